//! Leaves created on the devices (issue 42, item 1): an experiment declared by its types
//! (`init::declared`) and `Config::initialize` rules get their trainable leaves from an
//! initializer program — the same values on one device and on any mesh (FSDP on 4 and 2,
//! replicated, tensor parallel), the distributions the rules name, trained to the same losses —
//! with no host copy of the model: in a child process, a declared model created under FSDP on 4
//! CPU devices peaks at about the devices' own memory, where reading it from the host costs a
//! second copy. Bad rules are refused when the handle is made, naming them.
#![allow(missing_docs)]

mod common;

#[path = "common/mlp.rs"]
mod mlp;

use common::{backend_of, fsdp, own_cache, peak_rss_kb, xla_devices_or_skip};
use mlp::*;
use nitro::backend::{self, Backend};
use nitro::init::{self, layer_defaults, Init, Seed};
use nitro::optim::{Adam, Sgd};
use nitro::prelude::*;
use nitro::shard::{Mesh, PartitionSpec, Sharding};
use nitro::train::{Config, Model, Nitro};

/// The classifier declared by its types: every leaf zeros that were never written.
fn declared() -> Mlp {
    init::declared(|| mlp(Act::Tanh))
}

/// The rules of these tests: the layer library's, the input scale (not trainable) left alone.
fn rules(config: Config) -> Config {
    config
        .batch(8)
        .lr(0.02)
        .progress(false)
        .seed(11)
        .initialize_all(layer_defaults())
}

/// A handle on the declared model, its leaves created by the rules, on `backend`.
fn created_handle(config: Config, backend: &'static dyn Backend) -> Nitro<Mlp, Adam> {
    Nitro::with_backend(declared(), Adam::default(), config, backend, own_cache()).unwrap()
}

fn created_on(config: Config, backend: &'static dyn Backend) -> Vec<Vec<f32>> {
    let mut run = created_handle(rules(config), backend);
    assert!(
        run.creation_time().is_none(),
        "nothing is created before it is needed"
    );
    let leaves = leaves(run.experiment().unwrap());
    assert!(run.creation_time().is_some());
    leaves
}

#[test]
fn declared_leaves_are_created_as_the_rules_say_on_the_interpreter() {
    let created = created_on(Config::new(), backend::interpreter());
    // layers[0].w [4, 16], layers[0].b [16], layers[1].w [16, 3], layers[1].b [3].
    let (w0, b0, w1, b1) = (&created[0], &created[1], &created[2], &created[3]);
    let limit0 = (6.0f32 / 20.0).sqrt();
    let limit1 = (6.0f32 / 19.0).sqrt();
    assert!(w0.iter().all(|v| v.abs() <= limit0) && w0.iter().any(|&v| v != 0.0));
    assert!(w1.iter().all(|v| v.abs() <= limit1) && w1.iter().any(|&v| v != 0.0));
    assert!(b0.iter().chain(b1).all(|&v| v == 0.0));
    // Distinct leaves draw distinct values (their keys are folded from their paths).
    assert_ne!(&w0[..3], &w1[..3]);
    // The same seed gives the same leaves; another seed others.
    assert_eq!(created, created_on(Config::new(), backend::interpreter()));
    let mut other = created_handle(rules(Config::new()).seed(12), backend::interpreter());
    assert_ne!(leaves(other.experiment().unwrap())[0], created[0]);
}

#[test]
fn a_normal_rule_draws_its_mean_and_spread() {
    #[experiment]
    struct Table {
        #[device(trainable)]
        table: Array,
    }
    impl Model for Table {
        type Batch = Batch;
        fn loss(v: &TableView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
            b.x.sum(&[1]) * v.table.mean(&[0, 1])
        }
    }
    let mut run = Nitro::with_backend(
        init::declared(|| Table {
            table: init::normal(&[256, 64], 0.0, 0.02, Seed(0)),
        }),
        Adam::default(),
        Config::new().progress(false).initialize(
            "table",
            Init::Normal {
                mean: 0.5,
                std: 0.02,
            },
        ),
        backend::interpreter(),
        own_cache(),
    )
    .unwrap();
    let table = run
        .experiment()
        .unwrap()
        .table
        .as_slice::<f32>()
        .unwrap()
        .to_vec();
    let n = table.len() as f64;
    let mean = table.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = table
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    assert!((mean - 0.5).abs() < 0.002, "mean {mean}");
    assert!((var.sqrt() - 0.02).abs() < 0.001, "std {}", var.sqrt());
}

#[test]
fn bad_rules_are_refused_when_the_handle_is_made() {
    let make = |config: Config| {
        Nitro::with_backend(
            declared(),
            Adam::default(),
            config.progress(false),
            backend::interpreter(),
            own_cache(),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default()
    };
    let err = make(Config::new().initialize("*.kernel", Init::Zeros));
    assert!(
        err.contains("*.kernel") && err.contains("layers[0].w"),
        "{err}"
    );
    // A set of rules may go partly unused, but not wholly.
    let err =
        make(Config::new().initialize_all([("*.kernel", Init::Zeros), ("*.gamma", Init::Ones)]));
    assert!(
        err.contains("*.kernel") && err.contains("no trainable leaf"),
        "{err}"
    );
    // `scale` is a Device leaf that is not trained: it is read from the experiment.
    let err = make(Config::new().initialize("scale", Init::Ones));
    assert!(
        err.contains("not trainable") && err.contains("`scale`"),
        "{err}"
    );

    #[experiment]
    struct Counts {
        #[device(trainable)]
        n: Array,
    }
    impl Model for Counts {
        type Batch = Batch;
        fn loss(v: &CountsView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
            b.x.sum(&[1]) * v.n.convert(DType::F32).sum(&[0])
        }
    }
    let made = Nitro::with_backend(
        Counts {
            n: Array::zeros(DType::I32, &[3]),
        },
        Adam::default(),
        Config::new()
            .progress(false)
            .initialize("n", Init::HeNormal),
        backend::interpreter(),
        own_cache(),
    );
    let Err(err) = made else {
        panic!("a random rule on an integer leaf was accepted")
    };
    let err = err.to_string();
    assert!(err.contains("i32") && err.contains("`n`"), "{err}");
}

/// On XLA: the created leaves are the same, bit for bit, on one device and on every layout of
/// 4 devices; they agree with the interpreter's to float rounding; and FSDP trains from them to
/// the one-device losses.
#[test]
fn created_leaves_are_the_same_on_any_mesh_and_train_to_the_same_losses() {
    let test = "created_leaves_are_the_same_on_any_mesh_and_train_to_the_same_losses";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    xla_devices_or_skip(test, 4).expect("4 devices");
    let on_one = created_on(Config::new(), one);
    let interp = created_on(Config::new(), backend::interpreter());
    for (x, i) in on_one.iter().flatten().zip(interp.iter().flatten()) {
        assert!(
            (x - i).abs() <= 1e-6 * (1.0 + x.abs()),
            "XLA {x} vs interpreter {i}"
        );
    }
    let megatron = Config::new()
        .mesh(Mesh::new([("data", 2), ("model", 2)]).unwrap())
        .sharding(
            Sharding::replicated("data")
                .leaf("layers[0].w", PartitionSpec::new([None, Some("model")]))
                .leaf("layers[0].b", PartitionSpec::new([Some("model")]))
                .leaf("layers[1].w", PartitionSpec::new([Some("model"), None])),
        );
    for config in [
        fsdp(4),
        fsdp(2),
        Config::new().mesh(Mesh::new([("data", 4)]).unwrap()),
        megatron,
    ] {
        let what = format!("{:?}", config.mesh);
        let backend = backend_of(&config, one);
        assert_eq!(created_on(config, backend), on_one, "{what}");
    }
    // Training from them: FSDP on 4 devices to the one-device losses.
    let (x, y) = data(32, 5);
    let losses = |config: Config| {
        let backend = backend_of(&config, one);
        let mut run = created_handle(rules(config), backend);
        (0..4)
            .map(|i| run.step(&batch(&x, &y, 8 * i, 8, 8), 8).unwrap().loss)
            .collect::<Vec<f64>>()
    };
    let base = losses(Config::new());
    let sharded = losses(fsdp(4));
    for (a, b) in base.iter().zip(&sharded) {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + a.abs()),
            "{base:?} vs {sharded:?}"
        );
    }
    assert!(base[3] < base[0], "it trains: {base:?}");
}

// ---- host memory while creating ----------------------------------------------------------------

const CHILD: &str = "NITRO_DEVICE_INIT_MEMORY_CHILD";

/// A stack of 4 layers of 4096 × 4096 f32 (`nn::Repeated`, as a scanned model keeps them):
/// 256 MiB of parameters, large beside what compiling the initializer program takes.
const WIDE: [usize; 2] = [4096, 4096];

#[experiment]
pub struct Wide {
    #[device(trainable)]
    pub stack: nitro::nn::LinearParams,
}

impl Model for Wide {
    type Batch = Batch;

    fn loss(v: &WideView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        b.x.sum(&[1]) * v.stack.w.mean(&[0, 1, 2])
    }
}

/// The child: a declared `Wide` on 4 devices under FSDP, its leaves created on the devices
/// (`device`) or read from the host; prints the peak resident set before and after placing.
fn child(device: bool) {
    let backend: &'static dyn Backend = {
        let config = fsdp(4);
        backend::for_mesh(&config.partitioning().unwrap().unwrap()).unwrap()
    };
    // Built as a model is built: each layer drawn, then stacked (declared: neither draws nor
    // copies anything).
    let wide = || {
        use nitro::nn::{Layer, Linear, Repeated};
        Wide {
            stack: Repeated::new(Linear::new(WIDE[0], WIDE[1]), 4).init(Seed(0)),
        }
    };
    let experiment = if device { init::declared(wide) } else { wide() };
    let mut config = fsdp(4).batch(4).progress(false);
    if device {
        config = config.initialize_all(layer_defaults());
    }
    // Plain SGD keeps no state: creating (or reading) the leaves is all that grows.
    let mut run =
        Nitro::with_backend(experiment, Sgd, config, backend, own_cache()).expect("handle");
    let before = peak_rss_kb().unwrap_or(0);
    run.place().expect("placed");
    println!(
        "figures: before_kb={before} after_kb={} bytes={}",
        peak_rss_kb().unwrap_or(0),
        4 * (WIDE[0] * WIDE[1] + WIDE[1]) * 4
    );
}

fn figures(device: bool) -> (u64, u64, u64) {
    let figures = common::child_figures(
        "creating_leaves_on_the_devices_holds_no_host_copy_of_the_model",
        CHILD,
        if device { "device" } else { "host" },
    );
    (
        figures.get("before_kb"),
        figures.get("after_kb"),
        figures.get("bytes"),
    )
}

#[test]
fn creating_leaves_on_the_devices_holds_no_host_copy_of_the_model() {
    if let Ok(which) = std::env::var(CHILD) {
        child(which == "device");
        return;
    }
    let test = "creating_leaves_on_the_devices_holds_no_host_copy_of_the_model";
    if peak_rss_kb().is_none() {
        println!("skip: {test}: no /proc/self/status");
        return;
    }
    if xla_devices_or_skip(test, 4).is_none() {
        return;
    }
    let (before, after, bytes) = figures(true);
    let model_kb = bytes / 1024;
    // On CPU devices the shards live in this process: the floor is the model once.
    let grown = after.saturating_sub(before);
    let (host_before, host_after, _) = figures(false);
    let host_peak = host_after;
    println!(
        "created on the devices: peak {after} kB ({grown} kB over the handle's {before} kB); \
         read from the host: peak {host_peak} kB (from {host_before} kB); model {model_kb} kB"
    );
    // The floor: the devices' shards (the model once) and compiling the initializer program
    // (under 100 MB here, whatever the model's size).
    assert!(
        grown as f64 <= 1.15 * model_kb as f64 + 100.0 * 1024.0,
        "creating {model_kb} kB of leaves grew the peak by {grown} kB"
    );
    assert!(
        (after as f64) < 0.8 * host_peak as f64,
        "created: peak {after} kB; read from the host: peak {host_peak} kB"
    );
}

/// The created values against JAX's for the same key and rule (`bench/jax_init_goldens.py`:
/// `fold_in(fold_in(PRNGKey(seed), INIT_DOMAIN), leaf_id(path))`): on XLA within 1e-6 (the
/// goldens' tolerance for f32 arithmetic), on the interpreter too.
#[test]
fn created_values_match_jaxs_draws_for_the_same_key() {
    let bytes = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/goldens/init.safetensors"),
    )
    .unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let meta = header.metadata().clone().expect("case metadata");
    assert!(meta.len() >= 8, "{} cases", meta.len());
    let mut backends: Vec<&'static dyn Backend> = vec![backend::interpreter()];
    if let Some(xla) = xla_devices_or_skip("created_values_match_jaxs_draws_for_the_same_key", 1) {
        backends.push(xla);
    }
    for (case, json) in &meta {
        let m: serde_json::Value = serde_json::from_str(json).unwrap();
        let dims: Vec<usize> = m["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let path = m["path"].as_str().unwrap();
        assert_eq!(
            Init::leaf_id(path),
            m["leaf_id"].as_u64().unwrap() as u32,
            "{case}"
        );
        let rule = &m["rule"];
        let f = |k: &str| rule[k].as_f64().unwrap();
        let init = match rule["kind"].as_str().unwrap() {
            "glorot_uniform" => Init::GlorotUniform,
            "glorot_normal" => Init::GlorotNormal,
            "he_normal" => Init::HeNormal,
            "he_uniform" => Init::HeUniform,
            "normal" => Init::Normal {
                mean: f("mean"),
                std: f("std"),
            },
            "uniform" => Init::Uniform {
                low: f("low"),
                high: f("high"),
            },
            other => panic!("{case}: rule {other}"),
        };
        let want = file.tensor(&format!("{case}.out")).unwrap();
        let want: Vec<f32> = want
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let ty = nitro::LeafType::new(DType::F32, &dims);
        for (k, &b) in backends.iter().enumerate() {
            let on = ["the interpreter", "XLA"][k];
            let got = nitro::train::create_leaf(
                b,
                own_cache(),
                m["seed"].as_u64().unwrap(),
                path,
                &ty,
                init,
            )
            .unwrap();
            let got = got.as_slice::<f32>().unwrap();
            assert_eq!(got.len(), want.len(), "{case}");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                    "{case}[{i}] on {on}: {g} vs JAX's {w}"
                );
            }
        }
    }
}
