//! Pipeline parallelism on the CUDA engine: one stage of a pipeline as a [`StepBackend`] (see
//! "Pipeline parallelism on the GPU engine" in `docs/ARCHITECTURE.md`).
//!
//! The rank's [`GpuBackend`] is built for its stage's tensors only ([`PipelineStage`]: the
//! layers of the CPU engine's balanced cut, the embedding on the first stage, the final norm and
//! `lm_head` with the fused loss on the last), so its weights, gradients, optimizer moments and
//! fused AdamW cover the stage alone. A step runs this stage's actions of the schedule
//! (`tilearn_parallel::pipeline`, 1F1B by default, GPipe too) over the step's micro-batches (the
//! gradient accumulation steps) with [`run_actions`]: activations and their gradients cross
//! stages as device buffers through the pipeline communicator's batched send/receive (the host
//! communicator stages them through page-locked memory, so two ranks can share one GPU; NCCL
//! sends them from device to device). A stage keeps each in-flight micro-batch's *input* and
//! recomputes its forward right before a backward that does not follow it directly.
//!
//! What needs the whole model's view is collective over the pipeline group, as on the CPU
//! backend: the loss (computed on the last stage), the gradient norm (each stage's sum of
//! squares, handed to the fused AdamW's clip), the fp16 overflow check, the saved model (every
//! stage's tensors all-gathered and put together by name; stage 0 writes plain Hugging Face
//! files). Each stage writes its optimizer file in the CPU model-parallel layout format (whole
//! tensors as slices), so checkpoints interchange with the CPU engine's layouts. Data
//! parallelism around the pipeline is the Trainer's: it reduces this stage's flat gradient
//! buffer between the replicas after [`StepBackend::forward_backward_step`]; ZeRO is refused.
//!
//! With a [`TensorSplit`] the stage is one tensor-parallel rank's part of it (tensor and
//! pipeline parallelism together, Megatron's 2D layout): the stage is built for the rank's local
//! config and slices ([`PipelineStage::with_plan`]), completes its partial sums over the tensor
//! group as [`GpuTensorParallelBackend`](super::tensor_parallel::GpuTensorParallelBackend)
//! does (the vocabulary-parallel embedding on the first stage and loss head on the last), and
//! exchanges whole activations with the same tensor rank of the neighbouring stages; what
//! needs the whole model's view (the clip norm, the overflow check, the saved model) is
//! collective over the replica (every tensor rank of every stage).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use tilearn_ops::DType;
use tilearn_parallel::pipeline::{P2p, ScheduleKind};
use tilearn_parallel::{Communicator, P2pOp, scalars};

use super::GpuBackend;
use super::split_rank::split_rank_methods;
use super::tensor_parallel::{
    counted_sum_of_squares, gpu_shard_plan, join_tensor_group, norm_ranges, split_rank_args,
};
use crate::checkpoint::save_pretrained;
use crate::config::LlamaConfig;
use crate::cuda_graphs::CudaGraphs;
use crate::data::Batch;
use crate::gpu::{GpuLlama, StageBuffer};
use crate::model::model_parallel::{PipelineShard, assemble_planned};
use crate::model::pipeline_stage::PipelineStage;
use crate::model::tensor_parallel::{ShardPlan, TensorShard, slice_params};
use crate::model::{LlamaForCausalLM, LossStats};
use crate::params::{ParamSpec, ParamStore};
use crate::trainer::TrainingArguments;
use crate::trainer::backend::{ModelInit, StepBackend};
use crate::trainer::model_parallel::gather_padded;
use crate::trainer::optimizer_shards::OptimizerCheckpoint;
use crate::trainer::stage_executor::{StageCompute, run_actions, stage_actions};
use crate::{EngineError, Result};

fn usage(flag: &str, message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: flag.into(),
        message,
    }
}

/// Tensor parallelism inside each pipeline stage: this rank's place in its tensor group, the
/// group, and the replica (every rank of the model: tensor ranks of every stage, ordered by
/// stage, then tensor rank).
pub struct TensorSplit {
    pub shard: TensorShard,
    pub tp: Arc<dyn Communicator>,
    pub replica: Arc<dyn Communicator>,
}

/// One pipeline stage of a model on the GPU engine.
pub struct GpuPipelineParallelBackend {
    inner: GpuBackend,
    stage: PipelineStage,
    schedule: ScheduleKind,
    pp: Arc<dyn Communicator>,
    /// The whole model's ranks: the pipeline without tensor parallelism, else the replica.
    model_group: Arc<dyn Communicator>,
    /// The tensor-parallel size (1 without tensor parallelism).
    tp_size: usize,
    /// The local gradient ranges this rank counts in the global norm (merged where adjacent):
    /// all of the stage's, except the replicated tensors of tensor ranks other than 0.
    norm_ranges: Vec<Range<usize>>,
    full_specs: Vec<ParamSpec>,
    /// Boundary buffers kept between steps (the inputs of in-flight micro-batches and the
    /// tensors waiting to be sent: 1F1B holds about `stages − stage` of them at its peak).
    pool: Vec<StageBuffer>,
    name: String,
}

impl GpuPipelineParallelBackend {
    /// Stage `pipe.stage` of the model `config` describes on GPU `ordinal`, its tensors taken
    /// from `init` (a Hugging Face directory is read tensor by tensor, only the stage's; a random
    /// initialisation is made whole on the host with the run's seed and cut, so the stages start
    /// from the single rank's weights), exchanging activations over `pp` (the pipeline group,
    /// whose rank is the stage) in the order of `schedule`.
    pub fn from_init(
        config: &LlamaConfig,
        init: &ModelInit,
        args: &TrainingArguments,
        (ordinal, precisions): (usize, &[DType]),
        (pipe, schedule): (PipelineShard, ScheduleKind),
        pp: Arc<dyn Communicator>,
    ) -> Result<GpuPipelineParallelBackend> {
        Self::with_tensor_split(
            config,
            init,
            args,
            (ordinal, precisions),
            (pipe, schedule),
            pp,
            None,
        )
    }

    /// [`from_init`](Self::from_init) for one tensor rank of the stage when `split` is given
    /// (see the module docs).
    pub fn with_tensor_split(
        config: &LlamaConfig,
        init: &ModelInit,
        args: &TrainingArguments,
        (ordinal, precisions): (usize, &[DType]),
        (pipe, schedule): (PipelineShard, ScheduleKind),
        pp: Arc<dyn Communicator>,
        split: Option<TensorSplit>,
    ) -> Result<GpuPipelineParallelBackend> {
        if pp.world_size() != pipe.stages || pp.rank() != pipe.stage {
            return Err(usage(
                "--pp-size",
                format!(
                    "internal: the pipeline communicator is rank {} of {}, the layout says \
                     stage {} of {}",
                    pp.rank(),
                    pp.world_size(),
                    pipe.stage,
                    pipe.stages
                ),
            ));
        }
        if args.cuda_graphs == CudaGraphs::On {
            return Err(usage(
                "--cuda-graphs",
                "on: a pipeline stage exchanges activations with its neighbours between its \
                 forwards and backwards, which a CUDA graph cannot capture; use --cuda-graphs \
                 off (or auto)"
                    .into(),
            ));
        }
        if args.memory.is_lean() {
            return Err(usage(
                "--memory",
                "lean is not supported with pipeline parallelism on the GPU yet (a stage \
                 already holds only its layers' weights and optimizer state); drop --memory \
                 lean or use --pp-size 1"
                    .into(),
            ));
        }
        let shard = split.as_ref().map_or(TensorShard::WHOLE, |t| t.shard);
        if let Some(t) = &split
            && (t.tp.world_size() != shard.size
                || t.tp.rank() != shard.rank
                || t.replica.world_size() != shard.size * pipe.stages
                || t.replica.rank() != pipe.stage * shard.size + shard.rank)
        {
            return Err(usage(
                "--tp-size",
                format!(
                    "internal: the tensor group is rank {} of {} and the replica rank {} of {}; \
                     the layout says tensor rank {} of {} in stage {} of {}",
                    t.tp.rank(),
                    t.tp.world_size(),
                    t.replica.rank(),
                    t.replica.world_size(),
                    shard.rank,
                    shard.size,
                    pipe.stage,
                    pipe.stages
                ),
            ));
        }
        let plan = if shard.size > 1 {
            gpu_shard_plan(config, shard)?
        } else {
            ShardPlan::new(config, TensorShard::WHOLE)?
        };
        let stage = PipelineStage::with_plan(config, pipe, plan)?;
        // Refuse an unsupported schedule (or too few micro-batches) before allocating.
        stage_actions(
            schedule,
            stage.pipe.stage,
            stage.pipe.stages,
            args.gradient_accumulation_steps,
        )?;
        let eager = split_rank_args(args, config, shard, precisions);
        let mut inner =
            GpuBackend::build_for(&stage.config, Some(&stage), &eager, ordinal, precisions)?;
        let (model_group, tp_note) = match &split {
            Some(t) => {
                // Every stage gets the vocabulary slice: each checks token ids against the whole
                // vocabulary; the first looks up and the last scores only its rows.
                join_tensor_group(&mut inner.gpu, t.tp.clone(), &stage.plan, config)?;
                let note = format!(", tensor-parallel rank {} of {}", shard.rank, shard.size);
                (t.replica.clone(), note)
            }
            None => (pp.clone(), String::new()),
        };
        let norm_ranges = norm_ranges(&inner.specs, &stage.plan);
        let layers = &stage.pipe.partition[stage.pipe.stage];
        let name = format!(
            "{}, pipeline stage {} of {}{tp_note} (layers {}..{}, {schedule}, forward recomputed \
             before each backward that does not follow it)",
            inner.name, stage.pipe.stage, stage.pipe.stages, layers.start, layers.end
        );
        let mut backend = GpuPipelineParallelBackend {
            inner,
            full_specs: ParamStore::specs_for(config),
            stage,
            schedule,
            pp,
            model_group,
            tp_size: shard.size,
            norm_ranges,
            pool: Vec::new(),
            name,
        };
        match init {
            ModelInit::Random { seed } => {
                let full = LlamaForCausalLM::from_config(config.clone(), *seed);
                let rank_params = if shard.size > 1 {
                    slice_params(&full.params, config, &backend.stage.plan)
                } else {
                    full.params
                };
                let mine = backend.stage_params(&rank_params)?;
                backend.inner.gpu.upload_params(&mine)?;
            }
            ModelInit::Pretrained(dir) => backend.load_weights(dir)?,
        }
        Ok(backend)
    }

    /// This stage's tensors of `full` (the whole model, or this tensor rank's part of it).
    fn stage_params(&self, full: &ParamStore) -> Result<ParamStore> {
        let mut data = Vec::with_capacity(self.stage.numel());
        for spec in &self.stage.specs {
            let whole = full.spec(&spec.name).ok_or_else(|| {
                usage(
                    "--pp-size",
                    format!("internal: the model has no tensor {}", spec.name),
                )
            })?;
            data.extend_from_slice(&full.data[whole.range()]);
        }
        Ok(ParamStore {
            specs: self.stage.specs.clone(),
            data,
        })
    }

    /// The squared gradient norm over `range` of the stage's buffer (the parts this rank
    /// counts), summed over the model's ranks. Synchronises.
    fn group_sum_of_squares(&mut self, range: &Range<usize>) -> Result<f64> {
        self.inner.optimizer_ready()?;
        let local = counted_sum_of_squares(&mut self.inner.gpu, &self.norm_ranges, range)?;
        Ok(scalars::sum_f64(self.model_group.as_ref(), local)?)
    }

    /// Every rank's weights all-gathered over the model's ranks and put together as the whole
    /// model (rank r of the replica is tensor rank r mod tp of stage r / tp).
    fn gather_full_params(&self) -> Result<ParamStore> {
        let local = self.inner.gpu.download_params()?.data;
        let (all, longest) = gather_padded(self.model_group.as_ref(), &local)?;
        let full = &self.stage.full_config;
        let tp = self.tp_size;
        let parts = (0..self.stage.pipe.stages * tp)
            .map(|r| {
                let plan = if tp > 1 {
                    gpu_shard_plan(
                        full,
                        TensorShard {
                            rank: r % tp,
                            size: tp,
                        },
                    )?
                } else {
                    self.stage.plan.clone()
                };
                Ok((
                    plan,
                    self.stage.pipe_of(r / tp),
                    &all[r * longest..(r + 1) * longest],
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        assemble_planned(full, &parts)
    }

    /// One training step's forwards and backwards over `batches`; the step's loss sum, the same
    /// on every stage.
    fn run_step(
        &mut self,
        batches: &[Batch],
        denominator: f64,
        precision: DType,
        loss_scale: f32,
    ) -> Result<f64> {
        self.inner.use_precision(precision)?;
        let pipe = &self.stage.pipe;
        let actions = stage_actions(self.schedule, pipe.stage, pipe.stages, batches.len())?;
        let mut compute = DeviceStage {
            first: self.stage.is_first(),
            last: self.stage.is_last(),
            hidden: self.stage.full_config.hidden_size,
            gpu: &mut self.inner.gpu,
            batches,
            denominator,
            loss_scale,
            precision,
            pp: self.pp.as_ref(),
        };
        let local = run_actions(&mut compute, &actions, &mut self.pool)?;
        self.inner.host = None;
        Ok(scalars::sum_f64(self.pp.as_ref(), local)?)
    }

    /// A boundary buffer from the pool, or a new one.
    fn take_buffer(&mut self) -> Result<StageBuffer> {
        match self.pool.pop() {
            Some(b) => Ok(b),
            None => self.inner.gpu.stage_buffer(),
        }
    }
}

/// The stage's compute over one step's micro-batches, as the executor drives it.
struct DeviceStage<'a> {
    first: bool,
    last: bool,
    hidden: usize,
    gpu: &'a mut GpuLlama,
    batches: &'a [Batch],
    denominator: f64,
    loss_scale: f32,
    precision: DType,
    pp: &'a dyn Communicator,
}

impl<'a> DeviceStage<'a> {
    /// Micro-batch `mb`, with its position ids set for the calls of its shape.
    fn batch(&mut self, mb: usize) -> Result<&'a Batch> {
        let batches: &'a [Batch] = self.batches;
        let b = batches.get(mb).ok_or_else(|| {
            usage(
                "--pp-schedule",
                format!(
                    "internal: the schedule names micro-batch {mb} of {}",
                    self.batches.len()
                ),
            )
        })?;
        self.gpu
            .set_position_ids(b.positions.as_deref(), b.batch, b.seq_len)?;
        Ok(b)
    }
}

impl StageCompute for DeviceStage<'_> {
    type Buffer = StageBuffer;

    fn first(&self) -> bool {
        self.first
    }

    fn last(&self) -> bool {
        self.last
    }

    fn buffer(&mut self) -> Result<StageBuffer> {
        self.gpu.stage_buffer()
    }

    fn forward(
        &mut self,
        mb: usize,
        input: Option<&StageBuffer>,
        output: Option<&mut StageBuffer>,
    ) -> Result<()> {
        let b = self.batch(mb)?;
        let (ids, shape) = (&b.input_ids, (b.batch, b.seq_len));
        self.gpu.stage_forward(ids, shape, input, output)
    }

    fn backward(
        &mut self,
        mb: usize,
        dout: Option<&StageBuffer>,
        din: Option<&mut StageBuffer>,
    ) -> Result<Option<f64>> {
        let (denominator, loss_scale) = (self.denominator, self.loss_scale);
        let b = self.batch(mb)?;
        let (ids, labels, shape) = (&b.input_ids, &b.labels, (b.batch, b.seq_len));
        let stats =
            self.gpu
                .stage_backward((ids, labels), shape, denominator, loss_scale, dout, din)?;
        Ok(stats.map(|s| s.loss_sum))
    }

    fn exchange(&mut self, transfers: &mut [(P2p, &mut StageBuffer)]) -> Result<()> {
        let (precision, hidden, batches) = (self.precision, self.hidden, self.batches);
        let mut ops: Vec<P2pOp<'_>> = Vec::with_capacity(transfers.len());
        for (op, buf) in transfers.iter_mut() {
            let b = batches.get(op.micro_batch).ok_or_else(|| {
                usage(
                    "--pp-schedule",
                    format!("internal: a transfer of micro-batch {}", op.micro_batch),
                )
            })?;
            let len = b.batch * b.seq_len * hidden;
            ops.push(if op.kind.is_send() {
                buf.send(precision, len, op.peer_stage)?
            } else {
                buf.recv(precision, len, op.peer_stage)?
            });
        }
        self.pp.batch_p2p(&mut ops)?;
        Ok(())
    }
}

impl StepBackend for GpuPipelineParallelBackend {
    split_rank_methods!();

    fn forward_backward(
        &mut self,
        batch: &Batch,
        denominator: f64,
        precision: DType,
        loss_scale: f32,
    ) -> Result<f64> {
        self.run_step(
            std::slice::from_ref(batch),
            denominator,
            precision,
            loss_scale,
        )
    }

    fn forward_backward_step(
        &mut self,
        batches: &[Batch],
        denominator: f64,
        precision: DType,
        loss_scale: f32,
    ) -> Option<Result<f64>> {
        Some(self.run_step(batches, denominator, precision, loss_scale))
    }

    /// The forward only, stage after stage: each receives its input from the one before and
    /// sends its output on; the last computes the loss, which is summed over the pipeline.
    fn eval_loss(&mut self, batch: &Batch, precision: DType) -> Result<LossStats> {
        self.inner.use_precision(precision)?;
        self.inner
            .gpu
            .set_position_ids(batch.positions.as_deref(), batch.batch, batch.seq_len)?;
        let shape = (batch.batch, batch.seq_len);
        let len = self.stage.boundary_len(shape.0 * shape.1);
        let stage = self.stage.pipe.stage;
        let input = if self.stage.is_first() {
            None
        } else {
            let mut buf = self.take_buffer()?;
            self.pp
                .batch_p2p(&mut [buf.recv(precision, len, stage - 1)?])?;
            Some(buf)
        };
        let ids = &batch.input_ids;
        let mut loss = LossStats::default();
        if self.stage.is_last() {
            self.inner
                .gpu
                .stage_forward(ids, shape, input.as_ref(), None)?;
            loss = self.inner.gpu.stage_loss((ids, &batch.labels), shape)?;
        } else {
            let mut out = self.take_buffer()?;
            self.inner
                .gpu
                .stage_forward(ids, shape, input.as_ref(), Some(&mut out))?;
            self.pp
                .batch_p2p(&mut [out.send(precision, len, stage + 1)?])?;
            self.pool.push(out);
        }
        self.pool.extend(input);
        let pp = self.pp.as_ref();
        Ok(LossStats {
            loss_sum: scalars::sum_f64(pp, loss.loss_sum)?,
            valid_tokens: scalars::sum_u64(pp, loss.valid_tokens as u64)? as usize,
        })
    }

    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<bool> {
        let local = self.inner.unscale_and_check(inv_scale)?;
        Ok(scalars::any(self.model_group.as_ref(), local)?)
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        // The fused AdamW clips inside its kernel with the pipeline's norm (`optimizer_step`).
        self.inner.clip_grad_norm(max_norm)
    }

    fn model(&mut self) -> Result<&LlamaForCausalLM> {
        Err(usage(
            "--pp-size",
            "a pipeline stage holds only its layers; the whole model exists in the saved files \
             (the final model is gathered)"
                .into(),
        ))
    }

    fn save_model(
        &mut self,
        dir: &Path,
        config: &LlamaConfig,
        dtype: DType,
        max_shard_bytes: Option<usize>,
    ) -> Result<()> {
        let full = self.gather_full_params()?;
        if self.model_group.rank() != 0 {
            return Ok(());
        }
        save_pretrained(dir, config, &full, dtype, max_shard_bytes)
    }

    fn save_optimizer(&mut self, path: &Path) -> Result<()> {
        self.inner
            .save_optimizer_slices(path, &self.stage.plan, &self.full_specs)
    }

    /// Reads this stage's tensors of the weights and of the optimizer state, whatever layout
    /// (or engine) wrote the checkpoint.
    fn restore(&mut self, dir: &Path, optimizer: &OptimizerCheckpoint) -> Result<()> {
        self.inner
            .restore_optimizer_slices(optimizer, &self.stage.plan, &self.full_specs)?;
        self.load_weights(dir)
    }

    fn load_weights(&mut self, dir: &Path) -> Result<()> {
        let stage = &self.stage;
        self.inner
            .load_weight_slices(dir, &stage.full_config, &self.full_specs, &stage.plan)
    }
}
