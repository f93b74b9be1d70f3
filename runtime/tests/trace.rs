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
