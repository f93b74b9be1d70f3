//! Compiled programs: compile, execute, serialize, load.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::hash::Digest;
use crate::tree::{Array, LeafType};

use super::buffer::{dtype_of, DeviceBuffer};
use super::client::{Client, ClientInner};
use super::ffi::{
    self, code_name, names, Api, RawBuffer, RawEvent, RawExecutable, RawLoadedExecutable,
};
use super::identity::BackendIdentity;
use super::{compile_options, COMPILE_OPTIONS};

/// A program compiled for one PJRT client, with the input and output types it was declared with.
///
/// `Executable` is `Send + Sync`: PJRT executables may be run from several threads at once.
/// Dropping it destroys the PJRT executable (its client lives on while any executable or buffer
/// of it does).
pub struct Executable {
    client: Arc<ClientInner>,
    raw: *mut RawLoadedExecutable,
    inputs: Vec<LeafType>,
    /// The inputs' names (leaf paths) for errors; `argN` where none was given.
    input_names: Vec<String>,
    outputs: Vec<LeafType>,
    /// How many devices it runs on at once (replica `r` on the client's device `r`, or
    /// partition `p` on device `p`).
    replicas: usize,
    /// Whether XLA's SPMD partitioner split it over those devices (each then takes and gives
    /// its own shards) rather than running one copy per device.
    partitioned: bool,
}

// SAFETY: a `PJRT_LoadedExecutable` may be executed concurrently from several threads and
// destroyed from any thread (PjRtLoadedExecutable is thread-safe); `Executable` owns its pointer
// exclusively and its Rust fields are immutable.
unsafe impl Send for Executable {}
// SAFETY: see `Send`: `&self` methods only execute, serialize or query, all thread-safe in PJRT.
unsafe impl Sync for Executable {}

impl std::fmt::Debug for Executable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executable")
            .field("inputs", &self.inputs)
            .field("input_names", &self.input_names)
            .field("outputs", &self.outputs)
            .field("replicas", &self.replicas)
            .field("partitioned", &self.partitioned)
            .finish()
    }
}

/// One argument of [`Executable::execute_donating`].
#[derive(Debug)]
pub enum Arg<'a> {
    /// Passed by reference: never donated, still usable afterwards.
    Borrow(&'a DeviceBuffer),
    /// Passed by value: the program may reuse (donate) its memory for an output when the program
    /// text marks the input `tf.aliasing_output`; either way the buffer is consumed.
    Donate(DeviceBuffer),
}

impl<'a> From<&'a DeviceBuffer> for Arg<'a> {
    fn from(b: &'a DeviceBuffer) -> Arg<'a> {
        Arg::Borrow(b)
    }
}

impl From<DeviceBuffer> for Arg<'_> {
    fn from(b: DeviceBuffer) -> Self {
        Arg::Donate(b)
    }
}

impl Arg<'_> {
    fn buffer(&self) -> &DeviceBuffer {
        match self {
            Arg::Borrow(b) => b,
            Arg::Donate(b) => b,
        }
    }
}

/// What [`Executable::execute_donating`] and [`Executable::enqueue`] return.
#[derive(Debug)]
pub struct Executed {
    /// The program's outputs, in `return` order. After [`Executable::enqueue`] they may still
    /// be in the making: reading one waits for it, and passing one to another execution makes
    /// that execution wait for it on the device side, not on the host.
    pub outputs: Vec<DeviceBuffer>,
    /// The positions of the arguments passed by value whose memory XLA reused (PJRT deleted
    /// them). An argument passed by value but not donated by the program is simply freed.
    pub donated: Vec<usize>,
    /// When the execution finishes (already finished after
    /// [`execute_donating`](Executable::execute_donating)).
    pub done: Completion,
}

/// The end of an enqueued execution: an owned PJRT event. [`wait`](Completion::wait) blocks
/// until the execution has finished and reports its error, if it failed; dropping it without
/// waiting is fine (the execution goes on, and its outputs carry any error to whoever reads
/// them).
pub struct Completion {
    client: Option<Arc<ClientInner>>,
    raw: *mut RawEvent,
}

// SAFETY: a `PJRT_Event` may be awaited and destroyed from any thread; `Completion` owns its
// pointer exclusively.
unsafe impl Send for Completion {}
// SAFETY: `&Completion` exposes no call on the event (waiting takes it by value).
unsafe impl Sync for Completion {}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("pending", &!self.raw.is_null())
            .finish()
    }
}

impl Completion {
    /// A completion that has already happened.
    pub fn finished() -> Completion {
        Completion {
            client: None,
            raw: std::ptr::null_mut(),
        }
    }

    /// Waits until the execution has finished; its error if it failed.
    pub fn wait(mut self) -> Result<()> {
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        match self.client.take() {
            // SAFETY: `raw` is null or the live event this value owned; ownership moved here
            // (the field was nulled), so it is awaited and destroyed once.
            Some(c) => unsafe {
                c.plugin
                    .api
                    .await_event(names::loaded_executable_execute, raw)
            },
            None => Ok(()),
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if let Some(c) = &self.client {
            // SAFETY: the event is live (not yet awaited: `wait` nulls the field) and owned.
            unsafe { c.plugin.api.destroy_event(self.raw) };
        }
    }
}

/// A `PJRT_Executable` obtained from a loaded executable, destroyed on drop.
struct ExecRef {
    client: Arc<ClientInner>,
    raw: *mut RawExecutable,
}

impl Drop for ExecRef {
    fn drop(&mut self) {
        let plugin = self.client.plugin;
        if let Some(f) = plugin.api.fns.executable_destroy {
            let mut a = ffi::ExecutableDestroyArgs::new();
            a.executable = self.raw;
            // SAFETY: `self.raw` came from GetExecutable, which hands ownership to the caller;
            // destroyed exactly once, here.
            if let Err(e) = unsafe { plugin.api.check(names::executable_destroy, f(&mut a)) } {
                tracing::debug!("ignoring a failure to destroy a PJRT executable: {e}");
            }
        }
    }
}

/// The magic bytes that start a serialized nitro executable (format version 1).
const MAGIC: &[u8; 16] = b"NITRO-PJRT-EXE\x00\x01";

/// The header of a serialized executable: who built it, for which signature, and a checksum of
/// the plugin's bytes.
#[derive(serde::Serialize, serde::Deserialize)]
struct Header {
    identity: BackendIdentity,
    inputs: Vec<LeafType>,
    /// The inputs' names; absent in executables serialized before names were kept.
    #[serde(default)]
    input_names: Vec<String>,
    outputs: Vec<LeafType>,
    payload_len: u64,
    payload_digest: Digest,
    /// Whether the program was partitioned by XLA's SPMD partitioner over `identity.replicas`
    /// devices (its compile options are then the SPMD ones); absent before partitioned
    /// executables were serialized.
    #[serde(default)]
    partitioned: bool,
}

fn invalid(reason: impl Into<String>) -> Error {
    Error::InvalidSerializedExecutable {
        reason: reason.into(),
    }
}

/// Splits serialized bytes into header and payload, checking the envelope (not the identity).
fn parse(bytes: &[u8]) -> Result<(Header, &[u8])> {
    let rest = bytes
        .strip_prefix(MAGIC.as_slice())
        .ok_or_else(|| invalid("they do not start with nitro's magic bytes (format 1)"))?;
    let (len, rest) = rest
        .split_first_chunk::<8>()
        .ok_or_else(|| invalid("they end inside the header length"))?;
    let len = usize::try_from(u64::from_le_bytes(*len))
        .map_err(|_| invalid("the header length is out of range"))?;
    if rest.len() < len {
        return Err(invalid("they end inside the header"));
    }
    let (json, payload) = rest.split_at(len);
    let header: Header = serde_json::from_slice(json)
        .map_err(|e| invalid(format!("the header is not readable: {e}")))?;
    if payload.len() as u64 != header.payload_len {
        return Err(invalid(format!(
            "the executable is {} bytes but the header says {}",
            payload.len(),
            header.payload_len
        )));
    }
    Ok((header, payload))
}

/// The identity of the backend that built a serialized executable, read from its header without
/// loading anything (for caches that keep entries of several backends).
pub fn serialized_identity(bytes: &[u8]) -> Result<BackendIdentity> {
    parse(bytes).map(|(h, _)| h.identity)
}

/// The error for an execution that produced no run (never expected).
fn no_run() -> Error {
    Error::Pjrt {
        call: names::loaded_executable_execute,
        code: "nitro",
        message: "the execution returned no result for a device".into(),
    }
}

/// `arg0`, `arg1`, …: the names of inputs nobody named.
fn default_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("arg{i}")).collect()
}

/// The first non-empty line of an XLA message.
fn first_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("")
        .to_owned()
}

impl Executable {
    pub(crate) fn compile(
        client: &Arc<ClientInner>,
        mlir: &str,
        inputs: &[LeafType],
        outputs: &[LeafType],
        replicas: usize,
        partitioned: bool,
    ) -> Result<Executable> {
        const _: () = assert!(!COMPILE_OPTIONS.is_empty());
        let options = if partitioned {
            super::spmd_compile_options(replicas)
        } else {
            compile_options(replicas)
        };
        let plugin = client.plugin;
        let f = plugin.func(plugin.api.fns.client_compile, names::client_compile)?;
        // The C field is `char*`; hand it a private copy so nothing can write into `mlir`.
        let mut code = mlir.as_bytes().to_vec();
        let mut program = ffi::Program::new();
        program.code = code.as_mut_ptr();
        program.code_size = code.len();
        program.format = b"mlir".as_ptr();
        program.format_size = 4;
        let mut a = ffi::ClientCompileArgs::new();
        a.client = client.raw;
        a.program = &program;
        a.compile_options = options.as_ptr();
        a.compile_options_size = options.len();
        // SAFETY: `a` is a valid `PJRT_Client_Compile_Args`: a live client, a program whose code
        // and format outlive the call, and non-empty, well-formed compile options (empty options
        // abort the process inside XLA, so they are never sent).
        let err = unsafe { f(&mut a) };
        if !err.is_null() {
            // SAFETY: a non-null error just returned by this plugin.
            let (code, message) = unsafe { plugin.api.take_error(err) };
            return Err(Error::XlaCompile {
                code: code_name(code),
                first_line: first_line(&message),
                message,
            });
        }
        if a.executable.is_null() {
            return Err(Error::Pjrt {
                call: names::client_compile,
                code: "nitro",
                message: "the plugin returned no executable and no error".into(),
            });
        }
        let exe = Executable {
            client: client.clone(),
            raw: a.executable,
            inputs: inputs.to_vec(),
            input_names: default_names(inputs.len()),
            outputs: outputs.to_vec(),
            replicas,
            partitioned,
        };
        exe.check_outputs()?;
        Ok(exe)
    }

    /// How many devices the program runs on at once: 1, or the replica count it was compiled
    /// for ([`Client::compile_replicated`]).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// Whether it was partitioned by XLA's SPMD partitioner ([`Client::compile_partitioned`]):
    /// [`replicas`](Executable::replicas) then counts its partitions.
    pub fn partitioned(&self) -> bool {
        self.partitioned
    }

    /// The declared input types, in argument order.
    pub fn inputs(&self) -> &[LeafType] {
        &self.inputs
    }

    /// The inputs' names (leaf paths such as `layers[0].w`), in argument order: what input-type
    /// errors call them. `arg0`, `arg1`, … unless set with
    /// [`with_input_names`](Executable::with_input_names).
    pub fn input_names(&self) -> &[String] {
        &self.input_names
    }

    /// The executable with its inputs named `names` (in argument order), so that an argument of
    /// the wrong type is reported by its path, as the interpreter does. Names beyond the input
    /// count are ignored; inputs without one keep `argN`. The names are kept by
    /// [`serialize`](Executable::serialize).
    pub fn with_input_names(mut self, names: impl IntoIterator<Item = String>) -> Executable {
        for (slot, name) in self.input_names.iter_mut().zip(names) {
            *slot = name;
        }
        self
    }

    /// The declared output types, in `return` order.
    pub fn outputs(&self) -> &[LeafType] {
        &self.outputs
    }

    /// The client the executable runs on.
    pub fn client(&self) -> Client {
        Client {
            inner: self.client.clone(),
        }
    }

    fn executable(&self) -> Result<ExecRef> {
        let plugin = self.client.plugin;
        let f = plugin.func(
            plugin.api.fns.loaded_executable_get_executable,
            names::loaded_executable_get_executable,
        )?;
        let mut a = ffi::LoadedExecutableGetExecutableArgs::new();
        a.loaded_executable = self.raw;
        // SAFETY: valid args for a live loaded executable.
        unsafe {
            plugin
                .api
                .check(names::loaded_executable_get_executable, f(&mut a))
        }?;
        Ok(ExecRef {
            client: self.client.clone(),
            raw: a.executable,
        })
    }

    /// Checks the compiled program's outputs against the declared ones: the count always, the
    /// element types and dims when the plugin reports them.
    fn check_outputs(&self) -> Result<()> {
        let plugin = self.client.plugin;
        let api = &plugin.api;
        let e = self.executable()?;
        let f = plugin.func(
            api.fns.executable_num_outputs,
            names::executable_num_outputs,
        )?;
        let mut n = ffi::ExecutableNumOutputsArgs::new();
        n.executable = e.raw;
        // SAFETY: valid args for a live executable.
        unsafe { api.check(names::executable_num_outputs, f(&mut n)) }?;
        let count = n.num_outputs;
        if count != self.outputs.len() {
            return Err(Error::ProgramSignature {
                what: format!(
                    "returns {count} outputs, but {} were declared",
                    self.outputs.len()
                ),
            });
        }
        if let Some(f) = api.fns.executable_output_element_types {
            let mut t = ffi::ExecutableOutputElementTypesArgs::new();
            t.executable = e.raw;
            // SAFETY: valid args for a live executable.
            match unsafe { api.check(names::executable_output_element_types, f(&mut t)) } {
                Ok(())
                    if t.num_output_types == count && (count == 0 || !t.output_types.is_null()) =>
                {
                    let types: &[i32] = if count == 0 {
                        &[]
                    } else {
                        // SAFETY: the plugin returned `num_output_types` types, owned by the
                        // executable `e`, alive until `e` drops at the end of this function.
                        unsafe { std::slice::from_raw_parts(t.output_types, count) }
                    };
                    for (i, (&got, want)) in types.iter().zip(&self.outputs).enumerate() {
                        if dtype_of(got) != Some(want.dtype) {
                            let got = dtype_of(got)
                                .map_or_else(|| format!("PJRT type {got}"), |d| d.to_string());
                            return Err(Error::ProgramSignature {
                                what: format!(
                                    "output {i} has element type {got}, but {want} was declared"
                                ),
                            });
                        }
                    }
                }
                Ok(()) => {}
                Err(err) if Api::is_unimplemented(&err) => {}
                Err(err) => return Err(err),
            }
        }
        if let Some(f) = api.fns.executable_output_dimensions {
            let mut d = ffi::ExecutableOutputDimensionsArgs::new();
            d.executable = e.raw;
            d.num_outputs = count;
            // SAFETY: valid args for a live executable.
            match unsafe { api.check(names::executable_output_dimensions, f(&mut d)) } {
                Ok(()) if d.num_outputs == count && count > 0 && !d.dim_sizes.is_null() => {
                    // SAFETY: `dim_sizes` has `num_outputs` entries, owned by `e`.
                    let ranks = unsafe { std::slice::from_raw_parts(d.dim_sizes, count) };
                    let total: usize = ranks.iter().sum();
                    let dims: &[i64] = if total == 0 || d.dims.is_null() {
                        &[]
                    } else {
                        // SAFETY: `dims` has the sum of `dim_sizes` entries, owned by `e`.
                        unsafe { std::slice::from_raw_parts(d.dims, total) }
                    };
                    if dims.len() == total {
                        let mut at = 0;
                        for (i, (&rank, want)) in ranks.iter().zip(&self.outputs).enumerate() {
                            let got = &dims[at..at + rank];
                            at += rank;
                            let same = got.len() == want.dims.len()
                                && got.iter().zip(&want.dims).all(|(&g, &w)| g == w as i64);
                            if !same {
                                return Err(Error::ProgramSignature {
                                    what: format!(
                                        "output {i} has dims {got:?}, but {want} was declared"
                                    ),
                                });
                            }
                        }
                    }
                }
                Ok(()) => {}
                Err(err) if Api::is_unimplemented(&err) => {}
                Err(err) => return Err(err),
            }
        }
        Ok(())
    }

    /// The name of input `index`, for errors.
    fn input_name(&self, index: usize) -> String {
        self.input_names
            .get(index)
            .cloned()
            .unwrap_or_else(|| format!("arg{index}"))
    }

    /// Checks the arguments' count, client, device, dtypes and dims against the declared inputs
    /// of replica `replica`.
    fn check_args<'b>(
        &self,
        replica: usize,
        args: impl ExactSizeIterator<Item = &'b DeviceBuffer>,
    ) -> Result<()> {
        if args.len() != self.inputs.len() {
            return Err(Error::InputCount {
                expected: self.inputs.len(),
                got: args.len(),
            });
        }
        for (index, (b, want)) in args.zip(&self.inputs).enumerate() {
            if !Arc::ptr_eq(&b.client, &self.client) {
                return Err(Error::ForeignBuffer { index });
            }
            if b.device != replica {
                return Err(Error::Devices {
                    what: format!("argument {index} (`{}`)", self.input_name(index)),
                    requested: replica + 1,
                    reason: format!(
                        "it lives on device {}, but replica {replica} runs on device {replica}; \
                         upload each replica's arguments to its own device",
                        b.device
                    ),
                });
            }
            if b.leaf_type() != want {
                return Err(Error::InputType {
                    index,
                    name: self.input_name(index),
                    expected: want.clone(),
                    got: b.leaf_type().clone(),
                });
            }
        }
        Ok(())
    }

    /// Runs the program on device buffers (checked first) and returns its outputs, on the device.
    /// Arguments are never donated: a program that marks an input `tf.aliasing_output` gets a
    /// fresh output buffer instead (see [`execute_donating`](Executable::execute_donating)).
    /// Waits until the device has finished.
    pub fn execute(&self, args: &[&DeviceBuffer]) -> Result<Vec<DeviceBuffer>> {
        self.one_replica()?;
        self.check_args(0, args.iter().copied())?;
        let raws: Vec<*mut RawBuffer> = args.iter().map(|b| b.raw).collect();
        let keep: Vec<i64> = (0..args.len() as i64).collect();
        let mut runs = self.run(&[raws], &keep)?;
        let (outputs, done) = runs.pop().ok_or_else(no_run)?;
        done.wait()?;
        Ok(outputs)
    }

    /// An error for a replicated executable run as one.
    fn one_replica(&self) -> Result<()> {
        match self.replicas {
            1 => Ok(()),
            n => Err(Error::ReplicaCount {
                expected: n,
                got: 1,
            }),
        }
    }

    /// Runs the program, letting it reuse the memory of the arguments passed by value
    /// ([`Arg::Donate`]) where the program text marks that input `tf.aliasing_output = K`:
    /// typically parameters updated in place by a training step. Arguments passed by reference
    /// are never donated. Every by-value argument is consumed.
    pub fn execute_donating(&self, args: Vec<Arg<'_>>) -> Result<Executed> {
        let mut executed = self.enqueue(args)?;
        std::mem::replace(&mut executed.done, Completion::finished()).wait()?;
        Ok(executed)
    }

    /// Like [`execute_donating`](Executable::execute_donating), but returns as soon as the
    /// execution is enqueued, without waiting for it: the host goes on (uploading the next batch,
    /// enqueueing the next program) while the device computes. PJRT orders executions by their
    /// buffers, so an execution that takes these outputs waits for them on the device side.
    /// Arguments may be dropped at once: PJRT keeps their memory until the execution is done.
    /// An execution that fails later reports it through [`Executed::done`] and through any read
    /// of its outputs.
    pub fn enqueue(&self, args: Vec<Arg<'_>>) -> Result<Executed> {
        self.one_replica()?;
        self.enqueue_replicas(vec![args])?.pop().ok_or_else(no_run)
    }

    /// [`enqueue`](Executable::enqueue) for a replicated program: one argument list per replica,
    /// replica `r`'s buffers on device `r` ([`Client::upload_to`]), one [`Executed`] per replica
    /// back. Every replica passes the same arguments by value or by reference (PJRT's donation
    /// options are per argument position, not per device): the first list decides.
    /// [`Error::ReplicaCount`] when the number of lists is not the program's replica count.
    ///
    /// On the CPU plugin, wait for a replicated execution's completions before enqueueing
    /// another replicated execution: every device's share runs on one shared thread pool, and
    /// replicas blocked in a collective can take every thread from a replica queued behind
    /// them — a deadlock that XLA ends by aborting the process. The training handle does.
    pub fn enqueue_replicas(&self, args: Vec<Vec<Arg<'_>>>) -> Result<Vec<Executed>> {
        if args.len() != self.replicas {
            return Err(Error::ReplicaCount {
                expected: self.replicas,
                got: args.len(),
            });
        }
        for (replica, list) in args.iter().enumerate() {
            self.check_args(replica, list.iter().map(Arg::buffer))?;
        }
        let raws: Vec<Vec<*mut RawBuffer>> = args
            .iter()
            .map(|list| list.iter().map(|a| a.buffer().raw).collect())
            .collect();
        let keep: Vec<i64> = args[0]
            .iter()
            .enumerate()
            .filter(|(_, a)| matches!(a, Arg::Borrow(_)))
            .map(|(i, _)| i as i64)
            .collect();
        let runs = self.run(&raws, &keep)?;
        let mut executed = Vec::with_capacity(runs.len());
        for ((outputs, done), list) in runs.into_iter().zip(args) {
            let mut donated = Vec::new();
            for (i, a) in list.iter().enumerate() {
                if let Arg::Donate(b) = a {
                    if b.is_deleted().unwrap_or(false) {
                        donated.push(i);
                    }
                }
            }
            drop(list);
            executed.push(Executed {
                outputs,
                donated,
                done,
            });
        }
        Ok(executed)
    }

    /// Uploads host arrays (checked against the declared inputs first), runs the program and
    /// copies every output back.
    pub fn execute_host(&self, inputs: &[&Array]) -> Result<Vec<Array>> {
        self.one_replica()?;
        self.execute_host_replicas(&[inputs])?
            .pop()
            .ok_or_else(no_run)
    }

    /// [`execute_host`](Executable::execute_host) for a replicated program: one input list per
    /// replica (uploaded to its device), one output list per replica back.
    pub fn execute_host_replicas(&self, inputs: &[&[&Array]]) -> Result<Vec<Vec<Array>>> {
        if inputs.len() != self.replicas {
            return Err(Error::ReplicaCount {
                expected: self.replicas,
                got: inputs.len(),
            });
        }
        for replica in inputs {
            self.check_host_inputs(replica)?;
        }
        let client = self.client();
        let mut lists = Vec::with_capacity(inputs.len());
        for (device, replica) in inputs.iter().enumerate() {
            let buffers = replica
                .iter()
                .map(|a| client.upload_to(a, device))
                .collect::<Result<Vec<_>>>()?;
            lists.push(buffers);
        }
        let args: Vec<Vec<Arg<'_>>> = lists
            .iter()
            .map(|l| l.iter().map(Arg::Borrow).collect())
            .collect();
        let runs = self.enqueue_replicas(args)?;
        let mut out = Vec::with_capacity(runs.len());
        for run in runs {
            run.done.wait()?;
            out.push(
                run.outputs
                    .iter()
                    .map(DeviceBuffer::to_host)
                    .collect::<Result<Vec<_>>>()?,
            );
        }
        Ok(out)
    }

    /// Checks host inputs' count, dtypes and dims against the declared inputs.
    fn check_host_inputs(&self, inputs: &[&Array]) -> Result<()> {
        if inputs.len() != self.inputs.len() {
            return Err(Error::InputCount {
                expected: self.inputs.len(),
                got: inputs.len(),
            });
        }
        for (index, (a, want)) in inputs.iter().zip(&self.inputs).enumerate() {
            let got = a.leaf_type();
            if &got != want {
                return Err(Error::InputType {
                    index,
                    name: self.input_name(index),
                    expected: want.clone(),
                    got,
                });
            }
        }
        Ok(())
    }

    /// Enqueues an execution on the program's devices (replica `r` on device `r`) with checked
    /// raw argument lists, one per replica; `non_donatable` lists the argument positions PJRT
    /// must not donate. Returns each replica's outputs and completion, not waited for.
    fn run(
        &self,
        raws: &[Vec<*mut RawBuffer>],
        non_donatable: &[i64],
    ) -> Result<Vec<(Vec<DeviceBuffer>, Completion)>> {
        let plugin = self.client.plugin;
        let f = plugin.func(
            plugin.api.fns.loaded_executable_execute,
            names::loaded_executable_execute,
        )?;
        let devices = raws.len();
        let num_args = raws.first().map_or(0, Vec::len);
        if devices == 0 || raws.iter().any(|l| l.len() != num_args) {
            return Err(no_run());
        }
        let mut outs: Vec<Vec<*mut RawBuffer>> = (0..devices)
            .map(|_| vec![std::ptr::null_mut(); self.outputs.len()])
            .collect();
        let arg_lists: Vec<*const *mut RawBuffer> = raws.iter().map(|l| l.as_ptr()).collect();
        let out_lists: Vec<*mut *mut RawBuffer> = outs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        let mut events: Vec<*mut RawEvent> = vec![std::ptr::null_mut(); devices];
        let mut options = ffi::ExecuteOptions::new();
        if !non_donatable.is_empty() {
            options.non_donatable_input_indices = non_donatable.as_ptr();
            options.num_non_donatable_input_indices = non_donatable.len();
        }
        let mut a = ffi::ExecuteArgs::new();
        a.executable = self.raw;
        a.options = &mut options;
        a.argument_lists = arg_lists.as_ptr();
        a.num_devices = devices;
        a.num_args = num_args;
        a.output_lists = out_lists.as_ptr();
        a.device_complete_events = events.as_mut_ptr();
        // SAFETY: `a` is a valid `PJRT_LoadedExecutable_Execute_Args` for `devices` devices (the
        // program's replica count, checked by the callers): the executable is live; each
        // argument list holds `num_args` live buffers of this client, on its replica's device,
        // whose count, dtypes and dims were checked against the program (XLA checks only byte
        // sizes); each output list has room for the program's output count (checked at
        // compile); the event array has one slot per device; the options and the index list
        // outlive the call.
        unsafe {
            plugin
                .api
                .check(names::loaded_executable_execute, f(&mut a))
        }?;
        // Take ownership of every returned buffer and event first, so an error below frees
        // them.
        let mut runs = Vec::with_capacity(devices);
        let mut missing = false;
        for (device, (list, &event)) in outs.iter().zip(&events).enumerate() {
            let mut outputs = Vec::with_capacity(list.len());
            for (&raw, ty) in list.iter().zip(&self.outputs) {
                if raw.is_null() {
                    missing = true;
                } else {
                    outputs.push(DeviceBuffer::from_raw(
                        self.client.clone(),
                        raw,
                        ty.clone(),
                        device,
                    ));
                }
            }
            // The completion event (possibly null) was just returned to us: owned from here.
            let done = Completion {
                client: (!event.is_null()).then(|| self.client.clone()),
                raw: event,
            };
            runs.push((outputs, done));
        }
        if missing {
            return Err(Error::Pjrt {
                call: names::loaded_executable_execute,
                code: "nitro",
                message: "the plugin returned fewer output buffers than the program has".into(),
            });
        }
        Ok(runs)
    }

    /// The plugin's serialized executable (native code; tied to the plugin build and CPU).
    fn serialize_raw(&self) -> Result<Vec<u8>> {
        let plugin = self.client.plugin;
        let f = plugin.func(
            plugin.api.fns.executable_serialize,
            names::executable_serialize,
        )?;
        let e = self.executable()?;
        let mut a = ffi::ExecutableSerializeArgs::new();
        a.executable = e.raw;
        // SAFETY: valid args for a live executable.
        unsafe { plugin.api.check(names::executable_serialize, f(&mut a)) }?;
        let bytes = if a.serialized_bytes.is_null() {
            Vec::new()
        } else {
            // SAFETY: the plugin returned `serialized_bytes_size` bytes, backed by
            // `serialized_executable`, which is freed only below, after the copy.
            unsafe { std::slice::from_raw_parts(a.serialized_bytes, a.serialized_bytes_size) }
                .to_vec()
        };
        if let Some(deleter) = a.serialized_executable_deleter {
            // SAFETY: the deleter the plugin returned for this serialized executable, called
            // exactly once, after the bytes were copied.
            unsafe { deleter(a.serialized_executable) };
        }
        if bytes.is_empty() {
            return Err(Error::Pjrt {
                call: names::executable_serialize,
                code: "nitro",
                message: "the plugin returned an empty serialized executable".into(),
            });
        }
        Ok(bytes)
    }

    /// Serializes the executable with the identity of the backend that built it and its declared
    /// signature, for [`Client::deserialize`] in this or a later process.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let client = Client {
            inner: self.client.clone(),
        };
        let identity = match self.partitioned {
            true => client.identity_partitioned(self.replicas)?,
            false => client.identity_for(self.replicas)?,
        };
        let payload = self.serialize_raw()?;
        let header = Header {
            identity,
            inputs: self.inputs.clone(),
            input_names: self.input_names.clone(),
            outputs: self.outputs.clone(),
            payload_len: payload.len() as u64,
            payload_digest: Digest::from(blake3::hash(&payload)),
            partitioned: self.partitioned,
        };
        let json = serde_json::to_vec(&header).map_err(|e| invalid(e.to_string()))?;
        let mut out = Vec::with_capacity(MAGIC.len() + 8 + json.len() + payload.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        out.extend_from_slice(&payload);
        Ok(out)
    }

    /// Loads an executable that [`serialize`](Executable::serialize) wrote, on `client`: the
    /// same as [`Client::deserialize`]. Refuses ([`Error::BackendMismatch`]) bytes built by a
    /// backend whose [`BackendIdentity`] differs from the client's, before the plugin sees them,
    /// and ([`Error::InvalidSerializedExecutable`]) bytes that are not intact.
    pub fn deserialize(client: &Client, bytes: &[u8]) -> Result<Executable> {
        let (header, payload) = parse(bytes)?;
        let replicas = header.identity.replicas.max(1);
        let mine = match header.partitioned {
            true => client.identity_partitioned(replicas)?,
            false => client.identity_for(replicas)?,
        };
        if let Some((component, stored, current)) = header.identity.first_difference(&mine) {
            return Err(Error::BackendMismatch {
                component,
                stored,
                current,
            });
        }
        if Digest::from(blake3::hash(payload)) != header.payload_digest {
            return Err(invalid(
                "the executable's checksum does not match (corrupt bytes)",
            ));
        }
        client.check_replicas(replicas)?;
        let inner = &client.inner;
        let plugin = inner.plugin;
        let f = plugin.func(
            plugin.api.fns.executable_deserialize_and_load,
            names::executable_deserialize_and_load,
        )?;
        let mut a = ffi::DeserializeAndLoadArgs::new();
        a.client = inner.raw;
        a.serialized_executable = payload.as_ptr();
        a.serialized_executable_size = payload.len();
        // SAFETY: valid args: a live client and bytes that this plugin file (same digest, API,
        // platform, CPU features and compile options: checked above) serialized, intact
        // (checksum checked above), alive for the call. No overriding compile options.
        unsafe {
            plugin
                .api
                .check(names::executable_deserialize_and_load, f(&mut a))
        }?;
        if a.loaded_executable.is_null() {
            return Err(Error::Pjrt {
                call: names::executable_deserialize_and_load,
                code: "nitro",
                message: "the plugin returned no executable and no error".into(),
            });
        }
        let names = default_names(header.inputs.len());
        let exe = Executable {
            client: inner.clone(),
            raw: a.loaded_executable,
            inputs: header.inputs,
            input_names: names,
            outputs: header.outputs,
            replicas,
            partitioned: header.partitioned,
        }
        .with_input_names(header.input_names);
        exe.check_outputs()?;
        Ok(exe)
    }

    /// XLA's fingerprint of the compiled executable (`PJRT_Executable_Fingerprint`): stable
    /// across processes for the same program, options and compiler. `None` when the plugin does
    /// not provide one.
    pub fn fingerprint(&self) -> Result<Option<String>> {
        let plugin = self.client.plugin;
        let Some(f) = plugin.api.fns.executable_fingerprint else {
            return Ok(None);
        };
        let e = self.executable()?;
        let mut a = ffi::ExecutableFingerprintArgs::new();
        a.executable = e.raw;
        // SAFETY: valid args for a live executable.
        match unsafe { plugin.api.check(names::executable_fingerprint, f(&mut a)) } {
            Err(err) if Api::is_unimplemented(&err) => Ok(None),
            Err(err) => Err(err),
            Ok(()) if a.executable_fingerprint.is_null() => Ok(None),
            Ok(()) => {
                // SAFETY: the plugin returned `executable_fingerprint_size` bytes owned by `e`,
                // which is alive until the end of this function.
                let bytes = unsafe {
                    std::slice::from_raw_parts(
                        a.executable_fingerprint,
                        a.executable_fingerprint_size,
                    )
                };
                Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
            }
        }
    }
}

impl Executable {
    /// What XLA's buffer assignment planned for one run on one device
    /// (`PJRT_Executable_GetCompiledMemoryStats`); `None` when the plugin does not report it.
    pub fn memory_stats(&self) -> Result<Option<crate::backend::CompiledMemory>> {
        let plugin = self.client.plugin;
        let Some(f) = plugin.api.fns.executable_memory_stats else {
            return Ok(None);
        };
        let e = self.executable()?;
        let mut a = ffi::ExecutableMemoryStatsArgs::new();
        a.executable = e.raw;
        // SAFETY: valid args for a live executable; the plugin writes only the integer fields
        // that `struct_size` covers.
        match unsafe { plugin.api.check(names::executable_memory_stats, f(&mut a)) } {
            Err(err) if Api::is_unimplemented(&err) => Ok(None),
            Err(err) => Err(err),
            Ok(()) => {
                let bytes = |v: i64| u64::try_from(v).unwrap_or(0);
                Ok(Some(crate::backend::CompiledMemory {
                    arguments: bytes(a.argument_size_in_bytes),
                    outputs: bytes(a.output_size_in_bytes),
                    aliased: bytes(a.alias_size_in_bytes),
                    temporaries: bytes(a.temp_size_in_bytes),
                    code: bytes(a.generated_code_size_in_bytes),
                }))
            }
        }
    }
}

impl Drop for Executable {
    fn drop(&mut self) {
        let plugin = self.client.plugin;
        if let Some(f) = plugin.api.fns.loaded_executable_destroy {
            let mut a = ffi::LoadedExecutableDestroyArgs::new();
            a.executable = self.raw;
            // SAFETY: `self` owns the loaded executable; destroyed exactly once, here, while the
            // client is still alive (held by `self.client`).
            let destroyed = unsafe {
                plugin
                    .api
                    .check(names::loaded_executable_destroy, f(&mut a))
            };
            if let Err(e) = destroyed {
                tracing::debug!("ignoring a failure to destroy a PJRT executable: {e}");
            }
        }
    }
}
