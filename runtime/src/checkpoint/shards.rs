//! Checkpoint directories: a checkpoint written piece by piece — each device's shards into a
//! file of its own — and read back range by range, so neither side ever holds a whole leaf
//! that no device held whole. See [`CheckpointDir`] for the layout.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{st_dtype, to_array, Checkpoint, Raw, WindowMeta};
use super::{OPTIMIZER_PREFIX, WINDOW_PREFIX};
use crate::error::{Error, Result};
use crate::files::{self, Opened, Owner};
use crate::tree::{Array, LeafType};

/// The file in a checkpoint directory naming its committed version.
pub const CURRENT: &str = "CURRENT";

/// The index of a version: what each tensor is and where its pieces are.
pub const INDEX: &str = "index.json";

/// The value of the index's `format` field.
pub const DIR_FORMAT: &str = "nitro.checkpoint.dir";

/// The layout version of checkpoint directories this nitro writes and reads.
pub const DIR_VERSION: u32 = 1;

/// How a version's directory name starts (`step-000000000120.<pid>.<n>`).
const VERSION_PREFIX: &str = "step-";

/// What marks a version still being written (`<version>.tmp.<pid>.<n>`).
const TEMP_MARK: &str = files::TEMP_MARK;

/// The largest index and `CURRENT` file read.
const MAX_INDEX_BYTES: u64 = 1 << 30;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Where a checkpoint path says to write: one `safetensors` file, or a checkpoint directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// One `safetensors` file holding every leaf whole ([`Checkpoint::save`]).
    File,
    /// A directory of versions, each a file of pieces per device and an index
    /// ([`CheckpointDir`]).
    Directory,
}

impl Format {
    /// The format a save to `path` writes: [`Format::File`] for a name ending in
    /// `.safetensors`, [`Format::Directory`] for any other.
    pub fn for_path(path: &Path) -> Format {
        match path.extension() {
            Some(ext) if ext == "safetensors" => Format::File,
            _ => Format::Directory,
        }
    }
}

/// One stored piece of a tensor.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct PieceEntry {
    /// The part file holding it, by its index in [`Index::parts`].
    part: usize,
    /// Where it starts in the whole tensor, per dim.
    start: Vec<usize>,
    /// Its dims.
    dims: Vec<usize>,
    /// blake3 of its bytes as stored (hex).
    blake3: String,
}

/// One tensor of a checkpoint: its whole type and its pieces.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct TensorEntry {
    name: String,
    #[serde(rename = "type")]
    ty: LeafType,
    pieces: Vec<PieceEntry>,
}

impl TensorEntry {
    /// `Err(why)` unless the pieces tile the tensor: each inside it, no two overlapping, and
    /// their elements summing to the tensor's — so every element is in exactly one piece. The
    /// counts are checked products: dims whose product overflows are refused, never wrapped.
    fn check_tiling(&self) -> std::result::Result<(), String> {
        let name = &self.name;
        let total = self.ty.element_count().ok_or_else(|| {
            format!(
                "`{name}` is declared {}, past the largest tensor nitro holds",
                self.ty
            )
        })?;
        let mut covered = 0usize;
        for (i, p) in self.pieces.iter().enumerate() {
            if !inside(&p.start, &p.dims, &self.ty.dims) {
                return Err(format!(
                    "a piece of `{name}` ({:?} at {:?}) lies outside the tensor's {}",
                    p.dims, p.start, self.ty
                ));
            }
            // Inside a tensor whose count fits, a piece's count fits too.
            covered = covered
                .checked_add(p.dims.iter().product::<usize>())
                .ok_or_else(|| format!("the pieces of `{name}` hold more elements than it"))?;
            if let Some(q) = self.pieces[..i].iter().find(|q| overlap(p, q)) {
                return Err(format!(
                    "two pieces of `{name}` overlap ({:?} at {:?} and {:?} at {:?}): each \
                     element must be stored once",
                    q.dims, q.start, p.dims, p.start
                ));
            }
        }
        if covered != total {
            return Err(format!(
                "the pieces of `{name}` hold {covered} of its {total} elements: some are in \
                 no piece"
            ));
        }
        Ok(())
    }
}

/// Whether a piece at `start` of `dims` lies inside a tensor of dims `whole` (ranks equal).
fn inside(start: &[usize], dims: &[usize], whole: &[usize]) -> bool {
    start.len() == whole.len()
        && dims.len() == whole.len()
        && start
            .iter()
            .zip(dims)
            .zip(whole)
            .all(|((s, d), w)| s.checked_add(*d).is_some_and(|e| e <= *w))
}

/// Whether two pieces of one tensor share an element.
fn overlap(a: &PieceEntry, b: &PieceEntry) -> bool {
    a.start
        .iter()
        .zip(&a.dims)
        .zip(b.start.iter().zip(&b.dims))
        .all(|((&s0, &d0), (&s1, &d1))| s0.max(s1) < (s0 + d0).min(s1 + d1))
}

/// A version's `index.json`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Index {
    format: String,
    version: u32,
    /// The part files, in the order pieces name them.
    parts: Vec<String>,
    /// The checkpoint's metadata: the keys of [`super::meta`] but the checksum.
    metadata: BTreeMap<String, String>,
    tensors: Vec<TensorEntry>,
    /// blake3 (hex) of this index serialized without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    checksum: Option<String>,
}

impl Index {
    /// blake3 of the index serialized without its checksum.
    fn digest(&self) -> Result<String> {
        let mut bare = self.clone();
        bare.checksum = None;
        let bytes = serde_json::to_vec(&bare).map_err(|e| Error::CheckpointInput {
            why: format!("cannot encode the checkpoint's index: {e}"),
        })?;
        Ok(blake3::hash(&bytes).to_hex().to_string())
    }
}

/// One piece handed to [`DirWriter::write_part`]: a window of tensor `name`, whose whole type
/// is `whole`, starting at `start`, of `dims`; `fetch` gives its values when the part's file
/// reaches it (a device's shard is copied off the device then, and dropped once written).
pub(crate) struct Piece<'a> {
    pub(crate) name: String,
    pub(crate) whole: LeafType,
    pub(crate) start: Vec<usize>,
    pub(crate) dims: Vec<usize>,
    pub(crate) fetch: Box<dyn FnOnce() -> Result<Array> + 'a>,
}

impl Piece<'_> {
    /// A piece holding all of `array`.
    pub(crate) fn whole(name: String, array: Array) -> Piece<'static> {
        Piece {
            name,
            whole: array.leaf_type(),
            start: vec![0; array.dims().len()],
            dims: array.dims().to_vec(),
            fetch: Box::new(move || Ok(array)),
        }
    }
}

/// Writes one version of a checkpoint directory: [`begin`](DirWriter::begin), one
/// [`write_part`](DirWriter::write_part) per device (each only that device's pieces), then
/// [`commit`](DirWriter::commit). Until the commit the version is a temporary directory no
/// reader looks at; dropped uncommitted, it is removed.
pub(crate) struct DirWriter {
    root: PathBuf,
    version: String,
    tmp: PathBuf,
    parts: Vec<String>,
    tensors: Vec<TensorEntry>,
    by_name: HashMap<String, usize>,
    bytes: u64,
    committed: bool,
}

impl DirWriter {
    /// Starts a version for `step` in the checkpoint directory `root`, creating `root` (not its
    /// parents) when missing, and removing versions that writers killed mid-save left there.
    pub(crate) fn begin(root: &Path, step: u64) -> Result<DirWriter> {
        let io = |what: &'static str| {
            move |source| Error::CheckpointIo {
                path: root.to_path_buf(),
                what,
                source,
            }
        };
        // The path itself is followed when it is a link, as every reader follows it.
        match fs::metadata(root) {
            Ok(m) if m.is_dir() => check_ours(root)?,
            Ok(_) => {
                return Err(io("write a checkpoint directory at")(
                    std::io::Error::other(
                        "it is not a directory; pass a directory path, or a path ending in \
                     `.safetensors` for one file",
                    ),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                files::private_dir_builder(false)
                    .create(root)
                    .map_err(io("create the checkpoint directory"))?;
            }
            Err(e) => return Err(io("inspect")(e)),
        }
        sweep_temporaries(root);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let version = format!("{VERSION_PREFIX}{step:012}.{}.{n}", std::process::id());
        let tmp = root.join(format!("{version}{TEMP_MARK}{}.{n}", std::process::id()));
        files::private_dir_builder(false)
            .create(&tmp)
            .map_err(io("create a version directory in"))?;
        Ok(DirWriter {
            root: root.to_path_buf(),
            version,
            tmp,
            parts: Vec::new(),
            tensors: Vec::new(),
            by_name: HashMap::new(),
            bytes: 0,
            committed: false,
        })
    }

    /// Writes `pieces` as the next part file — a standard `safetensors` file, each piece named
    /// by its tensor — streaming: the header first (every piece's type is known), then each
    /// piece fetched, written and dropped in turn, so the host holds one piece at a time; then
    /// synced. A tensor has at most one piece per part.
    pub(crate) fn write_part(&mut self, pieces: Vec<Piece<'_>>) -> Result<()> {
        let part = self.parts.len();
        let name = format!("part-{part:05}.safetensors");
        let path = self.tmp.join(&name);
        let mut header = serde_json::Map::new();
        let mut offset = 0u64;
        for p in &pieces {
            let entry = match self.by_name.get(&p.name) {
                Some(&i) => &self.tensors[i],
                None => {
                    self.by_name.insert(p.name.clone(), self.tensors.len());
                    self.tensors.push(TensorEntry {
                        name: p.name.clone(),
                        ty: p.whole.clone(),
                        pieces: Vec::new(),
                    });
                    self.tensors.last().expect("just pushed")
                }
            };
            let fits = entry.ty == p.whole && inside(&p.start, &p.dims, &p.whole.dims);
            if !fits || header.contains_key(&p.name) {
                return Err(Error::CheckpointInput {
                    why: format!(
                        "a piece of `{}` ({:?} at {:?}) does not fit the tensor's {} once",
                        p.name, p.dims, p.start, entry.ty
                    ),
                });
            }
            let len = LeafType::new(p.whole.dtype, &p.dims)
                .size_bytes()
                .unwrap_or(u64::MAX);
            header.insert(
                p.name.clone(),
                serde_json::json!({
                    "dtype": format!("{:?}", st_dtype(p.whole.dtype)),
                    "shape": p.dims,
                    "data_offsets": [offset, offset + len],
                }),
            );
            offset += len;
        }
        let mut head = serde_json::to_vec(&header).map_err(|e| Error::CheckpointInput {
            why: format!("cannot encode a part's header: {e}"),
        })?;
        // The data starts 8-byte aligned, as the format asks.
        while head.len() % 8 != 0 {
            head.push(b' ');
        }
        let io = |source: std::io::Error| Error::CheckpointIo {
            path: path.clone(),
            what: "write a checkpoint part",
            source,
        };
        let file = files::private_file()
            .create_new(true)
            .open(&path)
            .map_err(io)?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        out.write_all(&(head.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&head))
            .map_err(io)?;
        for p in pieces {
            let array = (p.fetch)()?;
            if array.dtype() != p.whole.dtype || array.dims() != p.dims.as_slice() {
                return Err(Error::CheckpointInput {
                    why: format!(
                        "a piece of `{}` is {}, and its header says {:?}",
                        p.name,
                        array.leaf_type(),
                        p.dims
                    ),
                });
            }
            let raw = Raw::of(&array);
            drop(array);
            out.write_all(&raw.bytes).map_err(io)?;
            let i = self.by_name[&p.name];
            self.tensors[i].pieces.push(PieceEntry {
                part,
                start: p.start,
                dims: p.dims,
                blake3: blake3::hash(&raw.bytes).to_hex().to_string(),
            });
            self.bytes += raw.bytes.len() as u64;
        }
        let file = out.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)?;
        self.parts.push(name);
        Ok(())
    }

    /// Commits the version: checks that the pieces of every tensor cover it exactly, writes
    /// the index with `metadata`, renames the version into place and points `CURRENT` at it
    /// (each step synced), then removes the older versions. Returns the bytes of the pieces.
    pub(crate) fn commit(mut self, metadata: BTreeMap<String, String>) -> Result<u64> {
        for t in &self.tensors {
            t.check_tiling()
                .map_err(|why| Error::CheckpointInput { why })?;
        }
        let mut index = Index {
            format: DIR_FORMAT.to_owned(),
            version: DIR_VERSION,
            parts: std::mem::take(&mut self.parts),
            metadata,
            tensors: std::mem::take(&mut self.tensors),
            checksum: None,
        };
        index.checksum = Some(index.digest()?);
        let json = serde_json::to_vec_pretty(&index).map_err(|e| Error::CheckpointInput {
            why: format!("cannot encode the checkpoint's index: {e}"),
        })?;
        let root = self.root.clone();
        let io = |what: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::CheckpointIo { path, what, source }
        };
        let index_path = self.tmp.join(INDEX);
        let mut f = files::private_file()
            .create_new(true)
            .open(&index_path)
            .map_err(io("create", &index_path))?;
        f.write_all(&json)
            .and_then(|()| f.sync_all())
            .map_err(io("write", &index_path))?;
        drop(f);
        sync_dir(&self.tmp);
        let target = root.join(&self.version);
        fs::rename(&self.tmp, &target).map_err(io("rename a finished version into", &root))?;
        self.committed = true;
        sync_dir(&root);
        files::write_atomic(
            &root.join(CURRENT),
            format!("{}\n", self.version).as_bytes(),
            true,
        )
        .map_err(|f| Error::CheckpointIo {
            path: root.join(CURRENT),
            what: "point (atomically) at the new version with",
            source: f.source,
        })?;
        // The older versions are unreachable now.
        if let Ok(rd) = fs::read_dir(&root) {
            for e in rd.filter_map(|e| e.ok()) {
                let name = e.file_name();
                let Some(name) = name.to_str() else { continue };
                if name != self.version && written_version(&e) {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        Ok(self.bytes)
    }
}

impl Drop for DirWriter {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

/// Syncs a directory's entries (a rename in it), where directories can be synced.
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}

/// Whether `name` is a version's name as [`DirWriter::begin`] makes it:
/// `step-<12 digits>.<pid>.<n>`.
fn version_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(VERSION_PREFIX) else {
        return false;
    };
    let mut fields = rest.split('.');
    let digits = |f: Option<&str>, len: Option<usize>| {
        f.is_some_and(|f| {
            !f.is_empty()
                && f.bytes().all(|b| b.is_ascii_digit())
                && len.is_none_or(|l| f.len() == l)
        })
    };
    digits(fields.next(), Some(12))
        && digits(fields.next(), None)
        && digits(fields.next(), None)
        && fields.next().is_none()
}

/// The writer's pid when `name` is a version still being written, as [`DirWriter::begin`]
/// names it: `<version>.tmp.<pid>.<n>`.
fn temporary_version(name: &str) -> Option<u32> {
    let pos = name.find(TEMP_MARK)?;
    if !version_name(&name[..pos]) {
        return None;
    }
    let mut tail = name[pos + TEMP_MARK.len()..].split('.');
    let pid = tail.next()?.parse::<u32>().ok()?;
    let n = tail.next()?;
    (n.bytes().all(|b| b.is_ascii_digit()) && !n.is_empty() && tail.next().is_none()).then_some(pid)
}

/// Whether the entry is a committed version a nitro save wrote: a directory (not a link) by
/// nitro's naming, holding an index. Only these are removed once a newer version is
/// committed; a user's `step-best/` or notes stay.
fn written_version(e: &fs::DirEntry) -> bool {
    let name = e.file_name();
    name.to_str().is_some_and(version_name)
        && e.file_type().is_ok_and(|t| t.is_dir())
        && fs::symlink_metadata(e.path().join(INDEX)).is_ok_and(|m| m.is_file())
}

/// Refuses to write a checkpoint into the existing directory `root` unless it is one already
/// (it holds `CURRENT`) or holds nothing but what a nitro save leaves (versions, a killed
/// save's temporaries): a save never shares a directory it did not make with a user's files.
fn check_ours(root: &Path) -> Result<()> {
    if fs::symlink_metadata(root.join(CURRENT)).is_ok() {
        return Ok(());
    }
    let rd = fs::read_dir(root).map_err(|source| Error::CheckpointIo {
        path: root.to_path_buf(),
        what: "list the checkpoint directory",
        source,
    })?;
    let mut foreign = Vec::new();
    for e in rd.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        let current_temp = name
            .strip_prefix(CURRENT)
            .is_some_and(|t| t.starts_with(TEMP_MARK));
        if !(written_version(&e) || temporary_version(&name).is_some() || current_temp) {
            foreign.push(name);
        }
    }
    if foreign.is_empty() {
        return Ok(());
    }
    foreign.sort();
    let shown = foreign.len().min(5);
    let more = match foreign.len() - shown {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    Err(Error::CheckpointInput {
        why: format!(
            "`{}` is a directory that holds no checkpoint (no `{CURRENT}`) but holds {}{more}; \
             nitro writes checkpoint directories only into an empty or missing directory, or \
             one a save wrote: pass a new path",
            root.display(),
            foreign[..shown]
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

/// Removes the versions of writers killed mid-save: temporary version directories whose
/// writer is gone (or that are over an hour old).
fn sweep_temporaries(root: &Path) {
    let Ok(rd) = fs::read_dir(root) else { return };
    for e in rd.filter_map(|e| e.ok()) {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = temporary_version(name) else {
            continue;
        };
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let pid = Some(pid);
        let alive = match pid {
            Some(pid) if pid == std::process::id() => true,
            Some(pid) if Path::new("/proc/self").exists() => {
                Path::new(&format!("/proc/{pid}")).exists()
            }
            _ => true,
        };
        let old = e
            .metadata()
            .ok()
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age.as_secs() > 3600);
        if !alive || old {
            let _ = fs::remove_dir_all(e.path());
        }
    }
}

/// A checkpoint directory, opened: its committed version's index, read and checked, and the
/// checkpoint's identity — its values are read only when asked, range by range.
///
/// # The layout
///
/// ```text
/// run/                                   the checkpoint directory (the path saved to)
///   CURRENT                              the committed version's name, one line
///   step-000000000120.<pid>.<n>/         a version
///     index.json                         metadata, tensors, pieces, checksums
///     part-00000.safetensors             device 0's pieces
///     part-00001.safetensors             device 1's pieces, …
/// ```
///
/// Each part is a standard `safetensors` file holding one device's pieces, each named by its
/// tensor (`layers[0].w`, `opt/m/layers[0].w`, `acc/layers[0].w` — the names of the
/// single-file format); a piece replicated on several devices is written once. `index.json`
/// holds the checkpoint's metadata (the keys of [`meta`](super::meta) but the checksum), each
/// tensor's whole type and its pieces (part, start per dim, dims, blake3 of the bytes), and a
/// blake3 of itself.
///
/// A save writes a new version into a temporary directory, syncs it, renames it into place
/// and then replaces `CURRENT` atomically: a process killed at any point leaves `CURRENT`
/// naming the previous version, complete. The older versions are removed after the commit,
/// and the temporary ones of killed writers at the next save.
///
/// Reading checks the index's checksum, then each piece's as it is read: a flipped byte is
/// [`Error::CheckpointCorrupt`], naming the file.
#[derive(Debug)]
pub struct CheckpointDir {
    root: PathBuf,
    version: PathBuf,
    index: Index,
    by_name: HashMap<String, usize>,
    head: Checkpoint,
    opt_names: Vec<String>,
    window: Option<WindowMeta>,
    allow_retuned: bool,
    /// The part files opened so far, each with its header read once.
    parts: std::sync::Mutex<HashMap<usize, std::sync::Arc<Part>>>,
}

/// A part file opened, its header parsed: what every piece read from it needs.
#[derive(Debug)]
struct Part {
    file: std::sync::Mutex<File>,
    len: u64,
    header_len: u64,
    header: serde_json::Map<String, serde_json::Value>,
}

/// A checkpoint to resume a training handle from ([`crate::train::Nitro::resume`]): a file
/// read whole, or a checkpoint directory opened, whose values are read as the handle places
/// them.
#[derive(Debug)]
// One is made per resume and consumed by it: boxing either variant would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Saved {
    /// A checkpoint in memory ([`Checkpoint::load`], [`Checkpoint::capture`]).
    Whole(Checkpoint),
    /// A checkpoint directory ([`CheckpointDir::open`]).
    Directory(CheckpointDir),
}

impl Saved {
    /// The checkpoint at `path`: a directory opened ([`CheckpointDir::open`]), or a file read
    /// ([`Checkpoint::load`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Saved> {
        let path = path.as_ref();
        if fs::metadata(path).is_ok_and(|m| m.is_dir()) {
            return CheckpointDir::open(path).map(Saved::Directory);
        }
        Checkpoint::load(path).map(Saved::Whole)
    }

    /// Lets a resume keep the optimizer state under new constants (see
    /// [`Checkpoint::allow_retuned_optimizer`]).
    pub fn allow_retuned_optimizer(self) -> Saved {
        match self {
            Saved::Whole(c) => Saved::Whole(c.allow_retuned_optimizer()),
            Saved::Directory(d) => Saved::Directory(d.allow_retuned_optimizer()),
        }
    }

    /// The step it was taken at.
    pub fn step(&self) -> u64 {
        match self {
            Saved::Whole(c) => c.step(),
            Saved::Directory(d) => d.step(),
        }
    }
}

impl From<Checkpoint> for Saved {
    fn from(c: Checkpoint) -> Saved {
        Saved::Whole(c)
    }
}

impl From<CheckpointDir> for Saved {
    fn from(d: CheckpointDir) -> Saved {
        Saved::Directory(d)
    }
}

impl CheckpointDir {
    /// Opens the checkpoint directory at `path`: reads `CURRENT` and the version's index, and
    /// checks them.
    ///
    /// [`Error::CheckpointIo`] when they cannot be read; [`Error::CheckpointCorrupt`] when
    /// `CURRENT` names no version, or the index is altered, of another layout version, or not
    /// a nitro checkpoint's.
    pub fn open(path: impl AsRef<Path>) -> Result<CheckpointDir> {
        let root = path.as_ref().to_path_buf();
        let origin = format!("`{}`", root.display());
        let corrupt = |why: String| Error::CheckpointCorrupt {
            origin: origin.clone(),
            why,
        };
        if fs::symlink_metadata(root.join(CURRENT))
            .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
        {
            return Err(corrupt(format!(
                "it is a directory that holds no `{CURRENT}`, so no checkpoint directory: pass \
                 a checkpoint file, or a directory a save wrote"
            )));
        }
        let current = read_bounded(&root.join(CURRENT), 4096, &origin)?;
        let name = String::from_utf8(current)
            .ok()
            .map(|s| s.trim_end().to_owned())
            .filter(|n| version_name(n))
            .ok_or_else(|| corrupt(format!("its `{CURRENT}` names no version")))?;
        let version = root.join(&name);
        // Entries inside a checkpoint directory are never followed: the version must be a
        // directory in it, not a link out of it.
        if fs::symlink_metadata(&version).is_ok_and(|m| !m.is_dir()) {
            return Err(corrupt(format!(
                "its `{CURRENT}` names `{name}`, which is not a version directory in it (a \
                 link inside a checkpoint directory is not followed)"
            )));
        }
        let bytes = read_bounded(&version.join(INDEX), MAX_INDEX_BYTES, &origin)?;
        let index: Index = serde_json::from_slice(&bytes)
            .map_err(|e| corrupt(format!("its index is unreadable ({e})")))?;
        if index.format != DIR_FORMAT {
            return Err(corrupt("its index is not a nitro checkpoint's".into()));
        }
        if index.version != DIR_VERSION {
            return Err(corrupt(format!(
                "its index has layout version {}, and this nitro reads version {DIR_VERSION}",
                index.version
            )));
        }
        if index.checksum.as_deref() != Some(index.digest()?.as_str()) {
            return Err(corrupt(
                "its index's checksum does not match its contents (a byte was changed)".into(),
            ));
        }
        if index
            .parts
            .iter()
            .any(|p| p.is_empty() || p.contains(['/', '\\']) || p.contains(".."))
        {
            return Err(corrupt("its index names a part outside the version".into()));
        }
        // What each part file may hold: the pieces the index places in it must fit in its
        // bytes, so no declared dims can make a read allocate more than the files hold.
        let mut room = Vec::with_capacity(index.parts.len());
        for part in &index.parts {
            let path = version.join(part);
            match fs::symlink_metadata(&path) {
                Ok(m) if m.is_file() => room.push(m.len()),
                Ok(_) => {
                    return Err(corrupt(format!(
                        "its part `{part}` is not a regular file (links inside a checkpoint \
                         are not followed)"
                    )))
                }
                Err(source) => {
                    return Err(Error::CheckpointIo {
                        path,
                        what: "inspect a part of",
                        source,
                    })
                }
            }
        }
        let mut by_name = HashMap::new();
        for (i, t) in index.tensors.iter().enumerate() {
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(corrupt(format!("its index lists `{}` twice", t.name)));
            }
            t.check_tiling()
                .map_err(|why| corrupt(format!("its index is wrong: {why}")))?;
            let elem = t.ty.dtype.size_bytes() as u64;
            for p in &t.pieces {
                let left = room.get_mut(p.part).ok_or_else(|| {
                    corrupt(format!(
                        "its index places a piece of `{}` in part {}, and it has {}",
                        t.name,
                        p.part,
                        index.parts.len()
                    ))
                })?;
                // Tiling proved the count fits a usize; the bytes are a checked product.
                let bytes = (p.dims.iter().product::<usize>() as u64).checked_mul(elem);
                match bytes.and_then(|b| left.checked_sub(b)) {
                    Some(rest) => *left = rest,
                    None => {
                        return Err(corrupt(format!(
                            "its index places more bytes of `{}` in `{}` than the file holds",
                            t.name, index.parts[p.part]
                        )))
                    }
                }
            }
        }
        let (head, opt_names, window) = Checkpoint::parse_head(&index.metadata, &origin)?;
        Ok(CheckpointDir {
            root,
            version,
            index,
            by_name,
            head,
            opt_names,
            window,
            allow_retuned: false,
            parts: Default::default(),
        })
    }

    /// Lets a training handle resume it with an optimizer whose constants differ (see
    /// [`Checkpoint::allow_retuned_optimizer`]).
    pub fn allow_retuned_optimizer(mut self) -> CheckpointDir {
        self.allow_retuned = true;
        self
    }

    /// Whether [`allow_retuned_optimizer`](CheckpointDir::allow_retuned_optimizer) was called.
    pub fn allows_retuned_optimizer(&self) -> bool {
        self.allow_retuned
    }

    /// The directory opened.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// The committed version's directory, which `CURRENT` names.
    pub fn version(&self) -> &Path {
        &self.version
    }

    /// The step the checkpoint was taken at.
    pub fn step(&self) -> u64 {
        self.head.step()
    }

    /// The tensors, by name, with their whole types, in the order saved.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &LeafType)> {
        self.index.tensors.iter().map(|t| (t.name.as_str(), &t.ty))
    }

    /// The checkpoint's identity, position and optimizer without its arrays (`device()`,
    /// `optimizer()` and `window()` are empty): what a resume checks before reading a value.
    pub(crate) fn head(&self) -> &Checkpoint {
        &self.head
    }

    /// The optimizer-state names the metadata lists (without the prefix).
    pub(crate) fn optimizer_names(&self) -> &[String] {
        &self.opt_names
    }

    /// The accumulation window the metadata lists.
    pub(crate) fn window(&self) -> Option<&WindowMeta> {
        self.window.as_ref()
    }

    /// The whole type of tensor `name`, if the checkpoint holds it.
    pub fn tensor_type(&self, name: &str) -> Option<&LeafType> {
        self.by_name.get(name).map(|&i| &self.index.tensors[i].ty)
    }

    /// The window `window` (`(start, len)` per dim) of tensor `name`, reading only the pieces
    /// it overlaps. [`Error::CheckpointInput`] when the checkpoint holds no such tensor or the
    /// window is outside it.
    pub fn read(&self, name: &str, window: &[(usize, usize)]) -> Result<Array> {
        self.read_windows(name, &[window.to_vec()])?
            .pop()
            .ok_or_else(|| Error::CheckpointInput {
                why: format!("no window of `{name}` was read"),
            })
    }

    /// Tensor `name` whole.
    pub fn read_whole(&self, name: &str) -> Result<Array> {
        let ty = self.tensor_type(name).ok_or_else(|| self.missing(name))?;
        let whole: Vec<(usize, usize)> = ty.dims.iter().map(|&d| (0, d)).collect();
        self.read(name, &whole)
    }

    fn missing(&self, name: &str) -> Error {
        Error::CheckpointCorrupt {
            origin: format!("`{}`", self.root.display()),
            why: format!("it holds no tensor `{name}`"),
        }
    }

    /// The windows `windows` of tensor `name`, one array each: every piece is read once (and
    /// its checksum checked) and copied into each window it overlaps, so a window repeated
    /// (replicated on several devices) or finer than the pieces costs no second read.
    pub(crate) fn read_windows(
        &self,
        name: &str,
        windows: &[Vec<(usize, usize)>],
    ) -> Result<Vec<Array>> {
        let entry =
            &self.index.tensors[*self.by_name.get(name).ok_or_else(|| self.missing(name))?];
        let ty = &entry.ty;
        let elem = ty.dtype.size_bytes();
        let mut outs = Vec::with_capacity(windows.len());
        for w in windows {
            let (start, dims): (Vec<usize>, Vec<usize>) = w.iter().copied().unzip();
            if !inside(&start, &dims, &ty.dims) {
                return Err(Error::CheckpointInput {
                    why: format!("the window {w:?} is outside `{name}`, {ty}"),
                });
            }
            let count: usize = w.iter().map(|(_, l)| l).product();
            outs.push((vec![0u8; count * elem], 0usize));
        }
        for piece in &entry.pieces {
            let overlaps = |w: &Vec<(usize, usize)>| {
                w.iter()
                    .zip(&piece.start)
                    .zip(&piece.dims)
                    .all(|(((ws, wl), ps), pd)| ws.max(ps) < &(ws + wl).min(ps + pd))
            };
            if !windows.iter().any(overlaps) {
                continue;
            }
            let bytes = self.read_piece(entry, piece)?;
            for (w, (out, copied)) in windows.iter().zip(outs.iter_mut()) {
                *copied += copy_overlap(out, w, &bytes, &piece.start, &piece.dims, elem);
            }
        }
        windows
            .iter()
            .zip(outs)
            .map(|(w, (bytes, copied))| {
                let dims: Vec<usize> = w.iter().map(|(_, l)| *l).collect();
                if copied != dims.iter().product::<usize>() {
                    return Err(self.corrupt(format!(
                        "the pieces of `{name}` do not cover the window {w:?}"
                    )));
                }
                let view = safetensors::tensor::TensorView::new(st_dtype(ty.dtype), dims, &bytes)
                    .map_err(|e| {
                    self.corrupt(format!("a window of `{name}` is unreadable ({e})"))
                })?;
                to_array(&view).map_err(|why| self.corrupt(format!("`{name}` {why}")))
            })
            .collect()
    }

    fn corrupt(&self, why: String) -> Error {
        Error::CheckpointCorrupt {
            origin: format!("`{}`", self.version.display()),
            why,
        }
    }

    /// A piece's bytes, read from its part file and checked against the index.
    fn read_piece(&self, entry: &TensorEntry, piece: &PieceEntry) -> Result<Vec<u8>> {
        let path = self.version.join(&self.index.parts[piece.part]);
        let origin = format!("`{}`", path.display());
        let corrupt = |why: String| Error::CheckpointCorrupt {
            origin: origin.clone(),
            why,
        };
        let io = |what: &'static str| {
            let path = path.clone();
            move |source| Error::CheckpointIo { path, what, source }
        };
        let opened = self
            .parts
            .lock()
            .map_err(|_| corrupt("an earlier read of it panicked".into()))?
            .get(&piece.part)
            .cloned();
        let part = match opened {
            Some(part) => part,
            None => {
                let (file, len, header_len, header) = match super::open_safetensors(&path) {
                    Ok(opened) => opened,
                    Err(super::Unreadable::Io(what, e)) => return Err(io(what)(e)),
                    Err(super::Unreadable::Bad(why)) => return Err(corrupt(why)),
                };
                let header = serde_json::from_slice(&header)
                    .map_err(|e| corrupt(format!("its header is not a JSON object ({e})")))?;
                let part = std::sync::Arc::new(Part {
                    file: std::sync::Mutex::new(file),
                    len,
                    header_len,
                    header,
                });
                if let Ok(mut parts) = self.parts.lock() {
                    parts.insert(piece.part, part.clone());
                }
                part
            }
        };
        let (len, header_len) = (part.len, part.header_len);
        let t = part
            .header
            .get(&entry.name)
            .ok_or_else(|| corrupt(format!("it holds no piece of `{}`", entry.name)))?;
        let dtype = format!("{:?}", st_dtype(entry.ty.dtype));
        let (stored, shape, offsets) = super::header_tensor(t);
        let expected =
            piece.dims.iter().product::<usize>() as u64 * entry.ty.dtype.size_bytes() as u64;
        let (start, end) = match (stored, shape, offsets) {
            (Some(d), Some(s), Some((b, e)))
                if d == dtype && s == piece.dims && e >= b && e - b == expected =>
            {
                (b, e)
            }
            _ => {
                return Err(corrupt(format!(
                    "its piece of `{}` is not the {dtype}{:?} the index says",
                    entry.name, piece.dims
                )))
            }
        };
        let at = 8 + header_len + start;
        if at.checked_add(end - start).is_none_or(|e| e > len) {
            return Err(corrupt(format!(
                "its piece of `{}` runs past the end of the file",
                entry.name
            )));
        }
        let bytes = {
            let mut file = part
                .file
                .lock()
                .map_err(|_| corrupt("an earlier read of it panicked".into()))?;
            file.seek(SeekFrom::Start(at)).map_err(io("read"))?;
            files::read_exactly(&mut file, end - start).map_err(io("read"))?
        };
        if blake3::hash(&bytes).to_hex().as_str() != piece.blake3 {
            return Err(corrupt(format!(
                "its piece of `{}` does not match its checksum (a byte was changed)",
                entry.name
            )));
        }
        Ok(bytes)
    }

    /// The whole checkpoint, every tensor assembled on the host (what
    /// [`Checkpoint::load`] returns for a directory).
    pub fn load(&self) -> Result<Checkpoint> {
        let origin = format!("`{}`", self.root.display());
        let mut head = self.head.clone();
        if self.allow_retuned {
            head = head.allow_retuned_optimizer();
        }
        head.fill(
            self.opt_names.clone(),
            self.window.clone(),
            &origin,
            self.index.tensors.len(),
            &mut |name| self.read_whole(name),
        )
    }
}

/// Copies the part of `src` (a piece at `start` of `dims`) inside `window` into `out` (the
/// window's elements, row-major), `elem` bytes an element; returns the elements copied.
fn copy_overlap(
    out: &mut [u8],
    window: &[(usize, usize)],
    src: &[u8],
    start: &[usize],
    dims: &[usize],
    elem: usize,
) -> usize {
    let rank = dims.len();
    let mut lo = Vec::with_capacity(rank);
    let mut hi = Vec::with_capacity(rank);
    for ((&(ws, wl), &ps), &pd) in window.iter().zip(start).zip(dims) {
        let (l, h) = (ws.max(ps), (ws + wl).min(ps + pd));
        if l >= h {
            return 0;
        }
        lo.push(l);
        hi.push(h);
    }
    if rank == 0 {
        out[..elem].copy_from_slice(&src[..elem]);
        return 1;
    }
    let strides = |d: &[usize]| {
        let mut s = vec![1usize; d.len()];
        for i in (0..d.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * d[i + 1];
        }
        s
    };
    let wdims: Vec<usize> = window.iter().map(|(_, l)| *l).collect();
    let (ws, ps) = (strides(&wdims), strides(dims));
    let run = hi[rank - 1] - lo[rank - 1];
    let mut idx = lo.clone();
    let mut copied = 0;
    loop {
        let mut o = 0;
        let mut p = 0;
        for d in 0..rank {
            o += (idx[d] - window[d].0) * ws[d];
            p += (idx[d] - start[d]) * ps[d];
        }
        out[o * elem..(o + run) * elem].copy_from_slice(&src[p * elem..(p + run) * elem]);
        copied += run;
        // The next run: advance the outer dims.
        let mut d = rank - 1;
        loop {
            if d == 0 {
                return copied;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < hi[d] {
                break;
            }
            idx[d] = lo[d];
        }
    }
}

/// A small file's bytes (`CURRENT`, an index), at most `max`.
fn read_bounded(path: &Path, max: u64, origin: &str) -> Result<Vec<u8>> {
    let io = |source| Error::CheckpointIo {
        path: path.to_path_buf(),
        what: "read",
        source,
    };
    // Entries inside a checkpoint directory are never followed.
    if files::is_symlink(path) {
        return Err(Error::CheckpointCorrupt {
            origin: origin.to_owned(),
            why: format!(
                "its `{}` is a symbolic link (links inside a checkpoint directory are not \
                 followed)",
                path.display()
            ),
        });
    }
    match files::open_regular(path, max, Owner::Anyone).map_err(io)? {
        Opened::File(mut f, len) => files::read_exactly(&mut f, len).map_err(io),
        Opened::Refused(r) => Err(Error::CheckpointCorrupt {
            origin: origin.to_owned(),
            why: format!("its `{}` is {}", path.display(), r.why()),
        }),
    }
}

/// The tensor name of optimizer state `name` (`m/layers[0].w`): [`OPTIMIZER_PREFIX`] + name.
pub(crate) fn optimizer_tensor(name: &str) -> String {
    format!("{OPTIMIZER_PREFIX}{name}")
}

/// The tensor name of an accumulation window's sum for trainable leaf `path`.
pub(crate) fn window_tensor(path: &str) -> String {
    format!("{WINDOW_PREFIX}{path}")
}

impl Checkpoint {
    /// Writes the checkpoint as a checkpoint directory at `path` (see [`CheckpointDir`]): one
    /// part holding every tensor whole. A training handle on several devices writes one part
    /// per device instead ([`crate::train::Nitro::save`]).
    ///
    /// Errors as [`save`](Checkpoint::save).
    pub fn save_dir(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut writer = DirWriter::begin(path.as_ref(), self.step())?;
        let mut pieces = Vec::new();
        let mut add = |name: String, a: &Array| pieces.push(Piece::whole(name, a.clone()));
        for (n, a) in self.device() {
            add(n.clone(), a);
        }
        for (n, a) in self.optimizer() {
            add(optimizer_tensor(n), a);
        }
        if let Some(w) = self.window() {
            for (n, a) in &w.sums {
                add(window_tensor(n), a);
            }
        }
        writer.write_part(pieces)?;
        writer.commit(self.listed_metadata()?)?;
        Ok(())
    }
}
