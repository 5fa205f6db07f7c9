//! Tables larger than the device: every row and its optimizer state live in a backing store
//! (host memory; pinned on the device path), and a cache of `slots_t` rows per table holds the
//! rows the current batches use. The fused operator runs on the cache, whose tables are the
//! original ones with `slots_t` rows each; a batch's ids are remapped to slots first.
//!
//! Per batch and table ([`LruSlots::plan`]): rows already cached are hits; each missing row
//! takes the least recently used slot that the batch does not use; the evicted row is written
//! back (weights and optimizer state) only if a training step changed it since it was loaded
//! (write-back, not write-through: a hot row crosses the bus once per residence, not per step);
//! then the missing rows are loaded with their state. Training through the cache gives the
//! weights and state of training on the whole tables bit for bit: each row's update depends
//! only on its own gradient contributions, summed in entry order either way.

use crate::embedding_bag::{embedding_bag_backward_update, embedding_bag_forward};
use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::sparse_optim::{RowStateMut, SparseState};
use crate::tables::{EmbeddingTables, TableLayout, TableSpec};

use super::lru::LruSlots;

/// Counts since the cache was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    pub hits: u64,
    pub loads: u64,
    pub evictions: u64,
    /// Evicted or flushed rows that were dirty, so copied back.
    pub write_backs: u64,
}

/// Embedding tables in a backing store with a cache of hot rows (see the module docs).
#[derive(Debug)]
pub struct CachedEmbeddingBag {
    backing: EmbeddingTables,
    backing_state: SparseState,
    cache: EmbeddingTables,
    cache_state: SparseState,
    slots: Vec<LruSlots>,
    /// Per stacked cache row: changed by a step since it was loaded.
    dirty: Vec<bool>,
    stats: CacheStats,
}

/// Copies one row's optimizer state.
fn copy_row_state(from: RowStateMut<'_>, to: RowStateMut<'_>) {
    match (from, to) {
        (RowStateMut::None, RowStateMut::None) => {}
        (RowStateMut::Accumulator(a), RowStateMut::Accumulator(b)) => *b = *a,
        (RowStateMut::Moments(m, v), RowStateMut::Moments(m2, v2)) => {
            m2.copy_from_slice(m);
            v2.copy_from_slice(v);
        }
        _ => unreachable!("both states are of one optimizer"),
    }
}

impl CachedEmbeddingBag {
    /// A cache of `slots[t]` rows for table `t` (at most its rows) in front of `backing` and its
    /// optimizer `state`.
    pub fn new(backing: EmbeddingTables, state: SparseState, slots: &[usize]) -> Result<Self> {
        let layout = &backing.layout;
        state.check_layout(layout)?;
        if slots.len() != layout.num_tables() {
            return Err(RecsysError::invalid(
                "row cache",
                format!(
                    "{} slot counts for {} tables",
                    slots.len(),
                    layout.num_tables()
                ),
            ));
        }
        let specs: Vec<TableSpec> = (layout.specs().iter().zip(slots))
            .map(|(spec, &n)| TableSpec {
                rows: n.min(spec.rows),
                ..*spec
            })
            .collect();
        let cache_layout = TableLayout::new(specs)?;
        let mut cache_state = SparseState::new(*state.optimizer(), &cache_layout)?;
        cache_state.set_step(state.step());
        Ok(CachedEmbeddingBag {
            slots: (cache_layout.specs().iter())
                .map(|s| LruSlots::new(s.rows))
                .collect::<Result<_>>()?,
            dirty: vec![false; cache_layout.total_rows()],
            cache: EmbeddingTables {
                weights: vec![0.0; cache_layout.total_elements()],
                layout: cache_layout,
            },
            cache_state,
            backing,
            backing_state: state,
            stats: CacheStats::default(),
        })
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// The cache's tables (the original ones with `slots_t` rows each).
    pub fn cache_layout(&self) -> &TableLayout {
        &self.cache.layout
    }

    fn write_back(&mut self, t: usize, row: u32, slot: u32) {
        let (from, to) = (
            self.cache.layout.row_range(t, slot as usize),
            self.backing.layout.row_range(t, row as usize),
        );
        self.backing.weights[to.clone()].copy_from_slice(&self.cache.weights[from.clone()]);
        let cache_row = self.cache.layout.row_base()[t] + slot as usize;
        let backing_row = self.backing.layout.row_base()[t] + row as usize;
        copy_row_state(
            self.cache_state.row_mut(cache_row, from),
            self.backing_state.row_mut(backing_row, to),
        );
        self.dirty[cache_row] = false;
        self.stats.write_backs += 1;
    }

    fn load(&mut self, t: usize, row: u32, slot: u32) {
        let (from, to) = (
            self.backing.layout.row_range(t, row as usize),
            self.cache.layout.row_range(t, slot as usize),
        );
        self.cache.weights[to.clone()].copy_from_slice(&self.backing.weights[from.clone()]);
        let cache_row = self.cache.layout.row_base()[t] + slot as usize;
        let backing_row = self.backing.layout.row_base()[t] + row as usize;
        copy_row_state(
            self.backing_state.row_mut(backing_row, from),
            self.cache_state.row_mut(cache_row, to),
        );
        self.dirty[cache_row] = false;
        self.stats.loads += 1;
    }

    /// Brings every row of `batch` (ids of the backing tables) into the cache and returns the
    /// batch with slot ids, for [`forward`](Self::forward) and, when `training`,
    /// [`backward_update`](Self::backward_update) (whose rows become dirty). Fails, changing
    /// nothing, when a table's rows in the batch outnumber its slots.
    pub fn map_batch(&mut self, batch: &JaggedBatch, training: bool) -> Result<JaggedBatch> {
        batch.check_layout(&self.backing.layout)?;
        for t in 0..self.slots.len() {
            let distinct: std::collections::HashSet<u32> = batch.ids()[batch.table_entries(t)]
                .iter()
                .copied()
                .collect();
            if distinct.len() > self.slots[t].slots() {
                return Err(RecsysError::invalid(
                    "row cache",
                    format!(
                        "table {t}: the batch uses {} distinct rows, its cache holds {}; give the cache more slots or use smaller batches",
                        distinct.len(),
                        self.slots[t].slots()
                    ),
                ));
            }
        }
        let mut ids = batch.ids().to_vec();
        for t in 0..self.slots.len() {
            let entries = batch.table_entries(t);
            let plan = self.slots[t].plan(&batch.ids()[entries.clone()])?;
            self.stats.hits += plan.hits as u64;
            for &(row, slot) in &plan.evictions {
                self.stats.evictions += 1;
                if self.dirty[self.cache.layout.row_base()[t] + slot as usize] {
                    self.write_back(t, row, slot);
                }
            }
            for &(row, slot) in &plan.loads {
                self.load(t, row, slot);
            }
            let base = self.cache.layout.row_base()[t];
            for id in &mut ids[entries] {
                *id = self.slots[t].slot(*id).expect("planned rows are cached");
                if training {
                    self.dirty[base + *id as usize] = true;
                }
            }
        }
        JaggedBatch::new(
            &self.cache.layout,
            batch.batch(),
            batch.offsets().to_vec(),
            ids,
        )
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
        for t in 0..self.slots.len() {
            let cached: Vec<(u32, u32)> = self.slots[t].cached().collect();
            let base = self.cache.layout.row_base()[t];
            for (row, slot) in cached {
                if self.dirty[base + slot as usize] {
                    self.write_back(t, row, slot);
                }
            }
        }
        self.backing_state.set_step(self.cache_state.step());
        (&self.backing, &self.backing_state)
    }
}
