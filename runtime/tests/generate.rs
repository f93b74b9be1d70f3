//! The generator (issue 51, items 2–5): a model's programs declared and got up front (a
//! prefill per bucket, a decode per chunk size; a second generator compiles none), greedy
//! decoding through the KV cache giving exactly the tokens of the full-window recompute, slots
//! that requests join and leave with each request's text independent of the others, stops,
//! cancellation, a window that fills and is prefilled again from its tail, and requests refused
//! by name — on the interpreter and on XLA.
#![allow(missing_docs)]

mod common;

use common::xla_or_skip;
use nitro::backend::{self, Backend};
use nitro::cache::Cache;
use nitro::generate::{
    CacheTensor, DecodeShape, Decoder, Engine, Event, GenerateConfig, Generator, Request, Sampling,
    StopReason, StreamEvent,
};
use nitro::init::{self, Seed};
use nitro::prelude::*;
use nitro::program::Program;
use nitro::{Error, LeafType};

/// A small causal model with a cache: the state at position `p` is the sum of the embeddings of
/// tokens `0..=p`, each scaled by its position's weight; logits are `tanh(state) · out`.
#[derive(ContentHash, Clone, Copy, Debug, PartialEq)]
pub struct ToyShape {
    pub vocab: usize,
    pub dim: usize,
    pub context: usize,
}

#[experiment]
#[derive(Clone)]
pub struct Toy {
    #[graph_const]
    pub shape: ToyShape,
    #[device]
    pub emb: Array,
    #[device]
    pub pos: Array,
    #[device]
    pub out: Array,
}

fn toy(vocab: usize, dim: usize, context: usize, seed: u64) -> Toy {
    Toy {
        shape: ToyShape {
            vocab,
            dim,
            context,
        },
        emb: init::normal(&[vocab, dim], 0.0, 1.0, Seed(seed)),
        pos: init::uniform(&[context, 1], 0.5, 1.5, Seed(seed + 1)),
        out: init::normal(&[dim, vocab], 0.0, 2.0, Seed(seed + 2)),
    }
}

/// Logits of `[rows, t]` tokens at positions `positions` (`i32 [rows, t]`), given their
/// embeddings' running sums `h` (`[rows, t, dim]`).
fn head(v: &ToyView<'_>, h: Tensor) -> Tensor {
    h.tanh().matmul(v.out)
}

/// The full forward pass over windows `[rows, t]` (positions `0..t`).
fn full(v: &ToyView<'_>, x: &Tensor) -> Tensor {
    let d = x.dims();
    let (rows, t) = (d[0], d[1]);
    let e = v.emb.take(*x, 0) * v.pos.slice(&[0, 0], &[t, 1]).reshape(&[1, t, 1]);
    // Causal running sum: a lower-triangular [t, t] of ones times the embeddings.
    let r = Tensor::iota(DType::I32, &[t, t], 0);
    let c = Tensor::iota(DType::I32, &[t, t], 1);
    let lower = r.greater_equal(c).convert(DType::F32);
    let h = lower.broadcast_to(&[rows, t, t]).matmul(e);
    head(v, h)
}

const FULL: Program<Toy, Tensor> = Toy::program("full", full);

impl Decoder for Toy {
    fn decode_shape(&self) -> DecodeShape {
        let s = self.shape;
        DecodeShape {
            vocab: s.vocab,
            context: s.context,
            cache: vec![CacheTensor {
                name: "emb".into(),
                row: LeafType::new(DType::F32, &[s.context, s.dim]),
                row_axis: 0,
            }],
        }
    }

    fn decode(
        v: &ToyView<'_>,
        tokens: Tensor,
        start: Tensor,
        cache: Vec<Tensor>,
    ) -> (Tensor, Vec<Tensor>) {
        let d = tokens.dims();
        let (rows, t) = (d[0], d[1]);
        let ctx = v.shape.context;
        // Token j of row r sits at start[r] + j.
        let at = start.reshape(&[rows, 1]) + Tensor::iota(DType::I32, &[rows, t], 1);
        let scale = v.pos.reshape(&[ctx]).take(at, 0).reshape(&[rows, t, 1]);
        let e = v.emb.take(tokens, 0) * scale;
        // Written: a one-hot [rows, t, ctx] of each token's position.
        let slots = Tensor::iota(DType::I32, &[rows, t, ctx], 2);
        let hot = slots.equal(at.reshape(&[rows, t, 1]).broadcast_to(&[rows, t, ctx]));
        let hot = hot.convert(DType::F32);
        let covered = hot.sum(&[1]).reshape(&[rows, ctx, 1]);
        let old = cache[0];
        let new = old * (covered * -1.0 + 1.0) + hot.transpose(&[0, 2, 1]).matmul(e);
        // Read: every position up to the query's.
        let seen = slots
            .less_equal(at.reshape(&[rows, t, 1]).broadcast_to(&[rows, t, ctx]))
            .convert(DType::F32);
        let h = seen.matmul(new);
        (head(v, h), vec![new])
    }
}

fn memory_cache() -> &'static Cache {
    Box::leak(Box::new(Cache::in_memory(64)))
}

/// Greedy decoding by recomputing the whole window for every token (today's `predict` path):
/// the oracle.
fn recompute_greedy(
    backend: &'static dyn Backend,
    model: &Toy,
    prompt: &[u32],
    n: usize,
) -> Vec<u32> {
    let cache = memory_cache();
    let mut text: Vec<u32> = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let x =
            Array::from_vec(&[1, text.len()], text.iter().map(|&t| t as i32).collect()).unwrap();
        let served = cache.get(backend, &FULL, model, &x).unwrap();
        let logits = served
            .compiled
            .executable
            .run(&[&model.emb, &model.pos, &model.out, &x])
            .unwrap()
            .remove(0);
        let vocab = model.shape.vocab;
        let l = logits.as_slice::<f32>().unwrap();
        let last = &l[(text.len() - 1) * vocab..text.len() * vocab];
        let best = (0..vocab).fold(0, |b, i| if last[i] > last[b] { i } else { b }) as u32;
        out.push(best);
        text.push(best);
    }
    out
}

fn config() -> GenerateConfig {
    GenerateConfig::new()
        .slots(3)
        .buckets([4, 8, 16])
        .chunks([2, 5])
        .max_top_k(8)
}

fn greedy_matches_the_recompute_on(backend: &'static dyn Backend) {
    let model = toy(11, 6, 32, 5);
    let mut g = Generator::with_backend(model.clone(), config(), backend, memory_cache()).unwrap();
    for prompt in [
        vec![3u32],
        vec![1, 2, 3, 4, 5],
        vec![7, 7, 0, 2, 9, 10, 4, 1, 8],
    ] {
        // Up to a full window: the cache's tokens are the recompute's exactly.
        let n = 32 - prompt.len();
        let want = recompute_greedy(backend, &model, &prompt, n);
        let record = g.generate(Request::new(prompt.clone(), n)).unwrap();
        assert_eq!(record.tokens, want, "prompt {prompt:?}");
        assert_eq!(record.stop, StopReason::Length);
        assert_eq!(record.context_shifts, 0);
    }
}

#[test]
fn greedy_decoding_through_the_cache_is_the_full_window_recompute() {
    greedy_matches_the_recompute_on(backend::interpreter());
    if let Some(xla) = xla_or_skip("greedy_decoding_through_the_cache_is_the_full_window_recompute")
    {
        greedy_matches_the_recompute_on(xla);
    }
}

#[test]
fn the_inventory_is_got_up_front_and_a_second_generator_compiles_nothing() {
    let backend = backend::interpreter();
    let cache = memory_cache();
    let g = Generator::with_backend(toy(11, 6, 32, 5), config(), backend, cache).unwrap();
    let inv = g.inventory();
    assert_eq!(
        inv.prefill.iter().map(|(b, _)| *b).collect::<Vec<_>>(),
        [4, 8, 16]
    );
    assert_eq!(
        inv.decode.iter().map(|(c, _)| *c).collect::<Vec<_>>(),
        [2, 5]
    );
    assert_eq!(inv.compiles(), 5, "{inv:?}");
    // The preflight of the same declaration, other weights: every program held, none built.
    let plan = Generator::plan(&toy(11, 6, 32, 9), &config(), backend, cache).unwrap();
    assert_eq!(plan.entries.len(), 5);
    assert_eq!(plan.count(nitro::cache::Will::Hit), 5, "{plan:?}");
    // Another slot count: a cache of other dims, so every program is another — said before
    // any is built.
    let compiled = cache.stats().compiles;
    let plan = Generator::plan(&toy(11, 6, 32, 9), &config().slots(4), backend, cache).unwrap();
    assert_eq!(plan.count(nitro::cache::Will::Compile), 5, "{plan:?}");
    assert_eq!(
        plan.entries
            .iter()
            .map(|e| e.role.as_str())
            .collect::<Vec<_>>(),
        ["prefill", "prefill", "prefill", "decode", "decode"]
    );
    assert_eq!(
        cache.stats().compiles,
        compiled,
        "a preflight compiles nothing"
    );
    let compiles = cache.stats().compiles;
    // Other weights, the same shapes: every program held.
    let mut again = Generator::with_backend(toy(11, 6, 32, 9), config(), backend, cache).unwrap();
    assert_eq!(again.inventory().compiles(), 0);
    assert!(again.inventory().prefill.iter().all(|(_, o)| o.is_hit()));
    // Whatever is served afterwards — prompt lengths, settings, slots — compiles nothing.
    for (i, len) in [1usize, 3, 4, 5, 9, 16].into_iter().enumerate() {
        let sampling = Sampling::greedy()
            .temperature(0.5 + i as f32 * 0.3)
            .top_k(3)
            .top_p(0.9)
            .seed(i as u64);
        again
            .submit(Request::new(vec![2; len], 7).sampling(sampling))
            .unwrap();
    }
    again.run_to_end().unwrap();
    assert_eq!(cache.stats().compiles, compiles);
    assert_eq!(again.kv_cache_bytes(), 3 * 32 * 6 * 4);
}

#[test]
fn requests_join_and_leave_slots_and_each_text_is_its_own() {
    let backend = backend::interpreter();
    let model = toy(13, 8, 40, 2);
    let requests: Vec<Request> = (0..7u32)
        .map(|i| {
            let sampling = match i % 3 {
                0 => Sampling::greedy(),
                1 => Sampling::greedy().temperature(0.8).seed(u64::from(i) * 7),
                _ => Sampling::greedy()
                    .temperature(1.3)
                    .top_k(4)
                    .top_p(0.8)
                    .seed(u64::from(i)),
            };
            Request::new(vec![i % 13, (i * 5) % 13, 1], 3 + 4 * i as usize).sampling(sampling)
        })
        .collect();
    // Each alone, one slot.
    let mut alone =
        Generator::with_backend(model.clone(), config().slots(1), backend, memory_cache()).unwrap();
    let want: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| alone.generate(r.clone()).unwrap().tokens)
        .collect();
    // All at once over 3 slots: they queue, join as slots free, and each gets its own text.
    let mut g = Generator::with_backend(model, config(), backend, memory_cache()).unwrap();
    let ids: Vec<u64> = requests
        .iter()
        .map(|r| g.submit(r.clone()).unwrap())
        .collect();
    let mut streamed: Vec<Vec<u32>> = vec![Vec::new(); ids.len()];
    let mut finished = Vec::new();
    while g.busy() {
        for event in g.step().unwrap() {
            match event {
                Event::Tokens { id, tokens } => streamed[id as usize].extend(tokens),
                Event::Finished(r) => finished.push(r),
            }
        }
    }
    assert_eq!(finished.len(), ids.len());
    for r in &finished {
        let i = r.id as usize;
        assert_eq!(r.tokens, want[i], "request {i} beside others");
        assert_eq!(streamed[i], r.tokens, "request {i}'s stream");
        assert_eq!(r.tokens.len(), requests[i].max_tokens);
    }
}

#[test]
fn end_tokens_stop_sequences_and_cancellation_end_requests() {
    let backend = backend::interpreter();
    let model = toy(11, 6, 32, 5);
    let mut g = Generator::with_backend(model, config(), backend, memory_cache()).unwrap();
    let free = g.generate(Request::new(vec![1, 2], 12)).unwrap().tokens;
    // The third token as an end token: the text stops at its first appearance.
    let end = free[2];
    let first = free.iter().position(|&t| t == end).unwrap();
    let r = g
        .generate(Request::new(vec![1, 2], 12).end_token(end))
        .unwrap();
    assert_eq!(r.stop, StopReason::EndToken);
    assert_eq!(r.tokens, free[..=first].to_vec());
    // Tokens 3..5 as a stop sequence.
    let stop = free[3..5].to_vec();
    let r = g
        .generate(Request::new(vec![1, 2], 12).stop(stop.clone()))
        .unwrap();
    assert_eq!(r.stop, StopReason::StopSequence);
    assert!(r.tokens.ends_with(&stop) && r.tokens.len() <= 5);
    // Cancelled while running, and while waiting: each slot is free at once.
    let long: Vec<u64> = (0..5)
        .map(|_| g.submit(Request::new(vec![3], 25)).unwrap())
        .collect();
    g.step().unwrap();
    assert_eq!(g.pending(), 5);
    let running = g.cancel(long[0]).unwrap();
    assert_eq!(running.stop, StopReason::Cancelled);
    assert!(!running.tokens.is_empty());
    let waiting = g.cancel(long[4]).unwrap();
    assert!(waiting.tokens.is_empty());
    assert!(g.cancel(long[4]).is_none(), "cancelled once");
    let rest = g.run_to_end().unwrap();
    assert_eq!(rest.len(), 3);
    assert!(rest.iter().all(|r| r.tokens.len() == 25));
}

#[test]
fn a_full_window_is_prefilled_again_from_its_tail() {
    let backend = backend::interpreter();
    let model = toy(11, 6, 16, 5);
    let mut g = Generator::with_backend(
        model.clone(),
        config().buckets([4, 8]),
        backend,
        memory_cache(),
    )
    .unwrap();
    let r = g.generate(Request::new(vec![1, 2, 3], 50)).unwrap();
    assert_eq!(r.tokens.len(), 50);
    assert!(r.context_shifts >= 3, "{} shifts", r.context_shifts);
    // Until the window is full, the same tokens as the recompute.
    let want = recompute_greedy(backend, &model, &[1, 2, 3], 13);
    assert_eq!(r.tokens[..13], want[..]);
}

#[test]
fn bad_requests_and_declarations_are_refused_by_name() {
    let backend = backend::interpreter();
    let mut g = Generator::with_backend(
        toy(11, 6, 32, 5),
        config().queue(2),
        backend,
        memory_cache(),
    )
    .unwrap();
    let field = |e: Error| match e {
        Error::InvalidRequest { field, .. } => field,
        other => panic!("not a request error: {other}"),
    };
    assert_eq!(
        field(g.submit(Request::new(vec![], 4)).unwrap_err()),
        "prompt"
    );
    assert_eq!(
        field(g.submit(Request::new(vec![1; 17], 4)).unwrap_err()),
        "prompt"
    );
    assert_eq!(
        field(g.submit(Request::new(vec![11], 4)).unwrap_err()),
        "prompt"
    );
    assert_eq!(
        field(g.submit(Request::new(vec![1], 0)).unwrap_err()),
        "max_tokens"
    );
    assert_eq!(
        field(
            g.submit(Request::new(vec![1], 4).end_token(11))
                .unwrap_err()
        ),
        "end_token"
    );
    for (sampling, name) in [
        (Sampling::greedy().temperature(-1.0), "temperature"),
        (Sampling::greedy().temperature(f32::NAN), "temperature"),
        (Sampling::greedy().temperature(1.0).top_p(0.0), "top_p"),
        (Sampling::greedy().temperature(1.0).top_p(1.5), "top_p"),
        (Sampling::greedy().temperature(1.0).top_k(9), "top_k"),
    ] {
        let err = g
            .submit(Request::new(vec![1], 4).sampling(sampling))
            .unwrap_err();
        assert!(err.to_string().contains(name), "{name}: {err}");
    }
    g.submit(Request::new(vec![1], 4)).unwrap();
    g.submit(Request::new(vec![1], 4)).unwrap();
    assert_eq!(
        field(g.submit(Request::new(vec![1], 4)).unwrap_err()),
        "queue"
    );
    // Declarations.
    for (config, name) in [
        (config().slots(0), "slots"),
        (config().chunks([0]), "chunks"),
        (config().buckets([64]), "buckets"),
        (config().max_top_k(0), "max_top_k"),
    ] {
        let err = Generator::with_backend(toy(11, 6, 32, 5), config, backend, memory_cache())
            .err()
            .unwrap();
        assert_eq!(field(err), name);
    }
}

/// On a thread of its own: streams read from several threads at once get the texts their
/// requests get alone; a stream dropped mid-way frees its slot, so requests behind it run.
#[test]
fn streams_from_several_threads_and_a_dropped_stream_frees_its_slot() {
    let backend = backend::interpreter();
    let model = toy(13, 8, 64, 4);
    let requests: Vec<Request> = (0..6u32)
        .map(|i| {
            Request::new(vec![i, 2, (3 * i) % 13], 10 + 3 * i as usize)
                .sampling(Sampling::greedy().temperature(0.9).seed(u64::from(i) + 40))
        })
        .collect();
    let mut alone =
        Generator::with_backend(model.clone(), config().slots(1), backend, memory_cache()).unwrap();
    let want: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| alone.generate(r.clone()).unwrap().tokens)
        .collect();
    let engine = Engine::start(
        Generator::with_backend(model, config().slots(2), backend, memory_cache()).unwrap(),
    )
    .unwrap();
    // Two streams that will never be read to their end hold both slots.
    let mut held: Vec<_> = (0..2)
        .map(|_| {
            engine
                .submit(Request::new(vec![1], i32::MAX as usize))
                .unwrap()
        })
        .collect();
    for stream in &mut held {
        let first = stream.next().unwrap();
        assert!(matches!(first, StreamEvent::Tokens(_)), "{first:?}");
    }
    let got: Vec<Vec<u32>> = std::thread::scope(|s| {
        let readers: Vec<_> = requests
            .iter()
            .map(|r| {
                let mut stream = engine.submit(r.clone()).unwrap();
                s.spawn(move || {
                    let mut tokens = Vec::new();
                    // Held slots never end by themselves: only their drop lets these run.
                    let limit = std::time::Duration::from_secs(120);
                    while let Ok(event) = stream.next_within(limit) {
                        let event = event.expect("no token in 120 s: the held slots stayed held");
                        match event {
                            StreamEvent::Tokens(t) => tokens.extend(t),
                            StreamEvent::Done(record) => {
                                assert_eq!(record.tokens, tokens);
                                return tokens;
                            }
                            StreamEvent::Failed(why) => panic!("{why}"),
                        }
                    }
                    panic!("the stream ended without a record")
                })
            })
            .collect();
        // Nothing behind the held slots runs until a held stream is dropped: the client went
        // away, and its slot is freed.
        std::thread::sleep(std::time::Duration::from_millis(50));
        held.clear();
        readers.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert_eq!(got, want);
}

/// A second process on the same persistent store loads every program of the inventory and
/// compiles none (on XLA, whose programs are stored).
#[test]
fn a_second_process_loads_the_inventory_from_the_store() {
    let test = "a_second_process_loads_the_inventory_from_the_store";
    let Some(xla) = xla_or_skip(test) else {
        return;
    };
    let dir = common::TempDir::new("generate-store");
    std::fs::create_dir_all(dir.path()).unwrap();
    let process = || {
        let store = nitro::cache::DirStore::open(dir.path(), 1 << 30, None).unwrap();
        &*Box::leak(Box::new(Cache::new(16, Some(std::sync::Arc::new(store)))))
    };
    let first = Generator::with_backend(toy(11, 6, 32, 5), config(), xla, process()).unwrap();
    assert_eq!(first.inventory().compiles(), 5);
    let cache = process();
    let mut second = Generator::with_backend(toy(11, 6, 32, 5), config(), xla, cache).unwrap();
    assert_eq!(second.inventory().compiles(), 0, "{:?}", second.inventory());
    assert!(second
        .inventory()
        .prefill
        .iter()
        .chain(&second.inventory().decode)
        .all(|(_, o)| matches!(o, nitro::cache::Outcome::Loaded { .. })));
    second.generate(Request::new(vec![1, 2], 9)).unwrap();
    assert_eq!(cache.stats().compiles, 0);
}
