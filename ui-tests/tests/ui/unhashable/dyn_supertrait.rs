// A trait with `ContentHash` as a supertrait cannot become a trait object: two lists of
// different concrete layers with equal contents would share a compile key.
use nitro::{ContentHash, Tensor};

trait Layer: ContentHash {
    fn apply(&self, x: Tensor) -> Tensor;
}

#[derive(ContentHash)]
struct TanhL;

impl Layer for TanhL {
    fn apply(&self, x: Tensor) -> Tensor {
        x.tanh()
    }
}

#[nitro::experiment]
struct Net {
    #[graph_const]
    layers: Vec<Box<dyn Layer>>,
}

fn main() {
    let _ = Net { layers: vec![Box::new(TanhL)] };
}
