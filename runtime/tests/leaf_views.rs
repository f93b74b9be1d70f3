//! Per-leaf program inputs over packed parameters: the per-batch programs take one input per
//! trainable leaf — on XLA a view of the packed buffer's memory — while the update program
//! keeps the packed buffers. Views and copies give the same numbers, in every order of steps,
//! evaluations and metrics the handle allows; leaves that are not 64-byte multiples and
//! several dtypes in one model are laid out and read back exactly. And a warm-up on its own
//! thread leaves a later handle every program in memory.
#![allow(missing_docs)]

mod common;

use common::xla_or_skip;
use nitro::backend::{self, Backend};
use nitro::cache::Cache;
use nitro::init::{self, Seed};
use nitro::optim::Adam;
use nitro::prelude::*;
use nitro::trace::nn;
use nitro::train::{Config, DeviceMetric, LeafInputs, Model, Nitro};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

fn own_cache() -> &'static Cache {
    Box::leak(Box::new(Cache::in_memory(32)))
}

fn config(views: bool) -> Config {
    Config::new()
        .batch(16)
        .lr(0.05)
        .leaf_views(views)
        .progress(false)
}

/// Every trainable leaf's values, flattened to `f64`.
fn values<E: Experiment>(e: &E) -> Vec<Vec<f64>> {
    let mut out = Vec::new();
    e.visit_device(&mut |field, _, node| {
        if let nitro::tree::Node::Leaf(a) = node {
            if field.role == (nitro::experiment::Role::Device { trainable: true }) {
                out.push(to_f64(a));
            }
        }
    });
    out
}

fn to_f64(a: &Array) -> Vec<f64> {
    match a.dtype() {
        DType::F32 => a
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|&x| f64::from(x))
            .collect(),
        DType::BF16 => a
            .as_slice::<nitro::bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_f64())
            .collect(),
        other => panic!("no f64 view of {other}"),
    }
}

/// A classifier whose leaves are not multiples of 64 bytes (15, 5, 15 and 3 elements) in two
/// dtypes: `f32` for the first layer, `bf16` for the second (computed in `f32`).
#[experiment]
#[derive(Clone)]
pub struct Mixed {
    #[device(trainable)]
    pub w1: Array,
    #[device(trainable)]
    pub b1: Array,
    #[device(trainable)]
    pub w2: Array,
    #[device]
    pub frozen: Array,
    #[device(trainable)]
    pub b2: Array,
}

impl Model for Mixed {
    type Batch = Batch;

    fn loss(v: &MixedView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        nn::softmax_cross_entropy(mixed_logits(v, b.x), b.y)
    }
}

fn mixed_logits(v: &MixedView<'_>, x: Tensor) -> Tensor {
    // Three of the four features, as `w1` reads them.
    let x = x.slice(&[0, 0], &[x.dims()[0], 3]) * v.frozen;
    let h = (x.matmul(v.w1) + v.b1).tanh();
    h.matmul(v.w2.convert(DType::F32)) + v.b2.convert(DType::F32)
}

fn mixed() -> Mixed {
    let bf16 = |a: Array| -> Array {
        let v = a.as_slice::<f32>().unwrap();
        Array::from_vec(
            a.dims(),
            v.iter().map(|&x| nitro::bf16::from_f32(x)).collect(),
        )
        .unwrap()
    };
    Mixed {
        w1: init::glorot_uniform(3, 5, Seed(3)),
        b1: Array::full(&[5], 0.01f32),
        w2: bf16(init::glorot_uniform(5, 3, Seed(4))),
        frozen: Array::full(&[3], 1.0f32),
        b2: bf16(Array::full(&[3], 0.02f32)),
    }
}

/// Trains `e` for a few steps (deferred, so the host runs ahead of the device), evaluating
/// between them; the losses, the evaluations and the trained leaves.
fn train<E: Model<Batch = Batch> + Clone>(
    e: E,
    backend: &'static dyn Backend,
    views: bool,
) -> (Vec<f64>, Vec<f64>, Vec<Vec<f64>>, Option<LeafInputs>) {
    let (x, y) = data(64, 21);
    let mut run =
        Nitro::with_backend(e, Adam::default(), config(views), backend, own_cache()).unwrap();
    let mut evals = Vec::new();
    for (i, start) in [0, 16, 32, 48, 0, 16].into_iter().enumerate() {
        run.step_deferred(&batch(&x, &y, start, 16, 16), 16)
            .unwrap();
        if i % 2 == 1 {
            evals.push(
                run.evaluate(&batch(&x, &y, 32, 16, 16), 16)
                    .unwrap()
                    .loss_sum,
            );
        }
    }
    let losses = run.take_losses().unwrap();
    let how = run.leaf_inputs();
    let trained = values(&run.into_experiment().unwrap());
    (losses, evals, trained, how)
}

#[track_caller]
fn assert_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (p, q)) in a.iter().zip(b).enumerate() {
        assert!(
            (p - q).abs() <= tol * (1.0 + q.abs()),
            "{what}[{i}]: {p} vs {q}"
        );
    }
}

#[test]
fn the_interpreter_copies_leaves_and_agrees_with_xla_views() {
    let on_interp = train(mlp(Act::Tanh), backend::interpreter(), true);
    assert_eq!(
        on_interp.3,
        Some(LeafInputs::Copies),
        "no views on the host"
    );
    let Some(xla) = xla_or_skip("the_interpreter_copies_leaves_and_agrees_with_xla_views") else {
        return;
    };
    let on_xla = train(mlp(Act::Tanh), xla, true);
    assert_eq!(
        on_xla.3,
        Some(LeafInputs::Views),
        "the CPU plugin makes views"
    );
    // Documented tolerance: f32 through six Adam steps.
    assert_close(&on_xla.0, &on_interp.0, 1e-4, "losses");
    assert_close(&on_xla.1, &on_interp.1, 1e-4, "evaluations");
    for (a, b) in on_xla.2.iter().zip(&on_interp.2) {
        assert_close(a, b, 1e-4, "trained leaf");
    }
}

/// The donation-order test: the host enqueues steps without waiting, and evaluations and a
/// device metric read the leaves between them. A view made before the update writing its
/// memory had finished, or an update reusing memory an evaluation still reads, would read
/// half-written parameters; copies (made on the host after each update) cannot. Both must give
/// the same numbers, bit for bit: the same programs on the same values.
#[test]
fn views_and_copies_agree_bit_for_bit_in_any_order_of_runs() {
    let Some(xla) = xla_or_skip("views_and_copies_agree_bit_for_bit_in_any_order_of_runs") else {
        return;
    };
    let viewed = train(mlp(Act::Relu), xla, true);
    let copied = train(mlp(Act::Relu), xla, false);
    assert_eq!(viewed.3, Some(LeafInputs::Views));
    assert_eq!(copied.3, Some(LeafInputs::Copies));
    assert_eq!(viewed.0, copied.0, "losses");
    assert_eq!(viewed.1, copied.1, "evaluations");
    assert_eq!(viewed.2, copied.2, "trained leaves");
    // The same through a fit with a device metric validating after every epoch.
    let fit = |views: bool| {
        let mut run = Nitro::with_backend(
            mlp(Act::Relu),
            Adam::default(),
            config(views).epochs(3).batch(8),
            xla,
            own_cache(),
        )
        .unwrap();
        run.add_device_metric::<MeanMargin>();
        let history = run.fit(&dataset(60, 5), Some(&dataset(20, 6))).unwrap();
        let trained = values(&run.into_experiment().unwrap());
        let metrics: Vec<_> = history
            .epochs
            .iter()
            .map(|r| (r.train_loss, r.val_loss, r.metrics.clone()))
            .collect();
        (metrics, trained)
    };
    assert_eq!(fit(true), fit(false));
}

/// The largest logit's margin over the mean logit, accumulated on the device.
struct MeanMargin;

impl DeviceMetric<Mlp> for MeanMargin {
    const NAME: &'static str = "mean_margin";

    fn per_example(v: &MlpView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        let z = logits(v, b.x);
        z.max(&[1]) - z.mean(&[1])
    }
}

#[test]
fn leaves_off_the_64_byte_grid_in_two_dtypes_train_alike_everywhere() {
    let on_interp = train(mixed(), backend::interpreter(), true);
    // The trained leaves keep their dtypes and shapes: 15 and 5 `f32`, 15 and 3 `bf16`.
    let lens: Vec<usize> = on_interp.2.iter().map(Vec::len).collect();
    assert_eq!(lens, [15, 5, 15, 3]);
    let Some(xla) = xla_or_skip("leaves_off_the_64_byte_grid_in_two_dtypes_train_alike_everywhere")
    else {
        return;
    };
    let viewed = train(mixed(), xla, true);
    let copied = train(mixed(), xla, false);
    assert_eq!(viewed.3, Some(LeafInputs::Views));
    assert_eq!(viewed.0, copied.0, "losses, views vs copies");
    assert_eq!(viewed.2, copied.2, "trained leaves, views vs copies");
    assert_close(&viewed.0, &on_interp.0, 1e-4, "losses, XLA vs interpreter");
    for (a, b) in viewed.2.iter().zip(&on_interp.2) {
        assert_close(a, b, 1e-4, "trained leaf, XLA vs interpreter");
    }
    // It learned something: the last loss is below the first.
    assert!(viewed.0.last() < viewed.0.first(), "{:?}", viewed.0);
}

/// Changing the experiment through the handle replaces the packed storage: the views of the
/// old storage are dropped first, and the next step reads the new values.
#[test]
fn a_modified_experiment_is_read_through_new_views() {
    let Some(xla) = xla_or_skip("a_modified_experiment_is_read_through_new_views") else {
        return;
    };
    let (x, y) = data(32, 8);
    let b = batch(&x, &y, 0, 16, 16);
    let mut run = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        config(true),
        xla,
        own_cache(),
    )
    .unwrap();
    run.step(&b, 16).unwrap();
    let before = run.evaluate(&b, 16).unwrap().loss_sum;
    run.modify(|e| {
        for l in &mut e.layers {
            l.w = Array::zeros(DType::F32, l.w.dims());
        }
    })
    .unwrap();
    let after = run.evaluate(&b, 16).unwrap().loss_sum;
    // Zero weights and the trained biases: every row's logits are the last bias.
    let mut fresh = Nitro::with_backend(
        run.experiment().unwrap().clone(),
        Adam::default(),
        config(false),
        xla,
        own_cache(),
    )
    .unwrap();
    assert_eq!(after, fresh.evaluate(&b, 16).unwrap().loss_sum);
    assert_ne!(before, after);
}

/// A model whose update is long enough (a million parameters under Adam) that a view read
/// before the update had finished writing them would see half-written memory.
#[experiment]
#[derive(Clone)]
pub struct Wide {
    #[device(trainable)]
    pub w: Array,
    #[device(trainable)]
    pub b: Array,
}

impl Model for Wide {
    type Batch = Batch;

    fn loss(v: &WideView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        let h = (b.x.matmul(v.w) + v.b).tanh();
        let z = h.slice(&[0, 0], &[h.dims()[0], 3]) * 4.0;
        nn::softmax_cross_entropy(z, b.y)
    }
}

/// The wrong order the views must never allow: the host runs ahead (deferred steps, each
/// enqueued before the last update has finished) on a model whose update takes milliseconds.
/// The losses read through views equal those read through copies, bit for bit.
#[test]
fn views_never_read_parameters_an_update_is_still_writing() {
    let Some(xla) = xla_or_skip("views_never_read_parameters_an_update_is_still_writing") else {
        return;
    };
    let wide = Wide {
        w: init::glorot_uniform(4, 1 << 18, Seed(9)),
        b: Array::zeros(DType::F32, &[1 << 18]),
    };
    let (x, y) = data(64, 31);
    let run = |views: bool| {
        let mut run = Nitro::with_backend(
            wide.clone(),
            Adam::default(),
            config(views),
            xla,
            own_cache(),
        )
        .unwrap();
        for start in [0, 16, 32, 48, 0, 16, 32, 48] {
            run.step_deferred(&batch(&x, &y, start, 16, 16), 16)
                .unwrap();
        }
        (run.take_losses().unwrap(), run.leaf_inputs())
    };
    let (viewed, how) = run(true);
    assert_eq!(how, Some(LeafInputs::Views));
    assert_eq!(viewed, run(false).0);
}

/// A warm-up gets the programs and runs them once on its own thread; a handle made after it
/// finds every program in memory, and trains as one made without it.
#[test]
fn a_handle_after_a_warm_up_finds_every_program_in_memory() {
    let (x, y) = data(48, 12);
    let sample = batch(&x, &y, 0, 24, 24);
    let config = Config::new().batch(24).lr(0.05).progress(false);
    let warm = Nitro::warm_up(
        mlp(Act::Tanh),
        Adam::default(),
        config.clone(),
        sample.clone(),
        true,
    );
    let report = warm.wait().unwrap();
    assert_eq!(report.outcomes.len(), 3, "gradient, update, evaluation");
    let mut run = Nitro::new(mlp(Act::Tanh), Adam::default(), config).unwrap();
    let outcomes = run.prepare(&sample).unwrap();
    assert_eq!(outcomes.len(), 2);
    assert!(
        outcomes.iter().all(|o| o.is_hit()),
        "the warm-up's programs: {outcomes:?}"
    );
    let first = run.step(&sample, 24).unwrap().loss;
    // The warm-up trained values of its own: the handle's first loss is that of the initial
    // weights, as on a handle of its own.
    let mut fresh = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        Config::new().batch(24).lr(0.05).progress(false),
        nitro::backend::current().unwrap(),
        own_cache(),
    )
    .unwrap();
    assert_eq!(first, fresh.step(&sample, 24).unwrap().loss);
}
