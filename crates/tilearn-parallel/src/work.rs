//! Work handles: what an asynchronous collective returns. Waiting ends with the collective's error
//! (including a timeout); the handle borrows the buffer, so the buffer cannot be touched by safe
//! code before the work is waited for or dropped.

use std::marker::PhantomData;

use crate::error::Result;

/// A collective in flight, as a backend implements it.
pub trait PendingWork: Send {
    /// Blocks the calling thread until the work is complete (or fails, or times out).
    fn wait(self: Box<Self>) -> Result<()>;
    /// Whether the work is complete, without blocking.
    fn is_complete(&self) -> Result<bool>;
    /// Makes later work on `stream` wait for this work without blocking the host.
    #[cfg(feature = "cuda")]
    fn wait_on_stream(self: Box<Self>, stream: &cudarc::driver::CudaStream) -> Result<()>;
}

/// The handle of a collective: complete already (the host backend runs collectives in the call)
/// or pending on a device stream (NCCL).
#[must_use = "wait for the work (or drop it on purpose) before using the buffer"]
pub struct Work<'a> {
    pending: Option<Box<dyn PendingWork + 'a>>,
    _buffer: PhantomData<&'a mut ()>,
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("pending", &self.pending.is_some())
            .finish()
    }
}

impl<'a> Work<'a> {
    /// Work that finished inside the call that returned it.
    pub fn completed() -> Self {
        Work {
            pending: None,
            _buffer: PhantomData,
        }
    }

    /// Work a backend will complete later.
    pub fn pending(pending: Box<dyn PendingWork + 'a>) -> Self {
        Work {
            pending: Some(pending),
            _buffer: PhantomData,
        }
    }

    /// Blocks until the work is complete; its error if it failed or timed out.
    pub fn wait(self) -> Result<()> {
        match self.pending {
            None => Ok(()),
            Some(p) => p.wait(),
        }
    }

    /// Whether the work is complete, without blocking.
    pub fn is_complete(&self) -> Result<bool> {
        match &self.pending {
            None => Ok(true),
            Some(p) => p.is_complete(),
        }
    }

    /// Orders later work on `stream` (e.g. the optimizer step) after this work, without blocking
    /// the host: how the trainer overlaps communication with compute.
    #[cfg(feature = "cuda")]
    pub fn wait_on_stream(self, stream: &cudarc::driver::CudaStream) -> Result<()> {
        match self.pending {
            None => Ok(()),
            Some(p) => p.wait_on_stream(stream),
        }
    }
}
