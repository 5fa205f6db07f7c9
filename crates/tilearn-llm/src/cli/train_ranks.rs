//! `tilearn train` as one rank of a launched job (`tilearn launch`, torchrun or srun): joining the
//! process group, choosing the communicators, and how a rank reports output and failures.
//!
//! A process that some launcher started (even a group of one) joins the group and trains data
//! parallel; a plain `tilearn train` runs alone. Device buffers (gradients, and the activations
//! and partial sums of tensor and pipeline parallelism) go over NCCL unless two ranks run on one
//! GPU, else over the host (TCP) communicator (staged through page-locked memory; the CPU's
//! too); scalars always go over the host communicator.

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
    /// NCCL, one GPU per rank (the default on the GPU unless two ranks run on one GPU).
    Nccl,
    /// The host (TCP) communicator (the CPU's, and the default for ranks that share a GPU).
    Host,
}

impl DdpBackend {
    /// `chosen`, else NCCL unless two ranks of the job run on one GPU, where the host
    /// communicator is the default (NCCL refuses two ranks of a group on one GPU).
    pub fn or_default(chosen: Option<DdpBackend>, ranks_share_a_gpu: bool) -> DdpBackend {
        chosen.unwrap_or(if ranks_share_a_gpu {
            DdpBackend::Host
        } else {
            DdpBackend::Nccl
        })
    }
}

/// Whether two of the ranks' GPU ids (UUIDs, one per rank) are the same GPU.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // asked only where GPUs are
fn any_shared(gpu_ids: &[u128]) -> bool {
    let mut sorted = gpu_ids.to_vec();
    sorted.sort_unstable();
    sorted.windows(2).any(|w| w[0] == w[1])
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

    /// The backend for device buffers of ranks computing on `ctx`'s GPU: `chosen`, else by
    /// [`DdpBackend::or_default`] from whether two ranks of the job run on the same GPU,
    /// compared by the GPUs' UUIDs over the host communicator (so it holds whatever each rank's
    /// `CUDA_VISIBLE_DEVICES` is). Collective when `chosen` is `None` (every rank has the same
    /// flags, so all or none of them gather).
    #[cfg(feature = "cuda")]
    pub fn device_backend(
        &self,
        chosen: Option<DdpBackend>,
        ctx: &cudarc::driver::CudaContext,
    ) -> Result<DdpBackend> {
        if let Some(backend) = chosen {
            return Ok(backend);
        }
        let uuid = ctx.uuid().map_err(|e| LlmError::Usage {
            flag: "--ddp-backend".into(),
            message: format!(
                "cannot read this rank's GPU id to tell whether ranks share a GPU ({e}); pass \
                 --ddp-backend nccl or host"
            ),
        })?;
        let id = u128::from_le_bytes(uuid.bytes.map(|b| b as u8));
        let high = tilearn_parallel::scalars::gather_words(self.host.as_ref(), (id >> 64) as u64)?;
        let low = tilearn_parallel::scalars::gather_words(self.host.as_ref(), id as u64)?;
        let ids: Vec<u128> = high
            .into_iter()
            .zip(low)
            .map(|(h, l)| (u128::from(h) << 64) | u128::from(l))
            .collect();
        Ok(DdpBackend::or_default(None, any_shared(&ids)))
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
        Ok(match self.nccl_or_host_staging(backend, stream)? {
            Some(nccl) => nccl,
            None => self.host.clone(),
        })
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
        Ok(match self.nccl_or_host_staging(backend, stream)? {
            Some(nccl) => Arc::new(tilearn_parallel::RoutedCommunicator::new(
                nccl,
                self.host.clone(),
            )?),
            None => self.host.clone(),
        })
    }

    /// The job's NCCL communicator on `stream`'s GPU, or `None` where device buffers go over
    /// the host communicator, which then stages them on `stream`.
    #[cfg(feature = "cuda")]
    fn nccl_or_host_staging(
        &self,
        backend: Option<DdpBackend>,
        stream: Arc<cudarc::driver::CudaStream>,
    ) -> Result<Option<Arc<dyn Communicator>>> {
        match self.device_backend(backend, stream.context())? {
            DdpBackend::Host => {
                self.host.set_staging_stream(stream);
                Ok(None)
            }
            DdpBackend::Nccl => {
                let nccl =
                    tilearn_parallel::nccl::NcclCommunicator::new(&self.group, stream.context())?;
                Ok(Some(Arc::new(nccl)))
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
        // Four ranks on four GPUs; two of them on one GPU (whatever their device ordinals).
        let own = [0x10u128, 0x20, 0x30, 0x40];
        let shared = [0x10u128, 0x20, 0x10 << 100, 0x20];
        assert!(!any_shared(&own) && any_shared(&shared) && !any_shared(&[7]));
        assert_eq!(
            DdpBackend::or_default(None, any_shared(&own)),
            DdpBackend::Nccl
        );
        assert_eq!(
            DdpBackend::or_default(None, any_shared(&shared)),
            DdpBackend::Host
        );
        // An explicit choice stands either way (NCCL then refuses ranks sharing a GPU itself).
        let nccl = Some(DdpBackend::Nccl);
        assert_eq!(DdpBackend::or_default(nccl, true), DdpBackend::Nccl);
        let host = Some(DdpBackend::Host);
        assert_eq!(DdpBackend::or_default(host, false), DdpBackend::Host);
    }
}
