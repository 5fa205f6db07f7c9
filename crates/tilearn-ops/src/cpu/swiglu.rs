//! SwiGLU gate of the Llama MLP: `out = silu(gate) * up`, `silu(g) = g * sigmoid(g)`.
//!
//! Gradient convention: `swiglu_backward` *writes* (`=`) `dgate` and `dup` (activation
//! gradients); this op has no parameters.

use rayon::prelude::*;

use super::Real;
use crate::Result;
use crate::shape::expect_len;

const CHUNK: usize = 1 << 13;

#[inline(always)]
fn sigmoid<R: Real>(g: R) -> R {
    // For very negative g, exp(-g) overflows to +inf and the quotient is a correct 0.
    R::one() / (R::one() + (-g).exp())
}

/// `out = silu(gate) * up`, element-wise; all three slices have the same length.
pub fn swiglu_forward<R: Real>(gate: &[R], up: &[R], out: &mut [R]) -> Result<()> {
    expect_len("swiglu_forward (up)", gate.len(), up.len())?;
    expect_len("swiglu_forward (out)", gate.len(), out.len())?;
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(o, (g, u))| {
            for ((oi, &gi), &ui) in o.iter_mut().zip(g).zip(u) {
                *oi = gi * sigmoid(gi) * ui;
            }
        });
    Ok(())
}

/// `dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))`, `dup = dout * silu(g)`; all
/// five slices have the same length.
pub fn swiglu_backward<R: Real>(
    dout: &[R],
    gate: &[R],
    up: &[R],
    dgate: &mut [R],
    dup: &mut [R],
) -> Result<()> {
    let n = dout.len();
    expect_len("swiglu_backward (gate)", n, gate.len())?;
    expect_len("swiglu_backward (up)", n, up.len())?;
    expect_len("swiglu_backward (dgate)", n, dgate.len())?;
    expect_len("swiglu_backward (dup)", n, dup.len())?;
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .zip(
            dout.par_chunks(CHUNK)
                .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK))),
        )
        .for_each(|((dg, du), (d, (g, u)))| {
            for i in 0..dg.len() {
                let s = sigmoid(g[i]);
                let silu = g[i] * s;
                du[i] = d[i] * silu;
                dg[i] = d[i] * u[i] * s * (R::one() + g[i] * (R::one() - s));
            }
        });
    Ok(())
}
