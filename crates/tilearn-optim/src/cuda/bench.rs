//! Bandwidth benchmark of the fused optimizers, shared by the criterion bench
//! (`benches/fused_optim.rs`) and the `optim-bench` binary (which the GPU machine runs without
//! cargo).
//!
//! Setup: `n` parameters as a model would lay them out: 100 "layers", each a large decayed
//! matrix followed by a 4096-element no-decay norm weight (200 tensors, two groups), fp32 master
//! weights and state, bf16 gradients and a bf16 working copy. Gradients and parameters are
//! random (never zeros: an all-zero buffer can take shortcuts in the memory system).
//!
//! Reported: bytes actually moved per step / median step time, against the device-to-device
//! copy bandwidth measured in the same process (`cuMemcpyDtoD` of a large buffer, counting the
//! read and the write). Times come from CUDA events around each step, after warm-up and a
//! synchronisation; the median of the timed steps is used.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use half::bf16;

use super::error::{FusedError, Result};
use super::plan::SegmentPlan;
use crate::group::{ParamGroup, validate_groups};

/// Tensors of the synthetic model (two per layer).
pub const LAYERS: usize = 100;
/// Elements of each layer's no-decay tensor.
pub const NORM_LEN: usize = 4096;

fn cuda_err(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> FusedError {
    move |e| FusedError::Cuda {
        op,
        message: e.to_string(),
    }
}

/// The two groups of the synthetic model of `n` elements (n must exceed `LAYERS * NORM_LEN`).
pub fn model_groups(n: usize) -> Vec<ParamGroup> {
    let layer = n / LAYERS;
    let mut decay = Vec::new();
    let mut no_decay = Vec::new();
    for l in 0..LAYERS {
        let start = l * layer;
        let end = if l + 1 == LAYERS { n } else { start + layer };
        let split = end - NORM_LEN.min(end - start);
        decay.push(start..split);
        no_decay.push(split..end);
    }
    vec![
        ParamGroup::new("decay", decay, 0.01),
        ParamGroup::new("no_decay", no_decay, 0.0),
    ]
}

/// xorshift64* stream: fast enough to fill gigabytes, not zero, reproducible.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in ±[lo, lo + width).
    fn value(&mut self, lo: f32, width: f32) -> f32 {
        let r = self.next();
        let u = (r >> 40) as f32 / (1u64 << 24) as f32;
        let mag = lo + width * u;
        if r & 1 == 0 { mag } else { -mag }
    }
}

/// Fills `buf` with a random block (of at most 2^24 elements) repeated.
fn fill<T: DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    buf: &mut CudaSlice<T>,
    seed: u64,
    make: impl Fn(f32) -> T,
    lo: f32,
    width: f32,
) -> Result<()> {
    let block_len = buf.len().min(1 << 24);
    let mut rng = XorShift(seed | 1);
    let block: Vec<T> = (0..block_len).map(|_| make(rng.value(lo, width))).collect();
    let mut at = 0;
    while at < buf.len() {
        let len = block_len.min(buf.len() - at);
        let mut dst = buf.slice_mut(at..at + len);
        stream
            .memcpy_htod(&block[..len], &mut dst)
            .map_err(cuda_err("bench fill"))?;
        at += len;
    }
    Ok(())
}

/// Every buffer the benchmarked optimizers use.
pub struct BenchBuffers {
    pub n: usize,
    pub groups: Vec<ParamGroup>,
    pub plan: SegmentPlan,
    pub params: CudaSlice<f32>,
    pub exp_avg: CudaSlice<f32>,
    pub exp_avg_sq: CudaSlice<f32>,
    pub grads: CudaSlice<bf16>,
    pub param_copy: CudaSlice<bf16>,
}

impl BenchBuffers {
    /// Allocates and fills the buffers of an `n`-parameter model on `stream`'s device.
    pub fn new(stream: &Arc<CudaStream>, n: usize) -> Result<Self> {
        if n <= LAYERS * NORM_LEN {
            return Err(FusedError::InvalidArgument {
                op: "BenchBuffers::new",
                message: format!("{n} parameters: need more than {}", LAYERS * NORM_LEN),
            });
        }
        let groups = model_groups(n);
        let segments = validate_groups(&groups, n)?;
        let plan = SegmentPlan::whole(stream, &segments, n, groups.len())?;
        let alloc = |what: &'static str| {
            // SAFETY: every buffer is filled below before any kernel reads it.
            unsafe { stream.alloc::<f32>(n) }.map_err(cuda_err(what))
        };
        let mut params = alloc("alloc params")?;
        let mut exp_avg = alloc("alloc exp_avg")?;
        let mut exp_avg_sq = alloc("alloc exp_avg_sq")?;
        // SAFETY: filled below.
        let mut grads = unsafe { stream.alloc::<bf16>(n) }.map_err(cuda_err("alloc grads"))?;
        // SAFETY: written by every step before it is read (the bench never reads it).
        let mut param_copy =
            unsafe { stream.alloc::<bf16>(n) }.map_err(cuda_err("alloc param_copy"))?;
        fill(stream, &mut params, 1, |x| x, 0.05, 2.0)?;
        fill(stream, &mut exp_avg, 2, |x| x, 1e-4, 1e-2)?;
        fill(stream, &mut exp_avg_sq, 3, |x| x.abs(), 1e-6, 1e-4)?;
        fill(stream, &mut grads, 4, bf16::from_f32, 1e-4, 1.0)?;
        fill(stream, &mut param_copy, 5, bf16::from_f32, 0.05, 2.0)?;
        Ok(BenchBuffers {
            n,
            groups,
            plan,
            params,
            exp_avg,
            exp_avg_sq,
            grads,
            param_copy,
        })
    }
}

/// Times `iters` calls of `step` with CUDA events (after `warmup` calls and a synchronisation);
/// returns the per-call times in milliseconds.
pub fn time_steps(
    stream: &Arc<CudaStream>,
    warmup: usize,
    iters: usize,
    mut step: impl FnMut(u64) -> Result<()>,
) -> Result<Vec<f32>> {
    let mut t = 0u64;
    for _ in 0..warmup {
        t += 1;
        step(t)?;
    }
    stream.synchronize().map_err(cuda_err("bench warm-up"))?;
    let ctx = stream.context();
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(cuda_err("bench event"))?;
        let end = ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(cuda_err("bench event"))?;
        start.record(stream).map_err(cuda_err("bench event"))?;
        t += 1;
        step(t)?;
        end.record(stream).map_err(cuda_err("bench event"))?;
        times.push(start.elapsed_ms(&end).map_err(cuda_err("bench elapsed"))?);
    }
    Ok(times)
}

pub fn median(times: &[f32]) -> f64 {
    let mut v: Vec<f64> = times.iter().map(|&t| f64::from(t)).collect();
    v.sort_by(f64::total_cmp);
    let k = v.len() / 2;
    if v.is_empty() {
        f64::NAN
    } else if v.len() % 2 == 1 {
        v[k]
    } else {
        (v[k - 1] + v[k]) / 2.0
    }
}

/// Device-to-device copy bandwidth (GB/s, 1e9 bytes, read + write counted) of a `bytes`-byte
/// buffer: median of `iters` copies.
pub fn copy_bandwidth(stream: &Arc<CudaStream>, bytes: usize, iters: usize) -> Result<f64> {
    let words = bytes / 4;
    let mut src = stream
        .alloc_zeros::<f32>(words)
        .map_err(cuda_err("copy alloc"))?;
    fill(stream, &mut src, 6, |x| x, 0.5, 1.0)?;
    let mut dst = stream
        .alloc_zeros::<f32>(words)
        .map_err(cuda_err("copy alloc"))?;
    let times = time_steps(stream, 3, iters, |_| {
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(cuda_err("cuMemcpyDtoD"))
    })?;
    Ok(2.0 * (words * 4) as f64 / (median(&times) * 1e-3) / 1e9)
}

/// One line of the report.
#[derive(Debug, Clone)]
pub struct BenchResult {
    pub optimizer: &'static str,
    pub params: usize,
    pub bytes_per_param: usize,
    pub ms_median: f64,
    pub gb_per_s: f64,
    pub copy_gb_per_s: f64,
}

impl BenchResult {
    pub fn new(
        optimizer: &'static str,
        params: usize,
        bytes_per_param: usize,
        times: &[f32],
        copy_gb_per_s: f64,
    ) -> Self {
        let ms_median = median(times);
        let gb_per_s = (params * bytes_per_param) as f64 / (ms_median * 1e-3) / 1e9;
        BenchResult {
            optimizer,
            params,
            bytes_per_param,
            ms_median,
            gb_per_s,
            copy_gb_per_s,
        }
    }

    pub fn fraction_of_copy(&self) -> f64 {
        self.gb_per_s / self.copy_gb_per_s
    }

    /// One JSON object on one line.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"optimizer\":\"{}\",\"params\":{},\"bytes_per_param\":{},\"ms_median\":{:.4},\
             \"gb_per_s\":{:.1},\"copy_gb_per_s\":{:.1},\"fraction_of_copy\":{:.4}}}",
            self.optimizer,
            self.params,
            self.bytes_per_param,
            self.ms_median,
            self.gb_per_s,
            self.copy_gb_per_s,
            self.fraction_of_copy()
        )
    }
}

/// The optimizers [`run_optimizer`] knows, in report order.
pub const OPTIMIZERS: &[&str] = &["adamw", "adam", "sgd", "lion", "lamb"];

/// The `'static` name of a known optimizer (for [`BenchResult`]); unknown names map to "?".
pub fn static_name(name: &str) -> &'static str {
    OPTIMIZERS
        .iter()
        .copied()
        .find(|&o| o == name)
        .unwrap_or("?")
}

/// A step function for the timer: called with the 1-based step number.
pub type StepFn<'a> = dyn FnMut(u64) -> Result<()> + 'a;

/// Runs optimizer `name` on `bufs` through `time` (which calls the step function as often as
/// it likes) and returns the bytes the step moves per parameter with `time`'s result.
///
/// Bytes per parameter (fp32 master and state, bf16 gradient and working copy):
/// Adam/AdamW read p, m, v (12) + g (2) and write p, m, v (12) + the bf16 copy (2) = 28;
/// SGD with momentum reads p, buf (8) + g (2) and writes p, buf (8) + copy (2) = 20;
/// Lion reads p, m (8) + g (2) and writes p, m (8) + copy (2) = 20;
/// LAMB moves 40: stage 1 reads p, m, v, g (14) and writes m, v (8); stage 2 reads p, m, v
/// (12) and writes p + copy (6) (the per-tensor ratio kernel moves a few kB).
pub fn run_optimizer<T>(
    stream: &Arc<CudaStream>,
    bufs: &mut BenchBuffers,
    name: &str,
    time: impl FnOnce(&Arc<CudaStream>, &mut StepFn<'_>) -> Result<T>,
) -> Result<(usize, T)> {
    use super::adam::{AdamGroupScalars, AdamState, adam_step};
    use super::io::{Grads, ParamCopy, Rounding, StepIo};
    use crate::{
        AdamConfig, AdamStepScalars, AdamWConfig, AdamWStepScalars, LionConfig, LionStepScalars,
        SgdConfig, SgdStepScalars,
    };

    let lr = 1e-4f64;
    match name {
        "adamw" | "adam" => {
            let decoupled = name == "adamw";
            let mut step = |t: u64| -> Result<()> {
                let scalars: Vec<AdamGroupScalars> = bufs
                    .groups
                    .iter()
                    .map(|g| {
                        let wd = f64::from(g.weight_decay);
                        if decoupled {
                            AdamGroupScalars::from(&AdamWStepScalars::new(
                                &AdamWConfig::default(),
                                lr,
                                wd,
                                t,
                            ))
                        } else {
                            AdamGroupScalars::from(&AdamStepScalars::new(
                                &AdamConfig::default(),
                                lr,
                                wd,
                                t,
                            ))
                        }
                    })
                    .collect();
                let io = StepIo {
                    grads: Grads::Bf16(bufs.grads.as_view()),
                    param_copy: ParamCopy::Bf16(bufs.param_copy.as_view_mut(), Rounding::Nearest),
                    inv_scale: None,
                    found_inf: None,
                    clip: None,
                    step: t,
                };
                let state = AdamState {
                    params: bufs.params.as_view_mut(),
                    exp_avg: bufs.exp_avg.as_view_mut(),
                    exp_avg_sq: bufs.exp_avg_sq.as_view_mut(),
                    max_exp_avg_sq: None,
                };
                adam_step(stream, &bufs.plan, &scalars, state, io)
            };
            Ok((28, time(stream, &mut step)?))
        }
        "sgd" => {
            let config = SgdConfig {
                momentum: 0.9,
                ..SgdConfig::default()
            };
            let mut step = |t: u64| -> Result<()> {
                let scalars: Vec<SgdStepScalars> = bufs
                    .groups
                    .iter()
                    .map(|g| SgdStepScalars::new(&config, lr, f64::from(g.weight_decay), t == 1))
                    .collect();
                let io = StepIo {
                    grads: Grads::Bf16(bufs.grads.as_view()),
                    param_copy: ParamCopy::Bf16(bufs.param_copy.as_view_mut(), Rounding::Nearest),
                    inv_scale: None,
                    found_inf: None,
                    clip: None,
                    step: t,
                };
                super::sgd::sgd_step(
                    stream,
                    &bufs.plan,
                    &scalars,
                    bufs.params.as_view_mut(),
                    Some(bufs.exp_avg.as_view_mut()),
                    io,
                )
            };
            Ok((20, time(stream, &mut step)?))
        }
        "lion" => {
            let config = LionConfig::default();
            let mut step = |t: u64| -> Result<()> {
                let scalars: Vec<LionStepScalars> = bufs
                    .groups
                    .iter()
                    .map(|g| LionStepScalars::new(&config, lr, f64::from(g.weight_decay)))
                    .collect();
                let io = StepIo {
                    grads: Grads::Bf16(bufs.grads.as_view()),
                    param_copy: ParamCopy::Bf16(bufs.param_copy.as_view_mut(), Rounding::Nearest),
                    inv_scale: None,
                    found_inf: None,
                    clip: None,
                    step: t,
                };
                super::lion::lion_step(
                    stream,
                    &bufs.plan,
                    &scalars,
                    bufs.params.as_view_mut(),
                    bufs.exp_avg.as_view_mut(),
                    io,
                )
            };
            Ok((20, time(stream, &mut step)?))
        }
        "lamb" => {
            use super::lamb::{LambGroup, LambScratch, LambState, lamb_step};
            use crate::{LambConfig, LambStepScalars};
            // The model's tensors are the plan's segments (one per group range here).
            let mut scratch = LambScratch::new(stream, &bufs.plan)?;
            let config = LambConfig::default();
            let mut step = |t: u64| -> Result<()> {
                let groups: Vec<LambGroup> = bufs
                    .groups
                    .iter()
                    .map(|g| LambGroup {
                        scalars: LambStepScalars::new(
                            &config,
                            lr,
                            f64::from(g.weight_decay),
                            t,
                            1.0,
                        ),
                        lr,
                    })
                    .collect();
                let io = StepIo {
                    grads: Grads::Bf16(bufs.grads.as_view()),
                    param_copy: ParamCopy::Bf16(bufs.param_copy.as_view_mut(), Rounding::Nearest),
                    inv_scale: None,
                    found_inf: None,
                    clip: None,
                    step: t,
                };
                let state = LambState {
                    params: bufs.params.as_view_mut(),
                    exp_avg: bufs.exp_avg.as_view_mut(),
                    exp_avg_sq: bufs.exp_avg_sq.as_view_mut(),
                };
                lamb_step(stream, &bufs.plan, &groups, &mut scratch, state, io)
            };
            Ok((40, time(stream, &mut step)?))
        }
        other => Err(FusedError::InvalidArgument {
            op: "bench::run_optimizer",
            message: format!(
                "unknown optimizer {other} (known: {})",
                OPTIMIZERS.join(",")
            ),
        }),
    }
}
