//! Checkpoint directories from and into a handle's device state, piece by piece: a save copies
//! each device's shards off it and writes them as that device's part; a resume on a mesh reads
//! each device's ranges of every leaf and uploads them — neither assembles a leaf on the host
//! that no device holds whole ([`crate::checkpoint::CheckpointDir`]).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use super::state::frozen_leaves;
use super::values::place_group_from;
use super::*;
use crate::checkpoint::{
    optimizer_tensor, window_tensor, CheckpointDir, DirWriter, Piece, WindowMeta,
};

/// Where the values of one tensor of a save are.
pub(super) enum Held<'a> {
    /// A value the handle keeps (lent for a save on the training thread).
    Lent(&'a Value),
    /// A value handed over to the save's thread.
    Owned(Value),
    /// A host array: a leaf that is not trainable, or unpacked from a packed group.
    Host(Cow<'a, Array>),
}

impl Held<'_> {
    fn value(&self) -> Option<&Value> {
        match self {
            Held::Lent(v) => Some(v),
            Held::Owned(v) => Some(v),
            Held::Host(_) => None,
        }
    }
}

/// The state a save's thread was handed, as it holds it: the packed trainable groups, the
/// optimizer state (slot by slot), and how long the training thread spent copying them off
/// the devices before handing them over (zero when the buffers themselves were handed over:
/// their copy is then [`write_dir`]'s).
pub(super) struct HeldState {
    pub(super) trainable: Vec<Held<'static>>,
    pub(super) optimizer: Vec<Held<'static>>,
    pub(super) copied: Duration,
}

impl state::Snapshot {
    /// The state as a save's thread holds it ([`HeldState`]).
    pub(super) fn into_held(self) -> HeldState {
        match self {
            state::Snapshot::Devices {
                trainable,
                optimizer,
            } => HeldState {
                trainable: trainable.into_iter().map(Held::Owned).collect(),
                optimizer: optimizer.into_iter().map(Held::Owned).collect(),
                copied: Duration::ZERO,
            },
            state::Snapshot::Host {
                trainable,
                optimizer,
                copied,
            } => {
                let host = |arrays: Vec<Array>| -> Vec<Held<'static>> {
                    arrays
                        .into_iter()
                        .map(|a| Held::Host(Cow::Owned(a)))
                        .collect()
                };
                HeldState {
                    trainable: host(trainable),
                    optimizer: host(optimizer),
                    copied,
                }
            }
        }
    }
}

/// One tensor of a save: its name in the checkpoint and its values.
pub(super) type Source<'a> = (String, Held<'a>);

/// The tensors of a handle's checkpoint directory, named as the single file names them: the
/// other Device leaves (`frozen`: paths and host arrays), the trainable groups, the optimizer
/// state (slot by slot, one value per group) and an accumulation window's sums. On a mesh
/// every group is a leaf, kept as its value; packed groups are copied to the host and
/// unpacked — and how long copying them off the devices took is returned beside.
pub(super) fn sources<'a>(
    layout: &Layout,
    slots: &[&str],
    frozen: (Vec<String>, Vec<Cow<'a, Array>>),
    trainable: Vec<Held<'a>>,
    optimizer: Vec<Held<'a>>,
    sums: Option<Vec<Held<'a>>>,
) -> Result<(Vec<Source<'a>>, Duration)> {
    let (packing, paths) = (&layout.packing, &layout.paths);
    let state_packing = packing.for_state();
    let copy = std::cell::Cell::new(Duration::ZERO);
    let leaves = |held: Vec<Held<'a>>, packing: &Packing| -> Result<Vec<Held<'a>>> {
        if packing.per_leaf {
            return Ok(held);
        }
        let host = held
            .iter()
            .map(|h| match h {
                Held::Host(a) => Ok(a.as_ref().clone()),
                h => {
                    let copying = Instant::now();
                    let a = h.value().ok_or_else(state::unplaced)?.to_host();
                    copy.set(copy.get() + copying.elapsed());
                    a
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(packing
            .unpack(&host)?
            .into_iter()
            .map(|a| Held::Host(Cow::Owned(a)))
            .collect())
    };
    let mut out: Vec<Source<'a>> = frozen
        .0
        .into_iter()
        .zip(frozen.1)
        .map(|(p, a)| (p, Held::Host(a)))
        .collect();
    out.extend(paths.iter().cloned().zip(leaves(trainable, packing)?));
    let groups = packing.groups.len().max(1);
    let mut optimizer = optimizer.into_iter();
    for slot in slots {
        let chunk: Vec<Held<'a>> = optimizer.by_ref().take(groups).collect();
        let names = paths
            .iter()
            .map(|p| optimizer_tensor(&format!("{slot}/{p}")));
        out.extend(names.zip(leaves(chunk, &state_packing)?));
    }
    if let Some(sums) = sums {
        let names = paths.iter().map(|p| window_tensor(p));
        out.extend(names.zip(leaves(sums, packing)?));
    }
    Ok((out, copy.get()))
}

/// How a background save paces its writing: between pieces it pauses `PAUSE_PER_WORK` times
/// as long as the piece before took (copying, serializing, hashing, writing, syncing), so
/// that while training runs the save works about a quarter of the time — until it is told to
/// hurry, when it goes on without pauses.
///
/// Why: writing a checkpoint is not only the save thread's work. Filling the page cache with
/// hundreds of megabytes, and writing it back, keeps the kernel busy on the cores the
/// devices' computations run on (on a CPU plugin, every core), so the steps that overlap an
/// unpaced write ran up to twice as long. Spread out, the same work costs each step a
/// little; a save started every `n` steps still finishes long before the next one is due.
#[derive(Clone, Default)]
pub(super) struct Pace(std::sync::Arc<std::sync::atomic::AtomicBool>);

/// The pause between pieces, as a multiple of the time the piece before took.
const PAUSE_PER_WORK: u32 = 3;

/// The longest sleep between two looks at whether the save should hurry.
const PAUSE_SLICE: Duration = Duration::from_millis(5);

impl Pace {
    /// From now on, no more pauses: something waits for the save.
    pub(super) fn hurry(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    fn hurried(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Pauses after `worked` of work, in slices, until the pause is over or the save is told
    /// to hurry; returns how long it paused.
    fn pause(&self, worked: Duration) -> Duration {
        let started = Instant::now();
        let pause = worked * PAUSE_PER_WORK;
        while !self.hurried() {
            let Some(left) = pause.checked_sub(started.elapsed()) else {
                break;
            };
            std::thread::sleep(left.min(PAUSE_SLICE));
        }
        started.elapsed()
    }
}

/// Writes `sources` as a new version of the checkpoint directory `root` with `metadata`: one
/// part per device, each holding that device's shards (a shard several devices hold is written
/// once, by the first), copied off the device one device at a time; values kept whole go to
/// the first part.
///
/// With a `pace` (a background save), it pauses between pieces as [`Pace`] says; the pauses
/// are returned apart ([`Written::paused`]).
pub(super) fn write_dir(
    root: &Path,
    step: u64,
    metadata: BTreeMap<String, String>,
    sources: Vec<Source<'_>>,
    pace: Option<&Pace>,
) -> Result<Written> {
    let copy = std::cell::Cell::new(Duration::ZERO);
    let paused = std::cell::Cell::new(Duration::ZERO);
    // When the work since the last pause began.
    let working = std::cell::Cell::new(Instant::now());
    let timed = |v: &Value| {
        if let Some(pace) = pace {
            paused.set(paused.get() + pace.pause(working.get().elapsed()));
            working.set(Instant::now());
        }
        let copying = Instant::now();
        let a = v.to_host();
        copy.set(copy.get() + copying.elapsed());
        a
    };
    let parts = sources
        .iter()
        .map(|(_, h)| match h.value() {
            Some(Value::Sharded(shards, _)) => shards.len(),
            _ => 1,
        })
        .max()
        .unwrap_or(1);
    let mut writer = DirWriter::begin(root, step)?;
    let mut written: Vec<HashSet<Vec<usize>>> = vec![HashSet::new(); sources.len()];
    for device in 0..parts {
        let mut pieces: Vec<Piece<'_>> = Vec::new();
        for (i, (name, held)) in sources.iter().enumerate() {
            match held.value() {
                Some(v @ Value::Sharded(shards, layout)) => {
                    let (spec, mesh) = &**layout;
                    let whole = v.leaf_type();
                    let window = spec.window(mesh, &whole.dims, device);
                    let start: Vec<usize> = window.iter().map(|(s, _)| *s).collect();
                    if !written[i].insert(start.clone()) {
                        continue;
                    }
                    let shard = shards.get(device).ok_or_else(state::unplaced)?;
                    let timed = &timed;
                    pieces.push(Piece {
                        name: name.clone(),
                        whole,
                        start,
                        dims: window.iter().map(|(_, l)| *l).collect(),
                        fetch: Box::new(move || timed(shard)),
                    });
                }
                _ if device > 0 => {}
                Some(v) => {
                    let whole = v.leaf_type();
                    let timed = &timed;
                    pieces.push(Piece {
                        name: name.clone(),
                        start: vec![0; whole.dims.len()],
                        dims: whole.dims.clone(),
                        whole,
                        fetch: Box::new(move || timed(v)),
                    });
                }
                None => {
                    if let Held::Host(a) = held {
                        let a: &Array = a;
                        pieces.push(Piece {
                            name: name.clone(),
                            whole: a.leaf_type(),
                            start: vec![0; a.dims().len()],
                            dims: a.dims().to_vec(),
                            fetch: Box::new(move || Ok(a.clone())),
                        });
                    }
                }
            }
        }
        if device == 0 || !pieces.is_empty() {
            writer.write_part(pieces)?;
        }
    }
    let bytes = writer.commit(metadata)?;
    Ok(Written {
        bytes,
        copy: copy.get(),
        paused: paused.get(),
    })
}

/// What [`write_dir`] wrote: the tensors' bytes, the time spent copying them off the devices,
/// and the time it paused to leave the cores to training.
pub(super) struct Written {
    pub(super) bytes: u64,
    pub(super) copy: Duration,
    pub(super) paused: Duration,
}

/// The metadata of a handle's checkpoint directory: `head`'s, listing the optimizer state of
/// `slots` for every trainable leaf and the accumulation window `window` (micro-batches, rows)
/// when there is one.
pub(super) fn metadata(
    head: &Checkpoint,
    paths: &[String],
    slots: &[&str],
    window: Option<(usize, usize)>,
) -> Result<BTreeMap<String, String>> {
    let names: Vec<String> = slots
        .iter()
        .flat_map(|s| paths.iter().map(move |p| format!("{s}/{p}")))
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let window = window.map(|(micro_batches, rows)| WindowMeta {
        micro_batches,
        rows,
        sums: paths.to_vec(),
    });
    head.metadata(&names, window.as_ref())
}

impl<E: Model, O: Optimizer> Nitro<E, O> {
    /// Writes the handle as a checkpoint directory at `path`, on this thread.
    pub(super) fn save_dir(&mut self, path: &Path) -> Result<Written> {
        self.place_state()?;
        let head = self.checkpoint_head(false)?;
        let window = self.progress.window();
        let window_counts = window
            .sums
            .as_ref()
            .map(|_| (window.micro_batches, window.rows.round() as usize));
        let (paths, frozen) = frozen_leaves(&self.experiment);
        let frozen = (paths, frozen.into_iter().map(Cow::Owned).collect());
        let layout = self.state.layout().clone();
        let slots = self.optimizer.slots();
        let metadata = metadata(&head, &layout.paths, slots, window_counts)?;
        let (trainable, optimizer) = self.state.placed()?;
        let sums = self
            .progress
            .window()
            .sums
            .as_ref()
            .map(|s| s.iter().map(Held::Lent).collect());
        let (sources, unpacked) = sources(
            &layout,
            slots,
            frozen,
            trainable.iter().map(Held::Lent).collect(),
            optimizer.iter().map(Held::Lent).collect(),
            sums,
        )?;
        let mut written = write_dir(path, head.step(), metadata, sources, None)?;
        written.copy += unpacked;
        Ok(written)
    }

    /// A handle on a mesh that continues from the checkpoint directory `dir`, each device's
    /// ranges of every leaf read and uploaded to it (the other Device leaves are read whole
    /// into the experiment). Checked as [`Nitro::resume`] checks a checkpoint, before anything
    /// is read.
    pub(super) fn resume_dir(
        mut experiment: E,
        optimizer: O,
        config: Config,
        dir: CheckpointDir,
        backend: &'static dyn Backend,
        cache: &'static Cache,
    ) -> Result<Nitro<E, O>> {
        let head = dir.head();
        head.check(&experiment)?;
        let allow_retuned = dir.allows_retuned_optimizer();
        resume::check_optimizer(head.optimizer_identity(), &optimizer, allow_retuned)?;
        if let Some(w) = dir.window() {
            resume::check_accumulation(&config, w.micro_batches)?;
        }
        let mut failed = None;
        experiment.visit_device_mut(&mut |field, path, leaf| {
            if field.role != (Role::Device { trainable: true }) && failed.is_none() {
                match dir.read_whole(path.as_str()) {
                    Ok(a) => *leaf = a,
                    Err(e) => failed = Some(e),
                }
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        let mut handle = Nitro::with_backend(experiment, optimizer, config, backend, cache)?;
        handle.state.forgo_creation();
        let layout = handle.state.layout().clone();
        let corrupt = |why: String| Error::CheckpointCorrupt {
            origin: format!("`{}`", dir.path().display()),
            why,
        };
        // Every group is one leaf on a mesh: read each as its spec splits it.
        let read = |name: &str, ty: &LeafType, g: usize| -> Result<Value> {
            let stored = dir
                .tensor_type(name)
                .ok_or_else(|| corrupt(format!("it holds no tensor `{name}`")))?;
            if stored != ty {
                return Err(corrupt(format!(
                    "tensor `{name}` is {stored} in it, and this handle's is {ty}"
                )));
            }
            let spec = crate::shard::group_spec(&layout.specs, g);
            place_group_from(backend, ty, spec, |windows| dir.read_windows(name, windows))
        };
        let types = layout.packing.leaf_types();
        let trainable = layout
            .paths
            .iter()
            .zip(&types)
            .enumerate()
            .map(|(g, (path, ty))| read(path, ty, g))
            .collect::<Result<Vec<_>>>()?;
        // The optimizer state: exactly one per slot and trainable leaf.
        let names = resume::match_optimizer_state(
            &handle.optimizer,
            head.optimizer_identity(),
            &layout,
            dir.optimizer_names().iter().map(String::as_str).collect(),
            |name| dir.tensor_type(&optimizer_tensor(name)).cloned(),
        )?;
        let state_types = layout.packing.for_state().leaf_types();
        let optimizer_state = names
            .iter()
            .map(|(name, g)| read(&optimizer_tensor(name), &state_types[*g], *g))
            .collect::<Result<Vec<_>>>()?;
        let sums = match dir.window() {
            Some(w) => Some((
                w.micro_batches,
                w.rows,
                layout
                    .paths
                    .iter()
                    .zip(&types)
                    .enumerate()
                    .map(|(g, (path, ty))| read(&window_tensor(path), ty, g))
                    .collect::<Result<Vec<_>>>()?,
            )),
            None => None,
        };
        let step = resume::device_step(head.step())?;
        handle
            .state
            .restore_placed_leaves(backend, &handle.experiment, trainable)?;
        handle
            .state
            .restore_placed_optimizer(backend, optimizer_state, step, head.loss_scale())?;
        handle.progress.resume(
            head.step(),
            head.epoch(),
            head.epoch_batches(),
            head.random(),
        );
        if let Some((micro_batches, rows, sums)) = sums {
            handle.progress.restore_window(progress::Window {
                sums: Some(sums),
                micro_batches,
                rows: rows as f64,
            });
        }
        Ok(handle)
    }
}

impl<E: Model, O: Optimizer> Nitro<E, O> {
    /// Loads pretrained weights from the `safetensors` file at `path` into the handle's Device
    /// leaves, as [`weights::load_into`](crate::weights::load_into) loads them into an
    /// experiment — names, splits, permutes, casts and presets as `import` says — and refuses,
    /// with the same messages and before anything changes, everything it refuses.
    ///
    /// On a mesh no leaf is read whole unless a device holds it whole: the file's header is
    /// read and every check made from the types alone, then each device's window of each
    /// trainable leaf is read from the ranges of the file that hold it (a positioned read per
    /// run of contiguous bytes), permuted and cast, and uploaded to that device; a window
    /// several devices hold is read once ([`Loaded::read_bytes`](crate::weights::Loaded)
    /// counts what was read). Leaves that are not trainable, and a leaf with a `map` or a
    /// `flatten_order` (which recompute or reorder it whole), are read whole. The new values
    /// replace the handle's when all are placed (for that moment the devices hold both); the
    /// optimizer state and the step count stay. Off a mesh the file is loaded into the
    /// experiment and placed again at the next step.
    ///
    /// Leaves created on the devices ([`Config::initialize`]) are not created once weights
    /// are loaded.
    pub fn load_weights(
        &mut self,
        path: impl AsRef<Path>,
        import: &crate::weights::Import,
    ) -> Result<crate::weights::Loaded> {
        self.state.hand_over()?;
        self.saves.wait()?;
        let path = path.as_ref();
        let layout = self.state.layout().clone();
        if !(layout.packing.per_leaf && self.backend.partitioning().is_some()) {
            self.sync()?;
            let loaded = crate::weights::load_into(&mut self.experiment, path, import)?;
            self.state.forgo_creation();
            let layout = Layout::of(&self.experiment, &self.optimizer, self.backend)?;
            self.state.relayout(layout);
            return Ok(loaded);
        }
        let (mut wanted, mut trainable) = (Vec::new(), Vec::new());
        self.experiment.visit_device(&mut |field, path, node| {
            if let Node::Leaf(a) = node {
                wanted.push((path.as_str().to_owned(), a.leaf_type()));
                trainable.push(field.role == (Role::Device { trainable: true }));
            }
        });
        let header = crate::weights::Header::open(path)?;
        let mut plan = crate::weights::plan_ranges::<E>(header, import, &wanted)?;
        // Every value read and placed before anything changes.
        let (mut values, mut frozen) = (Vec::new(), std::collections::HashMap::new());
        for ((leaf, ty), &t) in wanted.iter().zip(&trainable) {
            if t {
                let spec = crate::shard::group_spec(&layout.specs, values.len());
                let value =
                    place_group_from(self.backend, ty, spec, |windows| plan.read(leaf, windows))?;
                values.push(value);
            } else {
                let whole: Vec<(usize, usize)> = ty.dims.iter().map(|&d| (0, d)).collect();
                let a = plan
                    .read(leaf, &[whole])?
                    .pop()
                    .ok_or_else(state::unplaced)?;
                frozen.insert(leaf.clone(), a);
            }
        }
        let loaded = plan.finish(&wanted);
        self.experiment.visit_device_mut(&mut |field, path, leaf| {
            if field.role != (Role::Device { trainable: true }) {
                if let Some(a) = frozen.remove(path.as_str()) {
                    *leaf = a;
                }
            }
        });
        // The updates in flight finish before the values they write are let go.
        self.state.wait()?;
        self.state.forgo_creation();
        self.state
            .restore_placed_leaves(self.backend, &self.experiment, values)?;
        Ok(loaded)
    }
}
