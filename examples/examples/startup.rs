//! What a fresh process pays before its first step: backend init, phase by phase, and the
//! first execute of a program against the second.
//!
//! Prints one JSON line (milliseconds):
//!
//! - `discover`: finding the plugin file (`NITRO_PJRT_PLUGIN`, or python3's site-packages);
//! - `load`: `dlopen` and `PJRT_Plugin_Initialize`;
//! - `client`: creating the PJRT client;
//! - `identity`: the backend identity, mostly the plugin file's blake3 digest;
//! - `init`: the sum: what `nitro::backend::current()` costs a fresh process;
//! - `compile`, `execute_1`, `execute_2`, `execute_3`: a small program (a 256×256 matrix
//!   product and `tanh`) compiled
//!   and run three times on host arrays;
//! - `threads_before_execute`, `threads_after_executes`: the process's thread count (Linux),
//!   which shows whether the first execute starts threads; `page_faults_per_execute`: minor
//!   page faults during each execute (Linux); `second_executable_execute_1` (with
//!   `--serialized`, when loaded): the first execute of a second executable of the same
//!   program, loaded after the first one ran — per-executable first-run work shows here.
//!
//! `--serialized FILE` loads the program from FILE when it exists (`compile` is then the
//! deserialize, as in a warm start from the persistent cache) and writes it there otherwise.
//! `--init-only` stops after init (for profiling it). Run it several times: the first run of a machine fills the start-up memo
//! (`<cache dir>/backend.json`), the later ones show a warm process.
//!
//! `cargo run --release -p nitro-examples --example startup` (from the workspace root).

use std::time::Instant;

use nitro::backend::{self, pjrt};
use nitro::{Array, DType, LeafType};

const MLIR: &str = "func.func public @main(%a: tensor<256x256xf32>, %b: tensor<256x256xf32>) -> tensor<256x256xf32> {
  %0 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<256x256xf32>, tensor<256x256xf32>) -> tensor<256x256xf32>
  %1 = stablehlo.tanh %0 : tensor<256x256xf32>
  return %1 : tensor<256x256xf32>
}";

fn ms(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e6).round() / 1e3
}

/// This process's minor page faults so far (Linux; 0 elsewhere).
fn minor_faults() -> u64 {
    // Field 10 of /proc/self/stat, counted after the command name (which may hold spaces).
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1.to_owned();
            rest.split_whitespace().nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

/// This process's thread count (Linux; 0 elsewhere).
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!(
            "What a fresh process pays before its first step: backend start-up phase by phase, \
             then a small program compiled and run three times. Prints one JSON line \
             (milliseconds).\n\n\
             Usage: startup [--serialized FILE] [--init-only]\n\n  \
             --serialized FILE  load the program from FILE when it exists, else compile it and \
             write it there\n  \
             --init-only        stop after the backend's start-up"
        );
        return Ok(());
    }
    let t = Instant::now();
    let path = pjrt::Discovery::from_env()?
        .find()?
        .ok_or("no PJRT plugin found: `pip install --no-deps lammps-jax-pjrt-cpu==0.11.2`")?;
    let discover = ms(t);
    let t = Instant::now();
    let plugin = pjrt::Plugin::load(&path)?;
    let load = ms(t);
    let t = Instant::now();
    let client = pjrt::client()?;
    let client_ms = ms(t);
    let t = Instant::now();
    let xla = backend::xla()?;
    let identity = ms(t);
    let init = discover + load + client_ms + identity;
    let mut report = serde_json::json!({
        "discover": discover,
        "load": load,
        "client": client_ms,
        "identity": identity,
        "init": (init * 1e3).round() / 1e3,
    });
    if std::env::args().any(|a| a == "--init-only") {
        println!("{report}");
        return Ok(());
    }

    let ty = LeafType {
        dtype: DType::F32,
        dims: vec![256, 256],
    };
    // `--serialized FILE`: load the program from FILE when it exists (as a warm start from the
    // persistent cache does), else compile it and write FILE.
    let serialized = std::env::args()
        .skip_while(|a| a != "--serialized")
        .nth(1)
        .map(std::path::PathBuf::from);
    let t = Instant::now();
    let (exe, loaded) = match serialized.as_deref().filter(|p| p.exists()) {
        Some(path) => (client.deserialize(&std::fs::read(path)?)?, true),
        None => {
            let exe = client.compile(MLIR, &[ty.clone(), ty.clone()], &[ty])?;
            if let Some(path) = &serialized {
                std::fs::write(path, exe.serialize()?)?;
            }
            (exe, false)
        }
    };
    let compile = ms(t);
    let threads_before_execute = threads();
    let a = Array::full(&[256, 256], 0.5f32);
    let mut runs = Vec::new();
    let mut thread_counts = Vec::new();
    let mut faults = Vec::new();
    for _ in 0..3 {
        let before = minor_faults();
        let t = Instant::now();
        exe.execute_host(&[&a, &a])?;
        runs.push(ms(t));
        faults.push(minor_faults() - before);
        thread_counts.push(threads());
    }
    // A second executable of the same program, loaded now: does its first execute pay again
    // (per-executable work, like lazy linking) or not (per-process warm-up)?
    let second_first_execute = match serialized.as_deref().filter(|_| loaded) {
        Some(path) => {
            let again = client.deserialize(&std::fs::read(path)?)?;
            let t = Instant::now();
            again.execute_host(&[&a, &a])?;
            Some(ms(t))
        }
        None => None,
    };
    let _ = (plugin, xla);
    let more = serde_json::json!({
        "compile": compile,
        "loaded": loaded,
        "execute_1": runs[0],
        "execute_2": runs[1],
        "execute_3": runs[2],
        "threads_before_execute": threads_before_execute,
        "threads_after_executes": thread_counts,
        "page_faults_per_execute": faults,
        "second_executable_execute_1": second_first_execute,
    });
    if let (Some(all), serde_json::Value::Object(more)) = (report.as_object_mut(), more) {
        all.extend(more);
    }
    println!("{report}");
    Ok(())
}
