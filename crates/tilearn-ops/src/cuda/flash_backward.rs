//! Which flash-attention backward a workspace runs, and where its regions lie.
//!
//! `tilearn_flash_attention_backward` has two forms. With a null `dq_accum` it is the
//! deterministic two-kernel backward (dK/dV per key block, then dQ per query block, fixed
//! summation orders): bit-identical from run to run. With an f32 `dq_accum` scratch it runs,
//! where the Hopper kernels do (bf16/f16, head_dim 64, unmasked, compute capability 9.0), one
//! pass that computes dK, dV and dQ together and sums dQ by f32 reduce-adds into the scratch:
//! fewer products (S and dP are computed once, not twice), but the order of the adds, and so
//! dQ's last bits, changes from run to run. dK and dV are computed as before.
//!
//! A flash workspace ([`super::AttentionWorkspace::for_flash`]) is laid out for one call of
//! shape `s` as: the backward's `delta` rows (`B·Hq·T` f32) from the first aligned byte, then,
//! for [`FlashBackward::OnePass`], `dq_accum` on the next region boundary. A call whose shape
//! needs more than the workspace holds runs the deterministic backward.

use crate::cpu::AttnShape;
use tilearn_kernels::ffi;

/// Which backward the flash kernels run (see the module documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FlashBackward {
    /// dK, dV and dQ in one pass where the Hopper kernels run, dQ summed by f32 atomic adds
    /// into a scratch the workspace holds: faster, and dq differs from run to run at the level
    /// of f32 rounding (dk and dv do not). Elsewhere the same as `Deterministic`.
    #[default]
    OnePass,
    /// The two-kernel backward with fixed summation orders: bit-reproducible run to run.
    Deterministic,
}

impl FlashBackward {
    /// `Deterministic` when `deterministic`, else `OnePass`.
    pub fn from_deterministic(deterministic: bool) -> FlashBackward {
        if deterministic {
            FlashBackward::Deterministic
        } else {
            FlashBackward::OnePass
        }
    }
}

/// f32 elements the one-pass backward's `dq_accum` needs at shape `s`
/// (`tilearn_flash_attention_dq_accum_len`: `B·Hq·D·round_up(T, 64)`); `None` when that
/// overflows `usize`.
pub fn flash_dq_accum_len(s: AttnShape) -> Option<usize> {
    // SAFETY: a pure host function of its integer arguments.
    let len =
        unsafe { ffi::tilearn_flash_attention_dq_accum_len(s.batch, s.seq, s.q_heads, s.head_dim) };
    // The launcher answers 0 for an overflow; an empty shape needs 0 elements.
    let empty = s.batch == 0 || s.seq == 0 || s.q_heads == 0 || s.head_dim == 0;
    (len > 0 || empty).then_some(len)
}

/// Byte offsets, from the workspace's first aligned byte, of one flash call's regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FlashRegions {
    /// Bytes of the `delta` rows (at offset 0).
    pub delta_bytes: usize,
    /// Offset and f32 length of `dq_accum` (`OnePass` only).
    pub dq_accum: Option<(usize, usize)>,
    /// Bytes up to the end of the last region.
    pub end: usize,
}

impl FlashRegions {
    /// The regions of a call of shape `s` with `backward`, each starting on an `align`-byte
    /// boundary; `None` when the sizes overflow `usize`.
    pub fn new(s: AttnShape, backward: FlashBackward, align: usize) -> Option<FlashRegions> {
        let delta_bytes = s
            .batch
            .checked_mul(s.q_heads)?
            .checked_mul(s.seq)?
            .checked_mul(size_of::<f32>())?;
        match backward {
            FlashBackward::Deterministic => Some(FlashRegions {
                delta_bytes,
                dq_accum: None,
                end: delta_bytes,
            }),
            FlashBackward::OnePass => {
                let offset = delta_bytes.checked_next_multiple_of(align)?;
                let len = flash_dq_accum_len(s)?;
                let end = len
                    .checked_mul(size_of::<f32>())
                    .and_then(|b| b.checked_add(offset))?;
                Some(FlashRegions {
                    delta_bytes,
                    dq_accum: Some((offset, len)),
                    end,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(batch: usize, seq: usize, q_heads: usize, kv_heads: usize) -> AttnShape {
        AttnShape {
            batch,
            seq,
            q_heads,
            kv_heads,
            head_dim: 64,
        }
    }

    #[test]
    fn dq_accum_len_rounds_the_sequence_to_64_rows() {
        assert_eq!(
            flash_dq_accum_len(shape(2, 130, 8, 2)),
            Some(2 * 8 * 64 * 192)
        );
        assert_eq!(flash_dq_accum_len(shape(1, 64, 4, 4)), Some(4 * 64 * 64));
        assert_eq!(flash_dq_accum_len(shape(0, 64, 4, 4)), Some(0));
        assert_eq!(flash_dq_accum_len(shape(usize::MAX / 2, 64, 4, 4)), None);
    }

    #[test]
    fn one_pass_regions_follow_delta_on_an_aligned_boundary() {
        // delta: 2·8·130 f32 = 8320 bytes, next multiple of 256 = 8448; dq_accum 2·8·64·192.
        let s = shape(2, 130, 8, 2);
        let one = FlashRegions::new(s, FlashBackward::OnePass, 256).unwrap();
        assert_eq!(one.delta_bytes, 8320);
        assert_eq!(one.dq_accum, Some((8448, 2 * 8 * 64 * 192)));
        assert_eq!(one.end, 8448 + 4 * 2 * 8 * 64 * 192);
        let det = FlashRegions::new(s, FlashBackward::Deterministic, 256).unwrap();
        assert_eq!((det.delta_bytes, det.dq_accum, det.end), (8320, None, 8320));
        assert!(
            FlashRegions::new(shape(usize::MAX / 4, 64, 4, 4), FlashBackward::OnePass, 256)
                .is_none()
        );
    }

    #[test]
    fn deterministic_is_the_named_setting() {
        assert_eq!(
            FlashBackward::from_deterministic(true),
            FlashBackward::Deterministic
        );
        assert_eq!(
            FlashBackward::from_deterministic(false),
            FlashBackward::OnePass
        );
        assert_eq!(FlashBackward::default(), FlashBackward::OnePass);
    }
}
