//! The vocabulary of a pipeline schedule: what kind it is, and the ordered actions of each stage.
//! Plain data, so a schedule can be built, checked, simulated and printed without any device.

use std::fmt;

/// Which pipeline schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al., 2019).
    GPipe,
    /// One-forward-one-backward (PipeDream-Flush, Megatron's default): stage `s` runs `p - s - 1`
    /// warm-up forwards, then alternates, so at most `p - s` micro-batches hold activations.
    OneFOneB,
    /// Megatron's interleaved 1F1B: each rank holds `virtual_stages` model chunks; global chunk
    /// `chunk * stages + stage` lives on `stage`, and micro-batches go through a chunk in groups of
    /// `stages`. With 1 virtual stage it is Megatron's interleaved code path on one chunk: the
    /// same bubble as 1F1B, a deeper warm-up (`2 (p - s - 1)` forwards).
    Interleaved { virtual_stages: usize },
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::GPipe => write!(f, "GPipe"),
            ScheduleKind::OneFOneB => write!(f, "1F1B"),
            ScheduleKind::Interleaved { virtual_stages } => {
                write!(f, "interleaved 1F1B ({virtual_stages} virtual stages)")
            }
        }
    }
}

/// What one stage does next. A stage runs its actions strictly in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// The forward of `micro_batch` through model chunk `chunk` of this rank (0 unless
    /// interleaved).
    Forward { micro_batch: usize, chunk: usize },
    /// The backward of `micro_batch` through model chunk `chunk` of this rank.
    Backward { micro_batch: usize, chunk: usize },
    /// One batch of point-to-point operations, like Megatron's batched `isend`/`irecv`: all of them
    /// are posted together and the batch finishes when all of them have, so "send my activation
    /// to the next stage while receiving its gradient" cannot deadlock.
    Comm(Vec<P2p>),
}

/// The direction and payload of one point-to-point operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum P2pKind {
    /// Send the output activation of a forward to the stage holding the next global chunk.
    SendActivation,
    /// Receive the input activation of a forward from the stage holding the previous global chunk.
    RecvActivation,
    /// Send the input gradient of a backward to the stage holding the previous global chunk.
    SendGradient,
    /// Receive the output gradient of a backward from the stage holding the next global chunk.
    RecvGradient,
}

impl P2pKind {
    /// Whether this operation sends (the other two receive).
    pub fn is_send(self) -> bool {
        matches!(self, P2pKind::SendActivation | P2pKind::SendGradient)
    }

    /// Whether the payload is an activation (flows forward) rather than a gradient.
    pub fn is_activation(self) -> bool {
        matches!(self, P2pKind::SendActivation | P2pKind::RecvActivation)
    }
}

/// One point-to-point operation of a [`Action::Comm`] batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct P2p {
    pub kind: P2pKind,
    /// The pipeline rank on the other end.
    pub peer_stage: usize,
    pub micro_batch: usize,
    /// The model chunk on THIS rank the tensor belongs to: for a send, the chunk that produced
    /// it; for a receive, the chunk that consumes it.
    pub chunk: usize,
}

impl fmt::Display for P2p {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (verb, what, dir) = match self.kind {
            P2pKind::SendActivation => ("send", "activation", "to"),
            P2pKind::RecvActivation => ("recv", "activation", "from"),
            P2pKind::SendGradient => ("send", "gradient", "to"),
            P2pKind::RecvGradient => ("recv", "gradient", "from"),
        };
        write!(
            f,
            "{verb} {what} of micro-batch {} chunk {} {dir} stage {}",
            self.micro_batch, self.chunk, self.peer_stage
        )
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Forward { micro_batch, chunk } => {
                write!(f, "forward of micro-batch {micro_batch} chunk {chunk}")
            }
            Action::Backward { micro_batch, chunk } => {
                write!(f, "backward of micro-batch {micro_batch} chunk {chunk}")
            }
            Action::Comm(ops) => {
                write!(f, "comm [")?;
                for (i, op) in ops.iter().enumerate() {
                    if i > 0 {
                        write!(f, "; ")?;
                    }
                    write!(f, "{op}")?;
                }
                write!(f, "]")
            }
        }
    }
}

/// A pipeline schedule: for every stage (pipeline rank), the ordered actions it runs in one
/// training step. Built by [`Schedule::build`] (which validates what it builds); a hand-made or
/// edited one can be checked with [`Schedule::validate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub stages: usize,
    pub micro_batches: usize,
    /// `actions[stage]`: what that stage does, in order.
    pub actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// Model chunks per rank: the virtual stages when interleaved, else 1.
    pub fn model_chunks(&self) -> usize {
        match self.kind {
            ScheduleKind::Interleaved { virtual_stages } => virtual_stages,
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => 1,
        }
    }

    /// The position of `chunk` on `stage` in the whole model: `chunk * stages + stage`, so with
    /// interleaving the last stage's chunk `c` feeds stage 0's chunk `c + 1`.
    pub fn global_chunk(&self, stage: usize, chunk: usize) -> usize {
        chunk * self.stages + stage
    }

    /// Which `(stage, chunk)` holds global model chunk `global` (the layers of a model split into
    /// `stages * model_chunks()` consecutive chunks); `None` past the last one.
    pub fn chunk_owner(&self, global: usize) -> Option<(usize, usize)> {
        (self.stages > 0 && global < self.stages * self.model_chunks())
            .then(|| (global % self.stages, global / self.stages))
    }

    /// The textbook bubble: `(p - 1) / m`, divided by the virtual stages for interleaving (idle
    /// time over busy compute time per stage, see [`super::Timeline::bubble_fraction`]).
    pub fn bubble_fraction_formula(&self) -> f64 {
        if self.micro_batches == 0 {
            return f64::INFINITY;
        }
        self.stages.saturating_sub(1) as f64 / (self.micro_batches * self.model_chunks()) as f64
    }

    /// The most (micro-batch, chunk) pairs whose forward has run and whose backward has not, at any
    /// point of `stage`'s program: how many sets of activations the stage holds at its peak
    /// (GPipe: all `m`; 1F1B: at most `p - stage`).
    pub fn peak_in_flight(&self, stage: usize) -> usize {
        let Some(actions) = self.actions.get(stage) else {
            return 0;
        };
        let mut in_flight = 0usize;
        let mut peak = 0;
        for action in actions {
            match action {
                Action::Forward { .. } => {
                    in_flight += 1;
                    peak = peak.max(in_flight);
                }
                Action::Backward { .. } => in_flight = in_flight.saturating_sub(1),
                Action::Comm(_) => {}
            }
        }
        peak
    }
}
