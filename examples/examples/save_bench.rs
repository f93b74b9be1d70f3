//! What background saves cost the steps of a run: a character model of `--layers` scanned
//! blocks (`nitro::nn::Repeated`) of width `--width`, its parameters created on the devices
//! and split over `--devices` CPU devices (FSDP), trained `--steps` steps on random windows
//! once without saving and once with `Config::save_every(--every, dir)` into a checkpoint
//! directory, `--rounds` times alternating. Prints one JSON line: per run the median step, the
//! p90 and max of all steps and of the save steps (the step that starts a save and the next,
//! whose update hands the state over), the ratio of the worst save step to the median, and
//! the save reports.
//!
//! A step is `Nitro::step` (it reads the loss back, as a custom loop does) followed by
//! `Nitro::wait` (the update finished): the time a loop pays per step, save included.
//!
//! `cargo run --release -p nitro-examples --example save_bench [-- --steps 60 --every 20]`

use std::time::Instant;

use clap::Parser;
use nitro::prelude::*;
use nitro::shard::{Mesh, Sharding};
use nitro::train::{Config, Nitro, SaveReport};
use nitro_examples::chargpt::{self, CharGpt, GptShape, Windows};
use serde_json::json;

/// What background saves cost each step of an FSDP run on CPU devices; prints one JSON line.
#[derive(Parser, Debug)]
#[command(about, long_about = None)]
struct Args {
    /// Blocks, one scan over stacked parameters.
    #[arg(long, default_value_t = 6)]
    layers: usize,
    /// Model width.
    #[arg(long, default_value_t = 512)]
    width: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Characters per window.
    #[arg(long, default_value_t = 32)]
    context: usize,
    /// Windows per step (a multiple of --devices).
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// CPU devices, one FSDP axis.
    #[arg(long, default_value_t = 4)]
    devices: usize,
    /// Timed steps per run (after --warm untimed ones).
    #[arg(long, default_value_t = 60)]
    steps: usize,
    /// Untimed steps first (compiling, first runs).
    #[arg(long, default_value_t = 3)]
    warm: usize,
    /// Save every this many steps in the saving run.
    #[arg(long, default_value_t = 20)]
    every: u64,
    /// Runs of each kind, alternating (plain, saving, plain, …).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Also print every step's time of each run.
    #[arg(long)]
    all_steps: bool,
}

/// The vocabulary of the random windows.
const VOCAB: usize = 96;

/// What one run measured.
struct Run {
    /// Every timed step, in milliseconds, and whether it was a save step.
    steps: Vec<(f64, bool)>,
    /// The reports of the saves that finished, in order.
    saves: Vec<SaveReport>,
}

fn main() -> std::process::ExitCode {
    nitro_examples::report::exit_status("save_bench", try_main())
}

fn try_main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.devices == 0 || args.batch % args.devices != 0 || args.every == 0 {
        return Err(
            "--devices and --every must be at least 1, --batch a multiple of --devices".into(),
        );
    }
    let batches = windows(&args, 8)?;
    let params = {
        let e = experiment(&args);
        let mut n = 0usize;
        e.visit_device(&mut |_, _, node| {
            if let nitro::tree::Node::Leaf(a) = node {
                n += a.len();
            }
        });
        n
    };
    let mut plain = Vec::new();
    let mut saving = Vec::new();
    for round in 0..args.rounds {
        plain.push(run(&args, &batches, None)?);
        let dir =
            std::env::temp_dir().join(format!("nitro-save-bench-{}-{round}", std::process::id()));
        let measured = run(&args, &batches, Some(&dir));
        let _ = std::fs::remove_dir_all(&dir);
        saving.push(measured?);
    }
    let all = |runs: &[Run], saves_only: bool| -> Vec<f64> {
        runs.iter()
            .flat_map(|r| r.steps.iter())
            .filter(|(_, save)| !saves_only || *save)
            .map(|(ms, _)| *ms)
            .collect()
    };
    let plain_median = quantile(all(&plain, false), 0.5);
    let saving_median = quantile(all(&saving, false), 0.5);
    let save_steps = all(&saving, true);
    let save_max = quantile(save_steps.clone(), 1.0);
    let per_round: Vec<serde_json::Value> = plain
        .iter()
        .zip(&saving)
        .map(|(p, s)| {
            let steps = |r: &Run| r.steps.iter().map(|(ms, _)| *ms).collect::<Vec<_>>();
            let saves: Vec<f64> = s
                .steps
                .iter()
                .filter(|(_, v)| *v)
                .map(|(ms, _)| *ms)
                .collect();
            let all = |r: &Run| {
                args.all_steps
                    .then(|| steps(r).into_iter().map(round2).collect::<Vec<_>>())
            };
            json!({
                "plain_steps_ms": all(p),
                "saving_steps_ms": all(s),
                "plain_median_ms": round2(quantile(steps(p), 0.5)),
                "saving_median_ms": round2(quantile(steps(s), 0.5)),
                "save_steps_ms": saves.iter().map(|&v| round2(v)).collect::<Vec<_>>(),
                "saving_max_ms": round2(quantile(steps(s), 1.0)),
            })
        })
        .collect();
    let reports: Vec<serde_json::Value> = saving
        .iter()
        .flat_map(|r| r.saves.iter())
        .map(|s| {
            json!({
                "step": s.step,
                "bytes": s.bytes,
                "copy_ms": round2(s.copy.as_secs_f64() * 1e3),
                "write_ms": round2(s.write.as_secs_f64() * 1e3),
            })
        })
        .collect();
    let line = json!({
        "bench": "save",
        "backend": nitro::backend::current()?.identity().description,
        "parameters": params,
        "layers": args.layers,
        "width": args.width,
        "context": args.context,
        "batch": args.batch,
        "devices": args.devices,
        "steps": args.steps,
        "every": args.every,
        "rounds": args.rounds,
        "plain_median_ms": round2(plain_median),
        "plain_p90_ms": round2(quantile(all(&plain, false), 0.9)),
        "plain_max_ms": round2(quantile(all(&plain, false), 1.0)),
        "saving_median_ms": round2(saving_median),
        "saving_p90_ms": round2(quantile(all(&saving, false), 0.9)),
        "saving_max_ms": round2(quantile(all(&saving, false), 1.0)),
        "save_steps": save_steps.len(),
        "save_step_p90_ms": round2(quantile(save_steps, 0.9)),
        "save_step_max_ms": round2(save_max),
        "ratio_save_max_to_plain_median": round2(save_max / plain_median),
        "ratio_save_max_to_saving_median": round2(save_max / saving_median),
        "rounds_detail": per_round,
        "saves": reports,
    });
    println!("{line}");
    Ok(())
}

/// The model: `--layers` blocks scanned, declared by its types (its values are created on
/// the devices by the layer library's rules).
fn experiment(args: &Args) -> CharGpt {
    let shape = GptShape {
        layers: args.layers,
        width: args.width,
        heads: args.heads,
        context: args.context,
        dropout: 0.0,
        seed: 1,
        scan: true,
    };
    nitro::init::declared(|| CharGpt::new(&shape, VOCAB))
}

/// `count` batches of random windows (seeded, so every run trains on the same).
fn windows(args: &Args, count: usize) -> nitro::Result<Vec<Windows>> {
    let mut rng = nitro::init::Rng::new(nitro::init::Seed(7));
    let mut ids = |n: usize| -> Vec<i32> {
        (0..n)
            .map(|_| (rng.next_f64() * VOCAB as f64) as i32 % VOCAB as i32)
            .collect()
    };
    (0..count)
        .map(|_| {
            let n = args.batch * args.context;
            Ok(Windows {
                x: Array::from_vec(&[args.batch, args.context], ids(n))?,
                y: Array::from_vec(&[args.batch, args.context], ids(n))?,
                valid: None,
            })
        })
        .collect()
}

/// One run: a fresh handle (saving to `dir` every `--every` steps when given), `--warm`
/// untimed steps, then `--steps` timed ones.
fn run(args: &Args, batches: &[Windows], dir: Option<&std::path::Path>) -> nitro::Result<Run> {
    let mut config = Config::new()
        .batch(args.batch)
        .lr(3e-4)
        .progress(false)
        .mesh(Mesh::new([("data", args.devices)])?)
        .sharding(Sharding::fsdp("data"))
        .initialize_all(nitro::init::layer_defaults());
    if let Some(dir) = dir {
        config = config.save_every(args.every, dir);
    }
    let mut run = Nitro::new(experiment(args), chargpt::optimizer(), config)?;
    let batch = |i: usize| &batches[i % batches.len()];
    for i in 0..args.warm {
        run.step(batch(i), args.batch)?;
    }
    run.wait()?;
    let (mut steps, mut saves) = (Vec::with_capacity(args.steps), Vec::new());
    let mut seen = None;
    for i in 0..args.steps {
        let t = Instant::now();
        run.step(batch(args.warm + i), args.batch)?;
        run.wait()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        // The step that starts a save (and waits for the one before), and the next, whose
        // update hands the state over.
        let at = run.steps();
        let save = dir.is_some() && (at % args.every == 0 || at % args.every == 1) && at > 1;
        steps.push((ms, save));
        if let Some(report) = run.last_save() {
            if seen != Some(report.step) {
                seen = Some(report.step);
                saves.push(report.clone());
            }
        }
    }
    if let Some(report) = run.wait_saved()? {
        saves.push(report);
    }
    Ok(Run { steps, saves })
}

/// The `q` quantile of `v` (nearest rank; 1.0 is the max); NaN when empty.
fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// `x` to two decimals.
fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
