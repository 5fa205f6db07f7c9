//! `prepare-data --format sft`: supervised fine-tuning data from JSON lines.
//!
//! Every non-blank line is one example ([`super::sft_record`] lists the accepted forms),
//! tokenized with a per-token loss mask ([`super::sft_encode`]: only the response or the
//! assistant turns are trained, everything else gets label -100 when batched). The dataset is
//! written in the `examples` layout ([`super::format`], `meta.json` version 2): at training time
//! every example is its own row, truncated to the sequence length and padded with the pad id
//! (label -100).
//!
//! With `packing` (`--packing`, TRL's `packing=True`) the examples, truncated to
//! `max_seq_length`, are packed into rows of `max_seq_length` tokens by best-fit decreasing
//! ([`super::packing`]) and written in the `packed` layout (version 3): at training time each
//! example's position ids restart at 0, the attention kernels keep every query inside its own
//! example, and its first label is -100 (the previous example's last token predicts nothing
//! across the boundary), so a packed row trains exactly like its examples one by one, with far
//! less padding. Packing holds the tokenized examples in memory until all are read.
//!
//! * Pad id: the `pad_token` of the `tokenizer_config.json` beside the tokenizer, else the EOS
//!   id (what most Llama fine-tuning recipes set, `tokenizer.pad_token = tokenizer.eos_token`).
//!   Its value never matters for the loss: padding follows the example, so causal attention
//!   keeps it out of every real token's computation, and its labels are -100.
//! * `max_seq_length` (`--max-seq-length`) truncates examples here and is recorded in
//!   `meta.json`; without it they are stored whole and truncated to the training `--seq-len`
//!   when batched (the trainer warns with the count).
//! * A bad line (not JSON, missing fields, a template that fails or raises) stops the run with
//!   an error naming the file, the line and the fix, unless `skip_bad_lines`, which counts
//!   them and reports the first few.

use std::fmt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use tokenizers::Tokenizer;

use super::chat_template::{ChatTemplate, TOKENIZER_CONFIG_FILE, special_token_text};
use super::documents::read_utf8;
use super::packing::best_fit_decreasing;
use super::prepare::{
    DEFAULT_SHARD_TOKENS, TOKENIZER_FILE, copy_tokenizer, disable_truncation_and_padding,
    eos_id_of, load_tokenizer, progress_bar, vocab_size_of,
};
use super::sft_encode::{MaskedTokens, SftEncoder};
use super::sft_record::{SftRecord, parse_record};
use super::writer::{PrepareSummary, ShardWriter};
use crate::error::{EngineError, Result};

/// Lines encoded per parallel batch.
const ENCODE_CHUNK: usize = 2048;
/// Bad lines quoted in the summary when they are skipped.
const QUOTED_BAD_LINES: usize = 5;

/// What `prepare_sft` reads and writes.
#[derive(Debug, Clone)]
pub struct SftOptions {
    /// A Hugging Face `tokenizer.json`; its directory's `tokenizer_config.json` supplies the
    /// chat template, special tokens and pad token.
    pub tokenizer: PathBuf,
    /// JSON-lines files.
    pub inputs: Vec<PathBuf>,
    /// Directory that receives the shards, loss masks, `meta.json` and the tokenizer.
    pub output_dir: PathBuf,
    /// Tokens per shard.
    pub shard_tokens: usize,
    /// The end-of-sequence token's text (`--eos-token`); `None` finds it.
    pub eos_token: Option<String>,
    /// Truncate every example to this many tokens (`--max-seq-length`).
    pub max_seq_length: Option<usize>,
    /// Skip (and count) bad lines instead of stopping at the first (`--skip-bad-lines`).
    pub skip_bad_lines: bool,
    /// Pack the examples into rows of `max_seq_length` tokens (`--packing`).
    pub packing: bool,
}

impl SftOptions {
    /// Options with [`DEFAULT_SHARD_TOKENS`], no truncation, stopping at a bad line.
    pub fn new(tokenizer: PathBuf, inputs: Vec<PathBuf>, output_dir: PathBuf) -> Self {
        SftOptions {
            tokenizer,
            inputs,
            output_dir,
            shard_tokens: DEFAULT_SHARD_TOKENS,
            eos_token: None,
            max_seq_length: None,
            skip_bad_lines: false,
            packing: false,
        }
    }
}

/// A line that was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadLine {
    pub file: PathBuf,
    /// 1-based.
    pub line: usize,
    pub message: String,
}

impl fmt::Display for BadLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} line {}: {}",
            self.file.display(),
            self.line,
            self.message
        )
    }
}

/// What a `prepare_sft` run wrote and met.
#[derive(Debug, Clone)]
pub struct SftSummary {
    pub data: PrepareSummary,
    /// The id rows are padded with, and where it came from.
    pub pad_id: u32,
    pub pad_source: &'static str,
    /// The `tokenizer_config.json` whose chat template rendered `messages` lines, if any.
    pub template: Option<PathBuf>,
    /// Tokens trained on (response and assistant tokens, after truncation).
    pub trained_tokens: u64,
    /// Bad lines skipped (only with `skip_bad_lines`), and the first few of them.
    pub num_skipped: u64,
    pub skipped: Vec<BadLine>,
    /// Examples cut by `max_seq_length`, and those of them left with no trained token.
    pub truncated: u64,
    pub truncated_to_nothing: u64,
    /// With packing: the rows written and the share of their tokens that are examples' (the
    /// rest is padding).
    pub packed_rows: Option<(u64, f64)>,
}

impl fmt::Display for SftSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}; {} trained tokens, pad id {} ({})",
            self.data, self.trained_tokens, self.pad_id, self.pad_source
        )?;
        if let Some(t) = &self.template {
            write!(f, "; chat template from {}", t.display())?;
        }
        if let Some((rows, fill)) = self.packed_rows {
            write!(
                f,
                "; packed into {rows} rows ({:.1}% of their tokens are examples, the rest \
                 padding)",
                100.0 * fill
            )?;
        }
        if self.truncated > 0 {
            write!(
                f,
                "\nwarning: {} example(s) were longer than --max-seq-length and were truncated \
                 ({} of them lost every trained token and add nothing to the loss)",
                self.truncated, self.truncated_to_nothing
            )?;
        }
        if self.num_skipped > 0 {
            write!(f, "\nskipped {} bad line(s):", self.num_skipped)?;
            for bad in &self.skipped {
                write!(f, "\n  {bad}")?;
            }
            if self.num_skipped > self.skipped.len() as u64 {
                write!(f, "\n  …")?;
            }
        }
        Ok(())
    }
}

/// Tokenize the JSON-lines `opts.inputs` into an `examples` dataset in `opts.output_dir`.
pub fn prepare_sft(opts: &SftOptions, progress: bool) -> Result<SftSummary> {
    if opts.inputs.is_empty() {
        return Err(EngineError::InvalidArgument {
            argument: "--input".into(),
            message: "no input files given; pass .jsonl files".into(),
        });
    }
    if opts.max_seq_length == Some(0) {
        return Err(EngineError::InvalidArgument {
            argument: "--max-seq-length".into(),
            message: "must be at least 1".into(),
        });
    }
    if opts.packing && opts.max_seq_length.is_none() {
        return Err(EngineError::InvalidArgument {
            argument: "--packing".into(),
            message: "needs --max-seq-length N, the length of the packed rows (pass the \
                      training --seq-len)"
                .into(),
        });
    }
    let mut tokenizer = load_tokenizer(&opts.tokenizer)?;
    let eos_id = eos_id_of(&tokenizer, &opts.tokenizer, opts.eos_token.as_deref())?;
    let (pad_id, pad_source) = pad_id_of(&tokenizer, &opts.tokenizer, eos_id);
    disable_truncation_and_padding(&mut tokenizer, &opts.tokenizer)?;
    let template = ChatTemplate::beside(&opts.tokenizer)?;
    let config_path = opts
        .tokenizer
        .parent()
        .unwrap_or(Path::new("."))
        .join(TOKENIZER_CONFIG_FILE);
    let hint = format!(
        "a `messages` line needs the model's chat template, but {} has no `chat_template` (or \
         does not exist); copy the model's tokenizer_config.json beside the tokenizer, or write \
         prompt/response lines",
        config_path.display()
    );
    let encoder = SftEncoder {
        tokenizer: &tokenizer,
        template: template.as_ref(),
        eos_id,
        missing_template_hint: &hint,
    };

    let mut sizes = 0u64;
    for input in &opts.inputs {
        let meta =
            std::fs::metadata(input).map_err(|e| EngineError::io(input, "read input file", e))?;
        if !meta.is_file() {
            return Err(EngineError::Data {
                file: input.clone(),
                message: "is not a file; pass .jsonl files".into(),
            });
        }
        sizes += meta.len();
    }
    let bar = progress_bar(progress, sizes);
    let mut writer = match (opts.packing, opts.max_seq_length) {
        (true, Some(row_len)) => ShardWriter::for_packed_examples(
            &opts.output_dir,
            vocab_size_of(&tokenizer),
            eos_id,
            pad_id,
            row_len,
            opts.shard_tokens,
        )?,
        _ => ShardWriter::for_examples(
            &opts.output_dir,
            vocab_size_of(&tokenizer),
            eos_id,
            pad_id,
            opts.max_seq_length,
            opts.shard_tokens,
        )?,
    };
    copy_tokenizer(&opts.tokenizer, &opts.output_dir)?;
    let mut run = Run {
        pending: opts.packing.then(Vec::new),
        ..Run::default()
    };
    for input in &opts.inputs {
        bar.set_message(format!("{}", input.display()));
        let content = read_utf8(input)?;
        let lines: Vec<(usize, &str)> = content
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim()))
            .filter(|(_, l)| !l.is_empty())
            .collect();
        for chunk in lines.chunks(ENCODE_CHUNK) {
            let encoded: Vec<std::result::Result<(MaskedTokens, bool), String>> = chunk
                .par_iter()
                .map(|(_, line)| {
                    let record = parse_record(line)?;
                    let is_chat = matches!(record, SftRecord::Chat(_));
                    encoder.encode(&record).map(|tokens| (tokens, is_chat))
                })
                .collect();
            for (&(line_no, line), result) in chunk.iter().zip(encoded) {
                match result {
                    Ok((tokens, is_chat)) => {
                        run.chats += u64::from(is_chat);
                        run.keep(&mut writer, tokens, opts.max_seq_length)?
                    }
                    Err(message) if opts.skip_bad_lines => run.skip(BadLine {
                        file: input.clone(),
                        line: line_no,
                        message,
                    }),
                    Err(message) => {
                        return Err(EngineError::Data {
                            file: input.clone(),
                            message: format!(
                                "line {line_no}: {message} (pass --skip-bad-lines to skip and \
                                 count such lines)"
                            ),
                        });
                    }
                }
                bar.inc(line.len() as u64 + 1);
            }
        }
    }
    let packed_rows = match (run.pending.take(), opts.max_seq_length) {
        (Some(examples), Some(row_len)) => Some(write_packed(&mut writer, &examples, row_len)?),
        _ => None,
    };
    if writer.num_documents() == 0 {
        return Err(EngineError::Data {
            file: opts.inputs[0].clone(),
            message: format!(
                "no examples found in the {} input file(s) ({} bad line(s) skipped); nothing \
                 to write",
                opts.inputs.len(),
                run.num_skipped
            ),
        });
    }
    let data = writer.finish(Some(TOKENIZER_FILE.to_string()))?;
    bar.finish_with_message(format!("{} examples", data.num_documents));
    Ok(SftSummary {
        data,
        pad_id,
        pad_source,
        template: template
            .filter(|_| run.chats > 0)
            .map(|t| t.source().to_path_buf()),
        trained_tokens: run.trained_tokens,
        num_skipped: run.num_skipped,
        skipped: run.skipped,
        truncated: run.truncated,
        truncated_to_nothing: run.truncated_to_nothing,
        packed_rows,
    })
}

/// Packs `examples` (each at most `row_len` tokens) into rows and writes them; returns the
/// number of rows and the share of their tokens that are examples'.
fn write_packed(
    writer: &mut ShardWriter,
    examples: &[MaskedTokens],
    row_len: usize,
) -> Result<(u64, f64)> {
    let lengths: Vec<usize> = examples.iter().map(|e| e.ids.len()).collect();
    let rows =
        best_fit_decreasing(&lengths, row_len).ok_or_else(|| EngineError::InvalidArgument {
            argument: "--packing".into(),
            message: format!("an example is empty or longer than the row length {row_len}"),
        })?;
    for row in &rows {
        let parts: Vec<(&[u32], &[bool])> = row
            .iter()
            .map(|&e| (examples[e].ids.as_slice(), examples[e].trained.as_slice()))
            .collect();
        writer.push_packed_row(&parts)?;
    }
    let tokens: usize = lengths.iter().sum();
    let fill = tokens as f64 / (rows.len().max(1) * row_len) as f64;
    Ok((rows.len() as u64, fill))
}

/// Counts of one prepare run.
#[derive(Debug, Default)]
struct Run {
    /// Examples from `messages` lines (rendered by the template).
    chats: u64,
    trained_tokens: u64,
    num_skipped: u64,
    skipped: Vec<BadLine>,
    truncated: u64,
    truncated_to_nothing: u64,
    /// With packing: the examples kept so far, packed and written once all are read.
    pending: Option<Vec<MaskedTokens>>,
}

impl Run {
    fn keep(
        &mut self,
        writer: &mut ShardWriter,
        mut tokens: MaskedTokens,
        max_seq_length: Option<usize>,
    ) -> Result<()> {
        if let Some(max) = max_seq_length
            && tokens.truncate(max)
        {
            self.truncated += 1;
            // The first token of a row is never a target (nothing predicts it).
            if !tokens.trained.iter().skip(1).any(|&t| t) {
                self.truncated_to_nothing += 1;
            }
        }
        self.trained_tokens += tokens.num_trained() as u64;
        match &mut self.pending {
            Some(pending) => {
                pending.push(tokens);
                Ok(())
            }
            None => writer.push_example(&tokens.ids, &tokens.trained),
        }
    }

    fn skip(&mut self, bad: BadLine) {
        self.num_skipped += 1;
        if self.skipped.len() < QUOTED_BAD_LINES {
            self.skipped.push(bad);
        }
    }
}

/// The pad id: `tokenizer_config.json`'s `pad_token` when it is in the vocabulary, else the
/// EOS id; and which of the two it is.
fn pad_id_of(tokenizer: &Tokenizer, tokenizer_path: &Path, eos_id: u32) -> (u32, &'static str) {
    let configured = tokenizer_path
        .parent()
        .map(|d| d.join(TOKENIZER_CONFIG_FILE))
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .map(|config| special_token_text(config.get("pad_token")))
        .filter(|name| !name.is_empty())
        .and_then(|name| tokenizer.token_to_id(&name));
    match configured {
        Some(id) => (id, "the pad_token of tokenizer_config.json"),
        None => (eos_id, "the EOS token; the tokenizer names no pad_token"),
    }
}
