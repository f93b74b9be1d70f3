//! Linear probing on the digits with a cached stage: a frozen random-feature encoder
//! (64 → `--width` → `--width`, tanh, random weights never trained) in front of a trainable
//! linear head. The encoder is a `#[device(frozen)]` field and its forward pass a cached
//! [`Stage`]: the first epoch runs it once per chunk of rows and stores the outputs; later
//! epochs (and later runs, from the persistent store) train the head alone.
//!
//! The table shows each epoch's time; the run ends with one JSON line in the digits example's
//! format plus `"stages": {"hits", "misses", "spared", "bytes", …}` and what naming a chunk by
//! its coordinate costs next to hashing a batch of its size.
//!
//! `cargo run --release -p nitro-examples --example probe [-- --epochs N --json]` (from the
//! workspace root).

use std::time::Instant;

use clap::Parser;
use nitro::data::BatchMirror;
use nitro::init::{self, Seed};
use nitro::optim::Adam;
use nitro::prelude::*;
use nitro::stage::{self, Coordinate, Stage};
use nitro::train::{Config, Model, Nitro};
use nitro_examples::data;
use nitro_examples::report::{exit_status, install_log, Summary};
use nitro_examples::run::TRAIN_FRACTION;

/// Trains a linear head on frozen random features of the digits, caching the features.
#[derive(Parser, Debug)]
#[command(name = "probe")]
struct Args {
    /// Epochs to train.
    #[arg(long, default_value_t = 10)]
    epochs: usize,
    /// Rows per step (and per stage chunk).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// The encoder's width.
    #[arg(long, default_value_t = 1024)]
    width: usize,
    /// The head's learning rate (Adam).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// The seed of the split, the shuffles and the encoder's weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print only the JSON line.
    #[arg(long)]
    json: bool,
}

/// A frozen encoder's weights.
#[derive(Tree)]
pub struct Layer {
    /// `[in, out]`.
    pub w: Array,
    /// `[out]`.
    pub b: Array,
}

/// Random features and a linear probe.
#[experiment]
pub struct Probe {
    /// The encoder's width: shapes both programs.
    #[graph_const]
    pub width: usize,
    /// The encoder: random, never trained; its content names the stored features.
    #[device(frozen)]
    pub encoder: Vec<Layer>,
    /// The head, `width → 10`.
    #[device(trainable)]
    pub head: Layer,
}

impl Stage for Probe {
    const NAME: &'static str = "encode";
    const INPUT: &'static str = "x";
    const OUTPUT: &'static str = "features";
    const CACHED: bool = true;
    type Output = Tensor;

    fn run(v: &ProbeFrozenView<'_>, x: &Tensor) -> Tensor {
        v.encoder
            .iter()
            .fold(*x, |h, l| (h.matmul(l.w) + l.b).tanh())
    }
}

fn logits(v: &ProbeView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
    let features = *b.get(Probe::OUTPUT).expect("the stage's column");
    features.matmul(v.head.w) + v.head.b
}

impl Model for Probe {
    type Batch = nitro::data::Batch;

    fn loss(v: &ProbeView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        nitro::nn::softmax_cross_entropy(logits(v, b), *b.get("y").expect("labels"))
    }

    fn correct(v: &ProbeView<'_>, b: &BatchMirror<Tensor>) -> Option<Tensor> {
        Some(nitro::nn::correct(
            logits(v, b),
            *b.get("y").expect("labels"),
        ))
    }
}

fn probe(width: usize, seed: u64) -> Probe {
    let layer = |fan_in: usize, fan_out: usize, s: u64| Layer {
        w: init::normal(
            &[fan_in, fan_out],
            0.0,
            (1.0 / fan_in as f64).sqrt(),
            Seed(s),
        ),
        b: init::normal(&[fan_out], 0.0, 0.1, Seed(s + 1)),
    };
    Probe {
        width,
        encoder: vec![
            layer(64, width, seed * 10),
            layer(width, width, seed * 10 + 2),
        ],
        head: Layer {
            w: Array::zeros(DType::F32, &[width, 10]),
            b: Array::zeros(DType::F32, &[10]),
        },
    }
}

fn main() -> std::process::ExitCode {
    install_log();
    exit_status("probe", try_main())
}

fn try_main() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let args = Args::parse();
    if args.epochs == 0 || args.batch == 0 || args.width == 0 {
        return Err("--epochs, --batch and --width must be at least 1".into());
    }
    let say = |line: String| {
        if !args.json {
            println!("{line}");
        }
    };
    let data = data::Digits::load(data::DIGITS_PATH)?;
    let split = data.split(TRAIN_FRACTION, args.seed)?;
    let backend = nitro::backend::current()?;
    say(format!("backend  {}", backend.identity().description));
    say(format!(
        "model    64 → {w} tanh → {w} tanh (frozen, cached stage) → 10 (trained), batch {}",
        args.batch,
        w = args.width
    ));
    let config = Config::new()
        .batch(args.batch)
        .lr(args.lr)
        .epochs(args.epochs)
        .seed(args.seed)
        .progress(!args.json);
    let mut run = Nitro::new(probe(args.width, args.seed), Adam::default(), config)?;
    let fit_started = Instant::now();
    let history = run.fit_staged(&split.train, Some(&split.validation))?;
    let fit_s = fit_started.elapsed().as_secs_f64();
    say(history.to_string());
    let first = history.epochs.first().map_or(0.0, |e| e.seconds);
    let later: Vec<f64> = history.epochs.iter().skip(1).map(|e| e.seconds).collect();
    let later_mean = later.iter().sum::<f64>() / later.len().max(1) as f64;
    say(format!(
        "epoch 1 {first:.3} s (runs or loads the stage), epochs 2+ {later_mean:.3} s each (head only)"
    ));
    let st = run.stage_stats();
    say(format!(
        "stage    misses {} · hits {} · spared {} · runs {} · compiles {} · stored {} B · loaded {} B · saved ≈ {:.1} ms",
        st.misses, st.hits, st.spared, st.executions, st.compiles, st.bytes_stored, st.bytes_loaded, st.saved_ms
    ));

    // Naming a chunk by its coordinate vs hashing a batch of bytes (a 19 MB batch: 32 rows of
    // 150k floats, as a large encoder input would be).
    let at = Coordinate {
        dataset: split.train.digest().unwrap_or_default(),
        start: 0,
        rows: args.batch,
    };
    let d = nitro::Digest::of("x");
    const NAMINGS: u32 = 10_000;
    let t = Instant::now();
    let mut acc = d;
    for i in 0..NAMINGS {
        let at = Coordinate {
            start: i as usize,
            ..at
        };
        acc = stage::output_key("probe", &acc, &d, &d, &at);
    }
    let naming_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(NAMINGS);
    std::hint::black_box(acc);
    let big = Array::zeros(DType::F32, &[32, 150_000]);
    let t = Instant::now();
    std::hint::black_box(nitro::Digest::of(&big));
    let hash_ms = t.elapsed().as_secs_f64() * 1e3;
    say(format!(
        "naming   a chunk by coordinate {naming_us:.2} µs; hashing a {:.1} MB batch {hash_ms:.2} ms",
        big.size_bytes() as f64 / 1e6
    ));

    let stats = nitro::cache::cache_stats();
    say(format!("cache    {stats}"));
    nitro::cache::assert_no_recompile_after_warmup()?;
    say("no recompile after warm-up: ok".into());

    let summary = Summary::new("probe", backend)
        .history(&history)
        .cache(&stats)
        .first_step(run.first_step_time())
        .field("fit_s", fit_s)
        .field("epoch1_s", first)
        .field("later_epoch_s", later_mean)
        .field(
            "stages",
            serde_json::json!({
                "hits": st.hits,
                "misses": st.misses,
                "spared": st.spared,
                "bytes": st.bytes_stored + st.bytes_loaded,
                "bytes_stored": st.bytes_stored,
                "bytes_loaded": st.bytes_loaded,
                "executions": st.executions,
                "compiles": st.compiles,
                "run_ms": st.run_ms,
                "saved_ms": st.saved_ms,
                "naming_us": naming_us,
                "hash_19mb_ms": hash_ms,
            }),
        )
        .field("process_s", started.elapsed().as_secs_f64());
    println!("{summary}");
    Ok(())
}
