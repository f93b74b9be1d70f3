//! NumPy's `.npy` files, the format Python code hands arrays over in: read into an [`Array`]
//! and written from one, so `np.load` reads what nitro writes and the other way round.
//!
//! Read: format versions 1.0, 2.0 and 3.0; little-endian (`<`, or `|` for one byte) `f2 f4 f8
//! i4 i8 u1 u4 b1` (`f16 f32 f64 i32 i64 u8 u32 bool`); C or Fortran order (a Fortran array is
//! reordered to row-major). Anything else — another magic, a truncated header or body, a
//! big-endian or object dtype, a shape that does not fit the bytes — is [`Error::DataFile`]
//! naming the file and what is wrong. Write: version 1.0, C order, the same dtypes; `bf16`
//! (which NumPy does not have) is refused. Writes are atomic (a temporary file renamed over the
//! target).
//!
//! ```
//! use nitro::{npy, Array};
//! let a = Array::from_vec(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?;
//! let bytes = npy::to_bytes(&a)?;
//! assert!(bytes.starts_with(b"\x93NUMPY\x01\x00"));
//! assert_eq!(npy::from_bytes(&bytes)?, a);
//! # Ok::<(), nitro::Error>(())
//! ```

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::tree::{Array, ArrayData, DType};

const MAGIC: &[u8] = b"\x93NUMPY";

/// The `.npy` file at `path` as an array.
pub fn read(path: impl AsRef<Path>) -> Result<Array> {
    let path = path.as_ref();
    let bytes = Error::read_data_file(path)?;
    parse(&bytes, path)
}

/// An array from the bytes of a `.npy` file.
pub fn from_bytes(bytes: &[u8]) -> Result<Array> {
    parse(bytes, &PathBuf::from("<bytes>"))
}

/// Writes `array` to `path` as a `.npy` file (version 1.0, C order), atomically; temporary
/// files that killed writes of files with its extension left beside it are removed first.
pub fn write(path: impl AsRef<Path>, array: &Array) -> Result<()> {
    let path = path.as_ref();
    let bytes = to_bytes(array).map_err(|e| match e {
        Error::DataFile { why, .. } => Error::data_file(path, why),
        other => other,
    })?;
    Error::write_data_file(path, &bytes, true)
}

/// The bytes of `array` as a `.npy` file (version 1.0, C order).
pub fn to_bytes(array: &Array) -> Result<Vec<u8>> {
    let no = |what: &str| Error::data_file(Path::new("<bytes>"), what.to_owned());
    let descr = match array.dtype() {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::U8 => "|u1",
        DType::U32 => "<u4",
        DType::Bool => "|b1",
        DType::F16 => "<f2",
        DType::BF16 => {
            return Err(no(
                "NumPy has no bf16 dtype; convert the array to f32 (or f16) to write it",
            ))
        }
    };
    let shape = match array.dims() {
        [] => "()".to_owned(),
        [n] => format!("({n},)"),
        dims => format!(
            "({})",
            dims.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Magic (6) + version (2) + length (2) + header, padded with spaces to a multiple of 64
    // and ended by a newline.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let len = u16::try_from(header.len()).map_err(|_| no("the header is too long for npy 1.0"))?;
    let mut out = Vec::with_capacity(10 + header.len() + array.len() * array.dtype().size_bytes());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    match array.data() {
        ArrayData::F32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        ArrayData::F64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        ArrayData::I32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        ArrayData::I64(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        ArrayData::U32(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        ArrayData::U8(v) => out.extend_from_slice(v),
        ArrayData::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        ArrayData::F16(v) => v
            .iter()
            .for_each(|x| out.extend_from_slice(&x.to_bits().to_le_bytes())),
        ArrayData::BF16(_) => return Err(no("NumPy has no bf16 dtype")),
    }
    Ok(out)
}

/// The value of `key` in the header dict, as written (`'<f4'`, `False`, `(3, 4)`).
fn field<'h>(header: &'h str, key: &str) -> Option<&'h str> {
    let at = header.find(&format!("'{key}'"))? + key.len() + 2;
    let rest = header[at..].trim_start().strip_prefix(':')?.trim_start();
    let end = if rest.starts_with('(') {
        rest.find(')')? + 1
    } else if let Some(quoted) = rest.strip_prefix('\'') {
        quoted.find('\'')? + 2
    } else {
        rest.find([',', '}'])?
    };
    Some(rest[..end].trim())
}

fn parse(bytes: &[u8], path: &Path) -> Result<Array> {
    if !bytes.starts_with(MAGIC) {
        return Err(Error::data_file(
            path,
            "not a .npy file: it does not start with \\x93NUMPY",
        ));
    }
    let version = bytes
        .get(6..8)
        .ok_or_else(|| Error::data_file(path, "truncated before its version"))?;
    let (len, start) = match version[0] {
        1 => (
            bytes
                .get(8..10)
                .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize),
            10,
        ),
        2 | 3 => (
            bytes
                .get(8..12)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize),
            12,
        ),
        v => {
            return Err(Error::data_file(
                path,
                format!(
                    "npy format version {v}.{} is not one nitro reads (1, 2, 3)",
                    version[1]
                ),
            ))
        }
    };
    let len = len.ok_or_else(|| Error::data_file(path, "truncated before its header length"))?;
    let header = bytes
        .get(start..start + len)
        .ok_or_else(|| Error::data_file(path, format!("truncated inside its {len}-byte header")))?;
    let header = std::str::from_utf8(header)
        .map_err(|_| Error::data_file(path, "its header is not text"))?;
    let descr = field(header, "descr")
        .map(|d| d.trim_matches('\''))
        .ok_or_else(|| Error::data_file(path, format!("its header has no 'descr': {header}")))?;
    let fortran = match field(header, "fortran_order") {
        Some("True") => true,
        Some("False") => false,
        _ => {
            return Err(Error::data_file(
                path,
                format!("its header has no 'fortran_order': {header}"),
            ))
        }
    };
    let shape = field(header, "shape")
        .ok_or_else(|| Error::data_file(path, format!("its header has no 'shape': {header}")))?;
    let dims = shape
        .trim_matches(|c| c == '(' || c == ')')
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| {
            Error::data_file(path, format!("its shape {shape} is not a tuple of sizes"))
        })?;
    let (order, kind) = descr.split_at(descr.len().min(1));
    let dtype = match (order, kind) {
        ("<" | "=" | "|", "f4") => DType::F32,
        ("<" | "=" | "|", "f8") => DType::F64,
        ("<" | "=" | "|", "i4") => DType::I32,
        ("<" | "=" | "|", "i8") => DType::I64,
        ("<" | "=" | "|", "u4") => DType::U32,
        ("<" | "=" | "|", "f2") => DType::F16,
        ("|" | "<" | "=", "u1") => DType::U8,
        ("|" | "<" | "=", "b1") => DType::Bool,
        (">", _) => {
            return Err(Error::data_file(
                path,
                format!(
                    "dtype {descr} is big-endian; save it little-endian (`a.astype('<{kind}')`)"
                ),
            ))
        }
        _ => {
            return Err(Error::data_file(
                path,
                format!(
                    "dtype {descr} is not one nitro reads (f2 f4 f8 i4 i8 u1 u4 b1, little-endian)"
                ),
            ))
        }
    };
    let body = &bytes[start + len..];
    let count = dims
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::data_file(path, format!("its shape {shape} overflows")))?;
    let want = count
        .checked_mul(dtype.size_bytes())
        .ok_or_else(|| Error::data_file(path, format!("its shape {shape} overflows")))?;
    if body.len() != want {
        return Err(Error::data_file(
            path,
            format!(
                "its shape {shape} of {descr} needs {want} bytes of data, but it holds {}",
                body.len()
            ),
        ));
    }
    fn words<const N: usize, T>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        b.chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect()
    }
    let data = match dtype {
        DType::F32 => ArrayData::F32(words(body, f32::from_le_bytes)),
        DType::F64 => ArrayData::F64(words(body, f64::from_le_bytes)),
        DType::I32 => ArrayData::I32(words(body, i32::from_le_bytes)),
        DType::I64 => ArrayData::I64(words(body, i64::from_le_bytes)),
        DType::U32 => ArrayData::U32(words(body, u32::from_le_bytes)),
        DType::F16 => ArrayData::F16(words(body, |b| half::f16::from_bits(u16::from_le_bytes(b)))),
        DType::U8 => ArrayData::U8(body.to_vec()),
        DType::Bool => ArrayData::Bool(
            body.iter()
                .map(|&b| match b {
                    0 => Ok(false),
                    1 => Ok(true),
                    _ => Err(Error::data_file(
                        path,
                        format!("it holds the byte {b} in a bool array"),
                    )),
                })
                .collect::<Result<_>>()?,
        ),
        DType::BF16 => unreachable!("npy has no bf16 descr"),
    };
    if !fortran || dims.len() < 2 {
        return Array::from_data(&dims, data);
    }
    // Column-major: the data is the row-major array of the reversed dims, transposed back.
    let reversed: Vec<usize> = dims.iter().rev().copied().collect();
    let perm: Vec<usize> = (0..dims.len()).rev().collect();
    let moved = crate::ops::host::layout::transpose(&data, &reversed, &perm)
        .map_err(|_| Error::data_file(path, "cannot reorder its Fortran-order data"))?;
    Array::from_data(&dims, moved)
}
