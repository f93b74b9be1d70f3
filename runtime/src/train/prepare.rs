//! How a handle gets its programs: [`Nitro::prepare`] looks up (or compiles) what the
//! [`Inventory`] lacks — concurrently or one at a time — and records what each lookup did and
//! spent ([`ProgramTime`]); [`Nitro::plan`] says what that would do without doing it.

use super::*;
use crate::cache::{Probe, Will};
use crate::hash::Digest;

impl<E: Model, O: Optimizer> Nitro<E, O> {
    /// Gets (or compiles) the training programs — gradient and update — for batches like
    /// `sample`, concurrently, and returns what each lookup did. Called by the first step; call
    /// it earlier to pay for compiles before training. The evaluation program is compiled by
    /// the first [`evaluate`](Nitro::evaluate) — or with these by [`fit`](Nitro::fit) when it
    /// is given validation data.
    pub fn prepare(&mut self, sample: &E::Batch) -> Result<Vec<Outcome>> {
        self.prepare_programs(sample, Need::Train)
    }

    /// Gets (or compiles) the programs `inventory` names for batches like `sample` — the
    /// training programs always — all at once: a `fit` with validation data waits for the
    /// slowest program of its whole inventory, not for the training programs and then, after
    /// the first epoch, for the evaluation programs.
    pub(super) fn prepare_programs(
        &mut self,
        sample: &E::Batch,
        need: Need,
    ) -> Result<Vec<Outcome>> {
        // Every step comes here: the common case (programs held for these batch types) is
        // answered without allocating.
        if self.inventory.ready(sample, need) {
            return Ok(Vec::new());
        }
        self.prepare_shapes(std::slice::from_ref(sample), need)
    }

    /// Gets (or compiles) what `inventory` names for batches like each of `samples` that the
    /// handle does not hold: every lookup of every
    /// shape at once, at most [`Config::compile_threads`] at a time, checked against the
    /// program budget before any compiles; then each shape's programs are installed in order
    /// (the last shape's are current).
    pub(super) fn prepare_shapes(
        &mut self,
        samples: &[E::Batch],
        need: Need,
    ) -> Result<Vec<Outcome>> {
        let started = Instant::now();
        let replicas = self.backend.replicas();
        // What each shape needs, its rows checked; the new programs counted for the budget.
        let mut jobs = Vec::new();
        let mut new = 0;
        let mut nothing_held = self.inventory.is_empty();
        for (i, sample) in samples.iter().enumerate() {
            let wants = self.inventory.wants(sample, need);
            let rows = batch_rows(sample)?;
            let expected_rows = self.expected_rows(sample)?;
            if rows != expected_rows {
                let why = match &self.config.buckets {
                    Some(_) => "rows for this bucket (Buckets::rows_for)",
                    None => "rows (Config::batch)",
                };
                return Err(Error::InvalidSetting {
                    variable: "batch",
                    value: rows.to_string(),
                    expected: format!("batches of {expected_rows} {why}"),
                });
            }
            new += wants.new_programs(nothing_held, self.inventory.metrics().len());
            nothing_held &= !wants.grad;
            jobs.push((i, wants, rows));
        }
        self.inventory.check_budget(
            self.config.max_programs,
            &samples[jobs.first().map_or(0, |j| j.0)],
            new,
        )?;
        // Tracing reads the experiment's leaf types only, which steps never change: no sync.
        let shaped: Vec<(Shaped<'_, E::Batch>, ProgramInputs<O>)> = jobs
            .iter()
            .map(|&(i, _, rows)| {
                Ok((
                    Shaped::new(&samples[i], replicas)?,
                    self.program_inputs(rows),
                ))
            })
            .collect::<Result<_>>()?;
        let found = {
            let lookups: Vec<(usize, Lookup<'_>)> = jobs
                .iter()
                .zip(&shaped)
                .enumerate()
                .flat_map(|(j, ((i, wants, _), (sample, inputs)))| {
                    self.lookups(sample, inputs, wants, self.bucket_edge(&samples[*i]))
                        .into_iter()
                        .map(move |l| (j, l))
                })
                .collect();
            let threads = if self.config.concurrent_compiles {
                self.config.compile_thread_count()
            } else {
                1
            };
            get_all(lookups, threads, !self.config.progress)
        };
        drop(shaped);
        let mut by_job: Vec<Vec<(Slot, &'static str, Result<Served>)>> =
            jobs.iter().map(|_| Vec::new()).collect();
        for (j, slot, role, result) in found {
            by_job[j].push((slot, role, result));
        }
        let mut outcomes = Vec::new();
        for ((i, _, _), found) in jobs.iter().zip(by_job) {
            let sample = &samples[*i];
            let got = found
                .into_iter()
                .map(|(slot, role, result)| Ok((slot, role, result?)))
                .collect::<Result<Vec<_>>>()?;
            let edge = self.bucket_edge(sample);
            outcomes.extend(
                self.inventory
                    .install(leaf_types(sample), got, self.backend, edge),
            );
        }
        self.inventory.spent(started.elapsed());
        Ok(outcomes)
    }

    /// The inventory's lookups for one batch shape: what `prepare` gets and `plan` probes, one
    /// list for both, in the plan's order (update, gradient, evaluation, metrics).
    fn lookups<'a>(
        &'a self,
        sample: &'a Shaped<'a, E::Batch>,
        inputs: &'a ProgramInputs<O>,
        wants: &Wants,
        edge: Option<usize>,
    ) -> Vec<Lookup<'a>> {
        let (backend, cache, experiment) = (self.backend, self.cache, &self.experiment);
        let compute = self.config.precision.compute();
        let mut out = Vec::new();
        if wants.update {
            out.push(Lookup::new(Slot::Update, "update", None, move |mode| {
                let program = update_program::<O>();
                found(
                    mode,
                    cache,
                    backend,
                    &program,
                    &inputs.opt,
                    &inputs.update_inputs,
                )
            }));
        }
        if wants.grad {
            if self.config.accum > 1 {
                out.push(Lookup::new(
                    Slot::Grad,
                    "grad_accumulate",
                    edge,
                    move |mode| {
                        let batch = BatchRef(sample, &inputs.mask, &inputs.sums);
                        found(
                            mode,
                            cache,
                            backend,
                            &grad_accum_program::<E>(compute),
                            experiment,
                            &batch,
                        )
                    },
                ));
            } else if let Some(scaled) = &inputs.scaled_sample {
                out.push(Lookup::new(Slot::Grad, "grad", edge, move |mode| {
                    let batch = BatchRef(sample, &inputs.mask, scaled);
                    found(
                        mode,
                        cache,
                        backend,
                        &grad_scaled_program::<E>(compute),
                        experiment,
                        &batch,
                    )
                }));
            } else {
                out.push(Lookup::new(Slot::Grad, "grad", edge, move |mode| {
                    let batch = BatchRef(sample, &inputs.mask, &inputs.key_sample);
                    found(
                        mode,
                        cache,
                        backend,
                        &grad_program::<E>(compute),
                        experiment,
                        &batch,
                    )
                }));
            }
        }
        if wants.eval {
            out.push(Lookup::new(Slot::Eval, "eval", edge, move |mode| {
                let batch = BatchRef(sample, &inputs.mask, &());
                found(
                    mode,
                    cache,
                    backend,
                    &eval_program::<E>(compute),
                    experiment,
                    &batch,
                )
            }));
        }
        for (i, m) in self.inventory.metrics().iter().enumerate() {
            if !wants.metrics.get(i).copied().unwrap_or(false) {
                continue;
            }
            let slot = m.slot.as_ref();
            out.push(Lookup::new(
                Slot::Metric(i),
                slot.name(),
                edge,
                move |mode| {
                    Ok(match mode {
                        Mode::Get => Found::Served(slot.get(
                            cache,
                            backend,
                            experiment,
                            sample,
                            &inputs.mask,
                            compute,
                        )?),
                        Mode::Probe => Found::Probe(slot.probe(
                            cache,
                            backend,
                            experiment,
                            sample,
                            &inputs.mask,
                            compute,
                        )?),
                    })
                },
            ));
        }
        out
    }

    /// Gets (or compiles) the evaluation program for batches like `sample`.
    pub(super) fn prepare_eval(&mut self, sample: &E::Batch) -> Result<Arc<Compiled>> {
        self.prepare_programs(sample, Need::Evaluate)?;
        self.inventory.eval().ok_or_else(no_output)
    }

    /// The optimizer program's experiment, with arrays of the right types from the layout
    /// (values unused: zeroed memory, never written, so never resident).
    pub(super) fn optimizer_step_shape(&self) -> OptimizerStep<O> {
        let layout = self.state.layout();
        let state = zero_state(&self.optimizer, &layout.packing);
        OptimizerStep {
            optimizer: self.optimizer.clone(),
            params: layout.packing.zeros(),
            state,
            masks: layout.masks.clone(),
            layout: crate::shard::GroupLayout::new(
                self.partitioning().map(|p| p.mesh()),
                layout
                    .specs
                    .iter()
                    .zip(&layout.paths)
                    .map(|(s, path)| (path.clone(), s.clone()))
                    .collect(),
            ),
            steps: Array::scalar(0i64),
            loss_scaling: self.config.precision.loss_scaling(),
            loss_scale: match self.config.precision.loss_scaling() {
                Some(_) => vec![Array::scalar(0.0f32), Array::scalar(0i64)],
                None => Vec::new(),
            },
        }
    }

    /// Device metric `i`'s program for batches like `sample`, compiled (with every other
    /// device metric's) by the first use.
    pub(super) fn metric_program(&mut self, i: usize, sample: &E::Batch) -> Result<Arc<Compiled>> {
        self.prepare_programs(sample, Need::Validate)?;
        self.inventory.metric(i).ok_or_else(no_output)
    }

    /// The rows a batch like `sample` must have: [`Config::batch`], or with buckets the rows
    /// of its bucket — an error when its variable dimension is not a declared edge.
    pub(super) fn expected_rows(&self, sample: &E::Batch) -> Result<usize> {
        let Some(buckets) = &self.config.buckets else {
            return Ok(self.config.batch);
        };
        let axis = buckets.axis();
        let mut edge = None;
        for leaf in leaves(sample) {
            if let Some(&len) = leaf.dims().get(axis) {
                buckets.check_edge(len)?;
                edge.get_or_insert(len);
            }
        }
        let edge = edge.ok_or_else(|| Error::InvalidDataArgument {
            what: format!(
                "a bucketed batch needs a leaf with a dimension at axis {axis}, the variable \
                 length; this batch has none"
            ),
        })?;
        Ok(buckets.rows_for(edge, self.config.batch, self.row_multiple()))
    }

    /// The bucket edge of batches like `sample` (`None` without buckets).
    fn bucket_edge(&self, sample: &E::Batch) -> Option<usize> {
        let axis = self.config.buckets.as_ref()?.axis();
        leaves(sample)
            .iter()
            .find_map(|a| a.dims().get(axis).copied())
    }

    /// The inventory manifest of this handle: every program it got (from memory, the store or
    /// a compile), each once, with its fingerprint and store key — what `nitro cache pull
    /// --manifest` fetches onto another machine before it runs the same experiment.
    pub fn manifest(&self) -> crate::cache::Manifest {
        self.inventory.manifest()
    }

    /// The programs the handle holds: the update program, and per batch shape its gradient
    /// program, with its evaluation program and device metrics when it validated.
    pub fn programs_held(&self) -> usize {
        self.inventory.held_count()
    }

    /// The programs a handle with buckets declares: the update program, and per edge the
    /// gradient program (plus, when `validating`, the evaluation program and one per device
    /// metric); without buckets, as for one edge.
    pub fn declared_inventory(&self, validating: bool) -> usize {
        let edges = self.config.buckets.as_ref().map_or(1, |b| b.edges().len());
        self.inventory.declared(edges, validating)
    }

    /// The inputs the handle's programs are looked up with, for batches of `rows` rows (each
    /// replica sees its share).
    fn program_inputs(&self, rows: usize) -> ProgramInputs<O> {
        let opt = self.optimizer_step_shape();
        let update_inputs = update_inputs_shape(&opt);
        let key_sample: GradExtra = E::RANDOM.then(|| Array::zeros(DType::U32, &[2]));
        ProgramInputs {
            mask: Array::zeros(DType::F32, &[rows / self.backend.replicas()]),
            sums: AccumExtra {
                sums: self.state.layout().packing.zeros(),
                scale: Array::scalar(1.0f32),
                key: key_sample.clone(),
                loss_scale: self
                    .config
                    .precision
                    .loss_scaling()
                    .map(|_| Array::scalar(1.0f32)),
            },
            opt,
            update_inputs,
            scaled_sample: self.config.precision.loss_scaling().map(|_| ScaledExtra {
                key: key_sample.clone(),
                loss_scale: Array::scalar(1.0f32),
            }),
            key_sample,
        }
    }

    /// The preflight: what getting the programs for batches like `sample` would do — per
    /// program, a hit, a load, a fetch from the shared server or a compile, with the miss
    /// reason and the expected time from the store's records — traced and keyed, never compiled
    /// (the cache's counters do not move). `validating` adds the evaluation and metric
    /// programs. With buckets, [`plan_buckets`](Nitro::plan_buckets) plans every edge.
    pub fn plan(&self, sample: &E::Batch, validating: bool) -> Result<Plan> {
        let mut plan = Plan::default();
        self.plan_into(&mut plan, sample, validating, None)?;
        Ok(plan)
    }

    /// The preflight of the whole declared inventory: [`plan`](Nitro::plan) for every bucket
    /// edge, with batches of `data`'s columns; the update program once.
    pub fn plan_buckets(
        &self,
        data: &crate::data::buckets::Ragged,
        validating: bool,
    ) -> Result<Plan>
    where
        E::Batch: FromBatch,
    {
        let buckets = self
            .config
            .buckets
            .clone()
            .ok_or_else(|| Error::InvalidSetting {
                variable: "Config::buckets",
                value: "None".into(),
                expected: "declared bucket edges to plan (or plan one batch with Nitro::plan)"
                    .into(),
            })?;
        let mut plan = Plan::default();
        for &edge in buckets.edges() {
            let rows = buckets.rows_for(edge, self.config.batch, self.row_multiple());
            let sample = E::Batch::from_batch(data.blank(edge, rows, &buckets)?)?;
            self.plan_into(&mut plan, &sample, validating, Some(edge))?;
        }
        Ok(plan)
    }

    fn plan_into(
        &self,
        plan: &mut Plan,
        sample: &E::Batch,
        validating: bool,
        edge: Option<usize>,
    ) -> Result<()> {
        let rows = batch_rows(sample)?;
        let expected = self.expected_rows(sample)?;
        if rows != expected {
            return Err(Error::InvalidSetting {
                variable: "batch",
                value: rows.to_string(),
                expected: format!("batches of {expected} rows"),
            });
        }
        let sample = &Shaped::new(sample, self.backend.replicas())?;
        let inputs = self.program_inputs(rows);
        let wants = Wants {
            grad: true,
            update: !plan.entries.iter().any(|e| e.role == "update"),
            eval: validating,
            metrics: vec![validating; self.inventory.metrics().len()],
        };
        for lookup in self.lookups(sample, &inputs, &wants, edge) {
            let Found::Probe(probe) = (lookup.run)(Mode::Probe)? else {
                continue;
            };
            plan.entries.push(PlanEntry {
                role: lookup.role.to_owned(),
                edge: lookup.edge,
                probe,
            });
        }
        Ok(())
    }
}

/// Which program of the inventory a lookup is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Slot {
    Grad,
    Update,
    Eval,
    Metric(usize),
}

/// What a lookup does: get the program (compiling it if need be), or say what getting it
/// would do ([`Cache::probe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Get,
    Probe,
}

/// What a lookup found.
pub(super) enum Found {
    Served(Served),
    Probe(Probe),
}

/// One program of the inventory for one batch shape: its role, its edge, and how to get or
/// probe it.
pub(super) struct Lookup<'a> {
    slot: Slot,
    role: &'static str,
    edge: Option<usize>,
    run: Box<dyn Fn(Mode) -> Result<Found> + Send + Sync + 'a>,
}

impl<'a> Lookup<'a> {
    fn new(
        slot: Slot,
        role: &'static str,
        edge: Option<usize>,
        run: impl Fn(Mode) -> Result<Found> + Send + Sync + 'a,
    ) -> Lookup<'a> {
        Lookup {
            slot,
            role,
            edge,
            run: Box::new(run),
        }
    }
}

/// [`Cache::get`] or [`Cache::probe`] of one program.
fn found<X: Experiment, M, Out: crate::program::Outputs, I: Tree<Mirror<Tensor> = M>>(
    mode: Mode,
    cache: &Cache,
    backend: &'static dyn Backend,
    program: &Program<X, M, Out>,
    experiment: &X,
    inputs: &I,
) -> Result<Found> {
    Ok(match mode {
        Mode::Get => Found::Served(cache.get(backend, program, experiment, inputs)?),
        Mode::Probe => Found::Probe(cache.probe(backend, program, experiment, inputs)?),
    })
}

/// Gets every lookup's program, at most `threads` at a time (this thread one of them), the
/// gradient programs first and then the rest in the list's order, the next starting as one
/// ends; with `quiet`, compiles print no progress.
/// Each result is returned with its job number, slot and role, in the lookups' order.
fn get_all(
    lookups: Vec<(usize, Lookup<'_>)>,
    threads: usize,
    quiet: bool,
) -> Vec<(usize, Slot, &'static str, Result<Served>)> {
    let n = lookups.len();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<Served>>>> =
        (0..n).map(|_| std::sync::Mutex::new(None)).collect();
    // The gradient programs first: the slowest to compile, and what the first step waits for.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| lookups[i].1.slot != Slot::Grad);
    let work = || {
        crate::cache::quietly(quiet, || loop {
            let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(&i) = order.get(k) else {
                break;
            };
            let (_, lookup) = &lookups[i];
            let result = (lookup.run)(Mode::Get).and_then(|f| match f {
                Found::Served(s) => Ok(s),
                Found::Probe(_) => Err(no_output()),
            });
            *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(result);
        })
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = (1..threads.min(n).max(1)).map(|_| s.spawn(work)).collect();
        work();
        // A helper that panicked leaves its lookup without a result: an error below.
        for h in helpers {
            let _ = h.join();
        }
    });
    lookups
        .iter()
        .zip(results)
        .map(|((job, lookup), result)| {
            let result = result
                .into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .unwrap_or_else(|| {
                    Err(Error::Misconfigured {
                        message: "a compiling thread panicked".into(),
                    })
                });
            (*job, lookup.slot, lookup.role, result)
        })
        .collect()
}

/// The inputs a handle's programs are looked up with (values unused: only their types matter).
pub(super) struct ProgramInputs<O: Optimizer> {
    pub(super) mask: Array,
    pub(super) opt: OptimizerStep<O>,
    pub(super) update_inputs: UpdateArgs,
    pub(super) key_sample: GradExtra,
    /// The gradient program's extra inputs with dynamic loss scaling.
    pub(super) scaled_sample: Option<ScaledExtra>,
    pub(super) sums: AccumExtra,
}

/// One program of a [`Plan`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PlanEntry {
    /// Its role (`grad`, `update`, `eval`, a metric's name).
    pub role: String,
    /// The bucket edge of its batches (`None`: no buckets, or the update program).
    pub edge: Option<usize>,
    /// What getting it would do.
    pub probe: Probe,
}

/// The preflight of a handle's inventory ([`Nitro::plan`], [`Nitro::plan_buckets`]): what
/// each program's lookup would do, found without compiling.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Plan {
    /// Per program (× bucket), in lookup order.
    pub entries: Vec<PlanEntry>,
}

impl Plan {
    /// How many entries would do `will`.
    pub fn count(&self, will: Will) -> usize {
        self.entries.iter().filter(|e| e.probe.will == will).count()
    }

    /// The expected wait, in milliseconds: the recorded compile (or load) times summed over
    /// the programs that are not hits (an upper bound when they compile concurrently), and how
    /// many of those have no record to go by.
    pub fn expected_ms(&self) -> (f64, usize) {
        let misses = self.entries.iter().filter(|e| e.probe.will != Will::Hit);
        let (mut ms, mut unknown) = (0.0, 0);
        for e in misses {
            match e.probe.expected_ms() {
                Some(t) => ms += t,
                None => unknown += 1,
            }
        }
        (ms, unknown)
    }

    /// The fingerprints of every program, in order: a run's inventory manifest.
    pub fn fingerprints(&self) -> Vec<Digest> {
        self.entries.iter().map(|e| e.probe.fingerprint).collect()
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for e in &self.entries {
            let edge = e.edge.map_or_else(String::new, |n| format!(" [{n}]"));
            write!(
                f,
                "{:<16} {:<22}",
                format!("{}{edge}", e.role),
                e.probe.will.to_string()
            )?;
            if let Some(reason) = &e.probe.reason {
                write!(f, " {reason}")?;
            }
            match (e.probe.will, e.probe.expected_ms(), e.probe.compile_ms) {
                (Will::Hit, _, _) => {}
                (Will::Compile, Some(ms), _) => write!(f, " (~{ms:.0} ms last time)")?,
                (_, Some(ms), Some(c)) => write!(f, " (~{ms:.0} ms; compiled in {c:.0} ms)")?,
                (_, Some(ms), None) => write!(f, " (~{ms:.0} ms last time)")?,
                (_, None, Some(c)) => write!(f, " (saves a {c:.0} ms compile)")?,
                (_, None, None) => write!(f, " (no record of its time)")?,
            }
            writeln!(f)?;
        }
        let (ms, unknown) = self.expected_ms();
        let misses = self.entries.len() - self.count(Will::Hit);
        write!(
            f,
            "{} program(s): {} hit, {} load, {} fetch, {} compile; ",
            self.entries.len(),
            self.count(Will::Hit),
            self.count(Will::Load),
            self.count(Will::Fetch),
            self.count(Will::Compile),
        )?;
        match (misses, unknown) {
            (0, _) => write!(f, "nothing to wait for"),
            (_, 0) => write!(f, "expected wait ~{:.1} s", ms / 1e3),
            (m, u) if u == m => write!(
                f,
                "expected wait unknown (no record of these programs' times)"
            ),
            (_, u) => write!(
                f,
                "expected wait ~{:.1} s plus {u} program(s) without a record",
                ms / 1e3
            ),
        }
    }
}
