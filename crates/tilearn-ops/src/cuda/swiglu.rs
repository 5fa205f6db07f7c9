//! Wrappers of `kernels/activation.cu`: the SwiGLU gate of the Llama MLP, `out = silu(gate) * up`,
//! forward and backward, for every [`DeviceFloat`] (f32, bf16, f16), always with f32 arithmetic.
//! Same contract as [`crate::cpu::swiglu_forward`] / [`crate::cpu::swiglu_backward`]: `out`,
//! `dgate` and `dup` are written (`=`).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::dtype::DeviceFloat;
use super::launch::{bind, check, expect_len, raw_stream, same_device};
use crate::Result;
use tilearn_kernels::ffi;

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
    let op = "tilearn_swiglu_forward";
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
    // with exactly `n` elements of `T` (checked above; `T::DTYPE` names `T` to the launcher).
    // `out` is borrowed mutably, so it overlaps neither input. The launcher only enqueues work
    // on `stream`; the guards order it after earlier writers and before later users of the
    // buffers.
    let status = unsafe {
        ffi::tilearn_swiglu_forward(
            T::DTYPE,
            g_ptr as *const c_void,
            u_ptr as *const c_void,
            out_ptr as *mut c_void,
            n,
            raw_stream(stream),
        )
    };
    check(op, status)
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
    let op = "tilearn_swiglu_backward";
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
    // with exactly `n` elements of `T` (checked above; `T::DTYPE` names `T`). dgate and dup are
    // borrowed mutably, so they overlap neither each other nor the inputs. Work is enqueued on
    // `stream` only, ordered by the guards.
    let status = unsafe {
        ffi::tilearn_swiglu_backward(
            T::DTYPE,
            dy_ptr as *const c_void,
            g_ptr as *const c_void,
            u_ptr as *const c_void,
            dg_ptr as *mut c_void,
            du_ptr as *mut c_void,
            n,
            raw_stream(stream),
        )
    };
    check(op, status)
}
