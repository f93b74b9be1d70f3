//! The two classic causes of recompiles, what nitro says about each, and their fixes.
//!
//! Each run trains the digits MLP with plain SGD, one step program per batch (the masked mean
//! loss, its gradient and the update, all traced), over a sweep of learning rates, each on a
//! compile cache of its own (in memory, so every run of the example compiles the same way):
//!
//! - **A — a learning rate declared `#[graph_const]`.** Its value is hashed into the compile
//!   key and baked into the program as a constant: every new value compiles the step again
//!   (`graph_const_changed: lr 0.05 → 0.1`), and after three such changes the lint names the field and
//!   advises `#[device]`.
//! - **B — a ragged last batch, not padded.** 1438 training rows in batches of 32 leave 30 rows
//!   at the end of each epoch: a batch of another shape, a program of its own
//!   (`signature_changed: x f32[32,64] → f32[30,64], …`).
//! - **The fix** — the learning rate as a `#[device]` scalar ([`DigitsMlp`]'s `lr`: a traced
//!   input, only its dtype and shape are in the key) and the last batch padded to 32 rows and
//!   masked: the step compiles once, and nothing compiles after step 1 however many learning
//!   rates are swept. The example checks this (and that A and B miss as described) and exits
//!   with an error otherwise.
//!
//! The training handle (`nitro::train::Nitro`) does the fix for you: its learning rate is a
//! traced scalar and its batches are padded and masked.
//!
//! `cargo run --release -p nitro-examples --example why_recompile [-- --epochs N --json]`
//! (from the workspace root).

use std::time::{Duration, Instant};

use clap::Parser;
use nitro::backend::Backend;
use nitro::cache::{Cache, CacheStats, Outcome};
use nitro::data::{Dataset, Order};
use nitro::prelude::*;
use nitro::program::Program;
use nitro_examples::report::{cache_json, exit_status, median, short_program, Summary};
use nitro_examples::run::TRAIN_FRACTION;
use nitro_examples::{
    data, glorot, Arch, Batch, BatchMirror, Dense, DenseMirror, DigitsMlp, DigitsMlpView,
};

/// Shows the two classic causes of recompiles — a swept value declared `#[graph_const]`, an
/// unpadded ragged batch — and checks that their fix compiles nothing after step 1.
#[derive(Parser, Debug)]
#[command(name = "why_recompile")]
struct Args {
    /// Epochs per learning rate.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Print only the JSON line.
    #[arg(long)]
    json: bool,
}

/// The learning rates each run sweeps.
const RATES: [f64; 4] = [0.05, 0.1, 0.2, 0.4];
/// Rows per step.
const BATCH: usize = 32;
/// The seed of the split, the shuffles and the initialization.
const SEED: u64 = 1;
/// The hidden width.
const HIDDEN: usize = 128;

/// **The mistake of part A**: the digits MLP with its learning rate declared `#[graph_const]`.
/// The value enters the compile key (content-hashed) and the program (as a constant), so every
/// value of a sweep compiles the step again.
#[experiment]
#[derive(Clone)]
pub struct LrAsGraphConst {
    /// The architecture (a true GraphConst: it shapes the graph).
    #[graph_const]
    pub arch: Arch,
    /// The learning rate — wrongly a GraphConst.
    #[graph_const]
    pub lr: f64,
    /// The layers' parameters.
    #[device(trainable)]
    pub layers: Vec<Dense>,
}

/// The masked mean loss of the MLP (`arch`, `layers`) on `batch`, its gradient, and one SGD
/// step `p ← p − lr·g` with `lr_times` giving `lr·g`. Outputs: the loss, then every layer's new
/// `w` and `b`.
fn sgd_step(
    arch: &Arch,
    layers: &[DenseMirror<Tensor>],
    batch: &BatchMirror<Tensor>,
    lr_times: impl Fn(Tensor) -> Tensor,
) -> Vec<Tensor> {
    let Some((out, hidden)) = layers.split_last() else {
        return Vec::new();
    };
    let h = hidden.iter().fold(batch.x, |h, layer| {
        arch.activation.apply(h.matmul(layer.w) + layer.b)
    });
    let per_example = nitro::nn::softmax_cross_entropy(h.matmul(out.w) + out.b, batch.y);
    let loss = (per_example * batch.mask).sum_all() / batch.mask.sum_all();
    let params: Vec<Tensor> = layers.iter().flat_map(|l| [l.w, l.b]).collect();
    let grads = nitro::trace::grad(loss, &params);
    let updated = params.iter().zip(grads).map(|(&p, g)| p - lr_times(g));
    std::iter::once(loss).chain(updated).collect()
}

/// Part A's step: the learning rate is a number here, baked into the program.
fn step_baked(v: &LrAsGraphConstView<'_>, batch: &BatchMirror<Tensor>) -> Vec<Tensor> {
    let lr = *v.lr;
    sgd_step(v.arch, &v.layers, batch, |g| g * lr)
}

/// The fixed step: the learning rate is a traced scalar, an input of the program.
fn step_traced(v: &DigitsMlpView<'_>, batch: &BatchMirror<Tensor>) -> Vec<Tensor> {
    let lr = v.lr;
    sgd_step(v.arch, &v.layers, batch, |g| g * lr)
}

const STEP_BAKED: Program<LrAsGraphConst, BatchMirror<Tensor>, Vec<Tensor>> =
    LrAsGraphConst::program("sgd_step", step_baked);
const STEP_TRACED: Program<DigitsMlp, BatchMirror<Tensor>, Vec<Tensor>> =
    DigitsMlp::program("sgd_step", step_traced);

/// An experiment with the digits MLP's layers and a learning rate that can be set.
trait Trainable: nitro::Experiment {
    fn layers_mut(&mut self) -> &mut Vec<Dense>;
    fn set_lr(&mut self, lr: f64);
}

impl Trainable for LrAsGraphConst {
    fn layers_mut(&mut self) -> &mut Vec<Dense> {
        &mut self.layers
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }
}

impl Trainable for DigitsMlp {
    fn layers_mut(&mut self) -> &mut Vec<Dense> {
        &mut self.layers
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr = Array::scalar(lr as f32);
    }
}

/// A lookup that missed.
struct Miss {
    /// The step it happened at (from 1; a lookup before the first step counts as step 1).
    step: u64,
    /// The program, without module paths (`DigitsMlp::sgd_step`).
    program: String,
    /// What the lookup did, and why.
    outcome: Outcome,
    /// Compile time, in milliseconds.
    ms: f64,
}

/// One run: a sweep of [`RATES`], each from the same initial parameters, through its own cache.
struct Sweep<'a> {
    backend: &'static dyn Backend,
    cache: Cache,
    train: &'a Dataset,
    epochs: usize,
    /// Whether the ragged last batch is padded to [`BATCH`] rows (and masked).
    pad: bool,
    quiet: bool,
    /// Every miss, in order.
    misses: Vec<Miss>,
    steps: u64,
    step_times: Vec<Duration>,
    started: Instant,
    first_step: Option<Duration>,
}

impl<'a> Sweep<'a> {
    fn new(backend: &'static dyn Backend, train: &'a Dataset, epochs: usize, pad: bool) -> Self {
        Sweep {
            backend,
            cache: Cache::in_memory(64),
            train,
            epochs,
            pad,
            quiet: false,
            misses: Vec::new(),
            steps: 0,
            step_times: Vec::new(),
            started: Instant::now(),
            first_step: None,
        }
    }

    /// Trains `exp` at learning rate `lr` for the configured epochs; returns the last epoch's
    /// mean loss.
    fn train<E: Trainable>(
        &mut self,
        program: &Program<E, BatchMirror<Tensor>, Vec<Tensor>>,
        exp: &mut E,
        lr: f64,
    ) -> Result<f64, Box<dyn std::error::Error>> {
        exp.set_lr(lr);
        let plan = self.train.plan(BATCH, Order::Shuffled { seed: SEED })?;
        let mut mean = 0.0;
        for epoch in 0..self.epochs as u64 {
            let (mut sum, mut rows) = (0.0, 0usize);
            for span in plan.epoch(epoch).spans() {
                let size = if self.pad { BATCH } else { span.len() };
                let batch = Batch::gather(self.train, span, size);
                let started = Instant::now();
                let served = self.cache.get(self.backend, program, exp, &batch)?;
                self.note(&served, &format!("step {:>3}, lr {lr:<4}", self.steps + 1));
                let mut out = served
                    .executable
                    .run(&program.arguments(exp, &batch))?
                    .into_iter();
                let loss = out.next().ok_or("the step returned nothing")?;
                for layer in exp.layers_mut() {
                    layer.w = out.next().ok_or("the step returned too few arrays")?;
                    layer.b = out.next().ok_or("the step returned too few arrays")?;
                }
                self.step_times.push(started.elapsed());
                self.steps += 1;
                if self.first_step.is_none() {
                    self.first_step = Some(self.started.elapsed());
                    // Warm-up ends with step 1: the acceptance check fails on any later miss.
                    self.cache.mark_warm();
                }
                sum += f64::from(loss.as_slice::<f32>()?[0]) * span.len() as f64;
                rows += span.len();
            }
            mean = sum / rows.max(1) as f64;
        }
        Ok(mean)
    }

    /// Records (and prints) the lookup `served` when it missed; `when` says at which step.
    fn note(&mut self, served: &nitro::cache::Served, when: &str) {
        if served.outcome.is_hit() {
            return;
        }
        let ms = served.build_time.as_secs_f64() * 1e3;
        let program = short_program(&served.program);
        if !self.quiet {
            println!("    {when}: {program} {} in {ms:.0} ms", served.outcome);
        }
        self.misses.push(Miss {
            step: self.steps + 1,
            program,
            outcome: served.outcome.clone(),
            ms,
        });
    }

    /// The misses by reason, as the cache counts them.
    fn stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// The misses after step 1.
    fn misses_after_step_1(&self) -> usize {
        self.misses.iter().filter(|m| m.step > 1).count()
    }
}

/// The fraction of `data`'s rows that the MLP classifies correctly (padded batches through
/// the [`nitro_examples::EVAL`] program, fetched from `cache`).
fn accuracy(
    sweep: &mut Sweep<'_>,
    exp: &DigitsMlp,
    data: &Dataset,
) -> Result<f64, Box<dyn std::error::Error>> {
    let plan = data.plan(BATCH, Order::Sequential)?;
    let mut correct = 0.0;
    for span in plan.epoch(0).spans() {
        let batch = Batch::gather(data, span, BATCH);
        let eval = sweep
            .cache
            .get(sweep.backend, &nitro_examples::EVAL, exp, &batch)?;
        sweep.note(&eval, "before step 1");
        let out = eval
            .executable
            .run(&nitro_examples::EVAL.arguments(exp, &batch))?;
        correct += f64::from(out[0].as_slice::<f32>()?[0]);
    }
    Ok(correct / data.rows().max(1) as f64)
}

/// The acceptance check of a run, in words: `ok`, or the error it gave.
fn acceptance(cache: &Cache) -> String {
    match cache.assert_no_recompile_after_warmup() {
        Ok(()) => "ok (nothing compiled after step 1)".into(),
        Err(e) => format!("fails: {e}"),
    }
}

/// A demand of the example: an error naming `what` unless `ok`.
fn check(ok: bool, what: &str) -> Result<(), Box<dyn std::error::Error>> {
    if ok {
        Ok(())
    } else {
        Err(format!("expected {what}").into())
    }
}

fn main() -> std::process::ExitCode {
    exit_status("why_recompile", try_main())
}

fn try_main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.epochs == 0 {
        return Err("--epochs must be at least 1".into());
    }
    let say = |line: &str| {
        if !args.json {
            println!("{line}");
        }
    };
    let data = data::Digits::load(data::DIGITS_PATH)?;
    let split = data.split(TRAIN_FRACTION, SEED)?;
    let backend = nitro::backend::current()?;
    let arch = Arch {
        widths: vec![64, HIDDEN, 10],
        activation: nitro_examples::Activation::Tanh,
    };
    let init = glorot(&arch.widths, SEED);
    say(&format!("backend  {}", backend.identity().description));
    say(&format!(
        "train    {} rows in batches of {BATCH}: the last batch of an epoch has {} rows",
        split.train.rows(),
        split.train.rows() % BATCH
    ));
    say(&format!(
        "sweep    learning rates {RATES:?}, plain SGD, {} epoch(s) each",
        args.epochs
    ));

    // A: the learning rate as a GraphConst, batches padded.
    say("\nA. learning rate declared #[graph_const] (batches padded):");
    let mut a = Sweep::new(backend, &split.train, args.epochs, true);
    a.quiet = args.json;
    for lr in RATES {
        let mut exp = LrAsGraphConst {
            arch: arch.clone(),
            lr,
            layers: init.clone(),
        };
        a.train(&STEP_BAKED, &mut exp, lr)?;
    }
    let lints = a.cache.lints();
    for lint in &lints {
        say(&format!("  lint: {lint}"));
    }
    let stats_a = a.stats();
    say(&format!("  cache: {stats_a}"));
    say(&format!("  acceptance check: {}", acceptance(&a.cache)));
    let lr_changes = stats_a
        .misses_by_reason
        .get("graph_const_changed")
        .copied()
        .unwrap_or(0);
    check(
        stats_a.compiles == RATES.len() as u64 && lr_changes == RATES.len() as u64 - 1,
        "part A to compile once per learning rate, each change naming `lr`",
    )?;
    check(
        lints.iter().any(|l| l.to_string().contains("`lr`")),
        "the lint to name the field `lr`",
    )?;

    // B: the learning rate traced, the ragged last batch not padded.
    say("\nB. learning rate #[device], ragged last batch NOT padded:");
    let mut b = Sweep::new(backend, &split.train, args.epochs, false);
    b.quiet = args.json;
    for lr in RATES {
        let mut exp = DigitsMlp::tanh(HIDDEN, data.clone());
        exp.layers = init.clone();
        b.train(&STEP_TRACED, &mut exp, lr)?;
    }
    let stats_b = b.stats();
    say(&format!("  cache: {stats_b}"));
    say(&format!("  acceptance check: {}", acceptance(&b.cache)));
    let ragged = split.train.rows() % BATCH != 0;
    check(
        !ragged || stats_b.misses_by_reason.contains_key("signature_changed"),
        "part B's ragged batch to miss with `signature_changed`",
    )?;

    // The fix: the learning rate traced, the ragged batch padded and masked.
    say("\nFixed. learning rate #[device], ragged last batch padded and masked:");
    let mut fixed = Sweep::new(backend, &split.train, args.epochs, true);
    fixed.quiet = args.json;
    let mut runs = Vec::new();
    // The evaluation program is fetched before step 1, with the step program's first lookup
    // close behind: warm-up is over after step 1.
    accuracy(
        &mut fixed,
        &DigitsMlp::tanh(HIDDEN, data.clone()),
        &split.validation,
    )?;
    for lr in RATES {
        let mut exp = DigitsMlp::tanh(HIDDEN, data.clone());
        exp.layers = init.clone();
        let loss = fixed.train(&STEP_TRACED, &mut exp, lr)?;
        let acc = accuracy(&mut fixed, &exp, &split.validation)?;
        say(&format!(
            "  lr {lr:<4}: train loss {loss:.4}, validation accuracy {:.2}%",
            100.0 * acc
        ));
        runs.push(serde_json::json!({"lr": lr, "train_loss": loss, "val_accuracy": acc}));
    }
    let stats_fixed = fixed.stats();
    say(&format!("  cache: {stats_fixed}"));
    let verdict = acceptance(&fixed.cache);
    say(&format!("  acceptance check: {verdict}"));
    // Strict: the step and evaluation programs were compiled before or at step 1, and
    // nothing after (`Cache::mark_warm` at step 1, then the cache's own check).
    fixed.cache.assert_no_recompile_after_warmup()?;
    check(
        fixed.misses_after_step_1() == 0 && stats_fixed.compiles == 2,
        "the fixed run to compile its step and evaluation programs once each, nothing more",
    )?;
    say("  no recompile after step 1: ok");

    let best = runs
        .iter()
        .filter_map(|r| r["val_accuracy"].as_f64())
        .fold(f64::NAN, f64::max);
    let step_us: Vec<f64> = fixed
        .step_times
        .iter()
        .map(|d| d.as_secs_f64() * 1e6)
        .collect();
    let mistake = |s: &Sweep<'_>, stats: &CacheStats| {
        serde_json::json!({
            "cache": cache_json(stats),
            "misses_after_step_1": s.misses_after_step_1(),
            "misses": s.misses.iter().map(|m| serde_json::json!({
                "step": m.step,
                "program": m.program,
                "loaded": matches!(m.outcome, Outcome::Loaded { .. }),
                "reason": m.outcome.reason().map(ToString::to_string),
                "ms": m.ms,
            })).collect::<Vec<_>>(),
        })
    };
    let mut lr_json = mistake(&a, &stats_a);
    lr_json["lints"] = serde_json::json!(lints.iter().map(ToString::to_string).collect::<Vec<_>>());
    let summary = Summary::new("why_recompile", backend)
        .field("epochs", args.epochs * RATES.len())
        .field("val_accuracy", best)
        .cache(&stats_fixed)
        // Each step reads its loss back before the next starts: waited, one at a time.
        .field("step_us_median", median(&step_us))
        .field(
            "step_us_pipelined",
            step_us.iter().sum::<f64>() / step_us.len().max(1) as f64,
        )
        .first_step(fixed.first_step)
        .field("lr_as_graph_const", lr_json)
        .field("unpadded_ragged_batch", mistake(&b, &stats_b))
        .field(
            "fixed",
            serde_json::json!({
                "runs": runs,
                "misses_after_step_1": fixed.misses_after_step_1(),
            }),
        );
    println!("{summary}");
    Ok(())
}
