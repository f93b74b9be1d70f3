//! The reference interpreter: runs a [`Graph`] on host [`Array`]s in pure Rust.
//!
//! It has two jobs:
//!
//! - **The semantic oracle.** Each op does what StableHLO specifies and XLA's CPU backend does
//!   (the catalog in `reference/stablehlo-ops/` gives concrete cases), written as plainly as
//!   possible, so tests can compare the XLA backend, the emitter and autodiff against it.
//! - **The fallback backend.** When no PJRT plugin is installed, programs run here: slower than
//!   XLA, but the same results (up to float rounding order) with no native dependency.
//!
//! [`run`] checks the inputs against the graph's signature first, then evaluates, in node order,
//! only the nodes some output needs, dropping each intermediate value after its last use.
//!
//! Semantics worth knowing, as in XLA unless noted:
//!
//! - Integer arithmetic wraps. Integer division truncates toward zero; `x / 0` is `-1` (all bits
//!   set, so `255` for `u8`) and `MIN / -1` is `MIN` (the StableHLO spec leaves both undefined).
//! - Integer `pow` squares repeatedly over every exponent bit, wrapping; a negative exponent
//!   gives `1` for base `1`, `±1` (by parity) for base `-1` and `0` otherwise. This is the
//!   StableHLO reference interpreter's rule; XLA's CPU emitter differs only in corners (it gives
//!   `0` for base `-1` with a negative exponent, and reads just the low 6 exponent bits).
//! - Float `maximum`/`minimum` propagate NaN and order `-0` below `+0`; comparisons are IEEE (NaN
//!   is unordered: only `!=` holds).
//! - `convert` from float to integer truncates toward zero and saturates at the type's bounds,
//!   with NaN giving 0 (so `-2.7 → -2`, `-1 → 0u8`, `300 → 255u8`); integer to integer keeps the
//!   low bits; to `bool` is `x != 0` (NaN gives `true`); `bool` to a number is 0 or 1.
//! - Reductions start from the init value (sum 0, max −∞ or the type's minimum, min +∞ or the
//!   type's maximum), so reducing an empty dim gives the init. Float sums add pairwise.
//! - `dot_general` accumulates in the element type (integers wrap).
//!
//! ```
//! use nitro::backend::interp;
//! use nitro::trace::trace;
//! use nitro::{Array, DType, LeafType};
//!
//! let x = LeafType { dtype: DType::F32, dims: vec![2, 2] };
//! let graph = trace(&[("x".into(), x)], |i| vec![(i[0] * 2.0).sum(&[1])])?;
//! let out = interp::run(&graph, &[Array::from_vec(&[2, 2], vec![1.0f32, 2.0, 3.0, 4.0])?])?;
//! assert_eq!(out[0].as_slice::<f32>()?, &[6.0, 14.0]);
//! # Ok::<(), nitro::Error>(())
//! ```

mod check;
mod kernels;
mod layout;

use std::borrow::Cow;

use crate::error::{Error, Result};
use crate::trace::ir::{Graph, Node, NodeId, Op};
use crate::tree::{Array, ArrayData};

use kernels::MatmulShape;

/// Runs `graph` on `inputs` (one array per graph input, in order) and returns its outputs in
/// order.
///
/// Errors: [`Error::InputCount`] when the number of inputs differs from the graph's;
/// [`Error::InputType`], naming the input, when one has another dtype or dims than declared —
/// both checked before anything is computed; [`Error::InvalidGraph`] when a node needed by an
/// output is malformed (never for a graph made by [`crate::trace::trace`]).
pub fn run(graph: &Graph, inputs: &[Array]) -> Result<Vec<Array>> {
    let refs: Vec<&Array> = inputs.iter().collect();
    run_refs(graph, &refs)
}

/// [`run`] on borrowed inputs (no copies of parameters that live elsewhere).
pub fn run_refs(graph: &Graph, inputs: &[&Array]) -> Result<Vec<Array>> {
    check_inputs(graph, inputs)?;

    let n = graph.nodes.len();
    // Ids must point backwards (or, for outputs, inside the graph) before liveness can follow them.
    let mut keep = vec![false; n];
    for &o in &graph.outputs {
        match keep.get_mut(o as usize) {
            Some(k) => *k = true,
            None => {
                return Err(Error::InvalidGraph {
                    node: o,
                    op: "output",
                    message: format!("it is an output, but the graph has only {n} nodes"),
                })
            }
        }
    }
    for (id, node) in graph.nodes.iter().enumerate() {
        if let Some(&bad) = node.inputs.iter().find(|&&i| i as usize >= id) {
            return Err(Error::InvalidGraph {
                node: id as NodeId,
                op: node.op.name(),
                message: format!("operand %{bad} does not precede it"),
            });
        }
    }
    let live = graph.live();
    // The last node that reads each value; values not kept are dropped after it.
    let mut last_use = vec![usize::MAX; n];
    for (id, node) in graph.nodes.iter().enumerate() {
        if live[id] {
            for &i in &node.inputs {
                if let Some(slot) = last_use.get_mut(i as usize) {
                    *slot = id;
                }
            }
        }
    }

    let mut values: Vec<Option<Cow<'_, Array>>> = (0..n).map(|_| None).collect();
    for (id, node) in graph.nodes.iter().enumerate() {
        if !live[id] {
            continue;
        }
        let invalid = |message: String| Error::InvalidGraph {
            node: id as NodeId,
            op: node.op.name(),
            message,
        };
        check::node(graph, id).map_err(invalid)?;
        let operands = node
            .inputs
            .iter()
            .map(|&i| values[i as usize].as_deref())
            .collect::<Option<Vec<&Array>>>()
            .ok_or_else(|| invalid("an operand was not computed before it".into()))?;
        let value = eval(node, &operands, inputs).map_err(invalid)?;
        if value.dims() != node.ty.dims.as_slice() || value.dtype() != node.ty.dtype {
            return Err(invalid(format!(
                "it computed {} but declares {}",
                value.leaf_type(),
                node.ty
            )));
        }
        for &i in &node.inputs {
            if last_use[i as usize] == id && !keep[i as usize] {
                values[i as usize] = None;
            }
        }
        values[id] = Some(value);
    }

    graph
        .outputs
        .iter()
        .map(|&o| {
            values[o as usize]
                .as_deref()
                .cloned()
                .ok_or_else(|| Error::InvalidGraph {
                    node: o,
                    op: "output",
                    message: "the output was not computed".into(),
                })
        })
        .collect()
}

/// Checks the input count, then each input's dtype and dims against the graph's declaration.
fn check_inputs(graph: &Graph, inputs: &[&Array]) -> Result<()> {
    if inputs.len() != graph.inputs.len() {
        return Err(Error::InputCount {
            expected: graph.inputs.len(),
            got: inputs.len(),
        });
    }
    for (index, (decl, given)) in graph.inputs.iter().zip(inputs).enumerate() {
        if given.dtype() != decl.ty.dtype || given.dims() != decl.ty.dims.as_slice() {
            return Err(Error::InputType {
                index,
                name: decl.name.clone(),
                expected: decl.ty.clone(),
                got: given.leaf_type(),
            });
        }
    }
    Ok(())
}

/// An array of the node's declared dims holding `data`.
fn array(node: &Node, data: ArrayData) -> std::result::Result<Array, String> {
    Array::from_data(&node.ty.dims, data).map_err(|e| e.to_string())
}

/// Evaluates one checked node on its operands' values.
fn eval<'a>(
    node: &'a Node,
    operands: &[&Array],
    inputs: &[&'a Array],
) -> std::result::Result<Cow<'a, Array>, String> {
    let out_dims = node.ty.dims.as_slice();
    let owned = |data: ArrayData| array(node, data).map(Cow::Owned);
    match &node.op {
        Op::Parameter { index } => inputs
            .get(*index)
            .map(|a| Cow::Borrowed(*a))
            .ok_or_else(|| format!("there is no input {index}")),
        Op::Constant(a) => Ok(Cow::Borrowed(&**a)),
        Op::Iota { axis } => {
            let data = layout::iota(node.ty.dtype, out_dims, *axis)
                .ok_or_else(|| format!("iota is not defined for {}", node.ty.dtype))?;
            owned(data)
        }
        Op::Unary(u) => owned(kernels::unary(*u, operands[0].data())?),
        Op::Binary(b) => owned(kernels::binary(*b, operands[0].data(), operands[1].data())?),
        Op::Compare(c) => owned(kernels::compare(
            *c,
            operands[0].data(),
            operands[1].data(),
        )?),
        Op::Select => owned(kernels::select(
            operands[0].data(),
            operands[1].data(),
            operands[2].data(),
        )?),
        Op::Convert => owned(kernels::convert(operands[0].data(), node.ty.dtype)),
        Op::BroadcastInDim { dims } => {
            let a = operands[0];
            owned(layout::broadcast(a.data(), a.dims(), out_dims, dims))
        }
        Op::Reshape => owned(operands[0].data().clone()),
        Op::Transpose { perm } => {
            let a = operands[0];
            owned(layout::transpose(a.data(), a.dims(), perm))
        }
        Op::Slice { start, strides, .. } => {
            let a = operands[0];
            owned(layout::slice(a.data(), a.dims(), start, strides, out_dims))
        }
        Op::Concatenate { axis } => {
            let data = layout::concatenate(operands, *axis, node.ty.dtype)
                .ok_or_else(|| "its operands have different dtypes".to_owned())?;
            owned(data)
        }
        Op::DotGeneral(d) => {
            let (l, r) = (operands[0], operands[1]);
            let free = |rank: usize, batch: &[usize], contract: &[usize]| -> Vec<usize> {
                (0..rank)
                    .filter(|i| !batch.contains(i) && !contract.contains(i))
                    .collect()
            };
            let l_free = free(l.rank(), &d.lhs_batch, &d.lhs_contract);
            let r_free = free(r.rank(), &d.rhs_batch, &d.rhs_contract);
            let size =
                |a: &Array, axes: &[usize]| axes.iter().map(|&i| a.dims()[i]).product::<usize>();
            let shape = MatmulShape {
                b: size(l, &d.lhs_batch),
                m: size(l, &l_free),
                k: size(l, &d.lhs_contract),
                n: size(r, &r_free),
            };
            // Lay the lhs out as [batch, free, contract] and the rhs as [batch, contract, free];
            // the batched product is then [batch, lhs free, rhs free], the result's order.
            let l_perm: Vec<usize> = [&d.lhs_batch[..], &l_free, &d.lhs_contract].concat();
            let r_perm: Vec<usize> = [&d.rhs_batch[..], &d.rhs_contract, &r_free].concat();
            let lt = permuted(l, &l_perm);
            let rt = permuted(r, &r_perm);
            owned(kernels::batched_matmul(&lt, &rt, shape)?)
        }
        Op::Reduce { kind, axes } => {
            let a = operands[0];
            owned(kernels::reduce(*kind, a.data(), a.dims(), axes))
        }
    }
}

/// The array's storage with its dims permuted, borrowed when `perm` is the identity.
fn permuted<'a>(a: &'a Array, perm: &[usize]) -> Cow<'a, ArrayData> {
    if layout::is_identity(perm) {
        Cow::Borrowed(a.data())
    } else {
        Cow::Owned(layout::transpose(a.data(), a.dims(), perm))
    }
}
