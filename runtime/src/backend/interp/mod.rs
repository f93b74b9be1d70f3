//! The reference interpreter: runs a [`Graph`] on host [`Array`]s in pure Rust.
//!
//! It has two jobs:
//!
//! - **The semantic oracle.** Each op does what StableHLO specifies and XLA's CPU backend does
//!   (a StableHLO op catalog kept outside this repository gave concrete cases), written as
//!   plainly as possible, so tests can compare the XLA backend, the emitter and autodiff against it.
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
//! - Float max/min reductions propagate NaN (a group holding NaN gives NaN), as NumPy and JAX
//!   do; the emitter spells the same rule out for XLA, whose CPU backend would drop the NaN.
//!
//! Every buffer is allocated fallibly (`try_reserve`): a value too large for the memory at hand
//! fails the run with [`Error::OutOfMemory`], naming the node, instead of aborting the process.
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

use std::borrow::Cow;
use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ops::elementwise::kernels;
use crate::ops::host::{copy_data, Fault};
use crate::trace::ir::{Graph, Node, NodeId, Op, ScanOp, WhileOp};
use crate::tree::{Array, ArrayData, DType};

/// Runs `graph` on `inputs` (one array per graph input, in order) and returns its outputs in
/// order.
///
/// Errors: [`Error::InputCount`] when the number of inputs differs from the graph's;
/// [`Error::InputType`], naming the input, when one has another dtype or dims than declared —
/// both checked before anything is computed; [`Error::InvalidGraph`] when a node needed by an
/// output is malformed (never for a graph made by [`crate::trace::trace`]);
/// [`Error::OutOfMemory`], naming the node, when a value cannot be allocated.
pub fn run(graph: &Graph, inputs: &[Array]) -> Result<Vec<Array>> {
    let refs: Vec<&Array> = inputs.iter().collect();
    run_refs(graph, &refs)
}

/// [`run`] on borrowed inputs (no copies of parameters that live elsewhere).
pub fn run_refs(graph: &Graph, inputs: &[&Array]) -> Result<Vec<Array>> {
    let mut outputs = run_replicas(graph, &[inputs])?;
    Ok(outputs.pop().unwrap_or_default())
}

/// Runs a replicated program ([`Graph::replicas`]): one input list per replica, one output list
/// per replica back. The replicas advance in lockstep, node by node; an
/// [`Op::AllReduce`] adds the replicas' values in replica order
/// (0, 1, 2, …), so a run is deterministic and every replica gets bit-identical sums.
///
/// Errors: those of [`run`], for any replica; [`Error::ReplicaCount`] when the number of input
/// lists is not the program's replica count.
pub fn run_replicas(graph: &Graph, inputs: &[&[&Array]]) -> Result<Vec<Vec<Array>>> {
    if inputs.len() != graph.replicas.max(1) {
        return Err(Error::ReplicaCount {
            expected: graph.replicas.max(1),
            got: inputs.len(),
        });
    }
    for replica in inputs {
        check_inputs(graph, replica)?;
    }

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

    // Every replica's values, indexed by node id.
    let mut values: Vec<Vec<Option<Cow<'_, Array>>>> = inputs
        .iter()
        .map(|_| (0..n).map(|_| None).collect())
        .collect();
    // Every replica's scan results not yet read, by scan node.
    let mut parts: Vec<HashMap<usize, Vec<Array>>> =
        inputs.iter().map(|_| HashMap::new()).collect();
    for (id, node) in graph.nodes.iter().enumerate() {
        if !live[id] {
            continue;
        }
        let invalid = |message: String| Error::InvalidGraph {
            node: id as NodeId,
            op: node.op.name(),
            message,
        };
        let fault = |f: Fault| match f {
            Fault::Invalid(message) => invalid(message),
            Fault::Alloc { bytes } => Error::OutOfMemory {
                what: format!(
                    "the value of node %{id} (`{}`, {}) in the interpreter",
                    node.op.name(),
                    node.ty
                ),
                bytes,
            },
        };
        check::node(graph, id).map_err(invalid)?;
        match &node.op {
            Op::Scan(_) | Op::While(_) => {
                // Its results wait in `parts` for the `result` nodes that read them.
                for (replica, (values, replica_parts)) in
                    values.iter_mut().zip(&mut parts).enumerate()
                {
                    let operands = node
                        .inputs
                        .iter()
                        .map(|&i| values[i as usize].as_deref())
                        .collect::<Option<Vec<&Array>>>()
                        .ok_or_else(|| invalid("an operand was not computed before it".into()))?;
                    let replicated = inputs.len() > 1;
                    let results = match &node.op {
                        Op::Scan(op) => run_scan(op, &operands, replicated, replica)?,
                        Op::While(op) => run_while(op, &operands, replicated)?,
                        _ => unreachable!("matched above"),
                    };
                    replica_parts.insert(id, results);
                    for &i in &node.inputs {
                        if last_use[i as usize] == id && !keep[i as usize] {
                            values[i as usize] = None;
                        }
                    }
                }
                continue;
            }
            Op::Result { index } => {
                let scan = node.inputs[0] as usize;
                for (values, replica_parts) in values.iter_mut().zip(&mut parts) {
                    let result = replica_parts
                        .get(&scan)
                        .and_then(|r| r.get(*index))
                        .ok_or_else(|| invalid("its scan was not computed before it".into()))?;
                    let value = copy(result).map_err(fault)?;
                    if last_use[scan] == id {
                        replica_parts.remove(&scan);
                    }
                    values[id] = Some(Cow::Owned(value));
                }
                continue;
            }
            _ => {}
        }
        let mut computed = Vec::with_capacity(inputs.len());
        for (replica, replica_inputs) in values.iter().zip(inputs) {
            let operands = node
                .inputs
                .iter()
                .map(|&i| replica[i as usize].as_deref())
                .collect::<Option<Vec<&Array>>>()
                .ok_or_else(|| invalid("an operand was not computed before it".into()))?;
            computed.push(match node.op {
                // Summed below, once every replica's operand is known.
                Op::AllReduce => None,
                _ => Some(eval(node, &operands, replica_inputs).map_err(fault)?),
            });
        }
        if matches!(node.op, Op::AllReduce) {
            let operands: Vec<&Array> = values
                .iter()
                .filter_map(|replica| replica[node.inputs[0] as usize].as_deref())
                .collect();
            let sum = all_reduce(node, &operands).map_err(fault)?;
            for slot in computed.iter_mut() {
                *slot = Some(Cow::Owned(copy(&sum).map_err(fault)?));
            }
        }
        for (replica, value) in values.iter_mut().zip(computed) {
            let Some(value) = value else {
                return Err(invalid("a replica computed no value".into()));
            };
            if value.dims() != node.ty.dims.as_slice() || value.dtype() != node.ty.dtype {
                return Err(invalid(format!(
                    "it computed {} but declares {}",
                    value.leaf_type(),
                    node.ty
                )));
            }
            for &i in &node.inputs {
                if last_use[i as usize] == id && !keep[i as usize] {
                    replica[i as usize] = None;
                }
            }
            replica[id] = Some(value);
        }
    }

    values
        .into_iter()
        .map(|replica| outputs(graph, replica))
        .collect()
}

/// Runs a scan's body once per iteration on the host: the final carry, then each stacked
/// per-iteration output.
fn run_scan(
    op: &ScanOp,
    operands: &[&Array],
    replicated: bool,
    replica: usize,
) -> Result<Vec<Array>> {
    if replicated && op.body.nodes.iter().any(|n| n.op == Op::AllReduce) {
        return Err(Error::InvalidGraph {
            node: 0,
            op: "scan",
            message: format!(
                "replica {replica}: an all_reduce inside a scan body cannot run replica by replica"
            ),
        });
    }
    let (nc, nx) = (op.carry, op.xs);
    let length = op.length;
    let types = op.result_types();
    let mut carry: Vec<Array> = Vec::with_capacity(nc);
    for a in &operands[..nc] {
        carry.push(copy(a).map_err(|f| scan_fault(f, "a carry"))?);
    }
    let (xs, consts) = operands[nc..].split_at(nx);
    // The stacked outputs, allocated whole before the first iteration (fallibly: a trip count
    // too large for the memory at hand is Error::OutOfMemory, never an abort), each iteration
    // writing its row.
    let mut stacked: Vec<(Vec<usize>, ArrayData)> = Vec::with_capacity(types.len() - nc);
    for ty in &types[nc..] {
        let a = Array::try_zeros(ty.dtype, &ty.dims).map_err(|e| match e {
            Error::OutOfMemory { bytes, .. } => scan_fault(Fault::Alloc { bytes }, "the outputs"),
            other => other,
        })?;
        stacked.push(a.into_parts());
    }
    for step in 0..length {
        let t = if op.reverse { length - 1 - step } else { step };
        let mut slices = Vec::with_capacity(nx);
        for x in xs {
            let row = x.len() / length.max(1);
            let data = x.data().range(t * row, (t + 1) * row).ok_or_else(|| {
                scan_fault(
                    Fault::Invalid("a stacked input is too short".into()),
                    "a slice",
                )
            })?;
            slices.push(
                Array::from_data(&x.dims()[1..], data)
                    .map_err(|e| scan_fault(Fault::Invalid(e.to_string()), "a slice"))?,
            );
        }
        let refs: Vec<&Array> = carry
            .iter()
            .chain(&slices)
            .chain(consts.iter().copied())
            .collect();
        let mut outs = run_refs(&op.body, &refs)?;
        let ys = outs.split_off(nc);
        carry = outs;
        for ((_, out), y) in stacked.iter_mut().zip(ys) {
            let row = y.len();
            out.write_at(t * row, y.data()).ok_or_else(|| {
                scan_fault(
                    Fault::Invalid("an iteration's output does not fit its row".into()),
                    "an output",
                )
            })?;
        }
    }
    let mut results = carry;
    for (dims, data) in stacked {
        results.push(
            Array::from_data(&dims, data)
                .map_err(|e| scan_fault(Fault::Invalid(e.to_string()), "an output"))?,
        );
    }
    Ok(results)
}

/// Runs a while loop's body (condition and new carry at once) until the condition is false:
/// the final carry.
fn run_while(op: &WhileOp, operands: &[&Array], replicated: bool) -> Result<Vec<Array>> {
    if replicated && op.body.nodes.iter().any(|n| n.op == Op::AllReduce) {
        return Err(Error::InvalidGraph {
            node: 0,
            op: "while_loop",
            message: "an all_reduce inside a loop body cannot run replica by replica".into(),
        });
    }
    let (carry, consts) = operands.split_at(op.carry.min(operands.len()));
    let mut carry: Vec<Array> = carry
        .iter()
        .map(|a| copy(a).map_err(|f| scan_fault(f, "a carry")))
        .collect::<Result<_>>()?;
    loop {
        let refs: Vec<&Array> = carry.iter().chain(consts.iter().copied()).collect();
        let mut outs = run_refs(&op.body, &refs)?;
        let next = outs.split_off(1);
        let go = outs[0]
            .as_slice::<bool>()
            .map_err(|e| Error::InvalidGraph {
                node: 0,
                op: "while_loop",
                message: format!("its condition: {e}"),
            })?;
        if !go.first().copied().unwrap_or(false) {
            return Ok(carry);
        }
        carry = next;
    }
}

/// A scan's fault as an error, naming what it was making.
fn scan_fault(f: Fault, what: &str) -> Error {
    match f {
        Fault::Invalid(message) => Error::InvalidGraph {
            node: 0,
            op: "scan",
            message: format!("{what}: {message}"),
        },
        Fault::Alloc { bytes } => Error::OutOfMemory {
            what: format!("{what} of a scan in the interpreter"),
            bytes,
        },
    }
}

/// The sum of one node's operand over every replica, added in replica order.
fn all_reduce(node: &Node, operands: &[&Array]) -> std::result::Result<Array, Fault> {
    let Some((first, rest)) = operands.split_first() else {
        return Err(Fault::Invalid("no replica computed its operand".into()));
    };
    // Half-precision sums add in f32 and round once.
    let mut sum = widened(first)?.into_owned();
    for a in rest {
        let a = widened(a)?;
        sum = Array::from_data(
            &node.ty.dims,
            kernels::binary(crate::trace::BinaryOp::Add, sum.data(), a.data())?,
        )
        .map_err(|e| Fault::Invalid(e.to_string()))?;
    }
    if node.ty.dtype.is_half() {
        sum = array(node, kernels::convert(sum.data(), node.ty.dtype)?)?;
    }
    Ok(sum)
}

/// The outputs of one replica's run, moved out of its values (copied where an output is listed
/// twice or is a borrowed parameter or constant).
fn outputs(graph: &Graph, mut values: Vec<Option<Cow<'_, Array>>>) -> Result<Vec<Array>> {
    let mut outputs = Vec::with_capacity(graph.outputs.len());
    for (k, &o) in graph.outputs.iter().enumerate() {
        // The last use of a value moves it out; an earlier one (an output listed twice), or a
        // borrowed parameter or constant, is copied, fallibly.
        let last = !graph.outputs[k + 1..].contains(&o);
        let value = if last {
            values[o as usize].take()
        } else {
            values[o as usize].as_deref().map(Cow::Borrowed)
        };
        let Some(value) = value else {
            return Err(Error::InvalidGraph {
                node: o,
                op: "output",
                message: "the output was not computed".into(),
            });
        };
        let array = match value {
            Cow::Owned(a) => a,
            Cow::Borrowed(a) => copy(a).map_err(|f| match f {
                Fault::Invalid(message) => Error::InvalidGraph {
                    node: o,
                    op: "output",
                    message,
                },
                Fault::Alloc { bytes } => Error::OutOfMemory {
                    what: format!(
                        "a copy of output {k} ({}) in the interpreter",
                        a.leaf_type()
                    ),
                    bytes,
                },
            })?,
        };
        outputs.push(array);
    }
    Ok(outputs)
}

/// A copy of an array, allocated fallibly.
fn copy(a: &Array) -> std::result::Result<Array, Fault> {
    Array::from_data(a.dims(), copy_data(a.data())?).map_err(|e| Fault::Invalid(e.to_string()))
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
fn array(node: &Node, data: ArrayData) -> std::result::Result<Array, Fault> {
    Array::from_data(&node.ty.dims, data).map_err(|e| Fault::Invalid(e.to_string()))
}

/// `a` with half-precision elements widened to `f32` (exactly); other arrays borrowed.
fn widened(a: &Array) -> std::result::Result<Cow<'_, Array>, Fault> {
    if !a.dtype().is_half() {
        return Ok(Cow::Borrowed(a));
    }
    let data = kernels::convert(a.data(), DType::F32)?;
    Ok(Cow::Owned(
        Array::from_data(a.dims(), data).map_err(|e| Fault::Invalid(e.to_string()))?,
    ))
}

/// Evaluates a node that reads or makes half-precision values as XLA's CPU backend does:
/// operands widened to `f32`, the op in `f32`, and a half result rounded once (to nearest,
/// ties to even). For `+ − × ÷` and `sqrt` that is the correctly rounded half result (`f32`
/// has more than twice the bits of either half type, plus two).
fn eval_half<'a>(
    node: &'a Node,
    operands: &[&Array],
) -> std::result::Result<Cow<'a, Array>, Fault> {
    let wide = operands
        .iter()
        .map(|a| widened(a))
        .collect::<std::result::Result<Vec<_>, Fault>>()?;
    let refs: Vec<&Array> = wide.iter().map(|a| a.as_ref()).collect();
    let mut n32 = node.clone();
    if node.ty.dtype.is_half() {
        n32.ty.dtype = DType::F32;
    }
    let out = eval(&n32, &refs, &[])?.into_owned();
    if !node.ty.dtype.is_half() {
        return Ok(Cow::Owned(out));
    }
    let data = kernels::convert(out.data(), node.ty.dtype)?;
    array(node, data).map(Cow::Owned)
}

/// Evaluates one checked node on its operands' values.
fn eval<'a>(
    node: &'a Node,
    operands: &[&Array],
    inputs: &[&'a Array],
) -> std::result::Result<Cow<'a, Array>, Fault> {
    let direct = matches!(
        node.op,
        Op::Parameter { .. }
            | Op::Constant(_)
            | Op::Convert
            | Op::BitcastConvert
            | Op::AllReduce
            | Op::Shard(_)
    );
    if !direct && (node.ty.dtype.is_half() || operands.iter().any(|a| a.dtype().is_half())) {
        return eval_half(node, operands);
    }
    let owned = |data: ArrayData| array(node, data).map(Cow::Owned);
    match &node.op {
        Op::Parameter { index } => inputs
            .get(*index)
            .map(|a| Cow::Borrowed(*a))
            .ok_or_else(|| Fault::Invalid(format!("there is no input {index}"))),
        Op::Constant(a) => Ok(Cow::Borrowed(&**a)),
        crate::ops::family_op!() => owned(crate::ops::eval(node, operands)?),
        // One device holds the whole value: the constraint is the value itself.
        Op::Shard(_) => operands
            .first()
            .map(|a| Cow::Owned((*a).clone()))
            .ok_or_else(|| Fault::Invalid("a sharding constraint has one operand".into())),
        // Summed across replicas by `run_replicas`; never evaluated one replica at a time.
        Op::AllReduce => Err(Fault::Invalid(
            "an all_reduce is evaluated across replicas".into(),
        )),
        // Run by `run_replicas`, which keeps their several results.
        Op::Scan(_) | Op::While(_) | Op::Result { .. } => Err(Fault::Invalid(
            "a scan and its results are evaluated by the run loop".into(),
        )),
    }
}
