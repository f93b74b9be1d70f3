//! Shape buckets: variable-length rows served by a declared, finite set of programs.
//!
//! A program is compiled for fixed shapes. Rows of varying length — documents, sentences — are
//! padded to the smallest declared **edge** that holds them and masked, so a handle compiles one
//! program per edge (and never one per length), all of them before its first step. This module
//! has the three pieces that do not need a handle:
//!
//! - [`Buckets`], the policy: the edges, how many rows a batch of each edge holds (a fixed
//!   count, or a token budget so short buckets get more rows), what to do with a row longer than
//!   every edge, and the shuffle window within which rows of similar length are binned together;
//! - [`Ragged`], a data set of variable-length `i32` rows (token ids), with named columns that
//!   share each row's length (inputs `x` and next tokens `y`, say);
//! - [`plan_edges`], the planner: the `k` edges that minimise padded positions for a histogram
//!   of lengths, exactly (dynamic programming over the distinct lengths), and
//!   [`padding_waste`], the fraction of padded positions a set of edges leaves.
//!
//! ```
//! use nitro::data::buckets::{padding_waste, plan_edges, Buckets, Ragged};
//!
//! let lengths = [3, 4, 4, 9, 10, 30];
//! let plan = plan_edges(&lengths, 2)?;
//! assert_eq!(plan.edges, [10, 30]);
//! assert_eq!(plan.padded, 7 + 6 + 6 + 1); // every row padded to 10 but the 30
//! assert!(padding_waste(&lengths, &[30])? > plan.waste());
//!
//! let docs: Vec<Vec<i32>> = vec![vec![1, 2, 3], vec![4, 5, 6, 7, 8]];
//! let data = Ragged::next_token(&docs)?; // x = doc[..n-1], y = doc[1..]
//! assert_eq!(data.lengths(), [2, 4]);
//! let buckets = Buckets::new([2, 4])?;
//! let (batch, weights) = data.gather(&[1, 0], 4, 2, &buckets)?;
//! assert_eq!(batch.column("x").unwrap().dims(), &[2, 4]);
//! assert_eq!(weights, [4.0, 2.0]); // real positions per row
//! # Ok::<(), nitro::Error>(())
//! ```

use crate::error::{Error, Result};
use crate::tree::Array;

use super::{epoch_seed, permutation, Batch};

/// The name of the per-position mask column a bucketed batch carries: `f32 [rows, edge]`, 1 at
/// a row's real positions and 0 at its padding.
pub const VALID: &str = "valid";

/// What a bucketed data set does with a row longer than the largest edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overflow {
    /// Refuse it: an error naming the row's length and the largest bucket (the default).
    Error,
    /// Keep its first `largest edge` positions.
    Truncate,
}

/// A bucket policy: the declared edges of a variable dimension and how batches are formed.
///
/// The handle's program inventory is its programs × these edges, known when the handle is made
/// ([`crate::train::Config::buckets`]); a length outside them is an error, never a new program.
#[derive(Clone, Debug, PartialEq)]
pub struct Buckets {
    edges: Vec<usize>,
    tokens: Option<usize>,
    overflow: Overflow,
    window: usize,
    pad: i32,
    axis: usize,
}

impl Buckets {
    /// Buckets at `edges` (any order; each at least 1, no repeats): rows of
    /// [`Config::batch`](crate::train::Config::batch) per batch, too-long rows refused, a
    /// shuffle window of 1024 rows, padding id 0, the variable dimension at axis 1 of every
    /// batch column.
    pub fn new(edges: impl IntoIterator<Item = usize>) -> Result<Buckets> {
        let mut edges: Vec<usize> = edges.into_iter().collect();
        edges.sort_unstable();
        let bad = if edges.is_empty() {
            Some("no edges".to_owned())
        } else if edges[0] == 0 {
            Some("an edge of 0".to_owned())
        } else {
            edges
                .windows(2)
                .find(|w| w[0] == w[1])
                .map(|w| format!("the edge {} twice", w[0]))
        };
        if let Some(bad) = bad {
            return Err(Error::InvalidSetting {
                variable: "Buckets::new",
                value: format!("{edges:?}"),
                expected: format!(
                    "distinct edges of at least 1 (this has {bad}): the lengths rows are padded \
                     to, e.g. [64, 128, 256, 512]"
                ),
            });
        }
        Ok(Buckets {
            edges,
            tokens: None,
            overflow: Overflow::Error,
            window: 1024,
            pad: 0,
            axis: 1,
        })
    }

    /// A token budget per batch: a batch of edge `e` holds `tokens / e` rows (rounded down to a
    /// multiple of the device count, at least one per device), so short buckets get more rows.
    pub fn token_budget(mut self, tokens: usize) -> Buckets {
        self.tokens = Some(tokens);
        self
    }

    /// What to do with a row longer than the largest edge.
    pub fn overflow(mut self, overflow: Overflow) -> Buckets {
        self.overflow = overflow;
        self
    }

    /// The shuffle window: rows are shuffled, then binned by length within windows of this many
    /// rows (larger: less padding, less randomness in which rows share a batch).
    pub fn window(mut self, rows: usize) -> Buckets {
        self.window = rows.max(1);
        self
    }

    /// The id padding positions hold.
    pub fn pad(mut self, id: i32) -> Buckets {
        self.pad = id;
        self
    }

    /// The declared edges, ascending.
    pub fn edges(&self) -> &[usize] {
        &self.edges
    }

    /// The largest edge.
    pub fn largest(&self) -> usize {
        self.edges[self.edges.len() - 1]
    }

    /// The axis of a batch column that varies by bucket (1: `[rows, length, …]`).
    pub fn axis(&self) -> usize {
        self.axis
    }

    /// The token budget, if any.
    pub fn tokens(&self) -> Option<usize> {
        self.tokens
    }

    /// The overflow policy.
    pub fn overflow_policy(&self) -> Overflow {
        self.overflow
    }

    /// Rows per batch of edge `edge`: `batch` without a token budget, else the budget's share,
    /// a multiple of `replicas` (at least `replicas`).
    pub fn rows_for(&self, edge: usize, batch: usize, replicas: usize) -> usize {
        let replicas = replicas.max(1);
        match self.tokens {
            None => batch,
            Some(t) => ((t / edge.max(1)) / replicas * replicas).max(replicas),
        }
    }

    /// The index of the bucket a row of `length` goes to: the smallest edge that holds it (the
    /// largest when truncating); an error naming the length and the largest bucket otherwise.
    pub fn bucket_of(&self, length: usize) -> Result<usize> {
        match self.edges.iter().position(|&e| e >= length) {
            Some(b) => Ok(b),
            None if self.overflow == Overflow::Truncate => Ok(self.edges.len() - 1),
            None => Err(Error::InvalidDataArgument {
                what: format!(
                    "a row of length {length} is longer than the largest bucket ({}) of {:?}; \
                     add a larger edge, or truncate such rows (Buckets::overflow(Overflow::Truncate))",
                    self.largest(),
                    self.edges
                ),
            }),
        }
    }

    /// Whether `length` is a declared edge; the error a batch of another length gets.
    pub fn check_edge(&self, length: usize) -> Result<()> {
        if self.edges.contains(&length) {
            return Ok(());
        }
        Err(Error::InvalidDataArgument {
            what: format!(
                "length {length} is not a declared bucket {:?}: a batch must be padded to one \
                 of them (Ragged::gather does), else it would compile a program outside the \
                 declared inventory",
                self.edges
            ),
        })
    }
}

/// The edges [`plan_edges`] chose, and what they leave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EdgePlan {
    /// The edges, ascending; the last is the longest length.
    pub edges: Vec<usize>,
    /// Padded positions over the histogram.
    pub padded: u64,
    /// Real positions over the histogram.
    pub real: u64,
}

impl EdgePlan {
    /// The fraction of positions that are padding.
    pub fn waste(&self) -> f64 {
        let total = self.padded + self.real;
        if total == 0 {
            0.0
        } else {
            self.padded as f64 / total as f64
        }
    }
}

/// The at most `k` edges that minimise the padded positions of rows of `lengths`, each row
/// padded to the smallest edge that holds it — exactly, by dynamic programming over the
/// distinct lengths (an optimal edge is always one of them, and the longest is always an edge).
///
/// **Cost.** With `m` distinct lengths: when `k ≥ m` every distinct length is an edge (no
/// padding), at once. Otherwise each added edge is one layer of the program, computed by
/// divide and conquer (the padding cost satisfies the quadrangle inequality, so the best split
/// moves right as the range grows): `O(k · m · log m)` time and `4 · k · m` bytes, the planning
/// stopping early once padding reaches 0. A plan of more than 2^24 cells (`k · m`, e.g. 4096
/// buckets over 4096 distinct lengths) is refused with [`Error::InvalidDataArgument`]: round the
/// lengths (to multiples of 8, say) or plan fewer buckets.
///
/// [`Error::InvalidDataArgument`] also when `k` is 0, `lengths` is empty, or a length is 0 (the
/// error names the first such row: a row of no positions cannot be padded to an edge).
pub fn plan_edges(lengths: &[usize], k: usize) -> Result<EdgePlan> {
    if k == 0 || lengths.is_empty() {
        return Err(Error::InvalidDataArgument {
            what: format!(
                "planning {k} bucket(s) over {} row(s): plan at least one bucket over at least \
                 one row",
                lengths.len()
            ),
        });
    }
    if let Some(row) = lengths.iter().position(|&l| l == 0) {
        return Err(Error::InvalidDataArgument {
            what: format!(
                "row {row} has length 0: a row of no positions has no edge to pad it to; drop \
                 empty rows before planning buckets"
            ),
        });
    }
    let mut sorted = lengths.to_vec();
    sorted.sort_unstable();
    // The distinct lengths and how many rows have each.
    let mut distinct: Vec<(u64, u64)> = Vec::new();
    for &l in &sorted {
        match distinct.last_mut() {
            Some((v, c)) if *v == l as u64 => *c += 1,
            _ => distinct.push((l as u64, 1)),
        }
    }
    drop(sorted);
    let m = distinct.len();
    let real: u64 = distinct.iter().map(|&(l, c)| l.saturating_mul(c)).sum();
    if k >= m {
        return Ok(EdgePlan {
            edges: distinct.iter().map(|&(l, _)| l as usize).collect(),
            padded: 0,
            real,
        });
    }
    const MAX_CELLS: usize = 1 << 24;
    if k.saturating_mul(m) > MAX_CELLS {
        return Err(Error::InvalidDataArgument {
            what: format!(
                "planning {k} buckets over {m} distinct lengths is {} cells of work, over the \
                 planner's bound of 2^24; round the lengths (to multiples of 8, say) or plan \
                 fewer buckets",
                k.saturating_mul(m)
            ),
        });
    }
    // Prefix sums of counts and of count × length: the cost of padding lengths i..=j to
    // length j is count(i..=j) · l_j − sum(i..=j).
    let mut count = vec![0u64; m + 1];
    let mut sum = vec![0u64; m + 1];
    for (i, &(l, c)) in distinct.iter().enumerate() {
        count[i + 1] = count[i] + c;
        sum[i + 1] = sum[i] + c * l;
    }
    let cost =
        |i: usize, j: usize| (count[j + 1] - count[i]) * distinct[j].0 - (sum[j + 1] - sum[i]);
    // layer[j]: the least padding of lengths 0..=j with b + 1 edges, the last at j; from[b][j]:
    // where that last bucket starts.
    let inf = u64::MAX;
    let mut layer: Vec<u64> = (0..m).map(|j| cost(0, j)).collect();
    let mut from: Vec<Vec<u32>> = vec![vec![0; m]];
    let (mut best_b, mut padded) = (0usize, layer[m - 1]);
    for b in 1..k {
        if padded == 0 {
            break;
        }
        let mut next = vec![inf; m];
        let mut at = vec![0u32; m];
        // Fill next[j] for j in lo..=hi, knowing its best start lies in opt_lo..=opt_hi.
        let mut work = vec![(b, m - 1, b, m - 1)];
        while let Some((lo, hi, opt_lo, opt_hi)) = work.pop() {
            let j = lo + (hi - lo) / 2;
            let (mut c_best, mut i_best) = (inf, opt_lo);
            for i in opt_lo..=opt_hi.min(j) {
                let prev = layer[i - 1];
                if prev == inf {
                    continue;
                }
                let c = prev + cost(i, j);
                if c < c_best {
                    (c_best, i_best) = (c, i);
                }
            }
            next[j] = c_best;
            at[j] = i_best as u32;
            if j > lo {
                work.push((lo, j - 1, opt_lo, i_best));
            }
            if j < hi {
                work.push((j + 1, hi, i_best, opt_hi));
            }
        }
        layer = next;
        from.push(at);
        // More edges never pad more; keep the fewest edges that reach the least padding.
        if layer[m - 1] < padded {
            (best_b, padded) = (b, layer[m - 1]);
        }
    }
    let mut edges = Vec::with_capacity(best_b + 1);
    let (mut b, mut j) = (best_b, m - 1);
    loop {
        edges.push(distinct[j].0 as usize);
        if b == 0 {
            break;
        }
        j = from[b][j] as usize - 1;
        b -= 1;
    }
    edges.reverse();
    Ok(EdgePlan {
        edges,
        padded,
        real,
    })
}

/// The fraction of positions that are padding when rows of `lengths` are padded to the
/// smallest of `edges` that holds them; an error for a length longer than every edge.
pub fn padding_waste(lengths: &[usize], edges: &[usize]) -> Result<f64> {
    let buckets = Buckets::new(edges.iter().copied())?;
    let (mut padded, mut real) = (0u64, 0u64);
    for &l in lengths {
        let e = buckets.edges[buckets.bucket_of(l)?];
        padded += (e - l) as u64;
        real += l as u64;
    }
    let total = padded + real;
    Ok(if total == 0 {
        0.0
    } else {
        padded as f64 / total as f64
    })
}

/// A data set of variable-length rows of `i32` ids: named columns that share each row's length.
#[derive(Clone, Debug, PartialEq)]
pub struct Ragged {
    names: Vec<String>,
    /// Per column, every row's ids one after another.
    values: Vec<Vec<i32>>,
    /// Row `r` spans `offsets[r]..offsets[r + 1]` of every column.
    offsets: Vec<usize>,
}

impl Ragged {
    /// A data set of `columns` (name, rows); every column has the same number of rows, and a
    /// row's length is the same in every column and at least 1 (an empty row is refused,
    /// naming it).
    pub fn new(columns: Vec<(&str, Vec<Vec<i32>>)>) -> Result<Ragged> {
        let Some((_, first)) = columns.first() else {
            return Err(Error::InvalidDataArgument {
                what: "a ragged data set without columns; give at least one".into(),
            });
        };
        let rows = first.len();
        if let Some(r) = first.iter().position(Vec::is_empty) {
            return Err(Error::InvalidDataArgument {
                what: format!(
                    "row {r} of ragged column `{}` is empty: a row of no positions has no bucket \
                     and no weight in a token-averaged loss; drop empty rows",
                    columns[0].0
                ),
            });
        }
        let mut offsets = Vec::with_capacity(rows + 1);
        offsets.push(0);
        for r in first {
            offsets.push(offsets[offsets.len() - 1] + r.len());
        }
        let mut names = Vec::new();
        let mut values = Vec::new();
        for (name, col) in &columns {
            if *name == VALID || *name == super::MASK || names.iter().any(|n| n == name) {
                return Err(Error::InvalidDataArgument {
                    what: format!(
                        "the ragged column name `{name}` is taken (by another column, or by the \
                         `{VALID}` and `{}` columns batches add); rename it",
                        super::MASK
                    ),
                });
            }
            if col.len() != rows {
                return Err(Error::InvalidDataArgument {
                    what: format!(
                        "ragged column `{name}` has {} rows and `{}` has {rows}; give every \
                         column the same rows",
                        col.len(),
                        columns[0].0
                    ),
                });
            }
            if let Some(r) = (0..rows).find(|&r| col[r].len() != first[r].len()) {
                return Err(Error::InvalidDataArgument {
                    what: format!(
                        "row {r} is {} long in `{name}` and {} in `{}`; a row's length is the \
                         same in every column",
                        col[r].len(),
                        first[r].len(),
                        columns[0].0
                    ),
                });
            }
            names.push((*name).to_owned());
            values.push(col.iter().flatten().copied().collect());
        }
        Ok(Ragged {
            names,
            values,
            offsets,
        })
    }

    /// Next-token rows of `docs`: `x` is a document without its last id, `y` without its
    /// first (documents shorter than 2 ids are skipped).
    pub fn next_token(docs: &[Vec<i32>]) -> Result<Ragged> {
        let docs: Vec<&Vec<i32>> = docs.iter().filter(|d| d.len() >= 2).collect();
        let x = docs.iter().map(|d| d[..d.len() - 1].to_vec()).collect();
        let y = docs.iter().map(|d| d[1..].to_vec()).collect();
        Ragged::new(vec![("x", x), ("y", y)])
    }

    /// The number of rows.
    pub fn rows(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Every row's length.
    pub fn lengths(&self) -> Vec<usize> {
        self.offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// The column names.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Row `row` of column `column` (in [`names`](Ragged::names) order).
    pub fn row(&self, column: usize, row: usize) -> &[i32] {
        &self.values[column][self.offsets[row]..self.offsets[row + 1]]
    }

    /// Epoch `epoch`'s batches under `buckets`, as `(bucket, rows)`: the rows shuffled with
    /// `seed` (a fresh order per epoch), cut into windows of the policy's window, and within
    /// each window binned by bucket and cut into batches of `rows_for(edge)` rows. A bucket's
    /// rows left over at a window's end wait for the next window; at the epoch's end each
    /// bucket's remainder is one last, ragged batch. Every row appears exactly once.
    pub fn epoch_batches(
        &self,
        buckets: &Buckets,
        rows_for: impl Fn(usize) -> usize,
        seed: u64,
        epoch: u64,
    ) -> Result<Vec<(usize, Vec<usize>)>> {
        let lengths = self.lengths();
        let order = permutation(self.rows(), epoch_seed(seed, epoch));
        let mut pending: Vec<Vec<usize>> = vec![Vec::new(); buckets.edges.len()];
        let mut out = Vec::new();
        for window in order.chunks(buckets.window) {
            for &r in window {
                let b = buckets.bucket_of(lengths[r])?;
                pending[b].push(r);
                let want = rows_for(buckets.edges[b]).max(1);
                if pending[b].len() == want {
                    out.push((b, std::mem::take(&mut pending[b])));
                }
            }
        }
        for (b, rows) in pending.into_iter().enumerate() {
            if !rows.is_empty() {
                out.push((b, rows));
            }
        }
        Ok(out)
    }

    /// The batch of `rows` (at most `batch_size` of them) padded to `edge` positions and to
    /// `batch_size` rows (padding rows repeat the real ones, as [`super::Dataset::gather`]
    /// does): each column `i32 [batch_size, edge]` (padding positions hold the policy's pad
    /// id), then [`VALID`] `f32 [batch_size, edge]`; the batch's row mask marks the real rows.
    /// Also each row's weight — its real positions, 0 for padding rows — which is what a
    /// token-averaged loss divides by ([`crate::train::Nitro::step_weighted`]).
    pub fn gather(
        &self,
        rows: &[usize],
        edge: usize,
        batch_size: usize,
        buckets: &Buckets,
    ) -> Result<(Batch, Vec<f32>)> {
        let real = rows.len();
        if real == 0 || real > batch_size {
            return Err(Error::InvalidDataArgument {
                what: format!(
                    "a batch of size {batch_size} cannot hold {real} rows; gather between 1 and \
                     {batch_size} rows"
                ),
            });
        }
        if let Some(&r) = rows.iter().find(|&&r| r >= self.rows()) {
            return Err(Error::RowOutOfRange {
                row: r,
                rows: self.rows(),
            });
        }
        let lengths = self.lengths();
        let longest = rows.iter().map(|&r| lengths[r]).max().unwrap_or(0);
        if longest > edge && buckets.overflow == Overflow::Error {
            return Err(Error::InvalidDataArgument {
                what: format!(
                    "a row of length {longest} does not fit a batch padded to {edge}; gather \
                     rows of at most the bucket's edge (Ragged::epoch_batches bins them)"
                ),
            });
        }
        let mut columns = Vec::with_capacity(self.names.len() + 1);
        let mut valid = filled(batch_size, edge, 0.0f32)?;
        let mut weights = vec![0.0f32; batch_size];
        for (c, name) in self.names.iter().enumerate() {
            let mut ids = filled(batch_size, edge, buckets.pad)?;
            for i in 0..batch_size {
                let r = rows[i % real];
                let (s, e) = (self.offsets[r], self.offsets[r + 1]);
                let n = (e - s).min(edge);
                ids[i * edge..i * edge + n].copy_from_slice(&self.values[c][s..s + n]);
                if c == 0 {
                    valid[i * edge..i * edge + n].fill(1.0);
                    if i < real {
                        weights[i] = n as f32;
                    }
                }
            }
            columns.push((name.clone(), Array::from_vec(&[batch_size, edge], ids)?));
        }
        columns.push((
            VALID.to_owned(),
            Array::from_vec(&[batch_size, edge], valid)?,
        ));
        let mask: Vec<f32> = (0..batch_size)
            .map(|i| if i < real { 1.0 } else { 0.0 })
            .collect();
        let batch = Batch {
            columns,
            mask: Array::from_vec(&[batch_size], mask)?,
            real,
        };
        Ok((batch, weights))
    }

    /// A batch of this data set's columns of `batch_size` rows padded to `edge`, every
    /// position padding and every row real: the shape of a bucket's batches, for compiling its
    /// programs before any row of that length is met.
    ///
    /// A batch too large to hold (`batch_size × edge` past nitro's size limit, or more memory
    /// than there is) is [`Error::ShapeTooLarge`] or [`Error::OutOfMemory`], never an abort; so
    /// in [`gather`](Ragged::gather).
    pub fn blank(&self, edge: usize, batch_size: usize, buckets: &Buckets) -> Result<Batch> {
        let mut columns = Vec::with_capacity(self.names.len() + 1);
        for name in &self.names {
            columns.push((
                name.clone(),
                Array::try_full(&[batch_size, edge], buckets.pad)?,
            ));
        }
        columns.push((
            VALID.to_owned(),
            Array::try_full(&[batch_size, edge], 0.0f32)?,
        ));
        Ok(Batch {
            columns,
            mask: Array::try_full(&[batch_size], 1.0f32)?,
            real: batch_size,
        })
    }
}

/// A `[rows, edge]` column's elements, all `value`, reserved fallibly: a size past nitro's limit
/// is [`Error::ShapeTooLarge`], memory that cannot be had is [`Error::OutOfMemory`].
fn filled<T: crate::tree::Element>(rows: usize, edge: usize, value: T) -> Result<Vec<T>> {
    let n = crate::tree::checked_count(T::DTYPE, &[rows, edge])?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::OutOfMemory {
        what: format!("a batch column of {rows} rows padded to {edge}"),
        bytes: (n as u64).saturating_mul(T::DTYPE.size_bytes() as u64),
    })?;
    v.resize(n, value);
    Ok(v)
}
