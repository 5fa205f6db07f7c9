//! The vocabulary-parallel kernels (tensor parallelism's embedding and cross entropy over one
//! rank's rows of the vocabulary) against their CPU reference `tilearn_ops::cpu::vocab_slice`,
//! for f32, bf16 and f16, on fresh seeded random inputs (never zeros), outputs poisoned with
//! NaN before each launch, uneven slices (the first `V mod parts` one row longer, as the
//! engines cut).
//!
//! * Embedding slices: forward bit for bit (a copy or exact zeros), backward bit for bit (the
//!   same f32 additions in position order as the f32 reference).
//! * Cross entropy, each step alone: partial maxima bit for bit, target logits bit for bit,
//!   sums of exponentials within 1e-5 relative (the kernel's f32 tree sum against the f64 sum
//!   of the same f32 terms: ≤ 6.8e-8 measured on the H200, rows of up to 16 002); rescale
//!   within 1e-6 (measured ≤ 5.1e-8; one
//!   `expf` against Rust's `exp`, ~1 ulp); the finishing kernels against the reference on the
//!   same completed statistics: row losses 1e-6, gradients 1e-6 (f32) / one rounding of the
//!   element type (bf16 1e-2, f16 2e-3 relative norm).
//! * The whole pipeline on the device, the all-reduces done on the host between the launches:
//!   the row losses and the gradient columns match the whole-vocabulary fused kernel on the full
//!   logits, losses 1e-5 relative (only the sum of exponentials is added in another order) and
//!   gradients 1e-5 (f32) / 1e-2 (bf16) / 2e-3 (f16): the values differ by ~1e-7 relative before
//!   the one rounding to the element type, which can flip a last bit (2⁻⁸ relative in bf16).
//!   Measured on the H200: losses ≤ 1.2e-8, gradients ≤ 8.5e-8 (f32), ≤ 2.4e-8 (bf16, f16).
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

mod gpu_common;

use gpu_common::{Elem, download, expect_within, gpu_or_skip, random, rel_err, report, upload};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cpu::{self, IGNORE_INDEX, VocabSlice};
use tilearn_ops::cuda::{
    self as k, CeTotals, CudaSlice, EmbeddingBackwardScratch, GpuDevice, TokenIdCheck, VocabCeStats,
};

/// Rank `r`'s slice of `full` over `parts` (the first `full % parts` one row longer).
fn slice(full: usize, parts: usize, r: usize) -> VocabSlice {
    let (base, extra) = (full / parts, full % parts);
    let start = r * base + r.min(extra);
    VocabSlice::new(start, base + usize::from(r < extra), full).unwrap()
}

fn widened<T: Elem>(v: &[T]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

fn as_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

fn poisoned<T: Elem>(dev: &GpuDevice, n: usize) -> CudaSlice<T> {
    upload(dev.stream(), &vec![T::NAN; n])
}

fn embedding_case<T: Elem>(test: &str, dev: &GpuDevice, full: usize, dim: usize, parts: usize) {
    let mut rng = ChaCha8Rng::seed_from_u64((full * 31 + dim) as u64);
    let stream = dev.stream();
    let (table, _) = random::<T>(&mut rng, full * dim, 0.01, 1.0);
    let ids: Vec<u32> = (0..301).map(|_| rng.random_range(0..full as u32)).collect();
    let (dout, _) = random::<T>(&mut rng, ids.len() * dim, 0.01, 1.0);
    let (dstart, _) = random::<f32>(&mut rng, full * dim, 0.01, 1.0);
    let (table_f, dout_f) = (widened(&table), widened(&dout));
    let d_ids = upload(stream, &ids);
    let d_dout = upload(stream, &dout);
    let mut check = TokenIdCheck::new(stream, full).unwrap();
    for r in 0..parts {
        let s = slice(full, parts, r);
        let rows = s.start * dim..(s.start + s.rows) * dim;
        let d_table = upload(stream, &table[rows.clone()]);
        let mut out = poisoned::<T>(dev, ids.len() * dim);
        k::embedding_forward_slice(stream, &d_ids, &d_table, s, dim, &mut out, &mut check).unwrap();
        let mut want = vec![f32::NAN; ids.len() * dim];
        cpu::embedding_forward_slice(&ids, &table_f[rows.clone()], s, dim, &mut want).unwrap();
        let got = widened(&download(dev, &out));
        assert!(
            got.iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits()),
            "{test}: forward of slice {s:?}, dim {dim}: not bit-identical"
        );
        let mut dtable = upload(stream, &dstart[rows.clone()]);
        let mut scratch = EmbeddingBackwardScratch::new(stream, ids.len(), s.rows).unwrap();
        k::embedding_backward_slice(
            stream,
            &d_ids,
            &d_dout,
            s,
            dim,
            &mut dtable,
            &mut check,
            &mut scratch,
        )
        .unwrap();
        let mut want = dstart[rows].to_vec();
        cpu::embedding_backward_slice(&ids, &dout_f, s, dim, &mut want).unwrap();
        let got = download(dev, &dtable);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits()),
            "{test}: backward of slice {s:?}, dim {dim}: not bit-identical"
        );
    }
    check.take(stream).expect("no id was out of range");
    report(&format!(
        "{test}: vocab {full} over {parts} slices, dim {dim}: forward and backward bit-identical"
    ));
}

fn embedding_slices<T: Elem>(name: &str) {
    let test = format!("vocab-parallel embedding {name}");
    let Some((dev, _)) = gpu_or_skip(&test) else {
        return;
    };
    // dim 64: the 16-byte vector path; 30: the scalar path (not a multiple of 8 or of 4 × 2).
    for (full, dim, parts) in [(1001, 64, 2), (1001, 30, 3), (7, 64, 4)] {
        embedding_case::<T>(&test, &dev, full, dim, parts);
    }
    // An id beyond the vocabulary is recorded, never read.
    let stream = dev.stream();
    let s = slice(11, 2, 1);
    let table = upload(stream, &vec![T::from_f32(1.0); s.rows * 4]);
    let mut out = poisoned::<T>(&dev, 4);
    let mut check = TokenIdCheck::new(stream, 11).unwrap();
    k::embedding_forward_slice(
        stream,
        &upload(stream, &[11u32]),
        &table,
        s,
        4,
        &mut out,
        &mut check,
    )
    .unwrap();
    let err = check.take(stream).unwrap_err();
    assert!(err.to_string().contains("token id 11"), "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn embedding_slices_match_the_cpu_reference_f32() {
    embedding_slices::<f32>("f32");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn embedding_slices_match_the_cpu_reference_bf16() {
    embedding_slices::<bf16>("bf16");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn embedding_slices_match_the_cpu_reference_f16() {
    embedding_slices::<f16>("f16");
}

/// Targets uniform over the vocabulary with about 1/8 ignored, the first rows pinned to the
/// vocabulary's edges and to an ignored row.
fn targets(rng: &mut ChaCha8Rng, rows: usize, full: usize) -> Vec<i32> {
    let mut t: Vec<i32> = (0..rows)
        .map(|_| {
            if rng.random_range(0..8) == 0 {
                IGNORE_INDEX
            } else {
                rng.random_range(0..full) as i32
            }
        })
        .collect();
    t[0] = 0;
    t[1] = (full - 1) as i32;
    t[2] = IGNORE_INDEX;
    t
}

/// The columns `s` of row-major `[rows, full]` data.
fn columns<T: Copy>(x: &[T], full: usize, s: &VocabSlice) -> Vec<T> {
    x.chunks(full)
        .flat_map(|row| row[s.start..s.start + s.rows].to_vec())
        .collect()
}

/// Per-row statistics of one slice, on the device.
struct Stats {
    local_max: CudaSlice<f32>,
    sumexp: CudaSlice<f32>,
    target: CudaSlice<f32>,
}

/// Bound of a gradient compared after one rounding to the element type: `f32_bound` in f32,
/// else the type's last bit (bf16 2⁻⁸, f16 2⁻¹¹ relative) with room for a few flips.
fn grad_tol<T: Elem>(f32_bound: f64) -> f64 {
    match T::NAME {
        "bf16" => 1e-2,
        "f16" => 2e-3,
        _ => f32_bound,
    }
}

fn cross_entropy_case<T: Elem>(
    test: &str,
    dev: &GpuDevice,
    rows: usize,
    full: usize,
    parts: usize,
) {
    let case = format!("{test} [{rows} x {full} over {parts}]");
    let stream = dev.stream();
    let mut rng = ChaCha8Rng::seed_from_u64((rows * 7919 + full) as u64);
    let (logits, _) = random::<T>(&mut rng, rows * full, 0.05, 12.0);
    let t = targets(&mut rng, rows, full);
    let d_targets = upload(stream, &t);
    // f16: the GradScaler's initial scale keeps the gradients out of f16's subnormals.
    let grad_scale = if T::NAME == "f16" { 65536.0 } else { 1.0 } / rows as f64;
    let slices: Vec<VocabSlice> = (0..parts).map(|r| slice(full, parts, r)).collect();

    // Step 1 on every slice, against the reference.
    let mut host_stats = Vec::new();
    for s in &slices {
        let cols = columns(&logits, full, s);
        let d_logits = upload(stream, &cols);
        let mut st = Stats {
            local_max: upload(stream, &vec![f32::NAN; rows]),
            sumexp: upload(stream, &vec![f32::NAN; rows]),
            target: upload(stream, &vec![f32::NAN; rows]),
        };
        k::vocab_ce_partials(
            stream,
            &d_logits,
            &d_targets,
            *s,
            &mut st.local_max,
            &mut st.sumexp,
            &mut st.target,
        )
        .unwrap();
        let (mut m, mut e, mut x) = (vec![0.0; rows], vec![0.0; rows], vec![0.0; rows]);
        cpu::vocab_ce_partials(&widened(&cols), &t, *s, &mut m, &mut e, &mut x).unwrap();
        let (gm, ge, gx) = (
            download(dev, &st.local_max),
            download(dev, &st.sumexp),
            download(dev, &st.target),
        );
        assert_eq!(gm, m, "{case}: partial maxima of {s:?}");
        assert_eq!(gx, x, "{case}: target logits of {s:?}");
        expect_within(
            &case,
            "partial sums of exp",
            rel_err("sumexp", &as_f64(&ge), &as_f64(&e)),
            1e-5,
        );
        host_stats.push((gm, ge, gx));
    }
    // The all-reduces, on the host: MAX of the maxima, then rescale (device, against the
    // reference) and SUM of the sums and target logits.
    let global_max: Vec<f32> = (0..rows)
        .map(|i| {
            host_stats
                .iter()
                .map(|h| h.0[i])
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect();
    let d_global = upload(stream, &global_max);
    let (mut sumexp, mut target) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    for (m, e, x) in &host_stats {
        let d_local = upload(stream, m);
        let mut d_sum = upload(stream, e);
        k::vocab_ce_rescale(stream, &d_local, &d_global, &mut d_sum).unwrap();
        let got = download(dev, &d_sum);
        let mut want = e.clone();
        cpu::vocab_ce_rescale(m, &global_max, &mut want).unwrap();
        expect_within(
            &case,
            "rescaled sums",
            rel_err("rescale", &as_f64(&got), &as_f64(&want)),
            1e-6,
        );
        sumexp.iter_mut().zip(&got).for_each(|(a, b)| *a += b);
        target.iter_mut().zip(x).for_each(|(a, b)| *a += b);
    }
    let (d_sum, d_target) = (upload(stream, &sumexp), upload(stream, &target));
    let stats = || VocabCeStats {
        global_max: &d_global,
        sumexp: &d_sum,
        target_logit: &d_target,
    };

    // The whole-vocabulary fused kernel on the full logits: the result to reproduce.
    let mut whole = upload(stream, &logits);
    let mut whole_loss = upload(stream, &vec![f32::NAN; rows]);
    let mut totals = CeTotals::new(stream).unwrap();
    k::cross_entropy_fused(
        stream,
        &mut whole,
        &d_targets,
        full,
        grad_scale,
        &mut whole_loss,
        &mut totals,
    )
    .unwrap();
    let (whole_grad, whole_loss) = (widened(&download(dev, &whole)), download(dev, &whole_loss));

    // Step 3, loss only.
    let mut loss = upload(stream, &vec![f32::NAN; rows]);
    k::vocab_ce_loss_finish(stream, &d_targets, full, stats(), &mut loss).unwrap();
    let loss = download(dev, &loss);
    let mut want = vec![f32::NAN; rows];
    cpu::vocab_ce_loss_finish(&t, full, &global_max, &sumexp, &target, &mut want).unwrap();
    expect_within(
        &case,
        "row losses (loss only) vs reference",
        rel_err("loss", &as_f64(&loss), &as_f64(&want)),
        1e-6,
    );
    expect_within(
        &case,
        "row losses vs whole vocabulary",
        rel_err("loss", &as_f64(&loss), &as_f64(&whole_loss)),
        1e-5,
    );
    assert_eq!(loss[2], 0.0, "{case}: an ignored row's loss");

    // Step 3, fused: every slice's gradient columns.
    for s in &slices {
        let cols = columns(&logits, full, s);
        let mut d_logits = upload(stream, &cols);
        let mut fused_loss = upload(stream, &vec![f32::NAN; rows]);
        k::vocab_ce_fused_finish(
            stream,
            &mut d_logits,
            &d_targets,
            *s,
            stats(),
            grad_scale,
            &mut fused_loss,
        )
        .unwrap();
        assert_eq!(
            download(dev, &fused_loss),
            loss,
            "{case}: fused row losses of {s:?}"
        );
        let got = widened(&download(dev, &d_logits));
        let mut want = widened(&cols);
        let mut want_loss = vec![0.0; rows];
        cpu::vocab_ce_fused_finish(
            &mut want,
            &t,
            *s,
            &global_max,
            &sumexp,
            &target,
            grad_scale as f32,
            &mut want_loss,
        )
        .unwrap();
        // The reference in f32: round it to T as the kernel stores it.
        let want: Vec<f32> = want.iter().map(|&g| T::from_f32(g).to_f32()).collect();
        expect_within(
            &case,
            &format!("gradient of {s:?} vs reference"),
            rel_err("grad", &as_f64(&got), &as_f64(&want)),
            grad_tol::<T>(1e-6),
        );
        expect_within(
            &case,
            &format!("gradient of {s:?} vs whole vocabulary"),
            rel_err(
                "grad",
                &as_f64(&got),
                &as_f64(&columns(&whole_grad, full, s)),
            ),
            grad_tol::<T>(1e-5),
        );
        assert!(
            got[2 * s.rows..3 * s.rows].iter().all(|&g| g == 0.0),
            "{case}: an ignored row's gradient is zero"
        );
    }
}

fn cross_entropy_slices<T: Elem>(name: &str) {
    let test = format!("vocab-parallel cross entropy {name}");
    let Some((dev, _)) = gpu_or_skip(&test) else {
        return;
    };
    // 32 003 over 2 (16 002 + 16 001, scalar rows), 1 024 over 2 (512: the 16-byte vector
    // rows in every type), 257 over 3 (86 + 86 + 85), 7 over 4 (slices of one or two words).
    for (rows, full, parts) in [(37, 32_003, 2), (64, 1024, 2), (29, 257, 3), (11, 7, 4)] {
        cross_entropy_case::<T>(&test, &dev, rows, full, parts);
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn vocab_parallel_cross_entropy_matches_reference_and_whole_vocabulary_f32() {
    cross_entropy_slices::<f32>("f32");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn vocab_parallel_cross_entropy_matches_reference_and_whole_vocabulary_bf16() {
    cross_entropy_slices::<bf16>("bf16");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn vocab_parallel_cross_entropy_matches_reference_and_whole_vocabulary_f16() {
    cross_entropy_slices::<f16>("f16");
}
