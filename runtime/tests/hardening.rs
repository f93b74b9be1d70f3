//! The training handle, checkpoints and data sets under bad input (issue 20): each case a clear
//! typed error, never an abort, a hang or a silently wrong number — or, where the input is
//! legitimate, the exact continuation.
#![allow(missing_docs)]

mod common;

use std::sync::mpsc;
use std::time::Duration;

use common::xla_or_skip;
use nitro::backend::{self, Backend};
use nitro::cache::Cache;
use nitro::checkpoint::Checkpoint;
use nitro::data::Dataset;
use nitro::optim::{Adam, AdamW, Momentum, Optimizer, Sgd};
use nitro::prelude::*;
use nitro::train::{Config, Model, Nitro};
use nitro::Error;

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

fn own_cache() -> &'static Cache {
    Box::leak(Box::new(Cache::in_memory(32)))
}

fn with_labels(rows: usize, seed: u64, bad_row: usize, label: i32) -> Dataset {
    let (x, mut y) = data(rows, seed);
    y[bad_row] = label;
    Dataset::new([
        ("x", Array::from_vec(&[rows, 4], x).unwrap()),
        ("y", Array::from_vec(&[rows], y).unwrap()),
    ])
    .unwrap()
}

fn run<O: Optimizer>(backend: &'static dyn Backend, o: O, config: Config) -> Nitro<Mlp, O> {
    Nitro::with_backend(mlp(Act::Tanh), o, config, backend, own_cache()).unwrap()
}

fn resume<O: Optimizer>(
    backend: &'static dyn Backend,
    o: O,
    config: Config,
    checkpoint: Checkpoint,
) -> nitro::Result<Nitro<Mlp, O>> {
    Nitro::resume_with(mlp(Act::Tanh), o, config, checkpoint, backend, own_cache())
}

/// A checkpoint through its bytes, as a file would carry it.
fn through_bytes(c: Checkpoint) -> Checkpoint {
    Checkpoint::from_bytes(&c.to_bytes().unwrap()).unwrap()
}

// ---- 1 and 3: optimizer state by name, the optimizer's identity ----

#[test]
fn optimizer_state_is_named_by_leaf_path_and_restored_by_name() {
    let b = backend::interpreter();
    let data = dataset(64, 1);
    let config = || Config::new().batch(16).lr(0.02).seed(4);
    let mut straight = run(b, Adam::default(), config());
    straight.train_epoch(&data, 0).unwrap();
    let taken = straight.checkpoint().unwrap();
    let names: Vec<&str> = taken.optimizer().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "m/layers[0].w",
            "m/layers[0].b",
            "m/layers[1].w",
            "m/layers[1].b",
            "v/layers[0].w",
            "v/layers[0].b",
            "v/layers[1].w",
            "v/layers[1].b"
        ]
    );
    straight.train_epoch(&data, 1).unwrap();
    let straight = straight.into_experiment().unwrap();

    // The same state listed in another order (v before m, leaves reversed): restored by name.
    let exp = {
        let mut e = mlp(Act::Tanh);
        taken.clone().restore_into(&mut e).unwrap();
        e
    };
    let reversed: Vec<(&str, &Array)> = taken
        .optimizer()
        .iter()
        .rev()
        .map(|(n, a)| (n.as_str(), a))
        .collect();
    let shuffled = Checkpoint::capture(&exp, &reversed, taken.step())
        .unwrap()
        .with_optimizer(&Adam::default())
        .with_position(1, 0);
    let mut resumed = resume(b, Adam::default(), config(), through_bytes(shuffled)).unwrap();
    resumed.train_epoch(&data, 1).unwrap();
    assert_eq!(
        leaves(&resumed.into_experiment().unwrap()),
        leaves(&straight)
    );
}

#[test]
fn resume_refuses_another_optimizer_naming_both() {
    let b = backend::interpreter();
    let data = dataset(32, 2);
    let config = || Config::new().batch(16);
    let mut adam = run(b, Adam::default(), config());
    adam.train_epoch(&data, 0).unwrap();
    let taken = adam.checkpoint().unwrap();

    let err = resume(b, AdamW::default(), config(), taken.clone()).unwrap_err();
    assert!(matches!(err, Error::CheckpointOptimizer { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("`adam`") && text.contains("`adamw`"),
        "{text}"
    );
    assert!(!text.contains("cannot capture"), "{text}");

    // Other constants of the same optimizer: refused, unless asked for.
    let retuned = Adam {
        beta2: 0.99,
        ..Adam::default()
    };
    let err = resume(b, retuned, config(), taken.clone()).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("constants differ"), "{text}");
    assert!(
        text.contains("beta2: 0.999") && text.contains("beta2: 0.99"),
        "{text}"
    );
    assert!(text.contains("allow_retuned_optimizer"), "{text}");
    let ok = resume(
        b,
        retuned,
        config(),
        taken.clone().allow_retuned_optimizer(),
    )
    .unwrap();
    assert_eq!(ok.steps(), 2);

    // Momentum and Nesterov keep the same slot, and are not the same optimizer.
    let mut momentum = run(b, Momentum::default(), config());
    momentum.train_epoch(&data, 0).unwrap();
    let taken = momentum.checkpoint().unwrap();
    let nesterov = Momentum {
        nesterov: true,
        ..Momentum::default()
    };
    let err = resume(b, nesterov, config(), taken.clone()).unwrap_err();
    assert!(err.to_string().contains("`nesterov`"), "{err}");
    // A retune opt-in does not turn one optimizer into another.
    let err = resume(b, nesterov, config(), taken.allow_retuned_optimizer()).unwrap_err();
    assert!(matches!(err, Error::CheckpointOptimizer { .. }), "{err}");
}

#[test]
fn a_state_array_that_does_not_fit_is_named_with_both_types() {
    let b = backend::interpreter();
    let e = mlp(Act::Tanh);
    let zeros = |dims: &[usize]| Array::zeros(DType::F32, dims);
    let (w0, b0, w1, b1) = (zeros(&[4, 16]), zeros(&[16]), zeros(&[16, 3]), zeros(&[3]));
    let wrong = zeros(&[16, 4]);
    let state = [
        ("velocity/layers[0].w", &wrong),
        ("velocity/layers[0].b", &b0),
        ("velocity/layers[1].w", &w1),
        ("velocity/layers[1].b", &b1),
    ];
    let c = Checkpoint::capture(&e, &state, 3)
        .unwrap()
        .with_optimizer(&Momentum::default());
    let err = resume(b, Momentum::default(), Config::new().batch(8), c).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("`velocity/layers[0].w`"), "{text}");
    assert!(
        text.contains("f32[16,4]") && text.contains("f32[4,16]"),
        "{text}"
    );
    drop(w0);
    // A missing one is named too.
    let c = Checkpoint::capture(&e, &state[1..], 3)
        .unwrap()
        .with_optimizer(&Momentum::default());
    let err = resume(b, Momentum::default(), Config::new().batch(8), c).unwrap_err();
    assert!(
        err.to_string()
            .contains("no optimizer state `velocity/layers[0].w`"),
        "{err}"
    );
}

// ---- 2: the loss's shape ----

/// A regression written the usual wrong way: a `[rows, 1]` loss.
#[experiment]
#[derive(Clone)]
struct Column {
    #[graph_const]
    scalar: bool,
    #[device(trainable)]
    w: Array,
}

impl Model for Column {
    type Batch = Batch;

    fn loss(v: &ColumnView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        let pred = b.x.matmul(v.w); // [rows, 1]
        let d = pred - b.x.slice(&[0, 0], &[b.x.dims()[0], 1]);
        let per_row = d * d;
        if *v.scalar {
            per_row.sum_all()
        } else {
            per_row
        }
    }
}

#[test]
fn a_loss_that_is_not_one_value_per_row_is_refused_at_trace_time() {
    let (x, y) = data(8, 3);
    for (scalar, got) in [(false, "f32[8,1]"), (true, "f32[]")] {
        let mut run = Nitro::with_backend(
            Column {
                scalar,
                w: Array::zeros(DType::F32, &[4, 1]),
            },
            Sgd,
            Config::new().batch(8),
            backend::interpreter(),
            own_cache(),
        )
        .unwrap();
        let err = run.step(&batch(&x, &y, 0, 8, 8), 8).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::Trace(_)), "{err:?}");
        assert!(text.contains("Model::loss"), "{text}");
        assert!(text.contains(got) && text.contains("[8]"), "{text}");
        assert_eq!(run.steps(), 0);
    }
}

// ---- 4: a checkpoint inside an accumulation window ----

#[test]
fn a_checkpoint_inside_an_accumulation_window_keeps_the_window() {
    let b = backend::interpreter();
    let (x, y) = data(32, 5);
    let config = || Config::new().batch(8).lr(0.05).accumulate(4);
    let micro = |i: usize| batch(&x, &y, 8 * i, 8, 8);
    let mut straight = run(b, Adam::default(), config());
    for i in 0..4 {
        straight.step(&micro(i), 8).unwrap();
    }
    assert_eq!(straight.steps(), 1, "one update after four micro-batches");
    let straight = straight.into_experiment().unwrap();

    let mut first = run(b, Adam::default(), config());
    for i in 0..2 {
        first.step(&micro(i), 8).unwrap();
    }
    let taken = through_bytes(first.checkpoint().unwrap());
    assert_eq!(taken.window().map(|w| w.micro_batches), Some(2));
    let mut resumed = resume(b, Adam::default(), config(), taken.clone()).unwrap();
    for i in 2..4 {
        resumed.step(&micro(i), 8).unwrap();
    }
    assert_eq!(resumed.steps(), 1);
    assert_eq!(
        leaves(&resumed.into_experiment().unwrap()),
        leaves(&straight)
    );

    // Resumed without accumulation, the window cannot be closed as it was opened.
    let err = resume(b, Adam::default(), Config::new().batch(8), taken).unwrap_err();
    assert!(err.to_string().contains("Config::accum"), "{err}");
}

// ---- 5: fit after resume continues ----

fn fit_continues_on(b: &'static dyn Backend) {
    let (train, val) = (dataset(90, 6), dataset(30, 7));
    let config = |epochs| {
        Config::new()
            .batch(16)
            .lr(0.03)
            .seed(11)
            .epochs(epochs)
            .progress(false)
    };
    let mut straight = run(b, Adam::default(), config(4));
    let full = straight.fit(&train, Some(&val)).unwrap();
    let straight = straight.into_experiment().unwrap();

    let mut first = run(b, Adam::default(), config(2));
    first.fit(&train, Some(&val)).unwrap();
    let taken = through_bytes(first.checkpoint().unwrap());
    assert_eq!((taken.epoch(), taken.epoch_batches()), (2, 0));
    let mut resumed = resume(b, Adam::default(), config(4), taken).unwrap();
    let rest = resumed.fit(&train, Some(&val)).unwrap();
    let numbers: Vec<usize> = rest.epochs.iter().map(|r| r.epoch).collect();
    assert_eq!(numbers, [3, 4], "the history continues the run's numbering");
    assert_eq!(rest.epochs[1].train_loss, full.epochs[3].train_loss);
    assert_eq!(rest.epochs[1].val_loss, full.epochs[3].val_loss);
    // Done: a further fit says so, and raising the count trains on.
    let err = resumed.fit(&train, None).unwrap_err();
    assert!(err.to_string().contains("set_epochs"), "{err}");
    assert_eq!(
        leaves(&resumed.into_experiment().unwrap()),
        leaves(&straight),
        "bit for bit"
    );
}

#[test]
fn fit_after_resume_continues_bit_for_bit_on_the_interpreter() {
    fit_continues_on(backend::interpreter());
}

#[test]
fn fit_after_resume_continues_bit_for_bit_on_xla() {
    if let Some(xla) = xla_or_skip("fit_after_resume_continues_bit_for_bit_on_xla") {
        fit_continues_on(xla);
    }
}

// ---- 6 and 9: empty data, a batch larger than the data ----

#[test]
fn empty_data_is_refused_naming_which() {
    let b = backend::interpreter();
    let empty = Dataset::new([
        ("x", Array::zeros(DType::F32, &[0, 4])),
        ("y", Array::zeros(DType::I32, &[0])),
    ])
    .unwrap();
    let good = dataset(32, 8);
    let mut r = run(b, Sgd, Config::new().batch(8).epochs(1));
    for (err, which) in [
        (r.fit(&empty, None).unwrap_err(), "the training data"),
        (
            r.fit(&good, Some(&empty)).unwrap_err(),
            "the validation data",
        ),
        (r.train_epoch(&empty, 0).unwrap_err(), "the training data"),
        (r.validate(&empty).unwrap_err(), "the validation data"),
    ] {
        assert!(
            matches!(err, Error::EmptyData { which: ref w } if w == which),
            "{err:?}"
        );
    }
    assert_eq!(r.steps(), 0);
}

#[test]
fn a_batch_larger_than_the_data_is_an_error_never_an_abort() {
    let b = backend::interpreter();
    let data = dataset(64, 9);
    for rows in [100_000_000, 1 << 40, usize::MAX] {
        let mut r = run(b, Sgd, Config::new().batch(rows).epochs(1));
        let err = r.fit(&data, None).unwrap_err();
        assert!(err.to_string().contains("Config::batch"), "{err}");
        // Validation pads a small set to the batch: a size no memory holds is a typed error.
        if rows > 100_000_000 {
            let err = r.validate(&data).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::OutOfMemory { .. } | Error::InvalidDataArgument { .. }
                ),
                "{err:?}"
            );
        }
    }
}

// ---- 7: labels outside the classes ----

fn labels_on(b: &'static dyn Backend) {
    for label in [7, 3, -1, i32::MAX] {
        let bad = with_labels(40, 10, 29, label);
        let mut r = run(b, Sgd, Config::new().batch(8).epochs(1).progress(false));
        let err = r.fit(&bad, None).unwrap_err();
        assert!(
            matches!(
                err,
                Error::LabelOutOfRange { ref column, row: 29, value, classes: 3 }
                    if column == "y" && value == i64::from(label)
            ),
            "label {label}: {err:?}"
        );
        let mut r = run(b, Sgd, Config::new().batch(8).epochs(1).progress(false));
        let err = r.fit(&dataset(40, 11), Some(&bad)).unwrap_err();
        assert!(
            matches!(err, Error::LabelOutOfRange { row: 29, .. }),
            "validation, label {label}: {err:?}"
        );
    }
    // A batch passed to `step` is checked too (naming the batch's row), and nothing ran.
    let (x, mut y) = data(8, 12);
    y[5] = 9;
    let mut r = run(b, Sgd, Config::new().batch(8));
    let err = r.step(&batch(&x, &y, 0, 8, 8), 8).unwrap_err();
    assert!(
        matches!(err, Error::LabelOutOfRange { row: 5, .. }),
        "{err:?}"
    );
    assert_eq!(r.steps(), 0);
    // A padding row is not a real row: its label is not checked.
    let (x, mut y) = data(8, 13);
    y[7] = -4;
    r.step(&batch(&x, &y, 0, 7, 8), 7).unwrap();
}

#[test]
fn labels_outside_the_classes_are_refused_naming_the_row_on_the_interpreter() {
    labels_on(backend::interpreter());
}

#[test]
fn labels_outside_the_classes_are_refused_naming_the_row_on_xla() {
    if let Some(xla) = xla_or_skip("labels_outside_the_classes_are_refused_naming_the_row_on_xla") {
        labels_on(xla);
    }
}

// ---- 8: the step counter ----

fn counter_on(b: &'static dyn Backend) {
    let e = mlp(Act::Tanh);
    let zeros = |a: &Array| Array::zeros(a.dtype(), a.dims());
    let state: Vec<(String, Array)> = ["velocity"]
        .iter()
        .flat_map(|slot| {
            e.layers.iter().enumerate().flat_map(move |(i, l)| {
                [
                    (format!("{slot}/layers[{i}].w"), zeros(&l.w)),
                    (format!("{slot}/layers[{i}].b"), zeros(&l.b)),
                ]
            })
        })
        .collect();
    let named: Vec<(&str, &Array)> = state.iter().map(|(n, a)| (n.as_str(), a)).collect();
    // Past 2^24 an f32 counter cannot count one more.
    let start = (1u64 << 24) + 5;
    let c = Checkpoint::capture(&e, &named, start)
        .unwrap()
        .with_optimizer(&Momentum::default());
    let mut r = resume(b, Momentum::default(), Config::new().batch(8), c).unwrap();
    let (x, y) = data(8, 14);
    for _ in 0..3 {
        r.step(&batch(&x, &y, 0, 8, 8), 8).unwrap();
    }
    assert_eq!(r.steps(), start + 3);
    assert_eq!(r.device_steps().unwrap(), start + 3, "exact on the device");

    // A step no counter holds is refused.
    let err = Checkpoint::capture(&e, &named, u64::MAX).unwrap_err();
    assert!(matches!(err, Error::CheckpointInput { .. }), "{err:?}");
}

#[test]
fn the_step_counter_is_exact_past_2_to_the_24_on_the_interpreter() {
    counter_on(backend::interpreter());
}

#[test]
fn the_step_counter_is_exact_past_2_to_the_24_on_xla() {
    if let Some(xla) = xla_or_skip("the_step_counter_is_exact_past_2_to_the_24_on_xla") {
        counter_on(xla);
    }
}

// ---- 10 and 12: what a checkpoint file is, and what a killed save leaves ----

struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "nitro-hardening-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `Checkpoint::load(path)` on another thread, failing the test if it has not returned within
/// a minute (a hang).
fn load_within_a_minute(path: std::path::PathBuf) -> nitro::Result<Checkpoint> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(Checkpoint::load(&path));
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("Checkpoint::load blocked")
}

#[test]
fn only_regular_files_are_read_and_only_as_far_as_their_header_says() {
    let dir = TempDir::new("special");
    #[cfg(unix)]
    {
        let fifo = dir.0.join("pipe.safetensors");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let err = load_within_a_minute(fifo).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        let err = load_within_a_minute("/dev/zero".into()).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
    }
    let err = load_within_a_minute(dir.0.clone()).unwrap_err();
    assert!(err.to_string().contains("a directory"), "{err}");

    // A header that claims more than the file holds, or a file longer than its header says.
    let good = Checkpoint::capture(&mlp(Act::Tanh), &[], 1)
        .unwrap()
        .to_bytes()
        .unwrap();
    let path = dir.0.join("c.safetensors");
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    std::fs::write(&path, &huge).unwrap();
    let err = load_within_a_minute(path.clone()).unwrap_err();
    assert!(matches!(err, Error::CheckpointCorrupt { .. }), "{err:?}");
    let mut longer = good.clone();
    longer.extend_from_slice(&[0; 64]);
    std::fs::write(&path, &longer).unwrap();
    let err = load_within_a_minute(path.clone()).unwrap_err();
    assert!(err.to_string().contains("the file holds"), "{err}");
    std::fs::write(&path, &good[..good.len() - 3]).unwrap();
    assert!(load_within_a_minute(path.clone()).is_err());
    std::fs::write(&path, &good).unwrap();
    assert_eq!(load_within_a_minute(path).unwrap().step(), 1);
}

#[test]
fn a_save_removes_what_killed_saves_left_and_names_the_path_given() {
    let dir = TempDir::new("temps");
    let dead = common::dead_pid();
    let me = std::process::id();
    let left = [
        format!("step-10.safetensors.tmp.{dead}.0"),
        format!("step-20.safetensors.tmp.{dead}.3"),
    ];
    let kept = [
        // A live writer's, and another tool's file of the same shape.
        format!("step-30.safetensors.tmp.{me}.999"),
        format!("notes.txt.tmp.{dead}.1"),
    ];
    for name in left.iter().chain(&kept) {
        std::fs::write(dir.0.join(name), b"half a checkpoint").unwrap();
    }
    let c = Checkpoint::capture(&mlp(Act::Tanh), &[], 2).unwrap();
    c.save(dir.0.join("step-40.safetensors")).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut expected: Vec<String> = kept.to_vec();
    expected.push("step-40.safetensors".into());
    expected.sort();
    assert_eq!(names, expected);

    // A failed save names the path the caller gave, with the temporary file in its message.
    let target = dir.0.join("no-such-dir").join("step-50.safetensors");
    let err = c.save(&target).unwrap_err();
    match &err {
        Error::CheckpointIo { path, .. } => assert_eq!(path, &target),
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains(".tmp."), "{err}");
}

// ---- 15: what a refused GraphConst change was ----

#[derive(ContentHash, Clone, Debug)]
struct Arch {
    hidden: usize,
    depth: usize,
}

#[experiment]
struct Shaped {
    #[graph_const]
    arch: Arch,
    #[device(trainable)]
    w: Array,
}

#[test]
fn a_refused_graph_const_change_shows_the_values() {
    let at = |hidden| Shaped {
        arch: Arch { hidden, depth: 2 },
        w: Array::zeros(DType::F32, &[2]),
    };
    let c = through_bytes(Checkpoint::capture(&at(128), &[], 0).unwrap());
    let err = c.restore_into(&mut at(64)).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("arch.hidden: 128 → 64"), "{text}");
    assert!(!text.contains("depth"), "only what differs: {text}");
}

// ---- 16: step figures that mean what they say ----

#[test]
fn an_epoch_reports_a_waited_step_and_the_pipelined_step() {
    let b = xla_or_skip("an_epoch_reports_a_waited_step_and_the_pipelined_step")
        .unwrap_or_else(|| backend::interpreter());
    let mut r = run(
        b,
        Adam::default(),
        Config::new().batch(8).epochs(2).progress(false),
    );
    let history = r.fit(&dataset(200, 15), None).unwrap();
    for e in &history.epochs {
        assert!(e.step_us_median > 0.0, "{e:?}");
        assert!(e.step_us_pipelined > 0.0, "{e:?}");
        // The pipelined figure covers every batch of the epoch: no more than the epoch took.
        assert!(e.step_us_pipelined * 25.0 <= e.seconds * 1e6, "{e:?}");
    }
}
