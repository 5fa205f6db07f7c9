//! The CPU reference ops Bloom adds, in f64, against their definitions:
//! * LayerNorm with bias: the forward's rows have mean 0 and variance 1 before the affine map
//!   (1e-12), and `dx`, `dweight`, `dbias` match central finite differences of
//!   `L = Σ dout ∘ out` (step 1e-6, relative 1e-7 over sampled coordinates; the parameter
//!   gradients accumulate `+=` onto a non-zero start);
//! * tanh-GeLU: the forward matches Bloom's formula evaluated directly (1e-15), the backward
//!   matches finite differences (1e-8), including large |x| where tanh saturates;
//! * linear with bias: `db +=` column sums of `dout` and `y = xWᵀ + b` against finite
//!   differences (the reference the CUDA bias epilogue is tested against).
//!
//! Inputs are seeded random, bounded away from zero; widths are odd (not multiples of any
//! vector width), rows cross the ops' 32-row reduction blocks.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cpu::{
    GELU_TANH_A, GELU_TANH_C, gelu_tanh_backward, gelu_tanh_forward, layernorm_backward,
    layernorm_forward, linear_backward, linear_forward,
};

fn uniform(rng: &mut ChaCha8Rng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let m = rng.random_range(lo..hi);
            if rng.random::<bool>() { m } else { -m }
        })
        .collect()
}

fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w).powi(2)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

/// Central differences of `loss` at `x` in `samples` random coordinates: (indices, values).
fn finite_diff(
    rng: &mut ChaCha8Rng,
    x: &[f64],
    samples: usize,
    loss: impl Fn(&[f64]) -> f64,
) -> (Vec<usize>, Vec<f64>) {
    let h = 1e-6;
    let idx: Vec<usize> = (0..samples).map(|_| rng.random_range(0..x.len())).collect();
    let vals = idx
        .iter()
        .map(|&i| {
            let mut xp = x.to_vec();
            xp[i] += h;
            let up = loss(&xp);
            xp[i] -= 2.0 * h;
            (up - loss(&xp)) / (2.0 * h)
        })
        .collect();
    (idx, vals)
}

const ROWS: usize = 37;
const DIM: usize = 45;
const EPS: f64 = 1e-5;

fn layernorm(x: &[f64], w: &[f64], b: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / DIM;
    let (mut out, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
    layernorm_forward(x, w, b, DIM, EPS, &mut out, &mut mean, &mut rstd).unwrap();
    (out, mean, rstd)
}

#[test]
fn layernorm_forward_normalises_then_applies_weight_and_bias() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    // Rows with a large common offset: the two-pass variance must not cancel.
    let x: Vec<f64> = uniform(&mut rng, ROWS * DIM, 0.1, 2.0)
        .iter()
        .map(|v| v + 300.0)
        .collect();
    let ones = vec![1.0; DIM];
    let zeros = vec![0.0; DIM];
    let (y, mean, rstd) = layernorm(&x, &ones, &zeros);
    for r in 0..ROWS {
        let row = &y[r * DIM..(r + 1) * DIM];
        let m: f64 = row.iter().sum::<f64>() / DIM as f64;
        let var: f64 = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / DIM as f64;
        assert!(m.abs() < 1e-12, "row {r}: mean {m}");
        // var(y) = var / (var + eps): 1 within eps / var.
        let want = 1.0 / (1.0 + EPS * rstd[r] * rstd[r] / (1.0 - EPS * rstd[r] * rstd[r]));
        assert!((var - want).abs() < 1e-12, "row {r}: var {var} vs {want}");
        assert!((mean[r] - 300.0).abs() < 2.0);
    }
    let w = uniform(&mut rng, DIM, 0.5, 1.5);
    let b = uniform(&mut rng, DIM, 0.1, 1.0);
    let (z, _, _) = layernorm(&x, &w, &b);
    let want: Vec<f64> = (0..ROWS * DIM)
        .map(|i| y[i] * w[i % DIM] + b[i % DIM])
        .collect();
    assert!(rel_err(&z, &want) < 1e-14);
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let x = uniform(&mut rng, ROWS * DIM, 0.1, 2.0);
    let w = uniform(&mut rng, DIM, 0.5, 1.5);
    let b = uniform(&mut rng, DIM, 0.1, 1.0);
    let dout = uniform(&mut rng, x.len(), 0.1, 1.0);
    let (_, mean, rstd) = layernorm(&x, &w, &b);
    let mut dx = vec![f64::NAN; x.len()];
    // Accumulation onto a non-zero start.
    let (start_w, start_b) = (
        uniform(&mut rng, DIM, 0.1, 1.0),
        uniform(&mut rng, DIM, 0.1, 1.0),
    );
    let (mut dw, mut db) = (start_w.clone(), start_b.clone());
    layernorm_backward(&dout, &x, &w, &mean, &rstd, DIM, &mut dx, &mut dw, &mut db).unwrap();
    let dw: Vec<f64> = dw.iter().zip(&start_w).map(|(a, s)| a - s).collect();
    let db: Vec<f64> = db.iter().zip(&start_b).map(|(a, s)| a - s).collect();
    let loss = |y: Vec<f64>| y.iter().zip(&dout).map(|(a, b)| a * b).sum::<f64>();
    let (i, num) = finite_diff(&mut rng, &x, 60, |x| loss(layernorm(x, &w, &b).0));
    let ana: Vec<f64> = i.iter().map(|&i| dx[i]).collect();
    assert!(rel_err(&ana, &num) < 1e-7, "dx: {:e}", rel_err(&ana, &num));
    let (i, num) = finite_diff(&mut rng, &w, 20, |w| loss(layernorm(&x, w, &b).0));
    let ana: Vec<f64> = i.iter().map(|&i| dw[i]).collect();
    assert!(
        rel_err(&ana, &num) < 1e-7,
        "dweight: {:e}",
        rel_err(&ana, &num)
    );
    let (i, num) = finite_diff(&mut rng, &b, 20, |b| loss(layernorm(&x, &w, b).0));
    let ana: Vec<f64> = i.iter().map(|&i| db[i]).collect();
    assert!(
        rel_err(&ana, &num) < 1e-7,
        "dbias: {:e}",
        rel_err(&ana, &num)
    );
}

#[test]
fn gelu_tanh_is_blooms_formula_and_its_derivative() {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let mut x = uniform(&mut rng, 501, 0.01, 4.0);
    x.extend([9.0, -9.0, 30.0, -30.0]); // saturated tanh
    let mut y = vec![f64::NAN; x.len()];
    gelu_tanh_forward(&x, &mut y).unwrap();
    let want: Vec<f64> = x
        .iter()
        .map(|&v| v * 0.5 * (1.0 + (GELU_TANH_C * v * (1.0 + GELU_TANH_A * v * v)).tanh()))
        .collect();
    assert!(rel_err(&y, &want) < 1e-15);
    let dout = uniform(&mut rng, x.len(), 0.1, 1.0);
    let mut dx = vec![f64::NAN; x.len()];
    gelu_tanh_backward(&dout, &x, &mut dx).unwrap();
    let loss = |x: &[f64]| {
        let mut y = vec![0.0; x.len()];
        gelu_tanh_forward(x, &mut y).unwrap();
        y.iter().zip(&dout).map(|(a, b)| a * b).sum::<f64>()
    };
    let (i, num) = finite_diff(&mut rng, &x, 80, loss);
    let ana: Vec<f64> = i.iter().map(|&i| dx[i]).collect();
    assert!(
        rel_err(&ana, &num) < 1e-8,
        "gelu dx: {:e}",
        rel_err(&ana, &num)
    );
    // Saturation: gelu'(±30) is 1 and 0.
    assert!((dx[x.len() - 2] / dout[x.len() - 2] - 1.0).abs() < 1e-15);
    assert!(dx[x.len() - 1].abs() < 1e-300);
}

#[test]
fn linear_bias_forward_and_gradient() {
    let mut rng = ChaCha8Rng::seed_from_u64(24);
    let (rows, in_f, out_f) = (37, 19, 23);
    let x = uniform(&mut rng, rows * in_f, 0.1, 1.0);
    let w = uniform(&mut rng, out_f * in_f, 0.1, 1.0);
    let b = uniform(&mut rng, out_f, 0.1, 1.0);
    let fwd = |b: &[f64]| {
        let mut y = vec![0.0; rows * out_f];
        linear_forward(&x, &w, Some(b), rows, in_f, out_f, &mut y).unwrap();
        y
    };
    let mut plain = vec![0.0; rows * out_f];
    linear_forward(&x, &w, None, rows, in_f, out_f, &mut plain).unwrap();
    let with_bias = fwd(&b);
    let want: Vec<f64> = (0..rows * out_f).map(|i| plain[i] + b[i % out_f]).collect();
    assert!(rel_err(&with_bias, &want) < 1e-15);
    let dout = uniform(&mut rng, rows * out_f, 0.1, 1.0);
    let mut dw = vec![0.0; w.len()];
    let start = uniform(&mut rng, out_f, 0.1, 1.0);
    let mut db = start.clone();
    linear_backward(
        &dout,
        &x,
        &w,
        rows,
        in_f,
        out_f,
        None,
        &mut dw,
        Some(&mut db),
    )
    .unwrap();
    let (i, num) = finite_diff(&mut rng, &b, 23, |b| {
        fwd(b).iter().zip(&dout).map(|(a, d)| a * d).sum()
    });
    let ana: Vec<f64> = i.iter().map(|&i| db[i] - start[i]).collect();
    assert!(rel_err(&ana, &num) < 1e-8, "db: {:e}", rel_err(&ana, &num));
}
