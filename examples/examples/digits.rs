//! Trains the digits MLP (64 → 128 tanh → 10) with Adam through the training handle, on XLA
//! when a PJRT plugin is installed (else on the reference interpreter), and checks the
//! acceptance criterion: no recompile after step 1.
//!
//! The data set is split 80/20 with a seed, batches are reshuffled every epoch, and the ragged
//! last batch is padded and masked, so every step runs the same program. Parameters and Adam's
//! state stay on the device between steps. The run ends with one JSON line (`--json` prints
//! only that) whose fields scripts rely on.
//!
//! The learning rate follows a cosine decay from 1e-2 after a short warm-up. Validation accuracy
//! after 10 epochs depends on the split (359 held-out rows, 0.28% each): 97.5% with the default
//! seed; seeds 2 to 5 gave 96.9%, 98.3%, 97.8% and 96.4% (measured on XLA).
//!
//! `cargo run --release -p nitro-examples --example digits [-- --epochs N --json]` (from the
//! workspace root).

use nitro::cache;
use nitro::optim::{Adam, Cosine};
use nitro::train::{Config, Nitro};
use nitro::Experiment;
use nitro_examples::{data, glorot, Activation, Arch, DigitsMlp};

const BATCH: usize = 32;
const LEARNING_RATE: f64 = 1e-2;
const TRAIN_FRACTION: f64 = 0.8;
const SEED: u64 = 1;

/// The command line: `--epochs N` (default 10), `--seed N` (the split and shuffle seed,
/// default 1), `--json` (print only the JSON line).
struct Args {
    epochs: usize,
    seed: u64,
    json: bool,
}

fn args() -> Result<Args, String> {
    let mut out = Args {
        epochs: 10,
        seed: SEED,
        json: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => out.json = true,
            "--epochs" => {
                out.epochs = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--epochs takes a number of epochs")?;
            }
            "--seed" => {
                out.seed = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--seed takes a number")?;
            }
            other => {
                return Err(format!(
                    "unknown argument `{other}`; try --epochs N, --seed N or --json"
                ))
            }
        }
    }
    Ok(out)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let started = std::time::Instant::now();
    // `RUST_LOG=nitro=info` shows one line per compile (with its reason and time) and per epoch.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = args()?;
    let say = |line: String| {
        if !args.json {
            println!("{line}");
        }
    };
    let data = data::Digits::load(data::DIGITS_PATH)?;
    let backend = nitro::backend::current()?;
    say(format!(
        "data     {} rows, digest {}",
        data.rows(),
        data.digest().short()
    ));
    say(format!("backend  {}", backend.identity().description));

    let arch = Arch {
        widths: vec![64, 128, 10],
        activation: Activation::Tanh,
    };
    let split = data.split(TRAIN_FRACTION, args.seed)?;
    say(format!(
        "split    {} train / {} held out, split {}",
        split.train.rows(),
        split.validation.rows(),
        split.identity().short()
    ));
    let exp = DigitsMlp {
        layers: glorot(&arch.widths, 1),
        arch,
        // Not used by the handle, which owns the learning rate (a Device scalar it writes).
        lr: nitro::Array::scalar(0.0f32),
        data,
    };
    if !args.json {
        print!("{}", DigitsMlp::key_manifest());
    }

    // Cosine decay from the peak rate after a short warm-up, over the whole run: the rate is a
    // traced scalar written each step, so the schedule compiles nothing.
    let steps = (split.train.rows().div_ceil(BATCH) * args.epochs) as u64;
    let config = Config::new()
        .batch(BATCH)
        .epochs(args.epochs)
        .seed(args.seed)
        .schedule(Cosine {
            base: LEARNING_RATE,
            min: LEARNING_RATE / 100.0,
            warmup: steps / 20,
            total: steps,
        })
        .progress(!args.json);
    let mut run = Nitro::new(exp, Adam::default(), config)?;
    let fit_started = std::time::Instant::now();
    let history = run.fit(&split.train, Some(&split.validation))?;
    let fit_s = fit_started.elapsed().as_secs_f64();
    say(history.to_string());

    let stats = cache::cache_stats();
    say(format!("cache    {stats}"));
    // Every program was compiled (or loaded) once, before or during the first step and the
    // first validation; nothing after.
    cache::assert_no_recompile_after_warmup()?;
    say("no recompile after warm-up: ok".into());

    let mut medians: Vec<f64> = history.epochs.iter().map(|e| e.step_us_median).collect();
    medians.sort_by(f64::total_cmp);
    let json = serde_json::json!({
        "example": "digits",
        "backend": if backend.device().is_some() { "xla" } else { "interp" },
        "plugin": backend.identity().description,
        "epochs": history.epochs.len(),
        "val_accuracy": history.epochs.last().and_then(|e| e.val_accuracy),
        "cache": {
            "hits": stats.hits,
            "misses": stats.misses,
            "entries": stats.entries,
            "compiles": stats.compiles,
            "l2_loads": stats.l2_hits,
            "misses_by_reason": stats.misses_by_reason,
        },
        "step_us_median": medians.get(medians.len() / 2).copied().unwrap_or(0.0),
        "first_step_ms": run.first_step_time().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        "fit_s": fit_s,
        "process_s": started.elapsed().as_secs_f64(),
        "compile_ms_total": stats.compile_ms,
        // The shared cache's exchanges (NITRO_CACHE_REMOTE); null without one.
        "remote": stats.remote,
    });
    println!("{json}");
    Ok(())
}
