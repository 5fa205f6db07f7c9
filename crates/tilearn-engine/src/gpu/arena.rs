//! The device activation arena: every buffer the forward and backward need, in two
//! allocations made once at model build (one untyped, viewed as the activation type `T` of the
//! call, one of f32 for the per-row statistics), carved into named views for each call.
//!
//! Each call carves views sized for its own `n = batch * seq` rows from the start of the arena
//! (a shorter batch uses a prefix of the space), so layouts such as the attention's `[B, Hq, T]`
//! log-sum-exp are contiguous for the call's shape. Every buffer starts on a multiple of
//! [`ALIGN_ELEMS`] elements (256 bytes for f32, 128 for bf16 and f16) so vectorised kernels and
//! cuBLASLt see aligned pointers.
//!
//! The logits buffer holds one chunk of the loss head's tokens, `[chunk × vocab]` (see
//! [`crate::lce_chunk`]), not the whole call's `[n × vocab]`: the fused linear + cross entropy
//! computes, differentiates and discards the logits chunk by chunk.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceSlice};
use tilearn_ops::cuda::{CudaStream, DeviceFloat};

use super::views::{Carver, sub_mut};
use crate::config::{LlamaConfig, NormKind};
use crate::error::Result;
use std::sync::Arc;

/// Every buffer's start is rounded up to this many elements.
pub(crate) const ALIGN_ELEMS: usize = 64;

fn padded(len: usize) -> usize {
    len.div_ceil(ALIGN_ELEMS) * ALIGN_ELEMS
}

/// Sizes of one call: `n = batch * seq` rows plus the model widths.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub batch: usize,
    pub seq: usize,
    pub n: usize,
    pub c: usize,
    pub q: usize,
    pub kv: usize,
    pub inter: usize,
    pub vocab: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub layers: usize,
    pub eps: f64,
    /// Elements of the lm_head (`V * C`) when NormHead normalises it, else 0.
    pub head_norm_len: usize,
    /// Baichuan2's z-loss weight (0: none).
    pub z_loss_weight: f64,
    /// LayerNorm (Bloom): the norms save means too, `n` f32 each (0 for RMSNorm).
    pub mean_len: usize,
    /// Bloom's embedding LayerNorm: its mean and rstd, `n` f32 each (0 otherwise).
    pub embed_norm_len: usize,
}

impl Dims {
    pub(crate) fn new(config: &LlamaConfig, batch: usize, seq: usize) -> Dims {
        Dims {
            batch,
            seq,
            n: batch * seq,
            c: config.hidden_size,
            q: config.q_dim(),
            kv: config.kv_dim(),
            inter: config.intermediate_size,
            vocab: config.vocab_size,
            q_heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            layers: config.num_hidden_layers,
            eps: config.rms_norm_eps,
            head_norm_len: if config.norm_head() {
                config.vocab_size * config.hidden_size
            } else {
                0
            },
            z_loss_weight: config.z_loss_weight,
            mean_len: if config.family.norm_kind() == NormKind::Layer {
                batch * seq
            } else {
                0
            },
            embed_norm_len: if config.family.embedding_norm() {
                batch * seq
            } else {
                0
            },
        }
    }

    /// Lengths of the `T` buffers of one layer, in carving order: xn1, q, k, v, att, h, xn2,
    /// gate, up, act. Under checkpointing (`shared`: one set for all layers) `gate` and `up`
    /// live in the [`Scratch`] instead, one MLP chunk at a time; `act` is empty when the
    /// backward recomputes it (see [`ActStore`]).
    fn layer_lens(&self, act: ActStore, shared: bool) -> [usize; 10] {
        let (n, c, q, kv, i) = (self.n, self.c, self.q, self.kv, self.inter);
        let gate_up = if shared { 0 } else { n * i };
        let act_len = match act {
            ActStore::Kept => n * i,
            ActStore::Recomputed => 0,
        };
        [
            n * c,
            n * q,
            n * kv,
            n * kv,
            n * q,
            n * c,
            n * c,
            gate_up,
            gate_up,
            act_len,
        ]
    }

    /// Lengths of the gradient scratch that lives through the whole backward, in carving
    /// order: dres, dxn, dtmp.
    fn grad_lens(&self) -> [usize; 3] {
        [self.n * self.c; 3]
    }

    /// Lengths of an MLP chunk's buffers in the scratch, in carving order: gate, up (only
    /// under checkpointing, `shared`), dgate, dup, dact, for `mlp_rows` tokens.
    fn mlp_lens(&self, mlp_rows: usize, shared: bool) -> [usize; 5] {
        let m = mlp_rows.min(self.n) * self.inter;
        let gate_up = if shared { m } else { 0 };
        [gate_up, gate_up, m, m, m]
    }

    /// Lengths of the attention backward's gradients, in carving order: dq, dk, dv, datt.
    fn attention_grad_lens(&self) -> [usize; 4] {
        let (n, q, kv) = (self.n, self.q, self.kv);
        [n * q, n * kv, n * kv, n * q]
    }

    /// Elements of the [`Scratch`]: the largest of its three uses.
    fn scratch_len(&self, logit_rows: usize, mlp_rows: usize, shared: bool) -> usize {
        let sum = |lens: &[usize]| lens.iter().map(|&l| padded(l)).sum::<usize>();
        self.logits_len(logit_rows)
            .max(sum(&self.mlp_lens(mlp_rows, shared)))
            .max(sum(&self.attention_grad_lens()))
    }

    /// Lengths of one layer's f32 statistics: rstd1, lse, rstd2, mean1, mean2.
    fn layer_stat_lens(&self) -> [usize; 5] {
        [
            self.n,
            self.n * self.q_heads,
            self.n,
            self.mean_len,
            self.mean_len,
        ]
    }

    /// Elements of `T` the arena needs for this call's shape under `plan` (the carving below
    /// takes exactly these, in the same order).
    pub(crate) fn main_len(&self, plan: &ArenaPlan) -> usize {
        let shared = plan.checkpointing;
        let sets = Arena::sets(self, shared);
        let slab = padded(self.n * self.c);
        let layer: usize = self
            .layer_lens(plan.act, shared)
            .iter()
            .map(|&l| padded(l))
            .sum();
        let grad: usize = self.grad_lens().iter().map(|&l| padded(l)).sum();
        let resid_slots = plan.resid_slots;
        self.resid_slabs(resid_slots) * slab
            + self.attention_spare(resid_slots) * padded(self.n * self.q)
            + sets * layer
            + slab
            + grad
            + self.scratch_len(plan.logit_rows, plan.mlp_rows, shared)
            + padded(self.head_norm_len)
    }

    /// Spare attention output / log-sum-exp buffers: one under checkpoint offload (the
    /// offload's two-slot ring of attention outputs, see `resid_offload.rs`), else none.
    fn attention_spare(&self, resid_slots: Option<usize>) -> usize {
        usize::from(resid_slots.is_some())
    }

    /// Device slabs of the residual stream: one per layer boundary, or the offload's ring.
    fn resid_slabs(&self, resid_slots: Option<usize>) -> usize {
        resid_slots.map_or(self.layers + 1, |k| k.min(self.layers + 1))
    }

    /// Bytes of one layer set's post-attention buffers (`h` and `xn2`, contiguous) in
    /// `elem_bytes`-byte elements: what each attention backward can lend the one-pass
    /// `dq_accum` (see [`PostAttention::as_f32`]).
    pub(crate) fn post_attention_bytes(&self, elem_bytes: usize) -> usize {
        2 * padded(self.n * self.c) * elem_bytes
    }

    /// Elements of `T` the logits chunk of `logit_rows` tokens takes (padded).
    pub(crate) fn logits_len(&self, logit_rows: usize) -> usize {
        padded(logit_rows.min(self.n) * self.vocab)
    }

    /// f32 elements of the statistics arena for this call's shape and `sets` (and the
    /// offload's spare log-sum-exp when `resid_slots` is set).
    pub(crate) fn stats_len(&self, sets: usize, resid_slots: Option<usize>) -> usize {
        let layer: usize = self.layer_stat_lens().iter().map(|&l| padded(l)).sum();
        sets * layer
            + self.attention_spare(resid_slots) * padded(self.n * self.q_heads)
            + 2 * padded(self.n)
            + padded(self.head_norm_len)
            + padded(self.mean_len)
            + 2 * padded(self.embed_norm_len)
    }
}

/// Whether each layer's buffers keep the MLP activation `silu(gate) * up` for the backward
/// (`Kept`), or the forward writes it to the gradient scratch `dgate` (idle until the
/// backward) and the backward recomputes it there from `gate` and `up` (`Recomputed`, the
/// lean memory mode: `[N, I]` less per layer for one elementwise launch per layer; the
/// kernel is deterministic, so the values are the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActStore {
    Kept,
    Recomputed,
}

/// What the arena is sized for beyond the capacity shape and element width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ArenaPlan {
    /// One shared set of layer buffers (gradient checkpointing) instead of one per layer.
    pub checkpointing: bool,
    /// Whether the layer buffers keep the MLP activation.
    pub act: ActStore,
    /// Tokens per logits chunk at capacity; a call carves `min(logit_rows, n)`.
    pub logit_rows: usize,
    /// Tokens per MLP chunk at capacity (see [`crate::mlp_chunk`]); a call carves
    /// `min(mlp_rows, n)`. Fewer than the capacity's tokens only under checkpointing.
    pub mlp_rows: usize,
    /// Checkpoint offload: the residual stream's device ring of this many slabs (`None`: one
    /// slab per layer boundary).
    pub resid_slots: Option<usize>,
}

/// The two allocations, sized for the largest call (the build's batch and sequence). The main
/// one is untyped: it holds `main_len` elements of the widest type the model may run in, and
/// each call carves it as the type of its period, so switching precision between periods
/// needs no new allocation. It is allocated as f32 so that between calls it can hold the whole
/// fp32 weights for a ZeRO-2 save or load ([`Arena::idle_f32`], see `zero.rs`).
///
/// Without gradient checkpointing it holds one set of [`LayerBufs`] per layer (everything the
/// backward reads); with it, one set shared by all layers, which the backward refills by
/// recomputing each block's forward from its input (`resid[i]`, kept for every layer).
#[derive(Debug)]
pub(crate) struct Arena {
    main: CudaSlice<f32>,
    stats: CudaSlice<f32>,
    plan: ArenaPlan,
}

impl Arena {
    /// Allocates (zero-filled, so nothing uninitialised is ever read) for `capacity` in
    /// elements of up to `max_elem_bytes` bytes, as `plan` says.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        capacity: &Dims,
        max_elem_bytes: usize,
        plan: ArenaPlan,
    ) -> Result<Self> {
        if plan.mlp_rows < capacity.n && !plan.checkpointing {
            return Err(super::views::arena_error(format!(
                "MLP chunks of {} tokens need gradient checkpointing (each layer keeps its \
                 whole MLP otherwise)",
                plan.mlp_rows
            )));
        }
        let sets = Self::sets(capacity, plan.checkpointing);
        let bytes = capacity.main_len(&plan) * max_elem_bytes;
        let main = stream
            .alloc_zeros::<f32>(bytes.div_ceil(size_of::<f32>()))
            .map_err(|e| {
                super::step_alloc_err(
                    "allocating the activation arena",
                    bytes,
                    capacity.n,
                    stream,
                    e,
                )
            })?;
        let stats = stream
            .alloc_zeros::<f32>(capacity.stats_len(sets, plan.resid_slots))
            .map_err(|e| super::cuda_err("allocating the statistics arena", e))?;
        Ok(Arena { main, stats, plan })
    }

    /// One element each: what a model holds between dropping its arena and allocating the
    /// next, so the two never exist together (see `GpuLlama::rebuild_arena`).
    pub(crate) fn placeholder(stream: &Arc<CudaStream>, plan: ArenaPlan) -> Result<Self> {
        let alloc = || {
            stream
                .alloc_zeros::<f32>(1)
                .map_err(|e| super::cuda_err("allocating a placeholder arena", e))
        };
        Ok(Arena {
            main: alloc()?,
            stats: alloc()?,
            plan,
        })
    }

    fn sets(d: &Dims, checkpointing: bool) -> usize {
        if checkpointing {
            d.layers.min(1)
        } else {
            d.layers
        }
    }

    /// The main allocation as f32, for a use between calls (the next call's carving
    /// overwrites whatever it holds).
    pub(crate) fn idle_f32(&self) -> &CudaSlice<f32> {
        &self.main
    }

    /// [`idle_f32`](Self::idle_f32), to write.
    pub(crate) fn idle_f32_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.main
    }

    /// What the arena was sized for.
    pub(crate) fn plan(&self) -> ArenaPlan {
        self.plan
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.main.num_bytes() + self.stats.num_bytes()
    }

    /// The named views for a call of shape `d` (which must not exceed the capacity; the
    /// carving fails with an error rather than overrun).
    pub(crate) fn carve<T: DeviceFloat>(&mut self, d: &Dims) -> Result<Bufs<'_, T>> {
        let elems = self.main.num_bytes() / size_of::<T>();
        // SAFETY: every `T` is a plain float type for which any bit pattern is a valid value,
        // and the allocation (device memory, 256-byte aligned) holds at least `elems` of them.
        // The view borrows `self.main` mutably, so no other view of the bytes exists while it
        // lives.
        let main = unsafe { self.main.transmute_mut::<T>(elems) }.ok_or_else(|| {
            super::views::arena_error(format!("cannot view the arena as {}", T::NAME))
        })?;
        let mut m = Carver::new(main);
        let mut s = Carver::new(self.stats.as_view_mut());
        let resid = (0..d.resid_slabs(self.plan.resid_slots))
            .map(|_| aligned(&mut m, d.n * d.c))
            .collect::<Result<Vec<_>>>()?;
        let att_spare = match d.attention_spare(self.plan.resid_slots) {
            0 => None,
            _ => Some((
                aligned(&mut m, d.n * d.q)?,
                aligned(&mut s, d.n * d.q_heads)?,
            )),
        };
        let sets = Self::sets(d, self.plan.checkpointing);
        let mlp_rows = self.plan.mlp_rows.min(d.n);
        let mut layers = Vec::with_capacity(sets);
        for _ in 0..sets {
            let [xn1, q, k, v, att, h, xn2, gate, up, act] =
                d.layer_lens(self.plan.act, self.plan.checkpointing);
            let [rstd1, lse, rstd2, mean1, mean2] = d.layer_stat_lens();
            debug_assert_eq!(h, xn2);
            layers.push(LayerBufs {
                xn1: aligned(&mut m, xn1)?,
                q: aligned(&mut m, q)?,
                k: aligned(&mut m, k)?,
                v: aligned(&mut m, v)?,
                att: aligned(&mut m, att)?,
                post: PostAttention {
                    region: m.take(2 * padded(h))?,
                    len: h,
                },
                gate: aligned(&mut m, gate)?,
                up: aligned(&mut m, up)?,
                act: aligned(&mut m, act)?,
                rstd1: aligned(&mut s, rstd1)?,
                lse: aligned(&mut s, lse)?,
                rstd2: aligned(&mut s, rstd2)?,
                mean1: aligned(&mut s, mean1)?,
                mean2: aligned(&mut s, mean2)?,
            });
        }
        let final_xn = aligned(&mut m, d.n * d.c)?;
        let logit_rows = self.plan.logit_rows.min(d.n);
        let [dres, dxn, dtmp] = d.grad_lens();
        let grad = GradBufs {
            dres: aligned(&mut m, dres)?,
            dxn: aligned(&mut m, dxn)?,
            dtmp: aligned(&mut m, dtmp)?,
        };
        let scratch = Scratch {
            region: m.take(d.scratch_len(logit_rows, mlp_rows, self.plan.checkpointing))?,
            logits_len: logit_rows * d.vocab,
            mlp_lens: d.mlp_lens(mlp_rows, self.plan.checkpointing),
            attention_lens: d.attention_grad_lens(),
        };
        let head_normed = aligned(&mut m, d.head_norm_len)?;
        let final_rstd = aligned(&mut s, d.n)?;
        let row_loss = aligned(&mut s, d.n)?;
        let dhead_normed = aligned(&mut s, d.head_norm_len)?;
        let final_mean = aligned(&mut s, d.mean_len)?;
        let embed_mean = aligned(&mut s, d.embed_norm_len)?;
        let embed_rstd = aligned(&mut s, d.embed_norm_len)?;
        Ok(Bufs {
            resid_ring: self.plan.resid_slots.is_some(),
            att_spare,
            att_front: 0,
            final_mean,
            embed_mean,
            embed_rstd,
            resid,
            layers,
            final_xn,
            final_rstd,
            logit_rows,
            mlp_rows,
            row_loss,
            grad,
            scratch,
            head_normed,
            dhead_normed,
        })
    }
}

/// The next `len` elements, starting on an aligned element (the padding is skipped).
fn aligned<'a, T>(c: &mut Carver<'a, T>, len: usize) -> Result<CudaViewMut<'a, T>> {
    sub_mut(c.take(padded(len))?, 0..len)
}

/// What one decoder layer's forward saves for its backward (`N = batch * seq` rows).
pub(crate) struct LayerBufs<'a, T> {
    /// `input_layernorm(x)`, `[N, C]`.
    pub xn1: CudaViewMut<'a, T>,
    /// Queries after rotary embedding, `[N, Hq*D]`.
    pub q: CudaViewMut<'a, T>,
    /// Keys after rotary embedding, `[N, Hkv*D]`.
    pub k: CudaViewMut<'a, T>,
    /// Values, `[N, Hkv*D]`.
    pub v: CudaViewMut<'a, T>,
    /// Attention output (input of `o_proj`), `[N, Hq*D]`.
    pub att: CudaViewMut<'a, T>,
    /// The residual stream after attention `h` and `post_attention_layernorm(h)` `xn2`.
    pub post: PostAttention<'a, T>,
    /// `gate_proj(xn2)` and `up_proj(xn2)`, `[N, I]`; empty under checkpointing, whose
    /// shared set leaves them to the [`Scratch`] one MLP chunk at a time.
    pub gate: CudaViewMut<'a, T>,
    pub up: CudaViewMut<'a, T>,
    /// `silu(gate) * up`, `[N, I]`; empty under [`ActStore::Recomputed`].
    pub act: CudaViewMut<'a, T>,
    /// f32 `1/rms` of the block input, `[N]`.
    pub rstd1: CudaViewMut<'a, f32>,
    /// f32 log-sum-exp of the scaled attention scores, `[B, Hq, T]`.
    pub lse: CudaViewMut<'a, f32>,
    /// f32 `1/rms` of `h`, `[N]`.
    pub rstd2: CudaViewMut<'a, f32>,
    /// LayerNorm (Bloom): f32 means of the block input and of `h`, `[N]` (empty for RMSNorm).
    pub mean1: CudaViewMut<'a, f32>,
    pub mean2: CudaViewMut<'a, f32>,
}

/// A layer's `h` (the residual stream after attention) and `xn2` (`post_attention_layernorm(h)`),
/// `[N, C]` each, in one region: `h` then `xn2` from the next aligned element. Both are dead
/// once the layer's MLP and post-attention norm have run their backward, so the attention
/// backward that follows borrows the region as the one-pass flash backward's f32 `dq_accum`
/// ([`as_f32`](Self::as_f32)) instead of the workspace holding one.
pub(crate) struct PostAttention<'a, T> {
    region: CudaViewMut<'a, T>,
    len: usize,
}

impl<'a, T> PostAttention<'a, T> {
    fn xn2_at(&self) -> usize {
        padded(self.len)
    }

    pub(crate) fn h(&self) -> CudaView<'_, T> {
        self.region.slice(..self.len)
    }

    pub(crate) fn xn2(&self) -> CudaView<'_, T> {
        let at = self.xn2_at();
        self.region.slice(at..at + self.len)
    }

    pub(crate) fn h_mut(&mut self) -> CudaViewMut<'_, T> {
        self.region.slice_mut(..self.len)
    }

    /// `h` and `xn2`, both writable.
    pub(crate) fn split_mut(&mut self) -> Result<(CudaViewMut<'_, T>, CudaViewMut<'_, T>)> {
        let (len, at) = (self.len, self.xn2_at());
        let (h, rest) = self.region.split_at_mut(at);
        // Cut to their lengths (the split point is padded).
        Ok((sub_mut(h, 0..len)?, sub_mut(rest, 0..len)?))
    }

    /// The whole region as f32 scratch (clobbers `h` and `xn2`).
    pub(crate) fn as_f32(&mut self) -> Result<CudaViewMut<'_, f32>> {
        let floats = self.region.num_bytes() / size_of::<f32>();
        // SAFETY: device memory of plain floats, any bit pattern valid for f32; the region
        // starts aligned (the carver's alignment is a multiple of 4 bytes) and holds `floats`
        // f32; borrowed mutably for the view's lifetime.
        unsafe { self.region.transmute_mut::<f32>(floats) }
            .ok_or_else(|| super::views::arena_error("cannot view h and xn2 as f32".into()))
    }
}

/// Gradient scratch of the backward that lives through all of it (written `=` by each op).
pub(crate) struct GradBufs<'a, T> {
    /// d(loss)/d(residual stream), `[N, C]`.
    pub dres: CudaViewMut<'a, T>,
    /// d(loss)/d(a norm output), `[N, C]`.
    pub dxn: CudaViewMut<'a, T>,
    /// Temporary `[N, C]`: the `=` output of a backward before it is added.
    pub dtmp: CudaViewMut<'a, T>,
}

/// One MLP chunk's buffers in the [`Scratch`] (`[M, I]` for a chunk of `M` tokens, see
/// [`crate::mlp_chunk`]).
pub(crate) struct MlpScratch<'a, T> {
    /// `gate_proj` and `up_proj` outputs under checkpointing (empty otherwise: each layer's
    /// own are in its [`LayerBufs`]).
    pub gate: CudaViewMut<'a, T>,
    pub up: CudaViewMut<'a, T>,
    /// Gradients (`=`). The forward and the backward also write the chunk's
    /// `silu(gate) * up` to `dgate` when the layer buffers do not keep it.
    pub dgate: CudaViewMut<'a, T>,
    pub dup: CudaViewMut<'a, T>,
    pub dact: CudaViewMut<'a, T>,
}

/// The attention backward's gradients (`=`), in the [`Scratch`].
pub(crate) struct AttentionGrads<'a, T> {
    pub dq: CudaViewMut<'a, T>,
    pub dk: CudaViewMut<'a, T>,
    pub dv: CudaViewMut<'a, T>,
    pub datt: CudaViewMut<'a, T>,
}

/// The region three short-lived groups of buffers share, each live only inside one phase that
/// runs in order on one stream: the loss head's logits chunk (`lce.rs`), an MLP chunk's
/// buffers (a block's MLP forward, and the MLP part of its backward, see `mlp.rs`), and the
/// attention backward's gradients. The region is the largest of the three, not their sum.
pub(crate) struct Scratch<'a, T> {
    region: CudaViewMut<'a, T>,
    logits_len: usize,
    mlp_lens: [usize; 5],
    attention_lens: [usize; 4],
}

impl<T> Scratch<'_, T> {
    /// The logits chunk, `[logit_rows, V]`.
    pub(crate) fn logits(&mut self) -> Result<CudaViewMut<'_, T>> {
        sub_mut(self.region.slice_mut(..), 0..self.logits_len)
    }

    /// An MLP chunk's buffers (over the same bytes as the other uses).
    pub(crate) fn mlp(&mut self) -> Result<MlpScratch<'_, T>> {
        let mut m = Carver::new(self.region.slice_mut(..));
        let [gate, up, dgate, dup, dact] = self.mlp_lens;
        Ok(MlpScratch {
            gate: aligned(&mut m, gate)?,
            up: aligned(&mut m, up)?,
            dgate: aligned(&mut m, dgate)?,
            dup: aligned(&mut m, dup)?,
            dact: aligned(&mut m, dact)?,
        })
    }

    /// The attention backward's gradients (over the same bytes as the other uses).
    pub(crate) fn attention(&mut self) -> Result<AttentionGrads<'_, T>> {
        let mut m = Carver::new(self.region.slice_mut(..));
        let [dq, dk, dv, datt] = self.attention_lens;
        Ok(AttentionGrads {
            dq: aligned(&mut m, dq)?,
            dk: aligned(&mut m, dk)?,
            dv: aligned(&mut m, dv)?,
            datt: aligned(&mut m, datt)?,
        })
    }
}

/// All views of one call.
pub(crate) struct Bufs<'a, T> {
    /// The residual stream, `[N, C]` each: the input of layer `i` (`i = L`: the final norm's
    /// input) is `resid[resid_slot(i)]`.
    pub resid: Vec<CudaViewMut<'a, T>>,
    /// Whether `resid` is the checkpoint offload's ring (a boundary's slab is `i % len`).
    pub resid_ring: bool,
    /// Checkpoint offload: the second slot of the attention output / log-sum-exp ring (the
    /// first is the layer set's `att` / `lse`; [`Bufs::select_attention_slot`] swaps them).
    pub att_spare: Option<(CudaViewMut<'a, T>, CudaViewMut<'a, f32>)>,
    /// Which ring slot the layer set's `att` / `lse` hold now.
    pub att_front: usize,
    /// One set per layer, or a single shared set with gradient checkpointing.
    pub layers: Vec<LayerBufs<'a, T>>,
    /// `model.norm(resid[L])`, `[N, C]`.
    pub final_xn: CudaViewMut<'a, T>,
    pub final_rstd: CudaViewMut<'a, f32>,
    /// The final LayerNorm's means (Bloom; empty for RMSNorm).
    pub final_mean: CudaViewMut<'a, f32>,
    /// Bloom's `word_embeddings_layernorm` mean and rstd, `[N]` each (empty otherwise).
    pub embed_mean: CudaViewMut<'a, f32>,
    pub embed_rstd: CudaViewMut<'a, f32>,
    /// Tokens per chunk of the loss head's logits in this call (`1..=N`).
    pub logit_rows: usize,
    /// Tokens per MLP chunk in this call (`1..=N`; `N`: the MLP runs whole).
    pub mlp_rows: usize,
    /// Per-row cross-entropy losses (f32, 0 for ignored rows), `[N]`.
    pub row_loss: CudaViewMut<'a, f32>,
    pub grad: GradBufs<'a, T>,
    /// The logits chunk (after the fused cross entropy, d(loss)/d(logits) of that chunk; see
    /// `lce.rs`), an MLP chunk's buffers or the attention backward's gradients.
    pub scratch: Scratch<'a, T>,
    /// NormHead (Baichuan2): the row-normalised lm_head `[V, C]` the logits are computed with
    /// (empty without NormHead).
    pub head_normed: CudaViewMut<'a, T>,
    /// NormHead: f32 d(loss)/d(normalised lm_head), `[V, C]`, summed over the chunks before
    /// the normalisation's backward adds it into the lm_head gradient.
    pub dhead_normed: CudaViewMut<'a, f32>,
}

impl<T> Bufs<'_, T> {
    /// The slab of `resid` holding layer boundary `i` (the input of layer `i`).
    pub(crate) fn resid_slot(&self, i: usize) -> usize {
        resid_slot(self.resid.len(), self.resid_ring, i)
    }

    /// Makes the (shared) layer set's `att` / `lse` the attention ring's slot `slot` (0 or 1)
    /// by swapping views with the spare; nothing without a spare.
    pub(crate) fn select_attention_slot(&mut self, slot: usize) {
        if let (Some((att, lse)), Some(set)) = (self.att_spare.as_mut(), self.layers.first_mut())
            && self.att_front != slot
        {
            std::mem::swap(&mut set.att, att);
            std::mem::swap(&mut set.lse, lse);
            self.att_front = slot;
        }
    }
}

fn resid_slot(slabs: usize, ring: bool, i: usize) -> usize {
    if ring { i % slabs } else { i }
}

/// Layer `i`'s input slab (read) and output slab (written) of the residual stream `resid`
/// (`ring`: the checkpoint offload's ring, see [`Bufs::resid_ring`]); distinct by
/// construction (a ring has at least two slabs), checked anyway.
pub(crate) fn resid_in_out<'s, 'a, T>(
    resid: &'s mut [CudaViewMut<'a, T>],
    ring: bool,
    i: usize,
) -> Result<(&'s CudaViewMut<'a, T>, &'s mut CudaViewMut<'a, T>)> {
    let n = resid.len();
    let (a, b) = (resid_slot(n, ring, i), resid_slot(n, ring, i + 1));
    if a == b || a.max(b) >= n {
        return Err(super::views::arena_error(format!(
            "residual slabs {a} and {b} of {n} for layer {i}"
        )));
    }
    if a < b {
        let (lo, hi) = resid.split_at_mut(b);
        Ok((&lo[a], &mut hi[0]))
    } else {
        let (lo, hi) = resid.split_at_mut(a);
        Ok((&hi[0], &mut lo[b]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lce_chunk::LceChunk;
    use crate::mlp_chunk::mlp_chunk_rows;

    fn tiny_llama(batch: usize, seq: usize) -> Dims {
        // TinyLlama-1.1B's shape (the bench preset).
        let json = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
            "hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, "intermediate_size": 5632}"#;
        let config = LlamaConfig::from_json_str(json, "<test>").unwrap();
        Dims::new(&config, batch, seq)
    }

    /// The plan of a model built for `d` in bf16, with logits chunks of `logit_rows`.
    fn plan(d: &Dims, checkpointing: bool, act: ActStore, logit_rows: usize) -> ArenaPlan {
        ArenaPlan {
            checkpointing,
            act,
            logit_rows,
            mlp_rows: mlp_chunk_rows(d.n, d.inter, 2, checkpointing),
            resid_slots: None,
        }
    }

    #[test]
    fn the_logits_chunk_shares_the_scratch_with_the_mlp_gradients() {
        let d = tiny_llama(8, 2048);
        let n = d.n;
        let rows = LceChunk::Auto.rows(n, d.vocab, 2);
        assert_eq!(rows, 2048);
        let kept = |logit_rows| d.main_len(&plan(&d, false, ActStore::Kept, logit_rows));
        // Without checkpointing the scratch holds dgate, dup, dact of every token (528 MiB in
        // bf16), more than dq, dk, dv, datt (144 MiB) or the 2 048 × 32 000 logits (125 MiB),
        // which therefore cost nothing.
        let mlp = 3 * n * d.inter;
        assert_eq!(mlp * 2, 528 << 20);
        assert_eq!(kept(rows), kept(1));
        // Unchunked, the logits are the largest: `n × vocab` over the MLP's.
        assert_eq!(kept(n) - kept(rows), n * d.vocab - mlp);
    }

    #[test]
    fn checkpointing_keeps_one_mlp_chunk_in_the_scratch() {
        let d = tiny_llama(1, 65_536);
        let rows = LceChunk::Auto.rows(d.n, d.vocab, 2);
        let ckpt = plan(&d, true, ActStore::Recomputed, rows);
        assert_eq!(ckpt.mlp_rows, 2048);
        let whole = ArenaPlan {
            mlp_rows: d.n,
            ..ckpt
        };
        // Whole, the scratch is gate, up, dgate, dup, dact of every token; in chunks of 2 048
        // it is the attention gradients (dq, dk, dv, datt of every token, 576 MiB), more than
        // five [M, I] (110 MiB) and the logits (125 MiB).
        let attention = 2 * d.n * (d.q + d.kv);
        assert_eq!(attention * 2, 576 << 20);
        assert_eq!(
            d.main_len(&whole) - d.main_len(&ckpt),
            5 * d.n * d.inter - attention
        );
        // 2.87 GiB less at 64 K tokens in bf16.
        assert_eq!((d.main_len(&whole) - d.main_len(&ckpt)) * 2, 3_087_007_744);
    }

    #[test]
    fn a_chunk_larger_than_the_call_is_the_unchunked_arena() {
        let d = tiny_llama(1, 64);
        let kept = ActStore::Kept;
        assert_eq!(
            d.main_len(&plan(&d, false, kept, 10_000)),
            d.main_len(&plan(&d, false, kept, d.n))
        );
        // A chunk that does not divide the tokens is padded like any buffer.
        assert_eq!(d.logits_len(7), padded(7 * d.vocab));
        assert!(d.logits_len(7) >= 7 * d.vocab && d.logits_len(7).is_multiple_of(ALIGN_ELEMS));
    }

    #[test]
    fn recomputing_the_mlp_activation_drops_one_tokens_by_intermediate_buffer_per_layer() {
        let d = tiny_llama(8, 2048);
        let rows = LceChunk::Auto.rows(d.n, d.vocab, 2);
        let len = |ckpt, act| d.main_len(&plan(&d, ckpt, act, rows));
        let saved = len(false, ActStore::Kept) - len(false, ActStore::Recomputed);
        assert_eq!(saved, d.layers * d.n * d.inter);
        // 22 × 16 384 × 5 632 bf16 elements: 3.78 GiB at TinyLlama's bench shape.
        assert_eq!(saved * 2, 4_060_086_272);
        // With checkpointing's one shared set, one layer's worth.
        assert_eq!(
            len(true, ActStore::Kept) - len(true, ActStore::Recomputed),
            d.n * d.inter
        );
    }
}
