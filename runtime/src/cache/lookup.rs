//! A lookup: served from memory, or missed and loaded from the store or compiled, written
//! back with its record, and admitted; the preflight (`probe`) that does the same without
//! building anything.

use super::*;

/// How long a process waits for another process compiling the same program before compiling
/// it itself (the lease of the cross-process lock).
pub(super) const COMPILE_LEASE: Duration = Duration::from_secs(120);

/// Says, once per process on stderr, that a compiled program of `program` could not be kept in
/// the persistent store (`serializing`: the backend could not serialize it; else the store could
/// not write it, `e` naming the path and what failed), so every later process compiles it again.
/// A shared server's faults are not said here: the shared store says them once itself.
pub(super) fn say_store_write_failed(program: &str, e: &Error, serializing: bool) {
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

/// A program a miss loaded or compiled ([`Cache::load_or_compile`]).
pub(super) struct Built {
    pub(super) executable: Box<dyn Executable>,
    /// Loaded from the persistent store (not compiled).
    pub(super) loaded: bool,
    /// Why a stored program was not used, when one was found.
    pub(super) rejected: Option<Rejection>,
    /// The stored program's compile time, when it was loaded.
    pub(super) stored_compile_ms: Option<f64>,
    /// Loading or compiling it.
    pub(super) build_time: Duration,
}

/// What [`Cache::admit`] files a built program under.
pub(super) struct Admission {
    pub(super) program_id: String,
    pub(super) program_key: Digest,
    pub(super) details: KeyDetails,
    pub(super) reason: MissReason,
    pub(super) write_failed: bool,
    pub(super) trace_time: Duration,
    /// The key's components, the full key and the code address.
    pub(super) route: (Digest, Digest, usize),
    /// What the program holds.
    pub(super) cost: Arc<ProgramCost>,
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

impl Cache {
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
    pub(super) fn check_configured(&self) -> Result<()> {
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
        let entry = l2_key(backend, &traced.fingerprint);
        let located = store.and_then(|s| s.locate(&entry));
        let reason = self
            .reason_here(&key, &program_key, &details)
            .unwrap_or_else(|| self.reason_stored(&program_key, &details));
        let record = recorded_times(store.map(|s| &**s), &entry, &program_key);
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
    pub(super) fn verified<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
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

    /// A lookup that missed in memory: the program loaded from the persistent store or
    /// compiled ([`Cache::load_or_compile`]), written back to the store with its record
    /// ([`Cache::write_back`]), and admitted to memory ([`Cache::admit`]).
    pub(super) fn miss(
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
                (&program_id, &program_key, &l2_key),
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
    pub(super) fn load_or_compile(
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

    /// Writes a compiled program back to `store` under `entry`, its persistent key (not one it
    /// loaded, and not over an entry signed with a key this process lacks), then its record,
    /// under the program and under the entry: what its key was made of (for the next miss's
    /// reason, and `explain`) and what it last cost to compile and to load (for a preflight's
    /// estimate; `before`, the entry's record as it was, keeps what this lookup did not
    /// measure). Whether the write failed.
    pub(super) fn write_back(
        &self,
        backend: &dyn Backend,
        store: &dyn Store,
        built: &Built,
        traced: &Traced,
        (program_id, program_key, entry): (&str, &Digest, &Digest),
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
                            key: *entry,
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
            let _ = store.record_program(&store::entry_record_key(entry), &record);
        }
        write_failed
    }

    /// Admits a built program to memory: the statistics, the recent misses, the lint, the
    /// program's last key, the LRU slots (evicting the least recently used past capacity) and
    /// the route of its code address. What the lookup serves.
    pub(super) fn admit(&self, traced: Traced, built: Built, a: Admission) -> Served {
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
}
