// A frozen field is in the full view (models may read it) and in the frozen view (stages read
// it there); GraphConsts are in both.
use nitro::prelude::*;
use nitro::stage::Stage;

#[experiment]
pub struct Probe<const N: usize> {
    #[graph_const]
    pub gain: u32,
    #[device(frozen)]
    pub encoder: Vec<Array>,
    #[device(trainable)]
    pub head: Array,
    pub notes: String,
}

impl<const N: usize> Stage for Probe<N> {
    const NAME: &'static str = "encode";
    const INPUT: &'static str = "x";
    const OUTPUT: &'static str = "features";
    const CACHED: bool = true;
    type Output = Tensor;

    fn run(v: &ProbeFrozenView<'_, N>, x: &Tensor) -> Tensor {
        let z = v.encoder.iter().fold(*x, |h, w| h.matmul(*w).tanh());
        z * f64::from(*v.gain)
    }
}

fn forward<const N: usize>(v: &ProbeView<'_, N>, x: &Tensor) -> Tensor {
    x.matmul(v.encoder[0]).matmul(v.head)
}

fn main() {
    let _ = forward::<2>;
}
