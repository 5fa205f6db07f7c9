//! The CUDA path (feature `cuda`): the embedding-bag kernels of tilearn-kernels'
//! `embedding_bag.cu`, wrapped through tilearn-ops' launch builder
//! ([`tilearn_ops::cuda::launch::Launch`]) like every other kernel of the workspace; the CTR
//! head's non-GEMM parts of `ctr_head.cu` ([`ctr_head`]); and the whole GPU training step of
//! DeepFM / Wide & Deep ([`DeviceCtrModel`], driven by the training loop as [`GpuCtrTrainer`]);
//! tables in pinned host memory behind a device cache of hot rows
//! ([`DeviceCachedEmbeddingBag`], its moves by `row_copy.cu`: [`row_copy`]), chosen per table
//! by [`DeviceRows`]; the MLP's GEMMs in bf16 with f32 master weights ([`Bf16Mlp`]); the
//! tables sharded over GPU ranks, the dense part data parallel ([`GpuShardedCtrTrainer`]).

mod cached_bag;
pub mod ctr_head;
mod ctr_model;
mod device_rows;
mod embedding_bag;
mod mlp_bf16;
pub mod row_copy;
mod sharded_trainer;

pub use cached_bag::DeviceCachedEmbeddingBag;
pub use ctr_model::{DeviceCtrModel, GpuCtrTrainer};
pub use device_rows::DeviceRows;
pub use embedding_bag::{DeviceEmbeddingBag, DeviceJaggedBatch};
pub use mlp_bf16::{Bf16Mlp, MlpPrecision};
pub use sharded_trainer::GpuShardedCtrTrainer;
