//! The scalar trait every CPU op is generic over: `f32` in training, `f64` in the
//! finite-difference tests.
//!
//! It carries exactly what the ops need: arithmetic through the std operator traits, a few
//! math functions, conversions through f64, and a strided `gemm` that dispatches to
//! `matrixmultiply::sgemm` / `dgemm` (row and column strides, so transposes are free).
//! No op in this crate computes a gradient here; see each op's file for its convention.

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

/// A real floating-point scalar (`f32` or `f64`).
pub trait Real:
    Copy
    + Send
    + Sync
    + Debug
    + Default
    + PartialOrd
    + PartialEq
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
{
    fn zero() -> Self;
    fn one() -> Self;
    /// Rounds an f64 to this type (to nearest).
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn abs(self) -> Self;
    /// The larger of the two (NaN-propagation is not specified).
    fn max(self, other: Self) -> Self;
    fn neg_infinity() -> Self;
    fn is_finite(self) -> bool;

    /// `C = alpha * A·B + beta * C` with `A` `m×k`, `B` `k×n`, `C` `m×n`, each given by a
    /// slice and (row, column) strides in elements. When `beta == 0`, `C` is not read.
    ///
    /// Panics if a stride is negative or an addressed element lies outside its slice.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: &[Self],
        rsa: usize,
        csa: usize,
        b: &[Self],
        rsb: usize,
        csb: usize,
        beta: Self,
        c: &mut [Self],
        rsc: usize,
        csc: usize,
    );
}

/// One past the largest index addressed by a `rows×cols` matrix with the given strides.
fn extent(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

#[allow(clippy::too_many_arguments)]
fn check_gemm_bounds(
    m: usize,
    k: usize,
    n: usize,
    a_len: usize,
    (rsa, csa): (usize, usize),
    b_len: usize,
    (rsb, csb): (usize, usize),
    c_len: usize,
    (rsc, csc): (usize, usize),
) {
    assert!(extent(m, k, rsa, csa) <= a_len, "gemm: A out of bounds");
    assert!(extent(k, n, rsb, csb) <= b_len, "gemm: B out of bounds");
    assert!(extent(m, n, rsc, csc) <= c_len, "gemm: C out of bounds");
    // matrixmultiply takes isize strides; refuse anything that would wrap.
    for s in [rsa, csa, rsb, csb, rsc, csc] {
        assert!(s <= isize::MAX as usize, "gemm: stride too large");
    }
}

macro_rules! impl_real {
    ($t:ty, $gemm:path) => {
        impl Real for $t {
            #[inline(always)]
            fn zero() -> Self {
                0.0
            }
            #[inline(always)]
            fn one() -> Self {
                1.0
            }
            #[inline(always)]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                if other > self { other } else { self }
            }
            #[inline(always)]
            fn neg_infinity() -> Self {
                <$t>::NEG_INFINITY
            }
            #[inline(always)]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }

            fn gemm(
                m: usize,
                k: usize,
                n: usize,
                alpha: Self,
                a: &[Self],
                rsa: usize,
                csa: usize,
                b: &[Self],
                rsb: usize,
                csb: usize,
                beta: Self,
                c: &mut [Self],
                rsc: usize,
                csc: usize,
            ) {
                check_gemm_bounds(
                    m,
                    k,
                    n,
                    a.len(),
                    (rsa, csa),
                    b.len(),
                    (rsb, csb),
                    c.len(),
                    (rsc, csc),
                );
                if m == 0 || n == 0 {
                    return;
                }
                // SAFETY: every element addressed through the strides lies inside its slice
                // (checked above), strides fit in isize, and `c` is uniquely borrowed.
                unsafe {
                    $gemm(
                        m,
                        k,
                        n,
                        alpha,
                        a.as_ptr(),
                        rsa as isize,
                        csa as isize,
                        b.as_ptr(),
                        rsb as isize,
                        csb as isize,
                        beta,
                        c.as_mut_ptr(),
                        rsc as isize,
                        csc as isize,
                    );
                }
            }
        }
    };
}

impl_real!(f32, matrixmultiply::sgemm);
impl_real!(f64, matrixmultiply::dgemm);

/// Dot product with eight independent accumulators combined in a fixed order: deterministic,
/// and shaped so the compiler can vectorize it.
#[inline]
pub(crate) fn dot<R: Real>(a: &[R], b: &[R]) -> R {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [R::zero(); 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = R::zero();
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += *x * *y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_transposed_b_matches_naive() {
        // A 2x3, B^T given as W 4x3 (so B = W^T is 3x4).
        let a: Vec<f64> = (0..6).map(|i| i as f64 + 1.0).collect();
        let w: Vec<f64> = (0..12).map(|i| (i as f64) * 0.5 - 2.0).collect();
        let mut c = vec![f64::NAN; 8];
        f64::gemm(2, 3, 4, 1.0, &a, 3, 1, &w, 1, 3, 0.0, &mut c, 4, 1);
        for i in 0..2 {
            for j in 0..4 {
                let want: f64 = (0..3).map(|p| a[i * 3 + p] * w[j * 3 + p]).sum();
                assert_eq!(c[i * 4 + j], want);
            }
        }
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn gemm_rejects_short_slice() {
        let a = [1.0f32; 5];
        let b = [1.0f32; 6];
        let mut c = [0.0f32; 4];
        f32::gemm(2, 3, 2, 1.0, &a, 3, 1, &b, 2, 1, 0.0, &mut c, 2, 1);
    }

    #[test]
    fn dot_matches_serial_sum() {
        let a: Vec<f64> = (0..19).map(|i| i as f64 * 0.25).collect();
        let b: Vec<f64> = (0..19).map(|i| 3.0 - i as f64).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - want).abs() < 1e-12);
    }
}
