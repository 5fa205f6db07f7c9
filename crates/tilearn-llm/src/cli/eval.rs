//! `tilearn eval`: mean next-token loss of a checkpoint on given token sequences.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use clap::Args;
use tilearn_engine::model::{Activations, LlamaForCausalLM};
use tilearn_ops::cpu::cross_entropy_forward;

use crate::{LlmError, Result};

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Hugging Face checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// JSON file holding a list of token-id lists, e.g. [[1, 5, 9], [4, 2]].
    #[arg(long)]
    pub tokens: PathBuf,
    /// Also write the f32 logits, one tensor `logits.<i>` of shape [len_i, vocab] per sequence.
    #[arg(long)]
    pub output: Option<PathBuf>,
}

pub fn run(args: EvalArgs) -> Result<()> {
    let model = LlamaForCausalLM::from_pretrained(&args.model)?;
    let sequences = read_token_lists(&args.tokens, model.config.vocab_size)?;
    let vocab = model.config.vocab_size;
    let (mut loss_sum, mut count) = (0.0f64, 0usize);
    let mut all_logits = Vec::new();
    for (i, ids) in sequences.iter().enumerate() {
        if ids.len() > model.config.max_position_embeddings {
            return Err(LlmError::Input {
                file: args.tokens.clone(),
                message: format!(
                    "sequence {i} has {} tokens, above the model's max_position_embeddings ({})",
                    ids.len(),
                    model.config.max_position_embeddings
                ),
            });
        }
        let mut acts = Activations::new(&model.config, 1, ids.len(), false);
        let logits = model.forward_logits(ids, 1, ids.len(), &mut acts)?;
        // Position t predicts token t+1; the last position has no target.
        let mut targets: Vec<i32> = ids[1..].iter().map(|&t| t as i32).collect();
        targets.push(-100);
        let stats = cross_entropy_forward(logits, &targets, vocab)?;
        loss_sum += stats.loss_sum;
        count += stats.valid;
        if args.output.is_some() {
            all_logits.push((ids.len(), logits.to_vec()));
        }
    }
    if count == 0 {
        return Err(LlmError::Input {
            file: args.tokens.clone(),
            message: "no sequence has two or more tokens, so there is nothing to predict".into(),
        });
    }
    if let Some(path) = &args.output {
        write_logits(path, &all_logits, vocab)?;
    }
    println!(
        "{}",
        serde_json::json!({"loss": loss_sum / count as f64, "tokens": count})
    );
    Ok(())
}

/// Reads and checks the token lists: every id must be a non-negative integer below `vocab`.
fn read_token_lists(path: &Path, vocab: usize) -> Result<Vec<Vec<u32>>> {
    let bad = |message: String| LlmError::Input {
        file: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| bad(format!("not JSON ({e}); expected a list of token-id lists")))?;
    let lists = value
        .as_array()
        .ok_or_else(|| bad("expected a list of token-id lists, e.g. [[1, 5, 9], [4, 2]]".into()))?;
    if lists.is_empty() {
        return Err(bad("the list is empty; give at least one sequence".into()));
    }
    lists
        .iter()
        .enumerate()
        .map(|(i, list)| {
            let items = list
                .as_array()
                .ok_or_else(|| bad(format!("entry {i} is not a list of token ids")))?;
            items
                .iter()
                .enumerate()
                .map(|(j, v)| match v.as_u64() {
                    Some(id) if (id as usize) < vocab => Ok(id as u32),
                    _ => Err(bad(format!(
                        "entry {i}, position {j}: {v} is not a token id in 0..{vocab}"
                    ))),
                })
                .collect()
        })
        .collect()
}

fn write_logits(path: &Path, logits: &[(usize, Vec<f32>)], vocab: usize) -> Result<()> {
    let tensors: Vec<(String, tilearn_ops::Tensor)> = logits
        .iter()
        .enumerate()
        .map(|(i, (len, values))| {
            tilearn_ops::Tensor::from_f32(tilearn_ops::DType::F32, vec![*len, vocab], values)
                .map(|t| (format!("logits.{i}"), t))
        })
        .collect::<std::result::Result<_, _>>()?;
    let views: HashMap<String, safetensors::tensor::TensorView<'_>> = tensors
        .iter()
        .map(|(name, t)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                t.shape().to_vec(),
                t.as_bytes(),
            )
            .expect("shape and bytes agree by construction");
            (name.clone(), view)
        })
        .collect();
    let err = |e: &dyn std::fmt::Display| LlmError::Input {
        file: path.to_path_buf(),
        message: format!("cannot write the logits: {e}"),
    };
    let bytes = safetensors::serialize(&views, None).map_err(|e| err(&e))?;
    tilearn_ops::fs::write_bytes_atomic(path, &bytes).map_err(|e| err(&e))
}
