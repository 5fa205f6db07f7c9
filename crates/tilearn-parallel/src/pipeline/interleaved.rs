//! Interleaved 1F1B (Narayanan et al., 2021; Megatron's `forward_backward_pipelining_with_interleaving`):
//! each rank holds `v` model chunks. The `m * v` (micro-batch, chunk) forwards of a rank run in
//! Megatron's order: micro-batches in groups of `p`, each group through chunk 0, then chunk 1, …;
//! backwards in the same order with the chunks reversed. Stage `s` runs
//! `min(m * v, 2 (p - s - 1) + (v - 1) p)` warm-up forwards, then steps of one forward and one
//! backward followed by one communication batch (Megatron's
//! send_forward_backward_recv_forward_backward), then the remaining backwards.

use super::dataflow::Compute;
use super::placement::Step;

/// The steps of each of `stages` stages with `chunks` model chunks per stage; `micro_batches`
/// is a multiple of `stages` (checked by the caller).
pub(crate) fn steps(stages: usize, micro_batches: usize, chunks: usize) -> Vec<Vec<Step>> {
    let total = micro_batches * chunks;
    let group = stages * chunks;
    // The k-th (micro-batch, chunk) a rank processes, forwards and backwards alike.
    let nth = |k: usize, backward: bool| {
        let micro_batch = k / group * stages + k % stages;
        let chunk = k % group / stages;
        if backward {
            Compute::backward(micro_batch, chunks - 1 - chunk)
        } else {
            Compute::forward(micro_batch, chunk)
        }
    };
    (0..stages)
        .map(|stage| {
            let warmup = (2 * (stages - stage - 1) + (chunks - 1) * stages).min(total);
            let mut steps: Vec<Step> = (0..warmup).map(|k| vec![nth(k, false)]).collect();
            steps.extend((0..total - warmup).map(|k| vec![nth(warmup + k, false), nth(k, true)]));
            steps.extend((total - warmup..total).map(|k| vec![nth(k, true)]));
            steps
        })
        .collect()
}
