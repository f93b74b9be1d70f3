//! Data movement: strided gathers (transpose, broadcast, slice), concatenation and iota.
//!
//! Every function here is generic over the element type and assumes its arguments were checked
//! by [`super::check`]: dims, permutations and windows fit the operand.

use crate::tree::{dims_product, Array, ArrayData, DType, Element};

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

/// Broadcasts storage of shape `in_dims` to `out_dims`: operand dim `i` becomes result dim
/// `map[i]` (its size equal, or 1).
pub(crate) fn broadcast(
    data: &ArrayData,
    in_dims: &[usize],
    out_dims: &[usize],
    map: &[usize],
) -> Result<ArrayData, Fault> {
    let s = strides(in_dims);
    let mut out_strides = vec![0; out_dims.len()];
    for (i, &d) in map.iter().enumerate() {
        if in_dims[i] != 1 {
            out_strides[d] = s[i];
        }
    }
    Ok(map_data!(data, v => gather(v, out_dims, &out_strides, 0)))
}

/// The strided window `start..limit` step `steps` of storage of shape `dims`; `out_dims` is the
/// window's shape.
pub(crate) fn slice(
    data: &ArrayData,
    dims: &[usize],
    start: &[usize],
    steps: &[usize],
    out_dims: &[usize],
) -> Result<ArrayData, Fault> {
    let s = strides(dims);
    let base = start.iter().zip(&s).map(|(a, b)| a * b).sum();
    let out_strides: Vec<usize> = s.iter().zip(steps).map(|(a, b)| a * b).collect();
    Ok(map_data!(data, v => gather(v, out_dims, &out_strides, base)))
}

fn concat_vec<T: Element>(parts: &[&Array], axis: usize) -> Result<Vec<T>, Fault> {
    let differ = || Fault::from("its operands have different dtypes".to_owned());
    let first = parts.first().ok_or_else(differ)?;
    // Sub-products of checked types (see `strides`) and a sum bounded by the checked result.
    let outer = dims_product(&first.dims()[..axis]).unwrap_or(0);
    let inner = dims_product(&first.dims()[axis + 1..]).unwrap_or(0);
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let slices = parts
        .iter()
        .map(|p| Some((T::unwrap(p.data())?, p.dims()[axis] * inner)))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(differ)?;
    let mut out = with_capacity(total)?;
    for o in 0..outer {
        for &(v, chunk) in &slices {
            out.extend_from_slice(&v[o * chunk..(o + 1) * chunk]);
        }
    }
    Ok(out)
}

/// Joins arrays of one dtype along `axis` (all other dims equal); an invalid-graph fault when
/// dtypes differ.
pub(crate) fn concatenate(parts: &[&Array], axis: usize, dtype: DType) -> Result<ArrayData, Fault> {
    Ok(match dtype {
        DType::F32 => ArrayData::F32(concat_vec(parts, axis)?),
        DType::F64 => ArrayData::F64(concat_vec(parts, axis)?),
        DType::I32 => ArrayData::I32(concat_vec(parts, axis)?),
        DType::I64 => ArrayData::I64(concat_vec(parts, axis)?),
        DType::U8 => ArrayData::U8(concat_vec(parts, axis)?),
        DType::Bool => ArrayData::Bool(concat_vec(parts, axis)?),
        DType::U32 => ArrayData::U32(concat_vec(parts, axis)?),
        DType::BF16 => ArrayData::BF16(concat_vec(parts, axis)?),
        DType::F16 => ArrayData::F16(concat_vec(parts, axis)?),
    })
}

/// Iota: element `[i0, i1, …]` is `i_axis`, converted to `dtype` as by `as` (integers wrap).
/// An invalid-graph fault for `bool`, which has no iota.
pub(crate) fn iota(dtype: DType, dims: &[usize], axis: usize) -> Result<ArrayData, Fault> {
    let n = dims_product(dims).ok_or_else(|| Fault::from(format!("{dims:?} overflow")))?;
    let stride = dims_product(&dims[axis + 1..]).unwrap_or(1).max(1);
    let size = dims[axis].max(1);
    let index = (0..n).map(move |i| (i / stride) % size);
    Ok(match dtype {
        DType::F32 => ArrayData::F32(collect(n, index.map(|i| i as f32))?),
        DType::F64 => ArrayData::F64(collect(n, index.map(|i| i as f64))?),
        DType::I32 => ArrayData::I32(collect(n, index.map(|i| i as i32))?),
        DType::I64 => ArrayData::I64(collect(n, index.map(|i| i as i64))?),
        DType::U8 => ArrayData::U8(collect(n, index.map(|i| i as u8))?),
        DType::U32 => ArrayData::U32(collect(n, index.map(|i| i as u32))?),
        DType::BF16 => ArrayData::BF16(collect(n, index.map(|i| half::bf16::from_f32(i as f32)))?),
        DType::F16 => ArrayData::F16(collect(n, index.map(|i| half::f16::from_f32(i as f32)))?),
        DType::Bool => return Err(Fault::from("iota is not defined for bool".to_owned())),
    })
}
