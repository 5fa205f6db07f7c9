//! A backend's flat buffer (all gradients, or all parameters) as the communicators see it: a
//! host f32 slice, or (feature `cuda`) a device view with the compute stream that wrote it
//! (f32, or the 16-bit working weights a ZeRO step all-gathers). Buckets and shards are
//! sub-ranges of it, handed to the communicator without a copy.

use std::ops::Range;

use tilearn_parallel::{BufferMut, Work};

use crate::Result;

/// The whole flat buffer of one backend.
pub enum FlatBuffer<'a> {
    Host(&'a mut [f32]),
    #[cfg(feature = "cuda")]
    Device {
        view: cudarc::driver::CudaViewMut<'a, f32>,
        /// The stream the backend computes on: what communication must be ordered against.
        stream: std::sync::Arc<cudarc::driver::CudaStream>,
    },
    /// 16-bit device data (the GPU engine's working weights under ZeRO).
    #[cfg(feature = "cuda")]
    DeviceHalf {
        view: crate::gpu::HalfViewMut<'a>,
        stream: std::sync::Arc<cudarc::driver::CudaStream>,
    },
}

impl FlatBuffer<'_> {
    pub fn len(&self) -> usize {
        match self {
            FlatBuffer::Host(s) => s.len(),
            #[cfg(feature = "cuda")]
            FlatBuffer::Device { view, .. } => view.len(),
            #[cfg(feature = "cuda")]
            FlatBuffer::DeviceHalf { view, .. } => match view {
                crate::gpu::HalfViewMut::Bf16(v) => v.len(),
                crate::gpu::HalfViewMut::F16(v) => v.len(),
            },
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host slice, if the buffer lives on the host (where bf16 compression and the ZeRO-2
    /// accumulation run).
    pub fn host(&mut self) -> Option<&mut [f32]> {
        match self {
            FlatBuffer::Host(s) => Some(s),
            #[cfg(feature = "cuda")]
            FlatBuffer::Device { .. } | FlatBuffer::DeviceHalf { .. } => None,
        }
    }

    /// Sets elements `range` to zero (on the device: queued on the compute stream, after
    /// which collectives on the buffer are ordered).
    pub fn zero(&mut self, range: Range<usize>) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        match self {
            FlatBuffer::Host(s) => s[range].fill(0.0),
            #[cfg(feature = "cuda")]
            FlatBuffer::Device { view, stream } => stream
                .memset_zeros(&mut view.slice_mut(range))
                .map_err(|e| crate::gpu::cuda_err("zeroing gradients outside the shard", e))?,
            #[cfg(feature = "cuda")]
            FlatBuffer::DeviceHalf { .. } => {
                return Err(crate::EngineError::InvalidArgument {
                    argument: "FlatBuffer::zero".into(),
                    message: "internal: only f32 buffers are zeroed".into(),
                });
            }
        }
        Ok(())
    }

    /// Elements `range` as a communicator buffer (a view, no copy).
    pub fn part(&mut self, range: Range<usize>) -> BufferMut<'_> {
        match self {
            FlatBuffer::Host(s) => BufferMut::from(&mut s[range]),
            #[cfg(feature = "cuda")]
            FlatBuffer::Device { view, .. } => BufferMut::from(view.slice_mut(range)),
            #[cfg(feature = "cuda")]
            FlatBuffer::DeviceHalf { view, .. } => match view {
                crate::gpu::HalfViewMut::Bf16(v) => BufferMut::from(v.slice_mut(range)),
                crate::gpu::HalfViewMut::F16(v) => BufferMut::from(v.slice_mut(range)),
            },
        }
    }

    /// Splits at `mid` into `..mid` and `mid..`, both views (for collectives in flight on
    /// disjoint buckets at once).
    pub fn split_at(&mut self, mid: usize) -> (FlatBuffer<'_>, FlatBuffer<'_>) {
        match self {
            FlatBuffer::Host(s) => {
                let (a, b) = s.split_at_mut(mid);
                (FlatBuffer::Host(a), FlatBuffer::Host(b))
            }
            #[cfg(feature = "cuda")]
            FlatBuffer::Device { view, stream } => {
                let (a, b) = view.split_at_mut(mid);
                (
                    FlatBuffer::Device {
                        view: a,
                        stream: stream.clone(),
                    },
                    FlatBuffer::Device {
                        view: b,
                        stream: stream.clone(),
                    },
                )
            }
            #[cfg(feature = "cuda")]
            FlatBuffer::DeviceHalf { view, stream } => {
                use crate::gpu::HalfViewMut;
                let (a, b) = match view {
                    HalfViewMut::Bf16(v) => {
                        let (a, b) = v.split_at_mut(mid);
                        (HalfViewMut::Bf16(a), HalfViewMut::Bf16(b))
                    }
                    HalfViewMut::F16(v) => {
                        let (a, b) = v.split_at_mut(mid);
                        (HalfViewMut::F16(a), HalfViewMut::F16(b))
                    }
                };
                (
                    FlatBuffer::DeviceHalf {
                        view: a,
                        stream: stream.clone(),
                    },
                    FlatBuffer::DeviceHalf {
                        view: b,
                        stream: stream.clone(),
                    },
                )
            }
        }
    }

    /// How collectives on this buffer are completed (taken before the buffer is lent to one).
    pub fn completion(&self) -> Completion {
        match self {
            FlatBuffer::Host(_) => Completion::Host,
            #[cfg(feature = "cuda")]
            FlatBuffer::Device { stream, .. } | FlatBuffer::DeviceHalf { stream, .. } => {
                Completion::Stream(stream.clone())
            }
        }
    }
}

/// How the trainer completes a collective on a [`FlatBuffer`].
pub enum Completion {
    /// The host waits.
    Host,
    /// The compute stream is ordered after the collective without blocking the host (NCCL), so
    /// the optimizer kernels that read the gradients next run after it.
    #[cfg(feature = "cuda")]
    Stream(std::sync::Arc<cudarc::driver::CudaStream>),
}

impl Completion {
    pub fn finish(&self, work: Work<'_>) -> Result<()> {
        match self {
            Completion::Host => Ok(work.wait()?),
            #[cfg(feature = "cuda")]
            Completion::Stream(stream) => Ok(work.wait_on_stream(stream)?),
        }
    }
}
