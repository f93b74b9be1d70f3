//! Backends that run graphs: the reference interpreter (and XLA through PJRT).

pub mod interp;
pub mod pjrt;
