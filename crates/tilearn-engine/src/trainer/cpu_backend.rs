//! The CPU reference engine as a [`StepBackend`].
//!
//! Mixed precision on the CPU is an emulation with the same numerics where they matter for the
//! scaler and the policies: in bf16/fp16 periods the forward and backward read the weights
//! rounded to that format (the working copy a GPU would hold) while the master weights and the
//! optimizer stay f32, and in fp16 periods the scaled gradients are rounded to f16, so an
//! element beyond f16's range overflows to infinity exactly as an fp16 backward would. The
//! arithmetic inside the ops stays f32.

use std::ops::Range;
use std::path::Path;

use half::{bf16, f16};
use tilearn_ops::DType;
use tilearn_optim::{AdamW, ParamGroup};

use super::backend::StepBackend;
use super::flat_buffer::FlatBuffer;
use super::optimizer_file;
use super::optimizer_shards::{OptimizerCheckpoint, groups_within};
use super::zero::{CPU_FP32_ADAMW, RankState, StateBytes};
use crate::Result;
use crate::checkpoint::{load_params_into, save_pretrained};
use crate::config::LlamaConfig;
use crate::data::Batch;
use crate::model::{Activations, LlamaForCausalLM, LossStats};
use crate::params::ParamSpec;

pub struct CpuBackend {
    model: LlamaForCausalLM,
    acts: Activations<f32>,
    grads: Vec<f32>,
    /// The weights rounded to the period's precision (unused in fp32 periods).
    working: Vec<f32>,
    /// Steps `params[shard]` (all parameters unless ZeRO sharded it).
    optimizer: AdamW,
    shard: Range<usize>,
}

impl CpuBackend {
    pub fn new(
        model: LlamaForCausalLM,
        optimizer: AdamW,
        batch: usize,
        seq: usize,
        gradient_checkpointing: bool,
    ) -> CpuBackend {
        let acts = Activations::new(&model.config, batch, seq, gradient_checkpointing);
        let numel = model.params.numel();
        CpuBackend {
            model,
            acts,
            grads: vec![0.0; numel],
            working: Vec::new(),
            optimizer,
            shard: 0..numel,
        }
    }
}

/// The master weights rounded to `precision` (the CPU's emulation of a GPU's working copy).
pub(super) fn round_into(master: &[f32], working: &mut Vec<f32>, precision: DType) {
    working.clear();
    match precision {
        DType::BF16 => working.extend(master.iter().map(|&x| bf16::from_f32(x).to_f32())),
        DType::F16 => working.extend(master.iter().map(|&x| f16::from_f32(x).to_f32())),
        DType::F32 => working.extend_from_slice(master),
    }
}

impl StepBackend for CpuBackend {
    fn describe(&self) -> String {
        "cpu (f32 reference engine)".into()
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
        // Gradients of loss_sum * scale / denominator: fold the scale into the denominator.
        let denom = denominator / loss_scale as f64;
        self.acts
            .set_position_ids(batch.positions.as_deref(), batch.batch, batch.seq_len)?;
        let stats = if precision == DType::F32 {
            self.model.forward_backward(
                &batch.input_ids,
                &batch.labels,
                batch.batch,
                batch.seq_len,
                Some(denom),
                &mut self.acts,
                &mut self.grads,
            )?
        } else {
            round_into(&self.model.params.data, &mut self.working, precision);
            self.model.forward_backward_with(
                &self.working,
                &batch.input_ids,
                &batch.labels,
                batch.batch,
                batch.seq_len,
                Some(denom),
                &mut self.acts,
                &mut self.grads,
            )?
        };
        if precision == DType::F16 {
            for g in &mut self.grads {
                *g = f16::from_f32(*g).to_f32();
            }
        }
        Ok(stats.loss_sum)
    }

    fn eval_loss(&mut self, batch: &Batch, precision: DType) -> Result<LossStats> {
        let params = if precision == DType::F32 {
            &self.model.params.data
        } else {
            round_into(&self.model.params.data, &mut self.working, precision);
            &self.working
        };
        self.acts
            .set_position_ids(batch.positions.as_deref(), batch.batch, batch.seq_len)?;
        self.model.forward_loss_with(
            params,
            &batch.input_ids,
            &batch.labels,
            batch.batch,
            batch.seq_len,
            &mut self.acts,
        )
    }

    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<bool> {
        Ok(adaptfp16::unscale_and_check_slice(
            &mut self.grads,
            inv_scale,
        ))
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        Ok(if max_norm > 0.0 {
            tilearn_optim::clip_grad_norm(&mut self.grads, max_norm)
        } else {
            tilearn_optim::global_grad_norm(&self.grads)
        })
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
        Ok(&self.model)
    }

    fn specs(&self) -> &[ParamSpec] {
        &self.model.params.specs
    }

    fn save_model(
        &mut self,
        dir: &Path,
        config: &LlamaConfig,
        dtype: DType,
        max_shard_bytes: Option<usize>,
    ) -> Result<()> {
        save_pretrained(dir, config, &self.model.params, dtype, max_shard_bytes)
    }

    fn save_optimizer(&mut self, path: &Path) -> Result<()> {
        write_host_optimizer(&self.optimizer, self.shard.len(), path)
    }

    fn restore(&mut self, dir: &Path, optimizer: &OptimizerCheckpoint) -> Result<()> {
        let numel = self.model.params.numel();
        let len = self.shard.len();
        let mut moments = vec![0.0f32; 2 * len];
        let mut dest: &mut [f32] = &mut moments;
        let step = optimizer.read(numel, self.shard.clone(), &mut dest)?;
        let exp_avg_sq = moments.split_off(len);
        load_params_into(dir, &self.model.config, &mut self.model.params)?;
        self.optimizer.set_state(moments, exp_avg_sq, None, step)?;
        Ok(())
    }

    fn load_weights(&mut self, dir: &Path) -> Result<()> {
        load_params_into(dir, &self.model.config, &mut self.model.params)
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
        Ok(tilearn_optim::clip::sum_of_squares(&self.grads[range]))
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
        // master + grads + working copy + activations arena + the moments (sharded by ZeRO)
        (params * 2 + self.working.capacity() * 4 + self.acts.bytes()) as u64
            + self.state_held().optimizer as u64
    }
}

/// Writes a host AdamW's state (for `len` parameters) in the format of [`optimizer_file`].
pub(super) fn write_host_optimizer(o: &AdamW, len: usize, path: &Path) -> Result<()> {
    let mut source = optimizer_file::HostMoments {
        exp_avg: o.exp_avg(),
        exp_avg_sq: o.exp_avg_sq(),
    };
    optimizer_file::write(
        path,
        o.config(),
        o.groups(),
        o.step_count(),
        len,
        &mut source,
    )
}

/// A fresh AdamW for parameters `shard` of the flat buffer, with `o`'s configuration and
/// groups (which cover `current`) cut to it: ZeRO's partition of the optimizer.
pub(super) fn resharded(o: &AdamW, current: &Range<usize>, shard: &Range<usize>) -> Result<AdamW> {
    // The groups in whole-buffer coordinates (shifting back any earlier shard), then cut.
    let full: Vec<_> = o
        .groups()
        .iter()
        .map(|g| ParamGroup {
            ranges: g
                .ranges
                .iter()
                .map(|r| r.start + current.start..r.end + current.start)
                .collect(),
            ..g.clone()
        })
        .collect();
    Ok(AdamW::new(
        *o.config(),
        groups_within(&full, shard),
        shard.len(),
    )?)
}
