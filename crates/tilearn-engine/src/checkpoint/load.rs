//! Loading Hugging Face safetensors weights (single file or sharded) into a [`ParamStore`] or,
//! streamed, into any [`TensorDest`] (the GPU engine's staging buffer).
//!
//! Files are memory-mapped and read front to back: each tensor is decoded into the
//! destination's buffers piece by piece and the pages already consumed are handed back to the
//! kernel ([`MappedFile::release`]), so resident host memory stays bounded by the destination's
//! piece size, not the checkpoint's size.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::qkv_interleave::QkvInterleave;
use super::safetensors_io::{MappedFile, check_dtype, decode_into};
use super::{INDEX_FILE, SINGLE_FILE};
use crate::config::{LlamaConfig, ModelFamily};
use crate::error::{EngineError, Result};
use crate::params::{ParamSpec, ParamStore};
use crate::tensor_io::TensorDest;

/// Loads the weights in `dir` for a model described by `config`.
pub fn load_params(dir: &Path, config: &LlamaConfig) -> Result<ParamStore> {
    let mut params = ParamStore::from_config(config);
    load_params_into(dir, config, &mut params)?;
    Ok(params)
}

/// The files holding the weights and, for a sharded checkpoint, the tensor → file map.
struct Layout {
    files: Vec<PathBuf>,
    weight_map: Option<serde_json::Map<String, Value>>,
    index_path: PathBuf,
}

fn layout(dir: &Path) -> Result<Layout> {
    let index_path = dir.join(INDEX_FILE);
    let single = dir.join(SINGLE_FILE);
    if index_path.is_file() {
        let text = std::fs::read_to_string(&index_path)
            .map_err(|e| EngineError::io(&index_path, "read", e))?;
        let bad = |message: String| EngineError::Checkpoint {
            file: index_path.clone(),
            tensor: "<index>".into(),
            message,
        };
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| bad(format!("not valid JSON ({e}); re-save the checkpoint")))?;
        let Some(Value::Object(map)) = value.get("weight_map") else {
            return Err(bad(
                "has no \"weight_map\" object; re-save the checkpoint (transformers writes \
                 {\"metadata\": {...}, \"weight_map\": {tensor: file}})"
                    .into(),
            ));
        };
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let Some(file) = file.as_str() else {
                return Err(EngineError::Checkpoint {
                    file: index_path.clone(),
                    tensor: tensor.clone(),
                    message: format!("weight_map entry {file} is not a file name string"),
                });
            };
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(EngineError::Checkpoint {
                    file: index_path.clone(),
                    tensor: tensor.clone(),
                    message: format!(
                        "weight_map entry \"{file}\" is not a plain file name in the checkpoint \
                         directory"
                    ),
                });
            }
            files.insert(file.to_string());
        }
        Ok(Layout {
            files: files.into_iter().map(|f| dir.join(f)).collect(),
            weight_map: Some(map.clone()),
            index_path,
        })
    } else if single.is_file() {
        Ok(Layout {
            files: vec![single],
            weight_map: None,
            index_path,
        })
    } else {
        Err(EngineError::Checkpoint {
            file: single,
            tensor: "<all>".into(),
            message: format!(
                "no {SINGLE_FILE} and no {INDEX_FILE} in {}; point to a directory saved by \
                 save_pretrained",
                dir.display()
            ),
        })
    }
}

/// Tensors a Llama checkpoint may hold that the model does not take: a tied model's
/// `lm_head.weight` (transformers ignores it too) and rotary `inv_freq` buffers of old saves.
fn ignorable(name: &str, index: &HashMap<&str, usize>) -> bool {
    (name == "lm_head.weight" && !index.contains_key("lm_head.weight"))
        || name.ends_with("rotary_emb.inv_freq")
}

/// Loads the weights in `dir` into `params` (whose layout says which tensors are expected) of
/// a model described by `config`.
pub fn load_params_into(dir: &Path, config: &LlamaConfig, params: &mut ParamStore) -> Result<()> {
    let mut dest: &mut [f32] = &mut params.data;
    load_into(dir, config, &params.specs, &mut dest)
}

/// Loads the weights in `dir` for the tensors `specs` of a model described by `config` into
/// `dest` at the specs' ranges, tensor by tensor in file order. Every expected tensor must be
/// present exactly once with its shape; errors name the file and the tensor. Bloom's
/// `query_key_value` tensors are de-interleaved on the way (see `qkv_interleave.rs`), and its
/// tensor names are found with or without the `transformer.` prefix.
pub fn load_into(
    dir: &Path,
    config: &LlamaConfig,
    specs: &[ParamSpec],
    dest: &mut dyn TensorDest,
) -> Result<()> {
    let qkv = QkvInterleave::of(config, specs);
    let mut dest = qkv.dest(dest);
    let dest: &mut dyn TensorDest = &mut dest;
    let layout = layout(dir)?;
    let index: HashMap<&str, usize> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();
    let mut loaded = vec![false; specs.len()];
    for path in &layout.files {
        let mapped = MappedFile::open(path)?;
        mapped.expect_sequential();
        let st = mapped.tensors()?;
        // Check every tensor of the file (in name order) before loading any, so a mismatch is
        // reported at once rather than after most of a large checkpoint was read.
        let mut names = st.names();
        names.sort_unstable();
        let mut to_load = Vec::with_capacity(names.len());
        for name in names {
            let err = |message: String| EngineError::Checkpoint {
                file: path.clone(),
                tensor: name.to_string(),
                message,
            };
            // Bloom checkpoints name their tensors with or without `transformer.` (the bare
            // `BloomModel` saves them without).
            let found = index.get(name).or_else(|| {
                (config.family == ModelFamily::Bloom)
                    .then(|| index.get(format!("transformer.{name}").as_str()))
                    .flatten()
            });
            let Some(&i) = found else {
                if ignorable(name, &index) {
                    continue;
                }
                return Err(err(
                    "unexpected tensor: a LlamaForCausalLM with this config.json has no such \
                     parameter; check num_hidden_layers, attention_bias, mlp_bias and \
                     tie_word_embeddings in config.json"
                        .into(),
                ));
            };
            let view = st.tensor(name).map_err(|e| err(format!("{e}")))?;
            let spec = &specs[i];
            if view.shape() != spec.shape.as_slice() {
                return Err(err(format!(
                    "has shape {:?} but config.json expects {:?}; the weights do not match \
                     config.json",
                    view.shape(),
                    spec.shape
                )));
            }
            if loaded[i] {
                return Err(err(
                    "appears in more than one file; keep one copy per tensor".into(),
                ));
            }
            check_dtype(view.dtype()).map_err(err)?;
            loaded[i] = true;
            to_load.push((name, i, view));
        }
        // File order, so the disk is read front to back (and read ahead of the decoding).
        to_load.sort_by_key(|(_, _, v)| v.data().as_ptr() as usize);
        mapped.reading_ahead(|| -> Result<()> {
            for (name, i, view) in to_load {
                let spec = &specs[i];
                let (dtype, bytes) = (view.dtype(), view.data());
                let esize = bytes.len() / spec.numel().max(1);
                dest.write(spec.range(), &mut |offset, buf| {
                    let piece = &bytes[offset * esize..(offset + buf.len()) * esize];
                    decode_into(dtype, piece, buf).map_err(|message| EngineError::Checkpoint {
                        file: path.clone(),
                        tensor: name.to_string(),
                        message,
                    })?;
                    mapped.release(piece);
                    Ok(())
                })?;
            }
            Ok(())
        })?;
    }
    if let Some(i) = loaded.iter().position(|&l| !l) {
        let spec = &specs[i];
        let file = match &layout.weight_map {
            Some(map) => match map.get(&spec.name).and_then(Value::as_str) {
                Some(f) => dir.join(f),
                None => layout.index_path.clone(),
            },
            None => layout.files[0].clone(),
        };
        return Err(EngineError::Checkpoint {
            file,
            tensor: spec.name.clone(),
            message: format!(
                "missing (expected shape {:?}); the weights do not match config.json",
                spec.shape
            ),
        });
    }
    Ok(())
}
