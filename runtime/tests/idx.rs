//! The idx reader (MNIST's format), plain and gzip-compressed, its typed errors, the
//! Fashion-MNIST loader on a synthetic directory — and on the real Debian package
//! `dataset-fashion-mnist` when it is installed (`.ci/run` installs it and sets
//! `NITRO_REQUIRE_FASHION=1`, so there it must load).
#![allow(missing_docs)]

mod common;

use std::io::Write as _;

use nitro::data::idx;
use nitro::{Array, DType, Error};

fn idx_bytes(kind: u8, dims: &[u32], body: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 0, kind, dims.len() as u8];
    for d in dims {
        v.extend_from_slice(&d.to_be_bytes());
    }
    v.extend_from_slice(body);
    v
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn why(r: nitro::Result<Array>) -> String {
    match r {
        Err(Error::DataFile { why, .. }) => why,
        other => panic!(
            "expected a DataFile error, got {:?}",
            other.map(|a| a.leaf_type())
        ),
    }
}

#[test]
fn reads_bytes_ints_and_floats_plain_or_gzipped() {
    let images: Vec<u8> = (0..18).collect();
    let raw = idx_bytes(0x08, &[2, 3, 3], &images);
    let a = idx::from_bytes(&raw).unwrap();
    assert_eq!((a.dtype(), a.dims()), (DType::U8, &[2, 3, 3][..]));
    assert_eq!(a.as_slice::<u8>().unwrap(), &images[..]);
    assert_eq!(
        idx::from_bytes(&gz(&raw)).unwrap(),
        a,
        "gzip is detected from the bytes"
    );
    let floats: Vec<u8> = [1.5f32, -2.0]
        .iter()
        .flat_map(|f| f.to_be_bytes())
        .collect();
    let f = idx::from_bytes(&idx_bytes(0x0D, &[2], &floats)).unwrap();
    assert_eq!(f.as_slice::<f32>().unwrap(), &[1.5, -2.0]);
    let ints: Vec<u8> = [-3i32, 70000]
        .iter()
        .flat_map(|f| f.to_be_bytes())
        .collect();
    let i = idx::from_bytes(&idx_bytes(0x0C, &[2], &ints)).unwrap();
    assert_eq!(i.as_slice::<i32>().unwrap(), &[-3, 70000]);
}

#[test]
fn bad_files_are_typed_errors() {
    let raw = idx_bytes(0x08, &[2, 3, 3], &[0; 18]);
    assert!(why(idx::from_bytes(&raw[..raw.len() - 1])).contains("(truncated)"));
    let mut extra = raw.clone();
    extra.push(0);
    assert!(why(idx::from_bytes(&extra)).contains("need 18 bytes of data, but it holds 19"));
    assert!(why(idx::from_bytes(b"\x1f\x8b broken")).contains("gzip"));
    assert!(why(idx::from_bytes(b"PK\x03\x04")).contains("not an idx file"));
    assert!(why(idx::from_bytes(&idx_bytes(0x0B, &[1], &[0, 0]))).contains("element type 0x0b"));
    assert!(why(idx::from_bytes(&raw[..7])).contains("truncated inside its 3 dims"));
}

#[test]
fn fashion_mnist_loads_a_directory_and_names_the_package_when_absent() {
    let dir = common::TempDir::new("idx");
    std::fs::create_dir_all(dir.path()).unwrap();
    let write = |name: &str, bytes: Vec<u8>| std::fs::write(dir.path().join(name), bytes).unwrap();
    write(
        "train-images-idx3-ubyte.gz",
        gz(&idx_bytes(0x08, &[3, 28, 28], &[7; 3 * 28 * 28])),
    );
    write(
        "train-labels-idx1-ubyte.gz",
        gz(&idx_bytes(0x08, &[3], &[0, 1, 9])),
    );
    write(
        "t10k-images-idx3-ubyte",
        idx_bytes(0x08, &[1, 28, 28], &[1; 28 * 28]),
    );
    write("t10k-labels-idx1-ubyte", idx_bytes(0x08, &[1], &[4]));
    let d = idx::fashion_mnist(Some(dir.path())).unwrap();
    assert_eq!(d.train_images.dims(), &[3, 28, 28]);
    assert_eq!(d.test_labels.as_slice::<u8>().unwrap(), &[4]);
    // Labels that do not pair with the images are refused.
    write("t10k-labels-idx1-ubyte", idx_bytes(0x08, &[2], &[4, 4]));
    let err = idx::fashion_mnist(Some(dir.path()))
        .err()
        .expect("mismatched counts");
    assert!(err.to_string().contains("do not pair up"), "{err}");
    let empty = common::TempDir::new("idx-empty");
    std::fs::create_dir_all(empty.path()).unwrap();
    let err = idx::fashion_mnist(Some(empty.path()))
        .err()
        .expect("a missing directory");
    assert!(
        err.to_string()
            .contains("apt-get install dataset-fashion-mnist"),
        "{err}"
    );
}

#[test]
fn the_debian_package_loads_when_installed() {
    let required = std::env::var("NITRO_REQUIRE_FASHION").is_ok_and(|v| v.trim() == "1");
    if !std::path::Path::new(idx::FASHION_MNIST_DIR).exists() && !required {
        println!("skip: the Debian package dataset-fashion-mnist is not installed");
        return;
    }
    let d = idx::fashion_mnist(None).unwrap_or_else(|e| panic!("Fashion-MNIST: {e}"));
    assert_eq!(d.train_images.dims(), &[60_000, 28, 28]);
    assert_eq!(d.test_images.dims(), &[10_000, 28, 28]);
    assert!(d
        .train_labels
        .as_slice::<u8>()
        .unwrap()
        .iter()
        .all(|&l| l < 10));
}
