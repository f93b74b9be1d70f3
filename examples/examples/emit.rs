//! Traces the digits MLP's gradient program, prints its StableHLO as the backend compiles it
//! (`Program::trace_for`) and how long tracing and emission took, then runs it on the reference interpreter and, when a PJRT plugin is
//! installed, on XLA: the loss and gradient norms of both side by side, their largest
//! difference, XLA's compile time and its time per execute (from host arrays, and on buffers
//! kept on the device).
//!
//! `cargo run --release -p nitro-examples --example emit`

use std::time::{Duration, Instant};

use nitro::Array;

use nitro_examples::report::Summary;
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

    // The program as the backend compiles it (`trace_for`): with its rewrites, such as a CPU
    // plugin's half-precision dots widened to f32 (none here: this model is f32). Without a
    // backend, the program as written (`trace`). Either warms up once (first-touch
    // allocations) before several traces are timed.
    let traced = match nitro::backend::current() {
        Ok(backend) => GRAD.trace_for(&exp, &batch, backend)?,
        Err(_) => GRAD.trace(&exp, &batch)?,
    };
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

    // The run's arguments in the traced program's input order: Device leaves, then the batch.
    let inputs: Vec<Array> = GRAD.arguments(&exp, &batch).into_iter().cloned().collect();
    let start = Instant::now();
    let out = nitro::backend::interp::run(&traced.graph, &inputs)?;
    let first = start.elapsed();
    const INTERP_RUNS: u32 = 20;
    let start = Instant::now();
    for _ in 0..INTERP_RUNS {
        std::hint::black_box(nitro::backend::interp::run(&traced.graph, &inputs)?);
    }
    println!(
        "interpreter  loss {:.6}, first run {:.3} ms, then {:.3} ms per run (mean of {INTERP_RUNS})",
        out[0].as_slice::<f32>()?[0],
        first.as_secs_f64() * 1e3,
        (start.elapsed() / INTERP_RUNS).as_secs_f64() * 1e3
    );

    // The outputs are the mean loss, then the gradient of each layer leaf, in input order.
    let mut names = vec!["loss".to_owned()];
    names.extend(
        traced
            .inputs
            .leaves()
            .take(out.len().saturating_sub(1))
            .map(|(path, _)| format!("d loss / d {path}")),
    );
    let xla = run_on_xla(&traced.graph, &traced.text, &inputs, &out, &names)?;

    let backend = nitro::backend::current()?;
    let mut summary = Summary::new("emit", backend)
        .field("program", GRAD.identity())
        .field("nodes", traced.graph.nodes.len())
        .field("stablehlo_bytes", traced.text.len())
        .field("fingerprint", traced.fingerprint.to_string())
        .field("trace_emit_ms", trace_and_emit.as_secs_f64() * 1e3);
    if let Some(x) = xla {
        summary = summary
            .field("compile_ms_total", x.compile_ms)
            .field("grad_execute_us", x.execute_us)
            .field("max_abs_diff", x.max_diff);
    }
    println!("{summary}");
    Ok(())
}

/// What the XLA run measured.
struct XlaFigures {
    compile_ms: f64,
    /// Mean execute time on device buffers.
    execute_us: f64,
    /// The largest difference from the interpreter over every output element.
    max_diff: f64,
}

/// Compiles and runs the program on XLA when [`nitro::backend::current`] is XLA, comparing with
/// the interpreter's outputs `want`; says so in one line otherwise.
fn run_on_xla(
    graph: &nitro::trace::Graph,
    text: &str,
    inputs: &[Array],
    want: &[Array],
    names: &[String],
) -> Result<Option<XlaFigures>, Box<dyn std::error::Error>> {
    let backend = match nitro::backend::current() {
        Ok(b) => b,
        Err(e) => {
            println!("XLA          not available: {e}");
            return Ok(None);
        }
    };
    let start = Instant::now();
    let exe = backend.compile(graph, text)?;
    let compile = start.elapsed();
    let Some(xla) = exe.as_pjrt() else {
        println!(
            "XLA          not available (no PJRT plugin installed, or NITRO_BACKEND=interp; \
             `pip install --no-deps lammps-jax-pjrt-cpu==0.11.2` installs one); ran on {}",
            backend.identity().description
        );
        return Ok(None);
    };
    println!("XLA          {}", backend.identity().description);

    let refs: Vec<&Array> = inputs.iter().collect();
    let start = Instant::now();
    let got = exe.run(&refs)?;
    let first = start.elapsed();

    println!(
        "{:<28} {:>16} {:>16} {:>12}",
        "output (value or L2 norm)", "interpreter", "XLA", "max |diff|"
    );
    let mut max_diff = 0f64;
    for ((name, w), g) in names.iter().zip(want).zip(&got) {
        let (w, g) = (w.as_slice::<f32>()?, g.as_slice::<f32>()?);
        let diff = w
            .iter()
            .zip(g)
            .map(|(a, b)| (f64::from(*a) - f64::from(*b)).abs())
            .fold(0.0, f64::max);
        max_diff = max_diff.max(diff);
        let show = |v: &[f32]| {
            if v.len() == 1 {
                f64::from(v[0])
            } else {
                v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt()
            }
        };
        println!(
            "{name:<28} {:>16.9} {:>16.9} {diff:>12.3e}",
            show(w),
            show(g)
        );
    }
    println!("max |interpreter - XLA| over every output element: {max_diff:.3e}");

    const RUNS: u32 = 100;
    let host = mean_of(RUNS, || xla.execute_host(&refs).map(drop))?;
    let client = xla.client();
    let buffers = inputs
        .iter()
        .map(|a| client.upload(a))
        .collect::<nitro::Result<Vec<_>>>()?;
    let buffer_refs: Vec<_> = buffers.iter().collect();
    xla.execute(&buffer_refs)?; // warm, like the host path's first run
    let device = mean_of(RUNS, || xla.execute(&buffer_refs).map(drop))?;
    // The first execute in a process also pays XLA's one-time setup (tens of ms on CPU).
    println!(
        "XLA compile  {:.1} ms; first execute {:.3} ms",
        compile.as_secs_f64() * 1e3,
        first.as_secs_f64() * 1e3
    );
    println!(
        "XLA execute  {:.1} us from host arrays (upload + run + copy back), {:.1} us on \
         device buffers (outputs left on the device); mean of {RUNS}",
        host.as_secs_f64() * 1e6,
        device.as_secs_f64() * 1e6
    );
    Ok(Some(XlaFigures {
        compile_ms: compile.as_secs_f64() * 1e3,
        execute_us: device.as_secs_f64() * 1e6,
        max_diff,
    }))
}

/// The mean time of `runs` calls of `f`.
fn mean_of(runs: u32, mut f: impl FnMut() -> nitro::Result<()>) -> nitro::Result<Duration> {
    let start = Instant::now();
    for _ in 0..runs {
        f()?;
    }
    Ok(start.elapsed() / runs)
}
