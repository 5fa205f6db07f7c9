//! Whole-buffer gradient reductions of the optimizer step: the global L2 norm (gradient
//! clipping) and the GradScaler's unscale + non-finite check
//! (`torch._amp_foreach_non_finite_check_and_unscale_`). The oracles of
//! `crates/tilearn-kernels/kernels/reduce.cu`.
//!
//! Deterministic: the norm sums fixed-size chunks in parallel and adds the chunk sums in order,
//! so the result does not depend on the rayon thread count.

use rayon::prelude::*;

use super::Real;

/// Elements per parallel chunk of [`global_norm`] (fixed, so the summation order is too).
const NORM_CHUNK: usize = 1 << 16;

/// `sqrt(sum x[i]²)`, with every square and sum in f64 (for f32 input the squares are exact).
/// Any inf or NaN element makes the result inf or NaN; an empty slice gives 0.
pub fn global_norm<R: Real>(x: &[R]) -> f64 {
    let partials: Vec<f64> = x
        .par_chunks(NORM_CHUNK)
        .map(|chunk| {
            chunk.iter().fold(0.0f64, |acc, &v| {
                let v = v.to_f64();
                acc + v * v
            })
        })
        .collect();
    partials.iter().sum::<f64>().sqrt()
}

/// Multiplies every element in place by `inv_scale` (in f32; non-finite elements too, as
/// PyTorch does) and returns whether any element was inf or NaN before the multiplication.
pub fn unscale_and_check(x: &mut [f32], inv_scale: f32) -> bool {
    x.par_chunks_mut(NORM_CHUNK)
        .map(|chunk| {
            let mut non_finite = false;
            for v in chunk {
                non_finite |= !v.is_finite();
                *v *= inv_scale;
            }
            non_finite
        })
        .reduce(|| false, |a, b| a || b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_of_known_vectors() {
        assert_eq!(global_norm::<f32>(&[]), 0.0);
        assert_eq!(global_norm(&[3.0f32, -4.0]), 5.0);
        // The squares (1e40) overflow f32 but not the f64 accumulation.
        let big = 1e20f32 as f64 * 2f64.sqrt();
        assert!((global_norm(&[1e20f32, 1e20]) - big).abs() <= 1e-15 * big);
        assert!(global_norm(&[1.0f64, f64::NAN]).is_nan());
        assert_eq!(global_norm(&[1.0f32, f32::NEG_INFINITY]), f64::INFINITY);
    }

    #[test]
    fn norm_crosses_chunks_like_a_serial_sum() {
        let x: Vec<f64> = (0..3 * NORM_CHUNK + 17)
            .map(|i| ((i % 7) as f64 - 3.0) * 0.25)
            .collect();
        let serial = x.iter().map(|v| v * v).sum::<f64>().sqrt();
        let got = global_norm(&x);
        assert!((got - serial).abs() <= 1e-12 * serial, "{got} vs {serial}");
    }

    #[test]
    fn unscale_multiplies_and_flags_non_finite() {
        let mut x = vec![2.0f32, -6.0, 0.5, 1e-3];
        assert!(!unscale_and_check(&mut x, 0.5));
        assert_eq!(x, [1.0, -3.0, 0.25, 0.5e-3]);

        let mut x = vec![1.0f32; NORM_CHUNK + 5];
        x[NORM_CHUNK + 3] = f32::INFINITY;
        assert!(unscale_and_check(&mut x, 0.25));
        assert_eq!(x[0], 0.25);
        assert_eq!(x[NORM_CHUNK + 3], f32::INFINITY);

        let mut x = vec![f32::NAN, 4.0];
        assert!(unscale_and_check(&mut x, 0.25));
        assert!(x[0].is_nan());
        assert_eq!(x[1], 1.0);
    }
}
