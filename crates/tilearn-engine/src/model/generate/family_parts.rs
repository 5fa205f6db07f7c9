//! The per-family parts the decoders (CPU and GPU) need beyond the Llama block:
//!
//! * NormHead (Baichuan2): at inference its code normalises the lm_head rows once; the logits
//!   of the normalised head are the raw head's scaled per vocabulary row by
//!   `1 / max(‖w_r‖, 1e-12)`, so the decoders scale the last position's logits on the host
//!   instead of keeping a second copy of the head.
//! * Sliding window (Mistral, Qwen2 with `use_sliding_window`): the cached attention sees every
//!   cached key, which is the windowed result only while the sequence fits in the window;
//!   longer sequences are refused rather than computed wrongly.

use tilearn_ops::cpu::ROW_NORMALIZE_EPS;

use crate::config::LlamaConfig;
use crate::error::{EngineError, Result};
use crate::model::LlamaForCausalLM;

/// NormHead's per-row logit scale, `None` without NormHead.
pub(crate) fn norm_head_scale(model: &LlamaForCausalLM) -> Option<Vec<f32>> {
    if !model.config.norm_head() {
        return None;
    }
    let c = model.config.hidden_size;
    let head = &model.params.data[model.layout().lm_head];
    Some(
        head.chunks(c)
            .map(|row| {
                let norm = row
                    .iter()
                    .map(|&x| f64::from(x) * f64::from(x))
                    .sum::<f64>()
                    .sqrt();
                (1.0 / norm.max(ROW_NORMALIZE_EPS)) as f32
            })
            .collect(),
    )
}

/// Scales `logits` by NormHead's row scale, when there is one.
pub(crate) fn apply_head_scale(scale: Option<&[f32]>, logits: &mut [f32]) {
    if let Some(scale) = scale {
        for (l, s) in logits.iter_mut().zip(scale) {
            *l *= s;
        }
    }
}

/// Fails when a sequence of `len` tokens is longer than a sliding-window layer's window.
pub(crate) fn check_sliding_window(config: &LlamaConfig, len: usize) -> Result<()> {
    let slides = (0..config.num_hidden_layers).any(|i| config.layer_window(i).is_some());
    match config.sliding_window {
        Some(w) if slides && len > w => Err(EngineError::InvalidArgument {
            argument: "ids".into(),
            message: format!(
                "a sequence of {len} tokens exceeds the sliding window of {w} keys: generation \
                 with a KV cache does not window attention yet; keep prompt + new tokens \
                 <= {w}"
            ),
        }),
        _ => Ok(()),
    }
}

/// The ALiBi slopes of an ALiBi model (Baichuan-13B), `None` for RoPE models.
pub(crate) fn alibi_slopes(config: &LlamaConfig) -> Option<Vec<f32>> {
    (config.family.position_encoding() == crate::config::PositionEncoding::Alibi)
        .then(|| tilearn_ops::alibi_slopes(config.num_attention_heads))
}
