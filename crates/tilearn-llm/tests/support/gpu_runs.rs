//! GPU runs of `tilearn train` through the CLI for the launcher-level GPU tests: whether the
//! machine has the GPUs a test needs (saying so when it skips), a tiny Llama, its embedded
//! corpus, and a training run of it under `tilearn launch` or alone.

use std::path::Path;
use std::process::Command;

use super::{bin, ok};

/// Whether a usable CUDA GPU is present; prints why the test skips when not.
pub fn gpu_present() -> bool {
    gpus_present(1)
}

/// Whether `wanted` usable CUDA GPUs are present; prints why the test skips when not.
pub fn gpus_present(wanted: usize) -> bool {
    let info = tilearn_ops::backend::probe();
    if !info.cuda_usable() {
        println!("skipped: no usable CUDA GPU");
        return false;
    }
    if info.devices.len() < wanted {
        println!(
            "skipped: needs {wanted} GPUs, {} present",
            info.devices.len()
        );
        return false;
    }
    true
}

/// A Llama of 2 layers, hidden 64, 4/2 heads and 257 words (which tensor parallelism cuts
/// 129 + 128), untied.
pub const TINY: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "vocab_size": 257, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0}"#;

/// Runs `tilearn train` on the GPU in fp32 (under `tilearn launch` with `launch` flags when
/// given) with the tiny model and the embedded corpus in `data`.
pub fn train(dir: &Path, launch: &[&str], out: &str, extra: &[&str]) -> String {
    train_in(dir, launch, out, "--fp32", extra)
}

/// [`train`] in `precision` (`--fp32`, `--bf16`); no checkpoints unless `extra` asks with
/// `--save-steps`. `--deterministic`: the runs are compared bit for bit, which the one-pass
/// flash attention backward (bf16 on Hopper at head_dim 64) would not allow.
pub fn train_in(dir: &Path, launch: &[&str], out: &str, precision: &str, extra: &[&str]) -> String {
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
        precision,
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
        "--deterministic",
        "--logging-steps",
        "1",
    ]);
    if !extra.contains(&"--save-steps") {
        args.extend(["--save-strategy", "no"]);
    }
    args.extend(extra);
    ok(Command::new(bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(&args)
        .output()
        .unwrap())
}

/// A temporary directory holding `tiny.json` ([`TINY`]) and, in `gen/data`, the embedded corpus
/// (written by a one-step CPU run).
pub fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tiny.json"), TINY).unwrap();
    let config = dir.path().join("tiny.json");
    let gen_dir = dir.path().join("gen");
    ok(Command::new(bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
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
        .unwrap());
    dir
}
