//! Checkpoint directories under hostile input (issue 50, items 1–3 and 6): indexes crafted with
//! their checksum recomputed — as a broken writer or an attacker would — whose pieces repeat,
//! overlap or leave a gap, whose dims overflow or outgrow the bytes that exist; saves into
//! directories that hold a user's own files; and checkpoint paths reached through a symbolic
//! link. Each is refused by name, or works, never silently wrong, never an abort.
#![allow(missing_docs)]

mod common;

#[path = "common/mlp.rs"]
mod mlp;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{own_cache, TempDir};
use mlp::*;
use nitro::backend;
use nitro::checkpoint::{Checkpoint, CheckpointDir, Saved, CURRENT, INDEX};
use nitro::optim::Adam;
use nitro::train::{Config, Nitro};
use nitro::{Error, LeafType};

/// The index as a writer serializes it (field order matters to its checksum).
#[derive(serde::Serialize, serde::Deserialize, Clone)]
struct Index {
    format: String,
    version: u32,
    parts: Vec<String>,
    metadata: BTreeMap<String, String>,
    tensors: Vec<Tensor>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    checksum: Option<String>,
}

#[derive(serde::Serialize, serde::Deserialize, Clone)]
struct Tensor {
    name: String,
    #[serde(rename = "type")]
    ty: LeafType,
    pieces: Vec<Piece>,
}

#[derive(serde::Serialize, serde::Deserialize, Clone)]
struct Piece {
    part: usize,
    start: Vec<usize>,
    dims: Vec<usize>,
    blake3: String,
}

/// The committed version of the checkpoint directory `root`.
fn version(root: &Path) -> PathBuf {
    let name = std::fs::read_to_string(root.join(CURRENT)).unwrap();
    root.join(name.trim_end())
}

fn read_index(root: &Path) -> Index {
    serde_json::from_slice(&std::fs::read(version(root).join(INDEX)).unwrap()).unwrap()
}

/// Writes `index` with its checksum recomputed, so only the checks of its contents can refuse it.
fn reseal(root: &Path, mut index: Index) {
    index.checksum = None;
    let digest = blake3::hash(&serde_json::to_vec(&index).unwrap())
        .to_hex()
        .to_string();
    index.checksum = Some(digest);
    std::fs::write(
        version(root).join(INDEX),
        serde_json::to_vec_pretty(&index).unwrap(),
    )
    .unwrap();
}

/// Writes a part file holding one piece `name` of `values` (f32, `dims`); returns its blake3.
fn write_part(root: &Path, part: &str, name: &str, dims: &[usize], values: &[f32]) -> String {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, dims.to_vec(), &bytes)
        .unwrap();
    let file = safetensors::tensor::serialize([(name, view)], None).unwrap();
    std::fs::write(version(root).join(part), file).unwrap();
    blake3::hash(&bytes).to_hex().to_string()
}

/// A checkpoint of the classifier at step 7, saved as a directory under `dir`.
fn saved(dir: &TempDir, name: &str) -> (PathBuf, Checkpoint) {
    std::fs::create_dir_all(dir.path()).unwrap();
    let checkpoint = Checkpoint::capture(&mlp(Act::Relu), &[], 7).unwrap();
    let root = dir.path().join(name);
    checkpoint.save_dir(&root).unwrap();
    (root, checkpoint)
}

/// Every way to read a directory refuses it as corrupt, with a message holding `words`.
fn refused_everywhere(root: &Path, words: &[&str]) {
    let errors = [
        CheckpointDir::open(root).map(drop).unwrap_err(),
        Checkpoint::load(root).map(drop).unwrap_err(),
        Saved::open(root).map(drop).unwrap_err(),
    ];
    for err in errors {
        let text = err.to_string();
        assert!(matches!(err, Error::CheckpointCorrupt { .. }), "{text}");
        for w in words {
            assert!(text.contains(w), "`{w}` missing from: {text}");
        }
    }
}

const W: &str = "layers[0].w";

#[test]
fn pieces_must_tile_their_tensor_exactly_once() {
    let dir = TempDir::new("ckpt-hostile-tiling");
    let (root, checkpoint) = saved(&dir, "run");
    let (_, w) = checkpoint.device().iter().find(|(n, _)| n == W).unwrap();
    let whole = w.as_slice::<f32>().unwrap().to_vec();
    // `layers[0].w` ([4, 16]) as two pieces of two rows, each in a part of its own.
    let top = write_part(&root, "part-00001.safetensors", W, &[2, 16], &whole[..32]);
    let bottom = write_part(&root, "part-00002.safetensors", W, &[2, 16], &whole[32..]);
    let honest = {
        let mut index = read_index(&root);
        index.parts.push("part-00001.safetensors".into());
        index.parts.push("part-00002.safetensors".into());
        let t = index.tensors.iter_mut().find(|t| t.name == W).unwrap();
        t.pieces = vec![
            Piece {
                part: 1,
                start: vec![0, 0],
                dims: vec![2, 16],
                blake3: top.clone(),
            },
            Piece {
                part: 2,
                start: vec![2, 0],
                dims: vec![2, 16],
                blake3: bottom,
            },
        ];
        index
    };
    // The honest split reads back whole.
    reseal(&root, honest.clone());
    assert_eq!(Checkpoint::load(&root).unwrap(), checkpoint);

    let with_pieces = |pieces: Vec<Piece>| {
        let mut index = honest.clone();
        index
            .tensors
            .iter_mut()
            .find(|t| t.name == W)
            .unwrap()
            .pieces = pieces;
        index
    };
    let top_piece = |start: usize| Piece {
        part: 1,
        start: vec![start, 0],
        dims: vec![2, 16],
        blake3: top.clone(),
    };
    // The top piece listed twice and the bottom never: the element count adds up, and before
    // the fix the bottom rows read back as zeros.
    reseal(&root, with_pieces(vec![top_piece(0), top_piece(0)]));
    refused_everywhere(&root, &["`layers[0].w`", "overlap"]);
    // Overlapping by one row (rows 0..2 and 1..3), leaving row 3 in no piece.
    reseal(&root, with_pieces(vec![top_piece(0), top_piece(1)]));
    refused_everywhere(&root, &["`layers[0].w`", "overlap"]);
    // A gap: the top piece alone.
    reseal(&root, with_pieces(vec![top_piece(0)]));
    refused_everywhere(&root, &["`layers[0].w`", "32 of its 64 elements"]);
}

#[test]
fn an_index_whose_dims_overflow_or_outgrow_the_files_is_an_error_not_an_abort() {
    let dir = TempDir::new("ckpt-hostile-dims");
    let (root, _) = saved(&dir, "run");
    let pristine = read_index(&root);
    let retyped = |dims: Vec<usize>, piece: Option<Vec<usize>>| {
        let mut index = pristine.clone();
        let t = index.tensors.iter_mut().find(|t| t.name == W).unwrap();
        t.ty.dims = dims;
        if let Some(p) = piece {
            t.pieces[0].dims = p;
        }
        index
    };
    // 2^36 rows with the real piece unchanged: before, a 4 TiB allocation aborted the process.
    reseal(&root, retyped(vec![1 << 36, 16], None));
    refused_everywhere(&root, &["`layers[0].w`", "64 of its"]);
    // Dims whose product wraps a usize to 0: before, a panic in a slice copy.
    reseal(&root, retyped(vec![1 << 32, 1 << 32], None));
    refused_everywhere(&root, &["`layers[0].w`", "largest tensor"]);
    // A piece that tiles its tensor but claims far more bytes than its part file holds.
    reseal(&root, retyped(vec![1 << 28, 16], Some(vec![1 << 28, 16])));
    refused_everywhere(&root, &["`layers[0].w`", "than the file holds"]);
    // The pristine index still opens.
    reseal(&root, pristine);
    assert!(Checkpoint::load(&root).is_ok());
}

#[test]
fn a_save_removes_only_the_versions_it_wrote_and_never_writes_among_a_users_files() {
    let dir = TempDir::new("ckpt-hostile-sweep");
    let (root, checkpoint) = saved(&dir, "run");
    // A user's own entries beside nitro's versions, named like them.
    for own in ["step-100", "step-best", "step-000000000001.1.1"] {
        std::fs::create_dir_all(root.join(own)).unwrap();
        std::fs::write(root.join(own).join("notes.txt"), "mine").unwrap();
    }
    std::fs::write(root.join("step-notes.txt"), "mine").unwrap();
    let first = version(&root);
    checkpoint.save_dir(&root).unwrap();
    assert_ne!(version(&root), first);
    assert!(!first.exists(), "the version the first save wrote is swept");
    for own in ["step-100", "step-best", "step-000000000001.1.1"] {
        assert_eq!(
            std::fs::read_to_string(root.join(own).join("notes.txt")).unwrap(),
            "mine",
            "{own}"
        );
    }
    assert!(root.join("step-notes.txt").exists());
    assert_eq!(Checkpoint::load(&root).unwrap(), checkpoint);

    // A training handle's save sweeps the same way.
    let mut run = Nitro::with_backend(
        mlp(Act::Relu),
        Adam::default(),
        Config::new().batch(8).progress(false),
        backend::interpreter(),
        own_cache(),
    )
    .unwrap();
    let before = version(&root);
    run.save(&root).unwrap();
    assert!(!before.exists());
    assert!(root.join("step-best").join("notes.txt").exists());

    // A non-empty directory without `CURRENT` is not a checkpoint: refused, naming what is
    // there, and left as it was.
    let theirs = dir.path().join("theirs");
    std::fs::create_dir_all(theirs.join("step-100")).unwrap();
    std::fs::write(theirs.join("notes.txt"), "mine").unwrap();
    for err in [
        checkpoint.save_dir(&theirs).unwrap_err(),
        run.save(&theirs).unwrap_err(),
    ] {
        let text = err.to_string();
        assert!(matches!(err, Error::CheckpointInput { .. }), "{text}");
        assert!(
            text.contains("`notes.txt`") && text.contains("`step-100`") && text.contains(CURRENT),
            "{text}"
        );
    }
    let mut left: Vec<String> = std::fs::read_dir(&theirs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["notes.txt", "step-100"]);
    // An empty directory is fine.
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    checkpoint.save_dir(&empty).unwrap();
    assert_eq!(Checkpoint::load(&empty).unwrap(), checkpoint);
}

#[cfg(unix)]
#[test]
fn a_checkpoint_directory_through_a_symbolic_link_works_everywhere() {
    let dir = TempDir::new("ckpt-hostile-link");
    let (root, checkpoint) = saved(&dir, "run");
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&root, &link).unwrap();
    // Every reader follows the link to the directory.
    assert_eq!(CheckpointDir::open(&link).unwrap().step(), 7);
    assert_eq!(Checkpoint::load(&link).unwrap(), checkpoint);
    assert!(matches!(Saved::open(&link).unwrap(), Saved::Directory(_)));
    let config = || Config::new().batch(8).progress(false);
    let handle = |saved: Option<Saved>| match saved {
        None => Nitro::with_backend(
            mlp(Act::Relu),
            Adam::default(),
            config(),
            backend::interpreter(),
            own_cache(),
        ),
        Some(saved) => Nitro::resume_with(
            mlp(Act::Relu),
            Adam::default(),
            config(),
            saved,
            backend::interpreter(),
            own_cache(),
        ),
    };
    // A handle's checkpoint, resumed through the link.
    let (x, y) = data(8, 3);
    let mut run = handle(None).unwrap();
    run.step(&batch(&x, &y, 0, 8, 8), 8).unwrap();
    run.save(&root).unwrap();
    let mut run = handle(Some(Saved::open(&link).unwrap())).unwrap();
    assert_eq!(run.steps(), 1);
    // And so do both writers: the new version lands in the directory the link names.
    let before = version(&root);
    run.save(&link).unwrap();
    assert!(!before.exists());
    assert_eq!(CheckpointDir::open(&root).unwrap().step(), 1);
    checkpoint.save_dir(&link).unwrap();
    assert_eq!(Checkpoint::load(&root).unwrap(), checkpoint);
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());

    // Inside the directory nothing is followed: a version that is a link out of it is refused.
    let outside = dir.path().join("outside");
    std::fs::rename(version(&root), &outside).unwrap();
    let name = std::fs::read_to_string(root.join(CURRENT)).unwrap();
    std::os::unix::fs::symlink(&outside, root.join(name.trim_end())).unwrap();
    let err = CheckpointDir::open(&link).unwrap_err();
    assert!(
        matches!(err, Error::CheckpointCorrupt { .. }) && err.to_string().contains("link"),
        "{err}"
    );
    // So is a `CURRENT`, an index or a part that is a link.
    let name = name.trim_end();
    std::fs::remove_file(root.join(name)).unwrap();
    std::fs::rename(&outside, root.join(name)).unwrap();
    assert!(CheckpointDir::open(&root).is_ok());
    for entry in [
        PathBuf::from(CURRENT),
        Path::new(name).join(INDEX),
        Path::new(name).join("part-00000.safetensors"),
    ] {
        let real = root.join(&entry);
        let moved = dir.path().join("moved");
        std::fs::rename(&real, &moved).unwrap();
        std::os::unix::fs::symlink(&moved, &real).unwrap();
        let err = Checkpoint::load(&root).unwrap_err();
        assert!(
            matches!(err, Error::CheckpointCorrupt { .. }) && err.to_string().contains("link"),
            "{}: {err}",
            entry.display()
        );
        std::fs::remove_file(&real).unwrap();
        std::fs::rename(&moved, &real).unwrap();
    }
    assert!(Checkpoint::load(&root).is_ok());
}
