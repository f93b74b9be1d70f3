//! Per-node checks: an op's operands and attributes fit it, and its declared result type is the
//! one the op gives. Traced graphs always pass; the checks make a hand-built or edited graph an
//! error instead of a panic or a wrong answer.

use crate::ops::arity;
use crate::trace::ir::{Graph, Op};
use crate::tree::{DType, LeafType};

/// Checks node `id` of `graph`: operands precede it, and its op, operands and result type fit.
pub(super) fn node(graph: &Graph, id: usize) -> Result<(), String> {
    let node = &graph.nodes[id];
    if let Some(&bad) = node.inputs.iter().find(|&&i| i as usize >= id) {
        return Err(format!("operand %{bad} does not precede it"));
    }
    let ins: Vec<&LeafType> = node.inputs.iter().map(|&i| graph.ty(i)).collect();
    let out = &node.ty;
    // Every type within the size limit bounds every product of dims the kernels compute.
    if let Some(big) = ins.iter().copied().chain([out]).find(|t| !t.within_limit()) {
        return Err(format!(
            "{big} is over the size limit (nitro::MAX_TENSOR_BYTES, 2^63 - 1 bytes)"
        ));
    }
    let expected = match &node.op {
        Op::Parameter { index } => {
            arity(0, ins.len())?;
            match graph.inputs.get(*index) {
                Some(input) => input.ty.clone(),
                None if *index == usize::MAX => {
                    return Err(
                        "it is the stand-in result of an op that failed while tracing, \
                                so the trace should have failed"
                            .into(),
                    )
                }
                None => {
                    return Err(format!(
                        "it reads input {index} but the graph has {} inputs",
                        graph.inputs.len()
                    ))
                }
            }
        }
        Op::Constant(a) => {
            arity(0, ins.len())?;
            a.leaf_type()
        }
        Op::Shard(_) => {
            arity(1, ins.len())?;
            ins[0].clone()
        }
        Op::AllReduce => {
            arity(1, ins.len())?;
            if ins[0].dtype == DType::Bool {
                return Err(format!("it is not defined for {}", ins[0]));
            }
            ins[0].clone()
        }
        Op::Scan(op) => crate::ops::scan::check(op, &ins)?,
        Op::While(op) => crate::ops::scan::check_while(op, &ins)?,
        Op::Result { index } => {
            arity(1, ins.len())?;
            let types = match &graph.node(node.inputs[0]).op {
                Op::Scan(op) => op.result_types(),
                Op::While(op) => op.result_types(),
                _ => return Err("its operand is not a scan or a while_loop".into()),
            };
            match types.get(*index) {
                Some(t) => t.clone(),
                None => {
                    return Err(format!(
                        "it reads result {index} of a loop with {} results",
                        types.len()
                    ))
                }
            }
        }
        crate::ops::family_op!() => crate::ops::result_type(node, &ins)?,
    };
    if &expected == out {
        Ok(())
    } else {
        Err(format!(
            "its result type is {out} but the op gives {expected}"
        ))
    }
}
