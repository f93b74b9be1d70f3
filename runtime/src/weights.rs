//! Pretrained weights: a plain `safetensors` file — written by PyTorch, JAX or the Hugging Face
//! tools — loaded into an experiment's Device leaves by tensor name, and the trained parameters
//! exported as one that `safetensors.numpy.load_file` (or `torch`) reads.
//!
//! A leaf's name is its path (`conv1.w`, `layers[0].b`). Names that differ are mapped with
//! [`Import::rename`] (one name) or [`Import::rename_with`] (a function, applied to the file's
//! names), and a layout that differs with [`Import::permute`] (PyTorch's `Linear` weight is
//! `[out, in]`: `permute("fc.w", &[1, 0])`; a PyTorch conv kernel OIHW becomes HWIO with
//! `[2, 3, 1, 0]`). Loading checks everything before it changes anything, and refuses — naming
//! each tensor, with both shapes and dtypes — a leaf the file lacks, a file tensor no leaf
//! takes (unless [`Import::allow_extra`]), a shape or dtype that does not match, and every
//! instruction that names nothing: a `rename` whose tensor is not in the file or whose leaf is
//! not in the experiment, a `permute` whose leaf is not in the experiment (a permute written
//! with the file's name instead of the leaf's) or that no tensor maps to.
//!
//! ```no_run
//! use nitro::weights::{self, Import};
//! # use nitro::prelude::*;
//! # #[derive(Tree)] pub struct Dense { pub w: Array, pub b: Array }
//! # #[experiment] pub struct Net { #[device(trainable)] pub fc: Dense }
//! # let mut net = Net { fc: Dense { w: Array::zeros(DType::F32, &[4, 3]), b: Array::zeros(DType::F32, &[3]) } };
//! let import = Import::new()
//!     .rename("fc.weight", "fc.w")
//!     .rename("fc.bias", "fc.b")
//!     .permute("fc.w", &[1, 0]); // torch's [out, in] is our [in, out]
//! weights::load_into(&mut net, "model.safetensors", &import)?;
//! weights::export(&net, "trained.safetensors")?;
//! # Ok::<(), nitro::Error>(())
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use crate::checkpoint::{to_array, Raw};

mod ranges;

use crate::error::{Error, Result};
use crate::experiment::Experiment;
use crate::tree::{Array, ArrayData, DType, LeafType, Node};
pub(crate) use ranges::{plan as plan_ranges, Header};

type Renamer = Box<dyn Fn(&str) -> String>;
type Mapper = Box<dyn Fn(Array) -> std::result::Result<Array, String>>;

/// How a file's tensors map onto an experiment's leaves, and how their values are converted on
/// the way: names ([`rename`](Import::rename), [`rename_with`](Import::rename_with)), fused
/// tensors ([`split`](Import::split)), layouts ([`permute`](Import::permute),
/// [`flatten_order`](Import::flatten_order)), dtypes ([`cast`](Import::cast)) and anything else
/// ([`map`](Import::map)) — or a framework's conventions at once ([`Import::pytorch`],
/// [`Import::gpt2`]).
///
/// A file tensor goes through, in order: its name ([`split`](Import::split), then
/// [`rename`](Import::rename), then [`rename_with`](Import::rename_with), then the preset),
/// then per leaf [`permute`](Import::permute) (or the preset's layout),
/// [`flatten_order`](Import::flatten_order), [`cast`](Import::cast) and
/// [`map`](Import::map); what comes out must have the leaf's shape and dtype.
#[derive(Default)]
pub struct Import {
    renames: HashMap<String, String>,
    rename_with: Option<Renamer>,
    permutes: HashMap<String, Vec<usize>>,
    flatten_orders: HashMap<String, [usize; 3]>,
    maps: HashMap<String, Mapper>,
    splits: HashMap<String, (usize, Vec<String>)>,
    cast: bool,
    saturate: bool,
    allow_extra: bool,
    preset: Option<Preset>,
}

/// A framework's naming and layout conventions.
#[derive(Clone, Debug)]
enum Preset {
    /// PyTorch's `weight`/`bias`, `layers.0` indices, `[out, in]` and OIHW layouts.
    PyTorch,
    /// Hugging Face GPT-2 onto a [`crate::nn::Gpt2Params`] at this leaf path.
    Gpt2(String),
}

/// Where a file tensor goes.
enum Route {
    /// To one leaf; `torch` when PyTorch's layout conventions apply to it.
    Leaf { leaf: String, torch: bool },
    /// Split evenly along `axis` into these leaves.
    Split(usize, Vec<String>),
    /// Nowhere, for this reason (a buffer, a tied head).
    Skip(&'static str),
}

impl Import {
    /// Names as they are, no permutes, extra tensors refused.
    pub fn new() -> Import {
        Import::default()
    }

    /// PyTorch's conventions, resolved against the experiment's leaves: `a.0.weight` is
    /// `a[0].w` (a `Linear`/`Conv2d` kernel), `a[0].gain` (a norm) or `a[0].table` (an
    /// embedding), whichever the experiment has; `a.0.bias` is `a[0].b` or `a[0].bias`. A
    /// `Linear` weight `[out, in]` is transposed to nitro's `[in, out]`; a conv weight (OIHW)
    /// is permuted to HWIO for a channels-last [`Conv2d`](crate::nn::Conv2d) and kept for a
    /// [`channels_first`](crate::nn::Conv2d::channels_first) one (a kernel whose shape fits
    /// both is refused until a [`permute`](Import::permute) says which). Names are mapped by
    /// [`rename_with`](Import::rename_with) first, if given (to add a prefix, say); an explicit
    /// `rename` wins over the preset's name (a renamed `…weight` keeps PyTorch's layout) and an
    /// explicit `permute` over its layout.
    ///
    /// ```
    /// use nitro::nn::{Conv2d, Layer, Linear};
    /// use nitro::prelude::*;
    /// use nitro::weights::{self, Import};
    ///
    /// #[experiment]
    /// pub struct Net {
    ///     #[device(trainable)] pub conv1: nitro::nn::Conv2dParams,
    ///     #[device(trainable)] pub fc: nitro::nn::LinearParams,
    /// }
    /// let mut net = Net {
    ///     conv1: Conv2d::new(1, 4, (3, 3)).init(nitro::init::Seed(0)),
    ///     fc: Linear::new(16, 2).init(nitro::init::Seed(1)),
    /// };
    /// # let dir = std::env::temp_dir().join(format!("nitro-doc-pytorch-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir)?;
    /// # let file = dir.join("torch.safetensors");
    /// # #[derive(Tree)] pub struct T { pub weight: Array, pub bias: Array }
    /// # #[experiment] pub struct Torch { #[device] pub conv1: T, #[device] pub fc: T }
    /// # let z = |d: &[usize]| Array::zeros(DType::F32, d);
    /// # let torch = Torch { conv1: T { weight: z(&[4, 1, 3, 3]), bias: z(&[4]) },
    /// #     fc: T { weight: z(&[2, 16]), bias: z(&[2]) } };
    /// # weights::export(&torch, &file)?;
    /// // conv1.weight [4, 1, 3, 3], conv1.bias [4], fc.weight [2, 16], fc.bias [2]
    /// let loaded = weights::load_into(&mut net, &file, &Import::pytorch())?;
    /// assert_eq!(loaded.leaves, ["conv1.w", "conv1.b", "fc.w", "fc.b"]);
    /// # let _ = std::fs::remove_dir_all(&dir);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn pytorch() -> Import {
        Import {
            preset: Some(Preset::PyTorch),
            ..Import::default()
        }
    }

    /// A Hugging Face GPT-2 file (`GPT2Model` or `GPT2LMHeadModel`, with or without the
    /// `transformer.` prefix) onto the [`Gpt2Params`](crate::nn::Gpt2Params) at leaf path
    /// `at` (the experiment's field holding them): `wte`/`wpe` to the embeddings, `h.N.ln_1`
    /// to `blocks[N].ln1`, the fused `attn.c_attn` `[d, 3d]` split into the attention's `q`,
    /// `k` and `v`, `attn.c_proj` to `o`, `mlp.c_fc`/`mlp.c_proj` to `fc1`/`fc2` — Conv1D
    /// weights are `[in, out]` already, so nothing is transposed. `lm_head.weight` (the head,
    /// tied to `wte`) and the causal-mask buffers `attn.bias`/`attn.masked_bias` are skipped
    /// and listed in [`Loaded::ignored`]. Half-precision checkpoints need [`Import::cast`].
    pub fn gpt2(at: &str) -> Import {
        Import {
            preset: Some(Preset::Gpt2(at.to_owned())),
            ..Import::default()
        }
    }

    /// The file's tensor `from` is the leaf `to`.
    pub fn rename(mut self, from: &str, to: &str) -> Import {
        self.renames.insert(from.to_owned(), to.to_owned());
        self
    }

    /// The leaf a file tensor is, for the names [`Import::rename`] does not list (with a
    /// preset: the name the preset then maps).
    pub fn rename_with(mut self, f: impl Fn(&str) -> String + 'static) -> Import {
        self.rename_with = Some(Box::new(f));
        self
    }

    /// The tensor for `leaf` is stored with its dims permuted: leaf dim `i` is file dim
    /// `perm[i]` (`[1, 0]` transposes a matrix).
    pub fn permute(mut self, leaf: &str, perm: &[usize]) -> Import {
        self.permutes.insert(leaf.to_owned(), perm.to_vec());
        self
    }

    /// The dense weight `leaf` (`[features, out]`, after any permute) follows a conv stack
    /// whose output `[channels, height, width]` was flattened channels first — PyTorch's
    /// `x.flatten(1)` over NCHW — and is reordered for channels-last features `(height, width,
    /// channels)`, as [`Flatten`](crate::nn::Flatten) gives over NHWC. Without it the shapes
    /// match and the values are scrambled.
    pub fn flatten_order(mut self, leaf: &str, chw: [usize; 3]) -> Import {
        self.flatten_orders.insert(leaf.to_owned(), chw);
        self
    }

    /// Applies `f` to the value for `leaf`, last (after permutes, reordering and casts): any
    /// conversion the others do not cover. Its error is reported with the rest.
    pub fn map(
        mut self,
        leaf: &str,
        f: impl Fn(Array) -> std::result::Result<Array, String> + 'static,
    ) -> Import {
        self.maps.insert(leaf.to_owned(), Box::new(f));
        self
    }

    /// The file's tensor `name` is several leaves fused along `axis`: it is split into
    /// `leaves.len()` equal parts, in order (GPT-2's `c_attn` `[d, 3d]` is `q`, `k` and `v`
    /// along axis 1).
    pub fn split(mut self, name: &str, axis: usize, leaves: &[&str]) -> Import {
        let leaves = leaves.iter().map(|l| (*l).to_owned()).collect();
        self.splits.insert(name.to_owned(), (axis, leaves));
        self
    }

    /// Converts floating-point tensors whose dtype differs from their leaf's (`f16`, `bf16`,
    /// `f64` files into `f32` leaves, say) instead of refusing them; each conversion is listed
    /// in [`Loaded::cast`]. Integer tensors are never converted.
    ///
    /// A finite value the leaf's dtype cannot hold (`70000.0` or `1e300` into an `f16` leaf) is
    /// refused, naming the tensor, the value and its index: converting it would give ±inf, and
    /// the first loss would be NaN far from here. [`cast_saturating`](Import::cast_saturating)
    /// clamps such values instead.
    pub fn cast(mut self) -> Import {
        self.cast = true;
        self
    }

    /// [`cast`](Import::cast), clamping finite values the leaf's dtype cannot hold to its
    /// largest finite value (with their sign) instead of refusing them; each leaf so clamped is
    /// listed, with how many values, in [`Loaded::saturated`].
    pub fn cast_saturating(mut self) -> Import {
        self.cast = true;
        self.saturate = true;
        self
    }

    /// Ignore file tensors that no leaf takes (an optimizer's state, a head not used).
    pub fn allow_extra(mut self) -> Import {
        self.allow_extra = true;
        self
    }

    /// Where the file's tensor `name` goes, given the experiment's leaves.
    fn route(&self, name: &str, leaves: &HashSet<&str>) -> Route {
        if let Some((axis, parts)) = self.splits.get(name) {
            return Route::Split(*axis, parts.clone());
        }
        if let Some(to) = self.renames.get(name) {
            // Under the PyTorch preset a renamed `weight` keeps PyTorch's layout.
            let torch = matches!(self.preset, Some(Preset::PyTorch)) && name.ends_with("weight");
            return Route::Leaf {
                leaf: to.clone(),
                torch,
            };
        }
        let renamed = self.rename_with.as_ref().map(|f| f(name));
        let name = renamed.as_deref().unwrap_or(name);
        match &self.preset {
            None => Route::Leaf {
                leaf: name.to_owned(),
                torch: false,
            },
            Some(Preset::PyTorch) => torch_route(name, leaves),
            Some(Preset::Gpt2(at)) => gpt2_route(name, at),
        }
    }
}

/// `a.0.b` as a leaf path: `a[0].b`.
fn torch_path(dotted: &str) -> String {
    let mut out = String::new();
    for seg in dotted.split('.').filter(|s| !s.is_empty()) {
        if !out.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) {
            out.push('[');
            out.push_str(seg);
            out.push(']');
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(seg);
        }
    }
    out
}

fn torch_route(name: &str, leaves: &HashSet<&str>) -> Route {
    let (parent, last) = name.rsplit_once('.').unwrap_or(("", name));
    let candidates: &[&str] = match last {
        "weight" => &["w", "gain", "table"],
        "bias" => &["b", "bias"],
        _ => &[],
    };
    let parent = torch_path(parent);
    let join = |field: &str| {
        if parent.is_empty() {
            field.to_owned()
        } else {
            format!("{parent}.{field}")
        }
    };
    match candidates
        .iter()
        .map(|c| join(c))
        .find(|l| leaves.contains(l.as_str()))
        .or_else(|| candidates.first().map(|c| join(c)))
    {
        Some(leaf) => Route::Leaf { leaf, torch: true },
        None => Route::Leaf {
            leaf: torch_path(name),
            torch: false,
        },
    }
}

fn gpt2_route(name: &str, at: &str) -> Route {
    let name = name.strip_prefix("transformer.").unwrap_or(name);
    let leaf = |path: &str| Route::Leaf {
        leaf: format!("{at}.{path}"),
        torch: false,
    };
    match name {
        "wte.weight" => return leaf("wte.table"),
        "wpe.weight" => return leaf("wpe.table"),
        "ln_f.weight" => return leaf("ln_f.gain"),
        "ln_f.bias" => return leaf("ln_f.bias"),
        "lm_head.weight" => return Route::Skip("the head is tied to `wte`"),
        _ => {}
    }
    let Some((index, rest)) = name
        .strip_prefix("h.")
        .and_then(|r| r.split_once('.'))
        .filter(|(i, _)| i.parse::<usize>().is_ok())
    else {
        return Route::Leaf {
            leaf: name.to_owned(),
            torch: false,
        };
    };
    let block = format!("{at}.blocks[{index}]");
    let path = match rest {
        "ln_1.weight" => "ln1.gain",
        "ln_1.bias" => "ln1.bias",
        "ln_2.weight" => "ln2.gain",
        "ln_2.bias" => "ln2.bias",
        "attn.c_proj.weight" => "attention.o.w",
        "attn.c_proj.bias" => "attention.o.b",
        "mlp.c_fc.weight" => "fc1.w",
        "mlp.c_fc.bias" => "fc1.b",
        "mlp.c_proj.weight" => "fc2.w",
        "mlp.c_proj.bias" => "fc2.b",
        "attn.c_attn.weight" | "attn.c_attn.bias" => {
            let (axis, field) = if rest.ends_with("weight") {
                (1, "w")
            } else {
                (0, "b")
            };
            let parts = ["q", "k", "v"]
                .iter()
                .map(|p| format!("{block}.attention.{p}.{field}"))
                .collect();
            return Route::Split(axis, parts);
        }
        "attn.bias" | "attn.masked_bias" => return Route::Skip("a causal-mask buffer"),
        _ => {
            return Route::Leaf {
                leaf: name.to_owned(),
                torch: false,
            }
        }
    };
    Route::Leaf {
        leaf: format!("{block}.{path}"),
        torch: false,
    }
}

/// What [`load_into`] loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    /// The leaves filled, by path.
    pub leaves: Vec<String>,
    /// File tensors no leaf took (with [`Import::allow_extra`]), and those a preset skips
    /// (with why).
    pub ignored: Vec<String>,
    /// The conversions [`Import::cast`] made: `` `leaf` f16 → f32 ``.
    pub cast: Vec<String>,
    /// The leaves whose finite values [`Import::cast_saturating`] clamped to their dtype's
    /// range, with how many: `` `leaf` 3 value(s) clamped to ±65504 (f16) ``.
    pub saturated: Vec<String>,
    /// The bytes of tensor data read from the file: all of them for [`load_into`]; for a
    /// handle on a mesh ([`crate::train::Nitro::load_weights`]) each device's ranges, once
    /// for each distinct window.
    pub read_bytes: u64,
}

/// One file tensor's value on its way to a leaf.
struct Candidate {
    /// The file's name for it.
    name: String,
    value: Array,
    /// Whether PyTorch's layout conventions apply.
    torch: bool,
}

/// Loads the `safetensors` file at `path` into `experiment`'s Device leaves (see the
/// [module docs](self) and [`Import`]). Nothing changes unless every leaf is found and fits.
pub fn load_into<E: Experiment + ?Sized>(
    experiment: &mut E,
    path: impl AsRef<Path>,
    import: &Import,
) -> Result<Loaded> {
    let path = path.as_ref();
    let bytes = Error::read_data_file(path)?;
    let file = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::data_file(path, format!("not a safetensors file: {e}")))?;
    let mut wanted: Vec<(String, LeafType)> = Vec::new();
    experiment.visit_device(&mut |_, p, node| {
        if let Node::Leaf(a) = node {
            wanted.push((p.as_str().to_owned(), a.leaf_type()));
        }
    });
    let leaves: HashSet<&str> = wanted.iter().map(|(l, _)| l.as_str()).collect();
    // The file's tensors under the leaf names they map to.
    let mut by_leaf: BTreeMap<String, Candidate> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut skipped = Vec::new();
    let mut file_names = HashSet::new();
    let mut tensors = file.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, view) in tensors {
        file_names.insert(name.clone());
        let array = match to_array(&view) {
            Ok(a) => a,
            Err(why) => {
                problems.push(format!("tensor `{name}` {why}"));
                continue;
            }
        };
        let routed: Vec<(String, Array, bool)> = match import.route(&name, &leaves) {
            Route::Skip(why) => {
                skipped.push(format!("`{name}` ({}, {why})", array.leaf_type()));
                continue;
            }
            Route::Leaf { leaf, torch } => vec![(leaf, array, torch)],
            Route::Split(axis, parts) => match split(&array, axis, parts.len()) {
                Ok(pieces) => parts
                    .into_iter()
                    .zip(pieces)
                    .map(|(l, a)| (l, a, false))
                    .collect(),
                Err(why) => {
                    problems.push(format!("tensor `{name}`: {why}"));
                    continue;
                }
            },
        };
        for (leaf, value, torch) in routed {
            let candidate = Candidate {
                name: name.clone(),
                value,
                torch,
            };
            if let Some(other) = by_leaf.insert(leaf.clone(), candidate) {
                problems.push(format!(
                    "tensors `{}` and `{name}` both map to `{leaf}`",
                    other.name
                ));
            }
        }
    }
    check_instructions::<E>(
        import,
        &leaves,
        &file_names,
        &|l| by_leaf.contains_key(l),
        &mut problems,
    );
    // Each tensor's conversions, in order; then its type against the leaf's.
    let mut casts = Conversions::default();
    let mut values: HashMap<String, Array> = HashMap::new();
    let mut loaded = Vec::new();
    for (leaf, ty) in &wanted {
        let Some(c) = by_leaf.remove(leaf) else {
            problems.push(format!("leaf `{leaf}` ({ty}) has no tensor in the file"));
            continue;
        };
        let tensor = (c.name.as_str(), c.value, c.torch);
        if let Some(a) = converted_for(import, leaf, ty, tensor, &mut casts, &mut problems) {
            values.insert(leaf.clone(), a);
            loaded.push(leaf.clone());
        }
    }
    let unused = by_leaf
        .iter()
        .map(|(leaf, c)| (leaf.as_str(), c.name.as_str(), c.value.leaf_type()));
    let mut ignored = unused_or_refused::<E>(import, path, unused, problems)?;
    ignored.extend(skipped);
    experiment.visit_device_mut(&mut |_, p, leaf| {
        if let Some(a) = values.remove(p.as_str()) {
            *leaf = a;
        }
    });
    Ok(Loaded {
        leaves: loaded,
        ignored,
        cast: casts.cast,
        saturated: casts.saturated,
        read_bytes: file_names
            .iter()
            .filter_map(|n| file.tensor(n).ok())
            .map(|t| t.data().len() as u64)
            .sum(),
    })
}

/// The file tensors no leaf took (`unused`: the leaf name each maps to, its name in the file,
/// its type), as [`Loaded::ignored`] lists them — or, with `problems` or without
/// [`Import::allow_extra`], the error that refuses the file, naming every problem.
fn unused_or_refused<'a, E: Experiment + ?Sized>(
    import: &Import,
    path: &Path,
    unused: impl Iterator<Item = (&'a str, &'a str, LeafType)>,
    mut problems: Vec<String>,
) -> Result<Vec<String>> {
    let ignored: Vec<String> = unused
        .map(|(leaf, name, ty)| {
            if name == leaf {
                format!("`{name}` ({ty})")
            } else {
                format!("`{name}` (as `{leaf}`, {ty})")
            }
        })
        .collect();
    if !import.allow_extra {
        for t in &ignored {
            problems.push(format!(
                "tensor {t} is not a leaf of `{}` (rename it, or allow extra tensors)",
                E::TYPE_PATH
            ));
        }
    }
    if !problems.is_empty() {
        return Err(Error::data_file(
            path,
            format!(
                "it does not fit `{}` ({} problem(s)): {}",
                E::TYPE_PATH,
                problems.len(),
                problems.join("; ")
            ),
        ));
    }
    Ok(ignored)
}

/// The dtype conversions [`Import::cast`] made while loading.
#[derive(Default)]
struct Conversions {
    /// `` `leaf` f16 → f32 ``.
    cast: Vec<String>,
    /// The leaves whose values were clamped, with how many.
    saturated: Vec<String>,
}

/// What to say after a mismatch between a converted tensor of type `file` and `leaf`'s type
/// `ty`: [`Import::cast`] where only the dtype differs between floats, a permute (or
/// [`Import::pytorch`]) where the shape is a reordering of the leaf's.
fn hint(leaf: &str, file: &LeafType, ty: &LeafType, casting: bool) -> String {
    let mut hints = Vec::new();
    if file.dims != ty.dims {
        let mut sorted = (file.dims.clone(), ty.dims.clone());
        sorted.0.sort_unstable();
        sorted.1.sort_unstable();
        if sorted.0 == sorted.1 {
            let perm = permutation_between(&file.dims, &ty.dims);
            let pytorch = if file.dims.len() == 2 {
                "PyTorch stores a `Linear` weight as [out, in]: `Import::pytorch()` transposes \
                 it; or "
            } else {
                ""
            };
            hints.push(format!(
                "its shape is a reordering of the leaf's: {pytorch}`permute(\"{leaf}\", \
                 &{perm:?})`"
            ));
        }
    }
    if !casting && file.dtype != ty.dtype && file.dtype.is_float() && ty.dtype.is_float() {
        hints.push("Import::cast converts its dtype".to_owned());
    }
    if hints.is_empty() {
        String::new()
    } else {
        format!(" ({})", hints.join("; "))
    }
}

/// A permutation `perm` with `to[i] == from[perm[i]]` (`from` a reordering of `to`); equal
/// sizes are matched in order.
fn permutation_between(from: &[usize], to: &[usize]) -> Vec<usize> {
    let mut used = vec![false; from.len()];
    to.iter()
        .map(|d| {
            let i = (0..from.len())
                .find(|&i| !used[i] && from[i] == *d)
                .unwrap_or(0);
            used[i] = true;
            i
        })
        .collect()
}

/// Refuses every instruction that names nothing: a permute written with the file's name
/// instead of the leaf's would otherwise load the untransposed layout.
fn check_instructions<E: Experiment + ?Sized>(
    import: &Import,
    leaves: &HashSet<&str>,
    names: &HashSet<String>,
    mapped: &dyn Fn(&str) -> bool,
    problems: &mut Vec<String>,
) {
    let ty = E::TYPE_PATH;
    let mut renames: Vec<(&String, &String)> = import.renames.iter().collect();
    renames.sort();
    for (from, to) in renames {
        if !names.contains(from) {
            problems.push(format!(
                "rename(\"{from}\", \"{to}\") names no tensor of the file"
            ));
        } else if !leaves.contains(to.as_str()) {
            problems.push(format!(
                "rename(\"{from}\", \"{to}\") names no leaf of `{ty}`"
            ));
        }
    }
    let mut splits: Vec<_> = import.splits.iter().collect();
    splits.sort_by(|a, b| a.0.cmp(b.0));
    for (name, (axis, parts)) in splits {
        if !names.contains(name) {
            problems.push(format!(
                "split(\"{name}\", {axis}, {parts:?}) names no tensor of the file"
            ));
        }
        for part in parts.iter().filter(|p| !leaves.contains(p.as_str())) {
            problems.push(format!(
                "split(\"{name}\", {axis}, …) names `{part}`, no leaf of `{ty}`"
            ));
        }
    }
    let per_leaf = |what: &str, leaf: &str, args: String, problems: &mut Vec<String>| {
        if !leaves.contains(leaf) {
            let hint = if names.contains(leaf) {
                format!(" (it is a tensor's name in the file: {what} takes the leaf's name)")
            } else {
                String::new()
            };
            problems.push(format!(
                "{what}(\"{leaf}\"{args}) names no leaf of `{ty}`{hint}"
            ));
        } else if !mapped(leaf) {
            problems.push(format!(
                "{what}(\"{leaf}\"{args}) names a leaf no tensor of the file maps to"
            ));
        }
    };
    let mut permutes: Vec<_> = import.permutes.iter().collect();
    permutes.sort();
    for (leaf, perm) in permutes {
        per_leaf("permute", leaf, format!(", {perm:?}"), problems);
    }
    let mut orders: Vec<_> = import.flatten_orders.iter().collect();
    orders.sort();
    for (leaf, chw) in orders {
        per_leaf("flatten_order", leaf, format!(", {chw:?}"), problems);
    }
    let mut maps: Vec<&String> = import.maps.keys().collect();
    maps.sort();
    for leaf in maps {
        per_leaf("map", leaf, ", …".to_owned(), problems);
    }
}

/// File tensor `(name, value, torch)` [converted](convert) for `leaf` and checked to come out
/// as its type `ty`: the value, or `None` with what went wrong (naming the tensor and the leaf)
/// added to `problems`.
fn converted_for(
    import: &Import,
    leaf: &str,
    ty: &LeafType,
    (name, value, torch): (&str, Array, bool),
    casts: &mut Conversions,
    problems: &mut Vec<String>,
) -> Option<Array> {
    match convert(import, leaf, ty, value, torch, casts) {
        Ok(a) if &a.leaf_type() == ty => return Some(a),
        Ok(a) => problems.push(format!(
            "tensor `{name}` is {} but leaf `{leaf}` is {ty}{}",
            a.leaf_type(),
            hint(leaf, &a.leaf_type(), ty, import.cast)
        )),
        Err(why) => problems.push(format!("tensor `{name}` (for `{leaf}`): {why}")),
    }
    None
}

/// A file tensor's value converted for `leaf` (of type `ty`): permuted, reordered, cast and
/// mapped as `import` says.
fn convert(
    import: &Import,
    leaf: &str,
    ty: &LeafType,
    value: Array,
    torch: bool,
    casts: &mut Conversions,
) -> std::result::Result<Array, String> {
    let mut a = value;
    let perm = match import.permutes.get(leaf) {
        Some(p) => Some(p.clone()),
        None if torch => torch_layout(leaf, a.dims(), ty)?,
        None => None,
    };
    if let Some(perm) = perm {
        a = permuted(&a, &perm)?;
    }
    if let Some(chw) = import.flatten_orders.get(leaf) {
        a = channels_last_rows(&a, *chw)?;
    }
    if import.cast && a.dtype() != ty.dtype && a.dtype().is_float() && ty.dtype.is_float() {
        casts
            .cast
            .push(format!("`{leaf}` {} → {}", a.dtype(), ty.dtype));
        let (cast, clamped) = cast(&a, ty.dtype, import.saturate)?;
        if clamped > 0 {
            casts.saturated.push(format!(
                "`{leaf}` {clamped} value(s) clamped to ±{} ({})",
                largest_finite(ty.dtype),
                ty.dtype
            ));
        }
        a = cast;
    }
    if let Some(f) = import.maps.get(leaf) {
        a = f(a).map_err(|why| format!("map: {why}"))?;
    }
    Ok(a)
}

/// PyTorch's layout for `leaf`, as nitro stores it: a `Linear` weight `[out, in]` transposed, a
/// conv weight OIHW permuted to HWIO unless the leaf is OIHW (a channels-first conv).
fn torch_layout(
    leaf: &str,
    d: &[usize],
    ty: &LeafType,
) -> std::result::Result<Option<Vec<usize>>, String> {
    if !leaf.ends_with(".w") {
        return Ok(None);
    }
    match d.len() {
        2 => Ok(Some(vec![1, 0])),
        4 => {
            let hwio = [d[2], d[3], d[1], d[0]];
            let (as_hwio, as_is) = (ty.dims == hwio, ty.dims == d);
            match (as_hwio, as_is) {
                (true, true) => Err(format!(
                    "the kernel {:?} fits both a channels-last (HWIO) and a channels-first \
                     (OIHW) conv: say which with permute(\"{leaf}\", &[2, 3, 1, 0]) or \
                     permute(\"{leaf}\", &[0, 1, 2, 3])",
                    d
                )),
                (false, true) => Ok(None),
                _ => Ok(Some(vec![2, 3, 1, 0])),
            }
        }
        _ => Ok(None),
    }
}

/// `a`'s rows — its first dim, `c·h·w` features in `(c, h, w)` order — reordered to `(h, w,
/// c)`.
fn channels_last_rows(a: &Array, [c, h, w]: [usize; 3]) -> std::result::Result<Array, String> {
    let d = a.dims();
    let Some(rows) = c.checked_mul(h).and_then(|n| n.checked_mul(w)) else {
        return Err(format!(
            "flatten_order {:?}: c·h·w overflows a size; give the layer's real \
             [channels, height, width]",
            [c, h, w]
        ));
    };
    if d.first() != Some(&rows) {
        return Err(format!(
            "flatten_order {:?} wants a first dim of {rows} (c·h·w), the value is {}",
            [c, h, w],
            a.leaf_type()
        ));
    }
    let rest: usize = d[1..].iter().product();
    let data = crate::ops::host::layout::transpose(a.data(), &[c, h, w, rest], &[1, 2, 0, 3])
        .map_err(|_| "cannot reorder it (out of memory)".to_owned())?;
    Array::from_data(d, data).map_err(|e| e.to_string())
}

/// `a` split into `parts` equal pieces along `axis`.
fn split(a: &Array, axis: usize, parts: usize) -> std::result::Result<Vec<Array>, String> {
    let d = a.dims();
    let Some(&n) = d.get(axis) else {
        return Err(format!("cannot split {} along axis {axis}", a.leaf_type()));
    };
    if parts == 0 || n % parts != 0 {
        return Err(format!(
            "cannot split {} into {parts} equal parts along axis {axis}",
            a.leaf_type()
        ));
    }
    let (outer, inner): (usize, usize) =
        (d[..axis].iter().product(), d[axis + 1..].iter().product());
    let step = n / parts;
    (0..parts)
        .map(|k| {
            // Rows `k·step .. (k+1)·step` of the `[outer, n, inner]` view.
            let dims = [outer, step, inner];
            let strides = [n * inner, inner, 1];
            let data =
                crate::ops::host::layout::gather_data(a.data(), &dims, &strides, k * step * inner)
                    .map_err(|_| "cannot split it (out of memory)".to_owned())?;
            let mut out = d.to_vec();
            out[axis] = step;
            Array::from_data(&out, data).map_err(|e| e.to_string())
        })
        .collect()
}

/// `a` converted to the floating-point dtype `to`, as the `convert` op converts, and how many
/// values were clamped. A finite value that `to` cannot hold is an error naming it and its
/// index, or (`saturate`) clamped to `to`'s largest finite value with its sign.
fn cast(a: &Array, to: DType, saturate: bool) -> std::result::Result<(Array, usize), String> {
    use crate::ops::elementwise::kernels::convert;
    let fail = |f| format!("cannot cast {} to {to}: {f:?}", a.leaf_type());
    let data = convert(a.data(), to).map_err(fail)?;
    // A cast into a range at least as wide (f16 → f32, bf16 → f32) holds every value: no
    // overflow to look for, and no copies made to look.
    if largest_finite(a.dtype()) <= largest_finite(to) {
        let array = Array::from_data(a.dims(), data).map_err(|e| e.to_string())?;
        return Ok((array, 0));
    }
    // Read both sides as f64 (which holds every value of every float dtype) to find the
    // finite values that became infinite.
    let (ArrayData::F64(before), ArrayData::F64(after)) = (
        convert(a.data(), DType::F64).map_err(fail)?,
        convert(&data, DType::F64).map_err(fail)?,
    ) else {
        return Err(format!("cannot read {} as f64", a.leaf_type()));
    };
    let overflows = |(x, y): &(&f64, &f64)| x.is_finite() && !y.is_finite();
    let clamped = before.iter().zip(&after).filter(overflows).count();
    if clamped == 0 {
        let array = Array::from_data(a.dims(), data).map_err(|e| e.to_string())?;
        return Ok((array, 0));
    }
    let max = largest_finite(to);
    if !saturate {
        let first = before
            .iter()
            .zip(&after)
            .position(|p| overflows(&p))
            .unwrap_or(0);
        return Err(format!(
            "its value {} at index {:?} ({clamped} value(s) in all) is finite but outside \
             {to}'s range (±{max}): cast, it would be infinite; scale the weights, keep the leaf \
             in a wider dtype, or clamp them with Import::cast_saturating()",
            before[first],
            unflatten(first, a.dims())
        ));
    }
    let clamp: Vec<f64> = before
        .iter()
        .map(|x| {
            if x.is_finite() {
                x.clamp(-max, max)
            } else {
                *x
            }
        })
        .collect();
    let data = convert(&ArrayData::F64(clamp), to).map_err(fail)?;
    let array = Array::from_data(a.dims(), data).map_err(|e| e.to_string())?;
    Ok((array, clamped))
}

/// The largest finite value of the float dtype `to`.
fn largest_finite(to: DType) -> f64 {
    match to {
        DType::F16 => half::f16::MAX.to_f64(),
        DType::BF16 => half::bf16::MAX.to_f64(),
        DType::F32 => f64::from(f32::MAX),
        _ => f64::MAX,
    }
}

/// The index, per dim of `dims`, of the `flat`-th element in row-major order.
fn unflatten(mut flat: usize, dims: &[usize]) -> Vec<usize> {
    let mut index = vec![0; dims.len()];
    for (i, &d) in dims.iter().enumerate().rev() {
        if d > 0 {
            index[i] = flat % d;
            flat /= d;
        }
    }
    index
}

fn permuted(a: &Array, perm: &[usize]) -> std::result::Result<Array, String> {
    let mut sorted = perm.to_vec();
    sorted.sort_unstable();
    if sorted != (0..a.dims().len()).collect::<Vec<_>>() {
        return Err(format!(
            "the permute {perm:?} is not a permutation of the dims of {}",
            a.leaf_type()
        ));
    }
    let dims: Vec<usize> = perm.iter().map(|&p| a.dims()[p]).collect();
    let data = crate::ops::host::layout::transpose(a.data(), a.dims(), perm)
        .map_err(|_| "cannot permute it (out of memory)".to_owned())?;
    Array::from_data(&dims, data).map_err(|e| e.to_string())
}

/// Writes `experiment`'s Device leaves to `path` as a plain `safetensors` file, one tensor per
/// leaf named by its path, atomically (temporary files that killed writes of files with its
/// extension left beside it are removed first).
pub fn export<E: Experiment + ?Sized>(experiment: &E, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let mut tensors: Vec<(String, Raw)> = Vec::new();
    experiment.visit_device(&mut |_, p, node| {
        if let Node::Leaf(a) = node {
            tensors.push((p.as_str().to_owned(), Raw::of(a)));
        }
    });
    let bytes = safetensors::serialize(tensors, None)
        .map_err(|e| Error::data_file(path, format!("safetensors cannot encode it: {e}")))?;
    Error::write_data_file(path, &bytes, true)
}
