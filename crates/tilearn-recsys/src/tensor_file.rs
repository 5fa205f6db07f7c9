//! Flat f32 tensors with string metadata in one safetensors file: the model file and the sparse
//! optimizer's state file of tilearn-recsys. Written atomically through `tilearn_ops::fs`; read
//! back with every tensor's dtype and length checked, each failure naming the file.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use crate::error::{RecsysError, Result};

/// Writes `tensors` (1-D f32) and one metadata entry `(key, value)` to `path` atomically.
/// One entry, because the safetensors writer emits its metadata map in hash order: several
/// keys would make equal states give different bytes (a resume is checked byte for byte).
pub fn write_f32_tensors(
    path: &Path,
    tensors: &[(&str, &[f32])],
    (key, value): (&str, String),
) -> Result<()> {
    let metadata = HashMap::from([(key.to_string(), value)]);
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, values)| values.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let mut views = Vec::with_capacity(tensors.len());
    for ((name, values), bytes) in tensors.iter().zip(&bytes) {
        let view = TensorView::new(Dtype::F32, vec![values.len()], bytes)
            .map_err(|e| format_error(path, format!("{name}: {e}")))?;
        views.push((*name, view));
    }
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| format_error(path, e.to_string()))?;
    tilearn_ops::fs::write_bytes_atomic(path, &bytes).map_err(|e| RecsysError::io(path, e))
}

fn format_error(path: &Path, message: String) -> RecsysError {
    RecsysError::Format {
        path: path.to_path_buf(),
        message,
    }
}

/// A safetensors file read into memory, its header parsed.
#[derive(Debug)]
pub struct F32TensorFile {
    path: PathBuf,
    bytes: Vec<u8>,
    metadata: HashMap<String, String>,
}

impl F32TensorFile {
    /// Reads and parses `path` (a missing or truncated file is an error naming it).
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| RecsysError::io(path, e))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| format_error(path, format!("not a valid safetensors file: {e}")))?;
        let metadata = meta.metadata().clone().unwrap_or_default();
        Ok(F32TensorFile {
            path: path.to_path_buf(),
            bytes,
            metadata,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// An error about this file.
    pub fn error(&self, message: impl Into<String>) -> RecsysError {
        format_error(&self.path, message.into())
    }

    /// The metadata value of `key` (`what` says what a file without it is not).
    pub fn metadata(&self, key: &str, what: &str) -> Result<&str> {
        self.metadata
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| self.error(format!("no `{key}` metadata: not a {what}")))
    }

    /// The tensor `name`, which must hold `len` f32 values.
    pub fn tensor(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let file = safetensors::SafeTensors::deserialize(&self.bytes)
            .map_err(|e| self.error(format!("not a valid safetensors file: {e}")))?;
        let t = file
            .tensor(name)
            .map_err(|e| self.error(format!("{name}: {e}")))?;
        if t.dtype() != Dtype::F32 || t.data().len() != 4 * len {
            return Err(self.error(format!("{name} is not {len} f32 values")));
        }
        Ok(t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}
