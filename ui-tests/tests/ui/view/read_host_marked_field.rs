// A `#[host]` field is absent from the compile view, like an unmarked one.
use nitro::prelude::*;

#[experiment]
pub struct Probe {
    #[device(trainable)]
    pub w: Array,
    #[host]
    pub log: Vec<String>,
}

fn forward(v: &ProbeView<'_>, x: Tensor) -> Tensor {
    v.log.len();
    x
}

fn main() {
    let _ = forward;
}
