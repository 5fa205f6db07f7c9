//! The crate's one error type. Every variant names what was wrong and, where it helps, what to do.

use tilearn_ops::DType;

use crate::names::{Param, PolicyId};

/// An error from a device backend behind [`crate::UnscaleTarget`] (e.g. a CUDA launch failure).
pub type BackendError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // ---- GradScaler ----
    #[error("GradScaler {field} = {value} is invalid: it must be {requirement}")]
    InvalidScalerConfig {
        field: &'static str,
        value: f64,
        requirement: &'static str,
    },
    #[error(
        "unscale() was already called this step; call update() before unscaling again \
         (torch: \"unscale_() has already been called on this optimizer since the last update()\")"
    )]
    AlreadyUnscaled,
    #[error(
        "update() without an inf check this step: call unscale() (or check_for_fused_step()) \
         after backward and before update()"
    )]
    NoInfCheck,
    #[error(
        "the scaler state dict is empty: it was saved from a disabled GradScaler \
         (torch raises the same)"
    )]
    EmptyStateDict,
    #[error("invalid GradScaler state dict: {0}")]
    InvalidStateDict(String),
    #[error("unscale backend failed: {0}")]
    Backend(BackendError),

    // ---- policies ----
    #[error("policy {policy} requires {param}")]
    MissingParameter { policy: PolicyId, param: Param },
    #[error("policy {policy} does not use {param}; leave it unset")]
    ParameterNotUsed { policy: PolicyId, param: Param },
    #[error("end_time {end} is before start_time {start}")]
    EndBeforeStart { start: u64, end: u64 },
    #[error("{param} must be at least 1")]
    ZeroParameter { param: Param },
    #[error(
        "interval_hold_time {interval_hold} is longer than interval_time {interval}: \
         the loss windows would overlap"
    )]
    IntervalHoldTooLong { interval_hold: u64, interval: u64 },
    #[error("{what} = {value} is invalid: it must be {requirement}")]
    InvalidTolerance {
        what: &'static str,
        value: f64,
        requirement: &'static str,
    },
    #[error("mixed precision must be fp16 or bf16, got {0}")]
    MixedNotMixed(DType),
    #[error(
        "policy auto watches the fp16 loss scale, so its mixed precision must be fp16, got {0}"
    )]
    AutoNeedsFp16(DType),
    #[error("policy auto falls back to bf16 or fp32, not {0}")]
    InvalidFallback(DType),
    #[error("policy auto: max_overflows {max_overflows} must be in 1..=window ({window})")]
    InvalidOverflowLimit { max_overflows: u64, window: u64 },
    #[error("policy {policy} needs {signal} at every decision (period {period})")]
    MissingSignal {
        policy: PolicyId,
        signal: &'static str,
        period: u64,
    },
    #[error("{signal} = {value} at period {period} is not finite")]
    NonFiniteSignal {
        signal: &'static str,
        value: f64,
        period: u64,
    },
    #[error("period went back from {last} to {got}: decisions must be asked in time order")]
    PeriodWentBack { last: u64, got: u64 },
    #[error("policy state JSON: {0}")]
    StateJson(serde_json::Error),
    #[error("saved policy state was made with other parameters than this policy {expected}")]
    StateMismatch { expected: PolicyId },
}
