//! Saving a model as transformers does: `config.json` plus `model.safetensors`, or shards and
//! `model.safetensors.index.json` when the weights exceed `max_shard_bytes`.

use std::path::Path;

use serde_json::{Map, Value, json};
use tilearn_ops::DType;

use super::safetensors_io::{TensorRef, write_file_atomic, write_tensors_file};
use super::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE, shard_file_name};
use crate::config::LlamaConfig;
use crate::error::{EngineError, Result};
use crate::params::ParamStore;

/// Writes `config.json` (v5 form, `dtype` set to `dtype`) and the weights of `params` in
/// `dtype` into `dir` (created if needed). With `max_shard_bytes`, tensors are packed in
/// Hugging Face order into shards of at most that many bytes (a larger single tensor gets a
/// shard of its own) plus an index; one shard is written as plain `model.safetensors`.
/// Weight files of an earlier save in `dir` that this save does not use are removed afterwards.
pub fn save_pretrained(
    dir: &Path,
    config: &LlamaConfig,
    params: &ParamStore,
    dtype: DType,
    max_shard_bytes: Option<usize>,
) -> Result<()> {
    if max_shard_bytes == Some(0) {
        return Err(EngineError::InvalidArgument {
            argument: "max_shard_bytes".into(),
            message: "must be positive; pass None for a single file".into(),
        });
    }
    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, "create directory", e))?;

    let mut config = config.clone();
    config.dtype = Some(dtype);
    let config_text = config.to_json();
    write_file_atomic(&dir.join(CONFIG_FILE), |w| {
        use std::io::Write;
        w.write_all(config_text.as_bytes())
    })?;

    // Pack tensors into shards in order.
    let esize = dtype.size_in_bytes();
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut shard_bytes = 0usize;
    for (i, spec) in params.specs.iter().enumerate() {
        let bytes = spec.numel() * esize;
        let current = shards.last_mut().expect("at least one shard");
        if let Some(max) = max_shard_bytes
            && !current.is_empty()
            && shard_bytes + bytes > max
        {
            shards.push(vec![i]);
            shard_bytes = bytes;
        } else {
            current.push(i);
            shard_bytes += bytes;
        }
    }

    let tensors_of = |idx: &[usize]| -> Vec<TensorRef<'_>> {
        idx.iter()
            .map(|&i| {
                let s = &params.specs[i];
                (s.name.as_str(), s.shape.as_slice(), &params.data[s.range()])
            })
            .collect()
    };
    let meta = [("format", "pt")];

    let keep: Vec<String> = if shards.len() == 1 {
        write_tensors_file(
            &dir.join(SINGLE_FILE),
            &tensors_of(&shards[0]),
            dtype,
            &meta,
        )?;
        remove_if_exists(&dir.join(INDEX_FILE))?;
        vec![SINGLE_FILE.to_string()]
    } else {
        let n = shards.len();
        let mut weight_map = Map::new();
        let mut total_size = 0usize;
        let mut names = Vec::with_capacity(n);
        for (k, idx) in shards.iter().enumerate() {
            let file = shard_file_name(k + 1, n);
            total_size += write_tensors_file(&dir.join(&file), &tensors_of(idx), dtype, &meta)?;
            for &i in idx {
                weight_map.insert(params.specs[i].name.clone(), Value::from(file.clone()));
            }
            names.push(file);
        }
        let index = json!({
            "metadata": { "total_size": total_size, "total_parameters": params.numel() },
            "weight_map": Value::Object(weight_map),
        });
        let mut text = serde_json::to_string_pretty(&index).expect("JSON serialises");
        text.push('\n');
        write_file_atomic(&dir.join(INDEX_FILE), |w| {
            use std::io::Write;
            w.write_all(text.as_bytes())
        })?;
        remove_if_exists(&dir.join(SINGLE_FILE))?;
        names
    };
    remove_stale_shards(dir, &keep)
}

fn remove_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(EngineError::io(path, "remove stale file", e)),
    }
}

/// Whether `name` looks like `model-00001-of-00002.safetensors`.
fn is_shard_name(name: &str) -> bool {
    let Some(mid) = name
        .strip_prefix("model-")
        .and_then(|s| s.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let Some((a, b)) = mid.split_once("-of-") else {
        return false;
    };
    !a.is_empty()
        && !b.is_empty()
        && a.bytes().all(|c| c.is_ascii_digit())
        && b.bytes().all(|c| c.is_ascii_digit())
}

fn remove_stale_shards(dir: &Path, keep: &[String]) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| EngineError::io(dir, "list", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| EngineError::io(dir, "list", e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if is_shard_name(name) && !keep.iter().any(|k| k == name) {
            remove_if_exists(&entry.path())?;
        }
    }
    Ok(())
}
