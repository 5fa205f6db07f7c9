//! Evaluation during training: the mean token loss of a held-out token dataset with the
//! forward only.
//!
//! The eval set is cut into rows like the training data (windows of `seq_len` tokens, the
//! short tail dropped; or one padded example per row for fine-tuning data, whose masked tokens
//! are not scored) and visited in order, unshuffled. With data parallelism global batch `g` holds
//! `world_size × eval_batch` windows and rank `r` takes its `r`-th run (the last global batch
//! may leave some ranks fewer rows or none); the ranks' loss sums and target counts are summed
//! so every rank gets the same mean.

use std::sync::Arc;

use tilearn_ops::DType;

use super::backend::StepBackend;
use super::data_parallel::DataParallel;
use crate::data::{Batch, TokenDataset};
use crate::{EngineError, Result};

/// A prepared token dataset to evaluate on, checked against the run.
pub struct EvalSet {
    dataset: Arc<TokenDataset>,
    seq_len: usize,
    /// The set's windows are `first_window..first_window + num_windows` of the dataset.
    first_window: usize,
    num_windows: usize,
}

/// The windows `[start, end)` rank `rank` of `world` evaluates in global batch `g` of a set
/// of `num_windows` (empty past the end).
fn rank_windows(
    num_windows: usize,
    g: usize,
    batch: usize,
    rank: usize,
    world: usize,
) -> (usize, usize) {
    let start = (g * world + rank) * batch;
    let end = (start + batch).min(num_windows);
    (start.min(end), end)
}

/// The result of one evaluation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalLoss {
    /// Mean token loss over every target of the evaluated windows (all ranks).
    pub mean: f64,
    /// Targets the mean is over.
    pub tokens: u64,
}

impl EvalSet {
    /// `dataset` for a model of `vocab_size` tokens trained on windows of `seq_len`; errors
    /// (naming `--eval-data` and the directory) when its tokenizer is larger than the model's
    /// vocabulary or it holds less than one window.
    pub fn new(dataset: TokenDataset, vocab_size: usize, seq_len: usize) -> Result<EvalSet> {
        let bad = |message: String| EngineError::InvalidArgument {
            argument: "--eval-data".into(),
            message: format!("{}: {message}", dataset.dir().display()),
        };
        if dataset.vocab_size() > vocab_size {
            return Err(bad(format!(
                "its tokenizer has {} tokens but the model's vocab_size is {vocab_size}; \
                 prepare the eval data with the model's tokenizer",
                dataset.vocab_size()
            )));
        }
        let num_windows = dataset.num_rows(seq_len);
        if num_windows == 0 {
            return Err(bad(format!(
                "holds {} tokens, less than one window of --seq-len {seq_len}; use more eval \
                 data or a shorter --seq-len",
                dataset.num_tokens()
            )));
        }
        Ok(EvalSet {
            dataset: Arc::new(dataset),
            seq_len,
            first_window: 0,
            num_windows,
        })
    }

    /// The last `percentage` % of the training data's `seq_len` windows, held out from
    /// training (`--validation-split-percentage`); returns the set and the windows left to
    /// train on. Errors when either part would be empty.
    pub fn held_out(
        dataset: Arc<TokenDataset>,
        seq_len: usize,
        percentage: f64,
    ) -> Result<(EvalSet, usize)> {
        let total = dataset.num_rows(seq_len);
        let held = (total as f64 * percentage / 100.0).floor() as usize;
        if !(percentage > 0.0 && percentage < 100.0) || held == 0 || held >= total {
            return Err(EngineError::InvalidArgument {
                argument: "--validation-split-percentage".into(),
                message: format!(
                    "{percentage}% of the {total} windows of --seq-len {seq_len} in {} leaves \
                     {held} to evaluate and {} to train on; both need at least one (use a \
                     percentage between 0 and 100, more data, or --eval-data)",
                    dataset.dir().display(),
                    total.saturating_sub(held)
                ),
            });
        }
        let train = total - held;
        let set = EvalSet {
            dataset,
            seq_len,
            first_window: train,
            num_windows: held,
        };
        Ok((set, train))
    }

    /// Windows of `seq_len` tokens in the set.
    pub fn num_windows(&self) -> usize {
        self.num_windows
    }

    fn batch(&self, windows: (usize, usize)) -> Result<Batch> {
        let t = self.seq_len;
        let rows = windows.1 - windows.0;
        let mut input_ids = vec![0u32; rows * t];
        let mut labels = vec![0i32; rows * t];
        let mut positions = self.dataset.has_positions().then(|| vec![0i32; rows * t]);
        let mut pos_rows = positions.as_mut().map(|p| p.chunks_mut(t));
        let out = input_ids.chunks_mut(t).zip(labels.chunks_mut(t));
        for (row, (ids, row_labels)) in out.enumerate() {
            let pos = pos_rows.as_mut().and_then(|p| p.next());
            self.dataset
                .read_row_at(self.first_window + windows.0 + row, ids, row_labels, pos)?;
        }
        Ok(Batch {
            input_ids,
            labels,
            positions,
            batch: rows,
            seq_len: t,
        })
    }

    /// The mean token loss of the set (at most `max_batches` global batches of `batch`
    /// windows per rank) on `backend`'s current weights in `precision`; every rank of `dp`
    /// must call it and gets the same result.
    pub fn evaluate(
        &self,
        backend: &mut dyn StepBackend,
        dp: &DataParallel,
        batch: usize,
        max_batches: Option<u64>,
        precision: DType,
    ) -> Result<EvalLoss> {
        let (rank, world) = (dp.rank(), dp.world_size());
        let mut global_batches = self.num_windows.div_ceil(batch * world);
        if let Some(cap) = max_batches {
            global_batches = global_batches.min(usize::try_from(cap).unwrap_or(usize::MAX));
        }
        let (mut loss_sum, mut tokens) = (0.0f64, 0u64);
        for g in 0..global_batches {
            let windows = rank_windows(self.num_windows, g, batch, rank, world);
            if windows.0 == windows.1 {
                continue;
            }
            let stats = backend.eval_loss(&self.batch(windows)?, precision)?;
            loss_sum += stats.loss_sum;
            tokens += stats.valid_tokens as u64;
        }
        let tokens = dp.sum_count(tokens)?;
        let loss_sum = dp.sum_f64(loss_sum)?;
        Ok(EvalLoss {
            mean: loss_sum / tokens.max(1) as f64,
            tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_split_each_global_batch_and_cover_every_window_once() {
        let set_windows = 11usize;
        let (batch, world) = (2, 3);
        let mut seen = Vec::new();
        for g in 0..set_windows.div_ceil(batch * world) {
            for rank in 0..world {
                let (start, end) = rank_windows(set_windows, g, batch, rank, world);
                seen.extend(start..end);
            }
        }
        assert_eq!(seen, (0..set_windows).collect::<Vec<_>>());
    }
}
