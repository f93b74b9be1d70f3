//! The digits classifier as a [`nitro::train::Model`]: what the training handle trains.

use nitro::train::{FromBatch, Model};
use nitro::{Array, Tensor, Tree};

use crate::{forward, DigitsMlp, DigitsMlpView};

/// What one training step sees: pixels `f32[batch, 64]` and labels `i32[batch]`. (The handle
/// adds the row mask of a padded batch itself.)
#[derive(Tree, Clone, Debug)]
pub struct Rows {
    /// Pixels.
    pub x: Array,
    /// Labels.
    pub y: Array,
}

impl FromBatch for Rows {
    fn from_batch(batch: nitro::data::Batch) -> nitro::Result<Rows> {
        let (x, y, _mask) = crate::xy_columns(batch)?;
        Ok(Rows { x, y })
    }
}

impl Model for DigitsMlp {
    type Batch = Rows;

    fn loss(v: &DigitsMlpView<'_>, batch: &RowsMirror<Tensor>) -> Tensor {
        nitro::nn::softmax_cross_entropy(forward(v, batch.x), batch.y)
    }

    fn correct(v: &DigitsMlpView<'_>, batch: &RowsMirror<Tensor>) -> Option<Tensor> {
        Some(nitro::nn::correct(forward(v, batch.x), batch.y))
    }
}
