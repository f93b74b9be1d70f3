//! Seeded, reproducible parameter initializers, in two families.
//!
//! - **Functions of a [`Seed`]** ([`normal`], [`uniform`], [`glorot_uniform`], …, and so every
//!   layer's own `init` in [`crate::nn`]) draw from [`Rng`], a SplitMix64 generator: the same
//!   seed gives the same numbers on every platform, in every process and in every version of
//!   nitro (golden values in the tests pin the stream). Normal draws use the Box–Muller
//!   transform.
//! - **Rules** ([`Init`]) create a leaf from a run's seed and the leaf's path with
//!   `jax.random`'s Threefry algorithms — on the devices
//!   ([`Config::initialize`](crate::train::Config::initialize)) or on the host
//!   ([`crate::train::initialize_on_host`], [`Init::on_host`]), the same values either way
//!   (see [`Init::on_host`] for the last bits).
//!
//! The two families draw different numbers: a model made by its layers' `init` and the same
//! model created by rules are two different draws of one distribution. To move a run between
//! host and device creation and keep its numbers, create it by rules in both places.
//!
//! ```
//! use nitro::init::{self, Seed};
//!
//! let w = init::glorot_uniform(64, 128, Seed(1));
//! assert_eq!(w.dims(), &[64, 128]);
//! assert_eq!(w, init::glorot_uniform(64, 128, Seed(1)), "reproducible");
//! let limit = (6.0f32 / (64.0 + 128.0)).sqrt();
//! assert!(w.as_slice::<f32>().unwrap().iter().all(|v| v.abs() <= limit));
//! ```

use crate::trace::record::Tensor;
use crate::tree::{Array, DType, LeafType};

/// A seed for an initializer or a shuffle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Seed(pub u64);

/// SplitMix64: a small, fast generator with a fixed, documented stream (not for cryptography).
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: Seed) -> Rng {
        Rng { state: seed.0 }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform draw in `0..n` (`n > 0`), without modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        // Lemire's multiply-shift with rejection of the biased low zone.
        let zone = n.wrapping_neg() % n;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n);
            if (m as u64) >= zone {
                return (m >> 64) as u64;
            }
        }
    }

    /// A standard normal draw (Box–Muller; one of the pair is used, so the stream stays simple).
    pub fn next_normal(&mut self) -> f64 {
        // 1 - u lies in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Shuffles `items` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

fn filled(dims: &[usize], seed: Seed, mut draw: impl FnMut(&mut Rng) -> f64) -> Array {
    if declaring() {
        return Array::zeros(DType::F32, dims);
    }
    let mut rng = Rng::new(seed);
    let n: usize = dims.iter().product();
    let values: Vec<f32> = (0..n).map(|_| draw(&mut rng) as f32).collect();
    // The element count is the product of `dims` by construction.
    Array::from_vec(dims, values).unwrap_or_else(|_| Array::zeros(DType::F32, dims))
}

/// Zeros of `dtype`.
pub fn zeros(dtype: DType, dims: &[usize]) -> Array {
    Array::zeros(dtype, dims)
}

/// f32 draws from a normal distribution with `mean` and standard deviation `std`.
pub fn normal(dims: &[usize], mean: f64, std: f64, seed: Seed) -> Array {
    filled(dims, seed, |r| mean + std * r.next_normal())
}

/// f32 draws uniform in `[low, high)`.
pub fn uniform(dims: &[usize], low: f64, high: f64, seed: Seed) -> Array {
    filled(dims, seed, |r| low + (high - low) * r.next_f64())
}

/// Glorot (Xavier) uniform weights `[fan_in, fan_out]`: uniform in `±sqrt(6 / (fan_in +
/// fan_out))`, for tanh and logistic layers.
pub fn glorot_uniform(fan_in: usize, fan_out: usize, seed: Seed) -> Array {
    let limit = (6.0 / (fan_in + fan_out).max(1) as f64).sqrt();
    uniform(&[fan_in, fan_out], -limit, limit, seed)
}

/// Glorot (Xavier) normal weights `[fan_in, fan_out]`: standard deviation `sqrt(2 / (fan_in +
/// fan_out))`.
pub fn glorot_normal(fan_in: usize, fan_out: usize, seed: Seed) -> Array {
    let std = (2.0 / (fan_in + fan_out).max(1) as f64).sqrt();
    normal(&[fan_in, fan_out], 0.0, std, seed)
}

/// He (Kaiming) normal weights `[fan_in, fan_out]`: standard deviation `sqrt(2 / fan_in)`, for
/// ReLU layers.
pub fn he_normal(fan_in: usize, fan_out: usize, seed: Seed) -> Array {
    let std = (2.0 / fan_in.max(1) as f64).sqrt();
    normal(&[fan_in, fan_out], 0.0, std, seed)
}

/// He (Kaiming) uniform weights `[fan_in, fan_out]`: uniform in `±sqrt(6 / fan_in)`.
pub fn he_uniform(fan_in: usize, fan_out: usize, seed: Seed) -> Array {
    let limit = (6.0 / fan_in.max(1) as f64).sqrt();
    uniform(&[fan_in, fan_out], -limit, limit, seed)
}

// ---- leaves created on the devices ---------------------------------------------------------

thread_local! {
    static DECLARING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether [`declared`] is building an experiment on this thread.
pub(crate) fn declaring() -> bool {
    DECLARING.with(std::cell::Cell::get)
}

/// Runs `build` with every random initializer of this module ([`normal`], [`uniform`],
/// [`glorot_uniform`], … and so every layer's `init` in [`crate::nn`]) drawing nothing: each
/// returns zeros of its type, asked for already zeroed ([`Array::try_zeros`]), which cost
/// address space and no memory until written. What `build` makes is an experiment **declared by
/// its types**: a training handle whose [`Config::initialize`](crate::train::Config::initialize)
/// rules cover those leaves creates them on the devices, each device its own shard, and never
/// reads or writes the host's zeros — so the model need never fit one host. A stack of
/// declared layers ([`crate::nn::Repeated::stack_params`]) is declared too; copying a declared
/// leaf (`clone`) makes the copy resident.
///
/// ```
/// use nitro::init::{self, Seed};
///
/// let w = init::declared(|| init::glorot_uniform(1024, 1024, Seed(1)));
/// assert_eq!(w.dims(), &[1024, 1024]);
/// assert!(w.as_slice::<f32>()?.iter().all(|&v| v == 0.0));
/// # Ok::<(), nitro::Error>(())
/// ```
pub fn declared<T>(build: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            DECLARING.with(|d| d.set(self.0));
        }
    }
    let _reset = Reset(DECLARING.with(|d| d.replace(true)));
    build()
}

/// How a training handle creates a leaf on the devices
/// ([`Config::initialize`](crate::train::Config::initialize)): a constant, or draws from the
/// run's seed with `jax.random`'s algorithms (Threefry-2x32, [`crate::trace::random`]).
///
/// The fans of the scaled initializers are those the layers of [`crate::nn`] use in their own
/// `init` ([`Init::fans`]), read from the leaf's dims:
///
/// | leaf | dims | `(fan_in, fan_out)` |
/// | --- | --- | --- |
/// | a bias or gain | `[n]` | `(n, n)` |
/// | a `Linear`'s weight | `[inputs, outputs]` | `(inputs, outputs)` |
/// | a stack of them ([`crate::nn::Repeated`]) | `[layers, inputs, outputs]` | `(inputs, outputs)` |
/// | a `Conv2d` kernel (HWIO) | `[kh, kw, in, out]` | `(kh·kw·in, kh·kw·out)` |
/// | a stack of them | `[layers, kh, kw, in, out]` | `(kh·kw·in, kh·kw·out)` |
///
/// So `HeNormal` on a `3×3×16×32` kernel draws the standard deviation `√(2 / 144)` that
/// `Conv2d`'s own `init` draws. Dims do not say which layout a kernel has: a channels-first
/// (OIHW, [`crate::nn::Conv2d::channels_first`]) kernel or a kernel of another rank needs a
/// [`Init::Normal`] or [`Init::Uniform`] rule with its scale written out.
///
/// A rule whose parameters cannot make a finite leaf (`Normal { std: f64::NAN, .. }`, a
/// negative `std`, `Constant(f64::INFINITY)`, `Uniform` with `low ≥ high`) is refused when the
/// training handle is made ([`Init::problem`]).
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub enum Init {
    /// Zeros.
    Zeros,
    /// Ones.
    Ones,
    /// Every element this value.
    Constant(f64),
    /// Normal draws with this mean and standard deviation.
    Normal {
        /// The mean.
        mean: f64,
        /// The standard deviation.
        std: f64,
    },
    /// Uniform draws in `[low, high)`.
    Uniform {
        /// The lower bound.
        low: f64,
        /// The upper bound (excluded).
        high: f64,
    },
    /// Uniform in `±sqrt(6 / (fan_in + fan_out))` ([`glorot_uniform`]).
    GlorotUniform,
    /// Normal with standard deviation `sqrt(2 / (fan_in + fan_out))` ([`glorot_normal`]).
    GlorotNormal,
    /// Normal with standard deviation `sqrt(2 / fan_in)` ([`he_normal`]).
    HeNormal,
    /// Uniform in `±sqrt(6 / fan_in)` ([`he_uniform`]).
    HeUniform,
}

/// The rules that create the layers of [`crate::nn`] as their own `init` does (the same
/// distributions, drawn from the run's Threefry stream instead of SplitMix64): embedding
/// tables (`*.table`) normal with standard deviation 0.02, norm gains (`*.gain`) ones, biases
/// (`*.b`, `*.bias`) zeros, and weights (`*.w`) Glorot-uniform — every leaf of `Linear`,
/// `Embedding`, `LayerNorm`, `RmsNorm`, `Attention`, `Block` and `Gpt2`. Convolutions and
/// recurrent layers draw their weights otherwise: give them rules of their own, first.
///
/// These rules draw other numbers than the layers' own `init` (Threefry keyed by each leaf's
/// path, not SplitMix64 from a [`Seed`]); to create the same model on the host, give them to
/// [`crate::train::initialize_on_host`].
pub fn layer_defaults() -> Vec<(&'static str, Init)> {
    vec![
        (
            "*.table",
            Init::Normal {
                mean: 0.0,
                std: 0.02,
            },
        ),
        ("*.gain", Init::Ones),
        ("*.b|*.bias", Init::Zeros),
        ("*.w", Init::GlorotUniform),
    ]
}

/// The domain every leaf's key is folded from: `fold_in(PRNGKey(seed), INIT_DOMAIN)`.
pub const INIT_DOMAIN: u32 = 0x696e_6974;

impl Init {
    /// Whether it draws random numbers (and so needs a float leaf).
    pub fn is_random(&self) -> bool {
        !matches!(self, Init::Zeros | Init::Ones | Init::Constant(_))
    }

    /// The number a leaf's key is folded from: the first four bytes of the blake3 of its path,
    /// little-endian, top bit cleared — so a leaf keeps its values when others are added or
    /// reordered.
    pub fn leaf_id(path: &str) -> u32 {
        let h = blake3::hash(path.as_bytes());
        let b = h.as_bytes();
        u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7fff_ffff
    }

    /// `(fan_in, fan_out)` of a leaf of `dims`, as the layer that owns such a leaf computes
    /// them in its own `init` ([`Init`] says which leaves are which).
    pub fn fans(dims: &[usize]) -> (f64, f64) {
        let f = |n: usize| n as f64;
        match dims {
            [] => (1.0, 1.0),
            [n] => (f(*n), f(*n)),
            // A weight, or a stack of them: the leading dim is the stack's depth.
            [i, o] | [_, i, o] => (f(*i), f(*o)),
            // A 2-D convolution kernel (HWIO, as `Conv2d` keeps it), or a stack of them: the
            // receptive field times the input and output channels.
            [kh, kw, i, o] | [_, kh, kw, i, o] => {
                let field = f(*kh) * f(*kw);
                (field * f(*i), field * f(*o))
            }
            // Higher ranks: every dim before the last two is part of the receptive field.
            [rest @ .., i, o] => {
                let field: f64 = rest.iter().map(|&d| f(d)).product();
                (field * f(*i), field * f(*o))
            }
        }
    }

    /// Why this rule cannot create any leaf (a parameter that is not a finite number, a
    /// negative standard deviation, an empty range), in words that name the parameter and
    /// say what to give instead; `None` when it can.
    pub fn problem(&self) -> Option<String> {
        // Draws are made in f32: a parameter must be a finite f32.
        let finite = |name: &str, v: f64| {
            let as_f32 = v as f32;
            (!as_f32.is_finite()).then(|| {
                let what = match v.is_finite() {
                    true => format!("{v:e}, which is past f32's largest finite value"),
                    false => format!("{v}"),
                };
                format!(
                    "`{name}` is {what}: every parameter of a rule must be a finite number \
                     (draws are made in f32, up to ±{:e}); give a finite `{name}`",
                    f32::MAX
                )
            })
        };
        match *self {
            Init::Zeros
            | Init::Ones
            | Init::GlorotUniform
            | Init::GlorotNormal
            | Init::HeNormal
            | Init::HeUniform => None,
            Init::Constant(c) => (!c.is_finite()).then(|| {
                format!(
                    "the constant is {c}: give a finite number (a leaf of NaN or ±inf \
                         makes the loss NaN)"
                )
            }),
            Init::Normal { mean, std } => finite("mean", mean)
                .or_else(|| finite("std", std))
                .or_else(|| {
                    (std < 0.0).then(|| {
                        format!(
                            "`std` is {std}: a standard deviation is at least 0; give {}",
                            -std
                        )
                    })
                }),
            Init::Uniform { low, high } => finite("low", low)
                .or_else(|| finite("high", high))
                .or_else(|| {
                    (low as f32 >= high as f32).then(|| {
                        format!(
                            "the range [{low}, {high}) is empty: `low` must be below `high` \
                             (for a single value, use Init::Constant)"
                        )
                    })
                })
                .or_else(|| {
                    (!(high as f32 - low as f32).is_finite()).then(|| {
                        format!(
                            "the range [{low}, {high}) is wider than f32's largest finite \
                             value; give a narrower range"
                        )
                    })
                }),
        }
    }

    /// Why this rule cannot create a leaf of `ty`: [`problem`](Init::problem), a random rule on
    /// a leaf that is not floating-point, a constant the dtype cannot hold, or draws that could
    /// overflow the dtype (normal draws reach about 5.4 standard deviations from the mean);
    /// `None` when it can.
    pub fn problem_for(&self, ty: &LeafType) -> Option<String> {
        if let Some(p) = self.problem() {
            return Some(p);
        }
        if self.is_random() && !ty.dtype.is_float() {
            return Some(format!(
                "a random rule cannot create a leaf of {ty}: random draws make floating-point \
                 leaves; give a constant"
            ));
        }
        let largest = match ty.dtype {
            DType::F16 => f64::from(half::f16::MAX),
            DType::BF16 => f64::from(half::bf16::MAX),
            DType::F32 | DType::F64 => f64::from(f32::MAX),
            _ => f64::INFINITY,
        };
        let reach = match *self {
            Init::Constant(c) => {
                if let Err(e) = crate::ops::elementwise::tracing::scalar_array(c, ty.dtype) {
                    return Some(format!("{e}: give a constant a leaf of {ty} holds"));
                }
                c.abs()
            }
            Init::Normal { mean, std } => mean.abs() + 5.5 * std,
            Init::Uniform { low, high } => low.abs().max(high.abs()),
            // Scaled rules draw within a few units; zeros and ones fit every dtype.
            _ => 0.0,
        };
        (reach > largest).then(|| {
            format!(
                "values up to {reach:e} in magnitude do not fit a leaf of {ty}, whose largest \
                 finite value is {largest:e}; give smaller parameters, or make the leaf wider"
            )
        })
    }

    /// What it draws for a leaf of `dims`: a constant, or normal or uniform draws with these
    /// parameters (the scaled rules' computed from the fans).
    fn draw(&self, dims: &[usize]) -> Draw {
        let (fan_in, fan_out) = Init::fans(dims);
        match *self {
            Init::Zeros => Draw::Full(0.0),
            Init::Ones => Draw::Full(1.0),
            Init::Constant(c) => Draw::Full(c),
            Init::Normal { mean, std } => Draw::Normal { mean, std },
            Init::Uniform { low, high } => Draw::Uniform { low, high },
            Init::GlorotUniform => {
                let limit = (6.0 / (fan_in + fan_out).max(1.0)).sqrt();
                Draw::Uniform {
                    low: -limit,
                    high: limit,
                }
            }
            Init::GlorotNormal => Draw::Normal {
                mean: 0.0,
                std: (2.0 / (fan_in + fan_out).max(1.0)).sqrt(),
            },
            Init::HeNormal => Draw::Normal {
                mean: 0.0,
                std: (2.0 / fan_in.max(1.0)).sqrt(),
            },
            Init::HeUniform => {
                let limit = (6.0 / fan_in.max(1.0)).sqrt();
                Draw::Uniform {
                    low: -limit,
                    high: limit,
                }
            }
        }
    }

    /// The key leaf `path` draws from in a run seeded with `seed`, as two words:
    /// `fold_in(fold_in(PRNGKey(seed), INIT_DOMAIN), leaf_id(path))`.
    pub fn leaf_key(seed: u64, path: &str) -> [u32; 2] {
        use crate::ops::random::{fold_in_host, key_host};
        fold_in_host(
            fold_in_host(key_host(seed), INIT_DOMAIN),
            Init::leaf_id(path),
        )
    }

    /// The leaf of type `ty` at `path` that a training handle seeded with `seed` creates with
    /// this rule on its devices ([`Config::initialize`](crate::train::Config::initialize)),
    /// computed here on the host: the same Threefry bits, turned into floats by the same
    /// arithmetic as the initializer program compiled by XLA (a scale and a shift are one
    /// fused multiply-add). What that gives, measured in `runtime/tests/init_rules.rs`:
    ///
    /// - constants, and the uniform rules (`Uniform`, `GlorotUniform`, `HeUniform`): XLA's
    ///   leaves bit for bit; the interpreter's within one rounding of the shift (it does not
    ///   fuse), at most an ulp of the range's bound;
    /// - the normal rules (`Normal`, `GlorotNormal`, `HeNormal`): the interpreter's bit for
    ///   bit; XLA's within a few ulps (3 on its CPU compiler), because `erf_inv` takes a
    ///   `log1p` that every backend computes with its own math library — XLA on a CPU and on a
    ///   GPU differ from each other the same way.
    ///
    /// So [`crate::train::initialize_on_host`] and a handle's device creation start a run from
    /// the same model, where the layers' own `init` (SplitMix64 from a [`Seed`]) does not.
    ///
    /// ```
    /// use nitro::init::Init;
    /// use nitro::{DType, LeafType};
    ///
    /// let ty = LeafType::new(DType::F32, &[4, 16]);
    /// let rule = Init::Normal { mean: 0.0, std: 0.02 };
    /// let host = rule.on_host(11, "tokens.table", &ty)?;
    /// let backend = nitro::backend::interpreter();
    /// let cache = nitro::cache::global();
    /// let device = nitro::train::create_leaf(backend, cache, 11, "tokens.table", &ty, rule)?;
    /// assert_eq!(host, device);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    ///
    /// Errors: [`Error::InvalidSetting`](crate::Error::InvalidSetting) for a rule that cannot
    /// create such a leaf ([`problem_for`](Init::problem_for)), or a leaf of more than 2³²
    /// elements (a draw's counter is 32 bits).
    pub fn on_host(&self, seed: u64, path: &str, ty: &LeafType) -> crate::Result<Array> {
        use crate::ops::random::{normal_host, uniform_host};
        let refuse = |expected: String| crate::Error::InvalidSetting {
            variable: "Init::on_host",
            value: format!("{path} → {self:?}"),
            expected,
        };
        if let Some(problem) = self.problem_for(ty) {
            return Err(refuse(problem));
        }
        let dims = &ty.dims;
        let n = crate::tree::checked_count(ty.dtype, dims)?;
        let key = Init::leaf_key(seed, path);
        let too_many = || {
            refuse(format!(
                "a leaf of {ty} has more than 2^32 elements, more than one draw makes; split it"
            ))
        };
        let drawn = match self.draw(dims) {
            Draw::Full(c) => {
                let one =
                    crate::ops::elementwise::tracing::scalar_array(c, ty.dtype).map_err(refuse)?;
                use crate::tree::ArrayData as D;
                macro_rules! full {
                    ($($variant:ident),*) => {
                        match one.data() {
                            $(D::$variant(v) => v.first().map(|&x| Array::try_full(dims, x)),)*
                        }
                    };
                }
                let full = full!(F32, F64, I32, I64, U8, Bool, U32, BF16, F16);
                return full.unwrap_or_else(|| Ok(Array::zeros(ty.dtype, dims)));
            }
            Draw::Normal { mean, std } => {
                let (mean, std) = (mean as f32, std as f32);
                normal_host(key, n)
                    .ok_or_else(too_many)?
                    .into_iter()
                    .map(|z| z.mul_add(std, mean))
                    .collect::<Vec<f32>>()
            }
            Draw::Uniform { low, high } => uniform_host(key, n, low, high).ok_or_else(too_many)?,
        };
        let data = crate::tree::ArrayData::F32(drawn);
        let data = match ty.dtype {
            DType::F32 => data,
            other => {
                use crate::ops::host::Fault;
                crate::ops::elementwise::kernels::convert(&data, other).map_err(|f| match f {
                    Fault::Invalid(message) => refuse(message),
                    Fault::Alloc { bytes } => crate::Error::OutOfMemory {
                        what: format!("leaf `{path}`, {ty}"),
                        bytes,
                    },
                })?
            }
        };
        Array::from_data(dims, data)
    }

    /// The leaf of type `ty` it creates, traced: from `key` (the run's `u32[2]` key), folded
    /// with [`INIT_DOMAIN`] and the leaf's [`leaf_id`](Init::leaf_id); drawn in `f32` and
    /// converted to the leaf's dtype.
    #[track_caller]
    pub(crate) fn trace(&self, key: Tensor, path: &str, ty: &LeafType) -> Tensor {
        use crate::ops::random;
        let dims = &ty.dims;
        let key = || {
            let domain =
                random::fold_in(key, Tensor::full(&[], f64::from(INIT_DOMAIN), DType::U32));
            random::fold_in(
                domain,
                Tensor::full(&[], f64::from(Init::leaf_id(path)), DType::U32),
            )
        };
        let normal = |mean: f64, std: f64| random::normal(key(), dims) * std + mean;
        let uniform = |low: f64, high: f64| random::uniform(key(), dims, DType::F32, low, high);
        let drawn = match self.draw(dims) {
            Draw::Full(c) => return Tensor::full(dims, c, ty.dtype),
            Draw::Normal { mean, std } => normal(mean, std),
            Draw::Uniform { low, high } => uniform(low, high),
        };
        match ty.dtype {
            DType::F32 => drawn,
            other => drawn.convert(other),
        }
    }
}

/// What a rule draws for one leaf.
enum Draw {
    /// Every element this value.
    Full(f64),
    /// Normal draws.
    Normal { mean: f64, std: f64 },
    /// Uniform draws in `[low, high)`.
    Uniform { low: f64, high: f64 },
}
