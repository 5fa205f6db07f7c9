//! The model's norm, whichever kind the family uses: RMSNorm (weight) or LayerNorm (weight
//! and bias, Bloom), over the flat parameter buffer. The LayerNorm keeps its means next to
//! the `rstd` both kinds save; RMSNorm ignores them.

use std::ops::Range;

use tilearn_ops::cpu::{
    Real, layernorm_backward, layernorm_forward, rmsnorm_backward, rmsnorm_forward,
};

use crate::error::Result;

/// Where one norm's parameters lie: its weight and, for a LayerNorm, its bias.
#[derive(Clone, Copy)]
pub(crate) struct NormAt<'a> {
    pub weight: &'a Range<usize>,
    pub bias: Option<&'a Range<usize>>,
}

/// `out = norm(x)` row by row (`[rows, c]`), saving `rstd` (and, for a LayerNorm, `mean`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_forward<R: Real>(
    at: NormAt<'_>,
    p: &[R],
    x: &[R],
    c: usize,
    eps: f64,
    out: &mut [R],
    mean: &mut [R],
    rstd: &mut [R],
) -> Result<()> {
    let w = &p[at.weight.clone()];
    match at.bias {
        None => rmsnorm_forward(x, w, c, eps, out, rstd)?,
        Some(b) => layernorm_forward(x, w, &p[b.clone()], c, eps, out, mean, rstd)?,
    }
    Ok(())
}

/// Backward of [`norm_forward`]: `dx` written, the weight's (and bias's) gradient added into
/// `g`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_backward<R: Real>(
    at: NormAt<'_>,
    p: &[R],
    g: &mut [R],
    dout: &[R],
    x: &[R],
    mean: &[R],
    rstd: &[R],
    c: usize,
    dx: &mut [R],
) -> Result<()> {
    let w = &p[at.weight.clone()];
    match at.bias {
        None => rmsnorm_backward(dout, x, w, rstd, c, dx, &mut g[at.weight.clone()])?,
        Some(b) => {
            // LayerNorm's weight and bias are separate tensors; split the gradient buffer.
            let (wr, br) = (at.weight.clone(), b.clone());
            let (dw, db) = if wr.end <= br.start {
                let (lo, hi) = g.split_at_mut(br.start);
                (&mut lo[wr], &mut hi[..br.end - br.start])
            } else {
                let (lo, hi) = g.split_at_mut(wr.start);
                let db = &mut lo[br];
                (&mut hi[..wr.end - wr.start], db)
            };
            layernorm_backward(dout, x, w, mean, rstd, c, dx, dw, db)?
        }
    }
    Ok(())
}
