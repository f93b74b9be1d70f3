//! Cached stages: a frozen random-feature encoder in front of a trainable linear head. Later
//! epochs run the stage zero times and train the same head as an uncached run (bit for bit on
//! the interpreter); what the key names misses when it changes, what it does not name hits; a
//! fresh handle on the same store reuses stored outputs; corrupt entries are computed again.
#![allow(missing_docs)]

mod common;

#[path = "common/mlp.rs"]
mod mlp;
use mlp::dataset;

use std::sync::Arc;

use common::TempDir;
use nitro::backend::{self, Backend};
use nitro::cache::{Cache, DirStore};
use nitro::data::{BatchMirror, Dataset};
use nitro::init::{self, Seed};
use nitro::optim::{Adam, Optimizer, Sgd};
use nitro::prelude::*;
use nitro::stage::{ChunkFate, Stage, StagePass};
use nitro::trace::nn;
use nitro::train::{Config, Model, Nitro};
use nitro::Error;

/// The probe: `MODE` picks how the stage is written (0 and 1 compute the same thing through
/// differently named helpers; 2 computes something else); `CACHED` whether it is cached.
#[experiment]
pub struct Probe<const CACHED: bool, const MODE: u8> {
    /// Scales the features (shapes the stage's program: a constant in it).
    #[graph_const]
    pub gain: u32,
    #[device(frozen)]
    pub encoder: Array,
    #[device(trainable)]
    pub head: Array,
}

fn squash(t: Tensor) -> Tensor {
    t.tanh()
}

fn squash_renamed(t: Tensor) -> Tensor {
    t.tanh()
}

impl<const CACHED: bool, const MODE: u8> Stage for Probe<CACHED, MODE> {
    const NAME: &'static str = "encode";
    const INPUT: &'static str = "x";
    const OUTPUT: &'static str = "features";
    const CACHED: bool = CACHED;
    type Output = Tensor;

    fn run(v: &ProbeFrozenView<'_, CACHED, MODE>, x: &Tensor) -> Tensor {
        let z = x.matmul(v.encoder) * f64::from(*v.gain);
        match MODE {
            0 => squash(z),
            1 => squash_renamed(z),
            // Reads a value it makes itself, which nitro neither supplies nor names.
            3 => z + nitro::trace::input("bias", z.ty()),
            // One output row per encoder row, not per input row.
            4 => v.encoder.tanh(),
            _ => z.relu(),
        }
    }
}

impl<const CACHED: bool, const MODE: u8> Model for Probe<CACHED, MODE> {
    type Batch = nitro::data::Batch;

    fn loss(v: &ProbeView<'_, CACHED, MODE>, b: &BatchMirror<Tensor>) -> Tensor {
        let (f, y) = (
            *b.get("features").expect("features"),
            *b.get("y").expect("y"),
        );
        nn::softmax_cross_entropy(f.matmul(v.head), y)
    }
}

const FEATURES: usize = 16;

fn probe<const C: bool, const M: u8>(encoder_seed: u64, gain: u32) -> Probe<C, M> {
    Probe {
        gain,
        encoder: init::normal(&[4, FEATURES], 0.0, 1.0, Seed(encoder_seed)),
        head: Array::zeros(DType::F32, &[FEATURES, 3]),
    }
}

fn store_cache(dir: &TempDir) -> &'static Cache {
    let store = DirStore::open(dir.path(), 1 << 30, None).expect("store");
    Box::leak(Box::new(Cache::new(16, Some(Arc::new(store)))))
}

fn handle<const C: bool, const M: u8, O: Optimizer>(
    e: Probe<C, M>,
    o: O,
    cache: &'static Cache,
    backend: &'static dyn Backend,
    epochs: usize,
) -> Nitro<Probe<C, M>, O> {
    let config = Config::new()
        .batch(16)
        .lr(0.05)
        .epochs(epochs)
        .seed(3)
        .progress(false);
    Nitro::with_backend(e, o, config, backend, cache).expect("handle")
}

fn fates(pass: &StagePass) -> (usize, usize, usize) {
    (
        pass.count(ChunkFate::Computed),
        pass.count(ChunkFate::Loaded),
        pass.count(ChunkFate::Spared),
    )
}

fn head_after_fit<const C: bool>(backend: &'static dyn Backend) -> (Array, u64, u64) {
    let dir = TempDir::new("stage-fit");
    let split = dataset(100, 1).split(0.8, 7).unwrap();
    let mut run = handle(
        probe::<C, 0>(5, 2),
        Adam::default(),
        store_cache(&dir),
        backend,
        3,
    );
    let history = run
        .fit_staged(&split.train, Some(&split.validation))
        .unwrap();
    assert_eq!(history.epochs.len(), 3);
    let stats = run.stage_stats();
    // A fresh store: nothing found in it; later epochs find every chunk held.
    assert_eq!((stats.hits, stats.misses), (0, stats.executions));
    let head = run.into_experiment().unwrap().head;
    (head, stats.executions, stats.spared)
}

#[test]
fn later_epochs_run_no_stage_and_train_the_head_of_an_uncached_run_bit_for_bit() {
    // 80 training rows and 20 validation rows: 5 + 2 chunks of 16.
    let (cached, runs, spared) = head_after_fit::<true>(backend::interpreter());
    assert_eq!(
        runs, 7,
        "epoch 1 runs the stage once per chunk, later epochs never"
    );
    assert_eq!(spared, 14, "epochs 2 and 3 spare every chunk");
    let (uncached, runs, spared) = head_after_fit::<false>(backend::interpreter());
    assert_eq!(runs, 21, "uncached, every epoch runs every chunk");
    assert_eq!(spared, 0);
    assert_eq!(
        cached, uncached,
        "the head trained on restored outputs is the same"
    );
}

#[test]
fn later_epochs_run_no_stage_on_xla() {
    let Some(xla) = common::xla_or_skip("later_epochs_run_no_stage_on_xla") else {
        return;
    };
    let (_, runs, spared) = head_after_fit::<true>(xla);
    assert_eq!((runs, spared), (7, 14));
}

/// One pre-pass of `e` over `data` on a fresh handle (a fresh process's view: nothing held).
fn pass<const M: u8>(
    e: Probe<true, M>,
    data: &Dataset,
    cache: &'static Cache,
) -> (usize, usize, usize) {
    let mut run = handle(e, Sgd, cache, backend::interpreter(), 1);
    let (staged, pass) = run.stage_pass(data).unwrap();
    assert_eq!(
        staged.column("features").unwrap().dims(),
        &[data.rows(), FEATURES]
    );
    fates(&pass)
}

#[test]
fn what_the_key_names_misses_and_what_it_does_not_name_hits() {
    let dir = TempDir::new("stage-keys");
    let cache = store_cache(&dir);
    let data = dataset(40, 2); // 3 chunks: 16, 16, 8
    assert_eq!(pass(probe::<true, 0>(5, 2), &data, cache), (3, 0, 0));
    // A fresh handle (as in a new process) loads every stored output.
    assert_eq!(pass(probe::<true, 0>(5, 2), &data, cache), (0, 3, 0));
    // A helper renamed: the same emitted program, so the same keys.
    assert_eq!(pass(probe::<true, 1>(5, 2), &data, cache), (0, 3, 0));
    // The stage computes something else: another program, new keys.
    assert_eq!(pass(probe::<true, 2>(5, 2), &data, cache), (3, 0, 0));
    // Other frozen weights.
    assert_eq!(pass(probe::<true, 0>(6, 2), &data, cache), (3, 0, 0));
    // Another GraphConst value.
    assert_eq!(pass(probe::<true, 0>(5, 3), &data, cache), (3, 0, 0));
    // Another data set.
    assert_eq!(
        pass(probe::<true, 0>(5, 2), &dataset(40, 9), cache),
        (3, 0, 0)
    );
    // Another split of the same data, or the same split with another seed.
    let full = dataset(50, 4);
    let a = full.split(0.8, 1).unwrap().train;
    let b = full.split(0.8, 2).unwrap().train;
    assert_eq!(pass(probe::<true, 0>(5, 2), &a, cache), (3, 0, 0));
    assert_eq!(pass(probe::<true, 0>(5, 2), &b, cache), (3, 0, 0));
    assert_eq!(pass(probe::<true, 0>(5, 2), &a, cache), (0, 3, 0));
    // The head's hyper-parameters (optimizer, learning rate, epochs) are not in the key.
    let mut run = Nitro::with_backend(
        probe::<true, 0>(5, 2),
        Adam::default(),
        Config::new().batch(16).lr(0.3).epochs(9).progress(false),
        backend::interpreter(),
        cache,
    )
    .unwrap();
    let (first, p) = run.stage_pass(&data).unwrap();
    assert_eq!(fates(&p), (0, 3, 0));
    // Within a handle, a second pass spares every chunk (and makes the same data set).
    let (second, p) = run.stage_pass(&data).unwrap();
    assert_eq!(fates(&p), (0, 0, 3));
    assert_eq!(first, second);
    let stats = run.stage_stats();
    assert_eq!(
        (stats.executions, stats.compiles),
        (0, 0),
        "nothing missing: no compile"
    );
    // Hits are outputs found in the store; spared, chunks not run (found stored or held).
    assert_eq!((stats.hits, stats.misses, stats.spared), (3, 0, 6));
    assert!(
        stats.saved_ms > 0.0,
        "loaded outputs carry what computing them took"
    );
}

#[test]
fn corrupt_stored_outputs_are_computed_again() {
    let dir = TempDir::new("stage-corrupt");
    let data = dataset(40, 3);
    assert_eq!(
        pass(probe::<true, 0>(5, 2), &data, store_cache(&dir)),
        (3, 0, 0)
    );
    let mut corrupted = 0;
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "entry") {
            let mut bytes = std::fs::read(&path).unwrap();
            let last = bytes.len() - 1;
            bytes[last] ^= 0xff;
            std::fs::write(&path, bytes).unwrap();
            corrupted += 1;
        }
    }
    assert_eq!(corrupted, 3);
    // A fresh handle and cache: every entry fails its checksum, is dropped and recomputed.
    assert_eq!(
        pass(probe::<true, 0>(5, 2), &data, store_cache(&dir)),
        (3, 0, 0)
    );
    assert_eq!(
        pass(probe::<true, 0>(5, 2), &data, store_cache(&dir)),
        (0, 3, 0)
    );
}

#[test]
fn a_data_set_without_the_input_column_is_a_typed_error() {
    let data = Dataset::new([("z", Array::zeros(DType::F32, &[8, 4]))]).unwrap();
    let mut run = handle(
        probe::<true, 0>(5, 2),
        Sgd,
        Box::leak(Box::new(Cache::in_memory(4))),
        backend::interpreter(),
        1,
    );
    let err = run.stage_pass(&data).unwrap_err();
    assert!(
        matches!(err, Error::DatasetColumn { ref column, .. } if column == "x"),
        "{err}"
    );
}

/// Stage outputs live in the same store as compiled programs: behind a local directory, a
/// shared Redis server hands a fresh machine (an empty local directory) every output another
/// machine computed.
#[test]
fn a_fresh_machine_loads_stage_outputs_from_the_shared_server() {
    use nitro::cache::{LayeredStore, RedisStore, RemoteConfig};
    let Some(url) =
        common::redis_or_skip("a_fresh_machine_loads_stage_outputs_from_the_shared_server")
    else {
        return;
    };
    let namespace = common::namespace("stage");
    let key = [7u8; 32];
    let machine = |dir: &TempDir| -> &'static Cache {
        let mut config = RemoteConfig::new(&url);
        config.prefix = namespace.clone();
        config.timeout = std::time::Duration::from_secs(10);
        let remote = RedisStore::open(config, Some(key)).expect("the shared store opens");
        let local = DirStore::open(dir.path(), 1 << 30, Some(key)).expect("the local store");
        let store = LayeredStore::new(local, remote).expect("same keys");
        Box::leak(Box::new(Cache::new(16, Some(Arc::new(store)))))
    };
    let (first, second) = (TempDir::new("stage-first"), TempDir::new("stage-second"));
    let data = dataset(40, 6);
    assert_eq!(
        pass(probe::<true, 0>(5, 2), &data, machine(&first)),
        (3, 0, 0)
    );
    assert_eq!(
        pass(probe::<true, 0>(5, 2), &data, machine(&second)),
        (0, 3, 0)
    );
}

/// A handle on several devices runs its stage on one device and trains the head on all of
/// them; the keys do not depend on the device count, so a one-device handle reuses its outputs.
#[test]
fn a_handle_on_two_devices_runs_its_stage_on_one_and_shares_the_outputs() {
    let dir = TempDir::new("stage-devices");
    let cache = store_cache(&dir);
    let data = dataset(40, 8);
    let config = Config::new().batch(16).epochs(2).devices(2).progress(false);
    let mut run = Nitro::with_backend(
        probe::<true, 0>(5, 2),
        Sgd,
        config,
        backend::interpreter_for(2),
        cache,
    )
    .unwrap();
    let (_, p) = run.stage_pass(&data).unwrap();
    assert_eq!(fates(&p), (3, 0, 0));
    run.fit_staged(&data, None).unwrap();
    assert_eq!(
        run.stage_stats().executions,
        3,
        "fit ran no stage: all held"
    );
    assert_eq!(pass(probe::<true, 0>(5, 2), &data, cache), (0, 3, 0));
}

fn unnamed(data: &Dataset) -> Dataset {
    Dataset::unnamed(data.clone().into_columns()).unwrap()
}

/// A cached stage names its outputs by the data set's digest: data without one is refused,
/// naming which data, before anything runs; an uncached stage takes it.
#[test]
fn a_data_set_without_a_digest_is_refused_by_a_cached_stage_before_anything_runs() {
    let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(8)));
    let split = dataset(60, 5).split(0.8, 3).unwrap();
    let (train, validation) = (unnamed(&split.train), unnamed(&split.validation));
    let mut run = handle(
        probe::<true, 0>(5, 2),
        Sgd,
        cache,
        backend::interpreter(),
        2,
    );
    let refusals = [
        (
            run.fit_staged(&train, Some(&split.validation)),
            "the training data",
        ),
        (
            run.fit_staged(&split.train, Some(&validation)),
            "the validation data",
        ),
        (
            run.stage_pass(&train).map(|_| Default::default()),
            "the data passed to stage_pass",
        ),
    ];
    for (outcome, which) in refusals {
        let err = outcome.unwrap_err();
        assert!(
            matches!(err, Error::Nameless { ref stage, ref data } if stage == "encode" && data == which),
            "{err}"
        );
        assert!(err.to_string().contains("Dataset::into_named"), "{err}");
    }
    let stats = run.stage_stats();
    assert_eq!((stats.executions, stats.compiles, stats.misses), (0, 0, 0));
    assert_eq!(run.steps(), 0, "no epoch started");

    // Named when needed, it runs; an uncached stage needs no name.
    run.fit_staged(&train.clone().into_named(), None).unwrap();
    let mut uncached = handle(
        probe::<false, 0>(5, 2),
        Sgd,
        cache,
        backend::interpreter(),
        2,
    );
    let history = uncached.fit_staged(&train, Some(&validation)).unwrap();
    assert_eq!(history.epochs.len(), 2);
    let (staged, _) = uncached.stage_pass(&train).unwrap();
    assert_eq!(staged.digest(), None, "made from unnamed data, unnamed");
}

/// The refusal of a pre-pass by the probe written as `MODE`, before it ran for any chunk.
fn refusal<const MODE: u8>() -> Error {
    let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(8)));
    let mut run = handle(
        probe::<true, MODE>(5, 2),
        Sgd,
        cache,
        backend::interpreter(),
        1,
    );
    let err = run.stage_pass(&dataset(20, 1)).unwrap_err();
    assert_eq!(run.stage_stats().executions, 0, "{err}");
    err
}

/// A stage that makes a program input of its own reads something that is neither frozen nor
/// its data: refused at its trace, naming the input.
#[test]
fn a_stage_reading_an_input_it_made_itself_is_unsettled() {
    let err = refusal::<3>();
    assert!(
        matches!(err, Error::Unsettled { ref input, ref column, .. } if input == "bias" && column == "x"),
        "{err}"
    );
}

/// A stage returns one row per input row; anything else is refused at its trace.
#[test]
fn a_stage_output_without_a_row_per_input_row_is_a_typed_error() {
    let err = refusal::<4>();
    assert!(
        matches!(err, Error::StageOutputRows { rows: 16, ref output, .. } if output == "f32[4,16]"),
        "{err}"
    );
}

// ---- issue 42, item 5: stages on a mesh ----

/// The head trained by `fit_staged` (3 epochs) on a handle over `mesh`, split as `sharding`
/// says (`None`: replicated), and the stage's executions and spared chunks.
fn head_on_mesh(
    mesh: nitro::shard::Mesh,
    sharding: Option<nitro::shard::Sharding>,
) -> (Array, u64, u64) {
    let dir = TempDir::new("stage-mesh");
    let split = dataset(100, 1).split(0.8, 7).unwrap();
    let mut config = Config::new()
        .batch(16)
        .lr(0.05)
        .epochs(3)
        .seed(3)
        .progress(false)
        .mesh(mesh);
    if let Some(s) = sharding {
        config = config.sharding(s);
    }
    let backend = backend::for_mesh(&config.partitioning().unwrap().unwrap()).unwrap();
    let mut run = Nitro::with_backend(
        probe::<true, 0>(5, 2),
        Adam::default(),
        config,
        backend,
        store_cache(&dir),
    )
    .unwrap();
    run.fit_staged(&split.train, Some(&split.validation))
        .unwrap();
    let stats = run.stage_stats();
    (
        run.into_experiment().unwrap().head,
        stats.executions,
        stats.spared,
    )
}

/// A cached stage under FSDP and under a replicated mesh: the stage runs once per chunk (on
/// one device: its program and outputs do not depend on the mesh, so their keys do not name
/// it), later epochs spare every chunk, and the head trains to the one-device run's values.
#[test]
fn a_cached_stage_under_fsdp_and_replication_trains_the_one_device_head() {
    let test = "a_cached_stage_under_fsdp_and_replication_trains_the_one_device_head";
    let Some(one) = common::xla_devices_or_skip(test, 1) else {
        return;
    };
    common::xla_devices_or_skip(test, 2).expect("2 devices");
    let (want, _, _) = head_after_fit::<true>(one);
    let want = want.as_slice::<f32>().unwrap().to_vec();
    let mesh = || nitro::shard::Mesh::new([("data", 2)]).unwrap();
    for (what, sharding) in [
        ("fsdp", Some(nitro::shard::Sharding::fsdp("data"))),
        ("replicated", None),
    ] {
        let (head, runs, spared) = head_on_mesh(mesh(), sharding);
        assert_eq!(
            (runs, spared),
            (7, 14),
            "{what}: the stage ran once per chunk"
        );
        for (i, (g, w)) in head
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .zip(&want)
            .enumerate()
        {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{what}: head[{i}] {g} vs one device {w}"
            );
        }
    }
}

/// Stage outputs stored by a handle over a mesh are the ones a one-device handle finds: the
/// keys name the stage's program, frozen state and data, never the mesh.
#[test]
fn stage_outputs_stored_under_fsdp_load_on_one_device() {
    let test = "stage_outputs_stored_under_fsdp_load_on_one_device";
    if common::xla_devices_or_skip(test, 2).is_none() {
        return;
    }
    let dir = TempDir::new("stage-mesh-keys");
    let cache = store_cache(&dir);
    let data = dataset(40, 9);
    let config = Config::new()
        .batch(16)
        .progress(false)
        .mesh(nitro::shard::Mesh::new([("data", 2)]).unwrap())
        .sharding(nitro::shard::Sharding::fsdp("data"));
    let backend = backend::for_mesh(&config.partitioning().unwrap().unwrap()).unwrap();
    let mut run = Nitro::with_backend(probe::<true, 0>(5, 2), Sgd, config, backend, cache).unwrap();
    let (_, p) = run.stage_pass(&data).unwrap();
    assert_eq!(fates(&p), (3, 0, 0));
    assert_eq!(pass(probe::<true, 0>(5, 2), &data, cache), (0, 3, 0));
}
