//! From `tilearn train`'s precision flags to a validated [`AmpPlan`], with errors that name the
//! flags. The CLI crate owns the clap definitions; this owns their meaning:
//!
//! * `--fp32`, `--bf16`, `--fp16`: at most one. Alone: every step in that precision.
//! * `--amp-policy 0|1|2|auto`: adaptive; the mixed precision is `--fp16` (default) or `--bf16`;
//!   `--fp32` with a policy is an error (a policy switches between fp32 and a mixed precision);
//!   `auto` takes `--fp16` only.
//! * `--amp-start`, `--amp-end`, `--amp-hold`, `--amp-interval`, `--amp-interval-hold`,
//!   `--amp-unit step|epoch` (default step), `--amp-fallback bf16|fp32` (auto only): need
//!   `--amp-policy`, and each only where the policy uses it (see the crate docs' table).
//! * No flag at all: fp32.

use tilearn_ops::DType;

use crate::error::Error;
use crate::names::{Param, PolicyId, TimeUnit};
use crate::plan::AmpPlan;
use crate::policy::PolicyBuilder;

/// The raw flag values (clap can parse `PolicyId`, `TimeUnit` and `DType` with `FromStr`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AmpArgs {
    pub fp16: bool,
    pub bf16: bool,
    pub fp32: bool,
    pub policy: Option<PolicyId>,
    pub start: Option<u64>,
    pub end: Option<u64>,
    pub hold: Option<u64>,
    pub interval: Option<u64>,
    pub interval_hold: Option<u64>,
    pub unit: Option<TimeUnit>,
    pub fallback: Option<DType>,
}

#[derive(Debug, thiserror::Error)]
pub enum FlagError {
    #[error("{0} and {1} are mutually exclusive")]
    MutuallyExclusive(&'static str, &'static str),
    #[error("{0} requires --amp-policy")]
    NeedsPolicy(&'static str),
    #[error(
        "--amp-policy switches between fp32 and mixed precision, so it cannot be combined with \
         --fp32; choose the mixed precision with --fp16 (default) or --bf16"
    )]
    PolicyWithFp32,
    #[error(
        "--amp-policy auto watches the fp16 loss scale: use it with --fp16 (default), not --bf16"
    )]
    AutoWithBf16,
    #[error("--amp-policy {0} requires {1}")]
    Requires(PolicyId, &'static str),
    #[error("{1} does not apply to --amp-policy {0}")]
    NotUsed(PolicyId, &'static str),
    #[error("--amp-end {end} is before {default}--amp-start {start}")]
    EndBeforeStart {
        start: u64,
        end: u64,
        /// "the default " when `--amp-start` was not given.
        default: &'static str,
    },
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    #[error("--amp-interval-hold {interval_hold} is longer than --amp-interval {interval}")]
    IntervalHoldTooLong { interval_hold: u64, interval: u64 },
    #[error("--amp-fallback must be bf16 or fp32, not {0}")]
    InvalidFallback(DType),
    #[error("{0}")]
    Other(Error),
}

/// Build the plan the flags describe, or say which flag is wrong.
pub fn plan_from_args(args: &AmpArgs) -> Result<AmpPlan, FlagError> {
    let chosen: Vec<(&'static str, DType)> = [
        ("--fp16", args.fp16, DType::F16),
        ("--bf16", args.bf16, DType::BF16),
        ("--fp32", args.fp32, DType::F32),
    ]
    .into_iter()
    .filter(|&(_, on, _)| on)
    .map(|(flag, _, p)| (flag, p))
    .collect();
    if let [(a, _), (b, _), ..] = chosen[..] {
        return Err(FlagError::MutuallyExclusive(a, b));
    }
    let precision = chosen.first().map(|&(_, p)| p);

    let Some(id) = args.policy else {
        let stray = [
            (args.start.is_some(), "--amp-start"),
            (args.end.is_some(), "--amp-end"),
            (args.hold.is_some(), "--amp-hold"),
            (args.interval.is_some(), "--amp-interval"),
            (args.interval_hold.is_some(), "--amp-interval-hold"),
            (args.unit.is_some(), "--amp-unit"),
            (args.fallback.is_some(), "--amp-fallback"),
        ];
        if let Some(&(_, flag)) = stray.iter().find(|(set, _)| *set) {
            return Err(FlagError::NeedsPolicy(flag));
        }
        return Ok(AmpPlan::Fixed(precision.unwrap_or(DType::F32)));
    };

    let mixed = match (id, precision) {
        (_, Some(DType::F32)) => return Err(FlagError::PolicyWithFp32),
        (PolicyId::Auto, Some(DType::BF16)) => return Err(FlagError::AutoWithBf16),
        (_, p) => p.unwrap_or(DType::F16),
    };
    let mut b = PolicyBuilder::new(id)
        .mixed(mixed)
        .unit(args.unit.unwrap_or_default());
    if let Some(v) = args.start {
        b = b.start(v);
    }
    if let Some(v) = args.end {
        b = b.end(v);
    }
    if let Some(v) = args.hold {
        b = b.hold(v);
    }
    if let Some(v) = args.interval {
        b = b.interval(v);
    }
    if let Some(v) = args.interval_hold {
        b = b.interval_hold(v);
    }
    if let Some(f) = args.fallback {
        b = b.fallback(f);
    }
    b.build()
        .map(AmpPlan::Adaptive)
        .map_err(|e| flag_error(e, args))
}

/// Restate a builder error in terms of flags.
fn flag_error(e: Error, args: &AmpArgs) -> FlagError {
    let flag = |p: Param| p.flag().unwrap_or(p.name());
    match e {
        Error::MissingParameter { policy, param } => FlagError::Requires(policy, flag(param)),
        Error::ParameterNotUsed { policy, param } => FlagError::NotUsed(policy, flag(param)),
        Error::EndBeforeStart { start, end } => FlagError::EndBeforeStart {
            start,
            end,
            default: if args.start.is_some() {
                ""
            } else {
                "the default "
            },
        },
        Error::ZeroParameter { param } => FlagError::Zero(flag(param)),
        Error::IntervalHoldTooLong {
            interval_hold,
            interval,
        } => FlagError::IntervalHoldTooLong {
            interval_hold,
            interval,
        },
        Error::InvalidFallback(p) => FlagError::InvalidFallback(p),
        other => FlagError::Other(other),
    }
}
