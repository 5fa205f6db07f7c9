//! [`ShardWriter`]: streams documents (pretraining) or masked examples (supervised
//! fine-tuning) into shard files and writes `meta.json` last.

use std::fs;
use std::path::{Path, PathBuf};

use tilearn_ops::fs::write_bytes_atomic;

use super::format::{
    DatasetMeta, MASK_EXAMPLE_START, MASK_ROW_START, MASK_TRAINED, META_FILE, META_FORMAT,
    META_VERSION, META_VERSION_EXAMPLES, META_VERSION_STREAM, RowLayout, ShardMeta, mask_file_name,
    shard_file_name, token_width_for_vocab, write_mask_shard, write_shard,
};
use crate::error::{EngineError, Result};

/// What a prepare run wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareSummary {
    pub output_dir: PathBuf,
    /// Documents (stream layout) or examples (examples layout).
    pub num_documents: u64,
    pub num_tokens: u64,
    pub shards: Vec<ShardMeta>,
    pub vocab_size: usize,
    pub eos_id: u32,
    /// Bytes per token in the shards (2 or 4).
    pub token_width: u32,
    /// How the data becomes training rows.
    pub layout: RowLayout,
}

impl std::fmt::Display for PrepareSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let unit = match self.layout {
            RowLayout::Stream => "documents",
            RowLayout::Examples => "examples, each one training row",
            RowLayout::Packed => "examples, packed into training rows",
        };
        write!(
            f,
            "wrote {} tokens ({} {unit}) in {} shard(s) to {} (vocab {}, eos id {}, {}-byte \
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

/// The loss masks of an `examples` dataset being written.
#[derive(Debug)]
struct MaskBuffer {
    pad_id: u32,
    max_seq_length: Option<usize>,
    /// Whether rows are packed (`packed` layout: [`ShardWriter::push_packed_row`]).
    packed: bool,
    /// One byte per token of the writer's token buffer (see [`super::format`]).
    bytes: Vec<u8>,
    files: Vec<ShardMeta>,
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
    masks: Option<MaskBuffer>,
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
            masks: None,
        })
    }

    /// Start a supervised fine-tuning dataset (the `examples` layout): every
    /// [`Self::push_example`] becomes one training row, padded with `pad_id`;
    /// `max_seq_length` is recorded when the examples were truncated to it.
    pub fn for_examples(
        dir: &Path,
        vocab_size: usize,
        eos_id: u32,
        pad_id: u32,
        max_seq_length: Option<usize>,
        shard_tokens: usize,
    ) -> Result<Self> {
        if pad_id as usize >= vocab_size {
            return Err(EngineError::InvalidArgument {
                argument: "pad_id".into(),
                message: format!("pad id {pad_id} is not below the vocabulary size {vocab_size}"),
            });
        }
        let mut writer = Self::new(dir, vocab_size, eos_id, shard_tokens)?;
        writer.masks = Some(MaskBuffer {
            pad_id,
            max_seq_length,
            packed: false,
            bytes: Vec::new(),
            files: Vec::new(),
        });
        Ok(writer)
    }

    /// Start a packed fine-tuning dataset (the `packed` layout): every
    /// [`Self::push_packed_row`] becomes one training row of at most `row_len` tokens, holding
    /// whole examples.
    pub fn for_packed_examples(
        dir: &Path,
        vocab_size: usize,
        eos_id: u32,
        pad_id: u32,
        row_len: usize,
        shard_tokens: usize,
    ) -> Result<Self> {
        let mut writer =
            Self::for_examples(dir, vocab_size, eos_id, pad_id, Some(row_len), shard_tokens)?;
        if let Some(m) = writer.masks.as_mut() {
            m.packed = true;
        }
        Ok(writer)
    }

    /// Documents (or examples) pushed so far.
    pub fn num_documents(&self) -> u64 {
        self.num_documents
    }

    fn check_ids(&self, tokens: &[u32]) -> Result<()> {
        match tokens.iter().find(|&&t| t as usize >= self.vocab_size) {
            Some(&bad) => Err(EngineError::InvalidArgument {
                argument: "tokens".into(),
                message: format!(
                    "token id {bad} is not below the vocabulary size {}",
                    self.vocab_size
                ),
            }),
            None => Ok(()),
        }
    }

    /// Append one document's tokens followed by the EOS id (stream layout).
    pub fn push_document(&mut self, tokens: &[u32]) -> Result<()> {
        if self.masks.is_some() {
            return Err(EngineError::InvalidArgument {
                argument: "push_document".into(),
                message: "this writer holds examples; use push_example".into(),
            });
        }
        self.check_ids(tokens)?;
        self.buffer.extend_from_slice(tokens);
        self.buffer.push(self.eos_id);
        self.num_documents += 1;
        self.num_tokens += tokens.len() as u64 + 1;
        self.flush_full_shards()
    }

    /// Append one example (examples layout): its tokens as they are (no EOS is added: the
    /// caller's tokens end as the example should) and, per token, whether it is a training
    /// target.
    pub fn push_example(&mut self, tokens: &[u32], trained: &[bool]) -> Result<()> {
        if self.masks.as_ref().is_some_and(|m| m.packed) {
            return Err(EngineError::InvalidArgument {
                argument: "push_example".into(),
                message: "this writer packs rows; use push_packed_row".into(),
            });
        }
        self.push_masked(tokens, trained, false)
    }

    /// Append one packed row (packed layout): its examples in order, each `(tokens, trained)`,
    /// together at most the row length given to [`Self::for_packed_examples`].
    pub fn push_packed_row(&mut self, examples: &[(&[u32], &[bool])]) -> Result<()> {
        let Some(m) = self.masks.as_ref().filter(|m| m.packed) else {
            return Err(EngineError::InvalidArgument {
                argument: "push_packed_row".into(),
                message: "this writer does not pack rows; start it with \
                          ShardWriter::for_packed_examples"
                    .into(),
            });
        };
        let len: usize = examples.iter().map(|(t, _)| t.len()).sum();
        let row_len = m.max_seq_length.unwrap_or(usize::MAX);
        if examples.is_empty() || len > row_len {
            return Err(EngineError::InvalidArgument {
                argument: "push_packed_row".into(),
                message: format!(
                    "a packed row needs at least one example and at most {row_len} tokens (got \
                     {} examples, {len} tokens)",
                    examples.len()
                ),
            });
        }
        for (i, (tokens, trained)) in examples.iter().enumerate() {
            self.push_masked(tokens, trained, i == 0)?;
        }
        Ok(())
    }

    /// One example into the token and mask buffers; `starts_row` marks a packed row's first.
    fn push_masked(&mut self, tokens: &[u32], trained: &[bool], starts_row: bool) -> Result<()> {
        let Some(masks) = &self.masks else {
            return Err(EngineError::InvalidArgument {
                argument: "push_example".into(),
                message: "this writer holds a token stream; start it with \
                          ShardWriter::for_examples"
                    .into(),
            });
        };
        if tokens.is_empty() || tokens.len() != trained.len() {
            return Err(EngineError::InvalidArgument {
                argument: "push_example".into(),
                message: format!(
                    "an example needs at least one token and one mask flag per token (got {} \
                     tokens, {} flags)",
                    tokens.len(),
                    trained.len()
                ),
            });
        }
        debug_assert_eq!(masks.bytes.len(), self.buffer.len());
        self.check_ids(tokens)?;
        let masks = self.masks.as_mut().expect("checked above");
        self.buffer.extend_from_slice(tokens);
        masks
            .bytes
            .extend(trained.iter().enumerate().map(|(i, &t)| {
                let start = match (i, starts_row) {
                    (0, true) => MASK_EXAMPLE_START | MASK_ROW_START,
                    (0, false) => MASK_EXAMPLE_START,
                    _ => 0,
                };
                start | if t { MASK_TRAINED } else { 0 }
            }));
        self.num_documents += 1;
        self.num_tokens += tokens.len() as u64;
        self.flush_full_shards()
    }

    fn flush_full_shards(&mut self) -> Result<()> {
        while self.buffer.len() >= self.shard_tokens {
            self.write_next_shard(self.shard_tokens)?;
        }
        Ok(())
    }

    fn write_next_shard(&mut self, n: usize) -> Result<()> {
        let index = self.shards.len();
        let name = shard_file_name(index);
        write_shard(&self.dir.join(&name), &self.buffer[..n], self.width)?;
        self.buffer.drain(..n);
        self.shards.push(ShardMeta {
            file: name,
            num_tokens: n as u64,
        });
        if let Some(masks) = &mut self.masks {
            let name = mask_file_name(index);
            write_mask_shard(&self.dir.join(&name), &masks.bytes[..n])?;
            masks.bytes.drain(..n);
            masks.files.push(ShardMeta {
                file: name,
                num_tokens: n as u64,
            });
        }
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
        let (version, layout, pad_id, mask_shards, max_seq_length) = match &self.masks {
            None => (
                META_VERSION_STREAM,
                RowLayout::Stream,
                None,
                Vec::new(),
                None,
            ),
            Some(m) if m.packed => (
                META_VERSION,
                RowLayout::Packed,
                Some(m.pad_id),
                m.files.clone(),
                m.max_seq_length,
            ),
            Some(m) => (
                META_VERSION_EXAMPLES,
                RowLayout::Examples,
                Some(m.pad_id),
                m.files.clone(),
                m.max_seq_length,
            ),
        };
        let meta = DatasetMeta {
            format: META_FORMAT.to_string(),
            version,
            vocab_size: self.vocab_size,
            eos_id: self.eos_id,
            token_width: self.width,
            num_tokens: self.num_tokens,
            num_documents: self.num_documents,
            shards: self.shards.clone(),
            tokenizer,
            layout,
            pad_id,
            mask_shards,
            max_seq_length,
        };
        let json = serde_json::to_string_pretty(&meta).expect("DatasetMeta serializes");
        let meta_path = self.dir.join(META_FILE);
        write_bytes_atomic(&meta_path, json.as_bytes())
            .map_err(|e| EngineError::io(&meta_path, "write dataset metadata", e))?;
        self.remove_stale_files(&meta);
        Ok(PrepareSummary {
            output_dir: self.dir,
            num_documents: meta.num_documents,
            num_tokens: meta.num_tokens,
            shards: meta.shards,
            vocab_size: meta.vocab_size,
            eos_id: meta.eos_id,
            token_width: meta.token_width,
            layout: meta.layout,
        })
    }

    /// Best effort: shard and mask files left by an earlier, larger run would only confuse
    /// people.
    fn remove_stale_files(&self, meta: &DatasetMeta) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        let listed = |name: &str| {
            meta.shards
                .iter()
                .chain(&meta.mask_shards)
                .any(|s| s.file == name)
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let ours =
                (name.starts_with("shard-") || name.starts_with("mask-")) && name.ends_with(".bin");
            if ours && !listed(&name) {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}
