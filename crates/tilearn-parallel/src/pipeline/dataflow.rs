//! Where each tensor of a pipeline comes from and goes to. The model is cut into
//! `stages * chunks` consecutive global chunks; global chunk `g = chunk * stages + stage` lives on
//! `stage`. The forward of (micro-batch, g) needs the activation of (micro-batch, g - 1); the
//! backward of (micro-batch, g) needs its own forward and the gradient of (micro-batch, g + 1),
//! except the last global chunk, whose backward starts from the loss.

use super::error::{Result, ScheduleError};
use super::schedule::{Action, P2pKind, Schedule, ScheduleKind};

/// The sizes every part of a schedule agrees on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shape {
    pub stages: usize,
    pub micro_batches: usize,
    pub chunks: usize,
}

/// Forward or backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Pass {
    Forward,
    Backward,
}

/// One compute action, as the generators and checks handle it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Compute {
    pub pass: Pass,
    pub micro_batch: usize,
    pub chunk: usize,
}

/// Where a tensor goes or comes from: the other stage and its chunk there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub stage: usize,
    pub chunk: usize,
}

impl Compute {
    pub fn forward(micro_batch: usize, chunk: usize) -> Self {
        Compute {
            pass: Pass::Forward,
            micro_batch,
            chunk,
        }
    }

    pub fn backward(micro_batch: usize, chunk: usize) -> Self {
        Compute {
            pass: Pass::Backward,
            micro_batch,
            chunk,
        }
    }

    /// The compute of an action; `None` for communication.
    pub fn of(action: &Action) -> Option<Self> {
        match *action {
            Action::Forward { micro_batch, chunk } => Some(Compute::forward(micro_batch, chunk)),
            Action::Backward { micro_batch, chunk } => Some(Compute::backward(micro_batch, chunk)),
            Action::Comm(_) => None,
        }
    }

    pub fn to_action(self) -> Action {
        let Compute {
            micro_batch, chunk, ..
        } = self;
        match self.pass {
            Pass::Forward => Action::Forward { micro_batch, chunk },
            Pass::Backward => Action::Backward { micro_batch, chunk },
        }
    }
}

impl Shape {
    pub fn global_chunks(&self) -> usize {
        self.stages * self.chunks
    }

    pub fn global(&self, stage: usize, chunk: usize) -> usize {
        chunk * self.stages + stage
    }

    pub fn owner(&self, global: usize) -> Endpoint {
        Endpoint {
            stage: global % self.stages,
            chunk: global / self.stages,
        }
    }

    /// The neighbour that an activation or gradient of `chunk` on `stage` is exchanged with by an
    /// operation of `kind`, or `None` when that tensor does not exist (the first chunk receives no
    /// activation and sends no gradient; the last sends no activation and receives no gradient).
    pub fn partner(&self, stage: usize, chunk: usize, kind: P2pKind) -> Option<Endpoint> {
        let global = self.global(stage, chunk);
        let other = match kind {
            P2pKind::SendActivation | P2pKind::RecvGradient => global + 1,
            P2pKind::RecvActivation | P2pKind::SendGradient => global.checked_sub(1)?,
        };
        (other < self.global_chunks()).then(|| self.owner(other))
    }

    /// The compute that produces the input `compute` needs beyond its own stage's program order,
    /// with the stage it runs on: the previous global chunk's forward for a forward, the next
    /// global chunk's backward for a backward (or its own forward for the last global chunk).
    pub fn input_of(&self, stage: usize, compute: Compute) -> Option<(usize, Compute)> {
        let mb = compute.micro_batch;
        match compute.pass {
            Pass::Forward => self
                .partner(stage, compute.chunk, P2pKind::RecvActivation)
                .map(|from| (from.stage, Compute::forward(mb, from.chunk))),
            Pass::Backward => Some(
                match self.partner(stage, compute.chunk, P2pKind::RecvGradient) {
                    Some(from) => (from.stage, Compute::backward(mb, from.chunk)),
                    None => (stage, Compute::forward(mb, compute.chunk)),
                },
            ),
        }
    }

    /// Where the output of `compute` goes and how it is sent (activation forward, gradient
    /// backward); `None` for the last forward and the first backward, whose outputs stay.
    pub fn output_of(&self, stage: usize, compute: Compute) -> Option<(Endpoint, P2pKind)> {
        let kind = match compute.pass {
            Pass::Forward => P2pKind::SendActivation,
            Pass::Backward => P2pKind::SendGradient,
        };
        self.partner(stage, compute.chunk, kind)
            .map(|to| (to, kind))
    }
}

/// The most (stage, micro-batch, chunk) triples a schedule may have: far beyond any real
/// pipeline (8 stages x 4096 micro-batches x 8 chunks is 2^18), small enough to lay out.
const MAX_COMPUTES: usize = 1 << 24;

impl Schedule {
    /// The schedule's sizes, after checking they can describe a pipeline at all and that there is
    /// one program per stage.
    pub(crate) fn checked_shape(&self) -> Result<Shape> {
        let shape = Schedule::checked_sizes(self.kind, self.stages, self.micro_batches)?;
        if self.actions.len() != self.stages {
            return Err(ScheduleError::Config {
                field: "actions",
                value: self.actions.len().to_string(),
                reason: format!(
                    "one program per stage is needed, and there are {} stages",
                    self.stages
                ),
            });
        }
        Ok(shape)
    }

    /// The sizes of a `kind` schedule over `stages` and `micro_batches`, or what is wrong with
    /// them.
    pub(crate) fn checked_sizes(
        kind: ScheduleKind,
        stages: usize,
        micro_batches: usize,
    ) -> Result<Shape> {
        let config = |field, value: usize, reason: &str| ScheduleError::Config {
            field,
            value: value.to_string(),
            reason: reason.to_string(),
        };
        if stages == 0 {
            return Err(config("stages", 0, "a pipeline needs at least 1 stage"));
        }
        if micro_batches == 0 {
            return Err(config(
                "micro_batches",
                0,
                "a step needs at least 1 micro-batch (micro-batches = gradient accumulation steps)",
            ));
        }
        let chunks = match kind {
            ScheduleKind::Interleaved { virtual_stages: 0 } => {
                return Err(config(
                    "virtual_stages",
                    0,
                    "interleaving needs at least 1 model chunk per stage",
                ));
            }
            ScheduleKind::Interleaved { virtual_stages } => virtual_stages,
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => 1,
        };
        // Every check allocates per (stage, chunk, micro-batch); refuse what cannot be meant.
        let computes = stages
            .checked_mul(micro_batches)
            .and_then(|n| n.checked_mul(chunks));
        if computes.is_none_or(|n| n > MAX_COMPUTES) {
            return Err(config(
                "micro_batches",
                micro_batches,
                &format!(
                    "{stages} stages x {micro_batches} micro-batches x {chunks} chunks is over the \
                     {MAX_COMPUTES} (stage, micro-batch, chunk) a schedule may hold"
                ),
            ));
        }
        Ok(Shape {
            stages,
            micro_batches,
            chunks,
        })
    }
}
