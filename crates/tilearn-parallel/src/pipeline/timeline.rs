//! The outcome of a simulated step: what each stage did when, and how much of the step it sat
//! idle.

use super::schedule::ScheduleKind;

/// What a stage was doing during a [`Span`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activity {
    Forward {
        micro_batch: usize,
        chunk: usize,
    },
    Backward {
        micro_batch: usize,
        chunk: usize,
    },
    /// A communication batch, from its posting to its completion (waiting for the partners to
    /// post, then the transfer).
    Comm,
}

/// One interval of a stage's time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    pub start: f64,
    pub end: f64,
    pub what: Activity,
}

impl Span {
    pub fn duration(&self) -> f64 {
        self.end - self.start
    }

    /// Whether the stage was computing (forward or backward) during this span.
    pub fn is_compute(&self) -> bool {
        !matches!(self.what, Activity::Comm)
    }
}

/// A simulated training step of a [`super::Schedule`].
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    pub kind: ScheduleKind,
    pub micro_batches: usize,
    /// `spans[stage]`: that stage's computes and communication batches, in time order.
    pub spans: Vec<Vec<Span>>,
    /// When the last stage finished; every stage is counted from 0 to here.
    pub makespan: f64,
    /// The schedule's [`super::Schedule::bubble_fraction_formula`], for comparison.
    pub formula_bubble_fraction: f64,
}

impl Timeline {
    pub fn stages(&self) -> usize {
        self.spans.len()
    }

    /// Time `stage` spent computing.
    pub fn busy(&self, stage: usize) -> f64 {
        self.spans.get(stage).map_or(0.0, |spans| {
            spans
                .iter()
                .filter(|s| s.is_compute())
                .map(Span::duration)
                .sum()
        })
    }

    /// Time `stage` did not compute within the step (waiting, communicating, or done early).
    pub fn idle(&self, stage: usize) -> f64 {
        self.makespan - self.busy(stage)
    }

    /// The pipeline bubble as the formula counts it: idle time over busy compute time, summed
    /// over the stages (every stage computes the same amount, so this is also each stage's
    /// idle/busy). With forward and backward costs that are whole numbers and no p2p cost, it
    /// equals `(p - 1) / m` exactly for GPipe and 1F1B, and `(p - 1) / (m v)` for interleaving.
    /// 0 when nothing was computed.
    pub fn bubble_fraction(&self) -> f64 {
        let busy: f64 = (0..self.stages()).map(|s| self.busy(s)).sum();
        if busy <= 0.0 {
            return 0.0;
        }
        let idle = self.makespan * self.stages() as f64 - busy;
        idle / busy
    }
}
