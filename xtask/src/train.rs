//! `cargo xtask train [ARGS…]`: the main job. Builds the `tilearn` CLI in release mode (with the
//! CUDA kernels when nvcc is available) and runs `tilearn train` on the embedded default; ARGS
//! are passed to `tilearn train` unchanged.

use crate::cmd::{cargo, run_checked, workspace_root};
use crate::setup_cuda::find_nvcc;

pub fn run(args: &[String]) -> Result<(), String> {
    let mut build = cargo();
    build.args([
        "build",
        "--release",
        "-p",
        "tilearn-llm",
        "--bin",
        "tilearn",
    ]);
    if find_nvcc().is_some() {
        build.args(["--features", "cuda"]);
    } else {
        eprintln!(
            "xtask train: nvcc not found, building without CUDA kernels (run `cargo xtask setup-cuda` to add them)"
        );
    }
    run_checked(build)?;

    let exe = workspace_root().join("target/release/tilearn");
    let mut train = std::process::Command::new(exe);
    train.arg("train");
    if !args.iter().any(|a| a == "--output-dir") {
        train.args(["--output-dir", "runs/default"]);
    }
    train.args(args);
    run_checked(train)
}
