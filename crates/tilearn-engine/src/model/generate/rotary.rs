//! Rotary angles for the positions a cached forward computes: rows `start..start + n`, laid out
//! as a table of `n` rows so the ops' `rope_forward` rotates row `i` by the angle of absolute
//! position `start + i`. Only the chunk's rows are computed (no table for the whole capacity),
//! with the same f64 formula as `RopeTable::new`.
//!
//! Dynamic NTK scaling follows transformers' cached generation: each forward computes the
//! inverse frequencies for `seq_len = start + n` (the longest sequence seen so far), so a key
//! keeps the rotation it got when it entered the cache. Past `original_max_position_embeddings`
//! this differs from one uncached forward over the whole sequence, which rotates every
//! position with the frequencies of the final length; transformers behaves the same way. For
//! the other scalings the frequencies do not depend on the length.

use tilearn_ops::cpu::{RopeTable, rope_inv_freq};

use crate::config::LlamaConfig;

/// The angles of positions `start..start + n` as rows `0..n`.
pub(crate) fn rope_rows(config: &LlamaConfig, start: usize, n: usize) -> RopeTable {
    let inv_freq = rope_inv_freq(
        config.head_dim,
        config.rope_theta,
        &config.rope_scaling.to_ops(),
        start + n,
        config.max_position_embeddings,
    );
    let half_dim = inv_freq.len();
    let mut cos = Vec::with_capacity(n * half_dim);
    let mut sin = Vec::with_capacity(n * half_dim);
    for t in start..start + n {
        for &f in &inv_freq {
            let angle = t as f64 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    RopeTable {
        half_dim,
        seq_len: n,
        cos,
        sin,
    }
}
