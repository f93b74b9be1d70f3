//! What a shared compile cache saves: the digits programs (the training step, and validation)
//! in a fresh process, three ways:
//!
//! - **cold**: empty local store, empty server — every program compiles (and is uploaded);
//! - **local**: the local store that run filled, no server — every program loads from disk;
//! - **remote**: the server that run filled, an empty local store (a new machine) — every
//!   program is fetched, verified, copied into the local store, and loaded.
//!
//! Each measurement is a fresh process (this example, run again with a role) training one epoch
//! with validation; the example prints the median of `--reps` rounds (default 3), each round in
//! its own key namespace and local directories, and ends with one JSON line.
//!
//! It needs a server: `NITRO_CACHE_REMOTE=redis+unix:///path/to/redis.sock` (or
//! `redis://host:port/db`; see `docs/sharing.md` for starting one). Without it, it prints a
//! `skip:` line and exits. `NITRO_CACHE_KEY` signs the entries (a throwaway key is made when it
//! is unset); the namespaces it creates are removed at the end.
//!
//! `NITRO_CACHE_REMOTE=… cargo run --release -p nitro-examples --example remote_warm [-- --reps N]`

use std::process::Command;
use std::time::Instant;

use nitro::cache::{RedisStore, RemoteConfig, Store};
use nitro::optim::Adam;
use nitro::train::{Config, Nitro};
use nitro_examples::{data, DigitsMlp};

/// The role of a measuring child process.
const CHILD: &str = "NITRO_REMOTE_WARM_CHILD";

/// One epoch of the digits MLP in this process; prints what getting its programs cost.
fn child() -> Result<(), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let data = data::Digits::load(data::DIGITS_PATH)?;
    let split = data.split(0.8, 1)?;
    let exp = DigitsMlp::tanh(128, data);
    let config = Config::new().batch(32).lr(3e-3).epochs(1).progress(false);
    let mut run = Nitro::new(exp, Adam::default(), config)?;
    run.fit(&split.train, Some(&split.validation))?;
    let stats = nitro::cache::cache_stats();
    let remote = stats.remote.clone().unwrap_or_default();
    println!(
        "CHILD {}",
        serde_json::json!({
            "programs_ms": run.compile_time().as_secs_f64() * 1e3,
            "first_step_ms": run.first_step_time().map_or(0.0, |d| d.as_secs_f64() * 1e3),
            "process_ms": started.elapsed().as_secs_f64() * 1e3,
            "compiles": stats.compiles,
            "loads": stats.l2_hits,
            "remote_hits": remote.hits,
            "remote_bytes_down": remote.bytes_down,
            "remote_bytes_up": remote.bytes_up,
            "remote_errors": remote.errors,
        })
    );
    Ok(())
}

/// Runs one measuring child with `local` as its local store and, when given, the server under
/// `namespace`.
fn measure(
    local: &std::path::Path,
    remote: Option<(&str, &str)>,
    key: &str,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.env(CHILD, "1")
        .env("NITRO_CACHE", "on")
        .env("NITRO_CACHE_DIR", local)
        .env("NITRO_CACHE_KEY", key)
        .env_remove("NITRO_CACHE_REMOTE_MODE");
    match remote {
        Some((url, namespace)) => {
            cmd.env("NITRO_CACHE_REMOTE", url)
                .env("NITRO_CACHE_REMOTE_PREFIX", namespace);
        }
        None => {
            cmd.env_remove("NITRO_CACHE_REMOTE");
        }
    }
    let out = cmd.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "a measuring process failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("CHILD "))
        .ok_or("a measuring process printed no result")?;
    Ok(serde_json::from_str(line)?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let mut reps = 3usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--reps" => reps = args.next().ok_or("--reps needs a number")?.parse()?,
            "--help" | "-h" => {
                println!(
                    "What a shared compile cache saves: the digits programs in a fresh process, \
                     cold, from the local store and from the server. Needs NITRO_CACHE_REMOTE \
                     (docs/sharing.md); ends with one JSON line.\n\n\
                     Usage: remote_warm [--reps N]   (rounds, default 3)"
                );
                return Ok(());
            }
            other => return Err(format!("unknown argument `{other}`; try --reps N").into()),
        }
    }
    let Some(url) = std::env::var("NITRO_CACHE_REMOTE")
        .ok()
        .filter(|u| !u.trim().is_empty())
    else {
        println!(
            "skip: remote_warm: set NITRO_CACHE_REMOTE to a Redis server (see docs/sharing.md)"
        );
        return Ok(());
    };
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let key = std::env::var("NITRO_CACHE_KEY")
        .ok()
        .filter(|k| !k.trim().is_empty())
        .unwrap_or_else(|| nitro::Digest::of(format!("remote_warm {stamp}").as_str()).to_string());
    let root = std::env::temp_dir().join(format!("nitro-remote-warm-{}", std::process::id()));

    let mut rows: Vec<[serde_json::Value; 3]> = Vec::new();
    let mut namespaces = Vec::new();
    for rep in 0..reps {
        let namespace = format!("nitro-remote-warm-{stamp}-{rep}");
        let machine_a = root.join(format!("{rep}-a"));
        let machine_b = root.join(format!("{rep}-b"));
        let cold = measure(&machine_a, Some((&url, &namespace)), &key)?;
        let local = measure(&machine_a, None, &key)?;
        let remote = measure(&machine_b, Some((&url, &namespace)), &key)?;
        namespaces.push(namespace);
        rows.push([cold, local, remote]);
    }
    let _ = std::fs::remove_dir_all(&root);
    for namespace in namespaces {
        let mut config = RemoteConfig::new(url.as_str());
        config.prefix = namespace;
        let key_bytes = *key.trim().parse::<nitro::Digest>()?.as_bytes();
        RedisStore::open(config, Some(key_bytes))?.clear()?;
    }

    let figure = |i: usize, field: &str| {
        median(
            rows.iter()
                .map(|r| r[i][field].as_f64().unwrap_or(f64::NAN))
                .collect(),
        )
    };
    let last = rows.last().ok_or("--reps must be at least 1")?;
    println!("digits programs in a fresh process (median of {reps}):");
    println!(
        "{:<34} {:>12} {:>14} {:>12} {:>9} {:>7} {:>12}",
        "", "programs ms", "first step ms", "process ms", "compiles", "loads", "remote hits"
    );
    let names = [
        "cold compile",
        "warm local store",
        "warm remote, empty local store",
    ];
    for (i, name) in names.iter().enumerate() {
        println!(
            "{:<34} {:>12.1} {:>14.1} {:>12.1} {:>9} {:>7} {:>12}",
            name,
            figure(i, "programs_ms"),
            figure(i, "first_step_ms"),
            figure(i, "process_ms"),
            last[i]["compiles"].as_u64().unwrap_or(0),
            last[i]["loads"].as_u64().unwrap_or(0),
            last[i]["remote_hits"].as_u64().unwrap_or(0),
        );
    }
    let backend = nitro::backend::current()?;
    let scenario = |i: usize| {
        serde_json::json!({
            "programs_ms": figure(i, "programs_ms"),
            "first_step_ms": figure(i, "first_step_ms"),
            "process_ms": figure(i, "process_ms"),
            "compiles": last[i]["compiles"],
            "loads": last[i]["loads"],
            "remote_hits": last[i]["remote_hits"],
            "remote_bytes_down": last[i]["remote_bytes_down"],
            "remote_bytes_up": last[i]["remote_bytes_up"],
            "remote_errors": last[i]["remote_errors"],
        })
    };
    println!(
        "{}",
        serde_json::json!({
            "example": "remote_warm",
            "backend": if backend.device().is_some() { "xla" } else { "interp" },
            "reps": reps,
            "cold": scenario(0),
            "local": scenario(1),
            "remote": scenario(2),
        })
    );
    Ok(())
}
