//! A program defined in one crate (the examples library) and named again in another (this test
//! crate) is one program: compiled once, whichever crate's constant asks for it.
#![allow(missing_docs)]

use nitro::backend;
use nitro::cache::Cache;
use nitro::prelude::*;
use nitro::program::Program;
use nitro_examples::data::Digits;
use nitro_examples::{glorot, loss_and_grads, Activation, Arch, Batch, BatchMirror, DigitsMlp};

/// The library's gradient program, named from this crate: the same `fn`, the same name.
const GRAD_HERE: Program<DigitsMlp, BatchMirror<Tensor>, Vec<Tensor>> =
    DigitsMlp::program("grad", loss_and_grads);

#[test]
fn a_program_named_from_two_crates_compiles_once() {
    let data = Digits::parse(&format!("{}3\n", "0,".repeat(64))).unwrap();
    let exp = DigitsMlp {
        arch: Arch {
            widths: vec![64, 16, 10],
            activation: Activation::Tanh,
        },
        layers: glorot(&[64, 16, 10], 1),
        lr: Array::scalar(0.1f32),
        data,
    };
    let batch = Batch::slice(&exp.data, 0, 1);
    let cache = Cache::in_memory(8);
    let b = backend::interpreter();
    let there = cache.get(b, &nitro_examples::GRAD, &exp, &batch).unwrap();
    let here = cache.get(b, &GRAD_HERE, &exp, &batch).unwrap();
    assert!(!there.outcome.is_hit());
    assert!(here.outcome.is_hit(), "{}", here.outcome);
    assert!(std::sync::Arc::ptr_eq(&there.compiled, &here.compiled));
    for _ in 0..3 {
        assert!(cache
            .get(b, &GRAD_HERE, &exp, &batch)
            .unwrap()
            .outcome
            .is_hit());
        assert!(cache
            .get(b, &nitro_examples::GRAD, &exp, &batch)
            .unwrap()
            .outcome
            .is_hit());
    }
    assert_eq!(cache.stats().compiles, 1);
}
