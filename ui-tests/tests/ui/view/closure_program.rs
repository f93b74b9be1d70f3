// A program is a `fn` item: a closure that captures a value (here `scale`) would put a value
// into the program that the compile key cannot see.
use nitro::prelude::*;

#[experiment]
pub struct Probe {
    #[graph_const]
    pub width: usize,
    #[device]
    pub w: Array,
}

fn main() {
    let scale = 3.0;
    let _p = Probe::program("scaled", |v: &ProbeView<'_>, x: &Tensor| *x * v.w * scale);
}
