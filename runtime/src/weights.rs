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

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crate::checkpoint::{to_array, Raw};
use crate::error::{Error, Result};
use crate::experiment::Experiment;
use crate::tree::{Array, Node};

type Renamer = Box<dyn Fn(&str) -> String>;

/// How a file's tensors map onto an experiment's leaves.
#[derive(Default)]
pub struct Import {
    renames: HashMap<String, String>,
    rename_with: Option<Renamer>,
    permutes: HashMap<String, Vec<usize>>,
    allow_extra: bool,
}

impl Import {
    /// Names as they are, no permutes, extra tensors refused.
    pub fn new() -> Import {
        Import::default()
    }

    /// The file's tensor `from` is the leaf `to`.
    pub fn rename(mut self, from: &str, to: &str) -> Import {
        self.renames.insert(from.to_owned(), to.to_owned());
        self
    }

    /// The leaf a file tensor is, for the names [`Import::rename`] does not list.
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

    /// Ignore file tensors that no leaf takes (an optimizer's state, a head not used).
    pub fn allow_extra(mut self) -> Import {
        self.allow_extra = true;
        self
    }

    fn leaf_of(&self, name: &str) -> String {
        match (self.renames.get(name), &self.rename_with) {
            (Some(to), _) => to.clone(),
            (None, Some(f)) => f(name),
            (None, None) => name.to_owned(),
        }
    }
}

/// What [`load_into`] loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loaded {
    /// The leaves filled, by path.
    pub leaves: Vec<String>,
    /// File tensors no leaf took (with [`Import::allow_extra`]).
    pub ignored: Vec<String>,
}

/// Loads the `safetensors` file at `path` into `experiment`'s Device leaves (see the
/// [module docs](self)). Nothing changes unless every leaf is found and fits.
pub fn load_into<E: Experiment + ?Sized>(
    experiment: &mut E,
    path: impl AsRef<Path>,
    import: &Import,
) -> Result<Loaded> {
    let path = path.as_ref();
    let bytes = Error::read_data_file(path)?;
    let file = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::data_file(path, format!("not a safetensors file: {e}")))?;
    // The file's tensors under the leaf names they map to.
    let mut by_leaf: BTreeMap<String, (String, Array)> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut file_names = std::collections::HashSet::new();
    for (name, view) in file.tensors() {
        file_names.insert(name.clone());
        let leaf = import.leaf_of(&name);
        let array = match to_array(&view) {
            Ok(a) => a,
            Err(why) => {
                problems.push(format!("tensor `{name}` {why}"));
                continue;
            }
        };
        let array = match import.permutes.get(&leaf) {
            Some(perm) => match permuted(&array, perm) {
                Ok(a) => a,
                Err(why) => {
                    problems.push(format!("tensor `{name}` (for `{leaf}`): {why}"));
                    continue;
                }
            },
            None => array,
        };
        if let Some((other, _)) = by_leaf.insert(leaf.clone(), (name.clone(), array)) {
            problems.push(format!(
                "tensors `{other}` and `{name}` both map to `{leaf}`"
            ));
        }
    }
    let mut wanted = Vec::new();
    experiment.visit_device(&mut |_, p, node| {
        if let Node::Leaf(a) = node {
            wanted.push((p.as_str().to_owned(), a.leaf_type()));
        }
    });
    // An instruction that names nothing is a mistake (a permute written with the file's name
    // instead of the leaf's would load the untransposed layout): every one is refused.
    let leaves: std::collections::HashSet<&str> = wanted.iter().map(|(l, _)| l.as_str()).collect();
    let names: std::collections::HashSet<&str> = file_names.iter().map(String::as_str).collect();
    let mut renames: Vec<(&String, &String)> = import.renames.iter().collect();
    renames.sort();
    for (from, to) in renames {
        if !names.contains(from.as_str()) {
            problems.push(format!(
                "rename(\"{from}\", \"{to}\") names no tensor of the file"
            ));
        } else if !leaves.contains(to.as_str()) {
            problems.push(format!(
                "rename(\"{from}\", \"{to}\") names no leaf of `{}`",
                E::TYPE_PATH
            ));
        }
    }
    let mut permutes: Vec<(&String, &Vec<usize>)> = import.permutes.iter().collect();
    permutes.sort();
    for (leaf, perm) in permutes {
        if !leaves.contains(leaf.as_str()) {
            let hint = if names.contains(leaf.as_str()) {
                " (it is a tensor's name in the file: permute takes the leaf's name)"
            } else {
                ""
            };
            problems.push(format!(
                "permute(\"{leaf}\", {perm:?}) names no leaf of `{}`{hint}",
                E::TYPE_PATH
            ));
        } else if !by_leaf.contains_key(leaf.as_str()) {
            problems.push(format!(
                "permute(\"{leaf}\", {perm:?}) names a leaf no tensor of the file maps to"
            ));
        }
    }
    let mut loaded = Vec::new();
    for (leaf, ty) in &wanted {
        match by_leaf.get(leaf) {
            None => problems.push(format!("leaf `{leaf}` ({ty}) has no tensor in the file")),
            Some((name, a)) if &a.leaf_type() != ty => problems.push(format!(
                "tensor `{name}` is {} but leaf `{leaf}` is {ty}",
                a.leaf_type()
            )),
            Some(_) => loaded.push(leaf.clone()),
        }
    }
    let taken = &leaves;
    let ignored: Vec<String> = by_leaf
        .iter()
        .filter(|(leaf, _)| !taken.contains(leaf.as_str()))
        .map(|(leaf, (name, a))| {
            if *name == *leaf {
                format!("`{name}` ({})", a.leaf_type())
            } else {
                format!("`{name}` (as `{leaf}`, {})", a.leaf_type())
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
    let mut values: HashMap<String, Array> = by_leaf
        .into_iter()
        .map(|(leaf, (_, a))| (leaf, a))
        .collect();
    experiment.visit_device_mut(&mut |_, p, leaf| {
        if let Some(a) = values.remove(p.as_str()) {
            *leaf = a;
        }
    });
    Ok(Loaded {
        leaves: loaded,
        ignored,
    })
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
