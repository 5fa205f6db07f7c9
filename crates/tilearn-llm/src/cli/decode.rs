//! Generation on the engine the device flag chose, for `tilearn generate` and the samples at the
//! end of `tilearn train`: the CUDA engine's `GpuDecoder` (KV cache in device memory, in the
//! given precision) or the CPU's cached decoder (always f32).

use tilearn_engine::model::LlamaForCausalLM;
use tilearn_engine::model::generate::{GenerateOptions, Generation, generate};
use tilearn_ops::DType;

use crate::Result;

/// Where and how generation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DecodeDevice {
    pub on_gpu: bool,
    /// Storage type of weights, activations and cache on the GPU (the CPU always runs f32).
    pub precision: DType,
}

impl DecodeDevice {
    /// For messages: `the GPU (bf16)` or `the CPU`.
    pub(crate) fn describe(&self) -> String {
        if self.on_gpu {
            format!("the GPU ({})", self.precision)
        } else {
            "the CPU".to_string()
        }
    }
}

/// Continues each prompt with `options` on `device`, loading the model onto the GPU once for
/// all of them (its cache sized for the longest).
pub(crate) fn generate_all(
    device: DecodeDevice,
    model: &LlamaForCausalLM,
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
) -> Result<Vec<Generation>> {
    if device.on_gpu {
        return gpu::generate_all(device.precision, model, prompts, options);
    }
    prompts
        .iter()
        .map(|p| Ok(generate(model, p, options)?))
        .collect()
}

/// Continues one prompt (see [`generate_all`]).
pub(crate) fn generate_one(
    device: DecodeDevice,
    model: &LlamaForCausalLM,
    prompt: &[u32],
    options: &GenerateOptions,
) -> Result<Generation> {
    if !device.on_gpu {
        return Ok(generate(model, prompt, options)?);
    }
    let mut all = gpu::generate_all(device.precision, model, &[prompt.to_vec()], options)?;
    Ok(all.swap_remove(0))
}

#[cfg(feature = "cuda")]
mod gpu {
    use tilearn_engine::gpu::GpuDecoder;
    use tilearn_engine::model::generate::generate_with;
    use tilearn_ops::cuda::GpuDevice;

    use super::*;

    pub(super) fn generate_all(
        precision: DType,
        model: &LlamaForCausalLM,
        prompts: &[Vec<u32>],
        options: &GenerateOptions,
    ) -> Result<Vec<Generation>> {
        let device = GpuDevice::new(super::super::device::local_gpu())?;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let mut decoder =
            GpuDecoder::new(&device, model, precision, longest + options.max_new_tokens)?;
        prompts
            .iter()
            .map(|p| Ok(generate_with(&mut decoder, p, options)?))
            .collect()
    }
}

#[cfg(not(feature = "cuda"))]
mod gpu {
    use super::*;
    use crate::LlmError;

    /// Unreachable in practice: `choose_device` never picks the GPU in a build without CUDA.
    pub(super) fn generate_all(
        _precision: DType,
        _model: &LlamaForCausalLM,
        _prompts: &[Vec<u32>],
        _options: &GenerateOptions,
    ) -> Result<Vec<Generation>> {
        Err(LlmError::Usage {
            flag: "--device cuda".into(),
            message: "this build has no CUDA kernels; rebuild with --features cuda or use \
                      --device cpu"
                .into(),
        })
    }
}
