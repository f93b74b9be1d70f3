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
}
