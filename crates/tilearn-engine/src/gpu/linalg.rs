//! The matrix-product ops of the device model: linear layers (cuBLASLt through
//! [`tilearn_ops::cuda::Gemm`]) and causal grouped-query attention (cuBLASLt batched GEMMs plus
//! the row kernels, through [`AttentionWorkspace`]), mapped per activation type like
//! [`GpuElem`]'s element-wise ops.
//!
//! [`Matmul`] owns the cuBLASLt handle (bound to the model's stream, with its workspace) and
//! the attention workspace, both allocated once at model build.

use std::sync::Arc;

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use half::bf16;
use tilearn_ops::cpu::AttnShape;
use tilearn_ops::cuda::{self as k, AttentionWorkspace, AttnElement, CudaStream, Gemm};
use tilearn_ops::{OpsError, Result};

use super::Precision;
use super::arena::Dims;
use super::elem::GpuElem;
use crate::error::Result as EngineResult;

/// Upper bound on the attention workspace: it holds the f32 scores and the probabilities of
/// `chunk` whole sequences (`Hq · T²` each), so long sequences run the batch in several passes
/// instead of reserving `B · Hq · T²` (6.4 GB for TinyLlama at batch 8 × 2048).
const ATTENTION_WORKSPACE_BUDGET: usize = 2 << 30;

/// The attention workspace of the model's activation type.
#[derive(Debug)]
enum AttnWs {
    F32(AttentionWorkspace<f32>),
    Bf16(AttentionWorkspace<bf16>),
}

/// cuBLASLt handle and attention workspace of one device model.
#[derive(Debug)]
pub(crate) struct Matmul {
    gemm: Gemm,
    attn: AttnWs,
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

/// The workspace for `capacity`, for as many whole sequences per pass as fit the budget
/// (at least one).
fn workspace<T: AttnElement>(
    stream: &Arc<CudaStream>,
    capacity: &Dims,
) -> Result<AttentionWorkspace<T>> {
    let one = AttnShape {
        batch: 1,
        ..attn_shape(capacity)
    };
    let per_seq = AttentionWorkspace::<T>::bytes_for(one)?.max(1);
    let chunk = (ATTENTION_WORKSPACE_BUDGET / per_seq).clamp(1, capacity.batch.max(1));
    AttentionWorkspace::<T>::new(
        stream,
        AttnShape {
            batch: chunk,
            ..one
        },
    )
}

impl Matmul {
    /// A cuBLASLt handle on `stream` and the attention workspace for calls up to `capacity`.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        capacity: &Dims,
        precision: Precision,
    ) -> EngineResult<Matmul> {
        let gemm = Gemm::new(stream)?;
        let attn = match precision {
            Precision::F32 => AttnWs::F32(workspace(stream, capacity)?),
            Precision::Bf16 => AttnWs::Bf16(workspace(stream, capacity)?),
        };
        Ok(Matmul { gemm, attn })
    }

    /// Device bytes held (cuBLASLt workspace and attention workspace).
    pub(crate) fn bytes(&self) -> usize {
        self.gemm.workspace_bytes()
            + match &self.attn {
                AttnWs::F32(ws) => ws.bytes(),
                AttnWs::Bf16(ws) => ws.bytes(),
            }
    }
}

fn wrong_workspace(op: &'static str) -> OpsError {
    OpsError::Cuda {
        context: op,
        message: "the attention workspace was built for the other precision".into(),
    }
}

/// The matrix-product ops for one activation type. The stream is the [`Gemm`]'s (the model's).
#[allow(clippy::too_many_arguments)]
pub(crate) trait GpuLinalg: GpuElem {
    /// `out = x·Wᵀ (+ bias)`, `out` written.
    fn linear_forward(
        mm: &mut Matmul,
        s: &Arc<CudaStream>,
        x: &CudaView<'_, Self>,
        w: &CudaView<'_, Self>,
        bias: Option<&CudaView<'_, Self>>,
        rows: usize,
        in_f: usize,
        out_f: usize,
        out: &mut CudaViewMut<'_, Self>,
    ) -> Result<()>;

    /// `dx = dout·W` (if given), `dw += doutᵀ·x`, `db += colsum(dout)` (if given); f32 `dw`,
    /// `db`.
    fn linear_backward(
        mm: &mut Matmul,
        s: &Arc<CudaStream>,
        dout: &CudaView<'_, Self>,
        x: &CudaView<'_, Self>,
        w: &CudaView<'_, Self>,
        rows: usize,
        in_f: usize,
        out_f: usize,
        dx: Option<&mut CudaViewMut<'_, Self>>,
        dw: &mut CudaViewMut<'_, f32>,
        db: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<()>;

    /// Causal GQA: `out` `[B, T, Hq, D]` and f32 `lse` `[B, Hq, T]` written.
    fn attention_forward(
        mm: &mut Matmul,
        s: &Arc<CudaStream>,
        d: &Dims,
        q: &CudaView<'_, Self>,
        k: &CudaView<'_, Self>,
        v: &CudaView<'_, Self>,
        out: &mut CudaViewMut<'_, Self>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()>;

    /// `dq`, `dk`, `dv` written.
    fn attention_backward(
        mm: &mut Matmul,
        s: &Arc<CudaStream>,
        d: &Dims,
        dout: &CudaView<'_, Self>,
        q: &CudaView<'_, Self>,
        k: &CudaView<'_, Self>,
        v: &CudaView<'_, Self>,
        out: &CudaView<'_, Self>,
        lse: &CudaView<'_, f32>,
        dq: &mut CudaViewMut<'_, Self>,
        dk: &mut CudaViewMut<'_, Self>,
        dv: &mut CudaViewMut<'_, Self>,
    ) -> Result<()>;
}

/// Fails unless `s` is the stream the handle launches on: every op of a model is ordered on
/// one stream, and a product on another stream would race with its neighbours.
fn same_stream(mm: &Matmul, s: &Arc<CudaStream>, op: &'static str) -> Result<()> {
    if Arc::ptr_eq(mm.gemm.stream(), s) {
        Ok(())
    } else {
        Err(OpsError::Cuda {
            context: op,
            message: "the cuBLASLt handle is bound to another stream than the model's".into(),
        })
    }
}

/// Implements [`GpuLinalg`] for one type from its wrappers and workspace variant.
macro_rules! impl_linalg {
    ($t:ty, $ws:ident, $lin_f:path, $lin_b:path, $att_f:path, $att_b:path) => {
        impl GpuLinalg for $t {
            fn linear_forward(
                mm: &mut Matmul,
                s: &Arc<CudaStream>,
                x: &CudaView<'_, Self>,
                w: &CudaView<'_, Self>,
                bias: Option<&CudaView<'_, Self>>,
                rows: usize,
                in_f: usize,
                out_f: usize,
                out: &mut CudaViewMut<'_, Self>,
            ) -> Result<()> {
                same_stream(mm, s, concat!("linear_forward<", stringify!($t), ">"))?;
                let bias = bias.map(|b| b as &dyn DevicePtr<Self>);
                $lin_f(&mm.gemm, x, w, bias, rows, in_f, out_f, out)
            }

            fn linear_backward(
                mm: &mut Matmul,
                s: &Arc<CudaStream>,
                dout: &CudaView<'_, Self>,
                x: &CudaView<'_, Self>,
                w: &CudaView<'_, Self>,
                rows: usize,
                in_f: usize,
                out_f: usize,
                dx: Option<&mut CudaViewMut<'_, Self>>,
                dw: &mut CudaViewMut<'_, f32>,
                db: Option<&mut CudaViewMut<'_, f32>>,
            ) -> Result<()> {
                same_stream(mm, s, concat!("linear_backward<", stringify!($t), ">"))?;
                let dx = dx.map(|v| v as &mut dyn DevicePtrMut<Self>);
                let db = db.map(|v| v as &mut dyn DevicePtrMut<f32>);
                $lin_b(&mm.gemm, dout, x, w, rows, in_f, out_f, dx, dw, db)
            }

            fn attention_forward(
                mm: &mut Matmul,
                s: &Arc<CudaStream>,
                d: &Dims,
                q: &CudaView<'_, Self>,
                k: &CudaView<'_, Self>,
                v: &CudaView<'_, Self>,
                out: &mut CudaViewMut<'_, Self>,
                lse: &mut CudaViewMut<'_, f32>,
            ) -> Result<()> {
                const OP: &str = concat!("attention_forward<", stringify!($t), ">");
                same_stream(mm, s, OP)?;
                let AttnWs::$ws(ws) = &mut mm.attn else {
                    return Err(wrong_workspace(OP));
                };
                $att_f(&mm.gemm, ws, attn_shape(d), q, k, v, out, lse)
            }

            fn attention_backward(
                mm: &mut Matmul,
                s: &Arc<CudaStream>,
                d: &Dims,
                dout: &CudaView<'_, Self>,
                q: &CudaView<'_, Self>,
                k: &CudaView<'_, Self>,
                v: &CudaView<'_, Self>,
                out: &CudaView<'_, Self>,
                lse: &CudaView<'_, f32>,
                dq: &mut CudaViewMut<'_, Self>,
                dk: &mut CudaViewMut<'_, Self>,
                dv: &mut CudaViewMut<'_, Self>,
            ) -> Result<()> {
                const OP: &str = concat!("attention_backward<", stringify!($t), ">");
                same_stream(mm, s, OP)?;
                let AttnWs::$ws(ws) = &mut mm.attn else {
                    return Err(wrong_workspace(OP));
                };
                $att_b(
                    &mm.gemm,
                    ws,
                    attn_shape(d),
                    dout,
                    q,
                    k,
                    v,
                    out,
                    lse,
                    dq,
                    dk,
                    dv,
                )
            }
        }
    };
}

impl_linalg!(
    f32,
    F32,
    k::linear_forward_f32,
    k::linear_backward_f32,
    k::attention_forward_f32,
    k::attention_backward_f32
);

impl_linalg!(
    bf16,
    Bf16,
    k::linear_forward_bf16,
    k::linear_backward_bf16,
    k::attention_forward_bf16,
    k::attention_backward_bf16
);
