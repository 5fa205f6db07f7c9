//! The CUDA path (feature `cuda`): the embedding-bag kernels of tilearn-kernels'
//! `embedding_bag.cu`, wrapped through tilearn-ops' launch builder
//! ([`tilearn_ops::cuda::launch::Launch`]) like every other kernel of the workspace; the CTR
//! head's non-GEMM parts of `ctr_head.cu` ([`ctr_head`]); and the whole GPU training step of
//! DeepFM / Wide & Deep ([`DeviceCtrModel`], driven by the training loop as [`GpuCtrTrainer`]);
//! tables in host memory behind a device cache of hot rows ([`DeviceCachedEmbeddingBag`]).

mod cached_bag;
pub mod ctr_head;
mod ctr_model;
mod embedding_bag;

pub use cached_bag::DeviceCachedEmbeddingBag;
pub use ctr_model::{DeviceCtrModel, GpuCtrTrainer};
pub use embedding_bag::{DeviceEmbeddingBag, DeviceJaggedBatch};
