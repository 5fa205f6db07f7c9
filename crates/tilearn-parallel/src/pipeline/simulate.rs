//! Replays a schedule in simulated time. Computes take their cost; a communication batch is
//! posted when its stage reaches it and finishes `p2p` after the last of its partners' batches is
//! posted (rendezvous: a send waits for its receive to be posted, and the other way round). When
//! no stage can move and some have work left, that is a deadlock, reported with every stuck stage,
//! the batch it waits in and the partner it waits for.

use super::error::{Result, ScheduleError};
use super::pairing::{self, Partners};
use super::schedule::{Action, Schedule};
use super::timeline::{Activity, Span, Timeline};

/// Time units of one forward and one backward of one model chunk, and of one communication batch
/// once all its partners are posted. With interleaving a chunk is `1/v` of a stage's layers:
/// divide per-stage costs by `v` to compare with a non-interleaved schedule of the same model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Costs {
    pub forward: f64,
    pub backward: f64,
    pub p2p: f64,
}

impl Default for Costs {
    /// Forward 1, backward 2 (a backward computes gradients of inputs and of weights), free p2p.
    fn default() -> Self {
        Costs {
            forward: 1.0,
            backward: 2.0,
            p2p: 0.0,
        }
    }
}

impl Costs {
    fn check(&self) -> Result<()> {
        // (field, value, whether 0 is allowed): a compute that takes no time would make the
        // bubble fraction meaningless; free communication is the usual idealisation.
        for (field, value, zero_ok) in [
            ("forward cost", self.forward, false),
            ("backward cost", self.backward, false),
            ("p2p cost", self.p2p, true),
        ] {
            if !(value.is_finite() && (value > 0.0 || (zero_ok && value == 0.0))) {
                let least = if zero_ok {
                    "zero or more"
                } else {
                    "above zero"
                };
                return Err(ScheduleError::Config {
                    field,
                    value: value.to_string(),
                    reason: format!("must be a finite number, {least}"),
                });
            }
        }
        Ok(())
    }
}

impl Schedule {
    /// Simulates one step of this schedule with `costs` (see the module comment). Errors name the
    /// messages that do not pair up, or, on a deadlock, every stuck stage and what it waits for.
    pub fn simulate(&self, costs: &Costs) -> Result<Timeline> {
        costs.check()?;
        let shape = self.checked_shape()?;
        let partners = pairing::pair(shape, &self.actions)?;
        let stages = self.stages;
        let mut clock = vec![0.0f64; stages];
        let mut next = vec![0usize; stages];
        let mut posted: Vec<Vec<Option<f64>>> =
            self.actions.iter().map(|p| vec![None; p.len()]).collect();
        let mut spans: Vec<Vec<Span>> = vec![Vec::new(); stages];
        let mut progressed = true;
        while progressed {
            progressed = false;
            for stage in 0..stages {
                while let Some(action) = self.actions[stage].get(next[stage]) {
                    let index = next[stage];
                    let start = clock[stage];
                    let (end, what) = match *action {
                        Action::Forward { micro_batch, chunk } => (
                            start + costs.forward,
                            Activity::Forward { micro_batch, chunk },
                        ),
                        Action::Backward { micro_batch, chunk } => (
                            start + costs.backward,
                            Activity::Backward { micro_batch, chunk },
                        ),
                        Action::Comm(ref ops) => {
                            posted[stage][index] = Some(start);
                            let mut last_post = start;
                            let mut all_posted = true;
                            for &(peer, peer_index) in &partners[stage][index] {
                                match posted[peer][peer_index] {
                                    Some(at) => last_post = last_post.max(at),
                                    None => all_posted = false,
                                }
                            }
                            if !all_posted {
                                break;
                            }
                            let cost = if ops.is_empty() { 0.0 } else { costs.p2p };
                            (last_post + cost, Activity::Comm)
                        }
                    };
                    if end > start || what != Activity::Comm {
                        spans[stage].push(Span { start, end, what });
                    }
                    clock[stage] = end;
                    next[stage] += 1;
                    progressed = true;
                }
            }
        }
        if (0..stages).any(|s| next[s] < self.actions[s].len()) {
            return Err(ScheduleError::Deadlock(
                self.describe_stuck(&next, &posted, &partners),
            ));
        }
        Ok(Timeline {
            kind: self.kind,
            micro_batches: self.micro_batches,
            spans,
            makespan: clock.iter().copied().fold(0.0, f64::max),
            formula_bubble_fraction: self.bubble_fraction_formula(),
        })
    }

    /// One clause per stuck stage: where it waits, and for which partner batch.
    fn describe_stuck(
        &self,
        next: &[usize],
        posted: &[Vec<Option<f64>>],
        partners: &Partners,
    ) -> String {
        let mut clauses = Vec::new();
        for (stage, &index) in next.iter().enumerate() {
            let Some(action) = self.actions[stage].get(index) else {
                continue;
            };
            let waits: Vec<String> = partners[stage][index]
                .iter()
                .filter(|&&(peer, peer_index)| posted[peer][peer_index].is_none())
                .map(|&(peer, peer_index)| {
                    format!(
                        "stage {peer} to reach its action {peer_index} ({})",
                        self.actions[peer][peer_index]
                    )
                })
                .collect();
            clauses.push(format!(
                "stage {stage} is stuck at action {index} ({action}) waiting for {}",
                waits.join(" and ")
            ));
        }
        clauses.join("; ")
    }
}
