//! The host backend's collectives on host slices, built from the ring primitives. Half-precision
//! buffers are widened to f32 for the reduction and rounded once at the end.

use std::ops::Range;

use crate::buffer::{HostSlice, HostSliceMut};
use crate::communicator::{chunk_range, shard_range};
use crate::error::Result;
use crate::host::ring::Ring;
use crate::reduce::ReduceOp;

fn bytes_of(range: Range<usize>, elem: usize) -> Range<usize> {
    range.start * elem..range.end * elem
}

/// Reduces every member's `buf` into this rank's chunk of `buf` (scaled by `op`, rounded once).
fn reduce_own_chunk(
    ring: &Ring<'_>,
    buf: &mut HostSliceMut<'_>,
    chunk: &impl Fn(usize) -> Range<usize>,
    op: ReduceOp,
) -> Result<()> {
    let n = ring.size();
    let own = chunk(ring.index);
    match buf {
        HostSliceMut::F32(values) => {
            ring.reduce_scatter(values, chunk, op)?;
            op.finish(&mut values[own], n);
        }
        _ => {
            let mut acc = buf.to_f32_vec();
            ring.reduce_scatter(&mut acc, chunk, op)?;
            op.finish(&mut acc[own.clone()], n);
            buf.store_f32(own.start, &acc[own]);
        }
    }
    Ok(())
}

pub fn all_reduce(ring: &Ring<'_>, mut buf: HostSliceMut<'_>, op: ReduceOp) -> Result<()> {
    let n = ring.size();
    let len = buf.len();
    let chunk = |i: usize| chunk_range(len, n, i);
    reduce_own_chunk(ring, &mut buf, &chunk, op)?;
    let elem = buf.dtype().size_in_bytes();
    ring.all_gather(buf.as_bytes_mut(), |i| bytes_of(chunk(i), elem))
}

pub fn reduce_scatter(ring: &Ring<'_>, mut buf: HostSliceMut<'_>, op: ReduceOp) -> Result<()> {
    let (n, len, dtype) = (ring.size(), buf.len(), buf.dtype());
    shard_range(ring.name, dtype, len, n, 0)?;
    let chunk = |i: usize| len / n * i..len / n * (i + 1);
    reduce_own_chunk(ring, &mut buf, &chunk, op)
}

pub fn all_gather(ring: &Ring<'_>, mut buf: HostSliceMut<'_>) -> Result<()> {
    let (n, len, dtype) = (ring.size(), buf.len(), buf.dtype());
    shard_range(ring.name, dtype, len, n, 0)?;
    let elem = dtype.size_in_bytes();
    ring.all_gather(buf.as_bytes_mut(), |i| {
        bytes_of(len / n * i..len / n * (i + 1), elem)
    })
}

/// The root sends the whole buffer to each member in turn (the host backend serves small groups;
/// a pipelined chain would only pay off for large ones).
pub fn broadcast(ring: &Ring<'_>, mut buf: HostSliceMut<'_>, root: usize) -> Result<()> {
    if ring.index == root {
        for member in (0..ring.size()).filter(|&m| m != root) {
            ring.send(member, buf.as_bytes())?;
        }
        Ok(())
    } else {
        ring.recv(root, buf.as_bytes_mut())
    }
}

pub fn send(ring: &Ring<'_>, buf: HostSlice<'_>, peer: usize) -> Result<()> {
    ring.send(peer, buf.as_bytes())
}

pub fn recv(ring: &Ring<'_>, mut buf: HostSliceMut<'_>, peer: usize) -> Result<()> {
    ring.recv(peer, buf.as_bytes_mut())
}

/// Pairwise exchange: at step `s`, send shard `me + s` to that member and receive shard
/// `me - s` from that member. The input is copied first because a shard is overwritten before
/// the step that sends it.
pub fn all_to_all(ring: &Ring<'_>, mut buf: HostSliceMut<'_>) -> Result<()> {
    let (n, len, dtype) = (ring.size(), buf.len(), buf.dtype());
    shard_range(ring.name, dtype, len, n, 0)?;
    let shard = len / n * dtype.size_in_bytes();
    let me = ring.index;
    let input = buf.as_bytes().to_vec();
    let output = buf.as_bytes_mut();
    for step in 1..n {
        let to = (me + step) % n;
        let from = (me + n - step) % n;
        ring.exchange(
            to,
            &input[to * shard..(to + 1) * shard],
            from,
            &mut output[from * shard..(from + 1) * shard],
        )?;
    }
    Ok(())
}
