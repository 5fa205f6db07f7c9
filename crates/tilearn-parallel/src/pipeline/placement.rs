//! From compute order to a full program: where every send and receive goes.
//!
//! A generator gives each stage a list of steps (one or two computes each). Every step gets a
//! tick, as early as its stage's previous step and its remote inputs allow (one tick per step, as
//! if every step took the same time): `tick = max(previous tick, ticks of the steps producing its
//! inputs on other stages) + 1`. Each tensor is then sent in a [`Action::Comm`] batch right after
//! the step that produced it and received in the receiver's batch *of the same tick*, which
//! comes before the step that consumes it (that step's tick is larger).
//!
//! Why this cannot deadlock, whatever the real costs: along every stage the ticks of its batches
//! strictly increase, and the partners of every operation sit in batches of the same tick. If
//! every batch of tick `< t` has finished, every stage reaches its batch of tick `t` (what runs in
//! between needs only data that arrived earlier), so all partners of that batch are posted and it
//! finishes too; by induction every batch does. In 1F1B's steady phase this gives Megatron's
//! pairs (send_forward_recv_backward, send_backward_recv_forward); with interleaving, Megatron's
//! one batch of up to four operations per steady step.

use std::collections::BTreeMap;

use super::dataflow::{Compute, Pass, Shape};
use super::error::{Result, ScheduleError};
use super::schedule::{Action, P2p, P2pKind};

/// Computes that run back to back and are followed by one communication batch.
pub(crate) type Step = Vec<Compute>;

/// The actions of every stage: the generators' steps with the communication placed.
pub(crate) fn place(shape: Shape, steps: &[Vec<Step>]) -> Result<Vec<Vec<Action>>> {
    let ticks = assign_ticks(shape, steps)?;
    let mut batches: Vec<BTreeMap<usize, Vec<P2p>>> = vec![BTreeMap::new(); shape.stages];
    for (stage, stage_steps) in steps.iter().enumerate() {
        for (step, &tick) in stage_steps.iter().zip(&ticks[stage]) {
            for compute in step {
                let Some((to, kind)) = shape.output_of(stage, *compute) else {
                    continue;
                };
                if to.stage == stage {
                    continue; // consecutive chunks on one rank (one stage): no message
                }
                let micro_batch = compute.micro_batch;
                let receive = match kind {
                    P2pKind::SendActivation => P2pKind::RecvActivation,
                    _ => P2pKind::RecvGradient,
                };
                // Pushed in the same order on both ends, so each link lists its messages alike.
                batches[stage].entry(tick).or_default().push(P2p {
                    kind,
                    peer_stage: to.stage,
                    micro_batch,
                    chunk: compute.chunk,
                });
                batches[to.stage].entry(tick).or_default().push(P2p {
                    kind: receive,
                    peer_stage: stage,
                    micro_batch,
                    chunk: to.chunk,
                });
            }
        }
    }
    let programs = steps
        .iter()
        .zip(&ticks)
        .zip(batches)
        .map(|((stage_steps, stage_ticks), mut stage_batches)| {
            let mut actions = Vec::new();
            for (step, &tick) in stage_steps.iter().zip(stage_ticks) {
                // Receive-only batches of ticks where this stage computes nothing.
                let later = stage_batches.split_off(&tick);
                actions.extend(stage_batches.into_values().map(Action::Comm));
                stage_batches = later;
                actions.extend(step.iter().map(|compute| compute.to_action()));
                if let Some(ops) = stage_batches.remove(&tick) {
                    actions.push(Action::Comm(ops));
                }
            }
            actions.extend(stage_batches.into_values().map(Action::Comm));
            actions
        })
        .collect();
    Ok(programs)
}

/// Where a compute's tick is kept: one slot per (pass, chunk, micro-batch) of a stage.
fn slot(shape: Shape, compute: Compute) -> usize {
    let pass = match compute.pass {
        Pass::Forward => 0,
        Pass::Backward => 1,
    };
    (pass * shape.chunks + compute.chunk) * shape.micro_batches + compute.micro_batch
}

/// The tick of every step (see the module comment), or an error naming the step that can never
/// run because the generator ordered a stage's computes against the data flow.
fn assign_ticks(shape: Shape, steps: &[Vec<Step>]) -> Result<Vec<Vec<usize>>> {
    let slots = 2 * shape.chunks * shape.micro_batches;
    let mut done: Vec<Vec<Option<usize>>> = vec![vec![None; slots]; shape.stages];
    let mut ticks: Vec<Vec<usize>> = vec![Vec::new(); shape.stages];
    let mut progressed = true;
    while progressed {
        progressed = false;
        for (stage, stage_steps) in steps.iter().enumerate() {
            'steps: while let Some(step) = stage_steps.get(ticks[stage].len()) {
                let mut tick = ticks[stage].last().map_or(1, |last| last + 1);
                for (i, compute) in step.iter().enumerate() {
                    let Some((from, input)) = shape.input_of(stage, *compute) else {
                        continue;
                    };
                    let ready = done[from][slot(shape, input)];
                    match ready {
                        Some(at) if from != stage => tick = tick.max(at + 1),
                        Some(_) => {}
                        None if from == stage && step[..i].contains(&input) => {}
                        None => break 'steps,
                    }
                }
                for compute in step {
                    done[stage][slot(shape, *compute)] = Some(tick);
                }
                ticks[stage].push(tick);
                progressed = true;
            }
        }
    }
    for (stage, stage_steps) in steps.iter().enumerate() {
        if let Some(step) = stage_steps.get(ticks[stage].len()) {
            return Err(ScheduleError::Deadlock(format!(
                "the compute order of stage {stage} cannot proceed past step {} ({:?}): its input \
                 is produced after it (a schedule generator bug)",
                ticks[stage].len(),
                step
            )));
        }
    }
    Ok(ticks)
}
