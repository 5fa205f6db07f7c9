//! What a row cache did, for the training log: hits and loads (the hit rate), write-backs, and
//! the host↔device row traffic with the time its copies took on the device (the bandwidth).

use serde::Serialize;

use super::planner::CacheStats;

/// Counts since a cache was made (subtract two with [`since`](Self::since) for a window).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RowCacheReport {
    pub stats: CacheStats,
    /// Row bytes (weights + optimizer state) copied host → device and device → host.
    pub bytes_to_device: u64,
    pub bytes_to_host: u64,
    /// Device time of those copies (CUDA events around them), 0 for a host cache.
    pub copy_seconds: f64,
}

/// One log record's view of a window of a [`RowCacheReport`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RowCacheLog {
    /// Rows of the window's batches found cached / all rows they used (`None`: no rows used).
    pub hit_rate: Option<f64>,
    pub hits: u64,
    pub loads: u64,
    pub write_backs: u64,
    pub host_to_device_bytes: u64,
    pub device_to_host_bytes: u64,
    pub copy_seconds: f64,
    /// Both directions' bytes over the copies' device time, in GB/s (10^9 bytes).
    pub copy_gb_per_s: Option<f64>,
}

impl RowCacheReport {
    /// The counts between `earlier` and this report.
    pub fn since(&self, earlier: &RowCacheReport) -> RowCacheReport {
        let (a, b) = (&self.stats, &earlier.stats);
        RowCacheReport {
            stats: CacheStats {
                hits: a.hits - b.hits,
                loads: a.loads - b.loads,
                evictions: a.evictions - b.evictions,
                write_backs: a.write_backs - b.write_backs,
            },
            bytes_to_device: self.bytes_to_device - earlier.bytes_to_device,
            bytes_to_host: self.bytes_to_host - earlier.bytes_to_host,
            copy_seconds: self.copy_seconds - earlier.copy_seconds,
        }
    }

    pub fn hit_rate(&self) -> Option<f64> {
        let used = self.stats.hits + self.stats.loads;
        (used > 0).then(|| self.stats.hits as f64 / used as f64)
    }

    pub fn log(&self) -> RowCacheLog {
        let bytes = self.bytes_to_device + self.bytes_to_host;
        RowCacheLog {
            hit_rate: self.hit_rate(),
            hits: self.stats.hits,
            loads: self.stats.loads,
            write_backs: self.stats.write_backs,
            host_to_device_bytes: self.bytes_to_device,
            device_to_host_bytes: self.bytes_to_host,
            copy_seconds: self.copy_seconds,
            copy_gb_per_s: (self.copy_seconds > 0.0)
                .then(|| bytes as f64 / self.copy_seconds / 1e9),
        }
    }
}
