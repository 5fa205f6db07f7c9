//! Tensor and pipeline parallelism on the GPU engine through the real launcher (feature `cuda`,
//! a CUDA GPU; NCCL for the two-GPU tests, found as `libnccl.so.2`/`libnccl.so` on the library
//! path or at `TILEARN_NCCL_LIBRARY`). The per-rank arithmetic is tested in tilearn-engine's
//! `gpu_model_parallel.rs`/`gpu_pipeline_parallel.rs` (ranks on threads sharing one GPU);
//! these tests cover how `tilearn train` wires the ranks.
//!
//! * tp 2 × dp 2 (four processes sharing one GPU, so the device buffers default to the host
//!   communicator) equals one process with the same global batch (2 sequences × 2 accumulation
//!   steps against 2 sequences on each of the two replicas): fp32, 4 steps at lr 1e-2, max
//!   |Δw| ≤ `support::SPLIT_TOLERANCE` (2e-4: the split and the replicas' sum only reorder f32
//!   additions, ~1e-7 relative, which AdamW magnifies for a weight whose gradient is near its
//!   ε) and the logged loss and gradient norm within 2e-4 relative at every step; a replica
//!   that trained on the wrong data, or a sum left out, moves weights by ~lr.
//! * tp 2 × pp 2 (four processes) and tp 2 × pp 2 × dp 2 (eight) on one GPU, 1F1B over 4
//!   micro-batches, equal one process with the same global batch (4 and 8 accumulation steps),
//!   within the same bound: the tensor sums inside each stage, the boundary sends between the
//!   stages and the replicas' gradient sum composed by the launcher's groups.
//! * On two GPUs (skipped, saying so, with fewer): tp 2 and pp 2 (4 micro-batches, 1F1B) with
//!   the device buffers over NCCL (the default when each rank has a GPU of its own, and the
//!   run says so) equal one process, within the same bound; on four, tp 2 × pp 2.

#![cfg(feature = "cuda")]

mod support;

use support::gpu_runs::{gpu_present, gpus_present, setup, train};
use support::{SPLIT_TOLERANCE, assert_logs_agree, max_abs_diff, weights};

/// Launches `ranks` processes on this host.
fn launch(ranks: &'static str) -> [&'static str; 6] {
    [
        "launch",
        "--nproc-per-node",
        ranks,
        "--standalone",
        "--comm-timeout",
        "120",
    ]
}

/// The split run in `dir/split` ended where the one process in `dir/one` did: weights within
/// [`SPLIT_TOLERANCE`], logged losses and gradient norms within 2e-4 relative at every step.
fn assert_split_equals_one(dir: &std::path::Path, one: &str, split: &str, what: &str) {
    let (one, split) = (dir.join(one), dir.join(split));
    let diff = max_abs_diff(&weights(&one), &weights(&split));
    println!("{what} vs one process: max |Δw| = {diff:e}");
    assert!(diff <= SPLIT_TOLERANCE, "{what}: max |Δw| = {diff}");
    assert_logs_agree(&one, &split, 2e-4);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensor_parallel_with_data_parallel_around_it_on_one_gpu_equals_one_process() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    let accumulate = ["--gradient-accumulation-steps", "2"];
    train(dir.path(), &[], "one", &accumulate);
    let stdout = train(dir.path(), &launch("4"), "tp2dp2", &["--tp-size", "2"]);
    // Four ranks on fewer GPUs: the host communicator by default (NCCL refuses shared GPUs).
    let gpus = tilearn_ops::backend::probe().devices.len();
    if gpus < 4 {
        assert!(
            stdout.contains("tp 2 × dp 2 × pp 1") && stdout.contains("device buffers over host"),
            "{stdout}"
        );
    }
    assert_split_equals_one(
        dir.path(),
        "one",
        "tp2dp2",
        &format!("tp 2 × dp 2 on {gpus} GPU(s)"),
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensor_and_pipeline_parallel_with_and_without_replicas_on_one_gpu_equal_one_process() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    let split = ["--tp-size", "2", "--pp-size", "2"];
    for (ranks, replicas, accumulation) in [("4", 1, "4"), ("8", 2, "8")] {
        let one = format!("one{accumulation}");
        train(
            dir.path(),
            &[],
            &one,
            &["--gradient-accumulation-steps", accumulation],
        );
        let name = format!("tp2pp2dp{replicas}");
        let mut flags = vec!["--gradient-accumulation-steps", "4"];
        flags.extend(split);
        let stdout = train(dir.path(), &launch(ranks), &name, &flags);
        assert!(
            stdout.contains(&format!("tp 2 × dp {replicas} × pp 2")),
            "{stdout}"
        );
        let what = format!("tp 2 × pp 2 × dp {replicas} on one GPU");
        assert_split_equals_one(dir.path(), &one, &name, &what);
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn two_gpus_tensor_parallel_over_nccl_equals_one_process() {
    if !gpus_present(2) {
        return;
    }
    let dir = setup();
    train(dir.path(), &[], "one", &[]);
    let stdout = train(dir.path(), &launch("2"), "tp2", &["--tp-size", "2"]);
    assert!(stdout.contains("device buffers over nccl"), "{stdout}");
    assert_split_equals_one(dir.path(), "one", "tp2", "tp 2 over NCCL on 2 GPUs");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn two_gpus_pipeline_over_nccl_equals_one_process() {
    if !gpus_present(2) {
        return;
    }
    let dir = setup();
    let micro_batches = ["--gradient-accumulation-steps", "4"];
    train(dir.path(), &[], "one", &micro_batches);
    let pp = [micro_batches[0], micro_batches[1], "--pp-size", "2"];
    let stdout = train(dir.path(), &launch("2"), "pp2", &pp);
    assert!(stdout.contains("device buffers over nccl"), "{stdout}");
    assert_split_equals_one(dir.path(), "one", "pp2", "pp 2 over NCCL on 2 GPUs");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn four_gpus_tensor_and_pipeline_over_nccl_equal_one_process() {
    if !gpus_present(4) {
        return;
    }
    let dir = setup();
    let micro_batches = ["--gradient-accumulation-steps", "4"];
    train(dir.path(), &[], "one", &micro_batches);
    let split = [
        micro_batches[0],
        micro_batches[1],
        "--tp-size",
        "2",
        "--pp-size",
        "2",
    ];
    let stdout = train(dir.path(), &launch("4"), "tp2pp2", &split);
    assert!(stdout.contains("device buffers over nccl"), "{stdout}");
    assert_split_equals_one(
        dir.path(),
        "one",
        "tp2pp2",
        "tp 2 × pp 2 over NCCL on 4 GPUs",
    );
}
