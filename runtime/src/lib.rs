//! Cache-aware training experiments on XLA: declare what shapes the graph, and never recompile
//! after step 1.
//!
//! ```
//! use nitro::prelude::*;
//!
//! /// How the classifier is built: shapes the graph, so its contents are in the compile key.
//! #[derive(ContentHash, Clone, Debug)]
//! pub struct Arch { pub hidden: usize }
//!
//! #[derive(Tree)]
//! pub struct Dense { pub w: Array, pub b: Array }
//!
//! /// Handwritten digits, 64 → hidden → 10.
//! #[experiment]
//! pub struct Digits {
//!     #[graph_const] pub arch: Arch,
//!     #[device(trainable)] pub layers: Vec<Dense>,
//!     pub notes: String, // Host: never traced, never in the key
//! }
//!
//! let exp = Digits {
//!     arch: Arch { hidden: 128 },
//!     layers: vec![Dense { w: Array::zeros(DType::F32, &[64, 128]), b: Array::zeros(DType::F32, &[128]) }],
//!     notes: "first try".into(),
//! };
//! let mut other = Digits { notes: "second try".into(), ..exp };
//! let key = other.graph_const_digest();
//! other.notes.push('!'); // Host: the key does not move
//! assert_eq!(other.graph_const_digest(), key);
//! assert_eq!(other.device_signature().to_string(), "layers[0].w: f32[64,128], layers[0].b: f32[128]");
//! ```
//!
//! Each field of an [`experiment`](macro@experiment) has one role:
//!
//! | role | marker | in the compile key as | in traced code |
//! | --- | --- | --- | --- |
//! | GraphConst | `#[graph_const]` | its content hash ([`ContentHash`]) | a `&` reference |
//! | Device | `#[device]`, `#[device(trainable)]` | its [`Signature`]: structure, dtypes, dims | a tree of [`Tensor`]s |
//! | Host | `#[host]` or none | nothing | absent |
//!
//! The crate's modules follow the pipeline: [`hash`] → [`tree`] → [`trace`] → [`experiment`](mod@experiment).
#![deny(rustdoc::broken_intra_doc_links)]
#![deny(unsafe_code)]

// Lets derived code inside this crate (tests, docs) name `::nitro`.
#[allow(unused_extern_crates)]
extern crate self as nitro;

pub mod backend;
pub mod cache;
pub mod checkpoint;
pub mod data;
pub mod emit;
pub mod error;
pub mod experiment;
mod files;
pub mod generate;
pub mod hash;
pub mod init;
pub mod nn;
pub mod npy;
pub mod ops;
pub mod optim;
pub mod pattern;
pub mod program;
pub mod settings;
pub mod shard;
pub mod stage;
pub mod trace;
pub mod train;
pub mod tree;
pub mod weights;

pub use error::{Error, Result};
pub use experiment::{
    assert_graphconst_hashable, Experiment, FieldInfo, HostField, KeyManifest, ManifestField, Role,
};
/// The half-precision element types of [`DType::BF16`] and [`DType::F16`] arrays.
pub use half::{bf16, f16};
pub use hash::{ContentHash, ContentHasher, Digest, ShortDigest};
pub use trace::{Operand, Tensor};
pub use tree::{
    Array, ArrayData, DType, Element, LeafPath, LeafType, Node, Signature, SignatureChange, Tree,
    MAX_TENSOR_BYTES,
};

/// Derives [`ContentHash`](trait@ContentHash) for a struct or enum whose fields are all
/// `ContentHash`.
///
/// Structs hash each field in declaration order; enums hash the variant's index (`u32`), then its
/// fields. For a generic type, each field type that mentions a type parameter gets a
/// `FieldType: ContentHash` bound, so `Wrapper<T>` is `ContentHash` exactly when its fields are.
///
/// ```
/// use nitro::{ContentHash, Digest};
///
/// #[derive(ContentHash)]
/// struct Schedule<T> { warmup: u32, values: Vec<T> }
///
/// #[derive(ContentHash)]
/// enum Norm { None, Layer { eps: f32 }, Rms(f32) }
///
/// assert_ne!(Digest::of(&Norm::Layer { eps: 1e-5 }), Digest::of(&Norm::Rms(1e-5)));
/// assert_eq!(Digest::of(&Schedule { warmup: 1, values: vec![0.5f64] }),
///            Digest::of(&Schedule { warmup: 1, values: vec![0.5f64] }));
/// ```
///
/// A field whose value is not determined by its contents is a compile error at that field:
///
/// ```compile_fail
/// #[derive(nitro::ContentHash)]
/// struct Config { counter: std::sync::atomic::AtomicUsize }
/// ```
pub use nitro_macros::ContentHash;

/// Derives [`Tree`](trait@Tree) for a struct whose fields are all trees of [`Array`]s, and
/// generates its mirror type `<Name>Mirror<L>` (the same fields, each leaf an `L`).
///
/// Named fields extend leaf paths with `.name`, tuple fields with `.0`, `.1`, …
///
/// ```
/// use nitro::{Array, DType, Tree};
///
/// #[derive(Tree)]
/// pub struct Dense { pub w: Array, pub b: Array }
///
/// let d = Dense { w: Array::zeros(DType::F32, &[3, 2]), b: Array::zeros(DType::F32, &[2]) };
/// // The mirror keeps the structure; here each leaf becomes its element count.
/// let m: DenseMirror<usize> = d.mirror(&mut nitro::LeafPath::root("d"), &mut |_, a| a.len());
/// assert_eq!((m.w, m.b), (6, 2));
/// ```
///
/// A field that is not a tree is rejected while compiling:
///
/// ```compile_fail
/// #[derive(nitro::Tree)]
/// struct Layer { w: nitro::Array, width: usize }
/// ```
pub use nitro_macros::Tree;

/// Declares an experiment: a struct whose every field has a role in compilation.
///
/// ```
/// use nitro::prelude::*;
///
/// #[derive(Tree)]
/// pub struct Dense { pub w: Array, pub b: Array }
///
/// #[experiment]
/// pub struct Probe {
///     /// Hidden width: shapes the graph.
///     #[graph_const] pub hidden: usize,
///     /// Parameters: traced, gradients flow here.
///     #[device(trainable)] pub layers: Vec<Dense>,
///     /// Learning rate: a traced scalar, so a schedule never recompiles.
///     #[device] pub lr: Array,
///     /// Host (the default): invisible to traced code.
///     pub log: Vec<String>,
/// }
///
/// // The compile view has GraphConst fields by reference, Device fields as tensors, and no `log`.
/// fn forward(v: &ProbeView<'_>, x: Tensor) -> Tensor {
///     let _width: &usize = v.hidden;
///     let _w: Tensor = v.layers[0].w;
///     x
/// }
/// ```
///
/// # Roles
///
/// - `#[graph_const]` — a value that shapes the emitted graph. Its type must be
///   [`ContentHash`](trait@ContentHash); its content digest is in the compile key, so changing it
///   compiles a new program. Traced code reads it as `&T`.
/// - `#[device]` / `#[device(trainable)]` — a traced input. Its type must be a
///   [`Tree`](trait@Tree) of arrays; only its signature (structure, dtypes, dims) is in the key,
///   so new values never recompile. Traced code sees `<T as Tree>::Mirror<Tensor>`.
///   `trainable` marks what gradients flow to.
/// - `#[host]`, or no marker — everything else (datasets, loggers). Not in the key, and not in
///   the compile view, so traced code cannot read it by mistake:
///
/// ```compile_fail
/// use nitro::prelude::*;
///
/// #[experiment]
/// pub struct Probe { #[graph_const] hidden: usize, data: Vec<f32> }
///
/// // `data` is a Host field of `Probe` …: traced code cannot read it (and `HostField` has no `len`)
/// fn forward(v: &ProbeView<'_>) -> usize { v.data.len() }
/// ```
///
/// # What it generates
///
/// - The struct, with the markers removed and a **Compile key** table appended to its docs.
/// - `impl` [`Experiment`]: `FIELDS`, `SCHEMA_DIGEST`, GraphConst digests, the Device signature,
///   leaf walks and the view builder.
/// - `<Name>View<'a>`: the compile view, with the struct's visibility and each field's own.
///
/// # Rejected while compiling
///
/// A GraphConst that is not `ContentHash`, a Device field that is not a `Tree`, two role markers
/// on one field, an unknown marker option or a repeated one, and anything but a struct with
/// named fields. All errors of one struct are reported together.
///
/// ```compile_fail
/// #[nitro::experiment]
/// struct Bad { #[graph_const] #[device] w: nitro::Array }
/// ```
///
/// # Generics
///
/// Generic experiments are supported. The view carries every type parameter (through a hidden
/// marker field), so a parameter used only by Host fields is allowed; the program identity
/// includes the generic arguments, while the GraphConst digest is seeded with the path alone.
pub use nitro_macros::experiment;

/// The names almost every nitro user needs.
pub mod prelude {
    pub use crate::{
        experiment, Array, ContentHash, DType, Digest, Experiment, Signature, Tensor, Tree,
    };
}

/// Items used by generated code; not part of the public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::experiment::{Experiment, FieldInfo, HostField, Role};
    pub use crate::hash::{ContentHash, ContentHasher, Digest, Part};
    pub use crate::trace::Tensor;
    pub use crate::tree::{Array, LeafPath, Node, Tree};
    pub use core::clone::Clone;
    pub use core::fmt;
    pub use core::marker::PhantomData;
    pub use core::option::Option;
    pub use std::vec::Vec;

    /// Names the `ContentHash` requirement of a GraphConst field at the field's span.
    pub const fn require_content_hash<T: ?Sized + ContentHash>() {}

    /// Names the `Tree` requirement of a Device field at the field's span.
    pub const fn require_tree<T: ?Sized + Tree>() {}

    /// A GraphConst field's value, printed where its type is `Debug` and `None` elsewhere
    /// (method resolution picks [`Printable`] for `&DebugProbe<T: Debug>`, and falls back to
    /// [`Unprintable`] through one more reference otherwise — without requiring `Debug`).
    pub struct DebugProbe<'a, T: ?Sized>(pub &'a T);

    /// The `Debug` side of [`DebugProbe`].
    pub trait Printable {
        /// The value, `{:#?}`.
        fn nitro_print(&self) -> Option<String>;
    }

    impl<T: ?Sized + fmt::Debug> Printable for DebugProbe<'_, T> {
        fn nitro_print(&self) -> Option<String> {
            Some(format!("{:#?}", self.0))
        }
    }

    /// The fallback side of [`DebugProbe`].
    pub trait Unprintable {
        /// Nothing: the type is not `Debug`.
        fn nitro_print(&self) -> Option<String>;
    }

    impl<T: ?Sized> Unprintable for &DebugProbe<'_, T> {
        fn nitro_print(&self) -> Option<String> {
            None
        }
    }

    /// A GraphConst field's parts ([`ContentHasher::parts_of`]) where its type is
    /// `ContentHash`, and none elsewhere — the same fallback as [`DebugProbe`], so a field
    /// without a content hash is reported once (by its digest), not once per use.
    pub struct PartsProbe<'a, T: ?Sized>(pub &'a T);

    /// The `ContentHash` side of [`PartsProbe`].
    pub trait HasParts {
        /// The parts, rooted at `root`.
        fn nitro_parts(&self, root: &str) -> Vec<Part>;
    }

    impl<T: ?Sized + ContentHash> HasParts for PartsProbe<'_, T> {
        fn nitro_parts(&self, root: &str) -> Vec<Part> {
            ContentHasher::parts_of(root, self.0)
        }
    }

    /// The fallback side of [`PartsProbe`].
    pub trait NoParts {
        /// None: the type has no content hash (an error reported elsewhere).
        fn nitro_parts(&self, root: &str) -> Vec<Part>;
    }

    impl<T: ?Sized> NoParts for &PartsProbe<'_, T> {
        fn nitro_parts(&self, _: &str) -> Vec<Part> {
            Vec::new()
        }
    }
}

/// The README's example, compiled as a doctest so it stays true.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

mod guide;
