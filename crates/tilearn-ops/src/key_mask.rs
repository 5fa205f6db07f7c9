//! Which keys a query of causal attention may see, beyond `j <= i`: the boundaries of packed
//! examples and a sliding window. Shared by the CPU reference and the CUDA kernels, which all
//! reduce a mask to one number per query, its first visible key `key_start(i)`; query `i` then
//! attends to the keys `key_start(i) ..= i`.
//!
//! * **Packed examples** are described the way transformers' packing collator
//!   (`DataCollatorWithFlattening`) and flash-attention's varlen path do: by `position_ids`
//!   (`[batch, seq]`) that restart at 0 where an example starts. Token `i` at position `p`
//!   belongs to the example that began at `i - p`, so `key_start(i) >= i - p`: no query sees a
//!   key of an earlier example, and RoPE rotates by the same restarted positions. Positions
//!   must be a *restart sequence*: 0 at the start of each row, and each next one either 0 (a new
//!   example) or the previous plus one ([`check_positions`]). Then `key_start` never decreases
//!   along a row, which the CUDA kernels use to skip whole key tiles.
//! * **Sliding window** (Mistral's `sliding_window` `W`, as transformers masks it: key `j` is
//!   visible from query `i` when `i - W < j <= i`): `key_start(i) >= i + 1 - W`, so a query sees
//!   at most `W` keys, itself included.
//!
//! With neither ([`KeyMask::causal`]) `key_start` is 0 and every op runs its plain causal path,
//! unchanged in numerics and speed.

use crate::{OpsError, Result};

/// A causal mask's extra restrictions. `P` holds the positions: `&[i32]` on the CPU, a device
/// buffer for the CUDA ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyMask<P> {
    /// Restarting `position_ids` `[batch, seq]` of packed rows, or `None` (one sequence a row).
    pub positions: Option<P>,
    /// Mistral's `sliding_window` (keys `i - W < j <= i`), or `None` (unbounded).
    pub sliding_window: Option<usize>,
}

impl<P> KeyMask<P> {
    /// Plain causal attention: every key `j <= i`.
    pub fn causal() -> KeyMask<P> {
        KeyMask {
            positions: None,
            sliding_window: None,
        }
    }

    /// Causal attention within the packed examples that `positions` delimit.
    pub fn packed(positions: P) -> KeyMask<P> {
        KeyMask {
            positions: Some(positions),
            sliding_window: None,
        }
    }

    /// The same mask with a sliding window of `window` keys (`None`: unbounded).
    pub fn with_sliding_window(self, window: Option<usize>) -> KeyMask<P> {
        KeyMask {
            sliding_window: window,
            ..self
        }
    }

    /// Whether this is plain causal attention.
    pub fn is_causal(&self) -> bool {
        self.positions.is_none() && self.sliding_window.is_none()
    }

    /// Fails on a window of 0 keys (a query always sees itself).
    pub fn check_window(&self, op: &'static str) -> Result<()> {
        if self.sliding_window == Some(0) {
            return Err(OpsError::ShapeMismatch {
                op,
                expected: 1,
                actual: 0,
            });
        }
        Ok(())
    }
}

/// The first key query `i` sees, given its position `pos` (`None`: unpacked) and the window.
/// Clamped to `[0, i]`, so the query always sees itself.
pub fn key_start(i: usize, pos: Option<i32>, window: Option<usize>) -> usize {
    let from_pos = pos.map_or(0, |p| i.saturating_sub(usize::try_from(p).unwrap_or(0)));
    let from_window = window.map_or(0, |w| (i + 1).saturating_sub(w));
    from_pos.max(from_window).min(i)
}

/// Fails unless `positions` (`[batch, seq]`) is a restart sequence: each row starts at 0 and
/// every next position is 0 or the previous one plus 1. The error names the row and column.
pub fn check_positions(positions: &[i32], batch: usize, seq: usize) -> Result<()> {
    let expected = batch.saturating_mul(seq);
    if positions.len() != expected {
        return Err(OpsError::ShapeMismatch {
            op: "positions (batch x seq)",
            expected,
            actual: positions.len(),
        });
    }
    if seq == 0 {
        return Ok(());
    }
    for (b, row) in positions.chunks(seq).enumerate() {
        let mut prev: Option<i32> = None;
        for (t, &p) in row.iter().enumerate() {
            let ok = p == 0 || prev.is_some_and(|q| q.checked_add(1) == Some(p));
            if !ok {
                return Err(OpsError::InvalidPositions {
                    row: b,
                    column: t,
                    value: p,
                    previous: prev,
                });
            }
            prev = Some(p);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_start_follows_examples_and_window() {
        // Examples [0, 3) and [3, 5): positions 0 1 2 0 1.
        let pos = [0, 1, 2, 0, 1];
        let starts: Vec<usize> = (0..5).map(|i| key_start(i, Some(pos[i]), None)).collect();
        assert_eq!(starts, [0, 0, 0, 3, 3]);
        let windowed: Vec<usize> = (0..5).map(|i| key_start(i, None, Some(2))).collect();
        assert_eq!(windowed, [0, 0, 1, 2, 3]);
        assert_eq!(key_start(4, Some(pos[4]), Some(1)), 4);
        // Out-of-range positions clamp to [0, i] (as the CUDA kernels do): a negative one
        // leaves the query only itself, one past the row start the whole prefix.
        assert_eq!(key_start(2, Some(-5), None), 2);
        assert_eq!(key_start(2, Some(9), None), 0);
    }

    #[test]
    fn positions_must_restart_at_zero_and_count_up() {
        check_positions(&[0, 1, 2, 0, 0, 1], 2, 3).unwrap();
        let err = check_positions(&[0, 1, 3], 1, 3).unwrap_err().to_string();
        assert!(err.contains("row 0") && err.contains("column 2"), "{err}");
        assert!(check_positions(&[1, 2], 1, 2).is_err());
        assert!(check_positions(&[0, 1], 1, 3).is_err());
    }
}
