//! Streaming a [`GpuLlama`]'s parameters and AdamW moments to and from the host through one
//! bounded page-locked staging buffer ([`PIECE_ELEMS`] f32, 64 MiB), as the
//! [`TensorSource`]/[`TensorDest`] that checkpoint saves, loads and the random initialisation
//! use: saving or loading a model never needs a host copy of it.
//!
//! Each piece is one copy between the staging buffer and a slice of the device buffer followed
//! by a stream synchronisation (the staging buffer is reused for the next piece, and a copy
//! from page-locked memory is asynchronous). The host-side work of a piece (conversion,
//! file I/O) is many times slower than the copy, so the copies are not overlapped.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, PinnedHostSlice};
use tilearn_ops::cuda::CudaStream;

use super::{GpuLlama, cuda_err, invalid, pinned};
use crate::checkpoint::stream::PIECE_ELEMS;
use crate::checkpoint::{TensorDest, TensorSource};
use crate::error::Result;

/// The page-locked staging buffer of one save or load.
struct Staging {
    stream: Arc<CudaStream>,
    host: PinnedHostSlice<f32>,
}

impl Staging {
    fn new(stream: &Arc<CudaStream>) -> Result<Staging> {
        Ok(Staging {
            stream: stream.clone(),
            host: pinned(stream.context(), PIECE_ELEMS, 0.0f32)?,
        })
    }

    /// Calls `sink` with `buf[range]`, copied down piece by piece.
    fn download(
        &mut self,
        buf: &CudaSlice<f32>,
        range: Range<usize>,
        sink: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let what = "downloading to the staging buffer";
        let mut start = range.start;
        while start < range.end {
            let end = range.end.min(start + PIECE_ELEMS);
            let host = self.host.as_mut_slice().map_err(|e| cuda_err(what, e))?;
            let host = &mut host[..end - start];
            self.stream
                .memcpy_dtoh(&buf.slice(start..end), host)
                .map_err(|e| cuda_err(what, e))?;
            self.stream.synchronize().map_err(|e| cuda_err(what, e))?;
            sink(host)?;
            start = end;
        }
        Ok(())
    }

    /// Lets `fill` write `buf[range]` piece by piece into the staging buffer and copies each
    /// piece up.
    fn upload(
        &mut self,
        buf: &mut CudaSlice<f32>,
        range: Range<usize>,
        fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let what = "uploading from the staging buffer";
        let mut start = range.start;
        while start < range.end {
            let end = range.end.min(start + PIECE_ELEMS);
            let host = self.host.as_mut_slice().map_err(|e| cuda_err(what, e))?;
            let host = &mut host[..end - start];
            fill(start - range.start, host)?;
            self.stream
                .memcpy_htod(&*host, &mut buf.slice_mut(start..end))
                .map_err(|e| cuda_err(what, e))?;
            self.stream.synchronize().map_err(|e| cuda_err(what, e))?;
            start = end;
        }
        Ok(())
    }
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
            staging: Staging::new(self.stream())?,
            buffers: vec![&self.master],
            numel: self.layout.numel,
        };
        f(&mut source)
    }

    /// Runs `f` with the master weights as a [`TensorDest`] (the parameters' layout), then
    /// refreshes the 16-bit working copy; the optimizer state is kept. `f` must write every
    /// parameter it means to set; the others keep their values.
    pub fn fill_params(&mut self, f: impl FnOnce(&mut dyn TensorDest) -> Result<()>) -> Result<()> {
        let stream = self.stream().clone();
        let mut dest = DeviceDest {
            staging: Staging::new(&stream)?,
            buffers: vec![&mut self.master],
            numel: self.layout.numel,
        };
        f(&mut dest)?;
        drop(dest);
        if let Some(w) = self.work.as_mut() {
            w.invalidate();
            w.refresh(&stream, &self.master, self.precision)?;
        }
        Ok(())
    }

    /// Runs `f` with the AdamW moments as a [`TensorSource`] (`exp_avg` then `exp_avg_sq`,
    /// see [`crate::trainer::optimizer_file`]).
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
            staging: Staging::new(self.stream())?,
            buffers: vec![exp_avg, exp_avg_sq],
            numel: self.layout.numel,
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
        let numel = self.layout.numel;
        let Some(opt) = self.optimizer.as_mut() else {
            return Err(invalid(
                "GpuLlama::fill_moments",
                "no optimizer: call configure_optimizer first".into(),
            ));
        };
        let (exp_avg, exp_avg_sq) = opt.moments_mut();
        let mut dest = DeviceDest {
            staging: Staging::new(&stream)?,
            buffers: vec![exp_avg, exp_avg_sq],
            numel,
        };
        let step = f(&mut dest)?;
        drop(dest);
        opt.set_step(step);
        Ok(())
    }
}
