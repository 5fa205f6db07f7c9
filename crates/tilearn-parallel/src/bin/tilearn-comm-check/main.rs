//! `tilearn-comm-check`: run under a launcher (`tilearn launch --nproc-per-node 2 --
//! tilearn-comm-check`), it joins the job, all-reduces a buffer of every dtype over the host
//! communicator (or NCCL with `--backend nccl`, on device buffers of the rank's GPU), checks the
//! sums and prints one line per rank.
//! `--fail-rank R --fail-mode kill|abort|error|hang|stop` makes rank R fail on purpose after the
//! first round, to test how a job ends; with `--fail-once` only in the first attempt (before any
//! restart by the launcher).
//!
//! `--bench` measures instead: the bus bandwidth of all-reduce, reduce-scatter and all-gather
//! on bf16 buffers from `--min-bytes` to `--max-bytes` (doubling), as nccl-tests and
//! `benches/pytorch_comm_baseline.py` report it; rank 0 prints one JSON line per size.

mod backend;
mod bench;

use std::process::ExitCode;
use std::time::Duration;

use half::{bf16, f16};
use tilearn_parallel::{CommElement, ParallelError, ProcessGroup, Result};

use backend::Backend;

#[derive(Debug)]
struct Options {
    elements: usize,
    rounds: usize,
    backend: String,
    fail_rank: Option<usize>,
    fail_mode: String,
    pid_dir: Option<String>,
    fail_once: bool,
    bench: Option<bench::BenchOptions>,
}

fn usage(flag: &str, reason: &str) -> ParallelError {
    ParallelError::Usage {
        flag: flag.into(),
        reason: reason.into(),
    }
}

fn parse() -> Result<Options> {
    let mut o = Options {
        elements: 1001,
        rounds: 3,
        backend: "host".into(),
        fail_rank: None,
        fail_mode: "kill".into(),
        pid_dir: None,
        fail_once: false,
        bench: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| usage(&flag, "needs a value"));
        let number = |v: String, flag: &str| {
            v.parse::<usize>()
                .map_err(|_| usage(flag, "needs a number"))
        };
        match flag.as_str() {
            "--elements" => o.elements = number(value()?, "--elements")?,
            "--rounds" => o.rounds = number(value()?, "--rounds")?,
            "--backend" => o.backend = value()?,
            "--fail-rank" => o.fail_rank = Some(number(value()?, "--fail-rank")?),
            "--fail-mode" => o.fail_mode = value()?,
            "--pid-dir" => o.pid_dir = Some(value()?),
            "--fail-once" => o.fail_once = true,
            "--bench" => {
                o.bench.get_or_insert_with(bench::BenchOptions::default);
            }
            "--min-bytes" | "--max-bytes" | "--iters" | "--warmup" => {
                let n = number(value()?, &flag)?;
                let b = o.bench.get_or_insert_with(bench::BenchOptions::default);
                match flag.as_str() {
                    "--min-bytes" => b.min_bytes = n,
                    "--max-bytes" => b.max_bytes = n,
                    "--iters" => b.iters = n.max(1),
                    _ => b.warmup = n,
                }
            }
            other => return Err(usage(other, "unknown flag (see the file's documentation)")),
        }
    }
    Ok(o)
}

/// All-reduces `rank + 1` on every rank (on the GPU for NCCL) and checks the sum `n(n + 1) / 2`.
fn check<T: CommElement + backend::DeviceElement>(
    backend: &Backend,
    elements: usize,
) -> Result<f32> {
    let (rank, world) = (backend.comm().rank(), backend.comm().world_size());
    let buf = backend.all_reduce_sum(vec![T::from_f32((rank + 1) as f32); elements])?;
    let expected = (world * (world + 1) / 2) as f32;
    if let Some((i, bad)) = buf.iter().enumerate().find(|(_, v)| v.to_f32() != expected) {
        return Err(ParallelError::Buffer {
            op: "all_reduce",
            dtype: T::DTYPE,
            len: elements,
            reason: format!("element {i} is {} instead of {expected}", bad.to_f32()),
        });
    }
    Ok(expected)
}

fn fail_on_purpose(mode: &str) -> Result<()> {
    match mode {
        // SAFETY: raise(2) on this process with a standard signal; it does not return for
        // SIGKILL, and SIGSTOP suspends the process until someone sends SIGCONT or SIGKILL.
        "kill" => unsafe {
            libc::raise(libc::SIGKILL);
        },
        "stop" => unsafe {
            libc::raise(libc::SIGSTOP);
        },
        "abort" => std::process::abort(),
        "hang" => loop {
            std::thread::sleep(Duration::from_secs(3600));
        },
        "error" => return Err(usage("--fail-mode error", "this rank fails on purpose")),
        other => return Err(usage("--fail-mode", &format!("unknown mode {other:?}"))),
    }
    Ok(())
}

fn run(group: &ProcessGroup, options: &Options) -> Result<()> {
    let backend = Backend::new(group, &options.backend)?;
    if let Some(b) = &options.bench {
        return bench::run(&backend, b);
    }
    let comm = backend.comm();
    for round in 0..options.rounds {
        let attempt_fails = !options.fail_once || group.env().restart == 0;
        if round == 1 && attempt_fails && options.fail_rank == Some(group.rank()) {
            fail_on_purpose(&options.fail_mode)?;
        }
        let sums = [
            check::<f32>(&backend, options.elements)?,
            check::<bf16>(&backend, options.elements)?,
            check::<f16>(&backend, options.elements)?,
        ];
        println!(
            "rank {}/{}: round {round}: all_reduce of {} elements ok on {} (f32, bf16, f16 sums {sums:?})",
            comm.rank(),
            comm.world_size(),
            options.elements,
            comm.backend(),
        );
    }
    comm.barrier()
}

fn main() -> ExitCode {
    let options = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let group = match ProcessGroup::from_env() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(dir) = &options.pid_dir {
        let path = std::path::Path::new(dir).join(format!("rank{}.pid", group.rank()));
        if let Err(e) = std::fs::write(&path, std::process::id().to_string()) {
            eprintln!("error: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    match run(&group, &options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            group.report_or_print(&e.to_string(), e.is_secondary());
            ExitCode::FAILURE
        }
    }
}
