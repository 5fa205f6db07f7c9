//! CUDA kernels against the CPU reference, on fresh seeded random inputs (never zeros), at shapes
//! that are not multiples of the block size, with every output buffer poisoned with NaN before
//! the launch (so an element the kernel forgets to write fails the test).
//!
//! Without a GPU or driver (CI, dev machines) each GPU test prints `skipped: <reason>` to stderr
//! and passes; `backend_probe_never_panics` runs everywhere.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::sync::Arc;

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cuda::{self, CudaSlice, CudaStream, DeviceFloat, GpuDevice};
use tilearn_ops::{OpsError, cpu};

/// Writes to the process's stderr directly: libtest captures `eprintln!` of passing tests, and a
/// skip must be visible in the log.
fn report(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Opens GPU 0, or prints why the test is skipped.
fn gpu_or_skip(test: &str) -> Option<GpuDevice> {
    match GpuDevice::new(0) {
        Ok(dev) => Some(dev),
        Err(e) => {
            report(&format!("skipped: {test}: {e}"));
            None
        }
    }
}

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `±(1 + u) · 2^e` with e uniform in `exp`: spans many binades, never zero.
fn wide_f32(rng: &mut ChaCha8Rng, n: usize, exp: std::ops::RangeInclusive<i32>) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let sign = if rng.random::<bool>() { -1.0f64 } else { 1.0 };
            let mant = 1.0 + rng.random::<f64>();
            let e = rng.random_range(exp.clone());
            (sign * mant * 2f64.powi(e)) as f32
        })
        .map(|v| if v == 0.0 { f32::MIN_POSITIVE } else { v })
        .collect()
}

/// Uniform in ±[0.05, 2): bounded away from zero.
fn nonzero_f32(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let m = rng.random_range(0.05f32..2.0);
            if rng.random::<bool>() { m } else { -m }
        })
        .collect()
}

/// Random 16-bit patterns that are neither NaN nor ±0 (NaN payload handling is not part of the
/// contract; zeros could hide an unwritten output).
fn float16_bits(rng: &mut ChaCha8Rng, n: usize, exp_mask: u16, man_mask: u16) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let bits: u16 = rng.random();
        let is_nan = bits & exp_mask == exp_mask && bits & man_mask != 0;
        if !is_nan && bits & 0x7fff != 0 {
            out.push(bits);
        }
    }
    out
}

fn upload<T: cudarc::driver::DeviceRepr>(stream: &Arc<CudaStream>, host: &[T]) -> CudaSlice<T> {
    stream.clone_htod(host).expect("host-to-device copy")
}

fn download<T: cudarc::driver::DeviceRepr>(
    dev: &GpuDevice,
    buf: &impl cudarc::driver::DevicePtr<T>,
) -> Vec<T> {
    dev.synchronize().expect("kernels ran without error");
    dev.stream().clone_dtoh(buf).expect("device-to-host copy")
}

/// ‖got − want‖₂ / ‖want‖₂, failing on any non-finite `got`.
fn rel_err(what: &str, got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} is {} (want {})", got[i], want[i]);
    }
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

/// Exact widening of device elements for the f64 reference.
fn widen<T: DeviceFloat>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| f64::from(x.to_f32())).collect()
}

/// Rounds host f32 values to the device type (nearest even; the identity for f32).
fn narrow<T: DeviceFloat>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

/// `n` NaNs of the device type: an output element the kernel forgets to write stays NaN.
fn poison<T: DeviceFloat>(n: usize) -> Vec<T> {
    vec![T::from_f32(f32::NAN); n]
}

/// Elements whose bits differ (compared through the exact, injective widening to f32).
fn bit_diffs<T: DeviceFloat>(a: &[T], b: &[T]) -> usize {
    assert_eq!(a.len(), b.len(), "bit_diffs: length");
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_f32().to_bits() != y.to_f32().to_bits())
        .count()
}

const CAST_LENGTHS: &[usize] = &[1, 3, 4, 5, 1000, 4099, (1 << 20) + 3];

// ---- casts: exact, bit for bit, against the `half` crate (round to nearest even) ----

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn cast_f32_to_bf16_matches_half_bit_exact() {
    let Some(dev) = gpu_or_skip("cast_f32_to_bf16_matches_half_bit_exact") else {
        return;
    };
    let s = dev.stream();
    let mut rng = rng(1);
    for &n in CAST_LENGTHS {
        // Whole f32 range incl. subnormals and values that round up to ±inf in bf16.
        let host = wide_f32(&mut rng, n + 1, -149..=127);
        let input = upload(s, &host);
        let mut out = upload(s, &vec![bf16::NAN; n + 1]);
        cuda::cast_f32_to_bf16(s, &input, &mut out).unwrap();
        let got = download(&dev, &out);
        for (i, (&x, g)) in host.iter().zip(&got).enumerate() {
            assert_eq!(
                g.to_bits(),
                bf16::from_f32(x).to_bits(),
                "n={n} i={i} x={x:e}"
            );
        }
        // Offset by one element: misaligned for the vector path, exercises the scalar kernel.
        let mut out = upload(s, &vec![bf16::NAN; n + 1]);
        let mut out_view = out.slice_mut(1..);
        cuda::cast_f32_to_bf16(s, &input.slice(1..), &mut out_view).unwrap();
        let got = download(&dev, &out);
        assert!(got[0].is_nan(), "element before the view was written");
        for (i, (&x, g)) in host[1..].iter().zip(&got[1..]).enumerate() {
            assert_eq!(
                g.to_bits(),
                bf16::from_f32(x).to_bits(),
                "offset n={n} i={i}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn cast_f32_to_f16_matches_half_bit_exact() {
    let Some(dev) = gpu_or_skip("cast_f32_to_f16_matches_half_bit_exact") else {
        return;
    };
    let s = dev.stream();
    let mut rng = rng(2);
    for &n in CAST_LENGTHS {
        // f16 subnormals (< 2^-14), underflow to ±0, and overflow past 65504 to ±inf.
        let host = wide_f32(&mut rng, n + 1, -30..=17);
        let input = upload(s, &host);
        let mut out = upload(s, &vec![f16::NAN; n + 1]);
        cuda::cast_f32_to_f16(s, &input, &mut out).unwrap();
        let got = download(&dev, &out);
        for (i, (&x, g)) in host.iter().zip(&got).enumerate() {
            assert_eq!(
                g.to_bits(),
                f16::from_f32(x).to_bits(),
                "n={n} i={i} x={x:e}"
            );
        }
        let mut out = upload(s, &vec![f16::NAN; n + 1]);
        let mut out_view = out.slice_mut(1..);
        cuda::cast_f32_to_f16(s, &input.slice(1..), &mut out_view).unwrap();
        let got = download(&dev, &out);
        assert!(got[0].is_nan(), "element before the view was written");
        for (i, (&x, g)) in host[1..].iter().zip(&got[1..]).enumerate() {
            assert_eq!(
                g.to_bits(),
                f16::from_f32(x).to_bits(),
                "offset n={n} i={i}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn cast_bf16_to_f32_is_exact() {
    let Some(dev) = gpu_or_skip("cast_bf16_to_f32_is_exact") else {
        return;
    };
    let s = dev.stream();
    let mut rng = rng(3);
    for &n in CAST_LENGTHS {
        let host: Vec<bf16> = float16_bits(&mut rng, n + 1, 0x7f80, 0x007f)
            .into_iter()
            .map(bf16::from_bits)
            .collect();
        let input = upload(s, &host);
        let mut out = upload(s, &vec![f32::NAN; n + 1]);
        cuda::cast_bf16_to_f32(s, &input, &mut out).unwrap();
        let got = download(&dev, &out);
        for (i, (x, g)) in host.iter().zip(&got).enumerate() {
            assert_eq!(g.to_bits(), x.to_f32().to_bits(), "n={n} i={i}");
        }
        let mut out = upload(s, &vec![f32::NAN; n + 1]);
        let mut out_view = out.slice_mut(1..);
        cuda::cast_bf16_to_f32(s, &input.slice(1..), &mut out_view).unwrap();
        let got = download(&dev, &out);
        assert!(got[0].is_nan(), "element before the view was written");
        for (i, (x, g)) in host[1..].iter().zip(&got[1..]).enumerate() {
            assert_eq!(g.to_bits(), x.to_f32().to_bits(), "offset n={n} i={i}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn cast_f16_to_f32_is_exact() {
    let Some(dev) = gpu_or_skip("cast_f16_to_f32_is_exact") else {
        return;
    };
    let s = dev.stream();
    let mut rng = rng(4);
    for &n in CAST_LENGTHS {
        let host: Vec<f16> = float16_bits(&mut rng, n + 1, 0x7c00, 0x03ff)
            .into_iter()
            .map(f16::from_bits)
            .collect();
        let input = upload(s, &host);
        let mut out = upload(s, &vec![f32::NAN; n + 1]);
        cuda::cast_f16_to_f32(s, &input, &mut out).unwrap();
        let got = download(&dev, &out);
        for (i, (x, g)) in host.iter().zip(&got).enumerate() {
            assert_eq!(g.to_bits(), x.to_f32().to_bits(), "n={n} i={i}");
        }
        let mut out = upload(s, &vec![f32::NAN; n + 1]);
        let mut out_view = out.slice_mut(1..);
        cuda::cast_f16_to_f32(s, &input.slice(1..), &mut out_view).unwrap();
        let got = download(&dev, &out);
        assert!(got[0].is_nan(), "element before the view was written");
        for (i, (x, g)) in host[1..].iter().zip(&got[1..]).enumerate() {
            assert_eq!(g.to_bits(), x.to_f32().to_bits(), "offset n={n} i={i}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn cast_rejects_length_mismatch() {
    let Some(dev) = gpu_or_skip("cast_rejects_length_mismatch") else {
        return;
    };
    let s = dev.stream();
    let input = upload(s, &[1.0f32; 8]);
    let mut out = upload(s, &[bf16::NAN; 7]);
    let err = cuda::cast_f32_to_bf16(s, &input, &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            OpsError::ShapeMismatch {
                expected: 8,
                actual: 7,
                ..
            }
        ),
        "{err}"
    );
}

// ---- RMSNorm ----

/// (rows, dim): width 768 with 1000 rows, widths that are not multiples of the block size or of
/// 4 (4099, 13, 3), the widest row whose dweight partial the backward keeps in shared memory
/// (12032) and one above it (13000, the global-scratch path), and more rows (1025) than the
/// backward has chunks (512). Not dim 1: there dx is ~eps/x² times its terms, a cancellation no
/// f32 kernel can resolve to 1e-5.
/// Odd and wide rows take the scalar backward; rows of whole 16-byte vectors (≤ 8 per lane)
/// the warp-per-row one: 768 and 2048 (the presets' hidden sizes, 2048 at 8 vectors per lane
/// in bf16/f16 and past the fast path in f32), 1000 (a lane range that ends mid-warp), 64
/// (most lanes idle), with row counts that leave a short last chunk.
const NORM_SHAPES: &[(usize, usize)] = &[
    (1, 3),
    (3, 13),
    (1000, 768),
    (37, 4099),
    (2, 12032),
    (5, 13000),
    (1025, 64),
    (4099, 2048),
    (600, 1000),
    (33, 1024),
];
const EPS: f64 = 1e-6;

/// One backward scratch covering every shape of [`NORM_SHAPES`] (allocated once, as a training
/// loop does).
fn norm_scratch(s: &Arc<CudaStream>) -> cuda::RmsNormScratch {
    let rows = NORM_SHAPES.iter().map(|&(r, _)| r).max().unwrap();
    let dim = NORM_SHAPES.iter().map(|&(_, d)| d).max().unwrap();
    cuda::RmsNormScratch::new(s, rows, dim).expect("allocating the RMSNorm scratch")
}

struct NormCase {
    x: Vec<f32>,
    weight: Vec<f32>,
    dout: Vec<f32>,
    dweight0: Vec<f32>,
}

fn norm_case(seed: u64, rows: usize, dim: usize) -> NormCase {
    let mut rng = rng(seed);
    NormCase {
        x: nonzero_f32(&mut rng, rows * dim),
        weight: nonzero_f32(&mut rng, dim),
        dout: nonzero_f32(&mut rng, rows * dim),
        dweight0: nonzero_f32(&mut rng, dim),
    }
}

/// The CPU reference in f64 on the given (already rounded) inputs: (out, rstd, dx, dweight0 + dw).
fn norm_reference(
    x: &[f64],
    weight: &[f64],
    dout: &[f64],
    dweight0: &[f64],
    dim: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / dim;
    let mut out = vec![f64::NAN; x.len()];
    let mut rstd = vec![f64::NAN; rows];
    cpu::rmsnorm_forward(x, weight, dim, EPS, &mut out, &mut rstd).unwrap();
    let mut dx = vec![f64::NAN; x.len()];
    let mut dweight = dweight0.to_vec();
    cpu::rmsnorm_backward(dout, x, weight, &rstd, dim, &mut dx, &mut dweight).unwrap();
    (out, rstd, dx, dweight)
}

fn check_tol(what: &str, e: f64, tol: f64) {
    report(&format!("{what}: rel err {e:.3e} (tol {tol:e})"));
    assert!(e <= tol, "{what}: rel err {e:e} > {tol:e}");
}

/// Bound on ‖got − want‖₂ / ‖want‖₂ for rstd and dweight: f32 results of f32 arithmetic on
/// inputs the reference sees exactly, whatever the element type (DESIGN's fp32 bound; the
/// kernels accumulate in f32 over at most a few thousand terms, ~1e-7 per term).
const F32_TOL: f64 = 1e-5;

/// The bound for outputs stored in the element type (out, dx, dresid), per type:
/// - f32: [`F32_TOL`].
/// - bf16 (8 significant bits, ≤ 2^-8 = 3.9e-3 relative per rounding): DESIGN's bf16 bound
///   1e-2, which covers the forward's two roundings (≤ 7.8e-3) with room.
/// - f16 (11 significant bits, ≤ 2^-11 = 4.9e-4 relative per rounding): 2e-3, twice the
///   forward's two roundings (≤ 9.8e-4) to leave room for the f32 arithmetic (~1e-6). The
///   per-rounding bound needs normal results: with inputs in ±[0.05, 2), rstd ≤ 1 / 0.05 and
///   |x · rstd| ≤ √dim, so |out| ≥ 0.05 · 0.05 · 0.5 ≈ 1.2e-3 (f16's smallest normal is 6.1e-5)
///   and |out| < 2√13000 ≈ 230, |dx| ≤ rstd · 4 · (1 + √dim) < 4e4 < 65504 even in the worst
///   case (in practice all are O(1)). dx elements that land in f16's subnormals (cancellation)
///   err by at most 2^-25 absolute, nothing next to ‖dx‖.
fn stored_tol<T: DeviceFloat>() -> f64 {
    match T::NAME {
        "f32" => F32_TOL,
        "bf16" => 1e-2,
        "f16" => 2e-3,
        other => panic!("no tolerance for {other}"),
    }
}

/// RMSNorm forward and backward in `T` vs the f64 reference on the same (already rounded)
/// inputs, over [`NORM_SHAPES`]; the forward's output rounds exactly as PyTorch's LlamaRMSNorm
/// (bit for bit against a host emulation); the backward's dx and dweight are bit-identical
/// between two identical launches.
fn check_rmsnorm<T: DeviceFloat>(test: &str, seed: u64) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let mut scratch = norm_scratch(s);
    let tol = stored_tol::<T>();
    for (case_no, &(rows, dim)) in NORM_SHAPES.iter().enumerate() {
        let c = norm_case(seed + case_no as u64, rows, dim);
        let (x_h, w_h, dout_h) = (
            narrow::<T>(&c.x),
            narrow::<T>(&c.weight),
            narrow::<T>(&c.dout),
        );
        let (out_ref, rstd_ref, dx_ref, dw_ref) = norm_reference(
            &widen(&x_h),
            &widen(&w_h),
            &widen(&dout_h),
            &widen(&c.dweight0),
            dim,
        );
        let tag = format!("rmsnorm {} ({rows}x{dim})", T::NAME);

        let x = upload(s, &x_h);
        let w = upload(s, &w_h);
        let mut out = upload(s, &poison::<T>(rows * dim));
        let mut rstd = upload(s, &vec![f32::NAN; rows]);
        cuda::rmsnorm_forward(s, &x, &w, dim, EPS, &mut out, &mut rstd).unwrap();
        let out_h = download(&dev, &out);
        let e = rel_err("out", &widen(&out_h), &out_ref);
        check_tol(&format!("{tag} forward out"), e, tol);
        let rstd_h = download(&dev, &rstd);
        let e = rel_err("rstd", &widen(&rstd_h), &rstd_ref);
        check_tol(&format!("{tag} forward rstd"), e, F32_TOL);
        // The rounding contract, bit for bit from the kernel's own rstd: out = T(w · T(x · rstd))
        // with each product one f32 multiplication (LlamaRMSNorm's cast back to the input dtype
        // before the weight; a single rounding of w · x · rstd would fail here for bf16/f16).
        let emulated: Vec<T> = x_h
            .iter()
            .enumerate()
            .map(|(i, xv)| {
                let normed = T::from_f32(xv.to_f32() * rstd_h[i / dim]).to_f32();
                T::from_f32(w_h[i % dim].to_f32() * normed)
            })
            .collect();
        let diff = bit_diffs(&out_h, &emulated);
        assert_eq!(
            diff,
            0,
            "{tag}: out differs from {0}(w * {0}(x * rstd)) in {diff} elements",
            T::NAME
        );

        let dout = upload(s, &dout_h);
        let mut dx = upload(s, &poison::<T>(rows * dim));
        let mut dweight = upload(s, &c.dweight0);
        cuda::rmsnorm_backward(
            s,
            &dout,
            &x,
            &w,
            &rstd,
            dim,
            &mut dx,
            &mut dweight,
            &mut scratch,
        )
        .unwrap();
        let dx_h = download(&dev, &dx);
        let e = rel_err("dx", &widen(&dx_h), &dx_ref);
        check_tol(&format!("{tag} backward dx"), e, tol);
        let dw = download(&dev, &dweight);
        let e = rel_err("dweight", &widen(&dw), &dw_ref);
        check_tol(&format!("{tag} backward dweight"), e, F32_TOL);

        // Deterministic: the same launch from the same dweight gives the same bits.
        let mut dx2 = upload(s, &poison::<T>(rows * dim));
        let mut dweight2 = upload(s, &c.dweight0);
        cuda::rmsnorm_backward(
            s,
            &dout,
            &x,
            &w,
            &rstd,
            dim,
            &mut dx2,
            &mut dweight2,
            &mut scratch,
        )
        .unwrap();
        assert_eq!(
            bit_diffs(&download(&dev, &dweight2), &dw),
            0,
            "{tag}: dweight differs between identical runs"
        );
        assert_eq!(
            bit_diffs(&download(&dev, &dx2), &dx_h),
            0,
            "{tag}: dx differs between identical runs"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn rmsnorm_f32_matches_cpu_reference() {
    check_rmsnorm::<f32>("rmsnorm_f32_matches_cpu_reference", 100);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn rmsnorm_bf16_matches_cpu_reference() {
    check_rmsnorm::<bf16>("rmsnorm_bf16_matches_cpu_reference", 200);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn rmsnorm_f16_matches_cpu_reference() {
    check_rmsnorm::<f16>("rmsnorm_f16_matches_cpu_reference", 500);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn rmsnorm_rejects_bad_shapes() {
    let Some(dev) = gpu_or_skip("rmsnorm_rejects_bad_shapes") else {
        return;
    };
    let s = dev.stream();
    let x = upload(s, &[1.0f32; 12]);
    let w = upload(s, &[1.0f32; 5]);
    let mut out = upload(s, &[f32::NAN; 12]);
    let mut rstd = upload(s, &[f32::NAN; 3]);
    // weight has 5 elements for dim 4.
    let err = cuda::rmsnorm_forward(s, &x, &w, 4, EPS, &mut out, &mut rstd).unwrap_err();
    assert!(
        matches!(
            err,
            OpsError::ShapeMismatch {
                expected: 4,
                actual: 5,
                ..
            }
        ),
        "{err}"
    );
    // 12 elements are not a whole number of rows of 5.
    let err = cuda::rmsnorm_forward(s, &x, &w, 5, EPS, &mut out, &mut rstd).unwrap_err();
    assert!(matches!(err, OpsError::ShapeMismatch { .. }), "{err}");
    let w4 = upload(s, &[1.0f32; 4]);
    let err = cuda::rmsnorm_forward(s, &x, &w4, 4, -1.0, &mut out, &mut rstd).unwrap_err();
    assert!(matches!(err, OpsError::Cuda { .. }), "{err}");
    assert!(
        download(&dev, &out).iter().all(|v| v.is_nan()),
        "a rejected call wrote output"
    );
}

// ---- RMSNorm fused with the residual add ----

struct AddNormCase {
    x: Vec<f32>,
    y: Vec<f32>,
    weight: Vec<f32>,
    dout: Vec<f32>,
    dresid0: Vec<f32>,
    dweight0: Vec<f32>,
}

fn add_norm_case(seed: u64, rows: usize, dim: usize) -> AddNormCase {
    let mut rng = rng(seed);
    AddNormCase {
        x: nonzero_f32(&mut rng, rows * dim),
        y: nonzero_f32(&mut rng, rows * dim),
        weight: nonzero_f32(&mut rng, dim),
        dout: nonzero_f32(&mut rng, rows * dim),
        dresid0: nonzero_f32(&mut rng, rows * dim),
        dweight0: nonzero_f32(&mut rng, dim),
    }
}

/// The CPU composition in f64 on `h` (the residual sum as the kernel must store it, computed on
/// the host): RMSNorm forward of h, then `dresid0 + dx` and `dweight0 + dw`.
/// Returns (out, rstd, dresid, dweight).
fn add_norm_reference(
    h: &[f64],
    weight: &[f64],
    dout: &[f64],
    dresid0: &[f64],
    dweight0: &[f64],
    dim: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let (out, rstd, dx, dweight) = norm_reference(h, weight, dout, dweight0, dim);
    let mut dresid = dresid0.to_vec();
    cpu::add_inplace(&mut dresid, &dx).unwrap();
    (out, rstd, dresid, dweight)
}

/// The residual-fused kernels in `T` against the f64 composition on the host-rounded residual
/// sum, over [`NORM_SHAPES`]:
/// - the stored residual is `T(x + y)` bit for bit (for bf16 and f16 the f32 sum of two values in
///   ±[0.05, 2) is exact, then one round-to-nearest-even, as `half` does);
/// - out, rstd, dresid, dweight within the tolerances of [`check_rmsnorm`];
/// - the fused forward gives the bits of the unfused RMSNorm forward on the stored residual, and
///   the fused backward the dweight bits of the unfused backward; in f32 the fused dresid also
///   equals the unfused `dx` added on the host bit for bit (for bf16/f16 the fused kernel rounds
///   once where the unfused pair rounds twice, so only the tolerance applies);
/// - the fused backward is bit-identical between identical launches.
fn check_add_rmsnorm<T: DeviceFloat>(test: &str, seed: u64) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let mut scratch = norm_scratch(s);
    let tol = stored_tol::<T>();
    for (case_no, &(rows, dim)) in NORM_SHAPES.iter().enumerate() {
        let c = add_norm_case(seed + case_no as u64, rows, dim);
        let (x_h, y_h, w_h) = (narrow::<T>(&c.x), narrow::<T>(&c.y), narrow::<T>(&c.weight));
        let (dout_h, dresid0_h) = (narrow::<T>(&c.dout), narrow::<T>(&c.dresid0));
        let h_host: Vec<T> = x_h
            .iter()
            .zip(&y_h)
            .map(|(a, b)| T::from_f32(a.to_f32() + b.to_f32()))
            .collect();
        let (out_ref, rstd_ref, dresid_ref, dw_ref) = add_norm_reference(
            &widen(&h_host),
            &widen(&w_h),
            &widen(&dout_h),
            &widen(&dresid0_h),
            &widen(&c.dweight0),
            dim,
        );
        let tag = format!("add_rmsnorm {} ({rows}x{dim})", T::NAME);

        let mut resid = upload(s, &x_h);
        let y = upload(s, &y_h);
        let w = upload(s, &w_h);
        let mut out = upload(s, &poison::<T>(rows * dim));
        let mut rstd = upload(s, &vec![f32::NAN; rows]);
        cuda::add_rmsnorm_forward(s, &mut resid, &y, &w, dim, EPS, &mut out, &mut rstd).unwrap();
        let bad = bit_diffs(&download(&dev, &resid), &h_host);
        assert_eq!(
            bad,
            0,
            "{tag}: stored residual differs from {}(x + y) in {bad} elements",
            T::NAME
        );
        let out_h = download(&dev, &out);
        check_tol(
            &format!("{tag} out"),
            rel_err("out", &widen(&out_h), &out_ref),
            tol,
        );
        let rstd_h = download(&dev, &rstd);
        check_tol(
            &format!("{tag} rstd"),
            rel_err("rstd", &widen(&rstd_h), &rstd_ref),
            F32_TOL,
        );

        // The unfused forward on the stored residual: identical bits.
        let mut out2 = upload(s, &poison::<T>(rows * dim));
        let mut rstd2 = upload(s, &vec![f32::NAN; rows]);
        cuda::rmsnorm_forward(s, &resid, &w, dim, EPS, &mut out2, &mut rstd2).unwrap();
        let diff =
            bit_diffs(&download(&dev, &out2), &out_h) + bit_diffs(&download(&dev, &rstd2), &rstd_h);
        assert_eq!(
            diff, 0,
            "{tag}: fused forward differs from add + rmsnorm_forward in {diff} elements"
        );

        let dout = upload(s, &dout_h);
        let mut dresid = upload(s, &dresid0_h);
        let mut dweight = upload(s, &c.dweight0);
        cuda::rmsnorm_backward_add(
            s,
            &dout,
            &resid,
            &w,
            &rstd,
            dim,
            &mut dresid,
            &mut dweight,
            &mut scratch,
        )
        .unwrap();
        let dres = download(&dev, &dresid);
        check_tol(
            &format!("{tag} dresid"),
            rel_err("dresid", &widen(&dres), &dresid_ref),
            tol,
        );
        let dw = download(&dev, &dweight);
        check_tol(
            &format!("{tag} dweight"),
            rel_err("dweight", &widen(&dw), &dw_ref),
            F32_TOL,
        );

        // The unfused backward: the same dweight bits; in f32, dx added on the host gives the
        // fused dresid bit for bit.
        let mut dx = upload(s, &poison::<T>(rows * dim));
        let mut dweight2 = upload(s, &c.dweight0);
        cuda::rmsnorm_backward(
            s,
            &dout,
            &resid,
            &w,
            &rstd,
            dim,
            &mut dx,
            &mut dweight2,
            &mut scratch,
        )
        .unwrap();
        let dx_h = download(&dev, &dx);
        assert_eq!(
            bit_diffs(&download(&dev, &dweight2), &dw),
            0,
            "{tag}: dweight differs between the fused and unfused backward"
        );
        if T::DTYPE == f32::DTYPE {
            let unfused: Vec<T> = dx_h
                .iter()
                .zip(&dresid0_h)
                .map(|(d, r)| T::from_f32(r.to_f32() + d.to_f32()))
                .collect();
            let diff = bit_diffs(&unfused, &dres);
            assert_eq!(
                diff, 0,
                "{tag}: fused dresid differs from rmsnorm_backward + add in {diff} elements"
            );
        }

        // Deterministic: the same fused launch from the same state gives the same bits.
        let mut dresid3 = upload(s, &dresid0_h);
        let mut dweight3 = upload(s, &c.dweight0);
        cuda::rmsnorm_backward_add(
            s,
            &dout,
            &resid,
            &w,
            &rstd,
            dim,
            &mut dresid3,
            &mut dweight3,
            &mut scratch,
        )
        .unwrap();
        let diff = bit_diffs(&download(&dev, &dresid3), &dres)
            + bit_diffs(&download(&dev, &dweight3), &dw);
        assert_eq!(diff, 0, "{tag}: backward differs between identical runs");
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn add_rmsnorm_f32_matches_cpu_composition() {
    check_add_rmsnorm::<f32>("add_rmsnorm_f32_matches_cpu_composition", 300);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn add_rmsnorm_bf16_matches_cpu_composition() {
    check_add_rmsnorm::<bf16>("add_rmsnorm_bf16_matches_cpu_composition", 400);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn add_rmsnorm_f16_matches_cpu_composition() {
    check_add_rmsnorm::<f16>("add_rmsnorm_f16_matches_cpu_composition", 600);
}

/// Bad shapes and a too-small scratch are typed errors that launch nothing.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn add_rmsnorm_rejects_bad_shapes_and_small_scratch() {
    let Some(dev) = gpu_or_skip("add_rmsnorm_rejects_bad_shapes_and_small_scratch") else {
        return;
    };
    let s = dev.stream();
    let mut resid = upload(s, &[1.5f32; 12]);
    let y_short = upload(s, &[0.5f32; 8]);
    let w = upload(s, &[1.0f32; 4]);
    let mut out = upload(s, &[f32::NAN; 12]);
    let mut rstd = upload(s, &[f32::NAN; 3]);
    let err = cuda::add_rmsnorm_forward(s, &mut resid, &y_short, &w, 4, EPS, &mut out, &mut rstd)
        .unwrap_err();
    assert!(
        matches!(
            err,
            OpsError::ShapeMismatch {
                expected: 12,
                actual: 8,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        download(&dev, &resid).iter().all(|&v| v == 1.5),
        "a rejected call wrote resid"
    );
    assert!(
        download(&dev, &out).iter().all(|v| v.is_nan()),
        "a rejected call wrote out"
    );

    // Scratch for 1 row of width 4 cannot serve 3 rows of width 4.
    let mut small = cuda::RmsNormScratch::new(s, 1, 4).unwrap();
    assert_eq!(small.bytes(), cuda::RmsNormScratch::bytes_for(1, 4));
    let dout = upload(s, &[0.25f32; 12]);
    let x = upload(s, &[1.5f32; 12]);
    let r = upload(s, &[0.5f32; 3]);
    let mut dresid = upload(s, &[2.0f32; 12]);
    let mut dweight = upload(s, &[3.0f32; 4]);
    let err = cuda::rmsnorm_backward_add(
        s,
        &dout,
        &x,
        &w,
        &r,
        4,
        &mut dresid,
        &mut dweight,
        &mut small,
    )
    .unwrap_err();
    assert!(matches!(err, OpsError::Cuda { .. }), "{err}");
    assert!(
        download(&dev, &dresid).iter().all(|&v| v == 2.0),
        "a rejected call wrote dresid"
    );
    assert!(
        download(&dev, &dweight).iter().all(|&v| v == 3.0),
        "a rejected call wrote dweight"
    );
}

/// Host-only (runs everywhere): a scratch sized by `RmsNormScratch::len_for(max_rows, dim)`
/// covers every call with fewer rows, although the per-call need is not monotone in the row
/// count (512 rows use 512 chunks, 513 rows only 257).
#[test]
fn rmsnorm_scratch_len_for_covers_every_smaller_call() {
    // SAFETY: pure host functions of their arguments.
    let need = |rows: usize, dim: usize| unsafe {
        cuda::ffi::tilearn_rmsnorm_backward_scratch_len(rows, dim)
    };
    assert!(
        need(513, 8) < need(512, 8),
        "the per-call need is expected to be non-monotone"
    );
    for &dim in &[1usize, 768, 4099] {
        for &max_rows in &[1usize, 7, 511, 512, 513, 1025, 8192] {
            let bound = cuda::RmsNormScratch::len_for(max_rows, dim);
            let worst = (1..=max_rows).map(|r| need(r, dim)).max().unwrap();
            assert!(
                worst <= bound,
                "max_rows {max_rows} dim {dim}: a call needs {worst} f32, len_for gives {bound}"
            );
            assert_eq!(
                cuda::RmsNormScratch::bytes_for(max_rows, dim),
                bound * 4,
                "bytes_for is len_for in f32 bytes"
            );
        }
    }
}

// ---- backend probe: runs everywhere ----

#[test]
fn backend_probe_never_panics() {
    let info = tilearn_ops::backend::probe();
    assert!(info.cuda_compiled);
    report(&format!("backend probe:\n{info}"));
    if let Err(reason) = &info.cuda_driver {
        assert!(!reason.is_empty());
    }
}
