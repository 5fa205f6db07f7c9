//! Causal grouped-query scaled-dot-product attention (Llama): query head `h` attends with kv
//! head `h / (q_heads / kv_heads)`, scores `s = q·k / sqrt(head_dim)`, keys `j <= i` only.
//!
//! The forward stores the per-row log-sum-exp `lse = log sum_j exp(s_ij)` so the backward
//! recomputes probabilities as `p_ij = exp(s_ij - lse_i)` instead of storing them.
//!
//! Gradient convention: `dq`, `dk`, `dv` are *written* (`=`, activation gradients).
//!
//! Parallelism and determinism: the forward runs one task per (batch, query head); the backward
//! one task per (batch, kv head), which walks its query heads and query rows in a fixed order,
//! so `dk`/`dv` (shared by the heads of a group) are summed in an order independent of
//! threads. Each task works on private buffers that are then copied into place.

use rayon::prelude::*;

use super::Real;
use super::real::{axpy, dot};

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
    fn check(&self) {
        assert!(self.head_dim > 0, "attention: head_dim must be positive");
        assert!(
            self.kv_heads > 0 && self.q_heads.is_multiple_of(self.kv_heads),
            "attention: q_heads ({}) must be a multiple of kv_heads ({})",
            self.q_heads,
            self.kv_heads
        );
    }
    fn q_len(&self) -> usize {
        self.batch * self.seq * self.q_heads * self.head_dim
    }
    fn kv_len(&self) -> usize {
        self.batch * self.seq * self.kv_heads * self.head_dim
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

/// Causal GQA forward: writes `out` and `lse`.
pub fn attention_forward<R: Real>(
    s: AttnShape,
    q: &[R],
    k: &[R],
    v: &[R],
    out: &mut [R],
    lse: &mut [R],
) {
    s.check();
    assert_eq!(q.len(), s.q_len(), "attention_forward: q length");
    assert_eq!(k.len(), s.kv_len(), "attention_forward: k length");
    assert_eq!(v.len(), s.kv_len(), "attention_forward: v length");
    assert_eq!(out.len(), s.q_len(), "attention_forward: out length");
    assert_eq!(
        lse.len(),
        s.batch * s.q_heads * s.seq,
        "attention_forward: lse length"
    );
    let (t_len, d) = (s.seq, s.head_dim);
    let scale = R::from_f64(1.0 / (d as f64).sqrt());
    let group = s.group();

    // One task per (b, h); lse is [B, Hq, T], so each task owns one contiguous lse chunk, and
    // returns its output rows [T, D] to be scattered into the interleaved `out`.
    let head_outs: Vec<Vec<R>> = lse
        .par_chunks_mut(t_len.max(1))
        .enumerate()
        .map(|(bh, lse_bh)| {
            let (b, h) = (bh / s.q_heads, bh % s.q_heads);
            let g = h / group;
            let mut o = vec![R::zero(); t_len * d];
            let mut scores = vec![R::zero(); t_len];
            for i in 0..t_len {
                let qi = &q[s.qi(b, i, h)..s.qi(b, i, h) + d];
                let mut m = R::neg_infinity();
                for (j, sc) in scores[..=i].iter_mut().enumerate() {
                    let kj = &k[s.ki(b, j, g)..s.ki(b, j, g) + d];
                    *sc = dot(qi, kj) * scale;
                    m = m.max(*sc);
                }
                let mut l = R::zero();
                for sc in scores[..=i].iter_mut() {
                    *sc = (*sc - m).exp();
                    l += *sc;
                }
                let inv_l = R::one() / l;
                let oi = &mut o[i * d..(i + 1) * d];
                for (j, &p) in scores[..=i].iter().enumerate() {
                    axpy(p * inv_l, &v[s.ki(b, j, g)..s.ki(b, j, g) + d], oi);
                }
                lse_bh[i] = m + l.ln();
            }
            o
        })
        .collect();
    if s.q_heads * d == 0 || t_len == 0 {
        return;
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
) {
    s.check();
    for (name, len, want) in [
        ("dout", dout.len(), s.q_len()),
        ("q", q.len(), s.q_len()),
        ("out", out.len(), s.q_len()),
        ("dq", dq.len(), s.q_len()),
        ("k", k.len(), s.kv_len()),
        ("v", v.len(), s.kv_len()),
        ("dk", dk.len(), s.kv_len()),
        ("dv", dv.len(), s.kv_len()),
        ("lse", lse.len(), s.batch * s.q_heads * s.seq),
    ] {
        assert_eq!(len, want, "attention_backward: {name} length");
    }
    let (t_len, d) = (s.seq, s.head_dim);
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
            let mut ds = vec![R::zero(); t_len];
            for hh in 0..group {
                let h = g * group + hh;
                for i in 0..t_len {
                    let qo = s.qi(b, i, h);
                    let qi = &q[qo..qo + d];
                    let doi = &dout[qo..qo + d];
                    let delta = dot(doi, &out[qo..qo + d]);
                    let lse_i = lse[(b * s.q_heads + h) * t_len + i];
                    for j in 0..=i {
                        let ko = s.ki(b, j, g);
                        let kj = &k[ko..ko + d];
                        let p = (dot(qi, kj) * scale - lse_i).exp();
                        axpy(p, doi, &mut dv_g[j * d..(j + 1) * d]);
                        let dp = dot(doi, &v[ko..ko + d]);
                        ds[j] = p * (dp - delta) * scale;
                    }
                    let dqi = &mut dq_g[(hh * t_len + i) * d..(hh * t_len + i + 1) * d];
                    for j in 0..=i {
                        let ko = s.ki(b, j, g);
                        axpy(ds[j], &k[ko..ko + d], dqi);
                        axpy(ds[j], qi, &mut dk_g[j * d..(j + 1) * d]);
                    }
                }
            }
            (dq_g, dk_g, dv_g)
        })
        .collect();
    if t_len == 0 || d == 0 {
        return;
    }
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
}
