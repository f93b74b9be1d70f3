//! The one JSON line every example ends with, built in one place.
//!
//! Scripts read the last line of an example's output: an object with `example`, `backend`
//! (`xla` or `interp`), `plugin`, `epochs`, `val_accuracy`, `cache` (hits, misses, entries,
//! compiles, loads from the persistent cache, misses by reason, failed writes of the
//! persistent cache), `step_us_median` (a whole
//! step, waited for), `step_us_pipelined` (an epoch's training wall time ÷ its batches, steps
//! enqueued while earlier ones run), `first_step_ms` and `compile_ms_total`, plus whatever an
//! example adds ([`Summary::field`]). The step figures are `null` for an example that takes
//! no training steps.
//!
//! ```
//! use nitro_examples::report::{last_json_line, Summary};
//!
//! let line = Summary::with_backend("demo", "interp", "reference interpreter")
//!     .field("note", "extra fields go last")
//!     .to_string();
//! let parsed = last_json_line(&format!("a table\n{line}\n")).expect("one JSON line");
//! assert_eq!(parsed["example"], "demo");
//! assert_eq!(parsed["note"], "extra fields go last");
//! ```

use std::fmt;
use std::process::ExitCode;
use std::time::Duration;

use nitro::backend::Backend;
use nitro::cache::CacheStats;
use nitro::train::History;
use serde_json::{json, Map, Value};

/// The summary line of an example run: the common fields, then the example's own.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    fields: Map<String, Value>,
}

impl Summary {
    /// A summary of `example` run on `backend` (`backend` is `xla` when the backend has a
    /// PJRT device, `interp` otherwise). The other common fields start empty: 0 epochs, no
    /// accuracy, no cache figures, zero times.
    pub fn new(example: &str, backend: &dyn Backend) -> Summary {
        Summary::with_backend(
            example,
            backend_kind(backend),
            &backend.identity().description,
        )
    }

    /// The fields every example's line has, whose names and meanings scripts rely on.
    pub const COMMON_FIELDS: [&'static str; 10] = [
        "example",
        "backend",
        "plugin",
        "epochs",
        "val_accuracy",
        "cache",
        "step_us_median",
        "step_us_pipelined",
        "first_step_ms",
        "compile_ms_total",
    ];

    /// A summary with the backend given in words (`kind` is `xla` or `interp`; `plugin` the
    /// backend's description), for a process that did not open a backend itself.
    pub fn with_backend(example: &str, kind: &str, plugin: &str) -> Summary {
        let mut fields = Map::new();
        fields.insert("example".into(), json!(example));
        fields.insert("backend".into(), json!(kind));
        fields.insert("plugin".into(), json!(plugin));
        fields.insert("epochs".into(), json!(0));
        fields.insert("val_accuracy".into(), Value::Null);
        fields.insert("cache".into(), Value::Null);
        fields.insert("step_us_median".into(), Value::Null);
        fields.insert("step_us_pipelined".into(), Value::Null);
        fields.insert("first_step_ms".into(), json!(0.0));
        fields.insert("compile_ms_total".into(), json!(0.0));
        Summary { fields }
    }

    /// The epochs of a training history: how many, the last epoch's validation accuracy, the
    /// median of the epochs' median waited steps, and the median of their pipelined step
    /// times.
    pub fn history(self, history: &History) -> Summary {
        let waited: Vec<f64> = history.epochs.iter().map(|e| e.step_us_median).collect();
        let pipelined: Vec<f64> = history.epochs.iter().map(|e| e.step_us_pipelined).collect();
        self.field("epochs", history.epochs.len())
            .field(
                "val_accuracy",
                history.epochs.last().and_then(|e| e.val_accuracy),
            )
            .field("step_us_median", median(&waited))
            .field("step_us_pipelined", median(&pipelined))
    }

    /// The compile cache's figures (`cache`, `compile_ms_total`, and `remote`: the shared
    /// cache's exchanges, `null` without one), and the cost ledger: seconds spent compiling
    /// (`compile_s`) and loading (`load_s`), seconds saved by hits and loads (`saved_s`, from
    /// the store's records of the compiles they spared), and the programs compiled, loaded and
    /// hit.
    pub fn cache(self, stats: &CacheStats) -> Summary {
        self.field("cache", cache_json(stats))
            .field("compile_ms_total", stats.compile_ms)
            .field("remote", json!(stats.remote))
            .field("compile_s", stats.compile_ms / 1e3)
            .field("load_s", stats.load_ms / 1e3)
            .field("saved_s", stats.saved_ms / 1e3)
            .field("programs_compiled", stats.compiles)
            .field("programs_loaded", stats.l2_hits)
            .field("programs_hit", stats.hits)
    }

    /// A training handle's figures: the last epoch's waited and pipelined step (`step_ms`,
    /// `step_ms_pipelined`), each program's compile and trace time by role
    /// (`compile_ms_by_program`, `trace_ms_by_program`), and the process's `peak_rss_mb`.
    pub fn handle(
        self,
        last: &nitro::train::EpochRecord,
        times: &[nitro::train::ProgramTime],
    ) -> Summary {
        self.field("step_ms", last.step_us_median / 1e3)
            .field("step_ms_pipelined", last.step_us_pipelined / 1e3)
            .field("compile_ms_by_program", ms_by_program(times, false))
            .field("trace_ms_by_program", ms_by_program(times, true))
            .field("peak_rss_mb", peak_rss_mb())
    }

    /// The warm start against its floor: `load_ms_by_program`, what loading each program from
    /// the persistent cache took (per role, the lookups that loaded); and when every program
    /// the handle looked up was loaded — the examples look them all up before the first step —
    /// `first_step_floor_ms`, those loads one after another plus one steady step (`step_ms`,
    /// the last epoch's median), and `first_step_over_floor`, the first step's time over it.
    /// Both `null` in a run that compiled, or took no step. Then, cold or warm, the training
    /// programs' first two runs, each timed alone ([`nitro::train::Nitro::first_runs`]):
    /// `first_run_ms_by_program`, `second_run_ms_by_program` and `first_run_excess_ms` (the
    /// first runs' excess over the second, summed: the backend's lazy set-up at a program's
    /// first execute, which the floor does not hold).
    pub fn warm_floor(
        self,
        first_step: Option<Duration>,
        last: &nitro::train::EpochRecord,
        times: &[nitro::train::ProgramTime],
        runs: Option<nitro::train::FirstRuns>,
    ) -> Summary {
        let loaded = |t: &&nitro::train::ProgramTime| {
            matches!(t.outcome, nitro::cache::Outcome::Loaded { .. })
        };
        let loads: Vec<nitro::train::ProgramTime> = times.iter().filter(loaded).cloned().collect();
        let all_loaded = !times.is_empty() && loads.len() == times.len();
        let floor_ms = all_loaded.then(|| {
            loads
                .iter()
                .map(|t| t.build.as_secs_f64() * 1e3)
                .sum::<f64>()
                + last.step_us_median / 1e3
        });
        let over = floor_ms
            .zip(first_step)
            .map(|(floor, first)| first.as_secs_f64() * 1e3 / floor);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let by_program = |grad: Option<Duration>, update: Option<Duration>| match (grad, update) {
            (Some(g), Some(u)) => json!({"grad": ms(g), "update": ms(u)}),
            _ => Value::Null,
        };
        self.field("load_ms_by_program", ms_by_program(&loads, false))
            .field("first_step_floor_ms", floor_ms)
            .field("first_step_over_floor", over)
            .field(
                "first_run_ms_by_program",
                by_program(runs.map(|r| r.grad), runs.map(|r| r.update)),
            )
            .field(
                "second_run_ms_by_program",
                by_program(
                    runs.and_then(|r| r.second_grad),
                    runs.and_then(|r| r.second_update),
                ),
            )
            .field(
                "first_run_excess_ms",
                runs.and_then(|r| r.excess()).map(|(g, u)| ms(g + u)),
            )
    }

    /// How a handle is laid out over its devices: `devices`, `sharding` (the mesh and
    /// sharding it partitions over, `null` when replicated or on one device) and `memory`
    /// (per device: bytes of parameters, frozen leaves, optimizer state and gradient sums,
    /// and the programs held, each with the compiler's figures for one run on one device —
    /// arguments, outputs, temporaries: [`nitro::train::Memory`]), `precision` (what the
    /// model computed in: `f32`, `bf16`, `f16`) and `temporaries_mb` (the largest program's
    /// temporaries, MiB).
    pub fn layout<E: nitro::train::Model, O: nitro::optim::Optimizer>(
        self,
        run: &nitro::train::Nitro<E, O>,
    ) -> Summary {
        self.field("devices", run.devices())
            .field(
                "sharding",
                run.partitioning().map(nitro::shard::Partitioning::describe),
            )
            .field("memory", json!(run.memory()))
            .field("precision", run.config().precision.to_string())
            .field(
                "temporaries_mb",
                run.memory()
                    .largest_temporaries()
                    .map(|b| b as f64 / (1 << 20) as f64),
            )
    }

    /// How long the run took to finish its first step (0 when it took none).
    pub fn first_step(self, time: Option<Duration>) -> Summary {
        self.field("first_step_ms", time.map_or(0.0, |d| d.as_secs_f64() * 1e3))
    }

    /// Sets field `key` (a common one, or one of the example's own).
    pub fn field(mut self, key: &str, value: impl Into<Value>) -> Summary {
        self.fields.insert(key.to_owned(), value.into());
        self
    }

    /// The summary as a JSON value.
    pub fn to_value(&self) -> Value {
        Value::Object(self.fields.clone())
    }
}

impl fmt::Display for Summary {
    /// The summary as one line of JSON.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_value())
    }
}

/// `xla` when `backend` runs on a PJRT device, `interp` for the reference interpreter.
pub fn backend_kind(backend: &dyn Backend) -> &'static str {
    if backend.device().is_some() {
        "xla"
    } else {
        "interp"
    }
}

/// The cache figures of a summary: hits, misses, entries, compiles, loads from the persistent
/// cache (`l2_loads`) and misses by reason.
pub fn cache_json(stats: &CacheStats) -> Value {
    json!({
        "hits": stats.hits,
        "misses": stats.misses,
        "entries": stats.entries,
        "compiles": stats.compiles,
        "l2_loads": stats.l2_hits,
        "misses_by_reason": stats.misses_by_reason,
        "store_write_failures": stats.store_write_failures,
    })
}

/// The median of `values` (the upper one of an even count); 0 for none.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(0.0)
}

/// A program identity without its module paths, for tables:
/// `nitro::train::OptimizerStep<nitro::optim::Adam>::nitro.update` becomes
/// `OptimizerStep<Adam>::nitro.update`, `nitro_examples::DigitsMlp::nitro.grad` becomes
/// `DigitsMlp::nitro.grad`. (Module names are the leading lower-case segments of each path.)
pub fn short_program(program: &str) -> String {
    let mut out = String::with_capacity(program.len());
    let mut path = String::new();
    let flush = |path: &mut String, out: &mut String| {
        if path.starts_with("::") {
            out.push_str(path);
        } else {
            let segments: Vec<&str> = path.split("::").collect();
            let keep = segments
                .iter()
                .position(|s| s.starts_with(|c: char| c.is_ascii_uppercase()))
                .unwrap_or(segments.len().saturating_sub(1));
            out.push_str(&segments[keep..].join("::"));
        }
        path.clear();
    };
    for c in program.chars() {
        if matches!(c, '<' | '>' | ',' | ' ' | '(' | ')' | '[' | ']' | ';' | '&') {
            flush(&mut path, &mut out);
            out.push(c);
        } else {
            path.push(c);
        }
    }
    flush(&mut path, &mut out);
    out
}

/// The exit status of an example's `main`: success, or failure after printing the error on
/// stderr as a sentence (`digits: cannot write the plot to …`), not as a debug dump.
pub fn exit_status(example: &str, result: Result<(), Box<dyn std::error::Error>>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{example}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The last line of `output` that is a JSON object (an example's summary), parsed; `None`
/// when there is none.
pub fn last_json_line(output: &str) -> Option<Map<String, Value>> {
    output.lines().rev().find_map(|line| {
        let line = line.trim();
        if !line.starts_with('{') {
            return None;
        }
        match serde_json::from_str(line) {
            Ok(Value::Object(map)) => Some(map),
            _ => None,
        }
    })
}

/// Installs the examples' log subscriber on stderr: `RUST_LOG=nitro=info` shows one line per
/// compile (with its reason and time) and per epoch; nothing is logged without `RUST_LOG`.
pub fn install_log() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Per program role (`grad`, `update`, `eval`, …), the milliseconds its lookups spent
/// compiling or loading it (`build`) or tracing it (`trace`), summed over the shapes it was got
/// for (one per bucket), from the handle's
/// [`program_times`](nitro::train::Nitro::program_times): `{"grad": 1234.5, "update": …}`.
pub fn ms_by_program(times: &[nitro::train::ProgramTime], trace: bool) -> Value {
    let mut by_program: std::collections::BTreeMap<&str, f64> = Default::default();
    for t in times {
        let d = if trace { t.trace } else { t.build };
        *by_program.entry(t.role.as_str()).or_default() += d.as_secs_f64() * 1e3;
    }
    Value::Object(
        by_program
            .into_iter()
            .map(|(role, ms)| (role.to_owned(), Value::from(ms)))
            .collect::<Map<String, Value>>(),
    )
}

/// The preflight `plan` of `example` (`--check --json`) as one JSON object: `example`,
/// `check` (`true`), `programs` — per program (× bucket), in lookup order, its `role` (`grad`,
/// `update`, `eval`, a metric's name), `edge` (its bucket's, or `null`), `program` (its
/// identity), `outcome` (`hit`, `load`, `fetch` or `compile`), `reason` (why memory cannot
/// serve it, as the table says it; `null` for a hit), the recorded `compile_ms` and `load_ms`
/// (`null` without a record), `expected_ms` and `fingerprint` — then the counts `hit`, `load`,
/// `fetch`, `compile`, the total `expected_ms` of the programs that are not hits and how many
/// of those have no record (`without_record`).
///
/// ```
/// use nitro::train::Plan;
/// use nitro_examples::report::plan_json;
///
/// let v = plan_json("demo", &Plan::default());
/// assert_eq!(v["programs"].as_array().map(Vec::len), Some(0));
/// assert_eq!(v["compile"], 0);
/// ```
pub fn plan_json(example: &str, plan: &nitro::train::Plan) -> Value {
    use nitro::cache::Will;
    let programs: Vec<Value> = plan
        .entries
        .iter()
        .map(|e| {
            let p = &e.probe;
            json!({
                "role": e.role,
                "edge": e.edge,
                "program": p.program,
                "outcome": will_name(p.will),
                "reason": p.reason.as_ref().map(ToString::to_string),
                "compile_ms": p.compile_ms,
                "load_ms": p.load_ms,
                "expected_ms": p.expected_ms(),
                "fingerprint": p.fingerprint.to_string(),
            })
        })
        .collect();
    let (expected_ms, without_record) = plan.expected_ms();
    json!({
        "example": example,
        "check": true,
        "programs": programs,
        "hit": plan.count(Will::Hit),
        "load": plan.count(Will::Load),
        "fetch": plan.count(Will::Fetch),
        "compile": plan.count(Will::Compile),
        "expected_ms": expected_ms,
        "without_record": without_record,
    })
}

/// The one-word name of what a lookup would do, as [`plan_json`] writes it.
fn will_name(will: nitro::cache::Will) -> &'static str {
    use nitro::cache::Will;
    match will {
        Will::Hit => "hit",
        Will::Load => "load",
        Will::Fetch => "fetch",
        Will::Compile => "compile",
    }
}

/// The memory the system can give this process without swapping, in bytes (`MemAvailable` of
/// `/proc/meminfo`); `None` where the system does not say.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// This process's peak resident memory in MiB (`VmHWM` of `/proc/self/status`); `None` where
/// the system does not say.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nitro::train::EpochRecord;

    fn epoch(epoch: usize, step_us: f64, accuracy: Option<f64>) -> EpochRecord {
        EpochRecord {
            epoch,
            train_loss: 1.0 / epoch as f64,
            val_loss: accuracy.map(|a| 1.0 - a),
            val_accuracy: accuracy,
            metrics: Vec::new(),
            steps: 45,
            step_us_median: step_us,
            step_us_pipelined: step_us / 2.0,
            step_us_median_saving: None,
            seconds: 0.1,
        }
    }

    #[test]
    fn median_takes_the_middle_of_the_sorted_values() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0]), 3.0);
        assert_eq!(median(&[9.0, 1.0, 5.0]), 5.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 3.0);
    }

    #[test]
    fn summary_has_the_common_fields_and_the_history() {
        let history = History {
            epochs: vec![
                epoch(1, 50.0, Some(0.8)),
                epoch(2, 30.0, Some(0.9)),
                epoch(3, 40.0, Some(0.95)),
            ],
        };
        let mut stats = CacheStats {
            misses: 3,
            compiles: 2,
            l2_hits: 1,
            entries: 3,
            compile_ms: 12.5,
            ..CacheStats::default()
        };
        stats.misses_by_reason.insert("empty".into(), 3);
        let s = Summary::with_backend("digits", "xla", "a plugin")
            .history(&history)
            .cache(&stats)
            .first_step(Some(Duration::from_millis(250)))
            .field("extra", 7);
        let v = s.to_value();
        for key in Summary::COMMON_FIELDS {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        assert_eq!(v["epochs"], 3);
        assert_eq!(v["val_accuracy"], 0.95);
        assert_eq!(v["step_us_median"], 40.0);
        assert_eq!(v["step_us_pipelined"], 20.0);
        assert_eq!(v["first_step_ms"], 250.0);
        assert_eq!(v["compile_ms_total"], 12.5);
        assert_eq!(v["cache"]["l2_loads"], 1);
        assert_eq!(v["cache"]["misses_by_reason"]["empty"], 3);
        assert_eq!(v["cache"]["store_write_failures"], 0);
        assert_eq!(v["remote"], Value::Null);
        assert_eq!(v["extra"], 7);
        // One line, which parses back to the same object.
        let line = s.to_string();
        assert!(!line.contains('\n'));
        assert_eq!(last_json_line(&line).map(Value::Object), Some(v));
    }

    fn time(
        role: &str,
        outcome: nitro::cache::Outcome,
        build_ms: u64,
    ) -> nitro::train::ProgramTime {
        nitro::train::ProgramTime {
            role: role.into(),
            program: format!("p::{role}"),
            outcome,
            trace: Duration::ZERO,
            build: Duration::from_millis(build_ms),
            saved: Duration::ZERO,
            edge: None,
            fingerprint: Default::default(),
            key: Default::default(),
        }
    }

    #[test]
    fn the_warm_floor_is_the_loads_and_one_step_and_only_when_everything_loaded() {
        let loaded = || nitro::cache::Outcome::Loaded {
            reason: nitro::cache::MissReason::Empty,
        };
        let compiled = nitro::cache::Outcome::Compiled {
            reason: nitro::cache::MissReason::Empty,
        };
        let last = epoch(1, 200_000.0, None);
        let warm = [
            time("grad", loaded(), 300),
            time("update", loaded(), 20),
            time("eval", loaded(), 80),
        ];
        let runs = nitro::train::FirstRuns {
            grad: Duration::from_millis(330),
            update: Duration::from_millis(25),
            second_grad: Some(Duration::from_millis(190)),
            second_update: Some(Duration::from_millis(10)),
        };
        let v = Summary::with_backend("x", "xla", "p")
            .warm_floor(Some(Duration::from_millis(1200)), &last, &warm, Some(runs))
            .to_value();
        assert_eq!(v["first_run_ms_by_program"]["grad"], 330.0);
        assert_eq!(v["second_run_ms_by_program"]["update"], 10.0);
        assert_eq!(v["first_run_excess_ms"], 155.0, "140 + 15");
        assert_eq!(v["load_ms_by_program"]["grad"], 300.0);
        assert_eq!(
            v["first_step_floor_ms"], 600.0,
            "400 ms of loads and a 200 ms step"
        );
        assert_eq!(v["first_step_over_floor"], 2.0);
        // A program compiled: no floor of loads to hold the first step to.
        let cold = [time("grad", compiled, 900), time("update", loaded(), 20)];
        let v = Summary::with_backend("x", "xla", "p")
            .warm_floor(Some(Duration::from_millis(1200)), &last, &cold, None)
            .to_value();
        assert_eq!(v["first_run_excess_ms"], Value::Null);
        assert_eq!(v["load_ms_by_program"]["update"], 20.0);
        assert!(v["load_ms_by_program"].get("grad").is_none());
        assert_eq!(v["first_step_floor_ms"], Value::Null);
        assert_eq!(v["first_step_over_floor"], Value::Null);
    }

    #[test]
    fn a_summary_without_a_history_has_no_accuracy() {
        let v = Summary::with_backend("x", "interp", "p").to_value();
        assert_eq!(v["epochs"], 0);
        assert_eq!(v["val_accuracy"], Value::Null);
    }

    #[test]
    fn short_program_drops_module_paths() {
        assert_eq!(
            short_program("nitro::train::OptimizerStep<nitro::optim::Adam>::nitro.update"),
            "OptimizerStep<Adam>::nitro.update"
        );
        assert_eq!(
            short_program("nitro_examples::DigitsMlp::nitro.grad"),
            "DigitsMlp::nitro.grad"
        );
        assert_eq!(
            short_program("a::Pair<x::A, y::z::B>::step"),
            "Pair<A, B>::step"
        );
        assert_eq!(short_program("plain"), "plain");
        assert_eq!(short_program("m::f"), "f");
        assert_eq!(short_program(""), "");
    }

    #[test]
    fn last_json_line_skips_other_lines() {
        let out = "epoch  train loss\n{\"a\": 1}\n  1  0.5\n{not json\n{\"b\": 2}\ncache ok\n";
        let last = last_json_line(out).expect("a JSON line");
        assert_eq!(last.get("b"), Some(&json!(2)));
        assert_eq!(last_json_line("no json here\n[1, 2]\n"), None);
        assert_eq!(last_json_line(""), None);
    }
}
