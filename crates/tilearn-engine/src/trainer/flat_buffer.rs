//! A backend's flat f32 buffer (all gradients, or all parameters) as the communicators see it:
//! a host slice, or (feature `cuda`) a device view with the compute stream that wrote it. Buckets
//! and shards are sub-ranges of it, handed to the communicator without a copy.

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
}

impl FlatBuffer<'_> {
    pub fn len(&self) -> usize {
        match self {
            FlatBuffer::Host(s) => s.len(),
            #[cfg(feature = "cuda")]
            FlatBuffer::Device { view, .. } => view.len(),
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
            FlatBuffer::Device { .. } => None,
        }
    }

    /// Elements `range` as a communicator buffer (a view, no copy).
    pub fn part(&mut self, range: Range<usize>) -> BufferMut<'_> {
        match self {
            FlatBuffer::Host(s) => BufferMut::from(&mut s[range]),
            #[cfg(feature = "cuda")]
            FlatBuffer::Device { view, .. } => BufferMut::from(view.slice_mut(range)),
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
        }
    }

    /// How collectives on this buffer are completed (taken before the buffer is lent to one).
    pub fn completion(&self) -> Completion {
        match self {
            FlatBuffer::Host(_) => Completion::Host,
            #[cfg(feature = "cuda")]
            FlatBuffer::Device { stream, .. } => Completion::Stream(stream.clone()),
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
