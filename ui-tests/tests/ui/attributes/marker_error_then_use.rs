// After a marker error, code that uses the experiment should see only the marker error.
use nitro::prelude::*;

#[experiment]
pub struct Probe {
    #[device(sharded)]
    pub w: Array,
}

fn forward(v: &ProbeView<'_>) -> Tensor {
    v.w
}

fn main() {
    let _ = forward;
    let p = Probe {
        w: Array::scalar(1.0f32),
    };
    let _ = p.graph_const_digest();
}
