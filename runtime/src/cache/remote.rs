//! The shared level: compiled programs on a Redis server, for many machines.
//!
//! [`RedisStore`] keeps entries on a Redis server (the `redis` crate's sync client; no async
//! runtime), and [`LayeredStore`] puts the local [`DirStore`] in front of it, which is what
//! `NITRO_CACHE_REMOTE` configures (see [`global`](super::global) and `docs/sharing.md`):
//!
//! - **Layering.** A lookup asks the local store first; a miss there asks the server, and an
//!   entry found there is verified and copied into the local store (read-through), so a
//!   program costs a network round trip once per machine. A compiled program is written to
//!   both (write-through).
//! - **Trust.** A server's entries are native code written by other machines, so a shared store
//!   requires a signing key ([`Error::RemoteUnsigned`] without one). Entries are the bytes
//!   [`DirStore`] writes to disk, signed with the same key, and are verified the same way: a
//!   corrupt, truncated, foreign, unsigned or otherwise-signed entry is refused and rebuilt,
//!   never loaded. A read-only store ([`RemoteMode::ReadOnly`], `NITRO_CACHE_REMOTE_MODE=ro`)
//!   sends no command that writes.
//! - **One compile per fleet.** The per-key lock becomes a lease on the server
//!   (`SET <prefix>:lock:<key> <id> NX PX <lease>`): the holder renews it from a background
//!   thread while it compiles (a compare-and-`PEXPIRE` script) and deletes it when done (a
//!   compare-and-`DEL` script, so it never removes a lease another process took after its own
//!   expired); the others poll until the entry appears, then load it. A holder that dies stops
//!   renewing, the lease expires, and the next waiter compiles. A lease no holder of this
//!   configuration could have set — without an expiry, or outlasting [`RemoteConfig::lease`]
//!   (left by a writer that crashed between a plain `SET` and its expiry, a foreign tool, a
//!   server that lost the expiry) — is stale: never waited for. A read-write store removes it
//!   with a script that reads its time to live and deletes it in one step (so a live lease
//!   taken meanwhile is never removed) and takes the lease; a read-only one compiles without
//!   waiting. Counted in [`RemoteStats::stale_leases`], said once on stderr.
//! - **Faults never fail a run.** A timeout, a refused connection, a server restart or an error
//!   reply is counted ([`RemoteStats::errors`]), said once on stderr, and served locally
//!   (compiled, or read from the local store); the server is then left alone for
//!   [`RemoteConfig::retry_after`] and tried again. An entry evicted by the server's memory
//!   bound is a miss: rebuilt and re-uploaded.
//! - **Bounds.** Entries over [`RemoteConfig::max_entry_bytes`] are neither uploaded nor read
//!   (a read asks for at most that many bytes). The server's `maxmemory` with
//!   `maxmemory-policy allkeys-lru` bounds the whole.
//!
//! Keys on the server, under the namespace `prefix` (default `nitro`): `<prefix>:entry:<key>`
//! (an entry's bytes) and `<prefix>:lock:<key>` (a compile lease). Program records, which only
//! explain misses, stay in the local store.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::store::{
    decode_entry, encode_entry, explain_entries, meta_len_of, DirStore, Entry, EntrySummary,
    Explanation, HeldLock, KeyLock, Lookup, Store, ENTRY_HEADER_BYTES,
};
use super::{RejectKind, Rejection, RemoteStats};
use crate::error::{Error, Result};
use crate::hash::Digest;

/// The default time allowed to connect to the server, and for each read or write: 1 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
/// The default compile lease: 15 s, renewed every third of it while the holder compiles.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(15);
/// The default time the server is left alone after a fault: 5 s.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(5);
/// The default entry size limit: 64 MiB.
pub const DEFAULT_MAX_ENTRY_BYTES: u64 = 64 << 20;
/// The default key namespace.
pub const DEFAULT_PREFIX: &str = "nitro";

/// A waiter says so on stderr after waiting this long for another process's lease.
const WAIT_NOTICE_AFTER: Duration = Duration::from_secs(1);

/// Deletes a lease only if it still holds this holder's id.
const RELEASE: &str =
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end";
/// Extends a lease only if it still holds this holder's id.
const RENEW: &str = "if redis.call('get', KEYS[1]) == ARGV[1] then \
                     return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end";
/// Deletes a lease no live holder of this configuration can have: one without an expiry, or
/// set to outlast the lease (`ARGV[1]` ms). The holder and its time to live are read and the
/// lease deleted in one step, so a lease taken in between is never removed. Returns the
/// removed lease's holder id and time to live in ms (-1: none), or nil.
const REMOVE_STALE: &str = "local holder = redis.call('get', KEYS[1]) \
                            if not holder then return false end \
                            local ttl = redis.call('pttl', KEYS[1]) \
                            if ttl == -1 or ttl > tonumber(ARGV[1]) then \
                            redis.call('del', KEYS[1]) return {holder, ttl} end \
                            return false";

/// Whether a shared store may write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteMode {
    /// Reads, uploads what this process compiles, and takes compile leases (the default).
    ReadWrite,
    /// Reads only: never uploads, never takes a lease, never removes anything — for consumers
    /// that must not write (CI readers, laptops). It still waits while another process holds
    /// the lease of a program it needs.
    ReadOnly,
}

/// How to reach and use a shared compile-cache server.
#[derive(Clone, PartialEq, Eq)]
pub struct RemoteConfig {
    /// The server: `redis://[:password@]host:port/db` or `redis+unix:///path/to/socket`
    /// (`?db=N` selects a database).
    pub url: String,
    /// The namespace of every key this store uses (`<prefix>:entry:…`), so that teams or
    /// projects can share one server apart.
    pub prefix: String,
    /// Whether this store may write.
    pub mode: RemoteMode,
    /// The time allowed to connect, and for each read or write. A request that runs out of it
    /// is a fault that says so (`timed out after … ms`, naming
    /// `NITRO_CACHE_REMOTE_TIMEOUT_MS`).
    pub timeout: Duration,
    /// How long a compile lease lasts unless renewed (its holder renews it every third of
    /// this); a holder that dies blocks the others this long at most.
    pub lease: Duration,
    /// After a fault, how long the server is left alone (served locally) before it is tried
    /// again.
    pub retry_after: Duration,
    /// Entries larger than this are not uploaded, and not read.
    pub max_entry_bytes: u64,
}

/// A password in the URL never reaches logs.
impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("url", &redacted(&self.url))
            .field("prefix", &self.prefix)
            .field("mode", &self.mode)
            .field("timeout", &self.timeout)
            .field("lease", &self.lease)
            .field("retry_after", &self.retry_after)
            .field("max_entry_bytes", &self.max_entry_bytes)
            .finish()
    }
}

impl RemoteConfig {
    /// The server at `url`, with the defaults: namespace [`DEFAULT_PREFIX`], read-write,
    /// [`DEFAULT_TIMEOUT`], [`DEFAULT_LEASE`], [`DEFAULT_RETRY_AFTER`],
    /// [`DEFAULT_MAX_ENTRY_BYTES`].
    pub fn new(url: impl Into<String>) -> RemoteConfig {
        RemoteConfig {
            url: url.into(),
            prefix: DEFAULT_PREFIX.to_owned(),
            mode: RemoteMode::ReadWrite,
            timeout: DEFAULT_TIMEOUT,
            lease: DEFAULT_LEASE,
            retry_after: DEFAULT_RETRY_AFTER,
            max_entry_bytes: DEFAULT_MAX_ENTRY_BYTES,
        }
    }

    /// The configuration the environment asks for; `None` when `NITRO_CACHE_REMOTE` is unset
    /// or empty:
    ///
    /// - `NITRO_CACHE_REMOTE`: the server's URL;
    /// - `NITRO_CACHE_REMOTE_PREFIX`: the key namespace (default `nitro`);
    /// - `NITRO_CACHE_REMOTE_MODE`: `rw` (default) or `ro`;
    /// - `NITRO_CACHE_REMOTE_TIMEOUT_MS`: connect, read and write timeout (default 1000);
    /// - `NITRO_CACHE_REMOTE_LEASE_MS`: compile lease (default 15000);
    /// - `NITRO_CACHE_REMOTE_MAX_ENTRY_BYTES`: entry size limit (default 64 MiB).
    ///
    /// A value that is not understood is [`Error::InvalidSetting`].
    pub fn from_env() -> Result<Option<RemoteConfig>> {
        RemoteConfig::from_env_at(None)
    }

    /// Like [`from_env`](RemoteConfig::from_env), with `url` in place of
    /// `NITRO_CACHE_REMOTE` when given (a tool's `--remote URL`); the other settings still come
    /// from the environment.
    pub fn from_env_at(url: Option<String>) -> Result<Option<RemoteConfig>> {
        let url = match url {
            Some(url) => url,
            None => match env_value("NITRO_CACHE_REMOTE")? {
                Some(url) => url,
                None => return Ok(None),
            },
        };
        let mut config = RemoteConfig::new(url);
        if let Some(prefix) = env_value("NITRO_CACHE_REMOTE_PREFIX")? {
            if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(Error::InvalidSetting {
                    variable: "NITRO_CACHE_REMOTE_PREFIX",
                    value: prefix,
                    expected: "a key namespace without spaces or control characters".into(),
                });
            }
            config.prefix = prefix;
        }
        if let Some(mode) = env_value("NITRO_CACHE_REMOTE_MODE")? {
            config.mode = match mode.to_ascii_lowercase().as_str() {
                "rw" | "read-write" => RemoteMode::ReadWrite,
                "ro" | "read-only" => RemoteMode::ReadOnly,
                _ => {
                    return Err(Error::InvalidSetting {
                        variable: "NITRO_CACHE_REMOTE_MODE",
                        value: mode,
                        expected: "`rw` (read and write, the default) or `ro` (read only)".into(),
                    })
                }
            };
        }
        if let Some(ms) = env_number("NITRO_CACHE_REMOTE_TIMEOUT_MS", 1)? {
            config.timeout = Duration::from_millis(ms);
        }
        if let Some(ms) = env_number("NITRO_CACHE_REMOTE_LEASE_MS", 100)? {
            config.lease = Duration::from_millis(ms);
        }
        if let Some(bytes) = env_number("NITRO_CACHE_REMOTE_MAX_ENTRY_BYTES", 1)? {
            config.max_entry_bytes = bytes;
        }
        Ok(Some(config))
    }

    fn read_only(&self) -> bool {
        self.mode == RemoteMode::ReadOnly
    }
}

/// The trimmed value of `variable`; `None` when unset or empty.
fn env_value(variable: &'static str) -> Result<Option<String>> {
    match std::env::var(variable) {
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v.trim().to_owned())),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(Error::InvalidSetting {
            variable,
            value: v.to_string_lossy().into_owned(),
            expected: "UTF-8 text".into(),
        }),
    }
}

/// `variable` as a whole number of at least `min`; `None` when unset or empty.
fn env_number(variable: &'static str, min: u64) -> Result<Option<u64>> {
    let Some(v) = env_value(variable)? else {
        return Ok(None);
    };
    match v.parse::<u64>() {
        Ok(n) if n >= min => Ok(Some(n)),
        _ => Err(Error::InvalidSetting {
            variable,
            value: v,
            expected: format!("a whole number, at least {min}"),
        }),
    }
}

/// `url` with any password (the part before `@` in the authority) hidden.
fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://<redacted>@{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

/// Counters behind [`RemoteStats`].
#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    rejected: AtomicU64,
    uploads: AtomicU64,
    bytes_down: AtomicU64,
    bytes_up: AtomicU64,
    errors: AtomicU64,
    lease_waits: AtomicU64,
    stale_leases: AtomicU64,
    too_large: AtomicU64,
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves the value whole (a connection or none; an instant).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The connection to the server and its health, shared by a store and its leases' renewers.
struct Remote {
    client: redis::Client,
    /// The URL with any password hidden.
    shown: String,
    config: RemoteConfig,
    signing_key: [u8; 32],
    conn: Mutex<Option<redis::Connection>>,
    /// Until when the server is left alone after a fault.
    down_until: Mutex<Option<Instant>>,
    /// Whether the last request failed (to say once when it recovers).
    down: AtomicBool,
    stats: Counters,
}

impl Remote {
    fn entry_key(&self, key: &Digest) -> String {
        format!("{}:entry:{key}", self.config.prefix)
    }

    fn lock_key(&self, key: &Digest) -> String {
        format!("{}:lock:{key}", self.config.prefix)
    }

    /// Runs `op` on the connection (connecting first if needed). A failure is counted and
    /// said once, and one that leaves the connection unusable drops it and leaves the server
    /// alone for `retry_after`. `Err` says what went wrong, in words.
    fn run<T>(
        &self,
        what: &str,
        op: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> std::result::Result<T, String> {
        if lock(&self.down_until).is_some_and(|until| Instant::now() < until) {
            return Err(format!(
                "not tried: the server failed less than {} ms ago",
                self.config.retry_after.as_millis()
            ));
        }
        let mut conn = lock(&self.conn);
        if conn.is_none() {
            match self.connect() {
                Ok(c) => *conn = Some(c),
                Err(e) => {
                    drop(conn);
                    return Err(self.fault(what, &e, true));
                }
            }
        }
        let result = match conn.as_mut() {
            Some(c) => op(c),
            None => return Err("no connection".into()),
        };
        match result {
            Ok(v) => {
                drop(conn);
                if self.down.swap(false, Ordering::Relaxed) {
                    tracing::info!(server = %self.shown, "nitro: the shared compile cache answers again");
                }
                Ok(v)
            }
            Err(e) => {
                let broken = e.is_io_error()
                    || e.is_timeout()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_unrecoverable_error();
                if broken {
                    *conn = None;
                }
                drop(conn);
                Err(self.fault(what, &e, broken))
            }
        }
    }

    fn connect(&self) -> redis::RedisResult<redis::Connection> {
        let conn = self
            .client
            .get_connection_with_timeout(self.config.timeout)?;
        conn.set_read_timeout(Some(self.config.timeout))?;
        conn.set_write_timeout(Some(self.config.timeout))?;
        Ok(conn)
    }

    /// A failure in words. A timeout says so, with the limit and the setting behind it (the
    /// operating system's own words for a read that timed out, "Resource temporarily
    /// unavailable", name neither).
    fn describe(&self, e: &redis::RedisError) -> String {
        if e.is_timeout() {
            format!(
                "timed out after {} ms without an answer (the limit NITRO_CACHE_REMOTE_TIMEOUT_MS \
                 sets, RemoteConfig::timeout in code; raise it if the server is only slow, or \
                 check that it runs and is not stopped)",
                self.config.timeout.as_millis()
            )
        } else {
            e.to_string()
        }
    }

    /// Counts and reports a failed request; returns it in words.
    fn fault(&self, what: &str, e: &redis::RedisError, broken: bool) -> String {
        add(&self.stats.errors, 1);
        if broken {
            *lock(&self.down_until) = Some(Instant::now() + self.config.retry_after);
        }
        let message = format!("cannot {what} on {}: {}", self.shown, self.describe(e));
        if !self.down.swap(true, Ordering::Relaxed) {
            tracing::warn!(server = %self.shown, "nitro: shared compile cache: {message}");
        }
        crate::settings::notice_once(
            "shared-cache-fault",
            &format!(
                "the shared compile cache failed ({message}); this run continues with local \
                 compiles and the local cache, and tries the server again every {} s",
                self.config.retry_after.as_secs_f64()
            ),
        );
        message
    }

    fn exists(&self, key: &str) -> std::result::Result<bool, String> {
        self.run("look up a key", |c| {
            redis::cmd("EXISTS").arg(key).query::<u64>(c).map(|n| n > 0)
        })
    }

    /// The entry under `key`, verified; `Err` when the server could not answer.
    fn fetch(&self, key: &Digest) -> std::result::Result<Lookup, String> {
        let max = self.config.max_entry_bytes;
        // At most one byte over the limit is read: enough to know an entry is too large.
        let end = i64::try_from(max).unwrap_or(i64::MAX);
        let bytes: Vec<u8> = self.run("read an entry", |c| {
            redis::cmd("GETRANGE")
                .arg(self.entry_key(key))
                .arg(0)
                .arg(end)
                .query(c)
        })?;
        // A missing key reads as empty, and no entry is empty.
        if bytes.is_empty() {
            add(&self.stats.misses, 1);
            return Ok(Lookup::Absent);
        }
        add(&self.stats.bytes_down, bytes.len() as u64);
        let checked = if bytes.len() as u64 > max {
            Err(Rejection::new(
                RejectKind::Malformed,
                format!(
                    "larger than the shared cache's entry limit of {max} bytes \
                     (NITRO_CACHE_REMOTE_MAX_ENTRY_BYTES)"
                ),
            ))
        } else {
            decode_entry(Some(&self.signing_key), key, &bytes)
        };
        match checked {
            Ok(entry) => {
                add(&self.stats.hits, 1);
                Ok(Lookup::Hit(entry))
            }
            Err(why) => {
                add(&self.stats.rejected, 1);
                tracing::warn!(server = %self.shown, key = %key.short(), "nitro: refused an entry of the shared compile cache ({why}); rebuilding it");
                // Not removed: the rebuilt entry replaces it (and a read-only store writes
                // nothing).
                Ok(Lookup::Rejected(Rejection::new(
                    why.kind,
                    format!("shared cache: {}", why.detail),
                )))
            }
        }
    }

    /// Uploads `entry` (nothing in read-only mode, or when it is over the size limit).
    fn upload(&self, entry: &Entry) -> std::result::Result<(), String> {
        if self.config.read_only() {
            return Ok(());
        }
        let bytes = encode_entry(Some(&self.signing_key), entry)?;
        if bytes.len() as u64 > self.config.max_entry_bytes {
            add(&self.stats.too_large, 1);
            crate::settings::notice_once(
                "shared-cache-too-large",
                &format!(
                    "`{}` compiled to {} bytes, over the shared cache's entry limit of {} bytes: \
                     kept locally, not uploaded (raise NITRO_CACHE_REMOTE_MAX_ENTRY_BYTES to \
                     share it)",
                    entry.meta.program,
                    bytes.len(),
                    self.config.max_entry_bytes
                ),
            );
            return Ok(());
        }
        self.run("write an entry", |c| {
            redis::cmd("SET")
                .arg(self.entry_key(&entry.meta.key))
                .arg(&bytes)
                .query::<()>(c)
        })?;
        add(&self.stats.uploads, 1);
        add(&self.stats.bytes_up, bytes.len() as u64);
        Ok(())
    }

    /// Takes the compile lease of `key`, waiting at most `wait` while another process holds
    /// it. `None` when there is nothing to compile here under a lease: the entry is on the
    /// server (now, or after waiting), the wait ran out, the store is read-only, or the server
    /// did not answer — in each case the caller looks the entry up and compiles on a miss.
    ///
    /// A stale lease (no expiry, or one that outlasts [`RemoteConfig::lease`]) is not waited
    /// for: a read-write store removes it and takes the lease, a read-only one compiles
    /// without waiting (see [`remove_stale`](Remote::remove_stale)).
    fn acquire(self: &Arc<Self>, key: &Digest, wait: Duration) -> Option<Lease> {
        let (entry_key, lock_key) = (self.entry_key(key), self.lock_key(key));
        let started = Instant::now();
        let deadline = started + wait;
        let poll =
            (self.config.lease / 20).clamp(Duration::from_millis(5), Duration::from_millis(50));
        let lease_ms = u64::try_from(self.config.lease.as_millis()).unwrap_or(u64::MAX);
        let (mut waited, mut announced) = (false, false);
        loop {
            if self.exists(&entry_key).unwrap_or(true) {
                return None;
            }
            if self.config.read_only() {
                // Never takes a lease (nor removes one); waits only while someone else holds a
                // live one.
                let ttl = self.run("look up a compile lease", |c| {
                    redis::cmd("PTTL").arg(&lock_key).query::<i64>(c)
                });
                match ttl {
                    Ok(-2) | Err(_) => return None,
                    Ok(ttl) if self.is_stale(ttl) => {
                        add(&self.stats.stale_leases, 1);
                        self.say_stale(&lock_key, None, ttl);
                        return None;
                    }
                    Ok(_) => {}
                }
            } else {
                let id = lease_id();
                let taken = self.run("take a compile lease", |c| {
                    redis::cmd("SET")
                        .arg(&lock_key)
                        .arg(&id)
                        .arg("NX")
                        .arg("PX")
                        .arg(lease_ms)
                        .query::<redis::Value>(c)
                });
                match taken {
                    // Held: by a live holder (wait), or stale (removed: take it now).
                    Ok(redis::Value::Nil) => match self.remove_stale(&lock_key) {
                        Ok(true) if Instant::now() < deadline => continue,
                        Ok(_) => {}
                        Err(_) => return None,
                    },
                    Ok(_) => return Some(Lease::start(self.clone(), lock_key, id)),
                    Err(_) => return None,
                }
            }
            if !waited {
                waited = true;
                add(&self.stats.lease_waits, 1);
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            if !announced && now - started >= WAIT_NOTICE_AFTER {
                announced = true;
                eprintln!(
                    "nitro: waiting for another machine, which is compiling a program this \
                     process needs (at most {} s more; then this process compiles it itself)",
                    deadline.saturating_duration_since(now).as_secs()
                );
            }
            std::thread::sleep(poll);
        }
    }

    /// Whether a lease with `ttl` ms left (`PTTL`: -1 without an expiry) is stale: no holder
    /// of this configuration sets or renews a lease without an expiry or beyond
    /// [`RemoteConfig::lease`], so none is waiting to release it. Such a lease is left by a
    /// writer that crashed between a plain `SET` and its expiry, by a foreign tool, or by a
    /// server that lost the expiry (a restored snapshot, a `PERSIST`); waited for, it would
    /// stall every machine the whole compile wait, for every program it names.
    fn is_stale(&self, ttl: i64) -> bool {
        let lease_ms = i64::try_from(self.config.lease.as_millis()).unwrap_or(i64::MAX);
        ttl == -1 || ttl > lease_ms
    }

    /// Removes the lease at `lock_key` if it is [stale](Remote::is_stale) — atomically, on the
    /// server, so a live lease taken in between is never removed. `Ok(true)` when it removed
    /// one (counted, said once on stderr); `Err` when the server did not answer.
    fn remove_stale(&self, lock_key: &str) -> std::result::Result<bool, String> {
        let lease_ms = u64::try_from(self.config.lease.as_millis()).unwrap_or(u64::MAX);
        let removed: Option<(String, i64)> = self.run("remove a stale compile lease", |c| {
            redis::cmd("EVAL")
                .arg(REMOVE_STALE)
                .arg(1)
                .arg(lock_key)
                .arg(lease_ms)
                .query(c)
        })?;
        let Some((holder, ttl)) = removed else {
            return Ok(false);
        };
        add(&self.stats.stale_leases, 1);
        self.say_stale(lock_key, Some(&holder), ttl);
        Ok(true)
    }

    /// Says (once per process on stderr, and each time in the log) that the lease at
    /// `lock_key`, held by `holder` when known, with `ttl` ms left, was stale.
    fn say_stale(&self, lock_key: &str, holder: Option<&str>, ttl: i64) {
        let lease_ms = self.config.lease.as_millis();
        let why = if ttl == -1 {
            "has no expiry".to_owned()
        } else {
            format!("would last {ttl} ms, longer than this process's lease of {lease_ms} ms")
        };
        let holder = holder.map_or_else(String::new, |h| format!(" (holder `{h}`)"));
        let done = if self.config.read_only() {
            "not waiting for it (read-only: it is left in place)"
        } else {
            "removed it and took the lease"
        };
        tracing::warn!(server = %self.shown, lease = %lock_key, "nitro: stale compile lease of the shared cache{holder}: it {why}; {done}");
        crate::settings::notice_once(
            "shared-cache-stale-lease",
            &format!(
                "a compile lease on the shared compile cache {}{holder} {why}, so no live \
                 holder will release it (a crashed or foreign writer left it, or the server lost \
                 its expiry); {done} instead of waiting. Every machine of a namespace should use \
                 the same NITRO_CACHE_REMOTE_LEASE_MS",
                self.shown
            ),
        );
    }
}

/// A lease id unique to this holder: the process id and a digest of the time and a counter.
fn lease_id() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let seed = format!(
        "{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    format!(
        "pid-{}-{}",
        std::process::id(),
        Digest::of(seed.as_str()).short()
    )
}

/// A held compile lease on the server: renewed by a background thread until dropped, then
/// deleted if it is still this holder's.
pub(crate) struct Lease {
    remote: Arc<Remote>,
    key: String,
    id: String,
    stop: Option<mpsc::Sender<()>>,
    renewer: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("id", &self.id)
            .finish()
    }
}

/// A [`KeyLock`] holds a lease while its holder compiles.
impl HeldLock for Lease {}

impl Lease {
    fn start(remote: Arc<Remote>, key: String, id: String) -> Lease {
        let (stop, stopped) = mpsc::channel::<()>();
        let every = remote.config.lease / 3;
        let lease_ms = u64::try_from(remote.config.lease.as_millis()).unwrap_or(u64::MAX);
        let (r, k, i) = (remote.clone(), key.clone(), id.clone());
        let renewer = std::thread::Builder::new()
            .name("nitro-lease".into())
            .spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                    let renewed = r.run("renew a compile lease", |c| {
                        redis::cmd("EVAL")
                            .arg(RENEW)
                            .arg(1)
                            .arg(&k)
                            .arg(&i)
                            .arg(lease_ms)
                            .query::<i64>(c)
                    });
                    if renewed == Ok(0) {
                        // Expired (the server stalled, or restarted) or evicted: another
                        // process may compile too, which costs time, never correctness.
                        tracing::warn!(lease = %k, "nitro: lost a compile lease of the shared cache");
                        break;
                    }
                }
            })
            // Without a renewer the lease still holds for its first term.
            .ok();
        Lease {
            remote,
            key,
            id,
            stop: Some(stop),
            renewer,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(renewer) = self.renewer.take() {
            let _ = renewer.join();
        }
        // On failure the lease expires by itself.
        let _ = self.remote.run("release a compile lease", |c| {
            redis::cmd("EVAL")
                .arg(RELEASE)
                .arg(1)
                .arg(&self.key)
                .arg(&self.id)
                .query::<i64>(c)
        });
    }
}

/// A [`Store`] on a Redis server, shared by many machines. Usually behind a [`LayeredStore`];
/// on its own, every lookup is a round trip. See the [module docs](self).
///
/// Opening connects to nothing: the first request does, and a server that is down is a fault
/// (a local compile), not an error. Its [`Store`] methods report faults as
/// [`Error::RemoteCache`] (which the compile cache warns about and works around).
#[derive(Clone)]
pub struct RedisStore {
    remote: Arc<Remote>,
}

/// The signing key and any password never reach logs.
impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("config", &self.remote.config)
            .field("signing_key", &"<redacted>")
            .finish()
    }
}

impl RedisStore {
    /// A store on the server `config` names, signing and verifying entries with
    /// `signing_key`. Refuses to open without a key ([`Error::RemoteUnsigned`]), and a URL the
    /// client cannot use ([`Error::RemoteCache`]).
    pub fn open(config: RemoteConfig, signing_key: Option<[u8; 32]>) -> Result<RedisStore> {
        let shown = redacted(&config.url);
        let Some(signing_key) = signing_key else {
            return Err(Error::RemoteUnsigned { url: shown });
        };
        if config.prefix.is_empty() {
            return Err(Error::RemoteCache {
                url: shown,
                why: "the key namespace (NITRO_CACHE_REMOTE_PREFIX) is empty; name one".into(),
            });
        }
        let client = redis::Client::open(config.url.as_str()).map_err(|e| Error::RemoteCache {
            url: shown.clone(),
            why: format!(
                "not a usable server address ({e}); use redis://host:port/db or \
                 redis+unix:///path/to/socket"
            ),
        })?;
        Ok(RedisStore {
            remote: Arc::new(Remote {
                client,
                shown,
                config,
                signing_key,
                conn: Mutex::new(None),
                down_until: Mutex::new(None),
                down: AtomicBool::new(false),
                stats: Counters::default(),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RemoteConfig {
        &self.remote.config
    }

    /// The server's address, with any password hidden.
    pub fn url(&self) -> &str {
        &self.remote.shown
    }

    /// Whether this store never writes ([`RemoteMode::ReadOnly`]).
    pub fn read_only(&self) -> bool {
        self.remote.config.read_only()
    }

    /// What this store exchanged with the server since it was opened.
    pub fn stats(&self) -> RemoteStats {
        let s = &self.remote.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RemoteStats {
            hits: get(&s.hits),
            misses: get(&s.misses),
            rejected: get(&s.rejected),
            uploads: get(&s.uploads),
            bytes_down: get(&s.bytes_down),
            bytes_up: get(&s.bytes_up),
            errors: get(&s.errors),
            lease_waits: get(&s.lease_waits),
            stale_leases: get(&s.stale_leases),
            too_large: get(&s.too_large),
        }
    }

    /// Whether the server answers now (a `PING`; a failure counts as a fault).
    pub fn ping(&self) -> bool {
        self.remote
            .run("ping", |c| redis::cmd("PING").query::<String>(c))
            .is_ok()
    }

    /// Every entry of this namespace on the server, most recently used first, with the
    /// metadata in its header (the header only is read; nothing is verified or changed, and
    /// the reads are not counted in [`stats`](RedisStore::stats)). `last_used` is when the
    /// server last served or stored it (0 when unknown: an LFU eviction policy does not track
    /// it). For tools: one scan and a few commands per entry.
    pub fn list(&self) -> Result<Vec<EntrySummary>> {
        let prefix = format!("{}:entry:", self.remote.config.prefix);
        let keys = self.scan("entry:*").map_err(|why| self.failed(why))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let (size, idle, head): (u64, Option<u64>, Vec<u8>) = self
                .remote
                .run("describe an entry", |c| {
                    let (size, head): (u64, Vec<u8>) = redis::pipe()
                        .cmd("STRLEN")
                        .arg(&k)
                        .cmd("GETRANGE")
                        .arg(&k)
                        .arg(0)
                        .arg(ENTRY_HEADER_BYTES as i64 - 1)
                        .query(c)?;
                    // Refused under an LFU eviction policy: last use is then unknown (0).
                    let idle: Option<u64> = redis::cmd("OBJECT")
                        .arg("IDLETIME")
                        .arg(&k)
                        .query(c)
                        .ok()
                        .flatten();
                    Ok((size, idle, head))
                })
                .map_err(|why| self.failed(why))?;
            if size == 0 {
                continue; // evicted or removed since the scan
            }
            let meta = match meta_len_of(&head).filter(|&n| n > 0 && n <= size) {
                Some(n) => {
                    let start = ENTRY_HEADER_BYTES as i64;
                    let raw: Vec<u8> = self
                        .remote
                        .run("read an entry's header", |c| {
                            redis::cmd("GETRANGE")
                                .arg(&k)
                                .arg(start)
                                .arg(start + n as i64 - 1)
                                .query(c)
                        })
                        .map_err(|why| self.failed(why))?;
                    serde_json::from_slice(&raw).ok()
                }
                None => None,
            };
            out.push(EntrySummary {
                key: k.strip_prefix(&prefix).unwrap_or(&k).to_owned(),
                size_bytes: size,
                last_used: idle.map_or(0, |i| now.saturating_sub(i)),
                meta,
                record: None,
            });
        }
        out.sort_by(|a, b| {
            b.last_used
                .cmp(&a.last_used)
                .then_with(|| a.key.cmp(&b.key))
        });
        Ok(out)
    }

    /// What the server holds of the programs `query` names, matched as
    /// [`DirStore::explain`] matches (a key or key prefix, or a program identity). Program
    /// records stay local, so every explanation's `record` is `None`.
    pub fn explain(&self, query: &str) -> Result<Vec<Explanation>> {
        Ok(explain_entries(self.list()?, query, &|_| None, &|_| None))
    }

    /// Uploads every entry of `local` that the server lacks (`nitro cache push`). Each is
    /// verified with the local store's key first, without touching the local store (an entry
    /// it would reject is skipped, with the reason). Refused in read-only mode, and when the
    /// local store is not signed with this store's key (its entries would all be refused).
    pub fn push_from(&self, local: &DirStore) -> Result<Transfer> {
        if self.read_only() {
            return Err(self.failed(
                "read-only (NITRO_CACHE_REMOTE_MODE=ro): nothing was uploaded; push from a \
                 read-write store"
                    .into(),
            ));
        }
        self.same_key(local)?;
        let mut t = Transfer::default();
        for e in local.list() {
            let Ok(key) = e.key.parse::<Digest>() else {
                t.skipped.push((e.key, "the file name is not a key".into()));
                continue;
            };
            if self
                .remote
                .exists(&self.remote.entry_key(&key))
                .map_err(|why| self.failed(why))?
            {
                t.present += 1;
                continue;
            }
            match local.read_entry(&key) {
                Ok(entry) => self.copy_in(&mut t, key, &entry, |x| self.put(x))?,
                Err(why) => t.skipped.push((e.key, why.to_string())),
            }
        }
        Ok(t)
    }

    /// Copies entries from the server into `local` (`nitro cache pull`): those `queries` name
    /// (each matched as [`explain`](RedisStore::explain) matches), or every one when `queries`
    /// is empty. Entries `local` already holds are left alone; each copied entry is verified
    /// with the key first (one the server's copy fails is skipped, with the reason). A query
    /// that names no entry on the server is listed in [`Transfer::unmatched`] (the others are
    /// still copied).
    pub fn pull_into(&self, local: &DirStore, queries: &[String]) -> Result<Transfer> {
        self.same_key(local)?;
        let all = self.list()?;
        let mut t = Transfer::default();
        let wanted: Vec<EntrySummary> = if queries.is_empty() {
            all
        } else {
            let mut v: Vec<EntrySummary> = Vec::new();
            for q in queries {
                let found = explain_entries(all.clone(), q, &|_| None, &|_| None);
                if found.iter().all(|x| x.entries.is_empty()) {
                    t.unmatched.push(q.clone());
                }
                for x in found {
                    for e in x.entries {
                        if !v.iter().any(|w| w.key == e.key) {
                            v.push(e);
                        }
                    }
                }
            }
            v
        };
        for e in wanted {
            let Ok(key) = e.key.parse::<Digest>() else {
                t.skipped.push((e.key, "not a key".into()));
                continue;
            };
            if local.contains(&key) {
                t.present += 1;
                continue;
            }
            match self.get(&key)? {
                Lookup::Hit(entry) => self.copy_in(&mut t, key, &entry, |x| local.put(x))?,
                Lookup::Rejected(why) => t.skipped.push((e.key, why.to_string())),
                Lookup::Absent => t.skipped.push((e.key, "gone from the server".into())),
            }
        }
        Ok(t)
    }

    /// Writes `entry` through `put` and counts it in `t` (an upload over the size limit is
    /// skipped by the server store, and counted as such).
    fn copy_in(
        &self,
        t: &mut Transfer,
        key: Digest,
        entry: &Entry,
        put: impl FnOnce(&Entry) -> Result<()>,
    ) -> Result<()> {
        let too_large = self.stats().too_large;
        put(entry)?;
        if self.stats().too_large > too_large {
            t.skipped.push((
                key.to_string(),
                format!(
                    "over the shared cache's entry limit of {} bytes",
                    self.remote.config.max_entry_bytes
                ),
            ));
        } else {
            t.copied.push(key.to_string());
            t.bytes += entry.payload.len() as u64;
        }
        Ok(())
    }

    /// Refuses a local store signed with another key (or none): its entries and this
    /// store's could never be exchanged.
    fn same_key(&self, local: &DirStore) -> Result<()> {
        if local.signing_key() != Some(&self.remote.signing_key) {
            return Err(self.failed(
                "the local store is not signed with this store's key; set NITRO_CACHE_KEY to \
                 the key both use"
                    .into(),
            ));
        }
        Ok(())
    }

    fn failed(&self, why: String) -> Error {
        Error::RemoteCache {
            url: self.remote.shown.clone(),
            why,
        }
    }

    /// The keys of this store's namespace that match `pattern` (after `<prefix>:`).
    fn scan(&self, pattern: &str) -> std::result::Result<Vec<String>, String> {
        let pattern = format!("{}:{pattern}", escape_glob(&self.remote.config.prefix));
        let mut keys = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = self.remote.run("list keys", |c| {
                redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .query(c)
            })?;
            keys.extend(batch);
            if next == 0 {
                return Ok(keys);
            }
            cursor = next;
        }
    }
}

/// What [`RedisStore::push_from`] or [`RedisStore::pull_into`] did.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Transfer {
    /// The keys copied.
    pub copied: Vec<String>,
    /// Entries the destination already held.
    pub present: usize,
    /// Entries not copied, with why (refused by verification, over the size limit).
    pub skipped: Vec<(String, String)>,
    /// Payload bytes copied.
    pub bytes: u64,
    /// The queries of a pull that named no entry on the server (a typo, or a program never
    /// uploaded): nothing was copied for them.
    pub unmatched: Vec<String>,
}

/// `s` with the glob characters of Redis patterns escaped.
fn escape_glob(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl Store for RedisStore {
    fn describe(&self) -> String {
        "the shared cache (Redis)".to_owned()
    }

    fn get(&self, key: &Digest) -> Result<Lookup> {
        self.remote.fetch(key).map_err(|why| self.failed(why))
    }

    /// Uploads the entry; does nothing in read-only mode or over the entry size limit.
    fn put(&self, entry: &Entry) -> Result<()> {
        self.remote.upload(entry).map_err(|why| self.failed(why))
    }

    fn contains(&self, key: &Digest) -> bool {
        self.remote
            .exists(&self.remote.entry_key(key))
            .unwrap_or(false)
    }

    fn locate(&self, key: &Digest) -> Option<super::store::Location> {
        self.contains(key).then_some(super::store::Location::Remote)
    }

    /// Removes every entry and lease of this store's namespace from the server — for every
    /// machine that shares it. Refused in read-only mode.
    fn clear(&self) -> Result<()> {
        if self.read_only() {
            return Err(self.failed(
                "read-only (NITRO_CACHE_REMOTE_MODE=ro): nothing was removed; clear it from a \
                 read-write store"
                    .into(),
            ));
        }
        let keys = self.scan("*").map_err(|why| self.failed(why))?;
        for batch in keys.chunks(500) {
            self.remote
                .run("remove keys", |c| {
                    redis::cmd("UNLINK").arg(batch).query::<u64>(c)
                })
                .map_err(|why| self.failed(why))?;
        }
        Ok(())
    }

    fn lock(&self, key: &Digest, wait: Duration) -> Result<Option<KeyLock>> {
        Ok(self.remote.acquire(key, wait).map(KeyLock::from_held))
    }

    /// The bytes of this namespace's entries on the server (a scan: for tools, not hot paths);
    /// 0 when the server does not answer.
    fn size_bytes(&self) -> u64 {
        let Ok(keys) = self.scan("entry:*") else {
            return 0;
        };
        keys.iter()
            .filter_map(|k| {
                self.remote
                    .run("measure an entry", |c| {
                        redis::cmd("STRLEN").arg(k).query::<u64>(c)
                    })
                    .ok()
            })
            .sum()
    }

    fn remote_stats(&self) -> Option<RemoteStats> {
        Some(self.stats())
    }
}

/// The local store in front of a shared one: read-through (an entry found on the server is
/// copied into the local store) and write-through (a compiled entry goes to both), so each
/// machine pays a round trip once per program. Faults of the server are served locally. See
/// the [module docs](self).
#[derive(Debug)]
pub struct LayeredStore {
    local: DirStore,
    remote: RedisStore,
}

impl LayeredStore {
    /// `local` in front of `remote`. Both must sign with the same key, so that an entry copied
    /// from the server is the same signed bytes on disk.
    pub fn new(local: DirStore, remote: RedisStore) -> Result<LayeredStore> {
        if local.signing_key() != Some(&remote.remote.signing_key) {
            return Err(Error::RemoteCache {
                url: remote.remote.shown.clone(),
                why: "the local store in front of it must be signed with the same key; open the \
                      DirStore with the key the RedisStore uses (NITRO_CACHE_KEY)"
                    .into(),
            });
        }
        Ok(LayeredStore { local, remote })
    }

    /// The local store.
    pub fn local(&self) -> &DirStore {
        &self.local
    }

    /// The shared store.
    pub fn remote(&self) -> &RedisStore {
        &self.remote
    }
}

impl Store for LayeredStore {
    fn describe(&self) -> String {
        "the local store, backed by the shared cache (Redis)".to_owned()
    }

    /// The local entry; else the server's, verified and copied into the local store. A
    /// rejected local entry (removed by the local store) is looked up on the server too; a
    /// server that does not answer leaves the local answer.
    fn get(&self, key: &Digest) -> Result<Lookup> {
        let local = match self.local.get(key) {
            Ok(Lookup::Hit(entry)) => return Ok(Lookup::Hit(entry)),
            Ok(other) => other,
            Err(e) => {
                tracing::warn!("nitro: local compile cache unreadable: {e}");
                Lookup::Absent
            }
        };
        match self.remote.remote.fetch(key) {
            Ok(Lookup::Hit(entry)) => {
                if let Err(e) = self.local.put(&entry) {
                    tracing::warn!(
                        "nitro: could not copy a shared entry into the local cache: {e}"
                    );
                }
                Ok(Lookup::Hit(entry))
            }
            Ok(Lookup::Rejected(why)) => Ok(Lookup::Rejected(why)),
            Ok(Lookup::Absent) | Err(_) => Ok(local),
        }
    }

    /// Writes the entry locally and uploads it (unless read-only); only a local failure is an
    /// error.
    fn put(&self, entry: &Entry) -> Result<()> {
        let local = self.local.put(entry);
        let _ = self.remote.remote.upload(entry);
        local
    }

    fn contains(&self, key: &Digest) -> bool {
        self.local.contains(key) || self.remote.contains(key)
    }

    fn locate(&self, key: &Digest) -> Option<super::store::Location> {
        if self.local.contains(key) {
            Some(super::store::Location::Local)
        } else {
            self.remote.locate(key)
        }
    }

    /// Clears the local store only: the server is the fleet's (clear it with
    /// [`RedisStore`]'s [`Store::clear`]).
    fn clear(&self) -> Result<()> {
        self.local.clear()
    }

    fn program_record(&self, program: &Digest) -> Option<Vec<u8>> {
        self.local.program_record(program)
    }

    fn record_program(&self, program: &Digest, record: &[u8]) -> Result<()> {
        self.local.record_program(program, record)
    }

    /// The local lock (one compile per machine), then, unless the entry is already local, the
    /// server's lease (one compile per fleet), within `wait` in all.
    fn lock(&self, key: &Digest, wait: Duration) -> Result<Option<KeyLock>> {
        let started = Instant::now();
        let local = self.local.lock(key, wait)?;
        if self.local.contains(key) {
            return Ok(local);
        }
        let rest = wait.saturating_sub(started.elapsed());
        Ok(match (self.remote.remote.acquire(key, rest), local) {
            (Some(lease), Some(local)) => Some(local.with_held(lease)),
            (Some(lease), None) => Some(KeyLock::from_held(lease)),
            (None, local) => local,
        })
    }

    /// The local store's bytes.
    fn size_bytes(&self) -> u64 {
        self.local.size_bytes()
    }

    fn remote_stats(&self) -> Option<RemoteStats> {
        Some(self.remote.stats())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(
            redacted("redis://:hunter2@cache.internal:6379/2"),
            "redis://<redacted>@cache.internal:6379/2"
        );
        assert_eq!(redacted("redis://host:6379"), "redis://host:6379");
        assert_eq!(
            redacted("redis+unix:///run/r.sock"),
            "redis+unix:///run/r.sock"
        );
        let config = RemoteConfig::new("redis://user:pw@h/0");
        assert!(!format!("{config:?}").contains("pw"));
    }

    #[test]
    fn globs_are_escaped() {
        assert_eq!(escape_glob("a*b?[c]"), "a\\*b\\?\\[c\\]");
    }
}
