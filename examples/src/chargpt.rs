//! The character-level GPT of `--example chargpt`: token and position embeddings, pre-norm
//! causal blocks from [`nitro::nn`], a final norm and a linear head. Here in the library so that
//! the example, its JAX twin's bundle and the tests that hold it to JAX build the same model.

use nitro::data::Dataset;
use nitro::nn::{
    self, BlockParams, Embedding, EmbeddingParams, Layer, LayerNorm, Linear, LinearParams,
    NormParams, Repeated, TransformerBlock,
};
use nitro::optim::{AdamW, Cosine};
use nitro::prelude::*;
use nitro::train::{FromBatch, Model};

use std::path::PathBuf;

use nitro::data::text::Vocab;

use crate::{
    at_least_one, below_one, check_checkpoint_input, check_checkpoint_path, finite_above_zero,
    FlagError, HandleFlags,
};

/// The model's shape (a GraphConst).
#[derive(ContentHash, Clone, Debug)]
pub struct GptArch {
    /// Token embeddings.
    pub tokens: Embedding,
    /// Position embeddings.
    pub positions: Embedding,
    /// The blocks, unrolled (empty when they are `stack`).
    pub blocks: Vec<TransformerBlock>,
    /// The blocks as one scan over stacked parameters (`--scan`), or `None`.
    pub stack: Option<Repeated<TransformerBlock>>,
    /// The final norm.
    pub norm: LayerNorm,
    /// The head: width → vocabulary.
    pub head: Linear,
}

/// How `--sample` generates ([`Args::sample_mode`]).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleMode {
    /// Through the generator (`nitro::generate`): prefill, then decode over a KV cache.
    Cache,
    /// The evaluation program over a full batch of windows, once per character.
    Recompute,
}

/// The experiment.
#[experiment]
#[derive(Clone)]
pub struct CharGpt {
    /// The shape.
    #[graph_const]
    pub arch: GptArch,
    /// Token embeddings.
    #[device(trainable)]
    pub tokens: EmbeddingParams,
    /// Position embeddings.
    #[device(trainable)]
    pub positions: EmbeddingParams,
    /// The blocks' parameters, unrolled (`blocks[i].…`; empty when they are `stack`).
    #[device(trainable)]
    pub blocks: Vec<BlockParams>,
    /// The blocks' parameters stacked (`stack.…`, every leaf `[layers, …]`) for the scan.
    #[device(trainable)]
    pub stack: Option<BlockParams>,
    /// The final norm.
    #[device(trainable)]
    pub norm: NormParams,
    /// The head.
    #[device(trainable)]
    pub head: LinearParams,
}

/// Windows of characters: inputs `x` and next characters `y`, `i32 [n, T]` each, and — for
/// documents padded to a bucket's edge — which positions are real (`valid`, `f32 [n, T]`).
#[derive(Tree, Clone)]
pub struct Windows {
    /// Inputs.
    pub x: Array,
    /// Targets.
    pub y: Array,
    /// 1 at real positions, 0 at padding (bucketed batches only).
    pub valid: Option<Array>,
}

impl FromBatch for Windows {
    fn from_batch(mut b: nitro::data::Batch) -> nitro::Result<Windows> {
        Ok(Windows {
            x: b.take("x")?,
            y: b.take("y")?,
            valid: b.take(nitro::data::buckets::VALID).ok(),
        })
    }
}

/// The next-character scores of windows `x` (`i32 [n, T]`), `[n, T, vocab]`.
pub fn logits(v: &CharGptView<'_>, x: Tensor) -> Tensor {
    let a = &v.arch;
    let t = x.dims()[1];
    let h = a.tokens.forward(&v.tokens, x) + a.positions.positions(&v.positions, t);
    let h = match (&a.stack, &v.stack) {
        (Some(blocks), Some(p)) => blocks.forward(p, h),
        _ => nn::stack(&a.blocks, &v.blocks, h, |h| h),
    };
    a.head.forward(&v.head, a.norm.forward(&v.norm, h))
}

impl Model for CharGpt {
    type Batch = Windows;
    const RANDOM: bool = true;

    /// The mean cross-entropy over a window's (real) positions, in nats. Padding comes after a
    /// document's real positions, so causal attention already keeps it out of them.
    fn loss(v: &CharGptView<'_>, b: &WindowsMirror<Tensor>) -> Tensor {
        let ce = nn::softmax_cross_entropy(logits(v, b.x), b.y);
        match b.valid {
            Some(valid) => (ce * valid).sum(&[1]) / valid.sum(&[1]).maximum(1.0),
            None => ce.mean(&[1]),
        }
    }

    fn predict(v: &CharGptView<'_>, b: &WindowsMirror<Tensor>) -> Option<Tensor> {
        Some(logits(v, b.x))
    }
}

/// The model decodes through a KV cache ([`nitro::generate`]): per unrolled block two cache
/// tensors `blocks[i].k` and `blocks[i].v` (`[heads, context, head_dim]` per row), or with
/// `--scan` the stack's `stack.k` and `stack.v` (`[layers, heads, context, head_dim]` per row,
/// the rows axis second), in the dtype of the token embeddings. Its logits through the cache
/// are [`logits`]' over the whole window.
impl nitro::generate::Decoder for CharGpt {
    fn decode_shape(&self) -> nitro::generate::DecodeShape {
        let a = &self.arch;
        let context = a.positions.vocab;
        let dtype = self.tokens.table.dtype();
        let cache = match &a.stack {
            Some(stack) => stack.cache_tensors("stack", context, dtype).to_vec(),
            None => a
                .blocks
                .iter()
                .enumerate()
                .flat_map(|(i, b)| b.cache_tensors(&format!("blocks[{i}]"), context, dtype))
                .collect(),
        };
        nitro::generate::DecodeShape {
            vocab: a.head.outputs,
            context,
            cache,
        }
    }

    fn decode(
        v: &CharGptView<'_>,
        tokens: Tensor,
        start: Tensor,
        cache: Vec<Tensor>,
    ) -> (Tensor, Vec<Tensor>) {
        let a = &v.arch;
        let t = tokens.dims().get(1).copied().unwrap_or(1);
        let h =
            a.tokens.forward(&v.tokens, tokens) + a.positions.positions_at(&v.positions, start, t);
        let (h, cache) = match (&a.stack, &v.stack) {
            (Some(blocks), Some(p)) => blocks.forward_cached_list(p, h, start, cache),
            _ => nn::stack_cached(&a.blocks, &v.blocks, h, start, cache),
        };
        (a.head.forward(&v.head, a.norm.forward(&v.norm, h)), cache)
    }
}

/// The hyperparameters that shape the model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptShape {
    /// Transformer blocks.
    pub layers: usize,
    /// Model width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Context length.
    pub context: usize,
    /// Dropout while training (0: none).
    pub dropout: f64,
    /// The seed of the initial weights.
    pub seed: u64,
    /// Whether the blocks are one scan over stacked parameters (else unrolled).
    pub scan: bool,
}

impl CharGpt {
    /// The model of `shape` over a vocabulary of `vocab` characters, with fresh weights.
    pub fn new(shape: &GptShape, vocab: usize) -> CharGpt {
        let d = shape.width;
        let block = TransformerBlock {
            dropout: shape.dropout,
            ..TransformerBlock::causal(d, shape.heads)
                .expect("a shape whose heads divide its width (`Args::check` refuses others)")
        };
        let arch = GptArch {
            tokens: Embedding { vocab, dim: d },
            positions: Embedding {
                vocab: shape.context,
                dim: d,
            },
            blocks: vec![block; shape.layers],
            stack: None,
            norm: LayerNorm::new(d),
            head: Linear::new(d, vocab),
        };
        let s = |k: u64| nitro::init::Seed(shape.seed.wrapping_mul(1000).wrapping_add(k));
        let mut gpt = CharGpt {
            tokens: arch.tokens.init(s(0)),
            positions: arch.positions.init(s(1)),
            blocks: Vec::new(),
            stack: None,
            norm: arch.norm.init(s(3)),
            head: arch.head.init(s(4)),
            arch,
        };
        match (shape.scan, gpt.arch.blocks.first()) {
            // The blocks drawn as the unrolled ones are, and stacked (under `init::declared`,
            // made zeros of the stacked types without drawing or copying a layer).
            (true, Some(&block)) => {
                let blocks = Repeated::new(block, gpt.arch.blocks.len());
                gpt.stack = Some(blocks.init(s(2)));
                gpt.arch.stack = Some(blocks);
                gpt.arch.blocks.clear();
            }
            _ => gpt.blocks = nn::init_stack(&gpt.arch.blocks, s(2)),
        }
        gpt
    }

    /// The same model and weights with its blocks as one scan over stacked parameters: block
    /// `i`'s leaves become row `i` of `stack`'s (unchanged when already stacked). An error when
    /// the blocks' weights do not stack (as many as the blocks, each of one shape).
    pub fn stacked(mut self) -> nitro::Result<CharGpt> {
        let Some(&block) = self.arch.blocks.first() else {
            return Ok(self);
        };
        let blocks = Repeated::new(block, self.arch.blocks.len());
        self.stack = Some(blocks.stack_params(&self.blocks)?);
        self.arch.stack = Some(blocks);
        self.arch.blocks.clear();
        self.blocks.clear();
        Ok(self)
    }
}

/// `sharding` with the blocks split Megatron-style along mesh axis `axis` (tensor
/// parallelism): the attention's q, k and v and the MLP's first layer by their output columns
/// (so by heads and hidden units, biases too), the attention's output and the MLP's second
/// layer by their input rows — two all-reduces a block. `stacked`: the blocks' leaves are
/// `stack.…` with a leading layer dim (`--scan`), else `blocks[i].…`.
pub fn megatron(
    sharding: nitro::shard::Sharding,
    axis: &str,
    stacked: bool,
) -> nitro::shard::Sharding {
    use nitro::shard::PartitionSpec;
    let lead = usize::from(stacked);
    let split = |dim: usize| {
        let mut dims = vec![None; lead + dim + 1];
        dims[lead + dim] = Some(axis);
        PartitionSpec::new(dims)
    };
    let p = if stacked { "stack" } else { "blocks[*]" };
    let any = |leaves: &[&str]| {
        leaves
            .iter()
            .map(|l| format!("{p}.{l}"))
            .collect::<Vec<_>>()
            .join("|")
    };
    sharding
        .leaf(
            any(&["attention.q.w", "attention.k.w", "attention.v.w", "fc1.w"]),
            split(1),
        )
        .leaf(
            any(&["attention.q.b", "attention.k.b", "attention.v.b", "fc1.b"]),
            split(0),
        )
        .leaf(any(&["attention.o.w", "fc2.w"]), split(0))
}

/// `config` with the blocks split along a mesh axis named `model`, when its mesh has one
/// ([`megatron`]; the rest as the config's sharding says); unchanged otherwise.
pub fn with_tensor_parallel(config: nitro::train::Config, stacked: bool) -> nitro::train::Config {
    let Some(mesh) = &config.mesh else {
        return config;
    };
    if mesh.size("model").is_none() {
        return config;
    }
    let first = mesh.axes()[0].0.clone();
    let base = config
        .sharding
        .clone()
        .unwrap_or_else(|| nitro::shard::Sharding::replicated(first));
    config.sharding(megatron(base, "model", stacked))
}

/// The optimizer the example trains with: AdamW, sparing biases and norm gains from decay.
pub fn optimizer() -> AdamW {
    AdamW::default().no_decay([nn::NO_DECAY])
}

/// The example's learning-rate schedule for `steps` steps peaking at `lr`: cosine down to
/// `lr / 10`, after a linear warm-up over the first tenth.
pub fn schedule(lr: f64, steps: u64) -> Cosine {
    Cosine {
        base: lr,
        min: lr / 10.0,
        warmup: steps / 10,
        total: steps,
    }
}

/// `count` windows of `t + 1` characters of `ids` at seeded random starts, as a data set of
/// columns `x` (the first `t`) and `y` (the last `t`); also the starts, in row order.
///
/// Errors ([`nitro::Error::InvalidDataArgument`]): `ids` shorter than one window, or windows
/// too many to hold in memory (the allocation is checked, never an abort).
pub fn random_windows(
    ids: &[i32],
    t: usize,
    count: usize,
    seed: u64,
) -> nitro::Result<(Dataset, Vec<usize>)> {
    let mut rng = nitro::init::Rng::new(nitro::init::Seed(seed));
    let Some(span) = ids.len().checked_sub(t + 1) else {
        return Err(nitro::Error::InvalidDataArgument {
            what: format!(
                "windows of {} characters (a context of {t} and the next one) do not fit in a \
                 text of {} characters; use a shorter context or a longer text",
                t + 1,
                ids.len()
            ),
        });
    };
    let mut x = reserve::<i32>(count.checked_mul(t), "window inputs")?;
    let mut y = reserve::<i32>(count.checked_mul(t), "window targets")?;
    let mut starts = reserve::<usize>(Some(count), "window starts")?;
    for _ in 0..count {
        let s = (rng.next_f64() * span as f64) as usize;
        x.extend_from_slice(&ids[s..s + t]);
        y.extend_from_slice(&ids[s + 1..s + t + 1]);
        starts.push(s);
    }
    let data = Dataset::new([
        ("x", Array::from_vec(&[count, t], x)?),
        ("y", Array::from_vec(&[count, t], y)?),
    ])?;
    Ok((data, starts))
}

/// An empty vector with room for `len` items (`None`: a length that overflowed), or an error
/// naming `what` when the memory cannot be had: an allocation failure is an error, not an abort.
fn reserve<T>(len: Option<usize>, what: &str) -> nitro::Result<Vec<T>> {
    let too_many = || nitro::Error::InvalidDataArgument {
        what: format!(
            "{} of {what} do not fit in memory; use fewer or shorter windows",
            len.map_or_else(|| "more than 2^64".to_owned(), |n| n.to_string())
        ),
    };
    let len = len.ok_or_else(too_many)?;
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| too_many())?;
    Ok(v)
}

/// The command line of `--example chargpt`: trains a small character-level GPT on the fortunes
/// and reports held-out bits per character.
///
/// [`Args::validate`] refuses, before anything is loaded, every setting that cannot train (each
/// error names the flag and its value); [`Args::check_memory`], [`Args::check_corpus`] and
/// [`Args::check_prompt`] refuse what the machine or the corpus cannot hold, still before
/// anything compiles.
///
/// ```
/// use clap::Parser;
/// use nitro_examples::chargpt::Args;
///
/// let args = Args::try_parse_from(["chargpt", "--lr", "NaN"]).unwrap();
/// let err = args.validate().unwrap_err().to_string();
/// assert!(err.starts_with("--lr NaN: "), "{err}");
/// ```
//
// `--help` shows the `about` and `long_about` below, not this comment: clap would otherwise print
// the doc comment above, code block and links included.
#[derive(clap::Parser, Clone, Debug)]
#[command(
    name = "chargpt",
    about = "Trains a small character-level GPT on the fortunes and reports held-out bits per \
             character.",
    long_about = "Trains a small character-level GPT (token and position embeddings, pre-norm \
                  causal blocks, a linear head) on the fortunes (the Debian `fortunes` corpus) \
                  and reports held-out bits per character against the corpus's unigram entropy.\n\n\
                  Every flag is checked before anything is loaded or compiled: a setting that \
                  cannot train, an output path that cannot be written, a --context beyond the \
                  corpus or a --steps beyond memory is one sentence naming the flag and its \
                  value, and exit status 1."
)]
pub struct Args {
    /// Training steps.
    #[arg(long, default_value_t = 1000)]
    pub steps: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Run the blocks as one scan over stacked parameters (`nitro::nn::Repeated`): the
    /// gradient program holds one block however many there are. Without it they are unrolled.
    #[arg(long)]
    pub scan: bool,
    /// With `--scan`: recompute each block's forward pass in the reverse pass instead of
    /// saving its intermediates (less memory, about one more forward pass of compute).
    #[arg(long)]
    pub remat: bool,
    /// Model width (a multiple of --heads).
    #[arg(long, default_value_t = 128)]
    pub width: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Context length.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Windows per step.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Peak learning rate (a finite number above 0).
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f64,
    /// Dropout while training (at least 0, below 1).
    #[arg(long, default_value_t = 0.1)]
    pub dropout: f64,
    /// The seed of the weights, the windows and the dropout stream.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Characters to generate after training.
    #[arg(long, default_value_t = 0)]
    pub sample: usize,
    /// The text generation starts from (in the corpus's characters).
    #[arg(long, default_value = "The ")]
    pub prompt: String,
    /// Sampling temperature (a finite number above 0).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample among the k likeliest characters only (0: all).
    #[arg(long, default_value_t = 20)]
    pub top_k: usize,
    /// Sample among the likeliest characters whose probabilities reach this much (in (0, 1];
    /// 1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Texts generated at once by `--sample` (the generator's slots): one per slot, each from
    /// its own seed (`--seed` + 7 + slot).
    #[arg(long, default_value_t = 1)]
    pub slots: usize,
    /// How `--sample` generates: `cache` (the generator: a KV cache on the device, sampling
    /// there, nothing recompiled) or `recompute` (the evaluation program on a full batch of
    /// windows per character: the slow path, kept to measure against).
    #[arg(long, value_enum, default_value_t = SampleMode::Cache)]
    pub sample_mode: SampleMode,
    /// Save a checkpoint here after training: a checkpoint directory (each device's shards a
    /// part of their own; created in an existing directory), or one file for a path ending in
    /// `.safetensors`.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Continue the run saved here (a checkpoint directory or file, written on any --mesh).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Also save the run to --checkpoint every N optimizer steps while it trains, in the
    /// background (copied off the devices, then written on a thread of its own while the next
    /// steps run). 0: only after training.
    #[arg(long, default_value_t = 0)]
    pub save_every: u64,
    /// Where the parameters are created, both times from --seed by the layer library's rules
    /// (Threefry, keyed by each parameter's name), so both give the same model (normal draws
    /// to a few ulps): `host` creates them on the host and splits them over the devices at
    /// the first step; `device` creates each on the devices, each device only its shard, so
    /// no host holds the model.
    #[arg(long, value_enum, default_value_t = InitOn::Host)]
    pub init: InitOn,
    /// The directory of the fortune files (default: the Debian package's).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// The flags of every handle example (`--json`, `--check`, `--serial-compiles`,
    /// `--manifest`, `--twin`: with `--buckets`, the twin bundle holds the documents).
    #[command(flatten)]
    pub run: HandleFlags,
    /// Train on whole documents (the fortunes, one each) of varying length instead of fixed
    /// windows, padded to K shape buckets the planner picks over their lengths (capped at
    /// --context): the inventory is the programs × K, all compiled before the first step.
    #[arg(long, default_value_t = 0)]
    pub buckets: usize,
}

/// Where `--init` creates the parameters.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InitOn {
    /// On the host, then split over the devices.
    #[default]
    Host,
    /// On the devices, each its shard.
    Device,
}

impl Args {
    /// Refuses, before anything is loaded or compiled, every setting that cannot train: a count
    /// of 0 (`--steps`, `--layers`, `--width`, `--heads`, `--context`, `--batch`), a width that
    /// is not a multiple of the heads, a learning rate or temperature that is not a finite
    /// number above 0, a dropout outside `[0, 1)`, `--remat` without `--scan`, and output paths
    /// that cannot be written (`--checkpoint`: a directory, or a `.safetensors` file, in an
    /// existing directory; `--manifest`: a file in an existing directory; `--twin`: a
    /// directory that exists or can be created), a `--resume` checkpoint that is not there, and `--save-every` without `--checkpoint`. The error is one sentence naming the
    /// flag and its value.
    pub fn validate(&self) -> Result<(), FlagError> {
        at_least_one("--steps", self.steps, "the training steps")?;
        at_least_one("--layers", self.layers, "the transformer blocks")?;
        at_least_one("--width", self.width, "the model width")?;
        at_least_one("--heads", self.heads, "the attention heads")?;
        at_least_one("--context", self.context, "the context length")?;
        at_least_one("--batch", self.batch, "the windows per step")?;
        if !self.width.is_multiple_of(self.heads) {
            return Err(FlagError::new(
                "--width",
                self.width,
                format!(
                    "the width must be a multiple of --heads {} (each head takes width / heads \
                     dimensions), like {}",
                    self.heads,
                    self.width.div_ceil(self.heads) * self.heads
                ),
            ));
        }
        finite_above_zero("--lr", self.lr, "the peak learning rate", 3e-3)?;
        below_one("--dropout", self.dropout, "the dropout rate")?;
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(FlagError::new(
                "--temperature",
                self.temperature,
                "the sampling temperature must be a finite number of at least 0 (0: the \
                 likeliest character every time), like 0.8",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(FlagError::new(
                "--top-p",
                self.top_p,
                "the nucleus must be in (0, 1] (1: every character), like 0.9",
            ));
        }
        at_least_one("--slots", self.slots, "texts generated at once")?;
        if self.remat && !self.scan {
            return Err(FlagError::new(
                "--remat",
                "",
                "it applies to the scanned blocks: add --scan",
            ));
        }
        if let Some(path) = &self.checkpoint {
            check_checkpoint_path("--checkpoint", path)?;
        }
        if let Some(path) = &self.resume {
            check_checkpoint_input("--resume", path)?;
        }
        if self.init == InitOn::Device && self.run.twin.is_some() {
            return Err(FlagError::new(
                "--init",
                "device",
                "--twin writes the initial parameters for the JAX twin, which the host must \
                 hold: use --init host with --twin",
            ));
        }
        if self.save_every > 0 && self.checkpoint.is_none() {
            return Err(FlagError::new(
                "--save-every",
                self.save_every,
                "the saves go to --checkpoint PATH: add it",
            ));
        }
        self.run.check_paths()
    }

    /// The model shape these flags ask for.
    pub fn shape(&self) -> GptShape {
        GptShape {
            layers: self.layers,
            width: self.width,
            heads: self.heads,
            context: self.context,
            dropout: self.dropout,
            seed: self.seed,
            scan: self.scan,
        }
    }

    /// About how many bytes the training windows of a run without `--buckets` take: every
    /// step's `--batch` windows (inputs and targets, `i32` each), their starts, the epoch's
    /// order of them, and with `--twin` their copy in the bundle. As a float: it may exceed
    /// any integer.
    pub fn window_bytes(&self) -> f64 {
        let t = self.context as f64;
        let mut per_window = 8.0 * t + 16.0;
        if self.run.twin.is_some() {
            per_window += 4.0 * (t + 1.0) + 12.0;
        }
        self.steps as f64 * self.batch as f64 * per_window
    }

    /// Refuses a run whose training windows ([`Args::window_bytes`]: `--steps` × `--batch`
    /// windows, all drawn up front) would not fit in the `available` bytes of memory (`None`:
    /// unknown, then only what no address space holds), with the largest `--steps` that fits.
    /// A `--buckets` run holds the corpus's documents instead, so nothing here bounds it.
    pub fn check_memory(&self, available: Option<u64>) -> Result<(), FlagError> {
        if self.buckets > 0 {
            return Ok(());
        }
        let need = self.window_bytes();
        let limit = available.map_or(usize::MAX as f64, |a| a as f64);
        if need <= limit {
            return Ok(());
        }
        let per_step = need / self.steps as f64;
        let most = (limit / per_step).floor();
        let what_fits = if most >= 1.0 {
            format!("use at most --steps {most:.0}")
        } else {
            "not even one step fits: use a smaller --batch or --context".to_owned()
        };
        let of = match available {
            Some(a) => format!("more than the {} available", gigabytes(a as f64)),
            None => "more than memory can address".to_owned(),
        };
        Err(FlagError::new(
            "--steps",
            self.steps,
            format!(
                "{} steps of {} windows (--batch) of {} characters (--context {}) drawn up \
                 front need about {} of memory, {of}; {what_fits}",
                self.steps,
                self.batch,
                self.context.saturating_add(1),
                self.context,
                gigabytes(need)
            ),
        ))
    }

    /// Refuses a `--context` whose windows (`--context` + 1 characters) do not fit in the
    /// corpus's training part (`train` characters) or its held-out last tenth (`held`), saying
    /// the largest context that fits. A `--buckets` run trains on whole documents instead
    /// (their lengths capped at the context), so nothing here bounds it.
    pub fn check_corpus(&self, train: usize, held: usize) -> Result<(), FlagError> {
        let shortest = train.min(held);
        if self.buckets > 0 || shortest > self.context {
            return Ok(());
        }
        let fix = if shortest >= 2 {
            format!(
                "use at most --context {}, or a larger corpus (--data DIR)",
                shortest - 1
            )
        } else {
            "it is too small for any window: pass a larger corpus (--data DIR)".to_owned()
        };
        Err(FlagError::new(
            "--context",
            self.context,
            format!(
                "windows of {} characters do not fit in the corpus, whose training part holds \
                 {train} character(s) and its held-out last tenth {held}; {fix}",
                self.context.saturating_add(1)
            ),
        ))
    }

    /// Refuses, when `--sample` asks for text, a `--prompt` with a character outside the
    /// corpus's vocabulary (found before training, not after it).
    pub fn check_prompt(&self, vocab: &Vocab) -> Result<(), FlagError> {
        if self.sample == 0 {
            return Ok(());
        }
        match self
            .prompt
            .chars()
            .find(|c| vocab.encode(c.encode_utf8(&mut [0; 4])).is_err())
        {
            None => Ok(()),
            Some(c) => Err(FlagError::new(
                "--prompt",
                format!("{:?}", self.prompt),
                format!(
                    "the character {c:?} is not in the corpus's vocabulary; write the prompt in \
                     the corpus's characters"
                ),
            )),
        }
    }
}

/// `bytes` in gigabytes (10^9), one decimal: `1.7 GB`.
fn gigabytes(bytes: f64) -> String {
    format!("{:.1} GB", bytes / 1e9)
}
