//! Compile-cache costs.
//!
//! - `l1_hit/<size>`: one L1 hit through `Cache::get_prepared` with the GraphConst digests
//!   precomputed (what a training handle does every step), for a Device table of 1 KB, 1 MB and
//!   100 MB. Device contents never reach the key, so the three must be flat.
//! - `warm_start/*`: the digits-sized MLP gradient program (64 → 128 tanh → 10, softmax
//!   cross-entropy, batch 32) served to a fresh `Cache` on the same store directory (trace +
//!   load of the serialized executable: a new process's first step), against compiling it
//!   (trace + compile), and tracing alone. XLA when a plugin is installed, else the interpreter.
//!
//! Run with `cargo bench -p nitro --bench cache`.
#![allow(missing_docs)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};
use nitro::backend::{self, Backend};
use nitro::cache::{Cache, DirStore, Prepared};
use nitro::prelude::*;
use nitro::program::Program;

#[experiment]
pub struct Table {
    #[graph_const]
    pub k: u32,
    #[device]
    pub table: Array,
}

fn scale(v: &TableView<'_>, _: &()) -> Tensor {
    v.table * f64::from(*v.k)
}
const SCALE: Program<Table> = Table::program("scale", scale);

fn l1_hit(c: &mut Criterion) {
    let backend = backend::interpreter();
    let mut group = c.benchmark_group("l1_hit");
    for (label, bytes) in [
        ("1KB", 1_000usize),
        ("1MB", 1_000_000),
        ("100MB", 100_000_000),
    ] {
        let e = Table {
            k: 3,
            table: Array::zeros(DType::F32, &[bytes / 4]),
        };
        let prepared = Prepared::new(&e);
        let cache = Cache::in_memory(16);
        cache
            .get_prepared(backend, &SCALE, &prepared, &())
            .expect("the program compiles");
        group.throughput(Throughput::Elements(1));
        group.bench_function(label, |b| {
            b.iter(|| {
                cache
                    .get_prepared(backend, &SCALE, std::hint::black_box(&prepared), &())
                    .expect("a hit")
            })
        });
        let stats = cache.stats();
        assert_eq!(stats.misses, 1, "every measured lookup was a hit: {stats}");
    }
    group.finish();
}

#[derive(Tree)]
pub struct Dense {
    pub w: Array,
    pub b: Array,
}

#[derive(Tree)]
pub struct Batch {
    pub x: Array,
    pub y: Array,
}

#[experiment]
pub struct Digits {
    #[graph_const]
    pub hidden: usize,
    #[device(trainable)]
    pub layers: Vec<Dense>,
}

fn loss_and_grads(v: &DigitsView<'_>, batch: &BatchMirror<Tensor>) -> Vec<Tensor> {
    let h = (batch.x.matmul(v.layers[0].w) + v.layers[0].b).tanh();
    let logits = h.matmul(v.layers[1].w) + v.layers[1].b;
    let loss = nitro::trace::nn::softmax_cross_entropy(logits, batch.y).mean_all();
    let params: Vec<Tensor> = v.layers.iter().flat_map(|l| [l.w, l.b]).collect();
    std::iter::once(loss)
        .chain(nitro::trace::grad(loss, &params))
        .collect()
}
const GRAD: Program<Digits, BatchMirror<Tensor>, Vec<Tensor>> =
    Digits::program("grad", loss_and_grads);

fn digits() -> (Digits, Batch) {
    let dense = |i: usize, o: usize| Dense {
        w: Array::full(&[i, o], 0.01f32),
        b: Array::zeros(DType::F32, &[o]),
    };
    (
        Digits {
            hidden: 128,
            layers: vec![dense(64, 128), dense(128, 10)],
        },
        Batch {
            x: Array::zeros(DType::F32, &[32, 64]),
            y: Array::zeros(DType::I32, &[32]),
        },
    )
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn median_ms(mut f: impl FnMut(), n: usize) -> f64 {
    let mut t: Vec<f64> = (0..n)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[n / 2]
}

fn warm_start(c: &mut Criterion) {
    let backend: &dyn Backend = match backend::xla() {
        Ok(x) => x,
        Err(e) => {
            println!("warm_start: no XLA plugin ({e}); measuring the interpreter");
            backend::interpreter()
        }
    };
    let (e, batch) = digits();
    let tmp =
        TempDir(std::env::temp_dir().join(format!("nitro-bench-cache-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&tmp.0);
    let open = || -> Arc<DirStore> {
        Arc::new(DirStore::open(&tmp.0, 1 << 30, None).expect("the store opens"))
    };
    // Fill the store once.
    {
        let cache = Cache::new(4, Some(open()));
        cache.get(backend, &GRAD, &e, &batch).expect("compiles");
        assert_eq!(cache.stats().compiles, 1);
    }
    let load = || {
        // A new process's first step: a new cache on the same directory.
        let cache = Cache::new(4, Some(open()));
        let compiled = cache.get(backend, &GRAD, &e, &batch).expect("loads");
        assert_eq!(cache.stats().l2_hits, 1, "served from the store");
        compiled
    };
    let compile = || {
        let cache = Cache::in_memory(4);
        let compiled = cache.get(backend, &GRAD, &e, &batch).expect("compiles");
        assert_eq!(cache.stats().compiles, 1);
        compiled
    };

    let mut group = c.benchmark_group("warm_start");
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(4));
    group.bench_function("trace_only", |b| {
        b.iter(|| GRAD.trace(&e, &batch).expect("traces"))
    });
    group.bench_function("l2_load", |b| b.iter(load));
    group.bench_function("compile", |b| b.iter(compile));
    group.finish();

    let (trace_ms, load_ms, compile_ms) = (
        median_ms(
            || {
                GRAD.trace(&e, &batch).expect("traces");
            },
            15,
        ),
        median_ms(
            || {
                load();
            },
            15,
        ),
        median_ms(
            || {
                compile();
            },
            15,
        ),
    );
    println!(
        "warm_start on {}: trace {trace_ms:.2} ms, L2 load (trace + load) {load_ms:.2} ms, \
         compile (trace + compile) {compile_ms:.2} ms: {:.1}x",
        backend.identity().description,
        compile_ms / load_ms
    );
}

criterion_group!(benches, l1_hit, warm_start);
criterion_main!(benches);
