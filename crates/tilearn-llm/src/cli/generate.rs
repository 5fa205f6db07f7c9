//! `tilearn generate`: continue a prompt with a trained model with a KV cache, on the GPU
//! (`--device auto` when one is present, as `train`) or the CPU.
//!
//! Decoding follows transformers' `generate`: greedy unless sampling is on (then temperature,
//! top-k and top-p, drawn from a generator seeded by `--seed`); sampling at temperature 0 is
//! greedy too. Generation stops at any `eos_token_id` or after the length. The model
//! directory's `generation_config.json` gives the defaults, the flags override them
//! (`generate_settings.rs`).

use std::path::{Path, PathBuf};

use clap::Args;
use tilearn_engine::data::{ChatMessage, ChatTemplate, load_tokenizer};
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_engine::model::generate::{Decoding, GenerateOptions, Generation, StopReason};
use tilearn_ops::DType;

use super::bench::precision_names;
use super::decode::{DecodeDevice, generate_one};
use super::device::{DeviceChoice, choose_device};
use super::generate_settings::{GenerationFlags, bos_for_empty_prompt};
use crate::{LlmError, Result};

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_ids", "chat"]))]
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
    /// A user message to answer: rendered with the chat template of the model's
    /// tokenizer_config.json (as transformers' `apply_chat_template` with
    /// `add_generation_prompt=True`), so the model continues with its assistant turn.
    #[arg(long, value_name = "MESSAGE")]
    pub chat: Option<String>,
    /// A system message before --chat's user message (for templates that take one).
    #[arg(long, requires = "chat", value_name = "MESSAGE")]
    pub system: Option<String>,
    /// tokenizer.json (or SentencePiece tokenizer.model) to use with --prompt or --chat (default:
    /// <model>/tokenizer.json, else <model>/tokenizer.model).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Most tokens to generate [default: generation_config.json's max_new_tokens, or its
    /// max_length minus the prompt, else 64].
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    /// Sample instead of taking the most likely token (transformers' `do_sample`); `--do-sample
    /// false` decodes greedily when generation_config.json turns sampling on [default: the
    /// file's do_sample, else false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub do_sample: Option<bool>,
    /// Divides the logits before sampling; 0 means greedy. Used when sampling [default: the
    /// file's, else 1].
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Sample only among the K most likely tokens; 0 means no limit. Used when sampling
    /// [default: the file's, else 50].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities sum to P, in (0, 1]; 1
    /// keeps all. Used when sampling [default: the file's, else 1].
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Seed of the sampler: the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where to run: the GPU when one is present and the CUDA kernels are built in (auto), or
    /// the one named.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
    pub device: DeviceChoice,
    /// Storage type of the weights, activations and KV cache on the GPU: fp32 (the CPU's and
    /// transformers' default numbers), bf16 or fp16 (faster, rounded). The CPU always runs
    /// fp32.
    #[arg(long, default_value_t = DType::F32, value_parser = precision_names())]
    pub precision: DType,
}

fn usage(flag: &str, message: String) -> LlmError {
    LlmError::Usage {
        flag: flag.into(),
        message,
    }
}

impl GenerateArgs {
    fn generation_flags(&self) -> GenerationFlags {
        GenerationFlags {
            max_new_tokens: self.max_new_tokens,
            do_sample: self.do_sample,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
        }
    }
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let flags = args.generation_flags();
    flags.validate()?;
    let device = DecodeDevice {
        on_gpu: choose_device(args.device)?,
        precision: args.precision,
    };
    if !device.on_gpu && args.precision != DType::F32 {
        eprintln!(
            "generate: note: --precision {} applies on the GPU only; the CPU runs fp32",
            args.precision
        );
    }
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
    let tokenizer = match args.prompt.is_some() || args.chat.is_some() {
        true => {
            let path = args
                .tokenizer
                .clone()
                .unwrap_or_else(|| tilearn_engine::data::prepare::tokenizer_in(&args.model));
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
        false => None,
    };
    // A chat message becomes the template's text, whose special tokens the template wrote.
    let text = match (&args.chat, &tokenizer) {
        (Some(message), Some((_, path))) => {
            Some((chat_prompt(path, args.system.as_deref(), message)?, false))
        }
        _ => args.prompt.clone().map(|p| (p, true)),
    };
    let model = LlamaForCausalLM::from_pretrained(&args.model)?;
    let mut prompt: Vec<u32> = match (&text, &tokenizer) {
        (Some((text, add_special)), Some((tok, path))) => tok
            .encode(text.as_str(), *add_special)
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
        // transformers' generate without input starts from the BOS token; so do we.
        match bos_for_empty_prompt(&model.config) {
            Some(bos) if args.prompt.is_some() => prompt.push(bos),
            _ => {
                return Err(usage(
                    "--prompt",
                    "has no tokens and the model names no bos_token_id to start from; give a \
                     non-empty --prompt or --prompt-ids"
                        .into(),
                ));
            }
        }
    }
    let vocab = model.config.vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(usage(
            "--prompt-ids",
            format!("{bad} is not a token id of this model (vocabulary 0..{vocab})"),
        ));
    }
    let settings = flags.resolve(&model.config, prompt.len())?;
    if settings.ignored_sampling_flags {
        // transformers warns and decodes greedily in this case; so do we.
        eprintln!(
            "generate: note: --temperature/--top-k/--top-p apply only when sampling \
             (--do-sample, or do_sample in generation_config.json); decoding greedily"
        );
    }
    let total = prompt.len() + settings.max_new_tokens;
    if total > model.config.max_position_embeddings {
        eprintln!(
            "generate: warning: {total} positions exceed the model's max_position_embeddings ({}); \
             quality past it is not what the model was trained for",
            model.config.max_position_embeddings
        );
    }
    eprintln!(
        "generate: on {} with a KV cache ({} prompt tokens, {})",
        device.describe(),
        prompt.len(),
        match settings.decoding {
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
        max_new_tokens: settings.max_new_tokens,
        decoding: settings.decoding,
        seed: args.seed,
        stop_ids: settings.stop_ids,
    };
    let generation = generate_one(device, &model, &prompt, &options)?;
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
/// `message` (after `system`, if any) as the chat template beside `tokenizer` renders a
/// conversation awaiting the assistant's answer.
fn chat_prompt(tokenizer: &Path, system: Option<&str>, message: &str) -> Result<String> {
    let Some(template) = ChatTemplate::beside(tokenizer)? else {
        return Err(usage(
            "--chat",
            format!(
                "no chat_template in the tokenizer_config.json beside {}; write the prompt in \
                 the model's format with --prompt",
                tokenizer.display()
            ),
        ));
    };
    let turn = |role: &str, content: &str| ChatMessage {
        role: role.into(),
        content: content.into(),
    };
    let mut messages: Vec<ChatMessage> = system.map(|s| turn("system", s)).into_iter().collect();
    messages.push(turn("user", message));
    template
        .render(&messages, true)
        .map_err(|e| LlmError::Input {
            file: template.source().to_path_buf(),
            message: format!("the chat template rejected the conversation: {e}"),
        })
}

fn summary(g: &Generation, prompt_len: usize) -> String {
    let stop = match g.stop {
        StopReason::EndOfSequence => "end-of-sequence token",
        StopReason::MaxNewTokens => "the length limit",
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
