//! ZeRO's vocabulary, shared by the backends and the data-parallel layer: the stage, and the
//! per-rank model-state memory the ZeRO paper (Rajbhandari et al., 2020, §5) counts.
//!
//! Ψ parameters, each with `weights` bytes of working weights, `grads` bytes of
//! gradient and `optimizer` (the paper's K) bytes of optimizer state, over N ranks.
//!
//! * stage 0: (weights + grads + K)·Ψ
//! * stage 1: (weights + grads)·Ψ + K·Ψ/N
//! * stage 2: weights·Ψ + (grads + K)·Ψ/N
//!
//! Mixed-precision Adam (bf16/fp16 weights and gradients, fp32 master weights and two fp32
//! moments: K = 12) gives the paper's 4Ψ + 12Ψ/N and 2Ψ + 14Ψ/N. The CPU engine is fp32 only:
//! its working weights *are* the fp32 master weights (4 bytes, needed whole by every rank's
//! forward, so not partitioned), gradients are fp32 (4) and the optimizer state is the two
//! moments (K = 8). The GPU engine keeps fp32 gradients: with one 16-bit precision a bf16/fp16
//! working copy (2), gradients 4, K = 12 (fp32 master + moments, sharded together), 18Ψ
//! unpartitioned, 6Ψ + 12Ψ/N at stage 1 and 2Ψ + 16Ψ/N at stage 2 (the paper's 2Ψ + 14Ψ/N with
//! 4-byte gradients); when fp32 may run, the forward reads the fp32 master weights, which are
//! then working weights (4, plus 2 for a working copy) and K = 8, as on the CPU. Each backend
//! reports its own layout (`StepBackend::state_layout`) and what it holds
//! (`StepBackend::state_held`).

use serde::{Deserialize, Serialize};

use crate::{EngineError, Result};

/// The environment variable that sets the ZeRO stage when `--zero-stage` is not given.
pub const ZERO_STAGE_ENV: &str = "TILEARN_HYBRID_ZERO_STAGE";

/// How much of the model state is partitioned across the data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ZeroStage {
    /// Plain data parallelism: every rank holds everything.
    #[default]
    Off,
    /// Optimizer state (and the fp32 master weights it steps) partitioned.
    One,
    /// Stage 1 plus the gradients.
    Two,
}

impl ZeroStage {
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::Off => 0,
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
        }
    }

    /// Parses `0`, `1` or `2` (from `--zero-stage` or [`ZERO_STAGE_ENV`], named in errors).
    pub fn parse(text: &str, source: &str) -> Result<ZeroStage> {
        match text.trim() {
            "0" => Ok(ZeroStage::Off),
            "1" => Ok(ZeroStage::One),
            "2" => Ok(ZeroStage::Two),
            other => Err(EngineError::InvalidArgument {
                argument: source.into(),
                message: format!(
                    "`{other}` is not a ZeRO stage; use 0 (plain data parallel), 1 (optimizer \
                     state sharded) or 2 (optimizer state and gradients sharded)"
                ),
            }),
        }
    }

    /// `flag` if given, else [`ZERO_STAGE_ENV`], else off.
    pub fn from_flag_or_env(flag: Option<&str>) -> Result<ZeroStage> {
        match (flag, std::env::var(ZERO_STAGE_ENV)) {
            (Some(text), _) => ZeroStage::parse(text, "--zero-stage"),
            (None, Ok(text)) if !text.trim().is_empty() => ZeroStage::parse(&text, ZERO_STAGE_ENV),
            _ => Ok(ZeroStage::Off),
        }
    }
}

/// Bytes per parameter of each part of the model state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateBytes {
    pub weights: u64,
    pub grads: u64,
    /// The paper's K.
    pub optimizer: u64,
}

/// Mixed-precision Adam, the paper's case.
pub const MIXED_PRECISION_ADAM: StateBytes = StateBytes {
    weights: 2,
    grads: 2,
    optimizer: 12,
};

/// The CPU engine's fp32 AdamW (see the module docs).
pub const CPU_FP32_ADAMW: StateBytes = StateBytes {
    weights: 4,
    grads: 4,
    optimizer: 8,
};

/// Model-state bytes one rank holds, split as the stage partitions them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankState {
    pub weights: f64,
    /// All gradient storage held, `grad_window` included.
    pub grads: f64,
    /// Of `grads`: the reusable window a ZeRO-2 backward writes its parts in (0 otherwise).
    pub grad_window: f64,
    pub optimizer: f64,
}

impl RankState {
    /// What a CPU-engine rank holds: fp32 weights, gradients and AdamW moments, given as
    /// element counts (the moments' count is what ZeRO left this rank).
    pub fn host_fp32(weights: usize, grads: usize, moments: usize) -> RankState {
        let bytes = |n: usize| (n * std::mem::size_of::<f32>()) as f64;
        RankState {
            weights: bytes(weights),
            grads: bytes(grads),
            grad_window: 0.0,
            optimizer: bytes(moments),
        }
    }

    pub fn total(&self) -> f64 {
        self.weights + self.grads + self.optimizer
    }
}

/// The paper's per-rank model state for `numel` (Ψ) parameters over `world` (N) ranks.
pub fn per_rank(bytes: StateBytes, numel: u64, world: u64, stage: ZeroStage) -> RankState {
    let psi = numel as f64;
    let shard = psi / world.max(1) as f64;
    let (grads_over, optimizer_over) = match stage {
        ZeroStage::Off => (psi, psi),
        ZeroStage::One => (psi, shard),
        ZeroStage::Two => (shard, shard),
    };
    RankState {
        weights: bytes.weights as f64 * psi,
        grads: bytes.grads as f64 * grads_over,
        grad_window: 0.0,
        optimizer: bytes.optimizer as f64 * optimizer_over,
    }
}

/// The formula of `stage` for `bytes`, e.g. `4Ψ + 12Ψ/N`.
pub fn formula_text(bytes: StateBytes, stage: ZeroStage) -> String {
    let StateBytes {
        weights: w,
        grads: g,
        optimizer: k,
    } = bytes;
    match stage {
        ZeroStage::Off => format!("{}Ψ", w + g + k),
        ZeroStage::One => format!("{}Ψ + {k}Ψ/N", w + g),
        ZeroStage::Two => format!("{w}Ψ + {}Ψ/N", g + k),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_precision_matches_the_paper() {
        let (psi, n) = (7_000_000_000u64, 64u64);
        let p = psi as f64;
        let s1 = per_rank(MIXED_PRECISION_ADAM, psi, n, ZeroStage::One).total();
        assert_eq!(s1, 4.0 * p + 12.0 * p / n as f64);
        assert_eq!(
            formula_text(MIXED_PRECISION_ADAM, ZeroStage::One),
            "4Ψ + 12Ψ/N"
        );
        assert_eq!(
            formula_text(MIXED_PRECISION_ADAM, ZeroStage::Two),
            "2Ψ + 14Ψ/N"
        );
        let s2 = per_rank(MIXED_PRECISION_ADAM, psi, n, ZeroStage::Two).total();
        assert_eq!(s2, 2.0 * p + 14.0 * p / n as f64);
        let s0 = per_rank(MIXED_PRECISION_ADAM, psi, n, ZeroStage::Off).total();
        assert_eq!(s0, 16.0 * p);
        // The paper's example: 7.5B parameters on 64 GPUs, 120 GB → 31.4 GB → 16.6 GB.
        let gb = |stage| per_rank(MIXED_PRECISION_ADAM, 7_500_000_000, 64, stage).total() / 1e9;
        assert_eq!(gb(ZeroStage::Off).round(), 120.0);
        assert!((gb(ZeroStage::One) - 31.4).abs() < 0.05);
        assert!((gb(ZeroStage::Two) - 16.6).abs() < 0.05);
    }

    #[test]
    fn gpu_engine_mixed_precision_mapping() {
        let gpu = StateBytes {
            weights: 2,
            grads: 4,
            optimizer: 12,
        };
        assert_eq!(formula_text(gpu, ZeroStage::Off), "18Ψ");
        assert_eq!(formula_text(gpu, ZeroStage::One), "6Ψ + 12Ψ/N");
        assert_eq!(formula_text(gpu, ZeroStage::Two), "2Ψ + 16Ψ/N");
        let s2 = per_rank(gpu, 1000, 4, ZeroStage::Two);
        assert_eq!(s2.total(), 2.0 * 1000.0 + 16.0 * 250.0);
    }

    #[test]
    fn cpu_engine_mapping() {
        let (psi, n) = (1000u64, 4u64);
        let s1 = per_rank(CPU_FP32_ADAMW, psi, n, ZeroStage::One);
        assert_eq!(s1.total(), 8.0 * 1000.0 + 8.0 * 250.0);
        let s2 = per_rank(CPU_FP32_ADAMW, psi, n, ZeroStage::Two);
        assert_eq!(s2.total(), 4.0 * 1000.0 + 12.0 * 250.0);
    }
}
