//! `HostCommunicator`: the [`Communicator`] over TCP between processes (gloo's role). Collectives
//! run inside the call and return completed work. Sub-groups share the parent's connections; a
//! tag on every message keeps their traffic apart.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::buffer::{Buffer, BufferMut, HostSlice, HostSliceMut};
use crate::communicator::{Communicator, P2pOp, check_group_ranks};
use crate::error::{ParallelError, Result};
use crate::host::collectives;
use crate::host::mesh::{Mesh, MeshOptions, OpCode};
use crate::host::ring::Ring;
use crate::reduce::ReduceOp;
use crate::store::StoreClient;
use crate::work::Work;

/// Message counters of one group: collectives share one, point-to-point has one per peer.
#[derive(Debug)]
struct Sequence {
    collective: u64,
    p2p_send: Vec<u64>,
    p2p_recv: Vec<u64>,
}

/// Collectives over TCP among a group of ranks.
pub struct HostCommunicator {
    mesh: Arc<Mesh>,
    group: u32,
    /// Global ranks of the members; the index is the group rank.
    members: Vec<usize>,
    index: usize,
    sequence: Mutex<Sequence>,
    groups_created: AtomicU32,
    #[cfg(feature = "cuda")]
    staging: crate::host::staging::Staging,
}

impl std::fmt::Debug for HostCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCommunicator")
            .field("group", &self.group)
            .field("members", &self.members)
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

/// The group id of the world.
const WORLD_GROUP: u32 = 0;

impl HostCommunicator {
    /// Joins the job's host communicator (all `world_size` ranks call this).
    pub fn connect(store: &StoreClient, options: &MeshOptions) -> Result<HostCommunicator> {
        let mesh = Arc::new(Mesh::connect(store, options)?);
        let members = (0..options.world_size).collect();
        Ok(Self::with_group(mesh, WORLD_GROUP, members, options.rank))
    }

    fn with_group(mesh: Arc<Mesh>, group: u32, members: Vec<usize>, index: usize) -> Self {
        let n = members.len();
        HostCommunicator {
            mesh,
            group,
            members,
            index,
            sequence: Mutex::new(Sequence {
                collective: 0,
                p2p_send: vec![0; n],
                p2p_recv: vec![0; n],
            }),
            groups_created: AtomicU32::new(0),
            #[cfg(feature = "cuda")]
            staging: crate::host::staging::Staging::default(),
        }
    }

    /// The CUDA stream that stages device buffers through page-locked host memory (needed before
    /// the first collective on a device buffer); groups made afterwards by `new_group` inherit
    /// it.
    #[cfg(feature = "cuda")]
    pub fn set_staging_stream(&self, stream: std::sync::Arc<cudarc::driver::CudaStream>) {
        self.staging.set_stream(stream);
    }

    /// Global ranks of this group's members, in group-rank order.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// Runs `body` with the mesh locked and a ring tagged with the group's next sequence number.
    fn collective<R>(
        &self,
        op: OpCode,
        name: &'static str,
        body: impl FnOnce(&Ring<'_>) -> Result<R>,
    ) -> Result<R> {
        let _mesh = lock(&self.mesh.op_lock);
        let seq = {
            let mut s = lock(&self.sequence);
            s.collective += 1;
            s.collective
        };
        body(&self.ring(op, name, seq))
    }

    fn ring(&self, op: OpCode, name: &'static str, seq: u64) -> Ring<'_> {
        Ring {
            mesh: &self.mesh,
            members: &self.members,
            index: self.index,
            group: self.group,
            seq,
            op,
            name,
        }
    }

    fn check_member(&self, op: &'static str, rank: usize) -> Result<()> {
        if rank < self.members.len() {
            Ok(())
        } else {
            Err(ParallelError::InvalidRank {
                op,
                rank,
                world_size: self.members.len(),
            })
        }
    }

    /// Runs a collective on a host slice, or on a device buffer staged through host memory.
    fn in_place(
        &self,
        buf: BufferMut<'_>,
        op: OpCode,
        name: &'static str,
        body: impl Fn(&Ring<'_>, HostSliceMut<'_>) -> Result<()>,
    ) -> Result<()> {
        match buf {
            BufferMut::Host(host) => self.collective(op, name, |ring| body(ring, host)),
            #[cfg(feature = "cuda")]
            BufferMut::Device(device) => self.staging.round_trip(device, |host| {
                self.collective(op, name, |ring| body(ring, host))
            }),
        }
    }

    fn send_host(&self, buf: HostSlice<'_>, peer: usize) -> Result<()> {
        let _mesh = lock(&self.mesh.op_lock);
        let seq = {
            let mut s = lock(&self.sequence);
            s.p2p_send[peer] += 1;
            s.p2p_send[peer]
        };
        collectives::send(&self.ring(OpCode::SendRecv, "send", seq), buf, peer)
    }

    fn recv_host(&self, buf: HostSliceMut<'_>, peer: usize) -> Result<()> {
        let _mesh = lock(&self.mesh.op_lock);
        let seq = {
            let mut s = lock(&self.sequence);
            s.p2p_recv[peer] += 1;
            s.p2p_recv[peer]
        };
        collectives::recv(&self.ring(OpCode::SendRecv, "recv", seq), buf, peer)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic inside a collective leaves the counters as they were: still usable.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Communicator for HostCommunicator {
    fn rank(&self) -> usize {
        self.index
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn backend(&self) -> &'static str {
        "host"
    }

    fn timeout(&self) -> Duration {
        self.mesh.timeout()
    }

    fn all_reduce<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        self.in_place(buf, OpCode::AllReduce, "all_reduce", |ring, host| {
            collectives::all_reduce(ring, host, op)
        })?;
        Ok(Work::completed())
    }

    fn reduce_scatter<'a>(&'a self, buf: BufferMut<'a>, op: ReduceOp) -> Result<Work<'a>> {
        self.in_place(
            buf,
            OpCode::ReduceScatter,
            "reduce_scatter",
            |ring, host| collectives::reduce_scatter(ring, host, op),
        )?;
        Ok(Work::completed())
    }

    fn all_gather<'a>(&'a self, buf: BufferMut<'a>) -> Result<Work<'a>> {
        self.in_place(
            buf,
            OpCode::AllGather,
            "all_gather",
            collectives::all_gather,
        )?;
        Ok(Work::completed())
    }

    fn broadcast<'a>(&'a self, buf: BufferMut<'a>, root: usize) -> Result<Work<'a>> {
        self.check_member("broadcast", root)?;
        self.in_place(buf, OpCode::Broadcast, "broadcast", |ring, host| {
            collectives::broadcast(ring, host, root)
        })?;
        Ok(Work::completed())
    }

    fn send<'a>(&'a self, buf: Buffer<'a>, peer: usize) -> Result<Work<'a>> {
        self.check_member("send", peer)?;
        match buf {
            Buffer::Host(host) => self.send_host(host, peer)?,
            #[cfg(feature = "cuda")]
            Buffer::Device(device) => self
                .staging
                .download(device, |host| self.send_host(host, peer))?,
        }
        Ok(Work::completed())
    }

    fn recv<'a>(&'a self, buf: BufferMut<'a>, peer: usize) -> Result<Work<'a>> {
        self.check_member("recv", peer)?;
        match buf {
            BufferMut::Host(host) => self.recv_host(host, peer)?,
            #[cfg(feature = "cuda")]
            BufferMut::Device(device) => self
                .staging
                .round_trip(device, |host| self.recv_host(host, peer))?,
        }
        Ok(Work::completed())
    }

    fn all_to_all<'a>(&'a self, buf: BufferMut<'a>) -> Result<Work<'a>> {
        self.in_place(buf, OpCode::AllToAll, "all_to_all", collectives::all_to_all)?;
        Ok(Work::completed())
    }

    fn batch_p2p(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        for op in ops.iter() {
            self.check_member("batch_p2p", op.peer())?;
        }
        #[cfg(feature = "cuda")]
        if ops.iter().any(|op| !op.is_host()) {
            return self.batch_p2p_staged(ops);
        }
        let _mesh = lock(&self.mesh.op_lock);
        // Every message's sequence number, in list order per peer and direction.
        let seqs: Vec<u64> = {
            let mut s = lock(&self.sequence);
            ops.iter()
                .map(|op| match op {
                    P2pOp::Send { peer, .. } => {
                        s.p2p_send[*peer] += 1;
                        s.p2p_send[*peer]
                    }
                    P2pOp::Recv { peer, .. } => {
                        s.p2p_recv[*peer] += 1;
                        s.p2p_recv[*peer]
                    }
                    // Refused above.
                    #[cfg(feature = "cuda")]
                    P2pOp::SendDevice { .. } | P2pOp::RecvDevice { .. } => 0,
                })
                .collect()
        };
        let mut sends: Vec<(usize, u64, &HostSlice<'_>)> = Vec::new();
        let mut recvs: Vec<(usize, u64, &mut HostSliceMut<'_>)> = Vec::new();
        for (op, &seq) in ops.iter_mut().zip(&seqs) {
            match op {
                P2pOp::Send { buf, peer } => sends.push((*peer, seq, buf)),
                P2pOp::Recv { buf, peer } => recvs.push((*peer, seq, buf)),
                #[cfg(feature = "cuda")]
                P2pOp::SendDevice { .. } | P2pOp::RecvDevice { .. } => {}
            }
        }
        let mut peers: Vec<usize> = sends.iter().map(|s| s.0).collect();
        peers.sort_unstable();
        peers.dedup();
        // One sender thread per peer (its messages in order on its stream), receives here: a
        // send that fills the socket's buffer never stops this rank from receiving.
        std::thread::scope(|scope| {
            let senders: Vec<_> = peers
                .iter()
                .map(|&peer| {
                    let mine: Vec<_> = sends.iter().filter(|s| s.0 == peer).collect();
                    scope.spawn(move || -> Result<()> {
                        for (peer, seq, buf) in mine {
                            let ring = self.ring(OpCode::SendRecv, "send", *seq);
                            collectives::send(&ring, **buf, *peer)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            let mut received = Ok(());
            for (peer, seq, buf) in recvs.iter_mut() {
                let ring = self.ring(OpCode::SendRecv, "recv", *seq);
                received = collectives::recv(&ring, buf.reborrow(), *peer);
                if received.is_err() {
                    break;
                }
            }
            let mut sent = Ok(());
            for sender in senders {
                let result = sender
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                sent = sent.and(result);
            }
            // A dead peer usually fails both; the receive names the rank we were waiting on.
            received.and(sent)
        })
    }

    fn barrier(&self) -> Result<()> {
        let mut token = [0f32];
        self.collective(OpCode::AllReduce, "barrier", |ring| {
            collectives::all_reduce(ring, HostSliceMut::F32(&mut token), ReduceOp::Sum)
        })
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn Communicator>>> {
        check_group_ranks(ranks, self.members.len())?;
        // Every member of this group calls new_group in the same order, so the counter agrees
        // across ranks; mixing it with the parent id keeps nested groups distinct.
        let ordinal = self.groups_created.fetch_add(1, Ordering::SeqCst) + 1;
        let group = child_group_id(self.group, ordinal);
        let Some(index) = ranks.iter().position(|&r| r == self.index) else {
            return Ok(None);
        };
        let members = ranks.iter().map(|&r| self.members[r]).collect();
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut child = HostCommunicator::with_group(Arc::clone(&self.mesh), group, members, index);
        // A sub-group stages device buffers on the stream set on its parent (if any).
        #[cfg(feature = "cuda")]
        {
            child.staging = self.staging.child();
        }
        Ok(Some(Box::new(child)))
    }
}

#[cfg(feature = "cuda")]
impl HostCommunicator {
    /// [`Communicator::batch_p2p`] with device buffers among the operations: the device sends
    /// are copied to the host before the batch, the device receives land in host buffers and
    /// are copied up after it (through the page-locked staging on the staging stream), and the
    /// batch itself runs on host memory as any other.
    fn batch_p2p_staged(&self, ops: &mut [P2pOp<'_>]) -> Result<()> {
        use crate::host::staging::HostCopy;
        let mut copies: Vec<Option<HostCopy>> = Vec::with_capacity(ops.len());
        for op in ops.iter() {
            copies.push(match op {
                P2pOp::SendDevice { buf, .. } => {
                    let mut copy = None;
                    self.staging.download(buf.reborrow(), |host| {
                        copy = Some(HostCopy::of(host));
                        Ok(())
                    })?;
                    copy
                }
                P2pOp::RecvDevice { buf, .. } => Some(HostCopy::zeros(buf.dtype(), buf.len())),
                P2pOp::Send { .. } | P2pOp::Recv { .. } => None,
            });
        }
        {
            let mut host_ops: Vec<P2pOp<'_>> = ops
                .iter_mut()
                .zip(copies.iter_mut())
                .map(|(op, copy)| match (op, copy) {
                    (P2pOp::Send { buf, peer }, _) => P2pOp::Send {
                        buf: *buf,
                        peer: *peer,
                    },
                    (P2pOp::Recv { buf, peer }, _) => P2pOp::Recv {
                        buf: buf.reborrow(),
                        peer: *peer,
                    },
                    (P2pOp::SendDevice { peer, .. }, Some(copy)) => P2pOp::Send {
                        buf: copy.host(),
                        peer: *peer,
                    },
                    (P2pOp::RecvDevice { peer, .. }, Some(copy)) => P2pOp::Recv {
                        buf: copy.host_mut(),
                        peer: *peer,
                    },
                    (P2pOp::SendDevice { .. } | P2pOp::RecvDevice { .. }, None) => {
                        unreachable!("every device operation has its host copy")
                    }
                })
                .collect();
            self.batch_p2p(&mut host_ops)?;
        }
        for (op, copy) in ops.iter_mut().zip(&copies) {
            if let (P2pOp::RecvDevice { buf, .. }, Some(copy)) = (op, copy) {
                self.staging.upload(buf.reborrow(), copy.host())?;
            }
        }
        Ok(())
    }
}

/// A group id derived from the parent's id and the ordinal of the `new_group` call (FNV-1a).
fn child_group_id(parent: u32, ordinal: u32) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in parent
        .to_le_bytes()
        .into_iter()
        .chain(ordinal.to_le_bytes())
    {
        h ^= b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    if h == WORLD_GROUP { 1 } else { h }
}
