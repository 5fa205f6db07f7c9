//! Tensor parallelism on the device: the partial sums of a rank's column-/row-parallel products
//! completed through a communicator on device buffers (see "Tensor parallelism on the GPU
//! engine" in `docs/ARCHITECTURE.md`).
//!
//! A tensor-parallel rank's [`GpuLlama`](super::GpuLlama) is built for the tp-local config
//! (its query and kv heads, its intermediate columns, its rows of the vocabulary) and runs the
//! single rank's forward and backward with four completions per layer: the o_proj and down_proj
//! outputs forward, the input gradients of q/k/v and of gate/up backward. Everything between
//! them is either the rank's own heads/columns or replicated, as on the CPU engine. The
//! vocabulary-parallel embedding and loss head complete theirs too (`vocab_parallel.rs`: the
//! lookup, the cross entropy's row maxima (a maximum) and sums, the hidden state's gradient).

use std::any::TypeId;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::CudaViewMut;
use half::{bf16, f16};
use tilearn_ops::cuda::DeviceFloat;
use tilearn_parallel::{BufferMut, Communicator, ReduceOp};

use crate::error::{EngineError, Result};

/// Completes a partial result held on the device by every rank of a tensor-parallel group.
pub trait DeviceSums: Send + Sync + fmt::Debug {
    /// Replaces `buf` by its element-wise sum over the group (same length on every rank,
    /// called in the same order on every rank).
    fn sum(&self, buf: BufferMut<'_>) -> Result<()>;
    /// Replaces `buf` by its element-wise maximum over the group (as [`sum`](Self::sum)).
    fn max(&self, buf: BufferMut<'_>) -> Result<()>;
}

/// [`DeviceSums`] over a communicator: one all-reduce per call (the host communicator stages
/// device buffers through page-locked memory; NCCL reduces them in place).
pub struct GroupDeviceSums {
    comm: Arc<dyn Communicator>,
}

impl GroupDeviceSums {
    pub fn new(comm: Arc<dyn Communicator>) -> GroupDeviceSums {
        GroupDeviceSums { comm }
    }
}

impl fmt::Debug for GroupDeviceSums {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GroupDeviceSums(rank {} of {})",
            self.comm.rank(),
            self.comm.world_size()
        )
    }
}

impl DeviceSums for GroupDeviceSums {
    fn sum(&self, buf: BufferMut<'_>) -> Result<()> {
        self.comm.all_reduce(buf, ReduceOp::Sum)?.wait()?;
        Ok(())
    }

    fn max(&self, buf: BufferMut<'_>) -> Result<()> {
        self.comm.all_reduce(buf, ReduceOp::Max)?.wait()?;
        Ok(())
    }
}

/// `view` (of one of the engine's element types) as a communicator buffer.
fn device_buffer<'b, T: DeviceFloat>(view: &'b mut CudaViewMut<'_, T>) -> Result<BufferMut<'b>> {
    let len = view.len();
    let id = TypeId::of::<T>();
    // SAFETY: each branch reinterprets the view as the very type it has (checked by TypeId),
    // with its own length: a no-op cast that only names the type for the communicator.
    let buffer = unsafe {
        if id == TypeId::of::<f32>() {
            view.transmute_mut::<f32>(len).map(BufferMut::from)
        } else if id == TypeId::of::<bf16>() {
            view.transmute_mut::<bf16>(len).map(BufferMut::from)
        } else if id == TypeId::of::<f16>() {
            view.transmute_mut::<f16>(len).map(BufferMut::from)
        } else {
            None
        }
    };
    buffer.ok_or_else(|| EngineError::InvalidArgument {
        argument: "tensor parallelism".into(),
        message: format!("internal: {} buffers cannot be all-reduced", T::NAME),
    })
}

/// Completes `view` over the tensor-parallel group when there is one (a no-op alone).
pub(crate) fn complete<T: DeviceFloat>(
    sums: Option<&dyn DeviceSums>,
    view: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    match sums {
        Some(s) => s.sum(device_buffer(view)?),
        None => Ok(()),
    }
}

/// Replaces `view` by its element-wise maximum over the tensor-parallel group when there is
/// one (a no-op alone).
pub(crate) fn complete_max<T: DeviceFloat>(
    sums: Option<&dyn DeviceSums>,
    view: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    match sums {
        Some(s) => s.max(device_buffer(view)?),
        None => Ok(()),
    }
}
