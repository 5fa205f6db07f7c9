//! The end of a training run: a few short greedy samples from the model it just saved, so the
//! run shows what it learnt and not only a loss. The prompts are the first tokens of the first
//! documents of the run's own training data; generation runs on the GPU (fp32) when training
//! did, else on the CPU (the default 1.4 M-parameter model takes a few milliseconds per
//! sample). `tilearn train --no-samples` skips them.
//!
//! A failure here is a warning: the model is saved and the run succeeded.

use std::path::Path;

use tilearn_engine::data::{TokenDataset, load_tokenizer};
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_engine::model::generate::{Decoding, GenerateOptions};
use tilearn_ops::DType;

use super::decode::{DecodeDevice, generate_all};
use crate::Result;

/// Samples printed.
const PROMPTS: usize = 2;
/// Tokens of each prompt (bytes, for the embedded corpus).
const PROMPT_TOKENS: usize = 16;
/// New tokens per sample.
const NEW_TOKENS: usize = 40;
/// Tokens of the data stream searched for document starts.
const SCAN_TOKENS: usize = 1 << 16;
/// On the CPU, models above this many parameters are not sampled by default: their samples
/// would take more than a few seconds.
const CPU_SAMPLE_MAX_PARAMS: usize = 200_000_000;

/// Prints the samples of the model saved in `model_dir`, prompted from `data`; warns instead of
/// failing.
pub(crate) fn print_after_training(model_dir: &Path, data: &Path, on_gpu: bool) {
    if let Err(e) = print_samples(model_dir, data, on_gpu) {
        eprintln!("warning: no samples after training: {e}");
    }
}

/// The first `PROMPT_TOKENS` tokens of each of the first `PROMPTS` documents (a document starts
/// the stream or follows an end-of-sequence id).
fn prompts(data: &TokenDataset) -> Result<Vec<Vec<u32>>> {
    let stream = data.tokens(0..data.num_tokens().min(SCAN_TOKENS))?;
    let eos = data.eos_id();
    let mut starts = vec![0];
    starts.extend(
        stream
            .iter()
            .enumerate()
            .filter(|&(_, &t)| t == eos)
            .map(|(i, _)| i + 1),
    );
    Ok(starts
        .into_iter()
        .filter_map(|s| {
            let doc: Vec<u32> = stream
                .get(s..)?
                .iter()
                .copied()
                .take_while(|&t| t != eos)
                .take(PROMPT_TOKENS)
                .collect();
            (doc.len() >= PROMPT_TOKENS / 2).then_some(doc)
        })
        .take(PROMPTS)
        .collect())
}

fn print_samples(model_dir: &Path, data: &Path, on_gpu: bool) -> Result<()> {
    let model = LlamaForCausalLM::from_pretrained(model_dir)?;
    let params = model.params.numel();
    if !on_gpu && params > CPU_SAMPLE_MAX_PARAMS {
        println!(
            "samples: skipped on the CPU for a model of {params} parameters (slow); run \
             `tilearn generate --model {}`",
            model_dir.display()
        );
        return Ok(());
    }
    let data = TokenDataset::open(data)?;
    let prompts = prompts(&data)?;
    if prompts.is_empty() {
        return Ok(());
    }
    let tokenizer = data
        .tokenizer_path()
        .filter(|p| p.is_file())
        .map(|p| load_tokenizer(&p))
        .transpose()?;
    let device = DecodeDevice {
        on_gpu,
        precision: DType::F32,
    };
    let options = GenerateOptions {
        max_new_tokens: NEW_TOKENS,
        decoding: Decoding::Greedy,
        seed: 0,
        stop_ids: model.config.eos_token_ids.clone(),
    };
    let generations = generate_all(device, &model, &prompts, &options)?;
    let text = |ids: &[u32]| -> String {
        tokenizer
            .as_ref()
            .and_then(|t| t.decode(ids, true).ok())
            .map_or_else(|| format!("{ids:?}"), |s| format!("{s:?}"))
    };
    println!(
        "samples (greedy, up to {NEW_TOKENS} new tokens, on {}; `tilearn generate --model {}` \
         for more, --no-samples skips these):",
        device.describe(),
        model_dir.display()
    );
    for (i, (prompt, g)) in prompts.iter().zip(&generations).enumerate() {
        println!("  [{}] {} -> {}", i + 1, text(prompt), text(&g.tokens));
    }
    Ok(())
}
