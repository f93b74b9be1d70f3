//! Compositions used by models: activations, softmax and losses, built from [`Tensor`] ops (so
//! they differentiate and emit like any other code).
//!
//! Losses return **per-example** values (shape `[batch]`); averaging, and masking the padding of
//! a ragged last batch, is the caller's (the training handle's) business.

use super::Tensor;

/// `max(x, 0)`.
#[track_caller]
pub fn relu(x: Tensor) -> Tensor {
    x.relu()
}

/// `1 / (1 + e^-x)`.
#[track_caller]
pub fn sigmoid(x: Tensor) -> Tensor {
    x.logistic()
}

/// `log(softmax(x))` along `axis`, computed stably (the maximum is subtracted first).
#[track_caller]
pub fn log_softmax(x: Tensor, axis: usize) -> Tensor {
    let shifted = x - x.max_keep(&[axis]);
    shifted - shifted.exp().sum_keep(&[axis]).log()
}

/// `softmax(x)` along `axis`, computed stably.
#[track_caller]
pub fn softmax(x: Tensor, axis: usize) -> Tensor {
    let e = (x - x.max_keep(&[axis])).exp();
    e / e.sum_keep(&[axis])
}

/// Cross-entropy of `logits` `[batch, classes]` against integer `labels` `[batch]`, per example
/// (shape `[batch]`).
#[track_caller]
pub fn softmax_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor {
    let dims = logits.dims();
    let classes = dims.last().copied().unwrap_or(0);
    let axis = dims.len().saturating_sub(1);
    let targets = labels.one_hot(classes, logits.dtype());
    -(targets * log_softmax(logits, axis)).sum(&[axis])
}

/// Squared error per example: the mean of `(pred - target)^2` over every dim but the first
/// (shape `[batch]`).
#[track_caller]
pub fn mse(pred: Tensor, target: Tensor) -> Tensor {
    let d = pred - target;
    let rank = d.rank();
    let axes: Vec<usize> = (1..rank).collect();
    if axes.is_empty() {
        d * d
    } else {
        (d * d).mean(&axes)
    }
}
