//! `optim-bench`: GB/s of the fused optimizers against the device copy bandwidth, one JSON line
//! per optimizer on stdout (the criterion bench `fused_optim` measures the same; this binary
//! exists for machines that get stripped binaries and no cargo).
//!
//! Usage: `optim-bench [--params N] [--steps S] [--warmup W] [--optimizers adamw,adam,...]`
//! (defaults: 1.1e9 parameters, 30 timed steps, 5 warm-up steps, every optimizer). Exits 2
//! without a GPU (printing why), 1 on a CUDA error.

use std::process::ExitCode;

use tilearn_ops::cuda::GpuDevice;
use tilearn_optim::cuda::bench::{BenchBuffers, BenchResult, copy_bandwidth, time_steps};
use tilearn_optim::cuda::{self, FusedError};

struct Args {
    params: usize,
    steps: usize,
    warmup: usize,
    optimizers: Vec<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        params: 1_100_000_000,
        steps: 30,
        warmup: 5,
        optimizers: cuda::bench::OPTIMIZERS
            .iter()
            .map(|s| s.to_string())
            .collect(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--params" => {
                let v = value()?;
                // Accept 1.1e9 as well as 1100000000.
                args.params = v
                    .parse::<usize>()
                    .ok()
                    .or_else(|| v.parse::<f64>().ok().map(|f| f as usize))
                    .ok_or_else(|| format!("--params {v}: not a number"))?;
            }
            "--steps" => {
                let v = value()?;
                args.steps = v
                    .parse()
                    .map_err(|_| format!("--steps {v}: not a number"))?;
                if args.steps < 20 {
                    return Err("--steps must be at least 20 (median of >= 20 steps)".into());
                }
            }
            "--warmup" => {
                let v = value()?;
                args.warmup = v
                    .parse()
                    .map_err(|_| format!("--warmup {v}: not a number"))?;
            }
            "--optimizers" => {
                args.optimizers = value()?.split(',').map(|s| s.trim().to_string()).collect();
                for o in &args.optimizers {
                    if !cuda::bench::OPTIMIZERS.contains(&o.as_str()) {
                        return Err(format!(
                            "unknown optimizer {o} (known: {})",
                            cuda::bench::OPTIMIZERS.join(",")
                        ));
                    }
                }
            }
            "-h" | "--help" => {
                return Err(
                    "usage: optim-bench [--params N] [--steps S>=20] [--warmup W] \
                            [--optimizers adamw,adam,sgd,lion,lamb]"
                        .into(),
                );
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

fn run(args: &Args, dev: &GpuDevice) -> Result<(), FusedError> {
    let s = dev.stream();
    let name = dev.name().unwrap_or_else(|_| "unknown GPU".into());
    eprintln!("optim-bench: {name}, {} parameters", args.params);
    // The copy buffer: 4 GiB each way, far beyond the 50 MB L2.
    let copy = copy_bandwidth(s, 4 << 30, args.steps)?;
    eprintln!("optim-bench: device copy {copy:.1} GB/s (read + write)");
    let mut bufs = BenchBuffers::new(s, args.params)?;
    for opt in &args.optimizers {
        let (bytes, times) = cuda::bench::run_optimizer(s, &mut bufs, opt, |s, step| {
            time_steps(s, args.warmup, args.steps, step)
        })?;
        let r = BenchResult::new(
            cuda::bench::static_name(opt),
            args.params,
            bytes,
            &times,
            copy,
        );
        println!("{}", r.to_json());
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("optim-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let dev = match GpuDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("optim-bench: skipped: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args, &dev) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("optim-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
