//! Datasets: digests, label checks, splits, shuffles and padded batches.
#![allow(missing_docs)]

use std::collections::BTreeSet;

use nitro::data::{permutation, BatchMirror, Dataset, Order, MASK};
use nitro::{Array, DType, Error, LeafPath, Tree};

/// `rows` rows: `x[i] = [i, i + 0.5]`, `y[i] = i % 3`.
fn toy(rows: usize) -> Dataset {
    let x: Vec<f32> = (0..rows).flat_map(|i| [i as f32, i as f32 + 0.5]).collect();
    let y: Vec<i32> = (0..rows as i32).map(|i| i % 3).collect();
    Dataset::new([
        ("x", Array::from_vec(&[rows, 2], x).unwrap()),
        ("y", Array::from_vec(&[rows], y).unwrap()),
    ])
    .unwrap()
}

/// The row ids (`x[·][0]`) of a data set or batch column `x`.
fn ids(x: &Array) -> Vec<usize> {
    x.as_slice::<f32>()
        .unwrap()
        .chunks(2)
        .map(|r| r[0] as usize)
        .collect()
}

#[test]
fn digest_is_stable_and_moves_with_any_change() {
    let a = toy(5);
    assert_eq!(a.digest(), toy(5).digest());
    let base = a.digest();
    assert!(base.is_some(), "Dataset::new names its data");

    // One changed byte.
    let mut cols = a.clone().into_columns();
    cols[0].1.as_slice_mut::<f32>().unwrap()[7] += 1.0;
    assert_ne!(Dataset::new(cols).unwrap().digest(), base);

    // Same bytes, another dtype: the f32 bits reinterpreted as i32.
    let mut cols = a.clone().into_columns();
    let bits: Vec<i32> = cols[0]
        .1
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits() as i32)
        .collect();
    cols[0].1 = Array::from_vec(&[5, 2], bits).unwrap();
    assert_ne!(Dataset::new(cols).unwrap().digest(), base);

    // Same bytes, another shape.
    let mut cols = a.clone().into_columns();
    let v = cols[0].1.as_slice::<f32>().unwrap().to_vec();
    cols[0].1 = Array::from_vec(&[5, 2, 1], v).unwrap();
    assert_ne!(Dataset::new(cols).unwrap().digest(), base);

    // Another column name.
    let mut cols = a.clone().into_columns();
    cols[1].0 = "label".into();
    assert_ne!(Dataset::new(cols).unwrap().digest(), base);
}

#[test]
fn mismatched_rows_and_bad_columns_are_typed_errors() {
    let err = Dataset::new([
        ("x", Array::zeros(DType::F32, &[4, 2])),
        ("y", Array::zeros(DType::I32, &[3])),
    ])
    .unwrap_err();
    match &err {
        Error::DatasetRows {
            column,
            rows,
            first,
            first_rows,
        } => assert_eq!(
            (column.as_str(), *rows, first.as_str(), *first_rows),
            ("y", 3, "x", 4)
        ),
        other => panic!("expected DatasetRows, got {other:?}"),
    }
    assert!(err.to_string().contains("`y` has 3 rows"), "{err}");

    let zeros = || Array::zeros(DType::F32, &[2]);
    for (cols, name) in [
        (vec![("x", zeros()), ("x", zeros())], "x"),
        (vec![("mask", zeros())], "mask"),
        (vec![("a.b", zeros())], "a.b"),
        (vec![("s", Array::scalar(1.0f32))], "s"),
    ] {
        match Dataset::new(cols) {
            Err(Error::DatasetColumn { column, .. }) => assert_eq!(column, name),
            other => panic!("expected DatasetColumn for {name}, got {other:?}"),
        }
    }
    assert!(matches!(
        Dataset::new(Vec::<(String, Array)>::new()),
        Err(Error::InvalidDataArgument { .. })
    ));
    assert!(toy(3)
        .column("z")
        .unwrap_err()
        .to_string()
        .contains("`x`, `y`"));
}

#[test]
fn label_check_names_the_first_bad_row() {
    let with = |labels: Vec<i32>| {
        Dataset::new([("y", Array::from_vec(&[labels.len()], labels).unwrap())]).unwrap()
    };
    with(vec![0, 9, 3]).check_labels("y", 10).unwrap();
    match with(vec![0, 9, 10, 11]).check_labels("y", 10) {
        Err(Error::LabelOutOfRange {
            row,
            value,
            classes,
            ..
        }) => assert_eq!((row, value, classes), (2, 10, 10)),
        other => panic!("expected LabelOutOfRange, got {other:?}"),
    }
    let err = with(vec![1, -1]).check_labels("y", 10).unwrap_err();
    assert!(matches!(
        err,
        Error::LabelOutOfRange {
            row: 1,
            value: -1,
            ..
        }
    ));
    assert!(err.to_string().contains("row 1"), "{err}");

    // Row, not element, of a [rows, 2] label column.
    let two = Dataset::new([(
        "y",
        Array::from_vec(&[3, 2], vec![0i64, 1, 1, 1, 1, 5]).unwrap(),
    )])
    .unwrap();
    assert!(matches!(
        two.check_labels("y", 5),
        Err(Error::LabelOutOfRange {
            row: 2,
            value: 5,
            ..
        })
    ));
    let u8s = Dataset::new([("y", Array::from_vec(&[2], vec![0u8, 200]).unwrap())]).unwrap();
    assert!(matches!(
        u8s.check_labels("y", 10),
        Err(Error::LabelOutOfRange {
            row: 1,
            value: 200,
            ..
        })
    ));
    assert!(matches!(
        toy(3).check_labels("x", 3),
        Err(Error::DatasetColumn { .. })
    ));
}

#[test]
fn split_sizes_determinism_and_disjointness() {
    let data = toy(101);
    let s = data.split(0.8, 7).unwrap();
    assert_eq!((s.train.rows(), s.validation.rows()), (81, 20));
    let mut all: Vec<usize> = ids(s.train.column("x").unwrap());
    all.extend(ids(s.validation.column("x").unwrap()));
    all.sort_unstable();
    assert_eq!(
        all,
        (0..101).collect::<Vec<_>>(),
        "the parts partition the rows"
    );
    assert_eq!(ids(s.train.column("x").unwrap()), s.train_indices());

    let again = data.split(0.8, 7).unwrap();
    assert_eq!(again.train_indices(), s.train_indices());
    assert_eq!(again.identity(), s.identity());
    assert_eq!(again.train.digest(), s.train.digest());

    let other = data.split(0.8, 8).unwrap();
    assert_ne!(other.train_indices(), s.train_indices());
    assert_ne!(other.identity(), s.identity());
    assert_ne!(data.split(0.7, 7).unwrap().identity(), s.identity());

    // Pinned: the same split on every platform and run.
    assert_eq!(
        data.split(0.9, 1).unwrap().validation_indices(),
        &[10, 15, 19, 29, 32, 33, 40, 66, 77, 84]
    );

    assert_eq!(data.split(1.0, 0).unwrap().validation.rows(), 0);
    assert_eq!(data.split(0.0, 0).unwrap().train.rows(), 0);
    for bad in [-0.1, 1.5, f64::NAN] {
        assert!(matches!(
            data.split(bad, 0),
            Err(Error::InvalidDataArgument { .. })
        ));
    }
}

#[test]
fn shuffles_are_permutations_and_differ_by_epoch() {
    for n in [0, 1, 2, 10, 257] {
        let p = permutation(n, 42);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..n).collect::<Vec<_>>());
    }
    assert_eq!(permutation(50, 1), permutation(50, 1));
    assert_ne!(permutation(50, 1), permutation(50, 2));

    let plan = toy(40).plan(8, Order::Shuffled { seed: 3 }).unwrap();
    assert_eq!(plan.epoch(0), plan.epoch(0));
    assert_ne!(plan.epoch(0).order(), plan.epoch(1).order());
    let seq = toy(40).plan(8, Order::Sequential).unwrap();
    assert_eq!(seq.epoch(5).order(), (0..40).collect::<Vec<_>>());
}

#[test]
fn batches_cover_every_row_once_and_pad_the_last() {
    let data = toy(23);
    let plan = data.plan(5, Order::Shuffled { seed: 9 }).unwrap();
    assert_eq!(plan.batches_per_epoch(), 5);
    for e in 0..3 {
        let epoch = plan.epoch(e);
        let batches: Vec<_> = epoch.batches(&data).collect::<Result<_, _>>().unwrap();
        assert_eq!(batches.len(), 5);
        let mut seen = Vec::new();
        for (b, span) in batches.iter().zip(epoch.spans()) {
            assert_eq!(b.size(), 5);
            assert_eq!(b.column("x").unwrap().dims(), &[5, 2]);
            assert_eq!(b.column("y").unwrap().dims(), &[5]);
            let real = b.real_rows();
            let rows = ids(b.column("x").unwrap());
            assert_eq!(&rows[..real], span);
            // y follows x row for row.
            let y = b.column("y").unwrap().as_slice::<i32>().unwrap();
            for (r, &label) in rows.iter().zip(y) {
                assert_eq!(label, (*r % 3) as i32);
            }
            seen.extend_from_slice(&rows[..real]);
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..23).collect::<Vec<_>>(), "epoch {e}");

        // 23 = 4·5 + 3: the last batch has 3 real rows, then copies of its rows 0 and 1.
        let last = &batches[4];
        assert_eq!(last.real_rows(), 3);
        assert_eq!(
            last.mask().as_slice::<f32>().unwrap(),
            &[1.0, 1.0, 1.0, 0.0, 0.0]
        );
        let rows = ids(last.column("x").unwrap());
        assert_eq!((rows[3], rows[4]), (rows[0], rows[1]));
        assert!(batches[..4]
            .iter()
            .all(|b| b.real_rows() == 5 && b.mask().as_slice::<f32>().unwrap() == [1.0; 5]));
    }
}

#[test]
fn a_batch_is_a_tree_of_columns_then_mask() {
    let data = toy(4);
    let b = data.gather(&[2, 0], 3).unwrap();
    assert_eq!(
        b.signature_at("batch").to_string(),
        "batch.x: f32[3,2], batch.y: i32[3], batch.mask: f32[3]"
    );
    let m: BatchMirror<Vec<usize>> =
        b.mirror(&mut LeafPath::root(""), &mut |_, a| a.dims().to_vec());
    assert_eq!(m.get("x"), Some(&vec![3, 2]));
    assert_eq!(m.mask, vec![3]);
    assert_eq!(m.get(MASK), None, "the mask is not a column");
    assert_eq!(b.leaf_count(), 3);

    // Padding never changes the signature: a ragged batch compiles nothing new.
    let full = data.gather(&[0, 1, 2], 3).unwrap();
    assert_eq!(full.signature_at("b"), b.signature_at("b"));
}

#[test]
fn gather_and_plans_reject_bad_arguments() {
    let data = toy(4);
    assert!(matches!(
        data.gather(&[0, 4], 2),
        Err(Error::RowOutOfRange { row: 4, rows: 4 })
    ));
    assert!(matches!(
        data.gather(&[], 2),
        Err(Error::InvalidDataArgument { .. })
    ));
    assert!(matches!(
        data.gather(&[0, 1, 2], 2),
        Err(Error::InvalidDataArgument { .. })
    ));
    assert!(matches!(
        data.plan(0, Order::Sequential),
        Err(Error::InvalidDataArgument { .. })
    ));
    assert!(matches!(
        data.select(&[9]),
        Err(Error::RowOutOfRange { row: 9, .. })
    ));
    let empty = data.select(&[]).unwrap();
    assert_eq!(empty.rows(), 0);
    assert!(empty
        .plan(4, Order::Shuffled { seed: 1 })
        .unwrap()
        .epoch(0)
        .is_empty());
    let picked = data.select(&[3, 3, 1]).unwrap();
    assert_eq!(ids(picked.column("x").unwrap()), [3, 3, 1]);
}

#[test]
fn distinct_rows_of_the_split_never_overlap() {
    let s = toy(60).split(0.5, 11).unwrap();
    let train: BTreeSet<_> = s.train_indices().iter().collect();
    assert!(s.validation_indices().iter().all(|i| !train.contains(i)));
}

#[test]
fn an_unnamed_data_set_trains_the_same_and_is_named_only_when_asked() {
    let named = toy(10);
    let unnamed = Dataset::unnamed(named.clone().into_columns()).unwrap();
    assert!(named.digest().is_some());
    assert_eq!(unnamed.digest(), None);
    assert!(format!("{unnamed:?}").contains("no digest"));

    // Its derived data sets have no digest either; their rows are the named one's.
    let (s, t) = (unnamed.split(0.8, 7).unwrap(), named.split(0.8, 7).unwrap());
    assert_eq!(s.identity(), None);
    assert!(t.identity().is_some());
    assert_eq!((s.train.digest(), s.validation.digest()), (None, None));
    assert_eq!(s.train_indices(), t.train_indices());
    assert_eq!(s.train.column("x").unwrap(), t.train.column("x").unwrap());
    assert_eq!(unnamed.select(&[3, 1]).unwrap().digest(), None);
    let plan = unnamed.plan(4, Order::Shuffled { seed: 3 }).unwrap();
    let a: Vec<_> = plan
        .epoch(1)
        .batches(&unnamed)
        .map(Result::unwrap)
        .collect();
    let b: Vec<_> = plan.epoch(1).batches(&named).map(Result::unwrap).collect();
    for (a, b) in a.iter().zip(&b) {
        assert_eq!(a.get("x"), b.get("x"));
        assert_eq!(a.mask(), b.mask());
    }

    // Named later, or hashed as part of a content hash: the digest the named one has.
    assert_eq!(unnamed.clone().into_named().digest(), named.digest());
    assert_eq!(nitro::Digest::of(&unnamed), nitro::Digest::of(&named));
    assert_eq!(
        t.train.clone().into_named().digest(),
        t.train.digest(),
        "naming a named data set keeps its digest"
    );
}
