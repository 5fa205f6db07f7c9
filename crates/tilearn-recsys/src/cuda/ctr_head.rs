//! Safe wrappers of `ctr_head.cu`'s launchers: the parts of a CTR model's head that are not
//! matrix products (those are tilearn-ops' cuBLASLt `linear_forward` / `linear_backward`).
//! Each computes on the device what [`crate::model::head_forward`] / `head_backward` compute on
//! the CPU for the same part; `tests/ctr_gpu.rs` compares the whole head with them.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;
use tilearn_ops::cuda::launch::Launch;

use crate::error::Result;
use crate::model::{CtrConfig, ModelKind};

/// The sizes of one batch through the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadShape {
    /// DeepFM's FM interaction term on.
    pub fm: bool,
    /// Width of a pooled embedding row (all tables).
    pub width: usize,
    pub fields: usize,
    pub k: usize,
    pub num_dense: usize,
    pub batch: usize,
}

impl HeadShape {
    /// The shape of `batch` samples of a model of `config` whose pooled rows are `width` wide.
    pub fn new(config: &CtrConfig, width: usize, batch: usize) -> Self {
        HeadShape {
            fm: config.model == ModelKind::DeepFm,
            width,
            fields: config.num_fields(),
            k: config.embed_dim,
            num_dense: config.num_dense,
            batch,
        }
    }

    /// Columns of the field embeddings (`fields * k`).
    pub fn deep(&self) -> usize {
        self.fields * self.k
    }

    /// Width of the MLP's input (`deep + num_dense`).
    pub fn mlp_in(&self) -> usize {
        self.deep() + self.num_dense
    }
}

/// `x0 = [emb[:, 0:deep], dense]` (`[batch, mlp_in]`, written `=`).
pub fn mlp_input(
    stream: &CudaStream,
    s: HeadShape,
    emb: &impl DevicePtr<f32>,
    dense: &impl DevicePtr<f32>,
    x0: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    Launch::new("tilearn_ctr_mlp_input", stream)
        .input("emb", emb, s.batch * s.width)
        .input("dense", dense, s.batch * s.num_dense)
        .output("x0", x0, s.batch * s.mlp_in())
        .skip_launch_if(s.batch == 0)
        .run(|[emb, dense], [x0], stream| {
            // SAFETY: reads batch * width f32 of emb and batch * num_dense of dense, writes
            // batch * mlp_in f32 to x0 (lengths checked by the builder; deep <= width by
            // construction of HeadShape).
            unsafe {
                ffi::tilearn_ctr_mlp_input(
                    emb.cast(),
                    s.width,
                    s.deep(),
                    dense.cast(),
                    s.num_dense,
                    s.batch,
                    x0.cast(),
                    stream,
                )
            }
        })?;
    Ok(())
}

/// `a = max(z, 0)` over `n` elements (written `=`).
pub fn relu_forward(
    stream: &CudaStream,
    z: &impl DevicePtr<f32>,
    a: &mut impl DevicePtrMut<f32>,
    n: usize,
) -> Result<()> {
    Launch::new("tilearn_ctr_relu_forward", stream)
        .input("z", z, n)
        .output("a", a, n)
        .skip_launch_if(n == 0)
        .run(|[z], [a], stream| {
            // SAFETY: reads n f32 of z, writes n f32 of a (lengths checked by the builder).
            unsafe { ffi::tilearn_ctr_relu_forward(z.cast(), a.cast(), n, stream) }
        })?;
    Ok(())
}

/// `dx = 0` where `z <= 0`, in place over `n` elements (the ReLU's backward).
pub fn relu_backward(
    stream: &CudaStream,
    dx: &mut impl DevicePtrMut<f32>,
    z: &impl DevicePtr<f32>,
    n: usize,
) -> Result<()> {
    Launch::new("tilearn_ctr_relu_backward", stream)
        .input("z", z, n)
        .output("dx", dx, n)
        .skip_launch_if(n == 0)
        .run(|[z], [dx], stream| {
            // SAFETY: reads n f32 of z, rewrites n f32 of dx (lengths checked by the builder).
            unsafe { ffi::tilearn_ctr_relu_backward(dx.cast(), z.cast(), n, stream) }
        })?;
    Ok(())
}

/// The head's non-matrix parameters: the dense features' weights and the global bias.
pub struct HeadParams<'a, P: DevicePtr<f32>> {
    pub w_dense: &'a P,
    pub bias: &'a P,
}

/// Logits only (evaluation): `logits = bias + mlp + sum(first-order) + dense . w_dense [+ FM]`.
pub fn logits<P: DevicePtr<f32>>(
    stream: &CudaStream,
    s: HeadShape,
    emb: &impl DevicePtr<f32>,
    dense: &impl DevicePtr<f32>,
    params: HeadParams<'_, P>,
    mlp: &impl DevicePtr<f32>,
    logits: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    Launch::new("tilearn_ctr_logits_loss", stream)
        .input("emb", emb, s.batch * s.width)
        .input("dense", dense, s.batch * s.num_dense)
        .input("w_dense", params.w_dense, s.num_dense)
        .input("bias", params.bias, 1)
        .input("mlp", mlp, s.batch)
        .output("logits", logits, s.batch)
        .skip_launch_if(s.batch == 0)
        .run(|[emb, dense, w_dense, bias, mlp], [logits], stream| {
            // SAFETY: reads the lengths registered above (checked by the builder) and writes
            // batch f32 of logits; with labels NULL the launcher touches no loss buffer.
            unsafe {
                ffi::tilearn_ctr_logits_loss(
                    i32::from(s.fm),
                    emb.cast(),
                    s.width,
                    s.fields,
                    s.k,
                    dense.cast(),
                    s.num_dense,
                    w_dense.cast(),
                    bias.cast(),
                    mlp.cast(),
                    std::ptr::null(),
                    s.batch,
                    0.0,
                    logits.cast(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    stream,
                )
            }
        })?;
    Ok(())
}

/// What [`logits_loss`] writes: per-sample logits, loss gradients and f64 loss terms.
pub struct LossOutputs<'a, L, D, T>
where
    L: DevicePtrMut<f32>,
    D: DevicePtrMut<f32>,
    T: DevicePtrMut<f64>,
{
    pub logits: &'a mut L,
    pub dlogits: &'a mut D,
    pub loss_terms: &'a mut T,
}

/// Logits, their BCE-with-logits terms (f64) and `dlogits = (sigmoid(z) - y) * dlogit_scale`.
#[allow(clippy::too_many_arguments)]
pub fn logits_loss<P, L, D, T>(
    stream: &CudaStream,
    s: HeadShape,
    emb: &impl DevicePtr<f32>,
    dense: &impl DevicePtr<f32>,
    params: HeadParams<'_, P>,
    mlp: &impl DevicePtr<f32>,
    labels: &impl DevicePtr<f32>,
    dlogit_scale: f32,
    out: LossOutputs<'_, L, D, T>,
) -> Result<()>
where
    P: DevicePtr<f32>,
    L: DevicePtrMut<f32>,
    D: DevicePtrMut<f32>,
    T: DevicePtrMut<f64>,
{
    Launch::new("tilearn_ctr_logits_loss", stream)
        .input("emb", emb, s.batch * s.width)
        .input("dense", dense, s.batch * s.num_dense)
        .input("w_dense", params.w_dense, s.num_dense)
        .input("bias", params.bias, 1)
        .input("mlp", mlp, s.batch)
        .input("labels", labels, s.batch)
        .output("logits", out.logits, s.batch)
        .output("dlogits", out.dlogits, s.batch)
        .output("loss_terms", out.loss_terms, s.batch)
        .skip_launch_if(s.batch == 0)
        .run(
            |[emb, dense, w_dense, bias, mlp, labels], [logits, dlogits, terms], stream| {
                // SAFETY: reads the lengths registered above and writes batch values to each
                // output (all checked by the builder).
                unsafe {
                    ffi::tilearn_ctr_logits_loss(
                        i32::from(s.fm),
                        emb.cast(),
                        s.width,
                        s.fields,
                        s.k,
                        dense.cast(),
                        s.num_dense,
                        w_dense.cast(),
                        bias.cast(),
                        mlp.cast(),
                        labels.cast(),
                        s.batch,
                        dlogit_scale,
                        logits.cast(),
                        dlogits.cast(),
                        terms.cast(),
                        stream,
                    )
                }
            },
        )?;
    Ok(())
}

/// `demb` (written `=`): `dlogit` on the dim-1 columns; on the field embeddings the FM's
/// gradient (DeepFM) plus the MLP input's gradient `dx0` (`[batch, mlp_in]`).
pub fn head_backward(
    stream: &CudaStream,
    s: HeadShape,
    emb: &impl DevicePtr<f32>,
    dlogits: &impl DevicePtr<f32>,
    dx0: &impl DevicePtr<f32>,
    demb: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    Launch::new("tilearn_ctr_head_backward", stream)
        .input("emb", emb, s.batch * s.width)
        .input("dlogits", dlogits, s.batch)
        .input("dx0", dx0, s.batch * s.mlp_in())
        .output("demb", demb, s.batch * s.width)
        .skip_launch_if(s.batch == 0)
        .run(|[emb, dlogits, dx0], [demb], stream| {
            // SAFETY: reads the lengths registered above and writes batch * width f32 of demb
            // (checked by the builder).
            unsafe {
                ffi::tilearn_ctr_head_backward(
                    i32::from(s.fm),
                    emb.cast(),
                    s.width,
                    s.fields,
                    s.k,
                    dlogits.cast(),
                    dx0.cast(),
                    s.mlp_in(),
                    s.batch,
                    demb.cast(),
                    stream,
                )
            }
        })?;
    Ok(())
}

/// The batch reductions of a step: `dw_dense[i] += sum_b dlogits[b] dense[b, i]`,
/// `dbias += sum_b dlogits[b]`, `loss_sum = sum_b loss_terms[b]` (f64, written `=`).
#[allow(clippy::too_many_arguments)]
pub fn batch_sums(
    stream: &CudaStream,
    s: HeadShape,
    dlogits: &impl DevicePtr<f32>,
    dense: &impl DevicePtr<f32>,
    loss_terms: &impl DevicePtr<f64>,
    dw_dense: &mut impl DevicePtrMut<f32>,
    dbias: &mut impl DevicePtrMut<f32>,
    loss_sum: &mut impl DevicePtrMut<f64>,
) -> Result<()> {
    Launch::new("tilearn_ctr_batch_sums", stream)
        .input("dlogits", dlogits, s.batch)
        .input("dense", dense, s.batch * s.num_dense)
        .input("loss_terms", loss_terms, s.batch)
        .output("dw_dense", dw_dense, s.num_dense)
        .output("dbias", dbias, 1)
        .output("loss_sum", loss_sum, 1)
        .run(|[dlogits, dense, terms], [dw, db, loss], stream| {
            // SAFETY: reads the lengths registered above, accumulates num_dense f32 into
            // dw_dense and one into dbias, writes one f64 to loss_sum (checked by the builder).
            unsafe {
                ffi::tilearn_ctr_batch_sums(
                    dlogits.cast(),
                    dense.cast(),
                    s.num_dense,
                    terms.cast(),
                    s.batch,
                    dw.cast(),
                    db.cast(),
                    loss.cast(),
                    stream,
                )
            }
        })?;
    Ok(())
}
