//! Windowed reductions: `reduce_window` (sum, max, min) — pooling, cumulative sums — and
//! `select_and_scatter`, the gradient of max/min pooling.
//!
//! A window of `dims[d]` taps, `window_dilation[d]` apart, slides `strides[d]` at a time over the
//! operand dilated by `base_dilation[d]` (`d − 1` holes between elements) and padded by
//! `padding[d]`. Dim `d` of the result is `(padded − (dims[d] − 1)·window_dilation[d] − 1) /
//! strides[d] + 1`; a window larger than the padded operand is a trace-time error. Holes and
//! padding hold the reduction's identity (0, −∞, +∞), so they never win or add.
//!
//! VJPs:
//! - **sum**: the cotangent, padded (interior `stride − 1` and the transposed padding), summed
//!   over the same windows with strides `base_dilation` — JAX's rule (`windowed_reductions.py`).
//! - **max / min**: `select_and_scatter`: each window's cotangent goes to the element the
//!   window selected. **Tie rule: the first maximum (minimum) in row-major window order gets the
//!   whole cotangent**, as XLA's `select_and_scatter` with `GE` (`LE`) picks it, on both
//!   backends. A padded operand is padded with −∞ (+∞) by an explicit `pad` first and the
//!   result cropped after, as JAX does on CPU. The gradient of a dilated max/min window is not
//!   defined here (a trace-time error naming the op).
//!
//! Windows that tile the operand (stride = window, as in 2×2/2 pooling) skip XLA's windowed
//! ops, which its CPU backend runs as a scalar loop per window: the forward is emitted as a
//! reshape to `[o₀, k₀, o₁, k₁, …]` and a reduction over the `k` dims
//! (`emit_reduce_window`), the max/min gradient traced as a compare, a select and a
//! reduction with the same tie rule (`tiled_select_and_scatter`).

use std::fmt::{self, Write as _};
use std::panic::Location;

use crate::emit::line::{self as emit, Line};
use crate::ops::host::alloc::{collect, filled};
use crate::ops::host::layout::strides;
use crate::ops::host::Fault;
use crate::trace::ir::{with_dims, Op, ReduceOp, Window};
use crate::trace::record::{with_recording, Tensor};
use crate::tree::{Array, ArrayData, DType, LeafType};

use super::{dilate, unflatten};

impl Window {
    /// A window of `dims` taps per operand dim, stride 1, no padding, no dilation.
    pub fn new(dims: &[usize]) -> Window {
        let r = dims.len();
        Window {
            dims: dims.to_vec(),
            strides: vec![1; r],
            padding: vec![(0, 0); r],
            base_dilation: vec![1; r],
            window_dilation: vec![1; r],
        }
    }

    /// With these strides.
    pub fn strides(mut self, strides: &[usize]) -> Window {
        self.strides = strides.to_vec();
        self
    }

    /// With this padding (`(low, high)` per dim; negative removes).
    pub fn padding(mut self, padding: &[(i64, i64)]) -> Window {
        self.padding = padding.to_vec();
        self
    }

    /// With "SAME" padding for an operand of `dims`: the result has `ceil(n / stride)` elements
    /// per dim, the padding split evenly with the odd one after (as JAX and TensorFlow).
    pub fn same_for(mut self, dims: &[usize]) -> Window {
        self.padding = same_padding(dims, &self.dims, &self.strides, &self.window_dilation);
        self
    }

    /// With this operand dilation.
    pub fn base_dilation(mut self, dilation: &[usize]) -> Window {
        self.base_dilation = dilation.to_vec();
        self
    }

    /// With this window dilation.
    pub fn window_dilation(mut self, dilation: &[usize]) -> Window {
        self.window_dilation = dilation.to_vec();
        self
    }

    fn is_plain(&self) -> bool {
        self.base_dilation.iter().all(|&d| d == 1) && self.window_dilation.iter().all(|&d| d == 1)
    }
}

/// "SAME" padding: for each dim, the `(low, high)` that gives `ceil(n / stride)` windows of
/// `window` taps `dilation` apart, split evenly with the odd element after. Lists shorter than
/// `input` count as stride 1 and dilation 1. Sizes past nitro's limit give the largest
/// padding (the op then refuses the window, naming the attribute).
pub fn same_padding(
    input: &[usize],
    window: &[usize],
    strides: &[usize],
    dilation: &[usize],
) -> Vec<(i64, i64)> {
    input
        .iter()
        .enumerate()
        .map(|(d, &n)| {
            // In i128, saturating where sizes past the limit could overflow even that.
            let s = strides.get(d).copied().unwrap_or(1).max(1) as i128;
            let w = window.get(d).copied().unwrap_or(1) as i128;
            let dil = dilation.get(d).copied().unwrap_or(1).max(1) as i128;
            let eff = if w == 0 {
                0
            } else {
                (w - 1).saturating_mul(dil).saturating_add(1)
            };
            let n = n as i128;
            let out = (n + s - 1) / s;
            // `(out − 1)·s` is below `n + s`: no overflow.
            let total = ((out - 1) * s)
                .saturating_add(eff)
                .saturating_sub(n)
                .clamp(0, 2 * i64::MAX as i128);
            let (lo, hi) = (total / 2, total - total / 2);
            (
                lo.min(i64::MAX as i128) as i64,
                hi.min(i64::MAX as i128) as i64,
            )
        })
        .collect()
}

// ---- types ---------------------------------------------------------------------------------

/// The result dims of sliding `w` over `dims`, or what is wrong.
#[allow(clippy::needless_range_loop)] // five parallel lists, indexed by dim
pub(crate) fn window_dims(dims: &[usize], w: &Window) -> Result<Vec<usize>, String> {
    let r = dims.len();
    if w.dims.len() != r
        || w.strides.len() != r
        || w.padding.len() != r
        || w.base_dilation.len() != r
        || w.window_dilation.len() != r
    {
        return Err(format!(
            "the window {w:?} must have one entry per operand dim ({r}) in each list"
        ));
    }
    let mut out = Vec::with_capacity(r);
    for d in 0..r {
        if w.dims[d] == 0
            || w.strides[d] == 0
            || w.base_dilation[d] == 0
            || w.window_dilation[d] == 0
        {
            return Err(format!(
                "dim {d}: window size, stride and dilations must be at least 1 (window {w:?})"
            ));
        }
    }
    super::within_limit("window", "dim", &w.dims)?;
    super::within_limit("strides", "dim", &w.strides)?;
    super::within_limit("base_dilation", "dim", &w.base_dilation)?;
    super::within_limit("window_dilation", "dim", &w.window_dilation)?;
    super::padding_within_limit("padding", "dim", &w.padding)?;
    for d in 0..r {
        let at = ("dim", d);
        let base = super::dilated(
            "the operand",
            dims[d],
            "base_dilation",
            w.base_dilation[d],
            at,
        )?;
        let padded = super::padded("the dilated operand", base, "padding", w.padding[d], at)?;
        let eff = super::dilated(
            "the window",
            w.dims[d],
            "window_dilation",
            w.window_dilation[d],
            at,
        )? as i128;
        if padded < eff {
            return Err(format!(
                "dim {d}: the window ({} taps spanning {eff}) is larger than the padded operand ({padded} elements from {} with padding {:?})",
                w.dims[d], dims[d], w.padding[d]
            ));
        }
        // At most `padded`, which is within the limit.
        out.push(((padded - eff) / w.strides[d] as i128 + 1) as usize);
    }
    Ok(out)
}

/// The result type of `reduce_window`, or what is wrong.
pub(crate) fn reduce_window_type(x: &LeafType, w: &Window) -> Result<LeafType, String> {
    if x.dtype == DType::Bool {
        return Err(format!(
            "cannot reduce a bool tensor ({x}); convert it first"
        ));
    }
    Ok(with_dims(x.dtype, window_dims(&x.dims, w)?))
}

/// The result type of `select_and_scatter`, or what is wrong.
pub(crate) fn select_and_scatter_type(
    x: &LeafType,
    source: &LeafType,
    kind: ReduceOp,
    w: &Window,
) -> Result<LeafType, String> {
    if kind == ReduceOp::Sum {
        return Err("it selects a maximum or a minimum, not a sum".into());
    }
    if !w.is_plain() || w.padding.iter().any(|&p| p != (0, 0)) {
        return Err(format!(
            "its window must have no padding and no dilation, got {w:?}"
        ));
    }
    let want = reduce_window_type(x, w)?;
    if source.dims != want.dims || source.dtype != x.dtype {
        return Err(format!(
            "the source must be {want} (the windows of {x}), got {source}"
        ));
    }
    Ok(x.clone())
}

// ---- tracing -------------------------------------------------------------------------------

impl Tensor {
    fn reduce_window(
        self,
        kind: ReduceOp,
        w: &Window,
        op: &'static str,
        at: &Location<'_>,
    ) -> Tensor {
        with_recording(|r| {
            if !r.owns(self, op, at) {
                return r.stand_in(super::f32_scalar());
            }
            let x = r.ty_of(self);
            match reduce_window_type(&x, w) {
                Ok(ty) => r.push(
                    Op::ReduceWindow {
                        kind,
                        window: w.clone(),
                    },
                    vec![self.node],
                    ty,
                    op,
                    at,
                ),
                Err(msg) => r.fail(op, format!("{msg} (operand {x})"), at, x),
            }
        })
    }

    /// The sum of each window ([`Window`]): average pooling (divide by the window size),
    /// cumulative sums ([`Tensor::cumsum`]).
    #[track_caller]
    pub fn window_sum(self, window: &Window) -> Tensor {
        self.reduce_window(ReduceOp::Sum, window, "window_sum", Location::caller())
    }

    /// The maximum of each window: max pooling. NaN propagates. The gradient goes to the first
    /// maximum of each window in row-major order (see [`crate::ops::window`]).
    #[track_caller]
    pub fn window_max(self, window: &Window) -> Tensor {
        self.reduce_window(ReduceOp::Max, window, "window_max", Location::caller())
    }

    /// The minimum of each window (the gradient goes to the first minimum).
    #[track_caller]
    pub fn window_min(self, window: &Window) -> Tensor {
        self.reduce_window(ReduceOp::Min, window, "window_min", Location::caller())
    }

    /// Cumulative sum along `axis`: element `i` is the sum of elements `0..=i`.
    #[track_caller]
    pub fn cumsum(self, axis: usize) -> Tensor {
        let at = Location::caller();
        let dims = self.dims();
        let Some(&n) = dims.get(axis) else {
            return with_recording(|r| {
                let ty = r.ty_of(self);
                r.fail(
                    "cumsum",
                    format!("axis {axis} is out of range for {ty}"),
                    at,
                    ty,
                )
            });
        };
        let mut taps = vec![1; dims.len()];
        taps[axis] = n.max(1);
        let mut padding = vec![(0, 0); dims.len()];
        padding[axis] = (n.max(1) as i64 - 1, 0);
        self.reduce_window(
            ReduceOp::Sum,
            &Window::new(&taps).padding(&padding),
            "cumsum",
            at,
        )
    }
}

/// `select_and_scatter(operand, source)` (see [`Op::SelectAndScatter`]).
fn select_and_scatter(x: Tensor, source: Tensor, kind: ReduceOp, w: &Window) -> Tensor {
    let at = Location::caller();
    with_recording(|r| {
        let (xt, st) = (r.ty_of(x), r.ty_of(source));
        match select_and_scatter_type(&xt, &st, kind, w) {
            Ok(ty) => r.push(
                Op::SelectAndScatter {
                    kind,
                    window: w.clone(),
                },
                vec![x.node, source.node],
                ty,
                "select_and_scatter",
                at,
            ),
            Err(msg) => r.fail("select_and_scatter", msg, at, xt),
        }
    })
}

// ---- gradients -----------------------------------------------------------------------------

/// The transposed padding of a strided, dilated window (JAX's
/// `_conv_general_vjp_lhs_padding`): `(low, high)` per dim of a cotangent of `out` elements
/// such that windows over it give back `input` elements; or what is wrong when an amount is
/// past ±(2^63 − 1). (A backstop: these are sums of several of the forward's sizes and padding
/// amounts, which fit when the forward's partial sums do, as its type rule checks.)
pub(crate) fn transposed_padding(
    input: &[usize],
    window: &[usize],
    strides: &[usize],
    out: &[usize],
    padding: &[(i64, i64)],
    base_dilation: &[usize],
    window_dilation: &[usize],
) -> Result<Vec<(i64, i64)>, String> {
    (0..input.len())
        .map(|d| {
            // Within the limit: the forward's type rule checked them.
            let lhs = dilate(input[d], base_dilation[d]) as i128;
            let rhs = dilate(window[d], window_dilation[d]) as i128;
            let out = dilate(out[d], strides[d]) as i128;
            let before = rhs - padding[d].0 as i128 - 1;
            let after = lhs + rhs - 1 - out - before;
            Ok((
                super::padding_amount(before, "the gradient's low padding", d)?,
                super::padding_amount(after, "the gradient's high padding", d)?,
            ))
        })
        .collect()
}

/// The VJP of `reduce_window`.
pub(crate) fn vjp(kind: ReduceOp, w: &Window, x: Tensor, g: Tensor) -> Vec<Option<Tensor>> {
    let in_dims = x.dims();
    let out_dims = g.dims();
    let r = in_dims.len();
    match kind {
        ReduceOp::Sum => {
            let pads = transposed_padding(
                &in_dims,
                &w.dims,
                &w.strides,
                &out_dims,
                &w.padding,
                &w.base_dilation,
                &w.window_dilation,
            );
            let pads = match pads {
                Ok(p) => p,
                Err(msg) => {
                    crate::trace::record::refuse(
                        "window_sum",
                        format!("the gradient of this window sum is not defined: {msg}"),
                    );
                    return vec![Some(x.zeros_like())];
                }
            };
            let interior: Vec<usize> = w.strides.iter().map(|&s| s - 1).collect();
            let lo: Vec<i64> = pads.iter().map(|p| p.0).collect();
            let hi: Vec<i64> = pads.iter().map(|p| p.1).collect();
            let padded = g.pad(0.0, &lo, &hi, &interior);
            let back = Window {
                dims: w.dims.clone(),
                strides: w.base_dilation.clone(),
                padding: vec![(0, 0); r],
                base_dilation: vec![1; r],
                window_dilation: w.window_dilation.clone(),
            };
            vec![Some(padded.window_sum(&back))]
        }
        ReduceOp::Max | ReduceOp::Min => {
            if !w.is_plain() {
                crate::trace::record::refuse(
                    "window_max",
                    format!(
                        "the gradient of a max/min window with dilation is not defined (window {w:?}); use dilations of 1"
                    ),
                );
                return vec![Some(x.zeros_like())];
            }
            let padded = w.padding.iter().any(|&p| p != (0, 0));
            let fill = if kind == ReduceOp::Max {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            };
            let lo: Vec<i64> = w.padding.iter().map(|p| p.0).collect();
            let hi: Vec<i64> = w.padding.iter().map(|p| p.1).collect();
            let operand = if padded {
                x.pad(fill, &lo, &hi, &vec![0; r])
            } else {
                x
            };
            let plain = Window {
                padding: vec![(0, 0); r],
                ..w.clone()
            };
            let scattered = if plain.strides == plain.dims {
                tiled_select_and_scatter(operand, g, kind, &plain.dims)
            } else {
                select_and_scatter(operand, g, kind, &plain)
            };
            let dx = if padded {
                let nlo: Vec<i64> = lo.iter().map(|&l| -l).collect();
                let nhi: Vec<i64> = hi.iter().map(|&h| -h).collect();
                scattered.pad(0.0, &nlo, &nhi, &vec![0; r])
            } else {
                scattered
            };
            vec![Some(dx)]
        }
    }
}

/// `select_and_scatter` for windows that tile the operand (stride = window, no padding, no
/// dilation: the usual 2×2/2 pooling), written as a reshape, reductions and selects that XLA
/// fuses into a few loops — XLA's CPU `select-and-scatter` is a scalar loop over every window
/// (measured: a 2×2/2 max-pool's forward + backward over 64×28×28×32 went from ~22 to ~4 ms).
///
/// The same tie rule: the operand's covered part is split into `[o₀, k₀, o₁, k₁, …]`, the
/// positions equal to their window's extremum are marked, and the cotangent goes to the one
/// with the lowest row-major window index. Elements past the last whole window (`n mod k`)
/// get 0, as they do from `select_and_scatter`. A window holding a NaN sends its cotangent
/// nowhere.
fn tiled_select_and_scatter(x: Tensor, g: Tensor, kind: ReduceOp, k: &[usize]) -> Tensor {
    let in_dims = x.dims();
    let out = g.dims();
    let r = in_dims.len();
    let covered: Vec<usize> = (0..r).map(|d| out[d] * k[d]).collect();
    let xc = if covered == in_dims {
        x
    } else {
        x.slice(&vec![0; r], &covered)
    };
    let split: Vec<usize> = (0..r).flat_map(|d| [out[d], k[d]]).collect();
    let taps: Vec<usize> = (0..r).map(|d| 2 * d + 1).collect();
    let xs = xc.reshape(&split);
    let extremum = match kind {
        ReduceOp::Min => xs.min(&taps),
        _ => xs.max(&taps),
    };
    // The extremum and the cotangent with each window's taps as dims of 1, then broadcast.
    let kept: Vec<usize> = (0..r).flat_map(|d| [out[d], 1]).collect();
    let hit = xs.equal(extremum.reshape(&kept));
    // Each tap's row-major index within its window, [1, k₀, 1, k₁, …].
    let tap_dims: Vec<usize> = (0..r).flat_map(|d| [1, k[d]]).collect();
    let mut index: Option<Tensor> = None;
    let mut scale = 1usize;
    for d in (0..r).rev() {
        if k[d] > 1 {
            let axis = Tensor::iota(DType::I32, &tap_dims, 2 * d + 1);
            let term = if scale == 1 {
                axis
            } else {
                axis * scale as f64
            };
            index = Some(match index {
                Some(i) => i + term,
                None => term,
            });
        }
        scale *= k[d];
    }
    let index = index.unwrap_or_else(|| Tensor::iota(DType::I32, &tap_dims, 1));
    let first = Tensor::select(hit, index, scale as f64).min(&taps);
    let chosen = index.equal(first.reshape(&kept));
    let dx = Tensor::select(chosen, g.reshape(&kept), 0.0).reshape(&covered);
    if covered == in_dims {
        dx
    } else {
        let hi: Vec<i64> = (0..r).map(|d| (in_dims[d] - covered[d]) as i64).collect();
        dx.pad(0.0, &vec![0; r], &hi, &vec![0; r])
    }
}

// ---- emission ------------------------------------------------------------------------------

fn window_attrs(w: &Window, with_dilation: bool) -> String {
    let as_i64 = |v: &[usize]| emit::i64_array(v.iter().map(|&x| x as i64));
    if with_dilation {
        format!(
            "base_dilations = {}, padding = {}, window_dilations = {}, window_dimensions = {}, window_strides = {}",
            as_i64(&w.base_dilation),
            emit::padding_attr(&w.padding),
            as_i64(&w.window_dilation),
            as_i64(&w.dims),
            as_i64(&w.strides)
        )
    } else {
        format!(
            "padding = {}, window_dimensions = {}, window_strides = {}",
            emit::padding_attr(&w.padding),
            as_i64(&w.dims),
            as_i64(&w.strides)
        )
    }
}

/// The body of a reducer block over scalars `%a`, `%b` of type `st`: float max/min propagate
/// NaN (as `Tensor::max` does on both backends).
fn reducer(out: &mut String, kind: ReduceOp, dtype: DType, st: &str) -> fmt::Result {
    let name = match kind {
        ReduceOp::Sum => "add",
        ReduceOp::Max => "maximum",
        ReduceOp::Min => "minimum",
    };
    writeln!(out, "      ^bb0(%a: {st}, %b: {st}):")?;
    if kind == ReduceOp::Sum || !dtype.is_float() {
        writeln!(out, "        %m = stablehlo.{name} %a, %b : {st}")?;
        return writeln!(out, "        stablehlo.return %m : {st}");
    }
    super::reduce::nan_propagating(out, "        ", name, st, ("a", "b"))
}

/// `stablehlo.reduce_window` with its init constant on the line before (`%initN`).
pub(crate) fn emit_reduce_window(
    mut l: Line<'_>,
    kind: ReduceOp,
    w: &Window,
    dtype: DType,
) -> fmt::Result {
    if let Some(split) = tiles(&l.arg_types[0].dims, w) {
        // Windows that tile the operand: a reshape to `[o₀, k₀, o₁, k₁, …]` and a reduction
        // over the `k` dims, which XLA's CPU backend runs as one vectorised loop where its
        // `reduce-window` visits every window in turn.
        let split_ty = emit::Ty(Some(&LeafType { dtype, dims: split })).to_string();
        let tiled = format!("%tile{}", l.n);
        writeln!(
            l.out,
            "    {tiled} = stablehlo.reshape {} : ({}) -> {split_ty}",
            l.args[0], l.arg_tys[0]
        )?;
        l.args[0] = tiled;
        l.arg_tys[0] = split_ty;
        let taps: Vec<usize> = (0..w.dims.len()).map(|d| 2 * d + 1).collect();
        return super::reduce::emit(l, kind, &taps, dtype);
    }
    let st = emit::scalar_type(dtype);
    let init = super::reduce::emit_init(&mut l, kind, dtype)?;
    writeln!(
        l.out,
        "    {} = \"stablehlo.reduce_window\"({}, {init}) <{{{}}}> ({{",
        l.me,
        l.args[0],
        window_attrs(w, true)
    )?;
    reducer(l.out, kind, dtype, &st)?;
    writeln!(l.out, "    }}) : ({}, {st}) -> {}", l.arg_tys[0], l.ty)
}

/// The operand split as `[o₀, k₀, o₁, k₁, …]` when the window tiles it exactly: strides equal
/// to the window, no padding, no dilation, and every dim a whole number of windows.
fn tiles(dims: &[usize], w: &Window) -> Option<Vec<usize>> {
    let tiling = w.is_plain()
        && w.strides == w.dims
        && w.padding.iter().all(|&p| p == (0, 0))
        && w.dims.len() == dims.len()
        && w.dims.iter().zip(dims).all(|(&k, &n)| k > 0 && n % k == 0);
    tiling.then(|| {
        dims.iter()
            .zip(&w.dims)
            .flat_map(|(&n, &k)| [n / k, k])
            .collect()
    })
}

/// `stablehlo.select_and_scatter` (select `GE` for max, `LE` for min; scatter `add`, init 0).
pub(crate) fn emit_select_and_scatter(
    mut l: Line<'_>,
    kind: ReduceOp,
    w: &Window,
    dtype: DType,
) -> fmt::Result {
    let st = emit::scalar_type(dtype);
    // The scatter adds into zeros.
    let init = super::reduce::emit_init(&mut l, ReduceOp::Sum, dtype)?;
    let dir = if kind == ReduceOp::Min { "LE" } else { "GE" };
    writeln!(
        l.out,
        "    {} = \"stablehlo.select_and_scatter\"({}, {}, {init}) <{{{}}}> ({{",
        l.me,
        l.args[0],
        l.args[1],
        window_attrs(w, false)
    )?;
    writeln!(l.out, "      ^bb0(%a: {st}, %b: {st}):")?;
    writeln!(
        l.out,
        "        %s = stablehlo.compare {dir}, %a, %b, {} : ({st}, {st}) -> tensor<i1>",
        emit::compare_type(dtype)
    )?;
    writeln!(l.out, "        stablehlo.return %s : tensor<i1>")?;
    writeln!(l.out, "    }}, {{")?;
    writeln!(l.out, "      ^bb0(%a: {st}, %b: {st}):")?;
    writeln!(l.out, "        %s = stablehlo.add %a, %b : {st}")?;
    writeln!(l.out, "        stablehlo.return %s : {st}")?;
    writeln!(
        l.out,
        "    }}) : ({}, {}, {st}) -> {}",
        l.arg_tys[0], l.arg_tys[1], l.ty
    )
}

// ---- interpreter ---------------------------------------------------------------------------

/// The operand position window tap `k` of window `o` reads in dim `d`, or `None` for padding
/// and holes.
fn tap(w: &Window, d: usize, n: usize, o: usize, k: usize) -> Option<usize> {
    // In i128: a position within the padded operand (within the limit) minus a low padding of
    // up to 2^63 − 1.
    let p = (o * w.strides[d] + k * w.window_dilation[d]) as i128 - w.padding[d].0 as i128;
    let bd = w.base_dilation[d] as i128;
    if p < 0 || p % bd != 0 || p / bd >= n as i128 {
        None
    } else {
        Some((p / bd) as usize)
    }
}

/// The flat operand positions of window `o` (row-major over its taps; `None` for padding);
/// `s` holds the strides of `dims`.
fn window_positions(
    w: &Window,
    dims: &[usize],
    s: &[usize],
    o: &[usize],
    taps: &mut Vec<Option<usize>>,
) {
    taps.clear();
    let n: usize = w.dims.iter().product();
    let mut k = vec![0; dims.len()];
    for t in 0..n {
        unflatten(t, &w.dims, &mut k);
        let mut at = Some(0usize);
        for d in 0..dims.len() {
            at = match (at, tap(w, d, dims[d], o[d], k[d])) {
                (Some(a), Some(p)) => Some(a + p * s[d]),
                _ => None,
            };
        }
        taps.push(at);
    }
}

fn reduce_window_vec<T: Copy>(
    v: &[T],
    dims: &[usize],
    out_dims: &[usize],
    w: &Window,
    init: T,
    f: impl Fn(T, T) -> T,
) -> Result<Vec<T>, Fault> {
    let n: usize = out_dims.iter().product();
    let ds = strides(dims);
    let mut o = vec![0; dims.len()];
    let mut taps = Vec::new();
    collect(
        n,
        (0..n).map(|i| {
            unflatten(i, out_dims, &mut o);
            window_positions(w, dims, &ds, &o, &mut taps);
            taps.iter().flatten().fold(init, |acc, &p| f(acc, v[p]))
        }),
    )
}

/// `reduce_window` on the host (float max/min propagate NaN, as `Tensor::max`).
pub(crate) fn eval_reduce_window(
    x: &Array,
    out: &LeafType,
    kind: ReduceOp,
    w: &Window,
) -> Result<ArrayData, Fault> {
    use crate::trace::ir::BinaryOp;
    let dims = x.dims();
    let od = &out.dims;
    let op = match kind {
        ReduceOp::Sum => BinaryOp::Add,
        ReduceOp::Max => BinaryOp::Max,
        ReduceOp::Min => BinaryOp::Min,
    };
    macro_rules! float {
        ($v:ident, $t:ty, $variant:ident) => {{
            let init: $t = match kind {
                ReduceOp::Sum => 0.0,
                ReduceOp::Max => <$t>::NEG_INFINITY,
                ReduceOp::Min => <$t>::INFINITY,
            };
            ArrayData::$variant(reduce_window_vec($v, dims, od, w, init, |a, b| {
                crate::ops::elementwise::kernels::float_binary(a, b, op)
            })?)
        }};
    }
    macro_rules! int {
        ($v:ident, $t:ty, $variant:ident) => {{
            let init: $t = match kind {
                ReduceOp::Sum => 0,
                ReduceOp::Max => <$t>::MIN,
                ReduceOp::Min => <$t>::MAX,
            };
            ArrayData::$variant(reduce_window_vec(
                $v,
                dims,
                od,
                w,
                init,
                |a, b| match kind {
                    ReduceOp::Sum => a.wrapping_add(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::Min => a.min(b),
                },
            )?)
        }};
    }
    Ok(match x.data() {
        ArrayData::F32(v) => float!(v, f32, F32),
        ArrayData::F64(v) => float!(v, f64, F64),
        ArrayData::I32(v) => int!(v, i32, I32),
        ArrayData::I64(v) => int!(v, i64, I64),
        ArrayData::U8(v) => int!(v, u8, U8),
        ArrayData::U32(v) => int!(v, u32, U32),
        ArrayData::BF16(_) | ArrayData::F16(_) => {
            return Err(Fault::Invalid(
                "half-precision values are computed in f32 by the interpreter".into(),
            ))
        }
        ArrayData::Bool(_) => return Err(Fault::Invalid("cannot reduce bool windows".into())),
    })
}

fn select_and_scatter_vec<T: Copy + PartialOrd + Default + std::ops::Add<Output = T>>(
    v: &[T],
    src: &[T],
    dims: &[usize],
    src_dims: &[usize],
    w: &Window,
    max: bool,
) -> Result<Vec<T>, Fault> {
    let mut out = filled(v.len(), T::default())?;
    let ds = strides(dims);
    let mut o = vec![0; dims.len()];
    let mut taps = Vec::new();
    for (i, &s) in src.iter().enumerate() {
        unflatten(i, src_dims, &mut o);
        window_positions(w, dims, &ds, &o, &mut taps);
        let mut chosen: Option<usize> = None;
        for &p in taps.iter().flatten() {
            chosen = Some(match chosen {
                None => p,
                // `select(current, candidate)`: keep the current one while it holds, so the
                // first maximum (GE) or minimum (LE) wins ties.
                Some(c) => {
                    let keep = if max { v[c] >= v[p] } else { v[c] <= v[p] };
                    if keep {
                        c
                    } else {
                        p
                    }
                }
            });
        }
        if let Some(c) = chosen {
            out[c] = out[c] + s;
        }
    }
    Ok(out)
}

/// `select_and_scatter` on the host.
pub(crate) fn eval_select_and_scatter(
    x: &Array,
    source: &Array,
    kind: ReduceOp,
    w: &Window,
) -> Result<ArrayData, Fault> {
    let max = kind == ReduceOp::Max;
    let (d, sd) = (x.dims(), source.dims());
    Ok(match (x.data(), source.data()) {
        (ArrayData::F32(v), ArrayData::F32(s)) => {
            ArrayData::F32(select_and_scatter_vec(v, s, d, sd, w, max)?)
        }
        (ArrayData::F64(v), ArrayData::F64(s)) => {
            ArrayData::F64(select_and_scatter_vec(v, s, d, sd, w, max)?)
        }
        (ArrayData::I32(v), ArrayData::I32(s)) => {
            ArrayData::I32(select_and_scatter_vec(v, s, d, sd, w, max)?)
        }
        (ArrayData::I64(v), ArrayData::I64(s)) => {
            ArrayData::I64(select_and_scatter_vec(v, s, d, sd, w, max)?)
        }
        _ => {
            return Err(Fault::Invalid(
                "select_and_scatter needs f32, f64, i32 or i64 operands of one dtype".into(),
            ))
        }
    })
}
