//! StableHLO emission: a [`Graph`] as deterministic MLIR text.
//!
//! The text is what XLA compiles (PJRT program format `"mlir"`), and its blake3 digest is the
//! program's [`fingerprint`]. Every form used here is one that a StableHLO op catalog (each op's
//! exact text, run on three XLA CPU plugins against known outputs; kept outside this
//! repository) saw compile and compute the right values; `runtime/tests/emit.rs` pins the
//! forms.
//!
//! ```
//! use nitro::trace::trace;
//! use nitro::{DType, LeafType};
//!
//! let x = LeafType { dtype: DType::F32, dims: vec![2, 3] };
//! let graph = trace(&[("x".into(), x)], |inputs| vec![(inputs[0] * 2.0).tanh()])?;
//! let text = nitro::emit::emit(&graph);
//! assert!(text.starts_with("module @nitro {\n  func.func public @main(%arg0: tensor<2x3xf32>) -> tensor<2x3xf32> {\n"));
//! assert!(text.contains("stablehlo.constant dense<0x40000000> : tensor<f32>")); // 2.0, as bits
//! assert_eq!(nitro::emit::fingerprint(&text), nitro::emit::fingerprint(&nitro::emit::emit(&graph)));
//! # Ok::<(), nitro::Error>(())
//! ```
//!
//! # The text
//!
//! - One `module @nitro` holding `func.func public @main`, then one `func.func private @scanN`
//!   per loop body ([`Op::Scan`], [`Op::While`]), numbered in the order they are first needed
//!   (a nested body after its parent). A scan is a `stablehlo.while` threading an `i32` counter,
//!   the carry, the stacked inputs, the invariants and the stacked outputs (zeros at first); its
//!   body slices row `t` of each stacked input (`dynamic_slice`), calls the function, writes row
//!   `t` of each output (`dynamic_update_slice`) and counts. Names inside a loop are `%wN_…`, `N`
//!   being the loop's own number; a loop's results are `%N#k`.
//! - `func.func public @main`. Arguments are `%arg0`, `%arg1`, … in
//!   input order (all inputs, used or not); results are the graph's outputs in order, written
//!   `-> T` for one and `-> (T0, T1)` otherwise.
//! - Only nodes some output depends on ([`Graph::live`]) are written. Parameters are their
//!   `%argN`; the other live nodes are numbered `%0`, `%1`, … in node order, so the names depend
//!   only on the graph. A reduction's init constant is written just before it as `%initN`, `N`
//!   being the reduction's own number.
//! - Types are `tensor<2x3xf32>`, `tensor<f32>` for a scalar, with element types `f32 f64 i32 i64`,
//!   `ui8` for `u8`, `ui32` for `u32` and `i1` for `bool`.
//! - Floats never appear as decimal text. A splat (every element equal, compared by bits, which
//!   includes scalars) is written as its bit pattern, `dense<0x3F800000>`; other float and
//!   integer constants are one quoted little-endian hex string, `dense<"0x0000803F...">`,
//!   written straight from a lookup table. Integer splats are decimal (`dense<-1>`). `bool`
//!   constants are `dense<true>` or a nested `dense<[[true, false], ...]>` list, because the
//!   plugins disagree on `i1` hex. A constant with no elements is `dense<>`.
//! - Comparisons carry their type: `FLOAT` for floats, `SIGNED` for `i32`/`i64`, `UNSIGNED` for
//!   `ui8` and `i1`.
//! - Float `maximum`/`minimum` propagate NaN from either operand (as NumPy and the interpreter
//!   do), which XLA's CPU backend does not guarantee for the bare op: the op is written as
//!   `%rawN`, then `%nan_aN`/`%nan_bN` compare each operand with itself (`NE`), and two
//!   `select`s (`%pickN`, then the result) return a NaN operand where there is one.
//! - Reductions are one line, `stablehlo.reduce(%x init: %initN) applies stablehlo.add across
//!   dimensions = [..] : ...`, except float max/min: XLA's CPU backend drops NaN elements in a
//!   reduction by a bare `maximum`/`minimum`, so those take a reducer block that propagates NaN
//!   (as NumPy and JAX do, and as the interpreter does): `reducer(%acc: T, %e: T) { … }`
//!   returning `%acc` when it is NaN, else `%e` when it is NaN, else `maximum(%acc, %e)`.

use std::fmt::{self, Write as _};

pub(crate) mod line;

use line::{Line, List, Ty};

use crate::hash::Digest;
use crate::trace::ir::{Graph, Node, NodeId, Op, ScanOp};
use crate::tree::{ArrayData, LeafType};

/// How to emit a program beyond its graph.
///
/// ```
/// let opts = nitro::emit::EmitOptions { donate: vec![(0, 0)], ..Default::default() };
/// assert_eq!(opts.donate, [(0, 0)]);
/// assert!(nitro::emit::EmitOptions::default().donate.is_empty());
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct EmitOptions {
    /// Donated arguments as `(input, output)` pairs: input `input` carries
    /// `{tf.aliasing_output = output : i32}`, so XLA may write output `output` into its buffer
    /// and PJRT deletes the input buffer after execute. The two must have the same byte size, or
    /// XLA refuses to compile. An input listed twice uses its first pair; pairs naming an input
    /// the graph does not have are ignored.
    pub donate: Vec<(usize, usize)>,
    /// Shard the program over a mesh ([`crate::shard`]): the module declares the mesh's
    /// devices as partitions and Shardy's mesh, and every argument and result carries its
    /// `sdy.sharding`. Compile it with
    /// [`Client::compile_partitioned`](crate::backend::pjrt::Client::compile_partitioned).
    pub sharding: Option<crate::shard::ProgramSharding>,
    /// With [`sharding`](EmitOptions::sharding): name the mesh's axes by position (`a0`, `a1`,
    /// …) in the text — the mesh, every argument's and result's sharding and every sharding
    /// constraint — so that the text, and so the fingerprint, does not depend on what the axes
    /// are called: a mesh renamed with the same partitioning emits the same program. The
    /// training handle's programs are emitted so.
    pub canonical_axes: bool,
    /// Emit every dot and convolution of half-precision operands (bf16, f16) as the same op
    /// over their exact f32 widening, its result rounded back: the numbers of a half dot
    /// accumulated in f32. For XLA's CPU compiler, which runs a half-precision dot on a path
    /// about 20 times slower than its f32 one (and half convolutions slowly too); the training
    /// handle sets it for a CPU plugin, never for a GPU, whose half dots are its fast ones.
    pub widen_half_dots: bool,
}

/// The StableHLO text of `graph`, with no donated arguments (see the [module docs](self)).
pub fn emit(graph: &Graph) -> String {
    emit_with(graph, &EmitOptions::default())
}

/// The StableHLO text of `graph`, with the arguments in `options.donate` donated.
///
/// The same graph and options always give byte-identical text.
pub fn emit_with(graph: &Graph, options: &EmitOptions) -> String {
    let _widen = line::WidenGuard::set(options.widen_half_dots);
    // Axes named by position: the sharding renamed, and the user's mesh kept to rename the
    // constraints inside the program.
    let renamed;
    let (options, rename) = match (&options.sharding, options.canonical_axes) {
        (Some(sharding), true) => {
            renamed = EmitOptions {
                donate: options.donate.clone(),
                sharding: Some(sharding.canonical()),
                canonical_axes: false,
                widen_half_dots: options.widen_half_dots,
            };
            (&renamed, Some(sharding.mesh.clone()))
        }
        _ => (options, None),
    };
    let mut out = String::new();
    if let Some(sharding) = &options.sharding {
        let _ = writeln!(
            out,
            "module @nitro attributes {{mhlo.num_partitions = {} : i32, mhlo.num_replicas = 1 : i32}} {{\n  {}",
            sharding.mesh.devices(),
            sharding.mesh.sdy()
        );
    } else if graph.replicas > 1 {
        // A replicated program says how many replicas it runs as; the compile options say
        // the same (and a one-replica program's text is unchanged).
        let _ = writeln!(
            out,
            "module @nitro attributes {{mhlo.num_partitions = 1 : i32, mhlo.num_replicas = {} : i32}} {{",
            graph.replicas
        );
    } else {
        out.push_str("module @nitro {\n");
    }
    let mut bodies = Bodies::default();
    let mut e = Emitter::new(graph, &mut bodies);
    e.partitioned |= options.sharding.is_some();
    e.rename = rename.map(std::sync::Arc::new);
    // Writing into a `String` cannot fail; the `fmt::Result` plumbing only serves `write!`.
    let _ = e.function("public @main", options);
    out.push_str(&e.out);
    for body in &bodies.texts {
        out.push_str(body);
    }
    out.push_str("}\n");
    out
}

/// The program's fingerprint: the blake3 digest of its StableHLO text.
///
/// ```
/// let a = nitro::emit::fingerprint("module {}");
/// assert_eq!(a, nitro::Digest::from(blake3::hash(b"module {}")));
/// assert_ne!(a, nitro::emit::fingerprint("module { }"));
/// ```
pub fn fingerprint(text: &str) -> Digest {
    Digest::from(blake3::hash(text.as_bytes()))
}

/// The SSA name of a node's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ssa {
    /// Function argument `%argN`.
    Arg(usize),
    /// Computed value `%N`.
    Value(usize),
    /// Result `k` of the multi-result value `%N`: `%N#k`.
    Part(usize, usize),
    /// A node that is not emitted (only reachable through a malformed graph).
    Missing,
}

impl fmt::Display for Ssa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ssa::Arg(i) => write!(f, "%arg{i}"),
            Ssa::Value(i) => write!(f, "%{i}"),
            Ssa::Part(i, k) => write!(f, "%{i}#{k}"),
            Ssa::Missing => f.write_str("%missing"),
        }
    }
}

struct Emitter<'g, 'b> {
    graph: &'g Graph,
    /// Whether the module is partitioned over a mesh (its sharding constraints are emitted;
    /// otherwise each is its operand).
    partitioned: bool,
    /// With [`EmitOptions::canonical_axes`], the user's mesh: constraints name its axes by
    /// position.
    rename: Option<std::sync::Arc<crate::shard::Mesh>>,
    live: Vec<bool>,
    names: Vec<Ssa>,
    out: String,
    /// The module's private functions (loop bodies), in the order they were first needed.
    bodies: &'b mut Bodies,
}

/// The private functions of a module: their texts, and which text each distinct body has, so
/// that identical bodies (every Threefry draw of one shape, say) are one function.
#[derive(Default)]
struct Bodies {
    /// The functions' texts, `@scanN` at place `N`.
    texts: Vec<String>,
    /// Each distinct body's text with its own name left out, and its number.
    seen: std::collections::HashMap<String, usize>,
}

impl<'g, 'b> Emitter<'g, 'b> {
    fn new(graph: &'g Graph, bodies: &'b mut Bodies) -> Self {
        let live = graph.live();
        let mut next = 0;
        let mut names: Vec<Ssa> = Vec::with_capacity(graph.nodes.len());
        for (node, &is_live) in graph.nodes.iter().zip(&live) {
            let name = match &node.op {
                Op::Parameter { index } => Ssa::Arg(*index),
                // A scan's results are its `while`'s, after the counter and what it threads.
                Op::Result { index } if is_live => {
                    let scan = Self::input(node, 0);
                    match (names.get(scan as usize), graph.nodes.get(scan as usize)) {
                        (Some(&Ssa::Value(n)), Some(s)) => match &s.op {
                            Op::Scan(op) => Ssa::Part(n, while_result(op, s.inputs.len(), *index)),
                            Op::While(_) => Ssa::Part(n, *index),
                            _ => Ssa::Missing,
                        },
                        _ => Ssa::Missing,
                    }
                }
                _ if is_live => {
                    next += 1;
                    Ssa::Value(next - 1)
                }
                _ => Ssa::Missing,
            };
            names.push(name);
        }
        Emitter {
            graph,
            partitioned: graph.sharding.is_some(),
            rename: None,
            live,
            names,
            out: String::new(),
            bodies,
        }
    }

    /// The name of node `id`.
    fn name(&self, id: NodeId) -> Ssa {
        self.names.get(id as usize).copied().unwrap_or(Ssa::Missing)
    }

    /// The type of node `id`.
    fn ty(&self, id: NodeId) -> Ty<'g> {
        Ty(self.graph.nodes.get(id as usize).map(|n| &n.ty))
    }

    /// Operand `k` of `node` (`NodeId::MAX`, which names nothing, when absent).
    fn input(node: &Node, k: usize) -> NodeId {
        node.inputs.get(k).copied().unwrap_or(NodeId::MAX)
    }

    /// The function `func.func {name}` (`public @main`, `private @scan0`) with the graph's
    /// inputs as arguments and its outputs as results.
    fn function(&mut self, name: &str, options: &EmitOptions) -> fmt::Result {
        let graph = self.graph;
        let out = &mut self.out;
        write!(out, "  func.func {name}(")?;
        for (i, input) in graph.inputs.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            write!(out, "%arg{i}: {}", Ty(Some(&input.ty)))?;
            let mut attrs = Vec::new();
            if let Some(&(_, k)) = options.donate.iter().find(|&&(d, _)| d == i) {
                attrs.push(format!("tf.aliasing_output = {k} : i32"));
            }
            if let Some(sharding) = &options.sharding {
                let sdy =
                    crate::shard::ProgramSharding::sdy(sharding.inputs.get(i), input.ty.dims.len());
                attrs.push(format!("sdy.sharding = {sdy}"));
            }
            if !attrs.is_empty() {
                write!(out, " {{{}}}", attrs.join(", "))?;
            }
        }
        out.push(')');
        match (graph.outputs.as_slice(), &options.sharding) {
            ([], _) => {}
            (outputs, Some(sharding)) => {
                self.out.push_str(" -> (");
                for (k, &o) in outputs.iter().enumerate() {
                    if k > 0 {
                        self.out.push_str(", ");
                    }
                    let rank = self
                        .graph
                        .nodes
                        .get(o as usize)
                        .map_or(0, |n| n.ty.dims.len());
                    let sdy = crate::shard::ProgramSharding::sdy(sharding.outputs.get(k), rank);
                    write!(self.out, "{} {{sdy.sharding = {sdy}}}", self.ty(o))?;
                }
                self.out.push(')');
            }
            (&[o], None) => write!(self.out, " -> {}", self.ty(o))?,
            (outputs, None) => {
                self.out.push_str(" -> (");
                self.types(outputs)?;
                self.out.push(')');
            }
        }
        self.out.push_str(" {\n");

        for (id, node) in graph.nodes.iter().enumerate() {
            if self.live[id] && !matches!(node.op, Op::Parameter { .. } | Op::Result { .. }) {
                self.node(id as NodeId, node)?;
            }
        }

        self.out.push_str("    return");
        for (i, &o) in graph.outputs.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            write!(self.out, "{sep}{}", self.name(o))?;
        }
        if !graph.outputs.is_empty() {
            self.out.push_str(" : ");
            self.types(&graph.outputs)?;
        }
        self.out.push_str("\n  }\n");
        Ok(())
    }

    /// `T0, T1, ...` for the nodes `ids`.
    fn types(&mut self, ids: &[NodeId]) -> fmt::Result {
        for (i, &id) in ids.iter().enumerate() {
            if i > 0 {
                self.out.push_str(", ");
            }
            write!(self.out, "{}", self.ty(id))?;
        }
        Ok(())
    }

    /// One node's line (two for a reduction).
    fn node(&mut self, id: NodeId, node: &Node) -> fmt::Result {
        let me = self.name(id);
        let ty = Ty(Some(&node.ty));
        let a = Self::input(node, 0);
        let (an, at) = (self.name(a), self.ty(a));
        let partitioned = self.partitioned;
        let out = &mut self.out;
        match &node.op {
            // Parameters are arguments, never lines; `module` skips them.
            Op::Parameter { .. } => Ok(()),
            Op::Constant(array) => {
                write!(out, "    {me} = stablehlo.constant ")?;
                dense(out, array.data(), array.dims());
                writeln!(out, " : {ty}")
            }
            crate::ops::family_op!() => {
                let line = self.line(me, node);
                crate::ops::emit(node, line)
            }
            // A loop's body is a private function of the module, written first (its number
            // is its place among the functions); the loop's own text is the scan family's.
            Op::Scan(op) if matches!(me, Ssa::Value(_)) => {
                let f = self.body_function(&op.body)?;
                crate::ops::scan::emit_scan(self.line(me, node), op, &f)
            }
            Op::While(op) if matches!(me, Ssa::Value(_)) => {
                let f = self.body_function(&op.body)?;
                crate::ops::scan::emit_while(self.line(me, node), op, &f)
            }
            Op::Scan(_) | Op::While(_) => Ok(()),
            // Named as parts of their scan's `while`; no line of their own.
            Op::Result { .. } => Ok(()),
            Op::Shard(spec) if partitioned => {
                let spec = match &self.rename {
                    Some(mesh) => spec.canonical_in(mesh),
                    None => spec.clone(),
                };
                let sdy = crate::shard::ProgramSharding::sdy(Some(&spec), node.ty.dims.len());
                let sdy = sdy.trim_start_matches("#sdy.sharding");
                writeln!(out, "    {me} = sdy.sharding_constraint {an} {sdy} : {ty}")
            }
            // Not partitioned: the value itself, as a same-type reshape XLA removes.
            Op::Shard(_) => writeln!(out, "    {me} = stablehlo.reshape {an} : ({at}) -> {ty}"),
            Op::AllReduce => {
                let scalar = Ty(Some(&LeafType {
                    dtype: node.ty.dtype,
                    dims: Vec::new(),
                }));
                let replicas = self.graph.replicas.max(1);
                writeln!(out, "    {me} = \"stablehlo.all_reduce\"({an}) ({{")?;
                writeln!(out, "      ^bb0(%lhs: {scalar}, %rhs: {scalar}):")?;
                writeln!(out, "        %sum = stablehlo.add %lhs, %rhs : {scalar}")?;
                writeln!(out, "        stablehlo.return %sum : {scalar}")?;
                let group: Vec<usize> = (0..replicas).collect();
                writeln!(
                    out,
                    "    }}) {{replica_groups = dense<[{}]> : tensor<1x{replicas}xi64>}} : ({at}) -> {ty}",
                    List(&group)
                )
            }
        }
    }
}

/// The position of a scan's result `index` among its `while`'s results: the counter, the
/// carry, the stacked inputs, the invariants (a scan with `operands` operands), then the
/// stacked outputs.
fn while_result(op: &ScanOp, operands: usize, index: usize) -> usize {
    if index < op.carry {
        1 + index
    } else {
        1 + operands + (index - op.carry)
    }
}

impl Emitter<'_, '_> {
    /// The [`Line`] an op family writes `node` (named `me`) with: its name and number, its
    /// type, its operands' names and types.
    fn line(&mut self, me: Ssa, node: &Node) -> Line<'_> {
        let n = match me {
            Ssa::Value(n) => n.to_string(),
            _ => String::new(),
        };
        let (args, arg_tys) = node
            .inputs
            .iter()
            .map(|&i| (self.name(i).to_string(), self.ty(i).to_string()))
            .unzip();
        let arg_types = node
            .inputs
            .iter()
            .filter_map(|&i| self.ty(i).0.cloned())
            .collect();
        Line {
            out: &mut self.out,
            me: me.to_string(),
            n,
            ty: Ty(Some(&node.ty)).to_string(),
            args,
            arg_tys,
            arg_types,
        }
    }

    /// `body` as a private function of the module; returns its name. A body identical to one
    /// emitted before (the same text but for its name, nested bodies deduplicated first) is
    /// that function: nothing new is emitted.
    fn body_function(&mut self, body: &Graph) -> Result<String, fmt::Error> {
        let k = self.bodies.texts.len();
        self.bodies.texts.push(String::new());
        let name = format!("@scan{k}");
        let partitioned = self.partitioned;
        let rename = self.rename.clone();
        let text = {
            let mut e = Emitter::new(body, self.bodies);
            e.partitioned = partitioned;
            e.rename = rename;
            e.function(&format!("private {name}"), &EmitOptions::default())?;
            e.out
        };
        // The text without its own name: the `func.func private @scanK(` of its first line.
        let anonymous = text.replacen(&format!("{name}("), "(", 1);
        if let Some(&first) = self.bodies.seen.get(&anonymous) {
            // Its nested bodies were deduplicated to earlier functions, so nothing after `k`
            // is new.
            self.bodies.texts.truncate(k);
            return Ok(format!("@scan{first}"));
        }
        self.bodies.seen.insert(anonymous, k);
        self.bodies.texts[k] = text;
        Ok(name)
    }
}

/// Writes a constant's `dense<...>` literal (without its type); `dims` shape a `bool` list.
fn dense(out: &mut String, data: &ArrayData, dims: &[usize]) {
    if data.is_empty() {
        out.push_str("dense<>");
        return;
    }
    match data {
        ArrayData::F32(v) => match splat_by(v, |x| x.to_bits()) {
            Some(bits) => push_bits_splat(out, &bits.to_be_bytes()),
            None => hex_string(out, v, |x| x.to_le_bytes()),
        },
        ArrayData::F64(v) => match splat_by(v, |x| x.to_bits()) {
            Some(bits) => push_bits_splat(out, &bits.to_be_bytes()),
            None => hex_string(out, v, |x| x.to_le_bytes()),
        },
        ArrayData::I32(v) => match splat_by(v, |x| x) {
            Some(x) => push_int_splat(out, x),
            None => hex_string(out, v, |x| x.to_le_bytes()),
        },
        ArrayData::I64(v) => match splat_by(v, |x| x) {
            Some(x) => push_int_splat(out, x),
            None => hex_string(out, v, |x| x.to_le_bytes()),
        },
        ArrayData::U8(v) => match splat_by(v, |x| x) {
            Some(x) => push_int_splat(out, x),
            None => hex_string(out, v, |x| [x]),
        },
        ArrayData::BF16(v) => match splat_by(v, |x| x.to_bits()) {
            Some(bits) => push_bits_splat(out, &bits.to_be_bytes()),
            None => hex_string(out, v, |x| x.to_bits().to_le_bytes()),
        },
        ArrayData::F16(v) => match splat_by(v, |x| x.to_bits()) {
            Some(bits) => push_bits_splat(out, &bits.to_be_bytes()),
            None => hex_string(out, v, |x| x.to_bits().to_le_bytes()),
        },
        ArrayData::U32(v) => match splat_by(v, |x| x) {
            Some(x) => push_int_splat(out, x),
            None => hex_string(out, v, |x| x.to_le_bytes()),
        },
        ArrayData::Bool(v) => match splat_by(v, |x| x) {
            Some(x) => out.push_str(if x { "dense<true>" } else { "dense<false>" }),
            None => bool_list(out, v, dims),
        },
    }
}

/// `Some(key)` when every element has the same key (the data is not empty).
fn splat_by<T: Copy, K: PartialEq>(v: &[T], key: impl Fn(T) -> K) -> Option<K> {
    let (&first, rest) = v.split_first()?;
    let k = key(first);
    rest.iter().all(|&x| key(x) == k).then_some(k)
}

const HEX_DIGITS: &[u8; 16] = b"0123456789ABCDEF";

/// `dense<0x3F800000>`: one element's bit pattern, most significant digit first.
fn push_bits_splat(out: &mut String, be_bytes: &[u8]) {
    out.push_str("dense<0x");
    for &b in be_bytes {
        out.push(HEX_DIGITS[usize::from(b >> 4)] as char);
        out.push(HEX_DIGITS[usize::from(b & 15)] as char);
    }
    out.push('>');
}

/// `dense<-1>`.
fn push_int_splat(out: &mut String, x: impl fmt::Display) {
    let _ = write!(out, "dense<{x}>");
}

/// `dense<"0x...">`: every element's little-endian bytes in row-major order, two hex digits a
/// byte. Digits go through a small stack buffer into the `String`, with no per-element
/// formatting.
fn hex_string<T: Copy, const N: usize>(out: &mut String, v: &[T], le_bytes: impl Fn(T) -> [u8; N]) {
    const CHUNK: usize = 4096;
    out.reserve(v.len() * N * 2 + 12);
    out.push_str("dense<\"0x");
    let mut buf = [0u8; CHUNK];
    let mut len = 0;
    for &x in v {
        if len + 2 * N > CHUNK {
            flush_ascii(out, &buf[..len]);
            len = 0;
        }
        for b in le_bytes(x) {
            buf[len] = HEX_DIGITS[usize::from(b >> 4)];
            buf[len + 1] = HEX_DIGITS[usize::from(b & 15)];
            len += 2;
        }
    }
    flush_ascii(out, &buf[..len]);
    out.push_str("\">");
}

/// Appends bytes that are ASCII hex digits.
fn flush_ascii(out: &mut String, ascii: &[u8]) {
    // Only `HEX_DIGITS` bytes reach here, so this is always valid UTF-8.
    match std::str::from_utf8(ascii) {
        Ok(s) => out.push_str(s),
        Err(_) => out.extend(ascii.iter().map(|&b| char::from(b))),
    }
}

/// `dense<[[true, false], [false, true]]>`: a list nested to follow `dims`.
fn bool_list(out: &mut String, v: &[bool], dims: &[usize]) {
    out.reserve(v.len() * 7 + 8);
    out.push_str("dense<");
    nested(out, v, dims);
    out.push('>');
}

fn nested(out: &mut String, v: &[bool], dims: &[usize]) {
    let Some((&n, inner)) = dims.split_first() else {
        out.push_str(match v.first() {
            Some(true) => "true",
            _ => "false",
        });
        return;
    };
    // Constants are `Array`s, within the size limit, so this never saturates.
    let step = inner.iter().fold(1usize, |n, &d| n.saturating_mul(d));
    out.push('[');
    for i in 0..n {
        if i > 0 {
            out.push_str(", ");
        }
        let part = v.get(i * step..(i + 1) * step).unwrap_or(&[]);
        nested(out, part, inner);
    }
    out.push(']');
}
