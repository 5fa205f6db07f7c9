//! The forward and backward of a run of consecutive decoder layers, with the embedding in front
//! when the run starts the model and the final norm, `lm_head` and loss behind when it ends it.
//! The whole model is the run that does both; a pipeline stage's chunk is any run, taking its
//! input activations from the previous stage and handing the gradient of its input back.
//!
//! Gradient convention as in [`super::block`]: parameter gradients are added (`+=`); after
//! [`stage_backward`], `acts.grad.dres` holds d(loss)/d(input of the run) (written).

use std::ops::Range;

use tilearn_ops::cpu::{
    Real, embedding_backward, embedding_forward, linear_backward, linear_forward,
    row_normalize_backward, row_normalize_forward,
};

use super::activations::Activations;
use super::block::{Dims, Positions, block_backward, block_forward};
use super::layout::LayerLayout;
use super::norm::{NormAt, norm_backward, norm_forward};
use super::{Split, vocab_parallel};
use crate::error::{EngineError, Result};

/// Which parameters a run holds, as ranges of its flat buffer.
pub(crate) struct StageParts<'a> {
    /// The embedding, when the run starts the model.
    pub embed: Option<&'a Range<usize>>,
    pub layers: &'a [LayerLayout],
    /// The final norm and `lm_head`, when the run ends the model.
    pub head: Option<(&'a Range<usize>, &'a Range<usize>)>,
    /// The final norm's bias (LayerNorm, Bloom).
    pub norm_bias: Option<&'a Range<usize>>,
    /// The LayerNorm after the embedding (Bloom): weight, bias.
    pub embed_norm: Option<&'a (Range<usize>, Range<usize>)>,
}

impl<'a> StageParts<'a> {
    /// The whole model: embedding, every layer, head.
    pub fn whole(layout: &'a super::ModelLayout) -> StageParts<'a> {
        StageParts {
            embed: Some(&layout.embed),
            layers: &layout.layers,
            head: Some((&layout.norm, &layout.lm_head)),
            norm_bias: layout.norm_bias.as_ref(),
            embed_norm: layout.embed_norm.as_ref(),
        }
    }
}

/// Sum of token losses of the rows this call computed.
pub(crate) struct StageLoss {
    pub loss_sum: f64,
    pub valid: usize,
}

/// The rotary table and the position ids set for this call's shape (see
/// [`Activations::set_position_ids`]).
fn positions<'a>(
    d: &Dims,
    rope: &'a tilearn_ops::cpu::RopeTable,
    alibi: &'a Option<Vec<f32>>,
    ids: &'a Option<(Vec<i32>, usize, usize)>,
) -> Result<Positions<'a>> {
    let ids = match ids {
        None => None,
        Some((p, b, s)) if (*b, *s) == (d.batch, d.seq) => Some(p.as_slice()),
        Some((_, b, s)) => {
            return Err(EngineError::InvalidArgument {
                argument: "position_ids".into(),
                message: format!(
                    "were set for batch {b} x seq {s}, but the call is batch {} x seq {}; call \
                     Activations::set_position_ids for every packed batch (None for unpacked)",
                    d.batch, d.seq
                ),
            });
        }
    };
    Ok(Positions {
        rope,
        ids,
        alibi: alibi.as_deref(),
    })
}

fn missing(what: &str) -> EngineError {
    EngineError::InvalidArgument {
        argument: what.into(),
        message: "a stage without the embedding needs the previous stage's activations (and \
                  one without the head the next stage's gradient)"
            .into(),
    }
}

/// Forward of the run into `acts` (block inputs in `acts.resid`, logits when it ends the model).
/// `input` is the previous stage's output `[n, C]` unless the run starts with the embedding.
pub(crate) fn stage_forward<R: Real>(
    d: &Dims,
    parts: &StageParts<'_>,
    params: &[R],
    ids: &[u32],
    input: Option<&[R]>,
    acts: &mut Activations<R>,
    split: &Split<'_, R>,
) -> Result<()> {
    let Activations {
        rope,
        alibi,
        resid,
        layers,
        final_rstd,
        final_mean,
        embed_mean,
        embed_rstd,
        final_xn,
        logits,
        position_ids,
        head_normed,
        ..
    } = acts;
    let pos = positions(d, rope, alibi, position_ids)?;
    let (n, c) = (d.n, d.c);
    let slab = n * c;
    let rows = split.rows();
    // This rank's rows of the residual stream (all of them without sequence parallelism).
    let local = rows.local_rows(n)? * c;
    let nl = parts.layers.len();
    match (parts.embed, input) {
        (Some(embed), _) => {
            let table = &params[embed.clone()];
            if split.is_whole() {
                embedding_forward(ids, table, c, &mut resid[..slab])?;
            } else {
                vocab_parallel::embedding_forward(
                    ids,
                    table,
                    &split.vocab,
                    split.full_vocab,
                    c,
                    &mut resid[..slab],
                )?;
                rows.complete(&mut resid[..slab])?;
            }
        }
        (None, Some(x)) => resid[..local].copy_from_slice(&x[..local]),
        (None, None) => return Err(missing("input")),
    }
    if let (Some((w, b)), Some(_)) = (parts.embed_norm, parts.embed) {
        // Bloom: the residual stream starts from word_embeddings_layernorm(embedding); the
        // raw embedding passes through final_xn (free until the final norm) and is
        // recomputed in the backward.
        final_xn[..slab].copy_from_slice(&resid[..slab]);
        let at = NormAt {
            weight: w,
            bias: Some(b),
        };
        norm_forward(
            at,
            params,
            &final_xn[..slab],
            c,
            d.eps,
            &mut resid[..slab],
            &mut embed_mean[..n],
            &mut embed_rstd[..n],
        )?;
    }
    let single = layers.len() == 1;
    for (i, lay) in parts.layers.iter().enumerate() {
        let (before, after) = resid.split_at_mut((i + 1) * slab);
        let x = &before[i * slab..];
        let out = &mut after[..slab];
        let a = &mut layers[if single { 0 } else { i }];
        block_forward(d, lay, params, pos, x, a, Some(out), rows)?;
    }
    if let Some((norm, lm_head)) = parts.head {
        let at = NormAt {
            weight: norm,
            bias: parts.norm_bias,
        };
        norm_forward(
            at,
            params,
            &resid[nl * slab..nl * slab + local],
            c,
            d.eps,
            &mut final_xn[..local],
            &mut final_mean[..local / c],
            &mut final_rstd[..local / c],
        )?;
        rows.gather(&mut final_xn[..slab])?;
        let head = &params[lm_head.clone()];
        let head = if d.norm_head {
            row_normalize_forward(head, c, head_normed)?;
            &head_normed[..]
        } else {
            head
        };
        linear_forward(
            &final_xn[..slab],
            head,
            None,
            n,
            c,
            d.vocab,
            &mut logits[..n * d.vocab],
        )?;
    }
    Ok(())
}

/// Backward of the run after its [`stage_forward`]. When it ends the model the loss comes from
/// the shifted targets in `acts.targets` with gradient scale `grad_scale`; otherwise `dout` is
/// the next stage's gradient of this run's output. Returns the loss when the run computed it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_backward<R: Real>(
    d: &Dims,
    parts: &StageParts<'_>,
    params: &[R],
    grads: &mut [R],
    ids: &[u32],
    dout: Option<&[R]>,
    grad_scale: f64,
    acts: &mut Activations<R>,
    split: &Split<'_, R>,
) -> Result<Option<StageLoss>> {
    let Activations {
        checkpointing,
        rope,
        alibi,
        resid,
        layers,
        final_rstd,
        final_mean,
        embed_mean,
        embed_rstd,
        final_xn,
        logits,
        targets,
        grad,
        position_ids,
        head_normed,
        dhead_normed,
        ..
    } = acts;
    let pos = positions(d, rope, alibi, position_ids)?;
    let (n, c) = (d.n, d.c);
    let slab = n * c;
    let rows = split.rows();
    let local = rows.local_rows(n)? * c;
    let nl = parts.layers.len();

    let loss = match (parts.head, dout) {
        (Some((norm, lm_head)), _) => {
            // Cross entropy in place: logits become d(loss_sum · grad_scale)/d(logits).
            let logits = &mut logits[..n * d.vocab];
            let ce = vocab_parallel::loss_and_grad(
                logits,
                &targets[..n],
                d.vocab,
                grad_scale,
                d.z_loss_weight,
                split,
            )?;
            let loss = StageLoss {
                loss_sum: ce.loss_sum,
                valid: ce.valid,
            };
            if d.norm_head {
                // The product saw the normalised rows (still in `head_normed` from the
                // forward); its weight gradient goes through the normalisation's backward.
                dhead_normed.fill(R::zero());
                linear_backward(
                    logits,
                    &final_xn[..slab],
                    head_normed,
                    n,
                    c,
                    d.vocab,
                    Some(&mut grad.dxn[..slab]),
                    dhead_normed,
                    None,
                )?;
                row_normalize_backward(
                    dhead_normed,
                    &params[lm_head.clone()],
                    c,
                    &mut grads[lm_head.clone()],
                )?;
            } else {
                linear_backward(
                    logits,
                    &final_xn[..slab],
                    &params[lm_head.clone()],
                    n,
                    c,
                    d.vocab,
                    Some(&mut grad.dxn[..slab]),
                    &mut grads[lm_head.clone()],
                    None,
                )?;
            }
            rows.complete(&mut grad.dxn[..slab])?;
            let at = NormAt {
                weight: norm,
                bias: parts.norm_bias,
            };
            norm_backward(
                at,
                params,
                grads,
                &grad.dxn[..local],
                &resid[nl * slab..nl * slab + local],
                &final_mean[..local / c],
                &final_rstd[..local / c],
                c,
                &mut grad.dres[..local],
            )?;
            Some(loss)
        }
        (None, Some(g)) => {
            grad.dres[..local].copy_from_slice(&g[..local]);
            None
        }
        (None, None) => return Err(missing("dout")),
    };

    for (i, lay) in parts.layers.iter().enumerate().rev() {
        let x = &resid[i * slab..(i + 1) * slab];
        let a = if *checkpointing {
            // The scratch still holds the last layer from the forward.
            if i + 1 != nl {
                block_forward(d, lay, params, pos, x, &mut layers[0], None, rows)?;
            }
            &layers[0]
        } else {
            &layers[i]
        };
        block_backward(d, lay, params, grads, pos, x, a, grad, rows)?;
    }
    if let (Some((w, b)), Some(embed)) = (parts.embed_norm, parts.embed) {
        // Bloom: through word_embeddings_layernorm, recomputing its input (the raw embedding)
        // into dxn; its input gradient replaces dres.
        embedding_forward(ids, &params[embed.clone()], c, &mut grad.dxn[..slab])?;
        let at = NormAt {
            weight: w,
            bias: Some(b),
        };
        norm_backward(
            at,
            params,
            grads,
            &grad.dres[..slab],
            &grad.dxn[..slab],
            &embed_mean[..n],
            &embed_rstd[..n],
            c,
            &mut grad.dtmp[..slab],
        )?;
        grad.dres[..slab].copy_from_slice(&grad.dtmp[..slab]);
    }
    if let Some(embed) = parts.embed {
        let dembed = &mut grads[embed.clone()];
        if split.is_whole() {
            embedding_backward(ids, &grad.dres[..slab], c, dembed)?;
        } else {
            let dout = rows.gathered(&grad.dres[..slab], &mut grad.dxn[..slab])?;
            vocab_parallel::embedding_backward(ids, dout, &split.vocab, c, dembed);
        }
    }
    Ok(loss)
}
