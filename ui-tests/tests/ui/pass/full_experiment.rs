// Every role, generics (type, lifetime and const parameters, bounds and a where clause), docs and
// other attributes on fields, all in one experiment.
#![deny(warnings)]

use nitro::prelude::*;

/// How the network is built.
#[derive(ContentHash, Clone, Debug)]
pub struct Arch {
    pub hidden: usize,
    pub activation: Activation,
}

/// The nonlinearity.
#[derive(ContentHash, Clone, Copy, Debug)]
pub enum Activation {
    Tanh,
    Relu,
}

/// One dense layer.
#[derive(Tree, Debug)]
pub struct Dense {
    pub w: Array,
    pub b: Array,
}

/// A generic run.
#[experiment]
#[derive(Debug)]
pub struct Run<'a, A, P: Tree, H, const N: usize>
where
    A: ContentHash + Clone,
{
    /// Shapes the graph.
    #[graph_const]
    pub arch: A,
    #[graph_const]
    pub widths: [usize; N],
    #[graph_const]
    pub name: &'a str,
    /// Trained.
    #[device(trainable)]
    pub params: P,
    #[device(trainable)]
    pub layers: Vec<Dense>,
    /// A traced scalar.
    #[device]
    pub lr: Array,
    #[device()]
    pub masks: [Array; N],
    #[device]
    pub extra: Option<(Array, Box<Array>)>,
    #[host]
    pub log: Vec<H>,
    #[allow(dead_code)]
    pub notes: String,
}

/// A program reads the view of any instantiation.
pub fn forward<'a, A, P, H, const N: usize>(
    v: &RunView<'_, 'a, A, P, H, N>,
    x: Tensor,
) -> (usize, Tensor)
where
    A: ContentHash + Clone,
    P: Tree,
    P::Mirror<Tensor>: Copy,
{
    let _arch: &A = v.arch;
    let _widths: &[usize; N] = v.widths;
    let _name: &&str = v.name;
    let _params: P::Mirror<Tensor> = v.params;
    let _w: Tensor = v.layers[0].w;
    let _lr: Tensor = v.lr;
    let _masks: [Tensor; N] = v.masks;
    let _extra: Option<(Tensor, Box<Tensor>)> = v.extra.clone();
    (v.widths.len(), x)
}

fn main() {
    let f32s = |dims: &[usize]| Array::zeros(DType::F32, dims);
    let run = Run::<Arch, Dense, String, 2> {
        arch: Arch {
            hidden: 8,
            activation: Activation::Relu,
        },
        widths: [4, 8],
        name: "probe",
        params: Dense {
            w: f32s(&[4, 8]),
            b: f32s(&[8]),
        },
        layers: vec![Dense {
            w: f32s(&[8, 2]),
            b: f32s(&[2]),
        }],
        lr: Array::scalar(0.1f32),
        masks: [f32s(&[4]), f32s(&[8])],
        extra: None,
        log: vec!["start".to_owned()],
        notes: String::new(),
    };
    let other = Run {
        arch: Arch {
            activation: Activation::Tanh,
            ..run.arch.clone()
        },
        ..run
    };
    assert_eq!(Run::<Arch, Dense, String, 2>::FIELDS.len(), 10);
    let _ = other.graph_const_digest();
    let _ = other.device_signature();
    let _ = forward::<Arch, Dense, String, 2>;
    let _ = (&other.log, &other.notes, other.arch.hidden);
}
