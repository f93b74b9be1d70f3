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

use std::panic::Location;

use super::ir::{BinaryOp, Node, Op, UnaryOp};
use super::{with_recording, Tensor};
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
    let (nodes, checked) = with_recording(|r| {
        let zero = || LeafType {
            dtype: DType::F32,
            dims: Vec::new(),
        };
        for &t in std::iter::once(&y).chain(wrt) {
            if !r.owns(t, "grad", at) {
                return (Vec::new(), false);
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
            return (Vec::new(), false);
        }
        for &x in wrt {
            let tx = r.graph.ty(x.node).clone();
            if !tx.dtype.is_float() {
                r.fail("grad", format!("cannot differentiate with respect to {tx}: only float tensors have gradients"), at, zero());
                return (Vec::new(), false);
            }
        }
        (r.graph.nodes[..=y.node as usize].to_vec(), true)
    });
    if !checked {
        return wrt.iter().map(|&x| stand_in(x)).collect();
    }
    let trace = y.trace;
    let handle = |node: u32| Tensor { node, trace };

    // Which nodes depend on some `wrt`: only their cotangents are worth computing.
    let mut depends = vec![false; nodes.len()];
    for &x in wrt {
        if (x.node as usize) < nodes.len() {
            depends[x.node as usize] = true;
        }
    }
    for (i, n) in nodes.iter().enumerate() {
        if n.inputs.iter().any(|&j| depends[j as usize]) && differentiable(n, &nodes) {
            depends[i] = true;
        }
    }

    let mut ct: Vec<Option<Tensor>> = vec![None; nodes.len()];
    ct[y.node as usize] = Some(Tensor::scalar(1.0, nodes[y.node as usize].ty.dtype));
    for i in (0..nodes.len()).rev() {
        let Some(g) = ct[i] else { continue };
        if !depends[i] {
            continue;
        }
        let node = &nodes[i];
        let inputs: Vec<Tensor> = node.inputs.iter().map(|&j| handle(j)).collect();
        let contributions = vjp(node, handle(i as u32), &inputs, g, &nodes);
        for (j, c) in node.inputs.iter().zip(contributions) {
            let (j, Some(c)) = (*j as usize, c) else {
                continue;
            };
            if !depends[j] {
                continue;
            }
            ct[j] = Some(match ct[j] {
                Some(prev) => prev + c,
                None => c,
            });
        }
    }
    wrt.iter()
        .map(|&x| {
            ct.get(x.node as usize)
                .copied()
                .flatten()
                .unwrap_or_else(|| x.zeros_like())
        })
        .collect()
}

fn stand_in(x: Tensor) -> Tensor {
    with_recording(|r| {
        let ty = if x.trace == r.id && (x.node as usize) < r.graph.nodes.len() {
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
        Op::Parameter { .. } | Op::Constant(_) | Op::Iota { .. } | Op::Compare(_) => false,
        Op::Convert => n.ty.dtype.is_float() && nodes[n.inputs[0] as usize].ty.dtype.is_float(),
        _ => n.ty.dtype.is_float(),
    }
}

/// The contribution of cotangent `g` of `node` (whose value is `y`) to each of its inputs.
fn vjp(node: &Node, y: Tensor, x: &[Tensor], g: Tensor, nodes: &[Node]) -> Vec<Option<Tensor>> {
    let ty_of = |t: Tensor| nodes[t.node as usize].ty.clone();
    match &node.op {
        Op::Parameter { .. } | Op::Constant(_) | Op::Compare(_) => {
            vec![None; x.len()]
        }
        Op::Unary(u) => {
            let a = x[0];
            let d = match u {
                UnaryOp::Neg => -g,
                UnaryOp::Exp => g * y,
                UnaryOp::Log => g / a,
                UnaryOp::Tanh => g * (1.0 - y * y),
                UnaryOp::Logistic => g * y * (1.0 - y),
                UnaryOp::Sqrt => g * 0.5 / y,
                UnaryOp::Rsqrt => g * -0.5 * y / a,
                UnaryOp::Abs => {
                    Tensor::select(a.greater(0.0), g, Tensor::select(a.less(0.0), -g, 0.0))
                }
                UnaryOp::Sin => g * a.cos(),
                UnaryOp::Cos => -(g * a.sin()),
                UnaryOp::Erf => g * std::f64::consts::FRAC_2_SQRT_PI * (-(a * a)).exp(),
                UnaryOp::ErfInv => g * (std::f64::consts::PI.sqrt() / 2.0) * (y * y).exp(),
                UnaryOp::Log1p => g / (a + 1.0),
                UnaryOp::Expm1 => g * (y + 1.0),
                // Piecewise constant (and integer-only ops never reach here).
                UnaryOp::Sign
                | UnaryOp::Floor
                | UnaryOp::Ceil
                | UnaryOp::RoundNearestEven
                | UnaryOp::Not
                | UnaryOp::Popcnt => return vec![None],
            };
            vec![Some(d)]
        }
        Op::Binary(b) => {
            let (a, c) = (x[0], x[1]);
            let (da, dc) = match b {
                BinaryOp::Add => (g, g),
                BinaryOp::Sub => (g, -g),
                BinaryOp::Mul => (g * c, g * a),
                BinaryOp::Div => (g / c, -(g * y) / c),
                BinaryOp::Pow => {
                    let da = g * c * a.pow(c - 1.0);
                    let log_a = Tensor::select(a.greater(0.0), a, 1.0).log();
                    let dc = Tensor::select(a.greater(0.0), g * y * log_a, 0.0);
                    (da, dc)
                }
                BinaryOp::Max | BinaryOp::Min => {
                    let (wins, loses) = if *b == BinaryOp::Max {
                        (a.greater(c), c.greater(a))
                    } else {
                        (a.less(c), c.less(a))
                    };
                    let tie = a.equal(c);
                    let half = g * 0.5;
                    let da = Tensor::select(wins, g, Tensor::select(tie, half, 0.0));
                    let dc = Tensor::select(loses, g, Tensor::select(tie, half, 0.0));
                    (da, dc)
                }
                BinaryOp::Atan2 => {
                    let r2 = a * a + c * c;
                    (g * c / r2, -(g * a) / r2)
                }
                BinaryOp::Rem => {
                    let q = a / c;
                    (g, -(g * q.sign() * q.abs().floor()))
                }
                // Integer-only ops: never differentiated.
                BinaryOp::And
                | BinaryOp::Or
                | BinaryOp::Xor
                | BinaryOp::ShiftLeft
                | BinaryOp::ShiftRightLogical
                | BinaryOp::ShiftRightArithmetic => return vec![None, None],
            };
            vec![Some(da), Some(dc)]
        }
        Op::Select => {
            let p = x[0];
            vec![
                None,
                Some(Tensor::select(p, g, 0.0)),
                Some(Tensor::select(p, 0.0, g)),
            ]
        }
        Op::Convert => vec![Some(g.convert(ty_of(x[0]).dtype))],
        // Every replica's output holds every replica's input, so a replica's input receives
        // the cotangents of all replicas' outputs.
        Op::AllReduce => vec![Some(g.all_sum())],
        Op::StopGradient => vec![None],
        crate::ops::family_op!() => crate::ops::vjp(node, y, x, g),
    }
}
