//! The recording of a trace: [`Tensor`], the thread's active [`Recording`] of a [`Graph`], the
//! first mistake ([`TraceError`]), and the entry points that start a trace. The bottom of
//! tracing: the op families in [`crate::ops`], autodiff and loop bodies build on it, and it
//! builds on none of them.

use std::cell::RefCell;
use std::collections::HashSet;
use std::panic::{self, AssertUnwindSafe, Location};
use std::sync::atomic::{AtomicU32, Ordering};

use super::ir::{ClassInput, Graph, Input, NodeId, Op};
use crate::error::{Error, Result, TraceError};
use crate::tree::LeafType;

/// A handle to a value in the trace being recorded: small and `Copy`.
///
/// Tensors are made by the tracer (program inputs, the leaves of a compile view) and by
/// operations on other tensors. Arithmetic operators broadcast like NumPy (trailing dims align;
/// a dim of 1 stretches), and `f64` scalars take the other operand's dtype:
/// `x * 2.0`, `1.0 - y`, `a + b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tensor {
    pub(crate) node: NodeId,
    pub(crate) trace: u32,
}

impl Tensor {
    /// The index of this tensor's node in its trace's graph.
    pub fn node(self) -> NodeId {
        self.node
    }

    /// The dtype and dims.
    pub fn ty(self) -> LeafType {
        with_recording(|r| r.graph.ty(self.node).clone())
    }

    /// The dims (empty for a scalar).
    pub fn dims(self) -> Vec<usize> {
        self.ty().dims
    }

    /// The number of dims.
    pub fn rank(self) -> usize {
        self.ty().dims.len()
    }

    /// The element type.
    pub fn dtype(self) -> crate::DType {
        self.ty().dtype
    }
}

pub(crate) struct Recording {
    /// The id tensors made now get: the trace's own, or that of the innermost open scan body.
    pub(crate) id: u32,
    pub(crate) graph: Graph,
    error: Option<TraceError>,
    /// The ids of the scopes enclosing the innermost open scan body, outermost first (empty
    /// outside a body): their tensors may be read inside it (they become the body's captures).
    pub(crate) scopes: Vec<u32>,
}

thread_local! {
    static ACTIVE: RefCell<Option<Recording>> = const { RefCell::new(None) };
}

pub(crate) static NEXT_TRACE: AtomicU32 = AtomicU32::new(1);

thread_local! {
    /// The ids of the scan bodies closed on this thread (for the error on a tensor kept from
    /// one).
    static CLOSED: RefCell<HashSet<u32>> = RefCell::new(HashSet::new());
}

/// A scan body's scope `id` was closed ([`crate::trace::region`]): its tensors are dead.
pub(crate) fn body_closed(id: u32) {
    CLOSED.with(|c| c.borrow_mut().insert(id));
}

/// Whether `id` was the scope of a closed body on this thread.
fn was_body(id: u32) -> bool {
    CLOSED.with(|c| c.borrow().contains(&id))
}

/// Runs `f` on the active recording; panics (a programming error, caught at the trace
/// boundary) if no trace is active on this thread.
pub(crate) fn with_recording<R>(f: impl FnOnce(&mut Recording) -> R) -> R {
    ACTIVE.with(|a| {
        let mut a = a.borrow_mut();
        match a.as_mut() {
            Some(r) => f(r),
            None => panic!(
                "a nitro Tensor was used outside a trace; tensors exist only while a program is \
                 being traced"
            ),
        }
    })
}

thread_local! {
    /// Where user code called the library function being traced ([`caller_scope`]).
    static CALLER: std::cell::Cell<Option<&'static Location<'static>>> =
        const { std::cell::Cell::new(None) };
}

/// Whether `at` is in nitro's own source (this crate's `src/`): the location of an op that a
/// layer or a composition of the library traces, not of the user's code.
fn in_library(at: &Location<'_>) -> bool {
    // This file is `<src>/trace/record.rs` (with either path separator): `<src>` is the root.
    const HERE: &str = file!();
    let root = &HERE[..HERE.len().saturating_sub("trace/record.rs".len())];
    !root.is_empty() && at.file().starts_with(root)
}

/// The location an error of an op traced at `at` names: `at` itself in user code; inside the
/// library, the user's call of the library function that traced it ([`caller_scope`]).
fn reported(at: &Location<'_>) -> String {
    let user = match in_library(at) {
        true => CALLER.with(std::cell::Cell::get),
        false => None,
    };
    match user {
        Some(u) => format!("{}:{}:{}", u.file(), u.line(), u.column()),
        None => format!("{}:{}:{}", at.file(), at.line(), at.column()),
    }
}

/// Restores the caller a [`caller_scope`] replaced when dropped.
pub(crate) struct CallerScope(Option<Option<&'static Location<'static>>>);

impl Drop for CallerScope {
    fn drop(&mut self) {
        if let Some(before) = self.0 {
            CALLER.with(|c| c.set(before));
        }
    }
}

/// Marks the start of a library function that traces ops (a layer's forward pass, an
/// activation), called from its caller's location (`#[track_caller]` all the way up): until
/// the guard is dropped, an error of an op traced inside the library names that location — the
/// user's line — instead of the library's. A call from inside the library keeps the location
/// of the outermost call from user code.
#[track_caller]
pub(crate) fn caller_scope() -> CallerScope {
    let at = Location::caller();
    if in_library(at) {
        return CallerScope(None);
    }
    CallerScope(Some(CALLER.with(|c| c.replace(Some(at)))))
}

impl Recording {
    /// Records the first error and returns a stand-in tensor of type `ty`. An op traced inside
    /// the library reports its user's call instead ([`caller_scope`]).
    pub(crate) fn fail(
        &mut self,
        op: &'static str,
        message: String,
        at: &Location<'_>,
        ty: LeafType,
    ) -> Tensor {
        if self.error.is_none() {
            self.error = Some(TraceError {
                op,
                message,
                location: reported(at),
            });
        }
        self.stand_in(ty)
    }

    /// Whether the trace has failed.
    pub(crate) fn failed(&self) -> bool {
        self.error.is_some()
    }

    pub(crate) fn stand_in(&mut self, ty: LeafType) -> Tensor {
        let node = self
            .graph
            .push(Op::Parameter { index: usize::MAX }, Vec::new(), ty);
        Tensor {
            node,
            trace: self.id,
        }
    }

    /// Appends a node of type `ty`, or, when `ty` is over the size limit
    /// ([`crate::MAX_TENSOR_BYTES`]), records that as the error of `op` (the user's op) at `at`
    /// and returns a stand-in.
    pub(crate) fn push(
        &mut self,
        node: Op,
        inputs: Vec<NodeId>,
        ty: LeafType,
        op: &'static str,
        at: &Location<'_>,
    ) -> Tensor {
        if !ty.within_limit() {
            let message = too_large(&ty, &inputs, &self.graph);
            return self.fail(op, message, at, ty);
        }
        let node = self.graph.push(node, inputs, ty);
        Tensor {
            node,
            trace: self.id,
        }
    }

    /// Whether `t` may be read here: it belongs to this trace, in the scope being recorded or
    /// one enclosing it.
    pub(crate) fn sees(&self, t: Tensor) -> bool {
        (t.trace == self.id || self.scopes.contains(&t.trace))
            && (t.node as usize) < self.graph.nodes.len()
    }

    /// Whether `t` may be read here ([`Recording::sees`]); records an error if not.
    pub(crate) fn owns(&mut self, t: Tensor, op: &'static str, at: &Location<'_>) -> bool {
        if self.sees(t) {
            return true;
        }
        let ty = LeafType {
            dtype: crate::DType::F32,
            dims: Vec::new(),
        };
        let message = if was_body(t.trace) {
            "a tensor made inside a scan body was used outside it; return it from the body \
             (as part of the carry or the per-iteration outputs) instead"
        } else {
            "a tensor from another trace was used; tensors cannot be kept from one trace to the next"
        };
        self.fail(op, message.into(), at, ty);
        false
    }
}

/// Records `message` as the trace's error for `op`, without a source location (for checks
/// nitro makes on what user code returned, such as a loss's shape). The first error of a trace
/// wins.
pub(crate) fn refuse(op: &'static str, message: String) {
    with_recording(|r| {
        if r.error.is_none() {
            r.error = Some(TraceError {
                op,
                message,
                location: String::new(),
            });
        }
    });
}

/// Records `message` as the trace's error for the layer `op`, at the caller's location, and
/// returns a stand-in of `like`'s type for the layer to return (the trace fails when it ends;
/// the first error of a trace wins).
#[track_caller]
pub(crate) fn refuse_at(op: &'static str, message: String, like: Tensor) -> Tensor {
    let at = Location::caller();
    with_recording(|r| {
        let ty = if r.sees(like) {
            r.graph.ty(like.node).clone()
        } else {
            LeafType::new(crate::DType::F32, &[])
        };
        r.fail(op, message, at, ty)
    })
}

/// Notes that `labels` is read as class indices in `0..classes` by `op` when it is a program
/// input ([`Graph::class_inputs`]); a computed tensor is not noted (its values are not known
/// before the program runs).
pub(crate) fn note_class_input(labels: Tensor, classes: usize, op: &'static str) {
    with_recording(|r| {
        if !r.sees(labels) {
            return;
        }
        let Some(node) = r.graph.nodes.get(labels.node as usize) else {
            return;
        };
        let Op::Parameter { index } = node.op.clone() else {
            return;
        };
        if index == usize::MAX || r.graph.class_inputs.iter().any(|c| c.input == index) {
            return;
        }
        r.graph.class_inputs.push(ClassInput {
            input: index,
            classes,
            op,
        });
    });
}

/// The message for a result type over the size limit, with the operands' types.
fn too_large(ty: &LeafType, inputs: &[NodeId], graph: &Graph) -> String {
    let mut message = format!(
        "the result {ty} is too large: its element size times its dims (each counted as at \
         least 1) is {}, over the limit of {} bytes (nitro::MAX_TENSOR_BYTES, 2^63 - 1)",
        ty.describe_size(),
        crate::MAX_TENSOR_BYTES
    );
    if !inputs.is_empty() {
        let operands: Vec<String> = inputs.iter().map(|&i| graph.ty(i).to_string()).collect();
        message.push_str(&format!(" (operands {})", operands.join(", ")));
    }
    message.push_str("; use smaller dims");
    message
}

/// Records a program: creates one parameter per `(name, type)` input, runs `body` on them, and
/// returns the graph with `body`'s tensors as outputs.
///
/// Errors: the first shape or dtype mistake in `body` ([`Error::Trace`]), an input or a tensor
/// over the size limit ([`crate::MAX_TENSOR_BYTES`], also [`Error::Trace`]), a panic in
/// `body` ([`Error::TracePanic`]), or a trace already active on this thread.
#[track_caller]
pub fn trace(
    inputs: &[(String, LeafType)],
    body: impl FnOnce(&[Tensor]) -> Vec<Tensor>,
) -> Result<Graph> {
    let at = Location::caller();
    trace_with(|| {
        let tensors: Vec<Tensor> = inputs
            .iter()
            .map(|(name, ty)| with_recording(|r| r.input(name, ty.clone(), at)))
            .collect();
        body(&tensors)
    })
}

/// Records a program whose inputs are created inside `body` with [`input`]; the tensors `body`
/// returns are the outputs. See [`trace`] for the errors.
pub fn trace_with(body: impl FnOnce() -> Vec<Tensor>) -> Result<Graph> {
    trace_replicated(1, body)
}

/// Like [`trace_with`], for a program that runs as `replicas` copies at once, one per device
/// ([`Graph::replicas`]): [`Tensor::all_sum`] sums over them. `replicas` below 1 counts as 1.
pub fn trace_replicated(replicas: usize, body: impl FnOnce() -> Vec<Tensor>) -> Result<Graph> {
    let id = NEXT_TRACE.fetch_add(1, Ordering::Relaxed);
    let started = ACTIVE.with(|a| {
        let mut a = a.borrow_mut();
        if a.is_some() {
            return false;
        }
        *a = Some(Recording {
            id,
            graph: Graph {
                replicas: replicas.max(1),
                ..Graph::default()
            },
            error: None,
            scopes: Vec::new(),
        });
        true
    });
    if !started {
        return Err(Error::NestedTrace);
    }
    let outcome = panic::catch_unwind(AssertUnwindSafe(body));
    let Some(mut rec) = ACTIVE.with(|a| a.borrow_mut().take()) else {
        return Err(Error::NestedTrace);
    };
    let outputs = match outcome {
        Ok(outputs) => outputs,
        Err(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with a non-text payload".to_owned());
            return Err(Error::TracePanic { message });
        }
    };
    if let Some(e) = rec.error.take() {
        return Err(Error::Trace(Box::new(e)));
    }
    for t in &outputs {
        if t.trace != rec.id {
            return Err(Error::Trace(Box::new(TraceError {
                op: "output",
                message: "a program returned a tensor from another trace".into(),
                location: String::new(),
            })));
        }
    }
    rec.graph.outputs = outputs.iter().map(|t| t.node).collect();
    Ok(rec.graph)
}

/// Creates the next program input, named `name` (a leaf path such as `layers[0].w`). Must be
/// called while a trace is active ([`trace_with`]). An input type over the size limit
/// ([`crate::MAX_TENSOR_BYTES`]) fails the trace, naming the input and the caller's line.
#[track_caller]
pub fn input(name: &str, ty: LeafType) -> Tensor {
    let at = Location::caller();
    with_recording(|r| r.input(name, ty, at))
}

impl Recording {
    fn input(&mut self, name: &str, ty: LeafType, at: &Location<'_>) -> Tensor {
        if !self.scopes.is_empty() {
            return self.fail(
                "input",
                format!(
                    "program input `{name}` was created inside a scan body; create inputs \
                     before the scan and read them in the body (they are passed in as \
                     loop invariants)"
                ),
                at,
                ty,
            );
        }
        if !ty.within_limit() {
            let message = format!(
                "input `{name}`: {}",
                too_large(&ty, &[], &self.graph).trim_start_matches("the result ")
            );
            return self.fail("input", message, at, ty);
        }
        let index = self.graph.inputs.len();
        let node = self
            .graph
            .push(Op::Parameter { index }, Vec::new(), ty.clone());
        self.graph.inputs.push(Input {
            name: name.to_owned(),
            ty,
            node,
        });
        Tensor {
            node,
            trace: self.id,
        }
    }
}

/// How many replicas the program being traced on this thread runs as (1 outside a trace, and
/// for programs on one device).
pub fn replicas() -> usize {
    ACTIVE.with(|a| a.borrow().as_ref().map_or(1, |r| r.graph.replicas))
}

/// Whether a trace is active on this thread.
pub fn is_tracing() -> bool {
    ACTIVE.with(|a| a.borrow().is_some())
}
