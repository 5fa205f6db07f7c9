//! SwiGLU gate of the Llama MLP: `out = silu(gate) * up`, `silu(g) = g * sigmoid(g)`.
//!
//! Gradient convention: `swiglu_backward` *writes* (`=`) `dgate` and `dup` (activation
//! gradients); this op has no parameters.

use rayon::prelude::*;

use super::Real;

const CHUNK: usize = 1 << 13;

#[inline(always)]
fn sigmoid<R: Real>(g: R) -> R {
    // For very negative g, exp(-g) overflows to +inf and the quotient is a correct 0.
    R::one() / (R::one() + (-g).exp())
}

/// `out = silu(gate) * up`, element-wise; all three slices have the same length.
pub fn swiglu_forward<R: Real>(gate: &[R], up: &[R], out: &mut [R]) {
    assert_eq!(gate.len(), up.len(), "swiglu_forward: gate/up length");
    assert_eq!(gate.len(), out.len(), "swiglu_forward: out length");
    out.par_chunks_mut(CHUNK)
        .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
        .for_each(|(o, (g, u))| {
            for ((oi, &gi), &ui) in o.iter_mut().zip(g).zip(u) {
                *oi = gi * sigmoid(gi) * ui;
            }
        });
}

/// `dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))`, `dup = dout * silu(g)`.
pub fn swiglu_backward<R: Real>(dout: &[R], gate: &[R], up: &[R], dgate: &mut [R], dup: &mut [R]) {
    let n = dout.len();
    assert!(
        gate.len() == n && up.len() == n && dgate.len() == n && dup.len() == n,
        "swiglu_backward: all slices must have the same length"
    );
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
}
