//! Every op, by family: one home per family, named after it. A family's home holds, for its
//! ops, the [`Tensor`] methods with their trace-time checks, the result-type rule the
//! interpreter re-checks hand-built graphs with, the VJP rule, the StableHLO emission and the
//! interpreter kernel. A reader looking for "how does nitro do convolution" opens `conv.rs` and
//! finds all of it.
//!
//! Why this cut (by family, every layer together) and not by layer (a tracer file, a VJP file,
//! an emitter, a kernel file): an op's four pieces change together — a new attribute (say,
//! dilation) touches the check, the gradient, the text and the kernel at once — and they must
//! agree with each other, which is easiest to see when they sit side by side; a file per layer
//! grows with every op until no one finds anything in it. What every family shares stays in the
//! drivers, which dispatch here: the IR ([`crate::trace::ir`], one `Op` enum), the recording and
//! the reverse pass ([`crate::trace`], [`crate::trace::autodiff`]), the module text and constant
//! encoding ([`crate::emit`]), and the interpreter's run loop, input checks and half-precision
//! widening ([`crate::backend::interp`]). Replication (`all_reduce`) belongs to those drivers.
//!
//! The op catalog:
//!
//! | family | home | ops |
//! | --- | --- | --- |
//! | element-wise | `elementwise/` (`mod.rs`: rules, VJPs, emission, new functions; `tracing.rs`: operands, broadcasting and the first ops' methods; `kernels.rs`: the typed scalar kernels) | `neg exp log tanh logistic sqrt rsqrt abs sin cos erf erf_inv log1p expm1 sign floor ceil round_nearest_even not popcnt`, `add sub mul div pow max min atan2 rem and or xor shift_*`, `compare`, `select`, `convert`, `clamp`, `bitcast_convert`, `stop_gradient`, constants |
//! | shape | `shape.rs` | `broadcast_in_dim`, `reshape`, `transpose`, `slice`, `concatenate`, `iota`, `pad`, `reverse` |
//! | products | `linalg.rs` | `dot_general` (`matmul`, `matmul_to`, `dot_general_to`) |
//! | reductions | `reduce.rs` | `reduce` (sum, max, min; `mean`, `argmax`) |
//! | windows | `window.rs` | `reduce_window` (sum, max, min; `cumsum`), `select_and_scatter` |
//! | convolution | `conv.rs` | `convolution` |
//! | indexing | `index.rs` | `gather`, `scatter` (add, replace), `dynamic_slice`, `dynamic_update_slice`, and `take`, `take_along_axis` on top |
//! | random | `random.rs` | Threefry-2x32, `bits`, `split`, `fold_in`, `uniform`, `normal`, `bernoulli` (built from `u32` ops) |
//! | loops | `scan.rs` | `scan` (a static trip count; its VJP is a reverse `scan`, saving or recomputing the residuals), `while_loop` (a traced condition; no derivative), and the `result` nodes that read a loop's results |
//!
//! `docs/tracing.md` has the same table op by op, with each VJP rule and its tests.
//!
//! The loops hold sub-graphs, so the drivers handle them with `scan.rs`'s functions; every other
//! op goes through the dispatch at the end of this file, which names every `Op` variant (no
//! default arm), so an op added to the IR without its type rule, VJP, emission and kernel does
//! not compile. Every size a rule computes from attributes (dilated, padded and strided sizes,
//! group products) is checked arithmetic bounded by nitro's size limit
//! ([`crate::MAX_TENSOR_BYTES`], 2^63 − 1): past it, tracing fails naming the op, the
//! attribute and its value.

pub mod conv;
pub mod elementwise;
pub(crate) mod host;
pub mod index;
pub mod linalg;
pub mod random;
pub mod reduce;
pub mod scan;
pub mod shape;
pub mod window;

use crate::ops::host::Fault;
use crate::tree::ArrayData;

pub(crate) use crate::ops::host::layout::map_data as same_dtype;

/// Integer storage as `i64`s (index operands), or a fault for floats and bools.
pub(crate) fn index_values(data: &ArrayData) -> Result<Vec<i64>, Fault> {
    let n = data.len();
    Ok(match data {
        ArrayData::I32(v) => crate::ops::host::alloc::collect(n, v.iter().map(|&x| x as i64))?,
        ArrayData::I64(v) => crate::ops::host::alloc::collect(n, v.iter().copied())?,
        ArrayData::U8(v) => crate::ops::host::alloc::collect(n, v.iter().map(|&x| x as i64))?,
        ArrayData::U32(v) => crate::ops::host::alloc::collect(n, v.iter().map(|&x| x as i64))?,
        other => {
            return Err(Fault::Invalid(format!(
                "indices must be integers, not {}",
                other.dtype()
            )))
        }
    })
}

/// `Ok` when an op has the `n` operands it takes, or what is wrong.
pub(crate) fn arity(n: usize, have: usize) -> Result<(), String> {
    if n == have {
        Ok(())
    } else {
        Err(format!("it takes {n} operands but has {have}"))
    }
}

/// Whether `axes` are distinct and below `rank`.
pub(crate) fn distinct_in_range(axes: &[usize], rank: usize) -> bool {
    let mut seen = vec![false; rank];
    axes.iter()
        .all(|&a| a < rank && !std::mem::replace(&mut seen[a], true))
}

/// The type of the stand-in for a tensor from another trace.
pub(crate) fn f32_scalar() -> crate::tree::LeafType {
    crate::tree::LeafType {
        dtype: crate::tree::DType::F32,
        dims: Vec::new(),
    }
}

/// `(n − 1)·d + 1`: a size after dilation by `d` (0 stays 0). Only for sizes a checked type
/// bounds (the trace-time rules use [`dilated`]).
pub(crate) fn dilate(n: usize, d: usize) -> usize {
    if n == 0 {
        0
    } else {
        (n - 1) * d + 1
    }
}

// ---- sizes computed from attributes ----------------------------------------------------------
//
// StableHLO holds every size, stride, dilation, padding amount and group count as a signed
// 64-bit integer, and XLA computes dilated and padded sizes in that type: a value past it is
// emitted wrapped (XLA then fails, blaming the plugin) or overflows inside XLA (which aborts
// the process). So every size the rules below compute from attributes is checked arithmetic,
// bounded by nitro's size limit (2^63 − 1, [`crate::MAX_TENSOR_BYTES`]), and a value past it is
// a trace-time error saying which attribute and value — never a wrong result type.

/// nitro's size limit as a bound on sizes, strides, dilations and padding amounts: 2^63 − 1.
pub(crate) const SIZE_LIMIT: u64 = crate::MAX_TENSOR_BYTES;

/// How [`SIZE_LIMIT`] reads in messages.
pub(crate) const LIMIT_WORDS: &str =
    "nitro's size limit of 2^63 − 1 (nitro::MAX_TENSOR_BYTES; StableHLO's sizes are signed 64-bit)";

/// `Ok` when every value of attribute `name` (one per dim; `role` names them, as "dim" or
/// "spatial dim") is within nitro's size limit, or what is wrong.
pub(crate) fn within_limit(name: &str, role: &str, values: &[usize]) -> Result<(), String> {
    match values.iter().position(|&v| v as u64 > SIZE_LIMIT) {
        None => Ok(()),
        Some(d) => Err(format!(
            "{name} {values:?}: {} ({role} {d}) is over {LIMIT_WORDS}; use a smaller value",
            values[d]
        )),
    }
}

/// `Ok` when every padding amount of attribute `name` (`(low, high)` per dim) is within
/// ±(2^63 − 1) — so that its negation, which a gradient pads with, exists — or what is wrong.
pub(crate) fn padding_within_limit(
    name: &str,
    role: &str,
    padding: &[(i64, i64)],
) -> Result<(), String> {
    match padding
        .iter()
        .position(|&(lo, hi)| lo == i64::MIN || hi == i64::MIN)
    {
        None => Ok(()),
        Some(d) => Err(format!(
            "{name} {:?} ({role} {d}) holds {}: padding amounts must be within ±(2^63 − 1) \
             (nitro::MAX_TENSOR_BYTES), so that a gradient can pad by their negation; use a \
             smaller amount",
            padding[d],
            i64::MIN
        )),
    }
}

/// `(n − 1)·d + 1` (0 for `n = 0`): the `n` elements of `what` spread by attribute `name` = `d`
/// in `role` `dim`, or what is wrong when that is over nitro's size limit.
pub(crate) fn dilated(
    what: &str,
    n: usize,
    name: &str,
    d: usize,
    (role, dim): (&str, usize),
) -> Result<u64, String> {
    let size = if n == 0 {
        0
    } else {
        (n as u128 - 1) * d as u128 + 1
    };
    if size > SIZE_LIMIT as u128 {
        return Err(format!(
            "{role} {dim}: {name} {d} spreads the {n} elements of {what} over ({n} − 1)·{d} + 1 \
             = {size} positions, over {LIMIT_WORDS}; use a smaller {name}"
        ));
    }
    Ok(size as u64)
}

/// `low + n + high`: `n` positions of `what` padded by attribute `name` = `(low, high)` in
/// `role` `dim`, or what is wrong when the sum is over nitro's size limit or a partial sum
/// (XLA adds them in some order, in 64 bits) leaves the signed 64-bit range. The sum may be
/// negative (the callers say what that means).
pub(crate) fn padded(
    what: &str,
    n: u64,
    name: &str,
    (low, high): (i64, i64),
    (role, dim): (&str, usize),
) -> Result<i128, String> {
    let (lo, n128, hi) = (low as i128, n as i128, high as i128);
    let sum = lo + n128 + hi;
    let place = format!("{role} {dim}: {name} ({low}, {high}) around the {n} positions of {what}");
    if sum > SIZE_LIMIT as i128 {
        return Err(format!(
            "{place} gives {sum} positions, over {LIMIT_WORDS}; use less padding"
        ));
    }
    let range = i64::MIN as i128..=SIZE_LIMIT as i128;
    let partials = [
        ("low + size", lo + n128),
        ("size + high", n128 + hi),
        ("low + high", lo + hi),
    ];
    match partials.into_iter().find(|(_, p)| !range.contains(p)) {
        None => Ok(sum),
        Some((which, p)) => Err(format!(
            "{place} gives {sum} positions, but its partial sum {which} = {p} is past the \
             signed 64-bit range XLA adds them in (nitro's size limit, 2^63 − 1, \
             nitro::MAX_TENSOR_BYTES); use less padding"
        )),
    }
}

/// A padding amount computed from sizes and other amounts (a gradient's), as an `i64` within
/// ±(2^63 − 1), or what is wrong: `what` names it, in `dim`.
pub(crate) fn padding_amount(p: i128, what: &str, dim: usize) -> Result<i64, String> {
    if p.unsigned_abs() > SIZE_LIMIT as u128 {
        Err(format!(
            "dim {dim}: {what} would be {p}, past ±(2^63 − 1) (nitro::MAX_TENSOR_BYTES); use \
             smaller padding or sizes"
        ))
    } else {
        Ok(p as i64)
    }
}

/// The first dim `axes` repeats, if any.
pub(crate) fn repeated(axes: &[usize]) -> Option<usize> {
    axes.iter()
        .enumerate()
        .find(|&(i, a)| axes[..i].contains(a))
        .map(|(_, &a)| a)
}

/// Row-major multi-index of flat position `i` in `dims`, into `idx`.
pub(crate) fn unflatten(mut i: usize, dims: &[usize], idx: &mut [usize]) {
    for (slot, &d) in idx.iter_mut().zip(dims).rev() {
        if d > 0 {
            *slot = i % d;
            i /= d;
        }
    }
}

// ---- dispatch from the shared drivers --------------------------------------------------------

use std::fmt;

use crate::emit::line::Line;
use crate::trace::ir::{Node, Op};
use crate::trace::record::Tensor;
use crate::tree::{Array, LeafType};

/// The pattern of the ops the families here handle (the drivers send them to the functions
/// below).
macro_rules! family_op {
    () => {
        $crate::trace::ir::Op::Unary(_)
            | $crate::trace::ir::Op::Binary(_)
            | $crate::trace::ir::Op::Compare(_)
            | $crate::trace::ir::Op::Select
            | $crate::trace::ir::Op::Convert
            | $crate::trace::ir::Op::StopGradient
            | $crate::trace::ir::Op::Iota { .. }
            | $crate::trace::ir::Op::BroadcastInDim { .. }
            | $crate::trace::ir::Op::Reshape
            | $crate::trace::ir::Op::Transpose { .. }
            | $crate::trace::ir::Op::Slice { .. }
            | $crate::trace::ir::Op::Concatenate { .. }
            | $crate::trace::ir::Op::Clamp
            | $crate::trace::ir::Op::DotGeneral(_)
            | $crate::trace::ir::Op::Reduce { .. }
            | $crate::trace::ir::Op::BitcastConvert
            | $crate::trace::ir::Op::Pad { .. }
            | $crate::trace::ir::Op::Reverse { .. }
            | $crate::trace::ir::Op::Convolution(_)
            | $crate::trace::ir::Op::ReduceWindow { .. }
            | $crate::trace::ir::Op::SelectAndScatter { .. }
            | $crate::trace::ir::Op::Gather(_)
            | $crate::trace::ir::Op::Scatter { .. }
            | $crate::trace::ir::Op::DynamicSlice { .. }
            | $crate::trace::ir::Op::DynamicUpdateSlice
    };
}
pub(crate) use family_op;

/// The ops the drivers handle themselves — parameters, constants, replication (`all_reduce`)
/// and the loops with their results — never sent to the functions below, which name them only
/// so that their matches have no default arm.
macro_rules! driver_op {
    () => {
        Op::Parameter { .. }
            | Op::Constant(_)
            | Op::AllReduce
            | Op::Shard(_)
            | Op::Scan(_)
            | Op::While(_)
            | Op::Result { .. }
    };
}

/// A match on `$op` (an `&Op`) naming every op: the first element-wise and shape ops bind their
/// view ([`elementwise::Core`], [`shape::Core`]) to `$e` / `$s` and give `$on_e` / `$on_s`;
/// `$arms` must name every other op. There is no default arm: an `Op` variant added without
/// its rule here, or a view variant without its rule in the family, does not compile.
macro_rules! dispatch {
    ($op:expr; $e:ident => $on_e:expr; $s:ident => $on_s:expr; $($arms:tt)*) => {
        match $op {
            Op::Unary(u) => {
                let $e = elementwise::Core::Unary(*u);
                $on_e
            }
            Op::Binary(b) => {
                let $e = elementwise::Core::Binary(*b);
                $on_e
            }
            Op::Compare(c) => {
                let $e = elementwise::Core::Compare(*c);
                $on_e
            }
            Op::Select => {
                let $e = elementwise::Core::Select;
                $on_e
            }
            Op::Convert => {
                let $e = elementwise::Core::Convert;
                $on_e
            }
            Op::StopGradient => {
                let $e = elementwise::Core::StopGradient;
                $on_e
            }
            Op::Iota { axis } => {
                let $s = shape::Core::Iota { axis: *axis };
                $on_s
            }
            Op::BroadcastInDim { dims } => {
                let $s = shape::Core::BroadcastInDim { dims };
                $on_s
            }
            Op::Reshape => {
                let $s = shape::Core::Reshape;
                $on_s
            }
            Op::Transpose { perm } => {
                let $s = shape::Core::Transpose { perm };
                $on_s
            }
            Op::Slice {
                start,
                limit,
                strides,
            } => {
                let $s = shape::Core::Slice {
                    start,
                    limit,
                    strides,
                };
                $on_s
            }
            Op::Concatenate { axis } => {
                let $s = shape::Core::Concatenate { axis: *axis };
                $on_s
            }
            $($arms)*
        }
    };
}

/// The result type a family op gives for operands of `types`, or what is wrong (the
/// interpreter's check of a hand-built graph; traced graphs pass by construction).
pub(crate) fn result_type(node: &Node, types: &[&LeafType]) -> Result<LeafType, String> {
    let want = |n: usize| arity(n, types.len());
    dispatch! { &node.op;
        e => elementwise::core_type(e, &node.ty, types);
        s => shape::core_type(s, &node.ty, types);
        Op::Clamp => {
            want(3)?;
            if types[0] != types[1] || types[2] != types[1] {
                return Err("its operands must have one type".into());
            }
            Ok(types[1].clone())
        }
        Op::BitcastConvert => {
            want(1)?;
            elementwise::bitcast_type(types[0], node.ty.dtype)
        }
        Op::Reduce { axes, .. } => {
            want(1)?;
            reduce::reduce_type(types[0], axes)
        }
        Op::DotGeneral(d) => {
            want(2)?;
            let mut t = linalg::dot_type(types[0], types[1], d)?;
            if linalg::product_dtype_ok(t.dtype, node.ty.dtype) {
                t.dtype = node.ty.dtype;
            }
            Ok(t)
        }
        Op::Pad {
            low,
            high,
            interior,
        } => {
            want(2)?;
            shape::pad_type(types[0], types[1], low, high, interior)
        }
        Op::Reverse { axes } => {
            want(1)?;
            shape::reverse_type(types[0], axes)
        }
        Op::Convolution(c) => {
            want(2)?;
            conv::conv_type(types[0], types[1], c)
        }
        Op::ReduceWindow { window, .. } => {
            want(1)?;
            window::reduce_window_type(types[0], window)
        }
        Op::SelectAndScatter { kind, window } => {
            want(2)?;
            window::select_and_scatter_type(types[0], types[1], *kind, window)
        }
        Op::Gather(d) => {
            want(2)?;
            index::gather_type(types[0], types[1], d)
        }
        Op::Scatter { dims, .. } => {
            want(3)?;
            index::scatter_type(types[0], types[1], types[2], dims)
        }
        Op::DynamicSlice { sizes } => {
            let starts: Vec<LeafType> = types.iter().skip(1).map(|t| (*t).clone()).collect();
            index::dynamic_slice_type(types[0], &starts, sizes)
        }
        Op::DynamicUpdateSlice => {
            if types.len() < 2 {
                return Err("it takes an operand, an update and the starts".into());
            }
            let starts: Vec<LeafType> = types.iter().skip(2).map(|t| (*t).clone()).collect();
            index::dynamic_update_slice_type(types[0], types[1], &starts)
        }
        driver_op!() => Err(format!("`{}` is not an op of crate::ops", node.op.name())),
    }
}

/// The VJP of a family op: the cotangent `g` of `node` (value `y`, inputs `x`) for each input.
pub(crate) fn vjp(node: &Node, y: Tensor, x: &[Tensor], g: Tensor) -> Vec<Option<Tensor>> {
    dispatch! { &node.op;
        e => elementwise::core_vjp(e, y, x, g);
        s => shape::core_vjp(s, &node.ty, x, g);
        Op::Reduce { kind, axes } => reduce::vjp(*kind, axes, node.ty.dtype, y, x, g),
        Op::Clamp => elementwise::clamp_vjp(x[0], x[1], x[2], g),
        // The bits of a float as an integer (or back): no gradient, as in JAX.
        Op::BitcastConvert => vec![None],
        Op::DotGeneral(d) => linalg::vjp(d, node.ty.dtype, x, g),
        Op::Pad {
            low,
            high,
            interior,
        } => shape::pad_vjp(g, low, high, interior),
        Op::Reverse { axes } => vec![Some(g.reverse(axes))],
        Op::Convolution(c) => conv::vjp(c, x[0], x[1], g),
        Op::ReduceWindow { kind, window } => window::vjp(*kind, window, x[0], g),
        Op::SelectAndScatter { .. } => {
            crate::trace::record::refuse(
                "window_max",
                "the second derivative of a max/min window is not defined".into(),
            );
            vec![None, None]
        }
        Op::Gather(d) => index::gather_vjp(d, x[0], x[1], g),
        Op::Scatter { dims, kind } => index::scatter_vjp(dims, *kind, x[0], x[1], x[2], g),
        Op::DynamicSlice { .. } => index::dynamic_slice_vjp(x[0], &x[1..], g),
        Op::DynamicUpdateSlice => index::dynamic_update_slice_vjp(x[1], &x[2..], g),
        // Never sent here: the reverse pass gives these their own rules.
        driver_op!() => vec![None; x.len()],
    }
}

/// Writes a family op's StableHLO.
pub(crate) fn emit(node: &Node, l: Line<'_>) -> fmt::Result {
    let dtype = node.ty.dtype;
    dispatch! { &node.op;
        e => elementwise::core_emit(e, &node.ty, l);
        s => shape::core_emit(s, l);
        Op::Clamp => elementwise::emit_clamp(l),
        Op::BitcastConvert => elementwise::emit_bitcast(l),
        Op::DotGeneral(d) => linalg::emit(l, d),
        Op::Reduce { kind, axes } => reduce::emit(l, *kind, axes, dtype),
        Op::Pad {
            low,
            high,
            interior,
        } => shape::emit_pad(l, low, high, interior),
        Op::Reverse { axes } => shape::emit_reverse(l, axes),
        Op::Convolution(c) => conv::emit(l, c),
        Op::ReduceWindow { kind, window } => window::emit_reduce_window(l, *kind, window, dtype),
        Op::SelectAndScatter { kind, window } => {
            window::emit_select_and_scatter(l, *kind, window, dtype)
        }
        Op::Gather(d) => index::emit_gather(l, d),
        Op::Scatter { dims, kind } => index::emit_scatter(l, dims, *kind, dtype),
        Op::DynamicSlice { sizes } => index::emit_dynamic_slice(l, sizes),
        Op::DynamicUpdateSlice => index::emit_dynamic_update_slice(l),
        // Never sent here: the emitter writes these itself.
        driver_op!() => Ok(()),
    }
}

/// Evaluates a family op on the host.
pub(crate) fn eval(node: &Node, a: &[&Array]) -> Result<ArrayData, Fault> {
    let out = &node.ty;
    dispatch! { &node.op;
        e => elementwise::core_eval(e, out, a);
        s => shape::core_eval(s, out, a);
        Op::Clamp => elementwise::eval_clamp(a[0], a[1], a[2]),
        Op::BitcastConvert => elementwise::eval_bitcast(a[0], out.dtype),
        Op::DotGeneral(d) => linalg::eval(d, a),
        Op::Reduce { kind, axes } => reduce::eval_reduce(*kind, a[0].data(), a[0].dims(), axes),
        Op::Pad { low, interior, .. } => shape::eval_pad(a[0], a[1], out, low, interior),
        Op::Reverse { axes } => shape::eval_reverse(a[0], axes),
        Op::Convolution(c) => conv::eval(a[0], a[1], out, c),
        Op::ReduceWindow { kind, window } => window::eval_reduce_window(a[0], out, *kind, window),
        Op::SelectAndScatter { kind, window } => {
            window::eval_select_and_scatter(a[0], a[1], *kind, window)
        }
        Op::Gather(d) => index::eval_gather(a[0], a[1], out, d),
        Op::Scatter { dims, kind } => index::eval_scatter(a[0], a[1], a[2], dims, *kind),
        Op::DynamicSlice { sizes } => index::eval_dynamic_slice(a[0], &a[1..], sizes),
        Op::DynamicUpdateSlice => index::eval_dynamic_update_slice(a[0], a[1], &a[2..]),
        // Never sent here: the run loop evaluates these itself.
        driver_op!() => Err(Fault::Invalid(format!(
            "`{}` is not an op of crate::ops",
            node.op.name()
        ))),
    }
}
