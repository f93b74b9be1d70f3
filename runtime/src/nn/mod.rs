//! Layers, in the experiment's own roles: each layer is a **configuration** (`ContentHash`: it
//! shapes the graph, so it goes in a `#[graph_const]` field), a **parameter tree**
//! (`#[derive(Tree)]`: it goes in a `#[device(trainable)]` field), a seeded `init`, and a
//! `forward` over the parameters' tensors in the compile view. Nothing a layer does reaches a
//! program unseen.
//!
//! ```
//! use nitro::nn::{self, Layer, Linear};
//! use nitro::prelude::*;
//!
//! #[derive(ContentHash, Clone, Debug)]
//! pub struct Arch { pub layers: Vec<Linear> }
//!
//! #[derive(Tree)] pub struct Batch { pub x: Array, pub y: Array }
//!
//! #[experiment]
//! pub struct Mlp {
//!     #[graph_const] pub arch: Arch,
//!     #[device(trainable)] pub params: Vec<nn::LinearParams>,
//! }
//!
//! // No hand-indexing: the stack runs each layer on its own parameters, tanh between them.
//! fn logits(v: &MlpView<'_>, x: Tensor) -> Tensor {
//!     nn::stack(&v.arch.layers, &v.params, x, |h| h.tanh())
//! }
//!
//! let arch = Arch { layers: vec![Linear::new(64, 128), Linear::new(128, 10)] };
//! let params = nn::init_stack(&arch.layers, nitro::init::Seed(7));
//! assert_eq!(params[1].w.dims(), &[128, 10]);
//! # let _ = logits;
//! ```
//!
//! Also here: the activations (`gelu`, `gelu_tanh`, `silu`) and, re-exported from
//! [`crate::trace::nn`], the losses and `softmax`/`log_softmax`/`dropout`.

use crate::init::{self, Seed};
use crate::trace::{Conv, Tensor, Window};
use crate::tree::{Array, DType, Tree};

mod recurrent;
mod repeated;

pub use recurrent::{Lstm, LstmParams, LstmParamsMirror};
pub use repeated::Repeated;

pub use crate::trace::nn::{
    correct, dropout, log_softmax, mse, relu, sigmoid, softmax, softmax_cross_entropy,
};

/// A layer: a configuration with a parameter tree, a seeded initializer and a forward pass.
pub trait Layer {
    /// Its parameters (a tree of arrays; `()` for none).
    type Params: Tree;

    /// Fresh parameters from `seed`.
    fn init(&self, seed: Seed) -> Self::Params;

    /// The layer applied to `x`, with its parameters' tensors from the compile view.
    fn forward(&self, params: &<Self::Params as Tree>::Mirror<Tensor>, x: Tensor) -> Tensor;
}

/// A distinct seed for part `k` of what `seed` initializes.
fn part(seed: Seed, k: u64) -> Seed {
    Seed(
        seed.0
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(k.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ 0x94D0_49BB_1331_11EB),
    )
}

/// Parameters for every layer of a stack, layer `i` from its own seed.
pub fn init_stack<L: Layer>(layers: &[L], seed: Seed) -> Vec<L::Params> {
    layers
        .iter()
        .enumerate()
        .map(|(i, l)| l.init(part(seed, i as u64)))
        .collect()
}

/// The layers applied in order, each to its own parameters, with `between` applied between
/// consecutive layers (an activation; `|h| h` for none).
#[track_caller]
pub fn stack<L: Layer>(
    layers: &[L],
    params: &[<L::Params as Tree>::Mirror<Tensor>],
    x: Tensor,
    between: impl Fn(Tensor) -> Tensor,
) -> Tensor {
    let mut h = x;
    for (i, (l, p)) in layers.iter().zip(params).enumerate() {
        if i > 0 {
            h = between(h);
        }
        h = l.forward(p, h);
    }
    h
}

// ---- activations ---------------------------------------------------------------------------

/// Exact GELU: `x · (1 + erf(x / √2)) / 2`.
#[track_caller]
pub fn gelu(x: Tensor) -> Tensor {
    x * ((x * std::f64::consts::FRAC_1_SQRT_2).erf() + 1.0) * 0.5
}

/// GELU's tanh approximation: `x · (1 + tanh(√(2/π) · (x + 0.044715 x³))) / 2`.
#[track_caller]
pub fn gelu_tanh(x: Tensor) -> Tensor {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    x * (((x + x * x * x * 0.044715) * c).tanh() + 1.0) * 0.5
}

/// SiLU (swish): `x · σ(x)`.
#[track_caller]
pub fn silu(x: Tensor) -> Tensor {
    x * x.logistic()
}

// ---- dense ---------------------------------------------------------------------------------

/// A dense layer `x · w + b` on the last dim of `x` (any leading dims).
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear {
    /// Input features.
    pub inputs: usize,
    /// Output features.
    pub outputs: usize,
    /// Whether it adds a bias.
    pub bias: bool,
}

/// A [`Linear`] layer's parameters: `w` is `[inputs, outputs]`, `b` `[outputs]` (when the layer
/// has a bias).
#[derive(crate::Tree, Clone, Debug)]
pub struct LinearParams {
    /// The weights.
    pub w: Array,
    /// The bias.
    pub b: Option<Array>,
}

impl Linear {
    /// `inputs` → `outputs`, with a bias.
    pub fn new(inputs: usize, outputs: usize) -> Linear {
        Linear {
            inputs,
            outputs,
            bias: true,
        }
    }

    /// The same layer without a bias.
    pub fn without_bias(mut self) -> Linear {
        self.bias = false;
        self
    }
}

impl Layer for Linear {
    type Params = LinearParams;

    /// Glorot-uniform weights, a zero bias.
    fn init(&self, seed: Seed) -> LinearParams {
        LinearParams {
            w: init::glorot_uniform(self.inputs, self.outputs, seed),
            b: self.bias.then(|| Array::zeros(DType::F32, &[self.outputs])),
        }
    }

    #[track_caller]
    fn forward(&self, p: &LinearParamsMirror<Tensor>, x: Tensor) -> Tensor {
        let y = x.matmul(p.w);
        match p.b {
            Some(b) => y + b,
            None => y,
        }
    }
}

// ---- convolution and pooling -----------------------------------------------------------------

/// How a 2-D window pads its input.
#[derive(crate::ContentHash, Clone, Debug, PartialEq, Eq)]
pub enum Padding {
    /// `ceil(n / stride)` outputs per spatial dim, the padding split evenly (odd one after).
    Same,
    /// No padding.
    Valid,
    /// `(low, high)` for height, then width.
    Explicit(Vec<(i64, i64)>),
}

/// A 2-D convolution on channels-last input `[N, H, W, C]` with an HWIO kernel.
#[derive(crate::ContentHash, Clone, Debug, PartialEq, Eq)]
pub struct Conv2d {
    /// Input channels.
    pub inputs: usize,
    /// Output channels.
    pub outputs: usize,
    /// Kernel height and width.
    pub kernel: (usize, usize),
    /// Strides.
    pub stride: (usize, usize),
    /// Padding.
    pub padding: Padding,
    /// Kernel dilation.
    pub dilation: (usize, usize),
    /// Channel groups (depthwise when it equals the input channels).
    pub groups: usize,
    /// Whether it adds a bias.
    pub bias: bool,
}

/// A [`Conv2d`]'s parameters: `w` is `[kh, kw, inputs / groups, outputs]`, `b` `[outputs]`.
#[derive(crate::Tree, Clone, Debug)]
pub struct Conv2dParams {
    /// The kernel.
    pub w: Array,
    /// The bias.
    pub b: Option<Array>,
}

impl Conv2d {
    /// A `kh × kw` convolution, stride 1, "SAME" padding, one group, with a bias.
    pub fn new(inputs: usize, outputs: usize, kernel: (usize, usize)) -> Conv2d {
        Conv2d {
            inputs,
            outputs,
            kernel,
            stride: (1, 1),
            padding: Padding::Same,
            dilation: (1, 1),
            groups: 1,
            bias: true,
        }
    }

    /// With these strides.
    pub fn stride(mut self, h: usize, w: usize) -> Conv2d {
        self.stride = (h, w);
        self
    }

    /// With this padding.
    pub fn padding(mut self, padding: Padding) -> Conv2d {
        self.padding = padding;
        self
    }

    /// With this kernel dilation.
    pub fn dilation(mut self, h: usize, w: usize) -> Conv2d {
        self.dilation = (h, w);
        self
    }

    /// With `groups` channel groups.
    pub fn groups(mut self, groups: usize) -> Conv2d {
        self.groups = groups;
        self
    }

    fn conv(&self, hw: (usize, usize)) -> Conv {
        let c = Conv::channels_last(2)
            .strides(&[self.stride.0, self.stride.1])
            .rhs_dilation(&[self.dilation.0, self.dilation.1])
            .feature_groups(self.groups);
        match &self.padding {
            Padding::Same => c.same_for(&[hw.0, hw.1], &[self.kernel.0, self.kernel.1]),
            Padding::Valid => c,
            Padding::Explicit(p) => c.padding(p),
        }
    }
}

impl Layer for Conv2d {
    type Params = Conv2dParams;

    /// He-normal kernel (fan-in `kh · kw · inputs / groups`), a zero bias.
    fn init(&self, seed: Seed) -> Conv2dParams {
        let per = self.inputs / self.groups.max(1);
        let fan_in = self.kernel.0 * self.kernel.1 * per;
        let std = (2.0 / fan_in.max(1) as f64).sqrt();
        Conv2dParams {
            w: init::normal(
                &[self.kernel.0, self.kernel.1, per, self.outputs],
                0.0,
                std,
                seed,
            ),
            b: self.bias.then(|| Array::zeros(DType::F32, &[self.outputs])),
        }
    }

    #[track_caller]
    fn forward(&self, p: &Conv2dParamsMirror<Tensor>, x: Tensor) -> Tensor {
        let d = x.dims();
        let hw = (
            d.get(1).copied().unwrap_or(0),
            d.get(2).copied().unwrap_or(0),
        );
        let y = x.conv(p.w, &self.conv(hw));
        match p.b {
            Some(b) => y + b,
            None => y,
        }
    }
}

/// 2-D pooling on `[N, H, W, C]`: the maximum or the mean of each window.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2d {
    /// Window height and width.
    pub window: (usize, usize),
    /// Strides.
    pub stride: (usize, usize),
    /// Maximum (`true`) or mean.
    pub max: bool,
}

/// Max pooling (`window` and `stride`, no padding).
pub fn max_pool2d(window: (usize, usize), stride: (usize, usize)) -> Pool2d {
    Pool2d {
        window,
        stride,
        max: true,
    }
}

/// Average pooling (`window` and `stride`, no padding: every window is full).
pub fn avg_pool2d(window: (usize, usize), stride: (usize, usize)) -> Pool2d {
    Pool2d {
        window,
        stride,
        max: false,
    }
}

impl Layer for Pool2d {
    type Params = ();

    fn init(&self, _: Seed) {}

    #[track_caller]
    fn forward(&self, _: &(), x: Tensor) -> Tensor {
        let w = Window::new(&[1, self.window.0, self.window.1, 1]).strides(&[
            1,
            self.stride.0,
            self.stride.1,
            1,
        ]);
        if self.max {
            x.window_max(&w)
        } else {
            x.window_sum(&w) / (self.window.0 * self.window.1) as f64
        }
    }
}

// ---- embeddings and norms --------------------------------------------------------------------

/// A lookup table: integer ids `[..]` to vectors `[.., dim]`.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Embedding {
    /// Rows of the table.
    pub vocab: usize,
    /// Width of a row.
    pub dim: usize,
}

/// An [`Embedding`]'s table, `[vocab, dim]`.
#[derive(crate::Tree, Clone, Debug)]
pub struct EmbeddingParams {
    /// The table.
    pub table: Array,
}

impl Embedding {
    /// The rows of `ids` (any integer tensor; ids are clamped into range, see
    /// [`crate::ops::index`]).
    #[track_caller]
    pub fn lookup(&self, p: &EmbeddingParamsMirror<Tensor>, ids: Tensor) -> Tensor {
        p.table.take(ids, 0)
    }
}

impl Layer for Embedding {
    type Params = EmbeddingParams;

    /// Normal rows with standard deviation 0.02 (GPT-2's).
    fn init(&self, seed: Seed) -> EmbeddingParams {
        EmbeddingParams {
            table: init::normal(&[self.vocab, self.dim], 0.0, 0.02, seed),
        }
    }

    #[track_caller]
    fn forward(&self, p: &EmbeddingParamsMirror<Tensor>, ids: Tensor) -> Tensor {
        self.lookup(p, ids)
    }
}

/// Layer normalization over the last dim: `(x − mean) / sqrt(var + eps) · gain + bias`.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq)]
pub struct LayerNorm {
    /// Width of the last dim.
    pub dim: usize,
    /// Added to the variance.
    pub eps: f64,
}

/// A [`LayerNorm`]'s gain and bias, `[dim]` each.
#[derive(crate::Tree, Clone, Debug)]
pub struct NormParams {
    /// The gain.
    pub gain: Array,
    /// The bias (`None` for RMS norm).
    pub bias: Option<Array>,
}

impl LayerNorm {
    /// `eps` 1e-5, as PyTorch's.
    pub fn new(dim: usize) -> LayerNorm {
        LayerNorm { dim, eps: 1e-5 }
    }
}

impl Layer for LayerNorm {
    type Params = NormParams;

    /// Gain 1, bias 0.
    fn init(&self, _: Seed) -> NormParams {
        NormParams {
            gain: Array::full(&[self.dim], 1.0f32),
            bias: Some(Array::zeros(DType::F32, &[self.dim])),
        }
    }

    #[track_caller]
    fn forward(&self, p: &NormParamsMirror<Tensor>, x: Tensor) -> Tensor {
        let last = x.rank().saturating_sub(1);
        let centered = x - x.mean_keep(&[last]);
        let var = (centered * centered).mean_keep(&[last]);
        let y = centered * (var + self.eps).rsqrt() * p.gain;
        match p.bias {
            Some(b) => y + b,
            None => y,
        }
    }
}

/// RMS normalization over the last dim: `x / sqrt(mean(x²) + eps) · gain`.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq)]
pub struct RmsNorm {
    /// Width of the last dim.
    pub dim: usize,
    /// Added to the mean square.
    pub eps: f64,
}

impl RmsNorm {
    /// `eps` 1e-6.
    pub fn new(dim: usize) -> RmsNorm {
        RmsNorm { dim, eps: 1e-6 }
    }
}

impl Layer for RmsNorm {
    type Params = NormParams;

    /// Gain 1, no bias.
    fn init(&self, _: Seed) -> NormParams {
        NormParams {
            gain: Array::full(&[self.dim], 1.0f32),
            bias: None,
        }
    }

    #[track_caller]
    fn forward(&self, p: &NormParamsMirror<Tensor>, x: Tensor) -> Tensor {
        let last = x.rank().saturating_sub(1);
        let ms = (x * x).mean_keep(&[last]);
        x * (ms + self.eps).rsqrt() * p.gain
    }
}

/// The leaves that AdamW's weight decay usually spares, as one
/// [`AdamW::no_decay`](crate::optim::AdamW::no_decay) pattern over this module's parameter
/// names: biases (`*.b`, `*.bias`) and norm gains (`*.gain`).
///
/// ```
/// let adamw = nitro::optim::AdamW::default().no_decay([nitro::nn::NO_DECAY]);
/// assert!(adamw.decays("blocks[0].fc1.w"));
/// assert!(!adamw.decays("blocks[0].fc1.b"));
/// assert!(!adamw.decays("norm.gain"));
/// ```
pub const NO_DECAY: &str = "*.b|*.bias|*.gain";

// ---- attention and the transformer block -----------------------------------------------------

/// What masked attention scores of `f32`, `f64` and `bf16` are set to: large and negative, but
/// finite, so a row whose every key is masked stays finite (its softmax is uniform) instead of
/// turning into NaN. `f16` cannot hold it (it would be −∞): [`masked_score`] gives each dtype's
/// value, and attention uses that.
pub const MASKED: f64 = -1e9;

/// What a masked attention score of `dtype` is set to: [`MASKED`], or for a dtype whose finite
/// range ends before it (`f16`, whose largest is 65504) half its most negative finite value, so
/// that subtracting a row's maximum in the softmax stays finite too.
///
/// ```
/// use nitro::{nn, DType};
/// assert_eq!(nn::masked_score(DType::F32), nn::MASKED);
/// assert!(nn::masked_score(DType::F16) >= -65504.0 / 2.0);
/// assert!(nitro::f16::from_f64(nn::masked_score(DType::F16)).is_finite());
/// ```
pub fn masked_score(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => -f64::from(half::f16::MAX) / 2.0,
        _ => MASKED,
    }
}

/// Multi-head self-attention on `[batch, time, dim]`.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq, Eq)]
pub struct MultiHeadAttention {
    /// Model width (a multiple of `heads`).
    pub dim: usize,
    /// Heads.
    pub heads: usize,
    /// Whether position `t` attends only to positions `≤ t`.
    pub causal: bool,
}

/// A [`MultiHeadAttention`]'s projections, each `[dim, dim]` with a bias.
#[derive(crate::Tree, Clone, Debug)]
pub struct AttentionParams {
    /// Queries.
    pub q: LinearParams,
    /// Keys.
    pub k: LinearParams,
    /// Values.
    pub v: LinearParams,
    /// The output projection.
    pub o: LinearParams,
}

impl MultiHeadAttention {
    /// Attention with `keep` (`bool [batch, time]`, true for real tokens) masking padded keys,
    /// on top of the causal mask when the layer is causal.
    #[track_caller]
    pub fn forward_masked(
        &self,
        p: &AttentionParamsMirror<Tensor>,
        x: Tensor,
        keep: Option<Tensor>,
    ) -> Tensor {
        let d = x.dims();
        let (b, t) = (
            d.first().copied().unwrap_or(1),
            d.get(1).copied().unwrap_or(1),
        );
        let h = self.heads.max(1);
        let dh = self.dim / h;
        let lin = Linear::new(self.dim, self.dim);
        let heads = |w: &LinearParamsMirror<Tensor>| {
            lin.forward(w, x)
                .reshape(&[b, t, h, dh])
                .transpose(&[0, 2, 1, 3])
        };
        let (q, k, v) = (heads(&p.q), heads(&p.k), heads(&p.v));
        let scores = q.matmul(k.transpose(&[0, 1, 3, 2])) / (dh as f64).sqrt();
        let mut allowed: Option<Tensor> = None;
        if self.causal {
            let rows = Tensor::iota(DType::I32, &[t, t], 0);
            let cols = Tensor::iota(DType::I32, &[t, t], 1);
            allowed = Some(rows.greater_equal(cols).reshape(&[1, 1, t, t]));
        }
        if let Some(keep) = keep {
            let k = keep.reshape(&[b, 1, 1, t]);
            allowed = Some(match allowed {
                Some(a) => a
                    .broadcast_to(&[b, 1, t, t])
                    .and(k.broadcast_to(&[b, 1, t, t])),
                None => k,
            });
        }
        let scores = match allowed {
            Some(a) => Tensor::select(a, scores, masked_score(scores.dtype())),
            None => scores,
        };
        let attn = softmax(scores, 3);
        let out = attn
            .matmul(v)
            .transpose(&[0, 2, 1, 3])
            .reshape(&[b, t, self.dim]);
        lin.forward(&p.o, out)
    }
}

impl Layer for MultiHeadAttention {
    type Params = AttentionParams;

    /// Glorot-uniform projections, zero biases.
    fn init(&self, seed: Seed) -> AttentionParams {
        let lin = Linear::new(self.dim, self.dim);
        AttentionParams {
            q: lin.init(part(seed, 0)),
            k: lin.init(part(seed, 1)),
            v: lin.init(part(seed, 2)),
            o: lin.init(part(seed, 3)),
        }
    }

    #[track_caller]
    fn forward(&self, p: &AttentionParamsMirror<Tensor>, x: Tensor) -> Tensor {
        self.forward_masked(p, x, None)
    }
}

/// A pre-norm transformer block: `x + drop(attn(ln₁(x)))`, then `x + drop(fc₂(gelu(fc₁(ln₂(x)))))`.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq)]
pub struct TransformerBlock {
    /// Its attention.
    pub attention: MultiHeadAttention,
    /// Width of the MLP's hidden layer.
    pub hidden: usize,
    /// Dropout after the attention and the MLP, while training (0 for none).
    pub dropout: f64,
}

/// A [`TransformerBlock`]'s parameters.
#[derive(crate::Tree, Clone, Debug)]
pub struct BlockParams {
    /// The first norm.
    pub ln1: NormParams,
    /// The attention.
    pub attention: AttentionParams,
    /// The second norm.
    pub ln2: NormParams,
    /// The MLP's first layer.
    pub fc1: LinearParams,
    /// The MLP's second layer.
    pub fc2: LinearParams,
}

impl TransformerBlock {
    /// A causal block of width `dim` with `heads` heads, a 4× MLP and no dropout.
    pub fn causal(dim: usize, heads: usize) -> TransformerBlock {
        TransformerBlock {
            attention: MultiHeadAttention {
                dim,
                heads,
                causal: true,
            },
            hidden: 4 * dim,
            dropout: 0.0,
        }
    }
}

impl Layer for TransformerBlock {
    type Params = BlockParams;

    fn init(&self, seed: Seed) -> BlockParams {
        let d = self.attention.dim;
        let ln = LayerNorm::new(d);
        BlockParams {
            ln1: ln.init(part(seed, 0)),
            attention: self.attention.init(part(seed, 1)),
            ln2: ln.init(part(seed, 2)),
            fc1: Linear::new(d, self.hidden).init(part(seed, 3)),
            fc2: Linear::new(self.hidden, d).init(part(seed, 4)),
        }
    }

    #[track_caller]
    fn forward(&self, p: &BlockParamsMirror<Tensor>, x: Tensor) -> Tensor {
        let d = self.attention.dim;
        let ln = LayerNorm::new(d);
        let a = self.attention.forward(&p.attention, ln.forward(&p.ln1, x));
        let x = x + dropout(a, self.dropout);
        let m = Linear::new(d, self.hidden).forward(&p.fc1, ln.forward(&p.ln2, x));
        let m = Linear::new(self.hidden, d).forward(&p.fc2, gelu(m));
        x + dropout(m, self.dropout)
    }
}
