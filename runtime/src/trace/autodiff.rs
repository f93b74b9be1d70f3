//! Reverse-mode automatic differentiation on the trace being recorded.
//!
//! [`grad`] walks the recorded graph backwards from a scalar and appends the backward pass to
//! the same graph, written with ordinary [`Tensor`] ops — so one program holds forward and
//! backward, and the gradient code is emitted, interpreted and checked like any other code.
//!
//! Every differentiable op has a rule. Comparisons, `iota`, conversions from integers and
//! everything built from them (`argmax`, `one_hot`) have no derivative: no gradient flows
//! through them, which is exactly their mathematical derivative almost everywhere (they are
//! piecewise constant). `select` passes gradients to the branch it chose, never to the
//! predicate; `maximum`/`minimum` and `max`/`min` reductions split the gradient evenly between
//! ties.

use std::collections::HashMap;
use std::panic::Location;

use super::ir::{Node, Op};
use super::record::{with_recording, Tensor};
use crate::tree::{DType, LeafType};

/// `(y, dy/dx for x in wrt)`. `y` must be a float scalar of the active trace; each gradient has
/// the shape and dtype of its `x`. An `x` that `y` does not depend on gets zeros.
#[track_caller]
pub fn value_and_grad(y: Tensor, wrt: &[Tensor]) -> (Tensor, Vec<Tensor>) {
    (y, grad(y, wrt))
}

/// The gradients of the scalar `y` with respect to each tensor in `wrt`.
///
/// ```
/// use nitro::trace::{grad, trace};
/// use nitro::{DType, LeafType};
///
/// let x = LeafType { dtype: DType::F64, dims: vec![3] };
/// let graph = trace(&[("x".into(), x)], |i| {
///     let y = (i[0] * i[0]).sum_all(); // y = Σ x², dy/dx = 2x
///     grad(y, &[i[0]])
/// })?;
/// assert_eq!(graph.output_types()[0].dims, vec![3]);
/// # Ok::<(), nitro::Error>(())
/// ```
#[track_caller]
pub fn grad(y: Tensor, wrt: &[Tensor]) -> Vec<Tensor> {
    let at = Location::caller();
    let checked = with_recording(|r| {
        let zero = || LeafType {
            dtype: DType::F32,
            dims: Vec::new(),
        };
        for &t in std::iter::once(&y).chain(wrt) {
            if !r.owns(t, "grad", at) {
                return false;
            }
        }
        let ty = r.graph.ty(y.node).clone();
        if !ty.dims.is_empty() || !ty.dtype.is_float() {
            r.fail(
                "grad",
                format!("can only differentiate a float scalar, got {ty}; reduce it first (e.g. `.sum_all()` or `.mean_all()`)"),
                at,
                zero(),
            );
            return false;
        }
        for &x in wrt {
            let tx = r.graph.ty(x.node).clone();
            if !tx.dtype.is_float() {
                r.fail("grad", format!("cannot differentiate with respect to {tx}: only float tensors have gradients"), at, zero());
                return false;
            }
        }
        true
    });
    if !checked {
        return wrt.iter().map(|&x| stand_in(x)).collect();
    }
    let one = Tensor::scalar(1.0, y.dtype());
    backprop(&[(y, one)], wrt, 0)
        .into_iter()
        .zip(wrt)
        .map(|(g, &x)| g.unwrap_or_else(|| x.zeros_like()))
        .collect()
}

/// The reverse pass from `seeds` — `(value, its cotangent)` pairs, the cotangent of the value's
/// type — to each tensor in `wrt`: `None` for one no seed depends on. Only nodes from `lo` on
/// are walked (a scan body's run; 0 for a whole program). The tensors must be the active
/// scope's, checked by the caller.
pub(crate) fn backprop(
    seeds: &[(Tensor, Tensor)],
    wrt: &[Tensor],
    lo: usize,
) -> Vec<Option<Tensor>> {
    let Some(top) = seeds.iter().map(|(y, _)| y.node as usize).max() else {
        return vec![None; wrt.len()];
    };
    let nodes = with_recording(|r| r.graph.nodes[..=top].to_vec());
    let trace = with_recording(|r| r.id);
    let handle = |node: u32| Tensor { node, trace };

    // Which nodes depend on some `wrt`: only their cotangents are worth computing.
    let mut depends = vec![false; nodes.len()];
    for &x in wrt {
        if (x.node as usize) < nodes.len() {
            depends[x.node as usize] = true;
        }
    }
    for (i, n) in nodes.iter().enumerate().skip(lo) {
        if n.inputs.iter().any(|&j| depends[j as usize]) && differentiable(n, &nodes) {
            depends[i] = true;
        }
    }

    let mut ct: Vec<Option<Tensor>> = vec![None; nodes.len()];
    let add = |slot: &mut Option<Tensor>, c: Tensor| {
        *slot = Some(match *slot {
            Some(prev) => prev + c,
            None => c,
        });
    };
    for &(y, g) in seeds {
        add(&mut ct[y.node as usize], g);
    }
    // The cotangents of each scan's results, gathered from its `result` nodes (which follow
    // it) until the walk reaches the scan itself.
    let mut results: HashMap<usize, Vec<Option<Tensor>>> = HashMap::new();
    for i in (lo..nodes.len()).rev() {
        if !depends[i] {
            continue;
        }
        let node = &nodes[i];
        let contributions = match &node.op {
            Op::Result { index } => {
                if let Some(g) = ct[i] {
                    let scan = node.inputs[0] as usize;
                    let slots = results.entry(scan).or_default();
                    if slots.len() <= *index {
                        slots.resize(*index + 1, None);
                    }
                    add(&mut slots[*index], g);
                }
                continue;
            }
            Op::Scan(_) => match results.remove(&i) {
                Some(cts) => crate::ops::scan::vjp(i as u32, cts, backprop),
                None => continue,
            },
            Op::While(_) => {
                if results.remove(&i).is_some() {
                    crate::trace::record::refuse(
                        "grad",
                        "a gradient reached a `while_loop`, whose trip count depends on traced \
                         values, so it has no reverse pass; use `Scan` with a static trip count \
                         (as `lax.scan`), or `stop_gradient` the loop's inputs"
                            .into(),
                    );
                }
                continue;
            }
            _ => {
                let Some(g) = ct[i] else { continue };
                let inputs: Vec<Tensor> = node.inputs.iter().map(|&j| handle(j)).collect();
                vjp(node, handle(i as u32), &inputs, g)
            }
        };
        for (j, c) in node.inputs.iter().zip(contributions) {
            let (j, Some(c)) = (*j as usize, c) else {
                continue;
            };
            if !depends[j] {
                continue;
            }
            add(&mut ct[j], c);
        }
    }
    wrt.iter()
        .map(|&x| ct.get(x.node as usize).copied().flatten())
        .collect()
}

fn stand_in(x: Tensor) -> Tensor {
    with_recording(|r| {
        let ty = if r.sees(x) {
            r.graph.ty(x.node).clone()
        } else {
            LeafType {
                dtype: DType::F32,
                dims: Vec::new(),
            }
        };
        r.stand_in(ty)
    })
}

/// Whether gradients flow from a node to its inputs at all.
fn differentiable(n: &Node, nodes: &[Node]) -> bool {
    match &n.op {
        Op::Parameter { .. }
        | Op::Constant(_)
        | Op::Iota { .. }
        | Op::Compare(_)
        | Op::StopGradient => false,
        // A scan's first result may be an integer while others are floats.
        Op::Scan(_) | Op::While(_) => true,
        Op::Convert => n.ty.dtype.is_float() && nodes[n.inputs[0] as usize].ty.dtype.is_float(),
        _ => n.ty.dtype.is_float(),
    }
}

/// The contribution of cotangent `g` of `node` (whose value is `y`) to each of its inputs: the
/// rule of the node's op family (`crate::ops`), or the replication rule of `all_reduce`.
fn vjp(node: &Node, y: Tensor, x: &[Tensor], g: Tensor) -> Vec<Option<Tensor>> {
    match &node.op {
        Op::Parameter { .. } | Op::Constant(_) => vec![None; x.len()],
        // Every replica's output holds every replica's input, so a replica's input receives
        // the cotangents of all replicas' outputs.
        Op::AllReduce => vec![Some(g.all_sum())],
        // The cotangent is split as the value is (JAX's transpose of the constraint).
        Op::Shard(spec) => vec![Some(g.shard(spec.clone()))],
        crate::ops::family_op!() => crate::ops::vjp(node, y, x, g),
        // `backprop` sends these to the scan's own rule.
        Op::Scan(_) | Op::While(_) | Op::Result { .. } => vec![None; x.len()],
    }
}
