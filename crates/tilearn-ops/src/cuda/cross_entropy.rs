//! Wrappers of `kernels/cross_entropy.cu`: token softmax cross-entropy over the vocabulary,
//! Hugging Face semantics (targets already shifted, `-100` ignored), same contract as
//! [`crate::cpu::cross_entropy_fused`] / [`crate::cpu::cross_entropy_forward`]:
//!
//! * the fused variant overwrites the logits in place with
//!   `(softmax(row) - onehot(target)) * grad_scale` (`=`; all zeros for ignored rows): no f32
//!   copy of the logits is ever made;
//! * every variant writes the per-row losses (f32, 0 for ignored rows) and, into a
//!   [`CeTotals`], the f64 sum of row losses and the valid-target count, reduced on the device
//!   in a fixed order (bit-identical run to run).
//!
//! Labels are checked on the device: a target that is neither `-100` nor in `0..vocab` is never
//! read out of bounds; its row gets a NaN loss (and a NaN gradient row), and the totals record
//! the first such position. [`CeTotals::read`] turns that into [`OpsError::LabelOutOfRange`].
//! Reading is the only synchronising step, so a training loop can launch every micro-batch
//! without waiting and check once, when it reads the loss for logging.

use std::ffi::c_int;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceSlice};
use half::bf16;

use super::ffi;
use super::launch::{bind, check, expect_len, raw_stream, same_device};
use crate::cpu::CeStats;
use crate::{OpsError, Result};

/// Number of f64 words the launchers write into the totals (see `tilearn_kernels.h`):
/// `[loss_sum, valid, first_bad_position or -1, first_bad_label]`.
const TOTALS_LEN: usize = 4;

/// Device-side totals of one cross-entropy launch: the f64 sum of row losses, the number of
/// valid targets, and the first out-of-range label. Allocate once and reuse; every launch
/// overwrites it (`=`).
#[derive(Debug)]
pub struct CeTotals {
    buf: CudaSlice<f64>,
    /// Vocabulary of the last launch that wrote `buf` (for the error message).
    vocab: usize,
}

impl CeTotals {
    /// Allocates the totals on `stream`'s device. Until a launch writes them they read as a NaN
    /// loss over 0 targets.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let buf = stream
            .clone_htod(&[f64::NAN, 0.0, -1.0, 0.0])
            .map_err(|e| OpsError::Cuda {
                context: "CeTotals::new",
                message: format!("cannot allocate the totals: {e}"),
            })?;
        Ok(CeTotals { buf, vocab: 0 })
    }

    /// The sum of row losses as a one-element device view (f64), for device-side use (e.g.
    /// dividing by the accumulated batch's target count) without a host round trip.
    pub fn loss_sum_device(&self) -> CudaView<'_, f64> {
        self.buf.slice(0..1)
    }

    /// The number of valid targets as a one-element device view (f64, exact below 2^53).
    pub fn valid_device(&self) -> CudaView<'_, f64> {
        self.buf.slice(1..2)
    }

    /// Copies the totals to the host and checks the labels.
    ///
    /// Cost: a 32-byte device-to-host copy on `stream` followed by a stream synchronisation, so
    /// the host waits for all work queued on `stream` so far and the GPU idles until the host
    /// queues more. Call it where the loss is needed anyway (logging, evaluation), not after
    /// every micro-batch: the totals of earlier launches are not kept, so to check every launch
    /// without a sync per launch, give each launch its own `CeTotals`.
    ///
    /// Errors: [`OpsError::LabelOutOfRange`] for the lowest position whose target was neither
    /// `-100` nor in `0..vocab` (its loss, and hence `loss_sum`, is NaN), or
    /// [`OpsError::Cuda`] when the copy or an earlier kernel on the stream failed.
    pub fn read(&self, stream: &Arc<CudaStream>) -> Result<CeStats> {
        same_device(stream, "CeTotals::read", "totals", &self.buf)?;
        let host = stream.clone_dtoh(&self.buf).map_err(|e| OpsError::Cuda {
            context: "CeTotals::read",
            message: format!("device-to-host copy failed: {e}"),
        })?;
        stream.synchronize().map_err(|e| OpsError::Cuda {
            context: "CeTotals::read",
            message: e.to_string(),
        })?;
        decode_totals(&host, self.vocab)
    }
}

/// Interprets the four words the kernel writes (layout in `tilearn_kernels.h`).
fn decode_totals(words: &[f64], vocab: usize) -> Result<CeStats> {
    let &[loss_sum, valid, bad_position, bad_label] = words else {
        return Err(OpsError::ShapeMismatch {
            op: "CeTotals::read",
            expected: TOTALS_LEN,
            actual: words.len(),
        });
    };
    if bad_position >= 0.0 {
        // Both are integers the kernel converted exactly (position < 2^31, label an i32).
        return Err(OpsError::LabelOutOfRange {
            label: bad_label as i32,
            position: bad_position as usize,
            vocab,
        });
    }
    Ok(CeStats {
        loss_sum,
        valid: valid as usize,
    })
}

type FusedLauncher<R> = unsafe extern "C" fn(
    *mut R,
    *const i32,
    usize,
    usize,
    f32,
    *mut f32,
    *mut f64,
    ffi::cudaStream_t,
) -> c_int;
type ForwardLauncher<R> = unsafe extern "C" fn(
    *const R,
    *const i32,
    usize,
    usize,
    *mut f32,
    *mut f64,
    ffi::cudaStream_t,
) -> c_int;

/// Checks what both variants share: `logits` is `[targets.len(), vocab]`, `row_loss` is
/// `[targets.len()]`, the row count fits the kernel's grid, and every buffer is on the stream's
/// device. Returns the row count.
fn validate<T>(
    op: &'static str,
    stream: &Arc<CudaStream>,
    logits: &impl DeviceSlice<T>,
    targets: &impl DeviceSlice<i32>,
    vocab: usize,
    row_loss: &impl DeviceSlice<f32>,
    totals: &CeTotals,
) -> Result<usize> {
    let rows = targets.len();
    let expected = rows.checked_mul(vocab).ok_or(OpsError::ShapeMismatch {
        op,
        expected: usize::MAX,
        actual: logits.len(),
    })?;
    expect_len(op, expected, logits.len())?;
    expect_len(op, rows, row_loss.len())?;
    if rows > i32::MAX as usize {
        return Err(OpsError::Cuda {
            context: op,
            message: format!("{rows} rows exceed the kernel's limit of {} rows", i32::MAX),
        });
    }
    same_device(stream, op, "logits", logits)?;
    same_device(stream, op, "targets", targets)?;
    same_device(stream, op, "row_loss", row_loss)?;
    same_device(stream, op, "totals", &totals.buf)?;
    Ok(rows)
}

fn grad_scale_f32(op: &'static str, grad_scale: f64) -> Result<f32> {
    let g = grad_scale as f32;
    if g.is_finite() {
        Ok(g)
    } else {
        Err(OpsError::Cuda {
            context: op,
            message: format!("grad_scale must be finite in f32, got {grad_scale}"),
        })
    }
}

#[allow(clippy::too_many_arguments)]
fn fused<T, R>(
    op: &'static str,
    launcher: FusedLauncher<R>,
    stream: &Arc<CudaStream>,
    logits: &mut impl DevicePtrMut<T>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    grad_scale: f64,
    row_loss: &mut impl DevicePtrMut<f32>,
    totals: &mut CeTotals,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
    let rows = validate(op, stream, logits, targets, vocab, row_loss, totals)?;
    let grad_scale = grad_scale_f32(op, grad_scale)?;
    bind(stream, op)?;
    let (logits_ptr, _logits) = logits.device_ptr_mut(stream);
    let (targets_ptr, _targets) = targets.device_ptr(stream);
    let (loss_ptr, _loss) = row_loss.device_ptr_mut(stream);
    let (totals_ptr, _totals) = totals.buf.device_ptr_mut(stream);
    // SAFETY: every pointer is a live allocation of the stream's context (checked above) with
    // the length the launcher uses: logits rows * vocab elements of the FFI type's size, targets
    // and row_loss rows, totals TOTALS_LEN (its private buffer is allocated with exactly that).
    // logits, row_loss and totals are borrowed mutably, so the outputs overlap no other buffer.
    // The kernel never indexes a row with an out-of-range target. The work is only enqueued on
    // `stream`; the guards order it after earlier writers and before later users.
    let status = unsafe {
        launcher(
            logits_ptr as *mut R,
            targets_ptr as *const i32,
            rows,
            vocab,
            grad_scale,
            loss_ptr as *mut f32,
            totals_ptr as *mut f64,
            raw_stream(stream),
        )
    };
    check(op, status)?;
    totals.vocab = vocab;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn forward<T, R>(
    op: &'static str,
    launcher: ForwardLauncher<R>,
    stream: &Arc<CudaStream>,
    logits: &impl DevicePtr<T>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    row_loss: &mut impl DevicePtrMut<f32>,
    totals: &mut CeTotals,
) -> Result<()> {
    const { assert!(size_of::<T>() == size_of::<R>()) };
    let rows = validate(op, stream, logits, targets, vocab, row_loss, totals)?;
    bind(stream, op)?;
    let (logits_ptr, _logits) = logits.device_ptr(stream);
    let (targets_ptr, _targets) = targets.device_ptr(stream);
    let (loss_ptr, _loss) = row_loss.device_ptr_mut(stream);
    let (totals_ptr, _totals) = totals.buf.device_ptr_mut(stream);
    // SAFETY: as in `fused`, except that logits are only read: live allocations of the stream's
    // context with the lengths the launcher uses (checked above), mutable outputs that overlap
    // nothing else, work enqueued on `stream` only and ordered by the guards.
    let status = unsafe {
        launcher(
            logits_ptr as *const R,
            targets_ptr as *const i32,
            rows,
            vocab,
            loss_ptr as *mut f32,
            totals_ptr as *mut f64,
            raw_stream(stream),
        )
    };
    check(op, status)?;
    totals.vocab = vocab;
    Ok(())
}

/// Fused cross-entropy forward + backward on f32 logits `[targets.len(), vocab]`: writes the
/// per-row losses into `row_loss` (`[targets.len()]`, 0 for ignored rows), the totals into
/// `totals`, and overwrites `logits` with `(softmax - onehot) * grad_scale` (0 for ignored
/// rows). `grad_scale` is typically `1 / (valid targets of the accumulated batch)`, and must be
/// finite in f32. Labels are checked by [`CeTotals::read`].
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_fused_f32(
    stream: &Arc<CudaStream>,
    logits: &mut impl DevicePtrMut<f32>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    grad_scale: f64,
    row_loss: &mut impl DevicePtrMut<f32>,
    totals: &mut CeTotals,
) -> Result<()> {
    fused::<f32, f32>(
        "tilearn_cross_entropy_fused_f32",
        ffi::tilearn_cross_entropy_fused_f32,
        stream,
        logits,
        targets,
        vocab,
        grad_scale,
        row_loss,
        totals,
    )
}

/// [`cross_entropy_fused_f32`] on bf16 logits: f32 arithmetic, the gradient rounded to bf16 in
/// place; losses and totals as in the f32 variant.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_fused_bf16(
    stream: &Arc<CudaStream>,
    logits: &mut impl DevicePtrMut<bf16>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    grad_scale: f64,
    row_loss: &mut impl DevicePtrMut<f32>,
    totals: &mut CeTotals,
) -> Result<()> {
    fused::<bf16, ffi::tilearn_bf16>(
        "tilearn_cross_entropy_fused_bf16",
        ffi::tilearn_cross_entropy_fused_bf16,
        stream,
        logits,
        targets,
        vocab,
        grad_scale,
        row_loss,
        totals,
    )
}

/// Loss only (evaluation) on f32 logits: writes `row_loss` and `totals`, leaves `logits`
/// unchanged. The row losses are bit-identical to the fused variant's.
pub fn cross_entropy_forward_f32(
    stream: &Arc<CudaStream>,
    logits: &impl DevicePtr<f32>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    row_loss: &mut impl DevicePtrMut<f32>,
    totals: &mut CeTotals,
) -> Result<()> {
    forward::<f32, f32>(
        "tilearn_cross_entropy_forward_f32",
        ffi::tilearn_cross_entropy_forward_f32,
        stream,
        logits,
        targets,
        vocab,
        row_loss,
        totals,
    )
}

/// Loss only (evaluation) on bf16 logits, f32 arithmetic; see [`cross_entropy_forward_f32`].
pub fn cross_entropy_forward_bf16(
    stream: &Arc<CudaStream>,
    logits: &impl DevicePtr<bf16>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    row_loss: &mut impl DevicePtrMut<f32>,
    totals: &mut CeTotals,
) -> Result<()> {
    forward::<bf16, ffi::tilearn_bf16>(
        "tilearn_cross_entropy_forward_bf16",
        ffi::tilearn_cross_entropy_forward_bf16,
        stream,
        logits,
        targets,
        vocab,
        row_loss,
        totals,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_reports_the_first_bad_label() {
        let err = decode_totals(&[f64::NAN, 3.0, 7.0, -5.0], 32003).unwrap_err();
        assert!(
            matches!(
                err,
                OpsError::LabelOutOfRange {
                    label: -5,
                    position: 7,
                    vocab: 32003
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn decode_returns_the_stats_without_error() {
        let stats = decode_totals(&[12.5, 4.0, -1.0, 0.0], 10).unwrap();
        assert_eq!(
            stats,
            CeStats {
                loss_sum: 12.5,
                valid: 4
            }
        );
    }
}
