//! CUDA kernels of embedding.cu, rope.cu, activation.cu (SwiGLU) and residual.cu against the CPU
//! reference, in every device element type (f32, bf16, f16: one generic test body per op,
//! instantiated per type by [`per_type!`] as `<test>::f32`, `<test>::bf16`, `<test>::f16`), on
//! fresh seeded random inputs (never zeros), at shapes that are not multiples of the block or
//! vector sizes (T = 1000, hidden 768, head_dim 64 and 80, vocab 32003, B·T = 4·1000), with
//! output buffers poisoned with NaN and guarded by NaN cells on both sides (an element the kernel
//! forgets, or one it writes past the end, fails the test). Views at an odd element offset take
//! the kernels' misaligned (scalar) paths, lengths that are not a multiple of the vector width
//! their tails.
//!
//! Tolerances (relative, ‖got − want‖₂ / ‖want‖₂ against the reference computed in f64 on the
//! same, already rounded inputs), see [`tol`]: f32 ≤ 1e-5; bf16 ≤ 1e-2; f16 ≤ 2e-3. Where the
//! kernel's arithmetic is exactly defined (residual adds, embedding copy and backward) the test
//! also demands bit equality with the f32 CPU reference, which is the stronger check. Every
//! measured error is printed, pass or fail.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::sync::Arc;

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::OpsError;
use tilearn_ops::cpu::{self, RopeScaling, RopeTable};
use tilearn_ops::cuda::{
    self, CudaSlice, CudaStream, DeviceFloat, GpuDevice, GpuRopeTable, TokenIdCheck,
};

/// Instantiates the generic test body `$body::<T>(name)` once per device type, as the tests
/// `$name::f32`, `$name::bf16` and `$name::f16`.
macro_rules! per_type {
    ($name:ident, $body:ident) => {
        mod $name {
            #[test]
            #[ignore = "needs a CUDA GPU (run with --include-ignored)"]
            fn f32() {
                super::$body::<f32>(concat!(stringify!($name), "::f32"));
            }
            #[test]
            #[ignore = "needs a CUDA GPU (run with --include-ignored)"]
            fn bf16() {
                super::$body::<half::bf16>(concat!(stringify!($name), "::bf16"));
            }
            #[test]
            #[ignore = "needs a CUDA GPU (run with --include-ignored)"]
            fn f16() {
                super::$body::<half::f16>(concat!(stringify!($name), "::f16"));
            }
        }
    };
}

/// Bound on ‖got − want‖₂ / ‖want‖₂ for outputs stored in `T`, against the f64 reference on the
/// same rounded inputs. Each op computes in f32 and rounds each stored value once; the round
/// trip of RoPE (forward then backward) rounds twice, so each bound covers two roundings:
/// - f32: 1e-5 (f32 arithmetic, ~6e-8 per operation, a handful of operations per element).
/// - bf16 (8 significant bits, ≤ 2^-8 ≈ 3.9e-3 relative per rounding to nearest): 1e-2, which
///   also covers the two roundings of the round trip (≤ 7.8e-3).
/// - f16 (11 significant bits, ≤ 2^-11 ≈ 4.9e-4 relative per rounding): 2e-3, twice the two
///   roundings of the round trip (≤ 9.8e-4), the rest for the f32 arithmetic (~1e-6). The
///   per-rounding bound needs results in f16's normal range, which these inputs give: every
///   input is in ±[0.05, 4) (SwiGLU's gate up to 30 and -100), so every output is below 70 in
///   magnitude (SwiGLU: 30 · 2 = 60; RoPE: 2√2; adds: 8), far from 65504. Outputs that fall
///   into f16's subnormals (below 6.1e-5: SwiGLU's saturated tail, e.g. silu(-12) · up) err by
///   at most 3e-8 absolute, nothing next to norms of O(1) elements.
fn tol<T: DeviceFloat>() -> f64 {
    match T::NAME {
        "f32" => 1e-5,
        "bf16" => 1e-2,
        "f16" => 2e-3,
        other => panic!("no tolerance for {other}"),
    }
}

/// f32 results of f32 arithmetic (the embedding's table gradient), whatever `T`.
const F32_TOL: f64 = 1e-5;

/// Cells of NaN kept on each side of an output (8 elements: 16-byte aligned for f32, bf16 and
/// f16, so the view itself stays on the vectorised path).
const GUARD: usize = 8;

/// Writes to the process's stderr directly: libtest captures `eprintln!` of passing tests, and
/// skips and measured errors must be visible in the log.
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

/// A generator per (test case, type): each type gets its own fresh inputs.
fn rng<T: DeviceFloat>(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed + 100_000 * T::DTYPE as u64)
}

/// Uniform in ±[lo, hi): bounded away from zero.
fn nonzero_f32(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let m = rng.random_range(lo..hi);
            if rng.random::<bool>() { m } else { -m }
        })
        .collect()
}

/// Rounds host f32 values to the device type (nearest even; the identity for f32).
fn narrow<T: DeviceFloat>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

/// Exact widening to f32.
fn widen_f32<T: DeviceFloat>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Exact widening to f64, for the f64 reference.
fn widen<T: DeviceFloat>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| f64::from(x.to_f32())).collect()
}

fn nan<T: DeviceFloat>() -> T {
    T::from_f32(f32::NAN)
}

fn is_nan<T: DeviceFloat>(v: T) -> bool {
    v.to_f32().is_nan()
}

fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, host: &[T]) -> CudaSlice<T> {
    stream.clone_htod(host).expect("host-to-device copy")
}

fn download<T: DeviceRepr>(dev: &GpuDevice, buf: &impl DevicePtr<T>) -> Vec<T> {
    dev.synchronize().expect("kernels ran without error");
    dev.stream().clone_dtoh(buf).expect("device-to-host copy")
}

/// ‖got − want‖₂ / ‖want‖₂, failing on any non-finite `got` (an unwritten NaN cell).
fn rel_err(what: &str, got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("{what}: element {i} is {} (want {})", got[i], want[i]);
    }
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den).sqrt()
}

/// Asserts `rel_err <= tol` and prints the measured error either way.
fn expect_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    let e = rel_err(what, got, want);
    report(&format!("{what}: rel err {e:.3e} (tol {tol:.0e})"));
    assert!(e <= tol, "{what}: rel err {e:e} > {tol:e}");
}

/// The bits of a device element, through the exact and injective widening to f32.
fn bits<T: DeviceFloat>(v: T) -> u32 {
    v.to_f32().to_bits()
}

/// Asserts bit equality, naming the first differing element.
fn expect_bits<T: DeviceFloat>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let diffs = got
        .iter()
        .zip(want)
        .filter(|(g, w)| bits(**g) != bits(**w))
        .count();
    if let Some(i) = got.iter().zip(want).position(|(g, w)| bits(*g) != bits(*w)) {
        panic!(
            "{what}: {diffs} of {} elements differ from the reference bits; first at {i}: got {}, want {}",
            got.len(),
            got[i].to_f32(),
            want[i].to_f32()
        );
    }
    report(&format!("{what}: all {} elements bit-identical", got.len()));
}

/// A NaN buffer of `n + 2 * GUARD` elements; the output is its middle `n`.
fn poisoned<T: DeviceFloat>(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<T> {
    upload(stream, &vec![nan::<T>(); n + 2 * GUARD])
}

/// The middle `n` elements of a [`poisoned`] buffer after checking both guards are still NaN.
fn unguard<T: DeviceFloat>(what: &str, all: Vec<T>) -> Vec<T> {
    let n = all.len() - 2 * GUARD;
    assert!(
        all[..GUARD]
            .iter()
            .chain(&all[GUARD + n..])
            .all(|&v| is_nan(v)),
        "{what}: the kernel wrote outside its output"
    );
    all[GUARD..GUARD + n].to_vec()
}

// ---- residual adds: exact (one f32 add, one rounding), checked bit for bit ----

/// Lengths: shorter than one vector, odd, a hidden-768 stream of 4·1000 tokens, plus 3.
const ADD_LENGTHS: &[usize] = &[1, 7, 1001, 4 * 1000 * 768 + 3];

per_type!(residual_add_is_exact, residual_add_is_exact);

/// `out = a + b` and `acc += x` against the f32 CPU reference on the widened inputs, rounded once
/// to `T` (what the kernel defines): bit-identical; and close to the f64 reference.
fn residual_add_is_exact<T: DeviceFloat>(test: &str) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let mut rng = rng::<T>(11);
    for &n in ADD_LENGTHS {
        // offset 0: the vector path; offset 1: misaligned views, the scalar path.
        for offset in [0usize, 1] {
            let a: Vec<T> = narrow(&nonzero_f32(&mut rng, n + offset, 0.05, 4.0));
            let b: Vec<T> = narrow(&nonzero_f32(&mut rng, n + offset, 0.05, 4.0));
            let mut sum = widen_f32(&a[offset..]);
            cpu::add_inplace(&mut sum, &widen_f32(&b[offset..])).unwrap();
            let want: Vec<T> = narrow(&sum);
            let mut want64 = widen(&a[offset..]);
            cpu::add_inplace(&mut want64, &widen(&b[offset..])).unwrap();
            let (da, db) = (upload(s, &a), upload(s, &b));
            let (va, vb) = (da.slice(offset..), db.slice(offset..));

            let mut out = poisoned::<T>(s, n + offset);
            let mut view = out.slice_mut(GUARD + offset..GUARD + offset + n);
            cuda::residual_add(s, &va, &vb, &mut view).unwrap();
            let got = unguard("residual_add", download(&dev, &out));
            assert!(
                got[..offset].iter().all(|&v| is_nan(v)),
                "residual_add wrote the element before its view"
            );
            let got = &got[offset..];
            let what = format!("residual_add::<{}> n={n} offset={offset}", T::NAME);
            expect_bits(&what, got, &want);
            expect_close(&what, &widen(got), &want64, tol::<T>());

            let mut acc = upload(s, &a);
            let mut acc_view = acc.slice_mut(offset..);
            cuda::residual_add_inplace(s, &mut acc_view, &vb).unwrap();
            let got = download(&dev, &acc);
            expect_bits(
                "in-place add: the element before the view",
                &got[..offset],
                &a[..offset],
            );
            let what = format!("residual_add_inplace::<{}> n={n} offset={offset}", T::NAME);
            expect_bits(&what, &got[offset..], &want);
        }
    }
}

/// An f16 sum of magnitude 65520 or more (past the largest f16, 65504, by half an ulp) rounds to
/// ±inf (no saturation), as `f16::from_f32` of the f32 sum does: the GradScaler's non-finite
/// check relies on it. 30000 + 30000 stays finite.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn residual_add_f16_overflows_to_inf() {
    let Some(dev) = gpu_or_skip("residual_add_f16_overflows_to_inf") else {
        return;
    };
    let s = dev.stream();
    // 9 elements: one vector of 8 and a scalar tail, both overflowing; the middle ones do not.
    let a: Vec<half::f16> = narrow(&[
        60000.0, -60000.0, 1.5, 65504.0, 30000.0, -2.0, 0.25, 40000.0, -65504.0,
    ]);
    let b: Vec<half::f16> = narrow(&[
        10000.0, -10000.0, 2.5, 32.0, 30000.0, 1.0, 0.5, 40000.0, -64.0,
    ]);
    let (da, db) = (upload(s, &a), upload(s, &b));
    let mut out = upload(s, &vec![nan::<half::f16>(); a.len()]);
    cuda::residual_add(s, &da, &db, &mut out).unwrap();
    let got = download(&dev, &out);
    let want: Vec<half::f16> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| half::f16::from_f32(x.to_f32() + y.to_f32()))
        .collect();
    for i in [0, 3, 7] {
        assert_eq!(want[i], half::f16::INFINITY, "reference at {i}");
    }
    for i in [1, 8] {
        assert_eq!(want[i], half::f16::NEG_INFINITY, "reference at {i}");
    }
    expect_bits("residual_add::<f16> overflow", &got, &want);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn residual_add_rejects_length_mismatch() {
    let Some(dev) = gpu_or_skip("residual_add_rejects_length_mismatch") else {
        return;
    };
    let s = dev.stream();
    let a = upload(s, &[1.0f32; 8]);
    let b = upload(s, &[1.0f32; 7]);
    let mut out = upload(s, &[f32::NAN; 8]);
    let err = cuda::residual_add(s, &a, &b, &mut out).unwrap_err();
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
    let mut acc = upload(s, &[1.0f32; 8]);
    let err = cuda::residual_add_inplace(s, &mut acc, &b).unwrap_err();
    assert!(matches!(err, OpsError::ShapeMismatch { .. }), "{err}");
    assert!(
        download(&dev, &out).iter().all(|v| v.is_nan()),
        "a rejected call wrote output"
    );
    assert!(
        download(&dev, &acc).iter().all(|&v| v == 1.0),
        "a rejected call wrote acc"
    );
}

/// The Rust wrappers can only pass `T::DTYPE`; the raw launchers must still refuse a code they
/// do not know (cudaErrorInvalidValue) without touching memory.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn launchers_reject_unknown_dtype() {
    let Some(dev) = gpu_or_skip("launchers_reject_unknown_dtype") else {
        return;
    };
    let s = dev.stream();
    let unknown = cuda::ffi::TILEARN_DTYPE_F16 as i32 + 1;
    let a = upload(s, &[1.0f32; 8]);
    let mut out = upload(s, &[f32::NAN; 8]);
    let statuses = {
        let (a_ptr, _a) = a.device_ptr(s);
        let (out_ptr, _out) = out.device_ptr_mut(s);
        let (a_ptr, out_ptr) = (
            a_ptr as *const std::ffi::c_void,
            out_ptr as *mut std::ffi::c_void,
        );
        let stream = s.cu_stream() as cuda::ffi::cudaStream_t;
        // SAFETY: valid device pointers of 8 f32 each on the stream's device; with an unknown
        // dtype the launchers return before reading or writing anything or launching.
        unsafe {
            [
                cuda::ffi::tilearn_residual_add(unknown, a_ptr, a_ptr, out_ptr, 8, stream),
                cuda::ffi::tilearn_residual_add_inplace(unknown, out_ptr, a_ptr, 8, stream),
                cuda::ffi::tilearn_swiglu_forward(unknown, a_ptr, a_ptr, out_ptr, 8, stream),
                cuda::ffi::tilearn_swiglu_backward(
                    unknown, a_ptr, a_ptr, a_ptr, out_ptr, out_ptr, 8, stream,
                ),
            ]
        }
    };
    // cudaErrorInvalidValue is 1 in every CUDA version.
    assert_eq!(statuses, [1; 4], "launcher statuses for dtype {unknown}");
    assert!(
        download(&dev, &out).iter().all(|v| v.is_nan()),
        "a refused launch wrote output"
    );
}

// ---- SwiGLU ----

/// Lengths: below one vector, odd, 1000 × intermediate 2048, 4·1000 × 768 + 5.
const SWIGLU_LENGTHS: &[usize] = &[1, 7, 1000 * 2048, 4 * 1000 * 768 + 5];

/// gate spans the saturated tails of the sigmoid (|g| up to 12, plus ±30 and -100, where
/// e^-g alone would overflow f32), up and dout are moderate. All fit f16.
fn swiglu_inputs(rng: &mut ChaCha8Rng, n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut gate = nonzero_f32(rng, n, 0.05, 12.0);
    for (i, v) in [-100.0f32, 30.0, -30.0].into_iter().enumerate() {
        // Only in longer inputs: alone, silu(-100) ≈ -4e-42 (an f32 subnormal with ~11
        // significant bits) would be the whole norm.
        if n >= 8 {
            gate[n - 1 - i] = v;
        }
    }
    (
        gate,
        nonzero_f32(rng, n, 0.05, 2.0),
        nonzero_f32(rng, n, 0.05, 2.0),
    )
}

fn swiglu_reference(gate: &[f64], up: &[f64], dout: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let n = gate.len();
    let mut out = vec![f64::NAN; n];
    cpu::swiglu_forward(gate, up, &mut out).unwrap();
    let (mut dgate, mut dup) = (vec![f64::NAN; n], vec![f64::NAN; n]);
    cpu::swiglu_backward(dout, gate, up, &mut dgate, &mut dup).unwrap();
    (out, dgate, dup)
}

per_type!(swiglu_matches_cpu_reference, swiglu_matches_cpu_reference);

fn swiglu_matches_cpu_reference<T: DeviceFloat>(test: &str) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let tol = tol::<T>();
    let name = T::NAME;
    for (case, &n) in SWIGLU_LENGTHS.iter().enumerate() {
        // offset 0: the vector path (with an n % width tail); offset 1: the scalar path.
        for offset in [0usize, 1] {
            let mut rng = rng::<T>(300 + 2 * case as u64 + offset as u64);
            let (gate, up, dout) = swiglu_inputs(&mut rng, n + offset);
            let (gate, up, dout): (Vec<T>, Vec<T>, Vec<T>) =
                (narrow(&gate), narrow(&up), narrow(&dout));
            let (out_ref, dg_ref, du_ref) = swiglu_reference(
                &widen(&gate[offset..]),
                &widen(&up[offset..]),
                &widen(&dout[offset..]),
            );
            let (g, u, dy) = (upload(s, &gate), upload(s, &up), upload(s, &dout));
            let (g, u, dy) = (g.slice(offset..), u.slice(offset..), dy.slice(offset..));
            let range = GUARD + offset..GUARD + offset + n;

            let mut out = poisoned::<T>(s, n + offset);
            cuda::swiglu_forward(s, &g, &u, &mut out.slice_mut(range.clone())).unwrap();
            let got = unguard("swiglu out", download(&dev, &out));
            let what = format!("swiglu_forward::<{name}> n={n} offset={offset}: out");
            expect_close(&what, &widen(&got[offset..]), &out_ref, tol);

            let mut dgate = poisoned::<T>(s, n + offset);
            let mut dup = poisoned::<T>(s, n + offset);
            cuda::swiglu_backward(
                s,
                &dy,
                &g,
                &u,
                &mut dgate.slice_mut(range.clone()),
                &mut dup.slice_mut(range),
            )
            .unwrap();
            let got = unguard("swiglu dgate", download(&dev, &dgate));
            let what = format!("swiglu_backward::<{name}> n={n} offset={offset}: dgate");
            expect_close(&what, &widen(&got[offset..]), &dg_ref, tol);
            let got = unguard("swiglu dup", download(&dev, &dup));
            let what = format!("swiglu_backward::<{name}> n={n} offset={offset}: dup");
            expect_close(&what, &widen(&got[offset..]), &du_ref, tol);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn swiglu_rejects_length_mismatch() {
    let Some(dev) = gpu_or_skip("swiglu_rejects_length_mismatch") else {
        return;
    };
    let s = dev.stream();
    let g = upload(s, &[1.0f32; 9]);
    let u = upload(s, &[1.0f32; 9]);
    let mut out = upload(s, &[f32::NAN; 8]);
    let err = cuda::swiglu_forward(s, &g, &u, &mut out).unwrap_err();
    assert!(
        matches!(
            err,
            OpsError::ShapeMismatch {
                expected: 9,
                actual: 8,
                ..
            }
        ),
        "{err}"
    );
    let dy = upload(s, &[1.0f32; 9]);
    let mut dg = upload(s, &[f32::NAN; 9]);
    let mut du = upload(s, &[f32::NAN; 10]);
    let err = cuda::swiglu_backward(s, &dy, &g, &u, &mut dg, &mut du).unwrap_err();
    assert!(matches!(err, OpsError::ShapeMismatch { .. }), "{err}");
    assert!(
        download(&dev, &dg).iter().all(|v| v.is_nan()),
        "a rejected call wrote output"
    );
}

// ---- RoPE ----

struct RopeCase {
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    table_seq: usize,
    scaling: RopeScaling,
}

/// Llama-134m's heads (12 × 64) over T = 1000; TinyLlama-style KV heads (4 × 80) at T = 1000
/// from a longer, Llama-3-scaled table; head_dim 6 and 10 (h = 3, 5: not a multiple of the
/// vector width, the one-pair-per-thread path) with linear scaling; head_dim 128.
fn rope_cases() -> Vec<RopeCase> {
    vec![
        RopeCase {
            batch: 4,
            seq: 1000,
            heads: 12,
            head_dim: 64,
            table_seq: 1000,
            scaling: RopeScaling::None,
        },
        RopeCase {
            batch: 2,
            seq: 1000,
            heads: 4,
            head_dim: 80,
            table_seq: 1024,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 256,
            },
        },
        RopeCase {
            batch: 1,
            seq: 7,
            heads: 3,
            head_dim: 6,
            table_seq: 9,
            scaling: RopeScaling::None,
        },
        RopeCase {
            batch: 3,
            seq: 33,
            heads: 5,
            head_dim: 10,
            table_seq: 33,
            scaling: RopeScaling::Linear { factor: 2.0 },
        },
        RopeCase {
            batch: 2,
            seq: 129,
            heads: 2,
            head_dim: 128,
            table_seq: 200,
            scaling: RopeScaling::None,
        },
    ]
}

impl RopeCase {
    fn len(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }
    fn table(&self) -> RopeTable {
        RopeTable::new(self.head_dim, 10000.0, &self.scaling, self.table_seq, 2048)
    }
    fn name(&self) -> String {
        format!(
            "[B={}, T={}, H={}, D={}] table {}",
            self.batch, self.seq, self.heads, self.head_dim, self.table_seq
        )
    }
}

/// (forward of x, backward of dy) by the CPU reference in f64.
fn rope_reference(c: &RopeCase, table: &RopeTable, x: &[f64], dy: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mut y = x.to_vec();
    cpu::rope_forward(&mut y, c.batch, c.seq, c.heads, c.head_dim, table).unwrap();
    let mut dx = dy.to_vec();
    cpu::rope_backward(&mut dx, c.batch, c.seq, c.heads, c.head_dim, table).unwrap();
    (y, dx)
}

per_type!(rope_matches_cpu_reference, rope_matches_cpu_reference);

/// Forward and backward against the f64 reference, and the round trip (the inverse rotation
/// brings the forward's output back to x, within two roundings).
fn rope_matches_cpu_reference<T: DeviceFloat>(test: &str) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let (tol, name) = (tol::<T>(), T::NAME);
    for (i, c) in rope_cases().iter().enumerate() {
        let table = c.table();
        let gpu_table = GpuRopeTable::upload(s, &table).unwrap();
        let mut rng = rng::<T>(500 + i as u64);
        let x: Vec<T> = narrow(&nonzero_f32(&mut rng, c.len(), 0.05, 2.0));
        let dy: Vec<T> = narrow(&nonzero_f32(&mut rng, c.len(), 0.05, 2.0));
        let (y_ref, dx_ref) = rope_reference(c, &table, &widen(&x), &widen(&dy));

        let mut buf = upload(s, &x);
        cuda::rope_forward(s, &mut buf, c.batch, c.seq, c.heads, c.head_dim, &gpu_table).unwrap();
        let y = download(&dev, &buf);
        let what = format!("rope_forward::<{name}> {}", c.name());
        expect_close(&what, &widen(&y), &y_ref, tol);

        cuda::rope_backward(s, &mut buf, c.batch, c.seq, c.heads, c.head_dim, &gpu_table).unwrap();
        let back = download(&dev, &buf);
        let what = format!("rope::<{name}> round trip {}", c.name());
        expect_close(&what, &widen(&back), &widen(&x), tol);

        let mut grad = upload(s, &dy);
        cuda::rope_backward(
            s, &mut grad, c.batch, c.seq, c.heads, c.head_dim, &gpu_table,
        )
        .unwrap();
        let dx = download(&dev, &grad);
        let what = format!("rope_backward::<{name}> {}", c.name());
        expect_close(&what, &widen(&dx), &dx_ref, tol);
    }
}

per_type!(
    rope_misaligned_view_matches_cpu_reference,
    rope_misaligned_view_matches_cpu_reference
);

/// A view at an odd element offset: the kernel must take its one-pair-per-thread path, and
/// touch nothing outside the view.
fn rope_misaligned_view_matches_cpu_reference<T: DeviceFloat>(test: &str) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let c = RopeCase {
        batch: 2,
        seq: 100,
        heads: 3,
        head_dim: 64,
        table_seq: 100,
        scaling: RopeScaling::None,
    };
    let table = c.table();
    let gpu_table = GpuRopeTable::upload(s, &table).unwrap();
    let mut rng = rng::<T>(700);
    let x: Vec<T> = narrow(&nonzero_f32(&mut rng, c.len() + 2, 0.05, 2.0));
    let inner = widen(&x[1..=c.len()]);
    let (y_ref, dx_ref) = rope_reference(&c, &table, &inner, &inner);
    let mut buf = upload(s, &x);
    let mut view = buf.slice_mut(1..=c.len());
    cuda::rope_forward(
        s, &mut view, c.batch, c.seq, c.heads, c.head_dim, &gpu_table,
    )
    .unwrap();
    let got = download(&dev, &buf);
    expect_bits(
        "rope_forward: the element before the view",
        &got[..1],
        &x[..1],
    );
    expect_bits(
        "rope_forward: the element after the view",
        &got[c.len() + 1..],
        &x[c.len() + 1..],
    );
    let what = format!("rope_forward::<{}> misaligned view", T::NAME);
    expect_close(&what, &widen(&got[1..=c.len()]), &y_ref, tol::<T>());

    let mut buf = upload(s, &x);
    let mut view = buf.slice_mut(1..=c.len());
    cuda::rope_backward(
        s, &mut view, c.batch, c.seq, c.heads, c.head_dim, &gpu_table,
    )
    .unwrap();
    let got = download(&dev, &buf);
    expect_bits(
        "rope_backward: the element before the view",
        &got[..1],
        &x[..1],
    );
    expect_bits(
        "rope_backward: the element after the view",
        &got[c.len() + 1..],
        &x[c.len() + 1..],
    );
    let what = format!("rope_backward::<{}> misaligned view", T::NAME);
    expect_close(&what, &widen(&got[1..=c.len()]), &dx_ref, tol::<T>());
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn rope_rejects_bad_shapes() {
    let Some(dev) = gpu_or_skip("rope_rejects_bad_shapes") else {
        return;
    };
    let s = dev.stream();
    let table =
        GpuRopeTable::upload(s, &RopeTable::new(8, 10000.0, &RopeScaling::None, 10, 2048)).unwrap();
    let original = vec![1.5f32; 2 * 11 * 3 * 8];
    let mut x = upload(s, &original);
    // seq 11 > the table's 10 positions.
    let err = cuda::rope_forward(s, &mut x, 2, 11, 3, 8, &table).unwrap_err();
    assert!(matches!(err, OpsError::Cuda { .. }), "{err}");
    // head_dim 4 does not match the table's 8.
    let err = cuda::rope_forward(s, &mut x, 2, 11, 6, 4, &table).unwrap_err();
    assert!(matches!(err, OpsError::Cuda { .. }), "{err}");
    // x has 2·11·3·8 elements, not 2·10·3·8.
    let err = cuda::rope_forward(s, &mut x, 2, 10, 3, 8, &table).unwrap_err();
    assert!(
        matches!(
            err,
            OpsError::ShapeMismatch {
                expected: 480,
                actual: 528,
                ..
            }
        ),
        "{err}"
    );
    let err = cuda::rope_backward(s, &mut x, 2, 10, 3, 8, &table).unwrap_err();
    assert!(matches!(err, OpsError::ShapeMismatch { .. }), "{err}");
    assert_eq!(download(&dev, &x), original, "a rejected call modified x");
}

// ---- embedding ----

/// Ids with heavy repetition: a quarter are one very hot id, a quarter come from 10 warm ids,
/// the rest are uniform over the vocabulary (so some rows are hit once, most never).
fn token_ids(rng: &mut ChaCha8Rng, rows: usize, vocab: usize) -> Vec<u32> {
    let hot = rng.random_range(0..vocab) as u32;
    let warm: Vec<u32> = (0..10).map(|_| rng.random_range(0..vocab) as u32).collect();
    (0..rows)
        .map(|_| match rng.random_range(0..4) {
            0 => hot,
            1 => warm[rng.random_range(0..warm.len())],
            _ => rng.random_range(0..vocab) as u32,
        })
        .collect()
}

/// (rows, vocab, dim): B·T = 4·1000 tokens of hidden 768 over vocab 32003; a width that is not a
/// multiple of the vector (13); TinyLlama's 2048; a single token (dim 4: one f32 vector, but
/// the scalar path for bf16 / f16); 3000 tokens all in a 3-row vocabulary (runs of ~1000 equal
/// ids).
const EMB_SHAPES: &[(usize, usize, usize)] = &[
    (4000, 32003, 768),
    (1000, 32003, 13),
    (777, 5003, 2048),
    (1, 7, 4),
    (3000, 3, 80),
];

per_type!(
    embedding_forward_is_an_exact_gather,
    embedding_forward_is_an_exact_gather
);

fn embedding_forward_is_an_exact_gather<T: DeviceFloat>(test: &str) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    for (i, &(rows, vocab, dim)) in EMB_SHAPES.iter().enumerate() {
        let mut rng = rng::<T>(800 + i as u64);
        let ids = token_ids(&mut rng, rows, vocab);
        let table: Vec<T> = narrow(&nonzero_f32(&mut rng, vocab * dim, 0.05, 2.0));
        // The f32 reference on the exactly widened table; narrowing back is exact.
        let mut want = vec![f32::NAN; rows * dim];
        cpu::embedding_forward(&ids, &widen_f32(&table), dim, &mut want).unwrap();
        let want: Vec<T> = narrow(&want);
        let d_ids = upload(s, &ids);
        let mut check = TokenIdCheck::new(s, vocab).unwrap();

        let d_table = upload(s, &table);
        let mut out = poisoned::<T>(s, rows * dim);
        cuda::embedding_forward(
            s,
            &d_ids,
            &d_table,
            dim,
            &mut out.slice_mut(GUARD..GUARD + rows * dim),
            &mut check,
        )
        .unwrap();
        let got = unguard("embedding out", download(&dev, &out));
        let what = format!(
            "embedding_forward::<{}> rows={rows} vocab={vocab} dim={dim}",
            T::NAME
        );
        expect_bits(&what, &got, &want);
        check.take(s).expect("no out-of-range id was recorded");
    }
}

per_type!(
    embedding_backward_is_deterministic_and_exact,
    embedding_backward_is_deterministic_and_exact
);

/// dtable (f32) += scatter of dout (`T`), from a random (non-zero) dtable: bit-identical to the
/// serial f32 CPU reference on the exactly widened dout (same adds in the same order), close to
/// the f64 one, and the same bits on a second run.
fn embedding_backward_is_deterministic_and_exact<T: DeviceFloat>(test: &str) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    for (i, &(rows, vocab, dim)) in EMB_SHAPES.iter().enumerate() {
        let mut rng = rng::<T>(900 + i as u64);
        let ids = token_ids(&mut rng, rows, vocab);
        let dout: Vec<T> = narrow(&nonzero_f32(&mut rng, rows * dim, 0.05, 2.0));
        let dtable0 = nonzero_f32(&mut rng, vocab * dim, 0.05, 2.0);
        let mut want = dtable0.clone();
        cpu::embedding_backward(&ids, &widen_f32(&dout), dim, &mut want).unwrap();
        let mut want64 = f64_of(&dtable0);
        cpu::embedding_backward(&ids, &widen(&dout), dim, &mut want64).unwrap();
        let d_ids = upload(s, &ids);
        let mut check = TokenIdCheck::new(s, vocab).unwrap();
        let mut scratch = cuda::EmbeddingBackwardScratch::new(s, rows, vocab).unwrap();
        let name = format!(
            "embedding_backward::<{}> rows={rows} vocab={vocab} dim={dim}",
            T::NAME
        );

        let d_dout = upload(s, &dout);
        let mut first = None;
        for run in 0..2 {
            let mut dtable = upload(s, &dtable0);
            cuda::embedding_backward(
                s,
                &d_ids,
                &d_dout,
                dim,
                &mut dtable,
                &mut check,
                &mut scratch,
            )
            .unwrap();
            let got = download(&dev, &dtable);
            expect_bits(&format!("{name} run {run} vs cpu f32"), &got, &want);
            match &first {
                None => {
                    expect_close(&name, &f64_of(&got), &want64, F32_TOL);
                    first = Some(got);
                }
                Some(f) => expect_bits(&format!("{name} run 1 vs run 0"), &got, f),
            }
        }
        check.take(s).expect("no out-of-range id was recorded");
    }
}

fn f64_of(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

per_type!(
    embedding_out_of_range_ids_are_reported,
    embedding_out_of_range_ids_are_reported
);

/// Out-of-range ids: recorded (first position), never read or written out of bounds; the
/// forward's row becomes NaN, the backward skips the row; everything else is as without them.
fn embedding_out_of_range_ids_are_reported<T: DeviceFloat>(test: &str) {
    let Some(dev) = gpu_or_skip(test) else {
        return;
    };
    let s = dev.stream();
    let (rows, vocab, dim) = (1000usize, 32003usize, 768usize);
    let mut rng = rng::<T>(1000);
    let mut ids = token_ids(&mut rng, rows, vocab);
    ids[17] = vocab as u32; // first bad position
    ids[300] = u32::MAX;
    ids[999] = vocab as u32 + 5;
    let bad = |r: usize| ids[r] as usize >= vocab;
    let table: Vec<T> = narrow(&nonzero_f32(&mut rng, vocab * dim, 0.05, 2.0));
    let dout: Vec<T> = narrow(&nonzero_f32(&mut rng, rows * dim, 0.05, 2.0));
    let d_ids = upload(s, &ids);
    let mut check = TokenIdCheck::new(s, vocab).unwrap();

    let d_table = upload(s, &table);
    let mut out = upload(s, &vec![T::from_f32(0.0); rows * dim]);
    cuda::embedding_forward(s, &d_ids, &d_table, dim, &mut out, &mut check).unwrap();
    let got = download(&dev, &out);
    for r in 0..rows {
        let row = &got[r * dim..(r + 1) * dim];
        if bad(r) {
            assert!(
                row.iter().all(|&v| is_nan(v)),
                "row {r} of a bad id is not NaN"
            );
        } else {
            let id = ids[r] as usize;
            let want = &table[id * dim..(id + 1) * dim];
            assert!(
                row.iter().zip(want).all(|(&g, &w)| bits(g) == bits(w)),
                "row {r} is not table row {id}"
            );
        }
    }
    let err = check.take(s).unwrap_err();
    report(&format!(
        "embedding_forward::<{}> with bad ids: {err}",
        T::NAME
    ));
    assert!(
        matches!(err, OpsError::TokenOutOfRange { id, position: 17, vocab: v } if id == vocab as u32 && v == vocab),
        "{err}"
    );
    check.take(s).expect("take clears the record");

    // Backward: the valid rows, in order, as the CPU reference adds them.
    let dout32 = widen_f32(&dout);
    let (good_ids, good_dout): (Vec<u32>, Vec<f32>) =
        (0..rows)
            .filter(|&r| !bad(r))
            .fold((Vec::new(), Vec::new()), |(mut i, mut d), r| {
                i.push(ids[r]);
                d.extend_from_slice(&dout32[r * dim..(r + 1) * dim]);
                (i, d)
            });
    let dtable0 = nonzero_f32(&mut rng, vocab * dim, 0.05, 2.0);
    let mut want = dtable0.clone();
    cpu::embedding_backward(&good_ids, &good_dout, dim, &mut want).unwrap();
    let mut dtable = upload(s, &dtable0);
    let d_dout = upload(s, &dout);
    let mut scratch = cuda::EmbeddingBackwardScratch::new(s, rows, vocab).unwrap();
    cuda::embedding_backward(
        s,
        &d_ids,
        &d_dout,
        dim,
        &mut dtable,
        &mut check,
        &mut scratch,
    )
    .unwrap();
    let got = download(&dev, &dtable);
    let what = format!("embedding_backward::<{}> with bad ids skipped", T::NAME);
    expect_bits(&what, &got, &want);
    let err = check.take(s).unwrap_err();
    assert!(
        matches!(err, OpsError::TokenOutOfRange { position: 17, .. }),
        "{err}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn embedding_rejects_bad_shapes() {
    let Some(dev) = gpu_or_skip("embedding_rejects_bad_shapes") else {
        return;
    };
    let s = dev.stream();
    let ids = upload(s, &[0u32, 1, 2]);
    let table = upload(s, &[1.0f32; 5 * 4]);
    let mut out = upload(s, &[f32::NAN; 3 * 4]);
    // The check was made for a vocabulary of 6, the table has 5 rows.
    let mut check6 = TokenIdCheck::new(s, 6).unwrap();
    let err = cuda::embedding_forward(s, &ids, &table, 4, &mut out, &mut check6).unwrap_err();
    assert!(
        matches!(
            err,
            OpsError::ShapeMismatch {
                expected: 24,
                actual: 20,
                ..
            }
        ),
        "{err}"
    );
    let mut check = TokenIdCheck::new(s, 5).unwrap();
    // dim 0.
    let err = cuda::embedding_forward(s, &ids, &table, 0, &mut out, &mut check).unwrap_err();
    assert!(matches!(err, OpsError::ShapeMismatch { .. }), "{err}");
    // out is [3, 4] but dim 4 with 3 ids needs 12: give it a dtable of the wrong size instead.
    let mut scratch = cuda::EmbeddingBackwardScratch::new(s, 3, 5).unwrap();
    let dout = upload(s, &[1.0f32; 3 * 4]);
    let mut dtable = upload(s, &[0.0f32; 4 * 4]);
    let err = cuda::embedding_backward(s, &ids, &dout, 4, &mut dtable, &mut check, &mut scratch)
        .unwrap_err();
    assert!(matches!(err, OpsError::ShapeMismatch { .. }), "{err}");
    let short = upload(s, &[1.0f32; 3 * 4 - 1]);
    let mut dtable = upload(s, &[0.0f32; 5 * 4]);
    let err = cuda::embedding_backward(s, &ids, &short, 4, &mut dtable, &mut check, &mut scratch)
        .unwrap_err();
    assert!(
        matches!(
            err,
            OpsError::ShapeMismatch {
                expected: 12,
                actual: 11,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        download(&dev, &out).iter().all(|v| v.is_nan()),
        "a rejected call wrote output"
    );
    assert!(
        download(&dev, &dtable).iter().all(|&v| v == 0.0),
        "a rejected call wrote dtable"
    );
    // Scratch sized for 1 token cannot serve 1000 (its key and position arrays alone are
    // larger): a typed error, dtable untouched.
    let mut small = cuda::EmbeddingBackwardScratch::new(s, 1, 5).unwrap();
    let many_ids = upload(s, &vec![1u32; 1000]);
    let many_dout = upload(s, &vec![1.0f32; 1000 * 4]);
    let err = cuda::embedding_backward(
        s,
        &many_ids,
        &many_dout,
        4,
        &mut dtable,
        &mut check,
        &mut small,
    )
    .unwrap_err();
    assert!(matches!(err, OpsError::Cuda { .. }), "{err}");
    assert!(
        download(&dev, &dtable).iter().all(|&v| v == 0.0),
        "a call with too small a scratch wrote dtable"
    );
    check.take(s).expect("rejected calls record nothing");
}
