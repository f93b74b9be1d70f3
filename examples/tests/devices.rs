//! The digits MLP trained data-parallel: 1, 2 and 4 devices with the same global batch give
//! the same parameters after a few steps — within 1e-5 on XLA and on the interpreter (the rows'
//! sums are grouped per device, so f32 rounding differs), with every replica bit-identical to
//! the others.
#![allow(missing_docs)]

use nitro::backend::{self, Backend};
use nitro::cache::Cache;
use nitro::optim::Adam;
use nitro::train::{Config, FromBatch, Nitro};
use nitro::Experiment;
use nitro_examples::data::{Digits, DIGITS_PATH};
use nitro_examples::{DigitsMlp, Rows};

const STEPS: usize = 4;
const BATCH: usize = 32;

/// The trained leaves after `STEPS` steps on the first rows of the digits (the last step
/// ragged), on `backend`.
fn trained(backend: &'static dyn Backend) -> Vec<Vec<f32>> {
    // Tests run in the crate's directory; the data path is relative to the workspace root.
    let data = Digits::load(std::path::Path::new("..").join(DIGITS_PATH)).expect("digits");
    let config = Config::new()
        .batch(BATCH)
        .lr(0.01)
        .devices(backend.replicas())
        .progress(false);
    let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(8)));
    let mut run = Nitro::with_backend(
        DigitsMlp::tanh(32, data.clone()),
        Adam::default(),
        config,
        backend,
        cache,
    )
    .expect("handle");
    for step in 0..STEPS {
        let real = if step + 1 == STEPS { 20 } else { BATCH };
        let rows: Vec<usize> = (step * BATCH..step * BATCH + real).collect();
        let batch = Rows::from_batch(data.gather(&rows, BATCH).unwrap()).unwrap();
        run.step(&batch, real).unwrap();
    }
    let replicas = run.replica_params().unwrap();
    for (r, replica) in replicas.iter().enumerate().skip(1) {
        assert_eq!(replica, &replicas[0], "replica {r} diverged");
    }
    let mut leaves = Vec::new();
    run.into_experiment()
        .unwrap()
        .visit_device(&mut |_, _, node| {
            if let nitro::Node::Leaf(a) = node {
                leaves.push(a.as_slice::<f32>().unwrap().to_vec());
            }
        });
    leaves
}

fn same_on(pick: impl Fn(usize) -> &'static dyn Backend) {
    let one = trained(pick(1));
    for devices in [2, 4] {
        let many = trained(pick(devices));
        for (a, b) in one.iter().zip(&many) {
            for (p, q) in a.iter().zip(b) {
                assert!(
                    (p - q).abs() <= 1e-5 * (1.0 + p.abs()),
                    "1 vs {devices} devices: {p} vs {q}"
                );
            }
        }
    }
}

#[test]
fn digits_on_one_two_and_four_devices_trains_the_same_parameters_on_the_interpreter() {
    same_on(|n| backend::interpreter_for(n));
}

#[test]
fn digits_on_one_two_and_four_devices_trains_the_same_parameters_on_xla() {
    match backend::xla() {
        Ok(_) => same_on(|n| backend::xla_for(n).expect("XLA devices")),
        Err(e) if std::env::var("NITRO_REQUIRE_XLA").as_deref() == Ok("1") => {
            panic!("NITRO_REQUIRE_XLA=1 but XLA is unavailable: {e}")
        }
        Err(e) => println!(
            "skip: digits_on_one_two_and_four_devices_trains_the_same_parameters_on_xla: {e}"
        ),
    }
}
