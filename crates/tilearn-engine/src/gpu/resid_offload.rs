//! Checkpoint offload (`--offload-checkpoints`, with gradient checkpointing): the layer inputs
//! that checkpointing keeps for the backward (`[N, C]` a layer: 1.4 GiB at TinyLlama 16 K,
//! 11 GiB at 128 K) live in page-locked host memory; the device keeps a ring of
//! [`RESID_SLOTS`] slabs.
//!
//! Schedule (boundary `j` is the input of layer `j`; it lives in slab `j % 3`):
//! * forward: after the block that wrote boundary `j`, a second stream copies it to the
//!   host (after an event recorded on the compute stream). Before block `i` writes boundary
//!   `i + 1` into the slab of boundary `i - 2`, the compute stream waits for that boundary's
//!   copy, long finished by then (two blocks ran since it was queued);
//! * backward, layer `i`: the copy stream brings boundary `i - 1` back into its slab, which
//!   last held boundary `i + 2` (read by layer `i + 1`'s backward, already queued: the copy
//!   waits for an event recorded before layer `i`'s kernels), so it overlaps layer `i`'s
//!   recomputation and backward; the compute stream waits for boundary `i`'s copy before
//!   layer `i`. The last three boundaries are still in their slabs after the forward.
//! * attention outputs: where every attention call is a flash kernel, each layer's output
//!   `[N, Hq·D]` and f32 log-sum-exp are kept too, in a two-slot ring (the layer set's and one
//!   spare, swapped by view), saved after the layer's forward and brought back one layer
//!   ahead, so the backward's recomputation skips the attention forward (the flash backward
//!   needs only q, k, v, the output and the log-sum-exp). This is the costliest part of a
//!   long-context recomputation (≈ 2.6 ms of ≈ 8 ms a layer at 16 K). Its host room is
//!   optional: when the driver refuses it, the recomputation runs the attention forward.
//!
//! The copies go through the driver directly with the arena's device pointers, so cudarc's
//! per-allocation event tracking (one pair of events for the whole arena) does not make
//! every later kernel wait for a copy; the events here order exactly what must be ordered.
//! The values round-trip unchanged (bytes copied), so a step is the same bits as without.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut};
use cudarc::driver::{DeviceRepr, result};

use super::arena::{ArenaPlan, Dims};
use super::{GpuLlama, cuda_err, invalid};
use crate::cuda_graphs::CudaGraphs;
use crate::error::Result;

/// Device slabs of the residual stream under offload: the boundary a layer reads, the one
/// its recomputation writes, and the one being brought back for the next layer down.
pub(crate) const RESID_SLOTS: usize = crate::offload_checkpoints::DEVICE_RING_SLOTS;

/// Page-locked host memory from the driver, freed on drop.
#[derive(Debug)]
struct HostBuf {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the buffer is plain memory owned by this struct; every access goes through
// `ResidOffload`'s methods, which take `&mut self`.
unsafe impl Send for HostBuf {}
unsafe impl Sync for HostBuf {}

impl HostBuf {
    fn new(bytes: usize) -> std::result::Result<HostBuf, cudarc::driver::DriverError> {
        // SAFETY: a plain page-locked allocation, freed by `drop`.
        let ptr = unsafe { result::malloc_host(bytes.max(1), 0) }?;
        Ok(HostBuf {
            ptr: ptr.cast(),
            bytes: bytes.max(1),
        })
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host`; the owner synchronised the copy stream before
        // dropping (no copy still reads or writes it).
        unsafe {
            let _ = result::free_host(self.ptr.cast());
        }
    }
}

/// What a host region holds: layer boundary `j` (the input of layer `j`), or layer `j`'s
/// attention output `[N, Hq·D]` and its f32 log-sum-exp `[B, Hq, T]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Boundary(usize),
    Attention(usize),
    Lse(usize),
}

/// Host room for one kind of part: `count` regions of `stride` bytes.
#[derive(Debug)]
struct Regions {
    buf: HostBuf,
    stride: usize,
    count: usize,
    /// Per region: its device-to-host copy (`saved`) and host-to-device copy (`loaded`).
    saved: Vec<Option<CudaEvent>>,
    loaded: Vec<Option<CudaEvent>>,
}

impl Regions {
    fn new(
        count: usize,
        stride: usize,
    ) -> std::result::Result<Regions, cudarc::driver::DriverError> {
        Ok(Regions {
            buf: HostBuf::new(count * stride)?,
            stride,
            count,
            saved: (0..count).map(|_| None).collect(),
            loaded: (0..count).map(|_| None).collect(),
        })
    }
}

/// The host copies of the layer boundaries (and, room permitting, of each layer's attention
/// output), the copy stream and the events ordering it against the compute stream.
#[derive(Debug)]
pub(crate) struct ResidOffload {
    copy: Arc<CudaStream>,
    boundaries: Regions,
    /// Attention outputs and log-sum-exps per layer; `None` when page-locked memory for them
    /// was refused (the backward then recomputes the attention forward).
    attention: Option<(Regions, Regions)>,
}

/// Device bytes of one layer part at capacity.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PartBytes {
    pub boundary: usize,
    pub attention: usize,
    pub lse: usize,
}

impl ResidOffload {
    /// Host room for `layers + 1` boundaries and, if the driver grants it, `layers` attention
    /// outputs and log-sum-exps, of `bytes` each.
    pub(crate) fn new(ctx: &Arc<CudaContext>, layers: usize, bytes: PartBytes) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("binding the device context", e))?;
        let boundaries = Regions::new(layers + 1, bytes.boundary).map_err(|e| {
            let gib = ((layers + 1) * bytes.boundary) as f64 / (1u64 << 30) as f64;
            cuda_err(
                &format!(
                    "allocating {gib:.1} GiB of page-locked host memory for the checkpoints \
                     (--offload-checkpoints; shorten --seq-len or the batch, or drop the flag)"
                ),
                e,
            )
        })?;
        // Optional: at the longest contexts host memory may not hold these too.
        let attention = match (
            Regions::new(layers, bytes.attention),
            Regions::new(layers, bytes.lse),
        ) {
            (Ok(a), Ok(l)) => Some((a, l)),
            _ => None,
        };
        let copy = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating the checkpoint copy stream", e))?;
        Ok(ResidOffload {
            copy,
            boundaries,
            attention,
        })
    }

    /// Host bytes held.
    pub(crate) fn host_bytes(&self) -> usize {
        self.boundaries.buf.bytes
            + self
                .attention
                .as_ref()
                .map_or(0, |(a, l)| a.buf.bytes + l.buf.bytes)
    }

    /// Whether the attention outputs are kept (the backward's recomputation then skips the
    /// attention forward).
    pub(crate) fn keeps_attention(&self) -> bool {
        self.attention.is_some()
    }

    fn regions(&mut self, part: Part) -> Result<(&mut Regions, usize)> {
        let (regions, j) = match (part, self.attention.as_mut()) {
            (Part::Boundary(j), _) => (&mut self.boundaries, j),
            (Part::Attention(j), Some((a, _))) => (a, j),
            (Part::Lse(j), Some((_, l))) => (l, j),
            (_, None) => {
                return Err(super::views::arena_error(format!(
                    "{part:?}: no host room for attention outputs"
                )));
            }
        };
        if j >= regions.count {
            return Err(super::views::arena_error(format!(
                "{part:?} lies past the {} host regions",
                regions.count
            )));
        }
        Ok((regions, j))
    }

    /// `part`'s host region as `len` elements of `T`.
    fn host_slice<T>(&mut self, part: Part, len: usize) -> Result<&mut [T]> {
        let (r, j) = self.regions(part)?;
        let bytes = len * size_of::<T>();
        if bytes > r.stride {
            return Err(super::views::arena_error(format!(
                "{part:?} of {bytes} bytes does not fit its host room of {}",
                r.stride
            )));
        }
        // SAFETY: in bounds (checked); the stride is a multiple of the element size and the
        // allocation page aligned, so the region is aligned for `T`; `&mut self` makes this
        // the only reference, and the copies using it are ordered by the events.
        Ok(unsafe { std::slice::from_raw_parts_mut(r.buf.ptr.add(j * r.stride).cast(), len) })
    }

    fn event(stream: &CudaStream) -> Result<CudaEvent> {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| cuda_err("recording a checkpoint copy event", e))
    }

    /// Queues the copy of `part` (in `view`, just written on `compute`) to the host.
    pub(crate) fn save<T: DeviceRepr>(
        &mut self,
        compute: &CudaStream,
        part: Part,
        view: &CudaViewMut<'_, T>,
    ) -> Result<()> {
        let written = Self::event(compute)?;
        self.copy
            .wait(&written)
            .map_err(|e| cuda_err("ordering a checkpoint copy", e))?;
        // The pointer is taken on the compute stream (cudarc records its read there, where
        // it is already ordered); the copy's order is the event above.
        let (src, _read) = view.device_ptr(compute);
        let len = view.len();
        let cu_stream = self.copy.cu_stream();
        let dst = self.host_slice::<T>(part, len)?;
        // SAFETY: `dst` is page-locked host memory of `len` elements that nothing else
        // touches until the saved event completes; `src` is a live buffer of `len` elements.
        unsafe { result::memcpy_dtoh_async(dst, src, cu_stream) }
            .map_err(|e| cuda_err("copying a checkpoint to host memory", e))?;
        let done = Self::event(&self.copy)?;
        let (r, j) = self.regions(part)?;
        r.saved[j] = Some(done);
        Ok(())
    }

    /// Makes `compute` wait until `part`'s copy to the host has finished (before its device
    /// buffer is overwritten).
    pub(crate) fn wait_saved(&mut self, compute: &CudaStream, part: Part) -> Result<()> {
        let (r, j) = self.regions(part)?;
        if let Some(e) = r.saved[j].take() {
            compute
                .wait(&e)
                .map_err(|e| cuda_err("waiting for a checkpoint copy", e))?;
        }
        Ok(())
    }

    /// Queues the copy of `part` from the host into `view` once everything queued so far on
    /// `compute` has run (the buffer's last readers).
    pub(crate) fn load<T: DeviceRepr>(
        &mut self,
        compute: &CudaStream,
        part: Part,
        view: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let free = Self::event(compute)?;
        self.copy
            .wait(&free)
            .map_err(|e| cuda_err("ordering a checkpoint copy", e))?;
        let len = view.len();
        let cu_stream = self.copy.cu_stream();
        let (dst, _write) = view.device_ptr_mut(compute);
        let src = self.host_slice::<T>(part, len)?;
        // SAFETY: `src` holds `part` (its save was queued earlier on this same stream, so it
        // completed first); `dst` is a live buffer of `len` elements that no kernel uses
        // until the compute stream waits for the loaded event.
        unsafe { result::memcpy_htod_async(dst, src, cu_stream) }
            .map_err(|e| cuda_err("copying a checkpoint back to the device", e))?;
        let done = Self::event(&self.copy)?;
        let (r, j) = self.regions(part)?;
        r.loaded[j] = Some(done);
        Ok(())
    }

    /// Makes `compute` wait for `part`'s copy back (if one was queued).
    pub(crate) fn wait_loaded(&mut self, compute: &CudaStream, part: Part) -> Result<()> {
        let (r, j) = self.regions(part)?;
        if let Some(e) = r.loaded[j].take() {
            compute
                .wait(&e)
                .map_err(|e| cuda_err("waiting for a checkpoint copy", e))?;
        }
        Ok(())
    }
}

impl Drop for ResidOffload {
    fn drop(&mut self) {
        // No copy may outlive the host buffer; an error here already surfaced at a step.
        let _ = self.copy.synchronize();
    }
}

impl GpuLlama {
    /// Keeps gradient checkpointing's layer inputs in page-locked host memory (`true`; see
    /// the module docs) or on the device (`false`, as built). Set-up work: reallocates the
    /// activation arena (its residual stream shrinks to a ring of [`RESID_SLOTS`] slabs),
    /// takes `(layers + 1) × batch × seq × hidden` elements of page-locked host memory, and
    /// turns CUDA graphs off (the copies run on a second stream; steps are long enough at the
    /// contexts this is for that a graph gains nothing). Refused without checkpointing.
    pub fn set_offload_checkpoints(&mut self, offload: bool) -> Result<()> {
        if offload == self.resid_offload.is_some() {
            return Ok(());
        }
        if offload && !self.gradient_checkpointing {
            return Err(invalid(
                "--offload-checkpoints",
                "offloads the layer inputs gradient checkpointing keeps; add \
                 --gradient-checkpointing"
                    .into(),
            ));
        }
        let layers = Dims::new(&self.config, self.batch, self.seq).layers;
        let plan = ArenaPlan {
            resid_slots: offload.then_some(RESID_SLOTS),
            ..self.arena.plan()
        };
        if offload {
            // The host room first: a refusal leaves the model as it was.
            let ring = ResidOffload::new(self.device.ctx(), layers, self.offload_part_bytes())?;
            self.rebuild_arena(plan)?;
            self.graphs.mode = CudaGraphs::Off;
            self.resid_offload = Some(ring);
        } else {
            // The old ring's copies must not outlive their buffers.
            self.resid_offload = None;
            self.rebuild_arena(plan)?;
        }
        Ok(())
    }

    /// Whether checkpointed layer inputs live in host memory (see
    /// [`GpuLlama::set_offload_checkpoints`]).
    pub fn offload_checkpoints(&self) -> bool {
        self.resid_offload.is_some()
    }

    /// One layer part's bytes at the build's capacity, in the widest element type.
    fn offload_part_bytes(&self) -> PartBytes {
        let cap = Dims::new(&self.config, self.batch, self.seq);
        let widest = self.widest_elem_bytes();
        PartBytes {
            boundary: cap.n * cap.c * widest,
            attention: cap.n * cap.q * widest,
            lse: cap.n * cap.q_heads * size_of::<f32>(),
        }
    }

    /// Page-locked host bytes [`GpuLlama::set_offload_checkpoints`] would take (the layer
    /// boundaries and every layer's attention output and log-sum-exp), for deciding before
    /// asking the driver.
    pub fn checkpoint_offload_host_bytes(&self) -> usize {
        let layers = Dims::new(&self.config, self.batch, self.seq).layers;
        let b = self.offload_part_bytes();
        (layers + 1) * b.boundary + layers * (b.attention + b.lse)
    }

    /// Page-locked host bytes the checkpoint offload holds (0 when off).
    pub fn offloaded_checkpoint_bytes(&self) -> usize {
        self.resid_offload
            .as_ref()
            .map_or(0, ResidOffload::host_bytes)
    }
}

/// Which boundary the backward of layer `i` brings back (the one layer `i - 1` reads), when
/// the forward's ring no longer holds it: boundaries `L - 2 ..= L` are still in their slabs.
pub(crate) fn boundary_to_load(i: usize, layers: usize) -> Option<usize> {
    let j = i.checked_sub(1)?;
    (j + RESID_SLOTS <= layers).then_some(j)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Simulates the ring over a whole step and checks every read finds its boundary.
    fn simulate(layers: usize) {
        let slots = RESID_SLOTS.min(layers + 1);
        let mut slab: Vec<Option<usize>> = vec![None; slots];
        let mut host = vec![false; layers + 1];
        // Forward: embedding writes boundary 0, block i reads i and writes i + 1.
        slab[0] = Some(0);
        host[0] = true;
        for i in 0..layers {
            assert_eq!(slab[i % slots], Some(i), "forward block {i} input");
            slab[(i + 1) % slots] = Some(i + 1);
            host[i + 1] = true;
        }
        // Backward: the final norm reads L; layer i recomputes from i, rewrites i + 1.
        assert_eq!(slab[layers % slots], Some(layers));
        let mut pending: Option<usize> = None;
        for i in (0..layers).rev() {
            if let Some(j) = pending.take() {
                assert_eq!(
                    j,
                    i,
                    "the load queued during layer {} is layer {i}'s input",
                    i + 1
                );
            }
            if let Some(j) = boundary_to_load(i, layers) {
                let target = j % slots;
                // The target slab holds neither what layer i reads nor what it writes.
                assert_ne!(target, i % slots);
                assert_ne!(target, (i + 1) % slots);
                assert!(host[j]);
                slab[target] = Some(j);
                pending = Some(j);
            }
            assert_eq!(slab[i % slots], Some(i), "backward layer {i} input");
            slab[(i + 1) % slots] = Some(i + 1);
        }
    }

    /// The attention ring: layer i's output in slot i % 2, saved when `i + 3 <= layers`,
    /// brought back one layer ahead by `boundary_to_load`.
    fn simulate_attention(layers: usize) {
        let mut slot: [Option<usize>; 2] = [None, None];
        for i in 0..layers {
            slot[i % 2] = Some(i);
        }
        for i in (0..layers).rev() {
            // The spare (the other slot) receives layer i - 1's; it held layer i + 1's, whose
            // backward is done.
            if let Some(j) = boundary_to_load(i, layers) {
                assert_eq!(j % 2, (i + 1) % 2);
                assert!(j + RESID_SLOTS <= layers, "layer {j} was saved");
                slot[j % 2] = Some(j);
            }
            assert_eq!(slot[i % 2], Some(i), "backward layer {i} attention");
        }
    }

    #[test]
    fn every_layer_finds_its_input_in_the_ring_for_any_depth() {
        for layers in 1..=9 {
            simulate_attention(layers);
        }
        for layers in 1..=9 {
            simulate(layers);
        }
        simulate(22);
    }

    #[test]
    fn the_last_three_boundaries_are_never_loaded() {
        assert_eq!(boundary_to_load(0, 22), None);
        assert_eq!(boundary_to_load(21, 22), None);
        assert_eq!(boundary_to_load(20, 22), Some(19));
        assert_eq!(boundary_to_load(1, 22), Some(0));
        assert_eq!(boundary_to_load(2, 2), None);
    }
}
