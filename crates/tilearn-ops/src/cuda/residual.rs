//! Wrappers of `kernels/residual.cu`: residual additions, `out = a + b` (forward, a branch joins
//! the stream) and `acc += x` (backward, a branch's input gradient joins the stream's), for every
//! [`DeviceFloat`] (f32, bf16, f16). Same contract as [`crate::cpu::add_inplace`].

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

use super::dtype::DeviceFloat;
use super::launch::{bind, check, expect_len, raw_stream, same_device};
use crate::Result;
use tilearn_kernels::ffi;

/// `out = a + b`, element-wise; all lengths must match and `out` is written (`=`).
///
/// Precision: f32 is one f32 add. bf16 / f16 widen both operands to f32 (exactly), add, and round
/// the sum once to nearest even (what PyTorch's bf16 / f16 add computes; an f16 sum of magnitude
/// 65520 or more, past the largest f16 65504 by half an ulp, becomes ±inf).
pub fn residual_add<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    let op = "tilearn_residual_add";
    expect_len(op, a.len(), b.len())?;
    expect_len(op, a.len(), out.len())?;
    same_device(stream, op, "a", a)?;
    same_device(stream, op, "b", b)?;
    same_device(stream, op, "out", out)?;
    if a.is_empty() {
        return Ok(());
    }
    bind(stream, op)?;
    let n = a.len();
    let (a_ptr, _a) = a.device_ptr(stream);
    let (b_ptr, _b) = b.device_ptr(stream);
    let (out_ptr, _out) = out.device_ptr_mut(stream);
    // SAFETY: the three pointers are live allocations of the stream's context (checked above),
    // each holding exactly `n` elements of `T` (lengths checked above), and `T::DTYPE` names `T`
    // to the launcher. `out` is borrowed mutably, so it overlaps neither input. The launcher only
    // enqueues work on `stream`; the `device_ptr*` guards order it after earlier writers and
    // before later users of the buffers, which outlive the call.
    let status = unsafe {
        ffi::tilearn_residual_add(
            T::DTYPE,
            a_ptr as *const c_void,
            b_ptr as *const c_void,
            out_ptr as *mut c_void,
            n,
            raw_stream(stream),
        )
    };
    check(op, status)
}

/// `acc += x`, element-wise (accumulates); lengths must match. Same precision as
/// [`residual_add`]: `acc = T(f32(acc) + f32(x))`.
pub fn residual_add_inplace<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    acc: &mut impl DevicePtrMut<T>,
    x: &impl DevicePtr<T>,
) -> Result<()> {
    let op = "tilearn_residual_add_inplace";
    expect_len(op, acc.len(), x.len())?;
    same_device(stream, op, "acc", acc)?;
    same_device(stream, op, "x", x)?;
    if x.is_empty() {
        return Ok(());
    }
    bind(stream, op)?;
    let n = x.len();
    let (x_ptr, _x) = x.device_ptr(stream);
    let (acc_ptr, _acc) = acc.device_ptr_mut(stream);
    // SAFETY: both pointers are live allocations of the stream's context (checked above) with
    // exactly `n` elements of `T` (checked above; `T::DTYPE` names `T`). `acc` is borrowed
    // mutably, so `x` cannot overlap it. The launcher only enqueues work on `stream`, ordered by
    // the guards as above.
    let status = unsafe {
        ffi::tilearn_residual_add_inplace(
            T::DTYPE,
            acc_ptr as *mut c_void,
            x_ptr as *const c_void,
            n,
            raw_stream(stream),
        )
    };
    check(op, status)
}
