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

use crate::tree::{Array, DType};

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
