//! Project automation. `cargo xtask <command>`:
//!
//! * `train [ARGS…]`      build (with CUDA when nvcc is available) and run `tilearn train` on the
//!   embedded default; ARGS go to `tilearn train`.
//! * `test`               what CI runs: install the pinned nvcc if none is found, fmt, clippy,
//!   the bindings freshness check, and the whole test suite built with `--features cuda`.
//! * `setup-cuda`         install the pinned CUDA 13.0 nvcc from PyPI wheels into `target/cuda`.
//! * `build-kernels [--check]`  check every kernel file's header, then regenerate (or
//!   check) the bindgen FFI of tilearn-kernels' launcher header.
//! * `check-cycles`       fail on an import cycle between the modules of any workspace crate.

mod build_kernels;
mod cmd;
mod kernel_header;
mod module_cycles;
mod rust_tokens;
mod setup_cuda;
mod test;
mod train;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (command, rest) = match args.split_first() {
        Some((c, rest)) => (c.as_str(), rest),
        None => ("help", &[][..]),
    };
    let result = match command {
        "train" => train::run(rest),
        "test" => test::run(rest),
        "setup-cuda" => setup_cuda::run(rest).map(|_| ()),
        "build-kernels" => build_kernels::run(rest),
        "check-cycles" => module_cycles::run(rest),
        "help" | "--help" | "-h" => {
            println!("{}", HELP);
            Ok(())
        }
        other => Err(format!("unknown xtask command `{other}`\n{HELP}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask {command}: error: {message}");
            ExitCode::FAILURE
        }
    }
}

const HELP: &str = "usage: cargo xtask <train [ARGS…] | test | setup-cuda | build-kernels [--check] | check-cycles>";
