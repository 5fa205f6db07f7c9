//! Bloom's tanh-approximated GeLU (transformers' `bloom_gelu_forward`):
//! `gelu(x) = 0.5 · x · (1 + tanh(C · x · (1 + A · x²)))` with Bloom's constants
//! `C = 0.79788456` (√(2/π) to 8 digits) and `A = 0.044715`.
//!
//! The backward is the exact derivative of that forward:
//! `gelu'(x) = 0.5 · (1 + t) + 0.5 · x · (1 − t²) · (C + 3 · A · C · x²)`, `t = tanh(..)`.
//! (Bloom's `bloom_gelu_back` writes `3·A·C` as 0.1070322243, 6e-10 relative from the
//! product; the exact form is what a finite-difference check can hold us to.)
//!
//! Gradient convention: `dx` is *written* (`=`); no parameters.

use rayon::prelude::*;

use super::Real;
use crate::Result;
use crate::shape::expect_len;

const CHUNK: usize = 1 << 13;

/// Bloom's `C` and `A`.
pub const GELU_TANH_C: f64 = 0.79788456;
pub const GELU_TANH_A: f64 = 0.044715;

#[inline(always)]
fn inner<R: Real>(x: R) -> R {
    R::from_f64(GELU_TANH_C) * x * (R::one() + R::from_f64(GELU_TANH_A) * x * x)
}

/// `out = gelu(x)` element-wise; both slices have the same length.
pub fn gelu_tanh_forward<R: Real>(x: &[R], out: &mut [R]) -> Result<()> {
    expect_len("gelu_tanh_forward (out)", x.len(), out.len())?;
    let half = R::from_f64(0.5);
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, xs)| {
            for (oi, &xi) in o.iter_mut().zip(xs) {
                *oi = half * xi * (R::one() + inner(xi).tanh());
            }
        });
    Ok(())
}

/// `dx = dout · gelu'(x)` element-wise; all three slices have the same length.
pub fn gelu_tanh_backward<R: Real>(dout: &[R], x: &[R], dx: &mut [R]) -> Result<()> {
    expect_len("gelu_tanh_backward (x)", dout.len(), x.len())?;
    expect_len("gelu_tanh_backward (dx)", dout.len(), dx.len())?;
    let half = R::from_f64(0.5);
    let c = R::from_f64(GELU_TANH_C);
    let ac3 = R::from_f64(3.0 * GELU_TANH_A * GELU_TANH_C);
    dx.par_chunks_mut(CHUNK)
        .zip(dout.par_chunks(CHUNK).zip(x.par_chunks(CHUNK)))
        .for_each(|(d, (g, xs))| {
            for ((di, &gi), &xi) in d.iter_mut().zip(g).zip(xs) {
                let t = inner(xi).tanh();
                let sech2 = R::one() - t * t;
                // Where tanh has saturated the second term is exactly 0 (no 0 · inf for huge x).
                let second = if sech2 == R::zero() {
                    R::zero()
                } else {
                    half * xi * sech2 * (c + ac3 * xi * xi)
                };
                let slope = half * (R::one() + t) + second;
                *di = gi * slope;
            }
        });
    Ok(())
}
