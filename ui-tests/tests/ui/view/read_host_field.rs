// An unmarked field is Host: the compile view has no such field, so traced code cannot read it.
use nitro::prelude::*;

#[experiment]
pub struct Probe {
    #[graph_const]
    pub width: usize,
    #[device(trainable)]
    pub w: Array,
    pub data: Vec<f32>,
}

fn forward(v: &ProbeView<'_>, x: Tensor) -> Tensor {
    let _n = v.data.len();
    x
}

fn main() {
    let _ = forward;
}
