//! `cargo xtask test`: what CI runs. Installs the pinned nvcc when none is found, then checks
//! formatting, lints (with the CUDA kernels compiled), the freshness of the generated kernel
//! bindings, and runs every test with `--features cuda`. GPU tests print that they skipped when
//! no GPU is present.

use crate::cmd::{cargo, run_checked};
use crate::setup_cuda;

pub fn run(args: &[String]) -> Result<(), String> {
    if let Some(unknown) = args.first() {
        return Err(format!("xtask test takes no arguments (got `{unknown}`)"));
    }
    let nvcc = match setup_cuda::find_nvcc() {
        Some(path) => path,
        None => {
            eprintln!("xtask test: no nvcc found; installing the pinned CUDA compiler");
            setup_cuda::run(&[])?
        }
    };
    eprintln!("xtask test: using nvcc at {}", nvcc.display());

    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);
    run_checked(fmt)?;

    let mut clippy = cargo();
    clippy.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--features",
        "tilearn-llm/cuda",
        "--",
        "-D",
        "warnings",
    ]);
    clippy.env("NVCC", &nvcc);
    run_checked(clippy)?;

    crate::build_kernels::run(&["--check".to_string()])?;

    let mut test = cargo();
    test.args(["test", "--workspace", "--features", "tilearn-llm/cuda"]);
    test.env("NVCC", &nvcc);
    run_checked(test)
}
