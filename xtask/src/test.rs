//! `cargo xtask test`: what CI runs. Installs the pinned nvcc when none is found, then checks
//! formatting, lints (with the CUDA kernels compiled), the freshness of the generated kernel
//! bindings, and runs every test with `--features cuda`. GPU tests print that they skipped when
//! no GPU is present.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use crate::cmd::{cargo, run_checked, workspace_root};
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
    let totals = run_counting_tests(test)?;
    // One closing line for the whole suite: cargo's own last line is a doctest summary that
    // often reads "0 passed" and would hide how many tests really ran.
    println!(
        "tests: {} passed, {} failed, {} skipped",
        totals.passed, totals.failed, totals.ignored
    );
    if totals.failed > 0 {
        return Err(format!("{} tests failed", totals.failed));
    }
    Ok(())
}

#[derive(Default)]
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
}

/// Runs `cargo test`, echoing its output, and adds up every `test result:` line.
fn run_counting_tests(mut cmd: Command) -> Result<Totals, String> {
    cmd.current_dir(workspace_root()).stdout(Stdio::piped());
    eprintln!("$ {cmd:?}");
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("could not start cargo test: {e}"))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut totals = Totals::default();
    for line in BufReader::new(stdout).lines() {
        let line = line.map_err(|e| format!("reading cargo test output: {e}"))?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            totals.passed += count_before(rest, " passed");
            totals.failed += count_before(rest, " failed");
            totals.ignored += count_before(rest, " ignored");
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("waiting for cargo test: {e}"))?;
    if !status.success() {
        return Err(format!("cargo test failed with {status}"));
    }
    Ok(totals)
}

/// The number just before `label` in a libtest summary such as `ok. 5 passed; 0 failed; …`.
fn count_before(summary: &str, label: &str) -> u64 {
    summary
        .find(label)
        .and_then(|end| summary[..end].rsplit([' ', '.']).next()?.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::count_before;

    #[test]
    fn reads_libtest_summary_counts() {
        let s = "ok. 12 passed; 3 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.05s";
        assert_eq!(count_before(s, " passed"), 12);
        assert_eq!(count_before(s, " failed"), 3);
        assert_eq!(count_before(s, " ignored"), 1);
    }
}
