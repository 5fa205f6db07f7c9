//! `prepare-data`: tokenize text or JSON-lines files into token shards.
//!
//! Every document is encoded without special tokens (no BOS; Llama-style templates are not
//! applied) and followed by one EOS id, then the token stream is cut into shards of
//! `shard_tokens` tokens (a document may span two shards; the loader reads the stream as one).
//! All files are written atomically; `meta.json` is removed first and written last, so a run
//! that fails halfway never leaves a directory that looks complete.

use std::fs;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use rayon::prelude::*;
use tilearn_ops::fs::write_bytes_atomic;
use tokenizers::Tokenizer;

use super::byte_tokenizer::{BYTE_EOS_ID, BYTE_VOCAB_SIZE, byte_level_tokenizer};
use super::documents::{InputKind, read_utf8, split_documents};
use super::format::{
    DatasetMeta, META_FILE, META_FORMAT, META_VERSION, ShardMeta, shard_file_name,
    token_width_for_vocab, write_shard,
};
use super::grammar::generate_corpus;
use crate::error::{EngineError, Result};

/// Default shard size: 64 Mi tokens (128 MiB at 2 bytes per token).
pub const DEFAULT_SHARD_TOKENS: usize = 64 * 1024 * 1024;
/// File name of the tokenizer copied into a dataset directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// End-of-sequence tokens looked for, in this order, when `tokenizer_config.json` does not name
/// one.
pub const EOS_CANDIDATES: &[&str] = &[
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<|eos|>",
    "[EOS]",
];

/// Documents encoded per parallel batch.
const ENCODE_CHUNK: usize = 4096;

/// What `prepare_data` reads and writes.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// A Hugging Face `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// Text or JSON-lines files (see [`super::documents`] for how documents are found).
    pub inputs: Vec<PathBuf>,
    /// Directory that receives the shards, `meta.json` and a copy of the tokenizer.
    pub output_dir: PathBuf,
    /// Field of a JSON-lines object holding the text (normally `text`).
    pub text_field: String,
    /// Tokens per shard.
    pub shard_tokens: usize,
    /// The end-of-sequence token's text (`--eos-token`), for tokenizers that name none;
    /// `None` finds it (see [`find_eos_id`]).
    pub eos_token: Option<String>,
}

impl PrepareOptions {
    /// Options with `text_field = "text"` and [`DEFAULT_SHARD_TOKENS`].
    pub fn new(tokenizer: PathBuf, inputs: Vec<PathBuf>, output_dir: PathBuf) -> Self {
        PrepareOptions {
            tokenizer,
            inputs,
            output_dir,
            text_field: "text".to_string(),
            shard_tokens: DEFAULT_SHARD_TOKENS,
            eos_token: None,
        }
    }
}

/// What a prepare run wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareSummary {
    pub output_dir: PathBuf,
    pub num_documents: u64,
    pub num_tokens: u64,
    pub shards: Vec<ShardMeta>,
    pub vocab_size: usize,
    pub eos_id: u32,
    /// Bytes per token in the shards (2 or 4).
    pub token_width: u32,
}

impl std::fmt::Display for PrepareSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "wrote {} tokens ({} documents) in {} shard(s) to {} (vocab {}, eos id {}, {}-byte \
             tokens)",
            self.num_tokens,
            self.num_documents,
            self.shards.len(),
            self.output_dir.display(),
            self.vocab_size,
            self.eos_id,
            self.token_width
        )
    }
}

/// Tokenize `opts.inputs` with `opts.tokenizer` into shards in `opts.output_dir`.
pub fn prepare_data(opts: &PrepareOptions, progress: bool) -> Result<PrepareSummary> {
    if opts.inputs.is_empty() {
        return Err(EngineError::InvalidArgument {
            argument: "inputs".into(),
            message: "no input files given; pass text or .jsonl files".into(),
        });
    }
    if opts.text_field.is_empty() {
        return Err(EngineError::InvalidArgument {
            argument: "--text-field".into(),
            message: "must not be empty".into(),
        });
    }
    let mut tokenizer = load_tokenizer(&opts.tokenizer)?;
    let eos_id = match &opts.eos_token {
        Some(text) => named_eos_id(&tokenizer, &opts.tokenizer, text)?,
        None => find_eos_id(&tokenizer, &opts.tokenizer)?,
    };
    let vocab_size = vocab_size_of(&tokenizer);

    let mut sizes = Vec::with_capacity(opts.inputs.len());
    for input in &opts.inputs {
        let meta = fs::metadata(input).map_err(|e| EngineError::io(input, "read input file", e))?;
        if !meta.is_file() {
            return Err(EngineError::Data {
                file: input.clone(),
                message: "is not a file; pass text or .jsonl files".into(),
            });
        }
        sizes.push(meta.len());
    }

    let bar = progress_bar(progress, sizes.iter().sum());
    let mut writer = ShardWriter::new(&opts.output_dir, vocab_size, eos_id, opts.shard_tokens)?;
    copy_tokenizer(&opts.tokenizer, &opts.output_dir)?;
    // Encoding happens inside; make sure a tokenizer.json with truncation or padding does not
    // silently cut or pad documents.
    tokenizer
        .with_truncation(None)
        .map_err(|e| EngineError::Tokenizer {
            file: opts.tokenizer.clone(),
            message: format!("cannot disable truncation: {e}"),
        })?;
    tokenizer.with_padding(None);

    let mut done_bytes = 0u64;
    for (input, size) in opts.inputs.iter().zip(&sizes) {
        bar.set_message(format!("{}", input.display()));
        let content = read_utf8(input)?;
        let docs = split_documents(input, &content, InputKind::of(input), &opts.text_field)?;
        drop(content);
        encode_into(&mut writer, &tokenizer, &opts.tokenizer, &docs, &bar)?;
        done_bytes += size;
        bar.set_position(done_bytes);
    }
    if writer.num_documents() == 0 {
        return Err(EngineError::Data {
            file: opts.inputs[0].clone(),
            message: format!(
                "no documents found in the {} input file(s) (empty, blank or only empty `{}` \
                 fields); nothing to write",
                opts.inputs.len(),
                opts.text_field
            ),
        });
    }
    let summary = writer.finish(Some(TOKENIZER_FILE.to_string()))?;
    bar.finish_with_message(format!(
        "{} documents, {} tokens, {} shard(s)",
        summary.num_documents,
        summary.num_tokens,
        summary.shards.len()
    ));
    Ok(summary)
}

/// Write the embedded default dataset: the grammar corpus of `num_documents` documents from
/// `seed`, tokenized by the byte-level tokenizer, which is saved as `output_dir/tokenizer.json`.
pub fn prepare_embedded_default(
    output_dir: &Path,
    seed: u64,
    num_documents: usize,
) -> Result<PrepareSummary> {
    if num_documents == 0 {
        return Err(EngineError::InvalidArgument {
            argument: "num_documents".into(),
            message: "must be at least 1".into(),
        });
    }
    let mut writer = ShardWriter::new(
        output_dir,
        BYTE_VOCAB_SIZE,
        BYTE_EOS_ID,
        DEFAULT_SHARD_TOKENS,
    )?;
    let tokenizer = byte_level_tokenizer();
    let tokenizer_path = output_dir.join(TOKENIZER_FILE);
    let json = tokenizer
        .to_string(true)
        .map_err(|e| EngineError::Tokenizer {
            file: tokenizer_path.clone(),
            message: format!("cannot serialize the byte-level tokenizer: {e}"),
        })?;
    write_bytes_atomic(&tokenizer_path, json.as_bytes())
        .map_err(|e| EngineError::io(&tokenizer_path, "write tokenizer", e))?;
    let docs = generate_corpus(seed, num_documents);
    encode_into(
        &mut writer,
        &tokenizer,
        &tokenizer_path,
        &docs,
        &ProgressBar::hidden(),
    )?;
    writer.finish(Some(TOKENIZER_FILE.to_string()))
}

/// Load a `tokenizer.json`, with a [`EngineError::Tokenizer`] naming the file on failure.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    if !path.is_file() {
        return Err(EngineError::Tokenizer {
            file: path.to_path_buf(),
            message: "file not found; pass the path of a Hugging Face tokenizer.json".into(),
        });
    }
    Tokenizer::from_file(path).map_err(|e| EngineError::Tokenizer {
        file: path.to_path_buf(),
        message: format!("cannot load: {e}"),
    })
}

/// The number of ids of `tokenizer` including added tokens: one more than the largest id.
pub fn vocab_size_of(tokenizer: &Tokenizer) -> usize {
    let max_id = tokenizer.get_vocab(true).into_values().max();
    let by_max = max_id.map_or(0, |m| m as usize + 1);
    by_max.max(tokenizer.get_vocab_size(true))
}

/// The end-of-sequence id of `tokenizer`: the `eos_token` of a `tokenizer_config.json` next to
/// `tokenizer_path` if there is one, else the first of [`EOS_CANDIDATES`] that is a special
/// token, else the first that is in the vocabulary at all.
pub fn find_eos_id(tokenizer: &Tokenizer, tokenizer_path: &Path) -> Result<u32> {
    if let Some(name) = eos_from_tokenizer_config(tokenizer_path)
        && let Some(id) = tokenizer.token_to_id(&name)
    {
        return Ok(id);
    }
    let specials = tokenizer.get_added_tokens_decoder();
    for candidate in EOS_CANDIDATES {
        if let Some((&id, _)) = specials
            .iter()
            .find(|(_, tok)| tok.special && tok.content == *candidate)
        {
            return Ok(id);
        }
    }
    for candidate in EOS_CANDIDATES {
        if let Some(id) = tokenizer.token_to_id(candidate) {
            return Ok(id);
        }
    }
    Err(EngineError::Tokenizer {
        file: tokenizer_path.to_path_buf(),
        message: format!(
            "no end-of-sequence token: none of {} is in the vocabulary and no \
             tokenizer_config.json beside it names an `eos_token`; name one with --eos-token \
             TEXT, or add one as a special token",
            EOS_CANDIDATES.join(", ")
        ),
    })
}

/// The id of the token `text` (`--eos-token`), which must be in the vocabulary.
fn named_eos_id(tokenizer: &Tokenizer, tokenizer_path: &Path, text: &str) -> Result<u32> {
    tokenizer
        .token_to_id(text)
        .ok_or_else(|| EngineError::InvalidArgument {
            argument: "--eos-token".into(),
            message: format!(
                "{text:?} is not a token of {} (give the token's text exactly as the \
                 vocabulary spells it, e.g. </s> or <|endoftext|>)",
                tokenizer_path.display()
            ),
        })
}

fn eos_from_tokenizer_config(tokenizer_path: &Path) -> Option<String> {
    let config = tokenizer_path.parent()?.join("tokenizer_config.json");
    let text = fs::read_to_string(config).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    match value.get("eos_token")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

fn copy_tokenizer(source: &Path, output_dir: &Path) -> Result<()> {
    let dest = output_dir.join(TOKENIZER_FILE);
    if let (Ok(a), Ok(b)) = (fs::canonicalize(source), fs::canonicalize(&dest))
        && a == b
    {
        return Ok(());
    }
    let bytes = fs::read(source).map_err(|e| EngineError::io(source, "read tokenizer", e))?;
    write_bytes_atomic(&dest, &bytes).map_err(|e| EngineError::io(&dest, "write tokenizer", e))
}

/// A bar over input bytes, or a hidden one.
fn progress_bar(enabled: bool, total_bytes: u64) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let template = "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({eta}) {msg}";
    let style =
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::new(total_bytes).with_style(style)
}

/// Encode `docs` in parallel and append them (each followed by EOS) to `writer`.
fn encode_into(
    writer: &mut ShardWriter,
    tokenizer: &Tokenizer,
    tokenizer_path: &Path,
    docs: &[String],
    bar: &ProgressBar,
) -> Result<()> {
    for chunk in docs.chunks(ENCODE_CHUNK) {
        let encoded: Vec<Vec<u32>> = chunk
            .par_iter()
            .map(|doc| {
                tokenizer
                    .encode_fast(doc.as_str(), false)
                    .map(|e| e.get_ids().to_vec())
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| EngineError::Tokenizer {
                file: tokenizer_path.to_path_buf(),
                message: format!("encoding failed: {e}"),
            })?;
        for ids in &encoded {
            writer.push_document(ids)?;
        }
        bar.inc(chunk.iter().map(|d| d.len() as u64).sum());
    }
    Ok(())
}

/// Streams documents into shard files and writes `meta.json` at the end.
///
/// Public so that tools and tests can write a dataset from token ids directly.
#[derive(Debug)]
pub struct ShardWriter {
    dir: PathBuf,
    vocab_size: usize,
    eos_id: u32,
    width: u32,
    shard_tokens: usize,
    buffer: Vec<u32>,
    shards: Vec<ShardMeta>,
    num_tokens: u64,
    num_documents: u64,
}

impl ShardWriter {
    /// Start a dataset in `dir` (created if needed; an existing `meta.json` is removed).
    pub fn new(dir: &Path, vocab_size: usize, eos_id: u32, shard_tokens: usize) -> Result<Self> {
        if shard_tokens == 0 {
            return Err(EngineError::InvalidArgument {
                argument: "--shard-tokens".into(),
                message: "must be at least 1".into(),
            });
        }
        if eos_id as usize >= vocab_size {
            return Err(EngineError::InvalidArgument {
                argument: "eos_id".into(),
                message: format!("EOS id {eos_id} is not below the vocabulary size {vocab_size}"),
            });
        }
        if vocab_size > u32::MAX as usize {
            return Err(EngineError::InvalidArgument {
                argument: "vocab_size".into(),
                message: format!("{vocab_size} ids do not fit in 32-bit token ids"),
            });
        }
        fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, "create output directory", e))?;
        let meta = dir.join(META_FILE);
        match fs::remove_file(&meta) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(EngineError::io(meta, "remove old meta.json", e)),
        }
        Ok(ShardWriter {
            dir: dir.to_path_buf(),
            vocab_size,
            eos_id,
            width: token_width_for_vocab(vocab_size),
            shard_tokens,
            buffer: Vec::new(),
            shards: Vec::new(),
            num_tokens: 0,
            num_documents: 0,
        })
    }

    /// Documents pushed so far.
    pub fn num_documents(&self) -> u64 {
        self.num_documents
    }

    /// Append one document's tokens followed by the EOS id.
    pub fn push_document(&mut self, tokens: &[u32]) -> Result<()> {
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(EngineError::InvalidArgument {
                argument: "tokens".into(),
                message: format!(
                    "token id {bad} is not below the vocabulary size {}",
                    self.vocab_size
                ),
            });
        }
        self.buffer.extend_from_slice(tokens);
        self.buffer.push(self.eos_id);
        self.num_documents += 1;
        self.num_tokens += tokens.len() as u64 + 1;
        while self.buffer.len() >= self.shard_tokens {
            self.write_next_shard(self.shard_tokens)?;
        }
        Ok(())
    }

    fn write_next_shard(&mut self, n: usize) -> Result<()> {
        let name = shard_file_name(self.shards.len());
        write_shard(&self.dir.join(&name), &self.buffer[..n], self.width)?;
        self.buffer.drain(..n);
        self.shards.push(ShardMeta {
            file: name,
            num_tokens: n as u64,
        });
        Ok(())
    }

    /// Write the last shard and `meta.json`; remove shard files of an earlier run that are not
    /// part of this dataset. `tokenizer` is the tokenizer's file name inside the directory.
    pub fn finish(mut self, tokenizer: Option<String>) -> Result<PrepareSummary> {
        if self.num_tokens == 0 {
            return Err(EngineError::Data {
                file: self.dir.clone(),
                message: "no documents were written; nothing to save".into(),
            });
        }
        if !self.buffer.is_empty() {
            self.write_next_shard(self.buffer.len())?;
        }
        let meta = DatasetMeta {
            format: META_FORMAT.to_string(),
            version: META_VERSION,
            vocab_size: self.vocab_size,
            eos_id: self.eos_id,
            token_width: self.width,
            num_tokens: self.num_tokens,
            num_documents: self.num_documents,
            shards: self.shards.clone(),
            tokenizer,
        };
        let json = serde_json::to_string_pretty(&meta).expect("DatasetMeta serializes");
        let meta_path = self.dir.join(META_FILE);
        write_bytes_atomic(&meta_path, json.as_bytes())
            .map_err(|e| EngineError::io(&meta_path, "write dataset metadata", e))?;
        self.remove_stale_shards();
        Ok(PrepareSummary {
            output_dir: self.dir,
            num_documents: meta.num_documents,
            num_tokens: meta.num_tokens,
            shards: meta.shards,
            vocab_size: meta.vocab_size,
            eos_id: meta.eos_id,
            token_width: meta.token_width,
        })
    }

    /// Best effort: shards left by an earlier, larger run would only confuse people.
    fn remove_stale_shards(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let is_shard = name.starts_with("shard-") && name.ends_with(".bin");
            if is_shard && !self.shards.iter().any(|s| s.file == name) {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}
