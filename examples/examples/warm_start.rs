//! What the persistent compile cache saves a new process: the digits run (the `digits`
//! example's model, optimizer, schedule and validation), started twice as a child process
//! against a fresh, empty cache directory (`NITRO_CACHE_DIR`):
//!
//! - **cold**: the directory is empty, every program compiles (and is stored);
//! - **warm**: a new process finds every program in the directory and loads it instead.
//!
//! For each program of the inventory (gradient, update, evaluation) it prints the compile time
//! (cold) against the load time (warm), then the first step (from making the handle: programs
//! ready and one step run) and the whole child process as the parent saw it (start to exit).
//! It checks that the cold child compiled every program and the warm one none, and ends with
//! one JSON line: the warm child's figures, with `warm_start` holding both children's.
//!
//! The children use only the local directory (`NITRO_CACHE_REMOTE` is removed from their
//! environment); the directory is deleted at the end.
//!
//! `cargo run --release -p nitro-examples --example warm_start [-- --epochs N --json]` (from
//! the workspace root).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use clap::Parser;
use nitro::optim::Adam;
use nitro_examples::data;
use nitro_examples::report::{exit_status, last_json_line, short_program, Summary};
use nitro_examples::run::{self, Settings, TRAIN_FRACTION};
use serde_json::{json, Map, Value};

/// Runs the digits training twice in fresh processes on one new cache directory — cold, then
/// warm — and compares what getting the programs cost.
#[derive(Parser, Debug)]
#[command(name = "warm_start")]
struct Args {
    /// Epochs each child trains.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Print only the JSON line.
    #[arg(long)]
    json: bool,
    /// Run as the measured child: train, then print one JSON line.
    #[arg(long, hide = true)]
    child: bool,
}

/// The programs of a digits run with validation: gradient, update, evaluation.
const PROGRAMS: u64 = 3;

fn main() -> std::process::ExitCode {
    nitro_examples::report::install_log();
    exit_status("warm_start", try_main())
}

fn try_main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.epochs == 0 {
        return Err("--epochs must be at least 1".into());
    }
    if args.child {
        return child(&args);
    }
    let dir = scratch_dir();
    let result = parent(&args, &dir);
    // A directory the first child never made is not an error.
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            eprintln!(
                "warm_start: could not remove the cache directory {}: {e}",
                dir.display()
            );
        }
    }
    result
}

/// A cache directory path no one uses yet (the store creates it, owner-only).
fn scratch_dir() -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!("nitro-warm-start-{}-{nanos}", std::process::id()))
}

/// The measured child: the digits run through the process-wide cache (whose persistent level
/// is `NITRO_CACHE_DIR`), then its summary line with every program it got and how.
fn child(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let data = data::Digits::load(data::DIGITS_PATH)?;
    let split = data.split(TRAIN_FRACTION, 1)?;
    let settings = Settings {
        epochs: args.epochs,
        progress: false,
        ..Settings::default()
    };
    let trained = run::train(&data, &split, &settings, Adam::default())?;
    let backend = nitro::backend::current()?;
    let cache = nitro::cache::global();
    let programs: Vec<Value> = cache
        .recent_misses()
        .iter()
        .map(|m| {
            json!({
                "program": m.program,
                "loaded": m.loaded,
                "reason": m.reason.to_string(),
                "ms": m.ms,
            })
        })
        .collect();
    let summary = Summary::new("warm_start_child", backend)
        .history(&trained.history)
        .cache(&cache.stats())
        .first_step(trained.first_step)
        .field("programs", programs)
        .field("programs_ms", trained.programs.as_secs_f64() * 1e3)
        .field("fit_s", trained.fit_s)
        .field("process_s", started.elapsed().as_secs_f64());
    println!("{summary}");
    Ok(())
}

/// One child's run: its summary line, and its wall time as the parent saw it.
struct ChildRun {
    summary: Map<String, Value>,
    wall_ms: f64,
}

impl ChildRun {
    fn number(&self, key: &str) -> f64 {
        self.summary.get(key).and_then(Value::as_f64).unwrap_or(0.0)
    }

    fn cache_count(&self, key: &str) -> u64 {
        self.summary
            .get("cache")
            .and_then(|c| c.get(key))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    }

    /// Each program's build (compile or load) time in milliseconds, and whether it loaded.
    fn programs(&self) -> Vec<(String, f64, bool)> {
        self.summary
            .get("programs")
            .and_then(Value::as_array)
            .map(|ps| {
                ps.iter()
                    .map(|p| {
                        (
                            p["program"].as_str().unwrap_or("?").to_owned(),
                            p["ms"].as_f64().unwrap_or(0.0),
                            p["loaded"].as_bool().unwrap_or(false),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The programs this child compiled instead of loading, with the cache's reasons
    /// (`: grad (store_rejected: load)`), or nothing.
    fn compiled_reasons(&self) -> String {
        let compiled: Vec<String> = self
            .summary
            .get("programs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|p| p["loaded"] == false)
            .map(|p| {
                format!(
                    "{} ({})",
                    short_program(p["program"].as_str().unwrap_or("?")),
                    p["reason"].as_str().unwrap_or("?")
                )
            })
            .collect();
        match compiled.is_empty() {
            true => String::new(),
            false => format!(" (compiled: {})", compiled.join("; ")),
        }
    }

    /// The figures the parent's JSON line keeps of this child.
    fn to_json(&self) -> Value {
        json!({
            "process_ms": self.wall_ms,
            "child_process_ms": self.number("process_s") * 1e3,
            "first_step_ms": self.number("first_step_ms"),
            "programs_ms": self.number("programs_ms"),
            "fit_s": self.number("fit_s"),
            "compiles": self.cache_count("compiles"),
            "loads": self.cache_count("l2_loads"),
        })
    }
}

/// Runs this program as a child on the cache directory `dir`.
fn run_child(args: &Args, dir: &Path) -> Result<ChildRun, Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let out = Command::new(exe)
        .args(["--child", "--epochs", &args.epochs.to_string()])
        .env("NITRO_CACHE_DIR", dir)
        .env("NITRO_CACHE", "on")
        .env_remove("NITRO_CACHE_REMOTE")
        .stderr(std::process::Stdio::inherit())
        .output()?;
    let wall_ms = started.elapsed().as_secs_f64() * 1e3;
    if !out.status.success() {
        return Err(format!("the child process failed ({})", out.status).into());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = last_json_line(&stdout)
        .ok_or_else(|| format!("the child printed no JSON line:\n{stdout}"))?;
    Ok(ChildRun { summary, wall_ms })
}

fn parent(args: &Args, dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let say = |line: String| {
        if !args.json {
            println!("{line}");
        }
    };
    say(format!("cache directory {} (new, empty)", dir.display()));
    let cold = run_child(args, dir)?;
    let warm = run_child(args, dir)?;
    say(format!(
        "backend  {}",
        warm.summary
            .get("plugin")
            .and_then(Value::as_str)
            .unwrap_or("?")
    ));
    say(format!(
        "\n{:<36} {:>16} {:>16}",
        "program", "cold (compiled)", "warm (loaded)"
    ));
    let warm_programs = warm.programs();
    let mut rows = Vec::new();
    for (program, cold_ms, cold_loaded) in cold.programs() {
        let (warm_ms, warm_loaded) = warm_programs
            .iter()
            .find(|(p, ..)| *p == program)
            .map_or((f64::NAN, false), |(_, ms, loaded)| (*ms, *loaded));
        say(format!(
            "{:<36} {:>13.1} ms {:>13.1} ms",
            short_program(&program),
            cold_ms,
            warm_ms
        ));
        rows.push(json!({
            "program": program,
            "cold_ms": cold_ms,
            "cold_loaded": cold_loaded,
            "warm_ms": warm_ms,
            "warm_loaded": warm_loaded,
        }));
    }
    let line = |what: &str, key: &str, scale: f64| {
        format!(
            "{what:<36} {:>13.1} ms {:>13.1} ms",
            cold.number(key) * scale,
            warm.number(key) * scale
        )
    };
    say(line(
        "getting the programs (handle total)",
        "programs_ms",
        1.0,
    ));
    say(line(
        "first step (programs ready, 1 step)",
        "first_step_ms",
        1.0,
    ));
    say(line(
        &format!("training ({} epoch(s), validated)", args.epochs),
        "fit_s",
        1e3,
    ));
    say(format!(
        "{:<36} {:>13.1} ms {:>13.1} ms",
        "process (start to exit)", cold.wall_ms, warm.wall_ms
    ));

    let (cold_compiles, cold_loads) = (cold.cache_count("compiles"), cold.cache_count("l2_loads"));
    let (warm_compiles, warm_loads) = (warm.cache_count("compiles"), warm.cache_count("l2_loads"));
    if cold_compiles != PROGRAMS || cold_loads != 0 || warm_compiles != 0 || warm_loads != PROGRAMS
    {
        return Err(format!(
            "expected the cold child to compile {PROGRAMS} programs and the warm \
             one to load them all; cold compiled {cold_compiles} and loaded {cold_loads}, warm \
             compiled {warm_compiles} and loaded {warm_loads}{}",
            warm.compiled_reasons()
        )
        .into());
    }
    say(format!(
        "\ncold compiled {cold_compiles} programs, warm loaded {warm_loads} and compiled none: ok"
    ));

    let text = |key: &str| {
        warm.summary
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_owned()
    };
    let mut summary = Summary::with_backend("warm_start", &text("backend"), &text("plugin"));
    // The warm child's figures are the summary's: a process that starts on a warm cache.
    for key in Summary::COMMON_FIELDS[3..]
        .iter()
        .copied()
        .chain(["remote"])
    {
        if let Some(v) = warm.summary.get(key) {
            summary = summary.field(key, v.clone());
        }
    }
    let summary = summary.field(
        "warm_start",
        json!({
            "cold": cold.to_json(),
            "warm": warm.to_json(),
            "programs": rows,
        }),
    );
    println!("{summary}");
    Ok(())
}
