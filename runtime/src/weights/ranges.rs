//! Weights read range by range, for a training handle on a mesh
//! ([`crate::train::Nitro::load_weights`]): each device's window of each leaf is read from the
//! file with positioned reads of the runs it covers, then permuted and cast on the way, so no
//! leaf is ever whole on the host unless a device holds it whole. Everything is checked as
//! [`load_into`](super::load_into) checks it, with the same messages, from the file's header
//! alone, before a byte of tensor data is read.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::{
    cast, check_instructions, converted_for, hint, largest_finite, permuted, split, torch_layout,
    unused_or_refused, Conversions, Import, Loaded, Route,
};
use crate::checkpoint::{dtype_named, header_tensor, st_dtype, to_array, Unreadable};
use crate::error::{Error, Result};
use crate::tree::{Array, DType, LeafType};

/// Where a split file tensor's piece is: the axis, the piece's index and the pieces' count.
type Split = (usize, usize, usize);

/// A file tensor routed to a leaf: the leaf, the piece's type, the split, whether PyTorch's
/// layout applies.
type Routed = (String, LeafType, Option<Split>, bool);

/// A file tensor as its header describes it: its type and where its data starts.
#[derive(Clone, Debug)]
struct Entry {
    ty: LeafType,
    at: u64,
}

/// A `safetensors` file opened by its header: its tensors' types and places, no data read.
pub(crate) struct Header {
    path: PathBuf,
    file: File,
    entries: BTreeMap<String, Entry>,
}

/// `Err` unless the tensors' data is what the `safetensors` crate accepts in
/// [`load_into`](super::load_into): the byte ranges, ordered by offset, follow each other from
/// the data's start with no gap and no overlap and end where the file ends (`data` bytes after
/// the header) — so no tensor's offsets point into another's bytes, and no byte is unused. The
/// error is the crate's own, so both paths refuse a file with the same message.
fn contiguous(
    json: &serde_json::Map<String, serde_json::Value>,
    data: u64,
) -> std::result::Result<(), safetensors::SafeTensorError> {
    use safetensors::SafeTensorError;
    let mut ranges = Vec::with_capacity(json.len());
    for (name, t) in json {
        if name == "__metadata__" {
            continue;
        }
        match header_tensor(t).2 {
            Some(offsets) => ranges.push((offsets, name.as_str())),
            // Refused by name by the per-tensor checks.
            None => return Ok(()),
        }
    }
    ranges.sort();
    let mut end = 0u64;
    for ((b, e), name) in ranges {
        if b != end || e < b {
            return Err(SafeTensorError::InvalidOffset(name.to_owned()));
        }
        end = e;
    }
    if end != data {
        return Err(SafeTensorError::MetadataIncompleteBuffer);
    }
    Ok(())
}

impl Header {
    /// Reads the header of the file at `path` and checks that every tensor's data lies in it.
    pub(crate) fn open(path: &Path) -> Result<Header> {
        let bad = |why: String| Error::data_file(path, why);
        let (file, len, header_len, header) = match crate::checkpoint::open_safetensors(path) {
            Ok(opened) => opened,
            Err(Unreadable::Io(_, e)) => return Err(bad(format!("cannot read it: {e}"))),
            Err(Unreadable::Bad(why)) if why.starts_with("it is ") => {
                return Err(bad(format!("{why}; pass a regular file")))
            }
            Err(Unreadable::Bad(why)) => return Err(bad(format!("not a safetensors file: {why}"))),
        };
        let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
            .map_err(|e| {
                bad(format!(
                    "not a safetensors file: its header is not JSON ({e})"
                ))
            })?;
        let data = 8 + header_len;
        contiguous(&json, len - data).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let mut entries = BTreeMap::new();
        for (name, t) in &json {
            if name == "__metadata__" {
                continue;
            }
            let (named, dims, offsets) = header_tensor(t);
            let Some(dtype) = named.and_then(dtype_named) else {
                return Err(bad(format!(
                    "tensor `{name}` has dtype {}, which nitro does not use",
                    named.unwrap_or("(none)")
                )));
            };
            let (Some(dims), Some((b, e))) = (dims, offsets) else {
                return Err(bad(format!(
                    "not a safetensors file: tensor `{name}` has no valid shape or offsets"
                )));
            };
            let ty = LeafType::new(dtype, &dims);
            let size = ty.size_bytes();
            let fits =
                e >= b && size == Some(e - b) && data.checked_add(e).is_some_and(|end| end <= len);
            if !fits {
                return Err(bad(format!(
                    "not a safetensors file: tensor `{name}` ({ty}) does not fit its offsets \
                     {b}..{e} in a file of {len} bytes"
                )));
            }
            entries.insert(name.clone(), Entry { ty, at: data + b });
        }
        Ok(Header {
            path: path.to_path_buf(),
            file,
            entries,
        })
    }

    /// The window `window` (`(start, len)` per dim) of tensor `name`, read with one positioned
    /// read per run of contiguous bytes it covers; `read` counts the bytes.
    fn read(&self, name: &str, window: &[(usize, usize)], read: &mut u64) -> Result<Array> {
        let entry = &self.entries[name];
        let (dims, elem) = (&entry.ty.dims, entry.ty.dtype.size_bytes());
        let rank = dims.len();
        let count: usize = window.iter().map(|w| w.1).product();
        let mut bytes = vec![0u8; count * elem];
        // The innermost dims the window covers whole read with the partial one before them
        // as one run.
        let mut whole_from = rank;
        while whole_from > 0 && window[whole_from - 1] == (0, dims[whole_from - 1]) {
            whole_from -= 1;
        }
        let inner: usize = dims[whole_from..].iter().product();
        let (outer, run) = match whole_from {
            0 => (0, inner),
            m => (m - 1, window[m - 1].1 * inner),
        };
        let mut strides = vec![1usize; rank];
        for i in (0..rank.saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * dims[i + 1];
        }
        let cannot =
            |e: std::io::Error| Error::data_file(&self.path, format!("cannot read it: {e}"));
        let runs: usize = window[..outer].iter().map(|w| w.1).product();
        for r in 0..if count == 0 { 0 } else { runs } {
            // Run `r`'s first element: its index over the outer dims, row-major.
            let (mut rest, mut element) = (r, 0);
            for d in (0..outer).rev() {
                element += (window[d].0 + rest % window[d].1) * strides[d];
                rest /= window[d].1;
            }
            if whole_from > 0 {
                element += window[outer].0 * strides[outer];
            }
            let mut file = &self.file;
            file.seek(SeekFrom::Start(entry.at + (element * elem) as u64))
                .map_err(cannot)?;
            let at = r * run * elem;
            file.read_exact(&mut bytes[at..at + run * elem])
                .map_err(cannot)?;
            *read += (run * elem) as u64;
        }
        let dims: Vec<usize> = window.iter().map(|w| w.1).collect();
        let view = safetensors::tensor::TensorView::new(st_dtype(entry.ty.dtype), dims, &bytes)
            .map_err(|e| Error::data_file(&self.path, format!("tensor `{name}`: {e}")))?;
        to_array(&view)
            .map_err(|why| Error::data_file(&self.path, format!("tensor `{name}` {why}")))
    }
}

/// How one leaf is read.
enum Way {
    /// Windows read from the file tensor `file` — of piece `k` of `parts` along `axis` when
    /// split — then permuted by `perm` and cast to `cast`.
    Ranges {
        file: String,
        split: Option<Split>,
        perm: Option<Vec<usize>>,
        cast: Option<DType>,
    },
    /// Read whole and converted as `load_into` converts (a `flatten_order` or a `map`
    /// reorders or recomputes the whole leaf): the leaf itself.
    Whole(Array),
}

/// A plan for reading a file into a handle's leaves, checked in full.
pub(crate) struct Plan {
    header: Header,
    ways: BTreeMap<String, Way>,
    saturate: bool,
    /// What the load did, as `load_into` says it; `cast` and `saturated` complete once read.
    pub(crate) loaded: Loaded,
    saturated: BTreeMap<String, usize>,
}

/// Plans loading the file `header` describes into the leaves `wanted` (path and type) of
/// experiment type `type_path`: routes, splits, permutes, flatten orders, casts and maps as
/// `import` says, every problem `load_into` would refuse refused here with its message, from
/// the types alone (a leaf with a `map` or a `flatten_order` is read and converted whole now).
pub(crate) fn plan<E: crate::experiment::Experiment + ?Sized>(
    header: Header,
    import: &Import,
    wanted: &[(String, LeafType)],
) -> Result<Plan> {
    let leaves: HashSet<&str> = wanted.iter().map(|(l, _)| l.as_str()).collect();
    // The file's tensors under the leaf names they map to: name, the piece's type, the split,
    // whether PyTorch's layout applies.
    struct Mapped {
        name: String,
        ty: LeafType,
        split: Option<Split>,
        torch: bool,
    }
    let mut by_leaf: BTreeMap<String, Mapped> = BTreeMap::new();
    let (mut problems, mut skipped) = (Vec::new(), Vec::new());
    let names: HashSet<String> = header.entries.keys().cloned().collect();
    for (name, entry) in &header.entries {
        let routed: Vec<Routed> = match import.route(name, &leaves) {
            Route::Skip(why) => {
                skipped.push(format!("`{name}` ({}, {why})", entry.ty));
                continue;
            }
            Route::Leaf { leaf, torch } => vec![(leaf, entry.ty.clone(), None, torch)],
            Route::Split(axis, parts) => {
                let d = &entry.ty.dims;
                match d.get(axis) {
                    Some(&n) if !parts.is_empty() && n % parts.len() == 0 => {
                        let mut dims = d.clone();
                        dims[axis] = n / parts.len();
                        let ty = LeafType::new(entry.ty.dtype, &dims);
                        let count = parts.len();
                        parts
                            .into_iter()
                            .enumerate()
                            .map(|(k, l)| (l, ty.clone(), Some((axis, k, count)), false))
                            .collect()
                    }
                    Some(_) => {
                        problems.push(format!(
                            "tensor `{name}`: cannot split {} into {} equal parts along \
                                 axis {axis}",
                            entry.ty,
                            parts.len()
                        ));
                        continue;
                    }
                    None => {
                        problems.push(format!(
                            "tensor `{name}`: cannot split {} along axis {axis}",
                            entry.ty
                        ));
                        continue;
                    }
                }
            }
        };
        for (leaf, ty, split, torch) in routed {
            let mapped = Mapped {
                name: name.clone(),
                ty,
                split,
                torch,
            };
            if let Some(other) = by_leaf.insert(leaf.clone(), mapped) {
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
        &names,
        &|l| by_leaf.contains_key(l),
        &mut problems,
    );
    let mut casts = Conversions::default();
    let mut ways = BTreeMap::new();
    let mut loaded = Vec::new();
    let mut read_whole = 0u64;
    for (leaf, ty) in wanted {
        let Some(m) = by_leaf.remove(leaf) else {
            problems.push(format!("leaf `{leaf}` ({ty}) has no tensor in the file"));
            continue;
        };
        if import.maps.contains_key(leaf) || import.flatten_orders.contains_key(leaf) {
            // Converted whole, as load_into converts it.
            let whole: Vec<(usize, usize)> = header.entries[&m.name]
                .ty
                .dims
                .iter()
                .map(|&d| (0, d))
                .collect();
            let value = header
                .read(&m.name, &whole, &mut read_whole)
                .and_then(|a| match m.split {
                    Some((axis, k, parts)) => split(&a, axis, parts)
                        .map(|mut p| p.swap_remove(k))
                        .map_err(|why| Error::data_file(&header.path, why)),
                    None => Ok(a),
                });
            let value = match value {
                Ok(v) => v,
                Err(e) => {
                    problems.push(e.to_string());
                    continue;
                }
            };
            let tensor = (m.name.as_str(), value, m.torch);
            if let Some(a) = converted_for(import, leaf, ty, tensor, &mut casts, &mut problems) {
                ways.insert(leaf.clone(), Way::Whole(a));
                loaded.push(leaf.clone());
            }
            continue;
        }
        // The type the conversions make, from the piece's type alone.
        let perm = match import.permutes.get(leaf) {
            Some(p) => Some(p.clone()),
            None if m.torch => match torch_layout(leaf, &m.ty.dims, ty) {
                Ok(p) => p,
                Err(why) => {
                    problems.push(format!("tensor `{}` (for `{leaf}`): {why}", m.name));
                    continue;
                }
            },
            None => None,
        };
        let mut dims = m.ty.dims.clone();
        if let Some(p) = &perm {
            let mut sorted = p.clone();
            sorted.sort_unstable();
            if sorted != (0..dims.len()).collect::<Vec<_>>() {
                problems.push(format!(
                    "tensor `{}` (for `{leaf}`): the permute {p:?} is not a permutation of the \
                     dims of {}",
                    m.name, m.ty
                ));
                continue;
            }
            dims = p.iter().map(|&i| m.ty.dims[i]).collect();
        }
        let from = m.ty.dtype;
        let cast = (import.cast && from != ty.dtype && from.is_float() && ty.dtype.is_float())
            .then_some(ty.dtype);
        let made = LeafType::new(cast.unwrap_or(from), &dims);
        if &made != ty {
            problems.push(format!(
                "tensor `{}` is {made} but leaf `{leaf}` is {ty}{}",
                m.name,
                hint(leaf, &made, ty, import.cast)
            ));
            continue;
        }
        if let Some(to) = cast {
            casts.cast.push(format!("`{leaf}` {from} → {to}"));
        }
        ways.insert(
            leaf.clone(),
            Way::Ranges {
                file: m.name,
                split: m.split,
                perm,
                cast,
            },
        );
        loaded.push(leaf.clone());
    }
    let unused = by_leaf
        .iter()
        .map(|(leaf, m)| (leaf.as_str(), m.name.as_str(), m.ty.clone()));
    let mut ignored = unused_or_refused::<E>(import, &header.path, unused, problems)?;
    ignored.extend(skipped);
    Ok(Plan {
        header,
        ways,
        saturate: import.saturate,
        loaded: Loaded {
            leaves: loaded,
            ignored,
            cast: casts.cast,
            saturated: casts.saturated,
            read_bytes: read_whole,
        },
        saturated: BTreeMap::new(),
    })
}

impl Plan {
    /// The windows `windows` (`(start, len)` per dim, in the leaf's dims) of leaf `leaf`, one
    /// array each: each read from the file's ranges that hold it, then permuted and cast.
    pub(crate) fn read(
        &mut self,
        leaf: &str,
        windows: &[Vec<(usize, usize)>],
    ) -> Result<Vec<Array>> {
        let path = self.header.path.clone();
        let bad = |why: String| Error::data_file(&path, format!("leaf `{leaf}`: {why}"));
        let way = self
            .ways
            .get(leaf)
            .ok_or_else(|| bad("no tensor of the file maps to it".into()))?;
        let mut out = Vec::with_capacity(windows.len());
        for window in windows {
            let array = match way {
                Way::Whole(a) => crate::ops::host::layout::window_of(a, window)?,
                Way::Ranges {
                    file,
                    split,
                    perm,
                    cast: to,
                } => {
                    // The window in the piece's dims (before the permute), then in the file's
                    // (the piece's offset along the split axis).
                    let mut piece: Vec<(usize, usize)> = match perm {
                        Some(p) => {
                            let mut w = vec![(0, 0); p.len()];
                            for (i, &src) in p.iter().enumerate() {
                                w[src] = window[i];
                            }
                            w
                        }
                        None => window.clone(),
                    };
                    if let Some((axis, k, parts)) = split {
                        let n = self.header.entries[file].ty.dims[*axis] / parts;
                        piece[*axis].0 += k * n;
                    }
                    let mut a = self
                        .header
                        .read(file, &piece, &mut self.loaded.read_bytes)?;
                    if let Some(p) = perm {
                        a = permuted(&a, p).map_err(bad)?;
                    }
                    if let Some(to) = to {
                        let (c, clamped) = cast(&a, *to, self.saturate).map_err(bad)?;
                        if clamped > 0 {
                            *self.saturated.entry(leaf.to_owned()).or_default() += clamped;
                        }
                        a = c;
                    }
                    a
                }
            };
            out.push(array);
        }
        Ok(out)
    }

    /// What the load did, once every leaf was read.
    pub(crate) fn finish(mut self, types: &[(String, LeafType)]) -> Loaded {
        for (leaf, clamped) in std::mem::take(&mut self.saturated) {
            let to = types
                .iter()
                .find(|(l, _)| *l == leaf)
                .map_or(DType::F32, |(_, t)| t.dtype);
            self.loaded.saturated.push(format!(
                "`{leaf}` {clamped} value(s) clamped to ±{} ({to})",
                largest_finite(to)
            ));
        }
        self.loaded
    }
}
