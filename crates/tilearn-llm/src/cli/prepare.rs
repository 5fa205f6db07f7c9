//! `tilearn prepare-data`: tokenizer.json + text/JSON-lines files → token shards, or
//! (`--format sft`) supervised fine-tuning examples with a loss mask, or
//! (`--random-tokens N --vocab-size V`) uniformly random tokens for throughput benchmarks.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use rand::{Rng, SeedableRng};
use tilearn_engine::data::{PrepareOptions, SftOptions, ShardWriter, prepare_data, prepare_sft};

use crate::{LlmError, Result};

/// What the input files hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DataFormat {
    /// Pretraining text: documents (plain text paragraphs or a JSON-lines field) packed into
    /// one token stream, every token trained.
    Text,
    /// Supervised fine-tuning JSON lines: `prompt`/`response` strings or chat `messages`
    /// (rendered with the chat_template of the tokenizer_config.json beside --tokenizer); only
    /// the response/assistant tokens are trained, one example per training row (or packed
    /// into full rows with --packing).
    Sft,
}

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// What the input holds: pretraining text, or fine-tuning examples (`sft`).
    #[arg(long, value_enum, default_value_t = DataFormat::Text)]
    pub format: DataFormat,
    /// `--format sft`: truncate every example to this many tokens (default: keep them whole;
    /// training truncates them to its --seq-len and warns with the count).
    #[arg(long)]
    pub max_seq_length: Option<usize>,
    /// `--format sft`: skip lines that are not valid examples (and report how many) instead of
    /// stopping at the first.
    #[arg(long)]
    pub skip_bad_lines: bool,
    /// `--format sft`: pack short examples into rows of --max-seq-length tokens (TRL's
    /// `packing`, best-fit decreasing) instead of one example per padded row. Each example
    /// keeps its own position ids (restarting at 0) and attention never crosses from one
    /// example to another, so the loss and gradients are those of the examples one by one,
    /// with far less padding. Needs --max-seq-length (use the training --seq-len).
    #[arg(long, requires = "max_seq_length")]
    pub packing: bool,
    /// Hugging Face `tokenizer.json` to tokenize with, or a SentencePiece `tokenizer.model`
    /// (Baichuan ships only that; converted as transformers does, saved as tokenizer.json).
    #[arg(long, required_unless_present = "random_tokens")]
    pub tokenizer: Option<PathBuf>,
    /// Input files: plain text (documents separated by blank lines) or JSON-lines
    /// (`.jsonl`/`.json`, one object per line with a string field, see --text-field).
    #[arg(long, num_args = 1.., required_unless_present = "random_tokens")]
    pub input: Vec<PathBuf>,
    /// Instead of tokenizing: this many uniformly random tokens (documents of 4096, seeded by
    /// --seed), for throughput benchmarks on a model of --vocab-size.
    #[arg(long, conflicts_with_all = ["tokenizer", "input"], requires = "vocab_size")]
    pub random_tokens: Option<usize>,
    /// The vocabulary of --random-tokens (the last id is the end-of-sequence token).
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// The end-of-sequence token's text, for tokenizers that name none (default: the
    /// tokenizer_config.json's `eos_token`, else a special token such as </s> or <|endoftext|>).
    #[arg(long)]
    pub eos_token: Option<String>,
    /// Seed of --random-tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory for the shards and meta.json.
    #[arg(long)]
    pub output: PathBuf,
    /// The JSON field that holds the text in JSON-lines input.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Tokens per shard file.
    #[arg(long, default_value_t = 64 << 20)]
    pub shard_tokens: usize,
}

pub fn run(args: PrepareArgs) -> Result<()> {
    if let Some(tokens) = args.random_tokens {
        return random(&args, tokens);
    }
    if args.format == DataFormat::Sft {
        return sft(args);
    }
    for (set, flag) in [
        (args.max_seq_length.is_some(), "--max-seq-length"),
        (args.skip_bad_lines, "--skip-bad-lines"),
        (args.packing, "--packing"),
    ] {
        if set {
            return Err(LlmError::Usage {
                flag: flag.into(),
                message: "applies to fine-tuning data only; add --format sft".into(),
            });
        }
    }
    let opts = PrepareOptions {
        tokenizer: args.tokenizer.unwrap_or_default(),
        inputs: args.input,
        output_dir: args.output,
        text_field: args.text_field,
        shard_tokens: args.shard_tokens,
        eos_token: args.eos_token,
    };
    let summary = prepare_data(&opts, std::io::stderr().is_terminal())?;
    println!("{summary}");
    Ok(())
}

/// `--format sft`: JSON lines → an examples dataset with loss masks.
fn sft(args: PrepareArgs) -> Result<()> {
    if args.text_field != "text" {
        return Err(LlmError::Usage {
            flag: "--text-field".into(),
            message: "does not apply to --format sft, whose lines hold `prompt`/`response` or \
                      `messages`"
                .into(),
        });
    }
    let opts = SftOptions {
        tokenizer: args.tokenizer.unwrap_or_default(),
        inputs: args.input,
        output_dir: args.output,
        shard_tokens: args.shard_tokens,
        eos_token: args.eos_token,
        max_seq_length: args.max_seq_length,
        skip_bad_lines: args.skip_bad_lines,
        packing: args.packing,
    };
    let summary = prepare_sft(&opts, std::io::stderr().is_terminal())?;
    println!("{summary}");
    Ok(())
}

/// Writes `tokens` random tokens in documents of 4096.
fn random(args: &PrepareArgs, tokens: usize) -> Result<()> {
    let vocab = args.vocab_size.unwrap_or(0);
    if vocab < 2 || tokens == 0 {
        return Err(LlmError::Usage {
            flag: "--random-tokens/--vocab-size".into(),
            message: format!("need at least 1 token and a vocabulary of 2 (got {tokens}, {vocab})"),
        });
    }
    let eos = (vocab - 1) as u32;
    let mut writer = ShardWriter::new(&args.output, vocab, eos, args.shard_tokens)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    let mut document = Vec::with_capacity(4096);
    let mut left = tokens;
    while left > 0 {
        document.clear();
        document.extend((0..left.min(4096)).map(|_| rng.random_range(0..eos)));
        writer.push_document(&document)?;
        left -= document.len();
    }
    println!("{}", writer.finish(None)?);
    Ok(())
}
