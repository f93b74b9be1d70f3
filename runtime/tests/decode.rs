//! Models that decode through a KV cache (`nn::*::forward_cached`, `generate::Decoder`), held
//! to the full forward pass over the window — the cache's correctness oracle — on the
//! interpreter and on XLA: a prefill then one token at a time gives the window's logits; rows
//! at different positions in one call each get their own; what the cache holds past a row's
//! positions (stale values, huge numbers) changes nothing; a stack run as one scan decodes as
//! the unrolled blocks do; and greedy decoding through the cache picks exactly the tokens of
//! the full-window recompute.
#![allow(missing_docs)]

mod common;

use nitro::backend::{self, Backend};
use nitro::cache::Cache;
use nitro::generate::Decoder;
use nitro::init::Seed;
use nitro::nn::{
    self, BlockParams, Gpt2, Gpt2Params, Layer, LayerNorm, Repeated, TransformerBlock,
};
use nitro::prelude::*;
use nitro::program::{Outputs, Program};

// ---- the models ------------------------------------------------------------------------------

/// GPT-2 with its blocks unrolled: what an experiment holding an `nn::Gpt2` writes to decode.
#[experiment]
pub struct Tiny {
    #[graph_const]
    pub model: Gpt2,
    #[device]
    pub weights: Gpt2Params,
}

impl Decoder for Tiny {
    fn decode_shape(&self) -> nitro::generate::DecodeShape {
        self.model.decode_shape(self.weights.wte.table.dtype())
    }
    fn decode(
        v: &TinyView<'_>,
        tokens: Tensor,
        start: Tensor,
        cache: Vec<Tensor>,
    ) -> (Tensor, Vec<Tensor>) {
        v.model.forward_cached(&v.weights, tokens, start, cache)
    }
}

fn tiny_logits(v: &TinyView<'_>, ids: &Tensor) -> Tensor {
    v.model.forward(&v.weights, *ids)
}

/// The same model with its blocks stacked, as one scan (or unrolled copies of the stack).
#[derive(ContentHash, Clone, Debug)]
pub struct StackArch {
    pub model: Gpt2,
    pub stack: Repeated<TransformerBlock>,
}

#[experiment]
pub struct Stacked {
    #[graph_const]
    pub arch: StackArch,
    #[device]
    pub wte: nn::EmbeddingParams,
    #[device]
    pub wpe: nn::EmbeddingParams,
    #[device]
    pub blocks: BlockParams,
    #[device]
    pub ln_f: nn::NormParams,
}

impl Stacked {
    fn of(tiny: &Tiny, unrolled: bool) -> Stacked {
        let m = tiny.model;
        let stack = Repeated::new(m.block(), m.layers).unrolled(unrolled);
        Stacked {
            blocks: stack.stack_params(&tiny.weights.blocks).unwrap(),
            wte: tiny.weights.wte.clone(),
            wpe: tiny.weights.wpe.clone(),
            ln_f: tiny.weights.ln_f.clone(),
            arch: StackArch { model: m, stack },
        }
    }
}

fn stacked_head(v: &StackedView<'_>, h: Tensor) -> Tensor {
    let m = v.arch.model;
    let h = LayerNorm {
        dim: m.dim,
        eps: m.eps,
    }
    .forward(&v.ln_f, h);
    h.matmul(v.wte.table.transpose(&[1, 0]))
}

impl Decoder for Stacked {
    fn decode_shape(&self) -> nitro::generate::DecodeShape {
        let m = self.arch.model;
        nitro::generate::DecodeShape {
            vocab: m.vocab,
            context: m.context,
            cache: self
                .arch
                .stack
                .cache_tensors("stack", m.context, DType::F32)
                .to_vec(),
        }
    }
    fn decode(
        v: &StackedView<'_>,
        tokens: Tensor,
        start: Tensor,
        cache: Vec<Tensor>,
    ) -> (Tensor, Vec<Tensor>) {
        let m = v.arch.model;
        let t = tokens.dims()[1];
        let wpe = nn::Embedding {
            vocab: m.context,
            dim: m.dim,
        };
        let h = v.wte.table.take(tokens, 0) + wpe.positions_at(&v.wpe, start, t);
        let (h, cache) = v.arch.stack.forward_cached_list(&v.blocks, h, start, cache);
        (stacked_head(v, h), cache)
    }
}

fn stacked_logits(v: &StackedView<'_>, ids: &Tensor) -> Tensor {
    let m = v.arch.model;
    let t = ids.dims()[1];
    let wpe = nn::Embedding {
        vocab: m.context,
        dim: m.dim,
    };
    let h = v.wte.table.take(*ids, 0) + wpe.positions(&v.wpe, t);
    stacked_head(v, v.arch.stack.forward(&v.blocks, h))
}

// ---- running programs ------------------------------------------------------------------------

/// One decode call's inputs: tokens `i32 [rows, t]`, starts `i32 [rows]`, the cache.
#[derive(Tree, Clone)]
pub struct Step {
    pub tokens: Array,
    pub start: Array,
    pub cache: Vec<Array>,
}

fn decode_step<E: Decoder>(v: &E::View<'_>, s: &StepMirror<Tensor>) -> (Tensor, Vec<Tensor>) {
    E::decode(v, s.tokens, s.start, s.cache.clone())
}

fn decode_program<E: Decoder>() -> Program<E, StepMirror<Tensor>, (Tensor, Vec<Tensor>)> {
    Program::generic("decode", decode_step::<E>)
}

/// A backend with a cache of what it compiled, so each shape compiles once.
struct Runner {
    backend: &'static dyn Backend,
    cache: Cache,
}

impl Runner {
    fn new(backend: &'static dyn Backend) -> Runner {
        Runner {
            backend,
            cache: Cache::in_memory(64),
        }
    }

    fn run<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        program: &Program<E, M, O>,
        e: &E,
        inputs: &I,
    ) -> Vec<Array> {
        let served = self.cache.get(self.backend, program, e, inputs).unwrap();
        served
            .executable
            .run(&program.arguments(e, inputs))
            .unwrap()
    }

    /// Logits `[rows, t, vocab]` of the full forward pass.
    fn full<E: Experiment>(&self, p: &Program<E, Tensor>, e: &E, ids: &Array) -> Vec<f32> {
        self.run(p, e, ids)
            .remove(0)
            .as_slice::<f32>()
            .unwrap()
            .to_vec()
    }

    /// Logits `[rows, t, vocab]` through the cache, and the written cache.
    fn decode<E: Decoder>(
        &self,
        e: &E,
        tokens: &[i32],
        rows: usize,
        start: &[i32],
        cache: Vec<Array>,
    ) -> (Vec<f32>, Vec<Array>) {
        let step = Step {
            tokens: Array::from_vec(&[rows, tokens.len() / rows], tokens.to_vec()).unwrap(),
            start: Array::from_vec(&[rows], start.to_vec()).unwrap(),
            cache,
        };
        let mut out = self.run(&decode_program::<E>(), e, &step);
        let logits = out.remove(0).as_slice::<f32>().unwrap().to_vec();
        (logits, out)
    }
}

/// The decoder's cache for `rows` rows, every element `fill`.
fn fresh_cache<E: Decoder>(e: &E, rows: usize, fill: f32) -> Vec<Array> {
    e.decode_shape()
        .cache
        .iter()
        .map(|c| Array::full(&c.with_rows(rows).dims, fill))
        .collect()
}

fn backends(test: &str) -> Vec<(&'static str, &'static dyn Backend)> {
    let mut b: Vec<(&'static str, &'static dyn Backend)> =
        vec![("interpreter", backend::interpreter())];
    if let Some(xla) = common::xla_or_skip(test) {
        b.push(("xla", xla));
    }
    b
}

fn tiny(context: usize, seed: u64) -> Tiny {
    let model = Gpt2::new(24, context, 32, 4, 2).unwrap();
    let mut weights = model.init(Seed(seed));
    // Wider logits than GPT-2's σ 0.02 embedding gives, so that greedy choices are not
    // near-ties (the token embedding is also the head), and positions that weigh enough for a
    // greedy text to keep changing (a position read wrongly shows).
    for x in weights.wte.table.as_slice_mut::<f32>().unwrap() {
        *x *= 10.0;
    }
    for x in weights.wpe.table.as_slice_mut::<f32>().unwrap() {
        *x *= 30.0;
    }
    Tiny { model, weights }
}

fn ids(rows: usize, t: usize, vocab: usize, seed: u64) -> Vec<i32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..rows * t)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as i32
        })
        .collect()
}

/// Columns `from..to` of each row of `[rows, t, vocab]` logits.
fn columns(x: &[f32], rows: usize, t: usize, vocab: usize, from: usize, to: usize) -> Vec<f32> {
    (0..rows)
        .flat_map(|r| {
            x[(r * t + from) * vocab..(r * t + to) * vocab]
                .iter()
                .copied()
        })
        .collect()
}

/// The largest `|a − b|` relative to the largest `|b|`, after checking both are as long.
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b
        .iter()
        .fold(0f64, |m, &x| m.max(f64::from(x).abs()))
        .max(1e-30);
    let diff = a.iter().zip(b).fold(0f64, |m, (&x, &y)| {
        m.max((f64::from(x) - f64::from(y)).abs())
    });
    assert!(diff.is_finite(), "a non-finite logit");
    diff / scale
}

const TOLERANCE: f64 = 1e-5;

/// Prefill of `p` tokens, then one token at a time through the cache: the logits of every
/// position, `[rows, t, vocab]` in row-major order.
fn through_cache<E: Decoder>(
    run: &Runner,
    e: &E,
    window: &[i32],
    rows: usize,
    p: usize,
) -> Vec<f32> {
    let t = window.len() / rows;
    let vocab = e.decode_shape().vocab;
    let mut per_pos = vec![vec![0f32; 0]; t];
    let prompt: Vec<i32> = (0..rows)
        .flat_map(|r| window[r * t..r * t + p].to_vec())
        .collect();
    let (logits, mut cache) =
        run.decode(e, &prompt, rows, &vec![0; rows], fresh_cache(e, rows, 0.0));
    for (j, col) in per_pos.iter_mut().enumerate().take(p) {
        *col = columns(&logits, rows, p, vocab, j, j + 1);
    }
    for (j, col) in per_pos.iter_mut().enumerate().skip(p) {
        let tokens: Vec<i32> = (0..rows).map(|r| window[r * t + j]).collect();
        let (logits, written) = run.decode(e, &tokens, rows, &vec![j as i32; rows], cache);
        cache = written;
        *col = logits;
    }
    // Back to [rows, t, vocab].
    (0..rows)
        .flat_map(|r| {
            per_pos
                .iter()
                .flat_map(move |col| col[r * vocab..(r + 1) * vocab].to_vec())
                .collect::<Vec<_>>()
        })
        .collect()
}

// ---- the oracle ------------------------------------------------------------------------------

#[test]
fn a_prefill_then_single_tokens_give_the_full_windows_logits() {
    let full = Tiny::program("logits", tiny_logits);
    let e = tiny(16, 1);
    let (rows, t, p) = (2, 12, 5);
    let window = ids(rows, t, 24, 7);
    let ids_array = Array::from_vec(&[rows, t], window.clone()).unwrap();
    for (name, b) in backends("a_prefill_then_single_tokens_give_the_full_windows_logits") {
        let run = Runner::new(b);
        let want = run.full(&full, &e, &ids_array);
        let got = through_cache(&run, &e, &window, rows, p);
        let d = rel_diff(&got, &want);
        println!("{name}: prefill {p} + {} single tokens vs the full window: max |Δ| / max |logit| = {d:.2e}", t - p);
        assert!(d <= TOLERANCE, "{name}: {d:e}");
        // A whole-window prefill is the full forward too.
        let (whole, _) = run.decode(&e, &window, rows, &[0, 0], fresh_cache(&e, rows, 0.0));
        let d = rel_diff(&whole, &want);
        println!("{name}: whole-window prefill: {d:.2e}");
        assert!(d <= TOLERANCE, "{name}: {d:e}");
    }
}

#[test]
fn rows_at_different_positions_each_get_their_own_logits_and_stale_entries_are_masked() {
    let full = Tiny::program("logits", tiny_logits);
    let e = tiny(16, 2);
    let (rows, t, vocab) = (2, 8, 24);
    let window = ids(rows, t, vocab, 11);
    let ids_array = Array::from_vec(&[rows, t], window.clone()).unwrap();
    for (name, b) in backends("rows_at_different_positions_each_get_their_own_logits") {
        let run = Runner::new(b);
        let want = run.full(&full, &e, &ids_array);
        // Both rows prefilled with 7 tokens; row 0's last four are not its window's, so its
        // positions 3..7 hold another text's keys and values.
        let mut prompt = window[..7].to_vec();
        prompt[3..7].copy_from_slice(&[1, 2, 3, 4]);
        prompt.extend_from_slice(&window[t..t + 7]);
        let (_, cache) = run.decode(&e, &prompt, rows, &[0, 0], fresh_cache(&e, rows, 0.0));
        // Row 0 at position 3, row 1 at position 7, in one call.
        let (got, _) = run.decode(&e, &[window[3], window[t + 7]], rows, &[3, 7], cache);
        let d0 = rel_diff(&got[..vocab], &columns(&want, 1, t, vocab, 3, 4));
        let d1 = rel_diff(
            &got[vocab..],
            &columns(&want[t * vocab..], 1, t, vocab, 7, 8),
        );
        println!("{name}: row 0 at 3: {d0:.2e}, row 1 at 7: {d1:.2e}");
        assert!(d0 <= TOLERANCE && d1 <= TOLERANCE, "{name}: {d0:e} {d1:e}");
    }
}

#[test]
fn huge_values_in_the_unwritten_cache_change_nothing() {
    let e = tiny(16, 3);
    let (rows, t) = (2, 6);
    let window = ids(rows, t, 24, 5);
    for (name, b) in backends("huge_values_in_the_unwritten_cache_change_nothing") {
        let run = Runner::new(b);
        let (clean, clean_cache) =
            run.decode(&e, &window, rows, &[0, 0], fresh_cache(&e, rows, 0.0));
        for fill in [1e30f32, -3e38] {
            let (dirty, dirty_cache) =
                run.decode(&e, &window, rows, &[0, 0], fresh_cache(&e, rows, fill));
            assert_eq!(clean, dirty, "{name}: the cache filled with {fill}");
            // The written positions are the same, the rest kept as it was.
            let (c, d) = (
                clean_cache[0].as_slice::<f32>().unwrap(),
                dirty_cache[0].as_slice::<f32>().unwrap(),
            );
            let (written, kept) = (
                c.iter().zip(d).filter(|(x, y)| x == y).count(),
                d.iter().filter(|&&y| y == fill).count(),
            );
            assert_eq!(
                written + kept,
                c.len(),
                "{name}: every entry written or kept"
            );
            let head_dim = 8;
            assert_eq!(
                written,
                rows * 4 * t * head_dim,
                "{name}: the tokens' entries written"
            );
        }
    }
}

#[test]
fn a_stack_run_as_one_scan_decodes_as_the_unrolled_blocks() {
    let e = tiny(16, 4);
    let (rows, t, p) = (2, 10, 4);
    let window = ids(rows, t, 24, 13);
    let scanned = Stacked::of(&e, false);
    let copies = Stacked::of(&e, true);
    assert_eq!(
        scanned.decode_shape().cache[0].with_rows(rows).dims,
        [2, rows, 4, 16, 8]
    );
    let full = Stacked::program("logits", stacked_logits);
    let ids_array = Array::from_vec(&[rows, t], window.clone()).unwrap();
    for (name, b) in backends("a_stack_run_as_one_scan_decodes_as_the_unrolled_blocks") {
        let run = Runner::new(b);
        let unrolled = through_cache(&run, &e, &window, rows, p);
        let want = run.full(&full, &scanned, &ids_array);
        for (form, s) in [("scan", &scanned), ("unrolled stack", &copies)] {
            let got = through_cache(&run, s, &window, rows, p);
            let (du, df) = (rel_diff(&got, &unrolled), rel_diff(&got, &want));
            println!("{name}: {form} through the cache vs unrolled blocks {du:.2e}, vs its full forward {df:.2e}");
            assert!(
                du <= TOLERANCE && df <= TOLERANCE,
                "{name} {form}: {du:e} {df:e}"
            );
        }
    }
}

// ---- greedy decoding -------------------------------------------------------------------------

/// The argmax of each row's `vocab` logits.
fn argmax(logits: &[f32], vocab: usize) -> Vec<i32> {
    logits
        .chunks(vocab)
        .map(|row| {
            let mut best = 0;
            for (i, &x) in row.iter().enumerate() {
                if x > row[best] {
                    best = i;
                }
            }
            best as i32
        })
        .collect()
}

/// `steps` greedy tokens per row after `prompt` (`[rows, p]`), by recomputing the full
/// window (padded to the context) for every token.
fn greedy_full<E: Decoder>(
    run: &Runner,
    full: &Program<E, Tensor>,
    e: &E,
    prompt: &[i32],
    rows: usize,
    steps: usize,
) -> Vec<Vec<i32>> {
    let shape = e.decode_shape();
    let (context, vocab) = (shape.context, shape.vocab);
    let p = prompt.len() / rows;
    let mut seqs: Vec<Vec<i32>> = prompt.chunks(p).map(<[i32]>::to_vec).collect();
    for _ in 0..steps {
        let len = seqs[0].len();
        let mut window = vec![0i32; rows * context];
        for (r, s) in seqs.iter().enumerate() {
            window[r * context..r * context + len].copy_from_slice(s);
        }
        let logits = run.full(full, e, &Array::from_vec(&[rows, context], window).unwrap());
        let last = columns(&logits, rows, context, vocab, len - 1, len);
        for (s, next) in seqs.iter_mut().zip(argmax(&last, vocab)) {
            s.push(next);
        }
    }
    seqs
}

/// The same through the cache: a prefill of the prompt, then one token a call.
fn greedy_cached<E: Decoder>(
    run: &Runner,
    e: &E,
    prompt: &[i32],
    rows: usize,
    steps: usize,
) -> Vec<Vec<i32>> {
    let vocab = e.decode_shape().vocab;
    let p = prompt.len() / rows;
    let mut seqs: Vec<Vec<i32>> = prompt.chunks(p).map(<[i32]>::to_vec).collect();
    let (logits, mut cache) =
        run.decode(e, prompt, rows, &vec![0; rows], fresh_cache(e, rows, 0.0));
    let mut next = argmax(&columns(&logits, rows, p, vocab, p - 1, p), vocab);
    for step in 0..steps {
        for (s, &n) in seqs.iter_mut().zip(&next) {
            s.push(n);
        }
        if step + 1 == steps {
            break;
        }
        let at = (p + step) as i32;
        let (logits, written) = run.decode(e, &next, rows, &vec![at; rows], cache);
        cache = written;
        next = argmax(&logits, vocab);
    }
    seqs
}

#[test]
fn greedy_decoding_through_the_cache_picks_the_full_windows_tokens() {
    let (context, vocab, rows, p, steps) = (64, 24, 2, 4, 56);
    let e = tiny(context, 5);
    let stacked = Stacked::of(&e, false);
    let prompt = ids(rows, p, vocab, 17);
    let full = Tiny::program("logits", tiny_logits);
    for (name, b) in backends("greedy_decoding_through_the_cache_picks_the_full_windows_tokens") {
        let run = Runner::new(b);
        let want = greedy_full(&run, &full, &e, &prompt, rows, steps);
        let got = greedy_cached(&run, &e, &prompt, rows, steps);
        assert_eq!(got, want, "{name}: unrolled blocks");
        let got = greedy_cached(&run, &stacked, &prompt, rows, steps);
        assert_eq!(got, want, "{name}: one scan");
        for row in &want {
            let distinct: std::collections::BTreeSet<i32> = row.iter().copied().collect();
            println!(
                "{name}: {steps} greedy tokens agree ({} distinct): {row:?}",
                distinct.len()
            );
            assert!(distinct.len() > 5, "{name}: a text that varies: {row:?}");
        }
    }
}

// ---- refusals --------------------------------------------------------------------------------

#[test]
fn caches_of_the_wrong_shape_or_count_fail_the_trace_naming_the_caller() {
    let e = tiny(16, 6);
    let rows = 2;
    let program = decode_program::<Tiny>();
    let mut cache = fresh_cache(&e, rows, 0.0);
    let step = |cache: Vec<Array>, t: usize| Step {
        tokens: Array::from_vec(&[rows, t], vec![0i32; rows * t]).unwrap(),
        start: Array::from_vec(&[rows], vec![0i32; rows]).unwrap(),
        cache,
    };
    assert!(program.trace(&e, &step(cache.clone(), 3)).is_ok());
    // One block's tensors missing.
    let short = cache[..2].to_vec();
    let err = program.trace(&e, &step(short, 1)).unwrap_err().to_string();
    assert!(
        err.contains("2 cache tensors") && err.contains("decode.rs"),
        "{err}"
    );
    // A cache with too few positions for the tokens.
    let err = program
        .trace(&e, &step(cache.clone(), 17))
        .unwrap_err()
        .to_string();
    assert!(err.contains("17"), "{err}");
    // A key cache of another head width.
    cache[0] = Array::zeros(DType::F32, &[rows, 4, 16, 7]);
    let err = program.trace(&e, &step(cache, 1)).unwrap_err().to_string();
    assert!(
        err.contains("[2, 4, 16, 8]") && err.contains("key cache"),
        "{err}"
    );
}

#[test]
fn the_cache_is_written_by_a_scatter_and_a_scanned_stack_carries_it() {
    let e = tiny(16, 8);
    let rows = 2;
    let step = |cache: Vec<Array>| Step {
        tokens: Array::from_vec(&[rows, 1], vec![0i32; rows]).unwrap(),
        start: Array::from_vec(&[rows], vec![3i32; rows]).unwrap(),
        cache,
    };
    let text = decode_program::<Tiny>()
        .trace(&e, &step(fresh_cache(&e, rows, 0.0)))
        .unwrap()
        .text;
    assert_eq!(
        text.matches("\"stablehlo.scatter\"(").count(),
        4,
        "k and v of 2 blocks: {text}"
    );
    let s = Stacked::of(&e, false);
    let traced = decode_program::<Stacked>()
        .trace(&s, &step(fresh_cache(&s, rows, 0.0)))
        .unwrap();
    let text = traced.text;
    assert_eq!(text.matches("stablehlo.while").count(), 1, "{text}");
    assert_eq!(
        text.matches("\"stablehlo.scatter\"(").count(),
        2,
        "k and v, in the body: {text}"
    );
    // The stacked caches go through the loop: the outputs are the caches' types, nothing is
    // stacked anew.
    assert_eq!(traced.outputs[1].dims, [2, rows, 4, 16, 8]);
}
