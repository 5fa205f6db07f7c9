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

use std::collections::BTreeMap;
use std::io::Write;
use std::ops::Range;
use std::path::Path;

use half::{bf16, f16};
use rayon::prelude::*;
use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};
use serde::ser::{Serialize, SerializeMap, Serializer};
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
    // Validates the layout (offsets, sizes) as the safetensors writer would; the header itself
    // is serialised by `Header`, whose metadata order does not depend on a hash seed.
    Metadata::new(None, infos.clone()).map_err(|e| EngineError::Checkpoint {
        file: path.to_path_buf(),
        tensor: "<header>".into(),
        message: format!("cannot build the safetensors header: {e}"),
    })?;
    let header = Header {
        metadata: metadata.iter().copied().collect(),
        tensors: &infos,
    };
    let mut json = serde_json::to_vec(&header).expect("safetensors header serialises");
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut bytes = Vec::with_capacity(8 + json.len());
    bytes.extend_from_slice(&(json.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    Ok((bytes, offset as u64))
}

/// A safetensors JSON header laid out as the safetensors writer lays it out (`__metadata__`
/// first, then the tensors in file order), except that the metadata keys are sorted. The
/// safetensors crate keeps metadata in a `HashMap`, which iterates in a per-instance random
/// order: two saves of the same state wrote different headers whenever there was more than one
/// key (the optimizer file has six), so a restored run no longer saved byte-identical files.
struct Header<'a> {
    metadata: BTreeMap<&'a str, &'a str>,
    tensors: &'a [(String, TensorInfo)],
}

impl Serialize for Header<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(1 + self.tensors.len()))?;
        map.serialize_entry("__metadata__", &self.metadata)?;
        for (name, info) in self.tensors {
            map.serialize_entry(name, info)?;
        }
        map.end()
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_values_and_metadata_write_identical_files() {
        let dir = tempfile::tempdir().unwrap();
        let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
        let tensors = [
            StreamedTensor {
                name: "b".into(),
                shape: vec![2, 3],
                range: 0..6,
            },
            StreamedTensor {
                name: "a".into(),
                shape: vec![6],
                range: 6..12,
            },
        ];
        let metadata = [
            ("step", "3"),
            ("format", "x"),
            ("numel", "12"),
            ("config", "{}"),
            ("groups", "[]"),
            ("format_version", "1"),
        ];
        // Each save builds its header afresh; with a hash-ordered map the eight headers would
        // almost surely not all agree.
        let files: Vec<Vec<u8>> = (0..8)
            .map(|k| {
                let path = dir.path().join(format!("f{k}.safetensors"));
                let mut source: &[f32] = &values;
                write_streamed(&path, &tensors, DType::F32, &metadata, &mut source).unwrap();
                std::fs::read(&path).unwrap()
            })
            .collect();
        assert!(files.iter().all(|f| *f == files[0]), "saves differ");
        let header_len = u64::from_le_bytes(files[0][..8].try_into().unwrap()) as usize;
        let json = std::str::from_utf8(&files[0][8..8 + header_len]).unwrap();
        let keys = [
            "config",
            "format",
            "format_version",
            "groups",
            "numel",
            "step",
        ];
        let at: Vec<usize> = keys
            .iter()
            .map(|k| json.find(&format!("\"{k}\"")).unwrap())
            .collect();
        assert!(
            at.windows(2).all(|w| w[0] < w[1]),
            "metadata not sorted: {json}"
        );
        assert!(
            json.find("\"b\"") < json.find("\"a\""),
            "tensors not in file order: {json}"
        );
        let st = safetensors::SafeTensors::deserialize(&files[0]).unwrap();
        assert_eq!(st.tensor("a").unwrap().shape(), [6]);
        let (_, meta) = safetensors::SafeTensors::read_metadata(&files[0]).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["step"], "3");
    }
}
