//! XLA through the PJRT C API: load a plugin, compile StableHLO text, run it on device buffers.
//!
//! ```no_run
//! use nitro::backend::pjrt;
//! use nitro::{Array, DType, LeafType};
//!
//! let t = LeafType { dtype: DType::F32, dims: vec![3] };
//! let exe = pjrt::compile(
//!     "func.func public @main(%a: tensor<3xf32>, %b: tensor<3xf32>) -> tensor<3xf32> {
//!        %0 = stablehlo.add %a, %b : tensor<3xf32>
//!        return %0 : tensor<3xf32>
//!      }",
//!     &[t.clone(), t.clone()],
//!     &[t],
//! )?;
//! let a = Array::from_vec(&[3], vec![1.0f32, 2.0, 3.0])?;
//! let out = exe.execute_host(&[&a, &a])?;
//! assert_eq!(out[0].as_slice::<f32>()?, &[2.0, 4.0, 6.0]);
//! # Ok::<(), nitro::Error>(())
//! ```
//!
//! # Pieces
//!
//! - [`Plugin`]: a loaded plugin file ([`Plugin::load`]), found by [`Discovery`] (see the
//!   [`plugin`] module for the search order) and chosen by [`selected`] (`NITRO_BACKEND`).
//! - [`Client`]: compiles ([`Client::compile`]), uploads ([`Client::upload`]) and loads
//!   serialized executables ([`Client::deserialize`]). [`client()`] is the process-wide one.
//! - [`Executable`]: runs on [`DeviceBuffer`]s ([`Executable::execute`],
//!   [`Executable::execute_donating`]) or host arrays ([`Executable::execute_host`]); every
//!   argument's dtype and dims are checked against the declared inputs **before** XLA sees it,
//!   because XLA itself checks only byte sizes and would silently reinterpret an `f32[3,2]` as an
//!   `f32[2,3]`.
//! - [`BackendIdentity`]: plugin file digest, API version, platform, CPU features and compile
//!   options: what a compile-cache key needs besides the program. Serialized executables carry
//!   it and are refused by a client of another identity.
//!
//! # Safety at the boundary
//!
//! This module is the only place in nitro with `unsafe` code. The C API is declared by hand in
//! `ffi` for API version 0.81; every function pointer is read only after checking that the
//! plugin's table covers it and that it is non-null. Every PJRT error is turned into a typed
//! [`Error`] and destroyed; every event is awaited and destroyed; every object is
//! destroyed by its owner's `Drop`. No Rust callback is ever handed to the plugin, so no panic
//! can unwind through C. Compile options are always the valid minimal
//! `CompileOptionsProto` [`COMPILE_OPTIONS`] (empty options abort the process inside XLA).
#![allow(unsafe_code)]

mod buffer;
mod client;
mod executable;
mod ffi;
mod identity;
pub mod plugin;
pub mod xla_flags;

use std::sync::{Mutex, OnceLock};

pub use buffer::DeviceBuffer;
pub use client::{devices_setting, Client, CPU_DEVICES_ENV, DEVICES_ENV};
pub use executable::{serialized_identity, Arg, Completion, Executable, Executed};
pub use identity::{cpu_features, plugin_file_digest, BackendIdentity};
pub use plugin::{
    Discovery, KnownPlugin, Platform, Plugin, Source, StartupMemo, KNOWN_PLUGINS, STARTUP_MEMO_FILE,
};

use crate::error::{Error, Result};
use crate::tree::LeafType;

/// The serialized `xla.CompileOptionsProto` passed to every compile of a one-device program:
/// `executable_build_options { num_replicas: 1, num_partitions: 1 }`, the same bytes as
/// [`compile_options`]`(1)`. Both fields are required; empty options abort the process inside
/// XLA.
pub const COMPILE_OPTIONS: &[u8] = &[0x1a, 0x04, 0x20, 0x01, 0x28, 0x01];

/// The serialized `xla.CompileOptionsProto` for a program replicated over `replicas` devices:
/// `executable_build_options` (field 3) holding `num_replicas` (field 4) = `replicas` and
/// `num_partitions` (field 5) = 1. Data parallelism here is replication — every device runs the
/// whole program on its share of the batch, and `all_reduce` sums across them — so no SPMD
/// partitioner is involved and nitro's own autodiff sees an ordinary program.
///
/// ```
/// use nitro::backend::pjrt::{compile_options, COMPILE_OPTIONS};
/// assert_eq!(compile_options(1), COMPILE_OPTIONS);
/// assert_eq!(compile_options(4), [0x1a, 0x04, 0x20, 0x04, 0x28, 0x01]);
/// // 300 needs a two-byte varint, so the nested message grows by one byte.
/// assert_eq!(compile_options(300), [0x1a, 0x05, 0x20, 0xac, 0x02, 0x28, 0x01]);
/// ```
pub fn compile_options(replicas: usize) -> Vec<u8> {
    build_options(replicas, 1, false)
}

/// The serialized `xla.CompileOptionsProto` for a program that XLA's SPMD partitioner splits
/// over `partitions` devices (partition `p` on device `p`), its shardings written in Shardy's
/// dialect (`sdy.mesh`, `sdy.sharding`): `executable_build_options` holding `num_replicas` = 1,
/// `num_partitions` (field 5) = `partitions`, `use_spmd_partitioning` (field 6) and
/// `use_shardy_partitioner` (field 19). These are the fields JAX 0.10.2 sets for a sharded
/// `jit` on CPU host devices (`bench/spmd_spike/FINDINGS.md`); without field 6 XLA refuses
/// the partitions, and without field 19 it refuses a Shardy result sharding.
///
/// ```
/// use nitro::backend::pjrt::spmd_compile_options;
/// assert_eq!(
///     spmd_compile_options(4),
///     [0x1a, 0x09, 0x20, 0x01, 0x28, 0x04, 0x30, 0x01, 0x98, 0x01, 0x01]
/// );
/// ```
pub fn spmd_compile_options(partitions: usize) -> Vec<u8> {
    build_options(1, partitions, true)
}

/// `executable_build_options` with these counts, and SPMD (with Shardy) when `spmd`.
fn build_options(replicas: usize, partitions: usize, spmd: bool) -> Vec<u8> {
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8 & 0x7f) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    // Field 4 (num_replicas) and field 5 (num_partitions), both varints (wire type 0).
    let mut build = vec![0x20];
    varint(&mut build, replicas.max(1) as u64);
    build.push(0x28);
    varint(&mut build, partitions.max(1) as u64);
    if spmd {
        // Field 6 (use_spmd_partitioning) and field 19 (use_shardy_partitioner), both true.
        build.extend_from_slice(&[0x30, 0x01, 0x98, 0x01, 0x01]);
    }
    // Field 3 (executable_build_options), length-delimited (wire type 2).
    let mut out = vec![0x1a];
    varint(&mut out, build.len() as u64);
    out.extend_from_slice(&build);
    out
}

/// The environment variable choosing the backend: `xla` (or `pjrt`), `interp`, or unset/`auto`.
pub const BACKEND_ENV: &str = "NITRO_BACKEND";

/// The PJRT plugin the environment selects, loaded and initialized.
///
/// - `NITRO_BACKEND` unset, empty or `auto`: the discovered plugin ([`Discovery::from_env`]), or
///   `Ok(None)` when none is installed (the caller falls back to the interpreter; this logs one
///   INFO line saying so, once per process). A plugin that is found but broken is an error.
/// - `NITRO_BACKEND=xla` (or `pjrt`): the discovered plugin, and an error
///   ([`Error::PjrtPluginNotFound`]) when none is installed.
/// - `NITRO_BACKEND=interp`: `Ok(None)`.
/// - anything else: [`Error::BackendSetting`].
pub fn selected() -> Result<Option<&'static Plugin>> {
    let value = std::env::var(BACKEND_ENV).unwrap_or_default();
    let required = match value.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => false,
        "xla" | "pjrt" => true,
        "interp" => return Ok(None),
        _ => {
            return Err(Error::BackendSetting {
                variable: BACKEND_ENV,
                value,
                accepted: "`xla` (a PJRT plugin, required), `interp` (the reference \
                           interpreter), or unset (XLA when a plugin is installed, else the \
                           interpreter)",
            })
        }
    };
    let discovery = Discovery::from_env()?;
    match discovery.find()? {
        Some(path) => Plugin::load(path).map(Some),
        // A platform the user asked for explicitly is required too: no silent fallback.
        None if required || discovery.platform.is_some() => Err(discovery.not_found()),
        None => {
            static SAID: OnceLock<()> = OnceLock::new();
            SAID.get_or_init(|| {
                tracing::info!(
                    "no PJRT plugin found, so programs run on the reference interpreter; \
                     `pip install --no-deps lammps-jax-pjrt-cpu==0.11.2` installs XLA for CPU"
                )
            });
            Ok(None)
        }
    }
}

/// The process-wide client on the [`selected`] plugin, created on first use (later calls return
/// the same client). Errors when no plugin is selected: none installed, or `NITRO_BACKEND=interp`.
/// A failed creation is not remembered: the next call tries again.
pub fn client() -> Result<&'static Client> {
    static CLIENT: OnceLock<Client> = OnceLock::new();
    static CREATING: Mutex<()> = Mutex::new(());
    if let Some(c) = CLIENT.get() {
        return Ok(c);
    }
    let _guard = CREATING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = CLIENT.get() {
        return Ok(c);
    }
    let plugin = match selected()? {
        Some(p) => p,
        None if std::env::var(BACKEND_ENV)
            .is_ok_and(|v| v.trim().eq_ignore_ascii_case("interp")) =>
        {
            return Err(Error::BackendSetting {
                variable: BACKEND_ENV,
                value: "interp".into(),
                accepted: "`xla`, or unset it, to use XLA (`interp` selects the reference \
                           interpreter, which has no PJRT client)",
            })
        }
        None => return Err(Discovery::from_env()?.not_found()),
    };
    let created = Client::new(plugin)?;
    Ok(CLIENT.get_or_init(|| created))
}

/// A client with at least `devices` devices on the [`selected`] plugin: the process-wide
/// [`client()`] when it has enough, else (on a CPU plugin) a client of its own with `devices`
/// devices, created once per process and count. [`Error::Devices`] when the plugin's platform
/// cannot be asked for more devices (a GPU plugin has the devices its machine has).
pub fn client_for(devices: usize) -> Result<&'static Client> {
    let default = client()?;
    if devices <= default.device_count() {
        return Ok(default);
    }
    if !default.platform_name().eq_ignore_ascii_case("cpu") {
        return Err(Error::Devices {
            what: "a training handle".into(),
            requested: devices,
            reason: format!(
                "the {} plugin's client has {} device(s); ask for at most that many",
                default.platform_name(),
                default.device_count()
            ),
        });
    }
    static MORE: Mutex<Vec<&'static Client>> = Mutex::new(Vec::new());
    let mut more = MORE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = more.iter().find(|c| c.device_count() >= devices) {
        return Ok(c);
    }
    let created = Client::with_cpu_devices(default.plugin(), devices)?;
    if created.device_count() < devices {
        return Err(Error::Devices {
            what: "a training handle".into(),
            requested: devices,
            reason: format!(
                "the CPU plugin made a client of {} device(s) when asked for {devices}",
                created.device_count()
            ),
        });
    }
    // Clients live as long as the process, like the process-wide one: executables and buffers
    // hold them, and there is one per device count asked for.
    let created: &'static Client = Box::leak(Box::new(created));
    more.push(created);
    Ok(created)
}

/// Compiles StableHLO text on the process-wide [`client()`]; see [`Client::compile`].
pub fn compile(mlir: &str, inputs: &[LeafType], outputs: &[LeafType]) -> Result<Executable> {
    client()?.compile(mlir, inputs, outputs)
}

/// One line describing the XLA backend this process uses: plugin path, C API version, platform
/// name and version, device count; or why there is none.
pub fn describe() -> String {
    match client() {
        Ok(c) => c.describe(),
        Err(e) => format!("XLA via PJRT: unavailable: {e}"),
    }
}
