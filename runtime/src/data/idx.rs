//! The idx format of MNIST and Fashion-MNIST: a big-endian magic (`0x0000_TTDD`: element type
//! `TT`, `DD` dims), the dims as big-endian `u32`s, then the elements, row-major, big-endian.
//! Files may be gzip-compressed (as the Debian package ships them); that is detected from the
//! bytes, not the name.
//!
//! Element types read: `0x08` unsigned byte (→ `u8`), `0x0C` int (→ `i32`), `0x0D` float
//! (→ `f32`), `0x0E` double (→ `f64`). Anything else — another magic, a truncated file, more
//! data than the dims say — is [`Error::DataFile`] naming the file and the fault.
//!
//! [`fashion_mnist`] loads the Debian package `dataset-fashion-mnist` (`apt-get install
//! dataset-fashion-mnist`); without it, the error names the package to install.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::tree::{Array, ArrayData};

/// The idx file at `path` (plain or gzip-compressed) as an array.
pub fn read(path: impl AsRef<Path>) -> Result<Array> {
    let path = path.as_ref();
    let raw = Error::read_data_file(path)?;
    parse(&raw, path)
}

/// An array from the bytes of an idx file (plain or gzip-compressed).
pub fn from_bytes(bytes: &[u8]) -> Result<Array> {
    parse(bytes, &PathBuf::from("<bytes>"))
}

fn parse(raw: &[u8], path: &Path) -> Result<Array> {
    let unzipped;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        unzipped = inflate(raw, path)?;
        &unzipped[..]
    } else {
        raw
    };
    let magic = bytes
        .get(..4)
        .ok_or_else(|| Error::data_file(path, "truncated before its magic number"))?;
    if magic[0] != 0 || magic[1] != 0 {
        return Err(Error::data_file(
            path,
            format!(
                "not an idx file: its magic {:02x}{:02x}{:02x}{:02x} does not start with two zero bytes",
                magic[0], magic[1], magic[2], magic[3]
            ),
        ));
    }
    let (kind, rank) = (magic[2], magic[3] as usize);
    let size = match kind {
        0x08 => 1,
        0x0C | 0x0D => 4,
        0x0E => 8,
        other => {
            return Err(Error::data_file(
                path,
                format!(
                    "element type 0x{other:02x} is not one nitro reads (0x08 u8, 0x0c i32, 0x0d f32, 0x0e f64)"
                ),
            ))
        }
    };
    let header = 4 + 4 * rank;
    let dims_bytes = bytes
        .get(4..header)
        .ok_or_else(|| Error::data_file(path, format!("truncated inside its {rank} dims")))?;
    let dims: Vec<usize> = dims_bytes
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let count = dims
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::data_file(path, format!("its dims {dims:?} overflow")))?;
    let body = &bytes[header..];
    let want = count.saturating_mul(size);
    if body.len() != want {
        return Err(Error::data_file(
            path,
            format!(
                "its dims {dims:?} need {want} bytes of data, but it holds {}{}",
                body.len(),
                if body.len() < want {
                    " (truncated)"
                } else {
                    ""
                }
            ),
        ));
    }
    let data = match kind {
        0x08 => ArrayData::U8(body.to_vec()),
        0x0C => ArrayData::I32(
            body.chunks_exact(4)
                .map(|c| i32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        0x0D => ArrayData::F32(
            body.chunks_exact(4)
                .map(|c| f32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        _ => ArrayData::F64(
            body.chunks_exact(8)
                .map(|c| {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(c);
                    f64::from_be_bytes(b)
                })
                .collect(),
        ),
    };
    Array::from_data(&dims, data)
}

/// The bytes of a gzip-compressed idx file, every member of it (`cat a.gz b.gz` and bgzip
/// files hold several), inflated no further than its header says the file holds: the header
/// is inflated first, its dims give the size of the data, and one byte more than that is the
/// most ever inflated — a small gzip of gigabytes of zeros is refused after its header, with
/// memory bounded by what the header claims (itself reserved fallibly).
fn inflate(raw: &[u8], path: &Path) -> Result<Vec<u8>> {
    let broken = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::data_file(
                path,
                "its gzip stream ends inside its idx header (truncated)",
            )
        } else {
            Error::data_file(path, format!("its gzip stream is broken: {e}"))
        }
    };
    let mut z = flate2::read::MultiGzDecoder::new(raw);
    let mut out = vec![0u8; 4];
    z.read_exact(&mut out).map_err(broken)?;
    let rank = out[3] as usize;
    out.resize(4 + 4 * rank, 0);
    z.read_exact(&mut out[4..]).map_err(broken)?;
    let size: u64 = match out[2] {
        0x0C | 0x0D => 4,
        0x0E => 8,
        _ => 1,
    };
    // The most the data can hold by its header; a header that overflows is refused by the
    // parser, so inflate nothing more and let it say so.
    let want = out[4..].chunks_exact(4).try_fold(size, |n, c| {
        n.checked_mul(u64::from(u32::from_be_bytes([c[0], c[1], c[2], c[3]])))
    });
    let Some(want) = want else {
        return Ok(out);
    };
    if want > crate::MAX_TENSOR_BYTES {
        return Err(Error::data_file(
            path,
            format!(
                "its header claims {want} bytes of data, over nitro's size limit \
                 (nitro::MAX_TENSOR_BYTES)"
            ),
        ));
    }
    let n = usize::try_from(want).unwrap_or(usize::MAX);
    out.try_reserve_exact(n.saturating_add(1))
        .map_err(|_| Error::OutOfMemory {
            what: format!("the idx data of `{}`", path.display()),
            bytes: want,
        })?;
    // One byte past the header's size is enough to tell "more data than the dims say".
    (&mut z)
        .take(want + 1)
        .read_to_end(&mut out)
        .map_err(broken)?;
    Ok(out)
}

/// Where the Debian package `dataset-fashion-mnist` installs the data set.
pub const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Fashion-MNIST: 60 000 training and 10 000 test images (`u8 [n, 28, 28]`) with their labels
/// (`u8 [n]`, classes 0–9).
pub struct FashionMnist {
    /// Training images.
    pub train_images: Array,
    /// Training labels.
    pub train_labels: Array,
    /// Test images.
    pub test_images: Array,
    /// Test labels.
    pub test_labels: Array,
}

/// Fashion-MNIST from `dir` (the four `{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`
/// files), or from [`FASHION_MNIST_DIR`] when `dir` is `None`. A missing file is an
/// [`Error::DataFile`] that names the Debian package to install; so are images that are not
/// `u8 [n, 28, 28]`, labels that are not `u8 [n]`, and counts that do not pair up (another
/// data set under these names would otherwise train on mis-sliced pixels).
pub fn fashion_mnist(dir: Option<&Path>) -> Result<FashionMnist> {
    let dir = dir.map_or_else(|| PathBuf::from(FASHION_MNIST_DIR), Path::to_path_buf);
    let load = |stem: &str| -> Result<Array> {
        let plain = dir.join(stem);
        let gz = dir.join(format!("{stem}.gz"));
        let path = if gz.exists() { gz } else { plain };
        if !path.exists() {
            return Err(Error::data_file(
                &path,
                "missing: install the Debian package `dataset-fashion-mnist` (`apt-get install dataset-fashion-mnist`), or pass the directory that holds the four idx files",
            ));
        }
        read(&path)
    };
    let data = FashionMnist {
        train_images: load("train-images-idx3-ubyte")?,
        train_labels: load("train-labels-idx1-ubyte")?,
        test_images: load("t10k-images-idx3-ubyte")?,
        test_labels: load("t10k-labels-idx1-ubyte")?,
    };
    for (images, labels, which) in [
        (&data.train_images, &data.train_labels, "training"),
        (&data.test_images, &data.test_labels, "test"),
    ] {
        let (images_ok, labels_ok) = (
            images.dtype() == crate::tree::DType::U8 && images.dims().get(1..) == Some(&[28, 28]),
            labels.dtype() == crate::tree::DType::U8 && labels.dims().len() == 1,
        );
        if !images_ok || !labels_ok {
            return Err(Error::data_file(
                &dir,
                format!(
                    "the {which} images are {} and the labels {}; Fashion-MNIST's are u8[n, 28, 28] \
                     and u8[n] — this directory holds another data set (read it with \
                     nitro::data::idx::read)",
                    images.leaf_type(),
                    labels.leaf_type()
                ),
            ));
        }
        if images.dims().first() != labels.dims().first() {
            return Err(Error::data_file(
                &dir,
                format!(
                    "the {which} images {} and labels {} do not pair up",
                    images.leaf_type(),
                    labels.leaf_type()
                ),
            ));
        }
    }
    Ok(data)
}
