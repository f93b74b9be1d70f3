//! Data movement: strided gathers (transpose, broadcast, slice), concatenation and iota.
//!
//! Every function here is generic over the element type and assumes its arguments were checked
//! by the interpreter's check of a graph (`backend/interp/check.rs`): dims, permutations and
//! windows fit the operand.

use crate::tree::{dims_product, ArrayData};

use super::alloc::{collect, with_capacity};
use super::Fault;

/// Applies `$body` to the elements of `$data` (bound to `$v`, a `&Vec<T>`), wrapping the
/// resulting `Result<Vec<T>, Fault>` (after `?`) in the same `ArrayData` variant.
macro_rules! map_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            ArrayData::F32($v) => ArrayData::F32($body?),
            ArrayData::F64($v) => ArrayData::F64($body?),
            ArrayData::I32($v) => ArrayData::I32($body?),
            ArrayData::I64($v) => ArrayData::I64($body?),
            ArrayData::U8($v) => ArrayData::U8($body?),
            ArrayData::Bool($v) => ArrayData::Bool($body?),
            ArrayData::U32($v) => ArrayData::U32($body?),
            ArrayData::BF16($v) => ArrayData::BF16($body?),
            ArrayData::F16($v) => ArrayData::F16($body?),
        }
    };
}
pub(crate) use map_data;

/// Row-major strides of `dims`, in elements. The products cannot overflow: every type the
/// interpreter meets is within the size limit (`check::node`), which bounds them.
pub(crate) fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// The elements `src[base + Σ idx[d] * strides[d]]` for every index `idx` of `dims`, in
/// row-major order.
pub(crate) fn gather<T: Copy>(
    src: &[T],
    dims: &[usize],
    strides: &[usize],
    base: usize,
) -> Result<Vec<T>, Fault> {
    let n = dims_product(dims).ok_or_else(|| Fault::from(format!("{dims:?} overflow")))?;
    let mut out = with_capacity(n)?;
    if n == 0 {
        return Ok(out);
    }
    let Some(last) = dims.len().checked_sub(1) else {
        out.push(src[base]);
        return Ok(out);
    };
    let (inner, inner_stride) = (dims[last], strides[last]);
    let mut idx = vec![0usize; last];
    let mut offset = base;
    loop {
        if inner_stride == 1 {
            out.extend_from_slice(&src[offset..offset + inner]);
        } else {
            out.extend((0..inner).map(|j| src[offset + j * inner_stride]));
        }
        // Advance the odometer over the outer dims.
        let mut d = last;
        loop {
            if d == 0 {
                return Ok(out);
            }
            d -= 1;
            idx[d] += 1;
            offset += strides[d];
            if idx[d] < dims[d] {
                break;
            }
            offset -= strides[d] * dims[d];
            idx[d] = 0;
        }
    }
}

/// [`gather`] over typed storage.
pub(crate) fn gather_data(
    data: &ArrayData,
    dims: &[usize],
    strides: &[usize],
    base: usize,
) -> Result<ArrayData, Fault> {
    Ok(map_data!(data, v => gather(v, dims, strides, base)))
}

/// Whether `perm` is `0, 1, 2, …`.
pub(crate) fn is_identity(perm: &[usize]) -> bool {
    perm.iter().enumerate().all(|(i, &p)| i == p)
}

/// Result dim `i` is operand dim `perm[i]`.
pub(crate) fn transpose_vec<T: Copy>(
    src: &[T],
    dims: &[usize],
    perm: &[usize],
) -> Result<Vec<T>, Fault> {
    if is_identity(perm) {
        return collect(src.len(), src.iter().copied());
    }
    let s = strides(dims);
    let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let out_strides: Vec<usize> = perm.iter().map(|&p| s[p]).collect();
    gather(src, &out_dims, &out_strides, 0)
}

/// Transposes typed storage of shape `dims`.
pub(crate) fn transpose(
    data: &ArrayData,
    dims: &[usize],
    perm: &[usize],
) -> Result<ArrayData, Fault> {
    Ok(map_data!(data, v => transpose_vec(v, dims, perm)))
}

/// The sub-array of `a` at `window` (`(start, len)` per dim).
pub(crate) fn window_of(
    a: &crate::tree::Array,
    window: &[(usize, usize)],
) -> crate::error::Result<crate::tree::Array> {
    let s = strides(a.dims());
    let base = window.iter().zip(&s).map(|(w, s)| w.0 * s).sum();
    let dims: Vec<usize> = window.iter().map(|w| w.1).collect();
    let data =
        gather_data(a.data(), &dims, &s, base).map_err(|f| crate::error::Error::Sharding {
            what: a.leaf_type().to_string(),
            problem: format!("cannot cut a shard out of it: {f:?}"),
        })?;
    crate::tree::Array::from_data(&dims, data)
}

/// An array of `dims` and `dtype` made of `pieces`, each written at its window (`(start, len)`
/// per dim); where pieces overlap, the first one written wins.
pub(crate) fn assemble(
    dims: &[usize],
    dtype: crate::tree::DType,
    pieces: &[(Vec<(usize, usize)>, &crate::tree::Array)],
) -> crate::error::Result<crate::tree::Array> {
    use crate::tree::Element;
    fn put<T: Element>(
        out: &mut [T],
        written: &mut [bool],
        out_strides: &[usize],
        window: &[(usize, usize)],
        src: &[T],
    ) {
        let dims: Vec<usize> = window.iter().map(|w| w.1).collect();
        let mut idx = vec![0usize; dims.len()];
        for &value in src {
            let at: usize = idx
                .iter()
                .zip(window)
                .zip(out_strides)
                .map(|((i, w), s)| (w.0 + i) * s)
                .sum();
            if !written[at] {
                out[at] = value;
                written[at] = true;
            }
            for d in (0..dims.len()).rev() {
                idx[d] += 1;
                if idx[d] < dims[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
    let mut out = crate::tree::Array::try_zeros(dtype, dims)?;
    let mut written = vec![false; out.len()];
    let s = strides(dims);
    for (window, piece) in pieces {
        let mismatch = || crate::error::Error::Sharding {
            what: piece.leaf_type().to_string(),
            problem: format!("a shard of {dtype} expected"),
        };
        macro_rules! each {
            ($($t:ty),*) => {
                match piece.dtype() {
                    $(d if d == <$t as Element>::DTYPE => put(
                        out.as_slice_mut::<$t>()?,
                        &mut written,
                        &s,
                        window,
                        piece.as_slice::<$t>().map_err(|_| mismatch())?,
                    ),)*
                    _ => return Err(mismatch()),
                }
            };
        }
        each!(f32, f64, i32, i64, u8, bool, u32, half::bf16, half::f16);
    }
    Ok(out)
}
