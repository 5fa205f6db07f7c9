//! `--device auto|cpu|cuda`, shared by `train` and `generate`: which engine runs, and which GPU
//! a process takes.

use clap::ValueEnum;

use crate::{LlmError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceChoice {
    /// The GPU when one is present and the CUDA path is built, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// Whether to run on the GPU: `cpu` never, `cuda` always (a clear error when this build or
/// machine has no GPU), `auto` when the CUDA kernels are built in and a device is present.
pub(crate) fn choose_device(choice: DeviceChoice) -> Result<bool> {
    let info = tilearn_ops::backend::probe();
    let usable = info.cuda_usable();
    match choice {
        DeviceChoice::Cpu => Ok(false),
        DeviceChoice::Auto => Ok(usable),
        DeviceChoice::Cuda if usable => Ok(true),
        DeviceChoice::Cuda => Err(LlmError::Usage {
            flag: "--device cuda".into(),
            message: if info.cuda_compiled {
                let why = info
                    .cuda_driver
                    .err()
                    .unwrap_or_else(|| "no device found".into());
                format!("no usable CUDA device ({why}); use --device cpu")
            } else {
                "this build has no CUDA kernels; rebuild with --features cuda (cargo xtask train does when nvcc is found) or use --device cpu".into()
            },
        }),
    }
}

/// The GPU of this process: torchrun's LOCAL_RANK among the visible devices (else 0). Ranks
/// beyond the visible devices share them round-robin, which only the host communicator allows
/// (`--ddp-backend host`; NCCL refuses two ranks on one GPU).
#[cfg(feature = "cuda")]
pub(crate) fn local_gpu() -> usize {
    let local_rank: usize = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    local_rank % tilearn_ops::backend::probe().devices.len().max(1)
}
