//! Training partitioned over a mesh by XLA's SPMD partitioner (issue 33): FSDP, replicated,
//! tensor-parallel and mixed 2-D layouts on 4 CPU devices train to the one-device losses and
//! parameters (also with gradient accumulation), evaluate and predict every row, keep a quarter
//! of the state per device under FSDP, resume from checkpoints written on another mesh, load
//! from the store in a fresh cache, and key their programs by mesh and sharding (a sharding
//! change misses naming both, and serves nothing stale). The interpreter runs the
//! unpartitioned programs and agrees.
#![allow(missing_docs)]

mod common;

#[path = "common/mlp.rs"]
mod mlp;

use common::xla_devices_or_skip;
use mlp::*;
use nitro::backend::{self, Backend};
use nitro::cache::{Cache, MissReason, Outcome, Will};
use nitro::optim::Adam;
use nitro::prelude::*;
use nitro::shard::{Mesh, PartitionSpec, Partitioning, Sharding};
use nitro::train::{Config, Nitro};

fn own_cache() -> &'static Cache {
    Box::leak(Box::new(Cache::in_memory(32)))
}

fn fsdp(devices: usize) -> Config {
    Config::new()
        .mesh(Mesh::new([("data", devices)]).unwrap())
        .sharding(Sharding::fsdp("data"))
}

fn partitioned(config: &Config) -> &'static dyn Backend {
    backend::for_mesh(&config.partitioning().unwrap().unwrap()).unwrap()
}

/// The steps every comparison takes: four full batches of 8 rows and a ragged one of 5.
const STEPS: [(usize, usize); 5] = [(0, 8), (8, 8), (16, 8), (24, 8), (32, 5)];

/// Trains the classifier over [`STEPS`] on `backend` with `config`; returns the losses and
/// the trained leaves.
fn train(
    config: Config,
    backend: &'static dyn Backend,
    cache: &'static Cache,
) -> (Vec<f64>, Vec<Vec<f32>>) {
    let (x, y) = data(40, 21);
    let mut run = handle(mlp(Act::Tanh), config.batch(8).lr(0.02), backend, cache).expect("handle");
    let losses = STEPS
        .iter()
        .map(|&(start, real)| run.step(&batch(&x, &y, start, real, 8), real).unwrap().loss)
        .collect();
    (losses, leaves(&run.into_experiment().unwrap()))
}

/// A handle on `model` with Adam, on `backend` and `cache`.
fn handle<E: nitro::train::Model>(
    model: E,
    config: Config,
    backend: &'static dyn Backend,
    cache: &'static Cache,
) -> nitro::Result<Nitro<E, Adam>> {
    Nitro::with_backend(model, Adam::default(), config, backend, cache)
}

fn assert_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (p, q) in a.iter().zip(b) {
        assert!((p - q).abs() <= tol * (1.0 + p.abs()), "{what}: {p} vs {q}");
    }
}

/// Trains on 4 devices laid out as `config` says, and checks the losses and the trained leaves
/// against the one-device run's within 1e-5.
fn matches_one_device(base_losses: &[f64], base: &[Vec<f32>], config: Config) {
    let backend = partitioned(&config);
    let what = backend.partitioning().unwrap().describe();
    assert_eq!(backend.devices(), 4, "{what}");
    let (losses, trained) = train(config, backend, own_cache());
    assert_close(base_losses, &losses, 1e-5, &format!("losses, {what}"));
    assert_close(
        &flat(base),
        &flat(&trained),
        1e-5,
        &format!("leaves, {what}"),
    );
}

fn flat(leaves: &[Vec<f32>]) -> Vec<f64> {
    leaves.iter().flatten().map(|&v| f64::from(v)).collect()
}

#[test]
fn fsdp_and_replicated_meshes_train_to_the_one_device_losses_on_four_xla_devices() {
    let test = "fsdp_and_replicated_meshes_train_to_the_one_device_losses_on_four_xla_devices";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    xla_devices_or_skip(test, 4).expect("4 devices");
    let (base_losses, base) = train(Config::new(), one, own_cache());
    for config in [
        fsdp(4),
        Config::new().mesh(Mesh::new([("data", 4)]).unwrap()),
    ] {
        // Documented tolerance: the partitioned program sums a batch's rows per device, then
        // across devices, so f32 rounding differs from the one-device sum.
        matches_one_device(&base_losses, &base, config);
    }
}

#[test]
fn a_mesh_of_one_device_trains_as_no_mesh_does() {
    let test = "a_mesh_of_one_device_trains_as_no_mesh_does";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    let (base_losses, base) = train(Config::new(), one, own_cache());
    let config = fsdp(1);
    let backend = partitioned(&config);
    assert_eq!(backend.devices(), 1);
    let (losses, trained) = train(config, backend, own_cache());
    assert_close(&base_losses, &losses, 1e-6, "losses");
    assert_close(&flat(&base), &flat(&trained), 1e-6, "leaves");
}

/// Issue 40, item 11: from no mesh to a one-device mesh, every program's reason names the mesh
/// (the update program's too, whose layout GraphConst moves with it).
#[test]
fn going_onto_a_mesh_names_the_mesh_in_every_programs_reason() {
    let test = "going_onto_a_mesh_names_the_mesh_in_every_programs_reason";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    let cache = own_cache();
    let (x, y) = data(8, 3);
    let sample = batch(&x, &y, 0, 8, 8);
    let mut plain = handle(mlp(Act::Tanh), Config::new().batch(8), one, cache).unwrap();
    assert!(plain.prepare(&sample).unwrap().iter().all(|o| !o.is_hit()));
    let config = fsdp(1).batch(8);
    let mut meshed = handle(mlp(Act::Tanh), config.clone(), partitioned(&config), cache).unwrap();
    let outcomes = meshed.prepare(&sample).unwrap();
    assert_eq!(outcomes.len(), 2);
    for outcome in &outcomes {
        match outcome {
            Outcome::Compiled {
                reason:
                    MissReason::BackendChanged {
                        component,
                        from,
                        to,
                    },
            } => {
                assert_eq!(component, "sharding", "{outcome}");
                assert_eq!(from, "absent", "{outcome}");
                assert!(to.contains("data=1"), "{outcome}");
            }
            other => panic!("the mesh, not the layout: {other}"),
        }
    }
}

#[test]
fn fsdp_with_gradient_accumulation_matches_one_device() {
    let test = "fsdp_with_gradient_accumulation_matches_one_device";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    xla_devices_or_skip(test, 4).expect("4 devices");
    let run = |config: Config, backend: &'static dyn Backend| {
        let (x, y) = data(40, 21);
        let mut run = handle(
            mlp(Act::Relu),
            config.batch(8).lr(0.02).accumulate(2),
            backend,
            own_cache(),
        )
        .unwrap();
        for &(start, real) in &STEPS[..4] {
            run.step_deferred(&batch(&x, &y, start, real, 8), real)
                .unwrap();
        }
        let losses = run.take_losses().unwrap();
        assert_eq!(run.steps(), 2, "two optimizer steps of two micro-batches");
        (losses, leaves(&run.into_experiment().unwrap()))
    };
    let (base_losses, base) = run(Config::new(), one);
    let config = fsdp(4);
    let (losses, trained) = run(config.clone(), partitioned(&config));
    assert_close(&base_losses, &losses, 1e-5, "accumulated losses");
    assert_close(&flat(&base), &flat(&trained), 1e-5, "accumulated leaves");
}

#[test]
fn fsdp_evaluates_and_predicts_every_row() {
    let test = "fsdp_evaluates_and_predicts_every_row";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    xla_devices_or_skip(test, 4).expect("4 devices");
    let (x, y) = data(16, 5);
    let sample = batch(&x, &y, 0, 7, 8);
    let mut results = Vec::new();
    for (config, backend) in [
        (Config::new(), one as &'static dyn Backend),
        (fsdp(4), partitioned(&fsdp(4))),
    ] {
        let mut run = handle(mlp(Act::Tanh), config.batch(8), backend, own_cache()).unwrap();
        let eval = run.evaluate(&sample, 7).unwrap();
        let predictions = run.predict(&sample).unwrap();
        assert_eq!(predictions.dims(), &[8, 3]);
        results.push((eval, predictions));
    }
    let ((a, pa), (b, pb)) = (&results[0], &results[1]);
    assert_close(
        &[a.loss_sum, a.correct],
        &[b.loss_sum, b.correct],
        1e-5,
        "eval",
    );
    let as64 = |p: &Array| {
        p.as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|&v| f64::from(v))
            .collect::<Vec<_>>()
    };
    assert_close(&as64(pa), &as64(pb), 1e-5, "predictions of all 8 rows");
}

/// A classifier whose every leaf has a dim that 4 divides: 4 features, 8 hidden units, 4
/// logits.
#[experiment]
#[derive(Clone)]
pub struct Wide {
    #[device(trainable)]
    pub layers: Vec<Dense>,
}

impl nitro::train::Model for Wide {
    type Batch = Batch;

    fn loss(v: &WideView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        let h = (b.x.matmul(v.layers[0].w) + v.layers[0].b).tanh();
        nitro::trace::nn::softmax_cross_entropy(h.matmul(v.layers[1].w) + v.layers[1].b, b.y)
    }
}

fn wide() -> Wide {
    let dense = |i: usize, o: usize, seed: u64| Dense {
        w: nitro::init::glorot_uniform(i, o, nitro::init::Seed(seed)),
        b: Array::zeros(DType::F32, &[o]),
    };
    Wide {
        layers: vec![dense(4, 8, 1), dense(8, 4, 2)],
    }
}

/// [`Wide`] with its hidden activations constrained to be split by rows along `data`
/// (`Tensor::shard`), or — `bad` — along an axis the mesh lacks.
#[experiment]
#[derive(Clone)]
pub struct Constrained {
    #[graph_const]
    pub bad: bool,
    #[device(trainable)]
    pub layers: Vec<Dense>,
}

impl nitro::train::Model for Constrained {
    type Batch = Batch;

    fn loss(v: &ConstrainedView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        let axis = if *v.bad { "model" } else { "data" };
        let h = (b.x.matmul(v.layers[0].w) + v.layers[0].b)
            .tanh()
            .shard(PartitionSpec::new([Some(axis), None]));
        nitro::trace::nn::softmax_cross_entropy(h.matmul(v.layers[1].w) + v.layers[1].b, b.y)
    }
}

#[test]
fn a_sharding_constraint_inside_the_model_is_emitted_and_trains_to_the_one_device_losses() {
    let test =
        "a_sharding_constraint_inside_the_model_is_emitted_and_trains_to_the_one_device_losses";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    xla_devices_or_skip(test, 4).expect("4 devices");
    let (x, y) = data(40, 21);
    let run = |bad: bool, config: Config, backend: &'static dyn Backend| {
        let model = Constrained {
            bad,
            layers: wide().layers,
        };
        let mut run = handle(model, config.batch(8).lr(0.02), backend, own_cache())?;
        STEPS
            .iter()
            .map(|&(start, real)| {
                run.step(&batch(&x, &y, start, real, 8), real)
                    .map(|s| s.loss)
            })
            .collect::<nitro::Result<Vec<f64>>>()
    };
    let base = run(false, Config::new(), one).unwrap();
    let config = fsdp(4);
    let got = run(false, config.clone(), partitioned(&config)).unwrap();
    assert_close(&base, &got, 1e-5, "losses with a constraint");
    // The interpreter and the one-device program take the constraint as the value itself.
    let interp = run(false, Config::new(), backend::interpreter()).unwrap();
    assert_close(&base, &interp, 1e-5, "interpreter");
    // An axis the mesh lacks: refused when the program is traced for the mesh.
    let e = run(true, config.clone(), partitioned(&config))
        .unwrap_err()
        .to_string();
    assert!(e.contains("Tensor::shard") && e.contains("`model`"), "{e}");
    // The emitted text carries Shardy's constraint.
    let traced = nitro::trace::trace(
        &[("x".into(), nitro::LeafType::new(DType::F32, &[8, 4]))],
        |i| vec![i[0].shard(PartitionSpec::new([Some("data"), None])).tanh()],
    )
    .unwrap();
    let sharding = nitro::shard::ProgramSharding {
        mesh: Mesh::new([("data", 4)]).unwrap(),
        inputs: vec![PartitionSpec::new([Some("data")])],
        outputs: vec![PartitionSpec::new([Some("data")])],
    };
    let mut partitioned_graph = traced.clone();
    partitioned_graph.sharding = Some(sharding.clone());
    let text = nitro::emit::emit_with(
        &partitioned_graph,
        &nitro::emit::EmitOptions {
            sharding: Some(sharding),
            ..Default::default()
        },
    );
    assert!(
        text.contains("sdy.sharding_constraint %arg0 <@mesh, [{\"data\"}, {}]> : tensor<8x4xf32>"),
        "{text}"
    );
    assert!(
        !nitro::emit::emit(&traced).contains("sdy."),
        "unpartitioned: no Shardy"
    );
}

#[test]
fn fsdp_keeps_a_quarter_of_the_state_per_device() {
    let test = "fsdp_keeps_a_quarter_of_the_state_per_device";
    let Some(replicated) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let (x, y) = data(8, 3);
    let sample = batch(&x, &y, 0, 8, 8);
    let memory = |config: Config, backend: &'static dyn Backend| {
        let mut run = handle(wide(), config.batch(8), backend, own_cache()).unwrap();
        run.step(&sample, 8).unwrap();
        run.memory()
    };
    let whole = memory(Config::new().devices(4), replicated);
    let config = fsdp(4);
    let sharded = memory(config.clone(), partitioned(&config));
    assert_eq!((whole.devices, sharded.devices), (4, 4));
    // Replicated: one packed array, each leaf at a 64-byte boundary: w1 32 floats, b1 8, a
    // 32-byte gap, w2 32, b2 4 — 84 floats. FSDP: each leaf split along its largest dim 4
    // divides — w1 [4, 8] by columns, b1 [8], w2 [8, 4] by rows, b2 [4] — 19 floats.
    assert_eq!(whole.parameters, 84 * 4);
    assert_eq!(sharded.parameters, 19 * 4);
    assert_eq!(
        whole.optimizer_state,
        2 * whole.parameters,
        "Adam's m and v"
    );
    assert_eq!(sharded.optimizer_state, 2 * sharded.parameters);
    let (a, b) = (
        sharded.parameters + sharded.optimizer_state,
        whole.parameters + whole.optimizer_state,
    );
    assert!(
        a as f64 <= 0.26 * b as f64,
        "FSDP keeps {a} bytes of parameters and optimizer state per device, replicated {b}"
    );
    // The plugin's own figures for one run on one device: the update program's arguments
    // (parameters, optimizer state, gradients) are shards under FSDP.
    let update = |m: &nitro::train::Memory| {
        let p = m
            .programs
            .iter()
            .find(|p| p.role == "update")
            .expect("update");
        p.compiled.expect("XLA reports the update program's memory")
    };
    let (a, b) = (update(&sharded), update(&whole));
    println!("update program per device: FSDP {a:?}, replicated {b:?}");
    // Parameters, Adam's state, the gradients (shaped as the parameters), the i64 step
    // counter and the f32 learning rate: the handle's own accounting, per device.
    for (m, c) in [(&sharded, a), (&whole, b)] {
        assert_eq!(
            c.arguments,
            2 * m.parameters + m.optimizer_state + 8 + 4,
            "{c:?}"
        );
        assert!(
            c.aliased > 0,
            "the update writes its donated state in place: {c:?}"
        );
    }
    assert!(sharded.largest_temporaries().is_some());
    assert!(sharded.programs.iter().any(|p| p.role == "grad"));
}

#[test]
fn tensor_parallel_and_mixed_meshes_train_to_the_one_device_losses() {
    let test = "tensor_parallel_and_mixed_meshes_train_to_the_one_device_losses";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    xla_devices_or_skip(test, 4).expect("4 devices");
    let (base_losses, base) = train(Config::new(), one, own_cache());
    let mesh = || Mesh::new([("data", 2), ("model", 2)]).unwrap();
    // Megatron's MLP on `model`: the first layer split by its hidden units (columns and bias),
    // the second by rows; the batch on `data`.
    let megatron = |s: Sharding| {
        s.leaf("layers[0].w", PartitionSpec::new([None, Some("model")]))
            .leaf("layers[0].b", PartitionSpec::new([Some("model")]))
            .leaf("layers[1].w", PartitionSpec::new([Some("model"), None]))
    };
    for config in [
        Config::new()
            .mesh(mesh())
            .sharding(megatron(Sharding::replicated("data"))),
        // The rest (the last bias) FSDP on `data`.
        Config::new()
            .mesh(mesh())
            .sharding(megatron(Sharding::fsdp("data"))),
        // FSDP alone on a 2-D mesh: the leaves split on `data`, whole along `model`.
        Config::new().mesh(mesh()).sharding(Sharding::fsdp("data")),
    ] {
        matches_one_device(&base_losses, &base, config);
    }
}

#[test]
fn checkpoints_resume_across_meshes_with_the_same_values() {
    let test = "checkpoints_resume_across_meshes_with_the_same_values";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    xla_devices_or_skip(test, 4).expect("4 devices");
    let (x, y) = data(40, 21);
    // Reference: all five steps on one device.
    let (base_losses, base) = train(Config::new(), one, own_cache());
    let step = |run: &mut Nitro<Mlp, Adam>, i: usize| {
        let (start, real) = STEPS[i];
        run.step(&batch(&x, &y, start, real, 8), real).unwrap().loss
    };
    // Trains STEPS leg by leg, each leg on its own layout, resumed from the last leg's
    // checkpoint.
    let chain = |legs: &[(Config, std::ops::Range<usize>)]| {
        let (mut losses, mut saved, mut last) = (Vec::new(), None, None);
        for (config, steps) in legs {
            let config = config.clone().batch(8).lr(0.02);
            let backend = match config.partitioning().unwrap() {
                Some(_) => partitioned(&config),
                None => one,
            };
            let mut run = match saved.take() {
                None => handle(mlp(Act::Tanh), config, backend, own_cache()).unwrap(),
                Some(saved) => Nitro::resume_with(
                    mlp(Act::Tanh),
                    Adam::default(),
                    config,
                    saved,
                    backend,
                    own_cache(),
                )
                .unwrap(),
            };
            losses.extend(steps.clone().map(|i| step(&mut run, i)));
            saved = Some(run.checkpoint().unwrap());
            last = Some(run);
        }
        let run = last.expect("a leg");
        assert_eq!(run.steps(), STEPS.len() as u64);
        (losses, leaves(&run.into_experiment().unwrap()))
    };
    let replicated = Config::new().mesh(Mesh::new([("data", 4)]).unwrap());
    for (what, legs) in [
        (
            "FSDP on 4 devices, then on 2, then one device",
            vec![(fsdp(4), 0..2), (fsdp(2), 2..4), (Config::new(), 4..5)],
        ),
        (
            "one device, then replicated on 4, then FSDP on 4",
            vec![(Config::new(), 0..1), (replicated, 1..3), (fsdp(4), 3..5)],
        ),
    ] {
        let (losses, trained) = chain(&legs);
        assert_close(&base_losses, &losses, 1e-5, &format!("losses: {what}"));
        assert_close(
            &flat(&base),
            &flat(&trained),
            1e-5,
            &format!("leaves: {what}"),
        );
    }
}

#[test]
fn a_sharding_change_misses_naming_both_and_serves_nothing_stale() {
    let test = "a_sharding_change_misses_naming_both_and_serves_nothing_stale";
    let Some(_) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let cache = own_cache();
    let (x, y) = data(8, 3);
    let sample = batch(&x, &y, 0, 8, 8);
    let prepare = |config: Config| {
        let backend = partitioned(&config);
        let mut run = handle(mlp(Act::Tanh), config.batch(8), backend, cache).unwrap();
        run.prepare(&sample).unwrap()
    };
    let first = prepare(fsdp(4));
    assert!(first.iter().all(|o| matches!(o, Outcome::Compiled { .. })));
    let replicated = prepare(Config::new().mesh(Mesh::new([("data", 4)]).unwrap()));
    assert_eq!(replicated.len(), 2);
    // Each program names the first input whose spec moved: the gradient program the first
    // trainable leaf by its path, the update program its first group, and that group's leaf.
    let moved: Vec<(String, String, String)> = replicated
        .iter()
        .map(|outcome| match outcome {
            Outcome::Compiled {
                reason: MissReason::ShardingChanged { input, from, to },
            } => (input.clone(), from.clone(), to.clone()),
            other => panic!("expected a sharding change, got {other:?}"),
        })
        .collect();
    let spec = |s: &str| s.to_owned();
    assert!(
        moved.contains(&(spec("layers[0].w"), spec("P(None, \"data\")"), spec("P()"))),
        "{moved:?}"
    );
    assert!(
        moved.contains(&(
            spec("params[0] (layers[0].w)"),
            spec("P(None, \"data\")"),
            spec("P()")
        )),
        "{moved:?}"
    );
    // Back to FSDP: its programs are still held, and served.
    assert!(prepare(fsdp(4)).iter().all(|o| *o == Outcome::Hit));
}

/// Issue 40, item 10: a `Sharding::leaf` pattern restating what FSDP gives the leaf shares the
/// FSDP programs in memory; a mesh whose axis is renamed, with the same partitioning, shares
/// them in memory too (issue 50, item 11) and, in a fresh cache, loads them from the store (no
/// compile), its reason naming the leaf and both specs; and the renamed run trains to the same
/// losses.
#[test]
fn equal_partitionings_share_programs_and_renamed_axes_load_them() {
    let test = "equal_partitionings_share_programs_and_renamed_axes_load_them";
    let Some(_) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let dir = common::TempDir::new("sharded-equal");
    let cache_on_dir = || -> &'static Cache {
        let store = nitro::cache::DirStore::open(dir.path(), 1 << 30, None).expect("store");
        Box::leak(Box::new(Cache::new(16, Some(std::sync::Arc::new(store)))))
    };
    let cache = cache_on_dir();
    let (x, y) = data(16, 9);
    let sample = batch(&x, &y, 0, 8, 8);
    let run_in = |config: Config, cache: &'static Cache| {
        let config = config.batch(8).lr(0.02);
        let mut run = handle(mlp(Act::Tanh), config.clone(), partitioned(&config), cache).unwrap();
        let outcomes = run.prepare(&sample).unwrap();
        let losses: Vec<f64> = [0, 8]
            .iter()
            .map(|&start| run.step(&batch(&x, &y, start, 8, 8), 8).unwrap().loss)
            .collect();
        (outcomes, losses)
    };
    let run = |config: Config| run_in(config, cache);
    let (first, losses) = run(fsdp(4));
    assert!(
        first.iter().all(|o| matches!(o, Outcome::Compiled { .. })),
        "{first:?}"
    );
    let compiles = cache.stats().compiles;

    // FSDP splits `layers[0].w` (f32[4,16]) along its dim 1; saying so again changes nothing.
    let restated = Config::new()
        .mesh(Mesh::new([("data", 4)]).unwrap())
        .sharding(
            Sharding::fsdp("data").leaf("layers[0].w", PartitionSpec::new([None, Some("data")])),
        );
    let (outcomes, again) = run(restated);
    assert!(outcomes.iter().all(|o| *o == Outcome::Hit), "{outcomes:?}");
    assert_eq!(again, losses);

    // The axis renamed: the same programs, held in memory.
    let renamed = Config::new()
        .mesh(Mesh::new([("batch", 4)]).unwrap())
        .sharding(Sharding::fsdp("batch"));
    let (outcomes, renamed_losses) = run(renamed.clone());
    assert!(outcomes.iter().all(|o| *o == Outcome::Hit), "{outcomes:?}");
    assert_eq!(cache.stats().compiles, compiles, "nothing compiled again");
    assert_close(&losses, &renamed_losses, 1e-6, "renamed losses");
    // In a fresh cache on the same store (another process): loaded.
    let fresh = cache_on_dir();
    let (outcomes, renamed_losses) = run_in(renamed, fresh);
    for o in &outcomes {
        match o {
            Outcome::Loaded {
                reason: MissReason::ShardingChanged { from, to, .. },
            } => assert!(from.contains("\"data\"") && to.contains("\"batch\""), "{o}"),
            other => panic!("a load naming both specs, got {other}"),
        }
    }
    assert_eq!(fresh.stats().compiles, 0, "nothing compiled again");
    assert_close(&losses, &renamed_losses, 1e-6, "renamed losses");

    // A sharding that splits differently still compiles its own programs.
    let (outcomes, _) = run(Config::new().mesh(Mesh::new([("data", 4)]).unwrap()));
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Compiled { .. })),
        "{outcomes:?}"
    );
}

#[test]
fn a_fresh_cache_on_the_same_store_loads_the_partitioned_programs_and_compiles_nothing() {
    let test =
        "a_fresh_cache_on_the_same_store_loads_the_partitioned_programs_and_compiles_nothing";
    let Some(_) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let dir = common::TempDir::new("sharded-store");
    let cache_on_dir = || -> &'static Cache {
        let store = nitro::cache::DirStore::open(dir.path(), 1 << 30, None).expect("store");
        Box::leak(Box::new(Cache::new(16, Some(std::sync::Arc::new(store)))))
    };
    let (x, y) = data(16, 9);
    let config = fsdp(4).batch(8).lr(0.02);
    let run = |cache: &'static Cache| {
        let mut run = handle(mlp(Act::Tanh), config.clone(), partitioned(&config), cache).unwrap();
        // The preflight first: it compiles nothing, and says what the lookups will do.
        let plan = run.plan(&batch(&x, &y, 0, 8, 8), false).unwrap();
        let outcomes = run.prepare(&batch(&x, &y, 0, 8, 8)).unwrap();
        let losses: Vec<f64> = [0, 8]
            .iter()
            .map(|&start| run.step(&batch(&x, &y, start, 8, 8), 8).unwrap().loss)
            .collect();
        (plan, outcomes, losses, run.manifest())
    };
    let (plan, first, losses, manifest) = run(cache_on_dir());
    assert_eq!(
        (plan.entries.len(), plan.count(Will::Compile)),
        (2, 2),
        "{plan:?}"
    );
    assert!(
        first.iter().all(|o| matches!(o, Outcome::Compiled { .. })),
        "{first:?}"
    );
    // The manifest names the partitioned programs by role and key.
    let mut roles: Vec<&str> = manifest.programs.iter().map(|p| p.role.as_str()).collect();
    roles.sort_unstable();
    assert_eq!(roles, ["grad", "update"], "{manifest:?}");
    // As a second process would: a cache with nothing in memory, on the same directory.
    let (plan, second, again, manifest_again) = run(cache_on_dir());
    assert_eq!(
        plan.count(Will::Load),
        2,
        "the preflight sees the stored programs: {plan:?}"
    );
    assert_eq!(second.len(), 2);
    assert!(
        second.iter().all(|o| matches!(o, Outcome::Loaded { .. })),
        "{second:?}"
    );
    assert_eq!(
        losses, again,
        "the loaded programs compute what the compiled ones did"
    );
    assert_eq!(
        manifest.programs, manifest_again.programs,
        "the same programs under the same keys"
    );
}

#[test]
fn the_interpreter_runs_the_unpartitioned_programs_and_agrees() {
    // A mesh on the interpreter: the programs run whole on its one device, bit for bit the
    // values of a handle without a mesh (the same programs).
    let config = fsdp(4);
    let interp = backend::interpreter();
    let (losses, trained) = train(config, interp, own_cache());
    let (base_losses, base) = train(Config::new(), interp, own_cache());
    assert_eq!(losses, base_losses);
    assert_eq!(trained, base);
    if nitro::backend::pjrt::selected().unwrap().is_none() {
        let picked = backend::for_mesh(&fsdp(4).partitioning().unwrap().unwrap()).unwrap();
        assert!(picked.partitioning().is_none() && picked.devices() == 1);
    }
}

#[test]
fn bad_meshes_and_shardings_are_typed_errors_that_say_what_to_do() {
    let err = |c: Config| c.partitioning().unwrap_err().to_string();
    let e = err(Config::new().sharding(Sharding::fsdp("data")));
    assert!(e.contains("no mesh was given"), "{e}");
    let e = err(fsdp(4).devices(4));
    assert!(e.contains("drop `Config::devices`"), "{e}");
    let e = err(Config::new()
        .mesh(Mesh::new([("data", 2)]).unwrap())
        .sharding(Sharding::fsdp("model")));
    assert!(e.contains("`model`") && e.contains("lacks"), "{e}");
    let e = Partitioning::new(
        Mesh::new([("data", 2)]).unwrap(),
        Sharding::fsdp("data").leaf("*.w", PartitionSpec::new([None, Some("model")])),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`*.w`") && e.contains("`model`"), "{e}");
    // A leaf spec whose dim does not divide: named with the leaf, its type and the axis.
    let config = Config::new()
        .mesh(Mesh::new([("data", 2), ("model", 2)]).unwrap())
        .sharding(
            Sharding::fsdp("data").leaf("layers[1].w", PartitionSpec::new([None, Some("model")])),
        );
    if nitro::backend::pjrt::selected().unwrap().is_some() {
        let e = handle(
            mlp(Act::Tanh),
            config.clone().batch(8),
            partitioned(&config),
            own_cache(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("layers[1].w") && e.contains("f32[16,3]") && e.contains("`model`"),
            "{e}"
        );
    }
    // A leaf pattern that matches no trainable leaf.
    if nitro::backend::pjrt::selected().unwrap().is_some() {
        let config = Config::new()
            .mesh(Mesh::new([("data", 2)]).unwrap())
            .sharding(Sharding::fsdp("data").leaf("*.kernel", PartitionSpec::new([Some("data")])));
        let e = handle(
            mlp(Act::Tanh),
            config.clone().batch(8),
            partitioned(&config),
            own_cache(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("`*.kernel`")
                && e.contains("matches no trainable leaf")
                && e.contains("layers[0].w"),
            "{e}"
        );
    }
    // A batch that does not split across the mesh.
    if nitro::backend::pjrt::selected().unwrap().is_some() {
        let config = fsdp(4).batch(6);
        let e = handle(
            mlp(Act::Tanh),
            config.clone(),
            partitioned(&config),
            own_cache(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("multiple of 4"), "{e}");
    }
}

#[test]
fn a_mesh_sets_the_device_count_and_its_batch_axis_the_row_multiple() {
    let mesh = Mesh::new([("data", 4), ("model", 2)]).unwrap();
    let config = Config::new().mesh(mesh.clone());
    assert_eq!(config.device_count().unwrap(), 8);
    // The batch is split along the sharding's axis (the first by default): devices that
    // differ only along `model` share rows.
    assert_eq!(config.row_multiple().unwrap(), 4);
    let by_model = Config::new().mesh(mesh).sharding(Sharding::fsdp("model"));
    assert_eq!(by_model.row_multiple().unwrap(), 2);
    assert_eq!(Config::new().devices(3).row_multiple().unwrap(), 3);
    let unknown = Config::new()
        .mesh(Mesh::new([("data", 2)]).unwrap())
        .sharding(Sharding::fsdp("model"));
    assert!(matches!(
        unknown.row_multiple(),
        Err(nitro::Error::Sharding { .. })
    ));
}
