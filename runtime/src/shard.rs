//! Sharding over a mesh of devices (XLA's SPMD partitioner): a [`Mesh`] of named axes, a
//! [`PartitionSpec`] per array saying which of its dims is split along which axis, and the
//! host-side split and gather of arrays into per-device shards.
//!
//! A program is traced at its global shapes; [`Sharding`] annotates its arguments and results
//! (emitted as Shardy's `sdy.mesh` and `sdy.sharding` attributes, as JAX does) and XLA
//! partitions it, inserting the all-gathers and reductions. Compile it with
//! [`Client::compile_partitioned`](crate::backend::pjrt::Client::compile_partitioned) and run
//! it with one list of shards per device.
//!
//! ```
//! use nitro::shard::{Mesh, PartitionSpec};
//! use nitro::Array;
//!
//! let mesh = Mesh::new([("data", 2), ("model", 2)])?;
//! assert_eq!(mesh.devices(), 4);
//! // Rows split on "data", columns whole: device d holds rows of its data coordinate d / 2.
//! let spec = PartitionSpec::new([Some("data"), None]);
//! let w = Array::from_vec(&[4, 2], (0..8).map(|i| i as f32).collect())?;
//! let shards = spec.split(&mesh, &w, "w")?;
//! assert_eq!(shards[3].as_slice::<f32>()?, &[4.0, 5.0, 6.0, 7.0]);
//! assert_eq!(spec.gather(&mesh, &shards, "w")?, w);
//! # Ok::<(), nitro::Error>(())
//! ```

use crate::error::{Error, Result};
use crate::tree::{Array, LeafType};

/// The most devices a handle, a mesh or `NITRO_DEVICES` may name: [`Mesh::new`],
/// [`Config::device_count`](crate::train::Config::device_count) and
/// [`for_devices`](crate::backend::for_devices) refuse more. Defined with the meshes, which every
/// layer below the backend checks against it; [`crate::backend::MAX_DEVICES`] is this.
pub const MAX_DEVICES: usize = 2048;

/// Devices arranged along named axes (`data`, `model`), device ids in row-major order: on a
/// `data=2 × model=2` mesh, device `2·data + model`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    axes: Vec<(String, usize)>,
}

impl Mesh {
    /// A mesh of these axes, in order. Names must be identifiers and unique, sizes at least 1,
    /// and the product of the sizes — the device count — at most
    /// [`MAX_DEVICES`] (checked: sizes whose product overflows are
    /// refused, never wrapped).
    pub fn new<N: Into<String>>(axes: impl IntoIterator<Item = (N, usize)>) -> Result<Mesh> {
        let axes: Vec<(String, usize)> = axes.into_iter().map(|(n, s)| (n.into(), s)).collect();
        let bad = |problem: String| Error::Sharding {
            what: "the mesh".into(),
            problem,
        };
        if axes.is_empty() {
            return Err(bad(
                "it has no axes; name at least one (`[(\"data\", 4)]`)".into()
            ));
        }
        for (i, (name, size)) in axes.iter().enumerate() {
            let ident = name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !ident {
                return Err(bad(format!("axis name {name:?} is not an identifier")));
            }
            if *size == 0 {
                return Err(bad(format!("axis `{name}` has size 0")));
            }
            if axes[..i].iter().any(|(n, _)| n == name) {
                return Err(bad(format!("axis `{name}` is named twice")));
            }
        }
        let max = MAX_DEVICES;
        let devices = axes
            .iter()
            .try_fold(1usize, |n, (_, s)| n.checked_mul(*s).filter(|&n| n <= max));
        if devices.is_none() {
            let sizes: Vec<String> = axes.iter().map(|(n, s)| format!("{n}={s}")).collect();
            return Err(bad(format!(
                "its axes [{}] span more than {max} devices (the most a handle can use); make \
                 the axes smaller",
                sizes.join(", ")
            )));
        }
        Ok(Mesh { axes })
    }

    /// The axes, in order.
    pub fn axes(&self) -> &[(String, usize)] {
        &self.axes
    }

    /// How many devices it spans: the product of its axes' sizes.
    pub fn devices(&self) -> usize {
        self.axes.iter().map(|(_, s)| s).product()
    }

    /// The size of axis `name`.
    pub fn size(&self, name: &str) -> Option<usize> {
        self.axes.iter().find(|(n, _)| n == name).map(|(_, s)| *s)
    }

    /// Device `device`'s coordinate along axis `name`.
    fn coordinate(&self, device: usize, name: &str) -> usize {
        let mut stride = 1;
        for (n, s) in self.axes.iter().rev() {
            if n == name {
                return device / stride % s;
            }
            stride *= s;
        }
        0
    }

    /// The same mesh with its axes named by position (`a0`, `a1`, …): what a program's text
    /// names them when its fingerprint must not depend on what they are called
    /// ([`EmitOptions::canonical_axes`](crate::emit::EmitOptions::canonical_axes)).
    pub fn canonical(&self) -> Mesh {
        Mesh {
            axes: self
                .axes
                .iter()
                .enumerate()
                .map(|(i, (_, s))| (canonical_axis(i), *s))
                .collect(),
        }
    }

    /// The shape: each axis's size, in order (what a partitioned executable depends on; the
    /// names do not).
    pub fn shape(&self) -> Vec<usize> {
        self.axes.iter().map(|(_, s)| *s).collect()
    }

    /// Shardy's declaration of the mesh, `sdy.mesh @mesh = <["data"=2, "model"=2]>`.
    pub(crate) fn sdy(&self) -> String {
        let axes: Vec<String> = self
            .axes
            .iter()
            .map(|(n, s)| format!("\"{n}\"={s}"))
            .collect();
        format!("sdy.mesh @mesh = <[{}]>", axes.join(", "))
    }
}

/// The name of a mesh's axis `i` in a program's text that names axes by position (`a0`).
fn canonical_axis(i: usize) -> String {
    format!("a{i}")
}

/// Per dim of an array, the mesh axis it is split along (`None`: whole on every device) — JAX's
/// `PartitionSpec`. Dims past the spec's length are whole.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PartitionSpec(pub Vec<Option<String>>);

impl PartitionSpec {
    /// A spec from one entry per dim.
    pub fn new<N: Into<String>>(dims: impl IntoIterator<Item = Option<N>>) -> PartitionSpec {
        PartitionSpec(dims.into_iter().map(|d| d.map(Into::into)).collect())
    }

    /// Whole on every device.
    pub fn replicated() -> PartitionSpec {
        PartitionSpec(Vec::new())
    }

    /// Whether it splits no dim: every device holds the whole array.
    pub fn is_whole(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }

    /// Split along `axis` on the largest dim of `dims` that its size divides (FSDP's rule);
    /// whole when none does.
    pub fn fsdp(mesh: &Mesh, axis: &str, dims: &[usize]) -> PartitionSpec {
        let Some(size) = mesh.size(axis) else {
            return PartitionSpec::replicated();
        };
        let best = dims
            .iter()
            .enumerate()
            .filter(|(_, &d)| size > 0 && d.is_multiple_of(size) && d >= size)
            .max_by_key(|(i, &d)| (d, std::cmp::Reverse(*i)));
        match best {
            Some((i, _)) => {
                let mut spec = vec![None; i + 1];
                spec[i] = Some(axis.to_owned());
                PartitionSpec(spec)
            }
            None => PartitionSpec::replicated(),
        }
    }

    /// Checks the spec against `mesh` and an array of type `ty` named `what`: every axis exists
    /// and is used once, the spec is no longer than the rank, and every split dim divides.
    pub fn check(&self, mesh: &Mesh, ty: &LeafType, what: &str) -> Result<()> {
        let bad = |problem: String| Error::Sharding {
            what: format!("{what} {ty}"),
            problem,
        };
        if self.0.len() > ty.dims.len() {
            return Err(bad(format!(
                "the spec {self} names {} dims, the array has {}",
                self.0.len(),
                ty.dims.len()
            )));
        }
        for (dim, axis) in self.0.iter().enumerate() {
            let Some(axis) = axis else { continue };
            let Some(size) = mesh.size(axis) else {
                return Err(bad(format!(
                    "the spec {self} names axis `{axis}`, which the mesh {} lacks",
                    mesh.sdy()
                )));
            };
            if self.0[..dim].iter().flatten().any(|a| a == axis) {
                return Err(bad(format!(
                    "the spec {self} splits two dims along `{axis}`"
                )));
            }
            if !ty.dims[dim].is_multiple_of(size) {
                return Err(bad(format!(
                    "dim {dim} ({}) does not divide into {size} shards along `{axis}`; choose \
                     a size that does, or leave that dim whole",
                    ty.dims[dim]
                )));
            }
        }
        Ok(())
    }

    /// This spec with each axis of `mesh` named by its position, as in [`Mesh::canonical`] (an
    /// axis `mesh` lacks keeps its name).
    pub fn canonical_in(&self, mesh: &Mesh) -> PartitionSpec {
        PartitionSpec(
            self.0
                .iter()
                .map(|d| {
                    d.as_ref()
                        .map(|axis| match mesh.axes.iter().position(|(n, _)| n == axis) {
                            Some(i) => canonical_axis(i),
                            None => axis.clone(),
                        })
                })
                .collect(),
        )
    }

    /// One device's shard type of an array of type `ty`.
    pub fn shard_type(&self, mesh: &Mesh, ty: &LeafType) -> LeafType {
        let dims: Vec<usize> = ty
            .dims
            .iter()
            .enumerate()
            .map(|(i, &d)| match self.0.get(i).cloned().flatten() {
                Some(axis) => d / mesh.size(&axis).unwrap_or(1).max(1),
                None => d,
            })
            .collect();
        LeafType::new(ty.dtype, &dims)
    }

    /// Device `device`'s `(start, len)` along each dim of an array of `dims`.
    pub(crate) fn window(&self, mesh: &Mesh, dims: &[usize], device: usize) -> Vec<(usize, usize)> {
        dims.iter()
            .enumerate()
            .map(|(i, &d)| match self.0.get(i).cloned().flatten() {
                Some(axis) => {
                    let n = d / mesh.size(&axis).unwrap_or(1).max(1);
                    (mesh.coordinate(device, &axis) * n, n)
                }
                None => (0, d),
            })
            .collect()
    }

    /// `array` cut into one shard per device of `mesh`, in device order (checked first).
    pub fn split(&self, mesh: &Mesh, array: &Array, what: &str) -> Result<Vec<Array>> {
        self.check(mesh, &array.leaf_type(), what)?;
        (0..mesh.devices())
            .map(|device| {
                let window = self.window(mesh, array.dims(), device);
                crate::ops::host::layout::window_of(array, &window)
            })
            .collect()
    }

    /// The array whose shards, one per device of `mesh` in device order, are `shards` (a
    /// replicated dim is taken from the device that holds coordinate 0 of every other axis).
    /// The spec is checked as [`split`](PartitionSpec::split) checks it, against the whole
    /// array the shards make.
    pub fn gather(&self, mesh: &Mesh, shards: &[Array], what: &str) -> Result<Array> {
        let first = shards.first().ok_or_else(|| Error::Sharding {
            what: what.to_owned(),
            problem: "no shards to gather".into(),
        })?;
        if shards.len() != mesh.devices() {
            return Err(Error::Sharding {
                what: what.to_owned(),
                problem: format!(
                    "{} shards for a mesh of {} devices",
                    shards.len(),
                    mesh.devices()
                ),
            });
        }
        let dims = first
            .dims()
            .iter()
            .enumerate()
            .map(|(i, &d)| match self.0.get(i).cloned().flatten() {
                Some(axis) => d.checked_mul(mesh.size(&axis).unwrap_or(1)),
                None => Some(d),
            })
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| Error::Sharding {
                what: what.to_owned(),
                problem: format!(
                    "shards of {} gathered by {self} overflow a dim's size",
                    first.leaf_type()
                ),
            })?;
        // The same check as `split`'s, on the whole array the shards make: an axis the mesh
        // lacks, a spec longer than the rank or an axis used twice is refused, never sized as 1.
        self.check(mesh, &LeafType::new(first.dtype(), &dims), what)?;
        let mut pieces = Vec::new();
        for (device, shard) in shards.iter().enumerate() {
            let window = self.window(mesh, &dims, device);
            if shard.dims() != window.iter().map(|w| w.1).collect::<Vec<_>>().as_slice() {
                return Err(Error::Sharding {
                    what: what.to_owned(),
                    problem: format!(
                        "device {device}'s shard is {}, the others' {}",
                        shard.leaf_type(),
                        first.leaf_type()
                    ),
                });
            }
            pieces.push((window, shard));
        }
        crate::ops::host::layout::assemble(&dims, first.dtype(), &pieces)
    }
}

impl std::fmt::Display for PartitionSpec {
    /// `P("data", None)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dims: Vec<String> = self
            .0
            .iter()
            .map(|d| d.as_ref().map_or("None".to_owned(), |a| format!("{a:?}")))
            .collect();
        write!(f, "P({})", dims.join(", "))
    }
}

/// How a program's arguments and results are sharded over a mesh: what
/// [`EmitOptions::sharding`](crate::emit::EmitOptions::sharding) emits.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProgramSharding {
    /// The mesh.
    pub mesh: Mesh,
    /// One spec per argument, in order (missing ones: replicated).
    pub inputs: Vec<PartitionSpec>,
    /// One spec per result, in order (missing ones: replicated).
    pub outputs: Vec<PartitionSpec>,
}

impl ProgramSharding {
    /// The same sharding with the mesh's axes named by position ([`Mesh::canonical`]).
    pub fn canonical(&self) -> ProgramSharding {
        let spec = |s: &PartitionSpec| s.canonical_in(&self.mesh);
        ProgramSharding {
            mesh: self.mesh.canonical(),
            inputs: self.inputs.iter().map(spec).collect(),
            outputs: self.outputs.iter().map(spec).collect(),
        }
    }

    /// Shardy's attribute for `spec` on an array of rank `rank`: `#sdy.sharding<@mesh, [{"data"},
    /// {}]>`.
    pub(crate) fn sdy(spec: Option<&PartitionSpec>, rank: usize) -> String {
        let dims: Vec<String> = (0..rank)
            .map(|i| match spec.and_then(|s| s.0.get(i).cloned().flatten()) {
                Some(axis) => format!("{{\"{axis}\"}}"),
                None => "{}".to_owned(),
            })
            .collect();
        format!("#sdy.sharding<@mesh, [{}]>", dims.join(", "))
    }
}

/// How the training handle lays an experiment out over a mesh
/// ([`Config::mesh`](crate::train::Config::mesh)): which axis the batch is split along, and how
/// each trainable leaf — with its optimizer slots and its gradient — is split.
///
/// - [`Sharding::fsdp`]: fully sharded data parallelism. Each trainable leaf is split along its
///   largest dim the axis divides ([`PartitionSpec::fsdp`]; a leaf with no such dim stays
///   whole), and so are its optimizer slots and its gradient. XLA all-gathers a leaf where the
///   program reads it and reduce-scatters its gradient; the update program runs on each
///   device's shards alone. Parameter and optimizer memory per device falls by about the axis
///   size.
/// - [`Sharding::replicated`]: data parallelism through the partitioner. Every device keeps
///   every leaf whole; only the batch is split (what
///   [`Config::devices`](crate::train::Config::devices) does with replicated programs).
/// - [`Sharding::leaf`]: an explicit spec for the leaves whose path matches a pattern (the
///   pattern language of [`crate::pattern`] (`AdamW::no_decay`'s too): `*` any run of
///   characters, `|` alternatives), over any axis of the mesh — tensor parallelism, such as an
///   MLP's first weight split by columns on a `model` axis and its second by rows. The first
///   matching pattern wins; the others follow the FSDP or replicated rule.
///
/// What it resolves to is part of every program's key: the mesh's shape (in the backend's
/// identity), its axis names and each trainable leaf's resolved spec (in the key's
/// components), and the program's text, which names the axes by position. So a handle whose
/// sharding splits some array differently compiles its programs again and never runs one
/// compiled for another, while a rule that restates what another gives (a `leaf` pattern
/// repeating FSDP's spec) shares its programs, and a mesh renamed with the same partitioning
/// loads them from the store.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sharding {
    axis: String,
    fsdp: bool,
    leaves: Vec<(String, PartitionSpec)>,
}

impl Sharding {
    /// Fully sharded data parallelism along `axis`: the batch, and every trainable leaf with
    /// its optimizer slots and gradient, split along it.
    pub fn fsdp(axis: impl Into<String>) -> Sharding {
        Sharding {
            axis: axis.into(),
            fsdp: true,
            leaves: Vec::new(),
        }
    }

    /// The batch split along `axis`; the leaves whole on every device (unless a
    /// [`leaf`](Sharding::leaf) spec splits them).
    pub fn replicated(axis: impl Into<String>) -> Sharding {
        Sharding {
            axis: axis.into(),
            fsdp: false,
            leaves: Vec::new(),
        }
    }

    /// This sharding, with the trainable leaves whose path matches `pattern` split as `spec`
    /// says (tensor parallelism). Checked against each matching leaf when the handle is made:
    /// an axis the mesh lacks, or a dim that does not divide, is an error naming the leaf.
    ///
    /// ```
    /// use nitro::shard::{PartitionSpec, Sharding};
    ///
    /// // Megatron's MLP: the first weight split by columns, the second by rows.
    /// let tp = Sharding::replicated("data")
    ///     .leaf("*.fc1.w|*.fc1.b", PartitionSpec::new([None, Some("model")]))
    ///     .leaf("*.fc2.w", PartitionSpec::new([Some("model"), None]));
    /// assert_eq!(tp.to_string(), "replicated(data), *.fc1.w|*.fc1.b: P(None, \"model\"), *.fc2.w: P(\"model\", None)");
    /// ```
    pub fn leaf(mut self, pattern: impl Into<String>, spec: PartitionSpec) -> Sharding {
        self.leaves.push((pattern.into(), spec));
        self
    }

    /// The axis the batch (and, under FSDP, the leaves) is split along.
    pub fn axis(&self) -> &str {
        &self.axis
    }

    /// Whether leaves without a spec of their own are split along the axis.
    pub fn is_fsdp(&self) -> bool {
        self.fsdp
    }

    /// The explicit per-leaf specs, by pattern, in order.
    pub fn leaves(&self) -> &[(String, PartitionSpec)] {
        &self.leaves
    }
}

impl std::fmt::Display for Sharding {
    /// `fsdp(data)` or `replicated(data)`, then each leaf pattern with its spec.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.fsdp { "fsdp" } else { "replicated" };
        write!(f, "{kind}({})", self.axis)?;
        for (pattern, spec) in &self.leaves {
            write!(f, ", {pattern}: {spec}")?;
        }
        Ok(())
    }
}

/// A mesh and how the training handle shards over it: what a partitioned backend
/// ([`crate::backend::for_mesh`]) compiles every program for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Partitioning {
    mesh: Mesh,
    sharding: Sharding,
}

impl Partitioning {
    /// `sharding` over `mesh`, checked: the sharding's axis, and every axis its leaf specs
    /// name, must be the mesh's. (Each leaf spec is checked against the leaves it matches when
    /// a handle is made.)
    pub fn new(mesh: Mesh, sharding: Sharding) -> Result<Partitioning> {
        let lacks = |axis: &str, what: String| Error::Sharding {
            what,
            problem: format!(
                "it splits along `{axis}`, which the mesh {} lacks; name one of its axes",
                mesh.sdy()
            ),
        };
        if mesh.size(sharding.axis()).is_none() {
            return Err(lacks(sharding.axis(), format!("the sharding {sharding}")));
        }
        for (pattern, spec) in sharding.leaves() {
            if let Some(axis) = spec.0.iter().flatten().find(|a| mesh.size(a).is_none()) {
                return Err(lacks(
                    axis,
                    format!("the spec {spec} of leaves `{pattern}`"),
                ));
            }
        }
        Ok(Partitioning { mesh, sharding })
    }

    /// The mesh.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The sharding.
    pub fn sharding(&self) -> &Sharding {
        &self.sharding
    }

    /// How many devices (partitions) a program runs on.
    pub fn devices(&self) -> usize {
        self.mesh.devices()
    }

    /// The spec of the trainable leaf at `path` of type `ty` — and of its optimizer slots, its
    /// gradient and its gradient sum: the first [`Sharding::leaf`] pattern it matches (checked
    /// against the leaf), else FSDP's rule under [`Sharding::fsdp`], else whole.
    pub fn leaf_spec(&self, path: &str, ty: &LeafType) -> Result<PartitionSpec> {
        let explicit = self
            .sharding
            .leaves
            .iter()
            .find(|(pattern, _)| crate::pattern::path_match(pattern, path));
        match explicit {
            Some((pattern, spec)) => {
                spec.check(
                    &self.mesh,
                    ty,
                    &format!("trainable leaf `{path}` (matched by `{pattern}`)"),
                )?;
                Ok(spec.clone())
            }
            None if self.sharding.fsdp => Ok(PartitionSpec::fsdp(
                &self.mesh,
                self.sharding.axis(),
                &ty.dims,
            )),
            None => Ok(PartitionSpec::replicated()),
        }
    }

    /// The spec of a batch array: its rows split along the axis.
    pub(crate) fn rows(&self) -> PartitionSpec {
        PartitionSpec::new([Some(self.sharding.axis())])
    }

    /// Into how many runs of rows a batch is split: the size of the sharding's (batch) axis.
    /// Devices that differ only along another axis get the same rows.
    pub fn row_split(&self) -> usize {
        self.mesh.size(self.sharding.axis()).unwrap_or(1)
    }

    /// One line for the backend's description and key: `mesh [data=4], fsdp(data)`.
    pub fn describe(&self) -> String {
        let axes: Vec<String> = self
            .mesh
            .axes()
            .iter()
            .map(|(n, s)| format!("{n}={s}"))
            .collect();
        format!("mesh [{}], {}", axes.join(", "), self.sharding)
    }
}

/// How each group of trainable leaves a program takes is split over a mesh: per group, its
/// leaf's path and [`PartitionSpec`], in the user's axis names. The GraphConst of the training
/// handle's update program ([`OptimizerStep::layout`](crate::train::OptimizerStep::layout)).
///
/// Its content hash names the mesh's axes by position, as the program's text does
/// ([`Mesh::canonical`]): a mesh whose axes are only renamed (`data=4` → `batch=4`) keys the
/// same program, while one whose axes are reordered (`data=2, model=2` → `model=2, data=2`)
/// splits its arrays differently and keys another. The names stay in
/// [`groups`](GroupLayout::groups), for the program's shardings and its messages.
///
/// ```
/// use nitro::shard::{GroupLayout, Mesh, PartitionSpec};
/// use nitro::Digest;
///
/// let on = |axes: [(&str, usize); 2], axis: &str| {
///     let mesh = Mesh::new(axes).unwrap();
///     let groups = vec![("w".to_owned(), PartitionSpec::new([Some(axis)]))];
///     Digest::of(&GroupLayout::new(Some(&mesh), groups))
/// };
/// // Renamed: the same layout.
/// assert_eq!(on([("data", 2), ("model", 2)], "data"), on([("rows", 2), ("cols", 2)], "rows"));
/// // Reordered: `data` is now the second axis.
/// assert_ne!(on([("data", 2), ("model", 2)], "data"), on([("model", 2), ("data", 2)], "data"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupLayout {
    mesh: Option<Mesh>,
    groups: Vec<(String, PartitionSpec)>,
}

impl GroupLayout {
    /// The `groups` (each a leaf's path and spec) on `mesh`; empty off a mesh (`None`).
    pub fn new(mesh: Option<&Mesh>, groups: Vec<(String, PartitionSpec)>) -> GroupLayout {
        match mesh {
            Some(mesh) => GroupLayout {
                mesh: Some(mesh.clone()),
                groups,
            },
            None => GroupLayout::default(),
        }
    }

    /// The groups, in order: each leaf's path and spec (in the mesh's own axis names).
    pub fn groups(&self) -> &[(String, PartitionSpec)] {
        &self.groups
    }

    /// Whether there are no groups (off a mesh).
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The mesh the specs name axes of; `None` off a mesh.
    pub fn mesh(&self) -> Option<&Mesh> {
        self.mesh.as_ref()
    }
}

impl crate::ContentHash for GroupLayout {
    /// The mesh's shape, then each group's path and spec with the axes named by position.
    fn content_hash(&self, h: &mut crate::ContentHasher) {
        let shape = self.mesh.as_ref().map(Mesh::shape).unwrap_or_default();
        let groups: Vec<(String, Vec<Option<String>>)> = self
            .groups
            .iter()
            .map(|(path, spec)| {
                let spec = match &self.mesh {
                    Some(mesh) => spec.canonical_in(mesh),
                    None => spec.clone(),
                };
                (path.clone(), spec.0)
            })
            .collect();
        h.field("mesh", |h| crate::ContentHash::content_hash(&shape, h));
        h.field("groups", |h| crate::ContentHash::content_hash(&groups, h));
    }
}

/// Group `i`'s spec among `specs`, one per group of the trainable leaves: the list repeats for
/// each optimizer slot (input `state[k]` holds group `k mod groups`); whole without specs.
pub(crate) fn group_spec(specs: &[PartitionSpec], i: usize) -> &PartitionSpec {
    static WHOLE: std::sync::OnceLock<PartitionSpec> = std::sync::OnceLock::new();
    match specs.len() {
        0 => WHOLE.get_or_init(PartitionSpec::replicated),
        n => &specs[i % n],
    }
}

/// The groups of trainable leaves an update program's inputs hold, as its function declares
/// them while it is traced: each group's leaf path and spec.
pub(crate) type DeclaredGroups = Vec<(String, PartitionSpec)>;

thread_local! {
    /// The groups of the update program being traced, declared by its function
    /// ([`declare_groups`]) for the trace to annotate (and name) its inputs with.
    static GROUPS: std::cell::RefCell<Option<DeclaredGroups>> =
        const { std::cell::RefCell::new(None) };
}

/// Declares, while a program is traced, the leaf path and spec of each group of trainable
/// leaves its inputs `params[i]`, `state[k]` and `grads[i]` hold (the update program's, whose
/// experiment holds them as a GraphConst, so they are in its key).
pub(crate) fn declare_groups(groups: DeclaredGroups) {
    GROUPS.with(|g| *g.borrow_mut() = Some(groups));
}

/// Takes what [`declare_groups`] declared during the trace just ended.
pub(crate) fn take_groups() -> Option<DeclaredGroups> {
    GROUPS.with(|g| g.borrow_mut().take())
}
