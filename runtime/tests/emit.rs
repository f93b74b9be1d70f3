//! StableHLO emission: the exact text of a small program, determinism and fingerprints, the
//! form of every op's line (as a StableHLO op catalog, kept outside this repository, ran
//! them), constants of every kind, donation and dead-node elimination.
#![allow(missing_docs)]

use std::sync::Arc;

use nitro::emit::{emit, emit_with, fingerprint, EmitOptions};
use nitro::trace::{trace, BinaryOp, CmpOp, DotDims, Graph, Input, Op, ReduceOp, UnaryOp};
use nitro::{Array, DType, LeafType, Tensor};

fn ty(dtype: DType, dims: &[usize]) -> LeafType {
    LeafType {
        dtype,
        dims: dims.to_vec(),
    }
}

fn f32t(dims: &[usize]) -> LeafType {
    ty(DType::F32, dims)
}

/// Traces `body` over inputs named `a`, `b`, … of the given types.
fn program(inputs: &[LeafType], body: impl FnOnce(&[Tensor]) -> Vec<Tensor>) -> Graph {
    let named: Vec<(String, LeafType)> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| (char::from(b'a' + i as u8).to_string(), t.clone()))
        .collect();
    match trace(&named, body) {
        Ok(g) => g,
        Err(e) => panic!("trace failed: {e}"),
    }
}

/// Asserts that `text` has a line containing `part`.
#[track_caller]
fn has(text: &str, part: &str) {
    assert!(
        text.lines().any(|l| l.contains(part)),
        "no line contains {part:?} in:\n{text}"
    );
}

fn golden_program() -> Graph {
    program(&[f32t(&[2, 3]), f32t(&[3, 4])], |i| {
        vec![(i[0].matmul(i[1]) + 1.0).tanh().sum(&[1])]
    })
}

#[test]
fn golden_text() {
    let expected = "\
module @nitro {
  func.func public @main(%arg0: tensor<2x3xf32>, %arg1: tensor<3x4xf32>) -> tensor<2xf32> {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>
    %1 = stablehlo.constant dense<0x3F800000> : tensor<f32>
    %2 = stablehlo.broadcast_in_dim %1, dims = [] : (tensor<f32>) -> tensor<2x4xf32>
    %3 = stablehlo.add %0, %2 : tensor<2x4xf32>
    %4 = stablehlo.tanh %3 : tensor<2x4xf32>
    %init5 = stablehlo.constant dense<0x00000000> : tensor<f32>
    %5 = stablehlo.reduce(%4 init: %init5) applies stablehlo.add across dimensions = [1] : (tensor<2x4xf32>, tensor<f32>) -> tensor<2xf32>
    return %5 : tensor<2xf32>
  }
}
";
    assert_eq!(emit(&golden_program()), expected);
}

#[test]
fn same_program_same_text_and_fingerprint() {
    let (a, b) = (emit(&golden_program()), emit(&golden_program()));
    assert_eq!(a, b);
    assert_eq!(fingerprint(&a), fingerprint(&b));
    assert_eq!(
        fingerprint(&a),
        nitro::Digest::from(blake3::hash(a.as_bytes()))
    );
}

#[test]
fn different_constant_different_fingerprint() {
    let scaled = |k: f64| emit(&program(&[f32t(&[3])], |i| vec![i[0] * k]));
    let (two, three) = (scaled(2.0), scaled(3.0));
    has(&two, "stablehlo.constant dense<0x40000000> : tensor<f32>");
    has(&three, "stablehlo.constant dense<0x40400000> : tensor<f32>");
    assert_ne!(fingerprint(&two), fingerprint(&three));
    // Only the constant differs.
    let diff: Vec<_> = two
        .lines()
        .zip(three.lines())
        .filter(|(x, y)| x != y)
        .collect();
    assert_eq!(diff.len(), 1, "{diff:?}");
}

/// An exhaustive name for each op, so a new `Op` variant fails to compile here until it is tested.
fn op_kind(op: &Op) -> &'static str {
    match op {
        Op::Parameter { .. } => "parameter",
        Op::Constant(_) => "constant",
        Op::Iota { .. } => "iota",
        Op::Unary(u) => match u {
            UnaryOp::Neg | UnaryOp::Exp | UnaryOp::Log | UnaryOp::Tanh => u.name(),
            UnaryOp::Logistic | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Abs => u.name(),
            UnaryOp::Sin | UnaryOp::Cos | UnaryOp::Erf | UnaryOp::ErfInv => u.name(),
            UnaryOp::Log1p | UnaryOp::Expm1 | UnaryOp::Sign | UnaryOp::Floor => u.name(),
            UnaryOp::Ceil | UnaryOp::RoundNearestEven | UnaryOp::Not | UnaryOp::Popcnt => u.name(),
        },
        Op::Binary(b) => match b {
            BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div => b.name(),
            BinaryOp::Pow | BinaryOp::Max | BinaryOp::Min => b.name(),
            BinaryOp::Atan2 | BinaryOp::Rem | BinaryOp::And | BinaryOp::Or => b.name(),
            BinaryOp::Xor | BinaryOp::ShiftLeft => b.name(),
            BinaryOp::ShiftRightLogical | BinaryOp::ShiftRightArithmetic => b.name(),
        },
        Op::Compare(_) => "compare",
        Op::Select => "select",
        Op::Convert => "convert",
        Op::BroadcastInDim { .. } => "broadcast_in_dim",
        Op::Reshape => "reshape",
        Op::Transpose { .. } => "transpose",
        Op::Slice { .. } => "slice",
        Op::Concatenate { .. } => "concatenate",
        Op::DotGeneral(_) => "dot_general",
        Op::Reduce { kind, .. } => match kind {
            ReduceOp::Sum => "reduce sum",
            ReduceOp::Max => "reduce max",
            ReduceOp::Min => "reduce min",
        },
        Op::AllReduce => "all_reduce",
        Op::Shard(_) => "sharding_constraint",
        Op::StopGradient => "stop_gradient",
        Op::Clamp => "clamp",
        Op::BitcastConvert => "bitcast_convert",
        Op::Pad { .. } => "pad",
        Op::Reverse { .. } => "reverse",
        Op::Convolution(_) => "convolution",
        Op::ReduceWindow { kind, .. } => match kind {
            ReduceOp::Sum => "reduce_window sum",
            ReduceOp::Max => "reduce_window max",
            ReduceOp::Min => "reduce_window min",
        },
        Op::SelectAndScatter { .. } => "select_and_scatter",
        Op::Gather(_) => "gather",
        Op::Scatter { .. } => "scatter",
        Op::DynamicSlice { .. } => "dynamic_slice",
        Op::DynamicUpdateSlice => "dynamic_update_slice",
        Op::Scan(_) => "scan",
        Op::While(_) => "while_loop",
        Op::Result { .. } => "result",
    }
}

const ALL_KINDS: &[&str] = &[
    "parameter",
    "constant",
    "iota",
    "negate",
    "exponential",
    "log",
    "tanh",
    "logistic",
    "sqrt",
    "rsqrt",
    "abs",
    "add",
    "subtract",
    "multiply",
    "divide",
    "power",
    "maximum",
    "minimum",
    "compare",
    "select",
    "convert",
    "broadcast_in_dim",
    "reshape",
    "transpose",
    "slice",
    "concatenate",
    "dot_general",
    "reduce sum",
    "reduce max",
    "reduce min",
    "all_reduce",
    "sharding_constraint",
    "stop_gradient",
    "sine",
    "cosine",
    "erf",
    "erf_inv",
    "log_plus_one",
    "exponential_minus_one",
    "sign",
    "floor",
    "ceil",
    "round_nearest_even",
    "not",
    "popcnt",
    "atan2",
    "remainder",
    "and",
    "or",
    "xor",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "clamp",
    "bitcast_convert",
    "pad",
    "reverse",
    "convolution",
    "reduce_window sum",
    "reduce_window max",
    "reduce_window min",
    "select_and_scatter",
    "gather",
    "scatter",
    "dynamic_slice",
    "dynamic_update_slice",
    "scan",
    "while_loop",
    "result",
];

/// A reversed scan (a running product over rows, every product kept) and a while loop.
fn loop_program() -> Graph {
    use nitro::trace::{while_loop, Scan};
    program(&[f32t(&[2]), f32t(&[3, 2])], |i| {
        let (c, ys) = Scan::new()
            .reverse(true)
            .run(&[i[0]], &[i[1]], |c, x| (vec![c[0] * x[0]], vec![c[0]]));
        let w = while_loop(&[c[0]], |c| c[0].sum_all().less(10.0), |c| vec![c[0] * 2.0]);
        vec![c[0], ys[0], w[0]]
    })
}

#[test]
fn a_scan_is_a_while_calling_its_body_function() {
    let text = emit(&loop_program());
    for line in [
        "  func.func public @main(%arg0: tensor<2xf32>, %arg1: tensor<3x2xf32>) -> (tensor<2xf32>, tensor<3x2xf32>, tensor<2xf32>) {",
        "    %w0_i0 = stablehlo.constant dense<0> : tensor<i32>",
        "    %w0_y0_0 = stablehlo.constant dense<0x00000000> : tensor<3x2xf32>",
        "    %0:4 = stablehlo.while(%w0_a0 = %w0_i0, %w0_a1 = %arg0, %w0_a2 = %arg1, %w0_a3 = %w0_y0_0) : tensor<i32>, tensor<2xf32>, tensor<3x2xf32>, tensor<3x2xf32>",
        "      %w0_n = stablehlo.constant dense<3> : tensor<i32>",
        "      %w0_t = stablehlo.subtract %w0_last, %w0_a0 : tensor<i32>",
        "      %w0_xs0 = stablehlo.dynamic_slice %w0_a2, %w0_t, %w0_zero, sizes = [1, 2] : (tensor<3x2xf32>, tensor<i32>, tensor<i32>) -> tensor<1x2xf32>",
        "      %w0_r:2 = func.call @scan0(%w0_a1, %w0_x0) : (tensor<2xf32>, tensor<2xf32>) -> (tensor<2xf32>, tensor<2xf32>)",
        "      %w0_yn0 = stablehlo.dynamic_update_slice %w0_a3, %w0_yu0, %w0_t, %w0_zero : (tensor<3x2xf32>, tensor<1x2xf32>, tensor<i32>, tensor<i32>) -> tensor<3x2xf32>",
        "      stablehlo.return %w0_next, %w0_r#0, %w0_a2, %w0_yn0 : tensor<i32>, tensor<2xf32>, tensor<3x2xf32>, tensor<3x2xf32>",
        "    %1:1 = stablehlo.while(%w1_a0 = %0#1) : tensor<2xf32>",
        "      %w1_c:2 = func.call @scan1(%w1_a0) : (tensor<2xf32>) -> (tensor<i1>, tensor<2xf32>)",
        "      stablehlo.return %w1_c#0 : tensor<i1>",
        "      stablehlo.return %w1_b#1 : tensor<2xf32>",
        "    return %0#1, %0#3, %1#0 : tensor<2xf32>, tensor<3x2xf32>, tensor<2xf32>",
        "  func.func private @scan0(%arg0: tensor<2xf32>, %arg1: tensor<2xf32>) -> (tensor<2xf32>, tensor<2xf32>) {",
        "  func.func private @scan1(%arg0: tensor<2xf32>) -> (tensor<i1>, tensor<2xf32>) {",
    ] {
        has(&text, line);
    }
    // The functions follow @main, inside the module.
    assert!(text.find("@main").unwrap() < text.find("func.func private @scan0").unwrap());
    assert!(text.ends_with("  }\n}\n"), "{text}");
}

/// One of each op of `nitro::ops`' families (and `select_and_scatter`, from a max window's
/// gradient).
fn family_program() -> Graph {
    use nitro::trace::{grad, Conv, ScatterDims, ScatterKind, Window};
    let i32t = |dims: &[usize]| LeafType {
        dtype: DType::I32,
        dims: dims.to_vec(),
    };
    let u32t = |dims: &[usize]| LeafType {
        dtype: DType::U32,
        dims: dims.to_vec(),
    };
    program(
        &[
            f32t(&[1, 4, 4, 2]),
            f32t(&[3, 3, 2, 3]),
            i32t(&[3]),
            u32t(&[4]),
            i32t(&[]),
        ],
        |i| {
            let (x, k, ids, bits, start) = (i[0], i[1], i[2], i[3], i[4]);
            let flat = x.reshape(&[16, 2]);
            // Overlapping windows: `reduce_window` and `select_and_scatter`; `tiled` windows
            // are written as a reshape and a reduction (`tiled_pooling_is_a_reshape_and_a_reduce`).
            let w = Window::new(&[1, 3, 3, 1]).strides(&[1, 2, 2, 1]);
            let pooled_grad = grad(x.window_max(&w).sum_all(), &[x]).remove(0);
            let d = ScatterDims {
                update_window_dims: vec![1],
                inserted_window_dims: vec![0],
                scatter_dims_to_operand_dims: vec![0],
                index_vector_dim: 1,
            };
            let e = flat.exp();
            vec![
                e.sin(),
                e.cos(),
                e.erf(),
                (e * 0.1).erf_inv(),
                e.log1p(),
                e.expm1(),
                e.sign(),
                e.floor(),
                e.ceil(),
                e.round_nearest_even(),
                !bits,
                bits.popcnt(),
                e.atan2(e),
                e % e,
                bits.and(bits),
                bits.or(bits),
                bits.xor(bits),
                bits.shift_left(bits),
                bits.shift_right_logical(bits),
                bits.shift_right_arithmetic(bits),
                Tensor::clamp(0.0, e, 1.0),
                e.bitcast_convert(DType::U32),
                e.pad(0.0, &[1, 0], &[0, 1], &[1, 0]),
                e.reverse(&[0]),
                x.conv(k, &Conv::channels_last(2).same_for(&[4, 4], &[3, 3])),
                x.window_sum(&w),
                x.window_max(&w),
                x.window_min(&w),
                pooled_grad,
                flat.take(ids, 0),
                flat.scatter(
                    ids.reshape(&[3, 1]),
                    flat.slice(&[0, 0], &[3, 2]),
                    &d,
                    ScatterKind::Add,
                ),
                flat.dynamic_slice(&[start, start], &[4, 2]),
                flat.dynamic_update_slice(flat.slice(&[0, 0], &[2, 2]), &[start, start]),
            ]
        },
    )
}

#[test]
fn family_op_lines() {
    let text = emit(&family_program());
    for line in [
        "= chlo.erf %",
        "= chlo.erf_inv %",
        "= stablehlo.sine %",
        "= stablehlo.round_nearest_even %",
        "= stablehlo.shift_right_logical %arg3, %arg3 : tensor<4xui32>",
        "= stablehlo.popcnt %arg3 : tensor<4xui32>",
        "= stablehlo.clamp %",
        " : (tensor<16x2xf32>) -> tensor<16x2xui32>",
        "low = [1, 0], high = [0, 1], interior = [1, 0] : (tensor<16x2xf32>, tensor<f32>) -> tensor<32x3xf32>",
        "= stablehlo.reverse %",
        "stablehlo.convolution(%arg0, %arg1) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1], pad = [[1, 1], [1, 1]], lhs_dilate = [1, 1], rhs_dilate = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64, precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]} : (tensor<1x4x4x2xf32>, tensor<3x3x2x3xf32>) -> tensor<1x4x4x3xf32>",
        "\"stablehlo.reduce_window\"(%arg0, %init",
        "window_dimensions = array<i64: 1, 3, 3, 1>, window_strides = array<i64: 1, 2, 2, 1>",
        "\"stablehlo.select_and_scatter\"(%arg0, %",
        "stablehlo.compare GE, %a, %b, FLOAT",
        "#stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: 1, 2>",
        "#stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>",
        "sizes = [4, 2] : (tensor<16x2xf32>, tensor<i32>, tensor<i32>) -> tensor<4x2xf32>",
        "stablehlo.dynamic_update_slice %",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
}

#[test]
fn tiled_pooling_is_a_reshape_and_a_reduce() {
    use nitro::trace::{grad, Window};
    // A 2×2/2 window over 4×6: the forward is a reshape to [2, 2, 3, 2] and a max over the
    // window dims; its gradient has no `select_and_scatter`.
    let graph = program(&[f32t(&[4, 6])], |i| {
        let w = Window::new(&[2, 2]).strides(&[2, 2]);
        let pooled = i[0].window_max(&w);
        vec![pooled, grad(pooled.sum_all(), &[i[0]]).remove(0)]
    });
    let text = emit(&graph);
    has(
        &text,
        "%tile0 = stablehlo.reshape %arg0 : (tensor<4x6xf32>) -> tensor<2x2x3x2xf32>",
    );
    has(
        &text,
        "across dimensions = [1, 3] : (tensor<2x2x3x2xf32>, tensor<f32>) -> tensor<2x3xf32>",
    );
    for absent in ["reduce_window", "select_and_scatter"] {
        assert!(!text.contains(absent), "{absent} in:\n{text}");
    }
    // A remainder (5 rows: the last one in no window) keeps `reduce_window` forward.
    let ragged = program(&[f32t(&[5, 6])], |i| {
        vec![i[0].window_max(&Window::new(&[2, 2]).strides(&[2, 2]))]
    });
    has(&emit(&ragged), "\"stablehlo.reduce_window\"(%arg0, %init");
}

/// `stop_gradient` is the value itself: a same-type reshape XLA removes.
fn shard_program() -> Graph {
    let spec = nitro::shard::PartitionSpec::new([Some("data"), None]);
    program(&[f32t(&[4, 3])], move |i| {
        vec![i[0].shard(spec.clone()).exp()]
    })
}

#[test]
fn a_sharding_constraint_is_shardys_on_a_mesh_and_the_value_itself_off_one() {
    let graph = shard_program();
    // Off a mesh: a same-type reshape, as stop_gradient.
    has(
        &emit(&graph),
        "%0 = stablehlo.reshape %arg0 : (tensor<4x3xf32>) -> tensor<4x3xf32>",
    );
    let sharding = nitro::shard::ProgramSharding {
        mesh: nitro::shard::Mesh::new([("data", 2)]).unwrap(),
        inputs: Vec::new(),
        outputs: Vec::new(),
    };
    let text = emit_with(
        &graph,
        &EmitOptions {
            sharding: Some(sharding),
            ..EmitOptions::default()
        },
    );
    has(
        &text,
        "%0 = sdy.sharding_constraint %arg0 <@mesh, [{\"data\"}, {}]> : tensor<4x3xf32>",
    );
}

fn stop_gradient_program() -> Graph {
    program(&[f32t(&[2, 3])], |i| vec![i[0].stop_gradient().exp()])
}

#[test]
fn stop_gradient_is_a_same_type_reshape() {
    let text = emit(&stop_gradient_program());
    has(
        &text,
        "    %0 = stablehlo.reshape %arg0 : (tensor<2x3xf32>) -> tensor<2x3xf32>",
    );
    has(&text, "    %1 = stablehlo.exponential %0 : tensor<2x3xf32>");
}

/// A program replicated over two devices: the sum of its input over both.
fn replicated_program() -> Graph {
    let ty = f32t(&[2]);
    nitro::trace::trace_replicated(2, || vec![nitro::trace::input("x", ty.clone()).all_sum()])
        .unwrap()
}

#[test]
fn a_replicated_program_declares_its_replica_count_and_sums_over_all_replicas() {
    let expected = "\
module @nitro attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 2 : i32} {
  func.func public @main(%arg0: tensor<2xf32>) -> tensor<2xf32> {
    %0 = \"stablehlo.all_reduce\"(%arg0) ({
      ^bb0(%lhs: tensor<f32>, %rhs: tensor<f32>):
        %sum = stablehlo.add %lhs, %rhs : tensor<f32>
        stablehlo.return %sum : tensor<f32>
    }) {replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>} : (tensor<2xf32>) -> tensor<2xf32>
    return %0 : tensor<2xf32>
  }
}
";
    assert_eq!(emit(&replicated_program()), expected);
}

fn elementwise_program() -> Graph {
    program(&[f32t(&[2, 3]), f32t(&[2, 3])], |i| {
        let (x, y) = (i[0], i[1]);
        vec![
            -x,
            x.exp(),
            x.log(),
            x.tanh(),
            x.logistic(),
            x.sqrt(),
            x.rsqrt(),
            x.abs(),
            x + y,
            x - y,
            x * y,
            x / y,
            x.pow(y),
            x.maximum(y),
            x.minimum(y),
        ]
    })
}

#[test]
fn elementwise_lines() {
    let text = emit(&elementwise_program());
    let unary = [
        "negate",
        "exponential",
        "log",
        "tanh",
        "logistic",
        "sqrt",
        "rsqrt",
        "abs",
    ];
    for (n, op) in unary.iter().enumerate() {
        has(
            &text,
            &format!("    %{n} = stablehlo.{op} %arg0 : tensor<2x3xf32>"),
        );
    }
    let binary = [
        "add", "subtract", "multiply", "divide", "power", "maximum", "minimum",
    ];
    for (n, op) in binary.iter().enumerate() {
        let n = n + unary.len();
        if op.ends_with("imum") {
            // Float maximum/minimum spell NaN propagation out.
            let t = "tensor<2x3xf32>";
            let p = "tensor<2x3xi1>";
            let block = format!(
                "    %raw{n} = stablehlo.{op} %arg0, %arg1 : {t}\n    \
                 %nan_a{n} = stablehlo.compare NE, %arg0, %arg0, FLOAT : ({t}, {t}) -> {p}\n    \
                 %nan_b{n} = stablehlo.compare NE, %arg1, %arg1, FLOAT : ({t}, {t}) -> {p}\n    \
                 %pick{n} = stablehlo.select %nan_b{n}, %arg1, %raw{n} : {p}, {t}\n    \
                 %{n} = stablehlo.select %nan_a{n}, %arg0, %pick{n} : {p}, {t}\n"
            );
            assert!(text.contains(&block), "no {block:?} in:\n{text}");
            continue;
        }
        has(
            &text,
            &format!("    %{n} = stablehlo.{op} %arg0, %arg1 : tensor<2x3xf32>"),
        );
    }
    has(&text, "-> (tensor<2x3xf32>, tensor<2x3xf32>, ");
    has(&text, "    return %0, %1, %2, ");
}

fn compare_select_program() -> Graph {
    let types = [
        f32t(&[2, 3]),
        ty(DType::I32, &[4]),
        ty(DType::U8, &[4]),
        ty(DType::Bool, &[4]),
        ty(DType::I64, &[4]),
        ty(DType::F64, &[]),
    ];
    program(&types, |i| {
        vec![
            i[0].less(i[0] * 2.0),
            i[1].greater_equal(i[1]),
            i[2].equal(i[2]),
            i[3].not_equal(i[3]),
            i[4].less_equal(i[4]),
            i[5].greater(i[5]),
            Tensor::select(i[0].greater(0.0), i[0], 0.0),
        ]
    })
}

#[test]
fn compare_and_select_lines() {
    let text = emit(&compare_select_program());
    has(&text, "= stablehlo.compare LT, %arg0, %2, FLOAT : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xi1>");
    has(&text, "= stablehlo.compare GE, %arg1, %arg1, SIGNED : (tensor<4xi32>, tensor<4xi32>) -> tensor<4xi1>");
    has(&text, "= stablehlo.compare EQ, %arg2, %arg2, UNSIGNED : (tensor<4xui8>, tensor<4xui8>) -> tensor<4xi1>");
    has(&text, "= stablehlo.compare NE, %arg3, %arg3, UNSIGNED : (tensor<4xi1>, tensor<4xi1>) -> tensor<4xi1>");
    has(&text, "= stablehlo.compare LE, %arg4, %arg4, SIGNED : (tensor<4xi64>, tensor<4xi64>) -> tensor<4xi1>");
    has(
        &text,
        "= stablehlo.compare GT, %arg5, %arg5, FLOAT : (tensor<f64>, tensor<f64>) -> tensor<i1>",
    );
    let select = text
        .lines()
        .find(|l| l.contains("stablehlo.select"))
        .unwrap_or_default();
    assert!(
        select.ends_with(" : tensor<2x3xi1>, tensor<2x3xf32>") && select.contains("%arg0, %"),
        "{select}"
    );
    has(&text, "func.func public @main(%arg0: tensor<2x3xf32>, %arg1: tensor<4xi32>, %arg2: tensor<4xui8>, %arg3: tensor<4xi1>, %arg4: tensor<4xi64>, %arg5: tensor<f64>)");
}

#[test]
fn select_with_scalar_pred_uses_the_functional_type() {
    // The tracer broadcasts the predicate, so build the graph by hand.
    let mut g = Graph::default();
    let types = [ty(DType::Bool, &[]), f32t(&[2]), f32t(&[2])];
    for (index, t) in types.iter().enumerate() {
        let node = g.push(Op::Parameter { index }, vec![], t.clone());
        g.inputs.push(Input {
            name: format!("p{index}"),
            ty: t.clone(),
            node,
        });
    }
    let s = g.push(Op::Select, vec![0, 1, 2], f32t(&[2]));
    g.outputs = vec![s];
    has(
        &emit(&g),
        "    %0 = stablehlo.select %arg0, %arg1, %arg2 : (tensor<i1>, tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>",
    );
}

fn shape_program() -> Graph {
    let types = [
        f32t(&[3, 4]),
        f32t(&[4]),
        f32t(&[2, 2, 3]),
        f32t(&[2, 3, 2]),
        f32t(&[3, 2]),
    ];
    program(&types, |i| {
        vec![
            i[0].convert(DType::I32),
            i[1].broadcast_to(&[3, 4]),
            i[0].reshape(&[2, 6]),
            i[0].t(),
            i[0].slice_strided(&[1, 0], &[3, 4], &[1, 2]),
            i[0].slice(&[0, 1], &[1, 4]),
            Tensor::concatenate(&[i[0], i[0].slice(&[0, 0], &[3, 2])], 1),
            i[2].matmul(i[3]),
            i[4].dot_general(
                i[0],
                DotDims {
                    lhs_batch: vec![],
                    rhs_batch: vec![],
                    lhs_contract: vec![0],
                    rhs_contract: vec![0],
                },
            ),
            Tensor::iota(DType::I64, &[2, 3], 1),
        ]
    })
}

#[test]
fn shape_op_lines() {
    let text = emit(&shape_program());
    has(
        &text,
        "= stablehlo.convert %arg0 : (tensor<3x4xf32>) -> tensor<3x4xi32>",
    );
    has(
        &text,
        "= stablehlo.broadcast_in_dim %arg1, dims = [1] : (tensor<4xf32>) -> tensor<3x4xf32>",
    );
    has(
        &text,
        "= stablehlo.reshape %arg0 : (tensor<3x4xf32>) -> tensor<2x6xf32>",
    );
    has(
        &text,
        "= stablehlo.transpose %arg0, dims = [1, 0] : (tensor<3x4xf32>) -> tensor<4x3xf32>",
    );
    has(
        &text,
        "= stablehlo.slice %arg0 [1:3, 0:4:2] : (tensor<3x4xf32>) -> tensor<2x2xf32>",
    );
    has(
        &text,
        "= stablehlo.slice %arg0 [0:1, 1:4] : (tensor<3x4xf32>) -> tensor<1x3xf32>",
    );
    let concat = text
        .lines()
        .find(|l| l.contains("stablehlo.concatenate"))
        .unwrap_or_default();
    assert!(
        concat.contains("stablehlo.concatenate %arg0, %")
            && concat
                .ends_with(", dim = 1 : (tensor<3x4xf32>, tensor<3x2xf32>) -> tensor<3x6xf32>"),
        "{concat}"
    );
    has(&text, "= stablehlo.dot_general %arg2, %arg3, batching_dims = [0] x [0], contracting_dims = [2] x [1], precision = [HIGHEST, HIGHEST] : (tensor<2x2x3xf32>, tensor<2x3x2xf32>) -> tensor<2x2x2xf32>");
    has(&text, "= stablehlo.dot_general %arg4, %arg0, contracting_dims = [0] x [0], precision = [HIGHEST, HIGHEST] : (tensor<3x2xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>");
    has(&text, "= stablehlo.iota dim = 1 : tensor<2x3xi64>");
}

fn reduce_program() -> Graph {
    let types = [
        f32t(&[2, 3]),
        ty(DType::F64, &[2, 3]),
        ty(DType::I32, &[4]),
        ty(DType::I64, &[4]),
        ty(DType::U8, &[4]),
    ];
    program(&types, |i| {
        vec![
            i[0].sum(&[0]),
            i[0].max(&[1]),
            i[0].min(&[0, 1]),
            i[1].sum(&[1]),
            i[1].max(&[1]),
            i[1].min(&[1]),
            i[2].sum(&[0]),
            i[2].max(&[0]),
            i[2].min(&[0]),
            i[3].sum(&[0]),
            i[3].max(&[0]),
            i[3].min(&[0]),
            i[4].sum(&[0]),
            i[4].max(&[0]),
            i[4].min(&[0]),
        ]
    })
}

#[test]
fn reduce_lines_and_inits() {
    let text = emit(&reduce_program());
    let expect = [
        (
            "%arg0",
            "add",
            "[0]",
            "tensor<2x3xf32>",
            "tensor<f32>",
            "tensor<3xf32>",
            "0x00000000",
        ),
        (
            "%arg0",
            "maximum",
            "[1]",
            "tensor<2x3xf32>",
            "tensor<f32>",
            "tensor<2xf32>",
            "0xFF800000",
        ),
        (
            "%arg0",
            "minimum",
            "[0, 1]",
            "tensor<2x3xf32>",
            "tensor<f32>",
            "tensor<f32>",
            "0x7F800000",
        ),
        (
            "%arg1",
            "add",
            "[1]",
            "tensor<2x3xf64>",
            "tensor<f64>",
            "tensor<2xf64>",
            "0x0000000000000000",
        ),
        (
            "%arg1",
            "maximum",
            "[1]",
            "tensor<2x3xf64>",
            "tensor<f64>",
            "tensor<2xf64>",
            "0xFFF0000000000000",
        ),
        (
            "%arg1",
            "minimum",
            "[1]",
            "tensor<2x3xf64>",
            "tensor<f64>",
            "tensor<2xf64>",
            "0x7FF0000000000000",
        ),
        (
            "%arg2",
            "add",
            "[0]",
            "tensor<4xi32>",
            "tensor<i32>",
            "tensor<i32>",
            "0",
        ),
        (
            "%arg2",
            "maximum",
            "[0]",
            "tensor<4xi32>",
            "tensor<i32>",
            "tensor<i32>",
            "-2147483648",
        ),
        (
            "%arg2",
            "minimum",
            "[0]",
            "tensor<4xi32>",
            "tensor<i32>",
            "tensor<i32>",
            "2147483647",
        ),
        (
            "%arg3",
            "add",
            "[0]",
            "tensor<4xi64>",
            "tensor<i64>",
            "tensor<i64>",
            "0",
        ),
        (
            "%arg3",
            "maximum",
            "[0]",
            "tensor<4xi64>",
            "tensor<i64>",
            "tensor<i64>",
            "-9223372036854775808",
        ),
        (
            "%arg3",
            "minimum",
            "[0]",
            "tensor<4xi64>",
            "tensor<i64>",
            "tensor<i64>",
            "9223372036854775807",
        ),
        (
            "%arg4",
            "add",
            "[0]",
            "tensor<4xui8>",
            "tensor<ui8>",
            "tensor<ui8>",
            "0",
        ),
        (
            "%arg4",
            "maximum",
            "[0]",
            "tensor<4xui8>",
            "tensor<ui8>",
            "tensor<ui8>",
            "0",
        ),
        (
            "%arg4",
            "minimum",
            "[0]",
            "tensor<4xui8>",
            "tensor<ui8>",
            "tensor<ui8>",
            "255",
        ),
    ];
    for (n, (arg, op, dims, t, st, rt, init)) in expect.into_iter().enumerate() {
        has(
            &text,
            &format!("    %init{n} = stablehlo.constant dense<{init}> : {st}"),
        );
        let float = st == "tensor<f32>" || st == "tensor<f64>";
        if op == "add" || !float {
            has(
                &text,
                &format!(
                    "    %{n} = stablehlo.reduce({arg} init: %init{n}) applies stablehlo.{op} across dimensions = {dims} : ({t}, {st}) -> {rt}"
                ),
            );
        } else {
            // Float max/min propagate NaN through a reducer block.
            let block = format!(
                    "    %{n} = stablehlo.reduce({arg} init: %init{n}) across dimensions = {dims} : ({t}, {st}) -> {rt}\n     reducer(%acc: {st}, %e: {st}) {{\n      %acc_nan = stablehlo.compare NE, %acc, %acc, FLOAT : ({st}, {st}) -> tensor<i1>\n      %e_nan = stablehlo.compare NE, %e, %e, FLOAT : ({st}, {st}) -> tensor<i1>\n      %m = stablehlo.{op} %acc, %e : {st}\n      %m_e = stablehlo.select %e_nan, %e, %m : tensor<i1>, {st}\n      %r = stablehlo.select %acc_nan, %acc, %m_e : tensor<i1>, {st}\n      stablehlo.return %r : {st}\n    }}\n"
            );
            assert!(text.contains(&block), "no {block:?} in:\n{text}");
        }
    }
}

fn constant_program() -> Graph {
    let c = |a: Result<Array, nitro::Error>| match a {
        Ok(a) => Tensor::constant(a),
        Err(e) => panic!("{e}"),
    };
    program(&[], |_| {
        vec![
            c(Array::from_vec(&[2, 2], vec![1.0f32, 2.0, 3.0, 4.0])),
            c(Array::from_vec(&[3], vec![1i32, -1, 256])),
            c(Array::from_vec(&[2], vec![1.0f64, -2.5])),
            Tensor::constant(Array::full(&[2, 3], 1.5f32)),
            Tensor::constant(Array::scalar(f32::NEG_INFINITY)),
            Tensor::constant(Array::full(&[2], -7i64)),
            Tensor::constant(Array::full(&[3], 200u8)),
            c(Array::from_vec(&[3], vec![0u8, 1, 255])),
            c(Array::from_vec(
                &[2, 3],
                vec![true, false, true, false, false, true],
            )),
            Tensor::constant(Array::full(&[2, 2], true)),
            Tensor::constant(Array::zeros(DType::F32, &[0, 3])),
            c(Array::from_vec(&[2], vec![0.0f32, -0.0])),
            Tensor::constant(Array::scalar(1.0f64)),
        ]
    })
}

#[test]
fn constant_lines() {
    let text = emit(&constant_program());
    let expect = [
        r#"dense<"0x0000803F000000400000404000008040"> : tensor<2x2xf32>"#,
        r#"dense<"0x01000000FFFFFFFF00010000"> : tensor<3xi32>"#,
        r#"dense<"0x000000000000F03F00000000000004C0"> : tensor<2xf64>"#,
        "dense<0x3FC00000> : tensor<2x3xf32>",
        "dense<0xFF800000> : tensor<f32>",
        "dense<-7> : tensor<2xi64>",
        "dense<200> : tensor<3xui8>",
        r#"dense<"0x0001FF"> : tensor<3xui8>"#,
        "dense<[[true, false, true], [false, false, true]]> : tensor<2x3xi1>",
        "dense<true> : tensor<2x2xi1>",
        "dense<> : tensor<0x3xf32>",
        // -0.0 and 0.0 differ in bits, so this is no splat.
        r#"dense<"0x0000000000000080"> : tensor<2xf32>"#,
        "dense<0x3FF0000000000000> : tensor<f64>",
    ];
    for (n, e) in expect.iter().enumerate() {
        has(&text, &format!("    %{n} = stablehlo.constant {e}"));
    }
    has(&text, "func.func public @main() -> (tensor<2x2xf32>, ");
}

#[test]
fn every_op_kind_is_covered() {
    let graphs = [
        golden_program(),
        elementwise_program(),
        compare_select_program(),
        shape_program(),
        reduce_program(),
        constant_program(),
        replicated_program(),
        stop_gradient_program(),
        shard_program(),
        family_program(),
        loop_program(),
    ];
    let mut seen = std::collections::BTreeSet::new();
    for g in &graphs {
        let live = g.live();
        for (n, node) in g.nodes.iter().enumerate() {
            if live[n] {
                seen.insert(op_kind(&node.op));
            }
        }
    }
    let missing: Vec<_> = ALL_KINDS.iter().filter(|k| !seen.contains(*k)).collect();
    assert!(missing.is_empty(), "not covered: {missing:?}");
    assert_eq!(seen.len(), ALL_KINDS.len());
}

#[test]
fn a_million_element_constant_is_one_hex_string() {
    let values: Vec<f32> = (0..1_000_000).map(|i| i as f32 * 0.5).collect();
    let big = match Array::from_vec(&[1000, 1000], values) {
        Ok(a) => a,
        Err(e) => panic!("{e}"),
    };
    let g = program(&[f32t(&[1000, 1000])], |i| {
        vec![i[0] + Tensor::constant(big)]
    });
    let text = emit(&g);
    let line = text
        .lines()
        .find(|l| l.contains("stablehlo.constant"))
        .unwrap_or_default();
    let prefix = "    %0 = stablehlo.constant dense<\"0x";
    let suffix = "\"> : tensor<1000x1000xf32>";
    assert!(
        line.starts_with(prefix) && line.ends_with(suffix),
        "{}",
        &line[..80.min(line.len())]
    );
    let hex = &line[prefix.len()..line.len() - suffix.len()];
    assert_eq!(hex.len(), 2 * 4 * 1_000_000);
    assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
    // Elements 0.0, 0.5, 1.0, little-endian.
    assert!(
        hex.starts_with("000000000000003F0000803F"),
        "{}",
        &hex[..24]
    );
    assert!(text.len() < hex.len() + 1000);
}

#[test]
fn donated_arguments_carry_the_alias() {
    let g = program(&[f32t(&[3]), f32t(&[3]), f32t(&[])], |i| {
        vec![i[0] - i[2] * i[1]]
    });
    let plain = emit(&g);
    assert!(!plain.contains("aliasing"));
    let donated = emit_with(
        &g,
        &EmitOptions {
            donate: vec![(0, 0)],
            ..EmitOptions::default()
        },
    );
    has(
        &donated,
        "func.func public @main(%arg0: tensor<3xf32> {tf.aliasing_output = 0 : i32}, %arg1: tensor<3xf32>, %arg2: tensor<f32>) -> tensor<3xf32> {",
    );
    assert_ne!(fingerprint(&plain), fingerprint(&donated));
    // Two donations, into outputs 1 and 0.
    let g2 = program(&[f32t(&[3]), f32t(&[3])], |i| vec![i[1] * 2.0, i[0] * 2.0]);
    let text = emit_with(
        &g2,
        &EmitOptions {
            donate: vec![(1, 0), (0, 1)],
            ..EmitOptions::default()
        },
    );
    has(&text, "(%arg0: tensor<3xf32> {tf.aliasing_output = 1 : i32}, %arg1: tensor<3xf32> {tf.aliasing_output = 0 : i32})");
}

#[test]
fn dead_nodes_are_not_emitted() {
    let g = program(&[f32t(&[2, 3])], |i| {
        let _unused = i[0].exp().sum(&[0]);
        let y = i[0].tanh();
        let _also_unused = y * 3.0;
        vec![y, i[0]]
    });
    assert!(g.nodes.len() > 3);
    let text = emit(&g);
    assert_eq!(
        text,
        "\
module @nitro {
  func.func public @main(%arg0: tensor<2x3xf32>) -> (tensor<2x3xf32>, tensor<2x3xf32>) {
    %0 = stablehlo.tanh %arg0 : tensor<2x3xf32>
    return %0, %arg0 : tensor<2x3xf32>, tensor<2x3xf32>
  }
}
"
    );
}

#[test]
fn unused_inputs_stay_in_the_signature_and_odd_shapes_print() {
    let g = program(
        &[ty(DType::Bool, &[0, 3]), ty(DType::U8, &[]), f32t(&[0, 3])],
        |i| vec![-i[2], i[1]],
    );
    let text = emit(&g);
    has(
        &text,
        "func.func public @main(%arg0: tensor<0x3xi1>, %arg1: tensor<ui8>, %arg2: tensor<0x3xf32>) -> (tensor<0x3xf32>, tensor<ui8>) {",
    );
    has(&text, "    %0 = stablehlo.negate %arg2 : tensor<0x3xf32>");
    has(&text, "    return %0, %arg1 : tensor<0x3xf32>, tensor<ui8>");
}

#[test]
fn hand_built_constant_node_is_shared_not_copied() {
    // Constants are `Arc`ed in the IR; emission reads them in place.
    let a = Arc::new(Array::full(&[4], 3i32));
    let mut g = Graph::default();
    let c = g.push(Op::Constant(a.clone()), vec![], a.leaf_type());
    let n = g.push(Op::Compare(CmpOp::Lt), vec![c, c], ty(DType::Bool, &[4]));
    g.outputs = vec![n];
    let text = emit(&g);
    has(
        &text,
        "    %0 = stablehlo.constant dense<3> : tensor<4xi32>",
    );
    has(&text, "    %1 = stablehlo.compare LT, %0, %0, SIGNED : (tensor<4xi32>, tensor<4xi32>) -> tensor<4xi1>");
    has(&text, "  func.func public @main() -> tensor<4xi1> {");
}
