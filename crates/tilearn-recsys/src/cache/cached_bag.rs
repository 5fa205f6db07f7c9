//! Tables larger than the device: every row and its optimizer state live in a backing store,
//! and a cache of `slots_t` rows per table holds the rows the current batches use. The fused
//! operator runs on the cache, whose tables are the original ones with `slots_t` rows each; a
//! batch's ids are remapped to slots first ([`RowCachePlanner`]).
//!
//! Per batch and table ([`super::LruSlots::plan`]): rows already cached are hits; each missing
//! row takes the least recently used slot that the batch does not use; the evicted row is
//! written back (weights and optimizer state) only if a training step changed it since it was
//! loaded (write-back, not write-through: a hot row crosses the bus once per residence, not per
//! step); then the missing rows are loaded with their state. Training through the cache gives
//! the weights and state of training on the whole tables bit for bit: each row's update
//! depends only on its own gradient contributions, summed in entry order either way.
//!
//! [`CachedEmbeddingBag`] keeps the cache in host memory (the reference the CPU tests run);
//! `cuda::DeviceCachedEmbeddingBag` keeps it on the GPU.

use crate::embedding_bag::{embedding_bag_backward_update, embedding_bag_forward};
use crate::error::Result;
use crate::jagged::JaggedBatch;
use crate::sparse_optim::SparseState;
use crate::tables::{EmbeddingTables, TableLayout};

use super::copies::{BatchCopies, RowCopies, copy_elements, state_copies};
use super::planner::{CacheStats, RowCachePlanner, RowMove};

/// Embedding tables in a backing store with a host cache of hot rows (see the module docs).
#[derive(Debug)]
pub struct CachedEmbeddingBag {
    backing: EmbeddingTables,
    backing_state: SparseState,
    cache: EmbeddingTables,
    cache_state: SparseState,
    planner: RowCachePlanner,
}

/// Carries out `copies` from one set of tables and state into another (the same rule's).
fn apply_copies(
    copies: &RowCopies,
    (src, src_state): (&[f32], &mut SparseState),
    (dst, dst_state): (&mut [f32], &mut SparseState),
) {
    copy_elements(src, dst, &copies.elements);
    let optimizer = *src_state.optimizer();
    let (state1, both) = state_copies(&optimizer, copies);
    let (s1, s2) = src_state.buffers_mut();
    let (d1, d2) = dst_state.buffers_mut();
    copy_elements(s1, d1, state1);
    if both {
        copy_elements(s2, d2, &copies.elements);
    }
}

impl CachedEmbeddingBag {
    /// A cache of `slots[t]` rows for table `t` (at most its rows) in front of `backing` and its
    /// optimizer `state`.
    pub fn new(backing: EmbeddingTables, state: SparseState, slots: &[usize]) -> Result<Self> {
        state.check_layout(&backing.layout)?;
        let planner = RowCachePlanner::new(&backing.layout, slots)?;
        let cache_layout = planner.cache_layout().clone();
        let mut cache_state = SparseState::new(*state.optimizer(), &cache_layout)?;
        cache_state.set_step(state.step());
        let mut bag = CachedEmbeddingBag {
            cache: EmbeddingTables {
                weights: vec![0.0; cache_layout.total_elements()],
                layout: cache_layout,
            },
            cache_state,
            backing,
            backing_state: state,
            planner,
        };
        bag.copy_resident(true);
        Ok(bag)
    }

    pub fn stats(&self) -> CacheStats {
        self.planner.stats()
    }

    /// The cache's tables (the original ones with `slots_t` rows each).
    pub fn cache_layout(&self) -> &TableLayout {
        &self.cache.layout
    }

    /// The resident tables, whole, into the cache (`to_cache`) or back.
    fn copy_resident(&mut self, to_cache: bool) {
        let copies = BatchCopies::whole_tables(
            &self.planner.resident_tables(),
            &self.backing.layout,
            &self.cache.layout,
            to_cache,
        );
        self.apply_one_way(&copies, to_cache);
    }

    fn apply_one_way(&mut self, copies: &RowCopies, to_cache: bool) {
        if to_cache {
            apply_copies(
                copies,
                (&self.backing.weights, &mut self.backing_state),
                (&mut self.cache.weights, &mut self.cache_state),
            );
        } else {
            apply_copies(
                copies,
                (&self.cache.weights, &mut self.cache_state),
                (&mut self.backing.weights, &mut self.backing_state),
            );
        }
    }

    fn apply(&mut self, moves: &[RowMove]) {
        let copies = BatchCopies::new(moves, &self.backing.layout, &self.cache.layout);
        self.apply_one_way(&copies.write_backs, false);
        self.apply_one_way(&copies.loads, true);
    }

    /// Brings every row of `batch` (ids of the backing tables) into the cache and returns the
    /// batch with slot ids, for [`forward`](Self::forward) and, when `training`,
    /// [`backward_update`](Self::backward_update) (whose rows become dirty). Fails, changing
    /// nothing, when a table's rows in the batch outnumber its slots.
    pub fn map_batch(&mut self, batch: &JaggedBatch, training: bool) -> Result<JaggedBatch> {
        let (moves, mapped) = self.planner.map_batch(batch, training)?;
        self.apply(&moves);
        Ok(mapped)
    }

    /// [`embedding_bag_forward`] of a batch from [`map_batch`](Self::map_batch).
    pub fn forward(&self, slot_batch: &JaggedBatch, out: &mut [f32]) -> Result<()> {
        embedding_bag_forward(&self.cache, slot_batch, out)
    }

    /// [`embedding_bag_backward_update`] of a batch mapped with `training`, on the cached rows.
    pub fn backward_update(&mut self, slot_batch: &JaggedBatch, dout: &[f32]) -> Result<usize> {
        embedding_bag_backward_update(&mut self.cache, slot_batch, dout, &mut self.cache_state)
    }

    /// Writes every dirty cached row back (the rows stay cached, now clean) and returns the
    /// backing tables and state, current.
    pub fn flush(&mut self) -> (&EmbeddingTables, &SparseState) {
        let moves = self.planner.flush();
        self.apply(&moves);
        self.copy_resident(false);
        self.backing_state.set_step(self.cache_state.step());
        (&self.backing, &self.backing_state)
    }
}
