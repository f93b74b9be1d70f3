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

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use crate::error::{Error, Result};
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
/// once per process. Empty when there is no `python3` or it fails.
pub fn site_packages() -> &'static [PathBuf] {
    static DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DIRS.get_or_init(|| {
        const SCRIPT: &str = "import site\n\
            dirs = list(site.getsitepackages())\n\
            try:\n    dirs.append(site.getusersitepackages())\n\
            except Exception:\n    pass\n\
            print('\\n'.join(dirs))";
        let out = std::process::Command::new("python3")
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
    })
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
    /// nitro needs, or a failing `PJRT_Plugin_Initialize`.
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
            _library: library,
        })
    }

    /// The plugin file (canonical path).
    pub fn path(&self) -> &Path {
        &self.path
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
