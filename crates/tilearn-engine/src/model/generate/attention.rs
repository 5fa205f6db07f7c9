//! Causal grouped-query attention of `n` new queries against a [`KvCache`](super::KvCache)
//! layer: query row `i` sits at absolute position `start + i` and attends to the cached
//! positions `0..=start + i` (query head `h` uses kv head `h / (q_heads / kv_heads)`), scores
//! `q·k / sqrt(head_dim)`, softmax with the row maximum subtracted. f32 throughout, one task per
//! (query row, head); each output is computed by one task in a fixed order, so results do not
//! depend on the thread count.

use rayon::prelude::*;

/// Shape of one cached attention call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CachedAttn {
    /// Position of the first new query.
    pub start: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// `out[i, h, :] = softmax_j(q[i,h]·k[j,g] / sqrt(d)) v[j,g]` over `j <= start + i`.
/// `q`/`out` are `[n, q_heads * head_dim]`; `k`/`v` hold at least `start + n` rows of
/// `kv_heads * head_dim`.
pub(crate) fn cached_attention(s: CachedAttn, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
    let d = s.head_dim;
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
            let mut scores: Vec<f32> = (0..keys)
                .map(|j| {
                    let kj = &k[j * kv_row + g * d..j * kv_row + (g + 1) * d];
                    scale * qh.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>()
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
}
