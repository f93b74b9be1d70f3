//! Keying and planning need the leaves' types, not their memory (issue 33, item 1): a model
//! declared with 2 billion f32 parameters (8 GB, in zeroed arrays that are never written)
//! gets a training handle and a full preflight plan — gradient, update and evaluation
//! programs traced and keyed, the update program's optimizer state and gradients included —
//! with the process's peak resident memory under 200 MB, measured in a child process. The
//! handle places nothing until its first step.
#![allow(missing_docs)]

mod common;

#[path = "common/mlp.rs"]
mod mlp;

use common::peak_rss_kb;

use mlp::{Batch, BatchMirror, Dense};
use nitro::cache::Cache;
use nitro::cache::Will;
use nitro::optim::Adam;
use nitro::prelude::*;
use nitro::train::{Config, Model, Nitro};

/// Width of each square layer: 10 layers of 14 142² ≈ 2.0 billion parameters.
const WIDTH: usize = 14_142;
const LAYERS: usize = 10;
const CHILD: &str = "NITRO_KEYING_MEMORY_CHILD";

#[experiment]
pub struct Huge {
    #[device(trainable)]
    pub layers: Vec<Dense>,
}

impl Model for Huge {
    type Batch = Batch;

    fn loss(v: &HugeView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        let h = v
            .layers
            .iter()
            .fold(b.x, |h, l| (h.matmul(l.w) + l.b).tanh());
        nitro::trace::nn::softmax_cross_entropy(h, b.y)
    }
}

/// The child's work: declare, make the handle, plan; print the figures.
fn child() {
    let layers = (0..LAYERS)
        .map(|_| Dense {
            w: Array::zeros(DType::F32, &[WIDTH, WIDTH]),
            b: Array::zeros(DType::F32, &[WIDTH]),
        })
        .collect();
    let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(8)));
    let run = Nitro::with_backend(
        Huge { layers },
        Adam::default(),
        Config::new().batch(4).progress(false),
        nitro::backend::interpreter(),
        cache,
    )
    .expect("handle");
    let sample = Batch {
        x: Array::zeros(DType::F32, &[4, WIDTH]),
        y: Array::zeros(DType::I32, &[4]),
    };
    let plan = run.plan(&sample, true).expect("plan");
    let memory = run.memory();
    println!(
        "figures: programs={} compile={} parameters={} optimizer_state={} peak_rss_kb={}",
        plan.entries.len(),
        plan.count(Will::Compile),
        memory.parameters,
        memory.optimizer_state,
        peak_rss_kb().unwrap_or(0),
    );
}

#[test]
fn a_two_billion_parameter_model_plans_and_keys_in_bounded_memory() {
    if std::env::var(CHILD).is_ok() {
        child();
        return;
    }
    if peak_rss_kb().is_none() {
        println!("skip: a_two_billion_parameter_model_plans_and_keys_in_bounded_memory: no /proc/self/status");
        return;
    }
    let figures = common::child_figures(
        "a_two_billion_parameter_model_plans_and_keys_in_bounded_memory",
        CHILD,
        "1",
    );
    let (line, figure) = (&figures.0, |name: &str| figures.get(name));
    let params = (LAYERS * (WIDTH * WIDTH + WIDTH)) as u64;
    assert!(params >= 2_000_000_000, "{params} parameters");
    assert_eq!(
        figure("programs"),
        3,
        "gradient, update, evaluation: {line}"
    );
    assert_eq!(figure("compile"), 3, "{line}");
    // Packed with each leaf at a 64-byte boundary: at least the parameters' 8 GB.
    assert!(figure("parameters") >= params * 4, "{line}");
    assert_eq!(
        figure("optimizer_state"),
        2 * figure("parameters"),
        "Adam: {line}"
    );
    let peak_mb = figure("peak_rss_kb") as f64 / 1024.0;
    assert!(
        peak_mb < 200.0,
        "planning a model of {params} parameters peaked at {peak_mb:.0} MB resident"
    );
    println!("planned {params} parameters at a peak of {peak_mb:.0} MB resident");
}
