//! The training handle: its program inventory, no recompile after the first step, padding that
//! does not change the gradient, learning-rate changes that never recompile, a second handle
//! that compiles nothing, a GraphConst change that recompiles exactly what depends on it, the
//! interpreter and XLA agreeing, and training that learns.
#![allow(missing_docs)]

mod common;

use common::xla_or_skip;
use nitro::backend::{self, Backend};
use nitro::cache::{Cache, MissReason, Outcome};
use nitro::optim::{Adam, Optimizer, Sgd};
use nitro::prelude::*;
use nitro::trace::nn;
use nitro::train::{Config, DeviceMetric, EvalResult, HostMetric, Nitro};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

fn own_cache() -> &'static Cache {
    Box::leak(Box::new(Cache::in_memory(32)))
}

fn handle<O: Optimizer>(
    backend: &'static dyn Backend,
    cache: &'static Cache,
    e: Mlp,
    o: O,
    rows: usize,
    lr: f64,
) -> Nitro<Mlp, O> {
    Nitro::with_backend(e, o, Config::new().batch(rows).lr(lr), backend, cache).unwrap()
}

#[track_caller]
fn assert_close(a: &[Vec<f32>], b: &[Vec<f32>], tol: f32, what: &str) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        for (j, (p, q)) in x.iter().zip(y).enumerate() {
            assert!(
                (p - q).abs() <= tol * (1.0 + q.abs()),
                "{what}: leaf {i}[{j}]: {p} vs {q}"
            );
        }
    }
}

fn inventory_on(backend: &'static dyn Backend) {
    let cache = own_cache();
    let (x, y) = data(96, 3);
    let mut run = handle(backend, cache, mlp(Act::Tanh), Adam::default(), 32, 0.01);
    let outcomes = run.prepare(&batch(&x, &y, 0, 32, 32)).unwrap();
    assert_eq!(
        outcomes.len(),
        2,
        "a train-only run: gradient and update programs"
    );
    assert!(outcomes.iter().all(|o| !o.is_hit()));
    // Three epochs of three steps, the last batch of each ragged; a learning-rate change.
    for epoch in 0..3 {
        for (start, real) in [(0, 32), (32, 32), (64, 20)] {
            run.step(&batch(&x, &y, start, real, 32), real).unwrap();
        }
        run.set_lr(0.01 / (epoch + 2) as f64);
    }
    let stats = cache.stats();
    assert_eq!(
        (stats.misses, stats.entries),
        (2, 2),
        "train-only: two programs, compiled once: {stats}"
    );
    // Validation adds one program, once.
    for _ in 0..3 {
        run.evaluate(&batch(&x, &y, 64, 20, 32), 20).unwrap();
    }
    let stats = cache.stats();
    assert_eq!((stats.misses, stats.entries), (3, 3), "{stats}");
    cache.assert_no_recompile_after_warmup().unwrap();
    assert_eq!(run.steps(), 9);
}

#[test]
fn the_inventory_is_two_programs_then_three_on_the_interpreter() {
    inventory_on(backend::interpreter());
}

#[test]
fn the_inventory_is_two_programs_then_three_on_xla() {
    if let Some(xla) = xla_or_skip("the_inventory_is_two_programs_then_three_on_xla") {
        inventory_on(xla);
    }
}

#[test]
fn a_padded_step_equals_the_unpadded_step_on_the_real_rows() {
    let (x, y) = data(8, 5);
    // Five real rows padded to eight, against a handle whose batch is exactly those five.
    let mut padded = handle(
        backend::interpreter(),
        own_cache(),
        mlp(Act::Tanh),
        Sgd,
        8,
        0.5,
    );
    let mut exact = handle(
        backend::interpreter(),
        own_cache(),
        mlp(Act::Tanh),
        Sgd,
        5,
        0.5,
    );
    let lp = padded.step(&batch(&x, &y, 0, 5, 8), 5).unwrap().loss;
    let le = exact.step(&batch(&x, &y, 0, 5, 5), 5).unwrap().loss;
    assert!((lp - le).abs() < 1e-6, "{lp} vs {le}");
    let (p, e) = (
        padded.into_experiment().unwrap(),
        exact.into_experiment().unwrap(),
    );
    assert_close(&leaves(&p), &leaves(&e), 1e-6, "padded vs exact");
    assert_ne!(
        leaves(&p),
        leaves(&mlp(Act::Tanh)),
        "the step moved the parameters"
    );
    assert_eq!(
        p.scale,
        mlp(Act::Tanh).scale,
        "a frozen leaf is not trained"
    );
}

#[test]
fn a_second_handle_compiles_nothing_and_a_graph_const_change_recompiles_only_the_gradient() {
    let cache = own_cache();
    let b = backend::interpreter();
    let (x, y) = data(32, 7);
    let first = batch(&x, &y, 0, 32, 32);
    let mut one = handle(b, cache, mlp(Act::Tanh), Adam::default(), 32, 0.01);
    one.step(&first, 32).unwrap();
    let mut two = handle(b, cache, mlp(Act::Tanh), Adam::default(), 32, 0.05);
    let outcomes = two.prepare(&first).unwrap();
    assert!(outcomes.iter().all(Outcome::is_hit), "{outcomes:?}");
    // Another activation: the gradient program moves, the update program (keyed on the
    // optimizer and the leaf types) does not.
    let mut three = handle(b, cache, mlp(Act::Relu), Adam::default(), 32, 0.01);
    let outcomes = three.prepare(&first).unwrap();
    assert_eq!(
        outcomes[0].to_string(),
        "compiled (graph_const_changed: act Tanh → Relu)"
    );
    assert!(outcomes[1].is_hit(), "{}", outcomes[1]);
    // Another optimizer constant: only the update program moves.
    let mut four = handle(
        b,
        cache,
        mlp(Act::Tanh),
        Adam {
            beta1: 0.8,
            ..Adam::default()
        },
        32,
        0.01,
    );
    let outcomes = four.prepare(&first).unwrap();
    assert!(outcomes[0].is_hit());
    assert!(
        matches!(
            &outcomes[1],
            Outcome::Compiled {
                reason: MissReason::GraphConstChanged { fields, .. }
            } if fields == &["optimizer".to_owned()]
        ),
        "{}",
        outcomes[1]
    );
}

#[test]
fn the_interpreter_and_xla_agree_on_the_first_steps() {
    let Some(xla) = xla_or_skip("the_interpreter_and_xla_agree_on_the_first_steps") else {
        return;
    };
    let (x, y) = data(64, 11);
    let mut on_interp = handle(
        backend::interpreter(),
        own_cache(),
        mlp(Act::Tanh),
        Adam::default(),
        32,
        0.01,
    );
    let mut on_xla = handle(xla, own_cache(), mlp(Act::Tanh), Adam::default(), 32, 0.01);
    for (start, real) in [(0, 32), (32, 20)] {
        let bt = batch(&x, &y, start, real, 32);
        let a = on_interp.step(&bt, real).unwrap().loss;
        let b = on_xla.step(&bt, real).unwrap().loss;
        assert!((a - b).abs() < 1e-5 * (1.0 + a.abs()), "loss {a} vs {b}");
    }
    let (i, x_) = (
        on_interp.into_experiment().unwrap(),
        on_xla.into_experiment().unwrap(),
    );
    // Documented tolerance: f32, two Adam steps.
    assert_close(&leaves(&i), &leaves(&x_), 1e-5, "interpreter vs XLA");
}

fn learns_on(backend: &'static dyn Backend) {
    let (x, y) = data(256, 13);
    let (vx, vy) = data(96, 17);
    let mut run = handle(
        backend,
        own_cache(),
        mlp(Act::Tanh),
        Adam::default(),
        32,
        0.05,
    );
    let before = run.evaluate(&batch(&vx, &vy, 0, 96, 96).clone(), 96);
    // The evaluation batch is larger than the training batch: refused, typed.
    assert!(before.is_err());
    let eval = |run: &mut Nitro<Mlp, Adam>| {
        let mut correct = 0.0;
        for start in (0..96).step_by(32) {
            correct += run
                .evaluate(&batch(&vx, &vy, start, 32, 32), 32)
                .unwrap()
                .correct;
        }
        correct / 96.0
    };
    let first = eval(&mut run);
    for _ in 0..15 {
        for start in (0..256).step_by(32) {
            run.step(&batch(&x, &y, start, 32, 32), 32).unwrap();
        }
    }
    let last = eval(&mut run);
    assert!(last > 0.85, "validation accuracy {first} → {last}");
    assert!(last > first + 0.2, "it learned: {first} → {last}");
}

#[test]
fn training_learns_on_the_interpreter() {
    learns_on(backend::interpreter());
}

#[test]
fn training_learns_on_xla() {
    if let Some(xla) = xla_or_skip("training_learns_on_xla") {
        learns_on(xla);
    }
}

#[test]
fn bad_steps_are_typed_errors() {
    let mut run = handle(
        backend::interpreter(),
        own_cache(),
        mlp(Act::Tanh),
        Sgd,
        4,
        0.1,
    );
    let (x, y) = data(8, 1);
    assert!(
        run.step(&batch(&x, &y, 0, 4, 4), 0).is_err(),
        "no real rows"
    );
    assert!(
        run.step(&batch(&x, &y, 0, 4, 4), 5).is_err(),
        "more real rows than rows"
    );
    assert!(
        run.step(&batch(&x, &y, 0, 4, 8), 4).is_err(),
        "another batch size"
    );
    assert!(Nitro::with_backend(
        mlp(Act::Tanh),
        Sgd,
        Config::new().batch(0),
        backend::interpreter(),
        own_cache()
    )
    .is_err());
    assert!(run.step(&batch(&x, &y, 0, 4, 4), 4).is_ok());
}

fn fits_on(backend: &'static dyn Backend) {
    let cache = own_cache();
    // 250 and 90 rows: both end with a ragged batch.
    let (train, val) = (dataset(250, 21), dataset(90, 22));
    let mut run = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        Config::new().batch(32).lr(0.05).epochs(12).seed(3),
        backend,
        cache,
    )
    .unwrap();
    let history = run.fit(&train, Some(&val)).unwrap();
    assert_eq!(history.epochs.len(), 12);
    assert!(
        history.epochs.iter().all(|r| r.steps == 8),
        "ceil(250 / 32) steps per epoch"
    );
    let (first, last) = (&history.epochs[0], &history.epochs[11]);
    assert!(last.train_loss < first.train_loss * 0.5, "{history}");
    let acc = last.val_accuracy.expect("the model has `correct`");
    assert!(acc > 0.85, "{history}");
    let table = history.to_string();
    assert!(
        table.contains("val acc") && table.lines().count() == 13,
        "{table}"
    );
    let stats = cache.stats();
    assert_eq!(
        (stats.misses, stats.entries),
        (3, 3),
        "gradient, update and evaluation, once each, ragged batches included: {stats}"
    );
}

#[test]
fn fit_trains_and_validates_a_dataset_with_ragged_batches_on_the_interpreter() {
    fits_on(backend::interpreter());
}

#[test]
fn fit_trains_and_validates_a_dataset_with_ragged_batches_on_xla() {
    if let Some(xla) = xla_or_skip("fit_trains_and_validates_a_dataset_with_ragged_batches_on_xla")
    {
        fits_on(xla);
    }
}

fn resume_on(backend: &'static dyn Backend) {
    let data = dataset(100, 31);
    let config = || Config::new().batch(16).lr(0.02).seed(9);
    let tmp = std::env::temp_dir().join(format!(
        "nitro-resume-{}-{}",
        std::process::id(),
        backend.identity().digest.short()
    ));
    std::fs::create_dir_all(&tmp).unwrap();
    let path = tmp.join("run.safetensors");

    let mut straight = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        config(),
        backend,
        own_cache(),
    )
    .unwrap();
    for epoch in 0..2 {
        straight.train_epoch(&data, epoch).unwrap();
    }
    straight.checkpoint().unwrap().save(&path).unwrap();
    for epoch in 2..4 {
        straight.train_epoch(&data, epoch).unwrap();
    }
    let straight = straight.into_experiment().unwrap();

    let checkpoint = nitro::checkpoint::Checkpoint::load(&path).unwrap();
    assert_eq!(checkpoint.step(), 14, "two epochs of ceil(100 / 16) steps");
    let mut resumed = Nitro::resume_with(
        mlp(Act::Tanh),
        Adam::default(),
        config(),
        checkpoint,
        backend,
        own_cache(),
    )
    .unwrap();
    assert_eq!(resumed.steps(), 14);
    for epoch in 2..4 {
        resumed.train_epoch(&data, epoch).unwrap();
    }
    let resumed = resumed.into_experiment().unwrap();
    assert_eq!(leaves(&resumed), leaves(&straight), "bit for bit");

    // Another activation is another experiment: refused, naming the field.
    let checkpoint = nitro::checkpoint::Checkpoint::load(&path).unwrap();
    let err = Nitro::resume_with(
        mlp(Act::Relu),
        Adam::default(),
        config(),
        checkpoint,
        backend,
        own_cache(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("act"), "{err}");
    // Another optimizer's state does not fit.
    let checkpoint = nitro::checkpoint::Checkpoint::load(&path).unwrap();
    let err = Nitro::resume_with(
        mlp(Act::Tanh),
        Sgd,
        config(),
        checkpoint,
        backend,
        own_cache(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("optimizer"), "{err}");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn resume_continues_bit_for_bit_on_the_interpreter() {
    resume_on(backend::interpreter());
}

#[test]
fn resume_continues_bit_for_bit_on_xla() {
    if let Some(xla) = xla_or_skip("resume_continues_bit_for_bit_on_xla") {
        resume_on(xla);
    }
}

#[test]
fn a_thousand_step_cosine_schedule_compiles_nothing_after_step_one() {
    let cache = own_cache();
    let (x, y) = data(64, 41);
    let schedule = nitro::optim::Cosine {
        base: 0.05,
        min: 0.0,
        warmup: 100,
        total: 1000,
    };
    let mut run = Nitro::with_backend(
        mlp(Act::Tanh),
        Sgd,
        Config::new().batch(16).schedule(schedule),
        backend::interpreter(),
        cache,
    )
    .unwrap();
    let mut rates = Vec::new();
    for step in 0..1000 {
        rates.push(run.lr());
        let start = (step % 4) * 16;
        run.step_deferred(&batch(&x, &y, start, 16, 16), 16)
            .unwrap();
        if step == 0 {
            cache.mark_warm();
        }
    }
    cache.assert_no_recompile_after_warmup().unwrap();
    assert_eq!(cache.stats().misses, 2);
    assert!(
        (rates[0] - 0.0005).abs() < 1e-12,
        "warm-up starts low: {}",
        rates[0]
    );
    assert!((rates[100] - 0.05).abs() < 1e-12, "the peak");
    assert!(rates[999] < 1e-6, "decayed: {}", rates[999]);
    assert_eq!(run.take_losses().unwrap().len(), 1000);
}

#[test]
fn a_graph_const_changed_through_the_handle_recompiles_only_what_reads_it() {
    let cache = own_cache();
    let (x, y) = data(64, 51);
    let b = batch(&x, &y, 0, 32, 32);
    let mut run = handle(
        backend::interpreter(),
        cache,
        mlp(Act::Tanh),
        Adam::default(),
        32,
        0.01,
    );
    run.step(&b, 32).unwrap();
    let trained = leaves(run.experiment().unwrap());
    run.modify(|e| e.act = Act::Relu).unwrap();
    assert_eq!(
        leaves(run.experiment().unwrap()),
        trained,
        "the parameters carry over"
    );
    let outcomes = run.prepare(&b).unwrap();
    assert_eq!(
        outcomes[0].to_string(),
        "compiled (graph_const_changed: act Tanh → Relu)"
    );
    assert!(
        outcomes[1].is_hit(),
        "the update program does not read `act`"
    );
    run.step(&b, 32).unwrap();
    // A Device value written through the handle: nothing recompiles.
    run.modify(|e| e.scale = Array::full(&[4], 0.5f32)).unwrap();
    let outcomes = run.prepare(&b).unwrap();
    assert!(outcomes.iter().all(Outcome::is_hit), "{outcomes:?}");
    run.step(&b, 32).unwrap();
    assert_eq!(run.experiment().unwrap().scale, Array::full(&[4], 0.5f32));
    assert_eq!(cache.stats().compiles, 3);
}

/// Four micro-batches of 8 rows (the last holding 3 real rows) accumulate into one optimizer
/// step equal to one step on all 27 rows at once.
fn accumulation_matches_one_big_step_on(backend: &'static dyn Backend, tol: f32) {
    let (x, y) = data(27, 31);
    let mut accumulated = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        Config::new().batch(8).lr(0.05).accumulate(4),
        backend,
        own_cache(),
    )
    .unwrap();
    let mut whole = handle(
        backend,
        own_cache(),
        mlp(Act::Tanh),
        Adam::default(),
        32,
        0.05,
    );
    for (i, (start, real)) in [(0, 8), (8, 8), (16, 8), (24, 3)].into_iter().enumerate() {
        assert_eq!(
            accumulated.steps(),
            0,
            "no update before the window closes ({i})"
        );
        accumulated
            .step_deferred(&batch(&x, &y, start, real, 8), real)
            .unwrap();
    }
    assert_eq!(accumulated.steps(), 1, "one update per window of four");
    let losses = accumulated.take_losses().unwrap();
    assert_eq!(losses.len(), 4, "one loss per micro-batch");
    let whole_loss = whole.step(&batch(&x, &y, 0, 27, 32), 27).unwrap().loss;
    // The window's mean loss, from the micro-batch means weighted by their real rows.
    let window_loss =
        (losses[0] * 8.0 + losses[1] * 8.0 + losses[2] * 8.0 + losses[3] * 3.0) / 27.0;
    assert!(
        (window_loss - whole_loss).abs() < 1e-5 * (1.0 + whole_loss.abs()),
        "{window_loss} vs {whole_loss}"
    );
    let (a, w) = (
        accumulated.into_experiment().unwrap(),
        whole.into_experiment().unwrap(),
    );
    assert_ne!(
        leaves(&a),
        leaves(&mlp(Act::Tanh)),
        "the window moved the parameters"
    );
    assert_close(&leaves(&a), &leaves(&w), tol, "accumulated vs one step");
}

#[test]
fn accumulation_matches_one_big_step_on_the_interpreter() {
    accumulation_matches_one_big_step_on(backend::interpreter(), 1e-5);
}

#[test]
fn accumulation_matches_one_big_step_on_xla() {
    if let Some(xla) = xla_or_skip("accumulation_matches_one_big_step_on_xla") {
        accumulation_matches_one_big_step_on(xla, 1e-5);
    }
}

/// With four micro-batches per step, the inventory is still two programs for training and
/// three with validation, ragged batches and a partial last window included.
fn inventory_with_accumulation_on(backend: &'static dyn Backend) {
    let cache = own_cache();
    let (train, val) = (dataset(90, 41), dataset(40, 42));
    let mut run = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        Config::new().batch(8).lr(0.05).epochs(2).accumulate(4),
        backend,
        cache,
    )
    .unwrap();
    run.train_epoch(&train, 0).unwrap();
    // 90 rows: 12 micro-batches of 8 (the last ragged), three windows.
    assert_eq!(run.steps(), 3);
    let stats = cache.stats();
    assert_eq!((stats.misses, stats.entries), (2, 2), "{stats}");
    let history = run.fit(&train, Some(&val)).unwrap();
    assert!(history.epochs.iter().all(|r| r.steps == 3), "{history}");
    let stats = cache.stats();
    assert_eq!((stats.misses, stats.entries), (3, 3), "{stats}");
    cache.assert_no_recompile_after_warmup().unwrap();
    // 11 rows: two micro-batches, the last window of the epoch partial (closed by the epoch).
    let small = dataset(11, 43);
    let before = run.steps();
    run.train_epoch(&small, 0).unwrap();
    assert_eq!(run.steps(), before + 1);
    assert_eq!(cache.stats().entries, 3);
}

#[test]
fn accumulation_adds_no_program_on_the_interpreter() {
    inventory_with_accumulation_on(backend::interpreter());
}

#[test]
fn accumulation_adds_no_program_on_xla() {
    if let Some(xla) = xla_or_skip("accumulation_adds_no_program_on_xla") {
        inventory_with_accumulation_on(xla);
    }
}

/// Accuracy accumulated on the device by a program of its own.
struct DeviceAccuracy;

impl DeviceMetric<Mlp> for DeviceAccuracy {
    const NAME: &'static str = "device_accuracy";

    fn per_example(v: &MlpView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        nn::correct(logits(v, b.x), b.y)
    }
}

/// Accuracy computed on the host from the predictions of the evaluation program.
#[derive(Default)]
struct HostAccuracy {
    correct: usize,
    rows: usize,
}

impl HostMetric<Mlp> for HostAccuracy {
    fn name(&self) -> &str {
        "host_accuracy"
    }

    fn update(&mut self, batch: &Batch, eval: &EvalResult) {
        let logits = eval
            .predictions
            .as_ref()
            .expect("predictions for a host metric");
        let logits = logits.as_slice::<f32>().unwrap();
        let labels = batch.y.as_slice::<i32>().unwrap();
        for (row, &label) in labels.iter().enumerate().take(eval.rows) {
            let scores = &logits[row * 3..row * 3 + 3];
            let best = (0..3)
                .max_by(|&a, &b| scores[a].total_cmp(&scores[b]))
                .unwrap();
            self.correct += usize::from(best as i32 == label);
        }
        self.rows += eval.rows;
    }

    fn finish(&mut self) -> f64 {
        let v = self.correct as f64 / self.rows.max(1) as f64;
        *self = HostAccuracy::default();
        v
    }
}

/// The inventory with metrics: a host metric adds no program, a device metric adds one — with
/// a ragged validation split, with and without accumulation; both metrics agree with the
/// built-in accuracy.
fn metrics_inventory_on(backend: &'static dyn Backend, accum: usize) {
    let (train, val) = (dataset(90, 51), dataset(45, 52));
    let config = Config::new().batch(8).lr(0.05).epochs(2).accumulate(accum);
    let cache = own_cache();
    let mut run = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        config.clone(),
        backend,
        cache,
    )
    .unwrap();
    run.add_host_metric(HostAccuracy::default());
    let history = run.fit(&train, Some(&val)).unwrap();
    let stats = cache.stats();
    assert_eq!(
        (stats.misses, stats.entries),
        (3, 3),
        "a host metric adds nothing: {stats}"
    );
    for r in &history.epochs {
        let acc = r.val_accuracy.unwrap();
        assert_eq!(r.metrics.len(), 1);
        assert!((r.metrics[0].1 - acc).abs() < 1e-9, "{history}");
    }
    assert!(history.to_string().contains("host_accuracy"), "{history}");

    let cache = own_cache();
    let mut run =
        Nitro::with_backend(mlp(Act::Tanh), Adam::default(), config, backend, cache).unwrap();
    run.add_device_metric::<DeviceAccuracy>();
    run.add_host_metric(HostAccuracy::default());
    let history = run.fit(&train, Some(&val)).unwrap();
    let stats = cache.stats();
    assert_eq!(
        (stats.misses, stats.entries),
        (4, 4),
        "a device metric adds one: {stats}"
    );
    cache.assert_no_recompile_after_warmup().unwrap();
    for r in &history.epochs {
        let acc = r.val_accuracy.unwrap();
        let names: Vec<&str> = r.metrics.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["device_accuracy", "host_accuracy"]);
        for (name, v) in &r.metrics {
            assert!((v - acc).abs() < 1e-6, "{name}: {v} vs {acc}");
        }
    }
}

#[test]
fn metrics_inventory_on_the_interpreter() {
    metrics_inventory_on(backend::interpreter(), 1);
    metrics_inventory_on(backend::interpreter(), 4);
}

#[test]
fn metrics_inventory_on_xla() {
    if let Some(xla) = xla_or_skip("metrics_inventory_on_xla") {
        metrics_inventory_on(xla, 1);
        metrics_inventory_on(xla, 4);
    }
}

/// `predict` reuses the evaluation program: no program of its own.
#[test]
fn predict_reuses_the_evaluation_program() {
    let cache = own_cache();
    let (x, y) = data(16, 61);
    let mut run = handle(backend::interpreter(), cache, mlp(Act::Tanh), Sgd, 8, 0.1);
    let b = batch(&x, &y, 0, 8, 8);
    run.evaluate(&b, 8).unwrap();
    let entries = cache.stats().entries;
    let logits = run.predict(&b).unwrap();
    assert_eq!(logits.dims(), [8, 3]);
    assert_eq!(cache.stats().entries, entries, "predict adds no program");
    // The same numbers as a forward pass on the host-side experiment.
    let e = run.into_experiment().unwrap();
    let w1 = e.layers[0].w.as_slice::<f32>().unwrap();
    let first: Vec<f32> = (0..16)
        .map(|j| (0..4).map(|k| x[k] * w1[k * 16 + j]).sum::<f32>().tanh())
        .collect();
    let w2 = e.layers[1].w.as_slice::<f32>().unwrap();
    let want: Vec<f32> = (0..3)
        .map(|c| (0..16).map(|j| first[j] * w2[j * 3 + c]).sum::<f32>())
        .collect();
    let got = &logits.as_slice::<f32>().unwrap()[..3];
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }
}

/// A fresh cache on the same directory loads the handle's programs instead of compiling them —
/// the donating update program included — on the interpreter as on XLA.
fn a_fresh_cache_loads_both_programs_on(backend: &'static dyn Backend) {
    let dir = common::TempDir::new("handle-store");
    let cache_on_dir = || -> &'static Cache {
        let store = nitro::cache::DirStore::open(dir.path(), 1 << 30, None).expect("store");
        Box::leak(Box::new(Cache::new(8, Some(std::sync::Arc::new(store)))))
    };
    let (x, y) = data(32, 3);
    let b = batch(&x, &y, 0, 32, 32);
    let fresh = || {
        handle(
            backend,
            cache_on_dir(),
            mlp(Act::Tanh),
            Adam::default(),
            32,
            0.01,
        )
    };
    let outcomes = fresh().prepare(&b).unwrap();
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Compiled { .. })),
        "{outcomes:?}"
    );
    let mut second = fresh();
    let outcomes = second.prepare(&b).unwrap();
    assert!(
        outcomes.iter().all(|o| matches!(o, Outcome::Loaded { .. })),
        "{outcomes:?}"
    );
    second.step(&b, 32).unwrap();
}

#[test]
fn a_fresh_cache_loads_both_programs_on_the_interpreter() {
    a_fresh_cache_loads_both_programs_on(backend::interpreter());
}

#[test]
fn a_fresh_cache_loads_both_programs_on_xla() {
    let Some(xla) = xla_or_skip("a_fresh_cache_loads_both_programs_on_xla") else {
        return;
    };
    a_fresh_cache_loads_both_programs_on(xla);
}

/// A schedule that records, at the first step, how many programs the cache had compiled.
#[derive(Debug)]
struct CompiledAtFirstStep {
    cache: &'static Cache,
    seen: std::sync::Arc<std::sync::Mutex<Option<u64>>>,
}

impl nitro::optim::Schedule for CompiledAtFirstStep {
    fn lr(&self, step: u64) -> f64 {
        if step == 0 {
            *self.seen.lock().unwrap() = Some(self.cache.stats().compiles);
        }
        0.05
    }
}

/// `fit` with validation compiles the whole inventory — gradient, update, evaluation and each
/// device metric's program — together before the first step, not the evaluation programs
/// after the first epoch; without validation, the two training programs alone.
#[test]
fn fit_compiles_the_evaluation_programs_with_the_training_ones() {
    for (validation, metric, expected) in [(false, false, 2), (true, false, 3), (true, true, 4)] {
        let cache = own_cache();
        let seen = std::sync::Arc::default();
        let schedule = CompiledAtFirstStep {
            cache,
            seen: std::sync::Arc::clone(&seen),
        };
        let config = Config::new().batch(32).epochs(2).schedule(schedule);
        let mut run =
            Nitro::with_backend(mlp(Act::Tanh), Sgd, config, backend::interpreter(), cache)
                .unwrap();
        if metric {
            run.add_device_metric::<DeviceAccuracy>();
        }
        let val = dataset(40, 5);
        run.fit(&dataset(64, 4), validation.then_some(&val))
            .unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            Some(expected),
            "compiled before the first step (validation {validation}, metric {metric})"
        );
        assert_eq!(cache.stats().compiles, expected, "and nothing after");
    }
}

/// AdamW's decay mask by leaf path: the leaves a pattern names take Adam's step, the others
/// AdamW's — through the packed update program, where a mask is per element — and a pattern
/// that names no leaf is refused when the handle is made, with the leaves listed.
fn adamw_mask_on(backend: &'static dyn Backend) {
    use nitro::optim::AdamW;
    let (x, y) = data(32, 9);
    let b = batch(&x, &y, 0, 32, 32);
    let after = |o: AdamW| -> Vec<Vec<f32>> {
        let mut run = handle(backend, own_cache(), mlp(Act::Tanh), o, 32, 0.05);
        // One step: from the same start, a leaf's step depends on its own decay only.
        run.step(&b, 32).unwrap();
        leaves(&run.into_experiment().unwrap())
    };
    let strong = AdamW {
        weight_decay: 0.5,
        ..AdamW::default()
    };
    let masked = after(strong.clone().no_decay(["*.b"]));
    let all = after(strong.clone());
    let none = after(AdamW {
        weight_decay: 0.0,
        ..strong.clone()
    });
    let spared_weights = after(strong.clone().no_decay(["layers[*].w"]));
    // Leaves alternate w, b (in one packed array): weights decay, biases do not; then the
    // other way round.
    for (i, leaf) in masked.iter().enumerate() {
        let want = if i % 2 == 0 { &all[i] } else { &none[i] };
        assert_eq!(leaf, want, "leaf {i}");
    }
    for (i, leaf) in spared_weights.iter().enumerate() {
        let want = if i % 2 == 0 { &none[i] } else { &all[i] };
        assert_eq!(leaf, want, "leaf {i}, weights spared");
    }
    assert_ne!(all[0], none[0], "the decay is strong enough to show");
    let err = Nitro::with_backend(
        mlp(Act::Tanh),
        strong.no_decay(["*.bias"]),
        Config::new().batch(32),
        backend,
        own_cache(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("*.bias") && err.contains("layers[0].b"),
        "{err}"
    );
}

#[test]
fn adamw_decays_only_the_leaves_outside_its_patterns_on_the_interpreter() {
    adamw_mask_on(backend::interpreter());
}

#[test]
fn adamw_decays_only_the_leaves_outside_its_patterns_on_xla() {
    if let Some(xla) = xla_or_skip("adamw_decays_only_the_leaves_outside_its_patterns_on_xla") {
        adamw_mask_on(xla);
    }
}

#[test]
fn recompile_reasons_name_the_program_inputs() {
    let cache = own_cache();
    let b = backend::interpreter();
    let (x, y) = data(32, 5);
    let mut one = handle(b, cache, mlp(Act::Tanh), Adam::default(), 32, 0.01);
    one.prepare(&batch(&x, &y, 0, 32, 32)).unwrap();
    // Another batch size: the gradient program's batch and mask inputs change shape, and the
    // reason names them as the program sees them — not by tuple position.
    let mut two = handle(b, cache, mlp(Act::Tanh), Adam::default(), 31, 0.01);
    let outcomes = two.prepare(&batch(&x, &y, 0, 31, 31)).unwrap();
    let reason = outcomes[0].to_string();
    assert!(reason.contains("batch.x f32[32,4] → f32[31,4]"), "{reason}");
    assert!(reason.contains("batch.y i32[32] → i32[31]"), "{reason}");
    assert!(reason.contains("mask f32[32] → f32[31]"), "{reason}");
    assert!(!reason.contains("0.x"), "{reason}");
    // The update program did not change.
    assert!(outcomes[1].is_hit(), "{}", outcomes[1]);
    // A narrower hidden layer: the update program's gradient input is `grads[0]`.
    let mut narrow = mlp(Act::Tanh);
    narrow.layers[0].w = nitro::init::glorot_uniform(4, 8, nitro::init::Seed(1));
    narrow.layers[0].b = Array::zeros(DType::F32, &[8]);
    narrow.layers[1].w = nitro::init::glorot_uniform(8, 3, nitro::init::Seed(2));
    let mut three = handle(b, cache, narrow, Adam::default(), 32, 0.01);
    let outcomes = three.prepare(&batch(&x, &y, 0, 32, 32)).unwrap();
    let reason = outcomes[1].to_string();
    assert!(reason.contains("grads[0] f32["), "{reason}");
    assert!(!reason.contains("0[0]"), "{reason}");
}

/// A modify that gives a trainable leaf new dims places the zeroed gradient sums an
/// accumulation window starts from again, for the new layout, so the next window trains the
/// new model (before, the sums kept the old dims and the next step was refused). The result
/// equals a fresh handle's on the modified experiment (plain SGD: no state, no step count).
#[test]
fn a_modify_that_resizes_a_leaf_places_new_zero_sums_for_accumulation() {
    let (x, y) = data(32, 61);
    let b = batch(&x, &y, 0, 8, 8);
    let config = || {
        Config::new()
            .batch(8)
            .lr(0.05)
            .accumulate(2)
            .progress(false)
    };
    let mut run = Nitro::with_backend(
        mlp(Act::Tanh),
        Sgd,
        config(),
        backend::interpreter(),
        own_cache(),
    )
    .unwrap();
    run.step(&b, 8).unwrap();
    run.step(&b, 8).unwrap();
    assert_eq!(run.steps(), 1);
    // A hidden layer of 8 units instead of 16.
    let resize = |e: &mut Mlp| {
        e.layers[0].w = nitro::init::glorot_uniform(4, 8, nitro::init::Seed(3));
        e.layers[0].b = Array::zeros(DType::F32, &[8]);
        e.layers[1].w = nitro::init::glorot_uniform(8, 3, nitro::init::Seed(4));
    };
    run.modify(resize).unwrap();
    let resized = run.experiment().unwrap().clone();
    run.step(&b, 8).unwrap();
    run.step(&b, 8).unwrap();
    assert_eq!(run.steps(), 2);
    let mut fresh =
        Nitro::with_backend(resized, Sgd, config(), backend::interpreter(), own_cache()).unwrap();
    fresh.step(&b, 8).unwrap();
    fresh.step(&b, 8).unwrap();
    assert_eq!(
        leaves(run.experiment().unwrap()),
        leaves(fresh.experiment().unwrap())
    );
}
