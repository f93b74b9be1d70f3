//! Issue 30: the parts added last under hostile input — readers, data sets, buckets and the
//! planner, loops, half precision, imports, the compile key. Each case a typed error, promptly
//! and in bounded memory, or the right result; never an abort, a hang or a silently wrong
//! number. (Ops at trace time are in `op_checks.rs`, the chargpt flags in the examples' tests,
//! the stale-program case in `program_identity.rs`, manifests on the command line in the
//! CLI's tests.)
#![allow(missing_docs)]

mod common;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use common::TempDir;
use nitro::backend::{self, interp};
use nitro::cache::Cache;
use nitro::data::buckets::{plan_edges, Buckets, Ragged};
use nitro::data::{idx, text};
use nitro::optim::{Adam, AdamW};
use nitro::prelude::*;
use nitro::trace::nn;
use nitro::trace::{trace, Scan, Tensor};
use nitro::train::{Config, Model, Nitro, NonFinite};
use nitro::weights::{self, Import};
use nitro::{bf16, f16, Error, LeafType};

#[path = "common/mlp.rs"]
mod mlp;

// ---- running a case in a child process with a memory limit ------------------------------------

/// Whether this process is the limited child running `test`.
fn is_child(test: &str) -> bool {
    std::env::var("NITRO_TEST_LIMITED").as_deref() == Ok(test)
}

/// Runs test `test` of this binary again in a child process whose address space is limited to
/// `mib` MiB (`ulimit -v`), and asserts it passed: an allocation past the limit fails there as
/// it would on a machine without the memory, so "an error, never an abort" is tested without
/// needing that much memory — and without ever taking it, should the code be wrong.
fn passes_in_limited_child(test: &str, mib: u64) {
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {}; exec \"$0\" --exact {test} --nocapture --test-threads=1",
            mib * 1024
        ))
        .arg(&exe)
        .env("NITRO_TEST_LIMITED", test)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child ({:?}) failed:\n{stdout}\n{stderr}",
        out.status
    );
}

/// `f` on another thread, failing the test when it has not returned within a minute.
fn within_a_minute<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the call blocked")
}

fn mkfifo(path: &Path) {
    let made = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(made.success());
}

// ---- 1: every reader opens regular files only --------------------------------------------------

#[experiment]
struct One {
    #[device(trainable)]
    w: Array,
}

#[test]
fn every_reader_refuses_a_fifo_and_a_device_promptly() {
    let dir = TempDir::new("readers");
    std::fs::create_dir_all(dir.path()).unwrap();
    type Reader = fn(PathBuf) -> nitro::Result<()>;
    let readers: [(&str, Reader); 4] = [
        ("weights", |p| {
            let mut e = One {
                w: Array::zeros(DType::F32, &[2]),
            };
            weights::load_into(&mut e, p, &Import::new()).map(|_| ())
        }),
        ("npy", |p| nitro::npy::read(p).map(|_| ())),
        ("idx", |p| idx::read(p).map(|_| ())),
        ("manifest", |p| nitro::cache::Manifest::read(p).map(|_| ())),
    ];
    for (i, (what, read)) in readers.into_iter().enumerate() {
        let fifo = dir.path().join(format!("pipe{i}"));
        mkfifo(&fifo);
        for path in [fifo, PathBuf::from("/dev/zero")] {
            let shown = path.display().to_string();
            let err = within_a_minute(move || read(path)).unwrap_err();
            assert!(
                matches!(err, Error::DataFile { .. })
                    && err.to_string().contains("not a regular file"),
                "{what} of {shown}: {err}"
            );
        }
        let err = within_a_minute(move || read(PathBuf::from("/"))).unwrap_err();
        assert!(err.to_string().contains("a directory"), "{what}: {err}");
    }
}

#[test]
fn the_text_corpus_reader_skips_nothing_and_reads_no_fifo() {
    let dir = TempDir::new("fortune-dir");
    std::fs::create_dir_all(dir.path()).unwrap();
    std::fs::write(dir.path().join("a"), "one\n%\ntwo\n").unwrap();
    assert_eq!(
        text::fortune_records(Some(dir.path())).unwrap(),
        ["one\n", "two\n"]
    );
    // A FIFO among the files is not a regular file: skipped by the listing, never opened.
    mkfifo(&dir.path().join("b"));
    let d = dir.path().to_path_buf();
    let records = within_a_minute(move || text::fortune_records(Some(&d))).unwrap();
    assert_eq!(records, ["one\n", "two\n"]);
}

// ---- 2: gzip inflates within the header's bound, every member ---------------------------------

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    z.write_all(bytes).unwrap();
    z.finish().unwrap()
}

fn idx_header(kind: u8, dims: &[u32]) -> Vec<u8> {
    let mut h = vec![0, 0, kind, dims.len() as u8];
    for d in dims {
        h.extend(d.to_be_bytes());
    }
    h
}

#[test]
fn a_gzip_bomb_is_refused_after_its_header_and_multi_member_files_read_whole() {
    // 64 MiB of zeros behind a header of 4 bytes (the bomb compresses to ~64 KiB): refused,
    // never inflated past the header's 4 bytes + 1.
    let mut bomb = idx_header(0x08, &[4]);
    bomb.extend(std::iter::repeat_n(0u8, 64 << 20));
    let z = gzip(&bomb);
    assert!(z.len() < 1 << 20);
    drop(bomb);
    let err = idx::from_bytes(&z).unwrap_err();
    assert!(
        err.to_string()
            .contains("need 4 bytes of data, but it holds 5"),
        "{err}"
    );
    // A header claiming more than the limit is refused before inflating the data.
    let huge = gzip(&idx_header(0x0E, &[1 << 31, 1 << 29]));
    let err = idx::from_bytes(&huge).unwrap_err();
    assert!(err.to_string().contains("over nitro's size limit"), "{err}");
    // Truncated inside the header.
    let err = idx::from_bytes(&gzip(&[0, 0, 8])).unwrap_err();
    assert!(err.to_string().contains("truncated"), "{err}");

    // Two members (`cat a.gz b.gz`, as bgzip writes): one file.
    let mut whole = idx_header(0x08, &[2, 3]);
    whole.extend([1, 2, 3, 4, 5, 6]);
    let (a, b) = whole.split_at(7);
    let mut two = gzip(a);
    two.extend(gzip(b));
    let array = idx::from_bytes(&two).unwrap();
    assert_eq!(array.dims(), [2, 3]);
    assert_eq!(array.as_slice::<u8>().unwrap(), [1, 2, 3, 4, 5, 6]);
    // And the plain file reads the same.
    assert_eq!(idx::from_bytes(&whole).unwrap(), array);
}

// ---- 12: Fashion-MNIST is checked against its documented shape ---------------------------------

#[test]
fn fashion_mnist_refuses_images_of_another_size() {
    let dir = TempDir::new("fashion-32");
    std::fs::create_dir_all(dir.path()).unwrap();
    let write = |name: &str, kind: u8, dims: &[u32]| {
        let mut bytes = idx_header(kind, dims);
        let n: u32 = dims.iter().product();
        bytes.extend(std::iter::repeat_n(1u8, n as usize));
        std::fs::write(dir.path().join(name), bytes).unwrap();
    };
    write("train-images-idx3-ubyte", 0x08, &[3, 32, 32]);
    write("train-labels-idx1-ubyte", 0x08, &[3]);
    write("t10k-images-idx3-ubyte", 0x08, &[2, 32, 32]);
    write("t10k-labels-idx1-ubyte", 0x08, &[2]);
    let err = idx::fashion_mnist(Some(dir.path())).err().unwrap();
    assert!(err.to_string().contains("u8[n, 28, 28]"), "{err}");
    // The right shape loads.
    write("train-images-idx3-ubyte", 0x08, &[3, 28, 28]);
    write("t10k-images-idx3-ubyte", 0x08, &[2, 28, 28]);
    let data = idx::fashion_mnist(Some(dir.path())).unwrap();
    assert_eq!(data.train_images.dims(), [3, 28, 28]);
    // Labels of another shape, too.
    write("t10k-labels-idx1-ubyte", 0x08, &[2, 1]);
    assert!(idx::fashion_mnist(Some(dir.path())).is_err());
}

// ---- 3: text windows are checked before they allocate ------------------------------------------

#[test]
fn windows_past_memory_are_an_error_never_an_abort() {
    const TEST: &str = "windows_past_memory_are_an_error_never_an_abort";
    let ids: Vec<i32> = (0..1_000_000).map(|i| i % 50).collect();
    let err = text::windows(&ids, usize::MAX, 1).unwrap_err();
    assert!(matches!(err, Error::InvalidDataArgument { .. }), "{err}");
    assert!(text::windows(&ids, 0, 1).is_err() && text::windows(&ids, 8, 0).is_err());
    let small = text::windows(&ids[..20], 4, 3).unwrap();
    assert_eq!(small.rows(), 6);
    if !is_child(TEST) {
        return passes_in_limited_child(TEST, 2048);
    }
    // 1M windows of 2048 tokens, two i32 columns: 16 GB, past the child's 2 GiB.
    let err = text::windows(&ids, 2048, 1).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
}

// ---- 4 and 17: ragged batches and the planner --------------------------------------------------

fn ragged() -> Ragged {
    Ragged::new(vec![("x", vec![vec![1, 2, 3], vec![4], vec![5, 6]])]).unwrap()
}

#[test]
fn a_huge_bucket_edge_is_an_error_never_an_abort() {
    const TEST: &str = "a_huge_bucket_edge_is_an_error_never_an_abort";
    let data = ragged();
    let buckets = Buckets::new([4]).unwrap();
    let err = data.blank(usize::MAX / 2, 8, &buckets).unwrap_err();
    assert!(matches!(err, Error::ShapeTooLarge { .. }), "{err}");
    let err = data
        .gather(&[0, 1], usize::MAX / 4, 2, &buckets)
        .unwrap_err();
    assert!(matches!(err, Error::ShapeTooLarge { .. }), "{err}");
    if !is_child(TEST) {
        return passes_in_limited_child(TEST, 1024);
    }
    for result in [
        data.blank(1 << 36, 2, &buckets).map(|_| ()),
        data.gather(&[0, 1], 1 << 36, 2, &buckets).map(|_| ()),
    ] {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
    }
}

#[test]
fn empty_rows_are_refused_up_front_naming_the_row() {
    let err = plan_edges(&[0, 0, 0, 0, 5, 5, 7, 7], 2).unwrap_err();
    assert!(err.to_string().contains("row 0 has length 0"), "{err}");
    let err = plan_edges(&[3, 4, 0], 2).unwrap_err();
    assert!(err.to_string().contains("row 2 has length 0"), "{err}");
    let err = Ragged::new(vec![("x", vec![vec![1], vec![], vec![2]])]).unwrap_err();
    assert!(err.to_string().contains("row 1"), "{err}");
}

#[test]
fn the_planner_answers_many_lengths_at_once_and_bounds_the_rest() {
    // As many buckets as distinct lengths (m = k = 3000): every length an edge, no padding.
    let lengths: Vec<usize> = (1..=3000).flat_map(|l| [l, l]).collect();
    let plan = plan_edges(&lengths, 3000).unwrap();
    assert_eq!(plan.edges, (1..=3000).collect::<Vec<_>>());
    assert_eq!(plan.padded, 0);
    assert_eq!(plan_edges(&lengths, 5000).unwrap().edges.len(), 3000);
    // Many lengths, a few buckets (the divide-and-conquer layers): the cost of every edge set
    // it returns is its own count, and more buckets never pad more.
    let lengths: Vec<usize> = (0..20_000).map(|i| 1 + (i * 7919) % 5000).collect();
    let mut last = u64::MAX;
    for k in [1, 2, 8, 64] {
        let plan = plan_edges(&lengths, k).unwrap();
        assert!(plan.edges.len() <= k);
        assert_eq!(plan.edges.last(), Some(&5000));
        let padded: u64 = lengths
            .iter()
            .map(|&l| (plan.edges[plan.edges.partition_point(|&e| e < l)] - l) as u64)
            .sum();
        assert_eq!(padded, plan.padded, "k {k}");
        assert!(plan.padded <= last, "k {k}");
        last = plan.padded;
    }
    // Past the planner's bound: refused, saying what to do.
    let err = plan_edges(&lengths, 4999).unwrap_err();
    assert!(err.to_string().contains("round the lengths"), "{err}");
}

// ---- 7 and 11: the scan's trip count -----------------------------------------------------------

#[test]
fn a_scan_past_the_i32_counter_fails_the_trace() {
    let err = trace(&[("c".into(), LeafType::new(DType::F32, &[]))], |t| {
        let (carry, _) = Scan::new()
            .length(1 << 31)
            .run(&[t[0]], &[], |c, _| (vec![c[0] + 1.0], vec![]));
        carry
    })
    .unwrap_err();
    assert!(err.to_string().contains("past 2^31 − 1"), "{err}");
    // 2^31 − 1 itself traces.
    let g = trace(&[("c".into(), LeafType::new(DType::F32, &[]))], |t| {
        Scan::new()
            .length((1 << 31) - 1)
            .run(&[t[0]], &[], |c, _| (vec![c[0] + 1.0], vec![]))
            .0
    });
    assert!(g.is_ok(), "{:?}", g.err());
}

#[test]
fn the_interpreters_scan_allocates_its_outputs_fallibly() {
    const TEST: &str = "the_interpreters_scan_allocates_its_outputs_fallibly";
    if !is_child(TEST) {
        return passes_in_limited_child(TEST, 1024);
    }
    // 2^30 iterations each writing f32[1024]: 4 TiB of stacked output.
    let g = trace(&[("c".into(), LeafType::new(DType::F32, &[1024]))], |t| {
        let (carry, ys) = Scan::new()
            .length(1 << 30)
            .run(&[t[0]], &[], |c, _| (vec![c[0] + 1.0], vec![c[0]]));
        vec![carry[0], ys[0]]
    })
    .unwrap();
    let err = interp::run(&g, &[Array::zeros(DType::F32, &[1024])]).unwrap_err();
    assert!(matches!(err, Error::OutOfMemory { .. }), "{err}");
}

// ---- 9: import instructions that name nothing --------------------------------------------------

#[derive(Tree, Clone, Debug, PartialEq)]
struct Fc {
    w: Array,
    b: Array,
}

#[experiment]
struct Imported {
    #[device(trainable)]
    fc: Fc,
}

#[test]
fn import_instructions_that_name_nothing_are_refused_and_change_nothing() {
    let dir = TempDir::new("import");
    std::fs::create_dir_all(dir.path()).unwrap();
    let file = dir.path().join("torch.safetensors");
    // As PyTorch writes a Linear(3 → 2): weight [out, in].
    let torch = Imported {
        fc: Fc {
            w: Array::from_vec(&[2, 3], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap(),
            b: Array::from_vec(&[2], vec![7.0f32, 8.0]).unwrap(),
        },
    };
    weights::export(&torch, &file).unwrap();
    let fresh = || Imported {
        fc: Fc {
            w: Array::zeros(DType::F32, &[3, 2]),
            b: Array::zeros(DType::F32, &[2]),
        },
    };
    // A permute written with a name that is no leaf (the file's `fc.weight`, say), and a
    // rename of a tensor the file does not hold: each named, nothing loaded.
    let mut e = fresh();
    let import = Import::new()
        .rename("fc.weight", "fc.w")
        .permute("fc.weight", &[1, 0])
        .permute("fc.w", &[1, 0]);
    let err = weights::load_into(&mut e, &file, &import).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("rename(\"fc.weight\", \"fc.w\") names no tensor of the file"),
        "{text}"
    );
    assert!(
        text.contains("permute(\"fc.weight\", [1, 0]) names no leaf"),
        "{text}"
    );
    assert_eq!(e.fc, fresh().fc, "the experiment is unchanged");
    // A rename to a leaf that does not exist, even with extra tensors allowed.
    let import = Import::new()
        .rename("fc.b", "fc.bias")
        .permute("fc.w", &[1, 0])
        .allow_extra();
    let err = weights::load_into(&mut e, &file, &import).unwrap_err();
    assert!(
        err.to_string()
            .contains("rename(\"fc.b\", \"fc.bias\") names no leaf"),
        "{err}"
    );
    assert_eq!(e.fc, fresh().fc);
    // The right instructions load the transposed layout.
    let loaded =
        weights::load_into(&mut e, &file, &Import::new().permute("fc.w", &[1, 0])).unwrap();
    assert_eq!(loaded.leaves, ["fc.w", "fc.b"]);
    assert_eq!(
        e.fc.w.as_slice::<f32>().unwrap(),
        [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    );
}

// ---- 20: writers sweep what killed writes left -------------------------------------------------

#[test]
fn exports_arrays_and_manifests_sweep_stale_temporary_files() {
    let dir = TempDir::new("sweep");
    std::fs::create_dir_all(dir.path()).unwrap();
    let dead = common::dead_pid();
    let me = std::process::id();
    let left = [
        format!("old.safetensors.tmp.{dead}.0"),
        format!("x.npy.tmp.{dead}.4"),
        format!("inventory.json.tmp.{dead}.2"),
    ];
    let kept = [
        format!("live.safetensors.tmp.{me}.999"),
        format!("notes.txt.tmp.{dead}.1"),
    ];
    for name in left.iter().chain(&kept) {
        std::fs::write(dir.path().join(name), b"half a file").unwrap();
    }
    let e = One {
        w: Array::full(&[2], 1.0f32),
    };
    weights::export(&e, dir.path().join("w.safetensors")).unwrap();
    nitro::npy::write(dir.path().join("y.npy"), &e.w).unwrap();
    nitro::cache::Manifest::new()
        .write(dir.path().join("m.json"))
        .unwrap();
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let mut want: Vec<String> = kept.to_vec();
    want.extend(["m.json".into(), "w.safetensors".into(), "y.npy".into()]);
    want.sort();
    assert_eq!(names, want);
}

// ---- 10 and 15: half-precision parameters train; non-finite losses are reported ----------------

#[experiment]
#[derive(Clone)]
struct HalfNet {
    #[device(trainable)]
    w: Array,
    #[device(trainable)]
    b: Array,
}

impl Model for HalfNet {
    type Batch = mlp::Batch;

    fn loss(v: &HalfNetView<'_>, b: &mlp::BatchMirror<Tensor>) -> Tensor {
        // A half-precision loss: logits in the parameters' dtype.
        let logits = b.x.convert(v.w.dtype()).matmul(v.w) + v.b;
        nn::softmax_cross_entropy(logits, b.y)
    }
}

fn half_net(dtype: DType) -> HalfNet {
    let w = nitro::init::glorot_uniform(4, 3, nitro::init::Seed(3));
    let w: Vec<f32> = w.as_slice::<f32>().unwrap().to_vec();
    let cast = |v: Vec<f32>, dims: &[usize]| {
        match dtype {
            DType::BF16 => {
                Array::from_vec(dims, v.into_iter().map(bf16::from_f32).collect::<Vec<_>>())
            }
            DType::F16 => {
                Array::from_vec(dims, v.into_iter().map(f16::from_f32).collect::<Vec<_>>())
            }
            _ => Array::from_vec(dims, v),
        }
        .unwrap()
    };
    HalfNet {
        w: cast(w, &[4, 3]),
        b: cast(vec![0.0; 3], &[3]),
    }
}

fn finite(a: &Array) -> bool {
    match a.dtype() {
        DType::BF16 => a.as_slice::<bf16>().unwrap().iter().all(|x| x.is_finite()),
        DType::F16 => a.as_slice::<f16>().unwrap().iter().all(|x| x.is_finite()),
        _ => a.as_slice::<f32>().unwrap().iter().all(|x| x.is_finite()),
    }
}

#[test]
fn adam_trains_half_precision_parameters_with_f32_state() {
    let train = mlp::dataset(256, 4);
    for dtype in [DType::BF16, DType::F16] {
        let config = Config::new()
            .batch(32)
            .lr(1e-2)
            .epochs(6)
            .progress(false)
            .non_finite(NonFinite::Stop);
        let mut h = Nitro::with_backend(
            half_net(dtype),
            AdamW::default(),
            config,
            backend::interpreter(),
            Box::leak(Box::new(Cache::in_memory(8))),
        )
        .unwrap();
        let history = h.fit(&train, None).unwrap();
        let (first, last) = (
            history.epochs[0].train_loss,
            history.epochs.last().unwrap().train_loss,
        );
        // bf16 losses read as what they are (they printed as 0 before).
        assert!(first > 0.5 && first.is_finite(), "{dtype}: {first}");
        assert!(last < first * 0.9, "{dtype}: {first} → {last}");
        let e = h.experiment().unwrap();
        assert_eq!(e.w.dtype(), dtype);
        assert!(finite(&e.w) && finite(&e.b), "{dtype}: {:?}", e.w);
        // The optimizer's state is f32, and a checkpoint carries it as such.
        let c = h.checkpoint().unwrap();
        let bytes = c.to_bytes().unwrap();
        let back = nitro::checkpoint::Checkpoint::from_bytes(&bytes).unwrap();
        let resumed = Nitro::resume_with(
            half_net(dtype),
            AdamW::default(),
            Config::new().batch(32).progress(false),
            back,
            backend::interpreter(),
            Box::leak(Box::new(Cache::in_memory(8))),
        );
        assert!(resumed.is_ok(), "{dtype}: {:?}", resumed.err());
    }
}

#[test]
fn a_non_finite_loss_is_reported_and_can_stop_the_run() {
    let train = mlp::dataset(128, 5);
    // A learning rate that blows the parameters up within the first epoch.
    let run = |policy| {
        let config = Config::new()
            .batch(16)
            .lr(1e38)
            .epochs(2)
            .progress(false)
            .non_finite(policy);
        let mut h = Nitro::with_backend(
            mlp::mlp(mlp::Act::Relu),
            Adam::default(),
            config,
            backend::interpreter(),
            Box::leak(Box::new(Cache::in_memory(8))),
        )
        .unwrap();
        h.fit(&train, None)
    };
    let err = run(NonFinite::Stop).unwrap_err();
    match err {
        ref e @ Error::NonFiniteLoss {
            epoch,
            batch,
            loss,
            step,
            state_step,
        } => {
            assert_eq!(epoch, 1);
            assert!(batch >= 2, "the first step's loss is finite: {batch}");
            assert!(!loss.is_finite());
            // The losses are read at the epoch's end: the state is at its last step (128 rows
            // of 16: step 8), past the step that produced the loss, and the error says both.
            assert_eq!(state_step, 8, "{e}");
            assert!(step < state_step, "{e}");
            let text = e.to_string();
            assert!(
                text.contains(&format!("optimizer step {step})"))
                    && text.contains(&format!("state at optimizer step {state_step}")),
                "{text}"
            );
        }
        other => panic!("{other}"),
    }
    // The default warns and trains on.
    let history = run(NonFinite::Warn).unwrap();
    assert!(!history.epochs[0].train_loss.is_finite());
}

#[test]
fn a_fully_masked_row_stays_finite_in_f16() {
    for dtype in [DType::F16, DType::BF16, DType::F32] {
        let g = trace(&[("s".into(), LeafType::new(dtype, &[2, 3]))], |t| {
            let keep = Tensor::iota(DType::I32, &[2, 3], 0).less(1.0);
            let masked = Tensor::select(keep, t[0], nitro::nn::masked_score(dtype));
            vec![nn::softmax(masked, 1).convert(DType::F32)]
        })
        .unwrap();
        let x = Array::zeros(dtype, &[2, 3]);
        let out = interp::run(&g, &[x]).unwrap();
        let v = out[0].as_slice::<f32>().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{dtype}: {v:?}");
        assert!((v[3] - 1.0 / 3.0).abs() < 1e-3, "{dtype}: uniform, {v:?}");
    }
}

// ---- 16: a panic in traced code leaves no step key behind --------------------------------------

#[test]
fn a_panic_under_a_step_key_leaves_the_thread_clean() {
    use nitro::trace::random::{self, StepKey};
    let panicked = trace(&[("k".into(), LeafType::new(DType::U32, &[2]))], |t| {
        let key = t[0];
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            random::with_step_key(StepKey::Training(key), || -> Tensor {
                panic!("a model's bug")
            })
        }));
        assert!(caught.is_err());
        vec![key]
    });
    assert!(panicked.is_ok());
    // A later, unrelated trace on this thread sees no key from the one that panicked.
    let later = trace(&[("x".into(), LeafType::new(DType::F32, &[2]))], |t| {
        assert!(random::step_key().is_none(), "a stale step key");
        vec![t[0] * 2.0]
    });
    assert!(later.is_ok(), "{:?}", later.err());
}

// ---- while in these files: `Repeated::stack_params` of another depth -------------------------

#[test]
fn stack_params_refuses_a_stack_of_another_depth_or_shape() {
    use nitro::nn::{Layer, Linear, Repeated};
    let stack = Repeated::new(Linear::new(3, 3), 2);
    let err = stack.stack_params(&[]).unwrap_err();
    assert!(
        err.to_string()
            .contains("0 layers' parameters given for a stack of depth 2"),
        "{err}"
    );
    let one = Linear::new(3, 3).init(nitro::init::Seed(1));
    let err = stack.stack_params(std::slice::from_ref(&one)).unwrap_err();
    assert!(err.to_string().contains("1 layers'"), "{err}");
    let wider = Linear::new(3, 4).init(nitro::init::Seed(2));
    let err = stack.stack_params(&[one.clone(), wider]).unwrap_err();
    assert!(
        err.to_string().contains("layer 1's leaf `w` is f32[3,4]"),
        "{err}"
    );
    let two = stack
        .stack_params(&[one.clone(), Linear::new(3, 3).init(nitro::init::Seed(3))])
        .unwrap();
    assert_eq!(two.w.dims(), [2, 3, 3]);
    assert_eq!(
        &two.w.as_slice::<f32>().unwrap()[..9],
        one.w.as_slice::<f32>().unwrap()
    );
}
