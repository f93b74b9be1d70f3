// A trait with `ContentHash` as a supertrait cannot become a trait object: two lists of
// different concrete layers with equal contents (`Tanh` and `Relu` unit structs) would share a
// compile key while emitting different programs.
use nitro::{ContentHash, Tensor};

trait Layer: ContentHash {
    fn apply(&self, x: Tensor) -> Tensor;
}

#[nitro::experiment]
struct Net {
    #[graph_const]
    layers: Vec<Box<dyn Layer>>,
}

fn main() {}
