//! The digits loader reads the shipped data set and rejects malformed rows.
#![allow(missing_docs)]

use nitro_examples::data::{DataError, Digits, DIGITS_PATH};

fn shipped() -> Digits {
    // Tests run with the package root as the working directory.
    Digits::load(format!("../{DIGITS_PATH}")).expect("the data set ships with the examples")
}

#[test]
fn loads_every_row_with_the_documented_digest() {
    let d = shipped();
    assert_eq!(d.rows(), 1797);
    assert_eq!(d.x.dims(), &[1797, 64]);
    // blake3 of the decompressed CSV, computed independently (`zcat … | b3sum`).
    assert_eq!(
        d.digest.to_string(),
        "f84230aa70dfb2e9da69c9c09d8c1fb7fb743a0cce3676204f3b3933c2115f15"
    );
    let labels = d.y.as_slice::<i32>().unwrap();
    assert!((0..10).all(|c| labels.contains(&c)));
    let pixels = d.x.as_slice::<f32>().unwrap();
    assert!(pixels.iter().all(|p| (0.0..=1.0).contains(p)));
}

#[test]
fn malformed_rows_name_their_line() {
    let good_row = format!("{}0", "1,".repeat(64));
    let short = format!("{good_row}\n1,2,3\n");
    match Digits::parse(&short) {
        Err(DataError::BadRow { line: 2, why }) => {
            assert!(why.contains("expected 65 values"), "{why}")
        }
        other => panic!("expected a bad row at line 2, got {other:?}"),
    }
    let bad_label = format!("{}10", "1,".repeat(64));
    assert!(matches!(
        Digits::parse(&bad_label),
        Err(DataError::BadRow { line: 1, .. })
    ));
    let bad_pixel = format!("17,{}0", "1,".repeat(63));
    let err = Digits::parse(&bad_pixel).unwrap_err();
    assert!(err.to_string().contains("pixel 17"), "{err}");
    assert!(matches!(
        Digits::load("no/such/file.csv.gz"),
        Err(DataError::Io(_))
    ));
}
