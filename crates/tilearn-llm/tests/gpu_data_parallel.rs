//! Data parallelism on the GPU engine through the real launcher (feature `cuda`, a CUDA GPU;
//! NCCL for the second test, found as `libnccl.so.2`/`libnccl.so` on the library path or at
//! `TILEARN_NCCL_LIBRARY`).
//!
//! * Two ranks share one GPU over the host communicator (device gradients staged through
//!   page-locked memory) and give the weights of one process with the same global batch.
//!   Tolerance |Δw| ≤ 1e-4 in fp32 (one step moves a weight by up to lr = 1e-2): as on the CPU
//!   the sums of the ranks' gradients round differently from one process's accumulation inside
//!   the backward kernels (~1e-7 relative), enlarged by AdamW for near-zero gradients; the GPU's
//!   reductions add their own ordering.
//! * NCCL with world size 1 through the launcher equals a plain run exactly (the all-reduce of
//!   one rank leaves the gradients as they are).

#![cfg(feature = "cuda")]

mod support;

use std::path::Path;
use std::process::Command;

use support::{max_abs_diff, ok, weights};

fn gpu_present() -> bool {
    let info = tilearn_ops::backend::probe();
    if !info.cuda_usable() {
        println!("skipped: no usable CUDA GPU");
    }
    info.cuda_usable()
}

const TINY: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "vocab_size": 257, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0}"#;

/// Runs `tilearn train` on the GPU in fp32 (under `tilearn launch` with `launch` flags when
/// given) with the tiny model and the embedded corpus in `data`.
fn train(dir: &Path, launch: &[&str], out: &str, extra: &[&str]) -> String {
    let config = dir.join("tiny.json");
    let data = dir.join("gen/data");
    let out = dir.join(out);
    let mut args: Vec<&str> = launch.to_vec();
    args.extend([
        "train",
        "--config",
        config.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--device",
        "cuda",
        "--fp32",
        "--seq-len",
        "64",
        "--per-device-train-batch-size",
        "2",
        "--max-steps",
        "4",
        "--learning-rate",
        "1e-2",
        "--warmup-steps",
        "0",
        "--save-strategy",
        "no",
    ]);
    args.extend(extra);
    ok(
        Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
            .args(&args)
            .output()
            .unwrap(),
    )
}

fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tiny.json"), TINY).unwrap();
    let config = dir.path().join("tiny.json");
    let gen_dir = dir.path().join("gen");
    ok(
        Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
            .args([
                "train",
                "--config",
                config.to_str().unwrap(),
                "--output-dir",
                gen_dir.to_str().unwrap(),
                "--max-steps",
                "1",
                "--device",
                "cpu",
                "--seq-len",
                "64",
                "--save-strategy",
                "no",
            ])
            .output()
            .unwrap(),
    );
    dir
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn two_ranks_sharing_one_gpu_over_the_host_communicator_equal_one_process() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    train(
        dir.path(),
        &[],
        "one",
        &["--gradient-accumulation-steps", "2"],
    );
    let launch = [
        "launch",
        "--nproc-per-node",
        "2",
        "--standalone",
        "--comm-timeout",
        "120",
    ];
    let stdout = train(dir.path(), &launch, "two", &["--ddp-backend", "host"]);
    assert!(stdout.contains("host backend"), "{stdout}");
    let diff = max_abs_diff(
        &weights(&dir.path().join("one")),
        &weights(&dir.path().join("two")),
    );
    println!("2 ranks on one GPU vs one process: max |Δw| = {diff:e}");
    assert!(diff <= 1e-4, "max |Δw| = {diff}");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn nccl_with_one_rank_through_the_launcher_equals_a_plain_run() {
    if !gpu_present() {
        return;
    }
    let dir = setup();
    train(dir.path(), &[], "plain", &[]);
    let launch = ["launch", "--nproc-per-node", "1", "--standalone"];
    let stdout = train(dir.path(), &launch, "nccl", &["--ddp-backend", "nccl"]);
    assert!(stdout.contains("nccl backend"), "{stdout}");
    assert_eq!(
        weights(&dir.path().join("plain")),
        weights(&dir.path().join("nccl"))
    );
}
