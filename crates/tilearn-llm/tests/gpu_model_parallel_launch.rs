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
//! * ZeRO-1 and ZeRO-2 around tp 2 (tp 2 × dp 2) and ZeRO-1 around pp 2 (pp 2 × dp 2), four
//!   processes on one GPU, equal one process with the same global batch within the same bound;
//!   a ZeRO-2 tp 2 × dp 2 checkpoint (four optimizer files: each rank's shard of its slices)
//!   resumes on its layout bit for bit and in one process within the bound; in bf16 without
//!   clipping, ZeRO-1 around tp 2 (the fp32 master sharded too) equals plain replicas bit for
//!   bit.
//! * On two GPUs (skipped, saying so, with fewer): tp 2 and pp 2 (4 micro-batches, 1F1B) with
//!   the device buffers over NCCL (the default when each rank has a GPU of its own, and the
//!   run says so) equal one process, within the same bound; on four, tp 2 × pp 2.

#![cfg(feature = "cuda")]

mod support;

use support::gpu_runs::{gpu_present, gpus_present, setup, train, train_in};
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

/// ZeRO around the split model (four processes sharing one GPU): the replicas' optimizer
/// shards cut from each rank's slices, the norm summed over the model's ranks and then the
/// replicas', the stepped shards all-gathered.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn zero_around_tensor_and_pipeline_parallelism_on_one_gpu_equals_one_process() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    for accumulation in ["2", "4"] {
        let name = format!("one{accumulation}");
        let flags = ["--gradient-accumulation-steps", accumulation];
        train(dir.path(), &[], &name, &flags);
    }
    for (name, split, accumulation, stage, one) in [
        ("tp2dp2z1", "--tp-size", "1", "1", "one2"),
        ("tp2dp2z2", "--tp-size", "1", "2", "one2"),
        ("pp2dp2z1", "--pp-size", "2", "1", "one4"),
    ] {
        let flags = [
            split,
            "2",
            "--gradient-accumulation-steps",
            accumulation,
            "--zero-stage",
            stage,
        ];
        let stdout = train(dir.path(), &launch("4"), name, &flags);
        assert!(stdout.contains(&format!("ZeRO stage {stage}")), "{stdout}");
        let what = format!("{name} (ZeRO-{stage}) on one GPU");
        assert_split_equals_one(dir.path(), one, name, &what);
    }
}

/// bf16 tp 2 × dp 2 without clipping: ZeRO-1 shards the fp32 master weights too (one 16-bit
/// precision), so each rank steps its shard and the replicas all-gather the stepped bf16
/// working copy, and a save gathers the master through the gradient buffer. AdamW is
/// elementwise, so the step-4 checkpoint equals plain data parallelism's bit for bit.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn bf16_zero_around_tensor_parallelism_shards_the_master_and_equals_plain_replicas() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    let flags = [
        "--tp-size",
        "2",
        "--max-grad-norm",
        "0",
        "--save-steps",
        "4",
    ];
    train_in(dir.path(), &launch("4"), "plain", "--bf16", &flags);
    let zero = [&flags[..], &["--zero-stage", "1"]].concat();
    train_in(dir.path(), &launch("4"), "zero1", "--bf16", &zero);
    let ckpt = |run: &str| weights(&dir.path().join(run).join("checkpoint-4"));
    let diff = max_abs_diff(&ckpt("plain"), &ckpt("zero1"));
    println!("bf16 tp 2 × dp 2, ZeRO-1 vs plain replicas (no clipping): max |Δw| = {diff:e}");
    assert_eq!(
        diff, 0.0,
        "bf16 ZeRO-1 around tp 2 differs from plain replicas"
    );
}

/// A checkpoint of tp 2 × dp 2 under ZeRO-2 (every rank writes its shard of its slices: four
/// optimizer files) resumes on the same layout to the uninterrupted run's weights bit for bit,
/// and in one process (each tensor read back whole from the four files' slices) within the
/// split bound of the uninterrupted run.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn a_zero_tensor_parallel_checkpoint_resumes_on_its_layout_and_in_one_process() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    let split = ["--tp-size", "2", "--zero-stage", "2", "--save-steps", "2"];
    train(dir.path(), &launch("4"), "full", &split);
    let ckpt = dir.path().join("full/checkpoint-2");
    for index in 0..4 {
        let file = format!("optimizer-rank{index:05}-of-00004.safetensors");
        assert!(ckpt.join(&file).exists(), "{file} missing");
    }
    let ckpt = ckpt.to_str().unwrap().to_string();
    let resume = ["--resume-from-checkpoint", ckpt.as_str()];
    train(
        dir.path(),
        &launch("4"),
        "same",
        &[&split[..], &resume[..]].concat(),
    );
    let full = weights(&dir.path().join("full"));
    let same = max_abs_diff(&full, &weights(&dir.path().join("same")));
    println!("ZeRO-2 tp 2 × dp 2 checkpoint resumed on its layout: max |Δw| = {same:e}");
    assert_eq!(same, 0.0, "same-layout resume");
    let stdout = train(
        dir.path(),
        &[],
        "one",
        &[&["--gradient-accumulation-steps", "2"][..], &resume[..]].concat(),
    );
    assert!(stdout.contains("training: steps 2..4"), "{stdout}");
    let one = max_abs_diff(&full, &weights(&dir.path().join("one")));
    println!("ZeRO-2 tp 2 × dp 2 checkpoint resumed in one process: max |Δw| = {one:e}");
    assert!(
        one <= SPLIT_TOLERANCE,
        "resumed in one process: max |Δw| = {one}"
    );
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
