//! Sampling on the device: one token id per row from a batch of logits, with every setting —
//! temperature, top-k, top-p — a traced per-row input, so a new setting is new data for the
//! same compiled program, never a new program; and the randomness drawn from a Threefry stream
//! per row, so a row's token depends on its own logits, settings and key only, never on the
//! other rows of the batch.
//!
//! # What a row's token is
//!
//! With the row's logits `x` (computed in `f32` whatever their dtype), its temperature `T`,
//! top-k `k` and top-p `p`:
//!
//! 1. **Greedy** (`T = 0`, and any `T` that is not `> 0`, NaN included): the index of the
//!    largest logit, the first one on ties (as [`Tensor::argmax`]). No randomness.
//! 2. Otherwise the scaled logits `z = (x − max x) / T` (the shift changes no probability and
//!    keeps `z ≤ 0`, so a tiny `T` gives `−∞`, never `∞ − ∞`).
//! 3. **Top-k** (`k > 0`; `0` is off, and `k` is clamped to the declared `max_k`): the tokens
//!    whose `z` is at least the `k`-th largest `z` (counted with repeats) are kept — all of
//!    them where several tie at the `k`-th value, so a tie can keep more than `k`.
//! 4. **Top-p** (`p < 1`; `1` is off): among what top-k kept, with `q = softmax(z)` over it,
//!    the smallest set of most likely tokens whose probability reaches `p` — every token whose
//!    `z` is at least the largest threshold `t` with `Σ q[z ≥ t] ≥ p`, ties at `t` kept. The
//!    most likely token is always kept, even for a `p` below its probability.
//! 5. **The draw** (Gumbel-max): the argmax of `z` over the kept tokens (the others `−∞`) plus
//!    Gumbel noise `−log(−log u)`, where `u` is the row's `jax.random.uniform(key, (vocab,),
//!    minval=tiny, maxval=1)` — `tiny` being `f32`'s smallest normal — from the row's key. This
//!    is how `jax.random.categorical(key, z)` draws for the row (`jax.vmap` over rows, each with
//!    its key): the same uniforms bit for bit, the same token unless the logarithms' last bits
//!    decide a near-tie. It picks token `i` with probability `softmax(z)[i]`.
//!
//! # Finding the thresholds without sorting
//!
//! nitro has no sort op, and top-k and top-p only need one threshold per row, so each is
//! found by **bisection on the bits** of `z`. `z` is mapped to `u32` keys whose unsigned order
//! is the float order (a negative float's bits inverted, a positive float's sign bit set), and
//! the threshold is built from the top bit down: 32 steps, each trying the threshold with one
//! more bit set and keeping the bit where the predicate still holds — for top-k "at least `k`
//! keys are ≥ it", for top-p "the kept mass at or above it reaches `p` of the total". Both
//! predicates only weaken as the threshold rises, so this finds the largest threshold for which
//! they hold: exactly the `k`-th largest value for top-k (an integer count, so the same on
//! every backend), and the top-p cut.
//!
//! Why bisection rather than `max_k` rounds of max-and-mask: its cost does not grow with
//! `max_k` (32 steps whether `max_k` is 8 or 1000), it is exact for ties, and one loop shape
//! serves top-k and top-p alike. Each search is a [`Scan`] of length 32 whose body is a
//! compare and a row reduction over `[rows, vocab]`, so the program holds one small loop body
//! per search rather than 32 unrolled copies.
//!
//! **Cost per row**, in passes over the vocabulary: 32 for top-k (a compare and an integer
//! count; none when `max_k` is 0 — the loop is not traced), 32 for top-p (a compare, a select
//! and a sum), and one each for the max, the scaling, the exponentials, the masks, the two
//! argmaxes and the noise. The noise is the largest single term: Threefry's 20 rounds (about
//! 120 `u32` operations) and two logarithms per element. All told about
//! `vocab × (64 small passes + the Threefry block)` per row: for a 50k vocabulary and 32 rows,
//! on the order of 10⁹ simple operations per decode step. Measured on the XLA CPU plugin (a
//! shared 2-core machine; top-k 40 of `max_k` 64, top-p 0.9): 32 rows of a 65-token vocabulary
//! (chargpt) take about 0.25 ms a call; one row of 50 257 (GPT-2) about 4 ms; 32 rows of 50 257
//! 37–60 ms, of which the noise and its argmax are about 10 ms, each search about 12 ms (32
//! passes over 6.4 MB), and a bare argmax 3.3 ms. A GPU reads those passes at its memory
//! bandwidth.
//!
//! # Randomness and reproducibility
//!
//! A row's key is a `u32[2]` Threefry key of its own (`keys[r]`), as `jax.random` keys are.
//! Element `i` of row `r`'s noise is `block(keys[r], (0, i))` — the bits
//! `jax.random.bits(keys[r], (vocab,))` gives — so a row's draws equal
//! `jax.random.uniform(keys[r], (vocab,), minval=tiny, maxval=1)` bit for bit (on both backends)
//! whatever the other rows hold. A request's stream is its seed's key ([`Sampling::key`],
//! `jax.random.PRNGKey(seed)`) with the token's position folded in ([`fold_in_rows`]), so the
//! same seed gives the same text in any batch.
//!
//! **Interpreter and XLA** give the same bits, the same top-k thresholds and the same kept sets
//! whenever the arithmetic is exact: the noise takes two logarithms and top-p sums
//! exponentials, which each backend computes with its own math library (and sums in its own
//! order), so a token can differ only where two noisy scores, or a row's cumulative mass and
//! its `p`, lie within a few ulps of each other — about one draw in millions. The tests check
//! that both backends pick the same tokens.

use std::panic::Location;

use crate::error::{Error, Result};
use crate::ops::random::{key_host, threefry2x32_rows};
use crate::ops::scan::Scan;
use crate::trace::record::{with_recording, Tensor};
use crate::tree::{Array, DType, LeafType};

/// The number of bisection steps of a threshold search: one per bit of a `u32` key.
const STEPS: usize = 32;

/// Per-row sampling settings as traced tensors, each of shape `[rows]` (row `r` is the row of
/// the logits [`sample`] draws from). Program inputs, so any value is the same program.
#[derive(Clone, Copy, Debug)]
pub struct SampleParams {
    /// `f32 [rows]`: the temperature; `0` (or anything not `> 0`) is greedy.
    pub temperature: Tensor,
    /// `i32 [rows]`: keep the `k` most likely tokens (ties at the `k`-th kept); `0` (or
    /// anything not `> 0`) is off; clamped to the `max_k` [`sample`] is traced with.
    pub top_k: Tensor,
    /// `f32 [rows]`: keep the smallest set of most likely tokens whose probability reaches it;
    /// `1` (or more, or NaN) is off.
    pub top_p: Tensor,
}

/// One request's sampling settings, on the host: what a caller (or the server) asks for. Check
/// them with [`Sampling::check`] before use; [`SampleArrays::new`] checks every row.
///
/// ```
/// use nitro::generate::sample::Sampling;
/// let s = Sampling::greedy().temperature(0.8).top_k(40).top_p(0.95).seed(7);
/// s.check(64)?;
/// assert!(s.top_k(65).check(64).is_err()); // past the declared maximum
/// # Ok::<(), nitro::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Sampling {
    /// Finite and at least 0; `0` is greedy (the most likely token, no randomness).
    pub temperature: f32,
    /// `0` is off; otherwise the number of most likely tokens kept, at most the generator's
    /// declared maximum.
    pub top_k: u32,
    /// In `(0, 1]`; `1` is off.
    pub top_p: f32,
    /// The request's random stream: its key is `jax.random.PRNGKey(seed)` ([`Sampling::key`]).
    pub seed: u64,
}

impl Default for Sampling {
    /// [`Sampling::greedy`].
    fn default() -> Sampling {
        Sampling::greedy()
    }
}

impl Sampling {
    /// Greedy decoding: temperature 0, top-k and top-p off, seed 0.
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// With this temperature.
    pub fn temperature(self, temperature: f32) -> Sampling {
        Sampling {
            temperature,
            ..self
        }
    }

    /// With this top-k (`0` is off).
    pub fn top_k(self, top_k: u32) -> Sampling {
        Sampling { top_k, ..self }
    }

    /// With this top-p (`1` is off).
    pub fn top_p(self, top_p: f32) -> Sampling {
        Sampling { top_p, ..self }
    }

    /// With this seed.
    pub fn seed(self, seed: u64) -> Sampling {
        Sampling { seed, ..self }
    }

    /// The request's key: `jax.random.PRNGKey(seed)` as two words (see
    /// [`key_host`]).
    pub fn key(&self) -> [u32; 2] {
        key_host(self.seed)
    }

    /// Whether these settings can be served by a generator whose top-k is at most `max_k`:
    /// the temperature finite and at least 0, top-p in `(0, 1]`, top-k at most `max_k`. The
    /// error is [`Error::InvalidRequest`] naming the field (`temperature`, `top_p`, `top_k`)
    /// and what it accepts.
    pub fn check(&self, max_k: usize) -> Result<()> {
        let bad = |field: &'static str, why: String| Err(Error::InvalidRequest { field, why });
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return bad(
                "temperature",
                format!("is {t}; it must be a finite number at least 0 (0 is greedy)"),
            );
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return bad("top_p", format!("is {p}; it must be in (0, 1] (1 is off)"));
        }
        if self.top_k as u64 > max_k as u64 {
            return bad(
                "top_k",
                format!(
                    "is {}; this generator serves at most {max_k} (0 is off)",
                    self.top_k
                ),
            );
        }
        Ok(())
    }
}

/// The host arrays of a batch's sampling inputs, row `r` from request `r`: what a program
/// calling [`sample`] takes as inputs.
#[derive(Clone, Debug)]
pub struct SampleArrays {
    /// `f32 [rows]`.
    pub temperature: Array,
    /// `i32 [rows]`.
    pub top_k: Array,
    /// `f32 [rows]`.
    pub top_p: Array,
    /// `u32 [rows, 2]`: each request's [`Sampling::key`] (fold a position into it on the
    /// device with [`fold_in_rows`] for a fresh draw per token).
    pub keys: Array,
}

impl SampleArrays {
    /// The arrays of `settings`, one row each, after [`Sampling::check`]ing each against
    /// `max_k` (the first refusal is returned).
    pub fn new(settings: &[Sampling], max_k: usize) -> Result<SampleArrays> {
        for s in settings {
            s.check(max_k)?;
        }
        let rows = settings.len();
        let column = |f: &dyn Fn(&Sampling) -> f32| settings.iter().map(f).collect::<Vec<f32>>();
        let keys: Vec<u32> = settings.iter().flat_map(|s| s.key()).collect();
        let top_k: Vec<i32> = settings
            .iter()
            .map(|s| s.top_k.min(i32::MAX as u32) as i32)
            .collect();
        Ok(SampleArrays {
            temperature: Array::from_vec(&[rows], column(&|s| s.temperature))?,
            top_k: Array::from_vec(&[rows], top_k)?,
            top_p: Array::from_vec(&[rows], column(&|s| s.top_p))?,
            keys: Array::from_vec(&[rows, 2], keys)?,
        })
    }
}

/// One input's type check: its name, the tensor, what types it accepts, and that in words.
type Check<'a> = (&'a str, Tensor, &'a dyn Fn(&LeafType) -> bool, &'a str);

/// Records a trace error for `op` unless every tensor of `checks` belongs to this trace and has
/// the type its predicate accepts. `false` after an error.
fn check_types(op: &'static str, at: &Location<'_>, checks: &[Check<'_>]) -> bool {
    with_recording(|r| {
        for &(_, t, _, _) in checks {
            if !r.owns(t, op, at) {
                return false;
            }
        }
        for &(name, t, fits, what) in checks {
            let ty = r.ty_of(t);
            if !fits(&ty) {
                r.fail(op, format!("`{name}` must be {what}; got {ty}"), at, ty);
                return false;
            }
        }
        true
    })
}

fn stand_in(dtype: DType, dims: &[usize]) -> Tensor {
    with_recording(|r| {
        r.stand_in(LeafType {
            dtype,
            dims: dims.to_vec(),
        })
    })
}

/// The rows of a `[rows, ...]` tensor (0 for a scalar).
fn rows_of(t: &LeafType) -> usize {
    t.dims.first().copied().unwrap_or(0)
}

/// Per-row [`fold_in`](crate::trace::random::fold_in): row `r` of the result is
/// `jax.random.fold_in(keys[r], data[r])` — `keys` is `u32 [rows, 2]`, `data` an integer
/// tensor `[rows]` (converted to `u32`: a position, a step), the result `u32 [rows, 2]`. Each
/// row's key depends on its own key and datum only.
///
/// ```
/// use nitro::backend::interp;
/// use nitro::generate::sample::fold_in_rows;
/// use nitro::trace::{random, trace};
/// use nitro::{Array, DType, LeafType};
///
/// let keys = LeafType { dtype: DType::U32, dims: vec![2, 2] };
/// let data = LeafType { dtype: DType::I32, dims: vec![2] };
/// let g = trace(&[("k".into(), keys), ("d".into(), data)], |i| vec![fold_in_rows(i[0], i[1])])?;
/// let out = interp::run(
///     &g,
///     &[Array::from_vec(&[2, 2], vec![0u32, 42, 0, 7])?, Array::from_vec(&[2], vec![3i32, 5])?],
/// )?;
/// let want: Vec<u32> = [random::fold_in_host([0, 42], 3), random::fold_in_host([0, 7], 5)].concat();
/// assert_eq!(out[0].as_slice::<u32>()?, &want[..]);
/// # Ok::<(), nitro::Error>(())
/// ```
#[track_caller]
pub fn fold_in_rows(keys: Tensor, data: Tensor) -> Tensor {
    let at = Location::caller();
    let rows = rows_of(&keys.ty());
    let ok = check_types(
        "fold_in_rows",
        at,
        &[
            (
                "keys",
                keys,
                &|t| t.dtype == DType::U32 && t.dims.len() == 2 && t.dims[1] == 2,
                "u32[rows, 2]",
            ),
            (
                "data",
                data,
                &|t| !t.dtype.is_float() && t.dtype != DType::Bool && t.dims == [rows],
                "an integer tensor [rows] (as many as the keys)",
            ),
        ],
    );
    if !ok {
        return stand_in(DType::U32, &[rows, 2]);
    }
    let d = data.convert(DType::U32);
    let (y0, y1) = threefry2x32_rows(keys, Tensor::full(&[rows], 0.0, DType::U32), d);
    Tensor::concatenate(&[y0.reshape(&[rows, 1]), y1.reshape(&[rows, 1])], 1)
}

/// `f32` draws uniform in `[lo, hi)`, `n` per row (`[rows, n]`): row `r` is
/// `jax.random.uniform(keys[r], (n,), minval=lo, maxval=hi)` — the same bits as
/// [`random::uniform`](crate::trace::random::uniform) under that key alone, with its rounding
/// (see there). `keys` is `u32 [rows, 2]`; `n` at most 2³².
#[track_caller]
pub fn uniform_rows(keys: Tensor, n: usize, lo: f64, hi: f64) -> Tensor {
    let at = Location::caller();
    let rows = rows_of(&keys.ty());
    let ok = check_types(
        "uniform_rows",
        at,
        &[(
            "keys",
            keys,
            &|t| t.dtype == DType::U32 && t.dims.len() == 2 && t.dims[1] == 2,
            "u32[rows, 2]",
        )],
    );
    if !ok {
        return stand_in(DType::F32, &[rows, n]);
    }
    if n as u64 > 1 << 32 {
        return with_recording(|r| {
            r.fail(
                "uniform_rows",
                format!("{n} draws per row is more than 2^32; draw in smaller pieces"),
                at,
                LeafType {
                    dtype: DType::F32,
                    dims: vec![rows, n],
                },
            )
        });
    }
    let dims = [rows, n];
    let counter = Tensor::iota(DType::U32, &dims, 1);
    let (y0, y1) = threefry2x32_rows(keys, Tensor::full(&dims, 0.0, DType::U32), counter);
    let bits = y0.xor(y1);
    let mantissa = bits
        .shift_right_logical(Tensor::scalar(9.0, DType::U32))
        .or(Tensor::scalar(f64::from(0x3F80_0000u32), DType::U32));
    let unit = mantissa.bitcast_convert(DType::F32) - 1.0;
    let (lo32, hi32) = (lo as f32, hi as f32);
    let span = f64::from(hi32 - lo32);
    (unit * span + f64::from(lo32)).maximum(f64::from(lo32))
}

/// Standard Gumbel noise, `n` draws per row (`f32 [rows, n]`): row `r` is
/// `jax.random.gumbel(keys[r], (n,))`, `−log(−log u)` for `u` from [`uniform_rows`] in
/// `[tiny, 1)` (`tiny` = `f32::MIN_POSITIVE`). The uniforms are the same bits on every backend;
/// the logarithms are each backend's own (a few ulps apart).
#[track_caller]
pub fn gumbel_rows(keys: Tensor, n: usize) -> Tensor {
    let u = uniform_rows(keys, n, f64::from(f32::MIN_POSITIVE), 1.0);
    -((-(u.log())).log())
}

/// A `u32` key per element whose unsigned order is the float order of `z` (`f32`): a negative
/// float's bits inverted, a non-negative float's with the sign bit set. (`−0` sorts just below
/// `+0`; NaNs sort outside the infinities.)
fn ordered(z: Tensor) -> Tensor {
    let b = z.bitcast_convert(DType::U32);
    let sign = f64::from(0x8000_0000u32);
    Tensor::select(b.greater_equal(sign), !b, b.or(sign))
}

/// The largest `u32` threshold `t` (per row, `[rows]`) for which `holds(t)` is true, by
/// bisection from the top bit down, for a predicate that only turns false as `t` grows;
/// 0 where it never holds above 0. `holds` takes a `[rows, 1]` candidate and returns
/// `bool [rows]`.
fn largest_threshold(rows: usize, holds: impl Fn(Tensor) -> Tensor) -> Tensor {
    let bits: Vec<u32> = (0..STEPS).map(|s| 1u32 << (STEPS - 1 - s)).collect();
    let bits =
        Tensor::constant(Array::from_vec(&[STEPS], bits).unwrap_or_else(|_| Array::scalar(0u32)));
    let start = Tensor::full(&[rows], 0.0, DType::U32);
    let (carry, _) = Scan::new().run(&[start], &[bits], |c, x| {
        let candidate = c[0].or(x[0]);
        let ok = holds(candidate.reshape(&[rows, 1]));
        (vec![Tensor::select(ok, candidate, c[0])], Vec::new())
    });
    carry.first().copied().unwrap_or(start)
}

/// One token id per row (`i32 [rows]`) drawn from `logits` (`[rows, vocab]`, any float dtype,
/// computed in `f32`) with each row's settings (`params`, each `[rows]`) and key (`keys`, `u32
/// [rows, 2]`) — greedy, temperature, top-k (clamped to `max_k`) and top-p, as the
/// [module](self) describes, by Gumbel-max. `max_k` shapes the program (it is the top-k search's
/// clamp, and `0` leaves the search out); every other setting is data.
///
/// Wrong types (logits that are not a float matrix, keys not `u32 [rows, 2]`, settings not
/// `[rows]` of their dtypes) fail the trace naming `sample` and the caller's line.
///
/// ```
/// use nitro::backend::interp;
/// use nitro::generate::sample::{sample, SampleArrays, SampleParams, Sampling};
/// use nitro::trace::trace;
/// use nitro::{Array, DType, LeafType};
///
/// let ty = |dtype, dims: &[usize]| LeafType { dtype, dims: dims.to_vec() };
/// let inputs = [
///     ("logits".into(), ty(DType::F32, &[2, 4])),
///     ("keys".into(), ty(DType::U32, &[2, 2])),
///     ("temperature".into(), ty(DType::F32, &[2])),
///     ("top_k".into(), ty(DType::I32, &[2])),
///     ("top_p".into(), ty(DType::F32, &[2])),
/// ];
/// let g = trace(&inputs, |i| {
///     let params = SampleParams { temperature: i[2], top_k: i[3], top_p: i[4] };
///     vec![sample(i[0], i[1], &params, 8)]
/// })?;
/// // Row 0 greedy; row 1 hot, but top-k 1 leaves only the most likely token.
/// let a = SampleArrays::new(&[Sampling::greedy(), Sampling::greedy().temperature(2.0).top_k(1)], 8)?;
/// let logits = Array::from_vec(&[2, 4], vec![0.1f32, 3.0, 0.2, 0.3, 1.0, 0.0, 0.5, 2.0])?;
/// let out = interp::run(&g, &[logits, a.keys, a.temperature, a.top_k, a.top_p])?;
/// assert_eq!(out[0].as_slice::<i32>()?, &[1, 3]);
/// # Ok::<(), nitro::Error>(())
/// ```
#[track_caller]
pub fn sample(logits: Tensor, keys: Tensor, params: &SampleParams, max_k: usize) -> Tensor {
    let at = Location::caller();
    let lt = logits.ty();
    let rows = rows_of(&lt);
    let vocab = lt.dims.get(1).copied().unwrap_or(0);
    let row_of = |dtype: DType| move |t: &LeafType| t.dtype == dtype && t.dims == [rows];
    let (is_f32_row, is_i32_row) = (row_of(DType::F32), row_of(DType::I32));
    let ok = check_types(
        "sample",
        at,
        &[
            (
                "logits",
                logits,
                &|t| t.dtype.is_float() && t.dims.len() == 2 && t.dims[1] > 0,
                "a float matrix [rows, vocab] with vocab > 0",
            ),
            (
                "keys",
                keys,
                &|t| t.dtype == DType::U32 && t.dims == [rows, 2],
                "u32[rows, 2] (a key per row of the logits)",
            ),
            (
                "temperature",
                params.temperature,
                &is_f32_row,
                "f32[rows] (a value per row of the logits)",
            ),
            (
                "top_k",
                params.top_k,
                &is_i32_row,
                "i32[rows] (a value per row of the logits)",
            ),
            (
                "top_p",
                params.top_p,
                &is_f32_row,
                "f32[rows] (a value per row of the logits)",
            ),
        ],
    );
    if !ok {
        return stand_in(DType::I32, &[rows]);
    }

    let x = logits.convert(DType::F32);
    let greedy = x.argmax(1);
    let column = |t: Tensor| t.reshape(&[rows, 1]);
    let hot = params.temperature.greater(0.0);
    let temperature = Tensor::select(hot, params.temperature, 1.0);
    let z = (x - x.max_keep(&[1])) / column(temperature);
    let key = ordered(z);

    // Top-k: the k-th largest key (0, keeping everything, where off).
    let top_k_cut = if max_k > 0 {
        let k = Tensor::clamp(0.0, params.top_k, max_k.min(i32::MAX as usize) as f64);
        let cut = largest_threshold(rows, |t| {
            key.greater_equal(t)
                .convert(DType::I32)
                .sum(&[1])
                .greater_equal(k)
        });
        Tensor::select(k.greater(0.0), cut, 0.0)
    } else {
        Tensor::full(&[rows], 0.0, DType::U32)
    };
    let kept_k = key.greater_equal(column(top_k_cut));

    // Top-p over what top-k kept, in unnormalised mass: Σ e[key ≥ t] ≥ p · Σ e.
    let mass = Tensor::select(kept_k, z.exp(), 0.0);
    let target = params.top_p * mass.sum(&[1]);
    let top_p_cut = largest_threshold(rows, |t| {
        Tensor::select(key.greater_equal(t), mass, 0.0)
            .sum(&[1])
            .greater_equal(target)
    });
    let top_p_cut = Tensor::select(params.top_p.less(1.0), top_p_cut, 0.0);
    // The most likely token is always kept, whatever p (0 included) asks.
    let cut = top_k_cut.maximum(top_p_cut).minimum(key.max(&[1]));

    let kept = key.greater_equal(column(cut));
    let filtered = Tensor::select(kept, z, f64::NEG_INFINITY);
    let drawn = (filtered + gumbel_rows(keys, vocab)).argmax(1);
    Tensor::select(hot, drawn, greedy)
}
