//! Why a compile is slow: a GraphConst array made a constant shows in the compile report with
//! its size and its field, is linted past 1 MiB (once, by the cache too), and reaches the
//! store's program record, where `nitro cache explain --cost` reads it.
#![allow(missing_docs)]

mod common;

use nitro::backend;
use nitro::cache::{Cache, Lint, CONSTANT_BYTES_LINT};
use nitro::optim::Sgd;
use nitro::prelude::*;
use nitro::trace::nn;
use nitro::train::{Config, Model, Nitro};

#[derive(Tree)]
pub struct Rows {
    pub x: Array,
    pub y: Array,
}

/// A classifier whose projection is a GraphConst array: baked into the program.
#[experiment]
pub struct Baked {
    #[graph_const]
    pub projection: Array,
    #[device(trainable)]
    pub w: Array,
}

impl Model for Baked {
    type Batch = Rows;

    fn loss(v: &BakedView<'_>, b: &RowsMirror<Tensor>) -> Tensor {
        let p = Tensor::constant(v.projection.clone());
        nn::softmax_cross_entropy(b.x.matmul(p).matmul(v.w), b.y)
    }
}

fn baked(width: usize) -> Baked {
    let values: Vec<f32> = (0..64 * width).map(|i| (i % 7) as f32 * 0.01).collect();
    Baked {
        projection: Array::from_vec(&[64, width], values).unwrap(),
        w: Array::zeros(DType::F32, &[width, 3]),
    }
}

fn rows() -> Rows {
    Rows {
        x: Array::zeros(DType::F32, &[8, 64]),
        y: Array::zeros(DType::I32, &[8]),
    }
}

#[test]
fn a_baked_graph_const_array_is_reported_and_linted() {
    // 64 × 5000 f32: 1.28 MB, past the lint's 1 MiB.
    let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(8)));
    let config = Config::new().batch(8).lr(0.1);
    let mut run =
        Nitro::with_backend(baked(5000), Sgd, config, backend::interpreter(), cache).unwrap();
    run.prepare(&rows()).unwrap();
    let report = run.compile_report();
    let grad = report.get("grad").expect("a gradient program");
    let largest = &grad.constants[0];
    assert_eq!(largest.bytes, 64 * 5000 * 4);
    assert_eq!(largest.ty, "f32[64,5000]");
    assert_eq!(largest.field.as_deref(), Some("projection"));
    assert!(grad.constant_bytes > CONSTANT_BYTES_LINT);
    let lints = report.lints();
    assert!(
        lints
            .iter()
            .any(|l| l.contains("embeds") && l.contains("GraphConst field `projection`")),
        "{lints:?}"
    );
    assert!(
        report
            .to_string()
            .contains("from GraphConst field `projection`"),
        "{report}"
    );
    // The cache linted it once, naming the field.
    let cache_lints: Vec<Lint> = cache
        .lints()
        .into_iter()
        .filter(|l| matches!(l, Lint::LargeConstants { .. }))
        .collect();
    assert_eq!(cache_lints.len(), 1, "{cache_lints:?}");
    assert!(cache_lints[0].to_string().contains("`projection`"));

    // A small array is reported but not linted.
    let small_cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(8)));
    let mut small = Nitro::with_backend(
        baked(16),
        Sgd,
        Config::new().batch(8).lr(0.1),
        backend::interpreter(),
        small_cache,
    )
    .unwrap();
    small.prepare(&rows()).unwrap();
    let report = small.compile_report();
    assert!(report.lints().is_empty(), "{report}");
    assert!(small_cache.lints().is_empty());
}
