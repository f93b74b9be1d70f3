//! The layers over `scan`: `nn::Repeated` (a block stack with stacked parameters) against the
//! same stack unrolled and against `nn::stack` over per-layer parameters, and `nn::Lstm` over
//! time against its unrolled form and the equations computed directly; on the interpreter
//! (bit-equal forward values) and on XLA; and dropout drawing a mask per layer.
#![allow(missing_docs)]

mod common;

use common::xla_or_skip;
use nitro::init::Seed;
use nitro::nn::{self, Layer, Lstm, Repeated, TransformerBlock};
use nitro::prelude::*;
use nitro::trace::{grad, input, random, trace_with, Graph, Remat};
use nitro::tree::LeafPath;
use nitro::{emit, LeafType};

fn f32s(seed: u64, dims: &[usize]) -> Array {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect();
    Array::from_vec(dims, v).unwrap()
}

/// A program of `params` (each leaf an input) and `x`: `f`'s output, then the gradient of a
/// fixed weighting of it with respect to every leaf and to `x`.
fn program<P: Tree>(
    params: &P,
    x: &Array,
    f: impl Fn(&P::Mirror<Tensor>, Tensor) -> Tensor,
) -> (Graph, Vec<Array>) {
    let mut values = Vec::new();
    params.for_each_leaf("p", &mut |_, a| values.push(a.clone()));
    values.push(x.clone());
    let g = trace_with(|| {
        let mut leaves = Vec::new();
        let view = params.mirror(&mut LeafPath::root("p"), &mut |path, a| {
            let t = input(path.as_str(), a.leaf_type());
            leaves.push(t);
            t
        });
        let x = input("x", x.leaf_type());
        leaves.push(x);
        let y = f(&view, x);
        let w = Tensor::constant(f32s(99, &y.dims()));
        let mut out = vec![y];
        out.extend(grad((y * w).sum_all(), &leaves));
        out
    })
    .unwrap();
    (g, values)
}

fn run(g: &Graph, inputs: &[Array]) -> Vec<Array> {
    nitro::backend::interp::run(g, inputs).unwrap()
}

fn close(what: &str, got: &Array, want: &Array, tol: f32) {
    assert_eq!(got.leaf_type(), want.leaf_type(), "{what}");
    let (g, w) = (
        got.as_slice::<f32>().unwrap(),
        want.as_slice::<f32>().unwrap(),
    );
    for (i, (a, b)) in g.iter().zip(w).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what}[{i}]: {a} vs {b}"
        );
    }
}

/// The scanned form's program under each remat policy (`scanned`), run on `inputs`, against the
/// unrolled form's outputs `want`: the forward value bit-equal on the interpreter, gradients
/// within 1e-5, and on XLA everything within 1e-5.
fn agrees_with_unrolled(
    what: &str,
    inputs: &[Array],
    want: &[Array],
    scanned: impl Fn(Remat) -> Graph,
) {
    for remat in [Remat::Save, Remat::Recompute] {
        let g = scanned(remat);
        let got = run(&g, inputs);
        assert_eq!(
            got[0], want[0],
            "{what} ({remat:?}): forward differs from the unrolled form"
        );
        for (k, (a, b)) in got.iter().zip(want).enumerate().skip(1) {
            close(&format!("{what} ({remat:?}) gradient {k}"), a, b, 1e-5);
        }
        if let Some(xla) = xla_or_skip("agrees_with_unrolled") {
            let refs: Vec<&Array> = inputs.iter().collect();
            let out = xla
                .compile(&g, &emit::emit(&g))
                .unwrap()
                .run(&refs)
                .unwrap();
            for (k, (a, b)) in out.iter().zip(want).enumerate() {
                close(&format!("{what} ({remat:?}) XLA output {k}"), a, b, 1e-5);
            }
        }
    }
}

#[test]
fn a_scanned_block_stack_is_the_unrolled_stack_and_the_per_layer_stack() {
    let block = TransformerBlock::causal(16, 2).unwrap();
    let depth = 3;
    let x = f32s(1, &[2, 5, 16]);
    let scanned = Repeated::new(block, depth);
    let stacked = scanned.init(Seed(4));
    // The same weights per layer, as `init_stack` makes them for an unrolled `Vec`.
    let per_layer = nn::init_stack(&vec![block; depth], Seed(4));
    assert_eq!(
        scanned
            .stack_params(&per_layer)
            .unwrap()
            .fc1
            .w
            .as_slice::<f32>()
            .unwrap(),
        stacked.fc1.w.as_slice::<f32>().unwrap()
    );

    let (g_unrolled, inputs) = program(&stacked, &x, |p, x| scanned.unrolled(true).forward(p, x));
    let want = run(&g_unrolled, &inputs);
    let (g_vec, vec_inputs) = program(&per_layer, &x, |p, x| {
        nn::stack(&vec![block; depth], p, x, |h| h)
    });
    let vec_out = run(&g_vec, &vec_inputs);
    assert_eq!(
        vec_out[0], want[0],
        "the per-layer stack differs from the unrolled Repeated"
    );

    agrees_with_unrolled("the block stack", &inputs, &want, |remat| {
        let layer = scanned.remat(remat);
        program(&stacked, &x, |p, x| layer.forward(p, x)).0
    });
}

/// The LSTM's equations on the host, in f64: every step's hidden state `[batch, time, hidden]`.
fn lstm_reference(p: &nn::LstmParams, x: &Array, hidden: usize) -> Vec<f64> {
    let d = x.dims();
    let (b, t, i) = (d[0], d[1], d[2]);
    let xv = x.as_slice::<f32>().unwrap();
    let (wih, whh, bias) = (
        p.w_ih.as_slice::<f32>().unwrap(),
        p.w_hh.as_slice::<f32>().unwrap(),
        p.b.as_slice::<f32>().unwrap(),
    );
    let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
    let g4 = 4 * hidden;
    let mut out = vec![0.0; b * t * hidden];
    for n in 0..b {
        let (mut h, mut c) = (vec![0.0f64; hidden], vec![0.0f64; hidden]);
        for s in 0..t {
            let mut z: Vec<f64> = (0..g4).map(|k| bias[k] as f64).collect();
            for (k, zk) in z.iter_mut().enumerate() {
                for j in 0..i {
                    *zk += xv[(n * t + s) * i + j] as f64 * wih[j * g4 + k] as f64;
                }
                for (j, hj) in h.iter().enumerate() {
                    *zk += hj * whh[j * g4 + k] as f64;
                }
            }
            for u in 0..hidden {
                let (ig, fg, gg, og) = (z[u], z[hidden + u], z[2 * hidden + u], z[3 * hidden + u]);
                c[u] = sig(fg) * c[u] + sig(ig) * gg.tanh();
                h[u] = sig(og) * c[u].tanh();
                out[(n * t + s) * hidden + u] = h[u];
            }
        }
    }
    out
}

#[test]
fn an_lstm_over_time_is_its_unrolled_form_and_its_equations() {
    let lstm = Lstm::new(3, 4);
    let p = lstm.init(Seed(2));
    let x = f32s(5, &[2, 6, 3]);
    let (g_unrolled, inputs) = program(&p, &x, |v, x| lstm.unrolled(true).forward(v, x));
    let want = run(&g_unrolled, &inputs);
    let reference = lstm_reference(&p, &x, 4);
    for (k, (a, b)) in want[0]
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .zip(&reference)
        .enumerate()
    {
        assert!((*a as f64 - b).abs() < 1e-5, "h[{k}]: {a} vs {b}");
    }
    agrees_with_unrolled("the LSTM", &inputs, &want, |remat| {
        let layer = lstm.remat(remat);
        program(&p, &x, |v, x| layer.forward(v, x)).0
    });
}

/// A layer that is only dropout, at rate 1/2.
#[derive(Clone, Copy)]
struct Drop;

impl Layer for Drop {
    type Params = ();
    fn init(&self, _: Seed) {}
    fn forward(&self, _: &(), x: Tensor) -> Tensor {
        nn::dropout(x, 0.5)
    }
}

#[test]
fn each_repeated_layer_draws_its_own_dropout_mask_in_both_forms() {
    let dims = [64, 64];
    let forms = [false, true].map(|unrolled| {
        let g = trace_with(|| {
            let key = input(
                "key",
                LeafType {
                    dtype: DType::U32,
                    dims: vec![2],
                },
            );
            let x = Tensor::scalar(1.0, DType::F32).broadcast_to(&dims);
            let y = random::with_step_key(random::StepKey::Training(key), || {
                Repeated::new(Drop, 2).unrolled(unrolled).forward(&(), x)
            });
            vec![y]
        })
        .unwrap();
        let key = Array::from_vec(&[2], vec![7u32, 11]).unwrap();
        run(&g, &[key]).remove(0)
    });
    assert_eq!(
        forms[0], forms[1],
        "the scanned and unrolled stacks drew different masks"
    );
    let kept = forms[0]
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .filter(|&&v| v != 0.0)
        .count() as f64
        / 4096.0;
    // Two independent masks keep a quarter; one mask drawn twice would keep a half.
    assert!((kept - 0.25).abs() < 0.03, "kept {kept}");
}

#[test]
fn depth_remat_and_form_are_in_the_layers_content_hash() {
    use nitro::Digest;
    let block = TransformerBlock::causal(16, 2).unwrap();
    let of = |r: Repeated<TransformerBlock>| Digest::of(&r);
    let base = Repeated::new(block, 4);
    assert_eq!(of(base), of(Repeated::new(block, 4)));
    assert_ne!(of(base), of(Repeated::new(block, 8)));
    assert_ne!(of(base), of(base.remat(Remat::Recompute)));
    assert_ne!(of(base), of(base.unrolled(true)));
    let lstm = Lstm::new(3, 4);
    assert_ne!(Digest::of(&lstm), Digest::of(&lstm.remat(Remat::Recompute)));
    assert_ne!(Digest::of(&lstm), Digest::of(&lstm.unrolled(true)));
}
