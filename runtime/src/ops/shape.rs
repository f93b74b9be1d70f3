//! Shape ops that move elements without arithmetic: `broadcast_in_dim`, `reshape`, `transpose`,
//! `slice`, `concatenate`, `iota`, `pad` and `reverse`.
//!
//! - `pad(x, value, low, high, interior)`: `low[d]`/`high[d]` elements of `value` before and
//!   after dim `d` (negative removes elements), `interior[d]` between neighbours. Dim `d` of the
//!   result is `low + high + n + (n − 1)·interior` (for `n > 0`; `low + high` for `n = 0`).
//!   VJP: the operand gets the cotangent padded by `−low, −high` and sliced with step
//!   `interior + 1`; the padding value gets the sum of the cotangent minus the operand's share.
//! - `reverse(x, axes)`: VJP is `reverse(g, axes)`.

use std::fmt;
use std::panic::Location;

use super::elementwise::tracing::Operand;
use crate::emit::line::Line;
use crate::ops::elementwise::tracing::{broadcast_dims, scalar_ty};
use crate::ops::host::alloc::{collect, filled, with_capacity};
use crate::ops::host::layout::{gather, map_data, strides};
use crate::ops::host::Fault;
use crate::trace::ir::{with_dims, Op};
use crate::trace::record::{with_recording, Recording, Tensor};
use crate::tree::{dims_product, Array, ArrayData, DType, Element, LeafType};

use super::{arity, distinct_in_range, same_dtype, unflatten};

// ---- types ---------------------------------------------------------------------------------

/// The result type of `pad`, or what is wrong.
pub(crate) fn pad_type(
    x: &LeafType,
    value: &LeafType,
    low: &[i64],
    high: &[i64],
    interior: &[usize],
) -> Result<LeafType, String> {
    let r = x.dims.len();
    if low.len() != r || high.len() != r || interior.len() != r {
        return Err(format!(
            "low {low:?}, high {high:?} and interior {interior:?} must have one entry per dim of {x}"
        ));
    }
    if value.dtype != x.dtype || !value.dims.is_empty() {
        return Err(format!(
            "the padding value must be a {} scalar, got {value}",
            x.dtype
        ));
    }
    super::within_limit("interior", "dim", interior)?;
    let edges: Vec<(i64, i64)> = low.iter().copied().zip(high.iter().copied()).collect();
    super::padding_within_limit("low/high", "dim", &edges)?;
    let mut dims = Vec::with_capacity(r);
    for d in 0..r {
        // No overflow: `interior` is within the limit (2^63 − 1) and `n` below 2^64.
        let (n, i) = (x.dims[d] as u128, interior[d] as u128);
        let inner = if n == 0 { 0 } else { n + (n - 1) * i };
        if inner > super::SIZE_LIMIT as u128 {
            return Err(format!(
                "dim {d}: interior {i} spreads the {n} elements of {x} over {n} + ({n} − 1)·{i} \
                 = {inner} positions, over {}; use a smaller interior",
                super::LIMIT_WORDS
            ));
        }
        let what = format!("{x} with its interior padding");
        let size = super::padded(
            &what,
            inner as u64,
            "low, high",
            (low[d], high[d]),
            ("dim", d),
        )?;
        if size < 0 {
            return Err(format!(
                "dim {d} of {x} padded by low {}, high {} and interior {} would have {size} \
                 elements; negative padding can remove at most the elements there are",
                low[d], high[d], interior[d]
            ));
        }
        dims.push(size as usize);
    }
    Ok(with_dims(x.dtype, dims))
}

/// The result type of `reverse`, or what is wrong.
pub(crate) fn reverse_type(x: &LeafType, axes: &[usize]) -> Result<LeafType, String> {
    let mut seen = vec![false; x.dims.len()];
    for &a in axes {
        if a >= x.dims.len() || std::mem::replace(&mut seen[a], true) {
            return Err(format!(
                "axes {axes:?} must be distinct dims of {x} (rank {})",
                x.dims.len()
            ));
        }
    }
    Ok(x.clone())
}

// ---- tracing -------------------------------------------------------------------------------

impl Tensor {
    /// Pads with `value` (a scalar: an `f64` in this tensor's dtype, or a rank-0 tensor):
    /// `low[d]` and `high[d]` elements before and after dim `d` — negative removes elements —
    /// and `interior[d]` between neighbours. `x.pad(0.0, &[1, 1], &[1, 1], &[0, 0])` frames a
    /// matrix with zeros.
    #[track_caller]
    pub fn pad(
        self,
        value: impl Into<Operand>,
        low: &[i64],
        high: &[i64],
        interior: &[usize],
    ) -> Tensor {
        let at = Location::caller();
        with_recording(|r| {
            if !r.owns(self, "pad", at) {
                return r.stand_in(super::f32_scalar());
            }
            let x = r.ty_of(self);
            let value = match value.into() {
                Operand::Tensor(t) => {
                    if !r.owns(t, "pad", at) {
                        return r.stand_in(x);
                    }
                    t
                }
                Operand::Scalar(v) => r.scalar(v, x.dtype, "pad", at),
            };
            let vt = r.ty_of(value);
            match pad_type(&x, &vt, low, high, interior) {
                Ok(ty) => r.push(
                    Op::Pad {
                        low: low.to_vec(),
                        high: high.to_vec(),
                        interior: interior.to_vec(),
                    },
                    vec![self.node, value.node],
                    ty,
                    "pad",
                    at,
                ),
                Err(msg) => r.fail("pad", msg, at, x),
            }
        })
    }

    /// The elements in reverse order along each of `axes`.
    #[track_caller]
    pub fn reverse(self, axes: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| {
            if !r.owns(self, "reverse", at) {
                return r.stand_in(super::f32_scalar());
            }
            let x = r.ty_of(self);
            match reverse_type(&x, axes) {
                Ok(ty) => r.push(
                    Op::Reverse {
                        axes: axes.to_vec(),
                    },
                    vec![self.node],
                    ty,
                    "reverse",
                    at,
                ),
                Err(msg) => r.fail("reverse", msg, at, x),
            }
        })
    }
}

// ---- gradients -----------------------------------------------------------------------------

/// The VJP of `pad` for (operand, value).
pub(crate) fn pad_vjp(
    g: Tensor,
    low: &[i64],
    high: &[i64],
    interior: &[usize],
) -> Vec<Option<Tensor>> {
    let r = low.len();
    let neg_low: Vec<i64> = low.iter().map(|&l| -l).collect();
    let neg_high: Vec<i64> = high.iter().map(|&h| -h).collect();
    let unpadded = if low.iter().chain(high).all(|&p| p == 0) {
        g
    } else {
        g.pad(0.0, &neg_low, &neg_high, &vec![0; r])
    };
    let steps: Vec<usize> = interior.iter().map(|&i| i + 1).collect();
    let dx = if steps.iter().all(|&s| s == 1) {
        unpadded
    } else {
        unpadded.slice_strided(&vec![0; r], &unpadded.dims(), &steps)
    };
    let dv = g.sum_all() - dx.sum_all();
    vec![Some(dx), Some(dv)]
}

// ---- emission ------------------------------------------------------------------------------

/// `stablehlo.pad`.
pub(crate) fn emit_pad(l: Line<'_>, low: &[i64], high: &[i64], interior: &[usize]) -> fmt::Result {
    use fmt::Write as _;
    let interior: Vec<i64> = interior.iter().map(|&i| i as i64).collect();
    writeln!(
        l.out,
        "    {} = stablehlo.pad {}, {}, low = {}, high = {}, interior = {} : ({}, {}) -> {}",
        l.me,
        l.args[0],
        l.args[1],
        crate::emit::line::signed_list(low),
        crate::emit::line::signed_list(high),
        crate::emit::line::signed_list(&interior),
        l.arg_tys[0],
        l.arg_tys[1],
        l.ty
    )
}

/// `stablehlo.reverse`.
pub(crate) fn emit_reverse(l: Line<'_>, axes: &[usize]) -> fmt::Result {
    use fmt::Write as _;
    writeln!(
        l.out,
        "    {} = stablehlo.reverse {}, dims = {} : {}",
        l.me,
        l.args[0],
        crate::emit::line::list(axes),
        l.ty
    )
}

// ---- interpreter ---------------------------------------------------------------------------

fn pad_vec<T: Copy>(
    v: &[T],
    value: T,
    in_dims: &[usize],
    out_dims: &[usize],
    low: &[i64],
    interior: &[usize],
) -> Result<Vec<T>, Fault> {
    let n: usize = out_dims.iter().product();
    let mut out = filled(n, value)?;
    let os = strides(out_dims);
    let mut idx = vec![0; in_dims.len()];
    'each: for (i, &x) in v.iter().enumerate() {
        unflatten(i, in_dims, &mut idx);
        let mut at = 0usize;
        for d in 0..in_dims.len() {
            let p = low[d] + (idx[d] * (interior[d] + 1)) as i64;
            if p < 0 || p >= out_dims[d] as i64 {
                continue 'each;
            }
            at += p as usize * os[d];
        }
        out[at] = x;
    }
    Ok(out)
}

/// `pad` on the host.
pub(crate) fn eval_pad(
    x: &Array,
    value: &Array,
    out: &LeafType,
    low: &[i64],
    interior: &[usize],
) -> Result<ArrayData, Fault> {
    let dims = x.dims();
    macro_rules! go {
        ($v:ident, $variant:ident) => {{
            let ArrayData::$variant(pv) = value.data() else {
                return Err(Fault::Invalid("the padding value has another dtype".into()));
            };
            let pv = *pv
                .first()
                .ok_or_else(|| Fault::Invalid("the padding value is empty".into()))?;
            pad_vec($v, pv, dims, &out.dims, low, interior)
        }};
    }
    Ok(match x.data() {
        ArrayData::F32(v) => ArrayData::F32(go!(v, F32)?),
        ArrayData::F64(v) => ArrayData::F64(go!(v, F64)?),
        ArrayData::I32(v) => ArrayData::I32(go!(v, I32)?),
        ArrayData::I64(v) => ArrayData::I64(go!(v, I64)?),
        ArrayData::U8(v) => ArrayData::U8(go!(v, U8)?),
        ArrayData::Bool(v) => ArrayData::Bool(go!(v, Bool)?),
        ArrayData::U32(v) => ArrayData::U32(go!(v, U32)?),
        ArrayData::BF16(v) => ArrayData::BF16(go!(v, BF16)?),
        ArrayData::F16(v) => ArrayData::F16(go!(v, F16)?),
    })
}

fn reverse_vec<T: Copy>(v: &[T], dims: &[usize], axes: &[usize]) -> Result<Vec<T>, Fault> {
    let s = strides(dims);
    let mut idx = vec![0; dims.len()];
    crate::ops::host::alloc::collect(
        v.len(),
        (0..v.len()).map(|i| {
            unflatten(i, dims, &mut idx);
            let mut at = 0;
            for d in 0..dims.len() {
                let k = if axes.contains(&d) {
                    dims[d] - 1 - idx[d]
                } else {
                    idx[d]
                };
                at += k * s[d];
            }
            v[at]
        }),
    )
}

/// `reverse` on the host.
pub(crate) fn eval_reverse(x: &Array, axes: &[usize]) -> Result<ArrayData, Fault> {
    let dims = x.dims();
    Ok(same_dtype!(x.data(), v => reverse_vec(v, dims, axes)))
}

// ---- the first shape ops: broadcast, reshape, transpose, slice, concatenate, iota ------------
//
// `broadcast_in_dim` maps operand dim `i` to result dim `dims[i]` (size equal, or 1);
// `reshape` keeps the row-major order; `transpose` makes result dim `i` operand dim `perm[i]`;
// `slice` takes `start..limit` step `strides`; `concatenate` joins along `axis`; `iota`
// counts along `axis`. VJPs: a broadcast sums the cotangent over the broadcast dims; reshape
// and transpose undo themselves; a slice pads the cotangent back into zeros (interleaving
// zeros for strides); a concatenation slices the cotangent apart; iota has none.

impl Recording {
    /// Broadcasts `t` to `dims` NumPy-style (trailing dims align); a no-op when already there.
    pub(crate) fn broadcast_to(
        &mut self,
        t: Tensor,
        dims: &[usize],
        op: &'static str,
        at: &Location<'_>,
    ) -> Tensor {
        let ty = self.ty_of(t);
        if ty.dims == dims {
            return t;
        }
        let offset = dims.len() - ty.dims.len();
        let map = (0..ty.dims.len()).map(|i| i + offset).collect();
        self.push(
            Op::BroadcastInDim { dims: map },
            vec![t.node],
            with_dims(ty.dtype, dims.to_vec()),
            op,
            at,
        )
    }
    pub(crate) fn reshape(&mut self, a: Tensor, dims: &[usize], at: &Location<'_>) -> Tensor {
        let ty = self.ty_of(a);
        // The operand is within the size limit, so its count is too; the new dims may not be.
        let have = dims_product(&ty.dims).unwrap_or(usize::MAX);
        let want = dims_product(dims);
        if want != Some(have) {
            let want = want.map_or_else(|| "more than 2^64".to_owned(), |n| n.to_string());
            return self.fail(
                "reshape",
                format!(
                    "cannot reshape {ty} ({have} elements) to {:?} ({want} elements)",
                    dims
                ),
                at,
                with_dims(ty.dtype, dims.to_vec()),
            );
        }
        if ty.dims == dims {
            return a;
        }
        self.push(
            Op::Reshape,
            vec![a.node],
            with_dims(ty.dtype, dims.to_vec()),
            "reshape",
            at,
        )
    }
    pub(crate) fn transpose(&mut self, a: Tensor, perm: &[usize], at: &Location<'_>) -> Tensor {
        let ty = self.ty_of(a);
        let mut sorted = perm.to_vec();
        sorted.sort_unstable();
        if sorted != (0..ty.dims.len()).collect::<Vec<_>>() {
            return self.fail(
                "transpose",
                format!("{perm:?} is not a permutation of the dims of {ty}"),
                at,
                ty,
            );
        }
        let dims = perm.iter().map(|&p| ty.dims[p]).collect();
        self.push(
            Op::Transpose {
                perm: perm.to_vec(),
            },
            vec![a.node],
            with_dims(ty.dtype, dims),
            "transpose",
            at,
        )
    }
    pub(crate) fn slice(
        &mut self,
        a: Tensor,
        start: &[usize],
        limit: &[usize],
        strides: &[usize],
        at: &Location<'_>,
    ) -> Tensor {
        let ty = self.ty_of(a);
        if let Some(msg) = slice_error(&ty, start, limit, strides) {
            return self.fail("slice", msg, at, ty);
        }
        let dims = (0..ty.dims.len())
            .map(|i| (limit[i] - start[i]).div_ceil(strides[i]))
            .collect();
        self.push(
            Op::Slice {
                start: start.to_vec(),
                limit: limit.to_vec(),
                strides: strides.to_vec(),
            },
            vec![a.node],
            with_dims(ty.dtype, dims),
            "slice",
            at,
        )
    }
    pub(crate) fn concatenate(
        &mut self,
        parts: &[Tensor],
        axis: usize,
        at: &Location<'_>,
    ) -> Tensor {
        let Some(&first) = parts.first() else {
            return self.fail(
                "concatenate",
                "nothing to concatenate".into(),
                at,
                scalar_ty(DType::F32),
            );
        };
        let t0 = self.ty_of(first);
        if axis >= t0.dims.len() {
            return self.fail(
                "concatenate",
                format!("axis {axis} is out of range for {t0}"),
                at,
                t0,
            );
        }
        let mut total: usize = 0;
        for &p in parts {
            let t = self.ty_of(p);
            let same_rest = t.dims.len() == t0.dims.len()
                && (0..t0.dims.len()).all(|i| i == axis || t.dims[i] == t0.dims[i]);
            if t.dtype != t0.dtype || !same_rest {
                return self.fail(
                    "concatenate",
                    format!("cannot concatenate {t0} and {t} along axis {axis}: dtypes and all other dims must match"),
                    at,
                    t0,
                );
            }
            let Some(sum) = total.checked_add(t.dims[axis]) else {
                return self.fail(
                    "concatenate",
                    format!(
                        "the joined dim {axis} of {parts} parts overflows",
                        parts = parts.len()
                    ),
                    at,
                    t0,
                );
            };
            total = sum;
        }
        let mut dims = t0.dims.clone();
        dims[axis] = total;
        self.push(
            Op::Concatenate { axis },
            parts.iter().map(|p| p.node).collect(),
            with_dims(t0.dtype, dims),
            "concatenate",
            at,
        )
    }
    pub(crate) fn iota(
        &mut self,
        dtype: DType,
        dims: &[usize],
        axis: usize,
        at: &Location<'_>,
    ) -> Tensor {
        let ty = with_dims(dtype, dims.to_vec());
        if axis >= dims.len() || dtype == DType::Bool {
            return self.fail(
                "iota",
                format!("iota along axis {axis} of {ty} is not defined"),
                at,
                ty,
            );
        }
        self.push(Op::Iota { axis }, Vec::new(), ty, "iota", at)
    }
}

impl Tensor {
    /// Indices along `axis`: element `[i0, i1, …]` is `i_axis`.
    #[track_caller]
    pub fn iota(dtype: DType, dims: &[usize], axis: usize) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.iota(dtype, dims, axis, at))
    }
    /// The same elements with new dims (equal element count).
    #[track_caller]
    pub fn reshape(self, dims: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.reshape(self, dims, at))
    }
    /// Permutes dims: result dim `i` is dim `perm[i]`.
    #[track_caller]
    pub fn transpose(self, perm: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.transpose(self, perm, at))
    }
    /// The transpose of a matrix.
    #[track_caller]
    pub fn t(self) -> Tensor {
        self.transpose(&[1, 0])
    }
    /// Elements `start[i]..limit[i]` of each dim.
    #[track_caller]
    pub fn slice(self, start: &[usize], limit: &[usize]) -> Tensor {
        let at = Location::caller();
        let ones = vec![1; start.len()];
        with_recording(|r| r.slice(self, start, limit, &ones, at))
    }
    /// Elements `start[i]..limit[i]` of each dim, every `strides[i]`-th.
    #[track_caller]
    pub fn slice_strided(self, start: &[usize], limit: &[usize], strides: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.slice(self, start, limit, strides, at))
    }
    /// Joins tensors along `axis`.
    #[track_caller]
    pub fn concatenate(parts: &[Tensor], axis: usize) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.concatenate(parts, axis, at))
    }
    /// Broadcasts to `dims`, NumPy-style.
    #[track_caller]
    pub fn broadcast_to(self, dims: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| {
            let ty = r.ty_of(self);
            match broadcast_dims(&ty.dims, dims) {
                Some(d) if d == dims => r.broadcast_to(self, dims, "broadcast", at),
                _ => r.fail(
                    "broadcast",
                    format!("cannot broadcast {ty} to {dims:?}"),
                    at,
                    with_dims(ty.dtype, dims.to_vec()),
                ),
            }
        })
    }
    /// One-hot encoding: integer labels `[..]` become `[.., classes]` of `dtype`.
    #[track_caller]
    pub fn one_hot(self, classes: usize, dtype: DType) -> Tensor {
        let at = Location::caller();
        let ty = self.ty();
        if ty.dtype.is_float() || ty.dtype == DType::Bool {
            return with_recording(|r| {
                let mut dims = ty.dims.clone();
                dims.push(classes);
                r.fail(
                    "one_hot",
                    format!("labels must be integers, got {ty}"),
                    at,
                    with_dims(dtype, dims),
                )
            });
        }
        let mut dims = ty.dims.clone();
        dims.push(classes);
        let rank = dims.len();
        // Class indices in a type wide enough for any class count (u8 labels would wrap).
        let index = if ty.dtype == DType::I64 {
            DType::I64
        } else {
            DType::I32
        };
        let classes_iota = Tensor::iota(index, &dims, rank - 1);
        let labels = self
            .convert(index)
            .reshape(&[ty.dims.as_slice(), &[1]].concat());
        classes_iota.equal(labels).convert(dtype)
    }
}

/// The first shape ops with their attributes, as their rules below take them: `crate::ops`'s
/// dispatch builds one from each such [`Op`] (naming every `Op` variant), and each rule names
/// every variant here, so an op added to either without its rule does not compile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Core<'a> {
    /// [`Op::Iota`].
    Iota {
        /// The dim that counts.
        axis: usize,
    },
    /// [`Op::BroadcastInDim`].
    BroadcastInDim {
        /// Result dim of each operand dim.
        dims: &'a [usize],
    },
    /// [`Op::Reshape`].
    Reshape,
    /// [`Op::Transpose`].
    Transpose {
        /// The permutation.
        perm: &'a [usize],
    },
    /// [`Op::Slice`].
    Slice {
        /// First index per dim.
        start: &'a [usize],
        /// One past the last index per dim.
        limit: &'a [usize],
        /// Step per dim.
        strides: &'a [usize],
    },
    /// [`Op::Concatenate`].
    Concatenate {
        /// The joined dim.
        axis: usize,
    },
}

/// What is wrong with a slice `start..limit` step `strides` of `ty`, if anything.
fn slice_error(
    ty: &LeafType,
    start: &[usize],
    limit: &[usize],
    strides: &[usize],
) -> Option<String> {
    let r = ty.dims.len();
    let bad = start.len() != r
        || limit.len() != r
        || strides.len() != r
        || (0..r).any(|i| start[i] > limit[i] || limit[i] > ty.dims[i] || strides[i] == 0);
    if bad {
        return Some(format!(
            "invalid slice [{start:?}..{limit:?} step {strides:?}] of {ty}: need start ≤ limit \
             ≤ dim and step ≥ 1 for each of the {r} dims"
        ));
    }
    super::within_limit("strides", "dim", strides).err()
}

/// The result type of one of the first shape ops whose node declares `out`, or what is wrong.
pub(crate) fn core_type(
    op: Core<'_>,
    out: &LeafType,
    ins: &[&LeafType],
) -> Result<LeafType, String> {
    Ok(match op {
        Core::Iota { axis } => {
            arity(0, ins.len())?;
            if axis >= out.dims.len() || out.dtype == DType::Bool {
                return Err(format!("iota along axis {axis} of {out} is not defined"));
            }
            out.clone()
        }
        Core::BroadcastInDim { dims } => {
            arity(1, ins.len())?;
            let t = ins[0];
            let fits = dims.len() == t.dims.len()
                && distinct_in_range(dims, out.dims.len())
                && dims
                    .iter()
                    .zip(&t.dims)
                    .all(|(&d, &s)| s == 1 || s == out.dims[d]);
            if !fits {
                return Err(format!(
                    "{t} cannot be broadcast to {out} along dims {dims:?}"
                ));
            }
            LeafType {
                dtype: t.dtype,
                dims: out.dims.clone(),
            }
        }
        Core::Reshape => {
            arity(1, ins.len())?;
            let t = ins[0];
            if dims_product(&t.dims) != dims_product(&out.dims) {
                return Err(format!("{t} and {out} have different element counts"));
            }
            LeafType {
                dtype: t.dtype,
                dims: out.dims.clone(),
            }
        }
        Core::Transpose { perm } => {
            arity(1, ins.len())?;
            let t = ins[0];
            if perm.len() != t.dims.len() || !distinct_in_range(perm, t.dims.len()) {
                return Err(format!("{perm:?} is not a permutation of the dims of {t}"));
            }
            LeafType {
                dtype: t.dtype,
                dims: perm.iter().map(|&p| t.dims[p]).collect(),
            }
        }
        Core::Slice {
            start,
            limit,
            strides,
        } => {
            arity(1, ins.len())?;
            let t = ins[0];
            if let Some(msg) = slice_error(t, start, limit, strides) {
                return Err(msg);
            }
            let dims = (0..t.dims.len())
                .map(|i| (limit[i] - start[i]).div_ceil(strides[i]))
                .collect();
            LeafType {
                dtype: t.dtype,
                dims,
            }
        }
        Core::Concatenate { axis } => {
            let Some(first) = ins.first() else {
                return Err("it has no operands".into());
            };
            let fits = axis < first.dims.len()
                && ins.iter().all(|t| {
                    t.dtype == first.dtype
                        && t.dims.len() == first.dims.len()
                        && (0..t.dims.len()).all(|i| i == axis || t.dims[i] == first.dims[i])
                });
            if !fits {
                let shown: Vec<String> = ins.iter().map(|t| t.to_string()).collect();
                return Err(format!(
                    "{} cannot be joined along axis {axis}",
                    shown.join(", ")
                ));
            }
            let total = ins
                .iter()
                .try_fold(0usize, |n, t| n.checked_add(t.dims[axis]));
            let Some(total) = total else {
                return Err(format!(
                    "the joined dim {axis} of {} operands overflows",
                    ins.len()
                ));
            };
            let mut dims = first.dims.clone();
            dims[axis] = total;
            LeafType {
                dtype: first.dtype,
                dims,
            }
        }
    })
}

/// The VJP of one of the first shape ops, whose result has type `out`.
pub(crate) fn core_vjp(
    op: Core<'_>,
    out: &LeafType,
    x: &[Tensor],
    g: Tensor,
) -> Vec<Option<Tensor>> {
    match op {
        // Indices: no operands, no gradient.
        Core::Iota { .. } => vec![None; x.len()],
        Core::BroadcastInDim { dims } => {
            let from = x[0].ty().dims;
            let to = &out.dims;
            let mut axes: Vec<usize> = (0..to.len()).filter(|a| !dims.contains(a)).collect();
            axes.extend(
                dims.iter()
                    .enumerate()
                    .filter(|(k, &d)| from[*k] == 1 && to[d] != 1)
                    .map(|(_, &d)| d),
            );
            axes.sort_unstable();
            let summed = if axes.is_empty() { g } else { g.sum(&axes) };
            let kept: Vec<usize> = (0..to.len()).filter(|a| !axes.contains(a)).collect();
            // Our broadcasts map operand dims in increasing order; restore that order if not.
            let order: Vec<usize> = dims
                .iter()
                .filter(|d| kept.contains(d))
                .map(|d| kept.iter().position(|k| k == d).unwrap_or(0))
                .collect();
            let ordered = if order.windows(2).all(|w| w[0] < w[1]) {
                summed
            } else {
                summed.transpose(&order)
            };
            vec![Some(ordered.reshape(&from))]
        }
        Core::Reshape => vec![Some(g.reshape(&x[0].ty().dims))],
        Core::Transpose { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![Some(g.transpose(&inv))]
        }
        Core::Slice {
            start,
            limit,
            strides,
        } => vec![Some(unslice(g, &x[0].ty().dims, start, limit, strides))],
        Core::Concatenate { axis } => {
            let out = &out.dims;
            let mut offset = 0;
            x.iter()
                .map(|&part| {
                    let n = part.ty().dims[axis];
                    let mut start = vec![0; out.len()];
                    let mut limit = out.clone();
                    start[axis] = offset;
                    limit[axis] = offset + n;
                    offset += n;
                    Some(g.slice(&start, &limit))
                })
                .collect()
        }
    }
}

/// The gradient of a slice: `g` scattered back into zeros of the operand's dims.
fn unslice(
    g: Tensor,
    dims: &[usize],
    start: &[usize],
    limit: &[usize],
    strides: &[usize],
) -> Tensor {
    let dtype = g.dtype();
    let mut cur = g;
    for axis in 0..dims.len() {
        let cd = cur.dims();
        let s = strides[axis];
        if s > 1 {
            // Interleave s-1 zeros after each element along `axis`, then trim.
            let n = cd[axis];
            let mut split = cd.clone();
            split.insert(axis + 1, 1);
            let mut zeros = cd.clone();
            zeros.insert(axis + 1, s - 1);
            let spread = Tensor::concatenate(
                &[cur.reshape(&split), Tensor::full(&zeros, 0.0, dtype)],
                axis + 1,
            );
            let mut merged = cd.clone();
            merged[axis] = n * s;
            cur = spread.reshape(&merged);
            let mut lim = merged.clone();
            lim[axis] = limit[axis] - start[axis];
            cur = cur.slice(&vec![0; merged.len()], &lim);
        }
        let cd = cur.dims();
        let mut parts = Vec::new();
        if start[axis] > 0 {
            let mut z = cd.clone();
            z[axis] = start[axis];
            parts.push(Tensor::full(&z, 0.0, dtype));
        }
        parts.push(cur);
        if dims[axis] > limit[axis] {
            let mut z = cd.clone();
            z[axis] = dims[axis] - limit[axis];
            parts.push(Tensor::full(&z, 0.0, dtype));
        }
        if parts.len() > 1 {
            cur = Tensor::concatenate(&parts, axis);
        }
    }
    cur
}

/// The StableHLO of one of the first shape ops.
pub(crate) fn core_emit(op: Core<'_>, l: Line<'_>) -> fmt::Result {
    use fmt::Write as _;
    let (me, ty) = (&l.me, &l.ty);
    match op {
        Core::Iota { axis } => writeln!(l.out, "    {me} = stablehlo.iota dim = {axis} : {ty}"),
        Core::BroadcastInDim { dims } => writeln!(
            l.out,
            "    {me} = stablehlo.broadcast_in_dim {}, dims = {} : ({}) -> {ty}",
            l.args[0],
            crate::emit::line::list(dims),
            l.arg_tys[0]
        ),
        Core::Reshape => writeln!(
            l.out,
            "    {me} = stablehlo.reshape {} : ({}) -> {ty}",
            l.args[0], l.arg_tys[0]
        ),
        Core::Transpose { perm } => writeln!(
            l.out,
            "    {me} = stablehlo.transpose {}, dims = {} : ({}) -> {ty}",
            l.args[0],
            crate::emit::line::list(perm),
            l.arg_tys[0]
        ),
        Core::Slice {
            start,
            limit,
            strides,
        } => {
            write!(l.out, "    {me} = stablehlo.slice {} [", l.args[0])?;
            for (i, (s, e)) in start.iter().zip(limit).enumerate() {
                if i > 0 {
                    l.out.push_str(", ");
                }
                write!(l.out, "{s}:{e}")?;
                match strides.get(i) {
                    Some(1) | None => {}
                    Some(step) => write!(l.out, ":{step}")?,
                }
            }
            writeln!(l.out, "] : ({}) -> {ty}", l.arg_tys[0])
        }
        Core::Concatenate { axis } => {
            write!(l.out, "    {me} = stablehlo.concatenate ")?;
            for a in &l.args {
                write!(l.out, "{a}, ")?;
            }
            writeln!(l.out, "dim = {axis} : ({}) -> {ty}", l.arg_tys.join(", "))
        }
    }
}

/// One of the first shape ops, with result type `out`, on the host.
pub(crate) fn core_eval(
    op: Core<'_>,
    out: &LeafType,
    operands: &[&Array],
) -> Result<ArrayData, Fault> {
    let out_dims = out.dims.as_slice();
    let a = operands.first().copied();
    let one = || a.ok_or_else(|| Fault::Invalid("it has no operand".into()));
    match op {
        Core::Iota { axis } => iota(out.dtype, out_dims, axis),
        Core::BroadcastInDim { dims } => {
            let a = one()?;
            broadcast(a.data(), a.dims(), out_dims, dims)
        }
        Core::Reshape => crate::ops::host::copy_data(one()?.data()),
        Core::Transpose { perm } => {
            let a = one()?;
            crate::ops::host::layout::transpose(a.data(), a.dims(), perm)
        }
        Core::Slice { start, strides, .. } => {
            let a = one()?;
            slice(a.data(), a.dims(), start, strides, out_dims)
        }
        Core::Concatenate { axis } => concatenate(operands, axis, out.dtype),
    }
}

/// Broadcasts storage of shape `in_dims` to `out_dims`: operand dim `i` becomes result dim
/// `map[i]` (its size equal, or 1).
pub(crate) fn broadcast(
    data: &ArrayData,
    in_dims: &[usize],
    out_dims: &[usize],
    map: &[usize],
) -> Result<ArrayData, Fault> {
    let s = strides(in_dims);
    let mut out_strides = vec![0; out_dims.len()];
    for (i, &d) in map.iter().enumerate() {
        if in_dims[i] != 1 {
            out_strides[d] = s[i];
        }
    }
    Ok(map_data!(data, v => gather(v, out_dims, &out_strides, 0)))
}
/// The strided window `start..limit` step `steps` of storage of shape `dims`; `out_dims` is the
/// window's shape.
pub(crate) fn slice(
    data: &ArrayData,
    dims: &[usize],
    start: &[usize],
    steps: &[usize],
    out_dims: &[usize],
) -> Result<ArrayData, Fault> {
    let s = strides(dims);
    let base = start.iter().zip(&s).map(|(a, b)| a * b).sum();
    let out_strides: Vec<usize> = s.iter().zip(steps).map(|(a, b)| a * b).collect();
    Ok(map_data!(data, v => gather(v, out_dims, &out_strides, base)))
}
fn concat_vec<T: Element>(parts: &[&Array], axis: usize) -> Result<Vec<T>, Fault> {
    let differ = || Fault::from("its operands have different dtypes".to_owned());
    let first = parts.first().ok_or_else(differ)?;
    // Sub-products of checked types (see `strides`) and a sum bounded by the checked result.
    let outer = dims_product(&first.dims()[..axis]).unwrap_or(0);
    let inner = dims_product(&first.dims()[axis + 1..]).unwrap_or(0);
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let slices = parts
        .iter()
        .map(|p| Some((T::unwrap(p.data())?, p.dims()[axis] * inner)))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(differ)?;
    let mut out = with_capacity(total)?;
    for o in 0..outer {
        for &(v, chunk) in &slices {
            out.extend_from_slice(&v[o * chunk..(o + 1) * chunk]);
        }
    }
    Ok(out)
}
/// Joins arrays of one dtype along `axis` (all other dims equal); an invalid-graph fault when
/// dtypes differ.
pub(crate) fn concatenate(parts: &[&Array], axis: usize, dtype: DType) -> Result<ArrayData, Fault> {
    Ok(match dtype {
        DType::F32 => ArrayData::F32(concat_vec(parts, axis)?),
        DType::F64 => ArrayData::F64(concat_vec(parts, axis)?),
        DType::I32 => ArrayData::I32(concat_vec(parts, axis)?),
        DType::I64 => ArrayData::I64(concat_vec(parts, axis)?),
        DType::U8 => ArrayData::U8(concat_vec(parts, axis)?),
        DType::Bool => ArrayData::Bool(concat_vec(parts, axis)?),
        DType::U32 => ArrayData::U32(concat_vec(parts, axis)?),
        DType::BF16 => ArrayData::BF16(concat_vec(parts, axis)?),
        DType::F16 => ArrayData::F16(concat_vec(parts, axis)?),
    })
}
/// Iota: element `[i0, i1, …]` is `i_axis`, converted to `dtype` as by `as` (integers wrap).
/// An invalid-graph fault for `bool`, which has no iota.
pub(crate) fn iota(dtype: DType, dims: &[usize], axis: usize) -> Result<ArrayData, Fault> {
    let n = dims_product(dims).ok_or_else(|| Fault::from(format!("{dims:?} overflow")))?;
    let stride = dims_product(&dims[axis + 1..]).unwrap_or(1).max(1);
    let size = dims[axis].max(1);
    let index = (0..n).map(move |i| (i / stride) % size);
    Ok(match dtype {
        DType::F32 => ArrayData::F32(collect(n, index.map(|i| i as f32))?),
        DType::F64 => ArrayData::F64(collect(n, index.map(|i| i as f64))?),
        DType::I32 => ArrayData::I32(collect(n, index.map(|i| i as i32))?),
        DType::I64 => ArrayData::I64(collect(n, index.map(|i| i as i64))?),
        DType::U8 => ArrayData::U8(collect(n, index.map(|i| i as u8))?),
        DType::U32 => ArrayData::U32(collect(n, index.map(|i| i as u32))?),
        DType::BF16 => ArrayData::BF16(collect(n, index.map(|i| half::bf16::from_f32(i as f32)))?),
        DType::F16 => ArrayData::F16(collect(n, index.map(|i| half::f16::from_f32(i as f32)))?),
        DType::Bool => return Err(Fault::from("iota is not defined for bool".to_owned())),
    })
}

// ---- one axis at a time: narrow, split, chunk ------------------------------------------------

impl Tensor {
    /// Elements `start..start + len` along `axis`, every other dim whole (`x.narrow(1, 0, 64)`).
    #[track_caller]
    pub fn narrow(self, axis: usize, start: usize, len: usize) -> Tensor {
        let at = Location::caller();
        with_recording(|r| {
            let ty = r.ty_of(self);
            let fits = axis < ty.dims.len()
                && start
                    .checked_add(len)
                    .is_some_and(|end| end <= ty.dims[axis]);
            if !fits {
                let mut dims = ty.dims.clone();
                if let Some(d) = dims.get_mut(axis) {
                    *d = len;
                }
                return r.fail(
                    "narrow",
                    format!(
                        "elements {start}..{} along axis {axis} do not fit {ty}",
                        start.saturating_add(len)
                    ),
                    at,
                    with_dims(ty.dtype, dims),
                );
            }
            let begin: Vec<usize> = (0..ty.dims.len())
                .map(|d| if d == axis { start } else { 0 })
                .collect();
            let mut limit = ty.dims.clone();
            limit[axis] = start + len;
            let ones = vec![1; ty.dims.len()];
            r.slice(self, &begin, &limit, &ones, at)
        })
    }

    /// Consecutive pieces along `axis` of the given `sizes`, which must add up to that dim
    /// (`qkv.split(2, &[d, d, d])`).
    #[track_caller]
    pub fn split(self, axis: usize, sizes: &[usize]) -> Vec<Tensor> {
        let at = Location::caller();
        let ty = self.ty();
        let total = sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
        if axis >= ty.dims.len() || total != Some(ty.dims[axis]) {
            let msg = format!(
                "pieces of sizes {sizes:?} along axis {axis} do not add up to that dim of {ty}"
            );
            return sizes
                .iter()
                .map(|&s| {
                    let mut dims = ty.dims.clone();
                    if let Some(d) = dims.get_mut(axis) {
                        *d = s;
                    }
                    with_recording(|r| r.fail("split", msg.clone(), at, with_dims(ty.dtype, dims)))
                })
                .collect();
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&s| {
                let piece = with_recording(|r| {
                    let begin: Vec<usize> = (0..ty.dims.len())
                        .map(|d| if d == axis { start } else { 0 })
                        .collect();
                    let mut limit = ty.dims.clone();
                    limit[axis] = start + s;
                    let ones = vec![1; ty.dims.len()];
                    r.slice(self, &begin, &limit, &ones, at)
                });
                start += s;
                piece
            })
            .collect()
    }

    /// `n` pieces along `axis`: all of `ceil(dim / n)` elements but the last, which holds the
    /// rest (as PyTorch's `chunk`; fewer pieces when the dim is small). `n` must be at least 1.
    #[track_caller]
    pub fn chunk(self, axis: usize, n: usize) -> Vec<Tensor> {
        let at = Location::caller();
        let ty = self.ty();
        let Some(&dim) = ty.dims.get(axis).filter(|_| n > 0) else {
            return vec![with_recording(|r| {
                r.fail(
                    "chunk",
                    format!("cannot cut axis {axis} of {ty} into {n} pieces"),
                    at,
                    ty.clone(),
                )
            })];
        };
        let size = dim.div_ceil(n).max(1);
        let mut sizes = Vec::new();
        let mut left = dim;
        while left > 0 {
            sizes.push(size.min(left));
            left -= size.min(left);
        }
        if sizes.is_empty() {
            sizes.push(0);
        }
        self.split(axis, &sizes)
    }
}
