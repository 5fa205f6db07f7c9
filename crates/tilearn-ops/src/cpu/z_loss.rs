//! Baichuan2's z-loss: `z_loss_weight · max(logits)²` per target row, which keeps the logits'
//! scale (and so the softmax normaliser) from drifting. Baichuan2's modeling code adds
//! `z_loss_weight · mean(max(shift_logits, -1)²)` to the mean cross entropy; tilearn adds the
//! term to each target row's loss, so a call's `loss_sum / denominator` carries
//! `z_loss_weight · mean(max²)` over the same targets the cross entropy averages (exactly
//! Baichuan2's value when no label is `-100`, and exact under gradient accumulation).
//!
//! Two steps, because the fused cross entropy overwrites the logits with their gradient:
//! [`z_loss_rows`] reads each target row's max and first argmax before it, [`z_loss_apply`]
//! afterwards adds `weight · max²` to the loss and `grad_scale · weight · 2 · max` to the
//! gradient at the argmax (`+=`: the derivative of the max is the one-hot of its position, as
//! PyTorch's `max(dim)` backward routes it). Rows with an ignored target get nothing.

use super::Real;
use super::cross_entropy::IGNORE_INDEX;
use crate::Result;
use crate::shape::{expect_len, expect_product};

/// Per row of `logits` (`[rows, vocab]`): `max[r]` and the first position of the max,
/// `arg[r]`, for rows whose target is not `-100`; `arg[r] = -1` (and `max[r] = 0`) for the
/// others. Both written.
pub fn z_loss_rows<R: Real>(
    logits: &[R],
    targets: &[i32],
    vocab: usize,
    max: &mut [R],
    arg: &mut [i32],
) -> Result<()> {
    let rows = targets.len();
    expect_product(
        "z_loss_rows (logits = targets x vocab)",
        &[rows, vocab],
        logits.len(),
    )?;
    expect_len("z_loss_rows (max)", rows, max.len())?;
    expect_len("z_loss_rows (arg)", rows, arg.len())?;
    for (r, &t) in targets.iter().enumerate() {
        if t == IGNORE_INDEX || vocab == 0 {
            max[r] = R::zero();
            arg[r] = -1;
            continue;
        }
        let row = &logits[r * vocab..(r + 1) * vocab];
        let (mut best, mut at) = (row[0], 0usize);
        for (j, &x) in row.iter().enumerate().skip(1) {
            if x > best {
                best = x;
                at = j;
            }
        }
        max[r] = best;
        arg[r] = at as i32;
    }
    Ok(())
}

/// The z-loss sum `Σ weight · max[r]²` over the rows with `arg[r] >= 0` (in f64, row order),
/// and, when `dlogits` (`[rows, vocab]`) is given, `dlogits[r, arg[r]] += grad_scale · weight ·
/// 2 · max[r]`.
pub fn z_loss_apply<R: Real>(
    max: &[R],
    arg: &[i32],
    vocab: usize,
    weight: f64,
    grad_scale: f64,
    dlogits: Option<&mut [R]>,
) -> Result<f64> {
    expect_len("z_loss_apply (arg)", max.len(), arg.len())?;
    let mut dlogits = dlogits;
    if let Some(d) = dlogits.as_deref() {
        expect_product("z_loss_apply (dlogits)", &[max.len(), vocab], d.len())?;
    }
    let mut sum = 0.0;
    for (r, (&m, &a)) in max.iter().zip(arg).enumerate() {
        if a < 0 {
            continue;
        }
        let m64 = m.to_f64();
        sum += weight * m64 * m64;
        if let Some(d) = dlogits.as_deref_mut() {
            let at = r * vocab + a as usize;
            d[at] += R::from_f64(grad_scale * weight * 2.0 * m64);
        }
    }
    Ok(sum)
}
