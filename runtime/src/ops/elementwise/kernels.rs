//! Arithmetic: element-wise functions, comparisons, selection, conversion, reductions and the
//! matrix product, with StableHLO's semantics as XLA implements them on CPU.
//!
//! Each function takes typed storage whose shapes the interpreter's checks have verified and returns the
//! result's storage (allocated fallibly), or a [`Fault`]: a message when the dtypes do not fit
//! the op, or an allocation that failed.

use crate::trace::ir::{BinaryOp, CmpOp, UnaryOp};
use crate::tree::{ArrayData, DType};

use crate::ops::host::alloc::{collect, with_capacity};
use crate::ops::host::Fault;

/// Floating-point element types.
pub(crate) trait Float: Copy + PartialOrd + std::fmt::Debug {
    const ZERO: Self;
    const NEG_INF: Self;
    const INF: Self;
    fn unary(self, op: UnaryOp) -> Self;
    fn binary(self, rhs: Self, op: BinaryOp) -> Self;
    /// `acc + a * b` (wrapping for integers; not fused for floats).
    fn mac(acc: Self, a: Self, b: Self) -> Self;
}

macro_rules! float {
    ($t:ty) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const NEG_INF: Self = <$t>::NEG_INFINITY;
            const INF: Self = <$t>::INFINITY;

            fn unary(self, op: UnaryOp) -> Self {
                match op {
                    UnaryOp::Neg => -self,
                    UnaryOp::Exp => self.exp(),
                    UnaryOp::Log => self.ln(),
                    UnaryOp::Tanh => self.tanh(),
                    UnaryOp::Logistic => 1.0 / (1.0 + (-self).exp()),
                    UnaryOp::Sqrt => self.sqrt(),
                    UnaryOp::Rsqrt => 1.0 / self.sqrt(),
                    UnaryOp::Abs => self.abs(),
                    UnaryOp::Sin => self.sin(),
                    UnaryOp::Cos => self.cos(),
                    UnaryOp::Erf => <$t as Special>::erf(self),
                    UnaryOp::ErfInv => <$t as Special>::erf_inv(self),
                    UnaryOp::Log1p => self.ln_1p(),
                    UnaryOp::Expm1 => self.exp_m1(),
                    UnaryOp::Sign => {
                        if self == 0.0 || self.is_nan() {
                            self
                        } else {
                            self.signum()
                        }
                    }
                    UnaryOp::Floor => self.floor(),
                    UnaryOp::Ceil => self.ceil(),
                    UnaryOp::RoundNearestEven => self.round_ties_even(),
                    // Integer-only: refused by the checks before any kernel runs.
                    UnaryOp::Not | UnaryOp::Popcnt => <$t>::NAN,
                }
            }

            fn binary(self, b: Self, op: BinaryOp) -> Self {
                let a = self;
                match op {
                    BinaryOp::Add => a + b,
                    BinaryOp::Sub => a - b,
                    BinaryOp::Mul => a * b,
                    BinaryOp::Div => a / b,
                    BinaryOp::Pow => a.powf(b),
                    // IEEE 754-2019 maximum/minimum (LLVM's `llvm.maximum`, which XLA emits):
                    // NaN propagates, and -0 orders below +0.
                    BinaryOp::Max => {
                        if a.is_nan() || b.is_nan() {
                            <$t>::NAN
                        } else if a == b {
                            if a.is_sign_negative() {
                                b
                            } else {
                                a
                            }
                        } else if a > b {
                            a
                        } else {
                            b
                        }
                    }
                    BinaryOp::Min => {
                        if a.is_nan() || b.is_nan() {
                            <$t>::NAN
                        } else if a == b {
                            if a.is_sign_negative() {
                                a
                            } else {
                                b
                            }
                        } else if a < b {
                            a
                        } else {
                            b
                        }
                    }
                    BinaryOp::Atan2 => a.atan2(b),
                    // Rust's `%` on floats is C's `fmod`: the sign of `a`.
                    BinaryOp::Rem => a % b,
                    // Integer-only: refused by the checks before any kernel runs.
                    BinaryOp::And
                    | BinaryOp::Or
                    | BinaryOp::Xor
                    | BinaryOp::ShiftLeft
                    | BinaryOp::ShiftRightLogical
                    | BinaryOp::ShiftRightArithmetic => <$t>::NAN,
                }
            }

            fn mac(acc: Self, a: Self, b: Self) -> Self {
                acc + a * b
            }
        }
    };
}
float!(f32);
float!(f64);

/// Integer element types: arithmetic wraps, and division never traps.
pub(crate) trait Int: Copy + Ord + std::fmt::Debug {
    const ZERO: Self;
    const MIN: Self;
    const MAX: Self;
    fn unary(self, op: UnaryOp) -> Option<Self>;
    fn binary(self, rhs: Self, op: BinaryOp) -> Self;
    /// `acc + a * b` (wrapping for integers; not fused for floats).
    fn mac(acc: Self, a: Self, b: Self) -> Self;
}

/// `base ^ exp` for `exp ≥ 0` by repeated squaring, wrapping.
macro_rules! pow_by_squaring {
    ($base:expr, $exp:expr) => {{
        let (mut base, mut exp, mut acc) = ($base, $exp, 1);
        while exp > 0 {
            if exp & 1 == 1 {
                acc = base.wrapping_mul(acc);
            }
            base = base.wrapping_mul(base);
            exp >>= 1;
        }
        acc
    }};
}

macro_rules! int {
    ($t:ty, $signed:expr, $unsigned:ty, $as_signed:ty) => {
        impl Int for $t {
            const ZERO: Self = 0;
            const MIN: Self = <$t>::MIN;
            const MAX: Self = <$t>::MAX;

            fn unary(self, op: UnaryOp) -> Option<Self> {
                match op {
                    UnaryOp::Neg => Some(self.wrapping_neg()),
                    #[allow(unused_comparisons)]
                    UnaryOp::Abs => Some(if self < 0 { self.wrapping_neg() } else { self }),
                    UnaryOp::Not => Some(!self),
                    UnaryOp::Popcnt => Some(self.count_ones() as $t),
                    #[allow(unused_comparisons)]
                    UnaryOp::Sign => Some(if self < 0 {
                        (0 as $t).wrapping_sub(1)
                    } else if self == 0 {
                        0
                    } else {
                        1
                    }),
                    _ => None,
                }
            }

            #[allow(unused_comparisons)]
            fn binary(self, b: Self, op: BinaryOp) -> Self {
                let a = self;
                match op {
                    BinaryOp::Add => a.wrapping_add(b),
                    BinaryOp::Sub => a.wrapping_sub(b),
                    BinaryOp::Mul => a.wrapping_mul(b),
                    // XLA: x / 0 is -1 (all bits set; 255 for u8), MIN / -1 is MIN (wraps);
                    // otherwise truncation toward zero.
                    BinaryOp::Div => {
                        if b == 0 {
                            (0 as $t).wrapping_sub(1)
                        } else {
                            a.wrapping_div(b)
                        }
                    }
                    // As the StableHLO reference interpreter: for a negative exponent,
                    // 1^n = 1, (-1)^n = ±1 by parity, anything else 0.
                    BinaryOp::Pow => {
                        if b < 0 {
                            if a == 1 {
                                1
                            } else if $signed && a == (0 as $t).wrapping_sub(1) {
                                if b % 2 == 0 {
                                    1
                                } else {
                                    a
                                }
                            } else {
                                0
                            }
                        } else {
                            pow_by_squaring!(a, b)
                        }
                    }
                    BinaryOp::Max => a.max(b),
                    BinaryOp::Min => a.min(b),
                    // XLA: x % 0 is x, MIN % -1 is 0; otherwise the sign of `a`.
                    BinaryOp::Rem => {
                        if b == 0 {
                            a
                        } else {
                            a.wrapping_rem(b)
                        }
                    }
                    BinaryOp::And => a & b,
                    BinaryOp::Or => a | b,
                    BinaryOp::Xor => a ^ b,
                    // Shift amounts are read as unsigned: at least the bit width gives 0 (all
                    // sign bits for an arithmetic right shift), as XLA.
                    BinaryOp::ShiftLeft => {
                        let n = b as $unsigned;
                        if n >= <$t>::BITS as $unsigned {
                            0
                        } else {
                            a << n
                        }
                    }
                    BinaryOp::ShiftRightLogical => {
                        let n = b as $unsigned;
                        if n >= <$t>::BITS as $unsigned {
                            0
                        } else {
                            ((a as $unsigned) >> n) as $t
                        }
                    }
                    BinaryOp::ShiftRightArithmetic => {
                        let n = (b as $unsigned).min(<$t>::BITS as $unsigned - 1);
                        ((a as $as_signed) >> n) as $t
                    }
                    // Float-only: refused by the checks before any kernel runs.
                    BinaryOp::Atan2 => 0,
                }
            }

            fn mac(acc: Self, a: Self, b: Self) -> Self {
                acc.wrapping_add(a.wrapping_mul(b))
            }
        }
    };
}
int!(i32, true, u32, i32);
int!(i64, true, u64, i64);
int!(u8, false, u8, i8);
int!(u32, false, u32, i32);

/// `erf` and its inverse (std has neither): `erf` from libm; `erf_inv` by Newton's method on
/// `erf` in `f64` from a rational first guess, rounded once to the type.
trait Special: Sized {
    fn erf(self) -> Self;
    fn erf_inv(self) -> Self;
}

fn erf_inv_f64(y: f64) -> f64 {
    if y.is_nan() || !(-1.0..=1.0).contains(&y) {
        return f64::NAN;
    }
    if y == 1.0 {
        return f64::INFINITY;
    }
    if y == -1.0 {
        return f64::NEG_INFINITY;
    }
    // A first guess accurate to about 2e-3 (Winitzki's approximation), then Newton steps:
    // x ← x − (erf(x) − y) / (2/√π · e^(−x²)), which converge quadratically.
    let a = 0.147;
    let ln = (1.0 - y * y).ln();
    let t = 2.0 / (std::f64::consts::PI * a) + ln / 2.0;
    let mut x = (y.signum()) * ((t * t - ln / a).sqrt() - t).sqrt();
    for _ in 0..6 {
        let err = libm::erf(x) - y;
        let slope = std::f64::consts::FRAC_2_SQRT_PI * (-x * x).exp();
        if slope == 0.0 {
            break;
        }
        x -= err / slope;
    }
    x
}

impl Special for f64 {
    fn erf(self) -> f64 {
        libm::erf(self)
    }
    fn erf_inv(self) -> f64 {
        erf_inv_f64(self)
    }
}

impl Special for f32 {
    fn erf(self) -> f32 {
        libm::erf(self as f64) as f32
    }
    /// Giles' single-precision approximation, which XLA expands `erf_inv` to for `f32` (its
    /// Horner steps fused), so the interpreter stays within an ulp or two of XLA where the
    /// approximation itself is tens of ulps from the true value (near ±1).
    fn erf_inv(self) -> f32 {
        const SMALL: [f32; 9] = [
            2.810_226_4e-8,
            3.432_739_4e-7,
            -3.523_387_7e-6,
            -4.391_506_5e-6,
            0.000_218_580_87,
            -0.001_253_725,
            -0.004_177_681_6,
            0.246_640_73,
            1.501_409_4,
        ];
        const LARGE: [f32; 9] = [
            -0.000_200_214_26,
            0.000_100_950_56,
            0.001_349_343_2,
            -0.003_673_428_4,
            0.005_739_507_7,
            -0.007_622_461,
            0.009_438_870_5,
            1.001_674,
            2.832_976_8,
        ];
        let x = self;
        if x.abs() == 1.0 {
            return x * f32::INFINITY;
        }
        let w = -(-(x * x)).ln_1p();
        let (w, c) = if w < 5.0 {
            (w - 2.5, &SMALL)
        } else {
            (w.sqrt() - 3.0, &LARGE)
        };
        let p = c[1..].iter().fold(c[0], |p, &k| p.mul_add(w, k));
        p * x
    }
}

/// `a op b` with the element-wise semantics of floats (NaN-propagating max/min).
pub(crate) fn float_binary<T: Float>(a: T, b: T, op: BinaryOp) -> T {
    a.binary(b, op)
}

fn zip<T: Copy, U>(a: &[T], b: &[T], f: impl Fn(T, T) -> U) -> Result<Vec<U>, Fault> {
    collect(
        a.len().min(b.len()),
        a.iter().zip(b).map(|(&x, &y)| f(x, y)),
    )
}

fn map<T: Copy, U>(a: &[T], f: impl Fn(T) -> U) -> Result<Vec<U>, Fault> {
    collect(a.len(), a.iter().map(|&x| f(x)))
}

fn int_unary<T: Int>(op: UnaryOp, v: &[T]) -> Result<Vec<T>, Fault> {
    let mut out = with_capacity(v.len())?;
    for &x in v {
        match x.unary(op) {
            Some(y) => out.push(y),
            None => return Err(format!("`{}` is defined only for floats", op.name()).into()),
        }
    }
    Ok(out)
}

/// An element-wise unary function.
pub(crate) fn unary(op: UnaryOp, a: &ArrayData) -> Result<ArrayData, Fault> {
    Ok(match a {
        ArrayData::F32(v) => ArrayData::F32(map(v, |x| x.unary(op))?),
        ArrayData::F64(v) => ArrayData::F64(map(v, |x| x.unary(op))?),
        ArrayData::I32(v) => ArrayData::I32(int_unary(op, v)?),
        ArrayData::I64(v) => ArrayData::I64(int_unary(op, v)?),
        ArrayData::U8(v) => ArrayData::U8(int_unary(op, v)?),
        ArrayData::U32(v) => ArrayData::U32(int_unary(op, v)?),
        ArrayData::Bool(v) if op == UnaryOp::Not => {
            ArrayData::Bool(v.iter().map(|&x| !x).collect())
        }
        ArrayData::Bool(_) => return Err(format!("`{}` is not defined for bool", op.name()).into()),
        ArrayData::BF16(_) | ArrayData::F16(_) => return Err(half_in_kernel()),
    })
}

/// An element-wise binary function of two operands of one shape and dtype.
pub(crate) fn binary(op: BinaryOp, a: &ArrayData, b: &ArrayData) -> Result<ArrayData, Fault> {
    Ok(match (a, b) {
        (ArrayData::F32(x), ArrayData::F32(y)) => {
            ArrayData::F32(zip(x, y, |p, q| p.binary(q, op))?)
        }
        (ArrayData::F64(x), ArrayData::F64(y)) => {
            ArrayData::F64(zip(x, y, |p, q| p.binary(q, op))?)
        }
        (ArrayData::I32(x), ArrayData::I32(y)) => {
            ArrayData::I32(zip(x, y, |p, q| p.binary(q, op))?)
        }
        (ArrayData::I64(x), ArrayData::I64(y)) => {
            ArrayData::I64(zip(x, y, |p, q| p.binary(q, op))?)
        }
        (ArrayData::U8(x), ArrayData::U8(y)) => ArrayData::U8(zip(x, y, |p, q| p.binary(q, op))?),
        (ArrayData::U32(x), ArrayData::U32(y)) => {
            ArrayData::U32(zip(x, y, |p, q| p.binary(q, op))?)
        }
        (ArrayData::Bool(x), ArrayData::Bool(y)) => match op {
            BinaryOp::Max | BinaryOp::Or => ArrayData::Bool(zip(x, y, |p, q| p | q)?),
            BinaryOp::Min | BinaryOp::And => ArrayData::Bool(zip(x, y, |p, q| p & q)?),
            BinaryOp::Xor => ArrayData::Bool(zip(x, y, |p, q| p ^ q)?),
            _ => return Err(format!("`{}` is not defined for bool", op.name()).into()),
        },
        _ => return Err(mismatch(a, b)),
    })
}

/// Half-precision values reach the kernels in `f32`: the interpreter's driver widens them
/// around every op but `convert`.
pub(crate) fn half_in_kernel() -> Fault {
    Fault::from("half-precision values are computed in f32 by the interpreter".to_owned())
}

pub(crate) fn mismatch(a: &ArrayData, b: &ArrayData) -> Fault {
    Fault::from(format!(
        "operands have different dtypes ({} and {})",
        a.dtype(),
        b.dtype()
    ))
}

fn compare_one<T: PartialOrd>(op: CmpOp, a: T, b: T) -> bool {
    // `PartialOrd` on floats is IEEE: NaN is unordered (only `!=` holds) and -0 == +0.
    match op {
        CmpOp::Eq => a == b,
        CmpOp::Ne => a != b,
        CmpOp::Lt => a < b,
        CmpOp::Le => a <= b,
        CmpOp::Gt => a > b,
        CmpOp::Ge => a >= b,
    }
}

/// An element-wise comparison giving `bool`.
pub(crate) fn compare(op: CmpOp, a: &ArrayData, b: &ArrayData) -> Result<ArrayData, Fault> {
    Ok(ArrayData::Bool(match (a, b) {
        (ArrayData::F32(x), ArrayData::F32(y)) => zip(x, y, |p, q| compare_one(op, p, q))?,
        (ArrayData::F64(x), ArrayData::F64(y)) => zip(x, y, |p, q| compare_one(op, p, q))?,
        (ArrayData::I32(x), ArrayData::I32(y)) => zip(x, y, |p, q| compare_one(op, p, q))?,
        (ArrayData::I64(x), ArrayData::I64(y)) => zip(x, y, |p, q| compare_one(op, p, q))?,
        (ArrayData::U8(x), ArrayData::U8(y)) => zip(x, y, |p, q| compare_one(op, p, q))?,
        (ArrayData::U32(x), ArrayData::U32(y)) => zip(x, y, |p, q| compare_one(op, p, q))?,
        (ArrayData::Bool(x), ArrayData::Bool(y)) => zip(x, y, |p, q| compare_one(op, p, q))?,
        _ => return Err(mismatch(a, b)),
    }))
}

fn select_vec<T: Copy>(pred: &[bool], a: &[T], b: &[T]) -> Result<Vec<T>, Fault> {
    if let [p] = pred {
        // A scalar predicate picks a whole operand.
        let whole = if *p { a } else { b };
        return collect(whole.len(), whole.iter().copied());
    }
    collect(
        pred.len(),
        pred.iter()
            .zip(a.iter().zip(b))
            .map(|(&p, (&x, &y))| if p { x } else { y }),
    )
}

/// `on_true` where `pred` holds, else `on_false`; `pred` has their shape, or is a scalar.
pub(crate) fn select(pred: &ArrayData, a: &ArrayData, b: &ArrayData) -> Result<ArrayData, Fault> {
    let ArrayData::Bool(p) = pred else {
        return Err(format!("the predicate must be bool, not {}", pred.dtype()).into());
    };
    Ok(match (a, b) {
        (ArrayData::F32(x), ArrayData::F32(y)) => ArrayData::F32(select_vec(p, x, y)?),
        (ArrayData::F64(x), ArrayData::F64(y)) => ArrayData::F64(select_vec(p, x, y)?),
        (ArrayData::I32(x), ArrayData::I32(y)) => ArrayData::I32(select_vec(p, x, y)?),
        (ArrayData::I64(x), ArrayData::I64(y)) => ArrayData::I64(select_vec(p, x, y)?),
        (ArrayData::U8(x), ArrayData::U8(y)) => ArrayData::U8(select_vec(p, x, y)?),
        (ArrayData::U32(x), ArrayData::U32(y)) => ArrayData::U32(select_vec(p, x, y)?),
        (ArrayData::Bool(x), ArrayData::Bool(y)) => ArrayData::Bool(select_vec(p, x, y)?),
        _ => return Err(mismatch(a, b)),
    })
}

/// Converts every element of `$v` to `$to` with Rust's `as`, which has StableHLO's semantics
/// here: float → int truncates toward zero and saturates (NaN → 0), int → int wraps (keeps the
/// low bits), int → float rounds to nearest; to bool is `x != 0` (NaN → true).
macro_rules! convert_all {
    ($v:expr, $to:expr, $zero:expr) => {
        match $to {
            DType::F32 => ArrayData::F32(map(&$v, |x| x as f32)?),
            DType::F64 => ArrayData::F64(map(&$v, |x| x as f64)?),
            DType::I32 => ArrayData::I32(map(&$v, |x| x as i32)?),
            DType::I64 => ArrayData::I64(map(&$v, |x| x as i64)?),
            DType::U8 => ArrayData::U8(map(&$v, |x| x as u8)?),
            DType::U32 => ArrayData::U32(map(&$v, |x| x as u32)?),
            // Through f32, then round to nearest, ties to even (NaN stays NaN): exact for f32
            // sources; f64 and wide integer sources round twice.
            DType::BF16 => ArrayData::BF16(map(&$v, |x| half::bf16::from_f32(x as f32))?),
            DType::F16 => ArrayData::F16(map(&$v, |x| half::f16::from_f32(x as f32))?),
            DType::Bool => ArrayData::Bool(map(&$v, |x| x != $zero)?),
        }
    };
}

/// Element type conversion (see `convert_all!` for the rules; bool → number is 0 or 1).
pub(crate) fn convert(a: &ArrayData, to: DType) -> Result<ArrayData, Fault> {
    Ok(match a {
        ArrayData::F32(v) => convert_all!(v, to, 0.0),
        ArrayData::F64(v) => convert_all!(v, to, 0.0),
        ArrayData::I32(v) => convert_all!(v, to, 0),
        ArrayData::I64(v) => convert_all!(v, to, 0),
        ArrayData::U8(v) => convert_all!(v, to, 0),
        ArrayData::U32(v) => convert_all!(v, to, 0),
        // Half to anything goes through f32, which holds every half value exactly.
        ArrayData::BF16(v) => {
            let wide: Vec<f32> = map(v, half::bf16::to_f32)?;
            convert_all!(wide, to, 0.0)
        }
        ArrayData::F16(v) => {
            let wide: Vec<f32> = map(v, half::f16::to_f32)?;
            convert_all!(wide, to, 0.0)
        }
        ArrayData::Bool(v) => {
            let bytes: Vec<u8> = map(v, u8::from)?;
            convert_all!(bytes, to, 0)
        }
    })
}
