//! The CUDA side of `tilearn bench`.

use tilearn_engine::config::LlamaConfig;

use super::bench::BenchResult;
use crate::{LlmError, Result};

/// Runs the bench loop on GPU 0. Until the CUDA training step exists this is a clear error.
pub fn bench(
    _config: &LlamaConfig,
    _batch: usize,
    _seq: usize,
    _steps: usize,
) -> Result<BenchResult> {
    Err(LlmError::Usage {
        flag: "--device cuda".into(),
        message: "the CUDA training step is not built into this version; use --device cpu".into(),
    })
}
