//! `cargo xtask test`: what CI runs. Installs the pinned nvcc and libclang when none is found,
//! then checks formatting, lints (with the CUDA kernels compiled), the freshness of the generated
//! kernel bindings, and runs every test with `--features cuda`.
//!
//! Tests that need a GPU are `#[ignore = "needs a CUDA GPU (run with --include-ignored)"]`, so
//! here they are listed as ignored, and the closing line counts them apart from any other ignored
//! test. The GPU machine runs them with `--include-ignored`; there, without a GPU, each prints
//! `skipped: <reason>` and returns.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use crate::cmd::{cargo, run_checked, workspace_root};
use crate::{setup_cuda, setup_libclang};

/// The start of the ignore reason every GPU test carries (libtest prints `test NAME ... ignored,
/// REASON`). The attribute needs a literal, so each test spells it out.
const GPU_IGNORE_REASON: &str = "needs a CUDA GPU";

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
    let libclang = setup_libclang::ensure()?;
    eprintln!("xtask test: using {libclang} (for the bindings check)");

    report_free_disk();

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
    one_shot_build(&mut clippy);
    run_checked(clippy)?;

    crate::build_kernels::run(&["--check".to_string()])?;
    crate::module_cycles::run(&[])?;

    let mut test = cargo();
    test.args(["test", "--workspace", "--features", "tilearn-llm/cuda"]);
    test.env("NVCC", &nvcc);
    one_shot_build(&mut test);
    let totals = run_counting_tests(test)?;
    // One closing line for the whole suite: cargo's own last line is a doctest summary that
    // often reads "0 passed" and would hide how many tests really ran.
    println!("{}", totals.summary());
    if totals.failed > 0 {
        return Err(format!("{} tests failed", totals.failed));
    }
    Ok(())
}

/// Turns off incremental compilation unless the caller chose otherwise: CI builds once from a
/// fresh clone, where incremental caches only cost disk (gigabytes for this workspace).
fn one_shot_build(cmd: &mut Command) {
    if std::env::var_os("CARGO_INCREMENTAL").is_none() {
        cmd.env("CARGO_INCREMENTAL", "0");
    }
}

/// About what a fresh `cargo xtask test` writes under `target/` (check, test and kernel builds;
/// 4.8 GB measured on 2026-12-02, with the CUDA compiler).
const DISK_NEEDED_GIB: f64 = 6.0;

/// Prints the free space under `target/`'s file system and warns when it is below what a fresh
/// run needs, so that a build that later fails with "No space left on device" was announced.
fn report_free_disk() {
    let root = workspace_root();
    let Ok(out) = Command::new("df").args(["-Pk"]).arg(&root).output() else {
        return;
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let free_kib = text
        .lines()
        .nth(1)
        .and_then(|line| line.split_whitespace().nth(3))
        .and_then(|field| field.parse::<f64>().ok());
    if let Some(kib) = free_kib {
        let gib = kib / (1024.0 * 1024.0);
        eprintln!("xtask test: {gib:.1} GiB free under {}", root.display());
        if gib < DISK_NEEDED_GIB {
            eprintln!(
                "xtask test: warning: a fresh run writes about {DISK_NEEDED_GIB} GiB under target/; \
                 free disk space (or run `cargo clean`) if the build fails with \"No space left\""
            );
        }
    }
}

#[derive(Default)]
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
    /// Of `ignored`, the tests ignored because they need a GPU.
    gpu_ignored: u64,
}

impl Totals {
    /// Adds one line of `cargo test` output: a binary's `test result:` summary or the line of
    /// one ignored test.
    fn add_line(&mut self, line: &str) {
        if let Some(rest) = line.strip_prefix("test result: ") {
            self.passed += count_before(rest, " passed");
            self.failed += count_before(rest, " failed");
            self.ignored += count_before(rest, " ignored");
        } else if line.starts_with("test ")
            && line.contains(&format!(" ... ignored, {GPU_IGNORE_REASON}"))
        {
            self.gpu_ignored += 1;
        }
    }

    /// The closing line, saying which skipped tests need a GPU.
    fn summary(&self) -> String {
        let mut line = format!(
            "tests: {} passed, {} failed, {} skipped",
            self.passed, self.failed, self.ignored
        );
        let other = self.ignored.saturating_sub(self.gpu_ignored);
        let run_them = "run them on a GPU machine with `cargo test -- --include-ignored`";
        match (self.gpu_ignored, other) {
            (0, _) => {}
            (gpu, 0) => line += &format!(" (all {gpu} need a CUDA GPU; {run_them})"),
            (gpu, other) => {
                line += &format!(
                    " ({gpu} need a CUDA GPU, {run_them}; {other} ignored for other reasons)"
                )
            }
        }
        line
    }
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
        totals.add_line(&line);
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
    use super::{Totals, count_before};

    #[test]
    fn reads_libtest_summary_counts() {
        let s = "ok. 12 passed; 3 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.05s";
        assert_eq!(count_before(s, " passed"), 12);
        assert_eq!(count_before(s, " failed"), 3);
        assert_eq!(count_before(s, " ignored"), 1);
    }

    #[test]
    fn counts_gpu_tests_among_the_skipped() {
        let mut t = Totals::default();
        for line in [
            "test cast_is_exact ... ignored, needs a CUDA GPU (run with --include-ignored)",
            "test step_time_of_the_default_model ... ignored",
            "test adds ... ok",
            "test result: ok. 1 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out",
        ] {
            t.add_line(line);
        }
        assert_eq!((t.passed, t.failed, t.ignored, t.gpu_ignored), (1, 0, 2, 1));
        assert_eq!(
            t.summary(),
            "tests: 1 passed, 0 failed, 2 skipped (1 need a CUDA GPU, run them on a GPU machine with \
             `cargo test -- --include-ignored`; 1 ignored for other reasons)"
        );
        let only_gpu = Totals {
            ignored: 3,
            gpu_ignored: 3,
            ..Totals::default()
        };
        assert_eq!(
            only_gpu.summary(),
            "tests: 0 passed, 0 failed, 3 skipped (all 3 need a CUDA GPU; run them on a GPU machine \
             with `cargo test -- --include-ignored`)"
        );
        assert_eq!(
            Totals::default().summary(),
            "tests: 0 passed, 0 failed, 0 skipped"
        );
    }
}
