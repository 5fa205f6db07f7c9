//! Optimizer state files: named flat f32 buffers plus string metadata in one safetensors
//! file, written atomically (`<path>.tmp`, fsync, rename) and read back with every field
//! checked, so a bad file is an error and never a silently wrong resume.
//!
//! Layout (shared by Adam, SGD, LAMB and Lion; AdamW keeps its own compatible writer):
//! tensors are 1-D F32 of `numel` elements; metadata holds `format` (e.g. `tilearn-sgd`),
//! `format_version`, `step`, `numel`, `config` (the optimizer's config as JSON) and `groups`
//! (JSON list of `{name, ranges, weight_decay, lr_scale}`).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, View};
use serde::Serialize;
use serde::de::DeserializeOwned;

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
    let metadata: HashMap<String, String> = [
        ("format", state.format.to_string()),
        ("format_version", FORMAT_VERSION.to_string()),
        ("step", state.step.to_string()),
        ("numel", state.numel.to_string()),
        ("config", config_json),
        ("groups", groups_json),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for (name, data) in &state.tensors {
        if data.len() != state.numel {
            return Err(err(format!(
                "buffer `{name}` has {} elements, expected {}",
                data.len(),
                state.numel
            )));
        }
    }
    let tensors: Vec<(&str, F32View<'_>)> = state
        .tensors
        .iter()
        .map(|&(name, data)| (name, F32View::new(data)))
        .collect();

    let tmp = tmp_path(path);
    let write = || -> std::result::Result<(), String> {
        safetensors::serialize_to_file(tensors, Some(metadata), &tmp)
            .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| format!("cannot sync {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .map_err(|e| format!("cannot rename {} into place: {e}", tmp.display()))
    };
    write().map_err(|message| {
        let _ = std::fs::remove_file(&tmp);
        err(message)
    })
}

/// A state file read back and checked against the expected format and `numel`.
pub(crate) struct StateIn {
    pub step: u64,
    /// The requested tensors, in the order they were asked for.
    pub tensors: Vec<Vec<f32>>,
}

/// Reads a state file of format `format` for `numel` parameters. `wanted` lists the tensors
/// to read; `want_for(config)` is called with the file's config to pick them (a buffer that
/// exists only for some configurations, e.g. amsgrad's maximum, is requested only then).
/// Every failure is `OptimError::State` naming `path`.
pub(crate) fn load<C: DeserializeOwned>(
    path: &Path,
    format: &str,
    numel: usize,
    want_for: impl FnOnce(&C) -> std::result::Result<Vec<&'static str>, String>,
) -> Result<StateIn> {
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
) -> std::result::Result<StateIn, String> {
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
    Ok(StateIn { step, tensors })
}

/// `<path>.tmp` (the suffix appended to the full file name).
fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// A borrowed f32 buffer as a 1-D safetensors F32 tensor (little-endian bytes; borrowed
/// without a copy on little-endian hosts).
struct F32View<'a> {
    data: &'a [f32],
    shape: [usize; 1],
}

impl<'a> F32View<'a> {
    fn new(data: &'a [f32]) -> Self {
        F32View {
            data,
            shape: [data.len()],
        }
    }
}

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            Cow::Borrowed(bytemuck::cast_slice(self.data))
        } else {
            Cow::Owned(self.data.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
    }

    fn data_len(&self) -> usize {
        std::mem::size_of_val(self.data)
    }
}
