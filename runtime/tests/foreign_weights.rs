//! Weights written by other frameworks load with the right values, not only the right shapes:
//! an Equinox CNN saved in PyTorch's names and layouts (OIHW convs, `[out, in]` dense, a
//! conv→dense flatten in NCHW order) and a GPT-2-shaped model in Hugging Face's names and Conv1D
//! layouts (fused `c_attn`). Both fixtures and their reference logits were written by
//! `bench/foreign_fixtures.py` (Equinox's own forward pass; a JAX GPT-2 forward); nitro's
//! logits must match within 1e-5, on the interpreter and on XLA where it is installed. Also:
//! half-precision files cast on request, and what each import instruction refuses.
#![allow(missing_docs)]

mod common;

use nitro::backend::{self, Backend};
use nitro::cache::Cache;
use nitro::init::Seed;
use nitro::nn::{self, Conv2d, Conv2dParams, Flatten, Gpt2, Gpt2Params, Layer, Linear};
use nitro::nn::{LinearParams, Padding};
use nitro::optim::Sgd;
use nitro::prelude::*;
use nitro::train::{Config, Model, Nitro};
use nitro::weights::{self, Import};
use nitro::Error;

fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/weights")
        .join(name)
}

/// The tensors of a fixture file, by name.
fn tensors(name: &str) -> std::collections::HashMap<String, Array> {
    let bytes = std::fs::read(fixture(name)).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(n, v)| {
            let data: Vec<u8> = v.data().to_vec();
            let dims = v.shape().to_vec();
            let array = match v.dtype() {
                safetensors::Dtype::F32 => Array::from_vec(
                    &dims,
                    data.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ),
                safetensors::Dtype::I32 => Array::from_vec(
                    &dims,
                    data.chunks_exact(4)
                        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ),
                other => panic!("{other:?}"),
            }
            .unwrap();
            (n, array)
        })
        .collect()
}

fn backends() -> Vec<(&'static str, &'static dyn Backend)> {
    let mut out: Vec<(&'static str, &'static dyn Backend)> =
        vec![("interpreter", backend::interpreter())];
    if let Some(xla) = common::xla_or_skip("foreign_weights (XLA half)") {
        out.push(("xla", xla));
    }
    out
}

#[track_caller]
fn assert_within(got: &Array, want: &Array, tol: f32, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}");
    let worst = common::max_abs_diff(got, want.as_slice::<f32>().unwrap());
    assert!(worst <= tol, "{what}: max |Δ| = {worst:e} > {tol:e}");
}

// ---- the Equinox CNN -----------------------------------------------------------------------

#[derive(ContentHash, Clone, Debug)]
pub struct CnnArch {
    pub conv1: Conv2d,
    pub conv2: Conv2d,
    pub pool: nn::Pool2d,
    pub fc: Linear,
    /// Whether the data stays channels first (as PyTorch's); otherwise it is transposed to
    /// NHWC and the dense weight's rows reordered on import.
    pub channels_first: bool,
}

impl CnnArch {
    fn new(channels_first: bool) -> CnnArch {
        let pad = Padding::Symmetric(1, 1);
        let mut conv1 = Conv2d::new(1, 4, (3, 3)).padding(pad.clone());
        let mut conv2 = Conv2d::new(4, 6, (3, 3)).stride(2, 2).padding(pad);
        let mut pool = nn::max_pool2d((2, 2), (2, 2));
        if channels_first {
            conv1 = conv1.channels_first();
            conv2 = conv2.channels_first();
            pool = pool.channels_first();
        }
        // The dense width, computed by the layer library: 6·2·2 either way.
        let input = if channels_first { [1, 8, 8] } else { [8, 8, 1] };
        let flat = nn::dims_after(&input, &[&conv1, &pool, &conv2, &Flatten]).expect("dims");
        CnnArch {
            fc: Linear::new(flat[0], 5),
            conv1,
            conv2,
            pool,
            channels_first,
        }
    }
}

#[derive(Tree, Clone, Debug)]
pub struct Images {
    /// `[N, 1, 8, 8]`, as the fixture stores it.
    pub x: Array,
    pub y: Array,
}

#[experiment]
pub struct Cnn {
    #[graph_const]
    pub arch: CnnArch,
    #[device(trainable)]
    pub conv1: Conv2dParams,
    #[device(trainable)]
    pub conv2: Conv2dParams,
    #[device(trainable)]
    pub fc: LinearParams,
}

fn cnn_logits(v: &CnnView<'_>, x: Tensor) -> Tensor {
    let a = v.arch;
    let x = if a.channels_first {
        x
    } else {
        x.transpose(&[0, 2, 3, 1])
    };
    let h = a.conv1.forward(&v.conv1, x).relu();
    let h = a.pool.forward(&(), h);
    let h = a.conv2.forward(&v.conv2, h).relu();
    a.fc.forward(&v.fc, Flatten.forward(&(), h))
}

impl Model for Cnn {
    type Batch = Images;

    fn loss(v: &CnnView<'_>, b: &ImagesMirror<Tensor>) -> Tensor {
        nn::softmax_cross_entropy(cnn_logits(v, b.x), b.y)
    }

    fn predict(v: &CnnView<'_>, b: &ImagesMirror<Tensor>) -> Option<Tensor> {
        Some(cnn_logits(v, b.x))
    }
}

fn cnn(channels_first: bool) -> Cnn {
    let arch = CnnArch::new(channels_first);
    Cnn {
        conv1: arch.conv1.init(Seed(1)),
        conv2: arch.conv2.init(Seed(2)),
        fc: arch.fc.init(Seed(3)),
        arch,
    }
}

fn predict<E: Model>(e: E, batch: &E::Batch, rows: usize, b: &'static dyn Backend) -> Array {
    let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(8)));
    let mut run = Nitro::with_backend(e, Sgd, Config::new().batch(rows), b, cache).unwrap();
    run.predict(batch).unwrap()
}

fn equinox_batch() -> (Images, Array) {
    let io = tensors("equinox_cnn_io.safetensors");
    let x = io["x"].clone();
    let y = Array::zeros(DType::I32, &[x.dims()[0]]);
    (Images { x, y }, io["logits"].clone())
}

#[test]
fn an_equinox_cnn_loads_channels_first_with_the_pytorch_preset() {
    let mut net = cnn(true);
    let loaded = weights::load_into(
        &mut net,
        fixture("equinox_cnn.safetensors"),
        &Import::pytorch(),
    )
    .unwrap();
    assert_eq!(
        loaded.leaves,
        ["conv1.w", "conv1.b", "conv2.w", "conv2.b", "fc.w", "fc.b"]
    );
    // OIHW kept for the channels-first convs, the dense weight transposed.
    assert_eq!(net.conv1.w.dims(), &[4, 1, 3, 3]);
    assert_eq!(net.fc.w.dims(), &[24, 5]);
    let (batch, want) = equinox_batch();
    for (name, b) in backends() {
        let got = predict(cnn(true).with_params_of(&net), &batch, 3, b);
        assert_within(&got, &want, 1e-5, &format!("channels first on {name}"));
    }
}

#[test]
fn an_equinox_cnn_loads_channels_last_with_the_flatten_order() {
    let (batch, want) = equinox_batch();
    // Without the reordering the shapes match and the values are scrambled.
    let mut scrambled = cnn(false);
    weights::load_into(
        &mut scrambled,
        fixture("equinox_cnn.safetensors"),
        &Import::pytorch(),
    )
    .unwrap();
    assert_eq!(scrambled.conv1.w.dims(), &[3, 3, 1, 4], "HWIO");
    let got = predict(scrambled, &batch, 3, backend::interpreter());
    let off = common::max_abs_diff(&got, want.as_slice::<f32>().unwrap());
    assert!(off > 1e-3, "scrambled rows should not match: {off}");

    let mut net = cnn(false);
    let import = Import::pytorch().flatten_order("fc.w", [6, 2, 2]);
    weights::load_into(&mut net, fixture("equinox_cnn.safetensors"), &import).unwrap();
    for (name, b) in backends() {
        let got = predict(cnn(false).with_params_of(&net), &batch, 3, b);
        assert_within(&got, &want, 1e-5, &format!("channels last on {name}"));
    }
}

impl Cnn {
    fn with_params_of(mut self, other: &Cnn) -> Cnn {
        self.conv1 = other.conv1.clone();
        self.conv2 = other.conv2.clone();
        self.fc = other.fc.clone();
        self
    }
}

// ---- GPT-2 ---------------------------------------------------------------------------------

#[derive(Tree, Clone, Debug)]
pub struct Tokens {
    pub ids: Array,
}

#[experiment]
pub struct TinyGpt {
    #[graph_const]
    pub arch: Gpt2,
    #[device(trainable)]
    pub model: Gpt2Params,
}

impl Model for TinyGpt {
    type Batch = Tokens;

    fn loss(v: &TinyGptView<'_>, b: &TokensMirror<Tensor>) -> Tensor {
        let logits = v.arch.forward(&v.model, b.ids);
        nn::softmax_cross_entropy(logits, b.ids).mean(&[1])
    }

    fn predict(v: &TinyGptView<'_>, b: &TokensMirror<Tensor>) -> Option<Tensor> {
        Some(v.arch.forward(&v.model, b.ids))
    }
}

fn tiny_gpt() -> TinyGpt {
    let arch = Gpt2::new(50, 16, 64, 4, 2).unwrap();
    TinyGpt {
        model: arch.init(Seed(9)),
        arch,
    }
}

#[test]
fn a_hugging_face_gpt2_file_loads_with_the_gpt2_preset() {
    let mut gpt = tiny_gpt();
    let loaded = weights::load_into(
        &mut gpt,
        fixture("gpt2_tiny.safetensors"),
        &Import::gpt2("model"),
    )
    .unwrap();
    assert_eq!(loaded.leaves.len(), 2 + 2 * 16 + 2, "{:?}", loaded.leaves);
    // The causal-mask buffers are skipped, and said so.
    assert_eq!(loaded.ignored.len(), 2, "{:?}", loaded.ignored);
    assert!(
        loaded.ignored[0].contains("attn.bias"),
        "{:?}",
        loaded.ignored
    );
    // The fused c_attn was split: q is its first 64 columns.
    let file = tensors_f32("gpt2_tiny.safetensors", "h.1.attn.c_attn.weight");
    let q = gpt.model.blocks[1].attention.q.w.as_slice::<f32>().unwrap();
    assert_eq!(q[..64], file[..64]);
    assert_eq!(q[64..128], file[192..256]);

    let io = tensors("gpt2_tiny_io.safetensors");
    let batch = Tokens {
        ids: io["ids"].clone(),
    };
    for (name, b) in backends() {
        let mut fresh = tiny_gpt();
        fresh.model = gpt.model.clone();
        let got = predict(fresh, &batch, 2, b);
        assert_within(&got, &io["logits"], 1e-5, &format!("GPT-2 on {name}"));
    }
}

fn tensors_f32(file: &str, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(fixture(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = st.tensor(name).unwrap();
    view.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

// ---- casts and refusals --------------------------------------------------------------------

#[derive(Tree)]
pub struct TorchLinear {
    pub weight: Array,
    pub bias: Array,
}

#[experiment]
pub struct TorchFile {
    #[device]
    pub fc: TorchLinear,
}

#[experiment]
pub struct Dense {
    #[device(trainable)]
    pub fc: LinearParams,
}

fn half_file(dir: &common::TempDir) -> std::path::PathBuf {
    let w: Vec<nitro::f16> = (0..6)
        .map(|i| nitro::f16::from_f64(i as f64 * 0.5))
        .collect();
    let file = TorchFile {
        fc: TorchLinear {
            weight: Array::from_vec(&[2, 3], w).unwrap(),
            bias: Array::from_vec(&[2], vec![nitro::f16::from_f64(-1.0); 2]).unwrap(),
        },
    };
    std::fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join("half.safetensors");
    weights::export(&file, &path).unwrap();
    path
}

fn dense() -> Dense {
    Dense {
        fc: Linear::new(3, 2).init(Seed(4)),
    }
}

fn why(e: Error) -> String {
    match e {
        Error::DataFile { why, .. } => why,
        other => panic!("expected DataFile, got {other:?}"),
    }
}

#[test]
fn half_precision_is_refused_with_a_hint_and_cast_on_request() {
    let dir = common::TempDir::new("foreign-half");
    let path = half_file(&dir);
    let mut net = dense();
    let before = net.fc.w.clone();
    let err = why(weights::load_into(&mut net, &path, &Import::pytorch()).unwrap_err());
    assert!(
        err.contains("is f16[3,2] but leaf `fc.w` is f32[3,2]"),
        "{err}"
    );
    assert!(err.contains("Import::cast"), "{err}");
    assert_eq!(net.fc.w, before, "nothing changes on a refusal");

    let loaded = weights::load_into(&mut net, &path, &Import::pytorch().cast()).unwrap();
    assert_eq!(loaded.cast, ["`fc.w` f16 → f32", "`fc.b` f16 → f32"]);
    // Transposed: leaf [i][o] is file [o][i] = (o·3 + i)·0.5.
    assert_eq!(
        net.fc.w.as_slice::<f32>().unwrap(),
        &[0.0, 1.5, 0.5, 2.0, 1.0, 2.5]
    );
    assert_eq!(
        net.fc.b.as_ref().unwrap().as_slice::<f32>().unwrap(),
        &[-1.0, -1.0]
    );
    // An explicit rename under the preset keeps PyTorch's layout.
    let mut renamed = dense();
    let import = Import::pytorch().cast().rename("fc.weight", "fc.w");
    weights::load_into(&mut renamed, &path, &import).unwrap();
    assert_eq!(renamed.fc.w, net.fc.w);
}

#[test]
fn map_split_and_flatten_order_refuse_what_names_nothing() {
    let dir = common::TempDir::new("foreign-refusals");
    let path = half_file(&dir);
    let mut net = dense();
    let import = Import::pytorch()
        .cast()
        .map("fc.weight", Ok)
        .flatten_order("fc.v", [1, 1, 3])
        .split("fc.gate", 0, &["fc.w", "fc.x"]);
    let err = why(weights::load_into(&mut net, &path, &import).unwrap_err());
    for want in [
        "map(\"fc.weight\", …) names no leaf of `foreign_weights::Dense` (it is a tensor's name",
        "flatten_order(\"fc.v\", [1, 1, 3]) names no leaf",
        "split(\"fc.gate\", 0, [\"fc.w\", \"fc.x\"]) names no tensor of the file",
        "split(\"fc.gate\", 0, …) names `fc.x`, no leaf",
    ] {
        assert!(err.contains(want), "missing {want:?} in: {err}");
    }

    // A map's own error is reported with the tensor; one that works is applied last.
    let failing = Import::pytorch()
        .cast()
        .map("fc.b", |_| Err("bias refused".to_owned()));
    let err = why(weights::load_into(&mut net, &path, &failing).unwrap_err());
    assert!(
        err.contains("tensor `fc.bias` (for `fc.b`): map: bias refused"),
        "{err}"
    );
    let doubled = Import::pytorch().cast().map("fc.b", |a| {
        let v: Vec<f32> = a
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|x| x * 2.0)
            .collect();
        Array::from_vec(a.dims(), v).map_err(|e| e.to_string())
    });
    weights::load_into(&mut net, &path, &doubled).unwrap();
    assert_eq!(
        net.fc.b.as_ref().unwrap().as_slice::<f32>().unwrap(),
        &[-2.0, -2.0]
    );

    // A split that does not divide evenly.
    let uneven = Import::new()
        .cast()
        .split("fc.weight", 1, &["fc.w", "fc.b"]);
    let err = why(weights::load_into(&mut net, &path, &uneven).unwrap_err());
    assert!(
        err.contains("cannot split f16[2,3] into 2 equal parts along axis 1"),
        "{err}"
    );
}

#[test]
fn flatten_order_reorders_rows_from_channels_first_to_channels_last() {
    // Features (c, h, w) of a 2×2×2 map: row r = c·4 + h·2 + w holds r.
    #[derive(Tree)]
    pub struct W {
        pub w: Array,
    }
    #[experiment]
    pub struct OneLeaf {
        #[device]
        pub fc: W,
    }
    let dir = common::TempDir::new("foreign-flatten");
    std::fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join("rows.safetensors");
    let rows: Vec<f32> = (0..8).map(|r| r as f32).collect();
    weights::export(
        &OneLeaf {
            fc: W {
                w: Array::from_vec(&[8, 1], rows).unwrap(),
            },
        },
        &path,
    )
    .unwrap();
    let mut net = OneLeaf {
        fc: W {
            w: Array::zeros(DType::F32, &[8, 1]),
        },
    };
    let import = Import::new().flatten_order("fc.w", [2, 2, 2]);
    weights::load_into(&mut net, &path, &import).unwrap();
    // Row (h, w, c) = h·4 + w·2 + c takes channels-first row c·4 + h·2 + w.
    assert_eq!(
        net.fc.w.as_slice::<f32>().unwrap(),
        &[0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]
    );
    let wrong = Import::new().flatten_order("fc.w", [3, 1, 1]);
    let err = why(weights::load_into(&mut net, &path, &wrong).unwrap_err());
    assert!(err.contains("wants a first dim of 3 (c·h·w)"), "{err}");
}
