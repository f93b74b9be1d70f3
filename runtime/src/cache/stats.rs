//! Cache statistics.

use std::collections::BTreeMap;
use std::fmt;

/// Counters and gauges of a cache. Counters (`hits`, `misses`, …) are historical and survive
/// [`Cache::reset`](super::Cache::reset); gauges (`entries`, `estimated_bytes`) describe what is
/// held now.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CacheStats {
    /// Lookups served from memory (L1).
    pub hits: u64,
    /// Lookups that missed in memory (each has a reason).
    pub misses: u64,
    /// Of the misses, those served by loading from the persistent store (L2).
    pub l2_hits: u64,
    /// Of the misses, those that compiled.
    pub compiles: u64,
    /// Misses by reason name (`empty`, `graph_const_changed`, …).
    pub misses_by_reason: BTreeMap<String, u64>,
    /// Stored entries that could not be used (corrupt, foreign, badly signed, unreadable) and
    /// were rebuilt.
    #[serde(default)]
    pub store_rejected: u64,
    /// Compiled programs that could not be kept in the persistent store: its write failed (a
    /// full disk, a directory that went away or became unwritable) or the backend could not
    /// serialize them. Each is compiled again by every later process; the first is said on
    /// stderr.
    #[serde(default)]
    pub store_write_failures: u64,
    /// Programs pushed out by capacity.
    pub evictions: u64,
    /// Times the cache was reset.
    pub clears: u64,
    /// Programs held in memory now.
    pub entries: u64,
    /// Estimated bytes held in memory now (serialized size where known).
    pub estimated_bytes: u64,
    /// Total time spent compiling, in milliseconds.
    pub compile_ms: f64,
    /// Estimated compile time saved by hits and loads, in milliseconds: a hit saves what
    /// getting the held program cost, a load its recorded compile time less the load.
    pub saved_ms: f64,
    /// Total time spent loading programs from the persistent store, in milliseconds.
    #[serde(default)]
    pub load_ms: f64,
    /// What the store exchanged with a shared server (`NITRO_CACHE_REMOTE`); `None` without
    /// one. Counted by the store since it was opened, so caches that share a store share these.
    #[serde(default)]
    pub remote: Option<RemoteStats>,
}

/// What a store exchanged with a shared compile-cache server
/// ([`RedisStore`](super::RedisStore)), counted since it was opened.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteStats {
    /// Entries found on the server, verified, and copied into the local store.
    pub hits: u64,
    /// Lookups the server could not serve: never stored, or evicted by its memory bound.
    pub misses: u64,
    /// Entries found on the server but refused (corrupt, signed with another key, unsigned,
    /// over the size limit): rebuilt, and re-uploaded unless read-only.
    pub rejected: u64,
    /// Entries written to the server.
    pub uploads: u64,
    /// Bytes read from the server (entries, whether used or refused).
    pub bytes_down: u64,
    /// Bytes written to the server.
    pub bytes_up: u64,
    /// Requests that failed (a timeout, a refused connection, a server restart, an error
    /// reply); each was served locally instead.
    pub errors: u64,
    /// Lookups that waited for another process's compile lease.
    pub lease_waits: u64,
    /// Compile leases found stale — without an expiry, or outlasting this store's lease
    /// (`NITRO_CACHE_REMOTE_LEASE_MS`), so no live holder will release them — and not waited
    /// for: removed and taken by a read-write store, left in place by a read-only one.
    #[serde(default)]
    pub stale_leases: u64,
    /// Compiled entries not uploaded because they are over the entry size limit.
    pub too_large: u64,
}

impl fmt::Display for RemoteStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "remote hits {} · misses {} · rejected {} · uploads {} · down {} B · up {} B · errors {}",
            self.hits,
            self.misses,
            self.rejected,
            self.uploads,
            self.bytes_down,
            self.bytes_up,
            self.errors
        )
    }
}

impl fmt::Display for CacheStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "hits {} · misses {} (loaded {}, compiled {}) · entries {} · compile {:.1} ms · saved {:.1} ms",
            self.hits, self.misses, self.l2_hits, self.compiles, self.entries, self.compile_ms, self.saved_ms
        )?;
        if !self.misses_by_reason.is_empty() {
            let reasons: Vec<String> = self
                .misses_by_reason
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            write!(f, " · reasons: {}", reasons.join(", "))?;
        }
        if self.store_rejected > 0 {
            write!(f, " · store rejected {}", self.store_rejected)?;
        }
        if self.store_write_failures > 0 {
            write!(f, " · store write failures {}", self.store_write_failures)?;
        }
        if self.evictions > 0 {
            write!(f, " · evictions {}", self.evictions)?;
        }
        if let Some(remote) = &self.remote {
            write!(f, " · {remote}")?;
        }
        Ok(())
    }
}
