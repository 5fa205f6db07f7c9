//! Token cross-entropy over `[rows, vocab]` logits with Hugging Face semantics: targets are
//! already shifted, `-100` is ignored, and the caller divides `loss_sum` by its denominator
//! (the number of non-ignored targets of the whole accumulated batch).
//!
//! Numerically stable: each row subtracts its max before exponentiating; the row's loss is
//! formed in f64 (`lse - logit[target]`), and row losses are summed serially in row order.
//!
//! Gradient convention: `cross_entropy_fused` *writes* (`=`, in place) the logits' gradient
//! `(softmax - onehot) * grad_scale`; rows with an ignored target become 0. No parameters.

use rayon::prelude::*;

use super::Real;
use crate::shape::expect_product;
use crate::{OpsError, Result};

/// The target value meaning "no loss at this position" (PyTorch's default `ignore_index`).
pub const IGNORE_INDEX: i32 = -100;

/// Sum of token losses (f64) and the number of non-ignored targets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CeStats {
    pub loss_sum: f64,
    pub valid: usize,
}

fn validate<R>(logits: &[R], targets: &[i32], vocab: usize) -> Result<()> {
    expect_product(
        "cross_entropy (logits = targets x vocab)",
        &[targets.len(), vocab],
        logits.len(),
    )?;
    for (position, &label) in targets.iter().enumerate() {
        if label != IGNORE_INDEX && (label < 0 || label as usize >= vocab) {
            return Err(OpsError::LabelOutOfRange {
                label,
                position,
                vocab,
            });
        }
    }
    Ok(())
}

/// Row max and `sum exp(x - max)` (in f64).
#[inline]
fn row_max_sumexp<R: Real>(row: &[R]) -> (R, f64) {
    let m = row.iter().fold(R::neg_infinity(), |m, &x| m.max(x));
    let sum: f64 = row.iter().map(|&x| (x - m).exp().to_f64()).sum();
    (m, sum)
}

fn sum_in_order(losses: &[Option<f64>]) -> CeStats {
    let mut loss_sum = 0.0;
    let mut valid = 0;
    for l in losses.iter().flatten() {
        loss_sum += *l;
        valid += 1;
    }
    CeStats { loss_sum, valid }
}

/// Loss only; `logits` is `[targets.len(), vocab]`. Errors (before any work) on a label that is
/// neither `-100` nor in `0..vocab`, or on a length mismatch.
pub fn cross_entropy_forward<R: Real>(
    logits: &[R],
    targets: &[i32],
    vocab: usize,
) -> Result<CeStats> {
    validate(logits, targets, vocab)?;
    if vocab == 0 {
        return Ok(sum_in_order(&[]));
    }
    let losses: Vec<Option<f64>> = logits
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .with_min_len(4)
        .map(|(row, &t)| {
            if t == IGNORE_INDEX {
                return None;
            }
            let (m, sum) = row_max_sumexp(row);
            Some(m.to_f64() + sum.ln() - row[t as usize].to_f64())
        })
        .collect();
    Ok(sum_in_order(&losses))
}

/// Loss, and overwrites `logits` with `d(loss_sum * grad_scale) / d(logits)`:
/// `(softmax(row) - onehot(target)) * grad_scale` for valid rows, 0 for ignored rows.
/// On error `logits` is left untouched.
pub fn cross_entropy_fused<R: Real>(
    logits: &mut [R],
    targets: &[i32],
    vocab: usize,
    grad_scale: f64,
) -> Result<CeStats> {
    validate(logits, targets, vocab)?;
    if vocab == 0 {
        return Ok(sum_in_order(&[]));
    }
    let losses: Vec<Option<f64>> = logits
        .par_chunks_mut(vocab)
        .zip(targets.par_iter())
        .with_min_len(4)
        .map(|(row, &t)| {
            if t == IGNORE_INDEX {
                row.fill(R::zero());
                return None;
            }
            let t = t as usize;
            let x_t = row[t].to_f64();
            let m = row.iter().fold(R::neg_infinity(), |m, &x| m.max(x));
            let mut sum = 0.0f64;
            for x in row.iter_mut() {
                *x = (*x - m).exp();
                sum += x.to_f64();
            }
            let scale = R::from_f64(grad_scale / sum);
            for x in row.iter_mut() {
                *x *= scale;
            }
            row[t] -= R::from_f64(grad_scale);
            Some(m.to_f64() + sum.ln() - x_t)
        })
        .collect();
    Ok(sum_in_order(&losses))
}
