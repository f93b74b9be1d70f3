//! Weights into shards (issue 42, item 4): `Nitro::load_weights` on a handle on a mesh reads
//! each device's window of each leaf from the file — through splits, permutes and casts —
//! to the values `weights::load_into` gives on the host, reading each byte once under FSDP,
//! and refuses what `load_into` refuses with the same message, before anything changes.
#![allow(missing_docs)]

mod common;

use common::{own_cache, xla_devices_or_skip, TempDir};
use nitro::backend::{self, Backend};
use nitro::optim::Adam;
use nitro::prelude::*;
use nitro::shard::{Mesh, PartitionSpec, Sharding};
use nitro::train::{Config, Model, Nitro};
use nitro::weights::{self, Import};

#[derive(Tree, Clone, Debug)]
pub struct Rows {
    pub x: Array,
}

/// Two leaves a fused file tensor splits into, one stored transposed, one stored in f16, and
/// one that is not trained.
#[experiment]
#[derive(Clone)]
pub struct Four {
    #[device(trainable)]
    pub a: Array,
    #[device(trainable)]
    pub b: Array,
    #[device(trainable)]
    pub c: Array,
    #[device(trainable)]
    pub d: Array,
    #[device]
    pub scale: Array,
}

impl Model for Four {
    type Batch = Rows;

    fn loss(v: &FourView<'_>, r: &RowsMirror<Tensor>) -> Tensor {
        let h = r.x.matmul(v.a.transpose(&[1, 0])) + r.x.matmul(v.b.transpose(&[1, 0]));
        let k = h.matmul(v.c) * v.scale;
        let y = k.sum(&[1]) + v.d.sum(&[0]);
        y * y
    }
}

fn ramp(dims: &[usize], from: f32) -> Array {
    let n: usize = dims.iter().product();
    Array::from_vec(dims, (0..n).map(|i| from + i as f32 * 0.01).collect()).unwrap()
}

fn zeros() -> Four {
    Four {
        a: Array::zeros(DType::F32, &[8, 4]),
        b: Array::zeros(DType::F32, &[8, 4]),
        c: Array::zeros(DType::F32, &[8, 4]),
        d: Array::zeros(DType::F32, &[8]),
        scale: Array::zeros(DType::F32, &[4]),
    }
}

/// The file: `ab` [16, 4] (a above b), `c_t` [4, 8] (c transposed), `d16` [8] in f16, `s` [4].
fn write_file(path: &std::path::Path) {
    let (a, b) = (ramp(&[8, 4], 0.0), ramp(&[8, 4], 1.0));
    let mut ab = a.as_slice::<f32>().unwrap().to_vec();
    ab.extend_from_slice(b.as_slice::<f32>().unwrap());
    let c = ramp(&[8, 4], 2.0);
    let c = c.as_slice::<f32>().unwrap();
    let c_t: Vec<f32> = (0..4)
        .flat_map(|j| (0..8).map(move |i| c[i * 4 + j]))
        .collect();
    let d: Vec<u8> = ramp(&[8], 3.0)
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect();
    let le = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (ab, c_t) = (le(&ab), le(&c_t));
    let s = le(&[1.0, 0.5, 0.25, 2.0]);
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let tensors = vec![
        ("ab", TensorView::new(Dtype::F32, vec![16, 4], &ab).unwrap()),
        (
            "c_t",
            TensorView::new(Dtype::F32, vec![4, 8], &c_t).unwrap(),
        ),
        ("d16", TensorView::new(Dtype::F16, vec![8], &d).unwrap()),
        ("s", TensorView::new(Dtype::F32, vec![4], &s).unwrap()),
    ];
    std::fs::write(path, safetensors::serialize(tensors, None).unwrap()).unwrap();
}

fn import() -> Import {
    Import::new()
        .split("ab", 0, &["a", "b"])
        .rename("c_t", "c")
        .permute("c", &[1, 0])
        .rename("d16", "d")
        .rename("s", "scale")
        .cast()
}

fn values(e: &Four) -> Vec<Vec<f32>> {
    [&e.a, &e.b, &e.c, &e.d, &e.scale]
        .iter()
        .map(|a| a.as_slice::<f32>().unwrap().to_vec())
        .collect()
}

fn handle(config: Config, backend: &'static dyn Backend) -> Nitro<Four, Adam> {
    Nitro::with_backend(
        zeros(),
        Adam::default(),
        config.batch(4).progress(false),
        backend,
        own_cache(),
    )
    .unwrap()
}

#[test]
fn a_handle_off_a_mesh_loads_weights_as_the_experiment_would() {
    let dir = TempDir::new("weights-handle");
    std::fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join("w.safetensors");
    write_file(&path);
    let mut host = zeros();
    weights::load_into(&mut host, &path, &import()).unwrap();
    let mut run = handle(Config::new(), backend::interpreter());
    let loaded = run.load_weights(&path, &import()).unwrap();
    assert_eq!(loaded.cast, vec!["`d` f16 → f32".to_owned()]);
    assert_eq!(values(run.experiment().unwrap()), values(&host));
    let rows = Rows {
        x: Array::full(&[4, 4], 0.1f32),
    };
    assert!(run.step(&rows, 4).unwrap().loss.is_finite());
}

/// On 4 XLA devices under FSDP, and tensor parallel on 2 × 2: the values `load_into` gives,
/// each device's windows read, each byte once under FSDP; a file that does not fit is refused
/// with `load_into`'s message and the handle keeps its values.
#[test]
fn a_handle_on_a_mesh_reads_each_devices_ranges_of_the_file() {
    let test = "a_handle_on_a_mesh_reads_each_devices_ranges_of_the_file";
    let Some(_) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let dir = TempDir::new("weights-ranges");
    std::fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join("w.safetensors");
    write_file(&path);
    let mut host = zeros();
    let on_host = weights::load_into(&mut host, &path, &import()).unwrap();
    let fsdp = Config::new()
        .mesh(Mesh::new([("data", 4)]).unwrap())
        .sharding(Sharding::fsdp("data"));
    let tp = Config::new()
        .mesh(Mesh::new([("data", 2), ("model", 2)]).unwrap())
        .sharding(
            Sharding::replicated("data")
                .leaf("a", PartitionSpec::new([Some("model"), None]))
                .leaf("c", PartitionSpec::new([None, Some("model")])),
        );
    let trainable_bytes = 3 * 8 * 4 * 4 + 8 * 2;
    for (what, config, read) in [
        ("FSDP on 4", fsdp.clone(), trainable_bytes + 16),
        ("tensor parallel on 2 x 2", tp, 0),
    ] {
        let backend = backend::for_mesh(&config.partitioning().unwrap().unwrap()).unwrap();
        let mut run = handle(config, backend);
        let loaded = run.load_weights(&path, &import()).unwrap();
        assert_eq!(loaded.leaves, on_host.leaves, "{what}");
        assert_eq!(loaded.cast, on_host.cast, "{what}");
        assert_eq!(values(run.experiment().unwrap()), values(&host), "{what}");
        if read > 0 {
            // Every window distinct: each byte of the file's tensors read once.
            assert_eq!(loaded.read_bytes, read as u64, "{what}");
            assert_eq!(on_host.read_bytes, read as u64, "{what}");
        }
        let rows = Rows {
            x: Array::full(&[4, 4], 0.1f32),
        };
        assert!(run.step(&rows, 4).unwrap().loss.is_finite(), "{what}");
    }

    // A file that does not fit: the same refusal as on the host, and nothing changes.
    let backend = backend::for_mesh(&fsdp.partitioning().unwrap().unwrap()).unwrap();
    let mut run = handle(fsdp, backend);
    run.load_weights(&path, &import()).unwrap();
    let before = values(run.experiment().unwrap());
    let wrong = Import::new()
        .split("ab", 0, &["a", "b"])
        .rename("c_t", "c")
        .rename("d16", "d")
        .rename("s", "scale");
    let on_handle = run.load_weights(&path, &wrong).unwrap_err().to_string();
    let on_host = weights::load_into(&mut zeros(), &path, &wrong)
        .unwrap_err()
        .to_string();
    assert_eq!(on_handle, on_host);
    assert!(
        on_handle.contains("`c`") && on_handle.contains("f16"),
        "{on_handle}"
    );
    assert_eq!(values(run.experiment().unwrap()), before);
}

/// A `safetensors` file written by hand: `(name, dims, offsets)` of f32 tensors in its header,
/// then `data` bytes — what a broken writer leaves.
fn crafted(path: &std::path::Path, tensors: &[(&str, &[usize], (u64, u64))], data: usize) {
    let mut header = serde_json::Map::new();
    for (name, dims, (b, e)) in tensors {
        header.insert(
            (*name).to_owned(),
            serde_json::json!({"dtype": "F32", "shape": dims, "data_offsets": [b, e]}),
        );
    }
    let mut head = serde_json::to_vec(&header).unwrap();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut file = (head.len() as u64).to_le_bytes().to_vec();
    file.extend(head);
    file.extend((0..data).map(|i| (i % 251) as u8));
    std::fs::write(path, file).unwrap();
}

/// Files whose header the `safetensors` crate refuses — one tensor's offsets inside another's
/// bytes, unused bytes between tensors, bytes after the last — are refused on a mesh as
/// `load_into` refuses them, with its message, before a byte is read and with nothing changed.
#[test]
fn a_mesh_refuses_the_malformed_files_load_into_refuses_with_its_message() {
    let test = "a_mesh_refuses_the_malformed_files_load_into_refuses_with_its_message";
    let Some(_) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let dir = TempDir::new("weights-ranges-malformed");
    std::fs::create_dir_all(dir.path()).unwrap();
    let fsdp = Config::new()
        .mesh(Mesh::new([("data", 4)]).unwrap())
        .sharding(Sharding::fsdp("data"));
    let backend = backend::for_mesh(&fsdp.partitioning().unwrap().unwrap()).unwrap();
    let mut run = handle(fsdp, backend);
    let before = values(run.experiment().unwrap());
    let (m, v) = (&[8usize, 4][..], &[8usize][..]);
    let s = &[4usize][..];
    // The layout a writer would give: a, b, c, d, scale back to back (128·3 + 32 + 16 bytes).
    let honest = |b: (u64, u64), c: (u64, u64)| {
        vec![
            ("a", m, (0, 128)),
            ("b", m, b),
            ("c", m, c),
            ("d", v, (c.1, c.1 + 32)),
            ("scale", s, (c.1 + 32, c.1 + 48)),
        ]
    };
    let path = dir.path().join("ok.safetensors");
    crafted(&path, &honest((128, 256), (256, 384)), 432);
    run.load_weights(&path, &Import::new()).unwrap();
    let loaded = values(run.experiment().unwrap());
    assert_ne!(loaded, before);
    for (what, tensors, data, says) in [
        (
            "b's offsets inside a's bytes",
            honest((64, 192), (192, 320)),
            368,
            "invalid offset for tensor `b`",
        ),
        (
            "16 unused bytes between a and b",
            honest((144, 272), (272, 400)),
            448,
            "invalid offset for tensor `b`",
        ),
        (
            "8 bytes after the last tensor",
            honest((128, 256), (256, 384)),
            440,
            "not fully covered",
        ),
    ] {
        let path = dir.path().join("bad.safetensors");
        crafted(&path, &tensors, data);
        let on_host = weights::load_into(&mut zeros(), &path, &Import::new())
            .unwrap_err()
            .to_string();
        let on_handle = run
            .load_weights(&path, &Import::new())
            .unwrap_err()
            .to_string();
        assert_eq!(on_handle, on_host, "{what}");
        assert!(on_handle.contains(says), "{what}: {on_handle}");
        assert_eq!(values(run.experiment().unwrap()), loaded, "{what}");
    }
}
