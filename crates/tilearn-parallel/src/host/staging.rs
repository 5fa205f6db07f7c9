//! Device buffers on the host communicator (feature `cuda`): copied to page-locked host memory,
//! reduced or exchanged there, and copied back. This is how several ranks share one GPU (NCCL
//! refuses two ranks on one device); it is synchronous and meant for tests and small jobs.

use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaStream, CudaView, CudaViewMut, DeviceRepr, DeviceSlice as _, PinnedHostSlice,
    ValidAsZeroBits,
};

use crate::buffer::{CommElement, HostSlice, HostSliceMut};
use crate::device::{DeviceSlice, DeviceSliceMut};
use crate::error::{ParallelError, Result};

#[derive(Default)]
struct State {
    stream: Option<Arc<CudaStream>>,
    f32: Option<PinnedHostSlice<f32>>,
    bf16: Option<PinnedHostSlice<half::bf16>>,
    f16: Option<PinnedHostSlice<half::f16>>,
}

/// The staging stream and the page-locked buffers, grown to the largest buffer seen.
#[derive(Default)]
pub struct Staging {
    state: Mutex<State>,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Staging")
    }
}

fn cuda(context: &str) -> impl Fn(cudarc::driver::DriverError) -> ParallelError + '_ {
    move |e| ParallelError::Cuda {
        context: context.to_string(),
        message: e.to_string(),
    }
}

/// A pinned buffer of at least `len` elements in `cache`, (re)allocated on `stream`'s context.
fn pinned<'c, T: DeviceRepr + ValidAsZeroBits>(
    cache: &'c mut Option<PinnedHostSlice<T>>,
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<&'c mut [T]> {
    if cache.as_ref().is_none_or(|p| p.len() < len) {
        // SAFETY: flags 0 asks for ordinary (cached, not write-combined) page-locked memory,
        // which the CPU reads fast; the slice is only used after a synchronised copy fills it.
        let fresh = unsafe { stream.context().alloc_pinned_with_flags::<T>(len.max(1), 0) }
            .map_err(cuda("allocating page-locked staging memory"))?;
        *cache = Some(fresh);
    }
    let slice = cache
        .as_mut()
        .map(PinnedHostSlice::as_mut_slice)
        .transpose()
        .map_err(cuda("page-locked staging memory"))?
        .unwrap_or_default();
    Ok(&mut slice[..len])
}

fn round_trip_typed<T: CommElement + DeviceRepr + ValidAsZeroBits>(
    cache: &mut Option<PinnedHostSlice<T>>,
    stream: &Arc<CudaStream>,
    mut view: CudaViewMut<'_, T>,
    body: impl FnOnce(HostSliceMut<'_>) -> Result<()>,
) -> Result<()> {
    // The buffer may be untracked by cudarc's events (the GPU engine's gradients are), so the
    // copies are ordered after everything the buffer's own stream has enqueued so far.
    order_after_owner(stream, view.stream())?;
    let host = pinned(cache, stream, view.len())?;
    stream
        .memcpy_dtoh(&view, host)
        .map_err(cuda("staging a device buffer to the host"))?;
    // A copy into page-locked memory is truly asynchronous (cudarc treats a `&mut [T]` as
    // pageable and does not wait): read the host copy only once the stream has finished it.
    synchronize(stream, "staging a device buffer to the host")?;
    body(T::host_mut(host))?;
    stream
        .memcpy_htod(&*host, &mut view)
        .map_err(cuda("copying a staged buffer back to the device"))?;
    // The next collective refills the same page-locked buffer.
    synchronize(stream, "copying a staged buffer back to the device")
}

/// Makes `stream` wait for the work enqueued on `owner` so far (no-op when they are one).
fn order_after_owner(stream: &Arc<CudaStream>, owner: &Arc<CudaStream>) -> Result<()> {
    if Arc::ptr_eq(stream, owner) {
        return Ok(());
    }
    stream.join(owner).map_err(cuda(
        "ordering the staging stream after the buffer's stream",
    ))
}

fn synchronize(stream: &CudaStream, context: &str) -> Result<()> {
    stream.synchronize().map_err(cuda(context))
}

fn download_typed<T: CommElement + DeviceRepr + ValidAsZeroBits>(
    cache: &mut Option<PinnedHostSlice<T>>,
    stream: &Arc<CudaStream>,
    view: CudaView<'_, T>,
    body: impl FnOnce(HostSlice<'_>) -> Result<()>,
) -> Result<()> {
    order_after_owner(stream, view.stream())?;
    let host = pinned(cache, stream, view.len())?;
    stream
        .memcpy_dtoh(&view, host)
        .map_err(cuda("staging a device buffer to the host"))?;
    synchronize(stream, "staging a device buffer to the host")?;
    body(T::host(host))
}

fn upload_typed<T: CommElement + DeviceRepr + ValidAsZeroBits + Copy>(
    cache: &mut Option<PinnedHostSlice<T>>,
    stream: &Arc<CudaStream>,
    mut view: CudaViewMut<'_, T>,
    src: &[T],
) -> Result<()> {
    order_after_owner(stream, view.stream())?;
    let host = pinned(cache, stream, view.len())?;
    host.copy_from_slice(src);
    stream
        .memcpy_htod(&*host, &mut view)
        .map_err(cuda("copying a received buffer to the device"))?;
    // The next staging refills the same page-locked buffer.
    synchronize(stream, "copying a received buffer to the device")
}

/// An owned host copy of a device buffer in its dtype: what a batch of point-to-point
/// operations on device buffers exchanges over the host communicator.
#[derive(Debug)]
pub(crate) enum HostCopy {
    F32(Vec<f32>),
    BF16(Vec<half::bf16>),
    F16(Vec<half::f16>),
}

impl HostCopy {
    /// `len` zeros of `dtype`.
    pub(crate) fn zeros(dtype: tilearn_ops::DType, len: usize) -> HostCopy {
        match dtype {
            tilearn_ops::DType::F32 => HostCopy::F32(vec![0.0; len]),
            tilearn_ops::DType::BF16 => HostCopy::BF16(vec![half::bf16::ZERO; len]),
            tilearn_ops::DType::F16 => HostCopy::F16(vec![half::f16::ZERO; len]),
        }
    }

    /// A copy of `host`.
    pub(crate) fn of(host: HostSlice<'_>) -> HostCopy {
        match host {
            HostSlice::F32(s) => HostCopy::F32(s.to_vec()),
            HostSlice::BF16(s) => HostCopy::BF16(s.to_vec()),
            HostSlice::F16(s) => HostCopy::F16(s.to_vec()),
        }
    }

    pub(crate) fn host(&self) -> HostSlice<'_> {
        match self {
            HostCopy::F32(v) => HostSlice::F32(v),
            HostCopy::BF16(v) => HostSlice::BF16(v),
            HostCopy::F16(v) => HostSlice::F16(v),
        }
    }

    pub(crate) fn host_mut(&mut self) -> HostSliceMut<'_> {
        match self {
            HostCopy::F32(v) => HostSliceMut::F32(v),
            HostCopy::BF16(v) => HostSliceMut::BF16(v),
            HostCopy::F16(v) => HostSliceMut::F16(v),
        }
    }
}

impl Staging {
    /// The stream the copies run on (the host communicator needs one for device buffers).
    pub fn set_stream(&self, stream: Arc<CudaStream>) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stream = Some(stream);
    }

    /// A new staging with this one's stream (if set) and buffers of its own: a sub-group's, so
    /// that the groups of a tensor- or pipeline-parallel GPU run made from a world whose
    /// stream was set can take device buffers too.
    pub fn child(&self) -> Staging {
        let child = Staging::default();
        if let Some(stream) = &self.state.lock().unwrap_or_else(|p| p.into_inner()).stream {
            child.set_stream(stream.clone());
        }
        child
    }

    fn with_state<R>(
        &self,
        body: impl FnOnce(&mut State, &Arc<CudaStream>) -> Result<R>,
    ) -> Result<R> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let stream = state
            .stream
            .clone()
            .ok_or_else(|| ParallelError::Unsupported {
                op: "a collective on a device buffer",
                backend: "host",
                reason: "no staging stream: call HostCommunicator::set_staging_stream first".into(),
            })?;
        body(&mut state, &stream)
    }

    /// Copies `device` to the host, runs `body` on the copy, and copies the result back.
    pub fn round_trip(
        &self,
        device: DeviceSliceMut<'_>,
        body: impl FnOnce(HostSliceMut<'_>) -> Result<()>,
    ) -> Result<()> {
        self.with_state(|state, stream| match device {
            DeviceSliceMut::F32(v) => round_trip_typed(&mut state.f32, stream, v, body),
            DeviceSliceMut::BF16(v) => round_trip_typed(&mut state.bf16, stream, v, body),
            DeviceSliceMut::F16(v) => round_trip_typed(&mut state.f16, stream, v, body),
        })
    }

    /// Copies `host` into `device` (same dtype and length).
    pub fn upload(&self, device: DeviceSliceMut<'_>, host: HostSlice<'_>) -> Result<()> {
        if device.dtype() != host.dtype() || device.len() != host.len() {
            return Err(ParallelError::Usage {
                flag: "batch_p2p".into(),
                reason: format!(
                    "a received {} message of {} elements does not fit the {} device buffer of \
                     {} elements it was posted for",
                    host.dtype(),
                    host.len(),
                    device.dtype(),
                    device.len()
                ),
            });
        }
        self.with_state(|state, stream| match (device, host) {
            (DeviceSliceMut::F32(v), HostSlice::F32(h)) => {
                upload_typed(&mut state.f32, stream, v, h)
            }
            (DeviceSliceMut::BF16(v), HostSlice::BF16(h)) => {
                upload_typed(&mut state.bf16, stream, v, h)
            }
            (DeviceSliceMut::F16(v), HostSlice::F16(h)) => {
                upload_typed(&mut state.f16, stream, v, h)
            }
            _ => unreachable!("the dtypes were compared above"),
        })
    }

    /// Copies `device` to the host and runs `body` on the copy.
    pub fn download(
        &self,
        device: DeviceSlice<'_>,
        body: impl FnOnce(HostSlice<'_>) -> Result<()>,
    ) -> Result<()> {
        self.with_state(|state, stream| match device {
            DeviceSlice::F32(v) => download_typed(&mut state.f32, stream, v, body),
            DeviceSlice::BF16(v) => download_typed(&mut state.bf16, stream, v, body),
            DeviceSlice::F16(v) => download_typed(&mut state.f16, stream, v, body),
        })
    }
}
