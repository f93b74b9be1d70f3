//! Traced values.
//!
//! A [`Tensor`] is the handle traced code holds for a value in the program being recorded:
//! every `Array` leaf of a `#[device]` field appears as a `Tensor` in the compile view. The
//! recorder and the operations on tensors are built by the tracing layer; this module fixes the
//! handle type so that views, trees and experiments can name it.

/// A handle to a value in a trace: small and `Copy`, identified by its node in the recorded
/// graph.
///
/// Tensors are created only by the tracer when it builds an experiment's compile view; user
/// code never constructs one from nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tensor {
    node: u32,
}

impl Tensor {
    /// The index of this tensor's node in its trace.
    pub fn node(self) -> u32 {
        self.node
    }

    #[doc(hidden)]
    pub fn __from_node(node: u32) -> Tensor {
        Tensor { node }
    }
}
