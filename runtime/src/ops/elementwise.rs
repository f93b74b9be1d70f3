//! Element-wise additions for real models: `sin cos` (rotary embeddings), `erf` (exact GELU),
//! `erf_inv` (normal samples), `log1p expm1 sign floor ceil round_nearest_even`, `atan2`, `x % y`,
//! integer `and or xor !x shift_left shift_right_logical shift_right_arithmetic popcnt`, and the
//! two ops of their own, `clamp` and `bitcast_convert`.
//!
//! The unary and binary functions are variants of [`UnaryOp`]/[`BinaryOp`], so they share the
//! element-wise machinery (broadcasting, dtype checks, one emission line, the interpreter's
//! typed kernels in `backend/interp/kernels.rs`); their VJP rules are in `trace/autodiff.rs`
//! beside the other element-wise rules. This file holds their `Tensor` methods and everything
//! of `clamp` and `bitcast_convert`.
//!
//! Semantics, on both backends: shifts by at least the bit width give 0 (arithmetic right: all
//! sign bits); `rem` has the sign of the dividend (C's `fmod`); `sign` keeps NaN and −0;
//! `round_nearest_even` rounds halves to even. VJPs: `sin → cos`, `cos → −sin`,
//! `erf → 2/√π·e^(−x²)`, `erf_inv → √π/2·e^(y²)`, `log1p → 1/(1+x)`, `expm1 → y+1`,
//! `atan2(a, b) → (b, −a)/(a²+b²)`, `rem(a, b) → (1, −trunc(a/b))`; `sign floor ceil round`
//! have zero gradient; `clamp` passes the gradient to `x` strictly inside the bounds and to a
//! bound where it is strictly exceeded (as JAX).

use std::fmt::{self, Write as _};
use std::panic::Location;

use crate::backend::interp::alloc::collect;
use crate::backend::interp::Fault;
use crate::emit::Line;
use crate::trace::ir::{BinaryOp, Op, UnaryOp};
use crate::trace::{with_recording, Operand, Tensor};
use crate::tree::{Array, ArrayData, DType, LeafType};

macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(self) -> Tensor {
                    let at = Location::caller();
                    with_recording(|r| r.unary(UnaryOp::$op, self, at))
                }
            )*
        }
    };
}

unary_methods! {
    /// Sine.
    sin => Sin;
    /// Cosine.
    cos => Cos;
    /// The error function (exact GELU is `x · (1 + erf(x / √2)) / 2`).
    erf => Erf;
    /// The inverse error function, on (−1, 1) (±∞ at ±1, NaN outside).
    erf_inv => ErfInv;
    /// `ln(1 + x)`, accurate for small `x`.
    log1p => Log1p;
    /// `e^x − 1`, accurate for small `x`.
    expm1 => Expm1;
    /// −1, 0 or +1 by sign (integers too; NaN stays NaN, −0 stays −0).
    sign => Sign;
    /// Rounds toward −∞.
    floor => Floor;
    /// Rounds toward +∞.
    ceil => Ceil;
    /// Rounds to the nearest integer, halves to even (`2.5 → 2`, `3.5 → 4`).
    round_nearest_even => RoundNearestEven;
    /// The number of set bits of each integer.
    popcnt => Popcnt;
}

macro_rules! binary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident;)*) => {
        impl Tensor {
            $(
                $(#[$doc])*
                #[track_caller]
                pub fn $name(self, rhs: impl Into<Operand>) -> Tensor {
                    let at = Location::caller();
                    with_recording(|r| r.binary(BinaryOp::$op, self.into(), rhs.into(), at))
                }
            )*
        }
    };
}

binary_methods! {
    /// `atan2(self, rhs)`: the angle of the point `(rhs, self)`, in `[−π, π]`.
    atan2 => Atan2;
    /// Bitwise and (logical and for bool), broadcasting.
    and => And;
    /// Bitwise or (logical or for bool), broadcasting.
    or => Or;
    /// Bitwise exclusive or (logical for bool), broadcasting.
    xor => Xor;
    /// `self << rhs`; 0 where `rhs` is at least the bit width.
    shift_left => ShiftLeft;
    /// `self >> rhs`, filling with zeros; 0 where `rhs` is at least the bit width.
    shift_right_logical => ShiftRightLogical;
    /// `self >> rhs`, filling with the sign bit.
    shift_right_arithmetic => ShiftRightArithmetic;
}

/// `!x`: bitwise not of an integer tensor (logical not of a bool tensor).
impl std::ops::Not for Tensor {
    type Output = Tensor;
    #[track_caller]
    fn not(self) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.unary(UnaryOp::Not, self, at))
    }
}

/// `x % y`: the remainder of truncating division, with the sign of `x` (C's `fmod` for
/// floats), broadcasting; an `f64` takes the tensor's dtype.
impl<R: Into<Operand>> std::ops::Rem<R> for Tensor {
    type Output = Tensor;
    #[track_caller]
    fn rem(self, rhs: R) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.binary(BinaryOp::Rem, self.into(), rhs.into(), at))
    }
}

/// `v % x` for an `f64` `v` in the tensor's dtype.
impl std::ops::Rem<Tensor> for f64 {
    type Output = Tensor;
    #[track_caller]
    fn rem(self, rhs: Tensor) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.binary(BinaryOp::Rem, Operand::Scalar(self), rhs.into(), at))
    }
}

/// The result type of `bitcast_convert` to `to`, or what is wrong.
pub(crate) fn bitcast_type(x: &LeafType, to: DType) -> Result<LeafType, String> {
    if x.dtype.size_bytes() != to.size_bytes() || x.dtype == DType::Bool || to == DType::Bool {
        return Err(format!(
            "cannot reinterpret {x} as {to}: bitcasts need non-bool dtypes of one width"
        ));
    }
    Ok(LeafType {
        dtype: to,
        dims: x.dims.clone(),
    })
}

impl Tensor {
    /// `min(max(x, lo), hi)` element-wise: `lo` and `hi` broadcast with this tensor (scalars
    /// take its dtype). Gradients: to `x` where `lo < x < hi`, to `lo` where `x < lo`, to `hi`
    /// where `x > hi`.
    #[track_caller]
    pub fn clamp(lo: impl Into<Operand>, x: Tensor, hi: impl Into<Operand>) -> Tensor {
        let at = Location::caller();
        with_recording(|r| {
            let Some(ts) = r.unify(&[lo.into(), x.into(), hi.into()], "clamp", at) else {
                return r.stand_in(super::f32_scalar());
            };
            let ty = r.ty_of(ts[1]);
            if ty.dtype == DType::Bool {
                return r.fail(
                    "clamp",
                    format!("cannot clamp a bool tensor ({ty})"),
                    at,
                    ty,
                );
            }
            r.push(
                Op::Clamp,
                ts.iter().map(|t| t.node).collect(),
                ty,
                "clamp",
                at,
            )
        })
    }

    /// The same bits as another dtype of the same width (`f32 ↔ u32 ↔ i32`, `f64 ↔ i64`).
    #[track_caller]
    pub fn bitcast_convert(self, to: DType) -> Tensor {
        let at = Location::caller();
        with_recording(|r| {
            if !r.owns(self, "bitcast_convert", at) {
                return r.stand_in(super::f32_scalar());
            }
            let x = r.ty_of(self);
            match bitcast_type(&x, to) {
                Ok(ty) => r.push(
                    Op::BitcastConvert,
                    vec![self.node],
                    ty,
                    "bitcast_convert",
                    at,
                ),
                Err(msg) => r.fail(
                    "bitcast_convert",
                    msg,
                    at,
                    LeafType {
                        dtype: to,
                        dims: x.dims,
                    },
                ),
            }
        })
    }
}

/// The VJP of `clamp(lo, x, hi)`.
pub(crate) fn clamp_vjp(lo: Tensor, x: Tensor, hi: Tensor, g: Tensor) -> Vec<Option<Tensor>> {
    let inside = Tensor::select(x.greater(lo), Tensor::select(x.less(hi), g, 0.0), 0.0);
    vec![
        Some(Tensor::select(lo.greater(x), g, 0.0)),
        Some(inside),
        Some(Tensor::select(hi.less(x), g, 0.0)),
    ]
}

/// `stablehlo.clamp`.
pub(crate) fn emit_clamp(l: Line<'_>) -> fmt::Result {
    writeln!(
        l.out,
        "    {} = stablehlo.clamp {}, {}, {} : {}",
        l.me, l.args[0], l.args[1], l.args[2], l.ty
    )
}

/// `stablehlo.bitcast_convert`.
pub(crate) fn emit_bitcast(l: Line<'_>) -> fmt::Result {
    writeln!(
        l.out,
        "    {} = stablehlo.bitcast_convert {} : ({}) -> {}",
        l.me, l.args[0], l.arg_tys[0], l.ty
    )
}

/// `clamp` on the host: `min(max(x, lo), hi)` with the element-wise max/min (NaN propagates).
pub(crate) fn eval_clamp(lo: &Array, x: &Array, hi: &Array) -> Result<ArrayData, Fault> {
    use crate::backend::interp::kernels::binary;
    let m = binary(BinaryOp::Max, x.data(), lo.data())?;
    binary(BinaryOp::Min, &m, hi.data())
}

/// `bitcast_convert` on the host (little-endian bytes, as on every supported machine).
pub(crate) fn eval_bitcast(x: &Array, to: DType) -> Result<ArrayData, Fault> {
    let bytes: Vec<u8> = match x.data() {
        ArrayData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ArrayData::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ArrayData::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ArrayData::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ArrayData::U32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ArrayData::U8(v) => v.clone(),
        ArrayData::BF16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        ArrayData::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        ArrayData::Bool(_) => return Err(Fault::Invalid("cannot bitcast bool".into())),
    };
    fn chunks<const N: usize, T>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Result<Vec<T>, Fault> {
        collect(
            b.len() / N,
            b.chunks_exact(N).map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            }),
        )
    }
    Ok(match to {
        DType::F32 => ArrayData::F32(chunks(&bytes, f32::from_le_bytes)?),
        DType::F64 => ArrayData::F64(chunks(&bytes, f64::from_le_bytes)?),
        DType::I32 => ArrayData::I32(chunks(&bytes, i32::from_le_bytes)?),
        DType::I64 => ArrayData::I64(chunks(&bytes, i64::from_le_bytes)?),
        DType::U32 => ArrayData::U32(chunks(&bytes, u32::from_le_bytes)?),
        DType::U8 => ArrayData::U8(bytes),
        DType::BF16 => ArrayData::BF16(chunks(&bytes, |b| {
            half::bf16::from_bits(u16::from_le_bytes(b))
        })?),
        DType::F16 => ArrayData::F16(chunks(&bytes, |b| {
            half::f16::from_bits(u16::from_le_bytes(b))
        })?),
        DType::Bool => return Err(Fault::Invalid("cannot bitcast to bool".into())),
    })
}

/// Whether `op` is defined for `dtype` (the tracer's and the interpreter's rule), or why not.
pub(crate) fn unary_defined(op: UnaryOp, ty: &LeafType) -> Result<(), String> {
    let (name, dtype) = (op.name(), ty.dtype);
    if op.float_only() && !dtype.is_float() {
        return Err(format!(
            "`{name}` needs a float tensor, got {ty}; convert it first"
        ));
    }
    if op.bits_only() && dtype.is_float() {
        return Err(format!("`{name}` needs an integer tensor, got {ty}"));
    }
    let unsigned = matches!(dtype, DType::U8 | DType::U32);
    if (dtype == DType::Bool && op != UnaryOp::Not)
        || (unsigned && op == UnaryOp::Neg)
        || (dtype == DType::Bool && op == UnaryOp::Popcnt)
    {
        return Err(format!("`{name}` is not defined for {ty}"));
    }
    Ok(())
}

/// Whether `op` is defined for operands of `dtype`, or why not.
pub(crate) fn binary_defined(op: BinaryOp, ty: &LeafType) -> Result<(), String> {
    let (name, dtype) = (op.name(), ty.dtype);
    if op.float_only() && !dtype.is_float() {
        return Err(format!(
            "`{name}` needs float tensors, got {ty}; convert them first"
        ));
    }
    if op.bits_only() && dtype.is_float() {
        return Err(format!("`{name}` needs integer tensors, got {ty}"));
    }
    let logical = matches!(
        op,
        BinaryOp::Max | BinaryOp::Min | BinaryOp::And | BinaryOp::Or | BinaryOp::Xor
    );
    if dtype == DType::Bool && !logical {
        return Err(format!("`{name}` is not defined for bool tensors ({ty})"));
    }
    Ok(())
}
