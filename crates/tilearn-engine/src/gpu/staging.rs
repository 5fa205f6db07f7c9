//! Streaming a [`GpuLlama`]'s parameters and AdamW moments to and from the host through a small
//! ring of page-locked staging buffers ([`SLOTS`] × [`PIECE_ELEMS`] f32, 2 × 64 MiB), as the
//! [`TensorSource`]/[`TensorDest`] that checkpoint saves, loads and the random initialisation
//! use: saving or loading a model never needs a host copy of it.
//!
//! The copies are asynchronous and each slot records a CUDA event after its copy; the schedule
//! ([`crate::staging_ring`]) waits for a slot's event only when it needs that slot again. A load
//! decodes piece `k + 1` into one slot while piece `k` is copied up from the other (across
//! tensors too: the ring lives for the whole load), and a save's download of the next piece
//! runs while the current one is encoded and written. Upload slots are write-combined (the
//! host only writes them); download slots are not, because the host reads them.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice, sys};
use tilearn_ops::cuda::CudaStream;

use super::{GpuLlama, cuda_err, invalid, pinned_with_flags};
use crate::checkpoint::stream::PIECE_ELEMS;
use crate::checkpoint::{TensorDest, TensorSource};
use crate::error::Result;
use crate::staging_ring::{StagingRing, StagingSlot};

/// Staging buffers per save or load: two already hide a 64 MiB copy (about 1.2 ms at 55 GB/s)
/// behind the host work of the next piece (tens of ms), so more would only hold more memory.
const SLOTS: usize = 2;

/// Which way a ring's copies go (it decides how its buffers are allocated).
#[derive(Clone, Copy)]
enum Direction {
    Upload,
    Download,
}

/// One page-locked staging buffer and the event recorded after its last copy.
struct CudaSlot {
    stream: Arc<CudaStream>,
    host: PinnedHostSlice<f32>,
    done: CudaEvent,
    /// A copy was queued since the last [`StagingSlot::wait`].
    pending: bool,
}

impl CudaSlot {
    fn new(stream: &Arc<CudaStream>, direction: Direction) -> Result<CudaSlot> {
        let ctx = stream.context();
        let flags = match direction {
            Direction::Upload => sys::CU_MEMHOSTALLOC_WRITECOMBINED,
            Direction::Download => 0,
        };
        Ok(CudaSlot {
            stream: stream.clone(),
            host: pinned_with_flags(ctx, PIECE_ELEMS, 0.0f32, flags)?,
            done: ctx
                .new_event(None)
                .map_err(|e| cuda_err("creating a staging event", e))?,
            pending: false,
        })
    }

    /// The whole host buffer, without waiting: the copies take plain slices of it, so
    /// `PinnedHostSlice`'s own event (which `as_mut_slice` waits for) never has work recorded.
    fn buffer(&mut self) -> Result<&mut [f32]> {
        self.host
            .as_mut_slice()
            .map_err(|e| cuda_err("mapping the staging buffer", e))
    }

    /// Records the slot's event after the copy just queued. If recording fails the stream is
    /// drained instead, so the buffer is never reused while a copy may still read or write it.
    fn mark_queued(&mut self, what: &str) -> Result<()> {
        if let Err(e) = self.done.record(&self.stream) {
            let _ = self.stream.synchronize();
            return Err(cuda_err(what, e));
        }
        self.pending = true;
        Ok(())
    }
}

impl StagingSlot for CudaSlot {
    type Device = CudaSlice<f32>;

    fn wait(&mut self) -> Result<()> {
        if self.pending {
            self.done
                .synchronize()
                .map_err(|e| cuda_err("waiting for a staging copy", e))?;
            self.pending = false;
        }
        Ok(())
    }

    fn host(&mut self) -> Result<&mut [f32]> {
        // The ring waits before asking; waiting here too keeps the buffer safe to touch even
        // if it did not.
        self.wait()?;
        self.buffer()
    }

    fn queue_upload(&mut self, device: &mut CudaSlice<f32>, dst: Range<usize>) -> Result<()> {
        let what = "uploading from the staging buffer";
        let n = dst.len();
        let stream = self.stream.clone();
        let host = self.buffer()?;
        // The buffer is page-locked, so the copy runs asynchronously after this returns: the
        // slot is not written (host() waits) nor freed (Drop waits) until its event completes.
        stream
            .memcpy_htod(&host[..n], &mut device.slice_mut(dst))
            .map_err(|e| cuda_err(what, e))?;
        self.mark_queued(what)
    }

    fn queue_download(&mut self, device: &CudaSlice<f32>, src: Range<usize>) -> Result<()> {
        let what = "downloading to the staging buffer";
        let n = src.len();
        let stream = self.stream.clone();
        let host = self.buffer()?;
        // As in queue_upload: nothing reads the buffer before the event completes.
        stream
            .memcpy_dtoh(&device.slice(src), &mut host[..n])
            .map_err(|e| cuda_err(what, e))?;
        self.mark_queued(what)
    }
}

impl Drop for CudaSlot {
    fn drop(&mut self) {
        // A copy may still be using the page-locked buffer (a save or load that failed half
        // way); it must finish before the buffer is freed. An error here already surfaced, or
        // surfaces at the stream's next operation.
        let _ = self.wait();
    }
}

/// The staging ring of one save or load.
type Staging = StagingRing<CudaSlot>;

fn staging(stream: &Arc<CudaStream>, direction: Direction) -> Result<Staging> {
    let slots = (0..SLOTS)
        .map(|_| CudaSlot::new(stream, direction))
        .collect::<Result<Vec<_>>>()?;
    Ok(StagingRing::new(slots, PIECE_ELEMS))
}

/// Device buffers of `numel` elements each, addressed as one flat range (buffer `k` holds
/// `k * numel..(k + 1) * numel`).
fn locate(numel: usize, count: usize, range: &Range<usize>) -> Result<(usize, Range<usize>)> {
    let k = range.start / numel.max(1);
    if k >= count || range.end > (k + 1) * numel {
        return Err(invalid(
            "range",
            format!("{range:?} is not inside one of {count} device buffers of {numel} elements"),
        ));
    }
    Ok((k, range.start - k * numel..range.end - k * numel))
}

struct DeviceSource<'a> {
    staging: Staging,
    buffers: Vec<&'a CudaSlice<f32>>,
    numel: usize,
}

impl TensorSource for DeviceSource<'_> {
    fn read(
        &mut self,
        range: Range<usize>,
        sink: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let (k, local) = locate(self.numel, self.buffers.len(), &range)?;
        self.staging.download(self.buffers[k], local, sink)
    }
}

struct DeviceDest<'a> {
    staging: Staging,
    buffers: Vec<&'a mut CudaSlice<f32>>,
    numel: usize,
}

impl TensorDest for DeviceDest<'_> {
    fn write(
        &mut self,
        range: Range<usize>,
        fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let (k, local) = locate(self.numel, self.buffers.len(), &range)?;
        self.staging.upload(self.buffers[k], local, fill)
    }
}

impl GpuLlama {
    /// Runs `f` with the fp32 master weights as a [`TensorSource`] (the parameters' layout).
    pub fn with_params_source<R>(
        &self,
        f: impl FnOnce(&mut dyn TensorSource) -> Result<R>,
    ) -> Result<R> {
        let mut source = DeviceSource {
            staging: staging(self.stream(), Direction::Download)?,
            buffers: vec![self.whole_params()?],
            numel: self.layout.numel,
        };
        f(&mut source)
    }

    /// Runs `f` with the master weights as a [`TensorDest`] (the parameters' layout), then
    /// refreshes the 16-bit working copy; the optimizer state is kept. `f` must write every
    /// parameter it means to set; the others keep their values.
    ///
    /// With ZeRO's sharded master the whole model is streamed into the idle gradient buffer
    /// (under ZeRO-2 a buffer made for it) and this rank keeps its shard (see `zero.rs`); `f`
    /// must then write every parameter.
    pub fn fill_params(&mut self, f: impl FnOnce(&mut dyn TensorDest) -> Result<()>) -> Result<()> {
        let stream = self.stream().clone();
        let sharded = self.master_shard.is_some();
        let numel = self.layout.numel;
        let target = if sharded {
            self.whole_params_target()?
        } else {
            &mut self.master
        };
        let mut dest = DeviceDest {
            staging: staging(&stream, Direction::Upload)?,
            buffers: vec![target],
            numel,
        };
        f(&mut dest)?;
        dest.staging.finish()?;
        drop(dest);
        if sharded {
            // A lean model's master (an empty shard here) lives on the host.
            self.keep_loaded_shard()?;
            return self.pull_loaded_into_host();
        }
        if let Some(w) = self.work.as_mut() {
            w.invalidate();
            w.refresh(&stream, &self.master, self.precision)?;
        }
        Ok(())
    }

    /// Runs `f` with the AdamW moments as a [`TensorSource`] (`exp_avg` then `exp_avg_sq`,
    /// see [`crate::trainer::optimizer_file`]), each as long as the optimizer's shard.
    pub fn with_moments_source<R>(
        &self,
        f: impl FnOnce(&mut dyn TensorSource) -> Result<R>,
    ) -> Result<R> {
        let Some(opt) = self.optimizer.as_ref() else {
            return Err(invalid(
                "GpuLlama::with_moments_source",
                "no optimizer: call configure_optimizer first".into(),
            ));
        };
        let (exp_avg, exp_avg_sq) = opt.moments();
        let mut source = DeviceSource {
            staging: staging(self.stream(), Direction::Download)?,
            buffers: vec![exp_avg, exp_avg_sq],
            numel: opt.shard().len(),
        };
        f(&mut source)
    }

    /// Runs `f` with the AdamW moments as a [`TensorDest`] (layout of
    /// [`GpuLlama::with_moments_source`]); `f` returns the step count, which replaces the
    /// optimizer's.
    pub fn fill_moments(
        &mut self,
        f: impl FnOnce(&mut dyn TensorDest) -> Result<u64>,
    ) -> Result<()> {
        let stream = self.stream().clone();
        let Some(opt) = self.optimizer.as_mut() else {
            return Err(invalid(
                "GpuLlama::fill_moments",
                "no optimizer: call configure_optimizer first".into(),
            ));
        };
        let numel = opt.shard().len();
        let (exp_avg, exp_avg_sq) = opt.moments_mut();
        let mut dest = DeviceDest {
            staging: staging(&stream, Direction::Upload)?,
            buffers: vec![exp_avg, exp_avg_sq],
            numel,
        };
        let step = f(&mut dest)?;
        dest.staging.finish()?;
        drop(dest);
        opt.set_step(step);
        Ok(())
    }
}
