//! Shape ops that move elements without arithmetic: `pad` and `reverse`.
//!
//! - `pad(x, value, low, high, interior)`: `low[d]`/`high[d]` elements of `value` before and
//!   after dim `d` (negative removes elements), `interior[d]` between neighbours. Dim `d` of the
//!   result is `low + high + n + (n − 1)·interior` (for `n > 0`; `low + high` for `n = 0`).
//!   VJP: the operand gets the cotangent padded by `−low, −high` and sliced with step
//!   `interior + 1`; the padding value gets the sum of the cotangent minus the operand's share.
//! - `reverse(x, axes)`: VJP is `reverse(g, axes)`.

use std::fmt;
use std::panic::Location;

use crate::backend::interp::alloc::filled;
use crate::backend::interp::layout::strides;
use crate::backend::interp::Fault;
use crate::emit::Line;
use crate::trace::ir::{with_dims, Op};
use crate::trace::{with_recording, Operand, Tensor};
use crate::tree::{Array, ArrayData, LeafType};

use super::{same_dtype, unflatten};

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
    let mut dims = Vec::with_capacity(r);
    for d in 0..r {
        let n = x.dims[d] as i128;
        let inner = if n == 0 {
            0
        } else {
            n + (n - 1) * interior[d] as i128
        };
        let size = inner + low[d] as i128 + high[d] as i128;
        if size < 0 || size > i64::MAX as i128 {
            return Err(format!(
                "dim {d} of {x} padded by low {}, high {} and interior {} would have {size} elements",
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
        crate::emit::signed_list(low),
        crate::emit::signed_list(high),
        crate::emit::signed_list(&interior),
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
        crate::emit::list(axes),
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
    crate::backend::interp::alloc::collect(
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
