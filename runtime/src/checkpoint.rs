//! Checkpoints in `safetensors` format: Device fields, optimizer state, step and the GraphConst
//! digests, written atomically.
//!
//! ```
//! use nitro::checkpoint::Checkpoint;
//! use nitro::prelude::*;
//!
//! #[experiment]
//! struct Probe {
//!     #[graph_const] hidden: usize,
//!     #[device(trainable)] w: Array,
//! }
//!
//! let exp = Probe { hidden: 4, w: Array::from_vec(&[2], vec![1.0f32, 2.0])? };
//! let momentum = Array::zeros(DType::F32, &[2]);
//! let dir = std::env::temp_dir().join(format!("nitro-doc-ckpt-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("step-10.safetensors");
//! Checkpoint::capture(&exp, &[("m/w", &momentum)], 10)?.save(&path)?;
//!
//! let mut fresh = Probe { hidden: 4, w: Array::zeros(DType::F32, &[2]) };
//! let restored = Checkpoint::load(&path)?.restore_into(&mut fresh)?;
//! assert_eq!((restored.step, fresh.w.as_slice::<f32>()?), (10, &[1.0f32, 2.0][..]));
//! assert_eq!(restored.optimizer[0].0, "m/w");
//!
//! // Another GraphConst value: refused, naming the field.
//! let mut wider = Probe { hidden: 8, w: Array::zeros(DType::F32, &[2]) };
//! let err = Checkpoint::load(&path)?.restore_into(&mut wider).unwrap_err();
//! assert!(err.to_string().contains("`hidden`"), "{err}");
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), nitro::Error>(())
//! ```
//!
//! # The file
//!
//! A standard `safetensors` file, readable by the `safetensors` crate and by Python's
//! `safetensors.safe_open` / `safetensors.numpy.load_file`:
//!
//! - each Device leaf is a tensor named by its path (`layers[0].w`, `lr`);
//! - each optimizer-state array is a tensor named [`OPTIMIZER_PREFIX`] + its name
//!   (`opt/m/layers[0].w`: a training handle names them `<slot>/<leaf path>`);
//! - an open gradient-accumulation window's sums are tensors named [`WINDOW_PREFIX`] + the
//!   trainable leaf's path;
//! - dtypes map to `F32`, `F64`, `I32`, `I64`, `U8`, `BOOL`, `U32`, `BF16` and `F16`; data is
//!   little-endian, row-major; optimizer state of `bf16` and `f16` leaves is `F32` (their update
//!   runs in `f32`: [`crate::optim::state_dtype`]);
//! - the metadata (a string map) holds the keys listed under [`meta`]: the format version, the
//!   experiment's type path and schema digest, the GraphConst digest and every GraphConst
//!   field's digest and (where `Debug`) printed value, the Device signature (JSON), the
//!   optimizer's identity, the step, the epoch position, the accumulation window, and a
//!   checksum.
//!
//! [`Checkpoint::save`] writes atomically and removes temporary files earlier saves left when
//! killed; [`Checkpoint::load`] reads regular files only, as far as their header says.
//!
//! `safetensors` has no checksum of its own, so nitro adds one: blake3 over every metadata
//! entry but the checksum (sorted by key), then every tensor's name, dtype, shape and bytes
//! (sorted by name). [`Checkpoint::load`] verifies it, so a flipped byte anywhere is
//! [`Error::CheckpointCorrupt`], as is a truncated file; bad input is never a panic.
//!
//! # What resume checks
//!
//! [`Checkpoint::restore_into`] refuses, before changing anything, when the experiment type
//! differs ([`Error::CheckpointExperiment`]), when the GraphConst digest differs
//! ([`Error::CheckpointGraphConst`], naming each field whose digest differs, and where its type
//! is `Debug` what differs in its value: `arch.hidden: 128 → 64`), or when a Device leaf's path,
//! dtype or dims differ, or the trees' structure does ([`Error::CheckpointDevice`], naming
//! each). Leaves are restored by path, so a reordered declaration restores correctly. A training
//! handle also checks the optimizer ([`crate::train::Nitro::resume`]). Host fields are not in checkpoints, and the
//! schema digest is recorded but not compared: adding a Host field does not invalidate a
//! checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::Path;

mod shards;

pub(crate) use shards::{optimizer_tensor, window_tensor, DirWriter, Piece};
pub use shards::{CheckpointDir, Format, Saved, CURRENT, DIR_FORMAT, DIR_VERSION, INDEX};

pub use crate::error::FieldChange;
use crate::error::{Error, Result};
use crate::experiment::Experiment;
use crate::files::{self, Opened, Owner};
use crate::hash::{ContentHasher, Digest};
use crate::optim::Optimizer;
use crate::tree::{Array, ArrayData, DType, Node, Signature, SignatureEntry};

/// The checkpoint format version this nitro writes and reads. Version 2 added the optimizer's
/// identity, the epoch position, the accumulation window and the GraphConst values; version 1
/// files are refused by name.
pub const FORMAT_VERSION: u32 = 2;

/// The prefix of optimizer-state tensor names.
pub const OPTIMIZER_PREFIX: &str = "opt/";

/// The prefix of the tensors of an open gradient-accumulation window (its gradient sums, by
/// trainable leaf path).
pub const WINDOW_PREFIX: &str = "acc/";

/// The largest step a checkpoint may hold: the step counter is an `i64` on the device, exact
/// over any run.
pub const MAX_STEP: u64 = i64::MAX as u64;

/// The largest header read (the `safetensors` crate's own bound).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The longest GraphConst value print kept in a checkpoint; longer ones are left out (a
/// refusal then names the field by digest).
const MAX_VALUE_PRINT: usize = 4096;

/// The metadata keys of a nitro checkpoint.
pub mod meta {
    /// Marks the file as a nitro checkpoint; its value is [`FORMAT_VALUE`]. (Not `format`,
    /// which other tools read as the framework that wrote a file.)
    pub const FORMAT: &str = "nitro.format";
    /// The value of [`FORMAT`].
    pub const FORMAT_VALUE: &str = "nitro.checkpoint";
    /// The format version (decimal), [`FORMAT_VERSION`](super::FORMAT_VERSION).
    pub const VERSION: &str = "nitro.version";
    /// The experiment's type path (`Experiment::TYPE_PATH`).
    pub const EXPERIMENT: &str = "nitro.experiment";
    /// The experiment's schema digest (hex).
    pub const SCHEMA_DIGEST: &str = "nitro.schema_digest";
    /// The GraphConst digest (hex).
    pub const GRAPH_CONST_DIGEST: &str = "nitro.graph_const_digest";
    /// The GraphConst field names, comma-separated, in declaration order.
    pub const GRAPH_CONST_FIELDS: &str = "nitro.graph_const_fields";
    /// Prefix of each GraphConst field's digest (hex): `nitro.graph_const.<field>`.
    pub const GRAPH_CONST_FIELD_PREFIX: &str = "nitro.graph_const.";
    /// Prefix of each printable GraphConst field's value (`{:#?}`):
    /// `nitro.graph_const_value.<field>`.
    pub const GRAPH_CONST_VALUE_PREFIX: &str = "nitro.graph_const_value.";
    /// The Device signature, as JSON (entries with `path` and `kind`).
    pub const DEVICE_SIGNATURE: &str = "nitro.device_signature";
    /// The optimizer-state names (without the prefix), as a JSON array of strings, in order.
    pub const OPTIMIZER: &str = "nitro.optimizer";
    /// The optimizer's identity (JSON: name, constants digest, constants as printed, slot
    /// names), when the checkpoint was taken by a training handle.
    pub const OPTIMIZER_IDENTITY: &str = "nitro.optimizer_identity";
    /// The step (decimal).
    pub const STEP: &str = "nitro.step";
    /// The epochs completed (decimal).
    pub const EPOCH: &str = "nitro.epoch";
    /// The batches of the next epoch already trained (decimal).
    pub const EPOCH_BATCHES: &str = "nitro.epoch_batches";
    /// An open gradient-accumulation window (JSON: micro-batches and real rows seen, and the
    /// names of its sum tensors), when there is one.
    pub const WINDOW: &str = "nitro.accumulation_window";
    /// The training handle's random stream (JSON: base key words and draws taken), when
    /// its model draws random numbers.
    pub const RANDOM: &str = "nitro.random";
    /// Where a training handle's dynamic loss scaling stands (JSON: the scale, the finite
    /// steps since it moved, the optimizer's own step count), when it scales.
    pub const LOSS_SCALE: &str = "nitro.loss_scale";
    /// The checksum (hex blake3; see the [module docs](super)).
    pub const CHECKSUM: &str = "nitro.checksum";
}

/// Where a training handle's random stream is: the base key (from the seed) and how many
/// keys it has drawn (one per gradient evaluation). Draw `t` uses the key
/// `threefry2x32(base, (t >> 32, t))` — JAX's `fold_in(base, t)` for `t < 2^32` — so a
/// resumed run continues the same stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RandomStream {
    /// The base key, `u32[2]` words.
    pub key: [u32; 2],
    /// Keys drawn so far.
    pub draws: u64,
}

impl RandomStream {
    /// The stream of `seed` before any draw: the base key is JAX's `PRNGKey(seed)`
    /// ([`crate::trace::random::key`]).
    pub fn new(seed: u64) -> RandomStream {
        RandomStream {
            key: [(seed >> 32) as u32, seed as u32],
            draws: 0,
        }
    }

    /// The key of the next draw (without taking it).
    pub fn next_key(&self) -> [u32; 2] {
        crate::trace::random::threefry2x32_host(
            self.key,
            [(self.draws >> 32) as u32, self.draws as u32],
        )
    }
}

/// What identifies an optimizer in a checkpoint: its name, the digest of its constants, the
/// constants as they print, and its state slots.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OptimizerIdentity {
    /// [`Optimizer::name`] (`adam`, `adamw`, `nesterov`).
    pub name: String,
    /// The content digest of its constants.
    pub digest: Digest,
    /// The optimizer as `Debug` prints it (`Adam { beta1: 0.9, … }`), for messages.
    pub constants: String,
    /// [`Optimizer::slots`], in order.
    pub slots: Vec<String>,
}

impl OptimizerIdentity {
    /// The identity of `optimizer`.
    pub fn of<O: Optimizer>(optimizer: &O) -> OptimizerIdentity {
        OptimizerIdentity {
            name: optimizer.name().to_owned(),
            digest: Digest::of(optimizer),
            constants: format!("{optimizer:?}"),
            slots: optimizer.slots().iter().map(|s| (*s).to_owned()).collect(),
        }
    }
}

/// An open gradient-accumulation window: the gradient sums of the micro-batches since the
/// last optimizer step (by trainable leaf path), how many there were and their real rows.
#[derive(Clone, Debug, PartialEq)]
pub struct AccumulationWindow {
    /// Micro-batches accumulated.
    pub micro_batches: usize,
    /// Their real rows (with weighted steps, the sum of their row weights, rounded).
    pub rows: usize,
    /// The summed gradient of each trainable leaf, by its path.
    pub sums: Vec<(String, Array)>,
}

/// An accumulation window as the metadata lists it: its counts and the names of its sums.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct WindowMeta {
    pub(crate) micro_batches: usize,
    pub(crate) rows: usize,
    pub(crate) sums: Vec<String>,
}

/// What [`Checkpoint::restore_into`] hands back besides the Device values it wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Restored {
    /// The step the checkpoint was taken at.
    pub step: u64,
    /// The optimizer state, by the names it was captured with, in capture order.
    pub optimizer: Vec<(String, Array)>,
    /// The optimizer that kept that state, when recorded.
    pub optimizer_identity: Option<OptimizerIdentity>,
    /// Epochs completed when it was taken.
    pub epoch: u64,
    /// Batches of the next epoch already trained.
    pub epoch_batches: u64,
    /// The open accumulation window, if any.
    pub window: Option<AccumulationWindow>,
    /// The random stream, when the handle's model draws random numbers.
    pub random: Option<RandomStream>,
    /// Where dynamic loss scaling stood, when the handle scaled.
    pub loss_scale: Option<LossScaleState>,
}

/// Where dynamic loss scaling stands ([`Nitro::loss_scale`](crate::train::Nitro::loss_scale)), as a
/// checkpoint records it. It lives here, beside the checkpoint that stores it, and the
/// training handle re-exports it (`nitro::train::LossScaleState`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaleState {
    /// The scale the next step multiplies its loss by.
    pub scale: f32,
    /// Finite steps since the scale last moved.
    pub good_steps: u64,
    /// The optimizer's own step count: the steps applied, which skipped steps do not advance
    /// (the handle's [`steps`](crate::train::Nitro::steps) counts every step taken).
    pub optimizer_steps: u64,
}

/// A snapshot of an experiment's Device values, optimizer state and step, with the identity
/// of the experiment that had them. See the [module docs](self).
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    experiment: String,
    schema_digest: Digest,
    graph_const_digest: Digest,
    graph_const_fields: Vec<(String, Digest)>,
    graph_const_values: Vec<(String, String)>,
    device_signature: Signature,
    device: Vec<(String, Array)>,
    optimizer: Vec<(String, Array)>,
    optimizer_identity: Option<OptimizerIdentity>,
    allow_retuned: bool,
    step: u64,
    epoch: u64,
    epoch_batches: u64,
    window: Option<AccumulationWindow>,
    random: Option<RandomStream>,
    loss_scale: Option<LossScaleState>,
}

impl Checkpoint {
    /// Captures `experiment`'s Device leaves (copied), the optimizer state `optimizer` (by
    /// name, stored under [`OPTIMIZER_PREFIX`]) and `step`.
    ///
    /// [`Error::CheckpointInput`] when an optimizer name is empty or repeats, or the step is
    /// over [`MAX_STEP`].
    pub fn capture<E: Experiment + ?Sized>(
        experiment: &E,
        optimizer: &[(&str, &Array)],
        step: u64,
    ) -> Result<Checkpoint> {
        unique_names(optimizer.iter().map(|(n, _)| *n), "optimizer-state")?;
        let mut checkpoint = Checkpoint::capture_head(experiment, step)?;
        experiment.visit_device(&mut |_, path, node| {
            if let Node::Leaf(a) = node {
                checkpoint
                    .device
                    .push((path.as_str().to_owned(), a.clone()));
            }
        });
        checkpoint.optimizer = optimizer
            .iter()
            .map(|(n, a)| ((*n).to_owned(), (*a).clone()))
            .collect();
        Ok(checkpoint)
    }

    /// What [`capture`](Checkpoint::capture) records of `experiment` but its values: the
    /// identity, the Device signature and `step`, and no arrays (a checkpoint directory's
    /// head, whose values are written shard by shard).
    pub(crate) fn capture_head<E: Experiment + ?Sized>(
        experiment: &E,
        step: u64,
    ) -> Result<Checkpoint> {
        if step > MAX_STEP {
            return Err(Error::CheckpointInput {
                why: format!("step {step} is over the largest step nitro counts, {MAX_STEP}"),
            });
        }
        let mut signature = Signature::default();
        experiment.visit_device(&mut |_, path, node| {
            signature
                .entries
                .push(SignatureEntry::from_node(path, node));
        });
        let fields = experiment.graph_const_field_digests();
        let graph_const_values = experiment
            .graph_const_field_values()
            .into_iter()
            .filter_map(|(n, v)| Some((n.to_owned(), v.filter(|v| v.len() <= MAX_VALUE_PRINT)?)))
            .collect();
        Ok(Checkpoint {
            experiment: E::TYPE_PATH.to_owned(),
            schema_digest: E::SCHEMA_DIGEST,
            graph_const_digest: crate::experiment::combine_graph_const::<E>(&fields),
            graph_const_fields: fields.into_iter().map(|(n, d)| (n.to_owned(), d)).collect(),
            graph_const_values,
            device_signature: signature,
            device: Vec::new(),
            optimizer: Vec::new(),
            optimizer_identity: None,
            allow_retuned: false,
            step,
            epoch: 0,
            epoch_batches: 0,
            window: None,
            random: None,
            loss_scale: None,
        })
    }

    /// Sets the optimizer state, by name (a training handle's checkpoints, assembled from its
    /// packed state). [`Error::CheckpointInput`] when a name is empty or repeats.
    pub(crate) fn set_optimizer_state(&mut self, state: Vec<(String, Array)>) -> Result<()> {
        unique_names(state.iter().map(|(n, _)| n.as_str()), "optimizer-state")?;
        self.optimizer = state;
        Ok(())
    }

    /// Replaces Device leaves by path with `leaves` of the same types (a training handle's
    /// saves: the trained values, copied from the devices after the host's were captured).
    pub(crate) fn replace_device(
        &mut self,
        leaves: impl IntoIterator<Item = (String, Array)>,
    ) -> Result<()> {
        for (path, array) in leaves {
            let slot = self
                .device
                .iter_mut()
                .find(|(p, a)| *p == path && a.leaf_type() == array.leaf_type())
                .ok_or_else(|| Error::CheckpointInput {
                    why: format!(
                        "no Device leaf `{path}` of {} to replace in the checkpoint",
                        array.leaf_type()
                    ),
                })?;
            slot.1 = array;
        }
        Ok(())
    }

    /// Records which optimizer kept the optimizer state (a training handle's checkpoints do):
    /// a resume then refuses another optimizer, other constants or other slots.
    pub fn with_optimizer<O: Optimizer>(mut self, optimizer: &O) -> Checkpoint {
        self.optimizer_identity = Some(OptimizerIdentity::of(optimizer));
        self
    }

    /// Records the position in the data: `epoch` epochs completed and `batches` batches of the
    /// next one trained (a training handle's `fit` continues from there).
    pub fn with_position(mut self, epoch: u64, batches: u64) -> Checkpoint {
        self.epoch = epoch;
        self.epoch_batches = batches;
        self
    }

    /// Records an open gradient-accumulation window (its sums are stored under
    /// [`WINDOW_PREFIX`]). [`Error::CheckpointInput`] when a sum's name is empty or repeats.
    pub fn with_window(mut self, window: AccumulationWindow) -> Result<Checkpoint> {
        unique_names(window.sums.iter().map(|(n, _)| n.as_str()), "window-sum")?;
        self.window = Some(window);
        Ok(self)
    }

    /// Records a training handle's random stream, so a resume continues it.
    pub fn with_random(mut self, stream: RandomStream) -> Checkpoint {
        self.random = Some(stream);
        self
    }

    /// The random stream, when one was recorded.
    pub fn random(&self) -> Option<RandomStream> {
        self.random
    }

    /// Records where a training handle's dynamic loss scaling stands, so a resume continues
    /// with the same scale.
    pub fn with_loss_scale(mut self, state: LossScaleState) -> Checkpoint {
        self.loss_scale = Some(state);
        self
    }

    /// Where loss scaling stood, when it was recorded.
    pub fn loss_scale(&self) -> Option<LossScaleState> {
        self.loss_scale
    }

    /// Lets a training handle resume this checkpoint with an optimizer of the same name and
    /// slots whose constants differ (Adam with another `beta2`, say): the moments are kept and
    /// the new constants apply from the next step. Without it such a resume is refused
    /// ([`Error::CheckpointOptimizer`]) — constants that differ by accident are the usual case.
    pub fn allow_retuned_optimizer(mut self) -> Checkpoint {
        self.allow_retuned = true;
        self
    }

    /// Whether [`allow_retuned_optimizer`](Checkpoint::allow_retuned_optimizer) was called.
    pub fn allows_retuned_optimizer(&self) -> bool {
        self.allow_retuned
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Epochs completed when it was taken.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches of the next epoch trained when it was taken.
    pub fn epoch_batches(&self) -> u64 {
        self.epoch_batches
    }

    /// The experiment type path that wrote it.
    pub fn experiment(&self) -> &str {
        &self.experiment
    }

    /// The experiment's schema digest when it was written.
    pub fn schema_digest(&self) -> Digest {
        self.schema_digest
    }

    /// The GraphConst digest when it was written.
    pub fn graph_const_digest(&self) -> Digest {
        self.graph_const_digest
    }

    /// Each GraphConst field's digest when it was written, in declaration order.
    pub fn graph_const_fields(&self) -> &[(String, Digest)] {
        &self.graph_const_fields
    }

    /// Each printable GraphConst field's value (`{:#?}`) when it was written.
    pub fn graph_const_values(&self) -> &[(String, String)] {
        &self.graph_const_values
    }

    /// The Device signature when it was written.
    pub fn device_signature(&self) -> &Signature {
        &self.device_signature
    }

    /// The Device leaves by path, in walk order.
    pub fn device(&self) -> &[(String, Array)] {
        &self.device
    }

    /// The optimizer state by name (without the prefix), in capture order.
    pub fn optimizer(&self) -> &[(String, Array)] {
        &self.optimizer
    }

    /// The optimizer that kept the state, when recorded.
    pub fn optimizer_identity(&self) -> Option<&OptimizerIdentity> {
        self.optimizer_identity.as_ref()
    }

    /// The open accumulation window, if any.
    pub fn window(&self) -> Option<&AccumulationWindow> {
        self.window.as_ref()
    }

    /// The GraphConst fields whose digests differ from `experiment`'s, in the experiment's
    /// declaration order, then fields only the checkpoint has. Where both sides' values
    /// printed, each change says what differs in them.
    pub fn graph_const_changes<E: Experiment + ?Sized>(&self, experiment: &E) -> Vec<FieldChange> {
        let current = experiment.graph_const_field_digests();
        let values = experiment.graph_const_field_values();
        let stored: HashMap<&str, Digest> = self
            .graph_const_fields
            .iter()
            .map(|(n, d)| (n.as_str(), *d))
            .collect();
        let stored_value = |n: &str| {
            self.graph_const_values
                .iter()
                .find(|(f, _)| f == n)
                .map(|(_, v)| v.as_str())
        };
        let current_value = |n: &str| {
            values
                .iter()
                .find(|(f, _)| *f == n)
                .and_then(|(_, v)| v.as_deref())
        };
        let mut changes: Vec<FieldChange> = current
            .iter()
            .filter(|(n, d)| stored.get(n) != Some(d))
            .map(|(n, d)| FieldChange {
                field: (*n).to_owned(),
                stored: stored.get(n).copied(),
                current: Some(*d),
                diff: match (stored_value(n), current_value(n)) {
                    (Some(old), Some(new)) => value_diff(n, old, new),
                    _ => Vec::new(),
                },
            })
            .collect();
        changes.extend(
            self.graph_const_fields
                .iter()
                .filter(|(n, _)| !current.iter().any(|(c, _)| c == n))
                .map(|(n, d)| FieldChange {
                    field: n.clone(),
                    stored: Some(*d),
                    current: None,
                    diff: Vec::new(),
                }),
        );
        changes
    }

    /// Checks that this checkpoint can be restored into `experiment`: the same experiment
    /// type, GraphConst digest and Device signature (compared by leaf path, so a pure reorder
    /// of fields fits). The errors are those of [`restore_into`](Checkpoint::restore_into).
    pub fn check<E: Experiment + ?Sized>(&self, experiment: &E) -> Result<()> {
        if self.experiment != E::TYPE_PATH {
            return Err(Error::CheckpointExperiment {
                stored: self.experiment.clone(),
                current: E::TYPE_PATH,
            });
        }
        let current = experiment.graph_const_digest();
        if current != self.graph_const_digest {
            return Err(Error::CheckpointGraphConst {
                experiment: E::TYPE_PATH,
                stored: self.graph_const_digest,
                current,
                fields: self.graph_const_changes(experiment),
            });
        }
        let changes = self.device_signature.diff(&experiment.device_signature());
        if !changes.is_empty() {
            return Err(Error::CheckpointDevice { changes });
        }
        Ok(())
    }

    /// Writes every Device leaf back into `experiment`, **by its path** (a field or tree
    /// reordered since the checkpoint was taken gets its own values), and returns the step and
    /// the optimizer state. Checks first (see [`check`](Checkpoint::check)); on an error
    /// nothing is written.
    pub fn restore_into<E: Experiment + ?Sized>(self, experiment: &mut E) -> Result<Restored> {
        self.check(experiment)?;
        let mut by_path: HashMap<String, Array> = self.device.into_iter().collect();
        experiment.visit_device_mut(&mut |_, path, leaf| {
            if let Some(array) = by_path.remove(path.as_str()) {
                *leaf = array;
            }
        });
        Ok(Restored {
            step: self.step,
            optimizer: self.optimizer,
            optimizer_identity: self.optimizer_identity,
            epoch: self.epoch,
            epoch_batches: self.epoch_batches,
            window: self.window,
            random: self.random,
            loss_scale: self.loss_scale,
        })
    }

    /// The checkpoint as the bytes of a `safetensors` file.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let window_len = self.window.as_ref().map_or(0, |w| w.sums.len());
        let mut tensors: Vec<(String, Raw)> =
            Vec::with_capacity(self.device.len() + self.optimizer.len() + window_len);
        for (name, array) in &self.device {
            tensors.push((name.clone(), Raw::of(array)));
        }
        for (name, array) in &self.optimizer {
            tensors.push((format!("{OPTIMIZER_PREFIX}{name}"), Raw::of(array)));
        }
        if let Some(w) = &self.window {
            for (name, array) in &w.sums {
                tensors.push((format!("{WINDOW_PREFIX}{name}"), Raw::of(array)));
            }
        }
        let mut metadata = self.listed_metadata()?;
        let views: Vec<(&str, safetensors::Dtype, &[usize], &[u8])> = tensors
            .iter()
            .map(|(n, r)| (n.as_str(), r.dtype, r.shape.as_slice(), r.bytes.as_slice()))
            .collect();
        let checksum = checksum(&metadata, views);
        metadata.insert(meta::CHECKSUM.to_owned(), checksum.to_string());
        safetensors::serialize(tensors, Some(metadata.into_iter().collect())).map_err(|e| {
            Error::CheckpointInput {
                why: format!("safetensors cannot encode it: {e}"),
            }
        })
    }

    /// [`metadata`](Checkpoint::metadata) listing this checkpoint's own optimizer state and
    /// window.
    pub(crate) fn listed_metadata(&self) -> Result<BTreeMap<String, String>> {
        let window = self.window.as_ref().map(|w| WindowMeta {
            micro_batches: w.micro_batches,
            rows: w.rows,
            sums: w.sums.iter().map(|(n, _)| n.clone()).collect(),
        });
        let opt_names: Vec<&str> = self.optimizer.iter().map(|(n, _)| n.as_str()).collect();
        self.metadata(&opt_names, window.as_ref())
    }

    /// The metadata every format stores (all of [`meta`] but the checksum), with the
    /// optimizer-state names `opt_names` and the accumulation window `window` as given.
    pub(crate) fn metadata(
        &self,
        opt_names: &[&str],
        window: Option<&WindowMeta>,
    ) -> Result<BTreeMap<String, String>> {
        let mut metadata = BTreeMap::new();
        metadata.insert(meta::FORMAT.to_owned(), meta::FORMAT_VALUE.to_owned());
        metadata.insert(meta::VERSION.to_owned(), FORMAT_VERSION.to_string());
        metadata.insert(meta::EXPERIMENT.to_owned(), self.experiment.clone());
        metadata.insert(
            meta::SCHEMA_DIGEST.to_owned(),
            self.schema_digest.to_string(),
        );
        metadata.insert(
            meta::GRAPH_CONST_DIGEST.to_owned(),
            self.graph_const_digest.to_string(),
        );
        let names: Vec<&str> = self
            .graph_const_fields
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        metadata.insert(meta::GRAPH_CONST_FIELDS.to_owned(), names.join(","));
        for (name, digest) in &self.graph_const_fields {
            metadata.insert(
                format!("{}{name}", meta::GRAPH_CONST_FIELD_PREFIX),
                digest.to_string(),
            );
        }
        for (name, value) in &self.graph_const_values {
            metadata.insert(
                format!("{}{name}", meta::GRAPH_CONST_VALUE_PREFIX),
                value.clone(),
            );
        }
        let json = |e: serde_json::Error| Error::CheckpointInput {
            why: format!("cannot encode the metadata: {e}"),
        };
        metadata.insert(
            meta::DEVICE_SIGNATURE.to_owned(),
            serde_json::to_string(&self.device_signature).map_err(json)?,
        );
        metadata.insert(
            meta::OPTIMIZER.to_owned(),
            serde_json::to_string(&opt_names).map_err(json)?,
        );
        if let Some(id) = &self.optimizer_identity {
            metadata.insert(
                meta::OPTIMIZER_IDENTITY.to_owned(),
                serde_json::to_string(id).map_err(json)?,
            );
        }
        if let Some(m) = window {
            metadata.insert(
                meta::WINDOW.to_owned(),
                serde_json::to_string(m).map_err(json)?,
            );
        }
        if let Some(r) = &self.random {
            metadata.insert(
                meta::RANDOM.to_owned(),
                serde_json::to_string(r).map_err(json)?,
            );
        }
        if let Some(l) = &self.loss_scale {
            metadata.insert(
                meta::LOSS_SCALE.to_owned(),
                serde_json::to_string(l).map_err(json)?,
            );
        }
        metadata.insert(meta::STEP.to_owned(), self.step.to_string());
        metadata.insert(meta::EPOCH.to_owned(), self.epoch.to_string());
        metadata.insert(
            meta::EPOCH_BATCHES.to_owned(),
            self.epoch_batches.to_string(),
        );
        Ok(metadata)
    }

    /// Writes the checkpoint to `path` atomically: into a new temporary file beside it
    /// (`<name>.tmp.<pid>.<n>`, mode 0600 on unix), synced, then renamed over `path`, and the
    /// directory synced. A reader sees the old file or the new one, never a part; on an error
    /// no file is left behind. Temporary files that earlier saves into the same directory left
    /// when killed mid-write (`SIGKILL`, a file-size limit) are removed first: those whose
    /// process is gone, and any older than an hour.
    ///
    /// [`Error::CheckpointIo`] (naming `path`, and the temporary file in its message) when the
    /// directory does not exist or cannot be written — a full disk, say.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let no_name = || Error::CheckpointIo {
            path: path.to_path_buf(),
            what: "write to",
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the path names no file; pass a file path such as `run/step-100.safetensors`",
            ),
        };
        let name = path.file_name().ok_or_else(no_name)?.to_owned();
        if name == ".." || name == "." {
            return Err(no_name());
        }
        // Only temporary files of checkpoints (same extension as this one) are swept.
        let bytes = self.to_bytes()?;
        files::save_atomic(path, &bytes, true).map_err(|f| Error::CheckpointIo {
            path: path.to_path_buf(),
            what: match f.step {
                "create" => "create a temporary file beside",
                "write" => "write (through a temporary file beside it)",
                "sync" => "sync (through a temporary file beside it)",
                _ => "rename a temporary file onto",
            },
            source: std::io::Error::new(
                f.source.kind(),
                format!("{} (temporary file {})", f.source, f.tmp.display()),
            ),
        })
    }

    /// Reads a checkpoint written by [`save`](Checkpoint::save) — or, when `path` is a
    /// directory, the checkpoint directory's committed version ([`CheckpointDir`]), every
    /// tensor assembled whole on the host (a training handle on a mesh reads only each
    /// device's ranges instead: [`crate::train::Nitro::resume`]).
    ///
    /// Only a regular file is read (a FIFO, socket or device is refused without
    /// blocking on it), and only as many bytes as its header says it holds: the header's
    /// length is read first and bounded, then the tensors' extent; a file of another length
    /// is refused before its data is read.
    ///
    /// [`Error::CheckpointIo`] when it cannot be opened or read; [`Error::CheckpointCorrupt`]
    /// when it is not a regular file, or is truncated, altered or not a nitro checkpoint of
    /// this format version.
    pub fn load(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let path = path.as_ref();
        if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
            return CheckpointDir::open(path)?.load();
        }
        let origin = format!("`{}`", path.display());
        let io = |what: &'static str| {
            move |source| Error::CheckpointIo {
                path: path.to_path_buf(),
                what,
                source,
            }
        };
        let corrupt = |why: String| Error::CheckpointCorrupt {
            origin: origin.clone(),
            why,
        };
        let (mut file, len, header_len, header) = match open_safetensors(path) {
            Ok(opened) => opened,
            Err(Unreadable::Io(what, e)) => return Err(io(what)(e)),
            Err(Unreadable::Bad(why)) => return Err(corrupt(why)),
        };
        let n = header_len.to_le_bytes();
        let extent = data_extent(&header).map_err(|why| corrupt(format!("its header {why}")))?;
        let expected = 8u64
            .checked_add(header_len)
            .and_then(|n| n.checked_add(extent));
        if expected != Some(len) {
            return Err(corrupt(format!(
                "its header describes {} bytes and the file holds {len}",
                expected.map_or_else(|| "more than 2^64".to_owned(), |n| n.to_string())
            )));
        }
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(usize::try_from(len).unwrap_or(usize::MAX))
            .map_err(|_| io("read")(std::io::Error::from(std::io::ErrorKind::OutOfMemory)))?;
        bytes.extend_from_slice(&n);
        bytes.extend_from_slice(&header);
        drop(header);
        let data = files::read_exactly(&mut file, extent).map_err(io("read"))?;
        bytes.extend_from_slice(&data);
        drop(data);
        Checkpoint::decode(&bytes, &origin)
    }

    /// Reads a checkpoint from the bytes of a file; errors as [`load`](Checkpoint::load).
    pub fn from_bytes(bytes: &[u8]) -> Result<Checkpoint> {
        Checkpoint::decode(bytes, "bytes")
    }

    fn decode(bytes: &[u8], origin: &str) -> Result<Checkpoint> {
        let corrupt = |why: String| Error::CheckpointCorrupt {
            origin: origin.to_owned(),
            why,
        };
        let file = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| corrupt(format!("not a readable safetensors file ({e})")))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| corrupt(format!("not a readable safetensors file ({e})")))?;
        let metadata: BTreeMap<String, String> = header
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        let get = |key: &str| {
            metadata
                .get(key)
                .ok_or_else(|| corrupt(format!("the metadata lacks `{key}`")))
        };
        check_version(&metadata, origin)?;
        let stored_checksum = get(meta::CHECKSUM)?;
        let mut names: Vec<&str> = file.names();
        names.sort_unstable();
        let views = names
            .iter()
            .map(|&n| {
                let t = file
                    .tensor(n)
                    .map_err(|e| corrupt(format!("tensor `{n}` is unreadable ({e})")))?;
                Ok((n, t))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut covered = metadata.clone();
        covered.remove(meta::CHECKSUM);
        let actual = checksum(
            &covered,
            views
                .iter()
                .map(|(n, t)| (*n, t.dtype(), t.shape(), t.data()))
                .collect(),
        );
        if stored_checksum != &actual.to_string() {
            return Err(corrupt(
                "its checksum does not match its contents (a byte was changed)".into(),
            ));
        }
        let tensors: HashMap<&str, &safetensors::tensor::TensorView<'_>> =
            views.iter().map(|(n, t)| (*n, t)).collect();
        let (head, opt_names, window) = Checkpoint::parse_head(&metadata, origin)?;
        head.fill(opt_names, window, origin, names.len(), &mut |name: &str| {
            let view = tensors
                .get(name)
                .ok_or_else(|| corrupt(format!("tensor `{name}` is missing")))?;
            to_array(view).map_err(|why| corrupt(format!("tensor `{name}` {why}")))
        })
    }

    /// The checkpoint `metadata` describes, without its arrays, with the optimizer-state names
    /// and the accumulation window it lists; errors as [`load`](Checkpoint::load).
    pub(crate) fn parse_head(
        metadata: &BTreeMap<String, String>,
        origin: &str,
    ) -> Result<(Checkpoint, Vec<String>, Option<WindowMeta>)> {
        let corrupt = |why: String| Error::CheckpointCorrupt {
            origin: origin.to_owned(),
            why,
        };
        let get = |key: &str| {
            metadata
                .get(key)
                .ok_or_else(|| corrupt(format!("the metadata lacks `{key}`")))
        };
        check_version(metadata, origin)?;
        let digest = |key: &str| -> Result<Digest> {
            get(key)?
                .parse::<Digest>()
                .map_err(|_| corrupt(format!("`{key}` is not a digest")))
        };
        let number = |key: &str| -> Result<u64> {
            get(key)?
                .parse::<u64>()
                .map_err(|_| corrupt(format!("`{key}` is not a number")))
        };
        let field_names = get(meta::GRAPH_CONST_FIELDS)?;
        let graph_const_fields = field_names
            .split(',')
            .filter(|n| !n.is_empty())
            .map(|n| {
                Ok((
                    n.to_owned(),
                    digest(&format!("{}{n}", meta::GRAPH_CONST_FIELD_PREFIX))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let graph_const_values = graph_const_fields
            .iter()
            .filter_map(|(n, _)| {
                let v = metadata.get(&format!("{}{n}", meta::GRAPH_CONST_VALUE_PREFIX))?;
                Some((n.clone(), v.clone()))
            })
            .collect();
        let device_signature: Signature = serde_json::from_str(get(meta::DEVICE_SIGNATURE)?)
            .map_err(|e| corrupt(format!("the Device signature is unreadable ({e})")))?;
        let opt_names: Vec<String> = serde_json::from_str(get(meta::OPTIMIZER)?)
            .map_err(|e| corrupt(format!("the optimizer-state names are unreadable ({e})")))?;
        // A value the metadata may hold as JSON; unreadable, the checkpoint is corrupt.
        fn optional<T: serde::de::DeserializeOwned>(
            metadata: &BTreeMap<String, String>,
            key: &str,
            what: &str,
            corrupt: impl Fn(String) -> Error,
        ) -> Result<Option<T>> {
            metadata
                .get(key)
                .map(|json| {
                    serde_json::from_str::<T>(json)
                        .map_err(|e| corrupt(format!("{what} is unreadable ({e})")))
                })
                .transpose()
        }
        let optimizer_identity: Option<OptimizerIdentity> = optional(
            metadata,
            meta::OPTIMIZER_IDENTITY,
            "the optimizer's identity",
            corrupt,
        )?;
        let window_meta: Option<WindowMeta> =
            optional(metadata, meta::WINDOW, "the accumulation window", corrupt)?;
        let random: Option<RandomStream> =
            optional(metadata, meta::RANDOM, "the random stream", corrupt)?;
        let loss_scale: Option<LossScaleState> =
            optional(metadata, meta::LOSS_SCALE, "the loss scale", corrupt)?;
        let step = number(meta::STEP)?;
        if step > MAX_STEP {
            return Err(corrupt(format!(
                "its step {step} is over the largest step nitro counts, {MAX_STEP}"
            )));
        }
        let epoch = number(meta::EPOCH)?;
        let epoch_batches = number(meta::EPOCH_BATCHES)?;
        let head = Checkpoint {
            experiment: get(meta::EXPERIMENT)?.clone(),
            schema_digest: digest(meta::SCHEMA_DIGEST)?,
            graph_const_digest: digest(meta::GRAPH_CONST_DIGEST)?,
            graph_const_fields,
            graph_const_values,
            device_signature,
            device: Vec::new(),
            optimizer: Vec::new(),
            optimizer_identity,
            allow_retuned: false,
            step,
            epoch,
            epoch_batches,
            window: None,
            random,
            loss_scale,
        };
        Ok((head, opt_names, window_meta))
    }

    /// This head with its arrays, read by name with `array` (`count`: how many tensors the
    /// source holds, all of which must be listed).
    fn fill(
        mut self,
        opt_names: Vec<String>,
        window_meta: Option<WindowMeta>,
        origin: &str,
        count: usize,
        array: &mut dyn FnMut(&str) -> Result<Array>,
    ) -> Result<Checkpoint> {
        let corrupt = |why: String| Error::CheckpointCorrupt {
            origin: origin.to_owned(),
            why,
        };
        let mut device = Vec::new();
        for (path, ty) in self.device_signature.leaves() {
            let a = array(path)?;
            if &a.leaf_type() != ty {
                return Err(corrupt(format!(
                    "tensor `{path}` is {} but the Device signature says {ty}",
                    a.leaf_type()
                )));
            }
            device.push((path.to_owned(), a));
        }
        let mut optimizer = Vec::new();
        for name in opt_names {
            let a = array(&format!("{OPTIMIZER_PREFIX}{name}"))?;
            optimizer.push((name, a));
        }
        let window = match window_meta {
            Some(m) => {
                let mut sums = Vec::new();
                for name in m.sums {
                    let a = array(&format!("{WINDOW_PREFIX}{name}"))?;
                    sums.push((name, a));
                }
                Some(AccumulationWindow {
                    micro_batches: m.micro_batches,
                    rows: m.rows,
                    sums,
                })
            }
            None => None,
        };
        let listed = device.len() + optimizer.len() + window.as_ref().map_or(0, |w| w.sums.len());
        if listed != count {
            return Err(corrupt(
                "it holds tensors that neither the Device signature, the optimizer names nor \
                 the accumulation window list"
                    .into(),
            ));
        }
        self.device = device;
        self.optimizer = optimizer;
        self.window = window;
        Ok(self)
    }
}

/// [`Error::CheckpointCorrupt`] unless `metadata` is a nitro checkpoint's of this format
/// version.
fn check_version(metadata: &BTreeMap<String, String>, origin: &str) -> Result<()> {
    let corrupt = |why: String| Error::CheckpointCorrupt {
        origin: origin.to_owned(),
        why,
    };
    let get = |key: &str| {
        metadata
            .get(key)
            .ok_or_else(|| corrupt(format!("the metadata lacks `{key}`")))
    };
    if get(meta::FORMAT)? != meta::FORMAT_VALUE {
        return Err(corrupt("it is not a nitro checkpoint".into()));
    }
    let version = get(meta::VERSION)?;
    if version != &FORMAT_VERSION.to_string() {
        return Err(corrupt(format!(
            "it has format version {version}, and this nitro reads version {FORMAT_VERSION} \
             (version 1 recorded neither the optimizer's identity nor the epoch; resume it \
             with the nitro that wrote it and take a new checkpoint)"
        )));
    }
    Ok(())
}

/// One tensor of a `safetensors` header, as far as it is well formed: its dtype's name, its
/// shape and its data offsets.
pub(crate) type HeaderTensor<'a> = (Option<&'a str>, Option<Vec<usize>>, Option<(u64, u64)>);

/// The parts of the header entry `t` ([`HeaderTensor`]).
pub(crate) fn header_tensor(t: &serde_json::Value) -> HeaderTensor<'_> {
    let dtype = t.get("dtype").and_then(|d| d.as_str());
    let shape = t.get("shape").and_then(|s| {
        s.as_array()?
            .iter()
            .map(|d| usize::try_from(d.as_u64()?).ok())
            .collect()
    });
    let offsets = t
        .get("data_offsets")
        .and_then(|o| o.as_array())
        .filter(|o| o.len() == 2)
        .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)));
    (dtype, shape, offsets)
}

/// The dtype of nitro's a `safetensors` dtype name stands for ([`st_dtype`]'s inverse).
pub(crate) fn dtype_named(name: &str) -> Option<DType> {
    DType::ALL
        .into_iter()
        .find(|&d| format!("{:?}", st_dtype(d)) == name)
}

/// Why [`open_safetensors`] could not open a file.
pub(crate) enum Unreadable {
    /// The operating system refused: what was being done, and its error.
    Io(&'static str, std::io::Error),
    /// The file is not one: why, completing "the file …" (`it is a directory, not a file`).
    Bad(String),
}

/// The `safetensors` file at `path` opened to its header: the file (positioned after the
/// header), its length, and the header's length and bytes. Only a regular file is opened (never
/// a FIFO, socket or device, which are not waited on), and the header's length is checked
/// against the file and bounded before it is read.
pub(crate) fn open_safetensors(
    path: &Path,
) -> std::result::Result<(std::fs::File, u64, u64, Vec<u8>), Unreadable> {
    let (mut file, len) = match files::open_regular(path, u64::MAX, Owner::Anyone) {
        Ok(Opened::File(f, len)) => (f, len),
        Ok(Opened::Refused(r)) => return Err(Unreadable::Bad(format!("it is {}", r.why()))),
        Err(e) => return Err(Unreadable::Io("open", e)),
    };
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|_| Unreadable::Bad(format!("it holds {len} bytes, too few for a header")))?;
    let header_len = u64::from_le_bytes(n);
    if header_len > MAX_HEADER_BYTES || header_len > len.saturating_sub(8) {
        return Err(Unreadable::Bad(format!(
            "its header claims {header_len} bytes and the file holds {len}"
        )));
    }
    let header =
        files::read_exactly(&mut file, header_len).map_err(|e| Unreadable::Io("read", e))?;
    Ok((file, len, header_len, header))
}

/// [`Error::CheckpointInput`] unless every name is non-empty and used once.
fn unique_names<'a>(names: impl Iterator<Item = &'a str>, what: &str) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for name in names {
        if name.is_empty() {
            return Err(Error::CheckpointInput {
                why: format!("an {what} array has an empty name; name each one (`m/layers[0].w`)"),
            });
        }
        if !seen.insert(name) {
            return Err(Error::CheckpointInput {
                why: format!("{what} name `{name}` is used twice; names must be unique"),
            });
        }
    }
    Ok(())
}

/// The bytes of tensor data a safetensors header describes: the largest end offset of its
/// tensors. The error completes "its header …".
fn data_extent(header: &[u8]) -> std::result::Result<u64, String> {
    let json: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| format!("is not a JSON object ({e})"))?;
    let mut end = 0u64;
    for (name, entry) in &json {
        if name == "__metadata__" {
            continue;
        }
        let offsets = entry
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
            .ok_or_else(|| format!("gives tensor `{name}` no valid data offsets"))?;
        if offsets.0 > offsets.1 {
            return Err(format!("gives tensor `{name}` offsets that run backwards"));
        }
        end = end.max(offsets.1);
    }
    Ok(end)
}

/// What differs between two `{:#?}` prints of a GraphConst field, one line per differing
/// value by its path inside the field (`arch.hidden: 128 → 64`); the whole values when the
/// prints do not parse as nested `Debug` structure; a note when they print alike.
fn value_diff(field: &str, old: &str, new: &str) -> Vec<String> {
    const MAX_LINES: usize = 8;
    let flat = |v: &str| v.split_whitespace().collect::<Vec<_>>().join(" ");
    if old == new {
        return vec![format!(
            "{field} prints identically on both sides ({}), yet its content hash differs: a \
             difference its Debug output does not show",
            clip(&flat(old))
        )];
    }
    let (Some(a), Some(b)) = (debug_leaves(field, old), debug_leaves(field, new)) else {
        return vec![format!(
            "{field}: {} → {}",
            clip(&flat(old)),
            clip(&flat(new))
        )];
    };
    let before: HashMap<&str, &str> = a.iter().map(|(p, v)| (p.as_str(), v.as_str())).collect();
    let after: HashMap<&str, &str> = b.iter().map(|(p, v)| (p.as_str(), v.as_str())).collect();
    let mut lines = Vec::new();
    for (path, value) in &b {
        match before.get(path.as_str()) {
            Some(v) if v == value => {}
            Some(v) => lines.push(format!("{path}: {} → {}", clip(v), clip(value))),
            None => lines.push(format!("{path}: (absent) → {}", clip(value))),
        }
    }
    for (path, value) in &a {
        if !after.contains_key(path.as_str()) {
            lines.push(format!("{path}: {} → (absent)", clip(value)));
        }
    }
    if lines.is_empty() {
        // Same leaves, other structure (a variant's name, say): show the whole values.
        return vec![format!(
            "{field}: {} → {}",
            clip(&flat(old)),
            clip(&flat(new))
        )];
    }
    if lines.len() > MAX_LINES {
        let more = lines.len() - MAX_LINES;
        lines.truncate(MAX_LINES);
        lines.push(format!("and {more} more"));
    }
    lines
}

/// `s`, cut to at most 120 characters.
fn clip(s: &str) -> String {
    const MAX: usize = 120;
    if s.chars().count() <= MAX {
        return s.to_owned();
    }
    let cut: String = s.chars().take(MAX).collect();
    format!("{cut}…")
}

/// The leaf values of a `{:#?}` print with their paths from `root` (`arch.layers[1]`), or
/// `None` when it is not the nested structure pretty `Debug` prints.
fn debug_leaves(root: &str, text: &str) -> Option<Vec<(String, String)>> {
    let lines: Vec<&str> = text.lines().collect();
    let opens = |v: &str| v.ends_with('{') || v.ends_with('[') || v.ends_with('(');
    let closes = |v: &str| matches!(v, "}" | "]" | ")");
    let first = lines.first()?.trim();
    if lines.len() == 1 {
        return Some(vec![(root.to_owned(), first.to_owned())]);
    }
    if !opens(first) {
        return None;
    }
    // (path, next index of an unnamed child)
    let mut stack: Vec<(String, usize)> = vec![(root.to_owned(), 0)];
    let mut out = Vec::new();
    for line in &lines[1..] {
        let t = line.trim();
        let t = t.strip_suffix(',').unwrap_or(t);
        if closes(t) {
            stack.pop();
            continue;
        }
        let top = stack.last_mut()?;
        let (path, value) = match split_key(t) {
            Some((key, value)) => (format!("{}.{key}", top.0), value),
            None => {
                let i = top.1;
                top.1 += 1;
                (format!("{}[{i}]", top.0), t)
            }
        };
        if opens(value) {
            stack.push((path, 0));
        } else {
            out.push((path, value.to_owned()));
        }
    }
    stack.is_empty().then_some(out)
}

/// `key: value` where the key is an identifier or a quoted string (a map's key).
fn split_key(t: &str) -> Option<(&str, &str)> {
    let end = if t.starts_with('"') {
        let mut escaped = false;
        let mut end = None;
        for (i, c) in t.char_indices().skip(1) {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i + 1);
                    break;
                }
                _ => escaped = false,
            }
        }
        end?
    } else {
        t.find(|c: char| !(c.is_alphanumeric() || c == '_'))?
    };
    if end == 0 {
        return None;
    }
    let rest = t[end..].strip_prefix(": ")?;
    Some((&t[..end], rest))
}

/// A tensor's bytes in safetensors' encoding (little-endian, row-major, bools as 0/1 bytes).
pub(crate) struct Raw {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Raw {
    pub(crate) fn of(array: &Array) -> Raw {
        fn le<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
            let mut out = Vec::with_capacity(v.len() * N);
            for &x in v {
                out.extend_from_slice(&f(x));
            }
            out
        }
        let bytes = match array.data() {
            ArrayData::F32(v) => le(v, f32::to_le_bytes),
            ArrayData::F64(v) => le(v, f64::to_le_bytes),
            ArrayData::I32(v) => le(v, i32::to_le_bytes),
            ArrayData::I64(v) => le(v, i64::to_le_bytes),
            ArrayData::U8(v) => v.clone(),
            ArrayData::U32(v) => le(v, u32::to_le_bytes),
            ArrayData::BF16(v) => le(v, |x| x.to_bits().to_le_bytes()),
            ArrayData::F16(v) => le(v, |x| x.to_bits().to_le_bytes()),
            ArrayData::Bool(v) => v.iter().map(|&b| u8::from(b)).collect(),
        };
        Raw {
            dtype: st_dtype(array.dtype()),
            shape: array.dims().to_vec(),
            bytes,
        }
    }
}

impl safetensors::View for Raw {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

pub(crate) fn st_dtype(dtype: DType) -> safetensors::Dtype {
    match dtype {
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::I32 => safetensors::Dtype::I32,
        DType::I64 => safetensors::Dtype::I64,
        DType::U8 => safetensors::Dtype::U8,
        DType::Bool => safetensors::Dtype::BOOL,
        DType::U32 => safetensors::Dtype::U32,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
    }
}

/// Decodes a tensor; the error says what is wrong with it.
pub(crate) fn to_array(
    view: &safetensors::tensor::TensorView<'_>,
) -> std::result::Result<Array, String> {
    fn from_le<T, const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        bytes
            .chunks_exact(N)
            .map(|c| {
                let mut b = [0u8; N];
                b.copy_from_slice(c);
                f(b)
            })
            .collect()
    }
    let bytes = view.data();
    let data = match view.dtype() {
        safetensors::Dtype::F32 => ArrayData::F32(from_le(bytes, f32::from_le_bytes)),
        safetensors::Dtype::F64 => ArrayData::F64(from_le(bytes, f64::from_le_bytes)),
        safetensors::Dtype::I32 => ArrayData::I32(from_le(bytes, i32::from_le_bytes)),
        safetensors::Dtype::I64 => ArrayData::I64(from_le(bytes, i64::from_le_bytes)),
        safetensors::Dtype::U8 => ArrayData::U8(bytes.to_vec()),
        safetensors::Dtype::U32 => ArrayData::U32(from_le(bytes, u32::from_le_bytes)),
        safetensors::Dtype::BF16 => ArrayData::BF16(from_le(bytes, |b| {
            half::bf16::from_bits(u16::from_le_bytes(b))
        })),
        safetensors::Dtype::F16 => ArrayData::F16(from_le(bytes, |b| {
            half::f16::from_bits(u16::from_le_bytes(b))
        })),
        safetensors::Dtype::BOOL => ArrayData::Bool(
            bytes
                .iter()
                .map(|&b| match b {
                    0 => Ok(false),
                    1 => Ok(true),
                    _ => Err(format!("holds the byte {b} in a bool tensor")),
                })
                .collect::<std::result::Result<_, _>>()?,
        ),
        other => return Err(format!("has dtype {other:?}, which nitro does not use")),
    };
    Array::from_data(view.shape(), data).map_err(|e| format!("is not a valid array ({e})"))
}

/// blake3 over the metadata (sorted by key) and the tensors (in the order given: by name).
fn checksum<'a>(
    metadata: &BTreeMap<String, String>,
    tensors: Vec<(&'a str, safetensors::Dtype, &'a [usize], &'a [u8])>,
) -> Digest {
    let mut h = ContentHasher::new();
    h.write_str("nitro.checkpoint.checksum.v1");
    h.write_len(metadata.len());
    for (k, v) in metadata {
        h.write_str(k);
        h.write_str(v);
    }
    let mut tensors = tensors;
    tensors.sort_by(|a, b| a.0.cmp(b.0));
    h.write_len(tensors.len());
    for (name, dtype, shape, bytes) in tensors {
        h.write_str(name);
        h.write_str(&format!("{dtype:?}"));
        h.write_len(shape.len());
        for &d in shape {
            h.write_len(d);
        }
        h.write_len(bytes.len());
        h.write_bytes(bytes);
    }
    h.finish()
}

/// One array as a safetensors file holding one tensor, `value` (a cached stage's stored
/// output).
pub(crate) fn array_to_safetensors(array: &Array) -> Result<Vec<u8>> {
    safetensors::serialize([("value", Raw::of(array))], None).map_err(|e| Error::CheckpointInput {
        why: format!(
            "safetensors cannot encode an array of {}: {e}",
            array.leaf_type()
        ),
    })
}

/// The array [`array_to_safetensors`] wrote; the error says what is wrong with the bytes.
pub(crate) fn array_from_safetensors(bytes: &[u8]) -> std::result::Result<Array, String> {
    let file = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| format!("is not a safetensors file ({e})"))?;
    let view = file
        .tensor("value")
        .map_err(|e| format!("holds no tensor `value` ({e})"))?;
    to_array(&view)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::DType;

    /// The same experiment before and after its Device fields (and a tree's fields) were
    /// reordered in the source: one type path, two declarations.
    mod before {
        #[derive(crate::Tree, Clone, Debug)]
        pub struct Head {
            pub w: crate::Array,
            pub b: crate::Array,
        }

        #[crate::experiment]
        pub struct Pair {
            #[device(trainable)]
            pub a: crate::Array,
            #[device(trainable)]
            pub b: crate::Array,
            #[device(trainable)]
            pub head: Head,
        }
    }

    mod after {
        #[derive(crate::Tree, Clone, Debug)]
        pub struct Head {
            pub b: crate::Array,
            pub w: crate::Array,
        }

        #[crate::experiment]
        pub struct Pair {
            #[device(trainable)]
            pub head: Head,
            #[device(trainable)]
            pub b: crate::Array,
            #[device(trainable)]
            pub a: crate::Array,
        }
    }

    fn values(v: &[f32]) -> Array {
        Array::from_vec(&[v.len()], v.to_vec()).unwrap()
    }

    #[test]
    fn a_reordered_declaration_restores_every_leaf_by_its_path() {
        let old = before::Pair {
            a: values(&[1.0, 2.0]),
            b: values(&[3.0, 4.0, 5.0]),
            head: before::Head {
                w: values(&[6.0]),
                b: values(&[7.0, 8.0]),
            },
        };
        let mut new = after::Pair {
            head: after::Head {
                b: Array::zeros(DType::F32, &[2]),
                w: Array::zeros(DType::F32, &[1]),
            },
            b: Array::zeros(DType::F32, &[3]),
            a: Array::zeros(DType::F32, &[2]),
        };
        let mut checkpoint = Checkpoint::capture(&old, &[], 9).unwrap();
        // What the file says after the source was edited: the same type path (which the
        // GraphConst digest includes).
        checkpoint.experiment = <after::Pair as Experiment>::TYPE_PATH.to_owned();
        checkpoint.graph_const_digest = new.graph_const_digest();
        let checkpoint = Checkpoint::from_bytes(&checkpoint.to_bytes().unwrap()).unwrap();
        checkpoint.restore_into(&mut new).unwrap();
        let read = |a: &Array| a.as_slice::<f32>().unwrap().to_vec();
        assert_eq!(read(&new.a), [1.0, 2.0]);
        assert_eq!(read(&new.b), [3.0, 4.0, 5.0]);
        assert_eq!(read(&new.head.w), [6.0]);
        assert_eq!(read(&new.head.b), [7.0, 8.0]);
    }

    #[derive(Debug)]
    #[allow(dead_code)]
    struct Arch {
        hidden: usize,
        layers: Vec<usize>,
        act: &'static str,
        inner: Inner,
    }

    #[derive(Debug)]
    #[allow(dead_code)]
    struct Inner {
        rate: f64,
    }

    fn print(a: &Arch) -> String {
        format!("{a:#?}")
    }

    #[test]
    fn a_value_diff_names_each_changed_leaf_by_its_path() {
        let old = Arch {
            hidden: 128,
            layers: vec![4, 8],
            act: "tanh",
            inner: Inner { rate: 0.5 },
        };
        let new = Arch {
            hidden: 64,
            layers: vec![4, 9, 2],
            act: "tanh",
            inner: Inner { rate: 0.25 },
        };
        let diff = value_diff("arch", &print(&old), &print(&new));
        assert_eq!(
            diff,
            [
                "arch.hidden: 128 → 64",
                "arch.layers[1]: 8 → 9",
                "arch.layers[2]: (absent) → 2",
                "arch.inner.rate: 0.5 → 0.25",
            ]
        );
        assert_eq!(value_diff("n", "3", "4"), ["n: 3 → 4"]);
        let same = value_diff("x", "1.0", "1.0");
        assert!(same[0].contains("prints identically"), "{same:?}");
    }
}
