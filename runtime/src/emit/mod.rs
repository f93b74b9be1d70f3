//! StableHLO emission: a [`Graph`](crate::trace::Graph) as deterministic MLIR text.
