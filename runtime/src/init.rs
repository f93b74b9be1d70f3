//! Seeded, reproducible parameter initializers.
//!
//! Every initializer draws from [`Rng`], a SplitMix64 generator seeded with a [`Seed`]: the same
//! seed gives the same numbers on every platform, in every process and in every version of
//! nitro (golden values in the tests pin the stream). Normal draws use the Box–Muller transform.
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

use crate::trace::Tensor;
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
/// The fans of the scaled initializers are the leaf's last two dims, `[.., fan_in, fan_out]`
/// (a `Linear`'s `[inputs, outputs]`; leading dims are stacked copies, as a scanned stack's
/// `[layers, inputs, outputs]`); a leaf of one dim has both fans equal to it.
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

    /// `(fan_in, fan_out)` of a leaf of `dims`: its last two dims, or its one dim twice.
    fn fans(dims: &[usize]) -> (f64, f64) {
        match dims {
            [] => (1.0, 1.0),
            [n] => (*n as f64, *n as f64),
            [.., i, o] => (*i as f64, *o as f64),
        }
    }

    /// The leaf of type `ty` it creates, traced: from `key` (the run's `u32[2]` key), folded
    /// with [`INIT_DOMAIN`] and the leaf's [`leaf_id`](Init::leaf_id); drawn in `f32` and
    /// converted to the leaf's dtype.
    #[track_caller]
    pub(crate) fn trace(&self, key: Tensor, path: &str, ty: &LeafType) -> Tensor {
        use crate::trace::random;
        let (fan_in, fan_out) = Init::fans(&ty.dims);
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
        let drawn = match *self {
            Init::Zeros => return Tensor::full(dims, 0.0, ty.dtype),
            Init::Ones => return Tensor::full(dims, 1.0, ty.dtype),
            Init::Constant(c) => return Tensor::full(dims, c, ty.dtype),
            Init::Normal { mean, std } => normal(mean, std),
            Init::Uniform { low, high } => uniform(low, high),
            Init::GlorotUniform => {
                let limit = (6.0 / (fan_in + fan_out).max(1.0)).sqrt();
                uniform(-limit, limit)
            }
            Init::GlorotNormal => normal(0.0, (2.0 / (fan_in + fan_out).max(1.0)).sqrt()),
            Init::HeNormal => normal(0.0, (2.0 / fan_in.max(1.0)).sqrt()),
            Init::HeUniform => {
                let limit = (6.0 / fan_in.max(1.0)).sqrt();
                uniform(-limit, limit)
            }
        };
        match ty.dtype {
            DType::F32 => drawn,
            other => drawn.convert(other),
        }
    }
}
