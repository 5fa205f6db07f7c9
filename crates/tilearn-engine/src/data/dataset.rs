//! A prepared token dataset, memory-mapped and verified, and its training rows.
//!
//! Rows ([`TokenDataset::read_row`]) depend on the dataset's [`RowLayout`]: a `stream`
//! dataset (pretraining) is cut into non-overlapping windows of `seq_len` tokens whose labels
//! are their ids; an `examples` dataset (supervised fine-tuning) gives one row per example,
//! truncated to `seq_len` and padded with the pad id, whose labels are the ids of the trained
//! tokens and -100 (`IGNORE_INDEX`) for the prompt and the padding. A `packed` dataset gives one
//! row per packed row of examples, with position ids that restart at 0 for each example (and
//! for the padding after the last one) and label -100 on each example's first token
//! ([`TokenDataset::read_row_at`]).

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;

use tilearn_ops::cpu::IGNORE_INDEX;

use super::format::{
    DatasetMeta, Fnv1a64, MASK_EXAMPLE_START, MASK_ROW_START, MASK_TRAINED, META_FILE, META_FORMAT,
    META_VERSION, RowLayout, SHARD_HEADER_LEN, ShardHeader, ShardKind, ShardMeta,
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
    /// The loss masks, one per shard (`examples` layout; empty for `stream`).
    masks: Vec<MappedShard>,
    /// Stream position of every example's first token and one extra entry holding the total
    /// (`examples` layout; empty for `stream`).
    examples: Vec<usize>,
    /// Stream position of every packed row's first token and the total (`packed` layout;
    /// empty otherwise).
    packed_rows: Vec<usize>,
}

/// How many rows of an `examples` dataset a sequence length cuts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Truncation {
    /// Examples longer than the sequence length.
    pub truncated: usize,
    /// Of those, the ones left with no target (all their trained tokens were cut).
    pub left_without_targets: usize,
    /// Examples in the dataset (packed rows, for a packed dataset).
    pub examples: usize,
    /// Whether the units counted are packed rows.
    pub packed: bool,
}

impl Truncation {
    /// The warning to print for a run with `seq_len` on the dataset in `dir`, or `None` when
    /// nothing is cut.
    pub fn warning(&self, dir: &Path, seq_len: usize) -> Option<String> {
        if self.packed {
            return (self.truncated > 0).then(|| {
                format!(
                    "warning: {} of the {} packed rows in {} are longer than the training \
                     --seq-len {seq_len} and are truncated to it, cutting the examples at their \
                     ends ({} of them keep no trained token); prepare with --max-seq-length \
                     {seq_len}",
                    self.truncated,
                    self.examples,
                    dir.display(),
                    self.left_without_targets
                )
            });
        }
        (self.truncated > 0).then(|| {
            format!(
                "warning: {} of the {} examples in {} are longer than the training --seq-len \
                 {seq_len} and are truncated to it ({} of them keep no trained token and add \
                 nothing to the loss); raise --seq-len, or choose the cut when preparing with \
                 --max-seq-length",
                self.truncated,
                self.examples,
                dir.display(),
                self.left_without_targets
            )
        })
    }
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
        if meta.format != META_FORMAT || !(1..=META_VERSION).contains(&meta.version) {
            return Err(data_err(
                &meta_path,
                format!(
                    "format `{}` version {} is not supported (expected `{META_FORMAT}` version \
                     1 to {META_VERSION}); re-run `tilearn prepare-data` (or update tilearn)",
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
        check_layout(&meta, &meta_path)?;
        let shards = meta
            .shards
            .par_iter()
            .map(|s| open_shard(dir, s, &meta, ShardKind::Tokens))
            .collect::<Result<Vec<_>>>()?;
        let masks = meta
            .mask_shards
            .par_iter()
            .map(|s| open_shard(dir, s, &meta, ShardKind::LossMask))
            .collect::<Result<Vec<_>>>()?;
        let (examples, packed_rows) = if masks.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            example_starts(dir, &meta, &masks)?
        };
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
            masks,
            examples,
            packed_rows,
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

    /// How the stream becomes training rows.
    pub fn layout(&self) -> RowLayout {
        self.meta.layout
    }

    /// Training rows of `seq_len` tokens: whole windows of the stream, or the examples.
    pub fn num_rows(&self, seq_len: usize) -> usize {
        match self.layout() {
            RowLayout::Stream => self.num_tokens() / seq_len.max(1),
            RowLayout::Examples => self.examples.len().saturating_sub(1),
            RowLayout::Packed => self.packed_rows.len().saturating_sub(1),
        }
    }

    /// Row `row` for sequences of `seq_len` tokens, written into `ids` and `labels` (both
    /// `seq_len` long): window `row` of the stream with labels equal to the ids, or example
    /// `row` truncated to `seq_len`, padded with the pad id, with label -100 on every token
    /// that is not trained and on the padding.
    ///
    /// A `packed` row needs its position ids: read it with [`Self::read_row_at`].
    pub fn read_row(&self, row: usize, ids: &mut [u32], labels: &mut [i32]) -> Result<()> {
        self.read_row_at(row, ids, labels, None)
    }

    /// [`Self::read_row`] that also writes the row's position ids into `positions` (`seq_len`
    /// long) for a `packed` dataset, where they are required: positions restart at 0 for each
    /// example and for the padding after the last one, and each example's first label is
    /// -100 (its predecessor's last token does not predict across the boundary). Other layouts
    /// leave `positions` untouched (their rows are one sequence, positions `0..seq_len`).
    pub fn read_row_at(
        &self,
        row: usize,
        ids: &mut [u32],
        labels: &mut [i32],
        positions: Option<&mut [i32]>,
    ) -> Result<()> {
        let seq_len = ids.len();
        if labels.len() != seq_len
            || row >= self.num_rows(seq_len)
            || positions.as_ref().is_some_and(|p| p.len() != seq_len)
        {
            return Err(EngineError::InvalidArgument {
                argument: "row".into(),
                message: format!(
                    "row {row} of {seq_len} tokens (labels {}) is outside the dataset's {} rows",
                    labels.len(),
                    self.num_rows(seq_len)
                ),
            });
        }
        match self.layout() {
            RowLayout::Stream => {
                self.read_into(row * seq_len, ids)?;
                for (l, &id) in labels.iter_mut().zip(ids.iter()) {
                    *l = id as i32;
                }
            }
            RowLayout::Examples => {
                let start = self.examples[row];
                let len = (self.examples[row + 1] - start).min(seq_len);
                self.read_into(start, &mut ids[..len])?;
                let mut mask = vec![0u8; len];
                self.read_mask_into(start, &mut mask);
                for ((l, &id), &m) in labels.iter_mut().zip(ids.iter()).zip(&mask) {
                    *l = if m & MASK_TRAINED != 0 {
                        id as i32
                    } else {
                        IGNORE_INDEX
                    };
                }
                let pad = self.meta.pad_id.unwrap_or(self.meta.eos_id);
                ids[len..].fill(pad);
                labels[len..].fill(IGNORE_INDEX);
            }
            RowLayout::Packed => {
                let Some(positions) = positions else {
                    return Err(EngineError::InvalidArgument {
                        argument: "positions".into(),
                        message: format!(
                            "{} holds packed rows, whose examples need their position ids; \
                             read them with read_row_at",
                            self.dir.display()
                        ),
                    });
                };
                self.read_packed_row(row, ids, labels, positions)?;
            }
        }
        Ok(())
    }

    /// Packed row `row` (see [`Self::read_row_at`]).
    fn read_packed_row(
        &self,
        row: usize,
        ids: &mut [u32],
        labels: &mut [i32],
        positions: &mut [i32],
    ) -> Result<()> {
        let seq_len = ids.len();
        let start = self.packed_rows[row];
        let len = (self.packed_rows[row + 1] - start).min(seq_len);
        self.read_into(start, &mut ids[..len])?;
        let mut mask = vec![0u8; len];
        self.read_mask_into(start, &mut mask);
        let mut pos = 0i32;
        for t in 0..len {
            let m = mask[t];
            if m & MASK_EXAMPLE_START != 0 {
                pos = 0;
            }
            positions[t] = pos;
            pos += 1;
            labels[t] = if m & MASK_TRAINED != 0 && m & MASK_EXAMPLE_START == 0 {
                ids[t] as i32
            } else {
                IGNORE_INDEX
            };
        }
        let pad = self.meta.pad_id.unwrap_or(self.meta.eos_id);
        ids[len..].fill(pad);
        labels[len..].fill(IGNORE_INDEX);
        for (p, slot) in positions[len..].iter_mut().enumerate() {
            *slot = p as i32;
        }
        Ok(())
    }

    /// Whether rows carry position ids ([`Self::read_row_at`]): the `packed` layout.
    pub fn has_positions(&self) -> bool {
        self.layout() == RowLayout::Packed
    }

    /// For an `examples` dataset: how many examples `seq_len` truncates (`None` for a stream).
    pub fn truncation(&self, seq_len: usize) -> Option<Truncation> {
        let units = match self.layout() {
            RowLayout::Stream => return None,
            RowLayout::Examples => &self.examples,
            // A packed row longer than seq_len loses the examples at its end.
            RowLayout::Packed => &self.packed_rows,
        };
        let mut report = Truncation {
            examples: self.num_rows(seq_len),
            packed: self.layout() == RowLayout::Packed,
            ..Truncation::default()
        };
        let mut mask = Vec::new();
        for pair in units.windows(2) {
            let (start, len) = (pair[0], pair[1] - pair[0]);
            if len <= seq_len {
                continue;
            }
            report.truncated += 1;
            // Position 0 is never a target; targets are the trained tokens at 1..seq_len.
            mask.resize(seq_len, 0);
            self.read_mask_into(start, &mut mask);
            if !mask.iter().skip(1).any(|&m| m & MASK_TRAINED != 0) {
                report.left_without_targets += 1;
            }
        }
        Some(report)
    }

    /// Fill `out` with the mask bytes of tokens `start..start + out.len()` (inside the stream).
    fn read_mask_into(&self, start: usize, out: &mut [u8]) {
        self.for_each_piece(start, out.len(), |shard, offset, range| {
            let payload = self.masks[shard].payload();
            out[range.clone()].copy_from_slice(&payload[offset..offset + range.len()]);
        });
    }

    /// Calls `f(shard, offset in shard, range of the output)` for the pieces of the stream
    /// range `start..start + len`, which must lie inside the stream.
    fn for_each_piece(
        &self,
        start: usize,
        len: usize,
        mut f: impl FnMut(usize, usize, Range<usize>),
    ) {
        let end = start + len;
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
            f(shard, offset, written..written + n);
            written += n;
            pos += n;
        }
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
        self.for_each_piece(start, end - start, |shard, offset, range| {
            self.shards[shard].read(offset, &mut out[range]);
        });
        Ok(())
    }

    /// Tokens `range` of the stream as a new vector.
    pub fn tokens(&self, range: Range<usize>) -> Result<Vec<u32>> {
        let mut out = vec![0u32; range.end.saturating_sub(range.start)];
        self.read_into(range.start, &mut out)?;
        Ok(out)
    }
}

/// The layout's fields agree with each other and with the shards.
fn check_layout(meta: &DatasetMeta, meta_path: &Path) -> Result<()> {
    let bad = |message: String| Err(data_err(meta_path, message));
    match meta.layout {
        RowLayout::Stream if !meta.mask_shards.is_empty() => bad(
            "lists mask_shards but its layout is `stream`; re-run `tilearn prepare-data`".into(),
        ),
        RowLayout::Stream => Ok(()),
        RowLayout::Examples if meta.version < 2 => bad(format!(
            "layout `examples` needs meta.json version 2, found {}; re-run `tilearn prepare-data`",
            meta.version
        )),
        RowLayout::Packed if meta.version < 3 || meta.max_seq_length.is_none() => bad(format!(
            "layout `packed` needs meta.json version 3 and max_seq_length (the row length), \
             found version {} and {:?}; re-run `tilearn prepare-data --format sft --packing`",
            meta.version, meta.max_seq_length
        )),
        RowLayout::Examples | RowLayout::Packed => {
            let counts = |list: &[ShardMeta]| list.iter().map(|s| s.num_tokens).collect::<Vec<_>>();
            if counts(&meta.mask_shards) != counts(&meta.shards) {
                return bad(
                    "the mask_shards do not pair one to one (same token counts) with the \
                     shards; re-run `tilearn prepare-data --format sft`"
                        .into(),
                );
            }
            match meta.pad_id {
                Some(pad) if (pad as usize) < meta.vocab_size => Ok(()),
                other => bad(format!(
                    "pad_id {other:?} is missing or not below vocab_size {}; re-run `tilearn \
                     prepare-data --format sft`",
                    meta.vocab_size
                )),
            }
        }
    }
}

/// Stream positions of the examples' first tokens (mask bit [`MASK_EXAMPLE_START`]) and of
/// the packed rows' (bit [`MASK_ROW_START`], `packed` layout), each list with the total
/// appended; checks that the stream starts with an example (and a row, when packed), that
/// rows start on examples, no row is longer than `max_seq_length`, and no other bits are set.
fn example_starts(
    dir: &Path,
    meta: &DatasetMeta,
    masks: &[MappedShard],
) -> Result<(Vec<usize>, Vec<usize>)> {
    let packed = meta.layout == RowLayout::Packed;
    let known = MASK_TRAINED | MASK_EXAMPLE_START | if packed { MASK_ROW_START } else { 0 };
    let row_len = meta.max_seq_length.unwrap_or(usize::MAX);
    let mut starts = Vec::with_capacity(meta.num_documents as usize + 1);
    let mut rows = Vec::new();
    let mut pos = 0usize;
    for (mask, listed) in masks.iter().zip(&meta.mask_shards) {
        for (i, &m) in mask.payload().iter().enumerate() {
            let first = pos + i == 0;
            let row_start = m & MASK_ROW_START != 0;
            // A packed row starts at token 0, on an example, and after a row of at most
            // row_len tokens.
            let bad_row = packed
                && if row_start {
                    m & MASK_EXAMPLE_START == 0
                        || rows.last().is_some_and(|&r| pos + i - r > row_len)
                } else {
                    first
                };
            if m & !known != 0 || (first && m & MASK_EXAMPLE_START == 0) || bad_row {
                return Err(data_err(
                    dir.join(&listed.file),
                    format!(
                        "mask byte {m:#04x} at token {i} is not valid (unknown bits, the first \
                         token does not start an example, or a packed row does not start on an \
                         example or exceeds max_seq_length); re-run `tilearn prepare-data \
                         --format sft`"
                    ),
                ));
            }
            if m & MASK_EXAMPLE_START != 0 {
                starts.push(pos + i);
            }
            if packed && row_start {
                rows.push(pos + i);
            }
        }
        pos += mask.num_tokens;
    }
    if packed && rows.last().is_some_and(|&r| pos - r > row_len) {
        return Err(data_err(
            dir.join(META_FILE),
            format!(
                "the last packed row exceeds max_seq_length {row_len}; re-run `tilearn \
                 prepare-data --format sft --packing`"
            ),
        ));
    }
    if starts.len() as u64 != meta.num_documents {
        return Err(data_err(
            dir.join(META_FILE),
            format!(
                "num_documents is {} but the loss masks start {} examples; re-run `tilearn \
                 prepare-data --format sft`",
                meta.num_documents,
                starts.len()
            ),
        ));
    }
    starts.push(pos);
    if packed {
        rows.push(pos);
    }
    Ok((starts, rows))
}

fn open_shard(
    dir: &Path,
    shard: &ShardMeta,
    meta: &DatasetMeta,
    kind: ShardKind,
) -> Result<MappedShard> {
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
    let header = ShardHeader::parse_of(&map, &path, kind)?;
    if kind == ShardKind::Tokens && header.token_width != meta.token_width {
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
    if kind == ShardKind::LossMask {
        return Ok(shard);
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
