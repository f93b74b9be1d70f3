//! The PJRT client: one per plugin per process, in practice.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::tree::{Array, LeafType};

use super::buffer::DeviceBuffer;
use super::executable::Executable;
use super::ffi::{self, names, RawClient, RawDevice};
use super::identity::{cpu_features, BackendIdentity};
use super::plugin::Plugin;
use super::COMPILE_OPTIONS;

/// The PJRT client and what was read from it once. Shared (`Arc`) by every executable and buffer
/// made through it, so the client is destroyed only after all of them.
pub(crate) struct ClientInner {
    pub(crate) plugin: &'static Plugin,
    pub(crate) raw: *mut RawClient,
    /// The first addressable device: where buffers are put and one-device programs run.
    pub(crate) device: *mut RawDevice,
    /// Every addressable device, in the client's order: replica `r` of a replicated program
    /// runs on device `r`.
    pub(crate) devices: Vec<*mut RawDevice>,
    platform_name: String,
    platform_version: String,
    device_count: usize,
    identity: OnceLock<BackendIdentity>,
}

// SAFETY: a `PJRT_Client` is thread-safe: the PJRT C API lets any thread compile, upload and
// execute through one client concurrently (JAX does exactly that), and the device pointer is owned
// by the client and immutable. The Rust-side fields are immutable after construction (the
// identity is behind a `OnceLock`).
unsafe impl Send for ClientInner {}
// SAFETY: see `Send`.
unsafe impl Sync for ClientInner {}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let plugin = self.plugin;
        if let Some(f) = plugin.api.fns.client_destroy {
            let mut a = ffi::ClientDestroyArgs::new();
            a.client = self.raw;
            // SAFETY: the last `Arc` to this client is gone, so no executable or buffer of it is
            // alive; the client is destroyed exactly once, here.
            if let Err(e) = unsafe { plugin.api.check(names::client_destroy, f(&mut a)) } {
                tracing::debug!("ignoring a failure to destroy a PJRT client: {e}");
            }
        }
    }
}

/// A PJRT client on one plugin: compiles StableHLO text, uploads arrays, loads serialized
/// executables. Programs run on the client's first addressable device.
///
/// `Client` is `Send + Sync` (PJRT clients are thread-safe) and cheap to clone (a reference
/// count). The process-wide client on the selected plugin is [`client()`](super::client).
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<ClientInner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("plugin", &self.inner.plugin.path())
            .field("platform", &self.inner.platform_name)
            .finish()
    }
}

/// Copies a (pointer, length) string the plugin returned.
///
/// # Safety
/// `ptr` must be null or point to `len` readable bytes.
unsafe fn copy_str(ptr: *const u8, len: usize) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: caller's contract.
    String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(ptr, len) }).into_owned()
}

impl Client {
    /// Creates a client on `plugin` and reads its platform and devices. A CPU plugin gets the
    /// device count of `NITRO_DEVICES` (or `NITRO_PJRT_CPU_DEVICES`), 1 by default. Logs one
    /// INFO line.
    pub fn new(plugin: &'static Plugin) -> Result<Client> {
        Client::with_cpu_devices(plugin, cpu_device_setting()?)
    }

    /// Creates a client on `plugin` asking a CPU plugin for `cpu_devices` devices (plugins of
    /// other platforms have the devices their hardware has, and are created without the
    /// option). Logs one INFO line.
    pub fn with_cpu_devices(plugin: &'static Plugin, cpu_devices: usize) -> Result<Client> {
        let started = Instant::now();
        let create = plugin.func(plugin.api.fns.client_create, names::client_create)?;
        // A CPU plugin makes 4 devices unless told otherwise, each with its own threads; nitro
        // asks for the count it needs. Plugins of other platforms refuse the option (an unknown
        // name is an error), so they are created without it.
        let cpu_devices = cpu_devices.clamp(1, crate::backend::MAX_DEVICES) as i64;
        const OPTION: &str = "cpu_device_count";
        let mut option = ffi::NamedValue::new();
        option.name = OPTION.as_ptr();
        option.name_size = OPTION.len();
        option.kind = ffi::NAMED_VALUE_INT64;
        option.int64_value = cpu_devices;
        option.value_size = 1;
        let mut a = ffi::ClientCreateArgs::new();
        a.create_options = (&raw const option).cast();
        a.num_options = 1;
        // SAFETY: `a` is a valid `PJRT_Client_Create_Args` with one option (alive for the call)
        // and no callbacks.
        let with_option =
            without_stderr(|| unsafe { plugin.api.check(names::client_create, create(&mut a)) });
        if with_option.is_err() || a.client.is_null() {
            a = ffi::ClientCreateArgs::new();
            // SAFETY: a valid `PJRT_Client_Create_Args` with no options and no callbacks.
            unsafe { plugin.api.check(names::client_create, create(&mut a)) }?;
        }
        if a.client.is_null() {
            return Err(Error::Pjrt {
                call: names::client_create,
                code: "nitro",
                message: "the plugin returned no client and no error".into(),
            });
        }
        // From here on, dropping `inner` destroys the client.
        let mut inner = ClientInner {
            plugin,
            raw: a.client,
            device: std::ptr::null_mut(),
            devices: Vec::new(),
            platform_name: String::new(),
            platform_version: String::new(),
            device_count: 0,
            identity: OnceLock::new(),
        };
        if let Some(f) = plugin.api.fns.client_platform_name {
            let mut p = ffi::ClientPlatformNameArgs::new();
            p.client = inner.raw;
            // SAFETY: valid args for a live client.
            unsafe { plugin.api.check(names::client_platform_name, f(&mut p)) }?;
            // SAFETY: the name is owned by the client, alive; copied at once.
            inner.platform_name = unsafe { copy_str(p.platform_name, p.platform_name_size) };
        }
        if let Some(f) = plugin.api.fns.client_platform_version {
            let mut p = ffi::ClientPlatformVersionArgs::new();
            p.client = inner.raw;
            // SAFETY: valid args for a live client.
            unsafe { plugin.api.check(names::client_platform_version, f(&mut p)) }?;
            // SAFETY: the version is owned by the client, alive; copied at once.
            inner.platform_version =
                unsafe { copy_str(p.platform_version, p.platform_version_size) };
        }
        let devices = plugin.func(
            plugin.api.fns.client_addressable_devices,
            names::client_addressable_devices,
        )?;
        let mut d = ffi::ClientAddressableDevicesArgs::new();
        d.client = inner.raw;
        // SAFETY: valid args for a live client.
        unsafe {
            plugin
                .api
                .check(names::client_addressable_devices, devices(&mut d))
        }?;
        if d.num_addressable_devices == 0 || d.addressable_devices.is_null() {
            return Err(Error::Pjrt {
                call: names::client_addressable_devices,
                code: "nitro",
                message: "the client has no addressable device; check that the platform's \
                          hardware and driver are present"
                    .into(),
            });
        }
        // SAFETY: the plugin returned an array of `num_addressable_devices` (> 0) device
        // pointers owned by the client.
        inner.device = unsafe { *d.addressable_devices };
        // SAFETY: as above: `num_addressable_devices` pointers, owned by the client, copied.
        inner.devices =
            unsafe { std::slice::from_raw_parts(d.addressable_devices, d.num_addressable_devices) }
                .to_vec();
        inner.device_count = d.num_addressable_devices;
        let client = Client {
            inner: Arc::new(inner),
        };
        let (major, minor) = plugin.api_version();
        tracing::info!(
            plugin = %plugin.path().display(),
            api = %format!("{major}.{minor}"),
            platform = %client.inner.platform_name,
            platform_version = %client.inner.platform_version,
            devices = client.inner.device_count,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "PJRT client created"
        );
        Ok(client)
    }

    /// The plugin this client runs on.
    pub fn plugin(&self) -> &'static Plugin {
        self.inner.plugin
    }

    /// The platform name (`cpu`, `cuda`, …).
    pub fn platform_name(&self) -> &str {
        &self.inner.platform_name
    }

    /// The platform version string.
    pub fn platform_version(&self) -> &str {
        &self.inner.platform_version
    }

    /// How many devices the client can address (one-device programs run on the first; replica
    /// `r` of a replicated program runs on device `r`).
    pub fn device_count(&self) -> usize {
        self.inner.device_count
    }

    /// One line: plugin path, API version, platform name and version, device count.
    pub fn describe(&self) -> String {
        let (major, minor) = self.plugin().api_version();
        format!(
            "XLA via PJRT: plugin {} (C API {major}.{minor}), platform {} {}, {} device(s)",
            self.plugin().path().display(),
            self.platform_name(),
            self.platform_version(),
            self.device_count()
        )
    }

    /// The backend identity of programs replicated over `replicas` devices: the one-device
    /// [`identity`](Client::identity) with the compile options and device count of `replicas`.
    pub fn identity_for(&self, replicas: usize) -> Result<BackendIdentity> {
        let mut id = self.identity()?.clone();
        if replicas > 1 {
            id.replicas = replicas;
            id.compile_options_digest =
                crate::Digest::from(blake3::hash(&super::compile_options(replicas)));
        }
        Ok(id)
    }

    /// The identity of a backend on this client whose programs are partitioned over
    /// `partitions` devices by XLA's SPMD partitioner: what a serialized partitioned
    /// executable records (the SPMD compile options' digest, and the partition count).
    pub fn identity_partitioned(&self, partitions: usize) -> Result<BackendIdentity> {
        let mut id = self.identity()?.clone();
        id.replicas = partitions.max(1);
        id.compile_options_digest =
            crate::Digest::from(blake3::hash(&super::spmd_compile_options(partitions)));
        Ok(id)
    }

    /// An error unless the client has at least `replicas` devices.
    pub(crate) fn check_replicas(&self, replicas: usize) -> Result<()> {
        if replicas <= self.device_count() {
            return Ok(());
        }
        Err(Error::Devices {
            what: "a replicated program".into(),
            requested: replicas,
            reason: format!(
                "this {} client has {} device(s); on CPU, ask for more with \
                 `Config::devices` or `NITRO_DEVICES`",
                self.platform_name(),
                self.device_count()
            ),
        })
    }

    /// The backend identity (hashes the plugin file the first time: tens to hundreds of ms for a
    /// 200 MB plugin, once per process).
    pub fn identity(&self) -> Result<&BackendIdentity> {
        if let Some(id) = self.inner.identity.get() {
            return Ok(id);
        }
        let id = BackendIdentity {
            plugin_digest: self.plugin().digest()?,
            api_version: self.plugin().api_version(),
            platform_name: self.inner.platform_name.clone(),
            platform_version: self.inner.platform_version.clone(),
            cpu_features: cpu_features().to_owned(),
            compile_options_digest: crate::Digest::from(blake3::hash(COMPILE_OPTIONS)),
            replicas: 1,
            xla_flags: self.plugin().xla_flags().to_owned(),
        };
        Ok(self.inner.identity.get_or_init(|| id))
    }

    /// Compiles StableHLO MLIR text (the entry function is `@main`) for programs taking
    /// `inputs` and returning `outputs`, in order.
    ///
    /// The declared types are what every execute checks its arguments against (XLA itself only
    /// checks byte sizes); the outputs are checked against the compiled program here when the
    /// plugin can report them ([`Error::ProgramSignature`] on a mismatch). A program XLA rejects is
    /// [`Error::XlaCompile`], whose message starts with XLA's first error line
    /// (`-:LINE:COL: error: …`, pointing into `mlir`).
    ///
    /// Inputs marked `tf.aliasing_output` in the text may be donated: see
    /// [`Executable::execute_donating`].
    pub fn compile(
        &self,
        mlir: &str,
        inputs: &[LeafType],
        outputs: &[LeafType],
    ) -> Result<Executable> {
        Executable::compile(&self.inner, mlir, inputs, outputs, 1, false)
    }

    /// Compiles a program that runs as `replicas` copies at once, replica `r` on device `r`
    /// (its text declares `mhlo.num_replicas`; see [`compile_options`](super::compile_options)).
    /// [`Error::Devices`] when the client has fewer devices. Run it with
    /// [`Executable::enqueue_replicas`].
    pub fn compile_replicated(
        &self,
        mlir: &str,
        inputs: &[LeafType],
        outputs: &[LeafType],
        replicas: usize,
    ) -> Result<Executable> {
        self.check_replicas(replicas)?;
        Executable::compile(&self.inner, mlir, inputs, outputs, replicas.max(1), false)
    }

    /// Compiles a program that XLA's SPMD partitioner splits over `partitions` devices,
    /// partition `p` on device `p`: its text declares `mhlo.num_partitions` and a Shardy mesh,
    /// and its arguments, results and constraints carry `sdy.sharding`s (what JAX's sharded
    /// `jit` emits; see [`spmd_compile_options`](super::spmd_compile_options)). `inputs` and
    /// `outputs` are one device's shards; run it with [`Executable::enqueue_replicas`] or
    /// [`Executable::execute_host_replicas`], one list of shards per device. [`Error::Devices`]
    /// when the client has fewer devices.
    pub fn compile_partitioned(
        &self,
        mlir: &str,
        inputs: &[LeafType],
        outputs: &[LeafType],
        partitions: usize,
    ) -> Result<Executable> {
        self.check_replicas(partitions)?;
        Executable::compile(&self.inner, mlir, inputs, outputs, partitions.max(1), true)
    }

    /// Uploads an array to the first device.
    pub fn upload(&self, array: &Array) -> Result<DeviceBuffer> {
        DeviceBuffer::upload(&self.inner, array, 0)
    }

    /// Uploads an array to device `device` (see [`device_count`](Client::device_count)).
    pub fn upload_to(&self, array: &Array, device: usize) -> Result<DeviceBuffer> {
        if device >= self.device_count() {
            return Err(Error::Devices {
                what: format!("an upload to device {device}"),
                requested: device + 1,
                reason: format!("the client has {} device(s)", self.device_count()),
            });
        }
        DeviceBuffer::upload(&self.inner, array, device)
    }

    /// Loads an executable that [`Executable::serialize`] wrote, after checking that it was built
    /// by a backend with this client's identity ([`Error::BackendMismatch`] otherwise, without
    /// loading anything) and that its bytes are intact ([`Error::InvalidSerializedExecutable`]).
    pub fn deserialize(&self, bytes: &[u8]) -> Result<Executable> {
        Executable::deserialize(self, bytes)
    }
}

/// The variable that sets how many devices a CPU plugin's process-wide client has (default 1).
/// A handle asking for more devices ([`crate::train::Config::devices`]) gets a client of its
/// own with that many.
pub const CPU_DEVICES_ENV: &str = "NITRO_PJRT_CPU_DEVICES";

/// The variable that sets how many devices training handles use by default (and how many a
/// CPU plugin's process-wide client has), like [`CPU_DEVICES_ENV`], which it takes precedence
/// over.
pub const DEVICES_ENV: &str = "NITRO_DEVICES";

/// The device count asked for by [`DEVICES_ENV`] or [`CPU_DEVICES_ENV`]: `None` when neither
/// is set.
pub fn devices_setting() -> Result<Option<usize>> {
    for variable in [DEVICES_ENV, CPU_DEVICES_ENV] {
        match std::env::var(variable) {
            Err(_) => continue,
            Ok(v) if v.trim().is_empty() => continue,
            Ok(v) => {
                return match v.trim().parse::<usize>() {
                    Ok(n) if (1..=crate::backend::MAX_DEVICES).contains(&n) => Ok(Some(n)),
                    _ => Err(Error::InvalidSetting {
                        variable,
                        value: v,
                        expected: format!(
                            "a device count from 1 to {}",
                            crate::backend::MAX_DEVICES
                        ),
                    }),
                }
            }
        }
    }
    Ok(None)
}

/// The CPU device count of the process-wide client: [`devices_setting`], 1 when unset.
fn cpu_device_setting() -> Result<usize> {
    Ok(devices_setting()?.unwrap_or(1))
}

/// Runs `f` with the process's standard error pointed at `/dev/null`, then restores it: the CPU
/// plugin logs a line (and a warning that its logging is not initialized) when it takes the
/// device-count option, which would otherwise greet every run. Failures are returned as
/// errors, not logged, so nothing is lost but those lines (and anything another thread writes
/// to stderr in those few milliseconds). If stderr cannot be redirected, `f` runs as is.
fn without_stderr<T>(f: impl FnOnce() -> T) -> T {
    use std::io::Write;
    let _ = std::io::stderr().flush();
    let saved = rustix::io::dup(std::io::stderr()).ok();
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .ok();
    let redirected = match (&saved, &null) {
        (Some(_), Some(null)) => rustix::stdio::dup2_stderr(null).is_ok(),
        _ => false,
    };
    let out = f();
    if let (true, Some(saved)) = (redirected, &saved) {
        let _ = rustix::stdio::dup2_stderr(saved);
    }
    out
}
