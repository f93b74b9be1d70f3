//! The training handle's side of cached stages ([`crate::stage`]): the pre-pass that gives a
//! data set its stage column, and `fit` over it.

use std::borrow::Cow;
use std::collections::HashMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::{FromBatch, History, Model, Nitro};
use crate::backend::Executable;
use crate::cache::{Entry, EntryMeta, Lookup};
use crate::data::{Dataset, Order};
use crate::error::{Error, Result};
use crate::hash::{ContentHasher, Digest};
use crate::optim::Optimizer;
use crate::stage::{
    for_each_frozen_leaf, frozen_digest, output_key, Chunk, ChunkFate, Coordinate, Stage,
    StageOutput, StagePass, StageStats,
};
use crate::trace::{self, Graph};
use crate::tree::{Array, LeafType};

/// A handle's stage: its traced program (per input type), compiled when first needed, the
/// frozen state's digest, the outputs held in memory, and the counts.
#[derive(Default)]
pub(crate) struct StageState {
    program: Option<StageProgram>,
    frozen: Option<Digest>,
    held: HashMap<Digest, Array>,
    stats: StageStats,
}

struct StageProgram {
    /// The chunk input's type it was traced for.
    input: LeafType,
    graph: Graph,
    text: String,
    fingerprint: Digest,
    compiled: Option<Box<dyn Executable>>,
}

impl StageState {
    /// Forgets the traced program and the frozen digest (after the experiment changed).
    pub(crate) fn forget_program(&mut self) {
        self.program = None;
        self.frozen = None;
    }
}

impl<E: Model + Stage, O: Optimizer> Nitro<E, O> {
    /// The stage's counts over this handle's life.
    pub fn stage_stats(&self) -> StageStats {
        self.stage.stats
    }

    /// The pre-pass of a cached stage over `data`: `data` with the stage's output added as
    /// column [`Stage::OUTPUT`], and what happened to each chunk of rows.
    ///
    /// The rows are taken in order, in chunks of [`Config::batch`](super::Config::batch) (the
    /// last one padded to that size, its padding dropped from the output). Every chunk's key is
    /// named first, without running anything; then each chunk is found held in memory
    /// (spared), found in the store (loaded), or computed by the stage program — compiled only
    /// if some chunk needs it — and stored. With [`Stage::CACHED`] false the stage runs for
    /// every chunk and nothing is stored or held.
    ///
    /// On a handle with several devices the stage runs on one (XLA's or the interpreter's
    /// one-device backend); the head then trains on all of them.
    ///
    /// Errors: [`Error::DatasetColumn`] when `data` has no [`Stage::INPUT`] column or already
    /// has a [`Stage::OUTPUT`] column; the trace's, compile's and run's errors.
    pub fn stage_pass(&mut self, data: &Dataset) -> Result<(Dataset, StagePass)> {
        let input = data.column(E::INPUT)?;
        if data.columns().any(|(n, _)| n == E::OUTPUT) {
            return Err(Error::DatasetColumn {
                column: E::OUTPUT.to_owned(),
                problem: format!(
                    "already exists, and the stage {} writes its output there; rename the \
                     column or the stage's output",
                    E::NAME
                ),
            });
        }
        let rows = self.config.batch;
        let mut chunk_dims = input.dims().to_vec();
        chunk_dims[0] = rows;
        let chunk_type = LeafType {
            dtype: input.dtype(),
            dims: chunk_dims,
        };
        self.trace_stage(&chunk_type)?;
        let frozen = match self.stage.frozen {
            Some(d) => d,
            None => *self.stage.frozen.insert(frozen_digest(&self.experiment)),
        };
        let graph_const = self.experiment.graph_const_digest();
        let identity = format!("{}::stage:{}", E::TYPE_PATH, E::NAME);
        let fingerprint = self
            .stage
            .program
            .as_ref()
            .map(|p| p.fingerprint)
            .ok_or_else(super::no_output)?;

        // Name every chunk's key: nothing runs, nothing is read.
        let plan = data.plan(rows, Order::Sequential)?;
        let epoch = plan.epoch(0);
        let mut chunks: Vec<Chunk> = epoch
            .spans()
            .map(|span| {
                let at = Coordinate {
                    dataset: data.digest(),
                    start: span.first().copied().unwrap_or(0),
                    rows: span.len(),
                };
                Chunk {
                    coordinate: at,
                    key: output_key(&identity, &fingerprint, &graph_const, &frozen, &at),
                    fate: ChunkFate::Computed,
                }
            })
            .collect();

        // Which exist: held in memory, or in the store (an existence check, no read).
        let store = self.cache.store().cloned();
        let cached = E::CACHED;
        let mut outputs: Vec<Option<Array>> = Vec::with_capacity(chunks.len());
        for chunk in &mut chunks {
            let held = if cached {
                self.stage.held.get(&chunk.key).cloned()
            } else {
                None
            };
            if let Some(a) = held {
                chunk.fate = ChunkFate::Spared;
                outputs.push(Some(a));
                continue;
            }
            let stored = match &store {
                Some(s) if cached && s.contains(&chunk.key) => load(s.as_ref(), &chunk.key)?,
                _ => None,
            };
            if let Some(a) = stored {
                chunk.fate = ChunkFate::Loaded;
                self.stage.stats.bytes_loaded += a.size_bytes() as u64;
                self.stage.held.insert(chunk.key, a.clone());
                outputs.push(Some(a));
            } else {
                outputs.push(None);
            }
        }

        // Run the stage for the missing chunks only.
        let mut frozen_leaves: Vec<&Array> = Vec::new();
        for_each_frozen_leaf(&self.experiment, &mut |_, a| frozen_leaves.push(a));
        for ((chunk, output), span) in chunks.iter().zip(outputs.iter_mut()).zip(epoch.spans()) {
            if output.is_some() {
                continue;
            }
            let batch = data.gather(span, rows)?;
            let x = batch.column(E::INPUT).ok_or_else(super::no_output)?;
            let program = self.stage.program.as_mut().ok_or_else(super::no_output)?;
            if program.compiled.is_none() {
                // A stage runs on one device: on a handle replicated over several, on the
                // one-device backend of the same kind (its outputs are host arrays, split
                // across the devices with the rest of the batch).
                let backend: &dyn crate::backend::Backend = match self.backend.replicas() {
                    1 => self.backend,
                    _ if self.backend.device().is_some() => crate::backend::xla()?,
                    _ => crate::backend::interpreter(),
                };
                let started = Instant::now();
                program.compiled = Some(backend.compile(&program.graph, &program.text)?);
                self.compile_time += started.elapsed();
                self.stage.stats.compiles += 1;
            }
            let exe = program.compiled.as_ref().ok_or_else(super::no_output)?;
            let mut args = frozen_leaves.clone();
            args.push(x);
            let started = Instant::now();
            let full = exe.run(&args)?.pop().ok_or_else(super::no_output)?;
            self.stage.stats.run_ms += started.elapsed().as_secs_f64() * 1e3;
            self.stage.stats.executions += 1;
            // The chunk's rows without the padding.
            let real: Vec<usize> = (0..chunk.coordinate.rows).collect();
            let out = crate::data::gather_rows(&full, &real)?;
            if cached {
                if let Some(s) = &store {
                    let payload = crate::checkpoint::array_to_safetensors(&out)?;
                    self.stage.stats.bytes_stored += payload.len() as u64;
                    let identity_backend = self.backend.identity();
                    let entry = Entry {
                        meta: EntryMeta {
                            key: chunk.key,
                            program: identity.clone(),
                            fingerprint,
                            backend: identity_backend.digest,
                            backend_description: identity_backend.description.clone(),
                            options: identity_backend.options,
                            compile_ms: started.elapsed().as_secs_f64() * 1e3,
                            created: SystemTime::now()
                                .duration_since(UNIX_EPOCH)
                                .map_or(0, |d| d.as_secs()),
                        },
                        payload,
                    };
                    // A store that cannot take the entry costs a recompute next time, not
                    // this run.
                    if let Err(e) = s.put(&entry) {
                        tracing::warn!("nitro: a stage output was not stored: {e}");
                    }
                }
                self.stage.held.insert(chunk.key, out.clone());
            }
            *output = Some(out);
        }

        // Counts: every chunk not computed was spared a run.
        let computed = chunks
            .iter()
            .filter(|c| c.fate == ChunkFate::Computed)
            .count() as u64;
        let spared = chunks.len() as u64 - computed;
        let stats = &mut self.stage.stats;
        stats.hits += spared;
        stats.spared += spared;
        stats.misses += computed;
        if stats.executions > 0 {
            stats.saved_ms += spared as f64 * stats.run_ms / stats.executions as f64;
        }

        // The data set with the stage's column, named by the chunks' keys (nothing hashed).
        let parts: Vec<Array> = outputs.into_iter().flatten().collect();
        let column = super::values::join_rows(&parts)?;
        let mut h = ContentHasher::new();
        h.write_str("nitro.stage.dataset.v1");
        h.write_digest(&data.digest());
        h.write_str(E::OUTPUT);
        for c in &chunks {
            h.write_digest(&c.key);
        }
        let columns = data
            .columns()
            .map(|(n, a)| (n.to_owned(), a.clone()))
            .chain(std::iter::once((E::OUTPUT.to_owned(), column)));
        let staged = Dataset::named(columns, h.finish())?;
        tracing::info!(stage = E::NAME, computed, spared, "nitro: stage pre-pass");
        Ok((staged, StagePass { chunks }))
    }

    /// [`fit`](Nitro::fit) through the cached stage: before every epoch, the pre-pass
    /// ([`stage_pass`](Nitro::stage_pass)) over the training and validation data, then the
    /// epoch on the data with the stage's column. The first epoch runs the stage for every
    /// chunk not stored yet; later epochs find every chunk held and run none.
    pub fn fit_staged(&mut self, train: &Dataset, validation: Option<&Dataset>) -> Result<History>
    where
        E::Batch: FromBatch,
    {
        self.fit_with(train, validation, |run, data| {
            run.stage_pass(data).map(|(staged, _)| Cow::Owned(staged))
        })
    }

    /// Traces the stage program for chunks of `input`'s type, unless it is traced already.
    fn trace_stage(&mut self, input: &LeafType) -> Result<()> {
        if self
            .stage
            .program
            .as_ref()
            .is_some_and(|p| &p.input == input)
        {
            return Ok(());
        }
        let experiment = &self.experiment;
        let graph = trace::trace_with(|| {
            let view = experiment
                .frozen_view(&mut |_, path, leaf| trace::input(path.as_str(), leaf.leaf_type()));
            let x = trace::input(E::INPUT, input.clone());
            vec![E::run(&view, &x).into_tensor()]
        })?;
        let text = crate::emit::emit(&graph);
        let fingerprint = crate::emit::fingerprint(&text);
        self.stage.program = Some(StageProgram {
            input: input.clone(),
            graph,
            text,
            fingerprint,
            compiled: None,
        });
        Ok(())
    }
}

/// A stored stage output, or `None` when the entry is gone or was rejected (corrupt, foreign,
/// unsigned: the store removes what no configuration can use), so the chunk is computed again.
fn load(store: &dyn crate::cache::Store, key: &Digest) -> Result<Option<Array>> {
    match store.get(key)? {
        Lookup::Hit(entry) => match crate::checkpoint::array_from_safetensors(&entry.payload) {
            Ok(a) => Ok(Some(a)),
            Err(why) => {
                tracing::warn!("nitro: a stored stage output {why}; computing it again");
                Ok(None)
            }
        },
        Lookup::Absent => Ok(None),
        Lookup::Rejected(r) => {
            tracing::warn!("nitro: a stored stage output was rejected ({r:?}); computing it again");
            Ok(None)
        }
    }
}
