//! `nitro`: command-line tools for nitro. Today, the compile cache:
//!
//! ```text
//! nitro cache ls                     # program, size, compile time a hit saves, last use
//! nitro cache explain KEY|PROGRAM    # what a stored program's key is made of
//! nitro cache explain --cost KEY     # why its compile costs what it does: ops, constants, repeats
//! nitro cache gc --max-size 500M     # drop least-recently-used entries down to a bound
//! nitro cache clear                  # drop everything
//! nitro cache verify                 # checksums, or signatures with NITRO_CACHE_KEY
//! nitro cache push                   # upload local entries the shared server lacks
//! nitro cache pull [QUERY...]        # copy entries from the shared server (all, or named)
//! nitro cache pull --manifest FILE   # copy exactly a run's inventory (its manifest)
//! nitro cache check --manifest FILE  # which of a run's programs the directory (or --remote) lacks
//! nitro cache ls --remote            # `ls` and `explain` of the shared server
//! ```
//!
//! The shared server is `NITRO_CACHE_REMOTE` (with its `NITRO_CACHE_REMOTE_*` settings), or
//! `--remote URL`; it needs the signing key in `NITRO_CACHE_KEY`.
//!
//! The directory is the one the library uses (`NITRO_CACHE_DIR`, else the platform's cache
//! directory), or `--dir`. Every command takes `--json` (one JSON document on stdout). The
//! library owns the store's format ([`nitro::cache::DirStore`]); this crate only prints.
//!
//! Exit status: 0 on success; 1 when `verify` finds a problem, `explain` or a query of `pull`
//! matches nothing, or `check` finds a program missing; 2 when the command could not run (a missing or untrusted directory, a bad
//! setting, a usage error).

mod cache;
mod text;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// nitro's command-line tools.
#[derive(Debug, Parser)]
#[command(name = "nitro", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Inspect and maintain the compile cache (the persistent level, L2).
    Cache(CacheArgs),
}

/// Options every `cache` command takes.
#[derive(Debug, Args)]
struct CacheArgs {
    /// The cache directory [default: NITRO_CACHE_DIR, else `nitro` in the platform's cache
    /// directory, as the library uses].
    #[arg(long, global = true, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Print one JSON document on stdout instead of text (errors too).
    #[arg(long, global = true)]
    json: bool,
    /// The shared server (`redis://host:port/db` or `redis+unix:///path/to/socket`) for `push`
    /// and `pull`, and the one `ls` and `explain` show instead of the directory
    /// [default: NITRO_CACHE_REMOTE].
    #[arg(long, global = true, value_name = "URL", num_args = 0..=1, default_missing_value = "")]
    remote: Option<String>,
    #[command(subcommand)]
    command: CacheCommand,
}

#[derive(Debug, Subcommand)]
enum CacheCommand {
    /// List the stored programs: key, program, size, compile time a hit saves, last use.
    Ls,
    /// Show what a stored program's key is made of.
    Explain {
        /// A key (64 hex digits, or a prefix of at least 4 as `ls` prints), or a program
        /// identity (exact, or its last `::` parts, like `DigitsMlp::nitro.grad`).
        query: String,
        /// Show why its compile costs what it does instead: ops by family, the largest
        /// constants (and the GraphConst they came from), blocks repeated back to back, the
        /// program's size, its trace and compile times, and what to change.
        #[arg(long)]
        cost: bool,
    },
    /// Remove least-recently-used entries until the cache holds at most --max-size.
    Gc {
        /// The bound: bytes, or with a suffix K, M, G (powers of 1024; `KiB`, `MB`, … also
        /// accepted).
        #[arg(long, value_name = "SIZE", value_parser = text::parse_size)]
        max_size: u64,
    },
    /// Remove every entry and every program record.
    Clear,
    /// Check every entry's checksum, or its signature when NITRO_CACHE_KEY is set.
    Verify,
    /// Upload every local entry the shared server lacks (verified first).
    Push,
    /// Copy entries from the shared server into the cache directory: every one, or those the
    /// queries name (keys, key prefixes or program identities, as `explain` takes them).
    Pull {
        /// What to copy; nothing means everything (unless --manifest names what).
        queries: Vec<String>,
        /// Copy the programs of this inventory manifest (written by a run:
        /// `Nitro::manifest`, the examples' `--manifest FILE`), by store key.
        #[arg(long, value_name = "FILE")]
        manifest: Option<PathBuf>,
    },
    /// Say which programs of an inventory manifest the cache directory lacks — or, with
    /// --remote, the shared server. Exit status 1 when any is missing.
    Check {
        /// The manifest (written by a run: `Nitro::manifest`, the examples' `--manifest FILE`).
        #[arg(long, value_name = "FILE")]
        manifest: PathBuf,
    },
}

/// Why a command did not succeed.
#[derive(Debug)]
pub(crate) struct Failure {
    /// A stable name for `--json` (`missing_directory`, `untrusted_directory`, …).
    kind: &'static str,
    /// What went wrong and what to do, in words.
    message: String,
    /// The exit status.
    code: u8,
}

impl Failure {
    /// A failure that stopped the command (exit status 2).
    pub(crate) fn fatal(kind: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            kind,
            message: message.into(),
            code: 2,
        }
    }

    /// A command that ran and found something wrong (exit status 1).
    pub(crate) fn found(kind: &'static str, message: impl Into<String>) -> Failure {
        Failure {
            kind,
            message: message.into(),
            code: 1,
        }
    }
}

impl From<nitro::Error> for Failure {
    fn from(e: nitro::Error) -> Failure {
        let kind = match &e {
            nitro::Error::CacheIo { source, path, .. }
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                return Failure::fatal(
                    "missing_directory",
                    format!(
                        "no compile cache at {}: the directory does not exist (nothing was \
                         cached there yet, or the path is wrong); pass --dir or set \
                         NITRO_CACHE_DIR to the cache directory",
                        path.display()
                    ),
                );
            }
            nitro::Error::CacheIo { .. } => "io",
            nitro::Error::CacheUntrusted { .. } => "untrusted_directory",
            nitro::Error::InvalidSetting { .. } => "invalid_setting",
            nitro::Error::RemoteUnsigned { .. } => "unsigned_remote",
            nitro::Error::RemoteCache { .. } => "remote",
            _ => "error",
        };
        Failure::fatal(kind, e.to_string())
    }
}

/// What a command produced: text for people, a JSON document for `--json`, and a failure
/// when it found a problem (reported after the output).
pub(crate) struct Report {
    pub(crate) text: String,
    pub(crate) json: serde_json::Value,
    pub(crate) problem: Option<Failure>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Command::Cache(args) = cli.command;
    let outcome = cache::run(&args);
    let mut out = std::io::stdout().lock();
    // A closed pipe (`nitro cache ls | head`) is not an error worth a panic: writes are
    // best-effort, and the exit status says how the command went.
    let (doc, failure) = match outcome {
        Ok(report) => {
            if args.json {
                let _ = writeln!(out, "{}", pretty(&report.json));
            } else {
                let _ = write!(out, "{}", report.text);
            }
            (None, report.problem)
        }
        Err(failure) => {
            let doc = serde_json::json!({
                "error": { "kind": failure.kind, "message": failure.message }
            });
            (Some(doc), Some(failure))
        }
    };
    let Some(failure) = failure else {
        return ExitCode::SUCCESS;
    };
    match doc {
        Some(doc) if args.json => {
            let _ = writeln!(out, "{}", pretty(&doc));
        }
        _ => eprintln!("nitro: {}", failure.message),
    }
    ExitCode::from(failure.code)
}

fn pretty(v: &serde_json::Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
}
