//! Saving a model as transformers does: `config.json` plus `model.safetensors`, or shards and
//! `model.safetensors.index.json` when the weights exceed `max_shard_bytes`. The weights are
//! streamed tensor by tensor from a [`TensorSource`] (host memory, or the GPU through a staging
//! buffer).

use std::path::Path;

use serde_json::{Map, Value, json};
use tilearn_ops::DType;
use tilearn_ops::fs::write_bytes_atomic;

use super::qkv_interleave::QkvInterleave;
use super::stream::{StreamedTensor, write_streamed};
use super::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE, shard_file_name};
use crate::config::{GENERATION_CONFIG_FILE, GenerationConfig, LlamaConfig};
use crate::error::{EngineError, Result};
use crate::params::{ParamSpec, ParamStore};
use crate::tensor_io::TensorSource;

/// transformers' default `max_shard_size` for `save_pretrained` (v5: "50GB", decimal; v4 used
/// "5GB"): above it the weights are split into shards plus an index.
pub const DEFAULT_MAX_SHARD_BYTES: usize = 50_000_000_000;

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
    let mut source: &[f32] = &params.data;
    save_pretrained_from(
        dir,
        config,
        &params.specs,
        &mut source,
        dtype,
        max_shard_bytes,
    )
}

/// [`save_pretrained`] of the tensors `specs` whose values `source` holds at the specs'
/// ranges: what the GPU engine uses to save without a host copy of the model.
pub fn save_pretrained_from(
    dir: &Path,
    config: &LlamaConfig,
    specs: &[ParamSpec],
    source: &mut dyn TensorSource,
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
    write_small_file(&dir.join(CONFIG_FILE), config.to_json().as_bytes())?;
    // The source model's generation defaults when it had them (fine-tuning), else the ids of
    // config.json, as transformers' save_pretrained writes for any generative model.
    let generation = config
        .generation
        .clone()
        .unwrap_or_else(|| GenerationConfig::from_model_config(&config));
    write_small_file(
        &dir.join(GENERATION_CONFIG_FILE),
        generation.to_json().as_bytes(),
    )?;

    // Pack tensors into shards in order.
    let esize = dtype.size_in_bytes();
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut shard_bytes = 0usize;
    for (i, spec) in specs.iter().enumerate() {
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

    let tensors_of = |idx: &[usize]| -> Vec<StreamedTensor> {
        idx.iter()
            .map(|&i| {
                let s = &specs[i];
                StreamedTensor {
                    name: s.name.clone(),
                    shape: s.shape.clone(),
                    range: s.range(),
                }
            })
            .collect()
    };
    let meta = [("format", "pt")];
    // Bloom's query_key_value goes back to its per-head interleaved order.
    let qkv = QkvInterleave::of(&config, specs);
    let mut source = qkv.source(source);
    let source: &mut dyn TensorSource = &mut source;

    let keep: Vec<String> = if shards.len() == 1 {
        write_streamed(
            &dir.join(SINGLE_FILE),
            &tensors_of(&shards[0]),
            dtype,
            &meta,
            source,
        )?;
        remove_if_exists(&dir.join(INDEX_FILE))?;
        vec![SINGLE_FILE.to_string()]
    } else {
        let n = shards.len();
        let mut weight_map = Map::new();
        let mut total_size = 0u64;
        let mut names = Vec::with_capacity(n);
        for (k, idx) in shards.iter().enumerate() {
            let file = shard_file_name(k + 1, n);
            total_size += write_streamed(&dir.join(&file), &tensors_of(idx), dtype, &meta, source)?;
            for &i in idx {
                weight_map.insert(specs[i].name.clone(), Value::from(file.clone()));
            }
            names.push(file);
        }
        let index = json!({
            "metadata": {
                "total_size": total_size,
                "total_parameters": specs.iter().map(ParamSpec::numel).sum::<usize>(),
            },
            "weight_map": Value::Object(weight_map),
        });
        let mut text = serde_json::to_string_pretty(&index).expect("JSON serialises");
        text.push('\n');
        write_small_file(&dir.join(INDEX_FILE), text.as_bytes())?;
        remove_if_exists(&dir.join(SINGLE_FILE))?;
        names
    };
    remove_stale_shards(dir, &keep)
}

/// Writes a small file (config, index) atomically.
fn write_small_file(path: &Path, bytes: &[u8]) -> Result<()> {
    write_bytes_atomic(path, bytes).map_err(|e| EngineError::io(path, "write", e))
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
