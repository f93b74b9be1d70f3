//! The handle's device state: what lives on the devices between steps, and the one invariant
//! that makes its zero-copy leaf views sound.
//!
//! [`DeviceState`] owns the trainable leaves' packed storage (one value per group: a buffer on
//! one device, one per replica, or one shard per device), the per-leaf views over it, the
//! other Device leaves, the optimizer state and step counter, the updates still running, the
//! constants the programs take (learning rate, masks, zero sums) and whether the host copy in
//! the experiment is stale. Every `unsafe` block of the training handle is in this file.
//!
//! **The invariant.** A view reads memory it does not own, and PJRT orders nothing between a
//! view and the buffer it views. So:
//! - views are made only once the update that defined the storage has finished
//!   ([`DeviceState::ready`] waits for it);
//! - a run reads views only through [`Args`], which [`DeviceState::batch_args`] starts with the
//!   views *and* the packed storage (an unused input that makes PJRT order the run after the
//!   update writing that memory and before the update donating it); `Args` can only grow;
//! - an update that does not write in place, and a new layout ([`DeviceState::relayout`]),
//!   drop the views before they could be read again.
//!
//! Nothing outside this file can reach a view or the storage's fields.

use std::borrow::Cow;

use super::values::{self, exec, exec_donating, place, place_groups, to_host, In, Value};
use super::{mask_runs, state_types, LeafInputs, MaskRuns};
use crate::backend::pjrt::{Completion, DeviceBuffer};
use crate::backend::Backend;
use crate::cache::Compiled;
use crate::error::{Error, Result};
use crate::experiment::{Experiment, Role};
use crate::optim::Optimizer;
use crate::program::Packing;
use crate::shard::PartitionSpec;
use crate::tree::{Array, LeafType, Node};

/// How a handle lays out an experiment's Device leaves, from their types alone (nothing is
/// copied): the packing of the trainable leaves, their paths, each group's spec on a mesh, how
/// many leaves are not trainable, and the optimizer's mask over the packing.
#[derive(Clone, Debug)]
pub(super) struct Layout {
    /// How the trainable leaves are packed (one flat array per dtype; per leaf on a mesh).
    pub(super) packing: Packing,
    /// The trainable leaves' paths, in walk order (how checkpoints name optimizer state).
    pub(super) paths: Vec<String>,
    /// On a mesh, the spec of each group of `packing`: how the group, its optimizer slots and
    /// its gradient are split. Empty otherwise.
    pub(super) specs: Vec<PartitionSpec>,
    /// How many Device leaves are not trainable.
    pub(super) frozen: usize,
    /// The optimizer's leaf mask over `packing` (the update program's GraphConst).
    pub(super) masks: MaskRuns,
}

impl Layout {
    /// The layout of `experiment`'s Device leaves on `backend` for `optimizer`. On a
    /// partitioned backend every trainable leaf is a group of its own ([`Packing::per_leaf`])
    /// with its spec ([`crate::shard::Partitioning::leaf_spec`]: a leaf that cannot be split
    /// as asked, or a leaf pattern that matches no leaf, is an error naming it); otherwise they
    /// are packed, and there are no specs.
    pub(super) fn of<E: Experiment, O: Optimizer>(
        experiment: &E,
        optimizer: &O,
        backend: &dyn Backend,
    ) -> Result<Layout> {
        let (mut types, mut paths, mut frozen) = (Vec::new(), Vec::new(), 0usize);
        experiment.visit_device(&mut |field, path, node| {
            if let Node::Leaf(a) = node {
                if field.role == (Role::Device { trainable: true }) {
                    types.push(a.leaf_type());
                    paths.push(path.as_str().to_owned());
                } else {
                    frozen += 1;
                }
            }
        });
        let partitioning = backend.partitioning();
        let packing = Packing::of(experiment, partitioning.is_some());
        let specs = match partitioning {
            None => Vec::new(),
            Some(p) => {
                unused_leaf_pattern::<E>(p, &paths)?;
                paths
                    .iter()
                    .zip(&types)
                    .map(|(path, ty)| p.leaf_spec(path, ty))
                    .collect::<Result<Vec<_>>>()?
            }
        };
        let masks = mask_runs(optimizer, &paths, &packing)?;
        Ok(Layout {
            packing,
            paths,
            specs,
            frozen,
            masks,
        })
    }

    /// One device's share of groups of `types` (a group's spec repeating for each slot), in
    /// bytes.
    pub(super) fn per_device_bytes(&self, backend: &dyn Backend, types: &[LeafType]) -> u64 {
        types
            .iter()
            .enumerate()
            .map(|(g, ty)| {
                let ty = match backend.partitioning() {
                    Some(p) => crate::shard::group_spec(&self.specs, g).shard_type(p.mesh(), ty),
                    None => ty.clone(),
                };
                ty.size_bytes().unwrap_or(u64::MAX)
            })
            .sum()
    }
}

/// Refuses a leaf pattern of the sharding that names no trainable leaf: a spec that would
/// never apply.
fn unused_leaf_pattern<E: Experiment>(
    p: &crate::shard::Partitioning,
    paths: &[String],
) -> Result<()> {
    let unused = p
        .sharding()
        .leaves()
        .iter()
        .find(|(pattern, _)| !paths.iter().any(|q| crate::pattern::path_match(pattern, q)));
    let Some((pattern, spec)) = unused else {
        return Ok(());
    };
    let shown: Vec<&str> = paths.iter().take(8).map(String::as_str).collect();
    Err(Error::Sharding {
        what: format!("the leaf spec `{pattern}`: {spec}"),
        problem: format!(
            "its pattern matches no trainable leaf of {}; the leaves are named like {}{} \
             (`*` matches any run of characters)",
            E::TYPE_PATH,
            shown.join(", "),
            if paths.len() > shown.len() {
                ", …"
            } else {
                ""
            }
        ),
    })
}

/// What lives on the devices between steps (see the [module docs](self)).
pub(super) struct DeviceState {
    layout: Layout,
    /// The trainable leaves one per value, as the per-batch programs take them: views of
    /// `trainable`'s memory (or copies). Declared before `trainable`, so the views go first.
    views: LeafViews,
    /// The trainable leaves, packed: their storage between steps, what the update program
    /// takes and replaces. Placed from the experiment by the first step or evaluation, not
    /// when the handle is made: keying and planning need only the leaves' types.
    trainable: Vec<Value>,
    /// The other Device leaves, in walk order.
    frozen: Vec<Value>,
    /// Whether `trainable` and `frozen` are placed.
    leaves_placed: bool,
    /// The optimizer state: slot by slot, one value per packed group.
    optimizer: Vec<Value>,
    /// The step counter the update program keeps (`i64[]`), then, with dynamic loss scaling,
    /// the scale (`f32[]`) and the finite steps since it moved (`i64[]`).
    counter: Vec<Value>,
    /// Dynamic loss scaling ([`Precision`](super::Precision)), when the handle scales.
    scaling: Option<super::LossScaling>,
    /// Whether `optimizer` and `counter` are placed.
    optimizer_placed: bool,
    /// The end of the last update enqueued (XLA; one per replica), not waited for yet.
    in_flight: Vec<Completion>,
    /// Whether the experiment's trainable leaves are stale (the devices hold newer values).
    host_stale: bool,
    /// The learning rate as placed, and for which value.
    lr: Option<(f64, Value)>,
    /// The all-ones mask of a full batch, placed once per row count.
    full_mask: Option<(usize, Value)>,
    /// Zeroed gradient sums and the factor 1, placed once for gradient accumulation.
    accumulation: Option<(Vec<Value>, Value)>,
    /// A background save waiting for the state as of its request: handed the buffers the next
    /// update replaces, or host copies when something else needs the state first.
    snapshot: Option<std::sync::mpsc::Sender<Snapshot>>,
    /// The pace of the last background save asked for: told to hurry once something may wait
    /// for it ([`hand_over`](Self::hand_over), the drop).
    save_pace: Option<super::pieces::Pace>,
    /// Whether some trainable leaves are still to be created on the devices
    /// ([`Config::initialize`](super::Config::initialize)) at the first placement.
    creating: bool,
    /// How long creating them took.
    created_in: Option<std::time::Duration>,
}

impl DeviceState {
    /// Nothing placed yet, laid out as `layout`; with `creating`, some trainable leaves are to
    /// be created on the devices at the first placement.
    pub(super) fn new(layout: Layout, creating: bool) -> DeviceState {
        DeviceState {
            layout,
            views: LeafViews::default(),
            trainable: Vec::new(),
            frozen: Vec::new(),
            leaves_placed: false,
            optimizer: Vec::new(),
            counter: Vec::new(),
            scaling: None,
            optimizer_placed: false,
            in_flight: Vec::new(),
            host_stale: false,
            lr: None,
            full_mask: None,
            accumulation: None,
            snapshot: None,
            save_pace: None,
            creating,
            created_in: None,
        }
    }

    /// Scales the loss dynamically as `scaling` says (from the handle's precision).
    pub(super) fn set_loss_scaling(&mut self, scaling: Option<super::LossScaling>) {
        self.scaling = scaling;
    }

    /// The counter's arrays for the optimizer's step count `step` and, with loss scaling, the
    /// scale and its finite steps as `scale` has them (the initial scale without).
    fn counter_arrays(&self, step: i64, scale: Option<super::LossScaleState>) -> Vec<Array> {
        let mut arrays = vec![Array::scalar(step)];
        if let Some(scaling) = self.scaling {
            let (value, good) = scale.map_or((scaling.initial, 0), |s| {
                (s.scale, i64::try_from(s.good_steps).unwrap_or(i64::MAX))
            });
            arrays.push(Array::scalar(value));
            arrays.push(Array::scalar(good));
        }
        arrays
    }

    /// The loss scale as placed (the gradient program's `loss_scale` input), when the handle
    /// scales.
    pub(super) fn loss_scale_value(&self) -> Result<Option<&Value>> {
        match self.scaling {
            None => Ok(None),
            Some(_) => self.counter.get(1).map(Some).ok_or_else(unplaced),
        }
    }

    /// Where loss scaling stands (waits for the updates); `None` without scaling or before
    /// the state is placed.
    pub(super) fn loss_scale(&mut self) -> Result<Option<super::LossScaleState>> {
        self.wait()?;
        if self.scaling.is_none() || !self.optimizer_placed {
            return Ok(None);
        }
        let counter = to_host(&self.counter)?;
        let int = |i: usize| {
            counter
                .get(i)
                .and_then(|a| a.as_slice::<i64>().ok()?.first().copied())
                .ok_or_else(unplaced)
        };
        let scale = counter
            .get(1)
            .and_then(|a| a.as_slice::<f32>().ok()?.first().copied())
            .ok_or_else(unplaced)?;
        Ok(Some(super::LossScaleState {
            scale,
            good_steps: int(2)?.max(0) as u64,
            optimizer_steps: int(0)?.max(0) as u64,
        }))
    }

    /// Whether trainable leaves are still to be created on the devices.
    pub(super) fn creating(&self) -> bool {
        self.creating && !self.leaves_placed
    }

    /// No leaf is created on the devices: a resumed handle's come from its checkpoint.
    pub(super) fn forgo_creation(&mut self) {
        self.creating = false;
    }

    /// How long creating the leaves took, once done.
    pub(super) fn creation_time(&self) -> Option<std::time::Duration> {
        self.created_in
    }

    /// Places the trainable leaves with `created` — `(group, value)` for each created on the
    /// devices — and the rest read from the experiment, and the other Device leaves. On a mesh
    /// every group is a leaf and a created value is its storage as made; packed groups are
    /// assembled on the host (one device, or replicas, hold them whole anyway). The
    /// experiment's copy of the created leaves is stale from now on (it is read back from the
    /// devices when asked for), and nothing is created again.
    pub(super) fn place_created<E: Experiment>(
        &mut self,
        backend: &dyn Backend,
        experiment: &E,
        created: Vec<(usize, Value)>,
        started: std::time::Instant,
    ) -> Result<()> {
        let mut created: std::collections::HashMap<usize, Value> = created.into_iter().collect();
        let specs = &self.layout.specs;
        let per_leaf = self.layout.packing.per_leaf && backend.partitioning().is_some();
        let (mut trainable, mut frozen, mut host) = (Vec::new(), Vec::new(), Vec::new());
        let mut failed = None;
        experiment.visit_device(&mut |field, _, node| {
            let Node::Leaf(a) = node else { return };
            if field.role != (Role::Device { trainable: true }) {
                frozen.push(a.clone());
                return;
            }
            let g = trainable.len() + host.len();
            match (created.remove(&g), per_leaf) {
                (Some(v), true) => trainable.push(Ok(v)),
                (None, true) => trainable.push(values::place_group(
                    backend,
                    Cow::Borrowed(a),
                    crate::shard::group_spec(specs, g),
                )),
                (Some(v), false) => match v.to_host() {
                    Ok(a) => host.push(a),
                    Err(e) => failed = Some(e),
                },
                (None, false) => host.push(a.clone()),
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        self.views.release();
        self.trainable = match per_leaf {
            true => trainable.into_iter().collect::<Result<_>>()?,
            false => {
                let packed = self.layout.packing.pack(&host)?;
                drop(host);
                place_groups(backend, packed, specs)?
            }
        };
        self.frozen = place(backend, frozen)?;
        self.leaves_placed = true;
        self.host_stale = true;
        self.creating = false;
        self.created_in = Some(started.elapsed());
        Ok(())
    }

    /// The layout.
    pub(super) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// A new layout (after the experiment changed): the views are dropped and the leaves are
    /// placed again from the experiment at the next use. The optimizer state restarts from
    /// zero when the packing or the specs changed (new types or splits); the step counter
    /// stays.
    pub(super) fn relayout(&mut self, layout: Layout) {
        if layout.packing != self.layout.packing || layout.specs != self.layout.specs {
            self.optimizer.clear();
            self.optimizer_placed = false;
            self.accumulation = None;
        }
        self.views.release();
        self.trainable.clear();
        self.frozen.clear();
        self.leaves_placed = false;
        self.layout = layout;
    }

    /// Places the experiment's Device leaves (the trainable ones packed, or split over the
    /// mesh) and, unless a resume placed them, zeroed optimizer state and the step counter —
    /// once, at the first step or evaluation, and again after [`relayout`](Self::relayout).
    pub(super) fn place<E: Experiment, O: Optimizer>(
        &mut self,
        backend: &dyn Backend,
        experiment: &E,
        optimizer: &O,
    ) -> Result<()> {
        if !self.leaves_placed {
            if self.layout.packing.per_leaf && backend.partitioning().is_some() {
                // Each leaf is a group of its own: split straight from the experiment's leaf,
                // never copied whole on the host first.
                let specs = &self.layout.specs;
                let (mut trainable, mut frozen) = (Vec::new(), Vec::new());
                experiment.visit_device(&mut |field, _, node| {
                    if let Node::Leaf(a) = node {
                        if field.role == (Role::Device { trainable: true }) {
                            let spec = crate::shard::group_spec(specs, trainable.len());
                            trainable.push(values::place_group(backend, Cow::Borrowed(a), spec));
                        } else {
                            frozen.push(a.clone());
                        }
                    }
                });
                self.trainable = trainable.into_iter().collect::<Result<_>>()?;
                self.frozen = place(backend, frozen)?;
            } else {
                let (trainable, frozen) = host_leaves(experiment);
                let packed = self.layout.packing.pack(&trainable)?;
                drop(trainable);
                self.trainable = place_groups(backend, packed, &self.layout.specs)?;
                self.frozen = place(backend, frozen)?;
            }
            self.leaves_placed = true;
        }
        if !self.optimizer_placed {
            let types = state_types(optimizer, &self.layout.packing);
            self.optimizer = values::place_zero_groups(backend, &types, &self.layout.specs)?;
            if self.counter.is_empty() {
                self.counter = place(backend, self.counter_arrays(0, None))?;
            }
            self.optimizer_placed = true;
        }
        Ok(())
    }

    /// Places optimizer state read from a checkpoint (packed, slot by slot) and the step
    /// counter at `step` (with loss scaling, as `scale` has it when the checkpoint recorded
    /// it), in place of zeroed state.
    pub(super) fn restore_optimizer(
        &mut self,
        backend: &dyn Backend,
        packed: Vec<Array>,
        step: i64,
        scale: Option<super::LossScaleState>,
    ) -> Result<()> {
        let optimizer = place_groups(backend, packed, &self.layout.specs)?;
        self.restore_placed_optimizer(backend, optimizer, step, scale)
    }

    /// Takes optimizer state already placed (slot by slot, one value per group, as the layout
    /// splits it) and places the step counter at `step`, in place of zeroed state.
    pub(super) fn restore_placed_optimizer(
        &mut self,
        backend: &dyn Backend,
        optimizer: Vec<Value>,
        step: i64,
        scale: Option<super::LossScaleState>,
    ) -> Result<()> {
        self.optimizer = optimizer;
        // A scaled run counts the optimizer's own steps (skipped ones not among them).
        let step = match (self.scaling, scale) {
            (Some(_), Some(s)) => i64::try_from(s.optimizer_steps).unwrap_or(step),
            _ => step,
        };
        self.counter = place(backend, self.counter_arrays(step, scale))?;
        self.optimizer_placed = true;
        Ok(())
    }

    /// Takes trainable leaves already placed (one value per group, as the layout splits
    /// them) and places the experiment's other Device leaves: the experiment's own trainable
    /// leaves are then stale, and are read back from the devices when asked for.
    pub(super) fn restore_placed_leaves<E: Experiment>(
        &mut self,
        backend: &dyn Backend,
        experiment: &E,
        trainable: Vec<Value>,
    ) -> Result<()> {
        let (_, frozen) = frozen_leaves(experiment);
        self.views.release();
        self.frozen = place(backend, frozen)?;
        self.trainable = trainable;
        self.leaves_placed = true;
        self.host_stale = true;
        Ok(())
    }

    /// The placed trainable groups and optimizer state (slot by slot), once the updates in
    /// flight have finished: what a checkpoint directory is written from.
    pub(super) fn placed(&mut self) -> Result<(&[Value], &[Value])> {
        self.wait()?;
        if !self.leaves_placed || !self.optimizer_placed {
            return Err(unplaced());
        }
        Ok((&self.trainable, &self.optimizer))
    }

    /// Gradient sums (packed, one per group) placed as the trainable leaves are.
    pub(super) fn place_sums(
        &self,
        backend: &dyn Backend,
        packed: Vec<Array>,
    ) -> Result<Vec<Value>> {
        place_groups(backend, packed, &self.layout.specs)
    }

    /// Makes the per-batch programs' leaves ready: views (or copies) of the packed storage,
    /// made once the update that wrote it has finished (its device pointer, or its values,
    /// are read then) and kept while updates write in place. Partitioned programs slice the
    /// leaves out of the storage themselves: nothing to make.
    #[allow(unsafe_code)]
    pub(super) fn ready(&mut self, backend: &dyn Backend, views: bool) -> Result<()> {
        if backend.partitioning().is_some() {
            return Ok(());
        }
        if self.views.values().is_none() {
            self.wait()?;
        }
        // SAFETY: when leaves are made, the update that defines `trainable` has finished
        // (waited just above; the first values are uploads, complete when placed). The views
        // are read only through `Args`, which `batch_args` starts with `trainable` too, so PJRT
        // orders every such run after the update writing that memory and before the update
        // donating it. An update that does not write in place (`update`), and `relayout`, drop
        // the views before they could be read again.
        unsafe {
            self.views
                .make(&self.trainable, &self.layout.packing, views)
        }
        .map(drop)
    }

    /// The arguments of a per-batch program: the trainable leaves (views, made by
    /// [`ready`](Self::ready); none when `partitioned`), the packed storage itself (unused by
    /// the program: it orders the run as a reader of that memory), the other Device leaves,
    /// the batch's leaves and `mask`. The caller appends what else the program takes.
    pub(super) fn batch_args<'a, B: crate::tree::Tree>(
        &'a self,
        partitioned: bool,
        batch: &'a B,
        mask: In<'a>,
    ) -> Result<Args<'a>> {
        let views: &[Value] = match partitioned {
            true => &[],
            false => self.views.values().ok_or_else(unplaced)?,
        };
        let mut args: Vec<In<'a>> = views
            .iter()
            .chain(&self.trainable)
            .chain(&self.frozen)
            .map(In::Keep)
            .collect();
        args.extend(super::leaves(batch).into_iter().map(In::Rows));
        args.push(mask);
        Ok(Args(args))
    }

    /// How many inputs of a per-batch program come before the batch's leaves: those
    /// [`batch_args`](Self::batch_args) puts first.
    pub(super) fn inputs_before_batch(&self, partitioned: bool) -> usize {
        let views = match partitioned {
            true => 0,
            false => self.layout.packing.leaves.len(),
        };
        views + self.layout.packing.groups.len() + self.layout.frozen
    }

    /// Runs the update program `update` on `grads` with learning rate `lr`: the trainable
    /// leaves, the optimizer state and the counter are given (donated where the program
    /// marks them) and replaced by its outputs. The views stay only when every packed buffer
    /// was written in place. The update is enqueued, not waited for.
    pub(super) fn update(
        &mut self,
        backend: &dyn Backend,
        update: &Compiled,
        grads: Vec<Value>,
        lr: f64,
    ) -> Result<()> {
        // The learning rate is placed when it changes, not per step.
        if self.lr.as_ref().is_none_or(|(v, _)| *v != lr) {
            self.lr = Some((lr, place_one(backend, Array::scalar(lr as f32))?));
        }
        let Some((_, lr)) = &self.lr else {
            return Err(unplaced());
        };
        let n = self.trainable.len();
        let trainable = std::mem::take(&mut self.trainable);
        let optimizer = std::mem::take(&mut self.optimizer);
        let counter = std::mem::take(&mut self.counter);
        let mut args: Vec<In<'_>> = Vec::with_capacity(2 * n + optimizer.len() + 2);
        let (mut new, done, in_place) = match self.snapshot.take() {
            // A save asked for the state: this update writes new buffers and leaves these to
            // the save's thread (lent to the update, not donated), whose copy PJRT orders
            // after the update that wrote them: nothing here waits for it.
            Some(save) => {
                args.extend(trainable.iter().map(In::Keep));
                args.extend(optimizer.iter().map(In::Keep));
                args.extend(counter.into_iter().map(In::Give));
                args.extend(grads.iter().map(In::Keep));
                args.push(In::Keep(lr));
                let (new, done, _) = exec_donating(update, args)?;
                // A save that is gone (its thread ended) wants nothing.
                let _ = save.send(Snapshot::Devices {
                    trainable,
                    optimizer,
                });
                (new, done, false)
            }
            None => {
                args.extend(trainable.into_iter().map(In::Give));
                args.extend(optimizer.into_iter().map(In::Give));
                args.extend(counter.into_iter().map(In::Give));
                args.extend(grads.iter().map(In::Keep));
                args.push(In::Keep(lr));
                exec_donating(update, args)?
            }
        };
        let counted = 1 + 2 * usize::from(self.scaling.is_some());
        self.counter = new.split_off(new.len().saturating_sub(counted));
        self.optimizer = new.split_off(n);
        self.trainable = new;
        self.views.after_update(in_place);
        // Only the last update matters: later runs wait for its outputs on the device.
        self.in_flight = done;
        self.host_stale = true;
        Ok(())
    }

    /// Waits until every update enqueued so far has finished; the error of one that failed on
    /// the device surfaces here.
    pub(super) fn wait(&mut self) -> Result<()> {
        for done in std::mem::take(&mut self.in_flight) {
            done.wait()?;
        }
        Ok(())
    }

    /// Asks for the state as it is now, for a background save: the next update hands `save`
    /// the buffers it replaces ([`Snapshot::Devices`]); [`hand_over`](Self::hand_over) sends
    /// host copies instead when something needs the state before an update comes.
    ///
    /// Returns the save's [`Pace`](super::pieces::Pace): the save writes in the background
    /// with pauses that leave the cores to training, and at full speed once anything may wait
    /// for it — [`hand_over`](Self::hand_over) (which every call that waits for a save makes
    /// first) and the state's drop tell it to hurry.
    pub(super) fn request_snapshot(
        &mut self,
        save: std::sync::mpsc::Sender<Snapshot>,
    ) -> super::pieces::Pace {
        let pace = super::pieces::Pace::default();
        if let Some(earlier) = self.save_pace.replace(pace.clone()) {
            earlier.hurry();
        }
        self.snapshot = Some(save);
        pace
    }

    /// Hands a save that asked for the state ([`request_snapshot`](Self::request_snapshot))
    /// host copies of it now (waiting for the updates in flight): before the state changes
    /// other than by an update, and before anything waits for that save.
    /// The save in flight is told to hurry too: whoever calls this is about to wait for it.
    pub(super) fn hand_over(&mut self) -> Result<()> {
        if let Some(pace) = self.save_pace.take() {
            pace.hurry();
        }
        let Some(save) = self.snapshot.take() else {
            return Ok(());
        };
        self.wait()?;
        let copying = std::time::Instant::now();
        let snapshot = Snapshot::Host {
            trainable: to_host(&self.trainable)?,
            optimizer: to_host(&self.optimizer)?,
            copied: copying.elapsed(),
        };
        let _ = save.send(snapshot);
        Ok(())
    }

    /// The trainable leaves as of the last update, unpacked, when the experiment's copy is
    /// stale (then it no longer is); `None` when the experiment holds them already.
    pub(super) fn read_back(&mut self) -> Result<Option<Vec<Array>>> {
        self.wait()?;
        if !self.host_stale || !self.leaves_placed {
            return Ok(None);
        }
        let values = self.layout.packing.unpack(&to_host(&self.trainable)?)?;
        self.host_stale = false;
        Ok(Some(values))
    }

    /// The optimizer state on the host, packed, slot by slot (waits for the updates).
    pub(super) fn optimizer_to_host(&mut self) -> Result<Vec<Array>> {
        self.wait()?;
        to_host(&self.optimizer)
    }

    /// The step count the update program keeps; `None` before it is placed.
    pub(super) fn counter(&mut self) -> Result<Option<i64>> {
        self.wait()?;
        if !self.optimizer_placed {
            return Ok(None);
        }
        let counter = to_host(&self.counter)?;
        let value = counter
            .first()
            .and_then(|a| a.as_slice::<i64>().ok()?.first().copied())
            .ok_or_else(unplaced)?;
        Ok(Some(value))
    }

    /// The trainable leaves as every replica holds them, one unpacked list per device.
    pub(super) fn replica_params(&mut self) -> Result<Vec<Vec<Array>>> {
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
            .map(|packed| self.layout.packing.unpack(packed))
            .collect()
    }

    /// How the per-batch programs got the trainable leaves last: views or copies.
    pub(super) fn leaf_inputs(&self) -> Option<LeafInputs> {
        self.views.how()
    }

    /// Places the all-ones mask of a full batch of `rows` rows, once per row count.
    pub(super) fn place_full_mask(&mut self, backend: &dyn Backend, rows: usize) -> Result<()> {
        if self.full_mask.as_ref().is_none_or(|(n, _)| *n != rows) {
            let mask = values::place_rows(backend, super::mask_of(rows, rows)?)?;
            self.full_mask = Some((rows, mask));
        }
        Ok(())
    }

    /// The all-ones mask [`place_full_mask`](Self::place_full_mask) placed last.
    pub(super) fn full_mask(&self) -> Result<&Value> {
        self.full_mask.as_ref().map(|(_, m)| m).ok_or_else(unplaced)
    }

    /// Places gradient accumulation's zero sums and factor 1, once.
    pub(super) fn place_accumulation(&mut self, backend: &dyn Backend) -> Result<()> {
        if self.accumulation.is_none() {
            let types = self.layout.packing.types();
            let zeros = values::place_zero_groups(backend, &types, &self.layout.specs)?;
            let one = place_one(backend, Array::scalar(1.0f32))?;
            self.accumulation = Some((zeros, one));
        }
        Ok(())
    }

    /// The zero sums and factor 1 of [`place_accumulation`](Self::place_accumulation).
    pub(super) fn accumulation(&self) -> Result<(&[Value], &Value)> {
        self.accumulation
            .as_ref()
            .map(|(z, o)| (z.as_slice(), o))
            .ok_or_else(unplaced)
    }
}

/// The state a background save asked for, on its way to the save's thread: the buffers the next
/// update replaced (kept for the save, not donated), or host copies made at once.
pub(super) enum Snapshot {
    /// Values the devices still hold: the save's thread copies them to the host, its copy
    /// ordered after the update that wrote them.
    Devices {
        trainable: Vec<Value>,
        optimizer: Vec<Value>,
    },
    /// Host copies, packed, made on the training thread ([`DeviceState::hand_over`]), and how
    /// long making them took (part of the save's [`copy`](super::SaveReport::copy)).
    Host {
        trainable: Vec<Array>,
        optimizer: Vec<Array>,
        copied: std::time::Duration,
    },
}

impl Snapshot {
    /// The packed trainable groups and the optimizer state, slot by slot, on the host, and
    /// how long copying them off the devices took, here or on the training thread before.
    pub(super) fn into_host(self) -> Result<(Vec<Array>, Vec<Array>, std::time::Duration)> {
        match self {
            Snapshot::Devices {
                trainable,
                optimizer,
            } => {
                let copying = std::time::Instant::now();
                let host = (to_host(&trainable)?, to_host(&optimizer)?);
                Ok((host.0, host.1, copying.elapsed()))
            }
            Snapshot::Host {
                trainable,
                optimizer,
                copied,
            } => Ok((trainable, optimizer, copied)),
        }
    }
}

/// One array placed where `backend` keeps values.
pub(super) fn place_one(backend: &dyn Backend, a: Array) -> Result<Value> {
    place(backend, vec![a])?.pop().ok_or_else(unplaced)
}

/// The arguments of a run that reads the trainable leaves' views: made only by
/// [`DeviceState::batch_args`] (views and the storage they view, together), and only ever
/// appended to, so no run can take the views without the storage.
pub(super) struct Args<'a>(Vec<In<'a>>);

impl<'a> Args<'a> {
    /// Appends one argument.
    pub(super) fn push(&mut self, arg: In<'a>) {
        self.0.push(arg);
    }

    /// Appends several.
    pub(super) fn extend(&mut self, args: impl IntoIterator<Item = In<'a>>) {
        self.0.extend(args);
    }

    /// Runs `compiled` on them ([`values::exec`]).
    pub(super) fn run(self, compiled: &Compiled) -> Result<(Vec<Value>, Vec<Completion>)> {
        exec(compiled, self.0)
    }
}

/// Copies of `experiment`'s trainable leaves and of its other Device leaves, in walk order.
fn host_leaves<E: Experiment>(experiment: &E) -> (Vec<Array>, Vec<Array>) {
    let (mut trainable, mut frozen) = (Vec::new(), Vec::new());
    experiment.visit_device(&mut |field, _, node| {
        if let Node::Leaf(a) = node {
            if field.role == (Role::Device { trainable: true }) {
                trainable.push(a.clone());
            } else {
                frozen.push(a.clone());
            }
        }
    });
    (trainable, frozen)
}

/// The experiment's Device leaves that are not trainable, with their paths, in walk order.
pub(super) fn frozen_leaves<E: Experiment>(experiment: &E) -> (Vec<String>, Vec<Array>) {
    let (mut paths, mut frozen) = (Vec::new(), Vec::new());
    experiment.visit_device(&mut |field, path, node| {
        if let Node::Leaf(a) = node {
            if field.role != (Role::Device { trainable: true }) {
                paths.push(path.as_str().to_owned());
                frozen.push(a.clone());
            }
        }
    });
    (paths, frozen)
}

pub(super) fn unplaced() -> Error {
    Error::Misconfigured {
        message: "a training handle's device state was read before it was placed".into(),
    }
}

/// The trainable leaves one value per leaf, as the per-batch programs take them, made from the
/// packed storage ([`leaf_values`]).
///
/// Every run that reads the views also takes the packed buffers themselves as (unused) inputs,
/// so PJRT orders it as a reader of that memory: after the update that wrote it, and before an
/// update that donates it. An update that donated every packed buffer wrote the new values in
/// place, so views made before it still show the current values and are kept
/// ([`after_update`](LeafViews::after_update)); otherwise they are dropped and made again.
#[derive(Default)]
struct LeafViews {
    values: Option<Vec<Value>>,
    how: Option<LeafInputs>,
}

impl LeafViews {
    /// The leaves, when made since the last [`release`](LeafViews::release).
    fn values(&self) -> Option<&[Value]> {
        self.values.as_deref()
    }

    /// How they were last made.
    fn how(&self) -> Option<LeafInputs> {
        self.how
    }

    /// The leaves, made from `packed` unless already made.
    ///
    /// # Safety
    /// As [`leaf_values`]: `packed` is defined (its computations finished); every run that
    /// reads the views also takes `packed` as inputs; and [`after_update`] or
    /// [`release`](LeafViews::release) is called when `packed` is replaced.
    ///
    /// [`after_update`]: LeafViews::after_update
    #[allow(unsafe_code)]
    unsafe fn make(
        &mut self,
        packed: &[Value],
        packing: &Packing,
        views: bool,
    ) -> Result<&[Value]> {
        if self.values.is_none() {
            // SAFETY: forwarded from this function's contract.
            let (values, how) = unsafe { leaf_values(packed, packing, views) }?;
            self.values = Some(values);
            self.how = Some(how);
        }
        self.values.as_deref().ok_or_else(unplaced)
    }

    /// After an update replaced the packed storage: views stay when the update donated every
    /// packed buffer (`in_place`: the new values are in the same memory, and the runs that read
    /// them take the new buffers, so PJRT orders them after the update); copies, and views of
    /// memory the update did not write, are dropped.
    fn after_update(&mut self, in_place: bool) {
        if !(in_place && self.how == Some(LeafInputs::Views)) {
            self.release();
        }
    }

    /// Drops the leaves (before the packed storage is replaced by other memory). Runs still
    /// reading them hold the packed buffers as inputs, so PJRT keeps that memory until they end.
    fn release(&mut self) {
        self.values = None;
    }
}

/// The trainable leaves, one value per leaf in walk order, from their packed storage `packed`
/// laid out as `packing`: views of the device buffers when `views` allows and the plugin makes
/// them, copies otherwise; and which of the two they are.
///
/// # Safety
/// A view reads memory it does not own, and PJRT orders nothing between it and `packed`
/// ([`DeviceBuffer::view`]): the computations that define `packed` must have finished; every
/// execution that reads a view must also take the buffer it views as an input (so PJRT orders
/// it after the writes of that memory and before its reuse); and a view must not be read once
/// its memory belongs to no live buffer.
#[allow(unsafe_code)]
unsafe fn leaf_values(
    packed: &[Value],
    packing: &Packing,
    views: bool,
) -> Result<(Vec<Value>, LeafInputs)> {
    let refs: Vec<&Value> = packed.iter().collect();
    fn on_device(v: &Value) -> bool {
        match v {
            Value::Host(_) => false,
            Value::Device(_) => true,
            Value::Replicas(r) | Value::Sharded(r, _) => r.first().is_some_and(on_device),
        }
    }
    let on_device = packed.first().is_some_and(on_device);
    if views && on_device {
        // SAFETY: forwarded from this function's contract.
        match unsafe { leaves_of(&refs, packing, true) } {
            Ok(values) => return Ok((values, LeafInputs::Views)),
            Err(e) => crate::settings::notice_once(
                "leaf views",
                &format!(
                    "the plugin made no view of the packed parameters ({e}); the per-batch \
                     programs get copies of the leaves, made through the host after every update"
                ),
            ),
        }
    }
    // SAFETY: copies only: no view is made.
    let values = unsafe { leaves_of(&refs, packing, false) }?;
    Ok((values, LeafInputs::Copies))
}

/// [`leaf_values`] over one packed value per group (each possibly replicated).
///
/// # Safety
/// As [`leaf_values`] when `views`.
#[allow(unsafe_code)]
unsafe fn leaves_of(packed: &[&Value], packing: &Packing, views: bool) -> Result<Vec<Value>> {
    if let Some(Value::Replicas(first)) = packed.first() {
        let mut per_leaf: Vec<Vec<Value>> = packing.leaves.iter().map(|_| Vec::new()).collect();
        for r in 0..first.len() {
            let parts = packed
                .iter()
                .map(|v| match v {
                    Value::Replicas(rs) => rs.get(r).ok_or_else(values::mixed),
                    _ => Err(values::mixed()),
                })
                .collect::<Result<Vec<_>>>()?;
            // SAFETY: forwarded: replica `r`'s buffers are among `packed`'s.
            let leaves = unsafe { leaves_of(&parts, packing, views) }?;
            for (slot, v) in per_leaf.iter_mut().zip(leaves) {
                slot.push(v);
            }
        }
        return Ok(per_leaf.into_iter().map(Value::Replicas).collect());
    }
    let mut hosts: Vec<Option<Array>> = vec![None; packed.len()];
    let types = packing.leaf_types();
    let mut out = Vec::with_capacity(types.len());
    for ((g, offset, _), ty) in packing.leaves.iter().zip(types) {
        let group = packed.get(*g).ok_or_else(values::mixed)?;
        let n = ty.element_count().ok_or_else(values::mixed)?;
        let copy = |host: &Array| -> Result<Array> {
            let data = host
                .data()
                .range(*offset, offset + n)
                .ok_or_else(values::mixed)?;
            Array::from_data(&ty.dims, data)
        };
        out.push(match group {
            Value::Host(a) => Value::Host(copy(a)?),
            // SAFETY: forwarded from this function's contract.
            Value::Device(b) if views => Value::Device(unsafe { b.view(*offset, ty.clone()) }?),
            Value::Device(b) => {
                if hosts[*g].is_none() {
                    hosts[*g] = Some(b.to_host()?);
                }
                let host = hosts[*g].as_ref().ok_or_else(values::mixed)?;
                Value::Device(DeviceBuffer::upload(&b.client, &copy(host)?, b.device)?)
            }
            // Shards hold pieces of leaves: partitioned programs slice them in the program.
            Value::Replicas(_) | Value::Sharded(..) => return Err(values::mixed()),
        });
    }
    Ok(out)
}

impl Drop for DeviceState {
    /// A save still waiting for the state gets the buffers themselves: the handle no longer
    /// needs them (its saves are waited for after this).
    fn drop(&mut self) {
        if let Some(pace) = self.save_pace.take() {
            pace.hurry();
        }
        if let Some(save) = self.snapshot.take() {
            let _ = save.send(Snapshot::Devices {
                trainable: std::mem::take(&mut self.trainable),
                optimizer: std::mem::take(&mut self.optimizer),
            });
        }
    }
}
