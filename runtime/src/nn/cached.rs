//! The layers' forward pass over a KV cache, for generation ([`crate::generate::Decoder`]):
//! tokens at given positions in, each attention layer's keys and values written into a cache
//! at those positions, every query attending to its own row's cache up to its position.
//!
//! The cache of one attention layer is a pair of tensors `[rows, heads, context, head_dim]`
//! (keys and values). Row `r` of a call writes token `j` at position `start[r] + j` with a
//! replacing scatter (XLA updates a donated cache in place), and query `(r, j)` attends to
//! positions `0..=start[r] + j` of row `r`; the rest of the row is masked with
//! [`masked_score`], so whatever it holds (zeros, an earlier request's values) has weight
//! exactly 0. A position past the cache's end is not written (a scatter skips an update that
//! does not fit): the generator keeps `start + time ≤ context`.

use super::{
    masked_score, softmax, AttentionParamsMirror, BlockParams, BlockParamsMirror, Embedding,
    EmbeddingParamsMirror, Gpt2, Gpt2ParamsMirror, Layer, LayerNorm, Linear, LinearParamsMirror,
    MultiHeadAttention, Repeated, TransformerBlock,
};
use crate::generate::{CacheTensor, DecodeShape};
use crate::trace::{Scan, ScatterDims, ScatterKind, Tensor};
use crate::tree::{DType, LeafType, Tree};

/// What to call a layer in a refusal: `op` for the trace error, and the message.
type Refusal = (&'static str, String);

impl Embedding {
    /// The rows of positions `start[r] + j` for `j` in `0..time`, `[rows, time, dim]`: a learned
    /// position table read for `rows` sequences of `time` new tokens whose first tokens sit at
    /// `start` (`i32 [rows]`, any integer dtype) — what a model decoding through a KV cache adds
    /// to its token embeddings. With `start` all zeros it is [`positions`](Embedding::positions)
    /// broadcast over the rows.
    ///
    /// `time` longer than the table fails the trace, naming both lengths. The positions are
    /// traced values, so one past the table cannot be refused when the program is traced: it
    /// reads the table's last row (as [`lookup`](Embedding::lookup) clamps). Keeping
    /// `start + time` within the table is the caller's part (the generator re-prefills a row
    /// whose window is full).
    ///
    /// ```
    /// use nitro::nn::{Embedding, EmbeddingParamsMirror};
    /// use nitro::trace::trace;
    /// use nitro::{DType, LeafType};
    ///
    /// let emb = Embedding { vocab: 16, dim: 8 };
    /// let graph = trace(
    ///     &[
    ///         ("table".into(), LeafType::new(DType::F32, &[16, 8])),
    ///         ("start".into(), LeafType::new(DType::I32, &[3])),
    ///     ],
    ///     |i| vec![emb.positions_at(&EmbeddingParamsMirror { table: i[0] }, i[1], 2)],
    /// )?;
    /// assert_eq!(graph.output_types()[0].dims, [3, 2, 8]);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    #[track_caller]
    pub fn positions_at(
        &self,
        p: &EmbeddingParamsMirror<Tensor>,
        start: Tensor,
        time: usize,
    ) -> Tensor {
        let _caller = crate::trace::caller_scope();
        let table = p.table.dims().first().copied().unwrap_or(0);
        let rows = match start_rows(start) {
            Ok(rows) => rows,
            Err(problem) => {
                return crate::trace::refuse_at(
                    "positions_at",
                    problem,
                    Tensor::full(&[1, time, self.dim], 0.0, p.table.dtype()),
                )
            }
        };
        if time > table {
            return crate::trace::refuse_at(
                "positions_at",
                format!(
                    "{time} new positions are more than the position table's {table} rows (the \
                     model's context); feed at most {table} tokens at once"
                ),
                Tensor::full(&[rows, time, self.dim], 0.0, p.table.dtype()),
            );
        }
        p.table.take(positions(start, rows, time), 0)
    }
}

/// The rows of a `start` tensor (an integer vector), or what is wrong with it.
fn start_rows(start: Tensor) -> Result<usize, String> {
    let ty = LeafType::new(start.dtype(), &start.dims());
    match ty.dims[..] {
        [rows] if matches!(ty.dtype, DType::I32 | DType::I64 | DType::U32 | DType::U8) => Ok(rows),
        _ => Err(format!(
            "the start positions must be an integer vector, one per row (i32 [rows]); got {ty}"
        )),
    }
}

/// `start[r] + j`, `i32 [rows, time]`.
fn positions(start: Tensor, rows: usize, time: usize) -> Tensor {
    let start = match start.dtype() {
        DType::I32 => start,
        _ => start.convert(DType::I32),
    };
    start.reshape(&[rows, 1]) + Tensor::iota(DType::I32, &[rows, time], 1)
}

/// Which slice of a cache tensor one attention layer owns: all of it, or row `layer` of a
/// stack's `[layers, rows, heads, context, head_dim]` (an `i32` scalar).
#[derive(Clone, Copy)]
enum Slot {
    Whole,
    Layer(Tensor, usize),
}

impl MultiHeadAttention {
    /// The type of one row of this attention's key (or value) cache over `context`
    /// positions: `[heads, context, head_dim]` of `dtype`.
    ///
    /// ```
    /// use nitro::nn::MultiHeadAttention;
    /// use nitro::DType;
    /// let mha = MultiHeadAttention::new(64, 4, true)?;
    /// assert_eq!(mha.cache_row(32, DType::F32).dims, [4, 32, 16]);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    pub fn cache_row(&self, context: usize, dtype: DType) -> LeafType {
        let heads = self.heads.max(1);
        LeafType::new(dtype, &[heads, context, self.dim / heads])
    }

    /// Attention over a KV cache: the `t` new tokens `x` (`[rows, t, dim]`) of each row sit at
    /// positions `start[r]..start[r] + t` (`start`: `i32 [rows]`); their keys and values are
    /// written there into `k` and `v` (`[rows, heads, context, head_dim]` each, see
    /// [`cache_row`](MultiHeadAttention::cache_row)), and each query attends to its row's
    /// positions up to its own. Returns the output (`[rows, t, dim]`) and the written caches.
    ///
    /// With `start` zeros and `t` the whole window it computes [`forward`](Layer::forward)'s
    /// values; feeding a window's tokens in pieces, each at its position, gives the same
    /// outputs as the whole window at once. What the cache holds past a row's positions is
    /// masked ([`masked_score`]): any finite value there changes nothing. The keys and values
    /// are stored in the cache's dtype and attended to in `x`'s.
    ///
    /// Refused when the trace runs (an error naming the caller's line): a layer that is not
    /// causal (its queries see later tokens, which a cache has not seen), caches of another
    /// shape, a `start` that is not one integer per row, or more new tokens than the cache has
    /// positions.
    ///
    /// ```
    /// use nitro::nn::{AttentionParamsMirror, LinearParamsMirror, MultiHeadAttention};
    /// use nitro::trace::trace;
    /// use nitro::{DType, LeafType};
    ///
    /// let mha = MultiHeadAttention::new(8, 2, true)?;
    /// let f32s = |d: &[usize]| LeafType::new(DType::F32, d);
    /// let mut inputs = vec![
    ///     ("x".into(), f32s(&[3, 1, 8])),
    ///     ("start".into(), LeafType::new(DType::I32, &[3])),
    ///     ("k".into(), f32s(&[3, 2, 16, 4])),
    ///     ("v".into(), f32s(&[3, 2, 16, 4])),
    /// ];
    /// for name in ["q", "k", "v", "o"] {
    ///     inputs.push((format!("{name}.w"), f32s(&[8, 8])));
    /// }
    /// let graph = trace(&inputs, |i| {
    ///     let lin = |w| LinearParamsMirror { w, b: None };
    ///     let p = AttentionParamsMirror { q: lin(i[4]), k: lin(i[5]), v: lin(i[6]), o: lin(i[7]) };
    ///     let (y, k, v) = mha.forward_cached(&p, i[0], i[1], i[2], i[3]);
    ///     vec![y, k, v]
    /// })?;
    /// let out = graph.output_types();
    /// assert_eq!((out[0].dims.as_slice(), out[1].dims.as_slice()), (&[3, 1, 8][..], &[3, 2, 16, 4][..]));
    /// # Ok::<(), nitro::Error>(())
    /// ```
    #[track_caller]
    pub fn forward_cached(
        &self,
        p: &AttentionParamsMirror<Tensor>,
        x: Tensor,
        start: Tensor,
        k: Tensor,
        v: Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let _caller = crate::trace::caller_scope();
        match self.cached(p, x, start, k, v, Slot::Whole) {
            Ok(out) => out,
            Err((op, problem)) => (crate::trace::refuse_at(op, problem, x), k, v),
        }
    }

    /// The shape checks of a cached call: `(rows, t, context)`.
    fn check_cached(
        &self,
        x: Tensor,
        start: Tensor,
        k: Tensor,
        v: Tensor,
        layers: Option<usize>,
    ) -> Result<(usize, usize, usize), Refusal> {
        const OP: &str = "MultiHeadAttention::forward_cached";
        if let Some(problem) = self.problem() {
            return Err(("MultiHeadAttention", problem));
        }
        if !self.causal {
            return Err((
                OP,
                "this attention is not causal: its queries attend to later tokens, which a KV \
                 cache has not seen yet; decode with a causal layer (`causal: true`)"
                    .into(),
            ));
        }
        let xd = x.dims();
        let [rows, t, width] = xd[..] else {
            return Err((
                OP,
                format!("the input must be [rows, time, {}], got {:?}", self.dim, xd),
            ));
        };
        if width != self.dim {
            return Err((
                OP,
                format!(
                    "the input is {width} wide and the attention {}: [rows, time, {}] expected, \
                     got {xd:?}",
                    self.dim, self.dim
                ),
            ));
        }
        let starts = start_rows(start).map_err(|p| (OP, p))?;
        if starts != rows {
            return Err((
                OP,
                format!("{starts} start positions given for {rows} rows; give one per row"),
            ));
        }
        let (heads, dh) = (self.heads, self.dim / self.heads);
        let kd = k.dims();
        let context = kd.get(kd.len().saturating_sub(2)).copied().unwrap_or(0);
        let want: Vec<usize> = match layers {
            None => vec![rows, heads, context, dh],
            Some(layers) => vec![layers, rows, heads, context, dh],
        };
        for (name, c) in [("key", k), ("value", v)] {
            if c.dims() != want {
                let lead = if layers.is_some() { "layers, " } else { "" };
                return Err((
                    OP,
                    format!(
                        "the {name} cache is {:?}; for {rows} rows of this attention it must be \
                         [{lead}rows, heads, context, head_dim] = {want:?} (as `cache_row` \
                         declares, with the rows axis)",
                        c.dims()
                    ),
                ));
            }
        }
        if t > context {
            return Err((
                OP,
                format!(
                    "{t} new tokens do not fit a cache of {context} positions; feed at most \
                     {context} at once"
                ),
            ));
        }
        Ok((rows, t, context))
    }

    /// [`forward_cached`](MultiHeadAttention::forward_cached) on the part of `k` and `v` that
    /// `slot` names.
    fn cached(
        &self,
        p: &AttentionParamsMirror<Tensor>,
        x: Tensor,
        start: Tensor,
        k: Tensor,
        v: Tensor,
        slot: Slot,
    ) -> Result<(Tensor, Tensor, Tensor), Refusal> {
        let layers = match slot {
            Slot::Whole => None,
            Slot::Layer(_, layers) => Some(layers),
        };
        let (rows, t, context) = self.check_cached(x, start, k, v, layers)?;
        let (h, dh) = (self.heads, self.dim / self.heads);
        let lin = Linear::new(self.dim, self.dim);
        let project = |w: &LinearParamsMirror<Tensor>| lin.forward(w, x).reshape(&[rows, t, h, dh]);
        let q = project(&p.q).transpose(&[0, 2, 1, 3]);
        let pos = positions(start, rows, t);
        let k = write(k, project(&p.k), pos, slot);
        let v = write(v, project(&p.v), pos, slot);
        let read = |c: Tensor| {
            let c = match slot {
                Slot::Whole => c,
                Slot::Layer(i, _) => {
                    let zero = Tensor::scalar(0.0, DType::I32);
                    c.dynamic_slice(&[i, zero, zero, zero, zero], &[1, rows, h, context, dh])
                        .reshape(&[rows, h, context, dh])
                }
            };
            match c.dtype() == x.dtype() {
                true => c,
                false => c.convert(x.dtype()),
            }
        };
        let (kc, vc) = (read(k), read(v));
        // Scores of every query against every cache position: [rows, heads, t, context].
        let scores = q.matmul(kc.transpose(&[0, 1, 3, 2])) / (dh as f64).sqrt();
        let at = Tensor::iota(DType::I32, &[1, 1, 1, context], 3);
        let allowed = at.less_equal(pos.reshape(&[rows, 1, t, 1]));
        let scores = Tensor::select(allowed, scores, masked_score(scores.dtype()));
        let out = softmax(scores, 3)
            .matmul(vc)
            .transpose(&[0, 2, 1, 3])
            .reshape(&[rows, t, self.dim]);
        Ok((lin.forward(&p.o, out), k, v))
    }
}

/// `cache` with `new` (`[rows, t, heads, head_dim]`) written at positions `pos`
/// (`i32 [rows, t]`) of each row — of the whole cache, or of layer `i`'s slice of a stack — by
/// a replacing scatter, in the cache's dtype.
fn write(cache: Tensor, new: Tensor, pos: Tensor, slot: Slot) -> Tensor {
    let dims = pos.dims();
    let (rows, t) = (dims[0], dims[1]);
    let row = Tensor::iota(DType::I32, &[rows, t, 1], 0);
    let pos = pos.reshape(&[rows, t, 1]);
    let (indices, lead) = match slot {
        Slot::Whole => (Tensor::concatenate(&[row, pos], 2), 0),
        Slot::Layer(i, _) => {
            let layer = i.reshape(&[1, 1, 1]).broadcast_to(&[rows, t, 1]);
            (Tensor::concatenate(&[layer, row, pos], 2), 1)
        }
    };
    // Operand [(layers,) rows, heads, context, head_dim]: rows and context (and the layer)
    // come from each index vector; heads and head_dim are the window.
    let dims = ScatterDims {
        update_window_dims: vec![2, 3],
        inserted_window_dims: (0..lead).chain([lead, lead + 2]).collect(),
        scatter_dims_to_operand_dims: (0..lead).chain([lead, lead + 2]).collect(),
        index_vector_dim: 2,
    };
    let new = match new.dtype() == cache.dtype() {
        true => new,
        false => new.convert(cache.dtype()),
    };
    cache.scatter(indices, new, &dims, ScatterKind::Replace)
}

impl TransformerBlock {
    /// The block's two cache tensors for `context` positions of `dtype`, named
    /// `{name}.k` and `{name}.v`: `[heads, context, head_dim]` per row, the rows axis first.
    ///
    /// ```
    /// use nitro::nn::TransformerBlock;
    /// use nitro::DType;
    /// let [k, v] = TransformerBlock::causal(64, 4)?.cache_tensors("blocks[0]", 128, DType::F32);
    /// assert_eq!((k.name.as_str(), v.row.dims.as_slice()), ("blocks[0].k", &[4, 128, 16][..]));
    /// assert_eq!(k.with_rows(8).dims, [8, 4, 128, 16]);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    pub fn cache_tensors(&self, name: &str, context: usize, dtype: DType) -> [CacheTensor; 2] {
        let row = self.attention.cache_row(context, dtype);
        ["k", "v"].map(|part| CacheTensor {
            name: format!("{name}.{part}"),
            row: row.clone(),
            row_axis: 0,
        })
    }

    /// The block over a KV cache: [`forward`](Layer::forward) with its attention's
    /// [`forward_cached`](MultiHeadAttention::forward_cached) — `x` (`[rows, t, dim]`) at
    /// positions `start[r] + j`, `k` and `v` `[rows, heads, context, head_dim]` — returning the
    /// output and the written caches. Dropout is off (generation is evaluation).
    #[track_caller]
    pub fn forward_cached(
        &self,
        p: &BlockParamsMirror<Tensor>,
        x: Tensor,
        start: Tensor,
        k: Tensor,
        v: Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let _caller = crate::trace::caller_scope();
        match self.cached(p, x, start, k, v, Slot::Whole) {
            Ok(out) => out,
            Err((op, problem)) => (crate::trace::refuse_at(op, problem, x), k, v),
        }
    }

    fn cached(
        &self,
        p: &BlockParamsMirror<Tensor>,
        x: Tensor,
        start: Tensor,
        k: Tensor,
        v: Tensor,
        slot: Slot,
    ) -> Result<(Tensor, Tensor, Tensor), Refusal> {
        let d = self.attention.dim;
        let ln = self.norm();
        let (a, k, v) =
            self.attention
                .cached(&p.attention, ln.forward(&p.ln1, x), start, k, v, slot)?;
        let x = x + a;
        let m = Linear::new(d, self.hidden).forward(&p.fc1, ln.forward(&p.ln2, x));
        let m = Linear::new(self.hidden, d).forward(&p.fc2, self.activation.apply(m));
        Ok((x + m, k, v))
    }
}

/// A list of blocks over their KV caches, each on its own parameters — [`stack`](super::stack)
/// for decoding. `cache` holds each block's key and value caches in order, `[k₀, v₀, k₁, v₁,
/// …]` (as [`TransformerBlock::cache_tensors`] declares them); the written caches come back in
/// that order. A cache of another length fails the trace.
#[track_caller]
pub fn stack_cached(
    blocks: &[TransformerBlock],
    params: &[BlockParamsMirror<Tensor>],
    x: Tensor,
    start: Tensor,
    cache: Vec<Tensor>,
) -> (Tensor, Vec<Tensor>) {
    let _caller = crate::trace::caller_scope();
    if cache.len() != 2 * blocks.len() || params.len() != blocks.len() {
        let problem = format!(
            "{} blocks with {} parameter sets and {} cache tensors; each block takes its own \
             parameters and two cache tensors (keys, then values)",
            blocks.len(),
            params.len(),
            cache.len()
        );
        return (crate::trace::refuse_at("stack_cached", problem, x), cache);
    }
    let mut h = x;
    let mut out = Vec::with_capacity(cache.len());
    for ((block, p), kv) in blocks.iter().zip(params).zip(cache.chunks(2)) {
        let (y, k, v) = block.forward_cached(p, h, start, kv[0], kv[1]);
        h = y;
        out.extend([k, v]);
    }
    (h, out)
}

impl Repeated<TransformerBlock> {
    /// The stack's two cache tensors for `context` positions of `dtype`, named `{name}.k` and
    /// `{name}.v`: `[layers, heads, context, head_dim]` per row, the rows axis at 1 (so the
    /// scan slices layers off the front).
    ///
    /// ```
    /// use nitro::nn::{Repeated, TransformerBlock};
    /// use nitro::DType;
    /// let stack = Repeated::new(TransformerBlock::causal(64, 4)?, 6);
    /// let [k, _v] = stack.cache_tensors("stack", 128, DType::F32);
    /// assert_eq!(k.with_rows(8).dims, [6, 8, 4, 128, 16]);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    pub fn cache_tensors(&self, name: &str, context: usize, dtype: DType) -> [CacheTensor; 2] {
        let mut row = self.layer.attention.cache_row(context, dtype);
        row.dims.insert(0, self.depth);
        ["k", "v"].map(|part| CacheTensor {
            name: format!("{name}.{part}"),
            row: row.clone(),
            row_axis: 1,
        })
    }

    /// The stack over its KV caches: `k` and `v` are `[layers, rows, heads, context,
    /// head_dim]`, layer `i` reading and writing row `i`. Each layer is
    /// [`TransformerBlock::forward_cached`]; as [`forward`](Layer::forward), one [`Scan`] over
    /// the layers (or `depth` copies when [`unrolled`](Repeated::unrolled)). The caches ride in
    /// the loop's carry and each layer scatters its new keys and values into them at
    /// `(layer, row, position)`, so a decode step writes only its tokens' entries — an update
    /// XLA can make in place — rather than stacking a new cache as the scan's outputs.
    ///
    /// Refused when the trace runs: caches of another shape (naming the one expected), and what
    /// the block's attention refuses.
    #[track_caller]
    pub fn forward_cached(
        &self,
        p: &BlockParamsMirror<Tensor>,
        x: Tensor,
        start: Tensor,
        k: Tensor,
        v: Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let _caller = crate::trace::caller_scope();
        let depth = self.depth;
        let block = self.layer;
        // Checked once outside the loop, so a refusal names the caller's line.
        if let Err((op, problem)) = block.attention.check_cached(x, start, k, v, Some(depth)) {
            return (crate::trace::refuse_at(op, problem, x), k, v);
        }
        if self.unrolled {
            let (mut h, mut k, mut v) = (x, k, v);
            for i in 0..depth {
                let view = self.layer_params(p, i);
                let slot = Slot::Layer(Tensor::scalar(i as f64, DType::I32), depth);
                match block.cached(&view, h, start, k, v, slot) {
                    Ok(out) => (h, k, v) = out,
                    Err((op, problem)) => return (crate::trace::refuse_at(op, problem, x), k, v),
                }
            }
            return (h, k, v);
        }
        let mut stacked = BlockParams::mirror_leaves(p);
        stacked.push(Tensor::iota(DType::I32, &[depth], 0));
        let (carry, _) = Scan::new()
            .length(depth)
            .run(&[x, k, v], &stacked, |c, slices| {
                let (index, leaves) = slices.split_last().expect("the layer index is a slice");
                let mut leaves = leaves.iter();
                let view = BlockParams::map_mirror(p, &mut |_| {
                    *leaves.next().expect("one slice per stacked leaf")
                });
                let slot = Slot::Layer(*index, depth);
                match block.cached(&view, c[0], start, c[1], c[2], slot) {
                    Ok((h, k, v)) => (vec![h, k, v], vec![]),
                    // Checked above: a refusal here is recorded and the carry kept.
                    Err((op, problem)) => {
                        let h = crate::trace::refuse_at(op, problem, c[0]);
                        (vec![h, c[1], c[2]], vec![])
                    }
                }
            });
        (carry[0], carry[1], carry[2])
    }

    /// [`forward_cached`](Repeated::forward_cached) with the cache as the list
    /// [`cache_tensors`](Repeated::cache_tensors) declares, `[k, v]` — what a
    /// [`Decoder`](crate::generate::Decoder) passes on. Another length fails the trace.
    #[track_caller]
    pub fn forward_cached_list(
        &self,
        p: &BlockParamsMirror<Tensor>,
        x: Tensor,
        start: Tensor,
        cache: Vec<Tensor>,
    ) -> (Tensor, Vec<Tensor>) {
        let _caller = crate::trace::caller_scope();
        let [k, v] = cache[..] else {
            let problem = format!(
                "{} cache tensors given to a stack of blocks, which takes two (keys, then \
                 values, each [layers, rows, heads, context, head_dim])",
                cache.len()
            );
            return (
                crate::trace::refuse_at("Repeated::forward_cached", problem, x),
                cache,
            );
        };
        let (h, k, v) = self.forward_cached(p, x, start, k, v);
        (h, vec![k, v])
    }
}

impl Gpt2 {
    /// What this model declares for decoding with caches of `dtype` (its compute dtype: the
    /// parameters' own, `f32` as [`init`](Layer::init) makes them): its vocabulary, its context
    /// (the position table's rows) and two cache tensors per block, `blocks[i].k` and
    /// `blocks[i].v`, `[heads, context, head_dim]` per row. An experiment holding a `Gpt2`
    /// returns it from [`Decoder::decode_shape`](crate::generate::Decoder::decode_shape) and
    /// calls [`forward_cached`](Gpt2::forward_cached) from
    /// [`Decoder::decode`](crate::generate::Decoder::decode):
    ///
    /// ```
    /// use nitro::generate::{DecodeShape, Decoder};
    /// use nitro::nn::{self, Gpt2, Layer};
    /// use nitro::prelude::*;
    ///
    /// #[experiment]
    /// pub struct Chat {
    ///     #[graph_const] pub model: Gpt2,
    ///     #[device] pub weights: nn::Gpt2Params,
    /// }
    ///
    /// impl Decoder for Chat {
    ///     fn decode_shape(&self) -> DecodeShape {
    ///         self.model.decode_shape(self.weights.wte.table.dtype())
    ///     }
    ///     fn decode(v: &ChatView<'_>, tokens: Tensor, start: Tensor, cache: Vec<Tensor>)
    ///         -> (Tensor, Vec<Tensor>) {
    ///         v.model.forward_cached(&v.weights, tokens, start, cache)
    ///     }
    /// }
    ///
    /// let model = Gpt2::new(50, 16, 32, 4, 2)?;
    /// let chat = Chat { weights: model.init(nitro::init::Seed(0)), model };
    /// let shape = chat.decode_shape();
    /// assert_eq!((shape.vocab, shape.context, shape.cache.len()), (50, 16, 4));
    /// assert_eq!(shape.cache[3].name, "blocks[1].v");
    /// assert_eq!(shape.cache[0].with_rows(2).dims, [2, 4, 16, 8]);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    pub fn decode_shape(&self, dtype: DType) -> DecodeShape {
        let block = self.block();
        DecodeShape {
            vocab: self.vocab,
            context: self.context,
            cache: (0..self.layers)
                .flat_map(|i| block.cache_tensors(&format!("blocks[{i}]"), self.context, dtype))
                .collect(),
        }
    }

    /// The logits (`[rows, t, vocab]`) of token ids `ids` (`i32 [rows, t]`) whose row `r`
    /// starts at position `start[r]` (`i32 [rows]`), through the KV cache `cache` as
    /// [`decode_shape`](Gpt2::decode_shape) declares it (`[k₀, v₀, k₁, v₁, …]`, each `[rows,
    /// heads, context, head_dim]`); returns the logits and the written cache. With `start`
    /// zeros over a whole window it gives [`forward`](Layer::forward)'s logits, and a window
    /// fed in pieces gives the same. A cache of another length or shape, or `t` past the
    /// context, fails the trace.
    #[track_caller]
    pub fn forward_cached(
        &self,
        p: &Gpt2ParamsMirror<Tensor>,
        ids: Tensor,
        start: Tensor,
        cache: Vec<Tensor>,
    ) -> (Tensor, Vec<Tensor>) {
        let _caller = crate::trace::caller_scope();
        let time = ids.dims().get(1).copied().unwrap_or(1);
        let wpe = Embedding {
            vocab: self.context,
            dim: self.dim,
        };
        let h = p.wte.table.take(ids, 0) + wpe.positions_at(&p.wpe, start, time);
        let blocks = vec![self.block(); self.layers];
        let (h, cache) = stack_cached(&blocks, &p.blocks, h, start, cache);
        let norm = LayerNorm {
            dim: self.dim,
            eps: self.eps,
        };
        let h = norm.forward(&p.ln_f, h);
        (h.matmul(p.wte.table.transpose(&[1, 0])), cache)
    }
}
