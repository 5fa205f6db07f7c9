//! The schedule by which pieces of a flat range move between host code and a device through a
//! small ring of staging buffers with asynchronous copies, so the host-side work of one piece
//! (reading and decoding a file, encoding and writing one) overlaps the copy of the previous
//! one instead of waiting for it.
//!
//! * Upload (loads, initialisation): for each piece, take the next slot, wait for the copy that
//!   last used it, let `fill` write the piece into it, queue its host → device copy and move on
//!   without waiting. With two slots, piece `k + 1` is decoded while piece `k` is copied; the
//!   ring persists across [`StagingRing::upload`] calls, so this overlap spans tensors too.
//!   [`StagingRing::finish`] waits for the last copies.
//! * Download (saves): queue the copies of the first pieces (one per slot), then for each piece
//!   wait for its copy, hand it to `sink`, and queue the copy of the piece one ring length ahead
//!   into the slot just consumed. Every piece of a call is consumed before it returns.
//!
//! The schedule is plain Rust over the [`StagingSlot`] trait: the CUDA engine implements it with
//! page-locked buffers and one event per slot (`gpu::staging`); the tests here use a simulated
//! device whose copies take effect only when waited for, so a slot reused before its copy
//! finished gives wrong values.

use std::ops::Range;

use crate::error::Result;

/// One staging buffer and the asynchronous copy that may be using it.
pub(crate) trait StagingSlot {
    /// What the copies read from or write to (a device buffer).
    type Device: ?Sized;

    /// Blocks until the copy last queued on this slot has finished (at once if none is).
    fn wait(&mut self) -> Result<()>;

    /// The host buffer. Called only after [`StagingSlot::wait`], so no copy is using it.
    fn host(&mut self) -> Result<&mut [f32]>;

    /// Queues the copy of `host()[..dst.len()]` to `device[dst]` and returns without waiting.
    fn queue_upload(&mut self, device: &mut Self::Device, dst: Range<usize>) -> Result<()>;

    /// Queues the copy of `device[src]` to `host()[..src.len()]` and returns without waiting.
    fn queue_download(&mut self, device: &Self::Device, src: Range<usize>) -> Result<()>;
}

/// `range` cut into consecutive pieces of at most `piece` elements.
pub(crate) fn pieces(range: Range<usize>, piece: usize) -> impl Iterator<Item = Range<usize>> {
    let piece = piece.max(1);
    range
        .clone()
        .step_by(piece)
        .map(move |start| start..range.end.min(start + piece))
}

/// A ring of staging slots and the position of the next one to use.
pub(crate) struct StagingRing<S> {
    slots: Vec<S>,
    next: usize,
    piece: usize,
}

impl<S: StagingSlot> StagingRing<S> {
    /// A ring over `slots` (at least one), each holding at least `piece` elements.
    pub fn new(slots: Vec<S>, piece: usize) -> StagingRing<S> {
        assert!(!slots.is_empty(), "a staging ring needs a slot");
        StagingRing {
            slots,
            next: 0,
            piece: piece.max(1),
        }
    }

    /// Lets `fill(offset, buf)` write `device[range]` piece by piece (`offset` relative to
    /// `range.start`) and queues each piece's copy; see the module docs. The copies may still
    /// be running when this returns.
    pub fn upload(
        &mut self,
        device: &mut S::Device,
        range: Range<usize>,
        fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        for piece in pieces(range.clone(), self.piece) {
            let slot_index = self.next;
            self.next = (self.next + 1) % self.slots.len();
            let slot = &mut self.slots[slot_index];
            slot.wait()?;
            fill(piece.start - range.start, &mut slot.host()?[..piece.len()])?;
            slot.queue_upload(device, piece)?;
        }
        Ok(())
    }

    /// Calls `sink` with `device[range]`, piece by piece in order; see the module docs.
    pub fn download(
        &mut self,
        device: &S::Device,
        range: Range<usize>,
        sink: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        let pieces: Vec<Range<usize>> = pieces(range, self.piece).collect();
        let ring = self.slots.len();
        let slot_of = |i: usize| (self.next + i) % ring;
        for (i, piece) in pieces.iter().enumerate().take(ring) {
            let slot = &mut self.slots[slot_of(i)];
            slot.wait()?;
            slot.queue_download(device, piece.clone())?;
        }
        for (i, piece) in pieces.iter().enumerate() {
            let slot = &mut self.slots[slot_of(i)];
            slot.wait()?;
            sink(&slot.host()?[..piece.len()])?;
            if let Some(ahead) = pieces.get(i + ring) {
                slot.queue_download(device, ahead.clone())?;
            }
        }
        self.next = slot_of(pieces.len());
        Ok(())
    }

    /// Waits for every queued copy; the first failure is returned.
    pub fn finish(&mut self) -> Result<()> {
        self.slots.iter_mut().try_for_each(StagingSlot::wait)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use super::*;
    use crate::error::EngineError;

    /// What happened, in order: `Fill(piece start)`, `Queue(slot, piece start)`,
    /// `Done(slot, piece start)` (a copy took effect), `Sink(piece start)`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Event {
        Fill(usize),
        Queue(usize, usize),
        Done(usize, usize),
        Sink(usize),
    }

    type Log = Rc<RefCell<Vec<Event>>>;

    enum Copy {
        Up(Rc<RefCell<Vec<f32>>>, Range<usize>),
        Down(Vec<f32>, Range<usize>),
    }

    /// A simulated device buffer.
    struct Device(Rc<RefCell<Vec<f32>>>);

    /// A slot whose queued copy takes effect only when waited for (an upload reads the host
    /// buffer then, a download writes it then), as an asynchronous DMA may.
    struct Slot {
        id: usize,
        host: Vec<f32>,
        pending: Option<Copy>,
        log: Log,
    }

    impl StagingSlot for Slot {
        type Device = Device;

        fn wait(&mut self) -> Result<()> {
            match self.pending.take() {
                Some(Copy::Up(device, dst)) => {
                    device.borrow_mut()[dst.clone()].copy_from_slice(&self.host[..dst.len()]);
                    self.log.borrow_mut().push(Event::Done(self.id, dst.start));
                }
                Some(Copy::Down(values, src)) => {
                    self.host[..src.len()].copy_from_slice(&values);
                    self.log.borrow_mut().push(Event::Done(self.id, src.start));
                }
                None => {}
            }
            Ok(())
        }

        fn host(&mut self) -> Result<&mut [f32]> {
            assert!(
                self.pending.is_none(),
                "slot {} used during its copy",
                self.id
            );
            Ok(&mut self.host)
        }

        fn queue_upload(&mut self, device: &mut Device, dst: Range<usize>) -> Result<()> {
            assert!(self.pending.is_none(), "slot {} queued twice", self.id);
            self.log.borrow_mut().push(Event::Queue(self.id, dst.start));
            self.pending = Some(Copy::Up(device.0.clone(), dst));
            Ok(())
        }

        fn queue_download(&mut self, device: &Device, src: Range<usize>) -> Result<()> {
            assert!(self.pending.is_none(), "slot {} queued twice", self.id);
            self.log.borrow_mut().push(Event::Queue(self.id, src.start));
            // The values the copy will deliver: the device's at queue time (nothing writes the
            // device during a download).
            let values = device.0.borrow()[src.clone()].to_vec();
            self.pending = Some(Copy::Down(values, src));
            Ok(())
        }
    }

    fn ring(slots: usize, piece: usize) -> (StagingRing<Slot>, Log) {
        let log: Log = Rc::default();
        let slots = (0..slots)
            .map(|id| Slot {
                id,
                host: vec![f32::NAN; piece],
                pending: None,
                log: log.clone(),
            })
            .collect();
        (StagingRing::new(slots, piece), log)
    }

    fn position(log: &[Event], event: Event) -> usize {
        log.iter()
            .position(|&e| e == event)
            .unwrap_or_else(|| panic!("{event:?} missing from {log:?}"))
    }

    #[test]
    fn pieces_cover_the_range_in_order() {
        let cut: Vec<_> = pieces(3..13, 4).collect();
        assert_eq!(cut, [3..7, 7..11, 11..13]);
        assert_eq!(pieces(5..5, 4).count(), 0);
        assert_eq!(pieces(0..8, 4).collect::<Vec<_>>(), [0..4, 4..8]);
    }

    #[test]
    fn uploads_land_whole_and_overlap_the_next_fill() {
        let (mut ring, log) = ring(2, 4);
        let mut device = Device(Rc::new(RefCell::new(vec![0.0; 23])));
        // Two writes, as a loader writes one tensor after another: the ring's rotation (and
        // the copies in flight) carry over from one call to the next.
        for range in [0..10, 10..23] {
            let base = range.start;
            let log2 = log.clone();
            ring.upload(&mut device, range, &mut |offset, buf| {
                log2.borrow_mut().push(Event::Fill(base + offset));
                for (k, x) in buf.iter_mut().enumerate() {
                    *x = (base + offset + k) as f32;
                }
                Ok(())
            })
            .unwrap();
        }
        ring.finish().unwrap();
        let want: Vec<f32> = (0..23).map(|i| i as f32).collect();
        assert_eq!(*device.0.borrow(), want);
        let log = log.borrow();
        // Piece 0..4 (slot 0) is still being copied while 4..8 is filled; its slot is waited
        // for only when 8..10 needs it.
        assert!(position(&log, Event::Fill(4)) < position(&log, Event::Done(0, 0)));
        assert!(position(&log, Event::Done(0, 0)) < position(&log, Event::Fill(8)));
        // Never more than two copies in flight.
        let mut in_flight = 0i32;
        for e in log.iter() {
            match e {
                Event::Queue(..) => in_flight += 1,
                Event::Done(..) => in_flight -= 1,
                _ => {}
            }
            assert!((0..=2).contains(&in_flight), "{log:?}");
        }
        assert_eq!(in_flight, 0, "finish waited for every copy");
    }

    #[test]
    fn downloads_queue_the_next_copy_before_the_sink_runs() {
        let (mut ring, log) = ring(2, 3);
        let values: Vec<f32> = (0..20).map(|i| i as f32 * 1.5).collect();
        let device = Device(Rc::new(RefCell::new(values.clone())));
        let mut got = Vec::new();
        for range in [0..11, 11..12, 12..20] {
            let log2 = log.clone();
            let mut next = range.start;
            ring.download(&device, range, &mut |piece| {
                log2.borrow_mut().push(Event::Sink(next));
                next += piece.len();
                got.extend_from_slice(piece);
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(got, values);
        let log = log.borrow();
        // The copy of 3..6 is queued before 0..3 is handed to the sink, and the copy of 6..9
        // reuses slot 0 only after the sink took 0..3.
        assert!(position(&log, Event::Queue(1, 3)) < position(&log, Event::Sink(0)));
        assert!(position(&log, Event::Sink(0)) < position(&log, Event::Queue(0, 6)));
    }

    #[test]
    fn a_failing_fill_stops_the_upload_and_finish_drains_the_copies() {
        let (mut ring, _log) = ring(2, 2);
        let mut device = Device(Rc::new(RefCell::new(vec![0.0; 8])));
        let e = ring
            .upload(&mut device, 0..8, &mut |offset, buf| {
                if offset == 4 {
                    return Err(EngineError::InvalidArgument {
                        argument: "fill".into(),
                        message: "refused".into(),
                    });
                }
                buf.fill(1.0);
                Ok(())
            })
            .unwrap_err();
        assert!(e.to_string().contains("refused"), "{e}");
        ring.finish().unwrap();
        assert!(ring.slots.iter().all(|s| s.pending.is_none()));
        assert_eq!(*device.0.borrow(), [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    }
}
