//! 1F1B (PipeDream-Flush, Megatron's non-interleaved schedule): stage `s` runs
//! `min(p - s - 1, m)` warm-up forwards, then alternates one forward and one backward, then
//! drains the remaining backwards. A stage starts a new micro-batch only after the last stage has
//! begun returning gradients, so it holds at most `p - s` micro-batches of activations.

use super::dataflow::Compute;
use super::placement::Step;

/// The steps of each of `stages` stages.
pub(crate) fn steps(stages: usize, micro_batches: usize) -> Vec<Vec<Step>> {
    (0..stages)
        .map(|stage| {
            let warmup = (stages - stage - 1).min(micro_batches);
            let mut steps: Vec<Step> = (0..warmup)
                .map(|mb| vec![Compute::forward(mb, 0)])
                .collect();
            for steady in 0..micro_batches - warmup {
                // Separate steps, so the forward's activation leaves (and the backward's gradient
                // arrives) in the batch between them, as Megatron's send_forward_recv_backward.
                steps.push(vec![Compute::forward(warmup + steady, 0)]);
                steps.push(vec![Compute::backward(steady, 0)]);
            }
            steps.extend(
                (micro_batches - warmup..micro_batches).map(|mb| vec![Compute::backward(mb, 0)]),
            );
            steps
        })
        .collect()
}
