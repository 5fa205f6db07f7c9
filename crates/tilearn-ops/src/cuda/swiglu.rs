//! Wrappers of `kernels/activation.cu`: the SwiGLU gate of the Llama MLP, `out = silu(gate) * up`,
//! forward and backward, in f32 and in bf16 with f32 arithmetic. Same contract as
//! [`crate::cpu::swiglu_forward`] / [`crate::cpu::swiglu_backward`]: `dgate` and `dup` are
//! written (`=`).

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::ffi;
use super::launch::{bind, check, expect_len, raw_stream, same_device};
use crate::Result;

type ForwardLauncher<R> =
    unsafe extern "C" fn(*const R, *const R, *mut R, usize, ffi::cudaStream_t) -> c_int;
type BackwardLauncher<R> = unsafe extern "C" fn(
    *const R,
    *const R,
    *const R,
    *mut R,
    *mut R,
    usize,
    ffi::cudaStream_t,
) -> c_int;

/// Shared body of the forwards. `T` is the Rust element type, `R` the FFI one of the same size.
fn forward<T, R>(
    op: &'static str,
    launcher: ForwardLauncher<R>,
    stream: &Arc<CudaStream>,
    gate: &impl DevicePtr<T>,
    up: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
    expect_len(op, gate.len(), up.len())?;
    expect_len(op, gate.len(), out.len())?;
    same_device(stream, op, "gate", gate)?;
    same_device(stream, op, "up", up)?;
    same_device(stream, op, "out", out)?;
    if gate.is_empty() {
        return Ok(());
    }
    bind(stream, op)?;
    let n = gate.len();
    let (g_ptr, _g) = gate.device_ptr(stream);
    let (u_ptr, _u) = up.device_ptr(stream);
    let (out_ptr, _out) = out.device_ptr_mut(stream);
    // SAFETY: the pointers are live allocations of the stream's context (checked above), each
    // with exactly `n` elements of the launcher's type (checked above). `out` is borrowed
    // mutably, so it overlaps neither input. The launcher only enqueues work on `stream`; the
    // guards order it after earlier writers and before later users of the buffers.
    let status = unsafe {
        launcher(
            g_ptr as *const R,
            u_ptr as *const R,
            out_ptr as *mut R,
            n,
            raw_stream(stream),
        )
    };
    check(op, status)
}

/// Shared body of the backwards.
#[allow(clippy::too_many_arguments)]
fn backward<T, R>(
    op: &'static str,
    launcher: BackwardLauncher<R>,
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<T>,
    gate: &impl DevicePtr<T>,
    up: &impl DevicePtr<T>,
    dgate: &mut impl DevicePtrMut<T>,
    dup: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
    let n = dout.len();
    expect_len(op, n, gate.len())?;
    expect_len(op, n, up.len())?;
    expect_len(op, n, dgate.len())?;
    expect_len(op, n, dup.len())?;
    same_device(stream, op, "dout", dout)?;
    same_device(stream, op, "gate", gate)?;
    same_device(stream, op, "up", up)?;
    same_device(stream, op, "dgate", dgate)?;
    same_device(stream, op, "dup", dup)?;
    if n == 0 {
        return Ok(());
    }
    bind(stream, op)?;
    let (dy_ptr, _dy) = dout.device_ptr(stream);
    let (g_ptr, _g) = gate.device_ptr(stream);
    let (u_ptr, _u) = up.device_ptr(stream);
    let (dg_ptr, _dg) = dgate.device_ptr_mut(stream);
    let (du_ptr, _du) = dup.device_ptr_mut(stream);
    // SAFETY: the pointers are live allocations of the stream's context (checked above), each
    // with exactly `n` elements (checked above). dgate and dup are borrowed mutably, so they
    // overlap neither each other nor the inputs. Work is enqueued on `stream` only, ordered by
    // the guards.
    let status = unsafe {
        launcher(
            dy_ptr as *const R,
            g_ptr as *const R,
            u_ptr as *const R,
            dg_ptr as *mut R,
            du_ptr as *mut R,
            n,
            raw_stream(stream),
        )
    };
    check(op, status)
}

/// `out = silu(gate) * up`, element-wise, in f32. All lengths must match.
pub fn swiglu_forward_f32(
    stream: &Arc<CudaStream>,
    gate: &impl DevicePtr<f32>,
    up: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    forward::<f32, f32>(
        "tilearn_swiglu_forward_f32",
        ffi::tilearn_swiglu_forward_f32,
        stream,
        gate,
        up,
        out,
    )
}

/// `out = bf16(silu(gate) * up)` with the arithmetic in f32 (one rounding).
pub fn swiglu_forward_bf16(
    stream: &Arc<CudaStream>,
    gate: &impl DevicePtr<bf16>,
    up: &impl DevicePtr<bf16>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    forward::<bf16, ffi::tilearn_bf16>(
        "tilearn_swiglu_forward_bf16",
        ffi::tilearn_swiglu_forward_bf16,
        stream,
        gate,
        up,
        out,
    )
}

/// Backward in f32: `dup = dout * silu(g)`, `dgate = dout * up * s * (1 + g * (1 - s))` with
/// `s = sigmoid(g)`; both written (`=`).
pub fn swiglu_backward_f32(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<f32>,
    gate: &impl DevicePtr<f32>,
    up: &impl DevicePtr<f32>,
    dgate: &mut impl DevicePtrMut<f32>,
    dup: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    backward::<f32, f32>(
        "tilearn_swiglu_backward_f32",
        ffi::tilearn_swiglu_backward_f32,
        stream,
        dout,
        gate,
        up,
        dgate,
        dup,
    )
}

/// Backward with bf16 tensors and f32 arithmetic; `dgate`, `dup` written (`=`), rounded once.
pub fn swiglu_backward_bf16(
    stream: &Arc<CudaStream>,
    dout: &impl DevicePtr<bf16>,
    gate: &impl DevicePtr<bf16>,
    up: &impl DevicePtr<bf16>,
    dgate: &mut impl DevicePtrMut<bf16>,
    dup: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    backward::<bf16, ffi::tilearn_bf16>(
        "tilearn_swiglu_backward_bf16",
        ffi::tilearn_swiglu_backward_bf16,
        stream,
        dout,
        gate,
        up,
        dgate,
        dup,
    )
}
