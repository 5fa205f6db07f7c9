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
    RangeOutOfBounds {
        start: usize,
        end: usize,
        len: usize,
    },
    /// A range whose start lies after its end (`start..end` with `start > end`).
    #[error("parameter range {start}..{end} of group `{group}` is reversed (start > end)")]
    ReversedRange {
        group: String,
        start: usize,
        end: usize,
    },
    /// Two ranges (of the same group or of two groups) share at least one element.
    #[error(
        "parameter range {first_start}..{first_end} of group `{first_group}` overlaps \
         range {second_start}..{second_end} of group `{second_group}`"
    )]
    OverlappingRanges {
        first_group: String,
        first_start: usize,
        first_end: usize,
        second_group: String,
        second_start: usize,
        second_end: usize,
    },
    /// A learning-rate scheduler name `FromStr` does not know.
    #[error(
        "unknown scheduler type `{0}` (expected one of: linear, cosine, cosine_with_restarts, \
         polynomial, constant, constant_with_warmup, inverse_sqrt, warmup_stable_decay)"
    )]
    UnknownScheduler(String),
    #[error("optimizer state {}: {message}", file.display())]
    State {
        file: std::path::PathBuf,
        message: String,
    },
    /// A per-tensor range (LAMB's trust-ratio tensors) that is reversed, overlaps another,
    /// straddles a group boundary, or leaves group elements uncovered.
    #[error("tensor range {start}..{end}: {message}")]
    InvalidTensorRange {
        start: usize,
        end: usize,
        message: &'static str,
    },
}

pub type Result<T> = std::result::Result<T, OptimError>;
