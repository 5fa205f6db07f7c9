//! Binary shards of CTR samples (what `tilearn ctr prepare` writes and training reads):
//! `shard-NNNNN.bin`, each a 40-byte header (magic `TLCTRSH1`, version 1, num_dense,
//! num_fields as u32, sample count and the FNV-1a-64 checksum of the payload as u64, little
//! endian) and the payload `labels: f32[n], dense: f32[n * num_dense], cats: u64[n * num_fields]`,
//! plus `meta.json`. Every file is written through `tilearn_ops::fs` (temporary file + rename),
//! and read through a memory map whose header, length and checksum are verified.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::batch::CtrBatch;
use crate::error::{RecsysError, Result};

const MAGIC: &[u8; 8] = b"TLCTRSH1";
const VERSION: u32 = 1;
const HEADER: usize = 40;

/// `meta.json` of a shard directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardMeta {
    pub format: String,
    pub num_dense: usize,
    pub num_fields: usize,
    pub samples: usize,
    pub shards: Vec<ShardEntry>,
    /// Where the samples came from (a TSV path, or the synthetic generator's parameters).
    pub source: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub file: String,
    pub samples: usize,
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn encode(batch: &CtrBatch) -> Vec<u8> {
    let mut payload =
        Vec::with_capacity(batch.len() * (4 + 4 * batch.num_dense + 8 * batch.num_fields));
    batch
        .labels
        .iter()
        .for_each(|x| payload.extend_from_slice(&x.to_le_bytes()));
    batch
        .dense
        .iter()
        .for_each(|x| payload.extend_from_slice(&x.to_le_bytes()));
    batch
        .cats
        .iter()
        .for_each(|x| payload.extend_from_slice(&x.to_le_bytes()));
    let mut bytes = Vec::with_capacity(HEADER + payload.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&VERSION.to_le_bytes());
    bytes.extend_from_slice(&(batch.num_dense as u32).to_le_bytes());
    bytes.extend_from_slice(&(batch.num_fields as u32).to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes());
    bytes.extend_from_slice(&(batch.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&fnv1a64(&payload).to_le_bytes());
    bytes.extend_from_slice(&payload);
    bytes
}

fn decode(bytes: &[u8], path: &Path) -> Result<CtrBatch> {
    let bad = |message: String| RecsysError::Format {
        path: path.to_path_buf(),
        message,
    };
    if bytes.len() < HEADER || &bytes[..8] != MAGIC {
        return Err(bad(
            "not a tilearn CTR shard (magic TLCTRSH1 missing); re-run `tilearn ctr prepare`".into(),
        ));
    }
    let u32_at =
        |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes")) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
    if u32_at(8) != VERSION as usize {
        return Err(bad(format!(
            "shard version {} (this build reads {VERSION})",
            u32_at(8)
        )));
    }
    let (num_dense, num_fields, n) = (u32_at(12), u32_at(16), u64_at(24) as usize);
    let payload = &bytes[HEADER..];
    let want = n
        .checked_mul(4 + 4 * num_dense + 8 * num_fields)
        .ok_or_else(|| bad(format!("sample count {n} overflows")))?;
    if payload.len() != want {
        return Err(bad(format!(
            "{} payload bytes, the header's {n} samples need {want} (truncated?)",
            payload.len()
        )));
    }
    if fnv1a64(payload) != u64_at(32) {
        return Err(bad(
            "checksum mismatch: the shard is corrupt; re-run `tilearn ctr prepare`".into(),
        ));
    }
    let f32s = |b: &[u8]| {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
            .collect::<Vec<_>>()
    };
    let (labels, rest) = payload.split_at(4 * n);
    let (dense, cats) = rest.split_at(4 * n * num_dense);
    Ok(CtrBatch {
        num_dense,
        num_fields,
        labels: f32s(labels),
        dense: f32s(dense),
        cats: cats
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8")))
            .collect(),
    })
}

/// Writes `batch` as shards of at most `per_shard` samples and `meta.json` into `dir`.
pub fn write_shards(
    dir: &Path,
    batch: &CtrBatch,
    per_shard: usize,
    source: serde_json::Value,
) -> Result<ShardMeta> {
    std::fs::create_dir_all(dir).map_err(|e| RecsysError::io(dir, e))?;
    let per_shard = per_shard.max(1);
    let mut shards = Vec::new();
    let mut start = 0;
    while start < batch.len() || shards.is_empty() {
        let end = (start + per_shard).min(batch.len());
        let file = format!("shard-{:05}.bin", shards.len());
        let path = dir.join(&file);
        tilearn_ops::fs::write_bytes_atomic(&path, &encode(&batch.slice(start..end)))
            .map_err(|e| RecsysError::io(&path, e))?;
        shards.push(ShardEntry {
            file,
            samples: end - start,
        });
        start = end;
    }
    let meta = ShardMeta {
        format: "tilearn-ctr-shards".into(),
        num_dense: batch.num_dense,
        num_fields: batch.num_fields,
        samples: batch.len(),
        shards,
        source,
    };
    let path = dir.join("meta.json");
    let json = serde_json::to_vec_pretty(&meta).expect("meta serialises");
    tilearn_ops::fs::write_bytes_atomic(&path, &json).map_err(|e| RecsysError::io(&path, e))?;
    Ok(meta)
}

/// Reads every shard listed in `dir/meta.json` into one batch, verifying each.
pub fn read_shards(dir: &Path) -> Result<(ShardMeta, CtrBatch)> {
    let meta_path = dir.join("meta.json");
    let text = std::fs::read(&meta_path).map_err(|e| RecsysError::io(&meta_path, e))?;
    let meta: ShardMeta = serde_json::from_slice(&text).map_err(|e| RecsysError::Format {
        path: meta_path.clone(),
        message: format!("{e}; re-run `tilearn ctr prepare`"),
    })?;
    let mut all = CtrBatch::new(meta.num_dense, meta.num_fields);
    for entry in &meta.shards {
        let path: PathBuf = dir.join(&entry.file);
        let file = std::fs::File::open(&path).map_err(|e| RecsysError::io(&path, e))?;
        // SAFETY: the map is read-only and dropped before this function returns; tilearn writes
        // shards by rename, so a concurrent writer replaces the file rather than changing it.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| RecsysError::io(&path, e))?;
        let shard = decode(&map, &path)?;
        if (shard.num_dense, shard.num_fields, shard.len())
            != (meta.num_dense, meta.num_fields, entry.samples)
        {
            return Err(RecsysError::Format {
                path,
                message: "its widths or sample count differ from meta.json".into(),
            });
        }
        all.extend(&shard);
    }
    Ok((meta, all))
}
