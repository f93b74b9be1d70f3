//! Tracing: shape inference, and errors that name the op, the shapes and the caller's line.
#![allow(missing_docs)]

use nitro::trace::{self, DotDims, Tensor};
use nitro::{DType, Error, LeafType};

fn f32s(dims: &[usize]) -> LeafType {
    LeafType {
        dtype: DType::F32,
        dims: dims.to_vec(),
    }
}

fn out_types(inputs: &[LeafType], body: fn(&[Tensor]) -> Vec<Tensor>) -> Vec<String> {
    let named: Vec<(String, LeafType)> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| (format!("x{i}"), t.clone()))
        .collect();
    trace::trace(&named, body)
        .unwrap()
        .output_types()
        .iter()
        .map(|t| t.to_string())
        .collect()
}

/// Traces `body`, expecting an error; returns the message and the line `body` ran on.
fn error_of(inputs: &[LeafType], body: fn(&[Tensor]) -> Vec<Tensor>) -> String {
    let named: Vec<(String, LeafType)> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| (format!("x{i}"), t.clone()))
        .collect();
    match trace::trace(&named, body) {
        Err(e @ Error::Trace(_)) => e.to_string(),
        other => panic!("expected a trace error, got {other:?}"),
    }
}

#[test]
fn shapes_are_inferred() {
    type Case = (Vec<LeafType>, fn(&[Tensor]) -> Vec<Tensor>, &'static str);
    let cases: Vec<Case> = vec![
        (
            vec![f32s(&[2, 3]), f32s(&[3])],
            |x| vec![x[0] + x[1]],
            "f32[2,3]",
        ),
        (
            vec![f32s(&[4, 1]), f32s(&[3])],
            |x| vec![x[0] * x[1]],
            "f32[4,3]",
        ),
        (vec![f32s(&[2, 3])], |x| vec![x[0] * 2.0], "f32[2,3]"),
        (
            vec![f32s(&[2, 3]), f32s(&[3, 5])],
            |x| vec![x[0].matmul(x[1])],
            "f32[2,5]",
        ),
        (
            vec![f32s(&[7, 2, 3]), f32s(&[7, 3, 5])],
            |x| vec![x[0].matmul(x[1])],
            "f32[7,2,5]",
        ),
        (
            vec![f32s(&[3]), f32s(&[3, 5])],
            |x| vec![x[0].matmul(x[1])],
            "f32[5]",
        ),
        (vec![f32s(&[2, 3, 4])], |x| vec![x[0].sum(&[1])], "f32[2,4]"),
        (
            vec![f32s(&[2, 3, 4])],
            |x| vec![x[0].max_keep(&[0, 2])],
            "f32[1,3,1]",
        ),
        (vec![f32s(&[2, 3, 4])], |x| vec![x[0].mean_all()], "f32[]"),
        (
            vec![f32s(&[2, 3, 4])],
            |x| vec![x[0].transpose(&[2, 0, 1])],
            "f32[4,2,3]",
        ),
        (
            vec![f32s(&[6])],
            |x| vec![x[0].reshape(&[2, 3])],
            "f32[2,3]",
        ),
        (
            vec![f32s(&[5, 4])],
            |x| vec![x[0].slice_strided(&[1, 0], &[5, 4], &[2, 3])],
            "f32[2,2]",
        ),
        (
            vec![f32s(&[2, 1]), f32s(&[2, 3])],
            |x| vec![Tensor::concatenate(&[x[0], x[1]], 1)],
            "f32[2,4]",
        ),
        (vec![f32s(&[2, 3])], |x| vec![x[0].less(0.5)], "bool[2,3]"),
        (vec![f32s(&[2, 3])], |x| vec![x[0].argmax(1)], "i32[2]"),
        (
            vec![LeafType {
                dtype: DType::I32,
                dims: vec![4],
            }],
            |x| vec![x[0].one_hot(10, DType::F32)],
            "f32[4,10]",
        ),
        (
            vec![f32s(&[2, 3])],
            |x| vec![x[0].convert(DType::F64)],
            "f64[2,3]",
        ),
        (
            vec![f32s(&[2, 3]), f32s(&[3, 2])],
            |x| {
                let d = DotDims {
                    lhs_batch: vec![],
                    rhs_batch: vec![],
                    lhs_contract: vec![0],
                    rhs_contract: vec![1],
                };
                vec![x[0].dot_general(x[1], d)]
            },
            "f32[3,3]",
        ),
        (
            vec![f32s(&[2, 3])],
            |x| vec![Tensor::select(x[0].greater(0.0), x[0], 0.0)],
            "f32[2,3]",
        ),
        (
            vec![],
            |_| vec![Tensor::iota(DType::I64, &[2, 5], 1)],
            "i64[2,5]",
        ),
    ];
    for (i, (inputs, body, want)) in cases.into_iter().enumerate() {
        assert_eq!(out_types(&inputs, body), vec![want.to_owned()], "case {i}");
    }
}

#[test]
fn shape_errors_name_op_shapes_and_line() {
    let line = line!() + 1;
    let msg = error_of(&[f32s(&[2, 3]), f32s(&[2, 3])], |x| vec![x[0].matmul(x[1])]);
    assert!(msg.contains("`matmul`"), "{msg}");
    assert!(msg.contains("f32[2,3]"), "{msg}");
    assert!(
        msg.contains(&format!("{}:{line}:", file!())),
        "names this file and line: {msg}"
    );

    let line = line!() + 1;
    let msg = error_of(&[f32s(&[2, 3]), f32s(&[4])], |x| vec![x[0] + x[1]]);
    assert!(
        msg.contains("`add`") && msg.contains("f32[2,3] and f32[4]"),
        "{msg}"
    );
    assert!(msg.contains(&format!("{}:{line}:", file!())), "{msg}");

    let msg = error_of(&[f32s(&[2, 3])], |x| vec![x[0].reshape(&[4, 2])]);
    assert!(
        msg.contains("`reshape`") && msg.contains("6 elements") && msg.contains("8 elements"),
        "{msg}"
    );
    let msg = error_of(&[f32s(&[2, 3])], |x| vec![x[0].sum(&[2])]);
    assert!(msg.contains("axis 2 is out of range"), "{msg}");
    let msg = error_of(&[f32s(&[2, 3])], |x| vec![x[0].transpose(&[0, 0])]);
    assert!(msg.contains("not a permutation"), "{msg}");
    let msg = error_of(&[f32s(&[2, 3])], |x| vec![x[0].slice(&[0, 2], &[2, 4])]);
    assert!(msg.contains("`slice`"), "{msg}");
    let msg = error_of(
        &[
            f32s(&[2, 3]),
            LeafType {
                dtype: DType::F64,
                dims: vec![2, 3],
            },
        ],
        |x| vec![x[0] - x[1]],
    );
    assert!(msg.contains("different dtypes"), "{msg}");
    let msg = error_of(
        &[LeafType {
            dtype: DType::I32,
            dims: vec![3],
        }],
        |x| vec![x[0].exp()],
    );
    assert!(msg.contains("needs a float tensor"), "{msg}");
    let msg = error_of(&[f32s(&[2]), f32s(&[2])], |x| {
        vec![Tensor::select(x[0].less(x[1]), 1.0, 0.0)]
    });
    assert!(msg.contains("every operand is a scalar"), "{msg}");
    let msg = error_of(
        &[LeafType {
            dtype: DType::I32,
            dims: vec![2],
        }],
        |x| vec![x[0] + 0.5],
    );
    assert!(msg.contains("not a i32 value"), "{msg}");
}

#[test]
fn the_first_error_wins_and_code_runs_to_the_end() {
    let msg = error_of(&[f32s(&[2, 3])], |x| {
        let bad = x[0].matmul(x[0]); // first mistake
        let worse = bad.reshape(&[7]); // would be a second one
        vec![worse]
    });
    assert!(
        msg.contains("`matmul`") && !msg.contains("reshape"),
        "{msg}"
    );
}

#[test]
fn panics_and_nesting_become_errors() {
    let err = trace::trace(&[], |_| panic!("user code broke")).unwrap_err();
    assert!(
        matches!(&err, Error::TracePanic { message } if message.contains("user code broke")),
        "{err}"
    );
    let err = trace::trace(&[], |_| {
        let inner = trace::trace(&[], |_| vec![]);
        assert!(matches!(inner, Err(Error::NestedTrace)));
        vec![]
    });
    assert!(err.is_ok());
    // A tensor kept from an earlier trace cannot be used in a later one.
    let mut kept = None;
    trace::trace(&[("x".into(), f32s(&[1]))], |x| {
        kept = Some(x[0]);
        vec![]
    })
    .unwrap();
    let stale = kept.unwrap();
    let err = trace::trace(&[("y".into(), f32s(&[1]))], |x| vec![x[0] + stale]).unwrap_err();
    assert!(err.to_string().contains("another trace"), "{err}");
}

// ---- the size limit ----------------------------------------------------------------------------

/// Traces `body` over named inputs, expecting a trace error; returns its message.
fn trace_error(inputs: &[(&str, LeafType)], body: impl FnOnce(&[Tensor]) -> Vec<Tensor>) -> String {
    let named: Vec<(String, LeafType)> = inputs
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    match trace::trace(&named, body) {
        Err(e @ Error::Trace(_)) => e.to_string(),
        other => panic!("expected a trace error, got {other:?}"),
    }
}

#[track_caller]
fn assert_mentions(message: &str, parts: &[&str]) {
    for p in parts {
        assert!(message.contains(p), "{p:?} is not in: {message}");
    }
}

/// 2^62 · 4-byte elements are 2^64 bytes: XLA aborted on these; tracing now refuses them,
/// naming the op, the shape and this file, before anything is emitted.
#[test]
fn tensors_over_the_size_limit_fail_the_trace() {
    let e = trace_error(&[], |_| {
        vec![Tensor::full(&[1 << 31, 1 << 31], 1.0, DType::F32).sum_all()]
    });
    assert_mentions(
        &e,
        &[
            "`full` at",
            file!(),
            "f32[2147483648,2147483648]",
            "18446744073709551616 bytes",
            "MAX_TENSOR_BYTES",
        ],
    );

    // Broadcasting two vectors against each other.
    let col = f32s(&[1 << 31, 1]);
    let row = f32s(&[1, 1 << 31]);
    let e = trace_error(&[("a", col), ("b", row)], |x| vec![x[0] + x[1]]);
    assert_mentions(&e, &["`add` at", file!(), "f32[2147483648,2147483648]"]);

    // An outer product whose result is too large, naming both operands.
    let e = trace_error(
        &[("u", f32s(&[1 << 31, 1])), ("v", f32s(&[1, 1 << 31]))],
        |x| vec![x[0].matmul(x[1])],
    );
    assert_mentions(
        &e,
        &[
            "`matmul`",
            "f32[2147483648,2147483648]",
            "operands f32[2147483648,1], f32[1,2147483648]",
        ],
    );

    // A conversion to a wider dtype: u8[2^62] is 2^62 bytes, f32[2^62] is 2^64.
    let e = trace_error(&[("b", LeafType::new(DType::U8, &[1 << 62]))], |x| {
        vec![x[0].convert(DType::F32)]
    });
    assert_mentions(&e, &["`convert`", "f32[4611686018427387904]"]);

    // iota, and one_hot through it.
    let e = trace_error(&[], |_| {
        vec![Tensor::iota(DType::I64, &[1 << 40, 1 << 30], 0)]
    });
    assert_mentions(&e, &["`iota`", "i64[1099511627776,1073741824]"]);
    let e = trace_error(&[("l", LeafType::new(DType::I32, &[1 << 40]))], |x| {
        vec![x[0].one_hot(1 << 30, DType::F32)]
    });
    assert_mentions(&e, &["`iota`", "[1099511627776,1073741824]"]);

    // Concatenation: past the limit, and a joined dim that overflows `usize` (an error, not a
    // wrap).
    let quarter = LeafType::new(DType::U8, &[1 << 62]);
    let e = trace_error(&[("a", quarter.clone())], |x| {
        vec![Tensor::concatenate(&[x[0]; 2], 0)]
    });
    assert_mentions(&e, &["`concatenate`", "u8[9223372036854775808]"]);
    let e = trace_error(&[("a", quarter)], |x| {
        vec![Tensor::concatenate(&[x[0]; 4], 0)]
    });
    assert_mentions(&e, &["`concatenate`", "overflows"]);

    // A reshape whose dims overflow is refused (it used to overflow while checking).
    let e = trace_error(&[("x", f32s(&[4]))], |x| {
        vec![x[0].reshape(&[1 << 62, 4, 4])]
    });
    assert_mentions(&e, &["`reshape`", "more than 2^64"]);

    // A zero dim does not make the other dims free: they are counted as at least 1.
    let e = trace_error(&[], |_| vec![Tensor::full(&[0, 1 << 62], 0.0, DType::F32)]);
    assert_mentions(&e, &["`full`", "f32[0,4611686018427387904]"]);

    // Just under the limit traces (nothing is allocated while tracing).
    let g = trace::trace(&[], |_| {
        vec![Tensor::full(&[1 << 30, 1 << 30], 1.0, DType::F32).sum_all()]
    })
    .expect("2^62 bytes are within the limit");
    assert_eq!(g.output_types()[0], LeafType::new(DType::F32, &[]));
}

/// Program inputs over the limit name the input.
#[test]
fn inputs_over_the_size_limit_fail_the_trace() {
    let e = trace_error(&[("layers[0].w", f32s(&[1 << 62, 4]))], |x| vec![x[0]]);
    assert_mentions(
        &e,
        &[
            "`input` at",
            file!(),
            "input `layers[0].w`",
            "f32[4611686018427387904,4]",
        ],
    );
}

// ---- labels ------------------------------------------------------------------------------------

/// Labels `[32, 1]` against logits `[32, 10]` used to broadcast into a `[32, 32]` loss (7.6
/// instead of 2.46); they are a trace-time error naming the op, both types and this line.
#[test]
fn classification_labels_must_have_the_logits_dims_without_the_last() {
    use nitro::trace::nn;
    let logits = ("logits", f32s(&[32, 10]));
    let column = ("labels", LeafType::new(DType::I32, &[32, 1]));
    let e = trace_error(&[logits.clone(), column.clone()], |x| {
        vec![nn::softmax_cross_entropy(x[0], x[1])]
    });
    assert_mentions(
        &e,
        &[
            "`softmax_cross_entropy` at",
            file!(),
            "i32[32,1]",
            "f32[32,10]",
            "[32]",
        ],
    );
    let e = trace_error(&[logits.clone(), column], |x| {
        vec![nn::correct(x[0], x[1]).sum_all()]
    });
    assert_mentions(&e, &["`correct` at", file!(), "i32[32,1]", "f32[32,10]"]);

    // Another batch size, and a rank-0 label, are mistakes too.
    let e = trace_error(
        &[logits.clone(), ("labels", LeafType::new(DType::I32, &[16]))],
        |x| vec![nn::softmax_cross_entropy(x[0], x[1])],
    );
    assert_mentions(&e, &["i32[16]", "f32[32,10]"]);
    let e = trace_error(
        &[logits.clone(), ("labels", LeafType::new(DType::I32, &[]))],
        |x| vec![nn::softmax_cross_entropy(x[0], x[1])],
    );
    assert_mentions(&e, &["i32[]", "f32[32,10]"]);

    // Float labels (one-hot rows passed by mistake) are refused.
    let e = trace_error(&[logits.clone(), ("labels", f32s(&[32, 10]))], |x| {
        vec![nn::softmax_cross_entropy(x[0], x[1])]
    });
    assert_mentions(&e, &["integer class indices", "f32[32,10]"]);

    // The right shape traces, per example; rank-3 logits take rank-2 labels.
    let ok = |labels: LeafType, logits: LeafType| {
        let named = vec![("logits".to_owned(), logits), ("labels".to_owned(), labels)];
        trace::trace(&named, |x| {
            vec![
                nn::softmax_cross_entropy(x[0], x[1]),
                nn::correct(x[0], x[1]),
            ]
        })
        .unwrap()
        .output_types()
    };
    let per = ok(LeafType::new(DType::I32, &[32]), f32s(&[32, 10]));
    assert_eq!(per, vec![f32s(&[32]), f32s(&[32])]);
    let per = ok(LeafType::new(DType::I64, &[4, 5]), f32s(&[4, 5, 3]));
    assert_eq!(per, vec![f32s(&[4, 5]), f32s(&[4, 5])]);
}
