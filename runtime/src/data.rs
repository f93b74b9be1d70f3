//! In-memory datasets: arrays with a content digest, batching, shuffling and splits.
//!
//! A [`Dataset`] is a set of named columns ([`Array`]s) that share their first dim, the rows:
//! pixels `x: f32[rows, 64]` and labels `y: i32[rows]`, say. Its [`Digest`] (blake3 over the
//! column names, dtypes, dims and bytes) is computed once, when it is built, and names the data.
//! A data set too large to hash at every start can be made without one
//! ([`Dataset::unnamed`]): it trains the same, but what needs its name — the coordinates of a
//! cached stage's outputs — refuses it ([`Error::Nameless`]).
//!
//! ```
//! use nitro::data::{Dataset, Order};
//! use nitro::Array;
//!
//! let x = Array::from_vec(&[10, 2], (0..20).map(|v| v as f32).collect())?;
//! let y = Array::from_vec(&[10], (0..10).map(|v| v % 3).collect::<Vec<i32>>())?;
//! let data = Dataset::new([("x", x), ("y", y)])?;
//! data.check_labels("y", 3)?;
//!
//! // A seeded 80/20 split: the same seed gives the same split on every run and platform.
//! let split = data.split(0.8, 7)?;
//! assert_eq!((split.train.rows(), split.validation.rows()), (8, 2));
//!
//! // Batches of 3, reshuffled every epoch: 3 full batches and a ragged one, padded to 3 rows.
//! let plan = split.train.plan(3, Order::Shuffled { seed: 1 })?;
//! let epoch = plan.epoch(0);
//! let batches = epoch.batches(&split.train).collect::<nitro::Result<Vec<_>>>()?;
//! assert_eq!(batches.len(), 3);
//! let last = &batches[2];
//! assert_eq!(last.column("x").unwrap().dims(), &[3, 2]); // always the full batch size
//! assert_eq!(last.real_rows(), 2);
//! assert_eq!(last.mask().as_slice::<f32>()?, &[1.0, 1.0, 0.0]);
//! # Ok::<(), nitro::Error>(())
//! ```
//!
//! # Ragged batches: padding and the mask
//!
//! Every batch has exactly the plan's batch size, so one compiled program serves every step.
//! When the rows do not divide evenly, the last batch of an epoch is **padded by repeating its
//! own real rows** (padding row `i` is a copy of real row `i % real`), and its `mask`
//! (`f32[batch]`) is 1 for real rows and 0 for padding. Repeated rows rather than zeros, because
//! a real row is always a valid input: an all-zero row can give a non-finite loss (a log of 0, a
//! division by a zero norm, an embedding of token 0 out of range), and a NaN times a mask of 0
//! is still NaN. The training loss is `sum(loss · mask) / real_rows`, so padding adds nothing.
//!
//! # Determinism
//!
//! Splits and shuffles use [`SplitMix64`], written out here, so a seed means the same rows on
//! every platform and nitro version that keeps this module's documented algorithm.

pub mod buckets;
pub mod idx;
pub mod text;

use std::fmt;

use crate::error::{Error, Result};
use crate::hash::{ContentHash, ContentHasher, Digest};
use crate::tree::{Array, ArrayData, LeafPath, Node, Tree};

/// The name of the mask leaf of a [`Batch`]; no column may use it.
pub const MASK: &str = "mask";

/// Named columns of arrays that share their first dim (one entry per row), with a content
/// digest.
///
/// Build one with [`Dataset::new`] (or [`Dataset::unnamed`], which skips the digest); it never
/// changes afterwards (derive new data sets with [`select`](Dataset::select) or
/// [`split`](Dataset::split)), so its digest stays true.
#[derive(Clone, PartialEq)]
pub struct Dataset {
    columns: Vec<(String, Array)>,
    rows: usize,
    /// `None` for a data set made with [`Dataset::unnamed`] (or derived from one).
    digest: Option<Digest>,
}

impl Dataset {
    /// A data set of the given columns, in order.
    ///
    /// Errors: [`Error::InvalidDataArgument`] when there is no column;
    /// [`Error::DatasetColumn`] when a name is not an identifier (`[A-Za-z_][A-Za-z0-9_]*`), is
    /// [`MASK`], or repeats, or when a column is a scalar (it has no rows);
    /// [`Error::DatasetRows`] when the columns' first dims differ.
    pub fn new<N: Into<String>>(columns: impl IntoIterator<Item = (N, Array)>) -> Result<Dataset> {
        Ok(Dataset::checked(columns)?.into_named())
    }

    /// A data set of the given columns without a digest: nothing is hashed, so making one
    /// costs no pass over its bytes (about 0.5 ms per MB here) — for data too large to hash at
    /// every start that never feeds a cached stage.
    ///
    /// It batches, splits, trains and validates like any other; its derived data sets
    /// ([`select`](Dataset::select), [`split`](Dataset::split)) have no digest either.
    /// What needs its name refuses it: a cached stage, whose outputs are named by the data
    /// set's digest and a span of rows, returns [`Error::Nameless`].
    /// [`into_named`](Dataset::into_named) hashes it later. Used as part of a content hash, it
    /// is hashed then (the same hash a named data set of the same contents gives).
    ///
    /// Errors: those of [`Dataset::new`].
    pub fn unnamed<N: Into<String>>(
        columns: impl IntoIterator<Item = (N, Array)>,
    ) -> Result<Dataset> {
        Dataset::checked(columns)
    }

    /// This data set with its content digest: hashed now when it has none
    /// ([`Dataset::unnamed`]), unchanged otherwise.
    pub fn into_named(mut self) -> Dataset {
        if self.digest.is_none() {
            self.digest = Some(digest_columns(&self.columns));
        }
        self
    }

    /// A data set of the given columns named by `digest` instead of a hash of its contents:
    /// for data derived from named inputs (a cached stage's outputs, named by their keys), so
    /// naming it costs nothing. The caller answers for the digest standing for the contents.
    pub(crate) fn named<N: Into<String>>(
        columns: impl IntoIterator<Item = (N, Array)>,
        digest: Digest,
    ) -> Result<Dataset> {
        let mut data = Dataset::checked(columns)?;
        data.digest = Some(digest);
        Ok(data)
    }

    /// The columns checked (see [`Dataset::new`]'s errors), without a digest.
    fn checked<N: Into<String>>(columns: impl IntoIterator<Item = (N, Array)>) -> Result<Dataset> {
        let columns: Vec<(String, Array)> =
            columns.into_iter().map(|(n, a)| (n.into(), a)).collect();
        let Some((first, first_array)) = columns.first() else {
            return Err(Error::InvalidDataArgument {
                what: "a data set needs at least one column; pass (name, array) pairs".into(),
            });
        };
        let rows = first_array.dims().first().copied().unwrap_or(0);
        for (i, (name, array)) in columns.iter().enumerate() {
            let problem = if !is_identifier(name) {
                Some("is not a valid column name; use an identifier such as `x` or `labels`")
            } else if name == MASK {
                Some(
                    "uses the name `mask`, which batches reserve for their padding mask; rename it",
                )
            } else if columns[..i].iter().any(|(n, _)| n == name) {
                Some("appears twice; give every column its own name")
            } else if array.rank() == 0 {
                Some("is a scalar; a column needs a first dim with one entry per row")
            } else {
                None
            };
            if let Some(problem) = problem {
                return Err(Error::DatasetColumn {
                    column: name.clone(),
                    problem: problem.into(),
                });
            }
            if array.dims()[0] != rows {
                return Err(Error::DatasetRows {
                    column: name.clone(),
                    rows: array.dims()[0],
                    first: first.clone(),
                    first_rows: rows,
                });
            }
        }
        Ok(Dataset {
            columns,
            rows,
            digest: None,
        })
    }

    /// The number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The content digest: blake3 over every column's name, dtype, dims and bytes, in column
    /// order. Equal data gives equal digests on every run and platform; any changed byte,
    /// dtype, dim, name or column order gives another. `None` for a data set without one
    /// ([`Dataset::unnamed`]).
    pub fn digest(&self) -> Option<Digest> {
        self.digest
    }

    /// The columns, in order.
    pub fn columns(&self) -> impl ExactSizeIterator<Item = (&str, &Array)> {
        self.columns.iter().map(|(n, a)| (n.as_str(), a))
    }

    /// The column named `name`; [`Error::DatasetColumn`] (listing the columns) when there is
    /// none.
    pub fn column(&self, name: &str) -> Result<&Array> {
        self.columns
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a)
            .ok_or_else(|| Error::DatasetColumn {
                column: name.to_owned(),
                problem: format!(
                    "does not exist; the data set's columns are {}",
                    self.column_names()
                ),
            })
    }

    /// Consumes the data set, returning its columns.
    pub fn into_columns(self) -> Vec<(String, Array)> {
        self.columns
    }

    /// Checks that every label in `column` is a class index in `0..classes`.
    ///
    /// Errors: [`Error::LabelOutOfRange`] naming the first bad row and its value (negative
    /// labels included); [`Error::DatasetColumn`] when the column does not exist or holds
    /// something other than integers (`i32`, `i64`, `u8`).
    pub fn check_labels(&self, column: &str, classes: usize) -> Result<()> {
        let array = self.column(column)?;
        match first_label_outside(array, classes, array.dims().first().copied().unwrap_or(0)) {
            Some(Ok((row, value))) => Err(Error::LabelOutOfRange {
                column: column.to_owned(),
                row,
                value,
                classes,
            }),
            Some(Err(())) => Err(Error::DatasetColumn {
                column: column.to_owned(),
                problem: format!(
                    "holds {} values, not class labels; labels must be i32, i64 or u8",
                    array.dtype()
                ),
            }),
            None => Ok(()),
        }
    }

    /// A new data set of the rows at `indices`, in that order (repeats allowed), with the same
    /// columns, named by its content (without a digest when this data set has none).
    /// [`Error::RowOutOfRange`] when an index is not a row.
    pub fn select(&self, indices: &[usize]) -> Result<Dataset> {
        self.check_indices(indices)?;
        let columns = self
            .columns
            .iter()
            .map(|(name, array)| Ok((name.clone(), gather_rows(array, indices)?)))
            .collect::<Result<Vec<_>>>()?;
        let selected = Dataset::checked(columns)?;
        Ok(match self.digest {
            Some(_) => selected.into_named(),
            None => selected,
        })
    }

    /// Splits the rows at random into a training part of `round(train_fraction · rows)` rows
    /// and a validation part of the rest, deterministically in `seed`.
    ///
    /// The rows are permuted with [`permutation`]`(rows, seed)`; the first part of the
    /// permutation is the training set, the rest validation, and each part keeps the data
    /// set's row order (shuffle batches with [`Order::Shuffled`]). The same data, fraction and
    /// seed give the same split on every run and platform; [`Split::identity`] names it.
    ///
    /// [`Error::InvalidDataArgument`] when `train_fraction` is not a number in `0..=1`.
    pub fn split(&self, train_fraction: f64, seed: u64) -> Result<Split> {
        if !(0.0..=1.0).contains(&train_fraction) {
            return Err(Error::InvalidDataArgument {
                what: format!(
                    "train fraction {train_fraction} is not in 0..=1; pass the share of rows \
                     to train on, such as 0.8"
                ),
            });
        }
        let train_rows = ((train_fraction * self.rows as f64).round() as usize).min(self.rows);
        let order = permutation(self.rows, seed);
        let (train, validation) = order.split_at(train_rows);
        let (mut train, mut validation) = (train.to_vec(), validation.to_vec());
        train.sort_unstable();
        validation.sort_unstable();
        let identity = self.digest.map(|parent| {
            let mut h = ContentHasher::new();
            h.write_str("nitro.data.split.v1");
            h.write_digest(&parent);
            h.write_u64(train_fraction.to_bits());
            h.write_u64(seed);
            h.finish()
        });
        Ok(Split {
            train: self.select(&train)?,
            validation: self.select(&validation)?,
            train_rows: train,
            validation_rows: validation,
            identity,
        })
    }

    /// A batch plan over this data set's rows (see [`BatchPlan::new`]).
    pub fn plan(&self, batch_size: usize, order: Order) -> Result<BatchPlan> {
        BatchPlan::new(self.rows, batch_size, order)
    }

    /// The rows at `indices` gathered into a [`Batch`] of exactly `batch_size` rows: when there
    /// are fewer indices, the batch is padded by repeating them (padding row `i` copies real
    /// row `i % indices.len()`) and masked (see the [module docs](self)).
    ///
    /// Errors: [`Error::InvalidDataArgument`] when `indices` is empty or longer than
    /// `batch_size`; [`Error::RowOutOfRange`] when an index is not a row.
    pub fn gather(&self, indices: &[usize], batch_size: usize) -> Result<Batch> {
        let real = indices.len();
        if real == 0 || real > batch_size {
            return Err(Error::InvalidDataArgument {
                what: format!(
                    "a batch of size {batch_size} cannot hold {real} rows; gather between 1 \
                     and {batch_size} rows"
                ),
            });
        }
        self.check_indices(indices)?;
        // A batch far larger than its rows (a mistyped size) is a typed error, never an abort:
        // its size is computed without overflow and every allocation is fallible.
        let row_bytes: u64 = self
            .columns
            .iter()
            .map(|(_, a)| (row_stride(a) * a.dtype().size_bytes()) as u64)
            .sum::<u64>()
            + 4;
        let bytes = row_bytes.checked_mul(batch_size as u64);
        if bytes.is_none_or(|b| b > crate::MAX_TENSOR_BYTES) {
            return Err(Error::InvalidDataArgument {
                what: format!(
                    "a batch of {batch_size} rows of {row_bytes} bytes each is over nitro's \
                     size limit (nitro::MAX_TENSOR_BYTES); use a smaller batch"
                ),
            });
        }
        let padded: Vec<usize>;
        let rows = if real == batch_size {
            indices
        } else {
            let mut p = Vec::new();
            p.try_reserve_exact(batch_size)
                .map_err(|_| Error::OutOfMemory {
                    what: format!("a batch of {batch_size} rows"),
                    bytes: bytes.unwrap_or(u64::MAX),
                })?;
            p.extend((0..batch_size).map(|i| indices[i % real]));
            padded = p;
            &padded
        };
        let columns = self
            .columns
            .iter()
            .map(|(name, array)| Ok((name.clone(), gather_rows(array, rows)?)))
            .collect::<Result<Vec<_>>>()?;
        let mut mask = Vec::new();
        mask.try_reserve_exact(batch_size)
            .map_err(|_| Error::OutOfMemory {
                what: format!("the mask of a batch of {batch_size} rows"),
                bytes: 4 * batch_size as u64,
            })?;
        mask.extend((0..batch_size).map(|i| if i < real { 1.0f32 } else { 0.0 }));
        Ok(Batch {
            columns,
            mask: Array::from_vec(&[batch_size], mask)?,
            real,
        })
    }

    fn check_indices(&self, indices: &[usize]) -> Result<()> {
        match indices.iter().find(|&&i| i >= self.rows) {
            Some(&row) => Err(Error::RowOutOfRange {
                row,
                rows: self.rows,
            }),
            None => Ok(()),
        }
    }

    fn column_names(&self) -> String {
        self.columns
            .iter()
            .map(|(n, _)| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl fmt::Debug for Dataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.digest {
            Some(d) => write!(f, "Dataset({} rows, digest {}", self.rows, d.short())?,
            None => write!(f, "Dataset({} rows, no digest", self.rows)?,
        }
        for (name, array) in &self.columns {
            write!(f, ", {name}: {}", array.leaf_type())?;
        }
        f.write_str(")")
    }
}

/// A data set's digest stands for its contents (so a data set can be part of a content hash);
/// one without a digest is hashed here, to the digest it would have.
impl ContentHash for Dataset {
    fn content_hash(&self, h: &mut ContentHasher) {
        let digest = self.digest.unwrap_or_else(|| digest_columns(&self.columns));
        h.write_digest(&digest);
    }
}

/// A training / validation split of a [`Dataset`] (see [`Dataset::split`]).
#[derive(Clone, Debug)]
pub struct Split {
    /// The training rows.
    pub train: Dataset,
    /// The validation rows.
    pub validation: Dataset,
    train_rows: Vec<usize>,
    validation_rows: Vec<usize>,
    identity: Option<Digest>,
}

impl Split {
    /// Names the split: blake3 over the parent's digest, the train fraction and the seed.
    /// Stable across runs and platforms; each part's own content digest is
    /// [`Dataset::digest`]. `None` when the parent has no digest ([`Dataset::unnamed`]).
    pub fn identity(&self) -> Option<Digest> {
        self.identity
    }

    /// The parent's row indices that make up the training set, ascending.
    pub fn train_indices(&self) -> &[usize] {
        &self.train_rows
    }

    /// The parent's row indices that make up the validation set, ascending.
    pub fn validation_indices(&self) -> &[usize] {
        &self.validation_rows
    }
}

/// The order in which a [`BatchPlan`] visits rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    /// Rows `0, 1, 2, …` every epoch (evaluation).
    Sequential,
    /// A fresh permutation every epoch: epoch `e` uses [`permutation`]`(rows,
    /// epoch_seed(seed, e))` (see [`epoch_seed`]).
    Shuffled {
        /// The run's shuffling seed.
        seed: u64,
    },
}

/// How an epoch over `rows` rows is cut into batches of one size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchPlan {
    rows: usize,
    batch_size: usize,
    order: Order,
}

impl BatchPlan {
    /// A plan for `rows` rows in batches of `batch_size`, in `order`.
    /// [`Error::InvalidDataArgument`] when `batch_size` is 0.
    pub fn new(rows: usize, batch_size: usize, order: Order) -> Result<BatchPlan> {
        if batch_size == 0 {
            return Err(Error::InvalidDataArgument {
                what: "batch size 0 holds no rows; use a batch size of at least 1".into(),
            });
        }
        Ok(BatchPlan {
            rows,
            batch_size,
            order,
        })
    }

    /// The number of rows an epoch covers.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The batch size: every batch's row count, the ragged last one included.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The row order.
    pub fn order(&self) -> Order {
        self.order
    }

    /// Batches per epoch: `ceil(rows / batch_size)`.
    pub fn batches_per_epoch(&self) -> usize {
        self.rows.div_ceil(self.batch_size)
    }

    /// Epoch `epoch` (counting from 0): its row order, cut into spans.
    pub fn epoch(&self, epoch: u64) -> Epoch {
        let order = match self.order {
            Order::Sequential => (0..self.rows).collect(),
            Order::Shuffled { seed } => permutation(self.rows, epoch_seed(seed, epoch)),
        };
        Epoch {
            order,
            batch_size: self.batch_size,
        }
    }
}

/// One epoch of a [`BatchPlan`]: every row exactly once, cut into spans of the batch size (the
/// last may be shorter).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Epoch {
    order: Vec<usize>,
    batch_size: usize,
}

impl Epoch {
    /// Every row index, in this epoch's order.
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    /// The number of batches.
    pub fn len(&self) -> usize {
        self.order.len().div_ceil(self.batch_size)
    }

    /// Whether the epoch has no batches (the data set has no rows).
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The row indices of each batch, in order; only the last may be shorter than the batch
    /// size.
    pub fn spans(&self) -> std::slice::Chunks<'_, usize> {
        self.order.chunks(self.batch_size)
    }

    /// Each batch of `data` gathered (see [`Dataset::gather`]): full-size arrays, the last
    /// padded and masked. `data` must have the plan's row count, else each item is
    /// [`Error::RowOutOfRange`] or covers only some rows.
    pub fn batches<'a>(&'a self, data: &'a Dataset) -> impl Iterator<Item = Result<Batch>> + 'a {
        let batch_size = self.batch_size;
        self.spans().map(move |span| data.gather(span, batch_size))
    }
}

/// A batch: every column's rows for one step, all of the plan's batch size, plus the mask.
///
/// It is a [`Tree`] whose leaves are the columns (at paths named after them: `x`, `y`) and
/// then `mask` (`f32[batch]`: 1 for real rows, 0 for padding), so it can be a program's
/// inputs as it is. Traced code sees a [`BatchMirror<Tensor>`](BatchMirror) and reads columns
/// with [`BatchMirror::get`].
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    columns: Vec<(String, Array)>,
    mask: Array,
    real: usize,
}

impl Batch {
    /// The column named `name`, `[batch, …]`; [`Error::DatasetColumn`] (listing the columns)
    /// when there is none — as [`Dataset::column`].
    pub fn column(&self, name: &str) -> Result<&Array> {
        self.get(name).ok_or_else(|| self.no_column(name))
    }

    /// The column named `name`, if the batch has one (an optional column), as
    /// [`BatchMirror::get`] in traced code.
    pub fn get(&self, name: &str) -> Option<&Array> {
        self.columns.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }

    /// Moves the column named `name` out of the batch (no copy): what a
    /// [`FromBatch`](crate::train::FromBatch) impl builds a model's batch from. An error as
    /// [`Batch::column`]'s when there is none (or it was taken already).
    ///
    /// ```
    /// use nitro::data::{BatchPlan, Dataset, Order};
    /// use nitro::train::FromBatch;
    /// use nitro::{Array, Tree};
    ///
    /// #[derive(Tree)]
    /// pub struct Images { pub x: Array, pub y: Array }
    ///
    /// impl FromBatch for Images {
    ///     fn from_batch(mut b: nitro::data::Batch) -> nitro::Result<Images> {
    ///         Ok(Images { x: b.take("x")?, y: b.take("y")? })
    ///     }
    /// }
    /// let data = Dataset::new([
    ///     ("x", Array::from_vec(&[3, 2], vec![0.0f32; 6])?),
    ///     ("y", Array::from_vec(&[3], vec![0i32, 1, 2])?),
    /// ])?;
    /// let plan = BatchPlan::new(3, 4, Order::Sequential)?;
    /// let batch = plan.epoch(0).batches(&data).next().unwrap()?;
    /// let images = Images::from_batch(batch)?;
    /// assert_eq!(images.x.dims(), &[4, 2]);
    /// # Ok::<(), nitro::Error>(())
    /// ```
    pub fn take(&mut self, name: &str) -> Result<Array> {
        match self.columns.iter().position(|(n, _)| n == name) {
            Some(i) => Ok(self.columns.remove(i).1),
            None => Err(self.no_column(name)),
        }
    }

    fn no_column(&self, name: &str) -> Error {
        let names: Vec<String> = self.columns.iter().map(|(n, _)| format!("`{n}`")).collect();
        Error::DatasetColumn {
            column: name.to_owned(),
            problem: format!(
                "does not exist; the batch's columns are {}",
                if names.is_empty() {
                    "none".to_owned()
                } else {
                    names.join(", ")
                }
            ),
        }
    }

    /// The columns, in the data set's order.
    pub fn columns(&self) -> impl ExactSizeIterator<Item = (&str, &Array)> {
        self.columns.iter().map(|(n, a)| (n.as_str(), a))
    }

    /// The mask, `f32[batch]`: 1 for real rows (which come first), 0 for padding.
    pub fn mask(&self) -> &Array {
        &self.mask
    }

    /// The number of real rows: what to divide a masked loss sum by.
    pub fn real_rows(&self) -> usize {
        self.real
    }

    /// The batch size (real rows plus padding).
    pub fn size(&self) -> usize {
        self.mask.len()
    }

    /// Consumes the batch, returning its columns and its mask.
    pub fn into_parts(self) -> (Vec<(String, Array)>, Array) {
        (self.columns, self.mask)
    }
}

/// The traced (or otherwise mapped) form of a [`Batch`]: one `L` per column, and the mask.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchMirror<L> {
    /// The columns, in the data set's order.
    pub columns: Vec<(String, L)>,
    /// The mask.
    pub mask: L,
}

impl<L> BatchMirror<L> {
    /// The column named `name`.
    pub fn get(&self, name: &str) -> Option<&L> {
        self.columns.iter().find(|(n, _)| n == name).map(|(_, l)| l)
    }
}

/// Leaves at the column names, then at `mask`.
impl Tree for Batch {
    type Mirror<L> = BatchMirror<L>;

    fn visit<'a>(&'a self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, Node<'a>)) {
        for (name, array) in &self.columns {
            at.with_field(name, |at| array.visit(at, f));
        }
        at.with_field(MASK, |at| self.mask.visit(at, f));
    }

    fn visit_mut(&mut self, at: &mut LeafPath, f: &mut dyn FnMut(&LeafPath, &mut Array)) {
        for (name, array) in &mut self.columns {
            at.with_field(name, |at| array.visit_mut(at, f));
        }
        at.with_field(MASK, |at| self.mask.visit_mut(at, f));
    }

    fn mirror<L>(
        &self,
        at: &mut LeafPath,
        f: &mut dyn FnMut(&LeafPath, &Array) -> L,
    ) -> Self::Mirror<L> {
        let columns = self
            .columns
            .iter()
            .map(|(name, array)| (name.clone(), at.with_field(name, |at| array.mirror(at, f))))
            .collect();
        let mask = at.with_field(MASK, |at| self.mask.mirror(at, f));
        BatchMirror { columns, mask }
    }

    fn map_mirror<L, M>(m: &BatchMirror<L>, f: &mut dyn FnMut(&L) -> M) -> BatchMirror<M> {
        let columns = m.columns.iter().map(|(n, l)| (n.clone(), f(l))).collect();
        let mask = f(&m.mask);
        BatchMirror { columns, mask }
    }
}

/// The SplitMix64 generator (Steele, Lea and Flood, 2014): small, fast, and the same on every
/// platform. nitro uses it for splits and shuffles; its output for a seed is part of this
/// module's contract.
///
/// ```
/// let mut r = nitro::data::SplitMix64::new(0);
/// assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose state starts at `seed`.
    pub const fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits: the state advances by `0x9e3779b97f4a7c15`, and the output is
    /// [`mix64`] of the state.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.state)
    }

    /// A uniform integer in `0..bound` without modulo bias (draws below `2^64 mod bound` are
    /// rejected and redrawn); `0` when `bound` is 0.
    pub fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            return 0;
        }
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let r = self.next_u64();
            if r >= threshold {
                return r % bound;
            }
        }
    }
}

/// The SplitMix64 output function (a bijection of `u64`).
pub const fn mix64(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The shuffling seed of epoch `epoch` of a run seeded with `seed`:
/// `mix64(seed ^ mix64(epoch + 1))`, so epochs draw unrelated streams.
pub const fn epoch_seed(seed: u64, epoch: u64) -> u64 {
    mix64(seed ^ mix64(epoch.wrapping_add(1)))
}

/// A random permutation of `0..n`, deterministic in `seed`: Fisher–Yates from the top, `i`
/// swapped with [`SplitMix64::below`]`(i + 1)`, with the generator seeded by `seed`.
pub fn permutation(n: usize, seed: u64) -> Vec<usize> {
    let mut rng = SplitMix64::new(seed);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

fn is_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn digest_columns(columns: &[(String, Array)]) -> Digest {
    let mut h = ContentHasher::new();
    h.write_str("nitro.data.dataset.v1");
    h.write_len(columns.len());
    for (name, array) in columns {
        h.write_str(name);
        array.content_hash(&mut h);
    }
    h.finish()
}

/// Elements per row of a column (the product of its dims after the first).
fn row_stride(array: &Array) -> usize {
    array.dims().iter().skip(1).product()
}

/// The first of the first `rows` rows of `array` holding a label outside `0..classes`: its row
/// and value; `Some(Err(()))` when `array` does not hold integers; `None` when all fit.
pub(crate) fn first_label_outside(
    array: &Array,
    classes: usize,
    rows: usize,
) -> Option<std::result::Result<(usize, i64), ()>> {
    let per_row = row_stride(array);
    let n = rows.saturating_mul(per_row);
    let in_range = |v: i64| v >= 0 && (v as u64) < classes as u64;
    let found =
        match array.data() {
            ArrayData::I32(v) => first_bad(&v[..n.min(v.len())], |&x| in_range(x.into()))
                .map(|(i, x)| (i, i64::from(x))),
            ArrayData::I64(v) => first_bad(&v[..n.min(v.len())], |&x| in_range(x)),
            ArrayData::U8(v) => first_bad(&v[..n.min(v.len())], |&x| in_range(x.into()))
                .map(|(i, x)| (i, i64::from(x))),
            _ => return Some(Err(())),
        };
    found.map(|(i, value)| Ok((i.checked_div(per_row).unwrap_or(0), value)))
}

fn first_bad<T: Copy>(values: &[T], ok: impl Fn(&T) -> bool) -> Option<(usize, T)> {
    values.iter().position(|v| !ok(v)).map(|i| (i, values[i]))
}

/// The rows at `rows` (all valid) of `array`, as one array `[rows.len(), …]`: one allocation,
/// one slice copy per row.
/// The rows at `rows` (indices into the first dim, each in range) of `array`, copied in that
/// order into a new array.
pub(crate) fn gather_rows(array: &Array, rows: &[usize]) -> Result<Array> {
    fn copy<T: Copy>(src: &[T], stride: usize, rows: &[usize]) -> Result<Vec<T>> {
        let n = stride.saturating_mul(rows.len());
        let mut out = Vec::new();
        out.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
            what: format!("{} gathered rows", rows.len()),
            bytes: (n as u64).saturating_mul(std::mem::size_of::<T>() as u64),
        })?;
        for &r in rows {
            out.extend_from_slice(&src[r * stride..(r + 1) * stride]);
        }
        Ok(out)
    }
    let stride = row_stride(array);
    let data = match array.data() {
        ArrayData::F32(v) => ArrayData::F32(copy(v, stride, rows)?),
        ArrayData::F64(v) => ArrayData::F64(copy(v, stride, rows)?),
        ArrayData::I32(v) => ArrayData::I32(copy(v, stride, rows)?),
        ArrayData::I64(v) => ArrayData::I64(copy(v, stride, rows)?),
        ArrayData::U8(v) => ArrayData::U8(copy(v, stride, rows)?),
        ArrayData::Bool(v) => ArrayData::Bool(copy(v, stride, rows)?),
        ArrayData::U32(v) => ArrayData::U32(copy(v, stride, rows)?),
        ArrayData::BF16(v) => ArrayData::BF16(copy(v, stride, rows)?),
        ArrayData::F16(v) => ArrayData::F16(copy(v, stride, rows)?),
    };
    let mut dims = array.dims().to_vec();
    dims[0] = rows.len();
    Array::from_data(&dims, data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::DType;

    #[test]
    fn splitmix_matches_the_reference_sequence() {
        // The first outputs of the reference C implementation seeded with 0.
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(r.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn below_stays_in_bounds() {
        let mut r = SplitMix64::new(3);
        for bound in [1u64, 2, 3, 7, 1000, u64::MAX] {
            for _ in 0..100 {
                assert!(r.below(bound) < bound);
            }
        }
        assert_eq!(r.below(0), 0);
    }

    #[test]
    fn dtype_of_mask_is_f32() {
        let d = Dataset::new([("x", Array::zeros(DType::F32, &[3, 2]))]).unwrap();
        let b = d.gather(&[0], 2).unwrap();
        assert_eq!(b.mask().dtype(), DType::F32);
    }
}
