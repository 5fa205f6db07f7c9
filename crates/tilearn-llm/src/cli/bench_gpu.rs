//! The CUDA side of `tilearn bench`: full training steps of the GPU engine in bf16 or fp16
//! mixed precision or fp32 (fp32 master weights, fused AdamW with clipping), timed after a
//! device sync. fp16 steps go through the GradScaler exactly as training does: scaled loss,
//! unscale with the non-finite check (one extra host read), skipped step on overflow.
//! With `--cuda-graphs on|auto` a bf16 or fp32 step is one [`GpuLlama::train_step`]: captured
//! as a CUDA graph at the second step and replayed after (the step then also reads the
//! gradient norm back, as training does: a 16-byte copy after the loss's).
//! With `--memory lean` the master weights and AdamW live in host memory and every step ends
//! with the host AdamW (see `tilearn_engine::memory_mode`); such steps always run eagerly.

use tilearn_engine::config::LlamaConfig;
use tilearn_engine::cuda_graphs::CudaGraphs;
use tilearn_engine::lce_chunk::LceChunk;
use tilearn_engine::memory_mode::MemoryMode;
use tilearn_engine::offload_checkpoints::OffloadCheckpoints;
use tilearn_engine::weight_copy::WeightCopy;
use tilearn_ops::DType;

use super::bench_loop::BenchResult;
use crate::Result;

/// Where a benchmarked GPU model keeps its state (`--memory`, `--weight-copy`,
/// `--offload-checkpoints`, as `tilearn train`).
#[derive(Clone, Copy, Debug)]
// Parsed in every build (bad values are errors without a GPU too); read only by the CUDA bench.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct GpuMemoryOptions {
    pub memory: MemoryMode,
    pub weight_copy: WeightCopy,
    pub offload_checkpoints: OffloadCheckpoints,
}

#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
pub fn bench(
    config: &LlamaConfig,
    batch: usize,
    seq: usize,
    (warmup, steps): (usize, usize),
    precision: DType,
    gradient_checkpointing: bool,
    lce: LceChunk,
    graphs: CudaGraphs,
    memory_options: GpuMemoryOptions,
    deterministic: bool,
) -> Result<BenchResult> {
    use std::time::Instant;

    use tilearn_engine::cuda_graphs::{GraphDecision, StepConditions};
    use tilearn_engine::offload_checkpoints::{OffloadSetting, host_available_bytes};

    use super::bench_loop::GraphReport;

    use adaptfp16::GradScaler;
    use tilearn_engine::gpu::GpuLlama;
    use tilearn_engine::model::LlamaForCausalLM;
    use tilearn_ops::cuda::GpuDevice;
    use tilearn_optim::AdamWConfig;

    use super::bench_loop::{median, random_tokens};

    let device = GpuDevice::new(0)?;
    let model = LlamaForCausalLM::from_config(config.clone(), 0);
    let num_params = model.params.numel();
    let mut scaler = if precision.needs_loss_scaling() {
        GradScaler::new()
    } else {
        GradScaler::disabled()
    };
    let GpuMemoryOptions {
        memory,
        weight_copy,
        offload_checkpoints,
    } = memory_options;
    if (memory.is_lean() || offload_checkpoints == OffloadCheckpoints::On)
        && graphs == CudaGraphs::On
    {
        return Err(crate::LlmError::Usage {
            flag: "--cuda-graphs on".into(),
            message: "--memory lean steps AdamW on the host and --offload-checkpoints copies \
                      on a second stream, which a CUDA graph does not hold; \
                      use --cuda-graphs auto or off"
                .into(),
        });
    }
    let mut gpu = GpuLlama::with_memory(
        &device,
        &model,
        batch,
        seq,
        &[precision],
        gradient_checkpointing,
        lce,
        memory,
    )?;
    drop(model);
    gpu.set_deterministic(deterministic)?;
    weight_copy.check(memory.is_lean(), 0)?;
    gpu.set_per_layer_weights(weight_copy.per_layer(gradient_checkpointing, memory.is_lean()))?;
    let offload = offload_checkpoints.resolve(&OffloadSetting {
        gradient_checkpointing,
        lean: memory.is_lean(),
        pipeline_stage: false,
        cuda_graphs_forced: graphs == CudaGraphs::On,
        seq,
        host_bytes: gpu.checkpoint_offload_host_bytes(),
        host_available: host_available_bytes(),
        local_processes: 1,
    });
    gpu.set_offload_checkpoints(offload.offload)?;
    let groups = gpu.default_groups(0.0);
    gpu.configure_optimizer(
        AdamWConfig {
            lr: 1e-4,
            ..AdamWConfig::default()
        },
        groups,
        1.0,
    )?;
    gpu.set_cuda_graphs(graphs);
    let conditions = StepConditions {
        loss_scaling: scaler.is_enabled(),
        ..StepConditions::single()
    };
    let decision =
        gpu.cuda_graph_decision(conditions)
            .map_err(|message| crate::LlmError::Usage {
                flag: "--cuda-graphs".into(),
                message,
            })?;
    let mut report = GraphReport {
        mode: graphs.to_string(),
        ..GraphReport::default()
    };
    let whole_steps = match decision {
        GraphDecision::Graph => true,
        GraphDecision::Eager { reason } => {
            report.fallback = reason;
            false
        }
    };
    let batches: Vec<(Vec<u32>, Vec<i32>)> = (0..warmup + steps)
        .map(|i| {
            let ids = random_tokens(config.vocab_size, batch * seq, i as u64);
            let labels = ids.iter().map(|&t| t as i32).collect();
            (ids, labels)
        })
        .collect();
    let mut times = Vec::with_capacity(steps);
    let mut last_loss = f64::NAN;
    let mut skipped_steps = 0;
    for (i, (ids, labels)) in batches.iter().enumerate() {
        if whole_steps {
            let start = Instant::now();
            let out = gpu.train_step(ids, labels, batch, seq, None, 1e-4, conditions)?;
            device.synchronize()?;
            if i >= warmup {
                times.push(start.elapsed().as_secs_f64());
            }
            if out.eager_reason.is_some() {
                report.fallback = out.eager_reason;
            }
            last_loss = out.loss.mean();
            continue;
        }
        let start = Instant::now();
        gpu.zero_grad()?;
        let scale = if scaler.is_enabled() {
            scaler.get_scale()
        } else {
            1.0
        };
        let stats = gpu.forward_backward_scaled(ids, labels, batch, seq, None, scale)?;
        let mut found_inf = false;
        if scaler.is_enabled() {
            let mut grads = ScaledGrads {
                gpu: &mut gpu,
                found_inf: false,
            };
            scaler
                .unscale(&mut grads)
                .and_then(|()| scaler.update(&mut grads))
                .map_err(tilearn_engine::EngineError::from)?;
            found_inf = grads.found_inf;
        }
        if found_inf {
            skipped_steps += 1;
        } else {
            gpu.step(1e-4)?;
        }
        device.synchronize()?;
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64());
        }
        last_loss = stats.mean();
    }
    let stats = gpu.cuda_graph_stats();
    report.eager_steps = if whole_steps {
        stats.eager
    } else {
        batches.len() as u64
    };
    report.captured_steps = stats.captures;
    report.replayed_steps = stats.replays;
    Ok(BenchResult {
        cuda_graphs: Some(report),
        offload_checkpoints: Some((gpu.offload_checkpoints(), offload.reason)),
        device: format!("cuda:0 {}", device.name()?),
        precision,
        num_params,
        step_seconds: median(times),
        peak_memory_bytes: gpu.memory().peak_bytes() as u64,
        last_loss,
        skipped_steps,
    })
}

/// The device gradients as the GradScaler's unscale target: the check reads the unscaled norm
/// (the optimizer step then unscales inside its kernel), as the Trainer's GPU backend does.
#[cfg(feature = "cuda")]
struct ScaledGrads<'a> {
    gpu: &'a mut tilearn_engine::gpu::GpuLlama,
    found_inf: bool,
}

#[cfg(feature = "cuda")]
impl adaptfp16::UnscaleTarget for ScaledGrads<'_> {
    fn unscale_and_check(
        &mut self,
        inv_scale: f32,
    ) -> std::result::Result<(), adaptfp16::BackendError> {
        self.found_inf = self.gpu.unscale_and_check(inv_scale)?;
        Ok(())
    }

    fn found_inf(&mut self) -> std::result::Result<bool, adaptfp16::BackendError> {
        Ok(self.found_inf)
    }
}

/// Fused optimizer steps over `params` parameters: one JSON line per optimizer with GB/s
/// against the device copy bandwidth measured in the same run.
#[cfg(feature = "cuda")]
pub fn bench_optimizers(names: &[String], params: usize, steps: usize) -> Result<()> {
    use tilearn_ops::cuda::GpuDevice;
    use tilearn_optim::cuda::bench::{
        BenchBuffers, BenchResult, copy_bandwidth, run_optimizer, static_name, time_steps,
    };

    let fused = |e: tilearn_optim::cuda::FusedError| crate::LlmError::Usage {
        flag: "--optimizer".into(),
        message: e.to_string(),
    };
    let steps = steps.max(20);
    let device = GpuDevice::new(0)?;
    let stream = device.stream();
    // 4 GiB each way: far beyond the 60 MB L2, so this is the HBM ceiling.
    let copy = copy_bandwidth(stream, 4 << 30, steps).map_err(fused)?;
    let mut bufs = BenchBuffers::new(stream, params).map_err(fused)?;
    for name in names {
        let (bytes, times) = run_optimizer(stream, &mut bufs, name, |s, step| {
            time_steps(s, 3, steps, step)
        })
        .map_err(fused)?;
        let r = BenchResult::new(static_name(name), params, bytes, &times, copy);
        println!("{}", r.to_json());
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn bench_optimizers(_names: &[String], _params: usize, _steps: usize) -> Result<()> {
    Err(crate::LlmError::Usage {
        flag: "--optimizer".into(),
        message: "the fused optimizer kernels need a build with --features cuda".into(),
    })
}

#[cfg(not(feature = "cuda"))]
#[allow(clippy::too_many_arguments)]
pub fn bench(
    _config: &LlamaConfig,
    _batch: usize,
    _seq: usize,
    _steps: (usize, usize),
    _precision: DType,
    _gradient_checkpointing: bool,
    _lce: LceChunk,
    _graphs: CudaGraphs,
    _memory_options: GpuMemoryOptions,
    _deterministic: bool,
) -> Result<BenchResult> {
    Err(crate::LlmError::Usage {
        flag: "--device cuda".into(),
        message: "this build has no CUDA kernels; rebuild with --features cuda or use --device cpu"
            .into(),
    })
}
