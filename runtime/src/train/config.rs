//! How a handle trains: [`Config`].

use super::*;
use crate::data::buckets::Buckets;

/// How a handle trains.
#[derive(Clone, Debug)]
pub struct Config {
    /// Rows per step (the last batch of an epoch is padded to it).
    pub batch: usize,
    /// The learning rate (a traced scalar: changing it never recompiles).
    pub lr: f64,
    /// Epochs [`Nitro::fit`] runs.
    pub epochs: usize,
    /// The seed of the run: of the per-epoch shuffles, and of the random stream of a model
    /// that draws random numbers ([`Model::RANDOM`]; its base key is JAX's `PRNGKey(seed)`).
    pub seed: u64,
    /// A learning-rate schedule; when set, it gives the rate of every step (and `lr` is
    /// ignored). Its rates are written to a traced scalar: a schedule never recompiles.
    pub schedule: Option<Arc<dyn Schedule>>,
    /// Whether [`Nitro::fit`] draws a progress bar per epoch on stderr (only ever when stderr
    /// is a terminal), and whether the handle's compiles that run past a second say so on
    /// stderr (the program, how long so far, how long its last compile took here:
    /// [`crate::cache::quietly`]). Off, the handle writes nothing to stderr (the examples turn
    /// it off under `--json`).
    pub progress: bool,
    /// Micro-batches per optimizer step (gradient accumulation): each of
    /// [`step_deferred`](Nitro::step_deferred)'s batches adds its gradient to a sum on the
    /// device, and every `accum`-th applies the optimizer to the mean over the window's real
    /// rows. 1 (the default) updates after every batch. Accumulating adds no program: it
    /// replaces the gradient program by an accumulating one.
    pub accum: usize,
    /// Devices to train on at once (data parallelism), `None` for the count `NITRO_DEVICES`
    /// sets, else 1. Every program runs as one replica per device: parameters and optimizer
    /// state are replicated, each batch is split by rows across the devices (so
    /// [`Config::batch`] must be a multiple of the count), gradients and sums are added over the
    /// devices inside the programs, and every device runs the optimizer. The program inventory
    /// is the same at any count.
    pub devices: Option<usize>,
    /// Whether [`Nitro::prepare`] (and the first step) compiles the programs concurrently, one
    /// thread each (the default: the first step waits for the slowest program, not for their
    /// sum), or one after another — slower to start on a busy machine, but each program's
    /// compile time in [`Nitro::program_times`] is then its own, not contended by the others.
    pub concurrent_compiles: bool,
    /// With [`concurrent_compiles`](Config::concurrent_compiles), the most programs compiled
    /// (or loaded) at once — across every bucket edge when [`Nitro::prepare_buckets`] gets the
    /// whole inventory — the next starting as one ends, the gradient programs first. `None`
    /// (the default): the machine's available parallelism, at least 2.
    pub compile_threads: Option<usize>,
    /// Shape buckets for variable-length data ([`crate::data::buckets`]): the declared edges of
    /// the batches' variable dimension. With them the handle's inventory is its programs × the
    /// edges, compiled before the first step of [`Nitro::fit_ragged`]; a batch of any other
    /// length is an error, never a new program.
    pub buckets: Option<Buckets>,
    /// A recompile budget: the most programs the handle may hold (gradient, update, evaluation
    /// and metric programs, over every bucket). Getting one more is an error
    /// ([`Error::ProgramBudget`]) before it compiles, never a silent new program.
    pub max_programs: Option<usize>,
    /// What [`Nitro::fit`] and [`Nitro::fit_ragged`] do when a training loss is NaN or
    /// infinite (checked when an epoch's losses are read): warn naming the step (the default),
    /// or stop with [`Error::NonFiniteLoss`].
    pub non_finite: NonFinite,
    /// Whether the per-batch programs (gradient, evaluation, metrics) read the trainable
    /// leaves as zero-copy views of the packed parameters (the default; on XLA, through PJRT's
    /// `CreateViewOfDeviceBuffer`), or as copies made after every update, through the host.
    /// Copies are the fallback for a plugin that refuses views, and slower; the handle says
    /// which it uses ([`Nitro::leaf_inputs`]). The programs are the same either way.
    pub leaf_views: bool,
    /// A mesh of devices to partition every program over with XLA's SPMD partitioner (in
    /// place of [`Config::devices`]' replicas), laid out as [`Config::sharding`] says. The
    /// mesh and the sharding are part of every program's key. On the interpreter the programs
    /// run unpartitioned on one device, with the same values.
    pub mesh: Option<crate::shard::Mesh>,
    /// How the experiment is laid out over [`Config::mesh`]: `None` splits the batch along
    /// the mesh's axis and keeps everything else whole on every device
    /// ([`Sharding::replicated`](crate::shard::Sharding::replicated));
    /// [`Sharding::fsdp`](crate::shard::Sharding::fsdp) splits the parameters, the optimizer
    /// state and the gradients too.
    pub sharding: Option<crate::shard::Sharding>,
    /// Every how many optimizer steps the handle saves a checkpoint, and where
    /// ([`Nitro::save_in_background`]: the state after that step, copied off the devices and
    /// written on a thread of its own while training goes on, atomically over the previous
    /// one). `None` (the default) saves only when asked.
    pub save_every: Option<(u64, std::path::PathBuf)>,
    /// Rules that create trainable leaves on the devices instead of reading them from the
    /// experiment ([`Config::initialize`]): for each leaf, the first rule whose pattern
    /// matches its path. Empty (the default): every leaf is read from the experiment.
    pub initialize: Vec<InitRule>,
    /// The precision the gradient, evaluation and metric programs compute in
    /// ([`Precision`]): the leaves' own dtypes (the default), or f32 parameters and optimizer
    /// state with the forward and backward passes in bf16 or f16. Part of those programs' keys.
    pub precision: Precision,
}

/// One rule of [`Config::initialize`]: the trainable leaves whose path matches `pattern` are
/// created on the devices as `init` says.
#[derive(Clone, Debug, PartialEq)]
pub struct InitRule {
    /// The leaf-path pattern ([`crate::pattern`]).
    pub pattern: String,
    /// How the leaves it matches are created.
    pub init: crate::init::Init,
    /// Whether a handle refuses the rule when it matches no trainable leaf: a rule given on
    /// its own ([`Config::initialize`]) must apply; a rule of a set
    /// ([`Config::initialize_all`]) may go unused, as long as one of the rules applies.
    pub required: bool,
}

/// What an epoch does on a NaN or infinite training loss ([`Config::non_finite`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NonFinite {
    /// Log a warning (`tracing`, target `nitro::train`) naming the epoch, the batch and the
    /// step of the first non-finite loss, and train on.
    #[default]
    Warn,
    /// Return [`Error::NonFiniteLoss`] naming them; the handle keeps the state it reached.
    /// Losses are read when an epoch ends (steps are enqueued without waiting), so that state
    /// is the epoch's last step's, not the one that produced the loss: the error names both
    /// (`step` and `state_step`). Resume from a checkpoint taken before `step` to go back.
    Stop,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            batch: 32,
            lr: 1e-3,
            epochs: 10,
            seed: 0,
            schedule: None,
            progress: true,
            accum: 1,
            devices: None,
            concurrent_compiles: true,
            compile_threads: None,
            buckets: None,
            max_programs: None,
            non_finite: NonFinite::Warn,
            leaf_views: true,
            mesh: None,
            sharding: None,
            save_every: None,
            initialize: Vec::new(),
            precision: Precision::full(),
        }
    }
}

impl Config {
    /// The default configuration: batch 32, learning rate 1e-3, 10 epochs, seed 0.
    pub fn new() -> Config {
        Config::default()
    }

    /// Rows per step.
    pub fn batch(mut self, rows: usize) -> Config {
        self.batch = rows;
        self
    }

    /// The learning rate.
    pub fn lr(mut self, lr: f64) -> Config {
        self.lr = lr;
        self
    }

    /// Epochs [`Nitro::fit`] runs.
    pub fn epochs(mut self, epochs: usize) -> Config {
        self.epochs = epochs;
        self
    }

    /// The seed of the per-epoch shuffles and of the random stream.
    pub fn seed(mut self, seed: u64) -> Config {
        self.seed = seed;
        self
    }

    /// Whether to draw a progress bar per epoch (on stderr, and only when it is a terminal).
    pub fn progress(mut self, on: bool) -> Config {
        self.progress = on;
        self
    }

    /// Micro-batches per optimizer step (see [`Config::accum`]).
    pub fn accumulate(mut self, micro_batches: usize) -> Config {
        self.accum = micro_batches;
        self
    }

    /// Devices to train on at once (see [`Config::devices`]).
    pub fn devices(mut self, devices: usize) -> Config {
        self.devices = Some(devices);
        self
    }

    /// Partition every program over `mesh` (see [`Config::mesh`]).
    ///
    /// ```
    /// use nitro::shard::{Mesh, Sharding};
    /// use nitro::train::Config;
    ///
    /// let config = Config::new()
    ///     .batch(64)
    ///     .mesh(Mesh::new([("data", 4)])?)
    ///     .sharding(Sharding::fsdp("data"));
    /// assert_eq!(config.partitioning()?.map(|p| p.devices()), Some(4));
    /// # Ok::<(), nitro::Error>(())
    /// ```
    pub fn mesh(mut self, mesh: crate::shard::Mesh) -> Config {
        self.mesh = Some(mesh);
        self
    }

    /// How the experiment is laid out over the mesh (see [`Config::sharding`]).
    pub fn sharding(mut self, sharding: crate::shard::Sharding) -> Config {
        self.sharding = Some(sharding);
        self
    }

    /// The mesh and sharding, checked: `None` without a mesh; an error for a sharding without
    /// a mesh, a mesh together with [`Config::devices`], or a sharding whose axis the mesh
    /// lacks.
    pub fn partitioning(&self) -> Result<Option<crate::shard::Partitioning>> {
        let Some(mesh) = &self.mesh else {
            return match &self.sharding {
                None => Ok(None),
                Some(s) => Err(Error::Sharding {
                    what: format!("Config::sharding {s}"),
                    problem: "no mesh was given; add `Config::mesh(Mesh::new([(\"data\", n)])?)`"
                        .into(),
                }),
            };
        };
        if let Some(n) = self.devices {
            return Err(Error::Sharding {
                what: format!("Config::devices({n})"),
                problem: format!(
                    "a mesh ({}) was given too; the mesh says how many devices to use: drop \
                     `Config::devices`",
                    mesh.devices()
                ),
            });
        }
        let sharding = match &self.sharding {
            Some(s) => s.clone(),
            None => crate::shard::Sharding::replicated(
                mesh.axes().first().map_or("data", |(n, _)| n.as_str()),
            ),
        };
        crate::shard::Partitioning::new(mesh.clone(), sharding).map(Some)
    }

    /// Shape buckets (see [`Config::buckets`]).
    pub fn buckets(mut self, buckets: Buckets) -> Config {
        self.buckets = Some(buckets);
        self
    }

    /// A recompile budget (see [`Config::max_programs`]).
    pub fn max_programs(mut self, programs: usize) -> Config {
        self.max_programs = Some(programs);
        self
    }

    /// What to do on a NaN or infinite training loss (see [`Config::non_finite`]).
    pub fn non_finite(mut self, policy: NonFinite) -> Config {
        self.non_finite = policy;
        self
    }

    /// Whether the per-batch programs read the trainable leaves as views (see
    /// [`Config::leaf_views`]).
    pub fn leaf_views(mut self, on: bool) -> Config {
        self.leaf_views = on;
        self
    }

    /// The most programs compiled at once (see [`Config::compile_threads`]); 0 is taken as 1.
    pub fn compile_threads(mut self, threads: usize) -> Config {
        self.compile_threads = Some(threads.max(1));
        self
    }

    /// The compile threads in force: [`Config::compile_threads`], else the machine's available
    /// parallelism (at least 2).
    pub fn compile_thread_count(&self) -> usize {
        self.compile_threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .max(2)
        })
    }

    /// Whether programs compile concurrently (see [`Config::concurrent_compiles`]).
    pub fn concurrent_compiles(mut self, on: bool) -> Config {
        self.concurrent_compiles = on;
        self
    }

    /// The device count a handle made with [`Nitro::new`] uses: the mesh's ([`Config::mesh`]),
    /// else [`Config::devices`], else `NITRO_DEVICES`, else 1. Between 1 and
    /// [`MAX_DEVICES`](crate::backend::MAX_DEVICES) ([`Error::Devices`] otherwise).
    pub fn device_count(&self) -> Result<usize> {
        match (&self.mesh, self.devices) {
            (Some(mesh), _) => Ok(mesh.devices()),
            (None, Some(n)) => crate::backend::check_device_count(n, "Config::devices"),
            (None, None) => Ok(crate::backend::pjrt::devices_setting()?.unwrap_or(1)),
        }
    }

    /// The backend a handle made with [`Nitro::new`] on this config runs on: partitioned over
    /// [`Config::mesh`], else replicated over [`Config::device_count`] devices — what to
    /// describe when saying which devices a run uses (the process's default backend,
    /// [`crate::backend::current`], has one device).
    pub fn backend(&self) -> Result<&'static dyn crate::backend::Backend> {
        backend_for(self)
    }

    /// Into how many runs of rows a handle made with [`Nitro::new`] splits each batch, so the
    /// multiple every batch's row count must be: on a mesh the size of the sharding's axis
    /// (devices that differ only along another axis get the same rows), else the device count.
    /// It is what [`Buckets::rows_for`](crate::data::buckets::Buckets::rows_for) takes as
    /// `replicas`.
    pub fn row_multiple(&self) -> Result<usize> {
        match self.partitioning()? {
            Some(p) => Ok(p.row_split()),
            None => self.device_count(),
        }
    }

    /// Saves a checkpoint to `path` every `steps` optimizer steps, in the background
    /// ([`Nitro::save_in_background`]); 0 steps is refused when the handle is made. A save that
    /// fails, or one that cannot start when due (the last one failed:
    /// [`Error::SaveNotStarted`](crate::Error::SaveNotStarted)), is reported by the next step
    /// call, which is then not taken ([`Nitro::step`]).
    pub fn save_every(mut self, steps: u64, path: impl Into<std::path::PathBuf>) -> Config {
        self.save_every = Some((steps, path.into()));
        self
    }

    /// Sets [`Config::precision`]: `Precision::bf16()` keeps f32 parameters and optimizer
    /// state and runs the forward and backward passes in bfloat16.
    pub fn precision(mut self, precision: Precision) -> Config {
        self.precision = precision;
        self
    }

    /// Creates the trainable leaves whose path matches `pattern` (`*` any run of characters,
    /// `|` alternatives; [`crate::pattern`]) on the devices as `init` says, instead of reading
    /// them from the experiment: the first step traces an initializer program — keyed and
    /// cached like every other — and runs it partitioned on [`Config::mesh`], so each device
    /// creates only its own shard, from the run's [`seed`](Config::seed) (leaf `p`'s key is
    /// `fold_in(fold_in(PRNGKey(seed), INIT_DOMAIN), leaf_id(p))`: the same values on any mesh
    /// and on one device). The experiment's values of those leaves are never read: build it
    /// under [`crate::init::declared`] and they cost no memory. The first rule that matches a
    /// leaf applies; a rule that matches no trainable leaf, or a random rule on a leaf that is
    /// not floating-point, is refused when the handle is made. A resumed handle takes its
    /// leaves from the checkpoint.
    ///
    /// ```
    /// use nitro::init::{layer_defaults, Init};
    /// use nitro::train::Config;
    ///
    /// let config = Config::new()
    ///     .initialize("head.w", Init::Zeros)
    ///     .initialize_all(layer_defaults());
    /// assert_eq!(config.initialize[0].pattern, "head.w");
    /// ```
    pub fn initialize(mut self, pattern: impl Into<String>, init: crate::init::Init) -> Config {
        self.initialize.push(InitRule {
            pattern: pattern.into(),
            init,
            required: true,
        });
        self
    }

    /// [`initialize`](Config::initialize) with each rule of `rules`, in order (say,
    /// [`crate::init::layer_defaults`]).
    pub fn initialize_all<P: Into<String>>(
        mut self,
        rules: impl IntoIterator<Item = (P, crate::init::Init)>,
    ) -> Config {
        self.initialize
            .extend(rules.into_iter().map(|(p, init)| InitRule {
                pattern: p.into(),
                init,
                required: false,
            }));
        self
    }

    /// A learning-rate schedule (constant, step decay, warm-up, cosine, or your own).
    pub fn schedule(mut self, schedule: impl Schedule + 'static) -> Config {
        self.schedule = Some(Arc::new(schedule));
        self
    }
}
