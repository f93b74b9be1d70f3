//! The layer library (`nitro::nn`): each layer's forward against a direct computation on the
//! interpreter, its gradient against central finite differences in f64, the attention masks
//! (causal, key padding, fully masked rows finite), and stacking without hand-indexing.
#![allow(missing_docs)]

use nitro::init::Seed;
use nitro::nn::{self, Layer};
use nitro::prelude::*;
use nitro::trace::{self, grad};
use nitro::LeafType;

fn f64s(seed: u64, dims: &[usize]) -> Array {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n: usize = dims.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        })
        .collect();
    Array::from_vec(dims, v).unwrap()
}

fn types(inputs: &[Array]) -> Vec<(String, LeafType)> {
    inputs
        .iter()
        .enumerate()
        .map(|(i, a)| (format!("x{i}"), a.leaf_type()))
        .collect()
}

fn run(inputs: &[Array], f: impl Fn(&[Tensor]) -> Tensor) -> Array {
    let g = trace::trace(&types(inputs), |x| vec![f(x)]).unwrap();
    nitro::backend::interp::run(&g, inputs).unwrap().remove(0)
}

/// Σ w ⊙ f(x) for fixed weights, and its gradient against central differences on every element
/// of every input.
fn check_grad(name: &str, inputs: Vec<Array>, f: impl Fn(&[Tensor]) -> Tensor) {
    let weigh = |x: &[Tensor]| {
        let y = f(x);
        let w = Tensor::constant(f64s(777, &y.dims()));
        (y * w).sum_all()
    };
    let g = trace::trace(&types(&inputs), |x| grad(weigh(x), x)).unwrap();
    let grads = nitro::backend::interp::run(&g, &inputs).unwrap();
    let value = |ins: &[Array]| run(ins, weigh).as_slice::<f64>().unwrap()[0];
    let h = 1e-6;
    for (k, input) in inputs.iter().enumerate() {
        for e in 0..input.len() {
            let mut plus = inputs.clone();
            plus[k].as_slice_mut::<f64>().unwrap()[e] += h;
            let mut minus = inputs.clone();
            minus[k].as_slice_mut::<f64>().unwrap()[e] -= h;
            let numeric = (value(&plus) - value(&minus)) / (2.0 * h);
            let analytic = grads[k].as_slice::<f64>().unwrap()[e];
            assert!(
                (analytic - numeric).abs() <= 1e-6 + 1e-6 * numeric.abs(),
                "{name}: d/dx{k}[{e}] analytic {analytic} vs numeric {numeric}"
            );
        }
    }
}

#[test]
fn linear_on_a_sequence_is_x_w_plus_b() {
    let (x, w, b) = (f64s(1, &[2, 3, 4]), f64s(2, &[4, 5]), f64s(3, &[5]));
    let lin = nn::Linear::new(4, 5);
    let f = move |t: &[Tensor]| {
        lin.forward(
            &nn::LinearParamsMirror {
                w: t[1],
                b: Some(t[2]),
            },
            t[0],
        )
    };
    let out = run(&[x.clone(), w.clone(), b.clone()], f);
    assert_eq!(out.dims(), &[2, 3, 5]);
    let (xv, wv, bv, ov) = (
        x.as_slice::<f64>().unwrap(),
        w.as_slice::<f64>().unwrap(),
        b.as_slice::<f64>().unwrap(),
        out.as_slice::<f64>().unwrap(),
    );
    for r in 0..6 {
        for c in 0..5 {
            let want: f64 = (0..4).map(|k| xv[r * 4 + k] * wv[k * 5 + c]).sum::<f64>() + bv[c];
            assert!((ov[r * 5 + c] - want).abs() < 1e-12);
        }
    }
    check_grad("linear", vec![x, w, b], f);
    let p = lin.without_bias().init(Seed(1));
    assert!(p.b.is_none() && p.w.dims() == [4, 5]);
}

#[test]
fn conv2d_and_pooling() {
    let conv = nn::Conv2d::new(2, 3, (3, 3)).stride(2, 2);
    let (x, w, b) = (
        f64s(4, &[1, 5, 5, 2]),
        f64s(5, &[3, 3, 2, 3]),
        f64s(6, &[3]),
    );
    let c = conv.clone();
    let f = move |t: &[Tensor]| {
        c.forward(
            &nn::Conv2dParamsMirror {
                w: t[1],
                b: Some(t[2]),
            },
            t[0],
        )
    };
    assert_eq!(
        run(&[x.clone(), w.clone(), b.clone()], f.clone()).dims(),
        &[1, 3, 3, 3],
        "SAME, stride 2"
    );
    check_grad("conv2d", vec![x.clone(), w, b], f);
    let p = conv.init(Seed(3));
    assert_eq!(p.w.dims(), &[3, 3, 2, 3]);

    let avg = nn::avg_pool2d((2, 2), (2, 2));
    let y = run(std::slice::from_ref(&x), move |t| avg.forward(&(), t[0]));
    assert_eq!(y.dims(), &[1, 2, 2, 2]);
    let xv = x.as_slice::<f64>().unwrap();
    let at = |h: usize, w: usize, c: usize| xv[(h * 5 + w) * 2 + c];
    let want = (at(0, 0, 1) + at(0, 1, 1) + at(1, 0, 1) + at(1, 1, 1)) / 4.0;
    assert!(
        (y.as_slice::<f64>().unwrap()[1] - want).abs() < 1e-12,
        "the mean of the window"
    );
    let max = nn::max_pool2d((2, 2), (2, 2));
    let y = run(std::slice::from_ref(&x), move |t| max.forward(&(), t[0]));
    let want = at(0, 0, 0)
        .max(at(0, 1, 0))
        .max(at(1, 0, 0))
        .max(at(1, 1, 0));
    assert_eq!(y.as_slice::<f64>().unwrap()[0], want);
    check_grad("avg pool", vec![x], move |t| avg.forward(&(), t[0]));
}

#[test]
fn embedding_norms_and_activations() {
    let table = f64s(7, &[6, 3]);
    let ids = Array::from_vec(&[2, 2], vec![5i32, 0, 2, 5]).unwrap();
    let emb = nn::Embedding { vocab: 6, dim: 3 };
    let out = run(&[table.clone(), ids], move |t| {
        emb.forward(&nn::EmbeddingParamsMirror { table: t[0] }, t[1])
    });
    assert_eq!(out.dims(), &[2, 2, 3]);
    assert_eq!(
        &out.as_slice::<f64>().unwrap()[..3],
        &table.as_slice::<f64>().unwrap()[15..18]
    );

    let x = f64s(8, &[3, 5]);
    let ln = nn::LayerNorm::new(5);
    let (g, b) = (f64s(9, &[5]), f64s(10, &[5]));
    let f = move |t: &[Tensor]| {
        ln.forward(
            &nn::NormParamsMirror {
                gain: t[1],
                bias: Some(t[2]),
            },
            t[0],
        )
    };
    let ones = Array::from_vec(&[5], vec![1.0f64; 5]).unwrap();
    let zeros = Array::from_vec(&[5], vec![0.0f64; 5]).unwrap();
    let y = run(&[x.clone(), ones.clone(), zeros], f);
    for row in y.as_slice::<f64>().unwrap().chunks(5) {
        let mean = row.iter().sum::<f64>() / 5.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 5.0;
        assert!(
            mean.abs() < 1e-12 && (var - 1.0).abs() < 1e-4,
            "normalized: mean {mean}, var {var}"
        );
    }
    check_grad("layer norm", vec![x.clone(), g.clone(), b], f);
    let rms = nn::RmsNorm::new(5);
    let f = move |t: &[Tensor]| {
        rms.forward(
            &nn::NormParamsMirror {
                gain: t[1],
                bias: None,
            },
            t[0],
        )
    };
    let y = run(&[x.clone(), ones], f);
    let row = &x.as_slice::<f64>().unwrap()[..5];
    let rms_v = (row.iter().map(|v| v * v).sum::<f64>() / 5.0 + 1e-6).sqrt();
    assert!((y.as_slice::<f64>().unwrap()[0] - row[0] / rms_v).abs() < 1e-12);
    check_grad("rms norm", vec![x.clone(), g], f);

    let pts = Array::from_vec(&[4], vec![-2.0f64, -0.5, 0.0, 1.5]).unwrap();
    let ge = run(std::slice::from_ref(&pts), |t| nn::gelu(t[0]));
    let gt = run(std::slice::from_ref(&pts), |t| nn::gelu_tanh(t[0]));
    let si = run(std::slice::from_ref(&pts), |t| nn::silu(t[0]));
    for (i, &p) in pts.as_slice::<f64>().unwrap().iter().enumerate() {
        let exact = p * (1.0 + libm_erf(p / 2f64.sqrt())) / 2.0;
        assert!((ge.as_slice::<f64>().unwrap()[i] - exact).abs() < 1e-12);
        assert!(
            (gt.as_slice::<f64>().unwrap()[i] - exact).abs() < 1e-3,
            "tanh GELU approximates GELU"
        );
        assert!((si.as_slice::<f64>().unwrap()[i] - p / (1.0 + (-p).exp())).abs() < 1e-12);
    }
    check_grad("gelu", vec![x.clone()], |t| nn::gelu(t[0]));
    check_grad("silu", vec![x], |t| nn::silu(t[0]));
}

/// erf by its Taylor series (|x| < 2 here).
fn libm_erf(x: f64) -> f64 {
    let mut sum = 0.0;
    let mut term = x;
    for n in 0..60 {
        sum += term / (2 * n + 1) as f64;
        term *= -x * x / (n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

fn attention_inputs(seed: u64, d: usize) -> Vec<Array> {
    (0..8)
        .map(|i| {
            if i % 2 == 0 {
                f64s(seed + i, &[d, d])
            } else {
                f64s(seed + i, &[d])
            }
        })
        .collect()
}

fn params(t: &[Tensor]) -> nn::AttentionParamsMirror<Tensor> {
    let lin = |i: usize| nn::LinearParamsMirror {
        w: t[i],
        b: Some(t[i + 1]),
    };
    nn::AttentionParamsMirror {
        q: lin(1),
        k: lin(3),
        v: lin(5),
        o: lin(7),
    }
}

#[test]
fn attention_masks_and_gradients() {
    let (b, t, d) = (2, 4, 4);
    let mha = nn::MultiHeadAttention {
        dim: d,
        heads: 2,
        causal: true,
    };
    let x = f64s(20, &[b, t, d]);
    let mut inputs = vec![x.clone()];
    inputs.extend(attention_inputs(30, d));
    let f = move |t: &[Tensor]| mha.forward(&params(t), t[0]);
    let y = run(&inputs, f);
    // Causal: changing later positions leaves position 0 unchanged.
    let mut later = inputs.clone();
    for v in &mut later[0].as_slice_mut::<f64>().unwrap()[d..t * d] {
        *v += 0.5;
    }
    let y2 = run(&later, f);
    assert_eq!(
        &y.as_slice::<f64>().unwrap()[..d],
        &y2.as_slice::<f64>().unwrap()[..d],
        "position 0 sees only itself"
    );
    assert_ne!(
        &y.as_slice::<f64>().unwrap()[d..2 * d],
        &y2.as_slice::<f64>().unwrap()[d..2 * d]
    );
    check_grad("causal attention", inputs.clone(), f);

    // Key padding: a batch row whose every key is masked stays finite.
    let keep = Array::from_vec(
        &[b, t],
        vec![true, true, false, false, false, false, false, false],
    )
    .unwrap();
    let open = nn::MultiHeadAttention {
        causal: false,
        ..mha
    };
    let mut masked = inputs.clone();
    masked.push(keep);
    let y = run(&masked, move |t| {
        open.forward_masked(&params(t), t[0], Some(t[9]))
    });
    assert!(
        y.as_slice::<f64>().unwrap().iter().all(|v| v.is_finite()),
        "fully masked rows stay finite"
    );
    // Masked keys do not matter: changing the values of positions 2.. of batch 0 changes nothing.
    let mut changed = masked.clone();
    for v in &mut changed[0].as_slice_mut::<f64>().unwrap()[2 * d..t * d] {
        *v -= 0.7;
    }
    let y3 = run(&changed, move |t| {
        open.forward_masked(&params(t), t[0], Some(t[9]))
    });
    assert_eq!(
        &y.as_slice::<f64>().unwrap()[..2 * d],
        &y3.as_slice::<f64>().unwrap()[..2 * d],
        "padded keys are not attended to"
    );
}

#[test]
fn a_transformer_block_differentiates_and_stacks() {
    let block = nn::TransformerBlock::causal(4, 2).unwrap();
    let p = block.init(Seed(1));
    assert_eq!(
        (p.fc1.w.dims(), p.fc2.w.dims()),
        (&[4, 16][..], &[16, 4][..])
    );
    // Its gradient with respect to the input, through both halves.
    let params: Vec<Array> = {
        let mut v = Vec::new();
        p.for_each_leaf("", &mut |_, a| v.push(a.clone()));
        v
    };
    let to64 = |a: &Array| {
        Array::from_vec(
            a.dims(),
            a.as_slice::<f32>()
                .unwrap()
                .iter()
                .map(|&x| x as f64)
                .collect::<Vec<_>>(),
        )
        .unwrap()
    };
    let mut inputs = vec![f64s(40, &[1, 3, 4])];
    inputs.extend(params.iter().map(to64));
    let f = move |t: &[Tensor]| {
        let lin = |i: usize| nn::LinearParamsMirror {
            w: t[i],
            b: Some(t[i + 1]),
        };
        let m = nn::BlockParamsMirror {
            ln1: nn::NormParamsMirror {
                gain: t[1],
                bias: Some(t[2]),
            },
            attention: nn::AttentionParamsMirror {
                q: lin(3),
                k: lin(5),
                v: lin(7),
                o: lin(9),
            },
            ln2: nn::NormParamsMirror {
                gain: t[11],
                bias: Some(t[12]),
            },
            fc1: lin(13),
            fc2: lin(15),
        };
        block.forward(&m, t[0])
    };
    assert_eq!(run(&inputs, f).dims(), &[1, 3, 4]);
    check_grad(
        "transformer block (input)",
        vec![inputs[0].clone()],
        move |t| {
            let consts: Vec<Tensor> = params.iter().map(|a| Tensor::constant(to64(a))).collect();
            let all: Vec<Tensor> = std::iter::once(t[0]).chain(consts).collect();
            f(&all)
        },
    );
    // Stacking: init_stack seeds each layer differently, and stack runs them in order.
    let layers = vec![nn::Linear::new(3, 4), nn::Linear::new(4, 2)];
    let ps = nn::init_stack(&layers, Seed(9));
    assert_ne!(
        ps[0].w.as_slice::<f32>().unwrap()[..2],
        ps[1].w.as_slice::<f32>().unwrap()[..2]
    );
    let x = Array::from_vec(&[1, 3], vec![0.5f32, -1.0, 2.0]).unwrap();
    let types = vec![("x".to_string(), x.leaf_type())];
    let (w0, w1) = (ps[0].w.clone(), ps[1].w.clone());
    let g = trace::trace(&types, |t| {
        let mirrors = vec![
            nn::LinearParamsMirror {
                w: Tensor::constant(w0.clone()),
                b: None,
            },
            nn::LinearParamsMirror {
                w: Tensor::constant(w1.clone()),
                b: None,
            },
        ];
        vec![nn::stack(&layers, &mirrors, t[0], |h| h.tanh())]
    })
    .unwrap();
    let y = nitro::backend::interp::run(&g, std::slice::from_ref(&x))
        .unwrap()
        .remove(0);
    let (xv, a, c) = (
        x.as_slice::<f32>().unwrap(),
        w0.as_slice::<f32>().unwrap(),
        w1.as_slice::<f32>().unwrap(),
    );
    let h: Vec<f32> = (0..4)
        .map(|j| (0..3).map(|i| xv[i] * a[i * 4 + j]).sum::<f32>().tanh())
        .collect();
    let want: f32 = (0..4).map(|j| h[j] * c[j * 2]).sum();
    assert!(
        (y.as_slice::<f32>().unwrap()[0] - want).abs() < 1e-5,
        "the stack is layer 2 after tanh after layer 1"
    );
}
