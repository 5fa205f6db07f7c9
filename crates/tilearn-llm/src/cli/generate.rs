//! `tilearn generate`: continue a prompt with a trained model, on the CPU with a KV cache.
//!
//! Decoding follows transformers' `generate`: greedy unless `--do-sample` (then temperature,
//! top-k and top-p, drawn from a generator seeded by `--seed`); `--do-sample --temperature 0`
//! is greedy too. Generation stops at any of the config's `eos_token_id`s or after
//! `--max-new-tokens`.

use std::path::PathBuf;

use clap::Args;
use tilearn_engine::data::load_tokenizer;
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_engine::model::generate::{
    Decoding, GenerateOptions, Generation, SamplingParams, StopReason, generate,
};

use crate::{LlmError, Result};

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_ids"]))]
pub struct GenerateArgs {
    /// Hugging Face checkpoint directory (config.json + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// Text to continue, encoded with the tokenizer (special tokens such as BOS added as the
    /// tokenizer's post-processor says). The continuation is printed on stdout.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Token ids to continue instead of text, e.g. `1,5,9`; needs no tokenizer and prints the
    /// generated ids, comma-separated.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub prompt_ids: Option<Vec<u32>>,
    /// tokenizer.json to use with --prompt (default: <model>/tokenizer.json).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Sample instead of taking the most likely token (transformers' `do_sample`).
    #[arg(long)]
    pub do_sample: bool,
    /// Divides the logits before sampling; 0 means greedy. Used with --do-sample [default: 1].
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Sample only among the K most likely tokens; 0 means no limit. Used with --do-sample
    /// [default: 50].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities sum to P, in (0, 1]; 1
    /// keeps all. Used with --do-sample [default: 1].
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Seed of the sampler: the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

fn usage(flag: &str, message: String) -> LlmError {
    LlmError::Usage {
        flag: flag.into(),
        message,
    }
}

/// Checks the sampling flags (always, so a typo is caught before a long load) and picks the
/// decoding.
fn decoding(args: &GenerateArgs) -> Result<Decoding> {
    let defaults = SamplingParams::default();
    let temperature = args.temperature.unwrap_or(defaults.temperature);
    let top_p = args.top_p.unwrap_or(defaults.top_p);
    let top_k = args.top_k.or(defaults.top_k).unwrap_or(0);
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(usage(
            "--temperature",
            format!(
                "{temperature} is negative or not a number; use 0 (greedy) or a positive value"
            ),
        ));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(usage(
            "--top-p",
            format!("{top_p} is outside (0, 1]; 1 disables the filter"),
        ));
    }
    if !args.do_sample {
        // transformers warns and decodes greedily in this case; so do we.
        if args.temperature.is_some() || args.top_k.is_some() || args.top_p.is_some() {
            eprintln!(
                "generate: note: --temperature/--top-k/--top-p apply only with --do-sample; \
                 decoding greedily"
            );
        }
        return Ok(Decoding::Greedy);
    }
    if temperature == 0.0 {
        return Ok(Decoding::Greedy);
    }
    Ok(Decoding::Sample(SamplingParams {
        temperature,
        top_k: (top_k > 0).then_some(top_k),
        top_p,
    }))
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let decoding = decoding(&args)?;
    if !args.model.join("config.json").is_file() {
        return Err(usage(
            "--model",
            format!(
                "{} has no config.json; pass a Hugging Face checkpoint directory (e.g. the \
                 --output-dir of `tilearn train`)",
                args.model.display()
            ),
        ));
    }
    // Text needs the tokenizer; load it before the weights so a missing file fails fast.
    let tokenizer = match &args.prompt {
        Some(_) => {
            let path = args
                .tokenizer
                .clone()
                .unwrap_or_else(|| args.model.join("tokenizer.json"));
            if !path.is_file() {
                return Err(usage(
                    "--tokenizer",
                    format!(
                        "{} not found; pass --tokenizer FILE (a model trained on the embedded \
                         corpus has it in <output-dir>/data/tokenizer.json), or token ids with \
                         --prompt-ids",
                        path.display()
                    ),
                ));
            }
            Some((load_tokenizer(&path)?, path))
        }
        None => None,
    };
    let model = LlamaForCausalLM::from_pretrained(&args.model)?;
    let prompt: Vec<u32> = match (&args.prompt, &tokenizer) {
        (Some(text), Some((tok, path))) => tok
            .encode(text.as_str(), true)
            .map_err(|e| LlmError::Input {
                file: path.clone(),
                message: format!("cannot encode the prompt: {e}"),
            })?
            .get_ids()
            .to_vec(),
        // clap requires one of the two; an empty list is refused just below.
        _ => args.prompt_ids.clone().unwrap_or_default(),
    };
    if prompt.is_empty() {
        return Err(usage(
            "--prompt",
            "has no tokens; give a non-empty --prompt or --prompt-ids".into(),
        ));
    }
    let vocab = model.config.vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(usage(
            "--prompt-ids",
            format!("{bad} is not a token id of this model (vocabulary 0..{vocab})"),
        ));
    }
    let total = prompt.len() + args.max_new_tokens;
    if total > model.config.max_position_embeddings {
        eprintln!(
            "generate: warning: {total} positions exceed the model's max_position_embeddings ({}); \
             quality past it is not what the model was trained for",
            model.config.max_position_embeddings
        );
    }
    eprintln!(
        "generate: on the CPU with a KV cache{} ({} prompt tokens, {})",
        if cfg!(feature = "cuda") {
            " (generation has no GPU path yet)"
        } else {
            ""
        },
        prompt.len(),
        match decoding {
            Decoding::Greedy => "greedy".to_string(),
            Decoding::Sample(p) => format!(
                "sampling: temperature {}, top-k {}, top-p {}, seed {}",
                p.temperature,
                p.top_k.map_or("off".to_string(), |k| k.to_string()),
                p.top_p,
                args.seed
            ),
        }
    );
    let options = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        decoding,
        seed: args.seed,
        stop_ids: model.config.eos_token_ids.clone(),
    };
    let generation = generate(&model, &prompt, &options)?;
    match &tokenizer {
        Some((tok, path)) => {
            let text = tok
                .decode(&generation.tokens, true)
                .map_err(|e| LlmError::Input {
                    file: path.clone(),
                    message: format!("cannot decode the generated ids: {e}"),
                })?;
            println!("{text}");
        }
        None => {
            let ids: Vec<String> = generation.tokens.iter().map(u32::to_string).collect();
            println!("{}", ids.join(","));
        }
    }
    eprintln!("{}", summary(&generation, prompt.len()));
    Ok(())
}

/// One stderr line: tokens, why it stopped, prefill time and decode speed.
fn summary(g: &Generation, prompt_len: usize) -> String {
    let stop = match g.stop {
        StopReason::EndOfSequence => "end-of-sequence token",
        StopReason::MaxNewTokens => "--max-new-tokens",
    };
    let speed = g
        .decode_tokens_per_second()
        .map_or("-".to_string(), |s| format!("{s:.1}"));
    format!(
        "generate: {} new tokens (stopped by {stop}); prefill of {prompt_len} tokens {:.1} ms; \
         decode {speed} tokens/s",
        g.tokens.len(),
        g.prefill.as_secs_f64() * 1e3
    )
}
