//! LayerNorm with weight and bias as PyTorch's `nn.LayerNorm` (Bloom): per row of `dim`,
//! `y = (x − mean) · rstd · weight + bias` with `rstd = 1 / sqrt(var + eps)` and the biased
//! variance `var = mean((x − mean)²)` (two passes, not `E[x²] − mean²`, which cancels).
//!
//! Gradient convention: `dx` is *written* (`=`); `dweight` and `dbias` are *accumulated*
//! (`+=`). With `xhat = (x − mean) · rstd` and `g = dout · weight`:
//! `dx = rstd · (g − mean(g) − xhat · mean(g · xhat))`, `dweight += Σ_rows dout · xhat`,
//! `dbias += Σ_rows dout`.
//!
//! Determinism: as [`super::rmsnorm`], the parameter gradients are summed per fixed block of
//! rows in parallel, then the blocks in order.

use rayon::prelude::*;

use super::Real;
use super::real::dot;
use crate::Result;
use crate::shape::{expect_len, rows_of};

const ROWS_PER_BLOCK: usize = 32;

/// `x`, `out` are `[rows, dim]`; `weight`, `bias` `[dim]`; `mean` and `rstd` `[rows]` receive
/// each row's mean and `1 / sqrt(var + eps)` for the backward.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<R: Real>(
    x: &[R],
    weight: &[R],
    bias: &[R],
    dim: usize,
    eps: f64,
    out: &mut [R],
    mean: &mut [R],
    rstd: &mut [R],
) -> Result<()> {
    let rows = rows_of("layernorm_forward (x)", x.len(), dim)?;
    expect_len("layernorm_forward (weight)", dim, weight.len())?;
    expect_len("layernorm_forward (bias)", dim, bias.len())?;
    expect_len("layernorm_forward (out)", x.len(), out.len())?;
    expect_len("layernorm_forward (mean)", rows, mean.len())?;
    expect_len("layernorm_forward (rstd)", rows, rstd.len())?;
    let eps = R::from_f64(eps);
    let inv_dim = R::from_f64(1.0 / dim as f64);
    out.par_chunks_mut(dim)
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .zip(x.par_chunks(dim))
        .with_min_len(8)
        .for_each(|((o, (m, r)), xr)| {
            let mu = xr.iter().fold(R::zero(), |s, &v| s + v) * inv_dim;
            let var = xr.iter().fold(R::zero(), |s, &v| s + (v - mu) * (v - mu)) * inv_dim;
            let rs = R::one() / (var + eps).sqrt();
            (*m, *r) = (mu, rs);
            for (((oi, &xi), &wi), &bi) in o.iter_mut().zip(xr).zip(weight).zip(bias) {
                *oi = (xi - mu) * rs * wi + bi;
            }
        });
    Ok(())
}

/// Backward of [`layernorm_forward`] from its saved `mean` and `rstd` (see the module
/// documentation for the formulas): `dx` written, `dweight` and `dbias` accumulated.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<R: Real>(
    dout: &[R],
    x: &[R],
    weight: &[R],
    mean: &[R],
    rstd: &[R],
    dim: usize,
    dx: &mut [R],
    dweight: &mut [R],
    dbias: &mut [R],
) -> Result<()> {
    let rows = rows_of("layernorm_backward (x)", x.len(), dim)?;
    expect_len("layernorm_backward (weight)", dim, weight.len())?;
    expect_len("layernorm_backward (dweight)", dim, dweight.len())?;
    expect_len("layernorm_backward (dbias)", dim, dbias.len())?;
    expect_len("layernorm_backward (dout)", x.len(), dout.len())?;
    expect_len("layernorm_backward (dx)", x.len(), dx.len())?;
    expect_len("layernorm_backward (mean)", rows, mean.len())?;
    expect_len("layernorm_backward (rstd)", rows, rstd.len())?;
    let inv_dim = R::from_f64(1.0 / dim as f64);
    let block = ROWS_PER_BLOCK * dim;
    let partials: Vec<(Vec<R>, Vec<R>)> = dx
        .par_chunks_mut(block)
        .zip(dout.par_chunks(block))
        .zip(x.par_chunks(block))
        .zip(
            mean.par_chunks(ROWS_PER_BLOCK)
                .zip(rstd.par_chunks(ROWS_PER_BLOCK)),
        )
        .map(|(((dxb, db), xb), (mb, rb))| {
            let (mut dw, mut dbi) = (vec![R::zero(); dim], vec![R::zero(); dim]);
            let (mut g, mut xhat) = (vec![R::zero(); dim], vec![R::zero(); dim]);
            for ((((dxr, dr), xr), &m), &r) in dxb
                .chunks_mut(dim)
                .zip(db.chunks(dim))
                .zip(xb.chunks(dim))
                .zip(mb)
                .zip(rb)
            {
                for i in 0..dim {
                    xhat[i] = (xr[i] - m) * r;
                    g[i] = dr[i] * weight[i];
                    dw[i] += dr[i] * xhat[i];
                    dbi[i] += dr[i];
                }
                let mean_g = g.iter().fold(R::zero(), |s, &v| s + v) * inv_dim;
                let mean_gx = dot(&g, &xhat) * inv_dim;
                for i in 0..dim {
                    dxr[i] = r * (g[i] - mean_g - xhat[i] * mean_gx);
                }
            }
            (dw, dbi)
        })
        .collect();
    for (pw, pb) in &partials {
        for (d, &v) in dweight.iter_mut().zip(pw) {
            *d += v;
        }
        for (d, &v) in dbias.iter_mut().zip(pb) {
            *d += v;
        }
    }
    Ok(())
}
