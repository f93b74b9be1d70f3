//! `.npy` files against NumPy's own writer: the fixtures in `tests/fixtures/npy/` were written
//! by `np.save` (`bench/npy_fixtures.py`); nitro reads each to the right values and writes
//! byte-identical files for the C-order ones, so `np.load` reads what nitro writes.
#![allow(missing_docs)]

mod common;

use nitro::{bf16, f16, npy, Array, DType, Error};

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/npy")
        .join(format!("{name}.npy"))
}

#[test]
fn reads_what_numpy_writes_and_writes_the_same_bytes() {
    let base: Vec<f32> = (0..6).map(|i| i as f32 * 0.5 - 1.0).collect();
    let cases: Vec<(&str, Array)> = vec![
        ("f32_2x3", Array::from_vec(&[2, 3], base.clone()).unwrap()),
        (
            "f64_3",
            Array::from_vec(&[3], vec![1.5f64, -2.25, 1e300]).unwrap(),
        ),
        (
            "i32_2x2",
            Array::from_vec(&[2, 2], vec![1i32, -2, i32::MAX, i32::MIN]).unwrap(),
        ),
        ("i64_scalar", Array::scalar(-7i64)),
        (
            "u8_4",
            Array::from_vec(&[4], vec![0u8, 1, 200, 255]).unwrap(),
        ),
        (
            "u32_3",
            Array::from_vec(&[3], vec![0u32, 1, u32::MAX]).unwrap(),
        ),
        (
            "bool_2x2",
            Array::from_vec(&[2, 2], vec![true, false, false, true]).unwrap(),
        ),
        (
            "f16_3",
            Array::from_vec(
                &[3],
                vec![f16::from_f32(0.5), f16::from_f32(-1.0), f16::MAX],
            )
            .unwrap(),
        ),
        ("f32_empty_0x3", Array::zeros(DType::F32, &[0, 3])),
    ];
    for (name, want) in &cases {
        let path = fixture(name);
        let got = npy::read(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(&got, want, "{name}: values");
        let numpy_bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            npy::to_bytes(want).unwrap(),
            numpy_bytes,
            "{name}: nitro writes NumPy's bytes"
        );
    }
    // Fortran order and format 2.0 read as the same row-major array.
    let want = &cases[0].1;
    assert_eq!(
        &npy::read(fixture("f32_fortran_2x3")).unwrap(),
        want,
        "Fortran order"
    );
    assert_eq!(&npy::read(fixture("f32_v2")).unwrap(), want, "format 2.0");
}

#[test]
fn a_file_round_trips_through_disk() {
    let dir = common::TempDir::new("npy");
    std::fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join("a.npy");
    let a = Array::from_vec(&[2, 2, 2], (0..8).map(|i| i as f64).collect::<Vec<_>>()).unwrap();
    npy::write(&path, &a).unwrap();
    assert_eq!(npy::read(&path).unwrap(), a);
}

#[test]
fn bad_files_are_typed_errors_naming_the_file_and_the_fault() {
    let why = |r: nitro::Result<Array>| match r {
        Err(Error::DataFile { why, .. }) => why,
        other => panic!("expected a DataFile error, got {other:?}"),
    };
    let e = why(npy::read(fixture("f32_big_endian")));
    assert!(e.contains("big-endian"), "{e}");
    let good = std::fs::read(fixture("f32_2x3")).unwrap();
    let e = why(npy::from_bytes(&good[..good.len() - 3]));
    assert!(e.contains("needs 24 bytes of data, but it holds 21"), "{e}");
    let e = why(npy::from_bytes(&good[..40]));
    assert!(e.contains("truncated inside its"), "{e}");
    let e = why(npy::from_bytes(b"PK\x03\x04 not an npy"));
    assert!(e.contains("does not start with"), "{e}");
    let err = npy::read(fixture("missing")).unwrap_err();
    assert!(
        err.to_string().contains("missing.npy") && err.to_string().contains("cannot read"),
        "{err}"
    );
    // bf16 has no NumPy dtype.
    let h = Array::from_vec(&[1], vec![bf16::ONE]).unwrap();
    let e = match npy::to_bytes(&h) {
        Err(Error::DataFile { why, .. }) => why,
        other => panic!("{other:?}"),
    };
    assert!(e.contains("no bf16"), "{e}");
}
