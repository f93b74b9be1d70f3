//! Sub-graphs recorded in place: how a [`scan`](crate::trace::Scan) body is traced.
//!
//! A body is recorded into the enclosing graph's own node list, as a contiguous run of nodes
//! after its arguments, under a fresh scope id (so a tensor made inside cannot be used after
//! the body is closed). Tensors of enclosing scopes may be read inside: a body node that reads
//! a node from before the run is a *capture*. [`extract`] then copies the run's live nodes
//! into a graph of their own — the arguments, then the captures, as its inputs — and [`close`]
//! removes the run from the enclosing graph. Because the run shares the enclosing node list,
//! every op, shape check and error path works inside a body unchanged.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::ir::{Graph, Input, NodeId, Op};
use super::record::{self, with_recording, Tensor, NEXT_TRACE};
use crate::tree::LeafType;

/// An open body: where its run starts, and its scope id.
pub(crate) struct Open {
    /// The id of its first node (the first argument).
    pub(crate) start: usize,
    /// Its scope id.
    pub(crate) id: u32,
}

/// Opens a body with arguments of `types`: a new scope, and one argument node per type.
pub(crate) fn open(types: &[LeafType]) -> (Open, Vec<Tensor>) {
    let id = NEXT_TRACE.fetch_add(1, Ordering::Relaxed);
    with_recording(|r| {
        let start = r.graph.nodes.len();
        let outer = std::mem::replace(&mut r.id, id);
        r.scopes.push(outer);
        let args = types
            .iter()
            .map(|ty| {
                // Marked like a stand-in, so nothing mistakes it for a program input.
                let node =
                    r.graph
                        .push(Op::Parameter { index: usize::MAX }, Vec::new(), ty.clone());
                Tensor { node, trace: id }
            })
            .collect();
        (Open { start, id }, args)
    })
}

/// Closes a body: removes its run from the graph and returns to the enclosing scope.
pub(crate) fn close(open: Open) {
    with_recording(|r| {
        r.graph.nodes.truncate(open.start);
        if let Some(outer) = r.scopes.pop() {
            r.id = outer;
        }
    });
    record::body_closed(open.id);
}

/// A body copied out of the run: its graph, and the enclosing nodes it captured (its inputs
/// after the given parameters, in this order).
pub(crate) struct Extracted {
    pub(crate) graph: Graph,
    pub(crate) captures: Vec<NodeId>,
}

/// Copies the part of the run from `start` that `outputs` need into a graph of its own:
/// `params` (nodes of the run, or before it) become its first inputs, in order — what they
/// compute is cut off — and each node from before the run that is read becomes an input after
/// them (a capture). The run itself is left in place.
///
/// Errors: a node the outputs need that is a program input or a stand-in (an input created
/// inside the body, or an op that failed), with the message to record.
pub(crate) fn extract(
    start: usize,
    params: &[NodeId],
    outputs: &[NodeId],
) -> Result<Extracted, String> {
    with_recording(|r| {
        let g = &r.graph;
        let end = g.nodes.len();
        let is_param: HashMap<NodeId, usize> = params
            .iter()
            .enumerate()
            .rev()
            .map(|(k, &p)| (p, k))
            .collect();
        // Which nodes of the run the outputs need, walking back and stopping at parameters.
        let mut live = vec![false; end.saturating_sub(start)];
        for &o in outputs {
            if o as usize >= start && !is_param.contains_key(&o) {
                live[o as usize - start] = true;
            }
        }
        for i in (start..end).rev() {
            if !live[i - start] {
                continue;
            }
            for &j in &g.nodes[i].inputs {
                if j as usize >= start && !is_param.contains_key(&j) {
                    live[j as usize - start] = true;
                }
            }
        }
        // A body is a function of the program, not a program: it runs once per iteration on
        // each replica, so it has no replica count of its own.
        let mut body = Graph::default();
        let mut map: HashMap<NodeId, NodeId> = HashMap::new();
        for (k, &p) in params.iter().enumerate() {
            let ty = g.ty(p).clone();
            let node = body.push(Op::Parameter { index: k }, Vec::new(), ty.clone());
            body.inputs.push(Input {
                name: format!("arg{k}"),
                ty,
                node,
            });
            map.entry(p).or_insert(node);
        }
        let mut captures: Vec<NodeId> = Vec::new();
        let mut capture = |body: &mut Graph, map: &mut HashMap<NodeId, NodeId>, j: NodeId| {
            if map.contains_key(&j) {
                return;
            }
            let ty = g.ty(j).clone();
            let index = body.inputs.len();
            let node = body.push(Op::Parameter { index }, Vec::new(), ty.clone());
            body.inputs.push(Input {
                name: format!("capture{}", captures.len()),
                ty,
                node,
            });
            captures.push(j);
            map.insert(j, node);
        };
        for i in start..end {
            if !live[i - start] {
                continue;
            }
            let n = &g.nodes[i];
            if matches!(n.op, Op::Parameter { .. }) {
                return Err(
                    if matches!(n.op, Op::Parameter { index } if index != usize::MAX) {
                        "a program input was created inside the body".to_owned()
                    } else {
                        "the body used a value of a failed op".to_owned()
                    },
                );
            }
            for &j in &n.inputs {
                if (j as usize) < start {
                    capture(&mut body, &mut map, j);
                }
            }
            let inputs = n.inputs.iter().map(|j| map[j]).collect();
            let id = body.push(n.op.clone(), inputs, n.ty.clone());
            map.insert(i as NodeId, id);
        }
        for &o in outputs {
            if (o as usize) < start {
                capture(&mut body, &mut map, o);
            }
        }
        body.outputs = outputs.iter().map(|o| map[o]).collect();
        Ok(Extracted {
            graph: body,
            captures,
        })
    })
}

/// Records `body`'s nodes again in the active scope, its inputs bound to `args`, and returns
/// its outputs. The nodes were checked when `body` was traced, so they are pushed as they are.
pub(crate) fn replay(body: &Graph, args: &[Tensor]) -> Vec<Tensor> {
    with_recording(|r| {
        let trace = r.id;
        let mut map: Vec<NodeId> = Vec::with_capacity(body.nodes.len());
        for n in &body.nodes {
            let id = match n.op {
                Op::Parameter { index } => args[index].node,
                _ => {
                    let inputs = n.inputs.iter().map(|&j| map[j as usize]).collect();
                    r.graph.push(n.op.clone(), inputs, n.ty.clone())
                }
            };
            map.push(id);
        }
        body.outputs
            .iter()
            .map(|&o| Tensor {
                node: map[o as usize],
                trace,
            })
            .collect()
    })
}
