//! Handing parameter gradients on while the backward still runs: the hook data parallelism
//! uses to all-reduce the gradients of the last layers while the first ones are computed
//! (PyTorch DDP's bucketed overlap).
//!
//! The backward runs from the loss to the embedding, so the gradients become final from the
//! end of the flat buffer towards its start ([`ModelLayout::backward_handoffs`]). After the
//! final norm and after each layer, [`Handoff`] splits the finished part off the view it
//! still writes to and hands it to a [`GradientSink`]; at the end it hands over the rest
//! (the embedding and the first layer's front) and lets the sink order the compute stream
//! after what it launched.
//!
//! The gradient buffer is not tracked by cudarc's events ([`GpuLlama`](super::GpuLlama) makes
//! it so): one allocation has one pair of events, so a collective in flight on a finished part
//! would otherwise make every later kernel that writes *another* part wait for it. The order
//! is kept by hand instead: a sink's collectives wait for the compute stream as it stands
//! when the part is handed on, and [`GradientSink::finish`] makes the compute stream wait
//! for all of them before the optimizer reads the gradients.
//!
//! Under ZeRO-2 the backward need not write into a whole-model buffer: [`Handoff::windowed`]
//! gives each part its space in a small window ([`crate::grad_window::WindowPlan`]) and the
//! compute code addresses gradients by their global ranges through [`GradParts`], whichever
//! storage is behind them. Before a part is written its space is *prepared*: zeroed, and where
//! the part meets the rank's owned shard, filled with what the owned-shard accumulator holds
//! (the backward then adds this micro-batch's gradient onto the accumulated one, and the
//! reduction to the owner sums the ranks' new gradients onto it, exactly as the owned part of
//! a whole buffer behaves). When a later part takes a part's space, the compute stream first
//! waits for that part's reduction ([`GradientSink::completion`]) and copies the owned piece
//! back into the accumulator.
//!
//! The CUDA-graph step does not zero the buffer first ([`Handoff::unzeroed`]): each weight's
//! first product *writes* its gradient ([`GradParts::claim`] says when it may), what a kernel
//! adds to is zeroed just before ([`GradParts::range`]), and [`Handoff::finish`] zeroes what
//! nothing wrote. At TinyLlama that saves the 4.4 GB zeroing pass and as much again read back
//! by the weight-gradient products; the gradients are the same bits.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaViewMut};
use tilearn_ops::cuda::{CudaStream, WeightGrad};

use super::cuda_err;
use super::views::{split_owned, sub_mut, two_mut};
use crate::error::{EngineError, Result};
use crate::grad_window::WindowPlan;
use crate::model::ModelLayout;

/// Receives the finished parts of the gradient buffer during a backward.
pub trait GradientSink {
    /// `part` is elements `offset..offset + part.len()` of the flat gradient buffer (or, under
    /// ZeRO-2, the window space that holds them); no kernel of this backward writes them any
    /// more. `stream` is the compute stream, whose enqueued work produced them. Launch without
    /// blocking; the part must not be touched after [`completion`](Self::completion)'s event
    /// or [`finish`](Self::finish).
    fn ready(
        &mut self,
        offset: usize,
        part: CudaViewMut<'_, f32>,
        stream: &Arc<CudaStream>,
    ) -> Result<()>;

    /// An event that completes when everything launched so far is done with its parts (the
    /// window's space of those parts may then be reused).
    fn completion(&mut self) -> Result<CudaEvent>;

    /// After the whole buffer was handed on: order `stream` after everything launched.
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()>;
}

/// The gradients a backward writes, addressed by their global ranges of the flat buffer:
/// one piece of the whole buffer, or the window spaces of the parts being written.
pub(crate) struct GradParts<'v> {
    /// (global index of the piece's first element, the piece).
    pieces: Vec<(usize, CudaViewMut<'v, f32>)>,
    /// Under [`Handoff::unzeroed`]: what this backward has written so far.
    unzeroed: Option<&'v mut Unzeroed>,
}

/// Sorted, merged ranges of a flat buffer.
#[derive(Debug, Default)]
struct Written(Vec<Range<usize>>);

impl Written {
    /// The parts of `r` outside every range, in order.
    fn gaps(&self, r: &Range<usize>) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let mut at = r.start;
        for w in &self.0 {
            if w.start >= r.end {
                break;
            }
            if w.end <= at {
                continue;
            }
            if w.start > at {
                out.push(at..w.start);
            }
            at = w.end;
        }
        if at < r.end {
            out.push(at..r.end);
        }
        out
    }

    fn add(&mut self, r: Range<usize>) {
        if r.is_empty() {
            return;
        }
        let first = self.0.partition_point(|w| w.end < r.start);
        let mut merged = r;
        let mut last = first;
        while let Some(w) = self.0.get(last).filter(|w| w.start <= merged.end) {
            merged = merged.start.min(w.start)..merged.end.max(w.end);
            last += 1;
        }
        self.0.splice(first..last, std::iter::once(merged));
    }
}

/// A backward into a buffer nobody zeroed: what it has written, and the stream it zeroes on.
struct Unzeroed {
    written: Written,
    stream: Arc<CudaStream>,
}

impl GradParts<'_> {
    /// How the first product into `r` may store its gradient: [`WeightGrad::Write`] when the
    /// buffer was not zeroed and nothing of `r` has been written this backward (the product
    /// must then cover all of `r`), else [`WeightGrad::Add`]. Either way `r` counts as
    /// written from here on.
    pub(crate) fn claim(&mut self, r: Range<usize>) -> Result<WeightGrad> {
        let untouched = self
            .unzeroed
            .as_deref()
            .is_some_and(|u| !r.is_empty() && u.written.gaps(&r) == [r.clone()]);
        if untouched {
            if let Some(u) = self.unzeroed.as_deref_mut() {
                u.written.add(r);
            }
            return Ok(WeightGrad::Write);
        }
        self.settle(&r)?;
        Ok(WeightGrad::Add)
    }

    /// Under [`Handoff::unzeroed`]: zeroes what of `r` was not written yet (a kernel is about
    /// to add into it), and counts `r` as written.
    fn settle(&mut self, r: &Range<usize>) -> Result<()> {
        let Some((gaps, stream)) = self
            .unzeroed
            .as_deref()
            .map(|u| (u.written.gaps(r), u.stream.clone()))
        else {
            return Ok(());
        };
        if !gaps.is_empty() {
            let k = self.locate(r)?;
            let (start, piece) = &mut self.pieces[k];
            for gap in gaps {
                let mut view = sub_mut(piece.slice_mut(..), gap.start - *start..gap.end - *start)?;
                stream
                    .memset_zeros(&mut view)
                    .map_err(|e| cuda_err("zeroing gradients before they are added to", e))?;
            }
        }
        if let Some(u) = self.unzeroed.as_deref_mut() {
            u.written.add(r.clone());
        }
        Ok(())
    }

    fn locate(&self, r: &Range<usize>) -> Result<usize> {
        self.pieces
            .iter()
            .position(|(start, v)| *start <= r.start && r.end <= start + v.len())
            .ok_or_else(|| {
                internal(&format!(
                    "gradients {r:?} are not among the parts being written ({:?})",
                    self.pieces
                        .iter()
                        .map(|(s, v)| *s..s + v.len())
                        .collect::<Vec<_>>()
                ))
            })
    }

    /// The gradients of the global range `r`, to add into (zeroed first where an unzeroed
    /// buffer has not been written there yet).
    pub(crate) fn range(&mut self, r: Range<usize>) -> Result<CudaViewMut<'_, f32>> {
        self.settle(&r)?;
        let k = self.locate(&r)?;
        let (start, piece) = &mut self.pieces[k];
        let local = r.start - *start..r.end - *start;
        sub_mut(piece.slice_mut(..), local)
    }

    /// The gradients of two disjoint global ranges of one tensor's part (`a` before `b`: a
    /// weight and its bias).
    pub(crate) fn two(
        &mut self,
        a: Range<usize>,
        b: Range<usize>,
    ) -> Result<(CudaViewMut<'_, f32>, CudaViewMut<'_, f32>)> {
        self.settle(&a)?;
        self.settle(&b)?;
        let k = self.locate(&(a.start..b.end))?;
        let (start, piece) = &mut self.pieces[k];
        let s = *start;
        two_mut(
            piece.slice_mut(..),
            a.start - s..a.end - s,
            b.start - s..b.end - s,
        )
    }
}

/// ZeRO-2's state during one backward (see the module docs).
struct Windowed<'g> {
    plan: &'g WindowPlan,
    window: CudaViewMut<'g, f32>,
    /// The owned shard's accumulated gradients (global elements `owned`).
    acc: CudaViewMut<'g, f32>,
    owned: Range<usize>,
    /// The part being written.
    current: usize,
    /// Per part: the sink's completion event once handed on, until its space is reused.
    done: Vec<Option<CudaEvent>>,
    /// Parts whose owned piece is back in the accumulator.
    kept: Vec<bool>,
}

impl Windowed<'_> {
    /// Where part `i` meets the owned shard: (global range, its place in the window).
    fn owned_piece(&self, i: usize) -> Option<(Range<usize>, Range<usize>)> {
        let part = &self.plan.parts[i];
        let lo = part.start.max(self.owned.start);
        let hi = part.end.min(self.owned.end);
        if lo >= hi {
            return None;
        }
        let at = self.plan.at[i] + (lo - part.start);
        Some((lo..hi, at..at + (hi - lo)))
    }

    /// Zeroes part `i`'s space and puts the accumulated owned piece there.
    fn prepare(&mut self, i: usize, stream: &Arc<CudaStream>) -> Result<()> {
        for j in self.plan.reuses[i].clone() {
            self.keep(j, stream)?;
        }
        let space = self.plan.space(i);
        let mut view = sub_mut(self.window.slice_mut(..), space)?;
        stream
            .memset_zeros(&mut view)
            .map_err(|e| cuda_err("zeroing the gradient window", e))?;
        if let Some((global, local)) = self.owned_piece(i) {
            let from = global.start - self.owned.start..global.end - self.owned.start;
            let src = self.acc.slice(from);
            let mut dst = sub_mut(self.window.slice_mut(..), local)?;
            stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| cuda_err("preparing the gradient window", e))?;
        }
        Ok(())
    }

    /// After part `j`'s reduction: its owned piece (the ranks' sum) back into the accumulator.
    fn keep(&mut self, j: usize, stream: &Arc<CudaStream>) -> Result<()> {
        if self.kept[j] {
            return Ok(());
        }
        let done = self.done[j]
            .take()
            .ok_or_else(|| internal("a window part is reused before it was handed on"))?;
        stream
            .wait(&done)
            .map_err(|e| cuda_err("ordering the backward after a reduction", e))?;
        if let Some((global, local)) = self.owned_piece(j) {
            let to = global.start - self.owned.start..global.end - self.owned.start;
            let src = self.window.slice(local);
            let mut dst = sub_mut(self.acc.slice_mut(..), to)?;
            stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| cuda_err("keeping the owned gradients", e))?;
        }
        self.kept[j] = true;
        Ok(())
    }

    /// The parts being written: the current one and the persistent one.
    fn parts(&mut self) -> Result<GradParts<'_>> {
        let current = self.plan.space(self.current);
        let cur_start = self.plan.parts[self.current].start;
        let pieces = match self.plan.persistent.filter(|&p| p != self.current) {
            None => vec![(cur_start, sub_mut(self.window.slice_mut(..), current)?)],
            Some(p) => {
                // The persistent part is at the window's start, before every ring part.
                let (lo, hi) = two_mut(self.window.slice_mut(..), self.plan.space(p), current)?;
                vec![(self.plan.parts[p].start, lo), (cur_start, hi)]
            }
        };
        Ok(GradParts {
            pieces,
            unzeroed: None,
        })
    }
}

enum Mode<'g> {
    /// The whole flat buffer; `rest` is the part still written (elements `0..len`).
    Whole(Option<CudaViewMut<'g, f32>>),
    Window(Windowed<'g>),
}

/// The gradient storage a backward writes to, handing finished parts on as it goes.
pub(crate) struct Handoff<'g, 's> {
    mode: Mode<'g>,
    sink: Option<&'s mut dyn GradientSink>,
    offsets: Vec<usize>,
    next: usize,
    /// Set by [`Handoff::unzeroed`].
    unzeroed: Option<Unzeroed>,
}

fn internal(what: &str) -> EngineError {
    EngineError::InvalidArgument {
        argument: "gradient hand-off".into(),
        message: format!("internal: {what}"),
    }
}

impl<'g, 's> Handoff<'g, 's> {
    /// Without a sink nothing is split and everything stays one view.
    pub(crate) fn new(
        grads: CudaViewMut<'g, f32>,
        sink: Option<&'s mut dyn GradientSink>,
        layout: &ModelLayout,
    ) -> Self {
        let offsets = match sink {
            Some(_) => layout.backward_handoffs().unwrap_or_default(),
            None => Vec::new(),
        };
        Handoff {
            mode: Mode::Whole(Some(grads)),
            sink,
            offsets,
            next: 0,
            unzeroed: None,
        }
    }

    /// The whole buffer, not zeroed (the module docs say how the backward then fills it);
    /// nothing is handed on before [`finish`](Self::finish), which zeroes what no kernel
    /// wrote, so a sink would see stale values.
    pub(crate) fn unzeroed(grads: CudaViewMut<'g, f32>, stream: &Arc<CudaStream>) -> Self {
        Handoff {
            mode: Mode::Whole(Some(grads)),
            sink: None,
            offsets: Vec::new(),
            next: 0,
            unzeroed: Some(Unzeroed {
                written: Written::default(),
                stream: stream.clone(),
            }),
        }
    }

    /// ZeRO-2: the parts are written in `window` as `plan` places them, each reduced through
    /// `sink` when finished and its owned piece (global elements `owned`) kept in `acc`.
    /// Prepares the first part (and the persistent one) on `stream`.
    pub(crate) fn windowed(
        plan: &'g WindowPlan,
        window: CudaViewMut<'g, f32>,
        acc: CudaViewMut<'g, f32>,
        owned: Range<usize>,
        sink: &'s mut dyn GradientSink,
        stream: &Arc<CudaStream>,
    ) -> Result<Self> {
        if acc.len() != owned.len() || window.len() < plan.len || plan.parts.is_empty() {
            return Err(internal("the gradient window does not match its plan"));
        }
        let n = plan.parts.len();
        let mut w = Windowed {
            plan,
            window,
            acc,
            owned,
            current: 0,
            done: (0..n).map(|_| None).collect(),
            kept: vec![false; n],
        };
        if let Some(p) = plan.persistent {
            w.prepare(p, stream)?;
        }
        if plan.persistent != Some(0) {
            w.prepare(0, stream)?;
        }
        Ok(Handoff {
            mode: Mode::Window(w),
            sink: Some(sink),
            offsets: Vec::new(),
            next: 0,
            unzeroed: None,
        })
    }

    /// The gradients the backward still writes, by their global ranges.
    pub(crate) fn grads(&mut self) -> Result<GradParts<'_>> {
        match &mut self.mode {
            Mode::Whole(rest) => {
                let rest = rest
                    .as_mut()
                    .ok_or_else(|| internal("the gradient view was handed on twice"))?;
                Ok(GradParts {
                    pieces: vec![(0, rest.slice_mut(..))],
                    unzeroed: self.unzeroed.as_mut(),
                })
            }
            Mode::Window(w) => w.parts(),
        }
    }

    /// The next part is final: hand it on.
    pub(crate) fn pass_on(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        let Some(sink) = self.sink.as_deref_mut() else {
            return Ok(());
        };
        match &mut self.mode {
            Mode::Whole(rest) => {
                let Some(&at) = self.offsets.get(self.next) else {
                    return Ok(());
                };
                self.next += 1;
                let whole = rest
                    .take()
                    .ok_or_else(|| internal("the gradient view was handed on twice"))?;
                let (front, done) = split_owned(whole, at)?;
                *rest = Some(front);
                sink.ready(at, done, stream)
            }
            Mode::Window(w) => {
                let i = w.current;
                // The last part is handed on by `finish`.
                if i + 1 >= w.plan.parts.len() {
                    return Ok(());
                }
                let space = sub_mut(w.window.slice_mut(..), w.plan.space(i))?;
                sink.ready(w.plan.parts[i].start, space, stream)?;
                w.done[i] = Some(sink.completion()?);
                w.current = i + 1;
                if w.plan.persistent != Some(i + 1) {
                    w.prepare(i + 1, stream)?;
                }
                Ok(())
            }
        }
    }

    /// The backward is over: hand on what is left and order `stream` after the sink's work
    /// (and, under ZeRO-2, keep the owned pieces still in the window).
    pub(crate) fn finish(mut self, stream: &Arc<CudaStream>) -> Result<()> {
        if let (Some(u), Mode::Whole(Some(rest))) = (&self.unzeroed, &mut self.mode) {
            for gap in u.written.gaps(&(0..rest.len())) {
                let mut view = sub_mut(rest.slice_mut(..), gap)?;
                stream
                    .memset_zeros(&mut view)
                    .map_err(|e| cuda_err("zeroing the gradients nothing wrote", e))?;
            }
        }
        let Some(sink) = self.sink.as_deref_mut() else {
            return Ok(());
        };
        match &mut self.mode {
            Mode::Whole(rest) => {
                if let Some(rest) = rest.take()
                    && !rest.is_empty()
                {
                    sink.ready(0, rest, stream)?;
                }
                sink.finish(stream)
            }
            Mode::Window(w) => {
                let i = w.current;
                if i + 1 != w.plan.parts.len() {
                    return Err(internal("the backward ended before its last part"));
                }
                let space = sub_mut(w.window.slice_mut(..), w.plan.space(i))?;
                sink.ready(w.plan.parts[i].start, space, stream)?;
                w.done[i] = Some(sink.completion()?);
                sink.finish(stream)?;
                for j in 0..w.plan.parts.len() {
                    w.keep(j, stream)?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Written;

    fn written(ranges: &[std::ops::Range<usize>]) -> Written {
        let mut w = Written::default();
        for r in ranges {
            w.add(r.clone());
        }
        w
    }

    #[test]
    fn ranges_merge_where_they_touch_or_overlap() {
        let w = written(&[10..20, 30..40, 20..25, 38..50, 0..0, 60..70]);
        assert_eq!(w.0, vec![10..25, 30..50, 60..70]);
        let w = written(&[5..10, 0..100]);
        assert_eq!(w.0, vec![0..100]);
    }

    #[test]
    fn gaps_are_what_no_range_covers() {
        let w = written(&[10..20, 30..40]);
        assert_eq!(w.gaps(&(0..50)), vec![0..10, 20..30, 40..50]);
        assert_eq!(w.gaps(&(12..35)), vec![20..30]);
        assert_eq!(w.gaps(&(10..20)), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(w.gaps(&(20..30)), vec![20..30]);
        assert_eq!(Written::default().gaps(&(3..7)), vec![3..7]);
    }
}
