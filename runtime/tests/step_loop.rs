//! A loop of one's own over `Nitro::step` (issue 50, items 5 and 13): an error from a step
//! always means that step was not taken — a failed `Config::save_every` save is reported
//! before a step, never after one, and the save due at a step is started or reported as not
//! started — and the step calls record the position in the data, so a checkpoint taken in such
//! a loop resumes where it stopped.
#![allow(missing_docs)]

mod common;

#[path = "common/mlp.rs"]
mod mlp;

use common::{own_cache, TempDir};
use mlp::*;
use nitro::backend;
use nitro::checkpoint::{Checkpoint, Saved};
use nitro::data::Order;
use nitro::optim::Adam;
use nitro::train::{Config, FromBatch, Nitro};
use nitro::Error;

fn config() -> Config {
    Config::new().batch(8).lr(0.05).progress(false)
}

fn handle(config: Config) -> Nitro<Mlp, Adam> {
    Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        config,
        backend::interpreter(),
        own_cache(),
    )
    .unwrap()
}

#[test]
fn a_failed_save_every_never_fails_a_step_that_was_taken() {
    let dir = TempDir::new("step-loop-save-fail");
    // Its parent does not exist: every save fails on its own thread.
    let path = dir.path().join("missing").join("run");
    let (x, y) = data(8, 5);
    let b = batch(&x, &y, 0, 8, 8);
    let mut run = handle(config().save_every(1, &path));
    let (mut taken, mut failed, mut not_started) = (0u64, Vec::new(), Vec::new());
    for _ in 0..30 {
        let before = run.steps();
        match run.step(&b, 8) {
            Ok(r) => {
                assert!(r.loss.is_finite());
                taken += 1;
                assert_eq!(run.steps(), before + 1);
            }
            Err(e) => {
                // Not taken: the count did not move.
                assert_eq!(run.steps(), before, "{e}");
                match e {
                    Error::SaveNotStarted { step, source, .. } => {
                        assert_eq!(step, before, "the save due at the last step taken");
                        assert!(
                            matches!(*source, Error::CheckpointIo { .. }),
                            "the earlier save's failure: {source}"
                        );
                        not_started.push(step);
                    }
                    Error::CheckpointIo { .. } => failed.push(before),
                    other => panic!("an unexpected error: {other}"),
                }
            }
        }
    }
    assert_eq!(run.steps(), taken);
    assert!(taken >= 10, "{taken} of 30 steps taken");
    // Every taken step's save is accounted for: it failed and was reported (alone, or as
    // the cause of the next one not starting), or it was reported as not started, or it is
    // the one the next call reports.
    let accounted = |e: &Error| match e {
        Error::SaveNotStarted { .. } => 2,
        _ => 1,
    };
    let last = match run.wait_saved() {
        Ok(report) => {
            assert!(report.is_none(), "a save to a missing directory succeeded");
            0
        }
        Err(e) => accounted(&e),
    };
    assert_eq!(
        failed.len() + 2 * not_started.len() + last,
        taken as usize,
        "{} failed, {} not started, {last} at the end, {taken} steps",
        failed.len(),
        not_started.len()
    );
    assert!(
        !not_started.is_empty(),
        "a due save found the last one failed"
    );
    // Reported once: nothing is left.
    assert!(run.wait_saved().unwrap().is_none());
}

#[test]
fn a_step_loop_records_its_position_and_resumes_where_it_stopped() {
    let dir = TempDir::new("step-loop-position");
    std::fs::create_dir_all(dir.path()).unwrap();
    let data = dataset(64, 9);
    // The batches `train_epoch` takes in epoch 0, in its order.
    let plan = data
        .plan(
            8,
            Order::Shuffled {
                seed: config().seed,
            },
        )
        .unwrap();
    let order = plan.epoch(0);
    let epoch: Vec<(Batch, usize)> = order
        .spans()
        .map(|span| {
            let b = data.gather(span, 8).unwrap();
            let real = b.real_rows();
            (Batch::from_batch(b).unwrap(), real)
        })
        .collect();
    assert_eq!(epoch.len(), 8);

    // Uninterrupted: the whole epoch by `train_epoch`.
    let mut whole = handle(config());
    whole.train_epoch(&data, 0).unwrap();
    let want = leaves(&whole.into_experiment().unwrap());

    // Three batches by hand, then saved: the checkpoint says 3 batches of epoch 0.
    let mut run = handle(config());
    assert_eq!(run.begin_epoch(0), 0);
    for (b, real) in &epoch[..3] {
        run.step(b, *real).unwrap();
    }
    assert_eq!(run.epoch_batches(), 3);
    let path = dir.path().join("run");
    run.save(&path).unwrap();
    let saved = Checkpoint::load(&path).unwrap();
    assert_eq!((saved.epoch(), saved.epoch_batches()), (0, 3));
    drop(run);

    // Resumed, `train_epoch` continues after them, to the uninterrupted run's leaves.
    let resume = || {
        Nitro::resume_with(
            mlp(Act::Tanh),
            Adam::default(),
            config(),
            Saved::open(&path).unwrap(),
            backend::interpreter(),
            own_cache(),
        )
        .unwrap()
    };
    let mut resumed = resume();
    assert_eq!(resumed.epoch_batches(), 3);
    resumed.train_epoch(&data, 0).unwrap();
    assert_eq!(resumed.steps(), 8);
    assert_eq!(resumed.epochs_done(), 1);
    assert_eq!(leaves(&resumed.into_experiment().unwrap()), want);

    // And a loop of one's own resumes the same way through `begin_epoch`.
    let mut resumed = resume();
    let skip = resumed.begin_epoch(0) as usize;
    assert_eq!(skip, 3);
    for (b, real) in &epoch[skip..] {
        resumed.step(b, *real).unwrap();
    }
    resumed.end_epoch(0);
    assert_eq!((resumed.epochs_done(), resumed.epoch_batches()), (1, 0));
    assert_eq!(resumed.begin_epoch(1), 0);
    assert_eq!(leaves(&resumed.into_experiment().unwrap()), want);
}
