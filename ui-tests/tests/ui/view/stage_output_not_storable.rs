// A stage's output must be storable (`StageOutput`: a tensor); anything else is a compile error,
// not a stage that silently runs every epoch.
use nitro::prelude::*;
use nitro::stage::Stage;

#[experiment]
pub struct Probe {
    #[device(frozen)]
    pub encoder: Array,
}

impl Stage for Probe {
    const NAME: &'static str = "encode";
    const INPUT: &'static str = "x";
    const OUTPUT: &'static str = "features";
    const CACHED: bool = true;
    type Output = Vec<Tensor>;

    fn run(v: &ProbeFrozenView<'_>, x: &Tensor) -> Vec<Tensor> {
        vec![x.matmul(v.encoder)]
    }
}

fn main() {}
