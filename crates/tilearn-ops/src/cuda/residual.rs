//! Wrappers of tilearn-kernels' `residual.cu`: residual additions, `out = a + b` (forward, a
//! branch joins the stream) and `acc += x` (backward, a branch's input gradient joins the
//! stream's), for every [`DeviceFloat`] (f32, bf16, f16). Same contract as
//! [`crate::cpu::add_inplace`].

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::dtype::DeviceFloat;
use super::launch::Launch;
use crate::Result;

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
    let n = a.len();
    Launch::new("tilearn_residual_add", stream)
        .input("a", a, n)
        .input("b", b, n)
        .output("out", out, n)
        .skip_launch_if(n == 0)
        .run(|[a, b], [out], stream| {
            // SAFETY: the launcher reads `n` elements of T (`T::DTYPE`) from a and b and writes
            // `n` to out.
            unsafe { ffi::tilearn_residual_add(T::DTYPE, a, b, out, n, stream) }
        })
}

/// `acc += x`, element-wise (accumulates); lengths must match. Same precision as
/// [`residual_add`]: `acc = T(f32(acc) + f32(x))`.
pub fn residual_add_inplace<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    acc: &mut impl DevicePtrMut<T>,
    x: &impl DevicePtr<T>,
) -> Result<()> {
    let n = acc.len();
    Launch::new("tilearn_residual_add_inplace", stream)
        .output("acc", acc, n)
        .input("x", x, n)
        .skip_launch_if(n == 0)
        .run(|[x], [acc], stream| {
            // SAFETY: the launcher reads `n` elements of T (`T::DTYPE`) from x and from acc and
            // writes `n` to acc.
            unsafe { ffi::tilearn_residual_add_inplace(T::DTYPE, acc, x, n, stream) }
        })
}
