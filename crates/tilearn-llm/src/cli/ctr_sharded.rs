//! `tilearn launch --nproc-per-node N ctr train …` (N > 1): the embedding tables sharded over
//! the ranks and the dense part data parallel (tilearn-recsys' `shard::ShardedCtrTrainer`),
//! lookups and gradients exchanged with all-to-all over the host communicator.
//!
//! Every rank loads the same data and draws the same global batches of `--batch-size`; rank r
//! trains the r-th of N parts of each. `--shard-row-wise-rows` decides which tables are cut
//! into row ranges over every rank; the others go whole to the least loaded rank, largest
//! first. The plan is printed once (rank 0) as a JSON line (`shard_plan`). Rank 0 writes the log,
//! the checkpoints and the final model (gathered from the shards by every rank; a resume
//! re-shards them); the others print nothing.

use std::sync::Arc;

use clap::Args;
use tilearn_parallel::Communicator;
use tilearn_recsys::CtrModel;
use tilearn_recsys::shard::{ShardPlan, ShardedCtrTrainer};

use super::train_ranks::Ranks;
use crate::Result;

/// How a sharded run places the tables.
#[derive(Debug, Args)]
pub struct ShardArgs {
    /// Under `tilearn launch` with several ranks: tables with at least this many rows (and sum
    /// pooling) are split row-wise over every rank; smaller ones are placed whole, largest
    /// first, on the rank holding the fewest rows so far.
    #[arg(long, default_value_t = 1_000_000)]
    pub shard_row_wise_rows: usize,
}

/// This rank's sharded trainer of `ctr` (the same freshly initialised model on every rank).
pub fn sharded_trainer(
    ctr: CtrModel,
    ranks: &Ranks,
    args: &ShardArgs,
) -> Result<ShardedCtrTrainer> {
    let world = ranks.group.world_size();
    let plan = ShardPlan::balanced(&ctr.tables.layout, world, args.shard_row_wise_rows)?;
    if ranks.is_primary() {
        let per_rank: Vec<Vec<serde_json::Value>> = (0..world)
            .map(|r| {
                (plan.shard(r).iter())
                    .map(|s| serde_json::json!([s.table, s.rows.start, s.rows.end]))
                    .collect()
            })
            .collect();
        let line = serde_json::json!({"shard_plan": {
            "world": world,
            "row_wise_rows": args.shard_row_wise_rows,
            "shards": per_rank,
        }});
        eprintln!("{line}");
    }
    let comm: Arc<dyn Communicator> = ranks.host.clone();
    Ok(ShardedCtrTrainer::new(comm, ctr, plan)?)
}
