//! A CNN on Fashion-MNIST (conv 3×3 16 → relu → max-pool 2×2, conv 3×3 32 → relu → max-pool
//! 2×2, dense 10) trained through the training handle with native convolution and pooling, on
//! XLA when a PJRT plugin is installed. It validates on the 10 000 test images after every
//! epoch and checks the acceptance criterion: no recompile after step 1.
//!
//! The data is the Debian package `dataset-fashion-mnist` (`apt-get install
//! dataset-fashion-mnist`); `--data DIR` reads the four idx files from elsewhere. The run ends
//! with one JSON line (`--json` prints only that): the digits example's fields plus
//! `test_accuracy`, `step_ms` (a waited step), `step_ms_pipelined` and `compile_ms_by_program`.
//!
//! Measured here (2 cores, CPU XLA): 90.2% test accuracy after the default 5 epochs, 96 s,
//! about 38 ms a step; a second process loads its three programs instead of compiling them.
//!
//! `cargo run --release -p nitro-examples --example fashion [-- --epochs N --train-rows N --json]`

use std::path::PathBuf;

use clap::Parser;
use nitro::cache;
use nitro::data::idx;
use nitro::prelude::*;
use nitro::train::{Config, FromBatch, Nitro};
use nitro_examples::fashion::{self, FashionCnn, Images};
use nitro_examples::report::{exit_status, install_log, Summary};
use nitro_examples::{twin, HandleFlags};
use serde_json::json;

/// Trains a small CNN on Fashion-MNIST and checks that nothing recompiles after step 1.
#[derive(Parser, Debug)]
#[command(name = "fashion")]
struct Args {
    /// Epochs to train.
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    /// Rows per step.
    #[arg(long, default_value_t = 128)]
    batch: usize,
    /// The peak learning rate of the cosine schedule.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Train on the first N training images only (all 60 000 by default).
    #[arg(long)]
    train_rows: Option<usize>,
    /// The seed of the initial weights and of the per-epoch shuffles.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The directory of the four idx files (default: the Debian package's).
    #[arg(long)]
    data: Option<PathBuf>,
    /// The flags of every handle example (`--json`, `--check`, `--serial-compiles`,
    /// `--manifest`, `--twin`).
    #[command(flatten)]
    run: HandleFlags,
}

fn main() -> std::process::ExitCode {
    exit_status("fashion", try_main())
}

fn try_main() -> Result<(), Box<dyn std::error::Error>> {
    let started = std::time::Instant::now();
    install_log();
    let args = Args::parse();
    if args.epochs == 0 || args.batch == 0 {
        return Err("--epochs and --batch must be at least 1".into());
    }
    args.run.check_paths()?;
    let say = |line: String| {
        if !args.run.json {
            println!("{line}");
        }
    };
    let raw = idx::fashion_mnist(args.data.as_deref())?;
    let train = fashion::dataset(&raw.train_images, &raw.train_labels, args.train_rows)?;
    let test = fashion::dataset(&raw.test_images, &raw.test_labels, None)?;
    let steps = (train.rows().div_ceil(args.batch) * args.epochs) as u64;
    let config = Config::new()
        .batch(args.batch)
        .epochs(args.epochs)
        .seed(args.seed)
        .schedule(fashion::schedule(args.lr, steps))
        .concurrent_compiles(!args.run.serial_compiles)
        .progress(!args.run.json);
    let config = args.run.apply_layout(config)?;
    // The devices the handle runs on (a mesh, or --devices), not the process's default.
    let backend = config.backend()?;
    say(format!(
        "data     Fashion-MNIST, {} train / {} test images",
        train.rows(),
        test.rows()
    ));
    say(format!("backend  {}", backend.identity().description));
    say(format!(
        "model    conv3x3 16 · relu · pool2 · conv3x3 32 · relu · pool2 · dense 10, adam, peak lr {}, batch {}",
        args.lr, args.batch
    ));
    if !args.run.json {
        print!("{}", FashionCnn::key_manifest());
    }
    let experiment = FashionCnn::new(args.seed);
    if let Some(dir) = &args.run.twin {
        let schedule = fashion::schedule(args.lr, steps);
        let adam = fashion::optimizer();
        let run = json!({
            "model": "fashion",
            "steps": steps,
            "batch": args.batch,
            "seed": args.seed,
            "schedule": {"base": schedule.base, "min": schedule.min,
                         "warmup": schedule.warmup, "total": schedule.total},
            "adam": {"beta1": adam.beta1, "beta2": adam.beta2, "eps": adam.eps},
            "weight_decay": 0.0,
            "decayed": [],
            "dropout": 0.0,
            "data_dir": args.data.clone().unwrap_or_else(|| idx::FASHION_MNIST_DIR.into()),
            "train_rows": train.rows(),
            "epochs": args.epochs,
            "precision": args.run.precision.to_string(),
            "loss_scaling": args.run.precision.loss_scaling().map(|s| json!({
                "initial": s.initial, "growth_interval": s.growth_interval,
            })),
        });
        let rows = twin::step_rows(&train, args.batch, args.seed, args.epochs)?;
        twin::write(dir, &experiment, &run, &rows, &[])?;
        say(format!(
            "twin     bundle for bench/twin_fashion.py in {}",
            dir.display()
        ));
    }
    let mut run = Nitro::new(experiment, fashion::optimizer(), config)?;
    if args.run.check {
        let rows: Vec<usize> = (0..args.batch.min(train.rows())).collect();
        let sample = Images::from_batch(train.gather(&rows, args.batch)?)?;
        args.run.print_plan("fashion", &run.plan(&sample, true)?);
        return Ok(());
    }
    let fit_started = std::time::Instant::now();
    let history = run.fit(&train, Some(&test))?;
    let fit_s = fit_started.elapsed().as_secs_f64();
    say(history.to_string());
    let stats = cache::cache_stats();
    say(format!("cache    {stats}"));
    cache::assert_no_recompile_after_warmup()?;
    say("no recompile after warm-up: ok".into());
    if let Some(path) = &args.run.manifest {
        run.manifest().write(path)?;
        say(format!("manifest {}", path.display()));
    }

    let last = history.epochs.last().ok_or("no epoch ran")?;
    let test_accuracy = last.val_accuracy.unwrap_or(0.0);
    let summary = Summary::new("fashion", backend)
        .history(&history)
        .cache(&stats)
        .first_step(run.first_step_time())
        .field("test_accuracy", test_accuracy)
        .handle(last, run.program_times())
        .warm_floor(
            run.first_step_time(),
            last,
            run.program_times(),
            run.first_runs(),
        )
        .layout(&run)
        .field("loss_scale", json!(run.loss_scale()?))
        .field("fit_s", fit_s)
        .field("process_s", started.elapsed().as_secs_f64());
    println!("{summary}");
    Ok(())
}
