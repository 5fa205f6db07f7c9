//! The error type of tilearn-optim.

#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    #[error("{what}: buffer lengths differ: {expected} vs {actual}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("invalid hyper-parameter `{name}` = {value}: {message}")]
    InvalidHyperParameter {
        name: &'static str,
        value: f64,
        message: &'static str,
    },
    #[error("parameter range {start}..{end} lies outside the buffer of {len} elements")]
    RangeOutOfBounds { start: usize, end: usize, len: usize },
    #[error("optimizer state {}: {message}", file.display())]
    State {
        file: std::path::PathBuf,
        message: String,
    },
}

pub type Result<T> = std::result::Result<T, OptimError>;
