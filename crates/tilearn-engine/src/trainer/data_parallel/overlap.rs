//! The DDP gradient all-reduce overlapped with the backward.
//!
//! On the step's last micro-batch the GPU engine hands each finished part of the gradient
//! buffer on as soon as its layer's backward is enqueued (`gpu/sink.rs`); [`OverlapSink`]
//! all-reduces it at once, in buckets of at most `--ddp-bucket-cap-mb`, on the
//! communicator's own stream, while the compute stream goes on with the earlier layers. A
//! side stream collects the buckets' completions, and at the end of the backward the compute
//! stream waits for the side stream only, so the optimizer reads reduced gradients.
//!
//! With `--ddp-comm-dtype bf16` a bucket is rounded to bf16 on the compute stream into a
//! (likewise untracked) bf16 copy of the buffer, all-reduced there, and widened back into the
//! gradients on the side stream, so neither conversion holds the backward up.
//!
//! Every bucket leaves two timestamps (CUDA events): when its gradients were ready on the
//! compute stream and when its all-reduce ended. [`summarize`] turns them, with the end of the
//! backward, into the time the all-reduce kept the link busy and the part of it that was not
//! hidden behind the backward (what the step waited for).

#[cfg(feature = "cuda")]
pub(super) use device::{OverlapSink, ReduceToOwnersSink, Timeline};

/// One step's overlapped all-reduce, summarised.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OverlapStats {
    pub buckets: usize,
    /// Time the all-reduces ran (a bucket runs from when it was ready, or when the previous
    /// bucket ended if later, to its end), in ms.
    pub comm_ms: f64,
    /// The part of `comm_ms` after the backward ended: what the step waited for.
    pub exposed_ms: f64,
}

impl OverlapStats {
    /// The share of the all-reduce time hidden behind the backward (1 when there was none).
    pub fn hidden_share(&self) -> f64 {
        if self.comm_ms > 0.0 {
            (1.0 - self.exposed_ms / self.comm_ms).clamp(0.0, 1.0)
        } else {
            1.0
        }
    }
}

/// `buckets`: (ready, done) times in ms of each bucket in launch order (one stream runs them
/// in that order); `backward_end`: when the compute stream finished the backward, same clock.
pub fn summarize(buckets: &[(f64, f64)], backward_end: f64) -> OverlapStats {
    let mut comm_ms = 0.0;
    let mut previous_done = f64::NEG_INFINITY;
    for &(ready, done) in buckets {
        comm_ms += (done - ready.max(previous_done)).max(0.0);
        previous_done = previous_done.max(done);
    }
    let last = buckets
        .iter()
        .map(|b| b.1)
        .fold(f64::NEG_INFINITY, f64::max);
    let exposed_ms = if buckets.is_empty() {
        0.0
    } else {
        (last - backward_end).clamp(0.0, comm_ms)
    };
    OverlapStats {
        buckets: buckets.len(),
        comm_ms,
        exposed_ms,
    }
}

#[cfg(feature = "cuda")]
mod device {
    use std::sync::Arc;

    use cudarc::driver::sys::CUevent_flags;
    use cudarc::driver::{CudaEvent, CudaSlice, CudaViewMut};
    use half::bf16;
    use tilearn_ops::cuda::{CudaStream, cast_bf16_to_f32, cast_f32_to_bf16};
    use tilearn_parallel::{BufferMut, Communicator, ReduceOp};

    use super::{OverlapStats, summarize};
    use crate::Result;
    use crate::gpu::{GradientSink, cuda_err};
    use crate::trainer::data_parallel::layout::ShardLayout;

    fn timed_event(stream: &CudaStream) -> Result<CudaEvent> {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| cuda_err("recording an all-reduce timestamp", e))
    }

    /// Everything the side stream was asked to wait for so far, as one event.
    fn completion(side: &CudaStream) -> Result<CudaEvent> {
        side.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| cuda_err("recording a reduction's completion", e))
    }

    /// The timestamps of one step's overlapped all-reduce.
    #[derive(Default)]
    pub struct Timeline {
        /// (ready on the compute stream, done on the side stream, offset, elements).
        buckets: Vec<(CudaEvent, CudaEvent, usize, usize)>,
        backward_end: Option<CudaEvent>,
    }

    impl Timeline {
        /// Reads the events (all complete once the step's loss was read back) into times
        /// relative to the first bucket's readiness.
        pub fn stats(&self) -> Result<Option<(OverlapStats, Vec<BucketTimes>)>> {
            let (Some(first), Some(end)) = (self.buckets.first(), &self.backward_end) else {
                return Ok(None);
            };
            let since = |e: &CudaEvent| -> Result<f64> {
                first
                    .0
                    .elapsed_ms(e)
                    .map(f64::from)
                    .map_err(|e| cuda_err("reading an all-reduce timestamp", e))
            };
            let mut times = Vec::with_capacity(self.buckets.len());
            for (ready, done, offset, elements) in &self.buckets {
                times.push(BucketTimes {
                    offset: *offset,
                    elements: *elements,
                    ready_ms: since(ready)?,
                    done_ms: since(done)?,
                });
            }
            let pairs: Vec<(f64, f64)> = times.iter().map(|t| (t.ready_ms, t.done_ms)).collect();
            Ok(Some((summarize(&pairs, since(end)?), times)))
        }
    }

    /// One bucket's place and timestamps (ms after the first bucket was ready).
    #[derive(Clone, Copy, Debug)]
    pub struct BucketTimes {
        pub offset: usize,
        pub elements: usize,
        pub ready_ms: f64,
        pub done_ms: f64,
    }

    /// All-reduces (sum) each part of the gradients handed on, without waiting.
    pub struct OverlapSink<'a> {
        pub comm: &'a dyn Communicator,
        /// Largest bucket, in elements.
        pub cap: usize,
        /// Collects the buckets' completions (the compute stream waits for it at the end).
        pub side: &'a Arc<CudaStream>,
        pub timeline: &'a mut Timeline,
        /// `--ddp-comm-dtype bf16`: where the buckets travel (as long as the gradient buffer).
        pub compressed: Option<&'a mut CudaSlice<bf16>>,
    }

    impl GradientSink for OverlapSink<'_> {
        fn ready(
            &mut self,
            offset: usize,
            mut part: CudaViewMut<'_, f32>,
            stream: &Arc<CudaStream>,
        ) -> Result<()> {
            // Equal buckets of at most `cap`, the end of the part first (backward order).
            let len = part.len();
            let count = len.div_ceil(self.cap.max(1)).max(1);
            for k in (0..count).rev() {
                let range = k * len / count..(k + 1) * len / count;
                if range.is_empty() {
                    continue;
                }
                let ready = timed_event(stream)?;
                let elements = range.len();
                match self.compressed.as_deref_mut() {
                    None => {
                        let bucket = BufferMut::from(part.slice_mut(range.clone()));
                        let work = self.comm.all_reduce(bucket, ReduceOp::Sum)?;
                        // The side stream, not the compute stream, waits: the backward goes on.
                        work.wait_on_stream(self.side)?;
                    }
                    Some(wire) => {
                        let at = offset + range.start..offset + range.end;
                        let mut travel = wire.slice_mut(at);
                        cast_f32_to_bf16(stream, &part.slice(range.clone()), &mut travel)?;
                        let work = self
                            .comm
                            .all_reduce(BufferMut::from(travel.slice_mut(..)), ReduceOp::Sum)?;
                        work.wait_on_stream(self.side)?;
                        let mut bucket = part.slice_mut(range.clone());
                        cast_bf16_to_f32(self.side, &travel, &mut bucket)?;
                    }
                }
                let done = timed_event(self.side)?;
                self.timeline
                    .buckets
                    .push((ready, done, offset + range.start, elements));
            }
            Ok(())
        }

        fn completion(&mut self) -> Result<CudaEvent> {
            completion(self.side)
        }

        fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
            self.timeline.backward_end = Some(timed_event(stream)?);
            stream
                .join(self.side)
                .map_err(|e| cuda_err("ordering the optimizer after the all-reduce", e))
        }
    }

    /// ZeRO-2: reduces (sum) each part of the gradients handed on to the rank that owns it,
    /// without waiting. A part is cut at the shard boundaries of `layout` (and into buckets of
    /// at most `cap`), and each piece is reduced to its owner, so after the backward every
    /// rank's owned shard holds the ranks' sum. In a whole gradient buffer the rest is stale
    /// (the caller zeroes it); in the GPU engine's window (`gpu/sink.rs`) the owner copies its
    /// piece into its owned-shard accumulator once [`GradientSink::completion`] says the
    /// reduction is done.
    pub struct ReduceToOwnersSink<'a> {
        pub comm: &'a dyn Communicator,
        pub layout: ShardLayout,
        pub cap: usize,
        pub side: &'a Arc<CudaStream>,
        pub timeline: &'a mut Timeline,
    }

    impl GradientSink for ReduceToOwnersSink<'_> {
        fn ready(
            &mut self,
            offset: usize,
            mut part: CudaViewMut<'_, f32>,
            stream: &Arc<CudaStream>,
        ) -> Result<()> {
            let whole = offset..offset + part.len();
            for (range, owner) in self.layout.pieces_to_owners(whole, self.cap) {
                let ready = timed_event(stream)?;
                let local = range.start - offset..range.end - offset;
                let piece = BufferMut::from(part.slice_mut(local));
                let work = self.comm.reduce(piece, ReduceOp::Sum, owner)?;
                work.wait_on_stream(self.side)?;
                let done = timed_event(self.side)?;
                self.timeline
                    .buckets
                    .push((ready, done, range.start, range.len()));
            }
            Ok(())
        }

        fn completion(&mut self) -> Result<CudaEvent> {
            completion(self.side)
        }

        fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
            self.timeline.backward_end = Some(timed_event(stream)?);
            stream
                .join(self.side)
                .map_err(|e| cuda_err("ordering the optimizer after the reduces", e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hidden_time_is_what_ends_before_the_backward() {
        // Three buckets; the second waits for the first; the last ends 1 ms after the
        // backward: 2 + 2 + 2 = 6 ms of communication, 1 exposed.
        let s = summarize(&[(0.0, 2.0), (1.0, 4.0), (5.0, 7.0)], 6.0);
        assert_eq!(s.buckets, 3);
        assert!((s.comm_ms - 6.0).abs() < 1e-12, "{s:?}");
        assert!((s.exposed_ms - 1.0).abs() < 1e-12, "{s:?}");
        assert!((s.hidden_share() - 5.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn communication_after_the_backward_is_all_exposed() {
        let s = summarize(&[(10.0, 12.0), (10.0, 13.0)], 10.0);
        assert!((s.comm_ms - 3.0).abs() < 1e-12);
        assert!((s.exposed_ms - 3.0).abs() < 1e-12);
        assert_eq!(s.hidden_share(), 0.0);
        assert_eq!(summarize(&[], 1.0).hidden_share(), 1.0);
    }
}
