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
//!
//! The copies go through the driver directly with the arena's device pointers, so cudarc's
//! per-allocation event tracking (one pair of events for the whole arena) does not make
//! every later kernel wait for a copy; the events here order exactly what must be ordered.
//! The values round-trip unchanged (bytes copied), so a step is the same bits as without.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut};
use cudarc::driver::{DeviceRepr, result};

use super::arena::{Arena, Dims};
use super::{GpuLlama, cuda_err, invalid};
use crate::cuda_graphs::CudaGraphs;
use crate::error::Result;

/// Device slabs of the residual stream under offload: the boundary a layer reads, the one
/// its recomputation writes, and the one being brought back for the next layer down.
pub(crate) const RESID_SLOTS: usize = 3;

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

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host` in `ResidOffload::new`; the owner synchronised
        // the copy stream before dropping (no copy still reads or writes it).
        unsafe {
            let _ = result::free_host(self.ptr.cast());
        }
    }
}

/// The host copies of the layer boundaries, the copy stream and the events ordering it
/// against the compute stream.
#[derive(Debug)]
pub(crate) struct ResidOffload {
    copy: Arc<CudaStream>,
    host: HostBuf,
    /// Bytes reserved per boundary (capacity rows × hidden × widest element).
    stride: usize,
    boundaries: usize,
    /// Per boundary: its device-to-host copy (`saved`) and host-to-device copy (`loaded`).
    saved: Vec<Option<CudaEvent>>,
    loaded: Vec<Option<CudaEvent>>,
}

impl ResidOffload {
    /// Host room for `layers + 1` boundaries of `slab_bytes` each.
    pub(crate) fn new(ctx: &Arc<CudaContext>, layers: usize, slab_bytes: usize) -> Result<Self> {
        let boundaries = layers + 1;
        let bytes = boundaries * slab_bytes;
        ctx.bind_to_thread()
            .map_err(|e| cuda_err("binding the device context", e))?;
        // SAFETY: a plain page-locked allocation, freed by `HostBuf::drop`.
        let ptr = unsafe { result::malloc_host(bytes.max(1), 0) }
            .map_err(|e| cuda_err("allocating page-locked memory for the checkpoints", e))?;
        let copy = ctx
            .new_stream()
            .map_err(|e| cuda_err("creating the checkpoint copy stream", e))?;
        Ok(ResidOffload {
            copy,
            host: HostBuf {
                ptr: ptr.cast(),
                bytes: bytes.max(1),
            },
            stride: slab_bytes,
            boundaries,
            saved: (0..boundaries).map(|_| None).collect(),
            loaded: (0..boundaries).map(|_| None).collect(),
        })
    }

    /// Host bytes held.
    pub(crate) fn host_bytes(&self) -> usize {
        self.host.bytes
    }

    /// Boundary `j`'s host region as `len` elements of `T`.
    fn region<T>(&mut self, j: usize, len: usize) -> Result<&mut [T]> {
        let bytes = len * size_of::<T>();
        if j >= self.boundaries || bytes > self.stride {
            return Err(super::views::arena_error(format!(
                "checkpoint {j} of {} bytes does not fit its host room ({} boundaries of {})",
                bytes, self.boundaries, self.stride
            )));
        }
        // SAFETY: in bounds (checked); the stride is a multiple of the slab's element size
        // and the allocation is page aligned, so the region is aligned for `T`; `&mut self`
        // makes this the only reference, and the copies using it are ordered by the events.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.host.ptr.add(j * self.stride).cast(), len)
        })
    }

    fn event(&self, stream: &CudaStream) -> Result<CudaEvent> {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| cuda_err("recording a checkpoint copy event", e))
    }

    /// Queues the copy of boundary `j` (in `slab`, just written on `compute`) to the host.
    pub(crate) fn save<T: DeviceRepr>(
        &mut self,
        compute: &CudaStream,
        j: usize,
        slab: &CudaViewMut<'_, T>,
    ) -> Result<()> {
        let written = self.event(compute)?;
        self.copy
            .wait(&written)
            .map_err(|e| cuda_err("ordering a checkpoint copy", e))?;
        // The pointer is taken on the compute stream (cudarc records its read there, where
        // it is already ordered); the copy's order is the event above.
        let (src, _read) = slab.device_ptr(compute);
        let len = slab.len();
        let cu_stream = self.copy.cu_stream();
        let dst = self.region::<T>(j, len)?;
        // SAFETY: `dst` is page-locked host memory of `len` elements that nothing else
        // touches until `saved[j]` completes; `src` is a live slab of `len` elements.
        unsafe { result::memcpy_dtoh_async(dst, src, cu_stream) }
            .map_err(|e| cuda_err("copying a checkpoint to host memory", e))?;
        self.saved[j] = Some(self.event(&self.copy)?);
        Ok(())
    }

    /// Makes `compute` wait until boundary `j`'s copy to the host has finished (before its
    /// slab is overwritten).
    pub(crate) fn wait_saved(&mut self, compute: &CudaStream, j: usize) -> Result<()> {
        if let Some(e) = self.saved.get_mut(j).and_then(Option::take) {
            compute
                .wait(&e)
                .map_err(|e| cuda_err("waiting for a checkpoint copy", e))?;
        }
        Ok(())
    }

    /// Queues the copy of boundary `j` from the host into `slab` once everything queued so
    /// far on `compute` has run (the slab's last readers).
    pub(crate) fn load<T: DeviceRepr>(
        &mut self,
        compute: &CudaStream,
        j: usize,
        slab: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let free = self.event(compute)?;
        self.copy
            .wait(&free)
            .map_err(|e| cuda_err("ordering a checkpoint copy", e))?;
        let len = slab.len();
        let cu_stream = self.copy.cu_stream();
        let (dst, _write) = slab.device_ptr_mut(compute);
        let src = self.region::<T>(j, len)?;
        // SAFETY: `src` holds boundary `j` (its save was queued earlier on this same stream,
        // so it completed first); `dst` is a live slab of `len` elements that no kernel uses
        // until the compute stream waits for `loaded[j]`.
        unsafe { result::memcpy_htod_async(dst, src, cu_stream) }
            .map_err(|e| cuda_err("copying a checkpoint back to the device", e))?;
        self.loaded[j] = Some(self.event(&self.copy)?);
        Ok(())
    }

    /// Makes `compute` wait for boundary `j`'s copy back (if one was queued).
    pub(crate) fn wait_loaded(&mut self, compute: &CudaStream, j: usize) -> Result<()> {
        if let Some(e) = self.loaded.get_mut(j).and_then(Option::take) {
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
        let stream = self.device.stream().clone();
        let cap = Dims::new(&self.config, self.batch, self.seq);
        let widest = self
            .precisions
            .iter()
            .map(|p| p.size_in_bytes())
            .max()
            .unwrap_or(4);
        let slots = offload.then_some(RESID_SLOTS);
        let before = self.arena.bytes();
        self.graphs.invalidate();
        // The old arena's readers are queued on the stream; its memory returns to the pool in
        // stream order when it is replaced, before the new one is taken.
        self.device.synchronize()?;
        let act = self.arena.act_store();
        self.arena = Arena::new(
            &stream,
            &cap,
            widest,
            (self.gradient_checkpointing, act),
            self.lce_rows,
            slots,
        )?;
        self.resid_offload = if offload {
            self.graphs.mode = CudaGraphs::Off;
            let slab_bytes = cap.n * cap.c * widest;
            Some(ResidOffload::new(
                self.device.ctx(),
                cap.layers,
                slab_bytes,
            )?)
        } else {
            None
        };
        let after = self.arena.bytes();
        for bytes in [
            &mut self.memory.activation_bytes,
            &mut self.memory.own_bytes,
        ] {
            *bytes = (*bytes + after).saturating_sub(before);
        }
        self.device.synchronize()?;
        self.memory.device_used_peak = 0;
        self.sample_memory()
    }

    /// Whether checkpointed layer inputs live in host memory (see
    /// [`GpuLlama::set_offload_checkpoints`]).
    pub fn offload_checkpoints(&self) -> bool {
        self.resid_offload.is_some()
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

    #[test]
    fn every_layer_finds_its_input_in_the_ring_for_any_depth() {
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
