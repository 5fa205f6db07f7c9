//! Data parallelism and ZeRO for the Trainer (see "Data parallel and ZeRO" in
//! `docs/ARCHITECTURE.md`).
//!
//! Every rank runs the same loop on its own part of each global batch (the loader's
//! `rank`/`world_size`). The loss of a step is divided by the number of valid targets of the
//! whole global batch (summed over the ranks first), so each rank's gradient is its share of the
//! global mean and the ranks' gradients only need a plain sum: the averaging is folded into the
//! loss denominator and the collective is `ReduceOp::Sum`, no separate scaling pass.
//!
//! * Stage 0 (DDP): gradients accumulate locally over the micro-batches (PyTorch's `no_sync`) and
//!   are all-reduced once per optimizer step, in buckets ([`layout::gradient_buckets`]), all in
//!   flight at once, optionally compressed to bf16 (host buffers; f32 accumulation).
//! * Stage 1: the gradients are reduce-scattered once per step; each rank clips with the global
//!   norm (partial sums gathered), steps its shard of the weights with its shard of the optimizer
//!   state, and the weights are all-gathered.
//! * Stage 2: stage 1, with the reduce-scatter after every micro-batch into an accumulator that
//!   holds only the owned shard (DeepSpeed's schedule).
//!
//! Scalars (the target count, the loss, the norm's partial sums, overflow flags) travel as f64 or
//! u64 bit patterns in an all-gather and are summed in rank order on every rank: exact, and
//! identical everywhere, so every rank takes the same decisions.

pub mod layout;
pub mod overlap;

use std::ops::Range;
use std::sync::Arc;

use half::bf16;
use tilearn_ops::DType;
use tilearn_parallel::{BufferMut, Communicator, ReduceOp};

pub use layout::{ShardLayout, gradient_buckets};
pub use overlap::OverlapStats;

use super::backend::StepBackend;
use super::flat_buffer::{Completion, FlatBuffer};
pub use super::zero::{ZERO_STAGE_ENV, ZeroStage};
use crate::data::Batch;
use crate::{EngineError, Result};

/// Set to 1, rank 0 prints every overlapped all-reduce bucket's timestamps to stderr.
pub const TIMELINE_ENV: &str = "TILEARN_DDP_TIMELINE";

/// `--ddp-bucket-cap-mb`'s default, PyTorch DDP's `bucket_cap_mb`.
pub const DEFAULT_BUCKET_CAP_MB: f64 = 25.0;

/// The data-parallel settings of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DdpOptions {
    /// Bucket size of the gradient all-reduce (`--ddp-bucket-cap-mb`, MiB as PyTorch counts).
    pub bucket_cap_mb: f64,
    /// The dtype gradients travel in (`--ddp-comm-dtype`): f32, or bf16 to halve the traffic.
    pub comm_dtype: DType,
    pub zero_stage: ZeroStage,
    /// All-reduce the gradients of each finished layer while the backward goes on (the GPU
    /// engine with f32 gradients and no ZeRO; `--no-ddp-overlap` turns it off to compare).
    pub overlap: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_mb: DEFAULT_BUCKET_CAP_MB,
            comm_dtype: DType::F32,
            zero_stage: ZeroStage::Off,
            overlap: true,
        }
    }
}

impl DdpOptions {
    pub fn validate(&self) -> Result<()> {
        if !(self.bucket_cap_mb.is_finite() && self.bucket_cap_mb > 0.0) {
            return Err(EngineError::InvalidArgument {
                argument: "--ddp-bucket-cap-mb".into(),
                message: format!("is {}; use a positive size in MiB", self.bucket_cap_mb),
            });
        }
        if self.comm_dtype == DType::F16 {
            return Err(EngineError::InvalidArgument {
                argument: "--ddp-comm-dtype".into(),
                message: "fp16 is not supported (its range overflows on summed gradients); use \
                          f32 or bf16"
                    .into(),
            });
        }
        if self.comm_dtype != DType::F32 && self.zero_stage != ZeroStage::Off {
            return Err(EngineError::InvalidArgument {
                argument: "--ddp-comm-dtype".into(),
                message: "bf16 compression applies to the DDP all-reduce; ZeRO's reduce-scatter \
                          runs in f32 (drop --ddp-comm-dtype or --zero-stage)"
                    .into(),
            });
        }
        Ok(())
    }

    fn bucket_cap_bytes(&self) -> usize {
        (self.bucket_cap_mb * (1u64 << 20) as f64) as usize
    }
}

/// The communicators of a data-parallel run.
struct Comms {
    /// Gradients and weights (NCCL on GPUs, or the host communicator).
    grads: Arc<dyn Communicator>,
    /// Scalars in host memory (always a host communicator: NCCL takes only device buffers).
    scalars: Arc<dyn Communicator>,
}

/// A rank's view of data parallelism; for a single process every operation is the identity.
pub struct DataParallel {
    comms: Option<Comms>,
    options: DdpOptions,
    layout: ShardLayout,
    buckets: Vec<Range<usize>>,
    /// bf16 staging of one bucket (`--ddp-comm-dtype bf16`).
    compressed: Vec<bf16>,
    /// ZeRO-2: the reduced gradients of the owned shard, accumulated over the micro-batches.
    grad_shard: Vec<f32>,
    /// The stream that collects the overlapped buckets' completions (made on first use).
    #[cfg(feature = "cuda")]
    side: Option<Arc<tilearn_ops::cuda::CudaStream>>,
    /// bf16 device copy of the gradients for `--ddp-comm-dtype bf16` on the GPU (made on use).
    #[cfg(feature = "cuda")]
    compressed_device: Option<cudarc::driver::CudaSlice<bf16>>,
    /// The last overlapped step, summarised (taken by the log).
    last_overlap: Option<OverlapStats>,
}

impl DataParallel {
    /// One process: no communication.
    pub fn single(numel: usize) -> DataParallel {
        DataParallel {
            comms: None,
            options: DdpOptions::default(),
            layout: ShardLayout::new(numel, 1),
            buckets: Vec::new(),
            compressed: Vec::new(),
            grad_shard: Vec::new(),
            #[cfg(feature = "cuda")]
            side: None,
            #[cfg(feature = "cuda")]
            compressed_device: None,
            last_overlap: None,
        }
    }

    /// Data parallelism over `grads` (gradients and weights) and `scalars` (a host
    /// communicator of the same ranks; may be the same one) for a model of `numel` parameters.
    pub fn new(
        grads: Arc<dyn Communicator>,
        scalars: Arc<dyn Communicator>,
        options: DdpOptions,
        numel: usize,
    ) -> Result<DataParallel> {
        options.validate()?;
        if grads.world_size() != scalars.world_size() || grads.rank() != scalars.rank() {
            return Err(EngineError::InvalidArgument {
                argument: "data parallel".into(),
                message: "internal: the gradient and scalar communicators differ in rank or size"
                    .into(),
            });
        }
        let world = grads.world_size();
        Ok(DataParallel {
            layout: ShardLayout::new(numel, world),
            buckets: gradient_buckets(numel, options.bucket_cap_bytes()),
            comms: Some(Comms { grads, scalars }),
            options,
            compressed: Vec::new(),
            grad_shard: Vec::new(),
            #[cfg(feature = "cuda")]
            side: None,
            #[cfg(feature = "cuda")]
            compressed_device: None,
            last_overlap: None,
        })
    }

    pub fn rank(&self) -> usize {
        self.comms.as_ref().map_or(0, |c| c.grads.rank())
    }

    pub fn world_size(&self) -> usize {
        self.comms.as_ref().map_or(1, |c| c.grads.world_size())
    }

    /// Rank 0 writes the model, the log and the checkpoints and shows progress.
    pub fn is_primary(&self) -> bool {
        self.rank() == 0
    }

    pub fn options(&self) -> &DdpOptions {
        &self.options
    }

    pub fn zero_stage(&self) -> ZeroStage {
        self.options.zero_stage
    }

    /// Whether the optimizer state is partitioned (ZeRO 1 or 2 over more than one rank).
    pub fn is_sharded(&self) -> bool {
        self.comms.is_some() && self.options.zero_stage != ZeroStage::Off
    }

    pub fn layout(&self) -> ShardLayout {
        self.layout
    }

    /// The parameters this rank steps: its shard under ZeRO, else all of them.
    pub fn owned(&self) -> Range<usize> {
        if self.is_sharded() {
            self.layout.owned(self.rank())
        } else {
            0..self.layout.numel
        }
    }

    /// A one-line description for the start of a run.
    pub fn describe(&self) -> String {
        let Some(c) = &self.comms else {
            return "single process".into();
        };
        let mut text = format!(
            "data parallel: rank {} of {}, {} backend, {} buckets of ≤ {} MiB",
            self.rank(),
            self.world_size(),
            c.grads.backend(),
            self.buckets.len(),
            self.options.bucket_cap_mb
        );
        if self.options.comm_dtype != DType::F32 {
            text.push_str(&format!(", gradients sent in {}", self.options.comm_dtype));
        }
        if self.is_sharded() {
            text.push_str(&format!(", ZeRO stage {}", self.zero_stage().number()));
        }
        text
    }

    /// Gathers 8-byte values from every rank, in rank order (see [`tilearn_parallel::scalars`]).
    fn gather_words(&self, value: u64) -> Result<Vec<u64>> {
        match &self.comms {
            Some(c) => Ok(tilearn_parallel::scalars::gather_words(
                c.scalars.as_ref(),
                value,
            )?),
            None => Ok(vec![value]),
        }
    }

    /// The sum over the ranks of a count (exact).
    pub fn sum_count(&self, count: u64) -> Result<u64> {
        Ok(self.gather_words(count)?.into_iter().sum())
    }

    /// The sum over the ranks of `value`, added in rank order (identical on every rank).
    pub fn sum_f64(&self, value: f64) -> Result<f64> {
        Ok(self
            .gather_words(value.to_bits())?
            .into_iter()
            .map(f64::from_bits)
            .sum())
    }

    /// Whether `flag` holds on any rank.
    pub fn any(&self, flag: bool) -> Result<bool> {
        Ok(self.gather_words(u64::from(flag))?.contains(&1))
    }

    /// Waits until every rank arrives.
    pub fn barrier(&self) -> Result<()> {
        match &self.comms {
            Some(c) => Ok(c.scalars.barrier()?),
            None => Ok(()),
        }
    }

    /// The forward and backward of a step's last micro-batch with the gradient all-reduce
    /// overlapped (see `overlap.rs`): `None` when this step cannot overlap (one process, ZeRO,
    /// bf16 compression, `--no-ddp-overlap`, or a backend without the hook: the CPU engine);
    /// then the caller runs the plain backward and [`Self::after_backward`].
    pub fn overlapped_backward(
        &mut self,
        backend: &mut dyn StepBackend,
        batch: &Batch,
        denominator: f64,
        precision: DType,
        loss_scale: f32,
    ) -> Result<Option<f64>> {
        let Some(c) = &self.comms else {
            return Ok(None);
        };
        let o = &self.options;
        let reduce_to_owners = self.reduces_each_micro_batch();
        if !o.overlap || (o.zero_stage != ZeroStage::Off && !reduce_to_owners) {
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        {
            let Some(stream) = backend.compute_stream() else {
                return Ok(None);
            };
            if self.side.is_none() {
                let side = stream
                    .context()
                    .new_stream()
                    .map_err(|e| crate::gpu::cuda_err("creating the all-reduce side stream", e))?;
                self.side = Some(side);
            }
            if self.options.comm_dtype == DType::BF16 && self.compressed_device.is_none() {
                let numel = self.layout.numel.max(1);
                // Untracked like the gradients, for the same reason (see `overlap.rs`).
                let wire = crate::gpu::untracked(&stream, || stream.alloc_zeros::<bf16>(numel))
                    .map_err(|e| {
                        crate::gpu::cuda_err("allocating the bf16 all-reduce buffer", e)
                    })?;
                self.compressed_device = Some(wire);
            }
            let side = self.side.as_ref().expect("made above");
            let mut timeline = overlap::Timeline::default();
            if reduce_to_owners {
                let mut sink = overlap::ReduceToOwnersSink {
                    comm: c.grads.as_ref(),
                    layout: self.layout,
                    cap: (self.options.bucket_cap_bytes() / 4).max(1),
                    side,
                    timeline: &mut timeline,
                };
                let loss = backend
                    .forward_backward_into(batch, denominator, precision, loss_scale, &mut sink)
                    .ok_or_else(|| EngineError::InvalidArgument {
                        argument: "data parallel".into(),
                        message: "internal: a backend with a compute stream lacks the hook".into(),
                    })??;
                // The owned shard holds the ranks' sum (accumulated onto what earlier
                // micro-batches left there); in a whole buffer the rest is zeroed for the
                // next backward (a backend that keeps only the owned gradients has no rest).
                if !backend.gradients_sharded() {
                    let owned = self.owned();
                    let mut grads = backend.flat_gradients()?;
                    let len = grads.len();
                    grads.zero(0..owned.start)?;
                    grads.zero(owned.end..len)?;
                }
                self.keep_timeline(&timeline)?;
                return Ok(Some(loss));
            }
            let mut sink = overlap::OverlapSink {
                comm: c.grads.as_ref(),
                cap: (self.options.bucket_cap_bytes() / 4).max(1),
                side,
                timeline: &mut timeline,
                compressed: match self.options.comm_dtype {
                    DType::BF16 => self.compressed_device.as_mut(),
                    _ => None,
                },
            };
            let loss = backend
                .forward_backward_into(batch, denominator, precision, loss_scale, &mut sink)
                .ok_or_else(|| EngineError::InvalidArgument {
                    argument: "data parallel".into(),
                    message: "internal: a backend with a compute stream lacks the hook".into(),
                })??;
            self.keep_timeline(&timeline)?;
            Ok(Some(loss))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (c, backend, batch, denominator, precision, loss_scale);
            Ok(None)
        }
    }

    /// Summarises an overlapped backward's buckets for the log (and prints them with
    /// [`TIMELINE_ENV`]).
    #[cfg(feature = "cuda")]
    fn keep_timeline(&mut self, timeline: &overlap::Timeline) -> Result<()> {
        if let Some((stats, buckets)) = timeline.stats()? {
            if std::env::var_os(TIMELINE_ENV).is_some_and(|v| v == "1") && self.is_primary() {
                for b in &buckets {
                    eprintln!(
                        "reduction bucket at {} ({} elements): ready {:.3} ms, done {:.3} ms",
                        b.offset, b.elements, b.ready_ms, b.done_ms
                    );
                }
            }
            self.last_overlap = Some(stats);
        }
        Ok(())
    }

    /// Whether every micro-batch's gradients are reduced during its own backward (ZeRO-2 with
    /// the overlap on: each bucket goes to its owner as soon as it is final). On a backend
    /// without the hook (the CPU engine) [`Self::after_backward`] reduces instead.
    pub fn reduces_each_micro_batch(&self) -> bool {
        self.is_sharded() && self.options.zero_stage == ZeroStage::Two && self.options.overlap
    }

    /// The last overlapped all-reduce's summary, once.
    pub fn take_overlap_stats(&mut self) -> Option<OverlapStats> {
        self.last_overlap.take()
    }

    /// Called after the backward of each micro-batch (`last`: the step's final one): reduces
    /// the gradients as the stage says (see the module docs). Afterwards the backend's gradients
    /// hold the global gradient on [`Self::owned`].
    pub fn after_backward(&mut self, backend: &mut dyn StepBackend, last: bool) -> Result<()> {
        let Some(c) = &self.comms else {
            return Ok(());
        };
        let grads_comm = c.grads.clone();
        match self.options.zero_stage {
            ZeroStage::Off if last => {
                let mut grads = backend.flat_gradients()?;
                if self.options.comm_dtype == DType::BF16 {
                    let host = grads.host().ok_or_else(|| EngineError::InvalidArgument {
                        argument: "--ddp-comm-dtype".into(),
                        message: "on the GPU, bf16 compression runs in the all-reduce \
                                  overlapped with the backward: drop --no-ddp-overlap (or use \
                                  f32)"
                            .into(),
                    })?;
                    all_reduce_bf16(
                        grads_comm.as_ref(),
                        host,
                        &self.buckets,
                        &mut self.compressed,
                    )?;
                } else {
                    let done = grads.completion();
                    all_reduce_buckets(grads_comm.as_ref(), &mut grads, &self.buckets, &done)?;
                }
            }
            ZeroStage::Off => {}
            ZeroStage::One if last => {
                let mut grads = backend.flat_gradients()?;
                reduce_scatter(grads_comm.as_ref(), &mut grads, self.layout)?;
            }
            ZeroStage::One => {}
            ZeroStage::Two if backend.gradients_sharded() => {
                return Err(EngineError::InvalidArgument {
                    argument: "--zero-stage".into(),
                    message: "internal: the backend keeps only the owned gradients, which its \
                              backward reduces; nothing is left to reduce after it"
                        .into(),
                });
            }
            ZeroStage::Two if backend.flat_gradients()?.host().is_none() => {
                // On the device the owned part of the gradient buffer is the accumulator: after
                // the reduce-scatter it holds the global sum so far, and the rest is zeroed, so
                // the next backward adds into it and the next reduce-scatter sums the ranks'
                // new gradients onto it (no second buffer, no host copy).
                let owned = self.owned();
                let mut grads = backend.flat_gradients()?;
                reduce_scatter(grads_comm.as_ref(), &mut grads, self.layout)?;
                grads.zero(0..owned.start)?;
                let len = grads.len();
                grads.zero(owned.end..len)?;
            }
            ZeroStage::Two => {
                let owned = self.owned();
                {
                    let mut grads = backend.flat_gradients()?;
                    reduce_scatter(grads_comm.as_ref(), &mut grads, self.layout)?;
                    let host = grads.host().ok_or_else(zero_on_device)?;
                    let reduced = &host[owned.clone()];
                    if self.grad_shard.len() != reduced.len() {
                        self.grad_shard = reduced.to_vec();
                    } else {
                        self.grad_shard
                            .iter_mut()
                            .zip(reduced)
                            .for_each(|(a, &g)| *a += g);
                    }
                }
                // The next micro-batch's backward adds into a clean buffer; after the last one
                // the buffer holds the accumulated shard (zeros elsewhere).
                backend.zero_grads();
                let mut grads = backend.flat_gradients()?;
                let host = grads.host().ok_or_else(zero_on_device)?;
                if last {
                    host[owned].copy_from_slice(&self.grad_shard);
                    self.grad_shard.clear();
                }
            }
        }
        Ok(())
    }

    /// Whether the gradients are non-finite on any rank (the GradScaler's check; under ZeRO a
    /// rank sees only its shard's reduced values).
    pub fn found_inf(&self, local: bool) -> Result<bool> {
        if self.is_sharded() {
            self.any(local)
        } else {
            Ok(local)
        }
    }

    /// Clips the global gradient norm to `max_norm` (0: no clipping) and returns it. Without
    /// ZeRO every rank holds the whole reduced gradient and the backend clips as alone; under
    /// ZeRO the owned shards' sums of squares are summed over the ranks first.
    pub fn clip_grad_norm(&self, backend: &mut dyn StepBackend, max_norm: f64) -> Result<f64> {
        if !self.is_sharded() {
            return backend.clip_grad_norm(max_norm);
        }
        let owned = self.owned();
        let local = backend.grad_sum_of_squares(owned.clone())?;
        let sum_of_squares = self.sum_f64(local)?;
        backend.clip_shard(owned, sum_of_squares, max_norm)?;
        Ok(sum_of_squares.sqrt())
    }

    /// Before a save (collective): where the backend holds only its shard of the fp32 weights
    /// (the GPU engine's sharded master), every rank's shard is gathered into a whole-model
    /// buffer the save then reads. Nothing to do otherwise.
    pub fn gather_whole_weights(&mut self, backend: &mut dyn StepBackend) -> Result<()> {
        let Some(c) = &self.comms else {
            return Ok(());
        };
        if !self.is_sharded() {
            return Ok(());
        }
        let comm = c.grads.clone();
        let layout = self.layout;
        // Every rank answers the same way (the model and its precisions are the same).
        let Some(mut whole) = backend.stage_whole_weights()? else {
            return Ok(());
        };
        all_gather_shards(comm.as_ref(), &mut whole, layout)
    }

    /// After the optimizer stepped the owned shard: every rank gets every shard's new weights.
    pub fn gather_parameters(&mut self, backend: &mut dyn StepBackend) -> Result<()> {
        let Some(c) = &self.comms else {
            return Ok(());
        };
        if !self.is_sharded() {
            return Ok(());
        }
        let comm = c.grads.clone();
        let layout = self.layout;
        let mut params = backend.flat_parameters()?;
        all_gather_shards(comm.as_ref(), &mut params, layout)
    }
}

/// Every rank's owned shard of `buf` to every rank: the bulk with the in-place all-gather, the
/// tail broadcast by its owner.
fn all_gather_shards(
    comm: &dyn Communicator,
    buf: &mut FlatBuffer<'_>,
    layout: ShardLayout,
) -> Result<()> {
    let done = buf.completion();
    let bulk = layout.bulk();
    if !bulk.is_empty() {
        done.finish(comm.all_gather(buf.part(bulk))?)?;
    }
    let tail = layout.tail();
    if !tail.is_empty() {
        done.finish(comm.broadcast(buf.part(tail), layout.tail_owner())?)?;
    }
    Ok(())
}

fn zero_on_device() -> EngineError {
    EngineError::InvalidArgument {
        argument: "--zero-stage".into(),
        message: "internal: ZeRO-2's host accumulation reached a device gradient buffer".into(),
    }
}

/// All-reduces (sum) the buckets of `grads`, all in flight before any is waited for: each
/// level of the recursion launches one bucket and waits for it after the later ones launched.
/// `buckets` run from the end of the buffer towards its start.
fn all_reduce_buckets(
    comm: &dyn Communicator,
    grads: &mut FlatBuffer<'_>,
    buckets: &[Range<usize>],
    done: &Completion,
) -> Result<()> {
    let Some((bucket, rest)) = buckets.split_first() else {
        return Ok(());
    };
    debug_assert_eq!(bucket.end, grads.len(), "buckets run from the end");
    let (mut earlier, mut this) = grads.split_at(bucket.start);
    let work = comm.all_reduce(this.part(0..bucket.len()), ReduceOp::Sum)?;
    all_reduce_buckets(comm, &mut earlier, rest, done)?;
    done.finish(work)
}

/// The bf16-compressed all-reduce: each bucket is rounded to bf16, summed (the host backend
/// accumulates in f32 and rounds the result once) and widened back.
fn all_reduce_bf16(
    comm: &dyn Communicator,
    grads: &mut [f32],
    buckets: &[Range<usize>],
    staging: &mut Vec<bf16>,
) -> Result<()> {
    for bucket in buckets {
        let part = &mut grads[bucket.clone()];
        staging.clear();
        staging.extend(part.iter().map(|&g| bf16::from_f32(g)));
        comm.all_reduce(BufferMut::from(&mut staging[..]), ReduceOp::Sum)?
            .wait()?;
        part.iter_mut()
            .zip(staging.iter())
            .for_each(|(g, h)| *g = h.to_f32());
    }
    Ok(())
}

/// Reduce-scatters (sum) the gradients so that every rank holds the global sum on its owned
/// shard: the bulk with the communicator's in-place reduce-scatter, the short tail with an
/// all-reduce (every rank gets it; only its owner uses it).
fn reduce_scatter(
    comm: &dyn Communicator,
    grads: &mut FlatBuffer<'_>,
    layout: ShardLayout,
) -> Result<()> {
    let done = grads.completion();
    let bulk = layout.bulk();
    if !bulk.is_empty() {
        done.finish(comm.reduce_scatter(grads.part(bulk), ReduceOp::Sum)?)?;
    }
    let tail = layout.tail();
    if !tail.is_empty() {
        done.finish(comm.all_reduce(grads.part(tail), ReduceOp::Sum)?)?;
    }
    Ok(())
}
