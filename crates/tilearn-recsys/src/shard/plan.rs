//! Which rank holds which rows: each table either whole on one rank (table-wise) or cut into
//! one contiguous row range per rank (row-wise), TorchRec's two basic shardings.

use std::ops::Range;

use crate::error::{RecsysError, Result};
use crate::tables::{Pooling, TableLayout, TableSpec};

/// How one table is placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// The whole table on rank `owner`.
    TableWise { owner: usize },
    /// Rank `r` holds rows `chunk r` of `world` nearly equal chunks (sum pooling only: a
    /// rank's partial sum of a bag is added to the others', which a mean's `1/len` of the
    /// partial bag would not allow).
    RowWise,
}

/// One table of a rank's shard: global table `table`, its rows `rows`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardTable {
    pub table: usize,
    pub rows: Range<usize>,
}

/// A placement of every table of a layout on `world` ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardPlan {
    layout: TableLayout,
    world: usize,
    /// Per rank, its shard tables in global table order.
    shards: Vec<Vec<ShardTable>>,
}

/// Rows `index` of `rows` split into `parts` nearly equal chunks (the first `rows % parts` one
/// longer).
fn chunk(rows: usize, parts: usize, index: usize) -> Range<usize> {
    let (base, extra) = (rows / parts, rows % parts);
    let start = index * base + index.min(extra);
    start..start + base + usize::from(index < extra)
}

impl ShardPlan {
    /// Checks `placement` (one per table; owners below `world`; row-wise tables sum-pooled).
    pub fn new(layout: &TableLayout, placement: &[Sharding], world: usize) -> Result<Self> {
        let bad = |m: String| Err(RecsysError::invalid("shard plan", m));
        if world == 0 || placement.len() != layout.num_tables() {
            return bad(format!(
                "{} placements for {} tables on {world} ranks; give one per table and >= 1 rank",
                placement.len(),
                layout.num_tables()
            ));
        }
        let mut shards = vec![Vec::new(); world];
        for (t, (spec, place)) in layout.specs().iter().zip(placement).enumerate() {
            match *place {
                Sharding::TableWise { owner } if owner >= world => {
                    return bad(format!("table {t}: owner {owner} is not a rank of {world}"));
                }
                Sharding::TableWise { owner } => shards[owner].push(ShardTable {
                    table: t,
                    rows: 0..spec.rows,
                }),
                Sharding::RowWise if spec.pooling != Pooling::Sum => {
                    return bad(format!(
                        "table {t} is mean-pooled; row-wise sharding needs sum pooling (shard it table-wise)"
                    ));
                }
                Sharding::RowWise => {
                    for (r, shard) in shards.iter_mut().enumerate() {
                        let rows = chunk(spec.rows, world, r);
                        // A rank with no rows of a small table holds no shard of it.
                        if !rows.is_empty() {
                            shard.push(ShardTable { table: t, rows });
                        }
                    }
                }
            }
        }
        Ok(ShardPlan {
            layout: layout.clone(),
            world,
            shards,
        })
    }

    /// A placement of `layout` on `world` ranks: sum-pooled tables of at least
    /// `row_wise_rows` rows row-wise over every rank; the others table-wise, largest first,
    /// each to the rank holding the fewest elements so far (ties to the lowest rank).
    pub fn balanced(layout: &TableLayout, world: usize, row_wise_rows: usize) -> Result<Self> {
        let specs = layout.specs();
        let mut placement = vec![Sharding::RowWise; specs.len()];
        let mut load = vec![0usize; world.max(1)];
        let elements = |t: usize| specs[t].rows * specs[t].dim;
        let mut table_wise: Vec<usize> = (0..specs.len())
            .filter(|&t| specs[t].rows < row_wise_rows || specs[t].pooling != Pooling::Sum)
            .collect();
        // Largest first; equal sizes in table order (a stable sort), so every rank computes
        // the same plan.
        table_wise.sort_by_key(|&t| std::cmp::Reverse(elements(t)));
        for t in table_wise {
            let owner = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
            load[owner] += elements(t);
            placement[t] = Sharding::TableWise { owner };
        }
        ShardPlan::new(layout, &placement, world)
    }

    pub fn layout(&self) -> &TableLayout {
        &self.layout
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// The shard tables of `rank`.
    pub fn shard(&self, rank: usize) -> &[ShardTable] {
        &self.shards[rank]
    }

    /// The fused operator's tables of `rank`'s shard (`None` when it holds none).
    pub fn shard_layout(&self, rank: usize) -> Result<Option<TableLayout>> {
        let specs: Vec<TableSpec> = (self.shards[rank].iter())
            .map(|s| TableSpec {
                rows: s.rows.len(),
                ..self.layout.specs()[s.table]
            })
            .collect();
        if specs.is_empty() {
            Ok(None)
        } else {
            TableLayout::new(specs).map(Some)
        }
    }

    /// Width of `rank`'s pooled shard rows (the sum of its shard tables' dims).
    pub fn shard_width(&self, rank: usize) -> usize {
        (self.shards[rank].iter())
            .map(|s| self.layout.specs()[s.table].dim)
            .sum()
    }
}
