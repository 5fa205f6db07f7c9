//! CUDA kernels of embedding.cu, rope.cu, activation.cu (SwiGLU) and residual.cu against the CPU
//! reference, on fresh seeded random inputs (never zeros), at shapes that are not multiples of
//! the block or vector sizes (T = 1000, hidden 768, head_dim 64 and 80, vocab 32003, B·T =
//! 4·1000), with output buffers poisoned with NaN and guarded by NaN cells on both sides (an
//! element the kernel forgets, or one it writes past the end, fails the test).
//!
//! Tolerances (relative, ‖got − want‖₂ / ‖want‖₂ against the reference computed in f64 on the
//! same, already rounded inputs): f32 ≤ 1e-5; bf16 ≤ 1e-2, because a bf16 output keeps 8
//! significant bits (rounding error ≤ 2^-9 ≈ 2e-3 per element) and inputs of a backward may
//! themselves be bf16-rounded activations. Where the kernel's arithmetic is exactly defined
//! (residual adds, embedding copy and backward) the test also demands bit equality with the f32
//! CPU reference, which is the stronger check. Every measured error is printed, pass or fail.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

use std::io::Write;
use std::sync::Arc;

use cudarc::driver::{DevicePtr, DeviceRepr};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::OpsError;
use tilearn_ops::cpu::{self, RopeScaling, RopeTable};
use tilearn_ops::cuda::{self, CudaSlice, CudaStream, GpuDevice, GpuRopeTable, TokenIdCheck};

const F32_TOL: f64 = 1e-5;
const BF16_TOL: f64 = 1e-2;

/// Cells of NaN kept on each side of an output (8 elements: 16-byte aligned for bf16 and f32, so
/// the view itself stays on the vectorised path).
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

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
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

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn f32_to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn bf16_to_f64(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
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

/// Asserts bit equality, naming the first differing element.
fn expect_bits<T: Copy + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
    bits: impl Fn(T) -> u64,
) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let diffs = got
        .iter()
        .zip(want)
        .filter(|(g, w)| bits(**g) != bits(**w))
        .count();
    if let Some(i) = got.iter().zip(want).position(|(g, w)| bits(*g) != bits(*w)) {
        panic!(
            "{what}: {diffs} of {} elements differ from the reference bits; first at {i}: got {:?}, want {:?}",
            got.len(),
            got[i],
            want[i]
        );
    }
    report(&format!("{what}: all {} elements bit-identical", got.len()));
}

fn f32_bits(v: f32) -> u64 {
    v.to_bits() as u64
}

fn bf16_bits(v: bf16) -> u64 {
    v.to_bits() as u64
}

/// A NaN buffer of `n + 2 * GUARD` elements; the output is its middle `n`.
fn poisoned<T: DeviceRepr + Copy>(stream: &Arc<CudaStream>, n: usize, nan: T) -> CudaSlice<T> {
    upload(stream, &vec![nan; n + 2 * GUARD])
}

/// The middle `n` elements of a [`poisoned`] buffer after checking both guards are still NaN.
fn unguard<T: Copy>(what: &str, all: Vec<T>, is_nan: impl Fn(T) -> bool) -> Vec<T> {
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

// ---- residual adds: exact (one IEEE add, one rounding), checked bit for bit ----

/// Lengths: shorter than one vector, odd, a hidden-768 stream of 4·1000 tokens, plus 3.
const ADD_LENGTHS: &[usize] = &[1, 7, 1001, 4 * 1000 * 768 + 3];

#[test]
fn residual_add_f32_is_exact() {
    let Some(dev) = gpu_or_skip("residual_add_f32_is_exact") else {
        return;
    };
    let s = dev.stream();
    let mut rng = rng(11);
    for &n in ADD_LENGTHS {
        // offset 0: the vector path; offset 1: misaligned views, the scalar path.
        for offset in [0usize, 1] {
            let a = nonzero_f32(&mut rng, n + offset, 0.05, 4.0);
            let b = nonzero_f32(&mut rng, n + offset, 0.05, 4.0);
            let mut want = a[offset..].to_vec();
            cpu::add_inplace(&mut want, &b[offset..]);
            let mut want64 = f32_to_f64(&a[offset..]);
            cpu::add_inplace(&mut want64, &f32_to_f64(&b[offset..]));
            let (da, db) = (upload(s, &a), upload(s, &b));
            let (va, vb) = (da.slice(offset..), db.slice(offset..));

            let mut out = poisoned(s, n + offset, f32::NAN);
            let mut view = out.slice_mut(GUARD + offset..GUARD + offset + n);
            cuda::residual_add_f32(s, &va, &vb, &mut view).unwrap();
            let got = unguard("add f32", download(&dev, &out), f32::is_nan);
            let got = &got[offset..];
            let what = format!("residual_add_f32 n={n} offset={offset}");
            expect_bits(&what, got, &want, f32_bits);
            expect_close(&what, &f32_to_f64(got), &want64, F32_TOL);

            let mut acc = upload(s, &a);
            let mut acc_view = acc.slice_mut(offset..);
            cuda::residual_add_inplace_f32(s, &mut acc_view, &vb).unwrap();
            let got = download(&dev, &acc);
            assert_eq!(
                got[..offset],
                a[..offset],
                "in-place add touched the element before the view"
            );
            let what = format!("residual_add_inplace_f32 n={n} offset={offset}");
            expect_bits(&what, &got[offset..], &want, f32_bits);
        }
    }
}

#[test]
fn residual_add_bf16_is_exact() {
    let Some(dev) = gpu_or_skip("residual_add_bf16_is_exact") else {
        return;
    };
    let s = dev.stream();
    let mut rng = rng(12);
    for &n in ADD_LENGTHS {
        for offset in [0usize, 1] {
            let a = to_bf16(&nonzero_f32(&mut rng, n + offset, 0.05, 4.0));
            let b = to_bf16(&nonzero_f32(&mut rng, n + offset, 0.05, 4.0));
            // What the kernel defines: widen, add in f32, round once.
            let want: Vec<bf16> = a[offset..]
                .iter()
                .zip(&b[offset..])
                .map(|(x, y)| bf16::from_f32(x.to_f32() + y.to_f32()))
                .collect();
            let mut want64 = bf16_to_f64(&a[offset..]);
            cpu::add_inplace(&mut want64, &bf16_to_f64(&b[offset..]));
            let (da, db) = (upload(s, &a), upload(s, &b));
            let (va, vb) = (da.slice(offset..), db.slice(offset..));

            let mut out = poisoned(s, n + offset, bf16::NAN);
            let mut view = out.slice_mut(GUARD + offset..GUARD + offset + n);
            cuda::residual_add_bf16(s, &va, &vb, &mut view).unwrap();
            let got = unguard("add bf16", download(&dev, &out), |v: bf16| v.is_nan());
            let got = &got[offset..];
            let what = format!("residual_add_bf16 n={n} offset={offset}");
            expect_bits(&what, got, &want, bf16_bits);
            expect_close(&what, &bf16_to_f64(got), &want64, BF16_TOL);

            let mut acc = upload(s, &a);
            let mut acc_view = acc.slice_mut(offset..);
            cuda::residual_add_inplace_bf16(s, &mut acc_view, &vb).unwrap();
            let got = download(&dev, &acc);
            let what = format!("residual_add_inplace_bf16 n={n} offset={offset}");
            expect_bits(&what, &got[offset..], &want, bf16_bits);
        }
    }
}

#[test]
fn residual_add_rejects_length_mismatch() {
    let Some(dev) = gpu_or_skip("residual_add_rejects_length_mismatch") else {
        return;
    };
    let s = dev.stream();
    let a = upload(s, &[1.0f32; 8]);
    let b = upload(s, &[1.0f32; 7]);
    let mut out = upload(s, &[f32::NAN; 8]);
    let err = cuda::residual_add_f32(s, &a, &b, &mut out).unwrap_err();
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
    let err = cuda::residual_add_inplace_f32(s, &mut acc, &b).unwrap_err();
    assert!(matches!(err, OpsError::ShapeMismatch { .. }), "{err}");
    assert!(
        download(&dev, &out).iter().all(|v| v.is_nan()),
        "a rejected call wrote output"
    );
}

// ---- SwiGLU ----

/// Lengths: below one vector, odd, 1000 × intermediate 2048, 4·1000 × 768 + 5.
const SWIGLU_LENGTHS: &[usize] = &[1, 7, 1000 * 2048, 4 * 1000 * 768 + 5];

/// gate spans the saturated tails of the sigmoid (|g| up to 12, plus ±30 and -100, where
/// e^-g alone would overflow f32), up and dout are moderate.
fn swiglu_inputs(seed: u64, n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = rng(seed);
    let mut gate = nonzero_f32(&mut rng, n, 0.05, 12.0);
    for (i, v) in [-100.0f32, 30.0, -30.0].into_iter().enumerate() {
        // Only in longer inputs: alone, silu(-100) ≈ -4e-42 (an f32 subnormal with ~11
        // significant bits) would be the whole norm.
        if n >= 8 {
            gate[n - 1 - i] = v;
        }
    }
    (
        gate,
        nonzero_f32(&mut rng, n, 0.05, 2.0),
        nonzero_f32(&mut rng, n, 0.05, 2.0),
    )
}

fn swiglu_reference(gate: &[f64], up: &[f64], dout: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let n = gate.len();
    let mut out = vec![f64::NAN; n];
    cpu::swiglu_forward(gate, up, &mut out);
    let (mut dgate, mut dup) = (vec![f64::NAN; n], vec![f64::NAN; n]);
    cpu::swiglu_backward(dout, gate, up, &mut dgate, &mut dup);
    (out, dgate, dup)
}

#[test]
fn swiglu_f32_matches_cpu_reference() {
    let Some(dev) = gpu_or_skip("swiglu_f32_matches_cpu_reference") else {
        return;
    };
    let s = dev.stream();
    for (case, &n) in SWIGLU_LENGTHS.iter().enumerate() {
        for offset in [0usize, 1] {
            let (gate, up, dout) = swiglu_inputs(300 + 2 * case as u64 + offset as u64, n + offset);
            let (out_ref, dg_ref, du_ref) = swiglu_reference(
                &f32_to_f64(&gate[offset..]),
                &f32_to_f64(&up[offset..]),
                &f32_to_f64(&dout[offset..]),
            );
            let (g, u, dy) = (upload(s, &gate), upload(s, &up), upload(s, &dout));
            let (g, u, dy) = (g.slice(offset..), u.slice(offset..), dy.slice(offset..));
            let range = GUARD + offset..GUARD + offset + n;

            let mut out = poisoned(s, n + offset, f32::NAN);
            cuda::swiglu_forward_f32(s, &g, &u, &mut out.slice_mut(range.clone())).unwrap();
            let got = unguard("swiglu out", download(&dev, &out), f32::is_nan);
            let what = format!("swiglu_forward_f32 n={n} offset={offset}: out");
            expect_close(&what, &f32_to_f64(&got[offset..]), &out_ref, F32_TOL);

            let mut dgate = poisoned(s, n + offset, f32::NAN);
            let mut dup = poisoned(s, n + offset, f32::NAN);
            cuda::swiglu_backward_f32(
                s,
                &dy,
                &g,
                &u,
                &mut dgate.slice_mut(range.clone()),
                &mut dup.slice_mut(range),
            )
            .unwrap();
            let got = unguard("swiglu dgate", download(&dev, &dgate), f32::is_nan);
            let what = format!("swiglu_backward_f32 n={n} offset={offset}: dgate");
            expect_close(&what, &f32_to_f64(&got[offset..]), &dg_ref, F32_TOL);
            let got = unguard("swiglu dup", download(&dev, &dup), f32::is_nan);
            let what = format!("swiglu_backward_f32 n={n} offset={offset}: dup");
            expect_close(&what, &f32_to_f64(&got[offset..]), &du_ref, F32_TOL);
        }
    }
}

#[test]
fn swiglu_bf16_matches_cpu_reference() {
    let Some(dev) = gpu_or_skip("swiglu_bf16_matches_cpu_reference") else {
        return;
    };
    let s = dev.stream();
    for (case, &n) in SWIGLU_LENGTHS.iter().enumerate() {
        for offset in [0usize, 1] {
            let (gate, up, dout) = swiglu_inputs(400 + 2 * case as u64 + offset as u64, n + offset);
            let (gate, up, dout) = (to_bf16(&gate), to_bf16(&up), to_bf16(&dout));
            let (out_ref, dg_ref, du_ref) = swiglu_reference(
                &bf16_to_f64(&gate[offset..]),
                &bf16_to_f64(&up[offset..]),
                &bf16_to_f64(&dout[offset..]),
            );
            let (g, u, dy) = (upload(s, &gate), upload(s, &up), upload(s, &dout));
            let (g, u, dy) = (g.slice(offset..), u.slice(offset..), dy.slice(offset..));
            let range = GUARD + offset..GUARD + offset + n;
            let is_nan = |v: bf16| v.is_nan();

            let mut out = poisoned(s, n + offset, bf16::NAN);
            cuda::swiglu_forward_bf16(s, &g, &u, &mut out.slice_mut(range.clone())).unwrap();
            let got = unguard("swiglu out", download(&dev, &out), is_nan);
            let what = format!("swiglu_forward_bf16 n={n} offset={offset}: out");
            expect_close(&what, &bf16_to_f64(&got[offset..]), &out_ref, BF16_TOL);

            let mut dgate = poisoned(s, n + offset, bf16::NAN);
            let mut dup = poisoned(s, n + offset, bf16::NAN);
            cuda::swiglu_backward_bf16(
                s,
                &dy,
                &g,
                &u,
                &mut dgate.slice_mut(range.clone()),
                &mut dup.slice_mut(range),
            )
            .unwrap();
            let got = unguard("swiglu dgate", download(&dev, &dgate), is_nan);
            let what = format!("swiglu_backward_bf16 n={n} offset={offset}: dgate");
            expect_close(&what, &bf16_to_f64(&got[offset..]), &dg_ref, BF16_TOL);
            let got = unguard("swiglu dup", download(&dev, &dup), is_nan);
            let what = format!("swiglu_backward_bf16 n={n} offset={offset}: dup");
            expect_close(&what, &bf16_to_f64(&got[offset..]), &du_ref, BF16_TOL);
        }
    }
}

#[test]
fn swiglu_rejects_length_mismatch() {
    let Some(dev) = gpu_or_skip("swiglu_rejects_length_mismatch") else {
        return;
    };
    let s = dev.stream();
    let g = upload(s, &[1.0f32; 9]);
    let u = upload(s, &[1.0f32; 9]);
    let mut out = upload(s, &[f32::NAN; 8]);
    let err = cuda::swiglu_forward_f32(s, &g, &u, &mut out).unwrap_err();
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
    let err = cuda::swiglu_backward_f32(s, &dy, &g, &u, &mut dg, &mut du).unwrap_err();
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
    cpu::rope_forward(&mut y, c.batch, c.seq, c.heads, c.head_dim, table);
    let mut dx = dy.to_vec();
    cpu::rope_backward(&mut dx, c.batch, c.seq, c.heads, c.head_dim, table);
    (y, dx)
}

#[test]
fn rope_f32_matches_cpu_reference() {
    let Some(dev) = gpu_or_skip("rope_f32_matches_cpu_reference") else {
        return;
    };
    let s = dev.stream();
    for (i, c) in rope_cases().iter().enumerate() {
        let table = c.table();
        let gpu_table = GpuRopeTable::upload(s, &table).unwrap();
        let mut rng = rng(500 + i as u64);
        let x = nonzero_f32(&mut rng, c.len(), 0.05, 2.0);
        let dy = nonzero_f32(&mut rng, c.len(), 0.05, 2.0);
        let (y_ref, dx_ref) = rope_reference(c, &table, &f32_to_f64(&x), &f32_to_f64(&dy));

        let mut buf = upload(s, &x);
        cuda::rope_forward_f32(s, &mut buf, c.batch, c.seq, c.heads, c.head_dim, &gpu_table)
            .unwrap();
        let y = download(&dev, &buf);
        expect_close(
            &format!("rope_forward_f32 {}", c.name()),
            &f32_to_f64(&y),
            &y_ref,
            F32_TOL,
        );

        // The inverse rotation brings the forward's output back to x.
        cuda::rope_backward_f32(s, &mut buf, c.batch, c.seq, c.heads, c.head_dim, &gpu_table)
            .unwrap();
        let back = download(&dev, &buf);
        expect_close(
            &format!("rope f32 round trip {}", c.name()),
            &f32_to_f64(&back),
            &f32_to_f64(&x),
            F32_TOL,
        );

        let mut grad = upload(s, &dy);
        cuda::rope_backward_f32(
            s, &mut grad, c.batch, c.seq, c.heads, c.head_dim, &gpu_table,
        )
        .unwrap();
        let dx = download(&dev, &grad);
        expect_close(
            &format!("rope_backward_f32 {}", c.name()),
            &f32_to_f64(&dx),
            &dx_ref,
            F32_TOL,
        );
    }
}

#[test]
fn rope_bf16_matches_cpu_reference() {
    let Some(dev) = gpu_or_skip("rope_bf16_matches_cpu_reference") else {
        return;
    };
    let s = dev.stream();
    for (i, c) in rope_cases().iter().enumerate() {
        let table = c.table();
        let gpu_table = GpuRopeTable::upload(s, &table).unwrap();
        let mut rng = rng(600 + i as u64);
        let x = to_bf16(&nonzero_f32(&mut rng, c.len(), 0.05, 2.0));
        let dy = to_bf16(&nonzero_f32(&mut rng, c.len(), 0.05, 2.0));
        let (y_ref, dx_ref) = rope_reference(c, &table, &bf16_to_f64(&x), &bf16_to_f64(&dy));

        let mut buf = upload(s, &x);
        cuda::rope_forward_bf16(s, &mut buf, c.batch, c.seq, c.heads, c.head_dim, &gpu_table)
            .unwrap();
        let y = download(&dev, &buf);
        expect_close(
            &format!("rope_forward_bf16 {}", c.name()),
            &bf16_to_f64(&y),
            &y_ref,
            BF16_TOL,
        );

        let mut grad = upload(s, &dy);
        cuda::rope_backward_bf16(
            s, &mut grad, c.batch, c.seq, c.heads, c.head_dim, &gpu_table,
        )
        .unwrap();
        let dx = download(&dev, &grad);
        expect_close(
            &format!("rope_backward_bf16 {}", c.name()),
            &bf16_to_f64(&dx),
            &dx_ref,
            BF16_TOL,
        );
    }
}

/// A view at an odd element offset: the kernel must take its one-pair-per-thread path.
#[test]
fn rope_f32_misaligned_view_matches_cpu_reference() {
    let Some(dev) = gpu_or_skip("rope_f32_misaligned_view_matches_cpu_reference") else {
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
    let mut rng = rng(700);
    let x = nonzero_f32(&mut rng, c.len() + 2, 0.05, 2.0);
    let (y_ref, _) = rope_reference(
        &c,
        &table,
        &f32_to_f64(&x[1..=c.len()]),
        &f32_to_f64(&x[1..=c.len()]),
    );
    let mut buf = upload(s, &x);
    let mut view = buf.slice_mut(1..=c.len());
    cuda::rope_forward_f32(
        s, &mut view, c.batch, c.seq, c.heads, c.head_dim, &gpu_table,
    )
    .unwrap();
    let got = download(&dev, &buf);
    assert_eq!(got[0], x[0], "element before the view was written");
    assert_eq!(
        got[c.len() + 1],
        x[c.len() + 1],
        "element after the view was written"
    );
    expect_close(
        "rope_forward_f32 misaligned view",
        &f32_to_f64(&got[1..=c.len()]),
        &y_ref,
        F32_TOL,
    );
}

#[test]
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
    let err = cuda::rope_forward_f32(s, &mut x, 2, 11, 3, 8, &table).unwrap_err();
    assert!(matches!(err, OpsError::Cuda { .. }), "{err}");
    // head_dim 4 does not match the table's 8.
    let err = cuda::rope_forward_f32(s, &mut x, 2, 11, 6, 4, &table).unwrap_err();
    assert!(matches!(err, OpsError::Cuda { .. }), "{err}");
    // x has 2·11·3·8 elements, not 2·10·3·8.
    let err = cuda::rope_forward_f32(s, &mut x, 2, 10, 3, 8, &table).unwrap_err();
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
/// multiple of the vector (13); TinyLlama's 2048; a single token; 3000 tokens all in a
/// 3-row vocabulary (runs of ~1000 equal ids).
const EMB_SHAPES: &[(usize, usize, usize)] = &[
    (4000, 32003, 768),
    (1000, 32003, 13),
    (777, 5003, 2048),
    (1, 7, 4),
    (3000, 3, 80),
];

#[test]
fn embedding_forward_is_an_exact_gather() {
    let Some(dev) = gpu_or_skip("embedding_forward_is_an_exact_gather") else {
        return;
    };
    let s = dev.stream();
    for (i, &(rows, vocab, dim)) in EMB_SHAPES.iter().enumerate() {
        let mut rng = rng(800 + i as u64);
        let ids = token_ids(&mut rng, rows, vocab);
        let table = nonzero_f32(&mut rng, vocab * dim, 0.05, 2.0);
        let mut want = vec![f32::NAN; rows * dim];
        cpu::embedding_forward(&ids, &table, dim, &mut want).unwrap();
        let d_ids = upload(s, &ids);
        let mut check = TokenIdCheck::new(s, vocab).unwrap();
        let range = GUARD..GUARD + rows * dim;

        let d_table = upload(s, &table);
        let mut out = poisoned(s, rows * dim, f32::NAN);
        cuda::embedding_forward_f32(
            s,
            &d_ids,
            &d_table,
            dim,
            &mut out.slice_mut(range.clone()),
            &mut check,
        )
        .unwrap();
        let got = unguard("embedding out f32", download(&dev, &out), f32::is_nan);
        expect_bits(
            &format!("embedding_forward_f32 rows={rows} vocab={vocab} dim={dim}"),
            &got,
            &want,
            f32_bits,
        );

        let table16 = to_bf16(&table);
        let want16: Vec<bf16> = to_bf16(&want);
        let d_table16 = upload(s, &table16);
        let mut out = poisoned(s, rows * dim, bf16::NAN);
        cuda::embedding_forward_bf16(
            s,
            &d_ids,
            &d_table16,
            dim,
            &mut out.slice_mut(range),
            &mut check,
        )
        .unwrap();
        let got = unguard("embedding out bf16", download(&dev, &out), |v: bf16| {
            v.is_nan()
        });
        expect_bits(
            &format!("embedding_forward_bf16 rows={rows} vocab={vocab} dim={dim}"),
            &got,
            &want16,
            bf16_bits,
        );
        check.take(s).expect("no out-of-range id was recorded");
    }
}

/// dtable += scatter of dout, from a random (non-zero) dtable: bit-identical to the serial f32
/// CPU reference (same adds in the same order), close to the f64 one, and the same bits twice.
#[test]
fn embedding_backward_is_deterministic_and_exact() {
    let Some(dev) = gpu_or_skip("embedding_backward_is_deterministic_and_exact") else {
        return;
    };
    let s = dev.stream();
    for (i, &(rows, vocab, dim)) in EMB_SHAPES.iter().enumerate() {
        let mut rng = rng(900 + i as u64);
        let ids = token_ids(&mut rng, rows, vocab);
        let dout = nonzero_f32(&mut rng, rows * dim, 0.05, 2.0);
        let dtable0 = nonzero_f32(&mut rng, vocab * dim, 0.05, 2.0);
        let mut want = dtable0.clone();
        cpu::embedding_backward(&ids, &dout, dim, &mut want);
        let mut want64 = f32_to_f64(&dtable0);
        cpu::embedding_backward(&ids, &f32_to_f64(&dout), dim, &mut want64);
        let d_ids = upload(s, &ids);
        let mut check = TokenIdCheck::new(s, vocab).unwrap();
        let mut scratch = cuda::EmbeddingBackwardScratch::new(s, rows, vocab).unwrap();
        let name = format!("rows={rows} vocab={vocab} dim={dim}");

        let d_dout = upload(s, &dout);
        let mut first = None;
        for run in 0..2 {
            let mut dtable = upload(s, &dtable0);
            cuda::embedding_backward_f32(
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
            expect_bits(
                &format!("embedding_backward_f32 {name} run {run} vs cpu f32"),
                &got,
                &want,
                f32_bits,
            );
            match &first {
                None => {
                    expect_close(
                        &format!("embedding_backward_f32 {name}"),
                        &f32_to_f64(&got),
                        &want64,
                        F32_TOL,
                    );
                    first = Some(got);
                }
                Some(f) => expect_bits(
                    &format!("embedding_backward_f32 {name} run 1 vs run 0"),
                    &got,
                    f,
                    f32_bits,
                ),
            }
        }

        // bf16 dout, widened exactly: the f32 reference on the widened values is still exact.
        let dout16 = to_bf16(&dout);
        let widened: Vec<f32> = dout16.iter().map(|v| v.to_f32()).collect();
        let mut want16 = dtable0.clone();
        cpu::embedding_backward(&ids, &widened, dim, &mut want16);
        let d_dout16 = upload(s, &dout16);
        let mut dtable = upload(s, &dtable0);
        cuda::embedding_backward_bf16(
            s,
            &d_ids,
            &d_dout16,
            dim,
            &mut dtable,
            &mut check,
            &mut scratch,
        )
        .unwrap();
        let got = download(&dev, &dtable);
        expect_bits(
            &format!("embedding_backward_bf16 {name} vs cpu f32"),
            &got,
            &want16,
            f32_bits,
        );
        check.take(s).expect("no out-of-range id was recorded");
    }
}

/// Out-of-range ids: recorded (first position), never read or written out of bounds; the
/// forward's row becomes NaN, the backward skips the row; everything else is as without them.
#[test]
fn embedding_out_of_range_ids_are_reported() {
    let Some(dev) = gpu_or_skip("embedding_out_of_range_ids_are_reported") else {
        return;
    };
    let s = dev.stream();
    let (rows, vocab, dim) = (1000usize, 32003usize, 768usize);
    let mut rng = rng(1000);
    let mut ids = token_ids(&mut rng, rows, vocab);
    ids[17] = vocab as u32; // first bad position
    ids[300] = u32::MAX;
    ids[999] = vocab as u32 + 5;
    let bad = |r: usize| ids[r] as usize >= vocab;
    let table = nonzero_f32(&mut rng, vocab * dim, 0.05, 2.0);
    let dout = nonzero_f32(&mut rng, rows * dim, 0.05, 2.0);
    let d_ids = upload(s, &ids);
    let mut check = TokenIdCheck::new(s, vocab).unwrap();

    let d_table = upload(s, &table);
    let mut out = upload(s, &vec![0.0f32; rows * dim]);
    cuda::embedding_forward_f32(s, &d_ids, &d_table, dim, &mut out, &mut check).unwrap();
    let got = download(&dev, &out);
    for r in 0..rows {
        let row = &got[r * dim..(r + 1) * dim];
        if bad(r) {
            assert!(
                row.iter().all(|v| v.is_nan()),
                "row {r} of a bad id is not NaN"
            );
        } else {
            let id = ids[r] as usize;
            assert_eq!(row, &table[id * dim..(id + 1) * dim], "row {r}");
        }
    }
    let err = check.take(s).unwrap_err();
    report(&format!("embedding forward with bad ids: {err}"));
    assert!(
        matches!(err, OpsError::TokenOutOfRange { id, position: 17, vocab: v } if id == vocab as u32 && v == vocab),
        "{err}"
    );
    check.take(s).expect("take clears the record");

    // Backward: the valid rows, in order, as the CPU reference adds them.
    let (good_ids, good_dout): (Vec<u32>, Vec<f32>) =
        (0..rows)
            .filter(|&r| !bad(r))
            .fold((Vec::new(), Vec::new()), |(mut i, mut d), r| {
                i.push(ids[r]);
                d.extend_from_slice(&dout[r * dim..(r + 1) * dim]);
                (i, d)
            });
    let dtable0 = nonzero_f32(&mut rng, vocab * dim, 0.05, 2.0);
    let mut want = dtable0.clone();
    cpu::embedding_backward(&good_ids, &good_dout, dim, &mut want);
    let mut dtable = upload(s, &dtable0);
    let d_dout = upload(s, &dout);
    let mut scratch = cuda::EmbeddingBackwardScratch::new(s, rows, vocab).unwrap();
    cuda::embedding_backward_f32(
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
    expect_bits(
        "embedding_backward_f32 with bad ids skipped",
        &got,
        &want,
        f32_bits,
    );
    let err = check.take(s).unwrap_err();
    assert!(
        matches!(err, OpsError::TokenOutOfRange { position: 17, .. }),
        "{err}"
    );
}

#[test]
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
    let err = cuda::embedding_forward_f32(s, &ids, &table, 4, &mut out, &mut check6).unwrap_err();
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
    let err = cuda::embedding_forward_f32(s, &ids, &table, 0, &mut out, &mut check).unwrap_err();
    assert!(matches!(err, OpsError::ShapeMismatch { .. }), "{err}");
    // out is [3, 4] but dim 4 with 3 ids needs 12: give it a dtable of the wrong size instead.
    let mut scratch = cuda::EmbeddingBackwardScratch::new(s, 3, 5).unwrap();
    let dout = upload(s, &[1.0f32; 3 * 4]);
    let mut dtable = upload(s, &[0.0f32; 4 * 4]);
    let err =
        cuda::embedding_backward_f32(s, &ids, &dout, 4, &mut dtable, &mut check, &mut scratch)
            .unwrap_err();
    assert!(matches!(err, OpsError::ShapeMismatch { .. }), "{err}");
    let short = upload(s, &[1.0f32; 3 * 4 - 1]);
    let mut dtable = upload(s, &[0.0f32; 5 * 4]);
    let err =
        cuda::embedding_backward_f32(s, &ids, &short, 4, &mut dtable, &mut check, &mut scratch)
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
    let err = cuda::embedding_backward_f32(
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
