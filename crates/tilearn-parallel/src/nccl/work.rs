//! NCCL work handles: an event recorded on the communication stream after the collective.
//! Waiting polls the event and NCCL's asynchronous error; past the timeout it aborts the
//! communicator (the only way to unblock NCCL) and fails with [`ParallelError::Timeout`].

use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};

use crate::error::{ParallelError, Result};
use crate::nccl::library::CommHandle;
use crate::work::PendingWork;

pub struct NcclWork {
    pub(crate) event: CudaEvent,
    pub(crate) comm: CommHandle,
    pub(crate) op: &'static str,
    pub(crate) timeout: Duration,
}

fn cuda(context: &str, e: cudarc::driver::DriverError) -> ParallelError {
    ParallelError::Cuda {
        context: context.to_string(),
        message: e.to_string(),
    }
}

impl PendingWork for NcclWork {
    fn wait(self: Box<Self>) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        loop {
            if self.event.try_is_complete().map_err(|e| cuda(self.op, e))? {
                return self.comm.async_error();
            }
            self.comm.async_error()?;
            if Instant::now() >= deadline {
                self.comm.abort();
                return Err(ParallelError::Timeout {
                    op: self.op,
                    peer: "the NCCL communicator's other ranks".into(),
                    timeout: self.timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn is_complete(&self) -> Result<bool> {
        self.event.try_is_complete().map_err(|e| cuda(self.op, e))
    }

    fn wait_on_stream(self: Box<Self>, stream: &CudaStream) -> Result<()> {
        stream
            .wait(&self.event)
            .map_err(|e| cuda("ordering a stream after NCCL work", e))
    }
}
