//! The nitro twin of `bench/ops_jax.py`: a 3×3 convolution, a 2×2/2 max-pool and average pool,
//! an embedding gather and a `[1024, 1024]·[1024, 4096]` matmul (with `gflop_per_s`: the
//! machine's dot rate, the roof of a dot-bound step), each forward + backward
//! (`loss = Σ out ⊙ cot` and its gradients, the forward kept:
//! JAX's `--with-value` lines), traced, emitted, compiled by XLA and executed on device-resident
//! buffers. One JSON line per workload with the same fields as the JAX script:
//!
//! - `trace_emit_ms`: tracing the value-and-gradient program and emitting its StableHLO (JAX's
//!   `lower_ms` counterpart), median of 5;
//! - `compile_ms`: XLA's compile of that text, median of 5 fresh compiles (no cache);
//! - `execute_us_median` / `execute_us_min`: one finished forward + backward on buffers already on
//!   the device, after 3 warm-up runs, over `--runs` runs (default 20).
//!
//! `cargo run --release -p nitro-examples --example ops_bench [-- --workload conv --runs 20 --dump DIR]`
//!
//! Compare the figures only as ratios with the JAX script run on the same machine at the same
//! time. `--dump DIR` writes each program's StableHLO to `DIR/nitro_<workload>.mlir`.

use std::time::Instant;

use clap::Parser;
use nitro::backend::Backend;
use nitro::trace::{self, grad, Conv, Tensor, Window};
use nitro::{Array, LeafType};

/// Times single ops — a convolution, max and average pooling, a matmul, an embedding gather —
/// each forward and backward through XLA, one JSON line per workload, for comparison with
/// `bench/ops_jax.py` run on the same machine.
#[derive(Parser)]
#[command(name = "ops_bench")]
struct Args {
    /// One workload (conv, maxpool, avgpool, matmul, gather); all of them when absent.
    #[arg(long)]
    workload: Option<String>,
    /// Timed executes per workload.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// A directory for the emitted StableHLO.
    #[arg(long)]
    dump: Option<std::path::PathBuf>,
}

/// A workload: its inputs and the scalar loss over them; gradients are taken w.r.t. `wrt`.
struct Workload {
    name: &'static str,
    inputs: Vec<Array>,
    wrt: Vec<usize>,
    loss: fn(&[Tensor]) -> Tensor,
    /// The forward + backward's multiply-add flops, for a rate (`gflop_per_s`), where counted.
    flops: Option<f64>,
}

fn filled(dims: &[usize], seed: u32) -> Array {
    let n: usize = dims.iter().product();
    // A cheap deterministic pattern in [-1, 1): the values do not affect the timings.
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let h = (i as u32)
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503));
            (h >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect();
    Array::from_vec(dims, v).expect("dims and data agree")
}

fn workloads() -> Vec<Workload> {
    let ids: Vec<i32> = (0..8 * 512)
        .map(|i| ((i as u64 * 7919) % 50_000) as i32)
        .collect();
    vec![
        Workload {
            name: "conv",
            inputs: vec![
                filled(&[64, 28, 28, 16], 1),
                filled(&[3, 3, 16, 32], 2),
                filled(&[64, 28, 28, 32], 3),
            ],
            wrt: vec![0, 1],
            loss: |x| {
                let conv = Conv::channels_last(2).same_for(&[28, 28], &[3, 3]);
                (x[0].conv(x[1], &conv) * x[2]).sum_all()
            },
            flops: None,
        },
        Workload {
            name: "maxpool",
            inputs: vec![filled(&[64, 28, 28, 32], 4), filled(&[64, 14, 14, 32], 5)],
            wrt: vec![0],
            loss: |x| {
                let w = Window::new(&[1, 2, 2, 1]).strides(&[1, 2, 2, 1]);
                (x[0].window_max(&w) * x[1]).sum_all()
            },
            flops: None,
        },
        Workload {
            name: "avgpool",
            inputs: vec![filled(&[64, 28, 28, 32], 11), filled(&[64, 14, 14, 32], 12)],
            wrt: vec![0],
            loss: |x| {
                let w = Window::new(&[1, 2, 2, 1]).strides(&[1, 2, 2, 1]);
                (x[0].window_sum(&w) * 0.25 * x[1]).sum_all()
            },
            flops: None,
        },
        Workload {
            name: "matmul",
            inputs: vec![
                filled(&[1024, 1024], 8),
                filled(&[1024, 4096], 9),
                filled(&[1024, 4096], 10),
            ],
            wrt: vec![0, 1],
            loss: |x| (x[0].matmul(x[1]) * x[2]).sum_all(),
            // The forward dot and its two gradient dots, 2·M·K·N each.
            flops: Some(3.0 * 2.0 * 1024.0 * 1024.0 * 4096.0),
        },
        Workload {
            name: "gather",
            inputs: vec![
                filled(&[50_000, 512], 6),
                Array::from_vec(&[8, 512], ids).expect("dims and data agree"),
                filled(&[8, 512, 512], 7),
            ],
            wrt: vec![0],
            loss: |x| (x[0].take(x[1], 0) * x[2]).sum_all(),
            flops: None,
        },
    ]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let xla = match nitro::backend::xla() {
        Ok(x) => x,
        Err(e) => {
            println!("skip: ops_bench needs the XLA backend: {e}");
            return Ok(());
        }
    };
    for w in workloads() {
        if args.workload.as_deref().is_some_and(|name| name != w.name) {
            continue;
        }
        let types: Vec<(String, LeafType)> = w
            .inputs
            .iter()
            .enumerate()
            .map(|(i, a)| (format!("x{i}"), a.leaf_type()))
            .collect();
        let program = || -> nitro::Result<(trace::Graph, String)> {
            let graph = trace::trace(&types, |x| {
                let loss = (w.loss)(x);
                let wrt: Vec<Tensor> = w.wrt.iter().map(|&i| x[i]).collect();
                let mut outs = vec![loss];
                outs.extend(grad(loss, &wrt));
                outs
            })?;
            let text = nitro::emit::emit(&graph);
            Ok((graph, text))
        };
        let mut emit_ms = Vec::new();
        let mut built = None;
        for _ in 0..5 {
            let start = Instant::now();
            let p = program()?;
            emit_ms.push(start.elapsed().as_secs_f64() * 1e3);
            built = Some(p);
        }
        let (graph, text) = built.expect("five traces ran");
        if let Some(dir) = &args.dump {
            std::fs::create_dir_all(dir)?;
            std::fs::write(dir.join(format!("nitro_{}.mlir", w.name)), &text)?;
        }
        let mut compile_ms = Vec::new();
        let mut exe = None;
        for _ in 0..5 {
            let start = Instant::now();
            let e = xla.compile(&graph, &text)?;
            compile_ms.push(start.elapsed().as_secs_f64() * 1e3);
            exe = Some(e);
        }
        let exe = exe.expect("five compiles ran");
        let pjrt = exe
            .as_pjrt()
            .ok_or("the XLA backend gave a non-PJRT executable")?;
        let client = pjrt.client();
        let buffers = w
            .inputs
            .iter()
            .map(|a| client.upload(a))
            .collect::<nitro::Result<Vec<_>>>()?;
        let refs: Vec<_> = buffers.iter().collect();
        for _ in 0..3 {
            drop(pjrt.execute(&refs)?);
        }
        let mut times = Vec::with_capacity(args.runs);
        for _ in 0..args.runs.max(1) {
            let start = Instant::now();
            // `execute` returns once the device has finished: a run is a finished step.
            drop(pjrt.execute(&refs)?);
            times.push(start.elapsed().as_secs_f64() * 1e6);
        }
        let min = times.iter().copied().fold(f64::INFINITY, f64::min);
        let loss = pjrt.execute(&refs)?[0].to_host()?;
        let execute_us = median(times);
        let rate = w
            .flops
            .map(|f| format!(", \"gflop_per_s\": {:.1}", f / execute_us / 1e3))
            .unwrap_or_default();
        println!(
            "{{\"workload\": \"{}\", \"trace_emit_ms\": {:.3}, \"compile_ms\": {:.3}, \"execute_us_median\": {:.1}, \"execute_us_min\": {:.1}, \"runs\": {}, \"nodes\": {}, \"stablehlo_bytes\": {}, \"loss\": {}{rate}}}",
            w.name,
            median(emit_ms),
            median(compile_ms),
            execute_us,
            min,
            args.runs.max(1),
            graph.nodes.len(),
            text.len(),
            loss.as_slice::<f32>()?[0]
        );
    }
    Ok(())
}
