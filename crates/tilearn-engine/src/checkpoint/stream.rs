//! Streaming tensor I/O: saves and loads move one bounded piece at a time between the values'
//! home (host memory, or device memory through a pinned staging buffer) and the file, so host
//! memory never holds a whole model or optimizer state.
//!
//! * A [`TensorSource`] hands out the f32 values of a flat index range in pieces; the writer
//!   ([`write_streamed`]) writes the safetensors header first (offsets computed from shapes and
//!   the dtype up front) and then each tensor's bytes, converted to the file dtype in pieces of
//!   at most [`PIECE_ELEMS`] elements, through [`AtomicFile`].
//! * A [`TensorDest`] lends host buffers covering a flat index range; loaders decode file bytes
//!   straight into them (the GPU's buffers are its staging memory, uploaded piece by piece).

use std::collections::HashMap;
use std::io::Write;
use std::ops::Range;
use std::path::Path;

use half::{bf16, f16};
use rayon::prelude::*;
use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};
use tilearn_ops::DType;
use tilearn_ops::fs::AtomicFile;

use crate::error::{EngineError, Result};
use crate::tensor_io::TensorSource;

/// Elements converted and written per piece (64 MiB of f32): the bound on the writer's own
/// buffer and on a GPU staging buffer.
pub const PIECE_ELEMS: usize = 16 << 20;

/// Elements one rayon task converts.
const TASK_ELEMS: usize = 1 << 16;

/// One tensor of a streamed file: its name, shape and the source range holding its values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    /// Flat f32 indices in the [`TensorSource`].
    pub range: Range<usize>,
}

/// The bytes of a safetensors file before its data: 8-byte little-endian header length, then
/// the JSON header padded with spaces to a multiple of 8 (as the safetensors writer does).
/// Returns it with the number of data bytes that follow.
pub fn safetensors_header(
    path: &Path,
    tensors: &[StreamedTensor],
    dtype: DType,
    metadata: &[(&str, &str)],
) -> Result<(Vec<u8>, u64)> {
    let esize = dtype.size_in_bytes();
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for t in tensors {
        let n: usize = t.shape.iter().product();
        if n != t.range.len() {
            return Err(EngineError::Checkpoint {
                file: path.to_path_buf(),
                tensor: t.name.clone(),
                message: format!(
                    "internal: shape {:?} has {n} elements but the source range has {}",
                    t.shape,
                    t.range.len()
                ),
            });
        }
        infos.push((
            t.name.clone(),
            TensorInfo {
                dtype: st_dtype(dtype),
                shape: t.shape.clone(),
                data_offsets: (offset, offset + n * esize),
            },
        ));
        offset += n * esize;
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
    let mut json = serde_json::to_vec(&header).expect("safetensors header serialises");
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = Vec::with_capacity(8 + json.len());
    bytes.extend_from_slice(&(json.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    Ok((bytes, offset as u64))
}

/// Writes a safetensors file at `path` atomically: the header, then every tensor's values read
/// from `source` and stored as `dtype` (round to nearest even for BF16/F16), piece by piece.
/// Returns the number of tensor-data bytes written. On error nothing replaces `path` and the
/// temporary file is removed.
pub fn write_streamed(
    path: &Path,
    tensors: &[StreamedTensor],
    dtype: DType,
    metadata: &[(&str, &str)],
    source: &mut dyn TensorSource,
) -> Result<u64> {
    let (header, data_bytes) = safetensors_header(path, tensors, dtype, metadata)?;
    let io_err = |e| EngineError::io(tilearn_ops::fs::tmp_path(path), "write", e);
    let mut file = AtomicFile::create(path).map_err(io_err)?;
    file.write_all(&header).map_err(io_err)?;
    let mut encoded: Vec<u8> = Vec::new();
    for t in tensors {
        source.read(t.range.clone(), &mut |values| {
            for piece in values.chunks(PIECE_ELEMS) {
                encode_into(dtype, piece, &mut encoded);
                file.write_all(&encoded).map_err(io_err)?;
            }
            Ok(())
        })?;
    }
    file.commit()
        .map_err(|e| EngineError::io(path, "finish writing (flush, sync, rename)", e))?;
    Ok(data_bytes)
}

/// `values` as little-endian `dtype` bytes in `out` (replacing its contents), converted in
/// parallel.
fn encode_into(dtype: DType, values: &[f32], out: &mut Vec<u8>) {
    let esize = dtype.size_in_bytes();
    out.clear();
    out.resize(values.len() * esize, 0);
    out.par_chunks_mut(TASK_ELEMS * esize)
        .zip(values.par_chunks(TASK_ELEMS))
        .for_each(|(dst, src)| match dtype {
            DType::F32 => dst
                .chunks_exact_mut(4)
                .zip(src)
                .for_each(|(d, x)| d.copy_from_slice(&x.to_le_bytes())),
            DType::BF16 => dst
                .chunks_exact_mut(2)
                .zip(src)
                .for_each(|(d, &x)| d.copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes())),
            DType::F16 => dst
                .chunks_exact_mut(2)
                .zip(src)
                .for_each(|(d, &x)| d.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes())),
        });
}

/// The safetensors dtype of a workspace dtype.
pub(crate) fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}
