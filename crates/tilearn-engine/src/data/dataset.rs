//! A prepared token dataset, memory-mapped and verified.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;

use super::format::{
    DatasetMeta, Fnv1a64, META_FILE, META_FORMAT, META_VERSION, SHARD_HEADER_LEN, ShardHeader,
    ShardMeta,
};
use crate::error::{EngineError, Result};

/// The token stream of a dataset directory written by `prepare-data`: all shards in order,
/// read as one sequence of `u32` ids.
///
/// [`TokenDataset::open`] checks everything once (header, length, FNV-1a checksum, every id
/// below `vocab_size`), so reads afterwards cannot fail except for out-of-range positions.
#[derive(Debug)]
pub struct TokenDataset {
    dir: PathBuf,
    meta: DatasetMeta,
    shards: Vec<MappedShard>,
    /// `starts[i]` is the stream position of shard `i`'s first token; one extra entry holds
    /// the total.
    starts: Vec<usize>,
}

#[derive(Debug)]
struct MappedShard {
    map: Mmap,
    width: usize,
    num_tokens: usize,
}

impl MappedShard {
    fn payload(&self) -> &[u8] {
        &self.map[SHARD_HEADER_LEN..]
    }

    /// Decode tokens `offset..offset + out.len()` of this shard into `out`.
    fn read(&self, offset: usize, out: &mut [u32]) {
        let w = self.width;
        let bytes = &self.payload()[offset * w..(offset + out.len()) * w];
        match w {
            2 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u32::from(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            _ => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }
}

fn data_err(file: impl Into<PathBuf>, message: impl Into<String>) -> EngineError {
    EngineError::Data {
        file: file.into(),
        message: message.into(),
    }
}

impl TokenDataset {
    /// Open the dataset in `dir`: read `meta.json`, memory-map and verify every shard.
    pub fn open(dir: &Path) -> Result<TokenDataset> {
        let meta_path = dir.join(META_FILE);
        let text = match std::fs::read_to_string(&meta_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(data_err(
                    &meta_path,
                    format!(
                        "not found: {} is not a prepared dataset; run `tilearn prepare-data` \
                         with this output directory first",
                        dir.display()
                    ),
                ));
            }
            Err(e) => return Err(EngineError::io(&meta_path, "read dataset meta.json", e)),
        };
        let meta: DatasetMeta = serde_json::from_str(&text).map_err(|e| {
            data_err(
                &meta_path,
                format!("invalid dataset description ({e}); re-run `tilearn prepare-data`"),
            )
        })?;
        if meta.format != META_FORMAT || meta.version != META_VERSION {
            return Err(data_err(
                &meta_path,
                format!(
                    "format `{}` version {} is not supported (expected `{META_FORMAT}` version \
                     {META_VERSION}); re-run `tilearn prepare-data`",
                    meta.format, meta.version
                ),
            ));
        }
        if meta.num_tokens == 0 || meta.shards.is_empty() {
            return Err(data_err(
                dir,
                "dataset contains no tokens; run `tilearn prepare-data` on non-empty input",
            ));
        }
        let listed: u64 = meta.shards.iter().map(|s| s.num_tokens).sum();
        if listed != meta.num_tokens {
            return Err(data_err(
                &meta_path,
                format!(
                    "num_tokens is {} but the shards hold {listed}; re-run `tilearn prepare-data`",
                    meta.num_tokens
                ),
            ));
        }
        let width_ok =
            meta.token_width == 4 || (meta.token_width == 2 && meta.vocab_size <= 1 << 16);
        if !width_ok || meta.eos_id as usize >= meta.vocab_size {
            return Err(data_err(
                &meta_path,
                format!(
                    "inconsistent token_width {} / vocab_size {} / eos_id {}; re-run \
                     `tilearn prepare-data`",
                    meta.token_width, meta.vocab_size, meta.eos_id
                ),
            ));
        }
        let shards = meta
            .shards
            .par_iter()
            .map(|s| open_shard(dir, s, &meta))
            .collect::<Result<Vec<_>>>()?;
        let mut starts = Vec::with_capacity(shards.len() + 1);
        let mut pos = 0usize;
        for s in &shards {
            starts.push(pos);
            pos += s.num_tokens;
        }
        starts.push(pos);
        Ok(TokenDataset {
            dir: dir.to_path_buf(),
            meta,
            shards,
            starts,
        })
    }

    /// The dataset directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed `meta.json`.
    pub fn meta(&self) -> &DatasetMeta {
        &self.meta
    }

    /// Total tokens in the stream (documents and their EOS tokens).
    pub fn num_tokens(&self) -> usize {
        self.starts[self.shards.len()]
    }

    /// Number of documents.
    pub fn num_documents(&self) -> u64 {
        self.meta.num_documents
    }

    /// Every id is below this.
    pub fn vocab_size(&self) -> usize {
        self.meta.vocab_size
    }

    /// The id that ends every document.
    pub fn eos_id(&self) -> u32 {
        self.meta.eos_id
    }

    /// Number of shard files.
    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    /// Path of the tokenizer recorded in `meta.json`, if any.
    pub fn tokenizer_path(&self) -> Option<PathBuf> {
        self.meta.tokenizer.as_ref().map(|t| self.dir.join(t))
    }

    /// Fill `out` with tokens `start..start + out.len()` of the stream (across shards).
    pub fn read_into(&self, start: usize, out: &mut [u32]) -> Result<()> {
        let end = start
            .checked_add(out.len())
            .filter(|&e| e <= self.num_tokens());
        let Some(end) = end else {
            return Err(EngineError::InvalidArgument {
                argument: "range".into(),
                message: format!(
                    "tokens {start}..{} are outside the dataset's {} tokens",
                    start.saturating_add(out.len()),
                    self.num_tokens()
                ),
            });
        };
        let mut pos = start;
        let mut written = 0;
        // The shard holding `pos`: the last one whose start is <= pos.
        let mut shard = self.starts.partition_point(|&s| s <= pos).saturating_sub(1);
        while pos < end {
            // Skip empty shards (never written by prepare, but harmless).
            while self.starts[shard + 1] <= pos {
                shard += 1;
            }
            let offset = pos - self.starts[shard];
            let n = (self.starts[shard + 1] - pos).min(end - pos);
            self.shards[shard].read(offset, &mut out[written..written + n]);
            written += n;
            pos += n;
        }
        Ok(())
    }

    /// Tokens `range` of the stream as a new vector.
    pub fn tokens(&self, range: Range<usize>) -> Result<Vec<u32>> {
        let mut out = vec![0u32; range.end.saturating_sub(range.start)];
        self.read_into(range.start, &mut out)?;
        Ok(out)
    }
}

fn open_shard(dir: &Path, shard: &ShardMeta, meta: &DatasetMeta) -> Result<MappedShard> {
    let path = dir.join(&shard.file);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(data_err(
                &path,
                "listed in meta.json but missing; re-run `tilearn prepare-data`",
            ));
        }
        Err(e) => return Err(EngineError::io(&path, "open token shard", e)),
    };
    let len = file
        .metadata()
        .map_err(|e| EngineError::io(&path, "stat token shard", e))?
        .len();
    if len < SHARD_HEADER_LEN as u64 {
        return Err(data_err(
            &path,
            format!(
                "truncated shard: {len} bytes, shorter than the {SHARD_HEADER_LEN}-byte header; \
                 re-run `tilearn prepare-data`"
            ),
        ));
    }
    // SAFETY: the map is read-only and private to this process. Like every reader of
    // memory-mapped files we rely on nobody truncating or rewriting the shard while it is open;
    // prepare-data never does (it writes new files and renames them into place, which leaves
    // an existing mapping of the old inode intact).
    let map =
        unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(&path, "mmap token shard", e))?;
    let header = ShardHeader::parse(&map, &path)?;
    if header.token_width != meta.token_width {
        return Err(data_err(
            &path,
            format!(
                "token width {} differs from meta.json's {}; re-run `tilearn prepare-data`",
                header.token_width, meta.token_width
            ),
        ));
    }
    if header.num_tokens != shard.num_tokens {
        return Err(data_err(
            &path,
            format!(
                "holds {} tokens but meta.json lists {}; re-run `tilearn prepare-data`",
                header.num_tokens, shard.num_tokens
            ),
        ));
    }
    let width = header.token_width as usize;
    let expected = (header.num_tokens as u128) * width as u128 + SHARD_HEADER_LEN as u128;
    if u128::from(len) != expected {
        let what = if u128::from(len) < expected {
            "truncated shard"
        } else {
            "oversized shard"
        };
        return Err(data_err(
            &path,
            format!(
                "{what}: {len} bytes, expected {expected} for {} tokens of {width} bytes; \
                 re-run `tilearn prepare-data`",
                header.num_tokens
            ),
        ));
    }
    let shard = MappedShard {
        map,
        width,
        num_tokens: header.num_tokens as usize,
    };
    let mut hash = Fnv1a64::default();
    hash.update(shard.payload());
    if hash.finish() != header.checksum {
        return Err(data_err(
            &path,
            format!(
                "checksum mismatch (header says {:016x}, payload hashes to {:016x}): the shard \
                 is corrupt; re-run `tilearn prepare-data`",
                header.checksum,
                hash.finish()
            ),
        ));
    }
    let max_id = max_token(&shard);
    if let Some(max) = max_id
        && max as usize >= meta.vocab_size
    {
        return Err(data_err(
            &path,
            format!(
                "token id {max} is not below vocab_size {}; the shard was written with another \
                 tokenizer, re-run `tilearn prepare-data`",
                meta.vocab_size
            ),
        ));
    }
    Ok(shard)
}

fn max_token(shard: &MappedShard) -> Option<u32> {
    let mut buf = vec![0u32; 64 * 1024];
    let mut max = None;
    let mut offset = 0;
    while offset < shard.num_tokens {
        let n = buf.len().min(shard.num_tokens - offset);
        shard.read(offset, &mut buf[..n]);
        let m = buf[..n].iter().copied().max();
        max = max.max(m);
        offset += n;
    }
    max
}
