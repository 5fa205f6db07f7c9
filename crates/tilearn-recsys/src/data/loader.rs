//! Batches for training: a seeded shuffle of the sample order per epoch, cut into batches that
//! a background thread assembles ahead of the training step (a bounded channel of
//! [`Prefetcher::DEPTH`] batches).

use std::sync::Arc;
use std::sync::mpsc::{Receiver, sync_channel};
use std::thread::JoinHandle;

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::batch::CtrBatch;

/// The sample order of `epoch`: a permutation seeded by `seed + epoch`.
pub fn epoch_order(samples: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..samples).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed.wrapping_add(epoch)));
    order
}

/// The samples `order` of `data`, as one batch.
pub fn gather(data: &CtrBatch, order: &[usize]) -> CtrBatch {
    let (nd, nf) = (data.num_dense, data.num_fields);
    let mut out = CtrBatch::new(nd, nf);
    out.labels.reserve(order.len());
    out.dense.reserve(order.len() * nd);
    out.cats.reserve(order.len() * nf);
    for &i in order {
        out.labels.push(data.labels[i]);
        out.dense
            .extend_from_slice(&data.dense[i * nd..(i + 1) * nd]);
        out.cats.extend_from_slice(&data.cats[i * nf..(i + 1) * nf]);
    }
    out
}

/// Yields `steps` batches of `batch_size` samples (the last batch of an epoch may be smaller),
/// epoch after epoch, built on a background thread.
pub struct Prefetcher {
    receiver: Receiver<CtrBatch>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher").finish_non_exhaustive()
    }
}

impl Prefetcher {
    pub const DEPTH: usize = 4;

    pub fn new(data: Arc<CtrBatch>, batch_size: usize, steps: usize, seed: u64) -> Self {
        Self::starting_at(data, batch_size, steps, seed, 0)
    }

    /// The same sequence of batches as [`Prefetcher::new`] from batch `first` (0-based) on:
    /// what a resumed run reads after `first` steps. The batch order depends only on the seed,
    /// the number of samples and the batch size, so no skipped batch is built.
    pub fn starting_at(
        data: Arc<CtrBatch>,
        batch_size: usize,
        steps: usize,
        seed: u64,
        first: usize,
    ) -> Self {
        let (sender, receiver) = sync_channel(Self::DEPTH);
        let batch_size = batch_size.max(1);
        let worker = std::thread::spawn(move || {
            let per_epoch = data.len().div_ceil(batch_size).max(1);
            let mut epoch = (first / per_epoch) as u64;
            let (mut skip, mut produced) = (first % per_epoch, first);
            while produced < steps && !data.is_empty() {
                let order = epoch_order(data.len(), seed, epoch);
                for chunk in order.chunks(batch_size).skip(skip) {
                    if produced == steps || sender.send(gather(&data, chunk)).is_err() {
                        return;
                    }
                    produced += 1;
                }
                (skip, epoch) = (0, epoch + 1);
            }
        });
        Prefetcher {
            receiver,
            worker: Some(worker),
        }
    }
}

impl Iterator for Prefetcher {
    type Item = CtrBatch;
    fn next(&mut self) -> Option<CtrBatch> {
        self.receiver.recv().ok()
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Unblock a worker waiting on a full channel, then wait for it.
        let (_, dead) = sync_channel(0);
        drop(std::mem::replace(&mut self.receiver, dead));
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
