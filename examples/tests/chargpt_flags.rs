//! The chargpt example's flags are checked before any work is done:
//!
//! - settings that cannot train (`--lr NaN`, `--width 0`, a dropout of 1, …) are refused with
//!   one sentence naming the flag and its value;
//! - a corpus shorter than a window (or a `--context` beyond the data) and a `--steps` whose
//!   windows would not fit in memory are errors, not a panic or an allocation abort;
//! - output paths (`--checkpoint`, `--manifest`, `--twin`) that cannot be written are refused
//!   before the corpus is read, naming the flag and the path, not after training;
//! - `--check --json` prints the preflight as one JSON line;
//! - a run with `--mesh data=2 --fsdp` reports its devices, sharding and per-device memory
//!   (with the plugin's figures for each program) in its JSON line.
//!
//! Most tests call the library ([`nitro_examples::chargpt::Args`]); those about the process
//! (exit status 1, one line on stderr) run the example binary, built once by cargo in this
//! test's profile, on tiny inputs that are refused before anything compiles.
#![allow(missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use clap::Parser;
use nitro::cache::{MissReason, Probe, Will};
use nitro::data::text::{self, Vocab};
use nitro::train::{Plan, PlanEntry};
use nitro_examples::chargpt::{self, Args};
use nitro_examples::report::{last_json_line, plan_json};
use serde_json::Value;

/// A scratch directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "nitro-chargpt-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn args(flags: &[&str]) -> Args {
    Args::try_parse_from(std::iter::once("chargpt").chain(flags.iter().copied()))
        .unwrap_or_else(|e| panic!("{flags:?}: {e}"))
}

/// The validation error of `flags`, which must start with `prefix` and be one line.
fn refused(flags: &[&str], prefix: &str) -> String {
    let err = match args(flags).validate() {
        Ok(()) => panic!("{flags:?} was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.starts_with(prefix), "{flags:?}: {err}");
    assert!(!err.contains('\n'), "one line: {err}");
    err
}

/// A directory of one fortune file holding `text`, as `--data` reads it.
fn corpus(tag: &str, text: &str) -> TempDir {
    let dir = TempDir::new(tag);
    std::fs::write(dir.path().join("fortunes"), text).unwrap();
    dir
}

/// About `chars` characters of fortunes, `%`-separated.
fn small_corpus(tag: &str, chars: usize) -> TempDir {
    let fortune =
        "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen jugs.\n%\n";
    corpus(tag, &fortune.repeat(chars.div_ceil(fortune.len())))
}

// ---- item 13: settings that cannot train ----

#[test]
fn the_defaults_validate() {
    args(&[]).validate().expect("the defaults train");
    args(&["--dropout", "0", "--lr", "1e-4", "--scan", "--remat"])
        .validate()
        .expect("a dropout of 0 is none");
}

#[test]
fn non_finite_and_non_positive_rates_are_refused_naming_the_flag_and_value() {
    refused(&["--lr", "NaN"], "--lr NaN: ");
    refused(&["--lr", "inf"], "--lr inf: ");
    refused(&["--lr", "0"], "--lr 0: ");
    refused(&["--lr=-0.001"], "--lr -0.001: ");
    refused(&["--dropout", "1"], "--dropout 1: ");
    refused(&["--dropout=-0.1"], "--dropout -0.1: ");
    refused(&["--dropout", "NaN"], "--dropout NaN: ");
    // 0 is greedy decoding; below it, or not a number, is refused.
    args(&["--temperature", "0"]).validate().unwrap();
    refused(&["--temperature=-0.5"], "--temperature -0.5: ");
    refused(&["--temperature", "NaN"], "--temperature NaN: ");
    refused(&["--top-p", "0"], "--top-p 0: ");
    refused(&["--top-p", "1.5"], "--top-p 1.5: ");
    refused(&["--slots", "0"], "--slots 0: ");
    let err = refused(&["--lr", "NaN"], "--lr NaN: ");
    assert!(err.contains("finite number above 0"), "{err}");
}

#[test]
fn zero_counts_and_mismatched_shapes_are_refused_naming_the_flag() {
    for flag in [
        "--steps",
        "--layers",
        "--width",
        "--heads",
        "--context",
        "--batch",
    ] {
        let err = refused(&[flag, "0"], &format!("{flag} 0: "));
        assert!(err.contains("at least 1"), "{err}");
    }
    let err = refused(&["--width", "10", "--heads", "4"], "--width 10: ");
    assert!(err.contains("multiple of --heads 4"), "{err}");
    refused(&["--remat"], "--remat: ");
}

// ---- item 8: a corpus shorter than a window, and steps beyond memory ----

#[test]
fn windows_of_a_text_shorter_than_one_window_are_an_error_not_a_panic() {
    for len in [0, 1, 5, 8] {
        let ids = vec![0i32; len];
        let err = chargpt::random_windows(&ids, 8, 4, 1)
            .err()
            .unwrap_or_else(|| panic!("{len} characters hold no window of 9"))
            .to_string();
        assert!(err.contains("windows of 9 characters"), "{err}");
    }
    // A text of exactly one window holds it.
    let (data, starts) = chargpt::random_windows(&[0, 1, 2], 2, 3, 1).unwrap();
    assert_eq!((data.rows(), starts), (3, vec![0, 0, 0]));
}

#[test]
fn a_context_beyond_the_corpus_names_the_largest_that_fits() {
    let err = args(&["--context", "128"])
        .check_corpus(1, 1)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("--context 128: "), "{err}");
    assert!(err.contains("too small for any window"), "{err}");
    let err = args(&["--context", "500"])
        .check_corpus(900, 100)
        .unwrap_err()
        .to_string();
    assert!(err.contains("at most --context 99"), "{err}");
    args(&["--context", "99"]).check_corpus(900, 100).unwrap();
    // Whole documents are capped at the context: nothing to refuse.
    args(&["--context", "500", "--buckets", "2"])
        .check_corpus(900, 100)
        .unwrap();
}

#[test]
fn steps_whose_windows_exceed_memory_are_refused_with_the_most_that_fit() {
    let gb = 1_000_000_000u64;
    let err = args(&["--steps", "100000000"])
        .check_memory(Some(8 * gb))
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("--steps 100000000: "), "{err}");
    assert!(err.contains("use at most --steps "), "{err}");
    assert!(!err.contains('\n'), "{err}");
    // The defaults (about 17 MB of windows) fit.
    args(&[]).check_memory(Some(8 * gb)).unwrap();
    args(&[]).check_memory(None).unwrap();
    // Beyond any address space, even when the memory is unknown.
    let huge = usize::MAX.to_string();
    let err = args(&["--steps", &huge])
        .check_memory(None)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with(&format!("--steps {huge}: ")), "{err}");
    // Not even one step fits.
    let err = args(&["--batch", "1000000", "--context", "100000"])
        .check_memory(Some(gb))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not even one step fits"), "{err}");
    // A bucketed run holds documents, not steps × batch windows.
    args(&["--steps", "100000000", "--buckets", "4"])
        .check_memory(Some(gb))
        .unwrap();
}

#[test]
fn a_prompt_outside_the_vocabulary_is_refused_before_training() {
    let vocab = Vocab::of("abc ");
    args(&["--sample", "5", "--prompt", "ab c"])
        .check_prompt(&vocab)
        .unwrap();
    // Without --sample the prompt is unused.
    args(&["--prompt", "xyz"]).check_prompt(&vocab).unwrap();
    let err = args(&["--sample", "5", "--prompt", "abz"])
        .check_prompt(&vocab)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("--prompt \"abz\": "), "{err}");
    assert!(err.contains("'z'"), "{err}");
}

// ---- item 21: output paths, checked before the run ----

#[test]
fn unwritable_output_paths_are_refused_naming_the_flag_and_the_path() {
    let dir = TempDir::new("paths");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let through = |name: &str| file.join(name).display().to_string();
    let shown = file.display().to_string();
    for (flag, path) in [
        ("--checkpoint", through("run.ckpt")),
        ("--manifest", through("manifest.json")),
        ("--twin", through("bundle")),
    ] {
        let err = refused(&[flag, &path], &format!("{flag} {path}: "));
        assert!(
            err.contains(&format!("`{shown}` is a file, not a directory")),
            "{err}"
        );
    }
    // A twin bundle's directory that is a file; a checkpoint or manifest that is a directory.
    refused(
        &["--twin", &shown],
        &format!("--twin {shown}: it is a file"),
    );
    // A directory is a checkpoint directory; a `.safetensors` path that is a directory, and
    // a file where a checkpoint directory would be, are refused.
    let d = dir.path().display().to_string();
    args(&["--checkpoint", &d]).validate().unwrap();
    let st = dir.path().join("dir.safetensors");
    std::fs::create_dir_all(&st).unwrap();
    let st = st.display().to_string();
    refused(
        &["--checkpoint", &st],
        &format!("--checkpoint {st}: it is a directory"),
    );
    let err = refused(
        &["--checkpoint", &shown],
        &format!("--checkpoint {shown}: "),
    );
    assert!(err.contains("`.safetensors`"), "{err}");
    refused(
        &["--manifest", &d],
        &format!("--manifest {d}: it is a directory"),
    );
    // A missing parent directory is not created.
    let missing = dir
        .path()
        .join("no-such-dir/run.ckpt")
        .display()
        .to_string();
    let err = refused(&["--checkpoint", &missing], "--checkpoint ");
    assert!(err.contains("does not exist"), "{err}");
    // A resume file that is not there.
    let absent = dir.path().join("absent.ckpt").display().to_string();
    refused(&["--resume", &absent], &format!("--resume {absent}: "));
    // Writable ones pass: a new file in an existing directory, a twin directory to create.
    let ok = |name: &str| dir.path().join(name).display().to_string();
    args(&[
        "--checkpoint",
        &ok("run.ckpt"),
        "--manifest",
        &ok("manifest.json"),
        "--twin",
        &ok("new/nested/bundle"),
    ])
    .validate()
    .unwrap();
}

// ---- item 22: the preflight as JSON ----

fn entry(role: &str, edge: Option<usize>, will: Will, reason: Option<MissReason>) -> PlanEntry {
    PlanEntry {
        role: role.into(),
        edge,
        probe: Probe {
            program: format!("CharGpt::nitro.{role}"),
            will,
            reason,
            compile_ms: Some(1025.0),
            load_ms: None,
            fingerprint: nitro::Digest::default(),
        },
    }
}

#[test]
fn the_plan_as_json_has_every_program_with_its_role_edge_outcome_reason_and_times() {
    let plan = Plan {
        entries: vec![
            entry("update", None, Will::Hit, None),
            entry("grad", Some(64), Will::Compile, Some(MissReason::Empty)),
            entry("eval", Some(64), Will::Load, Some(MissReason::Evicted)),
        ],
    };
    let line = plan_json("chargpt", &plan).to_string();
    assert!(!line.contains('\n'), "one line: {line}");
    let v = Value::Object(last_json_line(&line).expect("a JSON object"));
    assert_eq!(v["example"], "chargpt");
    assert_eq!(v["check"], true);
    let programs = v["programs"].as_array().expect("programs");
    assert_eq!(programs.len(), 3);
    assert_eq!(programs[0]["role"], "update");
    assert_eq!(programs[0]["edge"], Value::Null);
    assert_eq!(programs[0]["outcome"], "hit");
    assert_eq!(programs[0]["reason"], Value::Null);
    assert_eq!(programs[1]["role"], "grad");
    assert_eq!(programs[1]["edge"], 64);
    assert_eq!(programs[1]["outcome"], "compile");
    assert_eq!(programs[1]["reason"], "empty (never compiled here)");
    assert_eq!(programs[1]["compile_ms"], 1025.0);
    assert_eq!(programs[1]["expected_ms"], 1025.0);
    assert_eq!(programs[2]["outcome"], "load");
    assert_eq!(programs[2]["load_ms"], Value::Null);
    assert_eq!(programs[2]["program"], "CharGpt::nitro.eval");
    assert_eq!((v["hit"].clone(), v["load"].clone()), (1.into(), 1.into()));
    assert_eq!(
        (v["fetch"].clone(), v["compile"].clone()),
        (0.into(), 1.into())
    );
    assert_eq!(v["expected_ms"], 1025.0);
    assert_eq!(v["without_record"], 1, "the load has no recorded time");
}

// ---- the process: exit status 1 and one sentence on stderr ----

/// The chargpt example's binary, built once (by cargo, in this test's profile and target
/// directory: a no-op when `cargo test` built the examples already).
fn chargpt_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        // This test runs from TARGET/PROFILE/deps/.
        let exe = std::env::current_exe().unwrap();
        let profile_dir = exe.parent().and_then(Path::parent).expect("a profile dir");
        let target_dir = profile_dir.parent().expect("a target dir");
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev".to_owned(),
            Some(p) => p.to_owned(),
        };
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_owned());
        let out = Command::new(cargo)
            .args(["build", "--quiet", "-p", "nitro-examples", "--example"])
            .args(["chargpt", "--message-format=json", "--profile", &profile])
            .arg("--manifest-path")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .arg("--target-dir")
            .arg(target_dir)
            .output()
            .expect("cargo runs");
        assert!(
            out.status.success(),
            "building the chargpt example failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "chargpt")
            .find_map(|m| m["executable"].as_str().map(PathBuf::from))
            .expect("cargo names the chargpt executable")
    })
}

/// Runs the example with `flags`, its compile cache in `cache`.
fn chargpt(flags: &[&str], cache: &Path) -> Output {
    Command::new(chargpt_bin())
        .args(flags)
        .env("NITRO_CACHE_DIR", cache)
        .env_remove("NITRO_CACHE_REMOTE")
        .env_remove("RUST_LOG")
        .output()
        .expect("the example runs")
}

/// Asserts the run failed with status 1 (not a panic's 101 or an abort's signal) and one line
/// on stderr starting with `prefix`, having trained nothing; returns that line.
fn fails_with(out: &Output, prefix: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "exit status 1, got {:?}; stderr:\n{stderr}",
        out.status
    );
    assert_eq!(stderr.lines().count(), 1, "one line on stderr:\n{stderr}");
    assert!(stderr.starts_with(prefix), "{stderr}");
    assert!(!stdout.contains("epoch"), "nothing trained:\n{stdout}");
    stderr
}

#[test]
fn the_example_exits_1_on_settings_that_cannot_train() {
    let cache = TempDir::new("cache");
    fails_with(
        &chargpt(&["--lr", "NaN"], cache.path()),
        "chargpt: --lr NaN: ",
    );
    fails_with(
        &chargpt(&["--width", "0"], cache.path()),
        "chargpt: --width 0: ",
    );
}

#[test]
fn the_example_exits_1_on_a_corpus_shorter_than_a_window() {
    let cache = TempDir::new("cache");
    let one = corpus("one-char", "a");
    let data = one.path().display().to_string();
    let err = fails_with(
        &chargpt(&["--data", &data], cache.path()),
        "chargpt: --context 128: ",
    );
    assert!(err.contains("too small for any window"), "{err}");
    let small = small_corpus("small", 2000);
    let data = small.path().display().to_string();
    let err = fails_with(
        &chargpt(&["--data", &data, "--context", "100000"], cache.path()),
        "chargpt: --context 100000: ",
    );
    assert!(err.contains("use at most --context "), "{err}");
}

#[test]
fn the_example_exits_1_on_steps_beyond_memory_without_allocating_them() {
    let cache = TempDir::new("cache");
    let small = small_corpus("steps", 4000);
    let data = small.path().display().to_string();
    // 10^8 steps of 16 windows of 129 characters: about 1.7 TB.
    let err = fails_with(
        &chargpt(&["--data", &data, "--steps", "100000000"], cache.path()),
        "chargpt: --steps 100000000: ",
    );
    assert!(err.contains("use at most --steps "), "{err}");
}

#[test]
fn the_example_refuses_unwritable_outputs_before_reading_the_corpus() {
    let cache = TempDir::new("cache");
    let dir = TempDir::new("outputs");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    // A corpus directory that is not there: the outputs are refused before it is read.
    let data = dir.path().join("no-corpus").display().to_string();
    for (flag, name) in [
        ("--checkpoint", "run.ckpt"),
        ("--manifest", "manifest.json"),
        ("--twin", "bundle"),
    ] {
        let path = file.join(name).display().to_string();
        let out = chargpt(&["--data", &data, flag, &path], cache.path());
        let err = fails_with(&out, &format!("chargpt: {flag} {path}: "));
        assert!(err.contains("is a file, not a directory"), "{err}");
    }
}

#[test]
fn the_example_prints_the_preflight_as_one_json_line() {
    let cache = TempDir::new("cache");
    let small = small_corpus("check", 4000);
    let data = small.path().display().to_string();
    let tiny = [
        "--steps",
        "2",
        "--batch",
        "2",
        "--context",
        "8",
        "--width",
        "8",
        "--heads",
        "1",
        "--layers",
        "1",
    ];
    let mut flags = vec!["--data", &data, "--check", "--json"];
    flags.extend(tiny);
    let out = chargpt(&flags, cache.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.lines().count(), 1, "one line:\n{stdout}");
    let v: Value = serde_json::from_str(stdout.trim()).expect("a JSON line");
    assert_eq!(v["example"], "chargpt");
    let programs = v["programs"].as_array().expect("programs");
    let roles: Vec<&str> = programs.iter().filter_map(|p| p["role"].as_str()).collect();
    assert_eq!(roles, ["update", "grad", "eval"], "{v}");
    for p in programs {
        for key in ["edge", "outcome", "reason", "compile_ms", "load_ms"] {
            assert!(p.get(key).is_some(), "{key} missing from {p}");
        }
        assert_eq!(p["outcome"], "compile", "a fresh cache: {p}");
    }
    assert_eq!(v["compile"], 3);
    // Without --json, the table.
    let mut flags = vec!["--data", &data, "--check"];
    flags.extend(tiny);
    let out = chargpt(&flags, cache.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(stdout.contains("3 program(s): 0 hit"), "{stdout}");
}

/// The Debian package's corpus (`NITRO_REQUIRE_FORTUNES=1`: required, else the test skips).
#[test]
fn a_context_beyond_the_fortunes_is_an_error() {
    let required = std::env::var("NITRO_REQUIRE_FORTUNES").is_ok_and(|v| v.trim() == "1");
    if !Path::new(text::FORTUNES_DIR).exists() && !required {
        println!("skip: the Debian package fortunes is not installed");
        return;
    }
    let cache = TempDir::new("cache");
    let err = fails_with(
        &chargpt(&["--context", "100000000"], cache.path()),
        "chargpt: --context 100000000: ",
    );
    assert!(err.contains("use at most --context "), "{err}");
}

// ---- issue 40: one --devices flag, refused beside --mesh ----

#[test]
fn devices_is_a_flag_refused_at_zero_and_beside_a_mesh() {
    assert_eq!(args(&["--devices", "2"]).run.devices, Some(2));
    refused(&["--devices", "0"], "--devices 0");
    let err = refused(&["--mesh", "data=2", "--devices", "2"], "--devices 2");
    assert!(err.contains("--mesh data=2"), "{err}");
    // With --fsdp and no --mesh, --devices sizes the data axis.
    let layout = args(&["--fsdp", "--devices", "2"])
        .run
        .layout()
        .unwrap()
        .unwrap();
    assert_eq!(layout.devices(), 2);
}

// ---- issue 33: a run over a mesh reports its layout ----

/// Whether XLA serves 2 devices here; prints `skip:` when not, and fails under
/// `NITRO_REQUIRE_XLA=1`.
fn xla_on_two_devices_or_skip(test: &str) -> bool {
    let Err(e) = nitro::backend::xla_for(2) else {
        return true;
    };
    let required = std::env::var("NITRO_REQUIRE_XLA").is_ok_and(|v| v.trim() == "1");
    assert!(
        !required,
        "{test}: NITRO_REQUIRE_XLA=1 but XLA on 2 devices: {e}"
    );
    println!("skip: {test}: {e}");
    false
}

/// Runs the example on a model small enough to train in seconds (`--width 16 --heads 2
/// --layers 1 --context 8 --batch 4`) over the corpus in `data`, with `--json` and `extra`;
/// asserts it succeeded and returns its JSON line.
fn tiny_run(data: &str, cache: &Path, extra: &[&str]) -> Value {
    let mut flags = vec![
        "--data",
        data,
        "--width",
        "16",
        "--heads",
        "2",
        "--layers",
        "1",
        "--context",
        "8",
        "--batch",
        "4",
        "--json",
    ];
    flags.extend(extra);
    let out = chargpt(&flags, cache);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{flags:?}:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Value::Object(last_json_line(&stdout).expect("a JSON line"))
}

#[test]
fn an_fsdp_run_reports_its_devices_sharding_and_per_device_memory_in_its_json_line() {
    let test = "an_fsdp_run_reports_its_devices_sharding_and_per_device_memory_in_its_json_line";
    if !xla_on_two_devices_or_skip(test) {
        return;
    }
    let corpus = small_corpus("fsdp", 6000);
    let data = corpus.path().display().to_string();
    let cache = TempDir::new("cache");
    let v = tiny_run(
        &data,
        cache.path(),
        &[
            "--steps",
            "2",
            "--dropout",
            "0",
            "--mesh",
            "data=2",
            "--fsdp",
        ],
    );
    assert_eq!(v["devices"], 2, "{v}");
    // The plugin line describes the devices the handle uses, not the default one-device client.
    let plugin = v["plugin"].as_str().expect("a plugin");
    assert!(
        plugin.contains("partitioned over 2 devices") && !plugin.contains("1 device(s)"),
        "{plugin}"
    );
    let sharding = v["sharding"].as_str().expect("a sharding");
    assert!(
        sharding.contains("data=2") && sharding.contains("fsdp(data)"),
        "{sharding}"
    );
    let memory = &v["memory"];
    assert_eq!(memory["devices"], 2, "{memory}");
    let bytes = |field: &str| {
        memory[field]
            .as_u64()
            .unwrap_or_else(|| panic!("{field}: {memory}"))
    };
    let (parameters, state) = (bytes("parameters"), bytes("optimizer_state"));
    assert!(
        parameters > 0 && state == 2 * parameters,
        "Adam's two slots: {memory}"
    );
    let programs = memory["programs"].as_array().expect("programs");
    let mut roles: Vec<&str> = programs.iter().filter_map(|p| p["role"].as_str()).collect();
    roles.sort_unstable();
    assert_eq!(roles, ["eval", "grad", "update"], "{memory}");
    for p in programs {
        let compiled = &p["compiled"];
        assert!(
            compiled["temporaries"].is_u64(),
            "the plugin's figures: {p}"
        );
        if p["role"] == "update" {
            // One device's shards: parameters, optimizer state, gradients; the step counter
            // (i64) and the learning rate (f32).
            assert_eq!(
                compiled["arguments"].as_u64(),
                Some(2 * parameters + state + 8 + 4),
                "{p}"
            );
        }
    }
}

// ---- issue 42, item 3: saves in the background ----

#[test]
fn save_every_needs_a_checkpoint_path() {
    let err = refused(&["--save-every", "2"], "--save-every 2");
    assert!(err.contains("--checkpoint"), "{err}");
    let dir = TempDir::new("save-every");
    let path = dir.path().join("run.safetensors").display().to_string();
    std::fs::create_dir_all(dir.path()).unwrap();
    assert_eq!(
        args(&["--save-every", "2", "--checkpoint", &path]).save_every,
        2
    );
}

/// A run saving every 2 of its 4 steps reports the background saves in its JSON line, and the
/// checkpoint it leaves (the final state, written after the last background save) resumes.
#[test]
fn a_run_saving_every_two_steps_reports_its_saves_and_its_checkpoint_resumes() {
    let corpus = small_corpus("save-every", 6000);
    let data = corpus.path().display().to_string();
    let dir = TempDir::new("save-every-run");
    std::fs::create_dir_all(dir.path()).unwrap();
    let checkpoint = dir.path().join("run.safetensors").display().to_string();
    let cache = TempDir::new("cache");
    let run = ["--steps", "4", "--checkpoint", &checkpoint];
    let v = tiny_run(
        &data,
        cache.path(),
        &[&run[..], &["--save-every", "2"]].concat(),
    );
    let save_ms = v["save_ms"]
        .as_f64()
        .unwrap_or_else(|| panic!("save_ms: {v}"));
    assert!(save_ms > 0.0, "{v}");
    assert!(v["save_copy_ms"].as_f64().is_some(), "{v}");
    assert!(v.get("step_ms_saving").is_some(), "{v}");
    let saved = nitro::checkpoint::Checkpoint::load(&checkpoint).unwrap();
    assert_eq!(saved.step(), 4);
    // The final checkpoint resumes and trains on.
    tiny_run(
        &data,
        cache.path(),
        &[&run[..], &["--resume", &checkpoint]].concat(),
    );
    let resumed = nitro::checkpoint::Checkpoint::load(&checkpoint).unwrap();
    assert_eq!(resumed.step(), 8);
}

/// A checkpoint directory written by a run under FSDP on 2 devices resumes on one device, and a
/// file written on one device resumes under FSDP (`--resume` on any `--mesh`).
#[test]
fn a_checkpoint_resumes_across_meshes() {
    let test = "a_checkpoint_resumes_across_meshes";
    if !xla_on_two_devices_or_skip(test) {
        return;
    }
    let corpus = small_corpus("across-meshes", 6000);
    let data = corpus.path().display().to_string();
    let dir = TempDir::new("across-meshes-run");
    std::fs::create_dir_all(dir.path()).unwrap();
    let cache = TempDir::new("cache");
    let run = |extra: &[&str]| {
        let flags = [&["--steps", "2", "--dropout", "0"][..], extra].concat();
        tiny_run(&data, cache.path(), &flags)
    };
    // Under FSDP a checkpoint directory (each device's shards a part of their own), on one
    // device one file: each resumes on the other mesh.
    let fsdp_ckpt = dir.path().join("fsdp").display().to_string();
    let one_ckpt = dir.path().join("one.safetensors").display().to_string();
    let v = run(&["--mesh", "data=2", "--fsdp", "--checkpoint", &fsdp_ckpt]);
    assert_eq!(v["devices"], 2, "{v}");
    let parts = nitro::checkpoint::CheckpointDir::open(&fsdp_ckpt).unwrap();
    let part_files = std::fs::read_dir(parts.version())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("part-"))
        .count();
    assert_eq!(part_files, 2, "one part per device");
    // FSDP on 2 devices → one device.
    let v = run(&["--resume", &fsdp_ckpt, "--checkpoint", &one_ckpt]);
    assert_eq!(v["devices"], 1, "{v}");
    assert_eq!(
        nitro::checkpoint::Checkpoint::load(&one_ckpt)
            .unwrap()
            .step(),
        4
    );
    // One device → FSDP on 2 devices.
    let v = run(&[
        "--resume",
        &one_ckpt,
        "--mesh",
        "data=2",
        "--fsdp",
        "--checkpoint",
        &fsdp_ckpt,
    ]);
    assert_eq!(v["devices"], 2, "{v}");
    assert_eq!(
        nitro::checkpoint::Checkpoint::load(&fsdp_ckpt)
            .unwrap()
            .step(),
        6
    );
}

/// `--init device` creates the parameters on the devices (under FSDP on 2, unrolled and
/// scanned blocks) and trains; the JSON line names where they were made and how long it took.
/// `--twin`, which writes the initial parameters, needs them on the host.
#[test]
fn parameters_created_on_the_devices_train_and_are_reported() {
    let test = "parameters_created_on_the_devices_train_and_are_reported";
    let err = refused(&["--init", "device", "--twin", "bundle"], "--init device: ");
    assert!(err.contains("--init host"), "{err}");
    if !xla_on_two_devices_or_skip(test) {
        return;
    }
    let corpus = small_corpus("init-device", 6000);
    let data = corpus.path().display().to_string();
    let cache = TempDir::new("cache");
    for extra in [&[][..], &["--scan"][..]] {
        let flags = [
            &[
                "--steps", "3", "--mesh", "data=2", "--fsdp", "--init", "device",
            ][..],
            extra,
        ]
        .concat();
        let v = tiny_run(&data, cache.path(), &flags);
        assert_eq!(v["init"], "device", "{v}");
        assert!(v["init_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{v}");
        let loss = v["val_bits_per_char"].as_f64().unwrap_or(f64::NAN);
        assert!(loss.is_finite() && loss > 0.0, "{v}");
    }
    let v = tiny_run(&data, cache.path(), &["--steps", "2"]);
    assert_eq!(v["init"], "host", "{v}");
    assert!(v["init_ms"].as_f64().is_some(), "{v}");
}
