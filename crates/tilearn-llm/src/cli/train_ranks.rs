//! `tilearn train` as one rank of a launched job (`tilearn launch`, torchrun or srun): joining the
//! process group, choosing the communicators, and how a rank reports output and failures.
//!
//! A process that some launcher started (even a group of one) joins the group and trains data
//! parallel; a plain `tilearn train` runs alone. Device buffers (gradients, and the activations
//! and partial sums of tensor and pipeline parallelism) go over NCCL when each rank of the node
//! has a GPU of its own, or over the host (TCP) communicator on the CPU and when ranks share a
//! GPU (staged through page-locked memory); scalars always go over the host communicator.

use std::sync::Arc;

use clap::ValueEnum;
use tilearn_engine::EngineError;
use tilearn_engine::trainer::{DataParallel, DdpOptions, LogRecord, ProgressSink};
use tilearn_parallel::host::HostCommunicator;
use tilearn_parallel::rank_env::Launcher;
use tilearn_parallel::{Communicator, ProcessGroup, RankEnv};

use crate::{LlmError, Result};

/// `--ddp-backend`: what carries device buffers between ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DdpBackend {
    /// NCCL, one GPU per rank (the default on the GPU when the node has a GPU for each rank).
    Nccl,
    /// The host (TCP) communicator (the CPU's, and the default for ranks that share a GPU).
    Host,
}

impl DdpBackend {
    /// `chosen`, else NCCL when each of the node's `local_ranks` has one of its `gpus` to
    /// itself, else the host communicator (NCCL refuses two ranks of a group on one GPU).
    pub fn for_gpus(chosen: Option<DdpBackend>, local_ranks: usize, gpus: usize) -> DdpBackend {
        chosen.unwrap_or(if local_ranks <= gpus {
            DdpBackend::Nccl
        } else {
            DdpBackend::Host
        })
    }
}

/// This process's membership in a launched job.
pub struct Ranks {
    pub group: ProcessGroup,
    pub host: Arc<HostCommunicator>,
}

impl Ranks {
    /// Joins the job when a launcher started this process; `None` for a plain run.
    pub fn join() -> Result<Option<Ranks>> {
        let env = RankEnv::from_env()?;
        if env.launcher == Launcher::Single {
            return Ok(None);
        }
        let group = ProcessGroup::init(env, tilearn_parallel::GroupOptions::from_env()?)?;
        let host = Arc::new(group.host_communicator()?);
        Ok(Some(Ranks { group, host }))
    }

    pub fn is_primary(&self) -> bool {
        self.group.rank() == 0
    }

    /// Runs `first` on rank 0 alone, then on the other ranks once rank 0 is done (e.g. rank 0
    /// generates the embedded corpus that every rank then opens).
    pub fn rank0_first<T>(&self, mut first: impl FnMut() -> Result<T>) -> Result<T> {
        let value = if self.is_primary() {
            Some(first()?)
        } else {
            None
        };
        self.host.barrier()?;
        match value {
            Some(v) => Ok(v),
            None => first(),
        }
    }

    /// Data parallelism over `grads` (see [`Self::gradient_communicator`]) for a model of
    /// `numel` parameters.
    pub fn data_parallel(
        &self,
        grads: Arc<dyn Communicator>,
        options: DdpOptions,
        numel: usize,
    ) -> Result<DataParallel> {
        let scalars: Arc<dyn Communicator> = self.host.clone();
        Ok(DataParallel::new(grads, scalars, options, numel)?)
    }

    /// The gradients' communicator for a CPU run: the host one (NCCL needs GPU buffers).
    pub fn cpu_gradient_communicator(
        &self,
        backend: Option<DdpBackend>,
    ) -> Result<Arc<dyn Communicator>> {
        if backend == Some(DdpBackend::Nccl) {
            return Err(LlmError::Usage {
                flag: "--ddp-backend nccl".into(),
                message: "NCCL communicates GPU buffers; a CPU run uses the host backend (drop \
                          the flag or use --ddp-backend host)"
                    .into(),
            });
        }
        Ok(self.host.clone())
    }

    /// The backend for device buffers: `chosen`, else by [`DdpBackend::for_gpus`] from the
    /// node's ranks and visible GPUs.
    #[cfg(feature = "cuda")]
    pub fn device_backend(&self, chosen: Option<DdpBackend>) -> DdpBackend {
        let gpus = tilearn_ops::backend::probe().devices.len();
        DdpBackend::for_gpus(chosen, self.group.env().local_world_size, gpus)
    }

    /// The gradients' communicator for a GPU run on `stream`'s device: NCCL or the host
    /// communicator staging through page-locked memory on `stream` (see
    /// [`Self::device_backend`]).
    #[cfg(feature = "cuda")]
    pub fn gpu_gradient_communicator(
        &self,
        backend: Option<DdpBackend>,
        stream: Arc<cudarc::driver::CudaStream>,
    ) -> Result<Arc<dyn Communicator>> {
        match self.device_backend(backend) {
            DdpBackend::Host => {
                self.host.set_staging_stream(stream);
                Ok(self.host.clone())
            }
            DdpBackend::Nccl => {
                let nccl =
                    tilearn_parallel::nccl::NcclCommunicator::new(&self.group, stream.context())?;
                Ok(Arc::new(nccl))
            }
        }
    }

    /// The whole job's communicator for a model split over GPUs (tensor or pipeline
    /// parallelism, with data parallelism around it), from which each rank's groups are cut:
    /// device buffers over NCCL and host buffers over the host communicator
    /// ([`RoutedCommunicator`](tilearn_parallel::RoutedCommunicator)), or everything over the
    /// host communicator staging device buffers on `stream` (see [`Self::device_backend`]).
    #[cfg(feature = "cuda")]
    pub fn gpu_model_parallel_world(
        &self,
        backend: Option<DdpBackend>,
        stream: Arc<cudarc::driver::CudaStream>,
    ) -> Result<Arc<dyn Communicator>> {
        self.host.set_staging_stream(stream.clone());
        match self.device_backend(backend) {
            DdpBackend::Host => Ok(self.host.clone()),
            DdpBackend::Nccl => {
                let nccl =
                    tilearn_parallel::nccl::NcclCommunicator::new(&self.group, stream.context())?;
                let routed =
                    tilearn_parallel::RoutedCommunicator::new(Arc::new(nccl), self.host.clone())?;
                Ok(Arc::new(routed))
            }
        }
    }

    /// Ends a failed rank: under `tilearn launch` the launcher prints one line for the job, so
    /// the rank reports instead of printing (see [`ProcessGroup::report_or_print`]).
    pub fn report(&self, error: LlmError) -> LlmError {
        self.group
            .report_or_print(&error.to_string(), is_secondary(&error));
        LlmError::Reported
    }
}

/// Whether `error` only echoes another rank's failure (a lost or silent peer).
fn is_secondary(error: &LlmError) -> bool {
    match error {
        LlmError::Parallel(p) | LlmError::Engine(EngineError::Parallel(p)) => p.is_secondary(),
        _ => false,
    }
}

/// The progress sink of ranks other than 0: they print nothing (errors end the rank through
/// [`Ranks::report`]).
pub struct Quiet;

impl ProgressSink for Quiet {
    fn start(&mut self, _: u64, _: u64) {}
    fn step(&mut self, _: u64, _: f64, _: f64) {}
    fn log(&mut self, _: &LogRecord) {}
    fn finish(&mut self) {}
    fn note(&mut self, _: &str) {}
    fn warn(&mut self, _: &str) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_by_default_only_where_each_rank_has_a_gpu_of_its_own() {
        assert_eq!(DdpBackend::for_gpus(None, 2, 2), DdpBackend::Nccl);
        assert_eq!(DdpBackend::for_gpus(None, 1, 8), DdpBackend::Nccl);
        assert_eq!(DdpBackend::for_gpus(None, 2, 1), DdpBackend::Host);
        assert_eq!(DdpBackend::for_gpus(None, 4, 0), DdpBackend::Host);
        // An explicit choice stands either way (NCCL then refuses ranks sharing a GPU itself).
        let nccl = Some(DdpBackend::Nccl);
        assert_eq!(DdpBackend::for_gpus(nccl, 2, 1), DdpBackend::Nccl);
        let host = Some(DdpBackend::Host);
        assert_eq!(DdpBackend::for_gpus(host, 2, 2), DdpBackend::Host);
    }
}
