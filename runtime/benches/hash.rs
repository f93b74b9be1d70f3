//! Content hashing throughput: `Digest::of(&Vec<f32>)` against raw `blake3::hash` of the same
//! bytes. The target is ≥ 0.9× raw throughput (bulk slices are hashed as one byte run).
//!
//! Run with `cargo bench -p nitro --bench hash`; compare the two `time` figures of one run.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nitro::Digest;

fn hash_100mb(c: &mut Criterion) {
    const BYTES: usize = 100 * 1000 * 1000;
    let values: Vec<f32> = (0..BYTES / 4).map(|i| i as f32 * 0.5).collect();
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();

    let mut group = c.benchmark_group("hash_100MB");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(BYTES as u64));
    group.bench_function("raw_blake3", |b| {
        b.iter(|| blake3::hash(std::hint::black_box(&raw)))
    });
    group.bench_function("content_hash_vec_f32", |b| {
        b.iter(|| Digest::of(std::hint::black_box(&values)))
    });
    group.finish();
}

criterion_group!(benches, hash_100mb);
criterion_main!(benches);
