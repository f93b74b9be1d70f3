//! Settings read from the environment: every accepted spelling works, anything else is an error
//! naming the variable, an explicit setting that cannot be honoured fails loudly, and a default
//! that cannot be honoured is said once on stderr. The process-wide cache reads the environment
//! once, so each case runs in a child process.
#![allow(missing_docs)]

mod common;

use std::process::Command;

use common::TempDir;
use nitro::prelude::*;
use nitro::program::Program;
use nitro::settings::parse_switch;

#[experiment]
pub struct Probe {
    #[device]
    pub w: Array,
}

fn double(v: &ProbeView<'_>, _: &()) -> Tensor {
    v.w * 2.0
}
const DOUBLE: Program<Probe> = Probe::program("double", double);

#[test]
fn switches_accept_the_usual_spellings_in_any_case() {
    for on in ["1", "true", "TRUE", "Yes", "on", " On "] {
        assert_eq!(parse_switch("NITRO_X", on).unwrap(), Some(true), "{on}");
    }
    for off in ["0", "false", "False", "NO", "off", "OFF"] {
        assert_eq!(parse_switch("NITRO_X", off).unwrap(), Some(false), "{off}");
    }
    assert_eq!(parse_switch("NITRO_X", "").unwrap(), None);
    for bad in ["2", "enable", "y", "tru", "off!"] {
        let e = parse_switch("NITRO_VERIFY_KEYS", bad).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("NITRO_VERIFY_KEYS"), "{text}");
        assert!(text.contains("true"), "says what is accepted: {text}");
    }
}

/// The child side: one case, chosen by `NITRO_TEST_SETTINGS`; prints `SETTINGS <result>`.
#[test]
#[ignore = "run as a child process by the settings tests"]
fn settings_child() {
    let Ok(case) = std::env::var("NITRO_TEST_SETTINGS") else {
        return;
    };
    let result = match case.as_str() {
        "verify" => format!("verify={}", nitro::cache::global().verify()),
        "store" => format!("store={}", nitro::cache::global().store().is_some()),
        "default_dir" => format!("{:?}", nitro::cache::default_cache_dir()),
        "backend" => match nitro::backend::current() {
            Ok(b) => format!("ok: {}", b.identity().description),
            Err(e) => format!("err: {e}"),
        },
        _ => {
            // Two lookups on the process-wide cache.
            let e = Probe {
                w: Array::full(&[2], 1.0f32),
            };
            let cache = nitro::cache::global();
            let interp = nitro::backend::interpreter();
            let first = cache.get(interp, &DOUBLE, &e, &());
            let second = cache.get(interp, &DOUBLE, &e, &());
            match (first, second) {
                (Ok(_), Ok(_)) => "lookups ok".to_owned(),
                (Err(e), _) | (_, Err(e)) => format!("err: {e}"),
            }
        }
    };
    println!("SETTINGS {result}");
}

/// Runs the child with `vars` set (and `unset` removed); returns its report and its stderr.
fn child(case: &str, vars: &[(&str, &str)], unset: &[&str]) -> (String, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["settings_child", "--exact", "--ignored", "--nocapture"])
        .env("NITRO_TEST_SETTINGS", case);
    for v in [
        "NITRO_CACHE",
        "NITRO_CACHE_DIR",
        "NITRO_CACHE_KEY",
        "NITRO_VERIFY_KEYS",
        "NITRO_PJRT_PLATFORM",
        "NITRO_BACKEND",
        "XDG_CACHE_HOME",
    ]
    .iter()
    .chain(unset)
    {
        cmd.env_remove(v);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report = stdout
        .lines()
        .find_map(|l| l.split_once("SETTINGS ").map(|(_, r)| r.to_owned()))
        .unwrap_or_else(|| panic!("no report from {case} {vars:?}:\n{stdout}\n{stderr}"));
    (report, stderr)
}

#[test]
fn verify_mode_accepts_every_spelling() {
    let tmp = TempDir::new("settings-verify");
    let dir = tmp.path().to_str().unwrap();
    for (value, on) in [("true", true), ("YES", true), ("1", true), ("off", false)] {
        let (report, _) = child(
            "verify",
            &[("NITRO_VERIFY_KEYS", value), ("NITRO_CACHE_DIR", dir)],
            &[],
        );
        assert_eq!(report, format!("verify={on}"), "NITRO_VERIFY_KEYS={value}");
    }
}

#[test]
fn the_persistent_cache_switch_accepts_every_spelling() {
    let tmp = TempDir::new("settings-cache");
    let dir = tmp.path().to_str().unwrap();
    for (value, store) in [("OFF", false), ("false", false), ("0", false), ("on", true)] {
        let (report, _) = child(
            "store",
            &[("NITRO_CACHE", value), ("NITRO_CACHE_DIR", dir)],
            &[],
        );
        assert_eq!(report, format!("store={store}"), "NITRO_CACHE={value}");
    }
}

#[test]
fn a_setting_that_cannot_be_honoured_fails_every_lookup_and_names_the_variable() {
    let tmp = TempDir::new("settings-bad");
    std::fs::create_dir_all(tmp.path()).unwrap();
    let dir = tmp.path().to_str().unwrap().to_owned();
    let open = tmp.path().join("open");
    std::fs::create_dir_all(&open).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let open = open.to_str().unwrap().to_owned();
    let secret = "not-a-key-0123456789";
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (
            vec![("NITRO_VERIFY_KEYS", "maybe"), ("NITRO_CACHE_DIR", &dir)],
            "NITRO_VERIFY_KEYS",
        ),
        (
            vec![("NITRO_CACHE", "disabled"), ("NITRO_CACHE_DIR", &dir)],
            "NITRO_CACHE",
        ),
        (
            vec![("NITRO_CACHE_KEY", secret), ("NITRO_CACHE_DIR", &dir)],
            "NITRO_CACHE_KEY",
        ),
        (vec![("NITRO_CACHE_DIR", &open)], "writable by every user"),
    ];
    for (vars, named) in cases {
        let (report, _) = child("lookups", &vars, &[]);
        assert!(report.starts_with("err: "), "{vars:?}: {report}");
        assert!(report.contains("misconfigured"), "{report}");
        assert!(report.contains(named), "{vars:?} names {named}: {report}");
        assert!(
            !report.contains(secret),
            "the key is never printed: {report}"
        );
    }
}

#[test]
fn a_default_that_cannot_be_honoured_is_said_once_and_runs_without_the_store() {
    let tmp = TempDir::new("settings-default");
    let cache = tmp.path().join(".cache").join("nitro");
    std::fs::create_dir_all(&cache).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let home = tmp.path().to_str().unwrap();
    let (report, stderr) = child("lookups", &[("HOME", home)], &[]);
    assert_eq!(report, "lookups ok");
    assert_eq!(
        stderr
            .matches("the default compile cache is not usable")
            .count(),
        1,
        "said once, on stderr: {stderr}"
    );
}

#[test]
fn the_default_directory_follows_the_platform_rules() {
    let tmp = TempDir::new("settings-xdg");
    let home = tmp.path().to_str().unwrap();
    if cfg!(target_os = "linux") {
        let (report, _) = child(
            "default_dir",
            &[("HOME", home), ("XDG_CACHE_HOME", "relative/cache")],
            &[],
        );
        let want = tmp.path().join(".cache").join("nitro");
        assert_eq!(
            report,
            format!("{:?}", Some(want)),
            "a relative XDG_CACHE_HOME is ignored"
        );
        let xdg = tmp.path().join("xdg");
        let (report, _) = child(
            "default_dir",
            &[("HOME", home), ("XDG_CACHE_HOME", xdg.to_str().unwrap())],
            &[],
        );
        assert_eq!(report, format!("{:?}", Some(xdg.join("nitro"))));
        // No HOME: the home directory still comes from the user database.
        let (report, _) = child("default_dir", &[], &["HOME"]);
        assert!(report.starts_with("Some("), "{report}");
    }
}

#[test]
fn asking_for_a_platform_without_its_plugin_is_an_error() {
    // No CUDA plugin is installed where these tests run (a CUDA machine would load it).
    let (report, _) = child("backend", &[("NITRO_PJRT_PLATFORM", "cuda")], &[]);
    if report.starts_with("ok: ") {
        println!("skip: a CUDA plugin is installed here: {report}");
        return;
    }
    assert!(report.starts_with("err: "), "{report}");
    assert!(report.contains("CUDA"), "{report}");
    let (report, _) = child("backend", &[("NITRO_PJRT_PLATFORM", "tpu")], &[]);
    assert!(report.contains("NITRO_PJRT_PLATFORM"), "{report}");
}
