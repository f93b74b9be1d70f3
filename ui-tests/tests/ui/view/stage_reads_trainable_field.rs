// A cached stage sees only GraphConst and frozen fields: its view has no trainable field, so a
// stage that reads one (here the head it would feed) does not compile.
use nitro::prelude::*;
use nitro::stage::Stage;

#[experiment]
pub struct Probe {
    #[device(frozen)]
    pub encoder: Array,
    #[device(trainable)]
    pub head: Array,
}

impl Stage for Probe {
    const NAME: &'static str = "encode";
    const INPUT: &'static str = "x";
    const OUTPUT: &'static str = "features";
    const CACHED: bool = true;
    type Output = Tensor;

    fn run(v: &ProbeFrozenView<'_>, x: &Tensor) -> Tensor {
        x.matmul(v.encoder).matmul(v.head)
    }
}

fn main() {}
