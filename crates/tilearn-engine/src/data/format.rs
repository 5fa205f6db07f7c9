//! The on-disk format of a prepared token dataset: shard files, `meta.json` and the FNV-1a-64
//! checksum. Every file is written through `tilearn_ops::fs` (atomic: `<name>.tmp`, fsync,
//! rename).
//!
//! A dataset directory holds `meta.json`, one or more `shard-NNNNN.bin` files and (normally) the
//! `tokenizer.json` that produced the tokens. A shard is a 32-byte little-endian header followed
//! by the payload:
//!
//! | offset | size | field                                                   |
//! |-------:|-----:|---------------------------------------------------------|
//! |      0 |    8 | magic `TILTOK01`                                        |
//! |      8 |    4 | format version (u32, currently 1)                       |
//! |     12 |    4 | token width in bytes (u32, 2 or 4)                      |
//! |     16 |    8 | token count (u64)                                       |
//! |     24 |    8 | FNV-1a-64 of the payload bytes (u64)                    |
//! |     32 |  n·w | token ids, little-endian unsigned integers of width `w` |
//!
//! **Version 2** (supervised fine-tuning data, `meta.json` `"layout": "examples"`) keeps the
//! token shards unchanged and adds one loss-mask file per token shard, `mask-NNNNN.bin`, with
//! the same header (magic `TILMSK01`, width 1, the same token count as its token shard) and one
//! byte per token: bit 0 ([`MASK_TRAINED`]) set when the token is a training target (its label
//! is its id; otherwise the label is -100), bit 1 ([`MASK_EXAMPLE_START`]) set on the first
//! token of every example. Each example becomes one row of a batch (see
//! [`super::dataset::TokenDataset::read_row`]). `meta.json` version 2 adds `layout`, `pad_id`,
//! `mask_shards` and `max_seq_length`; a version-1 `meta.json` (which has none of them) reads
//! as the `stream` layout, and stream datasets are still written as version 1.
//!
//! **Version 3, the `packed` layout** (`prepare-data --format sft --packing`): the examples
//! are stored row by row, each row a run of whole examples packed into `max_seq_length`
//! tokens, and a third mask bit ([`MASK_ROW_START`]) marks the first token of every row.
//! Examples keep bit 1, so a row knows where its examples start: at training time each
//! example's positions restart at 0 and attention stays inside it. Unpacked examples are still
//! written as version 2, so readers of version 2 keep reading them; a version-2 reader refuses
//! a packed dataset (its `layout` is unknown there) instead of training across examples.

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// Magic bytes at the start of every shard.
pub const SHARD_MAGIC: &[u8; 8] = b"TILTOK01";
/// Version of the shard header written by this library.
pub const SHARD_VERSION: u32 = 1;
/// Size of the shard header in bytes.
pub const SHARD_HEADER_LEN: usize = 32;
/// The `format` field of `meta.json`.
pub const META_FORMAT: &str = "tilearn-tokens";
/// Newest version of `meta.json` this library reads and writes (3: the `packed` layout;
/// `examples` datasets are still written as version 2, stream datasets as version 1).
pub const META_VERSION: u32 = 3;
/// The `meta.json` version of a dataset in the `examples` layout.
pub const META_VERSION_EXAMPLES: u32 = 2;
/// The `meta.json` version of a dataset in the stream layout.
pub const META_VERSION_STREAM: u32 = 1;
/// Magic bytes at the start of every loss-mask file.
pub const MASK_MAGIC: &[u8; 8] = b"TILMSK01";
/// Mask bit: the token is a training target.
pub const MASK_TRAINED: u8 = 1;
/// Mask bit: the token is the first of an example.
pub const MASK_EXAMPLE_START: u8 = 2;
/// Mask bit: the token is the first of a packed row (`packed` layout; always also the first
/// of an example).
pub const MASK_ROW_START: u8 = 4;
/// File name of the dataset description inside a dataset directory.
pub const META_FILE: &str = "meta.json";

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Incremental FNV-1a 64-bit hash.
#[derive(Debug, Clone, Copy)]
pub struct Fnv1a64(u64);

impl Default for Fnv1a64 {
    fn default() -> Self {
        Fnv1a64(FNV_OFFSET)
    }
}

impl Fnv1a64 {
    /// Feed bytes into the hash.
    pub fn update(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(FNV_PRIME);
        }
        self.0 = h;
    }

    /// The hash of everything fed so far.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// FNV-1a-64 of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = Fnv1a64::default();
    h.update(bytes);
    h.finish()
}

/// Token id width in bytes for a vocabulary of `vocab_size` ids (`0..vocab_size`).
pub fn token_width_for_vocab(vocab_size: usize) -> u32 {
    if vocab_size <= 1 << 16 { 2 } else { 4 }
}

/// Name of shard number `index`.
pub fn shard_file_name(index: usize) -> String {
    format!("shard-{index:05}.bin")
}

/// Name of the loss-mask file of shard number `index`.
pub fn mask_file_name(index: usize) -> String {
    format!("mask-{index:05}.bin")
}

/// How a dataset's token stream becomes training rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RowLayout {
    /// Pretraining: the stream is cut into windows of the training sequence length, every
    /// token is a target.
    #[default]
    Stream,
    /// Supervised fine-tuning: every example is one row (truncated to the sequence length,
    /// padded with `pad_id` and label -100), only tokens whose mask has [`MASK_TRAINED`] are
    /// targets.
    Examples,
    /// Supervised fine-tuning with packing: every row holds whole examples (marked by
    /// [`MASK_ROW_START`]), padded with `pad_id`; position ids restart at 0 with each example
    /// and no example attends to another.
    Packed,
}

/// What a shard file holds: token ids or a loss mask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardKind {
    Tokens,
    LossMask,
}

impl ShardKind {
    fn magic(self) -> &'static [u8; 8] {
        match self {
            ShardKind::Tokens => SHARD_MAGIC,
            ShardKind::LossMask => MASK_MAGIC,
        }
    }

    fn width_ok(self, width: u32) -> bool {
        match self {
            ShardKind::Tokens => width == 2 || width == 4,
            ShardKind::LossMask => width == 1,
        }
    }
}

/// One shard as listed in `meta.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMeta {
    /// File name relative to the dataset directory.
    pub file: String,
    /// Number of tokens in the shard.
    pub num_tokens: u64,
}

/// The contents of `meta.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetMeta {
    /// Always [`META_FORMAT`].
    pub format: String,
    /// [`META_VERSION`] when written by this library.
    pub version: u32,
    /// Number of token ids (every id in the shards is below it).
    pub vocab_size: usize,
    /// The end-of-sequence id appended after every document.
    pub eos_id: u32,
    /// Bytes per token in the shards (2 or 4).
    pub token_width: u32,
    /// Total tokens over all shards.
    pub num_tokens: u64,
    /// Number of documents (each followed by one EOS).
    pub num_documents: u64,
    /// The shards in stream order.
    pub shards: Vec<ShardMeta>,
    /// File name (relative to the dataset directory) of the tokenizer that made the tokens.
    pub tokenizer: Option<String>,
    /// How the stream becomes rows (version 2; absent, i.e. `stream`, in version 1).
    #[serde(default)]
    pub layout: RowLayout,
    /// The id that pads an example's row (`examples` layout); its label is always -100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_id: Option<u32>,
    /// The loss-mask files, one per shard with the same token counts (`examples` layout).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mask_shards: Vec<ShardMeta>,
    /// The `--max-seq-length` examples were truncated to when prepared, if any (the row
    /// length of a `packed` dataset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seq_length: Option<usize>,
}

/// The fixed-size shard header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardHeader {
    pub version: u32,
    pub token_width: u32,
    pub num_tokens: u64,
    pub checksum: u64,
}

impl ShardHeader {
    /// Encode as the 32 header bytes.
    pub fn to_bytes(&self) -> [u8; SHARD_HEADER_LEN] {
        let mut b = [0u8; SHARD_HEADER_LEN];
        b[0..8].copy_from_slice(SHARD_MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&self.token_width.to_le_bytes());
        b[16..24].copy_from_slice(&self.num_tokens.to_le_bytes());
        b[24..32].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }

    /// Encode as the 32 header bytes of a `kind` file.
    pub fn to_bytes_of(&self, kind: ShardKind) -> [u8; SHARD_HEADER_LEN] {
        let mut b = self.to_bytes();
        b[0..8].copy_from_slice(kind.magic());
        b
    }

    /// Decode and check a token shard's header; `file` names the shard in errors.
    pub fn parse(bytes: &[u8], file: &Path) -> Result<ShardHeader> {
        Self::parse_of(bytes, file, ShardKind::Tokens)
    }

    /// Decode and check the header of a `kind` file; `file` names it in errors.
    pub fn parse_of(bytes: &[u8], file: &Path, kind: ShardKind) -> Result<ShardHeader> {
        let magic = kind.magic();
        let err = |message: String| EngineError::Data {
            file: file.to_path_buf(),
            message,
        };
        if bytes.len() < SHARD_HEADER_LEN {
            return Err(err(format!(
                "truncated shard: {} bytes, shorter than the {SHARD_HEADER_LEN}-byte header; \
                 re-run `tilearn prepare-data`",
                bytes.len()
            )));
        }
        if &bytes[0..8] != magic {
            return Err(err(format!(
                "not a tilearn {} (magic {:?}, expected {:?}); re-run `tilearn prepare-data`",
                match kind {
                    ShardKind::Tokens => "token shard",
                    ShardKind::LossMask => "loss-mask file",
                },
                String::from_utf8_lossy(&bytes[0..8]),
                String::from_utf8_lossy(magic)
            )));
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let header = ShardHeader {
            version: u32_at(8),
            token_width: u32_at(12),
            num_tokens: u64_at(16),
            checksum: u64_at(24),
        };
        if header.version != SHARD_VERSION {
            return Err(err(format!(
                "shard format version {} is not supported (this build reads version \
                 {SHARD_VERSION}); re-run `tilearn prepare-data`",
                header.version
            )));
        }
        if !kind.width_ok(header.token_width) {
            return Err(err(format!(
                "invalid width {} in the header (expected {}); the file is corrupt, re-run \
                 `tilearn prepare-data`",
                header.token_width,
                match kind {
                    ShardKind::Tokens => "2 or 4",
                    ShardKind::LossMask => "1",
                }
            )));
        }
        Ok(header)
    }
}

/// Append `tokens` to `out` as little-endian integers of `width` bytes.
pub(crate) fn encode_tokens(tokens: &[u32], width: u32, out: &mut Vec<u8>) {
    match width {
        2 => {
            for &t in tokens {
                debug_assert!(t <= u32::from(u16::MAX));
                out.extend_from_slice(&(t as u16).to_le_bytes());
            }
        }
        _ => {
            for &t in tokens {
                out.extend_from_slice(&t.to_le_bytes());
            }
        }
    }
}

/// Write a shard file atomically. Every token must fit in `width` bytes.
pub fn write_shard(path: &Path, tokens: &[u32], width: u32) -> Result<()> {
    tilearn_ops::fs::write_atomic(path, |w| {
        let mut header = ShardHeader {
            version: SHARD_VERSION,
            token_width: width,
            num_tokens: tokens.len() as u64,
            checksum: 0,
        };
        w.write_all(&header.to_bytes())?;
        let mut hash = Fnv1a64::default();
        let mut buf = Vec::with_capacity(64 * 1024 * width as usize);
        for chunk in tokens.chunks(64 * 1024) {
            buf.clear();
            encode_tokens(chunk, width, &mut buf);
            hash.update(&buf);
            w.write_all(&buf)?;
        }
        // The checksum is known only now: patch it into the header.
        header.checksum = hash.finish();
        let file = w.file_mut()?;
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&header.to_bytes())?;
        Ok(())
    })
    .map_err(|e| EngineError::io(path, "write shard", e))
}

/// Write a loss-mask file atomically: the header of a [`ShardKind::LossMask`] and one byte per
/// token.
pub fn write_mask_shard(path: &Path, mask: &[u8]) -> Result<()> {
    let header = ShardHeader {
        version: SHARD_VERSION,
        token_width: 1,
        num_tokens: mask.len() as u64,
        checksum: fnv1a64(mask),
    };
    tilearn_ops::fs::write_atomic(path, |w| {
        w.write_all(&header.to_bytes_of(ShardKind::LossMask))?;
        w.write_all(mask)?;
        Ok(())
    })
    .map_err(|e| EngineError::io(path, "write loss-mask file", e))
}
