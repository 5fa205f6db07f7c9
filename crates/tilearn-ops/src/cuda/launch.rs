//! What every launcher wrapper does before and after the FFI call: check that buffers live on
//! the stream's device, make the context current, and turn the returned status into an error.

use std::ffi::c_int;

use cudarc::driver::{CudaStream, DeviceSlice};

use crate::{OpsError, Result};
use tilearn_kernels::ffi;

/// The runtime's stream handle for a cudarc stream. The driver's `CUstream` and the runtime's
/// `cudaStream_t` are the same handle (CUDA documents them as interchangeable).
pub(super) fn raw_stream(stream: &CudaStream) -> ffi::cudaStream_t {
    stream.cu_stream() as ffi::cudaStream_t
}

/// Makes the stream's context current on this thread, so the runtime API inside the launcher
/// uses it (the runtime picks up a driver context that is current; cudarc's is the primary one).
pub(super) fn bind(stream: &CudaStream, op: &'static str) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| OpsError::Cuda {
            context: op,
            message: format!("cannot make the device context current: {e}"),
        })
}

/// Fails unless `buf` was allocated on the same device (context) as `stream`.
pub(super) fn same_device<T>(
    stream: &CudaStream,
    op: &'static str,
    what: &str,
    buf: &impl DeviceSlice<T>,
) -> Result<()> {
    if **buf.stream().context() == **stream.context() {
        Ok(())
    } else {
        Err(OpsError::Cuda {
            context: op,
            message: format!(
                "`{what}` lives on device {} but the launch stream is on device {}",
                buf.stream().context().ordinal(),
                stream.context().ordinal()
            ),
        })
    }
}

/// Fails with [`OpsError::ShapeMismatch`] unless `actual == expected`.
pub(super) fn expect_len(op: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(OpsError::ShapeMismatch {
            op,
            expected,
            actual,
        })
    }
}

/// Turns a launcher's return value (a `cudaError_t`) into a result.
pub(super) fn check(op: &'static str, status: c_int) -> Result<()> {
    match tilearn_kernels::status_message(status) {
        None => Ok(()),
        Some(message) => Err(OpsError::Cuda {
            context: op,
            message,
        }),
    }
}
