//! Rotary tables for the positions a cached forward computes: rows `start..start + n` of the
//! table, laid out as a table of `n` rows so the ops' `rope_forward` rotates row `i` by the angle
//! of absolute position `start + i`.
//!
//! Dynamic NTK scaling follows transformers' cached generation: each forward computes the
//! inverse frequencies for `seq_len = start + n` (the longest sequence seen so far), so a key
//! keeps the rotation it got when it entered the cache. Past `original_max_position_embeddings`
//! this differs from one uncached forward over the whole sequence, which rotates every
//! position with the frequencies of the final length; transformers behaves the same way.

use tilearn_ops::cpu::RopeTable;

use crate::config::{LlamaConfig, RopeScalingConfig};

/// The source of the rotary angles.
#[derive(Clone, Debug)]
pub(crate) enum Rotary {
    /// Frequencies independent of the sequence length: one table for the whole capacity.
    Fixed(RopeTable),
    /// Dynamic NTK: frequencies depend on the sequence length, tables are built per forward.
    Dynamic(LlamaConfig),
}

impl Rotary {
    pub fn new(config: &LlamaConfig, capacity: usize) -> Rotary {
        match config.rope_scaling {
            RopeScalingConfig::Dynamic { .. } => Rotary::Dynamic(config.clone()),
            _ => Rotary::Fixed(table(config, capacity)),
        }
    }

    /// The angles of positions `start..start + n` as rows `0..n`.
    pub fn rows(&self, start: usize, n: usize) -> RopeTable {
        match self {
            Rotary::Fixed(t) => slice(t, start, n),
            Rotary::Dynamic(config) => slice(&table(config, start + n), start, n),
        }
    }
}

fn table(config: &LlamaConfig, seq_len: usize) -> RopeTable {
    RopeTable::new(
        config.head_dim,
        config.rope_theta,
        &config.rope_scaling.to_ops(),
        seq_len,
        config.max_position_embeddings,
    )
}

fn slice(t: &RopeTable, start: usize, n: usize) -> RopeTable {
    let h = t.half_dim;
    let cells = start * h..(start + n) * h;
    RopeTable {
        half_dim: h,
        seq_len: n,
        cos: t.cos[cells.clone()].to_vec(),
        sin: t.sin[cells].to_vec(),
    }
}
