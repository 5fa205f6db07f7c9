//! `NcclCommunicator`: the production backend, one process per GPU. Collectives are enqueued on a
//! communication stream of their own and return work handles (events). The communication stream
//! first waits for the work enqueued so far on the buffer's own stream, and cudarc's event
//! tracking (on buffers that have it) orders later readers after the collective; on untracked
//! buffers the caller orders them with [`Work::wait_on_stream`].

use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tilearn_ops::DType;

use crate::buffer::{Buffer, BufferMut};
use crate::communicator::{Communicator, P2pOp, check_group_ranks, shard_range};
use crate::device::{DeviceSlice, DeviceSliceMut};
use crate::error::{ParallelError, Result};
use crate::nccl::library::{self, CommHandle, UniqueId};
use crate::nccl::work::NcclWork;
use crate::process_group::ProcessGroup;
use crate::reduce::ReduceOp;
use crate::work::Work;

fn cuda(context: &str) -> impl Fn(cudarc::driver::DriverError) -> ParallelError + '_ {
    move |e| ParallelError::Cuda {
        context: context.to_string(),
        message: e.to_string(),
    }
}

fn nccl_dtype(dtype: DType) -> library::DataType {
    match dtype {
        DType::F32 => library::FLOAT32,
        DType::BF16 => library::BFLOAT16,
        DType::F16 => library::FLOAT16,
    }
}

/// The collectives of one group of GPUs.
pub struct NcclCommunicator {
    handle: CommHandle,
    stream: Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    enqueue: Mutex<()>,
    barrier_scratch: Mutex<CudaSlice<f32>>,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCommunicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

impl Drop for NcclCommunicator {
    fn drop(&mut self) {
        // SAFETY: the communicator is live and no call on it is in progress (`&mut self`).
        unsafe {
            (self.handle.nccl.comm_destroy)(self.handle.comm);
        }
    }
}

/// A device pointer with its byte offset applied.
fn offset(ptr: u64, elements: usize, dtype: DType) -> *mut c_void {
    (ptr + (elements * dtype.size_in_bytes()) as u64) as *mut c_void
}

impl NcclCommunicator {
    /// The communicator of all ranks, on the GPU `LOCAL_RANK` among the visible devices.
    pub fn for_local_rank(group: &ProcessGroup) -> Result<NcclCommunicator> {
        // SAFETY: only tries to dlopen the driver library; cudarc panics on use without it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(ParallelError::Cuda {
                context: "opening the GPU numbered LOCAL_RANK".into(),
                message: "no CUDA driver (libcuda.so) found: is the NVIDIA driver installed?"
                    .into(),
            });
        }
        let ctx = CudaContext::new(group.env().local_rank)
            .map_err(cuda("opening the GPU numbered LOCAL_RANK"))?;
        NcclCommunicator::new(group, &ctx)
    }

    /// The communicator of all ranks on `ctx`'s GPU; rank 0's unique id travels through the
    /// store. Collective: every rank calls it.
    pub fn new(group: &ProcessGroup, ctx: &Arc<CudaContext>) -> Result<NcclCommunicator> {
        let nccl = library::nccl()?;
        let key = group.next_communicator_key("nccl");
        let env = group.env();
        let mut id = UniqueId { internal: [0; 128] };
        if env.rank == 0 {
            // SAFETY: writes the 128-byte id through a valid pointer.
            nccl.check("ncclGetUniqueId", unsafe { (nccl.get_unique_id)(&mut id) })?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            group.store().set(&key, &bytes)?;
        } else {
            let bytes = group.store().wait_get(&key, group.options().timeout)?;
            if bytes.len() != id.internal.len() {
                return Err(ParallelError::frame(
                    format!("store key {key}"),
                    format!("NCCL unique id of {} bytes instead of 128", bytes.len()),
                ));
            }
            for (dst, src) in id.internal.iter_mut().zip(bytes) {
                *dst = src as std::ffi::c_char;
            }
        }
        ctx.bind_to_thread().map_err(cuda("binding the GPU"))?;
        let stream = ctx
            .new_stream()
            .map_err(cuda("creating the communication stream"))?;
        let mut comm: library::Comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the new communicator; the id is the one every rank shares.
        nccl.check("ncclCommInitRank", unsafe {
            (nccl.comm_init_rank)(&mut comm, env.world_size as i32, id, env.rank as i32)
        })?;
        Self::with_comm(
            CommHandle { comm, nccl },
            stream,
            env.rank,
            env.world_size,
            group.options().timeout,
        )
    }

    fn with_comm(
        handle: CommHandle,
        stream: Arc<CudaStream>,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<NcclCommunicator> {
        let barrier_scratch = stream
            .alloc_zeros::<f32>(1)
            .map_err(cuda("allocating the barrier's scratch element"))?;
        Ok(NcclCommunicator {
            handle,
            stream,
            rank,
            world_size,
            timeout,
            enqueue: Mutex::new(()),
            barrier_scratch: Mutex::new(barrier_scratch),
        })
    }

    /// The stream collectives run on (to order compute after them, prefer [`Work::wait_on_stream`]).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn device_only(&self, op: &'static str) -> ParallelError {
        ParallelError::Unsupported {
            op,
            backend: "nccl",
            reason: "NCCL works on device buffers; pass a CudaSlice/CudaViewMut, or use the host communicator for host memory".into(),
        }
    }

    /// Enqueues `call(ptr)` for a mutable device buffer on the communication stream and returns
    /// its work handle.
    fn enqueue_mut<'a>(
        &'a self,
        op: &'static str,
        buf: BufferMut<'a>,
        call: impl FnOnce(u64, DType, usize) -> Result<()>,
    ) -> Result<Work<'a>> {
        let BufferMut::Device(mut device) = buf else {
            return Err(self.device_only(op));
        };
        let _serial = self.enqueue.lock().unwrap_or_else(|p| p.into_inner());
        let (dtype, len) = (device.dtype(), device.len());
        self.order_after(device.stream())?;
        {
            // The guard records the buffer's write event on the communication stream when it
            // drops, after the call is enqueued.
            let (ptr, _record) = match &mut device {
                DeviceSliceMut::F32(v) => v.device_ptr_mut(&self.stream),
                DeviceSliceMut::BF16(v) => v.device_ptr_mut(&self.stream),
                DeviceSliceMut::F16(v) => v.device_ptr_mut(&self.stream),
            };
            call(ptr, dtype, len)?;
        }
        self.record(op)
    }

    /// Makes the communication stream wait for everything `owner` (the stream a buffer belongs
    /// to) has enqueued so far. cudarc's event tracking already orders tracked buffers; this
    /// also orders untracked ones, such as the GPU engine's gradients, which are left untracked
    /// so that the backward can keep writing other layers' gradients while NCCL reduces the
    /// finished ones (one allocation shares one pair of events).
    fn order_after(&self, owner: &Arc<CudaStream>) -> Result<()> {
        if Arc::ptr_eq(owner, &self.stream) {
            return Ok(());
        }
        self.stream.join(owner).map_err(cuda(
            "ordering the communication stream after the buffer's stream",
        ))
    }

    fn record<'a>(&'a self, op: &'static str) -> Result<Work<'a>> {
        let event = self
            .stream
            .record_event(None)
            .map_err(cuda("recording the completion event"))?;
        Ok(Work::pending(Box::new(NcclWork {
            event,
            comm: self.handle,
            op,
            timeout: self.timeout,
        })))
    }

    /// The reduction op for `op` and `dtype`, and whether it must be destroyed after the call.
    fn red_op(&self, op: ReduceOp, dtype: DType) -> Result<(library::RedOp, bool)> {
        let nccl = self.handle.nccl;
        Ok(match op {
            ReduceOp::Sum => (library::SUM, false),
            ReduceOp::Avg => (library::AVG, false),
            ReduceOp::Max => (library::MAX, false),
            ReduceOp::Min => (library::MIN, false),
            ReduceOp::ScaledSum(scale) => {
                let mut red: library::RedOp = 0;
                let mut bits: [u8; 4] = match dtype {
                    DType::F32 => scale.to_le_bytes(),
                    DType::BF16 => {
                        let b = half::bf16::from_f32(scale).to_le_bytes();
                        [b[0], b[1], 0, 0]
                    }
                    DType::F16 => {
                        let b = half::f16::from_f32(scale).to_le_bytes();
                        [b[0], b[1], 0, 0]
                    }
                };
                // SAFETY: the scalar of the buffer's dtype is read from host memory during the
                // call (host-immediate residence); `red` receives the new op.
                nccl.check("ncclRedOpCreatePreMulSum", unsafe {
                    (nccl.red_op_create_pre_mul_sum)(
                        &mut red,
                        bits.as_mut_ptr().cast(),
                        nccl_dtype(dtype),
                        library::SCALAR_HOST_IMMEDIATE,
                        self.handle.comm,
                    )
                })?;
                (red, true)
            }
        })
    }

    /// Runs a reducing NCCL call over `(send, recv, count)` with `op` for `dtype`.
    fn reduce_call(
        &self,
        (call, f): (&'static str, library::ReduceFn),
        (send, recv, count): (*const c_void, *mut c_void, usize),
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let nccl = self.handle.nccl;
        let (red, created) = self.red_op(op, dtype)?;
        // SAFETY: `send`/`recv` are device pointers of live buffers covering `count` elements
        // (in place where NCCL documents it), enqueued on our stream.
        let status = unsafe {
            f(
                send,
                recv,
                count,
                nccl_dtype(dtype),
                red,
                self.handle.comm,
                self.stream.cu_stream().cast(),
            )
        };
        if created {
            // SAFETY: NCCL allows destroying an op once the calls using it are enqueued.
            unsafe {
                (nccl.red_op_destroy)(red, self.handle.comm);
            }
        }
        nccl.check(call, status)
    }
}

impl Communicator for NcclCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn all_reduce<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        self.enqueue_mut("all_reduce", buf, |ptr, dtype, len| {
            let p = ptr as *mut c_void;
            let call = ("ncclAllReduce", self.handle.nccl.all_reduce);
            self.reduce_call(call, (p, p, len), dtype, op)
        })
    }

    fn reduce_scatter<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        let (rank, world) = (self.rank, self.world_size);
        shard_range("reduce_scatter", buf.dtype(), buf.len(), world, rank)?;
        self.enqueue_mut("reduce_scatter", buf, |ptr, dtype, len| {
            let shard = len / world;
            // In place as NCCL defines it: recvbuff = sendbuff + rank * recvcount.
            let recv = offset(ptr, rank * shard, dtype);
            let f = self.handle.nccl.reduce_scatter;
            let span = (ptr as *const c_void, recv, shard);
            self.reduce_call(("ncclReduceScatter", f), span, dtype, op)
        })
    }

    fn all_gather<'a>(&'a self, buf: BufferMut<'a>) -> Result<Work<'a>> {
        let (rank, world) = (self.rank, self.world_size);
        shard_range("all_gather", buf.dtype(), buf.len(), world, rank)?;
        self.enqueue_mut("all_gather", buf, |ptr, dtype, len| {
            let shard = len / world;
            let nccl = self.handle.nccl;
            // SAFETY: in place as NCCL defines it: sendbuff = recvbuff + rank * sendcount.
            let status = unsafe {
                (nccl.all_gather)(
                    offset(ptr, rank * shard, dtype),
                    ptr as *mut c_void,
                    shard,
                    nccl_dtype(dtype),
                    self.handle.comm,
                    self.stream.cu_stream().cast(),
                )
            };
            nccl.check("ncclAllGather", status)
        })
    }

    fn broadcast<'a>(&'a self, buf: BufferMut<'a>, root: usize) -> Result<Work<'a>> {
        if root >= self.world_size {
            return Err(ParallelError::InvalidRank {
                op: "broadcast",
                rank: root,
                world_size: self.world_size,
            });
        }
        self.enqueue_mut("broadcast", buf, |ptr, dtype, len| {
            let nccl = self.handle.nccl;
            let p = ptr as *mut c_void;
            // SAFETY: in-place broadcast of `len` elements of a live device buffer.
            let status = unsafe {
                (nccl.broadcast)(
                    p,
                    p,
                    len,
                    nccl_dtype(dtype),
                    root as i32,
                    self.handle.comm,
                    self.stream.cu_stream().cast(),
                )
            };
            nccl.check("ncclBroadcast", status)
        })
    }

    fn reduce<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp, root: usize) -> Result<Work<'a>> {
        if root >= self.world_size {
            return Err(ParallelError::InvalidRank {
                op: "reduce",
                rank: root,
                world_size: self.world_size,
            });
        }
        self.enqueue_mut("reduce", buf, |ptr, dtype, len| {
            let nccl = self.handle.nccl;
            let (red, created) = self.red_op(op, dtype)?;
            let p = ptr as *mut c_void;
            // SAFETY: in-place reduce of `len` elements of a live device buffer, enqueued on
            // our stream.
            let status = unsafe {
                (nccl.reduce)(
                    p,
                    p,
                    len,
                    nccl_dtype(dtype),
                    red,
                    root as i32,
                    self.handle.comm,
                    self.stream.cu_stream().cast(),
                )
            };
            if created {
                // SAFETY: NCCL allows destroying an op once the calls using it are enqueued.
                unsafe {
                    (nccl.red_op_destroy)(red, self.handle.comm);
                }
            }
            nccl.check("ncclReduce", status)
        })
    }

    fn send<'a>(&'a self, buf: Buffer<'a>, peer: usize) -> Result<Work<'a>> {
        if peer >= self.world_size {
            return Err(ParallelError::InvalidRank {
                op: "send",
                rank: peer,
                world_size: self.world_size,
            });
        }
        let Buffer::Device(device) = buf else {
            return Err(self.device_only("send"));
        };
        let _serial = self.enqueue.lock().unwrap_or_else(|p| p.into_inner());
        self.order_after(device.stream())?;
        {
            let (ptr, _record) = match &device {
                DeviceSlice::F32(v) => v.device_ptr(&self.stream),
                DeviceSlice::BF16(v) => v.device_ptr(&self.stream),
                DeviceSlice::F16(v) => v.device_ptr(&self.stream),
            };
            let nccl = self.handle.nccl;
            // SAFETY: sends `len` elements of a live device buffer on our stream.
            let status = unsafe {
                (nccl.send)(
                    ptr as *const c_void,
                    device.len(),
                    nccl_dtype(device.dtype()),
                    peer as i32,
                    self.handle.comm,
                    self.stream.cu_stream().cast(),
                )
            };
            nccl.check("ncclSend", status)?;
        }
        self.record("send")
    }

    fn recv<'a>(&'a self, buf: BufferMut<'a>, peer: usize) -> Result<Work<'a>> {
        if peer >= self.world_size {
            return Err(ParallelError::InvalidRank {
                op: "recv",
                rank: peer,
                world_size: self.world_size,
            });
        }
        self.enqueue_mut("recv", buf, |ptr, dtype, len| {
            let nccl = self.handle.nccl;
            // SAFETY: receives `len` elements into a live device buffer on our stream.
            let status = unsafe {
                (nccl.recv)(
                    ptr as *mut c_void,
                    len,
                    nccl_dtype(dtype),
                    peer as i32,
                    self.handle.comm,
                    self.stream.cu_stream().cast(),
                )
            };
            nccl.check("ncclRecv", status)
        })
    }

    fn batch_p2p(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        for op in ops.iter() {
            let peer = op.peer();
            if peer >= self.world_size {
                return Err(ParallelError::InvalidRank {
                    op: "batch_p2p",
                    rank: peer,
                    world_size: self.world_size,
                });
            }
            if op.is_host() {
                return Err(self.device_only("batch_p2p"));
            }
        }
        let _serial = self.enqueue.lock().unwrap_or_else(|p| p.into_inner());
        for op in ops.iter() {
            match op {
                P2pOp::SendDevice { buf, .. } => self.order_after(buf.stream())?,
                P2pOp::RecvDevice { buf, .. } => self.order_after(buf.stream())?,
                P2pOp::Send { .. } | P2pOp::Recv { .. } => {}
            }
        }
        let nccl = self.handle.nccl;
        let (comm, stream) = (self.handle.comm, self.stream.cu_stream().cast());
        // The guards record each buffer's event on our stream when they drop, after the group
        // is enqueued, so later users of the buffers wait for it.
        let mut guards = Vec::with_capacity(ops.len());
        // SAFETY: opens a group; every path below closes it before returning.
        nccl.check("ncclGroupStart", unsafe { (nccl.group_start)() })?;
        let mut posted = Ok(());
        for op in ops.iter_mut() {
            let status = match op {
                P2pOp::SendDevice { buf, peer } => {
                    let (ptr, guard) = match &*buf {
                        DeviceSlice::F32(v) => v.device_ptr(&self.stream),
                        DeviceSlice::BF16(v) => v.device_ptr(&self.stream),
                        DeviceSlice::F16(v) => v.device_ptr(&self.stream),
                    };
                    guards.push(guard);
                    // SAFETY: sends `len` elements of a live device buffer on our stream; the
                    // buffer is borrowed until this call returns, after the group completed.
                    let status = unsafe {
                        (nccl.send)(
                            ptr as *const c_void,
                            buf.len(),
                            nccl_dtype(buf.dtype()),
                            *peer as i32,
                            comm,
                            stream,
                        )
                    };
                    nccl.check("ncclSend", status)
                }
                P2pOp::RecvDevice { buf, peer } => {
                    let (dtype, len) = (buf.dtype(), buf.len());
                    let (ptr, guard) = match buf {
                        DeviceSliceMut::F32(v) => v.device_ptr_mut(&self.stream),
                        DeviceSliceMut::BF16(v) => v.device_ptr_mut(&self.stream),
                        DeviceSliceMut::F16(v) => v.device_ptr_mut(&self.stream),
                    };
                    guards.push(guard);
                    // SAFETY: receives `len` elements into a live device buffer on our stream,
                    // borrowed mutably until this call returns.
                    let status = unsafe {
                        (nccl.recv)(
                            ptr as *mut c_void,
                            len,
                            nccl_dtype(dtype),
                            *peer as i32,
                            comm,
                            stream,
                        )
                    };
                    nccl.check("ncclRecv", status)
                }
                P2pOp::Send { .. } | P2pOp::Recv { .. } => Ok(()),
            };
            if status.is_err() {
                posted = status;
                break;
            }
        }
        // SAFETY: closes the group opened above (also after a failed post, as NCCL requires).
        let ended = nccl.check("ncclGroupEnd", unsafe { (nccl.group_end)() });
        drop(guards);
        posted?;
        ended?;
        // Returns once all are done, as the trait says (bounded by the timeout).
        self.record("batch_p2p")?.wait()
    }

    /// Grouped `ncclSend` / `ncclRecv` with every rank (itself included): shard `j` goes to
    /// rank `j` and rank `j`'s shard lands in shard `j` of a scratch buffer, copied over `buf`
    /// once the group completed (NCCL's exchange is out of place). All on the communication
    /// stream, so the scratch is freed after the copy.
    fn all_to_all<'a>(&'a self, buf: BufferMut<'a>) -> Result<Work<'a>> {
        let world = self.world_size;
        shard_range("all_to_all", buf.dtype(), buf.len(), world, self.rank)?;
        let bytes = buf.len() * buf.dtype().size_in_bytes();
        let mut scratch = (self.stream)
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(cuda("allocating the all_to_all scratch"))?;
        self.enqueue_mut("all_to_all", buf, |ptr, dtype, len| {
            let nccl = self.handle.nccl;
            let (comm, stream) = (self.handle.comm, self.stream.cu_stream());
            let shard = len / world;
            let (scratch_ptr, _scratch) = scratch.device_ptr_mut(&self.stream);
            // SAFETY: opens a group; closed below on every path.
            nccl.check("ncclGroupStart", unsafe { (nccl.group_start)() })?;
            let mut posted = Ok(());
            for peer in 0..world {
                // SAFETY: `shard` elements of `dtype` at shard `peer` of the live device buffer
                // (len = world * shard, checked above) are sent, and as many received into the
                // same place of the scratch (`bytes` long), both on the communication stream.
                let status = unsafe {
                    nccl.check(
                        "ncclSend",
                        (nccl.send)(
                            offset(ptr, peer * shard, dtype),
                            shard,
                            nccl_dtype(dtype),
                            peer as i32,
                            comm,
                            stream.cast(),
                        ),
                    )
                    .and_then(|()| {
                        nccl.check(
                            "ncclRecv",
                            (nccl.recv)(
                                offset(scratch_ptr, peer * shard, dtype),
                                shard,
                                nccl_dtype(dtype),
                                peer as i32,
                                comm,
                                stream.cast(),
                            ),
                        )
                    })
                };
                if status.is_err() {
                    posted = status;
                    break;
                }
            }
            // SAFETY: closes the group opened above (also after a failed post, as NCCL requires).
            let ended = nccl.check("ncclGroupEnd", unsafe { (nccl.group_end)() });
            posted?;
            ended?;
            // SAFETY: copies `bytes` from the scratch over the buffer (both live, both `bytes`
            // long), ordered after the group on the communication stream.
            unsafe { cudarc::driver::result::memcpy_dtod_async(ptr, scratch_ptr, bytes, stream) }
                .map_err(cuda("copying the all_to_all result into place"))
        })
    }

    fn barrier(&self) -> Result<()> {
        let mut scratch = self
            .barrier_scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let view = scratch.as_view_mut();
        self.all_reduce(BufferMut::from(view), ReduceOp::Sum)?
            .wait()
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn Communicator>>> {
        check_group_ranks(ranks, self.world_size)?;
        let index = ranks.iter().position(|&r| r == self.rank);
        let color = if index.is_some() {
            0
        } else {
            library::SPLIT_NOCOLOR
        };
        let nccl = self.handle.nccl;
        let mut comm: library::Comm = std::ptr::null_mut();
        let _serial = self.enqueue.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: collective over this communicator; `comm` receives the new one (or null for
        // NOCOLOR); a null config asks for the parent's settings.
        nccl.check("ncclCommSplit", unsafe {
            (nccl.comm_split)(
                self.handle.comm,
                color,
                self.rank as i32,
                &mut comm,
                std::ptr::null_mut(),
            )
        })?;
        let Some(index) = index else {
            return Ok(None);
        };
        let stream = self
            .stream
            .context()
            .new_stream()
            .map_err(cuda("creating a group's communication stream"))?;
        let sub = Self::with_comm(
            CommHandle { comm, nccl },
            stream,
            index,
            ranks.len(),
            self.timeout,
        )?;
        Ok(Some(Box::new(sub)))
    }
}
