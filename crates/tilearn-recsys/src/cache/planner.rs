//! The device-independent part of a row cache: per table an [`LruSlots`], per cached row a dirty
//! bit, and for each batch the copies to make (dirty evicted rows back to the backing store,
//! then missing rows into their slots) and the batch's ids remapped to slots. The host cache
//! ([`super::CachedEmbeddingBag`]) and the device one (`cuda::DeviceCachedEmbeddingBag`) only
//! carry the copies out.
//!
//! A table given at least as many slots as it has rows is *resident*: it lives in the cache
//! whole (copied in when the cache is made, out when it is flushed), its ids are not remapped
//! and it has no slot map; only the other tables' rows move per batch and count in the stats.

use rayon::prelude::*;
use rustc_hash::FxHashSet;

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
    /// Per table and slot: changed by a step since it was loaded (empty for resident tables).
    dirty: Vec<Vec<bool>>,
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
            dirty: (cache.specs().iter().zip(backing.specs()).zip(slots))
                .map(|((c, b), &n)| vec![false; if n < b.rows { c.rows } else { 0 }])
                .collect(),
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
    /// its slots. The tables are planned in parallel (each has its own slot map and dirty
    /// bits; the moves come out in table order either way).
    pub fn map_batch(
        &mut self,
        batch: &JaggedBatch,
        training: bool,
    ) -> Result<(Vec<RowMove>, JaggedBatch)> {
        batch.check_layout(&self.backing)?;
        (self.slots.par_iter().enumerate()).try_for_each(|(t, slots)| {
            let Some(slots) = slots else { return Ok(()) };
            let distinct: FxHashSet<u32> = batch.ids()[batch.table_entries(t)]
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
            Ok(())
        })?;
        let mut ids = batch.ids().to_vec();
        // Each table's ids, a contiguous run of the table-major batch.
        let mut runs: Vec<&mut [u32]> = Vec::with_capacity(self.slots.len());
        let mut rest = ids.as_mut_slice();
        for t in 0..self.slots.len() {
            let (run, tail) = rest.split_at_mut(batch.table_entries(t).len());
            runs.push(run);
            rest = tail;
        }
        let planned: Vec<Result<(Vec<RowMove>, CacheStats)>> = (self.slots.par_iter_mut())
            .zip(self.dirty.par_iter_mut())
            .zip(runs.into_par_iter())
            .enumerate()
            .map(|(t, ((slots, dirty), ids))| match slots {
                Some(slots) => plan_table(t, slots, dirty, ids, training),
                None => Ok((Vec::new(), CacheStats::default())),
            })
            .collect();
        let mut moves = Vec::new();
        for result in planned {
            let (table_moves, stats) = result?;
            moves.extend(table_moves);
            self.stats.hits += stats.hits;
            self.stats.loads += stats.loads;
            self.stats.evictions += stats.evictions;
            self.stats.write_backs += stats.write_backs;
        }
        let mapped = JaggedBatch::new(&self.cache, batch.batch(), batch.offsets().to_vec(), ids)?;
        Ok((moves, mapped))
    }

    /// The write-backs of every dirty cached row; they stay cached, now clean.
    pub fn flush(&mut self) -> Vec<RowMove> {
        let mut moves = Vec::new();
        for (t, slots) in self.slots.iter().enumerate() {
            let Some(slots) = slots else { continue };
            for (row, slot) in slots.cached() {
                if std::mem::take(&mut self.dirty[t][slot as usize]) {
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

/// One cached table's part of [`RowCachePlanner::map_batch`]: plans its rows, remaps its `ids`
/// to slots in place and marks them dirty when `training`; returns its moves (write-backs of
/// dirty evicted rows, then loads) and counts.
fn plan_table(
    t: usize,
    slots: &mut LruSlots,
    dirty: &mut [bool],
    ids: &mut [u32],
    training: bool,
) -> Result<(Vec<RowMove>, CacheStats)> {
    let plan = slots.plan(ids)?;
    let mut stats = CacheStats {
        hits: plan.hits as u64,
        loads: plan.loads.len() as u64,
        evictions: plan.evictions.len() as u64,
        write_backs: 0,
    };
    let mut moves = Vec::with_capacity(plan.evictions.len() + plan.loads.len());
    for &(row, slot) in &plan.evictions {
        if std::mem::take(&mut dirty[slot as usize]) {
            stats.write_backs += 1;
            moves.push(RowMove::WriteBack {
                table: t,
                row,
                slot,
            });
        }
    }
    moves.extend((plan.loads.iter()).map(|&(row, slot)| RowMove::Load {
        table: t,
        row,
        slot,
    }));
    for id in ids.iter_mut() {
        *id = slots.slot(*id).expect("planned rows are cached");
        if training {
            dirty[*id as usize] = true;
        }
    }
    Ok((moves, stats))
}
