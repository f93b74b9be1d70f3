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
    /// Estimated compile time saved by hits and loads, in milliseconds.
    pub saved_ms: f64,
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
        if self.evictions > 0 {
            write!(f, " · evictions {}", self.evictions)?;
        }
        Ok(())
    }
}
