//! Where pooled shard rows go between a rank's `[batch, total_dim]` pooled output and the
//! owners' `[batch, shard width]` blocks, as lists of element copies `[src, dst, len]` (the
//! form `row_copy.cu`'s `tilearn_copy_rows` takes, so the GPU ranks run the same lists in one
//! launch each; the CPU ranks run them with [`apply_copies`] / [`add_copies`]).
//!
//! * Forward ([`assemble_rounds`]): owner `d`'s block of this rank's samples sits at
//!   `bases[d]` of a receive buffer; each block's columns go to their tables' columns of the
//!   output. A table-wise table has one owner; a row-wise one has a partial sum from every
//!   rank holding rows of it, so the copies come in rounds: round 0 writes the first
//!   contributor of every table (each output column exactly once), round `j` adds the `j`-th
//!   contributors, in rank order — the order in which one serial loop over the ranks would add
//!   them.
//! * Backward ([`scatter_copies`]): the output gradient's columns of owner `d`'s tables into
//!   its block at `bases[d]`, every element written once.
//!
//! Copies of consecutive tables that are contiguous on both sides are merged into one (up to
//! 1024 elements, so a warp's share stays small).

use super::plan::ShardPlan;

/// `[src, dst, len]` element offsets of one copy.
pub type Copy = [u64; 3];

/// The longest copy merging makes: `row_copy.cu` gives each copy one warp, so a batch-long
/// copy would run on one warp; 1024 elements are 8 float4 rounds of a warp.
const MERGED_MAX: u64 = 1024;

/// Appends `[src, dst, len]`, or extends the last copy when it ends where this one starts on
/// both sides (up to [`MERGED_MAX`] elements).
fn push(copies: &mut Vec<Copy>, src: usize, dst: usize, len: usize) {
    let (src, dst, len) = (src as u64, dst as u64, len as u64);
    if let Some(last) = copies.last_mut()
        && last[0] + last[2] == src
        && last[1] + last[2] == dst
        && last[2] + len <= MERGED_MAX
    {
        last[2] += len;
        return;
    }
    copies.push([src, dst, len]);
}

/// For every owner `d` and each of its shard tables (in shard order): (the table's column in
/// the shard block, its column in the output, dim, the round: how many lower ranks hold a
/// shard of the same table).
fn placements(plan: &ShardPlan) -> Vec<Vec<(usize, usize, usize, usize)>> {
    let layout = plan.layout();
    let mut contributors = vec![0usize; layout.num_tables()];
    (0..plan.world())
        .map(|d| {
            let mut col = 0;
            (plan.shard(d).iter())
                .map(|s| {
                    let dim = layout.specs()[s.table].dim;
                    let round = contributors[s.table];
                    contributors[s.table] += 1;
                    let p = (col, layout.col_offset()[s.table], dim, round);
                    col += dim;
                    p
                })
                .collect()
        })
        .collect()
}

/// The forward's copies, by round, for `batch` samples whose owner blocks sit at `bases[d]`
/// (one base per rank) of the receive buffer. Round 0 covers every output column once.
pub fn assemble_rounds(plan: &ShardPlan, batch: usize, bases: &[usize]) -> Vec<Vec<Copy>> {
    let total_dim = plan.layout().total_dim();
    let placed = placements(plan);
    let rounds = (placed.iter().flatten())
        .map(|p| p.3 + 1)
        .max()
        .unwrap_or(0);
    (0..rounds)
        .map(|round| {
            let mut copies = Vec::new();
            for sample in 0..batch {
                for (d, tables) in placed.iter().enumerate() {
                    let width = plan.shard_width(d);
                    for &(col, dst, dim, r) in tables {
                        if r == round {
                            let src = bases[d] + sample * width + col;
                            push(&mut copies, src, sample * total_dim + dst, dim);
                        }
                    }
                }
            }
            copies
        })
        .collect()
}

/// The backward's copies: `[batch, total_dim]` output-gradient columns into owner `d`'s block
/// (`[batch, shard width d]`) at `bases[d]`.
pub fn scatter_copies(plan: &ShardPlan, batch: usize, bases: &[usize]) -> Vec<Copy> {
    let total_dim = plan.layout().total_dim();
    let mut copies = Vec::new();
    for (d, tables) in placements(plan).iter().enumerate() {
        let width = plan.shard_width(d);
        for sample in 0..batch {
            for &(col, src, dim, _) in tables {
                push(
                    &mut copies,
                    sample * total_dim + src,
                    bases[d] + sample * width + col,
                    dim,
                );
            }
        }
    }
    copies
}

/// `dst[c.dst..][..c.len] = src[c.src..][..c.len]` for every copy (the CPU reference of
/// `tilearn_copy_rows`).
pub fn apply_copies(src: &[f32], dst: &mut [f32], copies: &[Copy]) {
    for &[s, d, len] in copies {
        let (s, d, len) = (s as usize, d as usize, len as usize);
        dst[d..d + len].copy_from_slice(&src[s..s + len]);
    }
}

/// `dst[c.dst..][..c.len] += src[c.src..][..c.len]` for every copy.
pub fn add_copies(src: &[f32], dst: &mut [f32], copies: &[Copy]) {
    for &[s, d, len] in copies {
        let (s, d, len) = (s as usize, d as usize, len as usize);
        for (o, &x) in dst[d..d + len].iter_mut().zip(&src[s..s + len]) {
            *o += x;
        }
    }
}

/// The forward's assembly on the CPU: round 0 copied, later rounds added.
pub fn assemble(rounds: &[Vec<Copy>], received: &[f32], out: &mut [f32]) {
    for (round, copies) in rounds.iter().enumerate() {
        if round == 0 {
            apply_copies(received, out, copies);
        } else {
            add_copies(received, out, copies);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::Sharding;
    use crate::tables::{Pooling, TableLayout, TableSpec};

    fn layout() -> TableLayout {
        let spec = |rows, dim, pooling| TableSpec { rows, dim, pooling };
        TableLayout::new(vec![
            spec(10, 3, Pooling::Sum),
            spec(7, 2, Pooling::Mean),
            spec(5, 4, Pooling::Sum),
            spec(9, 1, Pooling::Sum),
        ])
        .unwrap()
    }

    /// Row-wise table 0, table-wise 1 → rank 1, row-wise 2, table-wise 3 → rank 0 on 3 ranks;
    /// the copies against a direct loop over (rank, shard table, sample) on random blocks.
    #[test]
    fn copies_place_every_column_as_a_loop_over_the_shards_would() {
        let layout = layout();
        let placement = [
            Sharding::RowWise,
            Sharding::TableWise { owner: 1 },
            Sharding::RowWise,
            Sharding::TableWise { owner: 0 },
        ];
        let plan = ShardPlan::new(&layout, &placement, 3).unwrap();
        let (batch, total_dim) = (5, layout.total_dim());
        // Blocks with a gap between them, so a wrong base shows.
        let mut bases = Vec::new();
        let mut len = 0;
        for d in 0..3 {
            bases.push(len);
            len += batch * plan.shard_width(d) + 3;
        }
        let received: Vec<f32> = (0..len)
            .map(|i| ((i * 37 % 101) as f32) * 0.25 - 9.0)
            .collect();
        let mut want = vec![0.0f32; batch * total_dim];
        for d in 0..3 {
            let mut col = 0;
            for s in plan.shard(d) {
                let dim = layout.specs()[s.table].dim;
                for b in 0..batch {
                    for j in 0..dim {
                        let x = received[bases[d] + b * plan.shard_width(d) + col + j];
                        want[b * total_dim + layout.col_offset()[s.table] + j] += x;
                    }
                }
                col += dim;
            }
        }
        let rounds = assemble_rounds(&plan, batch, &bases);
        // Row-wise tables have 3 contributors: rounds 0, 1, 2.
        assert_eq!(rounds.len(), 3);
        let mut got = vec![f32::NAN; batch * total_dim];
        assemble(&rounds, &received, &mut got);
        assert_eq!(got, want);

        // Backward: each block gets exactly its tables' columns; the gaps stay untouched.
        let dout: Vec<f32> = (0..batch * total_dim).map(|i| i as f32 + 0.5).collect();
        let mut blocks = vec![-1.0f32; len];
        apply_copies(&dout, &mut blocks, &scatter_copies(&plan, batch, &bases));
        for d in 0..3 {
            let w = plan.shard_width(d);
            let mut col = 0;
            for s in plan.shard(d) {
                let dim = layout.specs()[s.table].dim;
                for b in 0..batch {
                    for j in 0..dim {
                        let src = b * total_dim + layout.col_offset()[s.table] + j;
                        assert_eq!(blocks[bases[d] + b * w + col + j], dout[src]);
                    }
                }
                col += dim;
            }
            let end = bases[d] + batch * w;
            assert_eq!(&blocks[end..end + 3], &[-1.0; 3], "gap after block {d}");
        }
    }

    /// One rank holding everything: the block is the output itself, so 300 samples of 10
    /// columns become 3 copies of at most 1024 elements covering it in order.
    #[test]
    fn contiguous_copies_merge_up_to_1024_elements() {
        let layout = layout();
        let plan = ShardPlan::new(&layout, &[Sharding::TableWise { owner: 0 }; 4], 1).unwrap();
        let rounds = assemble_rounds(&plan, 300, &[0]);
        assert_eq!(rounds.len(), 1);
        for copies in [&rounds[0], &scatter_copies(&plan, 300, &[0])] {
            assert_eq!(copies.len(), 3, "{copies:?}");
            let mut at = 0;
            for &[src, dst, len] in copies {
                assert!(src == at && dst == at && len <= MERGED_MAX, "{copies:?}");
                at += len;
            }
            assert_eq!(at, 3000);
        }
    }
}
