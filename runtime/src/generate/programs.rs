//! The generator's programs: a prefill per prompt-length bucket, writing one slot's rows of the
//! KV cache and drawing the slot's first token, and a decode chunk per declared size, running
//! that many steps of every slot as one loop on the device with the stop check inside. Both
//! take the cache donated, so it is updated in place and never exists twice.

use std::cell::RefCell;

use super::sample::{self, SampleParams};
use super::Decoder;
use crate::program::Program;
use crate::trace::Tensor;
use crate::tree::{Array, DType};

/// A prefill's inputs: the whole cache (donated), one prompt padded to its bucket, and the
/// slot it goes into with its sampling settings.
#[derive(crate::Tree, Clone, Debug)]
pub(crate) struct PrefillIn {
    /// The KV cache, every slot (donated: outputs `0..cache.len()`).
    pub(crate) cache: Vec<Array>,
    /// The prompt, `i32 [1, bucket]`, padded after its `length` tokens.
    pub(crate) tokens: Array,
    /// The slot, `i32 []`.
    pub(crate) slot: Array,
    /// The prompt's tokens, `i32 []` (1 ..= bucket).
    pub(crate) length: Array,
    /// The request's key for this draw, `u32 [1, 2]`, and how many it drew before, `u32 [1]`.
    pub(crate) key: Array,
    pub(crate) drawn: Array,
    /// Sampling settings, `[1]` each.
    pub(crate) temperature: Array,
    pub(crate) top_k: Array,
    pub(crate) top_p: Array,
}

/// A decode chunk's inputs: the whole cache (donated), and per slot its last token (not yet
/// in the cache), that token's position, the tokens it may still produce, the draws it made,
/// its key and settings and its end token; the context limit; and the chunk's token buffer,
/// whose length is the chunk's size.
#[derive(crate::Tree, Clone, Debug)]
pub(crate) struct DecodeIn {
    /// The KV cache, every slot (donated: outputs `0..cache.len()`).
    pub(crate) cache: Vec<Array>,
    /// `i32 [slots]` each.
    pub(crate) last: Array,
    pub(crate) pos: Array,
    pub(crate) budget: Array,
    /// `u32 [slots]`.
    pub(crate) drawn: Array,
    /// `u32 [slots, 2]`.
    pub(crate) keys: Array,
    /// `[slots]` each.
    pub(crate) temperature: Array,
    pub(crate) top_k: Array,
    pub(crate) top_p: Array,
    /// The token that ends a row, `-1` for none, `i32 [slots]`.
    pub(crate) end: Array,
    /// The positions a row may hold, `i32 []`.
    pub(crate) limit: Array,
    /// The chunk's tokens, `i32 [slots, chunk]` (its contents are not read).
    pub(crate) out: Array,
}

thread_local! {
    /// The rows axis of each cache tensor of the model being traced (set by the generator
    /// around its lookups: the axes follow from the model's GraphConsts, which the key holds).
    static ROW_AXES: RefCell<Option<Vec<usize>>> = const { RefCell::new(None) };
    /// The largest top-k of the programs being traced.
    static MAX_K: RefCell<usize> = const { RefCell::new(1) };
}

/// Sets what the programs' functions read while `f` traces them.
pub(crate) fn tracing<R>(row_axes: Vec<usize>, max_k: usize, f: impl FnOnce() -> R) -> R {
    ROW_AXES.with(|a| *a.borrow_mut() = Some(row_axes));
    MAX_K.with(|k| *k.borrow_mut() = max_k);
    let out = f();
    ROW_AXES.with(|a| *a.borrow_mut() = None);
    out
}

fn row_axes(n: usize) -> Vec<usize> {
    ROW_AXES
        .with(|a| a.borrow().clone())
        .unwrap_or_else(|| vec![0; n])
}

fn max_k() -> usize {
    MAX_K.with(|k| *k.borrow())
}

/// The prefill program of a model.
pub(crate) fn prefill<E: Decoder>(
    cache_len: usize,
) -> Program<E, PrefillInMirror<Tensor>, Vec<Tensor>> {
    Program::generic("nitro.generate.prefill", prefill_fn::<E>).donating_inputs(cache_len)
}

/// The decode program of a model.
pub(crate) fn decode<E: Decoder>(
    cache_len: usize,
) -> Program<E, DecodeInMirror<Tensor>, Vec<Tensor>> {
    Program::generic("nitro.generate.decode", decode_fn::<E>).donating_inputs(cache_len)
}

/// `i32` scalar `value`.
fn i32_scalar(value: i64) -> Tensor {
    Tensor::scalar(value as f64, DType::I32)
}

fn prefill_fn<E: Decoder>(v: &E::View<'_>, m: &PrefillInMirror<Tensor>) -> Vec<Tensor> {
    let axes = row_axes(m.cache.len());
    // A fresh row of every cache tensor: the prompt starts at position 0.
    let fresh: Vec<Tensor> = m
        .cache
        .iter()
        .zip(&axes)
        .map(|(c, &axis)| {
            let mut dims = c.dims();
            if let Some(d) = dims.get_mut(axis) {
                *d = 1;
            }
            Tensor::full(&dims, 0.0, c.dtype())
        })
        .collect();
    let start = Tensor::full(&[1], 0.0, DType::I32);
    let (logits, written) = E::decode(v, m.tokens, start, fresh);
    let mut out: Vec<Tensor> = m
        .cache
        .iter()
        .zip(written)
        .zip(&axes)
        .map(|((&c, w), &axis)| {
            let starts: Vec<Tensor> = (0..c.dims().len())
                .map(|d| if d == axis { m.slot } else { i32_scalar(0) })
                .collect();
            c.dynamic_update_slice(w.convert(c.dtype()), &starts)
        })
        .collect();
    // The logits after the prompt's last token.
    let vocab = logits.dims().last().copied().unwrap_or(1);
    let last = logits
        .dynamic_slice(
            &[i32_scalar(0), m.length - 1.0, i32_scalar(0)],
            &[1, 1, vocab],
        )
        .reshape(&[1, vocab]);
    let keys = sample::fold_in_rows(m.key, m.drawn);
    let params = SampleParams {
        temperature: m.temperature,
        top_k: m.top_k,
        top_p: m.top_p,
    };
    out.push(sample::sample(last, keys, &params, max_k()));
    out
}

fn decode_fn<E: Decoder>(v: &E::View<'_>, m: &DecodeInMirror<Tensor>) -> Vec<Tensor> {
    let n = m.cache.len();
    let slots = m.last.dims().first().copied().unwrap_or(1);
    let chunk = m.out.dims().get(1).copied().unwrap_or(1);
    let params = SampleParams {
        temperature: m.temperature,
        top_k: m.top_k,
        top_p: m.top_p,
    };
    let k = max_k();
    // A row decodes while it has tokens to give and room in its window.
    let limit = m.limit.broadcast_to(&[slots]);
    let active = |pos: Tensor, budget: Tensor| budget.greater(0.0).and(pos.less(limit));
    let mut init = vec![i32_scalar(0)];
    init.extend(m.cache.iter().copied());
    init.extend([m.last, m.pos, m.budget, m.drawn, m.out]);
    let last_of = |c: &[Tensor]| {
        let (pos, budget) = (c[n + 2], c[n + 3]);
        (pos, budget)
    };
    let done = crate::trace::while_loop(
        &init,
        |c| {
            let (pos, budget) = last_of(c);
            let any = active(pos, budget)
                .convert(DType::I32)
                .sum(&[0])
                .greater(0.0);
            c[0].less(chunk as f64).and(any)
        },
        |c| {
            let i = c[0];
            let cache: Vec<Tensor> = c[1..=n].to_vec();
            let (last, pos, budget, drawn, out) =
                (c[n + 1], c[n + 2], c[n + 3], c[n + 4], c[n + 5]);
            let live = active(pos, budget);
            // Rows that do not decode write at a position they hold already.
            let at = pos.minimum(limit - 1.0);
            let (logits, cache) = E::decode(v, last.reshape(&[slots, 1]), at, cache);
            let vocab = logits.dims().last().copied().unwrap_or(1);
            let logits = logits.reshape(&[slots, vocab]);
            let keys = sample::fold_in_rows(m.keys, drawn);
            let token = sample::sample(logits, keys, &params, k);
            let given = Tensor::select(live, token, Tensor::full(&[slots], -1.0, DType::I32));
            let out = out.dynamic_update_slice(given.reshape(&[slots, 1]), &[i32_scalar(0), i]);
            let step = live.convert(DType::I32);
            let ended = live.and(token.equal(m.end));
            let budget = Tensor::select(
                ended,
                Tensor::full(&[slots], 0.0, DType::I32),
                budget - step,
            );
            let mut next = vec![i + 1.0];
            next.extend(
                cache
                    .into_iter()
                    .zip(&c[1..=n])
                    .map(|(w, old)| w.convert(old.dtype())),
            );
            next.extend([
                Tensor::select(live, token, last),
                pos + step,
                budget,
                drawn + step.convert(DType::U32),
                out,
            ]);
            next
        },
    );
    done[1..].to_vec()
}
