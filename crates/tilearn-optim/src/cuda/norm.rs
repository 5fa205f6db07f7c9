//! [`GradNorm`]: the global gradient sum of squares on the device
//! (`crates/tilearn-kernels/kernels/optim_norm.cu`).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceSlice};
use tilearn_kernels::ffi;

use super::error::{FusedError, Result};
use super::io::{Grads, bind, check_status, same_device};

/// Scratch and result of the deterministic global gradient norm. [`GradNorm::compute`] writes
/// `[sum of squares, norm]` (f64) to a device buffer that a step's
/// [`Clip`](super::Clip) reads directly: no host synchronisation.
#[derive(Debug)]
pub struct GradNorm {
    partials: CudaSlice<f64>,
    out: CudaSlice<f64>,
}

impl GradNorm {
    /// Allocates the scratch on `stream`'s device.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        // SAFETY: only reports a compile-time constant of the kernel file.
        let partials_len = unsafe { ffi::tilearn_optim_norm_partials_len() };
        let alloc = |len: usize| {
            stream
                .alloc_zeros::<f64>(len)
                .map_err(|e| FusedError::Cuda {
                    op: "GradNorm::new",
                    message: e.to_string(),
                })
        };
        Ok(GradNorm {
            partials: alloc(partials_len)?,
            out: alloc(2)?,
        })
    }

    /// `out = [Σ (g·inv_scale)², sqrt of it]` over the whole `grads` buffer (one multi-tensor
    /// pass plus a one-block final sum; bit-identical run to run). `inv_scale`: the GradScaler's
    /// device scalar (one f32) or `None` for 1.
    pub fn compute(
        &mut self,
        stream: &Arc<CudaStream>,
        grads: &Grads<'_>,
        inv_scale: Option<&CudaView<'_, f32>>,
    ) -> Result<()> {
        const OP: &str = "GradNorm::compute";
        if let Some(s) = inv_scale {
            if s.len() != 1 {
                return Err(FusedError::InvalidArgument {
                    op: OP,
                    message: format!("inv_scale must hold one f32, it holds {}", s.len()),
                });
            }
            same_device(OP, "inv_scale", stream, s.stream())?;
        }
        same_device(OP, "partials", stream, self.partials.stream())?;
        bind(OP, stream)?;
        let partials_len = self.partials.len();
        let (scale_ptr, _scale_guard) = match inv_scale {
            Some(s) => {
                let (p, g) = s.device_ptr(stream);
                (p as *const f32, Some(g))
            }
            None => (std::ptr::null(), None),
        };
        let (partials, _pg) = self.partials.device_ptr_mut(stream);
        let (out, _og) = self.out.device_ptr_mut(stream);
        let raw = stream.cu_stream() as ffi::cudaStream_t;
        let status = match grads {
            Grads::F32(g) => {
                same_device(OP, "grads", stream, g.stream())?;
                let (gp, _gg) = g.device_ptr(stream);
                // SAFETY: `gp` holds `g.len()` f32 on the stream's device; `partials` holds
                // `partials_len` f64 (>= what the launcher requires, checked by it), `out` 2
                // f64; `scale_ptr` is NULL or one f32. All stay alive until the launch has run
                // (borrowed here; cudarc frees stream-ordered). The launcher only enqueues work.
                unsafe {
                    ffi::tilearn_optim_grad_sumsq_f32(
                        gp as *const f32,
                        g.len(),
                        scale_ptr,
                        partials as *mut f64,
                        partials_len,
                        out as *mut f64,
                        raw,
                    )
                }
            }
            Grads::Bf16(g) => {
                same_device(OP, "grads", stream, g.stream())?;
                let (gp, _gg) = g.device_ptr(stream);
                // SAFETY: as above, with `g.len()` bf16 (u16 storage) gradients.
                unsafe {
                    ffi::tilearn_optim_grad_sumsq_bf16(
                        gp as *const ffi::tilearn_bf16,
                        g.len(),
                        scale_ptr,
                        partials as *mut f64,
                        partials_len,
                        out as *mut f64,
                        raw,
                    )
                }
            }
        };
        check_status(OP, status)
    }

    /// `[sum of squares, norm]` on the device: pass it as [`Clip::grad_sumsq`](super::Clip)
    /// (index 0 is read). After [`compute`](Self::compute) on the same stream.
    pub fn result(&self) -> CudaView<'_, f64> {
        self.out.as_view()
    }

    /// Mutable access for a ZeRO all-reduce of the partial sum of squares (index 0). The norm
    /// at index 1 is then stale; the optimizer kernels only read index 0.
    pub fn result_mut(&mut self) -> cudarc::driver::CudaViewMut<'_, f64> {
        self.out.as_view_mut()
    }

    /// Copies `[sum of squares, norm]` to the host (synchronises the stream; for logging).
    pub fn read(&self, stream: &Arc<CudaStream>) -> Result<[f64; 2]> {
        let v = stream.clone_dtoh(&self.out).map_err(|e| FusedError::Cuda {
            op: "GradNorm::read",
            message: e.to_string(),
        })?;
        Ok([v[0], v[1]])
    }
}
