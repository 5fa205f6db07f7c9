//! Tensor and pipeline parallelism on the CPU reference engine: one rank's part of the model
//! ([`RankModel`]) as a [`StepBackend`], so the Trainer's loop, data parallelism and ZeRO run
//! over it unchanged (see "Tensor parallelism" and "Pipeline parallelism" in
//! `docs/ARCHITECTURE.md`).
//!
//! The ranks of one model replica (its tensor-parallel × pipeline-parallel ranks, the
//! "model-parallel group") see the same batches and call every method in the same order; the
//! methods that need the whole model's view (the gradient norm, the overflow check, the loss,
//! the saved model) are collective over that group. The flat buffers the Trainer and data
//! parallelism see are this rank's local ones, so data parallelism reduces each slice among the
//! ranks that hold the same slice.

mod exec;
pub(crate) mod slices;

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use tilearn_ops::DType;
use tilearn_optim::AdamW;
use tilearn_parallel::pipeline::ScheduleKind;
use tilearn_parallel::{BufferMut, Communicator, ReduceOp, scalars};

use super::backend::StepBackend;
use super::cpu_backend::{resharded, round_into};
use super::flat_buffer::FlatBuffer;
use super::optimizer_file::{self, HostMoments};
use super::optimizer_layout::{TensorSlice, slices_within};
use super::optimizer_shards::OptimizerCheckpoint;
use super::zero::{CPU_FP32_ADAMW, RankState, StateBytes};
use crate::checkpoint::{load_into, save_pretrained};
use crate::config::LlamaConfig;
use crate::data::Batch;
use crate::model::model_parallel::{PipelineShard, RankModel, assemble_ranks};
use crate::model::tensor_parallel::{Cut, TensorShard};
use crate::model::{Activations, LlamaForCausalLM, LossStats, PartialSums, Whole};
use crate::params::{ParamSpec, ParamStore};
use crate::{EngineError, Result};

/// [`PartialSums`] over a communicator (the tensor-parallel group): f32 all-reduces.
pub struct GroupSums {
    comm: Arc<dyn Communicator>,
}

impl GroupSums {
    pub fn new(comm: Arc<dyn Communicator>) -> GroupSums {
        GroupSums { comm }
    }

    fn reduce(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.comm.all_reduce(BufferMut::from(buf), op)?.wait()?;
        Ok(())
    }
}

impl PartialSums<f32> for GroupSums {
    fn parts(&self) -> usize {
        self.comm.world_size()
    }

    fn sum(&self, buf: &mut [f32]) -> Result<()> {
        self.reduce(buf, ReduceOp::Sum)
    }

    fn max(&self, buf: &mut [f32]) -> Result<()> {
        self.reduce(buf, ReduceOp::Max)
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn reduce_scatter_front(&self, buf: &mut [f32]) -> Result<()> {
        self.comm
            .reduce_scatter(BufferMut::from(&mut *buf), ReduceOp::Sum)?
            .wait()?;
        let chunk = buf.len() / self.comm.world_size();
        let at = self.comm.rank() * chunk;
        buf.copy_within(at..at + chunk, 0);
        Ok(())
    }

    fn all_gather_front(&self, buf: &mut [f32]) -> Result<()> {
        let chunk = buf.len() / self.comm.world_size();
        let at = self.comm.rank() * chunk;
        buf.copy_within(0..chunk, at);
        self.comm.all_gather(BufferMut::from(buf))?.wait()?;
        Ok(())
    }
}

/// The communicators of one rank of a model replica (`None` where the dimension is 1).
#[derive(Clone, Default)]
pub struct ModelParallelComms {
    /// The tensor-parallel group (consecutive ranks).
    pub tp: Option<Arc<dyn Communicator>>,
    /// The pipeline group (one rank per stage; its rank is the stage).
    pub pp: Option<Arc<dyn Communicator>>,
    /// Every rank of this replica (tp × pp), ordered by (stage, tp rank).
    pub replica: Option<Arc<dyn Communicator>>,
}

/// How a run is split: the sizes, the pipeline schedule and whether the rows between the
/// tensor-parallel products are split too (sequence parallelism).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelParallelLayout {
    pub tp: TensorShard,
    pub pipe: PipelineShard,
    pub schedule: ScheduleKind,
    pub sequence_parallel: bool,
}

/// One rank of a tensor- and pipeline-parallel model on the CPU engine.
pub struct ModelParallelCpuBackend {
    model: RankModel,
    layout: ModelParallelLayout,
    comms: ModelParallelComms,
    sums: Box<dyn PartialSums<f32> + Send>,
    /// The ranks holding the same replicated kv head (when kv heads are replicated).
    kv_group: Option<Box<dyn Communicator>>,
    kv_ranges: Vec<Range<usize>>,
    /// Sequence parallelism: the replicated tensors (the norms), whose gradients each rank
    /// computes over its rows only and which are summed over the tensor-parallel group.
    row_split_ranges: Vec<Range<usize>>,
    /// The gradients this rank counts in the global norm (replicated tensors once).
    norm_ranges: Vec<Range<usize>>,
    full_specs: Vec<ParamSpec>,
    batch: usize,
    seq: usize,
    recompute: bool,
    /// Activation buffers per local chunk, reused across micro-batches.
    pool: Vec<Vec<Activations<f32>>>,
    grads: Vec<f32>,
    working: Vec<f32>,
    optimizer: AdamW,
    /// The optimizer's part of the local buffer (all of it unless ZeRO sharded it).
    shard: Range<usize>,
}

impl ModelParallelCpuBackend {
    /// This rank's part of `full` with the optimizer `make_optimizer` builds for its tensors.
    /// Collective over the tensor-parallel group (it creates the kv replica groups).
    pub fn new(
        full: &LlamaForCausalLM,
        layout: ModelParallelLayout,
        comms: ModelParallelComms,
        make_optimizer: impl FnOnce(&ParamStore) -> Result<AdamW>,
        (batch, seq): (usize, usize),
        recompute: bool,
    ) -> Result<ModelParallelCpuBackend> {
        let size_of = |c: &Option<Arc<dyn Communicator>>| c.as_ref().map_or(1, |c| c.world_size());
        if size_of(&comms.tp) != layout.tp.size || size_of(&comms.pp) != layout.pipe.stages {
            return Err(EngineError::InvalidArgument {
                argument: "--tp-size".into(),
                message: "the communicators do not match the layout's sizes".into(),
            });
        }
        if layout.sequence_parallel && layout.tp.size < 2 {
            return Err(EngineError::InvalidArgument {
                argument: "--sequence-parallel".into(),
                message: "splits the rows between tensor-parallel products, so it needs \
                          --tp-size 2 or more; drop the flag or raise --tp-size"
                    .into(),
            });
        }
        let mut model = RankModel::from_full(full, layout.tp, layout.pipe.clone())?;
        model.sequence_parallel = layout.sequence_parallel;
        let row_split_ranges = if layout.sequence_parallel {
            let specs = &model.params.specs;
            specs
                .iter()
                .filter(|s| model.plan.cut(&s.name) == Cut::Whole)
                .map(ParamSpec::range)
                .collect()
        } else {
            Vec::new()
        };
        let mut kv_group = None;
        if let Some(tp) = &comms.tp
            && model.plan.kv_replicas > 1
        {
            let replicas = model.plan.kv_replicas;
            for head in 0..layout.tp.size / replicas {
                let ranks: Vec<usize> = (head * replicas..(head + 1) * replicas).collect();
                if let Some(group) = tp.new_group(&ranks)? {
                    kv_group = Some(group);
                }
            }
        }
        let sums: Box<dyn PartialSums<f32> + Send> = match &comms.tp {
            Some(tp) => Box::new(GroupSums::new(tp.clone())),
            None => Box::new(Whole),
        };
        let optimizer = make_optimizer(&model.params)?;
        let numel = model.params.numel();
        let pool = (0..model.chunk_count()).map(|_| Vec::new()).collect();
        Ok(ModelParallelCpuBackend {
            kv_ranges: model.kv_gradient_ranges(),
            row_split_ranges,
            norm_ranges: model.norm_ranges(),
            full_specs: ParamStore::specs_for(&full.config),
            model,
            layout,
            comms,
            sums,
            kv_group,
            batch,
            seq,
            recompute,
            pool,
            grads: vec![0.0; numel],
            working: Vec::new(),
            optimizer,
            shard: 0..numel,
        })
    }

    fn is_pipelined(&self) -> bool {
        self.layout.pipe.stages > 1 || self.layout.pipe.chunks > 1
    }

    /// Rounds the master weights into the working copy for a bf16/fp16 period (the CPU's
    /// emulation of a GPU's working weights, as [`super::CpuBackend`] does).
    fn round_working(&mut self, precision: DType) {
        round_into(&self.model.params.data, &mut self.working, precision);
    }

    /// The gradients that are partial per rank after a step's backwards, snapshotted before
    /// them: replicated kv heads (each replica added only its query heads' share) and, with
    /// sequence parallelism, the replicated norms (each rank added only its rows' share).
    fn partial_snapshot(&self) -> (Vec<f32>, Vec<f32>) {
        let take = |ranges: &[Range<usize>]| -> Vec<f32> {
            ranges
                .iter()
                .flat_map(|r| self.grads[r.clone()].iter().copied())
                .collect()
        };
        (take(&self.kv_ranges), take(&self.row_split_ranges))
    }

    /// Completes the gradients of [`Self::partial_snapshot`]: the increments since `before`
    /// summed over the ranks that share them.
    fn sum_partial_gradients(&mut self, (kv, rows): &(Vec<f32>, Vec<f32>)) -> Result<()> {
        if let Some(group) = &self.kv_group {
            sum_increments(group.as_ref(), &mut self.grads, &self.kv_ranges, kv)?;
        }
        if let Some(tp) = self
            .comms
            .tp
            .as_ref()
            .filter(|_| !self.row_split_ranges.is_empty())
        {
            sum_increments(tp.as_ref(), &mut self.grads, &self.row_split_ranges, rows)?;
        }
        Ok(())
    }

    /// This rank's share of the squared gradient norm over `range` of the local buffer
    /// (replicated tensors counted by one rank), summed over the replica.
    fn replica_sum_of_squares(&self, range: &Range<usize>) -> Result<f64> {
        let local: f64 = self
            .norm_ranges
            .iter()
            .map(|r| r.start.max(range.start)..r.end.min(range.end))
            .filter(|r| !r.is_empty())
            .map(|r| tilearn_optim::clip::sum_of_squares(&self.grads[r]))
            .sum();
        self.replica_sum(local)
    }

    fn replica_sum(&self, value: f64) -> Result<f64> {
        match &self.comms.replica {
            Some(c) => Ok(scalars::sum_f64(c.as_ref(), value)?),
            None => Ok(value),
        }
    }

    /// Every replica rank's local parameters gathered and put together as the whole model.
    fn gather_full_params(&self) -> Result<ParamStore> {
        let local = &self.model.params.data;
        let Some(replica) = &self.comms.replica else {
            let pipe = self.layout.pipe.clone();
            return assemble_ranks(&self.model.full_config, &[(self.layout.tp, pipe, local)]);
        };
        let (all, longest) = gather_padded(replica.as_ref(), local)?;
        let tp = self.layout.tp.size;
        let parts: Vec<(TensorShard, PipelineShard, &[f32])> = all
            .chunks(longest)
            .enumerate()
            .map(|(j, data)| {
                let pipe = PipelineShard {
                    stage: j / tp,
                    ..self.layout.pipe.clone()
                };
                let shard = TensorShard {
                    rank: j % tp,
                    size: tp,
                };
                (shard, pipe, data)
            })
            .collect();
        assemble_ranks(&self.model.full_config, &parts)
    }

    /// The slices of the whole model's tensors that elements `range` of the local buffer are
    /// (the `layout` of this rank's optimizer file).
    fn slices(&self, range: &Range<usize>) -> Vec<TensorSlice> {
        let (plan, full) = (&self.model.plan, &self.full_specs);
        slices_within(
            &self.model.params.specs,
            |spec| slices::place(plan, full, spec),
            range,
        )
    }

    /// Whether this rank writes the gathered model (rank 0 of its replica).
    fn writes_model(&self) -> bool {
        self.comms.replica.as_ref().is_none_or(|c| c.rank() == 0)
    }
}

/// Every rank's `local` buffer gathered over `group`, each padded to the longest: rank `j`'s
/// elements start at `j * longest` of the result, `(result, longest)`.
pub(crate) fn gather_padded(group: &dyn Communicator, local: &[f32]) -> Result<(Vec<f32>, usize)> {
    let longest = scalars::gather_words(group, local.len() as u64)?
        .into_iter()
        .max()
        .unwrap_or(0) as usize;
    let (rank, size) = (group.rank(), group.world_size());
    let mut all = vec![0f32; longest * size];
    all[rank * longest..rank * longest + local.len()].copy_from_slice(local);
    group.all_gather(BufferMut::from(&mut all[..]))?.wait()?;
    Ok((all, longest))
}

/// Adds to `grads[ranges]` the sum over `group` of their increments since `before` (the
/// ranges' values, concatenated).
fn sum_increments(
    group: &dyn Communicator,
    grads: &mut [f32],
    ranges: &[Range<usize>],
    before: &[f32],
) -> Result<()> {
    let mut delta: Vec<f32> = ranges
        .iter()
        .flat_map(|r| grads[r.clone()].iter().copied())
        .zip(before)
        .map(|(g, p)| g - p)
        .collect();
    group
        .all_reduce(BufferMut::from(&mut delta[..]), ReduceOp::Sum)?
        .wait()?;
    let mut at = 0;
    for r in ranges {
        let (prior, d) = (&before[at..at + r.len()], &delta[at..at + r.len()]);
        for ((g, p), d) in grads[r.clone()].iter_mut().zip(prior).zip(d) {
            *g = p + d;
        }
        at += r.len();
    }
    Ok(())
}

impl StepBackend for ModelParallelCpuBackend {
    fn describe(&self) -> String {
        format!(
            "cpu (f32 reference engine), tensor-parallel rank {} of {}, pipeline stage {} of {}",
            self.layout.tp.rank,
            self.layout.tp.size,
            self.layout.pipe.stage,
            self.layout.pipe.stages
        )
    }

    fn zero_grads(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = 0.0);
    }

    fn forward_backward(
        &mut self,
        batch: &Batch,
        denominator: f64,
        precision: DType,
        loss_scale: f32,
    ) -> Result<f64> {
        let loss = self.forward_backward_step(
            std::slice::from_ref(batch),
            denominator,
            precision,
            loss_scale,
        );
        loss.expect("the model-parallel backend runs every step itself")
    }

    fn forward_backward_step(
        &mut self,
        batches: &[Batch],
        denominator: f64,
        precision: DType,
        loss_scale: f32,
    ) -> Option<Result<f64>> {
        Some(exec::run_step(
            self,
            batches,
            denominator,
            precision,
            loss_scale,
        ))
    }

    fn eval_loss(&mut self, batch: &Batch, precision: DType) -> Result<LossStats> {
        exec::eval(self, batch, precision)
    }

    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<bool> {
        let local = adaptfp16::unscale_and_check_slice(&mut self.grads, inv_scale);
        match &self.comms.replica {
            Some(c) => Ok(scalars::any(c.as_ref(), local)?),
            None => Ok(local),
        }
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        let norm = self.replica_sum_of_squares(&(0..self.grads.len()))?.sqrt();
        if max_norm > 0.0
            && let Some(coef) = tilearn_optim::clip::clip_coefficient(norm, max_norm)
        {
            tilearn_optim::clip::scale_grads(&mut self.grads, coef as f32);
        }
        Ok(norm)
    }

    fn optimizer_step(&mut self, lr: f32) -> Result<Option<f64>> {
        let shard = self.shard.clone();
        self.optimizer.step(
            &mut self.model.params.data[shard.clone()],
            &self.grads[shard],
            lr,
        )?;
        Ok(None)
    }

    fn model(&mut self) -> Result<&LlamaForCausalLM> {
        Err(EngineError::InvalidArgument {
            argument: "--tp-size".into(),
            message: "a tensor- or pipeline-parallel rank holds only its part of the model; \
                      the whole model exists in the saved files (the final model is gathered)"
                .into(),
        })
    }

    fn specs(&self) -> &[ParamSpec] {
        &self.model.params.specs
    }

    fn saved_specs(&self) -> &[ParamSpec] {
        &self.full_specs
    }

    fn save_model(
        &mut self,
        dir: &Path,
        config: &LlamaConfig,
        dtype: DType,
        max_shard_bytes: Option<usize>,
    ) -> Result<()> {
        let full = self.gather_full_params()?;
        if !self.writes_model() {
            return Ok(());
        }
        save_pretrained(dir, config, &full, dtype, max_shard_bytes)
    }

    fn save_optimizer(&mut self, path: &Path) -> Result<()> {
        let o = &self.optimizer;
        let mut source = HostMoments {
            exp_avg: o.exp_avg(),
            exp_avg_sq: o.exp_avg_sq(),
        };
        let layout = self.slices(&self.shard);
        optimizer_file::write_sliced(
            path,
            o.config(),
            o.groups(),
            o.step_count(),
            self.shard.len(),
            Some(&layout),
            &mut source,
        )
    }

    /// Reads this rank's slices of the weights and of the optimizer state (its ZeRO shard of
    /// them), whatever layout wrote the checkpoint.
    fn restore(&mut self, dir: &Path, optimizer: &OptimizerCheckpoint) -> Result<()> {
        let want = self.slices(&self.shard);
        let len = self.shard.len();
        let mut moments = vec![0.0f32; 2 * len];
        let step = optimizer.read_slices(&self.full_specs, &want, &mut &mut moments[..])?;
        let exp_avg_sq = moments.split_off(len);
        self.load_weights(dir)?;
        self.optimizer.set_state(moments, exp_avg_sq, None, step)?;
        Ok(())
    }

    fn load_weights(&mut self, dir: &Path) -> Result<()> {
        let params = &mut self.model.params;
        let mut dest = slices::RankSlices::new(
            &self.full_specs,
            &params.specs,
            &self.model.plan,
            &mut params.data,
        );
        load_into(dir, &self.model.full_config, &self.full_specs, &mut dest)
    }

    fn flat_gradients(&mut self) -> Result<FlatBuffer<'_>> {
        Ok(FlatBuffer::Host(&mut self.grads))
    }

    fn flat_parameters(&mut self) -> Result<FlatBuffer<'_>> {
        Ok(FlatBuffer::Host(&mut self.model.params.data))
    }

    fn shard_optimizer(&mut self, shard: Range<usize>) -> Result<()> {
        self.optimizer = resharded(&self.optimizer, &self.shard, &shard)?;
        self.shard = shard;
        Ok(())
    }

    fn grad_sum_of_squares(&mut self, range: Range<usize>) -> Result<f64> {
        self.replica_sum_of_squares(&range)
    }

    fn scale_gradients(&mut self, range: Range<usize>, factor: f32) -> Result<()> {
        tilearn_optim::clip::scale_grads(&mut self.grads[range], factor);
        Ok(())
    }

    fn state_layout(&self) -> StateBytes {
        CPU_FP32_ADAMW
    }

    fn state_held(&self) -> RankState {
        let o = &self.optimizer;
        RankState::host_fp32(
            self.model.params.data.len(),
            self.grads.len(),
            o.exp_avg().len() + o.exp_avg_sq().len(),
        )
    }

    fn poison_gradients(&mut self) -> Result<()> {
        self.grads.iter_mut().for_each(|g| *g = f32::INFINITY);
        Ok(())
    }

    fn peak_memory_bytes(&self) -> u64 {
        let params = self.model.params.numel() * 4;
        let acts: usize = self.pool.iter().flatten().map(Activations::bytes).sum();
        (params * 2 + self.working.capacity() * 4 + acts) as u64
            + self.state_held().optimizer as u64
    }
}
