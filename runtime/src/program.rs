//! Programs: named `fn` items over an experiment's compile view and traced inputs.
//!
//! A [`Program`] is what nitro traces, emits, compiles and caches. It is a plain `fn` — never a
//! closure that captures — so no value can enter a program except through the compile view
//! (GraphConst fields by reference, Device fields as tensors) or its inputs. A value that
//! determines the graph is therefore always reachable as a GraphConst, which is what makes the
//! compile key complete. (A `fn` can still read a global; verify mode re-traces to catch that.)
//!
//! ```
//! use nitro::prelude::*;
//! use nitro::program::Program;
//!
//! #[derive(Tree)]
//! pub struct Dense { pub w: Array, pub b: Array }
//!
//! #[experiment]
//! pub struct Linear {
//!     #[graph_const] pub scale: u32,
//!     #[device(trainable)] pub layer: Dense,
//! }
//!
//! fn forward(v: &LinearView<'_>, x: &Tensor) -> Tensor {
//!     (x.matmul(v.layer.w) + v.layer.b) * f64::from(*v.scale)
//! }
//!
//! const FORWARD: Program<Linear, Tensor> = Linear::program("forward", forward);
//!
//! let exp = Linear {
//!     scale: 2,
//!     layer: Dense { w: Array::zeros(DType::F32, &[3, 2]), b: Array::zeros(DType::F32, &[2]) },
//! };
//! let traced = FORWARD.trace(&exp, &Array::zeros(DType::F32, &[8, 3]))?;
//! assert_eq!(traced.outputs[0].to_string(), "f32[8,2]");
//! assert_eq!(traced.inputs.to_string(), "layer.w: f32[3,2], layer.b: f32[2], input: f32[8,3]");
//! assert!(traced.text.contains("stablehlo.dot_general"));
//! # Ok::<(), nitro::Error>(())
//! ```
//!
//! A closure that captures a value is not a program:
//!
//! ```compile_fail
//! # use nitro::prelude::*;
//! # use nitro::program::Program;
//! # #[experiment] pub struct E { #[graph_const] pub n: u32 }
//! let hidden = 3.0;
//! let p: Program<E, Tensor> = E::program("f", |_v: &EView<'_>, x: &Tensor| *x * hidden);
//! ```

use std::fmt;

use crate::error::Result;
use crate::experiment::Experiment;
use crate::hash::Digest;
use crate::trace::{self, Graph, Tensor};
use crate::tree::{Array, LeafPath, LeafType, Signature, SignatureEntry, Tree};

/// What a program returns: one tensor, several, or a tuple of them.
pub trait Outputs {
    /// The tensors, in output order.
    fn into_tensors(self) -> Vec<Tensor>;
}

impl Outputs for Tensor {
    fn into_tensors(self) -> Vec<Tensor> {
        vec![self]
    }
}

impl Outputs for Vec<Tensor> {
    fn into_tensors(self) -> Vec<Tensor> {
        self
    }
}

impl<const N: usize> Outputs for [Tensor; N] {
    fn into_tensors(self) -> Vec<Tensor> {
        self.to_vec()
    }
}

impl<A: Outputs, B: Outputs> Outputs for (A, B) {
    fn into_tensors(self) -> Vec<Tensor> {
        let mut v = self.0.into_tensors();
        v.extend(self.1.into_tensors());
        v
    }
}

impl<A: Outputs, B: Outputs, C: Outputs> Outputs for (A, B, C) {
    fn into_tensors(self) -> Vec<Tensor> {
        let mut v = self.0.into_tensors();
        v.extend(self.1.into_tensors());
        v.extend(self.2.into_tensors());
        v
    }
}

/// The byte boundary every trainable leaf starts at in its packed array ([`Packing`]): the
/// alignment XLA's CPU runtime gives its own buffers, so a view of a leaf is as aligned as any
/// buffer PJRT allocates.
pub(crate) const LEAF_ALIGN: usize = 64;

/// [`LEAF_ALIGN`] in elements of `dtype`.
fn leaf_align_elements(dtype: crate::tree::DType) -> usize {
    (LEAF_ALIGN / dtype.size_bytes()).max(1)
}

thread_local! {
    /// The trainable Device leaves of the experiment whose program is being traced.
    static TRAINABLE: std::cell::RefCell<Vec<Tensor>> = const { std::cell::RefCell::new(Vec::new()) };
    /// How the trainable leaves of the program being traced are packed (empty when they are
    /// not).
    static PACKING: std::cell::RefCell<Option<Packing>> = const { std::cell::RefCell::new(None) };
    /// The dtype the program being traced computes in ([`Program::computing_in`]).
    static COMPUTE: std::cell::Cell<Option<crate::tree::DType>> = const { std::cell::Cell::new(None) };
}

/// The dtype the program being traced computes in, when it is not its leaves' own
/// ([`Program::computing_in`]); `None` outside a program's trace.
pub(crate) fn compute_dtype() -> Option<crate::tree::DType> {
    COMPUTE.with(|c| c.get())
}

/// How the trainable Device leaves of an experiment are packed into one flat array per dtype
/// (in order of first appearance in walk order): how the training handle stores parameters,
/// the layout of the gradients a per-batch program returns (see
/// [`Program::packing_trainable`]) and of the update program's inputs. An elementwise
/// optimizer runs as one loop over all parameters.
///
/// Each leaf starts at a [`LEAF_ALIGN`]-byte boundary of its flat array (zeros fill the gaps,
/// and stay zero through every optimizer: a zero parameter with a zero gradient and zero state
/// is never moved), so that a per-batch program can read each leaf as a view of the flat
/// array's memory with no copy.
///
/// On a mesh ([`Packing::per_leaf`]) every leaf is a group of its own, kept in its own shape:
/// each can then be split along its own dims ([`crate::shard::Partitioning::leaf_spec`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Packing {
    /// One entry per flat array: its dtype and length.
    pub(crate) groups: Vec<(crate::tree::DType, usize)>,
    /// One entry per trainable leaf, in walk order: its group, offset in it, and dims.
    pub(crate) leaves: Vec<(usize, usize, Vec<usize>)>,
    /// Whether every leaf is a group of its own, in the leaf's shape (not flattened).
    pub(crate) per_leaf: bool,
}

impl Packing {
    /// The packing of `experiment`'s trainable leaves: packed, or one group per leaf.
    pub(crate) fn of<E: Experiment>(experiment: &E, per_leaf: bool) -> Packing {
        let mut types = Vec::new();
        experiment.visit_device(&mut |field, _, node| {
            if let crate::tree::Node::Leaf(a) = node {
                if field.role == (crate::experiment::Role::Device { trainable: true }) {
                    types.push(a.leaf_type());
                }
            }
        });
        match per_leaf {
            true => Packing::per_leaf(&types),
            false => Packing::of_types(&types),
        }
    }

    /// One group per leaf of `types`, each in its own shape.
    pub(crate) fn per_leaf(types: &[LeafType]) -> Packing {
        Packing {
            groups: types
                .iter()
                .map(|t| (t.dtype, t.dims.iter().product()))
                .collect(),
            leaves: types
                .iter()
                .enumerate()
                .map(|(g, t)| (g, 0, t.dims.clone()))
                .collect(),
            per_leaf: true,
        }
    }

    /// The dims group `g` is kept in: its length, or its leaf's dims when per leaf.
    pub(crate) fn group_dims(&self, g: usize) -> Vec<usize> {
        match self.per_leaf {
            true => self.leaves[g].2.clone(),
            false => vec![self.groups[g].1],
        }
    }

    /// The packing of trainable leaves of `types`, in walk order.
    pub(crate) fn of_types(types: &[LeafType]) -> Packing {
        let mut p = Packing {
            groups: Vec::new(),
            leaves: Vec::new(),
            per_leaf: false,
        };
        for t in types {
            let g = match p.groups.iter().position(|(d, _)| *d == t.dtype) {
                Some(g) => g,
                None => {
                    p.groups.push((t.dtype, 0));
                    p.groups.len() - 1
                }
            };
            let n: usize = t.dims.iter().product();
            let offset = p.groups[g].1.next_multiple_of(leaf_align_elements(t.dtype));
            p.leaves.push((g, offset, t.dims.clone()));
            p.groups[g].1 = offset + n;
        }
        p
    }

    /// The leaves' types, in walk order.
    pub(crate) fn leaf_types(&self) -> Vec<LeafType> {
        self.leaves
            .iter()
            .map(|(g, _, dims)| LeafType {
                dtype: self.groups[*g].0,
                dims: dims.clone(),
            })
            .collect()
    }

    /// Zero-filled flat arrays of this packing's types.
    /// The layout of an optimizer's state for these leaves: the same groups and offsets, each
    /// group of its [`crate::optim::state_dtype`] (`f32` for half-precision parameters).
    pub(crate) fn for_state(&self) -> Packing {
        Packing {
            groups: self
                .groups
                .iter()
                .map(|&(dtype, n)| (crate::optim::state_dtype(dtype), n))
                .collect(),
            leaves: self.leaves.clone(),
            per_leaf: self.per_leaf,
        }
    }

    /// The types of this packing's groups.
    pub(crate) fn types(&self) -> Vec<LeafType> {
        (0..self.groups.len())
            .map(|g| LeafType {
                dtype: self.groups[g].0,
                dims: self.group_dims(g),
            })
            .collect()
    }

    /// Zero-filled arrays of this packing's groups.
    pub(crate) fn zeros(&self) -> Vec<Array> {
        self.types()
            .iter()
            .map(|t| Array::zeros(t.dtype, &t.dims))
            .collect()
    }

    /// Packs leaves (in walk order, of this packing's types) into the flat arrays.
    pub(crate) fn pack(&self, leaves: &[Array]) -> Result<Vec<Array>> {
        if leaves.len() != self.leaves.len() {
            return Err(crate::Error::InputCount {
                expected: self.leaves.len(),
                got: leaves.len(),
            });
        }
        let mut flat = self
            .groups
            .iter()
            .enumerate()
            .map(|(g, &(dtype, _))| {
                Array::try_zeros(dtype, &self.group_dims(g)).map(Array::into_parts)
            })
            .collect::<Result<Vec<_>>>()?;
        for (index, (a, (g, offset, dims))) in leaves.iter().zip(&self.leaves).enumerate() {
            let expected = LeafType {
                dtype: self.groups[*g].0,
                dims: dims.clone(),
            };
            let written = (a.leaf_type() == expected)
                .then(|| flat[*g].1.write_at(*offset, a.data()))
                .flatten();
            if written.is_none() {
                return Err(crate::Error::InputType {
                    index,
                    name: "trainable leaf".into(),
                    expected,
                    got: a.leaf_type(),
                });
            }
        }
        flat.into_iter()
            .map(|(dims, data)| Array::from_data(&dims, data))
            .collect()
    }

    /// The leaves (in walk order) held by the flat arrays `flat`.
    pub(crate) fn unpack(&self, flat: &[Array]) -> Result<Vec<Array>> {
        self.leaves
            .iter()
            .map(|(g, offset, dims)| {
                let n: usize = dims.iter().product();
                let data = flat
                    .get(*g)
                    .and_then(|a| a.data().range(*offset, offset + n))
                    .ok_or(crate::Error::InputCount {
                        expected: self.groups.len(),
                        got: flat.len(),
                    })?;
                Array::from_data(dims, data)
            })
            .collect()
    }
}

/// The trainable leaves' gradients (one per leaf, as [`trainable_leaves`] lists them) in the
/// layout of the program being traced: concatenated into one flat gradient per dtype when the
/// program packs its trainable leaves, unchanged otherwise.
pub(crate) fn pack_like_trainable(grads: Vec<Tensor>) -> Vec<Tensor> {
    PACKING.with(|p| match &*p.borrow() {
        None => grads,
        Some(packing) if packing.per_leaf => grads,
        Some(packing) => (0..packing.groups.len())
            .map(|g| {
                let dtype = packing.groups[g].0;
                let mut parts = Vec::new();
                let mut end = 0;
                for ((_, offset, dims), t) in packing
                    .leaves
                    .iter()
                    .zip(&grads)
                    .filter(|((lg, _, _), _)| *lg == g)
                {
                    if *offset > end {
                        parts.push(Tensor::full(&[offset - end], 0.0, dtype));
                    }
                    let n: usize = dims.iter().product();
                    parts.push(t.reshape(&[n]));
                    end = offset + n;
                }
                Tensor::concatenate(&parts, 0)
            })
            .collect(),
    })
}

/// Sets [`TRAINABLE`] for the length of a program's call, and clears it after (also when the
/// program panics).
struct TrainableGuard;

impl TrainableGuard {
    fn set(leaves: Vec<Tensor>) -> TrainableGuard {
        TRAINABLE.with(|t| *t.borrow_mut() = leaves);
        TrainableGuard
    }
}

impl Drop for TrainableGuard {
    fn drop(&mut self) {
        TRAINABLE.with(|t| t.borrow_mut().clear());
        PACKING.with(|p| *p.borrow_mut() = None);
        COMPUTE.with(|c| c.set(None));
    }
}

/// The trainable Device leaves (`#[device(trainable)]` fields) of the experiment whose program
/// is being traced, as tensors, in walk order: what a gradient program differentiates with
/// respect to, without knowing the experiment's fields. Empty outside a program's trace.
///
/// ```
/// use nitro::prelude::*;
/// use nitro::program::{self, Program};
///
/// #[experiment]
/// pub struct Fit { #[device(trainable)] pub w: Array, #[device] pub lr: Array }
///
/// fn grads(v: &FitView<'_>, x: &Tensor) -> Vec<Tensor> {
///     let loss = (*x * v.w).sum_all();
///     nitro::trace::grad(loss, &program::trainable_leaves())
/// }
/// const GRADS: Program<Fit, Tensor, Vec<Tensor>> = Fit::program("grads", grads);
/// let e = Fit { w: Array::full(&[3], 1.0f32), lr: Array::scalar(0.1f32) };
/// let traced = GRADS.trace(&e, &Array::zeros(DType::F32, &[3]))?;
/// assert_eq!(traced.outputs.len(), 1, "one trainable leaf: `w`, not `lr`");
/// # Ok::<(), nitro::Error>(())
/// ```
pub fn trainable_leaves() -> Vec<Tensor> {
    TRAINABLE.with(|t| t.borrow().clone())
}

/// The name of a program input at `path` in its input tree: the path, or `input` at the root.
pub(crate) fn input_name(path: &str) -> &str {
    if path.is_empty() {
        "input"
    } else {
        path
    }
}

/// The function of a program: `for<'v> fn(&View<'v>, &M) -> O`, with `View` the experiment's
/// compile view (`DigitsView`). A plain `fn` item coerces to it; a closure that captures a value
/// does not.
pub type ProgramFn<E, M, O> = <E as Experiment>::ProgramFn<M, O>;

/// A named program of experiment `E`, receiving traced inputs of type `M` (the tensor mirror of
/// its input tree: `Tensor` for one array, `BatchMirror<Tensor>` for a `#[derive(Tree)]`
/// struct `Batch`, `()` for none) and returning `O`.
pub struct Program<E: Experiment, M = (), O: Outputs = Tensor> {
    name: &'static str,
    f: ProgramFn<E, M, O>,
    donates_device: bool,
    /// How many leading leaves of the inputs are donated ([`Program::donating_inputs`]).
    donated_inputs: usize,
    packs_trainable: bool,
    packed_outputs: bool,
    grouped_outputs: bool,
    /// The dtype the program computes in ([`Program::computing_in`]); `None`: the leaves' own.
    compute: Option<crate::tree::DType>,
}

impl<E: Experiment, M, O: Outputs> Clone for Program<E, M, O> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E: Experiment, M, O: Outputs> Copy for Program<E, M, O> {}

impl<E: Experiment, M, O: Outputs> fmt::Debug for Program<E, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Program({})", self.identity())
    }
}

/// The result of tracing a program: its graph, signatures, StableHLO text and fingerprint.
#[derive(Clone, Debug)]
pub struct Traced {
    /// The recorded graph (forward and, if the program differentiates, backward).
    pub graph: Graph,
    /// Every input leaf, in argument order: the experiment's Device leaves (by path), then the
    /// program's inputs.
    pub inputs: Signature,
    /// The whole input structure the program was traced on: every node of the Device fields and
    /// of the inputs (leaves, sequence lengths, option presence), as the compile key sees it.
    pub structure: Signature,
    /// The output types, in order.
    pub outputs: Vec<LeafType>,
    /// The emitted StableHLO module.
    pub text: String,
    /// blake3 of `text`: the program's identity as compiled code.
    pub fingerprint: Digest,
    /// The dtype the program computes in, when it is not its leaves' own (a handle's
    /// [`Precision`](crate::train::Precision)).
    pub compute: Option<crate::tree::DType>,
    /// Whether, partitioned over a mesh, the program's inputs are groups of trainable leaves
    /// its function declared with their specs (the training handle's update and initializer
    /// programs): their layout is the mesh's, so a miss that names a change of the mesh does
    /// not name that layout again. False off a mesh.
    pub grouped: bool,
}

impl<E: Experiment, M, O: Outputs> Program<E, M, O> {
    /// A program named `name` running `f`. `#[experiment]` generates `Name::program(name, f)`,
    /// which spells the view type concretely so that a `fn` item coerces without annotations;
    /// prefer it.
    pub const fn new(name: &'static str, f: ProgramFn<E, M, O>) -> Self {
        Program {
            name,
            f,
            donates_device: false,
            donated_inputs: 0,
            packs_trainable: false,
            packed_outputs: false,
            grouped_outputs: false,
            compute: None,
        }
    }

    /// This program with the first `n` leaves of its inputs (the `M` tree, in walk order)
    /// donated to the outputs at the same positions: output `i` (the program returns the new
    /// value of input leaf `i` first, for `i < n`, each of that leaf's type) may reuse input
    /// leaf `i`'s memory, so state carried from run to run (a generator's KV cache) is
    /// updated in place and never exists twice. Part of the program's key.
    pub const fn donating_inputs(mut self, n: usize) -> Self {
        self.donated_inputs = n;
        self
    }

    /// How many leading input leaves are donated ([`donating_inputs`](Program::donating_inputs)).
    pub const fn donated_inputs(&self) -> usize {
        self.donated_inputs
    }

    /// This program with every Device leaf donated to the output at its position: output `i`
    /// (the program must return the new value of Device leaf `i` first, in walk order, each of
    /// its leaf's type) may reuse the memory of Device leaf `i`. For update steps whose state
    /// never needs to exist twice; the inputs passed by value are consumed by the run. It
    /// changes the emitted program, so it is part of the program's key.
    pub const fn donating_device(mut self) -> Self {
        self.donates_device = true;
        self
    }

    /// Whether Device leaves are donated (see [`donating_device`](Program::donating_device)).
    pub const fn donates_device(&self) -> bool {
        self.donates_device
    }

    /// This program as the training handle runs it over packed parameters: its first inputs
    /// are the trainable Device leaves, one per leaf in walk order (each a view of the packed
    /// storage, [`Packing`]), then the packed arrays themselves (one per dtype, unread: they
    /// make PJRT order the run after the update that writes their memory and before one that
    /// reuses it), then the other Device leaves in walk order, then the inputs; the
    /// gradients it returns through [`pack_like_trainable`] are packed, one flat array per
    /// dtype. Part of the program's key.
    ///
    /// A leaf per input, not a slice of one flat input: XLA's CPU compiler copies a fusible
    /// slice into every fusion that reads it, which made the gradient program compile about
    /// 1.5× as long for the same kernels.
    pub(crate) const fn packing_trainable(mut self) -> Self {
        self.packs_trainable = true;
        self
    }

    /// This program's outputs after the first (the loss) are packed like the trainable
    /// leaves (gradients, gradient sums): on a partitioned backend they are sharded as the
    /// packed storage is ([`Partitioning`]); elsewhere it changes nothing.
    pub(crate) const fn packed_outputs(mut self) -> Self {
        self.packed_outputs = true;
        self
    }

    /// This program's outputs are the groups its function declares
    /// ([`crate::shard::declare_groups`]), one each in order: on a partitioned backend output
    /// `k` is sharded as group `k` (a leaf created on the devices, each device its shard).
    pub(crate) const fn grouped_outputs(mut self) -> Self {
        self.grouped_outputs = true;
        self
    }

    /// This program computing in `dtype` (a handle's [`Precision`](crate::train::Precision)):
    /// every floating-point Device leaf, and every floating-point leaf of its `batch` input,
    /// is converted to `dtype` where the program reads it — the leaves themselves, and the
    /// gradients taken with respect to them ([`trainable_leaves`]), keep their own dtype. Part
    /// of the program's key, and named when it moves
    /// ([`MissReason::SettingChanged`](crate::cache::MissReason::SettingChanged)).
    pub(crate) const fn computing_in(mut self, dtype: Option<crate::tree::DType>) -> Self {
        self.compute = dtype;
        self
    }

    /// The dtype the program computes in, when it is not the leaves' own
    /// ([`computing_in`](Program::computing_in)).
    pub(crate) const fn compute(&self) -> Option<crate::tree::DType> {
        self.compute
    }

    /// The flags that shape the emitted program beyond its function: donation and packing
    /// (donated inputs' count follows them in the key when there are any).
    pub(crate) const fn layout_flags(&self) -> u8 {
        (self.donates_device as u8)
            | ((self.packs_trainable as u8) << 1)
            | (((self.donated_inputs > 0) as u8) << 2)
    }

    /// A program from a `fn` written generically over experiments — what library code (a
    /// training handle, a metric) uses to build programs for any experiment that implements
    /// its trait. The `fn` is still a plain `fn` item: nothing enters it but the view and the
    /// inputs.
    ///
    /// ```
    /// use nitro::prelude::*;
    /// use nitro::program::Program;
    ///
    /// /// What a library needs of an experiment: a score over its view.
    /// pub trait Scored: Experiment + 'static {
    ///     fn score(v: &Self::View<'_>, x: &Tensor) -> Tensor;
    /// }
    ///
    /// /// A library program for every `Scored` experiment.
    /// fn doubled<E: Scored>(v: &E::View<'_>, x: &Tensor) -> Tensor {
    ///     E::score(v, x) * 2.0
    /// }
    ///
    /// #[experiment]
    /// pub struct Line { #[device] pub w: Array }
    /// impl Scored for Line {
    ///     fn score(v: &LineView<'_>, x: &Tensor) -> Tensor { *x * v.w }
    /// }
    ///
    /// /// The library names its program for any `E` (build it in generic code, as here: the
    /// /// compiler matches `E::View` with the view type there).
    /// fn doubled_program<E: Scored>() -> Program<E, Tensor> {
    ///     Program::generic("doubled", doubled::<E>)
    /// }
    ///
    /// let p = doubled_program::<Line>();
    /// let traced = p.trace(&Line { w: Array::full(&[2], 3.0f32) }, &Array::zeros(DType::F32, &[2]))?;
    /// assert_eq!(traced.outputs[0].to_string(), "f32[2]");
    /// # Ok::<(), nitro::Error>(())
    /// ```
    pub fn generic(name: &'static str, f: for<'v> fn(&E::View<'v>, &M) -> O) -> Self
    where
        E: 'static,
    {
        Program {
            name,
            f: E::erase_program(f),
            donates_device: false,
            donated_inputs: 0,
            packs_trainable: false,
            packed_outputs: false,
            grouped_outputs: false,
            compute: None,
        }
    }

    /// The program's name.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The program's identity: the experiment type with its generic arguments, and the name
    /// (`my_crate::Digits::grad`).
    pub fn identity(&self) -> String {
        format!("{}::{}", std::any::type_name::<E>(), self.name)
    }

    /// The address of the program's code. Not an identity: one `fn` can have several
    /// addresses in one process (an `#[inline]` fn or a closure instantiated in several
    /// codegen units), so the cache uses it only as a route to a program it already matched
    /// by fingerprint — a new address costs one trace, never a compile.
    pub fn code_address(&self) -> usize {
        E::program_address(self.f)
    }

    /// The arguments of a run, in the traced program's input order: every Device leaf of
    /// `experiment` (by path), then every leaf of `inputs`. Borrowed, never copied.
    pub fn arguments<'a, I: Tree<Mirror<Tensor> = M>>(
        &self,
        experiment: &'a E,
        inputs: &'a I,
    ) -> Vec<&'a Array> {
        let mut args = Vec::new();
        experiment.visit_device(&mut |_, _, node| {
            if let crate::tree::Node::Leaf(a) = node {
                args.push(a);
            }
        });
        inputs.visit(&mut LeafPath::root(""), &mut |_, node| {
            if let crate::tree::Node::Leaf(a) = node {
                args.push(a);
            }
        });
        args
    }

    /// Traces the program on `experiment`'s view and `inputs`' shapes, then emits it.
    ///
    /// Only shapes and dtypes of Device leaves and inputs are read, never their values.
    ///
    /// This is the program as written, for one device and no backend in particular. A backend
    /// may compile a rewrite of it — on XLA's CPU plugin every half-precision dot and
    /// convolution is widened to f32 and its result rounded back — and a mesh or several
    /// replicas change it too: [`trace_for`](Program::trace_for) gives the text and
    /// fingerprint that a backend compiles.
    pub fn trace<I: Tree<Mirror<Tensor> = M>>(&self, experiment: &E, inputs: &I) -> Result<Traced> {
        self.trace_replicated(experiment, inputs, 1)
    }

    /// Traces the program as `backend` compiles it: the StableHLO text the compile cache
    /// compiles (and the persistent store keeps) for that backend, with its rewrites —
    /// half-precision dots and convolutions widened to f32 and rounded back on a CPU plugin
    /// ([`EmitOptions::widen_half_dots`](crate::emit::EmitOptions::widen_half_dots)) —,
    /// replicated over its devices or partitioned over its mesh. Its fingerprint is the one
    /// [`Cache::get`](crate::cache::Cache::get) serves for the same experiment and inputs
    /// ([`Compiled::fingerprint`](crate::cache::Compiled::fingerprint)), and the one `nitro
    /// cache explain` lists.
    ///
    /// ```
    /// use nitro::prelude::*;
    /// use nitro::program::Program;
    ///
    /// #[experiment]
    /// pub struct Half { #[device] pub w: Array }
    ///
    /// fn apply(v: &HalfView<'_>, x: &Tensor) -> Tensor { x.matmul(v.w) }
    /// const APPLY: Program<Half, Tensor> = Half::program("apply", apply);
    ///
    /// let exp = Half { w: Array::zeros(DType::BF16, &[4, 2]) };
    /// let x = Array::zeros(DType::BF16, &[3, 4]);
    /// let backend = nitro::backend::current()?;
    /// let compiled = nitro::cache::Cache::in_memory(4).get(backend, &APPLY, &exp, &x)?;
    /// let traced = APPLY.trace_for(&exp, &x, backend)?;
    /// assert_eq!(traced.fingerprint, compiled.fingerprint);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    pub fn trace_for<I: Tree<Mirror<Tensor> = M>>(
        &self,
        experiment: &E,
        inputs: &I,
        backend: &dyn crate::backend::Backend,
    ) -> Result<Traced> {
        self.trace_on(experiment, inputs, backend)
    }

    /// Like [`trace`](Program::trace), for a program that runs as `replicas` copies at once,
    /// one per device (data parallelism: each replica sees its share of the batch, and
    /// [`Tensor::all_sum`] sums across them). The emitted text declares the replica count, so
    /// the fingerprint differs from the one-device program's.
    pub fn trace_replicated<I: Tree<Mirror<Tensor> = M>>(
        &self,
        experiment: &E,
        inputs: &I,
        replicas: usize,
    ) -> Result<Traced> {
        self.trace_with(experiment, inputs, replicas, None, false)
    }

    /// Traces the program as `backend` runs it: replicated over its replicas, or partitioned
    /// over its mesh ([`Backend::partitioning`](crate::backend::Backend::partitioning)).
    pub(crate) fn trace_on<I: Tree<Mirror<Tensor> = M>>(
        &self,
        experiment: &E,
        inputs: &I,
        backend: &dyn crate::backend::Backend,
    ) -> Result<Traced> {
        self.trace_with(
            experiment,
            inputs,
            backend.replicas(),
            backend.partitioning(),
            backend.identity().platform() == Some("cpu"),
        )
    }

    /// The trace behind [`trace_replicated`](Program::trace_replicated) and
    /// [`trace_on`](Program::trace_on). Partitioned, a program that packs the trainable leaves
    /// takes them one group per leaf, each in its own shape ([`Packing::per_leaf`]), and every
    /// input and output gets the spec its role in the training handle gives it
    /// ([`program_sharding`](Program::program_sharding)).
    fn trace_with<I: Tree<Mirror<Tensor> = M>>(
        &self,
        experiment: &E,
        inputs: &I,
        replicas: usize,
        partitioning: Option<&crate::shard::Partitioning>,
        widen_half_dots: bool,
    ) -> Result<Traced> {
        let mut names = Signature::default();
        let mut device_leaves = 0usize;
        let partitioned = partitioning.is_some();
        let packing = self
            .packs_trainable
            .then(|| Packing::of(experiment, partitioned));
        // Per input, in order: what it holds, for its spec when partitioned.
        let mut roles: Vec<InputRole> = Vec::new();
        // The trainable leaves' paths and types, in walk order (their specs, partitioned).
        let mut trainable_leaves: Vec<(String, LeafType)> = Vec::new();
        let graph = trace::trace_replicated(replicas, || {
            let mut trainable = Vec::new();
            // Packed gradients: the trainable leaves come first, one input each (partitioned,
            // the groups are the leaves themselves).
            let mut first = Vec::new();
            if packing.is_some() {
                experiment.visit_device(&mut |field, path, node| {
                    let is_trainable =
                        field.role == (crate::experiment::Role::Device { trainable: true });
                    if let (true, crate::tree::Node::Leaf(a)) = (is_trainable, node) {
                        trainable_leaves.push((path.as_str().to_owned(), a.leaf_type()));
                        if !partitioned {
                            names.entries.push(SignatureEntry::from_node(path, node));
                            first.push(trace::input(path.as_str(), a.leaf_type()));
                            roles.push(InputRole::Whole);
                        }
                    }
                });
            }
            // Then the packed storage the leaves are views of: unused by the program, passed
            // so that PJRT orders the run as a reader of that memory (partitioned: the leaves).
            for (g, &(dtype, _)) in packing.iter().flat_map(|p| p.groups.iter()).enumerate() {
                // Partitioned, a group is a leaf: named by its path.
                let name = match (partitioned, trainable_leaves.get(g)) {
                    (true, Some((path, _))) => path.clone(),
                    _ => format!("trainable.packed[{g}]"),
                };
                let ty = LeafType {
                    dtype,
                    dims: packing.as_ref().map_or_else(Vec::new, |p| p.group_dims(g)),
                };
                names.entries.push(SignatureEntry {
                    path: name.clone(),
                    kind: crate::tree::EntryKind::Leaf(ty.clone()),
                });
                let t = trace::input(&name, ty);
                roles.push(InputRole::Group(g));
                if partitioned {
                    first.push(t);
                }
            }
            let mut first = first.into_iter();
            // Under a compute dtype the model reads its float leaves converted to it; the
            // gradients are taken with respect to the leaves themselves, in their own dtype.
            let compute = self.compute;
            let computed = |t: Tensor| match compute {
                Some(d) if t.dtype().is_float() && t.dtype() != d => t.convert(d),
                _ => t,
            };
            let view = experiment.view(&mut |field, path, leaf| {
                let is_trainable =
                    field.role == (crate::experiment::Role::Device { trainable: true });
                if is_trainable {
                    if let Some(t) = first.next() {
                        trainable.push(t);
                        return computed(t);
                    }
                }
                names.entries.push(SignatureEntry::from_node(
                    path,
                    crate::tree::Node::Leaf(leaf),
                ));
                device_leaves += 1;
                // The update program's Device leaves are the groups and their slots.
                roles.push(match self.donates_device {
                    true => InputRole::indexed(path.as_str(), &["params[", "state["]),
                    false => InputRole::Whole,
                });
                let t = trace::input(path.as_str(), leaf.leaf_type());
                if is_trainable {
                    trainable.push(t);
                }
                computed(t)
            });
            PACKING.with(|p| *p.borrow_mut() = packing.clone());
            COMPUTE.with(|c| c.set(compute));
            let _trainable = TrainableGuard::set(trainable);
            let traced_inputs = inputs.mirror(&mut LeafPath::root(""), &mut |path, leaf| {
                let name = input_name(path.as_str());
                names.entries.push(SignatureEntry::from_node(
                    &LeafPath::root(name),
                    crate::tree::Node::Leaf(leaf),
                ));
                let per_batch = self.packs_trainable || self.donates_device;
                roles.push(match per_batch {
                    false => InputRole::Whole,
                    true if name.starts_with("batch.") || name == "mask" => InputRole::Rows,
                    true => InputRole::indexed(name, &["sums[", "grads["]),
                });
                let t = trace::input(name, leaf.leaf_type());
                match name.starts_with("batch.") || name == "batch" {
                    true => computed(t),
                    false => t,
                }
            });
            E::call_program(self.f, &view, &traced_inputs).into_tensors()
        });
        // What the update program declared of its groups (taken even when the trace failed,
        // so nothing is left for the next trace to find).
        let declared = crate::shard::take_groups();
        let grouped = partitioning.is_some() && declared.is_some();
        let mut graph = graph?;
        if let Some(partitioning) = partitioning {
            let groups = match declared {
                Some(groups) => {
                    // Each group is a leaf on a mesh: its inputs are named by it too, so that
                    // a check or a miss reason says which leaf (`params[0] (layers[0].w)`).
                    for (input, role) in graph.inputs.iter_mut().zip(&roles) {
                        if let (InputRole::Group(i), false) = (role, groups.is_empty()) {
                            let (path, _) = &groups[i % groups.len()];
                            input.name = format!("{} ({path})", input.name);
                        }
                    }
                    groups.into_iter().map(|(_, spec)| spec).collect::<Vec<_>>()
                }
                None => trainable_leaves
                    .iter()
                    .map(|(path, ty)| partitioning.leaf_spec(path, ty))
                    .collect::<Result<_>>()?,
            };
            graph.sharding = Some(self.program_sharding(partitioning, &graph, &roles, &groups)?);
        }
        let options = crate::emit::EmitOptions {
            donate: if self.donates_device {
                (0..device_leaves).map(|i| (i, i)).collect()
            } else {
                (0..self.donated_inputs)
                    .map(|i| (device_leaves + i, i))
                    .collect()
            },
            sharding: graph.sharding.clone(),
            // Axes named by position: a mesh renamed with the same partitioning is the same
            // program (the names stay in the graph's sharding, for messages and reasons).
            canonical_axes: true,
            widen_half_dots,
        };
        let text = crate::emit::emit_with(&graph, &options);
        let fingerprint = crate::emit::fingerprint(&text);
        let mut structure = experiment.device_signature();
        inputs.visit(&mut LeafPath::root(""), &mut |path, node| {
            structure.entries.push(SignatureEntry::from_node(
                &LeafPath::root(input_name(path.as_str())),
                node,
            ));
        });
        Ok(Traced {
            outputs: graph.output_types(),
            inputs: names,
            structure,
            graph,
            text,
            fingerprint,
            compute: self.compute,
            grouped,
        })
    }

    /// The specs of a partitioned program's inputs (by their `roles`, in order) and outputs,
    /// `groups` being the specs of the trainable leaves' groups: a group, its optimizer slots,
    /// its gradient and its sum as the group; batch arrays split by rows; the loss and every
    /// scalar whole; an update's outputs as the inputs they replace; a gradient program's
    /// outputs after the loss as their groups; other per-batch outputs (predictions) by rows.
    /// Every spec is checked against its array's type.
    fn program_sharding(
        &self,
        partitioning: &crate::shard::Partitioning,
        graph: &Graph,
        roles: &[InputRole],
        groups: &[crate::shard::PartitionSpec],
    ) -> Result<crate::shard::ProgramSharding> {
        use crate::shard::PartitionSpec;
        let group = |i: usize| crate::shard::group_spec(groups, i).clone();
        let inputs: Vec<PartitionSpec> = roles
            .iter()
            .map(|role| match role {
                InputRole::Whole => PartitionSpec::replicated(),
                InputRole::Rows => partitioning.rows(),
                InputRole::Group(i) => group(*i),
            })
            .collect();
        let outputs: Vec<PartitionSpec> = graph
            .output_types()
            .iter()
            .enumerate()
            .map(|(k, ty)| {
                if ty.dims.is_empty() {
                    PartitionSpec::replicated()
                } else if self.donates_device {
                    inputs.get(k).cloned().unwrap_or_default()
                } else if self.grouped_outputs {
                    group(k)
                } else if self.packed_outputs && k > 0 {
                    group(k - 1)
                } else if self.packs_trainable {
                    partitioning.rows()
                } else {
                    PartitionSpec::replicated()
                }
            })
            .collect();
        let mesh = partitioning.mesh();
        for (spec, input) in inputs.iter().zip(&graph.inputs) {
            spec.check(
                mesh,
                &input.ty,
                &format!("input `{}` of {}", input.name, self.name),
            )?;
        }
        for (k, (spec, ty)) in outputs.iter().zip(graph.output_types()).enumerate() {
            spec.check(mesh, &ty, &format!("output {k} of {}", self.name))?;
        }
        check_constraints(graph, mesh, self.name)?;
        Ok(crate::shard::ProgramSharding {
            mesh: mesh.clone(),
            inputs,
            outputs,
        })
    }
}

/// Checks every [`Tensor::shard`] constraint of `graph` (and of its loops' bodies) against
/// `mesh`: an axis it lacks or a dim that does not divide is an error naming the program.
fn check_constraints(graph: &Graph, mesh: &crate::shard::Mesh, program: &str) -> Result<()> {
    use crate::trace::ir::Op;
    for node in &graph.nodes {
        match &node.op {
            Op::Shard(spec) => spec.check(
                mesh,
                &node.ty,
                &format!("a `Tensor::shard` constraint in {program}, on"),
            )?,
            Op::Scan(op) => check_constraints(&op.body, mesh, program)?,
            Op::While(op) => check_constraints(&op.body, mesh, program)?,
            _ => {}
        }
    }
    Ok(())
}

/// What an input of a program the training handle runs holds, for its spec on a mesh.
#[derive(Clone, Copy, Debug)]
enum InputRole {
    /// Whole on every device.
    Whole,
    /// Batch rows, split along the batch axis.
    Rows,
    /// The trainable leaves' group `i` (or, past the groups' count, an optimizer slot of group
    /// `i mod count`): split as that group is.
    Group(usize),
}

impl InputRole {
    /// `Group(i)` for a name `<prefix>i]` with one of `prefixes`, else `Whole`.
    fn indexed(name: &str, prefixes: &[&str]) -> InputRole {
        prefixes
            .iter()
            .find_map(|p| name.strip_prefix(p)?.strip_suffix(']')?.parse().ok())
            .map_or(InputRole::Whole, InputRole::Group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::DType;

    #[test]
    fn leaves_start_on_64_byte_boundaries_and_round_trip() {
        let types = [
            LeafType::new(DType::F32, &[3]),
            LeafType::new(DType::BF16, &[7]),
            LeafType::new(DType::F32, &[2, 5]),
            LeafType::new(DType::F32, &[16]),
            LeafType::new(DType::BF16, &[]),
            LeafType::new(DType::U8, &[65]),
        ];
        let p = Packing::of_types(&types);
        // f32: 3 elements at 0, 10 at 16 (64 bytes), 16 at 32; bf16: 7 at 0, 1 at 32; u8: 65
        // at 0.
        let offsets: Vec<(usize, usize)> = p.leaves.iter().map(|(g, o, _)| (*g, *o)).collect();
        assert_eq!(offsets, [(0, 0), (1, 0), (0, 16), (0, 32), (1, 32), (2, 0)]);
        assert_eq!(
            p.groups,
            [(DType::F32, 48), (DType::BF16, 33), (DType::U8, 65)]
        );
        for (g, offset, _) in &p.leaves {
            assert_eq!(offset * p.groups[*g].0.size_bytes() % LEAF_ALIGN, 0);
        }
        assert_eq!(p.leaf_types(), types);
        let leaves: Vec<Array> = types
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let n: usize = t.dims.iter().product();
                let v = (0..n).map(|k| ((i * 7 + k) % 200 + 1) as f32);
                match t.dtype {
                    DType::F32 => Array::from_vec(&t.dims, v.collect()),
                    DType::BF16 => Array::from_vec(&t.dims, v.map(half::bf16::from_f32).collect()),
                    _ => Array::from_vec(&t.dims, v.map(|x| x as u8).collect()),
                }
                .unwrap()
            })
            .collect();
        let flat = p.pack(&leaves).unwrap();
        assert_eq!(p.unpack(&flat).unwrap(), leaves);
        // The gaps hold zeros.
        let f32s = flat[0].as_slice::<f32>().unwrap();
        assert!(f32s[3..16].iter().chain(&f32s[26..32]).all(|&x| x == 0.0));
        // A leaf of the wrong type is refused, naming its position.
        let mut wrong = leaves.clone();
        wrong[2] = Array::zeros(DType::F32, &[10]);
        let err = p.pack(&wrong).unwrap_err();
        assert!(
            matches!(err, crate::Error::InputType { index: 2, .. }),
            "{err}"
        );
    }
}
