//! The guide's prose names only flags and environment variables that exist: every `NITRO_…`
//! variable in `README.md` and `docs/*.md` is read somewhere in the workspace's code (or CI's
//! script), and every `--flag` is either another tool's (cargo, pip, redis-server; listed
//! below) or one that nitro's examples or its `nitro` command define.
#![allow(missing_docs)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// The guide's pages and the README.
fn pages() -> Vec<(String, String)> {
    let root = root();
    let mut out = vec![(
        "README.md".to_owned(),
        std::fs::read_to_string(root.join("README.md")).unwrap(),
    )];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    for p in docs {
        let name = format!("docs/{}", p.file_name().unwrap().to_string_lossy());
        out.push((name, std::fs::read_to_string(&p).unwrap()));
    }
    out
}

/// Every source file of the workspace that could read a variable or define a flag (not the
/// docs themselves, not build output).
fn sources() -> String {
    fn walk(dir: &Path, out: &mut String) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                if name != "target" && name != "docs" && !name.starts_with('.') {
                    walk(&p, out);
                }
            } else if ["rs", "sh", "py", "toml"]
                .iter()
                .any(|x| p.extension().is_some_and(|e| e == *x))
            {
                out.push_str(&std::fs::read_to_string(&p).unwrap_or_default());
                out.push('\n');
            }
        }
    }
    let root = root();
    let mut out = std::fs::read_to_string(root.join(".ci/run")).unwrap();
    for dir in ["runtime", "cli", "examples", "macros", "bench", "scripts"] {
        walk(&root.join(dir), &mut out);
    }
    // This file lists the other tools' flags; it must not vouch for the guide's.
    out.replace(include_str!("docs_claims.rs"), "")
}

/// Words made of `[A-Za-z0-9_-]` that start with `prefix` at a word boundary, with what
/// follows them (`*` marks a family: `NITRO_CACHE_REMOTE_*`).
fn tokens(text: &str, prefix: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
    let mut i = 0;
    while let Some(at) = text[i..].find(prefix) {
        let start = i + at;
        i = start + prefix.len();
        if start > 0 && word(bytes[start - 1]) {
            continue;
        }
        let mut end = i;
        while end < bytes.len() && word(bytes[end]) {
            end += 1;
        }
        if end == i {
            continue;
        }
        let family = bytes.get(end) == Some(&b'*') || text[start..end].ends_with('_');
        out.push((
            text[start..end].trim_end_matches(['_', '-']).to_owned(),
            family,
        ));
        i = end;
    }
    out
}

#[test]
fn every_environment_variable_the_guide_names_is_read_by_the_code() {
    let code = sources();
    let mut missing = BTreeSet::new();
    let mut seen = 0;
    for (page, text) in pages() {
        for (var, family) in tokens(&text, "NITRO_") {
            seen += 1;
            let found = if family {
                code.contains(&format!("\"{var}_")) || code.contains(&format!("{var}_"))
            } else {
                code.contains(&format!("\"{var}\"")) || code.contains(&format!("{var}="))
            };
            if !found {
                missing.insert(format!("{page}: {var}"));
            }
        }
    }
    assert!(
        seen > 20,
        "the scan found only {seen} variables: is it reading the docs?"
    );
    assert!(
        missing.is_empty(),
        "variables the guide names but no code reads: {missing:?}"
    );
}

/// Flags of the tools the guide's commands run, not nitro's.
const OTHER_TOOLS: &[&str] = &[
    // cargo
    "example",
    "release",
    "bin",
    "doc",
    "bench",
    "workspace",
    "all-targets",
    "no-deps",
    "path",
    "rename",
    "check",
    "help",
    "test",
    "no-run",
    "lib",
    "features",
    // pip
    "quiet",
    "disable-pip-version-check",
    // redis-server
    "port",
    "unixsocket",
    "unixsocketperm",
    "save",
    "appendonly",
    "maxmemory",
    "maxmemory-policy",
    "daemonize",
    "pidfile",
];

#[test]
fn every_flag_the_guide_names_is_defined() {
    let code = sources();
    let mut missing = BTreeSet::new();
    let mut seen = 0;
    for (page, text) in pages() {
        for (flag, _) in tokens(&text, "--") {
            let name = flag.trim_start_matches('-');
            if name.is_empty() || !name.as_bytes()[0].is_ascii_lowercase() {
                continue;
            }
            seen += 1;
            // XLA's own flags (`XLA_FLAGS=--xla_…`) are the plugin's.
            if OTHER_TOOLS.contains(&name) || name.starts_with("xla_") {
                continue;
            }
            // A literal flag, or a clap field (`train_rows` is `--train-rows`).
            let field = name.replace('-', "_");
            let defined = code.contains(&format!("\"--{name}\""))
                || code.contains(&format!("long = \"{name}\""))
                || code.contains(&format!("pub {field}:"))
                || code.contains(&format!("    {field}:"));
            if !defined {
                missing.insert(format!("{page}: --{name}"));
            }
        }
    }
    assert!(
        seen > 50,
        "the scan found only {seen} flags: is it reading the docs?"
    );
    assert!(
        missing.is_empty(),
        "flags the guide names that nothing defines: {missing:?}"
    );
}

#[test]
fn the_scan_sees_a_made_up_name() {
    // The checks above could pass by finding nothing: they must see a name that is not there.
    let code = sources();
    let page = "Set `NITRO_NO_SUCH_SETTING=1` and run with `--no-such-flag`.";
    let vars = tokens(page, "NITRO_");
    assert_eq!(vars, [("NITRO_NO_SUCH_SETTING".to_owned(), false)]);
    assert!(!code.contains("\"NITRO_NO_SUCH_SETTING\""));
    let flags = tokens(page, "--");
    assert_eq!(flags, [("--no-such-flag".to_owned(), false)]);
    assert!(!code.contains("\"--no-such-flag\""));
    assert!(!code.contains("pub no_such_flag:"));
}

#[test]
fn the_guide_adds_tracing_subscriber_as_the_examples_do() {
    // The examples build from the workspace's lock file with these features; the crate's
    // defaults add `tracing-log`, which the lock does not hold (an offline build fails).
    let manifest = std::fs::read_to_string(root().join("examples/Cargo.toml")).unwrap();
    let ours = manifest
        .lines()
        .find(|l| l.starts_with("tracing-subscriber ="))
        .expect("examples/Cargo.toml depends on tracing-subscriber")
        .trim();
    let mut seen = 0;
    for (page, text) in pages() {
        for (at, _) in text.match_indices("tracing-subscriber = ") {
            seen += 1;
            assert!(
                text[at..].starts_with(ours),
                "{page} adds tracing-subscriber otherwise than examples/Cargo.toml (`{ours}`)"
            );
        }
    }
    assert!(
        seen > 0,
        "the guide no longer shows how to add tracing-subscriber"
    );
}
