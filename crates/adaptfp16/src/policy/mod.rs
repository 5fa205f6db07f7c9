//! Adaptive mixed-precision policies: Tilearn-Angel's 0/1/2 and our `auto`. The exact decision
//! rules are in the crate docs.

mod auto;
mod builder;
mod loss;
mod signals;
mod time;
mod time_lr;

pub use auto::{
    AutoMode, AutoPolicy, AutoState, DEFAULT_AUTO_HOLD, DEFAULT_MAX_OVERFLOWS,
    DEFAULT_OVERFLOW_WINDOW, DEFAULT_RESUME_SCALE, DEFAULT_SCALE_FLOOR, FallbackReason,
};
pub use builder::PolicyBuilder;
pub use loss::{
    DEFAULT_INTERVAL, DEFAULT_INTERVAL_HOLD, DEFAULT_LOSS_RISE_TOLERANCE, LossPolicy, LossState,
};
pub use signals::Signals;
pub use time::{DEFAULT_START, TimePolicy};
pub use time_lr::{DEFAULT_LR_TOLERANCE, TimeLrPolicy, TimeLrState};

use serde::{Deserialize, Serialize};
use tilearn_ops::DType;

use crate::error::{Error, Result};
use crate::names::{PolicyId, TimeUnit};
use crate::scaler::GradScaler;

/// One policy's rule and parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Rule {
    Time(TimePolicy),
    TimeLr(TimeLrPolicy),
    Loss(LossPolicy),
    Auto(AutoPolicy),
}

impl Rule {
    pub fn id(&self) -> PolicyId {
        match self {
            Rule::Time(_) => PolicyId::Time,
            Rule::TimeLr(_) => PolicyId::TimeLr,
            Rule::Loss(_) => PolicyId::Loss,
            Rule::Auto(_) => PolicyId::Auto,
        }
    }
}

/// A validated policy with its runtime state: the typed form of the seed's
/// `MixedPrecision_TrainingPolicy`. Build one with [`PolicyBuilder`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AmpPolicy {
    rule: Rule,
    /// What "mixed precision on" means for policies 0/1/2 (fp16 or bf16); fp16 for auto.
    mixed: DType,
    unit: TimeUnit,
    /// The last decision, so asking twice for one period gives one answer and counts once.
    last: Option<(u64, DType)>,
}

impl AmpPolicy {
    /// Pair a rule with its mixed precision and unit. Policies 0/1/2 take fp16 or bf16; auto
    /// needs fp16 (it watches the fp16 loss scale).
    pub fn new(rule: Rule, mixed: DType, unit: TimeUnit) -> Result<Self> {
        match (&rule, mixed) {
            (_, DType::F32) => return Err(Error::MixedNotMixed(mixed)),
            (Rule::Auto(_), DType::BF16) => return Err(Error::AutoNeedsFp16(mixed)),
            _ => {}
        }
        Ok(AmpPolicy {
            rule,
            mixed,
            unit,
            last: None,
        })
    }

    pub fn id(&self) -> PolicyId {
        self.rule.id()
    }

    pub fn rule(&self) -> &Rule {
        &self.rule
    }

    pub fn mixed(&self) -> DType {
        self.mixed
    }

    /// Whether `decide` is to be asked once per step or once per epoch.
    pub fn unit(&self) -> TimeUnit {
        self.unit
    }

    /// Every precision this policy can ever return (so the trainer can prepare for them).
    pub fn possible_precisions(&self) -> Vec<DType> {
        match &self.rule {
            Rule::Auto(a) => vec![DType::F16, a.fallback()],
            _ => vec![DType::F32, self.mixed],
        }
    }

    /// The precision of period `period` (0-based step or epoch, per [`AmpPolicy::unit`]).
    /// Periods must be asked in non-decreasing order (gaps are fine); asking again for the
    /// same period returns the same answer without re-counting anything. `signals.lr` is
    /// required by policy 1, `scaler` by auto (which may restart its scale, see the crate docs).
    pub fn decide(
        &mut self,
        period: u64,
        signals: Signals,
        scaler: Option<&mut GradScaler>,
    ) -> Result<DType> {
        if let Some((last, precision)) = self.last {
            if period == last {
                return Ok(precision);
            }
            if period < last {
                return Err(Error::PeriodWentBack { last, got: period });
            }
        }
        let on = |b: bool| if b { self.mixed } else { DType::F32 };
        let precision = match &mut self.rule {
            Rule::Time(p) => on(p.in_window(period)),
            Rule::TimeLr(p) => on(p.decide(period, signals.lr)?),
            Rule::Loss(p) => on(p.decide(period, signals.loss)),
            Rule::Auto(p) => p.decide(period, signals.loss, scaler)?,
        };
        self.last = Some((period, precision));
        Ok(precision)
    }

    /// The seed's `enable_mixed_precision(epoch, lr, loss, scaler) -> bool`.
    pub fn enable_mixed_precision(
        &mut self,
        epoch: u64,
        lr: Option<f64>,
        loss: Option<f64>,
        scaler: Option<&mut GradScaler>,
    ) -> Result<bool> {
        Ok(self.decide(epoch, Signals { lr, loss }, scaler)?.is_half())
    }

    /// The whole policy (parameters and runtime state) as JSON, for checkpoints.
    pub fn state_json(&self) -> Result<serde_json::Value> {
        serde_json::to_value(self).map_err(Error::StateJson)
    }

    /// Restore runtime state saved by [`AmpPolicy::state_json`]. The saved policy must have the
    /// same parameters (a checkpoint resumed with different `--amp-*` flags is an error).
    pub fn load_state_json(&mut self, json: &serde_json::Value) -> Result<()> {
        let saved: AmpPolicy = serde_json::from_value(json.clone()).map_err(Error::StateJson)?;
        if !same_parameters(self, &saved) {
            return Err(Error::StateMismatch {
                expected: self.id(),
            });
        }
        *self = saved;
        Ok(())
    }
}

/// Equal up to runtime state.
fn same_parameters(a: &AmpPolicy, b: &AmpPolicy) -> bool {
    let strip = |p: &AmpPolicy| {
        let mut p = p.clone();
        p.last = None;
        match &mut p.rule {
            Rule::Time(_) => {}
            Rule::TimeLr(r) => r.set_state(TimeLrState::default()),
            Rule::Loss(r) => r.set_state(LossState::default()),
            Rule::Auto(r) => r.set_state(AutoState::default()),
        }
        p
    };
    strip(a) == strip(b)
}
