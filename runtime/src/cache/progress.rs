//! Compiles that say they are running.
//!
//! A compile that has run for [`ANNOUNCE_AFTER`] (a second; [`Cache::set_announce_after`]
//! moves it) is announced on stderr: which
//! program, for how long so far, and how long its last compile took on this machine (the
//! persistent store's record, which is also what the preflight's estimate is made of). On a
//! terminal one status line is redrawn while compiles run (several at once share it); elsewhere
//! (a log, CI) each long compile writes one line when it is announced and one when it ends.
//! Compiles shorter than a second write nothing.
//!
//! The training handle turns the lines off with [`Config::progress`](crate::train::Config)
//! (the examples do under `--json`); code of your own with [`quietly`].
//!
//! [`Cache::set_announce_after`]: super::Cache::set_announce_after

use std::cell::Cell;
use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a compile runs before it is announced.
pub const ANNOUNCE_AFTER: Duration = Duration::from_secs(1);

/// How often the terminal's status line is redrawn.
const REDRAW: Duration = Duration::from_millis(250);

thread_local! {
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the compile progress lines of this thread off (`quiet`) or on, restoring the
/// previous setting after, on every exit.
///
/// ```
/// let answer = nitro::cache::quietly(true, || 42);
/// assert_eq!(answer, 42);
/// ```
pub fn quietly<R>(quiet: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            let before = self.0;
            QUIET.with(|q| q.set(before));
        }
    }
    let _restore = Restore(QUIET.with(|q| q.replace(quiet)));
    f()
}

/// One compile in progress.
struct Running {
    program: String,
    started: Instant,
    last_ms: Option<f64>,
    /// How long it runs before it is announced.
    after: Duration,
    /// Whether its line was written (off a terminal) or it was shown (on one).
    announced: bool,
}

/// The line that announces a compile off a terminal.
fn announcement(program: &str, last_ms: Option<f64>) -> String {
    format!("nitro: compiling {program} ({}) …", last(last_ms))
}

/// The terminal's status line for compiles running `(program, for how long, last)`.
fn status(running: &[(&str, Duration, Option<f64>)]) -> String {
    let parts: Vec<String> = running
        .iter()
        .map(|(program, elapsed, last_ms)| {
            format!("{program} {} ({})", seconds(*elapsed), last(*last_ms))
        })
        .collect();
    format!("nitro: compiling {}", parts.join(" · "))
}

/// The line that says a compile announced earlier ended.
fn ended(program: &str, took: Duration, last_ms: Option<f64>) -> String {
    format!(
        "nitro: compiled {program} in {} ({})",
        seconds(took),
        last(last_ms)
    )
}

#[derive(Default)]
struct Board {
    running: BTreeMap<u64, Running>,
    /// Whether a drawing thread is alive.
    drawer: bool,
    /// Whether the terminal's status line holds text now.
    drawn: bool,
}

static BOARD: Mutex<Board> = Mutex::new(Board {
    running: BTreeMap::new(),
    drawer: false,
    drawn: false,
});
static NEXT: AtomicU64 = AtomicU64::new(0);

fn board() -> MutexGuard<'static, Board> {
    BOARD.lock().unwrap_or_else(|p| p.into_inner())
}

fn seconds(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

fn last(last_ms: Option<f64>) -> String {
    match last_ms {
        Some(ms) => format!("last compile here {:.1} s", ms / 1e3),
        None => "no earlier compile recorded here".to_owned(),
    }
}

/// A compile being watched: announced once it has run a second, its end said when it was.
/// Dropping it ends the watch.
pub(crate) struct Watch {
    id: Option<u64>,
}

impl Watch {
    /// Starts watching the compile of `program`, whose last compile here took `last_ms` (the
    /// store's record), to be announced once it has run `after`; a no-op when this thread is
    /// quiet. An `after` of zero announces it at once.
    pub(crate) fn start(program: &str, last_ms: Option<f64>, after: Duration) -> Watch {
        if QUIET.with(Cell::get) {
            return Watch { id: None };
        }
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut b = board();
        let announced = after.is_zero();
        if announced {
            let _ = writeln!(
                std::io::stderr().lock(),
                "{}",
                announcement(program, last_ms)
            );
        }
        b.running.insert(
            id,
            Running {
                program: program.to_owned(),
                started: Instant::now(),
                last_ms,
                after,
                announced,
            },
        );
        if !b.drawer {
            b.drawer = true;
            if std::thread::Builder::new()
                .name("nitro-progress".into())
                .spawn(draw)
                .is_err()
            {
                b.drawer = false;
            }
        }
        Watch { id: Some(id) }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        let mut b = board();
        let Some(r) = b.running.remove(&id) else {
            return;
        };
        if !r.announced {
            return;
        }
        let mut err = std::io::stderr().lock();
        if b.drawn {
            let _ = write!(err, "\r\x1b[2K");
            b.drawn = false;
        }
        let _ = writeln!(err, "{}", ended(&r.program, r.started.elapsed(), r.last_ms));
    }
}

/// The drawing thread: announces compiles past a second, redraws the terminal's status line,
/// and ends when nothing runs.
fn draw() {
    let terminal = std::io::stderr().is_terminal();
    loop {
        std::thread::sleep(REDRAW);
        let mut b = board();
        if b.running.is_empty() {
            b.drawer = false;
            return;
        }
        let now = Instant::now();
        let mut err = std::io::stderr().lock();
        if terminal {
            let mut shown = Vec::new();
            for r in b.running.values_mut() {
                let elapsed = now.duration_since(r.started);
                if elapsed >= r.after {
                    r.announced = true;
                    shown.push((r.program.as_str(), elapsed, r.last_ms));
                }
            }
            if !shown.is_empty() {
                let _ = write!(err, "\r\x1b[2K{}", status(&shown));
                let _ = err.flush();
                b.drawn = true;
            }
        } else {
            for r in b.running.values_mut() {
                if !r.announced && now.duration_since(r.started) >= r.after {
                    r.announced = true;
                    let _ = writeln!(err, "{}", announcement(&r.program, r.last_ms));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lines_name_the_program_its_time_and_its_last_compile_here() {
        assert_eq!(
            announcement("m::Net::nitro.grad", Some(12_400.0)),
            "nitro: compiling m::Net::nitro.grad (last compile here 12.4 s) …"
        );
        assert_eq!(
            announcement("p", None),
            "nitro: compiling p (no earlier compile recorded here) …"
        );
        assert_eq!(
            status(&[
                ("grad", Duration::from_millis(3_210), Some(9_000.0)),
                ("eval", Duration::from_millis(1_050), None),
            ]),
            "nitro: compiling grad 3.2 s (last compile here 9.0 s) · eval 1.1 s (no earlier \
             compile recorded here)"
        );
        assert_eq!(
            ended("grad", Duration::from_millis(8_960), Some(9_000.0)),
            "nitro: compiled grad in 9.0 s (last compile here 9.0 s)"
        );
    }

    #[test]
    fn a_quiet_thread_watches_nothing() {
        let w = quietly(true, || Watch::start("p", None, Duration::ZERO));
        assert!(w.id.is_none());
        assert!(!QUIET.with(Cell::get), "restored");
    }
}
