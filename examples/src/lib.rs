//! Runnable nitro experiments: the digits classifier, the Fashion-MNIST CNN and the
//! character-level GPT.
//!
//! The library holds the experiment declarations, so `cargo doc -p nitro-examples` shows what
//! `#[experiment]` generates: see the **Compile key** section of [`DigitsMlp`]. The programs
//! that run them are in `examples/` (`cargo run -p nitro-examples --example digits`).

pub mod chargpt;
pub mod data;
pub mod fashion;
mod model;
pub mod plot;
pub mod report;
pub mod run;
pub mod serve;
pub mod twin;

pub use model::{Rows, RowsMirror};

use nitro::prelude::*;

/// The activation between dense layers.
#[derive(ContentHash, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// Hyperbolic tangent.
    Tanh,
    /// Rectified linear unit.
    Relu,
}

/// How the classifier is built. It shapes the graph, so its contents are in the compile key.
#[derive(ContentHash, Clone, Debug, PartialEq)]
pub struct Arch {
    /// Widths of the layers, input first: `[64, 128, 10]`.
    pub widths: Vec<usize>,
    /// The activation after every layer but the last.
    pub activation: Activation,
}

/// A dense layer: `y = x·w + b`. A tree of two arrays, traced as two tensors.
#[derive(Tree, Clone, Debug, PartialEq)]
pub struct Dense {
    /// Weights, `[in, out]`.
    pub w: Array,
    /// Bias, `[out]`.
    pub b: Array,
}

/// A multi-layer perceptron classifying 8×8 handwritten digits.
#[experiment]
#[derive(Clone)]
pub struct DigitsMlp {
    /// The architecture: widths and activation.
    #[graph_const]
    pub arch: Arch,
    /// The layers' parameters; gradients flow here.
    #[device(trainable)]
    pub layers: Vec<Dense>,
    /// The learning rate, a traced scalar: a schedule writes it each step without recompiling.
    #[device]
    pub lr: Array,
    /// The data set (columns `x` and `y`): host-side, never traced, never in the key.
    pub data: nitro::data::Dataset,
}

impl DigitsMlp {
    /// The examples' MLP: 64 → `hidden` tanh → 10, Glorot-initialized with seed 1, on `data`,
    /// with the learning rate left to the training handle (which owns it).
    pub fn tanh(hidden: usize, data: nitro::data::Dataset) -> DigitsMlp {
        let arch = Arch {
            widths: vec![64, hidden, 10],
            activation: Activation::Tanh,
        };
        DigitsMlp {
            layers: glorot(&arch.widths, 1),
            arch,
            lr: Array::scalar(0.0f32),
            data,
        }
    }
}

/// Glorot-uniform initialized layers for `widths`, deterministic in `seed`.
pub fn glorot(widths: &[usize], seed: u64) -> Vec<Dense> {
    let mut rng = SplitMix64(seed);
    widths
        .windows(2)
        .map(|io| {
            let (i, o) = (io[0], io[1]);
            let limit = (6.0 / (i + o) as f64).sqrt();
            let w = (0..i * o)
                .map(|_| ((rng.next_f64() * 2.0 - 1.0) * limit) as f32)
                .collect();
            Dense {
                w: Array::from_vec(&[i, o], w)
                    .unwrap_or_else(|_| Array::zeros(DType::F32, &[i, o])),
                b: Array::zeros(DType::F32, &[o]),
            }
        })
        .collect()
}

/// A small deterministic generator (SplitMix64) for initialization (splits and shuffles use
/// `nitro::data`).
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform float in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Activation {
    /// Applies the activation to a traced tensor.
    pub fn apply(self, x: Tensor) -> Tensor {
        match self {
            Activation::Tanh => x.tanh(),
            Activation::Relu => x.relu(),
        }
    }
}

/// A batch of examples: pixels `[batch, 64]` (f32), labels `[batch]` (i32), and the mask
/// `[batch]` (f32: 1 for real rows, 0 for the padding of a ragged last batch).
#[derive(Tree, Clone, Debug)]
pub struct Batch {
    /// Pixels.
    pub x: Array,
    /// Labels.
    pub y: Array,
    /// 1 for real rows, 0 for padding.
    pub mask: Array,
}

impl Batch {
    /// Rows `start..start + len` of the data set (fewer at its end), unpadded.
    pub fn slice(data: &nitro::data::Dataset, start: usize, len: usize) -> Batch {
        let end = (start + len).min(data.rows());
        let rows: Vec<usize> = (start.min(end)..end).collect();
        Batch::gather(data, &rows, rows.len().max(1))
    }

    /// The rows at `indices` of the data set, padded to `batch_size` rows and masked
    /// ([`nitro::data::Dataset::gather`]).
    pub fn gather(data: &nitro::data::Dataset, indices: &[usize], batch_size: usize) -> Batch {
        match data.gather(indices, batch_size) {
            Ok(b) => Batch::from(b),
            Err(_) => Batch {
                x: Array::zeros(DType::F32, &[batch_size, 64]),
                y: Array::zeros(DType::I32, &[batch_size]),
                mask: Array::zeros(DType::F32, &[batch_size]),
            },
        }
    }
}

impl From<nitro::data::Batch> for Batch {
    /// Takes the `x` and `y` columns and the mask of a gathered batch (zeros for a missing
    /// column: the digits data set always has both).
    fn from(b: nitro::data::Batch) -> Batch {
        let n = b.size();
        match xy_columns(b) {
            Ok((x, y, mask)) => Batch { x, y, mask },
            Err(_) => Batch {
                x: Array::zeros(DType::F32, &[n, 64]),
                y: Array::zeros(DType::I32, &[n]),
                mask: Array::zeros(DType::F32, &[n]),
            },
        }
    }
}

/// The `x` and `y` columns and the mask of a gathered digits batch; a typed error naming the
/// missing column otherwise.
pub(crate) fn xy_columns(batch: nitro::data::Batch) -> nitro::Result<(Array, Array, Array)> {
    let (columns, mask) = batch.into_parts();
    let mut x = None;
    let mut y = None;
    for (name, array) in columns {
        match name.as_str() {
            "x" => x = Some(array),
            "y" => y = Some(array),
            _ => {}
        }
    }
    match (x, y) {
        (Some(x), Some(y)) => Ok((x, y, mask)),
        (x, _) => Err(nitro::Error::DatasetColumn {
            column: if x.is_none() { "x" } else { "y" }.into(),
            problem: "a digits batch needs the columns `x` (pixels) and `y` (labels); load the \
                      data with `nitro_examples::data::Digits::load`"
                .into(),
        }),
    }
}

/// The network: dense layers with the activation between them, logits out.
pub fn forward(v: &DigitsMlpView<'_>, x: Tensor) -> Tensor {
    let Some((last, hidden)) = v.layers.split_last() else {
        return x;
    };
    let h = hidden
        .iter()
        .fold(x, |h, l| v.arch.activation.apply(h.matmul(l.w) + l.b));
    h.matmul(last.w) + last.b
}

/// Per-example cross-entropy, shape `[batch]`.
pub fn loss(v: &DigitsMlpView<'_>, batch: &BatchMirror<Tensor>) -> Tensor {
    nitro::nn::softmax_cross_entropy(forward(v, batch.x), batch.y)
}

/// The gradient program: the mean loss over the real rows (padding masked out), then the
/// gradient of every layer's `w` and `b`, in the order the layers' leaves are walked.
pub fn loss_and_grads(v: &DigitsMlpView<'_>, batch: &BatchMirror<Tensor>) -> Vec<Tensor> {
    let mean = (loss(v, batch) * batch.mask).sum_all() / batch.mask.sum_all();
    let params: Vec<Tensor> = v.layers.iter().flat_map(|l| [l.w, l.b]).collect();
    let grads = nitro::trace::grad(mean, &params);
    std::iter::once(mean).chain(grads).collect()
}

/// The gradient program of [`DigitsMlp`].
pub const GRAD: nitro::program::Program<DigitsMlp, BatchMirror<Tensor>, Vec<Tensor>> =
    DigitsMlp::program("grad", loss_and_grads);

/// Number of correct predictions among a batch's real rows, as an f32 scalar. Labels must be
/// `[batch]` (checked while tracing, never broadcast).
pub fn correct(v: &DigitsMlpView<'_>, batch: &BatchMirror<Tensor>) -> Tensor {
    (nitro::nn::correct(forward(v, batch.x), batch.y) * batch.mask).sum_all()
}

/// The evaluation program of [`DigitsMlp`].
pub const EVAL: nitro::program::Program<DigitsMlp, BatchMirror<Tensor>, Tensor> =
    DigitsMlp::program("eval", correct);

/// The flags every example that trains through the handle takes (`#[command(flatten)]` into
/// its own arguments).
#[derive(clap::Args, Debug, Clone)]
pub struct HandleFlags {
    /// Print only the JSON line.
    #[arg(long)]
    pub json: bool,
    /// The preflight: print what each program of the run would do (hit, load, fetch or
    /// compile, with the reason and the recorded time), compile nothing, and exit.
    #[arg(long)]
    pub check: bool,
    /// Compile the programs one after another, so each compile time is its own (uncontended).
    #[arg(long)]
    pub serial_compiles: bool,
    /// Start a warm-up (`Nitro::warm_up`): get the programs and run each once on a thread of
    /// their own as soon as the model's shape is known, while the data is prepared (chargpt).
    /// Off by default: measured on chargpt it lengthens the time to the first step (its data
    /// takes 80 ms after the shape is known, the warm-up about a second: bench/README.md).
    #[arg(long)]
    pub warm_up: bool,
    /// Write the run's inventory manifest here (its programs' fingerprints and store keys), for
    /// `nitro cache pull --manifest FILE` on another machine.
    #[arg(long)]
    pub manifest: Option<std::path::PathBuf>,
    /// Write a twin bundle here (initial weights, batches, hyperparameters) for the example's
    /// JAX twin, `bench/twin_<example>.py`.
    #[arg(long)]
    pub twin: Option<std::path::PathBuf>,
    /// Partition every program over a mesh of devices with XLA's SPMD partitioner, the batch
    /// split along its axis: `data=4`. Parameters and optimizer state stay whole on every
    /// device unless --fsdp.
    #[arg(long, value_name = "AXIS=N")]
    pub mesh: Option<String>,
    /// Fully sharded data parallelism: parameters, optimizer state and gradients split along
    /// the mesh's axis too (without --mesh: over `data=` the device count of --devices, else
    /// `NITRO_DEVICES`).
    #[arg(long)]
    pub fsdp: bool,
    /// Devices to train on, data parallel: the same programs replicated, each batch split
    /// across them (on a CPU plugin, CPU devices sharing the machine's cores); with --fsdp the
    /// size of its `data` axis. Default: `NITRO_DEVICES`, else 1. With --mesh, the mesh says
    /// how many.
    #[arg(long, value_name = "N")]
    pub devices: Option<usize>,
    /// The precision the model computes in: `f32` (the parameters' own, the default), `bf16`
    /// or `f16` — parameters and optimizer state stay f32, the forward and backward passes
    /// run in the half dtype (`nitro::train::Precision`). The twin bundle records it for the
    /// JAX twin.
    #[arg(long, default_value = "f32", value_parser = parse_precision)]
    pub precision: nitro::train::Precision,
}

/// `--precision`'s value: `f32`, `bf16` or `f16`.
fn parse_precision(s: &str) -> Result<nitro::train::Precision, String> {
    s.parse().map_err(|_| {
        format!(
            "`{s}` is not a precision; use {}",
            nitro::train::Precision::NAMES
        )
    })
}

impl HandleFlags {
    /// The mesh and sharding `--mesh` and `--fsdp` ask for (`None` without either), checked
    /// before anything runs: a malformed mesh or an axis of size 0 is an error naming the
    /// flag. The batch (and, with --fsdp, every leaf) is split along the mesh's first axis.
    pub fn layout(&self) -> Result<Option<nitro::shard::Partitioning>, FlagError> {
        use nitro::shard::{Mesh, Partitioning, Sharding};
        if let Some(n) = self.devices {
            at_least_one("--devices", n, "the device count")?;
        }
        let mesh = match (&self.mesh, self.fsdp) {
            (None, false) => return Ok(None),
            (Some(text), _) => {
                let mut axes = Vec::new();
                for part in text.split(',') {
                    let parsed = part
                        .split_once('=')
                        .and_then(|(n, s)| Some((n.trim().to_owned(), s.trim().parse().ok()?)));
                    let Some(axis) = parsed else {
                        return Err(FlagError::new(
                            "--mesh",
                            text,
                            "write each axis as NAME=SIZE, comma-separated, like data=4",
                        ));
                    };
                    axes.push(axis);
                }
                Mesh::new(axes).map_err(|e| FlagError::new("--mesh", text, e.to_string()))?
            }
            (None, true) => {
                let devices = match self.devices {
                    Some(n) => n,
                    None => nitro::backend::pjrt::devices_setting()
                        .map_err(|e| FlagError::new("--fsdp", "", e.to_string()))?
                        .unwrap_or(1),
                };
                Mesh::new([("data", devices)])
                    .map_err(|e| FlagError::new("--fsdp", "", e.to_string()))?
            }
        };
        if let (Some(n), Some(text)) = (self.devices, &self.mesh) {
            return Err(FlagError::new(
                "--devices",
                n,
                format!("--mesh {text} says how many devices to use; drop --devices"),
            ));
        }
        let axis = mesh.axes()[0].0.clone();
        let sharding = match self.fsdp {
            true => Sharding::fsdp(axis),
            false => Sharding::replicated(axis),
        };
        let flag = if self.mesh.is_some() {
            "--mesh"
        } else {
            "--fsdp"
        };
        let shown = self.mesh.clone().unwrap_or_default();
        Partitioning::new(mesh, sharding)
            .map(Some)
            .map_err(|e| FlagError::new(flag, shown, e.to_string()))
    }

    /// `config` laid out as [`layout`](HandleFlags::layout) says, or over --devices, in the
    /// `--precision` asked for.
    pub fn apply_layout(
        &self,
        config: nitro::train::Config,
    ) -> Result<nitro::train::Config, FlagError> {
        let config = config.precision(self.precision);
        Ok(match (self.layout()?, self.devices) {
            (Some(p), _) => config.mesh(p.mesh().clone()).sharding(p.sharding().clone()),
            (None, Some(n)) => config.devices(n),
            (None, None) => config,
        })
    }

    /// Checks, before anything is loaded or compiled, that `--mesh`/`--fsdp` make a layout
    /// ([`layout`](HandleFlags::layout)) and that the outputs these flags name can be
    /// written: `--manifest` a file in an existing directory ([`check_output_file`]), `--twin`
    /// a directory that exists or can be created ([`check_output_dir`]). The error names the
    /// flag and the path.
    pub fn check_paths(&self) -> Result<(), FlagError> {
        self.layout()?;
        if let Some(path) = &self.manifest {
            check_output_file("--manifest", path)?;
        }
        if let Some(dir) = &self.twin {
            check_output_dir("--twin", dir)?;
        }
        Ok(())
    }

    /// Prints the preflight `plan` of `example` (`--check`): as one JSON line with `--json`
    /// ([`report::plan_json`]), else as the plan's table.
    pub fn print_plan(&self, example: &str, plan: &nitro::train::Plan) {
        if self.json {
            println!("{}", report::plan_json(example, plan));
        } else {
            println!("{plan}");
        }
    }
}

/// A command-line flag whose value cannot run, found before any work is done. It reads as one
/// sentence naming the flag, its value, what is wrong and what to do instead:
/// `--lr NaN: the peak learning rate must be a finite number above 0, like 3e-3`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlagError {
    /// The flag, with its dashes (`--lr`).
    pub flag: String,
    /// Its value as given (empty for a switch).
    pub value: String,
    /// What is wrong with the value and what to do instead.
    pub problem: String,
}

impl FlagError {
    /// The error of `flag` given `value`: `problem` says what is wrong and what to do.
    pub fn new(flag: &str, value: impl std::fmt::Display, problem: impl Into<String>) -> FlagError {
        FlagError {
            flag: flag.to_owned(),
            value: value.to_string(),
            problem: problem.into(),
        }
    }
}

impl std::fmt::Display for FlagError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.value.is_empty() {
            write!(f, "{}: {}", self.flag, self.problem)
        } else {
            write!(f, "{} {}: {}", self.flag, self.value, self.problem)
        }
    }
}

impl std::error::Error for FlagError {}

/// Refuses a count flag of 0: `what` names the quantity (`"the training steps"`).
pub fn at_least_one(flag: &str, value: usize, what: &str) -> Result<(), FlagError> {
    if value == 0 {
        return Err(FlagError::new(
            flag,
            value,
            format!("{what} must be at least 1"),
        ));
    }
    Ok(())
}

/// Refuses a real-valued flag that is not a finite number above 0 (`NaN`, `inf`, 0, negative):
/// `what` names the quantity, `like` is a sensible value to suggest.
pub fn finite_above_zero(flag: &str, value: f64, what: &str, like: f64) -> Result<(), FlagError> {
    if !(value.is_finite() && value > 0.0) {
        return Err(FlagError::new(
            flag,
            value,
            format!("{what} must be a finite number above 0, like {like}"),
        ));
    }
    Ok(())
}

/// Refuses a rate flag outside `[0, 1)` (or not a number): `what` names the quantity.
pub fn below_one(flag: &str, value: f64, what: &str) -> Result<(), FlagError> {
    if !(0.0..1.0).contains(&value) {
        return Err(FlagError::new(
            flag,
            value,
            format!("{what} must be at least 0 and below 1 (0: none)"),
        ));
    }
    Ok(())
}

/// The nearest ancestor of `path` that exists (`.` for a relative path none of whose
/// ancestors does), and whether it is a directory.
fn existing_ancestor(path: &std::path::Path) -> (std::path::PathBuf, bool) {
    let mut at = path.parent();
    while let Some(p) = at {
        let p = if p.as_os_str().is_empty() {
            std::path::Path::new(".")
        } else {
            p
        };
        if let Ok(meta) = std::fs::metadata(p) {
            return (p.to_path_buf(), meta.is_dir());
        }
        // A path through a regular file reads as absent (ENOTDIR): look further up.
        at = p.parent();
    }
    (std::path::PathBuf::from("."), true)
}

/// Checks, before any work is done, that the output file `path` of `flag` can be created: it
/// is not a directory, and its parent is an existing directory (nothing is created). The
/// error names the flag and the path, and says what to do.
pub fn check_output_file(flag: &str, path: &std::path::Path) -> Result<(), FlagError> {
    let shown = path.display();
    if path.as_os_str().is_empty() {
        return Err(FlagError::new(flag, "\"\"", "name a file to write"));
    }
    if path.is_dir() {
        return Err(FlagError::new(
            flag,
            &shown,
            "it is a directory; name a file in it instead",
        ));
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    if parent.is_dir() {
        return Ok(());
    }
    let (ancestor, is_dir) = existing_ancestor(path);
    let problem = if is_dir {
        format!(
            "the directory `{}` does not exist (it is not created); create it first or name a \
             file in an existing directory",
            parent.display()
        )
    } else {
        format!(
            "`{}` is a file, not a directory; name a file in an existing directory",
            ancestor.display()
        )
    };
    Err(FlagError::new(flag, &shown, problem))
}

/// Checks, before any work is done, that the output directory `dir` of `flag` exists as a
/// directory or can be created (its nearest existing ancestor is a directory). Nothing is
/// created. The error names the flag and the path, and says what to do.
pub fn check_output_dir(flag: &str, dir: &std::path::Path) -> Result<(), FlagError> {
    let shown = dir.display();
    if dir.as_os_str().is_empty() {
        return Err(FlagError::new(flag, "\"\"", "name a directory to write"));
    }
    match std::fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => Err(FlagError::new(
            flag,
            &shown,
            "it is a file, not a directory; name a directory (it is created if absent)",
        )),
        Err(_) => match existing_ancestor(dir) {
            (_, true) => Ok(()),
            (ancestor, false) => Err(FlagError::new(
                flag,
                &shown,
                format!(
                    "`{}` is a file, not a directory, so the directory cannot be created; name \
                     a directory elsewhere",
                    ancestor.display()
                ),
            )),
        },
    }
}

/// Checks a checkpoint path to write (`--checkpoint`): a path ending in `.safetensors` is one
/// file, checked as [`check_output_file`] checks it; any other is a checkpoint directory
/// ([`nitro::checkpoint::Format::for_path`]): an existing directory, or a new one in an
/// existing directory. A file where the directory would be is refused, naming both forms.
pub fn check_checkpoint_path(flag: &str, path: &std::path::Path) -> Result<(), FlagError> {
    use nitro::checkpoint::Format;
    if Format::for_path(path) == Format::File || path.as_os_str().is_empty() {
        return check_output_file(flag, path);
    }
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => Err(FlagError::new(
            flag,
            path.display(),
            "it is a file, and a path that does not end in `.safetensors` names a checkpoint \
             directory; name a directory, or a file ending in `.safetensors`",
        )),
        Err(_) => check_output_file(flag, path),
    }
}

/// Checks a checkpoint to read (`--resume`): a checkpoint file or directory that is there.
pub fn check_checkpoint_input(flag: &str, path: &std::path::Path) -> Result<(), FlagError> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => Ok(()),
        _ => check_input_file(flag, path),
    }
}

/// Checks, before any work is done, that the input file `path` of `flag` exists and is not a
/// directory. The error names the flag and the path.
pub fn check_input_file(flag: &str, path: &std::path::Path) -> Result<(), FlagError> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => Err(FlagError::new(
            flag,
            path.display(),
            "it is a directory; name the file to read",
        )),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(FlagError::new(
            flag,
            path.display(),
            "there is no such file; name an existing file",
        )),
        Err(e) => Err(FlagError::new(
            flag,
            path.display(),
            format!("cannot read it ({e}); name a file you can read"),
        )),
    }
}
