//! The builder: the seed's loose optional constructor arguments, validated into an [`AmpPolicy`].

use tilearn_ops::DType;

use super::auto::{
    AutoPolicy, DEFAULT_AUTO_HOLD, DEFAULT_MAX_OVERFLOWS, DEFAULT_OVERFLOW_WINDOW,
    DEFAULT_RESUME_SCALE, DEFAULT_SCALE_FLOOR,
};
use super::loss::{
    DEFAULT_INTERVAL, DEFAULT_INTERVAL_HOLD, DEFAULT_LOSS_RISE_TOLERANCE, LossPolicy,
};
use super::time::{DEFAULT_START, TimePolicy};
use super::time_lr::{DEFAULT_LR_TOLERANCE, TimeLrPolicy};
use super::{AmpPolicy, Rule};
use crate::error::{Error, Result};
use crate::names::{Param, PolicyId, TimeUnit};

/// `PolicyBuilder::new(PolicyId::Time).end(1000).build()`. Which parameters each policy takes,
/// requires and defaults is in the crate docs; setting one the policy does not use is
/// [`Error::ParameterNotUsed`] (a silently ignored setting is a misconfiguration).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyBuilder {
    id: PolicyId,
    mixed: Option<DType>,
    unit: TimeUnit,
    start: Option<u64>,
    end: Option<u64>,
    hold: Option<u64>,
    interval: Option<u64>,
    interval_hold: Option<u64>,
    fallback: Option<DType>,
    lr_tolerance: Option<f64>,
    loss_rise_tolerance: Option<f64>,
    overflow_window: Option<u64>,
    max_overflows: Option<u64>,
    scale_floor: Option<f32>,
    resume_scale: Option<f32>,
}

impl PolicyBuilder {
    pub fn new(id: PolicyId) -> Self {
        PolicyBuilder {
            id,
            mixed: None,
            unit: TimeUnit::default(),
            start: None,
            end: None,
            hold: None,
            interval: None,
            interval_hold: None,
            fallback: None,
            lr_tolerance: None,
            loss_rise_tolerance: None,
            overflow_window: None,
            max_overflows: None,
            scale_floor: None,
            resume_scale: None,
        }
    }

    /// What "mixed precision on" computes in (default fp16, the seed's `autocast`).
    pub fn mixed(mut self, p: DType) -> Self {
        self.mixed = Some(p);
        self
    }
    pub fn unit(mut self, u: TimeUnit) -> Self {
        self.unit = u;
        self
    }
    pub fn start(mut self, v: u64) -> Self {
        self.start = Some(v);
        self
    }
    pub fn end(mut self, v: u64) -> Self {
        self.end = Some(v);
        self
    }
    pub fn hold(mut self, v: u64) -> Self {
        self.hold = Some(v);
        self
    }
    pub fn interval(mut self, v: u64) -> Self {
        self.interval = Some(v);
        self
    }
    pub fn interval_hold(mut self, v: u64) -> Self {
        self.interval_hold = Some(v);
        self
    }
    pub fn fallback(mut self, p: DType) -> Self {
        self.fallback = Some(p);
        self
    }
    pub fn lr_tolerance(mut self, v: f64) -> Self {
        self.lr_tolerance = Some(v);
        self
    }
    pub fn loss_rise_tolerance(mut self, v: f64) -> Self {
        self.loss_rise_tolerance = Some(v);
        self
    }
    pub fn overflow_window(mut self, v: u64) -> Self {
        self.overflow_window = Some(v);
        self
    }
    pub fn max_overflows(mut self, v: u64) -> Self {
        self.max_overflows = Some(v);
        self
    }
    pub fn scale_floor(mut self, v: f32) -> Self {
        self.scale_floor = Some(v);
        self
    }
    pub fn resume_scale(mut self, v: f32) -> Self {
        self.resume_scale = Some(v);
        self
    }

    /// The parameters that were set, in a fixed order (so the first error is deterministic).
    fn set_params(&self) -> Vec<Param> {
        let set = [
            (Param::Start, self.start.is_some()),
            (Param::End, self.end.is_some()),
            (Param::Hold, self.hold.is_some()),
            (Param::Interval, self.interval.is_some()),
            (Param::IntervalHold, self.interval_hold.is_some()),
            (Param::Fallback, self.fallback.is_some()),
            (Param::LrTolerance, self.lr_tolerance.is_some()),
            (Param::LossRiseTolerance, self.loss_rise_tolerance.is_some()),
            (Param::OverflowWindow, self.overflow_window.is_some()),
            (Param::MaxOverflows, self.max_overflows.is_some()),
            (Param::ScaleFloor, self.scale_floor.is_some()),
            (Param::ResumeScale, self.resume_scale.is_some()),
        ];
        set.into_iter()
            .filter(|&(_, s)| s)
            .map(|(p, _)| p)
            .collect()
    }

    /// The parameters `id` takes.
    pub fn accepted(id: PolicyId) -> &'static [Param] {
        match id {
            PolicyId::Time => &[Param::Start, Param::End],
            PolicyId::TimeLr => &[Param::Start, Param::End, Param::Hold, Param::LrTolerance],
            PolicyId::Loss => &[
                Param::Start,
                Param::End,
                Param::Interval,
                Param::IntervalHold,
                Param::LossRiseTolerance,
            ],
            PolicyId::Auto => &[
                Param::Hold,
                Param::Fallback,
                Param::OverflowWindow,
                Param::MaxOverflows,
                Param::ScaleFloor,
                Param::ResumeScale,
            ],
        }
    }

    pub fn build(self) -> Result<AmpPolicy> {
        let id = self.id;
        let accepted = Self::accepted(id);
        if let Some(&param) = self.set_params().iter().find(|p| !accepted.contains(p)) {
            return Err(Error::ParameterNotUsed { policy: id, param });
        }
        let required =
            |v: Option<u64>, param: Param| v.ok_or(Error::MissingParameter { policy: id, param });
        let rule = match id {
            PolicyId::Time => Rule::Time(TimePolicy::new(
                self.start.unwrap_or(DEFAULT_START),
                required(self.end, Param::End)?,
            )?),
            PolicyId::TimeLr => Rule::TimeLr(TimeLrPolicy::new(
                required(self.start, Param::Start)?,
                required(self.end, Param::End)?,
                required(self.hold, Param::Hold)?,
                self.lr_tolerance.unwrap_or(DEFAULT_LR_TOLERANCE),
            )?),
            PolicyId::Loss => Rule::Loss(LossPolicy::new(
                self.start.unwrap_or(DEFAULT_START),
                self.end,
                self.interval.unwrap_or(DEFAULT_INTERVAL),
                self.interval_hold.unwrap_or(DEFAULT_INTERVAL_HOLD),
                self.loss_rise_tolerance
                    .unwrap_or(DEFAULT_LOSS_RISE_TOLERANCE),
            )?),
            PolicyId::Auto => Rule::Auto(AutoPolicy::new(
                self.hold.unwrap_or(DEFAULT_AUTO_HOLD),
                self.overflow_window.unwrap_or(DEFAULT_OVERFLOW_WINDOW),
                self.max_overflows.unwrap_or(DEFAULT_MAX_OVERFLOWS),
                self.scale_floor.unwrap_or(DEFAULT_SCALE_FLOOR),
                self.resume_scale.unwrap_or(DEFAULT_RESUME_SCALE),
                self.fallback.unwrap_or(DType::BF16),
            )?),
        };
        AmpPolicy::new(rule, self.mixed.unwrap_or(DType::F16), self.unit)
    }
}
