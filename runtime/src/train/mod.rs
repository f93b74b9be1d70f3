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
//! | `grad` | the trainable leaves (packed), the other Device leaves, the batch, a row mask | mean loss over real rows, packed gradient | the experiment's GraphConsts, the signature |
//! | `grad_accumulate` (instead of `grad` when [`Config::accum`] > 1) | as `grad`, plus the running gradient sum and a scale | mean loss, the new sum | as `grad` |
//! | `update` | trainable leaves and optimizer state (donated), gradients, learning rate, step | new leaves, new state | the optimizer's type and constants, the leaf types |
//! | `eval` | as `grad` | summed loss and correct count over real rows, [`Model::predict`] | as `grad` |
//! | one per [`DeviceMetric`] | as `grad`, plus the running sum | the new sum | as `grad`, and the metric |
//!
//! The trainable leaves are packed into one flat array per dtype: a step passes one buffer
//! where it would pass one per leaf, and the optimizer runs as one loop over all parameters.
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

use crate::backend::pjrt::Completion;
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

mod staged;
mod values;
use values::{exec, place, place_rows, to_host, In, Value};

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

/// The inputs of the per-batch programs: the batch, its row mask, and what else the program
/// takes (`()` for none).
type BatchInputs<E, X> = (
    <<E as Model>::Batch as Tree>::Mirror<Tensor>,
    Tensor,
    <X as Tree>::Mirror<Tensor>,
);

/// What the gradient program takes besides the batch: the step's random key, when the model
/// draws random numbers ([`Model::RANDOM`]).
type GradExtra = Option<Array>;

/// What the accumulating gradient program takes besides the batch: the gradient sum so far
/// (packed), the factor to multiply the new sum by (1 except when a window closes), and the
/// step's random key (as [`GradExtra`]).
type AccumExtra = (Vec<Array>, Array, Option<Array>);

/// The model's loss, traced with the step's key (or its absence) in force.
fn keyed_loss<E: Model>(
    v: &E::View<'_>,
    batch: &<E::Batch as Tree>::Mirror<Tensor>,
    key: Option<Tensor>,
) -> Tensor {
    let state = match key {
        Some(k) => trace::random::StepKey::Training(k),
        None if E::RANDOM => trace::random::StepKey::Evaluation,
        None => trace::random::StepKey::Unkeyed(E::TYPE_PATH),
    };
    trace::random::with_step_key(state, || E::loss(v, batch))
}

/// The mean loss over the real rows, then the gradient of every trainable leaf (packed).
///
/// Replicated over several devices, each replica differentiates the summed loss of its own rows;
/// the sums and the gradients are then added over the replicas (one `all_reduce` per packed
/// group) and divided by the real rows of the whole batch, so every replica ends with the
/// gradient of the global batch's mean loss.
fn grad_fn<E: Model>(v: &E::View<'_>, inputs: &BatchInputs<E, GradExtra>) -> Vec<Tensor> {
    let (batch, mask, key) = inputs;
    let losses = per_example::<E>(keyed_loss::<E>(v, batch, *key), *mask, "Model::loss", true);
    let mask = mask.convert(losses.dtype());
    if trace::replicas() == 1 {
        let mean = (losses * mask).sum_all() / mask.sum_all().maximum(1.0);
        let grads = program::pack_like_trainable(trace::grad(mean, &program::trainable_leaves()));
        return std::iter::once(mean).chain(grads).collect();
    }
    let total = (losses * mask).sum_all();
    let count = mask.sum_all().all_sum().maximum(1.0);
    let grads = program::pack_like_trainable(trace::grad(total, &program::trainable_leaves()));
    let mean = total.all_sum() / count;
    std::iter::once(mean)
        .chain(
            grads
                .into_iter()
                .map(|g| g.all_sum() / count.convert(g.dtype())),
        )
        .collect()
}

/// `values`, after checking that it holds one value per row of the batch (the mask's shape):
/// a `[batch, 1]` loss would broadcast against the mask to `[batch, batch]` (a loss and a
/// gradient about `batch` times too large, with padded rows leaking in), and a scalar would
/// train on padding. Anything else (or, when `float`, a value that is not a float) is refused
/// at trace time, naming `what`, the shape expected and the shape given.
fn per_example<E: Model>(values: Tensor, mask: Tensor, what: &'static str, float: bool) -> Tensor {
    let (got, want) = (values.dims(), mask.dims());
    if got != want || (float && !values.dtype().is_float()) {
        trace::refuse(
            what,
            format!(
                "`{what}` of `{}` returned {}, and it must return one value per row of the batch, \
                 shape {want:?}: the handle masks padded rows and averages over the real ones \
                 itself; reduce every other dim (a `[rows, 1]` regression loss: `.sum(&[1])`), \
                 and do not average over the batch",
                E::TYPE_PATH,
                LeafType::new(values.dtype(), &got),
            ),
        );
    }
    values
}

/// One micro-batch of an accumulation window: the mean loss over its real rows, then
/// `(sum + gradient of the summed loss over its real rows) * scale` for every packed gradient.
/// With `scale` 1 along the window and `1 / real rows of the window` on its last micro-batch,
/// the window ends holding the gradient of the window's mean loss — exactly what one step on
/// all its rows would compute.
fn grad_accum_fn<E: Model>(v: &E::View<'_>, inputs: &BatchInputs<E, AccumExtra>) -> Vec<Tensor> {
    let (batch, mask, (sums, scale, key)) = inputs;
    let losses = per_example::<E>(keyed_loss::<E>(v, batch, *key), *mask, "Model::loss", true);
    let mask = mask.convert(losses.dtype());
    let total = (losses * mask).sum_all();
    // Replicated, the sums and gradients add over the replicas (`all_sum` is the tensor itself
    // on one device).
    let mean = total.all_sum() / mask.sum_all().all_sum().maximum(1.0);
    let grads = program::pack_like_trainable(trace::grad(total, &program::trainable_leaves()));
    let summed = sums
        .iter()
        .zip(grads)
        .map(|(s, g)| (*s + g.all_sum()) * scale.convert(g.dtype()));
    std::iter::once(mean).chain(summed).collect()
}

/// The summed loss over the real rows, and the number of them classified correctly.
fn eval_fn<E: Model>(v: &E::View<'_>, inputs: &BatchInputs<E, ()>) -> Vec<Tensor> {
    let (batch, mask, ()) = inputs;
    let state = if E::RANDOM {
        trace::random::StepKey::Evaluation
    } else {
        trace::random::StepKey::Unkeyed(E::TYPE_PATH)
    };
    let loss = trace::random::with_step_key(state, || E::loss(v, batch));
    let losses = per_example::<E>(loss, *mask, "Model::loss", true);
    let mask_l = mask.convert(losses.dtype());
    // Replicated, the sums add over the replicas; the predictions stay per replica (each its
    // own rows), joined on the host.
    let mut out = vec![(losses * mask_l).sum_all().all_sum()];
    if let Some(correct) = E::correct(v, batch) {
        let correct = per_example::<E>(correct, *mask, "Model::correct", false);
        out.push((correct.convert(DType::F32) * *mask).sum_all().all_sum());
    }
    if let Some(predictions) = E::predict(v, batch) {
        out.push(predictions);
    }
    out
}

/// A device metric's running sum plus its per-example values over this batch's real rows.
fn metric_fn<E: Model, M: DeviceMetric<E>>(
    v: &E::View<'_>,
    inputs: &BatchInputs<E, Array>,
) -> Vec<Tensor> {
    let (batch, mask, sum) = inputs;
    let values = per_example::<E>(M::per_example(v, batch), *mask, M::NAME, true);
    let mask = mask.convert(values.dtype());
    vec![*sum + (values * mask).sum_all().all_sum().convert(sum.dtype())]
}

fn metric_program<E: Model, M: DeviceMetric<E>>() -> Program<E, BatchInputs<E, Array>, Vec<Tensor>>
{
    Program::generic(M::NAME, metric_fn::<E, M>).packing_trainable()
}

/// A registered device metric, its type erased.
trait MetricSlot<E: Model>: Send + Sync {
    fn name(&self) -> &'static str;
    /// Gets (or compiles) its program for batches like `sample`.
    fn get(
        &self,
        cache: &Cache,
        backend: &'static dyn Backend,
        experiment: &E,
        sample: &Shaped<'_, E::Batch>,
        mask: &Array,
    ) -> Result<Served>;
}

struct MetricOf<M>(std::marker::PhantomData<fn() -> M>);

impl<E: Model, M: DeviceMetric<E>> MetricSlot<E> for MetricOf<M> {
    fn name(&self) -> &'static str {
        M::NAME
    }

    fn get(
        &self,
        cache: &Cache,
        backend: &'static dyn Backend,
        experiment: &E,
        sample: &Shaped<'_, E::Batch>,
        mask: &Array,
    ) -> Result<Served> {
        let sum = Array::scalar(0.0f32);
        cache.get(
            backend,
            &metric_program::<E, M>(),
            experiment,
            &BatchRef(sample, mask, &sum),
        )
    }
}

/// What [`Nitro::prepare_programs`] compiles: the training programs, with the evaluation
/// program, with that and every device metric's.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Inventory {
    Train,
    Evaluate,
    Validate,
}

/// A registered device metric and its program, once compiled.
struct DeviceMetricState<E: Model> {
    slot: Box<dyn MetricSlot<E>>,
    compiled: Option<Arc<Compiled>>,
}

fn grad_program<E: Model>() -> Program<E, BatchInputs<E, GradExtra>, Vec<Tensor>> {
    Program::generic("nitro.grad", grad_fn::<E>).packing_trainable()
}

fn grad_accum_program<E: Model>() -> Program<E, BatchInputs<E, AccumExtra>, Vec<Tensor>> {
    Program::generic("nitro.grad_accumulate", grad_accum_fn::<E>).packing_trainable()
}

fn eval_program<E: Model>() -> Program<E, BatchInputs<E, ()>, Vec<Tensor>> {
    Program::generic("nitro.eval", eval_fn::<E>).packing_trainable()
}

/// The optimizer program's experiment: the optimizer's constants shape it (GraphConst), the
/// trainable leaves and the state are its Device leaves — donated to its outputs.
#[crate::experiment]
pub struct OptimizerStep<O: Optimizer> {
    /// The optimizer: its type and constants are the program's key.
    #[graph_const]
    pub optimizer: O,
    /// The trainable leaves.
    #[device]
    pub params: Vec<Array>,
    /// The optimizer state, slot by slot, leaf by leaf.
    #[device]
    pub state: Vec<Array>,
    /// The optimizer's [`leaf_mask`](Optimizer::leaf_mask) over the packed parameters: per
    /// packed array, runs of `(elements, selected)` in order; empty for an array wholly
    /// selected (and no arrays at all when the optimizer asked for no mask).
    #[graph_const]
    pub masks: MaskRuns,
    /// Steps taken so far, `i64[]`: kept on the device and counted by the program, so a step
    /// uploads no step number; an integer, so it stays exact over any run (an `f32` counter
    /// stops counting at 2^24 steps).
    #[device]
    pub steps: Array,
}

/// Per packed array, the runs of `(elements, selected)` of an optimizer's leaf mask.
pub type MaskRuns = Vec<Vec<(usize, bool)>>;

/// The runs of `optimizer`'s leaf mask over the leaves `paths` packed as `packing`.
fn mask_runs<O: Optimizer>(optimizer: &O, paths: &[String], packing: &Packing) -> Result<MaskRuns> {
    let types: Vec<LeafType> = packing
        .leaves
        .iter()
        .map(|(g, _, dims)| LeafType {
            dtype: packing.groups[*g].0,
            dims: dims.clone(),
        })
        .collect();
    let leaves: Vec<(&str, &LeafType)> = paths.iter().map(String::as_str).zip(&types).collect();
    let Some(mask) = optimizer.leaf_mask(&leaves)? else {
        return Ok(Vec::new());
    };
    if mask.len() != leaves.len() {
        return Err(Error::InputCount {
            expected: leaves.len(),
            got: mask.len(),
        });
    }
    let mut runs: MaskRuns = vec![Vec::new(); packing.groups.len()];
    for ((g, _, dims), on) in packing.leaves.iter().zip(mask) {
        let n: usize = dims.iter().product();
        match runs[*g].last_mut() {
            Some((len, last)) if *last == on => *len += n,
            _ => runs[*g].push((n, on)),
        }
    }
    for group in &mut runs {
        if group.iter().all(|&(_, on)| on) {
            group.clear();
        }
    }
    Ok(runs)
}

/// The inputs of the update program: the gradients and the learning rate.
type UpdateInputs = (Vec<Tensor>, Tensor);

fn update_fn<O: Optimizer>(v: &OptimizerStepView<'_, O>, inputs: &UpdateInputs) -> Vec<Tensor> {
    let (grads, lr) = inputs;
    let number = v.steps + 1.0;
    let masks: Vec<Option<Tensor>> = v
        .params
        .iter()
        .enumerate()
        .map(|(g, p)| {
            let runs = v.masks.get(g).filter(|r| !r.is_empty())?;
            let pieces: Vec<Tensor> = runs
                .iter()
                .map(|&(n, on)| Tensor::full(&[n], if on { 1.0 } else { 0.0 }, p.dtype()))
                .collect();
            Some(Tensor::concatenate(&pieces, 0))
        })
        .collect();
    let mut out = crate::optim::update_flat(
        v.optimizer,
        &v.params,
        grads,
        &v.state,
        *lr,
        number.convert(DType::F32),
        &masks,
    );
    out.push(number);
    out
}

fn update_program<O: Optimizer>() -> Program<OptimizerStep<O>, UpdateInputs, Vec<Tensor>> {
    OptimizerStep::<O>::program("nitro.update", update_fn::<O>).donating_device()
}

/// How a handle trains.
#[derive(Clone, Debug)]
pub struct Config {
    /// Rows per step (the last batch of an epoch is padded to it).
    pub batch: usize,
    /// The learning rate (a traced scalar: changing it never recompiles).
    pub lr: f64,
    /// Epochs [`Nitro::fit`] runs.
    pub epochs: usize,
    /// The seed of the run: of the per-epoch shuffles, and of the random stream of a model
    /// that draws random numbers ([`Model::RANDOM`]; its base key is JAX's `PRNGKey(seed)`).
    pub seed: u64,
    /// A learning-rate schedule; when set, it gives the rate of every step (and `lr` is
    /// ignored). Its rates are written to a traced scalar: a schedule never recompiles.
    pub schedule: Option<Arc<dyn Schedule>>,
    /// Whether [`Nitro::fit`] draws a progress bar per epoch on stderr (only ever when stderr
    /// is a terminal).
    pub progress: bool,
    /// Micro-batches per optimizer step (gradient accumulation): each of
    /// [`step_deferred`](Nitro::step_deferred)'s batches adds its gradient to a sum on the
    /// device, and every `accum`-th applies the optimizer to the mean over the window's real
    /// rows. 1 (the default) updates after every batch. Accumulating adds no program: it
    /// replaces the gradient program by an accumulating one.
    pub accum: usize,
    /// Devices to train on at once (data parallelism), `None` for the count `NITRO_DEVICES`
    /// sets, else 1. Every program runs as one replica per device: parameters and optimizer
    /// state are replicated, each batch is split by rows across the devices (so
    /// [`Config::batch`] must be a multiple of the count), gradients and sums are added over the
    /// devices inside the programs, and every device runs the optimizer. The program inventory
    /// is the same at any count.
    pub devices: Option<usize>,
    /// Whether [`Nitro::prepare`] (and the first step) compiles the programs concurrently, one
    /// thread each (the default: the first step waits for the slowest program, not for their
    /// sum), or one after another — slower to start on a busy machine, but each program's
    /// compile time in [`Nitro::program_times`] is then its own, not contended by the others.
    pub concurrent_compiles: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            batch: 32,
            lr: 1e-3,
            epochs: 10,
            seed: 0,
            schedule: None,
            progress: true,
            accum: 1,
            devices: None,
            concurrent_compiles: true,
        }
    }
}

impl Config {
    /// The default configuration: batch 32, learning rate 1e-3, 10 epochs, seed 0.
    pub fn new() -> Config {
        Config::default()
    }

    /// Rows per step.
    pub fn batch(mut self, rows: usize) -> Config {
        self.batch = rows;
        self
    }

    /// The learning rate.
    pub fn lr(mut self, lr: f64) -> Config {
        self.lr = lr;
        self
    }

    /// Epochs [`Nitro::fit`] runs.
    pub fn epochs(mut self, epochs: usize) -> Config {
        self.epochs = epochs;
        self
    }

    /// The seed of the per-epoch shuffles and of the random stream.
    pub fn seed(mut self, seed: u64) -> Config {
        self.seed = seed;
        self
    }

    /// Whether to draw a progress bar per epoch (on stderr, and only when it is a terminal).
    pub fn progress(mut self, on: bool) -> Config {
        self.progress = on;
        self
    }

    /// Micro-batches per optimizer step (see [`Config::accum`]).
    pub fn accumulate(mut self, micro_batches: usize) -> Config {
        self.accum = micro_batches;
        self
    }

    /// Devices to train on at once (see [`Config::devices`]).
    pub fn devices(mut self, devices: usize) -> Config {
        self.devices = Some(devices);
        self
    }

    /// Whether programs compile concurrently (see [`Config::concurrent_compiles`]).
    pub fn concurrent_compiles(mut self, on: bool) -> Config {
        self.concurrent_compiles = on;
        self
    }

    /// The device count a handle made with [`Nitro::new`] uses: [`Config::devices`], else
    /// `NITRO_DEVICES`, else 1.
    pub fn device_count(&self) -> Result<usize> {
        match self.devices {
            Some(n) => Ok(n),
            None => Ok(crate::backend::pjrt::devices_setting()?.unwrap_or(1)),
        }
    }

    /// A learning-rate schedule (constant, step decay, warm-up, cosine, or your own).
    pub fn schedule(mut self, schedule: impl Schedule + 'static) -> Config {
        self.schedule = Some(Arc::new(schedule));
        self
    }
}

/// The programs of a handle, once compiled for a batch shape.
struct Programs {
    grad: Arc<Compiled>,
    update: Arc<Compiled>,
    /// Compiled on the first evaluation: a train-only run compiles two programs.
    eval: Option<Arc<Compiled>>,
    /// The batch leaf types they were compiled for.
    batch_types: Vec<crate::tree::LeafType>,
}

/// What the handle's lookup of one of its programs did, and what it spent: one entry per
/// program per [`Nitro::prepare`] (or first step, or first validation) that had to look it up.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ProgramTime {
    /// The program's role in the inventory: `grad` (or `grad_accumulate`), `update`, `eval`,
    /// or a device metric's name.
    pub role: String,
    /// The program's identity (experiment type and name).
    pub program: String,
    /// What the lookup did: a hit, a load from the store, or a compile (with the reason).
    pub outcome: Outcome,
    /// Tracing it (zero for a hit through a known route).
    pub trace: Duration,
    /// Compiling or loading it (zero for a hit). Contended by the other programs' compiles
    /// unless [`Config::concurrent_compiles`] is off.
    pub build: Duration,
}

impl ProgramTime {
    fn of(role: &str, served: &Served) -> ProgramTime {
        ProgramTime {
            role: role.to_owned(),
            program: served.compiled.program.clone(),
            outcome: served.outcome.clone(),
            trace: served.timing.trace,
            build: served.timing.build,
        }
    }
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

/// One epoch of [`Nitro::fit`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EpochRecord {
    /// The epoch, from 1.
    pub epoch: usize,
    /// The mean training loss over the epoch's real rows.
    pub train_loss: f64,
    /// The mean validation loss, when validated.
    pub val_loss: Option<f64>,
    /// The validation accuracy, when validated and the model has `correct`.
    pub val_accuracy: Option<f64>,
    /// The validation metrics registered on the handle, by name.
    pub metrics: Vec<(String, f64)>,
    /// Steps taken in the epoch (optimizer updates).
    pub steps: u64,
    /// The median time of one whole step — the batch uploaded, the gradient and the update run
    /// and finished — in microseconds, over a sample of the epoch's steps (up to 8, spread
    /// over it) each timed with nothing else in flight and waited for. What one step costs.
    pub step_us_median: f64,
    /// The epoch's training wall time (first batch enqueued to the last step finished and its
    /// losses read) divided by its batches (micro-batches with accumulation), in
    /// microseconds: steps as the handle runs them, enqueued while earlier ones run. What a
    /// step costs in throughput.
    pub step_us_pipelined: f64,
    /// Wall time of the epoch (training and validation), in seconds.
    pub seconds: f64,
}

/// What [`Nitro::fit`] returns: one record per epoch. Prints as a table.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct History {
    /// The epochs, in order.
    pub epochs: Vec<EpochRecord>,
}

impl std::fmt::Display for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "epoch  train loss  val loss  val acc   steps  seconds")?;
        let names: Vec<&str> = self
            .epochs
            .first()
            .map(|r| r.metrics.iter().map(|(n, _)| n.as_str()).collect())
            .unwrap_or_default();
        for n in &names {
            write!(f, "  {n:>10}")?;
        }
        writeln!(f)?;
        for r in &self.epochs {
            let opt = |v: Option<f64>, pct: bool| match v {
                Some(v) if pct => format!("{:>6.2}%", 100.0 * v),
                Some(v) => format!("{v:>8.4}"),
                None => format!("{:>8}", "-"),
            };
            write!(
                f,
                "{:>5}  {:>10.4}  {}  {}  {:>6}  {:>7.2}",
                r.epoch,
                r.train_loss,
                opt(r.val_loss, false),
                opt(r.val_accuracy, true),
                r.steps,
                r.seconds
            )?;
            for (_, v) in &r.metrics {
                write!(f, "  {v:>10.4}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// The training handle. See the [module docs](self).
pub struct Nitro<E: Model, O: Optimizer> {
    experiment: E,
    optimizer: O,
    config: Config,
    backend: &'static dyn Backend,
    cache: &'static Cache,
    /// How the trainable leaves are packed into `trainable` (one flat array per dtype).
    packing: Packing,
    /// The optimizer's leaf mask over `packing` (the update program's GraphConst).
    masks: MaskRuns,
    /// The trainable leaves' paths, in walk order (how checkpoints name their optimizer state).
    trainable_paths: Vec<String>,
    /// The trainable leaves, packed.
    trainable: Vec<Value>,
    /// The other Device leaves, in walk order.
    frozen: Vec<Value>,
    /// The optimizer state: slot by slot, one array per packed group.
    state: Vec<Value>,
    /// The step counter the update program keeps (`i64[]`).
    counter: Vec<Value>,
    /// The learning rate as placed, and for which value.
    lr_value: Option<(f64, Value)>,
    /// The all-ones mask of a full batch, placed once.
    full_mask: Option<Value>,
    /// Gradient accumulation: the window's gradient sums so far, how many micro-batches and
    /// real rows it has seen, and (placed once) zero sums and the factor 1.
    window: Window,
    /// Losses of steps taken with [`Nitro::step_deferred`], not read yet.
    pending_losses: Vec<Value>,
    /// The end of the last update enqueued on the device (XLA; one per replica), not waited
    /// for yet.
    in_flight: Vec<Completion>,
    /// Whether the experiment's trainable leaves are stale (the device holds newer values).
    host_stale: bool,
    step: u64,
    /// Epochs completed, and batches of the next epoch trained: where `fit` continues.
    epoch: u64,
    epoch_batches: u64,
    /// The random stream of a model that draws random numbers ([`Model::RANDOM`]).
    random: crate::checkpoint::RandomStream,
    programs: Option<Programs>,
    compile_time: Duration,
    /// Every program lookup that prepared the inventory, in order.
    program_times: Vec<ProgramTime>,
    /// When the handle was made, and how long after that the first step finished.
    created: Instant,
    first_step: Option<Duration>,
    /// The current epoch's timings: sampled waited steps, and its batches' wall time.
    timings: EpochTimings,
    /// Validation metrics accumulated on the device, each with a program of its own.
    device_metrics: Vec<DeviceMetricState<E>>,
    /// Validation metrics computed on the host from the evaluation outputs.
    host_metrics: Vec<Box<dyn HostMetric<E>>>,
    /// A cached stage's program, held outputs and counts (unused without one).
    stage: staged::StageState,
}

/// What an epoch measured of its steps.
#[derive(Default)]
struct EpochTimings {
    /// Steps that applied the optimizer, each timed from its enqueue to its end with nothing
    /// else in flight (a sample of the epoch's steps).
    waited: Vec<Duration>,
    /// From the first batch's enqueue to the end of the last step (losses read).
    wall: Duration,
    /// Batches (micro-batches with accumulation) the epoch trained.
    batches: usize,
}

/// How many steps of an epoch are timed waited (spread evenly over it).
const WAITED_SAMPLES: usize = 8;

/// The state of a gradient-accumulation window.
#[derive(Default)]
struct Window {
    sums: Option<Vec<Value>>,
    micro_batches: usize,
    rows: usize,
    zeros: Option<Vec<Value>>,
    one: Option<Value>,
}

impl<E: Model, O: Optimizer> std::fmt::Debug for Nitro<E, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nitro")
            .field("experiment", &E::TYPE_PATH)
            .field("optimizer", &self.optimizer)
            .field("config", &self.config)
            .field("backend", &self.backend.identity().description)
            .field("step", &self.step)
            .finish()
    }
}

impl<E: Model, O: Optimizer> Nitro<E, O> {
    /// A handle training `experiment` with `optimizer` on the current backend
    /// ([`crate::backend::current`]) through the process-wide cache, on the devices
    /// [`Config::device_count`] names ([`crate::backend::for_devices`]).
    pub fn new(experiment: E, optimizer: O, config: Config) -> Result<Nitro<E, O>> {
        let backend = crate::backend::for_devices(config.device_count()?)?;
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
        if !config.batch.is_multiple_of(replicas) {
            return Err(Error::Devices {
                what: "Config::devices".into(),
                requested: replicas,
                reason: format!(
                    "a batch of {} rows cannot be split evenly across {replicas} devices; make \
                     Config::batch a multiple of {replicas}",
                    config.batch
                ),
            });
        }
        let (packing, trainable_paths, trainable, frozen) = device_leaves(&experiment)?;
        let masks = mask_runs(&optimizer, &trainable_paths, &packing)?;
        let state = zero_state(&optimizer, &packing);
        let put = |v: Vec<Array>| -> Result<Vec<Value>> { place(backend, v) };
        let (trainable, frozen, state) = (put(trainable)?, put(frozen)?, put(state)?);
        let counter = put(vec![Array::scalar(0i64)])?;
        let random = crate::checkpoint::RandomStream::new(config.seed);
        Ok(Nitro {
            experiment,
            optimizer,
            config,
            backend,
            cache,
            packing,
            masks,
            trainable_paths,
            trainable,
            frozen,
            state,
            counter,
            lr_value: None,
            full_mask: None,
            window: Window::default(),
            pending_losses: Vec::new(),
            in_flight: Vec::new(),
            host_stale: false,
            step: 0,
            epoch: 0,
            epoch_batches: 0,
            random,
            programs: None,
            compile_time: Duration::ZERO,
            program_times: Vec::new(),
            created: Instant::now(),
            first_step: None,
            timings: EpochTimings::default(),
            device_metrics: Vec::new(),
            host_metrics: Vec::new(),
            stage: staged::StageState::default(),
        })
    }

    /// Registers a validation metric accumulated on the device ([`DeviceMetric`]): one more
    /// program, compiled by the first validation (by the first step of a `fit` with validation
    /// data).
    pub fn add_device_metric<M: DeviceMetric<E>>(&mut self) {
        self.device_metrics.push(DeviceMetricState {
            slot: Box::new(MetricOf::<M>(std::marker::PhantomData)),
            compiled: None,
        });
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
        self.step
    }

    /// The step count the update program keeps on the device: an `i64`, so it equals
    /// [`steps`](Nitro::steps) however long the run (Adam's bias correction reads it). Reading
    /// it waits for the steps taken so far.
    pub fn device_steps(&mut self) -> Result<u64> {
        self.wait()?;
        let counter = to_host(&self.counter)?;
        let value = counter
            .first()
            .ok_or_else(no_output)?
            .as_slice::<i64>()?
            .first()
            .copied()
            .ok_or_else(no_output)?;
        u64::try_from(value).map_err(|_| no_output())
    }

    /// How long after the handle was made its first step finished (programs compiled or
    /// loaded, and one step run); `None` before the first step.
    pub fn first_step_time(&self) -> Option<Duration> {
        self.first_step
    }

    /// Each program lookup that prepared the inventory — per program its role, what the lookup
    /// did, and its trace and compile (or load) time — in the order they were looked up.
    pub fn program_times(&self) -> &[ProgramTime] {
        &self.program_times
    }

    /// Time spent getting programs (tracing, loading, compiling), wall clock: the programs
    /// of one [`prepare`](Nitro::prepare) are got concurrently, so this is less than the sum of
    /// [`program_times`](Nitro::program_times).
    pub fn compile_time(&self) -> Duration {
        self.compile_time
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

    /// Epochs completed (by `fit`, `train_epoch`, or in the run a resumed checkpoint was taken
    /// in).
    pub fn epochs_done(&self) -> u64 {
        self.epoch
    }

    /// The learning rate the next step uses.
    pub fn lr(&self) -> f64 {
        match &self.config.schedule {
            Some(s) => s.lr(self.step),
            None => self.config.lr,
        }
    }

    /// Gets (or compiles) the training programs — gradient and update — for batches like
    /// `sample`, concurrently, and returns what each lookup did. Called by the first step; call
    /// it earlier to pay for compiles before training. The evaluation program is compiled by
    /// the first [`evaluate`](Nitro::evaluate) — or with these by [`fit`](Nitro::fit) when it
    /// is given validation data.
    pub fn prepare(&mut self, sample: &E::Batch) -> Result<Vec<Outcome>> {
        self.prepare_programs(sample, Inventory::Train)
    }

    /// Gets (or compiles) the programs `inventory` names for batches like `sample` — the
    /// training programs always — all at once: a `fit` with validation data waits for the
    /// slowest program of its whole inventory, not for the training programs and then, after
    /// the first epoch, for the evaluation programs.
    fn prepare_programs(
        &mut self,
        sample: &E::Batch,
        inventory: Inventory,
    ) -> Result<Vec<Outcome>> {
        let want_eval = inventory != Inventory::Train;
        let want_metrics = inventory == Inventory::Validate;
        // Every step comes here: the common case (programs held for these batch types) is
        // answered without allocating.
        let training_ready = self
            .programs
            .as_ref()
            .is_some_and(|p| has_types(sample, &p.batch_types));
        let evaluation_ready = training_ready
            && (!want_eval || self.programs.as_ref().is_some_and(|p| p.eval.is_some()))
            && (!want_metrics || self.device_metrics.iter().all(|m| m.compiled.is_some()));
        if training_ready && evaluation_ready {
            return Ok(Vec::new());
        }
        let rows = batch_rows(sample)?;
        if rows != self.config.batch {
            return Err(Error::InvalidSetting {
                variable: "batch",
                value: rows.to_string(),
                expected: format!("batches of {} rows (Config::batch)", self.config.batch),
            });
        }
        let batch_types = leaf_types(sample);
        // Tracing reads the experiment's leaf types only, which steps never change: no sync.
        let started = Instant::now();
        // Each replica's programs see its share of the rows.
        let sample = &Shaped::new(sample, self.backend.replicas())?;
        let mask = Array::zeros(DType::F32, &[rows / self.backend.replicas()]);
        let opt = self.optimizer_step_shape();
        let (backend, cache, experiment) = (self.backend, self.cache, &self.experiment);
        let update_inputs = update_inputs_shape(&opt);
        let accumulating = self.config.accum > 1;
        let key_sample: GradExtra = E::RANDOM.then(|| Array::zeros(DType::U32, &[2]));
        let sums: AccumExtra = (
            self.packing.zeros(),
            Array::scalar(1.0f32),
            key_sample.clone(),
        );
        let held_eval = match &self.programs {
            Some(p) if training_ready => p.eval.clone(),
            _ => None,
        };
        let metrics: Vec<(&dyn MetricSlot<E>, Option<Arc<Compiled>>)> = self
            .device_metrics
            .iter()
            .map(|m| {
                let held = if training_ready {
                    m.compiled.clone()
                } else {
                    None
                };
                (m.slot.as_ref(), held)
            })
            .collect();
        // Compile the inventory concurrently: the first step waits for the slowest program,
        // not their sum (one after another when the configuration says so).
        let concurrent = self.config.concurrent_compiles;
        let (training, eval, metrics) = std::thread::scope(|s| {
            let update = (!training_ready).then(|| {
                Task::start(s, concurrent, || {
                    cache.get(backend, &update_program::<O>(), &opt, &update_inputs)
                })
            });
            let eval = (want_eval && held_eval.is_none()).then(|| {
                Task::start(s, concurrent, || {
                    let inputs = BatchRef(sample, &mask, &());
                    cache.get(backend, &eval_program::<E>(), experiment, &inputs)
                })
            });
            let metric_threads: Vec<_> = metrics
                .iter()
                .map(|(slot, held)| {
                    (want_metrics && held.is_none()).then(|| {
                        Task::start(s, concurrent, || {
                            slot.get(cache, backend, experiment, sample, &mask)
                        })
                    })
                })
                .collect();
            let grad = (!training_ready).then(|| {
                if accumulating {
                    let inputs = BatchRef(sample, &mask, &sums);
                    cache.get(backend, &grad_accum_program::<E>(), experiment, &inputs)
                } else {
                    let inputs = BatchRef(sample, &mask, &key_sample);
                    cache.get(backend, &grad_program::<E>(), experiment, &inputs)
                }
            });
            let training = match (grad, update) {
                (Some(grad), Some(update)) => Some((grad, update.finish())),
                _ => None,
            };
            let metrics: Vec<Option<Result<Served>>> = metric_threads
                .into_iter()
                .map(|t| t.map(Task::finish))
                .collect();
            (training, eval.map(Task::finish), metrics)
        });
        let mut outcomes = Vec::new();
        if let Some((grad, update)) = training {
            let (grad, update): (Served, Served) = (grad?, update?);
            outcomes.extend([grad.outcome.clone(), update.outcome.clone()]);
            let role = if accumulating {
                "grad_accumulate"
            } else {
                "grad"
            };
            self.program_times.push(ProgramTime::of(role, &grad));
            self.program_times.push(ProgramTime::of("update", &update));
            for m in &mut self.device_metrics {
                m.compiled = None;
            }
            self.programs = Some(Programs {
                grad: grad.compiled,
                update: update.compiled,
                eval: None,
                batch_types,
            });
        }
        if let Some(eval) = eval {
            let eval = eval?;
            outcomes.push(eval.outcome.clone());
            self.program_times.push(ProgramTime::of("eval", &eval));
            if let Some(p) = &mut self.programs {
                p.eval = Some(eval.compiled);
            }
        }
        for (state, served) in self.device_metrics.iter_mut().zip(metrics) {
            if let Some(served) = served {
                let served = served?;
                outcomes.push(served.outcome.clone());
                self.program_times
                    .push(ProgramTime::of(state.slot.name(), &served));
                state.compiled = Some(served.compiled);
            }
        }
        self.compile_time += started.elapsed();
        Ok(outcomes)
    }

    /// Gets (or compiles) the evaluation program for batches like `sample`.
    fn prepare_eval(&mut self, sample: &E::Batch) -> Result<Arc<Compiled>> {
        self.prepare_programs(sample, Inventory::Evaluate)?;
        self.programs
            .as_ref()
            .and_then(|p| p.eval.clone())
            .ok_or_else(no_output)
    }

    /// The optimizer program's experiment, with arrays of the right types (values unused).
    fn optimizer_step_shape(&self) -> OptimizerStep<O> {
        let zeros = |values: &[Value]| -> Vec<Array> {
            values
                .iter()
                .map(|v| {
                    let t = v.leaf_type();
                    Array::zeros(t.dtype, &t.dims)
                })
                .collect()
        };
        OptimizerStep {
            optimizer: self.optimizer.clone(),
            params: zeros(&self.trainable),
            state: zeros(&self.state),
            masks: self.masks.clone(),
            steps: Array::scalar(0i64),
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
        let closes = self.window.micro_batches + 1 >= self.config.accum;
        self.micro_step(batch, real, closes, None)
    }

    /// One micro-batch; the optimizer runs when `closes` (always, without accumulation).
    /// `rows_of` maps the batch's rows to the data set's, for errors that name a row.
    fn micro_step(
        &mut self,
        batch: &E::Batch,
        real: usize,
        closes: bool,
        rows_of: Option<&[usize]>,
    ) -> Result<()> {
        self.prepare(batch)?;
        let rows = self.config.batch;
        check_real_rows(rows, real)?;
        if let Some(p) = &self.programs {
            let before = self.trainable.len() + self.frozen.len();
            check_class_inputs(&p.grad, before, batch, real, rows_of)?;
        }
        if self.full_mask.is_none() {
            self.full_mask = Some(place_rows(self.backend, mask_of(rows, rows)?)?);
        }
        let ragged = if real < rows {
            Some(place_rows(self.backend, mask_of(rows, real)?)?)
        } else {
            None
        };
        let accumulating = self.config.accum > 1;
        // The draw's key, one per replica (replica `r`'s is `fold_in(key, r)`), as rows.
        let keys = if E::RANDOM {
            Some(self.draw_keys()?)
        } else {
            None
        };
        let (Some(programs), Some(full)) = (&self.programs, &self.full_mask) else {
            return Err(no_output());
        };
        let mut args = batch_args(
            &self.trainable,
            &self.frozen,
            batch,
            In::Keep(ragged.as_ref().unwrap_or(full)),
        );
        let mut scale = None;
        if accumulating {
            if self.window.zeros.is_none() {
                let zeros = self.packing.zeros();
                self.window.zeros = Some(place(self.backend, zeros)?);
                self.window.one = Some(self.place_one(Array::scalar(1.0f32))?);
            }
            self.window.rows += real;
            if closes {
                let rows = self.window.rows.max(1) as f32;
                scale = Some(self.place_one(Array::scalar(1.0 / rows))?);
            }
            let (Some(zeros), Some(one)) = (&self.window.zeros, &self.window.one) else {
                return Err(no_output());
            };
            match self.window.sums.take() {
                Some(sums) => args.extend(sums.into_iter().map(In::Give)),
                None => args.extend(zeros.iter().map(In::Keep)),
            }
            args.push(In::Keep(scale.as_ref().unwrap_or(one)));
        }
        if let Some(keys) = &keys {
            args.push(In::Rows(keys));
        }
        let (out, _) = exec(&programs.grad, args)?;
        if E::RANDOM {
            self.random.draws += 1;
        }
        let mut out = out.into_iter();
        let loss = out.next().ok_or_else(no_output)?;
        let grads: Vec<Value> = out.collect();
        self.pending_losses.push(loss);
        self.host_stale = true;
        if !closes {
            self.window.micro_batches += 1;
            self.window.sums = Some(grads);
            return Ok(());
        }
        self.window.micro_batches = 0;
        self.window.rows = 0;
        self.update(grads)
    }

    /// Applies the optimizer to `grads` (the packed gradient of the step's mean loss).
    fn update(&mut self, grads: Vec<Value>) -> Result<()> {
        if let Some(schedule) = &self.config.schedule {
            self.config.lr = schedule.lr(self.step);
        }
        // The learning rate is placed when it changes, not per step.
        if self
            .lr_value
            .as_ref()
            .is_none_or(|(v, _)| *v != self.config.lr)
        {
            let lr = self.place_one(Array::scalar(self.config.lr as f32))?;
            self.lr_value = Some((self.config.lr, lr));
        }
        let (Some(programs), Some((_, lr))) = (&self.programs, &self.lr_value) else {
            return Err(no_output());
        };
        let n = self.trainable.len();
        let mut args: Vec<In<'_>> = Vec::with_capacity(2 * n + self.state.len() + 2);
        args.extend(
            std::mem::take(&mut self.trainable)
                .into_iter()
                .map(In::Give),
        );
        args.extend(std::mem::take(&mut self.state).into_iter().map(In::Give));
        args.extend(std::mem::take(&mut self.counter).into_iter().map(In::Give));
        args.extend(grads.iter().map(In::Keep));
        args.push(In::Keep(lr));
        let (mut new, done) = exec(&programs.update, args)?;
        self.counter = new.split_off(new.len().saturating_sub(1));
        self.state = new.split_off(n);
        self.trainable = new;
        // Only the last update matters: later runs wait for its outputs on the device.
        self.in_flight = done;
        self.step += 1;
        if self.first_step.is_none() {
            self.first_step = Some(self.created.elapsed());
        }
        Ok(())
    }

    /// The next draw's key for every replica, as `u32[2 · replicas]` rows: replica `r` gets
    /// `fold_in(key, r)` when there are several.
    fn draw_keys(&self) -> Result<Array> {
        let key = self.random.next_key();
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

    /// One array placed where the handle keeps values.
    fn place_one(&self, a: Array) -> Result<Value> {
        place(self.backend, vec![a])?.pop().ok_or_else(no_output)
    }

    /// The losses of the steps taken since the last call, in order (read from the device at
    /// once on XLA). With gradient accumulation, one per micro-batch.
    pub fn take_losses(&mut self) -> Result<Vec<f64>> {
        self.wait()?;
        let pending = std::mem::take(&mut self.pending_losses);
        pending.iter().map(Value::scalar).collect()
    }

    /// Evaluates `batch` (its first `real` rows) without training: summed loss and correct
    /// count over the real rows.
    pub fn evaluate(&mut self, batch: &E::Batch, real: usize) -> Result<EvalResult> {
        let (result, _) = self.run_eval(batch, real, false, None)?;
        Ok(result)
    }

    /// [`Model::predict`] for every row of `batch` (the evaluation program's forward pass:
    /// no program of its own). Rows past the real ones hold the padding's predictions. An
    /// error when the model does not predict.
    pub fn predict(&mut self, batch: &E::Batch) -> Result<Array> {
        let rows = batch_rows(batch)?;
        let (result, _) = self.run_eval(batch, rows, true, None)?;
        result.predictions.ok_or_else(|| Error::InvalidSetting {
            variable: "Model::predict",
            value: "None".into(),
            expected: format!(
                "a model that predicts: implement `Model::predict` for {}",
                E::TYPE_PATH
            ),
        })
    }

    /// Runs the evaluation program on `batch`; reads the predictions back when `predictions`
    /// asks. Also returns the mask it placed, for the device metrics. `rows_of` maps the
    /// batch's rows to the data set's, for errors that name a row.
    fn run_eval(
        &mut self,
        batch: &E::Batch,
        real: usize,
        predictions: bool,
        rows_of: Option<&[usize]>,
    ) -> Result<(EvalResult, Array)> {
        let eval = self.prepare_eval(batch)?;
        let mask = mask_of(self.config.batch, real)?;
        let before = self.trainable.len() + self.frozen.len();
        check_class_inputs(&eval, before, batch, real, rows_of)?;
        let args = batch_args(&self.trainable, &self.frozen, batch, In::Rows(&mask));
        let (out, _) = exec(&eval, args)?;
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

    /// One epoch over `data`: its rows shuffled with the configured seed (a fresh order per
    /// epoch, numbered from 0), in batches of the configured size, the last one padded and
    /// masked. Returns the mean loss over the rows it trained. The losses are read once, at the
    /// end of the epoch.
    ///
    /// When `epoch` is the epoch the handle is in the middle of (one a resumed checkpoint was
    /// taken in, or one an error interrupted), it continues after the batches already trained.
    /// Afterwards the handle counts `epoch + 1` epochs completed ([`Nitro::epochs_done`]).
    ///
    /// Errors: [`Error::EmptyData`] for a data set without rows; [`Error::InvalidSetting`] when
    /// [`Config::batch`] is larger than the data set; [`Error::LabelOutOfRange`] naming the data
    /// set's row when a batch holds a label outside the classes of the loss reading it.
    pub fn train_epoch(&mut self, data: &Dataset, epoch: u64) -> Result<f64>
    where
        E::Batch: FromBatch,
    {
        self.check_training_data(data)?;
        let plan = data.plan(
            self.config.batch,
            Order::Shuffled {
                seed: self.config.seed,
            },
        )?;
        let skip = if epoch == self.epoch {
            usize::try_from(self.epoch_batches).unwrap_or(usize::MAX)
        } else {
            0
        };
        if epoch != self.epoch {
            self.epoch = epoch;
            self.epoch_batches = 0;
        }
        let number = epoch + 1;
        let order = plan.epoch(epoch);
        let count = order.len();
        let mut rows = Vec::with_capacity(count);
        self.timings = EpochTimings::default();
        let every = count.div_ceil(WAITED_SAMPLES).max(1);
        let bar = progress_bar(self.config.progress, count as u64, number);
        bar.inc(skip.min(count) as u64);
        let started = Instant::now();
        for (i, span) in order.spans().enumerate().skip(skip) {
            let batch = data.gather(span, self.config.batch)?;
            let real = batch.real_rows();
            let batch = E::Batch::from_batch(batch)?;
            // An epoch's last batch closes an accumulation window, full or not.
            let closes = self.window.micro_batches + 1 >= self.config.accum || i + 1 == count;
            // A few steps are timed alone: nothing in flight before, waited for after.
            let timed = closes && i % every == every / 2;
            if timed {
                self.wait()?;
            }
            let step_started = Instant::now();
            self.micro_step(&batch, real, closes, Some(span))?;
            if timed {
                self.wait()?;
                self.timings.waited.push(step_started.elapsed());
            }
            self.epoch_batches += 1;
            rows.push(real);
            bar.inc(1);
        }
        let losses = self.take_losses()?;
        self.timings.wall = started.elapsed();
        self.timings.batches = rows.len();
        bar.finish_and_clear();
        self.epoch = epoch + 1;
        self.epoch_batches = 0;
        let total: usize = rows.iter().sum();
        let sum: f64 = losses.iter().zip(&rows).map(|(l, &r)| l * r as f64).sum();
        Ok(if total == 0 { 0.0 } else { sum / total as f64 })
    }

    /// Refuses training data without rows, or fewer rows than one batch.
    fn check_training_data(&self, data: &Dataset) -> Result<()> {
        if data.rows() == 0 {
            return Err(Error::EmptyData {
                which: "the training data".into(),
            });
        }
        if self.config.batch > data.rows() {
            return Err(Error::InvalidSetting {
                variable: "Config::batch",
                value: self.config.batch.to_string(),
                expected: format!(
                    "at most the training data's {} rows: every step would pad its batch to {} \
                     rows, mostly copies; use a smaller batch",
                    data.rows(),
                    self.config.batch
                ),
            });
        }
        Ok(())
    }

    /// Evaluates every row of `data` once, in order: summed loss and correct count.
    ///
    /// Errors: [`Error::EmptyData`] for a data set without rows; [`Error::LabelOutOfRange`]
    /// naming the data set's row when a batch holds a label outside the classes of the loss
    /// (or `correct`) reading it.
    pub fn validate(&mut self, data: &Dataset) -> Result<EvalResult>
    where
        E::Batch: FromBatch,
    {
        if data.rows() == 0 {
            return Err(Error::EmptyData {
                which: "the validation data".into(),
            });
        }
        let plan = data.plan(self.config.batch, Order::Sequential)?;
        let epoch = plan.epoch(0);
        let mut total = EvalResult::default();
        let mut sums: Vec<Option<Value>> = Vec::new();
        for _ in &self.device_metrics {
            sums.push(Some(self.place_one(Array::scalar(0.0f32))?));
        }
        let want_predictions = !self.host_metrics.is_empty();
        for span in epoch.spans() {
            let batch = data.gather(span, self.config.batch)?;
            let real = batch.real_rows();
            let batch = E::Batch::from_batch(batch)?;
            let (r, mask) = self.run_eval(&batch, real, want_predictions, Some(span))?;
            for (i, sum) in sums.iter_mut().enumerate() {
                let compiled = self.metric_program(i, &batch)?;
                let mut args = batch_args(&self.trainable, &self.frozen, &batch, In::Rows(&mask));
                args.push(In::Give(sum.take().ok_or_else(no_output)?));
                let (out, _) = exec(&compiled, args)?;
                *sum = out.into_iter().next();
            }
            for m in &mut self.host_metrics {
                m.update(&batch, &r);
            }
            total.loss_sum += r.loss_sum;
            total.correct += r.correct;
            total.rows += r.rows;
        }
        let rows = total.rows.max(1) as f64;
        for (state, sum) in self.device_metrics.iter().zip(&sums) {
            let value = sum.as_ref().ok_or_else(no_output)?.scalar()?;
            total
                .metrics
                .push((state.slot.name().to_owned(), value / rows));
        }
        for m in &mut self.host_metrics {
            total.metrics.push((m.name().to_owned(), m.finish()));
        }
        Ok(total)
    }

    /// Device metric `i`'s program for batches like `sample`, compiled (with every other
    /// device metric's) by the first use.
    fn metric_program(&mut self, i: usize, sample: &E::Batch) -> Result<Arc<Compiled>> {
        self.prepare_programs(sample, Inventory::Validate)?;
        self.device_metrics[i]
            .compiled
            .clone()
            .ok_or_else(no_output)
    }

    /// Trains on `train` until the handle has completed [`Config::epochs`] epochs, validating
    /// on `validation` after each epoch when given. A train-only run compiles two programs,
    /// validation a third (and one per device metric), all concurrently before the first step;
    /// nothing after compiles.
    ///
    /// It **continues** the run: a new handle starts at epoch 1; a handle resumed from a
    /// checkpoint starts where the checkpoint was taken (the same epoch numbers, so the same
    /// shuffles, and — mid-epoch — after the batches already trained), and the history numbers
    /// its epochs from there. So `fit` with `epochs(10)`, or `fit` with `epochs(4)`, a
    /// checkpoint, a resume and `fit` with `epochs(10)`, train the same parameters.
    ///
    /// Errors: [`Error::InvalidSetting`] when the handle has completed `Config::epochs` epochs
    /// already (raise it with [`Nitro::set_epochs`] to train on); [`Error::EmptyData`] for a
    /// data set without rows; those of [`train_epoch`](Nitro::train_epoch) and
    /// [`validate`](Nitro::validate).
    pub fn fit(&mut self, train: &Dataset, validation: Option<&Dataset>) -> Result<History>
    where
        E::Batch: FromBatch,
    {
        self.fit_with(train, validation, |_, data| Ok(EpochData::Given(data)))
    }

    /// [`fit`](Nitro::fit) with `each_epoch` giving, before every epoch, the data the epoch
    /// trains and validates on (a cached stage's columns added, for one), timed with it.
    fn fit_with(
        &mut self,
        train: &Dataset,
        validation: Option<&Dataset>,
        mut each_epoch: impl for<'d> FnMut(&mut Self, &'d Dataset) -> Result<EpochData<'d>>,
    ) -> Result<History>
    where
        E::Batch: FromBatch,
    {
        self.check_training_data(train)?;
        if validation.is_some_and(|v| v.rows() == 0) {
            return Err(Error::EmptyData {
                which: "the validation data".into(),
            });
        }
        let target = self.config.epochs as u64;
        if self.epoch >= target {
            return Err(Error::InvalidSetting {
                variable: "Config::epochs",
                value: self.config.epochs.to_string(),
                expected: format!(
                    "more than the {} epochs this handle has completed: `fit` continues a run up \
                     to Config::epochs epochs; raise it with `Nitro::set_epochs` to train on",
                    self.epoch
                ),
            });
        }
        let mut history = History::default();
        let first = self.epoch;
        for epoch in first..target {
            let started = Instant::now();
            let steps_before = self.step;
            let train = each_epoch(self, train)?;
            let validation = match validation {
                Some(v) => Some(each_epoch(self, v)?),
                None => None,
            };
            let validation = validation.as_deref();
            if epoch == first {
                // The whole inventory at once, the evaluation programs with the training ones.
                let plan = train.plan(self.config.batch, Order::Sequential)?;
                if let Some(first) = plan.epoch(0).batches(&train).next() {
                    let first = E::Batch::from_batch(first?)?;
                    let inventory = match validation {
                        Some(_) => Inventory::Validate,
                        None => Inventory::Train,
                    };
                    self.prepare_programs(&first, inventory)?;
                }
            }
            let train_loss = self.train_epoch(&train, epoch)?;
            let mut metrics = Vec::new();
            let (val_loss, val_accuracy) = match validation {
                Some(v) => {
                    let r = self.validate(v)?;
                    metrics = r.metrics.clone();
                    let rows = r.rows.max(1) as f64;
                    let has_accuracy = self.programs.as_ref().is_some_and(|p| {
                        p.eval
                            .as_ref()
                            .is_some_and(|e| e.outputs.get(1).is_some_and(|t| t.dims.is_empty()))
                    });
                    (
                        Some(r.loss_sum / rows),
                        has_accuracy.then_some(r.correct / rows),
                    )
                }
                None => (None, None),
            };
            let mut waited: Vec<f64> = self
                .timings
                .waited
                .iter()
                .map(|d| d.as_secs_f64() * 1e6)
                .collect();
            waited.sort_by(f64::total_cmp);
            let batches = self.timings.batches.max(1) as f64;
            let record = EpochRecord {
                epoch: usize::try_from(epoch + 1).unwrap_or(usize::MAX),
                train_loss,
                val_loss,
                val_accuracy,
                metrics,
                steps: self.step - steps_before,
                step_us_median: waited.get(waited.len() / 2).copied().unwrap_or(0.0),
                step_us_pipelined: self.timings.wall.as_secs_f64() * 1e6 / batches,
                seconds: started.elapsed().as_secs_f64(),
            };
            tracing::info!(
                epoch = record.epoch,
                train_loss = record.train_loss,
                val_loss = ?record.val_loss,
                val_accuracy = ?record.val_accuracy,
                "nitro: epoch"
            );
            history.epochs.push(record);
        }
        Ok(history)
    }

    /// A checkpoint of the experiment's Device leaves (the trained ones as of the last step),
    /// the optimizer state (named `<slot>/<leaf path>`: `m/layers[0].w`), the optimizer's
    /// identity, the step count, the position in the data (epochs completed, batches of the
    /// next), and an open gradient-accumulation window (its sums and counts), so that a resume
    /// continues exactly; write it with [`Checkpoint::save`].
    pub fn checkpoint(&mut self) -> Result<Checkpoint> {
        self.sync()?;
        // The state is kept packed, slot by slot; a checkpoint holds it leaf by leaf.
        let packed = to_host(&self.state)?;
        let groups = self.packing.groups.len();
        let mut state = Vec::new();
        for slot in packed.chunks(groups.max(1)) {
            state.extend(self.packing.unpack(slot)?);
        }
        let paths = &self.trainable_paths;
        let names: Vec<String> = self
            .optimizer
            .slots()
            .iter()
            .flat_map(|slot| paths.iter().map(move |p| format!("{slot}/{p}")))
            .collect();
        let named: Vec<(&str, &Array)> = names.iter().map(String::as_str).zip(&state).collect();
        let mut checkpoint = Checkpoint::capture(&self.experiment, &named, self.step)?
            .with_optimizer(&self.optimizer)
            .with_position(self.epoch, self.epoch_batches);
        if E::RANDOM {
            checkpoint = checkpoint.with_random(self.random);
        }
        if let Some(sums) = &self.window.sums {
            let sums = self.packing.unpack(&to_host(sums)?)?;
            checkpoint = checkpoint.with_window(crate::checkpoint::AccumulationWindow {
                micro_batches: self.window.micro_batches,
                rows: self.window.rows,
                sums: paths.iter().cloned().zip(sums).collect(),
            })?;
        }
        Ok(checkpoint)
    }

    /// A handle that continues from `checkpoint`: its Device leaves, optimizer state, step
    /// count, position in the data and accumulation window, each restored by name. Refused,
    /// naming what differs, when the experiment's type, GraphConsts or Device structure are not
    /// the checkpoint's ([`Error::CheckpointExperiment`], [`Error::CheckpointGraphConst`],
    /// [`Error::CheckpointDevice`]), or the optimizer is not the one it was taken with — its
    /// name, constants (unless [`Checkpoint::allow_retuned_optimizer`]) or slots — or its
    /// state does not fit the trainable leaves ([`Error::CheckpointOptimizer`]).
    pub fn resume(
        experiment: E,
        optimizer: O,
        config: Config,
        checkpoint: Checkpoint,
    ) -> Result<Nitro<E, O>> {
        let backend = crate::backend::for_devices(config.device_count()?)?;
        Nitro::resume_with(
            experiment,
            optimizer,
            config,
            checkpoint,
            backend,
            crate::cache::global(),
        )
    }

    /// [`resume`](Nitro::resume) on an explicit backend and cache.
    pub fn resume_with(
        mut experiment: E,
        optimizer: O,
        config: Config,
        checkpoint: Checkpoint,
        backend: &'static dyn Backend,
        cache: &'static Cache,
    ) -> Result<Nitro<E, O>> {
        let allow_retuned = checkpoint.allows_retuned_optimizer();
        check_optimizer(checkpoint.optimizer_identity(), &optimizer, allow_retuned)?;
        let restored = checkpoint.restore_into(&mut experiment)?;
        let mut handle = Nitro::with_backend(experiment, optimizer, config, backend, cache)?;
        let current = crate::checkpoint::OptimizerIdentity::of(&handle.optimizer);
        let refuse = |why: String| Error::CheckpointOptimizer {
            stored: restored
                .optimizer_identity
                .as_ref()
                .map_or_else(|| "unrecorded".to_owned(), |i| i.constants.clone()),
            current: current.constants.clone(),
            why,
            retunable: false,
        };
        let types: Vec<LeafType> = handle
            .packing
            .leaves
            .iter()
            .map(|(g, _, dims)| LeafType {
                dtype: handle.packing.groups[*g].0,
                dims: dims.clone(),
            })
            .collect();
        let mut by_name: std::collections::HashMap<String, Array> =
            restored.optimizer.into_iter().collect();
        let mut packed = Vec::new();
        for slot in handle.optimizer.slots() {
            let mut leaves = Vec::with_capacity(types.len());
            for (path, ty) in handle.trainable_paths.iter().zip(&types) {
                let name = format!("{slot}/{path}");
                let array = by_name.remove(&name).ok_or_else(|| {
                    refuse(format!(
                        "the checkpoint holds no optimizer state `{name}` for trainable leaf \
                         `{path}`"
                    ))
                })?;
                if &array.leaf_type() != ty {
                    return Err(refuse(format!(
                        "optimizer state `{name}` is {} in the checkpoint, and trainable leaf \
                         `{path}` is {ty}",
                        array.leaf_type()
                    )));
                }
                leaves.push(array);
            }
            packed.extend(handle.packing.pack(&leaves)?);
        }
        if let Some(extra) = by_name.keys().min() {
            return Err(refuse(format!(
                "the checkpoint holds optimizer state `{extra}`, which no slot of this \
                 optimizer and no trainable leaf names"
            )));
        }
        handle.state = place(backend, packed)?;
        let step = i64::try_from(restored.step).map_err(|_| Error::CheckpointCorrupt {
            origin: "the checkpoint".into(),
            why: format!(
                "its step {} is over the largest step nitro counts, {}",
                restored.step,
                crate::checkpoint::MAX_STEP
            ),
        })?;
        handle.counter = place(backend, vec![Array::scalar(step)])?;
        handle.step = restored.step;
        handle.epoch = restored.epoch;
        handle.epoch_batches = restored.epoch_batches;
        if let Some(r) = restored.random {
            handle.random = r;
        }
        if let Some(w) = restored.window {
            if handle.config.accum <= 1 || w.micro_batches >= handle.config.accum {
                return Err(Error::InvalidSetting {
                    variable: "Config::accum",
                    value: handle.config.accum.to_string(),
                    expected: format!(
                        "more than the {} micro-batches of the accumulation window the \
                         checkpoint was taken in: resume it with the accumulation it was \
                         trained with",
                        w.micro_batches
                    ),
                });
            }
            let mut sums: std::collections::HashMap<String, Array> = w.sums.into_iter().collect();
            let mut leaves = Vec::with_capacity(types.len());
            for (path, ty) in handle.trainable_paths.iter().zip(&types) {
                let sum = sums
                    .remove(path)
                    .filter(|a| &a.leaf_type() == ty)
                    .ok_or_else(|| Error::CheckpointCorrupt {
                        origin: "the checkpoint".into(),
                        why: format!(
                            "its accumulation window has no gradient sum of {ty} for `{path}`"
                        ),
                    })?;
                leaves.push(sum);
            }
            handle.window.sums = Some(place(backend, handle.packing.pack(&leaves)?)?);
            handle.window.micro_batches = w.micro_batches;
            handle.window.rows = w.rows;
        }
        Ok(handle)
    }

    /// Changes the experiment — a GraphConst, a Device value — through the handle, the only
    /// way to change it while it trains. The experiment is synced from the device first; after
    /// `change`, its Device leaves are placed again and the programs are looked up again at the
    /// next step, so a changed GraphConst recompiles exactly the programs whose key it is in,
    /// and changed Device values recompile nothing. The optimizer state is kept when the
    /// trainable leaves keep their types, and restarts from zero otherwise.
    pub fn modify(&mut self, change: impl FnOnce(&mut E)) -> Result<()> {
        self.sync()?;
        change(&mut self.experiment);
        let (packing, trainable_paths, trainable, frozen) = device_leaves(&self.experiment)?;
        self.masks = mask_runs(&self.optimizer, &trainable_paths, &packing)?;
        self.trainable_paths = trainable_paths;
        if packing != self.packing {
            self.state = place(self.backend, zero_state(&self.optimizer, &packing))?;
        }
        self.packing = packing;
        self.trainable = place(self.backend, trainable)?;
        self.frozen = place(self.backend, frozen)?;
        self.programs = None;
        // Frozen fields or GraphConsts may have changed: the stage is traced and its frozen
        // state digested again (held outputs stay valid: their keys say what they were).
        self.stage.forget_program();
        Ok(())
    }

    /// Copies the trainable leaves back into the experiment (from the device on XLA).
    pub fn sync(&mut self) -> Result<()> {
        self.wait()?;
        if !self.host_stale {
            return Ok(());
        }
        let values = self.packing.unpack(&to_host(&self.trainable)?)?;
        let mut it = values.into_iter();
        self.experiment.visit_device_mut(&mut |field, _, leaf| {
            if field.role == (Role::Device { trainable: true }) {
                if let Some(v) = it.next() {
                    *leaf = v;
                }
            }
        });
        self.host_stale = false;
        Ok(())
    }

    /// Waits until every step taken so far has finished on the device (on XLA, steps are
    /// enqueued and the host does not wait for them); the error of a step that failed on the
    /// device surfaces here. Reading losses, parameters or a checkpoint waits by itself; call
    /// this to time steps, or before measuring anything else.
    pub fn wait(&mut self) -> Result<()> {
        for done in std::mem::take(&mut self.in_flight) {
            done.wait()?;
        }
        Ok(())
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

    /// How many devices the handle trains on (one replica of every program on each).
    pub fn devices(&self) -> usize {
        self.backend.replicas()
    }

    /// The trainable leaves as every replica holds them, one list per device (after waiting
    /// for the steps taken so far). Replicas run the same update on the same reduced
    /// gradients, so the lists are equal — on the interpreter bit for bit; this is how to
    /// check it.
    pub fn replica_params(&mut self) -> Result<Vec<Vec<Array>>> {
        self.wait()?;
        let mut per_replica: Vec<Vec<Array>> = Vec::new();
        for value in &self.trainable {
            for (r, a) in value.replicas_to_host()?.into_iter().enumerate() {
                if per_replica.len() <= r {
                    per_replica.push(Vec::new());
                }
                per_replica[r].push(a);
            }
        }
        per_replica
            .iter()
            .map(|packed| self.packing.unpack(packed))
            .collect()
    }

    /// The number of arrays the trainable leaves and the optimizer state are kept in between
    /// steps: the trainable leaves are packed into one flat array per dtype, and each optimizer
    /// slot keeps one array per such group.
    pub fn state_len(&self) -> (usize, usize) {
        (self.trainable.len(), self.state.len())
    }
}

/// A batch's structure with every leaf's first dim cut to one replica's share of the rows:
/// what a replicated program is traced on (zero-filled stand-ins; tracing reads only types).
struct Shaped<'a, B> {
    batch: &'a B,
    leaves: Vec<Array>,
}

impl<'a, B: Tree> Shaped<'a, B> {
    /// `batch` shaped for `replicas` replicas (itself for one).
    fn new(batch: &'a B, replicas: usize) -> Result<Shaped<'a, B>> {
        let mut leaves = Vec::new();
        let mut bad = None;
        batch.for_each_leaf("", &mut |path, a| {
            let mut dims = a.dims().to_vec();
            match dims.first_mut() {
                Some(rows) if *rows % replicas == 0 => *rows /= replicas,
                _ => {
                    bad.get_or_insert_with(|| format!("`{path}` ({})", a.leaf_type()));
                }
            }
            leaves.push(Array::zeros(a.dtype(), &dims));
        });
        if let Some(leaf) = bad {
            return Err(Error::Devices {
                what: "a batch split across devices".into(),
                requested: replicas,
                reason: format!(
                    "its leaf {leaf} has no first dim of rows divisible by {replicas}; make \
                     Config::batch a multiple of the device count"
                ),
            });
        }
        Ok(Shaped { batch, leaves })
    }
}

impl<B: Tree> Tree for Shaped<'_, B> {
    type Mirror<L> = B::Mirror<L>;

    fn visit<'a>(
        &'a self,
        at: &mut crate::tree::LeafPath,
        f: &mut dyn FnMut(&crate::tree::LeafPath, Node<'a>),
    ) {
        let mut leaves = self.leaves.iter();
        self.batch.visit(at, &mut |path, node| match node {
            Node::Leaf(leaf) => f(path, Node::Leaf(leaves.next().unwrap_or(leaf))),
            node => f(path, node),
        });
    }

    fn visit_mut(
        &mut self,
        _: &mut crate::tree::LeafPath,
        _: &mut dyn FnMut(&crate::tree::LeafPath, &mut Array),
    ) {
        // Stand-ins for tracing: never written.
    }

    fn mirror<L>(
        &self,
        at: &mut crate::tree::LeafPath,
        f: &mut dyn FnMut(&crate::tree::LeafPath, &Array) -> L,
    ) -> Self::Mirror<L> {
        let mut leaves = self.leaves.iter();
        self.batch
            .mirror(at, &mut |path, leaf| match leaves.next() {
                Some(local) => f(path, local),
                None => f(path, leaf),
            })
    }
}

/// A batch, its mask and the program's other inputs as one input tree, borrowed.
struct BatchRef<'a, B, X>(&'a B, &'a Array, &'a X);

impl<B: Tree, X: Tree> Tree for BatchRef<'_, B, X> {
    type Mirror<L> = (B::Mirror<L>, L, X::Mirror<L>);

    fn visit<'a>(
        &'a self,
        at: &mut crate::tree::LeafPath,
        f: &mut dyn FnMut(&crate::tree::LeafPath, Node<'a>),
    ) {
        at.with_field("0", |at| self.0.visit(at, f));
        at.with_field("1", |at| self.1.visit(at, f));
        at.with_field("2", |at| self.2.visit(at, f));
    }

    fn visit_mut(
        &mut self,
        _: &mut crate::tree::LeafPath,
        _: &mut dyn FnMut(&crate::tree::LeafPath, &mut Array),
    ) {
        // A borrowed batch is read-only; the handle never writes into it.
    }

    fn mirror<L>(
        &self,
        at: &mut crate::tree::LeafPath,
        f: &mut dyn FnMut(&crate::tree::LeafPath, &Array) -> L,
    ) -> Self::Mirror<L> {
        (
            at.with_field("0", |at| self.0.mirror(at, f)),
            at.with_field("1", |at| self.1.mirror(at, f)),
            at.with_field("2", |at| self.2.mirror(at, f)),
        )
    }
}

/// The update program's inputs with the types of `opt`'s leaves (values unused).
fn update_inputs_shape<O: Optimizer>(opt: &OptimizerStep<O>) -> (Vec<Array>, Array) {
    (
        opt.params
            .iter()
            .map(|a| Array::zeros(a.dtype(), a.dims()))
            .collect(),
        Array::scalar(0.0f32),
    )
}

/// What a handle keeps of an experiment's Device leaves.
type DeviceLeaves = (Packing, Vec<String>, Vec<Array>, Vec<Array>);

/// The packing of `experiment`'s trainable leaves, their paths, the packed trainable leaves,
/// and copies of the other Device leaves, in walk order.
fn device_leaves<E: Experiment>(experiment: &E) -> Result<DeviceLeaves> {
    let (mut trainable, mut paths, mut frozen) = (Vec::new(), Vec::new(), Vec::new());
    experiment.visit_device(&mut |field, path, node| {
        if let Node::Leaf(a) = node {
            if field.role == (Role::Device { trainable: true }) {
                trainable.push(a.clone());
                paths.push(path.as_str().to_owned());
            } else {
                frozen.push(a.clone());
            }
        }
    });
    let packing = Packing::of(experiment);
    let packed = packing.pack(&trainable)?;
    Ok((packing, paths, packed, frozen))
}

/// Refuses to resume state kept by another optimizer than `optimizer`: another name or other
/// slots always, other constants unless `allow_retuned`.
fn check_optimizer<O: Optimizer>(
    stored: Option<&crate::checkpoint::OptimizerIdentity>,
    optimizer: &O,
    allow_retuned: bool,
) -> Result<()> {
    let current = crate::checkpoint::OptimizerIdentity::of(optimizer);
    let Some(stored) = stored else {
        if optimizer.slots().is_empty() {
            return Ok(());
        }
        return Err(Error::CheckpointOptimizer {
            stored: "unrecorded".into(),
            current: current.constants,
            why: "the checkpoint does not say which optimizer kept its state (it was made \
                  with `Checkpoint::capture`, not `Nitro::checkpoint`; record it with \
                  `Checkpoint::with_optimizer`)"
                .into(),
            retunable: false,
        });
    };
    let why = if stored.name != current.name {
        format!(
            "it was taken with optimizer `{}`, and this handle's is `{}`",
            stored.name, current.name
        )
    } else if stored.slots != current.slots {
        format!(
            "its optimizer keeps the slots {:?}, and this handle's keeps {:?}",
            stored.slots, current.slots
        )
    } else if stored.digest != current.digest && !allow_retuned {
        return Err(Error::CheckpointOptimizer {
            stored: stored.constants.clone(),
            current: current.constants,
            why: "the optimizer's constants differ".into(),
            retunable: true,
        });
    } else {
        return Ok(());
    };
    Err(Error::CheckpointOptimizer {
        stored: stored.constants.clone(),
        current: current.constants,
        why,
        retunable: false,
    })
}

/// Zeroed optimizer state for the packed trainable leaves: each slot, one array per group.
fn zero_state<O: Optimizer>(optimizer: &O, packing: &Packing) -> Vec<Array> {
    (0..optimizer.slots().len())
        .flat_map(|_| packing.zeros())
        .collect()
}

/// A progress bar for one epoch of `steps` steps on stderr: hidden unless `on` and stderr is a
/// terminal (so logs and pipes never receive one).
fn progress_bar(on: bool, steps: u64, epoch: u64) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !on || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(steps);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "epoch {prefix:>3} [{bar:30}] {pos}/{len} steps · {per_sec} · {elapsed}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(epoch.to_string());
    bar
}

/// A program lookup started by [`Nitro::prepare`]: on a thread of its own, or done already.
enum Task<'s, T> {
    Running(std::thread::ScopedJoinHandle<'s, Result<T>>),
    Done(Result<T>),
}

impl<'s, T: Send + 's> Task<'s, T> {
    /// Runs `f` on a thread of scope `s` when `concurrent`, else now.
    fn start<'e>(
        s: &'s std::thread::Scope<'s, 'e>,
        concurrent: bool,
        f: impl FnOnce() -> Result<T> + Send + 's,
    ) -> Task<'s, T> {
        if concurrent {
            Task::Running(s.spawn(f))
        } else {
            Task::Done(f())
        }
    }

    fn finish(self) -> Result<T> {
        match self {
            Task::Running(h) => join(h),
            Task::Done(r) => r,
        }
    }
}

fn join<T>(h: std::thread::ScopedJoinHandle<'_, Result<T>>) -> Result<T> {
    h.join().unwrap_or_else(|_| {
        Err(Error::Misconfigured {
            message: "a compiling thread panicked".into(),
        })
    })
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

/// The arguments of a per-batch program: the packed trainable leaves, the other Device leaves,
/// the batch's leaves and its mask (the caller appends what else the program takes).
fn batch_args<'a, B: Tree>(
    trainable: &'a [Value],
    frozen: &'a [Value],
    batch: &'a B,
    mask: In<'a>,
) -> Vec<In<'a>> {
    let mut args: Vec<In<'a>> = trainable.iter().chain(frozen).map(In::Keep).collect();
    args.extend(leaves(batch).into_iter().map(In::Rows));
    args.push(mask);
    args
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
                column: path.strip_prefix("0.").unwrap_or(path).to_owned(),
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

/// The data an epoch of [`Nitro::fit_with`] runs on: the data set given, or one made for the
/// epoch and shared (a cached stage's memo of its data set with the stage's column).
pub(crate) enum EpochData<'d> {
    Given(&'d Dataset),
    Shared(std::sync::Arc<Dataset>),
}

impl std::ops::Deref for EpochData<'_> {
    type Target = Dataset;

    fn deref(&self) -> &Dataset {
        match self {
            EpochData::Given(d) => d,
            EpochData::Shared(d) => d,
        }
    }
}
