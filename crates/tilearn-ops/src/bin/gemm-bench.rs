//! `gemm-bench [M [N [K]]] [--dtype bf16|f16|f32]`: the device's measured matmul ceiling
//! through the same cuBLASLt path the engine uses ([`Gemm::matmul`], f32 accumulation, TF32 off
//! for f32; the output has the input type).
//!
//! Random inputs (never zeros: zero operands can take faster paths), one warm-up product (which
//! also runs cuBLASLt's algorithm search, cached afterwards), then 10 timed products, each
//! between two CUDA events; prints the median as one JSON line:
//! `{"m":8192,"n":8192,"k":8192,"dtype":"bf16","ms":…,"tflops":…}` with
//! tflops = 2·M·N·K / median seconds / 1e12. Default 8192×8192×8192 bf16.

use std::process::ExitCode;

use half::{bf16, f16};
use tilearn_ops::cuda::{CudaSlice, DeviceFloat, Gemm, GpuDevice, MatmulSpec, Operand};

const RUNS: usize = 10;

fn main() -> ExitCode {
    match run() {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gemm-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<String, String> {
    let mut dims = Vec::new();
    let mut dtype = "bf16".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--dtype" {
            dtype = args.next().ok_or("--dtype needs bf16, f16 or f32")?;
        } else {
            let d: usize = arg.parse().map_err(|_| {
                format!("usage: gemm-bench [M [N [K]]] [--dtype bf16|f16|f32]; got {arg:?}")
            })?;
            if d == 0 {
                return Err("dimensions must be positive".into());
            }
            dims.push(d);
        }
    }
    let m = dims.first().copied().unwrap_or(8192);
    let n = dims.get(1).copied().unwrap_or(m);
    let k = dims.get(2).copied().unwrap_or(n);
    let dev = GpuDevice::new(0).map_err(|e| e.to_string())?;
    let gemm = Gemm::new(dev.stream()).map_err(|e| e.to_string())?;
    let ms = match dtype.as_str() {
        "bf16" => time::<bf16>(&dev, &gemm, m, n, k)?,
        "f16" => time::<f16>(&dev, &gemm, m, n, k)?,
        "f32" => time::<f32>(&dev, &gemm, m, n, k)?,
        other => return Err(format!("unknown --dtype {other:?} (bf16, f16 or f32)")),
    };
    let tflops = 2.0 * m as f64 * n as f64 * k as f64 / (ms / 1e3) / 1e12;
    let name = dev.name().unwrap_or_else(|_| "unknown".into());
    Ok(format!(
        "{{\"m\":{m},\"n\":{n},\"k\":{k},\"dtype\":\"{dtype}\",\"ms\":{ms:.4},\"tflops\":{tflops:.1},\"device\":{name:?}}}"
    ))
}

/// Median milliseconds of `C = A·Bᵀ` (the linear layer's "TN" layout) over [`RUNS`] products.
fn time<T: DeviceFloat>(
    dev: &GpuDevice,
    gemm: &Gemm,
    m: usize,
    n: usize,
    k: usize,
) -> Result<f64, String> {
    let s = dev.stream();
    let err = |e: cudarc::driver::DriverError| e.to_string();
    // A small xorshift generator: uniform in ±[0.25, 1), enough to defeat any zero shortcut.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut random = |len: usize| -> Vec<T> {
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                let v = 0.25 + 0.75 * u;
                T::from_f32(if state & 1 == 0 { v } else { -v })
            })
            .collect()
    };
    let a: CudaSlice<T> = s.clone_htod(&random(m * k)).map_err(err)?;
    let b: CudaSlice<T> = s.clone_htod(&random(n * k)).map_err(err)?;
    // beta = 0: C is only written.
    let mut c: CudaSlice<T> = s.clone_htod(&random(m * n)).map_err(err)?;
    let spec = MatmulSpec::new(m, n, k, Operand::plain(k), Operand::transposed(k));
    gemm.matmul::<T, T>(&spec, &a, &b, &mut c)
        .map_err(|e| e.to_string())?;
    dev.synchronize().map_err(|e| e.to_string())?;
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let start = s.record_event(flags).map_err(err)?;
        gemm.matmul::<T, T>(&spec, &a, &b, &mut c)
            .map_err(|e| e.to_string())?;
        let end = s.record_event(flags).map_err(err)?;
        times.push(start.elapsed_ms(&end).map_err(err)? as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[RUNS / 2])
}
