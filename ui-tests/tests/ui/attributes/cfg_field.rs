// A field under #[cfg] would make the compile key differ between builds without saying so.
use nitro::prelude::*;

#[experiment]
pub struct Probe {
    #[graph_const]
    pub width: usize,
    #[cfg(any())]
    #[device]
    pub w: Array,
}

fn main() {}
