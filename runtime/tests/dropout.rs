//! Randomness in training programs: the step's key is a Device input the handle advances, so
//! dropout never recompiles, a run is reproducible from its seed, a resumed run continues the
//! same stream, and the evaluation programs take no key (dropout is off there).
#![allow(missing_docs)]

mod common;

use common::xla_or_skip;
use nitro::backend::{self, Backend};
use nitro::cache::Cache;
use nitro::checkpoint::Checkpoint;
use nitro::optim::Adam;
use nitro::prelude::*;
use nitro::trace::{self, nn, random};
use nitro::train::{Config, Model, Nitro};
use nitro::LeafType;

#[path = "common/mlp.rs"]
mod mlp;
use mlp::{dataset, Batch, BatchMirror, Dense};

/// The shared classifier with dropout on its hidden layer.
#[experiment]
#[derive(Clone)]
pub struct DropMlp {
    #[graph_const]
    pub rate: u32,
    #[device(trainable)]
    pub layers: Vec<Dense>,
}

fn hidden(v: &DropMlpView<'_>, x: Tensor) -> Tensor {
    let h = (x.matmul(v.layers[0].w) + v.layers[0].b).tanh();
    let h = nn::dropout(h, *v.rate as f64 / 100.0);
    h.matmul(v.layers[1].w) + v.layers[1].b
}

impl Model for DropMlp {
    type Batch = Batch;
    const RANDOM: bool = true;

    fn loss(v: &DropMlpView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        nn::softmax_cross_entropy(hidden(v, b.x), b.y)
    }
}

/// The same model without `RANDOM`: drawing is a trace-time error.
#[experiment]
#[derive(Clone)]
pub struct Forgot {
    #[device(trainable)]
    pub layers: Vec<Dense>,
}

impl Model for Forgot {
    type Batch = Batch;

    fn loss(v: &ForgotView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        let h = nn::dropout(b.x.matmul(v.layers[0].w) + v.layers[0].b, 0.5);
        nn::softmax_cross_entropy(h.matmul(v.layers[1].w) + v.layers[1].b, b.y)
    }
}

fn layers() -> Vec<Dense> {
    let m = mlp::mlp(mlp::Act::Tanh);
    m.layers
}

fn own_cache() -> &'static Cache {
    Box::leak(Box::new(Cache::in_memory(32)))
}

fn config(seed: u64, epochs: usize) -> Config {
    Config::new()
        .batch(16)
        .lr(0.03)
        .seed(seed)
        .epochs(epochs)
        .progress(false)
}

fn handle(
    b: &'static dyn Backend,
    cache: &'static Cache,
    seed: u64,
    epochs: usize,
) -> Nitro<DropMlp, Adam> {
    let e = DropMlp {
        rate: 30,
        layers: layers(),
    };
    Nitro::with_backend(e, Adam::default(), config(seed, epochs), b, cache).unwrap()
}

fn values(e: &DropMlp) -> Vec<Vec<f32>> {
    e.layers
        .iter()
        .flat_map(|l| [&l.w, &l.b])
        .map(|a| a.as_slice::<f32>().unwrap().to_vec())
        .collect()
}

fn reproducible_and_resumable_on(b: &'static dyn Backend) {
    let train = dataset(80, 3);
    let cache = own_cache();
    let mut first = handle(b, cache, 11, 3);
    first.fit(&train, None).unwrap();
    let misses = cache.stats().misses;
    let a = values(&first.into_experiment().unwrap());

    // The same seed: the same masks, bit for bit — and the programs came from the cache.
    let mut again = handle(b, cache, 11, 3);
    again.fit(&train, None).unwrap();
    assert_eq!(cache.stats().misses, misses, "a new key never recompiles");
    assert_eq!(
        values(&again.into_experiment().unwrap()),
        a,
        "reproducible from the seed"
    );

    // Another seed: other masks.
    let mut other = handle(b, cache, 12, 3);
    other.fit(&train, None).unwrap();
    assert_ne!(
        values(&other.into_experiment().unwrap()),
        a,
        "the seed reaches the masks"
    );

    // A checkpoint carries the stream: 1 epoch, resume, 2 more equal 3 straight.
    let mut part = handle(b, cache, 11, 1);
    part.fit(&train, None).unwrap();
    let taken = part.checkpoint().unwrap();
    let stream = taken
        .random()
        .expect("a random model's checkpoint carries its stream");
    assert_eq!(
        stream.draws, 5,
        "one draw per step (80 rows in batches of 16)"
    );
    assert_eq!(stream.key, [0, 11], "the base key is PRNGKey(seed)");
    let taken = Checkpoint::from_bytes(&taken.to_bytes().unwrap()).unwrap();
    assert_eq!(taken.random(), Some(stream));
    let e = DropMlp {
        rate: 30,
        layers: layers(),
    };
    // Without the draws counted so far, the resumed steps would redraw the first epoch's masks.
    let mut resumed =
        Nitro::resume_with(e, Adam::default(), config(11, 3), taken, b, cache).unwrap();
    resumed.fit(&train, None).unwrap();
    assert_eq!(
        values(&resumed.into_experiment().unwrap()),
        a,
        "the resumed run continues the stream"
    );
}

#[test]
fn dropout_training_is_reproducible_and_resumes_its_stream_on_the_interpreter() {
    reproducible_and_resumable_on(backend::interpreter());
}

#[test]
fn dropout_training_is_reproducible_and_resumes_its_stream_on_xla() {
    if let Some(xla) = xla_or_skip("dropout on xla") {
        reproducible_and_resumable_on(xla);
    }
}

#[test]
fn evaluation_has_no_dropout_and_is_deterministic() {
    let b = backend::interpreter();
    let val = dataset(48, 4);
    let mut h = handle(b, own_cache(), 5, 1);
    let first = h.validate(&val).unwrap();
    let second = h.validate(&val).unwrap();
    assert_eq!(first.loss_sum, second.loss_sum);
    // The same parameters with rate 0 (no dropout at all) give the same validation loss.
    let mut plain = Nitro::with_backend(
        DropMlp {
            rate: 0,
            layers: layers(),
        },
        Adam::default(),
        config(5, 1),
        b,
        own_cache(),
    )
    .unwrap();
    assert_eq!(plain.validate(&val).unwrap().loss_sum, first.loss_sum);
}

#[test]
fn drawing_without_model_random_is_a_trace_error_saying_what_to_set() {
    let b = backend::interpreter();
    let mut h = Nitro::with_backend(
        Forgot { layers: layers() },
        Adam::default(),
        config(1, 1),
        b,
        own_cache(),
    )
    .unwrap();
    let err = h.fit(&dataset(32, 1), None).unwrap_err().to_string();
    assert!(
        err.contains("Model::RANDOM") && err.contains("const RANDOM: bool = true"),
        "{err}"
    );
    assert!(err.contains("Forgot"), "names the model: {err}");
}

#[test]
fn dropout_keeps_the_expected_share_scaled_and_two_calls_draw_two_masks() {
    let x = LeafType {
        dtype: DType::F32,
        dims: vec![100, 100],
    };
    let k = LeafType {
        dtype: DType::U32,
        dims: vec![2],
    };
    let g = trace::trace(&[("x".into(), x), ("key".into(), k)], |i| {
        random::with_step_key(random::StepKey::Training(i[1]), || {
            vec![nn::dropout(i[0], 0.25), nn::dropout(i[0], 0.25)]
        })
    })
    .unwrap();
    let ones = Array::full(&[100, 100], 1.0f32);
    let out = nitro::backend::interp::run(&g, &[ones, random::key(3)]).unwrap();
    let a = out[0].as_slice::<f32>().unwrap();
    let kept = a.iter().filter(|&&v| v != 0.0).count();
    assert!((7_300..7_700).contains(&kept), "about 75% kept: {kept}");
    assert!(
        a.iter().all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6),
        "kept values scaled by 1/(1-rate)"
    );
    assert_ne!(out[0], out[1], "each call draws its own mask");
    // Outside a training program (no key), dropout is the identity.
    let g = trace::trace(
        &[(
            "x".into(),
            LeafType {
                dtype: DType::F32,
                dims: vec![3],
            },
        )],
        |i| vec![nn::dropout(i[0], 0.5)],
    )
    .unwrap();
    assert_eq!(g.outputs[0], g.inputs[0].node);
}

#[test]
fn replicas_draw_their_own_masks_reproducibly() {
    let b = backend::interpreter_for(2);
    let train = dataset(64, 5);
    let run = || {
        let mut h = handle(b, own_cache(), 21, 2);
        h.fit(&train, None).unwrap();
        values(&h.into_experiment().unwrap())
    };
    let (a, again) = (run(), run());
    assert_eq!(
        a, again,
        "a data-parallel run is reproducible from its seed"
    );
    let mut one = handle(backend::interpreter(), own_cache(), 21, 2);
    one.fit(&train, None).unwrap();
    assert_ne!(
        values(&one.into_experiment().unwrap()),
        a,
        "replica r draws fold_in(key, r), not the one-device mask"
    );
}

// ---- Threefry as JAX lowers it on CPU (issue 31, item 2) ---------------------------------------

/// Every small draw of one shape calls one Threefry function (a rolled loop of 5 × 4 rounds),
/// however many draws the program makes; another shape adds one more; a draw past
/// `ROLLED_UP_TO` elements is unrolled (no loop, 20 rounds inline). The bits are the host block
/// function's in both forms, on the interpreter and on XLA.
#[test]
fn threefry_is_one_rolled_function_per_small_shape_with_the_same_bits() {
    let key = LeafType::new(DType::U32, &[2]);
    let draws = |n: usize, shapes: &'static [&'static [usize]]| {
        trace::trace(&[("key".into(), key.clone())], move |t| {
            let mut out = Vec::new();
            for i in 0..n {
                let k = random::fold_in(t[0], Tensor::constant(Array::scalar(i as u32)));
                for dims in shapes {
                    out.push(random::bits(k, dims));
                }
            }
            out
        })
        .unwrap()
    };
    let functions = |g: &trace::Graph| {
        let text = nitro::emit::emit(g);
        (
            text.matches("func.func private").count(),
            text.matches("stablehlo.while").count(),
            text.matches("stablehlo.xor").count(),
        )
    };
    let (one, _, _) = functions(&draws(1, &[&[4, 8]]));
    let (eight, whiles, xors) = functions(&draws(8, &[&[4, 8]]));
    // fold_in draws u32[1] counters, bits u32[4, 8]: two shapes, two functions, however many.
    assert_eq!((one, eight), (2, 2));
    assert_eq!(
        whiles, 16,
        "one loop per draw, each calling its shape's function"
    );
    // The 20 rounds' xors are written once per function (4 in each loop body), not per draw:
    // unrolled, 16 draws held 16 × 20 of them.
    assert!(xors < 16 * 20 / 4, "{xors} xors");
    let (three_shapes, _, _) = functions(&draws(3, &[&[4, 8], &[5]]));
    assert_eq!(three_shapes, 3);
    // Past ROLLED_UP_TO elements: the fold_in's loop only, the draw's 20 rounds inline.
    const BIG: usize = random::ROLLED_UP_TO + 1;
    let (fns, whiles, xors) = functions(&draws(1, &[&[BIG]]));
    assert_eq!((fns, whiles), (1, 1));
    assert!(xors >= 20, "{xors} xors");

    // The bits: element i of bits(k, dims) is y0 ^ y1 of the host block on (0, i).
    let k = random::key(7);
    let host = |i: u32, n: u32| {
        let kw = k.as_slice::<u32>().unwrap();
        let f = random::threefry2x32_host([kw[0], kw[1]], [0, i]);
        let folded = [f[0], f[1]];
        (0..n)
            .map(|j| {
                let y = random::threefry2x32_host(folded, [0, j]);
                y[0] ^ y[1]
            })
            .collect::<Vec<u32>>()
    };
    let mut backends: Vec<&'static dyn Backend> = vec![backend::interpreter()];
    if let Some(xla) = xla_or_skip("threefry bits on xla") {
        backends.push(xla);
    }
    for (g, n) in [
        (draws(2, &[&[3, 5]]), 15),
        (draws(2, &[&[BIG]]), BIG as u32),
    ] {
        for b in &backends {
            let exe = b.compile(&g, &nitro::emit::emit(&g)).unwrap();
            let out = exe.run(&[&k]).unwrap();
            for (i, o) in out.iter().enumerate() {
                assert_eq!(
                    o.as_slice::<u32>().unwrap(),
                    host(i as u32, n),
                    "draw {i} of {n}"
                );
            }
        }
    }
}
