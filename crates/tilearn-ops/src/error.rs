//! The error type of tilearn-ops.

use crate::DType;

/// Errors from tensor construction and ops. Each says what was expected so the caller can fix it.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    #[error("shape mismatch in {op}: expected {expected} elements, got {actual}")]
    ShapeMismatch {
        op: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("byte length {bytes} is not a whole number of {dtype} elements for shape {shape:?}")]
    ByteLength {
        bytes: usize,
        dtype: DType,
        shape: Vec<usize>,
    },
    #[error("token id {id} at position {position} is outside the vocabulary of {vocab} entries")]
    TokenOutOfRange {
        id: u32,
        position: usize,
        vocab: usize,
    },
    #[error(
        "label {label} at position {position} is outside the vocabulary of {vocab} entries (use -100 to ignore a position)"
    )]
    LabelOutOfRange {
        label: i32,
        position: usize,
        vocab: usize,
    },
    #[error(
        "position_ids row {row}, column {column}: {value} after {previous:?}; packed rows need positions that start at 0 and either restart at 0 (a new example) or count up by 1"
    )]
    InvalidPositions {
        row: usize,
        column: usize,
        value: i32,
        previous: Option<i32>,
    },
    #[error(
        "vocabulary slice {start}..{start}+{rows} does not lie inside a vocabulary of {full} words (a tensor-parallel rank holds a non-empty run of the vocabulary's rows)"
    )]
    VocabSlice {
        start: usize,
        rows: usize,
        full: usize,
    },
    #[error("CUDA error in {context}: {message}")]
    Cuda {
        context: &'static str,
        message: String,
    },
    #[error("no CUDA device available: {reason}")]
    NoCudaDevice { reason: String },
}

/// Result alias of tilearn-ops.
pub type Result<T> = std::result::Result<T, OpsError>;
