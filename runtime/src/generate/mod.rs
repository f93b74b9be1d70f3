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

pub mod sample;

use crate::experiment::Experiment;
use crate::trace::Tensor;
use crate::tree::LeafType;

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
