//! Low-level safetensors reading and writing: memory-mapping (with the pages of consumed bytes
//! handed back), dtype conversion to the f32 master copy, and whole-file helpers on top of the
//! streaming writer.

use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::{Advice, Mmap, UncheckedAdvice};
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};
use tilearn_ops::DType;

use super::read_ahead::{CHUNK_BYTES, ReadAhead, WINDOW_BYTES};
use super::stream::{StreamedTensor, write_streamed};
use crate::error::{EngineError, Result};
use crate::tensor_io::TensorSource;

/// Elements one rayon task decodes.
const DECODE_TASK: usize = 1 << 16;

/// Converts little-endian F32/BF16/F16 bytes into `dst` (in parallel for large tensors);
/// `Err` names the unsupported dtype.
pub(crate) fn decode_into(
    dtype: Dtype,
    bytes: &[u8],
    dst: &mut [f32],
) -> std::result::Result<(), String> {
    let esize = check_dtype(dtype)?;
    dst.par_chunks_mut(DECODE_TASK)
        .zip(bytes.par_chunks(DECODE_TASK * esize))
        .for_each(|(d, b)| decode_serial(dtype, b, d));
    Ok(())
}

/// The element size of a dtype the loaders read (F32, BF16, F16); `Err` names any other.
pub(crate) fn check_dtype(dtype: Dtype) -> std::result::Result<usize, String> {
    match dtype {
        Dtype::F32 => Ok(4),
        Dtype::BF16 | Dtype::F16 => Ok(2),
        other => Err(format!(
            "dtype {other:?} is not supported; store the weights as F32, BF16 or F16"
        )),
    }
}

/// [`decode_into`] on one thread, for a dtype it accepted.
fn decode_serial(dtype: Dtype, bytes: &[u8], dst: &mut [f32]) {
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
        _ => unreachable!("decode_into rejected other dtypes"),
    }
}

/// One tensor to write: name, shape and the f32 values.
pub type TensorRef<'a> = (&'a str, &'a [usize], &'a [f32]);

/// Host slices as one [`TensorSource`]: tensor `i` occupies the flat range after tensor
/// `i - 1`.
struct Slices<'a> {
    starts: Vec<usize>,
    parts: Vec<&'a [f32]>,
}

impl TensorSource for Slices<'_> {
    fn read(
        &mut self,
        range: std::ops::Range<usize>,
        sink: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let i = self
            .starts
            .binary_search(&range.start)
            .expect("ranges are those write_tensors_file built");
        sink(&self.parts[i][..range.len()])
    }
}

/// Writes a safetensors file with `tensors` (in the given order) stored as `dtype` and the
/// `__metadata__` entries `metadata`, atomically (see [`write_streamed`]). Returns the number
/// of tensor-data bytes written.
pub fn write_tensors_file(
    path: &Path,
    tensors: &[TensorRef<'_>],
    dtype: DType,
    metadata: &[(&str, &str)],
) -> Result<u64> {
    let mut entries = Vec::with_capacity(tensors.len());
    let mut source = Slices {
        starts: Vec::with_capacity(tensors.len()),
        parts: Vec::with_capacity(tensors.len()),
    };
    let mut start = 0;
    for &(name, shape, data) in tensors {
        entries.push(StreamedTensor {
            name: name.to_string(),
            shape: shape.to_vec(),
            range: start..start + data.len(),
        });
        source.starts.push(start);
        source.parts.push(data);
        start += data.len();
    }
    write_streamed(path, &entries, dtype, metadata, &mut source)
}

/// A memory-mapped safetensors file.
pub(crate) struct MappedFile {
    pub path: PathBuf,
    file: File,
    mmap: Mmap,
    /// Told how far [`MappedFile::release`] got, for [`MappedFile::reading_ahead`].
    read_ahead: ReadAhead,
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
            file,
            mmap,
            read_ahead: ReadAhead::new(WINDOW_BYTES, CHUNK_BYTES),
        })
    }

    /// Runs `consume` (which reads the mapping front to back and hands each consumed piece to
    /// [`MappedFile::release`]) while helper threads read the file into the page cache a
    /// bounded window ahead of it (see [`super::read_ahead`]).
    pub fn reading_ahead<R>(&self, consume: impl FnOnce() -> R) -> R {
        self.read_ahead
            .run(&self.file, self.mmap.len() as u64, consume)
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.mmap
    }

    /// Tells the kernel the file will be read front to back (read-ahead).
    pub fn expect_sequential(&self) {
        // Only a hint: a kernel that ignores it reads on demand as usual.
        let _ = self.mmap.advise(Advice::Sequential);
    }

    /// Hands back the pages of `bytes` (a sub-slice of this mapping that has been consumed), so
    /// the process's resident memory stays bounded while a large file is read; pages only
    /// partly inside `bytes` are kept. Also moves the read-ahead window past `bytes`.
    pub fn release(&self, bytes: &[u8]) {
        let base = self.mmap.as_ptr() as usize;
        let start = (bytes.as_ptr() as usize).saturating_sub(base);
        let end = (start + bytes.len()).min(self.mmap.len());
        self.read_ahead.advance(end as u64);
        let page = page_size();
        let (first, last) = (start.next_multiple_of(page), end / page * page);
        if last > first {
            // SAFETY: the mapping is read-only and file-backed (memmap2 maps it shared), so
            // MADV_DONTNEED only drops this process's page-table entries for [first, last), a
            // range inside the mapping; a later access faults the same bytes back in from the page
            // cache or the file, so every slice borrowed from the mapping stays valid and
            // unchanged (nothing writes through the mapping, so no data can be lost).
            let _ = unsafe {
                self.mmap
                    .unchecked_advise_range(UncheckedAdvice::DontNeed, first, last - first)
            };
        }
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

/// The virtual-memory page size.
fn page_size() -> usize {
    // SAFETY: sysconf only reads a system constant.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(1)
}
