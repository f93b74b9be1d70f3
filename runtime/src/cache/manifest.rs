//! Inventory manifests: the list of programs a run used, by fingerprint and store key, as a
//! JSON file — what `nitro cache pull --manifest FILE` fetches from a shared server into a
//! machine's local store (pre-warming a fleet before a sweep) and `nitro cache check --manifest
//! FILE` looks for. [`crate::train::Nitro::manifest`] writes one for a handle's inventory.
//!
//! ```json
//! {"format": 1, "programs": [
//!   {"role": "grad", "edge": 128, "program": "chargpt::CharGpt::nitro.grad",
//!    "fingerprint": "9f…", "key": "3a…"}]}
//! ```

use std::path::Path;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::hash::Digest;

/// The manifest format this version writes and reads.
pub const MANIFEST_FORMAT: u32 = 1;

/// A run's inventory: every program it used.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: u32,
    /// The programs, each once.
    pub programs: Vec<ManifestEntry>,
}

/// One program of a [`Manifest`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ManifestEntry {
    /// Its role in the handle's inventory (`grad`, `update`, `eval`, a metric's name).
    pub role: String,
    /// The bucket edge of its batches, if any.
    #[serde(default)]
    pub edge: Option<usize>,
    /// The program's identity.
    pub program: String,
    /// The traced program's fingerprint (64 hex digits).
    pub fingerprint: String,
    /// The persistent store's key of it on the run's backend (64 hex digits): what `pull`
    /// fetches and `check` looks for.
    pub key: String,
}

impl Manifest {
    /// An empty manifest of the current format.
    pub fn new() -> Manifest {
        Manifest {
            format: MANIFEST_FORMAT,
            programs: Vec::new(),
        }
    }

    /// Adds a program, unless one with its key is listed already.
    pub fn push(&mut self, entry: ManifestEntry) {
        if !self.programs.iter().any(|p| p.key == entry.key) {
            self.programs.push(entry);
        }
    }

    /// The store keys, in order.
    pub fn keys(&self) -> Vec<String> {
        self.programs.iter().map(|p| p.key.clone()).collect()
    }

    /// Writes the manifest to `path` as JSON, atomically; temporary files that killed writes of
    /// files of its extension left beside it are removed first.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = serde_json::to_vec_pretty(self)
            .map_err(|e| Error::data_file(path, format!("cannot encode the manifest: {e}")))?;
        Error::write_data_file(path, &bytes, false)
    }

    /// Reads a manifest; a file that is not one (or of another format, or whose keys are not
    /// 64 hex digits) is [`Error::DataFile`], saying so.
    pub fn read(path: impl AsRef<Path>) -> Result<Manifest> {
        let path = path.as_ref();
        let bytes = Error::read_data_file(path)?;
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| {
            Error::data_file(
                path,
                format!("not a nitro inventory manifest ({e}); write one with Nitro::manifest"),
            )
        })?;
        if m.format != MANIFEST_FORMAT {
            return Err(Error::data_file(
                path,
                format!(
                    "a manifest of format {}, and this nitro reads format {MANIFEST_FORMAT}",
                    m.format
                ),
            ));
        }
        if let Some(bad) = m
            .programs
            .iter()
            .find(|p| p.key.parse::<Digest>().is_err() || p.fingerprint.parse::<Digest>().is_err())
        {
            return Err(Error::data_file(
                path,
                format!(
                    "program `{}` has a key or fingerprint that is not 64 hex digits",
                    bad.program.escape_debug()
                ),
            ));
        }
        Ok(m)
    }
}

/// The persistent store's key of a traced program with `fingerprint` on `backend` (with its
/// compile options): what the store files it under, and what a manifest lists.
pub fn store_key(backend: &dyn Backend, fingerprint: &Digest) -> Digest {
    super::l2_key(backend, fingerprint)
}
