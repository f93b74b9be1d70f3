//! Programs: tracing over a compile view, determinism of the fingerprint, and what moves it.
#![allow(missing_docs)]

use nitro::prelude::*;
use nitro::program::Program;

#[derive(ContentHash, Clone, Copy, Debug, PartialEq)]
pub enum Act {
    Tanh,
    Relu,
}

#[derive(Tree, Clone)]
pub struct Dense {
    pub w: Array,
    pub b: Array,
}

#[experiment]
#[derive(Clone)]
pub struct Mlp {
    #[graph_const]
    pub act: Act,
    #[device(trainable)]
    pub layers: Vec<Dense>,
    pub note: String,
}

fn forward(v: &MlpView<'_>, x: &Tensor) -> Tensor {
    v.layers.iter().fold(*x, |h, l| {
        let z = h.matmul(l.w) + l.b;
        match v.act {
            Act::Tanh => z.tanh(),
            Act::Relu => z.relu(),
        }
    })
}

const FORWARD: Program<Mlp, Tensor> = Mlp::program("forward", forward);

fn mlp(act: Act, widths: &[usize]) -> Mlp {
    Mlp {
        act,
        layers: widths
            .windows(2)
            .map(|w| Dense {
                w: Array::zeros(DType::F32, &[w[0], w[1]]),
                b: Array::zeros(DType::F32, &[w[1]]),
            })
            .collect(),
        note: String::new(),
    }
}

#[test]
fn tracing_twice_gives_the_same_fingerprint() {
    let x = Array::zeros(DType::F32, &[4, 3]);
    let a = FORWARD.trace(&mlp(Act::Tanh, &[3, 5, 2]), &x).unwrap();
    let b = FORWARD.trace(&mlp(Act::Tanh, &[3, 5, 2]), &x).unwrap();
    assert_eq!(a.text, b.text);
    assert_eq!(a.fingerprint, b.fingerprint);
    assert_eq!(a.fingerprint, nitro::emit::fingerprint(&a.text));
}

#[test]
fn graph_consts_and_shapes_move_the_fingerprint_values_and_host_do_not() {
    let x = Array::zeros(DType::F32, &[4, 3]);
    let base = FORWARD
        .trace(&mlp(Act::Tanh, &[3, 5, 2]), &x)
        .unwrap()
        .fingerprint;
    let relu = FORWARD
        .trace(&mlp(Act::Relu, &[3, 5, 2]), &x)
        .unwrap()
        .fingerprint;
    assert_ne!(
        base, relu,
        "a GraphConst that changes the graph changes the fingerprint"
    );
    let wider = FORWARD
        .trace(&mlp(Act::Tanh, &[3, 6, 2]), &x)
        .unwrap()
        .fingerprint;
    assert_ne!(base, wider);
    let batch = FORWARD
        .trace(
            &mlp(Act::Tanh, &[3, 5, 2]),
            &Array::zeros(DType::F32, &[8, 3]),
        )
        .unwrap()
        .fingerprint;
    assert_ne!(base, batch);
    let mut values = mlp(Act::Tanh, &[3, 5, 2]);
    values.layers[0].w = Array::full(&[3, 5], 0.5f32);
    values.note.push_str("host");
    assert_eq!(FORWARD.trace(&values, &x).unwrap().fingerprint, base);
}

#[test]
fn traced_inputs_are_named_and_typed() {
    let t = FORWARD
        .trace(
            &mlp(Act::Tanh, &[3, 5, 2]),
            &Array::zeros(DType::F32, &[4, 3]),
        )
        .unwrap();
    assert_eq!(
        t.inputs.to_string(),
        "layers[0].w: f32[3,5], layers[0].b: f32[5], layers[1].w: f32[5,2], layers[1].b: f32[2], input: f32[4,3]"
    );
    assert_eq!(t.outputs.len(), 1);
    assert_eq!(t.outputs[0].to_string(), "f32[4,2]");
    assert!(
        FORWARD.identity().ends_with("Mlp::forward"),
        "{}",
        FORWARD.identity()
    );
}

#[test]
fn a_shape_bug_in_a_program_is_a_trace_error() {
    let err = FORWARD
        .trace(
            &mlp(Act::Tanh, &[3, 5, 2]),
            &Array::zeros(DType::F32, &[4, 7]),
        )
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("`matmul`") && msg.contains("f32[4,7]") && msg.contains("f32[3,5]"),
        "{msg}"
    );
    assert!(
        msg.contains("tests/program.rs"),
        "names the program's source line: {msg}"
    );
}

/// What a library needs of an experiment: a per-example score over its view.
pub trait Scored: Experiment + 'static {
    fn score(v: &Self::View<'_>, x: &Tensor) -> Tensor;
}

/// A library program for every `Scored` experiment.
fn doubled<E: Scored>(v: &E::View<'_>, x: &Tensor) -> Tensor {
    E::score(v, x) * 2.0
}

fn doubled_program<E: Scored>() -> Program<E, Tensor> {
    Program::generic("doubled", doubled::<E>)
}

#[experiment]
pub struct Times {
    #[device]
    pub w: Array,
}

impl Scored for Times {
    fn score(v: &TimesView<'_>, x: &Tensor) -> Tensor {
        *x * v.w
    }
}

#[experiment]
pub struct Plus {
    #[graph_const]
    pub k: u32,
    #[device]
    pub w: Array,
}

impl Scored for Plus {
    fn score(v: &PlusView<'_>, x: &Tensor) -> Tensor {
        *x + v.w + f64::from(*v.k)
    }
}

#[test]
fn generic_programs_serve_every_experiment_that_implements_the_trait() {
    let cache = nitro::cache::Cache::in_memory(8);
    let backend = nitro::backend::interpreter();
    let x = Array::full(&[2], 3.0f32);
    let times = Times {
        w: Array::full(&[2], 2.0f32),
    };
    let plus = Plus {
        k: 1,
        w: Array::full(&[2], 2.0f32),
    };
    for round in 0..2 {
        let a = cache
            .get(backend, &doubled_program::<Times>(), &times, &x)
            .unwrap();
        let b = cache
            .get(backend, &doubled_program::<Plus>(), &plus, &x)
            .unwrap();
        assert_eq!(a.outcome.is_hit(), round == 1);
        assert_eq!(b.outcome.is_hit(), round == 1);
        assert!(a.program.ends_with("Times::doubled"), "{}", a.program);
        assert!(b.program.ends_with("Plus::doubled"), "{}", b.program);
        let run = |s: &nitro::cache::Served, w: &Array| s.executable.run(&[w, &x]).unwrap();
        assert_eq!(
            run(&a, &times.w)[0].as_slice::<f32>().unwrap(),
            &[12.0, 12.0]
        );
        assert_eq!(
            run(&b, &plus.w)[0].as_slice::<f32>().unwrap(),
            &[12.0, 12.0]
        );
    }
    assert_eq!(cache.stats().compiles, 2, "one per experiment type");
}
