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
use tilearn_ops::cuda::{self, CudaSlice, CudaStream, GpuDevice};
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

fn to_f64<T: Copy + Into<f64>>(v: &[T]) -> Vec<f64> {
    v.iter().map(|&x| x.into()).collect()
}

fn bf16_to_f64(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

const CAST_LENGTHS: &[usize] = &[1, 3, 4, 5, 1000, 4099, (1 << 20) + 3];

// ---- casts: exact, bit for bit, against the `half` crate (round to nearest even) ----

#[test]
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
const NORM_SHAPES: &[(usize, usize)] = &[
    (1, 3),
    (3, 13),
    (1000, 768),
    (37, 4099),
    (2, 12032),
    (5, 13000),
    (1025, 64),
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
    cpu::rmsnorm_forward(x, weight, dim, EPS, &mut out, &mut rstd);
    let mut dx = vec![f64::NAN; x.len()];
    let mut dweight = dweight0.to_vec();
    cpu::rmsnorm_backward(dout, x, weight, &rstd, dim, &mut dx, &mut dweight);
    (out, rstd, dx, dweight)
}

/// f32 kernels vs the f64 reference: ≤ 1e-5 relative (DESIGN's fp32 bound; the kernels
/// accumulate in f32 over at most a few thousand terms, ~1e-7 per term).
#[test]
fn rmsnorm_f32_matches_cpu_reference() {
    let Some(dev) = gpu_or_skip("rmsnorm_f32_matches_cpu_reference") else {
        return;
    };
    let s = dev.stream();
    let mut scratch = norm_scratch(s);
    for (case_no, &(rows, dim)) in NORM_SHAPES.iter().enumerate() {
        let c = norm_case(100 + case_no as u64, rows, dim);
        let (out_ref, rstd_ref, dx_ref, dw_ref) = norm_reference(
            &to_f64(&c.x),
            &to_f64(&c.weight),
            &to_f64(&c.dout),
            &to_f64(&c.dweight0),
            dim,
        );

        let x = upload(s, &c.x);
        let w = upload(s, &c.weight);
        let mut out = upload(s, &vec![f32::NAN; rows * dim]);
        let mut rstd = upload(s, &vec![f32::NAN; rows]);
        cuda::rmsnorm_forward_f32(s, &x, &w, dim, EPS, &mut out, &mut rstd).unwrap();
        let tol = 1e-5;
        let e = rel_err("out", &to_f64(&download(&dev, &out)), &out_ref);
        assert!(
            e <= tol,
            "rmsnorm forward f32 ({rows}x{dim}): out rel err {e:e} > {tol:e}"
        );
        let e = rel_err("rstd", &to_f64(&download(&dev, &rstd)), &rstd_ref);
        assert!(
            e <= tol,
            "rmsnorm forward f32 ({rows}x{dim}): rstd rel err {e:e} > {tol:e}"
        );

        let dout = upload(s, &c.dout);
        let mut dx = upload(s, &vec![f32::NAN; rows * dim]);
        let mut dweight = upload(s, &c.dweight0);
        cuda::rmsnorm_backward_f32(
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
        let e = rel_err("dx", &to_f64(&download(&dev, &dx)), &dx_ref);
        assert!(
            e <= tol,
            "rmsnorm backward f32 ({rows}x{dim}): dx rel err {e:e} > {tol:e}"
        );
        let dw = download(&dev, &dweight);
        let e = rel_err("dweight", &to_f64(&dw), &dw_ref);
        assert!(
            e <= tol,
            "rmsnorm backward f32 ({rows}x{dim}): dweight rel err {e:e} > {tol:e}"
        );

        // Deterministic: the same launch from the same dweight gives the same bits.
        let mut dweight2 = upload(s, &c.dweight0);
        cuda::rmsnorm_backward_f32(
            s,
            &dout,
            &x,
            &w,
            &rstd,
            dim,
            &mut dx,
            &mut dweight2,
            &mut scratch,
        )
        .unwrap();
        let dw2 = download(&dev, &dweight2);
        assert!(
            dw.iter().zip(&dw2).all(|(a, b)| a.to_bits() == b.to_bits()),
            "rmsnorm backward f32 ({rows}x{dim}): dweight differs between identical runs"
        );
    }
}

/// bf16 kernels vs the f64 reference on the same bf16-rounded inputs. out and dx are stored in
/// bf16 (8 significant bits: ≤ 2^-8 relative per element, twice for the forward's PyTorch-style
/// double rounding), so their bound is DESIGN's bf16 1e-2; rstd and dweight are f32 results of
/// f32 arithmetic on exact inputs, so they keep the fp32 bound 1e-5.
#[test]
fn rmsnorm_bf16_matches_cpu_reference() {
    let Some(dev) = gpu_or_skip("rmsnorm_bf16_matches_cpu_reference") else {
        return;
    };
    let s = dev.stream();
    let mut scratch = norm_scratch(s);
    for (case_no, &(rows, dim)) in NORM_SHAPES.iter().enumerate() {
        let c = norm_case(200 + case_no as u64, rows, dim);
        let round = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
        let (x_h, w_h, dout_h) = (round(&c.x), round(&c.weight), round(&c.dout));
        let (out_ref, rstd_ref, dx_ref, dw_ref) = norm_reference(
            &bf16_to_f64(&x_h),
            &bf16_to_f64(&w_h),
            &bf16_to_f64(&dout_h),
            &to_f64(&c.dweight0),
            dim,
        );

        let x = upload(s, &x_h);
        let w = upload(s, &w_h);
        let mut out = upload(s, &vec![bf16::NAN; rows * dim]);
        let mut rstd = upload(s, &vec![f32::NAN; rows]);
        cuda::rmsnorm_forward_bf16(s, &x, &w, dim, EPS, &mut out, &mut rstd).unwrap();
        let e = rel_err("out", &bf16_to_f64(&download(&dev, &out)), &out_ref);
        assert!(
            e <= 1e-2,
            "rmsnorm forward bf16 ({rows}x{dim}): out rel err {e:e} > 1e-2"
        );
        let e = rel_err("rstd", &to_f64(&download(&dev, &rstd)), &rstd_ref);
        assert!(
            e <= 1e-5,
            "rmsnorm forward bf16 ({rows}x{dim}): rstd rel err {e:e} > 1e-5"
        );

        let dout = upload(s, &dout_h);
        let mut dx = upload(s, &vec![bf16::NAN; rows * dim]);
        let mut dweight = upload(s, &c.dweight0);
        cuda::rmsnorm_backward_bf16(
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
        let e = rel_err("dx", &bf16_to_f64(&download(&dev, &dx)), &dx_ref);
        assert!(
            e <= 1e-2,
            "rmsnorm backward bf16 ({rows}x{dim}): dx rel err {e:e} > 1e-2"
        );
        let e = rel_err("dweight", &to_f64(&download(&dev, &dweight)), &dw_ref);
        assert!(
            e <= 1e-5,
            "rmsnorm backward bf16 ({rows}x{dim}): dweight rel err {e:e} > 1e-5"
        );
    }
}

#[test]
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
    let err = cuda::rmsnorm_forward_f32(s, &x, &w, 4, EPS, &mut out, &mut rstd).unwrap_err();
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
    let err = cuda::rmsnorm_forward_f32(s, &x, &w, 5, EPS, &mut out, &mut rstd).unwrap_err();
    assert!(matches!(err, OpsError::ShapeMismatch { .. }), "{err}");
    let w4 = upload(s, &[1.0f32; 4]);
    let err = cuda::rmsnorm_forward_f32(s, &x, &w4, 4, -1.0, &mut out, &mut rstd).unwrap_err();
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
    cpu::add_inplace(&mut dresid, &dx);
    (out, rstd, dresid, dweight)
}

fn check_tol(what: &str, e: f64, tol: f64) {
    report(&format!("{what}: rel err {e:.3e} (tol {tol:e})"));
    assert!(e <= tol, "{what}: rel err {e:e} > {tol:e}");
}

/// f32: the stored residual sum is bit-exact (`x + y` in f32); out, rstd, dresid, dweight
/// within 1e-5 of the f64 composition (as the unfused kernels); and the fused kernels give the
/// same bits as the unfused sequence they replace (residual add + RMSNorm forward; RMSNorm
/// backward + residual add), so swapping them into the engine changes no f32 result.
#[test]
fn add_rmsnorm_f32_matches_cpu_composition() {
    let Some(dev) = gpu_or_skip("add_rmsnorm_f32_matches_cpu_composition") else {
        return;
    };
    let s = dev.stream();
    let mut scratch = norm_scratch(s);
    for (case_no, &(rows, dim)) in NORM_SHAPES.iter().enumerate() {
        let c = add_norm_case(300 + case_no as u64, rows, dim);
        let h_host: Vec<f32> = c.x.iter().zip(&c.y).map(|(a, b)| a + b).collect();
        let (out_ref, rstd_ref, dresid_ref, dw_ref) = add_norm_reference(
            &to_f64(&h_host),
            &to_f64(&c.weight),
            &to_f64(&c.dout),
            &to_f64(&c.dresid0),
            &to_f64(&c.dweight0),
            dim,
        );
        let tag = format!("add_rmsnorm f32 ({rows}x{dim})");

        let mut resid = upload(s, &c.x);
        let y = upload(s, &c.y);
        let w = upload(s, &c.weight);
        let mut out = upload(s, &vec![f32::NAN; rows * dim]);
        let mut rstd = upload(s, &vec![f32::NAN; rows]);
        cuda::add_rmsnorm_forward_f32(s, &mut resid, &y, &w, dim, EPS, &mut out, &mut rstd)
            .unwrap();
        let h = download(&dev, &resid);
        let bad = h
            .iter()
            .zip(&h_host)
            .filter(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(bad.count(), 0, "{tag}: stored residual differs from x + y");
        let out_h = download(&dev, &out);
        check_tol(
            &format!("{tag} out"),
            rel_err("out", &to_f64(&out_h), &out_ref),
            1e-5,
        );
        let rstd_h = download(&dev, &rstd);
        check_tol(
            &format!("{tag} rstd"),
            rel_err("rstd", &to_f64(&rstd_h), &rstd_ref),
            1e-5,
        );

        // The unfused forward on the same h: identical bits.
        let mut out2 = upload(s, &vec![f32::NAN; rows * dim]);
        let mut rstd2 = upload(s, &vec![f32::NAN; rows]);
        cuda::rmsnorm_forward_f32(s, &resid, &w, dim, EPS, &mut out2, &mut rstd2).unwrap();
        let same = download(&dev, &out2)
            .iter()
            .zip(&out_h)
            .all(|(a, b)| a.to_bits() == b.to_bits())
            && download(&dev, &rstd2)
                .iter()
                .zip(&rstd_h)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{tag}: fused forward differs from add + rmsnorm_forward"
        );

        let dout = upload(s, &c.dout);
        let mut dresid = upload(s, &c.dresid0);
        let mut dweight = upload(s, &c.dweight0);
        cuda::rmsnorm_backward_add_f32(
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
            rel_err("dresid", &to_f64(&dres), &dresid_ref),
            1e-5,
        );
        let dw = download(&dev, &dweight);
        check_tol(
            &format!("{tag} dweight"),
            rel_err("dweight", &to_f64(&dw), &dw_ref),
            1e-5,
        );

        // The unfused backward: dx written, then added on the host in f32: identical bits.
        let mut dx = upload(s, &vec![f32::NAN; rows * dim]);
        let mut dweight2 = upload(s, &c.dweight0);
        cuda::rmsnorm_backward_f32(
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
        let unfused: Vec<f32> = download(&dev, &dx)
            .iter()
            .zip(&c.dresid0)
            .map(|(d, r)| r + d)
            .collect();
        let diff = unfused
            .iter()
            .zip(&dres)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            diff, 0,
            "{tag}: fused dresid differs from rmsnorm_backward + add in {diff} elements"
        );
        let dw2 = download(&dev, &dweight2);
        assert!(
            dw.iter().zip(&dw2).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{tag}: dweight differs between the fused and unfused backward"
        );

        // Deterministic: the same fused launch from the same state gives the same bits.
        let mut dresid3 = upload(s, &c.dresid0);
        let mut dweight3 = upload(s, &c.dweight0);
        cuda::rmsnorm_backward_add_f32(
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
        let same = download(&dev, &dresid3)
            .iter()
            .zip(&dres)
            .all(|(a, b)| a.to_bits() == b.to_bits())
            && download(&dev, &dweight3)
                .iter()
                .zip(&dw)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{tag}: backward differs between identical runs");
    }
}

/// bf16: the stored residual is `bf16(x + y)` bit for bit (the f32 sum of two bf16 values in
/// ±[0.05, 2) is exact, then one round-to-nearest-even, as `half` does); out and dresid are bf16
/// results (DESIGN's bf16 bound 1e-2); rstd and dweight are f32 arithmetic on exact bf16 inputs
/// (1e-5), all against the f64 composition on the rounded h.
#[test]
fn add_rmsnorm_bf16_matches_cpu_composition() {
    let Some(dev) = gpu_or_skip("add_rmsnorm_bf16_matches_cpu_composition") else {
        return;
    };
    let s = dev.stream();
    let mut scratch = norm_scratch(s);
    for (case_no, &(rows, dim)) in NORM_SHAPES.iter().enumerate() {
        let c = add_norm_case(400 + case_no as u64, rows, dim);
        let round = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
        let (x_h, y_h, w_h) = (round(&c.x), round(&c.y), round(&c.weight));
        let (dout_h, dresid0_h) = (round(&c.dout), round(&c.dresid0));
        let h_host: Vec<bf16> = x_h
            .iter()
            .zip(&y_h)
            .map(|(a, b)| bf16::from_f32(a.to_f32() + b.to_f32()))
            .collect();
        let (out_ref, rstd_ref, dresid_ref, dw_ref) = add_norm_reference(
            &bf16_to_f64(&h_host),
            &bf16_to_f64(&w_h),
            &bf16_to_f64(&dout_h),
            &bf16_to_f64(&dresid0_h),
            &to_f64(&c.dweight0),
            dim,
        );
        let tag = format!("add_rmsnorm bf16 ({rows}x{dim})");

        let mut resid = upload(s, &x_h);
        let y = upload(s, &y_h);
        let w = upload(s, &w_h);
        let mut out = upload(s, &vec![bf16::NAN; rows * dim]);
        let mut rstd = upload(s, &vec![f32::NAN; rows]);
        cuda::add_rmsnorm_forward_bf16(s, &mut resid, &y, &w, dim, EPS, &mut out, &mut rstd)
            .unwrap();
        let h = download(&dev, &resid);
        let bad = h
            .iter()
            .zip(&h_host)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            bad, 0,
            "{tag}: stored residual differs from bf16(x + y) in {bad} elements"
        );
        let e = rel_err("out", &bf16_to_f64(&download(&dev, &out)), &out_ref);
        check_tol(&format!("{tag} out"), e, 1e-2);
        let e = rel_err("rstd", &to_f64(&download(&dev, &rstd)), &rstd_ref);
        check_tol(&format!("{tag} rstd"), e, 1e-5);

        let dout = upload(s, &dout_h);
        let mut dresid = upload(s, &dresid0_h);
        let mut dweight = upload(s, &c.dweight0);
        cuda::rmsnorm_backward_add_bf16(
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
        let e = rel_err(
            "dresid",
            &bf16_to_f64(&download(&dev, &dresid)),
            &dresid_ref,
        );
        check_tol(&format!("{tag} dresid"), e, 1e-2);
        let e = rel_err("dweight", &to_f64(&download(&dev, &dweight)), &dw_ref);
        check_tol(&format!("{tag} dweight"), e, 1e-5);
    }
}

/// Bad shapes and a too-small scratch are typed errors that launch nothing.
#[test]
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
    let err =
        cuda::add_rmsnorm_forward_f32(s, &mut resid, &y_short, &w, 4, EPS, &mut out, &mut rstd)
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
    let err = cuda::rmsnorm_backward_add_f32(
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
