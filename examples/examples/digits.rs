//! Trains the digits MLP (64 → 128 tanh → 10; Adam unless `--optimizer` says otherwise) through
//! the training handle, on XLA when a PJRT plugin is installed (else on the reference
//! interpreter), and checks the acceptance criterion: no recompile after step 1.
//!
//! The data set is split 80/20 with a seed, batches are reshuffled every epoch, and the ragged
//! last batch is padded and masked, so every step runs the same program. Parameters and the
//! optimizer's state stay on the device between steps. The run ends with one JSON line
//! (`--json` prints only that) whose fields scripts rely on; `--plot FILE.png` draws the loss
//! and validation accuracy per epoch.
//!
//! The learning rate follows a cosine decay from 1e-2 after a short warm-up. Validation accuracy
//! after 10 epochs depends on the split (359 held-out rows, 0.28% each): 97.5% with the default
//! seed; seeds 2 to 5 gave 96.9%, 98.3%, 97.8% and 96.4% (measured on XLA).
//!
//! `--devices N` trains data-parallel on N devices (on a CPU plugin, N CPU devices sharing the
//! machine's cores): the same programs, replicated, each batch split across the devices.
//!
//! `cargo run --release -p nitro-examples --example digits [-- --epochs N --json]` (from the
//! workspace root; `-- --help` lists the flags).

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use nitro::cache;
use nitro::optim::{Adam, AdamW, Momentum, Sgd};
use nitro::Experiment;
use nitro_examples::report::{exit_status, install_log, Summary};
use nitro_examples::run::{self, Settings, TRAIN_FRACTION};
use nitro_examples::{data, plot, DigitsMlp};

/// Trains the digits MLP through nitro's compile cache and checks that nothing recompiles
/// after the first step.
#[derive(Parser, Debug)]
#[command(name = "digits")]
struct Args {
    /// The preflight: print what each program of the run would do (hit, load, fetch or
    /// compile, with the reason and the recorded time), compile nothing, and exit.
    #[arg(long)]
    check: bool,
    /// Epochs to train.
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Rows per step (the ragged last batch of an epoch is padded to it).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// The peak learning rate of the cosine schedule.
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// The hidden layer's width.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// The optimizer (with its default constants).
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adam)]
    optimizer: OptimizerKind,
    /// The seed of the train/validation split and of the per-epoch shuffles.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Devices to train on at once (data parallel: each batch is split across them); on a CPU
    /// plugin they share the machine's cores. Default: `NITRO_DEVICES`, else 1.
    #[arg(long)]
    devices: Option<usize>,
    /// Print only the JSON line.
    #[arg(long)]
    json: bool,
    /// Draw the loss and validation accuracy per epoch to this PNG file (its directory must
    /// exist).
    #[arg(long, value_name = "FILE.png")]
    plot: Option<PathBuf>,
}

/// The optimizers of `nitro::optim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OptimizerKind {
    /// Adam (β1 0.9, β2 0.999, ε 1e-8).
    Adam,
    /// AdamW: Adam with decoupled weight decay 0.01.
    Adamw,
    /// Plain stochastic gradient descent.
    Sgd,
    /// SGD with momentum 0.9.
    Momentum,
}

impl OptimizerKind {
    /// The name as given on the command line.
    fn name(self) -> &'static str {
        match self {
            OptimizerKind::Adam => "adam",
            OptimizerKind::Adamw => "adamw",
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Momentum => "momentum",
        }
    }
}

fn main() -> std::process::ExitCode {
    exit_status("digits", try_main())
}

fn try_main() -> Result<(), Box<dyn std::error::Error>> {
    let started = std::time::Instant::now();
    // `RUST_LOG=nitro=info` shows one line per compile (with its reason and time) and per epoch.
    install_log();
    let args = Args::parse();
    if args.epochs == 0 || args.batch == 0 || args.hidden == 0 {
        return Err("--epochs, --batch and --hidden must be at least 1".into());
    }
    if !(args.lr.is_finite() && args.lr > 0.0) {
        return Err(format!("--lr must be a positive number, not {}", args.lr).into());
    }
    // Refuse a plot path that cannot be written before training, not after.
    if let Some(path) = &args.plot {
        plot::check_path(path)?;
    }
    let say = |line: String| {
        if !args.json {
            println!("{line}");
        }
    };
    let data = data::Digits::load(data::DIGITS_PATH)?;
    let devices = match args.devices {
        Some(n) => n,
        None => nitro::backend::pjrt::devices_setting()?.unwrap_or(1),
    };
    let backend = nitro::backend::for_devices(devices)?;
    say(format!(
        "data     {} rows, digest {}",
        data.rows(),
        data.digest()
            .map_or_else(|| "none".to_owned(), |d| d.short().to_string())
    ));
    say(format!("backend  {}", backend.identity().description));
    let split = data.split(TRAIN_FRACTION, args.seed)?;
    say(format!(
        "split    {} train / {} held out, split {}",
        split.train.rows(),
        split.validation.rows(),
        split
            .identity()
            .map_or_else(|| "none".to_owned(), |d| d.short().to_string())
    ));
    say(format!(
        "model    64 → {} tanh → 10, {}, peak lr {}, batch {}",
        args.hidden,
        args.optimizer.name(),
        args.lr,
        args.batch
    ));
    if !args.json {
        print!("{}", DigitsMlp::key_manifest());
    }

    let settings = Settings {
        epochs: args.epochs,
        batch: args.batch,
        lr: args.lr,
        hidden: args.hidden,
        seed: args.seed,
        progress: !args.json,
        devices: Some(devices),
    };
    if args.check {
        let plan = match args.optimizer {
            OptimizerKind::Adam => run::plan(&data, &split, &settings, Adam::default()),
            OptimizerKind::Adamw => run::plan(&data, &split, &settings, AdamW::default()),
            OptimizerKind::Sgd => run::plan(&data, &split, &settings, Sgd),
            OptimizerKind::Momentum => run::plan(&data, &split, &settings, Momentum::default()),
        }?;
        if args.json {
            println!("{}", nitro_examples::report::plan_json("digits", &plan));
        } else {
            println!("{plan}");
        }
        return Ok(());
    }
    let trained = match args.optimizer {
        OptimizerKind::Adam => run::train(&data, &split, &settings, Adam::default()),
        OptimizerKind::Adamw => run::train(&data, &split, &settings, AdamW::default()),
        OptimizerKind::Sgd => run::train(&data, &split, &settings, Sgd),
        OptimizerKind::Momentum => run::train(&data, &split, &settings, Momentum::default()),
    }?;
    say(trained.history.to_string());

    let stats = cache::cache_stats();
    say(format!("cache    {stats}"));
    // Every program was compiled (or loaded) once, before or during the first step and the
    // first validation; nothing after.
    cache::assert_no_recompile_after_warmup()?;
    say("no recompile after warm-up: ok".into());

    if let Some(path) = &args.plot {
        let title = format!(
            "digits MLP 64-{}-10, {}, peak lr {}, batch {}",
            args.hidden,
            args.optimizer.name(),
            args.lr,
            args.batch
        );
        plot::training_curves(&trained.history, &title, path)?;
        say(format!("plot     {}", path.display()));
    }

    let summary = Summary::new("digits", backend)
        .history(&trained.history)
        .cache(&stats)
        .first_step(trained.first_step)
        .field("optimizer", args.optimizer.name())
        .field("devices", devices)
        .field("fit_s", trained.fit_s)
        .field("process_s", started.elapsed().as_secs_f64());
    println!("{summary}");
    Ok(())
}
