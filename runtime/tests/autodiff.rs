//! Reverse-mode gradients against central finite differences, in f64 on random inputs.
//!
//! Tolerance: |analytic − numeric| ≤ 1e-6 + 1e-6·|numeric|, with step h = 1e-6. In f64 the
//! central difference has truncation error O(h²·f‴) ≈ 1e-12 and rounding error O(ε·|f|/h) ≈ 1e-10
//! for the magnitudes here, so a failure means a wrong rule, not noise. Inputs are drawn away
//! from the points where an op is not differentiable (ties, zero for `abs`, non-positive bases).
#![allow(missing_docs)]

use nitro::backend::interp;
use nitro::trace::{self, grad, nn, DotDims, Tensor};
use nitro::{Array, DType, LeafType};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn array(&mut self, dims: &[usize], lo: f64, hi: f64) -> Array {
        let n = dims.iter().product();
        Array::from_vec(
            dims,
            (0..n)
                .map(|_| lo + (hi - lo) * self.next())
                .collect::<Vec<f64>>(),
        )
        .unwrap()
    }
}

/// A fixed random weighting, so the scalar depends on every element differently.
fn weights(dims: &[usize]) -> Tensor {
    Tensor::constant(Rng(99).array(dims, -1.0, 1.0))
}

/// Σ w ⊙ t: a scalar that sees every element of `t`.
fn weigh(t: Tensor) -> Tensor {
    (t * weights(&t.dims())).sum_all()
}

type Scalar = fn(&[Tensor]) -> Tensor;

fn types(inputs: &[Array]) -> Vec<(String, LeafType)> {
    inputs
        .iter()
        .enumerate()
        .map(|(i, a)| (format!("x{i}"), a.leaf_type()))
        .collect()
}

fn value(f: Scalar, inputs: &[Array]) -> f64 {
    let g = trace::trace(&types(inputs), |x| vec![f(x)]).unwrap();
    interp::run(&g, inputs).unwrap()[0]
        .as_slice::<f64>()
        .unwrap()[0]
}

/// Checks d f / d inputs[k] at `coords` (all elements when `None`) for every input.
fn check(name: &str, f: Scalar, inputs: Vec<Array>, coords: Option<usize>) {
    let g =
        trace::trace(&types(&inputs), |x| grad(f(x), x)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let grads = interp::run(&g, &inputs).unwrap();
    let h = 1e-6;
    let mut rng = Rng(7);
    for (k, input) in inputs.iter().enumerate() {
        let analytic = grads[k].as_slice::<f64>().unwrap().to_vec();
        assert_eq!(
            grads[k].dims(),
            input.dims(),
            "{name}: gradient {k} has the wrong shape"
        );
        let n = input.len();
        let picks: Vec<usize> = match coords {
            Some(c) if c < n => (0..c)
                .map(|_| (rng.next() * n as f64) as usize % n)
                .collect(),
            _ => (0..n).collect(),
        };
        for i in picks {
            let mut plus = inputs.clone();
            plus[k].as_slice_mut::<f64>().unwrap()[i] += h;
            let mut minus = inputs.clone();
            minus[k].as_slice_mut::<f64>().unwrap()[i] -= h;
            let numeric = (value(f, &plus) - value(f, &minus)) / (2.0 * h);
            let err = (analytic[i] - numeric).abs();
            assert!(
                err <= 1e-6 + 1e-6 * numeric.abs(),
                "{name}: d/dx{k}[{i}] analytic {} vs numeric {numeric} (error {err:e})",
                analytic[i]
            );
        }
    }
}

fn r(seed: u64, dims: &[usize], lo: f64, hi: f64) -> Array {
    Rng(seed).array(dims, lo, hi)
}

#[test]
fn unary_ops() {
    check(
        "neg",
        |x| weigh(-x[0]),
        vec![r(1, &[2, 3], -2.0, 2.0)],
        None,
    );
    check(
        "exp",
        |x| weigh(x[0].exp()),
        vec![r(2, &[2, 3], -2.0, 2.0)],
        None,
    );
    check(
        "log",
        |x| weigh(x[0].log()),
        vec![r(3, &[2, 3], 0.5, 3.0)],
        None,
    );
    check(
        "tanh",
        |x| weigh(x[0].tanh()),
        vec![r(4, &[2, 3], -2.0, 2.0)],
        None,
    );
    check(
        "logistic",
        |x| weigh(x[0].logistic()),
        vec![r(5, &[2, 3], -3.0, 3.0)],
        None,
    );
    check(
        "sqrt",
        |x| weigh(x[0].sqrt()),
        vec![r(6, &[2, 3], 0.5, 3.0)],
        None,
    );
    check(
        "rsqrt",
        |x| weigh(x[0].rsqrt()),
        vec![r(7, &[2, 3], 0.5, 3.0)],
        None,
    );
    // Away from 0: draw magnitudes in [0.2, 2] with random signs.
    let mut a = r(8, &[2, 3], 0.2, 2.0);
    for (i, v) in a.as_slice_mut::<f64>().unwrap().iter_mut().enumerate() {
        if i % 2 == 0 {
            *v = -*v;
        }
    }
    check("abs", |x| weigh(x[0].abs()), vec![a], None);
    check(
        "relu",
        |x| weigh(x[0].relu()),
        vec![r(9, &[2, 3], -2.0, 2.0)],
        None,
    );
}

#[test]
fn binary_ops_with_broadcasting() {
    check(
        "add [2,3]+[3]",
        |x| weigh(x[0] + x[1]),
        vec![r(1, &[2, 3], -1.0, 1.0), r(2, &[3], -1.0, 1.0)],
        None,
    );
    check(
        "sub [2,3]-[2,1]",
        |x| weigh(x[0] - x[1]),
        vec![r(3, &[2, 3], -1.0, 1.0), r(4, &[2, 1], -1.0, 1.0)],
        None,
    );
    check(
        "mul [2,3]*[]",
        |x| weigh(x[0] * x[1]),
        vec![r(5, &[2, 3], -1.0, 1.0), r(6, &[], -1.0, 1.0)],
        None,
    );
    check(
        "div",
        |x| weigh(x[0] / x[1]),
        vec![r(7, &[2, 3], -1.0, 1.0), r(8, &[2, 3], 0.5, 2.0)],
        None,
    );
    check(
        "div by scalar const",
        |x| weigh(x[0] / 3.0),
        vec![r(9, &[4], -1.0, 1.0)],
        None,
    );
    check(
        "const minus",
        |x| weigh(1.0 - x[0]),
        vec![r(10, &[4], -1.0, 1.0)],
        None,
    );
    check(
        "pow",
        |x| weigh(x[0].pow(x[1])),
        vec![r(11, &[2, 3], 0.5, 2.0), r(12, &[3], -2.0, 2.0)],
        None,
    );
    check(
        "pow const",
        |x| weigh(x[0].pow(3.0)),
        vec![r(13, &[5], -2.0, 2.0)],
        None,
    );
    check(
        "maximum",
        |x| weigh(x[0].maximum(x[1])),
        vec![r(14, &[2, 3], -1.0, 1.0), r(15, &[3], -1.0, 1.0)],
        None,
    );
    check(
        "minimum",
        |x| weigh(x[0].minimum(x[1])),
        vec![r(16, &[2, 3], -1.0, 1.0), r(17, &[2, 1], -1.0, 1.0)],
        None,
    );
    check(
        "select",
        |x| weigh(Tensor::select(x[0].greater(x[1]), x[0] * 2.0, x[1].exp())),
        vec![r(18, &[2, 3], -1.0, 1.0), r(19, &[2, 3], -1.0, 1.0)],
        None,
    );
}

#[test]
fn shape_ops() {
    check(
        "reshape",
        |x| weigh(x[0].reshape(&[3, 2]).tanh()),
        vec![r(1, &[2, 3], -1.0, 1.0)],
        None,
    );
    check(
        "transpose",
        |x| weigh(x[0].transpose(&[2, 0, 1])),
        vec![r(2, &[2, 3, 4], -1.0, 1.0)],
        None,
    );
    check(
        "slice",
        |x| weigh(x[0].slice(&[1, 0], &[3, 2])),
        vec![r(3, &[3, 4], -1.0, 1.0)],
        None,
    );
    check(
        "strided slice",
        |x| weigh(x[0].slice_strided(&[0, 1], &[3, 4], &[2, 2])),
        vec![r(4, &[3, 4], -1.0, 1.0)],
        None,
    );
    check(
        "concatenate",
        |x| weigh(Tensor::concatenate(&[x[0], x[1], x[0]], 1)),
        vec![r(5, &[2, 2], -1.0, 1.0), r(6, &[2, 3], -1.0, 1.0)],
        None,
    );
    check(
        "broadcast_to",
        |x| weigh(x[0].broadcast_to(&[4, 2, 3])),
        vec![r(7, &[2, 1], -1.0, 1.0)],
        None,
    );
}

#[test]
fn products() {
    check(
        "matmul",
        |x| weigh(x[0].matmul(x[1])),
        vec![r(1, &[2, 3], -1.0, 1.0), r(2, &[3, 4], -1.0, 1.0)],
        None,
    );
    check(
        "vec·mat",
        |x| weigh(x[0].matmul(x[1])),
        vec![r(3, &[3], -1.0, 1.0), r(4, &[3, 4], -1.0, 1.0)],
        None,
    );
    check(
        "mat·vec",
        |x| weigh(x[0].matmul(x[1])),
        vec![r(5, &[2, 3], -1.0, 1.0), r(6, &[3], -1.0, 1.0)],
        None,
    );
    check(
        "batched",
        |x| weigh(x[0].matmul(x[1])),
        vec![r(7, &[2, 2, 3], -1.0, 1.0), r(8, &[2, 3, 2], -1.0, 1.0)],
        None,
    );
    check(
        "dot_general aᵀ·b with batch in the middle",
        |x| {
            let d = DotDims {
                lhs_batch: vec![1],
                rhs_batch: vec![0],
                lhs_contract: vec![0],
                rhs_contract: vec![2],
            };
            weigh(x[0].dot_general(x[1], d))
        },
        vec![r(9, &[3, 2, 4], -1.0, 1.0), r(10, &[2, 5, 3], -1.0, 1.0)],
        None,
    );
}

#[test]
fn reductions_over_each_axis() {
    for axes in [vec![0], vec![1], vec![2], vec![0, 2], vec![0, 1, 2]] {
        let input = || vec![r(1, &[2, 3, 4], -1.0, 1.0)];
        // `fn` pointers cannot capture `axes`, so each case is spelled out through a table.
        let cases: [(&str, Scalar); 5] = match axes.as_slice() {
            [0] => [
                ("sum0", |x| weigh(x[0].sum(&[0]))),
                ("max0", |x| weigh(x[0].max(&[0]))),
                ("min0", |x| weigh(x[0].min(&[0]))),
                ("mean0", |x| weigh(x[0].mean(&[0]))),
                ("sumk0", |x| weigh(x[0].sum_keep(&[0]))),
            ],
            [1] => [
                ("sum1", |x| weigh(x[0].sum(&[1]))),
                ("max1", |x| weigh(x[0].max(&[1]))),
                ("min1", |x| weigh(x[0].min(&[1]))),
                ("mean1", |x| weigh(x[0].mean(&[1]))),
                ("maxk1", |x| weigh(x[0].max_keep(&[1]))),
            ],
            [2] => [
                ("sum2", |x| weigh(x[0].sum(&[2]))),
                ("max2", |x| weigh(x[0].max(&[2]))),
                ("min2", |x| weigh(x[0].min(&[2]))),
                ("mean2", |x| weigh(x[0].mean(&[2]))),
                ("meank2", |x| weigh(x[0].mean_keep(&[2]))),
            ],
            [0, 2] => [
                ("sum02", |x| weigh(x[0].sum(&[0, 2]))),
                ("max02", |x| weigh(x[0].max(&[0, 2]))),
                ("min02", |x| weigh(x[0].min(&[0, 2]))),
                ("mean02", |x| weigh(x[0].mean(&[0, 2]))),
                ("sumk02", |x| weigh(x[0].sum_keep(&[0, 2]))),
            ],
            _ => [
                ("sum_all", |x| x[0].sum_all()),
                ("max_all", |x| x[0].max(&[0, 1, 2])),
                ("min_all", |x| x[0].min(&[0, 1, 2])),
                ("mean_all", |x| x[0].mean_all()),
                ("sq_all", |x| (x[0] * x[0]).sum_all()),
            ],
        };
        for (name, f) in cases {
            check(name, f, input(), None);
        }
    }
}

#[test]
fn compositions() {
    check(
        "log_softmax",
        |x| weigh(nn::log_softmax(x[0], 1)),
        vec![r(1, &[3, 4], -2.0, 2.0)],
        None,
    );
    check(
        "softmax",
        |x| weigh(nn::softmax(x[0], 0)),
        vec![r(2, &[3, 4], -2.0, 2.0)],
        None,
    );
    check(
        "softmax_cross_entropy",
        |x| {
            let labels = Tensor::constant(Array::from_vec(&[3], vec![2i32, 0, 3]).unwrap());
            nn::softmax_cross_entropy(x[0], labels).mean_all()
        },
        vec![r(3, &[3, 4], -2.0, 2.0)],
        None,
    );
    check(
        "mse",
        |x| nn::mse(x[0], x[1]).sum_all(),
        vec![r(4, &[3, 2], -1.0, 1.0), r(5, &[3, 2], -1.0, 1.0)],
        None,
    );
}

#[test]
fn inputs_the_output_does_not_depend_on_get_zeros() {
    let g = trace::trace(&types(&[r(1, &[2], 0.0, 1.0), r(2, &[3], 0.0, 1.0)]), |x| {
        grad(x[0].sum_all(), x)
    })
    .unwrap();
    let out = interp::run(&g, &[r(1, &[2], 0.0, 1.0), r(2, &[3], 0.0, 1.0)]).unwrap();
    assert_eq!(out[1].as_slice::<f64>().unwrap(), &[0.0; 3]);
    assert_eq!(out[0].as_slice::<f64>().unwrap(), &[1.0; 2]);
}

#[test]
fn stop_gradient_passes_the_value_and_no_gradient() {
    let x = r(1, &[2, 3], 0.0, 1.0);
    let g = trace::trace(&types(std::slice::from_ref(&x)), |t| {
        // d/dx [x·stop(x) + stop(x)²] = stop(x) = x, where without the stops it would be 4x.
        let s = t[0].stop_gradient();
        let y = (t[0] * s + s * s).sum_all();
        let mut out = grad(y, t);
        out.push(y);
        out
    })
    .unwrap();
    let out = interp::run(&g, std::slice::from_ref(&x)).unwrap();
    assert_eq!(out[0], x, "the gradient is stop(x) alone");
    let v: f64 = x
        .as_slice::<f64>()
        .unwrap()
        .iter()
        .map(|v| 2.0 * v * v)
        .sum();
    assert!(
        (out[1].as_slice::<f64>().unwrap()[0] - v).abs() < 1e-12,
        "the value is unchanged"
    );
}

/// log_softmax shifts by a maximum no gradient goes through (its gradient against finite
/// differences is checked in `compositions`): the backward pass adds no comparison, which
/// the gradient of a maximum would (every element against it).
#[test]
fn log_softmax_gradient_skips_the_maximum() {
    let x = [r(3, &[4, 5], -2.0, 2.0)];
    let compares = |with_grad: bool| {
        let g = trace::trace(&types(&x), |x| {
            let y = weigh(nn::log_softmax(x[0], 1));
            if with_grad {
                grad(y, x)
            } else {
                vec![y]
            }
        })
        .unwrap();
        g.nodes
            .iter()
            .filter(|n| matches!(n.op, trace::Op::Compare(_)))
            .count()
    };
    // The forward maximum spells out NaN propagation with comparisons of its own.
    assert_eq!(compares(true), compares(false));
}

#[test]
fn non_differentiable_paths_carry_no_gradient() {
    // argmax and comparisons are piecewise constant: no gradient flows through them.
    let g = trace::trace(&types(&[r(1, &[2, 3], 0.0, 1.0)]), |x| {
        let idx = x[0].argmax(1).convert(DType::F64);
        grad((idx * 3.0).sum_all() + x[0].sum_all(), x)
    })
    .unwrap();
    let out = interp::run(&g, &[r(1, &[2, 3], 0.0, 1.0)]).unwrap();
    assert_eq!(out[0].as_slice::<f64>().unwrap(), &[1.0; 6]);
}

#[test]
fn grad_errors_name_the_problem_and_the_line() {
    let err = trace::trace(&types(&[r(1, &[2], 0.0, 1.0)]), |x| grad(x[0] * 2.0, x)).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("float scalar") && msg.contains("f64[2]"),
        "{msg}"
    );
    assert!(
        msg.contains("autodiff.rs"),
        "the error names the caller's file: {msg}"
    );
    let ints = vec![(
        "n".to_owned(),
        LeafType {
            dtype: DType::I32,
            dims: vec![2],
        },
    )];
    let err = trace::trace(&ints, |x| grad(x[0].convert(DType::F32).sum_all(), x)).unwrap_err();
    assert!(
        err.to_string()
            .contains("only float tensors have gradients"),
        "{err}"
    );
}

/// Digits-sized MLP: 64 → 128 tanh → 10, mean softmax cross-entropy over a batch of 8.
fn mlp_loss(p: &[Tensor]) -> Tensor {
    let labels = Tensor::constant(Array::from_vec(&[8], vec![0i32, 3, 9, 1, 1, 7, 4, 2]).unwrap());
    let x = Tensor::constant(Rng(5).array(&[8, 64], 0.0, 1.0));
    let h = (x.matmul(p[0]) + p[1]).tanh();
    let logits = h.matmul(p[2]) + p[3];
    nn::softmax_cross_entropy(logits, labels).mean_all()
}

#[test]
fn mlp_gradient_matches_finite_differences() {
    let params = vec![
        r(11, &[64, 128], -0.2, 0.2),
        r(12, &[128], -0.1, 0.1),
        r(13, &[128, 10], -0.2, 0.2),
        r(14, &[10], -0.1, 0.1),
    ];
    // 40 random coordinates of each parameter tensor (all 10 of the last bias).
    check("mlp", mlp_loss, params, Some(40));
}

/// relu's derivative is 0 at 0 (as in JAX and PyTorch) and 1 above; a tie of `maximum` splits
/// its gradient evenly. A zero-initialised bias over blank input puts every pre-activation at
/// exactly 0, where the two rules differ: the Fashion-MNIST CNN's bias gradients were 28% off
/// JAX's before relu got its own rule. The value keeps NaN.
#[test]
fn relu_has_derivative_zero_at_zero_and_keeps_nan() {
    let x = Array::from_vec(&[5], vec![-1.0f64, -0.0, 0.0, 2.0, f64::NAN]).unwrap();
    let g = trace::trace(&types(std::slice::from_ref(&x)), |t| {
        let finite = Tensor::select(t[0].not_equal(t[0]), 0.0, t[0]);
        let mut out = grad(finite.relu().sum_all(), t);
        out.push(grad(finite.maximum(0.0).sum_all(), t)[0]);
        out.push(t[0].relu());
        out
    })
    .unwrap();
    let out = interp::run(&g, std::slice::from_ref(&x)).unwrap();
    assert_eq!(
        out[0].as_slice::<f64>().unwrap(),
        &[0.0, 0.0, 0.0, 1.0, 0.0]
    );
    // (The NaN position is replaced by a constant 0 before both: no gradient reaches it.)
    assert_eq!(
        out[1].as_slice::<f64>().unwrap(),
        &[0.0, 0.5, 0.5, 1.0, 0.0]
    );
    let v = out[2].as_slice::<f64>().unwrap();
    assert_eq!(&v[..4], &[0.0, 0.0, 0.0, 2.0]);
    assert!(v[4].is_nan(), "relu(NaN) is NaN: {v:?}");
}
