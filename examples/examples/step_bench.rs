//! Per-step cost of the training handle on the digits MLP (64 → 128 tanh → 10, batch 32, Adam),
//! the figures the JAX comparison (`bench/compare_jax.py`) is measured against. Prints one JSON
//! line.
//!
//! `cargo run --release -p nitro-examples --example step_bench [steps]`

use std::time::Instant;

use nitro::data::Order;
use nitro::optim::Adam;
use nitro::train::FromBatch;
use nitro::train::{Config, Nitro};
use nitro::Array;
use nitro_examples::{data, glorot, Activation, Arch, DigitsMlp, Rows};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2000);
    let data = data::Digits::load(data::DIGITS_PATH)?;
    let backend = nitro::backend::current()?;
    // Batches built before timing: the step, not the data pipeline, is measured.
    let epoch = data.plan(32, Order::Sequential)?.epoch(0);
    let batches: Vec<Rows> = epoch
        .batches(&data)
        .take(data.rows() / 32)
        .map(|b| Rows::from_batch(b?))
        .collect::<nitro::Result<_>>()?;
    let arch = Arch {
        widths: vec![64, 128, 10],
        activation: Activation::Tanh,
    };
    let exp = DigitsMlp {
        layers: glorot(&arch.widths, 1),
        arch,
        lr: Array::scalar(0.0f32),
        data,
    };
    let started = Instant::now();
    let mut run = Nitro::new(exp, Adam::default(), Config::new().batch(32).lr(1e-3))?;
    run.step(&batches[0], 32)?;
    let first_step_ms = started.elapsed().as_secs_f64() * 1e3;
    let mut times = Vec::with_capacity(steps);
    let mut loss = 0.0;
    for i in 0..steps {
        let t = Instant::now();
        loss = run.step(&batches[(i + 1) % batches.len()], 32)?.loss;
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let p10 = times[times.len() / 10];
    // The same steps with the loss left on the device until the end (how an epoch runs).
    let mut deferred = Vec::with_capacity(steps);
    for i in 0..steps {
        let t = Instant::now();
        run.step_deferred(&batches[(i + 1) % batches.len()], 32)?;
        deferred.push(t.elapsed().as_secs_f64() * 1e6);
    }
    run.take_losses()?;
    deferred.sort_by(f64::total_cmp);
    let deferred_median = deferred[deferred.len() / 2];
    println!(
        "{{\"bench\": \"step\", \"backend\": {:?}, \"steps\": {steps}, \"step_us_median\": {median:.1}, \
         \"step_us_p10\": {p10:.1}, \"deferred_step_us_median\": {deferred_median:.1}, \"first_step_ms\": {first_step_ms:.1}, \"compile_ms\": {:.1}, \
         \"final_loss\": {loss:.4}, \"cache\": {}}}",
        backend.identity().description,
        run.compile_time().as_secs_f64() * 1e3,
        serde_json::to_string(&nitro::cache::cache_stats())?
    );
    Ok(())
}
