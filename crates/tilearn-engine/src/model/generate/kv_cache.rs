//! The key/value cache of a decoder: for every layer, the keys (already rotated by RoPE at their
//! absolute position) and values of every token seen so far, so a new token attends to them
//! without recomputing the prefix.

use crate::config::LlamaConfig;

/// Keys and values of one layer, `[capacity, kv_heads * head_dim]` each (row = position).
#[derive(Clone, Debug)]
pub(crate) struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// Per-layer keys and values of the first [`KvCache::len`] positions of one sequence, with room
/// for [`KvCache::capacity`] positions allocated up front (decoding allocates nothing).
#[derive(Clone, Debug)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerKv>,
    /// Width of one position's keys (or values): `kv_heads * head_dim`.
    pub(crate) row: usize,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// An empty cache for up to `capacity` positions of a model described by `config`.
    pub fn new(config: &LlamaConfig, capacity: usize) -> KvCache {
        let row = config.kv_dim();
        let layer = || LayerKv {
            k: vec![0.0; capacity * row],
            v: vec![0.0; capacity * row],
        };
        KvCache {
            layers: (0..config.num_hidden_layers).map(|_| layer()).collect(),
            row,
            len: 0,
            capacity,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions this cache has room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position (the buffers are kept for the next sequence).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Bytes held by the keys and values.
    pub fn bytes(&self) -> usize {
        self.layers.len() * 2 * self.capacity * self.row * std::mem::size_of::<f32>()
    }

    /// Marks `n` more positions as held once every layer has written them.
    pub(crate) fn advance(&mut self, n: usize) {
        debug_assert!(self.len + n <= self.capacity);
        self.len += n;
    }
}
