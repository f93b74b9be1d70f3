//! The precision a handle computes in: [`Precision`].

use crate::tree::DType;

/// The precision a handle's programs compute in ([`Config::precision`](super::Config::precision)).
///
/// The parameters, the optimizer state and the optimizer's arithmetic keep the leaves' own
/// dtype (f32 "master weights"); under [`Precision::bf16`] or [`Precision::f16`] the gradient,
/// evaluation and metric programs read every floating-point parameter leaf and batch column
/// converted to the half dtype, run the model there, and take the gradients with respect to
/// the leaves themselves — so they come back in f32, and the update is f32 arithmetic on f32
/// parameters. The handle reduces the per-example losses in f32, and `nn`'s softmax,
/// log-softmax, cross-entropy and normalization layers compute their reductions in f32 for
/// half inputs.
///
/// The precision is part of every per-batch program's key: changing it recompiles them, and
/// the miss says `setting_changed: precision f32 → bf16`. The update program does not depend
/// on it, so it stays.
///
/// ```
/// use nitro::train::{Config, Precision};
///
/// let config = Config::new().precision(Precision::bf16());
/// assert_eq!(config.precision.to_string(), "bf16");
/// assert_eq!("f32".parse::<Precision>()?, Precision::default());
/// assert!("fp8".parse::<Precision>().is_err());
/// # Ok::<(), nitro::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Precision {
    compute: Option<DType>,
}

impl Precision {
    /// Every program computes in the leaves' own dtypes (the default: f32 for f32 leaves).
    pub const fn full() -> Precision {
        Precision { compute: None }
    }

    /// f32 parameters and optimizer state, the forward and backward passes in bfloat16 (the
    /// range of f32 with 8 bits of mantissa: no loss scaling needed).
    pub const fn bf16() -> Precision {
        Precision {
            compute: Some(DType::BF16),
        }
    }

    /// f32 parameters and optimizer state, the forward and backward passes in IEEE half
    /// precision (f16).
    pub const fn f16() -> Precision {
        Precision {
            compute: Some(DType::F16),
        }
    }

    /// The dtype the per-batch programs compute in, `None` for the leaves' own.
    pub const fn compute(self) -> Option<DType> {
        self.compute
    }

    /// The names [`FromStr`](std::str::FromStr) reads.
    pub const NAMES: &'static str = "f32, bf16 or f16";
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.compute {
            None => f.write_str("f32"),
            Some(d) => write!(f, "{d}"),
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = crate::Error;

    /// `f32` (the leaves' own dtypes), `bf16` or `f16`.
    fn from_str(s: &str) -> crate::Result<Precision> {
        match s {
            "f32" => Ok(Precision::full()),
            "bf16" => Ok(Precision::bf16()),
            "f16" => Ok(Precision::f16()),
            _ => Err(crate::Error::InvalidSetting {
                variable: "precision",
                value: s.to_owned(),
                expected: Precision::NAMES.to_owned(),
            }),
        }
    }
}
