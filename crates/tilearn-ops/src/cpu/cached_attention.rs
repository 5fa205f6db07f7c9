//! Causal grouped-query attention of `n` new queries against a key/value cache (generation):
//! query row `i` sits at absolute position `start + i` and attends to the cached positions
//! `0..=start + i` (query head `h` uses kv head `h / (q_heads / kv_heads)`), scores
//! `q·k / sqrt(head_dim)`, softmax with the row maximum subtracted. Forward only: generation
//! needs no gradients. [`cached_attention_alibi`] adds ALiBi (Bloom, Baichuan-13B):
//! `slope_h · (j − (start + i))` on each scaled score, as the training attention does.
//!
//! f32 throughout, one task per (query row, head); each output is computed by one task in a
//! fixed order, so results do not depend on the thread count. The reference of the CUDA kernel
//! `cached_attention.cu`.

use rayon::prelude::*;

use crate::alibi::alibi_bias;
use crate::shape::expect_len;
use crate::{OpsError, Result};

/// Shape of one cached attention call: `q`/`out` are `[n, q_heads, head_dim]`, the caches
/// `[positions, kv_heads, head_dim]` with at least `start + n` positions written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedAttnShape {
    /// New queries (rows of `q`).
    pub n: usize,
    /// Absolute position of the first new query: keys `0..start + n` are read.
    pub start: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl CachedAttnShape {
    /// Fails unless `head_dim` and `kv_heads` are positive and `q_heads` is a multiple of
    /// `kv_heads`.
    pub fn check(&self) -> Result<()> {
        let bad = |op, expected, actual| {
            Err(OpsError::ShapeMismatch {
                op,
                expected,
                actual,
            })
        };
        if self.head_dim == 0 {
            return bad("cached_attention (head_dim)", 1, 0);
        }
        if self.kv_heads == 0 {
            return bad("cached_attention (kv_heads)", 1, 0);
        }
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return bad(
                "cached_attention (q_heads: a multiple of kv_heads)",
                self.q_heads.next_multiple_of(self.kv_heads),
                self.q_heads,
            );
        }
        Ok(())
    }

    /// Elements of `q` and `out`.
    pub fn q_len(&self) -> usize {
        self.n * self.q_heads * self.head_dim
    }

    /// Elements of each cache that the call reads (`start + n` positions).
    pub fn kv_len(&self) -> usize {
        (self.start + self.n) * self.kv_heads * self.head_dim
    }
}

/// `out[i, h, :] = softmax_j(q[i,h]·k[j,g] / sqrt(d)) v[j,g]` over `j <= start + i` (written,
/// `=`). `k` and `v` may be longer than the positions read (a cache with room to grow).
pub fn cached_attention(
    s: CachedAttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
) -> Result<()> {
    cached_attention_alibi(s, None, q, k, v, out)
}

/// [`cached_attention`] with ALiBi slopes (`[q_heads]`, [`crate::alibi_slopes`]): head `h`
/// adds `alibi[h] · (j − (start + i))` to its scaled scores; `None` is [`cached_attention`].
pub fn cached_attention_alibi(
    s: CachedAttnShape,
    alibi: Option<&[f32]>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
) -> Result<()> {
    const OP: &str = "cached_attention";
    s.check()?;
    if let Some(slopes) = alibi {
        expect_len("cached_attention (alibi slopes)", s.q_heads, slopes.len())?;
    }
    expect_len(OP, s.q_len(), q.len())?;
    expect_len(OP, s.q_len(), out.len())?;
    for cache in [k, v] {
        if cache.len() < s.kv_len() {
            return Err(OpsError::ShapeMismatch {
                op: "cached_attention (k/v: start + n positions)",
                expected: s.kv_len(),
                actual: cache.len(),
            });
        }
    }
    let d = s.head_dim;
    if s.q_len() == 0 {
        return Ok(());
    }
    let group = s.q_heads / s.kv_heads;
    let kv_row = s.kv_heads * d;
    let scale = 1.0 / (d as f32).sqrt();
    out.par_chunks_mut(d)
        .zip(q.par_chunks(d))
        .enumerate()
        .for_each(|(ih, (o, qh))| {
            let (i, h) = (ih / s.q_heads, ih % s.q_heads);
            let g = h / group;
            let keys = s.start + i + 1;
            let slope = alibi.map(|a| a[h]);
            let mut scores: Vec<f32> = (0..keys)
                .map(|j| {
                    let kj = &k[j * kv_row + g * d..j * kv_row + (g + 1) * d];
                    let dot = scale * qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>();
                    match slope {
                        Some(sl) => dot + alibi_bias(sl, s.start + i, j) as f32,
                        None => dot,
                    }
                })
                .collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0.0f32;
            for p in &mut scores {
                *p = (*p - max).exp();
                total += *p;
            }
            o.fill(0.0);
            for (j, p) in scores.iter().enumerate() {
                let w = p / total;
                let vj = &v[j * kv_row + g * d..j * kv_row + (g + 1) * d];
                for (oe, ve) in o.iter_mut().zip(vj) {
                    *oe += w * ve;
                }
            }
        });
    Ok(())
}
