//! GraphConst hashing against raw blake3 of the same bytes.
//!
//! For each size (1 KB, 1 MB, 100 MB of `f32`), group `graph_const_hash/<size>` measures:
//!
//! - `raw_blake3`: `blake3::hash` of the values' little-endian bytes — the floor;
//! - `digest_of`: `Digest::of(&Vec<f32>)`, the content hash of the same values (the bytes plus
//!   an 8-byte length prefix, hashed as one byte run);
//! - `prepared`: `Prepared::new` on an experiment whose only GraphConst is that `Vec<f32>`: the
//!   per-field digests and their combination, what a lookup pays when the caller has not hashed
//!   its GraphConsts ahead of time.
//!
//! All three hash the same values in one thread, so their throughputs compare directly; the
//! target is ≥ 0.9× the raw throughput.
//!
//! Run with `cargo bench -p nitro-xla --bench hash`.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use nitro::cache::Prepared;
use nitro::prelude::*;
use nitro::Digest;

/// An experiment whose GraphConst is a table of floats (hashed by content on every key).
#[experiment]
pub struct Lookup {
    #[graph_const]
    pub table: Vec<f32>,
    #[device]
    pub w: Array,
}

fn graph_const_hash(c: &mut Criterion) {
    for (label, bytes) in [
        ("1KB", 1_000usize),
        ("1MB", 1_000_000),
        ("100MB", 100_000_000),
    ] {
        let values: Vec<f32> = (0..bytes / 4).map(|i| i as f32 * 0.5).collect();
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(raw.len(), bytes);
        let e = Lookup {
            table: values.clone(),
            w: Array::zeros(DType::F32, &[1]),
        };

        let mut group = c.benchmark_group(format!("graph_const_hash/{label}"));
        group.warm_up_time(Duration::from_millis(500));
        group.measurement_time(Duration::from_secs(2));
        if bytes >= 100_000_000 {
            // Tens of milliseconds an iteration: ten samples of a few iterations each.
            group.sampling_mode(SamplingMode::Flat);
            group.sample_size(10);
            group.warm_up_time(Duration::from_secs(1));
            group.measurement_time(Duration::from_secs(4));
        } else if bytes >= 1_000_000 {
            group.sample_size(50);
        }
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function("raw_blake3", |b| b.iter(|| blake3::hash(black_box(&raw))));
        group.bench_function("digest_of", |b| b.iter(|| Digest::of(black_box(&values))));
        group.bench_function("prepared", |b| {
            b.iter(|| Prepared::new(black_box(&e)).graph_const_digest())
        });
        group.finish();
    }
}

criterion_group!(benches, graph_const_hash);
criterion_main!(benches);
