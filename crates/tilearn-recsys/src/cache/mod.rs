//! Tables larger than the device's memory: the rows in a backing store with a cache of hot rows
//! ([`CachedEmbeddingBag`]), slots given up least recently used first ([`LruSlots`]), changed
//! rows written back on eviction. The planning ([`RowCachePlanner`]) is the host's, as are the
//! copy lists its moves become ([`BatchCopies`]) and the choice of which tables stay whole on
//! the device under a memory budget ([`plan_residency`]); the cache itself lives in host memory
//! here (what the CPU tests run) or on the GPU (`cuda::DeviceCachedEmbeddingBag`).

mod budget;
mod cached_bag;
mod copies;
mod lru;
mod planner;
mod report;

pub use budget::{HostRows, ResidencyPlan, parse_bytes, plan_residency};
pub use cached_bag::CachedEmbeddingBag;
pub use copies::{BatchCopies, RowCopies, copy_elements, state_copies};
pub use lru::{LruSlots, SlotPlan};
pub use planner::{CacheStats, RowCachePlanner, RowMove};
pub use report::{RowCacheLog, RowCacheReport};
