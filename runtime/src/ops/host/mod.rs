//! What the op families' host kernels (the reference interpreter's arithmetic, in
//! [`crate::ops`]) are built on: fallible allocation ([`alloc`]), layout arithmetic and
//! copies ([`layout`]), and [`Fault`], why a node could not be evaluated. It sits below both the
//! op families and the interpreter (`crate::backend::interp`), which drives the kernels, so
//! neither reaches into the other.

pub(crate) mod alloc;
pub(crate) mod layout;

use crate::tree::ArrayData;

/// Why a node could not be evaluated.
#[derive(Debug)]
pub(crate) enum Fault {
    /// The node is malformed (the message says how).
    Invalid(String),
    /// A buffer of `bytes` bytes could not be allocated.
    Alloc {
        /// The size asked for.
        bytes: u64,
    },
}

impl From<String> for Fault {
    fn from(message: String) -> Fault {
        Fault::Invalid(message)
    }
}

/// A copy of typed storage, allocated fallibly.
pub(crate) fn copy_data(data: &ArrayData) -> std::result::Result<ArrayData, Fault> {
    Ok(match data {
        ArrayData::F32(v) => ArrayData::F32(alloc::collect(v.len(), v.iter().copied())?),
        ArrayData::F64(v) => ArrayData::F64(alloc::collect(v.len(), v.iter().copied())?),
        ArrayData::I32(v) => ArrayData::I32(alloc::collect(v.len(), v.iter().copied())?),
        ArrayData::I64(v) => ArrayData::I64(alloc::collect(v.len(), v.iter().copied())?),
        ArrayData::U8(v) => ArrayData::U8(alloc::collect(v.len(), v.iter().copied())?),
        ArrayData::Bool(v) => ArrayData::Bool(alloc::collect(v.len(), v.iter().copied())?),
        ArrayData::U32(v) => ArrayData::U32(alloc::collect(v.len(), v.iter().copied())?),
        ArrayData::BF16(v) => ArrayData::BF16(alloc::collect(v.len(), v.iter().copied())?),
        ArrayData::F16(v) => ArrayData::F16(alloc::collect(v.len(), v.iter().copied())?),
    })
}
