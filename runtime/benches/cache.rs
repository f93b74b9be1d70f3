//! The compile cache's hit path: what every training step pays before it executes.
//!
//! Group `hit_step/<size>` serves an already-compiled program from memory (L1) for an
//! experiment whose Device table holds 1 KB, 100 KB, 10 MB or 100 MB, and assembles the
//! arguments of the run — no execute:
//!
//! - `prepared`: the key (structure walk, GraphConst digests hashed once ahead by
//!   `Prepared::new`, as a training handle keeps them), the L1 lookup, and
//!   `Program::arguments` (the Device leaves and the batch, borrowed in argument order);
//! - `get`: the same through `Cache::get`, which hashes the GraphConsts on every call (here one
//!   `u32`).
//!
//! The key sees the shapes and dtypes of Device data, never its bytes, so every size must cost
//! the same: a time that grows with the size is a bug.
//!
//! Run with `cargo bench -p nitro-xla --bench cache`.
#![allow(missing_docs)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use nitro::backend;
use nitro::cache::{Cache, Prepared};
use nitro::prelude::*;
use nitro::program::Program;

#[experiment]
pub struct Table {
    #[graph_const]
    pub k: u32,
    #[device]
    pub table: Array,
    #[device]
    pub bias: Array,
}

fn score(v: &TableView<'_>, x: &Tensor) -> Tensor {
    v.table.mean_all() * f64::from(*v.k) + (x.matmul(v.bias)).mean_all()
}
const SCORE: Program<Table, Tensor, Tensor> = Table::program("score", score);

fn hit_step(c: &mut Criterion) {
    // The hit path never reaches the backend beyond its identity, so the interpreter serves
    // (compiling on it is keeping the graph) and the bench needs no plugin.
    let backend = backend::interpreter();
    let x = Array::full(&[32, 64], 0.5f32);
    for (label, bytes) in [
        ("1KB", 1_000usize),
        ("100KB", 100_000),
        ("10MB", 10_000_000),
        ("100MB", 100_000_000),
    ] {
        let e = Table {
            k: 3,
            table: Array::zeros(DType::F32, &[bytes / 4]),
            bias: Array::zeros(DType::F32, &[64]),
        };
        let cache = Cache::in_memory(16);
        let first = cache
            .get(backend, &SCORE, &e, &x)
            .expect("the program compiles");
        assert!(!first.outcome.is_hit(), "the first lookup compiles");
        let prepared = Prepared::new(&e);

        let mut group = c.benchmark_group(format!("hit_step/{label}"));
        group.warm_up_time(Duration::from_millis(500));
        group.measurement_time(Duration::from_secs(2));
        group.bench_function("prepared", |b| {
            b.iter(|| {
                let served = cache
                    .get_prepared(backend, &SCORE, black_box(&prepared), black_box(&x))
                    .expect("a hit");
                let args = SCORE.arguments(&e, black_box(&x));
                black_box((served, args))
            })
        });
        group.bench_function("get", |b| {
            b.iter(|| {
                let served = cache
                    .get(backend, &SCORE, black_box(&e), black_box(&x))
                    .expect("a hit");
                let args = SCORE.arguments(&e, black_box(&x));
                black_box((served, args))
            })
        });
        group.finish();

        let stats = cache.stats();
        assert_eq!(
            (stats.misses, stats.compiles),
            (1, 1),
            "every measured lookup was a hit: {stats}"
        );
        assert_eq!(SCORE.arguments(&e, &x).len(), 3, "table, bias and x");
    }
}

criterion_group!(benches, hit_step);
criterion_main!(benches);
