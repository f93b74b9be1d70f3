//! The compile cache: programs in memory (L1) and on disk (L2), keyed on exactly what
//! determines them, with a reason for every miss.
//!
//! **L1** is keyed on (program identity, GraphConst digest and program-shaping handle settings,
//! input signature, backend identity). A hit never traces. **L2** is keyed on (program
//! fingerprint, backend identity, compile options): a new process traces — cheap — and loads the
//! serialized executable instead of compiling. Every miss has a [`MissReason`] naming what moved
//! and is logged once (`tracing`, INFO) with the program and the compile time.
//!
//! ```
//! use nitro::prelude::*;
//! use nitro::cache::{Cache, MissReason};
//! use nitro::program::Program;
//!
//! #[experiment]
//! pub struct Scale { #[graph_const] pub k: u32, #[device] pub w: Array }
//!
//! fn apply(v: &ScaleView<'_>, _: &()) -> Tensor { v.w * f64::from(*v.k) }
//! const APPLY: Program<Scale> = Scale::program("apply", apply);
//!
//! let cache = Cache::in_memory(16);
//! let backend = nitro::backend::interpreter();
//! let mut exp = Scale { k: 2, w: Array::zeros(DType::F32, &[3]) };
//! cache.get(backend, &APPLY, &exp, &())?;                 // miss: empty
//! exp.w = Array::full(&[3], 1.0f32);
//! cache.get(backend, &APPLY, &exp, &())?;                 // hit: values never reach the key
//! exp.k = 3;
//! cache.get(backend, &APPLY, &exp, &())?;                 // miss: `k` moved
//! let stats = cache.stats();
//! assert_eq!((stats.hits, stats.misses), (1, 2));
//! assert_eq!(cache.recent_misses()[1].reason.to_string(), "graph_const_changed: k 2 → 3");
//! # Ok::<(), nitro::Error>(())
//! ```

pub mod cost;
pub mod manifest;
mod progress;
mod reason;
pub mod remote;
mod stats;
pub mod store;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use cost::{CompileReport, ConstantCost, ProgramCost, Repeat, CONSTANT_BYTES_LINT};
pub use manifest::{store_key, Manifest, ManifestEntry};
pub use progress::{quietly, ANNOUNCE_AFTER};
pub use reason::{GraphConstChange, MissReason};
pub use remote::{LayeredStore, RedisStore, RemoteConfig, RemoteMode, Transfer};
pub use stats::{CacheStats, RemoteStats};
pub use store::{
    DirStore, Entry, EntryMeta, EntrySummary, Explanation, GcReport, Location, Lookup, RejectKind,
    Rejection, Store, Verified,
};

use crate::backend::{Backend, Executable, Identity};
use crate::error::{Error, Result};
use crate::experiment::Experiment;
use crate::hash::{ContentHasher, Digest};
use crate::program::{Outputs, Program, Traced};
use crate::trace::Tensor;
use crate::tree::{LeafPath, Node, Signature, Tree};

/// The default capacity of the process-wide cache, in programs.
pub const DEFAULT_CAPACITY: usize = 256;

/// The lint names a GraphConst field once it has recompiled one program this many times.
const LINT_REPEATS: u32 = 3;

/// The lint warns about a program with more variants than this, by default.
pub const DEFAULT_VARIANT_WARNING: usize = 8;

/// What the lint saw of one program identity.
#[derive(Default)]
struct LintState {
    /// Recompiles per GraphConst field.
    field_changes: HashMap<String, u32>,
    /// Distinct keys compiled.
    variants: std::collections::HashSet<Digest>,
    warned_variants: bool,
    warned_constants: bool,
}

/// A warning of the lint: a compile pattern that costs compiles a different declaration would
/// save.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "lint")]
pub enum Lint {
    /// One GraphConst field keeps changing and recompiling the program: a value swept or
    /// scheduled (a learning rate, a dropout rate) belongs in a `#[device]` field, where it is
    /// a traced input and changing it never recompiles.
    RepeatedGraphConst {
        /// The program identity.
        program: String,
        /// The field.
        field: String,
        /// Compiles it caused so far.
        compiles: u32,
    },
    /// One program has compiled more variants than the warning threshold.
    ManyVariants {
        /// The program identity.
        program: String,
        /// Distinct variants compiled.
        variants: usize,
    },
    /// A program embeds more than [`CONSTANT_BYTES_LINT`] bytes of constants (a GraphConst
    /// array made a literal): XLA copies and folds them at every compile.
    LargeConstants {
        /// The program identity.
        program: String,
        /// Its constants' bytes.
        bytes: u64,
        /// The GraphConst field of the largest, when one field holds exactly it.
        field: Option<String>,
    },
}

impl std::fmt::Display for Lint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lint::RepeatedGraphConst {
                program,
                field,
                compiles,
            } => write!(
                f,
                "#[graph_const] field `{field}` has changed {compiles} times, recompiling \
                 `{program}` each time; if it does not shape the graph (a learning rate, a \
                 coefficient), declare it #[device]: a traced input never recompiles"
            ),
            Lint::ManyVariants { program, variants } => write!(
                f,
                "`{program}` has compiled {variants} variants in this process; see \
                 `Cache::recent_misses` for what keeps moving (GraphConsts, batch shapes)"
            ),
            Lint::LargeConstants {
                program,
                bytes,
                field,
            } => {
                let from = field.as_deref().map_or(String::new(), |f| {
                    format!(", the largest from GraphConst field `{f}`")
                });
                write!(
                    f,
                    "`{program}` embeds {bytes} bytes of constants{from}: XLA copies and folds \
                     them at every compile, and a new value is a new program; data belongs in a \
                     #[device] field (a traced input: only its shape reaches the key). \
                     `nitro cache explain --cost` shows what the program holds"
                )
            }
        }
    }
}

/// How many misses [`Cache::recent_misses`] keeps.
const RECENT_MISSES: usize = 64;

/// How long a process waits for another process compiling the same program before compiling
/// it itself (the lease of the cross-process lock).
const COMPILE_LEASE: Duration = Duration::from_secs(120);

/// Says, once per process on stderr, that a compiled program of `program` could not be kept in
/// the persistent store (`serializing`: the backend could not serialize it; else the store could
/// not write it, `e` naming the path and what failed), so every later process compiles it again.
/// A shared server's faults are not said here: the shared store says them once itself.
fn say_store_write_failed(program: &str, e: &Error, serializing: bool) {
    if matches!(e, Error::RemoteCache { .. }) {
        return;
    }
    let message = if serializing {
        format!(
            "could not serialize `{program}` for the persistent compile cache ({e}), so it is not \
             kept and every run compiles it again; this is the backend's fault, worth a report \
             (set NITRO_CACHE=off to stop trying). Counted in CacheStats::store_write_failures; \
             later failures are not said again"
        )
    } else {
        format!(
            "could not write `{program}` to the persistent compile cache ({e}), so it is not \
             kept and every run compiles it again. Free disk space there, point NITRO_CACHE_DIR \
             at a writable directory, or set NITRO_CACHE=off to stop trying. Counted in \
             CacheStats::store_write_failures; later failures are not said again"
        )
    };
    crate::settings::notice_once("store-write-failed", &message);
}

/// A compiled program held by the cache: the executable and what it was compiled from.
#[derive(Debug)]
pub struct Compiled {
    /// The program identity (`my_crate::Digits::grad`).
    pub program: String,
    /// The emitted program's fingerprint.
    pub fingerprint: Digest,
    /// Every input's path and type, in argument order.
    pub inputs: Signature,
    /// The output types.
    pub outputs: Vec<crate::tree::LeafType>,
    /// The inputs the program reads as class indices ([`crate::trace::Graph::class_inputs`]).
    pub class_inputs: Vec<crate::trace::ClassInput>,
    /// The backend executable.
    pub executable: Box<dyn Executable>,
    /// Compile (or load) time.
    pub build_time: Duration,
    /// What the program holds and what it cost ([`ProgramCost`]): why its compile takes what
    /// it takes.
    pub cost: Arc<ProgramCost>,
    /// How the program is partitioned over a mesh ([`crate::trace::Graph::sharding`]): its
    /// arguments are split and its results put together by these specs.
    pub sharding: Option<crate::shard::ProgramSharding>,
}

/// What one lookup did: served from memory, loaded from the persistent store, or compiled.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum Outcome {
    /// Served from memory (L1), without compiling. (A program met through a code address this
    /// cache had not seen yet is traced once to confirm it is the held program; still a hit.)
    Hit,
    /// A miss served by loading the program from the persistent store (L2).
    Loaded {
        /// Why memory could not serve it.
        reason: MissReason,
    },
    /// A miss that compiled the program.
    Compiled {
        /// Why neither level could serve it.
        reason: MissReason,
    },
}

impl Outcome {
    /// Whether this lookup was a hit.
    pub fn is_hit(&self) -> bool {
        matches!(self, Outcome::Hit)
    }

    /// The miss reason; `None` for a hit.
    pub fn reason(&self) -> Option<&MissReason> {
        match self {
            Outcome::Hit => None,
            Outcome::Loaded { reason } | Outcome::Compiled { reason } => Some(reason),
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Hit => f.write_str("hit"),
            Outcome::Loaded { reason } => write!(f, "loaded ({})", loaded_reason(reason)),
            Outcome::Compiled { reason } => write!(f, "compiled ({reason})"),
        }
    }
}

/// How a load's reason reads: `empty` for a program loaded from the store is its first use in
/// this process (nothing moved since the store's record of it, or there is none), not a
/// program "never compiled".
fn loaded_reason(reason: &MissReason) -> std::borrow::Cow<'static, str> {
    match reason {
        MissReason::Empty => "empty: first use in this process".into(),
        other => other.to_string().into(),
    }
}

/// A program served by [`Cache::get`], and what the lookup did to serve it. Dereferences to
/// the [`Compiled`] program.
#[derive(Clone, Debug)]
pub struct Served {
    /// The compiled program.
    pub compiled: Arc<Compiled>,
    /// What this lookup did.
    pub outcome: Outcome,
    /// What this lookup spent tracing and building.
    pub timing: Timing,
}

/// What one lookup spent: tracing the program (zero for a hit through a known route, which
/// never traces) and compiling or loading it (zero for a hit).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Timing {
    /// Tracing the program into its graph (and fingerprinting it).
    pub trace: Duration,
    /// Compiling it, or loading it from the persistent store ([`Outcome`] says which).
    pub build: Duration,
    /// The compile this lookup spared: for a hit, what getting the held program cost; for a
    /// load, the stored program's recorded compile time less the load.
    pub saved: Duration,
}

impl Served {
    /// This hit, with the time its lookup spent tracing.
    fn traced_in(mut self, trace: Duration) -> Served {
        self.timing.trace = trace;
        self
    }
}

impl std::ops::Deref for Served {
    type Target = Compiled;

    fn deref(&self) -> &Compiled {
        &self.compiled
    }
}

/// One miss, as kept by [`Cache::recent_misses`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Miss {
    /// The program identity.
    pub program: String,
    /// Why it missed.
    pub reason: MissReason,
    /// Whether it was loaded from the persistent store instead of compiled.
    pub loaded: bool,
    /// Compile or load time, in milliseconds.
    pub ms: f64,
    /// Trace time, in milliseconds.
    pub trace_ms: f64,
}

/// What a key is made of, kept per entry (and, with a store, per program beside it) so that the
/// next miss can name what moved.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct KeyDetails {
    /// The program identity, in words.
    program: String,
    graph_const: Digest,
    graph_const_fields: Vec<(String, Digest)>,
    /// The GraphConst fields' parts ([`Experiment::graph_const_field_parts`]): what a miss
    /// names the moved sub-fields from (empty in details recorded before they were kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    graph_const_parts: Vec<crate::hash::Part>,
    settings: Digest,
    /// The whole input structure: Device fields, then the program's inputs.
    signature: Signature,
    backend: Digest,
    backend_components: Vec<(String, String)>,
    options: Digest,
    fingerprint: Digest,
    /// On a mesh, each input's name and spec (empty off one, and in details stored before
    /// partitioned programs).
    #[serde(default)]
    shardings: Vec<(String, String)>,
}

impl KeyDetails {
    /// What moved from `self` (an earlier use) to `now`, in the order a user fixes things:
    /// GraphConsts and handle settings, the input structure, the backend, the options, the
    /// code. `None` when nothing did.
    fn moved_to(&self, now: &KeyDetails) -> Option<MissReason> {
        let before = |name: &str| {
            self.graph_const_fields
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, d)| d)
        };
        let mut fields: Vec<String> = now
            .graph_const_fields
            .iter()
            .filter(|(name, digest)| before(name) != Some(digest))
            .map(|(name, _)| name.clone())
            .collect();
        fields.extend(
            self.graph_const_fields
                .iter()
                .filter(|(name, _)| !now.graph_const_fields.iter().any(|(n, _)| n == name))
                .map(|(name, _)| name.clone()),
        );
        if now.settings != self.settings {
            fields.push("<handle>".to_owned());
        }
        if fields.is_empty() && now.graph_const != self.graph_const {
            fields.push("<graph_const>".to_owned());
        }
        // A mesh that came, went or changed explains a GraphConst moved with it (the update
        // program's layout): name the mesh, as every program of the handle does.
        if now.backend != self.backend {
            let moved =
                Identity::first_difference(&self.backend_components, &now.backend_components)
                    .filter(|(component, _, _)| component == "sharding");
            if let Some((component, from, to)) = moved {
                if self.shardings.is_empty() || now.shardings.is_empty() {
                    return Some(MissReason::BackendChanged {
                        component,
                        from,
                        to,
                    });
                }
            }
        }
        // A spec that moved on the same mesh explains more than the GraphConst (the update
        // program's layout) or the backend component that carries it.
        if !self.shardings.is_empty() && !now.shardings.is_empty() {
            let moved = now.shardings.iter().find_map(|(input, to)| {
                let (_, from) = self.shardings.iter().find(|(i, _)| i == input)?;
                (from != to).then(|| MissReason::ShardingChanged {
                    input: input.clone(),
                    from: from.clone(),
                    to: to.clone(),
                })
            });
            if moved.is_some() {
                return moved;
            }
        }
        if !fields.is_empty() {
            let changes = reason::graph_const_changes(
                &self.graph_const_parts,
                &now.graph_const_parts,
                &fields,
            );
            return Some(MissReason::GraphConstChanged { fields, changes });
        }
        let changes = self.signature.diff(&now.signature);
        if !changes.is_empty() {
            return Some(MissReason::SignatureChanged { changes });
        }
        if now.backend != self.backend {
            let (component, from, to) =
                Identity::first_difference(&self.backend_components, &now.backend_components)
                    .unwrap_or_else(|| {
                        (
                            "identity".to_owned(),
                            self.backend.short().to_string(),
                            now.backend.short().to_string(),
                        )
                    });
            return Some(MissReason::BackendChanged {
                component,
                from,
                to,
            });
        }
        if now.options != self.options {
            return Some(MissReason::OptionsChanged);
        }
        if now.fingerprint != self.fingerprint {
            return Some(MissReason::CodeChanged {
                from: self.fingerprint.short().to_string(),
                to: now.fingerprint.short().to_string(),
            });
        }
        None
    }
}

/// A held program: one emitted program (one fingerprint) under one key.
struct Slot {
    compiled: Arc<Compiled>,
    details: Arc<KeyDetails>,
    /// The program identity this slot belongs to: the key of `State::last`.
    program: Digest,
    tick: u64,
}

#[derive(Default)]
struct State {
    /// Held programs by full key (the key's components and the program's fingerprint).
    slots: HashMap<Digest, Slot>,
    /// Which held program a key's components and a code address lead to, so that a hit needs
    /// no tracing. A program reached through a new code address (an inlined copy, a closure
    /// instantiated in another module) is traced once and routed to the slot of its
    /// fingerprint.
    routes: HashMap<(Digest, usize), Digest>,
    /// Full keys evicted by capacity, oldest first, at most `capacity` of them.
    ledger: VecDeque<Digest>,
    /// The key details last used (compiled or hit) per program identity (for miss reasons).
    last: HashMap<Digest, Arc<KeyDetails>>,
    tick: u64,
    stats: CacheStats,
    recent: VecDeque<Miss>,
    /// What the lint has seen per program identity.
    lint: HashMap<Digest, LintState>,
    /// Warnings given, in order.
    lints: Vec<Lint>,
    warm_mark: Option<u64>,
    /// `stats.misses` at the last reset: the acceptance check counts misses since then.
    misses_at_reset: u64,
}

/// An in-flight compile that other threads wait for.
#[derive(Default)]
struct Flight {
    done: Mutex<Option<std::result::Result<Arc<Compiled>, String>>>,
    ready: Condvar,
}

impl Flight {
    fn finish(&self, outcome: std::result::Result<Arc<Compiled>, String>) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        if done.is_none() {
            *done = Some(outcome);
        }
        self.ready.notify_all();
    }
}

/// The leader's hold on a flight: completes it and removes it from the map when dropped, so a
/// leader that unwinds (a backend that panics) never leaves its waiters, or later requests for
/// the same key, blocked forever.
struct FlightGuard<'a> {
    cache: &'a Cache,
    key: Digest,
    flight: Arc<Flight>,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        self.flight
            .finish(Err("the compiling thread panicked".into()));
        self.cache
            .flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

/// A compile cache: L1 in memory, optionally backed by a persistent [`Store`] (L2).
///
/// The process-wide cache is [`global`]; caches created with [`Cache::new`] or
/// [`Cache::in_memory`] belong to their owner.
pub struct Cache {
    capacity: usize,
    store: Option<Arc<dyn Store>>,
    state: Mutex<State>,
    flights: Mutex<HashMap<Digest, Arc<Flight>>>,
    verify: AtomicBool,
    /// A setting of the environment that could not be honoured (the process-wide cache only):
    /// every lookup fails with it.
    misconfigured: Option<String>,
    /// The lint warns past this many variants of one program.
    variant_warning: AtomicUsize,
    /// How long a compile runs before it says so on stderr, in milliseconds.
    announce_after_ms: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("capacity", &self.capacity)
            .field("store", &self.store)
            .field("stats", &self.stats())
            .finish()
    }
}

/// The process-wide cache, configured from the environment:
///
/// - `NITRO_CACHE=off` (or `0`, `false`, `no`; any case) disables the persistent level;
/// - `NITRO_CACHE_DIR` moves it (default: [`default_cache_dir`]);
/// - `NITRO_CACHE_KEY` (64 hex digits) signs its entries;
/// - `NITRO_VERIFY_KEYS=1` (or `true`, `yes`, `on`) turns on verify mode;
/// - `NITRO_CACHE_REMOTE` (`redis://host:port/db` or `redis+unix:///path/to/socket`) puts a
///   shared server behind the local directory ([`LayeredStore`]; it requires `NITRO_CACHE_KEY`),
///   with `NITRO_CACHE_REMOTE_PREFIX`, `NITRO_CACHE_REMOTE_MODE=ro` and the other settings
///   [`RemoteConfig::from_env`] lists.
///
/// A setting the user gave that cannot be honoured — a value that is not a switch, a malformed
/// key, a cache directory that is refused — makes every lookup on this cache fail with
/// [`Error::Misconfigured`] naming it (it is never silently ignored). A default that cannot be
/// honoured (no cache directory, or the default one refused) disables the persistent level and
/// says so once on stderr.
pub fn global() -> &'static Cache {
    static GLOBAL: OnceLock<Cache> = OnceLock::new();
    GLOBAL.get_or_init(|| {
        let (store, mut problem) = match default_store() {
            Ok(s) => (s, None),
            Err(e) => (None, Some(e.to_string())),
        };
        let mut cache = Cache::new(DEFAULT_CAPACITY, store);
        match crate::settings::switch("NITRO_VERIFY_KEYS") {
            Ok(on) => cache.set_verify(on.unwrap_or(false)),
            Err(e) => problem = problem.or(Some(e.to_string())),
        }
        cache.misconfigured = problem;
        cache
    })
}

/// The persistent store the environment asks for (`None` when `NITRO_CACHE` is off, or when
/// the default directory cannot be used — said once on stderr), with a shared server behind it
/// when `NITRO_CACHE_REMOTE` names one (see [`global`]). An explicit setting that cannot be
/// honoured is an error.
pub fn default_store() -> Result<Option<Arc<dyn Store>>> {
    if crate::settings::switch("NITRO_CACHE")? == Some(false) {
        return Ok(None);
    }
    let key = match std::env::var("NITRO_CACHE_KEY") {
        Ok(hex) if !hex.trim().is_empty() => Some(
            *hex.trim()
                .parse::<Digest>()
                .map_err(|e| Error::InvalidSetting {
                    variable: "NITRO_CACHE_KEY",
                    value: "<redacted>".into(),
                    expected: format!("64 hex digits (a 32-byte signing key): {e}"),
                })?
                .as_bytes(),
        ),
        _ => None,
    };
    let remote = match RemoteConfig::from_env()? {
        Some(config) => Some(RedisStore::open(config, key)?),
        None => None,
    };
    let local = local_store(key)?;
    Ok(match (local, remote) {
        (Some(local), Some(remote)) => Some(Arc::new(LayeredStore::new(local, remote)?)),
        (None, Some(remote)) => Some(Arc::new(remote)),
        (Some(local), None) => Some(Arc::new(local)),
        (None, None) => None,
    })
}

/// The local store the environment asks for: `NITRO_CACHE_DIR`, else the default directory
/// (`None`, said once on stderr, when that cannot be used).
fn local_store(key: Option<[u8; 32]>) -> Result<Option<DirStore>> {
    let open = |dir: std::path::PathBuf| DirStore::open(dir, store::DEFAULT_CAPACITY_BYTES, key);
    match std::env::var_os("NITRO_CACHE_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => open(std::path::PathBuf::from(dir)).map(Some),
        None => {
            let Some(dir) = default_cache_dir() else {
                crate::settings::notice_once(
                    "cache-dir",
                    "no cache directory could be found (no home directory), so compiled programs \
                     are not kept between runs; set NITRO_CACHE_DIR to keep them",
                );
                return Ok(None);
            };
            match open(dir) {
                Ok(s) => Ok(Some(s)),
                Err(e) => {
                    crate::settings::notice_once(
                        "cache-dir",
                        &format!(
                            "the default compile cache is not usable, so compiled programs are \
                             not kept between runs ({e}); set NITRO_CACHE_DIR to another directory"
                        ),
                    );
                    Ok(None)
                }
            }
        }
    }
}

/// The platform's cache directory for nitro: `nitro` inside [`dirs::cache_dir`] —
/// `$XDG_CACHE_HOME` when it is an absolute path (a relative one is ignored, as the XDG spec
/// asks), else `~/.cache` on Linux, `~/Library/Caches` on macOS, `{FOLDERID_LocalAppData}` on
/// Windows. The home directory is found without `HOME` where the platform allows.
pub fn default_cache_dir() -> Option<std::path::PathBuf> {
    crate::files::default_cache_dir()
}

/// The process-wide cache's statistics.
pub fn cache_stats() -> CacheStats {
    global().stats()
}

/// Resets the process-wide cache (see [`Cache::reset`]).
pub fn cache_reset() -> Result<()> {
    global().reset()
}

/// The acceptance check on the process-wide cache (see [`Cache::assert_no_recompile_after_warmup`]).
pub fn assert_no_recompile_after_warmup() -> Result<()> {
    global().assert_no_recompile_after_warmup()
}

/// Feeds one node of a walk into the signature digest: its path and kind (leaf types, sequence
/// lengths, option presence), never values. Must agree with [`Signature`]'s entries: a walk
/// that differs in any node gives another digest.
fn walk_digest(h: &mut ContentHasher, path: &str, node: Node<'_>) {
    h.write_str(path);
    match node {
        Node::Leaf(a) => {
            h.write_u8(0);
            crate::ContentHash::content_hash(&a.dtype(), h);
            h.write_len(a.dims().len());
            for &d in a.dims() {
                h.write_len(d);
            }
        }
        Node::Seq(len) => {
            h.write_u8(1);
            h.write_len(len);
        }
        Node::None => h.write_u8(2),
        Node::Some => h.write_u8(3),
    }
}

/// The full key of a held program: the key's components and the emitted program's fingerprint.
fn full_key(components: &Digest, fingerprint: &Digest) -> Digest {
    let mut h = ContentHasher::new();
    h.write_digest(components);
    h.write_digest(fingerprint);
    h.finish()
}

impl Cache {
    /// A cache holding at most `capacity` programs in memory, backed by `store` (L2) if given.
    pub fn new(capacity: usize, store: Option<Arc<dyn Store>>) -> Cache {
        Cache {
            capacity,
            store,
            state: Mutex::new(State::default()),
            flights: Mutex::new(HashMap::new()),
            verify: AtomicBool::new(false),
            misconfigured: None,
            variant_warning: AtomicUsize::new(DEFAULT_VARIANT_WARNING),
            announce_after_ms: std::sync::atomic::AtomicU64::new(ANNOUNCE_AFTER.as_millis() as u64),
        }
    }

    /// A memory-only cache of `capacity` programs (capacity 0: every lookup misses, nothing is
    /// retained).
    pub fn in_memory(capacity: usize) -> Cache {
        Cache::new(capacity, None)
    }

    /// Turns verify mode on or off: on an L1 hit, re-trace and compare fingerprints; a program
    /// that changed without its key moving is reported as [`Error::StaleKey`].
    pub fn set_verify(&self, on: bool) {
        self.verify.store(on, Ordering::Relaxed);
    }

    /// Whether verify mode is on.
    pub fn verify(&self) -> bool {
        self.verify.load(Ordering::Relaxed)
    }

    /// The persistent store, if any.
    pub fn store(&self) -> Option<&Arc<dyn Store>> {
        self.store.as_ref()
    }

    fn lock_state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent state (every mutation is complete
        // before any call that could panic), so poisoning is safe to ignore.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The compiled program for `program` on `experiment` and `inputs`: from memory, from the
    /// persistent store, or compiled now — and which of the three this call did, with the
    /// reason of a miss ([`Served::outcome`]).
    ///
    /// The key is computed from `experiment` on every call (its GraphConst fields are hashed by
    /// content); to hash them once for many lookups, see [`Prepared`].
    pub fn get<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        backend: &dyn Backend,
        program: &Program<E, M, O>,
        experiment: &E,
        inputs: &I,
    ) -> Result<Served> {
        self.get_prepared(backend, program, &Prepared::new(experiment), inputs)
    }

    /// Like [`Cache::get`], on an experiment whose GraphConst digests were computed once by
    /// [`Prepared::new`]. The `Prepared` borrows the experiment, so its GraphConsts cannot
    /// change while the digests are in use: a precomputed key never describes other values.
    pub fn get_prepared<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        backend: &dyn Backend,
        program: &Program<E, M, O>,
        prepared: &Prepared<'_, E>,
        inputs: &I,
    ) -> Result<Served> {
        self.get_keyed(
            backend,
            program,
            prepared.experiment,
            inputs,
            &KeyParts {
                graph_const: prepared.graph_const,
                graph_const_fields: &prepared.fields,
                settings: Digest::default(),
            },
        )
    }

    /// The lookup behind [`Cache::get`], with key parts that a caller inside the crate (the
    /// training handle, which owns its experiment and recomputes the parts whenever a
    /// GraphConst changes through it) computed once. Never public: parts detached from the
    /// values they describe would serve a program for other GraphConst values.
    pub(crate) fn get_keyed<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        backend: &dyn Backend,
        program: &Program<E, M, O>,
        experiment: &E,
        inputs: &I,
        parts: &KeyParts<'_>,
    ) -> Result<Served> {
        self.check_configured()?;
        let components = key_components(backend, program, experiment, inputs, parts);
        let address = program.code_address();

        if let Some(hit) = self.hit_route(&components, address) {
            return self.verified(hit, program, experiment, inputs, backend);
        }

        // Tracing first: a traced program that asks the cache for a program (its own or
        // another) fails here with `NestedTrace`, never waits on a compile that waits on it.
        let trace_started = Instant::now();
        let traced = program.trace_on(experiment, inputs, backend)?;
        let trace_time = trace_started.elapsed();
        let key = full_key(&components, &traced.fingerprint);
        if let Some(hit) = self.hit_traced(&key, &components, address) {
            return Ok(hit.traced_in(trace_time));
        }
        let program_id = program.identity();

        // Single flight: the first requester compiles, the others wait for it. The slot is
        // checked again under the flights lock: a leader fills its slot before it leaves the
        // map, so a request that missed above while that leader was finishing sees one or the
        // other here, and never compiles the key a second time.
        let (flight, leader) = {
            let mut flights = self.flights.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(hit) = self.hit_traced(&key, &components, address) {
                return Ok(hit.traced_in(trace_time));
            }
            match flights.get(&key) {
                Some(f) => (f.clone(), false),
                None => {
                    let f = Arc::new(Flight::default());
                    flights.insert(key, f.clone());
                    (f, true)
                }
            }
        };
        if !leader {
            let mut done = flight.done.lock().unwrap_or_else(|p| p.into_inner());
            while done.is_none() {
                done = flight.ready.wait(done).unwrap_or_else(|p| p.into_inner());
            }
            return match &*done {
                Some(Ok(c)) => {
                    let c = c.clone();
                    drop(done);
                    // Held now unless capacity 0 (or already evicted): a hit either way, the
                    // compile was shared.
                    if let Some(hit) = self.hit_traced(&key, &components, address) {
                        return Ok(hit.traced_in(trace_time));
                    }
                    let mut st = self.lock_state();
                    st.stats.hits += 1;
                    st.stats.saved_ms += c.build_time.as_secs_f64() * 1e3;
                    let saved = c.build_time;
                    Ok(Served {
                        compiled: c,
                        outcome: Outcome::Hit,
                        timing: Timing {
                            trace: trace_time,
                            build: Duration::ZERO,
                            saved,
                        },
                    })
                }
                Some(Err(msg)) => Err(Error::CompileFailedElsewhere {
                    program: program_id,
                    message: msg.clone(),
                }),
                None => Err(Error::CompileFailedElsewhere {
                    program: program_id,
                    message: "no result".into(),
                }),
            };
        }
        let guard = FlightGuard {
            cache: self,
            key,
            flight,
        };
        // The GraphConst fields' parts, recorded with the key's details so that the next miss
        // names the sub-field that moved: hashed again only here, on a miss.
        let gc_parts = experiment.graph_const_field_parts();
        let result = self.miss(
            backend,
            program_id,
            (traced, trace_time),
            (parts, gc_parts),
            (components, key, address),
        );
        guard.flight.finish(match &result {
            Ok(c) => Ok(c.compiled.clone()),
            Err(e) => Err(e.to_string()),
        });
        drop(guard);
        result
    }

    /// The error every lookup gives while the cache's settings are wrong (a bad
    /// `NITRO_CACHE_*` value), before it does anything.
    fn check_configured(&self) -> Result<()> {
        match &self.misconfigured {
            Some(message) => Err(Error::Misconfigured {
                message: message.clone(),
            }),
            None => Ok(()),
        }
    }

    /// What [`Cache::get`] would do for `program` on `experiment` and `inputs` — serve it from
    /// memory, load it from the local store, fetch it from a shared server, or compile it, with
    /// the miss reason and the time the store's record says the program's last compile (or
    /// load) took — found by tracing and keying it, **without compiling or loading anything**
    /// (the cache's counters do not move). The preflight of [`crate::train::Nitro::plan`].
    pub fn probe<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        backend: &dyn Backend,
        program: &Program<E, M, O>,
        experiment: &E,
        inputs: &I,
    ) -> Result<Probe> {
        self.check_configured()?;
        let prepared = Prepared::new(experiment);
        let parts = KeyParts {
            graph_const: prepared.graph_const,
            graph_const_fields: &prepared.fields,
            settings: Digest::default(),
        };
        let components = key_components(backend, program, experiment, inputs, &parts);
        let program_id = program.identity();
        let held = |key: &Digest| {
            let st = self.lock_state();
            st.slots.get(key).map(|s| s.compiled.fingerprint)
        };
        let routed = {
            let st = self.lock_state();
            st.routes
                .get(&(components, program.code_address()))
                .copied()
        };
        if let Some(fingerprint) = routed.and_then(|k| held(&k)) {
            return Ok(Probe {
                program: program_id,
                will: Will::Hit,
                reason: None,
                compile_ms: None,
                load_ms: None,
                fingerprint,
            });
        }
        let traced = program.trace_on(experiment, inputs, backend)?;
        let key = full_key(&components, &traced.fingerprint);
        if held(&key).is_some() {
            return Ok(Probe {
                program: program_id,
                will: Will::Hit,
                reason: None,
                compile_ms: None,
                load_ms: None,
                fingerprint: traced.fingerprint,
            });
        }
        let gc_parts = experiment.graph_const_field_parts();
        let details = key_details(backend, &program_id, &traced, &parts, gc_parts);
        let program_key = Digest::of(program_id.as_str());
        let store = self.store.as_ref().filter(|_| backend.persistent());
        let located = store.and_then(|s| s.locate(&l2_key(backend, &traced.fingerprint)));
        let reason = self
            .reason_here(&key, &program_key, &details)
            .unwrap_or_else(|| self.reason_stored(&program_key, &details));
        let record = recorded_times(
            store.map(|s| &**s),
            &l2_key(backend, &traced.fingerprint),
            &program_key,
        );
        let will = match located {
            Some(Location::Local) => Will::Load,
            Some(Location::Remote) => Will::Fetch,
            None => Will::Compile,
        };
        Ok(Probe {
            program: program_id,
            will,
            reason: Some(reason),
            compile_ms: record.compile_ms,
            load_ms: record.load_ms,
            fingerprint: traced.fingerprint,
        })
    }

    /// In verify mode, re-traces a hit and refuses it when the program moved without its key.
    fn verified<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        hit: Arc<Compiled>,
        program: &Program<E, M, O>,
        experiment: &E,
        inputs: &I,
        backend: &dyn Backend,
    ) -> Result<Served> {
        if self.verify.load(Ordering::Relaxed) {
            let traced = program.trace_on(experiment, inputs, backend)?;
            if traced.fingerprint != hit.fingerprint {
                return Err(Error::StaleKey {
                    program: program.identity(),
                    was: hit.fingerprint.short().to_string(),
                    now: traced.fingerprint.short().to_string(),
                });
            }
        }
        let saved = hit.build_time;
        Ok(Served {
            compiled: hit,
            outcome: Outcome::Hit,
            timing: Timing {
                saved,
                ..Timing::default()
            },
        })
    }

    /// A hit through a known route (key components and code address): no tracing.
    fn hit_route(&self, components: &Digest, address: usize) -> Option<Arc<Compiled>> {
        let mut st = self.lock_state();
        let key = *st.routes.get(&(*components, address))?;
        Some(Self::count_hit(&mut st, &key)?.compiled)
    }

    /// A hit on the full key of a traced program; learns the route of its code address.
    fn hit_traced(&self, key: &Digest, components: &Digest, address: usize) -> Option<Served> {
        let mut st = self.lock_state();
        let served = Self::count_hit(&mut st, key)?;
        st.routes.insert((*components, address), *key);
        Some(served)
    }

    fn count_hit(st: &mut State, key: &Digest) -> Option<Served> {
        st.tick += 1;
        let tick = st.tick;
        let slot = st.slots.get_mut(key)?;
        slot.tick = tick;
        let compiled = slot.compiled.clone();
        let (program, details) = (slot.program, slot.details.clone());
        // The program's last-used key, so that the next miss names what moved since then.
        if let Some(last) = st.last.get_mut(&program) {
            if !Arc::ptr_eq(last, &details) {
                *last = details;
            }
        }
        st.stats.hits += 1;
        st.stats.saved_ms += compiled.build_time.as_secs_f64() * 1e3;
        let saved = compiled.build_time;
        Some(Served {
            compiled,
            outcome: Outcome::Hit,
            timing: Timing {
                saved,
                ..Timing::default()
            },
        })
    }

    /// A lookup that missed in memory: the program loaded from the persistent store or
    /// compiled ([`Cache::load_or_compile`]), written back to the store with its record
    /// ([`Cache::write_back`]), and admitted to memory ([`Cache::admit`]).
    fn miss(
        &self,
        backend: &dyn Backend,
        program_id: String,
        (traced, trace_time): (Traced, Duration),
        (parts, gc_parts): (&KeyParts<'_>, Vec<crate::hash::Part>),
        (components, key, address): (Digest, Digest, usize),
    ) -> Result<Served> {
        let details = key_details(backend, &program_id, &traced, parts, gc_parts);
        let l2_key = l2_key(backend, &traced.fingerprint);
        let program_key = Digest::of(program_id.as_str());

        // What moved in this process is known before the persistent level is asked; what moved
        // since another process used this program is asked of the store's record of it.
        let known = self.reason_here(&key, &program_key, &details);
        let store = self.store.as_deref().filter(|_| backend.persistent());
        let _lock = match store {
            Some(s) => s.lock(&l2_key, COMPILE_LEASE).unwrap_or(None),
            None => None,
        };
        // What this entry last cost here: shown by a long compile, kept by the write-back.
        let before = recorded_times(store, &l2_key, &program_key);
        let built = self.load_or_compile(
            backend,
            store,
            &l2_key,
            &traced,
            &program_id,
            before.compile_ms,
        )?;
        let reason = match known {
            Some(r) => r,
            None => self.reason_stored(&program_key, &details),
        };
        // A program that was stored but could not be used is not `empty`: name the fault.
        let reason = match (reason, &built.rejected) {
            (MissReason::Empty | MissReason::Evicted, Some(why)) => MissReason::StoreRejected {
                why: why.kind.name().to_owned(),
            },
            (reason, _) => reason,
        };
        let mut cost = ProgramCost::of(
            &program_id,
            &traced.graph,
            traced.text.len(),
            parts.graph_const_fields,
        );
        cost.trace_ms = Some(trace_time.as_secs_f64() * 1e3);
        cost.compile_ms = if built.loaded {
            built.stored_compile_ms.or(before.compile_ms)
        } else {
            Some(built.build_time.as_secs_f64() * 1e3)
        };
        let cost = Arc::new(cost);
        let write_failed = match store {
            Some(store) => self.write_back(
                backend,
                store,
                &built,
                &traced,
                (&program_id, &program_key),
                (&details, &before, &cost),
            ),
            None => false,
        };
        let ms = built.build_time.as_secs_f64() * 1e3;
        if built.loaded {
            let from = store.map_or_else(String::new, |s| s.describe());
            let reason = loaded_reason(&reason);
            tracing::info!(program = %program_id, reason = %reason, ms, from = %from, "nitro: not in memory; loaded from the store (no compile)");
        } else {
            tracing::info!(program = %program_id, reason = %reason, ms, "nitro: compile-cache miss; compiled");
        }
        let admission = Admission {
            program_id,
            program_key,
            details,
            reason,
            write_failed,
            trace_time,
            route: (components, key, address),
            cost,
        };
        Ok(self.admit(traced, built, admission))
    }

    /// The executable of `traced`: loaded from `store` when it holds the program (and the
    /// entry is sound), else compiled — a compile past a second saying so on stderr, with
    /// `last_ms`, what its last compile here took.
    fn load_or_compile(
        &self,
        backend: &dyn Backend,
        store: Option<&dyn Store>,
        l2_key: &Digest,
        traced: &Traced,
        program_id: &str,
        last_ms: Option<f64>,
    ) -> Result<Built> {
        let started = Instant::now();
        let mut executable = None;
        let mut rejected = None;
        let mut stored_compile_ms = None;
        if let Some(store) = store {
            match store.get(l2_key) {
                Ok(Lookup::Hit(entry)) if entry.meta.fingerprint != traced.fingerprint => {
                    rejected = Some(Rejection::new(
                        RejectKind::Foreign,
                        "the stored program's fingerprint is not the traced program's",
                    ));
                }
                Ok(Lookup::Hit(entry)) => match backend.load(&entry.payload, &traced.graph) {
                    Ok(exe) => {
                        stored_compile_ms = Some(entry.meta.compile_ms);
                        executable = Some(exe)
                    }
                    Err(e) => rejected = Some(Rejection::new(RejectKind::Load, e.to_string())),
                },
                Ok(Lookup::Rejected(why)) => rejected = Some(why),
                Ok(Lookup::Absent) => {}
                Err(e) => {
                    tracing::warn!(program = %program_id, "nitro: persistent cache unreadable: {e}")
                }
            }
        }
        if let Some(why) = &rejected {
            tracing::warn!(program = %program_id, "nitro: did not load a stored program ({why}); recompiling");
        }
        let loaded = executable.is_some();
        let executable = match executable {
            Some(exe) => exe,
            None => {
                // A compile of more than a second says so, with what it cost here last time.
                let after = Duration::from_millis(self.announce_after_ms.load(Ordering::Relaxed));
                let _watch = progress::Watch::start(program_id, last_ms, after);
                backend.compile(&traced.graph, &traced.text)?
            }
        };
        Ok(Built {
            executable,
            loaded,
            rejected,
            stored_compile_ms,
            build_time: started.elapsed(),
        })
    }

    /// Writes a compiled program back to `store` (not one it loaded, and not over an entry
    /// signed with a key this process lacks), then the program's record: what its key was made
    /// of (for the next miss's reason) and what it last cost to compile and to load (for a
    /// preflight's estimate; `before`, the record as it was, keeps what this lookup did not
    /// measure). Whether the write failed.
    fn write_back(
        &self,
        backend: &dyn Backend,
        store: &dyn Store,
        built: &Built,
        traced: &Traced,
        (program_id, program_key): (&str, &Digest),
        (details, before, cost): (&KeyDetails, &ProgramTimes, &ProgramCost),
    ) -> bool {
        let identity = backend.identity();
        let ms = built.build_time.as_secs_f64() * 1e3;
        let keep_stored = built
            .rejected
            .as_ref()
            .is_some_and(|r| r.kind == RejectKind::SignedNoKey);
        let mut write_failed = false;
        if !built.loaded && !keep_stored {
            match built.executable.serialize() {
                Ok(payload) => {
                    let entry = Entry {
                        meta: EntryMeta {
                            key: l2_key(backend, &traced.fingerprint),
                            program: program_id.to_owned(),
                            fingerprint: traced.fingerprint,
                            backend: identity.digest,
                            backend_description: identity.description.clone(),
                            options: identity.options,
                            compile_ms: ms,
                            created: store::unix_now(),
                        },
                        payload,
                    };
                    if let Err(e) = store.put(&entry) {
                        write_failed = true;
                        tracing::warn!(program = %program_id, "nitro: could not store a compiled program: {e}");
                        say_store_write_failed(program_id, &e, false);
                    }
                }
                Err(e) => {
                    write_failed = true;
                    tracing::warn!(program = %program_id, "nitro: could not serialize a compiled program: {e}");
                    say_store_write_failed(program_id, &e, true);
                }
            }
        }
        let record = ProgramRecord {
            details,
            cost,
            times: ProgramTimes {
                compile_ms: if built.loaded {
                    built.stored_compile_ms.or(before.compile_ms)
                } else {
                    Some(ms)
                },
                load_ms: if built.loaded {
                    Some(ms)
                } else {
                    before.load_ms
                },
            },
        };
        if let Ok(record) = serde_json::to_vec(&record) {
            // The program's latest use (for the next miss's reason, in any process), and this
            // entry's own record (for `explain` and a preflight's times of this entry).
            let _ = store.record_program(program_key, &record);
            let entry = l2_key(backend, &traced.fingerprint);
            let _ = store.record_program(&store::entry_record_key(&entry), &record);
        }
        write_failed
    }

    /// Admits a built program to memory: the statistics, the recent misses, the lint, the
    /// program's last key, the LRU slots (evicting the least recently used past capacity) and
    /// the route of its code address. What the lookup serves.
    fn admit(&self, traced: Traced, built: Built, a: Admission) -> Served {
        let Admission {
            program_id,
            program_key,
            details,
            reason,
            write_failed,
            trace_time,
            route: (components, key, address),
            cost,
        } = a;
        let Built {
            executable,
            loaded,
            rejected,
            stored_compile_ms,
            build_time,
        } = built;
        let ms = build_time.as_secs_f64() * 1e3;
        let compiled = Arc::new(Compiled {
            program: program_id.clone(),
            fingerprint: traced.fingerprint,
            inputs: traced.inputs,
            outputs: traced.outputs,
            class_inputs: traced.graph.class_inputs.clone(),
            executable,
            build_time,
            cost: cost.clone(),
            sharding: traced.graph.sharding.clone(),
        });
        let mut st = self.lock_state();
        st.stats.misses += 1;
        *st.stats
            .misses_by_reason
            .entry(reason.name().to_owned())
            .or_default() += 1;
        if write_failed {
            st.stats.store_write_failures += 1;
        }
        if rejected.is_some() {
            st.stats.store_rejected += 1;
        }
        if loaded {
            st.stats.l2_hits += 1;
            st.stats.load_ms += ms;
            st.stats.saved_ms += stored_compile_ms.map_or(0.0, |c| (c - ms).max(0.0));
        } else {
            st.stats.compiles += 1;
            st.stats.compile_ms += ms;
        }
        if st.recent.len() == RECENT_MISSES {
            st.recent.pop_front();
        }
        st.recent.push_back(Miss {
            program: program_id.clone(),
            reason: reason.clone(),
            loaded,
            ms,
            trace_ms: trace_time.as_secs_f64() * 1e3,
        });
        self.lint(&mut st, (program_key, &program_id), key, &reason, &cost);
        let details = Arc::new(details);
        st.last.insert(program_key, details.clone());
        st.ledger.retain(|k| *k != key);
        if self.capacity > 0 {
            while !st.slots.contains_key(&key) && st.slots.len() >= self.capacity {
                // Deterministic LRU: the smallest tick goes.
                let Some((&victim, _)) = st.slots.iter().min_by_key(|(_, s)| s.tick) else {
                    break;
                };
                st.slots.remove(&victim);
                st.routes.retain(|_, k| *k != victim);
                st.stats.evictions += 1;
                st.ledger.push_back(victim);
                while st.ledger.len() > self.capacity {
                    st.ledger.pop_front();
                }
            }
            st.tick += 1;
            let tick = st.tick;
            st.slots.insert(
                key,
                Slot {
                    compiled: compiled.clone(),
                    details,
                    program: program_key,
                    tick,
                },
            );
            st.routes.insert((components, address), key);
        }
        st.stats.entries = st.slots.len() as u64;
        st.stats.estimated_bytes = st
            .slots
            .values()
            .map(|s| s.compiled.executable.size_bytes())
            .sum();
        let outcome = if loaded {
            Outcome::Loaded { reason }
        } else {
            Outcome::Compiled { reason }
        };
        Served {
            compiled,
            outcome,
            timing: Timing {
                trace: trace_time,
                build: build_time,
                saved: match stored_compile_ms {
                    Some(ms) if loaded => Duration::try_from_secs_f64(ms / 1e3)
                        .unwrap_or_default()
                        .saturating_sub(build_time),
                    _ => Duration::ZERO,
                },
            },
        }
    }

    /// The lint: a GraphConst field whose changes keep recompiling one program is named once,
    /// with the advice to make it `#[device]`; a program with many variants is named once.
    fn lint(
        &self,
        st: &mut State,
        (program, name): (Digest, &str),
        key: Digest,
        reason: &MissReason,
        cost: &ProgramCost,
    ) {
        let variant_warning = self.variant_warning.load(Ordering::Relaxed);
        let lint = st.lint.entry(program).or_default();
        let mut found = Vec::new();
        if let MissReason::GraphConstChanged { fields, .. } = reason {
            for field in fields.iter().filter(|f| !f.starts_with('<')) {
                let n = lint.field_changes.entry(field.clone()).or_default();
                *n += 1;
                if *n == LINT_REPEATS {
                    found.push(Lint::RepeatedGraphConst {
                        program: name.to_owned(),
                        field: field.clone(),
                        compiles: *n,
                    });
                }
            }
        }
        lint.variants.insert(key);
        if lint.variants.len() > variant_warning && !lint.warned_variants {
            lint.warned_variants = true;
            found.push(Lint::ManyVariants {
                program: name.to_owned(),
                variants: lint.variants.len(),
            });
        }
        if cost.constant_bytes > CONSTANT_BYTES_LINT && !lint.warned_constants {
            lint.warned_constants = true;
            found.push(Lint::LargeConstants {
                program: name.to_owned(),
                bytes: cost.constant_bytes,
                field: cost.constants.first().and_then(|c| c.field.clone()),
            });
        }
        for l in found {
            crate::settings::notice_once(&l.to_string(), &l.to_string());
            st.lints.push(l);
        }
    }

    /// The lint's warnings so far (each also printed once on stderr): GraphConst fields whose
    /// changes keep recompiling a program, programs with many variants, and programs that
    /// embed large constants.
    pub fn lints(&self) -> Vec<Lint> {
        self.lock_state().lints.clone()
    }

    /// The variant count past which the lint warns about a program (see
    /// [`set_variant_warning`](Cache::set_variant_warning)).
    pub fn variant_warning(&self) -> usize {
        self.variant_warning.load(Ordering::Relaxed)
    }

    /// How long a compile runs before it says so on stderr: the program, how long so far and
    /// how long its last compile took here (default [`ANNOUNCE_AFTER`], a second; zero
    /// announces every compile at once). Threads inside [`quietly`] never say.
    pub fn set_announce_after(&self, after: Duration) {
        self.announce_after_ms.store(
            u64::try_from(after.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Warn when one program has compiled more than `variants` variants (default 8).
    pub fn set_variant_warning(&self, variants: usize) {
        self.variant_warning.store(variants, Ordering::Relaxed);
    }

    /// Names what moved in this process since this program was last used (compiled or hit):
    /// `None` when this process never had it (the persistent level may know more).
    fn reason_here(&self, key: &Digest, program: &Digest, now: &KeyDetails) -> Option<MissReason> {
        let st = self.lock_state();
        if st.ledger.contains(key) {
            return Some(MissReason::Evicted);
        }
        let before = st.last.get(program)?;
        // Nothing moved since this very key was last used here, yet it is not held: capacity
        // pushed it out, and so many others since that the bounded ledger forgot it. (At
        // capacity 0 nothing is ever held or evicted: every lookup is `empty`.)
        before
            .moved_to(now)
            .or_else(|| (self.capacity > 0).then_some(MissReason::Evicted))
            .or(Some(MissReason::Empty))
    }

    /// Names what moved since the last process that shared the store used this program, from
    /// the store's record of it: `empty` when there is none, or nothing moved.
    fn reason_stored(&self, program: &Digest, now: &KeyDetails) -> MissReason {
        self.store
            .as_ref()
            .and_then(|s| s.program_record(program))
            .and_then(|bytes| serde_json::from_slice::<KeyDetails>(&bytes).ok())
            .filter(|before| before.program == now.program)
            .and_then(|before| before.moved_to(now))
            .unwrap_or(MissReason::Empty)
    }

    /// The statistics (with the store's exchanges with a shared server, when it has one).
    pub fn stats(&self) -> CacheStats {
        let mut stats = self.lock_state().stats.clone();
        stats.remote = self.store.as_ref().and_then(|s| s.remote_stats());
        stats
    }

    /// The most recent misses (up to 64), oldest first.
    pub fn recent_misses(&self) -> Vec<Miss> {
        self.lock_state().recent.iter().cloned().collect()
    }

    /// Removes every held program, the persistent entries and the eviction ledger; keeps the
    /// historical counters and zeroes the gauges.
    pub fn reset(&self) -> Result<()> {
        {
            let mut st = self.lock_state();
            st.slots.clear();
            st.routes.clear();
            st.ledger.clear();
            st.last.clear();
            st.lint.clear();
            st.warm_mark = None;
            st.misses_at_reset = st.stats.misses;
            st.stats.clears += 1;
            st.stats.entries = 0;
            st.stats.estimated_bytes = 0;
        }
        if let Some(store) = &self.store {
            store.clear()?;
        }
        Ok(())
    }

    /// Marks the end of warm-up: from now on, [`Cache::assert_no_recompile_after_warmup`]
    /// fails on any miss.
    pub fn mark_warm(&self) {
        let mut st = self.lock_state();
        st.warm_mark = Some(st.stats.misses);
    }

    /// The acceptance check: every miss since the last [`Cache::reset`] produced an entry that
    /// is still held (`misses == entries`), and no miss happened since [`Cache::mark_warm`].
    /// Fails with the misses that broke it.
    pub fn assert_no_recompile_after_warmup(&self) -> Result<()> {
        let st = self.lock_state();
        let since = st.warm_mark.map(|m| st.stats.misses - m).unwrap_or(0);
        let misses = st.stats.misses - st.misses_at_reset;
        if misses == st.stats.entries && since == 0 {
            return Ok(());
        }
        let extra = (misses.saturating_sub(st.stats.entries)).max(since) as usize;
        let shown: Vec<String> = st
            .recent
            .iter()
            .rev()
            .take(extra.max(1))
            .rev()
            .map(|m| format!("{} ({})", m.program, m.reason))
            .collect();
        Err(Error::Recompiled {
            misses,
            entries: st.stats.entries,
            since_warm: since,
            recent: shown.join("; "),
        })
    }
}

/// An experiment with its GraphConst digests computed once, for many lookups
/// ([`Cache::get_prepared`]).
///
/// It borrows the experiment, so no GraphConst can change while it lives: the digests always
/// describe the values the program is traced from. (GraphConst types have no interior
/// mutability — `ContentHash` rules it out — so a shared borrow freezes them.)
///
/// ```
/// use nitro::prelude::*;
/// use nitro::cache::{Cache, Prepared};
/// use nitro::program::Program;
///
/// #[experiment]
/// pub struct Scale { #[graph_const] pub k: u32, #[device] pub w: Array }
///
/// fn apply(v: &ScaleView<'_>, x: &Tensor) -> Tensor { *x * v.w * f64::from(*v.k) }
/// const APPLY: Program<Scale, Tensor> = Scale::program("apply", apply);
///
/// let cache = Cache::in_memory(4);
/// let exp = Scale { k: 2, w: Array::full(&[3], 1.0f32) };
/// let prepared = Prepared::new(&exp);
/// for _ in 0..3 {
///     let x = Array::full(&[3], 0.5f32);
///     cache.get_prepared(nitro::backend::interpreter(), &APPLY, &prepared, &x)?;
/// }
/// assert_eq!((cache.stats().misses, cache.stats().hits), (1, 2));
/// # Ok::<(), nitro::Error>(())
/// ```
///
/// A GraphConst cannot change while its digests are in use:
///
/// ```compile_fail
/// # use nitro::prelude::*;
/// # use nitro::cache::Prepared;
/// # #[experiment] pub struct Scale { #[graph_const] pub k: u32, #[device] pub w: Array }
/// let mut exp = Scale { k: 2, w: Array::full(&[3], 1.0f32) };
/// let prepared = Prepared::new(&exp);
/// exp.k = 3; // error: `exp` is borrowed by `prepared`
/// drop(prepared);
/// ```
#[derive(Debug)]
pub struct Prepared<'e, E: Experiment> {
    experiment: &'e E,
    fields: Vec<(&'static str, Digest)>,
    graph_const: Digest,
}

impl<'e, E: Experiment> Prepared<'e, E> {
    /// Hashes `experiment`'s GraphConst fields.
    pub fn new(experiment: &'e E) -> Prepared<'e, E> {
        let fields = experiment.graph_const_field_digests();
        let graph_const = crate::experiment::combine_graph_const::<E>(&fields);
        Prepared {
            experiment,
            fields,
            graph_const,
        }
    }

    /// The experiment.
    pub fn experiment(&self) -> &'e E {
        self.experiment
    }

    /// Its GraphConst digest ([`Experiment::graph_const_digest`]).
    pub fn graph_const_digest(&self) -> Digest {
        self.graph_const
    }
}

/// Key parts computed once by their owner: the GraphConst digests of an experiment it holds
/// (and recomputes whenever a GraphConst changes) and the digest of the handle settings that
/// shape the program. Crate-internal: see [`Cache::get_keyed`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeyParts<'a> {
    /// [`Experiment::graph_const_digest`].
    pub graph_const: Digest,
    /// [`Experiment::graph_const_field_digests`].
    pub graph_const_fields: &'a [(&'static str, Digest)],
    /// Digest of handle settings that shape the program (masking, accumulation, …).
    pub settings: Digest,
}

/// The key's components: program identity (the experiment type with its generic arguments,
/// and the name), GraphConsts, settings, signature, backend, options. The program's code is not
/// among them — its address is not an identity (one `fn` can have several) — so a held program
/// is found by components and code address together, and a new address is traced once and
/// matched by fingerprint.
fn key_components<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
    backend: &dyn Backend,
    program: &Program<E, M, O>,
    experiment: &E,
    inputs: &I,
    parts: &KeyParts<'_>,
) -> Digest {
    let identity = backend.identity();
    // The signature digest walks the structure and leaf types, never values: the cost is per
    // node, not per byte.
    let mut h = ContentHasher::new();
    // Each Device leaf's role too: trainable or not changes the traced program (its
    // gradients), so two experiments that differ only there never share a route.
    experiment.visit_device(&mut |field, path, node| {
        h.write_str(field.role.label());
        walk_digest(&mut h, path.as_str(), node)
    });
    inputs.visit(&mut LeafPath::root(""), &mut |path, node| {
        walk_digest(&mut h, crate::program::input_name(path.as_str()), node)
    });
    let signature = h.finish();
    let mut k = ContentHasher::new();
    k.write_str(std::any::type_name::<E>());
    // `type_name` is not unique (two block-local `Net`s, two versions of one crate): the
    // schema (every field's name, type and role) and, where the type has one to give, its
    // `TypeId` (this process only: these components never leave memory) tell them apart.
    k.write_digest(&E::SCHEMA_DIGEST);
    if let Some(id) = E::type_identity() {
        use std::hash::{Hash, Hasher};
        let mut t = std::collections::hash_map::DefaultHasher::new();
        id.hash(&mut t);
        k.write_u8(1);
        k.write_u64(t.finish());
    } else {
        k.write_u8(0);
    }
    k.write_str(program.name());
    k.write_u8(program.layout_flags());
    k.write_digest(&parts.graph_const);
    k.write_digest(&parts.settings);
    k.write_digest(&signature);
    k.write_digest(&identity.digest);
    k.write_digest(&identity.options);
    if let Some(p) = backend.partitioning() {
        k.write_digest(&resolved_layout(p, experiment));
    }
    k.finish()
}

/// What decides how a program on `partitioning` splits its arrays, resolved: the mesh's axes
/// (names and sizes), the batch axis, and each trainable leaf's spec by the sharding's rules.
/// Two shardings whose rules resolve alike (a `Sharding::leaf` pattern restating what FSDP
/// gives the leaf) have one digest, and share programs; the backend's identity holds only the
/// mesh's shape.
fn resolved_layout<E: Experiment>(
    partitioning: &crate::shard::Partitioning,
    experiment: &E,
) -> Digest {
    let mut h = ContentHasher::new();
    for (name, size) in partitioning.mesh().axes() {
        h.write_str(name);
        h.write_len(*size);
    }
    h.write_str(partitioning.sharding().axis());
    experiment.visit_device(&mut |field, path, node| {
        let trainable = field.role == (crate::experiment::Role::Device { trainable: true });
        if let (true, crate::tree::Node::Leaf(a)) = (trainable, node) {
            h.write_str(path.as_str());
            // A spec that does not fit is the trace's error; its text keys the same.
            match partitioning.leaf_spec(path.as_str(), &a.leaf_type()) {
                Ok(spec) => h.write_str(&spec.to_string()),
                Err(e) => h.write_str(&e.to_string()),
            }
        }
    });
    h.finish()
}

/// What the key of a traced program is made of.
fn key_details(
    backend: &dyn Backend,
    program_id: &str,
    traced: &Traced,
    parts: &KeyParts<'_>,
    graph_const_parts: Vec<crate::hash::Part>,
) -> KeyDetails {
    let identity = backend.identity();
    KeyDetails {
        program: program_id.to_owned(),
        graph_const: parts.graph_const,
        graph_const_fields: parts
            .graph_const_fields
            .iter()
            .map(|(n, d)| ((*n).to_owned(), *d))
            .collect(),
        graph_const_parts,
        settings: parts.settings,
        signature: traced.structure.clone(),
        backend: identity.digest,
        backend_components: identity.components.clone(),
        options: identity.options,
        fingerprint: traced.fingerprint,
        shardings: traced
            .graph
            .sharding
            .iter()
            .flat_map(|s| {
                traced
                    .graph
                    .inputs
                    .iter()
                    .zip(&s.inputs)
                    .map(|(input, spec)| (input.name.clone(), spec.to_string()))
            })
            .collect(),
    }
}

/// The persistent store's key of a traced program: its fingerprint on this backend and options.
fn l2_key(backend: &dyn Backend, fingerprint: &Digest) -> Digest {
    let identity = backend.identity();
    let mut s = ContentHasher::new();
    s.write_digest(fingerprint);
    s.write_digest(&identity.digest);
    s.write_digest(&identity.options);
    s.finish()
}

/// A program's record in the store: its key's details, and what it last cost.
#[derive(serde::Serialize)]
struct ProgramRecord<'a> {
    #[serde(flatten)]
    details: &'a KeyDetails,
    /// What the program holds ([`ProgramCost`]), for `nitro cache explain --cost`.
    cost: &'a ProgramCost,
    #[serde(flatten)]
    times: ProgramTimes,
}

/// What a program last cost, from its record (absent in records written before they were kept).
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
struct ProgramTimes {
    #[serde(default)]
    compile_ms: Option<f64>,
    #[serde(default)]
    load_ms: Option<f64>,
}

/// What `store` recorded of what the entry under `entry` (a persistent key) last cost here:
/// its own record's compile and load times. An entry without a record (not stored yet, or
/// stored before records were kept per entry) takes only the compile time of the program
/// `program_key`'s latest compile — an estimate for a compile, from another key — and no load
/// time: another entry's load is never reported as this one's. Nothing when there is no store
/// or no readable record.
fn recorded_times(store: Option<&dyn Store>, entry: &Digest, program_key: &Digest) -> ProgramTimes {
    let read = |digest: &Digest| {
        store
            .and_then(|s| s.program_record(digest))
            .and_then(|bytes| serde_json::from_slice::<ProgramTimes>(&bytes).ok())
    };
    read(&store::entry_record_key(entry)).unwrap_or_else(|| ProgramTimes {
        compile_ms: read(program_key).and_then(|t| t.compile_ms),
        load_ms: None,
    })
}

/// A program a miss loaded or compiled ([`Cache::load_or_compile`]).
struct Built {
    executable: Box<dyn Executable>,
    /// Loaded from the persistent store (not compiled).
    loaded: bool,
    /// Why a stored program was not used, when one was found.
    rejected: Option<Rejection>,
    /// The stored program's compile time, when it was loaded.
    stored_compile_ms: Option<f64>,
    /// Loading or compiling it.
    build_time: Duration,
}

/// What [`Cache::admit`] files a built program under.
struct Admission {
    program_id: String,
    program_key: Digest,
    details: KeyDetails,
    reason: MissReason,
    write_failed: bool,
    trace_time: Duration,
    /// The key's components, the full key and the code address.
    route: (Digest, Digest, usize),
    /// What the program holds.
    cost: Arc<ProgramCost>,
}

/// What a lookup would do ([`Cache::probe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Will {
    /// Serve it from memory.
    Hit,
    /// Load it from the local store.
    Load,
    /// Fetch it from the shared server.
    Fetch,
    /// Compile it.
    Compile,
}

impl std::fmt::Display for Will {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Will::Hit => "hit (in memory)",
            Will::Load => "load (local store)",
            Will::Fetch => "fetch (shared server)",
            Will::Compile => "compile",
        })
    }
}

impl Probe {
    /// The expected wait: the recorded compile time for a compile, the recorded load time for a
    /// load or fetch, nothing for a hit; `None` when no record says.
    pub fn expected_ms(&self) -> Option<f64> {
        match self.will {
            Will::Hit => Some(0.0),
            Will::Compile => self.compile_ms,
            Will::Load | Will::Fetch => self.load_ms,
        }
    }
}

/// What [`Cache::probe`] found for one program.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Probe {
    /// The program's identity.
    pub program: String,
    /// What a lookup would do.
    pub will: Will,
    /// Why memory cannot serve it (`None` for a hit).
    pub reason: Option<MissReason>,
    /// From the store's record of this entry: how long its compile took, in milliseconds; for
    /// a program not stored yet, the program's last compile (of another key: an estimate).
    /// `None` when no record says, and for a hit.
    pub compile_ms: Option<f64>,
    /// From the store's record of this entry: how long its last load took (`None` when it was
    /// never loaded — another entry's load is never reported as this one's).
    pub load_ms: Option<f64>,
    /// The traced program's fingerprint (what a manifest lists).
    pub fingerprint: Digest,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::Array;

    fn doubled<E: Experiment + 'static>(_: &E::View<'_>, _: &()) -> Vec<Tensor> {
        crate::program::trainable_leaves()
            .into_iter()
            .map(|t| t * 2.0)
            .collect()
    }

    fn doubled_program<E: Experiment + 'static>() -> Program<E, (), Vec<Tensor>> {
        Program::generic("doubled", doubled::<E>)
    }

    /// The route of a held program is its key components and its code address. Two
    /// block-local types of one `type_name` that differ only in a Device leaf's role must not
    /// share components: when a release build folds their programs to one address, equal
    /// components would serve the first type's program to the second (issue 30, item 14).
    #[test]
    fn a_leaf_role_and_the_type_itself_are_in_the_key_components() {
        let backend = crate::backend::interpreter();
        let parts = KeyParts {
            graph_const: Digest::default(),
            graph_const_fields: &[],
            settings: Digest::default(),
        };
        // A block-local `Net` (every one of them has one `type_name`) whose `b` takes the
        // role given, and its type name and key components.
        macro_rules! local_net {
            ($($role:tt)*) => {{
                #[crate::experiment]
                struct Net {
                    #[device(trainable)]
                    w: Array,
                    $($role)*
                    b: Array,
                }
                let w = || Array::full(&[2], 1.0f32);
                let e = Net { w: w(), b: w() };
                let p = doubled_program::<Net>();
                (
                    std::any::type_name::<Net>(),
                    key_components(backend, &p, &e, &(), &parts),
                )
            }};
        }
        let (name_a, a) = local_net!(#[device]);
        let (name_b, b) = local_net!(#[device(trainable)]);
        // Same schema, another type: the TypeId alone tells them apart.
        let (name_c, c) = local_net!(#[device]);
        assert!(
            name_a == name_b && name_b == name_c,
            "{name_a} {name_b} {name_c}"
        );
        assert_ne!(a, b, "a role change must move the components");
        assert_ne!(a, c, "another type of one name and schema must move them");
    }
}
