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

// The cache's parts, one concern each: `key` (what a key is made of), `lookup` (a lookup,
// its miss, load or compile, write-back and admission; the preflight), `table` (the programs
// held in memory and the compiles in flight), `records` (what is kept to explain programs:
// store records, miss reasons, the lint); this file holds the `Cache` itself and what it serves.
pub mod cost;
mod key;
mod lookup;
pub mod manifest;
mod progress;
mod reason;
mod records;
pub mod remote;
mod stats;
pub mod store;
mod table;

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

pub(crate) use key::KeyParts;
pub use key::Prepared;
use key::*;
pub use lookup::{Probe, Will};
pub use records::Lint;
use records::*;
pub use store::{
    DirStore, Entry, EntryMeta, EntrySummary, Explanation, GcReport, Location, Lookup, RejectKind,
    Rejection, Store, Verified,
};
use table::*;

use crate::backend::{Backend, Executable, Identity};
use crate::error::{Error, Result};
use crate::experiment::Experiment;
use crate::hash::{ContentHasher, Digest};
use crate::program::{Outputs, Program, Traced};
use crate::trace::Tensor;
use crate::tree::{LeafPath, Node, Signature, Tree};

/// The default capacity of the process-wide cache, in programs.
pub const DEFAULT_CAPACITY: usize = 256;

/// The lint warns about a program with more variants than this, by default.
pub const DEFAULT_VARIANT_WARNING: usize = 8;

/// How many misses [`Cache::recent_misses`] keeps.
const RECENT_MISSES: usize = 64;

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
