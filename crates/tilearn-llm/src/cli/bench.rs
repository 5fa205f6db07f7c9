//! `tilearn bench`: end-to-end training-step throughput on a preset model, one JSON line.
//!
//! Times full optimizer steps (forward, backward, clip, AdamW) on random token batches after a
//! warm-up, and reports the median step time, tokens/s, MFU against the bf16 peak, and peak
//! memory. `benches/pytorch_baseline.py` prints the same fields for transformers.

use std::time::Instant;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, ValueEnum};
use tilearn_engine::cuda_graphs::{CudaGraphs, DEFAULT_CUDA_GRAPHS};
use tilearn_engine::lce_chunk::LceChunk;
use tilearn_engine::memory_mode::MemoryMode;
use tilearn_engine::model::{Activations, LlamaForCausalLM};
use tilearn_engine::offload_checkpoints::OffloadCheckpoints;
use tilearn_engine::weight_copy::WeightCopy;
use tilearn_ops::DType;
use tilearn_optim::{AdamW, AdamWConfig};

use super::bench_loop::{BenchResult, GraphReport, median, random_tokens};
use crate::presets::{PEAK_BF16_FLOPS, PRESETS, Preset, flops_per_token};
use crate::{LlmError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BenchDevice {
    Cpu,
    Cuda,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// llama-134m or tinyllama-1.1b.
    #[arg(long, required_unless_present = "optimizer")]
    pub preset: Option<String>,
    /// Benchmark fused optimizer steps instead (comma-separated: adamw, adam, sgd, lion, lamb)
    /// over `--params` parameters, against the measured device copy bandwidth.
    #[arg(long, value_delimiter = ',', conflicts_with = "preset")]
    pub optimizer: Option<Vec<String>>,
    /// Parameters for `--optimizer` (fp32 master and state, bf16 gradients and working copy).
    #[arg(long, default_value_t = 1_100_000_000)]
    pub params: usize,
    /// Sequences per step (default: the preset's).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Tokens per sequence (default: the preset's).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Timed steps (after the warm-up steps); the median is reported.
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Untimed steps before the timed ones (GPU engine; kernels loaded, cuBLASLt's choices
    /// made, a CUDA graph captured). Fewer shortens runs whose steps take minutes.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    #[arg(long, value_enum, default_value_t = BenchDevice::Cuda)]
    pub device: BenchDevice,
    /// Compute precision of the GPU steps: bf16 (default), fp16 (with the GradScaler: scaled
    /// loss, unscale and non-finite check, skipped steps on overflow) or fp32. The CPU bench
    /// always runs fp32.
    #[arg(long, default_value_t = DType::BF16, value_parser = precision_names())]
    pub precision: DType,
    /// Recompute each block's forward in the backward instead of keeping its activations
    /// (as `tilearn train --gradient-checkpointing`).
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Tokens per chunk of the GPU engine's fused linear + cross entropy: the lm_head product,
    /// the loss and its gradient run chunk by chunk, so only one chunk's [tokens × vocab]
    /// logits exist. `auto` (default, as in `tilearn train`): the largest power of two of tokens whose logits fit in
    /// 128 MiB; `0`: no chunking (all logits at once); N: at most N tokens.
    #[arg(long, default_value = "auto", value_parser = LceChunk::parse)]
    pub lce_chunk_tokens: LceChunk,
    /// Replay each GPU step as one CUDA graph captured once (`on`), run every step eagerly
    /// (`off`), or replay where the step can be captured (`auto`; as in `tilearn train`). fp16
    /// steps (the GradScaler decides on the host) run eagerly under `auto` and are refused
    /// under `on`.
    #[arg(long, default_value_t = DEFAULT_CUDA_GRAPHS, value_parser = CudaGraphs::parse)]
    pub cuda_graphs: CudaGraphs,
    /// Bit-reproducible GPU steps, as `tilearn train --deterministic`: the flash attention
    /// backward without atomics instead of its faster one-pass form (Hopper).
    #[arg(long)]
    pub deterministic: bool,
    /// Where the GPU engine keeps the optimizer state, as `tilearn train --memory`: `default`
    /// or `lean` (fp32 master weights and AdamW moments in host memory, stepped on the CPU;
    /// bf16 only, no CUDA graphs).
    #[arg(long, default_value = "default", value_parser = MemoryMode::parse)]
    pub memory: MemoryMode,
    /// How the GPU engine keeps the bf16/fp16 copy of the weights, as `tilearn train
    /// --weight-copy`: `whole`, `per-layer` (each layer cast from the fp32 master weights just
    /// before use) or `auto` (per layer under --gradient-checkpointing).
    #[arg(long, default_value = "auto", value_parser = WeightCopy::parse)]
    pub weight_copy: WeightCopy,
    /// Where gradient checkpointing's layer inputs live, as `tilearn train
    /// --offload-checkpoints`: `on` (page-locked host memory; steps run eagerly), `off`, or
    /// `auto` (default: on from 16 K tokens a sequence when the host has room). A bare
    /// `--offload-checkpoints` means `on`.
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "on",
          value_parser = OffloadCheckpoints::parse)]
    pub offload_checkpoints: OffloadCheckpoints,
    /// Print only the JSON line.
    #[arg(long)]
    pub json: bool,
}

/// `--precision`'s parser: exactly the names `DType` parses, listed by `--help`.
pub(crate) fn precision_names() -> impl TypedValueParser<Value = DType> {
    PossibleValuesParser::new(DType::ALL.map(DType::as_str)).try_map(|name| name.parse::<DType>())
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.steps == 0 {
        return Err(LlmError::Usage {
            flag: "--steps".into(),
            message: "must be at least 1".into(),
        });
    }
    if let Some(optimizers) = &args.optimizer {
        return super::bench_gpu::bench_optimizers(optimizers, args.params, args.steps);
    }
    let name = args.preset.clone().unwrap_or_default();
    let preset = Preset::by_name(&name).ok_or_else(|| LlmError::Usage {
        flag: "--preset".into(),
        message: format!(
            "unknown preset `{name}`; choose one of {}",
            PRESETS.map(|p| p.name).join(", ")
        ),
    })?;
    let batch = args.batch.unwrap_or(preset.batch);
    let seq = args.seq.unwrap_or(preset.seq);
    let config = preset.config(seq);
    let result = match args.device {
        BenchDevice::Cpu if args.offload_checkpoints == OffloadCheckpoints::On => {
            return Err(LlmError::Usage {
                flag: "--offload-checkpoints".into(),
                message: "is a GPU engine option; use --device cuda".into(),
            });
        }
        BenchDevice::Cpu if args.memory.is_lean() => {
            return Err(LlmError::Usage {
                flag: "--memory lean".into(),
                message: "is a GPU engine mode; use --device cuda".into(),
            });
        }
        BenchDevice::Cpu => {
            bench_cpu(&config, batch, seq, args.steps, args.gradient_checkpointing)?
        }
        BenchDevice::Cuda => super::bench_gpu::bench(
            &config,
            batch,
            seq,
            (args.warmup, args.steps),
            args.precision,
            args.gradient_checkpointing,
            args.lce_chunk_tokens,
            args.cuda_graphs,
            super::bench_gpu::GpuMemoryOptions {
                memory: args.memory,
                weight_copy: args.weight_copy,
                offload_checkpoints: args.offload_checkpoints,
            },
            args.deterministic,
        )?,
    };
    // The layout the GPU model kept its 16-bit weights in (`null` on the CPU, which has none).
    let weight_copy = matches!(args.device, BenchDevice::Cuda).then(|| {
        match args
            .weight_copy
            .per_layer(args.gradient_checkpointing, args.memory.is_lean())
        {
            true => WeightCopy::PerLayer.to_string(),
            false => WeightCopy::Whole.to_string(),
        }
    });
    // The chunk the GPU model sized its logits buffer for (built for one precision, so the
    // element is that precision's); the CPU engine keeps all logits.
    let lce_chunk_tokens = match args.device {
        BenchDevice::Cuda => Some(args.lce_chunk_tokens.rows(
            batch * seq,
            config.vocab_size,
            args.precision.size_in_bytes(),
        )),
        BenchDevice::Cpu => None,
    };
    let num_params = result.num_params;
    let tokens_per_sec = (batch * seq) as f64 / result.step_seconds;
    let mfu = tokens_per_sec * flops_per_token(&config, num_params, seq) / PEAK_BF16_FLOPS;
    let line = serde_json::json!({
        "impl": "tilearn",
        "preset": preset.name,
        "device": result.device,
        "precision": result.precision,
        "gradient_checkpointing": args.gradient_checkpointing,
        "deterministic": args.deterministic,
        "memory": args.memory.to_string(),
        "weight_copy": weight_copy,
        "offload_checkpoints": result.offload_checkpoints.as_ref().map(|(on, _)| on),
        "offload_reason": result.offload_checkpoints.as_ref().and_then(|(_, why)| why.clone()),
        "lce_chunk_tokens": lce_chunk_tokens,
        "batch": batch,
        "seq": seq,
        "params": num_params,
        "step_ms": result.step_seconds * 1e3,
        "tokens_per_sec": tokens_per_sec,
        "mfu": mfu,
        "peak_mem_gib": result.peak_memory_bytes as f64 / (1u64 << 30) as f64,
        "loss": result.last_loss,
        "skipped_steps": result.skipped_steps,
        "cuda_graphs": result.cuda_graphs.as_ref().map(GraphReport::to_json),
        "version": env!("CARGO_PKG_VERSION"),
    });
    if !args.json {
        eprintln!(
            "{}: {:.1} ms/step, {:.0} tokens/s, MFU {:.1}%",
            preset.name,
            result.step_seconds * 1e3,
            tokens_per_sec,
            mfu * 100.0
        );
    }
    println!("{line}");
    Ok(())
}

fn bench_cpu(
    config: &tilearn_engine::config::LlamaConfig,
    batch: usize,
    seq: usize,
    steps: usize,
    gradient_checkpointing: bool,
) -> Result<BenchResult> {
    let mut model = LlamaForCausalLM::from_config(config.clone(), 0);
    let numel = model.params.numel();
    let mut optimizer = AdamW::with_single_group(AdamWConfig::default(), numel)
        .map_err(tilearn_engine::EngineError::from)?;
    let mut acts = Activations::new(config, batch, seq, gradient_checkpointing);
    let mut grads = vec![0.0f32; numel];
    let mut times = Vec::with_capacity(steps);
    let mut last_loss = f64::NAN;
    let warmup = 1;
    for i in 0..warmup + steps {
        let ids = random_tokens(config.vocab_size, batch * seq, i as u64);
        let labels: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
        let start = Instant::now();
        grads.iter_mut().for_each(|g| *g = 0.0);
        let stats =
            model.forward_backward(&ids, &labels, batch, seq, None, &mut acts, &mut grads)?;
        tilearn_optim::clip_grad_norm(&mut grads, 1.0);
        optimizer
            .step(&mut model.params.data, &grads, 1e-4)
            .map_err(tilearn_engine::EngineError::from)?;
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64());
        }
        last_loss = stats.mean();
    }
    let bytes = (numel * 4 * 4 + acts.bytes()) as u64; // params, grads, two moments, arena
    Ok(BenchResult {
        device: "cpu".into(),
        precision: DType::F32,
        num_params: numel,
        step_seconds: median(times),
        peak_memory_bytes: bytes,
        cuda_graphs: None,
        offload_checkpoints: None,
        last_loss,
        skipped_steps: 0,
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn precision(flags: &[&str]) -> std::result::Result<DType, clap::Error> {
        let argv = ["bench", "--preset", "llama-134m"].iter().chain(flags);
        Cli::try_parse_from(argv).map(|cli| cli.bench.precision)
    }

    #[test]
    fn precision_flag_takes_the_dtype_names_and_defaults_to_bf16() {
        assert_eq!(precision(&[]).unwrap(), DType::BF16);
        for d in DType::ALL {
            assert_eq!(precision(&["--precision", d.as_str()]).unwrap(), d);
        }
        for bad in ["f32", "f16", "half", "BF16"] {
            let err = precision(&["--precision", bad]).unwrap_err().to_string();
            assert!(
                err.contains("possible values: fp32, bf16, fp16"),
                "{bad}: {err}"
            );
        }
    }
    fn lce_chunk(flags: &[&str]) -> std::result::Result<LceChunk, clap::Error> {
        let argv = ["bench", "--preset", "llama-134m"].iter().chain(flags);
        Cli::try_parse_from(argv).map(|cli| cli.bench.lce_chunk_tokens)
    }

    #[test]
    fn lce_chunk_flag_defaults_to_auto_and_takes_zero_or_a_count() {
        assert_eq!(lce_chunk(&[]).unwrap(), LceChunk::Auto);
        assert_eq!(
            lce_chunk(&["--lce-chunk-tokens", "0"]).unwrap(),
            LceChunk::Unchunked
        );
        assert_eq!(
            lce_chunk(&["--lce-chunk-tokens", "1000"]).unwrap(),
            LceChunk::from_tokens(1000)
        );
        let err = lce_chunk(&["--lce-chunk-tokens", "lots"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`lots` is not a token count"), "{err}");
    }

    fn cuda_graphs(flags: &[&str]) -> std::result::Result<CudaGraphs, clap::Error> {
        let argv = ["bench", "--preset", "llama-134m"].iter().chain(flags);
        Cli::try_parse_from(argv).map(|cli| cli.bench.cuda_graphs)
    }

    #[test]
    fn cuda_graphs_flag_defaults_to_the_engine_default_and_takes_on_off_auto() {
        assert_eq!(cuda_graphs(&[]).unwrap(), DEFAULT_CUDA_GRAPHS);
        for (text, mode) in [
            ("on", CudaGraphs::On),
            ("off", CudaGraphs::Off),
            ("auto", CudaGraphs::Auto),
        ] {
            assert_eq!(cuda_graphs(&["--cuda-graphs", text]).unwrap(), mode);
        }
        let err = cuda_graphs(&["--cuda-graphs", "maybe"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`maybe` is not a CUDA graph setting"), "{err}");
    }
}
