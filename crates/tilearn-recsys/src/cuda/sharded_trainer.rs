//! DeepFM / Wide & Deep sharded over GPU ranks (`tilearn launch --nproc-per-node N ctr train
//! --device cuda`): the CPU's [`crate::shard::ShardedCtrTrainer`] with every table shard, its
//! optimizer state, the pooled embeddings and the dense part on the rank's GPU.
//!
//! A step on rank r (its part of the global batch of n samples, as on the CPU):
//! 1. ids to their rows' owners over the *host* communicator (`shard_batch`): the loader
//!    builds them on the host and the owner checks them there (the kernels trust checked
//!    ids), so they would only make a round trip through the device;
//! 2. the owner's fused forward on its shard (`DeviceEmbeddingBag`) for every rank's samples;
//!    rank r' gets its rows by one all-to-all of *device* buffers (slots padded to the longest
//!    message, whose length every rank knows from the sample counts and the plan), and
//!    `row_copy.cu` places them in the `[batch, total_dim]` pooled embeddings
//!    (`shard::columns`: round 0 copied, row-wise tables' later partial sums added by
//!    tilearn-ops' residual add — the CPU's order of the same sums);
//! 3. the head forward / backward on the device with d loss / d logit scaled by 1 / n, the
//!    dense gradient all-reduced on the device, the loss sum (8 bytes, as three f32 parts:
//!    `exchange::split_f64`) over the host;
//! 4. the output gradient's columns to their owners by a second device all-to-all, and the
//!    owner's fused backward + sparse rule over every rank's samples in rank order.
//!
//! The device communicator is NCCL (one GPU per rank) or the host communicator staging device
//! buffers through pinned memory (ranks sharing a GPU, tests). Checkpoints are the CPU sharded
//! trainer's: the shards are downloaded into a host [`ShardedEmbeddingBag`] and gathered
//! (`host`), so a checkpoint loads on the CPU, one GPU or another world size.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use tilearn_parallel::{Communicator, ReduceOp};

use super::ctr_model::DeviceCtrModel;
use super::embedding_bag::{DeviceEmbeddingBag, DeviceJaggedBatch};
use super::row_copy::{copy_on_device, upload_words};
use crate::data::CtrBatch;
use crate::error::{RecsysError, Result};
use crate::jagged::JaggedBatch;
use crate::model::{CtrConfig, CtrModel, StepStats};
use crate::shard::columns::{Copy, assemble_rounds, scatter_copies};
use crate::shard::exchange::{exchange_u32, join_f64, split_f64};
use crate::shard::sharded_bag::{route_ids, shard_batch};
use crate::shard::{ShardPlan, ShardedEmbeddingBag};
use crate::stepper::CtrStepper;

fn driver(context: &'static str) -> impl Fn(cudarc::driver::DriverError) -> RecsysError {
    move |e| {
        RecsysError::Ops(tilearn_ops::OpsError::Cuda {
            context,
            message: e.to_string(),
        })
    }
}

fn comm_error(e: tilearn_parallel::ParallelError) -> RecsysError {
    RecsysError::invalid("sharded GPU training", e.to_string())
}

/// A device buffer of at least `len` f32 (grown, never shrunk; the driver refuses empty ones).
fn fit(stream: &Arc<CudaStream>, buf: &mut CudaSlice<f32>, len: usize) -> Result<()> {
    if buf.len() < len {
        *buf = (stream.alloc_zeros::<f32>(len.max(1))).map_err(driver("sharded buffers"))?;
    }
    Ok(())
}

/// The copy lists of one set of per-rank sample counts, uploaded: the forward's rounds and
/// the backward's scatter, as ranges of 3-word copies in `words`.
#[derive(Debug)]
struct Placement {
    samples: Vec<usize>,
    words: CudaSlice<u64>,
    rounds: Vec<Range<usize>>,
    scatter: Range<usize>,
}

/// What a forward leaves for the backward.
struct Lookup {
    samples: Vec<usize>,
    shard_batch: Option<DeviceJaggedBatch>,
    /// Elements per all-to-all slot.
    slot: usize,
}

/// One GPU rank of a sharded CTR model.
pub struct GpuShardedCtrTrainer {
    host_comm: Arc<dyn Communicator>,
    device_comm: Arc<dyn Communicator>,
    stream: Arc<CudaStream>,
    /// Config, dense parameters and AdamW (stale on the host until [`CtrStepper::host`]).
    model: CtrModel,
    /// The host copy of this rank's shard, refreshed from the device for a gather.
    bag: ShardedEmbeddingBag,
    shard: Option<DeviceEmbeddingBag>,
    dense: DeviceCtrModel,
    /// The owner's pooled rows `[all ranks' samples, shard width]`, and their gradient.
    pooled: CudaSlice<f32>,
    shard_dout: CudaSlice<f32>,
    /// The all-to-all buffer (`world` slots, exchanged in place).
    exchange: CudaSlice<f32>,
    /// Later rounds of row-wise partial sums, `[batch, total_dim]`.
    partial: CudaSlice<f32>,
    /// Copy lists of the last few sample splits (training's and evaluation's).
    placements: Vec<Placement>,
    host_current: bool,
}

impl std::fmt::Debug for GpuShardedCtrTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuShardedCtrTrainer")
            .field("rank", &self.host_comm.rank())
            .field("world", &self.host_comm.world_size())
            .field("device_backend", &self.device_comm.backend())
            .field("plan", self.bag.plan())
            .finish()
    }
}

impl GpuShardedCtrTrainer {
    /// This rank's part of `model` (the same model on every rank: freshly initialised with the
    /// same config and seed, or read from the same checkpoint) placed by `plan`, on the device
    /// of `stream`. `host_comm` carries host buffers (ids, scalars, checkpoint gathers),
    /// `device_comm` device buffers (NCCL, or the host communicator with its staging stream
    /// set); both span the same ranks in the same order.
    pub fn new(
        host_comm: Arc<dyn Communicator>,
        device_comm: Arc<dyn Communicator>,
        stream: &Arc<CudaStream>,
        mut model: CtrModel,
        plan: ShardPlan,
    ) -> Result<Self> {
        let world = host_comm.world_size();
        if plan.world() != world
            || device_comm.world_size() != world
            || device_comm.rank() != host_comm.rank()
            || *plan.layout() != model.tables.layout
        {
            return Err(RecsysError::invalid(
                "sharded GPU training",
                format!(
                    "a plan for {} ranks, communicators of {world} (rank {}) and {} (rank {}) \
                     ranks; give one plan of the model's tables and two communicators of the \
                     same ranks",
                    plan.world(),
                    host_comm.rank(),
                    device_comm.world_size(),
                    device_comm.rank()
                ),
            ));
        }
        let bag = ShardedEmbeddingBag::from_full_state(
            plan,
            host_comm.rank(),
            &model.tables,
            &model.sparse,
        )?;
        let shard = match bag.shard() {
            Some((tables, state)) => Some(DeviceEmbeddingBag::new(stream, tables, state)?),
            None => None,
        };
        let dense = DeviceCtrModel::dense_part(stream, &model)?;
        model.tables.weights = Vec::new();
        let empty = || {
            stream
                .alloc_zeros::<f32>(1)
                .map_err(driver("sharded buffers"))
        };
        Ok(GpuShardedCtrTrainer {
            pooled: empty()?,
            shard_dout: empty()?,
            exchange: empty()?,
            partial: empty()?,
            placements: Vec::new(),
            host_comm,
            device_comm,
            stream: stream.clone(),
            model,
            bag,
            shard,
            dense,
            host_current: false,
        })
    }

    pub fn plan(&self) -> &ShardPlan {
        self.bag.plan()
    }

    /// The dense part on the device (e.g. to run its MLP in bf16).
    pub fn dense(&mut self) -> &mut DeviceCtrModel {
        &mut self.dense
    }

    /// This rank's samples of a global batch of `n`.
    fn local(&self, n: usize) -> Range<usize> {
        let (r, world) = (self.host_comm.rank(), self.host_comm.world_size());
        r * n / world..(r + 1) * n / world
    }

    /// The index in `placements` of the copy lists for `samples`, built and uploaded on first
    /// use (at most four kept).
    fn placement(&mut self, samples: &[usize], slot: usize) -> Result<usize> {
        if let Some(i) = self.placements.iter().position(|p| p.samples == samples) {
            return Ok(i);
        }
        let plan = self.bag.plan();
        let world = plan.world();
        let b = samples[self.host_comm.rank()];
        let bases: Vec<usize> = (0..world).map(|d| d * slot).collect();
        let rounds = assemble_rounds(plan, b, &bases);
        let scatter = scatter_copies(plan, b, &bases);
        let mut words: Vec<u64> = Vec::new();
        let mut push = |copies: &[Copy]| {
            let start = words.len() / 3;
            words.extend(copies.iter().flatten());
            start..words.len() / 3
        };
        let round_ranges: Vec<Range<usize>> = rounds.iter().map(|r| push(r)).collect();
        let scatter_range = push(&scatter);
        let mut device = (self.stream.alloc_zeros::<u64>(words.len().max(1)))
            .map_err(driver("sharded copy lists"))?;
        upload_words(&self.stream, &mut device, &words)?;
        if self.placements.len() == 4 {
            self.placements.remove(0);
        }
        self.placements.push(Placement {
            samples: samples.to_vec(),
            words: device,
            rounds: round_ranges,
            scatter: scatter_range,
        });
        Ok(self.placements.len() - 1)
    }

    fn all_to_all(&mut self, len: usize) -> Result<()> {
        if len == 0 {
            // Every rank computed the same empty exchange.
            return Ok(());
        }
        let view = self.exchange.slice_mut(..len);
        (self.device_comm.all_to_all(view.into()))
            .and_then(|w| w.wait())
            .map_err(comm_error)
    }

    /// Steps 1 and 2 of the lookup for this rank's `local` samples: ids to their owners, the
    /// owner's forward, and its pooled rows exchanged into `exchange` (slot `d` holds owner
    /// `d`'s `[local samples, shard width d]`). Collective; a rank with no samples (an
    /// evaluation chunk smaller than the world) still serves the others.
    fn exchange_pooled(&mut self, local: &CtrBatch) -> Result<Lookup> {
        let jagged: JaggedBatch = self.model.config.jagged(local)?;
        let plan = self.bag.plan().clone();
        let (world, rank) = (plan.world(), self.host_comm.rank());
        let received = exchange_u32(&*self.host_comm, &route_ids(&plan, &jagged))?;
        let shard_layout = self.shard.as_ref().map(|s| s.layout());
        let (samples, batch) = shard_batch(&plan, rank, shard_layout, &received)?;
        let width = plan.shard_width(rank);
        let total: usize = samples.iter().sum();
        // Every rank computes the same slot from the counts and the plan.
        let slot = (0..world)
            .flat_map(|d| samples.iter().map(move |&n| (d, n)))
            .map(|(d, n)| n * plan.shard_width(d))
            .max()
            .unwrap_or(0);
        fit(&self.stream, &mut self.exchange, world * slot)?;
        let stream = self.stream.clone();
        let shard_batch = match (&self.shard, batch) {
            (Some(shard), Some(batch)) => {
                let batch = DeviceJaggedBatch::upload(&stream, shard.layout(), &batch)?;
                fit(&stream, &mut self.pooled, total * width)?;
                shard.forward(&stream, &batch, &mut self.pooled.slice_mut(..total * width))?;
                let mut first = 0;
                for (r, &n) in samples.iter().enumerate() {
                    if n > 0 && width > 0 {
                        let src = self.pooled.slice(first * width..(first + n) * width);
                        let mut dst = self.exchange.slice_mut(r * slot..r * slot + n * width);
                        (stream.memcpy_dtod(&src, &mut dst)).map_err(driver("sharded lookup"))?;
                    }
                    first += n;
                }
                Some(batch)
            }
            _ => None,
        };
        self.all_to_all(world * slot)?;
        Ok(Lookup {
            samples,
            shard_batch,
            slot,
        })
    }

    /// The whole sharded lookup of this rank's `local` samples (>= 1) into the dense part's
    /// pooled embeddings, its features uploaded too. Collective.
    fn lookup(&mut self, local: &CtrBatch) -> Result<Lookup> {
        let lookup = self.exchange_pooled(local)?;
        let (world, b) = (self.bag.plan().world(), local.len());
        let total_dim = self.bag.plan().layout().total_dim();
        self.dense.upload_features(local)?;
        let stream = self.stream.clone();
        let p = self.placement(&lookup.samples, lookup.slot)?;
        let placement = &self.placements[p];
        let received = self.exchange.slice(..(world * lookup.slot).max(1));
        // Round 0 copied; later rounds (row-wise tables' other partial sums) added.
        for (round, range) in placement.rounds.iter().enumerate() {
            let copies = placement
                .words
                .slice(3 * range.start..(3 * range.end).max(1));
            let n = range.len();
            if round == 0 {
                let mut emb = self.dense.emb_mut(b);
                copy_on_device(&stream, &received, &mut emb, &copies, n)?;
            } else {
                fit(&stream, &mut self.partial, b * total_dim)?;
                let mut partial = self.partial.slice_mut(..b * total_dim);
                (stream.memset_zeros(&mut partial)).map_err(driver("sharded lookup"))?;
                copy_on_device(&stream, &received, &mut partial, &copies, n)?;
                let partial = self.partial.slice(..b * total_dim);
                tilearn_ops::cuda::residual_add_inplace(
                    &stream,
                    &mut self.dense.emb_mut(b),
                    &partial,
                )?;
            }
        }
        Ok(lookup)
    }

    /// The output gradient's columns to their owners, and the owner's fused backward + sparse
    /// rule. Collective.
    fn backward(&mut self, lookup: &Lookup, b: usize) -> Result<()> {
        let plan = self.bag.plan().clone();
        let (world, rank) = (plan.world(), self.host_comm.rank());
        let stream = self.stream.clone();
        let slot = lookup.slot;
        let p = self.placement(&lookup.samples, slot)?;
        {
            let placement = &self.placements[p];
            let range = placement.scatter.clone();
            let copies = placement
                .words
                .slice(3 * range.start..(3 * range.end).max(1));
            let demb = self.dense.demb(b);
            let mut exchange = self.exchange.slice_mut(..(world * slot).max(1));
            copy_on_device(&stream, &demb, &mut exchange, &copies, range.len())?;
        }
        self.all_to_all(world * slot)?;
        let width = plan.shard_width(rank);
        if let (Some(shard), Some(batch)) = (&mut self.shard, &lookup.shard_batch) {
            let total: usize = lookup.samples.iter().sum();
            fit(&stream, &mut self.shard_dout, total * width)?;
            let mut first = 0;
            for (r, &n) in lookup.samples.iter().enumerate() {
                if n > 0 && width > 0 {
                    let src = self.exchange.slice(r * slot..r * slot + n * width);
                    let mut dst = (self.shard_dout).slice_mut(first * width..(first + n) * width);
                    (stream.memcpy_dtod(&src, &mut dst)).map_err(driver("sharded backward"))?;
                }
                first += n;
            }
            shard.backward_update(&stream, batch, &self.shard_dout.slice(..total * width))?;
        }
        Ok(())
    }

    /// The trained model, whole, on every rank (collective).
    pub fn into_host(mut self) -> Result<CtrModel> {
        self.host()?;
        Ok(self.model)
    }
}

impl CtrStepper for GpuShardedCtrTrainer {
    fn config(&self) -> &CtrConfig {
        &self.model.config
    }

    fn step(
        &mut self,
        batch: &CtrBatch,
        _jagged: &JaggedBatch,
        dense_lr: f32,
    ) -> Result<StepStats> {
        self.model.check_batch(batch)?;
        let n = batch.len();
        if n < self.host_comm.world_size() {
            return Err(RecsysError::invalid(
                "--batch-size",
                format!(
                    "a global batch of {n} samples for {} ranks; each rank needs >= 1 sample",
                    self.host_comm.world_size()
                ),
            ));
        }
        self.host_current = false;
        let local = batch.slice(self.local(n));
        let lookup = self.lookup(&local)?;
        let b = local.len();
        self.dense.head_forward_backward(b, 1.0 / n as f32)?;
        (self
            .device_comm
            .all_reduce(self.dense.grads_mut().into(), ReduceOp::Sum))
        .and_then(|w| w.wait())
        .map_err(comm_error)?;
        // The loss sum as three f32 parts (exact for one rank), as the CPU ranks reduce it.
        let mut loss = split_f64(self.dense.loss_sum()?);
        (self
            .host_comm
            .all_reduce((&mut loss[..]).into(), ReduceOp::Sum))
        .and_then(|w| w.wait())
        .map_err(comm_error)?;
        self.dense.dense_step(dense_lr)?;
        self.backward(&lookup, b)?;
        Ok(StepStats {
            loss: join_f64(loss) / n as f64,
            rows_updated: None,
        })
    }

    fn predict(&mut self, batch: &CtrBatch) -> Result<Vec<f32>> {
        self.model.check_batch(batch)?;
        let range = self.local(batch.len());
        let local = batch.slice(range.clone());
        let mut logits = vec![0.0f32; batch.len()];
        if local.is_empty() {
            // Still a party to the collective exchanges, with no rows of its own.
            self.exchange_pooled(&local)?;
        } else {
            self.lookup(&local)?;
            let mine = self.dense.head_logits(local.len())?;
            logits[range].copy_from_slice(&mine);
        }
        // Each logit is non-zero on one rank only: the sum puts every one in place exactly.
        (self
            .host_comm
            .all_reduce((&mut logits[..]).into(), ReduceOp::Sum))
        .and_then(|w| w.wait())
        .map_err(comm_error)?;
        Ok(logits)
    }

    fn writes_checkpoints(&self) -> bool {
        // Every rank gathers the model (collective); rank 0 alone writes it.
        self.host_comm.rank() == 0
    }

    fn host(&mut self) -> Result<&CtrModel> {
        if !self.host_current {
            if let Some(shard) = &self.shard {
                let (weights, state1, state2) = shard.download(&self.stream)?;
                (self.bag).set_shard_state(weights, state1, state2, shard.step())?;
            }
            let full = self.bag.gather_full(&*self.host_comm)?;
            self.model.tables.weights = full.weights;
            (self.model.sparse).set_state(full.state1, full.state2, full.steps)?;
            self.dense.download_dense_into(&mut self.model)?;
            self.host_current = true;
        }
        Ok(&self.model)
    }
}
