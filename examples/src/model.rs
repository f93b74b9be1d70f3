//! The digits classifier as a [`nitro::train::Model`]: what the training handle trains.

use nitro::train::Model;
use nitro::Tensor;

use crate::{forward, Batch, BatchMirror, DigitsMlp, DigitsMlpView};

impl Model for DigitsMlp {
    type Batch = Batch;

    fn loss(v: &DigitsMlpView<'_>, batch: &BatchMirror<Tensor>) -> Tensor {
        nitro::trace::nn::softmax_cross_entropy(forward(v, batch.x), batch.y)
    }

    fn correct(v: &DigitsMlpView<'_>, batch: &BatchMirror<Tensor>) -> Option<Tensor> {
        Some(nitro::trace::nn::correct(forward(v, batch.x), batch.y))
    }
}

impl nitro::train::FromBatch for Batch {
    fn from_batch(batch: nitro::data::Batch) -> nitro::Result<Batch> {
        Ok(Batch::from(batch))
    }
}
