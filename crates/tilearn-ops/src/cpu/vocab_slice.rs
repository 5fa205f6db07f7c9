//! The embedding lookup and the cross entropy over one rank's slice of the vocabulary
//! (Megatron's vocabulary-parallel embedding and cross entropy): the CPU reference of the CUDA
//! kernels `tilearn_embedding_{forward,backward}_slice` and `tilearn_vocab_ce_*`, step for
//! step, so each kernel is checked on its own against the function of the same name here.
//!
//! A rank holds rows `start .. start + rows` of a vocabulary of `full` words ([`VocabSlice`]).
//! Embedding: ids in the slice read their row, other ids give zero rows (the sum over the ranks
//! is the lookup); the backward adds only the slice's rows. Cross entropy over the rank's
//! logits `[n, rows]`: [`vocab_ce_partials`] (row max, sum of `exp(x - max)`, target logit
//! where owned), then the caller's all-reduce MAX of the maxima, [`vocab_ce_rescale`] to the
//! global max, the caller's all-reduce SUM of the sums and target logits, then
//! [`vocab_ce_fused_finish`] (row losses and the slice's gradient `(softmax - onehot) *
//! grad_scale`) or [`vocab_ce_loss_finish`] (row losses only). Ignored (`-100`) rows give zero
//! statistics, a zero loss and a zero gradient. Statistics and math in f32, as the kernels (the
//! sum of exponentials accumulated in f64, then stored as f32); the row loss is formed in f64
//! and stored as f32.

use super::Real;
use super::cross_entropy::IGNORE_INDEX;
use crate::shape::{expect_len, expect_product};
use crate::{OpsError, Result};

/// Rows `start .. start + rows` of a vocabulary of `full` words: one tensor-parallel rank's
/// part of the embedding and `lm_head` (and the columns of its logits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabSlice {
    pub start: usize,
    pub rows: usize,
    pub full: usize,
}

impl VocabSlice {
    /// The slice, refused unless it is non-empty and inside the vocabulary.
    pub fn new(start: usize, rows: usize, full: usize) -> Result<VocabSlice> {
        if rows == 0 || start > full || rows > full - start {
            return Err(OpsError::VocabSlice { start, rows, full });
        }
        Ok(VocabSlice { start, rows, full })
    }

    /// The whole vocabulary of `full` words.
    pub fn whole(full: usize) -> VocabSlice {
        VocabSlice {
            start: 0,
            rows: full,
            full,
        }
    }

    /// The slice's row (column of the logits) of vocabulary id `id`, if it holds it.
    pub fn local(&self, id: usize) -> Option<usize> {
        (id >= self.start && id - self.start < self.rows).then(|| id - self.start)
    }

    /// The slice's column of a (shifted) target, if it holds it (`None` for `-100` too).
    fn local_target(&self, t: i32) -> Option<usize> {
        usize::try_from(t).ok().and_then(|t| self.local(t))
    }
}

fn check_ids(ids: &[u32], full: usize) -> Result<()> {
    super::embedding::check_token_ids(ids, full)
}

fn check_targets(targets: &[i32], full: usize) -> Result<()> {
    match targets
        .iter()
        .position(|&t| t != IGNORE_INDEX && (t < 0 || t as usize >= full))
    {
        Some(position) => Err(OpsError::LabelOutOfRange {
            label: targets[position],
            position,
            vocab: full,
        }),
        None => Ok(()),
    }
}

/// `out[r] = table[ids[r] - start]` for the ids in the slice, zeros for the others. `table` is
/// `[slice.rows, dim]`, `out` `[ids.len(), dim]`; an id `>= slice.full` is an error (nothing
/// written).
pub fn embedding_forward_slice<R: Real>(
    ids: &[u32],
    table: &[R],
    slice: VocabSlice,
    dim: usize,
    out: &mut [R],
) -> Result<()> {
    expect_product(
        "embedding_forward_slice (table)",
        &[slice.rows, dim],
        table.len(),
    )?;
    expect_product(
        "embedding_forward_slice (out)",
        &[ids.len(), dim],
        out.len(),
    )?;
    check_ids(ids, slice.full)?;
    for (row, &id) in out.chunks_mut(dim).zip(ids) {
        match slice.local(id as usize) {
            Some(l) => row.copy_from_slice(&table[l * dim..(l + 1) * dim]),
            None => row.fill(R::zero()),
        }
    }
    Ok(())
}

/// `dtable[ids[r] - start] += dout[r]` for the ids in the slice, in row order (`+=`); other
/// ids are skipped. `dtable` is `[slice.rows, dim]`.
pub fn embedding_backward_slice<R: Real>(
    ids: &[u32],
    dout: &[R],
    slice: VocabSlice,
    dim: usize,
    dtable: &mut [R],
) -> Result<()> {
    expect_product(
        "embedding_backward_slice (dtable)",
        &[slice.rows, dim],
        dtable.len(),
    )?;
    expect_product(
        "embedding_backward_slice (dout)",
        &[ids.len(), dim],
        dout.len(),
    )?;
    check_ids(ids, slice.full)?;
    for (src, &id) in dout.chunks(dim).zip(ids) {
        if let Some(l) = slice.local(id as usize) {
            for (d, &s) in dtable[l * dim..(l + 1) * dim].iter_mut().zip(src) {
                *d += s;
            }
        }
    }
    Ok(())
}

/// Per row of the slice's logits `[targets.len(), slice.rows]`: the row's max, the sum of
/// `exp(x - max)` and the target's logit when the slice holds the target (else 0), written.
/// Ignored rows write zeros.
pub fn vocab_ce_partials<R: Real>(
    logits: &[R],
    targets: &[i32],
    slice: VocabSlice,
    local_max: &mut [f32],
    sumexp: &mut [f32],
    target_logit: &mut [f32],
) -> Result<()> {
    let n = targets.len();
    expect_product("vocab_ce_partials (logits)", &[n, slice.rows], logits.len())?;
    for (what, len) in [
        ("vocab_ce_partials (local_max)", local_max.len()),
        ("vocab_ce_partials (sumexp)", sumexp.len()),
        ("vocab_ce_partials (target_logit)", target_logit.len()),
    ] {
        expect_len(what, n, len)?;
    }
    check_targets(targets, slice.full)?;
    for (i, row) in logits.chunks(slice.rows).enumerate() {
        if targets[i] == IGNORE_INDEX {
            (local_max[i], sumexp[i], target_logit[i]) = (0.0, 0.0, 0.0);
            continue;
        }
        let m = row
            .iter()
            .fold(f32::NEG_INFINITY, |m, &x| m.max(x.to_f64() as f32));
        local_max[i] = m;
        // Summed in f64 and stored as f32: the oracle of the kernel's f32 tree sum.
        let sum: f64 = row
            .iter()
            .map(|&x| f64::from((x.to_f64() as f32 - m).exp()))
            .sum();
        sumexp[i] = sum as f32;
        target_logit[i] = slice
            .local_target(targets[i])
            .map_or(0.0, |c| row[c].to_f64() as f32);
    }
    Ok(())
}

/// `sumexp *= exp(local_max - global_max)` (a zero sum stays zero): the partial sums brought to
/// the global max before they are summed over the ranks.
pub fn vocab_ce_rescale(local_max: &[f32], global_max: &[f32], sumexp: &mut [f32]) -> Result<()> {
    let n = sumexp.len();
    expect_len("vocab_ce_rescale (local_max)", n, local_max.len())?;
    expect_len("vocab_ce_rescale (global_max)", n, global_max.len())?;
    for ((s, &l), &g) in sumexp.iter_mut().zip(local_max).zip(global_max) {
        if *s != 0.0 {
            *s *= (l - g).exp();
        }
    }
    Ok(())
}

/// The row loss `global_max + ln(sumexp) - target_logit` (f64, stored as f32; 0 for ignored
/// rows) of the completed statistics.
fn row_loss(t: i32, m: f32, s: f32, xt: f32) -> f32 {
    if t == IGNORE_INDEX {
        return 0.0;
    }
    (f64::from(m) + f64::from(s).ln() - f64::from(xt)) as f32
}

fn check_stats(op: &'static str, n: usize, stats: [&[f32]; 3], row_loss: &[f32]) -> Result<()> {
    for s in stats {
        expect_len(op, n, s.len())?;
    }
    expect_len(op, n, row_loss.len())
}

/// Row losses from the completed statistics (every rank gets the same), and the slice's logits
/// overwritten with `(exp(x - global_max) / sumexp - onehot) * grad_scale` (f32 math; zeros for
/// ignored rows; the one-hot only where the slice holds the target).
#[allow(clippy::too_many_arguments)]
pub fn vocab_ce_fused_finish<R: Real>(
    logits: &mut [R],
    targets: &[i32],
    slice: VocabSlice,
    global_max: &[f32],
    sumexp: &[f32],
    target_logit: &[f32],
    grad_scale: f32,
    row_losses: &mut [f32],
) -> Result<()> {
    let n = targets.len();
    expect_product(
        "vocab_ce_fused_finish (logits)",
        &[n, slice.rows],
        logits.len(),
    )?;
    check_stats(
        "vocab_ce_fused_finish (statistics)",
        n,
        [global_max, sumexp, target_logit],
        row_losses,
    )?;
    check_targets(targets, slice.full)?;
    for (i, row) in logits.chunks_mut(slice.rows).enumerate() {
        let t = targets[i];
        row_losses[i] = row_loss(t, global_max[i], sumexp[i], target_logit[i]);
        if t == IGNORE_INDEX {
            row.fill(R::zero());
            continue;
        }
        let (m, p_scale) = (global_max[i], grad_scale / sumexp[i]);
        let target = slice.local_target(t);
        for (c, x) in row.iter_mut().enumerate() {
            let mut g = (x.to_f64() as f32 - m).exp() * p_scale;
            if Some(c) == target {
                g -= grad_scale;
            }
            *x = R::from_f64(f64::from(g));
        }
    }
    Ok(())
}

/// The row losses only (evaluation), from the completed statistics.
pub fn vocab_ce_loss_finish(
    targets: &[i32],
    full: usize,
    global_max: &[f32],
    sumexp: &[f32],
    target_logit: &[f32],
    row_losses: &mut [f32],
) -> Result<()> {
    let n = targets.len();
    check_stats(
        "vocab_ce_loss_finish (statistics)",
        n,
        [global_max, sumexp, target_logit],
        row_losses,
    )?;
    check_targets(targets, full)?;
    for (i, l) in row_losses.iter_mut().enumerate() {
        *l = row_loss(targets[i], global_max[i], sumexp[i], target_logit[i]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::cpu::{cross_entropy_fused, embedding_backward, embedding_forward};

    /// Rank `r`'s slice of `full` over `parts` ranks: the first `full % parts` one row longer
    /// (tilearn-parallel's `chunk_range`, which the engines cut the vocabulary with).
    fn slice(full: usize, parts: usize, r: usize) -> VocabSlice {
        let (base, extra) = (full / parts, full % parts);
        let start = r * base + r.min(extra);
        VocabSlice::new(start, base + usize::from(r < extra), full).unwrap()
    }

    fn normal(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    fn rel(a: &[f32], b: &[f32]) -> f64 {
        let num: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
        let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
        (num / den.max(f64::MIN_POSITIVE)).sqrt()
    }

    #[test]
    fn slices_must_be_non_empty_and_inside_the_vocabulary() {
        assert!(VocabSlice::new(0, 0, 10).is_err());
        assert!(VocabSlice::new(8, 3, 10).is_err());
        assert!(VocabSlice::new(11, 1, 10).is_err());
        assert_eq!(VocabSlice::new(7, 3, 10).unwrap().local(9), Some(2));
        assert_eq!(VocabSlice::new(7, 3, 10).unwrap().local(6), None);
        assert_eq!(VocabSlice::whole(5), VocabSlice::new(0, 5, 5).unwrap());
    }

    /// The slices' lookups sum to the whole lookup (every other slice gives zeros), and the
    /// slices' backwards are the whole backward's rows, bit for bit.
    #[test]
    fn embedding_slices_sum_to_the_whole_lookup() {
        let (full, dim, parts) = (11, 5, 3);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let table = normal(&mut rng, full * dim, 1.0);
        let ids: Vec<u32> = (0..17).map(|_| rng.random_range(0..full as u32)).collect();
        let dout = normal(&mut rng, ids.len() * dim, 1.0);
        let mut whole = vec![0.0; ids.len() * dim];
        embedding_forward(&ids, &table, dim, &mut whole).unwrap();
        let mut dwhole = normal(&mut rng, full * dim, 0.1);
        let dstart = dwhole.clone();
        embedding_backward(&ids, &dout, dim, &mut dwhole).unwrap();
        let mut sum = vec![0.0f32; whole.len()];
        for r in 0..parts {
            let s = slice(full, parts, r);
            let rows = s.start * dim..(s.start + s.rows) * dim;
            let mut out = vec![f32::NAN; whole.len()];
            embedding_forward_slice(&ids, &table[rows.clone()], s, dim, &mut out).unwrap();
            sum.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
            let mut dpart = dstart[rows.clone()].to_vec();
            embedding_backward_slice(&ids, &dout, s, dim, &mut dpart).unwrap();
            assert_eq!(dpart, dwhole[rows], "rank {r}'s embedding gradient rows");
        }
        assert_eq!(sum, whole);
        let s = slice(full, parts, 0);
        let mut out = vec![0.0; dim];
        let err = embedding_forward_slice(&[11], &table[..s.rows * dim], s, dim, &mut out);
        assert!(matches!(err, Err(OpsError::TokenOutOfRange { id: 11, .. })));
    }

    /// The vocabulary-parallel cross entropy over uneven slices (the all-reduces done here:
    /// max, then sums) gives the whole-vocabulary op's row losses and gradient columns, to f32
    /// rounding (the sum of exponentials is added in another order): bound 1e-5 relative.
    #[test]
    fn sliced_cross_entropy_matches_the_whole_vocabulary() {
        let (full, n, parts, grad_scale) = (37, 9, 3, 0.125f32);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let logits = normal(&mut rng, n * full, 6.0);
        let mut targets: Vec<i32> = (0..n).map(|_| rng.random_range(0..full as i32)).collect();
        targets[4] = IGNORE_INDEX;
        targets[6] = (full - 1) as i32;
        let mut whole_grad = logits.clone();
        let stats =
            cross_entropy_fused(&mut whole_grad, &targets, full, f64::from(grad_scale)).unwrap();

        let slices: Vec<VocabSlice> = (0..parts).map(|r| slice(full, parts, r)).collect();
        let columns = |s: &VocabSlice| -> Vec<f32> {
            logits
                .chunks(full)
                .flat_map(|row| row[s.start..s.start + s.rows].to_vec())
                .collect()
        };
        let mut local: Vec<[Vec<f32>; 3]> = Vec::new();
        for s in &slices {
            let mut st = [vec![0.0; n], vec![0.0; n], vec![0.0; n]];
            let [m, e, t] = &mut st;
            vocab_ce_partials(&columns(s), &targets, *s, m, e, t).unwrap();
            local.push(st);
        }
        let global_max: Vec<f32> = (0..n)
            .map(|i| local.iter().map(|st| st[0][i]).fold(f32::MIN, f32::max))
            .collect();
        let (mut sumexp, mut target_logit) = (vec![0.0f32; n], vec![0.0f32; n]);
        for st in &mut local {
            let [m, e, t] = st;
            vocab_ce_rescale(m, &global_max, e).unwrap();
            sumexp.iter_mut().zip(e.iter()).for_each(|(a, b)| *a += b);
            target_logit
                .iter_mut()
                .zip(t.iter())
                .for_each(|(a, b)| *a += b);
        }
        let mut losses = vec![0.0f32; n];
        vocab_ce_loss_finish(
            &targets,
            full,
            &global_max,
            &sumexp,
            &target_logit,
            &mut losses,
        )
        .unwrap();
        let total: f64 = losses.iter().map(|&l| f64::from(l)).sum();
        assert!((total - stats.loss_sum).abs() <= 1e-5 * stats.loss_sum.abs());
        assert_eq!(losses[4], 0.0);
        for s in &slices {
            let mut grad = columns(s);
            let mut fused_losses = vec![f32::NAN; n];
            vocab_ce_fused_finish(
                &mut grad,
                &targets,
                *s,
                &global_max,
                &sumexp,
                &target_logit,
                grad_scale,
                &mut fused_losses,
            )
            .unwrap();
            assert_eq!(
                fused_losses, losses,
                "every rank computes the same row losses"
            );
            let expected: Vec<f32> = whole_grad
                .chunks(full)
                .flat_map(|row| row[s.start..s.start + s.rows].to_vec())
                .collect();
            let err = rel(&grad, &expected);
            assert!(err <= 1e-5, "slice {s:?}: gradient rel err {err}");
        }
    }

    #[test]
    fn out_of_range_targets_are_refused() {
        let s = slice(10, 2, 1);
        let mut st = [vec![0.0; 1], vec![0.0; 1], vec![0.0; 1]];
        let [m, e, t] = &mut st;
        let err = vocab_ce_partials(&[0.0; 5], &[10], s, m, e, t);
        assert!(matches!(
            err,
            Err(OpsError::LabelOutOfRange { label: 10, .. })
        ));
    }
}
