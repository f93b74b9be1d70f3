//! Helpers shared by the integration tests: a scratch directory, the XLA backend or a `skip:`,
//! signature-change reasons, and a small experiment for store tests. Each test crate uses a
//! part.
#![allow(dead_code)]

pub mod probe;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A directory under the system temp dir, removed on drop (after restoring owner write
/// permission, which tests of untrusted directories take away).
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh, not yet created path tagged with `tag`, this process and a counter.
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "nitro-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&path);
        TempDir(path)
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = fs::set_permissions(&self.0, fs::Permissions::from_mode(0o700));
        }
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The XLA backend, or `None` after printing a `skip:` line when no plugin is installed; with
/// `NITRO_REQUIRE_XLA=1` a missing plugin fails the test instead.
pub fn xla_or_skip(test: &str) -> Option<&'static dyn nitro::backend::Backend> {
    match nitro::backend::xla() {
        Ok(x) => Some(x),
        Err(e) => {
            skip_unless_required(test, "NITRO_REQUIRE_XLA", "XLA is unavailable", &e);
            None
        }
    }
}

/// XLA's backend on `devices` devices, or `None` (after a `skip:` line) when XLA is unavailable
/// or its platform has fewer devices: a CPU client makes as many as asked, a GPU machine has
/// the GPUs it has (one, say), which no setting changes. On CPU a refusal fails the test.
#[allow(dead_code)]
pub fn xla_devices_or_skip(test: &str, devices: usize) -> Option<&'static nitro::backend::Xla> {
    xla_or_skip(test)?;
    match nitro::backend::xla_for(devices) {
        Ok(x) => Some(x),
        Err(e @ nitro::Error::Devices { .. })
            if nitro::backend::pjrt::client().is_ok_and(|c| c.platform_name() != "cpu") =>
        {
            println!("skip: {test}: this machine's accelerators cannot serve it: {e}");
            None
        }
        Err(e) => panic!("{test}: XLA on {devices} devices: {e}"),
    }
}

/// Prints a `skip:` line for `test` because `what` (`why`), or fails the test when the
/// environment variable `require` is `1` (CI, where the skip would hide a broken setup).
pub fn skip_unless_required(test: &str, require: &str, what: &str, why: &dyn std::fmt::Display) {
    let required = std::env::var(require).is_ok_and(|v| v.trim() == "1");
    assert!(!required, "{test}: {require}=1 but {what}: {why}");
    println!("skip: {test}: {why}");
}

/// A `signature_changed` reason from `(path, from, to)` triples, `""` for a side that lacks
/// the node (added or removed).
pub fn sigs(changes: &[(&str, &str, &str)]) -> nitro::cache::MissReason {
    let side = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    nitro::cache::MissReason::SignatureChanged {
        changes: changes
            .iter()
            .map(|(path, from, to)| nitro::SignatureChange {
                path: (*path).to_owned(),
                from: side(from),
                to: side(to),
            })
            .collect(),
    }
}

/// The shared server's URL, or `None` after a `skip:` line (a failure under
/// `NITRO_REQUIRE_REDIS=1`).
pub fn redis_or_skip(test: &str) -> Option<String> {
    match std::env::var("NITRO_TEST_REDIS") {
        Ok(url) if !url.trim().is_empty() => Some(url.trim().to_owned()),
        _ => {
            skip_unless_required(
                test,
                "NITRO_REQUIRE_REDIS",
                "there is no server",
                &"NITRO_TEST_REDIS is not set (no redis-server to test on)",
            );
            None
        }
    }
}

/// A namespace no other test (or earlier run) uses.
pub fn namespace(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("nitro-test-{tag}-{}-{nanos}", std::process::id())
}

/// The id of a process that has exited: what a writer killed mid-write leaves in the names of
/// its temporary files.
pub fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// Trace inputs named `x0`, `x1`, … of `types`.
pub fn named_inputs(types: &[nitro::LeafType]) -> Vec<(String, nitro::LeafType)> {
    types
        .iter()
        .enumerate()
        .map(|(i, t)| (format!("x{i}"), t.clone()))
        .collect()
}

/// The largest `|got − want|` over the elements of an `f32` array and the values it should
/// hold (in row-major order).
pub fn max_abs_diff(got: &nitro::Array, want: &[f32]) -> f32 {
    got.as_slice::<f32>()
        .expect("an f32 array")
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max)
}

/// A cache of its own for one handle (leaked: handles take `&'static`).
pub fn own_cache() -> &'static nitro::cache::Cache {
    Box::leak(Box::new(nitro::cache::Cache::in_memory(32)))
}

/// FSDP over a mesh of `devices` devices along `data`.
pub fn fsdp(devices: usize) -> nitro::train::Config {
    nitro::train::Config::new()
        .mesh(nitro::shard::Mesh::new([("data", devices)]).unwrap())
        .sharding(nitro::shard::Sharding::fsdp("data"))
}

/// The backend `config` asks for: partitioned over its mesh, else `one`.
pub fn backend_of(
    config: &nitro::train::Config,
    one: &'static dyn nitro::backend::Backend,
) -> &'static dyn nitro::backend::Backend {
    match config.partitioning().unwrap() {
        Some(p) => nitro::backend::for_mesh(&p).unwrap(),
        None => one,
    }
}

/// This process's peak resident set, in kB (Linux's `VmHWM`); `None` where the system does
/// not say.
pub fn peak_rss_kb() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The `name=value` figures a child process printed on its line after `figures: `
/// ([`child_figures`]).
pub struct Figures(pub String);

impl Figures {
    /// Figure `name`, failing the test when the line lacks it.
    pub fn get(&self, name: &str) -> u64 {
        self.0
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {}", self.0))
    }
}

/// Runs this test binary's test `test` again in a child process with `var=value` set (so
/// that its memory is its own), fails when the child fails, and returns the figures it
/// printed.
pub fn child_figures(test: &str, var: &str, value: &str) -> Figures {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(var, value)
        .output()
        .expect("the child runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("figures: ").map(|(_, rest)| rest.to_owned()))
        .unwrap_or_else(|| panic!("no figures in:\n{stdout}"));
    Figures(line)
}
