//! The persistent level (L2): a content-addressed store of serialized executables.
//!
//! [`Store`] is the interface callers use, so a shared remote store can stand behind it without
//! touching them; [`DirStore`] keeps entries as files in a directory. Its rules:
//!
//! - **Atomic writes.** An entry is written to a temporary file in the same directory, synced,
//!   then renamed over the final name, so readers see a whole entry or none. Concurrent writers
//!   of one entry are safe (the last rename wins; both wrote the same content).
//! - **Checked reads.** Each entry carries a checksum (blake3, or blake3 keyed with
//!   `NITRO_CACHE_KEY` in signed mode) over everything before it, and the key it was stored
//!   under. A truncated, corrupt, foreign or (in signed mode) unsigned entry is reported as
//!   [`Lookup::Rejected`] with its [`RejectKind`], removed, and rebuilt by the caller — never
//!   loaded. (A signed entry met by a process without a key is rejected but kept: it is not
//!   damaged, and a process with the key can use it.)
//! - **Bounded size.** Total bytes are kept under a capacity by removing least-recently-used
//!   entries (last use is the file's modification time, refreshed on every hit).
//! - **Trust.** A serialized executable is native code, so a directory that other users can
//!   write (group- or world-writable, or owned by another user than this process's, root
//!   excepted) is refused.
//! - **No stampede.** [`Store::lock`] takes an exclusive OS file lock per key; it is released
//!   when the holder exits or dies, so a crashed compiler never blocks the others.
//!
//! This module knows no shared store: the shared level ([`remote`](super::remote)) builds on it,
//! and a [`KeyLock`] holds that level's lease as an opaque `HeldLock`, so imports point one
//! way (remote → store).

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::files::{self, Opened, Owner, Refusal, Untrusted, TEMP_MARK};
use crate::files::{private_dir_builder, private_file};
use crate::hash::{ContentHasher, Digest};

const MAGIC: &[u8; 8] = b"NITROC1\n";
const ENTRY_EXT: &str = "entry";
/// The subdirectory of per-program records.
const PROGRAMS: &str = "programs";
/// The largest program record read back (records are a few KiB).
const MAX_RECORD_BYTES: u64 = 1 << 20;
/// About this many program records are kept (the least recently written go first; see
/// `RECORD_CHECK_EVERY`).
const MAX_RECORDS: usize = 4096;
/// The subdirectory of lock files.
const LOCKS: &str = "locks";
/// Keys share this many lock files (by their first hex digits), so `locks/` stays bounded.
const LOCK_STRIPES_HEX: usize = 3;
/// The largest entry ever read, whatever the capacity: larger files are rejected unread.
const MAX_ENTRY_BYTES: u64 = 4 << 30;

/// The default capacity of a [`DirStore`]: 1 GiB.
pub const DEFAULT_CAPACITY_BYTES: u64 = 1 << 30;

/// Metadata stored with each entry: the key's components (so a miss can say what differs) and
/// bookkeeping.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EntryMeta {
    /// The key this entry was stored under (guards against foreign or misplaced files).
    pub key: Digest,
    /// Program identity (`crate::Experiment::program`).
    pub program: String,
    /// Fingerprint of the emitted program.
    pub fingerprint: Digest,
    /// Digest of the backend identity.
    pub backend: Digest,
    /// Human-readable backend identity (plugin, platform, CPU features).
    pub backend_description: String,
    /// Digest of the compile options.
    pub options: Digest,
    /// How long the compile took, in milliseconds.
    pub compile_ms: f64,
    /// When the entry was created (seconds since the Unix epoch).
    pub created: u64,
}

/// A stored entry: metadata and the serialized executable.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The metadata.
    pub meta: EntryMeta,
    /// The serialized executable.
    pub payload: Vec<u8>,
}

/// The outcome of a lookup.
#[derive(Clone, Debug, PartialEq)]
pub enum Lookup {
    /// A whole, verified entry.
    Hit(Entry),
    /// No entry under this key.
    Absent,
    /// An entry existed but was rejected (and removed unless another configuration can use it).
    Rejected(Rejection),
}

/// Why a stored entry was not loaded.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Rejection {
    /// The kind of fault.
    pub kind: RejectKind,
    /// Details, in words.
    pub detail: String,
}

impl Rejection {
    /// A rejection of `kind` with `detail`.
    pub fn new(kind: RejectKind, detail: impl Into<String>) -> Rejection {
        Rejection {
            kind,
            detail: detail.into(),
        }
    }

    /// Whether the words of this rejection contain `needle` (its kind's name or its detail).
    pub fn contains(&self, needle: &str) -> bool {
        self.to_string().contains(needle)
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind.name(), self.detail)
    }
}

/// The kinds of [`Rejection`], as `store_rejected` misses name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectKind {
    /// Not an entry, or cut short: bad magic, truncated lengths or sections, trailing bytes.
    Malformed,
    /// The checksum does not match (an unsigned store): the bytes were damaged.
    Checksum,
    /// The signature does not match (a signed store): damaged, or signed with another key.
    Signature,
    /// An unsigned entry in a signed store.
    Unsigned,
    /// A signed entry, and this process has no key configured to check it.
    SignedNoKey,
    /// Stored under another key (a misplaced or foreign file).
    Foreign,
    /// Metadata that does not parse.
    Metadata,
    /// The file could not be read.
    Unreadable,
    /// The backend refused to load the stored program.
    Load,
}

impl RejectKind {
    /// The kind's name (`checksum`, `signature`, …).
    pub const fn name(self) -> &'static str {
        match self {
            RejectKind::Malformed => "malformed",
            RejectKind::Checksum => "checksum",
            RejectKind::Signature => "signature",
            RejectKind::Unsigned => "unsigned",
            RejectKind::SignedNoKey => "signed_no_key",
            RejectKind::Foreign => "foreign",
            RejectKind::Metadata => "metadata",
            RejectKind::Unreadable => "unreadable",
            RejectKind::Load => "load",
        }
    }
}

impl std::fmt::Display for RejectKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One stored entry as [`DirStore::list`] shows it: the file's size and last use, and its
/// metadata read from the entry's header. Not verified (a listing reads no payload); see
/// [`DirStore::verify_all`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EntrySummary {
    /// The key, in hex: the entry file's name without `.entry`.
    pub key: String,
    /// The file's size in bytes.
    pub size_bytes: u64,
    /// When a process last stored or loaded it (seconds since the Unix epoch): the file's
    /// modification time, which every hit refreshes.
    pub last_used: u64,
    /// The stored metadata: program identity, key components and how long the compile took
    /// (which is what each later hit saves). `None` when the header cannot be read (a damaged
    /// or foreign file).
    pub meta: Option<EntryMeta>,
    /// This entry's own record, as JSON, where [`DirStore::explain`] found one: what its key
    /// was made of (GraphConst digests by field, handle settings, input signature, backend
    /// components, shardings), what the program holds (`cost`) and what it last cost to compile
    /// and load. Written by the cache on every compile or load of the entry; never another
    /// entry's (two entries of one program — on one device and on a mesh — each have their
    /// own). `None` in listings, and for entries stored before records were kept per entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<serde_json::Value>,
}

impl EntrySummary {
    /// The program identity, or `?` when the metadata is unreadable.
    pub fn program(&self) -> &str {
        self.meta.as_ref().map_or("?", |m| m.program.as_str())
    }

    /// The compile time a hit on this entry saves, in milliseconds, when known.
    pub fn compile_ms(&self) -> Option<f64> {
        self.meta.as_ref().map(|m| m.compile_ms)
    }
}

/// The outcome of checking one entry in [`DirStore::verify_all`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Verified {
    /// The key, in hex (the file's name).
    pub key: String,
    /// The file's size in bytes.
    pub size_bytes: u64,
    /// The program identity, when the header can be read.
    pub program: Option<String>,
    /// Why the entry would be rejected by a lookup; `None` when it is whole, under its own key,
    /// and its checksum (or signature, with the store's key) matches.
    pub problem: Option<Rejection>,
}

/// What [`DirStore::gc`] did.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GcReport {
    /// The bound asked for, in bytes.
    pub max_bytes: u64,
    /// Bytes held before.
    pub before_bytes: u64,
    /// Bytes held after (at most `max_bytes`, unless a file could not be removed).
    pub after_bytes: u64,
    /// The entries removed, least recently used first.
    pub removed: Vec<EntrySummary>,
}

/// What [`DirStore::explain`] knows of one program: its stored entries and the record of what
/// its key was made of when a process last compiled or loaded it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Explanation {
    /// The program identity.
    pub program: String,
    /// Its entries that matched the query, most recently used first.
    pub entries: Vec<EntrySummary>,
    /// The program's record (written by the cache on every compile or load: program,
    /// GraphConst digests by field, handle settings, input signature, backend components,
    /// compile options, program fingerprint), as JSON; `None` when none is kept. It describes
    /// the program's latest use — what the next miss's reason is named against — which is one
    /// of `entries` when its `fingerprint`, `backend` and `options` match that entry's
    /// metadata. Each entry's own record is [`EntrySummary::record`].
    pub record: Option<serde_json::Value>,
}

/// A held cross-process lock on one key: an OS file lock of a [`DirStore`], a lease on a shared
/// server ([`RedisStore`](super::RedisStore)), or both. Released on drop; a file lock also
/// when its holder dies, and a lease expires when its holder stops renewing it.
#[derive(Debug)]
pub struct KeyLock {
    _file: Option<File>,
    _held: Option<Box<dyn HeldLock>>,
}

/// A lock held somewhere other than this directory (a shared server's lease), released when
/// dropped. The store that takes it implements this, so that a [`KeyLock`] can hold it without
/// this module knowing that store.
pub(crate) trait HeldLock: Send + Sync + std::fmt::Debug {}

impl KeyLock {
    /// A lock held by `held` alone.
    pub(crate) fn from_held(held: impl HeldLock + 'static) -> KeyLock {
        KeyLock {
            _file: None,
            _held: Some(Box::new(held)),
        }
    }

    /// This lock, also holding `held`.
    pub(crate) fn with_held(mut self, held: impl HeldLock + 'static) -> KeyLock {
        self._held = Some(Box::new(held));
        self
    }
}

/// Where a store holds an entry ([`Store::locate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Location {
    /// On this machine.
    Local,
    /// On a shared server only.
    Remote,
}

/// A persistent store of compiled programs, addressed by content.
pub trait Store: Send + Sync + std::fmt::Debug {
    /// The entry under `key`, verified.
    fn get(&self, key: &Digest) -> Result<Lookup>;
    /// Stores `entry` under `entry.meta.key`, atomically; may evict others to stay in capacity.
    fn put(&self, entry: &Entry) -> Result<()>;
    /// Whether an entry exists under `key` (no read, no verification).
    fn contains(&self, key: &Digest) -> bool;

    /// Where this store would serve `key` from, without fetching it: `None` when it has no
    /// entry. A plain store answers [`Location::Local`]; a shared server, or a local store
    /// backed by one, [`Location::Remote`] for what only the server has.
    fn locate(&self, key: &Digest) -> Option<Location> {
        self.contains(key).then_some(Location::Local)
    }
    /// Removes every entry and every record.
    fn clear(&self) -> Result<()>;
    /// The record last written for a program identity by [`Store::record_program`]: what its
    /// key was made of when some process last compiled or loaded it, so that a miss in a fresh
    /// process can name what moved. `None` when none is kept.
    ///
    /// Records explain misses; they never decide what is served, so a store may drop them.
    fn program_record(&self, program: &Digest) -> Option<Vec<u8>> {
        let _ = program;
        None
    }
    /// Records what a program identity's key was made of (opaque bytes, a few KiB), replacing
    /// the previous record.
    fn record_program(&self, program: &Digest, record: &[u8]) -> Result<()> {
        let _ = (program, record);
        Ok(())
    }
    /// Takes the cross-process lock of `key`, waiting at most `wait`. `Ok(None)` when the wait
    /// ran out (the caller then compiles anyway: a lease, never a deadlock).
    fn lock(&self, key: &Digest, wait: Duration) -> Result<Option<KeyLock>>;
    /// Where it keeps programs, for messages (`the local store at <dir>`).
    fn describe(&self) -> String {
        "the persistent store".to_owned()
    }
    /// Total bytes held.
    fn size_bytes(&self) -> u64;
    /// What this store exchanged with a shared server, when it has one
    /// ([`CacheStats::remote`](super::CacheStats::remote)); `None` for a local store.
    fn remote_stats(&self) -> Option<super::RemoteStats> {
        None
    }
}

/// A [`Store`] in a local directory.
pub struct DirStore {
    dir: PathBuf,
    capacity: u64,
    signing_key: Option<[u8; 32]>,
}

/// The signing key never reaches logs: only whether there is one.
impl std::fmt::Debug for DirStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirStore")
            .field("dir", &self.dir)
            .field("capacity", &self.capacity)
            .field(
                "signing_key",
                &self.signing_key.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// Record writes in this process, to check the records' bound every few writes.
static RECORD_WRITES: AtomicU64 = AtomicU64::new(0);
/// The records' bound is checked every this many writes, so at most `MAX_RECORDS +
/// RECORD_CHECK_EVERY` records exist at any time.
const RECORD_CHECK_EVERY: u64 = 32;

impl DirStore {
    /// Opens (creating with mode 0700 if needed) a store in `dir`, bounded to `capacity` bytes,
    /// signing entries with `signing_key` when given. Refuses a directory that other users
    /// can write. Removes temporary files left by writers that died.
    pub fn open(
        dir: impl AsRef<Path>,
        capacity: u64,
        signing_key: Option<[u8; 32]>,
    ) -> Result<DirStore> {
        let dir = dir.as_ref().to_path_buf();
        private_dir(&dir)?;
        for sub in [PROGRAMS, LOCKS] {
            private_subdir(&dir.join(sub))?;
        }
        remove_legacy(&dir);
        let store = DirStore {
            dir,
            capacity,
            signing_key,
        };
        store.remove_stale_temps();
        Ok(store)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key entries are signed with, if any.
    pub(crate) fn signing_key(&self) -> Option<&[u8; 32]> {
        self.signing_key.as_ref()
    }

    fn entry_path(&self, key: &Digest) -> PathBuf {
        self.dir.join(format!("{key}.{ENTRY_EXT}"))
    }

    fn encode(&self, entry: &Entry) -> Result<Vec<u8>> {
        encode_entry(self.signing_key.as_ref(), entry).map_err(|why| Error::CacheCorrupt {
            path: self.entry_path(&entry.meta.key),
            why,
        })
    }

    /// Parses and verifies an entry file; `Err(rejection)` when it must not be loaded.
    fn decode(&self, key: &Digest, bytes: &[u8]) -> std::result::Result<Entry, Rejection> {
        decode_entry(self.signing_key.as_ref(), key, bytes)
    }

    fn entries(&self) -> Vec<(PathBuf, u64, SystemTime)> {
        listing(&self.dir, |name| {
            Path::new(name).extension().is_some_and(|x| x == ENTRY_EXT)
        })
    }

    /// The program records, with size and last write.
    fn records(&self) -> Vec<(PathBuf, u64, SystemTime)> {
        listing(&self.dir.join(PROGRAMS), |name| !name.contains(TEMP_MARK))
    }

    /// Removes whatever is at `path` (a file, a link, a FIFO or a directory).
    fn remove_any(path: &Path) {
        match fs::symlink_metadata(path) {
            Ok(m) if m.is_dir() => {
                let _ = fs::remove_dir_all(path);
            }
            Ok(_) => {
                let _ = fs::remove_file(path);
            }
            Err(_) => {}
        }
    }

    /// The lock file of `key`: keys share one of 4096 files by their first hex digits.
    fn lock_path(&self, key: &Digest) -> PathBuf {
        let hex = key.to_string();
        self.dir
            .join(LOCKS)
            .join(format!("{}.lock", &hex[..LOCK_STRIPES_HEX]))
    }

    /// Evicts least-recently-used entries until the total is within capacity; returns how many.
    /// (Program records and lock files are bounded by number instead: at most about 4096 of
    /// each, a few KiB or nothing each.)
    pub fn enforce_capacity(&self) -> usize {
        self.evict_to(self.capacity, false).len()
    }

    /// Removes temporary files left by writers that died ([`files::remove_stale_temps`]).
    fn remove_stale_temps(&self) {
        for dir in [self.dir.clone(), self.dir.join(PROGRAMS)] {
            files::remove_stale_temps(&dir, |_| true);
        }
    }
}

/// Inspection and maintenance: what the `nitro cache` command prints and does. These never
/// remove an entry a lookup would accept, except [`DirStore::gc`] (by age) and
/// [`Store::clear`].
impl DirStore {
    /// Opens an existing store without creating or repairing anything (for tools that only
    /// inspect it). Errors: [`Error::CacheIo`] when `dir` does not exist or is not a directory,
    /// [`Error::CacheUntrusted`] when other users can write it.
    pub fn open_existing(dir: impl AsRef<Path>, signing_key: Option<[u8; 32]>) -> Result<DirStore> {
        let dir = dir.as_ref().to_path_buf();
        match fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(Error::CacheIo {
                    path: dir,
                    what: "open the cache directory (it is not a directory; point --dir or \
                           NITRO_CACHE_DIR at the cache directory)"
                        .into(),
                    source: std::io::Error::from(std::io::ErrorKind::NotADirectory),
                })
            }
            Err(e) => {
                return Err(Error::CacheIo {
                    path: dir,
                    what: "open the cache directory (nothing was cached there yet, or the path \
                           is wrong; point --dir or NITRO_CACHE_DIR at the cache directory)"
                        .into(),
                    source: e,
                })
            }
        }
        check_trust(&dir)?;
        Ok(DirStore {
            dir,
            capacity: DEFAULT_CAPACITY_BYTES,
            signing_key,
        })
    }

    /// Every entry, most recently used first (ties by key), with the metadata in its header.
    /// Reads no payload and verifies nothing; changes nothing.
    pub fn list(&self) -> Vec<EntrySummary> {
        let mut out: Vec<EntrySummary> = self
            .entries()
            .into_iter()
            .map(|(path, len, modified)| summarize(&path, len, modified, read_meta(&path)))
            .collect();
        out.sort_by(|a, b| {
            b.last_used
                .cmp(&a.last_used)
                .then_with(|| a.key.cmp(&b.key))
        });
        out
    }

    /// Checks every entry as a lookup would (whole, under its own key, checksum or — with the
    /// store's signing key — signature), in key order. Unlike a lookup it removes nothing and
    /// does not refresh last use. A signed entry checked without a key is reported as
    /// [`RejectKind::SignedNoKey`]; an unsigned one checked with a key as
    /// [`RejectKind::Unsigned`].
    pub fn verify_all(&self) -> Vec<Verified> {
        let mut files = self.entries();
        files.sort_by(|a, b| a.0.cmp(&b.0));
        files
            .into_iter()
            .map(|(path, len, _)| Verified {
                key: key_of(&path),
                size_bytes: len,
                program: read_meta(&path).map(|m| m.program),
                problem: self.verify_file(&path).err(),
            })
            .collect()
    }

    fn verify_file(&self, path: &Path) -> std::result::Result<(), Rejection> {
        let key: Digest = key_of(path)
            .parse()
            .map_err(|_| Rejection::new(RejectKind::Malformed, "the file name is not a key"))?;
        self.read_entry(&key).map(|_| ())
    }

    /// The entry under `key`, verified as a lookup verifies it, but without the lookup's side
    /// effects: nothing is removed and last use is not refreshed (for tools that copy or check
    /// entries). `Err` says why a lookup would reject it; an absent entry is `Unreadable`.
    pub fn read_entry(&self, key: &Digest) -> std::result::Result<Entry, Rejection> {
        let path = self.entry_path(key);
        let (mut file, len) = match open_checked(&path, MAX_ENTRY_BYTES) {
            Ok(Checked::File(f, len)) => (f, len),
            Ok(Checked::Refused(kind, why)) => return Err(Rejection::new(kind, why)),
            Err(e) => {
                return Err(Rejection::new(
                    RejectKind::Unreadable,
                    format!("unreadable: {e}"),
                ))
            }
        };
        let bytes = read_all(&mut file, len)
            .map_err(|e| Rejection::new(RejectKind::Unreadable, format!("unreadable: {e}")))?;
        self.decode(key, &bytes)
    }

    /// Removes least-recently-used entries until at most `max_bytes` are held (program records
    /// and lock files are kept: they are small and bounded by number).
    pub fn gc(&self, max_bytes: u64) -> GcReport {
        let before_bytes = self.size_bytes();
        let removed = self.evict_to(max_bytes, true);
        GcReport {
            max_bytes,
            before_bytes,
            after_bytes: self.size_bytes(),
            removed,
        }
    }

    /// What the store knows of the programs `query` names: a key (its hex, or a prefix of at
    /// least 4 hex digits, as `list` prints), or a program identity — exact, or its last
    /// `::`-separated parts (`Probe::step` names `my_crate::Probe::step`). One explanation per
    /// program matched; empty when nothing matches. A program whose entries were all evicted
    /// is still explained by its exact identity when its record is kept.
    pub fn explain(&self, query: &str) -> Vec<Explanation> {
        explain_entries(
            self.list(),
            query,
            &|program| self.record_json(&Digest::of(program)),
            &|key| {
                let key: Digest = key.parse().ok()?;
                self.record_json(&entry_record_key(&key))
            },
        )
    }

    /// The record kept under `digest` (a program identity's, or an entry's
    /// [`entry_record_key`]), as JSON.
    fn record_json(&self, digest: &Digest) -> Option<serde_json::Value> {
        let bytes = self.program_record(digest)?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Removes least-recently-used entries until at most `bound` bytes are held; returns them,
    /// with their metadata when `describe`.
    fn evict_to(&self, bound: u64, describe: bool) -> Vec<EntrySummary> {
        let mut entries = self.entries();
        let mut total: u64 = entries.iter().map(|e| e.1).sum();
        let mut removed = Vec::new();
        if total <= bound {
            return removed;
        }
        oldest_first(&mut entries);
        for (path, len, modified) in entries {
            if total <= bound {
                break;
            }
            let meta = if describe { read_meta(&path) } else { None };
            if fs::remove_file(&path).is_ok() {
                total = total.saturating_sub(len);
                removed.push(summarize(&path, len, modified, meta));
            }
        }
        removed
    }
}

/// The key under which a store keeps the record of the entry stored under `entry` (the
/// persistent key): apart from the program identities' records, which describe a program's
/// latest use of any of its entries.
pub(crate) fn entry_record_key(entry: &Digest) -> Digest {
    let mut h = ContentHasher::new();
    h.write_str("nitro entry record");
    h.write_digest(entry);
    h.finish()
}

/// The explanations of `query` (see [`DirStore::explain`]) among the entries `all`, with each
/// program's record from `record` and each entry's own from `entry_record` (by key).
pub(crate) fn explain_entries(
    all: Vec<EntrySummary>,
    query: &str,
    record: &dyn Fn(&str) -> Option<serde_json::Value>,
    entry_record: &dyn Fn(&str) -> Option<serde_json::Value>,
) -> Vec<Explanation> {
    let query = query.trim();
    let explain = |program: &str, entries: Vec<EntrySummary>| Explanation {
        program: program.to_owned(),
        entries: entries
            .into_iter()
            .map(|mut e| {
                e.record = entry_record(&e.key);
                e
            })
            .collect(),
        record: record(program),
    };
    let mut programs: Vec<String> = Vec::new();
    let hex = query.to_ascii_lowercase();
    if query.len() >= 4 && query.len() <= 64 && query.bytes().all(|b| b.is_ascii_hexdigit()) {
        let by_key: Vec<&EntrySummary> = all.iter().filter(|e| e.key.starts_with(&hex)).collect();
        if !by_key.is_empty() {
            for e in &by_key {
                if !programs.iter().any(|p| p == e.program()) {
                    programs.push(e.program().to_owned());
                }
            }
            return programs
                .iter()
                .map(|p| {
                    let mine = by_key.iter().filter(|e| e.program() == p);
                    explain(p, mine.map(|e| (*e).clone()).collect())
                })
                .collect();
        }
    }
    let suffix = format!("::{query}");
    for e in &all {
        let p = e.program();
        let matches = p == query || p.ends_with(&suffix);
        if matches && !programs.iter().any(|q| q == p) {
            programs.push(p.to_owned());
        }
    }
    if programs.is_empty() && record(query).is_some() {
        programs.push(query.to_owned());
    }
    programs
        .iter()
        .map(|p| {
            let mine = all.iter().filter(|e| e.program() == p).cloned().collect();
            explain(p, mine)
        })
        .collect()
}

/// The largest entry header (metadata) [`read_meta`] reads.
const MAX_META_BYTES: u64 = 1 << 20;

/// The bytes before an entry's metadata: magic, signed flag, metadata length.
pub(crate) const ENTRY_HEADER_BYTES: usize = MAGIC.len() + 1 + 8;

/// The metadata length an entry's first [`ENTRY_HEADER_BYTES`] announce; `None` when they are
/// not an entry's, or announce more than any entry's metadata.
pub(crate) fn meta_len_of(head: &[u8]) -> Option<u64> {
    if head.len() < ENTRY_HEADER_BYTES || &head[..MAGIC.len()] != MAGIC {
        return None;
    }
    let mut raw = [0u8; 8];
    raw.copy_from_slice(&head[MAGIC.len() + 1..ENTRY_HEADER_BYTES]);
    Some(u64::from_le_bytes(raw)).filter(|&n| n <= MAX_META_BYTES)
}

/// The key of an entry file: its name without the extension.
fn key_of(path: &Path) -> String {
    path.file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default()
        .to_owned()
}

fn summarize(path: &Path, len: u64, modified: SystemTime, meta: Option<EntryMeta>) -> EntrySummary {
    EntrySummary {
        key: key_of(path),
        size_bytes: len,
        last_used: modified
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        meta,
        record: None,
    }
}

/// The metadata in an entry file's header (magic, signed flag, length, metadata), read with the
/// store's refusals and without reading the payload or checking the checksum.
fn read_meta(path: &Path) -> Option<EntryMeta> {
    let Ok(Checked::File(mut file, len)) = open_checked(path, MAX_ENTRY_BYTES) else {
        return None;
    };
    let mut head = [0u8; ENTRY_HEADER_BYTES];
    file.read_exact(&mut head).ok()?;
    let meta_len = meta_len_of(&head).filter(|&n| n <= len)?;
    let mut meta = Vec::new();
    file.take(meta_len).read_to_end(&mut meta).ok()?;
    serde_json::from_slice(&meta).ok()
}

/// Reads the `len` bytes of an opened entry, reserving memory fallibly (a huge length is an
/// error, never an abort).
fn read_all(file: &mut File, len: u64) -> std::io::Result<Vec<u8>> {
    files::read_exactly(file, len)
}

/// The checksum of `bytes`: blake3, keyed with `signing_key` when there is one.
fn checksum(signing_key: Option<&[u8; 32]>, bytes: &[u8]) -> [u8; 32] {
    match signing_key {
        Some(k) => *blake3::keyed_hash(k, bytes).as_bytes(),
        None => *blake3::hash(bytes).as_bytes(),
    }
}

/// The bytes of `entry` as every store keeps them (on disk, or on a shared server): magic, a
/// signed flag, metadata, payload, and a checksum (signed with `signing_key` when given) over
/// all of it. `Err` says why the metadata could not be encoded.
pub(crate) fn encode_entry(
    signing_key: Option<&[u8; 32]>,
    entry: &Entry,
) -> std::result::Result<Vec<u8>, String> {
    let meta =
        serde_json::to_vec(&entry.meta).map_err(|e| format!("cannot encode metadata: {e}"))?;
    let mut out = Vec::with_capacity(MAGIC.len() + 1 + 16 + meta.len() + entry.payload.len() + 32);
    out.extend_from_slice(MAGIC);
    out.push(u8::from(signing_key.is_some()));
    out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    out.extend_from_slice(&meta);
    out.extend_from_slice(&(entry.payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&entry.payload);
    let sum = checksum(signing_key, &out);
    out.extend_from_slice(&sum);
    Ok(out)
}

/// Parses and verifies the bytes of an entry found under `key` (see [`encode_entry`]);
/// `Err(rejection)` when it must not be loaded.
pub(crate) fn decode_entry(
    signing_key: Option<&[u8; 32]>,
    key: &Digest,
    bytes: &[u8],
) -> std::result::Result<Entry, Rejection> {
    use RejectKind::{Checksum, Foreign, Malformed, Metadata, Signature, SignedNoKey, Unsigned};
    let reject = |kind, detail: &str| Rejection::new(kind, detail);
    if bytes.len() < MAGIC.len() + 1 + 8 + 8 + 32 || &bytes[..MAGIC.len()] != MAGIC {
        return Err(reject(Malformed, "not a nitro cache entry, or truncated"));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 32);
    let signed = body[MAGIC.len()] == 1;
    match (signing_key, signed) {
        (Some(_), false) => return Err(reject(Unsigned, "unsigned entry in a signed cache")),
        (None, true) => {
            // An unsigned entry whose flag byte was damaged is not a signed one: its plain
            // checksum still matches with the flag cleared.
            let mut h = blake3::Hasher::new();
            h.update(&body[..MAGIC.len()]);
            h.update(&[0]);
            h.update(&body[MAGIC.len() + 1..]);
            if h.finalize().as_bytes() == sum {
                return Err(reject(Checksum, "damaged signing flag"));
            }
            return Err(reject(
                SignedNoKey,
                "signed entry, no key configured (set NITRO_CACHE_KEY to use it; it is kept)",
            ));
        }
        _ => {}
    }
    if checksum(signing_key, body) != sum {
        return Err(if signing_key.is_some() {
            reject(Signature, "bad signature (another key) or corrupt entry")
        } else {
            reject(Checksum, "checksum mismatch (corrupt or truncated entry)")
        });
    }
    let mut at = MAGIC.len() + 1;
    let read_len = |at: &mut usize| -> std::result::Result<usize, Rejection> {
        let end = *at + 8;
        let raw = body
            .get(*at..end)
            .ok_or_else(|| reject(Malformed, "truncated lengths"))?;
        *at = end;
        let mut b = [0u8; 8];
        b.copy_from_slice(raw);
        usize::try_from(u64::from_le_bytes(b)).map_err(|_| reject(Malformed, "length out of range"))
    };
    // Lengths come from the file: checked arithmetic, so a crafted length is a rejection,
    // never an overflow.
    let meta_len = read_len(&mut at)?;
    let meta_end = at
        .checked_add(meta_len)
        .ok_or_else(|| reject(Malformed, "metadata length out of range"))?;
    let meta_bytes = body
        .get(at..meta_end)
        .ok_or_else(|| reject(Malformed, "truncated metadata"))?;
    at = meta_end;
    let meta: EntryMeta = serde_json::from_slice(meta_bytes)
        .map_err(|e| reject(Metadata, &format!("unreadable metadata: {e}")))?;
    let payload_len = read_len(&mut at)?;
    let payload_end = at
        .checked_add(payload_len)
        .ok_or_else(|| reject(Malformed, "payload length out of range"))?;
    let payload = body
        .get(at..payload_end)
        .ok_or_else(|| reject(Malformed, "truncated payload"))?;
    if payload_end != body.len() {
        return Err(reject(Malformed, "trailing bytes"));
    }
    if meta.key != *key {
        return Err(reject(
            Foreign,
            &format!(
                "foreign entry: stored under key {} but found at {}",
                meta.key.short(),
                key.short()
            ),
        ));
    }
    Ok(Entry {
        meta,
        payload: payload.to_vec(),
    })
}

/// Refuses a directory other users can write: its entries are native code we would run.
fn check_trust(dir: &Path) -> Result<()> {
    match files::check_private_dir(dir) {
        Ok(()) => Ok(()),
        Err(Untrusted::Unreadable(e)) => Err(Error::CacheIo {
            path: dir.to_path_buf(),
            what: "read the cache directory's permissions".into(),
            source: e,
        }),
        Err(Untrusted::Writable { by, mode }) => Err(Error::CacheUntrusted {
            path: dir.to_path_buf(),
            why: format!(
                "it is writable by {by} (mode {mode:o}); cached executables are native code, so \
                 only its owner may write it — run `chmod go-w` on it, or choose another \
                 NITRO_CACHE_DIR"
            ),
        }),
        Err(Untrusted::OtherOwner { owner, me }) => Err(Error::CacheUntrusted {
            path: dir.to_path_buf(),
            why: format!(
                "it belongs to another user (uid {owner}, this process runs as uid {me}); cached \
                 executables are native code, so use a cache directory you own (set \
                 NITRO_CACHE_DIR)"
            ),
        }),
    }
}

/// How long a process waits on another's compile lock before saying so.
const LOCK_NOTICE_AFTER: Duration = Duration::from_secs(1);

/// What [`open_checked`] found.
enum Checked {
    /// A regular file of ours, and its length.
    File(File, u64),
    /// Something that must not be read.
    Refused(RejectKind, &'static str),
}

/// Opens an entry or record for reading with the store's refusals ([`files::open_regular`]
/// for this user's files only), no larger than `max` bytes.
fn open_checked(path: &Path, max: u64) -> std::io::Result<Checked> {
    Ok(match files::open_regular(path, max, Owner::Me)? {
        Opened::File(f, len) => Checked::File(f, len),
        Opened::Refused(Refusal::TooLarge) => Checked::Refused(
            RejectKind::Malformed,
            "larger than any entry this store can hold",
        ),
        Opened::Refused(Refusal::Directory) => {
            Checked::Refused(RejectKind::Unreadable, "a directory, not an entry")
        }
        Opened::Refused(r) => Checked::Refused(RejectKind::Unreadable, r.why()),
    })
}

/// Writes `bytes` to `path` atomically ([`files::write_atomic`]).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], durable: bool) -> Result<()> {
    // Something that is not a file in the way (a directory left where an entry was) would
    // make every rename fail, and every run recompile: inside the store, it is ours to repair.
    if fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        let _ = fs::remove_dir_all(path);
    }
    files::write_atomic(path, bytes, durable).map_err(|f| Error::CacheIo {
        path: f.tmp,
        what: format!("{} a temporary entry", f.step),
        source: f.source,
    })
}

/// Makes `dir` a directory this process may keep native-code metadata in: created owner-only
/// (with its parents) when missing, then held to the store's trust rules ([`check_trust`]).
pub(crate) fn private_dir(dir: &Path) -> Result<()> {
    files::private_dir(dir).map_err(|e| Error::CacheIo {
        path: dir.to_path_buf(),
        what: "create the cache directory".into(),
        source: e,
    })?;
    check_trust(dir)
}

/// Makes `path` a private subdirectory of the store: created owner-only; if it exists, a real
/// directory (not a link) of this user, which is made owner-only when it is not (a store
/// created by an older version under a permissive umask); another user's is refused.
fn private_subdir(path: &Path) -> Result<()> {
    let io = |what: &str, e: std::io::Error| Error::CacheIo {
        path: path.to_path_buf(),
        what: what.to_owned(),
        source: e,
    };
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => private_dir_builder(false)
            .create(path)
            .map_err(|e| io("create a cache subdirectory", e)),
        Err(e) => Err(io("inspect a cache subdirectory", e)),
        Ok(m) if !m.is_dir() => {
            // Not a directory (a file, a link): ours to repair, inside a directory we own.
            let _ = fs::remove_file(path);
            private_dir_builder(false)
                .create(path)
                .map_err(|e| io("create a cache subdirectory", e))
        }
        Ok(m) => {
            #[cfg(unix)]
            {
                use std::os::unix::fs::{MetadataExt, PermissionsExt};
                if m.uid() != files::effective_uid() {
                    return Err(Error::CacheUntrusted {
                        path: path.to_path_buf(),
                        why: format!(
                            "it belongs to another user (uid {}); remove it, or choose another \
                             NITRO_CACHE_DIR",
                            m.uid()
                        ),
                    });
                }
                if m.permissions().mode() & 0o077 != 0 {
                    fs::set_permissions(path, fs::Permissions::from_mode(0o700))
                        .map_err(|e| io("make a cache subdirectory owner-only", e))?;
                }
            }
            let _ = m;
            Ok(())
        }
    }
}

/// The files of `dir` whose names pass `keep`, with their size and last modification.
fn listing(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<(PathBuf, u64, SystemTime)> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(&keep))
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            Some((e.path(), m.len(), m.modified().unwrap_or(UNIX_EPOCH)))
        })
        .collect()
}

/// Sorts a [`listing`] least recently modified first (ties by path: deterministic).
fn oldest_first(files: &mut [(PathBuf, u64, SystemTime)]) {
    files.sort_by(|a, b| a.2.cmp(&b.2).then_with(|| a.0.cmp(&b.0)));
}

/// Removes what older versions of the store kept and this one does not: `logical/` records
/// (one file per program configuration, never bounded) and per-key lock files (replaced by
/// shared ones named by a key prefix).
fn remove_legacy(dir: &Path) {
    let _ = fs::remove_dir_all(dir.join("logical"));
    if let Ok(rd) = fs::read_dir(dir.join(LOCKS)) {
        for e in rd.filter_map(|e| e.ok()) {
            let name = e.file_name();
            let per_key = name
                .to_str()
                .and_then(|n| n.strip_suffix(".lock"))
                .is_some_and(|stem| stem.len() == 64);
            if per_key {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

/// The process id written in a lock file by its holder, if readable.
fn lock_holder(path: &Path) -> Option<u32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Whether process `pid` is stopped (job control or a tracer): it will not finish its compile
/// until someone resumes it, so waiting for its lock is pointless. Linux `/proc` only; elsewhere
/// `false`.
fn process_is_stopped(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `pid (comm) S …`: the command may hold spaces and parentheses; the state follows the
    // last `)`.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .is_some_and(|state| state == "T" || state == "t")
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Seconds since the Unix epoch, for [`EntryMeta::created`].
pub fn unix_now() -> u64 {
    now_secs()
}

impl Store for DirStore {
    fn describe(&self) -> String {
        format!("the local store at {}", self.dir().display())
    }

    fn get(&self, key: &Digest) -> Result<Lookup> {
        let path = self.entry_path(key);
        let max = self.capacity.min(MAX_ENTRY_BYTES);
        let (mut file, len) = match open_checked(&path, max) {
            Ok(Checked::File(f, len)) => (f, len),
            Ok(Checked::Refused(kind, why)) => {
                Self::remove_any(&path);
                return Ok(Lookup::Rejected(Rejection::new(kind, why)));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Lookup::Absent),
            Err(_) if files::is_symlink(&path) => {
                Self::remove_any(&path);
                return Ok(Lookup::Rejected(Rejection::new(
                    RejectKind::Unreadable,
                    "a symbolic link, not an entry",
                )));
            }
            Err(e) => {
                return Err(Error::CacheIo {
                    path,
                    what: "open a cache entry".into(),
                    source: e,
                });
            }
        };
        let read = read_all(&mut file, len);
        let bytes = match read {
            Ok(bytes) => bytes,
            Err(e) => {
                Self::remove_any(&path);
                return Ok(Lookup::Rejected(Rejection::new(
                    RejectKind::Unreadable,
                    format!("unreadable: {e}"),
                )));
            }
        };
        match self.decode(key, &bytes) {
            Ok(entry) => {
                // Refresh last use for LRU; failure only makes eviction less precise.
                let _ = file.set_modified(SystemTime::now());
                Ok(Lookup::Hit(entry))
            }
            Err(why) => {
                // A signed entry is not damaged: a process configured with the key can use it.
                if why.kind != RejectKind::SignedNoKey {
                    let _ = fs::remove_file(&path);
                }
                Ok(Lookup::Rejected(why))
            }
        }
    }

    fn put(&self, entry: &Entry) -> Result<()> {
        let bytes = self.encode(entry)?;
        write_atomic(&self.entry_path(&entry.meta.key), &bytes, true)?;
        self.enforce_capacity();
        Ok(())
    }

    fn contains(&self, key: &Digest) -> bool {
        self.entry_path(key).exists()
    }

    fn clear(&self) -> Result<()> {
        for (path, _, _) in self.entries() {
            let _ = fs::remove_file(path);
        }
        if let Ok(rd) = fs::read_dir(self.dir.join(PROGRAMS)) {
            for e in rd.filter_map(|e| e.ok()) {
                let _ = fs::remove_file(e.path());
            }
        }
        Ok(())
    }

    fn program_record(&self, program: &Digest) -> Option<Vec<u8>> {
        let path = self.dir.join(PROGRAMS).join(format!("{program}"));
        files::read_private(&path, MAX_RECORD_BYTES)
    }

    fn record_program(&self, program: &Digest, record: &[u8]) -> Result<()> {
        let path = self.dir.join(PROGRAMS).join(format!("{program}"));
        // Records only explain misses: not worth a sync each.
        write_atomic(&path, record, false)?;
        // Bounded, checked every few writes (a directory listing is not free).
        if !RECORD_WRITES
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(RECORD_CHECK_EVERY)
        {
            return Ok(());
        }
        let mut records = self.records();
        if records.len() > MAX_RECORDS {
            oldest_first(&mut records);
            for (old, _, _) in &records[..records.len() - MAX_RECORDS] {
                let _ = fs::remove_file(old);
            }
        }
        Ok(())
    }

    fn lock(&self, key: &Digest, wait: Duration) -> Result<Option<KeyLock>> {
        let path = self.lock_path(key);
        let mut file = private_file()
            .create(true)
            .truncate(false)
            .read(true)
            .open(&path)
            .map_err(|e| Error::CacheIo {
                path: path.clone(),
                what: "open a lock file".into(),
                source: e,
            })?;
        let started = Instant::now();
        let deadline = started + wait;
        let mut announced = false;
        loop {
            match file.try_lock() {
                Ok(()) => {
                    // Say who holds it, for the processes that wait.
                    let _ = file.set_len(0);
                    let _ = file.write_all(format!("{}\n", std::process::id()).as_bytes());
                    return Ok(Some(KeyLock {
                        _file: Some(file),
                        _held: None,
                    }));
                }
                Err(fs::TryLockError::WouldBlock) => {
                    let holder = lock_holder(&path);
                    if let Some(pid) = holder.filter(|&p| process_is_stopped(p)) {
                        crate::settings::notice_once(
                            &format!("lock-stopped-{pid}"),
                            &format!(
                                "process {pid} holds the compile lock of a program this process \
                                 needs but is stopped (Ctrl-Z?); compiling here instead of waiting"
                            ),
                        );
                        return Ok(None);
                    }
                    if !announced && started.elapsed() >= LOCK_NOTICE_AFTER {
                        announced = true;
                        let who = holder.map_or_else(
                            || "another process".to_owned(),
                            |p| format!("process {p}"),
                        );
                        eprintln!(
                            "nitro: waiting for {who}, which is compiling a program this process \
                                 needs (at most {} s more; then this process compiles it itself)",
                            deadline.saturating_duration_since(Instant::now()).as_secs()
                        );
                    }
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(fs::TryLockError::Error(e)) => {
                    return Err(Error::CacheIo {
                        path,
                        what: "lock a cache key".into(),
                        source: e,
                    });
                }
            }
        }
    }

    fn size_bytes(&self) -> u64 {
        self.entries().iter().map(|e| e.1).sum()
    }
}
