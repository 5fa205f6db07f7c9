//! Row L2 normalisation, `out[r] = w[r] / max(‖w[r]‖₂, eps)` with `eps = 1e-12`: PyTorch's
//! `F.normalize(w, dim=-1)`, which Baichuan2's NormHead applies to the lm_head weight before
//! the logits product.
//!
//! Gradient convention: the input is a parameter, so `dw` is *accumulated* (`+=`). With
//! `n = ‖w‖` and `u = w / n`: `dw += (dout − u · (u·dout)) / n` when `n > eps`, and
//! `dw += dout / eps` when the clamp is active (the norm is then a constant).
//!
//! The backward recomputes the norms from `w` (one dot product a row), so the forward leaves
//! nothing but its output behind. Rows are independent: parallel over rows, each row reduced
//! in a fixed order, so results do not depend on the thread count.

use rayon::prelude::*;

use super::Real;
use crate::Result;
use crate::shape::{expect_len, rows_of};

/// The clamp of `F.normalize`'s denominator.
pub const ROW_NORMALIZE_EPS: f64 = 1e-12;

/// `out[r] = w[r] / max(‖w[r]‖, eps)` for the rows of `w` (`[rows, cols]`); `out` written.
pub fn row_normalize_forward<R: Real>(w: &[R], cols: usize, out: &mut [R]) -> Result<()> {
    rows_of("row_normalize_forward (w)", w.len(), cols)?;
    expect_len("row_normalize_forward (out)", w.len(), out.len())?;
    if cols == 0 {
        return Ok(());
    }
    let eps = R::from_f64(ROW_NORMALIZE_EPS);
    out.par_chunks_mut(cols)
        .zip(w.par_chunks(cols))
        .with_min_len(8)
        .for_each(|(o, wr)| {
            let norm = super::real::dot(wr, wr).sqrt();
            let inv = R::one() / if norm > eps { norm } else { eps };
            for (oi, &wi) in o.iter_mut().zip(wr) {
                *oi = wi * inv;
            }
        });
    Ok(())
}

/// Backward of [`row_normalize_forward`]: `dw += d(out)/d(w)ᵀ · dout`, rows of `[rows, cols]`.
pub fn row_normalize_backward<R: Real>(
    dout: &[R],
    w: &[R],
    cols: usize,
    dw: &mut [R],
) -> Result<()> {
    rows_of("row_normalize_backward (w)", w.len(), cols)?;
    expect_len("row_normalize_backward (dout)", w.len(), dout.len())?;
    expect_len("row_normalize_backward (dw)", w.len(), dw.len())?;
    if cols == 0 {
        return Ok(());
    }
    let eps = R::from_f64(ROW_NORMALIZE_EPS);
    dw.par_chunks_mut(cols)
        .zip(w.par_chunks(cols))
        .zip(dout.par_chunks(cols))
        .with_min_len(8)
        .for_each(|((g, wr), dr)| {
            let norm = super::real::dot(wr, wr).sqrt();
            if norm > eps {
                let inv = R::one() / norm;
                // u·dout with u = w / n.
                let proj = super::real::dot(wr, dr) * inv;
                for ((gi, &wi), &di) in g.iter_mut().zip(wr).zip(dr) {
                    *gi += (di - wi * inv * proj) * inv;
                }
            } else {
                let inv = R::one() / eps;
                for (gi, &di) in g.iter_mut().zip(dr) {
                    *gi += di * inv;
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic pseudo-random matrix (no zeros).
    fn random(len: usize, seed: u64) -> Vec<f64> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0 + 1e-3
            })
            .collect()
    }

    #[test]
    fn rows_have_unit_norm_and_keep_their_direction() {
        let (rows, cols) = (5, 7);
        let w = random(rows * cols, 1);
        let mut out = vec![0.0; w.len()];
        row_normalize_forward(&w, cols, &mut out).unwrap();
        for (o, wr) in out.chunks(cols).zip(w.chunks(cols)) {
            let n: f64 = o.iter().map(|x| x * x).sum::<f64>().sqrt();
            assert!((n - 1.0).abs() < 1e-12, "{n}");
            let ratio = o[0] / wr[0];
            assert!(ratio > 0.0);
            for (a, b) in o.iter().zip(wr) {
                assert!((a - b * ratio).abs() < 1e-12);
            }
        }
    }

    /// The backward against central finite differences of `L = Σ out · g` in f64 (relative
    /// error ≤ 1e-6: the differences' truncation error at h = 1e-6 is ~1e-10).
    #[test]
    fn backward_matches_finite_differences() {
        let (rows, cols) = (4, 6);
        let w = random(rows * cols, 2);
        let g = random(rows * cols, 3);
        let loss = |w: &[f64]| -> f64 {
            let mut out = vec![0.0; w.len()];
            row_normalize_forward(w, cols, &mut out).unwrap();
            out.iter().zip(&g).map(|(o, gi)| o * gi).sum()
        };
        // Accumulates: start from a non-zero gradient and subtract it after.
        let start = random(rows * cols, 4);
        let mut dw = start.clone();
        row_normalize_backward(&g, &w, cols, &mut dw).unwrap();
        let h = 1e-6;
        for i in 0..w.len() {
            let (mut wp, mut wm) = (w.clone(), w.clone());
            wp[i] += h;
            wm[i] -= h;
            let fd = (loss(&wp) - loss(&wm)) / (2.0 * h);
            let got = dw[i] - start[i];
            assert!(
                (got - fd).abs() <= 1e-6 * fd.abs().max(1.0),
                "{i}: {got} vs {fd}"
            );
        }
    }

    #[test]
    fn a_zero_row_is_clamped_not_nan() {
        let w = vec![0.0f32; 3];
        let mut out = vec![1.0f32; 3];
        row_normalize_forward(&w, 3, &mut out).unwrap();
        assert_eq!(out, vec![0.0; 3]);
        let mut dw = vec![0.0f32; 3];
        row_normalize_backward(&[1e-13, 0.0, -1e-13], &w, 3, &mut dw).unwrap();
        assert!(dw.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut out = vec![0.0f32; 5];
        assert!(row_normalize_forward(&[1.0f32; 6], 3, &mut out).is_err());
        assert!(row_normalize_backward(&[1.0f32; 6], &[1.0f32; 6], 4, &mut [0.0; 6]).is_err());
    }
}
