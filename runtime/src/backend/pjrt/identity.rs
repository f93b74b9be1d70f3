//! What makes a compiled executable valid to reuse: the backend identity.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

use crate::error::{Error, Result};
use crate::hash::{ContentHash, ContentHasher, Digest};

/// Everything besides the program that decides what a compiled executable is, and so whether a
/// serialized one may be loaded here: the plugin **file** (its digest, not its path or version
/// string: two builds can share a version and differ in code), the PJRT API version, the platform,
/// the host CPU's features (XLA CPU code is compiled for the host's instruction set), the
/// compile options and the `XLA_FLAGS` the plugin started under.
///
/// A serialized executable carries the identity of the client that built it, and
/// [`Client::deserialize`](super::Client::deserialize) refuses one whose identity differs from
/// its own ([`Error::BackendMismatch`]), so native code from another plugin or CPU is never loaded.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct BackendIdentity {
    /// blake3 of the plugin file's bytes.
    pub plugin_digest: Digest,
    /// `PJRT_Api.pjrt_api_version` of the plugin: (major, minor).
    pub api_version: (i32, i32),
    /// The client's platform name (`cpu`, `cuda`, …).
    pub platform_name: String,
    /// The client's platform version string.
    pub platform_version: String,
    /// The host CPU: architecture and the instruction-set features it has, sorted
    /// (`x86_64: aes,avx,avx2,…`).
    pub cpu_features: String,
    /// blake3 of the serialized compile options nitro passes.
    pub compile_options_digest: Digest,
    /// How many devices the program runs on at once, one replica each (1 unless the program is
    /// replicated; see [`compile_options`](super::compile_options)). Absent in executables
    /// serialized before replication existed, which were all for one device.
    #[serde(default = "one")]
    pub replicas: usize,
    /// The `XLA_FLAGS` the plugin started under, normalized (tokens joined by one space; empty
    /// when unset): XLA's debug options (optimization level, fast math, …) change the code it
    /// generates. Absent in executables serialized before it was recorded, which were built
    /// without it only if nobody set it — the case the default stands for.
    #[serde(default)]
    pub xla_flags: String,
}

fn one() -> usize {
    1
}

impl BackendIdentity {
    /// The digest that compile-cache keys hold.
    pub fn digest(&self) -> Digest {
        Digest::of(self)
    }

    /// The components, named, in a fixed order: plugin file digest, PJRT API version,
    /// platform name and version, CPU features, the device count programs run on, the
    /// compile options and `XLA_FLAGS`.
    pub fn components(&self) -> Vec<(&'static str, String)> {
        vec![
            ("plugin file digest", self.plugin_digest.to_string()),
            (
                "PJRT API version",
                format!("{}.{}", self.api_version.0, self.api_version.1),
            ),
            ("platform name", self.platform_name.clone()),
            ("platform version", self.platform_version.clone()),
            ("CPU features", self.cpu_features.clone()),
            // The devices a program runs on: one per replica (devices 0..replicas of the
            // client, in order), one partition. Before the compile options, which follow from
            // it, so that a changed count is named as such.
            ("devices", self.replicas.to_string()),
            ("compile options", self.compile_options_digest.to_string()),
            ("XLA_FLAGS", format!("{:?}", self.xla_flags)),
        ]
    }

    /// The first component that differs from `other`, as `(name, self's value, other's value)`;
    /// `None` when the identities are equal.
    pub fn first_difference(
        &self,
        other: &BackendIdentity,
    ) -> Option<(&'static str, String, String)> {
        self.components()
            .into_iter()
            .zip(other.components())
            .find(|((_, a), (_, b))| a != b)
            .map(|((name, a), (_, b))| (name, a, b))
    }
}

impl ContentHash for BackendIdentity {
    fn content_hash(&self, h: &mut ContentHasher) {
        h.write_str("nitro.pjrt.BackendIdentity.v1");
        h.write_digest(&self.plugin_digest);
        h.write_u32(self.api_version.0 as u32);
        h.write_u32(self.api_version.1 as u32);
        h.write_str(&self.platform_name);
        h.write_str(&self.platform_version);
        h.write_str(&self.cpu_features);
        h.write_digest(&self.compile_options_digest);
        // One-device identities hash as they did before replication existed, so their cache
        // entries stay valid.
        if self.replicas != 1 {
            h.write_str("replicas");
            h.write_u64(self.replicas as u64);
        }
        // Likewise identities without XLA_FLAGS.
        if !self.xla_flags.is_empty() {
            h.write_str("XLA_FLAGS");
            h.write_str(&self.xla_flags);
        }
    }
}

/// The host CPU's architecture and instruction-set features, computed once.
///
/// On x86-64 this is the list of features `std::arch::is_x86_feature_detected!` reports present
/// (the ones XLA's CPU backend can generate code for); elsewhere, the `flags`/`Features` line of
/// `/proc/cpuinfo`, sorted. The arch name always comes first.
pub fn cpu_features() -> &'static str {
    static FEATURES: OnceLock<String> = OnceLock::new();
    FEATURES.get_or_init(|| {
        let mut list = detected_features();
        list.sort();
        list.dedup();
        format!("{}: {}", std::env::consts::ARCH, list.join(","))
    })
}

#[cfg(target_arch = "x86_64")]
fn detected_features() -> Vec<String> {
    let mut out = Vec::new();
    macro_rules! probe {
        ($($f:tt),*) => {$(
            if std::arch::is_x86_feature_detected!($f) {
                out.push($f.to_owned());
            }
        )*};
    }
    probe!(
        "aes",
        "pclmulqdq",
        "rdrand",
        "rdseed",
        "tsc",
        "mmx",
        "sse",
        "sse2",
        "sse3",
        "ssse3",
        "sse4.1",
        "sse4.2",
        "sse4a",
        "sha",
        "avx",
        "avx2",
        "avx512f",
        "avx512cd",
        "avx512er",
        "avx512pf",
        "avx512bw",
        "avx512dq",
        "avx512vl",
        "avx512ifma",
        "avx512vbmi",
        "avx512vpopcntdq",
        "avx512vbmi2",
        "gfni",
        "vaes",
        "vpclmulqdq",
        "avx512vnni",
        "avx512bitalg",
        "avx512bf16",
        "avx512vp2intersect",
        "avx512fp16",
        "f16c",
        "fma",
        "bmi1",
        "bmi2",
        "abm",
        "lzcnt",
        "tbm",
        "popcnt",
        "fxsr",
        "xsave",
        "xsaveopt",
        "xsaves",
        "xsavec",
        "cmpxchg16b",
        "adx",
        "rtm",
        "movbe",
        "ermsb"
    );
    out
}

#[cfg(not(target_arch = "x86_64"))]
fn detected_features() -> Vec<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            matches!(k.trim(), "flags" | "Features").then(|| v.to_owned())
        })
        .map(|v| v.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// blake3 of a plugin file, memoized by (path, size, modification time) in this process, so a
/// process hashes each plugin once and a replaced file is hashed again, and across processes by
/// the [`StartupMemo`](super::plugin::StartupMemo) (`backend.json` beside the compile cache).
pub fn plugin_file_digest(path: &Path) -> Result<Digest> {
    type Key = (PathBuf, u64, Option<SystemTime>);
    static MEMO: OnceLock<Mutex<HashMap<Key, Digest>>> = OnceLock::new();
    let io_err = |e: std::io::Error| Error::PjrtPlugin {
        path: path.to_path_buf(),
        reason: format!("cannot read the file to compute its digest: {e}"),
    };
    let meta = std::fs::metadata(path).map_err(io_err)?;
    let key: Key = (path.to_path_buf(), meta.len(), meta.modified().ok());
    let memo = MEMO.get_or_init(Default::default);
    if let Some(d) = memo.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(*d);
    }
    // Across processes: the start-up memo beside the compile cache.
    let digest = match super::plugin::StartupMemo::from_env() {
        Some(persisted) => persisted.file_digest(path)?.0,
        None => super::plugin::hash_file(path)?,
    };
    memo.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, digest);
    Ok(digest)
}
