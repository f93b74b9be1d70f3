//! The content hash: golden digests of the canonical encoding, and the properties the compile
//! key relies on.
#![allow(missing_docs)]

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use nitro::{Array, ContentHash, ContentHasher, Digest};
use proptest::prelude::*;

#[derive(ContentHash, Clone)]
struct Arch {
    hidden: usize,
    activation: Activation,
}

#[derive(ContentHash, Clone, Copy)]
enum Activation {
    Tanh,
    #[allow(dead_code)]
    Relu,
}

#[derive(ContentHash)]
enum Norm {
    #[allow(dead_code)]
    None,
    Layer {
        eps: f32,
    },
    Rms(f32),
}

fn hex<T: ContentHash + ?Sized>(v: &T) -> String {
    Digest::of(v).to_string()
}

/// Golden digests. Each was computed outside Rust (Python's `blake3` over the encoding bytes
/// written out by hand from the table in `nitro::hash`), so a change of encoding — or of these
/// bytes — fails here. Never update a golden without a deliberate encoding change: every
/// persistent cache entry keyed by the old encoding goes stale.
#[test]
fn golden_digests() {
    let mut map = HashMap::new();
    map.insert("b".to_owned(), 2u32);
    map.insert("a".to_owned(), 1u32);
    let mut btree = BTreeMap::new();
    btree.insert(2u8, "y");
    btree.insert(1u8, "x");
    let table: Vec<(&str, String, &str)> = vec![
        (
            "5u32",
            hex(&5u32),
            "e84248fb50d0833361d0417df114b0b3b34408fff97c39cd0de963b09a9aebb8",
        ),
        (
            "-1i64",
            hex(&-1i64),
            "73919af90e1fee9f2c6585e4534a6fa9e04931c0090b9c7ab9e631b16d8c8da0",
        ),
        (
            "300usize",
            hex(&300usize),
            "a49fa26726afc532c475064d75aef0188f6c6ac96508fb8cbd8825f26bf2b8eb",
        ),
        (
            "true",
            hex(&true),
            "48fc721fbbc172e0925fa27af1671de225ba927134802998b10a1568a188652b",
        ),
        (
            "'é'",
            hex(&'é'),
            "4ef81b983bd7cde6bbc497dcbaeffcb1ff38a9d8bb9b208abb417910dc73a6d1",
        ),
        (
            "1.5f32",
            hex(&1.5f32),
            "292e960b4456e16092d5aed318ea5227a3e6a5090f134fad396307116550fb5a",
        ),
        (
            "-0.0f64",
            hex(&-0.0f64),
            "26821d8a123d88fe3ed033ff9b612bbbabdc131ab40d29d747feb3e9ab909ad4",
        ),
        (
            "\"nitro\"",
            hex("nitro"),
            "d6265c8ac067966982bb68439a732486cf0bacf1f553bf889343aa9052dc011e",
        ),
        (
            "String",
            hex(&"nitro".to_owned()),
            "d6265c8ac067966982bb68439a732486cf0bacf1f553bf889343aa9052dc011e",
        ),
        (
            "vec![1u16,2,3]",
            hex(&vec![1u16, 2, 3]),
            "bcb05d3431fb081b13b3d035dd1658c694941af9e4a021785ec35719acf4c108",
        ),
        (
            "[1u16,2,3]",
            hex(&[1u16, 2, 3]),
            "bcb05d3431fb081b13b3d035dd1658c694941af9e4a021785ec35719acf4c108",
        ),
        (
            "Some(7u8)",
            hex(&Some(7u8)),
            "3fc14ed7ecde203a90425ee191e9db5966336d737f0398ec93b764517b6df400",
        ),
        (
            "None::<u8>",
            hex(&None::<u8>),
            "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213",
        ),
        (
            "(1u8, \"a\")",
            hex(&(1u8, "a")),
            "37237abcc15ce564b805e05bc89905f8c3efe9b4f39b6bd3a008ad726e9bbac3",
        ),
        (
            "Ok(3u8)",
            hex(&Ok::<u8, u8>(3)),
            "a88740cd9fb41a2cba302d8934e154b9b36e885744e8f9e90b2695f87c889baa",
        ),
        (
            "Err(4u8)",
            hex(&Err::<u8, u8>(4)),
            "c681339c86c70715ac599247041052cd5933e3d78bc3edca9fbfd1ac9c26efc0",
        ),
        (
            "BTreeMap",
            hex(&btree),
            "e3c3d713200766a4fe6d3ad4e7edf1cba121d3a3b862484ae80891344c888449",
        ),
        (
            "Duration",
            hex(&Duration::new(3, 5)),
            "83ed39591bbd49f2221a64fbeef731eef743c6e375efc0d44dd67b623f546600",
        ),
        (
            "Arch",
            hex(&Arch {
                hidden: 128,
                activation: Activation::Tanh,
            }),
            "fa3482e4bdc94ba0fd13b17006ba30e07a0366ccc519a794b545643abbe14bf8",
        ),
        (
            "Norm::Layer",
            hex(&Norm::Layer { eps: 1e-5 }),
            "49ad8df74795421ea8e6c5c082ab9276bce258d088bcea656bd2c1f114f6449d",
        ),
        (
            "HashMap",
            hex(&map),
            "35b9478a34c24d00137af8069805eb10248dabd6d27ea3cf2e9f0e584c12288f",
        ),
        (
            "Array f32[2]",
            hex(&Array::from_vec(&[2], vec![1.0f32, 2.0]).unwrap()),
            "18a6c05c93ce37c619b8bc39e1c02c77cd56e100a57ee7ab23e06dfbefc19d44",
        ),
        (
            "()",
            hex(&()),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
        ),
    ];
    let wrong: Vec<String> = table
        .iter()
        .filter(|(_, got, want)| got != want)
        .map(|(what, got, want)| format!("{what}: got {got}, golden {want}"))
        .collect();
    assert!(wrong.is_empty(), "encoding changed:\n{}", wrong.join("\n"));
}

#[test]
fn the_digest_is_blake3_of_the_encoding() {
    assert_eq!(Digest::of(&7u32), Digest::from(blake3::hash(&[7, 0, 0, 0])));
    let mut bytes = 2u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(&1.0f32.to_le_bytes());
    bytes.extend_from_slice(&(-2.5f32).to_le_bytes());
    assert_eq!(
        Digest::of(&vec![1.0f32, -2.5]),
        Digest::from(blake3::hash(&bytes))
    );
}

#[test]
fn floats_hash_by_exact_bit_pattern() {
    assert_ne!(Digest::of(&0.0f32), Digest::of(&-0.0f32));
    assert_ne!(Digest::of(&0.0f64), Digest::of(&-0.0f64));
    let quiet = f32::from_bits(0x7fc0_0000);
    let payload = f32::from_bits(0x7fc0_0001);
    assert!(quiet.is_nan() && payload.is_nan());
    assert_ne!(Digest::of(&quiet), Digest::of(&payload));
    assert_eq!(Digest::of(&quiet), Digest::of(&f32::from_bits(0x7fc0_0000)));
    assert_eq!(
        Digest::of(&vec![quiet]),
        Digest::of(&vec![f32::from_bits(0x7fc0_0000)])
    );
    assert_ne!(Digest::of(&vec![0.0f64]), Digest::of(&vec![-0.0f64]));
    assert_ne!(Digest::of(&1.0f32), Digest::of(&1.0f64));
}

#[test]
fn hash_maps_and_sets_are_order_independent() {
    // Different insertion orders and different random hasher seeds give different iteration
    // orders; the digest must not see it.
    let keys: Vec<u32> = (0..200).collect();
    let mut a: HashMap<u32, String> = HashMap::new();
    for k in &keys {
        a.insert(*k, format!("v{k}"));
    }
    let mut b: HashMap<u32, String> = HashMap::with_capacity(1000);
    for k in keys.iter().rev() {
        b.insert(*k, format!("v{k}"));
    }
    assert_ne!(
        a.keys().copied().collect::<Vec<_>>(),
        b.keys().copied().collect::<Vec<_>>(),
        "the test needs two iteration orders"
    );
    assert_eq!(Digest::of(&a), Digest::of(&b));
    b.insert(7, "changed".into());
    assert_ne!(Digest::of(&a), Digest::of(&b));

    let s1: HashSet<&str> = ["x", "y", "z"].into_iter().collect();
    let s2: HashSet<&str> = ["z", "x", "y"].into_iter().collect();
    assert_eq!(Digest::of(&s1), Digest::of(&s2));
    let s3: HashSet<&str> = ["z", "x"].into_iter().collect();
    assert_ne!(Digest::of(&s1), Digest::of(&s3));
}

#[test]
fn clones_hash_equal_and_field_changes_hash_different() {
    let a = Arch {
        hidden: 128,
        activation: Activation::Tanh,
    };
    assert_eq!(Digest::of(&a), Digest::of(&a.clone()));
    let wider = Arch {
        hidden: 129,
        ..a.clone()
    };
    let relu = Arch {
        activation: Activation::Relu,
        ..a.clone()
    };
    assert_ne!(Digest::of(&a), Digest::of(&wider));
    assert_ne!(Digest::of(&a), Digest::of(&relu));
    assert_ne!(
        Digest::of(&Norm::Layer { eps: 1e-5 }),
        Digest::of(&Norm::Rms(1e-5))
    );
}

#[test]
fn lengths_separate_adjacent_sequences() {
    // Without length prefixes these would encode identically.
    assert_ne!(Digest::of(&("ab", "c")), Digest::of(&("a", "bc")));
    assert_ne!(
        Digest::of(&(vec![1u8], vec![2u8, 3])),
        Digest::of(&(vec![1u8, 2], vec![3u8]))
    );
    assert_ne!(Digest::of(&Some(())), Digest::of(&None::<()>));
}

#[test]
fn pointers_and_containers_hash_by_content() {
    let v = vec![1u32, 2, 3];
    let d = Digest::of(&v);
    assert_eq!(Digest::of(&Box::new(v.clone())), d);
    assert_eq!(Digest::of(&std::rc::Rc::new(v.clone())), d);
    assert_eq!(Digest::of(&std::sync::Arc::new(v.clone())), d);
    assert_eq!(Digest::of(&&v), d);
    assert_eq!(Digest::of(v.as_slice()), d);
    let mut deque: VecDeque<u32> = VecDeque::with_capacity(4);
    deque.push_back(2);
    deque.push_back(3);
    deque.push_front(1); // wraps, so the deque is two slices
    assert_eq!(Digest::of(&deque), d);
    assert_eq!(
        Digest::of(std::path::Path::new("a/b")),
        Digest::of(&std::path::PathBuf::from("a/b"))
    );
}

#[test]
fn digest_text_round_trips_and_rejects_bad_input() {
    let d = Digest::of("x");
    assert_eq!(d.to_string().parse::<Digest>().unwrap(), d);
    assert_eq!(d.short().to_string(), d.to_string()[..12]);
    assert!("abc".parse::<Digest>().is_err());
    let bad = "g".repeat(64).parse::<Digest>().unwrap_err();
    assert!(bad.to_string().contains("non-hex"), "{bad}");
    let json = serde_json::to_string(&d).unwrap();
    assert_eq!(serde_json::from_str::<Digest>(&json).unwrap(), d);
}

/// The encoding of a slice written element by element, without the bulk fast path.
fn per_element<T: ContentHash>(items: &[T]) -> Digest {
    let mut h = ContentHasher::new();
    h.write_len(items.len());
    for item in items {
        item.content_hash(&mut h);
    }
    h.finish()
}

proptest! {
    #[test]
    fn bulk_slices_equal_per_element_encoding_f32(v in proptest::collection::vec(any::<f32>(), 0..300)) {
        prop_assert_eq!(Digest::of(&v), per_element(&v));
    }

    #[test]
    fn bulk_slices_equal_per_element_encoding_ints(
        a in proptest::collection::vec(any::<i64>(), 0..100),
        b in proptest::collection::vec(any::<u8>(), 0..100),
        c in proptest::collection::vec(any::<bool>(), 0..100),
        d in proptest::collection::vec(any::<usize>(), 0..100),
        e in proptest::collection::vec(any::<f64>(), 0..100),
    ) {
        prop_assert_eq!(Digest::of(&a), per_element(&a));
        prop_assert_eq!(Digest::of(&b), per_element(&b));
        prop_assert_eq!(Digest::of(&c), per_element(&c));
        prop_assert_eq!(Digest::of(&d), per_element(&d));
        prop_assert_eq!(Digest::of(&e), per_element(&e));
    }

    #[test]
    fn different_vectors_have_different_digests(
        a in proptest::collection::vec(any::<u32>(), 0..50),
        b in proptest::collection::vec(any::<u32>(), 0..50),
    ) {
        prop_assert_eq!(a == b, Digest::of(&a) == Digest::of(&b));
    }
}
