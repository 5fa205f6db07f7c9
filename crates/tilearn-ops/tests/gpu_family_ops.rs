//! The ops Bloom and the ALiBi Baichuans (13B) add, on the GPU against the f64 CPU reference, on
//! fresh seeded random inputs (never zeros) with NaN-poisoned outputs:
//! * ALiBi attention, forward and backward, through the flash kernels (bf16 / f16, head_dim 64
//!   and 128, their ALiBi instantiations) and the cuBLASLt path (f32 at head_dim 40, bf16):
//!   head counts 1, 5, 6, 8, 12 (non-powers of two; 12 also as GQA over 4 kv heads), odd
//!   lengths crossing the 64-row tiles, causal, packed examples (positions restarting) and a
//!   sliding window. Tolerances (‖got − want‖₂ / ‖want‖₂) are those of gpu_attention_mask.rs
//!   (derived in gpu_matmul_attention.rs): f32 1e-5; bf16 1e-2 for out/dq/dk/dv and 1e-3 for
//!   the f32 lse; f16 2e-3 and 1e-3. The bias changes which terms dominate, not the roundings
//!   per term. Two runs are bit-identical, and zero slopes give bit for bit the plain causal
//!   kernels' results (the ALiBi build adds `0 · (j − i)` exactly).
//! * LayerNorm with bias, forward and backward, f32 / bf16 / f16, widths 45, 1027 and 7001
//!   (the last keeps its dweight/dbias partials in global scratch): out and dx 1e-5 (f32),
//!   1e-2 (bf16: one rounding of 2^-9 per element), 2e-3 (f16: 2^-11); mean/rstd and the f32
//!   accumulations dweight/dbias (`+=` onto random starts) 1e-5.
//! * ALiBi in the generation kernel (cached attention), prefill and decode, f32 1e-5, bf16 1e-2.
//! * tanh-GeLU, forward and backward, f32 1e-5 (tanhf, a few ulps), bf16 1e-2, f16 2e-3, with
//!   saturated inputs (|x| up to 30) included.
//! * The CPU references of LayerNorm and GeLU against PyTorch (`F.layer_norm` and its autograd,
//!   Bloom's formula under autograd) in f64, 1e-12, when python3 with torch is importable
//!   (the GPU machine); else the test prints `skipped: ...`.
//! * Baichuan2's z-loss (`z_loss_rows` / `z_loss_apply` around the fused cross entropy), f32
//!   1e-5, bf16 1e-2, f16 2e-3 for dlogits, 1e-5 for the f32 row losses.
//!
//! Without a GPU or driver each GPU test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

mod gpu_common;

use std::io::Write;

use gpu_common::{
    Elem, download, expect_equal_to_rounding, expect_within, gpu_or_skip, random, rel_err, report,
    shape, upload,
};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::cpu::{self, AttnShape, HostKeyMask};
use tilearn_ops::cuda::{
    self, AttentionImpl, AttentionWorkspace, Gemm, GpuDevice, LayerNormScratch,
};
use tilearn_ops::{KeyMask, alibi_slopes, check_positions};

fn to_f64<T: Elem>(v: &[T]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

// ---- ALiBi attention ----

/// Restarting positions of `batch` rows: examples of random lengths 1..=max_len.
fn packed_positions(rng: &mut ChaCha8Rng, batch: usize, seq: usize, max_len: usize) -> Vec<i32> {
    let mut pos = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let mut t = 0;
        while t < seq {
            let len = rng.random_range(1..=max_len);
            pos.extend(0..len.min(seq - t) as i32);
            t += len;
        }
    }
    check_positions(&pos, batch, seq).unwrap();
    pos
}

struct AlibiCase {
    s: AttnShape,
    positions: Option<Vec<i32>>,
    window: Option<usize>,
    slopes: Vec<f32>,
    label: &'static str,
}

struct Outputs {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    bits: Vec<u32>,
}

/// Head counts 1, 5, 6, 8, 12 (and 12 over 4 kv heads), causal, packed and windowed.
fn alibi_cases(rng: &mut ChaCha8Rng, d: usize) -> Vec<AlibiCase> {
    let case = |s: AttnShape, positions, window, label| AlibiCase {
        slopes: alibi_slopes(s.q_heads),
        s,
        positions,
        window,
        label,
    };
    vec![
        case(shape(2, 131, 1, 1, d), None, None, "1 head, causal"),
        case(shape(1, 203, 5, 5, d), None, None, "5 heads, causal"),
        case(
            shape(2, 77, 6, 6, d),
            Some(packed_positions(rng, 2, 77, 30)),
            None,
            "6 heads, packed",
        ),
        case(shape(1, 150, 8, 8, d), None, Some(37), "8 heads, window 37"),
        case(
            shape(2, 97, 12, 4, d),
            Some(packed_positions(rng, 2, 97, 70)),
            None,
            "12 heads over 4 kv heads, packed",
        ),
    ]
}

/// Forward then backward on the GPU through `imp` with the case's mask and slopes.
#[allow(clippy::too_many_arguments)]
fn run_gpu<T: Elem>(
    dev: &GpuDevice,
    gemm: &Gemm,
    imp: AttentionImpl,
    c: &AlibiCase,
    q: &[T],
    k: &[T],
    v: &[T],
    dout: &[T],
) -> Outputs {
    let st = dev.stream();
    let s = c.s;
    let mut ws = AttentionWorkspace::new(st, s, size_of::<T>()).unwrap();
    let (q_, k_, v_, do_) = (
        upload(st, q),
        upload(st, k),
        upload(st, v),
        upload(st, dout),
    );
    let pos = c.positions.as_ref().map(|p| upload(st, p));
    let slopes = upload(st, &c.slopes);
    let mask = KeyMask {
        positions: pos.as_ref(),
        sliding_window: c.window,
    };
    let mut out = upload(st, &vec![T::NAN; q.len()]);
    let mut lse = upload(st, &vec![f32::NAN; s.batch * s.q_heads * s.seq]);
    cuda::attention_forward_alibi(
        imp,
        gemm,
        &mut ws,
        s,
        mask,
        Some(&slopes),
        &q_,
        &k_,
        &v_,
        &mut out,
        &mut lse,
    )
    .unwrap();
    let mut dq = upload(st, &vec![T::NAN; q.len()]);
    let mut dk = upload(st, &vec![T::NAN; k.len()]);
    let mut dv = upload(st, &vec![T::NAN; k.len()]);
    cuda::attention_backward_alibi(
        imp,
        gemm,
        &mut ws,
        s,
        mask,
        Some(&slopes),
        &do_,
        &q_,
        &k_,
        &v_,
        &out,
        &lse,
        &mut dq,
        &mut dk,
        &mut dv,
    )
    .unwrap();
    let raw: Vec<Vec<T>> = [&out, &dq, &dk, &dv]
        .iter()
        .map(|b| download(dev, b))
        .collect();
    let lse_h = download(dev, &lse);
    let mut bits: Vec<u32> = raw.iter().flatten().map(|x| x.bits()).collect();
    bits.extend(lse_h.iter().map(|x| x.to_bits()));
    Outputs {
        out: to_f64(&raw[0]),
        lse: lse_h.iter().map(|&x| x as f64).collect(),
        dq: to_f64(&raw[1]),
        dk: to_f64(&raw[2]),
        dv: to_f64(&raw[3]),
        bits,
    }
}

/// The f64 CPU reference of the case on exact inputs.
fn reference(c: &AlibiCase, q: &[f64], k: &[f64], v: &[f64], dout: &[f64]) -> Outputs {
    let s = c.s;
    let mask: HostKeyMask<'_> = KeyMask {
        positions: c.positions.as_deref(),
        sliding_window: c.window,
    };
    let slopes = Some(&c.slopes[..]);
    let mut out = vec![f64::NAN; q.len()];
    let mut lse = vec![f64::NAN; s.batch * s.q_heads * s.seq];
    cpu::attention_forward_alibi(s, mask, slopes, q, k, v, &mut out, &mut lse).unwrap();
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; k.len()]);
    cpu::attention_backward_alibi(
        s, mask, slopes, dout, q, k, v, &out, &lse, &mut dq, &mut dk, &mut dv,
    )
    .unwrap();
    Outputs {
        out,
        lse,
        dq,
        dk,
        dv,
        bits: Vec::new(),
    }
}

/// Random q, k, v, dout of `T` for shape `s` and their exact f64 values.
#[allow(clippy::type_complexity)]
fn qkv<T: Elem>(rng: &mut ChaCha8Rng, s: AttnShape) -> ([Vec<T>; 4], [Vec<f64>; 4]) {
    let ql = s.batch * s.seq * s.q_heads * s.head_dim;
    let kvl = s.batch * s.seq * s.kv_heads * s.head_dim;
    let (q, q64) = random::<T>(rng, ql, 0.05, 2.0);
    let (k, k64) = random::<T>(rng, kvl, 0.05, 2.0);
    let (v, v64) = random::<T>(rng, kvl, 0.05, 1.0);
    let (dout, dout64) = random::<T>(rng, ql, 0.05, 1.0);
    ([q, k, v, dout], [q64, k64, v64, dout64])
}

/// Every ALiBi case in `T` through `imp` against the reference, and twice for bit-identity.
fn alibi_case<T: Elem>(
    test: &str,
    imp: AttentionImpl,
    d: usize,
    seed: u64,
    tol: f64,
    tol_lse: f64,
) {
    let Some((dev, gemm)) = gpu_or_skip(test) else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for c in alibi_cases(&mut rng, d) {
        let ([q, k, v, dout], [q64, k64, v64, dout64]) = qkv::<T>(&mut rng, c.s);
        let want = reference(&c, &q64, &k64, &v64, &dout64);
        let got = run_gpu(&dev, &gemm, imp, &c, &q, &k, &v, &dout);
        let again = run_gpu(&dev, &gemm, imp, &c, &q, &k, &v, &dout);
        let tag = format!("{} {imp:?} {:?} ({})", T::NAME, c.s, c.label);
        assert!(got.bits == again.bits, "{tag}: two runs differ");
        for (what, g, w) in [
            ("out", &got.out, &want.out),
            ("dq", &got.dq, &want.dq),
            ("dk", &got.dk, &want.dk),
            ("dv", &got.dv, &want.dv),
        ] {
            expect_within(test, &format!("{tag}: {what}"), rel_err(what, g, w), tol);
        }
        let lse_err = rel_err("lse", &got.lse, &want.lse);
        expect_within(test, &format!("{tag}: lse"), lse_err, tol_lse);
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn flash_bf16_alibi_matches_cpu_reference_d64() {
    alibi_case::<bf16>(
        "flash_bf16_alibi_d64",
        AttentionImpl::Flash,
        64,
        1,
        1e-2,
        1e-3,
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn flash_bf16_alibi_matches_cpu_reference_d128() {
    alibi_case::<bf16>(
        "flash_bf16_alibi_d128",
        AttentionImpl::Flash,
        128,
        2,
        1e-2,
        1e-3,
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn flash_f16_alibi_matches_cpu_reference_d64() {
    alibi_case::<f16>(
        "flash_f16_alibi_d64",
        AttentionImpl::Flash,
        64,
        3,
        2e-3,
        1e-3,
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gemm_f32_alibi_matches_cpu_reference() {
    // head_dim 40: a shape only the cuBLASLt path serves, as in the engine's f32 runs.
    alibi_case::<f32>("gemm_f32_alibi", AttentionImpl::Gemm, 40, 4, 1e-5, 1e-5);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gemm_bf16_alibi_matches_cpu_reference() {
    alibi_case::<bf16>("gemm_bf16_alibi", AttentionImpl::Gemm, 64, 5, 1e-2, 1e-3);
}

/// Zero slopes add exactly nothing: the ALiBi kernels must give bit for bit what the plain
/// causal kernels give (flash: the same tiles, sums and roundings; gemm: the same row kernels).
/// On Hopper the plain causal flash call runs the wgmma kernels: equal to the rounding there.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn zero_slopes_are_bit_identical_to_causal() {
    const TEST: &str = "zero_slopes_are_bit_identical_to_causal";
    let Some((dev, gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let s = shape(2, 190, 4, 2, 64);
    let ([q, k, v, dout], _) = qkv::<bf16>(&mut rng, s);
    for imp in [AttentionImpl::Flash, AttentionImpl::Gemm] {
        let c = AlibiCase {
            s,
            positions: None,
            window: None,
            slopes: vec![0.0; s.q_heads],
            label: "zero slopes",
        };
        let zero = run_gpu(&dev, &gemm, imp, &c, &q, &k, &v, &dout);
        let st = dev.stream();
        let mut ws = AttentionWorkspace::new(st, s, 2).unwrap();
        let (q_, k_, v_, do_) = (
            upload(st, &q),
            upload(st, &k),
            upload(st, &v),
            upload(st, &dout),
        );
        let mut out = upload(st, &vec![bf16::NAN; q.len()]);
        let mut lse = upload(st, &vec![f32::NAN; s.batch * s.q_heads * s.seq]);
        cuda::attention_forward_with(imp, &gemm, &mut ws, s, &q_, &k_, &v_, &mut out, &mut lse)
            .unwrap();
        let mut dq = upload(st, &vec![bf16::NAN; q.len()]);
        let mut dk = upload(st, &vec![bf16::NAN; k.len()]);
        let mut dv = upload(st, &vec![bf16::NAN; k.len()]);
        cuda::attention_backward_with(
            imp, &gemm, &mut ws, s, &do_, &q_, &k_, &v_, &out, &lse, &mut dq, &mut dk, &mut dv,
        )
        .unwrap();
        let grads: Vec<Vec<bf16>> = [&out, &dq, &dk, &dv]
            .iter()
            .map(|b| download(&dev, b))
            .collect();
        let lse = download(&dev, &lse);
        if imp == AttentionImpl::Flash && cuda::flash_attention_uses_wgmma::<bf16>(64, false) {
            // The causal call ran the Hopper kernels, the ALiBi one the mma.sync kernels.
            let f = |v: &[bf16]| v.iter().map(|x| x.to_f64()).collect::<Vec<f64>>();
            let lse_f: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
            let (o, q, k, v) = (f(&grads[0]), f(&grads[1]), f(&grads[2]), f(&grads[3]));
            let pairs: [(&str, &[f64], &[f64]); 5] = [
                ("out", &zero.out, &o),
                ("dq", &zero.dq, &q),
                ("dk", &zero.dk, &k),
                ("dv", &zero.dv, &v),
                ("lse", &zero.lse, &lse_f),
            ];
            expect_equal_to_rounding(TEST, "zero slopes vs causal on the Hopper kernels", &pairs);
            continue;
        }
        let mut bits: Vec<u32> = grads.iter().flatten().map(|x| x.bits()).collect();
        bits.extend(lse.iter().map(|x| x.to_bits()));
        assert!(
            zero.bits == bits,
            "{TEST}: {imp:?}: zero slopes differ from causal"
        );
        report(&format!(
            "{TEST}: {imp:?}: bit-identical ({} values)",
            bits.len()
        ));
    }
}

/// ALiBi in the generation kernel (cached attention): GPU against the CPU reference (f32, which
/// is itself checked against the training attention in cpu_alibi.rs) for a prefill and one
/// decode step, 5 heads (not a power of two) over 5 kv heads and 12 over 4; f32 1e-5, bf16 1e-2.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn cached_attention_alibi_matches_cpu_reference() {
    const TEST: &str = "cached_attention_alibi_matches_cpu_reference";
    let Some((dev, _gemm)) = gpu_or_skip(TEST) else {
        return;
    };
    let st = dev.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(61);
    for (q_heads, kv_heads, head_dim) in [(5, 5, 64), (12, 4, 128)] {
        let (positions, slopes) = (77, alibi_slopes(q_heads));
        let slopes_dev = upload(st, &slopes);
        // bf16 values, so the f32 and bf16 runs see the same numbers.
        let (kb, k64) = random::<bf16>(&mut rng, positions * kv_heads * head_dim, 0.05, 2.0);
        let (vb, v64) = random::<bf16>(&mut rng, kb.len(), 0.05, 1.0);
        let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let (k, v) = (f32s(&k64), f32s(&v64));
        for (start, n) in [(0, 60), (76, 1)] {
            let shape = cpu::CachedAttnShape {
                n,
                start,
                q_heads,
                kv_heads,
                head_dim,
            };
            let (qb, q64) = random::<bf16>(&mut rng, shape.q_len(), 0.05, 2.0);
            let q = f32s(&q64);
            let mut want = vec![0.0f32; shape.q_len()];
            cpu::cached_attention_alibi(shape, Some(&slopes), &q, &k, &v, &mut want).unwrap();
            let want: Vec<f64> = want.iter().map(|&x| x as f64).collect();
            let tag = format!("heads {q_heads}/{kv_heads} d {head_dim} start {start} n {n}");
            // f32 storage.
            let (qd, kd, vd) = (upload(st, &q), upload(st, &k), upload(st, &v));
            let mut out = upload(st, &vec![f32::NAN; shape.q_len()]);
            cuda::cached_attention_alibi_forward(
                st,
                shape,
                Some(&slopes_dev),
                &qd,
                &kd,
                &vd,
                &mut out,
            )
            .unwrap();
            let got: Vec<f64> = download(&dev, &out).iter().map(|&x| x as f64).collect();
            expect_within(
                TEST,
                &format!("f32 {tag}"),
                rel_err("out", &got, &want),
                1e-5,
            );
            // bf16 storage of the same values.
            let (qd, kd, vd) = (upload(st, &qb), upload(st, &kb), upload(st, &vb));
            let mut out = upload(st, &vec![bf16::NAN; shape.q_len()]);
            cuda::cached_attention_alibi_forward(
                st,
                shape,
                Some(&slopes_dev),
                &qd,
                &kd,
                &vd,
                &mut out,
            )
            .unwrap();
            let got = to_f64(&download(&dev, &out));
            expect_within(
                TEST,
                &format!("bf16 {tag}"),
                rel_err("out", &got, &want),
                1e-2,
            );
        }
    }
}

// ---- LayerNorm ----

fn layernorm_case<T: Elem>(test: &str, seed: u64, tol: f64) {
    let Some((dev, _gemm)) = gpu_or_skip(test) else {
        return;
    };
    let st = dev.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let eps = 1e-5;
    for (rows, dim) in [(37, 45), (300, 1027), (5, 7001)] {
        let tag = format!("{} rows={rows} dim={dim}", T::NAME);
        let n = rows * dim;
        let (x, x64) = random::<T>(&mut rng, n, 0.05, 2.0);
        let (w, w64) = random::<T>(&mut rng, dim, 0.5, 1.5);
        let (b, b64) = random::<T>(&mut rng, dim, 0.05, 1.0);
        let (dout, dout64) = random::<T>(&mut rng, n, 0.05, 1.0);
        let (dw0, dw064) = random::<f32>(&mut rng, dim, 0.05, 1.0);
        let (db0, db064) = random::<f32>(&mut rng, dim, 0.05, 1.0);
        let (mut out_r, mut mean_r, mut rstd_r) = (vec![0.0; n], vec![0.0; rows], vec![0.0; rows]);
        cpu::layernorm_forward(
            &x64,
            &w64,
            &b64,
            dim,
            eps,
            &mut out_r,
            &mut mean_r,
            &mut rstd_r,
        )
        .unwrap();
        let (mut dx_r, mut dw_r, mut db_r) = (vec![0.0; n], dw064.clone(), db064.clone());
        cpu::layernorm_backward(
            &dout64, &x64, &w64, &mean_r, &rstd_r, dim, &mut dx_r, &mut dw_r, &mut db_r,
        )
        .unwrap();

        let (xd, wd, bd, dod) = (
            upload(st, &x),
            upload(st, &w),
            upload(st, &b),
            upload(st, &dout),
        );
        let mut out = upload(st, &vec![T::NAN; n]);
        let mut mean = upload(st, &vec![f32::NAN; rows]);
        let mut rstd = upload(st, &vec![f32::NAN; rows]);
        cuda::layernorm_forward(st, &xd, &wd, &bd, dim, eps, &mut out, &mut mean, &mut rstd)
            .unwrap();
        let mut dx = upload(st, &vec![T::NAN; n]);
        let (mut dw, mut db) = (upload(st, &dw0), upload(st, &db0));
        let mut scratch = LayerNormScratch::new(st, rows, dim).unwrap();
        cuda::layernorm_backward(
            st,
            &dod,
            &xd,
            &wd,
            &mean,
            &rstd,
            dim,
            &mut dx,
            &mut dw,
            &mut db,
            &mut scratch,
        )
        .unwrap();
        let f = |v: Vec<f32>| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        for (what, got, want, tol) in [
            ("out", to_f64(&download(&dev, &out)), &out_r, tol),
            ("dx", to_f64(&download(&dev, &dx)), &dx_r, tol),
            ("mean", f(download(&dev, &mean)), &mean_r, 1e-5),
            ("rstd", f(download(&dev, &rstd)), &rstd_r, 1e-5),
            ("dweight (+=)", f(download(&dev, &dw)), &dw_r, 1e-5),
            ("dbias (+=)", f(download(&dev, &db)), &db_r, 1e-5),
        ] {
            expect_within(
                test,
                &format!("{tag}: {what}"),
                rel_err(what, &got, want),
                tol,
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn layernorm_f32_matches_cpu_reference() {
    layernorm_case::<f32>("layernorm_f32", 31, 1e-5);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn layernorm_bf16_matches_cpu_reference() {
    layernorm_case::<bf16>("layernorm_bf16", 32, 1e-2);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn layernorm_f16_matches_cpu_reference() {
    layernorm_case::<f16>("layernorm_f16", 33, 2e-3);
}

// ---- tanh-GeLU ----

fn gelu_case<T: Elem>(test: &str, seed: u64, tol: f64) {
    let Some((dev, _gemm)) = gpu_or_skip(test) else {
        return;
    };
    let st = dev.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = 100_003;
    let (mut x, mut x64) = random::<T>(&mut rng, n, 0.01, 5.0);
    for v in [9.0f32, -9.0, 30.0, -30.0] {
        x.push(T::from_f32(v));
        x64.push(v as f64);
    }
    let (dout, dout64) = random::<T>(&mut rng, x.len(), 0.05, 1.0);
    let (mut y_r, mut dx_r) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    cpu::gelu_tanh_forward(&x64, &mut y_r).unwrap();
    cpu::gelu_tanh_backward(&dout64, &x64, &mut dx_r).unwrap();
    let (xd, dod) = (upload(st, &x), upload(st, &dout));
    let mut y = upload(st, &vec![T::NAN; x.len()]);
    let mut dx = upload(st, &vec![T::NAN; x.len()]);
    cuda::gelu_tanh_forward(st, &xd, &mut y).unwrap();
    cuda::gelu_tanh_backward(st, &dod, &xd, &mut dx).unwrap();
    let tag = format!("{} n={}", T::NAME, x.len());
    expect_within(
        test,
        &format!("{tag}: out"),
        rel_err("out", &to_f64(&download(&dev, &y)), &y_r),
        tol,
    );
    expect_within(
        test,
        &format!("{tag}: dx"),
        rel_err("dx", &to_f64(&download(&dev, &dx)), &dx_r),
        tol,
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gelu_tanh_f32_matches_cpu_reference() {
    gelu_case::<f32>("gelu_tanh_f32", 41, 1e-5);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gelu_tanh_bf16_matches_cpu_reference() {
    gelu_case::<bf16>("gelu_tanh_bf16", 42, 1e-2);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gelu_tanh_f16_matches_cpu_reference() {
    gelu_case::<f16>("gelu_tanh_f16", 43, 2e-3);
}

// ---- the CPU references against PyTorch ----

/// PyTorch's LayerNorm (`F.layer_norm`) and Bloom's GeLU formula in float64 under autograd, on
/// the JSON inputs given on stdin; prints their outputs and gradients as JSON.
const TORCH_SCRIPT: &str = r#"
import json, sys
import torch
import torch.nn.functional as F
d = json.load(sys.stdin)
t = lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=True)
x, w, b = t(d["x"]), t(d["w"]), t(d["b"])
y = F.layer_norm(x.view(-1, len(d["w"])), (len(d["w"]),), w, b, d["eps"])
(y.flatten() * torch.tensor(d["dout"], dtype=torch.float64)).sum().backward()
g = t(d["g"])
gy = g * 0.5 * (1.0 + torch.tanh(0.79788456 * g * (1 + 0.044715 * g * g)))
(gy * torch.tensor(d["gdout"], dtype=torch.float64)).sum().backward()
out = {k: v.detach().flatten().tolist() for k, v in
       [("y", y), ("dx", x.grad), ("dw", w.grad), ("db", b.grad), ("gy", gy), ("gdx", g.grad)]}
print(json.dumps(out))
"#;

#[test]
fn cpu_layernorm_and_gelu_match_pytorch() {
    const TEST: &str = "cpu_layernorm_and_gelu_match_pytorch";
    let mut rng = ChaCha8Rng::seed_from_u64(51);
    let (rows, dim, eps) = (13, 37, 1e-5);
    let (_, x) = random::<f32>(&mut rng, rows * dim, 0.05, 2.0);
    let (_, w) = random::<f32>(&mut rng, dim, 0.5, 1.5);
    let (_, b) = random::<f32>(&mut rng, dim, 0.05, 1.0);
    let (_, dout) = random::<f32>(&mut rng, rows * dim, 0.05, 1.0);
    let (_, g) = random::<f32>(&mut rng, 301, 0.01, 6.0);
    let (_, gdout) = random::<f32>(&mut rng, g.len(), 0.05, 1.0);
    let input = serde_json::json!({
        "x": x, "w": w, "b": b, "eps": eps, "dout": dout, "g": g, "gdout": gdout
    });
    let child = std::process::Command::new("python3")
        .args(["-c", TORCH_SCRIPT])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        report(&format!("skipped: {TEST}: python3 not found"));
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let res = child.wait_with_output().unwrap();
    if !res.status.success() {
        let err = String::from_utf8_lossy(&res.stderr);
        if err.contains("No module named 'torch'") {
            report(&format!("skipped: {TEST}: torch is not importable"));
            return;
        }
        panic!("{TEST}: the PyTorch reference failed: {err}");
    }
    let want: serde_json::Value = serde_json::from_slice(&res.stdout).unwrap();
    let col = |k: &str| -> Vec<f64> {
        want[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let n = rows * dim;
    let (mut y, mut mean, mut rstd) = (vec![0.0; n], vec![0.0; rows], vec![0.0; rows]);
    cpu::layernorm_forward(&x, &w, &b, dim, eps, &mut y, &mut mean, &mut rstd).unwrap();
    let (mut dx, mut dw, mut db) = (vec![0.0; n], vec![0.0; dim], vec![0.0; dim]);
    cpu::layernorm_backward(&dout, &x, &w, &mean, &rstd, dim, &mut dx, &mut dw, &mut db).unwrap();
    let (mut gy, mut gdx) = (vec![0.0; g.len()], vec![0.0; g.len()]);
    cpu::gelu_tanh_forward(&g, &mut gy).unwrap();
    cpu::gelu_tanh_backward(&gdout, &g, &mut gdx).unwrap();
    for (what, got, tol) in [
        ("y", &y, 1e-12),
        ("dx", &dx, 1e-12),
        ("dw", &dw, 1e-12),
        ("db", &db, 1e-12),
        ("gy", &gy, 1e-12),
        ("gdx", &gdx, 1e-12),
    ] {
        expect_within(TEST, what, rel_err(what, got, &col(what)), tol);
    }
}

// ---- Baichuan2's z-loss around the fused cross entropy ----

/// `z_loss_rows` + fused cross entropy + `z_loss_apply` on the GPU against the same sequence on
/// the f64 CPU reference over the same (rounded) logits: row losses and dlogits, host and
/// device gradient factors, and the loss-only path (no gradient). Vocab 1031 (odd, several
/// blocks' strides), 77 rows with some `-100`. Tolerances: f32 1e-5 (expf and f32 sums), bf16
/// 1e-2 and f16 2e-3 for the rounded dlogits; row losses are f32 in every type, 1e-5.
fn z_loss_case<T: Elem>(test: &str, seed: u64, tol: f64) {
    let Some((dev, _gemm)) = gpu_or_skip(test) else {
        return;
    };
    let st = dev.stream();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (rows, vocab, weight, scale) = (77usize, 1031usize, 0.05f32, 1.0f32 / 64.0);
    let (logits, logits64) = random::<T>(&mut rng, rows * vocab, 0.01, 6.0);
    let targets: Vec<i32> = (0..rows)
        .map(|r| {
            if r % 9 == 4 {
                cpu::IGNORE_INDEX
            } else {
                rng.random_range(0..vocab as i32)
            }
        })
        .collect();
    // CPU reference in f64.
    let (mut max, mut arg) = (vec![0.0f64; rows], vec![0i32; rows]);
    cpu::z_loss_rows(&logits64, &targets, vocab, &mut max, &mut arg).unwrap();
    let mut grad_r = logits64.clone();
    cpu::cross_entropy_fused(&mut grad_r, &targets, vocab, f64::from(scale)).unwrap();
    cpu::z_loss_apply(
        &max,
        &arg,
        vocab,
        f64::from(weight),
        f64::from(scale),
        Some(&mut grad_r),
    )
    .unwrap();
    let row_loss_r: Vec<f64> = (0..rows)
        .map(|r| {
            if targets[r] == cpu::IGNORE_INDEX {
                return 0.0;
            }
            let row = &logits64[r * vocab..(r + 1) * vocab];
            let lse = max[r] + row.iter().map(|x| (x - max[r]).exp()).sum::<f64>().ln();
            lse - row[targets[r] as usize] + f64::from(weight) * max[r] * max[r]
        })
        .collect();
    let td = upload(st, &targets);
    let mut scratch = cuda::ZLossScratch::new(st, rows).unwrap();
    let dev_scale = upload(st, &[scale]);
    for device_factor in [false, true] {
        let mut lg = upload(st, &logits);
        let mut row_loss = upload(st, &vec![f32::NAN; rows]);
        let mut totals = cuda::CeTotals::new(st).unwrap();
        cuda::z_loss_rows(st, &lg, &td, vocab, &mut scratch).unwrap();
        if device_factor {
            cuda::cross_entropy_fused_device_scale(
                st,
                &mut lg,
                &td,
                vocab,
                &dev_scale,
                &mut row_loss,
                &mut totals,
            )
            .unwrap();
        } else {
            cuda::cross_entropy_fused(
                st,
                &mut lg,
                &td,
                vocab,
                f64::from(scale),
                &mut row_loss,
                &mut totals,
            )
            .unwrap();
        }
        let factor = if device_factor {
            cuda::ZLossScale::Device(&dev_scale)
        } else {
            cuda::ZLossScale::Host(scale)
        };
        cuda::z_loss_apply(
            st,
            &scratch,
            vocab,
            weight,
            factor,
            &mut row_loss,
            Some(&mut lg),
        )
        .unwrap();
        let tag = format!("{} device factor {device_factor}", T::NAME);
        let got_loss: Vec<f64> = download(&dev, &row_loss)
            .iter()
            .map(|&x| f64::from(x))
            .collect();
        expect_within(
            test,
            &format!("{tag}: row losses"),
            rel_err("row_loss", &got_loss, &row_loss_r),
            1e-5,
        );
        expect_within(
            test,
            &format!("{tag}: dlogits"),
            rel_err("dlogits", &to_f64(&download(&dev, &lg)), &grad_r),
            tol,
        );
    }
    // Evaluation: the loss only, the logits untouched.
    let lg = upload(st, &logits);
    let mut row_loss = upload(st, &vec![f32::NAN; rows]);
    let mut totals = cuda::CeTotals::new(st).unwrap();
    cuda::cross_entropy_forward(st, &lg, &td, vocab, &mut row_loss, &mut totals).unwrap();
    cuda::z_loss_rows(st, &lg, &td, vocab, &mut scratch).unwrap();
    cuda::z_loss_apply(
        st,
        &scratch,
        vocab,
        weight,
        cuda::ZLossScale::Host::<cuda::CudaSlice<f32>>(0.0),
        &mut row_loss,
        None::<&mut cuda::CudaSlice<T>>,
    )
    .unwrap();
    let got_loss: Vec<f64> = download(&dev, &row_loss)
        .iter()
        .map(|&x| f64::from(x))
        .collect();
    expect_within(
        test,
        &format!("{} loss only: row losses", T::NAME),
        rel_err("row_loss", &got_loss, &row_loss_r),
        1e-5,
    );
    let untouched = download(&dev, &lg);
    assert!(
        untouched
            .iter()
            .zip(&logits)
            .all(|(a, b)| a.bits() == b.bits()),
        "{test}: the loss-only path changed the logits"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn z_loss_f32_matches_cpu_reference() {
    z_loss_case::<f32>("z_loss_f32", 51, 1e-5);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn z_loss_bf16_matches_cpu_reference() {
    z_loss_case::<bf16>("z_loss_bf16", 52, 1e-2);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn z_loss_f16_matches_cpu_reference() {
    z_loss_case::<f16>("z_loss_f16", 53, 2e-3);
}
