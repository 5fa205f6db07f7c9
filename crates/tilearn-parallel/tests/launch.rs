//! The launcher end to end with real processes: `tilearn-comm-check` ranks all-reduce over the
//! host communicator; failing ranks (killed, erroring, stopped) end the job with one error naming
//! them, in bounded time, leaving no process behind; `max_restarts` restarts the group.

mod support;

use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use tilearn_parallel::ParallelError;
use tilearn_parallel::launch::{LaunchConfig, Program, launch};

fn config(nproc: usize) -> LaunchConfig {
    LaunchConfig {
        nproc_per_node: nproc,
        standalone: true,
        comm_timeout: Duration::from_secs(30),
        heartbeat_timeout: Duration::from_secs(30),
        exit_grace: Duration::from_millis(500),
        kill_grace: Duration::from_secs(2),
        ..LaunchConfig::default()
    }
}

fn comm_check(pid_dir: &Path, extra: &[&str]) -> Program {
    let mut args: Vec<OsString> = vec!["--pid-dir".into(), pid_dir.into()];
    args.extend(extra.iter().map(OsString::from));
    Program::External {
        program: support::bin(
            "tilearn-comm-check",
            env!("CARGO_BIN_EXE_tilearn-comm-check"),
        ),
        args,
    }
}

/// Every rank's recorded pid is gone (reaped, not even a zombie).
fn assert_no_process_left(pid_dir: &Path, ranks: usize) {
    for rank in 0..ranks {
        let Ok(pid) = std::fs::read_to_string(pid_dir.join(format!("rank{rank}.pid"))) else {
            continue; // never got that far
        };
        let proc_dir = format!("/proc/{}", pid.trim());
        assert!(
            !Path::new(&proc_dir).exists(),
            "rank {rank} (pid {pid}) is still there"
        );
    }
}

fn run_failing(nproc: usize, cfg: LaunchConfig, extra: &[&str]) -> (ParallelError, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let err = launch(cfg, &comm_check(dir.path(), extra)).unwrap_err();
    let took = start.elapsed();
    assert_no_process_left(dir.path(), nproc);
    (err, took)
}

#[test]
fn ranks_all_reduce_through_the_launcher() {
    let dir = tempfile::tempdir().unwrap();
    launch(config(2), &comm_check(dir.path(), &["--elements", "10001"])).unwrap();
    assert!(dir.path().join("rank0.pid").exists() && dir.path().join("rank1.pid").exists());
    assert_no_process_left(dir.path(), 2);
}

#[test]
fn the_bandwidth_bench_runs_through_the_launcher() {
    let dir = tempfile::tempdir().unwrap();
    let bench = ["--bench", "--min-bytes", "96", "--max-bytes", "384"];
    launch(
        config(3),
        &comm_check(dir.path(), &[&bench[..], &["--iters", "2"]].concat()),
    )
    .unwrap();
    assert_no_process_left(dir.path(), 3);
    // Sizes the sharded collectives cannot split are refused with the flag named.
    let too_small = ["--bench", "--min-bytes", "2", "--max-bytes", "8"];
    assert!(launch(config(3), &comm_check(dir.path(), &too_small)).is_err());
}

#[test]
fn a_killed_rank_ends_the_job_naming_it() {
    let (err, took) = run_failing(3, config(3), &["--fail-rank", "1", "--fail-mode", "kill"]);
    assert!(
        matches!(&err, ParallelError::RankFailed { rank: 1, cause } if cause.contains("signal 9 (SIGKILL)")),
        "{err}"
    );
    assert!(took < Duration::from_secs(15), "{took:?}");
}

#[test]
fn an_erroring_rank_is_named_with_its_error() {
    let (err, _) = run_failing(2, config(2), &["--fail-rank", "0", "--fail-mode", "error"]);
    assert!(
        matches!(&err, ParallelError::RankFailed { rank: 0, cause } if cause.contains("fails on purpose")),
        "{err}"
    );
}

#[test]
fn a_stopped_rank_is_found_by_its_missing_heartbeat() {
    let cfg = LaunchConfig {
        heartbeat_timeout: Duration::from_secs(1),
        ..config(2)
    };
    let (err, took) = run_failing(2, cfg, &["--fail-rank", "1", "--fail-mode", "stop"]);
    assert!(
        matches!(&err, ParallelError::RankFailed { rank: 1, cause } if cause.contains("stopped answering")),
        "{err}"
    );
    assert!(took < Duration::from_secs(15), "{took:?}");
}

#[test]
fn a_hanging_rank_times_out_its_peers() {
    // Rank 1 keeps beating but never joins the collective: rank 0's all-reduce times out; the
    // summary names rank 0's exit and the rank it waited on.
    let cfg = LaunchConfig {
        comm_timeout: Duration::from_secs(2),
        ..config(2)
    };
    let (err, took) = run_failing(2, cfg, &["--fail-rank", "1", "--fail-mode", "hang"]);
    assert!(
        matches!(&err, ParallelError::RankFailed { rank: 0, cause } if cause.contains("no progress") && cause.contains("rank 1")),
        "{err}"
    );
    assert!(took < Duration::from_secs(15), "{took:?}");
}

#[test]
fn the_group_restarts_after_a_failure() {
    let dir = tempfile::tempdir().unwrap();
    let failing_once = ["--fail-rank", "1", "--fail-mode", "error", "--fail-once"];
    let cfg = LaunchConfig {
        max_restarts: 1,
        ..config(2)
    };
    launch(cfg, &comm_check(dir.path(), &failing_once)).unwrap();
    let err = launch(config(2), &comm_check(dir.path(), &failing_once)).unwrap_err();
    assert!(
        matches!(err, ParallelError::RankFailed { rank: 1, .. }),
        "{err}"
    );
}

#[test]
fn grandchildren_do_not_outlive_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "sleep 60 & echo $! > {}/sleeper$RANK; exit 3",
        dir.path().display()
    );
    let program = Program::External {
        program: "sh".into(),
        args: vec!["-c".into(), script.into()],
    };
    let err = launch(config(2), &program).unwrap_err();
    assert!(
        matches!(&err, ParallelError::RankFailed { cause, .. } if cause == "exited with status 3"),
        "{err}"
    );
    for rank in 0..2 {
        let pid = std::fs::read_to_string(dir.path().join(format!("sleeper{rank}"))).unwrap();
        // The sleeper was killed; as an orphan it is reaped by init, so wait briefly.
        let gone = (0..100).any(|_| {
            std::thread::sleep(Duration::from_millis(20));
            std::fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
                .map_or(true, |stat| stat.contains(") Z "))
        });
        assert!(gone, "rank {rank}'s child {pid} survived the job");
    }
}
