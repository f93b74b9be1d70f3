//! Differential tests: every op, and two whole programs, run on XLA (through the
//! [`nitro::backend::Backend`] trait) and on the reference interpreter, on random inputs, and
//! compared element by element.
//!
//! Each case is traced once, emitted once, compiled on XLA, and run on both backends with the
//! same inputs. Outputs must agree in dtype and dims, and in value within:
//!
//! - `f32`: |xla − interp| ≤ 1e-5·|interp| + 1e-6, for every group, transcendentals
//!   (`exp log tanh logistic sqrt rsqrt pow`), reductions and the MLP gradient included. XLA's
//!   CPU backend evaluates `exp`, `log`, `tanh` and `logistic` with its own polynomial/rational
//!   approximations (a few ulp, ≈ 1e-7 relative) and sums and dots in another order than the
//!   interpreter; both stay well inside this bound for the sizes used here (each group prints
//!   its largest error and its largest error/allowed ratio; run with `--nocapture`). The
//!   closest call is a 256-term dot product, whose summation-order error reaches about half the
//!   absolute floor where the result is near zero.
//! - `f64`: |xla − interp| ≤ 1e-12·|interp| + 1e-300 (relative only; the absolute floor just
//!   admits an exact zero). Inputs are drawn so that no result is a cancellation to near zero.
//! - integers and `bool`: exactly equal. A NaN must meet a NaN; infinities must be equal.
//!
//! Inputs avoid the points where the two backends may legitimately differ: no denormals (XLA's
//! CPU backend flushes them), no integer division by zero, no float-to-integer conversion out
//! of range or of NaN, no ties for `argmax` unless the test is about ties.
//!
//! The XLA side needs a PJRT plugin. Without one, each test still traces, emits and runs its
//! programs on the interpreter, then prints a `skip:` line; with `NITRO_REQUIRE_XLA=1` (or
//! `NITRO_BACKEND=xla`) a missing plugin fails the test instead, as in `tests/pjrt.rs`.
#![allow(missing_docs)]

use std::fmt::Write as _;

use nitro::backend::{self, pjrt, Backend};
use nitro::emit::{self, EmitOptions};
use nitro::trace::{self, grad, nn, DotDims, Tensor};
use nitro::{Array, ArrayData, DType, Error, LeafType};

// ---- inputs ------------------------------------------------------------------------------------

/// SplitMix64: deterministic random inputs.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    fn f32s(&mut self, dims: &[usize], lo: f64, hi: f64) -> Array {
        let n = dims.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.uniform(lo, hi) as f32).collect();
        Array::from_vec(dims, v).unwrap()
    }

    /// Values in `±[lo, hi]`, random sign: magnitudes bounded away from zero.
    fn f32s_signed(&mut self, dims: &[usize], lo: f64, hi: f64) -> Array {
        let n = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                let m = self.uniform(lo, hi) as f32;
                if self.unit() < 0.5 {
                    -m
                } else {
                    m
                }
            })
            .collect();
        Array::from_vec(dims, v).unwrap()
    }

    /// Multiples of 0.5 in `[-k, k]`: small sets, so comparisons see ties.
    fn f32s_coarse(&mut self, dims: &[usize], k: i64) -> Array {
        let n = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| ((self.next_u64() % (4 * k as u64 + 1)) as i64 - 2 * k) as f32 * 0.5)
            .collect();
        Array::from_vec(dims, v).unwrap()
    }

    fn f64s(&mut self, dims: &[usize], lo: f64, hi: f64) -> Array {
        let n = dims.iter().product();
        let v: Vec<f64> = (0..n).map(|_| self.uniform(lo, hi)).collect();
        Array::from_vec(dims, v).unwrap()
    }

    fn i32s(&mut self, dims: &[usize], lo: i64, hi: i64) -> Array {
        let n = dims.iter().product();
        let span = (hi - lo + 1) as u64;
        let v: Vec<i32> = (0..n)
            .map(|_| (lo + (self.next_u64() % span) as i64) as i32)
            .collect();
        Array::from_vec(dims, v).unwrap()
    }

    fn i64s(&mut self, dims: &[usize], lo: i64, hi: i64) -> Array {
        let n = dims.iter().product();
        let span = (hi as i128 - lo as i128 + 1) as u128;
        let v: Vec<i64> = (0..n)
            .map(|_| (lo as i128 + (self.next_u64() as u128 % span) as i128) as i64)
            .collect();
        Array::from_vec(dims, v).unwrap()
    }

    fn u8s(&mut self, dims: &[usize]) -> Array {
        let n = dims.iter().product();
        let v: Vec<u8> = (0..n).map(|_| self.next_u64() as u8).collect();
        Array::from_vec(dims, v).unwrap()
    }

    fn bools(&mut self, dims: &[usize]) -> Array {
        let n = dims.iter().product();
        let v: Vec<bool> = (0..n).map(|_| self.next_u64() & 1 == 1).collect();
        Array::from_vec(dims, v).unwrap()
    }
}

/// Integer `i32` values away from zero (`±[1, hi]`), for divisors.
fn nonzero_i32s(rng: &mut Rng, dims: &[usize], hi: i64) -> Array {
    let a = rng.i32s(dims, 1, hi);
    let v: Vec<i32> = a
        .as_slice::<i32>()
        .unwrap()
        .iter()
        .map(|&x| if rng.unit() < 0.5 { -x } else { x })
        .collect();
    Array::from_vec(dims, v).unwrap()
}

// ---- the XLA backend, or a skip ----------------------------------------------------------------

fn required() -> bool {
    std::env::var("NITRO_REQUIRE_XLA").is_ok_and(|v| v.trim() == "1")
        || std::env::var("NITRO_BACKEND").is_ok_and(|v| v.trim() == "xla")
}

/// The XLA backend, or `None` (after a `skip:` line) when no plugin is installed and none is
/// required.
fn xla_or_skip(test: &str) -> Option<&'static backend::Xla> {
    match backend::xla() {
        Ok(x) => Some(x),
        Err(e) => {
            let absent = match &e {
                Error::PjrtPluginNotFound { .. } => true,
                Error::BackendSetting { value, .. } => value == "interp",
                _ => false,
            };
            if required() || !absent {
                panic!("{test}: the XLA backend is required but unavailable: {e}");
            }
            println!("skip: {test}: no XLA to compare with ({e}); ran the interpreter only");
            None
        }
    }
}

// ---- comparison --------------------------------------------------------------------------------

/// Allowed error for floats: `|xla − interp| ≤ rel·|interp| + abs`. Integers are always exact.
#[derive(Clone, Copy, Debug)]
struct Tol {
    f32_rel: f64,
    f32_abs: f64,
    f64_rel: f64,
    f64_abs: f64,
}

/// The documented tolerances (see the crate docs above).
const TOL: Tol = Tol {
    f32_rel: 1e-5,
    f32_abs: 1e-6,
    f64_rel: 1e-12,
    f64_abs: 1e-300,
};

/// Largest errors seen in a group, per float type.
#[derive(Default, Debug)]
struct Worst {
    abs: f64,
    /// The largest relative error among elements where `rel·|interp| ≥ abs`.
    rel: f64,
    /// The largest `error / allowed` (≤ 1 passes).
    ratio: f64,
    at: String,
}

/// A group of cases sharing a tolerance: collects every failure, then reports them at once.
struct Group {
    name: &'static str,
    xla: Option<&'static backend::Xla>,
    tol: Tol,
    cases: usize,
    elements: usize,
    worst_f32: Worst,
    worst_f64: Worst,
    failures: Vec<String>,
}

impl Group {
    fn new(name: &'static str) -> Group {
        Group {
            name,
            xla: xla_or_skip(name),
            tol: TOL,
            cases: 0,
            elements: 0,
            worst_f32: Worst::default(),
            worst_f64: Worst::default(),
            failures: Vec::new(),
        }
    }

    /// Traces `body` on `inputs`' types, emits it, runs it on both backends and compares.
    /// Returns the interpreter's outputs.
    #[track_caller]
    fn check(
        &mut self,
        case: &str,
        inputs: &[&Array],
        body: impl FnOnce(&[Tensor]) -> Vec<Tensor>,
    ) -> Vec<Array> {
        let types: Vec<(String, LeafType)> = inputs
            .iter()
            .enumerate()
            .map(|(i, a)| (format!("x{i}"), a.leaf_type()))
            .collect();
        let graph = trace::trace(&types, body)
            .unwrap_or_else(|e| panic!("{}/{case}: trace failed: {e}", self.name));
        let text = emit::emit(&graph);
        let want = nitro::backend::interp::run_refs(&graph, inputs)
            .unwrap_or_else(|e| panic!("{}/{case}: the interpreter failed: {e}", self.name));
        self.cases += 1;
        let Some(xla) = self.xla else {
            return want;
        };
        let got = match xla.compile(&graph, &text).and_then(|exe| exe.run(inputs)) {
            Ok(got) => got,
            Err(e) => {
                self.failures
                    .push(format!("{case}: XLA failed: {e}\n--- program:\n{text}"));
                return want;
            }
        };
        self.compare(case, &got, &want);
        want
    }

    /// Compares XLA's outputs with the interpreter's, recording failures.
    fn compare(&mut self, case: &str, got: &[Array], want: &[Array]) {
        if got.len() != want.len() {
            self.failures.push(format!(
                "{case}: XLA returned {} outputs, the interpreter {}",
                got.len(),
                want.len()
            ));
            return;
        }
        for (k, (g, w)) in got.iter().zip(want).enumerate() {
            if g.leaf_type() != w.leaf_type() {
                self.failures.push(format!(
                    "{case}: output {k} is {} on XLA but {} on the interpreter",
                    g.leaf_type(),
                    w.leaf_type()
                ));
                continue;
            }
            self.elements += w.len();
            let mut bad = Vec::new();
            match (g.data(), w.data()) {
                (ArrayData::F32(a), ArrayData::F32(b)) => {
                    let it = a.iter().zip(b).map(|(&x, &y)| (x as f64, y as f64));
                    let (rel, abs) = (self.tol.f32_rel, self.tol.f32_abs);
                    floats(it, rel, abs, &mut self.worst_f32, case, k, &mut bad);
                }
                (ArrayData::F64(a), ArrayData::F64(b)) => {
                    let it = a.iter().zip(b).map(|(&x, &y)| (x, y));
                    let (rel, abs) = (self.tol.f64_rel, self.tol.f64_abs);
                    floats(it, rel, abs, &mut self.worst_f64, case, k, &mut bad);
                }
                (ArrayData::I32(a), ArrayData::I32(b)) => exact(a, b, &mut bad),
                (ArrayData::I64(a), ArrayData::I64(b)) => exact(a, b, &mut bad),
                (ArrayData::U8(a), ArrayData::U8(b)) => exact(a, b, &mut bad),
                (ArrayData::Bool(a), ArrayData::Bool(b)) => exact(a, b, &mut bad),
                _ => unreachable!("dtypes were compared above"),
            }
            let count = bad.len();
            for (i, x, y) in bad.into_iter().take(5) {
                self.failures.push(format!(
                    "{case}: output {k} ({}) element {i} {:?}: XLA {x}, interpreter {y}",
                    w.leaf_type(),
                    multi_index(i, w.dims()),
                ));
            }
            if count > 5 {
                self.failures.push(format!(
                    "{case}: output {k}: … and {} more elements differ",
                    count - 5
                ));
            }
        }
    }

    /// Prints the group's figures and fails with every mismatch.
    fn finish(self) {
        let mut line = format!(
            "{}: {} cases, {} elements compared",
            self.name, self.cases, self.elements
        );
        if self.xla.is_none() {
            line.push_str(" (interpreter only: no XLA)");
        }
        for (ty, w) in [("f32", &self.worst_f32), ("f64", &self.worst_f64)] {
            if w.at.is_empty() {
                continue;
            }
            let _ = write!(
                line,
                "; {ty} max abs err {:.3e}, max rel err {:.3e}, worst err/allowed {:.3} ({})",
                w.abs, w.rel, w.ratio, w.at
            );
        }
        println!("{line}");
        if !self.failures.is_empty() {
            panic!(
                "{}: {} mismatches between XLA and the interpreter:\n{}",
                self.name,
                self.failures.len(),
                self.failures.join("\n")
            );
        }
    }
}

fn multi_index(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for (slot, &d) in idx.iter_mut().zip(dims).rev() {
        if d > 0 {
            *slot = i % d;
            i /= d;
        }
    }
    idx
}

#[allow(clippy::too_many_arguments)]
fn floats(
    pairs: impl Iterator<Item = (f64, f64)>,
    rel: f64,
    abs: f64,
    worst: &mut Worst,
    case: &str,
    k: usize,
    bad: &mut Vec<(usize, String, String)>,
) {
    for (i, (x, y)) in pairs.enumerate() {
        let ok = if y.is_nan() || x.is_nan() {
            x.is_nan() && y.is_nan()
        } else if y.is_infinite() || x.is_infinite() {
            x == y
        } else {
            let err = (x - y).abs();
            let allowed = rel * y.abs() + abs;
            if err > worst.abs {
                worst.abs = err;
            }
            // Relative error where the relative term dominates the bound.
            if rel * y.abs() >= abs && err / y.abs() > worst.rel {
                worst.rel = err / y.abs();
            }
            if err / allowed > worst.ratio || worst.at.is_empty() {
                worst.ratio = worst.ratio.max(err / allowed);
                worst.at = format!("{case} out {k}[{i}]");
            }
            err <= allowed
        };
        if !ok {
            bad.push((i, format!("{x:e}"), format!("{y:e}")));
        }
    }
}

fn exact<T: PartialEq + std::fmt::Debug>(a: &[T], b: &[T], bad: &mut Vec<(usize, String, String)>) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x != y {
            bad.push((i, format!("{x:?}"), format!("{y:?}")));
        }
    }
}

fn dd(lb: &[usize], rb: &[usize], lc: &[usize], rc: &[usize]) -> DotDims {
    DotDims {
        lhs_batch: lb.to_vec(),
        rhs_batch: rb.to_vec(),
        lhs_contract: lc.to_vec(),
        rhs_contract: rc.to_vec(),
    }
}

// ---- element-wise ------------------------------------------------------------------------------

#[test]
fn unary_ops() {
    let mut g = Group::new("unary_ops");
    let mut rng = Rng(1);
    let d = [7, 13];
    let any = rng.f32s(&d, -4.0, 4.0);
    let wide = rng.f32s(&d, -20.0, 20.0);
    let pos = rng.f32s(&d, 0.01, 50.0);
    g.check("neg", &[&any], |x| vec![-x[0]]);
    g.check("abs", &[&any], |x| vec![x[0].abs()]);
    g.check("exp", &[&any], |x| vec![x[0].exp()]);
    g.check("exp wide", &[&wide], |x| vec![x[0].exp()]);
    g.check("log", &[&pos], |x| vec![x[0].log()]);
    g.check("tanh", &[&any], |x| vec![x[0].tanh()]);
    g.check("tanh wide", &[&wide], |x| vec![x[0].tanh()]);
    g.check("logistic", &[&any], |x| vec![x[0].logistic()]);
    g.check("logistic wide", &[&wide], |x| vec![x[0].logistic()]);
    g.check("sqrt", &[&pos], |x| vec![x[0].sqrt()]);
    g.check("rsqrt", &[&pos], |x| vec![x[0].rsqrt()]);
    g.check("relu", &[&any], |x| vec![x[0].relu()]);
    g.check("sigmoid (nn)", &[&any], |x| vec![nn::sigmoid(x[0])]);
    // Scalars and rank 3 take the same paths.
    g.check("exp scalar", &[&Array::scalar(0.75f32)], |x| {
        vec![x[0].exp()]
    });
    let r3 = rng.f32s(&[2, 3, 4], -3.0, 3.0);
    g.check("tanh rank 3", &[&r3], |x| vec![x[0].tanh()]);
    // Integer negate and abs.
    let ints = rng.i32s(&d, -1000, 1000);
    g.check("neg i32", &[&ints], |x| vec![-x[0]]);
    g.check("abs i32", &[&ints], |x| vec![x[0].abs()]);
    let longs = rng.i64s(&d, -(1 << 40), 1 << 40);
    g.check("neg i64", &[&longs], |x| vec![-x[0]]);
    g.check("abs i64", &[&longs], |x| vec![x[0].abs()]);
    g.finish();
}

/// Each binary op on `(lhs, rhs)` pairs of every broadcasting shape.
#[test]
fn binary_ops_broadcasting() {
    let mut g = Group::new("binary_ops_broadcasting");
    let mut rng = Rng(2);
    // (description, lhs dims, rhs dims)
    let shapes: [(&str, &[usize], &[usize]); 7] = [
        ("same", &[5, 6], &[5, 6]),
        ("scalar rhs", &[5, 6], &[]),
        ("scalar lhs", &[], &[5, 6]),
        ("row", &[5, 6], &[6]),
        ("column", &[5, 6], &[5, 1]),
        ("outer", &[5, 1], &[1, 6]),
        ("rank 3 vs row", &[2, 5, 6], &[6]),
    ];
    type Bin = fn(Tensor, Tensor) -> Tensor;
    let ops: [(&str, Bin); 7] = [
        ("add", |a, b| a + b),
        ("sub", |a, b| a - b),
        ("mul", |a, b| a * b),
        ("div", |a, b| a / b),
        ("pow", |a, b| a.pow(b)),
        ("maximum", |a, b| a.maximum(b)),
        ("minimum", |a, b| a.minimum(b)),
    ];
    for (op, f) in ops {
        for (shape, ld, rd) in shapes {
            let (l, r) = match op {
                // Positive bases, moderate exponents: no NaN, no overflow.
                "pow" => (rng.f32s(ld, 0.1, 4.0), rng.f32s(rd, -3.0, 3.0)),
                // Divisors away from zero.
                "div" => (rng.f32s(ld, -5.0, 5.0), rng.f32s_signed(rd, 0.25, 5.0)),
                // Coarse values so that maximum/minimum see ties.
                "maximum" | "minimum" => (rng.f32s_coarse(ld, 3), rng.f32s_coarse(rd, 3)),
                _ => (rng.f32s(ld, -5.0, 5.0), rng.f32s(rd, -5.0, 5.0)),
            };
            g.check(&format!("{op} {shape}"), &[&l, &r], |x| vec![f(x[0], x[1])]);
        }
        // A literal operand on either side.
        let a = rng.f32s(&[4, 3], 0.5, 3.0);
        g.check(&format!("{op} literal rhs"), &[&a], |x| {
            vec![f(x[0], Tensor::scalar(1.5, DType::F32))]
        });
        g.check(&format!("{op} literal lhs"), &[&a], |x| {
            vec![f(Tensor::scalar(2.5, DType::F32), x[0])]
        });
    }
    // Operator forms with f64 literals.
    let a = rng.f32s(&[3, 4], -2.0, 2.0);
    g.check("2 * x + 1 - x / 4", &[&a], |x| {
        vec![2.0 * x[0] + 1.0 - x[0] / 4.0]
    });
    g.check("1 - x", &[&a], |x| vec![1.0 - x[0]]);
    g.finish();
}

#[test]
fn comparisons_and_select() {
    let mut g = Group::new("comparisons_and_select");
    let mut rng = Rng(3);
    type Cmp = fn(Tensor, Tensor) -> Tensor;
    let cmps: [(&str, Cmp); 6] = [
        ("equal", |a, b| a.equal(b)),
        ("not_equal", |a, b| a.not_equal(b)),
        ("less", |a, b| a.less(b)),
        ("less_equal", |a, b| a.less_equal(b)),
        ("greater", |a, b| a.greater(b)),
        ("greater_equal", |a, b| a.greater_equal(b)),
    ];
    for (name, f) in cmps {
        // Coarse values: many ties, so `==` and `<=` see both outcomes.
        let (a, b) = (rng.f32s_coarse(&[6, 7], 2), rng.f32s_coarse(&[6, 7], 2));
        g.check(&format!("{name} f32"), &[&a, &b], |x| vec![f(x[0], x[1])]);
        let row = rng.f32s_coarse(&[7], 2);
        g.check(&format!("{name} f32 row"), &[&a, &row], |x| {
            vec![f(x[0], x[1])]
        });
        g.check(&format!("{name} f32 literal"), &[&a], |x| {
            vec![f(x[0], Tensor::scalar(0.5, DType::F32))]
        });
        let (a, b) = (rng.i32s(&[6, 7], -3, 3), rng.i32s(&[6, 7], -3, 3));
        g.check(&format!("{name} i32"), &[&a, &b], |x| vec![f(x[0], x[1])]);
        let (a, b) = (rng.i64s(&[20], -3, 3), rng.i64s(&[20], -3, 3));
        g.check(&format!("{name} i64"), &[&a, &b], |x| vec![f(x[0], x[1])]);
        let (a, b) = (rng.u8s(&[40]), rng.u8s(&[40]));
        g.check(&format!("{name} u8"), &[&a, &b], |x| vec![f(x[0], x[1])]);
        let (a, b) = (rng.f64s(&[20], -1.0, 1.0), rng.f64s(&[20], -1.0, 1.0));
        g.check(&format!("{name} f64"), &[&a, &b], |x| vec![f(x[0], x[1])]);
    }
    // NaN compares unordered (only `!=` holds) on both.
    let nan = Array::from_vec(&[4], vec![f32::NAN, 1.0, f32::NAN, -2.0]).unwrap();
    let one = Array::from_vec(&[4], vec![1.0f32, 1.0, f32::NAN, 0.0]).unwrap();
    g.check("comparisons with NaN", &[&nan, &one], |x| {
        cmps.iter().map(|(_, f)| f(x[0], x[1])).collect()
    });

    // select: same shapes, broadcast predicate, literal branches, integer branches.
    let (a, b) = (rng.f32s(&[6, 7], -1.0, 1.0), rng.f32s(&[6, 7], -1.0, 1.0));
    g.check("select", &[&a, &b], |x| {
        vec![Tensor::select(x[0].greater(x[1]), x[0], x[1])]
    });
    let p = rng.bools(&[6, 7]);
    g.check("select on a bool input", &[&p, &a, &b], |x| {
        vec![Tensor::select(x[0], x[1], x[2])]
    });
    let col = rng.bools(&[6, 1]);
    g.check("select column predicate", &[&col, &a, &b], |x| {
        vec![Tensor::select(x[0], x[1], x[2])]
    });
    // Two literal branches need one typed (the tracer refuses to guess a dtype).
    g.check("select literal branches", &[&a], |x| {
        vec![Tensor::select(
            x[0].less(0.0),
            Tensor::scalar(-1.0, DType::F32),
            1.0,
        )]
    });
    g.check("select literal false branch", &[&a], |x| {
        vec![Tensor::select(x[0].less(0.0), x[0], 0.0)]
    });
    let (i, j) = (rng.i32s(&[9], -5, 5), rng.i32s(&[9], -5, 5));
    g.check("select i32", &[&i, &j], |x| {
        vec![Tensor::select(x[0].less_equal(x[1]), x[0], x[1])]
    });
    let (p, q) = (rng.bools(&[9]), rng.bools(&[9]));
    g.check("select bool values", &[&p, &q], |x| {
        vec![Tensor::select(x[0], x[1], x[0])]
    });
    g.finish();
}

// ---- products ----------------------------------------------------------------------------------

#[test]
fn dot_general_and_matmul() {
    let mut g = Group::new("dot_general_and_matmul");
    let mut rng = Rng(4);
    let mut f = |dims: &[usize]| rng.f32s(dims, -1.0, 1.0);
    g.check("matmul 2-D", &[&f(&[7, 16]), &f(&[16, 5])], |x| {
        vec![x[0].matmul(x[1])]
    });
    g.check(
        "matmul 2-D large k",
        &[&f(&[8, 256]), &f(&[256, 12])],
        |x| vec![x[0].matmul(x[1])],
    );
    g.check("matmul batched", &[&f(&[3, 4, 8]), &f(&[3, 8, 5])], |x| {
        vec![x[0].matmul(x[1])]
    });
    g.check(
        "matmul batched rank 4",
        &[&f(&[2, 3, 4, 6]), &f(&[2, 3, 6, 5])],
        |x| vec![x[0].matmul(x[1])],
    );
    g.check("matmul vector · matrix", &[&f(&[16]), &f(&[16, 5])], |x| {
        vec![x[0].matmul(x[1])]
    });
    g.check("matmul matrix · vector", &[&f(&[7, 16]), &f(&[16])], |x| {
        vec![x[0].matmul(x[1])]
    });
    g.check("matmul vector · vector", &[&f(&[16]), &f(&[16])], |x| {
        vec![x[0].matmul(x[1])]
    });
    g.check("matmul x · wᵀ", &[&f(&[7, 16]), &f(&[5, 16])], |x| {
        vec![x[0].matmul(x[1].t())]
    });
    g.check(
        "dot_general transposed contraction (aᵀ·bᵀ)",
        &[&f(&[16, 7]), &f(&[5, 16])],
        |x| vec![x[0].dot_general(x[1], dd(&[], &[], &[0], &[1]))],
    );
    g.check(
        "dot_general lhs contracts dim 0",
        &[&f(&[16, 7]), &f(&[16, 5])],
        |x| vec![x[0].dot_general(x[1], dd(&[], &[], &[0], &[0]))],
    );
    g.check(
        "dot_general two contracting dims",
        &[&f(&[4, 3, 5]), &f(&[3, 4, 6])],
        |x| vec![x[0].dot_general(x[1], dd(&[], &[], &[0, 1], &[1, 0]))],
    );
    g.check(
        "dot_general batch dim not leading",
        &[&f(&[4, 3, 5]), &f(&[5, 3, 6])],
        |x| vec![x[0].dot_general(x[1], dd(&[1], &[1], &[2], &[0]))],
    );
    g.check(
        "dot_general outer product (no contraction)",
        &[&f(&[4]), &f(&[3])],
        |x| vec![x[0].dot_general(x[1], dd(&[], &[], &[], &[]))],
    );
    let (a, b) = (rng.f64s(&[6, 9], -1.0, 1.0), rng.f64s(&[9, 4], 0.5, 1.0));
    g.check("matmul f64", &[&a, &b], |x| vec![x[0].matmul(x[1])]);
    let (a, b) = (rng.i32s(&[5, 7], -50, 50), rng.i32s(&[7, 3], -50, 50));
    g.check("matmul i32", &[&a, &b], |x| vec![x[0].matmul(x[1])]);
    g.finish();
}

// ---- shapes ------------------------------------------------------------------------------------

#[test]
fn broadcast_reshape_transpose() {
    let mut g = Group::new("broadcast_reshape_transpose");
    let mut rng = Rng(5);
    g.check(
        "broadcast row → matrix",
        &[&rng.f32s(&[3], -1.0, 1.0)],
        |x| vec![x[0].broadcast_to(&[4, 3])],
    );
    g.check(
        "broadcast column → matrix",
        &[&rng.f32s(&[4, 1], -1.0, 1.0)],
        |x| vec![x[0].broadcast_to(&[4, 5])],
    );
    g.check(
        "broadcast scalar → rank 3",
        &[&Array::scalar(2.5f32)],
        |x| vec![x[0].broadcast_to(&[2, 3, 4])],
    );
    g.check(
        "broadcast [1,3,1] → [2,3,4]",
        &[&rng.f32s(&[1, 3, 1], -1.0, 1.0)],
        |x| vec![x[0].broadcast_to(&[2, 3, 4])],
    );
    g.check("broadcast i32", &[&rng.i32s(&[3], -9, 9)], |x| {
        vec![x[0].broadcast_to(&[2, 3])]
    });
    g.check("broadcast bool", &[&rng.bools(&[3])], |x| {
        vec![x[0].broadcast_to(&[2, 3])]
    });
    let m = rng.f32s(&[4, 6], -1.0, 1.0);
    g.check("reshape [4,6] → [24]", &[&m], |x| {
        vec![x[0].reshape(&[24])]
    });
    g.check("reshape [4,6] → [2,3,4]", &[&m], |x| {
        vec![x[0].reshape(&[2, 3, 4])]
    });
    g.check("reshape [4,6] → [6,1,4]", &[&m], |x| {
        vec![x[0].reshape(&[6, 1, 4])]
    });
    g.check("reshape scalar → [1,1]", &[&Array::scalar(3i32)], |x| {
        vec![x[0].reshape(&[1, 1])]
    });
    g.check(
        "reshape [1] → scalar",
        &[&rng.f32s(&[1], 0.0, 1.0)],
        |x| vec![x[0].reshape(&[])],
    );
    g.check("transpose 2-D", &[&m], |x| vec![x[0].t()]);
    let t3 = rng.f32s(&[2, 3, 4], -1.0, 1.0);
    for perm in [[0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]] {
        g.check(&format!("transpose {perm:?}"), &[&t3], |x| {
            vec![x[0].transpose(&perm)]
        });
    }
    g.check("transpose i64", &[&rng.i64s(&[3, 5], -99, 99)], |x| {
        vec![x[0].t()]
    });
    g.check("transpose u8", &[&rng.u8s(&[3, 5])], |x| vec![x[0].t()]);
    g.finish();
}

#[test]
fn slice_and_concatenate() {
    let mut g = Group::new("slice_and_concatenate");
    let mut rng = Rng(6);
    let m = rng.f32s(&[7, 9], -1.0, 1.0);
    g.check("slice rows", &[&m], |x| vec![x[0].slice(&[2, 0], &[5, 9])]);
    g.check(
        "slice window",
        &[&m],
        |x| vec![x[0].slice(&[1, 3], &[6, 8])],
    );
    g.check("slice single element", &[&m], |x| {
        vec![x[0].slice(&[6, 8], &[7, 9])]
    });
    g.check("slice strided", &[&m], |x| {
        vec![x[0].slice_strided(&[0, 1], &[7, 9], &[2, 3])]
    });
    g.check("slice strided offset", &[&m], |x| {
        vec![x[0].slice_strided(&[1, 0], &[6, 8], &[3, 2])]
    });
    let t3 = rng.f32s(&[4, 5, 6], -1.0, 1.0);
    g.check("slice strided rank 3", &[&t3], |x| {
        vec![x[0].slice_strided(&[1, 0, 2], &[4, 5, 6], &[2, 2, 1])]
    });
    g.check("slice i32", &[&rng.i32s(&[10], -9, 9)], |x| {
        vec![x[0].slice_strided(&[1], &[10], &[4])]
    });
    let (a, b, c) = (
        rng.f32s(&[2, 5], -1.0, 1.0),
        rng.f32s(&[3, 5], -1.0, 1.0),
        rng.f32s(&[1, 5], -1.0, 1.0),
    );
    g.check("concatenate axis 0 (three parts)", &[&a, &b, &c], |x| {
        vec![Tensor::concatenate(&[x[0], x[1], x[2]], 0)]
    });
    let (a, b) = (rng.f32s(&[4, 2], -1.0, 1.0), rng.f32s(&[4, 3], -1.0, 1.0));
    g.check("concatenate axis 1", &[&a, &b], |x| {
        vec![Tensor::concatenate(&[x[0], x[1]], 1)]
    });
    let (a, b) = (
        rng.f32s(&[2, 3, 1], -1.0, 1.0),
        rng.f32s(&[2, 3, 2], -1.0, 1.0),
    );
    g.check("concatenate axis 2", &[&a, &b], |x| {
        vec![Tensor::concatenate(&[x[0], x[1], x[0]], 2)]
    });
    let (a, b) = (rng.i32s(&[3], -9, 9), rng.i32s(&[4], -9, 9));
    g.check("concatenate i32 vectors", &[&a, &b], |x| {
        vec![Tensor::concatenate(&[x[0], x[1]], 0)]
    });
    let (a, b) = (rng.bools(&[2, 2]), rng.bools(&[1, 2]));
    g.check("concatenate bool", &[&a, &b], |x| {
        vec![Tensor::concatenate(&[x[0], x[1]], 0)]
    });
    g.finish();
}

// ---- reductions --------------------------------------------------------------------------------

#[test]
fn reductions() {
    let mut g = Group::new("reductions");
    let mut rng = Rng(7);
    let x = rng.f32s(&[4, 5, 6], -2.0, 2.0);
    // Positive values for sums checked relatively: no cancellation to near zero.
    let pos = rng.f32s(&[4, 5, 6], 0.5, 2.0);
    let axes_sets: [&[usize]; 7] = [&[0], &[1], &[2], &[0, 1], &[0, 2], &[1, 2], &[0, 1, 2]];
    for axes in axes_sets {
        g.check(&format!("sum {axes:?}"), &[&pos], |t| {
            vec![t[0].sum(axes), t[0].sum_keep(axes)]
        });
        g.check(&format!("mean {axes:?}"), &[&pos], |t| {
            vec![t[0].mean(axes), t[0].mean_keep(axes)]
        });
        g.check(&format!("max {axes:?}"), &[&x], |t| {
            vec![t[0].max(axes), t[0].max_keep(axes)]
        });
        g.check(&format!("min {axes:?}"), &[&x], |t| vec![t[0].min(axes)]);
    }
    g.check("sum_all / mean_all", &[&pos], |t| {
        vec![t[0].sum_all(), t[0].mean_all()]
    });
    // Signed values: sums that may cancel, within the same tolerance.
    g.check("sum signed each axis", &[&x], |t| {
        vec![t[0].sum(&[0]), t[0].sum(&[1]), t[0].sum(&[2])]
    });
    let long = rng.f32s(&[3, 1000], 0.0, 1.0);
    g.check("sum of 1000", &[&long], |t| {
        vec![
            t[0].sum(&[1]),
            t[0].mean(&[1]),
            t[0].max(&[1]),
            t[0].min(&[1]),
        ]
    });
    let big = rng.f32s(&[100_000], 0.0, 1.0);
    g.check("sum of 100000", &[&big], |t| {
        vec![t[0].sum_all(), t[0].mean_all()]
    });
    g.check(
        "reduce a scalar over no axes",
        &[&Array::scalar(2.0f32)],
        |t| vec![t[0].sum(&[]), t[0].max(&[])],
    );
    let ints = rng.i32s(&[4, 5, 6], -1000, 1000);
    for axes in axes_sets {
        g.check(&format!("i32 sum/max/min {axes:?}"), &[&ints], |t| {
            vec![t[0].sum(axes), t[0].max(axes), t[0].min_keep(axes)]
        });
    }
    let longs = rng.i64s(&[6, 7], -(1 << 40), 1 << 40);
    g.check("i64 sum/max/min", &[&longs], |t| {
        vec![t[0].sum(&[0]), t[0].max(&[1]), t[0].min(&[0, 1])]
    });
    let f64s = rng.f64s(&[5, 8], 0.5, 2.0);
    g.check("f64 sum/mean/max/min", &[&f64s], |t| {
        vec![
            t[0].sum(&[1]),
            t[0].mean(&[0]),
            t[0].max(&[0, 1]),
            t[0].min(&[1]),
        ]
    });
    g.finish();
}

trait MinKeep {
    fn min_keep(self, axes: &[usize]) -> Tensor;
}

impl MinKeep for Tensor {
    /// `min` keeping dims, through a reshape (there is no `min_keep` op).
    fn min_keep(self, axes: &[usize]) -> Tensor {
        let mut dims = self.dims();
        for &a in axes {
            dims[a] = 1;
        }
        self.min(axes).reshape(&dims)
    }
}

// ---- iota, one-hot, argmax ---------------------------------------------------------------------

#[test]
fn iota_one_hot_argmax() {
    let mut g = Group::new("iota_one_hot_argmax");
    let mut rng = Rng(8);
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8] {
        for axis in 0..3 {
            g.check(&format!("iota {dtype} axis {axis}"), &[], |_| {
                vec![Tensor::iota(dtype, &[3, 4, 5], axis)]
            });
        }
    }
    g.check("iota vector", &[], |_| {
        vec![Tensor::iota(DType::I32, &[17], 0)]
    });
    let labels = rng.i32s(&[32], 0, 9);
    for dtype in [DType::F32, DType::F64, DType::I32, DType::Bool] {
        g.check(&format!("one_hot i32 → {dtype}"), &[&labels], |t| {
            vec![t[0].one_hot(10, dtype)]
        });
    }
    g.check(
        "one_hot out-of-range labels",
        &[&rng.i32s(&[12], -2, 11)],
        |t| vec![t[0].one_hot(10, DType::F32)],
    );
    g.check("one_hot u8 labels", &[&rng.u8s(&[40])], |t| {
        vec![t[0].one_hot(256, DType::F32)]
    });
    g.check("one_hot i64 labels", &[&rng.i64s(&[8], 0, 4)], |t| {
        vec![t[0].one_hot(5, DType::I32)]
    });
    g.check("one_hot rank 2 labels", &[&rng.i32s(&[3, 4], 0, 6)], |t| {
        vec![t[0].one_hot(7, DType::F32)]
    });
    let x = rng.f32s(&[6, 7, 8], -1.0, 1.0);
    for axis in 0..3 {
        g.check(&format!("argmax axis {axis}"), &[&x], |t| {
            vec![t[0].argmax(axis)]
        });
    }
    // Ties: the first maximum wins, on both.
    let ties = rng.f32s_coarse(&[12, 9], 1);
    g.check("argmax with ties", &[&ties], |t| {
        vec![t[0].argmax(0), t[0].argmax(1)]
    });
    let nan = Array::from_vec(&[2, 3], vec![1.0f32, f32::NAN, 3.0, 2.0, 2.0, 1.0]).unwrap();
    g.check("argmax with NaN", &[&nan], |t| vec![t[0].argmax(1)]);
    g.check("argmax i32", &[&rng.i32s(&[5, 6], -3, 3)], |t| {
        vec![t[0].argmax(1)]
    });
    g.check("argmax f64", &[&rng.f64s(&[5, 6], -1.0, 1.0)], |t| {
        vec![t[0].argmax(0)]
    });
    g.finish();
}

// ---- conversions -------------------------------------------------------------------------------

#[test]
fn conversions() {
    let mut g = Group::new("conversions");
    let mut rng = Rng(9);
    let d = [50];
    let conv = |to: DType| move |t: &[Tensor]| vec![t[0].convert(to)];
    g.check("f32 → f64", &[&rng.f32s(&d, -1e6, 1e6)], conv(DType::F64));
    g.check("f64 → f32", &[&rng.f64s(&d, -1e6, 1e6)], conv(DType::F32));
    g.check(
        "f64 → f32 (values that round)",
        &[&rng.f64s(&d, -1e-3, 1e-3)],
        conv(DType::F32),
    );
    // Truncation toward zero, negatives and exact integers included.
    let mut fr = rng.f32s(&d, -1000.0, 1000.0);
    fr.as_slice_mut::<f32>().unwrap()[..8]
        .copy_from_slice(&[-2.7, 2.7, -0.5, 0.5, -1.0, 3.0, 0.0, -0.0]);
    g.check("f32 → i32 truncation", &[&fr], conv(DType::I32));
    g.check("f32 → i64", &[&fr], conv(DType::I64));
    g.check("f64 → i32", &[&rng.f64s(&d, -1e9, 1e9)], conv(DType::I32));
    g.check("f64 → i64", &[&rng.f64s(&d, -1e15, 1e15)], conv(DType::I64));
    g.check(
        "i32 → f32",
        &[&rng.i32s(&d, -(1 << 30), 1 << 30)],
        conv(DType::F32),
    );
    g.check(
        "i32 → f64",
        &[&rng.i32s(&d, i32::MIN as i64, i32::MAX as i64)],
        conv(DType::F64),
    );
    g.check(
        "i64 → f32",
        &[&rng.i64s(&d, -(1 << 50), 1 << 50)],
        conv(DType::F32),
    );
    g.check(
        "i64 → f64",
        &[&rng.i64s(&d, -(1 << 60), 1 << 60)],
        conv(DType::F64),
    );
    g.check("u8 → f32", &[&rng.u8s(&d)], conv(DType::F32));
    g.check("u8 → i32", &[&rng.u8s(&d)], conv(DType::I32));
    g.check(
        "f32 → u8 (in range)",
        &[&rng.f32s(&d, 0.0, 255.99)],
        conv(DType::U8),
    );
    g.check("bool → f32", &[&rng.bools(&d)], conv(DType::F32));
    g.check("bool → i32", &[&rng.bools(&d)], conv(DType::I32));
    g.check("bool → u8", &[&rng.bools(&d)], conv(DType::U8));
    let mut zs = rng.f32s_coarse(&d, 1);
    zs.as_slice_mut::<f32>().unwrap()[0] = -0.0;
    g.check("f32 → bool", &[&zs], conv(DType::Bool));
    g.check("i32 → bool", &[&rng.i32s(&d, -2, 2)], conv(DType::Bool));
    g.check(
        "i64 → i32 (in range)",
        &[&rng.i64s(&d, -(1 << 31), (1 << 31) - 1)],
        conv(DType::I32),
    );
    g.check(
        "i64 → i32 (wrapping: low bits kept)",
        &[&rng.i64s(&d, -(1 << 40), 1 << 40)],
        conv(DType::I32),
    );
    g.check(
        "i32 → i64",
        &[&rng.i32s(&d, i32::MIN as i64, i32::MAX as i64)],
        conv(DType::I64),
    );
    g.check(
        "i32 → u8 (low bits)",
        &[&rng.i32s(&d, -1000, 1000)],
        conv(DType::U8),
    );
    g.check(
        "same dtype is the identity",
        &[&rng.f32s(&d, -1.0, 1.0)],
        conv(DType::F32),
    );
    g.finish();
}

/// Conversions whose results StableHLO leaves to the implementation: float → integer out of
/// range and NaN. The interpreter documents XLA's CPU behaviour (saturate, NaN → 0); this checks
/// that claim against the plugin.
#[test]
fn conversions_out_of_range() {
    let mut g = Group::new("conversions_out_of_range");
    let v = vec![
        3e9f32,
        -3e9,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        2_147_483_520.0,
        -2_147_483_648.0,
        300.0,
        -1.0,
        -0.9,
        255.5,
    ];
    let n = v.len();
    let a = Array::from_vec(&[n], v).unwrap();
    g.check("f32 → i32 saturates", &[&a], |t| {
        vec![t[0].convert(DType::I32)]
    });
    g.check("f32 → u8 saturates", &[&a], |t| {
        vec![t[0].convert(DType::U8)]
    });
    g.check("f32 → i64", &[&a], |t| vec![t[0].convert(DType::I64)]);
    g.check("f32 → bool (NaN is true)", &[&a], |t| {
        vec![t[0].convert(DType::Bool)]
    });
    g.finish();
}

// ---- constants ---------------------------------------------------------------------------------

#[test]
fn constants() {
    let mut g = Group::new("constants");
    let mut rng = Rng(10);
    g.check("scalar f32", &[], |_| vec![Tensor::scalar(0.1, DType::F32)]);
    g.check("scalar f64", &[], |_| vec![Tensor::scalar(0.1, DType::F64)]);
    g.check("scalar i32", &[], |_| {
        vec![Tensor::scalar(-7.0, DType::I32)]
    });
    g.check("scalar i64", &[], |_| {
        vec![Tensor::scalar(9.0e15, DType::I64)]
    });
    g.check("scalar u8", &[], |_| vec![Tensor::scalar(255.0, DType::U8)]);
    g.check("scalar bool", &[], |_| {
        vec![Tensor::scalar(1.0, DType::Bool)]
    });
    g.check("special floats", &[], |_| {
        vec![Tensor::constant(
            Array::from_vec(
                &[6],
                vec![
                    f32::INFINITY,
                    f32::NEG_INFINITY,
                    -0.0,
                    f32::MAX,
                    f32::MIN_POSITIVE,
                    1e-30,
                ],
            )
            .unwrap(),
        )]
    });
    g.check("splat f32", &[], |_| {
        vec![Tensor::full(&[3, 4], -1.25, DType::F32)]
    });
    g.check("splat i32", &[], |_| {
        vec![Tensor::full(&[5], 3.0, DType::I32)]
    });
    g.check("splat bool", &[], |_| {
        vec![Tensor::full(&[2, 2], 0.0, DType::Bool)]
    });
    let x = rng.f32s(&[3, 4], -1.0, 1.0);
    let dense = rng.f32s(&[3, 4], -1.0, 1.0);
    g.check("dense f32 + input", &[&x], |t| {
        vec![t[0] + Tensor::constant(dense.clone())]
    });
    g.check("splat used by an op", &[&x], |t| {
        vec![t[0] * Tensor::full(&[3, 4], 3.0, DType::F32)]
    });
    let dense_f64 = rng.f64s(&[7], -1e10, 1e10);
    g.check("dense f64", &[], |_| vec![Tensor::constant(dense_f64)]);
    let dense_i32 = rng.i32s(&[9], i32::MIN as i64, i32::MAX as i64);
    g.check("dense i32", &[], |_| vec![Tensor::constant(dense_i32)]);
    let dense_i64 = rng.i64s(&[9], i64::MIN / 2, i64::MAX / 2);
    g.check("dense i64", &[], |_| vec![Tensor::constant(dense_i64)]);
    let dense_u8 = rng.u8s(&[2, 9]);
    g.check("dense u8", &[], |_| vec![Tensor::constant(dense_u8)]);
    let dense_bool = rng.bools(&[3, 5]);
    g.check("dense bool", &[], |_| vec![Tensor::constant(dense_bool)]);
    let big = rng.f32s(&[100_000], -1.0, 1.0);
    let y = rng.f32s(&[100_000], -1.0, 1.0);
    g.check("a 100k-element constant", &[&y], |t| {
        let c = Tensor::constant(big.clone());
        vec![c, t[0] - c]
    });
    let big_i32 = rng.i32s(&[250, 400], -1_000_000, 1_000_000);
    g.check("a 100k-element i32 constant", &[], |_| {
        vec![Tensor::constant(big_i32)]
    });
    g.finish();
}

// ---- integers and f64 --------------------------------------------------------------------------

#[test]
fn integer_ops() {
    let mut g = Group::new("integer_ops");
    let mut rng = Rng(11);
    let (a, b) = (
        rng.i32s(&[6, 7], -10_000, 10_000),
        rng.i32s(&[6, 7], -10_000, 10_000),
    );
    let div = nonzero_i32s(&mut rng, &[6, 7], 100);
    g.check("i32 add", &[&a, &b], |t| vec![t[0] + t[1]]);
    g.check("i32 sub", &[&a, &b], |t| vec![t[0] - t[1]]);
    g.check("i32 mul", &[&a, &b], |t| vec![t[0] * t[1]]);
    g.check("i32 div (truncating, signed)", &[&a, &div], |t| {
        vec![t[0] / t[1]]
    });
    g.check("i32 max/min", &[&a, &b], |t| {
        vec![t[0].maximum(t[1]), t[0].minimum(t[1])]
    });
    let row = rng.i32s(&[7], -100, 100);
    g.check("i32 add row", &[&a, &row], |t| vec![t[0] + t[1]]);
    g.check("i32 max row", &[&a, &row], |t| vec![t[0].maximum(t[1])]);
    g.check("i32 mul literal", &[&a], |t| vec![t[0] * 3.0 - 1.0]);
    g.check("i32 div literal", &[&a], |t| vec![t[0] / 7.0]);
    let big = rng.i32s(&[20], 1 << 20, 1 << 30);
    g.check("i32 mul wraps", &[&big, &big], |t| vec![t[0] * t[1]]);
    let base = rng.i32s(&[20], -4, 4);
    let exp = rng.i32s(&[20], 0, 6);
    g.check("i32 pow (non-negative exponents)", &[&base, &exp], |t| {
        vec![t[0].pow(t[1])]
    });
    let (a, b) = (
        rng.i64s(&[20], -(1 << 40), 1 << 40),
        rng.i64s(&[20], 1, 1 << 20),
    );
    g.check("i64 add/sub/mul/div/max/min", &[&a, &b], |t| {
        vec![
            t[0] + t[1],
            t[0] - t[1],
            t[0] * t[1],
            t[0] / t[1],
            t[0].maximum(t[1]),
            t[0].minimum(t[1]),
        ]
    });
    let (a, b) = (rng.u8s(&[40]), rng.u8s(&[40]));
    let nz: Vec<u8> = b
        .as_slice::<u8>()
        .unwrap()
        .iter()
        .map(|&x| x.max(1))
        .collect();
    let nz = Array::from_vec(&[40], nz).unwrap();
    g.check("u8 add/mul wrap, div, max", &[&a, &nz], |t| {
        vec![t[0] + t[1], t[0] * t[1], t[0] / t[1], t[0].maximum(t[1])]
    });
    g.finish();
}

#[test]
fn f64_programs() {
    let mut g = Group::new("f64_programs");
    let mut rng = Rng(12);
    let d = [6, 11];
    let any = rng.f64s(&d, -3.0, 3.0);
    let pos = rng.f64s(&d, 0.01, 40.0);
    g.check("f64 exp", &[&any], |x| vec![x[0].exp()]);
    g.check("f64 log", &[&pos], |x| vec![x[0].log()]);
    g.check("f64 tanh", &[&any], |x| vec![x[0].tanh()]);
    g.check("f64 logistic", &[&any], |x| vec![x[0].logistic()]);
    g.check("f64 sqrt/rsqrt", &[&pos], |x| {
        vec![x[0].sqrt(), x[0].rsqrt()]
    });
    g.check("f64 abs/neg", &[&any], |x| vec![x[0].abs(), -x[0]]);
    let expo = rng.f64s(&d, -2.0, 2.0);
    g.check("f64 pow", &[&pos, &expo], |x| vec![x[0].pow(x[1])]);
    let den = rng.f64s(&[11], 0.5, 3.0);
    g.check("f64 arithmetic with a row", &[&any, &den], |x| {
        vec![x[0] + x[1], x[0] - x[1], x[0] * x[1], x[0] / x[1]]
    });
    // A small f64 network with a loss.
    let xs = rng.f64s(&[8, 5], -1.0, 1.0);
    let w1 = rng.f64s(&[5, 16], -0.5, 0.5);
    let b1 = rng.f64s(&[16], -0.1, 0.1);
    let w2 = rng.f64s(&[16, 3], -0.5, 0.5);
    let labels = rng.i32s(&[8], 0, 2);
    let inputs = [xs, w1, b1, w2, labels];
    g.check("f64 MLP forward + cross-entropy", &inputs.each_ref(), |x| {
        let h = (x[0].matmul(x[1]) + x[2]).tanh();
        let logits = h.matmul(x[3]);
        let loss = nn::softmax_cross_entropy(logits, x[4]);
        vec![logits, nn::softmax(logits, 1), loss, loss.mean_all()]
    });
    g.check("f64 MLP gradient", &inputs.each_ref(), |x| {
        let h = (x[0].matmul(x[1]) + x[2]).tanh();
        let loss = nn::softmax_cross_entropy(h.matmul(x[3]), x[4]).mean_all();
        let mut out = vec![loss];
        out.extend(grad(loss, &[x[1], x[2], x[3]]));
        out
    });
    g.finish();
}

// ---- whole programs ----------------------------------------------------------------------------

/// The MLP of the examples: `64 → 128 tanh → 10`, softmax cross-entropy, batch 32.
fn mlp_inputs(seed: u64) -> Vec<Array> {
    let mut rng = Rng(seed);
    let glorot = |rng: &mut Rng, i: usize, o: usize| {
        let limit = (6.0 / (i + o) as f64).sqrt();
        rng.f32s(&[i, o], -limit, limit)
    };
    let w1 = glorot(&mut rng, 64, 128);
    let b1 = rng.f32s(&[128], -0.1, 0.1);
    let w2 = glorot(&mut rng, 128, 10);
    let b2 = rng.f32s(&[10], -0.1, 0.1);
    // Pixels in 0..16, as in the digits data.
    let x = rng.f32s(&[32, 64], 0.0, 16.0);
    let y = rng.i32s(&[32], 0, 9);
    vec![w1, b1, w2, b2, x, y]
}

/// Mean loss, then its gradient w.r.t. `w1 b1 w2 b2`.
fn mlp_loss_and_grads(x: &[Tensor]) -> Vec<Tensor> {
    let (w1, b1, w2, b2, pixels, labels) = (x[0], x[1], x[2], x[3], x[4], x[5]);
    let h = (pixels.matmul(w1) + b1).tanh();
    let logits = h.matmul(w2) + b2;
    let loss = nn::softmax_cross_entropy(logits, labels).mean_all();
    let mut out = vec![loss];
    out.extend(grad(loss, &[w1, b1, w2, b2]));
    out
}

#[test]
fn mlp_gradient_program() {
    let mut g = Group::new("mlp_gradient_program");
    for seed in [21, 22, 23] {
        let inputs = mlp_inputs(seed);
        let want = g.check(
            &format!("mlp grad (seed {seed})"),
            &inputs.iter().collect::<Vec<_>>(),
            mlp_loss_and_grads,
        );
        // The interpreter's outputs are what a gradient program must produce.
        assert_eq!(want.len(), 5);
        let dims: Vec<&[usize]> = want.iter().map(|a| a.dims()).collect();
        assert_eq!(dims, [&[][..], &[64, 128], &[128], &[128, 10], &[10]]);
        let loss = want[0].as_slice::<f32>().unwrap()[0];
        assert!(loss.is_finite() && loss > 0.0, "loss {loss}");
    }
    g.finish();
}

/// `w - lr * g`, with `w` donated to the output, several steps with `w` kept on the device.
#[test]
fn donated_sgd_update() {
    let name = "donated_sgd_update";
    let mut rng = Rng(31);
    let w0 = rng.f32s(&[64, 10], -1.0, 1.0);
    let lr = Array::scalar(0.05f32);
    const STEPS: usize = 8;
    let grads: Vec<Array> = (0..STEPS).map(|_| rng.f32s(&[64, 10], -1.0, 1.0)).collect();
    let types = [
        ("w".to_owned(), w0.leaf_type()),
        ("g".to_owned(), grads[0].leaf_type()),
        ("lr".to_owned(), lr.leaf_type()),
    ];
    let graph = trace::trace(&types, |x| vec![x[0] - x[2] * x[1]]).unwrap();
    let text = emit::emit_with(
        &graph,
        &EmitOptions {
            donate: vec![(0, 0)],
            ..EmitOptions::default()
        },
    );
    assert!(
        text.contains("tf.aliasing_output = 0 : i32"),
        "the donated argument is marked:\n{text}"
    );

    // The interpreter's loop.
    let mut want = w0.clone();
    for g in &grads {
        want = nitro::backend::interp::run_refs(&graph, &[&want, g, &lr])
            .unwrap()
            .remove(0);
    }

    let Some(_) = xla_or_skip(name) else {
        return;
    };
    let client = pjrt::client().unwrap();
    let exe = client
        .compile(&text, &graph.input_types(), &graph.output_types())
        .unwrap();
    let dlr = client.upload(&lr).unwrap();
    let mut w = client.upload(&w0).unwrap();
    for (step, g) in grads.iter().enumerate() {
        let dg = client.upload(g).unwrap();
        let mut run = exe
            .execute_donating(vec![w.into(), (&dg).into(), (&dlr).into()])
            .unwrap();
        assert_eq!(run.donated, vec![0], "step {step}: w was donated");
        assert!(!dg.is_deleted().unwrap(), "a borrowed argument survives");
        assert_eq!(run.outputs.len(), 1);
        w = run.outputs.pop().unwrap();
    }
    let got = w.to_host().unwrap();

    let mut group = Group::new(name);
    group.cases += 1;
    group.compare(&format!("{STEPS} donated SGD steps"), &[got], &[want]);
    group.finish();
}

// ---- NaN in max, min and argmax --------------------------------------------------------------------

/// NaN propagates in `max`/`min` reductions and `argmax` picks the first NaN (NumPy/JAX), on
/// both backends. XLA's CPU backend dropped NaN in a bare `maximum` reduction (x = [1, NaN, -2,
/// 0.5]: max 1.0 and argmax 0, against NaN and 1 on the interpreter); the emitter now writes a
/// NaN-propagating reducer. Positions vary (first, middle, last, in long rows that XLA
/// vectorizes), with all-NaN rows, -inf and ±0.
#[test]
fn nan_in_max_min_and_argmax() {
    let mut g = Group::new("nan_in_max_min_and_argmax");
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    // Rows: the issue's, NaN first, NaN last, all NaN, -inf with a NaN, all -inf, no NaN, ±0.
    let rows: [[f64; 4]; 8] = [
        [1.0, nan, -2.0, 0.5],
        [nan, 1.0, 2.0, 3.0],
        [3.0, 2.0, 1.0, nan],
        [nan, nan, nan, nan],
        [-inf, nan, -inf, -inf],
        [-inf, -inf, -inf, -inf],
        [0.25, -1.0, 4.0, 4.0],
        [-0.0, 0.0, -0.0, 0.0],
    ];
    let flat: Vec<f64> = rows.iter().flatten().copied().collect();
    let x64 = Array::from_vec(&[8, 4], flat.clone()).unwrap();
    let x32 = Array::from_vec(&[8, 4], flat.iter().map(|&v| v as f32).collect::<Vec<_>>()).unwrap();
    for x in [&x32, &x64] {
        let dt = x.dtype();
        let out = g.check(&format!("{dt} max/min/argmax along rows"), &[x], |t| {
            vec![
                t[0].max(&[1]),
                t[0].min(&[1]),
                t[0].argmax(1),
                t[0].max_keep(&[1]),
            ]
        });
        // The interpreter's values, as NumPy gives them.
        let max = out[0].data().clone();
        let argmax = out[2].as_slice::<i32>().unwrap().to_vec();
        assert_eq!(argmax, [1, 0, 3, 0, 1, 0, 2, 0], "{dt} argmax");
        let max: Vec<f64> = match max {
            ArrayData::F32(v) => v.iter().map(|&v| v as f64).collect(),
            ArrayData::F64(v) => v,
            _ => unreachable!(),
        };
        let nans: Vec<bool> = max.iter().map(|v| v.is_nan()).collect();
        assert_eq!(
            nans,
            [true, true, true, true, true, false, false, false],
            "{dt} max"
        );
        assert_eq!(&max[5..7], &[-inf, 4.0]);
        g.check(&format!("{dt} max/min/argmax along columns"), &[x], |t| {
            vec![t[0].max(&[0]), t[0].min(&[0]), t[0].argmax(0)]
        });
        g.check(&format!("{dt} max/min of everything"), &[x], |t| {
            vec![t[0].max(&[0, 1]), t[0].min(&[0, 1])]
        });
        g.check(&format!("{dt} softmax of rows with NaN"), &[x], |t| {
            vec![nn::log_softmax(t[0], 1)]
        });
    }
    // Long rows, which XLA reduces in vector lanes: one NaN at several positions per row.
    let mut rng = Rng(21);
    for n in [17usize, 1000] {
        let base = rng.f64s(&[5, n], -1.0, 1.0);
        let mut v = base.as_slice::<f64>().unwrap().to_vec();
        for (r, pos) in [0, 1, n / 2, n - 2, n - 1].into_iter().enumerate() {
            v[r * n + pos] = nan;
        }
        let x64 = Array::from_vec(&[5, n], v.clone()).unwrap();
        let x32 =
            Array::from_vec(&[5, n], v.iter().map(|&v| v as f32).collect::<Vec<_>>()).unwrap();
        for x in [&x32, &x64] {
            let out = g.check(
                &format!("{} rows of {n} with a NaN", x.dtype()),
                &[x],
                |t| {
                    vec![
                        t[0].max(&[1]),
                        t[0].min(&[1]),
                        t[0].argmax(1),
                        t[0].max(&[0]),
                    ]
                },
            );
            assert_eq!(
                out[2].as_slice::<i32>().unwrap(),
                &[0, 1, n as i32 / 2, n as i32 - 2, n as i32 - 1]
            );
        }
    }
    // Element-wise maximum/minimum (and relu): NaN on either side gives NaN on both backends.
    let a = Array::from_vec(&[6], vec![nan, 1.0, nan, -inf, -0.0, 0.0]).unwrap();
    let b = Array::from_vec(&[6], vec![1.0, nan, nan, nan, 0.0, -0.0]).unwrap();
    let to32 = |a: &Array| {
        let v: Vec<f32> = a
            .as_slice::<f64>()
            .unwrap()
            .iter()
            .map(|&v| v as f32)
            .collect();
        Array::from_vec(a.dims(), v).unwrap()
    };
    for (a, b) in [(to32(&a), to32(&b)), (a.clone(), b.clone())] {
        let out = g.check(
            &format!("{} element-wise maximum/minimum", a.dtype()),
            &[&a, &b],
            |t| vec![t[0].maximum(t[1]), t[0].minimum(t[1]), t[0].relu()],
        );
        let nan_at = |k: usize| -> Vec<bool> {
            match out[k].data() {
                ArrayData::F32(v) => v.iter().map(|v| v.is_nan()).collect(),
                ArrayData::F64(v) => v.iter().map(|v| v.is_nan()).collect(),
                _ => unreachable!(),
            }
        };
        assert_eq!(nan_at(0), [true, true, true, true, false, false]);
        assert_eq!(nan_at(1), [true, true, true, true, false, false]);
    }
    g.finish();
}
