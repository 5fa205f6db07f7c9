//! A batch's row moves ([`RowMove`]) as flat copy lists, the form both caches carry out: the
//! host one with [`copy_elements`] (the reference), the device one with one launch of
//! `row_copy.cu` per list (pinned host tables read and written over the bus).
//!
//! A list holds `[src, dst, len]` element offsets per copy. `elements` copies whole rows of
//! per-element buffers (the weights, and Adam's two moments, which share their layout);
//! `rows` copies per-row buffers (row-wise Adagrad's accumulator, one f32 per stacked row).

use crate::sparse_optim::SparseOptimizer;
use crate::tables::TableLayout;

use super::planner::RowMove;

/// Copies in one direction (cache → backing or backing → cache).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowCopies {
    /// Of per-element buffers: weights (and Adam's moments).
    pub elements: Vec<[u64; 3]>,
    /// Of per-row buffers: row-wise Adagrad's accumulators.
    pub rows: Vec<[u64; 3]>,
}

impl RowCopies {
    pub fn is_empty(&self) -> bool {
        self.elements.is_empty()
    }

    /// Rows copied.
    pub fn len(&self) -> usize {
        self.elements.len()
    }

    fn push(&mut self, from: (&TableLayout, usize), to: (&TableLayout, usize), t: usize) {
        let ((src, src_row), (dst, dst_row)) = (from, to);
        let dim = src.specs()[t].dim as u64;
        let src_el = src.row_range(t, src_row).start as u64;
        let dst_el = dst.row_range(t, dst_row).start as u64;
        self.elements.push([src_el, dst_el, dim]);
        let (src_r, dst_r) = (src.row_base()[t] + src_row, dst.row_base()[t] + dst_row);
        self.rows.push([src_r as u64, dst_r as u64, 1]);
    }

    /// Bytes these copies move for `optimizer`'s weights and state.
    pub fn bytes(&self, optimizer: &SparseOptimizer) -> u64 {
        let elements: u64 = self.elements.iter().map(|c| c[2]).sum();
        let per_element = match optimizer {
            SparseOptimizer::Adam { .. } => 3,
            _ => 1,
        };
        let per_row = match optimizer {
            SparseOptimizer::RowWiseAdagrad { .. } => self.rows.len() as u64,
            _ => 0,
        };
        4 * (elements * per_element + per_row)
    }
}

/// The copies of one batch's moves: write-backs (cache → backing) first, then loads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchCopies {
    pub write_backs: RowCopies,
    pub loads: RowCopies,
}

impl BatchCopies {
    /// The copies of `moves` between tables of the `backing` layout and the `cache` layout.
    pub fn new(moves: &[RowMove], backing: &TableLayout, cache: &TableLayout) -> Self {
        let mut copies = BatchCopies::default();
        for &m in moves {
            match m {
                RowMove::WriteBack { table, row, slot } => {
                    copies
                        .write_backs
                        .push((cache, slot as usize), (backing, row as usize), table)
                }
                RowMove::Load { table, row, slot } => {
                    copies
                        .loads
                        .push((backing, row as usize), (cache, slot as usize), table)
                }
            }
        }
        copies
    }

    /// Whole tables `tables` in one copy each: backing → cache (`to_cache`) or back. For the
    /// tables that live entirely in the cache.
    pub fn whole_tables(
        tables: &[usize],
        backing: &TableLayout,
        cache: &TableLayout,
        to_cache: bool,
    ) -> RowCopies {
        let mut copies = RowCopies::default();
        for &t in tables {
            let rows = backing.specs()[t].rows as u64;
            let dim = backing.specs()[t].dim as u64;
            let (b_el, c_el) = (
                backing.weight_offset()[t] as u64,
                cache.weight_offset()[t] as u64,
            );
            let (b_row, c_row) = (backing.row_base()[t] as u64, cache.row_base()[t] as u64);
            if to_cache {
                copies.elements.push([b_el, c_el, rows * dim]);
                copies.rows.push([b_row, c_row, rows]);
            } else {
                copies.elements.push([c_el, b_el, rows * dim]);
                copies.rows.push([c_row, b_row, rows]);
            }
        }
        copies
    }
}

/// Carries out `copies` (`[src, dst, len]` element offsets) from `src` into `dst`: the
/// reference of `row_copy.cu`. Every copy must lie inside both buffers.
pub fn copy_elements(src: &[f32], dst: &mut [f32], copies: &[[u64; 3]]) {
    for &[from, to, len] in copies {
        let (from, to, len) = (from as usize, to as usize, len as usize);
        dst[to..to + len].copy_from_slice(&src[from..from + len]);
    }
}

/// The copy lists each optimizer buffer takes: (state1's, whether state2 is copied too).
pub fn state_copies<'a>(
    optimizer: &SparseOptimizer,
    copies: &'a RowCopies,
) -> (&'a [[u64; 3]], bool) {
    match optimizer {
        SparseOptimizer::Sgd { .. } => (&[], false),
        SparseOptimizer::RowWiseAdagrad { .. } => (&copies.rows, false),
        SparseOptimizer::Adam { .. } => (&copies.elements, true),
    }
}
