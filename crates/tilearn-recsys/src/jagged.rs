//! A batch of jagged ids for every table: bag `(t, b)` (table `t`, sample `b`) holds
//! `ids[offsets[t * batch + b] .. offsets[t * batch + b + 1]]`, table-major as FBGEMM's TBE
//! takes them. Ids are row numbers already inside their table: raw categorical values go
//! through [`JaggedBatch::from_raw`], which hashes them into each table's size.

use std::ops::Range;

use rayon::prelude::*;

use crate::error::{RecsysError, Result};
use crate::hash::hash_to_row;
use crate::tables::TableLayout;

/// Jagged ids of one batch. Constructed only through checks, so every id is inside its table
/// and the offsets are a valid partition: the kernels rely on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JaggedBatch {
    num_tables: usize,
    batch: usize,
    offsets: Vec<u32>,
    ids: Vec<u32>,
}

impl JaggedBatch {
    /// Checks that `offsets` has `num_tables * batch + 1` entries, starts at 0, never decreases
    /// and ends at `ids.len()`, and that every id of table `t` is below its row count.
    pub fn new(
        layout: &TableLayout,
        batch: usize,
        offsets: Vec<u32>,
        ids: Vec<u32>,
    ) -> Result<Self> {
        check_offsets(layout.num_tables(), batch, &offsets, ids.len())?;
        let this = JaggedBatch {
            num_tables: layout.num_tables(),
            batch,
            offsets,
            ids,
        };
        for (t, spec) in layout.specs().iter().enumerate() {
            let entries = this.table_entries(t);
            if let Some(j) = this.ids[entries.clone()]
                .iter()
                .position(|&id| id as usize >= spec.rows)
            {
                return Err(RecsysError::RowOutOfRange {
                    table: t,
                    entry: entries.start + j,
                    id: this.ids[entries.start + j],
                    rows: spec.rows,
                });
            }
        }
        Ok(this)
    }

    /// Raw categorical values (same offsets) hashed into each table's rows with
    /// [`hash_to_row`].
    pub fn from_raw(
        layout: &TableLayout,
        batch: usize,
        offsets: Vec<u32>,
        raw: &[u64],
    ) -> Result<Self> {
        check_offsets(layout.num_tables(), batch, &offsets, raw.len())?;
        let mut ids = vec![0u32; raw.len()];
        for (t, spec) in layout.specs().iter().enumerate() {
            let entries = offsets[t * batch] as usize..offsets[(t + 1) * batch] as usize;
            // Hashing is most of the host work of a training step: spread over the cores for
            // large batches (each id depends only on its own value, so the result is the same).
            ids[entries.clone()]
                .par_iter_mut()
                .zip(raw[entries].par_iter())
                .with_min_len(8192)
                .for_each(|(id, &value)| *id = hash_to_row(value, spec.rows));
        }
        Ok(JaggedBatch {
            num_tables: layout.num_tables(),
            batch,
            offsets,
            ids,
        })
    }

    /// Fails unless the batch has one set of bags per table of `layout` (its ids were checked
    /// against a layout with that many tables when it was built).
    pub fn check_layout(&self, layout: &TableLayout) -> Result<()> {
        if self.num_tables == layout.num_tables() {
            Ok(())
        } else {
            Err(RecsysError::invalid(
                "jagged batch",
                format!(
                    "{} tables in the batch, {} in the operator",
                    self.num_tables,
                    layout.num_tables()
                ),
            ))
        }
    }

    pub fn num_tables(&self) -> usize {
        self.num_tables
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn offsets(&self) -> &[u32] {
        &self.offsets
    }

    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The entry range of bag `(t, b)`.
    pub fn bag(&self, t: usize, b: usize) -> Range<usize> {
        let k = t * self.batch + b;
        self.offsets[k] as usize..self.offsets[k + 1] as usize
    }

    /// The entry range of all bags of table `t`.
    pub fn table_entries(&self, t: usize) -> Range<usize> {
        self.offsets[t * self.batch] as usize..self.offsets[(t + 1) * self.batch] as usize
    }
}

fn check_offsets(num_tables: usize, batch: usize, offsets: &[u32], entries: usize) -> Result<()> {
    let bags = num_tables * batch;
    let bad = |message: String| Err(RecsysError::invalid("jagged offsets", message));
    if offsets.len() != bags + 1 {
        return bad(format!(
            "{} offsets for {num_tables} tables x {batch} samples; expected {}",
            offsets.len(),
            bags + 1
        ));
    }
    if offsets[0] != 0 {
        return bad(format!("offsets must start at 0, not {}", offsets[0]));
    }
    if let Some(k) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return bad(format!(
            "offsets decrease at bag {k} ({} -> {})",
            offsets[k],
            offsets[k + 1]
        ));
    }
    if offsets[bags] as usize != entries {
        return bad(format!(
            "the last offset is {} but {entries} ids were given",
            offsets[bags]
        ));
    }
    Ok(())
}
