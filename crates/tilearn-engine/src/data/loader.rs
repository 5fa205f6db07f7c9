//! The training data loader: fixed-length windows of the token stream, shuffled per epoch,
//! batched and prefetched on a background thread.
//!
//! * Windows (rows): the stream (documents each followed by EOS, all shards in order) is cut
//!   into non-overlapping windows of `seq_len` tokens starting at 0, like Hugging Face's
//!   `group_texts`; the tail shorter than `seq_len` is dropped. A fine-tuning dataset (the
//!   `examples` layout) has one row per example instead, truncated and padded to `seq_len`
//!   ([`TokenDataset::read_row`]), and a `packed` one a row per packed row of examples, with
//!   position ids ([`Batch::positions`]); everything below treats all three the same.
//! * Order: each epoch visits the windows in a permutation drawn by Fisher–Yates from a ChaCha8
//!   generator seeded with `seed + epoch` (wrapping), the convention of PyTorch's
//!   `DistributedSampler`. Windows that do not fill a whole global batch at the end of an epoch
//!   are skipped for that epoch (a different set each epoch).
//! * Data parallelism: with `world_size` ranks a global batch holds `world_size × batch_size`
//!   windows and rank `r` takes the `r`-th run of `batch_size`; all ranks use the same seed and
//!   therefore the same permutation.
//! * Batches: `input_ids` is `batch × seq_len` row-major; `labels` are the same ids as `i32`
//!   (the model shifts them, Hugging Face style), -100 where a fine-tuning example masks a
//!   token out of the loss (prompt, padding).
//! * Position: [`LoaderState`] `(epoch, batch_index)` names the next batch. A loader started at a
//!   saved state yields exactly the batches an uninterrupted run would have yielded from there.

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{Receiver, Sender, bounded};
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::dataset::TokenDataset;
use super::format::RowLayout;
use crate::error::{EngineError, Result};

/// Default number of batches prepared ahead of the trainer.
pub const DEFAULT_PREFETCH: usize = 4;

/// Position of the next batch: part of the training state so resume is exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct LoaderState {
    /// Epoch of the next batch (0-based).
    pub epoch: u64,
    /// Index of the next batch within its epoch (0-based).
    pub batch_index: u64,
}

/// One batch of training windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// `batch × seq_len` token ids, row-major.
    pub input_ids: Vec<u32>,
    /// The same ids as `i32`, or -100 (`IGNORE_INDEX`) for tokens that are not targets
    /// (prompt and padding of fine-tuning examples); the model shifts them for next-token
    /// prediction.
    pub labels: Vec<i32>,
    /// Position ids `batch × seq_len` of packed rows (restarting at 0 for each example; the
    /// model must keep every example's attention inside it), `None` when every row is one
    /// sequence (positions `0..seq_len`).
    pub positions: Option<Vec<i32>>,
    /// Rows.
    pub batch: usize,
    /// Tokens per row.
    pub seq_len: usize,
}

/// How to cut and order the windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderOptions {
    /// Windows per batch on this rank.
    pub batch_size: usize,
    /// Tokens per window.
    pub seq_len: usize,
    /// Shuffle seed (epoch `e` uses `seed + e`).
    pub seed: u64,
    /// Position of the first batch to yield.
    pub start: LoaderState,
    /// This rank in data parallelism (0 when alone).
    pub rank: usize,
    /// Number of data-parallel ranks (1 when alone).
    pub world_size: usize,
    /// Batches prepared ahead (at least 1).
    pub prefetch: usize,
    /// Use only the first this many windows of the stream (the rest is held out for
    /// evaluation, `--validation-split-percentage`); `None`: all of them.
    pub windows: Option<usize>,
}

impl LoaderOptions {
    /// Single rank, starting at the beginning, [`DEFAULT_PREFETCH`] batches ahead.
    pub fn new(batch_size: usize, seq_len: usize, seed: u64) -> Self {
        LoaderOptions {
            batch_size,
            seq_len,
            seed,
            start: LoaderState::default(),
            rank: 0,
            world_size: 1,
            prefetch: DEFAULT_PREFETCH,
            windows: None,
        }
    }

    /// The same options starting at `start`.
    pub fn starting_at(mut self, start: LoaderState) -> Self {
        self.start = start;
        self
    }
}

/// Code run once on the loader's worker thread before it produces the first batch (e.g. to pin
/// the thread to CPUs near the GPU).
pub type WorkerHook = Box<dyn FnOnce() + Send + 'static>;

/// The fixed facts of a loader, shared with its worker.
#[derive(Debug, Clone, Copy)]
struct Plan {
    batch_size: usize,
    seq_len: usize,
    seed: u64,
    rank: usize,
    world_size: usize,
    num_windows: usize,
    batches_per_epoch: u64,
}

impl Plan {
    fn permutation(&self, epoch: u64) -> Vec<u32> {
        window_order(self.seed, epoch, self.num_windows)
    }

    fn make_batch(&self, dataset: &TokenDataset, order: &[u32], batch_index: u64) -> Batch {
        let (b, t) = (self.batch_size, self.seq_len);
        let global = b * self.world_size;
        let first = batch_index as usize * global + self.rank * b;
        let mut input_ids = vec![0u32; b * t];
        let mut labels = vec![0i32; b * t];
        let mut positions = dataset.has_positions().then(|| vec![0i32; b * t]);
        let mut pos_rows = positions.as_mut().map(|p| p.chunks_mut(t));
        let rows = input_ids.chunks_mut(t).zip(labels.chunks_mut(t));
        for (&window, (ids, row_labels)) in order[first..first + b].iter().zip(rows) {
            let pos = pos_rows.as_mut().and_then(|p| p.next());
            dataset
                .read_row_at(window as usize, ids, row_labels, pos)
                .expect("every row index is below the dataset's row count");
        }
        Batch {
            input_ids,
            labels,
            positions,
            batch: b,
            seq_len: t,
        }
    }
}

/// The order in which epoch `epoch` visits `num_windows` windows: a Fisher–Yates permutation
/// from ChaCha8 seeded with `seed + epoch`.
pub fn window_order(seed: u64, epoch: u64, num_windows: usize) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(epoch));
    let mut order: Vec<u32> = (0..num_windows as u32).collect();
    for i in (1..num_windows).rev() {
        // Multiply-shift bounded integer; its bias (< n / 2^64) is irrelevant for shuffling.
        let j = ((u128::from(rng.next_u64()) * (i as u128 + 1)) >> 64) as usize;
        order.swap(i, j);
    }
    order
}

/// Yields training batches forever (epoch after epoch); see the module documentation.
///
/// Dropping the loader stops and joins its worker thread.
#[derive(Debug)]
pub struct DataLoader {
    dataset: Arc<TokenDataset>,
    plan: Plan,
    next: LoaderState,
    rx: Option<Receiver<(LoaderState, Batch)>>,
    worker: Option<JoinHandle<()>>,
}

impl DataLoader {
    /// A single-rank loader over `dataset` yielding `batch_size × seq_len` batches from
    /// position `start`, shuffled with `seed`, with [`DEFAULT_PREFETCH`] batches prefetched.
    pub fn new(
        dataset: impl Into<Arc<TokenDataset>>,
        batch_size: usize,
        seq_len: usize,
        seed: u64,
        start: LoaderState,
    ) -> Result<Self> {
        let options = LoaderOptions::new(batch_size, seq_len, seed).starting_at(start);
        Self::with_options(dataset, options, None)
    }

    /// A loader with all options; its worker thread runs `hook` (if any) before the first
    /// batch.
    pub fn with_options(
        dataset: impl Into<Arc<TokenDataset>>,
        options: LoaderOptions,
        hook: Option<WorkerHook>,
    ) -> Result<Self> {
        let dataset = dataset.into();
        let plan = plan(&dataset, &options)?;
        let (tx, rx) = bounded(options.prefetch.max(1));
        let worker_dataset = Arc::clone(&dataset);
        let start = options.start;
        let worker = std::thread::Builder::new()
            .name("tilearn-data-loader".into())
            .spawn(move || run_worker(&worker_dataset, plan, start, tx, hook))
            .map_err(|e| EngineError::io(dataset.dir(), "spawn data loader thread", e))?;
        Ok(DataLoader {
            dataset,
            plan,
            next: start,
            rx: Some(rx),
            worker: Some(worker),
        })
    }

    /// Position of the batch the next call to [`DataLoader::next_batch`] returns.
    pub fn state(&self) -> LoaderState {
        self.next
    }

    /// Batches in one epoch on this rank.
    pub fn batches_per_epoch(&self) -> u64 {
        self.plan.batches_per_epoch
    }

    /// Windows of `seq_len` tokens in the stream.
    pub fn num_windows(&self) -> usize {
        self.plan.num_windows
    }

    /// Windows per batch.
    pub fn batch_size(&self) -> usize {
        self.plan.batch_size
    }

    /// Tokens per window.
    pub fn seq_len(&self) -> usize {
        self.plan.seq_len
    }

    /// The dataset read.
    pub fn dataset(&self) -> &Arc<TokenDataset> {
        &self.dataset
    }

    /// The next batch. Fails only if the worker thread died (its hook panicked).
    pub fn next_batch(&mut self) -> Result<Batch> {
        let received = self.rx.as_ref().and_then(|rx| rx.recv().ok());
        let Some((state, batch)) = received else {
            return Err(EngineError::Data {
                file: self.dataset.dir().to_path_buf(),
                message: "the data loader's worker thread stopped unexpectedly (did its start \
                          hook panic?); see the message printed above"
                    .into(),
            });
        };
        debug_assert_eq!(state, self.next, "loader worker out of step");
        self.next = advance(state, self.plan.batches_per_epoch);
        Ok(batch)
    }
}

impl Iterator for DataLoader {
    type Item = Result<Batch>;

    /// Never `None`: the loader cycles through epochs.
    fn next(&mut self) -> Option<Result<Batch>> {
        Some(self.next_batch())
    }
}

impl Drop for DataLoader {
    fn drop(&mut self) {
        // Disconnecting the channel makes the worker's next (or current, blocked) send fail,
        // which ends its loop; then wait for it so no thread outlives the loader.
        drop(self.rx.take());
        if let Some(worker) = self.worker.take() {
            // A panicked worker already reported through `next_batch`; do not panic in drop.
            let _ = worker.join();
        }
    }
}

fn advance(state: LoaderState, batches_per_epoch: u64) -> LoaderState {
    if state.batch_index + 1 >= batches_per_epoch {
        LoaderState {
            epoch: state.epoch + 1,
            batch_index: 0,
        }
    } else {
        LoaderState {
            epoch: state.epoch,
            batch_index: state.batch_index + 1,
        }
    }
}

fn plan(dataset: &TokenDataset, o: &LoaderOptions) -> Result<Plan> {
    let invalid = |argument: &str, message: String| EngineError::InvalidArgument {
        argument: argument.into(),
        message,
    };
    if o.seq_len == 0 {
        return Err(invalid("--seq-len", "must be at least 1".into()));
    }
    if o.batch_size == 0 {
        return Err(invalid(
            "--per-device-train-batch-size",
            "must be at least 1".into(),
        ));
    }
    if o.world_size == 0 || o.rank >= o.world_size {
        return Err(invalid(
            "rank",
            format!(
                "rank {} is not below the data-parallel world size {}",
                o.rank, o.world_size
            ),
        ));
    }
    let num_windows = dataset
        .num_rows(o.seq_len)
        .min(o.windows.unwrap_or(usize::MAX));
    let global = o.batch_size.saturating_mul(o.world_size);
    if num_windows < global {
        let shape = if o.world_size == 1 {
            format!("{}×{}", o.batch_size, o.seq_len)
        } else {
            format!(
                "{}×{}×{} (ranks × batch × sequence)",
                o.world_size, o.batch_size, o.seq_len
            )
        };
        return Err(EngineError::Data {
            file: dataset.dir().to_path_buf(),
            message: match dataset.layout() {
                RowLayout::Stream => format!(
                    "dataset has {} tokens, fewer than one batch of {shape}; lower \
                     --per-device-train-batch-size or --seq-len",
                    dataset.num_tokens()
                ),
                RowLayout::Examples => format!(
                    "dataset has {num_windows} examples (one per row), fewer than one batch of \
                     {shape}; lower --per-device-train-batch-size or add examples"
                ),
                RowLayout::Packed => format!(
                    "dataset has {num_windows} packed rows, fewer than one batch of {shape}; \
                     lower --per-device-train-batch-size or add examples"
                ),
            },
        });
    }
    if num_windows > u32::MAX as usize {
        return Err(invalid(
            "--seq-len",
            format!("{num_windows} windows are more than this loader indexes; raise --seq-len"),
        ));
    }
    let batches_per_epoch = (num_windows / global) as u64;
    if o.start.batch_index >= batches_per_epoch {
        return Err(invalid(
            "resume state",
            format!(
                "batch index {} is beyond the {batches_per_epoch} batches of an epoch; the \
                 dataset, batch size or sequence length changed since the checkpoint",
                o.start.batch_index
            ),
        ));
    }
    Ok(Plan {
        batch_size: o.batch_size,
        seq_len: o.seq_len,
        seed: o.seed,
        rank: o.rank,
        world_size: o.world_size,
        num_windows,
        batches_per_epoch,
    })
}

fn run_worker(
    dataset: &TokenDataset,
    plan: Plan,
    start: LoaderState,
    tx: Sender<(LoaderState, Batch)>,
    hook: Option<WorkerHook>,
) {
    if let Some(hook) = hook {
        hook();
    }
    let mut state = start;
    let mut order = plan.permutation(state.epoch);
    loop {
        let batch = plan.make_batch(dataset, &order, state.batch_index);
        if tx.send((state, batch)).is_err() {
            return; // the loader was dropped
        }
        let next = advance(state, plan.batches_per_epoch);
        if next.epoch != state.epoch {
            order = plan.permutation(next.epoch);
        }
        state = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_order_is_a_seeded_permutation() {
        let a = window_order(3, 0, 1000);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<u32>>());
        assert_eq!(a, window_order(3, 0, 1000));
        assert_ne!(a, window_order(3, 1, 1000));
        assert_ne!(a, (0..1000).collect::<Vec<u32>>());
        assert!(window_order(3, 0, 0).is_empty());
        assert_eq!(window_order(3, 0, 1), vec![0]);
    }

    #[test]
    fn advance_wraps_epochs() {
        let s = LoaderState {
            epoch: 2,
            batch_index: 4,
        };
        assert_eq!(
            advance(s, 5),
            LoaderState {
                epoch: 3,
                batch_index: 0
            }
        );
        assert_eq!(
            advance(s, 6),
            LoaderState {
                epoch: 2,
                batch_index: 5
            }
        );
    }
}
