//! Helpers shared by the GPU test files of tilearn-ops that compare kernels against the f64 CPU
//! reference (`gpu_attention_mask.rs`, `gpu_family_ops.rs`): device set-up with the skip
//! message, element types with NaN poison and bit views, seeded random values, transfers, the
//! relative error and its report. Each test file uses a subset.
#![allow(dead_code)]

use std::io::Write;
use std::sync::Arc;

use half::{bf16, f16};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cpu::AttnShape;
use tilearn_ops::cuda::{CudaSlice, CudaStream, DeviceFloat, Gemm, GpuDevice};

/// Writes to stderr directly (libtest captures `eprintln!` of passing tests).
pub fn report(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// The device and a cuBLASLt handle, or `None` after printing `skipped: <test>: <reason>` when
/// there is no GPU or driver. A GPU whose cuBLASLt does not load fails the test.
pub fn gpu_or_skip(test: &str) -> Option<(GpuDevice, Gemm)> {
    let dev = match GpuDevice::new(0) {
        Ok(dev) => dev,
        Err(e) => {
            report(&format!("skipped: {test}: {e}"));
            return None;
        }
    };
    let gemm = Gemm::new(dev.stream())
        .unwrap_or_else(|e| panic!("{test}: a GPU is present but cuBLASLt is not usable: {e}"));
    Some((dev, gemm))
}

/// An element type under test.
pub trait Elem: DeviceFloat + std::fmt::Debug {
    const NAN: Self;
    fn bits(self) -> u32;
    fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
}

impl Elem for f32 {
    const NAN: f32 = f32::NAN;
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl Elem for bf16 {
    const NAN: bf16 = bf16::NAN;
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}

impl Elem for f16 {
    const NAN: f16 = f16::NAN;
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}

/// Values of `T` uniform in ±[lo, hi) (rounded once from f32) and their exact f64 values.
pub fn random<T: Elem>(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> (Vec<T>, Vec<f64>) {
    let v: Vec<T> = (0..n)
        .map(|_| {
            let m = rng.random_range(lo..hi);
            T::from_f32(if rng.random::<bool>() { m } else { -m })
        })
        .collect();
    let f = v.iter().map(|x| x.to_f64()).collect();
    (v, f)
}

pub fn upload<T: cudarc::driver::DeviceRepr>(stream: &Arc<CudaStream>, host: &[T]) -> CudaSlice<T> {
    stream.clone_htod(host).expect("host-to-device copy")
}

pub fn download<T: cudarc::driver::DeviceRepr>(dev: &GpuDevice, buf: &CudaSlice<T>) -> Vec<T> {
    dev.synchronize().expect("kernels ran without error");
    dev.stream().clone_dtoh(buf).expect("device-to-host copy")
}

/// ‖got − want‖₂ / ‖want‖₂ (absolute norm for an all-zero reference), failing on NaN.
pub fn rel_err(what: &str, got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|x| !x.is_finite()) {
        panic!("{what}: element {i} of {} is {}", got.len(), got[i]);
    }
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// Two runs of one bf16 attention problem whose only difference is where their f32 sums round:
/// on Hopper an unmasked flash call runs the wgmma kernels (the forward walks keys in blocks of
/// 128) while a masked or ALiBi call runs the mma.sync ones (blocks of 64). Each run lies ~2-4e-3
/// rms from the exact answer, so `(name, a, b)` pairs of out / dq / dk / dv must agree within
/// 1e-2 of the norm and lse (f32 throughout) within 1e-6. Reports the differences.
pub fn expect_equal_to_rounding(test: &str, label: &str, pairs: &[(&str, &[f64], &[f64])]) {
    let mut line = Vec::new();
    for &(what, a, b) in pairs {
        let tol = if what == "lse" { 1e-6 } else { 1e-2 };
        let err = rel_err(what, a, b);
        assert!(err <= tol, "{test}: {label}: {what}: {err:.2e} > {tol:.0e}");
        line.push(format!("{what} {err:.1e}"));
    }
    report(&format!(
        "{test}: {label}: equal to the rounding ({})",
        line.join(", ")
    ));
}

/// Reports the error against its bound and fails the test above it.
pub fn expect_within(test: &str, what: &str, err: f64, tol: f64) {
    report(&format!(
        "{test}: {what}: rel err {err:.3e} (tol {tol:.0e})"
    ));
    assert!(err <= tol, "{test}: {what}: rel err {err:.3e} > {tol:.0e}");
}

/// The attention shape of a case.
pub fn shape(
    batch: usize,
    seq: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> AttnShape {
    AttnShape {
        batch,
        seq,
        q_heads,
        kv_heads,
        head_dim,
    }
}
