//! `tilearn prepare-data`: tokenizer.json + text/JSON-lines files → token shards.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Args;
use tilearn_engine::data::{PrepareOptions, prepare_data};

use crate::Result;

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// Hugging Face `tokenizer.json` to tokenize with.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Input files: plain text (documents separated by blank lines) or JSON-lines
    /// (`.jsonl`/`.json`, one object per line with a string field, see --text-field).
    #[arg(long, required = true, num_args = 1..)]
    pub input: Vec<PathBuf>,
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
    let opts = PrepareOptions {
        tokenizer: args.tokenizer,
        inputs: args.input,
        output_dir: args.output,
        text_field: args.text_field,
        shard_tokens: args.shard_tokens,
    };
    let summary = prepare_data(&opts, std::io::stderr().is_terminal())?;
    println!("{summary}");
    Ok(())
}
