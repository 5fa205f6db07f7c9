//! Wrappers of tilearn-kernels' `row_normalize.cu`: `out[r] = w[r] / max(‖w[r]‖, 1e-12)`
//! (PyTorch's `F.normalize(w, dim=-1)`, Baichuan2's NormHead) and its backward, for every
//! [`DeviceFloat`] weight type. Same contract as [`crate::cpu::row_normalize_forward`] and
//! [`crate::cpu::row_normalize_backward`].

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::dtype::DeviceFloat;
use super::launch::Launch;
use crate::Result;
use crate::shape::rows_of;

/// `out = w / ‖w‖` row by row over `[rows, cols]`, `out` written (`=`).
///
/// Precision: the sum of squares and the scaling in f32; `out` rounded once to `T`.
pub fn row_normalize_forward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    w: &impl DevicePtr<T>,
    cols: usize,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const OP: &str = "tilearn_row_normalize_forward";
    let rows = rows_of(OP, w.len(), cols)?;
    Launch::new(OP, stream)
        .input("w", w, rows * cols)
        .output("out", out, rows * cols)
        .skip_launch_if(rows == 0)
        .run(|[w], [out], stream| {
            // SAFETY: the launcher reads rows * cols elements of T (`T::DTYPE`) from w and
            // writes as many to out.
            unsafe { ffi::tilearn_row_normalize_forward(T::DTYPE, w, rows, cols, out, stream) }
        })
}

/// Backward of [`row_normalize_forward`]: `dw += (dout − u·(u·dout)) / ‖w‖` per row
/// (`u = w / ‖w‖`; `dw += dout / 1e-12` for a clamped row). `dout` and `dw` are f32
/// `[rows, cols]`, `w` is in `T`; `dw` accumulates (`+=`).
pub fn row_normalize_backward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<f32>,
    w: &impl DevicePtr<T>,
    cols: usize,
    dw: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "tilearn_row_normalize_backward";
    let rows = rows_of(OP, w.len(), cols)?;
    Launch::new(OP, stream)
        .input("dout", dout, rows * cols)
        .input("w", w, rows * cols)
        .output("dw", dw, rows * cols)
        .skip_launch_if(rows == 0)
        .run(|[dout, w], [dw], stream| {
            // SAFETY: the launcher reads rows * cols f32 from dout and elements of T
            // (`T::DTYPE`) from w, and reads and writes rows * cols f32 of dw.
            unsafe {
                ffi::tilearn_row_normalize_backward(
                    T::DTYPE,
                    dout.cast(),
                    w,
                    rows,
                    cols,
                    dw.cast(),
                    stream,
                )
            }
        })
}
