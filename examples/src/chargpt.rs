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

use crate::column;

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

/// The experiment.
#[experiment]
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
    fn from_batch(b: nitro::data::Batch) -> nitro::Result<Windows> {
        Ok(Windows {
            x: column(&b, "x")?,
            y: column(&b, "y")?,
            valid: b.column(nitro::data::buckets::VALID).cloned(),
        })
    }
}

/// The next-character scores of windows `x` (`i32 [n, T]`), `[n, T, vocab]`.
pub fn logits(v: &CharGptView<'_>, x: Tensor) -> Tensor {
    let a = &v.arch;
    let t = x.dims()[1];
    let positions = Tensor::iota(DType::I32, &[t], 0);
    let h = a.tokens.forward(&v.tokens, x) + a.positions.forward(&v.positions, positions);
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
        let gpt = CharGpt {
            tokens: arch.tokens.init(s(0)),
            positions: arch.positions.init(s(1)),
            blocks: nn::init_stack(&arch.blocks, s(2)),
            stack: None,
            norm: arch.norm.init(s(3)),
            head: arch.head.init(s(4)),
            arch,
        };
        if shape.scan {
            gpt.stacked()
        } else {
            gpt
        }
    }

    /// The same model and weights with its blocks as one scan over stacked parameters: block
    /// `i`'s leaves become row `i` of `stack`'s (unchanged when already stacked).
    pub fn stacked(mut self) -> CharGpt {
        let Some(&block) = self.arch.blocks.first() else {
            return self;
        };
        let blocks = Repeated::new(block, self.arch.blocks.len());
        self.stack = Some(blocks.stack_params(&self.blocks));
        self.arch.stack = Some(blocks);
        self.arch.blocks.clear();
        self.blocks.clear();
        self
    }
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
pub fn random_windows(
    ids: &[i32],
    t: usize,
    count: usize,
    seed: u64,
) -> nitro::Result<(Dataset, Vec<usize>)> {
    let mut rng = nitro::init::Rng::new(nitro::init::Seed(seed));
    let span = ids.len() - t - 1;
    let mut x = Vec::with_capacity(count * t);
    let mut y = Vec::with_capacity(count * t);
    let mut starts = Vec::with_capacity(count);
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
