//! Hugging Face checkpoint I/O: `config.json` plus `model.safetensors`, or sharded
//! `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`.
//!
//! * [`load_params`] memory-maps the files and converts F32/BF16/F16 tensors to the f32
//!   [`ParamStore`](crate::params::ParamStore); missing, mis-shaped or unexpected tensors are
//!   errors naming the file and the tensor (a tied model's `lm_head.weight` and rotary
//!   `inv_freq` buffers are ignored, as transformers does).
//! * [`save_pretrained`] writes `config.json` and the weights in F32/BF16/F16, single-file or
//!   sharded; every file goes through [`tilearn_ops::fs::AtomicFile`] (`<name>.tmp`, fsync,
//!   rename), so an interrupted save never leaves a truncated file under the real name.
//! * Both stream ([`stream`]): saves read the values tensor by tensor from a [`TensorSource`]
//!   and loads decode into a [`TensorDest`] piece by piece, so the GPU engine saves and loads
//!   through a bounded staging buffer without a host copy of the model.

mod load;
mod qkv_interleave;
mod read_ahead;
mod safetensors_io;
mod save;
pub mod stream;

pub use crate::tensor_io::{TensorDest, TensorSource};
pub use load::{load_into, load_params, load_params_into};
pub use qkv_interleave::checkpoint_order;
pub(crate) use safetensors_io::{MappedFile, decode_into};
pub use safetensors_io::{NamedTensor, TensorRef, read_tensors_file, write_tensors_file};
pub use save::{DEFAULT_MAX_SHARD_BYTES, save_pretrained, save_pretrained_from};
pub use stream::{StreamedTensor, write_streamed};

/// Name of the single-file weights.
pub const SINGLE_FILE: &str = "model.safetensors";
/// Name of the shard index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Name of the configuration.
pub const CONFIG_FILE: &str = "config.json";

/// Name of shard `i` (1-based) of `n`, as transformers writes it.
pub fn shard_file_name(i: usize, n: usize) -> String {
    format!("model-{i:05}-of-{n:05}.safetensors")
}
