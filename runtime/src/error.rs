//! The error type of every fallible nitro call.

use crate::tree::DType;

/// A `Result` whose error is [`nitro::Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in nitro. Each message says what was wrong and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An array's data does not fill its dims.
    #[error("array dims {dims:?} need {expected} elements but the data has {got}; pass data whose length is the product of the dims")]
    ArrayLength {
        /// The requested dims.
        dims: Vec<usize>,
        /// Their product.
        expected: usize,
        /// The data length.
        got: usize,
    },

    /// An array was read as the wrong element type.
    #[error(
        "the array holds {got} elements, not {expected}; read it as {got} or convert it first"
    )]
    DTypeMismatch {
        /// The dtype asked for.
        expected: DType,
        /// The dtype held.
        got: DType,
    },

    /// A GraphConst field hashed differently across two hashes of equal values.
    #[error(
        "#[graph_const] field `{field}` of `{experiment}` is not hashable by content: \
         two hashes of equal values differ ({first} vs {second}); its ContentHash impl must \
         depend only on the value (no addresses, clocks, random state or iteration order)"
    )]
    UnstableGraphConstHash {
        /// The experiment type.
        experiment: &'static str,
        /// The field.
        field: &'static str,
        /// The digest of the value.
        first: crate::Digest,
        /// The digest of its clone (or of a second hash).
        second: crate::Digest,
    },

    /// A shape or dtype mistake in traced code, found while tracing.
    #[error("{}", describe_trace(.0))]
    Trace(Box<crate::trace::TraceError>),

    /// Traced code panicked.
    #[error("traced code panicked: {message}; programs must run to their end while being traced")]
    TracePanic {
        /// The panic message.
        message: String,
    },

    /// A program was run with the wrong number of inputs.
    #[error("the program takes {expected} inputs but was given {got}")]
    InputCount {
        /// Inputs the program declares.
        expected: usize,
        /// Inputs given.
        got: usize,
    },

    /// A program input has the wrong dtype or dims.
    #[error("input {index} (`{name}`) of the program must be {expected} but is {got}; a program is compiled for fixed shapes and dtypes")]
    InputType {
        /// Position of the input.
        index: usize,
        /// Its name (leaf path).
        name: String,
        /// The declared type.
        expected: crate::tree::LeafType,
        /// The given type.
        got: crate::tree::LeafType,
    },

    /// A trace was started while another was active on the same thread.
    #[error("a trace is already being recorded on this thread; programs cannot trace other programs")]
    NestedTrace,
}

fn describe_trace(e: &crate::trace::TraceError) -> String {
    if e.location.is_empty() {
        format!("`{}`: {}", e.op, e.message)
    } else {
        format!("`{}` at {}: {}", e.op, e.location, e.message)
    }
}
