//! Convolution: `stablehlo.convolution` with any number of spatial dims, strides, padding,
//! input (lhs) and kernel (rhs) dilation, feature groups (depthwise) and batch groups, in any
//! dimension layout ([`ConvDims`]: NHWC/HWIO by default, NCHW/OIHW accepted).
//!
//! Per spatial dim, the input is dilated (`lhs_dilation − 1` zeros between elements), padded
//! (`padding`, negative crops), and a kernel dilated by `rhs_dilation` slides over it
//! `strides` at a time: the result has `(padded − dilated kernel) / stride + 1` elements. With
//! `feature_groups = G`, the input's `C` features split into `G` groups of `C / G`, the
//! kernel's input dim is `C / G`, and output feature `o` reads group `o / (O / G)`.
//!
//! VJPs (derived as in JAX's `convolution.py`; both are convolutions):
//! - **input**: the cotangent, dilated by the strides, convolved with the kernel reversed in
//!   its spatial dims and with its feature dims swapped (for groups, regrouped:
//!   `[K…, I, G·O/G] → [K…, O/G, G·I]`); strides = the forward's lhs dilation, padding
//!   `(k_d − 1 − low, lhs_d + k_d − 1 − out_d − before)` with `k_d`, `lhs_d`, `out_d` the
//!   dilated kernel, input and (stride-dilated) cotangent sizes.
//! - **kernel**: the input convolved with the cotangent, the batch dim contracted (the input's
//!   batch and feature roles swapped, the cotangent's batch as kernel input): strides = the
//!   forward's rhs dilation, rhs dilation = the forward's strides, padding
//!   `(low, out_d − lhs_d + k_d − low − 1)`, and `batch_groups = G` for a grouped forward.
//!
//! The gradient of a batch-grouped convolution (itself a kernel gradient) is not defined here:
//! a trace-time error names the op.

use std::fmt::{self, Write as _};
use std::panic::Location;

use crate::emit::line::Line;
use crate::ops::host::alloc::collect;
use crate::ops::host::layout::strides;
use crate::ops::host::Fault;
use crate::trace::ir::{with_dims, Conv, ConvDims, Op};
use crate::trace::record::{with_recording, Tensor};
use crate::tree::{Array, ArrayData, DType, LeafType};

use super::window::{same_padding, transposed_padding};
use super::{dilate, unflatten};

impl ConvDims {
    /// Dimension numbers from layout strings, as JAX writes them: the input's (`"NHWC"`: `N`
    /// batch, `C` feature), the kernel's (`"HWIO"`: `I` input, `O` output feature) and the
    /// result's (`"NHWC"`); every other letter is a spatial dim, matched across the three by
    /// letter and ordered as in the kernel's string. `None` when the strings do not fit
    /// together.
    ///
    /// ```
    /// use nitro::trace::ConvDims;
    /// let d = ConvDims::parse("NCHW", "OIHW", "NCHW").unwrap();
    /// assert_eq!((d.input_batch, d.input_feature, d.input_spatial.clone()), (0, 1, vec![2, 3]));
    /// assert!(ConvDims::parse("NHWC", "HWIO", "NHC").is_none());
    /// ```
    pub fn parse(input: &str, kernel: &str, output: &str) -> Option<ConvDims> {
        let (i, k, o): (Vec<char>, Vec<char>, Vec<char>) = (
            input.chars().collect(),
            kernel.chars().collect(),
            output.chars().collect(),
        );
        if i.len() != k.len() || o.len() != k.len() || i.len() < 2 {
            return None;
        }
        let pos = |s: &[char], c: char| s.iter().position(|&x| x == c);
        let spatial: Vec<char> = k
            .iter()
            .copied()
            .filter(|&c| c != 'I' && c != 'O')
            .collect();
        if spatial.len() != k.len() - 2 {
            return None;
        }
        let at = |s: &[char]| {
            spatial
                .iter()
                .map(|&c| pos(s, c))
                .collect::<Option<Vec<_>>>()
        };
        let distinct = |s: &[char]| {
            let mut v = s.to_vec();
            v.sort_unstable();
            v.dedup();
            v.len() == s.len()
        };
        if !distinct(&i) || !distinct(&k) || !distinct(&o) {
            return None;
        }
        Some(ConvDims {
            input_batch: pos(&i, 'N')?,
            input_feature: pos(&i, 'C')?,
            input_spatial: at(&i)?,
            kernel_input: pos(&k, 'I')?,
            kernel_output: pos(&k, 'O')?,
            kernel_spatial: at(&k)?,
            output_batch: pos(&o, 'N')?,
            output_feature: pos(&o, 'C')?,
            output_spatial: at(&o)?,
        })
    }

    /// Channels last: input `[N, spatial…, C]`, kernel `[spatial…, I, O]`, result
    /// `[N, spatial…, C]` (NHWC/HWIO for 2 spatial dims; NWC/WIO for 1).
    pub fn channels_last(spatial: usize) -> ConvDims {
        let s: Vec<usize> = (1..=spatial).collect();
        ConvDims {
            input_batch: 0,
            input_feature: spatial + 1,
            input_spatial: s.clone(),
            kernel_input: spatial,
            kernel_output: spatial + 1,
            kernel_spatial: (0..spatial).collect(),
            output_batch: 0,
            output_feature: spatial + 1,
            output_spatial: s,
        }
    }

    /// Channels first: input `[N, C, spatial…]`, kernel `[O, I, spatial…]`, result
    /// `[N, C, spatial…]` (NCHW/OIHW).
    pub fn channels_first(spatial: usize) -> ConvDims {
        let s: Vec<usize> = (2..spatial + 2).collect();
        ConvDims {
            input_batch: 0,
            input_feature: 1,
            input_spatial: s.clone(),
            kernel_input: 1,
            kernel_output: 0,
            kernel_spatial: s.clone(),
            output_batch: 0,
            output_feature: 1,
            output_spatial: s,
        }
    }
}

impl Conv {
    /// A convolution with these dimension numbers: stride 1, no padding ("VALID"), no
    /// dilation, one group.
    pub fn new(dims: ConvDims) -> Conv {
        let n = dims.input_spatial.len();
        Conv {
            dims,
            strides: vec![1; n],
            padding: vec![(0, 0); n],
            lhs_dilation: vec![1; n],
            rhs_dilation: vec![1; n],
            feature_groups: 1,
            batch_groups: 1,
            preferred_element_type: None,
        }
    }

    /// A channels-last convolution ([`ConvDims::channels_last`]) over `spatial` dims.
    pub fn channels_last(spatial: usize) -> Conv {
        Conv::new(ConvDims::channels_last(spatial))
    }

    /// With these strides (one per spatial dim).
    pub fn strides(mut self, strides: &[usize]) -> Conv {
        self.strides = strides.to_vec();
        self
    }

    /// With this padding (`(low, high)` per spatial dim; negative crops).
    pub fn padding(mut self, padding: &[(i64, i64)]) -> Conv {
        self.padding = padding.to_vec();
        self
    }

    /// With "SAME" padding for an input of spatial dims `input` and a kernel of spatial dims
    /// `kernel` (the strides and rhs dilation set so far count): `ceil(n / stride)` outputs.
    pub fn same_for(mut self, input: &[usize], kernel: &[usize]) -> Conv {
        self.padding = same_padding(input, kernel, &self.strides, &self.rhs_dilation);
        self
    }

    /// With this input dilation (a transposed convolution).
    pub fn lhs_dilation(mut self, dilation: &[usize]) -> Conv {
        self.lhs_dilation = dilation.to_vec();
        self
    }

    /// With this kernel dilation (atrous).
    pub fn rhs_dilation(mut self, dilation: &[usize]) -> Conv {
        self.rhs_dilation = dilation.to_vec();
        self
    }

    /// With `groups` feature groups (depthwise when it equals the input's features).
    pub fn feature_groups(mut self, groups: usize) -> Conv {
        self.feature_groups = groups;
        self
    }

    /// Giving `dtype` elements: `f32` for `bf16`/`f16` operands multiplies in half precision
    /// and accumulates in f32 (mixed precision).
    pub fn preferred_element_type(mut self, dtype: DType) -> Conv {
        self.preferred_element_type = Some(dtype);
        self
    }

    /// With `groups` batch groups.
    pub fn batch_groups(mut self, groups: usize) -> Conv {
        self.batch_groups = groups;
        self
    }
}

// ---- types ---------------------------------------------------------------------------------

/// The result type of a convolution of `x` by `k`, or what is wrong.
pub(crate) fn conv_type(x: &LeafType, k: &LeafType, c: &Conv) -> Result<LeafType, String> {
    let d = &c.dims;
    let n = d.input_spatial.len();
    if x.dtype != k.dtype {
        return Err(format!(
            "the input and the kernel have different dtypes ({x} and {k})"
        ));
    }
    if !x.dtype.is_float() {
        return Err(format!("convolution needs float operands, got {x} and {k}"));
    }
    let result = c.preferred_element_type.unwrap_or(x.dtype);
    if !crate::ops::linalg::product_dtype_ok(x.dtype, result) {
        return Err(format!(
            "a convolution of {x} cannot give {result} elements: it gives its operands' dtype, \
             or f32 for bf16/f16 operands (accumulated in f32)"
        ));
    }
    let rank = n + 2;
    let lhs_all: Vec<usize> = [d.input_batch, d.input_feature]
        .into_iter()
        .chain(d.input_spatial.iter().copied())
        .collect();
    let rhs_all: Vec<usize> = [d.kernel_input, d.kernel_output]
        .into_iter()
        .chain(d.kernel_spatial.iter().copied())
        .collect();
    let out_all: Vec<usize> = [d.output_batch, d.output_feature]
        .into_iter()
        .chain(d.output_spatial.iter().copied())
        .collect();
    if x.dims.len() != rank
        || k.dims.len() != rank
        || d.kernel_spatial.len() != n
        || d.output_spatial.len() != n
    {
        return Err(format!(
            "the dimension numbers {d:?} do not fit the input {x} and the kernel {k} (both need rank {rank}: batch, feature and {n} spatial dims)"
        ));
    }
    // Each list names every dim once: one role per dim.
    let roles = [
        ("input", "batch, feature", &lhs_all),
        ("kernel", "input feature, output feature", &rhs_all),
        ("output", "batch, feature", &out_all),
    ];
    for (what, first, all) in roles {
        if all.len() != rank || !super::distinct_in_range(all, rank) {
            return Err(format!(
                "the {what} dimension numbers {all:?} ({first}, then the spatial dims) must \
                 name each of the {rank} dims once (dimension numbers {d:?})"
            ));
        }
    }
    if c.strides.len() != n
        || c.padding.len() != n
        || c.lhs_dilation.len() != n
        || c.rhs_dilation.len() != n
    {
        return Err(format!(
            "strides {:?}, padding {:?}, lhs_dilation {:?} and rhs_dilation {:?} need one entry per spatial dim ({n})",
            c.strides, c.padding, c.lhs_dilation, c.rhs_dilation
        ));
    }
    if c.strides
        .iter()
        .chain(&c.lhs_dilation)
        .chain(&c.rhs_dilation)
        .any(|&s| s == 0)
    {
        return Err(format!(
            "strides {:?} and dilations {:?}, {:?} must be at least 1",
            c.strides, c.lhs_dilation, c.rhs_dilation
        ));
    }
    let spatial = "spatial dim";
    super::within_limit("strides", spatial, &c.strides)?;
    super::within_limit("lhs_dilation", spatial, &c.lhs_dilation)?;
    super::within_limit("rhs_dilation", spatial, &c.rhs_dilation)?;
    super::padding_within_limit("padding", spatial, &c.padding)?;
    let (g, bg) = (c.feature_groups, c.batch_groups);
    if g == 0 || bg == 0 || (g > 1 && bg > 1) {
        return Err(format!(
            "feature_groups ({g}) and batch_groups ({bg}) must be at least 1, and not both above 1"
        ));
    }
    for (name, count) in [("feature_groups", g), ("batch_groups", bg)] {
        if count as u64 > super::SIZE_LIMIT {
            return Err(format!(
                "{name} {count} is over {}; use fewer groups",
                super::LIMIT_WORDS
            ));
        }
    }
    let (batch, feat) = (x.dims[d.input_batch], x.dims[d.input_feature]);
    let (k_in, k_out) = (k.dims[d.kernel_input], k.dims[d.kernel_output]);
    let wanted = k_in.checked_mul(g);
    if wanted != Some(feat) {
        let wanted = wanted.map_or_else(|| "more than 2^64".to_owned(), |w| w.to_string());
        return Err(format!(
            "the input {x} has {feat} channels (dim {}) but the kernel {k} takes {k_in} (dim {}){}",
            d.input_feature,
            d.kernel_input,
            if g > 1 {
                format!(
                    " per group × feature_groups {g} = {wanted}; the input's channels must be \
                     feature_groups times the kernel's input features"
                )
            } else {
                String::new()
            }
        ));
    }
    for (name, count) in [("feature_groups", g), ("batch_groups", bg)] {
        if k_out % count != 0 {
            return Err(format!(
                "the kernel's {k_out} output features (dim {}) do not split into {count} groups \
                 ({name} {count})",
                d.kernel_output
            ));
        }
    }
    if batch % bg != 0 {
        return Err(format!(
            "the input's batch of {batch} does not split into {bg} batch groups (batch_groups {bg})"
        ));
    }
    let mut out = vec![0; rank];
    out[d.output_batch] = batch / bg;
    out[d.output_feature] = k_out;
    for s in 0..n {
        let at = (spatial, s);
        let size = x.dims[d.input_spatial[s]];
        let lhs = super::dilated("the input", size, "lhs_dilation", c.lhs_dilation[s], at)?;
        let padded = super::padded("the dilated input", lhs, "padding", c.padding[s], at)?;
        let taps = k.dims[d.kernel_spatial[s]];
        let eff = super::dilated("the kernel", taps, "rhs_dilation", c.rhs_dilation[s], at)?;
        if padded < eff as i128 || taps == 0 {
            return Err(format!(
                "spatial dim {s}: the kernel ({taps} taps, spanning {eff} with dilation {}) is larger than the padded input ({padded} elements: {size} with dilation {} and padding {:?})",
                c.rhs_dilation[s], c.lhs_dilation[s], c.padding[s]
            ));
        }
        // At most `padded`, which is within the limit.
        out[d.output_spatial[s]] = ((padded - eff as i128) / c.strides[s] as i128 + 1) as usize;
    }
    Ok(with_dims(result, out))
}

// ---- tracing -------------------------------------------------------------------------------

impl Tensor {
    /// The convolution of this input by `kernel` ([`Conv`] says how: layout, strides, padding,
    /// dilations, groups).
    ///
    /// ```
    /// use nitro::trace::{trace, Conv};
    /// use nitro::{DType, LeafType};
    ///
    /// let x = LeafType { dtype: DType::F32, dims: vec![8, 28, 28, 3] };
    /// let k = LeafType { dtype: DType::F32, dims: vec![3, 3, 3, 16] };
    /// let g = trace(&[("x".into(), x), ("k".into(), k)], |i| {
    ///     let conv = Conv::channels_last(2).strides(&[2, 2]).same_for(&[28, 28], &[3, 3]);
    ///     vec![i[0].conv(i[1], &conv)]
    /// })?;
    /// assert_eq!(g.output_types()[0].dims, vec![8, 14, 14, 16]);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    #[track_caller]
    pub fn conv(self, kernel: Tensor, conv: &Conv) -> Tensor {
        let at = Location::caller();
        with_recording(|r| {
            if !r.owns(self, "conv", at) || !r.owns(kernel, "conv", at) {
                return r.stand_in(super::f32_scalar());
            }
            let (x, k) = (r.ty_of(self), r.ty_of(kernel));
            match conv_type(&x, &k, conv) {
                Ok(ty) => r.push(
                    Op::Convolution(Box::new(conv.clone())),
                    vec![self.node, kernel.node],
                    ty,
                    "conv",
                    at,
                ),
                Err(msg) => r.fail("conv", msg, at, x),
            }
        })
    }
}

// ---- gradients -----------------------------------------------------------------------------

/// The VJP of a convolution of `x` by `k` for the cotangent `g`.
pub(crate) fn vjp(c: &Conv, x: Tensor, k: Tensor, g: Tensor) -> Vec<Option<Tensor>> {
    if c.batch_groups != 1 {
        crate::trace::record::refuse(
            "conv",
            "the gradient of a batch-grouped convolution (a kernel gradient) is not defined; \
             differentiate the forward convolution once"
                .into(),
        );
        return vec![Some(x.zeros_like()), Some(k.zeros_like())];
    }
    // Checked, as a backstop: the gradients' paddings are sums of several of the forward's
    // sizes and padding amounts, which fit when the forward's partial sums do (its type rule
    // checks those).
    let paddings =
        input_grad_padding(c, x, k, g).and_then(|i| Ok((i, kernel_grad_padding(c, x, k, g)?)));
    let (input_padding, kernel_padding) = match paddings {
        Ok(p) => p,
        Err(msg) => {
            crate::trace::record::refuse(
                "conv",
                format!("the gradient of this convolution is not defined: {msg}"),
            );
            return vec![Some(x.zeros_like()), Some(k.zeros_like())];
        }
    };
    // Mixed precision: the cotangent is rounded to the operands' dtype, the gradient
    // convolutions accumulate in the forward's result dtype, and round back.
    let (xt, kt) = (x.dtype(), k.dtype());
    let g = g.convert(xt);
    vec![
        Some(input_grad(c, k, g, input_padding).convert(xt)),
        Some(kernel_grad(c, x, g, kernel_padding).convert(kt)),
    ]
}

/// The padding of the input gradient's convolution ([`transposed_padding`]), or what is wrong.
fn input_grad_padding(
    c: &Conv,
    x: Tensor,
    k: Tensor,
    g: Tensor,
) -> Result<Vec<(i64, i64)>, String> {
    let d = &c.dims;
    let (xd, kd, gd) = (x.dims(), k.dims(), g.dims());
    let in_spatial: Vec<usize> = d.input_spatial.iter().map(|&s| xd[s]).collect();
    let taps: Vec<usize> = d.kernel_spatial.iter().map(|&s| kd[s]).collect();
    let out_spatial: Vec<usize> = d.output_spatial.iter().map(|&s| gd[s]).collect();
    transposed_padding(
        &in_spatial,
        &taps,
        &c.strides,
        &out_spatial,
        &c.padding,
        &c.lhs_dilation,
        &c.rhs_dilation,
    )
}

/// The padding of the kernel gradient's convolution: `(low, out − lhs + rhs − low − 1)` per
/// spatial dim with the dilated sizes, or what is wrong when one is past the signed 64-bit
/// range.
fn kernel_grad_padding(
    c: &Conv,
    x: Tensor,
    k: Tensor,
    g: Tensor,
) -> Result<Vec<(i64, i64)>, String> {
    let d = &c.dims;
    let (xd, kd, gd) = (x.dims(), k.dims(), g.dims());
    (0..d.input_spatial.len())
        .map(|s| {
            // Within the limit: the forward's type rule checked them.
            let lhs = dilate(xd[d.input_spatial[s]], c.lhs_dilation[s]) as i128;
            let rhs = dilate(kd[d.kernel_spatial[s]], c.rhs_dilation[s]) as i128;
            let out = dilate(gd[d.output_spatial[s]], c.strides[s]) as i128;
            let lo = c.padding[s].0;
            let hi = out - lhs + rhs - lo as i128 - 1;
            super::padding_amount(hi, "the kernel gradient's high padding", s).map(|hi| (lo, hi))
        })
        .collect()
}

/// The input's gradient: the cotangent convolved with the flipped kernel, padded by `padding`
/// ([`input_grad_padding`]).
fn input_grad(c: &Conv, k: Tensor, g: Tensor, padding: Vec<(i64, i64)>) -> Tensor {
    let d = &c.dims;
    let n = d.input_spatial.len();
    let kd = k.dims();
    let groups = c.feature_groups;
    // The kernel laid out `[spatial…, I, O]`, reversed in space.
    let perm: Vec<usize> = d
        .kernel_spatial
        .iter()
        .copied()
        .chain([d.kernel_input, d.kernel_output])
        .collect();
    let canon = if perm.iter().enumerate().all(|(i, &p)| i == p) {
        k
    } else {
        k.transpose(&perm)
    };
    let spatial: Vec<usize> = d.kernel_spatial.iter().map(|&s| kd[s]).collect();
    let (k_in, k_out) = (kd[d.kernel_input], kd[d.kernel_output]);
    // The transposed kernel: input features are the forward's outputs (per group), outputs
    // are the forward's inputs.
    let (flipped, kernel_input, kernel_output) = if groups == 1 {
        (canon, n + 1, n)
    } else {
        let per = k_out / groups;
        let split: Vec<usize> = spatial.iter().copied().chain([k_in, groups, per]).collect();
        let mut order: Vec<usize> = (0..n).collect();
        order.extend([n + 2, n + 1, n]);
        let merged: Vec<usize> = spatial
            .iter()
            .copied()
            .chain([per, groups * k_in])
            .collect();
        let regrouped = canon.reshape(&split).transpose(&order).reshape(&merged);
        (regrouped, n, n + 1)
    };
    let reversed = flipped.reverse(&(0..n).collect::<Vec<_>>());
    let back = Conv {
        dims: ConvDims {
            input_batch: d.output_batch,
            input_feature: d.output_feature,
            input_spatial: d.output_spatial.clone(),
            kernel_input,
            kernel_output,
            kernel_spatial: (0..n).collect(),
            output_batch: d.input_batch,
            output_feature: d.input_feature,
            output_spatial: d.input_spatial.clone(),
        },
        strides: c.lhs_dilation.clone(),
        padding,
        lhs_dilation: c.strides.clone(),
        rhs_dilation: c.rhs_dilation.clone(),
        feature_groups: groups,
        batch_groups: 1,
        preferred_element_type: c.preferred_element_type,
    };
    g.conv(reversed, &back)
}

/// The kernel's gradient: the input convolved with the cotangent, padded by `padding`
/// ([`kernel_grad_padding`]).
fn kernel_grad(c: &Conv, x: Tensor, g: Tensor, padding: Vec<(i64, i64)>) -> Tensor {
    let d = &c.dims;
    let back = Conv {
        dims: ConvDims {
            input_batch: d.input_feature,
            input_feature: d.input_batch,
            input_spatial: d.input_spatial.clone(),
            kernel_input: d.output_batch,
            kernel_output: d.output_feature,
            kernel_spatial: d.output_spatial.clone(),
            output_batch: d.kernel_input,
            output_feature: d.kernel_output,
            output_spatial: d.kernel_spatial.clone(),
        },
        strides: c.rhs_dilation.clone(),
        padding,
        lhs_dilation: c.lhs_dilation.clone(),
        rhs_dilation: c.strides.clone(),
        feature_groups: 1,
        batch_groups: c.feature_groups,
        preferred_element_type: c.preferred_element_type,
    };
    x.conv(g, &back)
}

// ---- emission ------------------------------------------------------------------------------

/// A layout as `[b, 0, 1, f]`: `a`/`b` name the two non-spatial roles at their positions.
fn layout(rank: usize, first: (usize, char), second: (usize, char), spatial: &[usize]) -> String {
    let mut parts = vec![String::new(); rank];
    parts[first.0] = first.1.to_string();
    parts[second.0] = second.1.to_string();
    for (i, &s) in spatial.iter().enumerate() {
        parts[s] = i.to_string();
    }
    format!("[{}]", parts.join(", "))
}

/// `stablehlo.convolution` (full precision, as `dot_general`).
pub(crate) fn emit(mut l: Line<'_>, c: &Conv) -> fmt::Result {
    // Half-precision operands on a CPU plugin: widened to f32 and the result rounded back, as
    // a dot's (`linalg::Widened`); XLA's CPU compiler runs half convolutions slowly (fashion's
    // f16 step took 1.4× as long with them unwidened).
    let w = super::linalg::Widened::write(&mut l)?;
    let d = &c.dims;
    let rank = d.input_spatial.len() + 2;
    let pads: Vec<String> = c
        .padding
        .iter()
        .map(|(lo, hi)| format!("[{lo}, {hi}]"))
        .collect();
    writeln!(
        l.out,
        "    {} = stablehlo.convolution({}, {}) dim_numbers = {}x{}->{}, window = {{stride = {}, pad = [{}], lhs_dilate = {}, rhs_dilate = {}}} {{batch_group_count = {} : i64, feature_group_count = {} : i64, precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]}} : ({}, {}) -> {}",
        w.me,
        w.args[0],
        w.args[1],
        layout(rank, (d.input_batch, 'b'), (d.input_feature, 'f'), &d.input_spatial),
        layout(rank, (d.kernel_input, 'i'), (d.kernel_output, 'o'), &d.kernel_spatial),
        layout(rank, (d.output_batch, 'b'), (d.output_feature, 'f'), &d.output_spatial),
        crate::emit::line::list(&c.strides),
        pads.join(", "),
        crate::emit::line::list(&c.lhs_dilation),
        crate::emit::line::list(&c.rhs_dilation),
        c.batch_groups,
        c.feature_groups,
        w.arg_tys[0],
        w.arg_tys[1],
        w.ty
    )?;
    w.narrow(l)
}

// ---- interpreter ---------------------------------------------------------------------------

fn conv_f64(
    x: &[f64],
    k: &[f64],
    xd: &[usize],
    kd: &[usize],
    od: &[usize],
    c: &Conv,
) -> Result<Vec<f64>, Fault> {
    let d = &c.dims;
    let n = d.input_spatial.len();
    let (xs, ks) = (strides(xd), strides(kd));
    let (k_in, k_out) = (kd[d.kernel_input], kd[d.kernel_output]);
    let out_batch = od[d.output_batch];
    let per_group = k_out / c.feature_groups;
    let per_batch_group = k_out / c.batch_groups;
    let taps: Vec<usize> = d.kernel_spatial.iter().map(|&s| kd[s]).collect();
    let tap_count: usize = taps.iter().product();
    let total: usize = od.iter().product();
    let mut o = vec![0; od.len()];
    let mut t = vec![0; n];
    collect(
        total,
        (0..total).map(|i| {
            unflatten(i, od, &mut o);
            let (b, f) = (o[d.output_batch], o[d.output_feature]);
            let group = f / per_group;
            let batch = (f / per_batch_group) * out_batch + b;
            let mut acc = 0.0;
            for tap in 0..tap_count {
                unflatten(tap, &taps, &mut t);
                // The input offset of this tap, or `None` when it lands on padding or a hole.
                let mut x_off = batch * xs[d.input_batch];
                let mut k_off = f * ks[d.kernel_output];
                let mut inside = true;
                for s in 0..n {
                    // In i128: a position within the padded input (within the limit) minus a
                    // low padding of up to 2^63 − 1.
                    let p = (o[d.output_spatial[s]] * c.strides[s] + t[s] * c.rhs_dilation[s])
                        as i128
                        - c.padding[s].0 as i128;
                    let ld = c.lhs_dilation[s] as i128;
                    if p < 0 || p % ld != 0 || p / ld >= xd[d.input_spatial[s]] as i128 {
                        inside = false;
                        break;
                    }
                    x_off += (p / ld) as usize * xs[d.input_spatial[s]];
                    k_off += t[s] * ks[d.kernel_spatial[s]];
                }
                if !inside {
                    continue;
                }
                for ci in 0..k_in {
                    let cx = group * k_in + ci;
                    acc += x[x_off + cx * xs[d.input_feature]] * k[k_off + ci * ks[d.kernel_input]];
                }
            }
            acc
        }),
    )
}

/// A convolution on the host. Products accumulate in `f64` and round once to the result type.
pub(crate) fn eval(x: &Array, k: &Array, out: &LeafType, c: &Conv) -> Result<ArrayData, Fault> {
    let as_f64 = |a: &Array| -> Result<Vec<f64>, Fault> {
        Ok(match a.data() {
            ArrayData::F32(v) => collect(v.len(), v.iter().map(|&x| x as f64))?,
            ArrayData::F64(v) => collect(v.len(), v.iter().copied())?,
            other => {
                return Err(Fault::Invalid(format!(
                    "convolution needs float operands, not {}",
                    other.dtype()
                )))
            }
        })
    };
    let r = conv_f64(&as_f64(x)?, &as_f64(k)?, x.dims(), k.dims(), &out.dims, c)?;
    Ok(match x.data() {
        ArrayData::F32(_) => ArrayData::F32(collect(r.len(), r.iter().map(|&v| v as f32))?),
        _ => ArrayData::F64(r),
    })
}
