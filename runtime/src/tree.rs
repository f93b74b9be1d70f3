//! Host arrays and trees of them: the values of `#[device]` fields.
//!
//! An [`Array`] is a dense, row-major tensor on the host. A [`Tree`] is a value built from arrays
//! — `Vec`s, `Option`s, fixed-size arrays, tuples and `#[derive(Tree)]` structs of them. The
//! compile key sees a tree only through its [`Signature`]: structure, leaf paths, dtypes and
//! dims, never the numbers inside.
//!
//! ```
//! use nitro::{Array, Tree};
//!
//! #[derive(Tree)]
//! struct Dense { w: Array, b: Array }
//!
//! let layers = vec![
//!     Dense { w: Array::zeros(nitro::DType::F32, &[64, 128]), b: Array::zeros(nitro::DType::F32, &[128]) },
//!     Dense { w: Array::zeros(nitro::DType::F32, &[128, 10]), b: Array::zeros(nitro::DType::F32, &[10]) },
//! ];
//! let sig = layers.signature_at("layers");
//! assert_eq!(sig.to_string(), "layers[0].w: f32[64,128], layers[0].b: f32[128], layers[1].w: f32[128,10], layers[1].b: f32[10]");
//! ```

use std::fmt;

use crate::error::{Error, Result};
use crate::hash::{ContentHash, ContentHasher, Digest};

/// The element type of an [`Array`].
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// 8-bit unsigned integer.
    U8,
    /// Boolean (one byte per element on the host).
    Bool,
    /// 32-bit unsigned integer (random bits, bit manipulation).
    U32,
    /// bfloat16: 8 exponent bits, 7 mantissa bits ([`half::bf16`]).
    BF16,
    /// IEEE half precision: 5 exponent bits, 10 mantissa bits ([`half::f16`]).
    F16,
}

impl DType {
    /// All dtypes, in tag order.
    pub const ALL: [DType; 9] = [
        DType::F32,
        DType::F64,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::Bool,
        DType::U32,
        DType::BF16,
        DType::F16,
    ];

    /// Bytes per element on the host.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::U8 | DType::Bool => 1,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Whether this is a floating-point type (the only kind gradients flow through).
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    /// Whether this is a half-precision float (bf16, f16): what the interpreter widens to f32
    /// for arithmetic, and what a [`Precision`](crate::train::Precision) reduces in f32.
    pub const fn is_half(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }

    /// The lowercase name used in signatures and manifests (`f32`, `bool`, …).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Bool => "bool",
            DType::U32 => "u32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    const fn tag(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F64 => 1,
            DType::I32 => 2,
            DType::I64 => 3,
            DType::U8 => 4,
            DType::Bool => 5,
            DType::U32 => 6,
            DType::BF16 => 7,
            DType::F16 => 8,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl ContentHash for DType {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.write_u8(self.tag());
    }
}

/// The typed storage of an [`Array`]. More dtypes may come, so a `match` outside nitro needs
/// a catch-all arm.
#[derive(Clone, PartialEq)]
#[non_exhaustive]
pub enum ArrayData {
    /// `f32` elements.
    F32(Vec<f32>),
    /// `f64` elements.
    F64(Vec<f64>),
    /// `i32` elements.
    I32(Vec<i32>),
    /// `i64` elements.
    I64(Vec<i64>),
    /// `u8` elements.
    U8(Vec<u8>),
    /// Boolean elements.
    Bool(Vec<bool>),
    /// `u32` elements.
    U32(Vec<u32>),
    /// `bf16` elements.
    BF16(Vec<half::bf16>),
    /// `f16` elements.
    F16(Vec<half::f16>),
}

macro_rules! each_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            ArrayData::F32($v) => $body,
            ArrayData::F64($v) => $body,
            ArrayData::I32($v) => $body,
            ArrayData::I64($v) => $body,
            ArrayData::U8($v) => $body,
            ArrayData::Bool($v) => $body,
            ArrayData::U32($v) => $body,
            ArrayData::BF16($v) => $body,
            ArrayData::F16($v) => $body,
        }
    };
}

impl ArrayData {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            ArrayData::F32(_) => DType::F32,
            ArrayData::F64(_) => DType::F64,
            ArrayData::I32(_) => DType::I32,
            ArrayData::I64(_) => DType::I64,
            ArrayData::U8(_) => DType::U8,
            ArrayData::Bool(_) => DType::Bool,
            ArrayData::U32(_) => DType::U32,
            ArrayData::BF16(_) => DType::BF16,
            ArrayData::F16(_) => DType::F16,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        each_data!(self, v => v.len())
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `start..end`; `None` when out of range.
    pub(crate) fn range(&self, start: usize, end: usize) -> Option<ArrayData> {
        fn sub<T: Element>(v: &[T], start: usize, end: usize) -> Option<ArrayData> {
            Some(T::wrap(v.get(start..end)?.to_vec()))
        }
        each_data!(self, v => sub(v, start, end))
    }

    /// `parts` one after another; `None` when they are not all of `first`'s dtype.
    /// Writes `src`'s elements over this data's, from element `offset` on; `None` (nothing
    /// written) when the dtypes differ or `src` does not fit.
    pub(crate) fn write_at(&mut self, offset: usize, src: &ArrayData) -> Option<()> {
        fn write<T: Element>(dst: &mut [T], offset: usize, src: &ArrayData) -> Option<()> {
            let src = T::unwrap(src)?;
            dst.get_mut(offset..offset.checked_add(src.len())?)?
                .copy_from_slice(src);
            Some(())
        }
        each_data!(self, v => write(v, offset, src))
    }

    pub(crate) fn concat(first: &ArrayData, parts: &[&ArrayData]) -> Option<ArrayData> {
        fn join<T: Element>(_: &[T], parts: &[&ArrayData]) -> Option<ArrayData> {
            let mut v = Vec::with_capacity(parts.iter().map(|p| p.len()).sum());
            for p in parts {
                v.extend_from_slice(T::unwrap(p)?);
            }
            Some(T::wrap(v))
        }
        each_data!(first, v => join(v, parts))
    }
}

/// An element type an [`Array`] can hold: `f32 f64 i32 i64 u8 bool u32`, [`half::bf16`] and
/// [`half::f16`] (re-exported as `nitro::bf16`, `nitro::f16`).
pub trait Element: Copy + Default + PartialEq + fmt::Debug + sealed::Sealed + 'static {
    /// The dtype of this element type.
    const DTYPE: DType;
    /// Wraps a vector of elements.
    fn wrap(v: Vec<Self>) -> ArrayData;
    /// The elements, when `data` holds this type.
    fn unwrap(data: &ArrayData) -> Option<&[Self]>;
    /// The elements, mutably, when `data` holds this type.
    fn unwrap_mut(data: &mut ArrayData) -> Option<&mut [Self]>;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! elements {
    ($($t:ty => $variant:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            fn wrap(v: Vec<Self>) -> ArrayData { ArrayData::$variant(v) }
            fn unwrap(data: &ArrayData) -> Option<&[Self]> {
                match data { ArrayData::$variant(v) => Some(v), _ => None }
            }
            fn unwrap_mut(data: &mut ArrayData) -> Option<&mut [Self]> {
                match data { ArrayData::$variant(v) => Some(v), _ => None }
            }
        }
    )*};
}
elements!(
    f32 => F32, f64 => F64, i32 => I32, i64 => I64, u8 => U8, bool => Bool, u32 => U32,
    half::bf16 => BF16, half::f16 => F16
);

/// A dense, row-major tensor on the host: dtype, dims and data.
///
/// ```
/// use nitro::{Array, DType};
/// let a = Array::from_vec(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?;
/// assert_eq!(a.dtype(), DType::F32);
/// assert_eq!(a.dims(), &[2, 3]);
/// assert_eq!(a.as_slice::<f32>()?[4], 5.0);
/// assert!(Array::from_vec(&[2, 2], vec![1.0f32]).is_err());
/// # Ok::<(), nitro::Error>(())
/// ```
#[derive(Clone, PartialEq)]
pub struct Array {
    dims: Vec<usize>,
    data: ArrayData,
}

impl Array {
    /// An array of the given dims from row-major data.
    ///
    /// Errors: [`Error::ShapeTooLarge`] when the dims are over the size limit
    /// ([`MAX_TENSOR_BYTES`]), so their element count cannot be trusted; [`Error::ArrayLength`]
    /// when the element count differs from the product of `dims`.
    pub fn from_vec<T: Element>(dims: &[usize], data: Vec<T>) -> Result<Array> {
        Array::from_data(dims, T::wrap(data))
    }

    /// An array from typed storage; errors as [`Array::from_vec`].
    pub fn from_data(dims: &[usize], data: ArrayData) -> Result<Array> {
        let expected = checked_count(data.dtype(), dims)?;
        if data.len() != expected {
            return Err(Error::ArrayLength {
                dims: dims.to_vec(),
                expected,
                got: data.len(),
            });
        }
        Ok(Array {
            dims: dims.to_vec(),
            data,
        })
    }

    /// A rank-0 array holding one value.
    pub fn scalar<T: Element>(value: T) -> Array {
        Array {
            dims: Vec::new(),
            data: T::wrap(vec![value]),
        }
    }

    /// An array of zeros (or `false`).
    ///
    /// # Panics
    ///
    /// When the dims are over the size limit ([`MAX_TENSOR_BYTES`]) or the memory cannot be
    /// allocated, with the message of the error [`Array::try_zeros`] returns. Use `try_zeros`
    /// for dims that come from data or users.
    pub fn zeros(dtype: DType, dims: &[usize]) -> Array {
        Array::try_zeros(dtype, dims).unwrap_or_else(|e| {
            panic!("Array::zeros: {e} (Array::try_zeros returns this as an error)")
        })
    }

    /// An array of zeros (or `false`), or an error: [`Error::ShapeTooLarge`] when the dims are
    /// over the size limit ([`MAX_TENSOR_BYTES`]), [`Error::OutOfMemory`] when the memory cannot
    /// be allocated. Never panics or aborts.
    ///
    /// ```
    /// use nitro::{Array, DType, Error};
    /// assert_eq!(Array::try_zeros(DType::F32, &[2, 3])?.len(), 6);
    /// // 2^62 · 4 elements overflow: refused, never wrapped to an empty array.
    /// let err = Array::try_zeros(DType::F32, &[1 << 62, 4]).unwrap_err();
    /// assert!(matches!(err, Error::ShapeTooLarge { .. }));
    /// # Ok::<(), nitro::Error>(())
    /// ```
    ///
    /// The memory is asked for already zeroed (zero is all-zero bits in every dtype), which the
    /// operating system hands out lazily: pages become resident when written, so a zero array
    /// that is only looked at for its type — the training handle's stand-ins for optimizer
    /// state and gradients when it keys its programs — costs address space, not memory.
    pub fn try_zeros(dtype: DType, dims: &[usize]) -> Result<Array> {
        let n = checked_count(dtype, dims)?;
        let oom = || Error::OutOfMemory {
            what: format!("an array {}", LeafType::new(dtype, dims)),
            bytes: (n as u64).saturating_mul(dtype.size_bytes() as u64),
        };
        let data = match dtype {
            DType::F32 => ArrayData::F32(zeroed_vec(n).ok_or_else(oom)?),
            DType::F64 => ArrayData::F64(zeroed_vec(n).ok_or_else(oom)?),
            DType::I32 => ArrayData::I32(zeroed_vec(n).ok_or_else(oom)?),
            DType::I64 => ArrayData::I64(zeroed_vec(n).ok_or_else(oom)?),
            DType::U8 => ArrayData::U8(zeroed_vec(n).ok_or_else(oom)?),
            DType::Bool => ArrayData::Bool(zeroed_vec(n).ok_or_else(oom)?),
            DType::U32 => ArrayData::U32(zeroed_vec(n).ok_or_else(oom)?),
            DType::BF16 => ArrayData::BF16(zeroed_vec(n).ok_or_else(oom)?),
            DType::F16 => ArrayData::F16(zeroed_vec(n).ok_or_else(oom)?),
        };
        Ok(Array {
            dims: dims.to_vec(),
            data,
        })
    }

    /// An array with every element equal to `value`.
    ///
    /// # Panics
    ///
    /// As [`Array::zeros`]; [`Array::try_full`] returns the error instead.
    pub fn full<T: Element>(dims: &[usize], value: T) -> Array {
        Array::try_full(dims, value).unwrap_or_else(|e| {
            panic!("Array::full: {e} (Array::try_full returns this as an error)")
        })
    }

    /// An array with every element equal to `value`, or an error as [`Array::try_zeros`].
    pub fn try_full<T: Element>(dims: &[usize], value: T) -> Result<Array> {
        let n = checked_count(T::DTYPE, dims)?;
        let mut v = Vec::new();
        if v.try_reserve_exact(n).is_err() {
            return Err(Error::OutOfMemory {
                what: format!("an array {}", LeafType::new(T::DTYPE, dims)),
                bytes: (n as u64).saturating_mul(T::DTYPE.size_bytes() as u64),
            });
        }
        v.resize(n, value);
        Ok(Array {
            dims: dims.to_vec(),
            data: T::wrap(v),
        })
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The dims (empty for a scalar).
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The rank (number of dims).
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the array has no elements (some dim is 0).
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The size of the data in bytes on the host.
    pub fn size_bytes(&self) -> usize {
        self.len() * self.dtype().size_bytes()
    }

    /// The dtype and dims, as they enter a signature.
    pub fn leaf_type(&self) -> LeafType {
        LeafType {
            dtype: self.dtype(),
            dims: self.dims.clone(),
        }
    }

    /// The typed storage.
    pub fn data(&self) -> &ArrayData {
        &self.data
    }

    /// The elements as a slice of `T`; errors when the array holds another dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let dtype = self.dtype();
        T::unwrap(&self.data).ok_or(Error::DTypeMismatch {
            expected: T::DTYPE,
            got: dtype,
        })
    }

    /// The elements as a mutable slice of `T`; errors when the array holds another dtype.
    pub fn as_slice_mut<T: Element>(&mut self) -> Result<&mut [T]> {
        let dtype = self.dtype();
        T::unwrap_mut(&mut self.data).ok_or(Error::DTypeMismatch {
            expected: T::DTYPE,
            got: dtype,
        })
    }

    /// Consumes the array, returning its dims and storage.
    pub fn into_parts(self) -> (Vec<usize>, ArrayData) {
        (self.dims, self.data)
    }
}

/// Element types whose all-zero bit pattern is a valid value (zero, or `false`).
///
/// # Safety
/// Implemented only for types for which every byte being zero is a valid value.
#[allow(unsafe_code)]
unsafe trait ZeroBits: Sized {}
// SAFETY: zero bits are +0.0.
#[allow(unsafe_code)]
unsafe impl ZeroBits for f32 {}
// SAFETY: zero bits are +0.0.
#[allow(unsafe_code)]
unsafe impl ZeroBits for f64 {}
// SAFETY: zero bits are 0.
#[allow(unsafe_code)]
unsafe impl ZeroBits for i32 {}
// SAFETY: zero bits are 0.
#[allow(unsafe_code)]
unsafe impl ZeroBits for i64 {}
// SAFETY: zero bits are 0.
#[allow(unsafe_code)]
unsafe impl ZeroBits for u8 {}
// SAFETY: zero bits are 0.
#[allow(unsafe_code)]
unsafe impl ZeroBits for u32 {}
// SAFETY: a zero byte is `false`.
#[allow(unsafe_code)]
unsafe impl ZeroBits for bool {}
// SAFETY: zero bits are +0.0 (`repr(transparent)` over `u16`).
#[allow(unsafe_code)]
unsafe impl ZeroBits for half::bf16 {}
// SAFETY: zero bits are +0.0 (`repr(transparent)` over `u16`).
#[allow(unsafe_code)]
unsafe impl ZeroBits for half::f16 {}

/// `n` zero values from zeroed memory (lazily resident), or `None` when it cannot be had.
#[allow(unsafe_code)]
fn zeroed_vec<T: ZeroBits>(n: usize) -> Option<Vec<T>> {
    if n == 0 || std::mem::size_of::<T>() == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    // SAFETY: `layout` has a non-zero size (n > 0 elements of a sized, non-zero-size type).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `[T; n]` (the
    // capacity), its `n` elements are initialized (zero bits are a valid `T`: `ZeroBits`).
    Some(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// The element count of `dtype` with `dims`, or [`Error::ShapeTooLarge`] when the type is over
/// the size limit.
pub(crate) fn checked_count(dtype: DType, dims: &[usize]) -> Result<usize> {
    LeafType::new(dtype, dims)
        .element_count()
        .ok_or_else(|| Error::ShapeTooLarge {
            ty: LeafType::new(dtype, dims),
        })
}

/// The product of `dims`, or `None` when it overflows `usize`.
pub(crate) fn dims_product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// The largest tensor nitro handles, in bytes: 2^63 − 1 (`i64::MAX`), the largest size XLA's
/// signed 64-bit sizes hold.
///
/// A type is within the limit when its element size times the product of its dims, **each dim
/// counted as at least 1**, is at most this many bytes. (Counting a 0 as 1 keeps the other
/// dims bounded too, so strides and offsets never overflow, even in an empty tensor.)
/// Every tensor made while tracing, every program input and every [`Array`] must be within
/// it: tracing fails with [`Error::Trace`] naming the op, and `Array` constructors return
/// [`Error::ShapeTooLarge`]. A tensor within the limit can still be too large for the memory
/// at hand; then running it fails with [`Error::OutOfMemory`] (interpreter) or an XLA error.
///
/// ```
/// use nitro::{DType, LeafType, MAX_TENSOR_BYTES};
/// assert_eq!(MAX_TENSOR_BYTES, i64::MAX as u64);
/// assert_eq!(LeafType::new(DType::F32, &[1 << 30, 1 << 30]).size_bytes(), Some(1 << 62));
/// assert_eq!(LeafType::new(DType::F32, &[1 << 31, 1 << 31]).size_bytes(), None); // 2^64 bytes
/// assert_eq!(LeafType::new(DType::F32, &[0, 1 << 62]).element_count(), None); // 0 counts as 1
/// ```
pub const MAX_TENSOR_BYTES: u64 = i64::MAX as u64;

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Array({}", self.leaf_type())?;
        const SHOWN: usize = 8;
        each_data!(&self.data, v => {
            let more = if v.len() > SHOWN { ", …" } else { "" };
            write!(f, " {:?}{more})", &v[..v.len().min(SHOWN)])
        })
    }
}

/// An array's contents hash as: dtype tag, dims, then the elements as one byte run.
impl ContentHash for Array {
    fn content_hash(&self, h: &mut ContentHasher) {
        self.dtype().content_hash(h);
        self.dims.content_hash(h);
        each_data!(&self.data, v => v.content_hash(h));
    }
}

/// A leaf's type as the compile key sees it: dtype and dims.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct LeafType {
    /// Element type.
    pub dtype: DType,
    /// Dims, outermost first (empty for a scalar).
    pub dims: Vec<usize>,
}

impl LeafType {
    /// A type of `dtype` with `dims`.
    pub fn new(dtype: DType, dims: &[usize]) -> LeafType {
        LeafType {
            dtype,
            dims: dims.to_vec(),
        }
    }

    /// Whether the type is within the size limit ([`MAX_TENSOR_BYTES`]).
    pub fn within_limit(&self) -> bool {
        self.dims
            .iter()
            .try_fold(self.dtype.size_bytes() as u64, |n, &d| {
                n.checked_mul(u64::try_from(d.max(1)).ok()?)
            })
            .is_some_and(|bound| bound <= MAX_TENSOR_BYTES)
    }

    /// The number of elements (the product of the dims), or `None` when the type is over the
    /// size limit ([`MAX_TENSOR_BYTES`]) or the count does not fit a `usize`.
    pub fn element_count(&self) -> Option<usize> {
        if self.within_limit() {
            dims_product(&self.dims)
        } else {
            None
        }
    }

    /// The size in bytes, or `None` when the type is over the size limit
    /// ([`MAX_TENSOR_BYTES`]).
    pub fn size_bytes(&self) -> Option<u64> {
        let n = self.element_count()?;
        (n as u64).checked_mul(self.dtype.size_bytes() as u64)
    }

    /// The quantity [`MAX_TENSOR_BYTES`] bounds (the element size times the dims, each counted
    /// as at least 1), in words and exact even past the limit: `"32 bytes"`, or
    /// `"more than 2^128 bytes"` when not even a `u128` holds it.
    pub(crate) fn describe_size(&self) -> String {
        let bytes = self
            .dims
            .iter()
            .try_fold(self.dtype.size_bytes() as u128, |n, &d| {
                n.checked_mul(d.max(1) as u128)
            });
        match bytes {
            Some(b) => format!("{b} bytes"),
            None => "more than 2^128 bytes".to_owned(),
        }
    }
}

impl fmt::Display for LeafType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl ContentHash for LeafType {
    fn content_hash(&self, h: &mut ContentHasher) {
        self.dtype.content_hash(h);
        self.dims.content_hash(h);
    }
}

/// The path of a node inside a tree, as users read it: `layers[1].w`.
///
/// Trees extend the path while they walk (`field`, `index`) and restore it afterwards, so a
/// walk allocates once.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct LeafPath {
    text: String,
}

impl LeafPath {
    /// A path at a root named `root` (an experiment field name, or empty).
    pub fn root(root: &str) -> LeafPath {
        LeafPath {
            text: root.to_owned(),
        }
    }

    /// The path as text.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Runs `f` with `.name` appended (no dot at an empty root).
    pub fn with_field<R>(&mut self, name: &str, f: impl FnOnce(&mut LeafPath) -> R) -> R {
        let len = self.text.len();
        if !self.text.is_empty() {
            self.text.push('.');
        }
        self.text.push_str(name);
        let out = f(self);
        self.text.truncate(len);
        out
    }

    /// Runs `f` with `[index]` appended.
    pub fn with_index<R>(&mut self, index: usize, f: impl FnOnce(&mut LeafPath) -> R) -> R {
        use fmt::Write;
        let len = self.text.len();
        let _ = write!(self.text, "[{index}]");
        let out = f(self);
        self.text.truncate(len);
        out
    }
}

impl fmt::Display for LeafPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// What a read-only walk of a [`Tree`] meets: an array leaf, or a structural node.
///
/// Structural nodes make the signature encode the whole tree, not only its leaves: every
/// sequence reports its length (also when its elements have no leaves, as in `Vec<()>`) and
/// every `Option` its presence, at every level (`None` and `Some(None)` differ). Traced code can
/// branch on all of these, so all of them are in the compile key.
#[derive(Clone, Copy, Debug)]
pub enum Node<'a> {
    /// An array leaf.
    Leaf(&'a Array),
    /// A sequence (`Vec`, `[T; N]`) of this many elements begins here; its elements follow.
    Seq(usize),
    /// An `Option` that is `Some`; its content follows.
    Some,
    /// An `Option` that is `None`.
    None,
}

/// One entry of a [`Signature`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct SignatureEntry {
    /// Where in the tree (`layers[1].w`).
    pub path: String,
    /// What is there.
    pub kind: EntryKind,
}

impl SignatureEntry {
    /// The entry for `node` met at `path` in a walk.
    pub fn from_node(path: &LeafPath, node: Node<'_>) -> SignatureEntry {
        let kind = match node {
            Node::Leaf(a) => EntryKind::Leaf(a.leaf_type()),
            Node::Seq(len) => EntryKind::Seq(len),
            Node::Some => EntryKind::Some,
            Node::None => EntryKind::None,
        };
        SignatureEntry {
            path: path.as_str().to_owned(),
            kind,
        }
    }
}

/// The kind of a [`SignatureEntry`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    /// An array leaf with this dtype and dims.
    Leaf(LeafType),
    /// A sequence of this many elements.
    Seq(usize),
    /// `Some`.
    Some,
    /// `None`.
    None,
}

impl EntryKind {
    /// Which kind of node this is: entries of one class at one path describe the same node of
    /// two trees, so a diff compares them.
    fn class(&self) -> u8 {
        match self {
            EntryKind::Leaf(_) => 0,
            EntryKind::Seq(_) => 1,
            EntryKind::Some | EntryKind::None => 2,
        }
    }
}

impl fmt::Display for EntryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntryKind::Leaf(t) => write!(f, "{t}"),
            EntryKind::Seq(len) => write!(f, "len {len}"),
            EntryKind::Some => f.write_str("Some"),
            EntryKind::None => f.write_str("None"),
        }
    }
}

/// One difference between two signatures, by path: a node added, removed, or changed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct SignatureChange {
    /// Where (`layers[2].w`).
    pub path: String,
    /// What was there before (`f32[8,8]`, `len 2`, `None`); `None` when the node was added.
    pub from: Option<String>,
    /// What is there now; `None` when the node was removed.
    pub to: Option<String>,
}

impl fmt::Display for SignatureChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.from, &self.to) {
            (None, Some(to)) => write!(f, "added {} {to}", self.path),
            (Some(from), None) => write!(f, "removed {} {from}", self.path),
            (Some(from), Some(to)) => write!(f, "{} {from} → {to}", self.path),
            (None, None) => write!(f, "{}", self.path),
        }
    }
}

/// The signature of a tree: every node's path and kind — array leaves with their dtype and
/// dims, sequence lengths, option presence — in walk order. This is all the compile key sees of
/// a `#[device]` value or a program's inputs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Signature {
    /// The entries in walk order.
    pub entries: Vec<SignatureEntry>,
}

impl Signature {
    /// The array leaves only: `(path, type)` pairs.
    pub fn leaves(&self) -> impl Iterator<Item = (&str, &LeafType)> {
        self.entries.iter().filter_map(|e| match &e.kind {
            EntryKind::Leaf(t) => Some((e.path.as_str(), t)),
            _ => None,
        })
    }

    /// The digest of the signature (what the compile key holds).
    pub fn digest(&self) -> Digest {
        Digest::of(self)
    }

    /// Appends the entries of `other`.
    pub fn extend(&mut self, other: Signature) {
        self.entries.extend(other.entries);
    }

    /// What differs in `newer`, by path: nodes whose kind or type changed and nodes added (in
    /// `newer`'s walk order), then nodes removed (in `self`'s). Going from two layers to three
    /// reads `layers len 2 → len 3`, `added layers[2].w f32[8,8]`, `added layers[2].b f32[8]` —
    /// never a positional shift of everything after the change. Empty when equal.
    pub fn diff(&self, newer: &Signature) -> Vec<SignatureChange> {
        use std::collections::HashMap;
        // A node is identified by its path, its class and its rank among nodes of that class
        // at that path (nested options share a path).
        fn keyed(sig: &Signature) -> Vec<((&str, u8, usize), &EntryKind)> {
            let mut seen: HashMap<(&str, u8), usize> = HashMap::new();
            sig.entries
                .iter()
                .map(|e| {
                    let class = e.kind.class();
                    let n = seen.entry((e.path.as_str(), class)).or_default();
                    let key = (e.path.as_str(), class, *n);
                    *n += 1;
                    (key, &e.kind)
                })
                .collect()
        }
        let old = keyed(self);
        let new = keyed(newer);
        let old_map: HashMap<_, _> = old.iter().copied().collect();
        let new_map: HashMap<_, _> = new.iter().copied().collect();
        let mut changes = Vec::new();
        for (key, kind) in &new {
            match old_map.get(key) {
                Some(before) if before == kind => {}
                before => changes.push(SignatureChange {
                    path: key.0.to_owned(),
                    from: before.map(|k| k.to_string()),
                    to: Some(kind.to_string()),
                }),
            }
        }
        for (key, kind) in &old {
            if !new_map.contains_key(key) {
                changes.push(SignatureChange {
                    path: key.0.to_owned(),
                    from: Some(kind.to_string()),
                    to: None,
                });
            }
        }
        changes
    }

    /// The first difference from `newer` (see [`diff`](Signature::diff)), as `(path, from, to)`
    /// in words (`absent` for a node that one side lacks); `None` when equal.
    pub fn first_difference(&self, newer: &Signature) -> Option<(String, String, String)> {
        self.diff(newer).into_iter().next().map(|c| {
            let absent = || "absent".to_owned();
            (
                c.path,
                c.from.unwrap_or_else(absent),
                c.to.unwrap_or_else(absent),
            )
        })
    }
}

/// Leaves with their types, `[]` for an empty sequence and `None` for an absent option; the
/// lengths of non-empty sequences and `Some` markers are implied by the paths and left out.
impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for e in &self.entries {
            let shown = match &e.kind {
                EntryKind::Leaf(t) => t.to_string(),
                EntryKind::Seq(0) => "[]".to_owned(),
                EntryKind::None => "None".to_owned(),
                EntryKind::Seq(_) | EntryKind::Some => continue,
            };
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            write!(f, "{}: {shown}", e.path)?;
        }
        Ok(())
    }
}

impl ContentHash for Signature {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.write_len(self.entries.len());
        for e in &self.entries {
            h.write_str(&e.path);
            e.kind.content_hash(h);
        }
    }
}

impl ContentHash for EntryKind {
    fn content_hash(&self, h: &mut ContentHasher) {
        match self {
            EntryKind::Leaf(t) => {
                h.write_u8(0);
                t.content_hash(h);
            }
            EntryKind::Seq(len) => {
                h.write_u8(1);
                h.write_len(*len);
            }
            EntryKind::None => h.write_u8(2),
            EntryKind::Some => h.write_u8(3),
        }
    }
}

/// A value built from [`Array`] leaves: the type of a `#[device]` field.
///
/// Implemented for `Array`, `Vec<T>`, `Box<T>`, `Option<T>`, `[T; N]`, tuples of up to eight
/// trees, and structs with `#[derive(Tree)]`. Each tree names its **mirror**: the same structure
/// with every leaf replaced by an `L`. Traced code sees `Mirror<Tensor>` — so a `Vec<Dense>` is
/// traced as a `Vec<DenseMirror<Tensor>>` whose `w` and `b` are tensors.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tree of arrays, so it cannot be a #[device] value",
    label = "`{Self}` is not `Tree`",
    note = "a #[device] field is a traced input: it must be built from `nitro::Array` leaves \
            (`Array`, `Vec`, `Option`, `Box`, `[T; N]`, tuples, or a struct with `#[derive(nitro::Tree)]`)",
    note = "a value that shapes the graph (a width, a flag) belongs in a #[graph_const] field; \
            anything else traced code does not need belongs in a #[host] field"
)]
pub trait Tree {
    /// The same structure with every leaf replaced by an `L`.
    type Mirror<L>;

    /// Walks the tree in order, calling `f` with each leaf and structural node (see [`Node`])
    /// and its path.
    fn visit<'a>(&'a self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, Node<'a>));

    /// Walks the leaves in the same order as [`visit`](Tree::visit), mutably (to write results back).
    fn visit_mut(&mut self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &mut Array));

    /// Builds the mirror, mapping each leaf (in walk order) through `f`.
    fn mirror<L>(
        &self,
        at: &mut LeafPath,
        f: &mut dyn FnMut(&LeafPath, &Array) -> L,
    ) -> Self::Mirror<L>;

    /// A mirror of this tree type with every leaf mapped through `f`, in walk order; the
    /// structure (fields, sequence lengths, options) is kept. This is how generic code reads
    /// a `Mirror<Tensor>` leaf by leaf ([`Tree::mirror_leaves`]) or builds one of the same
    /// shape from other tensors (a scanned layer's per-layer view of stacked parameters).
    ///
    /// ```
    /// use nitro::{Array, Tree};
    ///
    /// let m: (Vec<u32>, Option<u32>) = (vec![1, 2], Some(3));
    /// let doubled = <(Vec<Array>, Option<Array>)>::map_mirror(&m, &mut |x| x * 2);
    /// assert_eq!(doubled, (vec![2, 4], Some(6)));
    /// ```
    fn map_mirror<L, M>(m: &Self::Mirror<L>, f: &mut dyn FnMut(&L) -> M) -> Self::Mirror<M>;

    /// The leaves of a mirror of this tree type, in walk order.
    ///
    /// ```
    /// use nitro::{Array, Tree};
    ///
    /// let m: (Vec<u32>, Option<u32>) = (vec![1, 2], Some(3));
    /// assert_eq!(<(Vec<Array>, Option<Array>)>::mirror_leaves(&m), vec![1, 2, 3]);
    /// ```
    fn mirror_leaves<L: Clone>(m: &Self::Mirror<L>) -> Vec<L>
    where
        Self: Sized,
    {
        let mut leaves = Vec::new();
        Self::map_mirror(m, &mut |l: &L| leaves.push(l.clone()));
        leaves
    }

    /// The signature of this tree with paths rooted at `root`.
    fn signature_at(&self, root: &str) -> Signature {
        let mut entries = Vec::new();
        self.visit(&mut LeafPath::root(root), &mut |path, node| {
            entries.push(SignatureEntry::from_node(path, node));
        });
        Signature { entries }
    }

    /// Calls `f` with every leaf and its path (rooted at `root`).
    fn for_each_leaf(&self, root: &str, f: &mut dyn FnMut(&LeafPath, &Array)) {
        self.visit(&mut LeafPath::root(root), &mut |path, node| {
            if let Node::Leaf(a) = node {
                f(path, a)
            }
        });
    }

    /// The number of array leaves.
    fn leaf_count(&self) -> usize {
        let mut n = 0;
        self.for_each_leaf("", &mut |_, _| n += 1);
        n
    }
}

impl Tree for Array {
    type Mirror<L> = L;

    fn visit<'a>(&'a self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, Node<'a>)) {
        f(at, Node::Leaf(self));
    }

    fn visit_mut(&mut self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &mut Array)) {
        f(at, self);
    }

    fn mirror<L>(&self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &Array) -> L) -> L {
        f(at, self)
    }

    fn map_mirror<L, M>(m: &L, f: &mut dyn FnMut(&L) -> M) -> M {
        f(m)
    }
}

impl<T: Tree> Tree for Vec<T> {
    type Mirror<L> = Vec<T::Mirror<L>>;

    fn visit<'a>(&'a self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, Node<'a>)) {
        self.as_slice().visit_seq(at, f);
    }

    fn visit_mut(&mut self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &mut Array)) {
        self.as_mut_slice().visit_seq_mut(at, f);
    }

    fn mirror<L>(
        &self,
        at: &mut LeafPath,
        f: &mut dyn FnMut(&LeafPath, &Array) -> L,
    ) -> Self::Mirror<L> {
        self.iter()
            .enumerate()
            .map(|(i, t)| at.with_index(i, |at| t.mirror(at, f)))
            .collect()
    }

    fn map_mirror<L, M>(m: &Self::Mirror<L>, f: &mut dyn FnMut(&L) -> M) -> Self::Mirror<M> {
        m.iter().map(|t| T::map_mirror(t, f)).collect()
    }
}

/// The walks shared by sequences (`Vec`, `[T; N]`): elements at `[i]`, an empty sequence as a
/// node of its own.
trait VisitSeq {
    fn visit_seq<'a>(&'a self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, Node<'a>));
    fn visit_seq_mut(&mut self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &mut Array));
}

impl<T: Tree> VisitSeq for [T] {
    fn visit_seq<'a>(&'a self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, Node<'a>)) {
        f(at, Node::Seq(self.len()));
        for (i, t) in self.iter().enumerate() {
            at.with_index(i, |at| t.visit(at, f));
        }
    }

    fn visit_seq_mut(&mut self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &mut Array)) {
        for (i, t) in self.iter_mut().enumerate() {
            at.with_index(i, |at| t.visit_mut(at, f));
        }
    }
}

impl<T: Tree, const N: usize> Tree for [T; N] {
    type Mirror<L> = [T::Mirror<L>; N];

    fn visit<'a>(&'a self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, Node<'a>)) {
        self.as_slice().visit_seq(at, f);
    }

    fn visit_mut(&mut self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &mut Array)) {
        self.as_mut_slice().visit_seq_mut(at, f);
    }

    fn mirror<L>(
        &self,
        at: &mut LeafPath,
        f: &mut dyn FnMut(&LeafPath, &Array) -> L,
    ) -> Self::Mirror<L> {
        let mut i = 0;
        self.each_ref().map(|t| {
            let out = at.with_index(i, |at| t.mirror(at, f));
            i += 1;
            out
        })
    }

    fn map_mirror<L, M>(m: &Self::Mirror<L>, f: &mut dyn FnMut(&L) -> M) -> Self::Mirror<M> {
        m.each_ref().map(|t| T::map_mirror(t, f))
    }
}

impl<T: Tree> Tree for Option<T> {
    type Mirror<L> = Option<T::Mirror<L>>;

    fn visit<'a>(&'a self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, Node<'a>)) {
        match self {
            Some(t) => {
                f(at, Node::Some);
                t.visit(at, f);
            }
            None => f(at, Node::None),
        }
    }

    fn visit_mut(&mut self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &mut Array)) {
        if let Some(t) = self {
            t.visit_mut(at, f);
        }
    }

    fn mirror<L>(
        &self,
        at: &mut LeafPath,
        f: &mut dyn FnMut(&LeafPath, &Array) -> L,
    ) -> Self::Mirror<L> {
        self.as_ref().map(|t| t.mirror(at, f))
    }

    fn map_mirror<L, M>(m: &Self::Mirror<L>, f: &mut dyn FnMut(&L) -> M) -> Self::Mirror<M> {
        m.as_ref().map(|t| T::map_mirror(t, f))
    }
}

impl<T: Tree> Tree for Box<T> {
    type Mirror<L> = Box<T::Mirror<L>>;

    fn visit<'a>(&'a self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, Node<'a>)) {
        (**self).visit(at, f);
    }

    fn visit_mut(&mut self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &mut Array)) {
        (**self).visit_mut(at, f);
    }

    fn mirror<L>(
        &self,
        at: &mut LeafPath,
        f: &mut dyn FnMut(&LeafPath, &Array) -> L,
    ) -> Self::Mirror<L> {
        Box::new((**self).mirror(at, f))
    }

    fn map_mirror<L, M>(m: &Self::Mirror<L>, f: &mut dyn FnMut(&L) -> M) -> Self::Mirror<M> {
        Box::new(T::map_mirror(m, f))
    }
}

/// The empty tree: no leaves (the inputs of a program that takes none besides its view).
impl Tree for () {
    type Mirror<L> = ();

    fn visit<'a>(&'a self, _: &mut LeafPath, _: &mut dyn FnMut(&LeafPath, Node<'a>)) {}

    fn visit_mut(&mut self, _: &mut LeafPath, _: &mut dyn FnMut(&LeafPath, &mut Array)) {}

    fn mirror<L>(&self, _: &mut LeafPath, _: &mut dyn FnMut(&LeafPath, &Array) -> L) {}

    fn map_mirror<L, M>(_: &(), _: &mut dyn FnMut(&L) -> M) {}
}

macro_rules! tuple_trees {
    ($(($($name:ident . $idx:tt),+))*) => {$(
        impl<$($name: Tree),+> Tree for ($($name,)+) {
            type Mirror<L> = ($($name::Mirror<L>,)+);

            fn visit<'a>(&'a self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, Node<'a>)) {
                $(at.with_field(stringify!($idx), |at| self.$idx.visit(at, f));)+
            }

            fn visit_mut(&mut self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &mut Array)) {
                $(at.with_field(stringify!($idx), |at| self.$idx.visit_mut(at, f));)+
            }

            fn mirror<L>(
                &self,
                at: &mut LeafPath,
                f: &mut dyn FnMut(&LeafPath, &Array) -> L,
            ) -> Self::Mirror<L> {
                ($(at.with_field(stringify!($idx), |at| self.$idx.mirror(at, f)),)+)
            }

            fn map_mirror<L, M>(m: &Self::Mirror<L>, f: &mut dyn FnMut(&L) -> M) -> Self::Mirror<M> {
                ($($name::map_mirror(&m.$idx, f),)+)
            }
        }
    )*};
}
tuple_trees! {
    (A.0)
    (A.0, B.1)
    (A.0, B.1, C.2)
    (A.0, B.1, C.2, D.3)
    (A.0, B.1, C.2, D.3, E.4)
    (A.0, B.1, C.2, D.3, E.4, F.5)
    (A.0, B.1, C.2, D.3, E.4, F.5, G.6)
    (A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7)
}
