// Traced code sees a Device field's leaves as tensors, never as the host arrays.
use nitro::prelude::*;

#[experiment]
pub struct Probe {
    #[device(trainable)]
    pub w: Array,
}

fn forward(v: &ProbeView<'_>) -> usize {
    let w: &Array = &v.w;
    w.len()
}

fn main() {
    let _ = forward;
}
