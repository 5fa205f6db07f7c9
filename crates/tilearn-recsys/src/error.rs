//! The error type of tilearn-recsys. Every variant names what was wrong and how to fix it.

use std::path::PathBuf;

/// Errors of the embedding operator, the models, the data pipeline and the trainer.
#[derive(Debug, thiserror::Error)]
pub enum RecsysError {
    /// A shape, length or configuration value that cannot work.
    #[error("invalid {what}: {message}")]
    Invalid { what: &'static str, message: String },
    /// A row id outside its table (ids are hashed into each table's size; raw ids must be too).
    #[error("table {table}: row id {id} at entry {entry} is outside the table's {rows} rows")]
    RowOutOfRange {
        table: usize,
        entry: usize,
        id: u32,
        rows: usize,
    },
    /// A file that could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file whose contents are not what the reader expects.
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    /// The dense optimizer (tilearn-optim) refused a step.
    #[error(transparent)]
    Optim(#[from] tilearn_optim::OptimError),
    /// A tensor op or CUDA launch failed.
    #[error(transparent)]
    Ops(#[from] tilearn_ops::OpsError),
    /// The fused CUDA AdamW of the dense part refused or failed a step.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    FusedOptim(#[from] tilearn_optim::cuda::FusedError),
}

impl RecsysError {
    /// An [`RecsysError::Invalid`] for `what`.
    pub fn invalid(what: &'static str, message: impl Into<String>) -> Self {
        RecsysError::Invalid {
            what,
            message: message.into(),
        }
    }

    /// An [`RecsysError::Io`] for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        RecsysError::Io {
            path: path.into(),
            source,
        }
    }
}

/// Result alias of tilearn-recsys.
pub type Result<T> = std::result::Result<T, RecsysError>;
