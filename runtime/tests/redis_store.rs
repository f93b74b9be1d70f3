//! The shared compile cache on a real `redis-server` (never a mock): layering, one compile per
//! fleet across processes, a compiler killed with its lease held, a server stopped and
//! restarted, corrupt, foreign-signed and evicted entries, read-only mode, the size limit, and
//! the refusal to share unsigned entries.
//!
//! The server comes from `NITRO_TEST_REDIS` (a `redis+unix://…` or `redis://…` URL; `.ci/run`
//! starts one). Without it each test prints a `skip:` line, unless `NITRO_REQUIRE_REDIS=1`,
//! where it fails. The restart and eviction tests start private servers of their own
//! (`redis-server` on `PATH`), so they never disturb the shared one. Every test uses its own
//! key namespace. Programs run on the interpreter, whose compile is instant; a wrapping backend
//! that sleeps (or hangs) in `compile` makes compiles overlap across processes.
#![allow(missing_docs)]

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::probe::{Probe, OTHER, STEP};
use common::TempDir;
use nitro::backend::{self, Backend, Executable, Identity};
use nitro::cache::{
    Cache, DirStore, LayeredStore, MissReason, Outcome, RedisStore, RemoteConfig, RemoteMode, Store,
};
use nitro::prelude::*;
use nitro::program::Program;
use nitro::trace::Graph;
use nitro::Error;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

const KEY: [u8; 32] = [7; 32];
const OTHER_KEY: [u8; 32] = [9; 32];
const GIB: u64 = 1 << 30;

/// The shared server's URL and a fresh namespace tagged `tag` for `test`, or `None` after a
/// `skip:` line.
fn shared_or_skip(test: &str, tag: &str) -> Option<(String, String)> {
    common::redis_or_skip(test).map(|url| (url, common::namespace(tag)))
}

fn config(url: &str, ns: &str) -> RemoteConfig {
    let mut c = RemoteConfig::new(url);
    c.prefix = ns.to_owned();
    // Generous: a loaded CI machine must not turn a slow answer into a fault (faults are
    // tested with a server that is down, not slow).
    c.timeout = Duration::from_secs(10);
    c.lease = Duration::from_millis(1000);
    c.retry_after = Duration::from_millis(100);
    c
}

fn layered(config: RemoteConfig, local: &Path, key: [u8; 32]) -> Arc<LayeredStore> {
    let remote = RedisStore::open(config, Some(key)).expect("the shared store opens");
    let local = DirStore::open(local, GIB, Some(key)).expect("the local store opens");
    Arc::new(LayeredStore::new(local, remote).expect("same keys"))
}

/// A cache on a fresh local directory in front of the server (what a fresh machine has).
fn machine(config: RemoteConfig, local: &TempDir) -> (Cache, Arc<LayeredStore>) {
    let store = layered(config, local.path(), KEY);
    (Cache::new(16, Some(store.clone())), store)
}

/// A direct connection, to inspect and damage what the server holds.
fn client(url: &str) -> redis::Connection {
    redis::Client::open(url)
        .unwrap()
        .get_connection_with_timeout(Duration::from_secs(5))
        .expect("the test server answers")
}

fn keys(url: &str, pattern: &str) -> Vec<String> {
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg(pattern)
        .query(&mut client(url))
        .unwrap();
    keys.sort();
    keys
}

/// The programs every test runs: four variants of STEP (the GraphConst `k` is baked into each)
/// and OTHER, five distinct stored entries, with the value each computes for `x = 2`,
/// `w = 0.5`.
fn programs() -> Vec<(&'static Program<Probe, Tensor>, u32, f32)> {
    let t = 1.0f32.tanh();
    vec![
        (&STEP, 1, t),
        (&STEP, 2, 2.0 * t),
        (&STEP, 3, 3.0 * t),
        (&STEP, 4, 4.0 * t),
        (&OTHER, 1, 2.5),
    ]
}

/// Looks up and runs program `i` of [`programs`], checking its result (never a wrong
/// program); returns what the lookup did.
fn run(cache: &Cache, backend: &dyn Backend, i: usize) -> Outcome {
    let (program, k, expected) = programs()[i];
    let e = Probe {
        k,
        w: Array::full(&[4], 0.5f32),
    };
    let x = Array::full(&[4], 2.0f32);
    let served = cache
        .get(backend, program, &e, &x)
        .expect("a lookup never fails");
    let out = served.executable.run(&[&e.w, &x]).unwrap();
    let got = out[0].as_slice::<f32>().unwrap();
    assert!(
        got.iter().all(|v| (v - expected).abs() < 1e-5),
        "program {i}: expected {expected}, got {got:?}"
    );
    served.outcome
}

fn loaded(o: &Outcome) -> bool {
    matches!(o, Outcome::Loaded { .. })
}

fn compiled(o: &Outcome) -> bool {
    matches!(o, Outcome::Compiled { .. })
}

/// The interpreter, slowed down (or hung) in `compile`, with the interpreter's identity so its
/// entries are the interpreter's. Announces each compile by creating `marker`.
#[derive(Debug)]
struct Slow {
    delay: Duration,
    marker: Option<PathBuf>,
}

impl Backend for Slow {
    fn identity(&self) -> &Identity {
        backend::interpreter().identity()
    }

    fn persistent(&self) -> bool {
        true
    }

    fn compile(&self, graph: &Graph, text: &str) -> nitro::Result<Box<dyn Executable>> {
        if let Some(marker) = &self.marker {
            fs::write(marker, b"compiling").unwrap();
        }
        std::thread::sleep(self.delay);
        backend::interpreter().compile(graph, text)
    }

    fn load(&self, payload: &[u8], graph: &Graph) -> nitro::Result<Box<dyn Executable>> {
        backend::interpreter().load(payload, graph)
    }
}

/// Waits (bounded: a stuck child fails the test rather than hanging it) until `path` exists.
fn wait_for_file(path: &Path, child: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !path.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the child exited ({status}) before creating {}",
                path.display()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// This test binary, running only the (ignored) child test `name`.
fn child(name: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        name,
        "--exact",
        "--ignored",
        "--test-threads=1",
        "--nocapture",
    ]);
    cmd
}

/// A private `redis-server` on a unix socket in its own directory, killed on drop.
struct Server {
    dir: TempDir,
    child: Option<Child>,
    extra: Vec<String>,
}

impl Server {
    fn start(tag: &str, extra: &[&str]) -> Server {
        let dir = TempDir::new(tag);
        fs::create_dir_all(dir.path()).unwrap();
        let mut server = Server {
            dir,
            child: None,
            extra: extra.iter().map(|s| (*s).to_owned()).collect(),
        };
        server.restart();
        server
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }

    fn url(&self) -> String {
        format!("redis+unix://{}", self.socket().display())
    }

    /// Starts it (again), and waits until it answers.
    fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", "0", "--unixsocket"])
            .arg(self.socket())
            .args([
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(&self.extra)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server is on PATH (NITRO_TEST_REDIS is set, so it must be)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let up = redis::Client::open(self.url())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c));
            if up.is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the private redis-server never answered"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends it `SIG<name>` (`STOP`, `CONT`).
    fn signal(&self, name: &str) {
        let pid = self.child.as_ref().expect("running").id();
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(pid.to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{name} {pid}");
    }

    /// Kills it (SIGKILL: no goodbye to clients).
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------------------------------------
// Trust and configuration
// ---------------------------------------------------------------------------------------------

#[test]
fn a_shared_store_without_a_signing_key_is_refused() {
    // No server needed: the refusal comes before any connection.
    let err = RedisStore::open(RemoteConfig::new("redis://127.0.0.1:1/0"), None).unwrap_err();
    assert!(matches!(err, Error::RemoteUnsigned { .. }), "{err}");
    assert!(err.to_string().contains("NITRO_CACHE_KEY"), "{err}");
    let err = RedisStore::open(RemoteConfig::new("ftp://nowhere"), Some(KEY)).unwrap_err();
    assert!(matches!(err, Error::RemoteCache { .. }), "{err}");

    // A local store in front must sign with the same key.
    let tmp = TempDir::new("layer-keys");
    let remote = RedisStore::open(RemoteConfig::new("redis://127.0.0.1:1/0"), Some(KEY)).unwrap();
    for local_key in [None, Some(OTHER_KEY)] {
        let local = DirStore::open(tmp.path(), GIB, local_key).unwrap();
        let err = LayeredStore::new(local, remote.clone()).unwrap_err();
        assert!(matches!(err, Error::RemoteCache { .. }), "{err}");
    }

    // Through the environment: the process-wide cache's settings (in a child process, whose
    // environment this test owns).
    let tmp = TempDir::new("env");
    let cases: [(&[(&str, &str)], &str); 5] = [
        (&[], "RemoteUnsigned"),
        (&[("NITRO_CACHE_KEY", &"07".repeat(32))], "LayeredStore"),
        (
            &[
                ("NITRO_CACHE_KEY", &"07".repeat(32)),
                ("NITRO_CACHE_REMOTE_MODE", "ro"),
            ],
            "ReadOnly",
        ),
        (
            &[
                ("NITRO_CACHE_KEY", &"07".repeat(32)),
                ("NITRO_CACHE_REMOTE_MODE", "sometimes"),
            ],
            "NITRO_CACHE_REMOTE_MODE",
        ),
        (
            &[
                ("NITRO_CACHE_KEY", &"07".repeat(32)),
                ("NITRO_CACHE_REMOTE_TIMEOUT_MS", "soon"),
            ],
            "NITRO_CACHE_REMOTE_TIMEOUT_MS",
        ),
    ];
    for (env, expected) in cases {
        let mut cmd = child("env_child");
        cmd.env_remove("NITRO_CACHE_KEY")
            .env_remove("NITRO_CACHE_REMOTE_MODE")
            .env("NITRO_CACHE", "on")
            .env("NITRO_CACHE_DIR", tmp.path())
            .env("NITRO_CACHE_REMOTE", "redis://127.0.0.1:1/0")
            .env("NITRO_TEST_ENV_CHILD", "1");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}");
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("STORE ").map(|(_, r)| r))
            .unwrap_or_else(|| panic!("no STORE line: {stdout}"));
        assert!(
            line.contains(expected),
            "{env:?}: expected {expected} in {line}"
        );
    }
}

#[test]
#[ignore = "run as a child process by a_shared_store_without_a_signing_key_is_refused"]
fn env_child() {
    if std::env::var_os("NITRO_TEST_ENV_CHILD").is_none() {
        return;
    }
    match nitro::cache::default_store() {
        Ok(store) => println!("STORE {store:?}"),
        Err(e) => println!("STORE {e:?}: {e}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Layering
// ---------------------------------------------------------------------------------------------

#[test]
fn a_remote_hit_is_copied_into_the_local_store() {
    let Some((url, ns)) = shared_or_skip("a_remote_hit_is_copied_into_the_local_store", "layering")
    else {
        return;
    };
    let interp = backend::interpreter();

    // Machine A compiles everything: written to its local store and uploaded.
    let dir_a = TempDir::new("layer-a");
    let (a, store_a) = machine(config(&url, &ns), &dir_a);
    for i in 0..programs().len() {
        assert!(compiled(&run(&a, interp, i)));
    }
    let sa = a.stats().remote.expect("remote stats");
    assert_eq!((sa.uploads, sa.hits, sa.errors), (5, 0, 0), "{sa:?}");
    assert!(sa.bytes_up > 0);
    assert_eq!(keys(&url, &format!("{ns}:entry:*")).len(), 5);
    assert!(
        keys(&url, &format!("{ns}:lock:*")).is_empty(),
        "leases released"
    );
    assert_eq!(
        store_a.local().size_bytes(),
        sa.bytes_up,
        "the same bytes on disk"
    );

    // Machine B, empty locally: every program is loaded from the server, none compiled…
    let dir_b = TempDir::new("layer-b");
    let (b, _) = machine(config(&url, &ns), &dir_b);
    for i in 0..programs().len() {
        assert!(loaded(&run(&b, interp, i)));
    }
    let sb = b.stats();
    assert_eq!(sb.compiles, 0);
    let rb = sb.remote.unwrap();
    assert_eq!((rb.hits, rb.uploads, rb.errors), (5, 0, 0), "{rb:?}");
    assert_eq!(rb.bytes_down, sa.bytes_up);

    // …and copied into its local store: a later process on B needs no server at all.
    let local_only = Cache::new(
        16,
        Some(Arc::new(
            DirStore::open(dir_b.path(), GIB, Some(KEY)).unwrap(),
        )),
    );
    for i in 0..programs().len() {
        assert!(loaded(&run(&local_only, interp, i)));
    }
    // And through the layered store, a second process on B asks the server nothing.
    let (b2, _) = machine(config(&url, &ns), &dir_b);
    for i in 0..programs().len() {
        assert!(loaded(&run(&b2, interp, i)));
    }
    let r2 = b2.stats().remote.unwrap();
    assert_eq!((r2.hits, r2.misses, r2.bytes_down), (0, 0, 0), "{r2:?}");
}

// ---------------------------------------------------------------------------------------------
// One compile per fleet
// ---------------------------------------------------------------------------------------------

#[test]
fn four_processes_compile_each_program_once() {
    let Some((url, ns)) = shared_or_skip("four_processes_compile_each_program_once", "fleet")
    else {
        return;
    };
    let work = TempDir::new("fleet");
    fs::create_dir_all(work.path()).unwrap();
    let go = work.path().join("go");
    let mut children: Vec<Child> = (0..4)
        .map(|i| {
            child("fleet_child")
                .env("NITRO_TEST_FLEET", &url)
                .env("NITRO_TEST_NS", &ns)
                .env("NITRO_TEST_LOCAL", work.path().join(format!("local-{i}")))
                .env("NITRO_TEST_GO", &go)
                .env("NITRO_TEST_READY", work.path().join(format!("ready-{i}")))
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // All four miss at once: released together once all are ready.
    for (i, c) in children.iter_mut().enumerate() {
        wait_for_file(&work.path().join(format!("ready-{i}")), c);
    }
    fs::write(&go, b"go").unwrap();
    let mut compiles = vec![0u64; programs().len()];
    let mut waits = 0;
    for c in children.drain(..) {
        let out = c.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "a child failed: {stdout}");
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("FLEET ").map(|(_, r)| r))
            .unwrap_or_else(|| panic!("no FLEET line: {stdout}"));
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        for (i, n) in compiles.iter_mut().enumerate() {
            let outcome = r["outcomes"][i].as_str().unwrap();
            assert!(outcome == "compiled" || outcome == "loaded", "{line}");
            *n += u64::from(outcome == "compiled");
        }
        assert_eq!(r["errors"], 0, "{line}");
        waits += r["lease_waits"].as_u64().unwrap();
    }
    assert_eq!(
        compiles,
        vec![1; programs().len()],
        "each program compiled exactly once across the four processes"
    );
    assert!(waits > 0, "the others waited on the compiling one's lease");
    assert_eq!(keys(&url, &format!("{ns}:entry:*")).len(), programs().len());
    assert!(
        keys(&url, &format!("{ns}:lock:*")).is_empty(),
        "leases released"
    );
}

#[test]
#[ignore = "run as a child process by four_processes_compile_each_program_once"]
fn fleet_child() {
    let Ok(url) = std::env::var("NITRO_TEST_FLEET") else {
        return;
    };
    let var = |v: &str| std::env::var(v).unwrap();
    let local = PathBuf::from(var("NITRO_TEST_LOCAL"));
    let store = layered(config(&url, &var("NITRO_TEST_NS")), &local, KEY);
    let cache = Cache::new(16, Some(store));
    // Compiles take long enough that the four processes overlap on each program.
    let slow = Slow {
        delay: Duration::from_millis(300),
        marker: None,
    };
    fs::write(var("NITRO_TEST_READY"), b"ready").unwrap();
    let go = PathBuf::from(var("NITRO_TEST_GO"));
    while !go.exists() {
        std::thread::sleep(Duration::from_millis(2));
    }
    let outcomes: Vec<&str> = (0..programs().len())
        .map(|i| match run(&cache, &slow, i) {
            Outcome::Compiled { .. } => "compiled",
            Outcome::Loaded { .. } => "loaded",
            Outcome::Hit => "hit",
        })
        .collect();
    let r = cache.stats().remote.unwrap();
    println!(
        "FLEET {}",
        serde_json::json!({
            "outcomes": outcomes,
            "errors": r.errors,
            "lease_waits": r.lease_waits,
        })
    );
}

#[test]
fn a_killed_compiler_lets_its_lease_expire() {
    let Some((url, ns)) = shared_or_skip("a_killed_compiler_lets_its_lease_expire", "kill") else {
        return;
    };
    let work = TempDir::new("kill");
    fs::create_dir_all(work.path()).unwrap();
    let marker = work.path().join("compiling");
    // The child takes the lease of program 0 and hangs in its compile.
    let mut hung = child("hung_child")
        .env("NITRO_TEST_HUNG", &url)
        .env("NITRO_TEST_NS", &ns)
        .env("NITRO_TEST_LOCAL", work.path().join("local-hung"))
        .env("NITRO_TEST_MARKER", &marker)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_file(&marker, &mut hung);
    assert_eq!(
        keys(&url, &format!("{ns}:lock:*")).len(),
        1,
        "the child holds the lease"
    );
    hung.kill().unwrap(); // SIGKILL: no cleanup, no release.
    hung.wait().unwrap();
    assert!(
        keys(&url, &format!("{ns}:entry:*")).is_empty(),
        "the killed process wrote nothing"
    );

    // Another machine needs the program: it waits for the dead holder's lease to expire, then
    // compiles it itself.
    let dir = TempDir::new("kill-survivor");
    let (survivor, _) = machine(config(&url, &ns), &dir);
    assert!(compiled(&run(&survivor, backend::interpreter(), 0)));
    let r = survivor.stats().remote.unwrap();
    assert_eq!((r.lease_waits, r.uploads, r.errors), (1, 1, 0), "{r:?}");
    assert!(keys(&url, &format!("{ns}:lock:*")).is_empty());

    // What it uploaded is whole: a third machine loads it.
    let dir = TempDir::new("kill-third");
    let (third, _) = machine(config(&url, &ns), &dir);
    assert!(loaded(&run(&third, backend::interpreter(), 0)));
    assert_eq!(third.stats().remote.unwrap().hits, 1);
}

#[test]
#[ignore = "run as a child process by a_killed_compiler_lets_its_lease_expire"]
fn hung_child() {
    let Ok(url) = std::env::var("NITRO_TEST_HUNG") else {
        return;
    };
    let var = |v: &str| std::env::var(v).unwrap();
    let store = layered(
        config(&url, &var("NITRO_TEST_NS")),
        Path::new(&var("NITRO_TEST_LOCAL")),
        KEY,
    );
    let cache = Cache::new(16, Some(store));
    let hang = Slow {
        delay: Duration::from_secs(600),
        marker: Some(PathBuf::from(var("NITRO_TEST_MARKER"))),
    };
    run(&cache, &hang, 0);
    unreachable!("killed while compiling");
}

/// The server keys (`entry:…`) of programs 0 and 1 of [`programs`], in that order, learnt by
/// compiling them in a namespace of their own (a key does not depend on the namespace).
fn entry_keys_of_two_programs(url: &str) -> [String; 2] {
    let ns = common::namespace("keys");
    let dir = TempDir::new("keys");
    let (cache, _) = machine(config(url, &ns), &dir);
    let mut seen: Vec<String> = Vec::new();
    for i in 0..2 {
        assert!(compiled(&run(&cache, backend::interpreter(), i)));
        let new = keys(url, &format!("{ns}:entry:*"))
            .into_iter()
            .find(|k| !seen.contains(k))
            .expect("each compile uploads one entry");
        seen.push(new);
    }
    let prefix = format!("{ns}:entry:");
    [0, 1].map(|i| seen[i].strip_prefix(&prefix).unwrap().to_owned())
}

#[test]
fn a_lease_without_an_expiry_or_outlasting_the_lease_is_taken_not_waited_for() {
    let Some((url, ns)) = shared_or_skip(
        "a_lease_without_an_expiry_or_outlasting_the_lease_is_taken_not_waited_for",
        "stale",
    ) else {
        return;
    };
    let [k0, k1] = entry_keys_of_two_programs(&url);
    // Left by a crashed or foreign writer: program 0's lease has no expiry, program 1's would
    // last an hour (this store's lease is 1 s). Waited for, each would hold every machine for
    // the whole compile wait (120 s).
    let (lock0, lock1) = (format!("{ns}:lock:{k0}"), format!("{ns}:lock:{k1}"));
    let mut c = client(&url);
    let _: () = redis::cmd("SET")
        .arg(&lock0)
        .arg("crashed-writer")
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg(&lock1)
        .arg("foreign-writer")
        .arg("PX")
        .arg(3_600_000)
        .query(&mut c)
        .unwrap();

    let dir = TempDir::new("stale");
    let (cache, _) = machine(config(&url, &ns), &dir);
    let started = Instant::now();
    assert!(compiled(&run(&cache, backend::interpreter(), 0)));
    assert!(compiled(&run(&cache, backend::interpreter(), 1)));
    let r = cache.stats().remote.unwrap();
    // Removed and taken, never waited for: compiled here, uploaded, released.
    assert_eq!(
        (r.stale_leases, r.lease_waits, r.uploads, r.errors),
        (2, 0, 2, 0),
        "{r:?}"
    );
    assert!(
        keys(&url, &format!("{ns}:lock:*")).is_empty(),
        "the stale leases are gone, and this process's released"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "well under the compile wait: {:?}",
        started.elapsed()
    );
    // What it uploaded serves the next machine.
    let dir = TempDir::new("stale-next");
    let (next, _) = machine(config(&url, &ns), &dir);
    assert!(loaded(&run(&next, backend::interpreter(), 0)));

    // A live lease (with an expiry within the lease) is still waited for: only stale ones are
    // removed. A read-only process does not wait for a stale one either, and removes nothing.
    let ns_ro = common::namespace("stale-ro");
    let lock_ro = format!("{ns_ro}:lock:{k0}");
    let _: () = redis::cmd("SET")
        .arg(&lock_ro)
        .arg("crashed-writer")
        .query(&mut c)
        .unwrap();
    let mut ro = config(&url, &ns_ro);
    ro.mode = RemoteMode::ReadOnly;
    let dir = TempDir::new("stale-ro");
    let (reader, _) = machine(ro, &dir);
    assert!(compiled(&run(&reader, backend::interpreter(), 0)));
    let r = reader.stats().remote.unwrap();
    assert_eq!(
        (r.stale_leases, r.lease_waits, r.uploads),
        (1, 0, 0),
        "{r:?}"
    );
    assert_eq!(
        keys(&url, &format!("{ns_ro}:lock:*")),
        vec![lock_ro.clone()],
        "read-only: left in place"
    );
    let _: u64 = redis::cmd("DEL").arg(&lock_ro).query(&mut c).unwrap();
}

#[test]
fn a_live_lease_is_never_taken_as_stale() {
    let Some((url, ns)) = shared_or_skip("a_live_lease_is_never_taken_as_stale", "live") else {
        return;
    };
    let [k0, _] = entry_keys_of_two_programs(&url);
    // Another holder's lease of 4 s, within this store's lease (30 s): waited for until it
    // expires, never removed.
    let lock0 = format!("{ns}:lock:{k0}");
    let _: () = redis::cmd("SET")
        .arg(&lock0)
        .arg("live-holder")
        .arg("PX")
        .arg(4000)
        .query(&mut client(&url))
        .unwrap();
    let mut long = config(&url, &ns);
    long.lease = Duration::from_secs(30);
    let dir = TempDir::new("live");
    let (cache, _) = machine(long, &dir);
    assert!(compiled(&run(&cache, backend::interpreter(), 0)));
    let r = cache.stats().remote.unwrap();
    assert_eq!(
        (r.stale_leases, r.lease_waits, r.uploads),
        (0, 1, 1),
        "{r:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Faults
// ---------------------------------------------------------------------------------------------

#[test]
fn a_server_stopped_and_restarted_mid_run() {
    if common::redis_or_skip("a_server_stopped_and_restarted_mid_run").is_none() {
        return;
    }
    let mut server = Server::start("restart", &[]);
    let url = server.url();
    let ns = common::namespace("restart");
    let interp = backend::interpreter();
    let dir = TempDir::new("restart-a");
    let (a, store_a) = machine(config(&url, &ns), &dir);
    assert!(compiled(&run(&a, interp, 0)));
    assert_eq!(a.stats().remote.unwrap().uploads, 1);

    server.stop();
    // The run continues: new programs compile locally, held ones are served locally.
    assert!(compiled(&run(&a, interp, 1)));
    assert!(compiled(&run(&a, interp, 2)));
    let during = a.stats().remote.unwrap();
    assert!(during.errors >= 1, "{during:?}");
    assert_eq!(during.uploads, 1, "{during:?}");
    // A fresh machine without its server compiles too.
    let dir_b = TempDir::new("restart-b");
    let (b, _) = machine(config(&url, &ns), &dir_b);
    assert!(compiled(&run(&b, interp, 0)));

    server.restart();
    // Back (after the retry pause): the remote is used again. The bound only keeps a broken
    // test from hanging.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !store_a.remote().ping() {
        assert!(Instant::now() < deadline, "the store never reconnected");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(compiled(&run(&a, interp, 3)));
    assert_eq!(a.stats().remote.unwrap().uploads, 2, "uploads resumed");
    let dir_c = TempDir::new("restart-c");
    let (c, _) = machine(config(&url, &ns), &dir_c);
    assert!(
        loaded(&run(&c, interp, 3)),
        "served by the restarted server"
    );
    assert_eq!(c.stats().remote.unwrap().hits, 1);
}

#[test]
fn an_unreachable_server_never_fails_a_run() {
    // Nothing listens on this socket: every request fails at once.
    let tmp = TempDir::new("nowhere");
    let url = format!("redis+unix://{}/none.sock", tmp.path().display());
    let dir = TempDir::new("nowhere-local");
    let (cache, _) = machine(config(&url, "nowhere"), &dir);
    for i in 0..programs().len() {
        assert!(compiled(&run(&cache, backend::interpreter(), i)));
    }
    let r = cache.stats().remote.unwrap();
    assert!(r.errors >= 1 && r.uploads == 0 && r.hits == 0, "{r:?}");
    // The local store still works: a second process loads everything from it.
    let (again, _) = machine(config(&url, "nowhere"), &dir);
    for i in 0..programs().len() {
        assert!(loaded(&run(&again, backend::interpreter(), i)));
    }
}

/// A real unix socket that accepts connections and never answers (a hung server, or one that
/// is not Redis), listening for the rest of the test process; its `redis+unix://` URL.
fn silent_server(dir: &TempDir) -> String {
    fs::create_dir_all(dir.path()).unwrap();
    let path = dir.path().join("silent.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            match conn {
                Ok(c) => held.push(c), // read nothing, write nothing
                Err(_) => return,
            }
        }
    });
    format!("redis+unix://{}", path.display())
}

#[track_caller]
fn names_the_timeout(message: &str, ms: u64) {
    assert!(
        message.contains(&format!("timed out after {ms} ms"))
            && message.contains("NITRO_CACHE_REMOTE_TIMEOUT_MS"),
        "the timeout and its setting are named: {message}"
    );
    assert!(
        !message.contains("os error 11") && !message.contains("temporarily unavailable"),
        "not the operating system's words for it: {message}"
    );
}

#[test]
fn a_server_that_does_not_answer_reports_its_timeout() {
    // No Redis server needed: a socket that accepts and stays silent.
    let tmp = TempDir::new("silent");
    let url = silent_server(&tmp);
    let mut c = config(&url, "silent");
    c.timeout = Duration::from_millis(200);
    let store = RedisStore::open(c, Some(KEY)).unwrap();
    let err = store.get(&nitro::Digest::of("anything")).unwrap_err();
    assert!(matches!(err, Error::RemoteCache { .. }), "{err}");
    names_the_timeout(&err.to_string(), 200);
    assert_eq!(store.stats().errors, 1);

    // The one-time notice on stderr says it too (in a child process, whose stderr this test
    // reads), and the run goes on with a local compile.
    let out = child("silent_child")
        .env("NITRO_TEST_SILENT", &url)
        .env("NITRO_TEST_LOCAL", tmp.path().join("local"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("SILENT compiled"), "{stdout}");
    let notices: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("the shared compile cache failed"))
        .collect();
    assert_eq!(notices.len(), 1, "said once: {stderr}");
    names_the_timeout(notices[0], 200);

    // A real server that stops answering mid-run (SIGSTOP) times out on a command of an open
    // connection the same way.
    if common::redis_or_skip("a_server_that_does_not_answer_reports_its_timeout").is_none() {
        return;
    }
    let server = Server::start("stopped", &[]);
    let mut c = config(&server.url(), "stopped");
    c.timeout = Duration::from_millis(300);
    let store = RedisStore::open(c, Some(KEY)).unwrap();
    assert!(store.ping(), "connected");
    server.signal("STOP");
    let err = store.get(&nitro::Digest::of("anything")).unwrap_err();
    server.signal("CONT");
    names_the_timeout(&err.to_string(), 300);
}

#[test]
#[ignore = "run as a child process by a_server_that_does_not_answer_reports_its_timeout"]
fn silent_child() {
    let Ok(url) = std::env::var("NITRO_TEST_SILENT") else {
        return;
    };
    let mut c = config(&url, "silent");
    c.timeout = Duration::from_millis(200);
    let local = PathBuf::from(std::env::var("NITRO_TEST_LOCAL").unwrap());
    let store = layered(c, &local, KEY);
    let cache = Cache::new(16, Some(store));
    for i in 0..2 {
        assert!(compiled(&run(&cache, backend::interpreter(), i)));
    }
    println!("SILENT compiled");
}

#[test]
fn a_corrupt_remote_entry_is_rejected_rebuilt_and_reuploaded() {
    let Some((url, ns)) = shared_or_skip(
        "a_corrupt_remote_entry_is_rejected_rebuilt_and_reuploaded",
        "corrupt",
    ) else {
        return;
    };
    let interp = backend::interpreter();
    let dir = TempDir::new("corrupt-a");
    let (a, _) = machine(config(&url, &ns), &dir);
    assert!(compiled(&run(&a, interp, 0)));
    let entry_key = keys(&url, &format!("{ns}:entry:*")).pop().unwrap();
    let good: Vec<u8> = redis::cmd("GET")
        .arg(&entry_key)
        .query(&mut client(&url))
        .unwrap();
    // Overwrite bytes in the middle of the payload.
    let _: u64 = redis::cmd("SETRANGE")
        .arg(&entry_key)
        .arg(good.len() / 2)
        .arg(&b"XXXXXXXX"[..])
        .query(&mut client(&url))
        .unwrap();

    let dir = TempDir::new("corrupt-b");
    let (b, _) = machine(config(&url, &ns), &dir);
    let outcome = run(&b, interp, 0);
    assert_eq!(
        outcome,
        Outcome::Compiled {
            reason: MissReason::StoreRejected {
                why: "signature".into()
            }
        }
    );
    let stats = b.stats();
    assert_eq!(stats.store_rejected, 1);
    let r = stats.remote.unwrap();
    assert_eq!((r.rejected, r.uploads), (1, 1), "{r:?}");
    // Rebuilt and re-uploaded: a third machine loads it.
    let dir = TempDir::new("corrupt-c");
    let (c, _) = machine(config(&url, &ns), &dir);
    assert!(loaded(&run(&c, interp, 0)));

    // Truncated too.
    let _: () = redis::cmd("SET")
        .arg(&entry_key)
        .arg(&good[..good.len() - 40])
        .query(&mut client(&url))
        .unwrap();
    let dir = TempDir::new("corrupt-d");
    let (d, _) = machine(config(&url, &ns), &dir);
    assert!(compiled(&run(&d, interp, 0)));
    assert_eq!(d.stats().remote.unwrap().rejected, 1);
}

#[test]
fn an_entry_signed_with_another_key_is_rejected_rebuilt_and_reuploaded() {
    let Some((url, ns)) = shared_or_skip(
        "an_entry_signed_with_another_key_is_rejected_rebuilt_and_reuploaded",
        "foreign-key",
    ) else {
        return;
    };
    let interp = backend::interpreter();
    // Another fleet (another key) writes to the same namespace.
    let dir = TempDir::new("foreign-a");
    let intruder = Cache::new(16, Some(layered(config(&url, &ns), dir.path(), OTHER_KEY)));
    assert!(compiled(&run(&intruder, interp, 0)));

    let dir = TempDir::new("foreign-b");
    let (b, _) = machine(config(&url, &ns), &dir);
    assert_eq!(
        run(&b, interp, 0),
        Outcome::Compiled {
            reason: MissReason::StoreRejected {
                why: "signature".into()
            }
        }
    );
    let r = b.stats().remote.unwrap();
    assert_eq!((r.rejected, r.uploads), (1, 1), "{r:?}");
    let dir = TempDir::new("foreign-c");
    let (c, _) = machine(config(&url, &ns), &dir);
    assert!(loaded(&run(&c, interp, 0)), "the re-uploaded entry is ours");
    // The bare shared store says the same.
    let bare = RedisStore::open(config(&url, &ns), Some(OTHER_KEY)).unwrap();
    let key = keys(&url, &format!("{ns}:entry:*")).pop().unwrap();
    let digest: Digest = key.rsplit(':').next().unwrap().parse().unwrap();
    match bare.get(&digest).unwrap() {
        nitro::cache::Lookup::Rejected(why) => assert_eq!(why.kind.name(), "signature"),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[test]
fn an_entry_evicted_by_the_server_is_rebuilt_and_reuploaded() {
    if common::redis_or_skip("an_entry_evicted_by_the_server_is_rebuilt_and_reuploaded").is_none() {
        return;
    }
    // A private server with a small memory bound, so filling it evicts for real.
    let server = Server::start(
        "evict",
        &["--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru"],
    );
    let url = server.url();
    let ns = common::namespace("evict");
    let interp = backend::interpreter();
    let dir = TempDir::new("evict-a");
    let (a, _) = machine(config(&url, &ns), &dir);
    assert!(compiled(&run(&a, interp, 0)));
    let entry_key = keys(&url, &format!("{ns}:entry:*")).pop().unwrap();
    let mut conn = client(&url);
    let filler = vec![0u8; 32 * 1024];
    let mut evicted = false;
    for i in 0..2000 {
        let _: () = redis::cmd("SET")
            .arg(format!("filler:{i}"))
            .arg(&filler)
            .query(&mut conn)
            .unwrap();
        if !redis::cmd("EXISTS")
            .arg(&entry_key)
            .query::<bool>(&mut conn)
            .unwrap()
        {
            evicted = true;
            break;
        }
    }
    assert!(evicted, "the server never evicted the entry");
    let info: String = redis::cmd("INFO").arg("stats").query(&mut conn).unwrap();
    assert!(!info.contains("evicted_keys:0\r"), "{info}");

    let dir = TempDir::new("evict-b");
    let (b, _) = machine(config(&url, &ns), &dir);
    assert_eq!(
        run(&b, interp, 0),
        Outcome::Compiled {
            reason: MissReason::Empty
        }
    );
    let r = b.stats().remote.unwrap();
    assert_eq!((r.misses, r.uploads, r.errors), (1, 1, 0), "{r:?}");
    assert!(redis::cmd("EXISTS")
        .arg(&entry_key)
        .query::<bool>(&mut conn)
        .unwrap());
}

// ---------------------------------------------------------------------------------------------
// Read-only mode and bounds
// ---------------------------------------------------------------------------------------------

#[test]
fn read_only_mode_never_writes() {
    let Some((url, ns)) = shared_or_skip("read_only_mode_never_writes", "ro") else {
        return;
    };
    let interp = backend::interpreter();
    let dir = TempDir::new("ro-writer");
    let (writer, _) = machine(config(&url, &ns), &dir);
    assert!(compiled(&run(&writer, interp, 0)));
    let snapshot = |url: &str| -> Vec<(String, Vec<u8>)> {
        keys(url, &format!("{ns}:*"))
            .into_iter()
            .map(|k| {
                let v = redis::cmd("GET").arg(&k).query(&mut client(url)).unwrap();
                (k, v)
            })
            .collect()
    };
    let before = snapshot(&url);
    assert_eq!(before.len(), 1);

    let mut ro = config(&url, &ns);
    ro.mode = RemoteMode::ReadOnly;
    let dir = TempDir::new("ro-reader");
    let (reader, store) = machine(ro, &dir);
    assert!(store.remote().read_only());
    assert!(loaded(&run(&reader, interp, 0)), "reads the shared entries");
    for i in 1..programs().len() {
        assert!(compiled(&run(&reader, interp, i)), "compiles the others");
    }
    let r = reader.stats().remote.unwrap();
    assert_eq!(
        (r.hits, r.uploads, r.bytes_up, r.errors),
        (1, 0, 0, 0),
        "{r:?}"
    );
    assert_eq!(snapshot(&url), before, "the server is untouched");
    let err = store.remote().clear().unwrap_err();
    assert!(matches!(err, Error::RemoteCache { .. }), "{err}");
    assert_eq!(snapshot(&url), before);
}

#[test]
fn entries_over_the_size_limit_are_not_shared() {
    let Some((url, ns)) = shared_or_skip("entries_over_the_size_limit_are_not_shared", "size")
    else {
        return;
    };
    let interp = backend::interpreter();
    let mut small = config(&url, &ns);
    small.max_entry_bytes = 64;
    let dir = TempDir::new("size-a");
    let (a, _) = machine(small.clone(), &dir);
    assert!(compiled(&run(&a, interp, 0)));
    let r = a.stats().remote.unwrap();
    assert_eq!((r.too_large, r.uploads), (1, 0), "{r:?}");
    assert!(keys(&url, &format!("{ns}:entry:*")).is_empty());

    // One uploaded under a larger limit is refused, unread past the limit, by a small one.
    let dir = TempDir::new("size-b");
    let (b, _) = machine(config(&url, &ns), &dir);
    assert!(compiled(&run(&b, interp, 0)));
    let dir = TempDir::new("size-c");
    let (c, _) = machine(small, &dir);
    assert_eq!(
        run(&c, interp, 0),
        Outcome::Compiled {
            reason: MissReason::StoreRejected {
                why: "malformed".into()
            }
        }
    );
    let r = c.stats().remote.unwrap();
    assert_eq!((r.rejected, r.bytes_down), (1, 65), "{r:?}");
}

#[test]
fn clearing_a_layered_store_leaves_the_server_alone() {
    let Some((url, ns)) =
        shared_or_skip("clearing_a_layered_store_leaves_the_server_alone", "clear")
    else {
        return;
    };
    let dir = TempDir::new("clear-a");
    let (a, store) = machine(config(&url, &ns), &dir);
    assert!(compiled(&run(&a, backend::interpreter(), 0)));
    a.reset().unwrap();
    assert_eq!(store.local().size_bytes(), 0);
    assert_eq!(keys(&url, &format!("{ns}:entry:*")).len(), 1);
    assert!(
        loaded(&run(&a, backend::interpreter(), 0)),
        "from the server"
    );
    // The shared store's own clear empties its namespace, and only it.
    store.remote().clear().unwrap();
    assert!(keys(&url, &format!("{ns}:*")).is_empty());
}
