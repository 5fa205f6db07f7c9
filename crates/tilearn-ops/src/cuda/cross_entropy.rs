//! Wrappers of `kernels/cross_entropy.cu`: token softmax cross-entropy over the vocabulary,
//! Hugging Face semantics (targets already shifted, `-100` ignored), same contract as
//! [`crate::cpu::cross_entropy_fused`] / [`crate::cpu::cross_entropy_forward`], one generic
//! function per variant for logits of any [`DeviceFloat`] type (f32, bf16, f16):
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

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceSlice};

use super::DeviceFloat;
use super::launch::{bind, check, expect_len, raw_stream, same_device};
use crate::cpu::CeStats;
use crate::{OpsError, Result};
use tilearn_kernels::ffi;

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

/// Fused cross-entropy forward + backward on logits `[targets.len(), vocab]` of any
/// [`DeviceFloat`] type: writes the per-row losses into `row_loss` (`[targets.len()]`, `=`, 0
/// for ignored rows), the totals into `totals` (`=`), and overwrites `logits` in place (`=`) with
/// `(softmax - onehot) * grad_scale` (all zeros for ignored rows). `grad_scale` is typically
/// `1 / (valid targets of the accumulated batch)`, times the GradScaler's loss scale when one is
/// used, and must be finite in f32. Labels are checked by [`CeTotals::read`].
///
/// Precision: softmax sums in f32, the row loss formed in f64 and stored as f32, each gradient
/// element computed in f32 and rounded once (to nearest even) to `T`. For f16 a gradient of
/// magnitude >= 65520 becomes ±inf (IEEE overflow, never clamped), which the GradScaler's
/// [`unscale_check`](super::unscale_check) then reports; the row losses and totals stay finite.
pub fn cross_entropy_fused<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    logits: &mut impl DevicePtrMut<T>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    grad_scale: f64,
    row_loss: &mut impl DevicePtrMut<f32>,
    totals: &mut CeTotals,
) -> Result<()> {
    const OP: &str = "tilearn_cross_entropy_fused";
    let rows = validate(OP, stream, logits, targets, vocab, row_loss, totals)?;
    let grad_scale = grad_scale_f32(OP, grad_scale)?;
    bind(stream, OP)?;
    let (logits_ptr, _logits) = logits.device_ptr_mut(stream);
    let (targets_ptr, _targets) = targets.device_ptr(stream);
    let (loss_ptr, _loss) = row_loss.device_ptr_mut(stream);
    let (totals_ptr, _totals) = totals.buf.device_ptr_mut(stream);
    // SAFETY: every pointer is a live allocation of the stream's context (checked above) with
    // the length the launcher uses: logits rows * vocab elements of T, whose layout is the one
    // T::DTYPE names (DeviceFloat is sealed to f32, bf16 and f16), targets and row_loss rows,
    // totals TOTALS_LEN (its private buffer is allocated with exactly that). logits, row_loss
    // and totals are borrowed mutably, so the outputs overlap no other buffer. The kernel never
    // indexes a row with an out-of-range target. The work is only enqueued on `stream`; the
    // guards order it after earlier writers and before later users.
    let status = unsafe {
        ffi::tilearn_cross_entropy_fused(
            T::DTYPE,
            logits_ptr as *mut c_void,
            targets_ptr as *const i32,
            rows,
            vocab,
            grad_scale,
            loss_ptr as *mut f32,
            totals_ptr as *mut f64,
            raw_stream(stream),
        )
    };
    check(OP, status)?;
    totals.vocab = vocab;
    Ok(())
}

/// Loss only (evaluation) on logits of any [`DeviceFloat`] type: writes `row_loss` and `totals`
/// (`=`) as [`cross_entropy_fused`] does, and leaves `logits` unchanged. The row losses and
/// totals are bit-identical to the fused variant's on the same input (both run the same row
/// reduction and loss formula).
pub fn cross_entropy_forward<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    logits: &impl DevicePtr<T>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    row_loss: &mut impl DevicePtrMut<f32>,
    totals: &mut CeTotals,
) -> Result<()> {
    const OP: &str = "tilearn_cross_entropy_forward";
    let rows = validate(OP, stream, logits, targets, vocab, row_loss, totals)?;
    bind(stream, OP)?;
    let (logits_ptr, _logits) = logits.device_ptr(stream);
    let (targets_ptr, _targets) = targets.device_ptr(stream);
    let (loss_ptr, _loss) = row_loss.device_ptr_mut(stream);
    let (totals_ptr, _totals) = totals.buf.device_ptr_mut(stream);
    // SAFETY: as in `cross_entropy_fused`, except that logits are only read: live allocations
    // of the stream's context with the lengths the launcher uses (checked above; T's layout is
    // the one T::DTYPE names), mutable outputs that overlap nothing else, work enqueued on
    // `stream` only and ordered by the guards.
    let status = unsafe {
        ffi::tilearn_cross_entropy_forward(
            T::DTYPE,
            logits_ptr as *const c_void,
            targets_ptr as *const i32,
            rows,
            vocab,
            loss_ptr as *mut f32,
            totals_ptr as *mut f64,
            raw_stream(stream),
        )
    };
    check(OP, status)?;
    totals.vocab = vocab;
    Ok(())
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
