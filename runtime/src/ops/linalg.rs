//! Products: `dot_general` (batch and contracting dims in any positions) and `matmul` on top,
//! with an f32 result for half-precision operands (`matmul_to`, `dot_general_to`: mixed
//! precision, JAX's `preferred_element_type`).
//!
//! The result's dims are the batch dims (in `lhs_batch` order), then the lhs free dims, then the
//! rhs free dims. VJP: the cotangent contracted with the other operand over that operand's free
//! dims, transposed into this operand's layout; with mixed precision the cotangent is rounded to
//! the operands' dtype, multiplied in it and accumulated in the result's dtype, then rounded back.
//! Emitted with `precision = [HIGHEST, HIGHEST]`: without it XLA on a GPU multiplies f32 in TF32.
//! The interpreter lays the operands out as `[batch, m, k]` and `[batch, k, n]` and multiplies in
//! the element type (integers wrap).

use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::panic::Location;

use crate::emit::line::{self as emit, Line};
use crate::ops::elementwise::kernels::{mismatch, Float, Int};
use crate::ops::elementwise::tracing::check_axes;
use crate::ops::host::alloc::filled;
use crate::ops::host::layout;
use crate::ops::host::Fault;
use crate::trace::ir::{with_dims, DotDims, Op};
use crate::trace::record::{with_recording, Recording, Tensor};
use crate::tree::{Array, ArrayData, DType, LeafType};

// ---- types ---------------------------------------------------------------------------------

/// Whether a product of `operands` may give `result` elements: the operands' own dtype, or
/// `f32` for half-precision operands (accumulated in f32).
pub fn product_dtype_ok(operands: DType, result: DType) -> bool {
    result == operands || (operands.is_half() && result == DType::F32)
}

/// The result type of a `dot_general` of `l` and `r`, or what is wrong.
pub(crate) fn dot_type(l: &LeafType, r: &LeafType, d: &DotDims) -> Result<LeafType, String> {
    same_dtype(l, r)?;
    if l.dtype == DType::Bool {
        return Err("it is not defined for bool".into());
    }
    if let Some(msg) = dims_error(l, r, d) {
        return Err(msg);
    }
    let lhs_all: Vec<usize> = d.lhs_batch.iter().chain(&d.lhs_contract).copied().collect();
    let rhs_all: Vec<usize> = d.rhs_batch.iter().chain(&d.rhs_contract).copied().collect();
    let pairs = d
        .lhs_batch
        .iter()
        .zip(&d.rhs_batch)
        .chain(d.lhs_contract.iter().zip(&d.rhs_contract));
    for (&a, &b) in pairs {
        if l.dims[a] != r.dims[b] {
            return Err(format!("lhs dim {a} of {l} and rhs dim {b} of {r} differ"));
        }
    }
    let mut dims: Vec<usize> = d.lhs_batch.iter().map(|&i| l.dims[i]).collect();
    dims.extend(
        (0..l.dims.len())
            .filter(|i| !lhs_all.contains(i))
            .map(|i| l.dims[i]),
    );
    dims.extend(
        (0..r.dims.len())
            .filter(|i| !rhs_all.contains(i))
            .map(|i| r.dims[i]),
    );
    Ok(LeafType {
        dtype: l.dtype,
        dims,
    })
}

/// What is wrong with the dimension numbers `d` of a product of `l` and `r`, if anything: each
/// side's batch and contracting dims must be distinct dims of that side (one role each), and the
/// two sides must pair up (StableHLO's `dot_general` C1–C8). The paired sizes are checked apart.
fn dims_error(l: &LeafType, r: &LeafType, d: &DotDims) -> Option<String> {
    let sides = [
        ("lhs", l, &d.lhs_batch, &d.lhs_contract),
        ("rhs", r, &d.rhs_batch, &d.rhs_contract),
    ];
    for (side, t, batch, contract) in sides {
        let all: Vec<usize> = batch.iter().chain(contract).copied().collect();
        if let Err(msg) = check_axes(t.dims.len(), &all) {
            return Some(format!(
                "the {side} batch dims {batch:?} and contracting dims {contract:?} of {t}: \
                 {msg}; each dim of an operand is a batch dim, a contracting dim or neither \
                 (dimension numbers {d:?})"
            ));
        }
    }
    let pairs = [
        ("batch", &d.lhs_batch, &d.rhs_batch),
        ("contracting", &d.lhs_contract, &d.rhs_contract),
    ];
    for (what, a, b) in pairs {
        if a.len() != b.len() {
            return Some(format!(
                "the lhs {what} dims {a:?} and the rhs {what} dims {b:?} must pair up, one for \
                 one ({l} and {r})"
            ));
        }
    }
    None
}

fn same_dtype(a: &LeafType, b: &LeafType) -> Result<(), String> {
    if a.dtype == b.dtype {
        Ok(())
    } else {
        Err(format!(
            "its operands must have one dtype, but are {a} and {b}"
        ))
    }
}

// ---- tracing -------------------------------------------------------------------------------

impl Recording {
    pub(crate) fn dot_general(
        &mut self,
        a: Tensor,
        b: Tensor,
        d: DotDims,
        result: Option<DType>,
        op: &'static str,
        at: &Location<'_>,
    ) -> Tensor {
        let (ta, tb) = (self.ty_of(a), self.ty_of(b));
        let guess = with_dims(result.unwrap_or(ta.dtype), Vec::new());
        let result = result.unwrap_or(ta.dtype);
        if !product_dtype_ok(ta.dtype, result) {
            return self.fail(
                op,
                format!(
                    "a product of {ta} and {tb} cannot give {result} elements: products give \
                     their operands' dtype, or f32 for bf16/f16 operands (accumulated in f32)"
                ),
                at,
                guess,
            );
        }
        if ta.dtype != tb.dtype {
            return self.fail(
                op,
                format!("operands have different dtypes ({ta} and {tb})"),
                at,
                guess,
            );
        }
        if ta.dtype == DType::Bool {
            return self.fail(
                op,
                format!("cannot multiply bool tensors ({ta} and {tb})"),
                at,
                guess,
            );
        }
        let (ra, rb) = (ta.dims.len(), tb.dims.len());
        if let Some(msg) = dims_error(&ta, &tb, &d) {
            return self.fail(op, msg, at, guess);
        }
        let lhs_all: Vec<usize> = d.lhs_batch.iter().chain(&d.lhs_contract).copied().collect();
        let rhs_all: Vec<usize> = d.rhs_batch.iter().chain(&d.rhs_contract).copied().collect();
        for (&l, &r) in d.lhs_batch.iter().zip(&d.rhs_batch) {
            if ta.dims[l] != tb.dims[r] {
                return self.fail(
                    op,
                    format!(
                        "batch dims differ: {ta} dim {l} is {} but {tb} dim {r} is {}",
                        ta.dims[l], tb.dims[r]
                    ),
                    at,
                    guess,
                );
            }
        }
        for (&l, &r) in d.lhs_contract.iter().zip(&d.rhs_contract) {
            if ta.dims[l] != tb.dims[r] {
                return self.fail(
                    op,
                    format!(
                        "cannot multiply {ta} by {tb}: contracting dims differ (lhs dim {l} is {}, rhs dim {r} is {})",
                        ta.dims[l], tb.dims[r]
                    ),
                    at,
                    guess,
                );
            }
        }
        let mut dims: Vec<usize> = d.lhs_batch.iter().map(|&i| ta.dims[i]).collect();
        dims.extend((0..ra).filter(|i| !lhs_all.contains(i)).map(|i| ta.dims[i]));
        dims.extend((0..rb).filter(|i| !rhs_all.contains(i)).map(|i| tb.dims[i]));
        self.push(
            Op::DotGeneral(d),
            vec![a.node, b.node],
            with_dims(result, dims),
            op,
            at,
        )
    }
}

impl Tensor {
    /// Matrix product, as NumPy's and JAX's `matmul`: `[m, k] · [k, n] → [m, n]`; a rank-1
    /// operand is a vector (`[k] · [k, n] → [n]`, `[m, k] · [k] → [m]`); a matrix on the right
    /// multiplies the last dim of anything (`[b, t, k] · [k, n] → [b, t, n]`, a dense layer on a
    /// sequence: one product XLA runs as `[b·t, k] · [k, n]`, the fastest form); otherwise the
    /// leading dims are batches, broadcast against each other (`[b, 1, m, k] · [h, k, n] →
    /// [b, h, m, n]`; broadcasting copies the smaller operand first).
    #[track_caller]
    pub fn matmul(self, rhs: Tensor) -> Tensor {
        self.matmul_impl(rhs, None, Location::caller())
    }
    /// [`Tensor::matmul`] giving `dtype` elements: `f32` for `bf16`/`f16` operands multiplies
    /// in half precision and accumulates in f32 (mixed precision), as JAX's
    /// `preferred_element_type`.
    #[track_caller]
    pub fn matmul_to(self, rhs: Tensor, dtype: DType) -> Tensor {
        self.matmul_impl(rhs, Some(dtype), Location::caller())
    }
    fn matmul_impl(self, rhs: Tensor, result: Option<DType>, at: &Location<'_>) -> Tensor {
        with_recording(|r| {
            if !r.owns(self, "matmul", at) || !r.owns(rhs, "matmul", at) {
                return r.stand_in(with_dims(DType::F32, Vec::new()));
            }
            let (ta, tb) = (r.ty_of(self), r.ty_of(rhs));
            let (ra, rb) = (ta.dims.len(), tb.dims.len());
            let guess = with_dims(ta.dtype, Vec::new());
            if ra == 0 || rb == 0 {
                return r.fail(
                    "matmul",
                    format!(
                        "cannot multiply {ta} by {tb}: matmul needs operands of rank 1 or more"
                    ),
                    at,
                    guess,
                );
            }
            let k_l = ta.dims[ra - 1];
            let k_r = if rb == 1 { tb.dims[0] } else { tb.dims[rb - 2] };
            if k_l != k_r {
                return r.fail(
                    "matmul",
                    format!(
                        "cannot multiply {ta} by {tb}: the lhs has {k_l} columns but the rhs has {k_r} rows"
                    ),
                    at,
                    guess,
                );
            }
            let contract = |l: usize, rr: usize| DotDims {
                lhs_batch: vec![],
                rhs_batch: vec![],
                lhs_contract: vec![l],
                rhs_contract: vec![rr],
            };
            match (ra, rb) {
                // A vector or a matrix on the right, anything on the left: one plain contraction
                // of the lhs's last dim (`[b, t, k] · [k, n] → [b, t, n]`), which XLA runs as a
                // single `[b·t, k] · [k, n]` product — the fastest form for dense layers.
                (_, 1) | (_, 2) => {
                    r.dot_general(self, rhs, contract(ra - 1, 0), result, "matmul", at)
                }
                // A vector on the left: `[k] · [b, k, n] → [b, n]`.
                (1, _) => r.dot_general(self, rhs, contract(0, rb - 2), result, "matmul", at),
                // A matrix on the left of a batch: the product is `[m, batch…, n]`, then the batch
                // moves to the front.
                (2, _) => {
                    let p = r.dot_general(self, rhs, contract(1, rb - 2), result, "matmul", at);
                    let nb = rb - 2;
                    let perm: Vec<usize> = (1..=nb).chain([0, nb + 1]).collect();
                    r.transpose(p, &perm, at)
                }
                // Batches on both sides, broadcast against each other as NumPy does.
                (a, b) => {
                    let (lb, rbd) = (&ta.dims[..a - 2], &tb.dims[..b - 2]);
                    let Some(batch) = crate::ops::elementwise::tracing::broadcast_dims(lb, rbd)
                    else {
                        return r.fail(
                            "matmul",
                            format!(
                                "cannot multiply {ta} by {tb}: the batch dims {lb:?} and {rbd:?} do not broadcast (aligned from the right, each pair must be equal or 1)"
                            ),
                            at,
                            guess,
                        );
                    };
                    let full = |tail: &[usize]| -> Vec<usize> {
                        batch.iter().chain(tail).copied().collect()
                    };
                    let l = r.broadcast_to(self, &full(&ta.dims[a - 2..]), "matmul", at);
                    let rr = r.broadcast_to(rhs, &full(&tb.dims[b - 2..]), "matmul", at);
                    let n = batch.len();
                    let d = DotDims {
                        lhs_batch: (0..n).collect(),
                        rhs_batch: (0..n).collect(),
                        lhs_contract: vec![n + 1],
                        rhs_contract: vec![n],
                    };
                    r.dot_general(l, rr, d, result, "matmul", at)
                }
            }
        })
    }

    /// A general product with explicit batch and contracting dims (see [`DotDims`]).
    #[track_caller]
    pub fn dot_general(self, rhs: Tensor, dims: DotDims) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.dot_general(self, rhs, dims, None, "dot_general", at))
    }
    /// [`Tensor::dot_general`] giving `dtype` elements (`f32` for `bf16`/`f16` operands:
    /// accumulated in f32).
    #[track_caller]
    pub fn dot_general_to(self, rhs: Tensor, dims: DotDims, dtype: DType) -> Tensor {
        let at = Location::caller();
        with_recording(|r| r.dot_general(self, rhs, dims, Some(dtype), "dot_general", at))
    }
}

// ---- gradients -----------------------------------------------------------------------------

/// The VJP of a `dot_general` of `x[0]` and `x[1]` with result dtype `acc`.
pub(crate) fn vjp(d: &DotDims, acc: DType, x: &[Tensor], g: Tensor) -> Vec<Option<Tensor>> {
    let (ta, tb) = (x[0].ty(), x[1].ty());
    let (ra, rb) = (ta.dims.len(), tb.dims.len());
    // Mixed precision (half operands, an f32 result): the cotangent is rounded to the
    // operands' dtype, multiplied in it and accumulated in f32, then rounded back.
    let g = g.convert(ta.dtype);
    vec![
        Some(dot_vjp(g, x[1], d, ra, rb, Side::Lhs, acc).convert(ta.dtype)),
        Some(dot_vjp(g, x[0], d, ra, rb, Side::Rhs, acc).convert(tb.dtype)),
    ]
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Lhs,
    Rhs,
}

/// The gradient of `dot_general` for one side: contract `g` with the other operand over the
/// other side's free dims, then transpose into this side's layout.
fn dot_vjp(
    g: Tensor,
    other: Tensor,
    d: &DotDims,
    ra: usize,
    rb: usize,
    side: Side,
    acc: DType,
) -> Tensor {
    let free = |rank: usize, batch: &[usize], contract: &[usize]| -> Vec<usize> {
        (0..rank)
            .filter(|i| !batch.contains(i) && !contract.contains(i))
            .collect()
    };
    let lhs_free = free(ra, &d.lhs_batch, &d.lhs_contract);
    let rhs_free = free(rb, &d.rhs_batch, &d.rhs_contract);
    let nb = d.lhs_batch.len();
    let (
        mine_rank,
        my_batch,
        my_contract,
        my_free,
        other_batch,
        other_contract,
        other_free,
        g_other_free_at,
    ) = match side {
        Side::Lhs => (
            ra,
            &d.lhs_batch,
            &d.lhs_contract,
            &lhs_free,
            &d.rhs_batch,
            &d.rhs_contract,
            &rhs_free,
            nb + lhs_free.len(),
        ),
        Side::Rhs => (
            rb,
            &d.rhs_batch,
            &d.rhs_contract,
            &rhs_free,
            &d.lhs_batch,
            &d.lhs_contract,
            &lhs_free,
            nb,
        ),
    };
    let dims = DotDims {
        lhs_batch: (0..nb).collect(),
        rhs_batch: other_batch.clone(),
        lhs_contract: (g_other_free_at..g_other_free_at + other_free.len()).collect(),
        rhs_contract: other_free.clone(),
    };
    // Result layout: [batch | g's free dims (= my free dims) | other's remaining dims
    // (= other's contracting dims, ascending)].
    let res = g.dot_general_to(other, dims, acc);
    let mut sorted_other_contract = other_contract.clone();
    sorted_other_contract.sort_unstable();
    let mut perm = vec![0; mine_rank];
    for (k, &b) in my_batch.iter().enumerate() {
        perm[b] = k;
    }
    for (j, &f) in my_free.iter().enumerate() {
        perm[f] = nb + j;
    }
    for (c, &mine) in my_contract.iter().enumerate() {
        let partner = other_contract[c];
        let rank = sorted_other_contract
            .iter()
            .position(|&o| o == partner)
            .unwrap_or(0);
        perm[mine] = nb + my_free.len() + rank;
    }
    if perm.iter().enumerate().all(|(i, &p)| i == p) {
        res
    } else {
        res.transpose(&perm)
    }
}

// ---- emission ------------------------------------------------------------------------------

/// `stablehlo.dot_general`, at full precision. With
/// [`EmitOptions::widen_half_dots`](crate::emit::EmitOptions::widen_half_dots) (a CPU plugin),
/// half-precision operands are widened to f32 first (exactly), multiplied in f32 and the
/// product rounded back to the result's dtype: the numbers of a half-precision product
/// accumulated in f32, which is what a GPU's half dot computes, and what XLA's CPU compiler
/// runs fast — asked for a half-precision dot it takes a path about 20 times slower than its
/// f32 one (measured on chargpt in bf16, `bench/README.md`).
pub(crate) fn emit(mut l: Line<'_>, dims: &DotDims) -> fmt::Result {
    let DotDims {
        lhs_batch,
        rhs_batch,
        lhs_contract,
        rhs_contract,
    } = dims;
    let w = Widened::write(&mut l)?;
    let (args, arg_tys, ty, me) = (&w.args, &w.arg_tys, &w.ty, &w.me);
    write!(
        l.out,
        "    {me} = stablehlo.dot_general {}, {}, ",
        args[0], args[1]
    )?;
    if !lhs_batch.is_empty() || !rhs_batch.is_empty() {
        write!(
            l.out,
            "batching_dims = {} x {}, ",
            emit::list(lhs_batch),
            emit::list(rhs_batch)
        )?;
    }
    // Full precision: without it XLA on a GPU computes f32 products in TF32 (a 10-bit
    // mantissa), and results leave the interpreter's by about 1e-3.
    writeln!(
        l.out,
        "contracting_dims = {} x {}, precision = [HIGHEST, HIGHEST] : ({}, {}) -> {}",
        emit::list(lhs_contract),
        emit::list(rhs_contract),
        arg_tys[0],
        arg_tys[1],
        ty
    )?;
    w.narrow(l)
}

/// The operands and result of a dot or convolution as emitted: with
/// [`EmitOptions::widen_half_dots`](crate::emit::EmitOptions::widen_half_dots) and two
/// half-precision operands, their exact f32 widenings (written by [`Widened::write`]) and an
/// f32 result under a name of its own, which [`Widened::narrow`] rounds back into the node;
/// otherwise the node's own names and types.
pub(crate) struct Widened {
    /// The operands' names.
    pub(crate) args: Vec<String>,
    /// The operands' types.
    pub(crate) arg_tys: Vec<String>,
    /// The result's type.
    pub(crate) ty: String,
    /// The result's name.
    pub(crate) me: String,
    /// The node's own result type, when the result is rounded back to it.
    narrow_to: Option<String>,
}

impl Widened {
    /// Writes the widening converts, if any, and says what to emit the op over.
    pub(crate) fn write(l: &mut Line<'_>) -> Result<Widened, fmt::Error> {
        let widen = emit::widens_half_dots()
            && l.arg_types.len() == 2
            && l.arg_types.iter().all(|t| t.dtype.is_half());
        if !widen {
            return Ok(Widened {
                args: l.args.clone(),
                arg_tys: l.arg_tys.clone(),
                ty: l.ty.clone(),
                me: l.me.clone(),
                narrow_to: None,
            });
        }
        // A tensor type with its element type replaced by f32 (`tensor<2x3xbf16>` → `…xf32>`).
        let as_f32 = |ty: &str| {
            let cut = ty.rfind(['x', '<']).map_or(0, |i| i + 1);
            format!("{}f32>", &ty[..cut])
        };
        let mut args = Vec::new();
        for (i, (a, t)) in l.args.iter().zip(&l.arg_tys).enumerate() {
            let name = format!("%widened{}_{i}", l.n);
            writeln!(
                l.out,
                "    {name} = stablehlo.convert {a} : ({t}) -> {}",
                as_f32(t)
            )?;
            args.push(name);
        }
        // The result goes straight into the node when it is f32 already (an f32
        // `preferred_element_type`), else under its own name, rounded back by `narrow`.
        let ty = as_f32(&l.ty);
        let narrow_to = (ty != l.ty).then(|| l.ty.clone());
        Ok(Widened {
            args,
            arg_tys: l.arg_tys.iter().map(|t| as_f32(t)).collect(),
            me: match narrow_to {
                Some(_) => format!("%widened{}", l.n),
                None => l.me.clone(),
            },
            ty,
            narrow_to,
        })
    }

    /// Rounds a widened result back into the node (nothing otherwise).
    pub(crate) fn narrow(&self, l: Line<'_>) -> fmt::Result {
        match &self.narrow_to {
            Some(node_ty) => writeln!(
                l.out,
                "    {} = stablehlo.convert {} : ({}) -> {node_ty}",
                l.me, self.me, self.ty
            ),
            None => Ok(()),
        }
    }
}

// ---- interpreter ---------------------------------------------------------------------------

/// A `dot_general` on the host.
pub(crate) fn eval(d: &DotDims, operands: &[&Array]) -> Result<ArrayData, Fault> {
    let (l, r) = (operands[0], operands[1]);
    let free = |rank: usize, batch: &[usize], contract: &[usize]| -> Vec<usize> {
        (0..rank)
            .filter(|i| !batch.contains(i) && !contract.contains(i))
            .collect()
    };
    let l_free = free(l.rank(), &d.lhs_batch, &d.lhs_contract);
    let r_free = free(r.rank(), &d.rhs_batch, &d.rhs_contract);
    // Sub-products of a checked type's dims: they cannot overflow.
    let size = |a: &Array, axes: &[usize]| {
        axes.iter()
            .map(|&i| a.dims()[i])
            .fold(1usize, usize::saturating_mul)
    };
    let shape = MatmulShape {
        b: size(l, &d.lhs_batch),
        m: size(l, &l_free),
        k: size(l, &d.lhs_contract),
        n: size(r, &r_free),
    };
    // Lay the lhs out as [batch, free, contract] and the rhs as [batch, contract, free]; the
    // batched product is then [batch, lhs free, rhs free], the result's order.
    let l_perm: Vec<usize> = [&d.lhs_batch[..], &l_free, &d.lhs_contract].concat();
    let r_perm: Vec<usize> = [&d.rhs_batch[..], &d.rhs_contract, &r_free].concat();
    let lt = permuted(l, &l_perm)?;
    let rt = permuted(r, &r_perm)?;
    batched_matmul(&lt, &rt, shape)
}

/// The array's storage with its dims permuted, borrowed when `perm` is the identity.
fn permuted<'a>(a: &'a Array, perm: &[usize]) -> std::result::Result<Cow<'a, ArrayData>, Fault> {
    Ok(if layout::is_identity(perm) {
        Cow::Borrowed(a.data())
    } else {
        Cow::Owned(layout::transpose(a.data(), a.dims(), perm)?)
    })
}

/// The shape of a batched product after the operands are laid out as `[B, M, K]` and `[B, K, N]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatmulShape {
    /// Batch size.
    pub(crate) b: usize,
    /// Rows of each lhs matrix.
    pub(crate) m: usize,
    /// The contracted length.
    pub(crate) k: usize,
    /// Columns of each rhs matrix.
    pub(crate) n: usize,
}

/// `out[b] = lhs[b] · rhs[b]` for row-major `[B, M, K]` and `[B, K, N]`, in i-k-j order (the
/// inner loop runs along contiguous rows of `rhs` and `out`).
fn matmul<T: Copy>(
    lhs: &[T],
    rhs: &[T],
    s: MatmulShape,
    zero: T,
    mul_add: impl Fn(T, T, T) -> T,
) -> Result<Vec<T>, Fault> {
    let MatmulShape { b, m, k, n } = s;
    let len = b
        .checked_mul(m)
        .and_then(|x| x.checked_mul(n))
        .ok_or_else(|| Fault::from(format!("the product shape {s:?} overflows")))?;
    let mut out = filled(len, zero)?;
    if out.is_empty() || k == 0 {
        return Ok(out);
    }
    for (bi, out_b) in out.chunks_exact_mut(m * n).enumerate() {
        let l = &lhs[bi * m * k..(bi + 1) * m * k];
        let r = &rhs[bi * k * n..(bi + 1) * k * n];
        for (out_row, l_row) in out_b.chunks_exact_mut(n).zip(l.chunks_exact(k)) {
            for (&a, r_row) in l_row.iter().zip(r.chunks_exact(n)) {
                for (o, &x) in out_row.iter_mut().zip(r_row) {
                    *o = mul_add(*o, a, x);
                }
            }
        }
    }
    Ok(out)
}

/// The batched product of storage already laid out as `[B, M, K]` and `[B, K, N]`; the result is
/// `[B, M, N]`. Float products accumulate in the element type, integer ones wrap.
pub(crate) fn batched_matmul(
    lhs: &ArrayData,
    rhs: &ArrayData,
    s: MatmulShape,
) -> Result<ArrayData, Fault> {
    Ok(match (lhs, rhs) {
        (ArrayData::F32(x), ArrayData::F32(y)) => {
            ArrayData::F32(matmul(x, y, s, 0.0, <f32 as Float>::mac)?)
        }
        (ArrayData::F64(x), ArrayData::F64(y)) => {
            ArrayData::F64(matmul(x, y, s, 0.0, <f64 as Float>::mac)?)
        }
        (ArrayData::I32(x), ArrayData::I32(y)) => {
            ArrayData::I32(matmul(x, y, s, 0, <i32 as Int>::mac)?)
        }
        (ArrayData::I64(x), ArrayData::I64(y)) => {
            ArrayData::I64(matmul(x, y, s, 0, <i64 as Int>::mac)?)
        }
        (ArrayData::U8(x), ArrayData::U8(y)) => {
            ArrayData::U8(matmul(x, y, s, 0, <u8 as Int>::mac)?)
        }
        (ArrayData::U32(x), ArrayData::U32(y)) => {
            ArrayData::U32(matmul(x, y, s, 0, <u32 as Int>::mac)?)
        }
        (ArrayData::Bool(_), ArrayData::Bool(_)) => {
            return Err(Fault::from(
                "dot_general is not defined for bool".to_owned(),
            ))
        }
        _ => return Err(mismatch(lhs, rhs)),
    })
}
