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
/// the miss says `setting_changed: precision the leaves' dtypes → bf16`. The update program
/// depends only on the loss scaling ([`Precision::f16`]'s, [`LossScaling`]), so between f32
/// and bf16 it stays.
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
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Precision {
    compute: Option<DType>,
    scaling: Option<LossScaling>,
}

/// Dynamic loss scaling ([`Precision::f16`]'s): the loss is multiplied by a scale before it is
/// differentiated, so that small gradients survive f16's narrow range, and the gradients are
/// divided by it (in f32) before the update. A step whose gradients hold an infinity or a NaN
/// is skipped — the parameters, the optimizer state and the optimizer's step count stay as
/// they were — and halves the scale (never below 1); `growth_interval` finite steps in a row
/// double it. The scale, the finite steps since it last moved and the optimizer's own step
/// count are kept on the device, read with [`Nitro::loss_scale`](super::Nitro::loss_scale),
/// and saved in checkpoints. PyTorch's `GradScaler` defaults: 2¹⁶, doubled after 2000.
#[derive(Clone, Copy, Debug, PartialEq, crate::ContentHash)]
pub struct LossScaling {
    /// The first scale (a power of two keeps scaling exact).
    pub initial: f32,
    /// Finite steps in a row after which the scale doubles.
    pub growth_interval: u32,
}

impl Default for LossScaling {
    fn default() -> LossScaling {
        LossScaling {
            initial: 65536.0,
            growth_interval: 2000,
        }
    }
}

impl Precision {
    /// Every program computes in the leaves' own dtypes (the default: f32 for f32 leaves).
    pub const fn full() -> Precision {
        Precision {
            compute: None,
            scaling: None,
        }
    }

    /// f32 parameters and optimizer state, the forward and backward passes in bfloat16 (the
    /// range of f32 with 8 bits of mantissa: no loss scaling needed).
    pub const fn bf16() -> Precision {
        Precision {
            compute: Some(DType::BF16),
            scaling: None,
        }
    }

    /// f32 parameters and optimizer state, the forward and backward passes in IEEE half
    /// precision (f16), with dynamic loss scaling ([`LossScaling::default`]): f16's range
    /// ends at 65504 and its smallest normal is 6e-5, so unscaled gradients underflow.
    pub const fn f16() -> Precision {
        Precision {
            compute: Some(DType::F16),
            scaling: Some(LossScaling {
                initial: 65536.0,
                growth_interval: 2000,
            }),
        }
    }

    /// This precision with `scaling` as its loss scaling (`None`: none).
    pub const fn with_loss_scaling(mut self, scaling: Option<LossScaling>) -> Precision {
        self.scaling = scaling;
        self
    }

    /// Its dynamic loss scaling, if any.
    pub const fn loss_scaling(self) -> Option<LossScaling> {
        self.scaling
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
            None => f.write_str("f32")?,
            Some(d) => write!(f, "{d}")?,
        }
        match self.scaling {
            Some(s) if self.compute != Some(DType::F16) || s != LossScaling::default() => write!(
                f,
                " (loss scale from {}, doubled after {} finite steps)",
                s.initial, s.growth_interval
            ),
            Some(_) => Ok(()),
            None if self.compute == Some(DType::F16) => f.write_str(" (no loss scaling)"),
            None => Ok(()),
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
