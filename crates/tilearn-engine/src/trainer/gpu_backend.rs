//! The CUDA engine ([`GpuLlama`]) as a [`StepBackend`].
//!
//! The engine is built for every precision the run's AMP plan may choose (fp32, bf16, fp16) and
//! switches between them per period without reallocating. fp16 periods run with the GradScaler:
//! the loss is scaled in the fused cross entropy, `unscale_and_check` reads the unscaled
//! gradient norm (the non-finite check), and the fused AdamW unscales and clips inside its
//! kernel. Clipping happens inside that kernel, so `clip_grad_norm` only records the limit and
//! `optimizer_step` reports the norm it measured.
//!
//! Saves, loads and the random initialisation stream through the engine's page-locked staging
//! buffer ([`GpuLlama::with_params_source`], [`GpuLlama::fill_params`], and the moments'
//! counterparts) in the CPU engine's file formats, so a run saved on the GPU resumes on either
//! device and host memory never holds the model or its optimizer state.

use std::path::Path;

use tilearn_ops::DType;
use tilearn_ops::cuda::GpuDevice;
use tilearn_optim::{AdamWConfig, ParamGroup};

use super::backend::{ModelInit, StepBackend};
use super::flat_buffer::FlatBuffer;
use super::optimizer_shards::OptimizerCheckpoint;
use super::zero::{RankState, StateBytes};
use super::{TrainingArguments, adamw_setup, optimizer_file};
use crate::Result;
use crate::checkpoint::{load_into, save_pretrained_from};
use crate::config::LlamaConfig;
use crate::data::Batch;
use crate::gpu::{GpuLlama, GradientSink};
use crate::model::{LlamaForCausalLM, LossStats};
use crate::params::{ParamSpec, ParamStore, init_random_into};

pub struct GpuBackend {
    gpu: GpuLlama,
    config: LlamaConfig,
    specs: Vec<ParamSpec>,
    numel: usize,
    /// A host copy made only when [`StepBackend::model`] asks for one (evaluation, tests).
    host: Option<LlamaForCausalLM>,
    optimizer_config: AdamWConfig,
    optimizer_groups: Vec<ParamGroup>,
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
        let mut backend = Self::build(&model.config, args, ordinal, precisions)?;
        backend.gpu.upload_params(&model.params)?;
        Ok(backend)
    }

    fn run_forward_backward(
        &mut self,
        batch: &Batch,
        denominator: f64,
        precision: DType,
        loss_scale: f32,
        sink: Option<&mut dyn GradientSink>,
    ) -> Result<f64> {
        self.use_precision(precision)?;
        let stats = self.gpu.forward_backward_into(
            &batch.input_ids,
            &batch.labels,
            batch.batch,
            batch.seq_len,
            Some(denominator),
            loss_scale,
            sink,
        )?;
        Ok(stats.loss_sum)
    }

    fn use_precision(&mut self, precision: DType) -> Result<()> {
        if precision != self.gpu.precision() {
            self.gpu.set_precision(precision)?;
        }
        Ok(())
    }

    /// Builds the model `config` describes on GPU `ordinal` and fills its weights from `init`
    /// tensor by tensor (see the module docs); otherwise as [`GpuBackend::new`].
    pub fn from_init(
        config: &LlamaConfig,
        init: &ModelInit,
        args: &TrainingArguments,
        ordinal: usize,
        precisions: &[DType],
    ) -> Result<GpuBackend> {
        let mut backend = Self::build(config, args, ordinal, precisions)?;
        let specs = backend.specs.clone();
        match init {
            ModelInit::Random { seed } => backend.gpu.fill_params(|dest| {
                init_random_into(
                    &specs,
                    *seed,
                    config.initializer_range,
                    config.pad_token_id,
                    dest,
                )
            })?,
            ModelInit::Pretrained(dir) => backend
                .gpu
                .fill_params(|dest| load_into(dir, &specs, dest))?,
        }
        Ok(backend)
    }

    fn build(
        config: &LlamaConfig,
        args: &TrainingArguments,
        ordinal: usize,
        precisions: &[DType],
    ) -> Result<GpuBackend> {
        let device = GpuDevice::new(ordinal)?;
        let mut gpu = GpuLlama::for_config_with_lce_chunk(
            &device,
            config,
            args.per_device_train_batch_size,
            args.seq_len,
            precisions,
            args.gradient_checkpointing,
            args.lce_chunk,
        )?;
        let specs = ParamStore::specs_for(config);
        let (optimizer_config, optimizer_groups) = adamw_setup(args, &specs);
        gpu.configure_optimizer(
            optimizer_config,
            optimizer_groups.clone(),
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
        let tokens = args.per_device_train_batch_size * args.seq_len;
        if gpu.lce_chunk_tokens() < tokens {
            features.push(format!(
                "loss head in chunks of {} tokens",
                gpu.lce_chunk_tokens()
            ));
        }
        let name = format!(
            "cuda:{ordinal} {} ({})",
            device.name().unwrap_or_else(|_| "GPU".into()),
            features.join(", ")
        );
        Ok(GpuBackend {
            gpu,
            config: config.clone(),
            numel: specs.iter().map(ParamSpec::numel).sum(),
            specs,
            host: None,
            optimizer_config,
            optimizer_groups,
            max_grad_norm: args.max_grad_norm,
            name,
        })
    }
}

impl GpuBackend {
    /// The stream the engine computes on (what data parallelism's communication is ordered
    /// against, and where the host communicator stages device buffers).
    pub fn stream(&self) -> std::sync::Arc<cudarc::driver::CudaStream> {
        self.gpu.device().stream().clone()
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
        self.run_forward_backward(batch, denominator, precision, loss_scale, None)
    }

    fn compute_stream(&self) -> Option<std::sync::Arc<tilearn_ops::cuda::CudaStream>> {
        Some(self.stream())
    }

    fn forward_backward_into(
        &mut self,
        batch: &Batch,
        denominator: f64,
        precision: DType,
        loss_scale: f32,
        sink: &mut dyn GradientSink,
    ) -> Option<Result<f64>> {
        Some(self.run_forward_backward(batch, denominator, precision, loss_scale, Some(sink)))
    }

    fn eval_loss(&mut self, batch: &Batch, precision: DType) -> Result<LossStats> {
        self.use_precision(precision)?;
        self.gpu
            .forward_loss(&batch.input_ids, &batch.labels, batch.batch, batch.seq_len)
    }

    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<bool> {
        self.gpu.unscale_and_check(inv_scale)
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        debug_assert_eq!(
            max_norm, self.max_grad_norm,
            "clipping is configured at build"
        );
        Ok(0.0)
    }

    fn optimizer_step(&mut self, lr: f32) -> Result<Option<f64>> {
        self.gpu.step(lr)?;
        Ok(Some(self.gpu.last_grad_norm()?))
    }

    fn model(&mut self) -> Result<&LlamaForCausalLM> {
        let params = self.gpu.download_params()?;
        let host = self.host.insert(LlamaForCausalLM {
            config: self.config.clone(),
            params,
        });
        Ok(host)
    }

    fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    fn save_model(
        &mut self,
        dir: &Path,
        config: &LlamaConfig,
        dtype: DType,
        max_shard_bytes: Option<usize>,
    ) -> Result<()> {
        let specs = &self.specs;
        self.gpu.with_params_source(|source| {
            save_pretrained_from(dir, config, specs, source, dtype, max_shard_bytes)
        })
    }

    fn save_optimizer(&mut self, path: &Path) -> Result<()> {
        let step = self.gpu.optimizer().map_or(0, |o| o.step_count());
        let numel = self.numel;
        let (config, groups) = (&self.optimizer_config, &self.optimizer_groups);
        self.gpu.with_moments_source(|source| {
            optimizer_file::write(path, config, groups, step, numel, source)
        })
    }

    fn restore(&mut self, dir: &Path, optimizer: &OptimizerCheckpoint) -> Result<()> {
        let numel = self.numel;
        self.gpu
            .fill_moments(|dest| optimizer.read(numel, 0..numel, dest))?;
        let specs = &self.specs;
        self.gpu.fill_params(|dest| load_into(dir, specs, dest))?;
        self.host = None;
        Ok(())
    }

    fn load_weights(&mut self, dir: &Path) -> Result<()> {
        let specs = &self.specs;
        self.gpu.fill_params(|dest| load_into(dir, specs, dest))?;
        self.host = None;
        Ok(())
    }

    fn flat_gradients(&mut self) -> Result<FlatBuffer<'_>> {
        let (view, stream) = self.gpu.gradients_mut();
        Ok(FlatBuffer::Device { view, stream })
    }

    fn state_layout(&self) -> StateBytes {
        let held = self.state_held();
        let per_param = |bytes: f64| (bytes / self.numel.max(1) as f64).round() as u64;
        // Mixed precision: bf16/fp16 working copy (none when built for fp32 only), fp32
        // gradients, K = fp32 master + two moments.
        StateBytes {
            weights: per_param(held.weights),
            grads: per_param(held.grads),
            optimizer: per_param(held.optimizer),
        }
    }

    fn state_held(&self) -> RankState {
        let m = self.gpu.memory();
        RankState {
            weights: m.working_copy_bytes as f64,
            grads: m.grad_bytes as f64,
            optimizer: (m.master_bytes + m.optimizer_bytes) as f64,
        }
    }

    fn poison_gradients(&mut self) -> Result<()> {
        self.gpu.plant_infinite_gradient()
    }

    fn peak_memory_bytes(&self) -> u64 {
        self.gpu.memory().peak_bytes() as u64
    }
}
