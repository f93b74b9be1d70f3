//! Loops: `scan`, a loop with a static trip count whose body is traced once, and `while_loop`,
//! a loop on a traced condition for inference.
//!
//! [`Scan::run`] records its body as a sub-graph (`trace::region`) and the loop as one
//! [`Op::Scan`] node with a [`Op::Result`] node per result. The body is emitted once, as a
//! private function called from a `stablehlo.while` (`crate::emit`), so a 24-layer stack compiles
//! about as fast as one layer; the interpreter runs the body graph once per iteration
//! (`crate::backend::interp`).
//!
//! The reverse pass (`vjp`) is a second scan running the other way. Its body is the forward
//! body replayed, then differentiated, on one iteration's values; what it needs of the forward
//! pass comes in as stacked inputs. With [`Remat::Save`] the forward loop is rewritten in place
//! to also stack the carries and the non-element-wise values the backward body reads (its
//! residuals); element-wise and layout values are recomputed from them, as are values that do
//! not change between iterations. With [`Remat::Recompute`] only the carries are stacked, and
//! each backward iteration recomputes its forward pass from them.

use std::panic::Location;
use std::sync::Arc;

use std::fmt::{self, Write as _};

use crate::emit::line::{self as emit, Line, List, Ty};
use crate::trace::ir::{Graph, NodeId, Op, Remat, ScanOp, WhileOp};
use crate::trace::record::{with_recording, Tensor};
use crate::trace::region;
use crate::tree::{DType, LeafType};

/// A loop with a static trip count over a carry and stacked inputs, traced once.
///
/// `body(carry, x)` gets the carry and, for each stacked input, its slice for this iteration
/// (the leading axis dropped); it returns the new carry (the same types as the old) and this
/// iteration's outputs, which come back stacked along a new leading axis. The body may read any
/// tensor of the enclosing trace (weights, masks, the step's random key): those are passed into
/// the loop as invariants. The trip count and the [`Remat`] policy shape the program, so they
/// are part of its fingerprint and key.
///
/// ```
/// use nitro::backend::interp;
/// use nitro::trace::{trace, Scan};
/// use nitro::{Array, DType, LeafType};
///
/// // A running sum over the rows of `xs`, and each prefix sum.
/// let xs = LeafType { dtype: DType::F32, dims: vec![4, 2] };
/// let graph = trace(&[("xs".into(), xs)], |i| {
///     let zero = nitro::trace::Tensor::scalar(0.0, DType::F32).broadcast_to(&[2]);
///     let (carry, ys) = Scan::new().run(&[zero], &[i[0]], |c, x| {
///         let s = c[0] + x[0];
///         (vec![s], vec![s])
///     });
///     vec![carry[0], ys[0]]
/// })?;
/// let xs = Array::from_vec(&[4, 2], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])?;
/// let out = interp::run(&graph, &[xs])?;
/// assert_eq!(out[0].as_slice::<f32>()?, &[16.0, 20.0]);
/// assert_eq!(out[1].as_slice::<f32>()?, &[1.0, 2.0, 4.0, 6.0, 9.0, 12.0, 16.0, 20.0]);
/// # Ok::<(), nitro::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Scan {
    length: Option<usize>,
    reverse: bool,
    remat: Remat,
}

/// [`Scan::run`] with the defaults: forwards, trip count from the stacked inputs, residuals
/// saved.
#[track_caller]
pub fn scan(
    init: &[Tensor],
    xs: &[Tensor],
    body: impl FnOnce(&[Tensor], &[Tensor]) -> (Vec<Tensor>, Vec<Tensor>),
) -> (Vec<Tensor>, Vec<Tensor>) {
    Scan::new().run(init, xs, body)
}

impl Scan {
    /// A forward scan whose trip count is the stacked inputs' leading dim, saving residuals.
    pub fn new() -> Scan {
        Scan::default()
    }

    /// The trip count, required when there are no stacked inputs (and checked against their
    /// leading dim when there are).
    pub fn length(mut self, length: usize) -> Scan {
        self.length = Some(length);
        self
    }

    /// Whether iteration `t` reads and writes index `length − 1 − t` (a loop from the end).
    pub fn reverse(mut self, reverse: bool) -> Scan {
        self.reverse = reverse;
        self
    }

    /// What the reverse pass keeps of the forward pass ([`Remat`]).
    pub fn remat(mut self, remat: Remat) -> Scan {
        self.remat = remat;
        self
    }

    /// Runs the loop: returns the final carry and the stacked per-iteration outputs.
    ///
    /// A mistake — stacked inputs of different lengths, a scalar as a stacked input, no trip
    /// count, a new carry of another type than the old, a tensor of another trace — fails the
    /// trace naming this call's line, like any op. A trip count of 0 runs nothing: the carry
    /// comes back as it went in and each output has a leading dim of 0.
    #[track_caller]
    pub fn run(
        self,
        init: &[Tensor],
        xs: &[Tensor],
        body: impl FnOnce(&[Tensor], &[Tensor]) -> (Vec<Tensor>, Vec<Tensor>),
    ) -> (Vec<Tensor>, Vec<Tensor>) {
        let at = Location::caller();
        let checked = with_recording(|r| {
            for &t in init.iter().chain(xs) {
                if !r.owns(t, "scan", at) {
                    return Err(());
                }
            }
            let stacked: Vec<LeafType> = xs.iter().map(|&x| r.graph.ty(x.node).clone()).collect();
            let mut length = self.length;
            for (k, ty) in stacked.iter().enumerate() {
                let Some(&n) = ty.dims.first() else {
                    r.fail(
                        "scan",
                        format!("stacked input {k} is the scalar {ty}; each stacked input needs a leading axis to scan over"),
                        at,
                        crate::ops::f32_scalar(),
                    );
                    return Err(());
                };
                match length {
                    Some(l) if l != n => {
                        let what = if self.length.is_some() && k == 0 {
                            format!("the trip count is {l}")
                        } else {
                            format!("stacked input 0 has {l} rows")
                        };
                        r.fail(
                            "scan",
                            format!("stacked input {k} ({ty}) has {n} rows but {what}; every stacked input needs the trip count as its leading dim"),
                            at,
                            crate::ops::f32_scalar(),
                        );
                        return Err(());
                    }
                    _ => length = Some(n),
                }
            }
            let Some(length) = length else {
                r.fail(
                    "scan",
                    "a scan with no stacked inputs needs its trip count: `Scan::new().length(n)`"
                        .into(),
                    at,
                    crate::ops::f32_scalar(),
                );
                return Err(());
            };
            if i32::try_from(length).is_err() {
                r.fail(
                    "scan",
                    format!(
                        "the trip count {length} is past 2^31 − 1, the most the emitted loop's \
                         i32 counter holds; nest two scans (an outer loop over blocks of an inner \
                         one) to run more iterations"
                    ),
                    at,
                    crate::ops::f32_scalar(),
                );
                return Err(());
            }
            let carry: Vec<LeafType> = init.iter().map(|&c| r.graph.ty(c.node).clone()).collect();
            let slices: Vec<LeafType> = stacked
                .iter()
                .map(|t| LeafType {
                    dtype: t.dtype,
                    dims: t.dims[1..].to_vec(),
                })
                .collect();
            Ok((length, carry, slices))
        });
        let Ok((length, carry_types, slice_types)) = checked else {
            return stand_ins(init.len(), 0);
        };

        let arg_types: Vec<LeafType> = carry_types.iter().chain(&slice_types).cloned().collect();
        let (open, args) = region::open(&arg_types);
        let (carry, ys) = body(&args[..init.len()], &args[init.len()..]);
        let outcome = with_recording(|r| -> Result<(), String> {
            if r.failed() {
                return Err(String::new());
            }
            for &t in carry.iter().chain(&ys) {
                if !r.sees(t) {
                    return Err(
                        "the body returned a tensor of another trace or of a closed scan body"
                            .into(),
                    );
                }
            }
            check_new_carry(&r.graph, &carry, &carry_types)
        });
        let outputs: Vec<NodeId> = carry.iter().chain(&ys).map(|t| t.node).collect();
        let Some(body) = finish_body(open, &args, &outputs, outcome, ("scan", "scan"), at) else {
            return stand_ins(init.len(), ys.len());
        };
        let consts: Vec<Tensor> = with_recording(|r| {
            body.captures
                .iter()
                .map(|&node| Tensor { node, trace: r.id })
                .collect()
        });
        let op = ScanOp {
            body: Arc::new(body.graph),
            length,
            reverse: self.reverse,
            carry: init.len(),
            xs: xs.len(),
            remat: self.remat,
        };
        if length == 0 {
            let ys = op
                .result_types()
                .split_off(init.len())
                .into_iter()
                .map(|ty| zeros(&ty))
                .collect();
            return (init.to_vec(), ys);
        }
        let inputs: Vec<Tensor> = init.iter().chain(xs).chain(&consts).copied().collect();
        let mut results = push(op, &inputs, at);
        let ys = results.split_off(init.len());
        (results, ys)
    }
}

/// A loop while a traced condition holds: `while cond(carry) { carry = body(carry) }`, and
/// the final carry. For inference only: its trip count depends on traced values, so a gradient
/// that reaches it fails the trace (use [`Scan`], whose trip count is static, to train through
/// a loop). `cond` returns a `bool` scalar; `body` returns the new carry, of the carry's types.
/// Both may read tensors of the enclosing trace. A condition that never turns false loops
/// forever, on XLA as on the interpreter.
///
/// ```
/// use nitro::backend::interp;
/// use nitro::trace::{trace, while_loop};
/// use nitro::{Array, DType, LeafType};
///
/// // Halve until below 1, counting the halvings.
/// let x = LeafType { dtype: DType::F32, dims: vec![] };
/// let graph = trace(&[("x".into(), x)], |i| {
///     let n = nitro::trace::Tensor::constant(Array::scalar(0i32));
///     while_loop(&[i[0], n], |c| c[0].greater_equal(1.0), |c| vec![c[0] * 0.5, c[1] + 1.0])
/// })?;
/// let out = interp::run(&graph, &[Array::scalar(10.0f32)])?;
/// assert_eq!(out[0].as_slice::<f32>()?, &[0.625]);
/// assert_eq!(out[1].as_slice::<i32>()?, &[4]);
/// # Ok::<(), nitro::Error>(())
/// ```
#[track_caller]
pub fn while_loop(
    init: &[Tensor],
    cond: impl FnOnce(&[Tensor]) -> Tensor,
    body: impl FnOnce(&[Tensor]) -> Vec<Tensor>,
) -> Vec<Tensor> {
    let at = Location::caller();
    let types = with_recording(|r| {
        for &t in init {
            if !r.owns(t, "while_loop", at) {
                return None;
            }
        }
        if init.is_empty() {
            r.fail(
                "while_loop",
                "a while_loop needs at least one carried value".into(),
                at,
                crate::ops::f32_scalar(),
            );
            return None;
        }
        Some(
            init.iter()
                .map(|&c| r.graph.ty(c.node).clone())
                .collect::<Vec<_>>(),
        )
    });
    let Some(types) = types else {
        return stand_ins(init.len(), 0).0;
    };
    let (open, args) = region::open(&types);
    let p = cond(&args);
    let next = body(&args);
    let outcome = with_recording(|r| -> Result<(), String> {
        if r.failed() {
            return Err(String::new());
        }
        for &t in std::iter::once(&p).chain(&next) {
            if !r.sees(t) {
                return Err(
                    "the loop returned a tensor of another trace or of a closed loop body".into(),
                );
            }
        }
        let pt = r.graph.ty(p.node);
        if pt.dtype != DType::Bool || !pt.dims.is_empty() {
            return Err(format!(
                "the condition is {pt}; it must be a bool scalar (e.g. `x.less(10.0)` on a scalar)"
            ));
        }
        check_new_carry(&r.graph, &next, &types)
    });
    let outputs: Vec<NodeId> = std::iter::once(&p).chain(&next).map(|t| t.node).collect();
    let Some(body) = finish_body(open, &args, &outputs, outcome, ("while_loop", "loop"), at) else {
        return stand_ins(init.len(), 0).0;
    };
    let op = WhileOp {
        body: Arc::new(body.graph),
        carry: init.len(),
    };
    let types = op.result_types();
    let mut inputs: Vec<NodeId> = init.iter().map(|t| t.node).collect();
    inputs.extend(&body.captures);
    push_loop(Op::While(Box::new(op)), types, inputs, "while_loop", at)
}

/// Ends a loop body's recording: copies the body out of its run (when the checks in `outcome`
/// passed), closes the run, and refuses an `all_sum` inside it in a replicated program. The
/// body, or `None` once the failure is recorded as op `name`'s (`kind` names the loop in the
/// message). An empty message is a failure recorded already.
fn finish_body(
    open: region::Open,
    args: &[Tensor],
    outputs: &[NodeId],
    outcome: Result<(), String>,
    (name, kind): (&'static str, &str),
    at: &Location<'_>,
) -> Option<region::Extracted> {
    let params: Vec<NodeId> = args.iter().map(|a| a.node).collect();
    let extracted = outcome.and_then(|()| region::extract(open.start, &params, outputs));
    region::close(open);
    let message = match extracted {
        Ok(body) => {
            let replicated_sum = crate::trace::record::replicas() > 1
                && body.graph.nodes.iter().any(|n| n.op == Op::AllReduce);
            if !replicated_sum {
                return Some(body);
            }
            format!(
                "`all_sum` inside a {kind} body of a replicated program is not supported; sum \
                 over replicas before or after the {kind}"
            )
        }
        Err(message) => message,
    };
    if !message.is_empty() {
        with_recording(|r| {
            r.fail(name, message, at, crate::ops::f32_scalar());
        });
    }
    None
}

/// Records a loop node `op` on `inputs` (its type that of its first result, of `types`) and a
/// result node per result; returns the results.
fn push_loop(
    op: Op,
    types: Vec<LeafType>,
    inputs: Vec<NodeId>,
    name: &'static str,
    at: &Location<'_>,
) -> Vec<Tensor> {
    with_recording(|r| {
        let Some(first) = types.first().cloned() else {
            return Vec::new();
        };
        let node = r.push(op, inputs, first, name, at);
        if matches!(r.graph.node(node.node).op, Op::Parameter { .. }) {
            // Over the size limit: `push` recorded the error and gave a stand-in.
            return types.iter().map(|t| r.stand_in(t.clone())).collect();
        }
        types
            .into_iter()
            .enumerate()
            .map(|(index, ty)| r.push(Op::Result { index }, vec![node.node], ty, name, at))
            .collect()
    })
}

/// The type a while node declares (its first carry's) for operands of `types`, or what is
/// wrong.
pub(crate) fn check_while(op: &WhileOp, types: &[&LeafType]) -> Result<LeafType, String> {
    let body_in = op.body.input_types();
    let body_out = op.body.output_types();
    if types.len() != body_in.len() || op.carry == 0 || op.carry > body_in.len() {
        return Err(format!(
            "it has {} operands and {} carried values but its body takes {} inputs",
            types.len(),
            op.carry,
            body_in.len()
        ));
    }
    for (k, (t, b)) in types.iter().zip(&body_in).enumerate() {
        if *t != b {
            return Err(format!("operand {k} is {t} but the body needs {b}"));
        }
    }
    let cond = LeafType {
        dtype: DType::Bool,
        dims: Vec::new(),
    };
    if body_out.first() != Some(&cond) || body_out[1..] != body_in[..op.carry] {
        return Err("its body does not give a bool condition and the carry's types".into());
    }
    Ok(body_in[0].clone())
}

/// `Ok` when a body's new carry has the parts and types of the carry that went in (`types`),
/// or the message saying which part differs.
fn check_new_carry(g: &Graph, carry: &[Tensor], types: &[LeafType]) -> Result<(), String> {
    if carry.len() != types.len() {
        return Err(format!(
            "the body returned {} carried values for a carry of {}; the new carry must have the \
             old one's parts",
            carry.len(),
            types.len()
        ));
    }
    for (k, (&c, want)) in carry.iter().zip(types).enumerate() {
        let got = g.ty(c.node);
        if got != want {
            return Err(format!(
                "the body's new carry {k} is {got} but the carry going in is {want}; a carry \
                 keeps its type from one iteration to the next"
            ));
        }
    }
    Ok(())
}

/// Stand-ins for the results of a failed scan (the trace has already failed).
fn stand_ins(carry: usize, ys: usize) -> (Vec<Tensor>, Vec<Tensor>) {
    with_recording(|r| {
        let mut one = || r.stand_in(crate::ops::f32_scalar());
        let c = (0..carry).map(|_| one()).collect();
        let y = (0..ys).map(|_| one()).collect();
        (c, y)
    })
}

/// Zeros of type `ty` (a broadcast scalar: no large constant).
fn zeros(ty: &LeafType) -> Tensor {
    let zero = match ty.dtype {
        DType::Bool => Tensor::constant(crate::Array::scalar(false)),
        d => Tensor::scalar(0.0, d),
    };
    if ty.dims.is_empty() {
        zero
    } else {
        zero.broadcast_to(&ty.dims)
    }
}

/// Records a scan node on `inputs` and a result node per result; returns the results.
fn push(op: ScanOp, inputs: &[Tensor], at: &Location<'_>) -> Vec<Tensor> {
    let types = op.result_types();
    let ids = inputs.iter().map(|t| t.node).collect();
    push_loop(Op::Scan(Box::new(op)), types, ids, "scan", at)
}

/// The reverse pass over a run of nodes that autodiff hands a scan's rule to differentiate its
/// body with ([`crate::trace::autodiff`]'s own): from `(value, cotangent)` seeds to the tensors
/// `wrt`, walking the nodes from the given index on. Handed in, so that the rule and the
/// reverse pass that calls it do not import each other.
pub(crate) type Backprop = fn(&[(Tensor, Tensor)], &[Tensor], usize) -> Vec<Option<Tensor>>;

/// The reverse pass of scan node `s`, given the cotangents of its results (`None`, or missing
/// at the end, for none): the cotangent of each of its inputs. The body's reverse pass is
/// `backprop`'s.
#[track_caller]
pub(crate) fn vjp(s: NodeId, cts: Vec<Option<Tensor>>, backprop: Backprop) -> Vec<Option<Tensor>> {
    let at = Location::caller();
    let (op, inputs, trace) = with_recording(|r| {
        let node = r.graph.node(s);
        let Op::Scan(op) = &node.op else {
            unreachable!("scan::vjp is called on scan nodes")
        };
        ((**op).clone(), node.inputs.clone(), r.id)
    });
    let t = |node: NodeId| Tensor { node, trace };
    let (nc, nx) = (op.carry, op.xs);
    let nk = inputs.len() - nc - nx;
    let ny = op.ys();
    let body = op.body.clone();
    let in_types = body.input_types();
    let out_types = body.output_types();
    let result_types = op.result_types();
    let float = |ty: &LeafType| ty.dtype.is_float();
    let fc: Vec<usize> = (0..nc).filter(|&k| float(&in_types[k])).collect();
    let fx: Vec<usize> = (0..nx).filter(|&j| float(&in_types[nc + j])).collect();
    let fk: Vec<usize> = (0..nk).filter(|&m| float(&in_types[nc + nx + m])).collect();
    let fy: Vec<usize> = (0..ny).filter(|&j| float(&out_types[nc + j])).collect();
    let ct = |k: usize| cts.get(k).copied().flatten();

    // The backward body: carry (ct_c, acc), slices (ct_y, then the forward values), invariants.
    let mut arg_types: Vec<LeafType> = Vec::new();
    arg_types.extend(fc.iter().map(|&k| in_types[k].clone()));
    arg_types.extend(fk.iter().map(|&m| in_types[nc + nx + m].clone()));
    arg_types.extend(fy.iter().map(|&j| out_types[nc + j].clone()));
    arg_types.extend(in_types.iter().cloned());
    let (open, args) = region::open(&arg_types);
    let (ct_c, rest) = args.split_at(fc.len());
    let (acc, rest) = rest.split_at(fk.len());
    let (ct_y, fwd_args) = rest.split_at(fy.len());
    let (c, rest) = fwd_args.split_at(nc);
    let (x, k) = rest.split_at(nx);
    let outs = region::replay(&body, fwd_args);
    let mut seeds: Vec<(Tensor, Tensor)> = Vec::new();
    seeds.extend(fc.iter().zip(ct_c).map(|(&i, &g)| (outs[i], g)));
    seeds.extend(fy.iter().zip(ct_y).map(|(&j, &g)| (outs[nc + j], g)));
    let wrt: Vec<Tensor> = fc
        .iter()
        .map(|&i| c[i])
        .chain(fx.iter().map(|&j| x[j]))
        .chain(fk.iter().map(|&m| k[m]))
        .collect();
    let g = backprop(&seeds, &wrt, open.start);
    let (g_c, rest) = g.split_at(fc.len());
    let (g_x, g_k) = rest.split_at(fx.len());
    let mut bwd_out: Vec<Tensor> = Vec::new();
    bwd_out.extend(
        fc.iter()
            .zip(g_c)
            .map(|(&i, g)| g.unwrap_or_else(|| c[i].zeros_like())),
    );
    bwd_out.extend(acc.iter().zip(g_k).map(|(&a, g)| match g {
        Some(g) => a + *g,
        None => a,
    }));
    bwd_out.extend(
        fx.iter()
            .zip(g_x)
            .map(|(&j, g)| g.unwrap_or_else(|| x[j].zeros_like())),
    );

    // What the backward body reads of the forward pass: its residuals.
    let cotangent_args: Vec<NodeId> = ct_c.iter().chain(acc).chain(ct_y).map(|a| a.node).collect();
    let carry_args: Vec<NodeId> = c.iter().map(|a| a.node).collect();
    let slice_args: Vec<NodeId> = x.iter().map(|a| a.node).collect();
    let given: Vec<NodeId> = x.iter().chain(k).map(|a| a.node).collect();
    let out_nodes: Vec<NodeId> = bwd_out.iter().map(|t| t.node).collect();
    let roles = Roles {
        cotangents: &cotangent_args,
        carries: &carry_args,
        slices: &slice_args,
        given: &given,
    };
    let residuals =
        with_recording(|r| residuals(&r.graph, open.start, &roles, &out_nodes, op.remat));

    let mut bwd_params = cotangent_args.clone();
    bwd_params.extend(&residuals);
    bwd_params.extend(&given);
    let bwd = region::extract(open.start, &bwd_params, &out_nodes);
    // The forward body, with the residuals as extra per-iteration outputs.
    let fwd = match op.remat {
        Remat::Save => {
            let params: Vec<NodeId> = fwd_args.iter().map(|a| a.node).collect();
            let mut outputs: Vec<NodeId> = outs.iter().map(|o| o.node).collect();
            outputs.extend(&residuals);
            region::extract(open.start, &params, &outputs).and_then(|e| {
                if e.captures.is_empty() {
                    Ok(e.graph)
                } else {
                    Err("the replayed forward body read a value from outside it".into())
                }
            })
        }
        Remat::Recompute => {
            let mut g: Graph = (*body).clone();
            for &res in &residuals {
                let k = carry_args.iter().position(|&a| a == res).unwrap_or(0);
                g.outputs.push(g.inputs[k].node);
            }
            Ok(g)
        }
    };
    region::close(open);
    let (bwd, fwd) = match (bwd, fwd) {
        (Ok(b), Ok(f)) => (b, f),
        (Err(m), _) | (_, Err(m)) => {
            with_recording(|r| r.fail("scan", m, at, crate::ops::f32_scalar()));
            return vec![None; inputs.len()];
        }
    };

    // The forward loop, rewritten in place to also stack the residuals.
    let residual_stacks: Vec<Tensor> = if residuals.is_empty() {
        Vec::new()
    } else {
        let extra = fwd.outputs.len() - body.outputs.len();
        let new = ScanOp {
            body: Arc::new(fwd),
            ..op.clone()
        };
        let types = new.result_types();
        with_recording(|r| {
            r.graph.nodes[s as usize].op = Op::Scan(Box::new(new));
            let first = types.len() - extra;
            (first..types.len())
                .map(|index| {
                    let node = r
                        .graph
                        .push(Op::Result { index }, vec![s], types[index].clone());
                    Tensor { node, trace }
                })
                .collect()
        })
    };

    // The backward loop.
    let mut init: Vec<Tensor> = fc
        .iter()
        .map(|&i| ct(i).unwrap_or_else(|| zeros(&result_types[i])))
        .collect();
    init.extend(fk.iter().map(|&m| zeros(&in_types[nc + nx + m])));
    let mut stacked: Vec<Tensor> = fy
        .iter()
        .map(|&j| ct(nc + j).unwrap_or_else(|| zeros(&result_types[nc + j])))
        .collect();
    stacked.extend(residual_stacks);
    stacked.extend(inputs[nc..nc + nx].iter().map(|&i| t(i)));
    let mut invariants: Vec<Tensor> = inputs[nc + nx..].iter().map(|&i| t(i)).collect();
    invariants.extend(bwd.captures.iter().map(|&i| t(i)));
    let back = ScanOp {
        body: Arc::new(bwd.graph),
        length: op.length,
        reverse: !op.reverse,
        carry: init.len(),
        xs: stacked.len(),
        remat: op.remat,
    };
    let all: Vec<Tensor> = init
        .iter()
        .chain(&stacked)
        .chain(&invariants)
        .copied()
        .collect();
    let results = push(back, &all, at);
    if results.len() != fc.len() + fk.len() + fx.len() {
        return vec![None; inputs.len()];
    }
    let mut out = vec![None; inputs.len()];
    for (n, &i) in fc.iter().enumerate() {
        out[i] = Some(results[n]);
    }
    for (n, &m) in fk.iter().enumerate() {
        out[nc + nx + m] = Some(results[fc.len() + n]);
    }
    for (n, &j) in fx.iter().enumerate() {
        out[nc + j] = Some(results[fc.len() + fk.len() + n]);
    }
    out
}

/// The backward body's arguments by role.
#[derive(Clone, Copy)]
struct Roles<'a> {
    /// The cotangents of the carry, the invariants' accumulated cotangents, and the
    /// per-iteration outputs' cotangents.
    cotangents: &'a [NodeId],
    /// This iteration's carry, going in.
    carries: &'a [NodeId],
    /// This iteration's slices.
    slices: &'a [NodeId],
    /// The slices, then the invariants: what the backward loop gets as they are.
    given: &'a [NodeId],
}

/// Whether a forward value is cheaper to recompute in the backward body than to stack: an
/// element-wise or layout op, which XLA fuses into the ops that read it.
fn recomputable(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_)
            | Op::Binary(_)
            | Op::Compare(_)
            | Op::Select
            | Op::Convert
            | Op::StopGradient
            | Op::Shard(_)
            | Op::Clamp
            | Op::BitcastConvert
            | Op::BroadcastInDim { .. }
            | Op::Reshape
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Reverse { .. }
            | Op::Iota { .. }
            | Op::Constant(_)
    )
}

/// The forward values the backward body reads, in node order: walking back from its outputs,
/// a value that does not depend on a cotangent but does change from one iteration to the next
/// (it depends on the carry or a slice) is a residual, and the walk stops there — unless it is
/// element-wise or a layout op ([`recomputable`]), which the backward body recomputes from its
/// operands instead, so only products, reductions and the like (and carries) are stacked.
/// Slices and invariants (`given`) come in as they are, so they are never residuals; values
/// that change nothing between iterations are recomputed. Under [`Remat::Recompute`] only
/// carries are residuals: everything else is recomputed.
fn residuals(
    g: &Graph,
    start: usize,
    roles: &Roles<'_>,
    outputs: &[NodeId],
    remat: Remat,
) -> Vec<NodeId> {
    let Roles {
        cotangents,
        carries,
        slices,
        given,
    } = *roles;
    let end = g.nodes.len();
    let local = |i: NodeId| (i as usize) >= start;
    let mut backward = vec![false; end - start];
    let mut varying = vec![false; end - start];
    for i in start..end {
        let id = i as NodeId;
        let n = &g.nodes[i];
        let ins = || n.inputs.iter().filter(|&&j| local(j));
        backward[i - start] =
            cotangents.contains(&id) || ins().any(|&j| backward[j as usize - start]);
        varying[i - start] = carries.contains(&id)
            || slices.contains(&id)
            || ins().any(|&j| varying[j as usize - start]);
    }
    let mut live = vec![false; end - start];
    let mut cut = vec![false; end - start];
    for &o in outputs {
        if local(o) {
            live[o as usize - start] = true;
        }
    }
    for i in (start..end).rev() {
        if !live[i - start] {
            continue;
        }
        let id = i as NodeId;
        let residual = match remat {
            Remat::Recompute => carries.contains(&id),
            Remat::Save => {
                !backward[i - start]
                    && varying[i - start]
                    && !given.contains(&id)
                    && (carries.contains(&id) || !recomputable(&g.nodes[i].op))
            }
        };
        if residual {
            cut[i - start] = true;
            continue;
        }
        for &j in &g.nodes[i].inputs {
            if local(j) {
                live[j as usize - start] = true;
            }
        }
    }
    (start..end)
        .filter(|&i| cut[i - start])
        .map(|i| i as NodeId)
        .collect()
}

/// The type a scan node declares (that of its first result) for operands of `types`, or what
/// is wrong (the interpreter's check of a hand-built graph).
pub(crate) fn check(op: &ScanOp, types: &[&LeafType]) -> Result<LeafType, String> {
    let body = op.body.input_types();
    if types.len() != body.len() || op.carry + op.xs > body.len() {
        return Err(format!(
            "it has {} operands but its body takes {}",
            types.len(),
            body.len()
        ));
    }
    if op.length == 0 {
        return Err("its trip count is 0".into());
    }
    if i32::try_from(op.length).is_err() {
        return Err(format!(
            "its trip count {} is past 2^31 − 1, the most its i32 counter holds",
            op.length
        ));
    }
    for (k, (t, b)) in types.iter().zip(&body).enumerate() {
        let want = if (op.carry..op.carry + op.xs).contains(&k) {
            let mut dims = vec![op.length];
            dims.extend(&b.dims);
            LeafType {
                dtype: b.dtype,
                dims,
            }
        } else {
            b.clone()
        };
        if **t != want {
            return Err(format!("operand {k} is {t} but the body needs {want}"));
        }
    }
    let outs = op.body.output_types();
    if outs.len() < op.carry || outs[..op.carry] != body[..op.carry] {
        return Err("its body's new carry does not have the carry's types".into());
    }
    op.result_types()
        .into_iter()
        .next()
        .ok_or_else(|| "it has no results".to_owned())
}

// The loops' text: what the emitter (`crate::emit`) writes for a scan and a while loop, once
// it has written each body as a private function of the module.

/// A scan: its body as a private function, and a `stablehlo.while` that calls it once per
/// iteration. The loop threads an `i32` counter, the carry, the stacked inputs, the
/// invariants and the stacked outputs (zeros at first); iteration `i` slices each stacked
/// input at `t` (`i`, or `length − 1 − i` in reverse) with `dynamic_slice`, and writes each
/// output at `t` with `dynamic_update_slice`. Names inside are `%wN_…`, `N` being the
/// scan's own number. The emitter has written the body as the private function `f`.
pub(crate) fn emit_scan(line: Line<'_>, op: &ScanOp, f: &str) -> fmt::Result {
    let Line {
        out,
        me,
        n,
        args: operand_names,
        arg_tys: operand_types,
        ..
    } = line;
    let operands = operand_names.len();

    let i32_ty = "tensor<i32>";
    let (nc, nx) = (op.carry, op.xs);
    let results = op.result_types();
    let body_in = op.body.input_types();
    let body_out = op.body.output_types();
    let ys: Vec<&LeafType> = results[nc..].iter().collect();
    let w = format!("%w{n}");
    writeln!(out, "    {w}_i0 = stablehlo.constant dense<0> : {i32_ty}")?;
    for (j, ty) in ys.iter().enumerate() {
        write!(out, "    {w}_y0_{j} = stablehlo.constant ")?;
        emit::zero_splat(out, ty);
        writeln!(out, " : {}", Ty(Some(ty)))?;
    }
    // The loop's values: counter, operands (carry, stacked inputs, invariants), outputs.
    let mut inits: Vec<String> = vec![format!("{w}_i0")];
    let mut types: Vec<String> = vec![i32_ty.to_owned()];
    inits.extend(operand_names);
    types.extend(operand_types);
    for (j, ty) in ys.iter().enumerate() {
        inits.push(format!("{w}_y0_{j}"));
        types.push(Ty(Some(ty)).to_string());
    }
    let arg = |k: usize| format!("{w}_a{k}");
    let args: Vec<String> = (0..inits.len()).map(arg).collect();
    while_head(out, &me, &args, &inits, &types)?;
    writeln!(
        out,
        "      {w}_n = stablehlo.constant dense<{}> : {i32_ty}",
        op.length
    )?;
    writeln!(
        out,
        "      {w}_go = stablehlo.compare LT, {}, {w}_n, SIGNED : ({i32_ty}, {i32_ty}) -> tensor<i1>",
        arg(0)
    )?;
    writeln!(out, "      stablehlo.return {w}_go : tensor<i1>")?;
    writeln!(out, "    }} do {{")?;
    writeln!(
        out,
        "      {w}_one = stablehlo.constant dense<1> : {i32_ty}"
    )?;
    writeln!(
        out,
        "      {w}_zero = stablehlo.constant dense<0> : {i32_ty}"
    )?;
    let t = if op.reverse {
        writeln!(
            out,
            "      {w}_last = stablehlo.constant dense<{}> : {i32_ty}",
            op.length - 1
        )?;
        writeln!(
            out,
            "      {w}_t = stablehlo.subtract {w}_last, {} : {i32_ty}",
            arg(0)
        )?;
        format!("{w}_t")
    } else {
        arg(0)
    };
    // Where each stacked input and output sits among the loop's values.
    let x_at = |j: usize| 1 + nc + j;
    let y_at = |j: usize| 1 + operands + j;
    let mut call_args: Vec<String> = (0..nc).map(|c| arg(1 + c)).collect();
    for j in 0..nx {
        let slice = &body_in[nc + j];
        let stacked = Ty(Some(&LeafType {
            dtype: slice.dtype,
            dims: std::iter::once(op.length)
                .chain(slice.dims.iter().copied())
                .collect(),
        }));
        let one_row = LeafType {
            dtype: slice.dtype,
            dims: std::iter::once(1)
                .chain(slice.dims.iter().copied())
                .collect(),
        };
        let sizes: Vec<usize> = one_row.dims.clone();
        write!(
            out,
            "      {w}_xs{j} = stablehlo.dynamic_slice {}, {t}",
            arg(x_at(j))
        )?;
        for _ in &slice.dims {
            write!(out, ", {w}_zero")?;
        }
        write!(out, ", sizes = {} : ({stacked}", List(&sizes))?;
        for _ in 0..=slice.dims.len() {
            write!(out, ", {i32_ty}")?;
        }
        writeln!(out, ") -> {}", Ty(Some(&one_row)))?;
        writeln!(
            out,
            "      {w}_x{j} = stablehlo.reshape {w}_xs{j} : ({}) -> {}",
            Ty(Some(&one_row)),
            Ty(Some(slice))
        )?;
        call_args.push(format!("{w}_x{j}"));
    }
    for c in nc + nx..operands {
        call_args.push(arg(1 + c));
    }
    let in_tys: Vec<String> = body_in.iter().map(|t| Ty(Some(t)).to_string()).collect();
    let out_tys: Vec<String> = body_out.iter().map(|t| Ty(Some(t)).to_string()).collect();
    let r = format!("{w}_r");
    let part = |k: usize| {
        if body_out.len() == 1 {
            r.clone()
        } else {
            format!("{r}#{k}")
        }
    };
    let head = if body_out.len() == 1 {
        r.clone()
    } else {
        format!("{r}:{}", body_out.len())
    };
    writeln!(
        out,
        "      {head} = func.call {f}({}) : ({}) -> ({})",
        call_args.join(", "),
        in_tys.join(", "),
        out_tys.join(", ")
    )?;
    let mut next: Vec<String> = vec![format!("{w}_next")];
    next.extend((0..nc).map(part));
    next.extend((nc + 1..=operands).map(arg));
    for (j, ty) in ys.iter().enumerate() {
        let row = &body_out[nc + j];
        let one_row = LeafType {
            dtype: row.dtype,
            dims: std::iter::once(1).chain(row.dims.iter().copied()).collect(),
        };
        writeln!(
            out,
            "      {w}_yu{j} = stablehlo.reshape {} : ({}) -> {}",
            part(nc + j),
            Ty(Some(row)),
            Ty(Some(&one_row))
        )?;
        write!(
            out,
            "      {w}_yn{j} = stablehlo.dynamic_update_slice {}, {w}_yu{j}, {t}",
            arg(y_at(j))
        )?;
        for _ in &row.dims {
            write!(out, ", {w}_zero")?;
        }
        write!(out, " : ({}, {}", Ty(Some(ty)), Ty(Some(&one_row)))?;
        for _ in 0..=row.dims.len() {
            write!(out, ", {i32_ty}")?;
        }
        writeln!(out, ") -> {}", Ty(Some(ty)))?;
        next.push(format!("{w}_yn{j}"));
    }
    writeln!(
        out,
        "      {w}_next = stablehlo.add {}, {w}_one : {i32_ty}",
        arg(0)
    )?;
    while_tail(out, &next, &types)
}

/// A while loop: it threads the carry and the invariants; the condition region calls the
/// body function (condition and new carry at once) and returns its first result, the body
/// region calls it and returns the rest (XLA drops the unused half of each after inlining). The
/// emitter has written the body as the private function `f`.
pub(crate) fn emit_while(line: Line<'_>, op: &WhileOp, f: &str) -> fmt::Result {
    let Line {
        out,
        me,
        n,
        args: inits,
        arg_tys: types,
        ..
    } = line;
    let w = format!("%w{n}");
    let outs: Vec<String> = op
        .body
        .output_types()
        .iter()
        .map(|t| Ty(Some(t)).to_string())
        .collect();
    let args: Vec<String> = (0..inits.len()).map(|k| format!("{w}_a{k}")).collect();
    let call = format!(
        "func.call {f}({}) : ({}) -> ({})",
        args.join(", "),
        types.join(", "),
        outs.join(", ")
    );
    let results = outs.len();
    while_head(out, &me, &args, &inits, &types)?;
    writeln!(out, "      {w}_c:{results} = {call}")?;
    writeln!(out, "      stablehlo.return {w}_c#0 : tensor<i1>")?;
    writeln!(out, "    }} do {{")?;
    writeln!(out, "      {w}_b:{results} = {call}")?;
    let mut next: Vec<String> = (1..results).map(|k| format!("{w}_b#{k}")).collect();
    next.extend(args[op.carry..].iter().cloned());
    while_tail(out, &next, &types)
}

/// A loop's first lines: `{me}:{n} = stablehlo.while(` each region argument bound to its
/// initial value, the types, and the condition region's opening.
fn while_head(
    out: &mut String,
    me: &str,
    args: &[String],
    inits: &[String],
    types: &[String],
) -> fmt::Result {
    write!(out, "    {me}:{} = stablehlo.while(", inits.len())?;
    for (k, (arg, init)) in args.iter().zip(inits).enumerate() {
        let sep = if k == 0 { "" } else { ", " };
        write!(out, "{sep}{arg} = {init}")?;
    }
    writeln!(out, ") : {}", types.join(", "))?;
    writeln!(out, "     cond {{")
}

/// A loop's last lines: the body region's `stablehlo.return` of the next values, and the
/// loop's close.
fn while_tail(out: &mut String, next: &[String], types: &[String]) -> fmt::Result {
    writeln!(
        out,
        "      stablehlo.return {} : {}",
        next.join(", "),
        types.join(", ")
    )?;
    writeln!(out, "    }}")
}
