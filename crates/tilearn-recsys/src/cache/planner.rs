//! The device-independent part of a row cache: per table an [`LruSlots`], per cached row a dirty
//! bit, and for each batch the copies to make (dirty evicted rows back to the backing store,
//! then missing rows into their slots) and the batch's ids remapped to slots. The host cache
//! ([`super::CachedEmbeddingBag`]) and the device one (`cuda::DeviceCachedEmbeddingBag`) only
//! carry the copies out.
//!
//! A table given at least as many slots as it has rows is *resident*: it lives in the cache
//! whole (copied in when the cache is made, out when it is flushed), its ids are not remapped
//! and it has no slot map; only the other tables' rows move per batch and count in the stats.

use std::collections::HashSet;

use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::tables::{TableLayout, TableSpec};

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

/// One copy between the backing store and the cache: row `row` of table `table` (weights and
/// optimizer state) and cache slot `slot` of that table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowMove {
    /// Cache slot → backing row (a dirty row leaving the cache, or a flush).
    WriteBack { table: usize, row: u32, slot: u32 },
    /// Backing row → cache slot.
    Load { table: usize, row: u32, slot: u32 },
}

/// Slot maps and dirty bits of a cache of `slots[t]` rows per table.
#[derive(Debug, Clone)]
pub struct RowCachePlanner {
    backing: TableLayout,
    cache: TableLayout,
    /// Per table: its slot map, or `None` for a resident table.
    slots: Vec<Option<LruSlots>>,
    /// Per stacked cache row: changed by a step since it was loaded.
    dirty: Vec<bool>,
    stats: CacheStats,
}

impl RowCachePlanner {
    /// A cache of `slots[t]` rows (at most the table's rows) for each table of `backing`.
    pub fn new(backing: &TableLayout, slots: &[usize]) -> Result<Self> {
        if slots.len() != backing.num_tables() {
            return Err(RecsysError::invalid(
                "row cache",
                format!(
                    "{} slot counts for {} tables",
                    slots.len(),
                    backing.num_tables()
                ),
            ));
        }
        let specs: Vec<TableSpec> = (backing.specs().iter().zip(slots))
            .map(|(spec, &n)| TableSpec {
                rows: n.min(spec.rows),
                ..*spec
            })
            .collect();
        let cache = TableLayout::new(specs)?;
        Ok(RowCachePlanner {
            slots: (cache.specs().iter().zip(backing.specs()).zip(slots))
                .map(|((c, b), &n)| (n < b.rows).then(|| LruSlots::new(c.rows)).transpose())
                .collect::<Result<_>>()?,
            dirty: vec![false; cache.total_rows()],
            backing: backing.clone(),
            cache,
            stats: CacheStats::default(),
        })
    }

    /// The cache's tables: the backing ones with `slots[t]` rows each.
    pub fn cache_layout(&self) -> &TableLayout {
        &self.cache
    }

    pub fn backing_layout(&self) -> &TableLayout {
        &self.backing
    }

    /// The tables that live in the cache whole.
    pub fn resident_tables(&self) -> Vec<usize> {
        (self.slots.iter().enumerate())
            .filter_map(|(t, s)| s.is_none().then_some(t))
            .collect()
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Plans `batch` (ids of the backing tables): the copies to make, in order, and the batch
    /// with slot ids. With `training` its rows become dirty (the step that follows changes
    /// them). Fails, changing nothing, when a table's distinct rows in the batch outnumber
    /// its slots.
    pub fn map_batch(
        &mut self,
        batch: &JaggedBatch,
        training: bool,
    ) -> Result<(Vec<RowMove>, JaggedBatch)> {
        batch.check_layout(&self.backing)?;
        for (t, slots) in self.slots.iter().enumerate() {
            let Some(slots) = slots else { continue };
            let distinct: HashSet<u32> = batch.ids()[batch.table_entries(t)]
                .iter()
                .copied()
                .collect();
            if distinct.len() > slots.slots() {
                return Err(RecsysError::invalid(
                    "row cache",
                    format!(
                        "table {t}: the batch uses {} distinct rows, its cache holds {}; give the cache more slots or use smaller batches",
                        distinct.len(),
                        slots.slots()
                    ),
                ));
            }
        }
        let mut moves = Vec::new();
        let mut ids = batch.ids().to_vec();
        for t in 0..self.slots.len() {
            let Some(slots) = self.slots[t].as_mut() else {
                continue;
            };
            let entries = batch.table_entries(t);
            let plan = slots.plan(&batch.ids()[entries.clone()])?;
            let base = self.cache.row_base()[t];
            self.stats.hits += plan.hits as u64;
            for &(row, slot) in &plan.evictions {
                self.stats.evictions += 1;
                if std::mem::take(&mut self.dirty[base + slot as usize]) {
                    self.stats.write_backs += 1;
                    moves.push(RowMove::WriteBack {
                        table: t,
                        row,
                        slot,
                    });
                }
            }
            for &(row, slot) in &plan.loads {
                self.stats.loads += 1;
                moves.push(RowMove::Load {
                    table: t,
                    row,
                    slot,
                });
            }
            for id in &mut ids[entries] {
                *id = slots.slot(*id).expect("planned rows are cached");
                if training {
                    self.dirty[base + *id as usize] = true;
                }
            }
        }
        let mapped = JaggedBatch::new(&self.cache, batch.batch(), batch.offsets().to_vec(), ids)?;
        Ok((moves, mapped))
    }

    /// The write-backs of every dirty cached row; they stay cached, now clean.
    pub fn flush(&mut self) -> Vec<RowMove> {
        let mut moves = Vec::new();
        for (t, slots) in self.slots.iter().enumerate() {
            let Some(slots) = slots else { continue };
            let base = self.cache.row_base()[t];
            for (row, slot) in slots.cached() {
                if std::mem::take(&mut self.dirty[base + slot as usize]) {
                    self.stats.write_backs += 1;
                    moves.push(RowMove::WriteBack {
                        table: t,
                        row,
                        slot,
                    });
                }
            }
        }
        moves
    }
}
