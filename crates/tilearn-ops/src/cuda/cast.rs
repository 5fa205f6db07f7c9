//! Wrappers of tilearn-kernels' `cast.cu`: f32 <-> bf16 / f16, element-wise, round to nearest
//! even.

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::{bf16, f16};
use tilearn_kernels::ffi;

use super::launch::Launch;
use crate::Result;

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
    let n = input.len();
    Launch::new(op, stream)
        .input("input", input, n)
        .output("output", output, n)
        .skip_launch_if(n == 0)
        .run(|[input], [output], stream| {
            // SAFETY: the launcher reads `n` elements of `SR` and writes `n` of `DR`, which have
            // the size and bit layout of the buffers' `S` and `D` (asserted above).
            unsafe { launcher(input.cast(), output.cast(), n, stream) }
        })
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
