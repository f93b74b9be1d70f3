//! Backends that run graphs: XLA through a PJRT plugin ([`pjrt`]), and the reference
//! interpreter ([`interp`]), which is the semantic oracle in tests and the fallback when no plugin
//! is installed.
//!
//! [`current`] picks one: XLA when a plugin is found, else the interpreter (saying so in one log
//! line); `NITRO_BACKEND=xla|interp` forces one, and forcing XLA without a plugin is an error.
//! The compile cache sees a backend through the [`Backend`] trait: an identity for its keys,
//! `compile`, and `load` of a serialized executable.

pub mod interp;
pub mod pjrt;

use std::fmt;
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};
use crate::hash::Digest;
use crate::trace::Graph;
use crate::tree::{Array, LeafType};

/// What identifies a backend in compile-cache keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Digest of everything that makes compiled code valid here: for XLA, the plugin file's
    /// digest, PJRT API version, platform and host CPU features.
    pub digest: Digest,
    /// Digest of the compile options.
    pub options: Digest,
    /// The same, in words, for explanations.
    pub description: String,
    /// The identity's components, named (`plugin file digest`, `PJRT API version`, `platform
    /// name`, `CPU features`, `devices`, …), so that a `backend_changed` miss can say which one
    /// differs.
    pub components: Vec<(String, String)>,
}

impl Identity {
    /// The platform name its programs run on (`cpu`, `cuda`, …), when it has one (the
    /// interpreter has none).
    pub fn platform(&self) -> Option<&str> {
        self.components
            .iter()
            .find(|(name, _)| name == "platform name")
            .map(|(_, value)| value.as_str())
    }

    /// The first component that differs between `before` and `now` (as `(name, before's
    /// value, now's value)`); a component present on one side only counts as differing.
    /// `None` when they agree.
    pub fn first_difference(
        before: &[(String, String)],
        now: &[(String, String)],
    ) -> Option<(String, String, String)> {
        let value = |list: &[(String, String)], name: &str| {
            list.iter()
                .find(|(n, _)| n == name)
                .map_or_else(|| "absent".to_owned(), |(_, v)| v.clone())
        };
        now.iter()
            .map(|(n, _)| n)
            .chain(before.iter().map(|(n, _)| n))
            .find_map(|name| {
                let (a, b) = (value(before, name), value(now, name));
                (a != b).then(|| (name.clone(), a, b))
            })
    }
}

/// What XLA planned for one run of a compiled program on one device (for a partitioned
/// program, one partition), from the plugin's memory statistics
/// (`PJRT_Executable_GetCompiledMemoryStats`), in bytes. These are the compiler's figures, not
/// a measurement: what buffer assignment reserved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CompiledMemory {
    /// The program's arguments (a partitioned program's argument shards).
    pub arguments: u64,
    /// Its results.
    pub outputs: u64,
    /// The part of `outputs` written into donated arguments' buffers (not allocated again).
    pub aliased: u64,
    /// Scratch space a run needs beyond its arguments and results: the intermediates, such
    /// as activations kept for the backward pass.
    pub temporaries: u64,
    /// The generated code.
    pub code: u64,
}

impl CompiledMemory {
    /// What one run holds at once on the device: arguments, the results not written in
    /// place, and the temporaries.
    pub fn run_bytes(&self) -> u64 {
        self.arguments + self.outputs.saturating_sub(self.aliased) + self.temporaries
    }
}

/// A backend the compile cache can compile for.
pub trait Backend: Send + Sync + fmt::Debug {
    /// The backend's identity (part of every cache key).
    fn identity(&self) -> &Identity;
    /// Whether its executables can be stored in the persistent cache.
    fn persistent(&self) -> bool;
    /// Compiles a traced graph (whose StableHLO `text` was emitted from it).
    fn compile(&self, graph: &Graph, text: &str) -> Result<Box<dyn Executable>>;
    /// Loads an executable that [`Executable::serialize`] produced for `graph`.
    fn load(&self, payload: &[u8], graph: &Graph) -> Result<Box<dyn Executable>>;
    /// The PJRT client whose device buffers this backend's executables take, when values can
    /// stay on a device between runs; `None` for the interpreter (its values are host arrays).
    fn device(&self) -> Option<&'static pjrt::Client> {
        None
    }
    /// How many devices its programs run on at once, one replica each (1 for one device). Part
    /// of the identity: a program for 4 replicas is never served for 2.
    fn replicas(&self) -> usize {
        1
    }
    /// The mesh and sharding its programs are partitioned over by XLA's SPMD partitioner
    /// ([`for_mesh`]); `None` for programs that run whole on each device. Part of the identity.
    fn partitioning(&self) -> Option<&crate::shard::Partitioning> {
        None
    }
    /// How many devices hold a value kept between runs: one per replica, or one per partition.
    fn devices(&self) -> usize {
        self.partitioning()
            .map_or_else(|| self.replicas(), crate::shard::Partitioning::devices)
    }
}

/// A compiled program.
pub trait Executable: Send + Sync + fmt::Debug {
    /// Runs on host arrays (checked against the program's input types first).
    fn run(&self, inputs: &[&Array]) -> Result<Vec<Array>>;
    /// Runs a replicated program on host arrays: one input list per replica, one output list
    /// per replica back.
    fn run_replicas(&self, inputs: &[&[&Array]]) -> Result<Vec<Vec<Array>>>;
    /// The bytes the persistent cache stores.
    fn serialize(&self) -> Result<Vec<u8>>;
    /// Estimated size in memory, in bytes.
    fn size_bytes(&self) -> u64;
    /// The XLA executable, when this is one (for device-resident execution).
    fn as_pjrt(&self) -> Option<&pjrt::Executable> {
        None
    }
    /// How many replicas it runs as (one per device).
    fn replicas(&self) -> usize {
        1
    }
    /// What the compiler planned for one run on one device, where the backend reports it
    /// (XLA's memory statistics); `None` otherwise (the interpreter).
    fn memory(&self) -> Option<CompiledMemory> {
        None
    }
}

/// The reference interpreter as a [`Backend`]. Compiling is keeping the graph; its "serialized
/// executable" is the StableHLO text, and loading checks that text against the graph, so the
/// persistent cache behaves the same on both backends.
#[derive(Debug)]
pub struct Interpreter {
    identity: Identity,
    replicas: usize,
}

#[derive(Debug)]
struct InterpExecutable {
    graph: Arc<Graph>,
    text_len: u64,
    text: Arc<str>,
}

impl Executable for InterpExecutable {
    fn run(&self, inputs: &[&Array]) -> Result<Vec<Array>> {
        interp::run_refs(&self.graph, inputs)
    }

    fn run_replicas(&self, inputs: &[&[&Array]]) -> Result<Vec<Vec<Array>>> {
        interp::run_replicas(&self.graph, inputs)
    }

    fn replicas(&self) -> usize {
        self.graph.replicas.max(1)
    }

    fn serialize(&self) -> Result<Vec<u8>> {
        Ok(self.text.as_bytes().to_vec())
    }

    fn size_bytes(&self) -> u64 {
        self.text_len
    }
}

impl Backend for Interpreter {
    fn identity(&self) -> &Identity {
        &self.identity
    }

    fn persistent(&self) -> bool {
        true
    }

    fn replicas(&self) -> usize {
        self.replicas
    }

    fn compile(&self, graph: &Graph, text: &str) -> Result<Box<dyn Executable>> {
        same_replicas(self.replicas, graph)?;
        Ok(Box::new(InterpExecutable {
            graph: Arc::new(graph.clone()),
            text_len: text.len() as u64,
            text: Arc::from(text),
        }))
    }

    fn load(&self, payload: &[u8], graph: &Graph) -> Result<Box<dyn Executable>> {
        // The stored text is the compiled one, donation attributes included; the graph does not
        // record donation, so those are set aside before comparing.
        let stored =
            std::str::from_utf8(payload).map_err(|_| Error::InvalidSerializedExecutable {
                reason: "the stored program is not text".into(),
            })?;
        if without_donation(stored) != crate::emit::emit(graph) {
            return Err(Error::InvalidSerializedExecutable {
                reason: "the stored program is not the traced one".into(),
            });
        }
        self.compile(graph, stored)
    }
}

/// StableHLO text with every argument's ` {tf.aliasing_output = K : i32}` removed: the text
/// [`crate::emit::emit`] gives for the same graph without donation.
fn without_donation(text: &str) -> String {
    const OPEN: &str = " {tf.aliasing_output = ";
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(OPEN) {
        out.push_str(&rest[..at]);
        let after = &rest[at + OPEN.len()..];
        match after.find(" : i32}") {
            Some(end) if after[..end].bytes().all(|b| b.is_ascii_digit()) => {
                rest = &after[end + " : i32}".len()..];
            }
            _ => {
                out.push_str(OPEN);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// An error unless `graph` runs as `replicas` replicas (the backend's count).
fn same_replicas(replicas: usize, graph: &Graph) -> Result<()> {
    if graph.replicas.max(1) == replicas {
        return Ok(());
    }
    Err(Error::ReplicaCount {
        expected: replicas,
        got: graph.replicas.max(1),
    })
}

/// The interpreter backend (one device).
pub fn interpreter() -> &'static Interpreter {
    static INTERP: OnceLock<Interpreter> = OnceLock::new();
    INTERP.get_or_init(|| Interpreter::with_replicas(1))
}

/// The interpreter running programs as `replicas` replicas in lockstep (see
/// [`interp::run_replicas`]): the reference for data-parallel programs. One backend per count,
/// made once per process.
pub fn interpreter_for(replicas: usize) -> &'static Interpreter {
    if replicas <= 1 {
        return interpreter();
    }
    static MORE: std::sync::Mutex<Vec<&'static Interpreter>> = std::sync::Mutex::new(Vec::new());
    let mut more = MORE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = more.iter().find(|i| i.replicas == replicas) {
        return i;
    }
    let made: &'static Interpreter = Box::leak(Box::new(Interpreter::with_replicas(replicas)));
    more.push(made);
    made
}

impl Interpreter {
    fn with_replicas(replicas: usize) -> Interpreter {
        let mut description = format!("nitro interpreter {}", env!("CARGO_PKG_VERSION"));
        let mut components = vec![
            ("backend".to_owned(), "nitro interpreter".to_owned()),
            ("version".to_owned(), env!("CARGO_PKG_VERSION").to_owned()),
        ];
        // A one-device identity is what it was before replicas existed (its entries stay valid).
        if replicas > 1 {
            description.push_str(&format!(", {replicas} replicas"));
            components.push(("devices".to_owned(), replicas.to_string()));
        }
        Interpreter {
            identity: Identity {
                digest: Digest::of(description.as_str()),
                options: Digest::of(""),
                components,
                description,
            },
            replicas,
        }
    }
}

/// XLA through a PJRT plugin as a [`Backend`].
#[derive(Debug)]
pub struct Xla {
    client: &'static pjrt::Client,
    identity: Identity,
    replicas: usize,
    partitioning: Option<crate::shard::Partitioning>,
}

#[derive(Debug)]
struct XlaExecutable {
    exe: pjrt::Executable,
    size: u64,
}

impl Executable for XlaExecutable {
    fn run(&self, inputs: &[&Array]) -> Result<Vec<Array>> {
        self.exe.execute_host(inputs)
    }

    fn run_replicas(&self, inputs: &[&[&Array]]) -> Result<Vec<Vec<Array>>> {
        self.exe.execute_host_replicas(inputs)
    }

    fn replicas(&self) -> usize {
        self.exe.replicas()
    }

    fn serialize(&self) -> Result<Vec<u8>> {
        self.exe.serialize()
    }

    fn size_bytes(&self) -> u64 {
        self.size
    }

    fn as_pjrt(&self) -> Option<&pjrt::Executable> {
        Some(&self.exe)
    }

    fn memory(&self) -> Option<CompiledMemory> {
        match self.exe.memory_stats() {
            Ok(stats) => stats,
            Err(e) => {
                tracing::debug!("the plugin's memory statistics are unavailable: {e}");
                None
            }
        }
    }
}

/// Refuses a graph holding a type over the size limit ([`crate::MAX_TENSOR_BYTES`]), which
/// XLA would abort on. Traced graphs never hold one (tracing checks every node); this guards
/// hand-built ones.
fn check_sizes(graph: &Graph) -> Result<()> {
    let inputs = graph.inputs.iter().map(|i| &i.ty);
    let nodes = graph.nodes.iter().map(|n| &n.ty);
    match inputs
        .chain(nodes)
        .enumerate()
        .find(|(_, t)| !t.within_limit())
    {
        None => Ok(()),
        Some((k, ty)) => {
            let (node, op) = match k.checked_sub(graph.inputs.len()) {
                Some(id) => (id as u32, graph.nodes[id].op.name()),
                None => (graph.inputs[k].node, "parameter"),
            };
            Err(Error::InvalidGraph {
                node,
                op,
                message: format!(
                    "its type {ty} is over the size limit (nitro::MAX_TENSOR_BYTES, 2^63 - 1 \
                     bytes), which XLA cannot hold"
                ),
            })
        }
    }
}

/// The graph's input names (leaf paths), for input-type errors.
fn input_names(graph: &Graph) -> impl Iterator<Item = String> + '_ {
    graph.inputs.iter().map(|i| i.name.clone())
}

/// The graph's input and output types as one device holds them: its global types, or one
/// shard of each when it is partitioned.
fn types_of(graph: &Graph) -> (Vec<LeafType>, Vec<LeafType>) {
    let (inputs, outputs) = (graph.input_types(), graph.output_types());
    match &graph.sharding {
        None => (inputs, outputs),
        Some(s) => {
            let shard = |types: Vec<LeafType>, specs: &[crate::shard::PartitionSpec]| {
                types
                    .iter()
                    .enumerate()
                    .map(|(i, t)| match specs.get(i) {
                        Some(spec) => spec.shard_type(&s.mesh, t),
                        None => t.clone(),
                    })
                    .collect()
            };
            (shard(inputs, &s.inputs), shard(outputs, &s.outputs))
        }
    }
}

impl Xla {
    /// The XLA backend on the process-wide client of the discovered plugin.
    pub fn new(client: &'static pjrt::Client) -> Result<Xla> {
        Xla::replicated(client, 1)
    }

    /// The XLA backend for programs replicated over `replicas` devices of `client` (which must
    /// have that many: [`Error::Devices`] otherwise).
    pub fn replicated(client: &'static pjrt::Client, replicas: usize) -> Result<Xla> {
        let replicas = replicas.max(1);
        client.check_replicas(replicas)?;
        let id = client.identity_for(replicas)?;
        let mut description = client.describe();
        if replicas > 1 {
            description.push_str(&format!("; programs replicated over {replicas} devices"));
        }
        Ok(Xla {
            client,
            identity: Identity {
                digest: id.digest(),
                options: id.compile_options_digest,
                description,
                components: std::iter::once(("backend", "XLA (PJRT plugin)".to_owned()))
                    .chain(id.components())
                    .map(|(name, value)| (name.to_owned(), value))
                    .collect(),
            },
            replicas,
            partitioning: None,
        })
    }

    /// The XLA backend for programs partitioned by XLA's SPMD partitioner over `partitioning`'s
    /// mesh, partition `p` on device `p` of `client` (which must have that many devices). Its
    /// identity's digest holds the mesh's shape (the axes' sizes, in order), not its axis names
    /// or the sharding's rules: a partitioned executable depends on how many partitions it has
    /// and how its program splits its arrays, and the program's text says the latter (with the
    /// axes named by position). So two shardings that split every array alike share programs,
    /// while the cache's key components hold the resolved per-leaf specs and the axis names,
    /// and a sharding that splits differently misses naming the leaf and both specs.
    pub fn partitioned(
        client: &'static pjrt::Client,
        partitioning: crate::shard::Partitioning,
    ) -> Result<Xla> {
        let devices = partitioning.devices();
        client.check_replicas(devices)?;
        let mut xla = Xla::replicated(client, 1)?;
        let described = partitioning.describe();
        xla.identity.digest = Digest::of(&format!(
            "{}|partitioned over a mesh of shape {:?}",
            xla.identity.digest,
            partitioning.mesh().shape()
        ));
        xla.identity.options = Digest::from(blake3::hash(&pjrt::spmd_compile_options(devices)));
        xla.identity.description.push_str(&format!(
            "; programs partitioned over {devices} devices ({described})"
        ));
        xla.identity
            .components
            .push(("sharding".to_owned(), described));
        xla.partitioning = Some(partitioning);
        Ok(xla)
    }

    /// The PJRT client.
    pub fn client(&self) -> &'static pjrt::Client {
        self.client
    }
}

impl Backend for Xla {
    fn identity(&self) -> &Identity {
        &self.identity
    }

    fn replicas(&self) -> usize {
        self.replicas
    }

    fn partitioning(&self) -> Option<&crate::shard::Partitioning> {
        self.partitioning.as_ref()
    }

    fn persistent(&self) -> bool {
        true
    }

    fn compile(&self, graph: &Graph, text: &str) -> Result<Box<dyn Executable>> {
        check_sizes(graph)?;
        same_replicas(self.replicas, graph)?;
        let (inputs, outputs) = types_of(graph);
        let exe = match (&self.partitioning, &graph.sharding) {
            (Some(p), Some(_)) => {
                self.client
                    .compile_partitioned(text, &inputs, &outputs, p.devices())?
            }
            (Some(p), None) => {
                return Err(Error::Sharding {
                    what: "a program for this backend".into(),
                    problem: format!(
                        "it was traced without the shardings of the backend's mesh ({}); trace                          it through the compile cache",
                        p.describe()
                    ),
                })
            }
            (None, _) => self
                .client
                .compile_replicated(text, &inputs, &outputs, self.replicas)?,
        }
        .with_input_names(input_names(graph));
        let size = text.len() as u64;
        Ok(Box::new(XlaExecutable { exe, size }))
    }

    fn device(&self) -> Option<&'static pjrt::Client> {
        Some(self.client)
    }

    fn load(&self, payload: &[u8], graph: &Graph) -> Result<Box<dyn Executable>> {
        same_replicas(self.replicas, graph)?;
        let exe = self.client.deserialize(payload)?;
        let (inputs, outputs) = types_of(graph);
        let devices = self.devices();
        if exe.replicas() != devices || exe.partitioned() != self.partitioning.is_some() {
            return Err(Error::InvalidSerializedExecutable {
                reason: format!(
                    "the stored executable runs on {} device(s){}, the traced program on \
                     {devices}{}",
                    exe.replicas(),
                    if exe.partitioned() {
                        " partitioned"
                    } else {
                        ""
                    },
                    if self.partitioning.is_some() {
                        " partitioned"
                    } else {
                        ""
                    },
                ),
            });
        }
        if exe.inputs() != inputs.as_slice() || exe.outputs() != outputs.as_slice() {
            return Err(Error::InvalidSerializedExecutable {
                reason: "the stored executable's signature is not the traced program's".into(),
            });
        }
        Ok(Box::new(XlaExecutable {
            exe: exe.with_input_names(input_names(graph)),
            size: payload.len() as u64,
        }))
    }
}

/// The XLA backend, if a plugin is installed (or named by `NITRO_PJRT_PLUGIN`).
pub fn xla() -> Result<&'static Xla> {
    // Only success is kept: after a failure (no plugin yet), a later call tries again.
    static XLA: OnceLock<Xla> = OnceLock::new();
    if let Some(x) = XLA.get() {
        return Ok(x);
    }
    let made = Xla::new(pjrt::client()?)?;
    Ok(XLA.get_or_init(|| made))
}

/// The XLA backend whose programs run on `devices` devices at once (one replica each), on a
/// client with that many devices ([`pjrt::client_for`]); one backend per count, made once per
/// process. `xla_for(1)` is [`xla`].
pub fn xla_for(devices: usize) -> Result<&'static Xla> {
    if devices <= 1 {
        return xla();
    }
    static MORE: std::sync::Mutex<Vec<&'static Xla>> = std::sync::Mutex::new(Vec::new());
    let mut more = MORE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(x) = more.iter().find(|x| x.replicas == devices) {
        return Ok(x);
    }
    let made: &'static Xla = Box::leak(Box::new(Xla::replicated(
        pjrt::client_for(devices)?,
        devices,
    )?));
    more.push(made);
    Ok(made)
}

pub use crate::shard::MAX_DEVICES;

/// The backend [`current`] picks, for programs replicated over `devices` devices: XLA on a
/// client with that many devices, or the interpreter running that many replicas.
/// [`Error::Devices`] for zero devices, more than [`MAX_DEVICES`], or more than the plugin can
/// give.
pub fn for_devices(devices: usize) -> Result<&'static dyn Backend> {
    check_device_count(devices, "a backend")?;
    match pjrt::selected()? {
        Some(_) => Ok(xla_for(devices)? as &'static dyn Backend),
        None => {
            current()?;
            Ok(interpreter_for(devices))
        }
    }
}

/// Refuses a device count of 0 or past [`MAX_DEVICES`], asked for by `what`.
pub(crate) fn check_device_count(devices: usize, what: &str) -> Result<usize> {
    let reason = if devices == 0 {
        "a program runs on at least one device".to_owned()
    } else if devices > MAX_DEVICES {
        format!("a handle uses at most {MAX_DEVICES} devices; ask for fewer")
    } else {
        return Ok(devices);
    };
    Err(Error::Devices {
        what: what.to_owned(),
        requested: devices,
        reason,
    })
}

/// The backend [`current`] picks, for programs partitioned over `partitioning`'s mesh by XLA's
/// SPMD partitioner: XLA on a client with that many devices (one backend per partitioning,
/// made once per process), or the interpreter, which runs the unpartitioned program on one
/// device (the same values; the semantic oracle).
pub fn for_mesh(partitioning: &crate::shard::Partitioning) -> Result<&'static dyn Backend> {
    match pjrt::selected()? {
        None => {
            current()?;
            Ok(interpreter())
        }
        Some(_) => {
            static MADE: std::sync::Mutex<Vec<&'static Xla>> = std::sync::Mutex::new(Vec::new());
            let mut made = MADE.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(x) = made
                .iter()
                .find(|x| x.partitioning.as_ref() == Some(partitioning))
            {
                return Ok(*x);
            }
            let client = pjrt::client_for(partitioning.devices())?;
            let x: &'static Xla =
                Box::leak(Box::new(Xla::partitioned(client, partitioning.clone())?));
            made.push(x);
            Ok(x)
        }
    }
}

/// The backend nitro runs on: XLA when a plugin is found (or `NITRO_BACKEND=xla`), else the
/// interpreter, announced once in the log.
pub fn current() -> Result<&'static dyn Backend> {
    match pjrt::selected()? {
        Some(_) => Ok(xla()? as &'static dyn Backend),
        None => {
            static ONCE: OnceLock<()> = OnceLock::new();
            ONCE.get_or_init(|| {
                tracing::info!(
                    "nitro: no XLA plugin selected; running on the reference interpreter"
                );
            });
            Ok(interpreter())
        }
    }
}

/// One line saying which backend [`current`] picks and why.
pub fn describe() -> String {
    match current() {
        Ok(b) => b.identity().description.clone(),
        Err(e) => format!("no backend: {e}"),
    }
}
