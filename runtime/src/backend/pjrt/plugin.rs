//! Finding and loading PJRT plugins.
//!
//! # Discovery order
//!
//! 1. `NITRO_PJRT_PLUGIN=/path/to/plugin.so`: that file, and nothing else (a missing or broken file
//!    is an error, never a silent fallback).
//! 2. The known plugin files of PyPI packages, inside the site-packages directories of the
//!    `python3` on `PATH` (asked once per process: `site.getsitepackages()` and
//!    `site.getusersitepackages()`), in the order of [`KNOWN_PLUGINS`]: the CPU plugins first
//!    (newest XLA first), then the CUDA ones.
//!
//!    `NITRO_PJRT_PLATFORM` narrows the search: `cpu` takes only CPU plugins, `cuda` only CUDA
//!    plugins (so a machine with both installed can pick its GPU, and asking for `cuda` where none
//!    is installed is an error rather than a slow CPU run). Unset, CPU comes first: a CPU plugin
//!    works on every machine and compiles in milliseconds, while a CUDA plugin needs a GPU and its
//!    driver, so it is chosen only when it is the only one installed or when asked for.
//! 3. Otherwise there is no plugin.
//!
//! Plugins are loaded once per path and never unloaded: XLA keeps process-wide state (thread
//! pools, registrations, exit handlers) that unloading the library would leave dangling.
//!
//! # The start-up memo
//!
//! Asking `python3` for its site-packages (tens of milliseconds to start an interpreter) and
//! hashing the plugin file (a few hundred megabytes) are the slow parts of backend init, and
//! their answers rarely change. [`StartupMemo`] keeps both across processes in
//! `backend.json` beside the compile cache (in `NITRO_CACHE_DIR`, else the default cache
//! directory; not kept when `NITRO_CACHE=off`):
//!
//! - python3's site-packages, keyed by the interpreter found on `PATH` (its path, size,
//!   modification and change times, inode and device) and the environment variables that move
//!   site-packages (`HOME`, `PYTHONHOME`, `PYTHONUSERBASE`, `PYTHONNOUSERSITE`, `VIRTUAL_ENV`,
//!   `CONDA_PREFIX`, `PYENV_VERSION`). Discovery still looks for the plugin files in those
//!   directories in every process, so `NITRO_PJRT_PLUGIN`, `NITRO_PJRT_PLATFORM` and installed
//!   or removed plugins take effect at once; when the remembered directories hold no known
//!   plugin, python3 is asked again.
//! - each plugin file's blake3 digest, keyed by its path, size, modification and change times
//!   (nanoseconds), inode and device: a replaced or rewritten file is hashed again.
//!
//! The memo is written atomically, owner-only, and read only from a directory and file the
//! compile cache would trust (see [`crate::cache::DirStore`]); a file someone else could have
//! written, or one that does not parse, is ignored (the work is redone) and rewritten — never an
//! error.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result};
use crate::files;
use crate::hash::Digest;

use super::ffi::{self, Api};

/// The environment variable naming a plugin file to use.
pub const PLUGIN_ENV: &str = "NITRO_PJRT_PLUGIN";
/// The environment variable choosing the platform of discovered plugins (`cpu` or `cuda`).
pub const PLATFORM_ENV: &str = "NITRO_PJRT_PLATFORM";

/// The hardware a plugin compiles for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Platform {
    /// XLA's CPU backend.
    Cpu,
    /// NVIDIA GPUs through CUDA.
    Cuda,
}

impl Platform {
    /// Parses `cpu` / `cuda` (any case).
    pub fn parse(text: &str) -> Option<Platform> {
        match text.trim().to_ascii_lowercase().as_str() {
            "cpu" => Some(Platform::Cpu),
            "cuda" | "gpu" => Some(Platform::Cuda),
            _ => None,
        }
    }
}

/// A PJRT plugin file that a PyPI package installs.
#[derive(Clone, Copy, Debug)]
pub struct KnownPlugin {
    /// The pip requirement that installs it (install with `pip install --no-deps …`).
    pub package: &'static str,
    /// The file's path relative to site-packages.
    pub file: &'static str,
    /// What it compiles for.
    pub platform: Platform,
}

/// The plugin files discovery looks for, in order of preference.
pub const KNOWN_PLUGINS: &[KnownPlugin] = &[
    KnownPlugin {
        package: "lammps-jax-pjrt-cpu==0.11.2",
        file: "lammps_jax_pjrt_cpu/pjrt_c_api_cpu_plugin.so",
        platform: Platform::Cpu,
    },
    KnownPlugin {
        package: "fastatomstruct-xla-cpu==2026.6.23",
        file: "fastatomstruct_xla_cpu/libpjrt_cpu.so",
        platform: Platform::Cpu,
    },
    KnownPlugin {
        package: "xla-cpu-pjrt==0.0.1",
        file: "xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so",
        platform: Platform::Cpu,
    },
    KnownPlugin {
        package: "jax-cuda13-pjrt",
        file: "jax_plugins/xla_cuda13/xla_cuda_plugin.so",
        platform: Platform::Cuda,
    },
    KnownPlugin {
        package: "jax-cuda12-pjrt",
        file: "jax_plugins/xla_cuda12/xla_cuda_plugin.so",
        platform: Platform::Cuda,
    },
];

/// The site-packages directories of the `python3` on `PATH` (system ones, then the user's), asked
/// once per process — or remembered from an earlier process by the [`StartupMemo`]. Empty when
/// there is no `python3` or it fails.
pub fn site_packages() -> &'static [PathBuf] {
    static DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DIRS.get_or_init(|| {
        let Some(python) = find_on_path("python3") else {
            return Vec::new();
        };
        match StartupMemo::from_env() {
            Some(memo) => memo.site_packages(&python).0,
            None => ask_python(&python),
        }
    })
}

/// The first executable file called `name` in the directories of `PATH`, as a shell would
/// find it (the path as found: a symbolic link is not resolved, so a virtual environment's
/// interpreter stays itself).
fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| d.join(name))
        .find(|p| is_executable(p))
}

#[cfg(unix)]
fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(not(unix))]
fn is_executable(p: &Path) -> bool {
    p.is_file()
}

/// Asks the interpreter at `python` for its site-packages directories (system ones, then the
/// user's). Empty when it fails.
fn ask_python(python: &Path) -> Vec<PathBuf> {
    const SCRIPT: &str = "import site\n\
        dirs = list(site.getsitepackages())\n\
        try:\n    dirs.append(site.getusersitepackages())\n\
        except Exception:\n    pass\n\
        print('\\n'.join(dirs))";
    let out = std::process::Command::new(python)
        .args(["-c", SCRIPT])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}

/// Where and how to look for a plugin. [`Discovery::from_env`] reads the environment; tests and
/// tools can build one by hand.
#[derive(Clone, Debug, Default)]
pub struct Discovery {
    /// An explicit plugin file (`NITRO_PJRT_PLUGIN`): used alone when set.
    pub explicit: Option<PathBuf>,
    /// Only plugins of this platform (`NITRO_PJRT_PLATFORM`); `None`: CPU first, then CUDA.
    pub platform: Option<Platform>,
    /// The directories to search for [`KNOWN_PLUGINS`].
    pub site_dirs: Vec<PathBuf>,
}

impl Discovery {
    /// The search the environment asks for: `NITRO_PJRT_PLUGIN`, `NITRO_PJRT_PLATFORM`, and the
    /// site-packages of `python3` (only asked when no explicit plugin is set).
    pub fn from_env() -> Result<Discovery> {
        let explicit = std::env::var_os(PLUGIN_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        let platform = match std::env::var(PLATFORM_ENV) {
            Ok(v) if !v.trim().is_empty() => {
                Some(Platform::parse(&v).ok_or_else(|| Error::BackendSetting {
                    variable: PLATFORM_ENV,
                    value: v.clone(),
                    accepted: "`cpu` or `cuda` (or unset: CPU plugins first, then CUDA)",
                })?)
            }
            _ => None,
        };
        let site_dirs = if explicit.is_some() {
            Vec::new()
        } else {
            site_packages().to_vec()
        };
        Ok(Discovery {
            explicit,
            platform,
            site_dirs,
        })
    }

    /// Every existing known plugin file in the site directories, in preference order (the
    /// explicit file, when set, is the only candidate).
    pub fn candidates(&self) -> Vec<(PathBuf, Option<&'static KnownPlugin>)> {
        if let Some(p) = &self.explicit {
            return vec![(p.clone(), None)];
        }
        let order: &[Platform] = match self.platform {
            Some(Platform::Cpu) => &[Platform::Cpu],
            Some(Platform::Cuda) => &[Platform::Cuda],
            None => &[Platform::Cpu, Platform::Cuda],
        };
        let mut out: Vec<(PathBuf, Option<&'static KnownPlugin>)> = Vec::new();
        for platform in order {
            for known in KNOWN_PLUGINS.iter().filter(|k| k.platform == *platform) {
                for dir in &self.site_dirs {
                    let path = dir.join(known.file);
                    if path.is_file() && !out.iter().any(|(p, _)| *p == path) {
                        out.push((path, Some(known)));
                    }
                }
            }
        }
        out
    }

    /// The plugin file to use: the explicit one, or the first candidate; `None` when nothing is
    /// installed. An explicit path that does not exist is an error.
    pub fn find(&self) -> Result<Option<PathBuf>> {
        if let Some(p) = &self.explicit {
            if !p.is_file() {
                return Err(Error::PjrtPlugin {
                    path: p.clone(),
                    reason: format!("{PLUGIN_ENV} names it, but there is no such file"),
                });
            }
            return Ok(Some(p.clone()));
        }
        Ok(self.candidates().into_iter().next().map(|(p, _)| p))
    }

    /// The error for "nothing found", saying where this search looked.
    pub fn not_found(&self) -> Error {
        let dirs: Vec<String> = self
            .site_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        let platform = match self.platform {
            Some(Platform::Cpu) => " (CPU plugins only)",
            Some(Platform::Cuda) => " (CUDA plugins only)",
            None => "",
        };
        Error::PjrtPluginNotFound {
            searched: if dirs.is_empty() {
                format!("no python3 site-packages to search{platform}")
            } else {
                format!("searched {}{platform}", dirs.join(", "))
            },
        }
    }
}

/// A loaded PJRT plugin: the library, its checked function table and its API version.
///
/// Obtained from [`Plugin::load`] (a path) or [`selected`](super::selected) (discovery). Each
/// path is loaded and initialized once per process; the value lives for the rest of the process.
pub struct Plugin {
    path: PathBuf,
    pub(crate) api: Api,
    /// The `XLA_FLAGS` the plugin started under (normalized).
    xla_flags: String,
    // Kept so the library is never unloaded (the table's functions live in it).
    _library: libloading::Library,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("path", &self.path)
            .field("api_version", &self.api.version)
            .finish()
    }
}

impl Plugin {
    /// Loads the plugin file at `path` (once per canonical path per process), checks its function
    /// table and initializes it.
    ///
    /// Errors ([`Error::PjrtPlugin`]) for a missing file, a file that is not a shared library, a
    /// library without `GetPjrtApi`, a table of an unknown major version or lacking a function
    /// nitro needs, or a failing `PJRT_Plugin_Initialize`; [`Error::XlaFlags`] when `XLA_FLAGS`
    /// holds a token the plugin would end the process on (see [`xla_flags`](super::xla_flags)).
    pub fn load(path: impl AsRef<Path>) -> Result<&'static Plugin> {
        static LOADED: OnceLock<Mutex<HashMap<PathBuf, &'static Plugin>>> = OnceLock::new();
        let path = path.as_ref();
        let bad = |reason: String| Error::PjrtPlugin {
            path: path.to_path_buf(),
            reason,
        };
        if !path.is_file() {
            return Err(bad("there is no such file".into()));
        }
        let canonical = path
            .canonicalize()
            .map_err(|e| bad(format!("cannot resolve the path: {e}")))?;
        let loaded = LOADED.get_or_init(Default::default);
        // Held while loading, so two threads never initialize one plugin twice.
        let mut map = loaded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = map.get(&canonical) {
            return Ok(p);
        }
        let plugin = Plugin::open(&canonical)?;
        let plugin: &'static Plugin = Box::leak(Box::new(plugin));
        map.insert(canonical, plugin);
        Ok(plugin)
    }

    fn open(path: &Path) -> Result<Plugin> {
        let bad = |reason: String| Error::PjrtPlugin {
            path: path.to_path_buf(),
            reason,
        };
        let started = std::time::Instant::now();
        // Read before the plugin can: XLA parses it once, when the client starts, and exits
        // on a token it cannot parse.
        let xla_flags = super::xla_flags::xla_flags_setting();
        if !xla_flags.is_empty() {
            super::xla_flags::check_xla_flags(path, &xla_flags)?;
        }
        let library = open_library(path).map_err(|e| {
            bad(format!(
                "it is not a loadable shared library ({})",
                one_line(&e.to_string())
            ))
        })?;
        type GetPjrtApi = unsafe extern "C" fn() -> *const c_void;
        // SAFETY: `GetPjrtApi` is declared by the PJRT C API as `const PJRT_Api* GetPjrtApi(void)`;
        // the symbol is only called, never kept past the library's lifetime (the library is never
        // unloaded).
        let get: libloading::Symbol<'_, GetPjrtApi> = unsafe { library.get(b"GetPjrtApi\0") }
            .map_err(|_| bad("it does not export GetPjrtApi, so it is not a PJRT plugin".into()))?;
        // SAFETY: calling the plugin's exported entry point, which takes no arguments and returns
        // a pointer to its static function table.
        let raw = unsafe { get() };
        // SAFETY: `raw` is what `GetPjrtApi` returned; it stays valid while the library is loaded,
        // which is forever (the `Library` is kept in the leaked `Plugin`).
        let api = unsafe { Api::from_raw(raw, path) }?;
        let init = ffi::require(
            api.fns.plugin_initialize,
            ffi::names::plugin_initialize,
            &api,
            path,
        )?;
        let mut args = ffi::PluginInitializeArgs::new();
        // SAFETY: `args` is a valid `PJRT_Plugin_Initialize_Args`; initialize is called once per
        // plugin (the registry in `load` guarantees it).
        let initialized = unsafe { api.check(ffi::names::plugin_initialize, init(&mut args)) };
        initialized.map_err(|e| bad(format!("PJRT_Plugin_Initialize failed: {e}")))?;
        tracing::debug!(
            plugin = %path.display(),
            api = %format!("{}.{}", api.version.0, api.version.1),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "loaded PJRT plugin"
        );
        Ok(Plugin {
            path: path.to_path_buf(),
            api,
            xla_flags,
            _library: library,
        })
    }

    /// The plugin file (canonical path).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `XLA_FLAGS` value the plugin was loaded under, normalized (tokens joined by one
    /// space; empty when unset). See [`xla_flags`](super::xla_flags).
    pub fn xla_flags(&self) -> &str {
        &self.xla_flags
    }

    /// The PJRT C API version the plugin implements: (major, minor).
    pub fn api_version(&self) -> (i32, i32) {
        self.api.version
    }

    /// The size of the plugin's function table, in bytes (how much of the API it has).
    pub fn api_struct_size(&self) -> usize {
        self.api.struct_size
    }

    /// blake3 of the plugin file (memoized by path, size and modification time).
    pub fn digest(&self) -> Result<Digest> {
        super::identity::plugin_file_digest(&self.path)
    }

    /// The function, or [`Error::PjrtUnsupported`] naming it.
    pub(crate) fn func<F: Copy>(&self, f: Option<F>, name: &'static str) -> Result<F> {
        ffi::require(f, name, &self.api, &self.path)
    }
}

#[cfg(unix)]
fn open_library(path: &Path) -> std::result::Result<libloading::Library, libloading::Error> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: loading a shared library runs its initializers. The file is one the user pointed at
    // (NITRO_PJRT_PLUGIN or an argument) or a known PJRT plugin installed by pip; a file that is
    // not a library is rejected by the dynamic loader with an error. RTLD_NOW resolves every
    // symbol now, so a broken plugin fails here instead of at a later call.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map(Into::into)
}

#[cfg(not(unix))]
fn open_library(path: &Path) -> std::result::Result<libloading::Library, libloading::Error> {
    // SAFETY: as for unix: the file is a plugin the user chose; a non-library is an error.
    unsafe { libloading::Library::new(path) }
}

/// The first line of a message (dynamic-loader errors can be long).
fn one_line(s: &str) -> &str {
    s.lines().next().unwrap_or("").trim()
}

/// blake3 of a file's bytes, read in 1 MiB pieces.
pub(crate) fn hash_file(path: &Path) -> Result<Digest> {
    use std::io::Read;
    let io_err = |e: std::io::Error| Error::PjrtPlugin {
        path: path.to_path_buf(),
        reason: format!("cannot read the file to compute its digest: {e}"),
    };
    let mut file = std::fs::File::open(path).map_err(io_err)?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io_err)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(Digest::from(hasher.finalize()))
}

/// Whether a [`StartupMemo`] answer was remembered or worked out now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Read from the memo file: no interpreter was started, no file was hashed.
    Memo,
    /// Worked out now (and written to the memo).
    Computed,
}

/// Backend-init answers kept across processes: python3's site-packages and plugin file
/// digests, in one small JSON file (see the [module documentation](self#the-start-up-memo)).
///
/// [`StartupMemo::from_env`] is the one backend init uses; [`StartupMemo::at`] puts one
/// anywhere (tests, tools).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StartupMemo {
    path: PathBuf,
}

/// The memo file's name in the cache directory.
pub const STARTUP_MEMO_FILE: &str = "backend.json";
/// The format version written in the memo file; another one is ignored.
const MEMO_VERSION: u32 = 1;
/// The largest memo file read (it holds a few hundred bytes per plugin).
const MAX_MEMO_BYTES: u64 = 256 << 10;
/// At most this many plugin digests are kept (the most recently used).
const MAX_MEMO_DIGESTS: usize = 8;
/// The environment variables that change what python3 reports as site-packages.
const PYTHON_ENV: &[&str] = &[
    "HOME",
    "PYTHONHOME",
    "PYTHONUSERBASE",
    "PYTHONNOUSERSITE",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "PYENV_VERSION",
];

/// What identifies one version of a file without reading it: a rewritten, replaced or touched
/// file gets another stamp.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct FileStamp {
    path: PathBuf,
    size: u64,
    /// Modification time: (seconds, nanoseconds) since the Unix epoch.
    mtime: (i64, i64),
    /// Status change time (not settable by tools that preserve modification times).
    ctime: (i64, i64),
    inode: u64,
    device: u64,
}

impl FileStamp {
    fn of(path: &Path) -> std::io::Result<FileStamp> {
        let m = std::fs::metadata(path)?;
        #[cfg(unix)]
        let (mtime, ctime, inode, device) = {
            use std::os::unix::fs::MetadataExt;
            (
                (m.mtime(), m.mtime_nsec()),
                (m.ctime(), m.ctime_nsec()),
                m.ino(),
                m.dev(),
            )
        };
        #[cfg(not(unix))]
        let (mtime, ctime, inode, device) = {
            let t = m
                .modified()?
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            let t = (t.as_secs() as i64, i64::from(t.subsec_nanos()));
            (t, t, 0, 0)
        };
        Ok(FileStamp {
            path: path.to_path_buf(),
            size: m.len(),
            mtime,
            ctime,
            inode,
            device,
        })
    }
}

/// The memo file's contents.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct MemoFile {
    version: u32,
    site: Option<SiteMemo>,
    /// Most recently used first.
    digests: Vec<DigestMemo>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct SiteMemo {
    python: FileStamp,
    env: Vec<(String, Option<String>)>,
    dirs: Vec<PathBuf>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct DigestMemo {
    file: FileStamp,
    digest: Digest,
}

fn python_env() -> Vec<(String, Option<String>)> {
    PYTHON_ENV
        .iter()
        .map(|v| {
            let value = std::env::var_os(v).map(|s| s.to_string_lossy().into_owned());
            ((*v).to_owned(), value)
        })
        .collect()
}

impl StartupMemo {
    /// A memo kept in the file at `path` (its directory must be one the compile cache would
    /// trust, or the memo is not used).
    pub fn at(path: impl Into<PathBuf>) -> StartupMemo {
        StartupMemo { path: path.into() }
    }

    /// The memo beside the compile cache: [`STARTUP_MEMO_FILE`] in `NITRO_CACHE_DIR`, else in
    /// [`crate::cache::default_cache_dir`]. `None` when `NITRO_CACHE` is off (or not a valid
    /// switch) or there is no cache directory.
    pub fn from_env() -> Option<StartupMemo> {
        if crate::settings::switch("NITRO_CACHE").map_or(true, |on| on == Some(false)) {
            return None;
        }
        let dir = std::env::var_os("NITRO_CACHE_DIR")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(files::default_cache_dir)?;
        Some(StartupMemo::at(dir.join(STARTUP_MEMO_FILE)))
    }

    /// The memo file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The memo's contents when its directory and file can be trusted and it parses; `None`
    /// when the directory cannot be trusted (then nothing is read or written).
    fn load(&self) -> Option<MemoFile> {
        let dir = self.path.parent()?;
        files::private_dir(dir).ok()?;
        files::check_private_dir(dir).ok()?;
        let memo = files::read_private(&self.path, MAX_MEMO_BYTES)
            .and_then(|bytes| serde_json::from_slice::<MemoFile>(&bytes).ok())
            .filter(|m| m.version == MEMO_VERSION);
        Some(memo.unwrap_or_default())
    }

    /// Writes `memo` atomically, owner-only; a failure only costs the next process the work.
    fn store(&self, mut memo: MemoFile) {
        memo.version = MEMO_VERSION;
        memo.digests.truncate(MAX_MEMO_DIGESTS);
        let Ok(bytes) = serde_json::to_vec_pretty(&memo) else {
            return;
        };
        if let Err(e) = files::write_atomic(&self.path, &bytes, false) {
            tracing::debug!(
                "nitro: could not write the start-up memo ({} {}): {}",
                e.step,
                e.tmp.display(),
                e.source
            );
        }
    }

    /// blake3 of the file at `path`: remembered when the file's stamp (path, size, modification
    /// and change times, inode, device) is the one it was hashed at, else hashed now and
    /// remembered.
    pub fn file_digest(&self, path: &Path) -> Result<(Digest, Source)> {
        let stamp = FileStamp::of(path).map_err(|e| Error::PjrtPlugin {
            path: path.to_path_buf(),
            reason: format!("cannot read the file to compute its digest: {e}"),
        })?;
        let Some(mut memo) = self.load() else {
            return Ok((hash_file(path)?, Source::Computed));
        };
        if let Some(d) = memo.digests.iter().find(|d| d.file == stamp) {
            return Ok((d.digest, Source::Memo));
        }
        let digest = hash_file(path)?;
        // The file may have changed while it was read: remember only a stable stamp.
        if FileStamp::of(path).is_ok_and(|after| after == stamp) {
            memo.digests.retain(|d| d.file.path != stamp.path);
            memo.digests.insert(
                0,
                DigestMemo {
                    file: stamp,
                    digest,
                },
            );
            self.store(memo);
        }
        Ok((digest, Source::Computed))
    }

    /// The site-packages directories of the interpreter at `python`: remembered when its
    /// stamp and the site-related environment are the ones it was asked under and the
    /// remembered directories still hold a known plugin file; else asked now (and remembered
    /// when it answers).
    pub fn site_packages(&self, python: &Path) -> (Vec<PathBuf>, Source) {
        let Ok(stamp) = FileStamp::of(python) else {
            return (ask_python(python), Source::Computed);
        };
        let Some(mut memo) = self.load() else {
            return (ask_python(python), Source::Computed);
        };
        let env = python_env();
        if let Some(site) = &memo.site {
            let holds_plugin = || {
                KNOWN_PLUGINS
                    .iter()
                    .any(|k| site.dirs.iter().any(|d| d.join(k.file).is_file()))
            };
            if site.python == stamp && site.env == env && holds_plugin() {
                return (site.dirs.clone(), Source::Memo);
            }
        }
        let dirs = ask_python(python);
        if !dirs.is_empty() {
            memo.site = Some(SiteMemo {
                python: stamp,
                env,
                dirs: dirs.clone(),
            });
            self.store(memo);
        }
        (dirs, Source::Computed)
    }
}
