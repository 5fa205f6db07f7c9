//! `tilearn launch` through the real binary: torchrun's flags (both spellings) and environment
//! contract, `[rank N]` output, subcommands, and one error line naming a killed rank.

mod support;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn tilearn(args: &[&str]) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(args)
        .env_remove("OMP_NUM_THREADS")
        .output()
        .expect("run tilearn");
    (out, start.elapsed())
}

#[test]
fn every_rank_gets_torchruns_environment() {
    let script = "echo env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK \
                  $MASTER_ADDR $OMP_NUM_THREADS ${MASTER_PORT:+port}";
    let (out, _) = tilearn(&[
        "launch",
        "--nproc_per_node",
        "2",
        "--standalone",
        "--",
        "sh",
        "-c",
        script,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("[rank 0] env 0 0 2 2 0 127.0.0.1 1 port"),
        "{stdout}"
    );
    assert!(
        stdout.contains("[rank 1] env 1 1 2 2 0 127.0.0.1 1 port"),
        "{stdout}"
    );
}

#[test]
fn a_subcommand_runs_this_executable_per_rank() {
    let (out, _) = tilearn(&["launch", "--nproc-per-node", "2", "--standalone", "info"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!("[rank {rank}] tilearn ")),
            "{stdout}"
        );
    }
}

#[test]
fn a_killed_rank_ends_the_job_with_one_line_naming_it() {
    let script = "if [ \"$RANK\" = 1 ]; then kill -9 $$; fi; sleep 30";
    let (out, took) = tilearn(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--standalone",
        "--",
        "sh",
        "-c",
        script,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(
        errors,
        ["error: rank 1 was killed by signal 9 (SIGKILL)"],
        "{stderr}"
    );
    assert!(
        took < Duration::from_secs(15),
        "took {took:?}: the sleeping rank was not stopped"
    );
}

#[test]
fn unsupported_flags_are_explained() {
    let (out, _) = tilearn(&["launch", "--nnodes", "1:4", "--", "true"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--nnodes") && stderr.contains("fixed number"),
        "{stderr}"
    );
    let (out, _) = tilearn(&["launch", "--standalone", "--nnodes", "2", "--", "true"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--standalone"));
}
