//! tilearn-engine: Llama-family models, Hugging Face checkpoint I/O, the data pipeline and the
//! Trainer.

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod model;
pub mod params;
pub mod tensor_io;

pub mod trainer;

pub use error::{EngineError, Result};
