//! [`SegmentPlan`]: the device-side segment table one fused launch walks.
//!
//! Built once (from the optimizer's [`Segment`]s and an optional ZeRO-1 shard range) and reused
//! every step: the table only changes when the grouping or the shard changes.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use tilearn_kernels::ffi;

use super::error::{FusedError, Result};
use crate::error::OptimError;
use crate::group::Segment;

/// Elements per chunk of work (one block handles one chunk at a time). A multiple of 4 so every
/// chunk of a segment has the segment's alignment; large enough that the per-chunk segment
/// lookup is negligible, small enough that 132 SMs stay balanced on a 10M-parameter model.
pub const CHUNK: usize = 1 << 14;

/// Most parameter groups one launch takes (`TILEARN_OPTIM_MAX_GROUPS` of the kernel header).
pub const MAX_GROUPS: usize = 16;

/// Words per segment in the device table: start, end, chunk_begin, group
/// (`tilearn_optim_segment`).
const SEGMENT_WORDS: usize = 4;

/// One segment of a plan in the buffers' local indexing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalSegment {
    /// Group index (into the step's group scalars).
    pub group: usize,
    /// Range in the launch buffers (global range minus the shard start).
    pub range: Range<usize>,
    /// Chunks of all earlier segments.
    pub chunk_begin: usize,
}

/// The segments of a flat buffer of `numel` elements restricted to `shard` (ZeRO-1: this rank
/// updates only `shard`), uploaded as the kernels' segment table.
///
/// The launch buffers then hold the shard only: buffer element `i` is global element
/// `shard.start + i`, and every buffer passed to a step must have `shard.len()` elements (for
/// the whole buffer, `shard = 0..numel`).
#[derive(Debug)]
pub struct SegmentPlan {
    table: CudaSlice<u64>,
    local: Vec<LocalSegment>,
    n_chunks: usize,
    n_groups: usize,
    shard: Range<usize>,
}

/// Host part of [`SegmentPlan::new`]: validation and the local segment list (testable without a
/// GPU).
pub fn local_segments(
    segments: &[Segment],
    numel: usize,
    shard: Range<usize>,
    n_groups: usize,
) -> Result<(Vec<LocalSegment>, usize)> {
    if shard.start > shard.end || shard.end > numel {
        return Err(OptimError::RangeOutOfBounds {
            start: shard.start,
            end: shard.end,
            len: numel,
        }
        .into());
    }
    if n_groups == 0 || n_groups > MAX_GROUPS {
        return Err(FusedError::InvalidArgument {
            op: "SegmentPlan::new",
            message: format!("{n_groups} parameter groups (1..={MAX_GROUPS} supported)"),
        });
    }
    let mut local = Vec::new();
    let mut chunks = 0usize;
    let mut prev_end = 0usize;
    for seg in segments {
        let r = &seg.range;
        if r.start > r.end || r.end > numel {
            return Err(OptimError::RangeOutOfBounds {
                start: r.start,
                end: r.end,
                len: numel,
            }
            .into());
        }
        if r.start < prev_end {
            return Err(FusedError::InvalidArgument {
                op: "SegmentPlan::new",
                message: format!(
                    "segments must be sorted and disjoint (as validate_groups returns them): \
                     {}..{} starts before the previous segment's end {prev_end}",
                    r.start, r.end
                ),
            });
        }
        if seg.group >= n_groups {
            return Err(FusedError::InvalidArgument {
                op: "SegmentPlan::new",
                message: format!(
                    "segment {}..{} has group {} of {n_groups}",
                    r.start, r.end, seg.group
                ),
            });
        }
        prev_end = r.end;
        let start = r.start.max(shard.start);
        let end = r.end.min(shard.end);
        if start >= end {
            continue;
        }
        let range = (start - shard.start)..(end - shard.start);
        local.push(LocalSegment {
            group: seg.group,
            chunk_begin: chunks,
            range: range.clone(),
        });
        chunks += range.len().div_ceil(CHUNK);
    }
    Ok((local, chunks))
}

impl SegmentPlan {
    /// Validates and uploads the table (on `stream`). `segments` sorted and disjoint (what
    /// [`validate_groups`](crate::validate_groups) returns), within `0..numel`, each with a group
    /// `< n_groups`; `shard` within `0..numel`.
    pub fn new(
        stream: &Arc<CudaStream>,
        segments: &[Segment],
        numel: usize,
        shard: Range<usize>,
        n_groups: usize,
    ) -> Result<Self> {
        let (local, n_chunks) = local_segments(segments, numel, shard.clone(), n_groups)?;
        let mut words = Vec::with_capacity(local.len().max(1) * SEGMENT_WORDS);
        for s in &local {
            words.extend_from_slice(&[
                s.range.start as u64,
                s.range.end as u64,
                s.chunk_begin as u64,
                s.group as u64,
            ]);
        }
        if words.is_empty() {
            // cudarc cannot allocate 0 bytes portably; the kernels never read an empty table.
            words.extend_from_slice(&[0; SEGMENT_WORDS]);
        }
        const { assert!(size_of::<ffi::tilearn_optim_segment>() == SEGMENT_WORDS * 8) };
        let table = stream.clone_htod(&words).map_err(|e| FusedError::Cuda {
            op: "SegmentPlan::new",
            message: format!("uploading the segment table: {e}"),
        })?;
        Ok(SegmentPlan {
            table,
            local,
            n_chunks,
            n_groups,
            shard,
        })
    }

    /// A plan over the whole buffer (`shard = 0..numel`).
    pub fn whole(
        stream: &Arc<CudaStream>,
        segments: &[Segment],
        numel: usize,
        n_groups: usize,
    ) -> Result<Self> {
        Self::new(stream, segments, numel, 0..numel, n_groups)
    }

    /// Length every launch buffer must have (the shard's length).
    pub fn len(&self) -> usize {
        self.shard.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shard.is_empty()
    }

    /// The global range this plan updates.
    pub fn shard(&self) -> Range<usize> {
        self.shard.clone()
    }

    /// Number of groups whose scalars a step takes.
    pub fn n_groups(&self) -> usize {
        self.n_groups
    }

    /// The segments in local indexing (one per tensor range; LAMB's trust ratio is per segment).
    pub fn segments(&self) -> &[LocalSegment] {
        &self.local
    }

    /// Total work chunks.
    pub fn n_chunks(&self) -> usize {
        self.n_chunks
    }

    pub(super) fn table(&self) -> &CudaSlice<u64> {
        &self.table
    }
}
