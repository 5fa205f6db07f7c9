//! The fused embedding bag sharded over the ranks of a tilearn-parallel [`Communicator`]
//! (tables too large or too many for one device): a [`ShardPlan`] places each table whole on
//! one rank or cut into row ranges, and [`ShardedEmbeddingBag`] runs the forward and the fused
//! backward + sparse rule with three all-to-all exchanges a step ([`exchange`]: messages of any
//! length over the communicator's equal-shard `all_to_all`). Host buffers; the CPU tests run
//! several ranks in one process over the host communicator. [`ShardedCtrTrainer`] trains a
//! whole CTR model this way (`tilearn launch --nproc-per-node N ctr train`): sharded tables,
//! data-parallel dense part. [`columns`] lists where exchanged pooled rows go, for these CPU
//! ranks and for the GPU ranks of `cuda::GpuShardedCtrTrainer` alike.
//!
//! [`Communicator`]: tilearn_parallel::Communicator

pub mod columns;
pub mod exchange;
mod plan;
pub(crate) mod sharded_bag;
mod trainer;

pub use plan::{ShardPlan, ShardTable, Sharding};
pub use sharded_bag::{GatheredTables, ShardedEmbeddingBag, ShardedForward};
pub use trainer::ShardedCtrTrainer;
