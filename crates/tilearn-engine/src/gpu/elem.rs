//! [`GpuElem`]: the activation element type of the device model (`f32` or `bf16`), mapping each
//! op of the Llama path to tilearn-ops' typed wrapper for that type, so the forward and
//! backward are written once, generically.
//!
//! Conventions are the wrappers' (and the CPU reference's): activation gradients are written
//! (`=`), parameter gradients are f32 and accumulated (`+=`); per-row statistics (RMSNorm
//! `rstd`, attention `lse`, cross-entropy row losses) are f32 whatever `Self` is.

use std::sync::Arc;

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use tilearn_ops::Result;
use tilearn_ops::cuda::{
    self as k, CeTotals, CudaStream, EmbeddingBackwardScratch, GpuRopeTable, RmsNormScratch,
    TokenIdCheck,
};

/// An activation element type the device model runs in.
#[allow(clippy::too_many_arguments)]
pub(crate) trait GpuElem: DeviceRepr + ValidAsZeroBits + Copy + Unpin + 'static {
    fn embedding_forward(
        s: &Arc<CudaStream>,
        ids: &impl DevicePtr<u32>,
        table: &impl DevicePtr<Self>,
        dim: usize,
        out: &mut impl DevicePtrMut<Self>,
        check: &mut TokenIdCheck,
    ) -> Result<()>;

    /// `dtable += scatter(dout)` (f32 table gradient).
    fn embedding_backward(
        s: &Arc<CudaStream>,
        ids: &impl DevicePtr<u32>,
        dout: &impl DevicePtr<Self>,
        dim: usize,
        dtable: &mut impl DevicePtrMut<f32>,
        check: &mut TokenIdCheck,
        scratch: &mut EmbeddingBackwardScratch,
    ) -> Result<()>;

    fn rmsnorm_forward(
        s: &Arc<CudaStream>,
        x: &impl DevicePtr<Self>,
        weight: &impl DevicePtr<Self>,
        dim: usize,
        eps: f64,
        out: &mut impl DevicePtrMut<Self>,
        rstd: &mut impl DevicePtrMut<f32>,
    ) -> Result<()>;

    /// `resid += y` in place, then `out = RMSNorm(resid)` (one launch).
    fn add_rmsnorm_forward(
        s: &Arc<CudaStream>,
        resid: &mut impl DevicePtrMut<Self>,
        y: &impl DevicePtr<Self>,
        weight: &impl DevicePtr<Self>,
        dim: usize,
        eps: f64,
        out: &mut impl DevicePtrMut<Self>,
        rstd: &mut impl DevicePtrMut<f32>,
    ) -> Result<()>;

    /// `dx =`, `dweight +=` (f32).
    fn rmsnorm_backward(
        s: &Arc<CudaStream>,
        dout: &impl DevicePtr<Self>,
        x: &impl DevicePtr<Self>,
        weight: &impl DevicePtr<Self>,
        rstd: &impl DevicePtr<f32>,
        dim: usize,
        dx: &mut impl DevicePtrMut<Self>,
        dweight: &mut impl DevicePtrMut<f32>,
        scratch: &mut RmsNormScratch,
    ) -> Result<()>;

    /// `dresid +=` the input gradient, `dweight +=` (f32).
    fn rmsnorm_backward_add(
        s: &Arc<CudaStream>,
        dout: &impl DevicePtr<Self>,
        x: &impl DevicePtr<Self>,
        weight: &impl DevicePtr<Self>,
        rstd: &impl DevicePtr<f32>,
        dim: usize,
        dresid: &mut impl DevicePtrMut<Self>,
        dweight: &mut impl DevicePtrMut<f32>,
        scratch: &mut RmsNormScratch,
    ) -> Result<()>;

    fn rope_forward(
        s: &Arc<CudaStream>,
        x: &mut impl DevicePtrMut<Self>,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        table: &GpuRopeTable,
    ) -> Result<()>;

    fn rope_backward(
        s: &Arc<CudaStream>,
        dx: &mut impl DevicePtrMut<Self>,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        table: &GpuRopeTable,
    ) -> Result<()>;

    fn swiglu_forward(
        s: &Arc<CudaStream>,
        gate: &impl DevicePtr<Self>,
        up: &impl DevicePtr<Self>,
        out: &mut impl DevicePtrMut<Self>,
    ) -> Result<()>;

    /// `dgate =`, `dup =`.
    fn swiglu_backward(
        s: &Arc<CudaStream>,
        dout: &impl DevicePtr<Self>,
        gate: &impl DevicePtr<Self>,
        up: &impl DevicePtr<Self>,
        dgate: &mut impl DevicePtrMut<Self>,
        dup: &mut impl DevicePtrMut<Self>,
    ) -> Result<()>;

    /// `acc += x`.
    fn add_inplace(
        s: &Arc<CudaStream>,
        acc: &mut impl DevicePtrMut<Self>,
        x: &impl DevicePtr<Self>,
    ) -> Result<()>;

    /// Logits become `(softmax - onehot) * grad_scale` in place; row losses and totals written.
    fn cross_entropy_fused(
        s: &Arc<CudaStream>,
        logits: &mut impl DevicePtrMut<Self>,
        targets: &impl DevicePtr<i32>,
        vocab: usize,
        grad_scale: f64,
        row_loss: &mut impl DevicePtrMut<f32>,
        totals: &mut CeTotals,
    ) -> Result<()>;

    /// Loss only (logits unchanged).
    fn cross_entropy_forward(
        s: &Arc<CudaStream>,
        logits: &impl DevicePtr<Self>,
        targets: &impl DevicePtr<i32>,
        vocab: usize,
        row_loss: &mut impl DevicePtrMut<f32>,
        totals: &mut CeTotals,
    ) -> Result<()>;

    /// Host-side widening of downloaded values (exact).
    fn host_to_f32(values: &[Self]) -> Vec<f32>;
}

/// Implements [`GpuElem`] for one type from its wrappers (all with the same argument order).
macro_rules! impl_elem {
    ($t:ty, $emb_f:path, $emb_b:path, $rms_f:path, $rms_b:path, $add_rms_f:path,
     $rms_b_add:path, $rope_f:path,
     $rope_b:path, $swi_f:path, $swi_b:path, $add:path, $ce_fused:path, $ce_fwd:path) => {
        impl GpuElem for $t {
            fn embedding_forward(
                s: &Arc<CudaStream>,
                ids: &impl DevicePtr<u32>,
                table: &impl DevicePtr<Self>,
                dim: usize,
                out: &mut impl DevicePtrMut<Self>,
                check: &mut TokenIdCheck,
            ) -> Result<()> {
                $emb_f(s, ids, table, dim, out, check)
            }

            fn embedding_backward(
                s: &Arc<CudaStream>,
                ids: &impl DevicePtr<u32>,
                dout: &impl DevicePtr<Self>,
                dim: usize,
                dtable: &mut impl DevicePtrMut<f32>,
                check: &mut TokenIdCheck,
                scratch: &mut EmbeddingBackwardScratch,
            ) -> Result<()> {
                $emb_b(s, ids, dout, dim, dtable, check, scratch)
            }

            fn rmsnorm_forward(
                s: &Arc<CudaStream>,
                x: &impl DevicePtr<Self>,
                weight: &impl DevicePtr<Self>,
                dim: usize,
                eps: f64,
                out: &mut impl DevicePtrMut<Self>,
                rstd: &mut impl DevicePtrMut<f32>,
            ) -> Result<()> {
                $rms_f(s, x, weight, dim, eps, out, rstd)
            }

            fn add_rmsnorm_forward(
                s: &Arc<CudaStream>,
                resid: &mut impl DevicePtrMut<Self>,
                y: &impl DevicePtr<Self>,
                weight: &impl DevicePtr<Self>,
                dim: usize,
                eps: f64,
                out: &mut impl DevicePtrMut<Self>,
                rstd: &mut impl DevicePtrMut<f32>,
            ) -> Result<()> {
                $add_rms_f(s, resid, y, weight, dim, eps, out, rstd)
            }

            fn rmsnorm_backward(
                s: &Arc<CudaStream>,
                dout: &impl DevicePtr<Self>,
                x: &impl DevicePtr<Self>,
                weight: &impl DevicePtr<Self>,
                rstd: &impl DevicePtr<f32>,
                dim: usize,
                dx: &mut impl DevicePtrMut<Self>,
                dweight: &mut impl DevicePtrMut<f32>,
                scratch: &mut RmsNormScratch,
            ) -> Result<()> {
                $rms_b(s, dout, x, weight, rstd, dim, dx, dweight, scratch)
            }

            fn rmsnorm_backward_add(
                s: &Arc<CudaStream>,
                dout: &impl DevicePtr<Self>,
                x: &impl DevicePtr<Self>,
                weight: &impl DevicePtr<Self>,
                rstd: &impl DevicePtr<f32>,
                dim: usize,
                dresid: &mut impl DevicePtrMut<Self>,
                dweight: &mut impl DevicePtrMut<f32>,
                scratch: &mut RmsNormScratch,
            ) -> Result<()> {
                $rms_b_add(s, dout, x, weight, rstd, dim, dresid, dweight, scratch)
            }

            fn rope_forward(
                s: &Arc<CudaStream>,
                x: &mut impl DevicePtrMut<Self>,
                batch: usize,
                seq: usize,
                heads: usize,
                head_dim: usize,
                table: &GpuRopeTable,
            ) -> Result<()> {
                $rope_f(s, x, batch, seq, heads, head_dim, table)
            }

            fn rope_backward(
                s: &Arc<CudaStream>,
                dx: &mut impl DevicePtrMut<Self>,
                batch: usize,
                seq: usize,
                heads: usize,
                head_dim: usize,
                table: &GpuRopeTable,
            ) -> Result<()> {
                $rope_b(s, dx, batch, seq, heads, head_dim, table)
            }

            fn swiglu_forward(
                s: &Arc<CudaStream>,
                gate: &impl DevicePtr<Self>,
                up: &impl DevicePtr<Self>,
                out: &mut impl DevicePtrMut<Self>,
            ) -> Result<()> {
                $swi_f(s, gate, up, out)
            }

            fn swiglu_backward(
                s: &Arc<CudaStream>,
                dout: &impl DevicePtr<Self>,
                gate: &impl DevicePtr<Self>,
                up: &impl DevicePtr<Self>,
                dgate: &mut impl DevicePtrMut<Self>,
                dup: &mut impl DevicePtrMut<Self>,
            ) -> Result<()> {
                $swi_b(s, dout, gate, up, dgate, dup)
            }

            fn add_inplace(
                s: &Arc<CudaStream>,
                acc: &mut impl DevicePtrMut<Self>,
                x: &impl DevicePtr<Self>,
            ) -> Result<()> {
                $add(s, acc, x)
            }

            fn cross_entropy_fused(
                s: &Arc<CudaStream>,
                logits: &mut impl DevicePtrMut<Self>,
                targets: &impl DevicePtr<i32>,
                vocab: usize,
                grad_scale: f64,
                row_loss: &mut impl DevicePtrMut<f32>,
                totals: &mut CeTotals,
            ) -> Result<()> {
                $ce_fused(s, logits, targets, vocab, grad_scale, row_loss, totals)
            }

            fn cross_entropy_forward(
                s: &Arc<CudaStream>,
                logits: &impl DevicePtr<Self>,
                targets: &impl DevicePtr<i32>,
                vocab: usize,
                row_loss: &mut impl DevicePtrMut<f32>,
                totals: &mut CeTotals,
            ) -> Result<()> {
                $ce_fwd(s, logits, targets, vocab, row_loss, totals)
            }

            fn host_to_f32(values: &[Self]) -> Vec<f32> {
                values.iter().map(|&x| f32::from(x)).collect()
            }
        }
    };
}

impl_elem!(
    f32,
    k::embedding_forward_f32,
    k::embedding_backward_f32,
    k::rmsnorm_forward_f32,
    k::rmsnorm_backward_f32,
    k::add_rmsnorm_forward_f32,
    k::rmsnorm_backward_add_f32,
    k::rope_forward_f32,
    k::rope_backward_f32,
    k::swiglu_forward_f32,
    k::swiglu_backward_f32,
    k::residual_add_inplace_f32,
    k::cross_entropy_fused_f32,
    k::cross_entropy_forward_f32
);

impl_elem!(
    bf16,
    k::embedding_forward_bf16,
    k::embedding_backward_bf16,
    k::rmsnorm_forward_bf16,
    k::rmsnorm_backward_bf16,
    k::add_rmsnorm_forward_bf16,
    k::rmsnorm_backward_add_bf16,
    k::rope_forward_bf16,
    k::rope_backward_bf16,
    k::swiglu_forward_bf16,
    k::swiglu_backward_bf16,
    k::residual_add_inplace_bf16,
    k::cross_entropy_fused_bf16,
    k::cross_entropy_forward_bf16
);
