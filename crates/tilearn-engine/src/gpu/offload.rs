//! The lean memory mode's device side (`--memory lean`, see [`crate::memory_mode`]): the fp32
//! master weights and the AdamW moments live in host memory and are stepped on the CPU; the
//! device keeps the bf16 working copy and the fp32 gradients (6 bytes a parameter instead of
//! 18).
//!
//! The device master buffer is reduced to one element and marked as an empty ZeRO shard
//! (`master_shard = 0..0`), so every path that already copes with a sharded master holds
//! here too: the forward and backward read the working copy only; a checkpoint load streams
//! into the idle gradient buffer, casts the working copy from it (`zero.rs`) and then lands
//! in the host master ([`GpuLlama::pull_loaded_into_host`]); a save reads the gradient buffer
//! after [`GpuLlama::stage_offloaded_master`] copied the host master into it.
//!
//! A step ([`GpuLlama::step`] in this mode): one device-to-host copy of the gradients into a
//! page-locked buffer (the one synchronisation), the clipped AdamW on the host over the
//! master weights with `tilearn-optim`'s multi-threaded CPU AdamW, the bf16 cast of the new
//! weights into a page-locked (write-combined) buffer, and one asynchronous host-to-device
//! copy into the working copy, which the next forward waits for on the stream. The host step
//! is the CPU reference the fused kernel reproduces, so the update equals the default mode's
//! up to the f64 norm's summation order.

use std::ops::Range;

use cudarc::driver::PinnedHostSlice;
use tilearn_optim::{AdamWConfig, ParamGroup};

use super::{GpuLlama, cuda_err, invalid, pinned, pinned_with_flags};
use crate::error::Result;
use crate::memory_mode::HostAdamW;

/// What a lean model holds besides the device buffers.
#[derive(Debug)]
pub(crate) struct Offload {
    /// The fp32 master weights until the optimizer is configured, then inside `adamw`.
    master: Option<Vec<f32>>,
    adamw: Option<HostAdamW>,
    /// Page-locked landing buffer of the gradients (the host reads it: not write-combined).
    grads: PinnedHostSlice<f32>,
    /// Page-locked bf16 bits of the new weights (the host writes, the device reads).
    weights: PinnedHostSlice<u16>,
}

impl Offload {
    /// Host buffers for `numel` parameters (master weights zeroed, as the device's zeroed
    /// working copy, until the first upload or load).
    pub(crate) fn new(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        numel: usize,
    ) -> Result<Self> {
        Ok(Offload {
            master: Some(vec![0.0; numel]),
            adamw: None,
            grads: pinned_with_flags(ctx, numel, 0.0f32, 0)?,
            weights: pinned(ctx, numel, 0u16)?,
        })
    }

    fn master_mut(&mut self) -> &mut [f32] {
        match (&mut self.master, &mut self.adamw) {
            (_, Some(a)) => a.master_mut(),
            (Some(m), None) => m.as_mut_slice(),
            (None, None) => &mut [],
        }
    }

    fn master(&self) -> &[f32] {
        match (&self.master, &self.adamw) {
            (_, Some(a)) => a.master(),
            (Some(m), None) => m.as_slice(),
            (None, None) => &[],
        }
    }

    /// Host bytes held: master weights, moments and the two page-locked buffers.
    pub(crate) fn bytes(&self) -> usize {
        let state = match &self.adamw {
            Some(a) => a.bytes(),
            None => self.master().len() * 4,
        };
        state + self.grads.num_bytes() + self.weights.num_bytes()
    }
}

impl GpuLlama {
    /// The host optimizer of a lean model, once configured.
    pub fn host_optimizer(&self) -> Option<&HostAdamW> {
        self.offload.as_ref().and_then(|o| o.adamw.as_ref())
    }

    /// The host optimizer of a lean model, once configured, for a resume to fill.
    pub fn host_optimizer_mut(&mut self) -> Option<&mut HostAdamW> {
        self.offload.as_mut().and_then(|o| o.adamw.as_mut())
    }

    /// Host memory a lean model holds (master weights, moments, page-locked buffers); 0 in
    /// the default mode.
    pub fn host_state_bytes(&self) -> usize {
        self.offload.as_ref().map_or(0, Offload::bytes)
    }

    /// Lean: the host AdamW over the whole model (moments zeroed, step 0), keeping the host
    /// master weights. ZeRO shards are refused (the state is one process's).
    pub(crate) fn configure_offloaded(
        &mut self,
        config: AdamWConfig,
        groups: Vec<ParamGroup>,
        max_grad_norm: f64,
        shard: Range<usize>,
    ) -> Result<()> {
        let numel = self.layout.numel;
        if shard != (0..numel) {
            return Err(invalid(
                "--memory lean",
                format!(
                    "the optimizer shard {shard:?} is not the whole model (0..{numel}): lean \
                     keeps the optimizer whole in host memory and does not combine with ZeRO"
                ),
            ));
        }
        if !(max_grad_norm.is_finite() && max_grad_norm >= 0.0) {
            return Err(invalid(
                "max_grad_norm",
                format!("is {max_grad_norm}; use a finite value >= 0 (0 disables)"),
            ));
        }
        config.validate()?;
        let off = self.offload_mut()?;
        let master = match (off.master.take(), off.adamw.take()) {
            (_, Some(a)) => a.into_master(),
            (Some(m), None) => m,
            (None, None) => vec![0.0; numel],
        };
        off.adamw = Some(HostAdamW::new(master, config, groups, max_grad_norm)?);
        Ok(())
    }

    fn offload_mut(&mut self) -> Result<&mut Offload> {
        self.offload.as_mut().ok_or_else(|| {
            invalid(
                "memory mode",
                "internal: a lean-mode call on a model built for the default mode".into(),
            )
        })
    }

    /// Lean step at `lr` (see the module docs): waits for the backward, steps on the host,
    /// queues the new bf16 weights' upload.
    pub(crate) fn offloaded_step(&mut self, lr: f32) -> Result<()> {
        let numel = self.layout.numel;
        let stream = self.device.stream().clone();
        let GpuLlama {
            grads,
            work,
            offload,
            ..
        } = self;
        let Some(off) = offload.as_mut() else {
            return Err(invalid(
                "GpuLlama::step",
                "internal: no host optimizer".into(),
            ));
        };
        let Some(adamw) = off.adamw.as_mut() else {
            return Err(invalid(
                "GpuLlama::step",
                "no optimizer: call configure_optimizer first".into(),
            ));
        };
        let Some(work) = work.as_mut() else {
            return Err(invalid(
                "GpuLlama::step",
                "internal: a lean model without a bf16 working copy".into(),
            ));
        };
        stream
            .memcpy_dtoh(&grads.slice(..numel), &mut off.grads)
            .map_err(|e| cuda_err("copying the gradients to the host", e))?;
        // Waits for that copy (and so for the backward), and for the previous step's upload
        // of the weights before they are rewritten.
        let host_grads = off
            .grads
            .as_mut_slice()
            .map_err(|e| cuda_err("waiting for the gradients", e))?;
        let bits = off
            .weights
            .as_mut_slice()
            .map_err(|e| cuda_err("waiting for the previous weight upload", e))?;
        adamw.step(&host_grads[..numel], lr, &mut bits[..numel])?;
        work.upload_bf16_bits(&stream, &off.weights)?;
        self.sample_memory()
    }

    /// Lean: the pre-clip gradient norm of the last step (no device work).
    pub(crate) fn offloaded_grad_norm(&self) -> Option<f64> {
        self.host_optimizer().and_then(HostAdamW::last_grad_norm)
    }

    /// Lean: sets the host master weights to `params` (the whole model, flat) and uploads
    /// their bf16 copy.
    pub(crate) fn upload_offloaded(&mut self, params: &[f32]) -> Result<()> {
        let stream = self.device.stream().clone();
        let GpuLlama { work, offload, .. } = self;
        let Some(off) = offload.as_mut() else {
            return Err(invalid("upload_params", "internal: no host master".into()));
        };
        let master = off.master_mut();
        if master.len() != params.len() {
            return Err(invalid(
                "params",
                format!(
                    "has {} entries; the model has {}",
                    params.len(),
                    master.len()
                ),
            ));
        }
        master.copy_from_slice(params);
        let n = params.len();
        let bits = off
            .weights
            .as_mut_slice()
            .map_err(|e| cuda_err("waiting for the previous weight upload", e))?;
        tilearn_optim::bf16_copy::cast_to_bf16_bits(params, &mut bits[..n]);
        match work.as_mut() {
            Some(w) => w.upload_bf16_bits(&stream, &off.weights),
            None => Err(invalid(
                "upload_params",
                "internal: a lean model without a bf16 working copy".into(),
            )),
        }
    }

    /// Lean, after a load into the gradient buffer (`fill_params` with the empty master
    /// shard): copies the loaded weights into the host master. No-op in the default mode.
    pub(crate) fn pull_loaded_into_host(&mut self) -> Result<()> {
        let numel = self.layout.numel;
        let stream = self.device.stream().clone();
        let GpuLlama { grads, offload, .. } = self;
        let Some(off) = offload.as_mut() else {
            return Ok(());
        };
        stream
            .memcpy_dtoh(&grads.slice(..numel), off.master_mut())
            .map_err(|e| cuda_err("copying the loaded weights to the host master", e))?;
        stream
            .synchronize()
            .map_err(|e| cuda_err("waiting for the loaded weights", e))
    }

    /// Lean: copies the host master weights into the (idle) gradient buffer, from which saves
    /// and downloads then read them until the next backward or `zero_grad`. No-op in the
    /// default mode. Call it before [`GpuLlama::with_params_source`] or
    /// [`GpuLlama::download_params`] on a lean model.
    pub fn stage_offloaded_master(&mut self) -> Result<()> {
        let numel = self.layout.numel;
        let stream = self.device.stream().clone();
        let GpuLlama { grads, offload, .. } = self;
        let Some(off) = offload.as_ref() else {
            return Ok(());
        };
        stream
            .memcpy_htod(off.master(), &mut grads.slice_mut(..numel))
            .map_err(|e| cuda_err("staging the host master weights", e))?;
        self.grads_hold_params = true;
        Ok(())
    }

    /// Whether this model runs in the lean memory mode.
    pub fn is_lean(&self) -> bool {
        self.offload.is_some()
    }
}
