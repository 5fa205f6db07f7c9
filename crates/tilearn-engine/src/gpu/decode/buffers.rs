//! Device memory of a [`GpuDecoder`](super::GpuDecoder) in one element type `T`: the weights,
//! the key/value cache of every layer and the buffers of one chunk of new tokens.
//!
//! The cache holds, per layer, keys (already rotated to their absolute positions) and values
//! `[positions, kv_heads · head_dim]` in `T`; it grows by doubling up to the decoder's capacity
//! (a device-to-device copy of the positions held), as the CPU cache does, so a large
//! `max_new_tokens` costs memory only for the tokens generated. The chunk buffers grow to the
//! longest chunk seen (usually the prompt); a decode step allocates nothing.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use tilearn_ops::cuda::{CudaStream, DeviceFloat};

use crate::config::LlamaConfig;
use crate::error::Result;
use crate::gpu::cuda_err;

/// Buffers of one chunk of `rows` new tokens (`[rows, width]` each).
#[derive(Debug)]
pub(super) struct Chunk<T> {
    pub rows: usize,
    pub ids: CudaSlice<u32>,
    /// Residual stream (block input, then output).
    pub x: CudaSlice<T>,
    /// Normalised input of the next projection.
    pub xn: CudaSlice<T>,
    pub rstd: CudaSlice<f32>,
    pub q: CudaSlice<T>,
    pub att: CudaSlice<T>,
    /// Residual stream after attention.
    pub h: CudaSlice<T>,
    pub gate: CudaSlice<T>,
    pub up: CudaSlice<T>,
    pub act: CudaSlice<T>,
}

/// Keys and values of one layer.
#[derive(Debug)]
pub(super) struct LayerKv<T> {
    pub k: CudaSlice<T>,
    pub v: CudaSlice<T>,
}

/// Everything a decoder keeps on the device in `T`.
#[derive(Debug)]
pub(super) struct Buffers<T> {
    pub weights: CudaSlice<T>,
    pub cache: Vec<LayerKv<T>>,
    /// Positions the cache buffers have room for (allocated, not necessarily written).
    pub held: usize,
    pub chunk: Chunk<T>,
    /// Logits of the last position, `[vocab]`.
    pub logits: CudaSlice<T>,
    /// Host copy of them, before widening to f32.
    pub host_logits: Vec<T>,
}

fn alloc<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
    what: &str,
) -> Result<CudaSlice<T>> {
    stream
        .alloc_zeros::<T>(len.max(1))
        .map_err(|e| cuda_err(&format!("allocating the decoder's {what}"), e))
}

impl<T: DeviceFloat> Chunk<T> {
    fn new(stream: &Arc<CudaStream>, c: &LlamaConfig, rows: usize) -> Result<Chunk<T>> {
        let (hid, q, inter) = (c.hidden_size, c.q_dim(), c.intermediate_size);
        Ok(Chunk {
            rows,
            ids: alloc(stream, rows, "token ids")?,
            x: alloc(stream, rows * hid, "residual stream")?,
            xn: alloc(stream, rows * hid, "norm output")?,
            rstd: alloc(stream, rows, "norm statistics")?,
            q: alloc(stream, rows * q, "queries")?,
            att: alloc(stream, rows * q, "attention output")?,
            h: alloc(stream, rows * hid, "residual stream")?,
            gate: alloc(stream, rows * inter, "MLP gate")?,
            up: alloc(stream, rows * inter, "MLP up projection")?,
            act: alloc(stream, rows * inter, "MLP activation")?,
        })
    }
}

impl<T: DeviceFloat> Buffers<T> {
    /// Uploads `params` (f32, [`ParamStore`](crate::params::ParamStore) layout) rounded once to
    /// `T`, with an empty cache.
    pub(super) fn new(
        stream: &Arc<CudaStream>,
        config: &LlamaConfig,
        params: &[f32],
    ) -> Result<Buffers<T>> {
        let host: Vec<T> = params.iter().map(|&p| T::from_f32(p)).collect();
        let weights = stream
            .clone_htod(&host)
            .map_err(|e| cuda_err("uploading the decoder's weights", e))?;
        drop(host);
        let cache = (0..config.num_hidden_layers)
            .map(|_| {
                Ok(LayerKv {
                    k: alloc(stream, 0, "key cache")?,
                    v: alloc(stream, 0, "value cache")?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Buffers {
            weights,
            cache,
            held: 0,
            chunk: Chunk::new(stream, config, 1)?,
            logits: alloc(stream, config.vocab_size, "logits")?,
            host_logits: vec![T::default(); config.vocab_size],
        })
    }

    /// Makes room for `positions` in the cache (at least double what it holds, at most
    /// `capacity`), keeping the first `written` positions, and for a chunk of `rows` tokens.
    pub(super) fn reserve(
        &mut self,
        stream: &Arc<CudaStream>,
        config: &LlamaConfig,
        positions: usize,
        written: usize,
        capacity: usize,
        rows: usize,
    ) -> Result<()> {
        if self.held < positions {
            let grown = positions.max(2 * self.held).min(capacity);
            let row = config.kv_dim();
            for layer in &mut self.cache {
                for buf in [&mut layer.k, &mut layer.v] {
                    let mut bigger = alloc::<T>(stream, grown * row, "key/value cache")?;
                    if written > 0 {
                        stream
                            .memcpy_dtod(
                                &buf.slice(..written * row),
                                &mut bigger.slice_mut(..written * row),
                            )
                            .map_err(|e| cuda_err("growing the key/value cache", e))?;
                    }
                    *buf = bigger;
                }
            }
            self.held = grown;
        }
        if self.chunk.rows < rows {
            self.chunk = Chunk::new(stream, config, rows)?;
        }
        Ok(())
    }

    /// Device bytes of the key/value cache.
    pub(super) fn cache_bytes(&self) -> usize {
        self.cache
            .iter()
            .map(|l| l.k.num_bytes() + l.v.num_bytes())
            .sum()
    }
}
