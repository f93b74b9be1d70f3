// Traced code reads GraphConst fields by reference and Device fields as mirrors of tensors.
#![deny(warnings)]

use nitro::prelude::*;

#[derive(ContentHash)]
pub struct Arch {
    pub depth: usize,
    pub residual: bool,
}

#[derive(Tree)]
pub struct Dense {
    pub w: Array,
    pub b: Array,
}

#[derive(Tree)]
pub struct Norm(pub Array, pub Option<Array>);

#[experiment]
pub struct Model {
    #[graph_const]
    pub arch: Arch,
    #[device(trainable)]
    pub layers: Vec<Dense>,
    #[device(trainable)]
    pub norm: Norm,
    #[device]
    pub lr: Array,
    #[device]
    pub pair: (Array, [Array; 2]),
    pub steps: u64,
}

fn dense(l: &DenseMirror<Tensor>, x: Tensor) -> Tensor {
    let _ = (l.w, l.b);
    x
}

fn forward(v: &ModelView<'_>, mut x: Tensor) -> Tensor {
    let arch: &Arch = v.arch;
    for layer in v.layers.iter().take(arch.depth) {
        x = dense(layer, x);
    }
    let NormMirror(_scale, shift) = &v.norm;
    let _: Option<Tensor> = *shift;
    let _: (Tensor, [Tensor; 2]) = v.pair;
    if arch.residual {
        x
    } else {
        v.lr
    }
}

fn main() {
    let _ = forward;
    let m = Model {
        arch: Arch {
            depth: 1,
            residual: true,
        },
        layers: Vec::new(),
        norm: Norm(Array::zeros(DType::F32, &[1]), None),
        lr: Array::scalar(0.1f32),
        pair: (
            Array::scalar(1i32),
            [Array::scalar(2i32), Array::scalar(3i32)],
        ),
        steps: 0,
    };
    let _ = (m.steps, m.device_signature());
}
