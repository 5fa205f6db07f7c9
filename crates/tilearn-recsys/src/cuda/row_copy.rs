//! The safe wrappers of `row_copy.cu`: a row cache's moves between tables in page-locked host
//! memory mapped into the device's address space ([`MappedHost`]) and the device cache, every
//! row of a list in one launch.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, PinnedHostSlice, sys};
use tilearn_kernels::ffi;
use tilearn_ops::OpsError;
use tilearn_ops::cuda::launch::Launch;

use crate::error::{RecsysError, Result};

fn driver(context: &'static str) -> impl Fn(cudarc::driver::DriverError) -> RecsysError {
    move |e| {
        RecsysError::Ops(OpsError::Cuda {
            context,
            message: e.to_string(),
        })
    }
}

/// A page-locked (pinned) host buffer of f32, mapped into the device's address space
/// (`cuMemHostAlloc` with `DEVICEMAP`; not managed memory): kernels read and write it over the
/// bus at `device_ptr`, the host through [`as_slice`](Self::as_slice) once the stream is idle.
#[derive(Debug)]
pub struct MappedHost {
    host: PinnedHostSlice<f32>,
    device_ptr: u64,
}

impl MappedHost {
    /// A pinned, mapped copy of `values` (at least one element: the driver refuses empty
    /// allocations).
    pub fn new(stream: &Arc<CudaStream>, values: &[f32]) -> Result<Self> {
        let err = driver("MappedHost::new");
        let context = stream.context();
        let len = values.len().max(1);
        // SAFETY: the memory is written in full below before anything reads it.
        let mut host = unsafe {
            context.alloc_pinned_with_flags::<f32>(
                len,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .map_err(&err)?;
        let slice = host.as_mut_slice().map_err(&err)?;
        slice[..values.len()].copy_from_slice(values);
        slice[values.len()..].fill(0.0);
        let mut device_ptr: sys::CUdeviceptr = 0;
        context.bind_to_thread().map_err(&err)?;
        let ptr = host.as_mut_ptr().map_err(&err)? as *mut c_void;
        // SAFETY: `ptr` is a live allocation of cuMemHostAlloc with DEVICEMAP in this context,
        // current on this thread; the call only writes the device address into `device_ptr`.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, ptr, 0) }
            .result()
            .map_err(&err)?;
        Ok(MappedHost { host, device_ptr })
    }

    pub fn len(&self) -> usize {
        self.host.len()
    }

    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The host values. Kernels write this memory behind cudarc's back: synchronise the stream
    /// that ran them first.
    pub fn as_slice(&self) -> Result<&[f32]> {
        self.host.as_slice().map_err(driver("MappedHost::as_slice"))
    }

    /// The host values, mutable (the same rule as [`as_slice`](Self::as_slice)).
    pub fn as_mut_slice(&mut self) -> Result<&mut [f32]> {
        self.host
            .as_mut_slice()
            .map_err(driver("MappedHost::as_mut_slice"))
    }
}

/// `[src, dst, len]` element offsets per copy, on the device.
pub type DeviceCopies<'a> = CudaView<'a, u64>;

/// Device → host: for each copy, `host[dst..dst + len] = src[src..src + len]`.
///
/// The copies come from a row cache's planner, which keeps every one inside both buffers and
/// never writes one element twice; `n` is their number (`copies` holds `3 n` words).
pub fn copy_rows_to_host(
    stream: &Arc<CudaStream>,
    src: &CudaSlice<f32>,
    host: &mut MappedHost,
    copies: &DeviceCopies<'_>,
    n: usize,
) -> Result<()> {
    let dst = host.device_ptr;
    Launch::new("tilearn_copy_rows", stream)
        .input("src", src, src.len())
        .input("copies", copies, 3 * n)
        .skip_launch_if(n == 0)
        .run(|[src, copies], [], stream| {
            // SAFETY: reads 3 n words of copies and, per copy, len f32 of src and writes len f32
            // of the mapped host buffer at dst (in bounds of both and disjoint: the planner's
            // guarantee above); the host buffer outlives the launch (`host` is borrowed and
            // the caller synchronises before reading or freeing it).
            unsafe { ffi::tilearn_copy_rows(src.cast(), dst as *mut f32, copies.cast(), n, stream) }
        })?;
    Ok(())
}

/// Host → device: for each copy, `dst[dst..dst + len] = host[src..src + len]` (the same
/// guarantees as [`copy_rows_to_host`]).
pub fn copy_rows_to_device(
    stream: &Arc<CudaStream>,
    host: &MappedHost,
    dst: &mut CudaSlice<f32>,
    copies: &DeviceCopies<'_>,
    n: usize,
) -> Result<()> {
    let src = host.device_ptr;
    let len = dst.len();
    Launch::new("tilearn_copy_rows", stream)
        .input("copies", copies, 3 * n)
        .output("dst", dst, len)
        .skip_launch_if(n == 0)
        .run(|[copies], [dst], stream| {
            // SAFETY: reads 3 n words of copies and, per copy, len f32 of the mapped host buffer
            // at src, writing len f32 of dst (in bounds and disjoint: the planner's guarantee).
            unsafe {
                ffi::tilearn_copy_rows(src as *const f32, dst.cast(), copies.cast(), n, stream)
            }
        })?;
    Ok(())
}

/// Device → device: for each copy, `dst[dst..dst + len] = src[src..src + len]`; a sharded
/// model's pooled-row placements (`shard::columns`), which keep every copy inside both buffers
/// and never write one element twice.
pub fn copy_on_device(
    stream: &Arc<CudaStream>,
    src: &CudaView<'_, f32>,
    dst: &mut CudaViewMut<'_, f32>,
    copies: &DeviceCopies<'_>,
    n: usize,
) -> Result<()> {
    let (src_len, dst_len) = (src.len(), dst.len());
    Launch::new("tilearn_copy_rows", stream)
        .input("src", src, src_len)
        .input("copies", copies, 3 * n)
        .output("dst", dst, dst_len)
        .skip_launch_if(n == 0)
        .run(|[src, copies], [dst], stream| {
            // SAFETY: reads 3 n words of copies and, per copy, len f32 of src, writing len f32
            // of dst (in bounds of both and disjoint: the placements' guarantee above).
            unsafe { ffi::tilearn_copy_rows(src.cast(), dst.cast(), copies.cast(), n, stream) }
        })?;
    Ok(())
}

/// Uploads `words` to the start of `buffer`, growing it when needed.
pub fn upload_words(
    stream: &Arc<CudaStream>,
    buffer: &mut CudaSlice<u64>,
    words: &[u64],
) -> Result<()> {
    let err = driver("row cache copies");
    if buffer.len() < words.len() {
        *buffer = stream.alloc_zeros::<u64>(words.len()).map_err(&err)?;
    }
    if !words.is_empty() {
        stream
            .memcpy_htod(words, &mut buffer.slice_mut(..words.len()))
            .map_err(&err)?;
    }
    Ok(())
}
