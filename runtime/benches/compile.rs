//! What a program costs before its first step: tracing and emission against XLA's compile, and
//! a warm start from the persistent cache against a cold compile.
//!
//! The programs are the digits example's, rebuilt here on the public API (the examples crate
//! depends on this one): an MLP 64 → 128 tanh → 10 on a batch of 32 with a row mask, `grad`
//! (masked mean softmax cross-entropy and its gradients for the four parameters) and `eval`
//! (the masked count of correct predictions).
//!
//! - `trace_emit/{grad,eval}`: `Program::trace` — recording the graph (with the backward pass
//!   for `grad`), emitting StableHLO and fingerprinting it.
//! - `xla_compile/{grad,eval}`: the XLA backend compiling the emitted text (tracing excluded).
//!   Skipped, with a `skip:` line, when no PJRT plugin is found.
//! - `warm_start/<backend>/…` for `grad`, on XLA when a plugin is found, else on the
//!   interpreter (whose "compile" is keeping the graph, so only the store's costs show):
//!   - `cold_compile`: a new in-memory cache's first lookup: trace + compile;
//!   - `warm_load`: a new cache on a store directory that already holds the program (a new
//!     process's first step): open the store, trace, read the entry from disk, verify it and
//!     load the serialized executable;
//!   - `deserialize`: the backend loading the serialized executable alone.
//!
//! The store lives in a fresh directory under the system's temporary directory, removed at the
//! end; no program is read from or written to the user's compile cache.
//!
//! Run with `cargo bench -p nitro-xla --bench compile`.
#![allow(missing_docs)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkGroup, Criterion, SamplingMode};
use nitro::backend::{self, Backend};
use nitro::cache::{Cache, DirStore};
use nitro::prelude::*;
use nitro::program::Program;

#[derive(Tree)]
pub struct Dense {
    pub w: Array,
    pub b: Array,
}

#[derive(Tree)]
pub struct Batch {
    pub x: Array,
    pub y: Array,
    pub mask: Array,
}

#[experiment]
pub struct Digits {
    #[graph_const]
    pub hidden: usize,
    #[device(trainable)]
    pub layers: Vec<Dense>,
    #[device]
    pub lr: Array,
}

fn forward(v: &DigitsView<'_>, x: Tensor) -> Tensor {
    let h = (x.matmul(v.layers[0].w) + v.layers[0].b).tanh();
    h.matmul(v.layers[1].w) + v.layers[1].b
}

fn loss_and_grads(v: &DigitsView<'_>, batch: &BatchMirror<Tensor>) -> Vec<Tensor> {
    let per_row = nitro::trace::nn::softmax_cross_entropy(forward(v, batch.x), batch.y);
    let mean = (per_row * batch.mask).sum_all() / batch.mask.sum_all();
    let params: Vec<Tensor> = v.layers.iter().flat_map(|l| [l.w, l.b]).collect();
    std::iter::once(mean)
        .chain(nitro::trace::grad(mean, &params))
        .collect()
}
const GRAD: Program<Digits, BatchMirror<Tensor>, Vec<Tensor>> =
    Digits::program("grad", loss_and_grads);

fn correct(v: &DigitsView<'_>, batch: &BatchMirror<Tensor>) -> Tensor {
    (nitro::trace::nn::correct(forward(v, batch.x), batch.y) * batch.mask).sum_all()
}
const EVAL: Program<Digits, BatchMirror<Tensor>, Tensor> = Digits::program("eval", correct);

/// The digits model and one batch. Parameter values do not matter here: tracing and compiling
/// read shapes and dtypes only.
fn digits() -> (Digits, Batch) {
    let dense = |i: usize, o: usize| Dense {
        w: Array::full(&[i, o], 0.01f32),
        b: Array::zeros(DType::F32, &[o]),
    };
    (
        Digits {
            hidden: 128,
            layers: vec![dense(64, 128), dense(128, 10)],
            lr: Array::scalar(0.1f32),
        },
        Batch {
            x: Array::zeros(DType::F32, &[32, 64]),
            y: Array::zeros(DType::I32, &[32]),
            mask: Array::full(&[32], 1.0f32),
        },
    )
}

/// Settings for groups whose iterations take milliseconds to a second (XLA compiles the
/// gradient program in about 0.8 s on a busy 2-core machine): ten samples, flat sampling.
fn slow<M: criterion::measurement::Measurement>(group: &mut BenchmarkGroup<'_, M>) {
    group.sampling_mode(SamplingMode::Flat);
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(8));
}

fn trace_emit(c: &mut Criterion) {
    let (e, batch) = digits();
    let mut group = c.benchmark_group("trace_emit");
    group.warm_up_time(Duration::from_millis(500));
    group.measurement_time(Duration::from_secs(2));
    group.bench_function("grad", |b| {
        b.iter(|| GRAD.trace(&e, &batch).expect("traces"))
    });
    group.bench_function("eval", |b| {
        b.iter(|| EVAL.trace(&e, &batch).expect("traces"))
    });
    group.finish();
}

fn xla_compile(c: &mut Criterion) {
    let xla = match backend::xla() {
        Ok(x) => x,
        Err(e) => {
            println!("skip: xla_compile: no XLA plugin ({e})");
            return;
        }
    };
    let (e, batch) = digits();
    let grad = GRAD.trace(&e, &batch).expect("traces");
    let eval = EVAL.trace(&e, &batch).expect("traces");
    let mut group = c.benchmark_group("xla_compile");
    slow(&mut group);
    for (name, traced) in [("grad", &grad), ("eval", &eval)] {
        group.bench_function(name, |b| {
            b.iter(|| {
                xla.compile(&traced.graph, &traced.text)
                    .expect("XLA compiles")
            })
        });
    }
    group.finish();
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn warm_start(c: &mut Criterion) {
    let (backend, name): (&dyn Backend, &str) = match backend::xla() {
        Ok(x) => (x, "xla"),
        Err(e) => {
            println!("skip: warm_start/xla: no XLA plugin ({e}); measuring warm_start/interpreter");
            (backend::interpreter(), "interpreter")
        }
    };
    let (e, batch) = digits();
    let tmp =
        TempDir(std::env::temp_dir().join(format!("nitro-bench-compile-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&tmp.0);
    let open = || -> Arc<DirStore> {
        Arc::new(DirStore::open(&tmp.0, 1 << 30, None).expect("the store opens"))
    };
    // Fill the store once, and keep the serialized executable for `deserialize`.
    let payload = {
        let cache = Cache::new(4, Some(open()));
        let served = cache.get(backend, &GRAD, &e, &batch).expect("compiles");
        assert_eq!(cache.stats().compiles, 1);
        served.executable.serialize().expect("serializes")
    };
    let graph = GRAD.trace(&e, &batch).expect("traces").graph;

    let mut group = c.benchmark_group(format!("warm_start/{name}"));
    slow(&mut group);
    group.bench_function("cold_compile", |b| {
        b.iter(|| {
            let cache = Cache::in_memory(4);
            let served = cache.get(backend, &GRAD, &e, &batch).expect("compiles");
            assert_eq!(cache.stats().compiles, 1, "compiled");
            served
        })
    });
    group.bench_function("warm_load", |b| {
        b.iter(|| {
            let cache = Cache::new(4, Some(open()));
            let served = cache.get(backend, &GRAD, &e, &batch).expect("loads");
            assert_eq!(
                (cache.stats().l2_hits, cache.stats().compiles),
                (1, 0),
                "served from the store"
            );
            served
        })
    });
    group.bench_function("deserialize", |b| {
        b.iter(|| backend.load(&payload, &graph).expect("loads"))
    });
    group.finish();
}

criterion_group!(benches, trace_emit, xla_compile, warm_start);
criterion_main!(benches);
