//! Which cache slot holds which row of one table, and which slot to give up next: least
//! recently used first, never a slot the current batch uses.
//!
//! The recency order is a doubly linked list over the slots (arrays of neighbours, no
//! allocation): a use moves the slot to the back, the victim is the front; both O(1), so a
//! batch of n distinct rows costs O(n) besides the hash lookups.

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
    /// The recency list: `prev` / `next` neighbour of each slot (`NONE` at the ends), from
    /// `front` (least recently used; free slots start there in slot order) to `back`.
    prev: Vec<u32>,
    next: Vec<u32>,
    front: u32,
    back: u32,
    /// The batch (clock value) that last used each slot.
    last_use: Vec<u64>,
    clock: u64,
}

/// No neighbour.
const NONE: u32 = u32::MAX;

impl LruSlots {
    pub fn new(slots: usize) -> Result<Self> {
        if slots == 0 || slots >= u32::MAX as usize {
            return Err(RecsysError::invalid(
                "row cache",
                format!("{slots} slots; a table's cache needs 1 ..= 2^32 - 2 slots"),
            ));
        }
        Ok(LruSlots {
            slot_of: FxHashMap::default(),
            row_of: vec![None; slots],
            prev: (0..slots as u32)
                .map(|s| s.checked_sub(1).unwrap_or(NONE))
                .collect(),
            next: (1..=slots as u32)
                .map(|s| if s < slots as u32 { s } else { NONE })
                .collect(),
            front: 0,
            back: slots as u32 - 1,
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

    /// Marks `slot` used by the current batch: to the back of the recency list.
    fn touch(&mut self, slot: u32) {
        let s = slot as usize;
        self.last_use[s] = self.clock;
        if self.back == slot {
            return;
        }
        // Unlink (not the back, so it has a next).
        let (p, n) = (self.prev[s], self.next[s]);
        if p == NONE {
            self.front = n;
        } else {
            self.next[p as usize] = n;
        }
        self.prev[n as usize] = p;
        // Append.
        self.prev[s] = self.back;
        self.next[s] = NONE;
        self.next[self.back as usize] = slot;
        self.back = slot;
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
            let slot = self.front;
            debug_assert!(
                self.last_use[slot as usize] < self.clock,
                "a slot of this batch would be evicted"
            );
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
