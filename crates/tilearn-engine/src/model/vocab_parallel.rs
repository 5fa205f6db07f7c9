//! The embedding and the cross entropy over one rank's slice of the vocabulary (Megatron's
//! vocabulary-parallel embedding and cross entropy): the full `[tokens × vocab]` logits never
//! exist on one rank.
//!
//! Embedding: a rank looks up the ids that fall in its rows and writes zeros for the others;
//! the sum over the ranks is the lookup. Its backward adds only the rows it owns.
//!
//! Cross entropy with logits `[n, V_r]` (rank `r`'s columns `start..start+V_r` of the vocab):
//! three all-reduces of `[n]` vectors (the row maxima, the sums of `exp(x - max)` and the
//! target logits, each rank contributing the target's logit when it owns the target) give every
//! rank the row's loss `ln(sum) + max - x_target`; the gradient of its own columns is
//! `(exp(x - max) / sum - onehot) * grad_scale`. Rows with an ignored target give no loss and a
//! zero gradient, as in [`tilearn_ops::cpu::cross_entropy_fused`].

use std::ops::Range;

use tilearn_ops::cpu::{IGNORE_INDEX, Real};

use super::partial_sums::PartialSums;
use crate::error::{EngineError, Result};

/// Row sums of token losses, as [`tilearn_ops::cpu::CeStats`].
pub(crate) struct SliceCe {
    pub loss_sum: f64,
    pub valid: usize,
}

fn check_ids(ids: &[u32], full_vocab: usize) -> Result<()> {
    if let Some((position, &id)) = ids
        .iter()
        .enumerate()
        .find(|&(_, &id)| id as usize >= full_vocab)
    {
        return Err(EngineError::InvalidArgument {
            argument: "ids".into(),
            message: format!(
                "token id {id} at position {position} is outside the vocabulary of \
                 {full_vocab}; prepare the data with the model's tokenizer"
            ),
        });
    }
    Ok(())
}

/// `out[t] = table[ids[t] - rows.start]` for the ids in `rows`, zeros elsewhere: this rank's
/// part of the embedding, which the caller completes over the ranks (all-reduce, or with
/// sequence parallelism reduce-scatter).
pub(crate) fn embedding_forward<R: Real>(
    ids: &[u32],
    table: &[R],
    rows: &Range<usize>,
    full_vocab: usize,
    dim: usize,
    out: &mut [R],
) -> Result<()> {
    check_ids(ids, full_vocab)?;
    for (row, &id) in out.chunks_mut(dim).zip(ids) {
        let id = id as usize;
        if rows.contains(&id) {
            let local = id - rows.start;
            row.copy_from_slice(&table[local * dim..(local + 1) * dim]);
        } else {
            row.fill(R::zero());
        }
    }
    Ok(())
}

/// Adds `dout`'s rows into the table rows this rank owns.
pub(crate) fn embedding_backward<R: Real>(
    ids: &[u32],
    dout: &[R],
    rows: &Range<usize>,
    dim: usize,
    dtable: &mut [R],
) {
    for (src, &id) in dout.chunks(dim).zip(ids) {
        let id = id as usize;
        if rows.contains(&id) {
            let local = id - rows.start;
            for (d, &s) in dtable[local * dim..(local + 1) * dim].iter_mut().zip(src) {
                *d += s;
            }
        }
    }
}

/// Per row: the global maximum, the global `sum exp(x - max)` and the target's logit.
struct RowStats<R> {
    max: Vec<R>,
    sumexp: Vec<R>,
    target_logit: Vec<R>,
}

fn row_stats<R: Real>(
    logits: &[R],
    targets: &[i32],
    cols: &Range<usize>,
    sums: &dyn PartialSums<R>,
) -> Result<RowStats<R>> {
    let width = cols.len();
    let rows = targets.len();
    let mut max: Vec<R> = logits
        .chunks(width)
        .map(|row| row.iter().fold(R::neg_infinity(), |m, &x| m.max(x)))
        .collect();
    sums.max(&mut max)?;
    let mut sumexp: Vec<R> = logits
        .chunks(width)
        .zip(&max)
        .map(|(row, &m)| {
            let s: f64 = row.iter().map(|&x| (x - m).exp().to_f64()).sum();
            R::from_f64(s)
        })
        .collect();
    sums.sum(&mut sumexp)?;
    let mut target_logit = vec![R::zero(); rows];
    for ((t, row), out) in targets
        .iter()
        .zip(logits.chunks(width))
        .zip(&mut target_logit)
    {
        if *t != IGNORE_INDEX && cols.contains(&(*t as usize)) {
            *out = row[*t as usize - cols.start];
        }
    }
    sums.sum(&mut target_logit)?;
    Ok(RowStats {
        max,
        sumexp,
        target_logit,
    })
}

fn check_targets(targets: &[i32], full_vocab: usize) -> Result<()> {
    if let Some((position, &label)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &label)| label != IGNORE_INDEX && (label < 0 || label as usize >= full_vocab))
    {
        return Err(EngineError::InvalidArgument {
            argument: "labels".into(),
            message: format!(
                "label {label} at position {position} is neither -100 nor in 0..{full_vocab}"
            ),
        });
    }
    Ok(())
}

fn losses<R: Real>(targets: &[i32], stats: &RowStats<R>) -> SliceCe {
    let (mut loss_sum, mut valid) = (0.0, 0);
    for (i, &t) in targets.iter().enumerate() {
        if t != IGNORE_INDEX {
            loss_sum += stats.max[i].to_f64() + stats.sumexp[i].to_f64().ln()
                - stats.target_logit[i].to_f64();
            valid += 1;
        }
    }
    SliceCe { loss_sum, valid }
}

/// The loss only.
pub(crate) fn cross_entropy_forward<R: Real>(
    logits: &[R],
    targets: &[i32],
    cols: &Range<usize>,
    full_vocab: usize,
    sums: &dyn PartialSums<R>,
) -> Result<SliceCe> {
    check_targets(targets, full_vocab)?;
    let stats = row_stats(logits, targets, cols, sums)?;
    Ok(losses(targets, &stats))
}

/// The loss, and the logits replaced by their gradient `(softmax - onehot) * grad_scale`.
pub(crate) fn cross_entropy_fused<R: Real>(
    logits: &mut [R],
    targets: &[i32],
    cols: &Range<usize>,
    full_vocab: usize,
    grad_scale: f64,
    sums: &dyn PartialSums<R>,
) -> Result<SliceCe> {
    check_targets(targets, full_vocab)?;
    let stats = row_stats(logits, targets, cols, sums)?;
    for (i, row) in logits.chunks_mut(cols.len()).enumerate() {
        let t = targets[i];
        if t == IGNORE_INDEX {
            row.fill(R::zero());
            continue;
        }
        let m = stats.max[i];
        let scale = R::from_f64(grad_scale / stats.sumexp[i].to_f64());
        for x in row.iter_mut() {
            *x = (*x - m).exp() * scale;
        }
        let t = t as usize;
        if cols.contains(&t) {
            row[t - cols.start] -= R::from_f64(grad_scale);
        }
    }
    Ok(losses(targets, &stats))
}

/// Baichuan2's z-loss is computed on the whole vocabulary's rows only: a rank's slice does not
/// know whether it holds the row's maximum.
fn no_split_z_loss<R>(z_loss_weight: f64, split: &super::Split<'_, R>) -> Result<()> {
    if z_loss_weight != 0.0 && !split.is_whole() {
        return Err(EngineError::InvalidArgument {
            argument: "z_loss_weight".into(),
            message: "Baichuan2's z-loss is not supported with tensor parallelism; train with \
                      --tp-size 1 or set \"z_loss_weight\": 0 in config.json"
                .into(),
        });
    }
    Ok(())
}

/// Per target row the maximum logit and its position (Baichuan2's z-loss), read before the
/// fused cross entropy overwrites the logits; `None` without z-loss.
fn z_rows<R: Real>(
    logits: &[R],
    targets: &[i32],
    vocab: usize,
    z_loss_weight: f64,
) -> Result<Option<(Vec<R>, Vec<i32>)>> {
    if z_loss_weight == 0.0 {
        return Ok(None);
    }
    let mut max = vec![R::zero(); targets.len()];
    let mut arg = vec![0; targets.len()];
    tilearn_ops::cpu::z_loss_rows(logits, targets, vocab, &mut max, &mut arg)?;
    Ok(Some((max, arg)))
}

/// The loss of `logits` (`[n, local vocab]`) against shifted `targets`: the whole-vocabulary op
/// for an unsplit model, the vocabulary-parallel one for a rank's slice; plus Baichuan2's
/// z-loss when `z_loss_weight` is non-zero.
pub(crate) fn loss<R: Real>(
    logits: &[R],
    targets: &[i32],
    local_vocab: usize,
    z_loss_weight: f64,
    split: &super::Split<'_, R>,
) -> Result<SliceCe> {
    no_split_z_loss(z_loss_weight, split)?;
    if split.is_whole() {
        let ce = tilearn_ops::cpu::cross_entropy_forward(logits, targets, local_vocab)?;
        let z = match z_rows(logits, targets, local_vocab, z_loss_weight)? {
            Some((max, arg)) => tilearn_ops::cpu::z_loss_apply::<R>(
                &max,
                &arg,
                local_vocab,
                z_loss_weight,
                0.0,
                None,
            )?,
            None => 0.0,
        };
        return Ok(SliceCe {
            loss_sum: ce.loss_sum + z,
            valid: ce.valid,
        });
    }
    cross_entropy_forward(logits, targets, &split.vocab, split.full_vocab, split.sums)
}

/// [`loss`], and the logits replaced by their gradient times `grad_scale`.
pub(crate) fn loss_and_grad<R: Real>(
    logits: &mut [R],
    targets: &[i32],
    local_vocab: usize,
    grad_scale: f64,
    z_loss_weight: f64,
    split: &super::Split<'_, R>,
) -> Result<SliceCe> {
    no_split_z_loss(z_loss_weight, split)?;
    if split.is_whole() {
        let rows = z_rows(logits, targets, local_vocab, z_loss_weight)?;
        let ce = tilearn_ops::cpu::cross_entropy_fused(logits, targets, local_vocab, grad_scale)?;
        let z = match rows {
            Some((max, arg)) => tilearn_ops::cpu::z_loss_apply(
                &max,
                &arg,
                local_vocab,
                z_loss_weight,
                grad_scale,
                Some(logits),
            )?,
            None => 0.0,
        };
        return Ok(SliceCe {
            loss_sum: ce.loss_sum + z,
            valid: ce.valid,
        });
    }
    cross_entropy_fused(
        logits,
        targets,
        &split.vocab,
        split.full_vocab,
        grad_scale,
        split.sums,
    )
}
