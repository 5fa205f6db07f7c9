//! How the flat parameter/gradient buffer is cut for data parallelism: gradient buckets for the
//! all-reduce and the ZeRO shard each rank owns. Both are plain element ranges of the one flat
//! buffer (`ParamStore`'s Hugging Face order), so a collective on them copies nothing.

use std::ops::Range;

/// PyTorch DDP's first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB): small so
/// that the first all-reduce starts early in the backward.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;

/// The gradient buckets of a flat f32 buffer of `numel` elements with `cap_bytes` per bucket, in
/// the order the backward completes them: from the end of the buffer (the last layers and the
/// LM head come first in a backward) towards the start. The first bucket holds at most
/// [`FIRST_BUCKET_BYTES`], as in PyTorch.
pub fn gradient_buckets(numel: usize, cap_bytes: usize) -> Vec<Range<usize>> {
    let elems = |bytes: usize| (bytes / std::mem::size_of::<f32>()).max(1);
    let cap = elems(cap_bytes);
    let first = elems(FIRST_BUCKET_BYTES.min(cap_bytes));
    let mut buckets = Vec::new();
    let mut end = numel;
    while end > 0 {
        let len = if buckets.is_empty() { first } else { cap };
        let start = end.saturating_sub(len);
        buckets.push(start..end);
        end = start;
    }
    buckets
}

/// ZeRO's partition of `numel` elements among `world` ranks: rank `r` owns the contiguous shard
/// `r·q .. (r+1)·q` with `q = numel / world`, and the last rank also owns the `numel % world`
/// tail. The bulk `0 .. world·q` is exactly NCCL's in-place reduce-scatter/all-gather layout, so
/// no buffer needs padding; the short tail (fewer than `world` elements) is all-reduced and
/// broadcast instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    pub numel: usize,
    pub world: usize,
}

impl ShardLayout {
    pub fn new(numel: usize, world: usize) -> ShardLayout {
        ShardLayout {
            numel,
            world: world.max(1),
        }
    }

    /// Elements per rank in the bulk.
    pub fn per_rank(&self) -> usize {
        self.numel / self.world
    }

    /// The evenly divided part, `0 .. world·q`.
    pub fn bulk(&self) -> Range<usize> {
        0..self.per_rank() * self.world
    }

    /// The remainder the last rank owns, `world·q .. numel`.
    pub fn tail(&self) -> Range<usize> {
        self.bulk().end..self.numel
    }

    /// The elements rank `rank` owns (steps with the optimizer and checkpoints).
    pub fn owned(&self, rank: usize) -> Range<usize> {
        let q = self.per_rank();
        let end = if rank + 1 == self.world {
            self.numel
        } else {
            (rank + 1) * q
        };
        rank * q..end
    }

    /// The rank that owns element `index` (< `numel`).
    pub fn owner_of(&self, index: usize) -> usize {
        match self.per_rank() {
            0 => self.world - 1,
            q => (index / q).min(self.world - 1),
        }
    }

    /// ZeRO-2's reductions of a finished part of the gradient buffer: `part` cut at the shard
    /// boundaries and into pieces of at most `cap` elements, each with the rank that owns it,
    /// from the end of the part (the order the backward finished it).
    pub fn pieces_to_owners(&self, part: Range<usize>, cap: usize) -> Vec<(Range<usize>, usize)> {
        let mut pieces = Vec::new();
        let mut hi = part.end.min(self.numel);
        while hi > part.start {
            let owner = self.owner_of(hi - 1);
            let lo = self
                .owned(owner)
                .start
                .max(part.start)
                .max(hi.saturating_sub(cap.max(1)));
            pieces.push((lo..hi, owner));
            hi = lo;
        }
        pieces
    }

    /// The rank that owns the tail (and broadcasts it after each step).
    pub fn tail_owner(&self) -> usize {
        self.world - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_the_buffer_from_the_end_with_a_small_first_one() {
        let mib = 1 << 20;
        let numel = 3 * mib; // 12 MiB of f32
        let buckets = gradient_buckets(numel, 5 * mib);
        assert_eq!(buckets[0], numel - mib / 4..numel, "first bucket: 1 MiB");
        assert_eq!(buckets[1].len(), 5 * mib / 4);
        let mut covered: Vec<Range<usize>> = buckets.clone();
        covered.sort_by_key(|r| r.start);
        assert_eq!(covered[0].start, 0);
        for pair in covered.windows(2) {
            assert_eq!(pair[0].end, pair[1].start, "contiguous, no overlap");
        }
        assert_eq!(covered.last().unwrap().end, numel);
        // A cap below 1 MiB also caps the first bucket.
        assert_eq!(gradient_buckets(1000, 400)[0], 900..1000);
        assert!(gradient_buckets(0, 400).is_empty());
    }

    #[test]
    fn pieces_go_to_their_owners_in_backward_order() {
        for (numel, world, cap) in [(1001, 4, 100), (10, 3, 1), (7, 5, 1000), (64, 2, 64)] {
            let layout = ShardLayout::new(numel, world);
            for part in [0..numel, 3..numel - 2, numel / 2..numel] {
                let pieces = layout.pieces_to_owners(part.clone(), cap);
                let mut end = part.end;
                for (range, owner) in &pieces {
                    assert_eq!(range.end, end, "contiguous from the end: {pieces:?}");
                    assert!(!range.is_empty() && range.len() <= cap);
                    let owned = layout.owned(*owner);
                    assert!(owned.start <= range.start && range.end <= owned.end);
                    end = range.start;
                }
                assert_eq!(end, part.start, "{numel} {world} {part:?}: {pieces:?}");
            }
        }
    }

    #[test]
    fn shards_partition_any_length() {
        for numel in [0, 1, 5, 7, 64, 1001] {
            for world in 1..=5 {
                let layout = ShardLayout::new(numel, world);
                let mut next = 0;
                for rank in 0..world {
                    let owned = layout.owned(rank);
                    assert_eq!(owned.start, next, "{numel} {world} {rank}");
                    next = owned.end;
                }
                assert_eq!(next, numel);
                for index in 0..numel {
                    let owner = layout.owner_of(index);
                    assert!(
                        layout.owned(owner).contains(&index),
                        "{numel} {world} {index}"
                    );
                }
                assert_eq!(layout.bulk().len() % world, 0);
                assert!(layout.tail().len() < world);
            }
        }
    }
}
