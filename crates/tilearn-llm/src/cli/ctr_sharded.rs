//! `tilearn launch --nproc-per-node N ctr train …` (N > 1): the embedding tables sharded over
//! the ranks and the dense part data parallel, lookups and gradients exchanged with
//! all-to-all: on the CPU over the host communicator (tilearn-recsys'
//! `shard::ShardedCtrTrainer`); with `--device cuda` each rank's shard, its optimizer state
//! and the dense part on its GPU (`cuda::GpuShardedCtrTrainer`), the pooled embeddings, their
//! gradients and the dense gradient exchanged on device buffers over NCCL (default) or, with
//! `--ddp-backend host`, the host communicator staging them through pinned memory (ranks
//! sharing one GPU; NCCL refuses that); the ids and scalars always over the host.
//!
//! Every rank loads the same data and draws the same global batches of `--batch-size`; rank r
//! trains the r-th of N parts of each. `--shard table` places every table whole, largest first
//! on the least loaded rank; `--shard row` cuts every sum-pooled table into one row range per
//! rank; `--shard auto` (default) cuts the tables of at least `--shard-row-wise-rows` rows and
//! places the others whole. The plan is printed once (rank 0) as a JSON line (`shard_plan`). Rank 0 writes the log,
//! the checkpoints and the final model (gathered from the shards by every rank; a resume
//! re-shards them); the others print nothing.

use std::sync::Arc;

use clap::{Args, ValueEnum};
use tilearn_parallel::Communicator;
use tilearn_recsys::CtrModel;
use tilearn_recsys::shard::{ShardPlan, ShardedCtrTrainer};

use super::train_ranks::{DdpBackend, Ranks};
use crate::Result;

/// `--shard`: how the tables are placed on the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ShardMode {
    /// Tables of at least --shard-row-wise-rows rows row-wise, the others whole.
    Auto,
    /// Every table whole on one rank (table-wise).
    Table,
    /// Every sum-pooled table cut into one row range per rank (row-wise); mean-pooled ones
    /// whole.
    Row,
}

/// How a sharded run places the tables.
#[derive(Debug, Args)]
pub struct ShardArgs {
    /// Under `tilearn launch` with several ranks: `table` (each table whole on one rank),
    /// `row` (every sum-pooled table split over all ranks) or `auto`.
    #[arg(long, value_enum, default_value = "auto")]
    pub shard: ShardMode,
    /// With `--shard auto`: tables with at least this many rows (and sum pooling) are split
    /// row-wise over every rank; smaller ones are placed whole, largest first, on the rank
    /// holding the fewest rows so far.
    #[arg(long, default_value_t = 1_000_000)]
    pub shard_row_wise_rows: usize,
    /// Sharded GPU runs: what carries the device buffers (pooled embeddings, their gradients,
    /// the dense gradient): nccl (the default unless two ranks run on one GPU) or host
    /// (TCP through pinned memory; the default for ranks sharing a GPU).
    #[arg(long, value_enum)]
    pub ddp_backend: Option<DdpBackend>,
}

impl ShardArgs {
    /// The row count from which a sum-pooled table is split row-wise.
    fn row_wise_rows(&self) -> usize {
        match self.shard {
            ShardMode::Auto => self.shard_row_wise_rows,
            ShardMode::Table => usize::MAX,
            ShardMode::Row => 0,
        }
    }
}

/// The placement of `ctr`'s tables on the job's ranks, printed once (rank 0).
fn shard_plan(ctr: &CtrModel, ranks: &Ranks, args: &ShardArgs) -> Result<ShardPlan> {
    let world = ranks.group.world_size();
    let plan = ShardPlan::balanced(&ctr.tables.layout, world, args.row_wise_rows())?;
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
            "shard": args.shard.to_possible_value().map(|v| v.get_name().to_string()),
            // The threshold only means something for `auto`.
            "row_wise_rows": (args.shard == ShardMode::Auto).then_some(args.shard_row_wise_rows),
            "shards": per_rank,
        }});
        eprintln!("{line}");
    }
    Ok(plan)
}

/// This rank's sharded CPU trainer of `ctr` (the same freshly initialised model on every rank).
pub fn sharded_trainer(
    ctr: CtrModel,
    ranks: &Ranks,
    args: &ShardArgs,
) -> Result<ShardedCtrTrainer> {
    let plan = shard_plan(&ctr, ranks, args)?;
    let comm: Arc<dyn Communicator> = ranks.host.clone();
    Ok(ShardedCtrTrainer::new(comm, ctr, plan)?)
}

/// This rank's sharded GPU trainer of `ctr` on `stream`'s device, its MLP in `precision`.
#[cfg(feature = "cuda")]
pub fn gpu_sharded_trainer(
    ctr: CtrModel,
    ranks: &Ranks,
    args: &ShardArgs,
    stream: &Arc<cudarc::driver::CudaStream>,
    precision: super::ctr_gpu::PrecisionArg,
) -> Result<tilearn_recsys::cuda::GpuShardedCtrTrainer> {
    use tilearn_recsys::cuda::{GpuShardedCtrTrainer, MlpPrecision};
    let plan = shard_plan(&ctr, ranks, args)?;
    let device = ranks.gpu_gradient_communicator(args.ddp_backend, stream.clone())?;
    let host: Arc<dyn Communicator> = ranks.host.clone();
    let mut trainer = GpuShardedCtrTrainer::new(host, device, stream, ctr, plan)?;
    if precision == super::ctr_gpu::PrecisionArg::Bf16 {
        trainer.dense().set_mlp_precision(MlpPrecision::Bf16)?;
    }
    Ok(trainer)
}
