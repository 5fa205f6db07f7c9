//! `tilearn ctr train|bench --device cuda`: the GPU trainer, where its embedding rows live and
//! the precision of its MLP.
//!
//! `--gpu-embedding-budget SIZE` bounds the device bytes of the embedding tables (weights +
//! sparse optimizer state). Tables over it keep their rows in pinned host memory behind a GPU
//! cache of hot rows (tilearn-recsys' `cuda::DeviceCachedEmbeddingBag`); `--host-rows` says
//! which (`auto`: the largest, until the rest fits; or table indices). The cache is exact:
//! training through it gives the rows and losses of training with every row on the GPU. The
//! plan is printed as one JSON line (`row_cache_plan`), and each log record carries the
//! cache's hit rate and host↔device row traffic (`row_cache`).
//!
//! `--precision bf16` runs the MLP's GEMMs in bf16 through cuBLASLt (f32 accumulation, f32
//! master weights stepped by the f32 AdamW; tilearn-recsys' `cuda::Bf16Mlp`).

use clap::{Args, ValueEnum};
use tilearn_recsys::CtrModel;
use tilearn_recsys::cache::{HostRows, ResidencyPlan, parse_bytes, plan_residency};
use tilearn_recsys::train::EVAL_CHUNK;

use crate::{LlmError, Result};

/// The element type of the MLP's matrix products on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrecisionArg {
    /// f32 throughout (no TF32).
    Fp32,
    /// bf16 GEMM inputs with f32 accumulation and f32 master weights.
    Bf16,
}

/// Where the embedding rows of a GPU run live, and the MLP's precision.
#[derive(Debug, Clone, Args)]
pub struct GpuArgs {
    /// Device memory for the embedding tables (weights + sparse optimizer state), e.g. `2GiB`,
    /// `512MiB`, `1.5GB`. Tables beyond it keep their rows in pinned host memory with a GPU
    /// cache of hot rows filling the rest of the budget. Default: every table on the GPU.
    #[arg(long, value_parser = parse_bytes)]
    pub gpu_embedding_budget: Option<u64>,
    /// Which tables keep their rows in host memory (with --gpu-embedding-budget): `auto` (the
    /// default: the largest tables, until the rest fits) or table indices such as `0,3` (the
    /// fields' embeddings are tables 0..F, their first-order weights F..2F, Wide & Deep's
    /// crossed pairs after them).
    #[arg(long, requires = "gpu_embedding_budget")]
    pub host_rows: Option<HostRows>,
    /// The MLP's matrix products on the GPU: `fp32` or `bf16` (cuBLASLt, f32 accumulation,
    /// f32 master weights).
    #[arg(long, value_enum, default_value = "fp32")]
    pub precision: PrecisionArg,
}

impl GpuArgs {
    /// The placement of `ctr`'s tables for batches of `batch_size` (`None`: no budget given,
    /// every table on the GPU).
    pub fn plan(&self, ctr: &CtrModel, batch_size: usize) -> Result<Option<ResidencyPlan>> {
        let Some(budget) = self.gpu_embedding_budget else {
            return Ok(None);
        };
        let host = self.host_rows.clone().unwrap_or(HostRows::Auto);
        // A cache holds at least one batch's distinct rows of a table (one id per sample and
        // field), in training and in evaluation.
        let min_slots = batch_size.max(EVAL_CHUNK);
        let plan = plan_residency(
            &ctr.tables.layout,
            ctr.sparse.optimizer(),
            budget,
            &host,
            min_slots,
        )?;
        let line = serde_json::json!({"row_cache_plan": {
            "gpu_embedding_budget": budget,
            "host_tables": plan.host_tables,
            "cache_slots": plan.host_tables.iter().map(|&t| plan.slots[t]).collect::<Vec<_>>(),
            "device_embedding_bytes": plan.device_bytes,
            "host_embedding_bytes": plan.host_bytes,
        }});
        eprintln!("{line}");
        Ok(Some(plan))
    }

    /// Fails when a GPU-only flag is given for a run on the CPU.
    pub fn check_cpu(&self) -> Result<()> {
        if self.gpu_embedding_budget.is_some() {
            return Err(LlmError::Usage {
                flag: "--gpu-embedding-budget".into(),
                message: "places tables for a GPU run; add --device cuda or drop the flag".into(),
            });
        }
        if self.precision == PrecisionArg::Bf16 {
            return Err(LlmError::Usage {
                flag: "--precision bf16".into(),
                message: "the CPU model is f32; add --device cuda or drop the flag".into(),
            });
        }
        Ok(())
    }
}

/// The GPU trainer of `ctr` on `stream`, its rows placed by `plan` (`None` or a plan with
/// every table on the device: all rows on the GPU), its MLP in `precision`.
#[cfg(feature = "cuda")]
pub fn gpu_trainer(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ctr: CtrModel,
    plan: Option<&ResidencyPlan>,
    precision: PrecisionArg,
) -> Result<tilearn_recsys::cuda::GpuCtrTrainer> {
    use tilearn_recsys::cuda::{GpuCtrTrainer, MlpPrecision};
    let mut trainer = match plan.filter(|p| !p.all_on_device()) {
        Some(plan) => GpuCtrTrainer::with_row_cache(stream, ctr, &plan.slots)?,
        None => GpuCtrTrainer::new(stream, ctr)?,
    };
    if precision == PrecisionArg::Bf16 {
        trainer.device().set_mlp_precision(MlpPrecision::Bf16)?;
    }
    Ok(trainer)
}
