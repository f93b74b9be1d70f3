//! The error type of every fallible nitro call.

use crate::tree::DType;

/// A `Result` whose error is [`nitro::Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in nitro. Each message says what was wrong and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An array's data does not fill its dims.
    #[error("array dims {dims:?} need {expected} elements but the data has {got}; pass data whose length is the product of the dims")]
    ArrayLength {
        /// The requested dims.
        dims: Vec<usize>,
        /// Their product.
        expected: usize,
        /// The data length.
        got: usize,
    },

    /// Dims whose size is over nitro's limit ([`crate::MAX_TENSOR_BYTES`]), or whose element
    /// count overflows.
    #[error(
        "{ty} is too large: its element size times its dims (each counted as at least 1) is \
         {}, over the limit of {} bytes (nitro::MAX_TENSOR_BYTES, 2^63 - 1); use smaller dims",
        ty.describe_size(),
        crate::MAX_TENSOR_BYTES
    )]
    ShapeTooLarge {
        /// The dtype and dims asked for.
        ty: crate::tree::LeafType,
    },

    /// Memory could not be allocated.
    #[error(
        "cannot allocate {bytes} bytes for {what}: not enough memory; use smaller shapes or \
         batches, or free memory"
    )]
    OutOfMemory {
        /// What the memory was for.
        what: String,
        /// How much was asked for.
        bytes: u64,
    },

    /// An array was read as the wrong element type.
    #[error(
        "the array holds {got} elements, not {expected}; read it as {got} or convert it first"
    )]
    DTypeMismatch {
        /// The dtype asked for.
        expected: DType,
        /// The dtype held.
        got: DType,
    },

    /// A GraphConst field hashed differently across two hashes of equal values.
    #[error(
        "#[graph_const] field `{field}` of `{experiment}` is not hashable by content: \
         two hashes of equal values differ ({first} vs {second}); its ContentHash impl must \
         depend only on the value (no addresses, clocks, random state or iteration order)"
    )]
    UnstableGraphConstHash {
        /// The experiment type.
        experiment: &'static str,
        /// The field.
        field: &'static str,
        /// The digest of the value.
        first: crate::Digest,
        /// The digest of its clone (or of a second hash).
        second: crate::Digest,
    },

    /// A shape or dtype mistake in traced code, found while tracing.
    #[error("{}", describe_trace(.0))]
    Trace(Box<TraceError>),

    /// Traced code panicked.
    #[error("traced code panicked: {message}; programs must run to their end while being traced")]
    TracePanic {
        /// The panic message.
        message: String,
    },

    /// A handle would hold more programs than its recompile budget allows
    /// ([`crate::train::Config::max_programs`]).
    #[error("the handle would hold {needed} programs, over its budget of {budget} (Config::max_programs): getting {what} would compile a program outside the declared inventory; declare its shape (a bucket edge), or raise the budget")]
    ProgramBudget {
        /// The budget.
        budget: usize,
        /// The programs the handle would hold.
        needed: usize,
        /// What asked for the new programs (the batch's shape).
        what: String,
    },

    /// A training loss was NaN or infinite and [`crate::train::Config::non_finite`] says to
    /// stop ([`crate::train::NonFinite::Stop`]).
    ///
    /// Steps are enqueued without waiting and losses are read when an epoch ends, so the
    /// handle has run on past the step that produced the loss: `step` is the step that produced
    /// it, `state_step` the step the handle's state is at when it stops (the steps between ran
    /// on what that step left, likely non-finite).
    #[error("the training loss of epoch {epoch}, batch {batch} (optimizer step {step}) is {loss}, found when the epoch's losses were read with the handle's state at optimizer step {state_step}: the parameters are likely non-finite now; lower the learning rate, check the data and the loss for NaN sources, or resume from a checkpoint taken before step {step}")]
    NonFiniteLoss {
        /// The epoch, from 1.
        epoch: u64,
        /// The batch of the epoch, from 1.
        batch: usize,
        /// The optimizer steps the handle had taken after that batch: the step that produced
        /// the loss.
        step: u64,
        /// The loss.
        loss: f64,
        /// The optimizer steps the handle had taken when it stopped: the step its state is at.
        state_step: u64,
    },

    /// A program was run with the wrong number of inputs.
    #[error("the program takes {expected} inputs but was given {got}")]
    InputCount {
        /// Inputs the program declares.
        expected: usize,
        /// Inputs given.
        got: usize,
    },

    /// A replicated program was run with input lists for another number of replicas.
    #[error(
        "the program runs as {expected} replica(s), one per device, but was given inputs for \
         {got}; give one input list per replica"
    )]
    ReplicaCount {
        /// The program's replica count.
        expected: usize,
        /// Input lists given.
        got: usize,
    },

    /// More devices were asked for than the backend can give, or a device count that cannot
    /// serve (zero, or one that does not divide the batch).
    #[error("{what}: {requested} device(s) asked for; {reason}")]
    Devices {
        /// What asked (`Config::devices`, `NITRO_DEVICES`, …).
        what: String,
        /// The device count asked for.
        requested: usize,
        /// Why it cannot be served, and what to do.
        reason: String,
    },

    /// A program input has the wrong dtype or dims.
    #[error("input {index} (`{name}`) of the program must be {expected} but is {got}; a program is compiled for fixed shapes and dtypes")]
    InputType {
        /// Position of the input.
        index: usize,
        /// Its name (leaf path).
        name: String,
        /// The declared type.
        expected: crate::tree::LeafType,
        /// The given type.
        got: crate::tree::LeafType,
    },

    /// A trace was started while another was active on the same thread.
    #[error(
        "a trace is already being recorded on this thread; programs cannot trace other programs"
    )]
    NestedTrace,

    /// A graph given to a backend is not well formed: an op's operands, attributes or result type
    /// do not fit together (only hand-built or edited graphs can be; traced graphs are checked).
    #[error(
        "node %{node} (`{op}`) of the graph is malformed: {message}; build graphs with \
         `nitro::trace::trace`, which checks shapes and dtypes, or fix the node"
    )]
    InvalidGraph {
        /// The node's id.
        node: u32,
        /// The node's op name.
        op: &'static str,
        /// What does not fit.
        message: String,
    },

    /// No PJRT plugin is installed where nitro looks for one.
    #[error(
        "no PJRT plugin (XLA) found ({searched}); install one with \
         `pip install --no-deps lammps-jax-pjrt-cpu==0.11.2` for the `python3` on PATH, or set \
         NITRO_PJRT_PLUGIN=/path/to/plugin.so, or set NITRO_BACKEND=interp to run on the \
         reference interpreter"
    )]
    PjrtPluginNotFound {
        /// Where discovery looked.
        searched: String,
    },

    /// A file could not be used as a PJRT plugin.
    #[error(
        "cannot use `{}` as a PJRT plugin: {reason}; point NITRO_PJRT_PLUGIN at a PJRT plugin \
         file, or install one with `pip install --no-deps lammps-jax-pjrt-cpu==0.11.2`",
        path.display()
    )]
    PjrtPlugin {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// The plugin lacks a PJRT function nitro needs for this call.
    #[error(
        "the PJRT plugin `{}` (C API {major}.{minor}) does not provide {function}; use a newer \
         plugin (`pip install --no-deps lammps-jax-pjrt-cpu==0.11.2`)",
        path.display()
    )]
    PjrtUnsupported {
        /// The plugin file.
        path: std::path::PathBuf,
        /// The C function.
        function: &'static str,
        /// The plugin's API major version.
        major: i32,
        /// The plugin's API minor version.
        minor: i32,
    },

    /// A PJRT call returned an error.
    #[error("{call} failed in the XLA plugin ({code}): {message}")]
    Pjrt {
        /// The C function.
        call: &'static str,
        /// The PJRT error code's name (`INVALID_ARGUMENT`, …), or `nitro` for a contract the
        /// plugin broke.
        code: &'static str,
        /// The plugin's message.
        message: String,
    },

    /// XLA rejected a program's StableHLO text.
    #[error(
        "XLA could not compile the program: {first_line}\n(the StableHLO text is invalid for \
         this plugin: fix the emitted text, or use a newer plugin; LINE:COL point into the text; \
         code {code}; XLA's full message follows)\n{message}"
    )]
    XlaCompile {
        /// The PJRT error code's name.
        code: &'static str,
        /// XLA's first error line: the real error (`-:LINE:COL: error: …`).
        first_line: String,
        /// XLA's whole message (its last line about "forward incompatibility" is boilerplate).
        message: String,
    },

    /// A compiled program's outputs (or an output buffer) do not match the declared types.
    #[error(
        "the compiled program {what}; declare the input and output types that the program \
         text has"
    )]
    ProgramSignature {
        /// What differs.
        what: String,
    },

    /// An argument buffer belongs to another PJRT client than the executable.
    #[error(
        "argument {index} lives on another PJRT client than the executable; upload it through \
         the executable's client"
    )]
    ForeignBuffer {
        /// Position of the argument.
        index: usize,
    },

    /// A serialized executable was built by a different backend, so it was not loaded.
    #[error(
        "the serialized executable was built for another backend ({component}: stored \
         {stored}, here {current}), so it was not loaded; compile the program again \
         (executables are native code tied to the plugin file, the CPU and the options)"
    )]
    BackendMismatch {
        /// The identity component that differs.
        component: &'static str,
        /// Its value in the serialized executable.
        stored: String,
        /// Its value for this client.
        current: String,
    },

    /// Bytes given to deserialize are not an intact serialized nitro executable.
    #[error("the bytes are not an intact serialized nitro executable: {reason}; discard them and compile again")]
    InvalidSerializedExecutable {
        /// What is wrong.
        reason: String,
    },

    /// An environment setting has a value nitro does not accept.
    #[error("{variable}={value:?} cannot be used; set it to {accepted}")]
    BackendSetting {
        /// The variable.
        variable: &'static str,
        /// Its value.
        value: String,
        /// What is accepted.
        accepted: &'static str,
    },

    /// `XLA_FLAGS` holds a token the plugin would not parse: XLA ends the process (exit status
    /// 1, no message) on one, so nitro refuses before loading the plugin.
    #[error(
        "XLA_FLAGS=\"{value}\" would end the process inside the XLA plugin, which exits without \
         a message on a flag it cannot parse: {why}. Fix or unset XLA_FLAGS"
    )]
    XlaFlags {
        /// The variable's value (tokens joined by one space).
        value: String,
        /// Which token, and what is wrong with it.
        why: String,
    },

    /// Verify mode found a program whose emitted code changed while its cache key did not: the
    /// program reads something the key cannot see (a global, a thread-local, the clock).
    #[error(
        "program `{program}` changed without its key moving (fingerprint {was} → {now}): it reads \
         a value the compile key cannot see, such as a global; pass that value as a \
         #[graph_const] field instead"
    )]
    StaleKey {
        /// The program identity.
        program: String,
        /// The fingerprint cached.
        was: String,
        /// The fingerprint traced now.
        now: String,
    },

    /// Another thread's compile of the same program, which this request waited for, failed.
    #[error(
        "compiling `{program}` failed (in another thread that this request waited for): {message}"
    )]
    CompileFailedElsewhere {
        /// The program identity.
        program: String,
        /// The failure.
        message: String,
    },

    /// The acceptance check failed: programs were compiled after warm-up.
    #[error(
        "recompiled after warm-up: {misses} misses for {entries} cached programs, {since_warm} \
         since warm-up; latest: {recent}. A GraphConst that changes between steps should be \
         #[device]; a ragged batch should be padded"
    )]
    Recompiled {
        /// Total misses.
        misses: u64,
        /// Programs held.
        entries: u64,
        /// Misses since the warm-up mark.
        since_warm: u64,
        /// The latest misses with their reasons.
        recent: String,
    },

    /// Reading or writing the persistent compile cache failed.
    #[error("compile cache: cannot {what} at {}: {source}", path.display())]
    CacheIo {
        /// The file or directory.
        path: std::path::PathBuf,
        /// What was being done.
        what: String,
        /// The I/O error.
        source: std::io::Error,
    },

    /// A persistent cache entry could not be encoded or decoded.
    #[error("compile cache entry {} is unusable: {why}", path.display())]
    CacheCorrupt {
        /// The entry file.
        path: std::path::PathBuf,
        /// What is wrong.
        why: String,
    },

    /// The process-wide compile cache could not be configured as the environment asks; every
    /// lookup on it fails until the setting is fixed.
    #[error("the process-wide compile cache is misconfigured: {message}")]
    Misconfigured {
        /// The setting that could not be honoured, and why.
        message: String,
    },

    /// A mesh or a partition spec that cannot shard what it is given (see [`crate::shard`]).
    #[error("sharding {what}: {problem}")]
    Sharding {
        /// What was being sharded (a leaf with its type, or the mesh).
        what: String,
        /// What is wrong, and what to do.
        problem: String,
    },

    /// A layer of [`crate::nn`] cannot take an input of these dims (see
    /// [`OutputDims`](crate::nn::OutputDims)): what a trace of its forward pass would fail with.
    #[error("layer {layer} cannot take input dims {input:?}: {problem}")]
    Layer {
        /// The layer, as it prints.
        layer: String,
        /// One example's input dims (no batch dim).
        input: Vec<usize>,
        /// What is wrong, and what to do.
        problem: String,
    },

    /// A layer of [`crate::nn`] was built with a shape it cannot have (heads that do not divide
    /// the width, none at all): refused by its constructor, and by its forward pass when it was
    /// written as a literal.
    #[error("layer {layer} cannot be built: {problem}")]
    LayerShape {
        /// The layer, as it was asked for (`TransformerBlock::causal(512, 7)`).
        layer: String,
        /// What is wrong, with the numbers, and what to do.
        problem: String,
    },

    /// An environment variable holds a value nitro does not accept.
    #[error("{variable}={value:?} is not a valid setting: {expected}")]
    InvalidSetting {
        /// The variable (`NITRO_VERIFY_KEYS`, …).
        variable: &'static str,
        /// The value it holds.
        value: String,
        /// What it accepts, in words.
        expected: String,
    },

    /// A data set's columns do not fit together (see [`crate::data::Dataset::new`]).
    #[error(
        "data set column `{column}` has {rows} rows but column `{first}` has {first_rows}; \
         every column of a data set must have the same first dim (one entry per row)"
    )]
    DatasetRows {
        /// The column whose row count differs.
        column: String,
        /// Its row count (first dim).
        rows: usize,
        /// The first column.
        first: String,
        /// The first column's row count.
        first_rows: usize,
    },

    /// A data set column is unusable as given.
    #[error("data set column `{column}` {problem}")]
    DatasetColumn {
        /// The column's name.
        column: String,
        /// What is wrong, and what to do.
        problem: String,
    },

    /// A label lies outside `0..classes`.
    #[error(
        "row {row} of column `{column}` holds label {value}, outside 0..{classes}; labels \
         must be class indices: fix that row of the data, or the number of classes"
    )]
    LabelOutOfRange {
        /// The label column.
        column: String,
        /// The first bad row (0-based).
        row: usize,
        /// Its value.
        value: i64,
        /// The number of classes allowed.
        classes: usize,
    },

    /// A row index is not in the data set.
    #[error("row {row} is out of range for a data set of {rows} rows; use indices in 0..{rows}")]
    RowOutOfRange {
        /// The index asked for.
        row: usize,
        /// The data set's row count.
        rows: usize,
    },

    /// A split, batch or plan was asked for with an unusable setting.
    #[error("{what}")]
    InvalidDataArgument {
        /// What was wrong and what is accepted.
        what: String,
    },

    /// A data file (`.npy`, idx) could not be read or written: which file, and what is wrong
    /// with it.
    #[error("{}: {why}", path.display())]
    DataFile {
        /// The file (`<bytes>` for bytes in memory).
        path: std::path::PathBuf,
        /// What is wrong, and what is accepted.
        why: String,
    },

    /// Reading or writing a checkpoint file failed.
    #[error("checkpoint: cannot {what} {}: {source}", path.display())]
    CheckpointIo {
        /// The file (or its temporary sibling).
        path: std::path::PathBuf,
        /// What was being done.
        what: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },

    /// A checkpoint's bytes are truncated, corrupt, or not a nitro checkpoint.
    #[error(
        "checkpoint {origin} is unusable: {why}; it is truncated, corrupt or not written by \
         nitro — resume from another checkpoint"
    )]
    CheckpointCorrupt {
        /// Where the bytes came from (a path, or `bytes` for an in-memory buffer).
        origin: String,
        /// What is wrong.
        why: String,
    },

    /// The background save [`Config::save_every`](crate::train::Config::save_every) asked for
    /// at step `step` was not started, because of `source` (most often the previous save's
    /// failure). Step `step` and the ones before it were taken; the call that returned this
    /// error was not (a step call did not train its batch): fix the cause and call it again.
    #[error(
        "the background save to {} due at step {step} was not started: {source}; the steps \
         up to {step} were taken, and the call that returned this was not — fix the cause (or \
         the path) and call it again",
        path.display()
    )]
    SaveNotStarted {
        /// The step whose save was due.
        step: u64,
        /// Where it was to be written.
        path: std::path::PathBuf,
        /// Why it could not be started.
        source: Box<Error>,
    },

    /// A generation request (or a generator's declaration) cannot be served as given: which
    /// field, and why, with what is accepted.
    #[error("generation: `{field}` {why}")]
    InvalidRequest {
        /// The field (`prompt`, `max_tokens`, `temperature`, `slots`, …).
        field: &'static str,
        /// What is wrong, with the numbers, and what is accepted.
        why: String,
    },

    /// A checkpoint cannot be written as asked.
    #[error("cannot capture a checkpoint: {why}")]
    CheckpointInput {
        /// What is wrong and what to do.
        why: String,
    },

    /// A checkpoint was written by another experiment type.
    #[error(
        "the checkpoint was written by experiment `{stored}`, not `{current}`; resume it with \
         the experiment type that wrote it"
    )]
    CheckpointExperiment {
        /// The type path in the checkpoint.
        stored: String,
        /// The type path of the experiment resumed into.
        current: &'static str,
    },

    /// A checkpoint's GraphConst digest differs from the experiment's: its programs would differ.
    #[error(
        "the checkpoint's GraphConst digest differs from `{experiment}`'s ({} → {}); fields that \
         differ: {}; resume with the GraphConst values it was written with, or start a new run",
        stored.short(),
        current.short(),
        describe_field_changes(fields)
    )]
    CheckpointGraphConst {
        /// The experiment type.
        experiment: &'static str,
        /// The GraphConst digest in the checkpoint.
        stored: crate::Digest,
        /// The experiment's GraphConst digest.
        current: crate::Digest,
        /// The fields whose digests differ (or that one side lacks).
        fields: Vec<FieldChange>,
    },

    /// A checkpoint's Device leaves do not fit the experiment's Device fields.
    #[error(
        "the checkpoint's Device fields do not fit the experiment's: {}; resume into an \
         experiment whose Device fields have the checkpoint's structure, dtypes and dims",
        changes.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ")
    )]
    CheckpointDevice {
        /// Each difference, from the checkpoint to the experiment, by leaf path.
        changes: Vec<crate::tree::SignatureChange>,
    },

    /// A checkpoint's optimizer (its name, constants or state) does not fit the handle resuming
    /// it.
    #[error(
        "cannot resume: {why} (the checkpoint's optimizer: {stored}; this handle's: {current}); \
         resume with the optimizer the checkpoint was taken with{}",
        if *retunable {
            ", or call `Checkpoint::allow_retuned_optimizer` to keep the state under new constants"
        } else {
            ""
        }
    )]
    CheckpointOptimizer {
        /// The checkpoint's optimizer (name and constants, as it printed).
        stored: String,
        /// The handle's optimizer.
        current: String,
        /// What does not fit, naming the array or field.
        why: String,
        /// Whether only the constants differ (the opt-in would accept it).
        retunable: bool,
    },

    /// A data set with no rows was given to train or validate on.
    #[error(
        "{which} has no rows: training or validating on it would report a loss of 0 from no \
         steps; pass a data set with at least one row"
    )]
    EmptyData {
        /// Which data set (`the training data`, `the validation data`).
        which: String,
    },

    /// A shared compile cache (`NITRO_CACHE_REMOTE`) was asked for without a signing key:
    /// entries from a server are native code written by other machines, so they must be signed.
    #[error(
        "the shared compile cache {url} needs signed entries and no signing key is set: set \
         NITRO_CACHE_KEY to the fleet's key (64 hex digits, the same on every machine that \
         shares the cache), or unset NITRO_CACHE_REMOTE"
    )]
    RemoteUnsigned {
        /// The server, as configured (any password hidden).
        url: String,
    },

    /// A shared compile cache could not be opened or used as asked (a malformed address, an
    /// unsupported scheme, a write to a read-only one). A server that is down is not this
    /// error: the cache warns once and compiles locally.
    #[error("shared compile cache {url}: {why}")]
    RemoteCache {
        /// The server, as configured (any password hidden).
        url: String,
        /// What is wrong, and what to do.
        why: String,
    },

    /// The persistent cache directory cannot be trusted (or is not configured).
    #[error("compile cache directory {} refused: {why}", path.display())]
    CacheUntrusted {
        /// The directory.
        path: std::path::PathBuf,
        /// Why.
        why: String,
    },

    /// A cached stage's outputs cannot be named: the data set it reads has no digest
    /// ([`Dataset::unnamed`](crate::data::Dataset::unnamed)).
    #[error(
        "the cached stage `{stage}` cannot name its outputs for {data}: that data set has no \
         digest (it was made with `Dataset::unnamed`, or derived from one), and a stored \
         output is named by its data set's digest and a span of rows. Give it one with \
         `Dataset::into_named` (one hash of its contents) or make it with `Dataset::new`; or \
         set the stage's `CACHED` to false"
    )]
    Nameless {
        /// The stage's name.
        stage: String,
        /// Which data: `the training data`, `the validation data`, `the data passed to
        /// stage_pass`.
        data: String,
    },

    /// Something upstream of a stage is not settled by what names its outputs: its program
    /// reads a value that is neither a frozen field nor its input column.
    #[error(
        "the stage `{stage}` reads program input `{input}`, which is neither a frozen field \
         nor its input column `{column}`: nitro can neither supply it nor name the stage's \
         outputs by it. A stage reads only its frozen view and its input tensor; create no \
         inputs in `Stage::run` (with `nitro::trace::input`), and mark the fields it needs \
         `#[device(frozen)]` or `#[graph_const]`"
    )]
    Unsettled {
        /// The stage's name.
        stage: String,
        /// The input's name, as the stage created it.
        input: String,
        /// The stage's input column ([`Stage::INPUT`](crate::stage::Stage::INPUT)).
        column: String,
    },

    /// A stage's output does not have one row per input row.
    #[error(
        "the stage `{stage}` returns {output} for a chunk of {rows} rows; a stage returns one \
         output row per input row (an array whose first dim is {rows}), computing each row \
         from its own input row"
    )]
    StageOutputRows {
        /// The stage's name.
        stage: String,
        /// The output's type.
        output: String,
        /// The chunk's rows.
        rows: usize,
    },
}

/// One GraphConst field whose digest differs between a checkpoint and an experiment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldChange {
    /// The field's name.
    pub field: String,
    /// Its digest in the checkpoint; `None` when the checkpoint has no such field.
    pub stored: Option<crate::Digest>,
    /// Its digest in the experiment; `None` when the experiment has no such field.
    pub current: Option<crate::Digest>,
    /// What differs in the values, as printed by `Debug` on both sides (`arch.hidden: 128 →
    /// 64`), one line per difference; empty when a side's value was not printable (its type
    /// is not `Debug`, or it printed too long to keep).
    pub diff: Vec<String>,
}

impl std::fmt::Display for FieldChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.stored, &self.current) {
            (Some(_), Some(_)) if !self.diff.is_empty() => {
                write!(f, "`{}` ({})", self.field, self.diff.join("; "))
            }
            (Some(s), Some(c)) => {
                write!(f, "`{}` (digest {} → {})", self.field, s.short(), c.short())
            }
            (Some(_), None) => write!(f, "`{}` (in the checkpoint only)", self.field),
            (None, Some(_)) => write!(f, "`{}` (in the experiment only)", self.field),
            (None, None) => write!(f, "`{}`", self.field),
        }
    }
}

/// The changes as one line, for [`Error::CheckpointGraphConst`].
fn describe_field_changes(changes: &[FieldChange]) -> String {
    if changes.is_empty() {
        return "none by digest (the type path or field order differs)".into();
    }
    changes
        .iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn describe_trace(e: &TraceError) -> String {
    if e.location.is_empty() {
        format!("`{}`: {}", e.op, e.message)
    } else {
        format!("`{}` at {}: {}", e.op, e.location, e.message)
    }
}

impl Error {
    /// [`Error::DataFile`] for `path`.
    pub(crate) fn data_file(path: &std::path::Path, why: impl Into<String>) -> Error {
        Error::DataFile {
            path: path.to_path_buf(),
            why: why.into(),
        }
    }

    /// Writes a data file (weights, `.npy`, a manifest) atomically
    /// ([`files::save_atomic`](crate::files::save_atomic): stale temporary files of killed
    /// writes swept first), or [`Error::DataFile`] naming the step and the temporary file.
    pub(crate) fn write_data_file(
        path: &std::path::Path,
        bytes: &[u8],
        durable: bool,
    ) -> Result<()> {
        crate::files::save_atomic(path, bytes, durable).map_err(|f| {
            Error::data_file(
                path,
                format!("cannot {} {}: {}", f.step, f.tmp.display(), f.source),
            )
        })
    }

    /// The bytes of the data file at `path`, or [`Error::DataFile`] saying why not: every file
    /// nitro reads for the user (weights, `.npy`, idx, text, manifests) comes through here.
    /// Only a regular file is read — a FIFO, socket, device or directory is refused without
    /// blocking on it or reading from it — and its bytes are reserved fallibly, so a huge file
    /// is an error, never an abort.
    pub(crate) fn read_data_file(path: &std::path::Path) -> Result<Vec<u8>> {
        use crate::files::{self, Opened, Owner};
        let cannot = |e: std::io::Error| Error::data_file(path, format!("cannot read it: {e}"));
        match files::open_regular(path, u64::MAX, Owner::Anyone).map_err(cannot)? {
            Opened::File(mut file, len) => files::read_exactly(&mut file, len).map_err(cannot),
            Opened::Refused(r) => Err(Error::data_file(
                path,
                format!("it is {}; pass a regular file", r.why()),
            )),
        }
    }
}

/// The first mistake of a trace: which op, what was wrong, and where the user called it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceError {
    /// The op (`matmul`, `add`, …).
    pub op: &'static str,
    /// What was wrong, with the shapes involved.
    pub message: String,
    /// The user's source location (`src/model.rs:42:17`).
    pub location: String,
}
