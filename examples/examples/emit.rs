//! Traces the digits MLP's gradient program, prints its StableHLO and how long tracing and
//! emission took, then runs it on the reference interpreter.
//!
//! `cargo run --release -p nitro-examples --example emit`

use std::time::Instant;

use nitro_examples::{data, glorot, Activation, Arch, Batch, DigitsMlp, GRAD};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let data = data::Digits::load(data::DIGITS_PATH)?;
    let arch = Arch {
        widths: vec![64, 128, 10],
        activation: Activation::Tanh,
    };
    let exp = DigitsMlp {
        layers: glorot(&arch.widths, 1),
        arch,
        lr: nitro::Array::scalar(0.1f32),
        data,
    };
    let batch = Batch::slice(&exp.data, 0, 32);

    // Warm up once (first-touch allocations), then time several traces.
    let traced = GRAD.trace(&exp, &batch)?;
    const RUNS: u32 = 50;
    let start = Instant::now();
    for _ in 0..RUNS {
        std::hint::black_box(GRAD.trace(&exp, &batch)?);
    }
    let trace_and_emit = start.elapsed() / RUNS;
    let start = Instant::now();
    for _ in 0..RUNS {
        std::hint::black_box(nitro::emit::emit(&traced.graph));
    }
    let emit_only = start.elapsed() / RUNS;

    println!("{}", traced.text);
    println!("program      {}", GRAD.identity());
    println!("inputs       {}", traced.inputs);
    println!(
        "outputs      {}",
        traced
            .outputs
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "nodes        {} ({} bytes of StableHLO)",
        traced.graph.nodes.len(),
        traced.text.len()
    );
    println!("fingerprint  {}", traced.fingerprint);
    println!(
        "trace + emit {:.3} ms (emit alone {:.3} ms), mean of {RUNS}",
        trace_and_emit.as_secs_f64() * 1e3,
        emit_only.as_secs_f64() * 1e3
    );

    let mut inputs = Vec::new();
    exp.visit_device_leaves(&mut inputs);
    inputs.push(batch.x.clone());
    inputs.push(batch.y.clone());
    let start = Instant::now();
    let out = nitro::backend::interp::run(&traced.graph, &inputs)?;
    println!(
        "interpreter  loss {:.6}, {:.3} ms",
        out[0].as_slice::<f32>()?[0],
        start.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

trait DeviceLeaves {
    fn visit_device_leaves(&self, out: &mut Vec<nitro::Array>);
}

impl DeviceLeaves for DigitsMlp {
    fn visit_device_leaves(&self, out: &mut Vec<nitro::Array>) {
        use nitro::Experiment;
        self.visit_device(&mut |_, _, node| {
            if let nitro::Node::Leaf(a) = node {
                out.push(a.clone());
            }
        });
    }
}
