//! Checkpoints of a handle and resuming from them.

use super::*;
use crate::checkpoint::Saved;

/// Refuses to resume state kept by another optimizer than `optimizer`: another name or other
/// slots always, other constants unless `allow_retuned`.
pub(super) fn check_optimizer<O: Optimizer>(
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

/// The optimizer state `packed` (slot by slot, one array per group of `packing`) leaf by leaf,
/// named `<slot>/<leaf path>` as checkpoints name it.
pub(super) fn named_state(
    packing: &Packing,
    paths: &[String],
    slots: &[&str],
    packed: &[Array],
) -> Result<Vec<(String, Array)>> {
    let groups = packing.groups.len();
    let state_packing = packing.for_state();
    let mut state = Vec::new();
    for slot in packed.chunks(groups.max(1)) {
        state.extend(state_packing.unpack(slot)?);
    }
    let names = slots
        .iter()
        .flat_map(|slot| paths.iter().map(move |p| format!("{slot}/{p}")));
    Ok(names.zip(state).collect())
}

/// The optimizer state a checkpoint lists (`listed`, with the stored type of each by
/// `stored_type`) matched against what `optimizer` keeps for the trainable leaves of `layout`:
/// the name (`<slot>/<leaf path>`) and group of each, slot by slot. Refused
/// ([`Error::CheckpointOptimizer`], naming both optimizers) when one is missing, of another
/// type than its leaf's state, or left over.
pub(super) fn match_optimizer_state<O: Optimizer>(
    optimizer: &O,
    stored: Option<&crate::checkpoint::OptimizerIdentity>,
    layout: &Layout,
    mut listed: std::collections::HashSet<&str>,
    stored_type: impl Fn(&str) -> Option<LeafType>,
) -> Result<Vec<(String, usize)>> {
    let current = crate::checkpoint::OptimizerIdentity::of(optimizer);
    let refuse = |why: String| Error::CheckpointOptimizer {
        stored: stored.map_or_else(|| "unrecorded".to_owned(), |i| i.constants.clone()),
        current: current.constants.clone(),
        why,
        retunable: false,
    };
    // Optimizer state is of each leaf's state dtype (f32 for half-precision leaves).
    let types = layout.packing.for_state().leaf_types();
    let mut names = Vec::new();
    for slot in optimizer.slots() {
        for (g, (path, ty)) in layout.paths.iter().zip(&types).enumerate() {
            let name = format!("{slot}/{path}");
            if !listed.remove(name.as_str()) {
                return Err(refuse(format!(
                    "the checkpoint holds no optimizer state `{name}` for trainable leaf \
                     `{path}`"
                )));
            }
            if let Some(stored) = stored_type(&name).filter(|t| t != ty) {
                return Err(refuse(format!(
                    "optimizer state `{name}` is {stored} in the checkpoint, and the state of \
                     trainable leaf `{path}` is {ty}"
                )));
            }
            names.push((name, g));
        }
    }
    if let Some(extra) = listed.iter().min() {
        return Err(refuse(format!(
            "the checkpoint holds optimizer state `{extra}`, which no slot of this optimizer \
             and no trainable leaf names"
        )));
    }
    Ok(names)
}

/// The step counter the update program keeps for a checkpoint's `step` (an `i64`).
pub(super) fn device_step(step: u64) -> Result<i64> {
    i64::try_from(step).map_err(|_| Error::CheckpointCorrupt {
        origin: "the checkpoint".into(),
        why: format!(
            "its step {step} is over the largest step nitro counts, {}",
            crate::checkpoint::MAX_STEP
        ),
    })
}

/// Refuses to resume an accumulation window of `micro_batches` unless `config` accumulates
/// more micro-batches than that.
pub(super) fn check_accumulation(config: &Config, micro_batches: usize) -> Result<()> {
    if config.accum <= 1 || micro_batches >= config.accum {
        return Err(Error::InvalidSetting {
            variable: "Config::accum",
            value: config.accum.to_string(),
            expected: format!(
                "more than the {micro_batches} micro-batches of the accumulation window the \
                 checkpoint was taken in: resume it with the accumulation it was trained with"
            ),
        });
    }
    Ok(())
}

impl<E: Model, O: Optimizer> Nitro<E, O> {
    /// A checkpoint of the experiment's Device leaves as the experiment holds them (with
    /// `values`; only their signature without), with the optimizer's identity, the step, the
    /// position in the data and the random stream — all but the optimizer state and an
    /// accumulation window. With dynamic loss scaling it records where the scale stands,
    /// which waits for the updates in flight.
    pub(super) fn checkpoint_head(&mut self, values: bool) -> Result<Checkpoint> {
        let loss_scale = self.state.loss_scale()?;
        let progress = &self.progress;
        let checkpoint = match values {
            true => Checkpoint::capture(&self.experiment, &[], progress.step())?,
            false => Checkpoint::capture_head(&self.experiment, progress.step())?,
        };
        let mut checkpoint = checkpoint
            .with_optimizer(&self.optimizer)
            .with_position(progress.epoch(), progress.epoch_batches());
        if E::RANDOM {
            checkpoint = checkpoint.with_random(progress.random());
        }
        if let Some(state) = loss_scale {
            checkpoint = checkpoint.with_loss_scale(state);
        }
        Ok(checkpoint)
    }

    /// A checkpoint of the experiment's Device leaves (the trained ones as of the last step),
    /// the optimizer state (named `<slot>/<leaf path>`: `m/layers[0].w`), the optimizer's
    /// identity, the step count, the position in the data (epochs completed, batches of the
    /// next), and an open gradient-accumulation window (its sums and counts), so that a resume
    /// continues exactly; write it with [`Checkpoint::save`].
    pub fn checkpoint(&mut self) -> Result<Checkpoint> {
        self.state.hand_over()?;
        self.saves.check()?;
        self.place_state()?;
        self.sync()?;
        let packed = self.state.optimizer_to_host()?;
        let mut checkpoint = self.checkpoint_head(true)?;
        let layout = self.state.layout();
        let state = named_state(
            &layout.packing,
            &layout.paths,
            self.optimizer.slots(),
            &packed,
        )?;
        checkpoint.set_optimizer_state(state)?;
        let (window, paths) = (self.progress.window(), &layout.paths);
        if let Some(sums) = &window.sums {
            let sums = layout.packing.unpack(&to_host(sums)?)?;
            checkpoint = checkpoint.with_window(crate::checkpoint::AccumulationWindow {
                micro_batches: window.micro_batches,
                rows: window.rows.round() as usize,
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
    ///
    /// `checkpoint` is a [`Checkpoint`] in memory or a checkpoint directory
    /// ([`CheckpointDir`](crate::checkpoint::CheckpointDir)); [`Saved::open`] opens either
    /// from a path. On a mesh a directory's values are read range by range, each device's
    /// shard of a leaf and no more, whatever mesh wrote it; elsewhere they are read whole.
    pub fn resume(
        experiment: E,
        optimizer: O,
        config: Config,
        checkpoint: impl Into<Saved>,
    ) -> Result<Nitro<E, O>> {
        let backend = backend_for(&config)?;
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
        experiment: E,
        optimizer: O,
        config: Config,
        checkpoint: impl Into<Saved>,
        backend: &'static dyn Backend,
        cache: &'static Cache,
    ) -> Result<Nitro<E, O>> {
        let checkpoint = match checkpoint.into() {
            Saved::Whole(c) => c,
            Saved::Directory(dir) if backend.partitioning().is_some() => {
                return Nitro::resume_dir(experiment, optimizer, config, dir, backend, cache);
            }
            Saved::Directory(dir) => dir.load()?,
        };
        Nitro::resume_whole(experiment, optimizer, config, checkpoint, backend, cache)
    }

    /// [`resume_with`](Nitro::resume_with) from a checkpoint in memory.
    fn resume_whole(
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
        handle.state.forgo_creation();
        // Optimizer state is of each leaf's state dtype (f32 for half-precision leaves).
        let layout = handle.state.layout().clone();
        let state_packing = layout.packing.for_state();
        let types = state_packing.leaf_types();
        let mut by_name: std::collections::HashMap<String, Array> =
            restored.optimizer.into_iter().collect();
        let names = match_optimizer_state(
            &handle.optimizer,
            restored.optimizer_identity.as_ref(),
            &layout,
            by_name.keys().map(String::as_str).collect(),
            |name| by_name.get(name).map(Array::leaf_type),
        )?;
        let mut packed = Vec::new();
        for slot in names.chunks(layout.paths.len().max(1)) {
            let leaves: Vec<Array> = slot
                .iter()
                .filter_map(|(name, _)| by_name.remove(name))
                .collect();
            packed.extend(state_packing.pack(&leaves)?);
        }
        let step = device_step(restored.step)?;
        handle
            .state
            .restore_optimizer(backend, packed, step, restored.loss_scale)?;
        handle.progress.resume(
            restored.step,
            restored.epoch,
            restored.epoch_batches,
            restored.random,
        );
        if let Some(w) = restored.window {
            check_accumulation(&handle.config, w.micro_batches)?;
            let mut sums: std::collections::HashMap<String, Array> = w.sums.into_iter().collect();
            let mut leaves = Vec::with_capacity(types.len());
            for (path, ty) in layout.paths.iter().zip(&types) {
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
            let sums = handle
                .state
                .place_sums(backend, layout.packing.pack(&leaves)?)?;
            handle.progress.restore_window(progress::Window {
                sums: Some(sums),
                micro_batches: w.micro_batches,
                rows: w.rows as f64,
            });
        }
        Ok(handle)
    }
}
