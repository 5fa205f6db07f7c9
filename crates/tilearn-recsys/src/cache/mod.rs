//! Tables larger than the device's memory: the rows in a backing store with a cache of hot rows
//! ([`CachedEmbeddingBag`]), slots given up least recently used first ([`LruSlots`]), changed
//! rows written back on eviction. The planning ([`RowCachePlanner`]) is the host's; the cache
//! itself lives in host memory here (what the CPU tests run) or on the GPU
//! (`cuda::DeviceCachedEmbeddingBag`).

mod cached_bag;
mod lru;
mod planner;

pub use cached_bag::CachedEmbeddingBag;
pub use lru::{LruSlots, SlotPlan};
pub use planner::{CacheStats, RowCachePlanner, RowMove};
