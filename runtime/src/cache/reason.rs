//! Why a lookup missed: every miss names what moved.

use std::fmt;

use crate::tree::SignatureChange;

/// How many signature changes a reason's text shows (all are kept).
const SHOWN_CHANGES: usize = 8;

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
    /// The structure of the inputs moved: a Device or input leaf's shape or dtype (a ragged
    /// batch, a new width), a sequence's length, an option's presence. Named by path: leaves
    /// added, removed and changed (`added layers[2].w f32[8,8]`).
    SignatureChanged {
        /// What differs, by path, in walk order.
        changes: Vec<SignatureChange>,
    },
    /// Same program, config and signature, but a different emitted program: the code changed.
    CodeChanged {
        /// The fingerprint that was compiled before (short form).
        from: String,
        /// The fingerprint now (short form).
        to: String,
    },
    /// The backend differs: plugin file, API version, platform, CPU features or device count.
    BackendChanged {
        /// The first component that differs (`plugin file digest`, `CPU features`, …).
        component: String,
        /// Its value before.
        from: String,
        /// Its value now.
        to: String,
    },
    /// On a mesh, how an input is split moved (a [`Sharding`](crate::shard::Sharding) or a
    /// leaf's spec changed): the first input whose spec differs, by name (a trainable leaf's
    /// path in a per-batch program), with both specs.
    ShardingChanged {
        /// The input.
        input: String,
        /// Its spec before (`P("data", None)`).
        from: String,
        /// Its spec now.
        to: String,
    },
    /// The compile options differ.
    OptionsChanged,
    /// It was here, and capacity pushed it out: the key is in the eviction ledger (bounded by
    /// the capacity), or it is exactly the key the program last used. Once the ledger has
    /// forgotten a key that the program has moved away from since, the miss names what moved
    /// instead.
    Evicted,
    /// The program was stored, but the stored entry could not be used and was rebuilt: its
    /// checksum or signature did not match, it was stored under another key, unreadable, or
    /// signed with a key this process does not have. The name of the fault is in `why`
    /// (`checksum`, `signature`, `unsigned`, `signed_no_key`, `foreign`, `malformed`, `metadata`,
    /// `unreadable`, `load`).
    StoreRejected {
        /// The kind of fault ([`RejectKind::name`](super::RejectKind::name)).
        why: String,
    },
}

impl MissReason {
    /// The reason's name, as in the stats' `misses_by_reason` (`graph_const_changed`, …).
    pub const fn name(&self) -> &'static str {
        match self {
            MissReason::Empty => "empty",
            MissReason::GraphConstChanged { .. } => "graph_const_changed",
            MissReason::SignatureChanged { .. } => "signature_changed",
            MissReason::CodeChanged { .. } => "code_changed",
            MissReason::BackendChanged { .. } => "backend_changed",
            MissReason::ShardingChanged { .. } => "sharding_changed",
            MissReason::OptionsChanged => "options_changed",
            MissReason::Evicted => "evicted",
            MissReason::StoreRejected { .. } => "store_rejected",
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
            MissReason::SignatureChanged { changes } => {
                f.write_str("signature_changed: ")?;
                for (i, c) in changes.iter().take(SHOWN_CHANGES).enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{c}")?;
                }
                if changes.len() > SHOWN_CHANGES {
                    write!(f, " and {} more", changes.len() - SHOWN_CHANGES)?;
                }
                Ok(())
            }
            MissReason::CodeChanged { from, to } => {
                write!(f, "code_changed: program {from} → {to}")
            }
            MissReason::BackendChanged {
                component,
                from,
                to,
            } => write!(f, "backend_changed: {component} {from} → {to}"),
            MissReason::ShardingChanged { input, from, to } => {
                write!(f, "sharding_changed: {input} {from} → {to}")
            }
            MissReason::OptionsChanged => f.write_str("options_changed"),
            MissReason::Evicted => f.write_str("evicted (capacity)"),
            MissReason::StoreRejected { why } => write!(f, "store_rejected: {why}"),
        }
    }
}
