//! What the cache keeps beside its programs to explain them: the records of programs and
//! entries in the store (their key's details, cost and times), the miss reasons named from
//! them, and the lint of GraphConsts that keep recompiling.

use super::*;

/// The lint names a GraphConst field once it has recompiled one program this many times.
pub(super) const LINT_REPEATS: u32 = 3;

/// What the lint saw of one program identity.
#[derive(Default)]
pub(super) struct LintState {
    /// Recompiles per GraphConst field.
    pub(super) field_changes: HashMap<String, u32>,
    /// Distinct keys compiled.
    pub(super) variants: std::collections::HashSet<Digest>,
    pub(super) warned_variants: bool,
    pub(super) warned_constants: bool,
}

/// A warning of the lint: a compile pattern that costs compiles a different declaration would
/// save.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "lint")]
pub enum Lint {
    /// One GraphConst field keeps changing and recompiling the program: a value swept or
    /// scheduled (a learning rate, a dropout rate) belongs in a `#[device]` field, where it is
    /// a traced input and changing it never recompiles.
    RepeatedGraphConst {
        /// The program identity.
        program: String,
        /// The field.
        field: String,
        /// Compiles it caused so far.
        compiles: u32,
    },
    /// One program has compiled more variants than the warning threshold.
    ManyVariants {
        /// The program identity.
        program: String,
        /// Distinct variants compiled.
        variants: usize,
    },
    /// A program embeds more than [`CONSTANT_BYTES_LINT`] bytes of constants (a GraphConst
    /// array made a literal): XLA copies and folds them at every compile.
    LargeConstants {
        /// The program identity.
        program: String,
        /// Its constants' bytes.
        bytes: u64,
        /// The GraphConst field of the largest, when one field holds exactly it.
        field: Option<String>,
    },
}

impl std::fmt::Display for Lint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lint::RepeatedGraphConst {
                program,
                field,
                compiles,
            } => write!(
                f,
                "#[graph_const] field `{field}` has changed {compiles} times, recompiling \
                 `{program}` each time; if it does not shape the graph (a learning rate, a \
                 coefficient), declare it #[device]: a traced input never recompiles"
            ),
            Lint::ManyVariants { program, variants } => write!(
                f,
                "`{program}` has compiled {variants} variants in this process; see \
                 `Cache::recent_misses` for what keeps moving (GraphConsts, batch shapes)"
            ),
            Lint::LargeConstants {
                program,
                bytes,
                field,
            } => {
                let from = field.as_deref().map_or(String::new(), |f| {
                    format!(", the largest from GraphConst field `{f}`")
                });
                write!(
                    f,
                    "`{program}` embeds {bytes} bytes of constants{from}: XLA copies and folds \
                     them at every compile, and a new value is a new program; data belongs in a \
                     #[device] field (a traced input: only its shape reaches the key). \
                     `nitro cache explain --cost` shows what the program holds"
                )
            }
        }
    }
}

/// A program's record in the store: its key's details, and what it last cost.
#[derive(serde::Serialize)]
pub(super) struct ProgramRecord<'a> {
    #[serde(flatten)]
    pub(super) details: &'a KeyDetails,
    /// What the program holds ([`ProgramCost`]), for `nitro cache explain --cost`.
    pub(super) cost: &'a ProgramCost,
    #[serde(flatten)]
    pub(super) times: ProgramTimes,
}

/// What a program last cost, from its record (absent in records written before they were kept).
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct ProgramTimes {
    #[serde(default)]
    pub(super) compile_ms: Option<f64>,
    #[serde(default)]
    pub(super) load_ms: Option<f64>,
}

/// What `store` recorded of what the entry under `entry` (a persistent key) last cost here:
/// its own record's compile and load times. An entry without a record (not stored yet, or
/// stored before records were kept per entry) takes only the compile time of the program
/// `program_key`'s latest compile — an estimate for a compile, from another key — and no load
/// time: another entry's load is never reported as this one's. Nothing when there is no store
/// or no readable record.
pub(super) fn recorded_times(
    store: Option<&dyn Store>,
    entry: &Digest,
    program_key: &Digest,
) -> ProgramTimes {
    let read = |digest: &Digest| {
        store
            .and_then(|s| s.program_record(digest))
            .and_then(|bytes| serde_json::from_slice::<ProgramTimes>(&bytes).ok())
    };
    read(&store::entry_record_key(entry)).unwrap_or_else(|| ProgramTimes {
        compile_ms: read(program_key).and_then(|t| t.compile_ms),
        load_ms: None,
    })
}

impl Cache {
    /// The lint: a GraphConst field whose changes keep recompiling one program is named once,
    /// with the advice to make it `#[device]`; a program with many variants is named once.
    pub(super) fn lint(
        &self,
        st: &mut State,
        (program, name): (Digest, &str),
        key: Digest,
        reason: &MissReason,
        cost: &ProgramCost,
    ) {
        let variant_warning = self.variant_warning.load(Ordering::Relaxed);
        let lint = st.lint.entry(program).or_default();
        let mut found = Vec::new();
        let moved = reason.components().iter().filter_map(|r| match r {
            MissReason::GraphConstChanged { fields, .. } => Some(fields),
            _ => None,
        });
        for fields in moved {
            for field in fields.iter().filter(|f| !f.starts_with('<')) {
                let n = lint.field_changes.entry(field.clone()).or_default();
                *n += 1;
                if *n == LINT_REPEATS {
                    found.push(Lint::RepeatedGraphConst {
                        program: name.to_owned(),
                        field: field.clone(),
                        compiles: *n,
                    });
                }
            }
        }
        lint.variants.insert(key);
        if lint.variants.len() > variant_warning && !lint.warned_variants {
            lint.warned_variants = true;
            found.push(Lint::ManyVariants {
                program: name.to_owned(),
                variants: lint.variants.len(),
            });
        }
        if cost.constant_bytes > CONSTANT_BYTES_LINT && !lint.warned_constants {
            lint.warned_constants = true;
            found.push(Lint::LargeConstants {
                program: name.to_owned(),
                bytes: cost.constant_bytes,
                field: cost.constants.first().and_then(|c| c.field.clone()),
            });
        }
        for l in found {
            crate::settings::notice_once(&l.to_string(), &l.to_string());
            st.lints.push(l);
        }
    }

    /// The lint's warnings so far (each also printed once on stderr): GraphConst fields whose
    /// changes keep recompiling a program, programs with many variants, and programs that
    /// embed large constants.
    pub fn lints(&self) -> Vec<Lint> {
        self.lock_state().lints.clone()
    }

    /// Names what moved in this process since this program was last used (compiled or hit):
    /// `None` when this process never had it (the persistent level may know more).
    pub(super) fn reason_here(
        &self,
        key: &Digest,
        program: &Digest,
        now: &KeyDetails,
    ) -> Option<MissReason> {
        let st = self.lock_state();
        if st.ledger.contains(key) {
            return Some(MissReason::Evicted);
        }
        let before = st.last.get(program)?;
        // Nothing moved since this very key was last used here, yet it is not held: capacity
        // pushed it out, and so many others since that the bounded ledger forgot it. (At
        // capacity 0 nothing is ever held or evicted: every lookup is `empty`.)
        before
            .moved_to(now)
            .or_else(|| (self.capacity > 0).then_some(MissReason::Evicted))
            .or(Some(MissReason::Empty))
    }

    /// Names what moved since the last process that shared the store used this program, from
    /// the store's record of it: `empty` when there is none, or nothing moved.
    pub(super) fn reason_stored(&self, program: &Digest, now: &KeyDetails) -> MissReason {
        self.store
            .as_ref()
            .and_then(|s| s.program_record(program))
            .and_then(|bytes| serde_json::from_slice::<KeyDetails>(&bytes).ok())
            .filter(|before| before.program == now.program)
            .and_then(|before| before.moved_to(now))
            .unwrap_or(MissReason::Empty)
    }
}
