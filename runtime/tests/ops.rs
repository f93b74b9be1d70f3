//! The op families of `nitro::ops` (convolution, windows, indexing, shape, element-wise
//! additions): every VJP against central finite differences in f64 on the interpreter, the
//! interpreter against XLA on the same graphs (forward and gradient programs), and trace-time
//! errors that name the op, the shapes and the user's line.
//!
//! Finite differences: step 1e-6, tolerance |analytic − numeric| ≤ 1e-6 + 1e-6·|numeric| (as
//! `autodiff.rs`). XLA against the interpreter: f32 within 1e-5 relative + 1e-6 absolute, f64
//! within 1e-12 relative, integers exact.
#![allow(missing_docs)]

mod common;

use common::xla_or_skip;

use nitro::backend::Backend;
use nitro::emit;
use nitro::trace::{
    self, grad, Conv, ConvDims, GatherDims, ScatterDims, ScatterKind, Tensor, Window,
};
use nitro::{Array, ArrayData, DType, Error, LeafType};

// ---- inputs ------------------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn f64s(seed: u64, dims: &[usize], lo: f64, hi: f64) -> Array {
    let mut r = Rng(seed);
    let n = dims.iter().product();
    Array::from_vec(
        dims,
        (0..n)
            .map(|_| lo + (hi - lo) * r.unit())
            .collect::<Vec<f64>>(),
    )
    .unwrap()
}

/// Distinct values (a shuffled ramp, spaced 0.1 apart): no ties, for max/min windows.
fn distinct(seed: u64, dims: &[usize]) -> Array {
    let mut r = Rng(seed);
    let n: usize = dims.iter().product();
    let mut v: Vec<f64> = (0..n).map(|i| i as f64 * 0.1 - n as f64 * 0.05).collect();
    for i in (1..n).rev() {
        let j = (r.next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    Array::from_vec(dims, v).unwrap()
}

fn i32s(values: &[i32], dims: &[usize]) -> Array {
    Array::from_vec(dims, values.to_vec()).unwrap()
}

fn to_f32(a: &Array) -> Array {
    match a.data() {
        ArrayData::F64(v) => {
            Array::from_vec(a.dims(), v.iter().map(|&x| x as f32).collect::<Vec<f32>>()).unwrap()
        }
        _ => a.clone(),
    }
}

// ---- one case: an op over some inputs ----------------------------------------------------------

type Body = Box<dyn Fn(&[Tensor]) -> Tensor>;

struct Case {
    name: String,
    inputs: Vec<Array>,
    body: Body,
}

fn case(name: &str, inputs: Vec<Array>, body: impl Fn(&[Tensor]) -> Tensor + 'static) -> Case {
    Case {
        name: name.to_owned(),
        inputs,
        body: Box::new(body),
    }
}

fn types(inputs: &[Array]) -> Vec<(String, LeafType)> {
    inputs
        .iter()
        .enumerate()
        .map(|(i, a)| (format!("x{i}"), a.leaf_type()))
        .collect()
}

fn float_inputs(inputs: &[Array]) -> Vec<usize> {
    (0..inputs.len())
        .filter(|&i| inputs[i].dtype().is_float())
        .collect()
}

/// Σ w ⊙ out for a fixed random w: a scalar that sees every output element differently.
fn weigh(t: Tensor) -> Tensor {
    let dims = t.dims();
    let w = Tensor::constant(f64s(99, &dims, -1.0, 1.0)).convert(t.dtype());
    (t * w).sum_all()
}

fn value(c: &Case, inputs: &[Array]) -> f64 {
    let g = trace::trace(&types(inputs), |x| vec![weigh((c.body)(x))]).unwrap();
    nitro::backend::interp::run(&g, inputs).unwrap()[0]
        .as_slice::<f64>()
        .unwrap()[0]
}

/// The VJP of `c` against central differences, for every element of every float input.
fn check_grad(c: &Case) {
    let wrt = float_inputs(&c.inputs);
    let g = trace::trace(&types(&c.inputs), |x| {
        let xs: Vec<Tensor> = wrt.iter().map(|&i| x[i]).collect();
        grad(weigh((c.body)(x)), &xs)
    })
    .unwrap_or_else(|e| panic!("{}: {e}", c.name));
    let grads = nitro::backend::interp::run(&g, &c.inputs).unwrap();
    let h = 1e-6;
    for (k, &i) in wrt.iter().enumerate() {
        let analytic = grads[k].as_slice::<f64>().unwrap();
        for (e, &want) in analytic.iter().enumerate() {
            let mut plus = c.inputs.clone();
            plus[i].as_slice_mut::<f64>().unwrap()[e] += h;
            let mut minus = c.inputs.clone();
            minus[i].as_slice_mut::<f64>().unwrap()[e] -= h;
            let numeric = (value(c, &plus) - value(c, &minus)) / (2.0 * h);
            let err = (want - numeric).abs();
            assert!(
                err <= 1e-6 + 1e-6 * numeric.abs(),
                "{}: d/dx{i}[{e}]: analytic {} vs numeric {numeric} (error {err:e})",
                c.name,
                want
            );
        }
    }
}

// ---- XLA against the interpreter ----------------------------------------------------------------

fn close(a: &Array, b: &Array, what: &str, failures: &mut Vec<String>) {
    if a.leaf_type() != b.leaf_type() {
        failures.push(format!(
            "{what}: XLA gave {}, the interpreter {}",
            a.leaf_type(),
            b.leaf_type()
        ));
        return;
    }
    let pairs: Vec<(f64, f64, f64, f64)> = match (a.data(), b.data()) {
        (ArrayData::F32(x), ArrayData::F32(y)) => x
            .iter()
            .zip(y)
            .map(|(&p, &q)| (p as f64, q as f64, 1e-5, 1e-6))
            .collect(),
        (ArrayData::F64(x), ArrayData::F64(y)) => x
            .iter()
            .zip(y)
            .map(|(&p, &q)| (p, q, 1e-12, 1e-300))
            .collect(),
        _ => {
            if a != b {
                failures.push(format!("{what}: integer or bool results differ"));
            }
            return;
        }
    };
    for (i, (x, y, rel, abs)) in pairs.into_iter().enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= rel * y.abs() + abs;
        if !ok {
            failures.push(format!("{what}[{i}]: XLA {x:e}, interpreter {y:e}"));
            return;
        }
    }
}

/// Runs `c`'s forward program and, when it has float inputs, its gradient program, on both
/// backends in f32 (and f64 for the gradient), recording every mismatch.
fn check_xla(xla: &dyn Backend, c: &Case, failures: &mut Vec<String>) {
    for f64_run in [false, true] {
        let inputs: Vec<Array> = if f64_run {
            c.inputs.clone()
        } else {
            c.inputs.iter().map(to_f32).collect()
        };
        let wrt = float_inputs(&inputs);
        let graph = trace::trace(&types(&inputs), |x| {
            let y = (c.body)(x);
            let mut outs = vec![y];
            if !wrt.is_empty() && y.dtype().is_float() {
                let xs: Vec<Tensor> = wrt.iter().map(|&i| x[i]).collect();
                outs.extend(grad(weigh(y), &xs));
            }
            outs
        })
        .unwrap_or_else(|e| panic!("{}: {e}", c.name));
        let text = emit::emit(&graph);
        let want = nitro::backend::interp::run(&graph, &inputs)
            .unwrap_or_else(|e| panic!("{}: the interpreter failed: {e}", c.name));
        let refs: Vec<&Array> = inputs.iter().collect();
        let got = match xla.compile(&graph, &text).and_then(|exe| exe.run(&refs)) {
            Ok(g) => g,
            Err(e) => {
                failures.push(format!("{}: XLA failed: {e}\n{text}", c.name));
                continue;
            }
        };
        let tag = if f64_run { "f64" } else { "f32" };
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            close(g, w, &format!("{} ({tag}) output {k}", c.name), failures);
        }
    }
}

fn run_all(test: &str, cases: &[Case], grads: bool) {
    for c in cases {
        if grads && !float_inputs(&c.inputs).is_empty() {
            check_grad(c);
        }
    }
    let Some(xla) = xla_or_skip(test) else { return };
    let mut failures = Vec::new();
    for c in cases {
        check_xla(xla, c, &mut failures);
    }
    assert!(
        failures.is_empty(),
        "{test}: {} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!(
        "{test}: {} cases agree on the interpreter and XLA",
        cases.len()
    );
}

// ---- shape ---------------------------------------------------------------------------------------

#[test]
fn pad_and_reverse() {
    let cases = vec![
        case("pad low/high", vec![f64s(1, &[2, 3], -1.0, 1.0)], |x| {
            x[0].pad(0.5, &[1, 0], &[2, 1], &[0, 0])
        }),
        case("pad interior", vec![f64s(2, &[3, 2], -1.0, 1.0)], |x| {
            x[0].pad(0.0, &[0, 1], &[1, 0], &[2, 1])
        }),
        case("pad negative", vec![f64s(3, &[4, 5], -1.0, 1.0)], |x| {
            x[0].pad(0.0, &[-1, 2], &[1, -2], &[1, 0])
        }),
        case(
            "pad traced value",
            vec![f64s(4, &[2, 2], -1.0, 1.0), f64s(5, &[], -1.0, 1.0)],
            |x| x[0].pad(x[1], &[1, 1], &[1, 1], &[1, 1]),
        ),
        case("reverse", vec![f64s(6, &[2, 3, 4], -1.0, 1.0)], |x| {
            x[0].reverse(&[0, 2])
        }),
    ];
    run_all("pad_and_reverse", &cases, true);
}

// ---- convolution -------------------------------------------------------------------------------

fn conv_case(name: &str, x: &[usize], k: &[usize], conv: Conv, seed: u64) -> Case {
    case(
        name,
        vec![f64s(seed, x, -1.0, 1.0), f64s(seed + 1, k, -1.0, 1.0)],
        move |t| t[0].conv(t[1], &conv),
    )
}

fn conv_cases() -> Vec<Case> {
    let nhwc = Conv::channels_last(2);
    vec![
        conv_case(
            "conv nhwc same",
            &[2, 5, 5, 3],
            &[3, 3, 3, 4],
            nhwc.clone().same_for(&[5, 5], &[3, 3]),
            10,
        ),
        conv_case(
            "conv stride 2 same",
            &[1, 7, 6, 2],
            &[3, 3, 2, 3],
            nhwc.clone().strides(&[2, 2]).same_for(&[7, 6], &[3, 3]),
            12,
        ),
        conv_case(
            "conv valid odd",
            &[2, 7, 5, 2],
            &[3, 2, 2, 2],
            nhwc.clone(),
            14,
        ),
        conv_case(
            "conv stride 2 valid even",
            &[1, 6, 6, 1],
            &[2, 2, 1, 2],
            nhwc.clone().strides(&[2, 2]),
            16,
        ),
        conv_case(
            "conv rhs dilation",
            &[1, 7, 7, 2],
            &[3, 3, 2, 2],
            nhwc.clone()
                .rhs_dilation(&[2, 2])
                .padding(&[(1, 2), (2, 1)]),
            18,
        ),
        conv_case(
            "conv lhs dilation",
            &[1, 3, 4, 2],
            &[3, 3, 2, 2],
            nhwc.clone()
                .lhs_dilation(&[2, 2])
                .padding(&[(2, 2), (1, 2)]),
            20,
        ),
        conv_case(
            "conv groups 2",
            &[2, 4, 4, 4],
            &[3, 3, 2, 6],
            nhwc.clone().feature_groups(2).same_for(&[4, 4], &[3, 3]),
            22,
        ),
        conv_case(
            "conv depthwise",
            &[1, 5, 5, 3],
            &[3, 3, 1, 6],
            nhwc.clone().feature_groups(3).strides(&[2, 1]),
            24,
        ),
        conv_case(
            "conv nchw",
            &[2, 3, 5, 4],
            &[4, 3, 3, 2],
            Conv::new(ConvDims::channels_first(2)).padding(&[(1, 1), (0, 1)]),
            26,
        ),
        conv_case(
            "conv 1d",
            &[2, 9, 3],
            &[4, 3, 2],
            Conv::channels_last(1).strides(&[2]).padding(&[(1, 2)]),
            28,
        ),
        conv_case(
            "conv negative padding",
            &[1, 6, 6, 1],
            &[2, 2, 1, 1],
            nhwc.padding(&[(-1, 0), (0, -1)]),
            30,
        ),
    ]
}

#[test]
fn convolution() {
    run_all("convolution", &conv_cases(), true);
}

// ---- windows -----------------------------------------------------------------------------------

fn window_cases() -> Vec<Case> {
    vec![
        case("max 2x2/2", vec![distinct(40, &[1, 4, 6, 2])], |x| {
            x[0].window_max(&Window::new(&[1, 2, 2, 1]).strides(&[1, 2, 2, 1]))
        }),
        case("max 3x3/2 padded", vec![distinct(41, &[2, 5, 5, 1])], |x| {
            x[0].window_max(
                &Window::new(&[1, 3, 3, 1]).strides(&[1, 2, 2, 1]).padding(&[
                    (0, 0),
                    (1, 1),
                    (1, 1),
                    (0, 0),
                ]),
            )
        }),
        // Windows that tile the operand take a reshape-and-reduce path (forward and gradient):
        // with a remainder in no window, and tiling only after their padding.
        case("max 2x3/2x3 ragged", vec![distinct(48, &[2, 5, 7])], |x| {
            x[0].window_max(&Window::new(&[1, 2, 3]).strides(&[1, 2, 3]))
        }),
        case("min 2x2/2 padded", vec![distinct(49, &[3, 5])], |x| {
            x[0].window_min(
                &Window::new(&[2, 2])
                    .strides(&[2, 2])
                    .padding(&[(1, 0), (0, 1)]),
            )
        }),
        case("min odd", vec![distinct(42, &[3, 7])], |x| {
            x[0].window_min(&Window::new(&[2, 3]).strides(&[1, 2]))
        }),
        case(
            "sum 2x2/2 (avg pool)",
            vec![f64s(43, &[1, 4, 4, 3], -1.0, 1.0)],
            |x| x[0].window_sum(&Window::new(&[1, 2, 2, 1]).strides(&[1, 2, 2, 1])) / 4.0,
        ),
        case(
            "sum same stride 2",
            vec![f64s(44, &[5, 6], -1.0, 1.0)],
            |x| x[0].window_sum(&Window::new(&[3, 2]).strides(&[2, 2]).same_for(&[5, 6])),
        ),
        case(
            "sum window dilation",
            vec![f64s(45, &[7, 5], -1.0, 1.0)],
            |x| x[0].window_sum(&Window::new(&[2, 2]).window_dilation(&[2, 3])),
        ),
        case(
            "sum base dilation",
            vec![f64s(46, &[3, 4], -1.0, 1.0)],
            |x| x[0].window_sum(&Window::new(&[2, 3]).base_dilation(&[2, 1]).strides(&[1, 2])),
        ),
        case("cumsum", vec![f64s(47, &[3, 5], -1.0, 1.0)], |x| {
            x[0].cumsum(1)
        }),
    ]
}

#[test]
fn reduce_window_and_its_gradients() {
    run_all("reduce_window", &window_cases(), true);
}

#[test]
fn max_window_ties_give_the_first_maximum_the_whole_gradient() {
    // Every element equal: each 2x2 window's gradient goes to its top-left element only.
    let x = Array::from_vec(&[2, 4], vec![1.0f64; 8]).unwrap();
    let g = trace::trace(&types(std::slice::from_ref(&x)), |t| {
        grad(
            t[0].window_max(&Window::new(&[2, 2]).strides(&[2, 2]))
                .sum_all(),
            &[t[0]],
        )
    })
    .unwrap();
    let want = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    let got = nitro::backend::interp::run(&g, std::slice::from_ref(&x)).unwrap();
    assert_eq!(got[0].as_slice::<f64>().unwrap(), &want);
    if let Some(xla) = xla_or_skip("ties") {
        let exe = xla.compile(&g, &emit::emit(&g)).unwrap();
        let got = exe.run(&[&x]).unwrap();
        assert_eq!(got[0].as_slice::<f64>().unwrap(), &want, "XLA's tie rule");
    }
}

/// The gradient of `Σ window(x) ⊙ c` for a window of `k` taps, stride `k`, no padding, over a
/// rank-3 `x`, on the host: each window's cotangent to its first extremum in row-major window
/// order; elements in no window get 0.
fn tiled_reference(x: &[f32], dims: [usize; 3], k: [usize; 3], c: &[f32], max: bool) -> Vec<f32> {
    let o: Vec<usize> = (0..3).map(|d| dims[d] / k[d]).collect();
    let at = |i: usize, j: usize, l: usize| (i * dims[1] + j) * dims[2] + l;
    let mut g = vec![0.0f32; x.len()];
    for a in 0..o[0] {
        for b in 0..o[1] {
            for e in 0..o[2] {
                let mut best: Option<usize> = None;
                for i in a * k[0]..(a + 1) * k[0] {
                    for j in b * k[1]..(b + 1) * k[1] {
                        for l in e * k[2]..(e + 1) * k[2] {
                            let n = at(i, j, l);
                            let better = match best {
                                None => true,
                                Some(m) if max => x[n] > x[m],
                                Some(m) => x[n] < x[m],
                            };
                            if better {
                                best = Some(n);
                            }
                        }
                    }
                }
                g[best.unwrap()] += c[(a * o[1] + b) * o[2] + e];
            }
        }
    }
    g
}

#[test]
fn tiled_windows_send_each_gradient_to_the_first_extremum_on_both_backends() {
    // Values from {0, 1, 2}: most windows hold ties. 5 and 7 leave rows and columns in no
    // window; the cotangent is distinct per window, so a misrouted one shows.
    let dims = [5usize, 7, 4];
    let k = [2usize, 3, 1];
    let mut r = Rng(77);
    let x: Vec<f32> = (0..dims.iter().product::<usize>())
        .map(|_| (r.next() % 3) as f32)
        .collect();
    let out = [dims[0] / k[0], dims[1] / k[1], dims[2] / k[2]];
    let c: Vec<f32> = (0..out.iter().product::<usize>())
        .map(|i| 1.0 + i as f32)
        .collect();
    let inputs = [
        Array::from_vec(&dims, x.clone()).unwrap(),
        Array::from_vec(&out, c.clone()).unwrap(),
    ];
    let xla = xla_or_skip("tiled window ties");
    for max in [true, false] {
        let want = tiled_reference(&x, dims, k, &c, max);
        let g = trace::trace(&types(&inputs), |t| {
            let w = Window::new(&k).strides(&k);
            let pooled = if max {
                t[0].window_max(&w)
            } else {
                t[0].window_min(&w)
            };
            grad((pooled * t[1]).sum_all(), &[t[0]])
        })
        .unwrap();
        let got = nitro::backend::interp::run(&g, &inputs).unwrap();
        assert_eq!(
            got[0].as_slice::<f32>().unwrap(),
            &want[..],
            "interpreter, max {max}"
        );
        if let Some(xla) = xla {
            let exe = xla.compile(&g, &emit::emit(&g)).unwrap();
            let got = exe.run(&[&inputs[0], &inputs[1]]).unwrap();
            assert_eq!(
                got[0].as_slice::<f32>().unwrap(),
                &want[..],
                "XLA, max {max}"
            );
        }
    }
}

// ---- indexing ----------------------------------------------------------------------------------

/// Scatter dims for whole rows: `[n, 1]` row indices into a matrix, one update row each.
fn rows_scatter() -> ScatterDims {
    ScatterDims {
        update_window_dims: vec![1],
        inserted_window_dims: vec![0],
        scatter_dims_to_operand_dims: vec![0],
        index_vector_dim: 1,
    }
}

fn index_cases() -> Vec<Case> {
    vec![
        case(
            "take axis 0 (embedding)",
            vec![
                f64s(50, &[6, 3], -1.0, 1.0),
                i32s(&[4, 0, 4, 5, 1, 2], &[2, 3]),
            ],
            |x| x[0].take(x[1], 0),
        ),
        case(
            "take axis 1",
            vec![f64s(51, &[2, 5, 3], -1.0, 1.0), i32s(&[3, 3, 0, 4], &[4])],
            |x| x[0].take(x[1], 1),
        ),
        case(
            "take out of range clamps",
            vec![f64s(52, &[4, 2], -1.0, 1.0), i32s(&[-3, 7, 2], &[3])],
            |x| x[0].take(x[1], 0),
        ),
        case(
            "take_along_axis",
            vec![
                f64s(53, &[3, 5], -1.0, 1.0),
                i32s(&[4, 0, 2, 2, 1, 3], &[3, 2]),
            ],
            |x| x[0].take_along_axis(x[1], 1),
        ),
        case(
            "take_along_axis rank 3",
            vec![
                f64s(54, &[2, 3, 4], -1.0, 1.0),
                i32s(&[2, 0, 1, 1, 0, 2, 1, 1], &[2, 1, 4]),
            ],
            |x| x[0].take_along_axis(x[1], 1),
        ),
        case(
            "scatter add repeated",
            vec![
                f64s(55, &[5, 2], -1.0, 1.0),
                i32s(&[1, 3, 1, 0], &[4, 1]),
                f64s(56, &[4, 2], -1.0, 1.0),
            ],
            |x| {
                let d = rows_scatter();
                x[0].scatter(x[1], x[2], &d, ScatterKind::Add)
            },
        ),
        case(
            "scatter add out of range skips",
            vec![
                f64s(57, &[4, 2], -1.0, 1.0),
                i32s(&[-1, 2, 4], &[3, 1]),
                f64s(58, &[3, 2], -1.0, 1.0),
            ],
            |x| {
                let d = rows_scatter();
                x[0].scatter(x[1], x[2], &d, ScatterKind::Add)
            },
        ),
        case(
            "scatter replace",
            vec![
                f64s(59, &[5, 3], -1.0, 1.0),
                i32s(&[4, 0], &[2, 1]),
                f64s(60, &[2, 3], -1.0, 1.0),
            ],
            |x| {
                let d = rows_scatter();
                x[0].scatter(x[1], x[2], &d, ScatterKind::Replace)
            },
        ),
        case(
            "gather 2-d windows",
            vec![
                f64s(61, &[5, 6], -1.0, 1.0),
                i32s(&[0, 1, 3, 4, 2, 2], &[3, 2]),
            ],
            |x| {
                let d = GatherDims {
                    offset_dims: vec![1, 2],
                    collapsed_slice_dims: vec![],
                    start_index_map: vec![0, 1],
                    index_vector_dim: 1,
                    slice_sizes: vec![2, 3],
                };
                x[0].gather(x[1], &d)
            },
        ),
        case(
            "dynamic_slice",
            vec![
                f64s(62, &[5, 6], -1.0, 1.0),
                i32s(&[1], &[]),
                i32s(&[2], &[]),
            ],
            |x| x[0].dynamic_slice(&[x[1], x[2]], &[3, 2]),
        ),
        case(
            "dynamic_slice clamped",
            vec![
                f64s(63, &[5, 6], -1.0, 1.0),
                i32s(&[4], &[]),
                i32s(&[-2], &[]),
            ],
            |x| x[0].dynamic_slice(&[x[1], x[2]], &[3, 2]),
        ),
        case(
            "dynamic_update_slice",
            vec![
                f64s(64, &[4, 5], -1.0, 1.0),
                f64s(65, &[2, 3], -1.0, 1.0),
                i32s(&[1], &[]),
                i32s(&[2], &[]),
            ],
            |x| x[0].dynamic_update_slice(x[1], &[x[2], x[3]]),
        ),
        case(
            "dynamic_update_slice clamped",
            vec![
                f64s(66, &[4, 5], -1.0, 1.0),
                f64s(67, &[2, 3], -1.0, 1.0),
                i32s(&[9], &[]),
                i32s(&[-1], &[]),
            ],
            |x| x[0].dynamic_update_slice(x[1], &[x[2], x[3]]),
        ),
    ]
}

#[test]
fn gather_scatter_and_dynamic_slices() {
    run_all("indexing", &index_cases(), true);
}

// ---- element-wise ------------------------------------------------------------------------------

fn elementwise_cases() -> Vec<Case> {
    vec![
        case("sin", vec![f64s(70, &[7], -3.0, 3.0)], |x| x[0].sin()),
        case("cos", vec![f64s(71, &[7], -3.0, 3.0)], |x| x[0].cos()),
        case("erf", vec![f64s(72, &[9], -3.0, 3.0)], |x| x[0].erf()),
        case("erf_inv", vec![f64s(73, &[9], -0.95, 0.95)], |x| {
            x[0].erf_inv()
        }),
        case("log1p", vec![f64s(74, &[7], -0.5, 2.0)], |x| x[0].log1p()),
        case("expm1", vec![f64s(75, &[7], -2.0, 2.0)], |x| x[0].expm1()),
        case(
            "atan2",
            vec![f64s(76, &[6], -2.0, 2.0), f64s(77, &[6], -2.0, 2.0)],
            |x| x[0].atan2(x[1]),
        ),
        case(
            "rem",
            vec![f64s(78, &[6], -5.0, 5.0), f64s(79, &[6], 0.7, 1.9)],
            |x| x[0] % x[1],
        ),
        case("clamp", vec![f64s(80, &[8], -2.0, 2.0)], |x| {
            Tensor::clamp(-0.5, x[0], 1.0)
        }),
        case(
            "clamp tensors",
            vec![
                f64s(81, &[3], -1.0, -0.2),
                f64s(82, &[2, 3], -2.0, 2.0),
                f64s(83, &[3], 0.2, 1.0),
            ],
            |x| Tensor::clamp(x[0], x[1], x[2]),
        ),
        case("gelu exact", vec![f64s(84, &[6], -3.0, 3.0)], |x| {
            x[0] * ((x[0] / 2f64.sqrt()).erf() + 1.0) * 0.5
        }),
    ]
}

#[test]
fn elementwise_functions() {
    run_all("elementwise", &elementwise_cases(), true);
}

#[test]
fn rounding_sign_and_bit_ops() {
    let halves =
        Array::from_vec(&[8], vec![-2.5f32, -1.5, -0.5, 0.5, 1.5, 2.5, -0.0, 3.7]).unwrap();
    let bits = Array::from_vec(
        &[6],
        vec![0u32, 1, 0x8000_0000, 0xFFFF_FFFF, 12345, 0xDEAD_BEEF],
    )
    .unwrap();
    let shifts = Array::from_vec(&[6], vec![0u32, 1, 31, 32, 33, 4]).unwrap();
    let ints = Array::from_vec(&[6], vec![-7i32, -1, 0, 1, 7, i32::MIN]).unwrap();
    let cases = vec![
        case("floor", vec![halves.clone()], |x| x[0].floor()),
        case("ceil", vec![halves.clone()], |x| x[0].ceil()),
        case("round_nearest_even", vec![halves.clone()], |x| {
            x[0].round_nearest_even()
        }),
        case("sign f32", vec![halves.clone()], |x| x[0].sign()),
        case("sign i32", vec![ints.clone()], |x| x[0].sign()),
        case("and", vec![bits.clone(), shifts.clone()], |x| {
            x[0].and(x[1])
        }),
        case("or", vec![bits.clone(), shifts.clone()], |x| x[0].or(x[1])),
        case("xor", vec![bits.clone(), shifts.clone()], |x| {
            x[0].xor(x[1])
        }),
        case("not", vec![bits.clone()], |x| !x[0]),
        case("popcnt", vec![bits.clone()], |x| x[0].popcnt()),
        case("shift_left", vec![bits.clone(), shifts.clone()], |x| {
            x[0].shift_left(x[1])
        }),
        case(
            "shift_right_logical",
            vec![bits.clone(), shifts.clone()],
            |x| x[0].shift_right_logical(x[1]),
        ),
        case(
            "shift_right_arithmetic i32",
            vec![
                ints.clone(),
                Array::from_vec(&[6], vec![1i32, 0, 3, 31, 32, 40]).unwrap(),
            ],
            |x| x[0].shift_right_arithmetic(x[1]),
        ),
        case(
            "rem i32",
            vec![
                ints.clone(),
                Array::from_vec(&[6], vec![3i32, 2, 5, 0, -2, -1]).unwrap(),
            ],
            |x| x[0] % x[1],
        ),
        case("bitcast f32 -> u32", vec![halves.clone()], |x| {
            x[0].bitcast_convert(DType::U32)
        }),
        case("bitcast u32 -> f32", vec![bits.clone()], |x| {
            x[0].bitcast_convert(DType::F32)
        }),
    ];
    // Known values on the interpreter, then the same graphs on XLA.
    let run = |c: &Case| {
        let g = trace::trace(&types(&c.inputs), |x| vec![(c.body)(x)]).unwrap();
        nitro::backend::interp::run(&g, &c.inputs)
            .unwrap()
            .remove(0)
    };
    assert_eq!(
        run(&cases[2]).as_slice::<f32>().unwrap(),
        &[-2.0, -2.0, -0.0, 0.0, 2.0, 2.0, -0.0, 4.0]
    );
    assert_eq!(
        run(&cases[10]).as_slice::<u32>().unwrap(),
        &[0, 2, 0, 0, 0, 0xEADB_EEF0]
    );
    assert_eq!(
        run(&cases[11]).as_slice::<u32>().unwrap(),
        &[0, 0, 1, 0, 0, 0x0DEA_DBEE]
    );
    assert_eq!(
        run(&cases[12]).as_slice::<i32>().unwrap(),
        &[-4, -1, 0, 0, 0, -1]
    );
    assert_eq!(
        run(&cases[13]).as_slice::<i32>().unwrap(),
        &[-1, -1, 0, 1, 1, 0]
    );
    assert_eq!(
        run(&cases[9]).as_slice::<u32>().unwrap(),
        &[0, 1, 1, 32, 6, 24]
    );
    run_all("bits", &cases, false);
}

// ---- trace-time errors -------------------------------------------------------------------------

fn trace_error(inputs: &[LeafType], body: impl FnOnce(&[Tensor]) -> Vec<Tensor>) -> String {
    let named = common::named_inputs(inputs);
    match trace::trace(&named, body) {
        Err(e @ Error::Trace(_)) => e.to_string(),
        other => panic!("expected a trace error, got {other:?}"),
    }
}

fn ty(dtype: DType, dims: &[usize]) -> LeafType {
    LeafType {
        dtype,
        dims: dims.to_vec(),
    }
}

#[test]
fn bad_attributes_are_trace_errors_naming_the_op_the_shapes_and_the_line() {
    let mut line = 0;
    let e = trace_error(
        &[ty(DType::F32, &[1, 8, 8, 3]), ty(DType::F32, &[3, 3, 4, 8])],
        |x| {
            let conv = Conv::channels_last(2);
            line = line!() + 1;
            vec![x[0].conv(x[1], &conv)]
        },
    );
    assert!(
        e.contains("`conv`")
            && e.contains("f32[1,8,8,3]")
            && e.contains("has 3 channels")
            && e.contains("takes 4"),
        "{e}"
    );
    assert!(e.contains(&format!("{}:{line}:", file!())), "{e}");

    let e = trace_error(
        &[ty(DType::F32, &[1, 2, 2, 1]), ty(DType::F32, &[3, 3, 1, 1])],
        |x| vec![x[0].conv(x[1], &Conv::channels_last(2))],
    );
    assert!(e.contains("larger than the padded input"), "{e}");

    let e = trace_error(&[ty(DType::F32, &[4, 4])], |x| {
        vec![x[0].window_max(&Window::new(&[5, 1]))]
    });
    assert!(
        e.contains("`window_max`")
            && e.contains("larger than the padded operand")
            && e.contains("f32[4,4]"),
        "{e}"
    );

    let e = trace_error(&[ty(DType::F32, &[10, 4]), ty(DType::F32, &[3])], |x| {
        vec![x[0].take(x[1], 0)]
    });
    assert!(
        e.contains("`take`") && e.contains("indices must be integers") && e.contains("f32[3]"),
        "{e}"
    );

    let e = trace_error(&[ty(DType::F32, &[5, 5]), ty(DType::I32, &[])], |x| {
        vec![x[0].dynamic_slice(&[x[1]], &[2, 2])]
    });
    assert!(
        e.contains("`dynamic_slice`") && e.contains("1 start indices given for f32[5,5]"),
        "{e}"
    );

    let e = trace_error(&[ty(DType::F32, &[3])], |x| vec![x[0].shift_left(x[0])]);
    assert!(e.contains("`shift_left` needs integer tensors"), "{e}");

    let e = trace_error(&[ty(DType::I32, &[3])], |x| vec![x[0].erf()]);
    assert!(e.contains("`erf` needs a float tensor, got i32[3]"), "{e}");

    let e = trace_error(&[ty(DType::F32, &[3])], |x| {
        vec![x[0].pad(0.0, &[-2], &[-2], &[0])]
    });
    assert!(e.contains("`pad`") && e.contains("-1 elements"), "{e}");

    let e = trace_error(&[ty(DType::F64, &[2, 3])], |x| {
        vec![x[0].bitcast_convert(DType::U32)]
    });
    assert!(
        e.contains("`bitcast_convert`") && e.contains("one width"),
        "{e}"
    );

    let mut line = 0;
    let e = trace_error(&[ty(DType::U32, &[3])], |x| {
        line = line!() + 1;
        vec![trace::random::uniform(x[0], &[4], DType::F32, 0.0, 1.0)]
    });
    assert!(
        e.contains("`random_bits`") && e.contains("a key must be u32[2]") && e.contains("u32[3]"),
        "{e}"
    );
    assert!(
        e.contains(&format!("{}:{line}:", file!())),
        "the user's line: {e}"
    );

    let e = trace_error(&[ty(DType::I32, &[2])], |x| {
        vec![trace::random::split(x[0], 2)]
    });
    assert!(e.contains("`split`") && e.contains("got i32[2]"), "{e}");
}

// ---- random configurations ------------------------------------------------------------------

/// A seeded random convolution: rank 1 or 2, odd and even sizes, strides 1–2, padding from
/// cropping to SAME, both dilations, 1–2 feature groups; `None` when the draw does not fit (the
/// window larger than the padded input).
fn random_conv(seed: u64) -> Option<Case> {
    let mut r = Rng(seed);
    let mut pick = |n: u64| (r.next() % n) as usize;
    let spatial = 1 + pick(2);
    let groups = 1 + pick(2);
    let (batch, per_in, out) = (1 + pick(2), 1 + pick(2), groups * (1 + pick(2)));
    let sizes: Vec<usize> = (0..spatial).map(|_| 3 + pick(5)).collect();
    let taps: Vec<usize> = (0..spatial).map(|_| 1 + pick(3)).collect();
    let strides: Vec<usize> = (0..spatial).map(|_| 1 + pick(2)).collect();
    let lhs_dil: Vec<usize> = (0..spatial).map(|_| 1 + pick(2)).collect();
    let rhs_dil: Vec<usize> = (0..spatial).map(|_| 1 + pick(2)).collect();
    let padding: Vec<(i64, i64)> = (0..spatial)
        .map(|_| (pick(4) as i64 - 1, pick(4) as i64 - 1))
        .collect();
    let mut x = vec![batch];
    x.extend(&sizes);
    x.push(per_in * groups);
    let mut k = taps.clone();
    k.extend([per_in, out]);
    let conv = Conv::channels_last(spatial)
        .strides(&strides)
        .padding(&padding)
        .lhs_dilation(&lhs_dil)
        .rhs_dilation(&rhs_dil)
        .feature_groups(groups);
    let fits = (0..spatial).all(|d| {
        let padded = ((sizes[d] - 1) * lhs_dil[d] + 1) as i64 + padding[d].0 + padding[d].1;
        padded >= ((taps[d] - 1) * rhs_dil[d] + 1) as i64
    });
    fits.then(|| {
        conv_case(
            &format!("random conv {seed}: x {x:?} k {k:?} {conv:?}"),
            &x,
            &k,
            conv,
            seed * 3,
        )
    })
}

#[test]
fn random_convolutions() {
    let cases: Vec<Case> = (1..200).filter_map(random_conv).take(16).collect();
    assert_eq!(cases.len(), 16);
    run_all("random convolutions", &cases, true);
}

/// A seeded random window over a rank-2 or rank-3 operand (tie-free values for max/min).
fn random_window(seed: u64) -> Option<Case> {
    let mut r = Rng(seed);
    let mut pick = |n: u64| (r.next() % n) as usize;
    let rank = 2 + pick(2);
    let dims: Vec<usize> = (0..rank).map(|_| 2 + pick(5)).collect();
    let taps: Vec<usize> = (0..rank).map(|_| 1 + pick(3)).collect();
    let strides: Vec<usize> = (0..rank).map(|_| 1 + pick(2)).collect();
    let padding: Vec<(i64, i64)> = (0..rank)
        .map(|_| (pick(2) as i64, pick(2) as i64))
        .collect();
    let kind = pick(3);
    // Dilations only for sums: a max/min window's gradient needs none.
    let (base, wdil): (Vec<usize>, Vec<usize>) = if kind == 0 {
        (
            (0..rank).map(|_| 1 + pick(2)).collect(),
            (0..rank).map(|_| 1 + pick(2)).collect(),
        )
    } else {
        (vec![1; rank], vec![1; rank])
    };
    let w = Window::new(&taps)
        .strides(&strides)
        .padding(&padding)
        .base_dilation(&base)
        .window_dilation(&wdil);
    let fits = (0..rank).all(|d| {
        let padded = ((dims[d] - 1) * base[d] + 1) as i64 + padding[d].0 + padding[d].1;
        padded >= ((taps[d] - 1) * wdil[d] + 1) as i64
    });
    // A max/min window of padding alone is ±∞, whose neighbourhood finite differences cannot
    // probe: keep padding below the window on each side.
    let real = kind == 0 || (0..rank).all(|d| (padding[d].0.max(padding[d].1) as usize) < taps[d]);
    if !fits || !real {
        return None;
    }
    let name = format!("random window {seed} ({kind}): {dims:?} {w:?}");
    Some(match kind {
        0 => case(&name, vec![f64s(seed, &dims, -1.0, 1.0)], move |x| {
            x[0].window_sum(&w)
        }),
        1 => case(&name, vec![distinct(seed, &dims)], move |x| {
            x[0].window_max(&w)
        }),
        _ => case(&name, vec![distinct(seed, &dims)], move |x| {
            x[0].window_min(&w)
        }),
    })
}

#[test]
fn random_windows() {
    let cases: Vec<Case> = (1..200).filter_map(random_window).take(16).collect();
    assert_eq!(cases.len(), 16);
    run_all("random windows", &cases, true);
}

// ---- matmul forms (jnp.matmul's) ---------------------------------------------------------------

#[test]
fn matmul_takes_the_forms_users_write() {
    let cases = vec![
        case(
            "[b,t,k]·[k,n]",
            vec![
                f64s(90, &[2, 3, 4], -1.0, 1.0),
                f64s(91, &[4, 5], -1.0, 1.0),
            ],
            |x| x[0].matmul(x[1]),
        ),
        case(
            "[m,k]·[b,k,n]",
            vec![
                f64s(92, &[3, 4], -1.0, 1.0),
                f64s(93, &[2, 4, 5], -1.0, 1.0),
            ],
            |x| x[0].matmul(x[1]),
        ),
        case(
            "[k]·[b,k,n]",
            vec![f64s(94, &[4], -1.0, 1.0), f64s(95, &[2, 4, 5], -1.0, 1.0)],
            |x| x[0].matmul(x[1]),
        ),
        case(
            "[b,t,k]·[k]",
            vec![f64s(96, &[2, 3, 4], -1.0, 1.0), f64s(97, &[4], -1.0, 1.0)],
            |x| x[0].matmul(x[1]),
        ),
        case(
            "broadcast batches [2,1,3,4]·[5,4,2]",
            vec![
                f64s(98, &[2, 1, 3, 4], -1.0, 1.0),
                f64s(99, &[5, 4, 2], -1.0, 1.0),
            ],
            |x| x[0].matmul(x[1]),
        ),
    ];
    // The broadcast case against a direct computation.
    let (a, b) = (&cases[4].inputs[0], &cases[4].inputs[1]);
    let g = trace::trace(&types(&cases[4].inputs), |x| vec![x[0].matmul(x[1])]).unwrap();
    let out = nitro::backend::interp::run(&g, &[a.clone(), b.clone()])
        .unwrap()
        .remove(0);
    assert_eq!(out.dims(), &[2, 5, 3, 2]);
    let (av, bv, ov) = (
        a.as_slice::<f64>().unwrap(),
        b.as_slice::<f64>().unwrap(),
        out.as_slice::<f64>().unwrap(),
    );
    for i in 0..2 {
        for j in 0..5 {
            for m in 0..3 {
                for n in 0..2 {
                    let want: f64 = (0..4)
                        .map(|k| av[(i * 3 + m) * 4 + k] * bv[(j * 4 + k) * 2 + n])
                        .sum();
                    let got = ov[((i * 5 + j) * 3 + m) * 2 + n];
                    assert!(
                        (got - want).abs() < 1e-12,
                        "[{i},{j},{m},{n}]: {got} vs {want}"
                    );
                }
            }
        }
    }
    run_all("matmul forms", &cases, true);
    let e = trace_error(
        &[ty(DType::F32, &[2, 3, 4]), ty(DType::F32, &[5, 4, 2])],
        |x| vec![x[0].matmul(x[1])],
    );
    assert!(e.contains("batch dims [2] and [5] do not broadcast"), "{e}");
}

#[test]
fn narrow_split_and_chunk_cut_one_axis() {
    let x = f64s(100, &[2, 7, 3], -1.0, 1.0);
    let g = trace::trace(&types(std::slice::from_ref(&x)), |t| {
        let mut out = vec![t[0].narrow(1, 2, 3)];
        out.extend(t[0].split(1, &[1, 4, 2]));
        out.extend(t[0].chunk(1, 3));
        out
    })
    .unwrap();
    let out = nitro::backend::interp::run(&g, std::slice::from_ref(&x)).unwrap();
    let dims: Vec<Vec<usize>> = out.iter().map(|a| a.dims().to_vec()).collect();
    assert_eq!(
        dims,
        [
            [2, 3, 3],
            [2, 1, 3],
            [2, 4, 3],
            [2, 2, 3],
            [2, 3, 3],
            [2, 3, 3],
            [2, 1, 3]
        ],
        "narrow; split 1+4+2; chunk of 7 in 3: 3+3+1"
    );
    let v = x.as_slice::<f64>().unwrap();
    // narrow(1, 2, 3)[1, 0, 2] is x[1, 2, 2].
    assert_eq!(out[0].as_slice::<f64>().unwrap()[9 + 2], v[21 + 2 * 3 + 2]);
    // The split pieces, joined, are x again.
    let joined = trace::trace(&types(std::slice::from_ref(&x)), |t| {
        vec![Tensor::concatenate(&t[0].split(1, &[1, 4, 2]), 1)]
    })
    .unwrap();
    assert_eq!(
        nitro::backend::interp::run(&joined, std::slice::from_ref(&x)).unwrap()[0],
        x
    );
    let e = trace_error(&[ty(DType::F32, &[2, 7])], |t| t[0].split(1, &[3, 3]));
    assert!(
        e.contains("`split`") && e.contains("[3, 3]") && e.contains("f32[2,7]"),
        "{e}"
    );
    let e = trace_error(&[ty(DType::F32, &[2, 7])], |t| vec![t[0].narrow(1, 5, 3)]);
    assert!(e.contains("`narrow`") && e.contains("5..8"), "{e}");
}

/// `and`, `or`, `xor` and `not` of bool tensors: the tracer accepts them, so the interpreter
/// runs them (it refused them before) — the truth tables, and XLA's the same.
#[test]
fn bool_logic_runs_on_the_interpreter_as_on_xla() {
    let p = Array::from_vec(&[4], vec![false, false, true, true]).unwrap();
    let q = Array::from_vec(&[4], vec![false, true, false, true]).unwrap();
    let g = trace::trace(&types(&[p.clone(), q.clone()]), |x| {
        vec![x[0].and(x[1]), x[0].or(x[1]), x[0].xor(x[1]), !x[0]]
    })
    .unwrap();
    let inputs = [p, q];
    let want: [&[bool]; 4] = [
        &[false, false, false, true],
        &[false, true, true, true],
        &[false, true, true, false],
        &[true, true, false, false],
    ];
    let got = nitro::backend::interp::run(&g, &inputs).unwrap();
    for (out, want) in got.iter().zip(want) {
        assert_eq!(out.as_slice::<bool>().unwrap(), want);
    }
    if let Some(xla) = xla_or_skip("bool_logic_runs_on_the_interpreter_as_on_xla") {
        let exe = xla.compile(&g, &emit::emit(&g)).unwrap();
        let refs: Vec<&Array> = inputs.iter().collect();
        assert_eq!(exe.run(&refs).unwrap(), got);
    }
}
