//! A checkpoint's `optimizer.safetensors`, streamed: the file [`tilearn_optim::AdamW::save_state`]
//! writes and [`tilearn_optim::AdamW::load_state`] reads (format `tilearn-adamw` version 1:
//! 1-D F32 `exp_avg` and `exp_avg_sq` of `numel` elements; metadata `format`,
//! `format_version`, `step`, `numel`, `config`, `groups`), written from a [`TensorSource`] and
//! read into a [`TensorDest`] piece by piece, so the GPU engine saves and resumes its moments
//! without a host copy. Tests pin both directions against tilearn-optim's own reader and writer.
//!
//! The moments are addressed as one flat range: `0..numel` is `exp_avg`,
//! `numel..2 * numel` is `exp_avg_sq`.
//!
//! The file of a rank that holds slices of the model (tensor or pipeline parallelism) also
//! carries the metadata `layout`: JSON, the [`TensorSlice`]s its elements are, in order (full
//! shape and the slice of each tensor), which is what lets another layout re-shard it. The key
//! is optional: a file without it holds a range of the whole model's flat buffer, and
//! tilearn-optim's reader ignores it.
use std::ops::Range;
use std::path::Path;

use safetensors::Dtype;
use serde::Serialize;
use tilearn_optim::{AdamWConfig, OptimError, ParamGroup};

use super::optimizer_layout::TensorSlice;
use crate::Result;
use crate::checkpoint::{MappedFile, StreamedTensor, TensorDest, TensorSource, decode_into};

const FORMAT: &str = "tilearn-adamw";
const FORMAT_VERSION: &str = "1";
const TENSORS: [&str; 2] = ["exp_avg", "exp_avg_sq"];
const LAYOUT_KEY: &str = "layout";

/// Host moment buffers as the [`TensorSource`] of [`write`].
pub struct HostMoments<'a> {
    pub exp_avg: &'a [f32],
    pub exp_avg_sq: &'a [f32],
}

impl TensorSource for HostMoments<'_> {
    fn read(
        &mut self,
        range: std::ops::Range<usize>,
        sink: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let n = self.exp_avg.len();
        if range.start >= n {
            sink(&self.exp_avg_sq[range.start - n..range.end - n])
        } else {
            sink(&self.exp_avg[range])
        }
    }
}

#[derive(Serialize)]
struct GroupJson<'a> {
    name: &'a str,
    ranges: Vec<[usize; 2]>,
    weight_decay: f32,
    lr_scale: f32,
}

/// Writes the AdamW state of `numel` parameters at optimizer step `step` to `path`
/// atomically, reading the moments from `source` (layout in the module docs).
pub fn write(
    path: &Path,
    config: &AdamWConfig,
    groups: &[ParamGroup],
    step: u64,
    numel: usize,
    source: &mut dyn TensorSource,
) -> Result<()> {
    write_sliced(path, config, groups, step, numel, None, source)
}

/// [`write`] with the `layout` metadata: the slices of the model the `numel` elements are.
pub fn write_sliced(
    path: &Path,
    config: &AdamWConfig,
    groups: &[ParamGroup],
    step: u64,
    numel: usize,
    layout: Option<&[TensorSlice]>,
    source: &mut dyn TensorSource,
) -> Result<()> {
    let state_err = |message: String| OptimError::State {
        file: path.to_path_buf(),
        message,
    };
    if config.amsgrad {
        return Err(state_err(
            "internal: the streamed state file holds no max_exp_avg_sq; amsgrad is not supported"
                .into(),
        )
        .into());
    }
    let config_json = serde_json::to_string(config)
        .map_err(|e| state_err(format!("cannot encode config: {e}")))?;
    let groups: Vec<GroupJson<'_>> = groups
        .iter()
        .map(|g| GroupJson {
            name: &g.name,
            ranges: g.ranges.iter().map(|r| [r.start, r.end]).collect(),
            weight_decay: g.weight_decay,
            lr_scale: g.lr_scale,
        })
        .collect();
    let groups_json = serde_json::to_string(&groups)
        .map_err(|e| state_err(format!("cannot encode groups: {e}")))?;
    let layout_json = layout
        .map(|slices| {
            if slices.iter().map(TensorSlice::len).sum::<usize>() != numel {
                return Err(state_err(format!(
                    "internal: the layout's slices do not add up to {numel} elements"
                )));
            }
            serde_json::to_string(slices)
                .map_err(|e| state_err(format!("cannot encode layout: {e}")))
        })
        .transpose()?;
    let (step, numel_text) = (step.to_string(), numel.to_string());
    let mut metadata = vec![
        ("format", FORMAT),
        ("format_version", FORMAT_VERSION),
        ("step", step.as_str()),
        ("numel", numel_text.as_str()),
        ("config", config_json.as_str()),
        ("groups", groups_json.as_str()),
    ];
    if let Some(json) = &layout_json {
        metadata.push((LAYOUT_KEY, json.as_str()));
    }
    let tensors: Vec<StreamedTensor> = TENSORS
        .iter()
        .enumerate()
        .map(|(k, name)| StreamedTensor {
            name: name.to_string(),
            shape: vec![numel],
            range: k * numel..(k + 1) * numel,
        })
        .collect();
    crate::checkpoint::write_streamed(path, &tensors, tilearn_ops::DType::F32, &metadata, source)?;
    Ok(())
}

/// Reads the AdamW state at `path` for `numel` parameters into `dest` (layout in the module
/// docs) and returns its step count. Every field is checked before any value is written; a
/// bad file is `OptimError::State` naming it.
pub fn read(path: &Path, numel: usize, dest: &mut dyn TensorDest) -> Result<u64> {
    let file = StateFile::open(path, Some(numel))?;
    file.mapped.expect_sequential();
    file.mapped.reading_ahead(|| -> Result<()> {
        for moment in 0..TENSORS.len() {
            file.read_into(moment, 0..numel, dest, moment * numel)?;
        }
        Ok(())
    })?;
    Ok(file.step)
}

/// An optimizer state file opened and checked, read piece by piece from its mapping (a
/// re-sharding rank touches only the pages of the elements it takes).
pub struct StateFile {
    mapped: MappedFile,
    pub step: u64,
    pub numel: usize,
    /// The `layout` metadata, checked against `numel` and the slices' shapes.
    pub layout: Option<Vec<TensorSlice>>,
    /// Byte offsets of `exp_avg` and `exp_avg_sq` in the file.
    data: [usize; 2],
}

impl StateFile {
    /// Opens and checks the file at `path` (of `numel` parameters when given). Every failure
    /// is `OptimError::State` naming the file.
    pub fn open(path: &Path, numel: Option<usize>) -> Result<StateFile> {
        let state_err = |message: String| OptimError::State {
            file: path.to_path_buf(),
            message,
        };
        let mapped = MappedFile::open(path)?;
        let st = mapped
            .tensors()
            .map_err(|e| state_err(format!("not a valid safetensors file: {e}")))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(mapped.bytes())
            .map_err(|e| state_err(format!("not a valid safetensors file: {e}")))?;
        let meta = header
            .metadata()
            .as_ref()
            .ok_or_else(|| state_err("no metadata (not an AdamW state file)".into()))?;
        let get = |key: &str| {
            meta.get(key)
                .ok_or_else(|| state_err(format!("metadata `{key}` missing")))
        };
        let format = get("format")?;
        if format != FORMAT {
            return Err(state_err(format!(
                "metadata format is `{format}`, expected `{FORMAT}`"
            ))
            .into());
        }
        let version = get("format_version")?;
        if version != FORMAT_VERSION {
            return Err(state_err(format!(
                "format version {version} is not supported (expected {FORMAT_VERSION})"
            ))
            .into());
        }
        let step: u64 = get("step")?
            .parse()
            .map_err(|e| state_err(format!("metadata `step` is not an integer: {e}")))?;
        let file_numel: usize = get("numel")?
            .parse()
            .map_err(|e| state_err(format!("metadata `numel` is not an integer: {e}")))?;
        if let Some(numel) = numel
            && file_numel != numel
        {
            return Err(state_err(format!(
                "state is for {file_numel} parameters, this optimizer has {numel}"
            ))
            .into());
        }
        let numel = file_numel;
        let config: AdamWConfig = serde_json::from_str(get("config")?)
            .map_err(|e| state_err(format!("metadata `config` is not valid JSON: {e}")))?;
        if config.amsgrad {
            return Err(state_err(
                "state was saved with amsgrad = true, this optimizer has amsgrad = false".into(),
            )
            .into());
        }
        let layout = meta
            .get(LAYOUT_KEY)
            .map(|json| {
                let slices: Vec<TensorSlice> = serde_json::from_str(json)
                    .map_err(|e| state_err(format!("metadata `layout` is not valid: {e}")))?;
                if let Some(bad) = slices.iter().find(|s| !s.is_consistent()) {
                    return Err(state_err(format!(
                        "metadata `layout`: the slice of `{}` does not fit its shape {:?}",
                        bad.name, bad.shape
                    )));
                }
                let total: usize = slices.iter().map(TensorSlice::len).sum();
                if total != numel {
                    return Err(state_err(format!(
                        "metadata `layout` describes {total} elements, the file holds {numel}"
                    )));
                }
                Ok(slices)
            })
            .transpose()?;
        let base = mapped.bytes().as_ptr() as usize;
        let mut data = [0usize; 2];
        for (k, name) in TENSORS.into_iter().enumerate() {
            let view = st
                .tensor(name)
                .map_err(|e| state_err(format!("tensor `{name}`: {e}")))?;
            if view.dtype() != Dtype::F32 {
                return Err(state_err(format!(
                    "tensor `{name}` has dtype {:?}, expected F32",
                    view.dtype()
                ))
                .into());
            }
            if view.shape() != [numel] {
                return Err(state_err(format!(
                    "tensor `{name}` has shape {:?}, expected [{numel}]",
                    view.shape()
                ))
                .into());
            }
            data[k] = view.data().as_ptr() as usize - base;
        }
        drop(st);
        Ok(StateFile {
            mapped,
            step,
            numel,
            layout,
            data,
        })
    }

    pub fn path(&self) -> &Path {
        &self.mapped.path
    }

    /// Decodes elements `src` of moment `moment` (0: `exp_avg`, 1: `exp_avg_sq`) into
    /// `dest[at..at + src.len()]`.
    pub fn read_into(
        &self,
        moment: usize,
        src: Range<usize>,
        dest: &mut dyn TensorDest,
        at: usize,
    ) -> Result<()> {
        let start = self.data[moment] + src.start * 4;
        let bytes = &self.mapped.bytes()[start..start + src.len() * 4];
        dest.write(at..at + src.len(), &mut |offset, buf| {
            let piece = &bytes[offset * 4..(offset + buf.len()) * 4];
            decode_into(Dtype::F32, piece, buf).map_err(|message| OptimError::State {
                file: self.mapped.path.clone(),
                message,
            })?;
            self.mapped.release(piece);
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use tilearn_optim::AdamW;

    use super::*;

    fn optimizer(numel: usize) -> AdamW {
        let config = AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            amsgrad: false,
        };
        let groups = vec![
            ParamGroup {
                name: "decay".into(),
                ranges: std::iter::once(0..6).collect(),
                weight_decay: 0.1,
                lr_scale: 1.0,
            },
            ParamGroup {
                name: "no_decay".into(),
                ranges: std::iter::once(6..numel).collect(),
                weight_decay: 0.0,
                lr_scale: 1.0,
            },
        ];
        AdamW::new(config, groups, numel).unwrap()
    }

    fn moments(numel: usize) -> (Vec<f32>, Vec<f32>) {
        let m = (0..numel).map(|i| i as f32 * 0.25 - 1.0).collect();
        let v = (0..numel).map(|i| (i * i) as f32 * 1e-3).collect();
        (m, v)
    }

    #[test]
    fn streamed_file_is_what_adamw_load_state_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optimizer.safetensors");
        let numel = 10;
        let opt = optimizer(numel);
        let (m, v) = moments(numel);
        let both: Vec<f32> = m.iter().chain(&v).copied().collect();
        let mut source: &[f32] = &both;
        write(&path, opt.config(), opt.groups(), 7, numel, &mut source).unwrap();
        let mut back = optimizer(numel);
        back.load_state(&path).unwrap();
        assert_eq!(back.step_count(), 7);
        assert_eq!(back.exp_avg(), m.as_slice());
        assert_eq!(back.exp_avg_sq(), v.as_slice());
    }

    /// The GPU engine's save → restore → save round trip on host buffers: the second file is
    /// byte for byte the first.
    #[test]
    fn a_state_read_back_writes_an_identical_file() {
        let dir = tempfile::tempdir().unwrap();
        let numel = 10;
        let opt = optimizer(numel);
        let (m, v) = moments(numel);
        let first = dir.path().join("first.safetensors");
        let mut source = HostMoments {
            exp_avg: &m,
            exp_avg_sq: &v,
        };
        write(&first, opt.config(), opt.groups(), 5, numel, &mut source).unwrap();
        let mut both = vec![0.0f32; 2 * numel];
        let step = read(&first, numel, &mut &mut both[..]).unwrap();
        let again = dir.path().join("again.safetensors");
        let mut source: &[f32] = &both;
        write(&again, opt.config(), opt.groups(), step, numel, &mut source).unwrap();
        assert!(
            std::fs::read(&first).unwrap() == std::fs::read(&again).unwrap(),
            "the optimizer file differs after a read-back"
        );
    }

    #[test]
    fn reads_what_adamw_save_state_writes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optimizer.safetensors");
        let numel = 10;
        let mut opt = optimizer(numel);
        let (m, v) = moments(numel);
        opt.set_state(m.clone(), v.clone(), None, 3).unwrap();
        opt.save_state(&path).unwrap();
        let mut both = vec![0.0f32; 2 * numel];
        let e = read(&path, numel + 1, &mut &mut both[..]).unwrap_err();
        assert!(e.to_string().contains("state is for 10 parameters"), "{e}");
        assert_eq!(read(&path, numel, &mut &mut both[..]).unwrap(), 3);
        assert_eq!(&both[..numel], m.as_slice());
        assert_eq!(&both[numel..], v.as_slice());
    }
}
