//! The one optimizer state-file format: named flat f32 buffers plus string metadata in one
//! safetensors file, written atomically through `tilearn_ops::fs` and read back with every field
//! checked, so a bad file is an error and never a silently wrong resume.
//!
//! Layout (every optimizer): tensors are 1-D F32 of `numel` elements, stored in name order;
//! metadata holds `format` (`tilearn-<optimizer>`, e.g. `tilearn-sgd`: a file of one optimizer
//! is refused by another), `format_version` (`1`), `step`, `numel`, `config` (the optimizer's
//! config as JSON) and `groups` (JSON list of `{name, ranges, weight_decay, lr_scale}`).
//! AdamW had its own writer until the Adam family was unified; it wrote this same layout, so its
//! files load unchanged (`tests/state_compat.rs` loads files of the old writers). The metadata
//! keys are written sorted, so equal states give byte-identical files.
//!
//! Writers may add metadata keys this reader ignores: the engine's checkpoints of ranks that
//! hold slices of a model (tensor/pipeline parallelism, ZeRO) add `layout`, the tensors' full
//! shapes and the slice of each the file's elements are, so another layout can re-shard them
//! (`tilearn-engine`'s `trainer::optimizer_layout`); the flat state reads here as before.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::error::{OptimError, Result};
use crate::group::ParamGroup;

pub(crate) const FORMAT_VERSION: &str = "1";

#[derive(Serialize)]
struct GroupJson<'a> {
    name: &'a str,
    ranges: Vec<[usize; 2]>,
    weight_decay: f32,
    lr_scale: f32,
}

/// What a writer hands over: the format tag, counters, config and the named buffers.
pub(crate) struct StateOut<'a, C: Serialize> {
    pub format: &'static str,
    pub step: u64,
    pub numel: usize,
    pub config: &'a C,
    pub groups: &'a [ParamGroup],
    pub tensors: Vec<(&'static str, &'a [f32])>,
}

/// Writes `state` to `path` atomically (see the module docs).
pub(crate) fn save<C: Serialize>(path: &Path, state: StateOut<'_, C>) -> Result<()> {
    let err = |message: String| OptimError::State {
        file: path.to_path_buf(),
        message,
    };
    let config_json = serde_json::to_string(state.config)
        .map_err(|e| err(format!("cannot encode config: {e}")))?;
    let groups: Vec<GroupJson<'_>> = state
        .groups
        .iter()
        .map(|g| GroupJson {
            name: &g.name,
            ranges: g.ranges.iter().map(|r| [r.start, r.end]).collect(),
            weight_decay: g.weight_decay,
            lr_scale: g.lr_scale,
        })
        .collect();
    let groups_json =
        serde_json::to_string(&groups).map_err(|e| err(format!("cannot encode groups: {e}")))?;
    let metadata: BTreeMap<&str, String> = BTreeMap::from([
        ("format", state.format.to_string()),
        ("format_version", FORMAT_VERSION.to_string()),
        ("step", state.step.to_string()),
        ("numel", state.numel.to_string()),
        ("config", config_json),
        ("groups", groups_json),
    ]);
    for (name, data) in &state.tensors {
        if data.len() != state.numel {
            return Err(err(format!(
                "buffer `{name}` has {} elements, expected {}",
                data.len(),
                state.numel
            )));
        }
    }
    let mut tensors = state.tensors;
    tensors.sort_by_key(|&(name, _)| name);
    let header = header(&metadata, &tensors);
    tilearn_ops::fs::write_atomic(path, |f| {
        f.write_all(&(header.len() as u64).to_le_bytes())?;
        f.write_all(&header)?;
        for (_, data) in &tensors {
            write_f32_le(f, data)?;
        }
        Ok(())
    })
    .map_err(|e| {
        err(format!(
            "cannot write {}: {e}",
            tilearn_ops::fs::tmp_path(path).display()
        ))
    })
}

/// The safetensors JSON header for 1-D F32 `tensors` (sorted by name, stored in that order),
/// padded with spaces to a multiple of 8 bytes as the safetensors writer does.
fn header(metadata: &BTreeMap<&str, String>, tensors: &[(&str, &[f32])]) -> Vec<u8> {
    // Inserted in sorted order (`__metadata__` sorts before the lowercase tensor names), so the
    // header is the same whether serde_json's map keeps sorted or insertion order.
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".to_string(), json!(metadata));
    let mut offset = 0usize;
    for &(name, data) in tensors {
        let end = offset + std::mem::size_of_val(data);
        let info = json!({"dtype": "F32", "shape": [data.len()], "data_offsets": [offset, end]});
        map.insert(name.to_string(), info);
        offset = end;
    }
    let mut bytes = Value::Object(map).to_string().into_bytes();
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    bytes
}

/// `data` as little-endian f32 bytes (borrowed without a copy on little-endian hosts).
fn write_f32_le(w: &mut impl Write, data: &[f32]) -> std::io::Result<()> {
    if cfg!(target_endian = "little") {
        w.write_all(bytemuck::cast_slice(data))
    } else {
        data.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
    }
}

/// A state file read back and checked against the expected format and `numel`.
pub(crate) struct LoadedState {
    pub step: u64,
    /// The requested tensors, in the order they were asked for.
    tensors: std::vec::IntoIter<Vec<f32>>,
}

impl LoadedState {
    /// The next requested tensor, in the order `want_for` named them; empty once all are taken
    /// — the value of a buffer an optimizer keeps empty when its config does not use it (e.g.
    /// amsgrad's maximum), which `want_for` then did not request.
    pub fn next_buffer(&mut self) -> Vec<f32> {
        self.tensors.next().unwrap_or_default()
    }
}

/// Reads a state file of format `format` for `numel` parameters. `want_for(config)` is called
/// with the file's config and lists the tensors to read (a buffer that exists only for some
/// configurations is requested only then), or says why the file does not fit. Every failure is
/// `OptimError::State` naming `path`.
pub(crate) fn load<C: DeserializeOwned>(
    path: &Path,
    format: &str,
    numel: usize,
    want_for: impl FnOnce(&C) -> std::result::Result<Vec<&'static str>, String>,
) -> Result<LoadedState> {
    read(path, format, numel, want_for).map_err(|message| OptimError::State {
        file: path.to_path_buf(),
        message,
    })
}

fn read<C: DeserializeOwned>(
    path: &Path,
    format: &str,
    numel: usize,
    want_for: impl FnOnce(&C) -> std::result::Result<Vec<&'static str>, String>,
) -> std::result::Result<LoadedState, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| format!("not a valid safetensors file: {e}"))?;
    let meta = header
        .metadata()
        .as_ref()
        .ok_or_else(|| format!("no metadata (not a {format} state file)"))?;
    let get = |key: &str| {
        meta.get(key)
            .ok_or_else(|| format!("metadata `{key}` missing"))
    };
    let file_format = get("format")?;
    if file_format != format {
        return Err(format!(
            "metadata format is `{file_format}`, expected `{format}`"
        ));
    }
    let version = get("format_version")?;
    if version != FORMAT_VERSION {
        return Err(format!(
            "format version {version} is not supported (expected {FORMAT_VERSION})"
        ));
    }
    let step: u64 = get("step")?
        .parse()
        .map_err(|e| format!("metadata `step` is not an integer: {e}"))?;
    let file_numel: usize = get("numel")?
        .parse()
        .map_err(|e| format!("metadata `numel` is not an integer: {e}"))?;
    if file_numel != numel {
        return Err(format!(
            "state is for {file_numel} parameters, this optimizer has {numel}"
        ));
    }
    let config: C = serde_json::from_str(get("config")?)
        .map_err(|e| format!("metadata `config` is not valid JSON: {e}"))?;
    let wanted = want_for(&config)?;

    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| format!("not a valid safetensors file: {e}"))?;
    let mut tensors = Vec::with_capacity(wanted.len());
    for name in wanted {
        let view = st
            .tensor(name)
            .map_err(|e| format!("tensor `{name}`: {e}"))?;
        if view.dtype() != Dtype::F32 {
            return Err(format!(
                "tensor `{name}` has dtype {:?}, expected F32",
                view.dtype()
            ));
        }
        if view.shape() != [numel] {
            return Err(format!(
                "tensor `{name}` has shape {:?}, expected [{numel}]",
                view.shape()
            ));
        }
        tensors.push(
            view.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        );
    }
    Ok(LoadedState {
        step,
        tensors: tensors.into_iter(),
    })
}
