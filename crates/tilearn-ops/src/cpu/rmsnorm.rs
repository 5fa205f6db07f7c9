//! RMSNorm as Hugging Face `LlamaRMSNorm`: `y = weight * (x * rsqrt(mean(x^2) + eps))`.
//!
//! Gradient convention: `dx` is *written* (`=`, activation gradient); `dweight` is
//! *accumulated* (`+=`, parameter gradient).
//!
//! Determinism: the weight gradient is reduced per fixed block of `ROWS_PER_BLOCK` rows (in
//! parallel), then the block partials are added into `dweight` serially in block order, so the
//! result does not depend on the number of threads or on scheduling.

use rayon::prelude::*;

use super::Real;
use crate::Result;
use crate::shape::{expect_len, rows_of};

const ROWS_PER_BLOCK: usize = 32;

/// `x`, `out` are `[rows, dim]`; `weight` is `[dim]`; `rstd` is `[rows]` and receives
/// `1 / sqrt(mean(x^2) + eps)` per row for the backward.
pub fn rmsnorm_forward<R: Real>(
    x: &[R],
    weight: &[R],
    dim: usize,
    eps: f64,
    out: &mut [R],
    rstd: &mut [R],
) -> Result<()> {
    let rows = rows_of("rmsnorm_forward (x)", x.len(), dim)?;
    expect_len("rmsnorm_forward (weight)", dim, weight.len())?;
    expect_len("rmsnorm_forward (out)", x.len(), out.len())?;
    expect_len("rmsnorm_forward (rstd)", rows, rstd.len())?;
    let eps = R::from_f64(eps);
    let inv_dim = R::from_f64(1.0 / dim as f64);
    out.par_chunks_mut(dim)
        .zip(rstd.par_iter_mut())
        .zip(x.par_chunks(dim))
        .with_min_len(8)
        .for_each(|((o, r), xr)| {
            let ms = super::real::dot(xr, xr) * inv_dim;
            let rs = R::one() / (ms + eps).sqrt();
            *r = rs;
            for ((oi, &xi), &wi) in o.iter_mut().zip(xr).zip(weight) {
                *oi = wi * (xi * rs);
            }
        });
    Ok(())
}

/// With `g = dout * weight` and `r = rstd`:
/// `dx = r * g - x * r^3 * sum(g * x) / dim`, `dweight += sum over rows of dout * x * r`.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward<R: Real>(
    dout: &[R],
    x: &[R],
    weight: &[R],
    rstd: &[R],
    dim: usize,
    dx: &mut [R],
    dweight: &mut [R],
) -> Result<()> {
    let rows = rows_of("rmsnorm_backward (x)", x.len(), dim)?;
    expect_len("rmsnorm_backward (weight)", dim, weight.len())?;
    expect_len("rmsnorm_backward (dweight)", dim, dweight.len())?;
    expect_len("rmsnorm_backward (dout)", x.len(), dout.len())?;
    expect_len("rmsnorm_backward (dx)", x.len(), dx.len())?;
    expect_len("rmsnorm_backward (rstd)", rows, rstd.len())?;
    let inv_dim = R::from_f64(1.0 / dim as f64);
    let block = ROWS_PER_BLOCK * dim;
    let partials: Vec<Vec<R>> = dx
        .par_chunks_mut(block)
        .zip(dout.par_chunks(block))
        .zip(x.par_chunks(block))
        .zip(rstd.par_chunks(ROWS_PER_BLOCK))
        .map(|(((dxb, db), xb), rb)| {
            let mut dw = vec![R::zero(); dim];
            let mut g = vec![R::zero(); dim];
            for (((dxr, dr), xr), &r) in dxb
                .chunks_mut(dim)
                .zip(db.chunks(dim))
                .zip(xb.chunks(dim))
                .zip(rb)
            {
                for i in 0..dim {
                    g[i] = dr[i] * weight[i];
                    dw[i] += dr[i] * (xr[i] * r);
                }
                let c = super::real::dot(&g, xr) * r * r * r * inv_dim;
                for i in 0..dim {
                    dxr[i] = r * g[i] - c * xr[i];
                }
            }
            dw
        })
        .collect();
    for p in &partials {
        for (d, &v) in dweight.iter_mut().zip(p) {
            *d += v;
        }
    }
    Ok(())
}
