//! Saving while training goes on (`Nitro::save_in_background`, `Config::save_every`): the file
//! holds the state of the step the save started at whatever ran after it, a resume from it
//! continues exactly (position in the data included), a failed save is reported by the next
//! step, once, and a process killed while a save is being written leaves the previous
//! checkpoint whole.
#![allow(missing_docs)]

mod common;

use common::{xla_or_skip, TempDir};
use nitro::backend::{self, Backend};
use nitro::cache::Cache;
use nitro::checkpoint::Checkpoint;
use nitro::optim::Adam;
use nitro::prelude::*;
use nitro::train::{Config, Model, Nitro};

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

fn own_cache() -> &'static Cache {
    Box::leak(Box::new(Cache::in_memory(32)))
}

fn config() -> Config {
    Config::new().batch(8).lr(0.05).progress(false)
}

/// The small classifier under Adam on `backend`.
fn handle_on(backend: &'static dyn Backend) -> Nitro<Mlp, Adam> {
    Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        config(),
        backend,
        own_cache(),
    )
    .unwrap()
}

/// The batches of a short run: rows `8·i ..` of one data set.
fn batches(n: usize) -> Vec<Batch> {
    let (x, y) = data(8 * n, 71);
    (0..n).map(|i| batch(&x, &y, 8 * i, 8, 8)).collect()
}

fn a_background_save_holds_its_steps_state_on(backend: &'static dyn Backend) {
    let dir = TempDir::new("bg-save");
    std::fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join("run.safetensors");
    let b = batches(6);
    let mut run = handle_on(backend);
    for batch in &b[..3] {
        run.step(batch, 8).unwrap();
    }
    // The state the save takes, taken the ordinary way first.
    let at_three = run.checkpoint().unwrap();
    run.save_in_background(&path).unwrap();
    // Training goes on: the next update hands the save the buffers it replaces, and the file is
    // written while the steps run; their updates do not reach it.
    for batch in &b[3..] {
        run.step(batch, 8).unwrap();
    }
    // Waited for here, or already reaped by a step after it finished: the last save either way.
    let waited = run.wait_saved().unwrap();
    let report = run.last_save().cloned().expect("the save finished");
    assert!(waited.is_none() || waited.as_ref() == Some(&report));
    assert_eq!((report.step, report.path.as_path()), (3, path.as_path()));
    assert_eq!(report.bytes, std::fs::metadata(&path).unwrap().len());
    assert!(!run.saving());
    let saved = Checkpoint::load(&path).unwrap();
    assert_eq!(saved.step(), 3);
    assert_eq!(saved.device(), at_three.device());
    assert_eq!(saved.optimizer(), at_three.optimizer());
    assert_ne!(
        saved.device(),
        run.checkpoint().unwrap().device(),
        "the steps after the save trained on"
    );
    // Nothing more in flight.
    assert_eq!(run.wait_saved().unwrap(), None);
}

#[test]
fn a_background_save_holds_its_steps_state_while_training_goes_on() {
    a_background_save_holds_its_steps_state_on(backend::interpreter());
}

#[test]
fn a_background_save_on_xla_holds_its_steps_state_while_training_goes_on() {
    let Some(xla) =
        xla_or_skip("a_background_save_on_xla_holds_its_steps_state_while_training_goes_on")
    else {
        return;
    };
    a_background_save_holds_its_steps_state_on(xla);
}

/// `Config::save_every(2, ..)` over an epoch of 5 batches saves at steps 2 and 4 (the last
/// file is step 4's, taken after its batch was counted); a handle resumed from it trains the
/// epoch's last batch and ends where the uninterrupted run ended, bit for bit.
#[test]
fn saves_every_n_steps_in_the_background_and_a_resume_continues_exactly() {
    let dir = TempDir::new("bg-every");
    std::fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join("every.safetensors");
    let data = dataset(40, 72);
    let interp = backend::interpreter();
    let mut run = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        config().save_every(2, &path),
        interp,
        own_cache(),
    )
    .unwrap();
    run.train_epoch(&data, 0).unwrap();
    assert_eq!(run.steps(), 5);
    let last = run
        .wait_saved()
        .unwrap()
        .or_else(|| run.last_save().cloned());
    assert_eq!(last.map(|r| r.step), Some(4));
    let saved = Checkpoint::load(&path).unwrap();
    assert_eq!(
        (saved.step(), saved.epoch(), saved.epoch_batches()),
        (4, 0, 4)
    );

    let mut resumed = Nitro::resume_with(
        mlp(Act::Tanh),
        Adam::default(),
        config(),
        saved,
        interp,
        own_cache(),
    )
    .unwrap();
    resumed.train_epoch(&data, 0).unwrap();
    assert_eq!(resumed.steps(), 5);
    assert_eq!(
        leaves(resumed.experiment().unwrap()),
        leaves(run.experiment().unwrap())
    );
}

#[test]
fn a_failed_background_save_is_reported_by_the_next_step_once() {
    let dir = TempDir::new("bg-fail");
    let path = dir.path().join("missing-dir").join("run.safetensors");
    let b = batches(1).remove(0);
    let mut run = handle_on(backend::interpreter());
    run.step(&b, 8).unwrap();
    // Starting it succeeds: the write fails on its own thread.
    run.save_in_background(&path).unwrap();
    let mut reported = None;
    for _ in 0..2000 {
        match run.step(&b, 8) {
            Ok(_) => std::thread::sleep(std::time::Duration::from_millis(2)),
            Err(e) => {
                reported = Some(e);
                break;
            }
        }
    }
    let err = reported.expect("a step reports the failed save");
    assert!(
        matches!(&err, nitro::Error::CheckpointIo { path: p, .. } if p == &path),
        "{err}"
    );
    // Reported once: the handle trains on, with nothing in flight.
    assert!(!run.saving());
    run.step(&b, 8).unwrap();
    assert_eq!(run.wait_saved().unwrap(), None);
}

#[test]
fn save_every_zero_steps_is_refused() {
    let err = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        config().save_every(0, "never.safetensors"),
        backend::interpreter(),
        own_cache(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("Config::save_every"), "{err}");
}

/// One trainable leaf of 1M `f32` (with Adam's two slots, a 12 MB checkpoint): long enough to
/// write that a process can die while it is being written.
#[experiment]
#[derive(Clone)]
pub struct Big {
    #[device(trainable)]
    pub w: Array,
}

#[derive(Tree, Clone, Debug)]
pub struct Rows {
    pub x: Array,
}

impl Model for Big {
    type Batch = Rows;

    fn loss(v: &BigView<'_>, b: &RowsMirror<Tensor>) -> Tensor {
        b.x.sum(&[1]) * (v.w * v.w).mean(&[0])
    }
}

const CHILD: &str = "NITRO_TEST_BACKGROUND_SAVE_CHILD";

/// In the child: a checkpoint of step 1 saved the ordinary way, then a background save of
/// step 2 to the same path — and the process aborted while it is being written.
fn child(path: &std::path::Path) -> ! {
    let big = Big {
        w: Array::full(&[1 << 20], 0.5f32),
    };
    let rows = Rows {
        x: Array::full(&[2, 1], 1.0f32),
    };
    let mut run = Nitro::with_backend(
        big,
        Adam::default(),
        Config::new().batch(2).lr(0.01).progress(false),
        backend::interpreter(),
        own_cache(),
    )
    .unwrap();
    run.step(&rows, 2).unwrap();
    run.checkpoint().unwrap().save(path).unwrap();
    run.step(&rows, 2).unwrap();
    run.save_in_background(path).unwrap();
    // The next update hands the save step 2's state; training goes on.
    run.step(&rows, 2).unwrap();
    // Dies as soon as the writer's temporary file is there: mid-write.
    let dir = path.parent().unwrap();
    for _ in 0..20_000 {
        if temporary_files(dir) > 0 {
            std::process::abort();
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
    std::process::abort();
}

/// How many temporary files of checkpoint writes `dir` holds.
fn temporary_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().contains(".tmp."))
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn a_process_killed_while_saving_in_the_background_leaves_the_previous_checkpoint_whole() {
    if let Ok(path) = std::env::var(CHILD) {
        child(std::path::Path::new(&path));
    }
    let dir = TempDir::new("bg-kill");
    std::fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join("big.safetensors");
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "a_process_killed_while_saving_in_the_background_leaves_the_previous_checkpoint_whole",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, &path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "the child aborts");
    // It died mid-write (the writer's temporary file is left): the file at the path is the
    // previous checkpoint, whole. (Had the rename won the race with the abort, by microseconds,
    // it would be the new one, whole.)
    let saved = Checkpoint::load(&path).expect("a whole checkpoint at the path");
    match temporary_files(dir.path()) {
        1 => assert_eq!(saved.step(), 1, "killed while writing: the previous file"),
        0 => assert_eq!(saved.step(), 2, "written before the abort: the new file"),
        n => panic!("{n} temporary files"),
    }
    assert_eq!(saved.device()[0].1.dims(), &[1 << 20]);
    // The next save into the directory sweeps what the killed one left.
    saved.save(&path).unwrap();
    assert_eq!(temporary_files(dir.path()), 0);
}

/// A save asked for after the last step gets the state when nothing else will come: from
/// `wait_saved` (host copies), or from the handle's drop (its buffers), which waits for the file.
#[test]
fn a_save_after_the_last_step_is_written_by_wait_saved_or_by_the_drop() {
    let dir = TempDir::new("bg-last");
    std::fs::create_dir_all(dir.path()).unwrap();
    let b = batches(2);
    let make = || {
        let mut run = handle_on(backend::interpreter());
        for batch in &b {
            run.step(batch, 8).unwrap();
        }
        run
    };
    let waited = dir.path().join("waited.safetensors");
    let mut run = make();
    let want = run.checkpoint().unwrap();
    run.save_in_background(&waited).unwrap();
    assert!(run.saving());
    let report = run.wait_saved().unwrap().expect("the save in flight");
    assert_eq!(report.step, 2);
    assert_eq!(Checkpoint::load(&waited).unwrap().device(), want.device());

    let dropped = dir.path().join("dropped.safetensors");
    let mut run = make();
    run.save_in_background(&dropped).unwrap();
    drop(run);
    let saved = Checkpoint::load(&dropped).expect("written before the drop returned");
    assert_eq!(saved.step(), 2);
    assert_eq!(saved.device(), want.device());
    assert_eq!(saved.optimizer(), want.optimizer());
}
