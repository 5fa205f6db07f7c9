//! The CUDA row normalisation (`row_normalize.cu`, Baichuan2's NormHead) against the CPU
//! reference, in f32, bf16 and f16 weights, on fresh seeded random inputs bounded away from zero,
//! at a shape that is not a multiple of the block size (1000 rows of 897: one block a row, 256
//! threads, a 129-element tail) plus rows of 5000 (several strides per thread). The reference
//! is the f64 CPU op on the same rounded inputs.
//!
//! Tolerances (relative, ‖got − want‖₂ / ‖want‖₂): the forward rounds each output once to `T`
//! after f32 arithmetic: f32 ≤ 1e-5, bf16 ≤ 1e-2 (2^-8 per rounding), f16 ≤ 2e-3 (2^-11 per
//! rounding; normalised entries are ~1/√cols ≥ 0.013, far above f16's subnormals at 6e-5).
//! The backward's dw is f32 arithmetic whatever `T` (the
//! weights are read exactly): ≤ 1e-5 for every type. The backward accumulates: dw starts from
//! random values, which the test subtracts.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

use std::io::Write;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cpu;
use tilearn_ops::cuda::{self, DeviceFloat, GpuDevice};

fn report(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

fn gpu_or_skip(test: &str) -> Option<GpuDevice> {
    match GpuDevice::new(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            report(&format!("skipped: {test}: {e}"));
            None
        }
    }
}

fn nonzero(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let m = rng.random_range(0.05f32..2.0);
            if rng.random::<bool>() { m } else { -m }
        })
        .collect()
}

fn rel_err(what: &str, got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} is {}", got[i]);
    }
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

fn expect_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    let e = rel_err(what, got, want);
    report(&format!("{what}: rel err {e:.3e} (tol {tol:.0e})"));
    assert!(e <= tol, "{what}: rel err {e:e} > {tol:e}");
}

fn tol<T: DeviceFloat>() -> f64 {
    match T::NAME {
        "f32" => 1e-5,
        "bf16" => 1e-2,
        "f16" => 2e-3,
        other => panic!("no tolerance for {other}"),
    }
}

fn check<T: DeviceFloat>(test: &str) {
    let Some(dev) = gpu_or_skip(test) else { return };
    let stream = dev.stream().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(77 + T::DTYPE as u64);
    for (rows, cols) in [(1000usize, 897usize), (7, 5000)] {
        let w: Vec<T> = nonzero(&mut rng, rows * cols)
            .into_iter()
            .map(T::from_f32)
            .collect();
        let w64: Vec<f64> = w.iter().map(|x| f64::from(x.to_f32())).collect();
        let dout = nonzero(&mut rng, rows * cols);
        let dw0 = nonzero(&mut rng, rows * cols);

        let mut want = vec![0.0f64; rows * cols];
        cpu::row_normalize_forward(&w64, cols, &mut want).unwrap();
        let d64: Vec<f64> = dout.iter().map(|&x| f64::from(x)).collect();
        let mut want_dw = vec![0.0f64; rows * cols];
        cpu::row_normalize_backward(&d64, &w64, cols, &mut want_dw).unwrap();

        let wd = stream.clone_htod(&w).unwrap();
        let mut out = stream
            .clone_htod(&vec![T::from_f32(f32::NAN); rows * cols])
            .unwrap();
        cuda::row_normalize_forward(&stream, &wd, cols, &mut out).unwrap();
        let dd = stream.clone_htod(&dout).unwrap();
        let mut dw = stream.clone_htod(&dw0).unwrap();
        cuda::row_normalize_backward(&stream, &dd, &wd, cols, &mut dw).unwrap();
        dev.synchronize().unwrap();
        let got: Vec<f64> = stream
            .clone_dtoh(&out)
            .unwrap()
            .iter()
            .map(|x| f64::from(x.to_f32()))
            .collect();
        let got_dw: Vec<f64> = stream
            .clone_dtoh(&dw)
            .unwrap()
            .iter()
            .zip(&dw0)
            .map(|(g, s)| f64::from(*g) - f64::from(*s))
            .collect();
        let what = format!("{test} [{rows} x {cols}]");
        expect_close(&format!("{what} forward"), &got, &want, tol::<T>());
        // The f32 difference dw - dw0 loses ~|dw0| * 2^-24 per element against gradients of
        // ~|dout| / |w| ~ 0.03: ~1e-6 relative, inside 1e-5.
        expect_close(&format!("{what} backward"), &got_dw, &want_dw, 1e-5);
    }
    // A length that is not rows x cols is an error, not a launch.
    let w = stream.clone_htod(&vec![T::from_f32(1.0); 10]).unwrap();
    let mut out = stream.clone_htod(&vec![T::from_f32(0.0); 10]).unwrap();
    assert!(cuda::row_normalize_forward(&stream, &w, 3, &mut out).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn row_normalize_f32() {
    check::<f32>("row_normalize::f32");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn row_normalize_bf16() {
    check::<half::bf16>("row_normalize::bf16");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn row_normalize_f16() {
    check::<half::f16>("row_normalize::f16");
}
