//! Criterion bench of the fused optimizers: each optimizer's step over a 1.1e9-parameter
//! synthetic model (fp32 master + state, bf16 grads and working copy; see
//! `tilearn_optim::cuda::bench`), with criterion's throughput set to the bytes the step
//! actually moves, so its GB/s is comparable with the device copy bandwidth, which is benched
//! alongside (`device_copy`, a 4 GiB cuMemcpyDtoD counting read + write).
//!
//! Timing uses CUDA events around each step (`iter_custom`), not host clocks. Without a GPU the
//! bench prints why and does nothing. `TILEARN_BENCH_PARAMS` overrides the parameter count
//! (e.g. `1e8` on a smaller GPU).
//!
//! Run: `cargo bench -p tilearn-optim --features cuda --bench fused_optim`.

use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tilearn_ops::cuda::{CudaStream, GpuDevice};
use tilearn_optim::cuda::bench::{
    BenchBuffers, OPTIMIZERS, copy_bandwidth, run_optimizer, time_steps,
};

fn params() -> usize {
    std::env::var("TILEARN_BENCH_PARAMS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(1_100_000_000, |f| f as usize)
}

/// Criterion's `iter_custom` time for `iters` steps, measured with CUDA events.
fn event_time(
    stream: &Arc<CudaStream>,
    iters: u64,
    step: &mut dyn FnMut(u64) -> tilearn_optim::cuda::Result<()>,
) -> Duration {
    let times = time_steps(stream, 1, iters as usize, step).expect("fused step");
    let ms: f64 = times.iter().map(|&t| f64::from(t)).sum();
    Duration::from_secs_f64(ms * 1e-3)
}

fn fused_optim(c: &mut Criterion) {
    let dev = match GpuDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: fused_optim bench: {e}");
            return;
        }
    };
    let s = dev.stream().clone();
    let n = params();
    let copy = copy_bandwidth(&s, 4 << 30, 20).expect("copy bandwidth");
    eprintln!("fused_optim: device copy bandwidth {copy:.1} GB/s (read + write)");

    let mut group = c.benchmark_group("fused_optim");
    group.sample_size(20);
    group.warm_up_time(Duration::from_secs(2));
    group.measurement_time(Duration::from_secs(10));

    {
        let copy_bytes = 4usize << 30;
        let mut src = s.alloc_zeros::<u8>(copy_bytes).expect("alloc");
        s.memset_zeros(&mut src).expect("memset");
        let mut dst = s.alloc_zeros::<u8>(copy_bytes).expect("alloc");
        group.throughput(Throughput::Bytes(2 * copy_bytes as u64));
        group.bench_function("device_copy", |b| {
            b.iter_custom(|iters| {
                event_time(&s, iters, &mut |_| {
                    s.memcpy_dtod(&src, &mut dst).map_err(|e| {
                        tilearn_optim::cuda::FusedError::Cuda {
                            op: "cuMemcpyDtoD",
                            message: e.to_string(),
                        }
                    })
                })
            })
        });
    }

    let mut bufs = BenchBuffers::new(&s, n).expect("bench buffers");
    for &opt in OPTIMIZERS {
        let (bytes, ()) = run_optimizer(&s, &mut bufs, opt, |_, _| Ok(())).expect("probe");
        group.throughput(Throughput::Bytes((bytes * n) as u64));
        group.bench_function(format!("{opt}_{n}"), |b| {
            b.iter_custom(|iters| {
                run_optimizer(&s, &mut bufs, opt, |s, step| Ok(event_time(s, iters, step)))
                    .expect("fused step")
                    .1
            })
        });
    }
    group.finish();
}

criterion_group!(benches, fused_optim);
criterion_main!(benches);
