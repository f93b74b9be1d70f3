//! Saving while training goes on: a save takes the state as it is when asked, and copies,
//! serializes and writes it — atomically, as [`Checkpoint::save`] writes — on a thread of its
//! own while the next steps run. The next update hands that thread the buffers it replaces
//! (lent to the update instead of donated), so the copy off the devices waits for nothing on
//! the training thread. At most one save is in flight; an error of one surfaces at the next
//! call that can report it.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::*;
use crate::checkpoint::Format;
use std::borrow::Cow;

/// What a finished background save did ([`Nitro::wait_saved`], [`Nitro::last_save`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SaveReport {
    /// The file or checkpoint directory written.
    pub path: PathBuf,
    /// The optimizer steps the checkpoint holds.
    pub step: u64,
    /// The bytes written: the file's size, or a checkpoint directory's tensor bytes.
    pub bytes: u64,
    /// Taking the state: capturing the checkpoint's other parts on the training thread, plus
    /// copying the parameters and optimizer state off the devices — on the save's own thread
    /// from the buffers the next update handed over, or on the training thread when the state
    /// was handed over as host copies (no update came first: `wait_saved`, `checkpoint`, a new
    /// save). Only the time copying: not the wait for the update that hands the state over.
    pub copy: Duration,
    /// Serializing, hashing and writing the file or the directory's parts, synced and
    /// committed: the time that work took on the save's own thread. A background save to a
    /// checkpoint directory pauses between pieces while training runs, to leave the cores to
    /// it; the pauses are not counted here, so such a save is in flight longer than `copy +
    /// write`.
    pub write: Duration,
}

/// A handle's background saves: the one in flight, and the last one finished.
#[derive(Default)]
pub(super) struct Saves {
    in_flight: Option<InFlight>,
    last: Option<SaveReport>,
    /// The step of the last save started by [`Config::save_every`], so a step count is saved
    /// once however many calls see it.
    last_every: Option<u64>,
    /// A save's error met after a step was taken, kept for the next call that can report it
    /// before doing anything: so an error from a step always means that step was not taken.
    deferred: Option<Error>,
}

/// What a background save's thread has once it took the state.
pub(super) enum Ready {
    /// A whole checkpoint to write as one file, and how long taking it took.
    Checkpoint(Box<Checkpoint>, Duration),
    /// A checkpoint directory already written.
    Saved(SaveReport),
}

/// The error of a save whose handle stopped before handing it the state.
fn handle_stopped(path: &Path) -> Error {
    Error::CheckpointIo {
        path: path.to_path_buf(),
        what: "take the state to save to",
        source: std::io::Error::other(
            "the training handle stopped (an update failed) before handing its state over; \
             the checkpoint at the path is the previous one, if there was one",
        ),
    }
}

/// A save whose writer thread has not been joined yet.
struct InFlight {
    path: PathBuf,
    thread: JoinHandle<Result<SaveReport>>,
}

impl Saves {
    /// Whether a save is in flight (started, not yet joined).
    pub(super) fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Whether a save's file is being written right now.
    pub(super) fn writing(&self) -> bool {
        self.in_flight
            .as_ref()
            .is_some_and(|f| !f.thread.is_finished())
    }

    /// Waits for the save in flight: its report (kept as the last one), its error, or `None`
    /// when there was none.
    pub(super) fn wait(&mut self) -> Result<Option<SaveReport>> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        let Some(InFlight { path, thread }) = self.in_flight.take() else {
            return Ok(None);
        };
        let report = thread.join().map_err(|_| Error::CheckpointIo {
            path: path.clone(),
            what: "write (in the background) to",
            source: std::io::Error::other(
                "the thread writing it panicked; the file at the path is the previous \
                 checkpoint, if there was one",
            ),
        })??;
        self.last = Some(report.clone());
        Ok(Some(report))
    }

    /// The error of a save that has finished with one (the save is then over); `Ok` while it
    /// is still writing, or when it succeeded.
    pub(super) fn check(&mut self) -> Result<()> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        if self
            .in_flight
            .as_ref()
            .is_some_and(|f| f.thread.is_finished())
        {
            self.wait()?;
        }
        Ok(())
    }

    /// Starts saving to `path` on a thread of its own, after the save in flight, if any, has
    /// finished: `take` gives the whole checkpoint there (and how long taking it took) to be
    /// written as one file, or writes a checkpoint directory itself.
    pub(super) fn start(
        &mut self,
        path: PathBuf,
        take: impl FnOnce() -> Result<Ready> + Send + 'static,
    ) -> Result<()> {
        self.wait()?;
        let target = path.clone();
        let thread = std::thread::Builder::new()
            .name("nitro-save".into())
            .spawn(move || {
                let (checkpoint, copy) = match take()? {
                    Ready::Checkpoint(checkpoint, copy) => (*checkpoint, copy),
                    Ready::Saved(report) => return Ok(report),
                };
                let started = Instant::now();
                checkpoint.save(&target)?;
                let bytes = std::fs::metadata(&target).map_or(0, |m| m.len());
                Ok(SaveReport {
                    path: target,
                    step: checkpoint.step(),
                    bytes,
                    copy,
                    write: started.elapsed(),
                })
            })
            .map_err(|source| Error::CheckpointIo {
                path: path.clone(),
                what: "start a thread to write (in the background) to",
                source,
            })?;
        self.in_flight = Some(InFlight { path, thread });
        Ok(())
    }

    /// Keeps `error` for the next call that can report it (the first kept wins: a later one
    /// follows from it).
    fn defer(&mut self, error: Error) {
        self.deferred.get_or_insert(error);
    }

    /// The last save that finished.
    pub(super) fn last(&self) -> Option<&SaveReport> {
        self.last.as_ref()
    }
}

impl Drop for Saves {
    /// A handle dropped while saving waits for the file to be complete; an error is logged
    /// (nothing is left to return it to), and the file at the path is then the previous one.
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            tracing::warn!(target: "nitro::train", "nitro: a background save failed: {e}");
        }
    }
}

impl<E: Model, O: Optimizer> Nitro<E, O> {
    /// Saves a checkpoint of the handle ([`checkpoint`](Nitro::checkpoint)) to `path` while
    /// training goes on, as the state is now. This returns at once: the next update lends the
    /// parameter and optimizer buffers it replaces to the save's thread instead of donating
    /// them (for that step the devices hold the state twice), and that thread copies them off
    /// the devices, behind the update, and writes the file atomically — a process killed
    /// mid-write leaves the previous file at `path` whole. When no update comes,
    /// [`wait_saved`](Nitro::wait_saved), [`checkpoint`](Nitro::checkpoint),
    /// [`modify`](Nitro::modify) or the next save hand the state over as host copies, and a
    /// dropped handle hands its buffers over and waits for the file. Inside an accumulation
    /// window (its sums are saved too) the whole checkpoint is copied before this returns.
    ///
    /// At most one save is in flight: this waits for an earlier one to finish first. An error
    /// of a background save (a missing directory, a full disk) is returned by the next call
    /// that can report it — the next step, save, [`wait_saved`](Nitro::wait_saved) or
    /// checkpoint — once; [`Config::save_every`] saves this way every few steps.
    pub fn save_in_background(&mut self, path: impl AsRef<Path>) -> Result<()> {
        // An earlier save still waiting for the state gets it now, then is waited for.
        self.state.hand_over()?;
        self.saves.wait()?;
        let path = path.as_ref().to_path_buf();
        let started = Instant::now();
        if Format::for_path(&path) == Format::Directory {
            return self.save_dir_in_background(path, started);
        }
        if self.progress.window().sums.is_some() {
            // Inside an accumulation window its sums are saved too: the whole checkpoint is
            // copied here.
            let checkpoint = self.checkpoint()?;
            let copy = started.elapsed();
            return self.saves.start(path, move || {
                Ok(Ready::Checkpoint(Box::new(checkpoint), copy))
            });
        }
        self.place_state()?;
        let mut head = self.checkpoint_head(true)?;
        let layout = self.state.layout();
        let (packing, paths) = (layout.packing.clone(), layout.paths.clone());
        let slots = self.optimizer.slots();
        let (save, state) = std::sync::mpsc::channel();
        self.state.request_snapshot(save);
        let captured = started.elapsed();
        self.saves.start(path.clone(), move || {
            let snapshot = state.recv().map_err(|_| handle_stopped(&path))?;
            // Copied here from the buffers handed over, or before, on the training thread.
            let (trainable, optimizer, copied) = snapshot.into_host()?;
            head.replace_device(paths.iter().cloned().zip(packing.unpack(&trainable)?))?;
            head.set_optimizer_state(resume::named_state(&packing, &paths, slots, &optimizer)?)?;
            Ok(Ready::Checkpoint(Box::new(head), captured + copied))
        })
    }

    /// Saves a checkpoint of the handle ([`checkpoint`](Nitro::checkpoint)) to `path` on this
    /// thread, after a background save in flight has finished, and says what it wrote.
    ///
    /// A path ending in `.safetensors` is written as one file ([`Checkpoint::save`]); any other
    /// path is a checkpoint directory ([`CheckpointDir`](crate::checkpoint::CheckpointDir)),
    /// created if missing (its parent must exist): each device's shards are copied off it and
    /// written as a part of their own, one device at a time, so the host never holds a leaf
    /// that no device holds whole, and the new version replaces the previous one atomically.
    /// [`resume`](Nitro::resume) reads either ([`Saved::open`](crate::checkpoint::Saved::open)),
    /// on any mesh.
    ///
    /// Errors as [`Checkpoint::save`].
    pub fn save(&mut self, path: impl AsRef<Path>) -> Result<SaveReport> {
        self.state.hand_over()?;
        self.saves.wait()?;
        let path = path.as_ref().to_path_buf();
        let started = Instant::now();
        let (bytes, copy) = match Format::for_path(&path) {
            Format::File => {
                let checkpoint = self.checkpoint()?;
                let copy = started.elapsed();
                checkpoint.save(&path)?;
                (std::fs::metadata(&path).map_or(0, |m| m.len()), copy)
            }
            Format::Directory => {
                let written = self.save_dir(&path)?;
                (written.bytes, written.copy)
            }
        };
        Ok(SaveReport {
            path,
            step: self.progress.step(),
            bytes,
            copy,
            write: started.elapsed().saturating_sub(copy),
        })
    }

    /// A background save to the checkpoint directory `path` (see
    /// [`save_in_background`](Nitro::save_in_background)): the save's thread copies each
    /// device's shards off it and writes them as its part. Inside an accumulation window the
    /// version is written before this returns.
    fn save_dir_in_background(&mut self, path: PathBuf, started: Instant) -> Result<()> {
        if self.progress.window().sums.is_some() {
            let written = self.save_dir(&path)?;
            let report = SaveReport {
                path,
                step: self.progress.step(),
                bytes: written.bytes,
                copy: written.copy,
                write: started.elapsed().saturating_sub(written.copy),
            };
            return self
                .saves
                .start(report.path.clone(), move || Ok(Ready::Saved(report)));
        }
        self.place_state()?;
        let head = self.checkpoint_head(false)?;
        let layout = self.state.layout().clone();
        let slots = self.optimizer.slots();
        let metadata = pieces::metadata(&head, &layout.paths, slots, None)?;
        let (paths, frozen) = state::frozen_leaves(&self.experiment);
        let step = head.step();
        let (save, state) = std::sync::mpsc::channel();
        // Written with pauses while training runs, at full speed once waited for.
        let pace = self.state.request_snapshot(save);
        let captured = started.elapsed();
        let target = path.clone();
        self.saves.start(path, move || {
            let snapshot = state.recv().map_err(|_| handle_stopped(&target))?;
            let started = Instant::now();
            let held = snapshot.into_held();
            let frozen = (paths, frozen.into_iter().map(Cow::Owned).collect());
            let (sources, unpacked) =
                pieces::sources(&layout, slots, frozen, held.trainable, held.optimizer, None)?;
            let written = pieces::write_dir(&target, step, metadata, sources, Some(&pace))?;
            // On this thread: copying what was handed over off the devices, the pauses, and
            // the rest — the writing.
            let copied_here = unpacked + written.copy;
            Ok(Ready::Saved(SaveReport {
                path: target,
                step,
                bytes: written.bytes,
                copy: captured + held.copied + copied_here,
                write: started
                    .elapsed()
                    .saturating_sub(copied_here + written.paused),
            }))
        })
    }

    /// Waits for the background save in flight to be written: its report, its error, or `None`
    /// when none is in flight (a save that finished was reaped by the next step, which
    /// reported its error; its report is [`last_save`](Nitro::last_save)).
    pub fn wait_saved(&mut self) -> Result<Option<SaveReport>> {
        self.state.hand_over()?;
        self.saves.wait()
    }

    /// Whether a background save is still in flight (started and not waited for).
    pub fn saving(&self) -> bool {
        self.saves.in_flight()
    }

    /// The last background save that finished (and was waited for, or reported).
    pub fn last_save(&self) -> Option<&SaveReport> {
        self.saves.last()
    }

    /// After a step is counted (its batch too): reaps a background save that finished, and,
    /// every [`Config::save_every`] steps, starts a new one. It never fails the step that was
    /// just taken: a save's error found here — one that failed, or the one due now not
    /// started ([`Error::SaveNotStarted`]) — is returned by the next call, before it does
    /// anything, so an error from a step always means that step was not taken.
    pub(super) fn after_step(&mut self) {
        let step = self.progress.step();
        let due = match &self.config.save_every {
            Some((every, path))
                if step != 0
                    && step.is_multiple_of(*every)
                    && self.saves.last_every != Some(step) =>
            {
                Some(path.clone())
            }
            _ => None,
        };
        let Some(path) = due else {
            if let Err(e) = self.saves.check() {
                self.saves.defer(e);
            }
            return;
        };
        self.saves.last_every = Some(step);
        if let Err(e) = self.save_in_background(&path) {
            self.saves.defer(Error::SaveNotStarted {
                step,
                path,
                source: Box::new(e),
            });
        }
    }
}
