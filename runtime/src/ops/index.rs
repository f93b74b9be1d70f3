//! Indexing with traced indices: `gather`, `scatter` (add, replace), `dynamic_slice`,
//! `dynamic_update_slice`, and on top of them `take` (embedding lookup) and `take_along_axis`
//! (per-row selection).
//!
//! **Out-of-range indices** follow StableHLO as XLA runs it, on both backends:
//! - `gather`, `take`, `take_along_axis`, `dynamic_slice`, `dynamic_update_slice` **clamp**
//!   each start index to `0..=dim − slice size` (an index of −3 reads row 0, one past the end
//!   reads the last row). They never fail and never read out of bounds; NumPy-style negative
//!   indices are not wrapped.
//! - `scatter` **skips** an update whose window would not fit entirely inside the operand.
//!
//! VJPs: gather → scatter-add of the cotangent at the gather's (clamped) starts; scatter-add →
//! the cotangent for the operand, a gather of it (0 where the update was skipped) for the
//! updates; scatter-replace → the cotangent with the replaced positions zeroed, and the same
//! gather for the updates (with repeated indices, every duplicate gets the cotangent of the
//! position, although only one of them was written); dynamic_slice ↔ dynamic_update_slice of
//! zeros. Indices get no gradient.

use std::fmt::{self, Write as _};
use std::panic::Location;

use crate::emit::line::{self as emit, Line};
use crate::ops::host::alloc::collect;
use crate::ops::host::layout::strides;
use crate::ops::host::Fault;
use crate::trace::ir::{with_dims, GatherDims, Op, ScatterDims, ScatterKind};
use crate::trace::record::{with_recording, Tensor};
use crate::tree::{Array, ArrayData, DType, LeafType};

use super::{index_values, unflatten};

fn is_index(dtype: DType) -> bool {
    matches!(dtype, DType::I32 | DType::I64 | DType::U32 | DType::U8)
}

fn sorted_distinct(v: &[usize], below: usize) -> bool {
    v.windows(2).all(|w| w[0] < w[1]) && v.iter().all(|&x| x < below)
}

/// The batch dims of `indices` (all but the index vector dim) and the index vector's length.
fn index_shape(indices: &LeafType, ivd: usize) -> Result<(Vec<usize>, usize), String> {
    let r = indices.dims.len();
    if ivd > r {
        return Err(format!(
            "index_vector_dim {ivd} is past the indices' rank ({indices})"
        ));
    }
    let len = if ivd == r { 1 } else { indices.dims[ivd] };
    let batch = (0..r)
        .filter(|&d| d != ivd)
        .map(|d| indices.dims[d])
        .collect();
    Ok((batch, len))
}

// ---- types ---------------------------------------------------------------------------------

/// The result type of a gather, or what is wrong.
pub(crate) fn gather_type(
    x: &LeafType,
    indices: &LeafType,
    g: &GatherDims,
) -> Result<LeafType, String> {
    if !is_index(indices.dtype) {
        return Err(format!("indices must be integers, got {indices}"));
    }
    let rank = x.dims.len();
    let (batch, len) = index_shape(indices, g.index_vector_dim)?;
    if g.slice_sizes.len() != rank || g.slice_sizes.iter().zip(&x.dims).any(|(s, d)| s > d) {
        return Err(format!(
            "slice sizes {:?} must have one entry per dim of {x}, each at most that dim",
            g.slice_sizes
        ));
    }
    if g.start_index_map.len() != len || !g.start_index_map.iter().all(|&d| d < rank) {
        return Err(format!(
            "start_index_map {:?} must name one operand dim for each of the {len} index components",
            g.start_index_map
        ));
    }
    if let Some(d) = super::repeated(&g.start_index_map) {
        return Err(format!(
            "start_index_map {:?} repeats operand dim {d}: each index component starts its own \
             dim",
            g.start_index_map
        ));
    }
    if !sorted_distinct(&g.collapsed_slice_dims, rank)
        || g.collapsed_slice_dims
            .iter()
            .any(|&d| g.slice_sizes[d] != 1)
    {
        return Err(format!(
            "collapsed_slice_dims {:?} must be ascending dims of {x} with slice size 1",
            g.collapsed_slice_dims
        ));
    }
    let out_rank = batch.len() + rank - g.collapsed_slice_dims.len();
    if g.offset_dims.len() != rank - g.collapsed_slice_dims.len()
        || !sorted_distinct(&g.offset_dims, out_rank)
    {
        return Err(format!(
            "offset_dims {:?} must be {} ascending result dims",
            g.offset_dims,
            rank - g.collapsed_slice_dims.len()
        ));
    }
    let mut sizes = (0..rank)
        .filter(|d| !g.collapsed_slice_dims.contains(d))
        .map(|d| g.slice_sizes[d]);
    let mut batch = batch.into_iter();
    let dims = (0..out_rank)
        .map(|d| {
            if g.offset_dims.contains(&d) {
                sizes.next().unwrap_or(0)
            } else {
                batch.next().unwrap_or(0)
            }
        })
        .collect();
    Ok(with_dims(x.dtype, dims))
}

/// The result type of a scatter (the operand's), or what is wrong.
pub(crate) fn scatter_type(
    x: &LeafType,
    indices: &LeafType,
    updates: &LeafType,
    s: &ScatterDims,
) -> Result<LeafType, String> {
    if !is_index(indices.dtype) {
        return Err(format!("indices must be integers, got {indices}"));
    }
    if updates.dtype != x.dtype {
        return Err(format!(
            "the updates {updates} must have the operand's dtype ({x})"
        ));
    }
    let rank = x.dims.len();
    let (batch, len) = index_shape(indices, s.index_vector_dim)?;
    let ur = updates.dims.len();
    if !sorted_distinct(&s.update_window_dims, ur)
        || !sorted_distinct(&s.inserted_window_dims, rank)
        || s.update_window_dims.len() + s.inserted_window_dims.len() != rank
        || ur != batch.len() + s.update_window_dims.len()
    {
        return Err(format!(
            "dimension numbers {s:?} do not fit the operand {x}, indices {indices} and updates {updates}"
        ));
    }
    if s.scatter_dims_to_operand_dims.len() != len
        || !s.scatter_dims_to_operand_dims.iter().all(|&d| d < rank)
    {
        return Err(format!(
            "scatter_dims_to_operand_dims {:?} must name one operand dim for each of the {len} index components",
            s.scatter_dims_to_operand_dims
        ));
    }
    if let Some(d) = super::repeated(&s.scatter_dims_to_operand_dims) {
        return Err(format!(
            "scatter_dims_to_operand_dims {:?} repeats operand dim {d}: each index component \
             starts its own dim",
            s.scatter_dims_to_operand_dims
        ));
    }
    let window_dims: Vec<usize> = (0..rank)
        .filter(|d| !s.inserted_window_dims.contains(d))
        .collect();
    for (&u, &o) in s.update_window_dims.iter().zip(&window_dims) {
        if updates.dims[u] > x.dims[o] {
            return Err(format!(
                "update dim {u} ({}) is larger than operand dim {o} ({})",
                updates.dims[u], x.dims[o]
            ));
        }
    }
    let update_batch: Vec<usize> = (0..ur)
        .filter(|d| !s.update_window_dims.contains(d))
        .map(|d| updates.dims[d])
        .collect();
    if update_batch != batch {
        return Err(format!(
            "the updates' scatter dims {update_batch:?} must equal the indices' batch dims {batch:?}"
        ));
    }
    Ok(x.clone())
}

/// The result type of a dynamic slice, or what is wrong.
pub(crate) fn dynamic_slice_type(
    x: &LeafType,
    starts: &[LeafType],
    sizes: &[usize],
) -> Result<LeafType, String> {
    check_starts(x, starts)?;
    if sizes.len() != x.dims.len() || sizes.iter().zip(&x.dims).any(|(s, d)| s > d) {
        return Err(format!(
            "sizes {sizes:?} must have one entry per dim of {x}, each at most that dim"
        ));
    }
    Ok(with_dims(x.dtype, sizes.to_vec()))
}

/// The result type of a dynamic update slice (the operand's), or what is wrong.
pub(crate) fn dynamic_update_slice_type(
    x: &LeafType,
    update: &LeafType,
    starts: &[LeafType],
) -> Result<LeafType, String> {
    check_starts(x, starts)?;
    if update.dtype != x.dtype
        || update.dims.len() != x.dims.len()
        || update.dims.iter().zip(&x.dims).any(|(u, d)| u > d)
    {
        return Err(format!(
            "the update {update} must have the dtype and rank of {x}, and no larger dims"
        ));
    }
    Ok(x.clone())
}

fn check_starts(x: &LeafType, starts: &[LeafType]) -> Result<(), String> {
    if starts.len() != x.dims.len() {
        return Err(format!(
            "{} start indices given for {x}, which has {} dims",
            starts.len(),
            x.dims.len()
        ));
    }
    if let Some(bad) = starts
        .iter()
        .find(|s| !s.dims.is_empty() || !is_index(s.dtype) || s.dtype != starts[0].dtype)
    {
        return Err(format!(
            "start indices must be integer scalars of one dtype, got {bad}"
        ));
    }
    Ok(())
}

// ---- tracing -------------------------------------------------------------------------------

impl Tensor {
    /// The general StableHLO gather: slices of `slice_sizes` starting where `indices` say
    /// ([`GatherDims`]); starts are clamped into range (see [`crate::ops::index`]).
    #[track_caller]
    pub fn gather(self, indices: Tensor, dims: &GatherDims) -> Tensor {
        gather_at(self, indices, dims, "gather", Location::caller())
    }

    /// The general StableHLO scatter: `updates` added at (or written to) the starts in
    /// `indices` ([`ScatterDims`]); an update whose window does not fit is skipped.
    #[track_caller]
    pub fn scatter(
        self,
        indices: Tensor,
        updates: Tensor,
        dims: &ScatterDims,
        kind: ScatterKind,
    ) -> Tensor {
        scatter_at(
            self,
            indices,
            updates,
            dims,
            kind,
            "scatter",
            Location::caller(),
        )
    }

    /// Elements along `axis` at `indices` (any integer tensor), as NumPy's `take`: the result
    /// has this tensor's dims with `axis` replaced by the indices' dims. `table.take(ids, 0)`
    /// is an embedding lookup. Indices are clamped to `0..dim` (not wrapped).
    #[track_caller]
    pub fn take(self, indices: Tensor, axis: usize) -> Tensor {
        let at = Location::caller();
        let (x, i) = (self.ty(), indices.ty());
        if axis >= x.dims.len() || !is_index(i.dtype) {
            return with_recording(|r| {
                let msg = if axis >= x.dims.len() {
                    format!("axis {axis} is out of range for {x}")
                } else {
                    format!("indices must be integers, got {i} (operand {x})")
                };
                r.fail("take", msg, at, x)
            });
        }
        let rank = i.dims.len();
        let column = indices.reshape_at(&[i.dims.as_slice(), &[1]].concat(), at);
        let mut slice_sizes = x.dims.clone();
        slice_sizes[axis] = 1;
        let offset_dims = (0..x.dims.len())
            .filter(|&d| d != axis)
            .map(|d| if d < axis { d } else { d - 1 + rank })
            .collect();
        let dims = GatherDims {
            offset_dims,
            collapsed_slice_dims: vec![axis],
            start_index_map: vec![axis],
            index_vector_dim: rank,
            slice_sizes,
        };
        gather_at(self, column, &dims, "take", at)
    }

    /// Elements at `indices` along `axis`, per position of the other dims (NumPy's
    /// `take_along_axis`): `indices` has this tensor's rank and dims except at `axis`, and the
    /// result has the indices' dims. `logits.take_along_axis(labels_column, 1)` picks each
    /// row's entry. Indices are clamped to `0..dim`.
    #[track_caller]
    pub fn take_along_axis(self, indices: Tensor, axis: usize) -> Tensor {
        let at = Location::caller();
        let (x, i) = (self.ty(), indices.ty());
        let rank = x.dims.len();
        let fits = i.dims.len() == rank
            && axis < rank
            && (0..rank).all(|d| d == axis || i.dims[d] == x.dims[d]);
        if !fits || !is_index(i.dtype) {
            return with_recording(|r| {
                r.fail(
                    "take_along_axis",
                    format!(
                        "the indices {i} must be integers of the rank and dims of {x} except at axis {axis}"
                    ),
                    at,
                    with_dims(x.dtype, i.dims.clone()),
                )
            });
        }
        let column: Vec<usize> = [i.dims.as_slice(), &[1]].concat();
        let parts: Vec<Tensor> = (0..rank)
            .map(|d| {
                if d == axis {
                    indices.reshape_at(&column, at)
                } else {
                    Tensor::iota(i.dtype, &column, d)
                }
            })
            .collect();
        let full = Tensor::concatenate(&parts, rank);
        let dims = GatherDims {
            offset_dims: vec![],
            collapsed_slice_dims: (0..rank).collect(),
            start_index_map: (0..rank).collect(),
            index_vector_dim: rank,
            slice_sizes: vec![1; rank],
        };
        gather_at(self, full, &dims, "take_along_axis", at)
    }

    /// The slice of `sizes` starting at traced `starts` (one integer scalar per dim), each
    /// start clamped to `0..=dim − size`.
    #[track_caller]
    pub fn dynamic_slice(self, starts: &[Tensor], sizes: &[usize]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| {
            if !r.owns(self, "dynamic_slice", at)
                || starts.iter().any(|&s| !r.owns(s, "dynamic_slice", at))
            {
                return r.stand_in(super::f32_scalar());
            }
            let x = r.ty_of(self);
            let st: Vec<LeafType> = starts.iter().map(|&s| r.ty_of(s)).collect();
            match dynamic_slice_type(&x, &st, sizes) {
                Ok(ty) => r.push(
                    Op::DynamicSlice {
                        sizes: sizes.to_vec(),
                    },
                    std::iter::once(self.node)
                        .chain(starts.iter().map(|s| s.node))
                        .collect(),
                    ty,
                    "dynamic_slice",
                    at,
                ),
                Err(msg) => r.fail("dynamic_slice", msg, at, with_dims(x.dtype, sizes.to_vec())),
            }
        })
    }

    /// This tensor with `update` written at traced `starts` (one integer scalar per dim), each
    /// start clamped to `0..=dim − update dim`.
    #[track_caller]
    pub fn dynamic_update_slice(self, update: Tensor, starts: &[Tensor]) -> Tensor {
        let at = Location::caller();
        with_recording(|r| {
            let op = "dynamic_update_slice";
            if !r.owns(self, op, at)
                || !r.owns(update, op, at)
                || starts.iter().any(|&s| !r.owns(s, op, at))
            {
                return r.stand_in(super::f32_scalar());
            }
            let (x, u) = (r.ty_of(self), r.ty_of(update));
            let st: Vec<LeafType> = starts.iter().map(|&s| r.ty_of(s)).collect();
            match dynamic_update_slice_type(&x, &u, &st) {
                Ok(ty) => r.push(
                    Op::DynamicUpdateSlice,
                    [self.node, update.node]
                        .into_iter()
                        .chain(starts.iter().map(|s| s.node))
                        .collect(),
                    ty,
                    op,
                    at,
                ),
                Err(msg) => r.fail(op, msg, at, x),
            }
        })
    }

    fn reshape_at(self, dims: &[usize], at: &Location<'_>) -> Tensor {
        with_recording(|r| r.reshape(self, dims, at))
    }
}

fn gather_at(
    x: Tensor,
    indices: Tensor,
    dims: &GatherDims,
    op: &'static str,
    at: &Location<'_>,
) -> Tensor {
    with_recording(|r| {
        if !r.owns(x, op, at) || !r.owns(indices, op, at) {
            return r.stand_in(super::f32_scalar());
        }
        let (xt, it) = (r.ty_of(x), r.ty_of(indices));
        match gather_type(&xt, &it, dims) {
            Ok(ty) => r.push(
                Op::Gather(dims.clone()),
                vec![x.node, indices.node],
                ty,
                op,
                at,
            ),
            Err(msg) => r.fail(op, format!("{msg} (operand {xt}, indices {it})"), at, xt),
        }
    })
}

fn scatter_at(
    x: Tensor,
    indices: Tensor,
    updates: Tensor,
    dims: &ScatterDims,
    kind: ScatterKind,
    op: &'static str,
    at: &Location<'_>,
) -> Tensor {
    with_recording(|r| {
        if !r.owns(x, op, at) || !r.owns(indices, op, at) || !r.owns(updates, op, at) {
            return r.stand_in(super::f32_scalar());
        }
        let (xt, it, ut) = (r.ty_of(x), r.ty_of(indices), r.ty_of(updates));
        match scatter_type(&xt, &it, &ut, dims) {
            Ok(ty) => r.push(
                Op::Scatter {
                    dims: dims.clone(),
                    kind,
                },
                vec![x.node, indices.node, updates.node],
                ty,
                op,
                at,
            ),
            Err(msg) => r.fail(op, msg, at, xt),
        }
    })
}

// ---- gradients -----------------------------------------------------------------------------

/// The largest in-range start of each index component, as a tensor of the indices' shape.
fn start_bounds(indices: Tensor, ivd: usize, bounds: &[i64]) -> Tensor {
    let it = indices.ty();
    let values =
        Array::from_vec(&[bounds.len()], bounds.to_vec()).unwrap_or_else(|_| Array::scalar(0i64));
    let b = Tensor::constant(values).convert(it.dtype);
    if ivd == it.dims.len() {
        b.reshape(&[]).broadcast_to(&it.dims)
    } else {
        let mut shape = vec![1; it.dims.len()];
        shape[ivd] = bounds.len();
        b.reshape(&shape).broadcast_to(&it.dims)
    }
}

/// The VJP of a gather for (operand, indices).
pub(crate) fn gather_vjp(
    d: &GatherDims,
    x: Tensor,
    indices: Tensor,
    g: Tensor,
) -> Vec<Option<Tensor>> {
    let xd = x.dims();
    let bounds: Vec<i64> = d
        .start_index_map
        .iter()
        .map(|&o| (xd[o] - d.slice_sizes[o]) as i64)
        .collect();
    // The starts the gather actually used (it clamps; a scatter would skip instead).
    let clamped = Tensor::clamp(
        0.0,
        indices,
        start_bounds(indices, d.index_vector_dim, &bounds),
    );
    let dims = ScatterDims {
        update_window_dims: d.offset_dims.clone(),
        inserted_window_dims: d.collapsed_slice_dims.clone(),
        scatter_dims_to_operand_dims: d.start_index_map.clone(),
        index_vector_dim: d.index_vector_dim,
    };
    let dx = x.zeros_like().scatter(clamped, g, &dims, ScatterKind::Add);
    vec![Some(dx), None]
}

/// The VJP of a scatter for (operand, indices, updates).
pub(crate) fn scatter_vjp(
    s: &ScatterDims,
    kind: ScatterKind,
    x: Tensor,
    indices: Tensor,
    updates: Tensor,
    g: Tensor,
) -> Vec<Option<Tensor>> {
    let (xd, ud) = (x.dims(), updates.dims());
    let window_dims: Vec<usize> = (0..xd.len())
        .filter(|d| !s.inserted_window_dims.contains(d))
        .collect();
    let mut slice_sizes = vec![1; xd.len()];
    for (&u, &o) in s.update_window_dims.iter().zip(&window_dims) {
        slice_sizes[o] = ud[u];
    }
    let gd = GatherDims {
        offset_dims: s.update_window_dims.clone(),
        collapsed_slice_dims: s.inserted_window_dims.clone(),
        start_index_map: s.scatter_dims_to_operand_dims.clone(),
        index_vector_dim: s.index_vector_dim,
        slice_sizes: slice_sizes.clone(),
    };
    // Updates the scatter skipped (their window did not fit) get no gradient.
    let it = indices.ty();
    let bounds: Vec<i64> = s
        .scatter_dims_to_operand_dims
        .iter()
        .map(|&o| (xd[o] - slice_sizes[o]) as i64)
        .collect();
    let upper = start_bounds(indices, s.index_vector_dim, &bounds);
    let ones = Tensor::full(&it.dims, 1.0, g.dtype());
    let inside = Tensor::select(indices.less_equal(upper), ones, 0.0);
    let ok = Tensor::select(indices.greater_equal(0.0), inside, 0.0);
    let ok = if s.index_vector_dim < it.dims.len() {
        ok.min(&[s.index_vector_dim])
    } else {
        ok
    };
    let map: Vec<usize> = (0..ud.len())
        .filter(|d| !s.update_window_dims.contains(d))
        .collect();
    let mask = broadcast_in(ok, &ud, &map);
    let du = g.gather(indices, &gd) * mask;
    let dx = match kind {
        ScatterKind::Add => g,
        ScatterKind::Replace => g.scatter(indices, updates.zeros_like(), s, ScatterKind::Replace),
    };
    vec![Some(dx), None, Some(du)]
}

/// `t` broadcast to `dims`, its dim `i` becoming dim `map[i]`.
fn broadcast_in(t: Tensor, dims: &[usize], map: &[usize]) -> Tensor {
    let at = Location::caller();
    with_recording(|r| {
        let ty = r.ty_of(t);
        r.push(
            Op::BroadcastInDim { dims: map.to_vec() },
            vec![t.node],
            with_dims(ty.dtype, dims.to_vec()),
            "scatter",
            at,
        )
    })
}

/// The VJP of a dynamic slice for (operand, starts…).
pub(crate) fn dynamic_slice_vjp(x: Tensor, starts: &[Tensor], g: Tensor) -> Vec<Option<Tensor>> {
    let dx = x.zeros_like().dynamic_update_slice(g, starts);
    std::iter::once(Some(dx))
        .chain(starts.iter().map(|_| None))
        .collect()
}

/// The VJP of a dynamic update slice for (operand, update, starts…).
pub(crate) fn dynamic_update_slice_vjp(
    update: Tensor,
    starts: &[Tensor],
    g: Tensor,
) -> Vec<Option<Tensor>> {
    let dx = g.dynamic_update_slice(update.zeros_like(), starts);
    let du = g.dynamic_slice(starts, &update.dims());
    [Some(dx), Some(du)]
        .into_iter()
        .chain(starts.iter().map(|_| None))
        .collect()
}

// ---- emission ------------------------------------------------------------------------------

/// `stablehlo.gather`.
pub(crate) fn emit_gather(l: Line<'_>, d: &GatherDims) -> fmt::Result {
    writeln!(
        l.out,
        "    {} = \"stablehlo.gather\"({}, {}) <{{dimension_numbers = #stablehlo.gather<offset_dims = {}, collapsed_slice_dims = {}, start_index_map = {}, index_vector_dim = {}>, indices_are_sorted = false, slice_sizes = {}}}> : ({}, {}) -> {}",
        l.me,
        l.args[0],
        l.args[1],
        emit::list(&d.offset_dims),
        emit::list(&d.collapsed_slice_dims),
        emit::list(&d.start_index_map),
        d.index_vector_dim,
        emit::i64_array(d.slice_sizes.iter().map(|&s| s as i64)),
        l.arg_tys[0],
        l.arg_tys[1],
        l.ty
    )
}

/// `stablehlo.scatter` with an `add` or a replacing update region.
pub(crate) fn emit_scatter(
    l: Line<'_>,
    d: &ScatterDims,
    kind: ScatterKind,
    dtype: DType,
) -> fmt::Result {
    let st = emit::scalar_type(dtype);
    writeln!(
        l.out,
        "    {} = \"stablehlo.scatter\"({}, {}, {}) <{{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = {}, inserted_window_dims = {}, scatter_dims_to_operand_dims = {}, index_vector_dim = {}>, unique_indices = false}}> ({{",
        l.me,
        l.args[0],
        l.args[1],
        l.args[2],
        emit::list(&d.update_window_dims),
        emit::list(&d.inserted_window_dims),
        emit::list(&d.scatter_dims_to_operand_dims),
        d.index_vector_dim,
    )?;
    writeln!(l.out, "      ^bb0(%old: {st}, %new: {st}):")?;
    match kind {
        ScatterKind::Add => {
            let add = if dtype == DType::Bool { "or" } else { "add" };
            writeln!(l.out, "        %s = stablehlo.{add} %old, %new : {st}")?;
            writeln!(l.out, "        stablehlo.return %s : {st}")?;
        }
        ScatterKind::Replace => writeln!(l.out, "        stablehlo.return %new : {st}")?,
    }
    writeln!(
        l.out,
        "    }}) : ({}, {}, {}) -> {}",
        l.arg_tys[0], l.arg_tys[1], l.arg_tys[2], l.ty
    )
}

/// `stablehlo.dynamic_slice`.
pub(crate) fn emit_dynamic_slice(l: Line<'_>, sizes: &[usize]) -> fmt::Result {
    write!(
        l.out,
        "    {} = stablehlo.dynamic_slice {}",
        l.me, l.args[0]
    )?;
    for a in &l.args[1..] {
        write!(l.out, ", {a}")?;
    }
    writeln!(
        l.out,
        ", sizes = {} : ({}) -> {}",
        emit::list(sizes),
        l.arg_tys.join(", "),
        l.ty
    )
}

/// `stablehlo.dynamic_update_slice`.
pub(crate) fn emit_dynamic_update_slice(l: Line<'_>) -> fmt::Result {
    writeln!(
        l.out,
        "    {} = stablehlo.dynamic_update_slice {} : ({}) -> {}",
        l.me,
        l.args.join(", "),
        l.arg_tys.join(", "),
        l.ty
    )
}

// ---- interpreter ---------------------------------------------------------------------------

/// The index vector of batch position `batch` (dims without `ivd`) from `idx` (shape `id`).
/// `s` holds the strides of `id`.
fn index_vector(
    idx: &[i64],
    id: &[usize],
    s: &[usize],
    ivd: usize,
    batch: &[usize],
    out: &mut Vec<i64>,
) {
    out.clear();
    let mut base = 0;
    let mut b = batch.iter();
    for (d, &st) in s.iter().enumerate() {
        if d != ivd {
            base += b.next().copied().unwrap_or(0) * st;
        }
    }
    if ivd == id.len() {
        out.push(idx[base]);
    } else {
        out.extend((0..id[ivd]).map(|k| idx[base + k * s[ivd]]));
    }
}

fn gather_vec<T: Copy>(
    v: &[T],
    xd: &[usize],
    idx: &[i64],
    id: &[usize],
    od: &[usize],
    g: &GatherDims,
) -> Result<Vec<T>, Fault> {
    let (xs, ids) = (strides(xd), strides(id));
    let total: usize = od.iter().product();
    let mut o = vec![0; od.len()];
    let mut vec_ = Vec::new();
    let mut batch = Vec::new();
    collect(
        total,
        (0..total).map(|i| {
            unflatten(i, od, &mut o);
            batch.clear();
            batch.extend(
                (0..od.len())
                    .filter(|d| !g.offset_dims.contains(d))
                    .map(|d| o[d]),
            );
            index_vector(idx, id, &ids, g.index_vector_dim, &batch, &mut vec_);
            let mut offsets = g.offset_dims.iter().map(|&d| o[d]);
            let mut at = 0;
            for d in 0..xd.len() {
                let start =
                    g.start_index_map
                        .iter()
                        .position(|&m| m == d)
                        .map_or(0, |k| vec_[k])
                        .clamp(0, (xd[d] - g.slice_sizes[d]) as i64) as usize;
                let off = if g.collapsed_slice_dims.contains(&d) {
                    0
                } else {
                    offsets.next().unwrap_or(0)
                };
                at += (start + off) * xs[d];
            }
            v[at]
        }),
    )
}

/// A gather on the host.
pub(crate) fn eval_gather(
    x: &Array,
    indices: &Array,
    out: &LeafType,
    g: &GatherDims,
) -> Result<ArrayData, Fault> {
    let idx = index_values(indices.data())?;
    let (xd, id) = (x.dims(), indices.dims());
    Ok(super::same_dtype!(x.data(), v => gather_vec(v, xd, &idx, id, &out.dims, g)))
}

#[allow(clippy::too_many_arguments)]
fn scatter_vec<T: Copy>(
    v: &[T],
    xd: &[usize],
    idx: &[i64],
    id: &[usize],
    u: &[T],
    ud: &[usize],
    s: &ScatterDims,
    combine: impl Fn(T, T) -> T,
) -> Result<Vec<T>, Fault> {
    let mut out = collect(v.len(), v.iter().copied())?;
    let (xs, ids) = (strides(xd), strides(id));
    let window_dims: Vec<usize> = (0..xd.len())
        .filter(|d| !s.inserted_window_dims.contains(d))
        .collect();
    // The window's size per operand dim.
    let mut size = vec![1usize; xd.len()];
    for (&w, &o) in s.update_window_dims.iter().zip(&window_dims) {
        size[o] = ud[w];
    }
    let mut k = vec![0; ud.len()];
    let mut vec_ = Vec::new();
    let mut batch = Vec::new();
    for (i, &x) in u.iter().enumerate() {
        unflatten(i, ud, &mut k);
        batch.clear();
        batch.extend(
            (0..ud.len())
                .filter(|d| !s.update_window_dims.contains(d))
                .map(|d| k[d]),
        );
        index_vector(idx, id, &ids, s.index_vector_dim, &batch, &mut vec_);
        let mut window = s.update_window_dims.iter().map(|&d| k[d]);
        let mut at = 0;
        let mut fits = true;
        for d in 0..xd.len() {
            let start = s
                .scatter_dims_to_operand_dims
                .iter()
                .position(|&m| m == d)
                .map_or(0, |c| vec_[c]);
            // XLA skips an update whose whole window does not fit.
            if start < 0 || start + size[d] as i64 > xd[d] as i64 {
                fits = false;
            }
            let off = if s.inserted_window_dims.contains(&d) {
                0
            } else {
                window.next().unwrap_or(0)
            };
            at += (start.max(0) as usize + off) * xs[d];
        }
        if fits {
            out[at] = combine(out[at], x);
        }
    }
    Ok(out)
}

/// A scatter on the host (additions in update order).
pub(crate) fn eval_scatter(
    x: &Array,
    indices: &Array,
    updates: &Array,
    s: &ScatterDims,
    kind: ScatterKind,
) -> Result<ArrayData, Fault> {
    let idx = index_values(indices.data())?;
    let (xd, id, ud) = (x.dims(), indices.dims(), updates.dims());
    macro_rules! go {
        ($v:ident, $u:ident, $add:expr) => {
            match kind {
                ScatterKind::Add => scatter_vec($v, xd, &idx, id, $u, ud, s, $add),
                ScatterKind::Replace => scatter_vec($v, xd, &idx, id, $u, ud, s, |_, n| n),
            }
        };
    }
    Ok(match (x.data(), updates.data()) {
        (ArrayData::F32(v), ArrayData::F32(u)) => ArrayData::F32(go!(v, u, |a, b| a + b)?),
        (ArrayData::F64(v), ArrayData::F64(u)) => ArrayData::F64(go!(v, u, |a, b| a + b)?),
        (ArrayData::I32(v), ArrayData::I32(u)) => ArrayData::I32(go!(v, u, i32::wrapping_add)?),
        (ArrayData::I64(v), ArrayData::I64(u)) => ArrayData::I64(go!(v, u, i64::wrapping_add)?),
        (ArrayData::U8(v), ArrayData::U8(u)) => ArrayData::U8(go!(v, u, u8::wrapping_add)?),
        (ArrayData::U32(v), ArrayData::U32(u)) => ArrayData::U32(go!(v, u, u32::wrapping_add)?),
        (ArrayData::Bool(v), ArrayData::Bool(u)) => ArrayData::Bool(go!(v, u, |a, b| a | b)?),
        _ => {
            return Err(Fault::Invalid(
                "the updates have another dtype than the operand".into(),
            ))
        }
    })
}

/// The clamped starts of a dynamic slice of `sizes` out of `dims`.
fn clamped_starts(starts: &[&Array], dims: &[usize], sizes: &[usize]) -> Result<Vec<usize>, Fault> {
    starts
        .iter()
        .zip(dims.iter().zip(sizes))
        .map(|(s, (&d, &n))| {
            let v = index_values(s.data())?;
            let v = *v
                .first()
                .ok_or_else(|| Fault::Invalid("a start index is empty".into()))?;
            Ok(v.clamp(0, (d - n) as i64) as usize)
        })
        .collect()
}

fn dus_vec<T: Copy>(
    v: &[T],
    xd: &[usize],
    u: &[T],
    ud: &[usize],
    start: &[usize],
) -> Result<Vec<T>, Fault> {
    let mut out = collect(v.len(), v.iter().copied())?;
    let xs = strides(xd);
    let mut k = vec![0; ud.len()];
    for (i, &x) in u.iter().enumerate() {
        unflatten(i, ud, &mut k);
        let at: usize = (0..xd.len()).map(|d| (start[d] + k[d]) * xs[d]).sum();
        out[at] = x;
    }
    Ok(out)
}

/// A dynamic slice on the host.
pub(crate) fn eval_dynamic_slice(
    x: &Array,
    starts: &[&Array],
    sizes: &[usize],
) -> Result<ArrayData, Fault> {
    let start = clamped_starts(starts, x.dims(), sizes)?;
    let s = strides(x.dims());
    let base: usize = start.iter().zip(&s).map(|(a, b)| a * b).sum();
    Ok(super::same_dtype!(x.data(), v => crate::ops::host::layout::gather(v, sizes, &s, base)))
}

/// A dynamic update slice on the host.
pub(crate) fn eval_dynamic_update_slice(
    x: &Array,
    update: &Array,
    starts: &[&Array],
) -> Result<ArrayData, Fault> {
    let start = clamped_starts(starts, x.dims(), update.dims())?;
    let (xd, ud) = (x.dims(), update.dims());
    macro_rules! go {
        ($($variant:ident),*) => {
            match (x.data(), update.data()) {
                $((ArrayData::$variant(v), ArrayData::$variant(u)) => ArrayData::$variant(dus_vec(v, xd, u, ud, &start)?),)*
                _ => return Err(Fault::Invalid("the update has another dtype than the operand".into())),
            }
        };
    }
    Ok(go!(F32, F64, I32, I64, U8, Bool, U32, BF16, F16))
}
