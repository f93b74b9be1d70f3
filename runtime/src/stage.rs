//! Cached stages: the content-addressed outputs of a frozen part of a model.
//!
//! A frozen encoder in front of a small trainable head (linear probing, adapters) computes the
//! same encoding of the same rows every epoch. Declare the encoder's weights
//! `#[device(frozen)]`, implement [`Stage`] on the experiment, and the training handle
//! ([`Nitro::fit_staged`](crate::train::Nitro::fit_staged)) runs the encoder once per chunk of
//! rows, stores its outputs in the compile cache's store, and trains the head on them: epochs
//! after the first are head-only work, and a later process reuses the stored outputs.
//!
//! # What names a stored output
//!
//! ```text
//! key(stage output) = H(stage identity, stage program fingerprint, GraphConst digest,
//!                       digest of the frozen Device state, coordinate of its input)
//! ```
//!
//! - The **stage identity** is the experiment type and [`Stage::NAME`].
//! - The **fingerprint** is of the emitted stage program, traced once per handle: an edit that
//!   changes what the stage computes misses, a cosmetic refactor (a renamed helper) hits.
//! - The **GraphConst digest** is the experiment's; the **frozen state** is the content digest of
//!   every `#[device(frozen)]` leaf, computed once per handle (and again after
//!   [`Nitro::modify`](crate::train::Nitro::modify)).
//! - The input is a **coordinate**, never a hash of the batch's bytes: the data set's digest
//!   (computed once, when the data set was made; a split's parts have their own), and the span
//!   of rows (start, length). The stage runs over the data set's rows in order, so a shuffled
//!   epoch reuses the chunks of every other epoch.
//!
//! A stage reads only GraphConst and frozen fields: its function takes the generated
//! `{Name}FrozenView`, which has no other field, so reading a trainable field in a stage is a
//! compile error. What the view's type cannot stop is refused before the stage runs: data
//! without a digest ([`Error::Nameless`](crate::Error::Nameless)), an input the stage made
//! itself ([`Error::Unsettled`](crate::Error::Unsettled)), an output without one row per input
//! row ([`Error::StageOutputRows`](crate::Error::StageOutputRows)). Its output must be [`StageOutput`] (a tensor, stored as an array): anything
//! else is a compile error rather than a silent recompute. Restored outputs are data, leaves of
//! the head's programs: no gradient flows into them, and none could reach the frozen fields.
//!
//! # The pre-pass
//!
//! [`Nitro::stage_pass`](crate::train::Nitro::stage_pass) names every chunk's key without
//! running anything, asks the store which exist (one existence check each, no reads), loads
//! those, runs the stage program only for the missing ones (compiling it only then), stores
//! their outputs, and reports each chunk as [`ChunkFate::Computed`], [`ChunkFate::Loaded`] or
//! [`ChunkFate::Spared`] (held in memory from an earlier pass). Counts go to [`StageStats`].

use crate::experiment::{Experiment, FieldInfo};
use crate::hash::{ContentHasher, Digest};
use crate::trace::Tensor;
use crate::tree::{Array, LeafPath};

/// The frozen view of an experiment: what a cached stage sees (GraphConst fields by reference,
/// `#[device(frozen)]` fields as tensor trees). Implemented by `#[experiment]`.
pub trait Frozen: Experiment {
    /// The generated `{Name}FrozenView`.
    type FrozenView<'a>
    where
        Self: 'a;

    /// Builds the frozen view, mapping every frozen leaf (in walk order) to a tensor through
    /// `leaf`. Called by the tracer.
    fn frozen_view<'a>(
        &'a self,
        leaf: &mut dyn FnMut(&FieldInfo, &LeafPath, &Array) -> Tensor,
    ) -> Self::FrozenView<'a>;
}

/// What a stage may return: something the store can hold. A tensor is stored as an array
/// (safetensors bytes); a stage returning any other type does not compile.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be stored as a cached stage's output",
    label = "not storable",
    note = "a stage returns one `Tensor` (stored as an array); return that instead"
)]
pub trait StageOutput {
    /// The traced value the stage program returns.
    fn into_tensor(self) -> Tensor;
}

impl StageOutput for Tensor {
    fn into_tensor(self) -> Tensor {
        self
    }
}

/// A frozen part of a model whose outputs are stored and reused: a function of the experiment's
/// frozen view and one data column, giving one new column.
///
/// ```
/// use nitro::prelude::*;
/// use nitro::stage::Stage;
///
/// #[experiment]
/// pub struct Probe {
///     #[device(frozen)]
///     pub encoder: Array,
///     #[device(trainable)]
///     pub head: Array,
/// }
///
/// impl Stage for Probe {
///     const NAME: &'static str = "encode";
///     const INPUT: &'static str = "x";
///     const OUTPUT: &'static str = "features";
///     const CACHED: bool = true;
///     type Output = Tensor;
///
///     fn run(v: &ProbeFrozenView<'_>, x: &Tensor) -> Tensor {
///         x.matmul(v.encoder).tanh()
///     }
/// }
/// ```
pub trait Stage: Frozen {
    /// The stage's name, part of its identity (with the experiment type).
    const NAME: &'static str;
    /// The data column the stage reads (`f32[rows, …]`).
    const INPUT: &'static str;
    /// The column its output becomes, which the model's programs read.
    const OUTPUT: &'static str;
    /// Whether outputs are stored and reused (`true`), or the stage runs on every pass
    /// (`false`: the same programs and results, for comparison). Always said explicitly.
    const CACHED: bool;
    /// What it returns: [`StageOutput`].
    type Output: StageOutput;

    /// The stage: over the frozen view and the input column's rows (a chunk of the data set),
    /// one output row per input row.
    fn run(v: &Self::FrozenView<'_>, input: &Tensor) -> Self::Output;
}

/// Where a chunk's input comes from: the data set (by its digest) and the span of its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Coordinate {
    /// The data set's digest (all zeros for a data set without one, which only an uncached
    /// stage accepts: its keys name nothing that is kept).
    pub dataset: Digest,
    /// The first row of the span.
    pub start: usize,
    /// How many rows.
    pub rows: usize,
}

/// What the pre-pass did with one chunk of rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChunkFate {
    /// Not stored: the stage program ran, and its output was stored.
    Computed,
    /// Stored by an earlier pass or process: read from the store, the stage did not run.
    Loaded,
    /// Held in memory from an earlier pass of this handle: neither run nor read.
    Spared,
}

/// One chunk of a [`StagePass`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Chunk {
    /// Its input.
    pub coordinate: Coordinate,
    /// Its output's key.
    pub key: Digest,
    /// What happened to it.
    pub fate: ChunkFate,
}

/// What one pre-pass did, chunk by chunk: a report can tell "not run because cached"
/// ([`ChunkFate::Loaded`], [`ChunkFate::Spared`]) from "never there" ([`ChunkFate::Computed`]).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct StagePass {
    /// Every chunk, in row order.
    pub chunks: Vec<Chunk>,
}

impl StagePass {
    /// How many chunks met `fate`.
    pub fn count(&self, fate: ChunkFate) -> usize {
        self.chunks.iter().filter(|c| c.fate == fate).count()
    }
}

/// A handle's stage counts, over its life.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct StageStats {
    /// Chunks whose output was found in the store ([`ChunkFate::Loaded`]).
    pub hits: u64,
    /// Chunks whose output was not stored, so the stage ran ([`ChunkFate::Computed`]).
    pub misses: u64,
    /// Chunks a pass did not run the stage for because their output was cached: found in the
    /// store or held in memory from an earlier pass ([`ChunkFate::Loaded`] and
    /// [`ChunkFate::Spared`]), so at least `hits`.
    pub spared: u64,
    /// Times the stage program ran (one per missed chunk).
    pub executions: u64,
    /// Times the stage program was compiled (at most once per handle and input type, and only
    /// when some chunk was missing).
    pub compiles: u64,
    /// Bytes of stage outputs written to the store.
    pub bytes_stored: u64,
    /// Bytes of stage outputs read from the store.
    pub bytes_loaded: u64,
    /// Time spent running the stage program, in milliseconds.
    pub run_ms: f64,
    /// What the spared chunks took to compute when they were computed (measured by this
    /// handle, or recorded in the stored entry), in milliseconds.
    pub saved_ms: f64,
}

/// The key of a stage output (see the [module docs](self)): naming a chunk costs one small
/// hash, whatever the size of its rows.
pub fn output_key(
    identity: &str,
    fingerprint: &Digest,
    graph_const: &Digest,
    frozen: &Digest,
    at: &Coordinate,
) -> Digest {
    let mut h = ContentHasher::new();
    h.write_str("nitro.stage.output.v1");
    h.write_str(identity);
    h.write_digest(fingerprint);
    h.write_digest(graph_const);
    h.write_digest(frozen);
    h.write_digest(&at.dataset);
    h.write_u64(at.start as u64);
    h.write_u64(at.rows as u64);
    h.finish()
}

/// Calls `f` with every leaf of the experiment's `#[device(frozen)]` fields and its path, in
/// walk order (the order of the stage program's frozen inputs).
pub(crate) fn for_each_frozen_leaf<'a, E: Experiment>(
    experiment: &'a E,
    f: &mut dyn FnMut(&LeafPath, &'a Array),
) {
    experiment.visit_device(&mut |field, path, node| {
        if let (crate::experiment::Role::Frozen, crate::tree::Node::Leaf(a)) = (field.role, node) {
            f(path, a);
        }
    });
}

/// The content digest of the frozen fields' leaves: each leaf's path, type and bytes.
pub(crate) fn frozen_digest<E: Experiment>(experiment: &E) -> Digest {
    let mut h = ContentHasher::new();
    h.write_str("nitro.stage.frozen.v1");
    for_each_frozen_leaf(experiment, &mut |path, a| {
        h.write_str(path.as_str());
        crate::hash::ContentHash::content_hash(a, &mut h);
    });
    h.finish()
}
