//! Why a compile is slow, when the cache is healthy: what a program holds. Per program, its ops
//! by family, the largest constants baked into it (a GraphConst array becomes a literal in the
//! program text, and XLA folds and copies it), repeated blocks of identical ops that
//! [`nn::Repeated`](crate::nn::Repeated) or a [`scan`](crate::trace::Scan) would trace once,
//! the size of the emitted program, and what tracing and compiling it took.
//!
//! The cache computes a [`ProgramCost`] whenever it compiles a program and keeps it in the
//! program's record, so `nitro cache explain --cost KEY` shows it later;
//! [`Nitro::compile_report`](crate::train::Nitro::compile_report) gives a handle's.

use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};

use crate::hash::Digest;
use crate::trace::{Graph, Op};

/// Constant bytes past which a program is linted ([`ProgramCost::lints`]): 1 MiB.
pub const CONSTANT_BYTES_LINT: u64 = 1 << 20;

/// Repeats smaller than this many ops per copy are not reported (an attention head's three
/// projections are not worth a loop).
const MIN_BLOCK_OPS: usize = 12;

/// What one program holds, and what it cost to trace and compile.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProgramCost {
    /// The program identity.
    pub program: String,
    /// Ops in the traced graph (a loop's body counted once, inside its loop op).
    pub ops: usize,
    /// Ops by family (`elementwise`, `layout`, `matmul`, `reduction`, …), most first.
    pub families: Vec<(String, usize)>,
    /// Every constant's bytes, summed.
    pub constant_bytes: u64,
    /// The largest constants, largest first (at most five, each at least 1 KiB).
    pub constants: Vec<ConstantCost>,
    /// Blocks of identical ops (same ops, same types, same wiring) that follow each other,
    /// most ops covered first.
    pub repeats: Vec<Repeat>,
    /// The emitted StableHLO text, in bytes.
    pub hlo_bytes: usize,
    /// Tracing the program, in milliseconds, when known.
    pub trace_ms: Option<f64>,
    /// Compiling it, in milliseconds, when known.
    pub compile_ms: Option<f64>,
}

/// A constant baked into a program.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ConstantCost {
    /// Its size in bytes.
    pub bytes: u64,
    /// Its type (`f32[512,512]`).
    pub ty: String,
    /// The GraphConst field whose value it is, when one field holds exactly this array.
    pub field: Option<String>,
}

/// A block of ops repeated back to back.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Repeat {
    /// Ops in one copy.
    pub ops: usize,
    /// Copies in a row.
    pub copies: usize,
    /// The position of the first copy's first op in the graph.
    pub first_op: usize,
    /// One copy's ops by family, most first.
    pub families: Vec<(String, usize)>,
}

/// The family an op belongs to.
fn family(op: &Op) -> &'static str {
    match op {
        Op::Parameter { .. } => "input",
        Op::Constant(_) | Op::Iota { .. } => "constant",
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Compare(_)
        | Op::Select
        | Op::Convert
        | Op::Clamp
        | Op::BitcastConvert
        | Op::StopGradient => "elementwise",
        Op::BroadcastInDim { .. }
        | Op::Reshape
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Concatenate { .. }
        | Op::Pad { .. }
        | Op::Reverse { .. }
        | Op::DynamicSlice { .. }
        | Op::DynamicUpdateSlice => "layout",
        Op::DotGeneral(_) => "matmul",
        Op::Convolution(_) => "convolution",
        Op::Reduce { .. } | Op::ReduceWindow { .. } | Op::SelectAndScatter { .. } => "reduction",
        Op::Gather(_) | Op::Scatter { .. } => "gather/scatter",
        Op::AllReduce => "collective",
        Op::Shard(_) => "sharding",
        Op::Scan(_) | Op::While(_) => "loop",
        Op::Result { .. } => "loop plumbing",
    }
}

/// Counts by family, most first (ties by name).
fn by_family<'a>(ops: impl Iterator<Item = &'a Op>) -> Vec<(String, usize)> {
    let mut counts: HashMap<&'static str, usize> = HashMap::new();
    for op in ops {
        *counts.entry(family(op)).or_default() += 1;
    }
    let mut out: Vec<(String, usize)> =
        counts.into_iter().map(|(f, n)| (f.to_owned(), n)).collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// One op as a repeat sees it: what it computes, its type, and its operands — an input or a
/// constant by its type (each layer reads its own parameters), anything else by how far back
/// it is (so the same block at another place hashes the same).
fn shape_hash(graph: &Graph, i: usize) -> u64 {
    let node = &graph.nodes[i];
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::mem::discriminant(&node.op).hash(&mut h);
    match &node.op {
        // A constant by type (its value may differ per layer), loops by kind only: their
        // bodies are large to print and a repeat of loops is rare.
        Op::Constant(_) | Op::Scan(_) | Op::While(_) | Op::Parameter { .. } => {}
        other => format!("{other:?}").hash(&mut h),
    }
    node.ty.hash(&mut h);
    for &input in &node.inputs {
        let operand = &graph.nodes[input as usize];
        match operand.op {
            Op::Parameter { .. } | Op::Constant(_) => {
                u8::from(matches!(operand.op, Op::Parameter { .. })).hash(&mut h);
                operand.ty.hash(&mut h);
            }
            _ => i.saturating_sub(input as usize).hash(&mut h),
        }
    }
    h.finish()
}

/// Polynomial prefix hashes of a sequence, for O(1) comparisons of its windows.
struct Windows {
    prefix: Vec<u64>,
    powers: Vec<u64>,
}

impl Windows {
    fn new(seq: &[u64]) -> Windows {
        const BASE: u64 = 0x100_0000_01b3;
        let mut prefix = Vec::with_capacity(seq.len() + 1);
        let mut powers = Vec::with_capacity(seq.len() + 1);
        prefix.push(0u64);
        powers.push(1u64);
        for (k, &x) in seq.iter().enumerate() {
            prefix.push(prefix[k].wrapping_mul(BASE).wrapping_add(x | 1));
            powers.push(powers[k].wrapping_mul(BASE));
        }
        Windows { prefix, powers }
    }

    /// The hash of `seq[start..start + len]`.
    fn of(&self, start: usize, len: usize) -> u64 {
        self.prefix[start + len].wrapping_sub(self.prefix[start].wrapping_mul(self.powers[len]))
    }
}

/// The blocks of ops repeated back to back, largest coverage first, not overlapping.
fn repeats(graph: &Graph) -> Vec<Repeat> {
    let n = graph.nodes.len();
    if n < 2 * MIN_BLOCK_OPS {
        return Vec::new();
    }
    let seq: Vec<u64> = (0..n).map(|i| shape_hash(graph, i)).collect();
    let win = Windows::new(&seq);
    // Candidate periods: distances between equal windows of MIN_BLOCK_OPS ops.
    let mut last: HashMap<u64, usize> = HashMap::new();
    let mut gaps: HashMap<usize, usize> = HashMap::new();
    for i in 0..=n - MIN_BLOCK_OPS {
        let h = win.of(i, MIN_BLOCK_OPS);
        if let Some(&j) = last.get(&h) {
            let gap = i - j;
            if gap >= MIN_BLOCK_OPS {
                *gaps.entry(gap).or_default() += 1;
            }
        }
        last.insert(h, i);
    }
    let mut periods: Vec<(usize, usize)> = gaps.into_iter().collect();
    periods.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    periods.truncate(64);
    // For each period, its runs of back-to-back copies.
    let mut found: Vec<Repeat> = Vec::new();
    for &(p, _) in &periods {
        let mut i = 0;
        while i + 2 * p <= n {
            if win.of(i, p) != win.of(i + p, p) {
                i += 1;
                continue;
            }
            let mut copies = 2;
            while i + (copies + 1) * p <= n && win.of(i, p) == win.of(i + copies * p, p) {
                copies += 1;
            }
            let families = by_family(graph.nodes[i..i + p].iter().map(|node| &node.op));
            // Inputs and constants side by side are a program's arguments, not a block.
            if families
                .iter()
                .any(|(f, _)| f != "input" && f != "constant" && f != "layout")
            {
                found.push(Repeat {
                    ops: p,
                    copies,
                    first_op: i,
                    families,
                });
            }
            i += copies * p;
        }
    }
    // The largest coverage first, then drop any that overlaps one kept.
    found.sort_by(|a, b| {
        (b.ops * b.copies)
            .cmp(&(a.ops * a.copies))
            .then(a.first_op.cmp(&b.first_op))
    });
    let mut kept: Vec<Repeat> = Vec::new();
    for r in found {
        let (start, end) = (r.first_op, r.first_op + r.ops * r.copies);
        if kept
            .iter()
            .all(|k| end <= k.first_op || start >= k.first_op + k.ops * k.copies)
        {
            kept.push(r);
        }
        if kept.len() == 4 {
            break;
        }
    }
    kept
}

impl ProgramCost {
    /// What `graph` (emitted as `hlo_bytes` of text) holds; its constants are matched to the
    /// GraphConst fields whose digests are `graph_const_fields`.
    pub fn of(
        program: &str,
        graph: &Graph,
        hlo_bytes: usize,
        graph_const_fields: &[(&str, Digest)],
    ) -> ProgramCost {
        let mut constant_bytes = 0u64;
        let mut constants: Vec<ConstantCost> = Vec::new();
        for node in &graph.nodes {
            if let Op::Constant(array) = &node.op {
                let bytes = array.size_bytes() as u64;
                constant_bytes += bytes;
                if bytes >= 1024 {
                    let digest = Digest::of(&**array);
                    constants.push(ConstantCost {
                        bytes,
                        ty: array.leaf_type().to_string(),
                        field: graph_const_fields
                            .iter()
                            .find(|(_, d)| *d == digest)
                            .map(|(f, _)| (*f).to_owned()),
                    });
                }
            }
        }
        constants.sort_by_key(|c| std::cmp::Reverse(c.bytes));
        constants.truncate(5);
        ProgramCost {
            program: program.to_owned(),
            ops: graph.nodes.len(),
            families: by_family(graph.nodes.iter().map(|n| &n.op)),
            constant_bytes,
            constants,
            repeats: repeats(graph),
            hlo_bytes,
            trace_ms: None,
            compile_ms: None,
        }
    }

    /// What to change, if anything: constants past [`CONSTANT_BYTES_LINT`], and a repeated
    /// block that covers much of the program.
    pub fn lints(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.constant_bytes > CONSTANT_BYTES_LINT {
            let largest = self.constants.first().map_or(String::new(), |c| {
                let from = c
                    .field
                    .as_deref()
                    .map_or(String::new(), |f| format!(", GraphConst field `{f}`"));
                format!(" (the largest: {} bytes, {}{from})", c.bytes, c.ty)
            });
            out.push(format!(
                "`{}` embeds {} bytes of constants{largest}: XLA copies and folds them at every \
                 compile, and a new value is a new program. Data belongs in a #[device] field \
                 (a traced input: only its shape reaches the key)",
                self.program, self.constant_bytes
            ));
        }
        if let Some(r) = self.repeats.iter().find(|r| {
            r.copies >= 3
                && r.ops * r.copies * 4 >= self.ops
                && r.families
                    .iter()
                    .any(|(f, _)| f == "matmul" || f == "convolution")
        }) {
            out.push(format!(
                "`{}` repeats a block of {} ops {} times ({}% of its ops): if these are the \
                 layers of one stack, nn::Repeated (or a scan) traces and compiles one copy",
                self.program,
                r.ops,
                r.copies,
                r.ops * r.copies * 100 / self.ops.max(1)
            ));
        }
        out
    }
}

fn families(f: &mut fmt::Formatter<'_>, list: &[(String, usize)]) -> fmt::Result {
    for (k, (name, n)) in list.iter().enumerate() {
        if k > 0 {
            write!(f, ", ")?;
        }
        write!(f, "{name} {n}")?;
    }
    Ok(())
}

fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

impl fmt::Display for ProgramCost {
    /// A few lines: ops by family, constants, repeats, sizes and times, then the lints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.program)?;
        write!(f, "  ops        {} (", self.ops)?;
        families(f, &self.families)?;
        writeln!(f, ")")?;
        writeln!(
            f,
            "  program    {} of StableHLO, {} of constants",
            bytes(self.hlo_bytes as u64),
            bytes(self.constant_bytes)
        )?;
        for c in &self.constants {
            let from = c
                .field
                .as_deref()
                .map_or(String::new(), |x| format!(" from GraphConst field `{x}`"));
            writeln!(f, "  constant   {} {}{from}", bytes(c.bytes), c.ty)?;
        }
        for r in &self.repeats {
            write!(
                f,
                "  repeated   {} ops × {} from op {} (",
                r.ops, r.copies, r.first_op
            )?;
            families(f, &r.families)?;
            writeln!(f, ")")?;
        }
        let ms = |v: Option<f64>| v.map_or("?".to_owned(), |m| format!("{m:.0} ms"));
        writeln!(
            f,
            "  time       trace {}, compile {}",
            ms(self.trace_ms),
            ms(self.compile_ms)
        )?;
        for lint in self.lints() {
            writeln!(f, "  lint       {lint}")?;
        }
        Ok(())
    }
}

/// A training handle's programs and what each holds
/// ([`Nitro::compile_report`](crate::train::Nitro::compile_report)).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct CompileReport {
    /// Per program the handle holds (every batch shape it prepared): its role in the inventory
    /// (`grad`, `update`, `eval`) and its cost.
    pub programs: Vec<(String, ProgramCost)>,
}

impl CompileReport {
    /// Every program's [`ProgramCost::lints`], in order.
    pub fn lints(&self) -> Vec<String> {
        self.programs.iter().flat_map(|(_, c)| c.lints()).collect()
    }

    /// The cost of the first program in `role`.
    pub fn get(&self, role: &str) -> Option<&ProgramCost> {
        self.programs
            .iter()
            .find(|(r, _)| r == role)
            .map(|(_, c)| c)
    }
}

impl fmt::Display for CompileReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, (role, cost)) in self.programs.iter().enumerate() {
            if k > 0 {
                writeln!(f)?;
            }
            write!(f, "[{role}] {cost}")?;
        }
        Ok(())
    }
}
