//! Which cache slot holds which row of one table, and which slot to give up next: least
//! recently used first, never a slot the current batch uses.

use std::collections::BTreeSet;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::error::{RecsysError, Result};

/// What one batch does to a table's cache: where each of its rows lives, which rows must be
/// loaded into which slot, and which rows leave their slot first (written back when dirty).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SlotPlan {
    /// `(row, slot)` of rows not cached before the batch, in first-use order.
    pub loads: Vec<(u32, u32)>,
    /// `(row, slot)` of rows evicted to make room, before the loads into the same slots.
    pub evictions: Vec<(u32, u32)>,
    /// Rows of the batch already cached.
    pub hits: usize,
}

/// The slot map of one table's cache of `slots` rows.
#[derive(Debug, Clone)]
pub struct LruSlots {
    /// Row → slot (FxHash: row ids are small integers, SipHash's DoS resistance buys nothing).
    slot_of: FxHashMap<u32, u32>,
    row_of: Vec<Option<u32>>,
    /// Slots by (last use, slot): the first is the least recently used (free slots: 0).
    by_use: BTreeSet<(u64, u32)>,
    last_use: Vec<u64>,
    clock: u64,
}

impl LruSlots {
    pub fn new(slots: usize) -> Result<Self> {
        if slots == 0 || slots > u32::MAX as usize {
            return Err(RecsysError::invalid(
                "row cache",
                format!("{slots} slots; a table's cache needs 1 ..= 2^32 - 1 slots"),
            ));
        }
        Ok(LruSlots {
            slot_of: FxHashMap::default(),
            row_of: vec![None; slots],
            by_use: (0..slots as u32).map(|s| (0, s)).collect(),
            last_use: vec![0; slots],
            clock: 0,
        })
    }

    pub fn slots(&self) -> usize {
        self.row_of.len()
    }

    /// The slot of `row`, if cached.
    pub fn slot(&self, row: u32) -> Option<u32> {
        self.slot_of.get(&row).copied()
    }

    /// The row in `slot`, if any.
    pub fn row(&self, slot: u32) -> Option<u32> {
        self.row_of[slot as usize]
    }

    fn touch(&mut self, slot: u32) {
        let s = slot as usize;
        self.by_use.remove(&(self.last_use[s], slot));
        self.last_use[s] = self.clock;
        self.by_use.insert((self.clock, slot));
    }

    /// Makes every row of `rows` (one batch's rows of this table, repeats allowed) cached and
    /// most recently used, and says what moved. Fails, changing nothing, when the batch has more
    /// distinct rows than the cache has slots.
    pub fn plan(&mut self, rows: &[u32]) -> Result<SlotPlan> {
        let mut distinct: Vec<u32> = Vec::with_capacity(rows.len());
        let mut seen = FxHashSet::default();
        seen.reserve(rows.len());
        for &r in rows {
            if seen.insert(r) {
                distinct.push(r);
            }
        }
        if distinct.len() > self.slots() {
            return Err(RecsysError::invalid(
                "row cache",
                format!(
                    "a batch uses {} distinct rows of a table whose cache holds {}; give the cache more slots or use smaller batches",
                    distinct.len(),
                    self.slots()
                ),
            ));
        }
        self.clock += 1;
        let mut plan = SlotPlan::default();
        // Hits first, so that the batch's cached rows are the newest and never chosen below.
        let mut missing = Vec::new();
        for &r in &distinct {
            match self.slot(r) {
                Some(slot) => {
                    self.touch(slot);
                    plan.hits += 1;
                }
                None => missing.push(r),
            }
        }
        for r in missing {
            let &(stamp, slot) = self.by_use.first().expect("a cache has slots");
            debug_assert!(stamp < self.clock, "a slot of this batch would be evicted");
            if let Some(old) = self.row_of[slot as usize] {
                self.slot_of.remove(&old);
                plan.evictions.push((old, slot));
            }
            self.row_of[slot as usize] = Some(r);
            self.slot_of.insert(r, slot);
            self.touch(slot);
            plan.loads.push((r, slot));
        }
        Ok(plan)
    }

    /// Every `(row, slot)` cached, in slot order.
    pub fn cached(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        (self.row_of.iter().enumerate()).filter_map(|(s, r)| r.map(|r| (r, s as u32)))
    }
}
