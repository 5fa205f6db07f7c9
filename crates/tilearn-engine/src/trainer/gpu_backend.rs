//! The CUDA engine ([`GpuLlama`]) as a [`StepBackend`].
//!
//! The precision is fixed when the engine is built (bf16 mixed precision with fp32 master
//! weights, or fp32): the Trainer refuses adaptive or fp16 plans on this backend before the
//! first step. Clipping happens inside the fused AdamW kernel, so `clip_grad_norm` only records
//! the limit and `optimizer_step` reports the norm it measured. Checkpoints use the CPU
//! formats: weights downloaded into a `LlamaForCausalLM`, moments into a CPU `AdamW`, so a run
//! saved on the GPU resumes on either device.

use std::path::Path;

use adaptfp16::Precision;
use tilearn_ops::cuda::GpuDevice;
use tilearn_optim::AdamW;

use super::backend::StepBackend;
use super::{TrainingArguments, adamw_for};
use crate::data::Batch;
use crate::gpu::{self, GpuLlama};
use crate::model::LlamaForCausalLM;
use crate::{EngineError, Result};

pub struct GpuBackend {
    gpu: GpuLlama,
    precision: Precision,
    /// Host copy for saving, refreshed on demand.
    host: LlamaForCausalLM,
    /// Holds the optimizer's configuration and groups; its moments are filled from the device
    /// only when saving.
    cpu_optimizer: AdamW,
    max_grad_norm: f64,
    name: String,
}

impl GpuBackend {
    /// Uploads `model` to GPU `ordinal` and sets up the fused AdamW as `args` say.
    pub fn new(
        model: LlamaForCausalLM,
        args: &TrainingArguments,
        ordinal: usize,
        precision: Precision,
    ) -> Result<GpuBackend> {
        let engine_precision = match precision {
            Precision::Bf16 => gpu::Precision::Bf16,
            Precision::Fp32 => gpu::Precision::F32,
            Precision::Fp16 => {
                return Err(EngineError::InvalidArgument {
                    argument: "--fp16".into(),
                    message: "the CUDA engine trains in bf16 or fp32; use --bf16 (no loss scaling needed) or --device cpu".into(),
                });
            }
        };
        let device = GpuDevice::new(ordinal)?;
        let mut gpu = GpuLlama::new(
            &device,
            &model,
            args.per_device_train_batch_size,
            args.seq_len,
            engine_precision,
        )?;
        let cpu_optimizer = adamw_for(args, &model.params)?;
        gpu.configure_optimizer(
            *cpu_optimizer.config(),
            cpu_optimizer.groups().to_vec(),
            args.max_grad_norm,
        )?;
        let name = format!(
            "cuda:{ordinal} {} ({precision})",
            device.name().unwrap_or_else(|_| "GPU".into())
        );
        Ok(GpuBackend {
            gpu,
            precision,
            host: model,
            cpu_optimizer,
            max_grad_norm: args.max_grad_norm,
            name,
        })
    }
}

impl StepBackend for GpuBackend {
    fn describe(&self) -> String {
        self.name.clone()
    }

    fn supports(&self, precision: Precision) -> bool {
        precision == self.precision
    }

    fn zero_grads(&mut self) {
        // A failure here surfaces at the next launch on the same stream.
        let _ = self.gpu.zero_grad();
    }

    fn forward_backward(
        &mut self,
        batch: &Batch,
        denominator: f64,
        precision: Precision,
        loss_scale: f32,
    ) -> Result<f64> {
        if precision != self.precision || loss_scale != 1.0 {
            return Err(EngineError::InvalidArgument {
                argument: "precision".into(),
                message: format!(
                    "the CUDA engine was built for {}; it cannot run a {precision} period",
                    self.precision
                ),
            });
        }
        let stats = self.gpu.forward_backward(
            &batch.input_ids,
            &batch.labels,
            batch.batch,
            batch.seq_len,
            Some(denominator),
        )?;
        Ok(stats.loss_sum)
    }

    fn unscale_and_check(&mut self, _inv_scale: f32) -> bool {
        // Never called: the GPU engine has no fp16 mode, so no step goes through the scaler.
        false
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        debug_assert_eq!(
            max_norm, self.max_grad_norm,
            "clipping is configured at build"
        );
        0.0
    }

    fn optimizer_step(&mut self, lr: f32) -> Result<Option<f64>> {
        self.gpu.step(lr)?;
        Ok(Some(self.gpu.last_grad_norm()?))
    }

    fn model(&mut self) -> Result<&LlamaForCausalLM> {
        self.host.params = self.gpu.download_params()?;
        Ok(&self.host)
    }

    fn save_optimizer(&mut self, path: &Path) -> Result<()> {
        let (m, v) = self.gpu.download_optimizer_moments()?;
        let step = self.gpu.optimizer().map_or(0, |o| o.step_count());
        self.cpu_optimizer.set_state(m, v, None, step)?;
        Ok(self.cpu_optimizer.save_state(path)?)
    }

    fn restore(&mut self, model: LlamaForCausalLM, optimizer_file: &Path) -> Result<()> {
        self.cpu_optimizer.load_state(optimizer_file)?;
        self.gpu.upload_params(&model.params)?;
        self.gpu.upload_optimizer_state(
            self.cpu_optimizer.exp_avg(),
            self.cpu_optimizer.exp_avg_sq(),
            self.cpu_optimizer.step_count(),
        )?;
        self.host = model;
        Ok(())
    }

    fn poison_gradients(&mut self) {}

    fn peak_memory_bytes(&self) -> u64 {
        self.gpu.memory().peak_bytes() as u64
    }
}
