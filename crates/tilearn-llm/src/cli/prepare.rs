//! `tilearn prepare-data`: tokenizer.json + text/JSON-lines files → token shards, or
//! (`--random-tokens N --vocab-size V`) uniformly random tokens for throughput benchmarks.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Args;
use rand::{Rng, SeedableRng};
use tilearn_engine::data::{PrepareOptions, ShardWriter, prepare_data};

use crate::{LlmError, Result};

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// Hugging Face `tokenizer.json` to tokenize with.
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
