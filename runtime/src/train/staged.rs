//! The training handle's side of cached stages ([`crate::stage`]): the pre-pass that gives a
//! data set its stage column, and `fit` over it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::{EpochData, FromBatch, History, Model, Nitro};
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
/// frozen state's digest, the outputs held in memory, the data sets last made with them, and
/// the counts.
#[derive(Default)]
pub(crate) struct StageState {
    program: Option<StageProgram>,
    frozen: Option<Digest>,
    held: HashMap<Digest, Held>,
    /// The last data sets a pass made (at most [`MEMO`]: training and validation data with
    /// room to spare), by name: a pass that would make one again shares it.
    memo: Vec<(Digest, Arc<Dataset>)>,
    stats: StageStats,
}

/// How many data sets with a stage column a handle keeps.
const MEMO: usize = 4;

/// A stage output held in memory, and what computing it took.
struct Held {
    output: Array,
    run_ms: f64,
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
    /// Errors: [`Error::Nameless`] when the stage is cached and `data` has no digest
    /// ([`Dataset::unnamed`]); [`Error::Unsettled`] when the stage's program reads an input
    /// that is not a frozen field or its input column; [`Error::StageOutputRows`] when it does
    /// not return one row per input row; [`Error::DatasetColumn`] when `data` has no
    /// [`Stage::INPUT`] column or already has a [`Stage::OUTPUT`] column; the trace's,
    /// compile's and run's errors. All of them before the stage runs for any chunk.
    pub fn stage_pass(&mut self, data: &Dataset) -> Result<(Dataset, StagePass)> {
        let (staged, pass) = self.pass(data, "the data passed to stage_pass")?;
        Ok((Arc::unwrap_or_clone(staged), pass))
    }

    /// [`stage_pass`](Nitro::stage_pass), its data set shared with the memo; `which` names
    /// `data` in a refusal.
    fn pass(&mut self, data: &Dataset, which: &str) -> Result<(Arc<Dataset>, StagePass)> {
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
        let cached = E::CACHED;
        if cached && data.digest().is_none() {
            return Err(nameless::<E>(which));
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

        // Name every chunk's key: nothing runs, nothing is read. (An uncached stage's data
        // set may have no digest: its keys name nothing that is kept.)
        let plan = data.plan(rows, Order::Sequential)?;
        let epoch = plan.epoch(0);
        let mut chunks: Vec<Chunk> = epoch
            .spans()
            .map(|span| {
                let at = Coordinate {
                    dataset: data.digest().unwrap_or_default(),
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
        // The data set with the stage's column is named by the chunks' keys (nothing hashed).
        let staged_name = data.digest().map(|digest| {
            let mut h = ContentHasher::new();
            h.write_str("nitro.stage.dataset.v1");
            h.write_digest(&digest);
            h.write_str(E::OUTPUT);
            for c in &chunks {
                h.write_digest(&c.key);
            }
            h.finish()
        });

        // Made already by an earlier pass: every chunk is held, and the data set is shared,
        // not rebuilt.
        if let (true, Some(name)) = (cached, staged_name) {
            if let Some(memo) = self.stage.memo.iter().find(|(n, _)| *n == name) {
                let staged = Arc::clone(&memo.1);
                let mut saved = 0.0;
                for chunk in &mut chunks {
                    chunk.fate = ChunkFate::Spared;
                    saved += self.stage.held.get(&chunk.key).map_or(0.0, |h| h.run_ms);
                }
                self.count(&chunks, saved);
                return Ok((staged, StagePass { chunks }));
            }
        }

        // Which exist: held in memory, or in the store (an existence check, no read).
        let store = self.cache.store().cloned();
        let mut saved = 0.0;
        let mut outputs: Vec<Option<Array>> = Vec::with_capacity(chunks.len());
        for chunk in &mut chunks {
            let held = if cached {
                self.stage.held.get(&chunk.key)
            } else {
                None
            };
            if let Some(held) = held {
                chunk.fate = ChunkFate::Spared;
                saved += held.run_ms;
                outputs.push(Some(held.output.clone()));
                continue;
            }
            let stored = match &store {
                Some(s) if cached && s.contains(&chunk.key) => load(s.as_ref(), &chunk.key)?,
                _ => None,
            };
            if let Some(held) = stored {
                chunk.fate = ChunkFate::Loaded;
                saved += held.run_ms;
                self.stage.stats.bytes_loaded += held.output.size_bytes() as u64;
                outputs.push(Some(held.output.clone()));
                self.stage.held.insert(chunk.key, held);
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
            let x = batch.get(E::INPUT).ok_or_else(super::no_output)?;
            let program = self.stage.program.as_mut().ok_or_else(super::no_output)?;
            if program.compiled.is_none() {
                // A stage runs on one device: on a handle replicated (or partitioned) over
                // several, on the one-device backend of the same kind (its outputs are host
                // arrays, split across the devices with the rest of the batch).
                let backend: &dyn crate::backend::Backend = match self.backend.devices() {
                    1 => self.backend,
                    _ if self.backend.device().is_some() => crate::backend::xla()?,
                    _ => crate::backend::interpreter(),
                };
                let started = Instant::now();
                program.compiled = Some(backend.compile(&program.graph, &program.text)?);
                self.inventory.spent(started.elapsed());
                self.stage.stats.compiles += 1;
            }
            let exe = program.compiled.as_ref().ok_or_else(super::no_output)?;
            let mut args = frozen_leaves.clone();
            args.push(x);
            let started = Instant::now();
            let full = exe.run(&args)?.pop().ok_or_else(super::no_output)?;
            let run_ms = started.elapsed().as_secs_f64() * 1e3;
            self.stage.stats.run_ms += run_ms;
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
                            // For a stage output: the time its chunk took to compute.
                            compile_ms: run_ms,
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
                let held = Held {
                    output: out.clone(),
                    run_ms,
                };
                self.stage.held.insert(chunk.key, held);
            }
            *output = Some(out);
        }
        self.count(&chunks, saved);

        let parts: Vec<Array> = outputs.into_iter().flatten().collect();
        let column = super::values::join_rows(&parts)?;
        let columns = data
            .columns()
            .map(|(n, a)| (n.to_owned(), a.clone()))
            .chain(std::iter::once((E::OUTPUT.to_owned(), column)));
        let staged = Arc::new(match staged_name {
            Some(name) => Dataset::named(columns, name)?,
            None => Dataset::unnamed(columns)?,
        });
        if let (true, Some(name)) = (cached, staged_name) {
            if self.stage.memo.len() == MEMO {
                self.stage.memo.remove(0);
            }
            self.stage.memo.push((name, Arc::clone(&staged)));
        }
        Ok((staged, StagePass { chunks }))
    }

    /// Adds a pass's chunks to the counts; `saved` is what the spared chunks took to compute.
    fn count(&mut self, chunks: &[Chunk], saved: f64) {
        let of = |fate| chunks.iter().filter(|c| c.fate == fate).count() as u64;
        let (computed, loaded, held) = (
            of(ChunkFate::Computed),
            of(ChunkFate::Loaded),
            of(ChunkFate::Spared),
        );
        let stats = &mut self.stage.stats;
        stats.hits += loaded;
        stats.misses += computed;
        stats.spared += loaded + held;
        stats.saved_ms += saved;
        tracing::info!(
            stage = E::NAME,
            computed,
            loaded,
            held,
            "nitro: stage pre-pass"
        );
    }

    /// [`fit`](Nitro::fit) through the cached stage: before every epoch, the pre-pass
    /// ([`stage_pass`](Nitro::stage_pass)) over the training and validation data, then the
    /// epoch on the data with the stage's column. The first epoch runs the stage for every
    /// chunk not stored yet; later epochs find every chunk held and run none.
    pub fn fit_staged(&mut self, train: &Dataset, validation: Option<&Dataset>) -> Result<History>
    where
        E::Batch: FromBatch,
    {
        if E::CACHED {
            // Refused before anything runs.
            let named = [(Some(train), TRAINING), (validation, VALIDATION)];
            if let Some((_, which)) = named
                .iter()
                .find(|(d, _)| d.is_some_and(|d| d.digest().is_none()))
            {
                return Err(nameless::<E>(which));
            }
        }
        self.fit_with(train, validation, |run, data| {
            let which = if std::ptr::eq(data, train) {
                TRAINING
            } else {
                VALIDATION
            };
            run.pass(data, which)
                .map(|(staged, _)| EpochData::Shared(staged))
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
        // The inputs nitro supplies: every frozen leaf, then the chunk.
        let mut supplied = 1;
        for_each_frozen_leaf(experiment, &mut |_, _| supplied += 1);
        let graph = trace::trace_with(|| {
            let view = experiment
                .frozen_view(&mut |_, path, leaf| trace::input(path.as_str(), leaf.leaf_type()));
            let x = trace::input(E::INPUT, input.clone());
            vec![E::run(&view, &x).into_tensor()]
        })?;
        // Every input past the frozen leaves and the chunk was made by the stage itself: a
        // value nitro neither supplies nor names the outputs by.
        if let Some(extra) = graph.inputs.get(supplied) {
            return Err(Error::Unsettled {
                stage: E::NAME.to_owned(),
                input: extra.name.clone(),
                column: E::INPUT.to_owned(),
            });
        }
        let output = graph
            .outputs
            .first()
            .map(|&id| &graph.node(id).ty)
            .ok_or_else(super::no_output)?;
        if output.dims.first() != Some(&input.dims[0]) {
            return Err(Error::StageOutputRows {
                stage: E::NAME.to_owned(),
                output: output.to_string(),
                rows: input.dims[0],
            });
        }
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

/// How a refusal names `fit_staged`'s data.
const TRAINING: &str = "the training data";
const VALIDATION: &str = "the validation data";

/// The refusal of a cached stage over `which` data, which has no digest.
fn nameless<E: Stage>(which: &str) -> Error {
    Error::Nameless {
        stage: E::NAME.to_owned(),
        data: which.to_owned(),
    }
}

/// A stored stage output, or `None` when the entry is gone or was rejected (corrupt, foreign,
/// unsigned: the store removes what no configuration can use), so the chunk is computed again.
fn load(store: &dyn crate::cache::Store, key: &Digest) -> Result<Option<Held>> {
    match store.get(key)? {
        Lookup::Hit(entry) => match crate::checkpoint::array_from_safetensors(&entry.payload) {
            Ok(output) => Ok(Some(Held {
                output,
                run_ms: entry.meta.compile_ms,
            })),
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
