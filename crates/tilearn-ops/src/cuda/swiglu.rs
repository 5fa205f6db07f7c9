//! Wrappers of tilearn-kernels' `activation.cu`: the SwiGLU gate of the Llama MLP,
//! `out = silu(gate) * up`, forward and backward, for every [`DeviceFloat`] (f32, bf16, f16),
//! always with f32 arithmetic.
//! Same contract as [`crate::cpu::swiglu_forward`] / [`crate::cpu::swiglu_backward`]: `out`,
//! `dgate` and `dup` are written (`=`).

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::dtype::DeviceFloat;
use super::launch::Launch;
use crate::Result;

/// `out = silu(gate) * up`, element-wise, with `silu(g) = g * sigmoid(g)`; all lengths must
/// match and `out` is written (`=`).
///
/// Precision: the inputs are widened to f32, everything is computed in f32 (exact `expf`, no
/// overflow for any finite `g`), and each output is rounded once to `T`.
pub fn swiglu_forward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    gate: &impl DevicePtr<T>,
    up: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let n = gate.len();
    Launch::new("tilearn_swiglu_forward", stream)
        .input("gate", gate, n)
        .input("up", up, n)
        .output("out", out, n)
        .skip_launch_if(n == 0)
        .run(|[gate, up], [out], stream| {
            // SAFETY: the launcher reads `n` elements of T (`T::DTYPE`) from gate and up and
            // writes `n` to out.
            unsafe { ffi::tilearn_swiglu_forward(T::DTYPE, gate, up, out, n, stream) }
        })
}

/// Backward of [`swiglu_forward`]: `dup = dout * silu(g)` and
/// `dgate = dout * up * s * (1 + g * (1 - s))` with `s = sigmoid(g)`, both written (`=`); all
/// lengths must match.
///
/// Precision: f32 arithmetic on the widened inputs (sigmoid recomputed, not saved), each output
/// rounded once to `T`.
pub fn swiglu_backward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<T>,
    gate: &impl DevicePtr<T>,
    up: &impl DevicePtr<T>,
    dgate: &mut impl DevicePtrMut<T>,
    dup: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let n = dout.len();
    Launch::new("tilearn_swiglu_backward", stream)
        .input("dout", dout, n)
        .input("gate", gate, n)
        .input("up", up, n)
        .output("dgate", dgate, n)
        .output("dup", dup, n)
        .skip_launch_if(n == 0)
        .run(|[dout, gate, up], [dgate, dup], stream| {
            // SAFETY: the launcher reads `n` elements of T (`T::DTYPE`) from dout, gate and up
            // and writes `n` to dgate and dup.
            unsafe { ffi::tilearn_swiglu_backward(T::DTYPE, dout, gate, up, dgate, dup, n, stream) }
        })
}
