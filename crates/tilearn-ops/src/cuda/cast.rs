//! Wrappers of `kernels/cast.cu`: f32 <-> bf16 / f16, element-wise, round to nearest even.

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::{bf16, f16};

use super::launch::{bind, check, expect_len, raw_stream, same_device};
use crate::Result;
use tilearn_kernels::ffi;

type CastLauncher<S, D> = unsafe extern "C" fn(*const S, *mut D, usize, ffi::cudaStream_t) -> c_int;

/// Shared body of the four casts. `S`/`D` are the Rust element types, `SR`/`DR` the FFI ones of
/// the same size and bit layout (`half::bf16`/`half::f16` are `#[repr(transparent)]` over `u16`).
fn cast<S, D, SR, DR>(
    op: &'static str,
    launcher: CastLauncher<SR, DR>,
    stream: &Arc<CudaStream>,
    input: &impl DevicePtr<S>,
    output: &mut impl DevicePtrMut<D>,
) -> Result<()> {
    const { assert!(size_of::<S>() == size_of::<SR>() && size_of::<D>() == size_of::<DR>()) };
    expect_len(op, input.len(), output.len())?;
    same_device(stream, op, "input", input)?;
    same_device(stream, op, "output", output)?;
    if input.is_empty() {
        return Ok(());
    }
    bind(stream, op)?;
    let n = input.len();
    // `device_ptr*` make `stream` wait for earlier work on these buffers; the guards record the
    // launch on drop, so later users of the buffers wait for it.
    let (src, _read) = input.device_ptr(stream);
    let (dst, _write) = output.device_ptr_mut(stream);
    // SAFETY: `src` and `dst` are live device allocations of the stream's context (checked
    // above) holding exactly `n` elements of the launcher's types (equal lengths checked above;
    // the FFI types have the same size as the Rust ones). They cannot overlap: `output` is
    // borrowed mutably while `input` is borrowed shared. The launcher only enqueues work on
    // `stream`, and the buffers stay alive until it has run: they are borrowed here, and cudarc
    // frees device memory stream-ordered (or after synchronizing) on drop.
    let status = unsafe { launcher(src as *const SR, dst as *mut DR, n, raw_stream(stream)) };
    check(op, status)
}

/// `output[i] = bf16(input[i])`, round to nearest even. Lengths must match.
pub fn cast_f32_to_bf16(
    stream: &Arc<CudaStream>,
    input: &impl DevicePtr<f32>,
    output: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    cast::<f32, bf16, f32, ffi::tilearn_bf16>(
        "tilearn_cast_f32_to_bf16",
        ffi::tilearn_cast_f32_to_bf16,
        stream,
        input,
        output,
    )
}

/// `output[i] = f16(input[i])`, round to nearest even (overflow to ±inf, subnormals kept).
pub fn cast_f32_to_f16(
    stream: &Arc<CudaStream>,
    input: &impl DevicePtr<f32>,
    output: &mut impl DevicePtrMut<f16>,
) -> Result<()> {
    cast::<f32, f16, f32, ffi::tilearn_f16>(
        "tilearn_cast_f32_to_f16",
        ffi::tilearn_cast_f32_to_f16,
        stream,
        input,
        output,
    )
}

/// `output[i] = f32(input[i])`, exact.
pub fn cast_bf16_to_f32(
    stream: &Arc<CudaStream>,
    input: &impl DevicePtr<bf16>,
    output: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    cast::<bf16, f32, ffi::tilearn_bf16, f32>(
        "tilearn_cast_bf16_to_f32",
        ffi::tilearn_cast_bf16_to_f32,
        stream,
        input,
        output,
    )
}

/// `output[i] = f32(input[i])`, exact.
pub fn cast_f16_to_f32(
    stream: &Arc<CudaStream>,
    input: &impl DevicePtr<f16>,
    output: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    cast::<f16, f32, ffi::tilearn_f16, f32>(
        "tilearn_cast_f16_to_f32",
        ffi::tilearn_cast_f16_to_f32,
        stream,
        input,
        output,
    )
}
