//! Generation: a trained model used to write text, through a declared set of compiled
//! programs — a prefill per prompt-length bucket and a decode step over a KV cache that lives
//! on the device and is updated in place, with sampling on the device.
//!
//! Three layers, each testable alone:
//!
//! - **The model** ([`Decoder`]): its forward pass over a KV cache — tokens and their positions
//!   in, logits out, the cache read and written. [`nn::Gpt2`](crate::nn::Gpt2) and
//!   [`nn::TransformerBlock`](crate::nn::TransformerBlock) provide the pieces
//!   (`forward_cached`).
//! - **Sampling** ([`sample`]): greedy, temperature, top-k and top-p, each a traced per-row
//!   input, drawn from a per-row Threefry stream, so a request's text depends on its seed alone.
//! - **The generator** (`Generator`): the programs, the device state (the cache, a position per
//!   slot), slots that requests join and leave, and the streams of tokens they produce.

mod engine;
mod programs;
pub mod sample;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::cache::{Cache, Compiled, Outcome};
use crate::error::{Error, Result};
use crate::experiment::Experiment;
use crate::trace::Tensor;
use crate::train::values::{self, In, Value};
use crate::tree::Node;
use crate::tree::{Array, DType, LeafType};
pub use engine::{Engine, Stream, StreamEvent};
use programs::{DecodeIn, PrefillIn};
pub use sample::Sampling;

/// One tensor of a model's KV cache: its type for **one** row (one sequence being decoded),
/// and where the rows axis goes when the cache holds several. The generator allocates it with
/// that axis `slots` long (zeros), hands the model rows of it, and keeps it on the device
/// between calls, donated to each.
///
/// A block's keys are typically `[heads, context, head_dim]` with `row_axis` 0; a stack of
/// blocks run as one scan ([`nn::Repeated`](crate::nn::Repeated)) keeps
/// `[layers, heads, context, head_dim]` with `row_axis` 1, so that the scan slices layers off
/// the front.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct CacheTensor {
    /// A name for messages and the memory report (`blocks[0].k`).
    pub name: String,
    /// The type of one row's part.
    pub row: LeafType,
    /// Where the rows axis is inserted into `row`'s dims.
    pub row_axis: usize,
}

impl CacheTensor {
    /// The type of the tensor holding `rows` rows.
    pub fn with_rows(&self, rows: usize) -> LeafType {
        let mut dims = self.row.dims.clone();
        dims.insert(self.row_axis.min(dims.len()), rows);
        LeafType::new(self.row.dtype, &dims)
    }
}

/// What a model that decodes declares about itself, from its GraphConst shape alone.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeShape {
    /// The vocabulary: logits are `[rows, time, vocab]`.
    pub vocab: usize,
    /// The most positions a row may hold: the cache's length, and, for a model with learned
    /// absolute positions, the last position it has an embedding for (a row past it is
    /// re-prefilled from its recent tail).
    pub context: usize,
    /// The KV cache, tensor by tensor (see [`CacheTensor`]).
    pub cache: Vec<CacheTensor>,
}

/// A model whose forward pass runs over a KV cache: what the generator compiles its prefill
/// and decode programs from.
///
/// `decode` takes `tokens` (`i32 [rows, time]`), the position of each row's first token
/// `start` (`i32 [rows]`: token `j` of row `r` sits at `start[r] + j`), and the cache — one
/// tensor per [`CacheTensor`] of [`shape`](Decoder::decode_shape), each with a rows axis of
/// `rows` — and returns the logits (`[rows, time, vocab]`) and the cache with this call's keys
/// and values written at their positions. Position `p` of a row attends to the positions
/// `0..=p` of that row: what the cache holds below `start[r]` and what this call writes. The
/// cache past a row's last written position holds whatever was there (zeros, or an earlier
/// request's values): the model must mask it, never read it.
///
/// Greedy decoding through `decode` must give the tokens that the full forward pass over the
/// whole window gives (the correctness oracle of the tests).
pub trait Decoder: Experiment + Sync + 'static {
    /// The model's decoding shape (vocabulary, context, cache).
    fn decode_shape(&self) -> DecodeShape;

    /// The logits of `tokens` at `start`, and the cache written (see the trait's docs).
    fn decode(
        v: &Self::View<'_>,
        tokens: Tensor,
        start: Tensor,
        cache: Vec<Tensor>,
    ) -> (Tensor, Vec<Tensor>);
}

/// A generator's declared shape: what it compiles up front, and all it will ever run.
///
/// ```
/// use nitro::generate::GenerateConfig;
/// let config = GenerateConfig::new().slots(8).buckets([16, 32, 64]).chunks([4, 16]);
/// assert_eq!(config.largest_bucket(), 64);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateConfig {
    slots: usize,
    buckets: Vec<usize>,
    chunks: Vec<usize>,
    max_top_k: usize,
    queue: usize,
}

impl Default for GenerateConfig {
    fn default() -> Self {
        GenerateConfig::new()
    }
}

impl GenerateConfig {
    /// 4 slots, prompt buckets of 16, 32, 64 and 128 tokens (those that fit the model's
    /// context), decode chunks of 8 steps, top-k up to 64, 64 requests waiting at most.
    pub fn new() -> GenerateConfig {
        GenerateConfig {
            slots: 4,
            buckets: vec![16, 32, 64, 128],
            chunks: vec![8],
            max_top_k: 64,
            queue: 64,
        }
    }

    /// The most sequences decoded at once: the KV cache holds this many rows.
    pub fn slots(mut self, slots: usize) -> GenerateConfig {
        self.slots = slots;
        self
    }

    /// The prompt-length buckets: one prefill program each, a prompt padded to the smallest
    /// that holds it ([`crate::data::buckets::plan_edges`] picks edges for a sample of lengths).
    pub fn buckets(mut self, edges: impl IntoIterator<Item = usize>) -> GenerateConfig {
        self.buckets = edges.into_iter().collect();
        self.buckets.sort_unstable();
        self.buckets.dedup();
        self
    }

    /// The decode chunk sizes: one decode program each, running that many steps of every slot
    /// as one loop on the device (the stop check inside), so a stream gets tokens a chunk at a
    /// time with no host round trip per token. The smallest runs while requests wait for a
    /// slot (they join sooner), the largest otherwise.
    pub fn chunks(mut self, sizes: impl IntoIterator<Item = usize>) -> GenerateConfig {
        self.chunks = sizes.into_iter().collect();
        self.chunks.sort_unstable();
        self.chunks.dedup();
        self
    }

    /// The largest top-k a request may ask for (part of the programs; at most the model's
    /// vocabulary, to which a larger value is lowered).
    pub fn max_top_k(mut self, k: usize) -> GenerateConfig {
        self.max_top_k = k;
        self
    }

    /// The most requests waiting for a slot; past it [`Generator::submit`] refuses
    /// ([`Error::InvalidRequest`] on `queue`).
    pub fn queue(mut self, waiting: usize) -> GenerateConfig {
        self.queue = waiting;
        self
    }

    /// The slots declared.
    pub fn slot_count(&self) -> usize {
        self.slots
    }

    /// The prompt buckets declared, ascending.
    pub fn bucket_edges(&self) -> &[usize] {
        &self.buckets
    }

    /// The decode chunk sizes declared, ascending.
    pub fn chunk_sizes(&self) -> &[usize] {
        &self.chunks
    }

    /// The largest top-k a request may ask for.
    pub fn top_k_limit(&self) -> usize {
        self.max_top_k
    }

    /// The most requests waiting for a slot.
    pub fn queue_bound(&self) -> usize {
        self.queue
    }

    /// The largest prompt bucket: the longest prompt accepted.
    pub fn largest_bucket(&self) -> usize {
        self.buckets.last().copied().unwrap_or(0)
    }

    /// The declaration checked against a model of `shape`: buckets that fit its context
    /// (those past it dropped when others remain), at least one slot, chunk and bucket.
    fn fitted(mut self, shape: &DecodeShape) -> Result<GenerateConfig> {
        let bad = |field, why: String| Err(Error::InvalidRequest { field, why });
        if self.slots == 0 {
            return bad("slots", "is 0: give at least one slot".into());
        }
        if self.chunks.is_empty() || self.chunks[0] == 0 {
            return bad(
                "chunks",
                format!("are {:?}: give sizes of at least 1", self.chunks),
            );
        }
        if self.max_top_k == 0 {
            return bad(
                "max_top_k",
                "is 0: give at least 1 (a request's top_k 0 turns top-k off)".into(),
            );
        }
        // A top-k past the vocabulary keeps every token.
        self.max_top_k = self.max_top_k.min(shape.vocab);
        let fits: Vec<usize> = self
            .buckets
            .iter()
            .copied()
            .filter(|&b| b >= 1 && b <= shape.context)
            .collect();
        if fits.is_empty() {
            return bad(
                "buckets",
                format!(
                    "are {:?}, and none is 1 ..= the model's context {}",
                    self.buckets, shape.context
                ),
            );
        }
        self.buckets = fits;
        Ok(self)
    }
}

/// One request: a prompt of token ids, how many tokens to generate, how to sample them, and
/// what ends it early.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// The most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// How to draw them.
    pub sampling: Sampling,
    /// A token that ends the request when drawn (kept as its last token).
    pub end_token: Option<u32>,
    /// Token sequences that end the request when its text ends with one (kept in the text).
    pub stop: Vec<Vec<u32>>,
}

impl Request {
    /// `max_tokens` tokens after `prompt`, greedy, no end token.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Request {
        Request {
            prompt,
            max_tokens,
            sampling: Sampling::greedy(),
            end_token: None,
            stop: Vec::new(),
        }
    }

    /// This request drawing as `sampling` says.
    pub fn sampling(mut self, sampling: Sampling) -> Request {
        self.sampling = sampling;
        self
    }

    /// This request ending at `token`.
    pub fn end_token(mut self, token: u32) -> Request {
        self.end_token = Some(token);
        self
    }

    /// This request ending after the tokens `stop`.
    pub fn stop(mut self, stop: Vec<u32>) -> Request {
        self.stop.push(stop);
        self
    }
}

/// A request's number in its generator.
pub type RequestId = u64;

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum StopReason {
    /// It generated `max_tokens`.
    Length,
    /// It drew its end token.
    EndToken,
    /// Its text ended with a stop sequence.
    StopSequence,
    /// [`Generator::cancel`] ended it.
    Cancelled,
}

/// What a finished request did.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Record {
    /// The request.
    pub id: RequestId,
    /// The tokens generated (after the prompt).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub stop: StopReason,
    /// The prompt's tokens.
    pub prompt_tokens: usize,
    /// From submission to its first token.
    pub time_to_first_token: Option<Duration>,
    /// From submission to its end.
    pub elapsed: Duration,
    /// Its tokens after the first over the time after the first: the decode rate it saw.
    pub tokens_per_s: f64,
    /// How often its window was full and its recent tail prefilled again.
    pub context_shifts: usize,
}

/// What one [`Generator::step`] produced.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// New tokens of a request, in order.
    Tokens {
        /// The request.
        id: RequestId,
        /// Its new tokens.
        tokens: Vec<u32>,
    },
    /// A request ended; its record.
    Finished(Record),
}

/// The programs a generator holds, by what they are for, and what getting each did.
#[derive(Clone, Debug)]
pub struct Inventory {
    /// Per prompt bucket, what its prefill's lookup did.
    pub prefill: Vec<(usize, Outcome)>,
    /// Per chunk size, what its decode's lookup did.
    pub decode: Vec<(usize, Outcome)>,
    /// The time the lookups took (tracing, loading or compiling).
    pub warm_up: Duration,
}

impl Inventory {
    /// How many of the lookups compiled.
    pub fn compiles(&self) -> usize {
        self.prefill
            .iter()
            .chain(&self.decode)
            .filter(|(_, o)| matches!(o, Outcome::Compiled { .. }))
            .count()
    }
}

/// A request in a slot.
struct Active {
    id: RequestId,
    request: Request,
    submitted: Instant,
    first: Option<Instant>,
    generated: Vec<u32>,
    key: [u32; 2],
    drawn: u32,
    last: u32,
    pos: usize,
    shifts: usize,
}

/// A trained model writing text: its programs compiled (or loaded) up front, a KV cache on the
/// device, and slots that requests join and leave (continuous batching).
///
/// [`new`](Generator::new) gets every program the declaration names — a prefill per prompt
/// bucket, a decode per chunk size — from the compile cache, keyed like a training program
/// (a second process loads them all and compiles none). After that the generator never looks
/// a program up again: a request that would need another (a prompt past the largest bucket,
/// a top-k past the declared largest) is refused when submitted, naming the declaration, so
/// nothing ever compiles after warm-up.
///
/// [`submit`](Generator::submit) queues a request; [`step`](Generator::step) puts waiting
/// requests into free slots (a prefill each) and runs one decode chunk over every slot,
/// returning the tokens each request gained and the records of those that ended. A row whose
/// window is full (its position at the model's context) is prefilled again from its recent
/// tail (half the context, at most the largest bucket), counted in its record, so a request may
/// generate past the context.
pub struct Generator<E: Decoder> {
    experiment: E,
    backend: &'static dyn Backend,
    shape: DecodeShape,
    config: GenerateConfig,
    leaves: Vec<Value>,
    kv: Vec<Value>,
    prefill: Vec<(usize, Arc<Compiled>)>,
    decode: Vec<(usize, Arc<Compiled>)>,
    inventory: Inventory,
    slots: Vec<Option<Active>>,
    queue: VecDeque<(RequestId, Request, Instant)>,
    next_id: RequestId,
}

impl<E: Decoder> Generator<E> {
    /// A generator of `experiment`'s model (its Device leaves as they are: a trained handle's
    /// [`into_experiment`](crate::train::Nitro::into_experiment), or an experiment loaded from
    /// a checkpoint or weights) on the process's backend and compile cache.
    pub fn new(experiment: E, config: GenerateConfig) -> Result<Generator<E>> {
        Generator::with_backend(
            experiment,
            config,
            crate::backend::current()?,
            crate::cache::global(),
        )
    }

    /// [`new`](Generator::new) on `backend` (one device) with `cache`.
    pub fn with_backend(
        experiment: E,
        config: GenerateConfig,
        backend: &'static dyn Backend,
        cache: &Cache,
    ) -> Result<Generator<E>> {
        let shape = experiment.decode_shape();
        let config = config.fitted(&shape)?;
        let mut arrays = Vec::new();
        experiment.visit_device(&mut |_, _, node| {
            if let Node::Leaf(a) = node {
                arrays.push(a.clone());
            }
        });
        let leaves = values::place(backend, arrays)?;
        let kv_types: Vec<LeafType> = shape
            .cache
            .iter()
            .map(|c| c.with_rows(config.slots))
            .collect();
        let kv = values::place(
            backend,
            kv_types
                .iter()
                .map(|t| Array::zeros(t.dtype, &t.dims))
                .collect(),
        )?;
        let started = Instant::now();
        let axes: Vec<usize> = shape.cache.iter().map(|c| c.row_axis).collect();
        let n = shape.cache.len();
        let (mut prefill, mut decode) = (Vec::new(), Vec::new());
        let mut inventory = Inventory {
            prefill: Vec::new(),
            decode: Vec::new(),
            warm_up: Duration::ZERO,
        };
        programs::tracing(axes, config.max_top_k, || -> Result<()> {
            for &bucket in &config.buckets {
                let shaped = prefill_shape(&kv_types, bucket);
                let served =
                    cache.get(backend, &programs::prefill::<E>(n), &experiment, &shaped)?;
                inventory.prefill.push((bucket, served.outcome.clone()));
                prefill.push((bucket, served.compiled));
            }
            for &chunk in &config.chunks {
                let shaped = decode_shape(&kv_types, config.slots, chunk);
                let served = cache.get(backend, &programs::decode::<E>(n), &experiment, &shaped)?;
                inventory.decode.push((chunk, served.outcome.clone()));
                decode.push((chunk, served.compiled));
            }
            Ok(())
        })?;
        inventory.warm_up = started.elapsed();
        let slots = (0..config.slots).map(|_| None).collect();
        Ok(Generator {
            experiment,
            backend,
            shape,
            config,
            leaves,
            kv,
            prefill,
            decode,
            inventory,
            slots,
            queue: VecDeque::new(),
            next_id: 0,
        })
    }

    /// The preflight of a generator of `experiment` declared by `config`: what getting each
    /// of its programs would do (serve from memory, load, fetch or compile, with the miss
    /// reason and the recorded compile time), found without compiling or loading anything.
    /// Entries are `prefill` per bucket and `decode` per chunk size (`edge`).
    pub fn plan(
        experiment: &E,
        config: &GenerateConfig,
        backend: &dyn Backend,
        cache: &Cache,
    ) -> Result<crate::train::Plan> {
        let shape = experiment.decode_shape();
        let config = config.clone().fitted(&shape)?;
        let kv_types: Vec<LeafType> = shape
            .cache
            .iter()
            .map(|c| c.with_rows(config.slots))
            .collect();
        let axes: Vec<usize> = shape.cache.iter().map(|c| c.row_axis).collect();
        let n = shape.cache.len();
        let mut plan = crate::train::Plan::default();
        programs::tracing(axes, config.max_top_k, || -> Result<()> {
            for &bucket in &config.buckets {
                let shaped = prefill_shape(&kv_types, bucket);
                let probe =
                    cache.probe(backend, &programs::prefill::<E>(n), experiment, &shaped)?;
                plan.entries.push(crate::train::PlanEntry {
                    role: "prefill".into(),
                    edge: Some(bucket),
                    probe,
                });
            }
            for &chunk in &config.chunks {
                let shaped = decode_shape(&kv_types, config.slots, chunk);
                let probe = cache.probe(backend, &programs::decode::<E>(n), experiment, &shaped)?;
                plan.entries.push(crate::train::PlanEntry {
                    role: "decode".into(),
                    edge: Some(chunk),
                    probe,
                });
            }
            Ok(())
        })?;
        Ok(plan)
    }

    /// The programs it holds and what getting them did.
    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    /// The declaration, as fitted to the model (buckets past its context dropped).
    pub fn config(&self) -> &GenerateConfig {
        &self.config
    }

    /// The model's decoding shape.
    pub fn decode_shape(&self) -> &DecodeShape {
        &self.shape
    }

    /// The backend its programs run on.
    pub fn backend(&self) -> &'static dyn Backend {
        self.backend
    }

    /// The experiment whose model it runs.
    pub fn experiment(&self) -> &E {
        &self.experiment
    }

    /// The KV cache's bytes on the device: every slot's rows of every cache tensor.
    pub fn kv_cache_bytes(&self) -> u64 {
        self.shape
            .cache
            .iter()
            .filter_map(|c| c.with_rows(self.config.slots).size_bytes())
            .sum()
    }

    /// Requests in slots or waiting.
    pub fn pending(&self) -> usize {
        self.queue.len() + self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Whether any request is in a slot or waiting.
    pub fn busy(&self) -> bool {
        self.pending() > 0
    }

    /// Queues `request`, checked against the model and the declaration first: a prompt of 1
    /// ..= the largest bucket's tokens, each below the vocabulary; `max_tokens` at least 1;
    /// sampling settings in range ([`Sampling::check`]); an end token below the vocabulary;
    /// room in the queue. Each refusal is [`Error::InvalidRequest`] naming the field.
    pub fn submit(&mut self, request: Request) -> Result<RequestId> {
        let bad = |field, why: String| Err(Error::InvalidRequest { field, why });
        let (vocab, largest) = (self.shape.vocab, self.config.largest_bucket());
        if request.prompt.is_empty() {
            return bad("prompt", "is empty: give at least one token".into());
        }
        if request.prompt.len() > largest {
            return bad(
                "prompt",
                format!(
                    "holds {} tokens, and the largest prompt bucket declared is {largest}: \
                     declare a larger bucket (at most the context, {}) or shorten the prompt",
                    request.prompt.len(),
                    self.shape.context
                ),
            );
        }
        if let Some(&t) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
            return bad(
                "prompt",
                format!("holds token {t}, and the vocabulary has {vocab}"),
            );
        }
        if request.max_tokens == 0 || request.max_tokens > i32::MAX as usize {
            return bad(
                "max_tokens",
                format!("is {}: give 1 ..= {}", request.max_tokens, i32::MAX),
            );
        }
        if let Some(t) = request.end_token.filter(|&t| t as usize >= vocab) {
            return bad(
                "end_token",
                format!("is {t}, and the vocabulary has {vocab}"),
            );
        }
        request.sampling.check(self.config.max_top_k)?;
        if self.queue.len() >= self.config.queue {
            return bad(
                "queue",
                format!(
                    "is full ({} requests wait for {} slots): try again later",
                    self.queue.len(),
                    self.config.slots
                ),
            );
        }
        let id = self.next_id;
        self.next_id += 1;
        self.queue.push_back((id, request, Instant::now()));
        Ok(id)
    }

    /// Ends request `id`, waiting or in a slot (its slot is free at once): its record, or
    /// `None` when no such request is pending.
    pub fn cancel(&mut self, id: RequestId) -> Option<Record> {
        if let Some(i) = self.queue.iter().position(|(q, _, _)| *q == id) {
            let (id, request, submitted) = self.queue.remove(i)?;
            return Some(Record {
                id,
                tokens: Vec::new(),
                stop: StopReason::Cancelled,
                prompt_tokens: request.prompt.len(),
                time_to_first_token: None,
                elapsed: submitted.elapsed(),
                tokens_per_s: 0.0,
                context_shifts: 0,
            });
        }
        let slot = self
            .slots
            .iter()
            .position(|s| s.as_ref().is_some_and(|a| a.id == id))?;
        let active = self.slots[slot].take()?;
        Some(record(active, StopReason::Cancelled))
    }

    /// Puts waiting requests into free slots (a prefill each), then runs one decode chunk over
    /// the slots: the tokens each request gained, in order, and the records of those that
    /// ended.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        while let Some(slot) = self.slots.iter().position(Option::is_none) {
            let Some((id, request, submitted)) = self.queue.pop_front() else {
                break;
            };
            let active = Active {
                id,
                key: request.sampling.key(),
                request,
                submitted,
                first: None,
                generated: Vec::new(),
                drawn: 0,
                last: 0,
                pos: 0,
                shifts: 0,
            };
            self.slots[slot] = Some(active);
            let prompt = self.slots[slot].as_ref().map(|a| a.request.prompt.clone());
            self.prefill_slot(slot, &prompt.unwrap_or_default(), &mut events)?;
        }
        if self.slots.iter().any(Option::is_some) {
            self.decode_chunk(&mut events)?;
        }
        Ok(events)
    }

    /// Runs [`step`](Generator::step) until every request pending has ended: their records,
    /// in the order they ended.
    pub fn run_to_end(&mut self) -> Result<Vec<Record>> {
        let mut records = Vec::new();
        while self.busy() {
            for event in self.step()? {
                if let Event::Finished(r) = event {
                    records.push(r);
                }
            }
        }
        Ok(records)
    }

    /// `request` alone, to its end: its record.
    pub fn generate(&mut self, request: Request) -> Result<Record> {
        let id = self.submit(request)?;
        loop {
            for event in self.step()? {
                if let Event::Finished(r) = event {
                    if r.id == id {
                        return Ok(r);
                    }
                }
            }
        }
    }

    /// Prefills `slot` with `tokens` (a prompt, or a row's tail after its window filled) and
    /// takes the token it draws.
    fn prefill_slot(&mut self, slot: usize, tokens: &[u32], events: &mut Vec<Event>) -> Result<()> {
        let Some(active) = self.slots[slot].as_mut() else {
            return Ok(());
        };
        let Some((bucket, compiled)) = self
            .prefill
            .iter()
            .find(|(b, _)| *b >= tokens.len())
            .cloned()
        else {
            return Err(Error::InvalidRequest {
                field: "prompt",
                why: format!(
                    "holds {} tokens, past the largest bucket {}",
                    tokens.len(),
                    self.config.largest_bucket()
                ),
            });
        };
        let mut padded: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        padded.resize(bucket, 0);
        let s = &active.request.sampling;
        let small = [
            Array::from_vec(&[1, bucket], padded)?,
            Array::scalar(slot as i32),
            Array::scalar(tokens.len() as i32),
            Array::from_vec(&[1, 2], active.key.to_vec())?,
            Array::from_vec(&[1], vec![active.drawn])?,
            Array::from_vec(&[1], vec![s.temperature])?,
            Array::from_vec(&[1], vec![s.top_k as i32])?,
            Array::from_vec(&[1], vec![s.top_p])?,
        ];
        let outputs = self.run(&compiled, &small)?;
        let token = outputs
            .first()
            .ok_or_else(no_output)?
            .to_host()?
            .as_slice::<i32>()?
            .first()
            .copied()
            .ok_or_else(no_output)?;
        let Some(active) = self.slots[slot].as_mut() else {
            return Ok(());
        };
        active.pos = tokens.len();
        active.drawn += 1;
        self.took(slot, &[token.max(0) as u32], events);
        Ok(())
    }

    /// Runs `compiled` on the model's leaves, the cache (given, and replaced by the outputs
    /// it is donated to) and `small` (uploaded): the outputs after the cache.
    fn run(&mut self, compiled: &Compiled, small: &[Array]) -> Result<Vec<Value>> {
        let n = self.kv.len();
        let mut args: Vec<In<'_>> = self.leaves.iter().map(In::Keep).collect();
        args.extend(std::mem::take(&mut self.kv).into_iter().map(In::Give));
        args.extend(small.iter().map(In::Whole));
        let (mut outputs, done) = values::exec(compiled, args)?;
        drop(done);
        if outputs.len() < n {
            return Err(no_output());
        }
        let rest = outputs.split_off(n);
        self.kv = outputs;
        Ok(rest)
    }

    /// One decode chunk over every slot.
    fn decode_chunk(&mut self, events: &mut Vec<Event>) -> Result<()> {
        let slots = self.config.slots;
        let (chunk, compiled) = match self.queue.is_empty() {
            true => self.decode.last(),
            false => self.decode.first(),
        }
        .cloned()
        .ok_or_else(no_output)?;
        let (mut last, mut pos, mut budget, mut drawn) = (
            vec![0i32; slots],
            vec![0i32; slots],
            vec![0i32; slots],
            vec![0u32; slots],
        );
        let (mut keys, mut temperature, mut top_k, mut top_p, mut end) = (
            vec![0u32; 2 * slots],
            vec![0f32; slots],
            vec![0i32; slots],
            vec![1f32; slots],
            vec![-1i32; slots],
        );
        let limit = self.shape.context;
        for (r, a) in self.slots.iter().enumerate() {
            let Some(a) = a else { continue };
            last[r] = a.last as i32;
            pos[r] = a.pos.min(limit) as i32;
            budget[r] = (a.request.max_tokens - a.generated.len()) as i32;
            drawn[r] = a.drawn;
            keys[2 * r..2 * r + 2].copy_from_slice(&a.key);
            let s = &a.request.sampling;
            temperature[r] = s.temperature;
            top_k[r] = s.top_k as i32;
            top_p[r] = s.top_p;
            end[r] = a.request.end_token.map_or(-1, |t| t as i32);
        }
        let small = [
            Array::from_vec(&[slots], last)?,
            Array::from_vec(&[slots], pos)?,
            Array::from_vec(&[slots], budget)?,
            Array::from_vec(&[slots], drawn)?,
            Array::from_vec(&[slots, 2], keys)?,
            Array::from_vec(&[slots], temperature)?,
            Array::from_vec(&[slots], top_k)?,
            Array::from_vec(&[slots], top_p)?,
            Array::from_vec(&[slots], end)?,
            Array::scalar(limit as i32),
            Array::zeros(DType::I32, &[slots, chunk]),
        ];
        let outputs = self.run(&compiled, &small)?;
        // last, pos, budget, drawn, out
        let host = |i: usize| -> Result<Array> { outputs.get(i).ok_or_else(no_output)?.to_host() };
        let (pos, drawn, out) = (host(1)?, host(3)?, host(4)?);
        let (pos, drawn, out) = (
            pos.as_slice::<i32>()?.to_vec(),
            drawn.as_slice::<u32>()?.to_vec(),
            out.as_slice::<i32>()?.to_vec(),
        );
        let mut shift = Vec::new();
        for r in 0..slots {
            let Some(a) = self.slots[r].as_mut() else {
                continue;
            };
            a.pos = pos[r].max(0) as usize;
            a.drawn = drawn[r];
            let tokens: Vec<u32> = out[r * chunk..(r + 1) * chunk]
                .iter()
                .take_while(|&&t| t >= 0)
                .map(|&t| t as u32)
                .collect();
            if !tokens.is_empty() {
                self.took(r, &tokens, events);
            }
            if let Some(a) = self.slots[r].as_ref() {
                if a.pos >= limit {
                    shift.push(r);
                }
            }
        }
        // Rows whose window is full: their recent tail prefilled again.
        for r in shift {
            let keep = (limit / 2).min(self.config.largest_bucket()).max(1);
            let Some(a) = self.slots[r].as_mut() else {
                continue;
            };
            a.shifts += 1;
            let mut text: Vec<u32> = a.request.prompt.clone();
            text.extend(&a.generated);
            let tail = text[text.len().saturating_sub(keep)..].to_vec();
            self.prefill_slot(r, &tail, events)?;
        }
        Ok(())
    }

    /// Slot `slot`'s request gained `tokens`: they are appended (up to a stop), an event says
    /// so, and a request that ended leaves its slot.
    fn took(&mut self, slot: usize, tokens: &[u32], events: &mut Vec<Event>) {
        let Some(a) = self.slots[slot].as_mut() else {
            return;
        };
        if a.first.is_none() {
            a.first = Some(Instant::now());
        }
        let mut stop = None;
        let mut given = Vec::new();
        for &t in tokens {
            if a.generated.len() >= a.request.max_tokens {
                stop = Some(StopReason::Length);
                break;
            }
            a.generated.push(t);
            given.push(t);
            a.last = t;
            if a.request.end_token == Some(t) {
                stop = Some(StopReason::EndToken);
                break;
            }
            if a.request
                .stop
                .iter()
                .any(|s| !s.is_empty() && a.generated.ends_with(s))
            {
                stop = Some(StopReason::StopSequence);
                break;
            }
            if a.generated.len() >= a.request.max_tokens {
                stop = Some(StopReason::Length);
                break;
            }
        }
        if !given.is_empty() {
            events.push(Event::Tokens {
                id: a.id,
                tokens: given,
            });
        }
        if let Some(stop) = stop {
            if let Some(active) = self.slots[slot].take() {
                events.push(Event::Finished(record(active, stop)));
            }
        }
    }
}

/// The record of a request that ended for `stop`.
fn record(a: Active, stop: StopReason) -> Record {
    let elapsed = a.submitted.elapsed();
    let ttft = a.first.map(|f| f.duration_since(a.submitted));
    let after_first = a.first.map_or(Duration::ZERO, |f| f.elapsed());
    let rest = a.generated.len().saturating_sub(1);
    Record {
        id: a.id,
        prompt_tokens: a.request.prompt.len(),
        tokens: a.generated,
        stop,
        time_to_first_token: ttft,
        elapsed,
        tokens_per_s: match after_first.as_secs_f64() {
            s if s > 0.0 && rest > 0 => rest as f64 / s,
            _ => 0.0,
        },
        context_shifts: a.shifts,
    }
}

fn no_output() -> Error {
    Error::Misconfigured {
        message: "a generation program returned fewer outputs than it declares".into(),
    }
}

/// The inputs a prefill of `bucket` tokens is traced on (values unused).
fn prefill_shape(kv: &[LeafType], bucket: usize) -> PrefillIn {
    PrefillIn {
        cache: kv.iter().map(|t| Array::zeros(t.dtype, &t.dims)).collect(),
        tokens: Array::zeros(DType::I32, &[1, bucket]),
        slot: Array::scalar(0i32),
        length: Array::scalar(1i32),
        key: Array::zeros(DType::U32, &[1, 2]),
        drawn: Array::zeros(DType::U32, &[1]),
        temperature: Array::zeros(DType::F32, &[1]),
        top_k: Array::zeros(DType::I32, &[1]),
        top_p: Array::zeros(DType::F32, &[1]),
    }
}

/// The inputs a decode chunk of `chunk` steps over `slots` is traced on (values unused).
fn decode_shape(kv: &[LeafType], slots: usize, chunk: usize) -> DecodeIn {
    let row = |dtype| Array::zeros(dtype, &[slots]);
    DecodeIn {
        cache: kv.iter().map(|t| Array::zeros(t.dtype, &t.dims)).collect(),
        last: row(DType::I32),
        pos: row(DType::I32),
        budget: row(DType::I32),
        drawn: row(DType::U32),
        keys: Array::zeros(DType::U32, &[slots, 2]),
        temperature: row(DType::F32),
        top_k: row(DType::I32),
        top_p: row(DType::F32),
        end: row(DType::I32),
        limit: Array::scalar(0i32),
        out: Array::zeros(DType::I32, &[slots, chunk]),
    }
}
