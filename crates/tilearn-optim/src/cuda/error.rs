//! The error type of the fused CUDA optimizers.

use crate::error::OptimError;

/// Why a fused step, a plan or a norm was refused or failed. Every check runs before anything is
/// launched, so an `Err` from a step means nothing was modified (except [`FusedError::Cuda`]
/// from the launch itself, which reports a failed launch: nothing ran).
#[derive(Debug, thiserror::Error)]
pub enum FusedError {
    /// Lengths, ranges and hyper-parameters, with the same variants as the CPU optimizers.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// Opening the device failed (no driver, no GPU).
    #[error(transparent)]
    Ops(#[from] tilearn_ops::OpsError),
    /// A buffer allocated on another device than the launch stream's.
    #[error(
        "{op}: `{what}` lives on device {buffer_device} but the stream is on device {stream_device}"
    )]
    WrongDevice {
        op: &'static str,
        what: &'static str,
        buffer_device: usize,
        stream_device: usize,
    },
    /// An argument combination the kernels do not support (wrong number of group scalars, an
    /// empty device scalar, ...).
    #[error("{op}: {message}")]
    InvalidArgument { op: &'static str, message: String },
    /// The CUDA driver or a launcher reported an error.
    #[error("CUDA error in {op}: {message}")]
    Cuda { op: &'static str, message: String },
}

pub type Result<T> = std::result::Result<T, FusedError>;
