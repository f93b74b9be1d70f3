//! Character-level text: the vocabulary, windows as a data set, the unigram entropy, and the
//! Debian package `fortunes` as a corpus when it is installed (`.ci/run` installs it and sets
//! `NITRO_REQUIRE_FORTUNES=1`).
#![allow(missing_docs)]

mod common;

use nitro::data::text::{self, Vocab};

#[test]
fn vocab_windows_and_entropy() {
    let corpus = "abracadabra";
    let v = Vocab::of(corpus);
    assert_eq!(v.len(), 5, "a b c d r");
    let ids = v.encode(corpus).unwrap();
    assert_eq!(ids[..4], [0, 1, 4, 0]);
    assert_eq!(v.decode(&ids), corpus);
    assert!(v.encode("z").unwrap_err().to_string().contains("'z'"));
    let d = text::windows(&ids, 4, 3).unwrap();
    assert_eq!(d.rows(), 3, "starts 0, 3, 6");
    let x = d.column("x").unwrap().as_slice::<i32>().unwrap().to_vec();
    let y = d.column("y").unwrap().as_slice::<i32>().unwrap().to_vec();
    assert_eq!(&x[..4], &ids[..4]);
    assert_eq!(&y[..4], &ids[1..5], "targets are the next characters");
    assert!(
        text::windows(&ids, 11, 1).is_err(),
        "a window longer than the text"
    );
    // 5 a, 2 b, 1 c, 1 d, 2 r of 11.
    let p = [5.0f64, 2.0, 1.0, 1.0, 2.0].map(|c| c / 11.0);
    let want: f64 = p.iter().map(|p| -p * p.log2()).sum();
    assert!((text::unigram_bits(&ids) - want).abs() < 1e-12);
}

#[test]
fn fortunes_read_a_directory_and_name_the_package_when_absent() {
    let dir = common::TempDir::new("fortunes");
    std::fs::create_dir_all(dir.path()).unwrap();
    std::fs::write(dir.path().join("b"), "second\n%\nthird\n").unwrap();
    std::fs::write(dir.path().join("a"), "first\n%\n").unwrap();
    std::fs::write(dir.path().join("a.dat"), [0u8, 1, 2]).unwrap();
    assert_eq!(
        text::fortunes(Some(dir.path())).unwrap(),
        "first\nsecond\nthird\n"
    );
    let missing = dir.path().join("nothing-here");
    let err = text::fortunes(Some(&missing)).unwrap_err().to_string();
    assert!(err.contains("apt-get install fortunes"), "{err}");
}

#[test]
fn the_debian_package_is_a_corpus_when_installed() {
    let required = std::env::var("NITRO_REQUIRE_FORTUNES").is_ok_and(|v| v.trim() == "1");
    if !std::path::Path::new(text::FORTUNES_DIR).exists() && !required {
        println!("skip: the Debian package fortunes is not installed");
        return;
    }
    let corpus = text::fortunes(None).unwrap();
    assert!(
        corpus.len() > 1_000_000,
        "about 2.5 MB of text, got {}",
        corpus.len()
    );
    let v = Vocab::of(&corpus);
    let ids = v.encode(&corpus).unwrap();
    let bits = text::unigram_bits(&ids);
    assert!(
        (3.0..6.0).contains(&bits),
        "English text is about 4.5 bits a character: {bits}"
    );
    println!(
        "fortunes: {} characters, vocabulary {}, unigram {bits:.3} bits/char",
        ids.len(),
        v.len()
    );
}
