//! Compositions used by models: activations, softmax and losses, built from [`Tensor`] ops (so
//! they differentiate and emit like any other code). Write them as [`crate::nn`]'s (`nn::relu`,
//! `nn::softmax_cross_entropy`), the one path for layers and losses alike; they live here, under
//! the tracer, because the layers are built on them.
//!
//! Losses return **per-example** values (shape `[batch]`); averaging, and masking the padding of
//! a ragged last batch, is the caller's (the training handle's) business.

use std::panic::Location;

use super::record::{with_recording, Tensor};
use crate::tree::{DType, LeafType};

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

/// `f(x)` computed in f32 when `x` is half precision ([`DType::is_half`]), the result converted
/// back to `x`'s dtype; `f(x)` itself otherwise. The reductions of [`softmax`],
/// [`log_softmax`], [`softmax_cross_entropy`] and the normalization layers run so (as a
/// [`Precision`](crate::train::Precision) that computes in half precision expects).
#[track_caller]
pub fn in_f32(x: Tensor, f: impl FnOnce(Tensor) -> Tensor) -> Tensor {
    let dtype = x.dtype();
    match dtype.is_half() {
        true => f(x.convert(DType::F32)).convert(dtype),
        false => f(x),
    }
}

/// `t` in f32 when it is half precision, else itself: what a per-example value is reduced in,
/// so that a mean over the batch never rounds to 8 or 11 bits.
#[track_caller]
pub(crate) fn widened(t: Tensor) -> Tensor {
    match t.dtype().is_half() {
        true => t.convert(DType::F32),
        false => t,
    }
}

/// `log(softmax(x))` along `axis`, computed stably (the maximum is subtracted first); in f32
/// for half-precision `x` ([`in_f32`]).
#[track_caller]
pub fn log_softmax(x: Tensor, axis: usize) -> Tensor {
    in_f32(x, |x| log_softmax_as_is(x, axis))
}

/// [`log_softmax`] in `x`'s own dtype.
fn log_softmax_as_is(x: Tensor, axis: usize) -> Tensor {
    // The shift cancels out of the result, so no gradient goes through the maximum.
    let shifted = x - x.max_keep(&[axis]).stop_gradient();
    shifted - shifted.exp().sum_keep(&[axis]).log()
}

/// `softmax(x)` along `axis`, computed stably; in f32 for half-precision `x` ([`in_f32`]).
#[track_caller]
pub fn softmax(x: Tensor, axis: usize) -> Tensor {
    in_f32(x, |x| {
        let e = (x - x.max_keep(&[axis]).stop_gradient()).exp();
        e / e.sum_keep(&[axis])
    })
}

/// Checks that `labels` fit `logits` for a classification op: integer labels of shape exactly
/// `logits.dims()[..rank - 1]`. On a mistake, records it as `op`'s trace error at `at` (naming
/// both types) and returns `false`.
fn labels_fit(logits: Tensor, labels: Tensor, op: &'static str, at: &Location<'_>) -> bool {
    with_recording(|r| {
        if !r.owns(logits, op, at) || !r.owns(labels, op, at) {
            return false;
        }
        let (lt, yt) = (r.ty_of(logits), r.ty_of(labels));
        let message = if !lt.dtype.is_float() || lt.dims.is_empty() {
            format!(
                "the logits must be a float tensor of rank at least 1 ([.., classes]), got {lt}"
            )
        } else if yt.dtype.is_float() || yt.dtype == DType::Bool {
            format!("the labels must be integer class indices, got {yt} (logits {lt})")
        } else if yt.dims != lt.dims[..lt.dims.len() - 1] {
            format!(
                "the labels {yt} do not fit the logits {lt}: labels must have exactly the \
                 logits' dims without the last (class) dim, {:?}; reshape them (labels of \
                 shape [batch, 1] would otherwise broadcast against every row)",
                &lt.dims[..lt.dims.len() - 1]
            )
        } else {
            return true;
        };
        r.fail(op, message, at, lt);
        false
    })
}

/// The per-example stand-in result (shape `logits.dims()[..rank - 1]`) of a failed op.
fn per_example_stand_in(logits: Tensor) -> Tensor {
    with_recording(|r| {
        let ty = match r.graph.nodes.get(logits.node as usize) {
            Some(n) if r.sees(logits) => n.ty.clone(),
            _ => LeafType::new(DType::F32, &[]),
        };
        let keep = ty.dims.len().saturating_sub(1);
        r.stand_in(LeafType::new(ty.dtype, &ty.dims[..keep]))
    })
}

/// Cross-entropy of `logits` `[.., classes]` against integer class `labels` `[..]`, per example
/// (shape `[..]`, the logits' dims without the last). Half-precision logits are converted to
/// f32 first, and the loss is f32.
///
/// The labels must be an integer tensor whose dims are **exactly** the logits' dims without the
/// last: labels `i32[32, 1]` for logits `f32[32, 10]` are a trace-time error (naming this op,
/// both types and your line), never broadcast into a `[32, 32]` loss.
///
/// A label outside `0..classes` (negative, or `classes` and above) matches no class: its
/// one-hot row is all zeros, so that example's loss is **0** and it contributes **no
/// gradient**, silently. When the labels are a program input (a batch column, as in every
/// model the training handle trains), the program notes them ([`Graph::class_inputs`](super::Graph::class_inputs)) and
/// the handle refuses a batch holding such a label before running it
/// ([`Error::LabelOutOfRange`](crate::Error::LabelOutOfRange), naming the row); labels
/// computed inside the program, or this op called on other data, are not checked.
///
/// ```
/// use nitro::trace::{nn, trace};
/// use nitro::{DType, LeafType};
///
/// let logits = ("logits".to_owned(), LeafType::new(DType::F32, &[32, 10]));
/// let labels = ("labels".to_owned(), LeafType::new(DType::I32, &[32, 1]));
/// let err = trace(&[logits, labels], |x| vec![nn::softmax_cross_entropy(x[0], x[1])]).unwrap_err();
/// assert!(err.to_string().contains("softmax_cross_entropy"));
/// assert!(err.to_string().contains("i32[32,1]"));
/// ```
#[track_caller]
pub fn softmax_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor {
    let at = Location::caller();
    if !labels_fit(logits, labels, "softmax_cross_entropy", at) {
        return per_example_stand_in(logits);
    }
    let dims = logits.dims();
    let classes = dims.last().copied().unwrap_or(0);
    super::record::note_class_input(labels, classes, "softmax_cross_entropy");
    let axis = dims.len().saturating_sub(1);
    // Half-precision logits are widened first: the loss comes back in f32.
    let logits = widened(logits);
    let targets = labels.one_hot(classes, logits.dtype());
    -(targets * log_softmax_as_is(logits, axis)).sum(&[axis])
}

/// Whether each example is classified right, per example: `1` where the first maximum of
/// `logits` along the last dim is at the `labels` class, else `0`, in the logits' dtype (shape
/// `[..]`, the logits' dims without the last). Sum it for the number of correct predictions.
///
/// The labels must fit the logits exactly as for [`softmax_cross_entropy`] (a mismatch is a
/// trace-time error, never a broadcast). An out-of-range label is never right (`0`). A row
/// holding NaN predicts the first NaN's position (see [`Tensor::argmax`]).
#[track_caller]
pub fn correct(logits: Tensor, labels: Tensor) -> Tensor {
    let at = Location::caller();
    if !labels_fit(logits, labels, "correct", at) {
        return per_example_stand_in(logits);
    }
    let axis = logits.rank() - 1;
    super::record::note_class_input(labels, logits.dims()[axis], "correct");
    let index = if labels.dtype() == DType::I64 {
        DType::I64
    } else {
        DType::I32
    };
    logits
        .argmax(axis)
        .convert(index)
        .equal(labels.convert(index))
        .convert(logits.dtype())
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

/// Dropout while training: each element kept with probability `1 − rate` and scaled by
/// `1 / (1 − rate)`, or zeroed — with a mask drawn from the step's key
/// ([`random::next_step_key`](crate::ops::random::next_step_key), a fresh key per call). In
/// an evaluation program (and outside the training handle's programs) it is `x` itself. The
/// model must declare `const RANDOM: bool = true;` in its `impl Model`; without it dropout is a
/// trace-time error rather than silently off. `rate` must be in `[0, 1)`; a rate of 0 is `x`
/// itself and draws nothing (a model whose dropout is off needs no key).
#[track_caller]
pub fn dropout(x: Tensor, rate: f64) -> Tensor {
    let at = Location::caller();
    if !(0.0..1.0).contains(&rate) {
        return with_recording(|r| {
            let ty = r.ty_of(x);
            r.fail(
                "dropout",
                format!("the rate must be in [0, 1), got {rate}"),
                at,
                ty,
            )
        });
    }
    if rate == 0.0 {
        return x;
    }
    let Some(key) = crate::ops::random::next_step_key() else {
        return x;
    };
    if rate == 0.0 {
        return x;
    }
    let keep = crate::ops::random::bernoulli(key, 1.0 - rate, &x.dims());
    Tensor::select(keep, x / (1.0 - rate), 0.0)
}
