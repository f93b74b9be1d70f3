//! Recurrent layers, run over time as one [`Scan`].

use crate::init::{self, Seed};
use crate::trace::{Remat, Scan, Tensor};
use crate::tree::{Array, DType};

use super::{part, Layer};

/// A long short-term memory layer over time: `[batch, time, inputs]` to every step's hidden
/// state, `[batch, time, hidden]`, starting from zero state. Gates in PyTorch's order (input,
/// forget, cell, output): `z = x_t·w_ih + h·w_hh + b`, `c = σ(f)·c + σ(i)·tanh(g)`,
/// `h = σ(o)·tanh(c)`.
///
/// Traced as a [`Scan`] over time, the program holds one step whatever the sequence length;
/// [`Lstm::unrolled`] traces one copy per step instead, for comparison. The input projection of
/// every step is one matrix product before the loop.
///
/// ```
/// use nitro::nn::{Layer, Lstm};
///
/// let lstm = Lstm::new(8, 16);
/// let p = lstm.init(nitro::init::Seed(3));
/// assert_eq!(p.w_ih.dims(), &[8, 64]);
/// assert_eq!(p.w_hh.dims(), &[16, 64]);
/// ```
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lstm {
    /// Input features.
    pub inputs: usize,
    /// Hidden (and cell) state width.
    pub hidden: usize,
    /// What the reverse pass keeps of each step ([`Remat`]).
    pub remat: Remat,
    /// Whether to trace one copy per step instead of a scan (same values).
    pub unrolled: bool,
}

/// An [`Lstm`]'s parameters, the four gates side by side in each (`[·, 4·hidden]`).
#[derive(crate::Tree, Clone, Debug)]
pub struct LstmParams {
    /// Input to gates, `[inputs, 4·hidden]`.
    pub w_ih: Array,
    /// Hidden state to gates, `[hidden, 4·hidden]`.
    pub w_hh: Array,
    /// Gate bias, `[4·hidden]`.
    pub b: Array,
}

impl Lstm {
    /// An LSTM from `inputs` features to a `hidden`-wide state, as a scan saving residuals.
    pub fn new(inputs: usize, hidden: usize) -> Lstm {
        Lstm {
            inputs,
            hidden,
            remat: Remat::Save,
            unrolled: false,
        }
    }

    /// With the reverse pass keeping what `remat` says.
    pub fn remat(mut self, remat: Remat) -> Lstm {
        self.remat = remat;
        self
    }

    /// Traced as one copy per step (`true`) or as a scan (`false`, the default).
    pub fn unrolled(mut self, unrolled: bool) -> Lstm {
        self.unrolled = unrolled;
        self
    }

    /// The layer over `x` (`[batch, time, inputs]`) from state `(h, c)` (each
    /// `[batch, hidden]`): every step's hidden state `[batch, time, hidden]`, then the final
    /// `h` and `c`.
    #[track_caller]
    pub fn run(
        &self,
        p: &LstmParamsMirror<Tensor>,
        x: Tensor,
        h: Tensor,
        c: Tensor,
    ) -> (Tensor, Tensor, Tensor) {
        let _caller = crate::trace::caller_scope();
        let d = x.dims();
        let (b, t) = (
            d.first().copied().unwrap_or(1),
            d.get(1).copied().unwrap_or(1),
        );
        let n = self.hidden;
        // Every step's input projection at once, time first: [time, batch, 4·hidden].
        let z_in = (x.matmul(p.w_ih) + p.b).transpose(&[1, 0, 2]);
        let w_hh = p.w_hh;
        let step = |h: Tensor, c: Tensor, z_in: Tensor| {
            let z = z_in + h.matmul(w_hh);
            let g = z.split(1, &[n, n, n, n]);
            let c = g[1].logistic() * c + g[0].logistic() * g[2].tanh();
            let h = g[3].logistic() * c.tanh();
            (h, c)
        };
        if self.unrolled {
            let (mut h, mut c) = (h, c);
            let mut ys = Vec::with_capacity(t);
            for i in 0..t {
                (h, c) = step(h, c, z_in.narrow(0, i, 1).reshape(&[b, 4 * n]));
                ys.push(h.reshape(&[b, 1, n]));
            }
            return (Tensor::concatenate(&ys, 1), h, c);
        }
        let (carry, ys) = Scan::new()
            .length(t)
            .remat(self.remat)
            .run(&[h, c], &[z_in], |s, z| {
                let (h, c) = step(s[0], s[1], z[0]);
                (vec![h, c], vec![h])
            });
        (ys[0].transpose(&[1, 0, 2]), carry[0], carry[1])
    }
}

impl Layer for Lstm {
    type Params = LstmParams;

    /// Uniform in `±1/√hidden`, as PyTorch.
    fn init(&self, seed: Seed) -> LstmParams {
        let k = 1.0 / (self.hidden.max(1) as f64).sqrt();
        let g = 4 * self.hidden;
        LstmParams {
            w_ih: init::uniform(&[self.inputs, g], -k, k, part(seed, 0)),
            w_hh: init::uniform(&[self.hidden, g], -k, k, part(seed, 1)),
            b: init::uniform(&[g], -k, k, part(seed, 2)),
        }
    }

    #[track_caller]
    fn forward(&self, p: &LstmParamsMirror<Tensor>, x: Tensor) -> Tensor {
        let _caller = crate::trace::caller_scope();
        let b = x.dims().first().copied().unwrap_or(1);
        let zero = Tensor::scalar(0.0, DType::F32).broadcast_to(&[b, self.hidden]);
        self.run(p, x, zero, zero).0
    }
}
