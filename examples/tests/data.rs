//! The digits loader reads the shipped data set into a `nitro::data::Dataset` and rejects
//! malformed rows.
#![allow(missing_docs)]

use nitro::data::{Dataset, Order};
use nitro_examples::data::{DataError, Digits, CLASSES, DIGITS_PATH};

fn shipped() -> Dataset {
    // Tests run with the package root as the working directory.
    Digits::load(format!("../{DIGITS_PATH}")).expect("the data set ships with the examples")
}

#[test]
fn loads_every_row_as_a_dataset_with_a_pinned_digest() {
    let d = shipped();
    assert_eq!(d.rows(), 1797);
    assert_eq!(d.column("x").unwrap().dims(), &[1797, 64]);
    assert_eq!(d.column("y").unwrap().dims(), &[1797]);
    // The content digest of the arrays (names, dtypes, dims, bytes): it moves if a byte of the
    // data or the way it is loaded changes.
    assert_eq!(d.digest(), shipped().digest());
    assert_eq!(
        d.digest().expect("loaded data is named").to_string(),
        "523997c02fdedcb523e448b087674e748e63974e21c3eb205a620d60e8547230"
    );
    d.check_labels("y", CLASSES).unwrap();
    let labels = d.column("y").unwrap().as_slice::<i32>().unwrap();
    assert!((0..10).all(|c| labels.contains(&c)));
    let pixels = d.column("x").unwrap().as_slice::<f32>().unwrap();
    assert!(pixels.iter().all(|p| (0.0..=1.0).contains(p)));
}

#[test]
fn the_shipped_data_splits_and_batches_deterministically() {
    let d = shipped();
    let s = d.split(0.8, 1).unwrap();
    assert_eq!((s.train.rows(), s.validation.rows()), (1438, 359));
    assert_eq!(s.identity(), d.split(0.8, 1).unwrap().identity());
    let plan = s.train.plan(32, Order::Shuffled { seed: 1 }).unwrap();
    let epoch = plan.epoch(0);
    assert_eq!(epoch.len(), 45);
    let last = epoch.batches(&s.train).last().unwrap().unwrap();
    // 1438 = 44·32 + 30: the last batch has 30 real rows and 2 padding rows.
    assert_eq!((last.size(), last.real_rows()), (32, 30));
    assert_eq!(last.column("x").unwrap().dims(), &[32, 64]);
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
    // The label check is the data set's: the row it names maps back to the line (empty lines
    // are skipped, so row 1 is line 3 here).
    let bad_label = format!("{good_row}\n\n{}10\n", "1,".repeat(64));
    match Digits::parse(&bad_label) {
        Err(DataError::BadRow { line: 3, why }) => assert!(why.contains("label 10"), "{why}"),
        other => panic!("expected a bad label at line 3, got {other:?}"),
    }
    let negative = format!("{}-1", "1,".repeat(64));
    assert!(matches!(
        Digits::parse(&negative),
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
