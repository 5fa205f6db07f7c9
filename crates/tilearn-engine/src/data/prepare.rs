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
use super::grammar::generate_corpus;
use super::writer::{PrepareSummary, ShardWriter};
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
    /// A Hugging Face `tokenizer.json` or a SentencePiece `tokenizer.model`.
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
    let eos_id = eos_id_of(&tokenizer, &opts.tokenizer, opts.eos_token.as_deref())?;
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
    disable_truncation_and_padding(&mut tokenizer, &opts.tokenizer)?;

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

/// Load a `tokenizer.json` (or a SentencePiece `tokenizer.model`, converted as transformers
/// does: see [`super::sentencepiece`]), with a [`EngineError::Tokenizer`] naming the file on
/// failure.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    if !path.is_file() {
        return Err(EngineError::Tokenizer {
            file: path.to_path_buf(),
            message: "file not found; pass the path of a Hugging Face tokenizer.json (or a \
                      SentencePiece tokenizer.model)"
                .into(),
        });
    }
    if super::sentencepiece::is_sentencepiece_model(path) {
        return super::sentencepiece::load_sentencepiece(path);
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

/// The EOS id: the token `--eos-token` names, else [`find_eos_id`]'s.
pub(crate) fn eos_id_of(
    tokenizer: &Tokenizer,
    tokenizer_path: &Path,
    eos_token: Option<&str>,
) -> Result<u32> {
    match eos_token {
        Some(text) => named_eos_id(tokenizer, tokenizer_path, text),
        None => find_eos_id(tokenizer, tokenizer_path),
    }
}

/// Encoding happens here; make sure a tokenizer.json with truncation or padding does not
/// silently cut or pad documents.
pub(crate) fn disable_truncation_and_padding(
    tokenizer: &mut Tokenizer,
    tokenizer_path: &Path,
) -> Result<()> {
    tokenizer
        .with_truncation(None)
        .map_err(|e| EngineError::Tokenizer {
            file: tokenizer_path.to_path_buf(),
            message: format!("cannot disable truncation: {e}"),
        })?;
    tokenizer.with_padding(None);
    Ok(())
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

/// The tokenizer of a model directory: its `tokenizer.json`, else its SentencePiece
/// `tokenizer.model` (Baichuan ships only that), else the `tokenizer.json` path (for the
/// caller's "not found" error).
pub fn tokenizer_in(dir: &Path) -> PathBuf {
    let json = dir.join(TOKENIZER_FILE);
    let model = dir.join("tokenizer.model");
    if !json.is_file() && model.is_file() {
        model
    } else {
        json
    }
}

/// Writes the tokenizer beside the prepared data as `tokenizer.json`: the file itself, or the
/// conversion of a SentencePiece model (so the data directory always has a fast tokenizer).
pub(crate) fn copy_tokenizer(source: &Path, output_dir: &Path) -> Result<()> {
    let dest = output_dir.join(TOKENIZER_FILE);
    if let (Ok(a), Ok(b)) = (fs::canonicalize(source), fs::canonicalize(&dest))
        && a == b
    {
        return Ok(());
    }
    let bytes = if super::sentencepiece::is_sentencepiece_model(source) {
        super::sentencepiece::load_sentencepiece(source)?
            .to_string(true)
            .map_err(|e| EngineError::Tokenizer {
                file: source.to_path_buf(),
                message: format!("cannot write the converted tokenizer: {e}"),
            })?
            .into_bytes()
    } else {
        fs::read(source).map_err(|e| EngineError::io(source, "read tokenizer", e))?
    };
    write_bytes_atomic(&dest, &bytes).map_err(|e| EngineError::io(&dest, "write tokenizer", e))
}

/// A bar over input bytes, or a hidden one.
pub(crate) fn progress_bar(enabled: bool, total_bytes: u64) -> ProgressBar {
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
