//! Zipf-like skewed ids, the access pattern of real categorical features (a few hot rows, a
//! long tail): used by the tests, the synthetic data generator and the benchmark.

use rand::Rng;

/// Samples `k` in `[0, n)` with probability roughly proportional to `(k + 1)^-s`, by inverting
/// the continuous power law's CDF (exact Zipf is not needed, only its skew). `s = 0` is
/// uniform; `s` near 1 is the usual CTR skew.
#[derive(Debug, Clone, Copy)]
pub struct Zipf {
    n: f64,
    s: f64,
}

impl Zipf {
    /// `n >= 1` values, exponent `s >= 0`.
    pub fn new(n: usize, s: f64) -> Self {
        assert!(n >= 1 && s >= 0.0, "Zipf needs n >= 1 and s >= 0");
        Zipf { n: n as f64, s }
    }

    pub fn sample(&self, rng: &mut impl Rng) -> u64 {
        let u: f64 = rng.random();
        let x = if (self.s - 1.0).abs() < 1e-9 {
            // s = 1: the CDF is log(x) / log(n + 1).
            ((self.n + 1.0).ln() * u).exp()
        } else {
            let a = 1.0 - self.s;
            (((self.n + 1.0).powf(a) - 1.0) * u + 1.0).powf(1.0 / a)
        };
        ((x.floor() as u64).max(1) - 1).min(self.n as u64 - 1)
    }
}
