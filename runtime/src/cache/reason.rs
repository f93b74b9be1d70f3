//! Why a lookup missed: every miss names what moved.

use std::fmt;

/// The reason of a cache miss. Each variant names what moved, so a recompile can always be
/// explained — and a user can match on it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "reason")]
pub enum MissReason {
    /// This program was never compiled here (in this cache since its last reset). A new
    /// process that loads the program from the persistent store reports `empty` too: the
    /// `loaded` flag of the miss says it was not compiled.
    Empty,
    /// The GraphConst digest moved; these fields' digests changed (a handle setting that shapes
    /// the program appears as `<handle>`).
    GraphConstChanged {
        /// The fields whose content digests differ.
        fields: Vec<String>,
    },
    /// A Device leaf's shape or dtype moved (a ragged batch, a new width).
    SignatureChanged {
        /// The leaf's path.
        leaf: String,
        /// Its previous type.
        from: String,
        /// Its new type.
        to: String,
    },
    /// Same program, config and signature, but a different emitted program: the code changed.
    CodeChanged {
        /// The fingerprint that was compiled before (short form).
        from: String,
        /// The fingerprint now (short form).
        to: String,
    },
    /// The plugin, API version, platform or CPU features differ.
    BackendChanged,
    /// The compile options differ.
    OptionsChanged,
    /// It was here, and capacity pushed it out: the key is in the eviction ledger (bounded by
    /// the capacity), or it is exactly the key the program last used. Once the ledger has
    /// forgotten a key that the program has moved away from since, the miss names what moved
    /// instead.
    Evicted,
}

impl MissReason {
    /// The reason's name, as in the stats' `misses_by_reason` (`graph_const_changed`, …).
    pub const fn name(&self) -> &'static str {
        match self {
            MissReason::Empty => "empty",
            MissReason::GraphConstChanged { .. } => "graph_const_changed",
            MissReason::SignatureChanged { .. } => "signature_changed",
            MissReason::CodeChanged { .. } => "code_changed",
            MissReason::BackendChanged => "backend_changed",
            MissReason::OptionsChanged => "options_changed",
            MissReason::Evicted => "evicted",
        }
    }
}

impl fmt::Display for MissReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MissReason::Empty => f.write_str("empty (never compiled here)"),
            MissReason::GraphConstChanged { fields } => {
                write!(f, "graph_const_changed: {}", fields.join(", "))
            }
            MissReason::SignatureChanged { leaf, from, to } => {
                write!(f, "signature_changed: {leaf} {from} → {to}")
            }
            MissReason::CodeChanged { from, to } => {
                write!(f, "code_changed: program {from} → {to}")
            }
            MissReason::BackendChanged => f.write_str("backend_changed"),
            MissReason::OptionsChanged => f.write_str("options_changed"),
            MissReason::Evicted => f.write_str("evicted (capacity)"),
        }
    }
}
