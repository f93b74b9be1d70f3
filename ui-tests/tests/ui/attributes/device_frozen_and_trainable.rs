// A frozen field never changes while training, so it cannot also be trainable.
use nitro::prelude::*;

#[experiment]
pub struct Probe {
    #[device(frozen, trainable)]
    pub encoder: Array,
}

fn main() {}
