//! Wrappers of `kernels/residual.cu`: residual additions, `out = a + b` (forward, a branch joins
//! the stream) and `acc += x` (backward, a branch's input gradient joins the stream's), in f32
//! and in bf16 (f32 add, one rounding). Same contract as [`crate::cpu::add_inplace`].

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::ffi;
use super::launch::{bind, check, expect_len, raw_stream, same_device};
use crate::Result;

type AddLauncher<R> =
    unsafe extern "C" fn(*const R, *const R, *mut R, usize, ffi::cudaStream_t) -> c_int;
type AddInplaceLauncher<R> =
    unsafe extern "C" fn(*mut R, *const R, usize, ffi::cudaStream_t) -> c_int;

/// Shared body of the out-of-place adds. `T` is the Rust element type, `R` the FFI one of the
/// same size and bit layout (`half::bf16` is `#[repr(transparent)]` over `u16`).
fn add<T, R>(
    op: &'static str,
    launcher: AddLauncher<R>,
    stream: &Arc<CudaStream>,
    a: &impl DevicePtr<T>,
    b: &impl DevicePtr<T>,
    out: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
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
    // each holding exactly `n` elements of the launcher's type (lengths checked above; the FFI
    // type has the Rust type's size). `out` is borrowed mutably, so it overlaps neither input.
    // The launcher only enqueues work on `stream`; the `device_ptr*` guards order it after
    // earlier writers and before later users of the buffers, which outlive the call.
    let status = unsafe {
        launcher(
            a_ptr as *const R,
            b_ptr as *const R,
            out_ptr as *mut R,
            n,
            raw_stream(stream),
        )
    };
    check(op, status)
}

/// Shared body of the in-place adds.
fn add_inplace<T, R>(
    op: &'static str,
    launcher: AddInplaceLauncher<R>,
    stream: &Arc<CudaStream>,
    acc: &mut impl DevicePtrMut<T>,
    x: &impl DevicePtr<T>,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
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
    // exactly `n` elements (checked above). `acc` is borrowed mutably, so `x` cannot overlap it.
    // The launcher only enqueues work on `stream`, ordered by the guards as above.
    let status = unsafe { launcher(acc_ptr as *mut R, x_ptr as *const R, n, raw_stream(stream)) };
    check(op, status)
}

/// `out = a + b`, element-wise, in f32. All lengths must match.
pub fn residual_add_f32(
    stream: &Arc<CudaStream>,
    a: &impl DevicePtr<f32>,
    b: &impl DevicePtr<f32>,
    out: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    add::<f32, f32>(
        "tilearn_residual_add_f32",
        ffi::tilearn_residual_add_f32,
        stream,
        a,
        b,
        out,
    )
}

/// `out = bf16(f32(a) + f32(b))`, element-wise (what PyTorch's bf16 add computes).
pub fn residual_add_bf16(
    stream: &Arc<CudaStream>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    add::<bf16, ffi::tilearn_bf16>(
        "tilearn_residual_add_bf16",
        ffi::tilearn_residual_add_bf16,
        stream,
        a,
        b,
        out,
    )
}

/// `acc += x`, element-wise, in f32. Lengths must match.
pub fn residual_add_inplace_f32(
    stream: &Arc<CudaStream>,
    acc: &mut impl DevicePtrMut<f32>,
    x: &impl DevicePtr<f32>,
) -> Result<()> {
    add_inplace::<f32, f32>(
        "tilearn_residual_add_inplace_f32",
        ffi::tilearn_residual_add_inplace_f32,
        stream,
        acc,
        x,
    )
}

/// `acc = bf16(f32(acc) + f32(x))`, element-wise.
pub fn residual_add_inplace_bf16(
    stream: &Arc<CudaStream>,
    acc: &mut impl DevicePtrMut<bf16>,
    x: &impl DevicePtr<bf16>,
) -> Result<()> {
    add_inplace::<bf16, ffi::tilearn_bf16>(
        "tilearn_residual_add_inplace_bf16",
        ffi::tilearn_residual_add_inplace_bf16,
        stream,
        acc,
        x,
    )
}
