//! cuBLASLt matmuls (the raw strided-batched product and the linear layer) and causal GQA
//! attention against the CPU reference computed in f64, on fresh seeded random inputs (never
//! zeros) at awkward shapes, with every output poisoned with NaN before the launch. Every test
//! prints its measured errors, on success too, so the GPU log shows the margins.
//!
//! Every test body is generic over the element type and runs in f32, bf16 and f16. Attention
//! runs through both implementations: the cuBLASLt path (forced with `AttentionImpl::Gemm` in
//! the `attention_*` tests) and the fused flash kernels (bf16 / f16, `flash_attention_*`: vs
//! the reference at the same bounds as the GEMM path, vs the GEMM path, bit-identical reruns,
//! and `Auto` equal to the path it resolves to).
//!
//! Tolerances (‖got − want‖₂ / ‖want‖₂, DESIGN.md's bounds):
//! * f32: 1e-5. cuBLASLt runs with `CUBLAS_COMPUTE_32F` (TF32 off, which would give ~1e-3);
//!   f32 sums over up to 32003 terms have relative error ~ 2^-24 · sqrt(k) ≈ 1e-5 at worst.
//! * bf16 outputs: 1e-2. The references use the same bf16-rounded inputs, so the error is the
//!   rounding of the output (unit roundoff 2^-8 ≈ 3.9e-3 per element, ~2.3e-3 rms) plus, in
//!   attention, of P and dS before their GEMMs; 1e-2 leaves room for those few roundings in
//!   sequence.
//! * f16 outputs: 2e-3. Same reasoning with f16's 11-bit significand: unit roundoff
//!   2^-11 ≈ 4.9e-4 per rounding (~2.8e-4 rms); the longest chain (attention's dq/dk: P, dS,
//!   then the output rounded) gives ~5e-4 rms, and 2e-3 keeps a 4x margin — the bf16 bound
//!   scaled by the 8x finer rounding, rounded up. Inputs are drawn in ±[0.05, 2): every value
//!   and every product sum of the cases (at most ~|300| for the 32003-term dx) is far inside
//!   f16's range (65504); P lies in [0, 1]; the smallest dS values of the T = 1000 case fall
//!   into f16's subnormals (< 6.1e-5, absolute spacing 6e-8), which changes the norm-relative
//!   error by far less than the bound.
//! * f32 outputs of bf16 / f16 GEMMs (dW, attention's lse): 1e-3. The products of 16-bit
//!   numbers are exact in f32, but tensor cores' f32 accumulation does not round to nearest at
//!   every add.
//! * db (f32 column sums of exactly representable values, in the reduction kernel): 1e-5 for
//!   every type.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes. With a
//! GPU but no libcublasLt the tests fail with the loader's message (the GPU path needs it).
#![cfg(feature = "cuda")]

use std::io::Write;
use std::sync::Arc;

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::OpsError;
use tilearn_ops::cpu::{self, AttnShape};
use tilearn_ops::cuda::{
    self, AttentionImpl, AttentionWorkspace, CudaSlice, CudaStream, DeviceFloat, DevicePtr,
    FlashBackward, Gemm, GpuDevice, MatmulSpec, Operand, Transpose, WeightGrad,
};

/// Writes to the process's stderr directly: libtest captures `eprintln!` of passing tests, and
/// skips and measured errors must be visible in the log.
fn report(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Opens GPU 0 and a cuBLASLt handle on its stream, or prints why the test is skipped (no GPU).
fn gpu_or_skip(test: &str) -> Option<(GpuDevice, Gemm)> {
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

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Uniform in ±[lo, hi): bounded away from zero.
fn uniform(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let m = rng.random_range(lo..hi);
            if rng.random::<bool>() { m } else { -m }
        })
        .collect()
}

/// An element type under test (f32, bf16 or f16): what the tests need beyond [`DeviceFloat`],
/// so one generic test body serves every precision.
trait Elem: DeviceFloat + std::fmt::Debug {
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

/// Random values of `T` (drawn in f32, rounded once) and their exact f64 values.
fn random<T: Elem>(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> (Vec<T>, Vec<f64>) {
    let v: Vec<T> = uniform(rng, n, lo, hi)
        .into_iter()
        .map(T::from_f32)
        .collect();
    let f = v.iter().map(|x| x.to_f64()).collect();
    (v, f)
}

fn upload<T: cudarc::driver::DeviceRepr>(stream: &Arc<CudaStream>, host: &[T]) -> CudaSlice<T> {
    stream.clone_htod(host).expect("host-to-device copy")
}

fn poisoned<T: Elem>(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<T> {
    upload(stream, &vec![T::NAN; n])
}

fn download<T: cudarc::driver::DeviceRepr>(dev: &GpuDevice, buf: &CudaSlice<T>) -> Vec<T> {
    dev.synchronize().expect("kernels ran without error");
    dev.stream().clone_dtoh(buf).expect("device-to-host copy")
}

fn download_f64<T: Elem>(dev: &GpuDevice, buf: &CudaSlice<T>) -> Vec<f64> {
    download(dev, buf).into_iter().map(Elem::to_f64).collect()
}

/// Fails on the first non-finite element (an unwritten, NaN-poisoned output).
fn all_finite(what: &str, v: &[f64]) {
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        panic!("{what}: element {i} of {} is {}", v.len(), v[i]);
    }
}

/// ‖got − want‖₂ / ‖want‖₂, failing on any non-finite `got`.
fn rel_err(what: &str, got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    all_finite(what, got);
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if den == 0.0 {
        // An all-zero reference (T=1: the softmax over one key has no gradient, so dQ = dK = 0)
        // has no relative error; the output must then be zero up to rounding, so measure the
        // absolute norm against the same tolerance.
        return num.sqrt();
    }
    (num / den).sqrt()
}

/// Checks `err <= tol`, printing the measurement either way.
fn expect_within(test: &str, what: &str, err: f64, tol: f64) {
    report(&format!(
        "{test}: {what}: rel err {err:.3e} (tol {tol:.0e})"
    ));
    assert!(err <= tol, "{test}: {what}: rel err {err:.3e} > {tol:.0e}");
}

/// Declares `#[test]`s that each run one generic case function in one element type over a
/// table of cases: `name: case::<T>(CASES, seed S, tol A, B);` becomes the test `name`, which
/// calls `case::<T>(TEST, &dev, &gemm, CASES[i], S + i, A, B)` for every i (TEST: the test's
/// name), or prints `skipped:` and passes without a GPU. Attributes before a test (its doc
/// comment, which states the tolerances) go to it.
macro_rules! case_table_tests {
    ($(
        $(#[$attr:meta])*
        $name:ident: $case:ident::<$t:ty>($cases:expr, seed $seed:literal, tol $($tol:expr),+);
    )+) => {$(
        $(#[$attr])*
        #[test]
        #[ignore = "needs a CUDA GPU (run with --include-ignored)"]
        fn $name() {
            const TEST: &str = stringify!($name);
            let Some((dev, gemm)) = gpu_or_skip(TEST) else {
                return;
            };
            for (i, &case) in $cases.iter().enumerate() {
                $case::<$t>(TEST, &dev, &gemm, case, $seed + i as u64, $($tol),+);
            }
        }
    )+};
}

// ---- the raw strided-batched matmul ----

/// `C_i = alpha op(A_i) op(B_i) + beta C_i` in f64, row-major, for every batch entry; entries of
/// `c` outside the matrices are left as they are.
fn naive_matmul(spec: &MatmulSpec, a: &[f64], b: &[f64], c: &mut [f64]) {
    let at = |x: &[f64], o: &Operand, bi: usize, r: usize, col: usize| match o.transpose {
        Transpose::No => x[bi * o.batch_stride + r * o.ld + col],
        Transpose::Yes => x[bi * o.batch_stride + col * o.ld + r],
    };
    for bi in 0..spec.batch {
        for i in 0..spec.m {
            for j in 0..spec.n {
                let acc: f64 = (0..spec.k)
                    .map(|p| at(a, &spec.a, bi, i, p) * at(b, &spec.b, bi, p, j))
                    .sum();
                let ci = bi * spec.c_batch_stride + i * spec.c_ld + j;
                let prev = if spec.beta == 0.0 { 0.0 } else { c[ci] };
                c[ci] = spec.alpha as f64 * acc + spec.beta as f64 * prev;
            }
        }
    }
}

fn operand_len(o: &Operand, rows: usize, cols: usize, batch: usize) -> usize {
    let (r, c) = match o.transpose {
        Transpose::No => (rows, cols),
        Transpose::Yes => (cols, rows),
    };
    let _ = c;
    (batch - 1) * o.batch_stride + (r - 1) * o.ld + o.ld
}

fn matmul_case<I: Elem, O: Elem>(test: &str, dev: &GpuDevice, gemm: &Gemm, tol: f64, seed: u64) {
    let s = dev.stream();
    let mut rng = rng(seed);
    let (m, n, k, batch) = (37, 29, 53, 3);
    for ta in [Transpose::No, Transpose::Yes] {
        for tb in [Transpose::No, Transpose::Yes] {
            for beta in [0.0f32, 0.5] {
                // Padded leading dimensions and batch strides: the padding must stay untouched.
                let a_cols = if ta == Transpose::No { k } else { m };
                let a_rows = if ta == Transpose::No { m } else { k };
                let b_cols = if tb == Transpose::No { n } else { k };
                let b_rows = if tb == Transpose::No { k } else { n };
                let a_op = Operand {
                    transpose: ta,
                    ld: a_cols + 3,
                    batch_stride: a_rows * (a_cols + 3) + 5,
                };
                let b_op = Operand {
                    transpose: tb,
                    ld: b_cols + 1,
                    batch_stride: b_rows * (b_cols + 1) + 2,
                };
                let spec = MatmulSpec {
                    m,
                    n,
                    k,
                    batch,
                    a: a_op,
                    b: b_op,
                    c_ld: n + 2,
                    c_batch_stride: m * (n + 2) + 7,
                    alpha: 0.75,
                    beta,
                };
                let a_len = operand_len(&a_op, m, k, batch);
                let b_len = operand_len(&b_op, k, n, batch);
                let c_len = (batch - 1) * spec.c_batch_stride + m * spec.c_ld;
                let (a, a64) = random::<I>(&mut rng, a_len, 0.05, 1.0);
                let (b, b64) = random::<I>(&mut rng, b_len, 0.05, 1.0);
                // With beta = 0, C starts as NaN: it must not be read. Otherwise random values;
                // in both cases the padding between rows and matrices is NaN and must stay NaN.
                let (c0, c064) = random::<O>(&mut rng, c_len, 0.05, 1.0);
                let mut c_host = vec![O::NAN; c_len];
                let mut want = vec![f64::NAN; c_len];
                for bi in 0..batch {
                    for i in 0..m {
                        for j in 0..n {
                            let ci = bi * spec.c_batch_stride + i * spec.c_ld + j;
                            if beta != 0.0 {
                                c_host[ci] = c0[ci];
                                want[ci] = c064[ci];
                            }
                        }
                    }
                }
                naive_matmul(&spec, &a64, &b64, &mut want);
                let (da, db) = (upload(s, &a), upload(s, &b));
                let mut dc = upload(s, &c_host);
                gemm.matmul::<I, O>(&spec, &da, &db, &mut dc).unwrap();
                let got = download_f64(dev, &dc);
                let (mut g, mut w) = (Vec::new(), Vec::new());
                for (idx, (&gv, &wv)) in got.iter().zip(&want).enumerate() {
                    if wv.is_nan() {
                        assert!(
                            gv.is_nan(),
                            "{test}: padding element {idx} was written: {gv}"
                        );
                    } else {
                        g.push(gv);
                        w.push(wv);
                    }
                }
                let what = format!("{}->{} {ta:?}/{tb:?} beta={beta}", I::NAME, O::NAME);
                expect_within(test, &what, rel_err(&what, &g, &w), tol);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn matmul_strided_batched_matches_naive_reference() {
    const TEST: &str = "matmul_strided_batched_matches_naive_reference";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    matmul_case::<f32, f32>(TEST, &dev, &gemm, 1e-5, 1);
    matmul_case::<bf16, bf16>(TEST, &dev, &gemm, 1e-2, 2);
    matmul_case::<bf16, f32>(TEST, &dev, &gemm, 1e-3, 3);
    matmul_case::<f16, f16>(TEST, &dev, &gemm, 2e-3, 4);
    matmul_case::<f16, f32>(TEST, &dev, &gemm, 1e-3, 5);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn matmul_rejects_bad_specs() {
    const TEST: &str = "matmul_rejects_bad_specs";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    let s = dev.stream();
    let a = upload(s, &[1.0f32; 6]);
    let b = upload(s, &[1.0f32; 6]);
    let mut c = poisoned::<f32>(s, 4);
    // A 2x3 · B 3x2 fits; a short C, an ld below the column count, overlapping batch entries
    // and the type pairs f32 -> bf16, f32 -> f16, bf16 -> f16, f16 -> bf16 do not.
    let ok = MatmulSpec::new(2, 2, 3, Operand::plain(3), Operand::plain(2));
    gemm.matmul::<f32, f32>(&ok, &a, &b, &mut c).unwrap();
    let mut short = poisoned::<f32>(s, 3);
    assert!(gemm.matmul::<f32, f32>(&ok, &a, &b, &mut short).is_err());
    let bad_ld = MatmulSpec::new(2, 2, 3, Operand::plain(2), Operand::plain(2));
    assert!(gemm.matmul::<f32, f32>(&bad_ld, &a, &b, &mut c).is_err());
    let mut overlap = ok;
    overlap.batch = 2;
    overlap.c_batch_stride = 1;
    let mut big = poisoned::<f32>(s, 64);
    let a_big = upload(s, &vec![1.0f32; 64]);
    assert!(
        gemm.matmul::<f32, f32>(&overlap, &a_big, &a_big, &mut big)
            .is_err()
    );
    let mut c16 = poisoned::<bf16>(s, 4);
    assert!(gemm.matmul::<f32, bf16>(&ok, &a, &b, &mut c16).is_err());
    let mut ch = poisoned::<f16>(s, 4);
    assert!(gemm.matmul::<f32, f16>(&ok, &a, &b, &mut ch).is_err());
    let (a16, b16) = (upload(s, &[bf16::ONE; 6]), upload(s, &[bf16::ONE; 6]));
    assert!(gemm.matmul::<bf16, f16>(&ok, &a16, &b16, &mut ch).is_err());
    let (ah, bh) = (upload(s, &[f16::ONE; 6]), upload(s, &[f16::ONE; 6]));
    assert!(gemm.matmul::<f16, bf16>(&ok, &ah, &bh, &mut c16).is_err());
    assert!(download(&dev, &c16).iter().all(|v| v.is_nan()));
    assert!(download(&dev, &ch).iter().all(|v| v.is_nan()));
    let got = download(&dev, &c);
    assert_eq!(got, vec![3.0f32; 4]);
}

// ---- the linear layer ----

/// (rows, in_features, out_features, bias): a small odd case, the Llama-134m MLP and attention
/// projections (hidden 768 <-> intermediate 2048) at 4 x 1000 tokens, and the 32003-word LM head.
const LINEAR_CASES: &[(usize, usize, usize, bool)] = &[
    (37, 80, 53, true),
    (4000, 768, 2048, true),
    (4000, 2048, 768, false),
    (4000, 768, 32003, true),
];

/// Up to `n` sorted distinct indices below `len` (all of them when `len <= n`), always with the
/// first and the last.
fn sample(rng: &mut ChaCha8Rng, len: usize, n: usize) -> Vec<usize> {
    if len <= n {
        return (0..len).collect();
    }
    let mut v: Vec<usize> = (0..n - 2).map(|_| rng.random_range(0..len)).collect();
    v.push(0);
    v.push(len - 1);
    v.sort_unstable();
    v.dedup();
    v
}

fn gather_rows(x: &[f64], cols: usize, rows: &[usize]) -> Vec<f64> {
    rows.iter()
        .flat_map(|&r| x[r * cols..(r + 1) * cols].iter().copied())
        .collect()
}

fn gather_cols(x: &[f64], cols: usize, pick: &[usize]) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|row| pick.iter().map(move |&j| row[j]))
        .collect()
}

/// Forward and backward of one linear case in type `T`; `tol_t` for `T` outputs (out, dx),
/// `tol_f32` for the f32 accumulations (dW, db).
fn linear_case<T: Elem>(
    test: &str,
    dev: &GpuDevice,
    gemm: &Gemm,
    case: (usize, usize, usize, bool),
    seed: u64,
    tol_t: f64,
    tol_f32: f64,
) {
    let (rows, in_f, out_f, with_bias) = case;
    let tag = format!(
        "{}: rows={rows} in={in_f} out={out_f} bias={with_bias}",
        T::NAME
    );
    let s = dev.stream();
    let mut rng = rng(seed);
    let (x, x64) = random::<T>(&mut rng, rows * in_f, 0.05, 1.0);
    let (w, w64) = random::<T>(&mut rng, out_f * in_f, 0.05, 1.0);
    let (b, b64) = random::<T>(&mut rng, out_f, 0.05, 1.0);
    let (dout, dout64) = random::<T>(&mut rng, rows * out_f, 0.05, 1.0);
    // Non-zero initial parameter gradients: the backward must add to them.
    let (dw0, dw064) = random::<f32>(&mut rng, out_f * in_f, 0.05, 1.0);
    let (db0, db064) = random::<f32>(&mut rng, out_f, 0.05, 1.0);
    // Another layer's input gradient, for linear_input_grad_add to add onto.
    let (dx_other, dx_other64) = random::<T>(&mut rng, rows * in_f, 0.05, 1.0);

    let (dx_, dw_) = (upload(s, &x), upload(s, &w));
    let dbias = upload(s, &b);
    let mut out = poisoned::<T>(s, rows * out_f);
    let bias_arg: Option<&dyn DevicePtr<T>> = if with_bias { Some(&dbias) } else { None };
    cuda::linear_forward(gemm, &dx_, &dw_, bias_arg, rows, in_f, out_f, &mut out).unwrap();
    let ddout = upload(s, &dout);
    let mut dx = poisoned::<T>(s, rows * in_f);
    let mut dw = upload(s, &dw0);
    let mut db = upload(s, &db0);
    cuda::linear_backward(
        gemm,
        &ddout,
        &dx_,
        &dw_,
        rows,
        in_f,
        out_f,
        Some(&mut dx),
        &mut dw,
        if with_bias { Some(&mut db) } else { None },
    )
    .unwrap();
    let mut dx_sum = upload(s, &dx_other);
    cuda::linear_input_grad_add(gemm, &ddout, &dw_, rows, in_f, out_f, &mut dx_sum).unwrap();
    let dx_sum = download_f64(dev, &dx_sum);
    let (out, dx, dw, db) = (
        download_f64(dev, &out),
        download_f64(dev, &dx),
        download_f64(dev, &dw),
        download_f64(dev, &db),
    );
    all_finite("out", &out);
    all_finite("dx", &dx);
    all_finite("dw", &dw);

    // The f64 reference on sampled rows (out, dx are row-wise) and sampled output features
    // (dW rows), so the 32003-feature case stays cheap on the host; db in full.
    let rs = sample(&mut rng, rows, 48);
    let js = sample(&mut rng, out_f, 48);
    let x_r = gather_rows(&x64, in_f, &rs);
    let mut out_ref = vec![f64::NAN; rs.len() * out_f];
    cpu::linear_forward(
        &x_r,
        &w64,
        with_bias.then_some(&b64[..]),
        rs.len(),
        in_f,
        out_f,
        &mut out_ref,
    )
    .unwrap();
    let dout_r = gather_rows(&dout64, out_f, &rs);
    let mut dx_ref = vec![f64::NAN; rs.len() * in_f];
    let mut scratch_dw = vec![0.0; out_f * in_f];
    cpu::linear_backward(
        &dout_r,
        &x_r,
        &w64,
        rs.len(),
        in_f,
        out_f,
        Some(&mut dx_ref),
        &mut scratch_dw,
        None,
    )
    .unwrap();
    let dout_j = gather_cols(&dout64, out_f, &js);
    let w_j = gather_rows(&w64, in_f, &js);
    let mut dw_ref = gather_rows(&dw064, in_f, &js);
    cpu::linear_backward(
        &dout_j,
        &x64,
        &w_j,
        rows,
        in_f,
        js.len(),
        None,
        &mut dw_ref,
        None,
    )
    .unwrap();
    expect_within(
        test,
        &format!("{tag}: out"),
        rel_err("out", &gather_rows(&out, out_f, &rs), &out_ref),
        tol_t,
    );
    expect_within(
        test,
        &format!("{tag}: dx"),
        rel_err("dx", &gather_rows(&dx, in_f, &rs), &dx_ref),
        tol_t,
    );
    let dx_sum_ref: Vec<f64> = gather_rows(&dx_other64, in_f, &rs)
        .iter()
        .zip(&dx_ref)
        .map(|(a, b)| a + b)
        .collect();
    expect_within(
        test,
        &format!("{tag}: dx += (linear_input_grad_add)"),
        rel_err("dx_sum", &gather_rows(&dx_sum, in_f, &rs), &dx_sum_ref),
        tol_t,
    );
    expect_within(
        test,
        &format!("{tag}: dW (+=)"),
        rel_err("dw", &gather_rows(&dw, in_f, &js), &dw_ref),
        tol_f32,
    );
    if with_bias {
        let mut db_ref = db064.clone();
        for r in 0..rows {
            for (d, g) in db_ref.iter_mut().zip(&dout64[r * out_f..(r + 1) * out_f]) {
                *d += g;
            }
        }
        expect_within(
            test,
            &format!("{tag}: db (+=)"),
            rel_err("db", &db, &db_ref),
            1e-5,
        );
    } else {
        // Without a bias gradient requested, db is untouched.
        assert_eq!(db, db064, "{tag}: db was written without being requested");
    }
}

case_table_tests! {
    /// f32: 1e-5 for every output (no TF32; see the file header).
    linear_f32_matches_cpu_reference: linear_case::<f32>(LINEAR_CASES, seed 10, tol 1e-5, 1e-5);
    /// bf16: out and dx (bf16) 1e-2; dW (f32 accumulation of exact bf16 products) 1e-3; db (f32
    /// sums in the reduction kernel) 1e-5.
    linear_bf16_matches_cpu_reference:
        linear_case::<bf16>(LINEAR_CASES, seed 20, tol 1e-2, 1e-3);
    /// f16: out and dx (f16) 2e-3 (one rounding of 2^-11 after an f32 sum, see the file
    /// header); dW (f32 accumulation of exact f16 products) 1e-3; db 1e-5. The largest values
    /// (dx of the 32003-feature LM head, ~|300|) stay far below f16's 65504.
    linear_f16_matches_cpu_reference: linear_case::<f16>(LINEAR_CASES, seed 25, tol 2e-3, 1e-3);
}

/// Two identical linear backwards in type `T` give bit-identical dW and db (1000 rows: the
/// bias gradient takes its two-pass path).
fn linear_determinism_case<T: Elem>(test: &str, dev: &GpuDevice, gemm: &Gemm, seed: u64) {
    let s = dev.stream();
    let (rows, in_f, out_f) = (1000, 96, 301);
    let mut rng = rng(seed);
    let (x, _) = random::<T>(&mut rng, rows * in_f, 0.05, 1.0);
    let (w, _) = random::<T>(&mut rng, out_f * in_f, 0.05, 1.0);
    let (dout, _) = random::<T>(&mut rng, rows * out_f, 0.05, 1.0);
    let (x, w, dout) = (upload(s, &x), upload(s, &w), upload(s, &dout));
    let run = || {
        let mut dw = upload(s, &vec![0.25f32; out_f * in_f]);
        let mut db = upload(s, &vec![0.25f32; out_f]);
        cuda::linear_backward(
            gemm,
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
        (download(dev, &dw), download(dev, &db))
    };
    let (a, b) = (run(), run());
    let same = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
    assert!(
        same(&a.0, &b.0),
        "{}: dW differs between two identical runs",
        T::NAME
    );
    assert!(
        same(&a.1, &b.1),
        "{}: db differs between two identical runs",
        T::NAME
    );
    report(&format!(
        "{test}: {}: dW and db bit-identical over two runs",
        T::NAME
    ));
}

/// `WeightGrad::Write` over a NaN-filled dW gives the bits of `WeightGrad::Add` onto zeros
/// (the CUDA-graph step's first products write gradients nobody zeroed), the bias gradient is
/// still added, and a product over zero rows writes zeros.
fn weight_grad_write_case<T: Elem>(test: &str, dev: &GpuDevice, gemm: &Gemm, seed: u64) {
    let s = dev.stream();
    let (rows, in_f, out_f) = (777, 96, 301);
    let mut rng = rng(seed);
    let (x, _) = random::<T>(&mut rng, rows * in_f, 0.05, 1.0);
    let (w, _) = random::<T>(&mut rng, out_f * in_f, 0.05, 1.0);
    let (dout, _) = random::<T>(&mut rng, rows * out_f, 0.05, 1.0);
    let (x, w, dout) = (upload(s, &x), upload(s, &w), upload(s, &dout));
    let run = |rows: usize, mut dw: CudaSlice<f32>, mode: WeightGrad| {
        let mut db = upload(s, &vec![0.5f32; out_f]);
        cuda::linear_backward_with(
            gemm,
            &dout.slice(..rows * out_f),
            &x.slice(..rows * in_f),
            &w,
            rows,
            in_f,
            out_f,
            None,
            &mut dw,
            Some(&mut db),
            mode,
        )
        .unwrap();
        (download(dev, &dw), download(dev, &db))
    };
    let zeros = || upload(s, &vec![0.0f32; out_f * in_f]);
    let (added, db_added) = run(rows, zeros(), WeightGrad::Add);
    let (written, db_written) = run(rows, poisoned::<f32>(s, out_f * in_f), WeightGrad::Write);
    let differing = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .filter(|(p, q)| p.to_bits() != q.to_bits())
            .count()
    };
    assert!(added.iter().any(|v| *v != 0.0), "{test}: dW is all zeros");
    assert_eq!(
        differing(&added, &written),
        0,
        "{test}: {}: written dW differs from dW added onto zeros",
        T::NAME
    );
    assert_eq!(differing(&db_added, &db_written), 0, "{test}: db");
    assert!(
        db_written.iter().all(|v| *v != 0.5),
        "{test}: db was not added to"
    );
    let (empty, _) = run(0, poisoned::<f32>(s, out_f * in_f), WeightGrad::Write);
    assert!(
        empty.iter().all(|v| v.to_bits() == 0),
        "{test}: {}: a product over zero rows did not write zeros",
        T::NAME
    );
    report(&format!(
        "{test}: {}: written dW = dW added onto zeros bit for bit ({} values), zero rows write \
         zeros",
        T::NAME,
        added.len()
    ));
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn a_written_weight_gradient_equals_one_added_onto_zeros() {
    const TEST: &str = "a_written_weight_gradient_equals_one_added_onto_zeros";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    weight_grad_write_case::<f32>(TEST, &dev, &gemm, 33);
    weight_grad_write_case::<bf16>(TEST, &dev, &gemm, 34);
    weight_grad_write_case::<f16>(TEST, &dev, &gemm, 35);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn linear_backward_is_deterministic() {
    const TEST: &str = "linear_backward_is_deterministic";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    linear_determinism_case::<f32>(TEST, &dev, &gemm, 30);
    linear_determinism_case::<bf16>(TEST, &dev, &gemm, 31);
    linear_determinism_case::<f16>(TEST, &dev, &gemm, 32);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn linear_rejects_bad_lengths() {
    const TEST: &str = "linear_rejects_bad_lengths";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    let s = dev.stream();
    let (rows, in_f, out_f) = (5, 3, 4);
    let x = upload(s, &vec![1.0f32; rows * in_f]);
    let w = upload(s, &vec![1.0f32; out_f * in_f]);
    let short_bias = upload(s, &vec![1.0f32; out_f - 1]);
    let mut out = poisoned::<f32>(s, rows * out_f);
    let err = cuda::linear_forward(&gemm, &x, &w, None, rows, in_f + 1, out_f, &mut out);
    assert!(
        matches!(err, Err(OpsError::ShapeMismatch { .. })),
        "{err:?}"
    );
    let err = cuda::linear_forward(
        &gemm,
        &x,
        &w,
        Some(&short_bias),
        rows,
        in_f,
        out_f,
        &mut out,
    );
    assert!(
        matches!(err, Err(OpsError::ShapeMismatch { .. })),
        "{err:?}"
    );
    let mut dw_short = upload(s, &vec![0.0f32; out_f * in_f - 1]);
    let err = cuda::linear_backward(
        &gemm,
        &out,
        &x,
        &w,
        rows,
        in_f,
        out_f,
        None,
        &mut dw_short,
        None,
    );
    assert!(
        matches!(err, Err(OpsError::ShapeMismatch { .. })),
        "{err:?}"
    );
    // Nothing was launched: out is still poisoned.
    assert!(download(&dev, &out).iter().all(|v| v.is_nan()));
}

// ---- attention ----

/// (batch, seq, q_heads, kv_heads, head_dim): Llama-style GQA at T = 1000 (not a multiple of
/// any tile), odd small shapes with D = 80, plain multi-head, and a single token.
const ATTN_CASES: &[(usize, usize, usize, usize, usize)] = &[
    (2, 1000, 12, 4, 64),
    (3, 37, 6, 2, 80),
    (2, 37, 4, 4, 80),
    (2, 1, 2, 1, 16),
];

struct AttnRun {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    bits: Vec<u32>,
}

/// Forward then backward on the GPU through `imp` with NaN-poisoned outputs; `bits` collects
/// every output's bit pattern for the determinism check.
#[allow(clippy::too_many_arguments)]
fn attn_gpu<T: Elem>(
    dev: &GpuDevice,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    imp: AttentionImpl,
    s: AttnShape,
    q: &CudaSlice<T>,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    dout: &CudaSlice<T>,
) -> AttnRun {
    let st = dev.stream();
    let (ql, kvl, rl) = (q.len(), k.len(), s.batch * s.q_heads * s.seq);
    let mut out = poisoned::<T>(st, ql);
    let mut lse = poisoned::<f32>(st, rl);
    cuda::attention_forward_with(imp, gemm, ws, s, q, k, v, &mut out, &mut lse).unwrap();
    let (mut dq, mut dk, mut dv) = (
        poisoned::<T>(st, ql),
        poisoned::<T>(st, kvl),
        poisoned::<T>(st, kvl),
    );
    cuda::attention_backward_with(
        imp, gemm, ws, s, dout, q, k, v, &out, &lse, &mut dq, &mut dk, &mut dv,
    )
    .unwrap();
    let raw: Vec<Vec<T>> = [&out, &dq, &dk, &dv]
        .iter()
        .map(|b| download(dev, b))
        .collect();
    let lse_h = download(dev, &lse);
    let mut bits: Vec<u32> = raw.iter().flatten().map(|x| x.bits()).collect();
    bits.extend(lse_h.iter().map(|x| x.to_bits()));
    let f = |v: &Vec<T>| v.iter().map(|x| x.to_f64()).collect::<Vec<f64>>();
    AttnRun {
        out: f(&raw[0]),
        lse: lse_h.iter().map(|&x| x as f64).collect(),
        dq: f(&raw[1]),
        dk: f(&raw[2]),
        dv: f(&raw[3]),
        bits,
    }
}

fn attn_shape(case: (usize, usize, usize, usize, usize)) -> AttnShape {
    let (batch, seq, q_heads, kv_heads, head_dim) = case;
    AttnShape {
        batch,
        seq,
        q_heads,
        kv_heads,
        head_dim,
    }
}

/// Fresh random inputs of one attention case in type `T`, on the device, with the f64 CPU
/// reference computed from their exact values.
struct AttnProblem<T: Elem> {
    s: AttnShape,
    tag: String,
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    dout: CudaSlice<T>,
    out_ref: Vec<f64>,
    lse_ref: Vec<f64>,
    dq_ref: Vec<f64>,
    dk_ref: Vec<f64>,
    dv_ref: Vec<f64>,
}

impl<T: Elem> AttnProblem<T> {
    fn new(dev: &GpuDevice, s: AttnShape, seed: u64) -> Self {
        let tag = format!(
            "{}: B={} T={} Hq={} Hkv={} D={}",
            T::NAME,
            s.batch,
            s.seq,
            s.q_heads,
            s.kv_heads,
            s.head_dim
        );
        let st = dev.stream();
        let mut rng = rng(seed);
        let ql = s.batch * s.seq * s.q_heads * s.head_dim;
        let kvl = s.batch * s.seq * s.kv_heads * s.head_dim;
        // |q|, |k| up to 2: scores of std ~1.3, so the softmax is neither uniform nor one-hot.
        let (q, q64) = random::<T>(&mut rng, ql, 0.05, 2.0);
        let (k, k64) = random::<T>(&mut rng, kvl, 0.05, 2.0);
        let (v, v64) = random::<T>(&mut rng, kvl, 0.05, 1.0);
        let (dout, dout64) = random::<T>(&mut rng, ql, 0.05, 1.0);
        let mut out_ref = vec![f64::NAN; ql];
        let mut lse_ref = vec![f64::NAN; s.batch * s.q_heads * s.seq];
        cpu::attention_forward(s, &q64, &k64, &v64, &mut out_ref, &mut lse_ref).unwrap();
        let (mut dq_ref, mut dk_ref, mut dv_ref) =
            (vec![f64::NAN; ql], vec![f64::NAN; kvl], vec![f64::NAN; kvl]);
        cpu::attention_backward(
            s,
            &dout64,
            &q64,
            &k64,
            &v64,
            &out_ref,
            &lse_ref,
            &mut dq_ref,
            &mut dk_ref,
            &mut dv_ref,
        )
        .unwrap();
        AttnProblem {
            s,
            tag,
            q: upload(st, &q),
            k: upload(st, &k),
            v: upload(st, &v),
            dout: upload(st, &dout),
            out_ref,
            lse_ref,
            dq_ref,
            dk_ref,
            dv_ref,
        }
    }

    fn run(&self, dev: &GpuDevice, gemm: &Gemm, ws: &mut AttentionWorkspace) -> AttnRun {
        self.run_with(dev, gemm, ws, AttentionImpl::Auto)
    }

    fn run_with(
        &self,
        dev: &GpuDevice,
        gemm: &Gemm,
        ws: &mut AttentionWorkspace,
        imp: AttentionImpl,
    ) -> AttnRun {
        attn_gpu(
            dev, gemm, ws, imp, self.s, &self.q, &self.k, &self.v, &self.dout,
        )
    }

    /// Two runs through `imp`, which must be bit-identical (forward and backward), the first
    /// checked against the reference (as in `check`, `label` after the tag) and returned.
    #[allow(clippy::too_many_arguments)]
    fn run_twice_checked(
        &self,
        test: &str,
        dev: &GpuDevice,
        gemm: &Gemm,
        ws: &mut AttentionWorkspace,
        imp: AttentionImpl,
        label: &str,
        tol_t: f64,
        tol_lse: f64,
    ) -> AttnRun {
        let tag = &self.tag;
        let first = self.run_with(dev, gemm, ws, imp);
        let second = self.run_with(dev, gemm, ws, imp);
        assert!(
            first.bits == second.bits,
            "{tag}{label}: two runs differ (forward or backward)"
        );
        self.check(test, &first, label, tol_t, tol_lse);
        report(&format!(
            "{test}: {tag}{label}: forward and backward bit-identical over two runs"
        ));
        first
    }

    /// Every output of `run` against the reference: `tol_t` for the `T` outputs, `tol_lse`
    /// for the f32 log-sum-exp.
    fn check(&self, test: &str, run: &AttnRun, label: &str, tol_t: f64, tol_lse: f64) {
        let tag = &self.tag;
        let t_outputs = [
            ("out", &run.out, &self.out_ref),
            ("dq", &run.dq, &self.dq_ref),
            ("dk", &run.dk, &self.dk_ref),
            ("dv", &run.dv, &self.dv_ref),
        ];
        for (what, got, want) in t_outputs {
            expect_within(
                test,
                &format!("{tag}{label}: {what}"),
                rel_err(what, got, want),
                tol_t,
            );
        }
        expect_within(
            test,
            &format!("{tag}{label}: lse"),
            rel_err("lse", &run.lse, &self.lse_ref),
            tol_lse,
        );
    }
}

/// One attention case in type `T` through the cuBLASLt path (forced: the flash kernels have
/// their own tests below): vs the f64 CPU reference, twice for bit-identity, and once more
/// through a workspace of one sequence (the multi-pass path).
fn attention_case<T: Elem>(
    test: &str,
    dev: &GpuDevice,
    gemm: &Gemm,
    case: (usize, usize, usize, usize, usize),
    seed: u64,
    tol_t: f64,
    tol_lse: f64,
) {
    let gemm_path = AttentionImpl::Gemm;
    let s = attn_shape(case);
    let st = dev.stream();
    let problem = AttnProblem::<T>::new(dev, s, seed);
    let mut ws = AttentionWorkspace::new(st, s, size_of::<T>()).unwrap();
    assert_eq!(
        ws.bytes(),
        AttentionWorkspace::bytes_for(s, size_of::<T>()).unwrap()
    );
    assert_eq!(ws.batch_chunk::<T>(s).unwrap(), s.batch);
    problem.run_twice_checked(test, dev, gemm, &mut ws, gemm_path, "", tol_t, tol_lse);
    if s.batch > 1 {
        let one = AttnShape { batch: 1, ..s };
        let mut small = AttentionWorkspace::new(st, one, size_of::<T>()).unwrap();
        let chunk = small.batch_chunk::<T>(s).unwrap();
        // Regions are rounded up to 256 bytes, so a tiny sequence (T = 1) may fit twice in a
        // workspace built for one; every real shape fits exactly once.
        if s.seq > 1 {
            assert_eq!(
                chunk, 1,
                "{}: chunk of a one-sequence workspace",
                problem.tag
            );
        }
        let c = problem.run_with(dev, gemm, &mut small, gemm_path);
        problem.check(
            test,
            &c,
            &format!(" ({chunk} sequence(s) per pass)"),
            tol_t,
            tol_lse,
        );
    }
}

case_table_tests! {
    /// f32: 1e-5 for out, lse, dq, dk, dv.
    attention_f32_matches_cpu_reference:
        attention_case::<f32>(ATTN_CASES, seed 40, tol 1e-5, 1e-5);
    /// bf16: out, dq, dk, dv (bf16, after P and dS are rounded to bf16) 1e-2; lse (f32 from
    /// exact bf16 products) 1e-3.
    attention_bf16_matches_cpu_reference:
        attention_case::<bf16>(ATTN_CASES, seed 50, tol 1e-2, 1e-3);
    /// f16: out, dq, dk, dv (f16, after P and dS are rounded to f16) 2e-3 — three roundings of
    /// 2^-11 in sequence at most, see the file header; lse (f32 from exact f16 products) 1e-3.
    attention_f16_matches_cpu_reference:
        attention_case::<f16>(ATTN_CASES, seed 55, tol 2e-3, 1e-3);
}

/// One step of `attention_workspace_serves_every_precision`: a fresh problem in `T` through
/// the shared workspace, checked against its reference.
#[allow(clippy::too_many_arguments)]
fn shared_workspace_step<T: Elem>(
    test: &str,
    dev: &GpuDevice,
    gemm: &Gemm,
    ws: &mut AttentionWorkspace,
    s: AttnShape,
    seed: u64,
    tol_t: f64,
    tol_lse: f64,
) {
    let problem = AttnProblem::<T>::new(dev, s, seed);
    let run = problem.run(dev, gemm, ws);
    problem.check(test, &run, " (shared f32-sized workspace)", tol_t, tol_lse);
}

/// One workspace sized for f32 serves f32, bf16 and f16 calls in sequence (the engine switches
/// precision between periods without reallocating), each as exact as with its own workspace,
/// and f32 again after the 16-bit calls left their data in it. A 16-bit call fits more
/// sequences per pass than the f32 one.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn attention_workspace_serves_every_precision() {
    const TEST: &str = "attention_workspace_serves_every_precision";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    let s = attn_shape((3, 37, 6, 2, 80));
    let mut ws = AttentionWorkspace::new(dev.stream(), s, size_of::<f32>()).unwrap();
    assert_eq!(ws.max_elem_bytes(), 4);
    for chunk in [
        ws.batch_chunk::<f32>(s).unwrap(),
        ws.batch_chunk::<bf16>(s).unwrap(),
        ws.batch_chunk::<f16>(s).unwrap(),
    ] {
        assert_eq!(chunk, s.batch);
    }
    // Twice the batch: f32 needs two passes, the 16-bit types fit more per pass.
    let wide = AttnShape { batch: 6, ..s };
    let f32_chunk = ws.batch_chunk::<f32>(wide).unwrap();
    let f16_chunk = ws.batch_chunk::<f16>(wide).unwrap();
    assert_eq!(f32_chunk, 3);
    assert!(f16_chunk > f32_chunk, "f16 chunk {f16_chunk}");
    assert_eq!(ws.batch_chunk::<bf16>(wide).unwrap(), f16_chunk);
    shared_workspace_step::<f32>(TEST, &dev, &gemm, &mut ws, s, 60, 1e-5, 1e-5);
    shared_workspace_step::<bf16>(TEST, &dev, &gemm, &mut ws, s, 61, 1e-2, 1e-3);
    shared_workspace_step::<f16>(TEST, &dev, &gemm, &mut ws, wide, 62, 2e-3, 1e-3);
    shared_workspace_step::<f32>(TEST, &dev, &gemm, &mut ws, wide, 63, 1e-5, 1e-5);
}

/// A workspace built for 2-byte elements serves bf16 and f16 but refuses f32 with an error
/// naming the element size, before launching anything.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn attention_workspace_refuses_wider_elements() {
    const TEST: &str = "attention_workspace_refuses_wider_elements";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    let st = dev.stream();
    let s = attn_shape((2, 5, 4, 2, 8));
    let mut ws = AttentionWorkspace::new(st, s, 2).unwrap();
    assert_eq!(ws.max_elem_bytes(), 2);
    let refused = |r: tilearn_ops::Result<usize>| match r {
        Err(OpsError::Cuda { message, .. }) => {
            assert!(message.contains("at most 2 bytes"), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    };
    refused(ws.batch_chunk::<f32>(s));
    let q = upload(st, &vec![0.5f32; 2 * 5 * 4 * 8]);
    let kv = upload(st, &vec![0.5f32; 2 * 5 * 2 * 8]);
    let mut out = poisoned::<f32>(st, q.len());
    let mut lse = poisoned::<f32>(st, 2 * 4 * 5);
    let err = cuda::attention_forward(&gemm, &mut ws, s, &q, &kv, &kv, &mut out, &mut lse);
    refused(err.map(|()| 0));
    let (mut dq, mut dk, mut dv) = (
        poisoned::<f32>(st, q.len()),
        poisoned::<f32>(st, kv.len()),
        poisoned::<f32>(st, kv.len()),
    );
    let err = cuda::attention_backward(
        &gemm, &mut ws, s, &q, &q, &kv, &kv, &q, &lse, &mut dq, &mut dk, &mut dv,
    );
    refused(err.map(|()| 0));
    assert!(
        download(&dev, &out).iter().all(|v| v.is_nan()),
        "a refused forward wrote out"
    );
    assert!(
        download(&dev, &dq).iter().all(|v| v.is_nan()),
        "a refused backward wrote dq"
    );
    // The same workspace serves the 16-bit types.
    assert_eq!(ws.batch_chunk::<bf16>(s).unwrap(), 2);
    let problem = AttnProblem::<f16>::new(&dev, s, 70);
    let run = problem.run(&dev, &gemm, &mut ws);
    problem.check(TEST, &run, " (2-byte workspace)", 2e-3, 1e-3);
}

/// Host only (runs without a GPU): the workspace size needs an element size of 2 or 4 bytes,
/// grows with it, and is what `new` would allocate for the shape.
#[test]
fn attention_workspace_size_checks_element_size() {
    let s = attn_shape((2, 37, 6, 2, 80));
    for bad in [0, 1, 3, 8] {
        match AttentionWorkspace::bytes_for(s, bad) {
            Err(OpsError::Cuda { message, .. }) => {
                assert!(message.contains("max_elem_bytes"), "{message}")
            }
            other => panic!("max_elem_bytes {bad}: expected an error, got {other:?}"),
        }
    }
    let two = AttentionWorkspace::bytes_for(s, 2).unwrap();
    let four = AttentionWorkspace::bytes_for(s, 4).unwrap();
    // S and delta are f32 in both; P and the six per-head copies double.
    let ld = 40; // 37 rounded up to 8
    let elems = 2 * (6 * 37 * ld + 2 * 6 * 37 * 80 + 3 * 2 * 37 * 80);
    let f32s = 2 * (6 * 37 * ld + 6 * 37);
    assert!(two >= 4 * f32s + 2 * elems, "{two}");
    assert!(four >= 4 * f32s + 4 * elems, "{four}");
    // Padding: at most 256 bytes per region (8) plus the 256 of alignment slack.
    assert!(two <= 4 * f32s + 2 * elems + 9 * 256, "{two}");
    assert!(four <= 4 * f32s + 4 * elems + 9 * 256, "{four}");
    assert!(
        AttentionWorkspace::bytes_for(AttnShape { kv_heads: 4, ..s }, 2).is_err(),
        "q_heads 6 is not a multiple of kv_heads 4"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn attention_rejects_bad_shapes() {
    const TEST: &str = "attention_rejects_bad_shapes";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    let st = dev.stream();
    let s = AttnShape {
        batch: 2,
        seq: 5,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let mut ws = AttentionWorkspace::new(st, s, size_of::<f32>()).unwrap();
    let q = upload(st, &vec![0.5f32; 2 * 5 * 4 * 8]);
    let kv = upload(st, &vec![0.5f32; 2 * 5 * 2 * 8]);
    let mut out = poisoned::<f32>(st, q.len());
    let mut lse = poisoned::<f32>(st, 2 * 4 * 5);
    // q_heads not a multiple of kv_heads.
    let bad = AttnShape { kv_heads: 3, ..s };
    assert!(
        cuda::attention_forward(&gemm, &mut ws, bad, &q, &kv, &kv, &mut out, &mut lse).is_err()
    );
    // k and v swapped for q-sized buffers.
    assert!(cuda::attention_forward(&gemm, &mut ws, s, &q, &q, &q, &mut out, &mut lse).is_err());
    // A sequence that exceeds the whole workspace. The check is by bytes over all regions
    // (each rounded up to 256 bytes; score rows padded to 8): two f32 sequences of 5 take
    // 7680 bytes of regions, one sequence of 8 needs 5888 and legitimately fits, one of 16
    // needs 8192 for S and P alone and does not.
    assert_eq!(
        ws.batch_chunk::<f32>(AttnShape {
            seq: 8,
            batch: 1,
            ..s
        })
        .unwrap(),
        1
    );
    let long = AttnShape {
        seq: 16,
        batch: 1,
        ..s
    };
    let q6 = upload(st, &vec![0.5f32; 16 * 4 * 8]);
    let kv6 = upload(st, &vec![0.5f32; 16 * 2 * 8]);
    let mut out6 = poisoned::<f32>(st, q6.len());
    let mut lse6 = poisoned::<f32>(st, 4 * 16);
    assert!(ws.batch_chunk::<f32>(long).is_err());
    assert!(
        cuda::attention_forward(&gemm, &mut ws, long, &q6, &kv6, &kv6, &mut out6, &mut lse6)
            .is_err()
    );
    assert!(
        download(&dev, &out).iter().all(|v| v.is_nan()),
        "a rejected call wrote out"
    );
}

// ---- flash attention (the fused kernels of tilearn-kernels' flash_attention.cu) ----

/// (batch, seq, q_heads, kv_heads, head_dim) for the flash kernels (bf16 / f16, head_dim 64 and
/// 128): a single token; T = 2 with a batch of 200, whose delta (f32 [B, Hq, T]) outgrows the
/// one-sequence workspace and goes to a temporary buffer; T = 17 and 200 (one partial tile);
/// T = 129 (one row past two 64-row tiles); T = 1000 (not a multiple of any tile) with GQA
/// groups of 4 at D = 64 and D = 128; plain multi-head; B > 1 throughout but one. On Hopper the
/// D = 64 cases run the wgmma kernels (key blocks of 128 in the forward): T = 130 and 300 (GQA
/// group of 8, TinyLlama's) cross that tile by a few rows.
const FLASH_CASES: &[(usize, usize, usize, usize, usize)] = &[
    (2, 1, 4, 2, 64),
    (2, 130, 4, 4, 64),
    (2, 300, 16, 2, 64),
    (200, 2, 4, 2, 64),
    (3, 17, 8, 2, 64),
    (2, 200, 4, 4, 128),
    (2, 129, 6, 3, 128),
    (2, 1000, 8, 2, 64),
    (1, 1000, 4, 1, 128),
];

/// ‖a − b‖₂ / ‖reference‖₂ (the absolute norm where the reference is all zeros, as in
/// [`rel_err`]): how far two GPU results lie apart, on the scale of the exact answer (for the
/// T = 1 case both are ~0, so a relative difference between them would divide noise by noise).
fn rel_diff(what: &str, a: &[f64], b: &[f64], reference: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "{what}: length");
    all_finite(what, a);
    all_finite(what, b);
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = reference.iter().map(|w| w * w).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// One flash case in `T`: the fused kernels (forced) vs the f64 CPU reference, twice for
/// bit-identity (forward and backward), the cuBLASLt path vs the same reference, the two paths
/// against each other, and `Auto` bit-identical to the path it resolves to. The workspace holds
/// one sequence (the engine's sizing; the flash path only keeps delta in it), so the flash
/// backward is the deterministic one; the one-pass backward (Hopper, head_dim 64: a
/// `FlashBackward::OnePass` flash workspace) is then checked against the same reference with
/// the same bounds.
#[allow(clippy::too_many_arguments)]
fn flash_case<T: Elem>(
    test: &str,
    dev: &GpuDevice,
    gemm: &Gemm,
    case: (usize, usize, usize, usize, usize),
    seed: u64,
    tol_t: f64,
    tol_lse: f64,
) {
    let s = attn_shape(case);
    assert!(cuda::flash_attention_supports::<T>(s), "{s:?}");
    let problem = AttnProblem::<T>::new(dev, s, seed);
    let one = AttnShape { batch: 1, ..s };
    let mut ws = AttentionWorkspace::new(dev.stream(), one, size_of::<T>()).unwrap();
    let (imp, label) = (AttentionImpl::Flash, " (flash)");
    let flash = problem.run_twice_checked(test, dev, gemm, &mut ws, imp, label, tol_t, tol_lse);
    let gemm_run = problem.run_with(dev, gemm, &mut ws, AttentionImpl::Gemm);
    problem.check(test, &gemm_run, " (gemm)", tol_t, tol_lse);
    let pairs = [
        ("out", &flash.out, &gemm_run.out, &problem.out_ref, tol_t),
        ("dq", &flash.dq, &gemm_run.dq, &problem.dq_ref, tol_t),
        ("dk", &flash.dk, &gemm_run.dk, &problem.dk_ref, tol_t),
        ("dv", &flash.dv, &gemm_run.dv, &problem.dv_ref, tol_t),
        ("lse", &flash.lse, &gemm_run.lse, &problem.lse_ref, tol_lse),
    ];
    for (what, a, b, reference, tol) in pairs {
        expect_within(
            test,
            &format!("{}: flash vs gemm: {what}", problem.tag),
            rel_diff(what, a, b, reference),
            tol,
        );
    }
    let mut one_pass_ws =
        AttentionWorkspace::for_flash(dev.stream(), s, FlashBackward::OnePass).unwrap();
    if one_pass_ws.flash_backward_for::<T>(s, false) == FlashBackward::OnePass {
        let one_pass = problem.run_with(dev, gemm, &mut one_pass_ws, AttentionImpl::Flash);
        problem.check(
            test,
            &one_pass,
            " (flash, one-pass backward)",
            tol_t,
            tol_lse,
        );
    } else {
        println!(
            "{}: one-pass backward not checked (it runs only on the Hopper kernels: compute \
             capability 9.0, head_dim 64)",
            problem.tag
        );
    }
    let auto = problem.run(dev, gemm, &mut ws);
    let (resolved, bits) = match AttentionImpl::Auto.resolve::<T>(s) {
        AttentionImpl::Flash => ("flash", &flash.bits),
        _ => ("gemm", &gemm_run.bits),
    };
    assert!(
        auto.bits == *bits,
        "{}: Auto differs from the {resolved} path it resolves to",
        problem.tag
    );
}

case_table_tests! {
    /// bf16 through the flash kernels: out, dq, dk, dv 1e-2 and lse 1e-3, the bounds of the
    /// cuBLASLt path (same roundings: P and dS once each as 16-bit operands of their products,
    /// then the output; lse from exact bf16 products summed in f32); flash vs gemm within 1e-2
    /// of the reference's norm (each path's error is ~2-4e-3 rms, independent between the
    /// paths).
    flash_attention_bf16_matches_cpu_reference:
        flash_case::<bf16>(FLASH_CASES, seed 80, tol 1e-2, 1e-3);
    /// f16 through the flash kernels: out, dq, dk, dv 2e-3 and lse 1e-3 (the f16 bounds of the
    /// file header: at most three roundings of 2^-11 in sequence; the inputs' ±[0.05, 2) keep
    /// every value far inside f16's range); flash vs gemm within 2e-3.
    flash_attention_f16_matches_cpu_reference:
        flash_case::<f16>(FLASH_CASES, seed 90, tol 2e-3, 1e-3);
}

/// The flash backward at a GQA shape with many query blocks per key block (group 8, as in
/// TinyLlama): four runs of the backward from one forward, all bit-identical.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn flash_attention_backward_is_deterministic() {
    const TEST: &str = "flash_attention_backward_is_deterministic";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    let st = dev.stream();
    let s = attn_shape((2, 700, 16, 2, 64));
    let problem = AttnProblem::<bf16>::new(&dev, s, 99);
    let mut ws = AttentionWorkspace::new(st, AttnShape { batch: 1, ..s }, 2).unwrap();
    let ql = problem.q.len();
    let kvl = problem.k.len();
    let mut out = poisoned::<bf16>(st, ql);
    let mut lse = poisoned::<f32>(st, s.batch * s.q_heads * s.seq);
    let flash = AttentionImpl::Flash;
    let (q, k, v, dout) = (&problem.q, &problem.k, &problem.v, &problem.dout);
    cuda::attention_forward_with(flash, &gemm, &mut ws, s, q, k, v, &mut out, &mut lse).unwrap();
    let mut first: Option<Vec<u32>> = None;
    for run in 0..4 {
        let (mut dq, mut dk, mut dv) = (
            poisoned::<bf16>(st, ql),
            poisoned::<bf16>(st, kvl),
            poisoned::<bf16>(st, kvl),
        );
        cuda::attention_backward_with(
            flash, &gemm, &mut ws, s, dout, q, k, v, &out, &lse, &mut dq, &mut dk, &mut dv,
        )
        .unwrap();
        let bits: Vec<u32> = [&dq, &dk, &dv]
            .iter()
            .flat_map(|b| download(&dev, b))
            .map(|x| x.bits())
            .collect();
        match &first {
            None => {
                let dq64 = download_f64(&dev, &dq);
                expect_within(TEST, "dq", rel_err("dq", &dq64, &problem.dq_ref), 1e-2);
                first = Some(bits);
            }
            Some(want) => assert!(bits == *want, "{TEST}: backward run {run} differs"),
        }
    }
    report(&format!("{TEST}: four backward runs bit-identical"));
}

/// The engine's workspace for 16-bit runs the flash kernels serve
/// (`AttentionWorkspace::for_flash`, only the backward's delta rows): the flash path through it
/// is bit-identical to the flash path through a full workspace, and a call that resolves to the
/// GEMM path is refused as too small instead of overrunning it.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn flash_only_workspace_serves_the_flash_path() {
    const TEST: &str = "flash_only_workspace_serves_the_flash_path";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    let s = attn_shape((3, 200, 8, 2, 64));
    let problem = AttnProblem::<bf16>::new(&dev, s, 123);
    let mut full = AttentionWorkspace::new(dev.stream(), AttnShape { batch: 1, ..s }, 2).unwrap();
    let mut small =
        AttentionWorkspace::for_flash(dev.stream(), s, FlashBackward::Deterministic).unwrap();
    assert!(
        small.bytes() < full.bytes() / 10,
        "{} vs {}",
        small.bytes(),
        full.bytes()
    );
    let want = problem.run_with(&dev, &gemm, &mut full, AttentionImpl::Flash);
    let got = problem.run_with(&dev, &gemm, &mut small, AttentionImpl::Auto);
    assert!(
        got.bits == want.bits,
        "{TEST}: the delta-only workspace changed the result"
    );
    let st = dev.stream();
    let mut out = poisoned::<bf16>(st, problem.q.len());
    let mut lse = poisoned::<f32>(st, s.batch * s.q_heads * s.seq);
    let refused = cuda::attention_forward_with(
        AttentionImpl::Gemm,
        &gemm,
        &mut small,
        s,
        &problem.q,
        &problem.k,
        &problem.v,
        &mut out,
        &mut lse,
    );
    assert!(
        refused.is_err(),
        "{TEST}: the GEMM path ran in a delta-only workspace"
    );
    report(&format!(
        "{TEST}: {} bytes instead of {}: same bits; the GEMM path refused ({})",
        small.bytes(),
        full.bytes(),
        refused.unwrap_err()
    ));
}

/// `Flash` is refused, before anything is launched, for f32, for a head_dim the kernels lack
/// and for a tensor off a 16-byte boundary; `Auto` takes the cuBLASLt path for all three and
/// stays exact.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn flash_attention_refuses_what_it_does_not_serve() {
    const TEST: &str = "flash_attention_refuses_what_it_does_not_serve";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    let st = dev.stream();
    let refused = |r: tilearn_ops::Result<()>, needle: &str| match r {
        Err(OpsError::Cuda { message, .. }) => {
            assert!(message.contains(needle), "{message}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    };
    let flash = AttentionImpl::Flash;
    // f32 and head_dim 80: refused by Flash, served by Auto through the GEMM path.
    let s32 = attn_shape((2, 9, 4, 2, 64));
    let p32 = AttnProblem::<f32>::new(&dev, s32, 100);
    let mut ws = AttentionWorkspace::new(st, s32, 4).unwrap();
    let mut out = poisoned::<f32>(st, p32.q.len());
    let mut lse = poisoned::<f32>(st, 2 * 4 * 9);
    let r = cuda::attention_forward_with(
        flash, &gemm, &mut ws, s32, &p32.q, &p32.k, &p32.v, &mut out, &mut lse,
    );
    refused(r, "does not serve f32");
    assert!(
        download(&dev, &out).iter().all(|v| v.is_nan()),
        "a refused call wrote out"
    );
    assert_eq!(AttentionImpl::Auto.resolve::<f32>(s32), AttentionImpl::Gemm);
    let run = p32.run(&dev, &gemm, &mut ws);
    p32.check(TEST, &run, " (f32 through Auto)", 1e-5, 1e-5);
    let s80 = attn_shape((2, 9, 4, 2, 80));
    let p80 = AttnProblem::<bf16>::new(&dev, s80, 101);
    let mut ws80 = AttentionWorkspace::new(st, s80, 2).unwrap();
    let mut out80 = poisoned::<bf16>(st, p80.q.len());
    let r = cuda::attention_forward_with(
        flash, &gemm, &mut ws80, s80, &p80.q, &p80.k, &p80.v, &mut out80, &mut lse,
    );
    refused(r, "head_dim 64 or 128");
    assert_eq!(
        AttentionImpl::Auto.resolve::<bf16>(s80),
        AttentionImpl::Gemm
    );
    let run = p80.run(&dev, &gemm, &mut ws80);
    p80.check(TEST, &run, " (D = 80 through Auto)", 1e-2, 1e-3);
    // q one element (2 bytes) past a 16-byte boundary.
    let s = attn_shape((2, 33, 4, 2, 64));
    let p = AttnProblem::<bf16>::new(&dev, s, 102);
    let mut ws = AttentionWorkspace::new(st, s, 2).unwrap();
    let mut shifted = vec![bf16::from_f32(0.5)];
    shifted.extend(download(&dev, &p.q));
    let shifted = upload(st, &shifted);
    let q_view = shifted.slice(1..);
    let mut out = poisoned::<bf16>(st, p.q.len());
    let mut lse = poisoned::<f32>(st, 2 * 4 * 33);
    let r = cuda::attention_forward_with(
        flash, &gemm, &mut ws, s, &q_view, &p.k, &p.v, &mut out, &mut lse,
    );
    refused(r, "16-byte boundary");
    assert!(
        download(&dev, &out).iter().all(|v| v.is_nan()),
        "a refused call wrote out"
    );
    cuda::attention_forward(&gemm, &mut ws, s, &q_view, &p.k, &p.v, &mut out, &mut lse).unwrap();
    let (mut dq, mut dk, mut dv) = (
        poisoned::<bf16>(st, p.q.len()),
        poisoned::<bf16>(st, p.k.len()),
        poisoned::<bf16>(st, p.k.len()),
    );
    let r = cuda::attention_backward_with(
        flash, &gemm, &mut ws, s, &p.dout, &q_view, &p.k, &p.v, &out, &lse, &mut dq, &mut dk,
        &mut dv,
    );
    refused(r, "16-byte boundary");
    cuda::attention_backward(
        &gemm, &mut ws, s, &p.dout, &q_view, &p.k, &p.v, &out, &lse, &mut dq, &mut dk, &mut dv,
    )
    .unwrap();
    for (what, got, want) in [
        ("out", download_f64(&dev, &out), &p.out_ref),
        ("dq", download_f64(&dev, &dq), &p.dq_ref),
        ("dk", download_f64(&dev, &dk), &p.dk_ref),
        ("dv", download_f64(&dev, &dv), &p.dv_ref),
    ] {
        expect_within(
            TEST,
            &format!("misaligned q through Auto: {what}"),
            rel_err(what, &got, want),
            1e-2,
        );
    }
}

/// Host only (runs without a GPU): which types and shapes the flash kernels serve, and what
/// `Auto` resolves to.
#[test]
fn flash_attention_support_matrix() {
    let s = attn_shape((8, 2048, 32, 4, 64));
    assert_eq!(AttentionImpl::default(), AttentionImpl::Auto);
    assert!(cuda::flash_attention_supports::<bf16>(s));
    assert!(cuda::flash_attention_supports::<f16>(s));
    assert!(!cuda::flash_attention_supports::<f32>(s));
    for d in [64, 128] {
        assert!(cuda::flash_attention_supports::<bf16>(AttnShape {
            head_dim: d,
            ..s
        }));
    }
    for d in [0, 16, 32, 80, 96, 256] {
        assert!(
            !cuda::flash_attention_supports::<bf16>(AttnShape { head_dim: d, ..s }),
            "{d}"
        );
    }
    assert!(!cuda::flash_attention_supports::<bf16>(AttnShape {
        kv_heads: 3,
        ..s
    }));
    assert!(!cuda::flash_attention_supports::<bf16>(AttnShape {
        kv_heads: 0,
        ..s
    }));
    assert!(!cuda::flash_attention_supports::<bf16>(AttnShape {
        seq: 1 << 30,
        ..s
    }));
    for imp in [AttentionImpl::Gemm, AttentionImpl::Flash] {
        assert_eq!(imp.resolve::<bf16>(s), imp);
        assert_eq!(imp.resolve::<f32>(s), imp);
    }
    assert_eq!(AttentionImpl::Auto.resolve::<f32>(s), AttentionImpl::Gemm);
    let auto = AttentionImpl::Auto.resolve::<bf16>(s);
    assert!(auto == AttentionImpl::Flash || auto == AttentionImpl::Gemm);
    assert_eq!(auto, AttentionImpl::Auto.resolve::<f16>(s));
}

/// Runs everywhere: asking whether cuBLASLt can be loaded never panics.
#[test]
fn cublaslt_probe_never_panics() {
    let present = cuda::cublaslt_available();
    report(&format!(
        "cublaslt_probe_never_panics: libcublasLt loadable: {present}"
    ));
}
