//! Optimizers, gradient clipping and learning-rate schedules.
//!
//! An optimizer is a **configuration** whose constants shape the update program — so it is
//! [`ContentHash`] and enters that program's compile key — plus **state** per trainable leaf
//! (Adam's `m` and `v`), which is Device data: it lives beside the parameters, never in the key.
//! The learning rate is not a constant of the optimizer: it is a traced scalar written each
//! step, so a [`Schedule`] never recompiles anything.
//!
//! [`update_graph`] traces one optimizer step for given parameter types, the program a training
//! handle compiles once and runs every step:
//!
//! ```
//! use nitro::optim::{self, Adam, Optimizer};
//! use nitro::{Array, DType, LeafType};
//!
//! let leaves = [LeafType::new(DType::F32, &[3])];
//! let graph = optim::update_graph(&Adam::default(), &leaves)?;
//! // Inputs: params, grads, Adam's m and v, the learning rate, the step number.
//! assert_eq!(graph.input_types().len(), 6);
//! let p = Array::full(&[3], 1.0f32);
//! let g = Array::full(&[3], 0.5f32);
//! let zeros = Array::zeros(DType::F32, &[3]);
//! let (lr, step) = (Array::scalar(0.1f32), Array::scalar(1.0f32));
//! let out = nitro::backend::interp::run_refs(&graph, &[&p, &g, &zeros, &zeros, &lr, &step])?;
//! // Adam's first step moves each parameter by about `lr`.
//! assert!(out[0].as_slice::<f32>()?.iter().all(|v| (v - 0.9).abs() < 1e-4));
//! # Ok::<(), nitro::Error>(())
//! ```

use std::fmt;

use crate::error::Result;
use crate::hash::ContentHash;
use crate::trace::{self, Graph, Tensor};
use crate::tree::{DType, LeafType};

/// The scalars every step sees — the learning rate and the 1-based step number, both traced
/// `f32[]` inputs (never constants, so changing them never recompiles) — and the per-leaf mask
/// of the optimizer's [`leaf_mask`](Optimizer::leaf_mask), when it asked for one.
#[derive(Clone, Copy, Debug)]
pub struct Step<'a> {
    /// The learning rate of this step.
    pub lr: Tensor,
    /// The number of this step, from 1 (Adam's bias correction uses it).
    pub number: Tensor,
    masks: &'a [Option<Tensor>],
}

impl<'a> Step<'a> {
    /// A step without masks: every parameter is wholly selected.
    pub fn new(lr: Tensor, number: Tensor) -> Step<'static> {
        Step {
            lr,
            number,
            masks: &[],
        }
    }

    /// This step with a mask per parameter (`None`: wholly selected).
    pub fn with_masks(self, masks: &'a [Option<Tensor>]) -> Step<'a> {
        Step { masks, ..self }
    }

    /// The mask of parameter `i`, of its type: 1 where the optimizer's
    /// [`leaf_mask`](Optimizer::leaf_mask) selected the element's leaf, 0 elsewhere; `None`
    /// when every element is selected (no mask was asked for, or every leaf of the parameter is
    /// selected). With the training handle a parameter is a packed array of many leaves, so
    /// the mask is per element, not per parameter.
    pub fn mask(&self, i: usize) -> Option<Tensor> {
        self.masks.get(i).copied().flatten()
    }
}

/// An optimizer: constants that shape the update (its [`ContentHash`]), state slots per
/// trainable leaf, and the traced update.
///
/// The update program is keyed on the optimizer's type as well as its content hash (two
/// optimizers without fields hash alike), so a custom optimizer needs no more than this trait.
pub trait Optimizer: ContentHash + Clone + fmt::Debug + Send + Sync + 'static {
    /// A short name for the update program's identity (`adam`, `sgd`).
    fn name(&self) -> &'static str;

    /// The state kept per trainable leaf, by slot name (Adam: `m`, `v`); each slot holds an
    /// array of the leaf's type, zero at the start.
    fn slots(&self) -> &'static [&'static str];

    /// Which trainable leaves a per-leaf option of this optimizer covers (AdamW: which leaves
    /// are decayed), given every trainable leaf's path and type in walk order: one `bool` per
    /// leaf, or `None` (the default) when every leaf is covered. The update program then sees
    /// the selection as [`Step::mask`]; it is part of that program (and so of its key).
    ///
    /// An error for a selection that cannot be meant, such as a pattern that names no leaf.
    fn leaf_mask(&self, leaves: &[(&str, &LeafType)]) -> Result<Option<Vec<bool>>> {
        let _ = leaves;
        Ok(None)
    }

    /// One step, traced: the new parameters, and the new state (`state[slot][leaf]`, in the
    /// order of [`slots`](Optimizer::slots)). `grads` and every state slot line up with
    /// `params`.
    fn update(
        &self,
        step: Step<'_>,
        params: &[Tensor],
        grads: &[Tensor],
        state: &[Vec<Tensor>],
    ) -> (Vec<Tensor>, Vec<Vec<Tensor>>);
}

/// Plain stochastic gradient descent: `p ← p − lr·g`.
#[derive(crate::ContentHash, Clone, Copy, Debug, Default, PartialEq)]
pub struct Sgd;

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        "sgd"
    }

    fn slots(&self) -> &'static [&'static str] {
        &[]
    }

    fn update(
        &self,
        step: Step<'_>,
        params: &[Tensor],
        grads: &[Tensor],
        _: &[Vec<Tensor>],
    ) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
        let new = params
            .iter()
            .zip(grads)
            .map(|(&p, &g)| p - step.lr * g)
            .collect();
        (new, Vec::new())
    }
}

/// SGD with momentum: `v ← β·v + g`, then `p ← p − lr·v`, or with Nesterov's correction
/// `p ← p − lr·(g + β·v)`.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq)]
pub struct Momentum {
    /// The momentum coefficient β (0.9).
    pub beta: f64,
    /// Nesterov's accelerated form.
    pub nesterov: bool,
}

impl Default for Momentum {
    fn default() -> Momentum {
        Momentum {
            beta: 0.9,
            nesterov: false,
        }
    }
}

impl Optimizer for Momentum {
    fn name(&self) -> &'static str {
        if self.nesterov {
            "nesterov"
        } else {
            "momentum"
        }
    }

    fn slots(&self) -> &'static [&'static str] {
        &["velocity"]
    }

    fn update(
        &self,
        step: Step<'_>,
        params: &[Tensor],
        grads: &[Tensor],
        state: &[Vec<Tensor>],
    ) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
        let mut new_params = Vec::with_capacity(params.len());
        let mut new_v = Vec::with_capacity(params.len());
        for ((&p, &g), &v) in params.iter().zip(grads).zip(&state[0]) {
            let v = v * self.beta + g;
            let direction = if self.nesterov { g + v * self.beta } else { v };
            new_params.push(p - step.lr * direction);
            new_v.push(v);
        }
        (new_params, vec![new_v])
    }
}

/// Adam: moving averages of the gradient (`m`) and its square (`v`) with bias correction;
/// `p ← p − lr·m̂ / (√v̂ + ε)`.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    /// Decay of the first moment (0.9).
    pub beta1: f64,
    /// Decay of the second moment (0.999).
    pub beta2: f64,
    /// Added to the denominator (1e-8).
    pub eps: f64,
}

impl Default for Adam {
    fn default() -> Adam {
        Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

impl Adam {
    /// The bias-corrected direction of one leaf, and its new moments.
    fn direction(
        &self,
        step: Step<'_>,
        g: Tensor,
        m: Tensor,
        v: Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let m = m * self.beta1 + g * (1.0 - self.beta1);
        let v = v * self.beta2 + g * g * (1.0 - self.beta2);
        // βᵗ = exp(t·ln β): the step number is traced, so no program per step.
        let c1 = 1.0 - (step.number * self.beta1.ln()).exp();
        let c2 = 1.0 - (step.number * self.beta2.ln()).exp();
        let m_hat = m / c1;
        let v_hat = v / c2;
        (m_hat / (v_hat.sqrt() + self.eps), m, v)
    }

    /// One Adam step of every leaf, with decoupled weight decay `decay` (0 for plain Adam):
    /// new parameters, and the new `m` and `v`.
    fn step_with_decay(
        &self,
        step: Step<'_>,
        params: &[Tensor],
        grads: &[Tensor],
        state: &[Vec<Tensor>],
        decay: f64,
    ) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
        let mut out = (Vec::new(), vec![Vec::new(), Vec::new()]);
        for (i, (&p, &g)) in params.iter().zip(grads).enumerate() {
            let (d, m, v) = self.direction(step, g, state[0][i], state[1][i]);
            let d = match (decay == 0.0, step.mask(i)) {
                (true, _) => d,
                (false, None) => d + p * decay,
                (false, Some(mask)) => d + p * mask * decay,
            };
            out.0.push(p - step.lr * d);
            out.1[0].push(m);
            out.1[1].push(v);
        }
        out
    }
}

impl Optimizer for Adam {
    fn name(&self) -> &'static str {
        "adam"
    }

    fn slots(&self) -> &'static [&'static str] {
        &["m", "v"]
    }

    fn update(
        &self,
        step: Step<'_>,
        params: &[Tensor],
        grads: &[Tensor],
        state: &[Vec<Tensor>],
    ) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
        self.step_with_decay(step, params, grads, state, 0.0)
    }
}

/// AdamW: Adam with decoupled weight decay, `p ← p − lr·(m̂ / (√v̂ + ε) + λ·p)` — on every
/// trainable leaf, or on those whose path matches none of [`no_decay`](AdamW::no_decay)
/// (biases and norm gains, as is usual: `AdamW::default().no_decay(nitro::nn::NO_DECAY)`).
///
/// The selection is by leaf path, as [`crate::tree::LeafPath`] writes it (`blocks[0].fc1.b`);
/// in a pattern `*` matches any run of characters, so `*.b` is every leaf named `b`, and `|`
/// separates alternatives (`*.b|*.bias`). A pattern none of whose alternatives matches a
/// trainable leaf is refused when the training handle is made (a typo would otherwise silently
/// decay what it meant to spare). Which leaves decay shapes the update
/// program, so the selection is in its key; the patterns are part of the optimizer's constants.
#[derive(crate::ContentHash, Clone, Debug, PartialEq)]
pub struct AdamW {
    /// The Adam constants.
    pub adam: Adam,
    /// The weight decay λ (0.01).
    pub weight_decay: f64,
    /// Leaf-path patterns that are not decayed (none by default: every leaf decays).
    pub no_decay: Vec<String>,
}

impl Default for AdamW {
    fn default() -> AdamW {
        AdamW {
            adam: Adam::default(),
            weight_decay: 0.01,
            no_decay: Vec::new(),
        }
    }
}

/// Leaf-path patterns, as [`AdamW::no_decay`] reads them (their home is [`crate::pattern`]).
pub use crate::pattern::path_match;

impl AdamW {
    /// This optimizer, sparing the leaves whose path matches any of `patterns` from decay.
    pub fn no_decay<S: AsRef<str>>(mut self, patterns: impl IntoIterator<Item = S>) -> AdamW {
        self.no_decay
            .extend(patterns.into_iter().map(|p| p.as_ref().to_owned()));
        self
    }

    /// Whether the leaf at `path` decays.
    pub fn decays(&self, path: &str) -> bool {
        self.weight_decay != 0.0 && !self.no_decay.iter().any(|p| path_match(p, path))
    }
}

impl Optimizer for AdamW {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn slots(&self) -> &'static [&'static str] {
        &["m", "v"]
    }

    fn update(
        &self,
        step: Step<'_>,
        params: &[Tensor],
        grads: &[Tensor],
        state: &[Vec<Tensor>],
    ) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
        self.adam
            .step_with_decay(step, params, grads, state, self.weight_decay)
    }

    fn leaf_mask(&self, leaves: &[(&str, &LeafType)]) -> Result<Option<Vec<bool>>> {
        if let Some(unused) = self
            .no_decay
            .iter()
            .find(|p| !leaves.iter().any(|(path, _)| path_match(p, path)))
        {
            let names: Vec<&str> = leaves.iter().map(|(path, _)| *path).collect();
            return Err(crate::Error::InvalidSetting {
                variable: "AdamW::no_decay",
                value: unused.clone(),
                expected: format!(
                    "a pattern matching at least one trainable leaf path (`*` matches any run \
                     of characters, `|` separates alternatives); the trainable leaves are {}",
                    names.join(", ")
                ),
            });
        }
        if self.weight_decay == 0.0 || self.no_decay.is_empty() {
            return Ok(None);
        }
        Ok(Some(
            leaves.iter().map(|(path, _)| self.decays(path)).collect(),
        ))
    }
}

/// Any optimizer with its gradients first scaled so that their global L2 norm (over every
/// leaf) is at most `max_norm`: `g ← g · min(1, max_norm / ‖g‖)`.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq)]
pub struct ClipGlobalNorm<O> {
    /// The optimizer that takes the clipped gradients.
    pub inner: O,
    /// The largest global norm let through.
    pub max_norm: f64,
}

/// Clipping for every optimizer: `Adam::default().clip_global_norm(1.0)`.
pub trait Clip: Optimizer + Sized {
    /// This optimizer on gradients clipped to a global norm of at most `max_norm`.
    fn clip_global_norm(self, max_norm: f64) -> ClipGlobalNorm<Self> {
        ClipGlobalNorm {
            inner: self,
            max_norm,
        }
    }
}

impl<O: Optimizer> Clip for O {}

impl<O: Optimizer> Optimizer for ClipGlobalNorm<O> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn slots(&self) -> &'static [&'static str] {
        self.inner.slots()
    }

    fn leaf_mask(&self, leaves: &[(&str, &LeafType)]) -> Result<Option<Vec<bool>>> {
        self.inner.leaf_mask(leaves)
    }

    fn update(
        &self,
        step: Step<'_>,
        params: &[Tensor],
        grads: &[Tensor],
        state: &[Vec<Tensor>],
    ) -> (Vec<Tensor>, Vec<Vec<Tensor>>) {
        let Some(squares) = grads
            .iter()
            .map(|&g| (g * g).sum_all())
            .reduce(|a, b| a + b)
        else {
            return self.inner.update(step, params, grads, state);
        };
        let norm = squares.sqrt();
        // max_norm / max(‖g‖, max_norm): 1 when within the bound, never a division by zero.
        let scale = self.max_norm / norm.maximum(self.max_norm);
        let clipped: Vec<Tensor> = grads.iter().map(|&g| g * scale).collect();
        self.inner.update(step, params, &clipped, state)
    }
}

/// The update program of `optimizer` for trainable leaves of types `leaves`.
///
/// Inputs, in order: every parameter, every gradient, every state slot's arrays (slot by slot,
/// leaf by leaf; of the leaf's [`state_dtype`], so `f32` for an `f16` or `bf16` leaf), the
/// learning rate `f32[]`, the step number `f32[]` (both converted to the leaves' float type,
/// which all leaves share, or `f32` for half-precision leaves, whose update runs in `f32`).
/// Outputs: the new parameters, then the new state in the same order. Parameters and state can
/// be donated: each output has the type of the input it replaces.
pub fn update_graph<O: Optimizer>(optimizer: &O, leaves: &[LeafType]) -> Result<Graph> {
    let slots = optimizer.slots();
    let mut inputs: Vec<(String, LeafType)> = Vec::new();
    for group in ["param", "grad"].iter().chain(slots) {
        let state = *group != "param" && *group != "grad";
        inputs.extend(leaves.iter().enumerate().map(|(i, t)| {
            let ty = if state {
                LeafType::new(state_dtype(t.dtype), &t.dims)
            } else {
                t.clone()
            };
            (format!("{group}[{i}]"), ty)
        }));
    }
    let scalar = LeafType::new(DType::F32, &[]);
    inputs.push(("lr".into(), scalar.clone()));
    inputs.push(("step".into(), scalar));
    let n = leaves.len();
    trace::trace(&inputs, |t| {
        let (params, rest) = t.split_at(n);
        let (grads, rest) = rest.split_at(n);
        let (state, scalars) = rest.split_at(n * slots.len());
        update_flat(optimizer, params, grads, state, scalars[0], scalars[1], &[])
    })
}

/// One traced step of `optimizer` over flat state (`state` holds every slot's arrays, slot by
/// slot, leaf by leaf): the new parameters, then the new state in the same layout. The
/// learning rate and step number are converted to the parameters' float type. Shared by
/// [`update_graph`] and the training handle's update program.
pub(crate) fn update_flat<O: Optimizer>(
    optimizer: &O,
    params: &[Tensor],
    grads: &[Tensor],
    state: &[Tensor],
    lr: Tensor,
    number: Tensor,
    masks: &[Option<Tensor>],
) -> Vec<Tensor> {
    let n = params.len();
    // Half-precision leaves are updated in f32 (mixed precision): the parameter and gradient
    // are widened, the state is kept in f32, and only the new parameter is narrowed again.
    let widen = |ts: &[Tensor]| -> Vec<Tensor> {
        ts.iter()
            .map(|&t| t.convert(state_dtype(t.dtype())))
            .collect()
    };
    let (wide_params, wide_grads) = (widen(params), widen(grads));
    let state: Vec<Vec<Tensor>> = (0..optimizer.slots().len())
        .map(|s| widen(&state[s * n..(s + 1) * n]))
        .collect();
    let masks: Vec<Option<Tensor>> = masks
        .iter()
        .map(|m| m.map(|m| m.convert(state_dtype(m.dtype()))))
        .collect();
    let dtype = wide_params.first().map_or(DType::F32, |t| t.dtype());
    let step = Step::new(lr.convert(dtype), number.convert(dtype)).with_masks(&masks);
    let (new_params, new_state) = optimizer.update(step, &wide_params, &wide_grads, &state);
    new_params
        .into_iter()
        .zip(params)
        .map(|(new, old)| new.convert(old.dtype()))
        .chain(new_state.into_iter().flatten())
        .collect()
}

/// The dtype an optimizer's state and arithmetic use for a trainable leaf of `dtype`: `f32` for
/// the half-precision `f16` and `bf16` (whose range and precision cannot hold Adam's `ε = 1e-8`
/// or its bias correction `1 − β₂ᵗ`), the leaf's own dtype otherwise.
///
/// ```
/// use nitro::{optim::state_dtype, DType};
/// assert_eq!(state_dtype(DType::BF16), DType::F32);
/// assert_eq!(state_dtype(DType::F64), DType::F64);
/// ```
pub fn state_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    }
}

/// A learning rate per step: written to the Device learning-rate scalar each step, so a
/// schedule never recompiles.
pub trait Schedule: fmt::Debug + Send + Sync {
    /// The learning rate of step `step` (counted from 0).
    fn lr(&self, step: u64) -> f64;
}

/// The same learning rate every step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Constant(pub f64);

impl Schedule for Constant {
    fn lr(&self, _: u64) -> f64 {
        self.0
    }
}

/// `base · factor^(step / every)`: multiplied by `factor` every `every` steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepDecay {
    /// The initial rate.
    pub base: f64,
    /// The factor applied every `every` steps (0.1).
    pub factor: f64,
    /// Steps between decays.
    pub every: u64,
}

impl Schedule for StepDecay {
    fn lr(&self, step: u64) -> f64 {
        let decays = step / self.every.max(1);
        self.base * self.factor.powi(i32::try_from(decays).unwrap_or(i32::MAX))
    }
}

/// Linear warm-up from 0 to `base` over `warmup` steps, then constant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearWarmup {
    /// The rate after warm-up.
    pub base: f64,
    /// Warm-up steps.
    pub warmup: u64,
}

impl Schedule for LinearWarmup {
    fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            self.base * (step + 1) as f64 / self.warmup as f64
        } else {
            self.base
        }
    }
}

/// Linear warm-up over `warmup` steps, then a cosine decay from `base` to `min` at step `total`
/// (and `min` after it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cosine {
    /// The peak rate.
    pub base: f64,
    /// The final rate.
    pub min: f64,
    /// Warm-up steps (0 for none).
    pub warmup: u64,
    /// The step at which the decay ends.
    pub total: u64,
}

impl Schedule for Cosine {
    fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.base * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let t = (step - self.warmup).min(span) as f64 / span as f64;
        self.min + 0.5 * (self.base - self.min) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}
