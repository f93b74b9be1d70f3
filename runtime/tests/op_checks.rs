//! Trace-time checks of the op families' attributes (issue 30): every size an op computes from
//! its attributes — dilated sizes `(n − 1)·d + 1`, padded sums, strides, group products — is
//! checked arithmetic bounded by nitro's size limit (2^63 − 1, `nitro::MAX_TENSOR_BYTES`), and
//! every attribute constraint XLA validates is checked while tracing; a violation is an
//! [`Error::Trace`] naming the op, the attribute and its value, never a wrong result type, a
//! panic, or an XLA failure blamed on the plugin (or an abort of the whole process). Also: the
//! op dispatch names every op (no silent default), the messages have no runs of spaces, and
//! the op catalog lists the loops.
#![allow(missing_docs)]

mod common;

use common::xla_or_skip;

use nitro::emit;
use nitro::trace::{
    self, grad, Conv, ConvDims, DotDims, GatherDims, ScatterDims, ScatterKind, Tensor, TraceError,
    Window,
};
use nitro::{Array, DType, Error, LeafType};

/// 2^62: within the limit alone, over it once dilated.
const P62: usize = 1 << 62;
/// 2^63: over the limit as an attribute of its own.
const P63: usize = 1 << 63;
/// nitro's size limit, 2^63 − 1.
const LIMIT: usize = i64::MAX as usize;

fn ty(dtype: DType, dims: &[usize]) -> LeafType {
    LeafType::new(dtype, dims)
}

fn f32s(dims: &[usize]) -> LeafType {
    ty(DType::F32, dims)
}

/// The trace error of `body` over `inputs`; fails the test when the trace succeeds or fails
/// any other way (a panic while tracing is [`Error::TracePanic`]).
fn trace_error(inputs: &[LeafType], body: impl FnOnce(&[Tensor]) -> Vec<Tensor>) -> TraceError {
    let named = common::named_inputs(inputs);
    match trace::trace(&named, body) {
        Err(Error::Trace(e)) => *e,
        Err(other) => panic!("expected a trace error, got another error: {other}"),
        Ok(g) => panic!(
            "expected a trace error, but the trace passed with outputs {:?}",
            g.output_types()
        ),
    }
}

/// Asserts the error is `op`'s and its message holds every one of `parts`.
#[track_caller]
fn expect(e: &TraceError, op: &str, parts: &[&str]) {
    assert_eq!(e.op, op, "the op of: {}", e.message);
    for p in parts {
        assert!(e.message.contains(p), "{p:?} missing from: {}", e.message);
    }
    assert!(
        !e.message.contains("  "),
        "a run of spaces in: {:?}",
        e.message
    );
}

fn nwc(x: Tensor, k: Tensor, conv: &Conv) -> Vec<Tensor> {
    vec![x.conv(k, conv)]
}

// ---- 6: dilations, padding, strides and groups overflow ------------------------------------

#[test]
fn conv_lhs_dilation_past_the_limit_is_a_trace_error() {
    // (3 − 1)·2^62 + 1 = 2^63 + 1: over the limit, although the strided result (3) is small.
    let e = trace_error(&[f32s(&[1, 3, 1]), f32s(&[1, 1, 1])], |x| {
        let conv = Conv::channels_last(1).lhs_dilation(&[P62]).strides(&[P62]);
        nwc(x[0], x[1], &conv)
    });
    expect(
        &e,
        "conv",
        &[
            "lhs_dilation",
            &P62.to_string(),
            "9223372036854775809",
            "2^63",
        ],
    );

    // (5 − 1)·2^62 + 1 overflows even a u64: no wrapped, wrong result type.
    let e = trace_error(&[f32s(&[1, 5, 1]), f32s(&[1, 1, 1])], |x| {
        nwc(x[0], x[1], &Conv::channels_last(1).lhs_dilation(&[P62]))
    });
    expect(&e, "conv", &["lhs_dilation", &P62.to_string()]);

    // 2^63 itself is over the limit, even where one element leaves nothing to dilate.
    let e = trace_error(&[f32s(&[1, 1, 1]), f32s(&[1, 1, 1])], |x| {
        nwc(x[0], x[1], &Conv::channels_last(1).lhs_dilation(&[P63]))
    });
    expect(&e, "conv", &["lhs_dilation", &P63.to_string()]);
}

#[test]
fn conv_rhs_dilation_strides_and_padding_past_the_limit_are_trace_errors() {
    let e = trace_error(&[f32s(&[1, 3, 1]), f32s(&[5, 1, 1])], |x| {
        nwc(x[0], x[1], &Conv::channels_last(1).rhs_dilation(&[P62]))
    });
    expect(&e, "conv", &["rhs_dilation", &P62.to_string()]);

    let e = trace_error(&[f32s(&[1, 3, 1]), f32s(&[1, 1, 1])], |x| {
        nwc(x[0], x[1], &Conv::channels_last(1).strides(&[P63]))
    });
    expect(&e, "conv", &["strides", &P63.to_string()]);

    // 3 + 2·(2^63 − 1) positions: the padded input is past the limit, the strided result is not.
    let e = trace_error(&[f32s(&[1, 3, 1]), f32s(&[1, 1, 1])], |x| {
        let conv = Conv::channels_last(1)
            .padding(&[(i64::MAX, i64::MAX)])
            .strides(&[P62]);
        nwc(x[0], x[1], &conv)
    });
    expect(&e, "conv", &["padding", &i64::MAX.to_string()]);

    // −2^63 has no negation: a padding amount is within ±(2^63 − 1).
    let e = trace_error(&[f32s(&[1, 3, 1]), f32s(&[1, 1, 1])], |x| {
        nwc(
            x[0],
            x[1],
            &Conv::channels_last(1).padding(&[(i64::MIN, i64::MAX)]),
        )
    });
    expect(&e, "conv", &["padding", &i64::MIN.to_string()]);
}

#[test]
fn conv_group_counts_past_the_limit_are_trace_errors() {
    // 2^33 taps per group × 2^33 groups overflows a u64.
    let e = trace_error(&[f32s(&[1, 1, 4]), f32s(&[1, 1 << 33, 0])], |x| {
        nwc(x[0], x[1], &Conv::channels_last(1).feature_groups(1 << 33))
    });
    expect(&e, "conv", &["feature_groups", &(1usize << 33).to_string()]);

    // An empty batch splits into any number of groups, but StableHLO's count is an i64.
    let e = trace_error(&[f32s(&[0, 1, 1]), f32s(&[1, 1, 0])], |x| {
        nwc(x[0], x[1], &Conv::channels_last(1).batch_groups(P63))
    });
    expect(&e, "conv", &["batch_groups", &P63.to_string()]);
}

#[test]
fn conv_sizes_at_the_limit_pass_and_run_on_the_interpreter() {
    // (2 − 1)·(2^63 − 2) + 1 = 2^63 − 1: exactly the limit.
    let d = LIMIT - 1;
    let conv = Conv::channels_last(1).lhs_dilation(&[d]).strides(&[d]);
    let g = trace::trace(
        &[
            ("x".into(), f32s(&[1, 2, 1])),
            ("k".into(), f32s(&[1, 1, 1])),
        ],
        |x| nwc(x[0], x[1], &conv),
    )
    .unwrap();
    assert_eq!(g.output_types()[0], f32s(&[1, 2, 1]));
    let x = Array::from_vec(&[1, 2, 1], vec![1.5f32, -2.0]).unwrap();
    let k = Array::from_vec(&[1, 1, 1], vec![2.0f32]).unwrap();
    let out = nitro::backend::interp::run(&g, &[x, k]).unwrap();
    assert_eq!(out[0].as_slice::<f32>().unwrap(), &[3.0, -4.0]);

    // One more and the dilated input is 2^63.
    let e = trace_error(&[f32s(&[1, 2, 1]), f32s(&[1, 1, 1])], |x| {
        let conv = Conv::channels_last(1)
            .lhs_dilation(&[LIMIT])
            .strides(&[LIMIT]);
        nwc(x[0], x[1], &conv)
    });
    expect(&e, "conv", &["lhs_dilation", &LIMIT.to_string()]);
}

#[test]
fn conv_padding_whose_gradient_would_overflow_is_refused_at_the_forward() {
    // The sum fits (−(2^63 − 1) + 2 + (2^63 − 1) = 2 positions for a 2-tap kernel), but the
    // partial sum 2 + (2^63 − 1) does not, and the input gradient's padding `taps − 1 − low`
    // would be 2^63: refused (never a panic while differentiating).
    let e = trace_error(&[f32s(&[1, 2, 1]), f32s(&[2, 1, 1])], |x| {
        let conv = Conv::channels_last(1).padding(&[(-i64::MAX, i64::MAX)]);
        let y = x[0].conv(x[1], &conv);
        grad(y.sum_all(), &[x[0], x[1]])
    });
    expect(
        &e,
        "conv",
        &["padding", "size + high", &i64::MAX.to_string()],
    );
}

#[test]
fn window_dilations_strides_and_padding_past_the_limit_are_trace_errors() {
    let e = trace_error(&[f32s(&[3])], |x| {
        let w = Window::new(&[1]).base_dilation(&[P62]).strides(&[P62]);
        vec![x[0].window_sum(&w)]
    });
    expect(
        &e,
        "window_sum",
        &["base_dilation", &P62.to_string(), "9223372036854775809"],
    );

    let e = trace_error(&[f32s(&[1])], |x| {
        vec![x[0].window_max(&Window::new(&[1]).base_dilation(&[P63]))]
    });
    expect(&e, "window_max", &["base_dilation", &P63.to_string()]);

    let e = trace_error(&[f32s(&[3])], |x| {
        vec![x[0].window_min(&Window::new(&[5]).window_dilation(&[P62]))]
    });
    expect(&e, "window_min", &["window_dilation", &P62.to_string()]);

    let e = trace_error(&[f32s(&[3])], |x| {
        vec![x[0].window_sum(&Window::new(&[1]).strides(&[P63]))]
    });
    expect(&e, "window_sum", &["strides", &P63.to_string()]);

    let e = trace_error(&[f32s(&[3])], |x| {
        vec![x[0].window_sum(&Window::new(&[P63]))]
    });
    expect(&e, "window_sum", &["window", &P63.to_string()]);

    let e = trace_error(&[f32s(&[3])], |x| {
        let w = Window::new(&[1]).padding(&[(i64::MAX, 1)]).strides(&[P62]);
        vec![x[0].window_sum(&w)]
    });
    expect(&e, "window_sum", &["padding", &i64::MAX.to_string()]);
}

#[test]
fn window_padding_whose_gradient_would_overflow_is_refused_at_the_forward() {
    let e = trace_error(&[f32s(&[2])], |x| {
        let w = Window::new(&[2]).padding(&[(-i64::MAX, i64::MAX)]);
        grad(x[0].window_sum(&w).sum_all(), &[x[0]])
    });
    expect(&e, "window_sum", &["padding", "size + high"]);
}

#[test]
fn pad_interior_and_edges_past_the_limit_are_trace_errors() {
    // 3 + 2·2^62 = 2^63 + 3 positions before the edges remove 2^63: the result (3) is small,
    // but XLA's signed 64-bit sum overflows.
    let e = trace_error(&[f32s(&[3])], |x| {
        vec![x[0].pad(0.0, &[-(1 << 62)], &[-(1 << 62)], &[P62])]
    });
    expect(&e, "pad", &["interior", &P62.to_string()]);

    // An interior of 2^63 is emitted as a negative i64.
    let e = trace_error(&[f32s(&[1])], |x| vec![x[0].pad(0.0, &[0], &[0], &[P63])]);
    expect(&e, "pad", &["interior", &P63.to_string()]);

    let e = trace_error(&[f32s(&[3])], |x| {
        vec![x[0].pad(0.0, &[i64::MIN], &[i64::MAX], &[0])]
    });
    expect(&e, "pad", &["low", &i64::MIN.to_string()]);

    let e = trace_error(&[f32s(&[3])], |x| {
        vec![x[0].pad(0.0, &[i64::MAX], &[-i64::MAX], &[0])]
    });
    expect(&e, "pad", &["low", &i64::MAX.to_string()]);

    // The existing message for a negative size still holds.
    let e = trace_error(&[f32s(&[3])], |x| vec![x[0].pad(0.0, &[-2], &[-2], &[0])]);
    expect(&e, "pad", &["-1 elements"]);
}

#[test]
fn slice_strides_past_the_limit_are_trace_errors() {
    let e = trace_error(&[f32s(&[3])], |x| {
        vec![x[0].slice_strided(&[0], &[3], &[P63])]
    });
    expect(&e, "slice", &["strides", &P63.to_string()]);
}

// ---- 19: repeated dims and other attributes XLA validates ---------------------------------

fn point_gather(map: Vec<usize>) -> GatherDims {
    GatherDims {
        offset_dims: vec![],
        collapsed_slice_dims: vec![0, 1],
        start_index_map: map,
        index_vector_dim: 1,
        slice_sizes: vec![1, 1],
    }
}

#[test]
fn gather_with_a_repeated_start_index_map_dim_is_a_trace_error() {
    let e = trace_error(&[f32s(&[4, 4]), ty(DType::I32, &[3, 2])], |x| {
        vec![x[0].gather(x[1], &point_gather(vec![0, 0]))]
    });
    expect(&e, "gather", &["start_index_map", "[0, 0]", "repeat"]);

    // Distinct dims still trace.
    trace::trace(
        &[
            ("x".into(), f32s(&[4, 4])),
            ("i".into(), ty(DType::I32, &[3, 2])),
        ],
        |x| vec![x[0].gather(x[1], &point_gather(vec![1, 0]))],
    )
    .unwrap();
}

#[test]
fn scatter_with_a_repeated_scatter_dims_to_operand_dims_dim_is_a_trace_error() {
    let dims = ScatterDims {
        update_window_dims: vec![],
        inserted_window_dims: vec![0, 1],
        scatter_dims_to_operand_dims: vec![1, 1],
        index_vector_dim: 1,
    };
    let e = trace_error(&[f32s(&[4, 4]), ty(DType::I32, &[3, 2]), f32s(&[3])], |x| {
        vec![x[0].scatter(x[1], x[2], &dims, ScatterKind::Add)]
    });
    expect(
        &e,
        "scatter",
        &["scatter_dims_to_operand_dims", "[1, 1]", "repeat"],
    );
}

#[test]
fn conv_dimension_numbers_must_be_distinct_and_in_range() {
    let mut dims = ConvDims::channels_last(1);
    dims.kernel_output = dims.kernel_input;
    let e = trace_error(&[f32s(&[1, 3, 2]), f32s(&[1, 2, 2])], |x| {
        nwc(x[0], x[1], &Conv::new(dims.clone()))
    });
    expect(&e, "conv", &["dimension numbers", "kernel"]);

    let mut dims = ConvDims::channels_last(1);
    dims.output_spatial = vec![3];
    let e = trace_error(&[f32s(&[1, 3, 2]), f32s(&[1, 2, 2])], |x| {
        nwc(x[0], x[1], &Conv::new(dims.clone()))
    });
    expect(&e, "conv", &["dimension numbers", "output"]);
}

#[test]
fn conv_groups_must_divide_the_features_and_the_batch() {
    // 4 input features in 3 groups.
    let e = trace_error(&[f32s(&[1, 3, 4]), f32s(&[1, 1, 3])], |x| {
        nwc(x[0], x[1], &Conv::channels_last(1).feature_groups(3))
    });
    expect(&e, "conv", &["feature_groups"]);

    // 6 output features in 4 groups (2 input features per group, 8 in all).
    let e = trace_error(&[f32s(&[1, 3, 8]), f32s(&[1, 2, 6])], |x| {
        nwc(x[0], x[1], &Conv::channels_last(1).feature_groups(4))
    });
    expect(&e, "conv", &["6 output features", "4 groups"]);

    // A batch of 3 in 2 batch groups.
    let e = trace_error(&[f32s(&[3, 3, 1]), f32s(&[1, 1, 2])], |x| {
        nwc(x[0], x[1], &Conv::channels_last(1).batch_groups(2))
    });
    expect(&e, "conv", &["batch of 3", "2 batch groups"]);
}

#[test]
fn dot_general_dims_must_be_distinct_in_range_and_match() {
    let e = trace_error(&[f32s(&[2, 3]), f32s(&[3, 4])], |x| {
        vec![x[0].dot_general(
            x[1],
            DotDims {
                lhs_batch: vec![],
                rhs_batch: vec![],
                lhs_contract: vec![1, 1],
                rhs_contract: vec![0, 1],
            },
        )]
    });
    expect(&e, "dot_general", &["lhs", "repeat"]);

    let e = trace_error(&[f32s(&[2, 3]), f32s(&[2, 3])], |x| {
        vec![x[0].dot_general(
            x[1],
            DotDims {
                lhs_batch: vec![0],
                rhs_batch: vec![0],
                lhs_contract: vec![0],
                rhs_contract: vec![1],
            },
        )]
    });
    expect(&e, "dot_general", &["lhs", "repeat"]);

    let e = trace_error(&[f32s(&[2, 3]), f32s(&[3, 4])], |x| {
        vec![x[0].dot_general(
            x[1],
            DotDims {
                lhs_batch: vec![],
                rhs_batch: vec![],
                lhs_contract: vec![2],
                rhs_contract: vec![0],
            },
        )]
    });
    expect(&e, "dot_general", &["out of range"]);
}

#[test]
fn transpose_must_be_a_permutation() {
    let e = trace_error(&[f32s(&[2, 3])], |x| vec![x[0].transpose(&[0, 0])]);
    expect(&e, "transpose", &["permutation"]);
}

// ---- the interpreter's check of a hand-built graph shares the rules ------------------------

fn graph(inputs: &[LeafType], op: trace::Op, out: LeafType) -> trace::Graph {
    let mut g = trace::Graph::default();
    let mut ids = Vec::new();
    for (i, t) in inputs.iter().enumerate() {
        let id = g.push(trace::Op::Parameter { index: i }, vec![], t.clone());
        g.inputs.push(trace::Input {
            name: format!("x{i}"),
            ty: t.clone(),
            node: id,
        });
        ids.push(id);
    }
    let y = g.push(op, ids, out);
    g.outputs = vec![y];
    g
}

#[test]
fn hand_built_graphs_meet_the_same_checks() {
    let x = Array::from_vec(&[4, 4], vec![0f32; 16]).unwrap();
    let i = Array::from_vec(&[3, 2], vec![0i32; 6]).unwrap();
    let g = graph(
        &[x.leaf_type(), i.leaf_type()],
        trace::Op::Gather(point_gather(vec![0, 0])),
        f32s(&[3]),
    );
    let e = nitro::backend::interp::run(&g, &[x, i]).unwrap_err();
    assert!(
        matches!(e, Error::InvalidGraph { .. }) && e.to_string().contains("start_index_map"),
        "{e}"
    );

    let x = Array::from_vec(&[1, 3, 1], vec![0f32; 3]).unwrap();
    let k = Array::from_vec(&[1, 1, 1], vec![0f32]).unwrap();
    let conv = Conv::channels_last(1).lhs_dilation(&[P62]).strides(&[P62]);
    let g = graph(
        &[x.leaf_type(), k.leaf_type()],
        trace::Op::Convolution(Box::new(conv)),
        f32s(&[1, 3, 1]),
    );
    let e = nitro::backend::interp::run(&g, &[x, k]).unwrap_err();
    assert!(
        matches!(e, Error::InvalidGraph { .. }) && e.to_string().contains("lhs_dilation"),
        "{e}"
    );

    // broadcast_in_dim's dims must be distinct and in range (StableHLO C3, C4), not
    // increasing: operand dim 0 to result dim 1 and dim 1 to dim 0 is a transposing broadcast.
    let x = Array::from_vec(&[2, 3], (0..6).map(|v| v as f32).collect::<Vec<_>>()).unwrap();
    let op = |dims: Vec<usize>| trace::Op::BroadcastInDim { dims };
    let g = graph(&[x.leaf_type()], op(vec![1, 0]), f32s(&[3, 2]));
    let out = nitro::backend::interp::run(&g, std::slice::from_ref(&x)).unwrap();
    assert_eq!(
        out[0].as_slice::<f32>().unwrap(),
        &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]
    );
    let g = graph(&[x.leaf_type()], op(vec![0, 0]), f32s(&[2, 3]));
    let e = nitro::backend::interp::run(&g, &[x]).unwrap_err();
    assert!(matches!(e, Error::InvalidGraph { .. }), "{e}");
}

// ---- large attributes within the limit agree on both backends ------------------------------

#[test]
fn large_strided_dilations_agree_on_the_interpreter_and_xla() {
    let d = 1 << 20;
    let inputs = vec![
        Array::from_vec(&[1, 3, 1], vec![1.0f32, -2.0, 0.5]).unwrap(),
        Array::from_vec(&[1, 1, 1], vec![3.0f32]).unwrap(),
    ];
    let types: Vec<(String, LeafType)> = inputs
        .iter()
        .enumerate()
        .map(|(i, a)| (format!("x{i}"), a.leaf_type()))
        .collect();
    let g = trace::trace(&types, |x| {
        let conv = Conv::channels_last(1).lhs_dilation(&[d]).strides(&[d]);
        let w = Window::new(&[1]).base_dilation(&[d]).strides(&[d]);
        vec![x[0].conv(x[1], &conv), x[0].reshape(&[3]).window_sum(&w)]
    })
    .unwrap();
    let want = nitro::backend::interp::run(&g, &inputs).unwrap();
    assert_eq!(want[0].as_slice::<f32>().unwrap(), &[3.0, -6.0, 1.5]);
    assert_eq!(want[1].as_slice::<f32>().unwrap(), &[1.0, -2.0, 0.5]);
    let Some(xla) = xla_or_skip("large_strided_dilations_agree_on_the_interpreter_and_xla") else {
        return;
    };
    let refs: Vec<&Array> = inputs.iter().collect();
    let got = xla
        .compile(&g, &emit::emit(&g))
        .and_then(|exe| exe.run(&refs))
        .unwrap();
    assert_eq!(got, want);
}

// ---- A: no silent default in the op dispatch ------------------------------------------------

/// The body of `fn name` in `src` (from its line to the first line that closes it at column 0).
fn body<'a>(src: &'a str, name: &str) -> &'a str {
    let start = src
        .find(&format!("fn {name}("))
        .unwrap_or_else(|| panic!("no fn {name}"));
    let end = src[start..].find("\n}\n").map_or(src.len(), |e| start + e);
    &src[start..end]
}

#[test]
fn the_op_dispatch_names_every_op_without_a_default_arm() {
    let files = [
        (
            "ops/mod.rs",
            include_str!("../src/ops/mod.rs"),
            &["result_type", "vjp", "emit", "eval"][..],
        ),
        (
            "ops/elementwise/mod.rs",
            include_str!("../src/ops/elementwise/mod.rs"),
            &["core_type", "core_vjp", "core_emit", "core_eval"][..],
        ),
        (
            "ops/shape.rs",
            include_str!("../src/ops/shape.rs"),
            &["core_type", "core_vjp", "core_emit", "core_eval"][..],
        ),
    ];
    for (file, src, fns) in files {
        for name in fns {
            let b = body(src, name);
            for line in b.lines() {
                let t = line.trim_start();
                assert!(
                    !(t.starts_with("_ =>") || t.starts_with("other =>")),
                    "{file}: fn {name} has a default arm: {t}"
                );
            }
        }
    }
}

// ---- B: no runs of spaces in messages -------------------------------------------------------

#[test]
fn mixed_precision_refusals_have_no_runs_of_spaces() {
    let e = trace_error(&[f32s(&[1, 3, 1]), f32s(&[1, 1, 1])], |x| {
        let conv = Conv::channels_last(1).preferred_element_type(DType::F64);
        nwc(x[0], x[1], &conv)
    });
    expect(&e, "conv", &["cannot give f64 elements", "dtype, or f32"]);

    let e = trace_error(&[f32s(&[2, 3]), f32s(&[3, 4])], |x| {
        vec![x[0].matmul_to(x[1], DType::F64)]
    });
    expect(
        &e,
        "matmul",
        &["cannot give f64 elements", "their operands'"],
    );

    let e = trace_error(&[f32s(&[2, 3]), f32s(&[3, 4])], |x| {
        let d = DotDims {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contract: vec![1],
            rhs_contract: vec![0],
        };
        vec![x[0].dot_general_to(x[1], d, DType::I32)]
    });
    expect(&e, "dot_general", &["cannot give i32 elements"]);
}

// ---- C: the op catalog lists the loops ------------------------------------------------------

#[test]
fn the_op_catalog_lists_scan_and_while_loop() {
    let docs: String = include_str!("../src/ops/mod.rs")
        .lines()
        .filter(|l| l.starts_with("//!"))
        .collect::<Vec<_>>()
        .join("\n");
    let catalog = docs.split("The op catalog").nth(1).expect("the op catalog");
    let loops = catalog
        .lines()
        .find(|l| l.contains("`scan.rs`"))
        .unwrap_or_else(|| panic!("no row for scan.rs in:\n{catalog}"));
    assert!(
        loops.contains("`scan`") && loops.contains("`while_loop`"),
        "{loops}"
    );
}
