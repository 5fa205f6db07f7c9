//! The loss head in chunks of tokens (fused linear + cross entropy): for each chunk of the
//! arena's `logit_rows` tokens,
//!
//! ```text
//! logits[chunk]      = final_xn[chunk] · lm_headᵀ                    (cuBLASLt, written)
//! row_loss[chunk], logits[chunk] ← cross_entropy_fused(logits[chunk]) (dlogits, in place)
//! dxn[chunk]         = dlogits · lm_head                             (written)
//! d(lm_head)        += dlogitsᵀ · final_xn[chunk]                    (beta = 1, f32)
//! ```
//!
//! then one totals launch over all rows, so the `[tokens × vocab]` logits never exist in full
//! and the hidden states' and lm_head's gradients come out of the same pass. The gradient factor
//! is the whole call's (`1 / loss denominator`, times the loss scale), ignored (`-100`) rows get
//! zero gradients, and a tied lm_head accumulates into the embedding's range (the layout's
//! `lm_head` range is the embedding's).
//!
//! Numerics: every kernel and product is the unchunked path's, row for row; the row losses and
//! dlogits depend only on the row, the totals reduce the same `row_loss` in the same order (so
//! the loss is the unchunked one up to the logits GEMM's choice of algorithm for a different
//! M).
//!
//! Baichuan2's z-loss (`z_loss_weight` non-zero): before each chunk's cross entropy
//! `z_loss_rows` reads the target rows' maxima and their positions; after it `z_loss_apply`
//! adds `weight · max²` to the row losses and `factor · weight · 2 · max` to dlogits at the
//! maximum, and the totals are then always reduced from the row losses.
//!
//! Vocabulary parallelism (a tensor-parallel rank holding rows of lm_head, `vocab_parallel.rs`):
//! each chunk's logits are the rank's columns; the cross entropy completes its row maxima, sums
//! of exponentials and target logits over the group (so the row losses are every rank's), the
//! chunks' `dxn` are the rank's partial sums, completed by one all-reduce after the last chunk,
//! and d(lm_head) is the rank's own rows. The totals are always reduced from the row losses.
//!
//! NormHead (Baichuan2): the products use the row-normalised lm_head, computed once per call
//! into the arena (`row_normalize_forward`); the chunks' weight gradients are summed in f32
//! into the arena's `dhead_normed` (zeroed, then each chunk's product adds with `beta = 1`),
//! and `row_normalize_backward` adds its backward into lm_head's gradient once. The only intended difference is d(lm_head)'s f32 accumulation order: a sum of per-chunk
//! products instead of one product (relative difference ~ f32 rounding, 1e-6, in every
//! precision, since the accumulator is f32). With one chunk (`logit_rows ≥ n`) this is the
//! unchunked path exactly: the fused launch's own totals are the call's.

use cudarc::driver::{CudaView, CudaViewMut};
use tilearn_ops::cuda::{self as k, CeTotals, DeviceFloat, WeightGrad};

use super::arena::{Bufs, Dims};
use super::compute::Cx;
use super::cuda_err;
use super::sink::GradParts;
use super::tensor_parallel::complete;
use super::views::{arena_error, view, view_mut};
use super::vocab_parallel;
use super::weights::Weights;
use crate::error::Result;
use crate::lce_chunk::chunk_ranges;

/// The lm_head the logits are computed with: `raw`, or with NormHead its row-normalised copy,
/// computed into `normed`.
fn head_weights<'b, T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    raw: &'b CudaView<'_, T>,
    normed: &'b mut CudaViewMut<'_, T>,
) -> Result<CudaView<'b, T>> {
    if d.head_norm_len == 0 {
        return Ok(raw.slice(..));
    }
    k::row_normalize_forward(cx.stream, raw, d.c, normed)?;
    Ok(normed.as_view())
}

/// `logits[rows] = final_xn[rows] · lm_headᵀ` into the front of the chunk buffer.
fn head_forward<'b, T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    head: &CudaView<'_, T>,
    x: &CudaView<'_, T>,
    rows: usize,
    chunk: &'b mut CudaViewMut<'_, T>,
) -> Result<CudaViewMut<'b, T>> {
    let mut logits = view_mut(chunk, 0..rows * d.vocab)?;
    cx.mm
        .linear_forward(cx.stream, x, head, None, rows, d.c, d.vocab, &mut logits)?;
    Ok(logits)
}

/// The cross entropy's gradient factor (`loss_scale / denominator`): a kernel argument in an
/// eager step, or one f32 in device memory that a captured CUDA graph reads when it replays
/// (see `graph.rs`), written by the host before each replay.
#[derive(Clone, Copy)]
pub(crate) enum GradFactor<'a> {
    Host(f64),
    Device(&'a CudaView<'a, f32>),
}

/// Training: the loss of every target (row losses, and the call's totals in `totals`) and the
/// loss head's backward. `b.final_xn` must hold the forward's final norm; on return
/// `b.grad.dxn` holds d(loss)/d(final_xn) (`=`) and d(lm_head) has been added into `g`'s
/// lm_head range. `factor` is the whole call's (`loss_scale / denominator`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn loss_and_head_backward<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &Weights<'_, T>,
    g: &mut GradParts<'_>,
    targets: &CudaView<'_, i32>,
    factor: GradFactor<'_>,
    totals: &mut CeTotals,
    b: &mut Bufs<'_, T>,
) -> Result<()> {
    let (n, c) = (d.n, d.c);
    let raw = w.slice(cx.layout.lm_head.clone())?;
    let head = head_weights(cx, d, &raw, &mut b.head_normed)?;
    let norm_head = d.head_norm_len > 0;
    // The first chunk's product covers the whole lm_head gradient, so it may write it (see
    // `GradParts::claim`); NormHead's goes through `dhead_normed` and is added.
    let mut dhead_grad = if norm_head {
        WeightGrad::Add
    } else {
        g.claim(cx.layout.lm_head.clone())?
    };
    let mut dhead = g.range(cx.layout.lm_head.clone())?;
    if norm_head {
        cx.stream
            .memset_zeros(&mut b.dhead_normed)
            .map_err(|e| cuda_err("zeroing the NormHead gradient", e))?;
    }
    let final_xn = b.final_xn.as_view();
    let mut logit_chunk = b.scratch.logits()?;
    for r in chunk_ranges(n, b.logit_rows) {
        let rows = r.len();
        let x = view(&final_xn, r.start * c..r.end * c)?;
        let mut logits = head_forward(cx, d, &head, &x, rows, &mut logit_chunk)?;
        let chunk_targets = view(targets, r.clone())?;
        if let Some(z) = cx.z_loss.as_deref_mut() {
            k::z_loss_rows(cx.stream, &logits, &chunk_targets, d.vocab, z)?;
        }
        let mut row_loss = view_mut(&mut b.row_loss, r.clone())?;
        match factor {
            GradFactor::Host(grad_scale) if cx.vocab.is_some() => {
                vocab_parallel::loss_and_grad_chunk(
                    cx,
                    &mut logits,
                    &chunk_targets,
                    grad_scale,
                    &mut row_loss,
                )?
            }
            GradFactor::Device(_) if cx.vocab.is_some() => {
                return Err(arena_error(
                    "a vocabulary-parallel loss head runs eagerly (its all-reduces cannot be \
                     captured in a CUDA graph)"
                        .into(),
                ));
            }
            GradFactor::Host(grad_scale) => k::cross_entropy_fused(
                cx.stream,
                &mut logits,
                &chunk_targets,
                d.vocab,
                grad_scale,
                &mut row_loss,
                totals,
            )?,
            GradFactor::Device(grad_scale) => k::cross_entropy_fused_device_scale(
                cx.stream,
                &mut logits,
                &chunk_targets,
                d.vocab,
                grad_scale,
                &mut row_loss,
                totals,
            )?,
        }
        if let Some(z) = cx.z_loss.as_deref() {
            let weight = d.z_loss_weight as f32;
            let scale = match factor {
                GradFactor::Host(f) => k::ZLossScale::Host(f as f32),
                GradFactor::Device(f) => k::ZLossScale::Device(f),
            };
            k::z_loss_apply(
                cx.stream,
                z,
                d.vocab,
                weight,
                scale,
                &mut row_loss,
                Some(&mut logits),
            )?;
        }
        cx.mm.linear_backward(
            cx.stream,
            &logits.as_view(),
            &x,
            &head,
            rows,
            c,
            d.vocab,
            Some(&mut view_mut(&mut b.grad.dxn, r.start * c..r.end * c)?),
            (
                &mut if norm_head {
                    b.dhead_normed.slice_mut(..)
                } else {
                    dhead.slice_mut(..)
                },
                dhead_grad,
            ),
            None,
        )?;
        dhead_grad = WeightGrad::Add;
    }
    if norm_head {
        k::row_normalize_backward(cx.stream, &b.dhead_normed, &raw, c, &mut dhead)?;
    }
    if cx.vocab.is_some() {
        // Each rank's dxn is its vocabulary slice's share of d(loss)/d(final_xn).
        complete(cx.tp, &mut b.grad.dxn)?;
    }
    call_totals(cx, d, targets, totals, b)
}

/// Evaluation: row losses and the call's totals, the logits left as computed (no gradient).
pub(crate) fn loss_only<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &Weights<'_, T>,
    targets: &CudaView<'_, i32>,
    totals: &mut CeTotals,
    b: &mut Bufs<'_, T>,
) -> Result<()> {
    let raw = w.slice(cx.layout.lm_head.clone())?;
    let head = head_weights(cx, d, &raw, &mut b.head_normed)?;
    let final_xn = b.final_xn.as_view();
    let mut logit_chunk = b.scratch.logits()?;
    for r in chunk_ranges(d.n, b.logit_rows) {
        let x = view(&final_xn, r.start * d.c..r.end * d.c)?;
        let logits = head_forward(cx, d, &head, &x, r.len(), &mut logit_chunk)?;
        let chunk_targets = view(targets, r.clone())?;
        let mut row_loss = view_mut(&mut b.row_loss, r.clone())?;
        if cx.vocab.is_some() {
            vocab_parallel::loss_chunk(cx, &logits.as_view(), &chunk_targets, &mut row_loss)?;
            continue;
        }
        k::cross_entropy_forward(
            cx.stream,
            &logits,
            &chunk_targets,
            d.vocab,
            &mut row_loss,
            totals,
        )?;
        if let Some(z) = cx.z_loss.as_deref_mut() {
            k::z_loss_rows(cx.stream, &logits, &chunk_targets, d.vocab, z)?;
            k::z_loss_apply(
                cx.stream,
                z,
                d.vocab,
                d.z_loss_weight as f32,
                k::ZLossScale::Host::<CudaView<'_, f32>>(0.0),
                &mut row_loss,
                None::<&mut CudaViewMut<'_, T>>,
            )?;
        }
    }
    call_totals(cx, d, targets, totals, b)
}

/// With several chunks, each cross-entropy launch wrote totals of its own rows only: reduce
/// the whole call's row losses once (the same reduction, so the same bits, as one launch).
/// With Baichuan2's z-loss the row losses gained their z terms after the launches' totals,
/// so they are reduced again in every case; the vocabulary-parallel launches write no totals
/// (their targets index the whole vocabulary, which the totals count them against).
fn call_totals<T>(
    cx: &mut Cx<'_>,
    d: &Dims,
    targets: &CudaView<'_, i32>,
    totals: &mut CeTotals,
    b: &Bufs<'_, T>,
) -> Result<()> {
    if b.logit_rows < d.n || cx.z_loss.is_some() || cx.vocab.is_some() {
        let vocab = vocab_parallel::full_vocab(cx, d.vocab);
        k::cross_entropy_totals(cx.stream, &b.row_loss.as_view(), targets, vocab, totals)?;
    }
    Ok(())
}

/// The whole call's logits `[n × vocab]` on the host (widened to f32), computed chunk by chunk
/// into the chunk buffer and downloaded after each (synchronises once per chunk): the host
/// holds the full logits, the device never does. On a vocabulary-parallel rank, its columns
/// (`vocab` is the slice's rows).
pub(crate) fn logits_to_host<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    d: &Dims,
    w: &Weights<'_, T>,
    b: &mut Bufs<'_, T>,
) -> Result<Vec<f32>> {
    let raw = w.slice(cx.layout.lm_head.clone())?;
    let head = head_weights(cx, d, &raw, &mut b.head_normed)?;
    let final_xn = b.final_xn.as_view();
    let mut host = Vec::with_capacity(d.n * d.vocab);
    let mut logit_chunk = b.scratch.logits()?;
    for r in chunk_ranges(d.n, b.logit_rows) {
        let x = view(&final_xn, r.start * d.c..r.end * d.c)?;
        let logits = head_forward(cx, d, &head, &x, r.len(), &mut logit_chunk)?;
        let chunk = cx
            .stream
            .clone_dtoh(&logits)
            .map_err(|e| cuda_err("downloading the logits", e))?;
        cx.stream
            .synchronize()
            .map_err(|e| cuda_err("downloading the logits", e))?;
        host.extend(chunk.into_iter().map(T::to_f32));
    }
    Ok(host)
}
