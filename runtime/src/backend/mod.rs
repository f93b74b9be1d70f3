//! Backends that run graphs: the reference interpreter (and XLA through PJRT).

pub mod interp;
