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
//! assert_eq!(cache.recent_misses()[1].reason, MissReason::GraphConstChanged { fields: vec!["k".into()] });
//! # Ok::<(), nitro::Error>(())
//! ```

mod reason;
mod stats;
pub mod store;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use reason::MissReason;
pub use stats::CacheStats;
pub use store::{DirStore, Entry, EntryMeta, Lookup, Store};

use crate::backend::{Backend, Executable};
use crate::error::{Error, Result};
use crate::experiment::Experiment;
use crate::hash::{ContentHasher, Digest};
use crate::program::{Outputs, Program, Traced};
use crate::trace::Tensor;
use crate::tree::{LeafPath, Node, Signature, Tree};

/// The default capacity of the process-wide cache, in programs.
pub const DEFAULT_CAPACITY: usize = 256;

/// How many misses [`Cache::recent_misses`] keeps.
const RECENT_MISSES: usize = 64;

/// How long a process waits for another process compiling the same program before compiling
/// it itself (the lease of the cross-process lock).
const COMPILE_LEASE: Duration = Duration::from_secs(120);

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
    /// The backend executable.
    pub executable: Box<dyn Executable>,
    /// Compile (or load) time.
    pub build_time: Duration,
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
}

/// What a key is made of, kept per entry so the next miss can name what moved.
#[derive(Clone, Debug, PartialEq)]
struct KeyDetails {
    graph_const: Digest,
    graph_const_fields: Vec<(&'static str, Digest)>,
    settings: Digest,
    signature: Signature,
    backend: Digest,
    options: Digest,
}

struct Slot {
    compiled: Arc<Compiled>,
    details: Arc<KeyDetails>,
    /// The program (identity and code address) this slot belongs to: the key of `State::last`.
    program: Digest,
    tick: u64,
}

#[derive(Default)]
struct State {
    slots: HashMap<Digest, Slot>,
    /// Keys evicted by capacity, oldest first, at most `capacity` of them.
    ledger: VecDeque<Digest>,
    /// The key details last used (compiled or hit) per program identity (for miss reasons).
    last: HashMap<Digest, Arc<KeyDetails>>,
    tick: u64,
    stats: CacheStats,
    recent: VecDeque<Miss>,
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

/// The settings of the process-wide cache read from the environment:
/// `NITRO_CACHE=off` disables the persistent level; `NITRO_CACHE_DIR` moves it;
/// `NITRO_CACHE_KEY` (64 hex digits) signs its entries; `NITRO_VERIFY_KEYS=1` turns on verify
/// mode.
pub fn global() -> &'static Cache {
    static GLOBAL: OnceLock<Cache> = OnceLock::new();
    GLOBAL.get_or_init(|| {
        let store = match default_store() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("nitro: persistent compile cache disabled: {e}");
                None
            }
        };
        let cache = Cache::new(DEFAULT_CAPACITY, store);
        cache.set_verify(std::env::var("NITRO_VERIFY_KEYS").is_ok_and(|v| v == "1"));
        cache
    })
}

/// The persistent store the environment asks for (`None` when `NITRO_CACHE=off`).
pub fn default_store() -> Result<Option<Arc<dyn Store>>> {
    if std::env::var("NITRO_CACHE").is_ok_and(|v| v == "off" || v == "0") {
        return Ok(None);
    }
    let dir = match std::env::var_os("NITRO_CACHE_DIR") {
        Some(d) => std::path::PathBuf::from(d),
        None => default_cache_dir().ok_or(Error::CacheUntrusted {
            path: std::path::PathBuf::new(),
            why: "no cache directory: set NITRO_CACHE_DIR, or HOME".into(),
        })?,
    };
    let key = match std::env::var("NITRO_CACHE_KEY") {
        Ok(hex) => Some(
            *hex.trim()
                .parse::<Digest>()
                .map_err(|e| Error::CacheUntrusted {
                    path: dir.clone(),
                    why: format!("NITRO_CACHE_KEY must be 64 hex digits (a 32-byte key): {e}"),
                })?
                .as_bytes(),
        ),
        Err(_) => None,
    };
    Ok(Some(Arc::new(DirStore::open(
        dir,
        store::DEFAULT_CAPACITY_BYTES,
        key,
    )?)))
}

/// The platform's cache directory for nitro: `$XDG_CACHE_HOME/nitro`, `~/.cache/nitro`, or
/// `~/Library/Caches/nitro` on macOS.
pub fn default_cache_dir() -> Option<std::path::PathBuf> {
    let home = std::env::var_os("HOME").map(std::path::PathBuf::from);
    if cfg!(target_os = "macos") {
        return home.map(|h| h.join("Library/Caches/nitro"));
    }
    match std::env::var_os("XDG_CACHE_HOME") {
        Some(x) if !x.is_empty() => Some(std::path::PathBuf::from(x).join("nitro")),
        _ => home.map(|h| h.join(".cache/nitro")),
    }
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

/// The digest of a walk's structure and leaf types (paths included, values never).
fn walk_digest(h: &mut ContentHasher, path: &LeafPath, node: Node<'_>) {
    h.write_str(path.as_str());
    match node {
        Node::Leaf(a) => {
            h.write_u8(0);
            crate::ContentHash::content_hash(&a.dtype(), h);
            h.write_len(a.dims().len());
            for &d in a.dims() {
                h.write_len(d);
            }
        }
        Node::EmptySeq => h.write_u8(1),
        Node::None => h.write_u8(2),
    }
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
    /// persistent store, or compiled now. `settings` is not needed by most callers: see
    /// [`Cache::get_with`].
    pub fn get<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        backend: &dyn Backend,
        program: &Program<E, M, O>,
        experiment: &E,
        inputs: &I,
    ) -> Result<Arc<Compiled>> {
        let fields = experiment.graph_const_field_digests();
        let gc = crate::experiment::combine_graph_const::<E>(&fields);
        self.get_with(
            backend,
            program,
            experiment,
            inputs,
            &KeyParts {
                graph_const: gc,
                graph_const_fields: &fields,
                settings: Digest::default(),
            },
        )
    }

    /// Like [`Cache::get`], with the GraphConst digests precomputed (a handle computes them
    /// once, not per step) and the handle settings that shape the program.
    pub fn get_with<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        backend: &dyn Backend,
        program: &Program<E, M, O>,
        experiment: &E,
        inputs: &I,
        parts: &KeyParts<'_>,
    ) -> Result<Arc<Compiled>> {
        let identity = backend.identity();
        // The signature digest walks leaf types, never values: the cost is per leaf, not per byte.
        let mut h = ContentHasher::new();
        experiment.visit_device(&mut |_, path, node| walk_digest(&mut h, path, node));
        inputs.visit(&mut LeafPath::root(""), &mut |path, node| {
            walk_digest(&mut h, path, node)
        });
        let signature = h.finish();
        let mut k = ContentHasher::new();
        // Program identity without allocating: the experiment type (with generic arguments),
        // the name, and the address of the program's code (two different `fn`s given one name
        // never share an entry; an address that differs for the same `fn` costs a miss, never
        // a stale hit).
        k.write_str(std::any::type_name::<E>());
        k.write_str(program.name());
        k.write_u64(program.code_address() as u64);
        k.write_digest(&parts.graph_const);
        k.write_digest(&parts.settings);
        k.write_digest(&signature);
        k.write_digest(&identity.digest);
        k.write_digest(&identity.options);
        let key = k.finish();

        if let Some(hit) = self.hit(&key) {
            return self.verified(hit, program, experiment, inputs);
        }
        let program_id = program.identity();

        // Single flight: the first requester compiles, the others wait for it. The slot is
        // checked again under the flights lock: a leader fills its slot before it leaves the
        // map, so a request that missed above while that leader was finishing sees one or the
        // other here, and never compiles the key a second time.
        let (flight, leader) = {
            let mut flights = self.flights.lock().unwrap_or_else(|p| p.into_inner());
            match flights.get(&key) {
                Some(f) => (f.clone(), false),
                None => {
                    if let Some(hit) = self.hit(&key) {
                        drop(flights);
                        return self.verified(hit, program, experiment, inputs);
                    }
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
            return match done.as_ref() {
                Some(Ok(c)) => {
                    let c = c.clone();
                    drop(done);
                    // Count as a hit: the key was compiled once, for everyone (also when the
                    // slot is already gone again: capacity 0, or evicted meanwhile).
                    if let Some(hit) = self.hit(&key) {
                        return Ok(hit);
                    }
                    let mut st = self.lock_state();
                    st.stats.hits += 1;
                    st.stats.saved_ms += c.build_time.as_secs_f64() * 1e3;
                    Ok(c)
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
        let result = self.miss(backend, program, experiment, inputs, parts, key, program_id);
        guard.flight.finish(match &result {
            Ok(c) => Ok(c.clone()),
            Err(e) => Err(e.to_string()),
        });
        drop(guard);
        result
    }

    /// In verify mode, re-traces a hit and refuses it when the program moved without its key.
    fn verified<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        hit: Arc<Compiled>,
        program: &Program<E, M, O>,
        experiment: &E,
        inputs: &I,
    ) -> Result<Arc<Compiled>> {
        if self.verify.load(Ordering::Relaxed) {
            let traced = program.trace(experiment, inputs)?;
            if traced.fingerprint != hit.fingerprint {
                return Err(Error::StaleKey {
                    program: program.identity(),
                    was: hit.fingerprint.short().to_string(),
                    now: traced.fingerprint.short().to_string(),
                });
            }
        }
        Ok(hit)
    }

    fn hit(&self, key: &Digest) -> Option<Arc<Compiled>> {
        let mut guard = self.lock_state();
        let st = &mut *guard;
        st.tick += 1;
        let slot = st.slots.get_mut(key)?;
        slot.tick = st.tick;
        let compiled = slot.compiled.clone();
        // The program's last-used key, so that the next miss names what moved since then.
        if let Some(last) = st.last.get_mut(&slot.program) {
            if !Arc::ptr_eq(last, &slot.details) {
                *last = slot.details.clone();
            }
        }
        st.stats.hits += 1;
        st.stats.saved_ms += compiled.build_time.as_secs_f64() * 1e3;
        Some(compiled)
    }

    #[allow(clippy::too_many_arguments)]
    fn miss<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        backend: &dyn Backend,
        program: &Program<E, M, O>,
        experiment: &E,
        inputs: &I,
        parts: &KeyParts<'_>,
        key: Digest,
        program_id: String,
    ) -> Result<Arc<Compiled>> {
        // Failures (trace or compile errors) are never cached: the next request tries again.
        let traced = program.trace(experiment, inputs)?;
        let identity = backend.identity();
        let details = KeyDetails {
            graph_const: parts.graph_const,
            graph_const_fields: parts.graph_const_fields.to_vec(),
            settings: parts.settings,
            signature: traced.inputs.clone(),
            backend: identity.digest,
            options: identity.options,
        };
        let mut l = ContentHasher::new();
        l.write_str(&program_id);
        l.write_digest(&parts.graph_const);
        l.write_digest(&parts.settings);
        l.write_digest(&traced.inputs.digest());
        let logical = l.finish();
        let mut s = ContentHasher::new();
        s.write_digest(&traced.fingerprint);
        s.write_digest(&identity.digest);
        s.write_digest(&identity.options);
        let l2_key = s.finish();

        // What moved in this process is known before the persistent level is asked; what moved
        // since another process compiled is asked of the store only when it cannot serve the
        // program (a load is not explained by an older record of another backend or code).
        // One program is one identity and one `fn`: two `fn`s under one name are two programs.
        let mut p = ContentHasher::new();
        p.write_str(&program_id);
        p.write_u64(program.code_address() as u64);
        let program_key = p.finish();
        let known = self.reason_here(&key, &program_key, &details);
        let store = self.store.as_ref().filter(|_| backend.persistent());
        let _lock = match store {
            Some(s) => s.lock(&l2_key, COMPILE_LEASE).unwrap_or(None),
            None => None,
        };
        let started = Instant::now();
        let mut loaded = false;
        let mut executable = None;
        if let Some(store) = store {
            match store.get(&l2_key) {
                Ok(Lookup::Hit(entry)) => match backend.load(&entry.payload, &traced.graph) {
                    Ok(exe) => {
                        executable = Some(exe);
                        loaded = true;
                    }
                    Err(e) => {
                        tracing::warn!(program = %program_id, "nitro: discarding a stored program that failed to load: {e}")
                    }
                },
                Ok(Lookup::Rejected(why)) => {
                    tracing::warn!(program = %program_id, "nitro: discarded a stored program ({why}); recompiling")
                }
                Ok(Lookup::Absent) => {}
                Err(e) => {
                    tracing::warn!(program = %program_id, "nitro: persistent cache unreadable: {e}")
                }
            }
        }
        let executable = match executable {
            Some(exe) => exe,
            None => backend.compile(&traced.graph, &traced.text)?,
        };
        let build_time = started.elapsed();
        let ms = build_time.as_secs_f64() * 1e3;
        let reason = match known {
            Some(r) => r,
            None if loaded => MissReason::Empty,
            None => self.reason_stored(&logical, &details, &traced),
        };
        if let (Some(store), false) = (store, loaded) {
            match executable.serialize() {
                Ok(payload) => {
                    let entry = Entry {
                        meta: EntryMeta {
                            key: l2_key,
                            program: program_id.clone(),
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
                        tracing::warn!(program = %program_id, "nitro: could not store a compiled program: {e}");
                    }
                }
                Err(e) => {
                    tracing::warn!(program = %program_id, "nitro: could not serialize a compiled program: {e}")
                }
            }
        }
        if let Some(store) = store {
            let _ = store.record_compiled(
                &logical,
                &traced.fingerprint,
                &identity.digest,
                &identity.options,
            );
        }
        tracing::info!(program = %program_id, reason = %reason, ms, loaded, "nitro: compile-cache miss");

        let compiled = Arc::new(Compiled {
            program: program_id.clone(),
            fingerprint: traced.fingerprint,
            inputs: traced.inputs.clone(),
            outputs: traced.outputs.clone(),
            executable,
            build_time,
        });
        let mut st = self.lock_state();
        st.stats.misses += 1;
        *st.stats
            .misses_by_reason
            .entry(reason.name().to_owned())
            .or_default() += 1;
        if loaded {
            st.stats.l2_hits += 1;
        } else {
            st.stats.compiles += 1;
            st.stats.compile_ms += ms;
        }
        if st.recent.len() == RECENT_MISSES {
            st.recent.pop_front();
        }
        st.recent.push_back(Miss {
            program: program_id.clone(),
            reason,
            loaded,
            ms,
        });
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
        }
        st.stats.entries = st.slots.len() as u64;
        st.stats.estimated_bytes = st
            .slots
            .values()
            .map(|s| s.compiled.executable.size_bytes())
            .sum();
        Ok(compiled)
    }

    /// Names what moved in this process since this program was last used (compiled or hit):
    /// `None` when this process never had it (the persistent level may know more).
    fn reason_here(&self, key: &Digest, program: &Digest, now: &KeyDetails) -> Option<MissReason> {
        let st = self.lock_state();
        if st.ledger.contains(key) {
            return Some(MissReason::Evicted);
        }
        let before = st.last.get(program)?;
        let fields: Vec<String> = now
            .graph_const_fields
            .iter()
            .zip(&before.graph_const_fields)
            .filter(|(a, b)| a != b)
            .map(|(a, _)| a.0.to_owned())
            .chain((now.settings != before.settings).then(|| "<handle>".to_owned()))
            .collect();
        if !fields.is_empty() {
            return Some(MissReason::GraphConstChanged { fields });
        }
        if now.graph_const != before.graph_const {
            // The digest moved though no field digest did (precomputed parts out of step).
            return Some(MissReason::GraphConstChanged {
                fields: vec!["<graph_const>".to_owned()],
            });
        }
        if let Some((leaf, from, to)) = before.signature.first_difference(&now.signature) {
            return Some(MissReason::SignatureChanged { leaf, from, to });
        }
        if before.backend != now.backend {
            return Some(MissReason::BackendChanged);
        }
        if before.options != now.options {
            return Some(MissReason::OptionsChanged);
        }
        // Nothing moved since this very key was last used here, yet it is not held: capacity
        // pushed it out, and so many others since that the bounded ledger forgot it. (At
        // capacity 0 nothing is ever held or evicted: every lookup is `empty`.)
        (self.capacity > 0).then_some(MissReason::Evicted)
    }

    /// Names what differs from the last compile another process recorded for the same logical
    /// program (program, GraphConst digest, settings, signature): its backend, its options, or
    /// its code. `empty` when none was recorded.
    fn reason_stored(&self, logical: &Digest, now: &KeyDetails, traced: &Traced) -> MissReason {
        if let Some((fingerprint, backend, options)) =
            self.store.as_ref().and_then(|s| s.last_compiled(logical))
        {
            if backend != now.backend {
                return MissReason::BackendChanged;
            }
            if options != now.options {
                return MissReason::OptionsChanged;
            }
            if fingerprint != traced.fingerprint {
                return MissReason::CodeChanged {
                    from: fingerprint.short().to_string(),
                    to: traced.fingerprint.short().to_string(),
                };
            }
        }
        MissReason::Empty
    }

    /// The statistics.
    pub fn stats(&self) -> CacheStats {
        self.lock_state().stats.clone()
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
            st.ledger.clear();
            st.last.clear();
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

/// Key parts a caller may precompute: the GraphConst digests (once per handle) and the digest
/// of the handle settings that shape the program.
#[derive(Clone, Copy, Debug)]
pub struct KeyParts<'a> {
    /// [`Experiment::graph_const_digest`].
    pub graph_const: Digest,
    /// [`Experiment::graph_const_field_digests`].
    pub graph_const_fields: &'a [(&'static str, Digest)],
    /// Digest of handle settings that shape the program (masking, accumulation, …).
    pub settings: Digest,
}
