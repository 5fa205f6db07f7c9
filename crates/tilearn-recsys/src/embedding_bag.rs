//! The CPU reference of the fused multi-table embedding bag: the pooled forward and the backward
//! fused with the sparse optimizer. The CUDA kernels (`embedding_bag.cu`) compute the same
//! values in the same order.
//!
//! Forward: `out[b, col_t + c] = scale_t(len) * sum_{j in bag(t, b)} W_t[ids[j], c]`, the sum
//! taken in entry order and multiplied by the pooling scale once.
//!
//! Backward + update: every entry `j` of bag `(t, b)` contributes `dout[b, col_t + c] *
//! scale_t(len)` to row `ids[j]` of table `t`. The entries are sorted by stacked row (stable,
//! so each row's contributions stay in entry order), each run of equal rows is reduced into one
//! gradient row, and the optimizer updates that row in place. The reduction order is the CUDA
//! kernel's, so SGD and SparseAdam match it bit for bit: the run is cut into chunks of
//! [`GRAD_CHUNK`] entries from its start, each chunk is summed from 0 in entry order, and the
//! gradient is 0 plus the chunk sums in chunk order (the kernel sums the chunks of a zipf-hot
//! row in parallel). No dense gradient exists; the
//! work and memory are proportional to the number of entries. Bit-identical from run to run.

use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::sparse_optim::SparseState;
use crate::tables::{EmbeddingTables, TableLayout};

fn check_batch(
    layout: &TableLayout,
    batch: &JaggedBatch,
    what: &'static str,
    len: usize,
) -> Result<()> {
    batch.check_layout(layout)?;
    let expected = batch.batch() * layout.total_dim();
    if len != expected {
        return Err(RecsysError::invalid(
            what,
            format!(
                "{len} values; a batch of {} x {} needs {expected}",
                batch.batch(),
                layout.total_dim()
            ),
        ));
    }
    Ok(())
}

/// The pooled lookup of every bag into `out` (`[batch, total_dim]`, written `=`).
pub fn embedding_bag_forward(
    tables: &EmbeddingTables,
    batch: &JaggedBatch,
    out: &mut [f32],
) -> Result<()> {
    let layout = &tables.layout;
    check_batch(layout, batch, "pooled output", out.len())?;
    let width = layout.total_dim();
    for (t, spec) in layout.specs().iter().enumerate() {
        let col = layout.col_offset()[t];
        for b in 0..batch.batch() {
            let bag = batch.bag(t, b);
            let scale = spec.pooling.scale(bag.len());
            let dst = &mut out[b * width + col..b * width + col + spec.dim];
            dst.fill(0.0);
            for &id in &batch.ids()[bag] {
                for (o, &w) in dst.iter_mut().zip(tables.row(t, id as usize)) {
                    *o += w;
                }
            }
            for o in dst.iter_mut() {
                *o *= scale;
            }
        }
    }
    Ok(())
}

/// Entries per chunk of a row's gradient sum (tilearn-kernels' `TILEARN_BAG_GRAD_CHUNK`).
pub const GRAD_CHUNK: usize = 32;

/// One contribution to a row's gradient: the stacked row, the entry index (the tie-break that
/// keeps entry order) and the bag it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Contribution {
    row: u32,
    entry: u32,
    table: u32,
    sample: u32,
}

/// The entries sorted by (stacked row, entry): the de-duplication order of the backward.
fn sorted_contributions(layout: &TableLayout, batch: &JaggedBatch) -> Vec<Contribution> {
    let mut all = Vec::with_capacity(batch.ids().len());
    for t in 0..layout.num_tables() {
        let base = layout.row_base()[t] as u32;
        for b in 0..batch.batch() {
            for j in batch.bag(t, b) {
                all.push(Contribution {
                    row: base + batch.ids()[j],
                    entry: j as u32,
                    table: t as u32,
                    sample: b as u32,
                });
            }
        }
    }
    // Keys are unique (the entry), so the unstable sort is deterministic.
    all.sort_unstable();
    all
}

/// Backward of [`embedding_bag_forward`] fused with the optimizer step of `state`: each row
/// that occurs in `batch` gets its summed gradient from `dout` (`[batch, total_dim]`) and is
/// updated in place; other rows and their state are untouched. Counts one optimizer step.
/// Returns the number of distinct rows updated.
pub fn embedding_bag_backward_update(
    tables: &mut EmbeddingTables,
    batch: &JaggedBatch,
    dout: &[f32],
    state: &mut SparseState,
) -> Result<usize> {
    let layout = &tables.layout;
    check_batch(layout, batch, "pooled gradient", dout.len())?;
    let width = layout.total_dim();
    let contributions = sorted_contributions(layout, batch);
    let rule = state.begin_step();
    let max_dim = layout.specs().iter().map(|s| s.dim).max().unwrap_or(0);
    let mut grad = vec![0.0f32; max_dim];
    let mut chunk_sum = vec![0.0f32; max_dim];
    let mut unique = 0;
    for run in contributions.chunk_by(|a, b| a.row == b.row) {
        let t = run[0].table as usize;
        let spec = layout.specs()[t];
        let col = layout.col_offset()[t];
        let g = &mut grad[..spec.dim];
        g.fill(0.0);
        for chunk in run.chunks(GRAD_CHUNK) {
            let p = &mut chunk_sum[..spec.dim];
            p.fill(0.0);
            for c in chunk {
                let b = c.sample as usize;
                let scale = spec.pooling.scale(batch.bag(t, b).len());
                for (p, &d) in p
                    .iter_mut()
                    .zip(&dout[b * width + col..b * width + col + spec.dim])
                {
                    *p += d * scale;
                }
            }
            for (g, &p) in g.iter_mut().zip(p.iter()) {
                *g += p;
            }
        }
        let row = run[0].row as usize - layout.row_base()[t];
        let elements = layout.row_range(t, row);
        rule.apply(
            &mut tables.weights[elements.clone()],
            g,
            state.row_mut(run[0].row as usize, elements),
        );
        unique += 1;
    }
    Ok(unique)
}
