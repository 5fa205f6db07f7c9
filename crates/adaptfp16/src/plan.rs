//! What the trainer holds: a fixed precision, or a policy that decides per period.

use tilearn_ops::DType;

use crate::error::Result;
use crate::names::TimeUnit;
use crate::policy::{AmpPolicy, Signals};
use crate::scaler::GradScaler;

#[derive(Debug, Clone, PartialEq)]
pub enum AmpPlan {
    /// `--fp32`, `--bf16` or `--fp16` without a policy: every period the same.
    Fixed(DType),
    Adaptive(AmpPolicy),
}

impl AmpPlan {
    /// The precision of `period`; see [`AmpPolicy::decide`]. A fixed plan ignores its inputs.
    pub fn decide(
        &mut self,
        period: u64,
        signals: Signals,
        scaler: Option<&mut GradScaler>,
    ) -> Result<DType> {
        match self {
            AmpPlan::Fixed(p) => Ok(*p),
            AmpPlan::Adaptive(policy) => policy.decide(period, signals, scaler),
        }
    }

    /// How often to call `decide` (a fixed plan never changes, `Step` is as good as any).
    pub fn unit(&self) -> TimeUnit {
        match self {
            AmpPlan::Fixed(_) => TimeUnit::Step,
            AmpPlan::Adaptive(p) => p.unit(),
        }
    }

    pub fn possible_precisions(&self) -> Vec<DType> {
        match self {
            AmpPlan::Fixed(p) => vec![*p],
            AmpPlan::Adaptive(p) => p.possible_precisions(),
        }
    }

    /// Whether any period can run fp16 and so needs the GradScaler.
    pub fn needs_scaler(&self) -> bool {
        self.possible_precisions()
            .iter()
            .any(|p| p.needs_loss_scaling())
    }

    /// A GradScaler for this plan: torch's defaults when fp16 can occur, disabled otherwise.
    pub fn new_scaler(&self) -> GradScaler {
        if self.needs_scaler() {
            GradScaler::new()
        } else {
            GradScaler::disabled()
        }
    }
}
