//! tilearn-engine: Llama-family models, Hugging Face checkpoint I/O, the data pipeline and the
//! Trainer.

pub mod checkpoint;
pub mod config;
pub mod cuda_graphs;
pub mod data;
pub mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod grad_window;
pub mod lce_chunk;
pub mod memory_mode;
pub mod mlp_chunk;
pub mod model;
pub mod offload_checkpoints;
pub mod params;
pub mod plan;
pub mod weight_copy;
// Used by `gpu::staging`; compiled without the `cuda` feature too, so its tests run anywhere.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod staging_ring;
pub mod tensor_io;

pub mod trainer;

pub use error::{EngineError, Result};
