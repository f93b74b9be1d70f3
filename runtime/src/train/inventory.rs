//! The program inventory of a handle: the programs it derives from a [`Model`] and its
//! optimizer, and how [`Nitro::prepare`] gets (or compiles) them — concurrently or one at a
//! time — with what each lookup did and spent ([`ProgramTime`]).

use super::*;
use crate::cache::{Probe, Will};
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
    values
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
    let (batch, mask, AccumExtraMirror { sums, scale, key }) = inputs;
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
        out.push(predictions);
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
) -> Program<E, BatchInputs<E, Array>, Vec<Tensor>> {
    Program::generic(M::NAME, metric_fn::<E, M>).packing_trainable()
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
    ) -> Result<Served>;
    /// What getting it would do ([`Cache::probe`]).
    fn probe(
        &self,
        cache: &Cache,
        backend: &'static dyn Backend,
        experiment: &E,
        sample: &Shaped<'_, E::Batch>,
        mask: &Array,
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
    ) -> Result<Served> {
        let sum = Array::scalar(0.0f32);
        cache.get(
            backend,
            &metric_program::<E, M>(),
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
    ) -> Result<Probe> {
        let sum = Array::scalar(0.0f32);
        cache.probe(
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
pub(super) enum Inventory {
    Train,
    Evaluate,
    Validate,
}

impl Inventory {
    /// Whether it holds the evaluation program.
    fn evaluates(self) -> bool {
        self != Inventory::Train
    }

    /// Whether it holds the device metrics' programs.
    fn measures(self) -> bool {
        self == Inventory::Validate
    }
}

/// A registered device metric and its program, once compiled.
pub(super) struct DeviceMetricState<E: Model> {
    pub(super) slot: Box<dyn MetricSlot<E>>,
    pub(super) compiled: Option<Arc<Compiled>>,
}

pub(super) fn grad_program<E: Model>() -> Program<E, BatchInputs<E, GradExtra>, Vec<Tensor>> {
    Program::generic("nitro.grad", grad_fn::<E>)
        .packing_trainable()
        .packed_outputs()
}

pub(super) fn grad_accum_program<E: Model>() -> Program<E, BatchInputs<E, AccumExtra>, Vec<Tensor>>
{
    Program::generic("nitro.grad_accumulate", grad_accum_fn::<E>)
        .packing_trainable()
        .packed_outputs()
}

pub(super) fn eval_program<E: Model>() -> Program<E, BatchInputs<E, ()>, Vec<Tensor>> {
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
    /// On a mesh, how each group of `params` (and its slots in `state`, and its gradient) is
    /// split: per group — one trainable leaf on a mesh — its path and its
    /// [`PartitionSpec`](crate::shard::PartitionSpec)'s dims. Empty off a mesh. A GraphConst:
    /// the program's shardings are in its key, and its inputs (so its miss reasons) are named
    /// by leaf: `params[0] (layers[0].w)`.
    #[graph_const]
    pub layout: Vec<(String, Vec<Option<String>>)>,
    /// Steps taken so far, `i64[]`: kept on the device and counted by the program, so a step
    /// uploads no step number; an integer, so it stays exact over any run (an `f32` counter
    /// stops counting at 2^24 steps).
    #[device]
    pub steps: Array,
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
        crate::shard::declare_groups(
            v.layout
                .iter()
                .map(|(path, dims)| (path.clone(), crate::shard::PartitionSpec(dims.clone())))
                .collect(),
        );
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
    out.push(number);
    out
}

pub(super) fn update_program<O: Optimizer>() -> Program<OptimizerStep<O>, UpdateInputs, Vec<Tensor>>
{
    OptimizerStep::<O>::program("nitro.update", update_fn::<O>).donating_device()
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

impl<E: Model, O: Optimizer> Nitro<E, O> {
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
    pub(super) fn prepare_programs(
        &mut self,
        sample: &E::Batch,
        inventory: Inventory,
    ) -> Result<Vec<Outcome>> {
        let (want_eval, want_metrics) = (inventory.evaluates(), inventory.measures());
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
        self.prepare_shapes(std::slice::from_ref(sample), inventory)
    }

    /// Gets (or compiles) what `inventory` names for batches like each of `samples` that the
    /// handle does not hold: every lookup of every
    /// shape at once, at most [`Config::compile_threads`] at a time, checked against the
    /// program budget before any compiles; then each shape's programs are installed in order
    /// (the last shape's are current).
    pub(super) fn prepare_shapes(
        &mut self,
        samples: &[E::Batch],
        inventory: Inventory,
    ) -> Result<Vec<Outcome>> {
        let started = Instant::now();
        let replicas = self.backend.replicas();
        // What each shape needs, its rows checked; the new programs counted for the budget.
        let mut jobs = Vec::new();
        let mut new = 0;
        let mut nothing_held = self.programs.is_none() && self.held.is_empty();
        for (i, sample) in samples.iter().enumerate() {
            let wants = self.wants(sample, inventory);
            let rows = batch_rows(sample)?;
            let expected_rows = self.expected_rows(sample)?;
            if rows != expected_rows {
                let why = match &self.config.buckets {
                    Some(_) => "rows for this bucket (Buckets::rows_for)",
                    None => "rows (Config::batch)",
                };
                return Err(Error::InvalidSetting {
                    variable: "batch",
                    value: rows.to_string(),
                    expected: format!("batches of {expected_rows} {why}"),
                });
            }
            new += wants.new_programs(nothing_held, self.device_metrics.len());
            nothing_held &= !wants.grad;
            jobs.push((i, wants, rows));
        }
        self.check_budget(&samples[jobs.first().map_or(0, |j| j.0)], new)?;
        // Tracing reads the experiment's leaf types only, which steps never change: no sync.
        let shaped: Vec<(Shaped<'_, E::Batch>, ProgramInputs<O>)> = jobs
            .iter()
            .map(|&(i, _, rows)| {
                Ok((
                    Shaped::new(&samples[i], replicas)?,
                    self.program_inputs(rows),
                ))
            })
            .collect::<Result<_>>()?;
        let found = {
            let lookups: Vec<(usize, Lookup<'_>)> = jobs
                .iter()
                .zip(&shaped)
                .enumerate()
                .flat_map(|(j, ((i, wants, _), (sample, inputs)))| {
                    self.lookups(sample, inputs, wants, self.bucket_edge(&samples[*i]))
                        .into_iter()
                        .map(move |l| (j, l))
                })
                .collect();
            let threads = if self.config.concurrent_compiles {
                self.config.compile_thread_count()
            } else {
                1
            };
            get_all(lookups, threads, !self.config.progress)
        };
        drop(shaped);
        let mut by_job: Vec<Vec<(Slot, &'static str, Result<Served>)>> =
            jobs.iter().map(|_| Vec::new()).collect();
        for (j, slot, role, result) in found {
            by_job[j].push((slot, role, result));
        }
        let mut outcomes = Vec::new();
        for ((i, _, _), found) in jobs.iter().zip(by_job) {
            let sample = &samples[*i];
            outcomes.extend(self.install(sample, found, self.bucket_edge(sample))?);
        }
        self.compile_time += started.elapsed();
        Ok(outcomes)
    }

    /// What the handle must look up for batches like `sample` to run `inventory`.
    fn wants(&self, sample: &E::Batch, inventory: Inventory) -> Wants {
        let (want_eval, want_metrics) = (inventory.evaluates(), inventory.measures());
        let current = self
            .programs
            .as_ref()
            .filter(|p| has_types(sample, &p.batch_types));
        let held = current.or_else(|| self.held.iter().find(|p| has_types(sample, &p.batch_types)));
        match held {
            None => Wants {
                grad: true,
                update: true,
                eval: want_eval,
                metrics: vec![want_metrics; self.device_metrics.len()],
            },
            Some(p) => Wants {
                grad: false,
                update: false,
                eval: want_eval && p.eval.is_none(),
                // A metric's program is kept for the current shape only.
                metrics: self
                    .device_metrics
                    .iter()
                    .map(|m| want_metrics && !(current.is_some() && m.compiled.is_some()))
                    .collect(),
            },
        }
    }

    /// The inventory's lookups for one batch shape: what `prepare` gets and `plan` probes, one
    /// list for both, in the plan's order (update, gradient, evaluation, metrics).
    fn lookups<'a>(
        &'a self,
        sample: &'a Shaped<'a, E::Batch>,
        inputs: &'a ProgramInputs<O>,
        wants: &Wants,
        edge: Option<usize>,
    ) -> Vec<Lookup<'a>> {
        let (backend, cache, experiment) = (self.backend, self.cache, &self.experiment);
        let mut out = Vec::new();
        if wants.update {
            out.push(Lookup::new(Slot::Update, "update", None, move |mode| {
                let program = update_program::<O>();
                found(
                    mode,
                    cache,
                    backend,
                    &program,
                    &inputs.opt,
                    &inputs.update_inputs,
                )
            }));
        }
        if wants.grad {
            if self.config.accum > 1 {
                out.push(Lookup::new(
                    Slot::Grad,
                    "grad_accumulate",
                    edge,
                    move |mode| {
                        let batch = BatchRef(sample, &inputs.mask, &inputs.sums);
                        found(
                            mode,
                            cache,
                            backend,
                            &grad_accum_program::<E>(),
                            experiment,
                            &batch,
                        )
                    },
                ));
            } else {
                out.push(Lookup::new(Slot::Grad, "grad", edge, move |mode| {
                    let batch = BatchRef(sample, &inputs.mask, &inputs.key_sample);
                    found(
                        mode,
                        cache,
                        backend,
                        &grad_program::<E>(),
                        experiment,
                        &batch,
                    )
                }));
            }
        }
        if wants.eval {
            out.push(Lookup::new(Slot::Eval, "eval", edge, move |mode| {
                let batch = BatchRef(sample, &inputs.mask, &());
                found(
                    mode,
                    cache,
                    backend,
                    &eval_program::<E>(),
                    experiment,
                    &batch,
                )
            }));
        }
        for (i, m) in self.device_metrics.iter().enumerate() {
            if !wants.metrics.get(i).copied().unwrap_or(false) {
                continue;
            }
            let slot = m.slot.as_ref();
            out.push(Lookup::new(
                Slot::Metric(i),
                slot.name(),
                edge,
                move |mode| {
                    Ok(match mode {
                        Mode::Get => Found::Served(slot.get(
                            cache,
                            backend,
                            experiment,
                            sample,
                            &inputs.mask,
                        )?),
                        Mode::Probe => Found::Probe(slot.probe(
                            cache,
                            backend,
                            experiment,
                            sample,
                            &inputs.mask,
                        )?),
                    })
                },
            ));
        }
        out
    }

    /// Installs the programs found for batches like `sample` (making them the current ones)
    /// and records what each lookup did and spent.
    fn install(
        &mut self,
        sample: &E::Batch,
        found: Vec<(Slot, &'static str, Result<Served>)>,
        edge: Option<usize>,
    ) -> Result<Vec<Outcome>> {
        let batch_types = leaf_types(sample);
        let mut got: Vec<(Slot, &'static str, Served)> = Vec::with_capacity(found.len());
        for (slot, role, result) in found {
            got.push((slot, role, result?));
        }
        let take = |got: &mut Vec<(Slot, &'static str, Served)>, slot: Slot| {
            got.iter()
                .position(|(s, _, _)| *s == slot)
                .map(|i| got.remove(i))
        };
        let mut outcomes = Vec::new();
        let b = self.backend;
        match (take(&mut got, Slot::Grad), take(&mut got, Slot::Update)) {
            (Some((_, role, grad)), Some((_, _, update))) => {
                outcomes.extend([grad.outcome.clone(), update.outcome.clone()]);
                self.program_times
                    .push(ProgramTime::of(role, &grad, b, edge));
                self.program_times
                    .push(ProgramTime::of("update", &update, b, None));
                for m in &mut self.device_metrics {
                    m.compiled = None;
                }
                if let Some(old) = self.programs.take() {
                    if old.batch_types != batch_types {
                        self.held.push(old);
                    }
                }
                self.programs = Some(Programs {
                    grad: grad.compiled,
                    update: update.compiled,
                    eval: None,
                    batch_types,
                });
            }
            _ => {
                // Held programs for another shape than the current one: swap them in.
                let current = self
                    .programs
                    .as_ref()
                    .is_some_and(|p| has_types(sample, &p.batch_types));
                if !current {
                    if let Some(i) = self
                        .held
                        .iter()
                        .position(|p| has_types(sample, &p.batch_types))
                    {
                        let found = self.held.swap_remove(i);
                        if let Some(old) = self.programs.replace(found) {
                            self.held.push(old);
                        }
                        for m in &mut self.device_metrics {
                            m.compiled = None;
                        }
                    }
                }
            }
        }
        for (slot, role, served) in got {
            outcomes.push(served.outcome.clone());
            self.program_times
                .push(ProgramTime::of(role, &served, b, edge));
            match slot {
                Slot::Eval => {
                    if let Some(p) = &mut self.programs {
                        p.eval = Some(served.compiled);
                    }
                }
                Slot::Metric(i) => {
                    if let Some(m) = self.device_metrics.get_mut(i) {
                        m.compiled = Some(served.compiled);
                    }
                }
                Slot::Grad | Slot::Update => {}
            }
        }
        Ok(outcomes)
    }

    /// Gets (or compiles) the evaluation program for batches like `sample`.
    pub(super) fn prepare_eval(&mut self, sample: &E::Batch) -> Result<Arc<Compiled>> {
        self.prepare_programs(sample, Inventory::Evaluate)?;
        self.programs
            .as_ref()
            .and_then(|p| p.eval.clone())
            .ok_or_else(no_output)
    }

    /// The optimizer program's experiment, with arrays of the right types from the layout
    /// (values unused: zeroed memory, never written, so never resident).
    pub(super) fn optimizer_step_shape(&self) -> OptimizerStep<O> {
        let state = zero_state(&self.optimizer, &self.packing);
        OptimizerStep {
            optimizer: self.optimizer.clone(),
            params: self.packing.zeros(),
            state,
            masks: self.masks.clone(),
            layout: self
                .group_specs
                .iter()
                .zip(&self.trainable_paths)
                .map(|(s, path)| (path.clone(), s.0.clone()))
                .collect(),
            steps: Array::scalar(0i64),
        }
    }

    /// Device metric `i`'s program for batches like `sample`, compiled (with every other
    /// device metric's) by the first use.
    pub(super) fn metric_program(&mut self, i: usize, sample: &E::Batch) -> Result<Arc<Compiled>> {
        self.prepare_programs(sample, Inventory::Validate)?;
        self.device_metrics[i]
            .compiled
            .clone()
            .ok_or_else(no_output)
    }

    /// The rows a batch like `sample` must have: [`Config::batch`], or with buckets the rows
    /// of its bucket — an error when its variable dimension is not a declared edge.
    pub(super) fn expected_rows(&self, sample: &E::Batch) -> Result<usize> {
        let Some(buckets) = &self.config.buckets else {
            return Ok(self.config.batch);
        };
        let axis = buckets.axis();
        let mut edge = None;
        for leaf in leaves(sample) {
            if let Some(&len) = leaf.dims().get(axis) {
                buckets.check_edge(len)?;
                edge.get_or_insert(len);
            }
        }
        let edge = edge.ok_or_else(|| Error::InvalidDataArgument {
            what: format!(
                "a bucketed batch needs a leaf with a dimension at axis {axis}, the variable \
                 length; this batch has none"
            ),
        })?;
        Ok(buckets.rows_for(edge, self.config.batch, self.row_multiple()))
    }

    /// The bucket edge of batches like `sample` (`None` without buckets).
    fn bucket_edge(&self, sample: &E::Batch) -> Option<usize> {
        let axis = self.config.buckets.as_ref()?.axis();
        leaves(sample)
            .iter()
            .find_map(|a| a.dims().get(axis).copied())
    }

    /// The inventory manifest of this handle: every program it got (from memory, the store or
    /// a compile), each once, with its fingerprint and store key — what `nitro cache pull
    /// --manifest` fetches onto another machine before it runs the same experiment.
    pub fn manifest(&self) -> crate::cache::Manifest {
        let mut m = crate::cache::Manifest::new();
        for t in &self.program_times {
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

    /// The programs the handle holds: the update program, and per batch shape its gradient
    /// program, with its evaluation program and device metrics when it validated.
    pub fn programs_held(&self) -> usize {
        let per_shape = |p: &Programs| {
            1 + match p.eval {
                Some(_) => 1 + self.device_metrics.len(),
                None => 0,
            }
        };
        let shapes: usize = self.programs.iter().chain(&self.held).map(per_shape).sum();
        shapes + usize::from(self.programs.is_some())
    }

    /// Refuses, before anything compiles, to get `new` more programs (for batches like
    /// `sample`) than [`Config::max_programs`] allows.
    fn check_budget(&self, sample: &E::Batch, new: usize) -> Result<()> {
        let Some(budget) = self.config.max_programs else {
            return Ok(());
        };
        let needed = self.programs_held() + new;
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

    /// The programs a handle with buckets declares: the update program, and per edge the
    /// gradient program (plus, when `validating`, the evaluation program and one per device
    /// metric); without buckets, as for one edge.
    pub fn declared_inventory(&self, validating: bool) -> usize {
        let edges = self.config.buckets.as_ref().map_or(1, |b| b.edges().len());
        let per_edge = 1 + if validating {
            1 + self.device_metrics.len()
        } else {
            0
        };
        1 + edges * per_edge
    }

    /// The inputs the handle's programs are looked up with, for batches of `rows` rows (each
    /// replica sees its share).
    fn program_inputs(&self, rows: usize) -> ProgramInputs<O> {
        let opt = self.optimizer_step_shape();
        let update_inputs = update_inputs_shape(&opt);
        let key_sample: GradExtra = E::RANDOM.then(|| Array::zeros(DType::U32, &[2]));
        ProgramInputs {
            mask: Array::zeros(DType::F32, &[rows / self.backend.replicas()]),
            sums: AccumExtra {
                sums: self.packing.zeros(),
                scale: Array::scalar(1.0f32),
                key: key_sample.clone(),
            },
            opt,
            update_inputs,
            key_sample,
        }
    }

    /// The preflight: what getting the programs for batches like `sample` would do — per
    /// program, a hit, a load, a fetch from the shared server or a compile, with the miss
    /// reason and the expected time from the store's records — traced and keyed, never compiled
    /// (the cache's counters do not move). `validating` adds the evaluation and metric
    /// programs. With buckets, [`plan_buckets`](Nitro::plan_buckets) plans every edge.
    pub fn plan(&self, sample: &E::Batch, validating: bool) -> Result<Plan> {
        let mut plan = Plan::default();
        self.plan_into(&mut plan, sample, validating, None)?;
        Ok(plan)
    }

    /// The preflight of the whole declared inventory: [`plan`](Nitro::plan) for every bucket
    /// edge, with batches of `data`'s columns; the update program once.
    pub fn plan_buckets(
        &self,
        data: &crate::data::buckets::Ragged,
        validating: bool,
    ) -> Result<Plan>
    where
        E::Batch: FromBatch,
    {
        let buckets = self
            .config
            .buckets
            .clone()
            .ok_or_else(|| Error::InvalidSetting {
                variable: "Config::buckets",
                value: "None".into(),
                expected: "declared bucket edges to plan (or plan one batch with Nitro::plan)"
                    .into(),
            })?;
        let mut plan = Plan::default();
        for &edge in buckets.edges() {
            let rows = buckets.rows_for(edge, self.config.batch, self.row_multiple());
            let sample = E::Batch::from_batch(data.blank(edge, rows, &buckets)?)?;
            self.plan_into(&mut plan, &sample, validating, Some(edge))?;
        }
        Ok(plan)
    }

    fn plan_into(
        &self,
        plan: &mut Plan,
        sample: &E::Batch,
        validating: bool,
        edge: Option<usize>,
    ) -> Result<()> {
        let rows = batch_rows(sample)?;
        let expected = self.expected_rows(sample)?;
        if rows != expected {
            return Err(Error::InvalidSetting {
                variable: "batch",
                value: rows.to_string(),
                expected: format!("batches of {expected} rows"),
            });
        }
        let sample = &Shaped::new(sample, self.backend.replicas())?;
        let inputs = self.program_inputs(rows);
        let wants = Wants {
            grad: true,
            update: !plan.entries.iter().any(|e| e.role == "update"),
            eval: validating,
            metrics: vec![validating; self.device_metrics.len()],
        };
        for lookup in self.lookups(sample, &inputs, &wants, edge) {
            let Found::Probe(probe) = (lookup.run)(Mode::Probe)? else {
                continue;
            };
            plan.entries.push(PlanEntry {
                role: lookup.role.to_owned(),
                edge: lookup.edge,
                probe,
            });
        }
        Ok(())
    }
}

/// Which program of the inventory a lookup is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Slot {
    Grad,
    Update,
    Eval,
    Metric(usize),
}

/// What a lookup does: get the program (compiling it if need be), or say what getting it
/// would do ([`Cache::probe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Get,
    Probe,
}

/// What a lookup found.
pub(super) enum Found {
    Served(Served),
    Probe(Probe),
}

/// One program of the inventory for one batch shape: its role, its edge, and how to get or
/// probe it.
pub(super) struct Lookup<'a> {
    slot: Slot,
    role: &'static str,
    edge: Option<usize>,
    run: Box<dyn Fn(Mode) -> Result<Found> + Send + Sync + 'a>,
}

impl<'a> Lookup<'a> {
    fn new(
        slot: Slot,
        role: &'static str,
        edge: Option<usize>,
        run: impl Fn(Mode) -> Result<Found> + Send + Sync + 'a,
    ) -> Lookup<'a> {
        Lookup {
            slot,
            role,
            edge,
            run: Box::new(run),
        }
    }
}

/// [`Cache::get`] or [`Cache::probe`] of one program.
fn found<X: Experiment, M, Out: crate::program::Outputs, I: Tree<Mirror<Tensor> = M>>(
    mode: Mode,
    cache: &Cache,
    backend: &'static dyn Backend,
    program: &Program<X, M, Out>,
    experiment: &X,
    inputs: &I,
) -> Result<Found> {
    Ok(match mode {
        Mode::Get => Found::Served(cache.get(backend, program, experiment, inputs)?),
        Mode::Probe => Found::Probe(cache.probe(backend, program, experiment, inputs)?),
    })
}

/// Gets every lookup's program, at most `threads` at a time (this thread one of them), the
/// gradient programs first and then the rest in the list's order, the next starting as one
/// ends; with `quiet`, compiles print no progress.
/// Each result is returned with its job number, slot and role, in the lookups' order.
fn get_all(
    lookups: Vec<(usize, Lookup<'_>)>,
    threads: usize,
    quiet: bool,
) -> Vec<(usize, Slot, &'static str, Result<Served>)> {
    let n = lookups.len();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<Served>>>> =
        (0..n).map(|_| std::sync::Mutex::new(None)).collect();
    // The gradient programs first: the slowest to compile, and what the first step waits for.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| lookups[i].1.slot != Slot::Grad);
    let work = || {
        crate::cache::quietly(quiet, || loop {
            let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(&i) = order.get(k) else {
                break;
            };
            let (_, lookup) = &lookups[i];
            let result = (lookup.run)(Mode::Get).and_then(|f| match f {
                Found::Served(s) => Ok(s),
                Found::Probe(_) => Err(no_output()),
            });
            *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
        })
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads.min(n).max(1)).map(|_| s.spawn(work)).collect();
        work();
        // A helper that panicked leaves its lookup without a result: an error below.
        for h in helpers {
            let _ = h.join();
        }
    });
    lookups
        .iter()
        .zip(results)
        .map(|((job, lookup), result)| {
            let result = result
                .into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .unwrap_or_else(|| {
                    Err(Error::Misconfigured {
                        message: "a compiling thread panicked".into(),
                    })
                });
            (*job, lookup.slot, lookup.role, result)
        })
        .collect()
}

/// Which programs of the inventory one batch shape needs looked up.
#[derive(Clone, Debug, Default)]
pub(super) struct Wants {
    grad: bool,
    update: bool,
    eval: bool,
    metrics: Vec<bool>,
}

impl Wants {
    /// How many programs these lookups add to what the handle holds (`nothing_held`: no
    /// update program is held yet); device metrics count with a new evaluation program.
    fn new_programs(&self, nothing_held: bool, metrics: usize) -> usize {
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

/// The inputs a handle's programs are looked up with (values unused: only their types matter).
pub(super) struct ProgramInputs<O: Optimizer> {
    pub(super) mask: Array,
    pub(super) opt: OptimizerStep<O>,
    pub(super) update_inputs: UpdateArgs,
    pub(super) key_sample: GradExtra,
    pub(super) sums: AccumExtra,
}

/// One program of a [`Plan`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PlanEntry {
    /// Its role (`grad`, `update`, `eval`, a metric's name).
    pub role: String,
    /// The bucket edge of its batches (`None`: no buckets, or the update program).
    pub edge: Option<usize>,
    /// What getting it would do.
    pub probe: Probe,
}

/// The preflight of a handle's inventory ([`Nitro::plan`], [`Nitro::plan_buckets`]): what
/// each program's lookup would do, found without compiling.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Plan {
    /// Per program (× bucket), in lookup order.
    pub entries: Vec<PlanEntry>,
}

impl Plan {
    /// How many entries would do `will`.
    pub fn count(&self, will: Will) -> usize {
        self.entries.iter().filter(|e| e.probe.will == will).count()
    }

    /// The expected wait, in milliseconds: the recorded compile (or load) times summed over
    /// the programs that are not hits (an upper bound when they compile concurrently), and how
    /// many of those have no record to go by.
    pub fn expected_ms(&self) -> (f64, usize) {
        let misses = self.entries.iter().filter(|e| e.probe.will != Will::Hit);
        let (mut ms, mut unknown) = (0.0, 0);
        for e in misses {
            match e.probe.expected_ms() {
                Some(t) => ms += t,
                None => unknown += 1,
            }
        }
        (ms, unknown)
    }

    /// The fingerprints of every program, in order: a run's inventory manifest.
    pub fn fingerprints(&self) -> Vec<Digest> {
        self.entries.iter().map(|e| e.probe.fingerprint).collect()
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for e in &self.entries {
            let edge = e.edge.map_or_else(String::new, |n| format!(" [{n}]"));
            write!(
                f,
                "{:<16} {:<22}",
                format!("{}{edge}", e.role),
                e.probe.will.to_string()
            )?;
            if let Some(reason) = &e.probe.reason {
                write!(f, " {reason}")?;
            }
            match (e.probe.will, e.probe.expected_ms(), e.probe.compile_ms) {
                (Will::Hit, _, _) => {}
                (Will::Compile, Some(ms), _) => write!(f, " (~{ms:.0} ms last time)")?,
                (_, Some(ms), Some(c)) => write!(f, " (~{ms:.0} ms; compiled in {c:.0} ms)")?,
                (_, Some(ms), None) => write!(f, " (~{ms:.0} ms last time)")?,
                (_, None, Some(c)) => write!(f, " (saves a {c:.0} ms compile)")?,
                (_, None, None) => write!(f, " (no record of its time)")?,
            }
            writeln!(f)?;
        }
        let (ms, unknown) = self.expected_ms();
        let misses = self.entries.len() - self.count(Will::Hit);
        write!(
            f,
            "{} program(s): {} hit, {} load, {} fetch, {} compile; ",
            self.entries.len(),
            self.count(Will::Hit),
            self.count(Will::Load),
            self.count(Will::Fetch),
            self.count(Will::Compile),
        )?;
        match (misses, unknown) {
            (0, _) => write!(f, "nothing to wait for"),
            (_, 0) => write!(f, "expected wait ~{:.1} s", ms / 1e3),
            (m, u) if u == m => write!(
                f,
                "expected wait unknown (no record of these programs' times)"
            ),
            (_, u) => write!(
                f,
                "expected wait ~{:.1} s plus {u} program(s) without a record",
                ms / 1e3
            ),
        }
    }
}
