//! Reductions over whole dims: `sum`, `max`, `min` (and `mean`, `argmax` on top).
//!
//! Inits: sum 0; max −∞ or the type's minimum; min +∞ or the type's maximum, so an empty group
//! gives the init. NaN propagates through float max/min, as in NumPy and JAX, on both backends:
//! XLA's CPU backend drops a NaN element in a reduction by a bare `maximum`, so the emitted
//! reducer spells NaN propagation out (`nan_propagating`, shared with `reduce_window`). Float
//! sums add pairwise in the interpreter. VJPs: a sum broadcasts the cotangent back; max/min
//! split it evenly between the tied winners. (Windowed reductions are in `window.rs`.)

use std::fmt::{self, Write as _};
use std::panic::Location;

use crate::emit::line::{self as emit, Line};
use crate::ops::elementwise::kernels::{half_in_kernel, Float, Int};
use crate::ops::elementwise::tracing::check_axes;
use crate::ops::host::alloc::{collect, filled};
use crate::ops::host::layout::transpose_vec;
use crate::ops::host::Fault;
use crate::trace::ir::{is_float, reduced_dims, with_dims, BinaryOp, Op, ReduceOp};
use crate::trace::record::{with_recording, Recording, Tensor};
use crate::tree::{dims_product, ArrayData, DType, LeafType};

// ---- types ---------------------------------------------------------------------------------

/// The result type of a reduction of `t` over `axes`, or what is wrong.
pub(crate) fn reduce_type(t: &LeafType, axes: &[usize]) -> Result<LeafType, String> {
    if !axes.windows(2).all(|w| w[0] < w[1]) || axes.iter().any(|&a| a >= t.dims.len()) {
        return Err(format!(
            "axes {axes:?} must be ascending, distinct dims of {t}"
        ));
    }
    let dims = (0..t.dims.len())
        .filter(|i| !axes.contains(i))
        .map(|i| t.dims[i])
        .collect();
    Ok(LeafType {
        dtype: t.dtype,
        dims,
    })
}

// ---- tracing -------------------------------------------------------------------------------

impl Recording {
    pub(crate) fn reduce(
        &mut self,
        kind: ReduceOp,
        a: Tensor,
        axes: &[usize],
        keep: bool,
        op: &'static str,
        at: &Location<'_>,
    ) -> Tensor {
        let ty = self.ty_of(a);
        let axes = match check_axes(ty.dims.len(), axes) {
            Ok(a) => a,
            Err(msg) => return self.fail(op, format!("{msg} (operand {ty})"), at, ty),
        };
        if ty.dtype == DType::Bool {
            return self.fail(
                op,
                format!("cannot reduce a bool tensor ({ty}); convert it first"),
                at,
                ty,
            );
        }
        let out = with_dims(ty.dtype, reduced_dims(&ty.dims, &axes));
        let r = self.push(
            Op::Reduce {
                kind,
                axes: axes.clone(),
            },
            vec![a.node],
            out,
            op,
            at,
        );
        if keep {
            let kept = ty
                .dims
                .iter()
                .enumerate()
                .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
                .collect();
            self.push(Op::Reshape, vec![r.node], with_dims(ty.dtype, kept), op, at)
        } else {
            r
        }
    }
}

impl Tensor {
    /// Sum over `axes` (removed).
    #[track_caller]
    pub fn sum(self, axes: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.reduce(ReduceOp::Sum, self, axes, false, "sum", at))
    }
    /// Sum over `axes`, kept as dims of size 1.
    #[track_caller]
    pub fn sum_keep(self, axes: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.reduce(ReduceOp::Sum, self, axes, true, "sum", at))
    }
    /// Sum of all elements (a scalar).
    #[track_caller]
    pub fn sum_all(self) -> Tensor {
        let axes: Vec<usize> = (0..self.rank()).collect();
        self.sum(&axes)
    }
    /// Maximum over `axes` (removed). NaN propagates, as in NumPy's and JAX's `max`: a group
    /// holding a NaN gives NaN, on every backend. An empty group gives −∞ (or the integer type's
    /// minimum).
    #[track_caller]
    pub fn max(self, axes: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.reduce(ReduceOp::Max, self, axes, false, "max", at))
    }
    /// Maximum over `axes`, kept as dims of size 1 (NaN propagates, as in [`Tensor::max`]).
    #[track_caller]
    pub fn max_keep(self, axes: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.reduce(ReduceOp::Max, self, axes, true, "max", at))
    }
    /// Minimum over `axes` (removed). NaN propagates, as in [`Tensor::max`]; an empty group gives
    /// +∞ (or the integer type's maximum).
    #[track_caller]
    pub fn min(self, axes: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.reduce(ReduceOp::Min, self, axes, false, "min", at))
    }
    /// Mean over `axes` (removed). Float tensors only.
    #[track_caller]
    pub fn mean(self, axes: &[usize]) -> Tensor {
        self.mean_impl(axes, false, Location::caller())
    }
    /// Mean over `axes`, kept as dims of size 1.
    #[track_caller]
    pub fn mean_keep(self, axes: &[usize]) -> Tensor {
        self.mean_impl(axes, true, Location::caller())
    }
    /// Mean of all elements (a scalar).
    #[track_caller]
    pub fn mean_all(self) -> Tensor {
        let axes: Vec<usize> = (0..self.rank()).collect();
        self.mean_impl(&axes, false, Location::caller())
    }
    fn mean_impl(self, axes: &[usize], keep: bool, at: &Location<'_>) -> Tensor {
        with_recording(|r| {
            let ty = r.ty_of(self);
            if !is_float(&ty) {
                return r.fail(
                    "mean",
                    format!("mean needs a float tensor, got {ty}"),
                    at,
                    ty,
                );
            }
            // A sub-product of a type within the size limit: it cannot overflow.
            let reduced: Vec<usize> = axes
                .iter()
                .filter_map(|&a| ty.dims.get(a).copied())
                .collect();
            let count = dims_product(&reduced).unwrap_or(usize::MAX);
            let s = r.reduce(ReduceOp::Sum, self, axes, keep, "mean", at);
            let dims = r.ty_of(s).dims;
            let n = r.scalar(count as f64, ty.dtype, "mean", at);
            let n = r.broadcast_to(n, &dims, "mean", at);
            r.push(
                Op::Binary(BinaryOp::Div),
                vec![s.node, n.node],
                with_dims(ty.dtype, dims),
                "mean",
                at,
            )
        })
    }
    /// The index of the maximum along `axis` (the first on ties), as `i32`. NaN counts as the
    /// maximum, as in NumPy's `argmax`: a row holding NaN gives the index of its **first** NaN.
    /// Not differentiable.
    #[track_caller]
    pub fn argmax(self, axis: usize) -> Tensor {
        let ty = self.ty();
        let m = self.max_keep(&[axis]);
        // NaN propagates (as in NumPy): a NaN maximum (`m`) equals nothing, so the positions
        // that win are the NaNs themselves (`x != x`), and the first NaN is the answer.
        let is_max = self.equal(m).maximum(self.not_equal(self));
        let idx = Tensor::iota(
            DType::I32,
            &ty.dims,
            axis.min(ty.dims.len().saturating_sub(1)),
        );
        let big = ty.dims.get(axis).copied().unwrap_or(0) as f64;
        Tensor::select(is_max, idx, big).min(&[axis])
    }
}

// ---- gradients -----------------------------------------------------------------------------

/// The VJP of a reduction of `x` (its value `y`) over `axes`.
pub(crate) fn vjp(
    kind: ReduceOp,
    axes: &[usize],
    dtype: DType,
    y: Tensor,
    x: &[Tensor],
    g: Tensor,
) -> Vec<Option<Tensor>> {
    let from = x[0].dims();
    let kept: Vec<usize> = from
        .iter()
        .enumerate()
        .map(|(i, &n)| if axes.contains(&i) { 1 } else { n })
        .collect();
    let gk = g.reshape(&kept);
    let d = match kind {
        ReduceOp::Sum => gk.broadcast_to(&from),
        ReduceOp::Max | ReduceOp::Min => {
            let hit = x[0].equal(y.reshape(&kept)).convert(dtype);
            hit * gk / hit.sum_keep(axes)
        }
    };
    vec![Some(d)]
}

// ---- emission ------------------------------------------------------------------------------

/// `stablehlo.reduce`, its init constant on the line before (`%initN`).
pub(crate) fn emit(mut l: Line<'_>, kind: ReduceOp, axes: &[usize], dtype: DType) -> fmt::Result {
    let st = emit::scalar_type(dtype);
    let init = emit_init(&mut l, kind, dtype)?;
    let applies = match kind {
        ReduceOp::Sum => "add",
        ReduceOp::Max => "maximum",
        ReduceOp::Min => "minimum",
    };
    let (me, an, at, ty) = (&l.me, &l.args[0], &l.arg_tys[0], &l.ty);
    if kind == ReduceOp::Sum || !dtype.is_float() {
        return writeln!(
            l.out,
            "    {me} = stablehlo.reduce({an} init: {init}) applies stablehlo.{applies} across dimensions = {} : ({at}, {st}) -> {ty}",
            emit::list(axes)
        );
    }
    // XLA's CPU backend drops a NaN element in a reduction by a bare
    // `stablehlo.maximum`/`minimum` (element-wise, the same ops propagate NaN), so float max/min
    // reductions spell NaN propagation out in the reducer.
    writeln!(
        l.out,
        "    {me} = stablehlo.reduce({an} init: {init}) across dimensions = {} : ({at}, {st}) -> {ty}",
        emit::list(axes)
    )?;
    writeln!(l.out, "     reducer(%acc: {st}, %e: {st}) {{")?;
    nan_propagating(l.out, "      ", applies, &st, ("acc", "e"))?;
    writeln!(l.out, "    }}")
}

/// A reducer body over scalars `%a`, `%b` (`names`) of type `st` that applies `applies`
/// (`maximum`, `minimum`) and propagates NaN from either side: `%a` if it is NaN, else `%b` if
/// it is, else the op — what XLA's CPU backend does not do for a bare `maximum` in a reduction.
pub(crate) fn nan_propagating(
    out: &mut String,
    indent: &str,
    applies: &str,
    st: &str,
    (a, b): (&str, &str),
) -> fmt::Result {
    let cmp = format!("FLOAT : ({st}, {st}) -> tensor<i1>");
    writeln!(
        out,
        "{indent}%{a}_nan = stablehlo.compare NE, %{a}, %{a}, {cmp}"
    )?;
    writeln!(
        out,
        "{indent}%{b}_nan = stablehlo.compare NE, %{b}, %{b}, {cmp}"
    )?;
    writeln!(out, "{indent}%m = stablehlo.{applies} %{a}, %{b} : {st}")?;
    writeln!(
        out,
        "{indent}%m_{b} = stablehlo.select %{b}_nan, %{b}, %m : tensor<i1>, {st}"
    )?;
    writeln!(
        out,
        "{indent}%r = stablehlo.select %{a}_nan, %{a}, %m_{b} : tensor<i1>, {st}"
    )?;
    writeln!(out, "{indent}stablehlo.return %r : {st}")
}

/// The identity of a reduction as a `stablehlo.constant` line's literal (see `reduce_init`).
fn init_literal(kind: ReduceOp, dtype: DType) -> String {
    let mut s = String::new();
    let _ = reduce_init(&mut s, kind, dtype);
    s
}

/// Writes the init constant of a reduction over `dtype` (its identity) as `%initN` on a line
/// of its own, and returns that name.
pub(crate) fn emit_init(
    l: &mut Line<'_>,
    kind: ReduceOp,
    dtype: DType,
) -> Result<String, fmt::Error> {
    let init = format!("%init{}", l.n);
    writeln!(
        l.out,
        "    {init} = stablehlo.constant {} : {}",
        init_literal(kind, dtype),
        emit::scalar_type(dtype)
    )?;
    Ok(init)
}

/// The identity of a reduction, as a splat literal: `0` for a sum, the lowest value (−∞ for
/// floats) for a maximum, the highest (+∞) for a minimum.
fn reduce_init(out: &mut String, kind: ReduceOp, dtype: DType) -> fmt::Result {
    match (kind, dtype) {
        (ReduceOp::Sum, DType::F32) => write!(out, "dense<0x{:08X}>", 0f32.to_bits()),
        (ReduceOp::Sum, DType::F64) => write!(out, "dense<0x{:016X}>", 0f64.to_bits()),
        (ReduceOp::Sum, DType::Bool) | (ReduceOp::Max, DType::Bool) => {
            out.write_str("dense<false>")
        }
        (ReduceOp::Sum, DType::BF16 | DType::F16) => out.write_str("dense<0x0000>"),
        (ReduceOp::Max, DType::BF16) => {
            write!(out, "dense<0x{:04X}>", half::bf16::NEG_INFINITY.to_bits())
        }
        (ReduceOp::Max, DType::F16) => {
            write!(out, "dense<0x{:04X}>", half::f16::NEG_INFINITY.to_bits())
        }
        (ReduceOp::Min, DType::BF16) => {
            write!(out, "dense<0x{:04X}>", half::bf16::INFINITY.to_bits())
        }
        (ReduceOp::Min, DType::F16) => {
            write!(out, "dense<0x{:04X}>", half::f16::INFINITY.to_bits())
        }
        (ReduceOp::Sum, _) => out.write_str("dense<0>"),
        (ReduceOp::Max, DType::F32) => write!(out, "dense<0x{:08X}>", f32::NEG_INFINITY.to_bits()),
        (ReduceOp::Max, DType::F64) => write!(out, "dense<0x{:016X}>", f64::NEG_INFINITY.to_bits()),
        (ReduceOp::Max, DType::I32) => write!(out, "dense<{}>", i32::MIN),
        (ReduceOp::Max, DType::I64) => write!(out, "dense<{}>", i64::MIN),
        (ReduceOp::Max, DType::U8) => write!(out, "dense<{}>", u8::MIN),
        (ReduceOp::Max, DType::U32) => write!(out, "dense<{}>", u32::MIN),
        (ReduceOp::Min, DType::F32) => write!(out, "dense<0x{:08X}>", f32::INFINITY.to_bits()),
        (ReduceOp::Min, DType::F64) => write!(out, "dense<0x{:016X}>", f64::INFINITY.to_bits()),
        (ReduceOp::Min, DType::I32) => write!(out, "dense<{}>", i32::MAX),
        (ReduceOp::Min, DType::I64) => write!(out, "dense<{}>", i64::MAX),
        (ReduceOp::Min, DType::U8) => write!(out, "dense<{}>", u8::MAX),
        (ReduceOp::Min, DType::U32) => write!(out, "dense<{}>", u32::MAX),
        (ReduceOp::Min, DType::Bool) => out.write_str("dense<true>"),
    }
}

// ---- interpreter ---------------------------------------------------------------------------

/// Folds a non-empty slice pairwise (halves, then halves of halves), which keeps float sums
/// accurate to `O(log n)` roundings instead of `O(n)`.
fn fold_pairwise<T: Copy>(v: &[T], f: &impl Fn(T, T) -> T) -> T {
    if v.len() <= 32 {
        v[1..].iter().fold(v[0], |acc, &x| f(acc, x))
    } else {
        let (l, r) = v.split_at(v.len() / 2);
        f(fold_pairwise(l, f), fold_pairwise(r, f))
    }
}
/// Reduces `v` (shape `dims`) over `axes` (ascending), starting from `init`.
fn reduce_vec<T: Copy>(
    v: &[T],
    dims: &[usize],
    axes: &[usize],
    init: T,
    f: impl Fn(T, T) -> T,
) -> Result<Vec<T>, Fault> {
    let mut perm: Vec<usize> = (0..dims.len()).filter(|d| !axes.contains(d)).collect();
    // Sub-products of a checked type's dims (see `layout::strides`): they cannot overflow.
    let size = |ds: &[usize]| {
        ds.iter()
            .map(|&d| dims[d])
            .fold(1usize, usize::saturating_mul)
    };
    let out_len = size(&perm);
    perm.extend_from_slice(axes);
    let group = size(axes);
    if group == 0 {
        return filled(out_len, init);
    }
    let moved = transpose_vec(v, dims, &perm)?;
    collect(
        out_len,
        moved
            .chunks_exact(group)
            .map(|c| f(init, fold_pairwise(c, &f))),
    )
}
fn reduce_float<T: Float>(
    kind: ReduceOp,
    v: &[T],
    dims: &[usize],
    axes: &[usize],
) -> Result<Vec<T>, Fault> {
    match kind {
        ReduceOp::Sum => reduce_vec(v, dims, axes, T::ZERO, |a, b| a.binary(b, BinaryOp::Add)),
        ReduceOp::Max => reduce_vec(v, dims, axes, T::NEG_INF, |a, b| a.binary(b, BinaryOp::Max)),
        ReduceOp::Min => reduce_vec(v, dims, axes, T::INF, |a, b| a.binary(b, BinaryOp::Min)),
    }
}
fn reduce_int<T: Int>(
    kind: ReduceOp,
    v: &[T],
    dims: &[usize],
    axes: &[usize],
) -> Result<Vec<T>, Fault> {
    match kind {
        ReduceOp::Sum => reduce_vec(v, dims, axes, T::ZERO, |a, b| a.binary(b, BinaryOp::Add)),
        ReduceOp::Max => reduce_vec(v, dims, axes, T::MIN, |a, b| a.binary(b, BinaryOp::Max)),
        ReduceOp::Min => reduce_vec(v, dims, axes, T::MAX, |a, b| a.binary(b, BinaryOp::Min)),
    }
}
/// A reduction over `axes` (ascending) of storage of shape `dims`. Inits: sum 0; max −∞ or the
/// type's minimum; min +∞ or the type's maximum (an empty reduction gives the init). On bool,
/// sum and max are `or`, min is `and`.
pub(crate) fn eval_reduce(
    kind: ReduceOp,
    a: &ArrayData,
    dims: &[usize],
    axes: &[usize],
) -> Result<ArrayData, Fault> {
    Ok(match a {
        ArrayData::F32(v) => ArrayData::F32(reduce_float(kind, v, dims, axes)?),
        ArrayData::F64(v) => ArrayData::F64(reduce_float(kind, v, dims, axes)?),
        ArrayData::I32(v) => ArrayData::I32(reduce_int(kind, v, dims, axes)?),
        ArrayData::I64(v) => ArrayData::I64(reduce_int(kind, v, dims, axes)?),
        ArrayData::U8(v) => ArrayData::U8(reduce_int(kind, v, dims, axes)?),
        ArrayData::U32(v) => ArrayData::U32(reduce_int(kind, v, dims, axes)?),
        ArrayData::BF16(_) | ArrayData::F16(_) => return Err(half_in_kernel()),
        ArrayData::Bool(v) => ArrayData::Bool(match kind {
            ReduceOp::Sum | ReduceOp::Max => reduce_vec(v, dims, axes, false, |a, b| a | b)?,
            ReduceOp::Min => reduce_vec(v, dims, axes, true, |a, b| a & b)?,
        }),
    })
}
