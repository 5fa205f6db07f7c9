//! ZeRO stages 1 and 2 on the device: what a [`GpuLlama`] holds and does when data
//! parallelism partitions its optimizer.
//!
//! [`GpuLlama::shard_optimizer`] cuts the fused AdamW to the rank's shard (moments and segment
//! plan for `shard.len()` elements). When the model runs a single 16-bit precision, the fp32
//! master weights are cut too: the forward and backward read only the 16-bit working copy,
//! the optimizer writes the shard's master weights and the shard's part of the working copy,
//! and data parallelism all-gathers the working copy ([`GpuLlama::gathered_weights_mut`]).
//! That is the ZeRO paper's mixed-precision layout: 2 bytes of working weights per parameter
//! on every rank, fp32 master + moments (K = 12) only for the shard. When fp32 may run (the
//! fp32 forward reads the master weights themselves) the master stays whole and is what gets
//! all-gathered; then only the moments are partitioned (K = 8, as on the CPU engine).
//!
//! Stage 2 also shards the gradients ([`GpuLlama::shard_gradients`]): the gradient buffer
//! shrinks to the owned shard's accumulator, and the backward writes its parts into a small
//! window ([`crate::grad_window::WindowPlan`]), reducing each finished part to its owners and
//! keeping the owned pieces (see `sink.rs`).
//!
//! Saves and loads still speak whole fp32 models. A sharded master is gathered into the
//! gradient buffer, which is idle between an optimizer step and the next backward
//! ([`GpuLlama::stage_params_in_grads`], collective through the caller), so a save needs no
//! extra device memory; a load streams the file into that buffer, casts the working copy
//! from it and keeps the shard. Under stage 2 the gradient buffer is too short for that: the
//! whole weights then go to the activation arena, idle between steps (allocated as f32 for
//! this), until the next forward carves it; only when the arena is smaller than the model
//! (a small batch) a buffer is allocated for the save or load and freed by the next backward or
//! `zero_grad`, for that moment 4Ψ more (what stage 1 holds throughout).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::CudaViewMut;
use tilearn_ops::DType;
use tilearn_ops::cuda::CudaStream;

use cudarc::driver::CudaSlice;

use super::precision::HalfViewMut;
use super::{GpuLlama, cuda_err, invalid, model_alloc_err, untracked};
use crate::error::Result;
use crate::grad_window::WindowPlan;

/// ZeRO-2's gradient storage besides the owned shard's accumulator (the gradient buffer).
#[derive(Debug)]
pub(crate) struct GradWindow {
    pub plan: WindowPlan,
    /// Where the backward writes its parts (untracked, as the whole buffer it replaces).
    pub window: CudaSlice<f32>,
    /// The global elements the gradient buffer holds.
    pub owned: Range<usize>,
}

/// The weights every rank must hold whole after a ZeRO step, as the optimizer left them (only
/// the rank's shard is new): all-gather them.
pub enum GatheredWeights<'a> {
    /// The fp32 master weights (a model that may run in fp32).
    Master(CudaViewMut<'a, f32>),
    /// The 16-bit working copy (the master weights are sharded).
    Working(HalfViewMut<'a>),
}

impl GpuLlama {
    /// ZeRO: from now on the optimizer holds state for and steps only the parameters `shard`
    /// of the flat buffer (fresh moments unless it was configured for that shard already; a
    /// resume fills them afterwards). With a single 16-bit precision the fp32 master weights
    /// are reduced to the shard as well (see the module docs).
    pub fn shard_optimizer(&mut self, shard: Range<usize>) -> Result<()> {
        let numel = self.layout.numel;
        if shard.start > shard.end || shard.end > numel {
            return Err(invalid(
                "shard",
                format!("{shard:?} is not a range of the model's {numel} parameters"),
            ));
        }
        if self.master_shard.is_some() {
            return Err(invalid(
                "shard_optimizer",
                "the master weights are already sharded; shard once, before training".into(),
            ));
        }
        let stream = self.stream().clone();
        // A recorded step graph points at the buffers this replaces.
        self.graphs.invalidate();
        let Some(opt) = self.optimizer.as_mut() else {
            return Err(invalid(
                "GpuLlama::shard_optimizer",
                "no optimizer: call configure_optimizer or configure_optimizer_for first".into(),
            ));
        };
        if opt.shard() != shard {
            opt.reshard(&stream, shard.clone())?;
            self.memory.optimizer_bytes = opt.bytes();
        }
        if self.master_shardable() {
            // A sharded master leaves no layer to cast from: ZeRO needs the whole copy.
            self.set_per_layer_weights(false)?;
            let precision = self.precision;
            if let Some(w) = self.work.as_mut() {
                w.refresh(&stream, &self.master, precision)?;
            }
            let mut part = stream.alloc_zeros::<f32>(shard.len().max(1)).map_err(|e| {
                model_alloc_err(
                    "allocating the master weights' shard",
                    4 * shard.len(),
                    &stream,
                    e,
                )
            })?;
            stream
                .memcpy_dtod(
                    &self.master.slice(shard.clone()),
                    &mut part.slice_mut(..shard.len()),
                )
                .map_err(|e| cuda_err("keeping the master weights' shard", e))?;
            // The whole master is freed (stream-ordered) when replaced.
            self.master = part;
            self.master_shard = Some(shard);
            self.memory.master_bytes = self.master.num_bytes();
        }
        let m = &mut self.memory;
        m.own_bytes = m.master_bytes
            + m.working_copy_bytes
            + m.grad_bytes
            + m.activation_bytes
            + m.workspace_bytes
            + m.optimizer_bytes;
        self.device.synchronize()?;
        self.sample_memory()
    }

    /// ZeRO-2: from now on this rank holds only the gradients `owned` (accumulated over the
    /// micro-batches of a step) plus the backward's window, instead of the whole model's;
    /// every backward must then go through [`GpuLlama::forward_backward_into`] with a sink
    /// that reduces each part to its owners. Returns whether it did: not when `owned` is the
    /// whole model (one rank: the whole buffer is the shard) or the parameter order gives the
    /// backward no hand-off points, or the owned gradients plus the window would not be smaller
    /// than the whole buffer (a model of few layers); then the whole buffer stays (stage 2
    /// reduces in it).
    pub fn shard_gradients(&mut self, owned: Range<usize>) -> Result<bool> {
        let numel = self.layout.numel;
        if owned.start > owned.end || owned.end > numel {
            return Err(invalid(
                "owned",
                format!("{owned:?} is not a range of the model's {numel} parameters"),
            ));
        }
        if self.grad_window.is_some() {
            return Err(invalid(
                "shard_gradients",
                "the gradients are already sharded; shard once, before training".into(),
            ));
        }
        let Some(plan) = WindowPlan::for_layout(&self.layout) else {
            return Ok(false);
        };
        // One rank (the shard is everything), or a model so shallow that the owned gradients
        // plus the window would not be smaller than the whole buffer (the window holds the
        // largest part and a layer): the whole buffer stays.
        if owned.len() == numel || owned.len() + plan.len >= numel {
            return Ok(false);
        }
        let stream = self.stream().clone();
        self.graphs.invalidate();
        let window = untracked(&stream, || stream.alloc_zeros::<f32>(plan.len)).map_err(|e| {
            model_alloc_err("allocating the gradient window", 4 * plan.len, &stream, e)
        })?;
        let acc =
            untracked(&stream, || stream.alloc_zeros::<f32>(owned.len().max(1))).map_err(|e| {
                model_alloc_err(
                    "allocating the owned gradients",
                    4 * owned.len(),
                    &stream,
                    e,
                )
            })?;
        // The whole buffer is freed (stream-ordered) when replaced.
        self.grads = acc;
        self.grads_hold_params = false;
        let m = &mut self.memory;
        m.grad_window_bytes = window.num_bytes();
        m.grad_bytes = self.grads.num_bytes() + m.grad_window_bytes;
        m.own_bytes = m.master_bytes
            + m.working_copy_bytes
            + m.grad_bytes
            + m.activation_bytes
            + m.workspace_bytes
            + m.optimizer_bytes;
        self.grad_window = Some(GradWindow {
            plan,
            window,
            owned,
        });
        self.device.synchronize()?;
        self.sample_memory()?;
        Ok(true)
    }

    /// Under ZeRO-2: the global elements of the gradients this rank holds.
    pub fn owned_gradients(&self) -> Option<Range<usize>> {
        self.grad_window.as_ref().map(|w| w.owned.clone())
    }

    /// Where the whole fp32 weights go for a save or a load while the master is sharded: the
    /// idle gradient buffer, or under ZeRO-2 a buffer made for it (see the module docs).
    pub(crate) fn whole_params_target(&mut self) -> Result<&mut CudaSlice<f32>> {
        let numel = self.layout.numel;
        if self.grad_window.is_some() && self.arena.idle_f32().len() >= numel {
            self.whole_in_arena = true;
            return Ok(self.arena.idle_f32_mut());
        }
        if self.grad_window.is_some() && self.whole_staging.is_none() {
            let stream = self.stream().clone();
            let numel = self.layout.numel;
            let buf = stream.alloc_zeros::<f32>(numel.max(1)).map_err(|e| {
                model_alloc_err(
                    "allocating the whole weights for a save or load",
                    4 * numel,
                    &stream,
                    e,
                )
            })?;
            self.whole_staging = Some(buf);
        }
        Ok(match self.whole_staging.as_mut() {
            Some(w) => w,
            None => &mut self.grads,
        })
    }

    /// Whether ZeRO may shard the fp32 master weights: the model runs exactly one precision,
    /// a 16-bit one, so no forward reads the master weights and the working copy never needs
    /// re-casting from them.
    pub fn master_shardable(&self) -> bool {
        matches!(self.precisions.as_slice(), [p] if p.is_half())
    }

    /// The elements of the master weights held, when ZeRO sharded them.
    pub fn master_shard(&self) -> Option<Range<usize>> {
        self.master_shard.clone()
    }

    /// The sum of squares of the gradients `range` (unscaled by a prepared
    /// [`unscale_and_check`](Self::unscale_and_check)): ZeRO's partial norm. Synchronises.
    pub fn grad_sum_of_squares(&mut self, range: Range<usize>) -> Result<f64> {
        let numel = self.layout.numel;
        if range.start > range.end || range.end > numel {
            return Err(invalid(
                "range",
                format!("{range:?} is not a range of the model's {numel} parameters"),
            ));
        }
        let stream = self.stream().clone();
        let Some(opt) = self.optimizer.as_mut() else {
            return Err(invalid(
                "GpuLlama::grad_sum_of_squares",
                "no optimizer: call configure_optimizer first".into(),
            ));
        };
        let grads = super::held_grads(&self.grads, self.grad_window.as_ref(), range)?;
        opt.sum_of_squares(&stream, grads)
    }

    /// The next [`step`](Self::step) clips with the global norm `sqrt(sum_of_squares)` (all
    /// ranks' shards) and reports it, instead of measuring the norm of its own shard.
    pub fn use_global_grad_sum_of_squares(&mut self, sum_of_squares: f64) -> Result<()> {
        let stream = self.stream().clone();
        match self.optimizer.as_mut() {
            Some(opt) => opt.use_global_sum_of_squares(&stream, sum_of_squares),
            None => Err(invalid(
                "GpuLlama::use_global_grad_sum_of_squares",
                "no optimizer: call configure_optimizer first".into(),
            )),
        }
    }

    /// The weights to all-gather after a ZeRO step (see [`GatheredWeights`]) and the stream
    /// that wrote them. A whole master is about to be rewritten by the gather, so the working
    /// copy is marked stale and re-cast before the next 16-bit forward.
    pub fn gathered_weights_mut(&mut self) -> Result<(GatheredWeights<'_>, Arc<CudaStream>)> {
        let stream = self.stream().clone();
        if self.master_shard.is_some() {
            let work = self.work.as_mut().ok_or_else(|| {
                invalid(
                    "gathered_weights_mut",
                    "internal: a sharded master without a working copy".into(),
                )
            })?;
            return Ok((GatheredWeights::Working(work.half_view_mut()?), stream));
        }
        if let Some(w) = self.work.as_mut() {
            w.invalidate();
        }
        let numel = self.layout.numel;
        Ok((
            GatheredWeights::Master(self.master.slice_mut(..numel)),
            stream,
        ))
    }

    /// For a save while the master weights are sharded: copies this rank's master shard into
    /// its place in the (idle) gradient buffer and returns the buffer, for the caller to
    /// all-gather the other shards into; afterwards saves and downloads read the weights from
    /// it until the next backward. `None` when the master is whole.
    pub fn stage_params_in_grads(
        &mut self,
    ) -> Result<Option<(CudaViewMut<'_, f32>, Arc<CudaStream>)>> {
        let Some(shard) = self.master_shard.clone() else {
            return Ok(None);
        };
        let stream = self.stream().clone();
        let numel = self.layout.numel;
        // Decides where the whole weights go (and allocates there if need be).
        self.whole_params_target()?;
        let GpuLlama {
            master,
            grads,
            whole_staging,
            whole_in_arena,
            arena,
            ..
        } = self;
        let target = match (*whole_in_arena, whole_staging.as_mut()) {
            (true, _) => arena.idle_f32_mut(),
            (false, Some(w)) => w,
            (false, None) => grads,
        };
        stream
            .memcpy_dtod(&master.slice(..shard.len()), &mut target.slice_mut(shard))
            .map_err(|e| cuda_err("staging the master shard for a save", e))?;
        self.grads_hold_params = true;
        let target = self.whole_params_target()?;
        Ok(Some((target.slice_mut(..numel), stream)))
    }

    /// The whole fp32 weights for a save or a download: the master weights, or the gradient
    /// buffer after [`stage_params_in_grads`](Self::stage_params_in_grads) and the caller's
    /// gather.
    pub(crate) fn whole_params(&self) -> Result<&cudarc::driver::CudaSlice<f32>> {
        match (&self.master_shard, self.grads_hold_params) {
            (None, _) => Ok(&self.master),
            (Some(_), true) => Ok(whole_of(self)),
            (Some(shard), false) => Err(invalid(
                "the fp32 weights",
                format!(
                    "this rank holds only elements {shard:?} of them (ZeRO); gather them first \
                     (the Trainer does before every save)"
                ),
            )),
        }
    }

    /// After a load into the gradient buffer (a sharded master): the working copy is cast
    /// from it and the master keeps its shard.
    pub(crate) fn keep_loaded_shard(&mut self) -> Result<()> {
        let Some(shard) = self.master_shard.clone() else {
            return Ok(());
        };
        let stream = self.stream().clone();
        let numel = self.layout.numel;
        let precision = self.precision;
        let whole = match (self.whole_in_arena, self.whole_staging.as_ref()) {
            (true, _) => self.arena.idle_f32(),
            (false, Some(w)) => w,
            (false, None) => &self.grads,
        };
        if let Some(w) = self.work.as_mut()
            && precision != DType::F32
        {
            w.cast_from(&stream, &whole.slice(..numel), precision)?;
        }
        if !shard.is_empty() {
            stream
                .memcpy_dtod(
                    &whole.slice(shard.clone()),
                    &mut self.master.slice_mut(..shard.len()),
                )
                .map_err(|e| cuda_err("keeping the loaded master shard", e))?;
        }
        self.grads_hold_params = true;
        Ok(())
    }
}

/// Where the whole fp32 weights are while `grads_hold_params` (see the module docs).
fn whole_of(gpu: &GpuLlama) -> &CudaSlice<f32> {
    match (gpu.whole_in_arena, gpu.whole_staging.as_ref()) {
        (true, _) => gpu.arena.idle_f32(),
        (false, Some(w)) => w,
        (false, None) => &gpu.grads,
    }
}
