//! Causal grouped-query scaled-dot-product attention (Llama): query head `h` attends with kv
//! head `h / (q_heads / kv_heads)`, scores `s = q·k / sqrt(head_dim)`, keys `j <= i` only.
//! The `_masked` variants take a [`KeyMask`] (packed examples by restarting positions, a
//! sliding window): query `i` then sees the keys `key_start(i) ..= i` only. The `_alibi`
//! variants also take ALiBi slopes (f32 `[q_heads]`, [`crate::alibi`]): head `h` adds
//! `slope_h · (j − i)` to the scaled score before the softmax (Bloom, Baichuan-13B); the
//! backward's formulas are unchanged (the bias is a constant of the scores).
//!
//! The forward stores the per-row log-sum-exp `lse = log sum_j exp(s_ij)` so the backward
//! recomputes probabilities as `p_ij = exp(s_ij - lse_i)` instead of storing them.
//!
//! Gradient convention: `dq`, `dk`, `dv` are *written* (`=`, activation gradients).
//!
//! Blocking: queries are processed in blocks of `BLOCK` rows. For a block `[i0, i1)`, scores
//! against the keys `[0, i0)` (all causal for every row of the block) go through one strided
//! `gemm`; scores against the diagonal keys `[i0, i]` are dot products, so only keys `<= i` are
//! ever scored. Probabilities above the diagonal are stored as exact zeros, so the products
//! with `V` (and, in the backward, with `K`, `Q`, `dout`) can use `gemm` over `[0, i1)`.
//! Under a [`KeyMask`] every range starts at the block's first visible key `j0 =
//! key_start(i0)` instead of 0 (keys before it are seen by no row of the block, since
//! `key_start` never decreases along a row), and the probabilities of keys in
//! `[j0, key_start(i))` are exact zeros too; with plain causal attention `j0 = 0` and the
//! calls are exactly the unmasked ones.
//!
//! Parallelism and determinism: the forward runs one task per (batch, query head); the backward
//! one task per (batch, kv head), which walks its query heads and query blocks in a fixed order,
//! so `dk`/`dv` (shared by the heads of a group) are summed in an order independent of
//! threads. `gemm` here is small enough that matrixmultiply runs it on the calling thread, and
//! it is deterministic in any case. Each task works on private buffers that are then copied
//! into place.

use rayon::prelude::*;

use super::Real;
use super::real::dot;
use crate::alibi::alibi_bias;
use crate::key_mask::{KeyMask, check_positions, key_start};
use crate::shape::expect_product;
use crate::{OpsError, Result};

/// The host form of a mask: positions `[batch, seq]` as a slice.
pub type HostKeyMask<'a> = KeyMask<&'a [i32]>;

/// Checks `mask` against `s` (positions a restart sequence of `batch x seq`, a window of at
/// least one key).
fn check_mask(op: &'static str, s: &AttnShape, mask: &HostKeyMask<'_>) -> Result<()> {
    mask.check_window(op)?;
    if let Some(pos) = mask.positions {
        check_positions(pos, s.batch, s.seq)?;
    }
    Ok(())
}

/// Fails unless `alibi` (when present) holds one slope per query head.
fn check_alibi(op: &'static str, s: &AttnShape, alibi: Option<&[f32]>) -> Result<()> {
    match alibi {
        Some(slopes) if slopes.len() != s.q_heads => Err(OpsError::ShapeMismatch {
            op,
            expected: s.q_heads,
            actual: slopes.len(),
        }),
        _ => Ok(()),
    }
}

/// Adds head slope `slope`'s ALiBi bias to the scores `row` of query `i`, keys `lo..`.
fn add_alibi<R: Real>(row: &mut [R], slope: Option<f32>, i: usize, lo: usize) {
    if let Some(slope) = slope {
        for (x, j) in row.iter_mut().zip(lo..) {
            *x += R::from_f64(alibi_bias(slope, i, j));
        }
    }
}

/// `key_start` of query `i` of batch row `b`.
fn row_start(mask: &HostKeyMask<'_>, seq: usize, b: usize, i: usize) -> usize {
    key_start(
        i,
        mask.positions.map(|p| p[b * seq + i]),
        mask.sliding_window,
    )
}

/// Shape of an attention call: `q`/`out` are `[batch, seq, q_heads, head_dim]`, `k`/`v`
/// `[batch, seq, kv_heads, head_dim]`, `lse` `[batch, q_heads, seq]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// Fails unless `head_dim` and `kv_heads` are positive and `q_heads` is a multiple of
    /// `kv_heads` (each kv head serves a whole group of query heads).
    fn check(&self) -> Result<()> {
        let positive = |op, n: usize| {
            if n == 0 {
                Err(OpsError::ShapeMismatch {
                    op,
                    expected: 1,
                    actual: 0,
                })
            } else {
                Ok(())
            }
        };
        positive("attention (head_dim)", self.head_dim)?;
        positive("attention (kv_heads)", self.kv_heads)?;
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return Err(OpsError::ShapeMismatch {
                op: "attention (q_heads: a multiple of kv_heads)",
                expected: self.q_heads.next_multiple_of(self.kv_heads),
                actual: self.q_heads,
            });
        }
        Ok(())
    }
    /// Dimensions of `q`, `out` and their gradients.
    fn q_dims(&self) -> [usize; 4] {
        [self.batch, self.seq, self.q_heads, self.head_dim]
    }
    /// Dimensions of `k`, `v` and their gradients.
    fn kv_dims(&self) -> [usize; 4] {
        [self.batch, self.seq, self.kv_heads, self.head_dim]
    }
    /// Dimensions of `lse`.
    fn lse_dims(&self) -> [usize; 3] {
        [self.batch, self.q_heads, self.seq]
    }
    fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }
    /// Offset of `q[b, t, h, :]` (or `out`, `dout`).
    fn qi(&self, b: usize, t: usize, h: usize) -> usize {
        ((b * self.seq + t) * self.q_heads + h) * self.head_dim
    }
    /// Offset of `k[b, t, g, :]` (or `v`).
    fn ki(&self, b: usize, t: usize, g: usize) -> usize {
        ((b * self.seq + t) * self.kv_heads + g) * self.head_dim
    }
}

/// Query rows per block.
const BLOCK: usize = 16;

/// Strides and bases of one (batch, query head, kv head) slice of the inputs.
#[derive(Clone, Copy)]
struct HeadView {
    /// Offset of `q[b, 0, h, :]` (also `out`, `dout`).
    qb: usize,
    /// Offset of `k[b, 0, g, :]` (also `v`).
    kb: usize,
    /// Row strides of q-shaped and kv-shaped tensors.
    qs: usize,
    ks: usize,
    d: usize,
}

impl HeadView {
    fn new(s: &AttnShape, b: usize, h: usize, g: usize) -> HeadView {
        HeadView {
            qb: s.qi(b, 0, h),
            kb: s.ki(b, 0, g),
            qs: s.q_heads * s.head_dim,
            ks: s.kv_heads * s.head_dim,
            d: s.head_dim,
        }
    }
    fn qrow<'a, R>(&self, x: &'a [R], i: usize) -> &'a [R] {
        &x[self.qb + i * self.qs..self.qb + i * self.qs + self.d]
    }
    fn krow<'a, R>(&self, x: &'a [R], j: usize) -> &'a [R] {
        &x[self.kb + j * self.ks..self.kb + j * self.ks + self.d]
    }
}

/// `buf[r, j] = alpha * a_{i0+r} · b_j` for the causal part of a block: rows `r < i1 - i0`,
/// keys `j0 <= j <= i0 + r` (`j0 <= i0`). `a` is q-shaped, `b` kv-shaped; `buf` has row stride
/// `ld`. Entries `j` in `(i0 + r, i1)` are set to zero; nothing at `j < j0` or `j >= i1` is
/// touched.
#[allow(clippy::too_many_arguments)]
fn causal_block_products<R: Real>(
    hv: HeadView,
    a: &[R],
    b: &[R],
    alpha: R,
    i0: usize,
    i1: usize,
    j0: usize,
    buf: &mut [R],
    ld: usize,
) {
    let bm = i1 - i0;
    if i0 > j0 {
        // Keys [j0, i0): A = rows i0..i1 of `a` (bm×d), B = (rows j0..i0 of `b`)ᵀ (d×(i0-j0)).
        R::gemm(
            bm,
            hv.d,
            i0 - j0,
            alpha,
            &a[hv.qb + i0 * hv.qs..],
            hv.qs,
            1,
            &b[hv.kb + j0 * hv.ks..],
            1,
            hv.ks,
            R::zero(),
            &mut buf[j0..],
            ld,
            1,
        );
    }
    for r in 0..bm {
        let i = i0 + r;
        let ai = hv.qrow(a, i);
        let row = &mut buf[r * ld..r * ld + i1];
        for (j, x) in row.iter_mut().enumerate().skip(i0) {
            *x = if j <= i {
                dot(ai, hv.krow(b, j)) * alpha
            } else {
                R::zero()
            };
        }
    }
}

/// Causal GQA forward: writes `out` and `lse`.
pub fn attention_forward<R: Real>(
    s: AttnShape,
    q: &[R],
    k: &[R],
    v: &[R],
    out: &mut [R],
    lse: &mut [R],
) -> Result<()> {
    attention_forward_masked(s, KeyMask::causal(), q, k, v, out, lse)
}

/// [`attention_forward`] under `mask`: query `i` of row `b` attends to the keys
/// `key_start(i) ..= i` only (see [`KeyMask`]).
pub fn attention_forward_masked<R: Real>(
    s: AttnShape,
    mask: HostKeyMask<'_>,
    q: &[R],
    k: &[R],
    v: &[R],
    out: &mut [R],
    lse: &mut [R],
) -> Result<()> {
    attention_forward_alibi(s, mask, None, q, k, v, out, lse)
}

/// [`attention_forward_masked`] with ALiBi: head `h` adds `alibi[h] · (j − i)` to the scaled
/// scores (`None`: no bias, exactly the masked op). `lse` is that of the biased scores.
#[allow(clippy::too_many_arguments)]
pub fn attention_forward_alibi<R: Real>(
    s: AttnShape,
    mask: HostKeyMask<'_>,
    alibi: Option<&[f32]>,
    q: &[R],
    k: &[R],
    v: &[R],
    out: &mut [R],
    lse: &mut [R],
) -> Result<()> {
    s.check()?;
    check_mask("attention_forward (mask)", &s, &mask)?;
    check_alibi("attention_forward (alibi slopes)", &s, alibi)?;
    expect_product("attention_forward (q)", &s.q_dims(), q.len())?;
    expect_product("attention_forward (k)", &s.kv_dims(), k.len())?;
    expect_product("attention_forward (v)", &s.kv_dims(), v.len())?;
    expect_product("attention_forward (out)", &s.q_dims(), out.len())?;
    expect_product("attention_forward (lse)", &s.lse_dims(), lse.len())?;
    let (t_len, d) = (s.seq, s.head_dim);
    if t_len == 0 {
        return Ok(());
    }
    let scale = R::from_f64(1.0 / (d as f64).sqrt());
    let group = s.group();

    // One task per (b, h); lse is [B, Hq, T], so each task owns one contiguous lse chunk, and
    // returns its output rows [T, D] to be scattered into the interleaved `out`.
    let head_outs: Vec<Vec<R>> = lse
        .par_chunks_mut(t_len)
        .enumerate()
        .map(|(bh, lse_bh)| {
            let (b, h) = (bh / s.q_heads, bh % s.q_heads);
            let hv = HeadView::new(&s, b, h, h / group);
            let slope = alibi.map(|a| a[h]);
            let mut o = vec![R::zero(); t_len * d];
            // Scaled scores, then probabilities, of one query block: [BLOCK, T].
            let mut p = vec![R::zero(); BLOCK * t_len];
            for i0 in (0..t_len).step_by(BLOCK) {
                let i1 = (i0 + BLOCK).min(t_len);
                let j0 = row_start(&mask, t_len, b, i0);
                causal_block_products(hv, q, k, scale, i0, i1, j0, &mut p, t_len);
                for r in 0..i1 - i0 {
                    let i = i0 + r;
                    let lo = row_start(&mask, t_len, b, i);
                    p[r * t_len + j0..r * t_len + lo].fill(R::zero());
                    let row = &mut p[r * t_len + lo..r * t_len + i + 1];
                    add_alibi(row, slope, i, lo);
                    let m = row.iter().fold(R::neg_infinity(), |m, &x| m.max(x));
                    let mut l = R::zero();
                    for x in row.iter_mut() {
                        *x = (*x - m).exp();
                        l += *x;
                    }
                    let inv_l = R::one() / l;
                    for x in row.iter_mut() {
                        *x *= inv_l;
                    }
                    lse_bh[i] = m + l.ln();
                }
                // O[i0..i1] = P[:, j0..i1] · V[j0..i1] (P is zero above the diagonal and
                // before each row's first key).
                R::gemm(
                    i1 - i0,
                    i1 - j0,
                    d,
                    R::one(),
                    &p[j0..],
                    t_len,
                    1,
                    &v[hv.kb + j0 * hv.ks..],
                    hv.ks,
                    1,
                    R::zero(),
                    &mut o[i0 * d..],
                    d,
                    1,
                );
            }
            o
        })
        .collect();
    if s.q_heads == 0 {
        return Ok(());
    }
    out.par_chunks_mut(t_len * s.q_heads * d)
        .enumerate()
        .for_each(|(b, ob)| {
            for h in 0..s.q_heads {
                let src = &head_outs[b * s.q_heads + h];
                for t in 0..t_len {
                    let dst = (t * s.q_heads + h) * d;
                    ob[dst..dst + d].copy_from_slice(&src[t * d..(t + 1) * d]);
                }
            }
        });
    Ok(())
}

/// Causal GQA backward. With `p_ij = exp(s_ij - lse_i)`, `delta_i = dout_i · out_i`,
/// `ds_ij = p_ij (dout_i · v_j - delta_i)`:
/// `dq_i = scale Σ_j ds_ij k_j`, `dk_j = scale Σ_{h in group, i} ds_ij q_i`,
/// `dv_j = Σ_{h in group, i} p_ij dout_i`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward<R: Real>(
    s: AttnShape,
    dout: &[R],
    q: &[R],
    k: &[R],
    v: &[R],
    out: &[R],
    lse: &[R],
    dq: &mut [R],
    dk: &mut [R],
    dv: &mut [R],
) -> Result<()> {
    attention_backward_masked(s, KeyMask::causal(), dout, q, k, v, out, lse, dq, dk, dv)
}

/// Backward of [`attention_forward_masked`] under the same `mask` (`p_ij = 0` for the keys a
/// query does not see, so they get no gradient from it).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_masked<R: Real>(
    s: AttnShape,
    mask: HostKeyMask<'_>,
    dout: &[R],
    q: &[R],
    k: &[R],
    v: &[R],
    out: &[R],
    lse: &[R],
    dq: &mut [R],
    dk: &mut [R],
    dv: &mut [R],
) -> Result<()> {
    attention_backward_alibi(s, mask, None, dout, q, k, v, out, lse, dq, dk, dv)
}

/// Backward of [`attention_forward_alibi`] under the same `mask` and slopes (`lse` from it).
#[allow(clippy::too_many_arguments)]
pub fn attention_backward_alibi<R: Real>(
    s: AttnShape,
    mask: HostKeyMask<'_>,
    alibi: Option<&[f32]>,
    dout: &[R],
    q: &[R],
    k: &[R],
    v: &[R],
    out: &[R],
    lse: &[R],
    dq: &mut [R],
    dk: &mut [R],
    dv: &mut [R],
) -> Result<()> {
    s.check()?;
    check_mask("attention_backward (mask)", &s, &mask)?;
    check_alibi("attention_backward (alibi slopes)", &s, alibi)?;
    let (q_dims, kv_dims) = (&s.q_dims()[..], &s.kv_dims()[..]);
    for (op, dims, len) in [
        ("attention_backward (dout)", q_dims, dout.len()),
        ("attention_backward (q)", q_dims, q.len()),
        ("attention_backward (out)", q_dims, out.len()),
        ("attention_backward (dq)", q_dims, dq.len()),
        ("attention_backward (k)", kv_dims, k.len()),
        ("attention_backward (v)", kv_dims, v.len()),
        ("attention_backward (dk)", kv_dims, dk.len()),
        ("attention_backward (dv)", kv_dims, dv.len()),
        ("attention_backward (lse)", &s.lse_dims()[..], lse.len()),
    ] {
        expect_product(op, dims, len)?;
    }
    let (t_len, d) = (s.seq, s.head_dim);
    if t_len == 0 {
        return Ok(());
    }
    let scale = R::from_f64(1.0 / (d as f64).sqrt());
    let group = s.group();

    // Task per (b, g): returns (dq of the group's heads [group, T, D], dk [T, D], dv [T, D]).
    let parts: Vec<(Vec<R>, Vec<R>, Vec<R>)> = (0..s.batch * s.kv_heads)
        .into_par_iter()
        .map(|bg| {
            let (b, g) = (bg / s.kv_heads, bg % s.kv_heads);
            let mut dq_g = vec![R::zero(); group * t_len * d];
            let mut dk_g = vec![R::zero(); t_len * d];
            let mut dv_g = vec![R::zero(); t_len * d];
            let mut p = vec![R::zero(); BLOCK * t_len];
            let mut ds = vec![R::zero(); BLOCK * t_len];
            for hh in 0..group {
                let h = g * group + hh;
                let hv = HeadView::new(&s, b, h, g);
                let slope = alibi.map(|a| a[h]);
                let lse_h = &lse[(b * s.q_heads + h) * t_len..(b * s.q_heads + h + 1) * t_len];
                for i0 in (0..t_len).step_by(BLOCK) {
                    let i1 = (i0 + BLOCK).min(t_len);
                    let bm = i1 - i0;
                    let j0 = row_start(&mask, t_len, b, i0);
                    // P (zero above the diagonal) and dP = dout · Vᵀ on the causal part.
                    causal_block_products(hv, q, k, scale, i0, i1, j0, &mut p, t_len);
                    causal_block_products(hv, dout, v, R::one(), i0, i1, j0, &mut ds, t_len);
                    for r in 0..bm {
                        let i = i0 + r;
                        let lo = row_start(&mask, t_len, b, i);
                        p[r * t_len + j0..r * t_len + lo].fill(R::zero());
                        ds[r * t_len + j0..r * t_len + lo].fill(R::zero());
                        let delta = dot(hv.qrow(dout, i), hv.qrow(out, i));
                        let (pr, dsr) = (
                            &mut p[r * t_len + lo..r * t_len + i + 1],
                            &mut ds[r * t_len + lo..r * t_len + i + 1],
                        );
                        add_alibi(pr, slope, i, lo);
                        for (pj, dsj) in pr.iter_mut().zip(dsr.iter_mut()) {
                            *pj = (*pj - lse_h[i]).exp();
                            *dsj = *pj * (*dsj - delta) * scale;
                        }
                    }
                    // dQ[i0..i1] = dS[:, j0..i1] · K[j0..i1].
                    R::gemm(
                        bm,
                        i1 - j0,
                        d,
                        R::one(),
                        &ds[j0..],
                        t_len,
                        1,
                        &k[hv.kb + j0 * hv.ks..],
                        hv.ks,
                        1,
                        R::zero(),
                        &mut dq_g[(hh * t_len + i0) * d..],
                        d,
                        1,
                    );
                    // dK[j0..i1] += dSᵀ · Q[i0..i1];  dV[j0..i1] += Pᵀ · dout[i0..i1].
                    R::gemm(
                        i1 - j0,
                        bm,
                        d,
                        R::one(),
                        &ds[j0..],
                        1,
                        t_len,
                        &q[hv.qb + i0 * hv.qs..],
                        hv.qs,
                        1,
                        R::one(),
                        &mut dk_g[j0 * d..],
                        d,
                        1,
                    );
                    R::gemm(
                        i1 - j0,
                        bm,
                        d,
                        R::one(),
                        &p[j0..],
                        1,
                        t_len,
                        &dout[hv.qb + i0 * hv.qs..],
                        hv.qs,
                        1,
                        R::one(),
                        &mut dv_g[j0 * d..],
                        d,
                        1,
                    );
                }
            }
            (dq_g, dk_g, dv_g)
        })
        .collect();
    if s.q_heads > 0 {
        dq.par_chunks_mut(t_len * s.q_heads * d)
            .enumerate()
            .for_each(|(b, dqb)| {
                for h in 0..s.q_heads {
                    let (g, hh) = (h / group, h % group);
                    let src = &parts[b * s.kv_heads + g].0;
                    for t in 0..t_len {
                        let dst = (t * s.q_heads + h) * d;
                        dqb[dst..dst + d]
                            .copy_from_slice(&src[(hh * t_len + t) * d..(hh * t_len + t + 1) * d]);
                    }
                }
            });
    }
    let kv_row = t_len * s.kv_heads * d;
    dk.par_chunks_mut(kv_row)
        .zip(dv.par_chunks_mut(kv_row))
        .enumerate()
        .for_each(|(b, (dkb, dvb))| {
            for g in 0..s.kv_heads {
                let (src_k, src_v) = (&parts[b * s.kv_heads + g].1, &parts[b * s.kv_heads + g].2);
                for t in 0..t_len {
                    let dst = (t * s.kv_heads + g) * d;
                    dkb[dst..dst + d].copy_from_slice(&src_k[t * d..(t + 1) * d]);
                    dvb[dst..dst + d].copy_from_slice(&src_v[t * d..(t + 1) * d]);
                }
            }
        });
    Ok(())
}
