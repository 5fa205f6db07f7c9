//! Samples written for a baseline outside Rust (`benches/pytorch_recsys_baseline.py
//! --deepfm-data DIR`): raw little-endian arrays that numpy maps directly, with every
//! categorical value already hashed into its field's table, so the baseline trains on exactly
//! the rows tilearn trains on.
//!
//! `DIR/{split}_ids.u32` `[n, fields]` (row of the value in the field's table, or `u32::MAX`
//! for an empty field), `{split}_dense.f32` `[n, num_dense]`, `{split}_labels.f32` `[n]`, and
//! `DIR/meta.json`: the caller's description plus `{split}_samples` for every split.
//! (Little-endian hosts, as the shards.)

use std::path::Path;

use tilearn_ops::fs::write_bytes_atomic;

use super::batch::{CtrBatch, MISSING};
use crate::error::{RecsysError, Result};
use crate::hash::hash_to_row;

/// The id of an empty field in `{split}_ids.u32`.
pub const EXPORT_MISSING: u32 = u32::MAX;

/// The hashed ids of `batch` (`[n, fields]`, row-major), `field_rows[f]` rows per field.
pub fn hashed_ids(batch: &CtrBatch, field_rows: &[usize]) -> Result<Vec<u32>> {
    if field_rows.len() != batch.num_fields {
        return Err(RecsysError::invalid(
            "export",
            format!(
                "{} table sizes for {} fields",
                field_rows.len(),
                batch.num_fields
            ),
        ));
    }
    Ok(batch
        .cats
        .chunks(batch.num_fields.max(1))
        .flat_map(|row| {
            row.iter().zip(field_rows).map(|(&v, &rows)| match v {
                MISSING => EXPORT_MISSING,
                v => hash_to_row(v, rows),
            })
        })
        .collect())
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let path = dir.join(name);
    write_bytes_atomic(&path, bytes).map_err(|e| RecsysError::io(&path, e))
}

/// Writes every `(split name, samples)` of `splits` and `meta.json` (`meta`, a JSON object,
/// with `{split}_samples` added) into `dir`.
pub fn export_splits(
    dir: &Path,
    splits: &[(&str, &CtrBatch)],
    field_rows: &[usize],
    mut meta: serde_json::Value,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| RecsysError::io(dir, e))?;
    for (name, batch) in splits {
        let ids = hashed_ids(batch, field_rows)?;
        write(dir, &format!("{name}_ids.u32"), bytemuck::cast_slice(&ids))?;
        write(
            dir,
            &format!("{name}_dense.f32"),
            bytemuck::cast_slice(&batch.dense),
        )?;
        write(
            dir,
            &format!("{name}_labels.f32"),
            bytemuck::cast_slice(&batch.labels),
        )?;
        meta[format!("{name}_samples")] = serde_json::json!(batch.len());
    }
    let text = serde_json::to_string_pretty(&meta).expect("meta serialises");
    write(dir, "meta.json", text.as_bytes())
}
