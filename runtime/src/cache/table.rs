//! The L1 table: the programs held in memory, their routes, the eviction ledger, the
//! compiles in flight that other requesters wait for, and admission of a built program.

use super::*;

/// A held program: one emitted program (one fingerprint) under one key.
pub(super) struct Slot {
    pub(super) compiled: Arc<Compiled>,
    pub(super) details: Arc<KeyDetails>,
    /// The program identity this slot belongs to: the key of `State::last`.
    pub(super) program: Digest,
    pub(super) tick: u64,
}

#[derive(Default)]
pub(super) struct State {
    /// Held programs by full key (the key's components and the program's fingerprint).
    pub(super) slots: HashMap<Digest, Slot>,
    /// Which held program a key's components and a code address lead to, so that a hit needs
    /// no tracing. A program reached through a new code address (an inlined copy, a closure
    /// instantiated in another module) is traced once and routed to the slot of its
    /// fingerprint.
    pub(super) routes: HashMap<(Digest, usize), Digest>,
    /// Full keys evicted by capacity, oldest first, at most `capacity` of them.
    pub(super) ledger: VecDeque<Digest>,
    /// The key details last used (compiled or hit) per program identity (for miss reasons).
    pub(super) last: HashMap<Digest, Arc<KeyDetails>>,
    pub(super) tick: u64,
    pub(super) stats: CacheStats,
    pub(super) recent: VecDeque<Miss>,
    /// What the lint has seen per program identity.
    pub(super) lint: HashMap<Digest, LintState>,
    /// Warnings given, in order.
    pub(super) lints: Vec<Lint>,
    pub(super) warm_mark: Option<u64>,
    /// `stats.misses` at the last reset: the acceptance check counts misses since then.
    pub(super) misses_at_reset: u64,
}

/// An in-flight compile that other threads wait for.
#[derive(Default)]
pub(super) struct Flight {
    pub(super) done: Mutex<Option<std::result::Result<Arc<Compiled>, String>>>,
    pub(super) ready: Condvar,
}

impl Flight {
    pub(super) fn finish(&self, outcome: std::result::Result<Arc<Compiled>, String>) {
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
pub(super) struct FlightGuard<'a> {
    pub(super) cache: &'a Cache,
    pub(super) key: Digest,
    pub(super) flight: Arc<Flight>,
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

impl Cache {
    /// A hit through a known route (key components and code address): no tracing.
    pub(super) fn hit_route(&self, components: &Digest, address: usize) -> Option<Arc<Compiled>> {
        let mut st = self.lock_state();
        let key = *st.routes.get(&(*components, address))?;
        Some(Self::count_hit(&mut st, &key)?.compiled)
    }

    /// A hit on the full key of a traced program; learns the route of its code address.
    pub(super) fn hit_traced(
        &self,
        key: &Digest,
        components: &Digest,
        address: usize,
    ) -> Option<Served> {
        let mut st = self.lock_state();
        let served = Self::count_hit(&mut st, key)?;
        st.routes.insert((*components, address), *key);
        Some(served)
    }

    pub(super) fn count_hit(st: &mut State, key: &Digest) -> Option<Served> {
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
}
