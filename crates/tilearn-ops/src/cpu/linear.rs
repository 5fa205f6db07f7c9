//! Linear layer `y = x·Wᵀ + b` with `W` stored `[out_features, in_features]` as in PyTorch.
//!
//! Gradient convention: `dx` is *written* (`=`, activation gradient); `dw` and `db` are
//! *accumulated* (`+=`, parameter gradients).
//!
//! Matmuls go through `matrixmultiply` (each output block is computed by one thread, in a fixed
//! order, so results are reproducible). The bias gradient is reduced per column block, each
//! block summing the rows serially in order: deterministic for any thread count.

use rayon::prelude::*;

use super::Real;
use crate::Result;
use crate::shape::{expect_len, expect_product};

/// `out = x·Wᵀ (+ bias)`; `x` is `[rows, in_f]`, `w` `[out_f, in_f]`, `out` `[rows, out_f]`.
#[allow(clippy::too_many_arguments)]
pub fn linear_forward<R: Real>(
    x: &[R],
    w: &[R],
    bias: Option<&[R]>,
    rows: usize,
    in_f: usize,
    out_f: usize,
    out: &mut [R],
) -> Result<()> {
    expect_product("linear_forward (x)", &[rows, in_f], x.len())?;
    expect_product("linear_forward (w)", &[out_f, in_f], w.len())?;
    expect_product("linear_forward (out)", &[rows, out_f], out.len())?;
    if let Some(b) = bias {
        expect_len("linear_forward (bias)", out_f, b.len())?;
    }
    let beta = match bias {
        Some(b) => {
            if out_f > 0 {
                out.par_chunks_mut(out_f)
                    .with_min_len(16)
                    .for_each(|row| row.copy_from_slice(b));
            }
            R::one()
        }
        None => R::zero(),
    };
    // A = x (rows×in_f, row-major), B = Wᵀ (in_f×out_f: B[p][j] = w[j*in_f + p]).
    R::gemm(
        rows,
        in_f,
        out_f,
        R::one(),
        x,
        in_f,
        1,
        w,
        1,
        in_f,
        beta,
        out,
        out_f,
        1,
    );
    Ok(())
}

/// `dx = dout·W` (if requested), `dw += doutᵀ·x`, `db += column sums of dout` (if requested).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<R: Real>(
    dout: &[R],
    x: &[R],
    w: &[R],
    rows: usize,
    in_f: usize,
    out_f: usize,
    dx: Option<&mut [R]>,
    dw: &mut [R],
    db: Option<&mut [R]>,
) -> Result<()> {
    expect_product("linear_backward (dout)", &[rows, out_f], dout.len())?;
    expect_product("linear_backward (x)", &[rows, in_f], x.len())?;
    expect_product("linear_backward (w)", &[out_f, in_f], w.len())?;
    expect_product("linear_backward (dw)", &[out_f, in_f], dw.len())?;
    if let Some(dx) = &dx {
        expect_product("linear_backward (dx)", &[rows, in_f], dx.len())?;
    }
    if let Some(db) = &db {
        expect_len("linear_backward (db)", out_f, db.len())?;
    }
    if let Some(dx) = dx {
        // dx (rows×in_f) = dout (rows×out_f) · W (out_f×in_f).
        R::gemm(
            rows,
            out_f,
            in_f,
            R::one(),
            dout,
            out_f,
            1,
            w,
            in_f,
            1,
            R::zero(),
            dx,
            in_f,
            1,
        );
    }
    // dw (out_f×in_f) += doutᵀ (out_f×rows: A[j][r] = dout[r*out_f + j]) · x (rows×in_f).
    R::gemm(
        out_f,
        rows,
        in_f,
        R::one(),
        dout,
        1,
        out_f,
        x,
        in_f,
        1,
        R::one(),
        dw,
        in_f,
        1,
    );
    if let Some(db) = db {
        const COLS: usize = 64;
        db.par_chunks_mut(COLS).enumerate().for_each(|(ci, dbc)| {
            let j0 = ci * COLS;
            for r in 0..rows {
                let src = &dout[r * out_f + j0..r * out_f + j0 + dbc.len()];
                for (d, &s) in dbc.iter_mut().zip(src) {
                    *d += s;
                }
            }
        });
    }
    Ok(())
}
