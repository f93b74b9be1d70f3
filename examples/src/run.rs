//! The digits training run shared by the examples: the MLP, the cosine schedule, `fit` with
//! validation, and what the run measured.

use std::time::{Duration, Instant};

use nitro::data::{Dataset, Split};
use nitro::optim::{Cosine, Optimizer};
use nitro::train::{Config, FromBatch, History, Nitro, Plan};

use crate::DigitsMlp;

/// How the digits MLP is trained (the `digits` example's defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// Epochs (10).
    pub epochs: usize,
    /// Rows per step (32).
    pub batch: usize,
    /// The peak learning rate of the cosine schedule (1e-2).
    pub lr: f64,
    /// The hidden layer's width (128).
    pub hidden: usize,
    /// The seed of the split and of the per-epoch shuffles (1).
    pub seed: u64,
    /// Whether to draw a progress bar per epoch (on a terminal only).
    pub progress: bool,
    /// Devices to train on (data parallel; `None`: `NITRO_DEVICES`, else 1).
    pub devices: Option<usize>,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            epochs: 10,
            batch: 32,
            lr: 1e-2,
            hidden: 128,
            seed: 1,
            progress: true,
            devices: None,
        }
    }
}

/// The fraction of the rows the examples train on; the rest is held out for validation.
pub const TRAIN_FRACTION: f64 = 0.8;

impl Settings {
    /// The handle's configuration for `train_rows` training rows: a cosine decay from
    /// [`lr`](Settings::lr) to a hundredth of it over the whole run, after a warm-up of 5% of
    /// the steps. The rate is a traced scalar written each step, so the schedule compiles
    /// nothing.
    pub fn config(&self, train_rows: usize) -> Config {
        let steps = (train_rows.div_ceil(self.batch.max(1)) * self.epochs) as u64;
        let config = match self.devices {
            Some(n) => Config::new().devices(n),
            None => Config::new(),
        };
        config
            .batch(self.batch)
            .epochs(self.epochs)
            .seed(self.seed)
            .schedule(Cosine {
                base: self.lr,
                min: self.lr / 100.0,
                warmup: steps / 20,
                total: steps,
            })
            .progress(self.progress)
    }
}

/// What a training run measured.
#[derive(Clone, Debug)]
pub struct Trained {
    /// Loss, validation loss and accuracy, step time per epoch.
    pub history: History,
    /// From making the handle to the end of its first step.
    pub first_step: Option<Duration>,
    /// Time spent getting programs (compiling, or loading from the persistent cache).
    pub programs: Duration,
    /// Wall time of `fit`, in seconds.
    pub fit_s: f64,
}

/// Trains the digits MLP ([`DigitsMlp::tanh`] of width [`Settings::hidden`], on `data`) with
/// `optimizer` on `split.train`, validating on `split.validation` after every epoch.
pub fn train<O: Optimizer>(
    data: &Dataset,
    split: &Split,
    settings: &Settings,
    optimizer: O,
) -> nitro::Result<Trained> {
    let exp = DigitsMlp::tanh(settings.hidden, data.clone());
    let config = settings.config(split.train.rows());
    let mut run = Nitro::new(exp, optimizer, config)?;
    let started = Instant::now();
    let history = run.fit(&split.train, Some(&split.validation))?;
    Ok(Trained {
        history,
        first_step: run.first_step_time(),
        programs: run.compile_time(),
        fit_s: started.elapsed().as_secs_f64(),
    })
}

/// The preflight of [`train`]: what getting each program of the run's inventory (gradient,
/// update, evaluation) would do — a hit, a load, a fetch or a compile, with the reason and the
/// recorded time — found without compiling anything.
pub fn plan<O: Optimizer>(
    data: &Dataset,
    split: &Split,
    settings: &Settings,
    optimizer: O,
) -> nitro::Result<Plan> {
    let exp = DigitsMlp::tanh(settings.hidden, data.clone());
    let config = settings.config(split.train.rows());
    let run = Nitro::new(exp, optimizer, config)?;
    let rows: Vec<usize> = (0..settings.batch.min(split.train.rows())).collect();
    let sample = crate::Rows::from_batch(split.train.gather(&rows, settings.batch)?)?;
    run.plan(&sample, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_warms_up_then_decays_over_the_whole_run() {
        let s = Settings {
            epochs: 40,
            batch: 32,
            ..Settings::default()
        };
        // 100 rows: 4 batches an epoch (the last one ragged), 160 steps, 8 of warm-up.
        let config = s.config(100);
        assert_eq!((config.batch, config.epochs, config.seed), (32, 40, 1));
        let schedule = config.schedule.expect("a schedule");
        assert!(
            (schedule.lr(0) - s.lr / 8.0).abs() < 1e-12,
            "warm-up starts low"
        );
        assert!(
            (schedule.lr(8) - s.lr).abs() < 1e-12,
            "the peak after warm-up"
        );
        assert!(schedule.lr(100) < schedule.lr(50), "decays");
        assert!(
            (schedule.lr(160) - s.lr / 100.0).abs() < 1e-12,
            "the floor at the end"
        );
    }
}
