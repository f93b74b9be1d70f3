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
use nitro::data::{idx, Dataset};
use nitro::nn::{self, Conv2d, Conv2dParams, Layer, Linear, LinearParams, Pool2d};
use nitro::optim::{Adam, Cosine};
use nitro::prelude::*;
use nitro::train::{Config, FromBatch, Model, Nitro};
use nitro_examples::column;
use nitro_examples::report::{compile_ms_by_program, exit_status, install_log, Summary};

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
    /// Print only the JSON line.
    #[arg(long)]
    json: bool,
}

/// The network's shape: a GraphConst, so another width is another program.
#[derive(ContentHash, Clone, Debug)]
pub struct CnnArch {
    /// The first convolution.
    pub conv1: Conv2d,
    /// The second convolution.
    pub conv2: Conv2d,
    /// The pooling after each.
    pub pool: Pool2d,
    /// The classifier.
    pub dense: Linear,
}

/// The experiment: the architecture shapes the graph, the parameters are trained on the device.
#[experiment]
pub struct FashionCnn {
    /// The architecture.
    #[graph_const]
    pub arch: CnnArch,
    /// The first convolution's kernel and bias.
    #[device(trainable)]
    pub conv1: Conv2dParams,
    /// The second convolution's kernel and bias.
    #[device(trainable)]
    pub conv2: Conv2dParams,
    /// The classifier's weights and bias.
    #[device(trainable)]
    pub dense: LinearParams,
}

/// One batch: images `f32 [n, 28, 28, 1]` in `[0, 1]`, labels `i32 [n]`.
#[derive(Tree)]
pub struct Images {
    /// The images.
    pub x: Array,
    /// The labels.
    pub y: Array,
}

impl FromBatch for Images {
    fn from_batch(b: nitro::data::Batch) -> nitro::Result<Images> {
        Ok(Images {
            x: column(&b, "x")?,
            y: column(&b, "y")?,
        })
    }
}

fn logits(v: &FashionCnnView<'_>, x: Tensor) -> Tensor {
    let a = &v.arch;
    let h = a.pool.forward(&(), a.conv1.forward(&v.conv1, x).relu());
    let h = a.pool.forward(&(), a.conv2.forward(&v.conv2, h).relu());
    let rows = h.dims()[0];
    a.dense
        .forward(&v.dense, h.reshape(&[rows, a.dense.inputs]))
}

impl Model for FashionCnn {
    type Batch = Images;

    fn loss(v: &FashionCnnView<'_>, b: &ImagesMirror<Tensor>) -> Tensor {
        nn::softmax_cross_entropy(logits(v, b.x), b.y)
    }

    fn correct(v: &FashionCnnView<'_>, b: &ImagesMirror<Tensor>) -> Option<Tensor> {
        Some(nn::correct(logits(v, b.x), b.y))
    }
}

impl FashionCnn {
    /// The network with fresh weights from `seed`.
    pub fn new(seed: u64) -> FashionCnn {
        let arch = CnnArch {
            conv1: Conv2d::new(1, 16, (3, 3)),
            conv2: Conv2d::new(16, 32, (3, 3)),
            pool: nn::max_pool2d((2, 2), (2, 2)),
            dense: Linear::new(7 * 7 * 32, 10),
        };
        let s = nitro::init::Seed;
        FashionCnn {
            conv1: arch.conv1.init(s(seed)),
            conv2: arch.conv2.init(s(seed.wrapping_add(1))),
            dense: arch.dense.init(s(seed.wrapping_add(2))),
            arch,
        }
    }
}

/// Images and labels as a data set: `f32 [n, 28, 28, 1]` scaled to `[0, 1]`, `i32` labels.
fn dataset(images: &Array, labels: &Array, rows: Option<usize>) -> nitro::Result<Dataset> {
    let n = rows.unwrap_or(images.dims()[0]).min(images.dims()[0]);
    let pixels = images.as_slice::<u8>()?;
    let x: Vec<f32> = pixels[..n * 784]
        .iter()
        .map(|&p| p as f32 / 255.0)
        .collect();
    let y: Vec<i32> = labels.as_slice::<u8>()?[..n]
        .iter()
        .map(|&l| l as i32)
        .collect();
    Dataset::new([
        ("x", Array::from_vec(&[n, 28, 28, 1], x)?),
        ("y", Array::from_vec(&[n], y)?),
    ])
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
    let say = |line: String| {
        if !args.json {
            println!("{line}");
        }
    };
    let raw = idx::fashion_mnist(args.data.as_deref())?;
    let train = dataset(&raw.train_images, &raw.train_labels, args.train_rows)?;
    let test = dataset(&raw.test_images, &raw.test_labels, None)?;
    let backend = nitro::backend::current()?;
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
    if !args.json {
        print!("{}", FashionCnn::key_manifest());
    }
    let steps = (train.rows().div_ceil(args.batch) * args.epochs) as u64;
    let config = Config::new()
        .batch(args.batch)
        .epochs(args.epochs)
        .seed(args.seed)
        .schedule(Cosine {
            base: args.lr,
            min: args.lr / 100.0,
            warmup: steps / 20,
            total: steps,
        })
        .progress(!args.json);
    let mut run = Nitro::new(FashionCnn::new(args.seed), Adam::default(), config)?;
    let fit_started = std::time::Instant::now();
    let history = run.fit(&train, Some(&test))?;
    let fit_s = fit_started.elapsed().as_secs_f64();
    say(history.to_string());
    let stats = cache::cache_stats();
    say(format!("cache    {stats}"));
    cache::assert_no_recompile_after_warmup()?;
    say("no recompile after warm-up: ok".into());

    let last = history.epochs.last().ok_or("no epoch ran")?;
    let test_accuracy = last.val_accuracy.unwrap_or(0.0);
    let summary = Summary::new("fashion", backend)
        .history(&history)
        .cache(&stats)
        .first_step(run.first_step_time())
        .field("test_accuracy", test_accuracy)
        .field("step_ms", last.step_us_median / 1e3)
        .field("step_ms_pipelined", last.step_us_pipelined / 1e3)
        .field("compile_ms_by_program", compile_ms_by_program())
        .field("fit_s", fit_s)
        .field("process_s", started.elapsed().as_secs_f64());
    println!("{summary}");
    Ok(())
}
