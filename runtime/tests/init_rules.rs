//! Initializer rules (issue 50, items 7 and 12): a rule whose parameters cannot make a finite
//! leaf is refused when the handle is made, naming the pattern and the parameter; the scaled
//! rules take a convolution kernel's fans as `Conv2d`'s own initializer does; and leaves created
//! on the host from the rules (`Init::on_host`, `train::initialize_on_host`) are the leaves a
//! handle creates on its devices from the same rules and seed.
#![allow(missing_docs)]

mod common;

use common::{own_cache, xla_or_skip};
use nitro::backend::{self, Backend};
use nitro::init::{self, Init, Seed};
use nitro::nn::{Conv2d, Layer};
use nitro::optim::Sgd;
use nitro::prelude::*;
use nitro::train::{Config, Model, Nitro};

#[derive(Tree, Clone, Debug)]
pub struct Batch {
    pub x: Array,
    pub y: Array,
}

/// Leaves of every kind a rule meets: a weight, a bias, a stack of weights, a convolution
/// kernel, a half-precision table, a leaf larger than a rolled draw (4096 elements), and a
/// frozen leaf no rule may touch.
#[experiment]
#[derive(Clone)]
pub struct Zoo {
    #[device(trainable)]
    pub w: Array,
    #[device(trainable)]
    pub b: Array,
    #[device(trainable)]
    pub stack: Array,
    #[device(trainable)]
    pub kernel: Array,
    #[device(trainable)]
    pub table: Array,
    #[device(trainable)]
    pub big: Array,
    #[device(trainable)]
    pub u: Array,
    #[device(trainable)]
    pub c: Array,
    #[device]
    pub frozen: Array,
}

impl Model for Zoo {
    type Batch = Batch;

    fn loss(v: &ZooView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        // Every trainable leaf reaches the loss.
        let h = b.x.matmul(v.w) + v.b;
        let extra = v.stack.sum_all()
            + v.kernel.sum_all()
            + v.table.convert(DType::F32).sum_all()
            + v.big.sum_all()
            + v.u.sum_all()
            + v.c.sum_all()
            + v.frozen.sum_all();
        nitro::nn::softmax_cross_entropy(h, b.y) + extra * 0.0
    }
}

fn zoo() -> Zoo {
    Zoo {
        w: Array::zeros(DType::F32, &[4, 3]),
        b: Array::zeros(DType::F32, &[3]),
        stack: Array::zeros(DType::F32, &[3, 8, 32]),
        kernel: Array::zeros(DType::F32, &[3, 3, 16, 32]),
        table: Array::zeros(DType::BF16, &[50, 12]),
        big: Array::zeros(DType::F32, &[70, 100]),
        u: Array::zeros(DType::F32, &[7, 5]),
        c: Array::zeros(DType::F32, &[5]),
        frozen: Array::full(&[2], 3.0f32),
    }
}

/// One rule of each kind, and the first rule that matches applies (`b` is not a weight).
fn rules() -> Vec<(&'static str, Init)> {
    vec![
        ("b", Init::Zeros),
        ("w", Init::GlorotNormal),
        ("stack", Init::GlorotUniform),
        ("kernel", Init::HeNormal),
        (
            "table",
            Init::Normal {
                mean: 0.0,
                std: 0.02,
            },
        ),
        ("big", Init::HeUniform),
        (
            "u",
            Init::Uniform {
                low: -3.0,
                high: 1.5,
            },
        ),
        ("c", Init::Constant(0.25)),
    ]
}

fn config(seed: u64) -> Config {
    Config::new().batch(2).lr(0.1).progress(false).seed(seed)
}

fn leaves(z: &Zoo) -> Vec<(String, Array)> {
    let mut out = Vec::new();
    z.visit_device(&mut |_, path, node| {
        if let nitro::Node::Leaf(a) = node {
            out.push((path.as_str().to_owned(), a.clone()));
        }
    });
    out
}

/// The leaves a handle on `backend` holds when the rules create them on its devices.
fn created_on_devices(backend: &'static dyn Backend, seed: u64) -> Vec<(String, Array)> {
    let declared = init::declared(zoo);
    let config = config(seed).initialize_all(rules());
    let mut run = Nitro::with_backend(declared, Sgd, config, backend, own_cache()).unwrap();
    leaves(run.experiment().unwrap())
}

/// The leaves a handle on `backend` holds when the same rules created them on the host.
fn created_on_host(backend: &'static dyn Backend, seed: u64) -> Vec<(String, Array)> {
    let mut z = init::declared(zoo);
    nitro::train::initialize_on_host(&mut z, rules(), seed).unwrap();
    let mut run = Nitro::with_backend(z, Sgd, config(seed), backend, own_cache()).unwrap();
    leaves(run.experiment().unwrap())
}

/// The distance in units in the last place between two floats of one sign (or both zero).
fn ulps(a: f32, b: f32) -> u32 {
    if a == b {
        return 0;
    }
    if a.is_sign_negative() != b.is_sign_negative() {
        return u32::MAX;
    }
    a.to_bits().abs_diff(b.to_bits())
}

fn as_f32(a: &Array) -> Vec<f32> {
    match a.dtype() {
        DType::F32 => a.as_slice::<f32>().unwrap().to_vec(),
        DType::BF16 => a
            .as_slice::<nitro::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        other => panic!("{other}"),
    }
}

/// The largest ulp distance between host- and device-created leaves, per leaf.
fn largest_ulps(host: &[(String, Array)], device: &[(String, Array)]) -> Vec<(String, u32)> {
    assert_eq!(host.len(), device.len());
    host.iter()
        .zip(device)
        .map(|((path, h), (p2, d))| {
            assert_eq!(path, p2);
            assert_eq!(h.leaf_type(), d.leaf_type(), "{path}");
            let most = as_f32(h)
                .iter()
                .zip(as_f32(d))
                .map(|(&a, b)| match h.dtype() {
                    // bf16 values: compare in bf16's own units.
                    DType::BF16 => ulps(a, b) >> 16,
                    _ => ulps(a, b),
                })
                .max()
                .unwrap_or(0);
            (path.clone(), most)
        })
        .collect()
}

/// The leaves the uniform rules create (a scale and a shift of the bits), and the normal ones.
const UNIFORM: [&str; 3] = ["stack", "big", "u"];
const NORMAL: [&str; 3] = ["w", "kernel", "table"];

/// Item 7 on XLA (what a device runs): the leaves created on the host are the leaves created
/// on the device — constants and uniform rules bit for bit (the same Threefry bits, and the
/// scale and shift as one fused multiply-add, as XLA computes it), normal rules within 3 ulps
/// (their `erf_inv` takes a `log1p`, which XLA's CPU compiler computes with its own polynomial
/// and the host with the platform's `log1pf`).
#[test]
fn host_creation_matches_xlas_device_creation() {
    let Some(xla) = xla_or_skip("host_creation_matches_xlas_device_creation") else {
        return;
    };
    let host = created_on_host(xla, 42);
    let device = created_on_devices(xla, 42);
    let most = largest_ulps(&host, &device);
    println!("largest ulp distance per leaf (host vs XLA): {most:?}");
    for (path, u) in &most {
        match path.as_str() {
            p if NORMAL.contains(&p) => assert!(*u <= 3, "leaf `{path}`: {u} ulps apart"),
            _ => assert_eq!(
                *u, 0,
                "leaf `{path}` differs between host and device creation"
            ),
        }
    }
    for ((path, h), (_, d)) in host.iter().zip(&device) {
        if !NORMAL.contains(&path.as_str()) {
            assert_eq!(h, d, "leaf `{path}`");
        }
    }
}

/// Item 7 on the interpreter: the normal rules and the constants bit for bit (the interpreter
/// runs the same `erf_inv`); the uniform rules within one rounding of the shift, which the
/// interpreter rounds apart from the scale where XLA (and the host) fuse them.
#[test]
fn host_creation_matches_the_interpreters_device_creation() {
    let host = created_on_host(backend::interpreter(), 42);
    let device = created_on_devices(backend::interpreter(), 42);
    for ((path, h), (_, d)) in host.iter().zip(&device) {
        if UNIFORM.contains(&path.as_str()) {
            let (h, d) = (as_f32(h), as_f32(d));
            let bound = h.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let ulp = f32::from_bits(bound.to_bits() + 1) - bound;
            let most = h
                .iter()
                .zip(&d)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(
                most <= ulp,
                "leaf `{path}`: {most} apart, over an ulp of {bound}"
            );
        } else {
            assert_eq!(
                h, d,
                "leaf `{path}` differs between host and device creation"
            );
        }
    }
    // The rules did apply: random leaves are not all zeros, the frozen leaf is untouched.
    let by = |name: &str| &host.iter().find(|(p, _)| p == name).unwrap().1;
    assert!(as_f32(by("kernel")).iter().any(|&v| v != 0.0));
    assert!(as_f32(by("c")).iter().all(|&v| v == 0.25));
    assert!(as_f32(by("b")).iter().all(|&v| v == 0.0));
    assert_eq!(as_f32(by("frozen")), [3.0, 3.0]);
    // Another seed, other leaves.
    let other = created_on_host(backend::interpreter(), 43);
    assert_ne!(as_f32(by("w")), as_f32(&other[0].1));
}

/// Item 7: the host creation keys each leaf by its path, as the device does: a leaf keeps its
/// values when other leaves are added, and two paths draw different values.
#[test]
fn host_created_values_depend_on_the_seed_path_type_and_rule_only() {
    let ty = nitro::LeafType::new(DType::F32, &[16, 8]);
    let a = Init::GlorotUniform.on_host(5, "layers[0].w", &ty).unwrap();
    assert_eq!(
        a,
        Init::GlorotUniform.on_host(5, "layers[0].w", &ty).unwrap()
    );
    assert_ne!(
        a,
        Init::GlorotUniform.on_host(5, "layers[1].w", &ty).unwrap()
    );
    assert_ne!(
        a,
        Init::GlorotUniform.on_host(6, "layers[0].w", &ty).unwrap()
    );
    // The same leaf, drawn on the interpreter's device program.
    let device = nitro::train::create_leaf(
        backend::interpreter(),
        own_cache(),
        5,
        "layers[0].w",
        &ty,
        Init::GlorotUniform,
    )
    .unwrap();
    assert_eq!(a, device);
}

// ---- item 12: rules refused when the handle is made ----------------------------------------

/// The refusal a handle on the declared zoo gives for `rule` on leaf `w`, or "" when made.
fn refusal(pattern: &str, rule: Init) -> String {
    Nitro::with_backend(
        init::declared(zoo),
        Sgd,
        config(1).initialize(pattern, rule),
        backend::interpreter(),
        own_cache(),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default()
}

#[test]
fn a_normal_rule_with_a_nan_std_is_refused() {
    let err = refusal(
        "w",
        Init::Normal {
            mean: 0.0,
            std: f64::NAN,
        },
    );
    assert!(
        err.contains("Config::initialize") && err.contains("w →") && err.contains("`std` is NaN"),
        "{err}"
    );
    assert!(err.contains("give a finite `std`"), "{err}");
}

#[test]
fn a_normal_rule_with_an_infinite_std_is_refused() {
    let err = refusal(
        "w",
        Init::Normal {
            mean: 0.0,
            std: f64::INFINITY,
        },
    );
    assert!(err.contains("w →") && err.contains("`std` is inf"), "{err}");
}

#[test]
fn a_normal_rule_with_a_nan_mean_is_refused() {
    let err = refusal(
        "w",
        Init::Normal {
            mean: f64::NAN,
            std: 1.0,
        },
    );
    assert!(err.contains("`mean` is NaN"), "{err}");
}

#[test]
fn a_normal_rule_with_a_negative_std_is_refused() {
    let err = refusal(
        "w",
        Init::Normal {
            mean: 0.0,
            std: -0.5,
        },
    );
    assert!(
        err.contains("`std` is -0.5") && err.contains("give 0.5"),
        "{err}"
    );
}

#[test]
fn a_normal_rule_past_f32s_range_is_refused() {
    let err = refusal(
        "w",
        Init::Normal {
            mean: 0.0,
            std: 1e300,
        },
    );
    assert!(
        err.contains("`std` is 1e300") && err.contains("f32"),
        "{err}"
    );
}

#[test]
fn a_nan_constant_is_refused() {
    let err = refusal("w", Init::Constant(f64::NAN));
    assert!(
        err.contains("w → Constant(NaN)") && err.contains("the constant is NaN"),
        "{err}"
    );
}

#[test]
fn an_infinite_constant_is_refused() {
    let err = refusal("w", Init::Constant(f64::NEG_INFINITY));
    assert!(err.contains("the constant is -inf"), "{err}");
}

#[test]
fn a_uniform_rule_with_an_infinite_bound_is_refused() {
    let err = refusal(
        "w",
        Init::Uniform {
            low: 0.0,
            high: f64::INFINITY,
        },
    );
    assert!(
        err.contains("w →") && err.contains("`high` is inf"),
        "{err}"
    );
    let err = refusal(
        "w",
        Init::Uniform {
            low: f64::NAN,
            high: 1.0,
        },
    );
    assert!(err.contains("`low` is NaN"), "{err}");
}

#[test]
fn a_uniform_rule_with_an_empty_range_is_refused() {
    let err = refusal(
        "w",
        Init::Uniform {
            low: 1.0,
            high: -1.0,
        },
    );
    assert!(
        err.contains("[1, -1) is empty") && err.contains("`low` must be below `high`"),
        "{err}"
    );
}

#[test]
fn a_uniform_rule_wider_than_f32_is_refused() {
    let err = refusal(
        "w",
        Init::Uniform {
            low: -3e38,
            high: 3e38,
        },
    );
    assert!(err.contains("wider than f32"), "{err}");
}

/// A rule is checked even where it matches nothing (of a set, it may go unused).
#[test]
fn a_bad_rule_of_a_set_is_refused_even_unused() {
    let err = Nitro::with_backend(
        init::declared(zoo),
        Sgd,
        config(1).initialize_all([
            ("*", Init::Zeros),
            (
                "nothing.here",
                Init::Normal {
                    mean: 0.0,
                    std: f64::NAN,
                },
            ),
        ]),
        backend::interpreter(),
        own_cache(),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(
        err.contains("nothing.here") && err.contains("`std` is NaN"),
        "{err}"
    );
}

/// Per leaf: a constant the leaf's dtype cannot hold, and draws past a half-precision leaf's
/// range, name the leaf.
#[test]
fn a_rule_a_leafs_dtype_cannot_hold_is_refused_naming_the_leaf() {
    let err = refusal(
        "table",
        Init::Normal {
            mean: 0.0,
            std: 1e38,
        },
    );
    assert!(
        err.contains("table →") && err.contains("leaf `table`") && err.contains("bf16"),
        "{err}"
    );
    let err = refusal("table", Init::Constant(1e39));
    assert!(err.contains("leaf `table`"), "{err}");
}

/// The same refusals on the host path.
#[test]
fn host_creation_refuses_the_same_rules() {
    let mut z = init::declared(zoo);
    let err = nitro::train::initialize_on_host(&mut z, [("w", Init::Constant(f64::NAN))], 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("the constant is NaN"), "{err}");
    let ty = nitro::LeafType::new(DType::F32, &[2]);
    let err = Init::Normal {
        mean: 0.0,
        std: f64::INFINITY,
    }
    .on_host(1, "w", &ty)
    .unwrap_err()
    .to_string();
    assert!(err.contains("`std` is inf"), "{err}");
    let err = nitro::train::initialize_on_host(&mut z, [("nothing", Init::Zeros)], 1)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nothing") && err.contains("none of these"),
        "{err}"
    );
}

/// `create_leaf` refuses them too.
#[test]
fn create_leaf_refuses_a_nan_rule() {
    let ty = nitro::LeafType::new(DType::F32, &[2]);
    let err = nitro::train::create_leaf(
        backend::interpreter(),
        own_cache(),
        1,
        "w",
        &ty,
        Init::Constant(f64::NAN),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("the constant is NaN"), "{err}");
}

// ---- item 12: a convolution kernel's fans ------------------------------------------------------

/// `HeNormal` on a `3×3×16×32` kernel: fan-in `3·3·16 = 144`, the standard deviation
/// `√(2/144) ≈ 0.118` that `Conv2d`'s own initializer draws (not `√(2/16) ≈ 0.354`).
#[test]
fn a_kernels_fans_are_those_conv2ds_own_initializer_uses() {
    assert_eq!(Init::fans(&[3, 3, 16, 32]), (144.0, 288.0));
    assert_eq!(
        Init::fans(&[4, 3, 3, 16, 32]),
        (144.0, 288.0),
        "a stack of kernels"
    );
    assert_eq!(Init::fans(&[3, 8, 32]), (8.0, 32.0), "a stack of weights");
    assert_eq!(Init::fans(&[8, 32]), (8.0, 32.0));
    assert_eq!(Init::fans(&[5]), (5.0, 5.0));

    let std = |v: &[f32]| {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n).sqrt()
    };
    let conv = Conv2d::new(16, 32, (3, 3));
    let own = conv.init(Seed(3));
    assert_eq!(own.w.dims(), &[3, 3, 16, 32]);
    let ty = own.w.leaf_type();
    let by_rule = Init::HeNormal.on_host(3, "conv.w", &ty).unwrap();
    let device = nitro::train::create_leaf(
        backend::interpreter(),
        own_cache(),
        3,
        "conv.w",
        &ty,
        Init::HeNormal,
    )
    .unwrap();
    let want = (2.0f64 / 144.0).sqrt();
    for (what, a) in [
        ("Conv2d::init", &own.w),
        ("the rule on the host", &by_rule),
        ("the rule on the device", &device),
    ] {
        let s = std(a.as_slice::<f32>().unwrap());
        assert!((s - want).abs() < 0.01, "{what}: std {s}, want {want}");
    }
}
