//! One pipeline stage on the device: a [`GpuLlama`] whose flat buffer holds only a stage's
//! tensors ([`PipelineStage`]: the first stage the embedding, the last the final norm and
//! `lm_head`), and its forward and backward as separate calls, so a pipeline schedule can run
//! other micro-batches between them (see "Pipeline parallelism on the GPU engine" in
//! `docs/ARCHITECTURE.md`).
//!
//! The forward and backward are the whole model's (`compute.rs`), which skip the embedding and
//! the final norm where the stage's layout has none: a later stage's forward starts from the
//! activations copied into `resid[0]`, an earlier stage's backward from the output gradient
//! copied into `dres`, and the stage's input gradient is `dres` at the end.
//!
//! The arena holds one micro-batch's activations. Its carving is a pure function of the call's
//! shape and element type, so what a forward left there is still there for a later backward of
//! the same shape, as long as no other call ran in between: the executor tracks which
//! micro-batch the arena holds and recomputes a stage's forward from its kept input before a
//! backward that finds another (stage-granular activation checkpointing).

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use tilearn_ops::DType;
use tilearn_ops::cuda::{DeviceFloat, GpuDevice};
use tilearn_parallel::P2pOp;
use tilearn_parallel::device::{DeviceSlice, DeviceSliceMut};

use super::arena::{Bufs, Dims};
use super::compute::{self, Cx};
use super::lce::{self, GradFactor};
use super::precision::with_elem;
use super::sink::Handoff;
use super::weights::{Weights, weights};
use super::{GpuLlama, cuda_err, invalid};
use crate::error::Result;
use crate::lce_chunk::LceChunk;
use crate::memory_mode::MemoryMode;
use crate::model::LossStats;
use crate::model::pipeline_stage::PipelineStage;

/// Activations (or their gradients) crossing a stage boundary, in device memory: untyped bytes
/// for the arena's capacity in the widest element type, viewed as the element type of the
/// period that uses it (so one pool of buffers serves every precision).
#[derive(Debug)]
pub struct StageBuffer {
    bytes: CudaSlice<u8>,
}

impl StageBuffer {
    fn view<T: DeviceFloat>(&self, len: usize) -> Result<CudaView<'_, T>> {
        let bytes = self.bytes.len();
        // SAFETY: every `T` is a plain float type for which any bit pattern is a valid value;
        // the allocation is 256-byte aligned and `transmute` checks that it holds `len` of them.
        unsafe { self.bytes.transmute::<T>(len) }.ok_or_else(|| too_small(bytes, len, T::NAME))
    }

    fn view_mut<T: DeviceFloat>(&mut self, len: usize) -> Result<CudaViewMut<'_, T>> {
        let bytes = self.bytes.len();
        // SAFETY: as in `view`; the view borrows the buffer mutably.
        unsafe { self.bytes.transmute_mut::<T>(len) }.ok_or_else(|| too_small(bytes, len, T::NAME))
    }

    /// A send of its first `len` elements of `precision` to `peer`.
    pub fn send(&self, precision: DType, len: usize, peer: usize) -> Result<P2pOp<'_>> {
        let buf = match precision {
            DType::F32 => DeviceSlice::F32(self.view(len)?),
            DType::BF16 => DeviceSlice::BF16(self.view(len)?),
            DType::F16 => DeviceSlice::F16(self.view(len)?),
        };
        Ok(P2pOp::SendDevice { buf, peer })
    }

    /// A receive from `peer` into its first `len` elements of `precision`.
    pub fn recv(&mut self, precision: DType, len: usize, peer: usize) -> Result<P2pOp<'_>> {
        let buf = match precision {
            DType::F32 => DeviceSliceMut::F32(self.view_mut(len)?),
            DType::BF16 => DeviceSliceMut::BF16(self.view_mut(len)?),
            DType::F16 => DeviceSliceMut::F16(self.view_mut(len)?),
        };
        Ok(P2pOp::RecvDevice { buf, peer })
    }
}

fn too_small(bytes: usize, len: usize, ty: &str) -> crate::EngineError {
    invalid(
        "pipeline stage buffer",
        format!(
            "internal: a boundary buffer of {bytes} bytes cannot hold {len} elements of {ty} \
             (a call larger than the model's capacity)"
        ),
    )
}

impl GpuLlama {
    /// The device model of pipeline stage `stage` for calls of up to `batch` sequences of `seq`
    /// tokens in any of `precisions`, with zeroed parameters (fill them with
    /// [`GpuLlama::fill_params`] or [`GpuLlama::upload_params`] in the stage's layout). Only
    /// the last stage computes logits, so the others get a one-token logits buffer.
    pub fn for_stage(
        device: &GpuDevice,
        stage: &PipelineStage,
        (batch, seq): (usize, usize),
        precisions: &[DType],
        gradient_checkpointing: bool,
        lce: LceChunk,
    ) -> Result<GpuLlama> {
        let lce = if stage.is_last() {
            lce
        } else {
            LceChunk::from_tokens(1)
        };
        Self::build_with_tensors(
            device,
            &stage.config,
            Some((stage.specs.clone(), stage.layout.clone())),
            batch,
            seq,
            precisions,
            gradient_checkpointing,
            lce,
            MemoryMode::Default,
        )
    }

    /// A buffer for the activations (or gradients) between two stages of this model's
    /// capacity, `[batch · seq, hidden]` in the widest precision it was built for.
    pub fn stage_buffer(&self) -> Result<StageBuffer> {
        let widest = self.widest_elem_bytes();
        let bytes = self.batch * self.seq * self.config.hidden_size * widest;
        let bytes = self
            .stream()
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| cuda_err("allocating a pipeline boundary buffer", e))?;
        Ok(StageBuffer { bytes })
    }

    /// The stage's forward of `ids` (`batch × seq`): from the embedding on the first stage,
    /// else from `input` (the previous stage's output). A stage before the last copies its
    /// output (the last block's, before any norm) into `output` when given. The activations stay
    /// in the arena for [`stage_backward`](Self::stage_backward). Queued; does not wait.
    pub fn stage_forward(
        &mut self,
        ids: &[u32],
        (batch, seq): (usize, usize),
        input: Option<&StageBuffer>,
        output: Option<&mut StageBuffer>,
    ) -> Result<()> {
        let d = self.prepare(ids, batch, seq)?;
        if !self.layout.has_embedding() && input.is_none() {
            return Err(invalid(
                "GpuLlama::stage_forward",
                "a stage after the first needs the previous stage's activations".into(),
            ));
        }
        let p = self.pass();
        let mut cx = p.cx;
        let stream = cx.stream;
        with_elem!(p.precision, T => forward_pass::<T>(
            &mut cx,
            &d,
            &mut weights::<T>(stream, p.master, p.work, p.numel)?,
            &p.ids.slice(..d.n),
            p.arena,
            input,
            output,
        ))
    }

    /// The stage's backward of the micro-batch whose [`stage_forward`](Self::stage_forward)
    /// was the last call (same `ids`, shape and precision): on the last stage the loss of the
    /// unshifted `labels` and the loss head's backward first (gradients of `loss_sum ·
    /// loss_scale / denominator`), elsewhere from `dout`, the next stage's input gradient.
    /// Parameter gradients are added into the gradient buffer; a stage after the first writes
    /// d(loss)/d(its input) into `din`. Returns the loss on the last stage (synchronises to
    /// read it), `None` elsewhere (queued, no wait).
    #[allow(clippy::too_many_arguments)]
    pub fn stage_backward(
        &mut self,
        (ids, labels): (&[u32], &[i32]),
        (batch, seq): (usize, usize),
        denominator: f64,
        loss_scale: f32,
        dout: Option<&StageBuffer>,
        din: Option<&mut StageBuffer>,
    ) -> Result<Option<LossStats>> {
        if !(loss_scale.is_finite() && loss_scale > 0.0) {
            return Err(invalid(
                "loss_scale",
                format!("is {loss_scale}; use a finite value > 0 (1 = no scaling)"),
            ));
        }
        if self.grad_window.is_some() {
            return Err(invalid(
                "GpuLlama::stage_backward",
                "a pipeline stage keeps its whole gradient buffer (ZeRO-2 is not supported \
                 with pipeline parallelism on the GPU)"
                    .into(),
            ));
        }
        let last = self.layout.has_head();
        let first = self.layout.has_embedding();
        if (!last && dout.is_none()) || (!first && din.is_none()) {
            return Err(invalid(
                "GpuLlama::stage_backward",
                "internal: a stage needs the next stage's gradient (unless last) and a buffer \
                 for its input gradient (unless first)"
                    .into(),
            ));
        }
        let d = self.prepare(ids, batch, seq)?;
        if last {
            self.upload_targets(labels, &d)?;
        }
        let grad_scale = if denominator > 0.0 {
            f64::from(loss_scale) / denominator
        } else {
            0.0
        };
        self.grads_hold_params = false;
        self.whole_staging = None;
        self.whole_in_arena = false;
        let p = self.pass();
        let mut cx = p.cx;
        let stream = cx.stream;
        let grads = Handoff::new(p.grads.as_view_mut(), None, cx.layout);
        with_elem!(p.precision, T => backward_pass::<T>(
            &mut cx,
            &d,
            &mut weights::<T>(stream, p.master, p.work, p.numel)?,
            grads,
            (&p.ids.slice(..d.n), &p.targets.slice(..d.n)),
            (GradFactor::Host(grad_scale), p.totals),
            p.arena,
            dout,
            din,
        ))?;
        if !last {
            return Ok(None);
        }
        let stats = self.totals.read(self.device.stream())?;
        self.sample_memory()?;
        Ok(Some(LossStats {
            loss_sum: stats.loss_sum,
            valid_tokens: stats.valid,
        }))
    }

    /// The loss of the unshifted `labels` after the last stage's
    /// [`stage_forward`](Self::stage_forward) of the same `ids` (evaluation: no gradients).
    /// Synchronises to read it.
    pub fn stage_loss(
        &mut self,
        (ids, labels): (&[u32], &[i32]),
        (batch, seq): (usize, usize),
    ) -> Result<LossStats> {
        if !self.layout.has_head() {
            return Err(invalid(
                "GpuLlama::stage_loss",
                "internal: only the last pipeline stage computes the loss".into(),
            ));
        }
        let d = self.prepare(ids, batch, seq)?;
        self.upload_targets(labels, &d)?;
        let p = self.pass();
        let mut cx = p.cx;
        let stream = cx.stream;
        with_elem!(p.precision, T => {
            let mut b = p.arena.carve::<T>(&d)?;
            lce::loss_only(
                &mut cx,
                &d,
                &weights::<T>(stream, p.master, p.work, p.numel)?,
                &p.targets.slice(..d.n),
                p.totals,
                &mut b,
            )
        })?;
        let stats = self.totals.read(self.device.stream())?;
        Ok(LossStats {
            loss_sum: stats.loss_sum,
            valid_tokens: stats.valid,
        })
    }
}

/// Copies the first `len` elements of `src` into `dst` (both `len` long) on the call's stream.
fn copy<T: DeviceFloat>(
    cx: &Cx<'_>,
    src: &CudaView<'_, T>,
    dst: &mut CudaViewMut<'_, T>,
    what: &str,
) -> Result<()> {
    cx.stream
        .memcpy_dtod(src, dst)
        .map_err(|e| cuda_err(what, e))
}

fn forward_pass<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &mut Weights<'_, T>,
    ids: &CudaView<'_, u32>,
    arena: &mut super::arena::Arena,
    input: Option<&StageBuffer>,
    output: Option<&mut StageBuffer>,
) -> Result<()> {
    let len = d.n * d.c;
    let mut b: Bufs<'_, T> = arena.carve::<T>(d)?;
    if !cx.layout.has_embedding()
        && let Some(input) = input
    {
        copy(
            cx,
            &input.view::<T>(len)?,
            &mut b.resid[0],
            "taking the previous stage's activations",
        )?;
    }
    compute::forward(cx, d, w, ids, &mut b)?;
    if !cx.layout.has_head()
        && let Some(out) = output
    {
        copy(
            cx,
            &b.resid[b.resid_slot(d.layers)].as_view(),
            &mut out.view_mut::<T>(len)?,
            "handing the stage's activations on",
        )?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn backward_pass<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &mut Weights<'_, T>,
    grads: Handoff<'_, '_>,
    (ids, targets): (&CudaView<'_, u32>, &CudaView<'_, i32>),
    (factor, totals): (GradFactor<'_>, &mut tilearn_ops::cuda::CeTotals),
    arena: &mut super::arena::Arena,
    dout: Option<&StageBuffer>,
    din: Option<&mut StageBuffer>,
) -> Result<()> {
    let len = d.n * d.c;
    let mut b: Bufs<'_, T> = arena.carve::<T>(d)?;
    let mut grads = grads;
    if cx.layout.has_head() {
        lce::loss_and_head_backward(
            cx,
            d,
            w,
            &mut grads.grads()?,
            targets,
            factor,
            totals,
            &mut b,
        )?;
    } else if let Some(dout) = dout {
        copy(
            cx,
            &dout.view::<T>(len)?,
            &mut b.grad.dres,
            "taking the next stage's gradient",
        )?;
    }
    compute::backward(cx, d, w, grads, ids, &mut b)?;
    if !cx.layout.has_embedding()
        && let Some(din) = din
    {
        copy(
            cx,
            &b.grad.dres.as_view(),
            &mut din.view_mut::<T>(len)?,
            "handing the input gradient back",
        )?;
    }
    Ok(())
}
