//! Element-wise ops: the unary and binary functions ([`UnaryOp`], [`BinaryOp`]), comparisons,
//! `select`, `convert`, `clamp`, `bitcast_convert`, `stop_gradient` and constants.
//!
//! - `tracing.rs`: operands (a tensor or an `f64` scalar in the other operand's dtype), NumPy
//!   broadcasting made explicit (`broadcast_in_dim`), dtype checks, and the `Tensor` methods and
//!   operators (`+ - * / % !`) of the first ops;
//! - this file: the methods of the functions added for real models (`sin cos` for rotary
//!   embeddings, `erf` for exact GELU, `erf_inv` for normal samples, `log1p expm1 sign floor
//!   ceil round_nearest_even atan2`, integer `and or xor shift_* popcnt`), the dtype rules, the
//!   VJPs, the emission (float `maximum`/`minimum` spell NaN propagation out; `erf`, `erf_inv`
//!   are `chlo` ops XLA expands), and the dispatch to the kernels;
//! - `kernels.rs`: the interpreter's typed kernels (floats, wrapping integers, bools;
//!   `erf` from libm, `erf_inv` as XLA's f32 approximation).
//!
//! Semantics, on both backends: shifts by at least the bit width give 0 (arithmetic right: all
//! sign bits); `rem` has the sign of the dividend (C's `fmod`); `sign` keeps NaN and −0;
//! `round_nearest_even` rounds halves to even. VJPs: `sin → cos`, `cos → −sin`,
//! `erf → 2/√π·e^(−x²)`, `erf_inv → √π/2·e^(y²)`, `log1p → 1/(1+x)`, `expm1 → y+1`,
//! `atan2(a, b) → (b, −a)/(a²+b²)`, `rem(a, b) → (1, −trunc(a/b))`; `sign floor ceil round`
//! have zero gradient; `clamp` passes the gradient to `x` strictly inside the bounds and to a
//! bound where it is strictly exceeded (as JAX).

pub(crate) mod kernels;
pub(crate) mod tracing;

use std::fmt::{self, Write as _};
use std::panic::Location;

use super::arity;
use crate::emit::line::Line;
use crate::ops::elementwise::tracing::Operand;
use crate::ops::host::alloc::collect;
use crate::ops::host::Fault;
use crate::trace::ir::{BinaryOp, CmpOp, Op, UnaryOp};
use crate::trace::record::{with_recording, Tensor};
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
    use crate::ops::elementwise::kernels::binary;
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

// ---- the first element-wise ops: result types, VJPs, emission, evaluation ----------------------

fn same(a: &LeafType, b: &LeafType) -> Result<(), String> {
    if a == b {
        Ok(())
    } else {
        Err(format!(
            "its operands must have one type, but are {a} and {b}"
        ))
    }
}

/// The first element-wise ops, as their rules below take them: `crate::ops`'s dispatch builds
/// one from each such [`Op`] (naming every `Op` variant), and each rule names every variant
/// here, so an op added to either without its rule does not compile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Core {
    /// [`Op::Unary`].
    Unary(UnaryOp),
    /// [`Op::Binary`].
    Binary(BinaryOp),
    /// [`Op::Compare`].
    Compare(CmpOp),
    /// [`Op::Select`].
    Select,
    /// [`Op::Convert`].
    Convert,
    /// [`Op::StopGradient`].
    StopGradient,
}

/// The result type of an element-wise op (unary, binary, compare, select, convert,
/// stop_gradient) whose node declares `out`, or what is wrong.
pub(crate) fn core_type(op: Core, out: &LeafType, ins: &[&LeafType]) -> Result<LeafType, String> {
    Ok(match op {
        Core::Unary(u) => {
            arity(1, ins.len())?;
            let t = ins[0];
            unary_defined(u, t)?;
            t.clone()
        }
        Core::Binary(b) => {
            arity(2, ins.len())?;
            same(ins[0], ins[1])?;
            binary_defined(b, ins[0])?;
            ins[0].clone()
        }
        Core::Compare(_) => {
            arity(2, ins.len())?;
            same(ins[0], ins[1])?;
            LeafType {
                dtype: DType::Bool,
                dims: ins[0].dims.clone(),
            }
        }
        Core::Select => {
            arity(3, ins.len())?;
            same(ins[1], ins[2])?;
            let p = ins[0];
            if p.dtype != DType::Bool || !(p.dims.is_empty() || p.dims == ins[1].dims) {
                return Err(format!(
                    "the predicate {p} must be bool, of the values' dims or a scalar"
                ));
            }
            ins[1].clone()
        }
        Core::StopGradient => {
            arity(1, ins.len())?;
            ins[0].clone()
        }
        Core::Convert => {
            arity(1, ins.len())?;
            LeafType {
                dtype: out.dtype,
                dims: ins[0].dims.clone(),
            }
        }
    })
}

/// The VJP of an element-wise op whose value is `y`.
pub(crate) fn core_vjp(op: Core, y: Tensor, x: &[Tensor], g: Tensor) -> Vec<Option<Tensor>> {
    match op {
        Core::Unary(u) => {
            let a = x[0];
            let d = match u {
                UnaryOp::Neg => -g,
                UnaryOp::Exp => g * y,
                UnaryOp::Log => g / a,
                UnaryOp::Tanh => g * (1.0 - y * y),
                UnaryOp::Logistic => g * y * (1.0 - y),
                UnaryOp::Sqrt => g * 0.5 / y,
                UnaryOp::Rsqrt => g * -0.5 * y / a,
                UnaryOp::Abs => {
                    Tensor::select(a.greater(0.0), g, Tensor::select(a.less(0.0), -g, 0.0))
                }
                UnaryOp::Sin => g * a.cos(),
                UnaryOp::Cos => -(g * a.sin()),
                UnaryOp::Erf => g * std::f64::consts::FRAC_2_SQRT_PI * (-(a * a)).exp(),
                UnaryOp::ErfInv => g * (std::f64::consts::PI.sqrt() / 2.0) * (y * y).exp(),
                UnaryOp::Log1p => g / (a + 1.0),
                UnaryOp::Expm1 => g * (y + 1.0),
                // Piecewise constant (and integer-only ops never reach here).
                UnaryOp::Sign
                | UnaryOp::Floor
                | UnaryOp::Ceil
                | UnaryOp::RoundNearestEven
                | UnaryOp::Not
                | UnaryOp::Popcnt => return vec![None],
            };
            vec![Some(d)]
        }
        Core::Binary(b) => {
            let (a, c) = (x[0], x[1]);
            let (da, dc) = match b {
                BinaryOp::Add => (g, g),
                BinaryOp::Sub => (g, -g),
                BinaryOp::Mul => (g * c, g * a),
                BinaryOp::Div => (g / c, -(g * y) / c),
                BinaryOp::Pow => {
                    let da = g * c * a.pow(c - 1.0);
                    let log_a = Tensor::select(a.greater(0.0), a, 1.0).log();
                    let dc = Tensor::select(a.greater(0.0), g * y * log_a, 0.0);
                    (da, dc)
                }
                BinaryOp::Max | BinaryOp::Min => {
                    let (wins, loses) = if b == BinaryOp::Max {
                        (a.greater(c), c.greater(a))
                    } else {
                        (a.less(c), c.less(a))
                    };
                    let tie = a.equal(c);
                    let half = g * 0.5;
                    let da = Tensor::select(wins, g, Tensor::select(tie, half, 0.0));
                    let dc = Tensor::select(loses, g, Tensor::select(tie, half, 0.0));
                    (da, dc)
                }
                BinaryOp::Atan2 => {
                    let r2 = a * a + c * c;
                    (g * c / r2, -(g * a) / r2)
                }
                BinaryOp::Rem => {
                    let q = a / c;
                    (g, -(g * q.sign() * q.abs().floor()))
                }
                // Integer-only ops: never differentiated.
                BinaryOp::And
                | BinaryOp::Or
                | BinaryOp::Xor
                | BinaryOp::ShiftLeft
                | BinaryOp::ShiftRightLogical
                | BinaryOp::ShiftRightArithmetic => return vec![None, None],
            };
            vec![Some(da), Some(dc)]
        }
        Core::Select => {
            let p = x[0];
            vec![
                None,
                Some(Tensor::select(p, g, 0.0)),
                Some(Tensor::select(p, 0.0, g)),
            ]
        }
        Core::Convert => vec![Some(g.convert(x[0].ty().dtype))],
        // A comparison's result is piecewise constant (and bool).
        Core::Compare(_) => vec![None; x.len()],
        // The identity through which no gradient flows.
        Core::StopGradient => vec![None; x.len()],
    }
}

/// The StableHLO of an element-wise op whose node has type `out`.
pub(crate) fn core_emit(op: Core, out: &LeafType, l: Line<'_>) -> fmt::Result {
    let (me, ty) = (&l.me, &l.ty);
    let an = &l.args[0];
    let at = &l.arg_tys[0];
    match op {
        Core::Unary(u) if u.dialect() == "chlo" => {
            writeln!(l.out, "    {me} = chlo.{} {an} : {ty} -> {ty}", u.name())
        }
        Core::Unary(u) => writeln!(l.out, "    {me} = stablehlo.{} {an} : {ty}", u.name()),
        Core::Binary(b) => {
            let bn = &l.args[1];
            let float_extremum = matches!(b, BinaryOp::Max | BinaryOp::Min) && out.dtype.is_float();
            if !float_extremum {
                return writeln!(l.out, "    {me} = stablehlo.{} {an}, {bn} : {ty}", b.name());
            }
            // XLA's CPU backend does not propagate a NaN in every operand position of
            // `maximum`/`minimum` (it can return the other operand), so NaN propagation is
            // spelled out: `a` if it is NaN, else `b` if it is NaN, else the op.
            let n = &l.n;
            let pred = crate::emit::line::bool_type(&out.dims);
            writeln!(
                l.out,
                "    %raw{n} = stablehlo.{} {an}, {bn} : {ty}",
                b.name()
            )?;
            writeln!(
                l.out,
                "    %nan_a{n} = stablehlo.compare NE, {an}, {an}, FLOAT : ({ty}, {ty}) -> {pred}"
            )?;
            writeln!(
                l.out,
                "    %nan_b{n} = stablehlo.compare NE, {bn}, {bn}, FLOAT : ({ty}, {ty}) -> {pred}"
            )?;
            writeln!(
                l.out,
                "    %pick{n} = stablehlo.select %nan_b{n}, {bn}, %raw{n} : {pred}, {ty}"
            )?;
            writeln!(
                l.out,
                "    {me} = stablehlo.select %nan_a{n}, {an}, %pick{n} : {pred}, {ty}"
            )
        }
        Core::Compare(c) => {
            let (bn, bt) = (&l.args[1], &l.arg_tys[1]);
            let kind = l
                .arg_types
                .first()
                .map_or("FLOAT", |t| crate::emit::line::compare_type(t.dtype));
            let dir = CmpOp::direction(c);
            writeln!(
                l.out,
                "    {me} = stablehlo.compare {dir}, {an}, {bn}, {kind} : ({at}, {bt}) -> {ty}"
            )
        }
        Core::Select => {
            let (tn, tt, fname, ft) = (&l.args[1], &l.arg_tys[1], &l.args[2], &l.arg_tys[2]);
            write!(l.out, "    {me} = stablehlo.select {an}, {tn}, {fname} : ")?;
            if l.arg_types.first().map(|p| &p.dims) == Some(&out.dims) {
                writeln!(l.out, "{at}, {ty}")
            } else {
                // A predicate of another shape (a scalar choosing whole tensors) needs the
                // functional type.
                writeln!(l.out, "({at}, {tt}, {ft}) -> {ty}")
            }
        }
        Core::Convert => writeln!(l.out, "    {me} = stablehlo.convert {an} : ({at}) -> {ty}"),
        // The value itself, as a same-type reshape, which XLA's simplifier removes.
        Core::StopGradient => {
            writeln!(l.out, "    {me} = stablehlo.reshape {an} : ({at}) -> {ty}")
        }
    }
}

/// An element-wise op with result type `out` on the host.
pub(crate) fn core_eval(op: Core, out: &LeafType, operands: &[&Array]) -> Result<ArrayData, Fault> {
    match op {
        Core::Unary(u) => kernels::unary(u, operands[0].data()),
        Core::Binary(b) => kernels::binary(b, operands[0].data(), operands[1].data()),
        Core::Compare(c) => kernels::compare(c, operands[0].data(), operands[1].data()),
        Core::Select => kernels::select(operands[0].data(), operands[1].data(), operands[2].data()),
        Core::Convert => kernels::convert(operands[0].data(), out.dtype),
        Core::StopGradient => crate::ops::host::copy_data(operands[0].data()),
    }
}
