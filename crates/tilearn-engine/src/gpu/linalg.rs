//! The matrix-product ops of the device model: linear layers (cuBLASLt through
//! [`tilearn_ops::cuda::Gemm`]) and causal grouped-query attention (cuBLASLt batched GEMMs plus
//! the row kernels, or the fused flash kernels for 16-bit types at head_dim 64/128, through
//! [`AttentionWorkspace`]).
//!
//! [`Matmul`] owns the cuBLASLt handle (bound to the model's stream, with its workspace) and
//! the attention workspace, both allocated once at model build. The attention workspace is
//! sized for the widest element type the model may run in, so one workspace serves every
//! precision period. A flash-only workspace also holds the one-pass flash backward's f32
//! `dq_accum` unless the model is deterministic ([`Matmul::set_flash_backward`],
//! `--deterministic`), and only on a device whose Hopper kernels would use it; where each
//! layer's post-attention buffers (`h` and `xn2`, dead by the time the attention backward
//! runs) can hold it, the workspace holds none and those buffers are lent to each call
//! instead (`AttentionWorkspace::for_flash_lent`).

use std::sync::Arc;

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::{bf16, f16};
use tilearn_ops::cpu::AttnShape;
use tilearn_ops::cuda::{
    self as k, AttentionImpl, AttentionWorkspace, CudaStream, DeviceFloat, FlashBackward, Gemm,
    WeightGrad, flash_attention_one_pass, flash_attention_supports, flash_dq_accum_len,
};
use tilearn_ops::{KeyMask, OpsError, Result};

use super::arena::Dims;
use crate::error::Result as EngineResult;

/// Upper bound on the attention workspace: it holds the f32 scores and the probabilities of
/// `chunk` whole sequences (`Hq · T²` each), so long sequences run the batch in several passes
/// instead of reserving `B · Hq · T²` (6.4 GB for TinyLlama at batch 8 × 2048).
const ATTENTION_WORKSPACE_BUDGET: usize = 2 << 30;

/// cuBLASLt handle and attention workspace of one device model.
#[derive(Debug)]
pub(crate) struct Matmul {
    gemm: Gemm,
    attn: AttentionWorkspace,
    /// The capacity shape of a flash-only workspace (`None`: the GEMM path's workspace).
    flash_capacity: Option<AttnShape>,
    /// Bytes each backward call can lend the one-pass `dq_accum` at capacity (the layer
    /// set's post-attention buffers, [`Dims::post_attention_bytes`]).
    lendable_bytes: usize,
}

/// The backward a flash-only workspace for `shape` is built for when `asked`: the one-pass
/// scratch only where the Hopper kernels would use it (unmasked bf16/f16 at head_dim 64 on
/// compute capability 9.0); elsewhere the flash backward is the deterministic one anyway.
fn effective_backward(shape: AttnShape, asked: FlashBackward) -> FlashBackward {
    let hopper = flash_attention_one_pass::<bf16>(shape.head_dim, false)
        || flash_attention_one_pass::<f16>(shape.head_dim, false);
    if hopper {
        asked
    } else {
        FlashBackward::Deterministic
    }
}

/// The flash workspace for `shape` and `asked`: a one-pass one borrows its `dq_accum` from
/// each call when `lendable_bytes` hold it at capacity, else holds its own.
fn flash_workspace(
    stream: &Arc<CudaStream>,
    shape: AttnShape,
    asked: FlashBackward,
    lendable_bytes: usize,
) -> Result<AttentionWorkspace> {
    let backward = effective_backward(shape, asked);
    let lend =
        flash_dq_accum_len(shape).is_some_and(|len| len * size_of::<f32>() <= lendable_bytes);
    if backward == FlashBackward::OnePass && lend {
        AttentionWorkspace::for_flash_lent(stream, shape)
    } else {
        AttentionWorkspace::for_flash(stream, shape, backward)
    }
}

fn attn_shape(d: &Dims) -> AttnShape {
    AttnShape {
        batch: d.batch,
        seq: d.seq,
        q_heads: d.q_heads,
        kv_heads: d.kv_heads,
        head_dim: d.head_dim,
    }
}

impl Matmul {
    /// A cuBLASLt handle on `stream` and the attention workspace for calls up to `capacity`
    /// in element types of up to `max_elem_bytes` bytes. When every precision is 16-bit and the
    /// flash kernels serve the shape, attention never takes the GEMM path and the workspace
    /// holds only the backward's `delta` rows; otherwise it holds the GEMM path's scores for as
    /// many whole sequences per pass as fit the budget (at least one). A flash-only workspace
    /// is built for `backward` (see [`Matmul::set_flash_backward`]).
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        capacity: &Dims,
        max_elem_bytes: usize,
        backward: FlashBackward,
    ) -> EngineResult<Matmul> {
        let gemm = Gemm::new(stream)?;
        let shape = attn_shape(capacity);
        let lendable_bytes = capacity.post_attention_bytes(max_elem_bytes);
        if max_elem_bytes == 2
            && flash_attention_supports::<bf16>(shape)
            && flash_attention_supports::<f16>(shape)
        {
            let attn = flash_workspace(stream, shape, backward, lendable_bytes)?;
            return Ok(Matmul {
                gemm,
                attn,
                flash_capacity: Some(shape),
                lendable_bytes,
            });
        }
        let one = AttnShape { batch: 1, ..shape };
        let per_seq = AttentionWorkspace::bytes_for(one, max_elem_bytes)?.max(1);
        let chunk = (ATTENTION_WORKSPACE_BUDGET / per_seq).clamp(1, capacity.batch.max(1));
        let attn = AttentionWorkspace::new(
            stream,
            AttnShape {
                batch: chunk,
                ..one
            },
            max_elem_bytes,
        )?;
        Ok(Matmul {
            gemm,
            attn,
            flash_capacity: None,
            lendable_bytes,
        })
    }

    /// Rebuilds a flash-only attention workspace for `backward` (allocating or freeing the
    /// one-pass `dq_accum`); returns whether the workspace changed (its device address did:
    /// a captured CUDA graph must be recaptured). The GEMM path's workspace runs the
    /// deterministic backward whatever is asked, and is kept.
    pub(crate) fn set_flash_backward(
        &mut self,
        stream: &Arc<CudaStream>,
        backward: FlashBackward,
    ) -> EngineResult<bool> {
        let Some(shape) = self.flash_capacity else {
            return Ok(false);
        };
        if effective_backward(shape, backward) == self.attn.flash_backward() {
            return Ok(false);
        }
        self.attn = flash_workspace(stream, shape, backward, self.lendable_bytes)?;
        Ok(true)
    }

    /// Whether every attention call runs the flash kernels (a flash-only workspace), whose
    /// backward needs only q, k, v, the output and the log-sum-exp of the forward.
    pub(crate) fn flash_only(&self) -> bool {
        self.flash_capacity.is_some()
    }

    /// The flash backward the attention workspace serves at its capacity on this device:
    /// `OnePass` only for a flash-only workspace built for it where the Hopper kernels run.
    pub(crate) fn flash_backward(&self) -> FlashBackward {
        self.attn.flash_backward()
    }

    /// Device bytes held (cuBLASLt workspace and attention workspace).
    pub(crate) fn bytes(&self) -> usize {
        self.gemm.workspace_bytes() + self.attn.bytes()
    }

    /// Fails unless `s` is the stream the handle launches on: every op of a model is ordered
    /// on one stream, and a product on another stream would race with its neighbours.
    fn same_stream(&self, s: &Arc<CudaStream>, op: &'static str) -> Result<()> {
        if Arc::ptr_eq(self.gemm.stream(), s) {
            Ok(())
        } else {
            Err(OpsError::Cuda {
                context: op,
                message: "the cuBLASLt handle is bound to another stream than the model's".into(),
            })
        }
    }

    /// `out = x·Wᵀ (+ bias)`, `out` written.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_forward<T: DeviceFloat>(
        &mut self,
        s: &Arc<CudaStream>,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        bias: Option<&CudaView<'_, T>>,
        rows: usize,
        in_f: usize,
        out_f: usize,
        out: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        self.same_stream(s, "linear_forward")?;
        let bias = bias.map(|b| b as &dyn DevicePtr<T>);
        k::linear_forward(&self.gemm, x, w, bias, rows, in_f, out_f, out)
    }

    /// `dx = dout·W` (if given), `dw += doutᵀ·x` (or `=`, as `dw_grad` says), `db +=
    /// colsum(dout)` (if given); f32 `dw`, `db`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_backward<T: DeviceFloat>(
        &mut self,
        s: &Arc<CudaStream>,
        dout: &CudaView<'_, T>,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        rows: usize,
        in_f: usize,
        out_f: usize,
        dx: Option<&mut CudaViewMut<'_, T>>,
        (dw, dw_grad): (&mut CudaViewMut<'_, f32>, WeightGrad),
        db: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()> {
        self.same_stream(s, "linear_backward")?;
        let dx = dx.map(|v| v as &mut dyn DevicePtrMut<T>);
        let db = db.map(|v| v as &mut dyn DevicePtrMut<f32>);
        k::linear_backward_with(
            &self.gemm, dout, x, w, rows, in_f, out_f, dx, dw, db, dw_grad,
        )
    }

    /// `dx += dout·W` (see [`k::linear_input_grad_add`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn linear_input_grad_add<T: DeviceFloat>(
        &mut self,
        s: &Arc<CudaStream>,
        dout: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        rows: usize,
        in_f: usize,
        out_f: usize,
        dx: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        self.same_stream(s, "linear_input_grad_add")?;
        k::linear_input_grad_add(&self.gemm, dout, w, rows, in_f, out_f, dx)
    }

    /// Causal GQA: `out` `[B, T, Hq, D]` and f32 `lse` `[B, Hq, T]` written; with
    /// `positions` (packed examples) a query sees only the keys of its own example, with
    /// `window` (a sliding-window layer) only the last `window` keys.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_forward<T: DeviceFloat>(
        &mut self,
        s: &Arc<CudaStream>,
        d: &Dims,
        positions: Option<&CudaView<'_, i32>>,
        window: Option<usize>,
        alibi: Option<&CudaView<'_, f32>>,
        q: &CudaView<'_, T>,
        k: &CudaView<'_, T>,
        v: &CudaView<'_, T>,
        out: &mut CudaViewMut<'_, T>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.same_stream(s, "attention_forward")?;
        k::attention_forward_alibi(
            AttentionImpl::Auto,
            &self.gemm,
            &mut self.attn,
            attn_shape(d),
            KeyMask {
                positions,
                sliding_window: window,
            },
            alibi,
            q,
            k,
            v,
            out,
            lse,
        )
    }

    /// `dq`, `dk`, `dv` written; `dq_accum` is the layer's idle post-attention buffers as f32
    /// (clobbered), lent to a workspace that borrows the one-pass scratch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_backward<T: DeviceFloat>(
        &mut self,
        s: &Arc<CudaStream>,
        d: &Dims,
        positions: Option<&CudaView<'_, i32>>,
        window: Option<usize>,
        alibi: Option<&CudaView<'_, f32>>,
        dout: &CudaView<'_, T>,
        q: &CudaView<'_, T>,
        k: &CudaView<'_, T>,
        v: &CudaView<'_, T>,
        out: &CudaView<'_, T>,
        lse: &CudaView<'_, f32>,
        dq: &mut CudaViewMut<'_, T>,
        dk: &mut CudaViewMut<'_, T>,
        dv: &mut CudaViewMut<'_, T>,
        dq_accum: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        self.same_stream(s, "attention_backward")?;
        k::attention_backward_lent(
            AttentionImpl::Auto,
            &self.gemm,
            &mut self.attn,
            attn_shape(d),
            KeyMask {
                positions,
                sliding_window: window,
            },
            alibi,
            dout,
            q,
            k,
            v,
            out,
            lse,
            dq,
            dk,
            dv,
            Some(dq_accum),
        )
    }
}
