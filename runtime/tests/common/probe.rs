//! A small experiment with two programs, for tests of the persistent store.

use nitro::prelude::*;
use nitro::program::Program;

#[experiment]
pub struct Probe {
    #[graph_const]
    pub k: u32,
    #[device]
    pub w: Array,
}

fn step(v: &ProbeView<'_>, x: &Tensor) -> Tensor {
    (*x * v.w).tanh() * f64::from(*v.k)
}

fn other_step(v: &ProbeView<'_>, x: &Tensor) -> Tensor {
    *x + v.w
}

/// `tanh(x · w) · k`.
pub const STEP: Program<Probe, Tensor> = Probe::program("step", step);
/// `x + w`.
pub const OTHER: Program<Probe, Tensor> = Probe::program("other", other_step);

/// `k = 3`, `w = 0.5`, `x = 2`: STEP computes `3 · tanh(1)`.
pub fn probe() -> (Probe, Array) {
    (
        Probe {
            k: 3,
            w: Array::full(&[4], 0.5f32),
        },
        Array::full(&[4], 2.0f32),
    )
}
