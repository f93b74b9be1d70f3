//! The reference interpreter: runs a graph on host arrays in pure Rust.
