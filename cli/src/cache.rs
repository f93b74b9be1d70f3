//! The `nitro cache` commands: open the store, ask the library, print.

use std::fmt::Write as _;
use std::path::PathBuf;

use nitro::cache::{
    DirStore, EntrySummary, Explanation, Manifest, ProgramCost, RedisStore, RemoteConfig, Store,
    Transfer,
};
use serde_json::{json, Value};

use crate::text::{ago, bytes, compile_ms, render_lines};
use crate::{CacheArgs, CacheCommand, Failure, Report};

/// The environment variable holding the signing key (64 hex digits), as the library reads it.
const KEY_ENV: &str = "NITRO_CACHE_KEY";
/// The environment variable moving the cache directory, as the library reads it.
const DIR_ENV: &str = "NITRO_CACHE_DIR";

/// Runs one `cache` command.
pub(crate) fn run(args: &CacheArgs) -> Result<Report, Failure> {
    let key = signing_key()?;
    // `ls` and `explain` of the shared server need no directory.
    match (&args.command, args.remote.is_some()) {
        (CacheCommand::Ls, true) => {
            let remote = remote_store(args, key)?;
            return Ok(listing(&remote.list()?, remote.url()));
        }
        (CacheCommand::Explain { query, cost }, true) => {
            let remote = remote_store(args, key)?;
            return explained(remote.explain(query)?, remote.url(), query, *cost);
        }
        _ => {}
    }
    if let (CacheCommand::Check { manifest }, true) = (&args.command, args.remote.is_some()) {
        let remote = remote_store(args, key)?;
        return check(&read_manifest(manifest)?, &remote, remote.url());
    }
    let dir = directory(args)?;
    let dir_text = dir.display().to_string();
    if let CacheCommand::Pull { queries, manifest } = &args.command {
        // Pulling warms a store that may not exist yet.
        let remote = remote_store(args, key)?;
        let store = DirStore::open(&dir, nitro::cache::store::DEFAULT_CAPACITY_BYTES, key)?;
        let mut queries = queries.clone();
        if let Some(path) = manifest {
            queries.extend(read_manifest(path)?.keys());
        }
        let t = remote.pull_into(&store, &queries)?;
        let mut report = transfer("pulled", "from", remote.url(), "into", &dir_text, &t);
        if !t.unmatched.is_empty() {
            let named: Vec<String> = t.unmatched.iter().map(|q| format!("`{q}`")).collect();
            report.problem = Some(Failure::found(
                "no_match",
                format!(
                    "nothing on {} matches {} (a key, a key prefix of at least 4 hex digits, or \
                     a program identity), so nothing was pulled for it; `nitro cache ls \
                     --remote` lists what is there",
                    remote.url(),
                    named.join(", ")
                ),
            ));
        }
        return Ok(report);
    }
    let store = DirStore::open_existing(&dir, key)?;
    match &args.command {
        CacheCommand::Ls => Ok(ls(&store, &dir_text)),
        CacheCommand::Explain { query, cost } => explain(&store, &dir_text, query, *cost),
        CacheCommand::Push => {
            let remote = remote_store(args, key)?;
            let t = remote.push_from(&store)?;
            Ok(transfer(
                "pushed",
                "from",
                &dir_text,
                "to",
                remote.url(),
                &t,
            ))
        }
        CacheCommand::Pull { .. } => unreachable!("handled above"),
        CacheCommand::Check { manifest } => check(&read_manifest(manifest)?, &store, &dir_text),
        CacheCommand::Gc { max_size } => Ok(gc(&store, &dir_text, *max_size)),
        CacheCommand::Clear => clear(&store, &dir_text),
        CacheCommand::Verify => Ok(verify(&store, &dir_text, key.is_some())),
    }
}

/// `--dir`, else `NITRO_CACHE_DIR`, else the library's default.
fn directory(args: &CacheArgs) -> Result<PathBuf, Failure> {
    if let Some(d) = &args.dir {
        return Ok(d.clone());
    }
    if let Some(d) = std::env::var_os(DIR_ENV).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    nitro::cache::default_cache_dir().ok_or_else(|| {
        Failure::fatal(
            "missing_directory",
            format!(
                "no cache directory: there is no home directory to find the default one in; \
                 pass --dir or set {DIR_ENV}"
            ),
        )
    })
}

/// The shared server: `--remote URL`, else `NITRO_CACHE_REMOTE`, with the other
/// `NITRO_CACHE_REMOTE_*` settings; checked to answer.
fn remote_store(args: &CacheArgs, key: Option<[u8; 32]>) -> Result<RedisStore, Failure> {
    let url = args.remote.clone().filter(|u| !u.is_empty());
    let config = RemoteConfig::from_env_at(url)?.ok_or_else(|| {
        Failure::fatal(
            "no_remote",
            "no shared server: pass --remote URL (redis://host:port/db or \
             redis+unix:///path/to/socket) or set NITRO_CACHE_REMOTE",
        )
    })?;
    let store = RedisStore::open(config, key)?;
    if !store.ping() {
        return Err(Failure::fatal(
            "remote_unreachable",
            format!(
                "the shared server {} does not answer; check the address and that it runs",
                store.url()
            ),
        ));
    }
    Ok(store)
}

/// The signing key from `NITRO_CACHE_KEY`, when set.
fn signing_key() -> Result<Option<[u8; 32]>, Failure> {
    match std::env::var(KEY_ENV) {
        Ok(hex) if !hex.trim().is_empty() => hex
            .trim()
            .parse::<nitro::Digest>()
            .map(|d| Some(*d.as_bytes()))
            .map_err(|e| {
                Failure::fatal(
                    "invalid_setting",
                    format!(
                        "{KEY_ENV} is not a signing key ({e}); set it to the 64 hex digits the \
                         cache was signed with, or unset it"
                    ),
                )
            }),
        _ => Ok(None),
    }
}

/// One line per entry: short key, program, size, compile time, last use.
fn entry_lines(out: &mut String, entries: &[EntrySummary], now: u64) {
    let width = entries
        .iter()
        .map(|e| e.program().len())
        .max()
        .unwrap_or(0)
        .max("PROGRAM".len());
    let _ = writeln!(
        out,
        "{:<12}  {:<width$}  {:>10}  {:>10}  LAST USED",
        "KEY", "PROGRAM", "SIZE", "SAVES"
    );
    for e in entries {
        let _ = writeln!(
            out,
            "{:<12}  {:<width$}  {:>10}  {:>10}  {}",
            e.key.get(..12).unwrap_or(&e.key),
            e.program(),
            bytes(e.size_bytes),
            compile_ms(e.compile_ms()),
            ago(now, e.last_used)
        );
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn ls(store: &DirStore, dir: &str) -> Report {
    listing(&store.list(), dir)
}

/// `ls` of the entries of `place` (a directory or a server).
fn listing(entries: &[EntrySummary], dir: &str) -> Report {
    let total: u64 = entries.iter().map(|e| e.size_bytes).sum();
    let saved: f64 = entries.iter().filter_map(EntrySummary::compile_ms).sum();
    let mut text = String::new();
    if entries.is_empty() {
        let _ = writeln!(text, "no compiled programs in {dir}");
    } else {
        entry_lines(&mut text, entries, now());
        let _ = writeln!(
            text,
            "{} entries, {} in {dir}; a hit on each saves its compile time ({} in all)",
            entries.len(),
            bytes(total),
            compile_ms(Some(saved))
        );
    }
    Report {
        text,
        json: json!({
            "dir": dir,
            "count": entries.len(),
            "total_bytes": total,
            "compile_ms_saved_per_hit": saved,
            "entries": entries,
        }),
        problem: None,
    }
}

fn explain(store: &DirStore, dir: &str, query: &str, cost: bool) -> Result<Report, Failure> {
    explained(store.explain(query), dir, query, cost)
}

/// `explain`'s report of what `dir` (a directory or a server) holds for `query`.
fn explained(
    found: Vec<Explanation>,
    dir: &str,
    query: &str,
    cost: bool,
) -> Result<Report, Failure> {
    if found.is_empty() {
        return Err(Failure::found(
            "no_match",
            format!(
                "nothing in {dir} matches `{query}` (a key, a key prefix of at least 4 hex \
                 digits, or a program identity); `nitro cache ls` lists what is there"
            ),
        ));
    }
    let mut text = String::new();
    let now = now();
    for (i, x) in found.iter().enumerate() {
        if i > 0 {
            text.push('\n');
        }
        if cost {
            cost_text(&mut text, x);
        } else {
            explanation_text(&mut text, x, now);
        }
    }
    let json = if cost {
        let costs: Vec<Value> = found
            .iter()
            .map(|x| {
                let entries: Vec<Value> = x
                    .entries
                    .iter()
                    .map(|e| json!({ "key": e.key, "cost": entry_cost(x, e) }))
                    .collect();
                json!({ "program": x.program, "cost": recorded_cost(x), "entries": entries })
            })
            .collect();
        json!({ "dir": dir, "query": query, "programs": costs })
    } else {
        json!({ "dir": dir, "query": query, "programs": found })
    };
    Ok(Report {
        text,
        json,
        problem: None,
    })
}

/// The record that describes entry `e` of `x`: its own, else the program's latest-use record
/// when that record is of this entry (same fingerprint, backend and options) — never another
/// entry's.
fn entry_record<'a>(x: &'a Explanation, e: &'a EntrySummary) -> Option<&'a Value> {
    if let Some(own) = &e.record {
        return Some(own);
    }
    let (Some(Value::Object(fields)), Some(m)) = (&x.record, &e.meta) else {
        return None;
    };
    let same = |name: &str, v: String| fields.get(name) == Some(&Value::String(v));
    let mine = same("fingerprint", m.fingerprint.to_string())
        && same("backend", m.backend.to_string())
        && same("options", m.options.to_string());
    mine.then_some(x.record.as_ref()?)
}

/// The [`ProgramCost`] a record keeps (absent from records written before costs were kept).
fn cost_of(record: &Value) -> Option<ProgramCost> {
    serde_json::from_value(record.get("cost")?.clone()).ok()
}

/// Entry `e`'s [`ProgramCost`], from the record that describes it.
fn entry_cost(x: &Explanation, e: &EntrySummary) -> Option<ProgramCost> {
    cost_of(entry_record(x, e)?)
}

/// The cost `explain --cost` reports for `x`: its most recently used listed entry's that has
/// one, else (no entries listed) the program's latest use.
fn recorded_cost(x: &Explanation) -> Option<ProgramCost> {
    if x.entries.is_empty() {
        return cost_of(x.record.as_ref()?);
    }
    x.entries.iter().find_map(|e| entry_cost(x, e))
}

/// `explain --cost`: what each listed entry of the program holds, from its own record.
fn cost_text(out: &mut String, x: &Explanation) {
    let costs: Vec<(Option<&str>, Option<ProgramCost>)> = if x.entries.is_empty() {
        vec![(None, x.record.as_ref().and_then(cost_of))]
    } else {
        x.entries
            .iter()
            .map(|e| (Some(e.key.as_str()), entry_cost(x, e)))
            .collect()
    };
    for (key, cost) in costs {
        match (key, cost) {
            (Some(key), Some(cost)) => {
                let _ = writeln!(out, "entry {}:", key.get(..12).unwrap_or(key));
                let _ = write!(out, "{cost}");
            }
            (None, Some(cost)) => {
                let _ = write!(out, "{cost}");
            }
            (key, None) => {
                let which = key.map_or_else(String::new, |k| {
                    format!(", entry {}", k.get(..12).unwrap_or(k))
                });
                let _ = writeln!(
                    out,
                    "program {}{which}\n  no cost is recorded for it (its record predates \
                     per-entry records, or there is none): run the program once to record it",
                    x.program
                );
            }
        }
    }
}

/// The fields of a record, one per line (the cost summarised in one line).
fn record_fields_text(out: &mut String, record: &Value, indent: &str) {
    let Value::Object(fields) = record else {
        let _ = writeln!(out, "{indent}record: {record}");
        return;
    };
    let width = fields.keys().map(String::len).max().unwrap_or(0);
    for (name, value) in fields.iter().filter(|(name, _)| *name != "cost") {
        for (i, line) in render_lines(value).iter().enumerate() {
            let label = if i == 0 { name.as_str() } else { "" };
            let _ = writeln!(out, "{indent}{label:<width$}  {line}");
        }
    }
    if let Some(cost) = cost_of(record) {
        let _ = writeln!(
            out,
            "{indent}cost: {} ops, {} bytes of StableHLO, {} bytes of constants \
             (`nitro cache explain --cost` says more)",
            cost.ops, cost.hlo_bytes, cost.constant_bytes
        );
    }
}

fn explanation_text(out: &mut String, x: &Explanation, now: u64) {
    let _ = writeln!(out, "program {}", x.program);
    if x.entries.is_empty() {
        let _ = writeln!(out, "  no stored entries (evicted or cleared)");
    }
    for e in &x.entries {
        let _ = writeln!(
            out,
            "  entry {}: {}, compiled in {}, last used {}",
            e.key,
            bytes(e.size_bytes),
            compile_ms(e.compile_ms()),
            ago(now, e.last_used)
        );
        match &e.meta {
            Some(m) => {
                let _ = writeln!(out, "    fingerprint  {}", m.fingerprint);
                let _ = writeln!(out, "    backend      {}", m.backend);
                let _ = writeln!(out, "                 ({})", m.backend_description);
                let _ = writeln!(out, "    options      {}", m.options);
                let _ = writeln!(out, "    created      {}", ago(now, m.created));
            }
            None => {
                let _ = writeln!(
                    out,
                    "    metadata unreadable (`nitro cache verify` says why)"
                );
            }
        }
        match entry_record(x, e) {
            Some(record) => {
                let _ = writeln!(out, "    key components of this entry:");
                record_fields_text(out, record, "      ");
            }
            None => {
                let _ = writeln!(
                    out,
                    "    no record of this entry's key components is kept (it predates \
                     per-entry records; its next compile or load writes one)"
                );
            }
        }
    }
    // A program without listed entries (evicted or cleared) still says what its latest use was.
    if x.entries.is_empty() {
        match &x.record {
            Some(record) => {
                let _ = writeln!(
                    out,
                    "  key components at the program's latest compile or load (no longer stored):"
                );
                record_fields_text(out, record, "    ");
            }
            None => {
                let _ = writeln!(out, "  no record of its key components is kept");
            }
        }
    }
}

fn gc(store: &DirStore, dir: &str, max_bytes: u64) -> Report {
    let report = store.gc(max_bytes);
    let mut text = String::new();
    let _ = writeln!(
        text,
        "removed {} entries ({}); {dir} holds {} (bound {})",
        report.removed.len(),
        bytes(report.before_bytes.saturating_sub(report.after_bytes)),
        bytes(report.after_bytes),
        bytes(max_bytes)
    );
    if !report.removed.is_empty() {
        entry_lines(&mut text, &report.removed, now());
    }
    Report {
        text,
        json: json!({ "dir": dir, "gc": report }),
        problem: None,
    }
}

fn clear(store: &DirStore, dir: &str) -> Result<Report, Failure> {
    let before = store.list();
    let total: u64 = before.iter().map(|e| e.size_bytes).sum();
    store.clear()?;
    let left = store.list().len();
    let mut text = String::new();
    let _ = writeln!(
        text,
        "removed {} entries ({}) and the program records from {dir}",
        before.len() - left.min(before.len()),
        bytes(total)
    );
    let problem = (left > 0).then(|| {
        Failure::found(
            "not_cleared",
            format!("{left} entries could not be removed from {dir}; check its permissions"),
        )
    });
    Ok(Report {
        text,
        json: json!({
            "dir": dir,
            "removed_entries": before.len() - left.min(before.len()),
            "removed_bytes": total,
            "left_entries": left,
        }),
        problem,
    })
}

fn verify(store: &DirStore, dir: &str, signed: bool) -> Report {
    let checked = store.verify_all();
    let bad = checked.iter().filter(|v| v.problem.is_some()).count();
    let what = if signed {
        format!("signatures (with {KEY_ENV})")
    } else {
        format!("checksums (no {KEY_ENV} set)")
    };
    let mut text = String::new();
    for v in &checked {
        let program = v.program.as_deref().unwrap_or("?");
        let short = v.key.get(..12).unwrap_or(&v.key);
        match &v.problem {
            None => {
                let _ = writeln!(text, "ok   {short}  {program}");
            }
            Some(why) => {
                let _ = writeln!(text, "BAD  {short}  {program}: {why}");
            }
        }
    }
    let _ = writeln!(
        text,
        "{} entries in {dir}, {what} checked: {} ok, {bad} with problems",
        checked.len(),
        checked.len() - bad
    );
    let problem = (bad > 0).then(|| {
        Failure::found(
            "verify_failed",
            format!(
                "{bad} of {} entries would be rejected by a lookup (and rebuilt by the next \
                 compile); `nitro cache clear` removes everything, and a wrong or missing {KEY_ENV} \
                 shows as `signature` or `signed_no_key`",
                checked.len()
            ),
        )
    });
    Report {
        text,
        json: json!({
            "dir": dir,
            "signed": signed,
            "checked": checked.len(),
            "ok": checked.len() - bad,
            "problems": bad,
            "entries": checked,
        }),
        problem,
    }
}

/// The report of a push or a pull: `verb` entries `from_word` `from` `to_word` `to`.
fn transfer(
    verb: &str,
    from_word: &str,
    from: &str,
    to_word: &str,
    to: &str,
    t: &Transfer,
) -> Report {
    let mut text = String::new();
    for (key, why) in &t.skipped {
        let _ = writeln!(text, "skipped {}: {why}", key.get(..12).unwrap_or(key));
    }
    for query in &t.unmatched {
        let _ = writeln!(text, "no match for `{query}`");
    }
    let _ = writeln!(
        text,
        "{verb} {} entries ({}) {from_word} {from} {to_word} {to}; {} already there, {} skipped",
        t.copied.len(),
        bytes(t.bytes),
        t.present,
        t.skipped.len()
    );
    Report {
        text,
        json: json!({ "from": from, "to": to, verb: t }),
        problem: None,
    }
}

/// The manifest at `path` for `pull` and `check`: one that lists no programs is refused by both
/// (there is nothing to pull, and "0 of 0 present" would pass a check of nothing).
fn read_manifest(path: &std::path::Path) -> Result<Manifest, Failure> {
    let m = Manifest::read(path)?;
    if m.programs.is_empty() {
        return Err(Failure::fatal(
            "empty_manifest",
            format!(
                "the manifest {} lists no programs, so there is nothing to pull or check (write \
                 it after the run has prepared its programs; pull without --manifest copies \
                 everything)",
                path.display()
            ),
        ));
    }
    Ok(m)
}

/// `check --manifest`: which of the manifest's programs `store` (at `place`) lacks. The
/// manifest is untrusted input: its names are printed escaped (no control characters reach the
/// terminal).
fn check(manifest: &Manifest, store: &dyn Store, place: &str) -> Result<Report, Failure> {
    let mut text = String::new();
    let mut missing = Vec::new();
    let mut present = Vec::new();
    for p in &manifest.programs {
        let key: nitro::hash::Digest = p.key.parse().map_err(|_| {
            Failure::fatal("bad_manifest", format!("`{}` is not a store key", p.key))
        })?;
        let edge = p.edge.map_or_else(String::new, |e| format!(" [{e}]"));
        let (word, list) = if store.contains(&key) {
            ("present", &mut present)
        } else {
            ("missing", &mut missing)
        };
        list.push(&p.key);
        let _ = writeln!(
            text,
            "{word}  {}  {}{edge}  {}",
            &p.key[..12],
            p.role.escape_debug(),
            p.program.escape_debug()
        );
    }
    let _ = writeln!(
        text,
        "{} of {} programs present in {place}; {} missing",
        present.len(),
        manifest.programs.len(),
        missing.len()
    );
    let problem = (!missing.is_empty()).then(|| {
        Failure::found(
            "missing",
            format!(
                "{} program(s) of the manifest are not in {place}: a run would compile them \
                 (`nitro cache pull --manifest FILE` copies them from the shared server)",
                missing.len()
            ),
        )
    });
    Ok(Report {
        text,
        json: json!({ "in": place, "present": present, "missing": missing }),
        problem,
    })
}
