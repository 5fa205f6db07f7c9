//! tilearn-ops: the tensor type and every op of the Llama training path.
//!
//! Each op exists twice: a CPU reference in [`cpu`] (clear code, f32 or f64 accumulation,
//! multi-threaded where hot) and a hand-written CUDA kernel under the `cuda` feature. The CPU
//! reference is the oracle for the CUDA tests and is what runs on a machine without a GPU.
//!
//! Gradient convention for every backward: gradients of *activations* are written (`=`),
//! gradients of *parameters* are accumulated (`+=`) so micro-batches can add into one buffer.

pub mod alibi;
pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod fs;
pub mod key_mask;
pub(crate) mod shape;
pub mod tensor;

pub use alibi::alibi_slopes;
pub use dtype::{DType, ParseDTypeError};
pub use error::{OpsError, Result};
pub use key_mask::{KeyMask, check_positions, key_start};
pub use tensor::{Device, Tensor};
