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
        let (columns, _mask) = batch.into_parts();
        let mut x = None;
        let mut y = None;
        for (name, array) in columns {
            match name.as_str() {
                "x" => x = Some(array),
                "y" => y = Some(array),
                _ => {}
            }
        }
        match (x, y) {
            (Some(x), Some(y)) => Ok(Rows { x, y }),
            (x, _) => Err(nitro::Error::DatasetColumn {
                column: if x.is_none() { "x" } else { "y" }.into(),
                problem: "a digits batch needs the columns `x` (pixels) and `y` (labels); \
                          load the data with `nitro_examples::data::Digits::load`"
                    .into(),
            }),
        }
    }
}

impl Model for DigitsMlp {
    type Batch = Rows;

    fn loss(v: &DigitsMlpView<'_>, batch: &RowsMirror<Tensor>) -> Tensor {
        nitro::trace::nn::softmax_cross_entropy(forward(v, batch.x), batch.y)
    }

    fn correct(v: &DigitsMlpView<'_>, batch: &RowsMirror<Tensor>) -> Option<Tensor> {
        Some(nitro::trace::nn::correct(forward(v, batch.x), batch.y))
    }
}
