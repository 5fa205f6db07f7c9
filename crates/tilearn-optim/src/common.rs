//! Helpers shared by the optimizers: hyper-parameter checks, f32 → f64 scalar widening, and
//! the fixed-chunk split of flat buffers into disjoint parallel work items.

use std::ops::Range;

use crate::error::{OptimError, Result};
use crate::group::Segment;

/// Elements per parallel work item of a CPU step. Every element is computed by the same
/// operations whatever the chunking, so this only affects speed, never results.
pub(crate) const CHUNK: usize = 1 << 14;

/// `lr` finite and >= 0 (the learning rate of a step, or a config's base rate).
pub(crate) fn check_lr(lr: f32) -> Result<()> {
    if lr.is_finite() && lr >= 0.0 {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            name: "lr",
            value: f64::from(lr),
            message: "must be finite and >= 0",
        })
    }
}

/// A beta (or momentum-like coefficient) in `[0, 1)`; NaN fails.
pub(crate) fn check_beta(name: &'static str, beta: f32) -> Result<()> {
    if (0.0..1.0).contains(&beta) {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            name,
            value: f64::from(beta),
            message: "must lie in [0, 1)",
        })
    }
}

/// A coefficient in `[0, 1]` (SGD's momentum and dampening, as torch accepts them).
pub(crate) fn check_unit_closed(name: &'static str, x: f32) -> Result<()> {
    if (0.0..=1.0).contains(&x) {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            name,
            value: f64::from(x),
            message: "must lie in [0, 1]",
        })
    }
}

/// Finite and > 0 (epsilons, clipping thresholds).
pub(crate) fn check_positive(name: &'static str, x: f32) -> Result<()> {
    if x.is_finite() && x > 0.0 {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            name,
            value: f64::from(x),
            message: "must be finite and > 0",
        })
    }
}

/// Finite and >= 0 (weight decay).
pub(crate) fn check_non_negative(name: &'static str, x: f32) -> Result<()> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperParameter {
            name,
            value: f64::from(x),
            message: "must be finite and >= 0",
        })
    }
}

/// `LengthMismatch` unless `actual == expected`.
pub(crate) fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(OptimError::LengthMismatch {
            what,
            expected,
            actual,
        })
    }
}

/// Widens an f32 to the f64 with the same shortest decimal representation (`0.9f32` →
/// `0.9f64`), i.e. the Python float the user most likely wrote; torch computes its per-step
/// scalars from such Python floats.
pub fn decimal_f64(x: f32) -> f64 {
    if !x.is_finite() {
        return f64::from(x);
    }
    // `Display` for f32 prints the shortest string that round-trips to `x`; parsing it as f64
    // cannot fail for a finite value.
    x.to_string().parse::<f64>().unwrap_or(f64::from(x))
}

/// One parallel work item: the elements `range` of the flat buffers, belonging to group
/// `group` (and, for per-tensor optimizers, tensor `tensor`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub group: usize,
    pub tensor: usize,
    pub range: Range<usize>,
}

/// Cuts every segment (sorted, disjoint) into chunks of at most [`CHUNK`] elements, in
/// buffer order. `tensor` is set to 0.
pub(crate) fn chunks_of_segments(segments: &[Segment]) -> Vec<Chunk> {
    let mut out = Vec::new();
    for seg in segments {
        let mut start = seg.range.start;
        while start < seg.range.end {
            let end = (start + CHUNK).min(seg.range.end);
            out.push(Chunk {
                group: seg.group,
                tensor: 0,
                range: start..end,
            });
            start = end;
        }
    }
    out
}

/// The ranges of `0..len` that no chunk covers (`chunks` sorted by start and disjoint, as
/// [`chunks_of_segments`] gives them), in order.
pub(crate) fn gaps(chunks: &[Chunk], len: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut pos = 0;
    for c in chunks {
        if c.range.start > pos {
            out.push(pos..c.range.start);
        }
        pos = pos.max(c.range.end);
    }
    if pos < len {
        out.push(pos..len);
    }
    out
}

/// Disjoint mutable slices of `buf` for `chunks` (sorted by start, disjoint, within
/// `buf` — as produced by [`chunks_of_segments`] for a buffer of the validated length).
pub(crate) fn split_mut<'a, T>(buf: &'a mut [T], chunks: &[Chunk]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(chunks.len());
    let mut rest: &'a mut [T] = buf;
    let mut pos = 0usize;
    for c in chunks {
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(c.range.start - pos);
        let (head, tail) = tail.split_at_mut(c.range.len());
        out.push(head);
        rest = tail;
        pos = c.range.end;
    }
    out
}

/// [`split_mut`] for a state buffer that only some configurations use: `None` for every
/// chunk when `used` is false (the buffer is then empty).
pub(crate) fn split_mut_opt<'a>(
    buf: &'a mut [f32],
    used: bool,
    chunks: &[Chunk],
) -> Vec<Option<&'a mut [f32]>> {
    if used {
        split_mut(buf, chunks).into_iter().map(Some).collect()
    } else {
        chunks.iter().map(|_| None).collect()
    }
}

/// Shared slices of `buf` for `chunks` (same contract as [`split_mut`]).
pub(crate) fn split<'a>(buf: &'a [f32], chunks: &[Chunk]) -> Vec<&'a [f32]> {
    chunks.iter().map(|c| &buf[c.range.clone()]).collect()
}

#[cfg(test)]
mod gap_tests {
    use super::*;

    #[test]
    fn gaps_are_what_the_segments_leave_out() {
        let segments = [
            Segment {
                group: 0,
                range: 3..5,
            },
            Segment {
                group: 1,
                range: 5..CHUNK + 9,
            },
            Segment {
                group: 0,
                range: CHUNK + 20..CHUNK + 30,
            },
        ];
        let chunks = chunks_of_segments(&segments);
        assert_eq!(
            gaps(&chunks, CHUNK + 40),
            vec![0..3, CHUNK + 9..CHUNK + 20, CHUNK + 30..CHUNK + 40]
        );
        assert_eq!(gaps(&chunks, CHUNK + 30), vec![0..3, CHUNK + 9..CHUNK + 20]);
        assert_eq!(gaps(&[], 4), vec![0..4]);
    }
}

#[cfg(test)]
mod decimal_tests {
    use super::decimal_f64;

    #[test]
    fn decimal_widening_keeps_the_written_value() {
        assert_eq!(decimal_f64(0.9), 0.9);
        assert_eq!(decimal_f64(0.999), 0.999);
        assert_eq!(decimal_f64(1e-8), 1e-8);
        assert_ne!(f64::from(0.9f32), 0.9);
    }
}
