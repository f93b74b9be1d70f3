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
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!(
            "Per-step cost of the training handle on the digits MLP (batch 32, Adam). Prints \
             one JSON line.\n\nUsage: step_bench [STEPS]   (default 2000)"
        );
        return Ok(());
    }
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
    // Each program's compile (or load) time, compiled side by side: the floor of the first step.
    let per_program: serde_json::Map<String, serde_json::Value> = nitro::cache::global()
        .recent_misses()
        .into_iter()
        .map(|m| (m.program, serde_json::json!((m.ms * 10.0).round() / 10.0)))
        .collect();
    let next = |i: usize| &batches[(i + 1) % batches.len()];
    // Like JAX's timed loop: one step, then wait until its update has finished on the device.
    let mut times = Vec::with_capacity(steps);
    for i in 0..steps {
        let t = Instant::now();
        run.step_deferred(next(i), 32)?;
        run.wait()?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    run.take_losses()?;
    // One step whose loss is read back each time (waits for the gradient only).
    let mut read = Vec::with_capacity(steps);
    let mut loss = 0.0;
    for i in 0..steps {
        let t = Instant::now();
        loss = run.step(next(i), 32)?.loss;
        read.push(t.elapsed().as_secs_f64() * 1e6);
    }
    // How an epoch runs: steps enqueued back to back, losses read at the end.
    let t = Instant::now();
    for i in 0..steps {
        run.step_deferred(next(i), 32)?;
    }
    run.wait()?;
    let pipelined = t.elapsed().as_secs_f64() * 1e6 / steps as f64;
    run.take_losses()?;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let p10 = {
        let mut v = times.clone();
        v.sort_by(f64::total_cmp);
        v[v.len() / 10]
    };
    let (median, read_median) = (median(times), median(read));
    let dispatch = trivial_dispatch_us(steps)?.map_or("null".to_owned(), |us| format!("{us:.1}"));
    println!(
        "{{\"bench\": \"step\", \"backend\": {:?}, \"steps\": {steps}, \"step_us_median\": {median:.1}, \
         \"step_us_p10\": {p10:.1}, \"loss_read_step_us_median\": {read_median:.1}, \"pipelined_step_us\": {pipelined:.1}, \"first_step_ms\": {first_step_ms:.1}, \"compile_ms\": {:.1}, \"compile_ms_by_program\": {}, \"trivial_dispatch_us\": {dispatch}, \
         \"final_loss\": {loss:.4}, \"cache\": {}}}",
        backend.identity().description,
        run.compile_time().as_secs_f64() * 1e3,
        serde_json::Value::Object(per_program),
        serde_json::to_string(&nitro::cache::cache_stats())?
    );
    Ok(())
}

/// The median time of one execute of a trivial program (`x + 1` on a scalar already on the
/// device), waited for: the runtime's own cost per execute. `None` without XLA.
fn trivial_dispatch_us(calls: usize) -> Result<Option<f64>, Box<dyn std::error::Error>> {
    let Ok(client) = nitro::backend::pjrt::client() else {
        return Ok(None);
    };
    let scalar = nitro::LeafType {
        dtype: nitro::DType::F32,
        dims: Vec::new(),
    };
    let graph = nitro::trace::trace(&[("x".into(), scalar)], |x| vec![x[0] + 1.0])?;
    let text = nitro::emit::emit(&graph);
    let exe = client.compile(&text, &graph.input_types(), &graph.output_types())?;
    let x = client.upload(&Array::scalar(0.0f32))?;
    exe.execute(&[&x])?;
    let mut times = Vec::with_capacity(calls);
    for _ in 0..calls {
        let t = Instant::now();
        std::hint::black_box(exe.execute(&[&x])?);
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    Ok(Some(times[times.len() / 2]))
}
