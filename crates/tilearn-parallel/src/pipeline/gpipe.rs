//! GPipe: every stage runs all its forwards, then all its backwards (in micro-batch order, which
//! for the bubble is as good as any). Every micro-batch's activations are held at once.

use super::dataflow::Compute;
use super::placement::Step;

/// The steps of each of `stages` stages.
pub(crate) fn steps(stages: usize, micro_batches: usize) -> Vec<Vec<Step>> {
    let stage_steps: Vec<Step> = (0..micro_batches)
        .map(|mb| vec![Compute::forward(mb, 0)])
        .chain((0..micro_batches).map(|mb| vec![Compute::backward(mb, 0)]))
        .collect();
    vec![stage_steps; stages]
}
