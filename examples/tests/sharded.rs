//! The examples' models partitioned over 4 CPU devices (issue 33): the character GPT under
//! FSDP, tensor parallelism (Megatron's split of its blocks on a `model` axis, with the rest
//! FSDP on `data`), its scanned form and gradient accumulation, and the Fashion CNN under FSDP
//! each train 20 steps (dropout off) to the one-device losses within 1e-5.
#![allow(missing_docs)]

use nitro::backend::{self, Backend};
use nitro::cache::Cache;
use nitro::prelude::*;
use nitro::shard::{Mesh, Sharding};
use nitro::train::{Config, Model, Nitro};
use nitro_examples::chargpt::{self, CharGpt, GptShape, Windows};
use nitro_examples::fashion::{self, FashionCnn, Images};

const STEPS: usize = 20;
const BATCH: usize = 8;

/// XLA with 4 devices, or `None` after a `skip:` line (failing under `NITRO_REQUIRE_XLA=1`).
fn xla_or_skip(test: &str) -> Option<()> {
    match backend::xla_for(4) {
        Ok(_) => Some(()),
        Err(e) => {
            let required = std::env::var("NITRO_REQUIRE_XLA").is_ok_and(|v| v.trim() == "1");
            assert!(
                !required,
                "{test}: NITRO_REQUIRE_XLA=1 but XLA on 4 devices: {e}"
            );
            println!("skip: {test}: {e}");
            None
        }
    }
}

fn backend_for(config: &Config) -> &'static dyn Backend {
    match config.partitioning().unwrap() {
        Some(p) => backend::for_mesh(&p).unwrap(),
        None => backend::xla_for(1).unwrap(),
    }
}

/// The per-micro-batch losses of `STEPS` batches on `config`.
fn losses<E: Model, O: nitro::optim::Optimizer>(
    experiment: E,
    optimizer: O,
    config: Config,
    batches: &[E::Batch],
) -> Vec<f64> {
    let backend = backend_for(&config);
    let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(8)));
    let mut run = Nitro::with_backend(
        experiment,
        optimizer,
        config.batch(BATCH).lr(3e-3).progress(false),
        backend,
        cache,
    )
    .expect("handle");
    for b in batches {
        run.step_deferred(b, BATCH).unwrap();
    }
    run.take_losses().unwrap()
}

fn assert_close(base: &[f64], other: &[f64], what: &str) {
    assert_eq!(base.len(), other.len(), "{what}");
    for (step, (a, b)) in base.iter().zip(other).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + a.abs()),
            "{what}, step {step}: {a} vs {b}"
        );
    }
}

fn windows(vocab: usize, context: usize) -> Vec<Windows> {
    let mut s = 12345u32;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        (s % vocab as u32) as i32
    };
    (0..STEPS)
        .map(|_| {
            let ids: Vec<i32> = (0..BATCH * (context + 1)).map(|_| next()).collect();
            let x: Vec<i32> = ids
                .chunks(context + 1)
                .flat_map(|w| w[..context].to_vec())
                .collect();
            let y: Vec<i32> = ids
                .chunks(context + 1)
                .flat_map(|w| w[1..].to_vec())
                .collect();
            Windows {
                x: Array::from_vec(&[BATCH, context], x).unwrap(),
                y: Array::from_vec(&[BATCH, context], y).unwrap(),
                valid: None,
            }
        })
        .collect()
}

fn gpt(scan: bool) -> CharGpt {
    let shape = GptShape {
        layers: 2,
        width: 32,
        heads: 4,
        context: 16,
        dropout: 0.0,
        seed: 3,
        scan,
    };
    CharGpt::new(&shape, 24)
}

#[test]
fn the_character_gpt_trains_to_the_one_device_losses_under_fsdp_tensor_parallelism_scan_and_accumulation(
) {
    let test = "the_character_gpt_trains_to_the_one_device_losses_under_fsdp_tensor_parallelism_scan_and_accumulation";
    let Some(()) = xla_or_skip(test) else {
        return;
    };
    let data = windows(24, 16);
    let fsdp = || {
        Config::new()
            .mesh(Mesh::new([("data", 4)]).unwrap())
            .sharding(Sharding::fsdp("data"))
    };
    let mixed = |scan: bool| {
        chargpt::with_tensor_parallel(
            Config::new()
                .mesh(Mesh::new([("data", 2), ("model", 2)]).unwrap())
                .sharding(Sharding::fsdp("data")),
            scan,
        )
    };
    for scan in [false, true] {
        let base = losses(gpt(scan), chargpt::optimizer(), Config::new(), &data);
        assert!(base[STEPS - 1] < base[0], "it learns: {base:?}");
        for (what, config) in [
            ("fsdp", fsdp()),
            ("tensor parallel + fsdp on 2x2", mixed(scan)),
        ] {
            let got = losses(gpt(scan), chargpt::optimizer(), config, &data);
            assert_close(&base, &got, &format!("{what}, scan {scan}"));
        }
    }
    // Accumulation: two micro-batches a step, on one device and under FSDP.
    let base = losses(
        gpt(false),
        chargpt::optimizer(),
        Config::new().accumulate(2),
        &data,
    );
    let got = losses(
        gpt(false),
        chargpt::optimizer(),
        fsdp().accumulate(2),
        &data,
    );
    assert_close(&base, &got, "fsdp with accumulation");
}

#[test]
fn the_megatron_split_names_the_blocks_leaves_in_both_layouts() {
    // Every pattern matches leaves of the model it is for (a pattern matching nothing is an
    // error when the handle is made), and splits q's columns and o's rows.
    for scan in [false, true] {
        let paths: Vec<String> = {
            let mut p = Vec::new();
            gpt(scan).visit_device(&mut |_, path, node| {
                if let nitro::Node::Leaf(_) = node {
                    p.push(path.as_str().to_owned());
                }
            });
            p
        };
        let sharding = chargpt::megatron(Sharding::fsdp("data"), "model", scan);
        for (pattern, spec) in sharding.leaves() {
            let hits: Vec<&String> = paths
                .iter()
                .filter(|p| nitro::optim::path_match(pattern, p))
                .collect();
            assert!(!hits.is_empty(), "{pattern} matches nothing in {paths:?}");
            let model_dim = spec.0.iter().position(Option::is_some).unwrap();
            let lead = usize::from(scan);
            if pattern.contains("q.w") {
                assert_eq!(model_dim, lead + 1, "q is split by columns");
            }
            if pattern.contains("o.w") {
                assert_eq!(model_dim, lead, "o is split by rows");
            }
        }
    }
}

#[test]
fn the_fashion_cnn_trains_to_the_one_device_losses_under_fsdp() {
    let test = "the_fashion_cnn_trains_to_the_one_device_losses_under_fsdp";
    let Some(()) = xla_or_skip(test) else {
        return;
    };
    let mut s = 99u32;
    let batches: Vec<Images> = (0..STEPS)
        .map(|_| {
            let x: Vec<f32> = (0..BATCH * 28 * 28)
                .map(|_| {
                    s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (s >> 8) as f32 / (1u32 << 24) as f32
                })
                .collect();
            let y: Vec<i32> = (0..BATCH).map(|i| ((s as usize + i) % 10) as i32).collect();
            Images {
                x: Array::from_vec(&[BATCH, 28, 28, 1], x).unwrap(),
                y: Array::from_vec(&[BATCH], y).unwrap(),
            }
        })
        .collect();
    let base = losses(
        FashionCnn::new(1),
        fashion::optimizer(),
        Config::new(),
        &batches,
    );
    let got = losses(
        FashionCnn::new(1),
        fashion::optimizer(),
        Config::new()
            .mesh(Mesh::new([("data", 4)]).unwrap())
            .sharding(Sharding::fsdp("data")),
        &batches,
    );
    assert_close(&base, &got, "fashion under fsdp");
}
