//! The CUDA path (feature `cuda`): the embedding-bag kernels of tilearn-kernels'
//! `embedding_bag.cu`, wrapped through tilearn-ops' launch builder
//! ([`tilearn_ops::cuda::launch::Launch`]) like every other kernel of the workspace.

mod embedding_bag;

pub use embedding_bag::{DeviceEmbeddingBag, DeviceJaggedBatch};
