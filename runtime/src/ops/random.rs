//! A counter-based random number generator in the graph: Threefry-2x32 (20 rounds), and
//! `jax.random`'s default algorithms on top of it, bit for bit (`jax==0.10.2`, whose
//! `jax_threefry_partitionable` is on). The same key gives the same bits in the interpreter, on
//! XLA and in JAX (`runtime/tests/goldens/random.safetensors`).
//!
//! A key is a `u32[2]` tensor — typically a Device input the training handle advances each
//! step, so a new key never recompiles. Everything here is built from `u32` element-wise ops
//! (`add xor or shift_left shift_right_logical`, `iota`, `bitcast_convert`), so it needs no op
//! of its own, emits plain StableHLO and has no gradient (the samples are constants to
//! autodiff; gradients flow through what they are combined with, as in dropout).
//!
//! - [`threefry2x32`]: the block function on counter pairs; [`threefry2x32_rows`] with a key
//!   per row.
//! - [`bits`]: element `i` (row-major) is `y0 ^ y1` of `block(key, (0, i))` (tensors of up to
//!   2³² elements).
//! - [`split`]: key `i` of `n` is `block(key, (0, i))`; [`fold_in`]`(key, d)` is
//!   `block(key, (0, d))` — so `fold_in(key, i) == split(key, n)[i]`.
//! - [`uniform`]: 23 random mantissa bits under the exponent of 1.0, minus 1, scaled to
//!   `[lo, hi)` and raised to at least `lo`.
//! - [`normal`]: `√2 · erf_inv(u)` for `u` uniform in `(−1, 1)`.
//! - [`bernoulli`]: `uniform < p`.
//! - [`key`]: JAX's `PRNGKey(seed)` on the host: `[0, seed mod 2³²]`.

use std::panic::Location;

use super::elementwise::kernels::{float_binary, Float};
use super::scan::Scan;
use crate::trace::record::{with_recording, Tensor};
use crate::tree::{Array, DType, LeafType};

const ROTATIONS: [[u32; 4]; 2] = [[13, 15, 26, 6], [17, 29, 16, 24]];
const PARITY: u32 = 0x1BD1_1BDA;

/// The key JAX's `jax.random.PRNGKey(seed)` makes, as a host array: `u32[2]` holding
/// `[seed >> 32, seed mod 2³²]` — `[0, seed]` for a seed below 2³², as JAX's default 32-bit
/// mode gives; larger seeds as JAX's 64-bit mode.
///
/// ```
/// assert_eq!(nitro::trace::random::key(42).as_slice::<u32>()?, &[0, 42]);
/// # Ok::<(), nitro::Error>(())
/// ```
pub fn key(seed: u64) -> Array {
    Array::from_vec(&[2], vec![(seed >> 32) as u32, seed as u32])
        .unwrap_or_else(|_| Array::scalar(0u32))
}

/// The Threefry-2x32 block function on the host (20 rounds): what [`threefry2x32`] computes
/// per element.
///
/// ```
/// // Random123's known answer.
/// let y = nitro::trace::random::threefry2x32_host([0x13198a2e, 0x03707344], [0x243f6a88, 0x85a308d3]);
/// assert_eq!(y, [0xc4923a9c, 0x483df7a0]);
/// ```
pub fn threefry2x32_host(key: [u32; 2], counter: [u32; 2]) -> [u32; 2] {
    let ks = [key[0], key[1], key[0] ^ key[1] ^ PARITY];
    let (mut x0, mut x1) = (
        counter[0].wrapping_add(ks[0]),
        counter[1].wrapping_add(ks[1]),
    );
    for g in 0..5 {
        for &r in &ROTATIONS[g % 2] {
            x0 = x0.wrapping_add(x1);
            x1 = x1.rotate_left(r);
            x1 ^= x0;
        }
        x0 = x0.wrapping_add(ks[(g + 1) % 3]);
        x1 = x1.wrapping_add(ks[(g + 2) % 3]).wrapping_add(g as u32 + 1);
    }
    [x0, x1]
}

/// [`fold_in`] on the host: `block(key, (0, data))`, the key a traced `fold_in(key, data)`
/// gives.
///
/// ```
/// use nitro::trace::random::{fold_in_host, threefry2x32_host};
/// assert_eq!(fold_in_host([0, 42], 7), threefry2x32_host([0, 42], [0, 7]));
/// ```
pub fn fold_in_host(key: [u32; 2], data: u32) -> [u32; 2] {
    threefry2x32_host(key, [0, data])
}

/// [`key`] as the two words [`threefry2x32_host`] takes: `[seed >> 32, seed mod 2³²]`.
pub fn key_host(seed: u64) -> [u32; 2] {
    [(seed >> 32) as u32, seed as u32]
}

/// [`bits`] on the host: `n` words, element `i` being `y0 ^ y1` of `block(key, (0, i))` — the
/// same bits a traced draw of `n` elements gives, on every backend. `None` past 2³² elements
/// (where the traced draw is refused too).
pub fn bits_host(key: [u32; 2], n: usize) -> Option<Vec<u32>> {
    if n as u64 > 1 << 32 {
        return None;
    }
    Some(
        (0..n)
            .map(|i| {
                let [y0, y1] = threefry2x32_host(key, [0, i as u32]);
                y0 ^ y1
            })
            .collect(),
    )
}

/// A float in `[1, 2)` minus 1: the 23 high bits of `b` under the exponent of 1.0.
fn unit_host(b: u32) -> f32 {
    f32::from_bits((b >> 9) | 0x3F80_0000) - 1.0
}

/// [`uniform`] on the host, for `f32`: `n` draws in `[lo, hi)` from `key`, computed as XLA
/// computes the traced draw — the scale and the shift as one fused multiply-add, as XLA's
/// compilers contract them (and so JAX's samples) — so they are XLA's bit for bit. The
/// interpreter rounds the product and the sum apart, so its samples of a range other than
/// `[0, 1)` can differ from these by one rounding of the sum (at most an ulp of `max(|lo|,
/// |hi|)`). `None` past 2³² elements.
pub fn uniform_host(key: [u32; 2], n: usize, lo: f64, hi: f64) -> Option<Vec<f32>> {
    let (lo32, hi32) = (lo as f32, hi as f32);
    let span = hi32 - lo32;
    let max = |a: f32, b: f32| float_binary(a, b, crate::trace::ir::BinaryOp::Max);
    Some(
        bits_host(key, n)?
            .into_iter()
            .map(|b| max(unit_host(b).mul_add(span, lo32), lo32))
            .collect(),
    )
}

/// [`normal`] on the host: `n` standard normal `f32` draws from `key`, `√2 · erf_inv(u)` as
/// the traced draw computes them, with the interpreter's `erf_inv` (Giles' approximation, as
/// XLA expands it). The uniform `u` is the same on every backend (its scale is 2, so no
/// rounding differs); `erf_inv` takes a `log1p`, which each backend computes with its own math
/// library (the interpreter's and these with the platform's `log1pf`, XLA's CPU compiler with
/// a polynomial of its own, CUDA with its device library), so draws agree across backends to a
/// few ulps, not bit for bit. `None` past 2³² elements.
pub fn normal_host(key: [u32; 2], n: usize) -> Option<Vec<f32>> {
    let lo = f32::from_bits(0xBF7F_FFFF) as f64;
    let erf_inv = |u: f32| <f32 as Float>::unary(u, crate::trace::ir::UnaryOp::ErfInv);
    Some(
        uniform_host(key, n, lo, 1.0)?
            .into_iter()
            .map(|u| erf_inv(u) * std::f32::consts::SQRT_2)
            .collect(),
    )
}

fn u32_scalar(v: u32) -> Tensor {
    Tensor::constant(Array::scalar(v))
}

/// Records a trace error for a key that is not `u32[2]`; `false` then.
fn check_key(key: Tensor, op: &'static str, at: &Location<'_>) -> bool {
    with_recording(|r| {
        if !r.owns(key, op, at) {
            return false;
        }
        let ty = r.ty_of(key);
        if ty.dtype == DType::U32 && ty.dims == [2] {
            return true;
        }
        r.fail(
            op,
            format!(
                "a key must be u32[2] (from `nitro::trace::random::key(seed)`, `split` or `fold_in`), got {ty}"
            ),
            at,
            ty,
        );
        false
    })
}

/// The two words of a key as scalars.
fn words(key: Tensor) -> (Tensor, Tensor) {
    (
        key.slice(&[0], &[1]).reshape(&[]),
        key.slice(&[1], &[2]).reshape(&[]),
    )
}

/// Draws of at most this many elements are traced as a rolled loop, larger ones unrolled (see
/// [`threefry2x32`]).
pub const ROLLED_UP_TO: usize = 4096;

/// The Threefry-2x32 block function (20 rounds) of `key` (`u32[2]`) on the counter pairs
/// `(x0, x1)` (`u32` tensors of one shape): the two output words, of that shape.
///
/// Two forms, the same bits, chosen by the draw's size (so by its shape, which the program's
/// key holds):
///
/// - **At most [`ROLLED_UP_TO`] elements** (keys: `split`, `fold_in`, small draws): as JAX
///   lowers it on CPU — the key injection, then a rolled loop ([`Scan`]) of 5 iterations of 4
///   rounds, whose carry also holds the key schedule (rotated each iteration), both rotation
///   sets (swapped each iteration) and the injection count. The loop's body is one function of
///   the emitted program, shared by every draw of its shape (identical bodies are emitted
///   once): 4 rounds of text instead of 20 per draw, which XLA compiles faster.
/// - **Larger draws** (dropout masks, noise): the 20 rounds unrolled. XLA then fuses the whole
///   block function into the ops that use its bits (the mask's compare and multiply), with no
///   pass over memory of its own; in a loop it cannot, and measured on the XLA CPU plugin that
///   made chargpt's training step 1.15× slower (its dropout draws hold up to a million
///   elements) for a gradient program that compiled in 0.87× the time — a compile paid once
///   against a step paid every step. Rolling the small draws only keeps most of that compile
///   gain (0.88–0.98× across runs) at the unrolled step time.
#[track_caller]
pub fn threefry2x32(key: Tensor, x0: Tensor, x1: Tensor) -> (Tensor, Tensor) {
    let at = Location::caller();
    if !check_key(key, "threefry2x32", at) {
        return (x0, x1);
    }
    let dims = x0.dims();
    let (k0, k1) = words(key);
    let k2 = k0.xor(k1).xor(u32_scalar(PARITY));
    let elements = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if elements.is_some_and(|n| n <= ROLLED_UP_TO) {
        return rolled(x0, x1, [k0, k1, k2]);
    }
    unrolled(x0, x1, [k0, k1, k2].map(|k| k.broadcast_to(&dims)))
}

/// [`threefry2x32`] with a key per row: `keys` is `u32[rows, 2]`, `x0` and `x1` are `u32`
/// tensors of one shape whose leading dim is `rows`, and the elements of row `r` go through
/// the block function under key `r` (`keys[r]`). Each element gets exactly the bits
/// [`threefry2x32`] gives it under its row's key alone, so a row's draws do not depend on the
/// other rows (sampling a batch of requests, each with its own stream, uses it). The same two
/// forms, chosen by the element count.
#[track_caller]
pub fn threefry2x32_rows(keys: Tensor, x0: Tensor, x1: Tensor) -> (Tensor, Tensor) {
    let at = Location::caller();
    let ok = with_recording(|r| {
        for t in [keys, x0, x1] {
            if !r.owns(t, "threefry2x32_rows", at) {
                return false;
            }
        }
        let (kt, t0, t1) = (r.ty_of(keys), r.ty_of(x0), r.ty_of(x1));
        let rows = kt.dims.first().copied();
        let fits = kt.dtype == DType::U32
            && kt.dims.len() == 2
            && kt.dims[1] == 2
            && t0.dtype == DType::U32
            && t0 == t1
            && t0.dims.first().copied() == rows;
        if !fits {
            r.fail(
                "threefry2x32_rows",
                format!(
                    "needs keys u32[rows, 2] and two u32 counters of one shape [rows, ...]; got keys {kt}, counters {t0} and {t1}"
                ),
                at,
                t0,
            );
        }
        fits
    });
    if !ok {
        return (x0, x1);
    }
    let dims = x0.dims();
    let rows = dims[0];
    let mut column = vec![1; dims.len()];
    column[0] = rows;
    let word = |w: usize| keys.slice(&[0, w], &[rows, w + 1]).reshape(&column);
    let (k0, k1) = (word(0), word(1));
    let k2 = k0.xor(k1).xor(u32_scalar(PARITY));
    let ks = [k0, k1, k2].map(|k| k.broadcast_to(&dims));
    let elements = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if elements.is_some_and(|n| n <= ROLLED_UP_TO) {
        return rolled(x0, x1, ks);
    }
    unrolled(x0, x1, ks)
}

/// The 20 rounds unrolled (the large draws' form of [`threefry2x32`]), with the key schedule
/// `ks` broadcast to the counters' shape.
fn unrolled(x0: Tensor, x1: Tensor, ks: [Tensor; 3]) -> (Tensor, Tensor) {
    let (mut x0, mut x1) = (x0 + ks[0], x1 + ks[1]);
    for g in 0..5 {
        for &r in &ROTATIONS[g % 2] {
            x0 = x0 + x1;
            let rotated = x1
                .shift_left(u32_scalar(r))
                .or(x1.shift_right_logical(u32_scalar(32 - r)));
            x1 = rotated.xor(x0);
        }
        x0 = x0 + ks[(g + 1) % 3];
        x1 = x1 + ks[(g + 2) % 3] + u32_scalar(g as u32 + 1);
    }
    (x0, x1)
}

/// Threefry as a rolled loop of 5 iterations × 4 rounds (the small draws' form of
/// [`threefry2x32`]), with the key schedule `ks` (scalars, or of the counters' shape).
fn rolled(x0: Tensor, x1: Tensor, ks: [Tensor; 3]) -> (Tensor, Tensor) {
    let [k0, k1, k2] = ks;
    let rotations = |set: [u32; 4]| {
        Tensor::constant(
            Array::from_vec(&[4], set.to_vec()).unwrap_or_else(|_| Array::scalar(0u32)),
        )
    };
    // The schedule starts rotated once: iteration g injects ks[(g + 1) % 3] and ks[(g + 2) % 3].
    let init = [
        x0 + k0,
        x1 + k1,
        k1,
        k2,
        k0,
        rotations(ROTATIONS[0]),
        rotations(ROTATIONS[1]),
        u32_scalar(1),
    ];
    let (out, _) = Scan::new().length(5).run(&init, &[], |c, _| {
        let (mut x0, mut x1) = (c[0], c[1]);
        let (ks, rot, count) = ([c[2], c[3], c[4]], [c[5], c[6]], c[7]);
        for k in 0..4 {
            let r = rot[0].slice(&[k], &[k + 1]).reshape(&[]);
            x0 = x0 + x1;
            let rotated = x1
                .shift_left(r)
                .or(x1.shift_right_logical(u32_scalar(32) - r));
            x1 = rotated.xor(x0);
        }
        x0 = x0 + ks[0];
        x1 = x1 + (ks[1] + count);
        let carry = vec![
            x0,
            x1,
            ks[1],
            ks[2],
            ks[0],
            rot[1],
            rot[0],
            count + u32_scalar(1),
        ];
        (carry, Vec::new())
    });
    match out.as_slice() {
        [y0, y1, ..] => (*y0, *y1),
        _ => (x0, x1),
    }
}

/// The row-major index of every element of `dims`, as `u32`.
fn flat_index(dims: &[usize]) -> Tensor {
    let mut stride = 1usize;
    let mut index: Option<Tensor> = None;
    for d in (0..dims.len()).rev() {
        let term = Tensor::iota(DType::U32, dims, d) * u32_scalar(stride as u32);
        index = Some(match index {
            None => term,
            Some(i) => i + term,
        });
        stride = stride.saturating_mul(dims[d]);
    }
    index.unwrap_or_else(|| Tensor::full(&[], 0.0, DType::U32))
}

fn too_many(dims: &[usize], op: &'static str, at: &Location<'_>) -> bool {
    let n = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d as u64));
    if n.is_some_and(|n| n <= 1 << 32) {
        return false;
    }
    with_recording(|r| {
        r.fail(
            op,
            format!("{dims:?} has more than 2^32 elements; draw in smaller pieces"),
            at,
            LeafType {
                dtype: DType::U32,
                dims: dims.to_vec(),
            },
        )
    });
    true
}

/// `u32` random bits of `dims` from `key`, as `jax.random.bits(key, dims, jnp.uint32)`.
#[track_caller]
pub fn bits(key: Tensor, dims: &[usize]) -> Tensor {
    let at = Location::caller();
    if !check_key(key, "random_bits", at) || too_many(dims, "random_bits", at) {
        return with_recording(|r| {
            r.stand_in(LeafType {
                dtype: DType::U32,
                dims: dims.to_vec(),
            })
        });
    }
    let lo = flat_index(dims);
    let hi = Tensor::full(dims, 0.0, DType::U32);
    let (y0, y1) = threefry2x32(key, hi, lo);
    y0.xor(y1)
}

/// `n` new keys from `key` (`u32[n, 2]`), as `jax.random.split(key, n)`.
#[track_caller]
pub fn split(key: Tensor, n: usize) -> Tensor {
    let at = Location::caller();
    if !check_key(key, "split", at) || too_many(&[n], "split", at) {
        return with_recording(|r| {
            r.stand_in(LeafType {
                dtype: DType::U32,
                dims: vec![n, 2],
            })
        });
    }
    let (y0, y1) = threefry2x32(key, Tensor::full(&[n], 0.0, DType::U32), flat_index(&[n]));
    Tensor::concatenate(&[y0.reshape(&[n, 1]), y1.reshape(&[n, 1])], 1)
}

/// Key `i` of `split(keys, n)` (for `keys` of `u32[n, 2]`), as a `u32[2]` key.
#[track_caller]
pub fn nth(keys: Tensor, i: usize) -> Tensor {
    keys.slice(&[i, 0], &[i + 1, 2]).reshape(&[2])
}

/// A new key from `key` and `data` (a `u32` scalar tensor, e.g. the step), as
/// `jax.random.fold_in(key, data)`.
#[track_caller]
pub fn fold_in(key: Tensor, data: Tensor) -> Tensor {
    let at = Location::caller();
    if !check_key(key, "fold_in", at) {
        return key;
    }
    let d = data.convert(DType::U32).reshape(&[1]);
    let (y0, y1) = threefry2x32(key, Tensor::full(&[1], 0.0, DType::U32), d);
    Tensor::concatenate(&[y0, y1], 0)
}

/// Floats uniform in `[lo, hi)` of `dims` and `dtype` (`f32`; other dtypes are a trace-time
/// error), as `jax.random.uniform(key, dims, dtype, lo, hi)`. On XLA the scale and shift fuse
/// into one multiply-add, as in JAX; the interpreter rounds twice, so samples with a range
/// other than `[0, 1)` can differ from XLA's in the last bit.
#[track_caller]
pub fn uniform(key: Tensor, dims: &[usize], dtype: DType, lo: f64, hi: f64) -> Tensor {
    let at = Location::caller();
    if dtype != DType::F32 {
        return with_recording(|r| {
            r.fail(
                "uniform",
                format!("uniform samples are f32 (got {dtype}); convert them after drawing"),
                at,
                LeafType {
                    dtype,
                    dims: dims.to_vec(),
                },
            )
        });
    }
    let b = bits(key, dims);
    let mantissa = b
        .shift_right_logical(u32_scalar(9))
        .or(u32_scalar(0x3F80_0000));
    let unit = mantissa.bitcast_convert(DType::F32) - 1.0;
    let (lo32, hi32) = (lo as f32, hi as f32);
    let span = (hi32 - lo32) as f64;
    (unit * span + lo32 as f64).maximum(lo32 as f64)
}

/// Standard normal `f32` samples of `dims`, as `jax.random.normal(key, dims)`.
#[track_caller]
pub fn normal(key: Tensor, dims: &[usize]) -> Tensor {
    // The largest f32 below −1's successor toward 0: the open interval (−1, 1).
    let lo = f32::from_bits(0xBF7F_FFFF) as f64;
    let u = uniform(key, dims, DType::F32, lo, 1.0);
    u.erf_inv() * (std::f32::consts::SQRT_2 as f64)
}

/// `bool` samples of `dims`, true with probability `p`, as `jax.random.bernoulli(key, p, dims)`.
#[track_caller]
pub fn bernoulli(key: Tensor, p: f64, dims: &[usize]) -> Tensor {
    uniform(key, dims, DType::F32, 0.0, 1.0).less((p as f32) as f64)
}

// ---- the training handle's step key ------------------------------------------------------------

/// What [`step_key`] gives while a program is traced.
#[derive(Clone, Copy, Debug)]
pub enum StepKey {
    /// Not inside a training handle's program (a program of your own): no key.
    Outside,
    /// A training program of a model that draws random numbers: this step's key.
    Training(Tensor),
    /// An evaluation program: no key (dropout is off).
    Evaluation,
    /// A training or evaluation program of a model whose `Model::RANDOM` is false (named by
    /// its type path): drawing is a trace-time error.
    Unkeyed(&'static str),
}

thread_local! {
    static STEP_KEY: std::cell::Cell<(StepKey, u32)> = const { std::cell::Cell::new((StepKey::Outside, 0)) };
}

/// Runs `f` with `state` as what [`step_key`] sees (the training handle's programs do this
/// around `Model::loss`), restoring the previous state after — on every exit, a panic in `f`
/// included (a panicking model's key never leaks into the thread's later traces).
pub fn with_step_key<R>(state: StepKey, f: impl FnOnce() -> R) -> R {
    /// Puts the state it holds back when dropped, on return and on unwind alike.
    struct Restore((StepKey, u32));
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0;
            STEP_KEY.with(|k| k.set(before));
        }
    }
    let _restore = Restore(STEP_KEY.with(|k| k.replace((state, 0))));
    f()
}

/// What [`step_key`] sees now.
pub(crate) fn step_key_state() -> StepKey {
    STEP_KEY.with(|k| k.get().0)
}

/// The key of the training step being traced — a `u32[2]` program input the handle advances
/// every step — or `None` in an evaluation program and outside the handle's programs. In a
/// program of a model whose `Model::RANDOM` is false it records a trace-time error saying to
/// set it.
#[track_caller]
pub fn step_key() -> Option<Tensor> {
    let at = Location::caller();
    match STEP_KEY.with(|k| k.get().0) {
        StepKey::Training(key) => Some(key),
        StepKey::Outside | StepKey::Evaluation => None,
        StepKey::Unkeyed(model) => {
            with_recording(|r| {
                r.fail(
                    "step_key",
                    format!(
                        "`{model}` draws random numbers, but its `Model::RANDOM` is false, so its \
                         programs take no key; add `const RANDOM: bool = true;` to its `impl Model`"
                    ),
                    at,
                    LeafType {
                        dtype: DType::U32,
                        dims: vec![2],
                    },
                )
            });
            None
        }
    }
}

/// A fresh key for each call within one traced step: `fold_in(step_key, n)` for the `n`-th
/// call (0, 1, 2, … in the order the model's code runs, which tracing makes deterministic), so
/// two dropout layers never share a mask. `None` where [`step_key`] is.
#[track_caller]
pub fn next_step_key() -> Option<Tensor> {
    let key = step_key()?;
    let n = STEP_KEY.with(|k| {
        let (state, n) = k.get();
        k.set((state, n + 1));
        n
    });
    Some(fold_in(key, Tensor::constant(Array::scalar(n))))
}
