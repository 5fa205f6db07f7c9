//! The CUDA engine ([`GpuLlama`]) as a [`StepBackend`].
//!
//! The engine is built for every precision the run's AMP plan may choose (fp32, bf16, fp16) and
//! switches between them per period without reallocating. fp16 periods run with the GradScaler:
//! the loss is scaled in the fused cross entropy, `unscale_and_check` reads the unscaled
//! gradient norm (the non-finite check), and the fused AdamW unscales and clips inside its
//! kernel. Clipping happens inside that kernel, so `clip_grad_norm` only records the limit and
//! `optimizer_step` reports the norm it measured. Checkpoints use the CPU
//! formats: weights downloaded into a `LlamaForCausalLM`, moments into a CPU `AdamW`, so a run
//! saved on the GPU resumes on either device.

use std::path::Path;

use tilearn_ops::DType;
use tilearn_ops::cuda::GpuDevice;
use tilearn_optim::AdamW;

use super::backend::StepBackend;
use super::{TrainingArguments, adamw_for};
use crate::Result;
use crate::data::Batch;
use crate::gpu::GpuLlama;
use crate::model::LlamaForCausalLM;

pub struct GpuBackend {
    gpu: GpuLlama,
    /// Host copy for saving, refreshed on demand.
    host: LlamaForCausalLM,
    /// Holds the optimizer's configuration and groups; its moments are filled from the device
    /// only when saving.
    cpu_optimizer: AdamW,
    max_grad_norm: f64,
    name: String,
}

impl GpuBackend {
    /// Uploads `model` to GPU `ordinal`, ready to run any of `precisions` (the AMP plan's
    /// possible precisions; the first is the initial one), and sets up the fused AdamW as
    /// `args` say.
    pub fn new(
        model: LlamaForCausalLM,
        args: &TrainingArguments,
        ordinal: usize,
        precisions: &[DType],
    ) -> Result<GpuBackend> {
        let device = GpuDevice::new(ordinal)?;
        let mut gpu = GpuLlama::with_options(
            &device,
            &model,
            args.per_device_train_batch_size,
            args.seq_len,
            precisions,
            args.gradient_checkpointing,
        )?;
        let cpu_optimizer = adamw_for(args, &model.params)?;
        gpu.configure_optimizer(
            *cpu_optimizer.config(),
            cpu_optimizer.groups().to_vec(),
            args.max_grad_norm,
        )?;
        let mut features: Vec<String> = vec![
            precisions
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(" / "),
        ];
        if gpu.flash_attention() && precisions.iter().any(|p| p.is_half()) {
            features.push("flash attention".into());
        }
        if gpu.gradient_checkpointing() {
            features.push("gradient checkpointing".into());
        }
        let name = format!(
            "cuda:{ordinal} {} ({})",
            device.name().unwrap_or_else(|_| "GPU".into()),
            features.join(", ")
        );
        Ok(GpuBackend {
            gpu,
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

    fn supports(&self, precision: DType) -> bool {
        self.gpu.precisions().contains(&precision)
    }

    fn zero_grads(&mut self) {
        // A failure here surfaces at the next launch on the same stream.
        let _ = self.gpu.zero_grad();
    }

    fn forward_backward(
        &mut self,
        batch: &Batch,
        denominator: f64,
        precision: DType,
        loss_scale: f32,
    ) -> Result<f64> {
        if precision != self.gpu.precision() {
            self.gpu.set_precision(precision)?;
        }
        let stats = self.gpu.forward_backward_scaled(
            &batch.input_ids,
            &batch.labels,
            batch.batch,
            batch.seq_len,
            Some(denominator),
            loss_scale,
        )?;
        Ok(stats.loss_sum)
    }

    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<bool> {
        self.gpu.unscale_and_check(inv_scale)
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

    fn poison_gradients(&mut self) -> Result<()> {
        self.gpu.plant_infinite_gradient()
    }

    fn peak_memory_bytes(&self) -> u64 {
        self.gpu.memory().peak_bytes() as u64
    }
}
