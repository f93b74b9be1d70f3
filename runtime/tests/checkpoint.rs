//! Checkpoints: bit-exact round trips, refusals that name what differs, corrupt files as typed
//! errors, atomic writes, and files the `safetensors` crate reads.
#![allow(missing_docs)]

use std::path::PathBuf;

use nitro::checkpoint::{meta, Checkpoint, OPTIMIZER_PREFIX};
use nitro::prelude::*;
use nitro::Error;

#[derive(ContentHash, Clone, Debug, PartialEq)]
struct Arch {
    widths: Vec<usize>,
    eps: f64,
}

#[derive(Tree, Clone, Debug, PartialEq)]
struct Dense {
    w: Array,
    b: Array,
    gate: Option<Array>,
}

#[experiment]
#[derive(Clone, Debug, PartialEq)]
struct Net {
    #[graph_const]
    arch: Arch,
    #[graph_const]
    classes: usize,
    #[device(trainable)]
    layers: Vec<Dense>,
    #[device]
    lr: Array,
    #[device]
    extras: (Array, Array, Array, Option<Array>),
    notes: String,
}

#[experiment]
struct Other {
    #[graph_const]
    classes: usize,
    #[device]
    lr: Array,
}

/// A net with distinct, awkward values in every leaf (NaN, -0.0, extremes).
fn net(seed: u32) -> Net {
    let f = |n: usize, k: u32| -> Vec<f32> {
        (0..n)
            .map(|i| f32::from_bits(0x3f80_0000 ^ (i as u32).wrapping_mul(2654435761) ^ k))
            .collect()
    };
    Net {
        arch: Arch {
            widths: vec![3, 4, 2],
            eps: 1e-5,
        },
        classes: 2,
        layers: vec![
            Dense {
                w: Array::from_vec(&[3, 4], f(12, seed)).unwrap(),
                b: Array::from_vec(&[4], vec![f32::NAN, -0.0, f32::MAX, f32::MIN_POSITIVE])
                    .unwrap(),
                gate: Some(Array::from_vec(&[4], vec![true, false, true, true]).unwrap()),
            },
            Dense {
                w: Array::from_vec(&[4, 2], f(8, seed + 1)).unwrap(),
                b: Array::zeros(DType::F32, &[2]),
                gate: None,
            },
        ],
        lr: Array::scalar(0.1f64 + f64::from(seed)),
        extras: (
            Array::from_vec(&[3], vec![i32::MIN, -1, i32::MAX]).unwrap(),
            Array::from_vec(&[2, 2], vec![0u8, 1, 254, 255]).unwrap(),
            Array::from_vec(&[2], vec![i64::MIN, 7]).unwrap(),
            Some(Array::from_vec(&[0, 3], Vec::<f64>::new()).unwrap()),
        ),
        notes: "host".into(),
    }
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("nitro-ckpt-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An array as dtype, dims and little-endian bytes.
type Bits = (DType, Vec<usize>, Vec<u8>);

/// Bit-exact equality of two arrays (NaN == NaN, -0.0 != 0.0).
fn bits(a: &Array) -> Bits {
    let bytes = match a.data() {
        nitro::ArrayData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        nitro::ArrayData::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        nitro::ArrayData::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        nitro::ArrayData::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        nitro::ArrayData::U8(v) => v.clone(),
        nitro::ArrayData::Bool(v) => v.iter().map(|&b| u8::from(b)).collect(),
        nitro::ArrayData::U32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        other => panic!("no test array has dtype {}", other.dtype()),
    };
    (a.dtype(), a.dims().to_vec(), bytes)
}

fn leaves(n: &Net) -> Vec<(String, Bits)> {
    let mut out = Vec::new();
    n.visit_device(&mut |_, path, node| {
        if let nitro::Node::Leaf(a) = node {
            out.push((path.to_string(), bits(a)));
        }
    });
    out
}

fn opt_state() -> (Array, Array) {
    (
        Array::from_vec(&[3, 4], vec![0.25f32; 12]).unwrap(),
        Array::scalar(17i64),
    )
}

#[test]
fn round_trip_is_bit_exact() {
    let dir = TempDir::new("roundtrip");
    let path = dir.0.join("step-42.safetensors");
    let src = net(1);
    let (m, t) = opt_state();
    Checkpoint::capture(&src, &[("m/layers[0].w", &m), ("t", &t)], 42)
        .unwrap()
        .save(&path)
        .unwrap();

    let mut dst = net(9);
    assert_ne!(leaves(&dst), leaves(&src));
    dst.notes = "kept".into();
    let restored = Checkpoint::load(&path)
        .unwrap()
        .restore_into(&mut dst)
        .unwrap();
    assert_eq!(leaves(&dst), leaves(&src));
    assert_eq!(dst.notes, "kept", "Host fields are not touched");
    assert_eq!(restored.step, 42);
    assert_eq!(restored.optimizer.len(), 2);
    assert_eq!(restored.optimizer[0].0, "m/layers[0].w");
    assert_eq!(bits(&restored.optimizer[0].1), bits(&m));
    assert_eq!(
        (
            restored.optimizer[1].0.as_str(),
            bits(&restored.optimizer[1].1)
        ),
        ("t", bits(&t))
    );

    // In memory too; decoding keeps every recorded fact. (The header's key order is the
    // safetensors crate's choice, so bytes are compared through a decode.)
    let c = Checkpoint::capture(&src, &[("t", &t)], 1).unwrap();
    let back = Checkpoint::from_bytes(&c.to_bytes().unwrap()).unwrap();
    let leaf_bits = |c: &Checkpoint| -> Vec<_> {
        c.device()
            .iter()
            .chain(c.optimizer())
            .map(|(n, a)| (n.clone(), bits(a)))
            .collect()
    };
    assert_eq!(leaf_bits(&back), leaf_bits(&c));
    assert_eq!(back.device_signature(), c.device_signature());
    assert_eq!(back.graph_const_fields(), c.graph_const_fields());
    assert_eq!(
        (back.experiment(), back.step(), back.schema_digest()),
        (Net::TYPE_PATH, 1, Net::SCHEMA_DIGEST)
    );
    assert_eq!(back.graph_const_digest(), src.graph_const_digest());
}

#[test]
fn the_file_is_plain_safetensors_with_documented_names() {
    let src = net(1);
    let (m, _) = opt_state();
    let bytes = Checkpoint::capture(&src, &[("m/layers[0].w", &m)], 5)
        .unwrap()
        .to_bytes()
        .unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "extras.0",
            "extras.1",
            "extras.2",
            "extras.3",
            "layers[0].b",
            "layers[0].gate",
            "layers[0].w",
            "layers[1].b",
            "layers[1].w",
            "lr",
            "opt/m/layers[0].w",
        ]
    );
    let w = st.tensor("layers[0].w").unwrap();
    assert_eq!(
        (w.dtype(), w.shape()),
        (safetensors::Dtype::F32, &[3usize, 4][..])
    );
    let expected: Vec<u8> = src.layers[0]
        .w
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(w.data(), expected.as_slice());
    assert_eq!(
        st.tensor("layers[0].gate").unwrap().dtype(),
        safetensors::Dtype::BOOL
    );
    assert_eq!(st.tensor("lr").unwrap().shape(), &[] as &[usize]);
    assert_eq!(
        st.tensor(&format!("{OPTIMIZER_PREFIX}m/layers[0].w"))
            .unwrap()
            .shape(),
        &[3, 4]
    );

    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let md = header.metadata().as_ref().unwrap();
    assert_eq!(md[meta::FORMAT], meta::FORMAT_VALUE);
    assert_eq!(md[meta::VERSION], "2");
    assert_eq!(md[meta::STEP], "5");
    assert_eq!(md[meta::EXPERIMENT], Net::TYPE_PATH);
    assert_eq!(md[meta::SCHEMA_DIGEST], Net::SCHEMA_DIGEST.to_string());
    assert_eq!(
        md[meta::GRAPH_CONST_DIGEST],
        src.graph_const_digest().to_string()
    );
    assert_eq!(md[meta::GRAPH_CONST_FIELDS], "arch,classes");
    for (field, digest) in src.graph_const_field_digests() {
        assert_eq!(
            md[&format!("{}{field}", meta::GRAPH_CONST_FIELD_PREFIX)],
            digest.to_string()
        );
    }
    assert_eq!(md[meta::CHECKSUM].len(), 64);
}

#[test]
fn refusal_names_the_changed_graph_const_fields() {
    let bytes = Checkpoint::capture(&net(1), &[], 3)
        .unwrap()
        .to_bytes()
        .unwrap();

    let mut wider = net(1);
    wider.arch.widths[1] = 8;
    let before = leaves(&wider);
    let err = Checkpoint::from_bytes(&bytes)
        .unwrap()
        .restore_into(&mut wider)
        .unwrap_err();
    match &err {
        Error::CheckpointGraphConst { fields, .. } => {
            let names: Vec<_> = fields.iter().map(|f| f.field.as_str()).collect();
            assert_eq!(names, ["arch"]);
            assert!(fields[0].stored.is_some() && fields[0].current.is_some());
        }
        other => panic!("expected CheckpointGraphConst, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("`arch`") && !text.contains("`classes`"),
        "{text}"
    );
    assert_eq!(leaves(&wider), before, "a refused restore writes nothing");

    let mut both = net(1);
    both.arch.eps = 1e-6;
    both.classes = 3;
    let err = Checkpoint::from_bytes(&bytes)
        .unwrap()
        .check(&both)
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("`arch`") && text.contains("`classes`"),
        "{text}"
    );

    // Another experiment type is refused before anything else.
    let mut other = Other {
        classes: 2,
        lr: Array::scalar(0.1f64),
    };
    assert!(matches!(
        Checkpoint::from_bytes(&bytes)
            .unwrap()
            .restore_into(&mut other),
        Err(Error::CheckpointExperiment { .. })
    ));
}

#[test]
fn refusal_names_device_leaves_that_changed() {
    let bytes = Checkpoint::capture(&net(1), &[], 3)
        .unwrap()
        .to_bytes()
        .unwrap();
    let refuse = |n: &mut Net| -> String {
        match Checkpoint::from_bytes(&bytes).unwrap().restore_into(n) {
            Err(e @ Error::CheckpointDevice { .. }) => e.to_string(),
            other => panic!("expected CheckpointDevice, got {other:?}"),
        }
    };

    let mut n = net(1);
    n.layers[1].w = Array::zeros(DType::F32, &[4, 3]);
    let text = refuse(&mut n);
    assert!(text.contains("layers[1].w f32[4,2] → f32[4,3]"), "{text}");

    let mut n = net(1);
    n.lr = Array::scalar(0.1f32);
    let text = refuse(&mut n);
    assert!(text.contains("lr f64[] → f32[]"), "{text}");

    let mut n = net(1);
    n.layers[0].gate = None;
    let text = refuse(&mut n);
    assert!(text.contains("layers[0].gate"), "{text}");

    let mut n = net(1);
    n.layers.pop();
    let text = refuse(&mut n);
    assert!(text.contains("removed layers[1].w"), "{text}");
}

#[test]
fn truncated_and_corrupt_bytes_are_typed_errors() {
    let (m, _) = opt_state();
    let mut small = net(1);
    small.layers.truncate(1);
    let bytes = Checkpoint::capture(&small, &[("m", &m)], 3)
        .unwrap()
        .to_bytes()
        .unwrap();
    assert!(Checkpoint::from_bytes(&bytes).is_ok());
    let corrupt = |b: &[u8], what: &str| match Checkpoint::from_bytes(b) {
        Err(Error::CheckpointCorrupt { .. }) => {}
        other => panic!("{what}: expected CheckpointCorrupt, got {other:?}"),
    };
    for len in 0..bytes.len() {
        corrupt(&bytes[..len], &format!("truncated to {len}"));
    }
    for i in 0..bytes.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[i] ^= flip;
            corrupt(&b, &format!("byte {i} ^ {flip:#x}"));
        }
    }
    let mut longer = bytes.clone();
    longer.push(0);
    corrupt(&longer, "one byte appended");
    corrupt(b"not a checkpoint at all", "text");
}

#[test]
fn files_from_other_tools_are_refused_by_name() {
    // A valid safetensors file without nitro's metadata.
    let data = vec![0u8; 8];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &data).unwrap();
    let bytes = safetensors::serialize([("w", view)], None).unwrap();
    let err = Checkpoint::from_bytes(&bytes).unwrap_err();
    assert!(matches!(err, Error::CheckpointCorrupt { .. }));
    assert!(err.to_string().contains("nitro.format"), "{err}");
}

#[test]
fn load_errors_name_the_file() {
    let dir = TempDir::new("load");
    let missing = dir.0.join("missing.safetensors");
    let err = Checkpoint::load(&missing).unwrap_err();
    assert!(matches!(err, Error::CheckpointIo { .. }));
    assert!(err.to_string().contains("missing.safetensors"), "{err}");

    let path = dir.0.join("half.safetensors");
    let bytes = Checkpoint::capture(&net(1), &[], 3)
        .unwrap()
        .to_bytes()
        .unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = Checkpoint::load(&path).unwrap_err();
    assert!(matches!(err, Error::CheckpointCorrupt { .. }));
    assert!(err.to_string().contains("half.safetensors"), "{err}");
}

#[test]
fn atomic_save_replaces_whole_files_and_leaves_nothing_on_failure() {
    let dir = TempDir::new("atomic");
    let ckpt = Checkpoint::capture(&net(1), &[], 3).unwrap();

    let nowhere = dir.0.join("no-such-dir").join("c.safetensors");
    assert!(matches!(
        ckpt.save(&nowhere),
        Err(Error::CheckpointIo { .. })
    ));
    assert!(!dir.0.join("no-such-dir").exists());

    let path = dir.0.join("c.safetensors");
    ckpt.save(&path).unwrap();
    let later = Checkpoint::capture(&net(2), &[], 4).unwrap();
    later.save(&path).unwrap();
    assert_eq!(Checkpoint::load(&path).unwrap().step(), 4);
    let names: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["c.safetensors"], "no temporary file is left behind");

    // A directory where the file should go: an error, and the directory is untouched.
    let blocked = dir.0.join("blocked");
    std::fs::create_dir(&blocked).unwrap();
    std::fs::write(blocked.join("keep"), b"x").unwrap();
    assert!(matches!(
        ckpt.save(&blocked),
        Err(Error::CheckpointIo { .. })
    ));
    assert!(blocked.join("keep").exists());
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 2);

    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}

#[test]
fn optimizer_names_must_be_unique_and_non_empty() {
    let a = Array::scalar(1.0f32);
    assert!(matches!(
        Checkpoint::capture(&net(1), &[("m", &a), ("m", &a)], 0),
        Err(Error::CheckpointInput { .. })
    ));
    assert!(matches!(
        Checkpoint::capture(&net(1), &[("", &a)], 0),
        Err(Error::CheckpointInput { .. })
    ));
}
