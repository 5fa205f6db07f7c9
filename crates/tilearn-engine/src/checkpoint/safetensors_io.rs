//! Low-level safetensors reading and writing: memory-mapping, dtype conversion to and from the
//! f32 master copy, and atomic (`<name>.tmp` + rename) file writes.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};
use tilearn_ops::DType;

use crate::error::{EngineError, Result};

/// `<path>.tmp`, the name a file is written under before it is renamed into place.
pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Writes a file through `write` to `<path>.tmp`, flushes and syncs it, then renames it to
/// `path`. On failure the temporary file is removed and `path` is untouched.
pub fn write_file_atomic(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<()> {
    let tmp = tmp_path(path);
    let result = (|| -> Result<()> {
        let file = File::create(&tmp).map_err(|e| EngineError::io(&tmp, "create", e))?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        write(&mut w).map_err(|e| EngineError::io(&tmp, "write", e))?;
        let file = w
            .into_inner()
            .map_err(|e| EngineError::io(&tmp, "write", e.into_error()))?;
        file.sync_all()
            .map_err(|e| EngineError::io(&tmp, "sync", e))?;
        Ok(())
    })();
    if let Err(e) = result {
        // Best effort: the temporary file may not exist or may be a directory in the way.
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, path).map_err(|e| EngineError::io(path, "rename the .tmp file onto", e))
}

pub(crate) fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

/// Converts little-endian F32/BF16/F16 bytes into `dst`; `Err` names the unsupported dtype.
pub(crate) fn decode_into(
    dtype: Dtype,
    bytes: &[u8],
    dst: &mut [f32],
) -> std::result::Result<(), String> {
    match dtype {
        Dtype::F32 => {
            for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        Dtype::BF16 => {
            for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        Dtype::F16 => {
            for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                *d = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        other => {
            return Err(format!(
                "dtype {other:?} is not supported; store the weights as F32, BF16 or F16"
            ));
        }
    }
    Ok(())
}

/// Writes `src` as little-endian `dtype` (round to nearest even for BF16/F16).
fn encode(dtype: DType, src: &[f32], w: &mut impl Write) -> std::io::Result<()> {
    const CHUNK: usize = 16 * 1024;
    let mut buf: Vec<u8> = Vec::with_capacity(CHUNK * 4);
    for chunk in src.chunks(CHUNK) {
        buf.clear();
        match dtype {
            DType::F32 => chunk
                .iter()
                .for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
            DType::BF16 => chunk
                .iter()
                .for_each(|&x| buf.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes())),
            DType::F16 => chunk
                .iter()
                .for_each(|&x| buf.extend_from_slice(&f16::from_f32(x).to_bits().to_le_bytes())),
        }
        w.write_all(&buf)?;
    }
    Ok(())
}

/// One tensor to write: name, shape and the f32 values.
pub type TensorRef<'a> = (&'a str, &'a [usize], &'a [f32]);

/// Writes a safetensors file with `tensors` (in the given order) stored as `dtype` and the
/// `__metadata__` entries `metadata`, atomically (`<path>.tmp` + rename). Returns the number of
/// tensor-data bytes written.
pub fn write_tensors_file(
    path: &Path,
    tensors: &[TensorRef<'_>],
    dtype: DType,
    metadata: &[(&str, &str)],
) -> Result<usize> {
    let esize = dtype.size_in_bytes();
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for &(name, shape, data) in tensors {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(EngineError::Checkpoint {
                file: path.to_path_buf(),
                tensor: name.to_string(),
                message: format!(
                    "internal: shape {shape:?} has {n} elements but {} values were given",
                    data.len()
                ),
            });
        }
        let bytes = n * esize;
        infos.push((
            name.to_string(),
            TensorInfo {
                dtype: st_dtype(dtype),
                shape: shape.to_vec(),
                data_offsets: (offset, offset + bytes),
            },
        ));
        offset += bytes;
    }
    let meta: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let header = Metadata::new(Some(meta), infos).map_err(|e| EngineError::Checkpoint {
        file: path.to_path_buf(),
        tensor: "<header>".into(),
        message: format!("cannot build the safetensors header: {e}"),
    })?;
    let mut header_bytes = serde_json::to_vec(&header).expect("safetensors header serialises");
    // The data section starts 8-byte aligned, as the safetensors writer does.
    header_bytes.resize(header_bytes.len().next_multiple_of(8), b' ');
    write_file_atomic(path, |w| {
        w.write_all(&(header_bytes.len() as u64).to_le_bytes())?;
        w.write_all(&header_bytes)?;
        for &(_, _, data) in tensors {
            encode(dtype, data, w)?;
        }
        Ok(())
    })?;
    Ok(offset)
}

/// A memory-mapped safetensors file.
pub(crate) struct MappedFile {
    pub path: PathBuf,
    mmap: Mmap,
}

impl MappedFile {
    pub fn open(path: &Path) -> Result<MappedFile> {
        let file = File::open(path).map_err(|e| EngineError::io(path, "open", e))?;
        // SAFETY: the mapping is read-only and lives as long as `MappedFile`. Another process
        // truncating or rewriting the file in place while it is mapped would be undefined
        // behaviour; tilearn itself never does (saves write `<name>.tmp` and rename), and
        // memory-mapping checkpoints is what transformers and safetensors do too.
        let mmap =
            unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(path, "memory-map", e))?;
        Ok(MappedFile {
            path: path.to_path_buf(),
            mmap,
        })
    }

    pub fn tensors(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.mmap).map_err(|e| EngineError::Checkpoint {
            file: self.path.clone(),
            tensor: "<header>".into(),
            message: format!(
                "not a valid safetensors file ({e}); re-save it, or delete it and its .tmp if a \
                 save was interrupted"
            ),
        })
    }
}

/// A tensor read from a safetensors file, converted to f32.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Reads every tensor of a safetensors file (F32/BF16/F16) as f32, in file order.
pub fn read_tensors_file(path: &Path) -> Result<Vec<NamedTensor>> {
    let mapped = MappedFile::open(path)?;
    let st = mapped.tensors()?;
    let mut views: Vec<_> = st.iter().collect();
    views.sort_by_key(|(_, v)| v.data().as_ptr() as usize);
    let mut out = Vec::with_capacity(views.len());
    for (name, view) in views {
        let n: usize = view.shape().iter().product();
        let mut values = vec![0.0f32; n];
        decode_into(view.dtype(), view.data(), &mut values).map_err(|message| {
            EngineError::Checkpoint {
                file: path.to_path_buf(),
                tensor: name.to_string(),
                message,
            }
        })?;
        out.push(NamedTensor {
            name: name.to_string(),
            shape: view.shape().to_vec(),
            data: values,
        });
    }
    Ok(out)
}
