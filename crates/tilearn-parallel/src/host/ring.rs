//! Ring algorithms over the mesh: reduce-scatter (f32 accumulation) and all-gather (any dtype,
//! as bytes), plus the pairwise exchange both are built from.
//!
//! Each chunk is reduced by exactly one rank in a fixed order (starting after its owner), so every
//! rank ends with bit-identical results, which data parallelism relies on to keep weights equal.

use std::ops::Range;

use crate::error::Result;
use crate::host::mesh::{Mesh, OpCode, Tag};
use crate::reduce::ReduceOp;

/// Below this many bytes a message is written before the matching receive without a helper
/// thread: it fits in the kernel's socket buffers, so the peer's identical order cannot deadlock.
const INLINE_SEND_BYTES: usize = 32 << 10;

/// One operation of one group: the members in ring order and the operation's tag.
#[derive(Debug)]
pub struct Ring<'m> {
    pub mesh: &'m Mesh,
    /// Global ranks of the group's members; the group rank is the index.
    pub members: &'m [usize],
    /// This rank's index in `members`.
    pub index: usize,
    pub group: u32,
    pub seq: u64,
    pub op: OpCode,
    pub name: &'static str,
}

impl Ring<'_> {
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// The global rank of group member `i` (taken modulo the group size).
    pub fn member(&self, i: usize) -> usize {
        self.members[i % self.size()]
    }

    fn tag(&self, len: usize) -> Tag {
        Tag {
            group: self.group,
            seq: self.seq,
            op: self.op,
            total: len as u64,
        }
    }

    pub fn send(&self, member: usize, bytes: &[u8]) -> Result<()> {
        self.mesh
            .send(self.name, self.member(member), self.tag(bytes.len()), bytes)
    }

    pub fn recv(&self, member: usize, dst: &mut [u8]) -> Result<()> {
        self.mesh
            .recv(self.name, self.member(member), self.tag(dst.len()), dst)
    }

    /// Sends `out` to member `to` while receiving `into` from member `from`.
    pub fn exchange(&self, to: usize, out: &[u8], from: usize, into: &mut [u8]) -> Result<()> {
        if out.len() <= INLINE_SEND_BYTES {
            self.send(to, out)?;
            return self.recv(from, into);
        }
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| self.send(to, out));
            let received = self.recv(from, into);
            let sent = sender
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            // A dead peer usually fails both; the receive names the rank we were waiting on.
            received.and(sent)
        })
    }

    /// Reduce-scatter in f32: `chunk(i)` gives chunk `i`'s elements; afterwards this rank's chunk
    /// (`chunk(index)`) holds the reduction over all members (not yet scaled by `op`).
    pub fn reduce_scatter(
        &self,
        acc: &mut [f32],
        chunk: impl Fn(usize) -> Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size();
        let me = self.index;
        let longest = (0..n).map(|i| chunk(i).len()).max().unwrap_or(0);
        let mut incoming = vec![0f32; longest];
        for step in 0..n.saturating_sub(1) {
            let send_chunk = chunk((me + 2 * n - step - 1) % n);
            let recv_chunk = chunk((me + 2 * n - step - 2) % n);
            let into = &mut incoming[..recv_chunk.len()];
            self.exchange(
                me + 1,
                bytemuck::cast_slice(&acc[send_chunk]),
                me + n - 1,
                bytemuck::cast_slice_mut(into),
            )?;
            op.combine(&mut acc[recv_chunk], into);
        }
        Ok(())
    }

    /// All-gather in place on raw bytes: this rank's chunk `chunk(index)` is its contribution.
    pub fn all_gather(&self, buf: &mut [u8], chunk: impl Fn(usize) -> Range<usize>) -> Result<()> {
        let n = self.size();
        let me = self.index;
        for step in 0..n.saturating_sub(1) {
            let send_chunk = chunk((me + n - step) % n);
            let recv_chunk = chunk((me + 2 * n - step - 1) % n);
            let (out, into) = split_read_write(buf, send_chunk, recv_chunk);
            self.exchange(me + 1, out, me + n - 1, into)?;
        }
        Ok(())
    }
}

/// A shared view of `read` and a mutable view of `write`, two disjoint ranges of `buf`.
pub fn split_read_write<T>(
    buf: &mut [T],
    read: Range<usize>,
    write: Range<usize>,
) -> (&[T], &mut [T]) {
    if read.is_empty() {
        return (&[], &mut buf[write]);
    }
    if write.is_empty() {
        return (&buf[read], &mut []);
    }
    assert!(
        read.end <= write.start || write.end <= read.start,
        "ranges {read:?} and {write:?} overlap"
    );
    if read.start < write.start {
        let (low, high) = buf.split_at_mut(write.start);
        (&low[read], &mut high[..write.len()])
    } else {
        let (low, high) = buf.split_at_mut(read.start);
        (&high[..read.len()], &mut low[write])
    }
}
