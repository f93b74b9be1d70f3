//! GPT-2: token and position embeddings, pre-norm blocks with tanh-GELU MLPs, a final norm and
//! a head tied to the token embedding — the architecture whose Hugging Face weights
//! [`Import::gpt2`](crate::weights::Import::gpt2) loads.

use super::{
    part, Activation, BlockParams, BlockParamsMirror, Embedding, EmbeddingParams, Layer, LayerNorm,
    NormParams, TransformerBlock,
};
use crate::init::Seed;
use crate::trace::Tensor;

/// GPT-2's shape: `vocab` tokens, `context` positions, width `dim`, `heads` heads, `layers`
/// blocks, norms with `eps`. Its forward pass takes token ids `[batch, time]` (`time ≤
/// context`) and gives logits `[batch, time, vocab]`.
///
/// ```
/// use nitro::nn::{Gpt2, Layer};
/// let small = Gpt2::new(50_257, 1024, 768, 12, 12)?; // GPT-2 "small"
/// assert_eq!(small.block().hidden, 4 * 768);
/// let tiny = Gpt2::new(50, 16, 64, 4, 2)?.init(nitro::init::Seed(0));
/// assert_eq!(tiny.blocks.len(), 2);
/// assert_eq!(tiny.wpe.table.dims(), &[16, 64]);
/// assert!(Gpt2::new(50, 16, 64, 5, 2).is_err(), "5 heads do not divide 64");
/// # Ok::<(), nitro::Error>(())
/// ```
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq)]
pub struct Gpt2 {
    /// Vocabulary size (`vocab_size`).
    pub vocab: usize,
    /// Positions (`n_positions`).
    pub context: usize,
    /// Width (`n_embd`).
    pub dim: usize,
    /// Attention heads (`n_head`).
    pub heads: usize,
    /// Blocks (`n_layer`).
    pub layers: usize,
    /// The norms' `eps` (`layer_norm_epsilon`).
    pub eps: f64,
}

/// A [`Gpt2`]'s parameters, named as [`Import::gpt2`](crate::weights::Import::gpt2) maps
/// Hugging Face's onto them.
#[derive(crate::Tree, Clone, Debug)]
pub struct Gpt2Params {
    /// Token embedding `[vocab, dim]` (`wte`), also the output head.
    pub wte: EmbeddingParams,
    /// Position embedding `[context, dim]` (`wpe`).
    pub wpe: EmbeddingParams,
    /// The blocks (`h.0`, `h.1`, …).
    pub blocks: Vec<BlockParams>,
    /// The final norm (`ln_f`).
    pub ln_f: NormParams,
}

impl Gpt2 {
    /// GPT-2 of this shape, `eps` 1e-5.
    ///
    /// Errors: [`Error::LayerShape`](crate::Error::LayerShape) when `heads` is 0 or does not
    /// divide `dim`, naming both.
    pub fn new(
        vocab: usize,
        context: usize,
        dim: usize,
        heads: usize,
        layers: usize,
    ) -> crate::Result<Gpt2> {
        let model = Gpt2 {
            vocab,
            context,
            dim,
            heads,
            layers,
            eps: 1e-5,
        };
        match model.block().attention.problem() {
            None => Ok(model),
            Some(problem) => Err(crate::Error::LayerShape {
                layer: format!("Gpt2::new({vocab}, {context}, {dim}, {heads}, {layers})"),
                problem,
            }),
        }
    }

    /// One of its blocks: causal, a 4× MLP with tanh-GELU, its `eps`, no dropout.
    pub fn block(&self) -> TransformerBlock {
        TransformerBlock {
            eps: self.eps,
            activation: Activation::GeluTanh,
            ..TransformerBlock::causal_unchecked(self.dim, self.heads)
        }
    }

    fn norm(&self) -> LayerNorm {
        LayerNorm {
            dim: self.dim,
            eps: self.eps,
        }
    }
}

impl Layer for Gpt2 {
    type Params = Gpt2Params;

    /// Embeddings and blocks as [`Embedding`] and [`TransformerBlock`] initialize them.
    fn init(&self, seed: Seed) -> Gpt2Params {
        let block = self.block();
        Gpt2Params {
            wte: Embedding {
                vocab: self.vocab,
                dim: self.dim,
            }
            .init(part(seed, 0)),
            wpe: Embedding {
                vocab: self.context,
                dim: self.dim,
            }
            .init(part(seed, 1)),
            blocks: (0..self.layers)
                .map(|i| block.init(part(seed, 2 + i as u64)))
                .collect(),
            ln_f: self.norm().init(seed),
        }
    }

    #[track_caller]
    fn forward(&self, p: &Gpt2ParamsMirror<Tensor>, ids: Tensor) -> Tensor {
        let _caller = crate::trace::caller_scope();
        let time = ids.dims().get(1).copied().unwrap_or(1);
        // Refused past the context (naming both lengths), never clamped into the table.
        let wpe = Embedding {
            vocab: self.context,
            dim: self.dim,
        };
        let mut h = p.wte.table.take(ids, 0) + wpe.positions(&p.wpe, time);
        let block = self.block();
        for b in &p.blocks {
            h = block.forward(b as &BlockParamsMirror<Tensor>, h);
        }
        let h = self.norm().forward(&p.ln_f, h);
        h.matmul(p.wte.table.transpose(&[1, 0]))
    }
}
