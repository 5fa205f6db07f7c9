//! The CUDA engine ([`GpuLlama`]) as a [`StepBackend`].
//!
//! The engine is built for every precision the run's AMP plan may choose (fp32, bf16, fp16) and
//! switches between them per period without reallocating. fp16 periods run with the GradScaler:
//! the loss is scaled in the fused cross entropy, `unscale_and_check` reads the unscaled
//! gradient norm (the non-finite check), and the fused AdamW unscales and clips inside its
//! kernel. Clipping happens inside that kernel, so `clip_grad_norm` only records the limit and
//! `optimizer_step` reports the norm it measured.
//!
//! `--memory lean` (see [`crate::memory_mode`], `gpu/offload.rs`): the fp32 master weights and
//! the AdamW moments live in host memory and the engine steps them on the CPU; saves stage the
//! host master through the idle gradient buffer and write the host moments in the same file
//! format, so a lean run's checkpoints resume in either mode. Lean steps always run eagerly.
//!
//! ZeRO (see `gpu/zero.rs`): the fused AdamW steps the rank's shard, clipping with the global
//! sum of squares the ranks gathered ([`StepBackend::clip_shard`] hands it to the kernel's
//! clip input instead of a norm the kernel measures), and with one 16-bit precision the fp32
//! master weights are sharded too, so the working copy is what data parallelism all-gathers.
//!
//! Saves, loads and the random initialisation stream through the engine's page-locked staging
//! buffer ([`GpuLlama::with_params_source`], [`GpuLlama::fill_params`], and the moments'
//! counterparts) in the CPU engine's file formats, so a run saved on the GPU resumes on either
//! device and host memory never holds the model or its optimizer state.

use std::ops::Range;
use std::path::Path;

use tilearn_ops::DType;
use tilearn_ops::cuda::{FlashBackward, GpuDevice};
use tilearn_optim::{AdamWConfig, ParamGroup};

use super::backend::{ModelInit, StepBackend, WholeStep};
use super::cpu_backend::write_host_optimizer;
use super::flat_buffer::FlatBuffer;
use super::model_parallel::slices;
use super::optimizer_layout::{TensorSlice, slices_within};
use super::optimizer_shards::{OptimizerCheckpoint, groups_within};
use super::zero::{RankState, StateBytes};
use super::{TrainingArguments, adamw_setup, optimizer_file};
use crate::Result;
use crate::checkpoint::{load_into, save_pretrained_from};
use crate::config::LlamaConfig;
use crate::cuda_graphs::{CudaGraphs, GraphDecision, StepConditions};
use crate::data::Batch;
use crate::gpu::{GatheredWeights, GpuLlama, GradientSink, StepRun};
use crate::model::pipeline_stage::PipelineStage;
use crate::model::tensor_parallel::ShardPlan;
use crate::model::{LlamaForCausalLM, LossStats};
use crate::offload_checkpoints::{
    OffloadCheckpoints, OffloadDecision, OffloadSetting, host_available_bytes, local_processes,
};
use crate::params::{ParamSpec, ParamStore, init_random_into};
use crate::weight_copy::WeightCopy;

pub mod pipeline_parallel;
mod split_rank;
pub mod tensor_parallel;

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
    /// The parameters the optimizer steps (all of them unless ZeRO sharded it).
    shard: Range<usize>,
    /// Whether the device AdamW exists (made for `shard` at its first use).
    optimizer_made: bool,
    name: String,
    /// The last note handed to the log (`--cuda-graphs` fallbacks), and one waiting.
    last_note: Option<String>,
    pending_note: Option<String>,
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
        self.gpu
            .set_position_ids(batch.positions.as_deref(), batch.batch, batch.seq_len)?;
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
        // Also when the precision is unchanged: a ZeRO gather of whole master weights leaves
        // the working copy stale, and this re-casts it (a no-op when it is current).
        self.gpu.set_precision(precision)
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
                .fill_params(|dest| load_into(dir, config, &specs, dest))?,
        }
        Ok(backend)
    }

    fn build(
        config: &LlamaConfig,
        args: &TrainingArguments,
        ordinal: usize,
        precisions: &[DType],
    ) -> Result<GpuBackend> {
        Self::build_for(config, None, args, ordinal, precisions)
    }

    /// [`GpuBackend::build`] for the whole model (`stage` `None`) or one pipeline stage's
    /// tensors (`config` is then the stage's; see `pipeline_parallel.rs`).
    fn build_for(
        config: &LlamaConfig,
        stage: Option<&PipelineStage>,
        args: &TrainingArguments,
        ordinal: usize,
        precisions: &[DType],
    ) -> Result<GpuBackend> {
        let device = GpuDevice::new(ordinal)?;
        if args.memory.is_lean() && args.cuda_graphs == CudaGraphs::On {
            return Err(crate::EngineError::InvalidArgument {
                argument: "--cuda-graphs on".into(),
                message: "--memory lean steps the optimizer on the host between the backward \
                          and the next forward, which a CUDA graph cannot hold; use \
                          --cuda-graphs auto or off"
                    .into(),
            });
        }
        if args.offload_checkpoints == OffloadCheckpoints::On {
            let why = if stage.is_some() {
                Some("is not yet implemented for pipeline stages; drop it or --pp-size")
            } else if args.cuda_graphs == CudaGraphs::On {
                Some(
                    "copies the checkpoints on a second stream, which the step's CUDA graph \
                     does not hold; use --cuda-graphs auto or off",
                )
            } else {
                None
            };
            if let Some(why) = why {
                return Err(crate::EngineError::InvalidArgument {
                    argument: "--offload-checkpoints".into(),
                    message: why.into(),
                });
            }
        }
        let shape = (args.per_device_train_batch_size, args.seq_len);
        let gpu = match stage {
            None => GpuLlama::for_config_with_memory(
                &device,
                config,
                shape.0,
                shape.1,
                precisions,
                args.gradient_checkpointing,
                args.lce_chunk,
                args.memory,
            )?,
            Some(stage) => GpuLlama::for_stage(
                &device,
                stage,
                shape,
                precisions,
                args.gradient_checkpointing,
                args.lce_chunk,
            )?,
        };
        let mut gpu = gpu;
        gpu.set_deterministic(args.deterministic)?;
        let offload = args.offload_checkpoints.resolve(&OffloadSetting {
            gradient_checkpointing: args.gradient_checkpointing,
            lean: args.memory.is_lean(),
            pipeline_stage: stage.is_some(),
            cuda_graphs_forced: args.cuda_graphs == CudaGraphs::On,
            seq: args.seq_len,
            host_bytes: gpu.checkpoint_offload_host_bytes(),
            host_available: host_available_bytes(),
            local_processes: local_processes(),
        });
        // An `auto` the driver refuses page-locked memory for keeps the checkpoints on the
        // device (the model is left as it was); an explicit `on` fails.
        let offload = match gpu.set_offload_checkpoints(offload.offload) {
            Err(e) if args.offload_checkpoints == OffloadCheckpoints::Auto => OffloadDecision {
                offload: false,
                reason: Some(format!("checkpoints on the GPU ({e})")),
            },
            other => other.map(|()| offload)?,
        };
        // `auto` falls back to the whole copy where the layout has no per-layer plan (the
        // reason is listed with the run's features); an explicit `per-layer` fails instead.
        let per_layer = args
            .weight_copy
            .per_layer(args.gradient_checkpointing, args.memory.is_lean());
        let weight_copy_note = match gpu.set_per_layer_weights(per_layer) {
            Err(e) if args.weight_copy == WeightCopy::Auto => {
                Some(format!("whole 16-bit weight copy ({e})"))
            }
            other => other.map(|()| None)?,
        };
        // A lean model stays eager whatever is asked (see `GpuLlama::set_cuda_graphs`).
        gpu.set_cuda_graphs(args.cuda_graphs);
        let specs = stage.map_or_else(|| ParamStore::specs_for(config), |s| s.specs.clone());
        // The fused AdamW is set up at its first use (see `optimizer_ready`), so that under
        // ZeRO its moments are only ever allocated for the rank's shard.
        let (optimizer_config, optimizer_groups) = adamw_setup(args, &specs);
        let mut features: Vec<String> = vec![
            precisions
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(" / "),
        ];
        if gpu.flash_attention() && precisions.iter().any(|p| p.is_half()) {
            features.push(match gpu.flash_backward() {
                FlashBackward::OnePass => "flash attention (one-pass backward)".into(),
                FlashBackward::Deterministic => "flash attention".into(),
            });
        }
        if gpu.deterministic() {
            features.push("deterministic".into());
        }
        if gpu.gradient_checkpointing() {
            features.push("gradient checkpointing".into());
        }
        if gpu.offload_checkpoints() {
            features.push(format!(
                "checkpoints in host memory ({:.2} GiB page-locked{})",
                gpu.offloaded_checkpoint_bytes() as f64 / (1u64 << 30) as f64,
                offload.reason.map_or(String::new(), |r| format!("; {r}"))
            ));
        } else if let Some(why) = offload.reason {
            features.push(why);
        }
        if gpu.per_layer_weights() {
            features.push("16-bit weights cast per layer".into());
        }
        features.extend(weight_copy_note);
        if gpu.is_lean() {
            features.push(
                "lean memory: master weights and AdamW on the host, MLP activation recomputed"
                    .into(),
            );
        } else if args.cuda_graphs != CudaGraphs::Off {
            features.push(format!("CUDA graphs {}", args.cuda_graphs));
        }
        let tokens = args.per_device_train_batch_size * args.seq_len;
        // A pipeline stage before the last has no loss head (its logits buffer is a stub).
        let has_loss_head = stage.is_none_or(PipelineStage::is_last);
        if has_loss_head && gpu.lce_chunk_tokens() < tokens {
            features.push(format!(
                "loss head in chunks of {} tokens",
                gpu.lce_chunk_tokens()
            ));
        }
        let specs_numel: usize = specs.iter().map(ParamSpec::numel).sum();
        let name = format!(
            "cuda:{ordinal} {} ({})",
            device.name().unwrap_or_else(|_| "GPU".into()),
            features.join(", ")
        );
        Ok(GpuBackend {
            gpu,
            config: config.clone(),
            numel: specs_numel,
            specs,
            host: None,
            optimizer_config,
            optimizer_groups,
            max_grad_norm: args.max_grad_norm,
            shard: 0..specs_numel,
            optimizer_made: false,
            name,
            last_note: None,
            pending_note: None,
        })
    }
}

impl GpuBackend {
    /// Makes the fused AdamW for `shard` if it does not exist yet: at the first step, save,
    /// resume or ZeRO cut, never at build, so a ZeRO rank never holds the whole model's moments.
    fn optimizer_ready(&mut self) -> Result<()> {
        if !self.optimizer_made {
            self.gpu.configure_optimizer_for(
                self.optimizer_config,
                self.optimizer_groups.clone(),
                self.max_grad_norm,
                self.shard.clone(),
            )?;
            self.optimizer_made = true;
        }
        Ok(())
    }

    /// The slices of the whole model's tensors (`full_specs`) that this rank's optimizer shard
    /// holds, placed by `plan` (a tensor-parallel rank's cuts or a pipeline stage's tensors).
    fn shard_layout(&self, plan: &ShardPlan, full_specs: &[ParamSpec]) -> Vec<TensorSlice> {
        slices_within(
            &self.specs,
            |spec| slices::place(plan, full_specs, spec),
            &self.shard,
        )
    }

    /// Writes this rank's optimizer state as its slices of the whole model's tensors: a
    /// tensor- or pipeline-parallel rank's file, in the CPU model-parallel backend's format, so
    /// layouts and engines interchange.
    pub(crate) fn save_optimizer_slices(
        &mut self,
        path: &Path,
        plan: &ShardPlan,
        full_specs: &[ParamSpec],
    ) -> Result<()> {
        self.optimizer_ready()?;
        let layout = self.shard_layout(plan, full_specs);
        let step = self.gpu.optimizer().map_or(0, |o| o.step_count());
        let (config, groups) = (&self.optimizer_config, &self.optimizer_groups);
        let len = self.shard.len();
        self.gpu.with_moments_source(|source| {
            optimizer_file::write_sliced(path, config, groups, step, len, Some(&layout), source)
        })
    }

    /// Fills this rank's moments from `optimizer`, reading its slices of the whole model's
    /// tensors, whatever layout wrote the file.
    pub(crate) fn restore_optimizer_slices(
        &mut self,
        optimizer: &OptimizerCheckpoint,
        plan: &ShardPlan,
        full_specs: &[ParamSpec],
    ) -> Result<()> {
        self.optimizer_ready()?;
        let layout = self.shard_layout(plan, full_specs);
        self.gpu
            .fill_moments(|dest| optimizer.read_slices(full_specs, &layout, dest))
    }

    /// One AdamW step clipped by the norm whose square `total` the caller summed over its
    /// model-parallel group; returns that norm. (Under ZeRO the data-parallel layer hands the
    /// step the sum over both groups instead, through [`StepBackend::clip_shard`], and the
    /// rank steps with [`StepBackend::optimizer_step`].)
    pub(crate) fn step_with_group_norm(&mut self, total: f64, lr: f32) -> Result<Option<f64>> {
        self.gpu.use_global_grad_sum_of_squares(total)?;
        self.gpu.step(lr)?;
        Ok(Some(total.sqrt()))
    }

    /// Whether ZeRO sharded the optimizer (it steps part of the parameters).
    pub(crate) fn optimizer_sharded(&self) -> bool {
        self.shard != (0..self.numel)
    }

    /// Loads a tensor- or pipeline-parallel rank's slices (placed by `plan`) of the whole
    /// model's weights saved in `dir` (`full_config`, `full_specs`), whatever layout wrote
    /// them. Through [`GpuLlama::fill_params`], so that under ZeRO the rank keeps its shard of
    /// the master weights.
    pub(crate) fn load_weight_slices(
        &mut self,
        dir: &Path,
        full_config: &LlamaConfig,
        full_specs: &[ParamSpec],
        plan: &ShardPlan,
    ) -> Result<()> {
        let mut data = vec![0f32; self.numel];
        let mut dest = slices::RankSlices::new(full_specs, &self.specs, plan, &mut data);
        load_into(dir, full_config, full_specs, &mut dest)?;
        let numel = self.numel;
        self.gpu.fill_params(|dest| {
            dest.write(0..numel, &mut |offset, buf| {
                buf.copy_from_slice(&data[offset..offset + buf.len()]);
                Ok(())
            })
        })?;
        self.host = None;
        Ok(())
    }

    /// Queues `note` for the log unless it is the last one handed out.
    fn note(&mut self, note: Option<String>) {
        if let Some(n) = note
            && self.last_note.as_ref() != Some(&n)
        {
            self.pending_note = Some(n);
        }
    }

    /// Whether a step of `conditions` is taken whole (replayed as a graph); `false` notes why
    /// not; `Err` is `--cuda-graphs on` refusing it.
    fn take_whole(&mut self, conditions: StepConditions) -> Result<bool> {
        match self.gpu.cuda_graph_decision(conditions) {
            Ok(GraphDecision::Graph) => Ok(true),
            Ok(GraphDecision::Eager { reason }) => {
                self.note(reason.map(|r| format!("CUDA graphs: this step runs eagerly: {r}")));
                Ok(false)
            }
            Err(message) => Err(crate::EngineError::InvalidArgument {
                argument: "--cuda-graphs".into(),
                message,
            }),
        }
    }

    /// The whole step through [`GpuLlama::train_step`] (see [`StepBackend::whole_step`]).
    fn graph_step(
        &mut self,
        batch: &Batch,
        denominator: f64,
        precision: DType,
        lr: f32,
        conditions: StepConditions,
    ) -> Option<Result<WholeStep>> {
        // The optimizer first: the decision reads its shard (made at the first step).
        if let Err(e) = self.optimizer_ready() {
            return Some(Err(e));
        }
        match self.take_whole(conditions) {
            Ok(true) => {}
            Ok(false) => return None,
            Err(e) => return Some(Err(e)),
        }
        let run = self.gpu.train_step(
            &batch.input_ids,
            &batch.labels,
            batch.batch,
            batch.seq_len,
            Some(denominator),
            lr,
            conditions,
        );
        Some(run.map(|out| {
            if let Some(r) = out.eager_reason {
                self.note(Some(format!("CUDA graphs: {r}")));
            } else if out.run == StepRun::Captured {
                self.note(Some(format!(
                    "CUDA graphs: step captured ({} x {} tokens, {precision}); later steps \
                     replay it",
                    batch.batch, batch.seq_len
                )));
            }
            WholeStep {
                loss_sum: out.loss.loss_sum,
                grad_norm: out.grad_norm,
            }
        }))
    }

    /// Bytes of the loss head's logits buffer (one chunk of `[tokens × vocab]`, see
    /// [`GpuLlama::logits_buffer_bytes`]).
    pub fn logits_buffer_bytes(&self) -> usize {
        self.gpu.logits_buffer_bytes()
    }

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

    fn whole_step(
        &mut self,
        batches: &[Batch],
        denominator: f64,
        precision: DType,
        lr: f32,
        conditions: StepConditions,
    ) -> Option<Result<WholeStep>> {
        if self.gpu.cuda_graphs() == CudaGraphs::Off {
            return None;
        }
        let [batch] = batches else {
            // Several micro-batches never take the graph: `on` refuses, `auto` notes why.
            let conditions = StepConditions {
                micro_batches: batches.len().max(2),
                ..conditions
            };
            return self.take_whole(conditions).err().map(Err);
        };
        if let Err(e) = self.use_precision(precision).and_then(|()| {
            self.gpu
                .set_position_ids(batch.positions.as_deref(), batch.batch, batch.seq_len)
        }) {
            return Some(Err(e));
        }
        self.graph_step(batch, denominator, precision, lr, conditions)
    }

    fn take_note(&mut self) -> Option<String> {
        let note = self.pending_note.take();
        if note.is_some() {
            self.last_note.clone_from(&note);
        }
        note
    }

    fn eval_loss(&mut self, batch: &Batch, precision: DType) -> Result<LossStats> {
        self.use_precision(precision)?;
        self.gpu
            .set_position_ids(batch.positions.as_deref(), batch.batch, batch.seq_len)?;
        self.gpu
            .forward_loss(&batch.input_ids, &batch.labels, batch.batch, batch.seq_len)
    }

    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<bool> {
        self.optimizer_ready()?;
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
        self.optimizer_ready()?;
        self.gpu.step(lr)?;
        Ok(Some(self.gpu.last_grad_norm()?))
    }

    fn model(&mut self) -> Result<&LlamaForCausalLM> {
        self.gpu.stage_offloaded_master()?;
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
        self.gpu.stage_offloaded_master()?;
        let specs = &self.specs;
        self.gpu.with_params_source(|source| {
            save_pretrained_from(dir, config, specs, source, dtype, max_shard_bytes)
        })
    }

    fn save_optimizer(&mut self, path: &Path) -> Result<()> {
        self.optimizer_ready()?;
        if let Some(host) = self.gpu.host_optimizer() {
            return write_host_optimizer(host.adamw(), self.shard.len(), path);
        }
        let step = self.gpu.optimizer().map_or(0, |o| o.step_count());
        // The file of a shard records the groups cut and shifted to it, as the CPU engine's.
        let groups = groups_within(&self.optimizer_groups, &self.shard);
        let (config, len) = (&self.optimizer_config, self.shard.len());
        self.gpu.with_moments_source(|source| {
            optimizer_file::write(path, config, &groups, step, len, source)
        })
    }

    fn restore(&mut self, dir: &Path, optimizer: &OptimizerCheckpoint) -> Result<()> {
        self.optimizer_ready()?;
        if let Some(host) = self.gpu.host_optimizer_mut() {
            let len = self.shard.len();
            let mut moments = vec![0.0f32; 2 * len];
            let mut dest: &mut [f32] = &mut moments;
            let step = optimizer.read(self.numel, self.shard.clone(), &mut dest)?;
            let exp_avg_sq = moments.split_off(len);
            host.adamw_mut()
                .set_state(moments, exp_avg_sq, None, step)?;
        } else {
            let (numel, shard) = (self.numel, self.shard.clone());
            self.gpu
                .fill_moments(|dest| optimizer.read(numel, shard, dest))?;
        }
        let (config, specs) = (&self.config, &self.specs);
        self.gpu
            .fill_params(|dest| load_into(dir, config, specs, dest))?;
        self.host = None;
        Ok(())
    }

    fn load_weights(&mut self, dir: &Path) -> Result<()> {
        let (config, specs) = (&self.config, &self.specs);
        self.gpu
            .fill_params(|dest| load_into(dir, config, specs, dest))?;
        self.host = None;
        Ok(())
    }

    fn flat_gradients(&mut self) -> Result<FlatBuffer<'_>> {
        let (view, stream) = self.gpu.gradients_mut();
        Ok(FlatBuffer::Device { view, stream })
    }

    fn flat_parameters(&mut self) -> Result<FlatBuffer<'_>> {
        let (weights, stream) = self.gpu.gathered_weights_mut()?;
        Ok(match weights {
            GatheredWeights::Master(view) => FlatBuffer::Device { view, stream },
            GatheredWeights::Working(view) => FlatBuffer::DeviceHalf { view, stream },
        })
    }

    fn shard_optimizer(&mut self, shard: Range<usize>) -> Result<()> {
        // Made for the shard directly when it does not exist yet (the usual case: before the
        // first step), then the master weights are cut.
        self.shard = shard.clone();
        self.optimizer_ready()?;
        self.gpu.shard_optimizer(shard)
    }

    fn shard_gradients(&mut self, owned: Range<usize>) -> Result<bool> {
        self.gpu.shard_gradients(owned)
    }

    fn gradients_sharded(&self) -> bool {
        self.gpu.owned_gradients().is_some()
    }

    fn grad_sum_of_squares(&mut self, range: Range<usize>) -> Result<f64> {
        self.optimizer_ready()?;
        self.gpu.grad_sum_of_squares(range)
    }

    fn clip_shard(
        &mut self,
        range: Range<usize>,
        sum_of_squares: f64,
        max_norm: f64,
    ) -> Result<()> {
        debug_assert_eq!(range, self.shard, "the optimizer steps the owned shard");
        debug_assert_eq!(
            max_norm, self.max_grad_norm,
            "clipping is configured at build"
        );
        // The fused AdamW clips with it (and reports its root as the step's norm).
        self.optimizer_ready()?;
        self.gpu.use_global_grad_sum_of_squares(sum_of_squares)
    }

    fn stage_whole_weights(&mut self) -> Result<Option<FlatBuffer<'_>>> {
        Ok(self
            .gpu
            .stage_params_in_grads()?
            .map(|(view, stream)| FlatBuffer::Device { view, stream }))
    }

    fn state_layout(&self) -> StateBytes {
        // Bytes per parameter before partitioning. fp32 master weights that a forward reads
        // (fp32 among the precisions, or two 16-bit types re-cast from them) are working
        // weights, as on the CPU engine; otherwise they belong to the optimizer state (K).
        let m = self.gpu.memory();
        let per_param = |bytes: usize| (bytes as f64 / self.numel.max(1) as f64).round() as u64;
        let working = per_param(m.working_copy_bytes);
        let moments = 8;
        if self.gpu.master_shardable() {
            StateBytes {
                weights: working,
                grads: 4,
                optimizer: 4 + moments,
            }
        } else {
            StateBytes {
                weights: working + 4,
                grads: 4,
                optimizer: moments,
            }
        }
    }

    fn state_held(&self) -> RankState {
        let m = self.gpu.memory();
        // Before its first use the optimizer is not allocated yet; count the moments it will
        // hold from the first step (two f32 per parameter of the shard).
        let optimizer_bytes = if self.optimizer_made {
            m.optimizer_bytes
        } else {
            8 * self.shard.len()
        };
        let (master_as_weights, master_as_state) = if self.gpu.master_shardable() {
            (0, m.master_bytes)
        } else {
            (m.master_bytes, 0)
        };
        RankState {
            weights: (m.working_copy_bytes + master_as_weights) as f64,
            grads: m.grad_bytes as f64,
            grad_window: m.grad_window_bytes as f64,
            optimizer: (master_as_state + optimizer_bytes) as f64,
        }
    }

    fn poison_gradients(&mut self) -> Result<()> {
        self.gpu.plant_infinite_gradient()
    }

    fn peak_memory_bytes(&self) -> u64 {
        self.gpu.memory().peak_bytes() as u64
    }
}
