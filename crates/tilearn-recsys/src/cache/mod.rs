//! Tables larger than the device's memory: the rows in a backing store with a cache of hot rows
//! ([`CachedEmbeddingBag`]), slots given up least recently used first ([`LruSlots`]), changed
//! rows written back on eviction. The logic is the host's; this module keeps the cache in host
//! memory too, which is what the CPU tests run (the device path, a device cache in front of
//! pinned host rows, is not written yet).

mod cached_bag;
mod lru;

pub use cached_bag::{CacheStats, CachedEmbeddingBag};
pub use lru::{LruSlots, SlotPlan};
