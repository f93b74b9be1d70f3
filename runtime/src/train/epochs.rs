//! Epochs: [`Nitro::train_epoch`], [`Nitro::validate`], [`Nitro::fit`], and the history they
//! record.

use super::*;

/// One epoch of [`Nitro::fit`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EpochRecord {
    /// The epoch, from 1.
    pub epoch: usize,
    /// The mean training loss over the epoch's real rows.
    pub train_loss: f64,
    /// The mean validation loss, when validated.
    pub val_loss: Option<f64>,
    /// The validation accuracy, when validated and the model has `correct`.
    pub val_accuracy: Option<f64>,
    /// The validation metrics registered on the handle, by name.
    pub metrics: Vec<(String, f64)>,
    /// Steps taken in the epoch (optimizer updates).
    pub steps: u64,
    /// The median time of one whole step — the batch uploaded, the gradient and the update run
    /// and finished — in microseconds, over a sample of the epoch's steps (up to 8, spread
    /// over it) each timed with nothing else in flight and waited for. What one step costs.
    pub step_us_median: f64,
    /// The epoch's training wall time (first batch enqueued to the last step finished and its
    /// losses read) divided by its batches (micro-batches with accumulation), in
    /// microseconds: steps as the handle runs them, enqueued while earlier ones run. What a
    /// step costs in throughput.
    pub step_us_pipelined: f64,
    /// The median time of a whole step taken while a background save was being written
    /// ([`Config::save_every`], [`Nitro::save_in_background`]), in microseconds, timed as
    /// `step_us_median`'s steps are (every such step is); `None` when no step overlapped a
    /// save. Against `step_us_median`: what saving in the background costs training.
    pub step_us_median_saving: Option<f64>,
    /// Wall time of the epoch (training and validation), in seconds.
    pub seconds: f64,
}

/// What [`Nitro::fit`] returns: one record per epoch. Prints as a table.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct History {
    /// The epochs, in order.
    pub epochs: Vec<EpochRecord>,
}

impl std::fmt::Display for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "epoch  train loss  val loss  val acc   steps  seconds")?;
        let names: Vec<&str> = self
            .epochs
            .first()
            .map(|r| r.metrics.iter().map(|(n, _)| n.as_str()).collect())
            .unwrap_or_default();
        for n in &names {
            write!(f, "  {n:>10}")?;
        }
        writeln!(f)?;
        for r in &self.epochs {
            let opt = |v: Option<f64>, pct: bool| match v {
                Some(v) if pct => format!("{:>6.2}%", 100.0 * v),
                Some(v) => format!("{v:>8.4}"),
                None => format!("{:>8}", "-"),
            };
            write!(
                f,
                "{:>5}  {:>10.4}  {}  {}  {:>6}  {:>7.2}",
                r.epoch,
                r.train_loss,
                opt(r.val_loss, false),
                opt(r.val_accuracy, true),
                r.steps,
                r.seconds
            )?;
            for (_, v) in &r.metrics {
                write!(f, "  {v:>10.4}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// What an epoch measured of its steps.
#[derive(Default)]
pub(super) struct EpochTimings {
    /// Steps that applied the optimizer, each timed from its enqueue to its end with nothing
    /// else in flight (a sample of the epoch's steps).
    pub(super) waited: Vec<Duration>,
    /// Steps taken while a background save was being written, each timed as `waited`'s.
    pub(super) waited_saving: Vec<Duration>,
    /// From the first batch's enqueue to the end of the last step (losses read).
    pub(super) wall: Duration,
    /// Batches (micro-batches with accumulation) the epoch trained.
    pub(super) batches: usize,
}

impl EpochTimings {
    /// The median of the waited steps, in microseconds (the upper one of an even count); 0
    /// for none.
    pub(super) fn waited_median_us(&self) -> f64 {
        median_us(&self.waited).unwrap_or(0.0)
    }

    /// The median of the steps taken while saving, in microseconds; `None` for none.
    pub(super) fn saving_median_us(&self) -> Option<f64> {
        median_us(&self.waited_saving)
    }
}

/// The median of `times` in microseconds (the upper one of an even count); `None` for none.
fn median_us(times: &[Duration]) -> Option<f64> {
    let mut us: Vec<f64> = times.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(f64::total_cmp);
    us.get(us.len() / 2).copied()
}

/// How many steps of an epoch are timed waited (spread evenly over it).
pub(super) const WAITED_SAMPLES: usize = 8;

/// A progress bar for one epoch of `steps` steps on stderr: hidden unless `on` and stderr is a
/// terminal (so logs and pipes never receive one).
pub(super) fn progress_bar(on: bool, steps: u64, epoch: u64) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !on || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(steps);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "epoch {prefix:>3} [{bar:30}] {pos}/{len} steps · {per_sec} · {elapsed}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(epoch.to_string());
    bar
}

/// The data an epoch of [`Nitro::fit_with`] runs on: the data set given, or one made for the
/// epoch and shared (a cached stage's memo of its data set with the stage's column).
pub(crate) enum EpochData<'d> {
    Given(&'d Dataset),
    Shared(std::sync::Arc<Dataset>),
}

impl std::ops::Deref for EpochData<'_> {
    type Target = Dataset;

    fn deref(&self) -> &Dataset {
        match self {
            EpochData::Given(d) => d,
            EpochData::Shared(d) => d,
        }
    }
}

impl<E: Model, O: Optimizer> Nitro<E, O> {
    /// One epoch over `data`: its rows shuffled with the configured seed (a fresh order per
    /// epoch, numbered from 0), in batches of the configured size, the last one padded and
    /// masked. Returns the mean loss over the rows it trained. The losses are read once, at the
    /// end of the epoch.
    ///
    /// When `epoch` is the epoch the handle is in the middle of (one a resumed checkpoint was
    /// taken in, or one an error interrupted), it continues after the batches already trained.
    /// Afterwards the handle counts `epoch + 1` epochs completed ([`Nitro::epochs_done`]).
    ///
    /// Errors: [`Error::EmptyData`] for a data set without rows; [`Error::InvalidSetting`] when
    /// [`Config::batch`] is larger than the data set; [`Error::LabelOutOfRange`] naming the data
    /// set's row when a batch holds a label outside the classes of the loss reading it.
    pub fn train_epoch(&mut self, data: &Dataset, epoch: u64) -> Result<f64>
    where
        E::Batch: FromBatch,
    {
        self.check_training_data(data)?;
        let plan = data.plan(
            self.config.batch,
            Order::Shuffled {
                seed: self.config.seed,
            },
        )?;
        let skip = usize::try_from(self.progress.start_epoch(epoch)).unwrap_or(usize::MAX);
        let number = epoch + 1;
        let order = plan.epoch(epoch);
        let count = order.len();
        let mut rows = Vec::with_capacity(count);
        let mut steps = Vec::with_capacity(count);
        let every = count.div_ceil(WAITED_SAMPLES).max(1);
        let bar = progress_bar(self.config.progress, count as u64, number);
        bar.inc(skip.min(count) as u64);
        let started = Instant::now();
        for (i, span) in order.spans().enumerate().skip(skip) {
            let batch = data.gather(span, self.config.batch)?;
            let real = batch.real_rows();
            let batch = E::Batch::from_batch(batch)?;
            // An epoch's last batch closes an accumulation window, full or not.
            let closes = self.progress.closes(self.config.accum) || i + 1 == count;
            // A few steps are timed alone: nothing in flight before, waited for after; and
            // every step taken while a save is being written.
            let saving = self.saves.writing();
            let timed = closes && (saving || i % every == every / 2);
            if timed {
                self.wait()?;
            }
            let step_started = Instant::now();
            self.micro_step(&batch, RowMask::Real(real), closes, Some(span))?;
            if timed {
                self.wait()?;
                self.progress.timed(step_started.elapsed(), saving);
            }
            self.progress.batch_done();
            self.after_step();
            steps.push(self.progress.step());
            rows.push(real);
            bar.inc(1);
        }
        let losses = self.take_losses()?;
        self.progress
            .end_epoch(epoch, rows.len(), started.elapsed());
        bar.finish_and_clear();
        self.check_losses(number, skip, &losses, &steps)?;
        let total: usize = rows.iter().sum();
        let sum: f64 = losses.iter().zip(&rows).map(|(l, &r)| l * r as f64).sum();
        Ok(if total == 0 { 0.0 } else { sum / total as f64 })
    }

    /// Warns about (or, under [`NonFinite::Stop`], refuses) the first NaN or infinite loss of
    /// an epoch's `losses`, batch `skip + i` of epoch `epoch` (from 1), the handle at
    /// `steps[i]` optimizer steps after it.
    pub(super) fn check_losses(
        &self,
        epoch: u64,
        skip: usize,
        losses: &[f64],
        steps: &[u64],
    ) -> Result<()> {
        let Some(i) = losses.iter().position(|l| !l.is_finite()) else {
            return Ok(());
        };
        let (batch, step, loss) = (skip + i + 1, steps.get(i).copied().unwrap_or(0), losses[i]);
        if self.config.non_finite == NonFinite::Stop {
            return Err(Error::NonFiniteLoss {
                epoch,
                batch,
                step,
                loss,
                state_step: self.progress.step(),
            });
        }
        let later = losses[i..].iter().filter(|l| !l.is_finite()).count();
        tracing::warn!(
            target: "nitro::train",
            epoch,
            batch,
            step,
            loss,
            non_finite_batches = later,
            "the training loss is {loss} from epoch {epoch}, batch {batch} (optimizer step \
             {step}) on ({later} such batch(es) this epoch): lower the learning rate or check \
             the data; Config::non_finite(NonFinite::Stop) stops instead"
        );
        Ok(())
    }

    /// Refuses training data without rows, or fewer rows than one batch.
    pub(super) fn check_training_data(&self, data: &Dataset) -> Result<()> {
        if data.rows() == 0 {
            return Err(Error::EmptyData {
                which: "the training data".into(),
            });
        }
        if self.config.batch > data.rows() {
            return Err(Error::InvalidSetting {
                variable: "Config::batch",
                value: self.config.batch.to_string(),
                expected: format!(
                    "at most the training data's {} rows: every step would pad its batch to {} \
                     rows, mostly copies; use a smaller batch",
                    data.rows(),
                    self.config.batch
                ),
            });
        }
        Ok(())
    }

    /// Evaluates every row of `data` once, in order: summed loss and correct count.
    ///
    /// Errors: [`Error::EmptyData`] for a data set without rows; [`Error::LabelOutOfRange`]
    /// naming the data set's row when a batch holds a label outside the classes of the loss
    /// (or `correct`) reading it.
    pub fn validate(&mut self, data: &Dataset) -> Result<EvalResult>
    where
        E::Batch: FromBatch,
    {
        if data.rows() == 0 {
            return Err(Error::EmptyData {
                which: "the validation data".into(),
            });
        }
        let plan = data.plan(self.config.batch, Order::Sequential)?;
        let epoch = plan.epoch(0);
        let mut total = EvalResult::default();
        let mut sums: Vec<Option<Value>> = Vec::new();
        for _ in self.inventory.metrics() {
            sums.push(Some(place_one(self.backend, Array::scalar(0.0f32))?));
        }
        let want_predictions = !self.host_metrics.is_empty();
        for span in epoch.spans() {
            let batch = data.gather(span, self.config.batch)?;
            let real = batch.real_rows();
            let batch = E::Batch::from_batch(batch)?;
            let (r, mask) =
                self.run_eval(&batch, RowMask::Real(real), want_predictions, Some(span))?;
            for (i, sum) in sums.iter_mut().enumerate() {
                let compiled = self.metric_program(i, &batch)?;
                self.state.ready(self.backend, self.config.leaf_views)?;
                let partitioned = self.backend.partitioning().is_some();
                let mut args = self
                    .state
                    .batch_args(partitioned, &batch, In::Rows(&mask))?;
                args.push(In::Give(sum.take().ok_or_else(no_output)?));
                let (out, _) = args.run(&compiled)?;
                *sum = out.into_iter().next();
            }
            for m in &mut self.host_metrics {
                m.update(&batch, &r);
            }
            total.loss_sum += r.loss_sum;
            total.correct += r.correct;
            total.rows += r.rows;
        }
        let rows = total.rows.max(1) as f64;
        for (state, sum) in self.inventory.metrics().iter().zip(&sums) {
            let value = sum.as_ref().ok_or_else(no_output)?.scalar()?;
            total
                .metrics
                .push((state.slot.name().to_owned(), value / rows));
        }
        for m in &mut self.host_metrics {
            total.metrics.push((m.name().to_owned(), m.finish()));
        }
        Ok(total)
    }

    /// [`Model::predict`] for every row of `data`, in order: `[rows, ...]` for any number of
    /// rows. The rows go through the evaluation program in batches of [`Config::batch`], the
    /// last padded (as [`validate`](Nitro::validate) pads it) and its padding's predictions
    /// dropped — on the programs a handle already has for its batch size: predicting 7 or 200
    /// rows compiles nothing new. [`predict`](Nitro::predict) is the form for one batch of
    /// exactly `Config::batch` rows.
    ///
    /// Errors: [`Error::EmptyData`] for a data set without rows; an error when the model does
    /// not predict.
    pub fn predict_data(&mut self, data: &Dataset) -> Result<Array>
    where
        E::Batch: FromBatch,
    {
        if data.rows() == 0 {
            return Err(Error::EmptyData {
                which: "the data to predict".into(),
            });
        }
        let plan = data.plan(self.config.batch, Order::Sequential)?;
        let epoch = plan.epoch(0);
        let mut parts: Vec<Array> = Vec::new();
        for span in epoch.spans() {
            let batch = data.gather(span, self.config.batch)?;
            let real = batch.real_rows();
            let batch = E::Batch::from_batch(batch)?;
            let (r, _) = self.run_eval(&batch, RowMask::Real(real), true, Some(span))?;
            let predictions = r.predictions.ok_or_else(not_predicting::<E>)?;
            let real_rows: Vec<usize> = (0..real).collect();
            parts.push(crate::data::gather_rows(&predictions, &real_rows)?);
        }
        values::join_rows(&parts)
    }

    /// Trains on `train` until the handle has completed [`Config::epochs`] epochs, validating
    /// on `validation` after each epoch when given. A train-only run compiles two programs,
    /// validation a third (and one per device metric), all concurrently before the first step;
    /// nothing after compiles.
    ///
    /// It **continues** the run: a new handle starts at epoch 1; a handle resumed from a
    /// checkpoint starts where the checkpoint was taken (the same epoch numbers, so the same
    /// shuffles, and — mid-epoch — after the batches already trained), and the history numbers
    /// its epochs from there. So `fit` with `epochs(10)`, or `fit` with `epochs(4)`, a
    /// checkpoint, a resume and `fit` with `epochs(10)`, train the same parameters.
    ///
    /// Errors: [`Error::InvalidSetting`] when the handle has completed `Config::epochs` epochs
    /// already (raise it with [`Nitro::set_epochs`] to train on); [`Error::EmptyData`] for a
    /// data set without rows; those of [`train_epoch`](Nitro::train_epoch) and
    /// [`validate`](Nitro::validate).
    pub fn fit(&mut self, train: &Dataset, validation: Option<&Dataset>) -> Result<History>
    where
        E::Batch: FromBatch,
    {
        self.fit_with(train, validation, |_, data| Ok(EpochData::Given(data)))
    }

    /// [`fit`](Nitro::fit) with `each_epoch` giving, before every epoch, the data the epoch
    /// trains and validates on (a cached stage's columns added, for one), timed with it.
    pub(super) fn fit_with(
        &mut self,
        train: &Dataset,
        validation: Option<&Dataset>,
        mut each_epoch: impl for<'d> FnMut(&mut Self, &'d Dataset) -> Result<EpochData<'d>>,
    ) -> Result<History>
    where
        E::Batch: FromBatch,
    {
        self.check_training_data(train)?;
        if validation.is_some_and(|v| v.rows() == 0) {
            return Err(Error::EmptyData {
                which: "the validation data".into(),
            });
        }
        let target = self.config.epochs as u64;
        if self.progress.epoch() >= target {
            return Err(Error::InvalidSetting {
                variable: "Config::epochs",
                value: self.config.epochs.to_string(),
                expected: format!(
                    "more than the {} epochs this handle has completed: `fit` continues a run up \
                     to Config::epochs epochs; raise it with `Nitro::set_epochs` to train on",
                    self.progress.epoch()
                ),
            });
        }
        let mut history = History::default();
        let first = self.progress.epoch();
        for epoch in first..target {
            let started = Instant::now();
            let steps_before = self.progress.step();
            let train = each_epoch(self, train)?;
            let validation = match validation {
                Some(v) => Some(each_epoch(self, v)?),
                None => None,
            };
            let validation = validation.as_deref();
            if epoch == first {
                // The whole inventory at once, the evaluation programs with the training ones.
                let plan = train.plan(self.config.batch, Order::Sequential)?;
                if let Some(first) = plan.epoch(0).batches(&train).next() {
                    let first = E::Batch::from_batch(first?)?;
                    let inventory = match validation {
                        Some(_) => Need::Validate,
                        None => Need::Train,
                    };
                    self.prepare_programs(&first, inventory)?;
                }
            }
            let train_loss = self.train_epoch(&train, epoch)?;
            let mut metrics = Vec::new();
            let (val_loss, val_accuracy) = match validation {
                Some(v) => {
                    let r = self.validate(v)?;
                    metrics = r.metrics.clone();
                    let rows = r.rows.max(1) as f64;
                    let has_accuracy = self
                        .inventory
                        .eval()
                        .is_some_and(|e| e.outputs.get(1).is_some_and(|t| t.dims.is_empty()));
                    (
                        Some(r.loss_sum / rows),
                        has_accuracy.then_some(r.correct / rows),
                    )
                }
                None => (None, None),
            };
            let timings = self.progress.timings();
            let batches = timings.batches.max(1) as f64;
            let record = EpochRecord {
                epoch: usize::try_from(epoch + 1).unwrap_or(usize::MAX),
                train_loss,
                val_loss,
                val_accuracy,
                metrics,
                steps: self.progress.step() - steps_before,
                step_us_median: timings.waited_median_us(),
                step_us_pipelined: timings.wall.as_secs_f64() * 1e6 / batches,
                step_us_median_saving: timings.saving_median_us(),
                seconds: started.elapsed().as_secs_f64(),
            };
            tracing::info!(
                epoch = record.epoch,
                train_loss = record.train_loss,
                val_loss = ?record.val_loss,
                val_accuracy = ?record.val_accuracy,
                "nitro: epoch"
            );
            history.epochs.push(record);
        }
        Ok(history)
    }

    /// The declared buckets, or the error for a call that needs them.
    fn declared_buckets(&self) -> Result<crate::data::buckets::Buckets> {
        self.config
            .buckets
            .clone()
            .ok_or_else(|| Error::InvalidSetting {
                variable: "Config::buckets",
                value: "None".into(),
                expected: "declared bucket edges (Config::buckets(Buckets::new([64, 128, 256])?)) \
                       to train on variable-length rows"
                    .into(),
            })
    }

    /// Gets (or compiles) every program of the declared inventory — per bucket edge the
    /// gradient program (with the evaluation and metric programs when `validating`), and the
    /// update program — before any step, for batches of `data`'s columns. Returns what each
    /// lookup did.
    pub fn prepare_buckets(
        &mut self,
        data: &crate::data::buckets::Ragged,
        validating: bool,
    ) -> Result<Vec<Outcome>>
    where
        E::Batch: FromBatch,
    {
        let buckets = self.declared_buckets()?;
        // A declared bucket per program variant is expected, not a sign of keys that keep
        // moving: the cache's variant warning waits for more than the declared edges.
        let edges = buckets.edges().len();
        if self.cache.variant_warning() < edges {
            self.cache.set_variant_warning(edges);
        }
        let inventory = if validating {
            Need::Validate
        } else {
            Need::Train
        };
        let mut samples = Vec::new();
        for &edge in buckets.edges() {
            let rows = buckets.rows_for(edge, self.config.batch, self.row_multiple());
            samples.push(E::Batch::from_batch(data.blank(edge, rows, &buckets)?)?);
        }
        // Every edge's programs at once, at most `Config::compile_threads` compiling together.
        self.prepare_shapes(&samples, inventory)
    }

    /// Trains [`Config::epochs`] epochs on variable-length rows under the declared
    /// [buckets](Config::buckets): each epoch's rows shuffled with the seed, binned by length
    /// within the policy's window, each batch padded to its bucket's edge, its loss averaged
    /// over the real positions ([`step_weighted`](Nitro::step_weighted)). The whole inventory
    /// (programs × buckets) is got before the first step ([`prepare_buckets`](Nitro::prepare_buckets)),
    /// so nothing compiles after it. After each epoch, `validation` is evaluated bucket by
    /// bucket, its loss averaged over its real positions.
    ///
    /// A row longer than the largest edge is an error naming its length (or is truncated, when
    /// the policy says so), before anything runs.
    pub fn fit_ragged(
        &mut self,
        train: &crate::data::buckets::Ragged,
        validation: Option<&crate::data::buckets::Ragged>,
    ) -> Result<History>
    where
        E::Batch: FromBatch,
    {
        let buckets = self.declared_buckets()?;
        for data in std::iter::once(train).chain(validation) {
            if data.rows() == 0 {
                return Err(Error::EmptyData {
                    which: "a ragged data set".into(),
                });
            }
            for l in data.lengths() {
                buckets.bucket_of(l)?;
            }
        }
        self.prepare_buckets(train, validation.is_some())?;
        let replicas = self.row_multiple();
        let batch = self.config.batch;
        let rows_for = |edge: usize| buckets.rows_for(edge, batch, replicas);
        let mut history = History { epochs: Vec::new() };
        for epoch in self.progress.epoch()..self.config.epochs as u64 {
            let started = Instant::now();
            let steps_before = self.progress.step();
            let plan = train.epoch_batches(&buckets, rows_for, self.config.seed, epoch)?;
            let every = plan.len().div_ceil(WAITED_SAMPLES).max(1);
            self.progress.start_epoch(epoch);
            let mut weights = Vec::with_capacity(plan.len());
            let mut steps = Vec::with_capacity(plan.len());
            let bar = progress_bar(self.config.progress, plan.len() as u64, epoch + 1);
            for (i, (b, rows)) in plan.iter().enumerate() {
                let edge = buckets.edges()[*b];
                let (batch, w) = train.gather(rows, edge, rows_for(edge), &buckets)?;
                let batch = E::Batch::from_batch(batch)?;
                let closes = self.progress.closes(self.config.accum) || i + 1 == plan.len();
                let saving = self.saves.writing();
                let timed = closes && (saving || i % every == every / 2);
                if timed {
                    self.wait()?;
                }
                let step_started = Instant::now();
                self.micro_step(&batch, RowMask::Weights(&w), closes, None)?;
                if timed {
                    self.wait()?;
                    self.progress.timed(step_started.elapsed(), saving);
                }
                self.after_step();
                weights.push(w.iter().map(|&x| f64::from(x)).sum::<f64>());
                steps.push(self.progress.step());
                bar.inc(1);
            }
            let losses = self.take_losses()?;
            bar.finish_and_clear();
            // The epoch is trained, as in `train_epoch`, before a non-finite loss may stop it.
            self.progress
                .end_epoch(epoch, plan.len(), started.elapsed());
            self.check_losses(epoch + 1, 0, &losses, &steps)?;
            let total: f64 = weights.iter().sum();
            let train_loss = losses.iter().zip(&weights).map(|(l, w)| l * w).sum::<f64>()
                / total.max(f64::MIN_POSITIVE);
            let val_loss = match validation {
                Some(val) => Some(self.validate_ragged(val, &buckets)?),
                None => None,
            };
            let record = EpochRecord {
                epoch: usize::try_from(epoch + 1).unwrap_or(usize::MAX),
                train_loss,
                val_loss,
                val_accuracy: None,
                metrics: Vec::new(),
                steps: self.progress.step() - steps_before,
                step_us_median: self.progress.timings().waited_median_us(),
                step_us_pipelined: self.progress.timings().wall.as_secs_f64() * 1e6
                    / plan.len().max(1) as f64,
                step_us_median_saving: self.progress.timings().saving_median_us(),
                seconds: started.elapsed().as_secs_f64(),
            };
            tracing::info!(
                epoch = record.epoch,
                train_loss = record.train_loss,
                val_loss = ?record.val_loss,
                "nitro: epoch done (bucketed)"
            );
            history.epochs.push(record);
        }
        Ok(history)
    }

    /// The mean loss over the real positions of every row of `data`, bucket by bucket (each
    /// row once; padded batches weigh nothing for their padding).
    fn validate_ragged(
        &mut self,
        data: &crate::data::buckets::Ragged,
        buckets: &crate::data::buckets::Buckets,
    ) -> Result<f64>
    where
        E::Batch: FromBatch,
    {
        let replicas = self.row_multiple();
        let batch = self.config.batch;
        let rows_for = |edge: usize| buckets.rows_for(edge, batch, replicas);
        // A fixed order: validation is the same every epoch.
        let plan = data.epoch_batches(buckets, rows_for, 0, 0)?;
        let (mut sum, mut weight) = (0.0, 0.0);
        for (b, rows) in &plan {
            let edge = buckets.edges()[*b];
            let (batch, w) = data.gather(rows, edge, rows_for(edge), buckets)?;
            let batch = E::Batch::from_batch(batch)?;
            let (r, _) = self.run_eval(&batch, RowMask::Weights(&w), false, None)?;
            sum += r.loss_sum;
            weight += w.iter().map(|&x| f64::from(x)).sum::<f64>();
        }
        Ok(sum / weight.max(f64::MIN_POSITIVE))
    }
}
