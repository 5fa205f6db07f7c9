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
) {
    assert_eq!(x.len(), rows * in_f, "linear_forward: x length");
    assert_eq!(w.len(), out_f * in_f, "linear_forward: w length");
    assert_eq!(out.len(), rows * out_f, "linear_forward: out length");
    let beta = match bias {
        Some(b) => {
            assert_eq!(b.len(), out_f, "linear_forward: bias length");
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
) {
    assert_eq!(dout.len(), rows * out_f, "linear_backward: dout length");
    assert_eq!(x.len(), rows * in_f, "linear_backward: x length");
    assert_eq!(w.len(), out_f * in_f, "linear_backward: w length");
    assert_eq!(dw.len(), out_f * in_f, "linear_backward: dw length");
    if let Some(dx) = dx {
        assert_eq!(dx.len(), rows * in_f, "linear_backward: dx length");
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
        assert_eq!(db.len(), out_f, "linear_backward: db length");
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
}
