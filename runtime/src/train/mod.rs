//! The training handle: [`Nitro`] owns an experiment and an optimizer, compiles each of its
//! programs once, keeps parameters and optimizer state on the device between steps, and says
//! what it compiled.
//!
//! A [`Model`] names its batch type and its per-example loss (and, optionally, per-example
//! correctness). The handle derives its programs from them — plain `fn` items written once for
//! every model ([`Program::generic`]), so nothing enters a program that the key cannot see:
//!
//! | program | inputs | outputs | key |
//! | --- | --- | --- | --- |
//! | `grad` | the trainable leaves (one input each), the other Device leaves, the batch, a row mask; with loss scaling, the scale | mean loss over real rows, packed gradient | the experiment's GraphConsts, the signature, the [`Precision`] |
//! | `grad_accumulate` (instead of `grad` when [`Config::accum`] > 1) | as `grad`, plus the running gradient sum and a scale | mean loss, the new sum | as `grad` |
//! | `update` | trainable leaves and optimizer state (donated), gradients, learning rate, step; with loss scaling, the scale and its finite steps | new leaves, new state (a non-finite step kept as it was) | the optimizer's type and constants, the leaf types, the loss scaling |
//! | `eval` | as `grad` | summed loss and correct count over real rows, [`Model::predict`] | as `grad` |
//! | one per [`DeviceMetric`] | as `grad`, plus the running sum | the new sum | as `grad`, and the metric |
//!
//! The trainable leaves are stored packed into one flat array per dtype ([`LeafInputs`]): the
//! update program takes one buffer where it would take one per leaf, and the optimizer runs as
//! one loop over all parameters. The per-batch programs take one input per leaf — on XLA a
//! zero-copy view of the packed memory — and return the gradient packed.
//!
//! A ragged final batch is padded to the batch size and masked, so it needs no program of its
//! own: the gradient of a padded step equals that of the real rows alone. The learning rate and
//! the step number are traced inputs: schedules never recompile.
//!
//! On XLA the trainable leaves and the optimizer state live as device buffers between steps;
//! a step uploads the batch and enqueues its two programs without waiting for them, and the
//! update program reuses the memory of the state it replaces (donation). The host sees
//! parameters only when asked ([`Nitro::sync`], [`Nitro::experiment`]); [`Nitro::wait`] waits
//! for the steps taken so far.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::cache::{Cache, Compiled, Outcome, Served};
use crate::checkpoint::Checkpoint;
use crate::data::{Dataset, Order};
use crate::error::{Error, Result};
use crate::experiment::{Experiment, Role};
use crate::optim::{Optimizer, Schedule};
use crate::program::{self, Packing, Program};
use crate::trace::{self, Tensor};
use crate::tree::{Array, DType, LeafType, Node, Tree};

mod config;
mod created;
mod epochs;
mod inventory;
mod pieces;
mod precision;
mod prepare;
mod progress;
mod resume;
mod saving;
mod staged;
mod state;
pub(crate) mod values;
mod warm;

pub use crate::checkpoint::LossScaleState;
pub use config::{Config, InitRule, NonFinite};
pub use created::{create_leaf, initialize_on_host, CreatedLeaf, Initializer, InitializerView};
use epochs::*;
pub use epochs::{EpochRecord, History};
use inventory::*;
pub use inventory::{MaskRuns, OptimizerStep, OptimizerStepView, ProgramTime};
pub use precision::{LossScaling, Precision};
use prepare::*;
pub use prepare::{Plan, PlanEntry};
pub use progress::FirstRuns;
use progress::Progress;
pub use saving::SaveReport;
use state::{place_one, DeviceState, Layout};
pub use values::LeafInputs;
use values::{place_rows, to_host, In, Value};
pub use warm::{WarmReport, WarmUp};

/// A model the training handle can train: an experiment with a batch type and a per-example
/// loss over its compile view.
///
/// Both functions are traced (once per program), never run per step: they build the graph.
pub trait Model: Experiment + Sync + 'static {
    /// What one step sees of the data: a tree of arrays whose first dimension is the batch
    /// (`#[derive(Tree)] struct Batch { x: Array, y: Array }`).
    type Batch: Tree + Sync + 'static;

    /// Whether the model draws random numbers while training (dropout, noise). When it does,
    /// the gradient programs take one more input, the step's key (`u32[2]`, a traced value: a
    /// new key never recompiles), which [`random::step_key`](crate::trace::random::step_key)
    /// and [`nn::dropout`](crate::trace::nn::dropout) read while `loss` is traced. Draw `t`
    /// of a run (one per gradient evaluation) uses `fold_in(PRNGKey(Config::seed), t)`,
    /// replica `r` of a data-parallel step `fold_in` of that with `r`; checkpoints carry the
    /// stream, so a resumed run continues it. The evaluation programs take no key: dropout is
    /// off there. Drawing with this `false` is a trace-time error that says to set it.
    const RANDOM: bool = false;

    /// The loss of every example of the batch, shape `[batch]`. The handle masks padded rows
    /// and averages over the real ones.
    fn loss(v: &Self::View<'_>, batch: &<Self::Batch as Tree>::Mirror<Tensor>) -> Tensor;

    /// Whether every example is classified correctly (`1.0`) or not (`0.0`), shape `[batch]`,
    /// for the accuracy metric; `None` (the default) when the model has no such notion.
    fn correct(
        v: &Self::View<'_>,
        batch: &<Self::Batch as Tree>::Mirror<Tensor>,
    ) -> Option<Tensor> {
        let _ = (v, batch);
        None
    }

    /// What [`Nitro::predict`] returns for every example (logits, a regression value), shape
    /// `[batch, ...]`; `None` (the default) when the model predicts nothing. It is an output of
    /// the evaluation program, so predicting adds no program.
    fn predict(
        v: &Self::View<'_>,
        batch: &<Self::Batch as Tree>::Mirror<Tensor>,
    ) -> Option<Tensor> {
        let _ = (v, batch);
        None
    }
}

/// A validation metric accumulated on the device: a per-example value, summed over the real
/// rows by a program of its own (one more program in the inventory) and read once per
/// validation pass. Its value is the mean over the rows. Register it with
/// [`Nitro::add_device_metric`].
pub trait DeviceMetric<E: Model>: 'static {
    /// Its name: the history's column and the program's name.
    const NAME: &'static str;

    /// The metric of every example of the batch, shape `[batch]`.
    fn per_example(v: &E::View<'_>, batch: &<E::Batch as Tree>::Mirror<Tensor>) -> Tensor;
}

/// A validation metric computed on the host from the evaluation program's outputs (loss,
/// correct count, predictions) and the batch: it adds no program. Register it with
/// [`Nitro::add_host_metric`].
pub trait HostMetric<E: Model>: Send {
    /// Its name: the history's column.
    fn name(&self) -> &str;
    /// One validation batch: the batch (its first `eval.rows` rows are real) and what the
    /// evaluation program returned for it.
    fn update(&mut self, batch: &E::Batch, eval: &EvalResult);
    /// The value over the batches seen since the last call, which starts the next pass.
    fn finish(&mut self) -> f64;
}

/// What one training step returned.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepResult {
    /// The mean loss over the batch's real rows.
    pub loss: f64,
}

/// The result of evaluating a batch: summed loss and correct count over real rows, and the
/// predictions when asked for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EvalResult {
    /// The sum of per-example losses over real rows.
    pub loss_sum: f64,
    /// How many real rows were classified correctly (0 when the model has no `correct`).
    pub correct: f64,
    /// How many real rows there were.
    pub rows: usize,
    /// [`Model::predict`] for every row of the batch (padding rows included), when the model
    /// predicts and a host metric or [`Nitro::predict`] asked for it.
    pub predictions: Option<Array>,
    /// The validation metrics (device and host), by name, after [`Nitro::validate`].
    pub metrics: Vec<(String, f64)>,
}

impl EvalResult {
    /// The mean loss over the real rows (`loss_sum / rows`; 0 without rows).
    pub fn mean_loss(&self) -> f64 {
        if self.rows == 0 {
            0.0
        } else {
            self.loss_sum / self.rows as f64
        }
    }

    /// The fraction of real rows classified correctly (`correct / rows`; 0 without rows, and
    /// for a model without [`Model::correct`]).
    ///
    /// ```
    /// let r = nitro::train::EvalResult { loss_sum: 12.0, correct: 45.0, rows: 60, ..Default::default() };
    /// assert_eq!((r.accuracy(), r.mean_loss()), (0.75, 0.2));
    /// ```
    pub fn accuracy(&self) -> f64 {
        if self.rows == 0 {
            0.0
        } else {
            self.correct / self.rows as f64
        }
    }
}

/// The error of predicting with a model whose [`Model::predict`] gives nothing.
fn not_predicting<E: Model>() -> Error {
    Error::InvalidSetting {
        variable: "Model::predict",
        value: "None".into(),
        expected: format!(
            "a model that predicts: implement `Model::predict` for {}",
            E::TYPE_PATH
        ),
    }
}

/// A model batch built from a data set's gathered [`crate::data::Batch`] (its columns, padded
/// to the batch size), so that [`Nitro::fit`] can feed a [`Dataset`] to any model.
pub trait FromBatch: Sized {
    /// The model's batch from a gathered one.
    fn from_batch(batch: crate::data::Batch) -> Result<Self>;
}

/// A gathered batch is a model batch as it is (its mirror reads columns by name).
impl FromBatch for crate::data::Batch {
    fn from_batch(batch: crate::data::Batch) -> Result<Self> {
        Ok(batch)
    }
}

/// The training handle. See the [module docs](self).
///
/// It composes a few owned parts, each with its methods in a file of its own: the device
/// state (`state.rs`: parameters, optimizer state and everything placed, with the views'
/// invariant), the program inventory (`inventory.rs`, got by `prepare.rs`), and the run's
/// progress (`progress.rs`). `docs/internals.md` draws them.
pub struct Nitro<E: Model, O: Optimizer> {
    experiment: E,
    optimizer: O,
    config: Config,
    backend: &'static dyn Backend,
    cache: &'static Cache,
    /// What lives on the devices between steps, and its layout.
    state: DeviceState,
    /// The programs held, and what getting them took.
    inventory: Inventory<E>,
    /// Where the run stands.
    progress: Progress,
    /// Validation metrics computed on the host from the evaluation outputs.
    host_metrics: Vec<Box<dyn HostMetric<E>>>,
    /// A cached stage's program, held outputs and counts (unused without one).
    stage: staged::StageState,
    /// The background save in flight, and the last one finished.
    saves: saving::Saves,
}

impl<E: Model, O: Optimizer> std::fmt::Debug for Nitro<E, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nitro")
            .field("experiment", &E::TYPE_PATH)
            .field("optimizer", &self.optimizer)
            .field("config", &self.config)
            .field("backend", &self.backend.identity().description)
            .field("step", &self.progress.step())
            .finish()
    }
}

impl<E: Model, O: Optimizer> Nitro<E, O> {
    /// A handle training `experiment` with `optimizer` on the current backend
    /// ([`crate::backend::current`]) through the process-wide cache, on the devices
    /// [`Config::device_count`] names ([`crate::backend::for_devices`]).
    pub fn new(experiment: E, optimizer: O, config: Config) -> Result<Nitro<E, O>> {
        let backend = backend_for(&config)?;
        Nitro::with_backend(
            experiment,
            optimizer,
            config,
            backend,
            crate::cache::global(),
        )
    }

    /// A handle on an explicit backend and cache.
    pub fn with_backend(
        experiment: E,
        optimizer: O,
        config: Config,
        backend: &'static dyn Backend,
        cache: &'static Cache,
    ) -> Result<Nitro<E, O>> {
        if config.batch == 0 {
            return Err(Error::InvalidSetting {
                variable: "Config::batch",
                value: "0".into(),
                expected: "at least one row per step".into(),
            });
        }
        if config.accum == 0 {
            return Err(Error::InvalidSetting {
                variable: "Config::accum",
                value: "0".into(),
                expected: "at least one micro-batch per optimizer step".into(),
            });
        }
        if let Some(scaling) = config.precision.loss_scaling() {
            if !(scaling.initial.is_finite() && scaling.initial >= 1.0)
                || scaling.growth_interval == 0
            {
                return Err(Error::InvalidSetting {
                    variable: "Config::precision",
                    value: format!("{scaling:?}"),
                    expected: "a finite initial loss scale of at least 1 and a growth interval \
                               of at least 1 step"
                        .into(),
                });
            }
        }
        let replicas = backend.replicas();
        if let Some(n) = config.devices.filter(|&n| n != replicas) {
            return Err(Error::Devices {
                what: "Config::devices".into(),
                requested: n,
                reason: format!(
                    "the backend given runs programs on {replicas} device(s); pass \
                     `nitro::backend::for_devices({n})`, or make the handle with `Nitro::new`"
                ),
            });
        }
        if config.save_every.as_ref().is_some_and(|(n, _)| *n == 0) {
            return Err(Error::InvalidSetting {
                variable: "Config::save_every",
                value: "0 steps".into(),
                expected: "a save every 1 or more optimizer steps".into(),
            });
        }
        let wanted = config.partitioning()?;
        if backend.device().is_some() && wanted.as_ref() != backend.partitioning() {
            return Err(Error::Sharding {
                what: "the backend given".into(),
                problem: format!(
                    "it partitions programs over {}, and the config asks for {}; pass \
                     `nitro::backend::for_mesh` of the config's partitioning, or make the handle \
                     with `Nitro::new`",
                    backend
                        .partitioning()
                        .map_or_else(|| "no mesh".to_owned(), |p| p.describe()),
                    wanted
                        .as_ref()
                        .map_or_else(|| "no mesh".to_owned(), |p| p.describe()),
                ),
            });
        }
        // On a mesh, the config's batch axis decides on every backend (the interpreter runs
        // the unpartitioned programs, and a config it takes must run on XLA too).
        let devices = wanted
            .as_ref()
            .map_or_else(|| batch_split(backend), |p| p.row_split());
        if !config.batch.is_multiple_of(devices) {
            return Err(match wanted.as_ref() {
                // On a mesh the batch is split along the sharding's axis, which the caller set
                // through `Config::mesh` (and `Config::sharding`), never `Config::devices`.
                Some(p) => Error::Sharding {
                    what: format!("Config::batch({})", config.batch),
                    problem: format!(
                        "the batch is split along the mesh's `{axis}` axis into {devices} runs \
                         of rows, and {} rows do not divide into {devices}; make Config::batch \
                         a multiple of {devices}, or give `{axis}` a size that divides it in \
                         Config::mesh ({})",
                        config.batch,
                        p.describe(),
                        axis = p.sharding().axis(),
                    ),
                },
                None => Error::Devices {
                    what: match config.devices {
                        Some(_) => "Config::devices".into(),
                        None => "the device count (NITRO_DEVICES, or the backend given)".into(),
                    },
                    requested: devices,
                    reason: format!(
                        "a batch of {} rows cannot be split evenly across {devices} devices; \
                         make Config::batch a multiple of {devices}",
                        config.batch
                    ),
                },
            });
        }
        let layout = Layout::of(&experiment, &optimizer, backend)?;
        // Rules that create leaves on the devices are checked now, not at the first step.
        let creating = !created::plan(&config.initialize, &layout, &experiment)?.is_empty();
        let progress = Progress::new(config.seed);
        let mut state = DeviceState::new(layout, creating);
        state.set_loss_scaling(config.precision.loss_scaling());
        Ok(Nitro {
            experiment,
            optimizer,
            config,
            backend,
            cache,
            state,
            inventory: Inventory::new(),
            progress,
            host_metrics: Vec::new(),
            stage: staged::StageState::default(),
            saves: saving::Saves::default(),
        })
    }

    /// Registers a validation metric accumulated on the device ([`DeviceMetric`]): one more
    /// program, compiled by the first validation (by the first step of a `fit` with validation
    /// data).
    pub fn add_device_metric<M: DeviceMetric<E>>(&mut self) {
        self.inventory
            .add_metric(Box::new(MetricOf::<M>(std::marker::PhantomData)));
    }

    /// Registers a validation metric computed on the host ([`HostMetric`]): no program.
    pub fn add_host_metric(&mut self, metric: impl HostMetric<E> + 'static) {
        self.host_metrics.push(Box::new(metric));
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.progress.step()
    }

    /// The step count the update program keeps on the device: an `i64`, so it equals
    /// [`steps`](Nitro::steps) however long the run (Adam's bias correction reads it). Reading
    /// it waits for the steps taken so far.
    pub fn device_steps(&mut self) -> Result<u64> {
        match self.state.counter()? {
            None => Ok(self.progress.step()),
            Some(value) => u64::try_from(value).map_err(|_| no_output()),
        }
    }

    /// How long after the handle was made its first step finished (programs compiled or
    /// loaded, and one step run); `None` before the first step.
    pub fn first_step_time(&self) -> Option<Duration> {
        self.progress.first_step()
    }

    /// The gradient and update programs' first two runs, each timed alone: the first run's
    /// excess over the second is the backend's lazy set-up at a program's first execute
    /// (part of the first step that no load or compile shows). `None` before the first step,
    /// or with gradient accumulation.
    pub fn first_runs(&self) -> Option<FirstRuns> {
        self.progress.first_runs()
    }

    /// Each program lookup that prepared the inventory — per program its role, what the lookup
    /// did, and its trace and compile (or load) time — in the order they were looked up.
    pub fn program_times(&self) -> &[ProgramTime] {
        self.inventory.times()
    }

    /// Why its compiles cost what they cost: for every program the handle holds (each batch
    /// shape it prepared), what the program holds — ops by family, the largest constants and
    /// the GraphConst they came from, blocks repeated back to back (which
    /// [`nn::Repeated`](crate::nn::Repeated) would trace once), the emitted program's size —
    /// and what tracing and compiling (or loading) it took. Empty before the first
    /// [`prepare`](Nitro::prepare) or step. [`CompileReport::lints`](crate::cache::CompileReport::lints) says what to change.
    pub fn compile_report(&self) -> crate::cache::CompileReport {
        self.inventory.compile_report()
    }

    /// Time spent getting programs (tracing, loading, compiling), wall clock: the programs
    /// of one [`prepare`](Nitro::prepare) are got concurrently, so this is less than the sum of
    /// [`program_times`](Nitro::program_times).
    pub fn compile_time(&self) -> Duration {
        self.inventory.compile_time()
    }

    /// Sets the learning rate of the next steps (a traced scalar: never recompiles), and
    /// drops a schedule if one was set.
    pub fn set_lr(&mut self, lr: f64) {
        self.config.schedule = None;
        self.config.lr = lr;
    }

    /// Sets the epoch count [`fit`](Nitro::fit) trains up to.
    pub fn set_epochs(&mut self, epochs: usize) {
        self.config.epochs = epochs;
    }

    /// Epochs completed (by `fit`, `train_epoch`, [`end_epoch`](Nitro::end_epoch), or in the
    /// run a resumed checkpoint was taken in).
    pub fn epochs_done(&self) -> u64 {
        self.progress.epoch()
    }

    /// Batches of the current epoch trained: counted by every step call
    /// ([`step`](Nitro::step), [`step_deferred`](Nitro::step_deferred) and
    /// [`step_weighted`](Nitro::step_weighted), one per call, a micro-batch under accumulation)
    /// as by `fit` and `train_epoch`, restored by a resume, and saved in every checkpoint —
    /// where a loop continues in its data after a resume.
    pub fn epoch_batches(&self) -> u64 {
        self.progress.epoch_batches()
    }

    /// For a loop of its own over step calls: starts epoch `epoch` (from 0) and returns how
    /// many of its batches are trained already — skip that many. That is the batches a
    /// resumed checkpoint of the same epoch recorded, or 0 for another epoch (which then
    /// counts from 0), as [`train_epoch`](Nitro::train_epoch) continues.
    ///
    /// ```no_run
    /// # use nitro::train::{Model, Nitro};
    /// # fn run<E: Model, O: nitro::optim::Optimizer>(
    /// #     run: &mut Nitro<E, O>, batches: &dyn Fn(u64) -> Vec<E::Batch>, rows: usize,
    /// # ) -> nitro::Result<()> {
    /// for epoch in run.epochs_done()..10 {
    ///     let skip = run.begin_epoch(epoch) as usize;
    ///     for batch in batches(epoch).iter().skip(skip) {
    ///         run.step(batch, rows)?;
    ///     }
    ///     run.end_epoch(epoch);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn begin_epoch(&mut self, epoch: u64) -> u64 {
        self.progress.start_epoch(epoch)
    }

    /// For a loop of its own: epoch `epoch` is trained, so [`epochs_done`](Nitro::epochs_done)
    /// is `epoch + 1` and the next batches count from 0 in the next epoch.
    pub fn end_epoch(&mut self, epoch: u64) {
        self.progress.close_epoch(epoch);
    }

    /// The learning rate the next step uses.
    pub fn lr(&self) -> f64 {
        match &self.config.schedule {
            Some(s) => s.lr(self.progress.step()),
            None => self.config.lr,
        }
    }

    /// One training step on `batch` (exactly `Config::batch` rows) whose real rows are the
    /// first `real` (the rest is padding): gradient, then the optimizer update. Returns the
    /// mean loss over the real rows.
    ///
    /// **What it waits for:** reading the loss waits for the gradient program only. On XLA the
    /// optimizer's update is enqueued after it and may still be running when `step` returns
    /// (the next step, or any read of the parameters, waits for it by itself). To time a
    /// finished step, call [`wait`](Nitro::wait) after `step`; to pipeline steps, use
    /// [`step_deferred`](Nitro::step_deferred) and read the losses later.
    ///
    /// A batch whose real rows hold a label outside the classes of the loss reading it is
    /// refused before it runs ([`Error::LabelOutOfRange`], naming the batch's row).
    ///
    /// **An error means the step was not taken**, so retrying the batch trains it once. A
    /// background save's failure (and a [`Config::save_every`] save that could not start,
    /// [`Error::SaveNotStarted`]) is never returned by the step that found it: it is returned
    /// by the next call, before that call trains anything.
    pub fn step(&mut self, batch: &E::Batch, real: usize) -> Result<StepResult> {
        self.step_deferred(batch, real)?;
        let loss = self.take_losses()?.pop().unwrap_or(f64::NAN);
        Ok(StepResult { loss })
    }

    /// One training step whose loss stays where it was computed until
    /// [`take_losses`](Nitro::take_losses): on XLA the step is enqueued and the host does not
    /// wait for the device. With gradient accumulation ([`Config::accum`] > 1) this is one
    /// micro-batch, and every `accum`-th call applies the optimizer.
    pub fn step_deferred(&mut self, batch: &E::Batch, real: usize) -> Result<()> {
        let closes = self.progress.closes(self.config.accum);
        self.micro_step(batch, RowMask::Real(real), closes, None)?;
        self.progress.batch_done();
        self.after_step();
        Ok(())
    }

    /// One training step on `batch` whose rows weigh `weights` (one per row, `0` for padding
    /// rows, which come last): the loss is `Σ wᵣ·lossᵣ / Σ wᵣ`. With a per-row loss that is the
    /// mean over a row's real positions and weights that count them (what
    /// [`Ragged::gather`](crate::data::buckets::Ragged::gather) returns), that is the mean over
    /// the batch's real positions — so a batch padded to a bucket's edge trains exactly as the
    /// unpadded rows would. Waits as [`step`](Nitro::step) does.
    pub fn step_weighted(&mut self, batch: &E::Batch, weights: &[f32]) -> Result<StepResult> {
        let closes = self.progress.closes(self.config.accum);
        self.micro_step(batch, RowMask::Weights(weights), closes, None)?;
        self.progress.batch_done();
        self.after_step();
        let loss = self.take_losses()?.pop().unwrap_or(f64::NAN);
        Ok(StepResult { loss })
    }

    /// One micro-batch; the optimizer runs when `closes` (always, without accumulation).
    /// `rows_of` maps the batch's rows to the data set's, for errors that name a row.
    pub(super) fn micro_step(
        &mut self,
        batch: &E::Batch,
        mask: RowMask<'_>,
        closes: bool,
        rows_of: Option<&[usize]>,
    ) -> Result<()> {
        // A background save that failed says so here, before another step.
        self.saves.check()?;
        self.prepare(batch)?;
        self.place_state()?;
        let rows = batch_rows(batch)?;
        let real = mask.real(rows)?;
        let partitioned = self.backend.partitioning().is_some();
        let programs = self.inventory.current().ok_or_else(no_output)?;
        let before = self.state.inputs_before_batch(partitioned);
        check_class_inputs(&programs.grad, before, batch, real, rows_of)?;
        let (grad, update) = (programs.grad.clone(), programs.update.clone());
        self.state.ready(self.backend, self.config.leaf_views)?;
        self.state.place_full_mask(self.backend, rows)?;
        let ragged = match mask {
            RowMask::Real(real) if real < rows => {
                Some(place_rows(self.backend, mask_of(rows, real)?)?)
            }
            RowMask::Real(_) => None,
            RowMask::Weights(_) => Some(place_rows(self.backend, mask.array(rows)?)?),
        };
        let weight = mask.total(rows);
        let accumulating = self.config.accum > 1;
        // The draw's key, one per replica (replica `r`'s is `fold_in(key, r)`), as rows.
        let keys = if E::RANDOM {
            Some(self.draw_keys()?)
        } else {
            None
        };
        let mut scale = None;
        let mut sums = None;
        if accumulating {
            self.state.place_accumulation(self.backend)?;
            if let Some(factor) = self.progress.weigh(weight, closes) {
                scale = Some(place_one(self.backend, Array::scalar(factor))?);
            }
            sums = self.progress.take_sums();
        }
        let full = self.state.full_mask()?;
        let mut args = self.state.batch_args(
            partitioned,
            batch,
            In::Keep(ragged.as_ref().unwrap_or(full)),
        )?;
        if accumulating {
            let (zeros, one) = self.state.accumulation()?;
            match sums {
                Some(sums) => args.extend(sums.into_iter().map(In::Give)),
                None => args.extend(zeros.iter().map(In::Keep)),
            }
            args.push(In::Keep(scale.as_ref().unwrap_or(one)));
        }
        if let Some(keys) = &keys {
            // Partitioned, the program is one and takes one key, whole on every device.
            args.push(match partitioned {
                true => In::Whole(keys),
                false => In::Rows(keys),
            });
        }
        if let Some(scale) = self.state.loss_scale_value()? {
            args.push(In::Keep(scale));
        }
        // The first two steps time each program alone (the first run's lazy set-up shows as
        // its excess over the second): the update cannot start before the gradient is done,
        // so waiting for it costs an enqueue, not an overlap.
        let timed = (!accumulating && self.progress.times_runs()).then(Instant::now);
        let (out, done) = args.run(&grad)?;
        let grad_time = match timed {
            Some(started) => {
                for d in done {
                    d.wait()?;
                }
                Some(started.elapsed())
            }
            None => None,
        };
        if E::RANDOM {
            self.progress.drew();
        }
        let mut out = out.into_iter();
        let loss = out.next().ok_or_else(no_output)?;
        let grads: Vec<Value> = out.collect();
        self.progress.push_loss(loss);
        if !closes {
            self.progress.keep_sums(grads);
            return Ok(());
        }
        self.progress.close_window();
        let started = Instant::now();
        self.update(&update, grads)?;
        if let Some(grad_time) = grad_time {
            self.state.wait()?;
            self.progress.record_runs(grad_time, started.elapsed());
        }
        Ok(())
    }

    /// Applies the optimizer (`update`) to `grads` (the packed gradient of the step's mean
    /// loss).
    fn update(&mut self, update: &Compiled, grads: Vec<Value>) -> Result<()> {
        if let Some(schedule) = &self.config.schedule {
            self.config.lr = schedule.lr(self.progress.step());
        }
        self.state
            .update(self.backend, update, grads, self.config.lr)?;
        if self.progress.stepped() {
            // A step is a step finished, not one enqueued: the first one is waited for (once;
            // pipelining starts after it) before its time is taken.
            self.wait()?;
            self.progress.first_step_done();
        }
        Ok(())
    }

    /// The next draw's key for every replica, as `u32[2 · replicas]` rows: replica `r` gets
    /// `fold_in(key, r)` when there are several.
    fn draw_keys(&self) -> Result<Array> {
        let key = self.progress.next_key();
        let replicas = self.backend.replicas();
        let words: Vec<u32> = if replicas == 1 {
            key.to_vec()
        } else {
            (0..replicas as u32)
                .flat_map(|r| trace::random::threefry2x32_host(key, [0, r]))
                .collect()
        };
        Array::from_vec(&[words.len()], words)
    }

    /// Where dynamic loss scaling stands ([`Precision::f16`]): the scale the next step uses,
    /// the finite steps since it last moved, and the optimizer's own step count — the steps
    /// applied, so [`steps`](Nitro::steps) minus it is the steps skipped for non-finite
    /// gradients. Waits for the steps in flight. `None` without loss scaling, or before the
    /// first step.
    pub fn loss_scale(&mut self) -> Result<Option<LossScaleState>> {
        self.state.loss_scale()
    }

    /// The losses of the steps taken since the last call, in order (read from the device at
    /// once on XLA). With gradient accumulation, one per micro-batch.
    pub fn take_losses(&mut self) -> Result<Vec<f64>> {
        self.wait()?;
        self.progress.take_losses()
    }

    /// Evaluates `batch` (its first `real` rows) without training: summed loss and correct
    /// count over the real rows.
    pub fn evaluate(&mut self, batch: &E::Batch, real: usize) -> Result<EvalResult> {
        let (result, _) = self.run_eval(batch, RowMask::Real(real), false, None)?;
        Ok(result)
    }

    /// [`Model::predict`] for every row of `batch` (the evaluation program's forward pass:
    /// no program of its own). Rows past the real ones hold the padding's predictions. An
    /// error when the model does not predict.
    ///
    /// The batch has the rows the programs are compiled for ([`Config::batch`], or its bucket's
    /// rows); for any other number of rows, [`predict_data`](Nitro::predict_data) pads and
    /// trims on the same programs.
    pub fn predict(&mut self, batch: &E::Batch) -> Result<Array> {
        let rows = batch_rows(batch)?;
        let expected = self.expected_rows(batch)?;
        if rows != expected {
            return Err(Error::InvalidSetting {
                variable: "the batch given to Nitro::predict",
                value: format!("{rows} rows"),
                expected: format!(
                    "batches of {expected} rows, what the programs are compiled for \
                     (Config::batch); to predict any number of rows, put them in a Dataset and \
                     call Nitro::predict_data(&data): it pads the last batch and drops the \
                     padding's predictions, compiling nothing new"
                ),
            });
        }
        let (result, _) = self.run_eval(batch, RowMask::Real(rows), true, None)?;
        result.predictions.ok_or_else(not_predicting::<E>)
    }

    /// Runs the evaluation program on `batch`; reads the predictions back when `predictions`
    /// asks. Also returns the mask it placed, for the device metrics. `rows_of` maps the
    /// batch's rows to the data set's, for errors that name a row.
    pub(super) fn run_eval(
        &mut self,
        batch: &E::Batch,
        row_mask: RowMask<'_>,
        predictions: bool,
        rows_of: Option<&[usize]>,
    ) -> Result<(EvalResult, Array)> {
        let eval = self.prepare_eval(batch)?;
        self.place_state()?;
        let rows = batch_rows(batch)?;
        let real = row_mask.real(rows)?;
        let mask = row_mask.array(rows)?;
        let partitioned = self.backend.partitioning().is_some();
        let before = self.state.inputs_before_batch(partitioned);
        check_class_inputs(&eval, before, batch, real, rows_of)?;
        self.state.ready(self.backend, self.config.leaf_views)?;
        let args = self.state.batch_args(partitioned, batch, In::Rows(&mask))?;
        let (out, _) = args.run(&eval)?;
        // Outputs: the loss sum, then the correct count (a scalar) when the model has
        // `correct`, then the predictions (`[batch, ...]`) when it predicts.
        let has_correct = eval.outputs.get(1).is_some_and(|t| t.dims.is_empty());
        let has_predictions =
            eval.outputs.len() > 1 && eval.outputs.last().is_some_and(|t| !t.dims.is_empty());
        Ok((
            EvalResult {
                loss_sum: out.first().ok_or_else(no_output)?.scalar()?,
                correct: match has_correct {
                    true => out.get(1).map(Value::scalar).transpose()?.unwrap_or(0.0),
                    false => 0.0,
                },
                rows: real,
                predictions: match (predictions && has_predictions, out.last()) {
                    (true, Some(p)) => Some(p.rows_to_host()?),
                    _ => None,
                },
                metrics: Vec::new(),
            },
            mask,
        ))
    }

    /// Changes the experiment — a GraphConst, a Device value — through the handle, the only
    /// way to change it while it trains. The experiment is synced from the device first; after
    /// `change`, its Device leaves are placed again and the programs are looked up again at the
    /// next step, so a changed GraphConst recompiles exactly the programs whose key it is in,
    /// and changed Device values recompile nothing. The optimizer state is kept when the
    /// trainable leaves keep their types, and restarts from zero otherwise.
    pub fn modify(&mut self, change: impl FnOnce(&mut E)) -> Result<()> {
        self.state.hand_over()?;
        self.sync()?;
        change(&mut self.experiment);
        let layout = Layout::of(&self.experiment, &self.optimizer, self.backend)?;
        self.state.relayout(layout);
        self.inventory.forget();
        // Frozen fields or GraphConsts may have changed: the stage is traced and its frozen
        // state digested again (held outputs stay valid: their keys say what they were).
        self.stage.forget_program();
        Ok(())
    }

    /// Copies the trainable leaves back into the experiment (from the device on XLA).
    pub fn sync(&mut self) -> Result<()> {
        // Leaves still to be created on the devices are created first: they are the values.
        if self.state.creating() {
            self.place_state()?;
        }
        let Some(values) = self.state.read_back()? else {
            return Ok(());
        };
        let mut it = values.into_iter();
        self.experiment.visit_device_mut(&mut |field, _, leaf| {
            if field.role == (Role::Device { trainable: true }) {
                if let Some(v) = it.next() {
                    *leaf = v;
                }
            }
        });
        Ok(())
    }

    /// Waits until every step taken so far has finished on the device (on XLA, steps are
    /// enqueued and the host does not wait for them); the error of a step that failed on the
    /// device surfaces here. Reading losses, parameters or a checkpoint waits by itself; call
    /// this to time steps, or before measuring anything else.
    pub fn wait(&mut self) -> Result<()> {
        self.state.wait()
    }

    /// How the per-batch programs got the trainable leaves at the last step or evaluation:
    /// views of the packed parameters, or copies ([`LeafInputs`]); `None` before the first.
    pub fn leaf_inputs(&self) -> Option<LeafInputs> {
        self.state.leaf_inputs()
    }

    /// Places the experiment's Device leaves and the optimizer state where they are not yet
    /// ([`DeviceState::place`]): at the first step or evaluation, and after
    /// [`modify`](Nitro::modify).
    pub(super) fn place_state(&mut self) -> Result<()> {
        if self.state.creating() {
            let started = Instant::now();
            let layout = self.state.layout().clone();
            let (groups, leaves): (Vec<usize>, Vec<created::CreatedLeaf>) =
                created::plan(&self.config.initialize, &layout, &self.experiment)?
                    .into_iter()
                    .unzip();
            let values = created::create(
                self.backend,
                self.cache,
                leaves,
                &groups,
                &layout,
                self.config.seed,
            )?;
            self.state.place_created(
                self.backend,
                &self.experiment,
                groups.into_iter().zip(values).collect(),
                started,
            )?;
        }
        self.state
            .place(self.backend, &self.experiment, &self.optimizer)
    }

    /// Places the state on the devices now — the Device leaves (those of
    /// [`Config::initialize`] created there), zeroed optimizer state and the step counter —
    /// rather than at the first step or evaluation, which otherwise do it. Placing twice does
    /// nothing.
    pub fn place(&mut self) -> Result<()> {
        self.place_state()
    }

    /// How long creating the leaves of [`Config::initialize`] on the devices took (tracing,
    /// getting and running the initializer program, and placing the other leaves), once the
    /// first step or evaluation did it; `None` without such rules, or for a resumed handle.
    pub fn creation_time(&self) -> Option<Duration> {
        self.state.creation_time()
    }

    /// The experiment, with its trainable leaves as of the last step (copied from the device).
    pub fn experiment(&mut self) -> Result<&E> {
        self.sync()?;
        Ok(&self.experiment)
    }

    /// Ends the handle, returning the experiment with its trained leaves.
    pub fn into_experiment(mut self) -> Result<E> {
        self.sync()?;
        Ok(self.experiment)
    }

    /// How many devices the handle trains on: one replica of every program on each, or one
    /// partition of it over [`Config::mesh`].
    pub fn devices(&self) -> usize {
        self.backend.devices()
    }

    /// The multiple a batch's rows must be: the runs of rows it is split into.
    pub(super) fn row_multiple(&self) -> usize {
        batch_split(self.backend)
    }

    /// The mesh and sharding the handle's programs are partitioned over; `None` for replicated
    /// (or one-device) programs, and on the interpreter, which runs them unpartitioned.
    pub fn partitioning(&self) -> Option<&crate::shard::Partitioning> {
        self.backend.partitioning()
    }

    /// The bytes each device holds of the handle's state: the parameters, the optimizer state
    /// (from the layout: what the first step places, or placed), the gradient sums of an open
    /// accumulation window (under FSDP, each device's shard), and the compiled programs held
    /// for the current batch shape.
    pub fn memory(&self) -> Memory {
        let layout = self.state.layout();
        let mut frozen = 0u64;
        self.experiment.visit_device(&mut |field, _, node| {
            if let (false, Node::Leaf(a)) = (field.role == (Role::Device { trainable: true }), node)
            {
                frozen += (a.len() * a.dtype().size_bytes()) as u64;
            }
        });
        let grad_role = match self.config.accum > 1 {
            true => "grad_accumulate",
            false => "grad",
        };
        let sums = self.progress.window().sums.as_deref();
        Memory {
            devices: self.backend.devices(),
            parameters: layout.per_device_bytes(self.backend, &layout.packing.types()),
            frozen,
            optimizer_state: layout
                .per_device_bytes(self.backend, &state_types(&self.optimizer, &layout.packing)),
            gradient_sums: sums.map_or(0, |v| v.iter().map(Value::device_bytes).sum()),
            programs: self.inventory.memory(grad_role),
        }
    }

    /// The trainable leaves as every replica holds them, one list per device (after waiting
    /// for the steps taken so far). Replicas run the same update on the same reduced
    /// gradients, so the lists are equal — on the interpreter bit for bit; this is how to
    /// check it.
    pub fn replica_params(&mut self) -> Result<Vec<Vec<Array>>> {
        self.place_state()?;
        self.state.replica_params()
    }

    /// The number of arrays the trainable leaves and the optimizer state are kept in between
    /// steps: the trainable leaves are packed into one flat array per dtype, and each optimizer
    /// slot keeps one array per such group.
    pub fn state_len(&self) -> (usize, usize) {
        let groups = self.state.layout().packing.groups.len();
        (groups, groups * self.optimizer.slots().len())
    }
}

/// The backend a handle made by [`Nitro::new`] (or resumed by [`Nitro::resume`]) with
/// `config` runs on: partitioned over its mesh, or replicated over its device count.
pub(super) fn backend_for(config: &Config) -> Result<&'static dyn Backend> {
    match config.partitioning()? {
        Some(p) => crate::backend::for_mesh(&p),
        None => crate::backend::for_devices(config.device_count()?),
    }
}

/// Into how many runs of rows `backend` splits a batch: its replicas, or on a mesh the size
/// of the batch axis (devices that differ only along another axis share rows).
fn batch_split(backend: &dyn Backend) -> usize {
    match backend.partitioning() {
        Some(p) => p.row_split(),
        None => backend.replicas(),
    }
}

/// What each device holds of a training handle's state ([`Nitro::memory`]), in bytes.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Memory {
    /// How many devices hold it.
    pub devices: usize,
    /// The trainable parameters (packed, with their alignment gaps): whole per device, or
    /// one shard under FSDP.
    pub parameters: u64,
    /// The other Device leaves (whole on every device).
    pub frozen: u64,
    /// Every optimizer slot (whole, or one shard under FSDP).
    pub optimizer_state: u64,
    /// The gradient sums of an accumulation window in progress.
    pub gradient_sums: u64,
    /// The compiled programs held for the current batch shape, by role.
    pub programs: Vec<ProgramMemory>,
}

impl Memory {
    /// Parameters, frozen leaves, optimizer state and gradient sums: the state one device
    /// keeps between steps.
    pub fn state_bytes(&self) -> u64 {
        self.parameters + self.frozen + self.optimizer_state + self.gradient_sums
    }

    /// The most scratch space one of the held programs needs per device in a run (the
    /// compiler's temporaries: activations kept for the backward pass, among others);
    /// `None` when the backend reports no program's memory (the interpreter).
    pub fn largest_temporaries(&self) -> Option<u64> {
        self.programs
            .iter()
            .filter_map(|p| p.compiled.map(|c| c.temporaries))
            .max()
    }
}

/// One compiled program a handle holds, as [`Memory`] reports it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ProgramMemory {
    /// Its role: `grad` (or `grad_accumulate`), `update` or `eval`.
    pub role: String,
    /// Its size in memory as the compile cache estimates it (what
    /// [`CacheStats::estimated_bytes`](crate::cache::CacheStats::estimated_bytes) adds up).
    pub cached_bytes: u64,
    /// What the compiler planned for one run on one device — arguments, results, the part of
    /// the results written in place, temporaries, code — where the backend reports it (XLA,
    /// from the plugin's memory statistics); `None` on the interpreter.
    pub compiled: Option<crate::backend::CompiledMemory>,
}

/// The optimizer state's types for the packed trainable leaves: each slot, one per group (in
/// `f32` for half-precision groups).
fn state_types<O: Optimizer>(optimizer: &O, packing: &Packing) -> Vec<LeafType> {
    std::iter::repeat_n(packing.for_state().types(), optimizer.slots().len())
        .flatten()
        .collect()
}

/// Zeroed optimizer state of [`state_types`].
fn zero_state<O: Optimizer>(optimizer: &O, packing: &Packing) -> Vec<Array> {
    state_types(optimizer, packing)
        .iter()
        .map(|t| Array::zeros(t.dtype, &t.dims))
        .collect()
}

fn no_output() -> Error {
    Error::Misconfigured {
        message: "a training program returned no output".into(),
    }
}

/// The rows of a batch: the first dimension shared by its leaves.
fn batch_rows<B: Tree>(batch: &B) -> Result<usize> {
    let mut rows = None;
    let mut bad = None;
    batch.for_each_leaf("", &mut |path, a| {
        let r = a.dims().first().copied().unwrap_or(0);
        match rows {
            None => rows = Some(r),
            Some(prev) if prev != r && bad.is_none() => {
                bad = Some(format!("{path} has {r} rows, not {prev}"));
            }
            _ => {}
        }
    });
    if let Some(why) = bad {
        return Err(Error::InvalidSetting {
            variable: "batch",
            value: why,
            expected: "every leaf of a batch with the same first dimension".into(),
        });
    }
    rows.ok_or_else(|| Error::InvalidSetting {
        variable: "batch",
        value: "no leaves".into(),
        expected: "a batch with at least one array".into(),
    })
}

/// The leaves of a batch, in walk order (the order of the programs' inputs).
fn leaves<B: Tree>(batch: &B) -> Vec<&Array> {
    let mut v = Vec::new();
    batch.visit(&mut crate::tree::LeafPath::root(""), &mut |_, node| {
        if let Node::Leaf(a) = node {
            v.push(a);
        }
    });
    v
}

/// Whether `batch`'s leaves have exactly `types`, in order.
fn has_types<B: Tree>(batch: &B, types: &[crate::tree::LeafType]) -> bool {
    let (mut i, mut same) = (0, true);
    batch.for_each_leaf("", &mut |_, a| {
        same &= types
            .get(i)
            .is_some_and(|t| t.dtype == a.dtype() && t.dims == a.dims());
        i += 1;
    });
    same && i == types.len()
}

fn leaf_types<B: Tree>(batch: &B) -> Vec<crate::tree::LeafType> {
    let mut v = Vec::new();
    batch.for_each_leaf("", &mut |_, a| v.push(a.leaf_type()));
    v
}

/// Refuses a batch holding a value outside `0..classes` in an input `compiled` reads as class
/// indices ([`crate::trace::Graph::class_inputs`]), among its first `real` rows, naming the
/// column and the row (the data set's, through `rows_of`, else the batch's). `before` is how
/// many program inputs precede the batch's leaves. A scan of the label column on the host:
/// nothing next to the step it guards.
fn check_class_inputs<B: Tree>(
    compiled: &Compiled,
    before: usize,
    batch: &B,
    real: usize,
    rows_of: Option<&[usize]>,
) -> Result<()> {
    if compiled.class_inputs.is_empty() {
        return Ok(());
    }
    let leaves = leaves(batch);
    for c in &compiled.class_inputs {
        let Some(array) = c.input.checked_sub(before).and_then(|k| leaves.get(k)) else {
            continue;
        };
        if let Some(Ok((row, value))) = crate::data::first_label_outside(array, c.classes, real) {
            let path = compiled
                .inputs
                .leaves()
                .nth(c.input)
                .map_or("labels", |(p, _)| p);
            return Err(Error::LabelOutOfRange {
                column: path.strip_prefix("batch.").unwrap_or(path).to_owned(),
                row: rows_of.and_then(|r| r.get(row)).copied().unwrap_or(row),
                value,
                classes: c.classes,
            });
        }
    }
    Ok(())
}

/// A batch of `rows` rows has between 1 and `rows` real ones.
fn check_real_rows(rows: usize, real: usize) -> Result<()> {
    if real == 0 || real > rows {
        return Err(Error::InvalidSetting {
            variable: "real rows",
            value: real.to_string(),
            expected: format!("between 1 and the batch size {rows}"),
        });
    }
    Ok(())
}

/// `1.0` for the first `real` of `rows` rows, `0.0` after.
fn mask_of(rows: usize, real: usize) -> Result<Array> {
    check_real_rows(rows, real)?;
    let values: Vec<f32> = (0..rows)
        .map(|i| if i < real { 1.0 } else { 0.0 })
        .collect();
    Array::from_vec(&[rows], values)
}

/// How the rows of a batch count: the first `n` real (weight 1) and the rest padding, or a
/// weight per row (0 for padding rows, which come last).
#[derive(Clone, Copy, Debug)]
pub(super) enum RowMask<'a> {
    Real(usize),
    Weights(&'a [f32]),
}

impl RowMask<'_> {
    /// The real rows of a batch of `rows`: an error when more than `rows`, or when the weights
    /// are not one per row, negative, or nonzero after a zero.
    fn real(&self, rows: usize) -> Result<usize> {
        match *self {
            RowMask::Real(real) => {
                check_real_rows(rows, real)?;
                Ok(real)
            }
            RowMask::Weights(w) => {
                let real = w.iter().take_while(|&&x| x > 0.0).count();
                let bad = w.len() != rows
                    || w.iter().any(|x| !(x.is_finite() && *x >= 0.0))
                    || w[real..].iter().any(|&x| x != 0.0)
                    || real == 0;
                if bad {
                    return Err(Error::InvalidDataArgument {
                        what: format!(
                            "row weights {w:?} for a batch of {rows} rows: give one finite weight \
                             per row, positive for the real rows (which come first) and 0 for \
                             padding"
                        ),
                    });
                }
                Ok(real)
            }
        }
    }

    /// The total weight: the real rows, or the weights' sum.
    fn total(&self, rows: usize) -> f64 {
        match *self {
            RowMask::Real(real) => real.min(rows) as f64,
            RowMask::Weights(w) => w.iter().map(|&x| f64::from(x)).sum(),
        }
    }

    /// The mask the programs take, `f32 [rows]`.
    fn array(&self, rows: usize) -> Result<Array> {
        match *self {
            RowMask::Real(real) => mask_of(rows, real),
            RowMask::Weights(w) => Array::from_vec(&[rows], w.to_vec()),
        }
    }
}
