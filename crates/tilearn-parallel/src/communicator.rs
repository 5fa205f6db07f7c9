//! The `Communicator` trait: collectives over flat typed buffers, in place.
//!
//! Every rank of a group calls the same collectives in the same order with buffers of the same
//! dtype and length (as with NCCL and torch.distributed). Each call returns a [`Work`] handle;
//! backends that run asynchronously (NCCL, on its own stream) return pending work, the host
//! backend returns completed work. Every backend bounds waiting by its timeout.

use std::ops::Range;
use std::time::Duration;

use crate::buffer::{Buffer, BufferMut, HostSlice, HostSliceMut};
use crate::error::{ParallelError, Result};
use crate::reduce::ReduceOp;
use crate::work::Work;

/// One operation of [`Communicator::batch_p2p`]: host buffers for the host backend, device
/// buffers for NCCL.
pub enum P2pOp<'a> {
    Send {
        buf: HostSlice<'a>,
        peer: usize,
    },
    Recv {
        buf: HostSliceMut<'a>,
        peer: usize,
    },
    #[cfg(feature = "cuda")]
    SendDevice {
        buf: crate::device::DeviceSlice<'a>,
        peer: usize,
    },
    #[cfg(feature = "cuda")]
    RecvDevice {
        buf: crate::device::DeviceSliceMut<'a>,
        peer: usize,
    },
}

impl P2pOp<'_> {
    /// The rank sent to or received from.
    pub fn peer(&self) -> usize {
        match self {
            P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => *peer,
            #[cfg(feature = "cuda")]
            P2pOp::SendDevice { peer, .. } | P2pOp::RecvDevice { peer, .. } => *peer,
        }
    }

    /// Whether the buffer lives in host memory.
    pub fn is_host(&self) -> bool {
        matches!(self, P2pOp::Send { .. } | P2pOp::Recv { .. })
    }
}

/// The default communication timeout (`--comm-timeout`), as torch.distributed's.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// Collectives among the ranks of one group.
pub trait Communicator: Send + Sync {
    /// This process's rank in the group, `0..world_size()`.
    fn rank(&self) -> usize;
    /// The number of ranks in the group.
    fn world_size(&self) -> usize;
    /// The backend's name (`host`, `nccl`), for logs and errors.
    fn backend(&self) -> &'static str;
    /// How long a collective may make no progress before it fails.
    fn timeout(&self) -> Duration;

    /// Reduces `buf` across the ranks; every rank ends with the result. Half-precision buffers
    /// are accumulated in f32 where the backend allows (the host backend always does).
    fn all_reduce<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp) -> Result<Work<'a>>;

    /// Reduces `buf` across the ranks into `root`'s `buf`; the other ranks' buffers are left
    /// unspecified. ZeRO-2 reduces each gradient bucket to the rank that owns it. The default
    /// runs [`Communicator::all_reduce`] (the same result on the root, twice the root's
    /// traffic); NCCL overrides it with `ncclReduce`.
    fn reduce<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp, root: usize) -> Result<Work<'a>> {
        if root >= self.world_size() {
            return Err(ParallelError::InvalidRank {
                op: "reduce",
                rank: root,
                world_size: self.world_size(),
            });
        }
        self.all_reduce(buf, op)
    }

    /// In place: `buf` holds `world_size` equal shards; rank `r` ends with the reduction of shard
    /// `r` in shard `r` (see [`shard_range`]); the other shards are left unspecified.
    fn reduce_scatter<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp) -> Result<Work<'a>>;

    /// In place: rank `r` contributes shard `r` of `buf`; every rank ends with all shards.
    fn all_gather<'a>(&'a self, buf: BufferMut<'a>) -> Result<Work<'a>>;

    /// Copies `root`'s `buf` to every rank.
    fn broadcast<'a>(&'a self, buf: BufferMut<'a>, root: usize) -> Result<Work<'a>>;

    /// Sends `buf` to `peer`, which calls [`Communicator::recv`] with a buffer of the same length.
    fn send<'a>(&'a self, buf: Buffer<'a>, peer: usize) -> Result<Work<'a>>;

    /// Receives from `peer` into `buf`.
    fn recv<'a>(&'a self, buf: BufferMut<'a>, peer: usize) -> Result<Work<'a>>;

    /// In place: shard `j` of `buf` goes to rank `j`, and shard `j` is replaced by what rank `j`
    /// sent to this rank.
    fn all_to_all<'a>(&'a self, buf: BufferMut<'a>) -> Result<Work<'a>>;

    /// Runs point-to-point operations together and returns once all are done (NCCL's group
    /// calls, torch's `batch_isend_irecv`): a rank may send to a peer that is itself sending to
    /// it in the same batch. Messages between two ranks are matched in the order each side
    /// lists them; pipeline schedules pair them so (see [`crate::pipeline`]). The host backend
    /// takes host buffers, NCCL device buffers (one `ncclGroupStart`/`ncclGroupEnd` group).
    fn batch_p2p(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        let _ = ops;
        Err(ParallelError::Usage {
            flag: "batch_p2p".into(),
            reason: format!(
                "the {} backend does not run batched point-to-point operations yet; use the \
                 host backend",
                self.backend()
            ),
        })
    }

    /// Returns once every rank of the group has entered the barrier.
    fn barrier(&self) -> Result<()>;

    /// A communicator for the sub-group of `ranks` (ranks of this group, ascending order defines
    /// the new numbering). Collective over this group: every rank calls it with the same list, in
    /// the same order relative to other `new_group` calls; ranks outside the list get `None`.
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn Communicator>>>;
}

/// The elements of shard `rank` when `len` elements are split into `world_size` equal shards,
/// as [`Communicator::reduce_scatter`] and [`Communicator::all_gather`] do.
pub fn shard_range(
    op: &'static str,
    buf_dtype: tilearn_ops::DType,
    len: usize,
    world_size: usize,
    rank: usize,
) -> Result<Range<usize>> {
    if !len.is_multiple_of(world_size) {
        return Err(ParallelError::Buffer {
            op,
            dtype: buf_dtype,
            len,
            reason: format!(
                "the length must be a multiple of the group size {world_size} (pad the flat buffer)"
            ),
        });
    }
    let shard = len / world_size;
    Ok(rank * shard..(rank + 1) * shard)
}

/// The elements of chunk `index` when `len` elements are split into `parts` nearly equal chunks
/// (the first `len % parts` are one longer); how ring algorithms cut a buffer of any length.
pub fn chunk_range(len: usize, parts: usize, index: usize) -> Range<usize> {
    let base = len / parts;
    let extra = len % parts;
    let start = index * base + index.min(extra);
    let end = start + base + usize::from(index < extra);
    start..end
}

/// Checks that `ranks` is a strictly ascending list of ranks below `world_size`.
pub fn check_group_ranks(ranks: &[usize], world_size: usize) -> Result<()> {
    if ranks.is_empty() {
        return Err(ParallelError::Usage {
            flag: "new_group".into(),
            reason: "a group needs at least one rank".into(),
        });
    }
    for (i, &r) in ranks.iter().enumerate() {
        if r >= world_size {
            return Err(ParallelError::InvalidRank {
                op: "new_group",
                rank: r,
                world_size,
            });
        }
        if i > 0 && ranks[i - 1] >= r {
            return Err(ParallelError::Usage {
                flag: "new_group".into(),
                reason: format!("ranks must be strictly ascending, got {ranks:?}"),
            });
        }
    }
    Ok(())
}
