//! The run's progress: where training stands — steps, the position in the data, the open
//! accumulation window, the losses not read yet, the random stream, and the timings. What a
//! checkpoint saves of the run and a resume restores.

use std::time::{Duration, Instant};

use super::values::Value;
use super::EpochTimings;
use crate::checkpoint::RandomStream;
use crate::error::Result;

/// The run's progress (see the [module docs](self)).
pub(super) struct Progress {
    /// Optimizer steps taken.
    step: u64,
    /// Epochs completed, and batches of the next epoch trained: where `fit` continues.
    epoch: u64,
    epoch_batches: u64,
    /// The random stream of a model that draws random numbers.
    random: RandomStream,
    /// Losses of steps taken, not read yet (on the devices).
    pending_losses: Vec<Value>,
    /// The open gradient-accumulation window.
    window: Window,
    /// The current epoch's timings.
    timings: EpochTimings,
    /// When the handle was made, and how long after that the first step finished.
    created: Instant,
    first_step: Option<Duration>,
    /// The gradient and update programs' first runs, each waited for alone, then their
    /// second ([`FirstRuns`]).
    runs: Vec<(Duration, Duration)>,
}

/// The training programs' first two runs, each waited for alone ([`Nitro::first_runs`]): what
/// the first run costs beyond a later one — the lazy set-up a backend does at a program's
/// first execute — per program.
///
/// [`Nitro::first_runs`]: super::Nitro::first_runs
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FirstRuns {
    /// The gradient program's first run.
    pub grad: Duration,
    /// The update program's first run.
    pub update: Duration,
    /// The gradient program's second run, once there was one.
    pub second_grad: Option<Duration>,
    /// The update program's second run, once there was one.
    pub second_update: Option<Duration>,
}

impl FirstRuns {
    /// The first runs' excess over the second ones, gradient and update (zero where the
    /// first was not slower); `None` before a second step.
    pub fn excess(&self) -> Option<(Duration, Duration)> {
        Some((
            self.grad.saturating_sub(self.second_grad?),
            self.update.saturating_sub(self.second_update?),
        ))
    }
}

/// A gradient-accumulation window: the gradient sums so far (on the devices), how many
/// micro-batches and real rows (their weight) it has seen.
#[derive(Default)]
pub(super) struct Window {
    pub(super) sums: Option<Vec<Value>>,
    pub(super) micro_batches: usize,
    pub(super) rows: f64,
}

impl Progress {
    /// A run at its start, its random stream from `seed`.
    pub(super) fn new(seed: u64) -> Progress {
        Progress {
            step: 0,
            epoch: 0,
            epoch_batches: 0,
            random: RandomStream::new(seed),
            pending_losses: Vec::new(),
            window: Window::default(),
            timings: EpochTimings::default(),
            created: Instant::now(),
            first_step: None,
            runs: Vec::new(),
        }
    }

    /// A run continuing a checkpoint's: its step, position and random stream.
    pub(super) fn resume(
        &mut self,
        step: u64,
        epoch: u64,
        epoch_batches: u64,
        random: Option<RandomStream>,
    ) {
        self.step = step;
        self.epoch = epoch;
        self.epoch_batches = epoch_batches;
        if let Some(r) = random {
            self.random = r;
        }
    }

    /// Optimizer steps taken.
    pub(super) fn step(&self) -> u64 {
        self.step
    }

    /// Epochs completed.
    pub(super) fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches of the current epoch trained.
    pub(super) fn epoch_batches(&self) -> u64 {
        self.epoch_batches
    }

    /// The random stream.
    pub(super) fn random(&self) -> RandomStream {
        self.random
    }

    /// The next draw's key.
    pub(super) fn next_key(&self) -> [u32; 2] {
        self.random.next_key()
    }

    /// A draw was made (its program ran).
    pub(super) fn drew(&mut self) {
        self.random.draws += 1;
    }

    /// Starts (or continues) epoch `epoch`: how many of its batches are trained already —
    /// those of the epoch the run is in the middle of, none of another. Its timings restart.
    pub(super) fn start_epoch(&mut self, epoch: u64) -> u64 {
        self.timings = EpochTimings::default();
        if epoch == self.epoch {
            return self.epoch_batches;
        }
        self.epoch = epoch;
        self.epoch_batches = 0;
        0
    }

    /// One more batch of the current epoch trained.
    pub(super) fn batch_done(&mut self) {
        self.epoch_batches += 1;
    }

    /// Epoch `epoch` completed by a loop of the caller's (no timings).
    pub(super) fn close_epoch(&mut self, epoch: u64) {
        self.epoch = epoch + 1;
        self.epoch_batches = 0;
    }

    /// Epoch `epoch` completed, after `batches` batches in `wall` time.
    pub(super) fn end_epoch(&mut self, epoch: u64, batches: usize, wall: Duration) {
        self.epoch = epoch + 1;
        self.epoch_batches = 0;
        self.timings.wall = wall;
        self.timings.batches = batches;
    }

    /// A step timed alone took `took` (`saving`: while a background save was being written).
    pub(super) fn timed(&mut self, took: Duration, saving: bool) {
        match saving {
            true => self.timings.waited_saving.push(took),
            false => self.timings.waited.push(took),
        }
    }

    /// The current (or last) epoch's timings.
    pub(super) fn timings(&self) -> &EpochTimings {
        &self.timings
    }

    /// One optimizer step taken; true when it is the first (whose time is taken once it has
    /// finished: [`first_step_done`](Self::first_step_done)).
    pub(super) fn stepped(&mut self) -> bool {
        self.step += 1;
        self.first_step.is_none()
    }

    /// The first step has finished: its time since the handle was made.
    pub(super) fn first_step_done(&mut self) {
        self.first_step = Some(self.created.elapsed());
    }

    /// Whether the coming step's programs are to be timed alone: the first two runs.
    pub(super) fn times_runs(&self) -> bool {
        self.runs.len() < 2
    }

    /// Records a step's gradient and update runs, timed alone.
    pub(super) fn record_runs(&mut self, grad: Duration, update: Duration) {
        self.runs.push((grad, update));
    }

    /// The first runs, once there was one.
    pub(super) fn first_runs(&self) -> Option<FirstRuns> {
        let &(grad, update) = self.runs.first()?;
        let second = self.runs.get(1);
        Some(FirstRuns {
            grad,
            update,
            second_grad: second.map(|r| r.0),
            second_update: second.map(|r| r.1),
        })
    }

    /// How long after the handle was made the first step finished.
    pub(super) fn first_step(&self) -> Option<Duration> {
        self.first_step
    }

    /// A step's loss, still on the devices.
    pub(super) fn push_loss(&mut self, loss: Value) {
        self.pending_losses.push(loss);
    }

    /// The losses of the steps taken since the last call, read to the host, in order. The
    /// caller waits for the steps first.
    pub(super) fn take_losses(&mut self) -> Result<Vec<f64>> {
        let pending = std::mem::take(&mut self.pending_losses);
        pending.iter().map(Value::scalar).collect()
    }

    /// The open accumulation window.
    pub(super) fn window(&self) -> &Window {
        &self.window
    }

    /// Whether the next micro-batch closes the window of `accum` micro-batches.
    pub(super) fn closes(&self, accum: usize) -> bool {
        self.window.micro_batches + 1 >= accum
    }

    /// Adds a micro-batch's weight (its real rows) to the window; when `closes`, the factor
    /// that turns the window's sums into a mean (1 / its rows).
    pub(super) fn weigh(&mut self, weight: f64, closes: bool) -> Option<f32> {
        self.window.rows += weight;
        closes.then(|| 1.0 / self.window.rows.max(f64::MIN_POSITIVE) as f32)
    }

    /// The window's sums so far, taken (`None` at its start).
    pub(super) fn take_sums(&mut self) -> Option<Vec<Value>> {
        self.window.sums.take()
    }

    /// A micro-batch that did not close the window: its new sums.
    pub(super) fn keep_sums(&mut self, sums: Vec<Value>) {
        self.window.micro_batches += 1;
        self.window.sums = Some(sums);
    }

    /// The window closed: the next micro-batch opens a new one.
    pub(super) fn close_window(&mut self) {
        self.window.micro_batches = 0;
        self.window.rows = 0.0;
    }

    /// A window restored from a checkpoint.
    pub(super) fn restore_window(&mut self, window: Window) {
        self.window = window;
    }
}
