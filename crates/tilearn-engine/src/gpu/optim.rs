//! [`GpuAdamW`]: torch AdamW on the device through tilearn-optim's fused multi-tensor kernel,
//! with `clip_grad_norm_` folded into the same launch, the 16-bit working copy written by it,
//! and the GradScaler's unscale applied inside it (the gradients are never rewritten).
//!
//! ZeRO ([`GpuAdamW::reshard`]): the moments and the segment plan cover one shard of the flat
//! buffer, the step reads that shard's gradients and writes that shard's master weights and
//! working copy; the clip then uses the global sum of squares the ranks computed together
//! ([`GpuAdamW::use_global_sum_of_squares`]) instead of a norm the kernel would measure on the
//! shard alone.
//!
//! The step's scalars (bias corrections, step size, decay factor) are computed on the host
//! exactly as [`tilearn_optim::AdamW`] computes them (f64, rounded to f32 once), so a device step
//! follows the CPU optimizer's trajectory. The global gradient norm is computed on the device
//! (f64 accumulation) and read by the kernel from device memory: a step queues two launches and
//! never waits for the device.
//!
//! With loss scaling (fp16 periods), [`GpuAdamW::unscaled_norm`] computes the norm of the
//! gradients times `inv_scale` first and reads it back: that one read is the GradScaler's
//! non-finite check (an inf or NaN gradient makes the f64 sum of squares non-finite; no finite
//! f32 gradient can overflow it), so the host knows whether to skip the step before queuing it.
//! The step then reuses that norm and multiplies by the same device-side `inv_scale`.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use tilearn_ops::cuda::CudaStream;
use tilearn_optim::cuda::{
    ADAM_GROUP_WORDS, AdamGroupScalars, AdamState, Clip, FusedError, GradNorm, Grads, ParamCopy,
    SegmentPlan, StepIo, adam_step_device_groups, adamw_step,
};
use tilearn_optim::{
    AdamWConfig, AdamWStepScalars, OptimError, ParamGroup, decimal_f64, validate_groups,
};

use crate::error::{EngineError, Result};

/// AdamW state on the device: the moments (f32, flat, the parameters' layout), the segment
/// table of the groups, and the gradient-norm scratch.
#[derive(Debug)]
pub struct GpuAdamW {
    config: AdamWConfig,
    groups: Vec<ParamGroup>,
    /// Parameters of the whole flat buffer, and the part of it this optimizer steps (all of it
    /// unless ZeRO resharded it).
    numel: usize,
    shard: Range<usize>,
    plan: SegmentPlan,
    exp_avg: CudaSlice<f32>,
    exp_avg_sq: CudaSlice<f32>,
    max_exp_avg_sq: Option<CudaSlice<f32>>,
    norm: GradNorm,
    max_grad_norm: f64,
    step: u64,
    /// The GradScaler's `1 / scale` on the device (one f32).
    inv_scale: CudaSlice<f32>,
    /// Set by [`GpuAdamW::unscaled_norm`]: the next step multiplies by `inv_scale`.
    unscale: bool,
    /// The norm buffer already holds the next step's sum of squares (from
    /// [`GpuAdamW::unscaled_norm`] or [`GpuAdamW::use_global_sum_of_squares`]); its norm.
    norm_ready: Option<f64>,
    /// The pre-clip norm of the last step, when it was read on the host before the step.
    last_norm: Option<f64>,
}

impl GpuAdamW {
    /// Zeroed moments for the parameters `shard` of a flat buffer of `numel` split into
    /// `groups` (validated as the CPU optimizer validates them; `0..numel` without ZeRO);
    /// `max_grad_norm > 0` clips the global norm to it, 0 disables.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        config: AdamWConfig,
        groups: Vec<ParamGroup>,
        (numel, shard): (usize, Range<usize>),
        max_grad_norm: f64,
    ) -> Result<Self> {
        config.validate()?;
        if !(max_grad_norm.is_finite() && max_grad_norm >= 0.0) {
            return Err(EngineError::InvalidArgument {
                argument: "max_grad_norm".into(),
                message: format!("is {max_grad_norm}; use a finite value >= 0 (0 disables)"),
            });
        }
        let (plan, exp_avg, exp_avg_sq, max_exp_avg_sq) =
            Self::state_for(stream, &config, &groups, numel, shard.clone())?;
        Ok(GpuAdamW {
            config,
            groups,
            numel,
            shard,
            plan,
            exp_avg,
            exp_avg_sq,
            max_exp_avg_sq,
            norm: GradNorm::new(stream).map_err(fused)?,
            max_grad_norm,
            step: 0,
            inv_scale: stream
                .alloc_zeros::<f32>(1)
                .map_err(|e| super::cuda_err("allocating inv_scale", e))?,
            unscale: false,
            norm_ready: None,
            last_norm: None,
        })
    }

    /// The segment plan and zeroed moments for stepping `shard` of a flat buffer of `numel`.
    #[allow(clippy::type_complexity)]
    fn state_for(
        stream: &Arc<CudaStream>,
        config: &AdamWConfig,
        groups: &[ParamGroup],
        numel: usize,
        shard: Range<usize>,
    ) -> Result<(
        SegmentPlan,
        CudaSlice<f32>,
        CudaSlice<f32>,
        Option<CudaSlice<f32>>,
    )> {
        let segments = validate_groups(groups, numel)?;
        let len = shard.len();
        let plan =
            SegmentPlan::new(stream, &segments, numel, shard, groups.len()).map_err(fused)?;
        let zeros = |what: &'static str| {
            stream
                .alloc_zeros::<f32>(len.max(1))
                .map_err(|e| super::model_alloc_err(what, 4 * len, stream, e))
        };
        let exp_avg = zeros("allocating exp_avg")?;
        let exp_avg_sq = zeros("allocating exp_avg_sq")?;
        let max_exp_avg_sq = if config.amsgrad {
            Some(zeros("allocating max_exp_avg_sq")?)
        } else {
            None
        };
        Ok((plan, exp_avg, exp_avg_sq, max_exp_avg_sq))
    }

    /// ZeRO: from now on steps only the parameters `shard` of the flat buffer, with fresh
    /// (zeroed) moments sized for the shard; the old moments are freed. A resume fills them
    /// afterwards ([`GpuAdamW::moments_mut`]).
    pub(crate) fn reshard(&mut self, stream: &Arc<CudaStream>, shard: Range<usize>) -> Result<()> {
        // Free the old state first, so the peak is not old + new.
        self.exp_avg = stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| super::cuda_err("allocating exp_avg", e))?;
        self.exp_avg_sq = stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| super::cuda_err("allocating exp_avg_sq", e))?;
        self.max_exp_avg_sq = None;
        let (plan, exp_avg, exp_avg_sq, max_exp_avg_sq) = Self::state_for(
            stream,
            &self.config,
            &self.groups,
            self.numel,
            shard.clone(),
        )?;
        self.plan = plan;
        self.exp_avg = exp_avg;
        self.exp_avg_sq = exp_avg_sq;
        self.max_exp_avg_sq = max_exp_avg_sq;
        self.shard = shard;
        self.step = 0;
        self.unscale = false;
        self.norm_ready = None;
        Ok(())
    }

    /// The parameters this optimizer steps (global element range of the flat buffer).
    pub(crate) fn shard(&self) -> Range<usize> {
        self.shard.clone()
    }

    /// Number of completed steps (torch's `state["step"]`).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Bytes of device memory held (moments and scratch).
    pub(crate) fn bytes(&self) -> usize {
        self.exp_avg.num_bytes()
            + self.exp_avg_sq.num_bytes()
            + self.max_exp_avg_sq.as_ref().map_or(0, |m| m.num_bytes())
    }

    /// The GradScaler's unscale and non-finite check for the next step: the global norm of
    /// `grads * inv_scale`, read back (one synchronisation). Returns it; it is infinite or NaN
    /// exactly when some gradient is (or the sum overflowed f64, which finite f32 gradients
    /// cannot do). The next [`step`](Self::step) unscales by the same factor and reuses it.
    /// `grads`: the shard's gradients (the whole buffer unless resharded).
    pub(crate) fn unscaled_norm(
        &mut self,
        stream: &Arc<CudaStream>,
        grads: CudaView<'_, f32>,
        inv_scale: f32,
    ) -> Result<f64> {
        if !(inv_scale.is_finite() && inv_scale > 0.0) {
            return Err(EngineError::InvalidArgument {
                argument: "inv_scale".into(),
                message: format!("is {inv_scale}; the GradScaler's 1/scale is finite and > 0"),
            });
        }
        self.check_shard_len("grads", grads.len())?;
        stream
            .memcpy_htod(&[inv_scale], &mut self.inv_scale)
            .map_err(|e| super::cuda_err("uploading inv_scale", e))?;
        self.norm
            .compute(stream, &Grads::F32(grads), Some(&self.inv_scale.as_view()))
            .map_err(fused)?;
        let norm = self.norm.read(stream).map_err(fused)?[1];
        self.unscale = true;
        self.norm_ready = Some(norm);
        Ok(norm)
    }

    /// Drops a prepared unscale (the step it was for was skipped).
    pub(crate) fn discard_prepared(&mut self) {
        self.unscale = false;
        self.norm_ready = None;
    }

    /// The sum of squares of `grads` (a part of the gradient buffer), times the prepared
    /// `inv_scale` when [`GpuAdamW::unscaled_norm`] prepared one: ZeRO's partial norm. Reads it
    /// back (one synchronisation); the next step measures or is given its norm afresh.
    pub(crate) fn sum_of_squares(
        &mut self,
        stream: &Arc<CudaStream>,
        grads: CudaView<'_, f32>,
    ) -> Result<f64> {
        let scale = self.unscale.then(|| self.inv_scale.as_view());
        self.norm
            .compute(stream, &Grads::F32(grads), scale.as_ref())
            .map_err(fused)?;
        self.norm_ready = None;
        Ok(self.norm.read(stream).map_err(fused)?[0])
    }

    /// ZeRO: the next step clips with the global gradient norm `sqrt(sum_of_squares)` (every
    /// rank's shard summed) instead of measuring the norm of its own shard; the value goes to
    /// the device buffer the fused kernel reads its clip input from, so the clip coefficient
    /// is computed inside the kernel exactly as without ZeRO.
    pub(crate) fn use_global_sum_of_squares(
        &mut self,
        stream: &Arc<CudaStream>,
        sum_of_squares: f64,
    ) -> Result<()> {
        let norm = sum_of_squares.sqrt();
        stream
            .memcpy_htod(&[sum_of_squares, norm], &mut self.norm.result_mut())
            .map_err(|e| super::cuda_err("uploading the global gradient norm", e))?;
        self.norm_ready = Some(norm);
        Ok(())
    }

    fn check_shard_len(&self, what: &'static str, len: usize) -> Result<()> {
        if len == self.plan.len() {
            return Ok(());
        }
        Err(OptimError::LengthMismatch {
            what,
            expected: self.plan.len(),
            actual: len,
        }
        .into())
    }

    /// One step at learning rate `lr` (times each group's `lr_scale`): global norm of `grads`
    /// (unless [`unscaled_norm`](Self::unscaled_norm) or
    /// [`use_global_sum_of_squares`](Self::use_global_sum_of_squares) prepared it), then the
    /// fused update of `params` and of the working copy `param_copy`, with the unscale and the
    /// norm clip applied inside the kernel. Every buffer holds the optimizer's shard (the whole
    /// model unless resharded). Queues the work; does not wait.
    pub(crate) fn step(
        &mut self,
        stream: &Arc<CudaStream>,
        params: CudaViewMut<'_, f32>,
        grads: CudaView<'_, f32>,
        param_copy: ParamCopy<'_>,
        lr: f32,
    ) -> Result<()> {
        check_lr(lr)?;
        let numel = self.plan.len();
        self.check_shard_len("params", params.len())?;
        self.check_shard_len("grads", grads.len())?;
        let unscale = std::mem::take(&mut self.unscale);
        let ready = self.norm_ready.take();
        if ready.is_none() {
            // The norm is always computed (for logging via `grad_norm`), clipping only when
            // asked.
            let scale = unscale.then(|| self.inv_scale.as_view());
            self.norm
                .compute(stream, &Grads::F32(grads.slice(..numel)), scale.as_ref())
                .map_err(fused)?;
        }
        self.last_norm = ready;
        let next = self.step + 1;
        let scalars = self.scalars_at(lr, next);
        let io = StepIo {
            grads: Grads::F32(grads.slice(..numel)),
            param_copy,
            inv_scale: unscale.then(|| self.inv_scale.as_view()),
            found_inf: None,
            clip: (self.max_grad_norm > 0.0).then(|| Clip {
                grad_sumsq: self.norm.result(),
                max_norm: self.max_grad_norm,
            }),
            step: next,
        };
        let mut params = params;
        let state = AdamState {
            params: params.slice_mut(..numel),
            exp_avg: self.exp_avg.slice_mut(..numel),
            exp_avg_sq: self.exp_avg_sq.slice_mut(..numel),
            max_exp_avg_sq: self.max_exp_avg_sq.as_mut().map(|m| m.slice_mut(..numel)),
        };
        adamw_step(stream, &self.plan, &scalars, state, io).map_err(fused)?;
        self.step = next;
        Ok(())
    }

    /// Every group's scalars of step `step` at learning rate `lr` (the CPU AdamW's f64
    /// formulas, rounded to f32 once).
    fn scalars_at(&self, lr: f32, step: u64) -> Vec<AdamWStepScalars> {
        self.groups
            .iter()
            .map(|g| {
                AdamWStepScalars::new(
                    &self.config,
                    decimal_f64(lr) * decimal_f64(g.lr_scale),
                    decimal_f64(g.weight_decay),
                    step,
                )
            })
            .collect()
    }

    /// The global gradient norm (before clipping) of the last step. Cost: a 16-byte
    /// device-to-host copy and a stream synchronisation.
    /// Free when the step was unscaled (the norm was read before it).
    pub(crate) fn last_grad_norm(&self, stream: &Arc<CudaStream>) -> Result<f64> {
        match self.last_norm {
            Some(norm) => Ok(norm),
            None => Ok(self.norm.read(stream).map_err(fused)?[1]),
        }
    }

    /// Downloads `(exp_avg, exp_avg_sq)` (for saving the optimizer state).
    pub(crate) fn download_moments(
        &self,
        stream: &Arc<CudaStream>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let numel = self.plan.len();
        let m = stream
            .clone_dtoh(&self.exp_avg.slice(..numel))
            .map_err(|e| super::cuda_err("downloading exp_avg", e))?;
        let v = stream
            .clone_dtoh(&self.exp_avg_sq.slice(..numel))
            .map_err(|e| super::cuda_err("downloading exp_avg_sq", e))?;
        stream
            .synchronize()
            .map_err(|e| super::cuda_err("downloading the moments", e))?;
        Ok((m, v))
    }
}

impl GpuAdamW {
    /// The moments `(exp_avg, exp_avg_sq)`, for streaming them to a checkpoint.
    pub(crate) fn moments(&self) -> (&CudaSlice<f32>, &CudaSlice<f32>) {
        (&self.exp_avg, &self.exp_avg_sq)
    }

    /// The moments, mutably, for streaming them in from a checkpoint (then
    /// [`GpuAdamW::set_step`]).
    pub(crate) fn moments_mut(&mut self) -> (&mut CudaSlice<f32>, &mut CudaSlice<f32>) {
        (&mut self.exp_avg, &mut self.exp_avg_sq)
    }

    /// Replaces the step count (resuming from a checkpoint).
    pub(crate) fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Replaces the moments and the step count (resuming from a checkpoint).
    pub(crate) fn upload_moments(
        &mut self,
        stream: &Arc<CudaStream>,
        exp_avg: &[f32],
        exp_avg_sq: &[f32],
        step: u64,
    ) -> Result<()> {
        let numel = self.plan.len();
        if exp_avg.len() != numel || exp_avg_sq.len() != numel {
            return Err(OptimError::LengthMismatch {
                what: "optimizer moments",
                expected: numel,
                actual: exp_avg.len().min(exp_avg_sq.len()),
            }
            .into());
        }
        stream
            .memcpy_htod(exp_avg, &mut self.exp_avg.slice_mut(..numel))
            .map_err(|e| super::cuda_err("uploading exp_avg", e))?;
        stream
            .memcpy_htod(exp_avg_sq, &mut self.exp_avg_sq.slice_mut(..numel))
            .map_err(|e| super::cuda_err("uploading exp_avg_sq", e))?;
        self.step = step;
        Ok(())
    }
}

/// What a whole-step CUDA graph needs of the optimizer (see `graph.rs`): the launch that reads
/// the groups' scalars from a device table, the table's words for the next step, and the
/// bookkeeping of a replayed step.
impl GpuAdamW {
    /// Words of the device table (`n_groups * ADAM_GROUP_WORDS`).
    pub(crate) fn group_table_len(&self) -> usize {
        self.groups.len() * ADAM_GROUP_WORDS
    }

    /// Whether the next step would use a norm or an unscale prepared on the host
    /// ([`GpuAdamW::unscaled_norm`], [`GpuAdamW::use_global_sum_of_squares`]): such a step
    /// cannot be replayed from a graph that measures the norm itself.
    pub(crate) fn has_prepared_norm(&self) -> bool {
        self.unscale || self.norm_ready.is_some()
    }

    /// The device table's words for the next step at learning rate `lr` (the scalars
    /// [`GpuAdamW::step`] would pass as the kernel's argument, validated as it validates them).
    pub(crate) fn next_group_words(&self, lr: f32) -> Result<Vec<u32>> {
        check_lr(lr)?;
        let mut words = Vec::with_capacity(self.group_table_len());
        for s in self.scalars_at(lr, self.step + 1) {
            words.extend(AdamGroupScalars::from(&s).to_words().map_err(fused)?);
        }
        Ok(words)
    }

    /// Queues what [`GpuAdamW::step`] queues without a prepared norm (the gradient norm, then
    /// the fused update with clipping) with the groups' scalars read from `table` when the
    /// kernel runs; changes no host state (it is recorded into a graph, which the caller
    /// launches and then reports with [`GpuAdamW::replayed_step`]).
    pub(crate) fn queue_device_step(
        &mut self,
        stream: &Arc<CudaStream>,
        params: CudaViewMut<'_, f32>,
        grads: CudaView<'_, f32>,
        param_copy: ParamCopy<'_>,
        table: &CudaSlice<u32>,
    ) -> Result<()> {
        let numel = self.plan.len();
        self.check_shard_len("params", params.len())?;
        self.check_shard_len("grads", grads.len())?;
        self.norm
            .compute(stream, &Grads::F32(grads.slice(..numel)), None)
            .map_err(fused)?;
        let io = StepIo {
            grads: Grads::F32(grads.slice(..numel)),
            param_copy,
            inv_scale: None,
            found_inf: None,
            clip: (self.max_grad_norm > 0.0).then(|| Clip {
                grad_sumsq: self.norm.result(),
                max_norm: self.max_grad_norm,
            }),
            // Only stochastic rounding reads it, and the engine rounds to nearest.
            step: self.step + 1,
        };
        let mut params = params;
        let state = AdamState {
            params: params.slice_mut(..numel),
            exp_avg: self.exp_avg.slice_mut(..numel),
            exp_avg_sq: self.exp_avg_sq.slice_mut(..numel),
            max_exp_avg_sq: self.max_exp_avg_sq.as_mut().map(|m| m.slice_mut(..numel)),
        };
        adam_step_device_groups(stream, &self.plan, &table.slice(..), state, io).map_err(fused)
    }

    /// Counts a step that a graph launch performed (the norm lives in the device buffer).
    pub(crate) fn replayed_step(&mut self) {
        self.step += 1;
        self.last_norm = None;
    }
}

fn check_lr(lr: f32) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        return Ok(());
    }
    Err(OptimError::InvalidHyperParameter {
        name: "lr",
        value: f64::from(lr),
        message: "must be finite and >= 0",
    }
    .into())
}

/// A fused-optimizer error as an engine error.
fn fused(e: FusedError) -> EngineError {
    match e {
        FusedError::Optim(e) => EngineError::Optim(e),
        FusedError::Ops(e) => EngineError::Ops(e),
        FusedError::InvalidArgument { op, message } => EngineError::InvalidArgument {
            argument: op.to_string(),
            message,
        },
        FusedError::Cuda { op, message } => EngineError::Ops(tilearn_ops::OpsError::Cuda {
            context: op,
            message,
        }),
        other => EngineError::Ops(tilearn_ops::OpsError::Cuda {
            context: "fused AdamW",
            message: other.to_string(),
        }),
    }
}
