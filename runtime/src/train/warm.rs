//! A warm start off the critical path: [`Nitro::warm_up`] gets a handle's programs and runs
//! each once on a thread of its own, while the caller goes on loading its data.
//!
//! Loading a stored executable costs what XLA spends rebuilding it (hundreds of milliseconds
//! for a transformer's gradient program), and the first run of a loaded program costs more
//! than a steady one (XLA builds parts of it lazily). Both are paid once per process, by
//! whoever runs the program first — so a warm-up that runs them on another thread, while the
//! main thread reads and prepares its data, takes them off the time to the first step. The
//! programs land in the process-wide cache, where the real handle finds them: its lookups are
//! then memory hits (or wait for the warm-up's lookup of the same key, never doing it twice).

use std::thread::JoinHandle;

use super::*;

/// A warm-up running on its own thread ([`Nitro::warm_up`]). [`wait`](WarmUp::wait) joins it
/// and returns what it did; dropping it joins it too (a process never ends with XLA busy on a
/// thread it has forgotten).
#[derive(Debug)]
pub struct WarmUp {
    thread: Option<JoinHandle<Result<WarmReport>>>,
    /// Why no thread could be started, if none was.
    unstarted: Option<String>,
}

/// What a warm-up did: each program lookup, and how long the whole warm-up took on its thread.
#[derive(Clone, Debug)]
pub struct WarmReport {
    /// The lookups, in order: the training programs, then the evaluation program when asked.
    pub outcomes: Vec<Outcome>,
    /// From the thread's start to its end: lookups, one step and, when asked, one evaluation.
    pub took: Duration,
}

impl WarmUp {
    /// Waits for the warm-up to end: what it did, or why it failed (a failed warm-up loses
    /// nothing: the handle's own lookups do the work instead).
    pub fn wait(mut self) -> Result<WarmReport> {
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(report)) => report,
            Some(Err(_)) => Err(Error::Misconfigured {
                message: "the warm-up thread panicked; the handle gets its programs itself".into(),
            }),
            None => Err(Error::Misconfigured {
                message: format!(
                    "no warm-up ran: {}; the handle gets its programs itself",
                    self.unstarted.take().unwrap_or_default()
                ),
            }),
        }
    }

    /// Whether the warm-up has ended (its report is ready for [`wait`](WarmUp::wait)).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

impl Drop for WarmUp {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            if let Ok(Err(e)) = thread.join() {
                tracing::debug!("the warm-up failed: {e}");
            }
        }
    }
}

impl<E: Model + Send, O: Optimizer> Nitro<E, O>
where
    E::Batch: Send,
{
    /// Starts a warm-up of the programs a handle of `experiment`, `optimizer` and `config`
    /// will run on batches like `sample`, on a thread of its own, and returns at once: the
    /// thread makes a handle of its own on them (same backend, the process-wide cache), gets
    /// its training programs — and the evaluation program when `evaluates` — from the cache
    /// (compiling what no level holds), and runs one step (every micro-batch of one with
    /// [`Config::accum`]) and, when `evaluates`, one evaluation on `sample`, so that the
    /// first runs' lazy set-up is paid too. The values it trains are its own and are dropped.
    ///
    /// Start it as soon as the model's shape is known and before the data loads; make the
    /// real handle after. Its lookups then find the programs in memory (a hit) or wait for the
    /// warm-up's lookup of the same key. `sample` is a batch like the first step's (zeros
    /// will do: only its shapes reach the programs, and no gradient is kept).
    ///
    /// ```no_run
    /// # use nitro::prelude::*;
    /// # use nitro::train::{Config, Model, Nitro};
    /// # fn demo<E: Model + Send, O: nitro::optim::Optimizer>(make: fn() -> E, optimizer: O,
    /// #     sample: E::Batch, load_data: fn() -> nitro::data::Dataset) -> nitro::Result<()>
    /// # where E::Batch: Send + nitro::train::FromBatch {
    /// let config = Config::new().batch(64);
    /// let warm = Nitro::warm_up(make(), optimizer.clone(), config.clone(), sample, true);
    /// let data = load_data(); // the programs load and run meanwhile
    /// let mut run = Nitro::new(make(), optimizer, config)?;
    /// let history = run.fit(&data, None)?; // its lookups hit in memory
    /// println!("warm-up: {:?}", warm.wait()?.took);
    /// # Ok(()) }
    /// ```
    pub fn warm_up(
        experiment: E,
        optimizer: O,
        config: Config,
        sample: E::Batch,
        evaluates: bool,
    ) -> WarmUp {
        let work = move || -> Result<WarmReport> {
            let started = Instant::now();
            let rows = batch_rows(&sample)?;
            let micro_batches = config.accum;
            // The warm-up's step is a rehearsal: it prints nothing and saves nothing.
            let mut config = config.progress(false);
            config.save_every = None;
            let mut run = Nitro::new(experiment, optimizer, config)?;
            let outcomes = run.prepare_programs(
                &sample,
                if evaluates {
                    Need::Evaluate
                } else {
                    Need::Train
                },
            )?;
            for _ in 0..micro_batches {
                run.step_deferred(&sample, rows)?;
            }
            run.wait()?;
            if evaluates {
                run.evaluate(&sample, rows)?;
            }
            Ok(WarmReport {
                outcomes,
                took: started.elapsed(),
            })
        };
        let thread = std::thread::Builder::new()
            .name("nitro-warm-up".into())
            .spawn(work);
        match thread {
            Ok(thread) => WarmUp {
                thread: Some(thread),
                unstarted: None,
            },
            Err(e) => WarmUp {
                thread: None,
                unstarted: Some(format!("no thread could be started ({e})")),
            },
        }
    }
}
