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
//!   (`opt/m/layers[0].w`);
//! - dtypes map to `F32`, `F64`, `I32`, `I64`, `U8` and `BOOL`; data is little-endian, row-major;
//! - the metadata (a string map) holds the keys listed under [`meta`]: the format version, the
//!   experiment's type path and schema digest, the GraphConst digest and every GraphConst
//!   field's digest, the Device signature (JSON), the step, and a checksum.
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
//! ([`Error::CheckpointGraphConst`], naming each field whose digest differs — the values
//! themselves are not in the file, since a GraphConst need not be `Debug`; compare them in your
//! configuration), or when a Device leaf's path, dtype or dims differ, or the trees' structure
//! does ([`Error::CheckpointDevice`], naming each). Host fields are not in checkpoints, and the
//! schema digest is recorded but not compared: adding a Host field does not invalidate a
//! checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::experiment::Experiment;
use crate::hash::{ContentHasher, Digest};
use crate::tree::{Array, ArrayData, DType, Node, Signature, SignatureEntry};

/// The checkpoint format version this nitro writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The prefix of optimizer-state tensor names.
pub const OPTIMIZER_PREFIX: &str = "opt/";

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
    /// The Device signature, as JSON (entries with `path` and `kind`).
    pub const DEVICE_SIGNATURE: &str = "nitro.device_signature";
    /// The optimizer-state names (without the prefix), as a JSON array of strings, in order.
    pub const OPTIMIZER: &str = "nitro.optimizer";
    /// The step (decimal).
    pub const STEP: &str = "nitro.step";
    /// The checksum (hex blake3; see the [module docs](super)).
    pub const CHECKSUM: &str = "nitro.checksum";
}

/// One GraphConst field whose digest differs between a checkpoint and an experiment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldChange {
    /// The field's name.
    pub field: String,
    /// Its digest in the checkpoint; `None` when the checkpoint has no such field.
    pub stored: Option<Digest>,
    /// Its digest in the experiment; `None` when the experiment has no such field.
    pub current: Option<Digest>,
}

impl fmt::Display for FieldChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.stored, &self.current) {
            (Some(s), Some(c)) => {
                write!(f, "`{}` (digest {} → {})", self.field, s.short(), c.short())
            }
            (Some(_), None) => write!(f, "`{}` (in the checkpoint only)", self.field),
            (None, Some(_)) => write!(f, "`{}` (in the experiment only)", self.field),
            (None, None) => write!(f, "`{}`", self.field),
        }
    }
}

/// The changes as one line, for [`Error::CheckpointGraphConst`].
pub(crate) fn describe_field_changes(changes: &[FieldChange]) -> String {
    if changes.is_empty() {
        return "none by digest (the type path or field order differs)".into();
    }
    changes
        .iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// What [`Checkpoint::restore_into`] hands back besides the Device values it wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Restored {
    /// The step the checkpoint was taken at.
    pub step: u64,
    /// The optimizer state, by the names it was captured with, in capture order.
    pub optimizer: Vec<(String, Array)>,
}

/// A snapshot of an experiment's Device values, optimizer state and step, with the identity
/// of the experiment that had them. See the [module docs](self).
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    experiment: String,
    schema_digest: Digest,
    graph_const_digest: Digest,
    graph_const_fields: Vec<(String, Digest)>,
    device_signature: Signature,
    device: Vec<(String, Array)>,
    optimizer: Vec<(String, Array)>,
    step: u64,
}

impl Checkpoint {
    /// Captures `experiment`'s Device leaves (copied), the optimizer state `optimizer` (by
    /// name, stored under [`OPTIMIZER_PREFIX`]) and `step`.
    ///
    /// [`Error::CheckpointInput`] when an optimizer name is empty or repeats.
    pub fn capture<E: Experiment + ?Sized>(
        experiment: &E,
        optimizer: &[(&str, &Array)],
        step: u64,
    ) -> Result<Checkpoint> {
        for (i, (name, _)) in optimizer.iter().enumerate() {
            if name.is_empty() {
                return Err(Error::CheckpointInput {
                    why: "an optimizer-state array has an empty name; name each one (`m/layers[0].w`)".into(),
                });
            }
            if optimizer[..i].iter().any(|(n, _)| n == name) {
                return Err(Error::CheckpointInput {
                    why: format!(
                        "optimizer-state name `{name}` is used twice; names must be unique"
                    ),
                });
            }
        }
        let mut signature = Signature::default();
        let mut device = Vec::new();
        experiment.visit_device(&mut |_, path, node| {
            signature
                .entries
                .push(SignatureEntry::from_node(path, node));
            if let Node::Leaf(a) = node {
                device.push((path.as_str().to_owned(), a.clone()));
            }
        });
        let fields = experiment.graph_const_field_digests();
        Ok(Checkpoint {
            experiment: E::TYPE_PATH.to_owned(),
            schema_digest: E::SCHEMA_DIGEST,
            graph_const_digest: crate::experiment::combine_graph_const::<E>(&fields),
            graph_const_fields: fields.into_iter().map(|(n, d)| (n.to_owned(), d)).collect(),
            device_signature: signature,
            device,
            optimizer: optimizer
                .iter()
                .map(|(n, a)| ((*n).to_owned(), (*a).clone()))
                .collect(),
            step,
        })
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.step
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

    /// The GraphConst fields whose digests differ from `experiment`'s, in the experiment's
    /// declaration order, then fields only the checkpoint has.
    pub fn graph_const_changes<E: Experiment + ?Sized>(&self, experiment: &E) -> Vec<FieldChange> {
        let current = experiment.graph_const_field_digests();
        let stored: HashMap<&str, Digest> = self
            .graph_const_fields
            .iter()
            .map(|(n, d)| (n.as_str(), *d))
            .collect();
        let mut changes: Vec<FieldChange> = current
            .iter()
            .filter(|(n, d)| stored.get(n) != Some(d))
            .map(|(n, d)| FieldChange {
                field: (*n).to_owned(),
                stored: stored.get(n).copied(),
                current: Some(*d),
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
                }),
        );
        changes
    }

    /// Checks that this checkpoint can be restored into `experiment`: the same experiment
    /// type, GraphConst digest and Device signature. The errors are those of
    /// [`restore_into`](Checkpoint::restore_into).
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

    /// Writes every Device leaf back into `experiment` and returns the step and the optimizer
    /// state. Checks first (see [`check`](Checkpoint::check)); on an error nothing is written.
    pub fn restore_into<E: Experiment + ?Sized>(self, experiment: &mut E) -> Result<Restored> {
        self.check(experiment)?;
        let mut leaves = self.device.into_iter();
        experiment.visit_device_mut(&mut |_, _, leaf| {
            if let Some((_, array)) = leaves.next() {
                *leaf = array;
            }
        });
        Ok(Restored {
            step: self.step,
            optimizer: self.optimizer,
        })
    }

    /// The checkpoint as the bytes of a `safetensors` file.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut tensors: Vec<(String, Raw)> =
            Vec::with_capacity(self.device.len() + self.optimizer.len());
        for (name, array) in &self.device {
            tensors.push((name.clone(), Raw::of(array)));
        }
        for (name, array) in &self.optimizer {
            tensors.push((format!("{OPTIMIZER_PREFIX}{name}"), Raw::of(array)));
        }
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
        let json = |e: serde_json::Error| Error::CheckpointInput {
            why: format!("cannot encode the metadata: {e}"),
        };
        metadata.insert(
            meta::DEVICE_SIGNATURE.to_owned(),
            serde_json::to_string(&self.device_signature).map_err(json)?,
        );
        let opt_names: Vec<&str> = self.optimizer.iter().map(|(n, _)| n.as_str()).collect();
        metadata.insert(
            meta::OPTIMIZER.to_owned(),
            serde_json::to_string(&opt_names).map_err(json)?,
        );
        metadata.insert(meta::STEP.to_owned(), self.step.to_string());
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

    /// Writes the checkpoint to `path` atomically: into a new temporary file beside it (mode
    /// 0600 on unix), synced, then renamed over `path`, and the directory synced. A reader sees
    /// the old file or the new one, never a part; on an error no file is left behind.
    ///
    /// [`Error::CheckpointIo`] when the directory does not exist or cannot be written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        write_atomic(path.as_ref(), &self.to_bytes()?)
    }

    /// Reads a checkpoint written by [`save`](Checkpoint::save).
    ///
    /// [`Error::CheckpointIo`] when it cannot be read; [`Error::CheckpointCorrupt`] when it is
    /// truncated, altered or not a nitro checkpoint of this format version.
    pub fn load(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::CheckpointIo {
            path: path.to_path_buf(),
            what: "read",
            source,
        })?;
        Checkpoint::decode(&bytes, &format!("`{}`", path.display()))
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
        if get(meta::FORMAT)? != meta::FORMAT_VALUE {
            return Err(corrupt("it is not a nitro checkpoint".into()));
        }
        let version = get(meta::VERSION)?;
        if version != &FORMAT_VERSION.to_string() {
            return Err(corrupt(format!(
                "it has format version {version}, and this nitro reads version {FORMAT_VERSION}"
            )));
        }
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
        let digest = |key: &str| -> Result<Digest> {
            get(key)?
                .parse::<Digest>()
                .map_err(|_| corrupt(format!("`{key}` is not a digest")))
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
        let device_signature: Signature = serde_json::from_str(get(meta::DEVICE_SIGNATURE)?)
            .map_err(|e| corrupt(format!("the Device signature is unreadable ({e})")))?;
        let opt_names: Vec<String> = serde_json::from_str(get(meta::OPTIMIZER)?)
            .map_err(|e| corrupt(format!("the optimizer-state names are unreadable ({e})")))?;
        let step = get(meta::STEP)?
            .parse::<u64>()
            .map_err(|_| corrupt("the step is not a number".into()))?;
        let tensors: HashMap<&str, &safetensors::tensor::TensorView<'_>> =
            views.iter().map(|(n, t)| (*n, t)).collect();
        let array = |name: &str| -> Result<Array> {
            let view = tensors
                .get(name)
                .ok_or_else(|| corrupt(format!("tensor `{name}` is missing")))?;
            to_array(view).map_err(|why| corrupt(format!("tensor `{name}` {why}")))
        };
        let mut device = Vec::new();
        for (path, ty) in device_signature.leaves() {
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
        if device.len() + optimizer.len() != names.len() {
            return Err(corrupt(
                "it holds tensors that neither the Device signature nor the optimizer names list"
                    .into(),
            ));
        }
        Ok(Checkpoint {
            experiment: get(meta::EXPERIMENT)?.clone(),
            schema_digest: digest(meta::SCHEMA_DIGEST)?,
            graph_const_digest: digest(meta::GRAPH_CONST_DIGEST)?,
            graph_const_fields,
            device_signature,
            device,
            optimizer,
            step,
        })
    }
}

/// A tensor's bytes in safetensors' encoding (little-endian, row-major, bools as 0/1 bytes).
struct Raw {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Raw {
    fn of(array: &Array) -> Raw {
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

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |path: &Path, what: &'static str| {
        let path = path.to_path_buf();
        move |source| Error::CheckpointIo { path, what, source }
    };
    let name = path
        .file_name()
        .ok_or_else(|| Error::CheckpointIo {
            path: path.to_path_buf(),
            what: "write to",
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the path names no file; pass a file path such as `run/step-100.safetensors`",
            ),
        })?
        .to_string_lossy()
        .into_owned();
    let dir: PathBuf = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp-{}-{n}", std::process::id()));
    let result = (|| {
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(&tmp).map_err(io(&tmp, "create"))?;
        file.write_all(bytes).map_err(io(&tmp, "write"))?;
        file.sync_all().map_err(io(&tmp, "sync"))?;
        drop(file);
        std::fs::rename(&tmp, path).map_err(io(path, "rename the temporary file onto"))?;
        // Make the rename itself durable (directories can be opened and synced on unix).
        #[cfg(unix)]
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
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
