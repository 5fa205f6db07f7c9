//! The error type of tilearn-engine. Every variant names the file (or argument), the field and
//! what to do, so the CLI can print it as one line.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A `config.json` that is missing a field, has a wrong type or describes something we do
    /// not support.
    #[error("{}: field `{field}`: {message}", file.display())]
    Config {
        file: PathBuf,
        field: String,
        message: String,
    },
    /// A checkpoint file (safetensors or its index) that does not match the config.
    #[error("{}: tensor `{tensor}`: {message}", file.display())]
    Checkpoint {
        file: PathBuf,
        tensor: String,
        message: String,
    },
    /// A token shard, dataset directory or input text file that cannot be used.
    #[error("{}: {message}", file.display())]
    Data { file: PathBuf, message: String },
    /// A tokenizer file that cannot be loaded or used.
    #[error("{}: tokenizer: {message}", file.display())]
    Tokenizer { file: PathBuf, message: String },
    /// An argument or combination of arguments that cannot work.
    #[error("{argument}: {message}")]
    InvalidArgument { argument: String, message: String },
    /// A file-system operation failed.
    #[error("{}: {action}: {source}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// Training finished and the final model is saved, but some checkpoints could not be
    /// written (each is named with its reason); the earlier checkpoints are intact.
    #[error(
        "training finished and the final model is saved in {}, but {failures}; free space on the \
         disk, or use --save-only-model, --save-total-limit N, --save-steps 0 or another \
         --output-dir",
        output_dir.display()
    )]
    CheckpointsNotSaved {
        output_dir: PathBuf,
        failures: String,
    },
    #[error(transparent)]
    Ops(#[from] tilearn_ops::OpsError),
    #[error(transparent)]
    Optim(#[from] tilearn_optim::OptimError),
    #[error(transparent)]
    Amp(#[from] adaptfp16::Error),
    /// A collective or the process group of a data-parallel run failed.
    #[error(transparent)]
    Parallel(#[from] tilearn_parallel::ParallelError),
}

impl EngineError {
    /// Shorthand for an [`EngineError::Io`] with the path and what was being done.
    pub fn io(path: impl Into<PathBuf>, action: &'static str, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            action,
            source,
        }
    }
}

/// Result alias of tilearn-engine.
pub type Result<T> = std::result::Result<T, EngineError>;
