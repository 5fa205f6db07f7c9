//! Wrappers of tilearn-kernels' `cross_entropy.cu`: token softmax cross-entropy over the
//! vocabulary, Hugging Face semantics (targets already shifted, `-100` ignored), same contract as
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
//!
//! The vocabulary-parallel variant ([`vocab_ce_partials`], [`vocab_ce_rescale`],
//! [`vocab_ce_fused_finish`], [`vocab_ce_loss_finish`]) runs on a tensor-parallel rank's
//! columns of the logits, with the caller's all-reduces between the steps; its CPU reference
//! is [`crate::cpu::vocab_slice`], function for function.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::DeviceFloat;
use super::launch::{Launch, same_device};
use crate::cpu::{CeStats, VocabSlice};
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

/// The shape both variants share: `logits` is `[rows, vocab]` for `rows` targets, and the row
/// count fits the kernel's grid. Returns the length `logits` must have.
fn logits_len(op: &'static str, rows: usize, vocab: usize, actual: usize) -> Result<usize> {
    let expected = rows.checked_mul(vocab).ok_or(OpsError::ShapeMismatch {
        op,
        expected: usize::MAX,
        actual,
    })?;
    if rows > i32::MAX as usize {
        return Err(OpsError::Cuda {
            context: op,
            message: format!("{rows} rows exceed the kernel's limit of {} rows", i32::MAX),
        });
    }
    Ok(expected)
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
    let grad_scale = grad_scale_f32(OP, grad_scale)?;
    fused_launch::<T, CudaView<'_, f32>>(
        OP,
        stream,
        logits,
        targets,
        vocab,
        GradFactor::Host(grad_scale),
        row_loss,
        totals,
    )
}

/// [`cross_entropy_fused`] with the gradient factor read from device memory (`grad_scale`:
/// one f32) when the kernel runs, not when it is queued: a captured CUDA graph replays the
/// launch with each step's factor (the host writes it into the buffer before the replay). The
/// arithmetic is the host-factor variant's, so the same factor gives the same bits. The value
/// is not checked on the host; a non-finite factor gives non-finite gradients.
pub fn cross_entropy_fused_device_scale<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    logits: &mut impl DevicePtrMut<T>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    grad_scale: &impl DevicePtr<f32>,
    row_loss: &mut impl DevicePtrMut<f32>,
    totals: &mut CeTotals,
) -> Result<()> {
    fused_launch::<T, _>(
        "tilearn_cross_entropy_fused_device_scale",
        stream,
        logits,
        targets,
        vocab,
        GradFactor::Device(grad_scale),
        row_loss,
        totals,
    )
}

/// Where the fused launch takes its gradient factor from.
enum GradFactor<'a, D: ?Sized> {
    /// A kernel argument.
    Host(f32),
    /// One f32 in device memory, read by the kernel.
    Device(&'a D),
}

#[allow(clippy::too_many_arguments)]
fn fused_launch<T: DeviceFloat, D: DevicePtr<f32>>(
    op: &'static str,
    stream: &Arc<CudaStream>,
    logits: &mut impl DevicePtrMut<T>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    factor: GradFactor<'_, D>,
    row_loss: &mut impl DevicePtrMut<f32>,
    totals: &mut CeTotals,
) -> Result<()> {
    let rows = targets.len();
    let logits_len = logits_len(op, rows, vocab, logits.len())?;
    let launch = Launch::new(op, stream)
        .output("logits", logits, logits_len)
        .input("targets", targets, rows)
        .output("row_loss", row_loss, rows)
        .output("totals", &mut totals.buf, TOTALS_LEN);
    match factor {
        GradFactor::Host(grad_scale) => {
            launch.run(|[targets], [logits, row_loss, totals], stream| {
                // SAFETY: the launcher reads rows i32 targets, rewrites rows * vocab elements
                // of T (`T::DTYPE`) of logits in place (never indexing a row with an
                // out-of-range target), and writes rows f32 of row_loss and TOTALS_LEN f64 of
                // totals.
                unsafe {
                    ffi::tilearn_cross_entropy_fused(
                        T::DTYPE,
                        logits,
                        targets.cast(),
                        rows,
                        vocab,
                        grad_scale,
                        row_loss.cast(),
                        totals.cast(),
                        stream,
                    )
                }
            })?
        }
        GradFactor::Device(scale) => launch.input("grad_scale", scale, 1).run(
            |[targets, scale], [logits, row_loss, totals], stream| {
                // SAFETY: as the host-factor launch, plus one f32 read from `scale` by the
                // kernel (a live device allocation of one element, checked by the builder).
                unsafe {
                    ffi::tilearn_cross_entropy_fused_device_scale(
                        T::DTYPE,
                        logits,
                        targets.cast(),
                        rows,
                        vocab,
                        scale.cast(),
                        row_loss.cast(),
                        totals.cast(),
                        stream,
                    )
                }
            },
        )?,
    }
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
    let rows = targets.len();
    let logits_len = logits_len(OP, rows, vocab, logits.len())?;
    Launch::new(OP, stream)
        .input("logits", logits, logits_len)
        .input("targets", targets, rows)
        .output("row_loss", row_loss, rows)
        .output("totals", &mut totals.buf, TOTALS_LEN)
        .run(|[logits, targets], [row_loss, totals], stream| {
            // SAFETY: as in `cross_entropy_fused`, except that the launcher only reads the
            // rows * vocab elements of logits.
            unsafe {
                ffi::tilearn_cross_entropy_forward(
                    T::DTYPE,
                    logits,
                    targets.cast(),
                    rows,
                    vocab,
                    row_loss.cast(),
                    totals.cast(),
                    stream,
                )
            }
        })?;
    totals.vocab = vocab;
    Ok(())
}

/// Totals only: the f64 sum of `row_loss` over the rows whose target is not `-100`, the
/// valid-target count and the first out-of-range label, written into `totals` (`=`), from row
/// losses that earlier launches wrote, typically [`cross_entropy_fused`] or
/// [`cross_entropy_forward`] over consecutive chunks of the rows (a chunked linear + cross
/// entropy never holds every row's logits at once). The reduction is the one those launches run
/// after their rows, so over the same `row_loss` and `targets` the totals are bit-identical to
/// one launch over all rows.
pub fn cross_entropy_totals(
    stream: &Arc<CudaStream>,
    row_loss: &impl DevicePtr<f32>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    totals: &mut CeTotals,
) -> Result<()> {
    const OP: &str = "tilearn_cross_entropy_totals";
    let rows = targets.len();
    if rows > i32::MAX as usize {
        return Err(OpsError::Cuda {
            context: OP,
            message: format!("{rows} rows exceed the kernel's limit of {} rows", i32::MAX),
        });
    }
    Launch::new(OP, stream)
        .input("row_loss", row_loss, rows)
        .input("targets", targets, rows)
        .output("totals", &mut totals.buf, TOTALS_LEN)
        .run(|[row_loss, targets], [totals], stream| {
            // SAFETY: the launcher reads rows f32 of row_loss and rows i32 of targets and
            // writes TOTALS_LEN f64 of totals.
            unsafe {
                ffi::tilearn_cross_entropy_totals(
                    row_loss.cast(),
                    targets.cast(),
                    rows,
                    vocab,
                    totals.cast(),
                    stream,
                )
            }
        })?;
    totals.vocab = vocab;
    Ok(())
}

/// The checks of a vocabulary-parallel launch: the logits are `[rows, slice.rows]`, the rows fit
/// the kernels' grid and the vocabulary their i32 targets. Returns the logits' length.
fn slice_logits_len(
    op: &'static str,
    rows: usize,
    slice: VocabSlice,
    actual: usize,
) -> Result<usize> {
    let checked = VocabSlice::new(slice.start, slice.rows, slice.full)?;
    if checked.full > i32::MAX as usize {
        return Err(OpsError::Cuda {
            context: op,
            message: format!(
                "a vocabulary of {} words exceeds the kernel's i32 targets",
                checked.full
            ),
        });
    }
    logits_len(op, rows, checked.rows, actual)
}

/// Vocabulary-parallel cross entropy, step 1 of 3 (see `cross_entropy.cu` and
/// [`crate::cpu::vocab_slice`]): per row of a rank's logits `[targets.len(), slice.rows]` (the
/// columns `slice.start ..` of a vocabulary of `slice.full` words), the row's max, the sum of
/// `exp(x - max)` and the target's logit where the slice holds the target (else 0), written into
/// three f32 `[targets.len()]` buffers (`=`). Ignored rows write zeros; a target neither `-100`
/// nor in `0..slice.full` writes a NaN target logit. The caller then all-reduces the maxima
/// (MAX) into the global maxima and calls [`vocab_ce_rescale`].
///
/// Precision: as [`cross_entropy_fused`]'s row pass (f32 max and sum, `expf`).
pub fn vocab_ce_partials<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    logits: &impl DevicePtr<T>,
    targets: &impl DevicePtr<i32>,
    slice: VocabSlice,
    local_max: &mut impl DevicePtrMut<f32>,
    sumexp: &mut impl DevicePtrMut<f32>,
    target_logit: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "tilearn_vocab_ce_partials";
    let rows = targets.len();
    let logits_len = slice_logits_len(OP, rows, slice, logits.len())?;
    Launch::new(OP, stream)
        .input("logits", logits, logits_len)
        .input("targets", targets, rows)
        .output("local_max", local_max, rows)
        .output("sumexp", sumexp, rows)
        .output("target_logit", target_logit, rows)
        .skip_launch_if(rows == 0)
        .run(
            |[logits, targets], [local_max, sumexp, target_logit], stream| {
                // SAFETY: the launcher reads rows * slice.rows elements of T (`T::DTYPE`) of logits
                // and rows i32 targets (indexing a row only at a target inside the slice), and
                // writes rows f32 to each of the three statistics.
                unsafe {
                    ffi::tilearn_vocab_ce_partials(
                        T::DTYPE,
                        logits,
                        targets.cast(),
                        rows,
                        slice.rows,
                        slice.start,
                        slice.full,
                        local_max.cast(),
                        sumexp.cast(),
                        target_logit.cast(),
                        stream,
                    )
                }
            },
        )
}

/// Vocabulary-parallel cross entropy, step 2 of 3: `sumexp *= exp(local_max - global_max)` in
/// place (f32; a zero sum stays zero), so that every rank's partial sum is taken relative to
/// the global max; the caller then all-reduces (SUM) the sums and the target logits.
pub fn vocab_ce_rescale(
    stream: &Arc<CudaStream>,
    local_max: &impl DevicePtr<f32>,
    global_max: &impl DevicePtr<f32>,
    sumexp: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "tilearn_vocab_ce_rescale";
    let rows = sumexp.len();
    Launch::new(OP, stream)
        .input("local_max", local_max, rows)
        .input("global_max", global_max, rows)
        .output("sumexp", sumexp, rows)
        .skip_launch_if(rows == 0)
        .run(|[local_max, global_max], [sumexp], stream| {
            // SAFETY: the launcher reads rows f32 of local_max and global_max and rewrites rows
            // f32 of sumexp.
            unsafe {
                ffi::tilearn_vocab_ce_rescale(
                    local_max.cast(),
                    global_max.cast(),
                    sumexp.cast(),
                    rows,
                    stream,
                )
            }
        })
}

/// The completed per-row statistics of the vocabulary-parallel cross entropy (each f32
/// `[rows]`, equal on every rank after the all-reduces).
pub struct VocabCeStats<'a, P: ?Sized> {
    pub global_max: &'a P,
    pub sumexp: &'a P,
    pub target_logit: &'a P,
}

/// Vocabulary-parallel cross entropy, step 3 of 3 (training): the row losses
/// `global_max + ln(sumexp) - target_logit` (f64, stored f32, `=`; 0 for ignored rows) and the
/// slice's logits overwritten in place (`=`) with `(softmax - onehot) * grad_scale` (the
/// one-hot only where the slice holds the target; zeros for ignored rows). The row losses are
/// the same on every rank; [`cross_entropy_totals`] with `slice.full` reduces them.
///
/// Precision: as [`cross_entropy_fused`] (f32 math, one rounding to `T`).
pub fn vocab_ce_fused_finish<T: DeviceFloat, P: DevicePtr<f32> + ?Sized>(
    stream: &Arc<CudaStream>,
    logits: &mut impl DevicePtrMut<T>,
    targets: &impl DevicePtr<i32>,
    slice: VocabSlice,
    stats: VocabCeStats<'_, P>,
    grad_scale: f64,
    row_loss: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "tilearn_vocab_ce_fused_finish";
    let grad_scale = grad_scale_f32(OP, grad_scale)?;
    let rows = targets.len();
    let logits_len = slice_logits_len(OP, rows, slice, logits.len())?;
    Launch::new(OP, stream)
        .output("logits", logits, logits_len)
        .input("targets", targets, rows)
        .input("global_max", stats.global_max, rows)
        .input("sumexp", stats.sumexp, rows)
        .input("target_logit", stats.target_logit, rows)
        .output("row_loss", row_loss, rows)
        .skip_launch_if(rows == 0)
        .run(|[targets, m, s, t], [logits, row_loss], stream| {
            // SAFETY: the launcher rewrites rows * slice.rows elements of T (`T::DTYPE`) of
            // logits in place, reads rows i32 targets and rows f32 of each statistic, and
            // writes rows f32 of row_loss.
            unsafe {
                ffi::tilearn_vocab_ce_fused_finish(
                    T::DTYPE,
                    logits,
                    targets.cast(),
                    rows,
                    slice.rows,
                    slice.start,
                    slice.full,
                    m.cast(),
                    s.cast(),
                    t.cast(),
                    grad_scale,
                    row_loss.cast(),
                    stream,
                )
            }
        })
}

/// Vocabulary-parallel cross entropy, step 3 of 3 (evaluation): the row losses only, as
/// [`vocab_ce_fused_finish`] writes them.
pub fn vocab_ce_loss_finish<P: DevicePtr<f32> + ?Sized>(
    stream: &Arc<CudaStream>,
    targets: &impl DevicePtr<i32>,
    full_vocab: usize,
    stats: VocabCeStats<'_, P>,
    row_loss: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    const OP: &str = "tilearn_vocab_ce_loss_finish";
    let rows = targets.len();
    if rows > i32::MAX as usize || full_vocab > i32::MAX as usize {
        return Err(OpsError::Cuda {
            context: OP,
            message: format!(
                "{rows} rows / vocabulary {full_vocab} exceed the kernel's range (< 2^31)"
            ),
        });
    }
    Launch::new(OP, stream)
        .input("targets", targets, rows)
        .input("global_max", stats.global_max, rows)
        .input("sumexp", stats.sumexp, rows)
        .input("target_logit", stats.target_logit, rows)
        .output("row_loss", row_loss, rows)
        .skip_launch_if(rows == 0)
        .run(|[targets, m, s, t], [row_loss], stream| {
            // SAFETY: the launcher reads rows i32 targets and rows f32 of each statistic and
            // writes rows f32 of row_loss.
            unsafe {
                ffi::tilearn_vocab_ce_loss_finish(
                    targets.cast(),
                    rows,
                    full_vocab,
                    m.cast(),
                    s.cast(),
                    t.cast(),
                    row_loss.cast(),
                    stream,
                )
            }
        })
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
