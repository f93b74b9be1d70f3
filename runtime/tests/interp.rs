//! The reference interpreter: every op traced, run and compared with hand-computed values (many
//! from the StableHLO catalog's `.expected` files), plus input validation and malformed graphs.
#![allow(missing_docs)]
// Expected values are decimal numbers copied from the catalog or worked out by hand, not constants.
#![allow(clippy::approx_constant, clippy::excessive_precision)]

use nitro::backend::interp;
use nitro::trace::{nn, trace, BinaryOp, DotDims, Graph, Op};
use nitro::{Array, DType, Element, Error, LeafType, Tensor};

// ---- helpers ---------------------------------------------------------------------------------

fn arr<T: Element>(dims: &[usize], v: &[T]) -> Array {
    Array::from_vec(dims, v.to_vec()).expect("data fills dims")
}

fn ty(dtype: DType, dims: &[usize]) -> LeafType {
    LeafType {
        dtype,
        dims: dims.to_vec(),
    }
}

fn graph_of(inputs: &[(&str, &Array)], body: impl FnOnce(&[Tensor]) -> Vec<Tensor>) -> Graph {
    let sig: Vec<(String, LeafType)> = inputs
        .iter()
        .map(|(n, a)| (n.to_string(), a.leaf_type()))
        .collect();
    trace(&sig, body).expect("the program traces")
}

/// Traces `body` over inputs typed like the arrays, runs it on them and returns the outputs.
fn run(inputs: &[(&str, &Array)], body: impl FnOnce(&[Tensor]) -> Vec<Tensor>) -> Vec<Array> {
    let graph = graph_of(inputs, body);
    let arrays: Vec<Array> = inputs.iter().map(|(_, a)| (*a).clone()).collect();
    interp::run(&graph, &arrays).expect("the program runs")
}

/// Float closeness as in the catalog: `|got - want| <= 1e-5 |want| + 1e-6`; NaN matches NaN.
fn close(got: f64, want: f64) -> bool {
    (got.is_nan() && want.is_nan()) || got == want || (got - want).abs() <= 1e-5 * want.abs() + 1e-6
}

#[track_caller]
fn check_f32(a: &Array, dims: &[usize], want: &[f32]) {
    assert_eq!(a.leaf_type(), ty(DType::F32, dims), "type of {a:?}");
    let got = a.as_slice::<f32>().unwrap();
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            close(g as f64, w as f64),
            "element {i}: got {g}, want {w} (all: {got:?})"
        );
    }
}

#[track_caller]
fn check_f64(a: &Array, dims: &[usize], want: &[f64]) {
    assert_eq!(a.leaf_type(), ty(DType::F64, dims), "type of {a:?}");
    let got = a.as_slice::<f64>().unwrap();
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(close(g, w), "element {i}: got {g}, want {w} (all: {got:?})");
    }
}

#[track_caller]
fn check_exact<T: Element>(a: &Array, dims: &[usize], want: &[T]) {
    assert_eq!(a.leaf_type(), ty(T::DTYPE, dims), "type of {a:?}");
    assert_eq!(a.as_slice::<T>().unwrap(), want);
}

fn x23() -> Array {
    arr(&[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])
}

fn y23() -> Array {
    arr(&[2, 3], &[0.5f32, -1.0, 10.0, -4.0, 0.25, 100.0])
}

// ---- element-wise unary ----------------------------------------------------------------------

#[test]
fn unary_float_ops_match_the_catalog() {
    type Case = (&'static [f32], &'static [f32], fn(Tensor) -> Tensor);
    let cases: [Case; 8] = [
        (
            &[-3.5, 0.0, 2.0, -1e-3, 7.0, 1e30],
            &[3.5, -0.0, -2.0, 0.001, -7.0, -1e30],
            |x| -x,
        ),
        (
            &[-2.0, -0.5, 0.0, 0.5, 1.0, 3.0],
            &[
                0.135_335_28,
                0.606_530_66,
                1.0,
                1.648_721_3,
                2.718_281_8,
                20.085_537,
            ],
            Tensor::exp,
        ),
        (
            &[0.1, 0.5, 1.0, 2.0, 10.0, 1000.0],
            &[
                -2.302_585,
                -0.693_147_2,
                0.0,
                0.693_147_2,
                2.302_585,
                6.907_755_3,
            ],
            Tensor::log,
        ),
        (
            &[-3.0, -0.5, 0.0, 0.25, 1.0, 20.0],
            &[
                -0.995_054_75,
                -0.462_117_16,
                0.0,
                0.244_918_66,
                0.761_594_16,
                1.0,
            ],
            Tensor::tanh,
        ),
        (
            &[-10.0, -1.0, 0.0, 0.5, 2.0, 30.0],
            &[
                4.539_786_9e-5,
                0.268_941_42,
                0.5,
                0.622_459_3,
                0.880_797_1,
                1.0,
            ],
            Tensor::logistic,
        ),
        (
            &[0.0, 0.25, 1.0, 2.0, 9.0, 1e6],
            &[0.0, 0.5, 1.0, 1.414_213_5, 3.0, 1000.0],
            Tensor::sqrt,
        ),
        (
            &[0.25, 1.0, 2.0, 4.0, 100.0, 1e-4],
            &[2.0, 1.0, 0.707_106_77, 0.5, 0.1, 100.0],
            Tensor::rsqrt,
        ),
        (
            &[-3.5, -0.0, 0.0, 2.0, -1e-3, 7.0],
            &[3.5, 0.0, 0.0, 2.0, 0.001, 7.0],
            Tensor::abs,
        ),
    ];
    for (input, want, f) in cases {
        let x = arr(&[6], input);
        let out = run(&[("x", &x)], |i| vec![f(i[0])]);
        check_f32(&out[0], &[6], want);
    }
}

#[test]
fn unary_special_values() {
    let x = arr(&[4], &[f32::NAN, f32::INFINITY, -1.0, 0.0]);
    let out = run(&[("x", &x)], |i| {
        vec![i[0].log(), i[0].sqrt(), i[0].exp(), i[0].logistic()]
    });
    check_f32(
        &out[0],
        &[4],
        &[f32::NAN, f32::INFINITY, f32::NAN, f32::NEG_INFINITY],
    );
    check_f32(&out[1], &[4], &[f32::NAN, f32::INFINITY, f32::NAN, 0.0]);
    check_f32(&out[2], &[4], &[f32::NAN, f32::INFINITY, 0.367_879_44, 1.0]);
    check_f32(&out[3], &[4], &[f32::NAN, 1.0, 0.268_941_42, 0.5]);
    // negate flips the sign of zero; abs clears it.
    let z = arr(&[2], &[0.0f32, -0.0]);
    let out = run(&[("z", &z)], |i| vec![-i[0], i[0].abs()]);
    let neg: Vec<u32> = out[0]
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(neg, vec![(-0.0f32).to_bits(), 0.0f32.to_bits()]);
    let abs: Vec<u32> = out[1]
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(abs, vec![0, 0]);
}

#[test]
fn integer_negate_and_abs_wrap() {
    // From the catalog's add_i32 case, plus i32::MIN (whose negation and abs wrap to itself).
    let a = arr(&[6], &[7i32, -7, 100, 0, -2_147_483_647, i32::MIN]);
    let out = run(&[("a", &a)], |i| vec![-i[0], i[0].abs()]);
    check_exact(&out[0], &[6], &[-7i32, 7, -100, 0, 2_147_483_647, i32::MIN]);
    check_exact(&out[1], &[6], &[7i32, 7, 100, 0, 2_147_483_647, i32::MIN]);
    let l = arr(&[3], &[-5i64, 0, i64::MAX]);
    let out = run(&[("l", &l)], |i| vec![-i[0], i[0].abs()]);
    check_exact(&out[0], &[3], &[5i64, 0, -i64::MAX]);
    check_exact(&out[1], &[3], &[5i64, 0, i64::MAX]);
    let u = arr(&[3], &[0u8, 7, 255]);
    let out = run(&[("u", &u)], |i| vec![i[0].abs()]);
    check_exact(&out[0], &[3], &[0u8, 7, 255]);
}

#[test]
fn f64_ops_match_the_catalog() {
    let a = arr(&[3], &[0.1f64, 1e-300, std::f64::consts::PI]);
    let b = arr(&[3], &[0.2f64, 1e300, -1.0]);
    let out = run(&[("a", &a), ("b", &b)], |i| {
        vec![i[0] + i[1], i[0] * i[1], i[0].exp()]
    });
    check_f64(
        &out[0],
        &[3],
        &[0.300_000_000_000_000_04, 1e300, 2.141_592_653_589_793],
    );
    check_f64(
        &out[1],
        &[3],
        &[0.020_000_000_000_000_004, 1.0, -std::f64::consts::PI],
    );
    check_f64(
        &out[2],
        &[3],
        &[1.105_170_918_075_647_7, 1.0, 23.140_692_632_779_267],
    );
}

// ---- element-wise binary ---------------------------------------------------------------------

#[test]
fn binary_float_ops_match_the_catalog() {
    let (a, b) = (x23(), y23());
    let out = run(&[("a", &a), ("b", &b)], |i| {
        let (a, b) = (i[0], i[1]);
        vec![a + b, a - b, a * b, a / b, a.maximum(b), a.minimum(b)]
    });
    check_f32(&out[0], &[2, 3], &[1.5, 1.0, 13.0, 0.0, 5.25, 106.0]);
    check_f32(&out[1], &[2, 3], &[0.5, 3.0, -7.0, 8.0, 4.75, -94.0]);
    check_f32(&out[2], &[2, 3], &[0.5, -2.0, 30.0, -16.0, 1.25, 600.0]);
    check_f32(&out[3], &[2, 3], &[2.0, -2.0, 0.3, -1.0, 20.0, 0.06]);
    check_f32(&out[4], &[2, 3], &[1.0, 2.0, 10.0, 4.0, 5.0, 100.0]);
    check_f32(&out[5], &[2, 3], &[0.5, -1.0, 3.0, -4.0, 0.25, 6.0]);
}

#[test]
fn float_power_matches_the_catalog() {
    let x = arr(&[6], &[2.0f32, -2.0, 4.0, 0.5, 9.0, 3.0]);
    let y = arr(&[6], &[3.0f32, 3.0, 0.5, -1.0, 0.5, 0.0]);
    let out = run(&[("x", &x), ("y", &y)], |i| {
        vec![i[0].pow(i[1]), i[0].pow(2.0)]
    });
    check_f32(&out[0], &[6], &[8.0, -8.0, 2.0, 2.0, 3.0, 1.0]);
    check_f32(&out[1], &[6], &[4.0, 4.0, 16.0, 0.25, 81.0, 9.0]);
}

#[test]
fn float_division_by_zero_and_nan_in_max_min() {
    let a = arr(&[5], &[1.0f32, -1.0, 0.0, f32::NAN, 1.0]);
    let b = arr(&[5], &[0.0f32, 0.0, 0.0, 1.0, f32::NAN]);
    let out = run(&[("a", &a), ("b", &b)], |i| {
        vec![i[0] / i[1], i[0].maximum(i[1]), i[0].minimum(i[1])]
    });
    check_f32(
        &out[0],
        &[5],
        &[
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::NAN,
            f32::NAN,
        ],
    );
    // XLA's maximum/minimum propagate NaN from either side.
    check_f32(&out[1], &[5], &[1.0, 0.0, 0.0, f32::NAN, f32::NAN]);
    check_f32(&out[2], &[5], &[0.0, -1.0, 0.0, f32::NAN, f32::NAN]);
    // -0 orders below +0.
    let p = arr(&[2], &[-0.0f32, 0.0]);
    let q = arr(&[2], &[0.0f32, -0.0]);
    let out = run(&[("p", &p), ("q", &q)], |i| {
        vec![i[0].maximum(i[1]), i[0].minimum(i[1])]
    });
    let bits = |a: &Array| {
        a.as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&out[0]), vec![0, 0]);
    assert_eq!(bits(&out[1]), vec![(-0.0f32).to_bits(); 2]);
}

#[test]
fn integer_arithmetic_wraps() {
    // The catalog's add_i32 case.
    let a = arr(&[5], &[7i32, -7, 100, 0, -2_147_483_647]);
    let b = arr(&[5], &[2i32, 2, -3, 5, 1]);
    let out = run(&[("a", &a), ("b", &b)], |i| {
        vec![
            i[0] + i[1],
            i[0] - i[1],
            i[0] * i[1],
            i[0].maximum(i[1]),
            i[0].minimum(i[1]),
        ]
    });
    check_exact(&out[0], &[5], &[9i32, -5, 97, 5, -2_147_483_646]);
    check_exact(&out[1], &[5], &[5i32, -9, 103, -5, -2_147_483_648]);
    check_exact(&out[2], &[5], &[14i32, -14, -300, 0, -2_147_483_647]);
    check_exact(&out[3], &[5], &[7i32, 2, 100, 5, 1]);
    check_exact(&out[4], &[5], &[2i32, -7, -3, 0, -2_147_483_647]);
    // Overflow wraps.
    let a = arr(&[3], &[i32::MAX, i32::MIN, 65_536]);
    let b = arr(&[3], &[1i32, 1, 65_536]);
    let out = run(&[("a", &a), ("b", &b)], |i| {
        vec![i[0] + i[1], i[0] - i[1], i[0] * i[1]]
    });
    check_exact(&out[0], &[3], &[i32::MIN, i32::MIN + 1, 131_072]);
    check_exact(&out[1], &[3], &[i32::MAX - 1, i32::MAX, 0]);
    check_exact(&out[2], &[3], &[i32::MAX, i32::MIN, 0]);
    let u = arr(&[3], &[250u8, 3, 16]);
    let v = arr(&[3], &[10u8, 5, 16]);
    let out = run(&[("u", &u), ("v", &v)], |i| {
        vec![i[0] + i[1], i[0] - i[1], i[0] * i[1]]
    });
    check_exact(&out[0], &[3], &[4u8, 8, 32]);
    check_exact(&out[1], &[3], &[240u8, 254, 0]);
    check_exact(&out[2], &[3], &[196u8, 15, 0]);
}

#[test]
fn integer_division_truncates_and_never_traps() {
    // The catalog's divide_i32 case: truncation toward zero.
    let a = arr(&[4], &[7i32, -7, 7, -7]);
    let b = arr(&[4], &[2i32, 2, -2, -2]);
    let out = run(&[("a", &a), ("b", &b)], |i| vec![i[0] / i[1]]);
    check_exact(&out[0], &[4], &[3i32, -3, -3, 3]);
    // XLA: x / 0 = -1 (all bits set) and MIN / -1 = MIN.
    let a = arr(&[4], &[5i32, -5, 0, i32::MIN]);
    let b = arr(&[4], &[0i32, 0, 0, -1]);
    let out = run(&[("a", &a), ("b", &b)], |i| vec![i[0] / i[1]]);
    check_exact(&out[0], &[4], &[-1i32, -1, -1, i32::MIN]);
    let a = arr(&[3], &[9i64, i64::MIN, -9]);
    let b = arr(&[3], &[0i64, -1, 4]);
    let out = run(&[("a", &a), ("b", &b)], |i| vec![i[0] / i[1]]);
    check_exact(&out[0], &[3], &[-1i64, i64::MIN, -2]);
    let a = arr(&[3], &[7u8, 200, 9]);
    let b = arr(&[3], &[0u8, 3, 10]);
    let out = run(&[("a", &a), ("b", &b)], |i| vec![i[0] / i[1]]);
    check_exact(&out[0], &[3], &[255u8, 66, 0]);
}

#[test]
fn integer_power_by_squaring() {
    let a = arr(&[11], &[2i32, 3, -2, 2, 1, -1, -1, 5, 0, 2, 2]);
    let b = arr(&[11], &[10i32, 4, 3, -1, -5, -3, -4, 0, 0, 31, 32]);
    let out = run(&[("a", &a), ("b", &b)], |i| vec![i[0].pow(i[1])]);
    // Negative exponents: 1 for base 1, ±1 for base -1, else 0. Overflow wraps.
    check_exact(
        &out[0],
        &[11],
        &[1024i32, 81, -8, 0, 1, -1, 1, 1, 1, i32::MIN, 0],
    );
    let u = arr(&[3], &[2u8, 3, 16]);
    let v = arr(&[3], &[7u8, 5, 2]);
    let out = run(&[("u", &u), ("v", &v)], |i| vec![i[0].pow(i[1])]);
    check_exact(&out[0], &[3], &[128u8, 243, 0]);
}

#[test]
fn bool_maximum_is_or_and_minimum_is_and() {
    let p = arr(&[4], &[true, true, false, false]);
    let q = arr(&[4], &[true, false, true, false]);
    let out = run(&[("p", &p), ("q", &q)], |i| {
        vec![i[0].maximum(i[1]), i[0].minimum(i[1])]
    });
    check_exact(&out[0], &[4], &[true, true, true, false]);
    check_exact(&out[1], &[4], &[true, false, false, false]);
}

#[test]
fn relu() {
    let x = arr(&[2, 2], &[-1.0f32, 0.0, 2.5, -0.5]);
    let out = run(&[("x", &x)], |i| {
        vec![i[0].relu(), nn::relu(i[0]), nn::sigmoid(i[0])]
    });
    check_f32(&out[0], &[2, 2], &[0.0, 0.0, 2.5, 0.0]);
    check_f32(&out[1], &[2, 2], &[0.0, 0.0, 2.5, 0.0]);
    check_f32(
        &out[2],
        &[2, 2],
        &[0.268_941_42, 0.5, 0.924_141_8, 0.377_540_67],
    );
}

// ---- broadcasting ----------------------------------------------------------------------------

#[test]
fn scalars_broadcast_against_matrices() {
    let x = x23();
    let out = run(&[("x", &x)], |i| {
        let x = i[0];
        vec![x + 1.0, 2.0 * x, 10.0 - x, x / 2.0, 12.0 / x]
    });
    check_f32(&out[0], &[2, 3], &[2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    check_f32(&out[1], &[2, 3], &[2.0, 4.0, 6.0, 8.0, 10.0, 12.0]);
    check_f32(&out[2], &[2, 3], &[9.0, 8.0, 7.0, 6.0, 5.0, 4.0]);
    check_f32(&out[3], &[2, 3], &[0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
    check_f32(&out[4], &[2, 3], &[12.0, 6.0, 4.0, 3.0, 2.4, 2.0]);
    // A rank-0 tensor input broadcasts too.
    let s = Array::scalar(0.5f32);
    let out = run(&[("x", &x), ("s", &s)], |i| vec![i[0] * i[1], i[1] - i[0]]);
    check_f32(&out[0], &[2, 3], &[0.5, 1.0, 1.5, 2.0, 2.5, 3.0]);
    check_f32(&out[1], &[2, 3], &[-0.5, -1.5, -2.5, -3.5, -4.5, -5.5]);
}

#[test]
fn rows_and_columns_broadcast_against_matrices() {
    let x = x23();
    let r = arr(&[3], &[10.0f32, 20.0, 30.0]);
    let c = arr(&[2, 1], &[100.0f32, 200.0]);
    let out = run(&[("x", &x), ("r", &r), ("c", &c)], |i| {
        let (x, r, c) = (i[0], i[1], i[2]);
        vec![
            x + r,
            r - x,
            x * c,
            c - r,
            r.broadcast_to(&[2, 3]),
            c.broadcast_to(&[2, 2, 3]),
        ]
    });
    check_f32(&out[0], &[2, 3], &[11.0, 22.0, 33.0, 14.0, 25.0, 36.0]);
    check_f32(&out[1], &[2, 3], &[9.0, 18.0, 27.0, 6.0, 15.0, 24.0]);
    check_f32(
        &out[2],
        &[2, 3],
        &[100.0, 200.0, 300.0, 800.0, 1000.0, 1200.0],
    );
    check_f32(&out[3], &[2, 3], &[90.0, 80.0, 70.0, 190.0, 180.0, 170.0]);
    check_f32(&out[4], &[2, 3], &[10.0, 20.0, 30.0, 10.0, 20.0, 30.0]);
    let col = [100.0, 100.0, 100.0, 200.0, 200.0, 200.0];
    check_f32(&out[5], &[2, 2, 3], &[col, col].concat());
}

#[test]
fn broadcast_in_dim_matches_the_catalog() {
    // Built by hand: the tracer only emits trailing-aligned maps, the op is general.
    let s = Array::scalar(2.5f32);
    let r = arr(&[3], &[1.0f32, 2.0, 3.0]);
    let c = arr(&[2], &[10.0f32, 20.0]);
    let m = arr(&[2, 1], &[-1.0f32, 7.0]);
    let mut g = graph_of(&[("s", &s), ("r", &r), ("c", &c), ("m", &m)], |i| {
        i.to_vec()
    });
    let out23 = ty(DType::F32, &[2, 3]);
    let mut outs = Vec::new();
    for (input, dims) in [(0u32, vec![]), (1, vec![1]), (2, vec![0]), (3, vec![0, 1])] {
        outs.push(g.push(Op::BroadcastInDim { dims }, vec![input], out23.clone()));
    }
    // A column broadcast into the middle of a rank-3 result: operand dim 0 → result dim 1.
    outs.push(g.push(
        Op::BroadcastInDim { dims: vec![1] },
        vec![2],
        ty(DType::F32, &[2, 2, 2]),
    ));
    g.outputs = outs;
    let out = interp::run(&g, &[s, r, c, m]).unwrap();
    check_f32(&out[0], &[2, 3], &[2.5; 6]);
    check_f32(&out[1], &[2, 3], &[1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    check_f32(&out[2], &[2, 3], &[10.0, 10.0, 10.0, 20.0, 20.0, 20.0]);
    check_f32(&out[3], &[2, 3], &[-1.0, -1.0, -1.0, 7.0, 7.0, 7.0]);
    check_f32(
        &out[4],
        &[2, 2, 2],
        &[10.0, 10.0, 20.0, 20.0, 10.0, 10.0, 20.0, 20.0],
    );
}

// ---- comparisons and selection ---------------------------------------------------------------

#[test]
fn float_comparisons_are_ieee() {
    // The catalog's compare_f32 case: NaN is unordered (only NE holds), -0 == 0.
    let a = arr(&[6], &[1.0f32, 2.0, 3.0, f32::NAN, -0.0, f32::INFINITY]);
    let b = arr(&[6], &[2.0f32, 2.0, 1.0, 1.0, 0.0, f32::INFINITY]);
    let out = run(&[("a", &a), ("b", &b)], |i| {
        let (a, b) = (i[0], i[1]);
        vec![
            a.equal(b),
            a.not_equal(b),
            a.less(b),
            a.less_equal(b),
            a.greater(b),
            a.greater_equal(b),
        ]
    });
    let want: [[u8; 6]; 6] = [
        [0, 1, 0, 0, 1, 1],
        [1, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1],
        [0, 0, 1, 0, 0, 0],
        [0, 1, 1, 0, 1, 1],
    ];
    for (o, w) in out.iter().zip(want) {
        check_exact(o, &[6], &w.map(|b| b == 1));
    }
    // NaN compared with itself.
    let n = arr(&[1], &[f32::NAN]);
    let out = run(&[("n", &n)], |i| {
        vec![
            i[0].equal(i[0]),
            i[0].not_equal(i[0]),
            i[0].greater_equal(i[0]),
        ]
    });
    check_exact(&out[0], &[1], &[false]);
    check_exact(&out[1], &[1], &[true]);
    check_exact(&out[2], &[1], &[false]);
}

#[test]
fn integer_comparisons_match_the_catalog() {
    let a = arr(&[6], &[1i32, 2, 3, -5, 0, 2_147_483_647]);
    let b = arr(&[6], &[2i32, 2, 1, -6, 0, -2_147_483_648]);
    let out = run(&[("a", &a), ("b", &b)], |i| {
        let (a, b) = (i[0], i[1]);
        vec![
            a.equal(b),
            a.not_equal(b),
            a.less(b),
            a.less_equal(b),
            a.greater(b),
            a.greater_equal(b),
        ]
    });
    let want: [[u8; 6]; 6] = [
        [0, 1, 0, 0, 1, 0],
        [1, 0, 1, 1, 0, 1],
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [0, 0, 1, 1, 0, 1],
        [0, 1, 1, 1, 1, 1],
    ];
    for (o, w) in out.iter().zip(want) {
        check_exact(o, &[6], &w.map(|b| b == 1));
    }
    // u8 compares unsigned; scalars broadcast.
    let u = arr(&[3], &[0u8, 128, 255]);
    let out = run(&[("u", &u)], |i| vec![i[0].greater(127.0)]);
    check_exact(&out[0], &[3], &[false, true, true]);
}

#[test]
fn select_matches_the_catalog() {
    let p = arr(&[2, 3], &[true, false, true, false, false, true]);
    let (a, b) = (x23(), y23());
    let out = run(&[("p", &p), ("a", &a), ("b", &b)], |i| {
        vec![Tensor::select(i[0], i[1], i[2])]
    });
    check_f32(&out[0], &[2, 3], &[1.0, -1.0, 3.0, -4.0, 0.25, 6.0]);
    // A scalar predicate picks whole tensors (the catalog's select_scalar_pred).
    for (pred, want) in [(false, y23()), (true, x23())] {
        let p = Array::scalar(pred);
        let out = run(&[("p", &p), ("a", &a), ("b", &b)], |i| {
            vec![Tensor::select(i[0], i[1], i[2])]
        });
        assert_eq!(out[0], want);
    }
    // Values broadcast: a scalar on one side, a row on the other.
    let r = arr(&[3], &[7.0f32, 8.0, 9.0]);
    let out = run(&[("a", &a), ("r", &r)], |i| {
        vec![Tensor::select(i[0].greater(3.0), i[1], 0.0)]
    });
    check_f32(&out[0], &[2, 3], &[0.0, 0.0, 0.0, 7.0, 8.0, 9.0]);
}

// ---- conversion ------------------------------------------------------------------------------

#[test]
fn convert_matches_the_catalog() {
    let f = arr(&[5], &[2.7f32, -2.7, 0.5, -0.5, 100.99]);
    let i = arr(&[3], &[-3i32, 0, 16_777_216]);
    let p = arr(&[3], &[true, false, true]);
    let out = run(&[("f", &f), ("i", &i), ("p", &p)], |t| {
        vec![
            t[0].convert(DType::I32),
            t[1].convert(DType::F32),
            t[2].convert(DType::F32),
        ]
    });
    check_exact(&out[0], &[5], &[2i32, -2, 0, 0, 100]);
    check_f32(&out[1], &[3], &[-3.0, 0.0, 16_777_216.0]);
    check_f32(&out[2], &[3], &[1.0, 0.0, 1.0]);

    // The catalog's convert_more case.
    let f = arr(&[4], &[0.0f32, 1.5, 200.75, 0.25]);
    let d = arr(&[2], &[0.1f64, -2.5]);
    let l = arr(&[3], &[-7i64, 0, 2_147_483_647]);
    let i = arr(&[4], &[0i32, -1, 2, 0]);
    let u = arr(&[3], &[0u8, 128, 255]);
    let out = run(
        &[("f", &f), ("d", &d), ("l", &l), ("i", &i), ("u", &u)],
        |t| {
            vec![
                t[0].convert(DType::F64),
                t[1].convert(DType::F32),
                t[2].convert(DType::I32),
                t[3].convert(DType::I64),
                t[0].convert(DType::U8),
                t[4].convert(DType::F32),
                t[3].convert(DType::Bool),
                t[0].convert(DType::Bool),
            ]
        },
    );
    check_f64(&out[0], &[4], &[0.0, 1.5, 200.75, 0.25]);
    check_f32(&out[1], &[2], &[0.1, -2.5]);
    check_exact(&out[2], &[3], &[-7i32, 0, 2_147_483_647]);
    check_exact(&out[3], &[4], &[0i64, -1, 2, 0]);
    check_exact(&out[4], &[4], &[0u8, 1, 200, 0]);
    check_f32(&out[5], &[3], &[0.0, 128.0, 255.0]);
    check_exact(&out[6], &[4], &[false, true, true, false]);
    check_exact(&out[7], &[4], &[false, true, true, true]);
}

#[test]
fn convert_edge_cases_truncate_and_saturate() {
    let f = arr(
        &[9],
        &[
            2.7f32,
            -2.7,
            f32::NAN,
            3e9,
            -3e9,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.9,
            255.9,
        ],
    );
    let out = run(&[("f", &f)], |t| {
        vec![
            t[0].convert(DType::I32),
            t[0].convert(DType::U8),
            t[0].convert(DType::I64),
            t[0].convert(DType::Bool),
        ]
    });
    check_exact(
        &out[0],
        &[9],
        &[2i32, -2, 0, i32::MAX, i32::MIN, i32::MAX, i32::MIN, 0, 255],
    );
    check_exact(&out[1], &[9], &[2u8, 0, 0, 255, 0, 255, 0, 0, 255]);
    check_exact(
        &out[2],
        &[9],
        &[
            2i64,
            -2,
            0,
            3_000_000_000,
            -3_000_000_000,
            i64::MAX,
            i64::MIN,
            0,
            255,
        ],
    );
    check_exact(
        &out[3],
        &[9],
        &[true, true, true, true, true, true, true, true, true],
    );
    // -1 and 300 to u8 saturate; -0.0 to bool is false.
    let g = arr(&[3], &[-1.0f64, 300.0, -0.0]);
    let out = run(&[("g", &g)], |t| {
        vec![t[0].convert(DType::U8), t[0].convert(DType::Bool)]
    });
    check_exact(&out[0], &[3], &[0u8, 255, 0]);
    check_exact(&out[1], &[3], &[true, true, false]);
    // Integer narrowing keeps the low bits; integer to float rounds to nearest.
    let l = arr(&[3], &[(1i64 << 32) + 5, -1, 2_147_483_648]);
    let i = arr(&[3], &[263i32, -1, 16_777_217]);
    let out = run(&[("l", &l), ("i", &i)], |t| {
        vec![
            t[0].convert(DType::I32),
            t[1].convert(DType::U8),
            t[1].convert(DType::F32),
            t[0].convert(DType::U8),
        ]
    });
    check_exact(&out[0], &[3], &[5i32, -1, i32::MIN]);
    check_exact(&out[1], &[3], &[7u8, 255, 1]);
    check_f32(&out[2], &[3], &[263.0, -1.0, 16_777_216.0]);
    check_exact(&out[3], &[3], &[5u8, 255, 0]);
    // bool to integers is 0/1.
    let p = arr(&[2], &[true, false]);
    let out = run(&[("p", &p)], |t| {
        vec![
            t[0].convert(DType::I32),
            t[0].convert(DType::U8),
            t[0].convert(DType::F64),
        ]
    });
    check_exact(&out[0], &[2], &[1i32, 0]);
    check_exact(&out[1], &[2], &[1u8, 0]);
    check_f64(&out[2], &[2], &[1.0, 0.0]);
}

// ---- shapes ----------------------------------------------------------------------------------

#[test]
fn reshape_matches_the_catalog() {
    let x = x23();
    let one = arr(&[1], &[42.0f32]);
    let out = run(&[("x", &x), ("one", &one)], |i| {
        vec![
            i[0].reshape(&[3, 2]),
            i[0].reshape(&[6]),
            i[0].reshape(&[1, 2, 3]),
            i[1].reshape(&[]),
        ]
    });
    let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    check_f32(&out[0], &[3, 2], &v);
    check_f32(&out[1], &[6], &v);
    check_f32(&out[2], &[1, 2, 3], &v);
    check_f32(&out[3], &[], &[42.0]);
}

#[test]
fn transpose_matches_the_catalog() {
    let x = x23();
    let t: Vec<f32> = (0..24).map(|v| v as f32).collect();
    let y = arr(&[2, 3, 4], &t);
    let out = run(&[("x", &x), ("y", &y)], |i| {
        vec![
            i[0].t(),
            i[1].transpose(&[2, 0, 1]),
            i[1].transpose(&[0, 1, 2]),
        ]
    });
    check_f32(&out[0], &[3, 2], &[1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    check_f32(
        &out[1],
        &[4, 2, 3],
        &[
            0.0, 4.0, 8.0, 12.0, 16.0, 20.0, 1.0, 5.0, 9.0, 13.0, 17.0, 21.0, 2.0, 6.0, 10.0, 14.0,
            18.0, 22.0, 3.0, 7.0, 11.0, 15.0, 19.0, 23.0,
        ],
    );
    check_f32(&out[2], &[2, 3, 4], &t);
}

#[test]
fn slices_with_and_without_strides() {
    let x = arr(
        &[3, 4],
        &[
            0.0f32, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0, 20.0, 21.0, 22.0, 23.0,
        ],
    );
    let v = arr(&[6], &[0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let out = run(&[("x", &x), ("v", &v)], |i| {
        let (x, v) = (i[0], i[1]);
        vec![
            x.slice_strided(&[1, 0], &[3, 4], &[1, 2]),
            x.slice(&[0, 1], &[1, 4]),
            v.slice_strided(&[1], &[5], &[2]),
            x.slice_strided(&[0, 1], &[3, 4], &[2, 2]),
            v.slice_strided(&[0], &[6], &[4]),
            x.slice(&[1, 1], &[1, 4]),
        ]
    });
    check_f32(&out[0], &[2, 2], &[10.0, 12.0, 20.0, 22.0]);
    check_f32(&out[1], &[1, 3], &[1.0, 2.0, 3.0]);
    check_f32(&out[2], &[2], &[1.0, 3.0]);
    check_f32(&out[3], &[2, 2], &[1.0, 3.0, 21.0, 23.0]);
    check_f32(&out[4], &[2], &[0.0, 4.0]);
    check_f32(&out[5], &[0, 3], &[]);
}

#[test]
fn concatenate_two_and_three() {
    let a = arr(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]);
    let b = arr(&[2, 3], &[10.0f32, 11.0, 12.0, 13.0, 14.0, 15.0]);
    let c = arr(&[1, 2], &[-1.0f32, -2.0]);
    let out = run(&[("a", &a), ("b", &b), ("c", &c)], |i| {
        vec![
            Tensor::concatenate(&[i[0], i[1]], 1),
            Tensor::concatenate(&[i[0], i[2], i[0]], 0),
        ]
    });
    check_f32(
        &out[0],
        &[2, 5],
        &[1.0, 2.0, 10.0, 11.0, 12.0, 3.0, 4.0, 13.0, 14.0, 15.0],
    );
    check_f32(
        &out[1],
        &[5, 2],
        &[1.0, 2.0, 3.0, 4.0, -1.0, -2.0, 1.0, 2.0, 3.0, 4.0],
    );
    // Three along the last axis of rank 3, integers.
    let p = arr(&[2, 1, 1], &[1i32, 2]);
    let q = arr(&[2, 1, 2], &[3i32, 4, 5, 6]);
    let out = run(&[("p", &p), ("q", &q)], |i| {
        vec![Tensor::concatenate(&[i[1], i[0], i[1]], 2)]
    });
    check_exact(&out[0], &[2, 1, 5], &[3i32, 4, 1, 3, 4, 5, 6, 2, 5, 6]);
}

#[test]
fn zero_element_tensors() {
    // The catalog's empty_tensor case.
    let e = arr::<f32>(&[0, 3], &[]);
    let x = x23();
    let out = run(&[("e", &e), ("x", &x)], |i| {
        vec![
            i[0].sum(&[0]),
            Tensor::concatenate(&[i[0], i[1]], 0),
            -i[0],
            i[0].max(&[0]),
            i[0].min(&[0]),
        ]
    });
    check_f32(&out[0], &[3], &[0.0, 0.0, 0.0]);
    assert_eq!(out[1], x);
    check_f32(&out[2], &[0, 3], &[]);
    check_f32(&out[3], &[3], &[f32::NEG_INFINITY; 3]);
    check_f32(&out[4], &[3], &[f32::INFINITY; 3]);
    let ei = arr::<i32>(&[2, 0], &[]);
    let eu = arr::<u8>(&[0], &[]);
    let out = run(&[("ei", &ei), ("eu", &eu)], |i| {
        vec![
            i[0].max(&[1]),
            i[0].min(&[1]),
            i[0].sum(&[1]),
            i[1].max(&[0]),
        ]
    });
    check_exact(&out[0], &[2], &[i32::MIN; 2]);
    check_exact(&out[1], &[2], &[i32::MAX; 2]);
    check_exact(&out[2], &[2], &[0i32; 2]);
    check_exact(&out[3], &[], &[0u8]);
    // Products with an empty free dim, or an empty contraction (all zeros).
    let a = arr::<f32>(&[0, 3], &[]);
    let b = arr(&[3, 2], &[1.0f32; 6]);
    let c = arr::<f32>(&[2, 0], &[]);
    let d = arr::<f32>(&[0, 3], &[]);
    let out = run(&[("a", &a), ("b", &b), ("c", &c), ("d", &d)], |i| {
        vec![i[0].matmul(i[1]), i[2].matmul(i[3])]
    });
    check_f32(&out[0], &[0, 2], &[]);
    check_f32(&out[1], &[2, 3], &[0.0; 6]);
}

// ---- products --------------------------------------------------------------------------------

#[test]
fn matmul_matches_the_catalog() {
    let a = x23();
    let b = arr(
        &[3, 4],
        &[
            1.0f32, 0.0, -1.0, 2.0, 0.5, 1.0, 0.0, -2.0, 3.0, -1.0, 2.0, 0.25,
        ],
    );
    let out = run(&[("a", &a), ("b", &b)], |i| vec![i[0].matmul(i[1])]);
    check_f32(
        &out[0],
        &[2, 4],
        &[11.0, -1.0, 5.0, -1.25, 24.5, -1.0, 8.0, -0.5],
    );
}

#[test]
fn batched_matmul_matches_the_catalog() {
    let a = arr(
        &[2, 2, 3],
        &[
            1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, -1.0, 0.0, 1.0, 2.0, -2.0, 0.5,
        ],
    );
    let b = arr(
        &[2, 3, 2],
        &[
            1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, -1.0, 0.5, 3.0, 1.0, 1.0,
        ],
    );
    let want = [4.0, 5.0, 10.0, 11.0, -1.0, 2.0, 3.5, -7.5];
    let out = run(&[("a", &a), ("b", &b)], |i| {
        let dims = DotDims {
            lhs_batch: vec![0],
            rhs_batch: vec![0],
            lhs_contract: vec![2],
            rhs_contract: vec![1],
        };
        vec![i[0].matmul(i[1]), i[0].dot_general(i[1], dims)]
    });
    check_f32(&out[0], &[2, 2, 2], &want);
    check_f32(&out[1], &[2, 2, 2], &want);
}

#[test]
fn transposed_contraction_matches_the_catalog() {
    // a^T · b with contracting dims [0] x [0], no transpose op.
    let a = arr(&[3, 2], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let b = arr(
        &[3, 4],
        &[
            1.0f32, 0.0, -1.0, 2.0, 0.5, 1.0, 0.0, -2.0, 3.0, -1.0, 2.0, 0.25,
        ],
    );
    let out = run(&[("a", &a), ("b", &b)], |i| {
        let dims = DotDims {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contract: vec![0],
            rhs_contract: vec![0],
        };
        vec![i[0].dot_general(i[1], dims), i[0].t().matmul(i[1])]
    });
    let want = [17.5, -2.0, 9.0, -2.75, 22.0, -2.0, 10.0, -2.5];
    check_f32(&out[0], &[2, 4], &want);
    check_f32(&out[1], &[2, 4], &want);
    // a · b^T with contracting dims [1] x [1].
    let c = arr(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]);
    let d = arr(&[3, 2], &[1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0]);
    let out = run(&[("c", &c), ("d", &d)], |i| {
        let dims = DotDims {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contract: vec![1],
            rhs_contract: vec![1],
        };
        vec![i[0].dot_general(i[1], dims)]
    });
    check_f32(&out[0], &[2, 3], &[1.0, 2.0, 3.0, 3.0, 4.0, 7.0]);
}

#[test]
fn dot_general_with_inner_batch_dims_and_two_contractions() {
    // lhs [k=3, b=2] (batch dim 1), rhs [b=2, k=3, n=2]: out[b, n] = Σ_k l[k, b] r[b, k, n].
    let l = arr(&[3, 2], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let r = arr(
        &[2, 3, 2],
        &[
            1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 1.0, 0.0, 0.0, 1.0, -1.0,
        ],
    );
    let out = run(&[("l", &l), ("r", &r)], |i| {
        let dims = DotDims {
            lhs_batch: vec![1],
            rhs_batch: vec![0],
            lhs_contract: vec![0],
            rhs_contract: vec![1],
        };
        vec![i[0].dot_general(i[1], dims)]
    });
    check_f32(&out[0], &[2, 2], &[6.0, 8.0, 10.0, -4.0]);
    // Two contracting dims, paired crosswise: out[b] = Σ_ij l[b, i, j] r[j, i].
    let l = arr(&[2, 2, 2], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    let r = arr(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]);
    let out = run(&[("l", &l), ("r", &r)], |i| {
        let crossed = DotDims {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contract: vec![1, 2],
            rhs_contract: vec![1, 0],
        };
        let straight = DotDims {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contract: vec![1, 2],
            rhs_contract: vec![0, 1],
        };
        vec![
            i[0].dot_general(i[1], crossed),
            i[0].dot_general(i[1], straight),
        ]
    });
    check_f32(&out[0], &[2], &[29.0, 69.0]);
    check_f32(&out[1], &[2], &[30.0, 70.0]);
    // Batch dims on both sides in different positions, with free dims on both: lhs [m=2, b=2, k=2],
    // rhs [k=2, n=1, b=2]; out[b, m, n] = Σ_k l[m, b, k] r[k, n, b].
    let l = arr(&[2, 2, 2], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    let r = arr(&[2, 1, 2], &[1.0f32, -1.0, 10.0, 100.0]);
    let out = run(&[("l", &l), ("r", &r)], |i| {
        let dims = DotDims {
            lhs_batch: vec![1],
            rhs_batch: vec![2],
            lhs_contract: vec![2],
            rhs_contract: vec![0],
        };
        vec![i[0].dot_general(i[1], dims)]
    });
    // b=0: r[:,0,0] = [1, 10]; m=0: l[0,0,:] = [1,2] → 21; m=1: l[1,0,:] = [5,6] → 65.
    // b=1: r[:,0,1] = [-1, 100]; m=0: l[0,1,:] = [3,4] → 397; m=1: l[1,1,:] = [7,8] → 793.
    check_f32(&out[0], &[2, 2, 1], &[21.0, 65.0, 397.0, 793.0]);
}

#[test]
fn vector_products() {
    let v = arr(&[3], &[1.0f32, 2.0, 3.0]);
    let m = arr(&[3, 2], &[1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0]);
    let n = arr(&[2, 3], &[1.0f32, 1.0, 1.0, 0.0, -1.0, 2.0]);
    let out = run(&[("v", &v), ("m", &m), ("n", &n)], |i| {
        vec![i[0].matmul(i[1]), i[2].matmul(i[0]), i[0].matmul(i[0])]
    });
    check_f32(&out[0], &[2], &[4.0, 5.0]);
    check_f32(&out[1], &[2], &[6.0, 4.0]);
    check_f32(&out[2], &[], &[14.0]);
}

#[test]
fn integer_products_wrap() {
    let a = arr(&[2, 2], &[1i32, 2, 3, 4]);
    let b = arr(&[2, 2], &[5i32, 6, 7, 8]);
    let out = run(&[("a", &a), ("b", &b)], |i| vec![i[0].matmul(i[1])]);
    check_exact(&out[0], &[2, 2], &[19i32, 22, 43, 50]);
    let a = arr(&[1, 2], &[65_536i64 * 65_536, 3]);
    let b = arr(&[2, 1], &[1i64 << 31, 2]);
    let out = run(&[("a", &a), ("b", &b)], |i| vec![i[0].matmul(i[1])]);
    check_exact(&out[0], &[1, 1], &[(1i64 << 63).wrapping_add(6)]);
    let a = arr(&[1, 2], &[16u8, 3]);
    let b = arr(&[2, 1], &[16u8, 2]);
    let out = run(&[("a", &a), ("b", &b)], |i| vec![i[0].matmul(i[1])]);
    check_exact(&out[0], &[1, 1], &[6u8]);
}

#[test]
fn a_32x64_by_64x128_matmul() {
    // Small integers, so every product and sum is exact in f32; the expected values come from a
    // plain triple loop here.
    let (m, k, n) = (32, 64, 128);
    let a: Vec<f32> = (0..m * k)
        .map(|x| ((x / k * 7 + x % k * 3) % 11) as f32 - 5.0)
        .collect();
    let b: Vec<f32> = (0..k * n)
        .map(|x| ((x / n * 5 + x % n * 2) % 13) as f32 - 6.0)
        .collect();
    let mut want = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            want[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    let (aa, bb) = (arr(&[m, k], &a), arr(&[k, n], &b));
    let out = run(&[("a", &aa), ("b", &bb)], |i| vec![i[0].matmul(i[1])]);
    check_exact(&out[0], &[m, n], &want);
}

// ---- reductions ------------------------------------------------------------------------------

#[test]
fn sums_over_each_axis_all_axes_and_kept() {
    let x = arr(&[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.5]);
    let out = run(&[("x", &x)], |i| {
        let x = i[0];
        vec![
            x.sum(&[0]),
            x.sum(&[1]),
            x.sum(&[0, 1]),
            x.sum_all(),
            x.sum_keep(&[1]),
            x.sum_keep(&[0]),
            x.sum(&[]),
        ]
    });
    check_f32(&out[0], &[3], &[5.0, 7.0, 9.5]);
    check_f32(&out[1], &[2], &[6.0, 15.5]);
    check_f32(&out[2], &[], &[21.5]);
    check_f32(&out[3], &[], &[21.5]);
    check_f32(&out[4], &[2, 1], &[6.0, 15.5]);
    check_f32(&out[5], &[1, 3], &[5.0, 7.0, 9.5]);
    check_f32(&out[6], &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);
    // Rank 3 over the outer and inner axes: t[i, j, k] = 6i + 2j + k.
    let t: Vec<f32> = (0..12).map(|v| v as f32).collect();
    let t = arr(&[2, 3, 2], &t);
    let out = run(&[("t", &t)], |i| {
        vec![i[0].sum(&[0, 2]), i[0].sum(&[1]), i[0].sum_keep(&[0, 2])]
    });
    check_f32(&out[0], &[3], &[14.0, 22.0, 30.0]);
    check_f32(&out[1], &[2, 2], &[6.0, 9.0, 24.0, 27.0]);
    check_f32(&out[2], &[1, 3, 1], &[14.0, 22.0, 30.0]);
}

#[test]
fn max_min_and_mean() {
    // The catalog's reduce_max case, plus min and mean.
    let x = arr(&[2, 3], &[-5.0f32, -1.5, -7.0, -0.25, -9.0, -3.0]);
    let out = run(&[("x", &x)], |i| {
        let x = i[0];
        vec![
            x.max(&[1]),
            x.max(&[0]),
            x.max(&[0, 1]),
            x.min(&[1]),
            x.min(&[0]),
            x.max_keep(&[1]),
            x.mean(&[0]),
            x.mean(&[1]),
            x.mean_all(),
            x.mean_keep(&[0]),
        ]
    });
    check_f32(&out[0], &[2], &[-1.5, -0.25]);
    check_f32(&out[1], &[3], &[-0.25, -1.5, -3.0]);
    check_f32(&out[2], &[], &[-0.25]);
    check_f32(&out[3], &[2], &[-7.0, -9.0]);
    check_f32(&out[4], &[3], &[-5.0, -9.0, -7.0]);
    check_f32(&out[5], &[2, 1], &[-1.5, -0.25]);
    check_f32(&out[6], &[3], &[-2.625, -5.25, -5.0]);
    check_f32(&out[7], &[2], &[-4.5, -4.083_333_5]);
    check_f32(&out[8], &[], &[-4.291_666_5]);
    check_f32(&out[9], &[1, 3], &[-2.625, -5.25, -5.0]);
    // NaN propagates through max and min.
    let n = arr(&[3], &[1.0f32, f32::NAN, 3.0]);
    let out = run(&[("n", &n)], |i| {
        vec![i[0].max(&[0]), i[0].min(&[0]), i[0].sum(&[0])]
    });
    for o in &out {
        check_f32(o, &[], &[f32::NAN]);
    }
}

#[test]
fn integer_reductions() {
    let x = arr(&[2, 2], &[3i32, -1, 7, 2]);
    let out = run(&[("x", &x)], |i| {
        vec![
            i[0].sum(&[0]),
            i[0].max(&[1]),
            i[0].min(&[0, 1]),
            i[0].sum_all(),
        ]
    });
    check_exact(&out[0], &[2], &[10i32, 1]);
    check_exact(&out[1], &[2], &[3i32, 7]);
    check_exact(&out[2], &[], &[-1i32]);
    check_exact(&out[3], &[], &[11i32]);
    // Sums wrap.
    let u = arr(&[3], &[200u8, 100, 1]);
    let l = arr(&[2], &[i64::MAX, 1]);
    let out = run(&[("u", &u), ("l", &l)], |i| {
        vec![i[0].sum(&[0]), i[0].max(&[0]), i[1].sum(&[0])]
    });
    check_exact(&out[0], &[], &[45u8]);
    check_exact(&out[1], &[], &[200u8]);
    check_exact(&out[2], &[], &[i64::MIN]);
}

#[test]
fn long_float_sums_stay_accurate() {
    // 100 000 copies of 0.1f32: a naive running f32 sum drifts by ~1e-3 relative.
    let v = arr(&[100_000], &vec![0.1f32; 100_000]);
    let out = run(&[("v", &v)], |i| vec![i[0].sum(&[0])]);
    let got = out[0].as_slice::<f32>().unwrap()[0] as f64;
    let want = 100_000.0 * 0.1f32 as f64;
    assert!((got - want).abs() / want < 1e-6, "{got} vs {want}");
}

// ---- creation --------------------------------------------------------------------------------

#[test]
fn iota_matches_the_catalog() {
    let out = run(&[], |_| {
        vec![
            Tensor::iota(DType::I32, &[4], 0),
            Tensor::iota(DType::F32, &[2, 3], 1),
            Tensor::iota(DType::I64, &[2, 3], 0),
            Tensor::iota(DType::U8, &[2, 2], 1),
            Tensor::iota(DType::F64, &[3], 0),
        ]
    });
    check_exact(&out[0], &[4], &[0i32, 1, 2, 3]);
    check_f32(&out[1], &[2, 3], &[0.0, 1.0, 2.0, 0.0, 1.0, 2.0]);
    check_exact(&out[2], &[2, 3], &[0i64, 0, 0, 1, 1, 1]);
    check_exact(&out[3], &[2, 2], &[0u8, 1, 0, 1]);
    check_f64(&out[4], &[3], &[0.0, 1.0, 2.0]);
}

#[test]
fn constants() {
    let x = arr(&[3], &[1.0f32, 2.0, 3.0]);
    let out = run(&[("x", &x)], |i| {
        let c = Tensor::constant(arr(&[3], &[1.0f32, f32::INFINITY, f32::NEG_INFINITY]));
        vec![
            i[0] + c,
            Tensor::constant(arr(&[3], &[-1i32, 0, 7])),
            Tensor::constant(arr(&[3], &[true, false, true])),
            Tensor::constant(arr(&[2], &[9_007_199_254_740_993i64; 2])),
            Tensor::full(&[2, 3], 1.5, DType::F32),
            Tensor::scalar(2.5, DType::F32),
            i[0].zeros_like(),
        ]
    });
    check_f32(&out[0], &[3], &[2.0, f32::INFINITY, f32::NEG_INFINITY]);
    check_exact(&out[1], &[3], &[-1i32, 0, 7]);
    check_exact(&out[2], &[3], &[true, false, true]);
    check_exact(&out[3], &[2], &[9_007_199_254_740_993i64; 2]);
    check_f32(&out[4], &[2, 3], &[1.5; 6]);
    check_f32(&out[5], &[], &[2.5]);
    check_f32(&out[6], &[3], &[0.0; 3]);
}

// ---- compositions ----------------------------------------------------------------------------

#[test]
fn argmax_takes_the_first_maximum() {
    let x = arr(
        &[3, 3],
        &[1.0f32, 5.0, 5.0, 7.0, 2.0, 7.0, -1.0, -3.0, -2.0],
    );
    let out = run(&[("x", &x)], |i| vec![i[0].argmax(1), i[0].argmax(0)]);
    check_exact(&out[0], &[3], &[1i32, 0, 0]);
    check_exact(&out[1], &[3], &[1i32, 0, 1]);
    let v = arr(&[4], &[3i32, 9, -2, 9]);
    let out = run(&[("v", &v)], |i| vec![i[0].argmax(0)]);
    check_exact(&out[0], &[], &[1i32]);
}

#[test]
fn one_hot_matches_the_catalog() {
    // Out-of-range labels (-1, 3) give a zero row.
    let want = [
        1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
    ];
    let l64 = arr(&[5], &[0i64, 2, 1, -1, 3]);
    let l32 = arr(&[5], &[0i32, 2, 1, -1, 3]);
    let out = run(&[("l64", &l64), ("l32", &l32)], |i| {
        vec![
            i[0].one_hot(3, DType::F32),
            i[1].one_hot(3, DType::F32),
            i[1].one_hot(3, DType::Bool),
        ]
    });
    check_f32(&out[0], &[5, 3], &want);
    check_f32(&out[1], &[5, 3], &want);
    check_exact(&out[2], &[5, 3], &want.map(|v| v == 1.0));
    // Rank-2 labels.
    let l = arr(&[2, 2], &[1i32, 0, 0, 1]);
    let out = run(&[("l", &l)], |i| vec![i[0].one_hot(2, DType::I32)]);
    check_exact(&out[0], &[2, 2, 2], &[0i32, 1, 1, 0, 1, 0, 0, 1]);
}

#[test]
fn log_softmax_and_softmax() {
    // The catalog's log_softmax case: row 1 would overflow exp without the max shift.
    let x = arr(&[2, 3], &[1.0f32, 2.0, 3.0, 1000.0, 1001.0, 1002.5]);
    let out = run(&[("x", &x)], |i| {
        vec![
            nn::log_softmax(i[0], 1),
            nn::softmax(i[0], 1),
            nn::log_softmax(i[0], 0),
        ]
    });
    check_f32(
        &out[0],
        &[2, 3],
        &[
            -2.407_606,
            -1.407_606,
            -0.407_606,
            -2.766_368,
            -1.766_368,
            -0.266_367_9,
        ],
    );
    // softmax([1,2,3]) = e^{-2,-1,0} / (e^-2 + e^-1 + 1); row 2 = e^{-2.5,-1.5,0} / Σ.
    check_f32(
        &out[1],
        &[2, 3],
        &[
            0.090_030_57,
            0.244_728_48,
            0.665_240_96,
            0.062_890_01,
            0.170_952_78,
            0.766_157_2,
        ],
    );
    // Along axis 0 the large row wins outright: log(1 - tiny) ≈ 0, and 1 - 1000 etc.
    check_f32(&out[2], &[2, 3], &[-999.0, -999.0, -999.5, 0.0, 0.0, 0.0]);
}

#[test]
fn softmax_cross_entropy_and_mse() {
    let logits = arr(&[2, 3], &[1.0f32, 2.0, 3.0, 1000.0, 1001.0, 1002.5]);
    let labels = arr(&[2], &[2i32, 0]);
    let out = run(&[("logits", &logits), ("labels", &labels)], |i| {
        let per = nn::softmax_cross_entropy(i[0], i[1]);
        vec![per, per.mean_all()]
    });
    // -log_softmax at the label: 0.4076059644 and 2.7663679.
    check_f32(&out[0], &[2], &[0.407_606, 2.766_368]);
    check_f32(&out[1], &[], &[1.586_987]);
    let p = arr(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]);
    let t = arr(&[2, 2], &[1.0f32, 0.0, 0.0, 4.0]);
    let v = arr(&[2], &[1.0f32, 3.0]);
    let out = run(&[("p", &p), ("t", &t), ("v", &v)], |i| {
        vec![nn::mse(i[0], i[1]), nn::mse(i[2], i[2] * 2.0)]
    });
    check_f32(&out[0], &[2], &[2.0, 4.5]);
    check_f32(&out[1], &[2], &[1.0, 9.0]);
}

#[test]
fn several_outputs_repeated_outputs_and_passed_through_inputs() {
    // The catalog's two_outputs case, plus an output listed twice and an input returned as is.
    let x = arr(&[2, 2], &[1.0f32, 2.0, 3.0, 4.0]);
    let y = arr(&[2, 2], &[0.5f32; 4]);
    let out = run(&[("x", &x), ("y", &y)], |i| {
        let sum = i[0] + i[1];
        let big = sum.sum_all().greater(10.0);
        vec![sum, big, sum, i[1]]
    });
    check_f32(&out[0], &[2, 2], &[1.5, 2.5, 3.5, 4.5]);
    check_exact(&out[1], &[], &[true]);
    check_f32(&out[2], &[2, 2], &[1.5, 2.5, 3.5, 4.5]);
    assert_eq!(out[3], y);
    // No outputs at all is fine.
    let out = run(&[("x", &x)], |_| vec![]);
    assert!(out.is_empty());
}

// ---- validation ------------------------------------------------------------------------------

fn two_input_graph() -> Graph {
    trace(
        &[
            ("layers[0].x".into(), ty(DType::F32, &[2, 3])),
            ("w".into(), ty(DType::F32, &[3])),
        ],
        |i| vec![i[0] * i[1]],
    )
    .unwrap()
}

#[test]
fn wrong_input_count_is_an_error() {
    let g = two_input_graph();
    let err = interp::run(&g, &[x23()]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InputCount {
                expected: 2,
                got: 1
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("takes 2 inputs but was given 1"),
        "{err}"
    );
    let w = arr(&[3], &[1.0f32; 3]);
    let err = interp::run(&g, &[x23(), w.clone(), w]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InputCount {
                expected: 2,
                got: 3
            }
        ),
        "{err:?}"
    );
}

#[test]
fn wrong_input_dims_are_an_error_naming_the_input() {
    let g = two_input_graph();
    let err = interp::run(&g, &[x23(), arr(&[4], &[1.0f32; 4])]).unwrap_err();
    assert!(
        matches!(&err, Error::InputType { index: 1, name, .. } if name == "w"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("`w`") && msg.contains("f32[3]") && msg.contains("f32[4]"),
        "{msg}"
    );
}

#[test]
fn wrong_input_dtype_is_an_error_naming_the_input() {
    let g = two_input_graph();
    let x = arr(&[2, 3], &[1i32; 6]);
    let err = interp::run(&g, &[x, arr(&[3], &[1.0f32; 3])]).unwrap_err();
    assert!(
        matches!(&err, Error::InputType { index: 0, name, .. } if name == "layers[0].x"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("`layers[0].x`") && msg.contains("f32[2,3]") && msg.contains("i32[2,3]"),
        "{msg}"
    );
}

#[test]
fn only_live_nodes_run_and_malformed_ones_are_errors() {
    let x = x23();
    let mut g = graph_of(&[("x", &x)], |i| vec![i[0] * 2.0]);
    // A malformed node (operands of different types) that no output needs is never evaluated.
    let scalar = g.push(
        Op::Constant(std::sync::Arc::new(Array::scalar(1.0f32))),
        vec![],
        ty(DType::F32, &[]),
    );
    let bad = g.push(
        Op::Binary(BinaryOp::Add),
        vec![0, scalar],
        ty(DType::F32, &[2, 3]),
    );
    let out = interp::run(&g, std::slice::from_ref(&x)).unwrap();
    check_f32(&out[0], &[2, 3], &[2.0, 4.0, 6.0, 8.0, 10.0, 12.0]);
    // Once an output needs it, it is reported, not a panic.
    g.outputs.push(bad);
    let err = interp::run(&g, std::slice::from_ref(&x)).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidGraph { node, op: "add", .. } if *node == bad),
        "{err:?}"
    );
    assert!(err.to_string().contains("f32[2,3] and f32[]"), "{err}");
    // A declared result type that the op does not give.
    let mut g = graph_of(&[("x", &x)], |i| vec![i[0].sum(&[1])]);
    let last = g.nodes.len() - 1;
    g.nodes[last].ty = ty(DType::F32, &[3]);
    let err = interp::run(&g, std::slice::from_ref(&x)).unwrap_err();
    assert!(
        err.to_string()
            .contains("result type is f32[3] but the op gives f32[2]"),
        "{err}"
    );
    // An output id past the end.
    let mut g = graph_of(&[("x", &x)], |i| vec![i[0]]);
    g.outputs.push(99);
    assert!(matches!(
        interp::run(&g, &[x]).unwrap_err(),
        Error::InvalidGraph { node: 99, .. }
    ));
}

#[test]
fn a_select_of_two_scalars_never_panics() {
    // `Tensor::select(p, 1.0, 0.0)`: both values are plain numbers, so the tracer has no dtype to
    // give them. Either the trace fails, or the interpreter reports the stand-in node it left.
    let p = arr(&[3], &[true, false, true]);
    match trace(&[("p".into(), p.leaf_type())], |i| {
        vec![Tensor::select(i[0], 1.0, 0.0)]
    }) {
        Err(e) => assert!(matches!(e, Error::Trace(_)), "{e:?}"),
        Ok(g) => {
            let err = interp::run(&g, &[p]).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidGraph {
                        op: "parameter",
                        ..
                    }
                ),
                "{err:?}"
            );
            assert!(err.to_string().contains("stand-in"), "{err}");
        }
    }
}

// ---- allocation failures -------------------------------------------------------------------------

/// A broadcast within the size limit but beyond any machine's memory used to abort the process
/// (an infallible allocation); it is an `OutOfMemory` error naming the node.
#[test]
fn values_too_large_for_memory_are_errors_not_aborts() {
    let x = Array::scalar(1.0f32);
    // 2^61 bytes: more than any x86-64 or aarch64 address space, whatever the overcommit policy.
    let graph = graph_of(&[("x", &x)], |i| {
        vec![i[0].broadcast_to(&[1 << 29, 1 << 30]).sum_all()]
    });
    match interp::run(&graph, std::slice::from_ref(&x)) {
        Err(e @ Error::OutOfMemory { .. }) => {
            let text = e.to_string();
            assert!(text.contains("2305843009213693952 bytes"), "{text}");
            assert!(text.contains("`broadcast_in_dim`"), "{text}");
            assert!(text.contains("f32[536870912,1073741824]"), "{text}");
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Every kernel allocates fallibly: an iota and a matmul of that size fail the same way.
    let graph = graph_of(&[], |_| {
        vec![Tensor::iota(DType::I64, &[1 << 28, 1 << 30], 1)]
    });
    assert!(matches!(
        interp::run(&graph, &[]),
        Err(Error::OutOfMemory { bytes, .. }) if bytes == 1 << 61
    ));
    // Empty operands, a 2^62-byte product: only the result is large.
    let a = Array::zeros(DType::F32, &[1 << 30, 0]);
    let b = Array::zeros(DType::F32, &[0, 1 << 30]);
    let graph = graph_of(&[("a", &a), ("b", &b)], |i| vec![i[0].matmul(i[1])]);
    assert!(matches!(
        interp::run(&graph, &[a, b]),
        Err(Error::OutOfMemory { bytes, .. }) if bytes == 1 << 62
    ));
}

/// A hand-built graph whose node type is over the size limit is malformed, not an overflow.
#[test]
fn hand_built_nodes_over_the_size_limit_are_malformed() {
    let mut g = Graph::default();
    let big = ty(DType::F32, &[1 << 62, 4]);
    let n = g.push(Op::Iota { axis: 0 }, vec![], big);
    g.outputs.push(n);
    match interp::run(&g, &[]) {
        Err(Error::InvalidGraph { message, .. }) => {
            assert!(message.contains("size limit"), "{message}")
        }
        other => panic!("expected InvalidGraph, got {other:?}"),
    }
}

// ---- NaN in max, min and argmax ------------------------------------------------------------------

/// NaN propagates (NumPy and JAX semantics): `max`/`min` of a group holding NaN are NaN, and
/// `argmax` is the first NaN's index. XLA agrees (`tests/differential.rs`).
#[test]
fn nan_propagates_through_max_min_and_argmax() {
    let nan = f32::NAN;
    let inf = f32::INFINITY;
    // The issue's row, a row without NaN, an all-NaN row, and -inf with NaN last.
    let x = arr(
        &[4, 4],
        &[
            1.0f32, nan, -2.0, 0.5, //
            1.0, 3.0, -2.0, 3.0, //
            nan, nan, nan, nan, //
            -inf, -inf, -inf, nan,
        ],
    );
    let out = run(&[("x", &x)], |i| {
        vec![
            i[0].max(&[1]),
            i[0].min(&[1]),
            i[0].argmax(1),
            i[0].max(&[0, 1]),
            i[0].max_keep(&[1]),
        ]
    });
    check_f32(&out[0], &[4], &[nan, 3.0, nan, nan]);
    check_f32(&out[1], &[4], &[nan, -2.0, nan, nan]);
    check_exact(&out[2], &[4], &[1i32, 1, 0, 3]);
    check_f32(&out[3], &[], &[nan]);
    check_f32(&out[4], &[4, 1], &[nan, 3.0, nan, nan]);

    // -inf rows without NaN: the max is -inf, the first position wins.
    let y = arr(&[2, 3], &[-inf, -inf, -inf, -inf, -1.0, -inf]);
    let out = run(&[("y", &y)], |i| {
        vec![i[0].max(&[1]), i[0].argmax(1), i[0].min(&[1])]
    });
    check_f32(&out[0], &[2], &[-inf, -1.0]);
    check_exact(&out[1], &[2], &[0i32, 1]);
    check_f32(&out[2], &[2], &[-inf, -inf]);

    // f64, along axis 0.
    let z = arr(&[3, 2], &[2.0f64, f64::NAN, f64::NAN, 1.0, 5.0, 7.0]);
    let out = run(&[("z", &z)], |i| {
        vec![i[0].max(&[0]), i[0].min(&[0]), i[0].argmax(0)]
    });
    check_f64(&out[0], &[2], &[f64::NAN, f64::NAN]);
    check_f64(&out[1], &[2], &[f64::NAN, f64::NAN]);
    check_exact(&out[2], &[2], &[1i32, 0]);

    // Element-wise maximum/minimum: NaN on either side gives NaN.
    let a = arr(&[3], &[nan, 1.0f32, nan]);
    let b = arr(&[3], &[1.0f32, nan, nan]);
    let out = run(&[("a", &a), ("b", &b)], |i| {
        vec![i[0].maximum(i[1]), i[0].minimum(i[1]), i[0].relu()]
    });
    check_f32(&out[0], &[3], &[nan, nan, nan]);
    check_f32(&out[1], &[3], &[nan, nan, nan]);
    check_f32(&out[2], &[3], &[nan, 1.0, nan]);
}

/// Out-of-range labels (documented on `softmax_cross_entropy`): a zero one-hot row, so that
/// example's loss is 0 and it has no gradient.
#[test]
fn out_of_range_labels_give_zero_loss_and_zero_gradient() {
    let logits = arr(&[3, 3], &[1.0f32, 2.0, 3.0, 0.5, 0.5, 0.5, 3.0, 2.0, 1.0]);
    let labels = arr(&[3], &[99i32, -1, 0]);
    let out = run(&[("logits", &logits), ("labels", &labels)], |i| {
        let per = nn::softmax_cross_entropy(i[0], i[1]);
        let g = nitro::trace::grad(per.sum_all(), &[i[0]]);
        vec![per, g[0], nn::correct(i[0], i[1])]
    });
    // Row 2: -log_softmax([3, 2, 1])[0] = 0.4076059644.
    check_f32(&out[0], &[3], &[0.0, 0.0, 0.407_606]);
    let g = out[1].as_slice::<f32>().unwrap();
    assert_eq!(
        &g[..6],
        &[0.0; 6],
        "out-of-range rows have no gradient: {g:?}"
    );
    assert!(g[6..].iter().any(|&v| v != 0.0));
    check_f32(&out[2], &[3], &[0.0, 0.0, 1.0]);
}
