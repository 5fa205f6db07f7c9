//! The Llama forward and backward on the device, generic over the activation type, op for op
//! the CPU reference's (`model/mod.rs` and `model/block.rs`): the same buffers, the same order of
//! operations, the same gradient conventions (activation gradients `=`, parameter gradients
//! `+=` into the f32 gradient buffer).
//!
//! ```text
//! h   = x + o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))   n1 = input_layernorm(x)
//! out = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                    n2 = post_attention_layernorm(h)
//! ```
//! Everything is enqueued on one stream; nothing here waits for the device.
//!
//! The residual adds are fused into the norms that read their result: `h = x + o` into
//! `post_attention_layernorm`, `out = h + down` into the next layer's `input_layernorm` (or the
//! final norm), so each block's output norm is computed by the block that produced its input;
//! in the backward the norms add their input gradient straight into `dres`.

use cudarc::driver::{CudaView, CudaViewMut};
use tilearn_ops::cuda::{self as k, DeviceFloat};

use super::arena::{Bufs, Dims, GradBufs, LayerBufs, Scratch, resid_in_out};
use super::linear::{linear_bwd, linear_bwd_add_dx, linear_fwd};
use super::mlp::{MlpBackward, mlp_backward, mlp_forward};
use super::norms::{NormAt, add_norm_fwd, norm_bwd, norm_bwd_add, norm_fwd};
use super::resid_offload::{Part, RESID_SLOTS, ResidOffload, boundary_to_load};
use super::sink::{GradParts, Handoff};
use super::tensor_parallel::complete;
use super::vocab_parallel::{embedding_grad, embedding_lookup};
use crate::error::Result;
use crate::model::{LayerLayout, ModelLayout};

pub(crate) use super::cx::Cx;
use super::weights::Weights;

/// Where a block writes the norm of its output: the next layer's `input_layernorm` buffers, or
/// the final norm's.
struct NextNorm<'b, 'a, T> {
    at: NormAt,
    xn: &'b mut CudaViewMut<'a, T>,
    mean: &'b mut CudaViewMut<'a, f32>,
    rstd: &'b mut CudaViewMut<'a, f32>,
}

/// Layer `i`'s input norm, the post-attention norm, and the final norm.
fn input_norm(lay: &LayerLayout) -> NormAt {
    NormAt {
        weight: lay.input_norm.clone(),
        bias: lay.input_norm_bias.clone(),
    }
}

fn post_attention_norm(lay: &LayerLayout) -> NormAt {
    NormAt {
        weight: lay.post_attention_norm.clone(),
        bias: lay.post_attention_norm_bias.clone(),
    }
}

fn final_norm(layout: &ModelLayout) -> NormAt {
    NormAt {
        weight: layout.norm.clone(),
        bias: layout.norm_bias.clone(),
    }
}

/// The norm of the last block's output: the final norm, or none on a pipeline stage before
/// the last (its output goes to the next stage, whose first layer normalises it).
fn output_norm(layout: &ModelLayout) -> Option<NormAt> {
    layout.has_head().then(|| final_norm(layout))
}

/// Forward through the final norm into `b.final_xn` (the loss head, `lm_head` and the cross
/// entropy, runs chunk by chunk in `lce.rs`).
pub(crate) fn forward<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &mut Weights<'_, T>,
    ids: &CudaView<'_, u32>,
    b: &mut Bufs<'_, T>,
) -> Result<()> {
    let layout = cx.layout;
    let c = d.c;
    // A later pipeline stage starts from the activations its caller put in `resid[0]`.
    if layout.has_embedding() {
        embed_forward(cx, d, w, ids, b)?;
    }
    if checkpointed(d, b) {
        let keep = keeps_attention(cx, b);
        save_boundary(cx, d, b, 0)?;
        for i in 0..d.layers {
            w.load_layer(i)?;
            if let Some(o) = cx.resid_offload.as_deref_mut() {
                // Block i writes boundary i + 1 over boundary i + 1 - RESID_SLOTS, and its
                // attention output over layer i - 2's.
                if let Some(old) = (i + 1).checked_sub(RESID_SLOTS) {
                    o.wait_saved(cx.stream, Part::Boundary(old))?;
                }
                if let (true, Some(old)) = (keep, i.checked_sub(2)) {
                    o.wait_saved(cx.stream, Part::Attention(old))?;
                    o.wait_saved(cx.stream, Part::Lse(old))?;
                }
            }
            if keep {
                b.select_attention_slot(i % 2);
            }
            run_block_checkpointed(cx, d, w, b, i, BlockPass::Forward)?;
            save_boundary(cx, d, b, i + 1)?;
            if keep {
                save_attention(cx, d, b, i)?;
            }
        }
        return Ok(());
    }
    // The first norm has no residual add before it; every later one is fused into the block
    // that produces its input.
    let (first_at, first_xn, first_mean, first_rstd) = match b.layers.first_mut() {
        Some(l0) => (
            input_norm(&layout.layers[0]),
            &mut l0.xn1,
            &mut l0.mean1,
            &mut l0.rstd1,
        ),
        None => (
            final_norm(layout),
            &mut b.final_xn,
            &mut b.final_mean,
            &mut b.final_rstd,
        ),
    };
    norm_fwd(
        cx,
        d.eps,
        c,
        w,
        &first_at,
        &b.resid[0].as_view(),
        first_xn,
        first_mean,
        first_rstd,
    )?;
    for (i, lay) in layout.layers.iter().enumerate() {
        let (before, after) = b.resid.split_at_mut(i + 1);
        let (cur, rest) = b.layers.split_at_mut(i + 1);
        let next = match rest.first_mut() {
            Some(nl) => Some(NextNorm {
                at: input_norm(&layout.layers[i + 1]),
                xn: &mut nl.xn1,
                mean: &mut nl.mean1,
                rstd: &mut nl.rstd1,
            }),
            None => output_norm(layout).map(|at| NextNorm {
                at,
                xn: &mut b.final_xn,
                mean: &mut b.final_mean,
                rstd: &mut b.final_rstd,
            }),
        };
        w.load_layer(i)?;
        block_forward(
            cx,
            d,
            lay,
            w,
            &before[i].as_view(),
            &mut cur[i],
            &mut b.scratch,
            &mut after[0],
            next,
            (BlockPass::Forward, b.mlp_rows),
        )?;
    }
    Ok(())
}

/// The embedding into `resid[0]`; for Bloom followed by `word_embeddings_layernorm` (the raw
/// lookup goes through `final_xn`, free until the final norm, and the backward recomputes it).
fn embed_forward<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &mut Weights<'_, T>,
    ids: &CudaView<'_, u32>,
    b: &mut Bufs<'_, T>,
) -> Result<()> {
    let layout = cx.layout;
    w.load_embedding()?;
    let table = w.slice(layout.embed.clone())?;
    match &layout.embed_norm {
        None => embedding_lookup(cx, ids, &table, d.c, &mut b.resid[0])?,
        Some((nw, nb)) => {
            embedding_lookup(cx, ids, &table, d.c, &mut b.final_xn)?;
            let at = NormAt {
                weight: nw.clone(),
                bias: Some(nb.clone()),
            };
            norm_fwd(
                cx,
                d.eps,
                d.c,
                w,
                &at,
                &b.final_xn.as_view(),
                &mut b.resid[0],
                &mut b.embed_mean,
                &mut b.embed_rstd,
            )?;
        }
    }
    Ok(())
}

/// Whether the arena holds one shared set of layer buffers (gradient checkpointing) instead of
/// one per layer.
fn checkpointed<T>(d: &Dims, b: &Bufs<'_, T>) -> bool {
    b.layers.len() < d.layers
}

/// Block `i`'s forward into the shared layer buffers, from its input `resid[i]` (gradient
/// checkpointing): its own input norm first (the fused "next norm" of the previous block has
/// no per-layer home here), then the block, whose output goes to `resid[i + 1]` and whose
/// fused next norm to the final-norm buffers. After the last block those hold the model's
/// final norm; before it they are scratch. Every kernel is deterministic, so the backward's
/// recomputation reproduces the forward's values bit for bit (and rewrites `resid[i + 1]` and
/// the final-norm buffers with the same bits, after their readers ran).
fn run_block_checkpointed<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &Weights<'_, T>,
    b: &mut Bufs<'_, T>,
    i: usize,
    pass: BlockPass,
) -> Result<()> {
    let layout = cx.layout;
    let lay = &layout.layers[i];
    let (input, output) = resid_in_out(&mut b.resid, b.resid_ring, i)?;
    let shared = &mut b.layers[0];
    norm_fwd(
        cx,
        d.eps,
        d.c,
        w,
        &input_norm(lay),
        &input.as_view(),
        &mut shared.xn1,
        &mut shared.mean1,
        &mut shared.rstd1,
    )?;
    let at = match layout.layers.get(i + 1) {
        Some(next) => Some(input_norm(next)),
        None => output_norm(layout),
    };
    let next = at.map(|at| NextNorm {
        at,
        xn: &mut b.final_xn,
        mean: &mut b.final_mean,
        rstd: &mut b.final_rstd,
    });
    block_forward(
        cx,
        d,
        lay,
        w,
        &input.as_view(),
        shared,
        &mut b.scratch,
        output,
        next,
        (pass, b.mlp_rows),
    )
}

/// Whether this checkpointed pass keeps each layer's attention output and log-sum-exp in
/// host memory, so that the backward's recomputation skips the attention forward: under
/// checkpoint offload with room for them, when every attention call is a flash kernel (whose
/// backward needs nothing else from the forward).
fn keeps_attention<T>(cx: &Cx<'_>, b: &Bufs<'_, T>) -> bool {
    b.att_spare.is_some()
        && cx.mm.flash_only()
        && cx
            .resid_offload
            .as_deref()
            .is_some_and(ResidOffload::keeps_attention)
}

/// Checkpoint offload, forward: queues layer `i`'s attention output and log-sum-exp (in the
/// layer set) to the host when the backward will need them back (the last two layers' stay
/// in the two-slot ring).
fn save_attention<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    b: &Bufs<'_, T>,
    i: usize,
) -> Result<()> {
    match (cx.resid_offload.as_deref_mut(), b.layers.first()) {
        (Some(o), Some(set)) if i + RESID_SLOTS <= d.layers => {
            o.save(cx.stream, Part::Attention(i), &set.att)?;
            o.save(cx.stream, Part::Lse(i), &set.lse)
        }
        _ => Ok(()),
    }
}

/// Checkpoint offload, backward of layer `i`: makes the layer set's attention buffers layer
/// `i`'s slot, queues the copy back of layer `i - 1`'s into the other slot (overlapping layer
/// `i`), and waits for layer `i`'s own.
fn load_attention<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    b: &mut Bufs<'_, T>,
    i: usize,
) -> Result<()> {
    b.select_attention_slot(i % 2);
    let Some(o) = cx.resid_offload.as_deref_mut() else {
        return Ok(());
    };
    if let (Some(j), Some((att, lse))) = (boundary_to_load(i, d.layers), b.att_spare.as_mut()) {
        o.load(cx.stream, Part::Attention(j), att)?;
        o.load(cx.stream, Part::Lse(j), lse)?;
    }
    o.wait_loaded(cx.stream, Part::Attention(i))?;
    o.wait_loaded(cx.stream, Part::Lse(i))
}

/// Checkpoint offload, forward: queues boundary `j`'s copy to the host when the backward will
/// need it back (the last [`RESID_SLOTS`] boundaries stay in the ring).
fn save_boundary<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    b: &Bufs<'_, T>,
    j: usize,
) -> Result<()> {
    match cx.resid_offload.as_deref_mut() {
        Some(o) if j + RESID_SLOTS <= d.layers => {
            o.save(cx.stream, Part::Boundary(j), &b.resid[b.resid_slot(j)])
        }
        _ => Ok(()),
    }
}

/// Checkpoint offload, backward of layer `i`: queues the copy back of the boundary layer
/// `i - 1` reads (overlapping layer `i`), then waits for layer `i`'s own.
fn load_boundaries<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    b: &mut Bufs<'_, T>,
    i: usize,
) -> Result<()> {
    let Some(o) = cx.resid_offload.as_deref_mut() else {
        return Ok(());
    };
    if let Some(j) = boundary_to_load(i, d.layers) {
        let slot = b.resid_slot(j);
        o.load(cx.stream, Part::Boundary(j), &mut b.resid[slot])?;
    }
    o.wait_loaded(cx.stream, Part::Boundary(i))
}

/// Backward from the final norm down to the embedding: `b.grad.dxn` must hold
/// d(loss)/d(final norm output) and lm_head's gradient must already be in `g`, as the chunked
/// loss head (`lce::loss_and_head_backward`) leaves them (a tied lm_head's in the embedding's
/// range, as on the CPU). Parameter gradients are added into `g`'s storage (addressed by their
/// global ranges), which hands finished parts on as it goes (see `sink.rs`).
pub(crate) fn backward<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &mut Weights<'_, T>,
    mut g: Handoff<'_, '_>,
    ids: &CudaView<'_, u32>,
    b: &mut Bufs<'_, T>,
) -> Result<()> {
    let layout = cx.layout;
    let c = d.c;
    // A pipeline stage before the last starts from the output gradient its caller put in
    // `dres`.
    if let Some(at) = output_norm(layout) {
        norm_bwd(
            cx,
            c,
            w,
            &mut g.grads()?,
            &at,
            &b.grad.dxn,
            &b.resid[b.resid_slot(d.layers)].as_view(),
            &b.final_mean,
            &b.final_rstd,
            &mut b.grad.dres,
        )?;
    }
    // The final norm and lm_head are done (a tied lm_head's gradient sits in the embedding's
    // range, which is handed on last).
    g.pass_on(cx.stream)?;
    let checkpointing = checkpointed(d, b);
    let keep = checkpointing && keeps_attention(cx, b);
    for (i, lay) in layout.layers.iter().enumerate().rev() {
        w.load_layer(i)?;
        load_boundaries(cx, d, b, i)?;
        if keep {
            load_attention(cx, d, b, i)?;
        }
        let set = if checkpointing {
            let pass = BlockPass::Recompute {
                attention_kept: keep,
            };
            run_block_checkpointed(cx, d, w, b, i, pass)?;
            0
        } else {
            i
        };
        let x = b.resid_slot(i);
        block_backward(
            cx,
            d,
            lay,
            w,
            &mut g.grads()?,
            &b.resid[x].as_view(),
            &mut b.layers[set],
            (&mut b.grad, &mut b.scratch),
            (checkpointing, b.mlp_rows),
        )?;
        g.pass_on(cx.stream)?;
    }
    if !layout.has_embedding() {
        // A later pipeline stage: `dres` is d/d(its input), for its caller to send back.
        return g.finish(cx.stream);
    }
    if let Some((nw, nb)) = &layout.embed_norm {
        // Bloom: through word_embeddings_layernorm, its input (the raw lookup) recomputed into
        // dxn; dtmp = d/d(lookup) replaces dres.
        w.load_embedding()?;
        let table = w.slice(layout.embed.clone())?;
        embedding_lookup(cx, ids, &table, c, &mut b.grad.dxn)?;
        let at = NormAt {
            weight: nw.clone(),
            bias: Some(nb.clone()),
        };
        let gb = &mut b.grad;
        norm_bwd(
            cx,
            c,
            w,
            &mut g.grads()?,
            &at,
            &gb.dres,
            &gb.dxn.as_view(),
            &b.embed_mean,
            &b.embed_rstd,
            &mut gb.dtmp,
        )?;
        std::mem::swap(&mut gb.dres, &mut gb.dtmp);
    }
    let mut parts = g.grads()?;
    let mut dembed = parts.range(layout.embed.clone())?;
    embedding_grad(cx, ids, &b.grad.dres, c, &mut dembed)?;
    g.finish(cx.stream)
}

/// What a block's forward computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockPass {
    /// Everything: the block output and the norm of it.
    Forward,
    /// The backward's recomputation of a checkpointed block: up to `post_attention_layernorm`
    /// (the MLP backward recomputes its own `gate` and `up` chunk by chunk, see `mlp.rs`, and
    /// the block output is not needed). `attention_kept`: the attention output and
    /// log-sum-exp are in the layer buffers already (checkpoint offload).
    Recompute { attention_kept: bool },
}

/// Forward of one block from `x` (whose `input_layernorm` is already in `a.xn1`/`a.rstd1`)
/// into `a`; `out` receives the block output and `next` its norm (none after a pipeline
/// stage's last block, unless it ends the model). The MLP runs in chunks of `mlp_rows` tokens
/// through the scratch (see `mlp.rs`), which also takes its activation when `a` keeps none
/// (the arena's `ActStore::Recomputed`; the backward recomputes it).
#[allow(clippy::too_many_arguments)]
fn block_forward<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    lay: &LayerLayout,
    w: &Weights<'_, T>,
    x: &CudaView<'_, T>,
    a: &mut LayerBufs<'_, T>,
    scratch: &mut Scratch<'_, T>,
    out: &mut CudaViewMut<'_, T>,
    next: Option<NextNorm<'_, '_, T>>,
    (pass, mlp_rows): (BlockPass, usize),
) -> Result<()> {
    let (n, c, q, kv) = (d.n, d.c, d.q, d.kv);
    let s = cx.stream;
    let xn1 = a.xn1.as_view();
    linear_fwd(cx, w, &lay.q, &xn1, n, c, q, &mut a.q)?;
    linear_fwd(cx, w, &lay.k, &xn1, n, c, kv, &mut a.k)?;
    linear_fwd(cx, w, &lay.v, &xn1, n, c, kv, &mut a.v)?;
    let pos = cx.positions.as_ref();
    if cx.alibi.is_none() {
        k::rope_forward_at(
            s, &mut a.q, d.batch, d.seq, d.q_heads, d.head_dim, cx.rope, pos,
        )?;
        k::rope_forward_at(
            s, &mut a.k, d.batch, d.seq, d.kv_heads, d.head_dim, cx.rope, pos,
        )?;
    }
    // A recomputation whose attention output and log-sum-exp were kept (checkpoint offload)
    // has them in `a` already: the flash backward needs nothing else from the forward.
    if pass
        != (BlockPass::Recompute {
            attention_kept: true,
        })
    {
        cx.mm.attention_forward(
            s,
            d,
            pos,
            lay.sliding_window,
            cx.alibi.as_ref(),
            &a.q.as_view(),
            &a.k.as_view(),
            &a.v.as_view(),
            &mut a.att,
            &mut a.lse,
        )?;
    }
    linear_fwd(
        cx,
        w,
        &lay.o,
        &a.att.as_view(),
        n,
        q,
        c,
        &mut a.post.h_mut(),
    )?;
    // Row-parallel: each rank's o_proj output is its heads' share.
    complete(cx.tp, &mut a.post.h_mut())?;
    let (mut h, mut xn2) = a.post.split_mut()?;
    // h = o + x in place, and post_attention_layernorm(h) (one launch for RMSNorm).
    add_norm_fwd(
        cx,
        d.eps,
        c,
        w,
        &post_attention_norm(lay),
        &mut h,
        x,
        &mut xn2,
        &mut a.mean2,
        &mut a.rstd2,
    )?;
    if pass != BlockPass::Forward {
        return Ok(());
    }
    let mut ms = scratch.mlp()?;
    let (mut gate, mut up) = layer_or_scratch((&mut a.gate, &mut a.up), (&mut ms.gate, &mut ms.up));
    let mut act = if a.act.is_empty() {
        ms.dgate.slice_mut(..)
    } else {
        a.act.slice_mut(..)
    };
    let xn2 = a.post.xn2();
    mlp_forward(
        cx, d, lay, w, mlp_rows, &xn2, &mut gate, &mut up, &mut act, out,
    )?;
    // Row-parallel: each rank's down_proj output is its columns' share.
    complete(cx.tp, out)?;
    // out = down + h in place, and the next norm of out (one launch for RMSNorm).
    match next {
        Some(next) => add_norm_fwd(
            cx,
            d.eps,
            c,
            w,
            &next.at,
            out,
            &a.post.h(),
            next.xn,
            next.mean,
            next.rstd,
        )?,
        None => k::residual_add_inplace(s, out, &a.post.h())?,
    }
    Ok(())
}

/// Backward of one block: `gb.dres` holds d/d(out) on entry and d/d(x) on return. Under
/// checkpointing (`recomputed`) the MLP's `gate` and `up` are recomputed chunk by chunk of
/// `mlp_rows` tokens (see `mlp.rs`).
#[allow(clippy::too_many_arguments)]
fn block_backward<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    lay: &LayerLayout,
    w: &Weights<'_, T>,
    g: &mut GradParts<'_>,
    x: &CudaView<'_, T>,
    a: &mut LayerBufs<'_, T>,
    (gb, scratch): (&mut GradBufs<'_, T>, &mut Scratch<'_, T>),
    (recomputed, mlp_rows): (bool, usize),
) -> Result<()> {
    let (n, c, q, kv) = (d.n, d.c, d.q, d.kv);
    let s = cx.stream;
    let xn2 = a.post.xn2();
    let mut ms = scratch.mlp()?;
    let (gate, up) = layer_or_scratch((&mut a.gate, &mut a.up), (&mut ms.gate, &mut ms.up));
    let mlp = MlpBackward {
        gate,
        up,
        act: a.act.as_view(),
        dgate: ms.dgate.slice_mut(..),
        dup: ms.dup.slice_mut(..),
        dact: ms.dact.slice_mut(..),
        recompute_gate_up: recomputed,
    };
    mlp_backward(
        cx,
        d,
        lay,
        w,
        g,
        mlp_rows,
        &xn2,
        &gb.dres.as_view(),
        mlp,
        &mut gb.dxn,
    )?;
    let mut lg = scratch.attention()?;
    let xn1 = a.xn1.as_view();
    // Column-parallel gate/up: each rank's input gradient covers its columns only.
    complete(cx.tp, &mut gb.dxn)?;
    // dres += the norm's input gradient: dres becomes d/dh.
    norm_bwd_add(
        cx,
        c,
        w,
        g,
        &post_attention_norm(lay),
        &gb.dxn,
        &a.post.h(),
        &a.mean2,
        &a.rstd2,
        &mut gb.dres,
        &mut gb.dtmp,
    )?;

    // Attention: h = x + o(attn(...)).
    linear_bwd(
        cx,
        w,
        g,
        &lay.o,
        &gb.dres.as_view(),
        &a.att.as_view(),
        n,
        q,
        c,
        Some(&mut lg.datt),
    )?;
    let pos = cx.positions.as_ref();
    cx.mm.attention_backward(
        s,
        d,
        pos,
        lay.sliding_window,
        cx.alibi.as_ref(),
        &lg.datt.as_view(),
        &a.q.as_view(),
        &a.k.as_view(),
        &a.v.as_view(),
        &a.att.as_view(),
        &a.lse.as_view(),
        &mut lg.dq,
        &mut lg.dk,
        &mut lg.dv,
        // h and xn2 are dead from here on: the one-pass backward's scratch.
        &mut a.post.as_f32()?,
    )?;
    if cx.alibi.is_none() {
        k::rope_backward_at(
            s, &mut lg.dq, d.batch, d.seq, d.q_heads, d.head_dim, cx.rope, pos,
        )?;
        k::rope_backward_at(
            s, &mut lg.dk, d.batch, d.seq, d.kv_heads, d.head_dim, cx.rope, pos,
        )?;
    }
    linear_bwd(
        cx,
        w,
        g,
        &lay.q,
        &lg.dq.as_view(),
        &xn1,
        n,
        c,
        q,
        Some(&mut gb.dxn),
    )?;
    // dxn += the k and v projections' input gradients (added by their GEMMs).
    linear_bwd_add_dx(
        cx,
        w,
        g,
        &lay.k,
        &lg.dk.as_view(),
        &xn1,
        n,
        c,
        kv,
        &mut gb.dxn,
    )?;
    linear_bwd_add_dx(
        cx,
        w,
        g,
        &lay.v,
        &lg.dv.as_view(),
        &xn1,
        n,
        c,
        kv,
        &mut gb.dxn,
    )?;
    // Column-parallel q/k/v: each rank's input gradient covers its heads only.
    complete(cx.tp, &mut gb.dxn)?;
    // dres += the norm's input gradient: dres becomes d/dx.
    norm_bwd_add(
        cx,
        c,
        w,
        g,
        &input_norm(lay),
        &gb.dxn,
        x,
        &a.mean1,
        &a.rstd1,
        &mut gb.dres,
        &mut gb.dtmp,
    )?;
    Ok(())
}

/// The MLP's `gate` and `up`: the layer buffers' own (`own`, without checkpointing), or one
/// chunk's in the scratch (`chunk`, under checkpointing, whose shared set has none).
type ViewPair<'s, 'a, T> = (&'s mut CudaViewMut<'a, T>, &'s mut CudaViewMut<'a, T>);

fn layer_or_scratch<'s, T>(
    own: ViewPair<'s, '_, T>,
    chunk: ViewPair<'s, '_, T>,
) -> (CudaViewMut<'s, T>, CudaViewMut<'s, T>) {
    if own.0.is_empty() && own.1.is_empty() {
        (chunk.0.slice_mut(..), chunk.1.slice_mut(..))
    } else {
        (own.0.slice_mut(..), own.1.slice_mut(..))
    }
}
