//! The communicator a check runs on: the host (TCP) communicator with host buffers, or NCCL with
//! device buffers on the rank's GPU. Device buffers are allocated on a stream of their own (a
//! training step's compute stream plays that role), so the check also exercises ordering the
//! communication stream after the stream that wrote a buffer.

#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use tilearn_parallel::host::HostCommunicator;
use tilearn_parallel::{
    BufferMut, CommElement, Communicator, ParallelError, ProcessGroup, ReduceOp, Result,
};

/// What a buffer element needs on this build: nothing more on the host, a device type with CUDA.
#[cfg(feature = "cuda")]
pub trait DeviceElement: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
#[cfg(feature = "cuda")]
impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> DeviceElement for T {}
#[cfg(not(feature = "cuda"))]
pub trait DeviceElement {}
#[cfg(not(feature = "cuda"))]
impl<T> DeviceElement for T {}

pub enum Backend {
    Host(HostCommunicator),
    #[cfg(feature = "cuda")]
    Nccl {
        comm: tilearn_parallel::nccl::NcclCommunicator,
        /// Where the buffers live (not the communication stream).
        stream: Arc<CudaStream>,
    },
}

/// A buffer of the backend's kind: host memory, or device memory for NCCL.
pub enum Buffer<T: CommElement + DeviceElement> {
    Host(Vec<T>),
    #[cfg(feature = "cuda")]
    Device(CudaSlice<T>),
}

impl<T: CommElement + DeviceElement> Buffer<T> {
    /// Its first `len` elements, as a communicator buffer.
    pub fn part(&mut self, len: usize) -> BufferMut<'_> {
        match self {
            Buffer::Host(v) => BufferMut::from(&mut v[..len]),
            #[cfg(feature = "cuda")]
            Buffer::Device(d) => BufferMut::from(d.slice_mut(..len)),
        }
    }
}

fn usage(reason: String) -> ParallelError {
    ParallelError::Usage {
        flag: "--backend".into(),
        reason,
    }
}

#[cfg(feature = "cuda")]
fn cuda(context: &'static str) -> impl Fn(cudarc::driver::DriverError) -> ParallelError {
    move |e| ParallelError::Cuda {
        context: context.into(),
        message: e.to_string(),
    }
}

impl Backend {
    /// `host`, or `nccl` (feature `cuda`) on the GPU numbered `LOCAL_RANK`.
    pub fn new(group: &ProcessGroup, name: &str) -> Result<Backend> {
        match name {
            "host" => Ok(Backend::Host(group.host_communicator()?)),
            #[cfg(feature = "cuda")]
            "nccl" => {
                let comm = tilearn_parallel::nccl::NcclCommunicator::for_local_rank(group)?;
                let stream = comm
                    .stream()
                    .context()
                    .new_stream()
                    .map_err(cuda("creating the buffers' stream"))?;
                Ok(Backend::Nccl { comm, stream })
            }
            other => Err(usage(format!(
                "{other:?} is not available (host{})",
                if cfg!(feature = "cuda") {
                    ", nccl"
                } else {
                    "; nccl needs the cuda feature"
                }
            ))),
        }
    }

    pub fn comm(&self) -> &dyn Communicator {
        match self {
            Backend::Host(c) => c,
            #[cfg(feature = "cuda")]
            Backend::Nccl { comm, .. } => comm,
        }
    }

    /// A buffer holding `values`, where the backend communicates.
    pub fn buffer<T: CommElement + DeviceElement>(&self, values: Vec<T>) -> Result<Buffer<T>> {
        match self {
            Backend::Host(_) => Ok(Buffer::Host(values)),
            #[cfg(feature = "cuda")]
            Backend::Nccl { stream, .. } => Ok(Buffer::Device(
                stream
                    .clone_htod(&values)
                    .map_err(cuda("copying a buffer to the GPU"))?,
            )),
        }
    }

    /// `values` reduced with `op` over the ranks (through the backend's kind of buffer).
    pub fn all_reduce<T: CommElement + DeviceElement>(
        &self,
        values: Vec<T>,
        op: ReduceOp,
    ) -> Result<Vec<T>> {
        let len = values.len();
        let mut buffer = self.buffer(values)?;
        self.comm().all_reduce(buffer.part(len), op)?.wait()?;
        match buffer {
            Buffer::Host(v) => Ok(v),
            // Waiting blocked until the collective finished, and cudarc's events order the
            // download after it; a copy into pageable memory returns once complete.
            #[cfg(feature = "cuda")]
            Buffer::Device(d) => match self {
                Backend::Nccl { stream, .. } => stream
                    .clone_dtoh(&d)
                    .map_err(cuda("copying a buffer from the GPU")),
                Backend::Host(_) => unreachable!("host backends make host buffers"),
            },
        }
    }

    pub fn all_reduce_sum<T: CommElement + DeviceElement>(&self, values: Vec<T>) -> Result<Vec<T>> {
        self.all_reduce(values, ReduceOp::Sum)
    }

    /// A point in time on the backend's timeline: the communication stream for NCCL (so that
    /// only the collectives are timed, as CUDA events time them for torch.distributed), the
    /// host clock otherwise.
    pub fn mark(&self) -> Result<Mark> {
        match self {
            Backend::Host(_) => Ok(Mark::Host(std::time::Instant::now())),
            #[cfg(feature = "cuda")]
            Backend::Nccl { comm, .. } => comm
                .stream()
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map(Mark::Device)
                .map_err(cuda("recording a timing event")),
        }
    }
}

pub enum Mark {
    Host(std::time::Instant),
    #[cfg(feature = "cuda")]
    Device(CudaEvent),
}

impl Mark {
    /// Seconds from `self` to `end` (waits for a device event to complete).
    pub fn seconds_to(&self, end: &Mark) -> Result<f64> {
        match (self, end) {
            (Mark::Host(a), Mark::Host(b)) => Ok(b.duration_since(*a).as_secs_f64()),
            #[cfg(feature = "cuda")]
            (Mark::Device(a), Mark::Device(b)) => a
                .elapsed_ms(b)
                .map(|ms| f64::from(ms) / 1e3)
                .map_err(cuda("reading a timing event")),
            #[cfg(feature = "cuda")]
            _ => unreachable!("both marks come from one backend"),
        }
    }
}
