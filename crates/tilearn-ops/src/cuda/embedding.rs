//! Wrappers of tilearn-kernels' `embedding.cu`: token embedding lookup and its deterministic
//! gradient, for every [`DeviceFloat`] (f32, bf16, f16; the table gradient is always f32). Same
//! contract as [`crate::cpu::embedding_forward`] / [`crate::cpu::embedding_backward`]: `dtable`
//! is accumulated (`+=`), and the result is bit-identical to the f32 CPU reference.
//!
//! Token ids live on the device, so the wrapper cannot check them without a host round trip.
//! Instead every launch records the first out-of-range id in a [`TokenIdCheck`] (a device word
//! written with an integer atomic min) and never reads or writes outside the table: the forward
//! fills such a row with NaN, the backward skips it. The caller reads the check when it chooses
//! (e.g. once per logging step) and gets [`OpsError::TokenOutOfRange`].
//!
//! The backward's sort buffers live in a caller-owned [`EmbeddingBackwardScratch`], allocated
//! once for the largest token count (a training step then allocates nothing).
//!
//! [`embedding_forward_slice`] / [`embedding_backward_slice`] are the vocabulary-parallel
//! lookup of a tensor-parallel rank holding rows `slice.start ..` of the vocabulary: ids of
//! other ranks give zero rows and are skipped by the backward (CPU reference:
//! [`crate::cpu::vocab_slice`]). The whole-table wrappers run the same body on the slice
//! `[0, vocab)` of a `vocab`-word vocabulary, as the kernels' whole-table entry points do.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::dtype::DeviceFloat;
use super::launch::{Launch, bind};
use crate::cpu::VocabSlice;
use crate::{OpsError, Result};

/// "No out-of-range id seen": the value the status word starts from.
const NO_ERROR: u64 = u64::MAX;

/// The device-side record of out-of-range token ids for one embedding table of `vocab` rows.
///
/// The embedding launches lower its word to `(position << 32) | id` of an offending row (atomic
/// min), so after several launches it names the smallest position of the earliest launch that
/// had one. [`take`](Self::take) reads and clears it.
#[derive(Debug)]
pub struct TokenIdCheck {
    word: CudaSlice<u64>,
    vocab: usize,
}

impl TokenIdCheck {
    /// A cleared check for a table of `vocab` rows, on the device of `stream`.
    pub fn new(stream: &Arc<CudaStream>, vocab: usize) -> Result<Self> {
        let word = stream.clone_htod(&[NO_ERROR]).map_err(|e| OpsError::Cuda {
            context: "TokenIdCheck::new",
            message: format!("cannot allocate the status word: {e}"),
        })?;
        Ok(TokenIdCheck { word, vocab })
    }

    /// Rows of the table whose launches this check accepts.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Waits for the work queued on `stream`, then returns
    /// [`OpsError::TokenOutOfRange`] if any launch since the last `take` met an id `>= vocab`,
    /// and clears the record either way.
    pub fn take(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        let op = "TokenIdCheck::take";
        let mut host = [NO_ERROR];
        let err = |e: cudarc::driver::DriverError| OpsError::Cuda {
            context: op,
            message: e.to_string(),
        };
        stream.memcpy_dtoh(&self.word, &mut host).map_err(err)?;
        stream.synchronize().map_err(err)?;
        if host[0] == NO_ERROR {
            return Ok(());
        }
        stream
            .memcpy_htod(&[NO_ERROR], &mut self.word)
            .map_err(err)?;
        Err(OpsError::TokenOutOfRange {
            id: host[0] as u32,
            position: (host[0] >> 32) as usize,
            vocab: self.vocab,
        })
    }
}

/// Device scratch of the embedding backward (the id sort's keys, positions and CUB's temporary
/// storage), sized once for up to `max_tokens` ids into a table of `vocab` rows. Clobbered by
/// each backward (calls on one stream are ordered).
#[derive(Debug)]
pub struct EmbeddingBackwardScratch {
    buf: CudaSlice<u8>,
}

impl EmbeddingBackwardScratch {
    /// Bytes the backward needs for `tokens` ids into `vocab` rows (CUB is asked on the
    /// stream's device, which is bound first).
    pub fn bytes_for(stream: &Arc<CudaStream>, tokens: usize, vocab: usize) -> Result<usize> {
        sort_scratch_bytes("EmbeddingBackwardScratch::bytes_for", stream, tokens, vocab)
    }

    /// Allocates (zero-filled) scratch for backward calls of up to `max_tokens` ids into a
    /// table of `vocab` rows. (CUB's storage grows with the item count, so the largest count
    /// covers the smaller ones; each call still checks its own need and errors rather than
    /// overrun.)
    pub fn new(stream: &Arc<CudaStream>, max_tokens: usize, vocab: usize) -> Result<Self> {
        let bytes = Self::bytes_for(stream, max_tokens, vocab)?;
        let buf = stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| OpsError::Cuda {
                context: "EmbeddingBackwardScratch::new",
                message: format!("cannot allocate {bytes} bytes of scratch: {e}"),
            })?;
        Ok(EmbeddingBackwardScratch { buf })
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.buf.num_bytes()
    }
}

/// Bytes of sort scratch the backward needs for `tokens` ids into `vocab` rows (CUB is asked on
/// the stream's device, which is bound first).
fn sort_scratch_bytes(
    op: &'static str,
    stream: &CudaStream,
    tokens: usize,
    vocab: usize,
) -> Result<usize> {
    bind(stream, op)?;
    // SAFETY: only asks CUB for its temporary-storage size on the current device (bound above);
    // reads and writes no memory.
    let bytes = unsafe { ffi::tilearn_embedding_backward_scratch_bytes(tokens, vocab) };
    if bytes == usize::MAX {
        return Err(OpsError::Cuda {
            context: op,
            message: format!("cannot size the sort scratch for {tokens} tokens"),
        });
    }
    Ok(bytes)
}

/// The length of a `[vocab, dim]` table (`len` elements now), refusing `dim == 0`.
fn table_len(op: &'static str, vocab: usize, dim: usize, len: usize) -> Result<usize> {
    if dim == 0 {
        return Err(OpsError::ShapeMismatch {
            op,
            expected: 1,
            actual: 0,
        });
    }
    vocab.checked_mul(dim).ok_or(OpsError::ShapeMismatch {
        op,
        expected: usize::MAX,
        actual: len,
    })
}

/// The length of the `[rows, dim]` activation (`len` elements now).
fn rows_len(op: &'static str, rows: usize, dim: usize, len: usize) -> Result<usize> {
    rows.checked_mul(dim).ok_or(OpsError::ShapeMismatch {
        op,
        expected: usize::MAX,
        actual: len,
    })
}

/// The kernels index rows and positions with u32 and launch one block per row (< 2^31).
fn rows_in_range(op: &'static str, rows: usize, vocab: usize) -> Result<()> {
    if rows > i32::MAX as usize || vocab > u32::MAX as usize {
        return Err(OpsError::Cuda {
            context: op,
            message: format!(
                "{rows} tokens / vocabulary {vocab} exceed the kernel's range (tokens < 2^31, \
                 vocabulary < 2^32)"
            ),
        });
    }
    Ok(())
}

/// `out[r, :] = table[ids[r], :]` (written, `=`). `table` is `[vocab, dim]` with `vocab =
/// check_ids.vocab()`, `out` is `[ids.len(), dim]`. An id `>= vocab` is recorded in `check_ids`
/// and its output row is filled with NaN; no out-of-bounds access happens.
///
/// Precision: a copy in `T` (no rounding), so bit-exact for every type.
pub fn embedding_forward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    ids: &impl DevicePtr<u32>,
    table: &impl DevicePtr<T>,
    dim: usize,
    out: &mut impl DevicePtrMut<T>,
    check_ids: &mut TokenIdCheck,
) -> Result<()> {
    let op = "tilearn_embedding_forward";
    let whole = VocabSlice::whole(check_ids.vocab);
    forward_rows(op, stream, ids, table, whole, dim, out, check_ids)
}

/// `dtable[ids[r], :] += dout[r, :]` for every row `r` in order (accumulates, `+=`). `dtable` is
/// the f32 `[vocab, dim]` gradient with `vocab = check_ids.vocab()`, `dout` is `[ids.len(), dim]`
/// in `T`. An id `>= vocab` is recorded in `check_ids` and its row skipped. `scratch` must cover
/// `ids.len()` tokens of this table.
///
/// Precision: `dout` is widened exactly to f32 and each `dtable` element gets the same f32 adds
/// in the same (position) order as [`crate::cpu::embedding_backward`]`::<f32>` on the widened
/// values: deterministic and bit-identical to that reference, with no float atomics.
pub fn embedding_backward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    ids: &impl DevicePtr<u32>,
    dout: &impl DevicePtr<T>,
    dim: usize,
    dtable: &mut impl DevicePtrMut<f32>,
    check_ids: &mut TokenIdCheck,
    scratch: &mut EmbeddingBackwardScratch,
) -> Result<()> {
    let op = "tilearn_embedding_backward";
    let whole = VocabSlice::whole(check_ids.vocab);
    backward_rows(
        op, stream, ids, dout, whole, dim, dtable, check_ids, scratch,
    )
}

/// The slice a `check_ids` of the whole vocabulary accepts, refused otherwise.
fn checked_slice(
    op: &'static str,
    slice: VocabSlice,
    check_ids: &TokenIdCheck,
) -> Result<VocabSlice> {
    let slice = VocabSlice::new(slice.start, slice.rows, slice.full)?;
    if check_ids.vocab != slice.full {
        return Err(OpsError::Cuda {
            context: op,
            message: format!(
                "the token id check covers a vocabulary of {} words, the slice one of {}; make \
                 the TokenIdCheck for the whole vocabulary",
                check_ids.vocab, slice.full
            ),
        });
    }
    Ok(slice)
}

/// The vocabulary-parallel lookup (written, `=`): `out[r, :] = table[ids[r] - slice.start, :]`
/// for the ids in the slice, zeros for the other ids of the vocabulary, so the sum of every
/// rank's output is [`embedding_forward`]'s. `table` is `[slice.rows, dim]`; `check_ids` covers
/// the whole vocabulary (`slice.full` words): an id `>= slice.full` is recorded there and its
/// row filled with NaN.
///
/// Precision: a copy in `T` (or exact zeros), bit-exact for every type.
pub fn embedding_forward_slice<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    ids: &impl DevicePtr<u32>,
    table: &impl DevicePtr<T>,
    slice: VocabSlice,
    dim: usize,
    out: &mut impl DevicePtrMut<T>,
    check_ids: &mut TokenIdCheck,
) -> Result<()> {
    let op = "tilearn_embedding_forward_slice";
    let slice = checked_slice(op, slice, check_ids)?;
    forward_rows(op, stream, ids, table, slice, dim, out, check_ids)
}

/// The vocabulary-parallel backward (accumulates, `+=`): `dtable[ids[r] - slice.start, :] +=
/// dout[r, :]` for the rows whose id the slice holds, in position order; the others are
/// skipped. `dtable` is the f32 `[slice.rows, dim]` gradient; `scratch` must cover `ids.len()`
/// tokens of a table of `slice.rows` rows.
///
/// Precision: as [`embedding_backward`] (bit-identical to the f32 CPU reference
/// [`crate::cpu::embedding_backward_slice`]).
#[allow(clippy::too_many_arguments)]
pub fn embedding_backward_slice<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    ids: &impl DevicePtr<u32>,
    dout: &impl DevicePtr<T>,
    slice: VocabSlice,
    dim: usize,
    dtable: &mut impl DevicePtrMut<f32>,
    check_ids: &mut TokenIdCheck,
    scratch: &mut EmbeddingBackwardScratch,
) -> Result<()> {
    let op = "tilearn_embedding_backward_slice";
    let slice = checked_slice(op, slice, check_ids)?;
    backward_rows(
        op, stream, ids, dout, slice, dim, dtable, check_ids, scratch,
    )
}

/// The lookup of both [`embedding_forward`] (the whole table is the slice `[0, vocab)`, which
/// the kernel's whole-table entry point passes too) and [`embedding_forward_slice`]: `slice`
/// is valid and covers `check_ids.vocab` words.
#[allow(clippy::too_many_arguments)]
fn forward_rows<T: DeviceFloat>(
    op: &'static str,
    stream: &Arc<CudaStream>,
    ids: &impl DevicePtr<u32>,
    table: &impl DevicePtr<T>,
    slice: VocabSlice,
    dim: usize,
    out: &mut impl DevicePtrMut<T>,
    check_ids: &mut TokenIdCheck,
) -> Result<()> {
    let table_len = table_len(op, slice.rows, dim, table.len())?;
    let rows = ids.len();
    let out_len = rows_len(op, rows, dim, out.len())?;
    rows_in_range(op, rows, slice.full)?;
    Launch::new(op, stream)
        .input("table", table, table_len)
        .output("out", out, out_len)
        .input("ids", ids, rows)
        .output("check", &mut check_ids.word, 1)
        .skip_launch_if(rows == 0)
        .run(|[table, ids], [out, status], stream| {
            // SAFETY: the launcher reads `rows` u32 ids and, for ids inside the slice only, rows
            // of the slice.rows * dim elements of T (`T::DTYPE`) of table; it writes rows * dim
            // to out and may lower the one u64 status word.
            unsafe {
                ffi::tilearn_embedding_forward_slice(
                    T::DTYPE,
                    ids.cast(),
                    table,
                    rows,
                    slice.start,
                    slice.rows,
                    slice.full,
                    dim,
                    out,
                    status.cast(),
                    stream,
                )
            }
        })
}

/// The backward of both [`embedding_backward`] (the whole table is the slice `[0, vocab)`) and
/// [`embedding_backward_slice`]: `slice` is valid and covers `check_ids.vocab` words.
#[allow(clippy::too_many_arguments)]
fn backward_rows<T: DeviceFloat>(
    op: &'static str,
    stream: &Arc<CudaStream>,
    ids: &impl DevicePtr<u32>,
    dout: &impl DevicePtr<T>,
    slice: VocabSlice,
    dim: usize,
    dtable: &mut impl DevicePtrMut<f32>,
    check_ids: &mut TokenIdCheck,
    scratch: &mut EmbeddingBackwardScratch,
) -> Result<()> {
    let dtable_len = table_len(op, slice.rows, dim, dtable.len())?;
    let rows = ids.len();
    let dout_len = rows_len(op, rows, dim, dout.len())?;
    rows_in_range(op, rows, slice.full)?;
    let have = scratch.buf.len();
    if rows > 0 {
        let need = sort_scratch_bytes(op, stream, rows, slice.rows)?;
        if have < need {
            return Err(OpsError::Cuda {
                context: op,
                message: format!(
                    "EmbeddingBackwardScratch holds {have} bytes, {rows} tokens need {need}"
                ),
            });
        }
    }
    Launch::new(op, stream)
        .output("dtable", dtable, dtable_len)
        .input("dout", dout, dout_len)
        .input("ids", ids, rows)
        .output("check", &mut check_ids.word, 1)
        .workspace("scratch", &mut scratch.buf)
        .skip_launch_if(rows == 0)
        .run(|[dout, ids], [dtable, status, scratch], stream| {
            // SAFETY: the launcher reads `rows` u32 ids and rows * dim elements of T
            // (`T::DTYPE`) of dout, adds into the rows of the slice.rows * dim f32 of dtable that
            // the slice's ids select, may lower the one u64 status word, and uses at most `have`
            // bytes of scratch (at least its need for slice.rows keys, checked above; it aligns
            // inside and writes every byte it later reads).
            unsafe {
                ffi::tilearn_embedding_backward_slice(
                    T::DTYPE,
                    ids.cast(),
                    dout,
                    rows,
                    slice.start,
                    slice.rows,
                    slice.full,
                    dim,
                    dtable.cast(),
                    status.cast(),
                    scratch,
                    have,
                    stream,
                )
            }
        })
}
