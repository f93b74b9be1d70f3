//! The sharding, import and layer parts under hostile input (issue 40): meshes whose sizes
//! overflow, gathers by specs the mesh cannot hold, casts that overflow a leaf's dtype, paddings
//! and products past what a size holds, sequences longer than a position table, and the hints
//! and names an error gives. Each case a typed error that names what to change, or the right
//! result — never a silently wrong one.
#![allow(missing_docs)]

mod common;

use common::TempDir;
use nitro::nn::{self, Conv2d, Flatten, Gpt2, Layer, OutputDims, Padding};
use nitro::prelude::*;
use nitro::shard::{Mesh, PartitionSpec};
use nitro::trace::trace;
use nitro::train::Config;
use nitro::tree::LeafPath;
use nitro::weights::{self, Import};
use nitro::{f16, Error, LeafType};

// ---- 1. mesh sizes ---------------------------------------------------------------------------

#[test]
fn a_mesh_whose_sizes_overflow_or_pass_the_device_bound_is_refused() {
    for axes in [
        vec![("a", 1usize << 32), ("b", 1 << 32)],
        vec![("a", usize::MAX), ("b", 2)],
        vec![("a", 64), ("b", 64)],
    ] {
        let err = Mesh::new(axes.clone()).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, Error::Sharding { .. }) && text.contains("more than 2048 devices"),
            "{axes:?}: {text}"
        );
    }
    // At the bound it is a mesh, and the config's device count is its product.
    let mesh = Mesh::new([("a", 32), ("b", 64)]).unwrap();
    assert_eq!(mesh.devices(), 2048);
    assert_eq!(Config::new().mesh(mesh).device_count().unwrap(), 2048);
    // Config::devices has the same bound, and 0 is refused too.
    for n in [0, 2049, usize::MAX] {
        let err = Config::new().devices(n).device_count().unwrap_err();
        assert!(
            matches!(err, Error::Devices { requested, .. } if requested == n),
            "{err}"
        );
    }
}

// ---- 2. gather checks its spec ----------------------------------------------------------------

#[test]
fn gather_checks_its_spec_as_split_does() {
    let mesh = Mesh::new([("data", 2)]).unwrap();
    let w = Array::from_vec(&[4, 2], (0..8).map(|i| i as f32).collect()).unwrap();
    let shards = PartitionSpec::new([Some("data"), None])
        .split(&mesh, &w, "w")
        .unwrap();
    // An axis the mesh lacks: before, sized as 1, the first shard came back as the whole.
    let err = PartitionSpec::new([Some("model"), None])
        .gather(&mesh, &shards, "w")
        .unwrap_err()
        .to_string();
    assert!(err.contains("`model`") && err.contains("lacks"), "{err}");
    // A spec longer than the rank, and one axis on two dims.
    let err = PartitionSpec::new([Some("data"), None, None])
        .gather(&mesh, &shards, "w")
        .unwrap_err()
        .to_string();
    assert!(err.contains("names 3 dims"), "{err}");
    let err = PartitionSpec::new([Some("data"), Some("data")])
        .gather(&mesh, &shards, "w")
        .unwrap_err()
        .to_string();
    assert!(err.contains("two dims"), "{err}");
    // The right spec still gathers the whole.
    let back = PartitionSpec::new([Some("data"), None])
        .gather(&mesh, &shards, "w")
        .unwrap();
    assert_eq!(back, w);
}

// ---- 3, 8, 9. imports: overflowing casts, flatten orders, hints --------------------------------

#[derive(Tree, Clone, Debug)]
pub struct One {
    pub w: Array,
}

#[experiment]
#[derive(Clone, Debug)]
pub struct Holder {
    #[device(trainable)]
    pub fc: One,
}

fn holder(a: Array) -> Holder {
    Holder { fc: One { w: a } }
}

/// A safetensors file holding `fc.w = a`.
fn file_of(dir: &TempDir, name: &str, a: Array) -> std::path::PathBuf {
    std::fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join(name);
    weights::export(&holder(a), &path).unwrap();
    path
}

fn why(e: Error) -> String {
    match e {
        Error::DataFile { why, .. } => why,
        other => panic!("expected DataFile, got {other:?}"),
    }
}

#[test]
fn a_cast_that_overflows_the_leafs_dtype_is_refused_naming_the_value_and_index() {
    let dir = TempDir::new("cast-overflow");
    let values = vec![1.0, -2.5, 70000.0, 3.0, 1e300, 0.5];
    let path = file_of(
        &dir,
        "wide.safetensors",
        Array::from_vec(&[2, 3], values).unwrap(),
    );
    let leaf = || holder(Array::zeros(DType::F16, &[2, 3]));
    let mut net = leaf();
    let err = why(weights::load_into(&mut net, &path, &Import::new().cast()).unwrap_err());
    assert!(
        err.contains("`fc.w`")
            && err.contains("70000")
            && err.contains("[0, 2]")
            && err.contains("2 value(s)")
            && err.contains("cast_saturating"),
        "{err}"
    );
    // Nothing changed.
    assert!(net
        .fc
        .w
        .as_slice::<f16>()
        .unwrap()
        .iter()
        .all(|v| v.to_f32() == 0.0));

    // Saturating clamps to ±65504 and says so; the other values are converted as before.
    let mut net = leaf();
    let loaded = weights::load_into(&mut net, &path, &Import::new().cast_saturating()).unwrap();
    let got: Vec<f32> = net
        .fc
        .w
        .as_slice::<f16>()
        .unwrap()
        .iter()
        .map(|v| v.to_f32())
        .collect();
    assert_eq!(got, [1.0, -2.5, 65504.0, 3.0, 65504.0, 0.5]);
    assert_eq!(loaded.saturated.len(), 1, "{loaded:?}");
    assert!(
        loaded.saturated[0].contains("`fc.w` 2 value(s)"),
        "{loaded:?}"
    );
    assert_eq!(loaded.cast, ["`fc.w` f64 → f16"]);

    // Infinities and NaN in the file are values, not overflows: they pass through as they are.
    let path = file_of(
        &dir,
        "inf.safetensors",
        Array::from_vec(&[3], vec![f64::INFINITY, f64::NAN, -1.0]).unwrap(),
    );
    let mut net = holder(Array::zeros(DType::F16, &[3]));
    let loaded = weights::load_into(&mut net, &path, &Import::new().cast()).unwrap();
    assert!(loaded.saturated.is_empty());
    let got = net.fc.w.as_slice::<f16>().unwrap();
    assert!(got[0].to_f32().is_infinite() && got[1].to_f32().is_nan());
}

#[test]
fn a_flatten_order_whose_product_overflows_says_so() {
    let dir = TempDir::new("flatten-overflow");
    let path = file_of(&dir, "w.safetensors", Array::zeros(DType::F32, &[8, 2]));
    let mut net = holder(Array::zeros(DType::F32, &[8, 2]));
    let import = Import::new().flatten_order("fc.w", [1 << 32, 1 << 32, 2]);
    let err = why(weights::load_into(&mut net, &path, &import).unwrap_err());
    assert!(err.contains("overflows"), "{err}");
    assert!(!err.contains("out of memory"), "{err}");
}

#[test]
fn a_shape_mismatch_hints_at_the_layout_and_a_dtype_mismatch_at_cast() {
    let dir = TempDir::new("hints");
    // PyTorch's Linear weight [out, in] for a leaf [in, out], same dtype: the layout hint, no
    // cast hint.
    let path = file_of(&dir, "t.safetensors", Array::zeros(DType::F32, &[3, 4]));
    let mut net = holder(Array::zeros(DType::F32, &[4, 3]));
    let err = why(weights::load_into(&mut net, &path, &Import::new()).unwrap_err());
    assert!(
        err.contains("Import::pytorch()") && err.contains("permute(\"fc.w\", &[1, 0])"),
        "{err}"
    );
    assert!(!err.contains("Import::cast"), "{err}");
    // The permute it names loads it.
    let import = Import::new().permute("fc.w", &[1, 0]);
    weights::load_into(&mut net, &path, &import).unwrap();

    // Only the dtype differs: the cast hint, no layout hint.
    let path = file_of(&dir, "d.safetensors", Array::zeros(DType::F64, &[4, 3]));
    let err = why(weights::load_into(&mut net, &path, &Import::new()).unwrap_err());
    assert!(err.contains("Import::cast"), "{err}");
    assert!(!err.contains("permute"), "{err}");

    // A shape that is no reordering of the leaf's: neither.
    let path = file_of(&dir, "s.safetensors", Array::zeros(DType::F32, &[5, 3]));
    let err = why(weights::load_into(&mut net, &path, &Import::new()).unwrap_err());
    assert!(
        !err.contains("Import::cast") && !err.contains("permute"),
        "{err}"
    );
    // A rank-3 reordering names its permutation.
    let path = file_of(&dir, "r.safetensors", Array::zeros(DType::F32, &[2, 3, 4]));
    let mut net = holder(Array::zeros(DType::F32, &[4, 2, 3]));
    let err = why(weights::load_into(&mut net, &path, &Import::new()).unwrap_err());
    assert!(err.contains("permute(\"fc.w\", &[2, 0, 1])"), "{err}");
    let import = Import::new().permute("fc.w", &[2, 0, 1]);
    weights::load_into(&mut net, &path, &import).unwrap();
}

// ---- 4. paddings and products past a size ------------------------------------------------------

#[test]
fn a_symmetric_padding_past_i64_is_refused_by_output_dims_and_the_trace_alike() {
    for padding in [
        Padding::Symmetric(usize::MAX, 0),
        Padding::Symmetric(1 << 63, 0),
        Padding::Symmetric(0, usize::MAX),
    ] {
        let conv = Conv2d::new(1, 4, (3, 3)).padding(padding.clone());
        let err = conv.output_dims(&[8, 8, 1]).unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, Error::Layer { .. }) && text.contains("past the largest padding"),
            "{padding:?}: {text}"
        );
        // The forward pass fails its trace with the same words.
        let params = conv.init(nitro::init::Seed(0));
        let traced = trace(
            &[
                ("x".into(), LeafType::new(DType::F32, &[2, 8, 8, 1])),
                ("w".into(), params.w.leaf_type()),
                ("b".into(), params.b.as_ref().unwrap().leaf_type()),
            ],
            |i| {
                let p = nn::Conv2dParamsMirror {
                    w: i[1],
                    b: Some(i[2]),
                };
                vec![conv.forward(&p, i[0])]
            },
        );
        let trace_err = traced.unwrap_err().to_string();
        assert!(
            trace_err.contains("past the largest padding"),
            "{padding:?}: {trace_err}"
        );
    }
    // A padding that fits still gives the shape the trace gives.
    let conv = Conv2d::new(1, 4, (3, 3)).padding(Padding::Symmetric(2, 0));
    assert_eq!(conv.output_dims(&[8, 8, 1]).unwrap(), [10, 6, 4]);
    // A window larger than the input is the trace's refusal too, not a made-up [0, 0, c].
    let big = Conv2d::new(1, 4, (9, 9)).padding(Padding::Valid);
    assert!(matches!(
        big.output_dims(&[8, 8, 1]),
        Err(Error::Layer { .. })
    ));
    assert!(nn::max_pool2d((9, 9), (1, 1))
        .output_dims(&[8, 8, 1])
        .is_err());
    // Flatten's product is checked.
    let err = Flatten.output_dims(&[1 << 32, 1 << 32, 2]).unwrap_err();
    assert!(err.to_string().contains("overflows"), "{err}");
    let err = nn::dims_after(&[8, 8, 1], &[&big, &Flatten]).unwrap_err();
    assert!(err.to_string().contains("Conv2d"), "{err}");
}

// ---- 5. sequences past the position table -----------------------------------------------------

#[test]
fn gpt2_refuses_more_tokens_than_its_context_naming_both() {
    let model = Gpt2::new(11, 4, 8, 2, 1).unwrap();
    let params = model.init(nitro::init::Seed(3));
    let mut leaves = Vec::new();
    params.for_each_leaf("p", &mut |path, a| {
        leaves.push((path.as_str().to_owned(), a.leaf_type()))
    });
    let run = |time: usize| {
        let mut inputs = vec![("ids".to_owned(), LeafType::new(DType::I32, &[1, time]))];
        inputs.extend(leaves.iter().cloned());
        trace(&inputs, |i| {
            let mut k = 0;
            let p = params.mirror(&mut LeafPath::root("p"), &mut |_, _| {
                k += 1;
                i[k]
            });
            vec![model.forward(&p, i[0])]
        })
    };
    let err = run(6).unwrap_err().to_string();
    assert!(
        err.contains("6 positions") && err.contains("4 rows"),
        "{err}"
    );
    assert_eq!(run(4).unwrap().output_types()[0].dims, [1, 4, 11]);
}

// ---- 7. a batch the mesh's batch axis does not divide ----------------------------------------

#[path = "common/mlp.rs"]
mod mlp;

#[test]
fn a_batch_the_mesh_axis_does_not_divide_names_the_mesh_and_its_axis() {
    use nitro::optim::Adam;
    use nitro::shard::Sharding;
    use nitro::train::Nitro;
    let config = Config::new()
        .batch(4)
        .progress(false)
        .mesh(Mesh::new([("data", 3)]).unwrap())
        .sharding(Sharding::fsdp("data"));
    // On whichever backend `Nitro::new` picks (XLA partitions, the interpreter does not): the
    // config's batch axis decides on both.
    let err = Nitro::new(mlp::mlp(mlp::Act::Tanh), Adam::default(), config)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Config::mesh")
            && err.contains("`data` axis")
            && err.contains("multiple of 3"),
        "{err}"
    );
    assert!(!err.contains("Config::devices"), "{err}");
}

// ---- 13. predicting any number of rows ----------------------------------------------------------

#[test]
fn predict_data_predicts_any_number_of_rows_on_the_programs_there_are() {
    use nitro::cache::Cache;
    use nitro::optim::Adam;
    use nitro::train::Nitro;
    let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(16)));
    let mut h = Nitro::with_backend(
        mlp::mlp(mlp::Act::Tanh),
        Adam::default(),
        Config::new().batch(32).progress(false),
        nitro::backend::interpreter(),
        cache,
    )
    .unwrap();
    let train = mlp::dataset(64, 1);
    h.fit(&train, None).unwrap();
    let all = mlp::dataset(200, 9);
    // One batch of exactly 32 rows, through `predict`: the reference.
    let (x, y) = mlp::data(200, 9);
    let reference: Vec<Vec<f32>> = (0..200)
        .step_by(32)
        .flat_map(|start| {
            let real = (200 - start).min(32);
            let p = h.predict(&mlp::batch(&x, &y, start, real, 32)).unwrap();
            let rows: Vec<Vec<f32>> = p
                .as_slice::<f32>()
                .unwrap()
                .chunks(3)
                .take(real)
                .map(<[f32]>::to_vec)
                .collect();
            rows
        })
        .collect();
    let compiles = cache.stats().compiles;
    for rows in [7usize, 32, 200] {
        let data = all.select(&(0..rows).collect::<Vec<_>>()).unwrap();
        let p = h.predict_data(&data).unwrap();
        assert_eq!(p.dims(), [rows, 3]);
        let got: Vec<&[f32]> = p.as_slice::<f32>().unwrap().chunks(3).collect();
        for (i, row) in got.iter().enumerate() {
            assert_eq!(*row, reference[i].as_slice(), "rows={rows}, row {i}");
        }
    }
    assert_eq!(
        cache.stats().compiles,
        compiles,
        "predicting compiled nothing new"
    );
    // `predict` with another row count says how to predict any number of rows.
    let err = h
        .predict(&mlp::batch(&x, &y, 0, 7, 7))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("7 rows") && err.contains("predict_data"),
        "{err}"
    );
    // What `validate` returns, as fractions.
    let r = h.validate(&all).unwrap();
    assert_eq!(r.rows, 200);
    assert!((r.accuracy() - r.correct / 200.0).abs() < 1e-12);
    assert!((r.mean_loss() - r.loss_sum / 200.0).abs() < 1e-12);
    assert!(r.accuracy() > 0.0 && r.accuracy() <= 1.0);
}
