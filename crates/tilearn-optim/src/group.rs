//! Parameter groups: named sets of contiguous index ranges into one flat f32 buffer.
//!
//! The engine keeps every parameter in one contiguous buffer (see `ParamStore`), and gradients
//! in a second buffer with the same layout. A [`ParamGroup`] names the slices of that buffer
//! that share hyper-parameters (Hugging Face's Trainer makes two: weights that decay, and norms
//! plus biases that do not). Ranges are plain `start..end` element indices so the same
//! description drives the CPU loop here and a fused multi-tensor CUDA kernel later.

use std::ops::Range;

use crate::error::{OptimError, Result};

/// Contiguous slices `ranges` of one flat f32 buffer that share hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroup {
    /// A label used in error messages and state files (e.g. `"decay"`, `"no_decay"`).
    pub name: String,
    /// Half-open element ranges into the flat buffer.
    pub ranges: Vec<Range<usize>>,
    /// Decoupled weight decay of this group (torch's per-group `weight_decay`).
    pub weight_decay: f32,
    /// Multiplier on the learning rate passed to `step` (1 for an ordinary group).
    pub lr_scale: f32,
}

impl ParamGroup {
    /// A group with `lr_scale` 1.
    pub fn new(name: impl Into<String>, ranges: Vec<Range<usize>>, weight_decay: f32) -> Self {
        ParamGroup {
            name: name.into(),
            ranges,
            weight_decay,
            lr_scale: 1.0,
        }
    }

    /// One group covering the whole buffer `0..numel`.
    pub fn whole(name: impl Into<String>, numel: usize, weight_decay: f32) -> Self {
        #[allow(clippy::single_range_in_vec_init)] // a list holding one range, on purpose
        let ranges = vec![0..numel];
        Self::new(name, ranges, weight_decay)
    }

    /// Sets `lr_scale` (builder style).
    pub fn with_lr_scale(mut self, lr_scale: f32) -> Self {
        self.lr_scale = lr_scale;
        self
    }

    /// Number of elements covered by the group's ranges.
    pub fn numel(&self) -> usize {
        self.ranges
            .iter()
            .map(|r| r.end.saturating_sub(r.start))
            .sum()
    }

    /// Checks the group's own ranges (ordered, in bounds) and hyper-parameters; overlap with
    /// other groups is checked by [`validate_groups`].
    pub fn validate(&self, len: usize) -> Result<()> {
        for r in &self.ranges {
            if r.start > r.end {
                return Err(OptimError::ReversedRange {
                    group: self.name.clone(),
                    start: r.start,
                    end: r.end,
                });
            }
            if r.end > len {
                return Err(OptimError::RangeOutOfBounds {
                    start: r.start,
                    end: r.end,
                    len,
                });
            }
        }
        if !self.weight_decay.is_finite() || self.weight_decay < 0.0 {
            return Err(OptimError::InvalidHyperParameter {
                name: "weight_decay",
                value: f64::from(self.weight_decay),
                message: "a group's weight decay must be finite and >= 0",
            });
        }
        if !self.lr_scale.is_finite() || self.lr_scale < 0.0 {
            return Err(OptimError::InvalidHyperParameter {
                name: "lr_scale",
                value: f64::from(self.lr_scale),
                message: "a group's lr_scale must be finite and >= 0",
            });
        }
        Ok(())
    }
}

/// One range of one group, as the optimizer walks them: sorted by `range.start`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Index of the group in the list given to the optimizer.
    pub group: usize,
    pub range: Range<usize>,
}

/// Validates every group against a buffer of `len` elements and checks that no two ranges
/// (in one group or across groups) overlap. Empty ranges are allowed and ignored.
///
/// Returns the non-empty ranges sorted by start: the order in which the CPU step walks the
/// buffer (and the list a multi-tensor CUDA launch would take).
pub fn validate_groups(groups: &[ParamGroup], len: usize) -> Result<Vec<Segment>> {
    for g in groups {
        g.validate(len)?;
    }
    let mut segments: Vec<Segment> = groups
        .iter()
        .enumerate()
        .flat_map(|(gi, g)| {
            g.ranges
                .iter()
                .filter(|r| r.start < r.end)
                .map(move |r| Segment {
                    group: gi,
                    range: r.clone(),
                })
        })
        .collect();
    segments.sort_by_key(|s| (s.range.start, s.range.end));
    for pair in segments.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if b.range.start < a.range.end {
            return Err(OptimError::OverlappingRanges {
                first_group: groups[a.group].name.clone(),
                first_start: a.range.start,
                first_end: a.range.end,
                second_group: groups[b.group].name.clone(),
                second_start: b.range.start,
                second_end: b.range.end,
            });
        }
    }
    Ok(segments)
}
