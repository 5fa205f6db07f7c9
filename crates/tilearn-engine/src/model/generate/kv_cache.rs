//! The key/value cache of a decoder: for every layer, the keys (already rotated by RoPE at their
//! absolute position) and values of every token seen so far, so a new token attends to them
//! without recomputing the prefix.

use crate::config::LlamaConfig;

/// Keys and values of one layer, `[allocated positions, kv_heads * head_dim]` each (row =
/// position).
#[derive(Clone, Debug)]
pub(crate) struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// Per-layer keys and values of the first [`KvCache::len`] positions of one sequence, of at most
/// [`KvCache::capacity`] positions. Buffers grow by doubling as the sequence does (so a large
/// `max_new_tokens` costs memory only for the tokens actually generated); most decode steps
/// allocate nothing.
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
            k: Vec::new(),
            v: Vec::new(),
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

    /// Bytes allocated for the keys and values.
    pub fn bytes(&self) -> usize {
        let elems: usize = self.layers.iter().map(|l| l.k.len() + l.v.len()).sum();
        elems * std::mem::size_of::<f32>()
    }

    /// Makes room for `positions` (at most the capacity): at least double the positions held
    /// so far, so a sequence grown one token at a time reallocates O(log n) times.
    pub(crate) fn reserve(&mut self, positions: usize) {
        let row = self.row;
        for layer in &mut self.layers {
            let held = layer.k.len() / row.max(1);
            if held < positions {
                let grown = positions.max(2 * held).min(self.capacity) * row;
                layer.k.resize(grown, 0.0);
                layer.v.resize(grown, 0.0);
            }
        }
    }

    /// Marks `n` more positions as held once every layer has written them.
    pub(crate) fn advance(&mut self, n: usize) {
        debug_assert!(self.len + n <= self.capacity);
        self.len += n;
    }
}
