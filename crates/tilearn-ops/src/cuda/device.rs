//! [`GpuDevice`]: a CUDA device's primary context plus the stream tilearn launches on.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError};

use crate::{OpsError, Result};

/// One GPU: its primary context (shared with the CUDA runtime that the kernels use) and a
/// non-blocking stream on which every tilearn kernel and copy for this device is ordered.
#[derive(Debug, Clone)]
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl GpuDevice {
    /// Opens device `ordinal`. Without a driver library, without devices, or with an ordinal past
    /// the last device this returns [`OpsError::NoCudaDevice`] (never panics).
    pub fn new(ordinal: usize) -> Result<Self> {
        let count = Self::count()?;
        if ordinal >= count {
            return Err(OpsError::NoCudaDevice {
                reason: format!("device {ordinal} requested but only {count} CUDA device(s) found"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| OpsError::NoCudaDevice {
            reason: format!("cannot open CUDA device {ordinal}: {e}"),
        })?;
        let stream = ctx
            .new_stream()
            .map_err(driver_err("GpuDevice::new: stream"))?;
        Ok(GpuDevice { ctx, stream })
    }

    /// The number of CUDA devices, or [`OpsError::NoCudaDevice`] when there is no driver or none.
    pub fn count() -> Result<usize> {
        // SAFETY: only tries to dlopen the driver library (libcuda.so*), and closes it again.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(OpsError::NoCudaDevice {
                reason: "no CUDA driver found (libcuda.so could not be loaded: is the NVIDIA \
                         driver installed and its library on the loader path?)"
                    .into(),
            });
        }
        let count = CudaContext::device_count().map_err(|e| OpsError::NoCudaDevice {
            reason: format!("the CUDA driver reports no usable device: {e}"),
        })?;
        match usize::try_from(count) {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(OpsError::NoCudaDevice {
                reason: "the CUDA driver is present but reports 0 devices".into(),
            }),
        }
    }

    /// The device's primary context (cudarc's handle).
    pub fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every tilearn launch for this device uses.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String> {
        self.ctx.name().map_err(driver_err("GpuDevice::name"))
    }

    /// Blocks until all work queued on [`stream`](Self::stream) has finished; reports errors of
    /// kernels that failed asynchronously.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver_err("GpuDevice::synchronize"))
    }
}

fn driver_err(context: &'static str) -> impl Fn(DriverError) -> OpsError {
    move |e| OpsError::Cuda {
        context,
        message: e.to_string(),
    }
}
