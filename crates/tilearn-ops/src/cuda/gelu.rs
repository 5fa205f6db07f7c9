//! Wrappers of tilearn-kernels' `gelu.cu`: Bloom's tanh GeLU, forward and backward, for every
//! [`DeviceFloat`] (f32, bf16, f16) with f32 arithmetic. Same contract as
//! [`crate::cpu::gelu_tanh_forward`] / [`crate::cpu::gelu_tanh_backward`]: `out` and `dx` are
//! written (`=`).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::dtype::DeviceFloat;
use super::launch::Launch;
use crate::Result;

/// `out = 0.5 x (1 + tanh(0.79788456 x (1 + 0.044715 x²)))` element-wise; lengths must match.
///
/// Precision: f32 arithmetic (`tanhf`) on the widened input, each output rounded once to `T`.
pub fn gelu_tanh_forward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let n = x.len();
    Launch::new("tilearn_gelu_tanh_forward", stream)
        .input("x", x, n)
        .output("out", out, n)
        .skip_launch_if(n == 0)
        .run(|[x], [out], stream| {
            // SAFETY: the launcher reads `n` elements of T (`T::DTYPE`) from x and writes `n`
            // to out.
            unsafe { ffi::tilearn_gelu_tanh_forward(T::DTYPE, x, out, n, stream) }
        })
}

/// Backward of [`gelu_tanh_forward`] from its input `x`: `dx = dout · gelu'(x)` written (`=`);
/// lengths must match.
///
/// Precision: f32 arithmetic (tanh recomputed), each output rounded once to `T`.
pub fn gelu_tanh_backward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<T>,
    x: &impl DevicePtr<T>,
    dx: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let n = dout.len();
    Launch::new("tilearn_gelu_tanh_backward", stream)
        .input("dout", dout, n)
        .input("x", x, n)
        .output("dx", dx, n)
        .skip_launch_if(n == 0)
        .run(|[dout, x], [dx], stream| {
            // SAFETY: the launcher reads `n` elements of T (`T::DTYPE`) from dout and x and
            // writes `n` to dx.
            unsafe { ffi::tilearn_gelu_tanh_backward(T::DTYPE, dout, x, dx, n, stream) }
        })
}
