//! The error type of the umbrella crate and the CLI.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    #[error(transparent)]
    Engine(#[from] tilearn_engine::EngineError),
    #[error(transparent)]
    Ops(#[from] tilearn_ops::OpsError),
    #[error(transparent)]
    Parallel(#[from] tilearn_parallel::ParallelError),
    #[error(transparent)]
    Recsys(#[from] tilearn_recsys::RecsysError),
    /// An input file of the CLI (e.g. the token list of `tilearn eval`) that is malformed.
    #[error("{}: {message}", file.display())]
    Input { file: PathBuf, message: String },
    /// A plot that could not be drawn or written.
    #[error("{}: cannot draw the plot: {message}", file.display())]
    Plot { file: PathBuf, message: String },
    /// Flags that contradict each other or cannot work.
    #[error("{flag}: {message}")]
    Usage { flag: String, message: String },
    /// A rank of a launched job failed and already reported why (to the launcher, which prints
    /// one line for the job, or on stderr): nothing more to print.
    #[error("the error was reported by this rank")]
    Reported,
}

pub type Result<T> = std::result::Result<T, LlmError>;
