// A type parameter used only by Host fields: the view drops those fields but still compiles.
#![deny(warnings)]

use std::marker::PhantomData;

use nitro::prelude::*;

#[experiment]
pub struct Run<D, Log> {
    #[graph_const]
    pub width: usize,
    #[device]
    pub w: Array,
    pub data: Vec<D>,
    #[host]
    pub logger: PhantomData<Log>,
}

fn forward<D, Log>(v: &RunView<'_, D, Log>, x: Tensor) -> Tensor {
    let _ = *v.width;
    x
}

fn main() {
    let run = Run::<f32, ()> {
        width: 4,
        w: Array::zeros(DType::F32, &[4]),
        data: vec![1.0],
        logger: PhantomData,
    };
    let key = run.graph_const_digest();
    let again = Run::<u8, String> {
        width: 4,
        w: Array::zeros(DType::F32, &[4]),
        data: vec![1],
        logger: PhantomData,
    };
    // The GraphConst digest is seeded with the path alone, not the generic arguments.
    assert_eq!(again.graph_const_digest(), key);
    let _ = (run.data, forward::<f32, ()>);
}
