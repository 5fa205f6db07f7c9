//! Tests of the CPU reference ops (`tilearn_ops::cpu`).
//!
//! * Every backward is checked against central finite differences in f64 on seeded random
//!   inputs (never zeros) at small but non-trivial shapes. The scalar probed is always
//!   `L = Σ c ⊙ output` with a random cotangent `c`, so the analytic gradient is the backward
//!   applied to `dout = c`.
//!
//!   Why the bound `‖analytic − numeric‖ / ‖numeric‖ ≤ 1e-6` holds with a wide margin: with
//!   step `h = 1e-6`, the central difference has truncation error `h²·|L'''|/6 ≈ 1e-13` for
//!   these O(1) smooth functions, and rounding error `≈ ε_f64·|L| / h ≈ 1e-16·|L| / 1e-6 ≈
//!   1e-10·|L|`, with `|L| = O(10)` here. The per-element error is thus ~1e-9 against O(0.1–1)
//!   gradient entries: a relative error around 1e-9, while any wrong term in a backward (a
//!   missing factor, a wrong index, a dropped group member) gives an error of order 1e-2 or
//!   more. The bound is 1e-6 as required, and each test prints nothing when it passes.
//! * Forward passes are compared with naive, obviously-correct f64 implementations.
//! * Activation gradients must be *written* (`=`): their buffers are pre-filled with garbage.
//!   Parameter gradients must be *accumulated* (`+=`): their buffers are pre-filled with random
//!   values that are subtracted before comparing.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_ops::OpsError;
use tilearn_ops::cpu::*;

const FD_STEP: f64 = 1e-6;
/// Bound on the relative error of a backward against finite differences (see module docs).
const FD_TOL: f64 = 1e-6;

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` values uniform in `[lo, hi)`, with no value closer to 0 than 1e-3 (inputs are never zero).
fn rand_vec(r: &mut ChaCha8Rng, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    (0..n)
        .map(|_| {
            loop {
                let v: f64 = r.random_range(lo..hi);
                if v.abs() > 1e-3 {
                    break v;
                }
            }
        })
        .collect()
}

fn norm(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// `‖a − n‖ / ‖n‖`; panics when `n` is (nearly) zero, so a vacuous comparison cannot pass.
fn rel_err(a: &[f64], n: &[f64]) -> f64 {
    assert_eq!(a.len(), n.len(), "rel_err: length mismatch");
    let nn = norm(n);
    assert!(
        nn > 1e-8,
        "reference gradient is ~0 (‖n‖ = {nn}); the check would be vacuous"
    );
    let diff: Vec<f64> = a.iter().zip(n).map(|(x, y)| x - y).collect();
    norm(&diff) / nn
}

fn assert_close(what: &str, a: &[f64], n: &[f64], tol: f64) {
    let e = rel_err(a, n);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
}

/// Central-difference gradient of `f` at `x`.
fn fd_grad(x: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            let orig = xp[i];
            xp[i] = orig + FD_STEP;
            let fp = f(&xp);
            xp[i] = orig - FD_STEP;
            let fm = f(&xp);
            xp[i] = orig;
            (fp - fm) / (2.0 * FD_STEP)
        })
        .collect()
}

fn dotv(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Garbage for buffers that must be overwritten.
fn garbage(n: usize) -> Vec<f64> {
    (0..n).map(|i| 1e3 + i as f64).collect()
}

fn to_f32(a: &[f64]) -> Vec<f32> {
    a.iter().map(|&x| x as f32).collect()
}

/// f64 values of f32 inputs, so both precisions see exactly the same inputs.
fn f32_exact(a: &[f64]) -> Vec<f64> {
    a.iter().map(|&x| x as f32 as f64).collect()
}

fn widen(a: &[f32]) -> Vec<f64> {
    a.iter().map(|&x| x as f64).collect()
}

// ---------------------------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------------------------

const EMB_VOCAB: usize = 13;
const EMB_DIM: usize = 6;
// Repeated ids (3 and 11) check that the backward accumulates rows that hit the same entry.
const EMB_IDS: [u32; 9] = [3, 0, 11, 3, 7, 12, 11, 3, 5];

#[test]
fn embedding_forward_copies_rows() {
    let mut r = rng(1);
    let table = rand_vec(&mut r, EMB_VOCAB * EMB_DIM, -1.0, 1.0);
    let mut out = garbage(EMB_IDS.len() * EMB_DIM);
    embedding_forward(&EMB_IDS, &table, EMB_DIM, &mut out).unwrap();
    for (row, &id) in EMB_IDS.iter().enumerate() {
        let id = id as usize;
        assert_eq!(
            &out[row * EMB_DIM..(row + 1) * EMB_DIM],
            &table[id * EMB_DIM..(id + 1) * EMB_DIM]
        );
    }
}

#[test]
fn embedding_backward_matches_finite_differences() {
    // Bound FD_TOL (1e-6): the loss is linear in the table, so the central difference is exact
    // up to rounding (~1e-10 relative).
    let mut r = rng(2);
    let table = rand_vec(&mut r, EMB_VOCAB * EMB_DIM, -1.0, 1.0);
    let c = rand_vec(&mut r, EMB_IDS.len() * EMB_DIM, -1.0, 1.0);
    let prefill = rand_vec(&mut r, table.len(), -1.0, 1.0);
    let mut dtable = prefill.clone();
    embedding_backward(&EMB_IDS, &c, EMB_DIM, &mut dtable).unwrap();
    let analytic: Vec<f64> = dtable.iter().zip(&prefill).map(|(a, p)| a - p).collect();
    let numeric = fd_grad(&table, |t| {
        let mut out = vec![0.0; c.len()];
        embedding_forward(&EMB_IDS, t, EMB_DIM, &mut out).unwrap();
        dotv(&out, &c)
    });
    assert_close("embedding dtable", &analytic, &numeric, FD_TOL);
    // Rows never looked up get no gradient, exactly.
    for v in [1usize, 2, 4, 6, 8, 9, 10] {
        assert!(
            analytic[v * EMB_DIM..(v + 1) * EMB_DIM]
                .iter()
                .all(|&g| g == 0.0)
        );
    }
}

#[test]
fn embedding_rejects_out_of_range_token() {
    let table = vec![0.5f64; EMB_VOCAB * EMB_DIM];
    let ids = [1u32, 4, EMB_VOCAB as u32, 2];
    let mut out = garbage(ids.len() * EMB_DIM);
    let before = out.clone();
    let err = embedding_forward(&ids, &table, EMB_DIM, &mut out).unwrap_err();
    match err {
        OpsError::TokenOutOfRange {
            id,
            position,
            vocab,
        } => {
            assert_eq!((id, position, vocab), (EMB_VOCAB as u32, 2, EMB_VOCAB));
        }
        other => panic!("expected TokenOutOfRange, got {other:?}"),
    }
    assert_eq!(out, before, "out must be untouched on error");
    // The largest valid id is accepted.
    let ok = [EMB_VOCAB as u32 - 1];
    let mut out1 = vec![0.0; EMB_DIM];
    embedding_forward(&ok, &table, EMB_DIM, &mut out1).unwrap();
}

// ---------------------------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------------------------

const RMS_ROWS: usize = 7;
const RMS_DIM: usize = 10;
const RMS_EPS: f64 = 1e-5;

fn rmsnorm_naive(x: &[f64], w: &[f64], dim: usize, eps: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(dim) {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
        let r = 1.0 / (ms + eps).sqrt();
        out.extend(row.iter().zip(w).map(|(v, wi)| wi * (v * r)));
    }
    out
}

#[test]
fn rmsnorm_forward_matches_naive() {
    let mut r = rng(3);
    let x = rand_vec(&mut r, RMS_ROWS * RMS_DIM, -2.0, 2.0);
    let w = rand_vec(&mut r, RMS_DIM, 0.5, 1.5);
    let mut out = garbage(x.len());
    let mut rstd = garbage(RMS_ROWS);
    rmsnorm_forward(&x, &w, RMS_DIM, RMS_EPS, &mut out, &mut rstd).unwrap();
    assert_close(
        "rmsnorm out",
        &out,
        &rmsnorm_naive(&x, &w, RMS_DIM, RMS_EPS),
        1e-14,
    );
    for (i, row) in x.chunks(RMS_DIM).enumerate() {
        let ms = row.iter().map(|v| v * v).sum::<f64>() / RMS_DIM as f64;
        assert!((rstd[i] - 1.0 / (ms + RMS_EPS).sqrt()).abs() < 1e-12 * rstd[i]);
    }
}

#[test]
fn rmsnorm_backward_matches_finite_differences() {
    // Bound FD_TOL (1e-6): smooth O(1) function, FD error ~1e-9 relative (module docs).
    let mut r = rng(4);
    let x = rand_vec(&mut r, RMS_ROWS * RMS_DIM, -2.0, 2.0);
    let w = rand_vec(&mut r, RMS_DIM, -1.5, 1.5);
    let c = rand_vec(&mut r, x.len(), -1.0, 1.0);
    let loss = |x: &[f64], w: &[f64]| dotv(&rmsnorm_op(x, w), &c);
    let mut out = vec![0.0; x.len()];
    let mut rstd = vec![0.0; RMS_ROWS];
    rmsnorm_forward(&x, &w, RMS_DIM, RMS_EPS, &mut out, &mut rstd).unwrap();
    let mut dx = garbage(x.len());
    let prefill = rand_vec(&mut r, RMS_DIM, -1.0, 1.0);
    let mut dw = prefill.clone();
    rmsnorm_backward(&c, &x, &w, &rstd, RMS_DIM, &mut dx, &mut dw).unwrap();
    let dw: Vec<f64> = dw.iter().zip(&prefill).map(|(a, p)| a - p).collect();
    assert_close("rmsnorm dx", &dx, &fd_grad(&x, |x| loss(x, &w)), FD_TOL);
    assert_close(
        "rmsnorm dweight",
        &dw,
        &fd_grad(&w, |w| loss(&x, w)),
        FD_TOL,
    );
}

fn rmsnorm_op(x: &[f64], w: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    let mut rstd = vec![0.0; x.len() / RMS_DIM];
    rmsnorm_forward(x, w, RMS_DIM, RMS_EPS, &mut out, &mut rstd).unwrap();
    out
}

// ---------------------------------------------------------------------------------------------
// Linear
// ---------------------------------------------------------------------------------------------

const LIN_ROWS: usize = 5;
const LIN_IN: usize = 7;
const LIN_OUT: usize = 6;

fn linear_naive(
    x: &[f64],
    w: &[f64],
    b: Option<&[f64]>,
    rows: usize,
    in_f: usize,
    out_f: usize,
) -> Vec<f64> {
    let mut out = vec![0.0; rows * out_f];
    for i in 0..rows {
        for j in 0..out_f {
            let mut s = b.map_or(0.0, |b| b[j]);
            for p in 0..in_f {
                s += x[i * in_f + p] * w[j * in_f + p];
            }
            out[i * out_f + j] = s;
        }
    }
    out
}

fn linear_op(x: &[f64], w: &[f64], b: Option<&[f64]>) -> Vec<f64> {
    let mut out = garbage(LIN_ROWS * LIN_OUT);
    linear_forward(x, w, b, LIN_ROWS, LIN_IN, LIN_OUT, &mut out).unwrap();
    out
}

#[test]
fn linear_forward_matches_naive() {
    let mut r = rng(5);
    let x = rand_vec(&mut r, LIN_ROWS * LIN_IN, -1.0, 1.0);
    let w = rand_vec(&mut r, LIN_OUT * LIN_IN, -1.0, 1.0);
    let b = rand_vec(&mut r, LIN_OUT, -1.0, 1.0);
    for bias in [None, Some(b.as_slice())] {
        let want = linear_naive(&x, &w, bias, LIN_ROWS, LIN_IN, LIN_OUT);
        assert_close("linear out", &linear_op(&x, &w, bias), &want, 1e-14);
    }
}

#[test]
fn linear_backward_matches_finite_differences() {
    // Bound FD_TOL (1e-6): the loss is bilinear in (x, W) and linear in b, so FD is exact up to
    // rounding (~1e-10 relative).
    let mut r = rng(6);
    let x = rand_vec(&mut r, LIN_ROWS * LIN_IN, -1.0, 1.0);
    let w = rand_vec(&mut r, LIN_OUT * LIN_IN, -1.0, 1.0);
    let b = rand_vec(&mut r, LIN_OUT, -1.0, 1.0);
    let c = rand_vec(&mut r, LIN_ROWS * LIN_OUT, -1.0, 1.0);
    let mut dx = garbage(x.len());
    let pw = rand_vec(&mut r, w.len(), -1.0, 1.0);
    let pb = rand_vec(&mut r, b.len(), -1.0, 1.0);
    let (mut dw, mut db) = (pw.clone(), pb.clone());
    linear_backward(
        &c,
        &x,
        &w,
        LIN_ROWS,
        LIN_IN,
        LIN_OUT,
        Some(&mut dx),
        &mut dw,
        Some(&mut db),
    )
    .unwrap();
    let dw: Vec<f64> = dw.iter().zip(&pw).map(|(a, p)| a - p).collect();
    let db: Vec<f64> = db.iter().zip(&pb).map(|(a, p)| a - p).collect();
    let loss = |x: &[f64], w: &[f64], b: &[f64]| dotv(&linear_op(x, w, Some(b)), &c);
    assert_close("linear dx", &dx, &fd_grad(&x, |x| loss(x, &w, &b)), FD_TOL);
    assert_close("linear dw", &dw, &fd_grad(&w, |w| loss(&x, w, &b)), FD_TOL);
    assert_close("linear db", &db, &fd_grad(&b, |b| loss(&x, &w, b)), FD_TOL);

    // Without dx and db, dw is the same.
    let mut dw2 = vec![0.0; w.len()];
    linear_backward(&c, &x, &w, LIN_ROWS, LIN_IN, LIN_OUT, None, &mut dw2, None).unwrap();
    assert_close("linear dw (no dx/db)", &dw2, &dw, 1e-14);
}

// ---------------------------------------------------------------------------------------------
// SwiGLU
// ---------------------------------------------------------------------------------------------

fn swiglu_op(g: &[f64], u: &[f64]) -> Vec<f64> {
    let mut out = garbage(g.len());
    swiglu_forward(g, u, &mut out).unwrap();
    out
}

#[test]
fn swiglu_forward_matches_naive() {
    let mut r = rng(7);
    let g = rand_vec(&mut r, 23, -6.0, 6.0);
    let u = rand_vec(&mut r, 23, -2.0, 2.0);
    let want: Vec<f64> = g
        .iter()
        .zip(&u)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    assert_close("swiglu out", &swiglu_op(&g, &u), &want, 1e-14);
    // Extreme gates stay finite: silu(-1000) = 0, silu(1000) = 1000.
    let out = swiglu_op(&[-1000.0, 1000.0], &[1.0, 1.0]);
    assert_eq!(out, vec![0.0, 1000.0]);
}

#[test]
fn swiglu_backward_matches_finite_differences() {
    // Bound FD_TOL (1e-6): smooth O(1) function, FD error ~1e-9 relative (module docs).
    let mut r = rng(8);
    let g = rand_vec(&mut r, 23, -4.0, 4.0);
    let u = rand_vec(&mut r, 23, -2.0, 2.0);
    let c = rand_vec(&mut r, 23, -1.0, 1.0);
    let (mut dg, mut du) = (garbage(23), garbage(23));
    swiglu_backward(&c, &g, &u, &mut dg, &mut du).unwrap();
    assert_close(
        "swiglu dgate",
        &dg,
        &fd_grad(&g, |g| dotv(&swiglu_op(g, &u), &c)),
        FD_TOL,
    );
    assert_close(
        "swiglu dup",
        &du,
        &fd_grad(&u, |u| dotv(&swiglu_op(&g, u), &c)),
        FD_TOL,
    );
}

// ---------------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------------

fn llama3_scaling() -> RopeScaling {
    RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 1024,
    }
}

#[test]
fn rope_inv_freq_matches_hand_computed_values() {
    let (d, theta) = (8usize, 10_000.0f64);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-14 * b.abs();
    // Default: inv_freq[i] = 1 / theta^(2i/d) = 10000^(-i/4): [1, 0.1, 0.01, 0.001].
    let f = rope_inv_freq(d, theta, &RopeScaling::None, 16, 64);
    for (got, want) in f.iter().zip([1.0, 0.1, 0.01, 0.001]) {
        assert!(close(*got, want), "default: {got} vs {want}");
    }
    // Linear, factor 4: inv_freq / 4.
    let f = rope_inv_freq(d, theta, &RopeScaling::Linear { factor: 4.0 }, 16, 64);
    assert!(close(f[1], 0.025) && close(f[3], 0.00025), "linear: {f:?}");
    // Dynamic NTK, factor 2, original max 4, seq_len 8 > 4:
    // base = 10000 * (2*8/4 - (2-1))^(8/6) = 10000 * 3^(4/3);
    // inv_freq[1] = base^(-2/8) = 0.1 * 3^(-1/3), inv_freq[3] = base^(-6/8) = 0.001 * 3^(-1).
    let dynamic = RopeScaling::Dynamic {
        factor: 2.0,
        original_max_position_embeddings: 4,
    };
    let f = rope_inv_freq(d, theta, &dynamic, 8, 4);
    assert!(close(f[0], 1.0), "dynamic f0: {}", f[0]);
    assert!(
        close(f[1], 0.1 * 3f64.powf(-1.0 / 3.0)),
        "dynamic f1: {}",
        f[1]
    );
    assert!(close(f[3], 0.001 / 3.0), "dynamic f3: {}", f[3]);
    // ... and unchanged when seq_len <= original max.
    let f = rope_inv_freq(d, theta, &dynamic, 4, 4);
    assert!(
        close(f[1], 0.1) && close(f[3], 0.001),
        "dynamic short: {f:?}"
    );
    // Original max 0 falls back to max_position_embeddings (here 4 again).
    let f0 = rope_inv_freq(
        d,
        theta,
        &RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 0,
        },
        8,
        4,
    );
    assert!(
        close(f0[1], 0.1 * 3f64.powf(-1.0 / 3.0)),
        "dynamic fallback: {f0:?}"
    );
    // Llama3, factor 8, low 1, high 4, original max 1024: low_freq_wavelen = 1024,
    // high_freq_wavelen = 256; wavelen = 2π / inv_freq = [6.28, 62.8, 628.3, 6283.2].
    //  * 6.28, 62.8 < 256: unchanged (1, 0.1);
    //  * 6283.2 > 1024: divided by factor (0.001 / 8);
    //  * 628.3 in [256, 1024]: smooth = (1024 / 628.3 - 1) / (4 - 1),
    //    value = (1 - smooth) * 0.01 / 8 + smooth * 0.01.
    let f = rope_inv_freq(d, theta, &llama3_scaling(), 16, 64);
    let smooth = (1024.0 * 0.01 / (2.0 * std::f64::consts::PI) - 1.0) / 3.0;
    assert!(
        (0.2..0.22).contains(&smooth),
        "hand value of smooth: {smooth}"
    );
    let want = [
        1.0,
        0.1,
        (1.0 - smooth) * 0.01 / 8.0 + smooth * 0.01,
        0.001 / 8.0,
    ];
    for (i, (got, want)) in f.iter().zip(want).enumerate() {
        assert!(
            (got - want).abs() <= 1e-13 * want,
            "llama3 inv_freq[{i}]: {got} vs {want}"
        );
    }
}

#[test]
fn rope_table_is_cos_sin_of_position_times_inv_freq() {
    let table = RopeTable::new(8, 500.0, &RopeScaling::Linear { factor: 2.0 }, 6, 64);
    let f = rope_inv_freq(8, 500.0, &RopeScaling::Linear { factor: 2.0 }, 6, 64);
    assert_eq!(
        (
            table.half_dim,
            table.seq_len,
            table.cos.len(),
            table.sin.len()
        ),
        (4, 6, 24, 24)
    );
    for t in 0..6 {
        for (i, fi) in f.iter().enumerate() {
            let a = t as f64 * fi;
            assert_eq!(table.cos[t * 4 + i], a.cos());
            assert_eq!(table.sin[t * 4 + i], a.sin());
        }
    }
}

const ROPE_B: usize = 2;
const ROPE_T: usize = 5;
const ROPE_H: usize = 3;
const ROPE_D: usize = 8;

fn rope_naive(x: &[f64], table: &RopeTable) -> Vec<f64> {
    // Hugging Face: x * cos(emb) + rotate_half(x) * sin(emb), emb = cat(freqs, freqs),
    // rotate_half(x) = cat(-x[h..], x[..h]).
    let h = ROPE_D / 2;
    let mut out = x.to_vec();
    for b in 0..ROPE_B {
        for t in 0..ROPE_T {
            for hd in 0..ROPE_H {
                let o = ((b * ROPE_T + t) * ROPE_H + hd) * ROPE_D;
                for e in 0..ROPE_D {
                    let i = e % h;
                    let (c, s) = (table.cos[t * h + i], table.sin[t * h + i]);
                    let rot = if e < h { -x[o + e + h] } else { x[o + e - h] };
                    out[o + e] = x[o + e] * c + rot * s;
                }
            }
        }
    }
    out
}

#[test]
fn rope_forward_matches_naive_and_backward_inverts_it() {
    let mut r = rng(9);
    let x = rand_vec(&mut r, ROPE_B * ROPE_T * ROPE_H * ROPE_D, -1.0, 1.0);
    for scaling in [RopeScaling::None, llama3_scaling()] {
        // Table longer than the sequence: rows 0..T are used.
        let table = RopeTable::new(ROPE_D, 100.0, &scaling, ROPE_T + 3, 64);
        let mut y = x.clone();
        rope_forward(&mut y, ROPE_B, ROPE_T, ROPE_H, ROPE_D, &table).unwrap();
        assert_close("rope out", &y, &rope_naive(&x, &table), 1e-14);
        rope_backward(&mut y, ROPE_B, ROPE_T, ROPE_H, ROPE_D, &table).unwrap();
        assert_close("rope inverse", &y, &x, 1e-14);
    }
}

#[test]
fn rope_backward_matches_finite_differences() {
    // Bound FD_TOL (1e-6): the rotation is linear in x, so FD is exact up to rounding.
    let mut r = rng(10);
    let n = ROPE_B * ROPE_T * ROPE_H * ROPE_D;
    let x = rand_vec(&mut r, n, -1.0, 1.0);
    let c = rand_vec(&mut r, n, -1.0, 1.0);
    for scaling in [
        RopeScaling::None,
        RopeScaling::Linear { factor: 3.0 },
        RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 3,
        },
        // With theta 10 and head_dim 8 the wavelengths are 6.3, 11.2, 19.9, 35.3: original max
        // 16 (low 16, high 4) puts two in the smoothed band and two in the divided band.
        RopeScaling::Llama3 {
            factor: 4.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 16,
        },
    ] {
        let unscaled = RopeTable::new(ROPE_D, 10.0, &RopeScaling::None, ROPE_T, 3);
        let table = RopeTable::new(ROPE_D, 10.0, &scaling, ROPE_T, 3);
        if scaling != RopeScaling::None {
            assert_ne!(
                table, unscaled,
                "{scaling:?} must change the table for this test to mean anything"
            );
        }
        let mut dx = c.clone();
        rope_backward(&mut dx, ROPE_B, ROPE_T, ROPE_H, ROPE_D, &table).unwrap();
        let numeric = fd_grad(&x, |x| {
            let mut y = x.to_vec();
            rope_forward(&mut y, ROPE_B, ROPE_T, ROPE_H, ROPE_D, &table).unwrap();
            dotv(&y, &c)
        });
        assert_close(&format!("rope dx ({scaling:?})"), &dx, &numeric, FD_TOL);
    }
}

// ---------------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------------

fn attn_shape(q_heads: usize, kv_heads: usize) -> AttnShape {
    AttnShape {
        batch: 2,
        seq: 5,
        q_heads,
        kv_heads,
        head_dim: 8,
    }
}

/// softmax(Q Kᵀ / √d + causal mask) V per (b, h), and the log-sum-exp of each row, in f64.
fn attention_naive(s: AttnShape, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (t, d) = (s.seq, s.head_dim);
    let group = s.q_heads / s.kv_heads;
    let mut out = vec![0.0; q.len()];
    let mut lse = vec![0.0; s.batch * s.q_heads * t];
    for b in 0..s.batch {
        for h in 0..s.q_heads {
            let g = h / group;
            for i in 0..t {
                let qi = &q[((b * t + i) * s.q_heads + h) * d..][..d];
                // Full row with -inf above the diagonal.
                let scores: Vec<f64> = (0..t)
                    .map(|j| {
                        let kj = &k[((b * t + j) * s.kv_heads + g) * d..][..d];
                        if j <= i {
                            dotv(qi, kj) / (d as f64).sqrt()
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let z: f64 = scores.iter().map(|s| s.exp()).sum();
                lse[(b * s.q_heads + h) * t + i] = z.ln();
                for (j, sc) in scores.iter().enumerate() {
                    let p = sc.exp() / z;
                    let vj = &v[((b * t + j) * s.kv_heads + g) * d..][..d];
                    for e in 0..d {
                        out[((b * t + i) * s.q_heads + h) * d + e] += p * vj[e];
                    }
                }
            }
        }
    }
    (out, lse)
}

fn attn_inputs(s: AttnShape, seed: u64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut r = rng(seed);
    let nq = s.batch * s.seq * s.q_heads * s.head_dim;
    let nk = s.batch * s.seq * s.kv_heads * s.head_dim;
    // Scale ±1.5 gives scores of order 1: softmax rows that are neither uniform nor one-hot.
    (
        rand_vec(&mut r, nq, -1.5, 1.5),
        rand_vec(&mut r, nk, -1.5, 1.5),
        rand_vec(&mut r, nk, -1.0, 1.0),
    )
}

fn attention_op(s: AttnShape, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let mut out = garbage(q.len());
    let mut lse = garbage(s.batch * s.q_heads * s.seq);
    attention_forward(s, q, k, v, &mut out, &mut lse).unwrap();
    (out, lse)
}

#[test]
fn attention_forward_matches_naive_softmax() {
    for (hq, hkv) in [(4, 2), (4, 1), (3, 3)] {
        let s = attn_shape(hq, hkv);
        let (q, k, v) = attn_inputs(s, 11);
        let (out, lse) = attention_op(s, &q, &k, &v);
        let (want_out, want_lse) = attention_naive(s, &q, &k, &v);
        assert_close(
            &format!("attention out ({hq},{hkv})"),
            &out,
            &want_out,
            1e-13,
        );
        assert_close(
            &format!("attention lse ({hq},{hkv})"),
            &lse,
            &want_lse,
            1e-13,
        );
    }
    // Causality: changing the last position's k and v does not change earlier outputs.
    let s = attn_shape(4, 2);
    let (q, mut k, mut v) = attn_inputs(s, 12);
    let (out1, _) = attention_op(s, &q, &k, &v);
    let row_kv = s.kv_heads * s.head_dim;
    for b in 0..s.batch {
        let o = (b * s.seq + s.seq - 1) * row_kv;
        for e in 0..row_kv {
            k[o + e] += 0.7;
            v[o + e] -= 0.4;
        }
    }
    let (out2, _) = attention_op(s, &q, &k, &v);
    let row_q = s.q_heads * s.head_dim;
    for b in 0..s.batch {
        for t in 0..s.seq {
            let o = (b * s.seq + t) * row_q;
            let same = out1[o..o + row_q] == out2[o..o + row_q];
            assert_eq!(same, t + 1 < s.seq, "causality at b={b} t={t}");
        }
    }
}

#[test]
fn attention_backward_matches_finite_differences() {
    // Bound FD_TOL (1e-6): smooth O(1) function (scores of order 1), FD error ~1e-9 relative.
    // Shapes: head_dim 8, T = 5, batch 2; GQA 4 query / 2 kv heads, plus MQA and MHA.
    for (hq, hkv) in [(4, 2), (4, 1), (3, 3)] {
        let s = attn_shape(hq, hkv);
        let (q, k, v) = attn_inputs(s, 13 + hq as u64 * 10 + hkv as u64);
        let mut r = rng(99);
        let c = rand_vec(&mut r, q.len(), -1.0, 1.0);
        let (out, lse) = attention_op(s, &q, &k, &v);
        let (mut dq, mut dk, mut dv) = (garbage(q.len()), garbage(k.len()), garbage(v.len()));
        attention_backward(s, &c, &q, &k, &v, &out, &lse, &mut dq, &mut dk, &mut dv).unwrap();
        let loss = |q: &[f64], k: &[f64], v: &[f64]| dotv(&attention_op(s, q, k, v).0, &c);
        let tag = format!("({hq},{hkv})");
        assert_close(
            &format!("attention dq {tag}"),
            &dq,
            &fd_grad(&q, |q| loss(q, &k, &v)),
            FD_TOL,
        );
        assert_close(
            &format!("attention dk {tag}"),
            &dk,
            &fd_grad(&k, |k| loss(&q, k, &v)),
            FD_TOL,
        );
        assert_close(
            &format!("attention dv {tag}"),
            &dv,
            &fd_grad(&v, |v| loss(&q, &k, v)),
            FD_TOL,
        );
    }
}

#[test]
fn attention_multi_block_matches_naive_and_finite_differences() {
    // T = 37 spans three query blocks of the blocked implementation (16 rows each), so the
    // strided-gemm path for keys before the block and the diagonal dot-product path both run.
    // Bound FD_TOL (1e-6): same smooth O(1) function as above, FD error ~1e-9 relative.
    let s = AttnShape {
        batch: 1,
        seq: 37,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let (q, k, v) = attn_inputs(s, 31);
    let (out, lse) = attention_op(s, &q, &k, &v);
    let (want_out, want_lse) = attention_naive(s, &q, &k, &v);
    assert_close("attention out (T=37)", &out, &want_out, 1e-13);
    assert_close("attention lse (T=37)", &lse, &want_lse, 1e-13);
    let mut r = rng(32);
    let c = rand_vec(&mut r, q.len(), -1.0, 1.0);
    let (mut dq, mut dk, mut dv) = (garbage(q.len()), garbage(k.len()), garbage(v.len()));
    attention_backward(s, &c, &q, &k, &v, &out, &lse, &mut dq, &mut dk, &mut dv).unwrap();
    let loss = |q: &[f64], k: &[f64], v: &[f64]| dotv(&attention_op(s, q, k, v).0, &c);
    assert_close(
        "attention dq (T=37)",
        &dq,
        &fd_grad(&q, |q| loss(q, &k, &v)),
        FD_TOL,
    );
    assert_close(
        "attention dk (T=37)",
        &dk,
        &fd_grad(&k, |k| loss(&q, k, &v)),
        FD_TOL,
    );
    assert_close(
        "attention dv (T=37)",
        &dv,
        &fd_grad(&v, |v| loss(&q, &k, v)),
        FD_TOL,
    );
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy
// ---------------------------------------------------------------------------------------------

const CE_VOCAB: usize = 37;
const CE_TARGETS: [i32; 7] = [5, -100, 36, 0, -100, 17, 5];

fn ce_naive(logits: &[f64], targets: &[i32], vocab: usize) -> (f64, usize) {
    let mut sum = 0.0;
    let mut valid = 0;
    for (row, &t) in logits.chunks(vocab).zip(targets) {
        if t == -100 {
            continue;
        }
        let z: f64 = row.iter().map(|x| x.exp()).sum();
        sum += -(row[t as usize].exp() / z).ln();
        valid += 1;
    }
    (sum, valid)
}

#[test]
fn cross_entropy_forward_matches_naive_and_ignores_minus_100() {
    let mut r = rng(14);
    let logits = rand_vec(&mut r, CE_TARGETS.len() * CE_VOCAB, -3.0, 3.0);
    let stats = cross_entropy_forward(&logits, &CE_TARGETS, CE_VOCAB).unwrap();
    let (want, valid) = ce_naive(&logits, &CE_TARGETS, CE_VOCAB);
    assert_eq!(valid, 5);
    assert_eq!(stats.valid, 5);
    assert!(
        (stats.loss_sum - want).abs() <= 1e-13 * want,
        "{} vs {want}",
        stats.loss_sum
    );
    // Changing an ignored row's logits changes nothing.
    let mut l2 = logits.clone();
    for x in &mut l2[CE_VOCAB..2 * CE_VOCAB] {
        *x += 5.0;
    }
    assert_eq!(
        cross_entropy_forward(&l2, &CE_TARGETS, CE_VOCAB).unwrap(),
        stats
    );
    // All ignored: zero loss, zero count.
    let none = cross_entropy_forward(&logits, &[-100; 7], CE_VOCAB).unwrap();
    assert_eq!((none.loss_sum, none.valid), (0.0, 0));
}

#[test]
fn cross_entropy_is_stable_for_large_logits() {
    // Shifting all logits of a row by a constant does not change the loss; without the max
    // subtraction exp(1000) would overflow.
    let mut r = rng(15);
    let logits = rand_vec(&mut r, 3 * CE_VOCAB, -3.0, 3.0);
    let targets = [4, 30, 2];
    let base = cross_entropy_forward(&logits, &targets, CE_VOCAB).unwrap();
    let shifted: Vec<f64> = logits.iter().map(|x| x + 1000.0).collect();
    let s = cross_entropy_forward(&shifted, &targets, CE_VOCAB).unwrap();
    assert!(
        s.loss_sum.is_finite() && (s.loss_sum - base.loss_sum).abs() < 1e-9,
        "{s:?} vs {base:?}"
    );
    let mut g = to_f32(&shifted);
    let s32 = cross_entropy_fused(&mut g, &targets, CE_VOCAB, 1.0).unwrap();
    assert!(s32.loss_sum.is_finite() && g.iter().all(|x| x.is_finite()));
    assert!((s32.loss_sum - base.loss_sum).abs() < 1e-3 * base.loss_sum);
}

#[test]
fn cross_entropy_fused_gradient_matches_finite_differences() {
    // Bound FD_TOL (1e-6): smooth O(1) function (logits in ±3), FD error ~1e-9 relative.
    let mut r = rng(16);
    let logits = rand_vec(&mut r, CE_TARGETS.len() * CE_VOCAB, -3.0, 3.0);
    let grad_scale = 0.37;
    let fwd = cross_entropy_forward(&logits, &CE_TARGETS, CE_VOCAB).unwrap();
    let mut g = logits.clone();
    let stats = cross_entropy_fused(&mut g, &CE_TARGETS, CE_VOCAB, grad_scale).unwrap();
    assert_eq!(stats.valid, 5);
    assert!((stats.loss_sum - fwd.loss_sum).abs() <= 1e-14 * fwd.loss_sum);
    let numeric = fd_grad(&logits, |l| {
        cross_entropy_forward(l, &CE_TARGETS, CE_VOCAB)
            .unwrap()
            .loss_sum
            * grad_scale
    });
    assert_close("cross-entropy dlogits", &g, &numeric, FD_TOL);
    for (row, &t) in g.chunks(CE_VOCAB).zip(&CE_TARGETS) {
        if t == -100 {
            assert!(
                row.iter().all(|&x| x == 0.0),
                "ignored row must have zero gradient"
            );
        } else {
            // Each valid row of (softmax - onehot) sums to 0.
            assert!(row.iter().sum::<f64>().abs() < 1e-14);
        }
    }
}

#[test]
fn cross_entropy_rejects_out_of_range_labels() {
    let logits = vec![0.25f64; 4 * CE_VOCAB];
    for (bad, pos) in [(CE_VOCAB as i32, 2usize), (-1, 1), (-101, 3), (i32::MAX, 0)] {
        let mut targets = [1, 2, 3, 4];
        targets[pos] = bad;
        match cross_entropy_forward(&logits, &targets, CE_VOCAB).unwrap_err() {
            OpsError::LabelOutOfRange {
                label,
                position,
                vocab,
            } => {
                assert_eq!((label, position, vocab), (bad, pos, CE_VOCAB));
            }
            other => panic!("expected LabelOutOfRange, got {other:?}"),
        }
        let mut l = logits.clone();
        let err = cross_entropy_fused(&mut l, &targets, CE_VOCAB, 1.0).unwrap_err();
        assert!(matches!(err, OpsError::LabelOutOfRange { .. }));
        assert_eq!(l, logits, "logits must be untouched on error");
    }
    // The boundary labels are fine.
    cross_entropy_forward(&logits, &[0, CE_VOCAB as i32 - 1, -100, 3], CE_VOCAB).unwrap();
    // A length mismatch is an error too.
    assert!(matches!(
        cross_entropy_forward(&logits, &[0, 1, 2], CE_VOCAB),
        Err(OpsError::ShapeMismatch { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// Residual
// ---------------------------------------------------------------------------------------------

#[test]
fn add_inplace_adds() {
    let mut r = rng(17);
    let a = rand_vec(&mut r, 40_000, -1.0, 1.0);
    let b = rand_vec(&mut r, 40_000, -1.0, 1.0);
    let mut acc = a.clone();
    add_inplace(&mut acc, &b).unwrap();
    for i in 0..a.len() {
        assert_eq!(acc[i], a[i] + b[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// f32 instantiation agrees with f64
// ---------------------------------------------------------------------------------------------

/// Bound for f32 vs f64 on the same inputs: f32 has ~6e-8 unit rounding; these small ops
/// accumulate at most a few hundred roundings, so 1e-5 relative is comfortable but would catch
/// any real difference of behaviour between the two instantiations.
const F32_TOL: f64 = 1e-5;

#[test]
fn f32_agrees_with_f64() {
    let mut r = rng(18);
    // RMSNorm forward + backward.
    {
        let x = f32_exact(&rand_vec(&mut r, RMS_ROWS * RMS_DIM, -2.0, 2.0));
        let w = f32_exact(&rand_vec(&mut r, RMS_DIM, 0.5, 1.5));
        let c = f32_exact(&rand_vec(&mut r, x.len(), -1.0, 1.0));
        let (mut o64, mut r64, mut dx64, mut dw64) = (
            vec![0.0; x.len()],
            vec![0.0; RMS_ROWS],
            vec![0.0; x.len()],
            vec![0.0; RMS_DIM],
        );
        rmsnorm_forward(&x, &w, RMS_DIM, RMS_EPS, &mut o64, &mut r64).unwrap();
        rmsnorm_backward(&c, &x, &w, &r64, RMS_DIM, &mut dx64, &mut dw64).unwrap();
        let (x32, w32, c32) = (to_f32(&x), to_f32(&w), to_f32(&c));
        let (mut o32, mut r32, mut dx32, mut dw32) = (
            vec![0f32; x.len()],
            vec![0f32; RMS_ROWS],
            vec![0f32; x.len()],
            vec![0f32; RMS_DIM],
        );
        rmsnorm_forward(&x32, &w32, RMS_DIM, RMS_EPS, &mut o32, &mut r32).unwrap();
        rmsnorm_backward(&c32, &x32, &w32, &r32, RMS_DIM, &mut dx32, &mut dw32).unwrap();
        assert_close("f32 rmsnorm out", &widen(&o32), &o64, F32_TOL);
        assert_close("f32 rmsnorm dx", &widen(&dx32), &dx64, F32_TOL);
        assert_close("f32 rmsnorm dw", &widen(&dw32), &dw64, F32_TOL);
    }
    // Linear forward + backward (with bias).
    {
        let x = f32_exact(&rand_vec(&mut r, LIN_ROWS * LIN_IN, -1.0, 1.0));
        let w = f32_exact(&rand_vec(&mut r, LIN_OUT * LIN_IN, -1.0, 1.0));
        let b = f32_exact(&rand_vec(&mut r, LIN_OUT, -1.0, 1.0));
        let c = f32_exact(&rand_vec(&mut r, LIN_ROWS * LIN_OUT, -1.0, 1.0));
        let mut o64 = vec![0.0; c.len()];
        linear_forward(&x, &w, Some(&b), LIN_ROWS, LIN_IN, LIN_OUT, &mut o64).unwrap();
        let (mut dx64, mut dw64, mut db64) =
            (vec![0.0; x.len()], vec![0.0; w.len()], vec![0.0; b.len()]);
        linear_backward(
            &c,
            &x,
            &w,
            LIN_ROWS,
            LIN_IN,
            LIN_OUT,
            Some(&mut dx64),
            &mut dw64,
            Some(&mut db64),
        )
        .unwrap();
        let (x32, w32, b32, c32) = (to_f32(&x), to_f32(&w), to_f32(&b), to_f32(&c));
        let mut o32 = vec![0f32; c.len()];
        linear_forward(&x32, &w32, Some(&b32), LIN_ROWS, LIN_IN, LIN_OUT, &mut o32).unwrap();
        let (mut dx32, mut dw32, mut db32) = (
            vec![0f32; x.len()],
            vec![0f32; w.len()],
            vec![0f32; b.len()],
        );
        linear_backward(
            &c32,
            &x32,
            &w32,
            LIN_ROWS,
            LIN_IN,
            LIN_OUT,
            Some(&mut dx32),
            &mut dw32,
            Some(&mut db32),
        )
        .unwrap();
        assert_close("f32 linear out", &widen(&o32), &o64, F32_TOL);
        assert_close("f32 linear dx", &widen(&dx32), &dx64, F32_TOL);
        assert_close("f32 linear dw", &widen(&dw32), &dw64, F32_TOL);
        assert_close("f32 linear db", &widen(&db32), &db64, F32_TOL);
    }
    // SwiGLU.
    {
        let g = f32_exact(&rand_vec(&mut r, 50, -4.0, 4.0));
        let u = f32_exact(&rand_vec(&mut r, 50, -2.0, 2.0));
        let c = f32_exact(&rand_vec(&mut r, 50, -1.0, 1.0));
        let (mut o64, mut dg64, mut du64) = (vec![0.0; 50], vec![0.0; 50], vec![0.0; 50]);
        swiglu_forward(&g, &u, &mut o64).unwrap();
        swiglu_backward(&c, &g, &u, &mut dg64, &mut du64).unwrap();
        let (g32, u32_, c32) = (to_f32(&g), to_f32(&u), to_f32(&c));
        let (mut o32, mut dg32, mut du32) = (vec![0f32; 50], vec![0f32; 50], vec![0f32; 50]);
        swiglu_forward(&g32, &u32_, &mut o32).unwrap();
        swiglu_backward(&c32, &g32, &u32_, &mut dg32, &mut du32).unwrap();
        assert_close("f32 swiglu out", &widen(&o32), &o64, F32_TOL);
        assert_close("f32 swiglu dgate", &widen(&dg32), &dg64, F32_TOL);
        assert_close("f32 swiglu dup", &widen(&du32), &du64, F32_TOL);
    }
    // RoPE forward.
    {
        let table = RopeTable::new(ROPE_D, 10_000.0, &llama3_scaling(), ROPE_T, 64);
        let x = f32_exact(&rand_vec(
            &mut r,
            ROPE_B * ROPE_T * ROPE_H * ROPE_D,
            -1.0,
            1.0,
        ));
        let mut y64 = x.clone();
        rope_forward(&mut y64, ROPE_B, ROPE_T, ROPE_H, ROPE_D, &table).unwrap();
        let mut y32 = to_f32(&x);
        rope_forward(&mut y32, ROPE_B, ROPE_T, ROPE_H, ROPE_D, &table).unwrap();
        assert_close("f32 rope", &widen(&y32), &y64, F32_TOL);
    }
    // Attention forward + backward.
    {
        let s = attn_shape(4, 2);
        let (q, k, v) = attn_inputs(s, 19);
        let (q, k, v) = (f32_exact(&q), f32_exact(&k), f32_exact(&v));
        let c = f32_exact(&rand_vec(&mut r, q.len(), -1.0, 1.0));
        let (o64, l64) = attention_op(s, &q, &k, &v);
        let (mut dq64, mut dk64, mut dv64) =
            (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        attention_backward(
            s, &c, &q, &k, &v, &o64, &l64, &mut dq64, &mut dk64, &mut dv64,
        )
        .unwrap();
        let (q32, k32, v32, c32) = (to_f32(&q), to_f32(&k), to_f32(&v), to_f32(&c));
        let (mut o32, mut l32) = (vec![0f32; q.len()], vec![0f32; l64.len()]);
        attention_forward(s, &q32, &k32, &v32, &mut o32, &mut l32).unwrap();
        let (mut dq32, mut dk32, mut dv32) = (
            vec![0f32; q.len()],
            vec![0f32; k.len()],
            vec![0f32; v.len()],
        );
        attention_backward(
            s, &c32, &q32, &k32, &v32, &o32, &l32, &mut dq32, &mut dk32, &mut dv32,
        )
        .unwrap();
        assert_close("f32 attention out", &widen(&o32), &o64, F32_TOL);
        assert_close("f32 attention lse", &widen(&l32), &l64, F32_TOL);
        assert_close("f32 attention dq", &widen(&dq32), &dq64, F32_TOL);
        assert_close("f32 attention dk", &widen(&dk32), &dk64, F32_TOL);
        assert_close("f32 attention dv", &widen(&dv32), &dv64, F32_TOL);
    }
    // Cross-entropy fused.
    {
        let logits = f32_exact(&rand_vec(&mut r, CE_TARGETS.len() * CE_VOCAB, -3.0, 3.0));
        let mut g64 = logits.clone();
        let s64 = cross_entropy_fused(&mut g64, &CE_TARGETS, CE_VOCAB, 0.5).unwrap();
        let mut g32 = to_f32(&logits);
        let s32 = cross_entropy_fused(&mut g32, &CE_TARGETS, CE_VOCAB, 0.5).unwrap();
        assert_eq!(s32.valid, s64.valid);
        assert!(
            (s32.loss_sum - s64.loss_sum).abs() <= F32_TOL * s64.loss_sum,
            "{s32:?} vs {s64:?}"
        );
        assert_close("f32 cross-entropy grad", &widen(&g32), &g64, F32_TOL);
    }
}

// ---------------------------------------------------------------------------------------------
// Determinism
// ---------------------------------------------------------------------------------------------

/// Runs every op (forward and backward) at shapes large enough to split into many parallel
/// tasks and blocks, and returns the bit patterns of every output.
fn run_all_ops_f32(seed: u64) -> Vec<u32> {
    let mut r = rng(seed);
    let mut rv = |n: usize, lo: f64, hi: f64| to_f32(&rand_vec(&mut r, n, lo, hi));
    let mut bits: Vec<u32> = Vec::new();
    let mut push = |v: &[f32]| bits.extend(v.iter().map(|x| x.to_bits()));

    let (rows, dim, vocab) = (300usize, 96usize, 301usize);
    // Embedding (repeated ids across rows).
    let ids: Vec<u32> = (0..rows)
        .map(|i| ((i * 7919) % vocab) as u32 % 50)
        .collect();
    let table = rv(vocab * dim, -1.0, 1.0);
    let mut emb = vec![0f32; rows * dim];
    embedding_forward(&ids, &table, dim, &mut emb).unwrap();
    let demb = rv(rows * dim, -1.0, 1.0);
    let mut dtable = vec![0f32; vocab * dim];
    embedding_backward(&ids, &demb, dim, &mut dtable).unwrap();
    push(&dtable);
    // RMSNorm.
    let w = rv(dim, 0.5, 1.5);
    let (mut y, mut rstd) = (vec![0f32; rows * dim], vec![0f32; rows]);
    rmsnorm_forward(&emb, &w, dim, 1e-6, &mut y, &mut rstd).unwrap();
    let dy = rv(rows * dim, -1.0, 1.0);
    let (mut dx, mut dw) = (vec![0f32; rows * dim], vec![0f32; dim]);
    rmsnorm_backward(&dy, &emb, &w, &rstd, dim, &mut dx, &mut dw).unwrap();
    push(&y);
    push(&dx);
    push(&dw);
    // Linear with bias, odd sizes.
    let out_f = 130;
    let lw = rv(out_f * dim, -0.2, 0.2);
    let lb = rv(out_f, -0.2, 0.2);
    let mut lo = vec![0f32; rows * out_f];
    linear_forward(&y, &lw, Some(&lb), rows, dim, out_f, &mut lo).unwrap();
    let dlo = rv(rows * out_f, -1.0, 1.0);
    let (mut ldx, mut ldw, mut ldb) = (
        vec![0f32; rows * dim],
        vec![0f32; out_f * dim],
        vec![0f32; out_f],
    );
    linear_backward(
        &dlo,
        &y,
        &lw,
        rows,
        dim,
        out_f,
        Some(&mut ldx),
        &mut ldw,
        Some(&mut ldb),
    )
    .unwrap();
    push(&lo);
    push(&ldx);
    push(&ldw);
    push(&ldb);
    // SwiGLU.
    let (mut so, mut sdg, mut sdu) = (
        vec![0f32; lo.len()],
        vec![0f32; lo.len()],
        vec![0f32; lo.len()],
    );
    swiglu_forward(&lo, &dlo, &mut so).unwrap();
    swiglu_backward(&dlo, &lo, &dlo, &mut sdg, &mut sdu).unwrap();
    push(&so);
    push(&sdg);
    push(&sdu);
    // RoPE + attention: B 3, T 40, Hq 4, Hkv 2, D 16.
    let s = AttnShape {
        batch: 3,
        seq: 40,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
    };
    let nq = s.batch * s.seq * s.q_heads * s.head_dim;
    let nk = s.batch * s.seq * s.kv_heads * s.head_dim;
    let table = RopeTable::new(16, 10_000.0, &llama3_scaling(), s.seq, 64);
    let mut q = rv(nq, -1.5, 1.5);
    let mut k = rv(nk, -1.5, 1.5);
    let v = rv(nk, -1.0, 1.0);
    rope_forward(&mut q, s.batch, s.seq, s.q_heads, s.head_dim, &table).unwrap();
    rope_forward(&mut k, s.batch, s.seq, s.kv_heads, s.head_dim, &table).unwrap();
    let (mut ao, mut lse) = (vec![0f32; nq], vec![0f32; s.batch * s.q_heads * s.seq]);
    attention_forward(s, &q, &k, &v, &mut ao, &mut lse).unwrap();
    let dao = rv(nq, -1.0, 1.0);
    let (mut dq, mut dk, mut dv) = (vec![0f32; nq], vec![0f32; nk], vec![0f32; nk]);
    attention_backward(s, &dao, &q, &k, &v, &ao, &lse, &mut dq, &mut dk, &mut dv).unwrap();
    rope_backward(&mut dq, s.batch, s.seq, s.q_heads, s.head_dim, &table).unwrap();
    push(&ao);
    push(&lse);
    push(&dq);
    push(&dk);
    push(&dv);
    // Cross-entropy.
    let mut logits = rv(rows * vocab, -4.0, 4.0);
    let targets: Vec<i32> = (0..rows)
        .map(|i| {
            if i % 7 == 3 {
                -100
            } else {
                ((i * 31) % vocab) as i32
            }
        })
        .collect();
    let st = cross_entropy_fused(&mut logits, &targets, vocab, 1.0 / 250.0).unwrap();
    push(&logits);
    // Residual.
    let mut acc = dx.clone();
    add_inplace(&mut acc, &ldx).unwrap();
    push(&acc);
    bits.extend_from_slice(&[
        st.loss_sum.to_bits() as u32,
        (st.loss_sum.to_bits() >> 32) as u32,
        st.valid as u32,
    ]);
    bits
}

#[test]
fn ops_are_bit_identical_across_runs_and_thread_counts() {
    let run_in = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| run_all_ops_f32(20))
    };
    let reference = run_all_ops_f32(20);
    assert_eq!(reference, run_all_ops_f32(20), "two runs differ");
    for threads in [1, 3, 7] {
        assert!(
            reference == run_in(threads),
            "results with {threads} rayon threads differ"
        );
    }
    // The comparison can fail: another seed gives different bits.
    assert_ne!(reference, run_all_ops_f32(21));
}
