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
//! - `compile`, `execute_1`, `execute_2`, `execute_3`: a small element-wise program compiled
//!   and run three times on host arrays.
//!
//! Run it several times: the first run of a machine fills the start-up memo
//! (`<cache dir>/backend.json`), the later ones show a warm process.
//!
//! `cargo run --release -p nitro-examples --example startup` (from the workspace root).

use std::time::Instant;

use nitro::backend::{self, pjrt};
use nitro::{Array, DType, LeafType};

fn ms(t: Instant) -> f64 {
    (t.elapsed().as_secs_f64() * 1e6).round() / 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
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

    let ty = LeafType {
        dtype: DType::F32,
        dims: vec![256, 256],
    };
    let t = Instant::now();
    let exe = client.compile(
        "func.func public @main(%a: tensor<256x256xf32>, %b: tensor<256x256xf32>) -> tensor<256x256xf32> {
           %0 = stablehlo.multiply %a, %b : tensor<256x256xf32>
           %1 = stablehlo.tanh %0 : tensor<256x256xf32>
           return %1 : tensor<256x256xf32>
         }",
        &[ty.clone(), ty.clone()],
        &[ty],
    )?;
    let compile = ms(t);
    let a = Array::full(&[256, 256], 0.5f32);
    let mut runs = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        exe.execute_host(&[&a, &a])?;
        runs.push(ms(t));
    }
    let _ = (plugin, xla);
    println!(
        "{}",
        serde_json::json!({
            "discover": discover,
            "load": load,
            "client": client_ms,
            "identity": identity,
            "init": (init * 1e3).round() / 1e3,
            "compile": compile,
            "execute_1": runs[0],
            "execute_2": runs[1],
            "execute_3": runs[2],
        })
    );
    Ok(())
}
