//! Tracing: ordinary Rust over [`Tensor`]s records a static-shape dataflow [`Graph`].
//!
//! A trace is active on one thread at a time. While it is, every operation on a tensor appends a
//! node to its graph and checks shapes and dtypes. A mistake does not panic: the first one is
//! recorded with the op's name, the shapes involved and the **caller's source line**, the
//! operation returns a stand-in tensor so the traced code can run to its end, and the trace then
//! fails with that error ([`Error::Trace`](crate::Error::Trace)).
//!
//! ```
//! use nitro::trace::{trace, Tensor};
//! use nitro::{DType, LeafType};
//!
//! let x = LeafType { dtype: DType::F32, dims: vec![2, 3] };
//! let graph = trace(&[("x".into(), x)], |inputs| {
//!     let y = (inputs[0] * 2.0).tanh().sum(&[1]);
//!     vec![y]
//! })?;
//! assert_eq!(graph.output_types()[0].dims, vec![2]);
//!
//! // A shape mistake names the op, both shapes and this line.
//! let x = LeafType { dtype: DType::F32, dims: vec![2, 3] };
//! let err = trace(&[("x".into(), x)], |inputs| vec![inputs[0].matmul(inputs[0])]).unwrap_err();
//! assert!(err.to_string().contains("matmul"));
//! assert!(err.to_string().contains("f32[2,3]"));
//! assert!(err.to_string().contains(file!()));
//! # Ok::<(), nitro::Error>(())
//! ```

pub mod autodiff;
pub mod ir;
pub mod nn;
pub(crate) mod record;
pub(crate) mod region;

pub use crate::error::TraceError;
pub use crate::ops::elementwise::tracing::Operand;
pub use crate::ops::random;
pub use crate::ops::scan::{scan, while_loop, Scan};
pub use crate::ops::window::same_padding;
pub use autodiff::{grad, value_and_grad};
pub use ir::{
    BinaryOp, ClassInput, CmpOp, Conv, ConvDims, DotDims, GatherDims, Graph, Input, Node, NodeId,
    Op, ReduceOp, Remat, ScanOp, ScatterDims, ScatterKind, UnaryOp, WhileOp, Window,
};
pub(crate) use record::{caller_scope, refuse, refuse_at};
pub use record::{input, is_tracing, replicas, trace, trace_replicated, trace_with, Tensor};
