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
        /// Inside them, the deepest sub-values whose digests differ, by path, with their old
        /// and new values where they print short (`arch.hidden 32 → 48`, `arch.act Tanh →
        /// Relu`): from the parts of the key's own bytes
        /// ([`ContentHasher::parts_of`](crate::ContentHasher::parts_of)), so exact. Empty when
        /// the earlier use recorded no parts (details from before they were kept).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        changes: Vec<GraphConstChange>,
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
    /// A setting of the training handle that shapes the program moved: its
    /// [`Precision`](crate::train::Precision) (`precision f32 → bf16`), named with both values.
    SettingChanged {
        /// The setting (`precision`).
        setting: String,
        /// Its value before.
        from: String,
        /// Its value now.
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
    /// More than one component of the key moved at once — a handle that went onto a mesh
    /// *and* to bf16 — each named by its own reason, in the order of
    /// [`components`](MissReason::components) (the mesh and settings, the GraphConsts, the
    /// input structure, the backend, the options). Never nested, and never holds `empty`,
    /// `evicted` or `store_rejected`, which are not changes. Its text lists each, separated
    /// by `; `.
    Several {
        /// The reasons, one per component that moved (at least two).
        reasons: Vec<MissReason>,
    },
}

/// One sub-value of a GraphConst field that moved, as [`MissReason::GraphConstChanged`] names
/// it: `arch.hidden 32 → 48`, or the path alone where a side does not print short.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct GraphConstChange {
    /// The path from the field (`arch.hidden`, `arch.layers[1].width`).
    pub path: String,
    /// Its value before, where it printed short.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Its value now, where it prints short.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

impl fmt::Display for GraphConstChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.from, &self.to) {
            (Some(a), Some(b)) => write!(f, "{} {a} → {b}", self.path),
            _ => f.write_str(&self.path),
        }
    }
}

/// What moved inside the GraphConst `fields` between the parts `before` and `now`: per field,
/// the deepest paths both sides recorded whose digests differ (a path none of whose recorded
/// sub-paths differ); the field itself where the parts say nothing more (none recorded, or a
/// length or variant changed with every common sub-part equal).
pub(crate) fn graph_const_changes(
    before: &[crate::hash::Part],
    now: &[crate::hash::Part],
    fields: &[String],
) -> Vec<GraphConstChange> {
    if before.is_empty() || now.is_empty() {
        return Vec::new();
    }
    let old: std::collections::HashMap<&str, &crate::hash::Part> =
        before.iter().map(|p| (p.path.as_str(), p)).collect();
    let under = |path: &str, root: &str| {
        path.strip_prefix(root)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.') || rest.starts_with('['))
    };
    // Paths on both sides whose digests differ, in `now`'s order (children before parents).
    let moved: Vec<(&crate::hash::Part, &crate::hash::Part)> = now
        .iter()
        .filter_map(|p| {
            let was = old.get(p.path.as_str())?;
            (was.digest != p.digest).then_some((*was, p))
        })
        .collect();
    let mut changes = Vec::new();
    for field in fields.iter().filter(|f| !f.starts_with('<')) {
        let mine: Vec<&(&crate::hash::Part, &crate::hash::Part)> = moved
            .iter()
            .filter(|(_, p)| under(&p.path, field))
            .collect();
        let deepest = mine.iter().filter(|(_, p)| {
            !mine
                .iter()
                .any(|(_, q)| q.path != p.path && under(&q.path, &p.path))
        });
        let before_len = changes.len();
        for (was, is) in deepest {
            changes.push(GraphConstChange {
                path: is.path.clone(),
                from: was.value.clone().filter(|_| is.value.is_some()),
                to: is.value.clone().filter(|_| was.value.is_some()),
            });
        }
        if changes.len() == before_len {
            changes.push(GraphConstChange {
                path: field.clone(),
                from: None,
                to: None,
            });
        }
    }
    changes
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
            MissReason::SettingChanged { .. } => "setting_changed",
            MissReason::OptionsChanged => "options_changed",
            MissReason::Evicted => "evicted",
            MissReason::StoreRejected { .. } => "store_rejected",
            MissReason::Several { .. } => "several",
        }
    }

    /// Each component that moved, by its own reason: the reasons of [`MissReason::Several`],
    /// or this reason alone. What to match on to ask whether a component moved, however many
    /// others moved with it.
    ///
    /// ```
    /// use nitro::cache::MissReason;
    ///
    /// let both = MissReason::of_changes(vec![
    ///     MissReason::BackendChanged {
    ///         component: "sharding".into(),
    ///         from: "absent".into(),
    ///         to: "mesh [data=4], fsdp(data)".into(),
    ///     },
    ///     MissReason::SettingChanged {
    ///         setting: "precision".into(),
    ///         from: "the leaves' dtypes".into(),
    ///         to: "bf16".into(),
    ///     },
    /// ])
    /// .unwrap();
    /// assert!(both
    ///     .components()
    ///     .iter()
    ///     .any(|r| matches!(r, MissReason::SettingChanged { setting, .. } if setting == "precision")));
    /// assert_eq!(
    ///     both.to_string(),
    ///     "backend_changed: sharding absent → mesh [data=4], fsdp(data); \
    ///      setting_changed: precision the leaves' dtypes → bf16"
    /// );
    /// assert_eq!(MissReason::Evicted.components(), [MissReason::Evicted]);
    /// ```
    pub fn components(&self) -> &[MissReason] {
        match self {
            MissReason::Several { reasons } => reasons,
            one => std::slice::from_ref(one),
        }
    }

    /// The reason for the components `changes` that moved: `None` for none, the one reason
    /// for one, [`MissReason::Several`] for more (a `Several` among them is flattened).
    pub fn of_changes(changes: Vec<MissReason>) -> Option<MissReason> {
        let mut reasons: Vec<MissReason> = changes
            .into_iter()
            .flat_map(|r| match r {
                MissReason::Several { reasons } => reasons,
                one => vec![one],
            })
            .collect();
        match reasons.len() {
            0 => None,
            1 => reasons.pop(),
            _ => Some(MissReason::Several { reasons }),
        }
    }
}

/// The first [`SHOWN_CHANGES`] of `changes`, comma-separated, then how many more there are.
fn write_shown<T: fmt::Display>(f: &mut fmt::Formatter<'_>, changes: &[T]) -> fmt::Result {
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

impl fmt::Display for MissReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MissReason::Empty => f.write_str("empty (never compiled here)"),
            MissReason::GraphConstChanged { fields, changes } if changes.is_empty() => {
                write!(f, "graph_const_changed: {}", fields.join(", "))
            }
            MissReason::GraphConstChanged { fields, changes } => {
                f.write_str("graph_const_changed: ")?;
                write_shown(f, changes)?;
                // Pseudo-fields (`<handle>`) have no parts: named after the changes.
                for pseudo in fields.iter().filter(|f| f.starts_with('<')) {
                    write!(f, ", {pseudo}")?;
                }
                Ok(())
            }
            MissReason::SignatureChanged { changes } => {
                f.write_str("signature_changed: ")?;
                write_shown(f, changes)
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
            MissReason::SettingChanged { setting, from, to } => {
                write!(f, "setting_changed: {setting} {from} → {to}")
            }
            MissReason::OptionsChanged => f.write_str("options_changed"),
            MissReason::Evicted => f.write_str("evicted (capacity)"),
            MissReason::StoreRejected { why } => write!(f, "store_rejected: {why}"),
            MissReason::Several { reasons } => {
                for (i, reason) in reasons.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{reason}")?;
                }
                Ok(())
            }
        }
    }
}
