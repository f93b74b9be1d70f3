//! The program inventory of a handle: the programs it derives from a [`Model`] and its
//! optimizer (traced from the `fn`s here), and the [`Inventory`] of those it holds, with what
//! each lookup did and spent ([`ProgramTime`]). How they are got is in `prepare.rs`.

use super::*;
use crate::cache::Probe;
use crate::hash::Digest;

/// The inputs of the per-batch programs: the batch, its row mask, and what else the program
/// takes (`()` for none).
pub(super) type BatchInputs<E, X> = (
    <<E as Model>::Batch as Tree>::Mirror<Tensor>,
    Tensor,
    <X as Tree>::Mirror<Tensor>,
);

/// What the gradient program takes besides the batch: the step's random key, when the model
/// draws random numbers ([`Model::RANDOM`]).
pub(super) type GradExtra = Option<Array>;

/// What the gradient program of a handle with dynamic loss scaling takes besides the batch,
/// named as program inputs (`key`, `loss_scale`).
#[derive(crate::Tree, Clone, Debug)]
pub(super) struct ScaledExtra {
    /// The step's random key (as [`GradExtra`]).
    pub(super) key: Option<Array>,
    /// The loss scale (`f32[]`): the loss is differentiated times it, the gradients divided
    /// by it.
    pub(super) loss_scale: Array,
}

impl ExtraInputs for ScaledExtra {
    const NAME: Option<&'static str> = None;
}

/// What the accumulating gradient program takes besides the batch, named as program inputs
/// (`sums[0]`, `scale`, `key`).
#[derive(crate::Tree, Clone, Debug)]
pub(super) struct AccumExtra {
    /// The gradient sums so far (packed).
    pub(super) sums: Vec<Array>,
    /// The factor to multiply the new sums by (1 except when a window closes).
    pub(super) scale: Array,
    /// The step's random key (as [`GradExtra`]).
    pub(super) key: Option<Array>,
    /// With dynamic loss scaling, the loss scale (as [`ScaledExtra`]'s): each micro-batch's
    /// gradient is unscaled before it is added to the sums.
    pub(super) loss_scale: Option<Array>,
}

/// The name a per-batch program's extra input is visited under, beside `batch` and `mask`:
/// `None` for a tree whose own fields name its leaves (or that has none).
pub(super) trait ExtraInputs: Tree {
    /// The name, if the tree has no names of its own.
    const NAME: Option<&'static str>;
}

impl ExtraInputs for GradExtra {
    const NAME: Option<&'static str> = Some("key");
}

impl ExtraInputs for AccumExtra {
    const NAME: Option<&'static str> = None;
}

impl ExtraInputs for () {
    const NAME: Option<&'static str> = None;
}

/// A device metric's running sum.
impl ExtraInputs for Array {
    const NAME: Option<&'static str> = Some("sum");
}

/// The model's loss, traced with the step's key (or its absence) in force.
pub(super) fn keyed_loss<E: Model>(
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
pub(super) fn grad_fn<E: Model>(
    v: &E::View<'_>,
    inputs: &BatchInputs<E, GradExtra>,
) -> Vec<Tensor> {
    let (batch, mask, key) = inputs;
    mean_and_gradients::<E>(v, batch, *mask, *key, None)
}

/// [`grad_fn`] with dynamic loss scaling: the mean loss times `loss_scale` is differentiated
/// (so that small gradients survive a half-precision backward pass), and every gradient is
/// divided by the scale in its own (f32) dtype. The loss returned is the unscaled mean.
pub(super) fn grad_scaled_fn<E: Model>(
    v: &E::View<'_>,
    inputs: &BatchInputs<E, ScaledExtra>,
) -> Vec<Tensor> {
    let (batch, mask, ScaledExtraMirror { key, loss_scale }) = inputs;
    mean_and_gradients::<E>(v, batch, *mask, *key, Some(*loss_scale))
}

/// The mean loss over the real rows, then the gradient of every trainable leaf (packed) —
/// with `scale`, of the mean times it, each gradient divided by it after.
fn mean_and_gradients<E: Model>(
    v: &E::View<'_>,
    batch: &<E::Batch as Tree>::Mirror<Tensor>,
    mask: Tensor,
    key: Option<Tensor>,
    scale: Option<Tensor>,
) -> Vec<Tensor> {
    let losses = per_example::<E>(keyed_loss::<E>(v, batch, key), mask, "Model::loss", true);
    let mask = mask.convert(losses.dtype());
    if trace::replicas() == 1 {
        let mean = (losses * mask).sum_all() / mask.sum_all().maximum(1.0);
        let grads = scaled_gradients(mean, scale);
        return std::iter::once(mean).chain(grads).collect();
    }
    let total = (losses * mask).sum_all();
    let count = mask.sum_all().all_sum().maximum(1.0);
    let grads = scaled_gradients(total, scale);
    let mean = total.all_sum() / count;
    std::iter::once(mean)
        .chain(
            grads
                .into_iter()
                .map(|g| g.all_sum() / count.convert(g.dtype())),
        )
        .collect()
}

/// The gradients of `loss` with respect to the trainable leaves, packed — with `scale`, of
/// `loss` times it, each gradient divided by it after (in its own dtype, f32 for f32 leaves).
fn scaled_gradients(loss: Tensor, scale: Option<Tensor>) -> Vec<Tensor> {
    let leaves = program::trainable_leaves();
    let grads = match scale {
        None => trace::grad(loss, &leaves),
        Some(s) => trace::grad(loss * s.convert(loss.dtype()), &leaves)
            .into_iter()
            .map(|g| g / s.convert(g.dtype()))
            .collect(),
    };
    program::pack_like_trainable(grads)
}

/// `values`, after checking that it holds one value per row of the batch (the mask's shape):
/// a `[batch, 1]` loss would broadcast against the mask to `[batch, batch]` (a loss and a
/// gradient about `batch` times too large, with padded rows leaking in), and a scalar would
/// train on padding. Anything else (or, when `float`, a value that is not a float) is refused
/// at trace time, naming `what`, the shape expected and the shape given.
pub(super) fn per_example<E: Model>(
    values: Tensor,
    mask: Tensor,
    what: &'static str,
    float: bool,
) -> Tensor {
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
    match float {
        true => trace::nn::widened(values),
        false => values,
    }
}

/// One micro-batch of an accumulation window: the mean loss over its real rows, then
/// `(sum + gradient of the summed loss over its real rows) * scale` for every packed gradient.
/// With `scale` 1 along the window and `1 / real rows of the window` on its last micro-batch,
/// the window ends holding the gradient of the window's mean loss — exactly what one step on
/// all its rows would compute.
pub(super) fn grad_accum_fn<E: Model>(
    v: &E::View<'_>,
    inputs: &BatchInputs<E, AccumExtra>,
) -> Vec<Tensor> {
    let (
        batch,
        mask,
        AccumExtraMirror {
            sums,
            scale,
            key,
            loss_scale,
        },
    ) = inputs;
    let losses = per_example::<E>(keyed_loss::<E>(v, batch, *key), *mask, "Model::loss", true);
    let mask = mask.convert(losses.dtype());
    let total = (losses * mask).sum_all();
    // Replicated, the sums and gradients add over the replicas (`all_sum` is the tensor itself
    // on one device).
    let mean = total.all_sum() / mask.sum_all().all_sum().maximum(1.0);
    let grads = scaled_gradients(total, *loss_scale);
    let summed = sums
        .iter()
        .zip(grads)
        .map(|(s, g)| (*s + g.all_sum()) * scale.convert(g.dtype()));
    std::iter::once(mean).chain(summed).collect()
}

/// The summed loss over the real rows, and the number of them classified correctly.
pub(super) fn eval_fn<E: Model>(v: &E::View<'_>, inputs: &BatchInputs<E, ()>) -> Vec<Tensor> {
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
        // Under a compute dtype, predictions come back in f32, as the model's leaves are.
        out.push(match program::compute_dtype() {
            Some(_) => trace::nn::widened(predictions),
            None => predictions,
        });
    }
    out
}

/// A device metric's running sum plus its per-example values over this batch's real rows.
pub(super) fn metric_fn<E: Model, M: DeviceMetric<E>>(
    v: &E::View<'_>,
    inputs: &BatchInputs<E, Array>,
) -> Vec<Tensor> {
    let (batch, mask, sum) = inputs;
    let values = per_example::<E>(M::per_example(v, batch), *mask, M::NAME, true);
    let mask = mask.convert(values.dtype());
    vec![*sum + (values * mask).sum_all().all_sum().convert(sum.dtype())]
}

pub(super) fn metric_program<E: Model, M: DeviceMetric<E>>(
    compute: Option<DType>,
) -> Program<E, BatchInputs<E, Array>, Vec<Tensor>> {
    Program::generic(M::NAME, metric_fn::<E, M>)
        .packing_trainable()
        .computing_in(compute)
}

/// A registered device metric, its type erased.
pub(super) trait MetricSlot<E: Model>: Send + Sync {
    fn name(&self) -> &'static str;
    /// Gets (or compiles) its program for batches like `sample`.
    fn get(
        &self,
        cache: &Cache,
        backend: &'static dyn Backend,
        experiment: &E,
        sample: &Shaped<'_, E::Batch>,
        mask: &Array,
        compute: Option<DType>,
    ) -> Result<Served>;
    /// What getting it would do ([`Cache::probe`]).
    fn probe(
        &self,
        cache: &Cache,
        backend: &'static dyn Backend,
        experiment: &E,
        sample: &Shaped<'_, E::Batch>,
        mask: &Array,
        compute: Option<DType>,
    ) -> Result<Probe>;
}

pub(super) struct MetricOf<M>(pub(super) std::marker::PhantomData<fn() -> M>);

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
        compute: Option<DType>,
    ) -> Result<Served> {
        let sum = Array::scalar(0.0f32);
        cache.get(
            backend,
            &metric_program::<E, M>(compute),
            experiment,
            &BatchRef(sample, mask, &sum),
        )
    }

    fn probe(
        &self,
        cache: &Cache,
        backend: &'static dyn Backend,
        experiment: &E,
        sample: &Shaped<'_, E::Batch>,
        mask: &Array,
        compute: Option<DType>,
    ) -> Result<Probe> {
        let sum = Array::scalar(0.0f32);
        cache.probe(
            backend,
            &metric_program::<E, M>(compute),
            experiment,
            &BatchRef(sample, mask, &sum),
        )
    }
}

/// What [`Nitro::prepare_programs`] compiles: the training programs, with the evaluation
/// program, with that and every device metric's.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Need {
    Train,
    Evaluate,
    Validate,
}

impl Need {
    /// Whether it holds the evaluation program.
    fn evaluates(self) -> bool {
        self != Need::Train
    }

    /// Whether it holds the device metrics' programs.
    fn measures(self) -> bool {
        self == Need::Validate
    }
}

/// A registered device metric and its program, once compiled.
pub(super) struct DeviceMetricState<E: Model> {
    pub(super) slot: Box<dyn MetricSlot<E>>,
    pub(super) compiled: Option<Arc<Compiled>>,
}

/// A gradient program: its trainable leaves packed, its gradients packed like them, computing
/// in `compute`.
fn gradient_program<E: Model, X: Tree>(
    name: &'static str,
    f: for<'v> fn(&E::View<'v>, &BatchInputs<E, X>) -> Vec<Tensor>,
    compute: Option<DType>,
) -> Program<E, BatchInputs<E, X>, Vec<Tensor>> {
    Program::generic(name, f)
        .packing_trainable()
        .packed_outputs()
        .computing_in(compute)
}

pub(super) fn grad_program<E: Model>(
    compute: Option<DType>,
) -> Program<E, BatchInputs<E, GradExtra>, Vec<Tensor>> {
    gradient_program::<E, GradExtra>("nitro.grad", grad_fn::<E>, compute)
}

pub(super) fn grad_scaled_program<E: Model>(
    compute: Option<DType>,
) -> Program<E, BatchInputs<E, ScaledExtra>, Vec<Tensor>> {
    gradient_program::<E, ScaledExtra>("nitro.grad", grad_scaled_fn::<E>, compute)
}

pub(super) fn grad_accum_program<E: Model>(
    compute: Option<DType>,
) -> Program<E, BatchInputs<E, AccumExtra>, Vec<Tensor>> {
    gradient_program::<E, AccumExtra>("nitro.grad_accumulate", grad_accum_fn::<E>, compute)
}

pub(super) fn eval_program<E: Model>(
    compute: Option<DType>,
) -> Program<E, BatchInputs<E, ()>, Vec<Tensor>> {
    Program::generic("nitro.eval", eval_fn::<E>)
        .packing_trainable()
        .computing_in(compute)
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
    /// On a mesh, how each group of `params` (and its slots in `state`, and its gradient) is
    /// split: per group — one trainable leaf on a mesh — its path and its
    /// [`PartitionSpec`](crate::shard::PartitionSpec). Empty off a mesh. A GraphConst:
    /// the program's shardings are in its key (with the mesh's axes named by position, so a
    /// renamed mesh keys alike: [`GroupLayout`](crate::shard::GroupLayout)), and its inputs
    /// (so its miss reasons) are named by leaf: `params[0] (layers[0].w)`.
    #[graph_const]
    pub layout: crate::shard::GroupLayout,
    /// Steps taken so far, `i64[]`: kept on the device and counted by the program, so a step
    /// uploads no step number; an integer, so it stays exact over any run (an `f32` counter
    /// stops counting at 2^24 steps). With loss scaling, the steps applied (a skipped step
    /// does not count).
    #[device]
    pub steps: Array,
    /// Dynamic loss scaling's constants ([`LossScaling`](super::LossScaling)), when the
    /// handle scales: the program then skips a step whose gradients are not all finite and
    /// moves the scale.
    #[graph_const]
    pub loss_scaling: Option<super::LossScaling>,
    /// With loss scaling, the scale (`f32[]`) and the finite steps since it moved (`i64[]`);
    /// empty without.
    #[device]
    pub loss_scale: Vec<Array>,
}

/// Per packed array, the runs of `(elements, selected)` of an optimizer's leaf mask.
pub type MaskRuns = Vec<Vec<(usize, bool)>>;

/// The runs of `optimizer`'s leaf mask over the leaves `paths` packed as `packing`.
pub(super) fn mask_runs<O: Optimizer>(
    optimizer: &O,
    paths: &[String],
    packing: &Packing,
) -> Result<MaskRuns> {
    let types = packing.leaf_types();
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
    let mut ends = vec![0usize; packing.groups.len()];
    for ((g, offset, dims), on) in packing.leaves.iter().zip(mask) {
        let n: usize = dims.iter().product();
        // The alignment gap before a leaf joins the run before it: its zeros stay zero
        // whether the optimizer runs over them or not.
        if let Some((len, _)) = runs[*g].last_mut() {
            *len += offset - ends[*g];
        }
        ends[*g] = offset + n;
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

/// The update program's inputs, named as program inputs (`grads[0]`, `lr`).
#[derive(crate::Tree, Clone, Debug)]
pub(super) struct UpdateArgs {
    /// The gradients (packed).
    pub(super) grads: Vec<Array>,
    /// The learning rate.
    pub(super) lr: Array,
}

/// The inputs of the update program, traced: the gradients and the learning rate.
pub(super) type UpdateInputs = UpdateArgsMirror<Tensor>;

pub(super) fn update_fn<O: Optimizer>(
    v: &OptimizerStepView<'_, O>,
    inputs: &UpdateInputs,
) -> Vec<Tensor> {
    let UpdateArgsMirror { grads, lr } = inputs;
    if !v.layout.is_empty() {
        crate::shard::declare_groups(v.layout.groups().to_vec());
    }
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
            // In the group's shape (a leaf's own, on a mesh).
            Some(Tensor::concatenate(&pieces, 0).reshape(&p.dims()))
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
    let (Some(scaling), [scale, good]) = (v.loss_scaling, v.loss_scale.as_slice()) else {
        out.push(number);
        return out;
    };
    // Finite when every gradient element is: an infinity or a NaN times 0 is a NaN, and a
    // NaN anywhere makes the sum one.
    let poison = grads
        .iter()
        .map(|g| (*g * 0.0).sum_all().convert(DType::F32))
        .reduce(|a, b| a + b)
        .unwrap_or_else(|| Tensor::scalar(0.0, DType::F32));
    let finite = poison.equal(0.0);
    // A step that is not finite is skipped: the parameters, the state and the count stay.
    let kept = v.params.iter().chain(&v.state);
    let mut out: Vec<Tensor> = out
        .into_iter()
        .zip(kept)
        .map(|(new, old)| Tensor::select(finite, new, *old))
        .collect();
    out.push(Tensor::select(finite, number, v.steps));
    let (scale, good) = (*scale, *good);
    let counted = good + 1.0;
    let grows = counted.greater_equal(f64::from(scaling.growth_interval));
    let halved = (scale * 0.5).maximum(1.0);
    out.push(Tensor::select(
        finite,
        Tensor::select(grows, scale * 2.0, scale),
        halved,
    ));
    out.push(Tensor::select(
        finite,
        Tensor::select(grows, good * 0.0, counted),
        good * 0.0,
    ));
    out
}

pub(super) fn update_program<O: Optimizer>() -> Program<OptimizerStep<O>, UpdateInputs, Vec<Tensor>>
{
    OptimizerStep::<O>::program("nitro.update", update_fn::<O>).donating_device()
}

/// The programs a handle holds and what getting them took: the current batch shape's
/// gradient, update and evaluation programs, those of other shapes (buckets) swapped in when a
/// batch needs them, the device metrics with their programs, and every lookup's times — what
/// [`Nitro::prepare`], [`Nitro::plan`], [`Nitro::manifest`] and the program budget read.
pub(super) struct Inventory<E: Model> {
    /// The current batch shape's programs.
    current: Option<Programs>,
    /// Programs for other batch shapes (other buckets).
    held: Vec<Programs>,
    /// Validation metrics accumulated on the device, each with a program of its own (kept for
    /// the current shape).
    metrics: Vec<DeviceMetricState<E>>,
    /// Wall time spent getting programs (tracing, loading, compiling).
    compile_time: Duration,
    /// Every program lookup that prepared the inventory, in order.
    times: Vec<ProgramTime>,
}

impl<E: Model> Inventory<E> {
    /// No programs yet.
    pub(super) fn new() -> Inventory<E> {
        Inventory {
            current: None,
            held: Vec::new(),
            metrics: Vec::new(),
            compile_time: Duration::ZERO,
            times: Vec::new(),
        }
    }

    /// Registers a device metric: one more program, got with the evaluation program.
    pub(super) fn add_metric(&mut self, slot: Box<dyn MetricSlot<E>>) {
        self.metrics.push(DeviceMetricState {
            slot,
            compiled: None,
        });
    }

    /// The device metrics, in registration order.
    pub(super) fn metrics(&self) -> &[DeviceMetricState<E>] {
        &self.metrics
    }

    /// The current batch shape's programs.
    pub(super) fn current(&self) -> Option<&Programs> {
        self.current.as_ref()
    }

    /// Whether nothing is held (no update program yet).
    pub(super) fn is_empty(&self) -> bool {
        self.current.is_none() && self.held.is_empty()
    }

    /// Whether everything `need` names is held for batches like `sample` as the current
    /// shape's (the common case of every step, answered without allocating).
    pub(super) fn ready<B: Tree>(&self, sample: &B, need: Need) -> bool {
        let Some(p) = self
            .current
            .as_ref()
            .filter(|p| has_types(sample, &p.batch_types))
        else {
            return false;
        };
        (!need.evaluates() || p.eval.is_some())
            && (!need.measures() || self.metrics.iter().all(|m| m.compiled.is_some()))
    }

    /// What must be looked up for batches like `sample` to run `need`.
    pub(super) fn wants<B: Tree>(&self, sample: &B, need: Need) -> Wants {
        let (want_eval, want_metrics) = (need.evaluates(), need.measures());
        let current = self
            .current
            .as_ref()
            .filter(|p| has_types(sample, &p.batch_types));
        let held = current.or_else(|| self.held.iter().find(|p| has_types(sample, &p.batch_types)));
        match held {
            None => Wants {
                grad: true,
                update: true,
                eval: want_eval,
                metrics: vec![want_metrics; self.metrics.len()],
            },
            Some(p) => Wants {
                grad: false,
                update: false,
                eval: want_eval && p.eval.is_none(),
                // A metric's program is kept for the current shape only.
                metrics: self
                    .metrics
                    .iter()
                    .map(|m| want_metrics && !(current.is_some() && m.compiled.is_some()))
                    .collect(),
            },
        }
    }

    /// Installs the programs `got` for batches of `batch_types` (making them the current
    /// ones, or swapping in those held for that shape) and records what each lookup did and
    /// spent; returns the outcomes, training programs first.
    pub(super) fn install(
        &mut self,
        batch_types: Vec<LeafType>,
        mut got: Vec<(Slot, &'static str, Served)>,
        backend: &dyn Backend,
        edge: Option<usize>,
    ) -> Vec<Outcome> {
        let take = |got: &mut Vec<(Slot, &'static str, Served)>, slot: Slot| {
            got.iter()
                .position(|(s, _, _)| *s == slot)
                .map(|i| got.remove(i))
        };
        let mut outcomes = Vec::new();
        match (take(&mut got, Slot::Grad), take(&mut got, Slot::Update)) {
            (Some((_, role, grad)), Some((_, _, update))) => {
                outcomes.extend([grad.outcome.clone(), update.outcome.clone()]);
                self.times.push(ProgramTime::of(role, &grad, backend, edge));
                self.times
                    .push(ProgramTime::of("update", &update, backend, None));
                for m in &mut self.metrics {
                    m.compiled = None;
                }
                if let Some(old) = self.current.take() {
                    if old.batch_types != batch_types {
                        self.held.push(old);
                    }
                }
                self.current = Some(Programs {
                    grad: grad.compiled,
                    update: update.compiled,
                    eval: None,
                    batch_types,
                });
            }
            _ => {
                // Held programs for another shape than the current one: swap them in.
                let current = self
                    .current
                    .as_ref()
                    .is_some_and(|p| p.batch_types == batch_types);
                if !current {
                    if let Some(i) = self.held.iter().position(|p| p.batch_types == batch_types) {
                        let found = self.held.swap_remove(i);
                        if let Some(old) = self.current.replace(found) {
                            self.held.push(old);
                        }
                        for m in &mut self.metrics {
                            m.compiled = None;
                        }
                    }
                }
            }
        }
        for (slot, role, served) in got {
            outcomes.push(served.outcome.clone());
            self.times
                .push(ProgramTime::of(role, &served, backend, edge));
            match slot {
                Slot::Eval => {
                    if let Some(p) = &mut self.current {
                        p.eval = Some(served.compiled);
                    }
                }
                Slot::Metric(i) => {
                    if let Some(m) = self.metrics.get_mut(i) {
                        m.compiled = Some(served.compiled);
                    }
                }
                Slot::Grad | Slot::Update => {}
            }
        }
        outcomes
    }

    /// Adds wall time spent getting programs.
    pub(super) fn spent(&mut self, took: Duration) {
        self.compile_time += took;
    }

    /// Wall time spent getting programs.
    pub(super) fn compile_time(&self) -> Duration {
        self.compile_time
    }

    /// Every lookup's times, in order.
    pub(super) fn times(&self) -> &[ProgramTime] {
        &self.times
    }

    /// The current shape's evaluation program, once got.
    pub(super) fn eval(&self) -> Option<Arc<Compiled>> {
        self.current.as_ref().and_then(|p| p.eval.clone())
    }

    /// Device metric `i`'s program for the current shape, once got.
    pub(super) fn metric(&self, i: usize) -> Option<Arc<Compiled>> {
        self.metrics.get(i).and_then(|m| m.compiled.clone())
    }

    /// Forgets every program (after the experiment changed: they are looked up again).
    pub(super) fn forget(&mut self) {
        self.current = None;
        self.held.clear();
    }

    /// The programs held: the update program, and per batch shape its gradient program, with
    /// its evaluation program and device metrics when it validated.
    pub(super) fn held_count(&self) -> usize {
        let per_shape = |p: &Programs| {
            1 + match p.eval {
                Some(_) => 1 + self.metrics.len(),
                None => 0,
            }
        };
        let shapes: usize = self.current.iter().chain(&self.held).map(per_shape).sum();
        shapes + usize::from(self.current.is_some())
    }

    /// Refuses, before anything compiles, to get `new` more programs (for batches like
    /// `sample`) than `budget` ([`Config::max_programs`]) allows.
    pub(super) fn check_budget<B: Tree>(
        &self,
        budget: Option<usize>,
        sample: &B,
        new: usize,
    ) -> Result<()> {
        let Some(budget) = budget else {
            return Ok(());
        };
        let needed = self.held_count() + new;
        if new > 0 && needed > budget {
            let shape: Vec<String> = leaves(sample)
                .iter()
                .map(|a| a.leaf_type().to_string())
                .collect();
            return Err(Error::ProgramBudget {
                budget,
                needed,
                what: format!("programs for batches of {}", shape.join(", ")),
            });
        }
        Ok(())
    }

    /// The programs declared for `edges` bucket edges: the update program, and per edge the
    /// gradient program (plus, when `validating`, the evaluation program and one per device
    /// metric).
    pub(super) fn declared(&self, edges: usize, validating: bool) -> usize {
        let per_edge = 1 + if validating {
            1 + self.metrics.len()
        } else {
            0
        };
        1 + edges * per_edge
    }

    /// Every program got (from memory, the store or a compile), each once, with its
    /// fingerprint and store key.
    pub(super) fn manifest(&self) -> crate::cache::Manifest {
        let mut m = crate::cache::Manifest::new();
        for t in &self.times {
            m.push(crate::cache::ManifestEntry {
                role: t.role.clone(),
                edge: t.edge,
                program: t.program.clone(),
                fingerprint: t.fingerprint.to_string(),
                key: t.key.to_string(),
            });
        }
        m
    }

    /// What each held program holds, and what tracing and compiling it took.
    pub(super) fn compile_report(&self) -> crate::cache::CompileReport {
        let mut programs = Vec::new();
        for p in self.current.iter().chain(&self.held) {
            programs.push(("grad".to_owned(), (*p.grad.cost).clone()));
            programs.push(("update".to_owned(), (*p.update.cost).clone()));
            if let Some(eval) = &p.eval {
                programs.push(("eval".to_owned(), (*eval.cost).clone()));
            }
        }
        crate::cache::CompileReport { programs }
    }

    /// The current shape's programs as [`Memory`] reports them; the gradient program under
    /// `grad_role`.
    pub(super) fn memory(&self, grad_role: &str) -> Vec<ProgramMemory> {
        let Some(p) = &self.current else {
            return Vec::new();
        };
        [Some((grad_role, &p.grad)), Some(("update", &p.update))]
            .into_iter()
            .chain(std::iter::once(p.eval.as_ref().map(|e| ("eval", e))))
            .flatten()
            .map(|(role, c)| ProgramMemory {
                role: role.to_owned(),
                cached_bytes: c.executable.size_bytes(),
                compiled: c.executable.memory(),
            })
            .collect()
    }
}

/// Which programs of the inventory one batch shape needs looked up.
#[derive(Clone, Debug, Default)]
pub(super) struct Wants {
    pub(super) grad: bool,
    pub(super) update: bool,
    pub(super) eval: bool,
    pub(super) metrics: Vec<bool>,
}

impl Wants {
    /// How many programs these lookups add to what the handle holds (`nothing_held`: no
    /// update program is held yet); device metrics count with a new evaluation program.
    pub(super) fn new_programs(&self, nothing_held: bool, metrics: usize) -> usize {
        let mut new = 0;
        if self.grad {
            new += 1 + usize::from(nothing_held);
        }
        if self.eval {
            new += 1 + if self.metrics.iter().any(|&m| m) {
                metrics
            } else {
                0
            };
        }
        new
    }
}

/// The programs of a handle, once compiled for a batch shape.
pub(super) struct Programs {
    pub(super) grad: Arc<Compiled>,
    pub(super) update: Arc<Compiled>,
    /// Compiled on the first evaluation: a train-only run compiles two programs.
    pub(super) eval: Option<Arc<Compiled>>,
    /// The batch leaf types they were compiled for.
    pub(super) batch_types: Vec<crate::tree::LeafType>,
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
    /// The compile it spared (see [`crate::cache::Timing::saved`]).
    pub saved: Duration,
    /// The bucket edge of its batches (`None`: no buckets, or the update program).
    pub edge: Option<usize>,
    /// The traced program's fingerprint.
    pub fingerprint: Digest,
    /// Its key in the persistent store ([`crate::cache::store_key`]).
    pub key: Digest,
}

impl ProgramTime {
    fn of(role: &str, served: &Served, backend: &dyn Backend, edge: Option<usize>) -> ProgramTime {
        ProgramTime {
            edge,
            fingerprint: served.compiled.fingerprint,
            key: crate::cache::store_key(backend, &served.compiled.fingerprint),
            role: role.to_owned(),
            program: served.compiled.program.clone(),
            outcome: served.outcome.clone(),
            trace: served.timing.trace,
            build: served.timing.build,
            saved: served.timing.saved,
        }
    }
}

/// A batch's structure with every leaf's first dim cut to one replica's share of the rows:
/// what a replicated program is traced on (zero-filled stand-ins; tracing reads only types).
pub(super) struct Shaped<'a, B> {
    pub(super) batch: &'a B,
    pub(super) leaves: Vec<Array>,
}

impl<'a, B: Tree> Shaped<'a, B> {
    /// `batch` shaped for `replicas` replicas (itself for one).
    pub(super) fn new(batch: &'a B, replicas: usize) -> Result<Shaped<'a, B>> {
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

    fn map_mirror<L, M>(m: &Self::Mirror<L>, f: &mut dyn FnMut(&L) -> M) -> Self::Mirror<M> {
        B::map_mirror(m, f)
    }
}

/// A batch, its mask and the program's other inputs as one input tree, borrowed: named
/// `batch.…`, `mask` and the extra's names in keys, reasons and manifests.
pub(super) struct BatchRef<'a, B, X>(pub(super) &'a B, pub(super) &'a Array, pub(super) &'a X);

/// Visits `extra` under its [`ExtraInputs::NAME`], if it has one.
fn with_extra<X: ExtraInputs, R>(
    at: &mut crate::tree::LeafPath,
    f: impl FnOnce(&mut crate::tree::LeafPath) -> R,
) -> R {
    match X::NAME {
        Some(name) => at.with_field(name, f),
        None => f(at),
    }
}

impl<B: Tree, X: ExtraInputs> Tree for BatchRef<'_, B, X> {
    type Mirror<L> = (B::Mirror<L>, L, X::Mirror<L>);

    fn visit<'a>(
        &'a self,
        at: &mut crate::tree::LeafPath,
        f: &mut dyn FnMut(&crate::tree::LeafPath, Node<'a>),
    ) {
        at.with_field("batch", |at| self.0.visit(at, f));
        at.with_field("mask", |at| self.1.visit(at, f));
        with_extra::<X, _>(at, |at| self.2.visit(at, f));
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
            at.with_field("batch", |at| self.0.mirror(at, f)),
            at.with_field("mask", |at| self.1.mirror(at, f)),
            with_extra::<X, _>(at, |at| self.2.mirror(at, f)),
        )
    }

    fn map_mirror<L, M>(m: &Self::Mirror<L>, f: &mut dyn FnMut(&L) -> M) -> Self::Mirror<M> {
        (B::map_mirror(&m.0, f), f(&m.1), X::map_mirror(&m.2, f))
    }
}

/// The update program's inputs with the types of `opt`'s leaves (values unused).
pub(super) fn update_inputs_shape<O: Optimizer>(opt: &OptimizerStep<O>) -> UpdateArgs {
    UpdateArgs {
        grads: opt
            .params
            .iter()
            .map(|a| Array::zeros(a.dtype(), a.dims()))
            .collect(),
        lr: Array::scalar(0.0f32),
    }
}
