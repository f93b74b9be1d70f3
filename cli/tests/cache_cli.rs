//! The `nitro` binary against real cache directories, filled by compiling programs through the
//! library (on the interpreter backend, which stores entries like XLA does, instantly).
#![allow(missing_docs)]

#[path = "../../runtime/tests/common/mod.rs"]
mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use common::probe::{OTHER, STEP};
use common::TempDir;
use nitro::backend;
use nitro::cache::{Cache, DirStore};
use nitro::prelude::*;
use serde_json::Value;

const KEY_A: &str = "0101010101010101010101010101010101010101010101010101010101010101";
const KEY_B: &str = "0202020202020202020202020202020202020202020202020202020202020202";

fn hex_key(hex: &str) -> [u8; 32] {
    *hex.parse::<Digest>().unwrap().as_bytes()
}

/// Compiles three programs into a store at `dir`: STEP with k = 3 and k = 4, and OTHER. The
/// entries' last use is set one minute apart in that order (STEP k=3 oldest), so least recently
/// used is known.
fn fill(dir: &Path, signing: Option<&str>) {
    let store = Arc::new(DirStore::open(dir, 1 << 30, signing.map(hex_key)).unwrap());
    let cache = Cache::new(8, Some(store.clone()));
    let (mut e, x) = common::probe::probe();
    let base = SystemTime::now() - Duration::from_secs(3600);
    for (i, (program, k)) in [(&STEP, 3), (&STEP, 4), (&OTHER, 3)]
        .into_iter()
        .enumerate()
    {
        let before = entry_files(dir);
        e.k = k;
        cache.get(backend::interpreter(), program, &e, &x).unwrap();
        let new: Vec<PathBuf> = entry_files(dir)
            .into_iter()
            .filter(|p| !before.contains(p))
            .collect();
        assert_eq!(new.len(), 1, "each run stores one entry");
        fs::File::options()
            .write(true)
            .open(&new[0])
            .unwrap()
            .set_modified(base + Duration::from_secs(60 * i as u64))
            .unwrap();
    }
}

/// The entry files, in key order, as the library lists them.
fn entry_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = DirStore::open_existing(dir, None)
        .unwrap()
        .list()
        .into_iter()
        .map(|e| dir.join(format!("{}.entry", e.key)))
        .collect();
    v.sort();
    v
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is one JSON document ({e}):\n{}", self.stdout))
    }
}

/// Runs the binary with `args`, no cache settings from the test's environment, and `env` added.
fn nitro(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nitro"));
    cmd.args(args)
        .env_remove("NITRO_CACHE_DIR")
        .env_remove("NITRO_CACHE_KEY")
        .env_remove("NITRO_CACHE_REMOTE")
        .env_remove("NITRO_CACHE_REMOTE_PREFIX")
        .env_remove("NITRO_CACHE_REMOTE_MODE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("the nitro binary runs");
    let run = Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(
        !run.stderr.contains("panicked"),
        "never a panic: {}",
        run.stderr
    );
    run
}

fn in_dir<'a>(command: &[&'a str], dir: &'a Path) -> Vec<&'a str> {
    let mut v = vec!["cache"];
    v.extend_from_slice(command);
    v.extend_from_slice(&["--dir", dir.to_str().unwrap()]);
    v
}

fn ls_json(dir: &Path) -> Value {
    let run = nitro(&in_dir(&["ls", "--json"], dir), &[]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    run.json()
}

fn keys(ls: &Value) -> Vec<String> {
    ls["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["key"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn ls_lists_every_compiled_program() {
    let tmp = TempDir::new("ls");
    fill(tmp.path(), None);
    let run = nitro(&in_dir(&["ls"], tmp.path()), &[]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("Probe::step"), "{}", run.stdout);
    assert!(run.stdout.contains("Probe::other"), "{}", run.stdout);
    assert!(run.stdout.contains("3 entries"), "{}", run.stdout);

    let ls = ls_json(tmp.path());
    assert_eq!(ls["count"], 3);
    let entries = ls["entries"].as_array().unwrap();
    // Most recently used first: OTHER was used last.
    assert!(entries[0]["meta"]["program"]
        .as_str()
        .unwrap()
        .ends_with("Probe::other"));
    for e in entries {
        assert!(run.stdout.contains(&e["key"].as_str().unwrap()[..12]));
        assert!(e["size_bytes"].as_u64().unwrap() > 0);
        assert!(e["meta"]["compile_ms"].as_f64().unwrap() >= 0.0);
        assert!(e["last_used"].as_u64().unwrap() > 0);
    }
    let total: u64 = entries
        .iter()
        .map(|e| e["size_bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(ls["total_bytes"], total);
}

#[test]
fn the_directory_comes_from_nitro_cache_dir_without_dir() {
    let tmp = TempDir::new("env-dir");
    fill(tmp.path(), None);
    let run = nitro(
        &["cache", "ls", "--json"],
        &[("NITRO_CACHE_DIR", tmp.path().to_str().unwrap())],
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.json()["count"], 3);
}

#[test]
fn explain_shows_the_key_components() {
    let tmp = TempDir::new("explain");
    fill(tmp.path(), None);

    // By program identity (its last `::` parts): both STEP entries, and the record of the
    // latest (k = 4) with the GraphConst field by name.
    let run = nitro(&in_dir(&["explain", "Probe::step"], tmp.path()), &[]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    for component in [
        "graph_const_fields",
        "k = ",
        "fingerprint",
        "backend_components",
        "nitro interpreter",
        "signature",
        "options",
    ] {
        assert!(
            run.stdout.contains(component),
            "`{component}` in:\n{}",
            run.stdout
        );
    }
    assert_eq!(run.stdout.matches("  entry ").count(), 2, "{}", run.stdout);

    // By key prefix: that one entry, and the record says whether it describes it.
    let ls = ls_json(tmp.path());
    let newest_step = ls["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["meta"]["program"].as_str().unwrap().ends_with("step"))
        .unwrap()
        .clone();
    let key = newest_step["key"].as_str().unwrap();
    let run = nitro(&in_dir(&["explain", &key[..10], "--json"], tmp.path()), &[]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let doc = run.json();
    let programs = doc["programs"].as_array().unwrap();
    assert_eq!(programs.len(), 1);
    assert_eq!(programs[0]["entries"].as_array().unwrap().len(), 1);
    assert_eq!(programs[0]["entries"][0]["key"], key);
    // The newest STEP entry is the program's latest compile: its record has its fingerprint.
    assert_eq!(
        programs[0]["record"]["fingerprint"],
        newest_step["meta"]["fingerprint"]
    );

    // Nothing matches: a clear message, exit status 1.
    let run = nitro(&in_dir(&["explain", "no_such_program"], tmp.path()), &[]);
    assert_eq!(run.code, 1);
    assert!(run.stderr.contains("nitro cache ls"), "{}", run.stderr);
}

/// Issue 40, item 6: two entries of one program (k = 3 and k = 4) each explain with their own
/// record — the older one's key components and cost are its own, not the program's latest.
#[test]
fn each_entry_of_a_program_explains_with_its_own_record() {
    let tmp = TempDir::new("explain-own");
    fill(tmp.path(), None);
    let ls = ls_json(tmp.path());
    let steps: Vec<&Value> = ls["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["meta"]["program"].as_str().unwrap().ends_with("step"))
        .collect();
    assert_eq!(steps.len(), 2);
    let mut digests = Vec::new();
    for entry in &steps {
        let key = entry["key"].as_str().unwrap();
        let run = nitro(&in_dir(&["explain", &key[..12], "--json"], tmp.path()), &[]);
        assert_eq!(run.code, 0, "{}", run.stderr);
        let doc = run.json();
        let listed = &doc["programs"][0]["entries"];
        assert_eq!(listed.as_array().unwrap().len(), 1);
        let record = &listed[0]["record"];
        // The entry's record is of this entry: its fingerprint and backend.
        assert_eq!(record["fingerprint"], entry["meta"]["fingerprint"], "{doc}");
        assert_eq!(record["backend"], entry["meta"]["backend"], "{doc}");
        digests.push(record["graph_const_fields"].clone());
        // The text shows this entry's components under it, never "not one of the entries".
        let run = nitro(&in_dir(&["explain", &key[..12]], tmp.path()), &[]);
        assert!(
            run.stdout.contains("key components of this entry"),
            "{}",
            run.stdout
        );
        assert!(
            !run.stdout.contains("not one of the entries"),
            "{}",
            run.stdout
        );
        let fingerprint = entry["meta"]["fingerprint"].as_str().unwrap();
        assert_eq!(run.stdout.matches(fingerprint).count(), 2, "{}", run.stdout);
        // --cost of this key: this entry's cost.
        let run = nitro(
            &in_dir(&["explain", "--cost", &key[..12], "--json"], tmp.path()),
            &[],
        );
        let doc = run.json();
        assert_eq!(doc["programs"][0]["entries"][0]["key"], key);
        assert!(doc["programs"][0]["cost"].is_object(), "{doc}");
    }
    // k = 3 and k = 4: the two records' GraphConst digests differ.
    assert_ne!(digests[0], digests[1]);
}

#[test]
fn gc_shrinks_to_the_bound_removing_least_recently_used_first() {
    let tmp = TempDir::new("gc");
    fill(tmp.path(), None);
    let before = ls_json(tmp.path());
    let total = before["total_bytes"].as_u64().unwrap();
    let oldest = keys(&before).pop().unwrap();
    let bound = total - 1;

    let run = nitro(
        &in_dir(
            &["gc", "--max-size", &bound.to_string(), "--json"],
            tmp.path(),
        ),
        &[],
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    let gc = run.json();
    assert_eq!(gc["gc"]["removed"].as_array().unwrap().len(), 1);
    assert_eq!(gc["gc"]["removed"][0]["key"], oldest.as_str());

    let after = ls_json(tmp.path());
    assert!(after["total_bytes"].as_u64().unwrap() <= bound);
    assert_eq!(after["count"], 2);
    assert!(!keys(&after).contains(&oldest));

    // A bound of 0 removes everything; text output says how much.
    let run = nitro(&in_dir(&["gc", "--max-size", "0K"], tmp.path()), &[]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("removed 2 entries"), "{}", run.stdout);
    assert_eq!(ls_json(tmp.path())["count"], 0);
}

#[test]
fn clear_empties_the_cache() {
    let tmp = TempDir::new("clear");
    fill(tmp.path(), None);
    assert!(fs::read_dir(tmp.path().join("programs")).unwrap().count() > 0);
    let run = nitro(&in_dir(&["clear", "--json"], tmp.path()), &[]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.json()["removed_entries"], 3);
    assert_eq!(ls_json(tmp.path())["count"], 0);
    assert_eq!(
        fs::read_dir(tmp.path().join("programs")).unwrap().count(),
        0
    );
    let run = nitro(&in_dir(&["ls"], tmp.path()), &[]);
    assert!(
        run.stdout.contains("no compiled programs"),
        "{}",
        run.stdout
    );
}

#[test]
fn verify_detects_a_corrupted_byte() {
    let tmp = TempDir::new("verify");
    fill(tmp.path(), None);
    let run = nitro(&in_dir(&["verify"], tmp.path()), &[]);
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("3 ok, 0 with problems"),
        "{}",
        run.stdout
    );

    let victim = entry_files(tmp.path()).remove(1);
    let mut bytes = fs::read(&victim).unwrap();
    let at = bytes.len() - 40;
    bytes[at] ^= 0x01;
    fs::write(&victim, bytes).unwrap();
    let key = victim.file_stem().unwrap().to_str().unwrap().to_owned();

    let run = nitro(&in_dir(&["verify", "--json"], tmp.path()), &[]);
    assert_eq!(run.code, 1, "a problem is exit status 1");
    let doc = run.json();
    assert_eq!(doc["problems"], 1);
    let bad: Vec<&Value> = doc["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| !e["problem"].is_null())
        .collect();
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0]["key"], key.as_str());
    assert_eq!(bad[0]["problem"]["kind"], "checksum");
    // Verifying removes nothing: the damaged entry is still there for a second look.
    assert!(victim.exists());
    let run = nitro(&in_dir(&["verify"], tmp.path()), &[]);
    assert!(
        run.stdout.contains(&format!("BAD  {}", &key[..12])),
        "{}",
        run.stdout
    );
}

#[test]
fn verify_checks_signatures_with_the_key() {
    let tmp = TempDir::new("signed");
    fill(tmp.path(), Some(KEY_A));
    let with = |key: &str| {
        nitro(
            &in_dir(&["verify", "--json"], tmp.path()),
            &[("NITRO_CACHE_KEY", key)],
        )
    };

    let right = with(KEY_A);
    assert_eq!(right.code, 0, "{}", right.stdout);
    assert_eq!(right.json()["signed"], true);
    assert_eq!(right.json()["ok"], 3);

    let wrong = with(KEY_B);
    assert_eq!(wrong.code, 1);
    let doc = wrong.json();
    assert_eq!(doc["problems"], 3);
    assert!(doc["entries"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["problem"]["kind"] == "signature"));

    let none = nitro(&in_dir(&["verify"], tmp.path()), &[]);
    assert_eq!(none.code, 1);
    assert!(none.stdout.contains("signed_no_key"), "{}", none.stdout);

    let bad_key = with("not-a-key");
    assert_eq!(bad_key.code, 2);
    assert_eq!(bad_key.json()["error"]["kind"], "invalid_setting");
}

#[test]
fn a_missing_directory_is_a_clear_error() {
    let tmp = TempDir::new("missing");
    for command in [
        &["ls"][..],
        &["explain", "x"],
        &["gc", "--max-size", "1M"],
        &["clear"],
        &["verify"],
    ] {
        let run = nitro(&in_dir(command, tmp.path()), &[]);
        assert_eq!(run.code, 2, "{command:?}");
        assert!(run.stderr.contains("does not exist"), "{}", run.stderr);
        assert!(run.stderr.contains("--dir"), "{}", run.stderr);
    }
    assert!(!tmp.path().exists(), "inspection creates nothing");
    let mut json = in_dir(&["ls"], tmp.path());
    json.push("--json");
    let run = nitro(&json, &[]);
    assert_eq!(run.code, 2);
    assert_eq!(run.json()["error"]["kind"], "missing_directory");
}

#[cfg(unix)]
#[test]
fn an_untrusted_directory_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = TempDir::new("untrusted");
    fill(tmp.path(), None);
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let run = nitro(&in_dir(&["ls"], tmp.path()), &[]);
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("writable by every user"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("chmod go-w"), "{}", run.stderr);
    let run = nitro(&in_dir(&["clear", "--json"], tmp.path()), &[]);
    assert_eq!(run.code, 2);
    assert_eq!(run.json()["error"]["kind"], "untrusted_directory");
    fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o700)).unwrap();
    assert_eq!(entry_files(tmp.path()).len(), 3, "nothing removed");
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// `push` uploads what the shared server lacks (once), `ls`/`explain --remote` show the server,
/// `pull` warms an empty directory (everything, or the entries of one program) with entries
/// that verify there; a read-only server, a missing key and a dead server are refused.
#[test]
fn push_and_pull_through_a_shared_server() {
    let Some(url) = common::redis_or_skip("push_and_pull_through_a_shared_server") else {
        return;
    };
    let ns = common::namespace("cli");
    let tmp = TempDir::new("push-pull");
    let a = tmp.path().join("a");
    fill(&a, Some(KEY_A));
    let local = sorted(keys(&ls_json(&a)));
    assert_eq!(local.len(), 3);
    let env = [
        ("NITRO_CACHE_KEY", KEY_A),
        ("NITRO_CACHE_REMOTE", url.as_str()),
        ("NITRO_CACHE_REMOTE_PREFIX", ns.as_str()),
    ];
    let copied = |doc: &Value, verb: &str| -> Vec<String> {
        doc[verb]["copied"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap().to_owned())
            .collect()
    };

    let push = nitro(&in_dir(&["push", "--json"], &a), &env);
    assert_eq!(push.code, 0, "{}{}", push.stdout, push.stderr);
    assert_eq!(sorted(copied(&push.json(), "pushed")), local);
    let again = nitro(&in_dir(&["push", "--json"], &a), &env);
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(again.json()["pushed"]["present"], 3);
    assert!(copied(&again.json(), "pushed").is_empty(), "nothing twice");

    // The server's listing and explanations, without any directory.
    let ls = nitro(&["cache", "ls", "--remote", "--json"], &env);
    assert_eq!(ls.code, 0, "{}", ls.stderr);
    assert_eq!(sorted(keys(&ls.json())), local);
    let text = nitro(&["cache", "ls", "--remote"], &env);
    assert!(text.stdout.contains("Probe::step"), "{}", text.stdout);
    let explain = nitro(
        &["cache", "explain", "Probe::step", "--remote", "--json"],
        &env,
    );
    assert_eq!(explain.code, 0, "{}", explain.stderr);
    assert_eq!(
        explain.json()["programs"][0]["entries"]
            .as_array()
            .unwrap()
            .len(),
        2
    );

    // Everything into a directory that does not exist yet; the entries verify there.
    let b = tmp.path().join("b");
    let pull = nitro(&in_dir(&["pull", "--json"], &b), &env);
    assert_eq!(pull.code, 0, "{}", pull.stderr);
    assert_eq!(sorted(copied(&pull.json(), "pulled")), local);
    assert_eq!(sorted(keys(&ls_json(&b))), local);
    let verify = nitro(&in_dir(&["verify"], &b), &[("NITRO_CACHE_KEY", KEY_A)]);
    assert_eq!(verify.code, 0, "{}", verify.stdout);
    // One program's entries only.
    let c = tmp.path().join("c");
    let pull = nitro(&in_dir(&["pull", "Probe::step", "--json"], &c), &env);
    assert_eq!(pull.code, 0, "{}", pull.stderr);
    assert_eq!(copied(&pull.json(), "pulled").len(), 2);
    assert_eq!(keys(&ls_json(&c)).len(), 2);

    // A query that matches nothing is a failure (exit 1, like `explain`), not a quiet success:
    // alone, nothing is pulled; beside one that matches, that one's entries still are.
    let d = tmp.path().join("d");
    let pull = nitro(&in_dir(&["pull", "Probe::nosuch", "--json"], &d), &env);
    assert_eq!(pull.code, 1, "{}{}", pull.stdout, pull.stderr);
    assert!(copied(&pull.json(), "pulled").is_empty());
    assert_eq!(pull.json()["pulled"]["unmatched"][0], "Probe::nosuch");
    assert!(
        pull.stderr.contains("`Probe::nosuch`") && pull.stderr.contains("nitro cache ls --remote"),
        "{}",
        pull.stderr
    );
    let pull = nitro(&in_dir(&["pull", "Probe::other", "ffff0000"], &d), &env);
    assert_eq!(pull.code, 1, "{}{}", pull.stdout, pull.stderr);
    assert!(
        pull.stdout.contains("no match for `ffff0000`"),
        "{}",
        pull.stdout
    );
    assert!(
        !pull.stdout.contains("`Probe::other`") && !pull.stderr.contains("`Probe::other`"),
        "only the unmatched query is named: {}{}",
        pull.stdout,
        pull.stderr
    );
    assert_eq!(keys(&ls_json(&d)).len(), 1, "Probe::other was pulled");
    // `push` takes no query: one is a usage error, never a push of everything.
    let push = nitro(&in_dir(&["push", "Probe::nosuch"], &a), &env);
    assert_eq!(push.code, 2, "{}{}", push.stdout, push.stderr);

    // Refusals: read-only push, no key, a server that does not answer.
    let mut ro = env.to_vec();
    ro.push(("NITRO_CACHE_REMOTE_MODE", "ro"));
    let run = nitro(&in_dir(&["push", "--json"], &a), &ro);
    assert_eq!(run.code, 2);
    assert_eq!(run.json()["error"]["kind"], "remote", "{}", run.stdout);
    let run = nitro(&in_dir(&["push", "--json"], &a), &env[1..]);
    assert_eq!(run.code, 2);
    assert_eq!(
        run.json()["error"]["kind"],
        "unsigned_remote",
        "{}",
        run.stdout
    );
    let dead = format!("redis+unix://{}/no.sock", tmp.path().display());
    let run = nitro(&["cache", "ls", "--remote", &dead, "--json"], &env);
    assert_eq!(run.code, 2);
    assert_eq!(
        run.json()["error"]["kind"],
        "remote_unreachable",
        "{}",
        run.stdout
    );
    let run = nitro(&["cache", "ls", "--remote", "--json"], &[]);
    assert_eq!(run.code, 2);
    assert_eq!(run.json()["error"]["kind"], "no_remote", "{}", run.stdout);
}

/// `pull --manifest` copies exactly a run's inventory from the shared server, and `check
/// --manifest` says which of its programs a directory (or, with `--remote`, the server) lacks.
#[test]
fn pull_and_check_an_inventory_manifest_through_a_shared_server() {
    let Some(url) = common::redis_or_skip("pull_and_check_an_inventory_manifest") else {
        return;
    };
    let ns = common::namespace("cli-manifest");
    let tmp = TempDir::new("manifest");
    let a = tmp.path().join("a");
    fill(&a, Some(KEY_A));
    let env = [
        ("NITRO_CACHE_KEY", KEY_A),
        ("NITRO_CACHE_REMOTE", url.as_str()),
        ("NITRO_CACHE_REMOTE_PREFIX", ns.as_str()),
    ];
    // A manifest of two of the three programs, as a run writes it.
    let ls = ls_json(&a);
    let mut manifest = nitro::cache::Manifest::new();
    for e in ls["entries"].as_array().unwrap().iter().take(2) {
        manifest.push(nitro::cache::ManifestEntry {
            role: "grad".into(),
            edge: None,
            program: e["meta"]["program"].as_str().unwrap().to_owned(),
            fingerprint: e["meta"]["fingerprint"].as_str().unwrap().to_owned(),
            key: e["key"].as_str().unwrap().to_owned(),
        });
    }
    let wanted = sorted(manifest.keys());
    let file = tmp.path().join("inventory.json");
    manifest.write(&file).unwrap();
    let m = file.to_str().unwrap();

    // Before the push the server lacks both; after it, has both.
    let check = nitro(
        &["cache", "check", "--manifest", m, "--remote", "--json"],
        &env,
    );
    assert_eq!(check.code, 1, "{}{}", check.stdout, check.stderr);
    assert_eq!(check.json()["missing"].as_array().unwrap().len(), 2);
    let push = nitro(&in_dir(&["push"], &a), &env);
    assert_eq!(push.code, 0, "{}", push.stderr);
    let check = nitro(&["cache", "check", "--manifest", m, "--remote"], &env);
    assert_eq!(check.code, 0, "{}{}", check.stdout, check.stderr);
    assert!(
        check.stdout.contains("2 of 2 programs present"),
        "{}",
        check.stdout
    );

    // Exactly the manifest's programs into an empty directory, and they verify there.
    let b = tmp.path().join("b");
    let pull = nitro(&in_dir(&["pull", "--manifest", m, "--json"], &b), &env);
    assert_eq!(pull.code, 0, "{}", pull.stderr);
    assert_eq!(
        sorted(keys(&ls_json(&b))),
        wanted,
        "the manifest's two, not the third"
    );
    let check = nitro(&in_dir(&["check", "--manifest", m, "--json"], &b), &env);
    assert_eq!(check.code, 0, "{}", check.stderr);
    assert_eq!(
        sorted(
            check.json()["present"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap().to_owned())
                .collect()
        ),
        wanted
    );
    // A directory with one of them: the other is named missing, exit status 1.
    let c = tmp.path().join("c");
    let pull = nitro(&in_dir(&["pull", wanted[0].as_str()], &c), &env);
    assert_eq!(pull.code, 0, "{}", pull.stderr);
    let check = nitro(&in_dir(&["check", "--manifest", m], &c), &env);
    assert_eq!(check.code, 1, "{}{}", check.stdout, check.stderr);
    assert!(
        check
            .stdout
            .contains(&format!("missing  {}", &wanted[1][..12])),
        "{}",
        check.stdout
    );
    // Not a manifest: refused, naming the file.
    let bad = tmp.path().join("bad.json");
    fs::write(&bad, "{\"programs\": 3}").unwrap();
    let run = nitro(
        &in_dir(&["check", "--manifest", bad.to_str().unwrap()], &c),
        &env,
    );
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
    assert!(
        run.stderr.contains("not a nitro inventory manifest"),
        "{}",
        run.stderr
    );
}

/// `check --manifest` of an empty manifest fails as `pull` does (it checked nothing), a
/// manifest's names are printed escaped (it is untrusted input), and a FIFO named as the
/// manifest is refused without blocking.
#[test]
fn check_refuses_an_empty_manifest_and_escapes_its_names() {
    let tmp = TempDir::new("manifest-hostile");
    let a = tmp.path().join("a");
    fill(&a, Some(KEY_A));
    let env = [("NITRO_CACHE_KEY", KEY_A)];
    let empty = tmp.path().join("empty.json");
    nitro::cache::Manifest::new().write(&empty).unwrap();
    for json in [false, true] {
        let mut args = vec!["check", "--manifest", empty.to_str().unwrap()];
        if json {
            args.push("--json");
        }
        let run = nitro(&in_dir(&args, &a), &env);
        assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
        if json {
            assert_eq!(
                run.json()["error"]["kind"],
                "empty_manifest",
                "{}",
                run.stdout
            );
        } else {
            assert!(run.stderr.contains("lists no programs"), "{}", run.stderr);
        }
    }

    let ls = ls_json(&a);
    let e = &ls["entries"][0];
    let mut manifest = nitro::cache::Manifest::new();
    manifest.push(nitro::cache::ManifestEntry {
        role: "grad\u{1b}[2J".into(),
        edge: None,
        program: "evil\u{1b}]0;title\u{7}\nfake line".into(),
        fingerprint: e["meta"]["fingerprint"].as_str().unwrap().to_owned(),
        key: e["key"].as_str().unwrap().to_owned(),
    });
    let file = tmp.path().join("evil.json");
    manifest.write(&file).unwrap();
    let run = nitro(
        &in_dir(&["check", "--manifest", file.to_str().unwrap()], &a),
        &env,
    );
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    assert!(
        !run.stdout.contains('\u{1b}') && !run.stdout.contains('\u{7}'),
        "{:?}",
        run.stdout
    );
    assert!(
        run.stdout.contains("evil\\u{1b}]0;title\\u{7}\\nfake line"),
        "{:?}",
        run.stdout
    );
    assert!(!run.stdout.contains("\nfake line"), "{:?}", run.stdout);

    #[cfg(unix)]
    {
        let fifo = tmp.path().join("pipe.json");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        let run = nitro(
            &in_dir(&["check", "--manifest", fifo.to_str().unwrap()], &a),
            &env,
        );
        assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
        assert!(run.stderr.contains("not a regular file"), "{}", run.stderr);
    }
}

#[experiment]
pub struct Baked {
    #[graph_const]
    pub table: Array,
    #[device]
    pub w: Array,
}

fn baked_step(v: &BakedView<'_>, x: &Tensor) -> Tensor {
    x.matmul(Tensor::constant(v.table.clone())) * v.w
}

const BAKED: nitro::program::Program<Baked, Tensor> = Baked::program("baked", baked_step);

#[test]
fn explain_cost_says_what_the_program_holds() {
    let tmp = TempDir::new("explain-cost");
    let store = Arc::new(DirStore::open(tmp.path(), 1 << 30, None).unwrap());
    let cache = Cache::new(8, Some(store));
    // 4 × 70 000 f32: 1.12 MB of constants, past the lint.
    let e = Baked {
        table: Array::full(&[4, 70_000], 0.25f32),
        w: Array::full(&[70_000], 2.0f32),
    };
    let x = Array::full(&[2, 4], 1.0f32);
    cache.get(backend::interpreter(), &BAKED, &e, &x).unwrap();

    let run = nitro(
        &in_dir(&["explain", "--cost", "Baked::baked"], tmp.path()),
        &[],
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    for want in [
        "ops ",
        "matmul 1",
        "1.1 MiB of constants",
        "constant   1.1 MiB f32[4,70000] from GraphConst field `table`",
        "time       trace ",
        "lint       ",
        "#[device] field",
    ] {
        assert!(run.stdout.contains(want), "`{want}` in:\n{}", run.stdout);
    }
    // Without --cost: the key components, and one line pointing at --cost.
    let run = nitro(&in_dir(&["explain", "Baked::baked"], tmp.path()), &[]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("graph_const_fields"), "{}", run.stdout);
    assert!(run.stdout.contains("explain --cost"), "{}", run.stdout);
    // As JSON: the cost's fields.
    let run = nitro(
        &in_dir(&["explain", "--cost", "Baked::baked", "--json"], tmp.path()),
        &[],
    );
    let doc = run.json();
    let cost = &doc["programs"][0]["cost"];
    assert_eq!(cost["constants"][0]["field"], "table");
    assert_eq!(cost["constants"][0]["bytes"], 4 * 70_000 * 4);
}
