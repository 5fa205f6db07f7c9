//! Tensor parallelism on the CPU reference engine: one rank's part of the model
//! ([`TensorParallelLlama`]) as a [`StepBackend`], so the Trainer's loop, data parallelism and
//! ZeRO run over it unchanged (see "Tensor parallelism" in `docs/ARCHITECTURE.md`).
//!
//! Every rank of a tensor-parallel group sees the same batches and calls every method in the
//! same order; the methods that need the whole model's view (the gradient norm, the overflow
//! check, the saved model) are collective over the group. The flat buffers the Trainer and
//! data parallelism see are this rank's local ones, so data parallelism reduces each tp rank's
//! slices among the ranks that hold the same slices.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use half::{bf16, f16};
use tilearn_ops::DType;
use tilearn_optim::{AdamW, ParamGroup};
use tilearn_parallel::{BufferMut, Communicator, ReduceOp, scalars};

use super::backend::StepBackend;
use super::flat_buffer::FlatBuffer;
use super::optimizer_file;
use super::optimizer_shards::{OptimizerCheckpoint, groups_within};
use super::zero::{CPU_FP32_ADAMW, RankState, StateBytes};
use crate::checkpoint::save_pretrained;
use crate::config::LlamaConfig;
use crate::data::Batch;
use crate::model::tensor_parallel::{TensorParallelLlama, assemble_params};
use crate::model::{Activations, LlamaForCausalLM, LossStats, PartialSums};
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
}

/// One tensor-parallel rank of the CPU engine.
pub struct TensorParallelCpuBackend {
    model: TensorParallelLlama,
    tp: Arc<dyn Communicator>,
    sums: GroupSums,
    /// The ranks holding the same replicated kv head (when kv heads are replicated).
    kv_group: Option<Box<dyn Communicator>>,
    kv_ranges: Vec<Range<usize>>,
    /// The gradients this rank counts in the global norm (replicated tensors once).
    norm_ranges: Vec<Range<usize>>,
    full_specs: Vec<ParamSpec>,
    acts: Activations<f32>,
    grads: Vec<f32>,
    working: Vec<f32>,
    optimizer: AdamW,
    /// The optimizer's part of the local buffer (all of it unless ZeRO sharded it).
    shard: Range<usize>,
}

impl TensorParallelCpuBackend {
    /// Rank `tp.rank()`'s part of `full` with `optimizer` built by `make_optimizer` for the
    /// local parameters. Collective over `tp` (it builds the kv replica groups).
    pub fn new(
        full: &LlamaForCausalLM,
        tp: Arc<dyn Communicator>,
        make_optimizer: impl FnOnce(&ParamStore) -> Result<AdamW>,
        batch: usize,
        seq: usize,
        gradient_checkpointing: bool,
    ) -> Result<TensorParallelCpuBackend> {
        let shard = crate::model::tensor_parallel::TensorShard {
            rank: tp.rank(),
            size: tp.world_size(),
        };
        let model = TensorParallelLlama::from_full(full, shard)?;
        let mut kv_group = None;
        if model.plan.kv_replicas > 1 {
            for ranks in model.kv_replica_groups() {
                if let Some(group) = tp.new_group(&ranks)? {
                    kv_group = Some(group);
                }
            }
        }
        let optimizer = make_optimizer(&model.local.params)?;
        let acts = Activations::new(&model.local.config, batch, seq, gradient_checkpointing);
        let numel = model.local.params.numel();
        Ok(TensorParallelCpuBackend {
            kv_ranges: model.kv_gradient_ranges(),
            norm_ranges: model.norm_ranges(),
            full_specs: ParamStore::specs_for(&full.config),
            sums: GroupSums::new(tp.clone()),
            tp,
            kv_group,
            model,
            acts,
            grads: vec![0.0; numel],
            working: Vec::new(),
            optimizer,
            shard: 0..numel,
        })
    }

    /// Rounds the master weights into the working copy for a bf16/fp16 period (the CPU's
    /// emulation of a GPU's working weights, as [`super::CpuBackend`] does).
    fn round_working(&mut self, precision: DType) {
        let master = &self.model.local.params.data;
        if precision == DType::F32 {
            return;
        }
        self.working.clear();
        match precision {
            DType::BF16 => self
                .working
                .extend(master.iter().map(|&x| bf16::from_f32(x).to_f32())),
            _ => self
                .working
                .extend(master.iter().map(|&x| f16::from_f32(x).to_f32())),
        }
    }

    /// Replicated kv heads: each replica added only its query heads' share of this
    /// micro-batch's gradient; the sum over the replicas is the true one. Only the
    /// micro-batch's increment is summed (`before` holds the gradients from earlier ones).
    fn sum_kv_replicas(&mut self, before: &[f32]) -> Result<()> {
        let Some(group) = &self.kv_group else {
            return Ok(());
        };
        let mut at = 0;
        for range in &self.kv_ranges {
            let prior = &before[at..at + range.len()];
            let grads = &mut self.grads[range.clone()];
            let mut delta: Vec<f32> = grads.iter().zip(prior).map(|(g, p)| g - p).collect();
            group
                .all_reduce(BufferMut::from(&mut delta[..]), ReduceOp::Sum)?
                .wait()?;
            for ((g, p), d) in grads.iter_mut().zip(prior).zip(&delta) {
                *g = p + d;
            }
            at += range.len();
        }
        Ok(())
    }

    /// This rank's share of the squared gradient norm over `range` of the local buffer
    /// (replicated tensors counted by one rank), summed over the group.
    fn group_sum_of_squares(&self, range: &Range<usize>) -> Result<f64> {
        let local: f64 = self
            .norm_ranges
            .iter()
            .map(|r| r.start.max(range.start)..r.end.min(range.end))
            .filter(|r| !r.is_empty())
            .map(|r| tilearn_optim::clip::sum_of_squares(&self.grads[r]))
            .sum();
        Ok(scalars::sum_f64(self.tp.as_ref(), local)?)
    }

    /// Every rank's local parameters, padded to the longest, gathered over the group.
    fn gather_full_params(&self) -> Result<ParamStore> {
        let local = &self.model.local.params.data;
        let longest = scalars::gather_words(self.tp.as_ref(), local.len() as u64)?
            .into_iter()
            .max()
            .unwrap_or(0) as usize;
        let (rank, size) = (self.tp.rank(), self.tp.world_size());
        let mut all = vec![0f32; longest * size];
        all[rank * longest..rank * longest + local.len()].copy_from_slice(local);
        self.tp.all_gather(BufferMut::from(&mut all[..]))?.wait()?;
        let parts: Vec<&[f32]> = all.chunks(longest).collect();
        assemble_params(&self.model.full_config, &parts)
    }
}

impl StepBackend for TensorParallelCpuBackend {
    fn describe(&self) -> String {
        format!(
            "cpu (f32 reference engine), tensor-parallel rank {} of {}",
            self.tp.rank(),
            self.tp.world_size()
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
        let denom = denominator / loss_scale as f64;
        let before: Vec<f32> = self
            .kv_ranges
            .iter()
            .flat_map(|r| self.grads[r.clone()].iter().copied())
            .collect();
        self.round_working(precision);
        let params = if precision == DType::F32 {
            &self.model.local.params.data
        } else {
            &self.working
        };
        let stats = self.model.forward_backward_with(
            params,
            &batch.input_ids,
            &batch.labels,
            batch.batch,
            batch.seq_len,
            Some(denom),
            &mut self.acts,
            &mut self.grads,
            &self.sums,
        )?;
        self.sum_kv_replicas(&before)?;
        if precision == DType::F16 {
            for g in &mut self.grads {
                *g = f16::from_f32(*g).to_f32();
            }
        }
        Ok(stats.loss_sum)
    }

    fn eval_loss(&mut self, batch: &Batch, precision: DType) -> Result<LossStats> {
        self.round_working(precision);
        let params = if precision == DType::F32 {
            &self.model.local.params.data
        } else {
            &self.working
        };
        self.model.forward_loss_with(
            params,
            &batch.input_ids,
            &batch.labels,
            batch.batch,
            batch.seq_len,
            &mut self.acts,
            &self.sums,
        )
    }

    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<bool> {
        let local = adaptfp16::unscale_and_check_slice(&mut self.grads, inv_scale);
        Ok(scalars::any(self.tp.as_ref(), local)?)
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        let norm = self.group_sum_of_squares(&(0..self.grads.len()))?.sqrt();
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
            &mut self.model.local.params.data[shard.clone()],
            &self.grads[shard],
            lr,
        )?;
        Ok(None)
    }

    fn model(&mut self) -> Result<&LlamaForCausalLM> {
        Err(EngineError::InvalidArgument {
            argument: "--tp-size".into(),
            message: "a tensor-parallel rank holds only its slices of the model; the whole \
                      model exists in the saved files (the final model is gathered)"
                .into(),
        })
    }

    fn specs(&self) -> &[ParamSpec] {
        &self.model.local.params.specs
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
        if self.tp.rank() != 0 {
            return Ok(());
        }
        save_pretrained(dir, config, &full, dtype, max_shard_bytes)
    }

    fn save_optimizer(&mut self, path: &Path) -> Result<()> {
        let o = &self.optimizer;
        let mut source = optimizer_file::HostMoments {
            exp_avg: o.exp_avg(),
            exp_avg_sq: o.exp_avg_sq(),
        };
        optimizer_file::write(
            path,
            o.config(),
            o.groups(),
            o.step_count(),
            self.shard.len(),
            &mut source,
        )
    }

    fn restore(&mut self, _dir: &Path, _optimizer: &OptimizerCheckpoint) -> Result<()> {
        Err(EngineError::InvalidArgument {
            argument: "--resume-from-checkpoint".into(),
            message: "resuming a tensor-parallel run is not supported yet; start it again \
                      from the saved model with --model"
                .into(),
        })
    }

    fn flat_gradients(&mut self) -> Result<FlatBuffer<'_>> {
        Ok(FlatBuffer::Host(&mut self.grads))
    }

    fn flat_parameters(&mut self) -> Result<FlatBuffer<'_>> {
        Ok(FlatBuffer::Host(&mut self.model.local.params.data))
    }

    fn shard_optimizer(&mut self, shard: Range<usize>) -> Result<()> {
        let o = &self.optimizer;
        let offset = self.shard.start;
        let full: Vec<_> = o
            .groups()
            .iter()
            .map(|g| ParamGroup {
                ranges: g
                    .ranges
                    .iter()
                    .map(|r| r.start + offset..r.end + offset)
                    .collect(),
                ..g.clone()
            })
            .collect();
        let groups = groups_within(&full, &shard);
        self.optimizer = AdamW::new(*o.config(), groups, shard.len())?;
        self.shard = shard;
        Ok(())
    }

    fn grad_sum_of_squares(&mut self, range: Range<usize>) -> Result<f64> {
        self.group_sum_of_squares(&range)
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
        let bytes = |n: usize| (n * std::mem::size_of::<f32>()) as f64;
        RankState {
            weights: bytes(self.model.local.params.data.len()),
            grads: bytes(self.grads.len()),
            optimizer: bytes(o.exp_avg().len() + o.exp_avg_sq().len()),
        }
    }

    fn poison_gradients(&mut self) -> Result<()> {
        self.grads.iter_mut().for_each(|g| *g = f32::INFINITY);
        Ok(())
    }

    fn peak_memory_bytes(&self) -> u64 {
        let params = self.model.local.params.numel() * 4;
        (params * 2 + self.working.capacity() * 4 + self.acts.bytes()) as u64
            + self.state_held().optimizer as u64
    }
}
