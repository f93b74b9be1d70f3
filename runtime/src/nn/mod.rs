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

use crate::error::{Error, Result};
use crate::init::{self, Seed};
use crate::trace::{Conv, Tensor, Window};
use crate::tree::{Array, DType, LeafType, Tree};

mod cached;
mod gpt2;
mod recurrent;
mod repeated;

pub use cached::stack_cached;
pub use gpt2::{Gpt2, Gpt2Params, Gpt2ParamsMirror};
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
    let _caller = crate::trace::caller_scope();
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
    let _caller = crate::trace::caller_scope();
    x * ((x * std::f64::consts::FRAC_1_SQRT_2).erf() + 1.0) * 0.5
}

/// GELU's tanh approximation: `x · (1 + tanh(√(2/π) · (x + 0.044715 x³))) / 2`.
#[track_caller]
pub fn gelu_tanh(x: Tensor) -> Tensor {
    let _caller = crate::trace::caller_scope();
    let c = (2.0 / std::f64::consts::PI).sqrt();
    x * (((x + x * x * x * 0.044715) * c).tanh() + 1.0) * 0.5
}

/// SiLU (swish): `x · σ(x)`.
#[track_caller]
pub fn silu(x: Tensor) -> Tensor {
    let _caller = crate::trace::caller_scope();
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
        let _caller = crate::trace::caller_scope();
        let y = x.matmul(p.w);
        match p.b {
            Some(b) => y + b,
            None => y,
        }
    }
}

// ---- convolution and pooling -----------------------------------------------------------------

/// How a 2-D window pads its input.
///
/// | nitro | PyTorch | TensorFlow / JAX |
/// | --- | --- | --- |
/// | `Padding::Valid` | `padding=0` | `"VALID"` |
/// | `Padding::Symmetric(ph, pw)` | `padding=(ph, pw)`: `ph` rows above *and* below | — |
/// | `Padding::Same` | `padding="same"` (stride 1 only) | `"SAME"`: odd padding's extra row after |
/// | `Padding::Explicit(vec![(lo, hi), (lo, hi)])` | `F.pad` then `padding=0` | `[(lo, hi), …]` |
///
/// At stride 2, PyTorch's `padding=1` is not `Same`: a 3×3 kernel over 4 rows pads one row on
/// each side (`Symmetric(1, 1)`), where `Same` pads none above and one below — the same output
/// shape and other values.
#[derive(crate::ContentHash, Clone, Debug, PartialEq, Eq)]
pub enum Padding {
    /// `ceil(n / stride)` outputs per spatial dim, the padding split evenly (odd one after).
    Same,
    /// No padding.
    Valid,
    /// `(low, high)` for height, then width.
    Explicit(Vec<(i64, i64)>),
    /// PyTorch's `padding=(h, w)`: `h` rows on both sides of the height, `w` columns on both
    /// sides of the width.
    Symmetric(usize, usize),
}

impl Padding {
    /// `(low, high)` per spatial dim for an input of spatial dims `input` (height, width); an
    /// amount past `i64::MAX` (what the convolution op takes) is refused, never wrapped.
    fn pairs(
        &self,
        input: (usize, usize),
        kernel: (usize, usize),
        stride: (usize, usize),
        dilation: (usize, usize),
    ) -> std::result::Result<Vec<(i64, i64)>, String> {
        Ok(match self {
            Padding::Same => crate::ops::window::same_padding(
                &[input.0, input.1],
                &[kernel.0, kernel.1],
                &[stride.0, stride.1],
                &[dilation.0, dilation.1],
            ),
            Padding::Valid => vec![(0, 0), (0, 0)],
            Padding::Explicit(p) => p.clone(),
            Padding::Symmetric(h, w) => {
                let amount = |n: usize| {
                    i64::try_from(n).map_err(|_| {
                        format!(
                            "Padding::Symmetric({h}, {w}) pads {n} on a side, past the largest \
                             padding a convolution takes ({}); pad less",
                            i64::MAX
                        )
                    })
                };
                let (h, w) = (amount(*h)?, amount(*w)?);
                vec![(h, h), (w, w)]
            }
        })
    }
}

/// Where a 2-D layer's channels are.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Channels {
    /// `[N, H, W, C]` data and, for [`Conv2d`], HWIO kernels `[kh, kw, in, out]` (JAX's and
    /// TensorFlow's layout).
    #[default]
    Last,
    /// `[N, C, H, W]` data and, for [`Conv2d`], OIHW kernels `[out, in, kh, kw]` (PyTorch's
    /// layout: its weights load without a permute).
    First,
}

impl Channels {
    /// The positions of height, width and channels in a rank-4 `[N, …]` shape.
    fn hwc(self) -> (usize, usize, usize) {
        match self {
            Channels::Last => (1, 2, 3),
            Channels::First => (2, 3, 1),
        }
    }
}

/// A 2-D convolution: channels-last input `[N, H, W, C]` with an HWIO kernel by default,
/// channels-first `[N, C, H, W]` with an OIHW kernel with [`Conv2d::channels_first`].
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
    /// Where the channels are, in the data and the kernel.
    pub channels: Channels,
}

/// A [`Conv2d`]'s parameters: `w` is `[kh, kw, inputs / groups, outputs]` (channels last) or
/// `[outputs, inputs / groups, kh, kw]` (channels first), `b` `[outputs]`.
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
            channels: Channels::Last,
        }
    }

    /// Over channels-first data `[N, C, H, W]` with an OIHW kernel, as PyTorch's
    /// `nn.Conv2d`.
    pub fn channels_first(mut self) -> Conv2d {
        self.channels = Channels::First;
        self
    }

    /// The dims of one example's output for one example's input dims (`[H, W, C]`, or
    /// `[C, H, W]` channels first; no batch dim).
    ///
    /// ```
    /// use nitro::nn::{Conv2d, Padding};
    /// let conv = Conv2d::new(1, 8, (3, 3)).stride(2, 2).padding(Padding::Symmetric(1, 1));
    /// assert_eq!(conv.output_dims(&[28, 28, 1])?, [14, 14, 8]);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    ///
    /// The convolution op's own type rule decides, on the same padding the forward pass
    /// uses: what it refuses (a padding past `i64::MAX`, a window larger than the padded input,
    /// a rank other than 3) is an [`Error::Layer`] with the message a trace of the forward pass
    /// fails with.
    pub fn output_dims(&self, input: &[usize]) -> Result<Vec<usize>> {
        let (h, w, _) = self.channels.hwc();
        let x: Vec<usize> = std::iter::once(1).chain(input.iter().copied()).collect();
        let hw = (
            x.get(h).copied().unwrap_or(0),
            x.get(w).copied().unwrap_or(0),
        );
        let ty = |d: &[usize]| LeafType::new(DType::F32, d);
        let out = self
            .conv(hw)
            .and_then(|conv| crate::ops::conv::conv_type(&ty(&x), &ty(&self.kernel_dims()), &conv));
        out.map(|out| out.dims[1..].to_vec())
            .map_err(|problem| layer_error(self, input, problem))
    }

    /// The kernel's dims: HWIO channels last, OIHW channels first.
    fn kernel_dims(&self) -> [usize; 4] {
        let per = self.inputs / self.groups.max(1);
        let (kh, kw) = self.kernel;
        match self.channels {
            Channels::Last => [kh, kw, per, self.outputs],
            Channels::First => [self.outputs, per, kh, kw],
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

    /// The convolution op for an input of spatial dims `hw`: the one rule both
    /// [`output_dims`](Conv2d::output_dims) and the forward pass follow.
    fn conv(&self, hw: (usize, usize)) -> std::result::Result<Conv, String> {
        let dims = match self.channels {
            Channels::Last => crate::trace::ir::ConvDims::channels_last(2),
            Channels::First => crate::trace::ir::ConvDims::channels_first(2),
        };
        let padding = self
            .padding
            .pairs(hw, self.kernel, self.stride, self.dilation)?;
        Ok(Conv::new(dims)
            .strides(&[self.stride.0, self.stride.1])
            .rhs_dilation(&[self.dilation.0, self.dilation.1])
            .feature_groups(self.groups)
            .padding(&padding))
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
            w: init::normal(&self.kernel_dims(), 0.0, std, seed),
            b: self.bias.then(|| Array::zeros(DType::F32, &[self.outputs])),
        }
    }

    #[track_caller]
    fn forward(&self, p: &Conv2dParamsMirror<Tensor>, x: Tensor) -> Tensor {
        let _caller = crate::trace::caller_scope();
        let d = x.dims();
        let (h, w, _) = self.channels.hwc();
        let hw = (
            d.get(h).copied().unwrap_or(0),
            d.get(w).copied().unwrap_or(0),
        );
        let conv = match self.conv(hw) {
            Ok(conv) => conv,
            Err(problem) => return crate::trace::refuse_at("Conv2d", problem, x),
        };
        let y = x.conv(p.w, &conv);
        match (p.b, self.channels) {
            (Some(b), Channels::Last) => y + b,
            (Some(b), Channels::First) => y + b.reshape(&[self.outputs, 1, 1]),
            (None, _) => y,
        }
    }
}

/// 2-D pooling on `[N, H, W, C]` (or `[N, C, H, W]` with [`Pool2d::channels_first`]): the
/// maximum or the mean of each window, windows that fit only — PyTorch's `MaxPool2d` and
/// `AvgPool2d` with `padding=0, ceil_mode=False` (a trailing row or column that no whole window
/// covers is dropped: 7 rows pooled 2 by 2 give 3), JAX's `"VALID"` pooling.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2d {
    /// Window height and width.
    pub window: (usize, usize),
    /// Strides.
    pub stride: (usize, usize),
    /// Maximum (`true`) or mean.
    pub max: bool,
    /// Where the channels are.
    pub channels: Channels,
}

impl Pool2d {
    /// Over channels-first data `[N, C, H, W]`.
    pub fn channels_first(mut self) -> Pool2d {
        self.channels = Channels::First;
        self
    }

    /// The dims of one example's output for one example's input dims (no batch dim).
    ///
    /// ```
    /// assert_eq!(nitro::nn::max_pool2d((2, 2), (2, 2)).output_dims(&[7, 7, 16])?, [3, 3, 16]);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    ///
    /// The window ops' own type rule decides (so it agrees with the forward pass): what it
    /// refuses (a window larger than the input, a rank other than 3) is an [`Error::Layer`]
    /// with the message a trace of the forward pass fails with.
    pub fn output_dims(&self, input: &[usize]) -> Result<Vec<usize>> {
        let x: Vec<usize> = std::iter::once(1).chain(input.iter().copied()).collect();
        crate::ops::window::window_dims(&x, &self.window())
            .map(|out| out[1..].to_vec())
            .map_err(|problem| layer_error(self, input, problem))
    }

    /// The window over `[N, …]`: `window` and `stride` on the height and width dims.
    fn window(&self) -> Window {
        let (h, w, _) = self.channels.hwc();
        let (mut dims, mut strides) = ([1; 4], [1; 4]);
        (dims[h], dims[w]) = self.window;
        (strides[h], strides[w]) = self.stride;
        Window::new(&dims).strides(&strides)
    }
}

/// Max pooling (`window` and `stride`, no padding).
pub fn max_pool2d(window: (usize, usize), stride: (usize, usize)) -> Pool2d {
    Pool2d {
        window,
        stride,
        max: true,
        channels: Channels::Last,
    }
}

/// Average pooling (`window` and `stride`, no padding: every window is full).
pub fn avg_pool2d(window: (usize, usize), stride: (usize, usize)) -> Pool2d {
    Pool2d {
        window,
        stride,
        max: false,
        channels: Channels::Last,
    }
}

impl Layer for Pool2d {
    type Params = ();

    fn init(&self, _: Seed) {}

    #[track_caller]
    fn forward(&self, _: &(), x: Tensor) -> Tensor {
        let _caller = crate::trace::caller_scope();
        let w = self.window();
        if self.max {
            x.window_max(&w)
        } else {
            x.window_sum(&w) / (self.window.0 * self.window.1) as f64
        }
    }
}

/// `[N, …] → [N, product of the rest]`: the dense layer after a conv stack. Channels last, the
/// features come out in `(h, w, c)` order; channels first, in PyTorch's `(c, h, w)` order.
#[derive(crate::ContentHash, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flatten;

impl Layer for Flatten {
    type Params = ();

    fn init(&self, _: Seed) {}

    #[track_caller]
    fn forward(&self, _: &(), x: Tensor) -> Tensor {
        let _caller = crate::trace::caller_scope();
        let d = x.dims();
        let n = d.first().copied().unwrap_or(1);
        match crate::tree::dims_product(d.get(1..).unwrap_or(&[])) {
            Some(features) => x.reshape(&[n, features]),
            None => crate::trace::refuse_at(
                "Flatten",
                format!(
                    "the product of the dims after the batch, {:?}, overflows a size",
                    &d[1..]
                ),
                x,
            ),
        }
    }
}

/// A layer whose output dims follow from its input dims — one example's, without the batch
/// dim — so a model's widths are computed, not written by hand ([`dims_after`]).
pub trait OutputDims {
    /// The output dims for input dims `input`, by the rule the layer's forward pass follows:
    /// what would fail its trace is an [`Error::Layer`] here.
    fn output_dims(&self, input: &[usize]) -> Result<Vec<usize>>;
}

impl OutputDims for Conv2d {
    /// `[H, W, C]` in, `[H', W', outputs]` out (`[C, H, W]` → `[outputs, H', W']` channels
    /// first).
    fn output_dims(&self, input: &[usize]) -> Result<Vec<usize>> {
        self.output_dims(input)
    }
}

impl OutputDims for Pool2d {
    fn output_dims(&self, input: &[usize]) -> Result<Vec<usize>> {
        self.output_dims(input)
    }
}

impl OutputDims for Flatten {
    /// The product of the dims, checked.
    fn output_dims(&self, input: &[usize]) -> Result<Vec<usize>> {
        crate::tree::dims_product(input)
            .map(|n| vec![n])
            .ok_or_else(|| {
                layer_error(
                    self,
                    input,
                    "the product of the dims overflows a size".into(),
                )
            })
    }
}

impl OutputDims for Linear {
    fn output_dims(&self, input: &[usize]) -> Result<Vec<usize>> {
        let mut out = input.to_vec();
        match out.last_mut() {
            Some(last) => *last = self.outputs,
            None => out.push(self.outputs),
        }
        Ok(out)
    }
}

/// The [`Error::Layer`] of `layer` refusing input dims `input`.
fn layer_error(layer: &impl std::fmt::Debug, input: &[usize], problem: String) -> Error {
    Error::Layer {
        layer: format!("{layer:?}"),
        input: input.to_vec(),
        problem,
    }
}

/// The dims after `layers`, in order, for one example's input dims `input`.
///
/// ```
/// use nitro::nn::{self, Conv2d, Flatten, Linear};
/// let (conv1, conv2) = (Conv2d::new(1, 16, (3, 3)), Conv2d::new(16, 32, (3, 3)));
/// let pool = nn::max_pool2d((2, 2), (2, 2));
/// let flat = nn::dims_after(&[28, 28, 1], &[&conv1, &pool, &conv2, &pool, &Flatten])?;
/// assert_eq!(flat, [7 * 7 * 32]);
/// let head = Linear::new(flat[0], 10);
/// # let _ = head;
/// # Ok::<(), nitro::Error>(())
/// ```
///
/// The first layer whose rule refuses its input stops it with that layer's [`Error::Layer`].
pub fn dims_after(input: &[usize], layers: &[&dyn OutputDims]) -> Result<Vec<usize>> {
    layers
        .iter()
        .try_fold(input.to_vec(), |dims, layer| layer.output_dims(&dims))
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
        let _caller = crate::trace::caller_scope();
        p.table.take(ids, 0)
    }

    /// The rows of positions `0..time`, `[time, dim]`: a learned position table (GPT's `wpe`)
    /// read for a sequence of `time` tokens. A sequence longer than the table fails the trace
    /// naming both lengths — looked up with [`lookup`](Embedding::lookup), positions past the
    /// table would be clamped to its last row and give normal-looking outputs.
    ///
    /// ```
    /// use nitro::nn::{Embedding, EmbeddingParamsMirror};
    /// use nitro::trace::trace;
    /// use nitro::{DType, LeafType};
    ///
    /// let table = LeafType::new(DType::F32, &[4, 8]);
    /// let emb = Embedding { vocab: 4, dim: 8 };
    /// let pos = |time: usize| {
    ///     trace(&[("table".into(), table.clone())], |i| {
    ///         vec![emb.positions(&EmbeddingParamsMirror { table: i[0] }, time)]
    ///     })
    /// };
    /// assert_eq!(pos(4)?.output_types()[0].dims, [4, 8]);
    /// let err = pos(6).unwrap_err().to_string();
    /// assert!(err.contains("6 positions") && err.contains("4"), "{err}");
    /// # Ok::<(), nitro::Error>(())
    /// ```
    #[track_caller]
    pub fn positions(&self, p: &EmbeddingParamsMirror<Tensor>, time: usize) -> Tensor {
        let _caller = crate::trace::caller_scope();
        let rows = p.table.dims().first().copied().unwrap_or(0);
        if time > rows {
            return crate::trace::refuse_at(
                "positions",
                format!(
                    "a sequence of {time} positions is longer than the position table's {rows} \
                     rows (the model's context); feed at most {rows} tokens, or build the model \
                     with a longer context"
                ),
                p.table,
            );
        }
        p.table.take(Tensor::iota(DType::I32, &[time], 0), 0)
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
        let _caller = crate::trace::caller_scope();
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
        let _caller = crate::trace::caller_scope();
        let last = x.rank().saturating_sub(1);
        // Half-precision input is normalized in f32, then scaled in its own dtype.
        let normalized = crate::trace::nn::in_f32(x, |x| {
            let centered = x - x.mean_keep(&[last]);
            let var = (centered * centered).mean_keep(&[last]);
            centered * (var + self.eps).rsqrt()
        });
        let y = normalized * p.gain;
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
        let _caller = crate::trace::caller_scope();
        let last = x.rank().saturating_sub(1);
        // Half-precision input is normalized in f32, then scaled in its own dtype.
        let normalized = crate::trace::nn::in_f32(x, |x| {
            let ms = (x * x).mean_keep(&[last]);
            x * (ms + self.eps).rsqrt()
        });
        normalized * p.gain
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
    /// Attention of width `dim` with `heads` heads (causal or not), each head `dim / heads`
    /// wide.
    ///
    /// ```
    /// use nitro::nn::MultiHeadAttention;
    /// assert_eq!(MultiHeadAttention::new(512, 8, true)?.dim, 512);
    /// let err = MultiHeadAttention::new(512, 7, true).unwrap_err().to_string();
    /// assert!(err.contains("7 heads") && err.contains("512"), "{err}");
    /// # Ok::<(), nitro::Error>(())
    /// ```
    ///
    /// Errors: [`Error::LayerShape`] when `heads` is 0 or does not divide `dim` (the
    /// message names the nearest widths that it divides).
    pub fn new(dim: usize, heads: usize, causal: bool) -> Result<MultiHeadAttention> {
        let attention = MultiHeadAttention { dim, heads, causal };
        match attention.problem() {
            None => Ok(attention),
            Some(problem) => Err(Error::LayerShape {
                layer: format!("MultiHeadAttention::new({dim}, {heads}, {causal})"),
                problem,
            }),
        }
    }

    /// Why this attention cannot be built (heads that do not divide the width), in words with
    /// the numbers; `None` when it can. Its forward pass refuses such a layer written as a
    /// literal, at the caller's line.
    pub fn problem(&self) -> Option<String> {
        let (dim, heads) = (self.dim, self.heads);
        if heads == 0 {
            return Some(format!(
                "0 heads: attention of width {dim} needs at least one head"
            ));
        }
        if dim % heads != 0 {
            let below = dim / heads * heads;
            let above = below + heads;
            let nearer = match below {
                0 => format!("{above}"),
                _ => format!("{below} or {above}"),
            };
            return Some(format!(
                "{heads} heads do not divide the width {dim} (each head takes width / heads \
                 features); give a width that {heads} divides ({nearer}), or a head count that \
                 divides {dim}"
            ));
        }
        None
    }

    /// Attention with `keep` (`bool [batch, time]`, true for real tokens) masking padded keys,
    /// on top of the causal mask when the layer is causal.
    #[track_caller]
    pub fn forward_masked(
        &self,
        p: &AttentionParamsMirror<Tensor>,
        x: Tensor,
        keep: Option<Tensor>,
    ) -> Tensor {
        let _caller = crate::trace::caller_scope();
        if let Some(problem) = self.problem() {
            return crate::trace::refuse_at("MultiHeadAttention", problem, x);
        }
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
        let _caller = crate::trace::caller_scope();
        self.forward_masked(p, x, None)
    }
}

/// The MLP's activation in a [`TransformerBlock`].
#[derive(crate::ContentHash, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// Exact GELU ([`gelu`]).
    #[default]
    Gelu,
    /// GELU's tanh approximation ([`gelu_tanh`]): GPT-2's `gelu_new`.
    GeluTanh,
    /// ReLU.
    Relu,
}

impl Activation {
    /// The activation applied to `x`.
    #[track_caller]
    pub fn apply(self, x: Tensor) -> Tensor {
        let _caller = crate::trace::caller_scope();
        match self {
            Activation::Gelu => gelu(x),
            Activation::GeluTanh => gelu_tanh(x),
            Activation::Relu => relu(x),
        }
    }
}

/// A pre-norm transformer block: `x + drop(attn(ln₁(x)))`, then `x + drop(fc₂(act(fc₁(ln₂(x)))))`.
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq)]
pub struct TransformerBlock {
    /// Its attention.
    pub attention: MultiHeadAttention,
    /// Width of the MLP's hidden layer.
    pub hidden: usize,
    /// Dropout after the attention and the MLP, while training (0 for none).
    pub dropout: f64,
    /// The norms' `eps` (1e-5, PyTorch's and GPT-2's).
    pub eps: f64,
    /// The MLP's activation.
    pub activation: Activation,
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
    ///
    /// ```
    /// use nitro::nn::TransformerBlock;
    /// assert_eq!(TransformerBlock::causal(512, 8)?.hidden, 2048);
    /// let err = TransformerBlock::causal(512, 7).unwrap_err().to_string();
    /// assert!(err.contains("7 heads do not divide the width 512"), "{err}");
    /// # Ok::<(), nitro::Error>(())
    /// ```
    ///
    /// Errors: [`Error::LayerShape`] when `heads` is 0 or does not divide `dim`.
    pub fn causal(dim: usize, heads: usize) -> Result<TransformerBlock> {
        let block = TransformerBlock::causal_unchecked(dim, heads);
        match block.attention.problem() {
            None => Ok(block),
            Some(problem) => Err(Error::LayerShape {
                layer: format!("TransformerBlock::causal({dim}, {heads})"),
                problem,
            }),
        }
    }

    /// [`causal`](TransformerBlock::causal) without the check (for a shape checked already).
    pub(crate) fn causal_unchecked(dim: usize, heads: usize) -> TransformerBlock {
        TransformerBlock {
            attention: MultiHeadAttention {
                dim,
                heads,
                causal: true,
            },
            hidden: 4 * dim,
            dropout: 0.0,
            eps: 1e-5,
            activation: Activation::Gelu,
        }
    }

    fn norm(&self) -> LayerNorm {
        LayerNorm {
            dim: self.attention.dim,
            eps: self.eps,
        }
    }
}

impl Layer for TransformerBlock {
    type Params = BlockParams;

    fn init(&self, seed: Seed) -> BlockParams {
        let d = self.attention.dim;
        let ln = self.norm();
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
        let _caller = crate::trace::caller_scope();
        let d = self.attention.dim;
        let ln = self.norm();
        let a = self.attention.forward(&p.attention, ln.forward(&p.ln1, x));
        let x = x + dropout(a, self.dropout);
        let m = Linear::new(d, self.hidden).forward(&p.fc1, ln.forward(&p.ln2, x));
        let m = Linear::new(self.hidden, d).forward(&p.fc2, self.activation.apply(m));
        x + dropout(m, self.dropout)
    }
}
