//! Checkpoint directories (issue 42, item 2): a handle saves each device's shards as a part of
//! their own and resumes on any mesh reading only each device's ranges (4 → 2 → 1 devices,
//! one → replicated → tensor-parallel) to the uninterrupted run's losses and values; a flipped
//! byte, an altered index or a `CURRENT` naming nothing is refused by name; a process killed
//! mid-save leaves the previous version whole and loadable; the single-file format stays
//! readable beside it.
#![allow(missing_docs)]

mod common;

#[path = "common/mlp.rs"]
mod mlp;

use std::path::Path;

use common::{backend_of, fsdp, own_cache, xla_devices_or_skip, TempDir};
use mlp::*;
use nitro::backend;
use nitro::checkpoint::{Checkpoint, CheckpointDir, Format, Saved, CURRENT, INDEX};
use nitro::optim::Adam;
use nitro::prelude::*;
use nitro::shard::{Mesh, PartitionSpec, Sharding};
use nitro::train::{Config, Nitro};

/// The micro-batches every run takes: four full batches of 8 rows and a ragged one of 5.
const STEPS: [(usize, usize); 5] = [(0, 8), (8, 8), (16, 8), (24, 8), (32, 5)];

fn assert_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (p, q) in a.iter().zip(b) {
        assert!((p - q).abs() <= tol * (1.0 + p.abs()), "{what}: {p} vs {q}");
    }
}

fn flat(leaves: &[Vec<f32>]) -> Vec<f64> {
    leaves.iter().flatten().map(|&v| f64::from(v)).collect()
}

/// The parts and pieces an index lists: `(tensor, part, piece dims)`.
fn pieces(version: &Path) -> Vec<(String, usize, Vec<usize>)> {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(version.join(INDEX)).unwrap()).unwrap();
    let mut out = Vec::new();
    for t in index["tensors"].as_array().unwrap() {
        for p in t["pieces"].as_array().unwrap() {
            let dims = p["dims"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            out.push((
                t["name"].as_str().unwrap().to_owned(),
                p["part"].as_u64().unwrap() as usize,
                dims,
            ));
        }
    }
    out
}

fn versions(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    v.sort();
    v
}

/// Flips one byte of `file`, `from_end` bytes before its end.
fn flip(file: &Path, from_end: usize) {
    let mut bytes = std::fs::read(file).unwrap();
    let at = bytes.len() - from_end;
    bytes[at] ^= 0x40;
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn a_checkpoint_directory_holds_what_the_file_holds_and_refuses_corruption_by_name() {
    let dir = TempDir::new("ckpt-dir");
    std::fs::create_dir_all(dir.path()).unwrap();
    let model = mlp(Act::Relu);
    let m = Array::full(&[4, 16], 0.25f32);
    let checkpoint = Checkpoint::capture(&model, &[("m/layers[0].w", &m)], 7)
        .unwrap()
        .with_position(1, 3);
    let root = dir.path().join("run");
    assert_eq!(Format::for_path(&root), Format::Directory);
    assert_eq!(
        Format::for_path(&dir.path().join("run.safetensors")),
        Format::File
    );
    checkpoint.save_dir(&root).unwrap();
    // The directory reads back as the same checkpoint, and so does the single file.
    assert_eq!(Checkpoint::load(&root).unwrap(), checkpoint);
    let file = dir.path().join("run.safetensors");
    checkpoint.save(&file).unwrap();
    assert_eq!(Checkpoint::load(&file).unwrap(), checkpoint);
    assert!(matches!(Saved::open(&root).unwrap(), Saved::Directory(_)));
    assert!(matches!(Saved::open(&file).unwrap(), Saved::Whole(_)));
    // Ranges read only what they ask for.
    let opened = CheckpointDir::open(&root).unwrap();
    assert_eq!(opened.step(), 7);
    let rows = opened.read("layers[0].w", &[(1, 2), (4, 3)]).unwrap();
    let whole = model.layers[0].w.as_slice::<f32>().unwrap();
    let want: Vec<f32> = (1..3)
        .flat_map(|r| (4..7).map(move |c| whole[r * 16 + c]))
        .collect();
    assert_eq!(rows.as_slice::<f32>().unwrap(), &want[..]);
    let outside = opened.read("layers[0].w", &[(3, 2), (0, 16)]).unwrap_err();
    assert!(outside.to_string().contains("outside"), "{outside}");

    // A second save replaces the version atomically and removes the first.
    let first = versions(&root);
    assert_eq!(first.len(), 1);
    checkpoint.save_dir(&root).unwrap();
    let second = versions(&root);
    assert_eq!(second.len(), 1);
    assert_ne!(first, second);

    // A flipped byte in a part is refused, naming the part and the tensor.
    let version = root.join(&second[0]);
    let part = version.join("part-00000.safetensors");
    let pristine = std::fs::read(&part).unwrap();
    flip(&part, 1);
    let err = Checkpoint::load(&root).unwrap_err();
    assert!(
        matches!(err, nitro::Error::CheckpointCorrupt { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("part-00000"), "{err}");
    assert!(err.to_string().contains("checksum"), "{err}");
    std::fs::write(&part, pristine).unwrap();
    assert_eq!(Checkpoint::load(&root).unwrap(), checkpoint);

    // An altered index (another step) is refused by its checksum.
    let index = version.join(INDEX);
    let text = std::fs::read_to_string(&index).unwrap();
    std::fs::write(
        &index,
        text.replace("\"nitro.step\": \"7\"", "\"nitro.step\": \"8\""),
    )
    .unwrap();
    let err = CheckpointDir::open(&root).unwrap_err();
    assert!(err.to_string().contains("index"), "{err}");
    std::fs::write(&index, text).unwrap();

    // `CURRENT` naming no version, or a path outside the directory, is refused.
    std::fs::write(root.join(CURRENT), "../elsewhere\n").unwrap();
    let err = CheckpointDir::open(&root).unwrap_err();
    assert!(err.to_string().contains("names no version"), "{err}");
    std::fs::write(root.join(CURRENT), "step-000000000001.1.1\n").unwrap();
    assert!(matches!(
        CheckpointDir::open(&root).unwrap_err(),
        nitro::Error::CheckpointIo { .. }
    ));
    // A file where the directory should be is refused, not replaced.
    let err = checkpoint.save_dir(&file).unwrap_err();
    assert!(err.to_string().contains("not a directory"), "{err}");
    assert_eq!(Checkpoint::load(&file).unwrap(), checkpoint);
}

/// On the interpreter (one device, packed leaves): a directory saved mid-run — at once, and in
/// the background — resumes to the uninterrupted run's losses and leaves exactly.
#[test]
fn a_handle_saved_to_a_directory_resumes_exactly() {
    let dir = TempDir::new("ckpt-dir-handle");
    std::fs::create_dir_all(dir.path()).unwrap();
    let (x, y) = data(40, 21);
    let config = || Config::new().batch(8).lr(0.02).progress(false);
    let interp = backend::interpreter();
    let start = || {
        Nitro::with_backend(
            mlp(Act::Tanh),
            Adam::default(),
            config(),
            interp,
            own_cache(),
        )
        .unwrap()
    };
    let step = |run: &mut Nitro<Mlp, Adam>, i: usize| {
        let (s, real) = STEPS[i];
        run.step(&batch(&x, &y, s, real, 8), real).unwrap().loss
    };
    let mut whole = start();
    let base: Vec<f64> = (0..5).map(|i| step(&mut whole, i)).collect();
    let base_leaves = leaves(&whole.into_experiment().unwrap());

    let mut run = start();
    let mut losses: Vec<f64> = (0..2).map(|i| step(&mut run, i)).collect();
    let now = dir.path().join("now");
    let report = run.save(&now).unwrap();
    assert_eq!((report.step, report.path.as_path()), (2, now.as_path()));
    assert!(report.bytes > 0);
    losses.push(step(&mut run, 2));
    let later = dir.path().join("later");
    run.save_in_background(&later).unwrap();
    losses.push(step(&mut run, 3));
    let report = run.wait_saved().unwrap().expect("a save in flight");
    assert_eq!(report.step, 3);
    drop(run);

    // From the directory saved at once: steps 3..5 again.
    let mut resumed = Nitro::resume_with(
        mlp(Act::Tanh),
        Adam::default(),
        config(),
        Saved::open(&now).unwrap(),
        interp,
        own_cache(),
    )
    .unwrap();
    assert_eq!(resumed.steps(), 2);
    let again: Vec<f64> = (2..4).map(|i| step(&mut resumed, i)).collect();
    assert_eq!(again, losses[2..4].to_vec());
    // From the background one (step 3's state, whatever ran after it): the last two steps, to
    // the uninterrupted run's losses and leaves.
    let mut resumed = Nitro::resume_with(
        mlp(Act::Tanh),
        Adam::default(),
        config(),
        CheckpointDir::open(&later).unwrap(),
        interp,
        own_cache(),
    )
    .unwrap();
    assert_eq!(resumed.steps(), 3);
    losses.truncate(3);
    losses.extend((3..5).map(|i| step(&mut resumed, i)));
    assert_eq!(losses, base);
    assert_eq!(leaves(&resumed.into_experiment().unwrap()), base_leaves);
}

const CHILD: &str = "NITRO_TEST_CKPT_DIR_CHILD";

#[derive(Tree, Clone, Debug)]
struct Rows {
    x: Array,
}

#[experiment]
struct Big {
    #[device(trainable)]
    w: Array,
}

impl nitro::train::Model for Big {
    type Batch = Rows;

    fn loss(v: &BigView<'_>, b: &RowsMirror<Tensor>) -> Tensor {
        b.x.sum(&[1]) * (v.w * v.w).mean(&[0])
    }
}

/// Saves step 1 into the directory, then dies while the background save of step 2 is being
/// written.
fn child(root: &Path) -> ! {
    let mut run = Nitro::with_backend(
        Big {
            w: Array::full(&[1 << 21], 0.5f32),
        },
        Adam::default(),
        Config::new().batch(2).lr(0.01).progress(false),
        backend::interpreter(),
        own_cache(),
    )
    .unwrap();
    let rows = Rows {
        x: Array::full(&[2, 1], 1.0f32),
    };
    run.step(&rows, 2).unwrap();
    run.save(root).unwrap();
    run.step(&rows, 2).unwrap();
    run.save_in_background(root).unwrap();
    run.step(&rows, 2).unwrap();
    for _ in 0..20_000 {
        if versions(root).iter().any(|v| v.contains(".tmp.")) {
            std::process::abort();
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
    std::process::abort();
}

#[test]
fn a_process_killed_mid_save_leaves_the_previous_version_whole() {
    if let Ok(path) = std::env::var(CHILD) {
        child(Path::new(&path));
    }
    let dir = TempDir::new("ckpt-dir-kill");
    std::fs::create_dir_all(dir.path()).unwrap();
    let root = dir.path().join("run");
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "a_process_killed_mid_save_leaves_the_previous_version_whole",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, &root)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "the child aborts");
    let left = versions(&root);
    let loaded = Checkpoint::load(&root).expect("a whole checkpoint in the directory");
    match left.iter().filter(|v| v.contains(".tmp.")).count() {
        1 => assert_eq!(
            loaded.step(),
            1,
            "killed while writing: the previous version"
        ),
        0 => assert_eq!(
            loaded.step(),
            2,
            "committed before the abort: the new version"
        ),
        n => panic!("{n} versions being written"),
    }
    assert_eq!(loaded.device()[0].1.dims(), &[1 << 21]);
    // The next save removes what the killed one left, and the version it replaces.
    loaded.save_dir(&root).unwrap();
    let after = versions(&root);
    assert_eq!(after.len(), 1, "{after:?}");
    assert!(!after[0].contains(".tmp."));
}

/// On 4 XLA devices: directories saved on one layout resume on another — FSDP on 4, on 2, one
/// device; one device, replicated on 4, tensor-parallel on 2 × 2 — to the one-device run's
/// losses and leaves, and under FSDP each part holds its device's quarter of a split leaf.
#[test]
fn checkpoint_directories_resume_across_meshes_reading_each_devices_ranges() {
    let test = "checkpoint_directories_resume_across_meshes_reading_each_devices_ranges";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    xla_devices_or_skip(test, 4).expect("4 devices");
    let dir = TempDir::new("ckpt-dir-mesh");
    std::fs::create_dir_all(dir.path()).unwrap();
    let (x, y) = data(40, 21);
    let step = |run: &mut Nitro<Mlp, Adam>, i: usize| {
        let (start, real) = STEPS[i];
        run.step(&batch(&x, &y, start, real, 8), real).unwrap().loss
    };
    let base = {
        let config = Config::new().batch(8).lr(0.02).progress(false);
        let mut run =
            Nitro::with_backend(mlp(Act::Tanh), Adam::default(), config, one, own_cache()).unwrap();
        let losses: Vec<f64> = (0..5).map(|i| step(&mut run, i)).collect();
        (losses, leaves(&run.into_experiment().unwrap()))
    };
    let chain = |name: &str, legs: &[(Config, std::ops::Range<usize>)]| {
        let root = dir.path().join(name);
        let mut losses = Vec::new();
        let mut last = None;
        for (i, (config, steps)) in legs.iter().enumerate() {
            let config = config.clone().batch(8).lr(0.02).progress(false);
            let backend = backend_of(&config, one);
            let mut run = match i {
                0 => Nitro::with_backend(
                    mlp(Act::Tanh),
                    Adam::default(),
                    config,
                    backend,
                    own_cache(),
                )
                .unwrap(),
                _ => Nitro::resume_with(
                    mlp(Act::Tanh),
                    Adam::default(),
                    config,
                    Saved::open(&root).unwrap(),
                    backend,
                    own_cache(),
                )
                .unwrap(),
            };
            losses.extend(steps.clone().map(|i| step(&mut run, i)));
            run.save(&root).unwrap();
            last = Some(run);
        }
        let run = last.expect("a leg");
        let taken = losses.len();
        assert_eq!(run.steps(), taken as u64);
        assert_close(&base.0[..taken], &losses, 1e-5, &format!("losses: {name}"));
        if taken == STEPS.len() {
            let trained = leaves(&run.into_experiment().unwrap());
            assert_close(
                &flat(&base.1),
                &flat(&trained),
                1e-5,
                &format!("leaves: {name}"),
            );
        }
        root
    };
    let megatron = Config::new()
        .mesh(Mesh::new([("data", 2), ("model", 2)]).unwrap())
        .sharding(
            Sharding::fsdp("data")
                .leaf("layers[0].w", PartitionSpec::new([None, Some("model")]))
                .leaf("layers[0].b", PartitionSpec::new([Some("model")]))
                .leaf("layers[1].w", PartitionSpec::new([Some("model"), None])),
        );
    let replicated = Config::new().mesh(Mesh::new([("data", 4)]).unwrap());
    // Saved on 4 devices under FSDP first: each part its device's quarter.
    let root = chain("fsdp", &[(fsdp(4), 0..2)]);
    let opened = CheckpointDir::open(&root).unwrap();
    let listed = pieces(opened.version());
    let parts: std::collections::BTreeSet<usize> = listed.iter().map(|p| p.1).collect();
    assert_eq!(parts.len(), 4, "{listed:?}");
    let w0: Vec<&(String, usize, Vec<usize>)> =
        listed.iter().filter(|p| p.0 == "layers[0].w").collect();
    assert_eq!(w0.len(), 4, "{w0:?}");
    for p in &w0 {
        assert_eq!(
            p.2.iter().product::<usize>(),
            16,
            "a quarter of 4 × 16: {p:?}"
        );
    }
    let m0 = listed.iter().filter(|p| p.0 == "opt/m/layers[0].w").count();
    assert_eq!(m0, 4, "the optimizer state is saved shard by shard too");
    // A window of device 0 reads part 0 alone: a flipped byte in part 3 does not reach it,
    // while reading every tensor whole does.
    let part3 = opened.version().join("part-00003.safetensors");
    let pristine = std::fs::read(&part3).unwrap();
    flip(&part3, 1);
    for (name, _) in opened.tensors() {
        let piece = listed
            .iter()
            .find(|p| p.0 == name && p.1 == 0)
            .expect("device 0 holds a piece of every tensor");
        let window: Vec<(usize, usize)> = piece.2.iter().map(|&d| (0, d)).collect();
        opened.read(name, &window).unwrap();
    }
    let bad: Vec<String> = opened
        .tensors()
        .filter_map(|(name, _)| opened.read_whole(name).err().map(|e| e.to_string()))
        .collect();
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].contains("part-00003"), "{bad:?}");
    std::fs::write(&part3, pristine).unwrap();

    chain(
        "fsdp 4, 2, one device",
        &[(fsdp(4), 0..2), (fsdp(2), 2..4), (Config::new(), 4..5)],
    );
    chain(
        "one device, replicated 4, tensor-parallel 2 x 2",
        &[(Config::new(), 0..1), (replicated, 1..3), (megatron, 3..5)],
    );
}

/// On 4 XLA devices under FSDP: a background save to a directory, and one taken inside an
/// accumulation window, resume on 2 devices to the uninterrupted run's losses.
#[test]
fn background_and_mid_window_directory_saves_resume_on_another_mesh() {
    let test = "background_and_mid_window_directory_saves_resume_on_another_mesh";
    let Some(_) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let dir = TempDir::new("ckpt-dir-bg");
    std::fs::create_dir_all(dir.path()).unwrap();
    let (x, y) = data(40, 21);
    let step = |run: &mut Nitro<Mlp, Adam>, i: usize| {
        let (start, real) = STEPS[i];
        run.step(&batch(&x, &y, start, real, 8), real).unwrap().loss
    };
    let config = |c: Config| c.batch(8).lr(0.02).progress(false).accumulate(2);
    let start = |c: Config| {
        let c = config(c);
        let backend = backend_of(&c, backend::interpreter());
        Nitro::with_backend(mlp(Act::Tanh), Adam::default(), c, backend, own_cache()).unwrap()
    };
    let resume = |c: Config, root: &Path| {
        let c = config(c);
        let backend = backend_of(&c, backend::interpreter());
        Nitro::resume_with(
            mlp(Act::Tanh),
            Adam::default(),
            c,
            Saved::open(root).unwrap(),
            backend,
            own_cache(),
        )
        .unwrap()
    };
    let mut whole = start(fsdp(4));
    let base: Vec<f64> = (0..5).map(|i| step(&mut whole, i)).collect();
    let base_leaves = leaves(&whole.into_experiment().unwrap());

    let mut run = start(fsdp(4));
    let mut losses: Vec<f64> = (0..2).map(|i| step(&mut run, i)).collect();
    let bg = dir.path().join("background");
    run.save_in_background(&bg).unwrap();
    losses.push(step(&mut run, 2));
    // Inside the window (one micro-batch of two): its sums are saved, shard by shard.
    let mid = dir.path().join("mid-window");
    run.save(&mid).unwrap();
    assert!(run.wait_saved().unwrap().is_some() || run.last_save().is_some());
    let listed = pieces(CheckpointDir::open(&mid).unwrap().version());
    assert_eq!(
        listed.iter().filter(|p| p.0 == "acc/layers[0].w").count(),
        4,
        "{listed:?}"
    );
    drop(run);

    let mut from_bg = resume(fsdp(2), &bg);
    let again: Vec<f64> = (2..5).map(|i| step(&mut from_bg, i)).collect();
    assert_close(&base[2..], &again, 1e-5, "from the background save");
    let mut from_mid = resume(fsdp(2), &mid);
    let rest: Vec<f64> = (3..5).map(|i| step(&mut from_mid, i)).collect();
    losses.extend(rest);
    assert_close(&base, &losses, 1e-5, "from the mid-window save");
    assert_close(
        &flat(&base_leaves),
        &flat(&leaves(&from_mid.into_experiment().unwrap())),
        1e-5,
        "leaves from the mid-window save",
    );
}
