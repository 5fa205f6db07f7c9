//! The host communicator's sockets: one TCP connection between every pair of ranks, set up through
//! the rendezvous store, and tagged data frames over them.
//!
//! Every data frame carries a tag (group, sequence number, operation, message length); a receiver
//! that gets another tag than it expects fails with [`ParallelError::OutOfStep`] instead of
//! misreading the bytes, so ranks that disagree on the order of collectives get an error, not
//! garbage or a hang.

use std::io::{ErrorKind, Read};
use std::net::{TcpListener, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{ParallelError, Result};
use crate::store::StoreClient;
use crate::token::JobToken;
use crate::wire::codec::{Decoder, Encoder};
use crate::wire::frame::{FrameKind, read_header, write_frame};
use crate::wire::handshake::{Hello, Role, accept_handshake, connect_handshake};
use crate::wire::socket::{Context, connect_with_retry, set_timeouts};

/// The most element bytes in one data frame; larger messages are split.
pub const MAX_DATA_BYTES: usize = 16 << 20;
/// Tag bytes at the start of every data frame.
const TAG_LEN: usize = 4 + 8 + 1 + 8;
/// The longest error message a peer may send.
const MAX_ERROR_LEN: usize = 4096;

/// Which operation a data frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpCode {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    SendRecv = 5,
    AllToAll = 6,
}

/// The tag of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    pub group: u32,
    pub seq: u64,
    pub op: OpCode,
    /// Bytes of the whole message (all its frames).
    pub total: u64,
}

impl Tag {
    fn encode(&self) -> Vec<u8> {
        Encoder::new()
            .u32(self.group)
            .u64(self.seq)
            .u8(self.op as u8)
            .u64(self.total)
            .finish()
    }

    fn describe(group: u32, seq: u64, op: u8, total: u64) -> String {
        format!("group {group} message {seq} op {op} of {total} bytes")
    }
}

/// Connections to every other rank.
pub struct Mesh {
    rank: usize,
    world_size: usize,
    links: Vec<Option<TcpStream>>,
    timeout: Duration,
    /// Held for the duration of each operation of any group sharing this mesh.
    pub(crate) op_lock: Mutex<()>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

/// How a rank joins the mesh.
#[derive(Debug, Clone)]
pub struct MeshOptions {
    pub rank: usize,
    pub world_size: usize,
    /// The local address to listen on (an interface the other ranks can reach; loopback for a
    /// single-node job). The port is chosen by the system.
    pub listen_host: String,
    pub token: JobToken,
    pub timeout: Duration,
    /// Namespace of this mesh's keys in the store (differs per restart of the job).
    pub key_prefix: String,
}

impl Mesh {
    /// Connects to every other rank: publishes this rank's address, connects to the lower ranks
    /// and accepts the higher ones.
    pub fn connect(store: &StoreClient, options: &MeshOptions) -> Result<Mesh> {
        let MeshOptions {
            rank,
            world_size,
            ref listen_host,
            ref token,
            timeout,
            ref key_prefix,
        } = *options;
        let mut links: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        let listener = TcpListener::bind((listen_host.as_str(), 0)).map_err(|e| {
            ParallelError::io(format!("rank {rank} cannot listen on {listen_host}"), e)
        })?;
        let addr = listener
            .local_addr()
            .map_err(|e| ParallelError::io("host communicator address", e))?;
        store.set(
            &format!("{key_prefix}/addr/{rank}"),
            addr.to_string().as_bytes(),
        )?;

        for (peer, link) in links.iter_mut().enumerate().take(rank) {
            let key = format!("{key_prefix}/addr/{peer}");
            let peer_addr = String::from_utf8(store.wait_get(&key, timeout)?)
                .map_err(|_| ParallelError::frame(format!("store key {key}"), "not UTF-8"))?;
            let mut stream = connect_with_retry(&peer_addr, timeout)?;
            let ctx = Context {
                op: "host communicator handshake",
                peer: format!("rank {peer} ({peer_addr})"),
                rank: Some(peer),
                timeout,
            };
            connect_handshake(
                &mut stream,
                &Hello {
                    role: Role::Peer,
                    rank: rank as u32,
                    token: token.as_str().as_bytes().to_vec(),
                },
                &ctx,
            )?;
            *link = Some(stream);
        }
        accept_higher_ranks(&listener, &mut links, options)?;
        for stream in links.iter().flatten() {
            stream
                .set_nodelay(true)
                .and_then(|()| set_timeouts(stream, Some(timeout)))
                .map_err(|e| ParallelError::io("host communicator socket options", e))?;
        }
        Ok(Mesh {
            rank,
            world_size,
            links,
            timeout,
            op_lock: Mutex::new(()),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn link(&self, op: &'static str, peer: usize) -> Result<(&TcpStream, Context)> {
        let stream =
            self.links
                .get(peer)
                .and_then(Option::as_ref)
                .ok_or(ParallelError::InvalidRank {
                    op,
                    rank: peer,
                    world_size: self.world_size,
                })?;
        let ctx = Context {
            op,
            peer: format!("rank {peer}"),
            rank: Some(peer),
            timeout: self.timeout,
        };
        Ok((stream, ctx))
    }

    /// Sends one message (split into frames of at most [`MAX_DATA_BYTES`]).
    pub fn send(&self, op: &'static str, peer: usize, tag: Tag, bytes: &[u8]) -> Result<()> {
        let (mut stream, ctx) = self.link(op, peer)?;
        debug_assert_eq!(tag.total, bytes.len() as u64);
        let tag_bytes = tag.encode();
        let mut pieces = bytes.chunks(MAX_DATA_BYTES).peekable();
        if pieces.peek().is_none() {
            return write_frame(&mut stream, FrameKind::Data, &[&tag_bytes]).map_err(|e| ctx.io(e));
        }
        for piece in pieces {
            write_frame(&mut stream, FrameKind::Data, &[&tag_bytes, piece])
                .map_err(|e| ctx.io(e))?;
        }
        Ok(())
    }

    /// Receives one message with `tag` into `dst`, which must be exactly its length. A message
    /// that does not match is answered with an error frame, so the peer fails with the reason
    /// instead of waiting for a timeout.
    pub fn recv(&self, op: &'static str, peer: usize, tag: Tag, dst: &mut [u8]) -> Result<()> {
        let result = self.recv_checked(op, peer, tag, dst);
        if let Err(e @ (ParallelError::OutOfStep { .. } | ParallelError::Frame { .. })) = &result
            && let Ok((mut stream, _)) = self.link(op, peer)
        {
            // Best effort: the peer learns why; our own error is returned either way.
            let _ = write_frame(&mut stream, FrameKind::Error, &[e.to_string().as_bytes()]);
        }
        result
    }

    fn recv_checked(&self, op: &'static str, peer: usize, tag: Tag, dst: &mut [u8]) -> Result<()> {
        let (mut stream, ctx) = self.link(op, peer)?;
        let mut filled = 0;
        loop {
            let header = read_header(&mut stream, TAG_LEN + MAX_DATA_BYTES.max(MAX_ERROR_LEN))
                .map_err(|e| ctx.frame(e))?;
            if header.kind == FrameKind::Error {
                let mut message = vec![0u8; header.len.min(MAX_ERROR_LEN)];
                stream.read_exact(&mut message).map_err(|e| ctx.io(e))?;
                return Err(ParallelError::Refused {
                    from: ctx.peer,
                    message: String::from_utf8_lossy(&message).into_owned(),
                });
            }
            if header.kind != FrameKind::Data || header.len < TAG_LEN {
                return Err(ParallelError::frame(
                    ctx.peer,
                    format!(
                        "{op}: expected a data frame, got {:?} of {} bytes",
                        header.kind, header.len
                    ),
                ));
            }
            let mut tag_bytes = [0u8; TAG_LEN];
            stream.read_exact(&mut tag_bytes).map_err(|e| ctx.io(e))?;
            let mut d = Decoder::new(&tag_bytes);
            let field = |r: std::result::Result<u64, String>| r.unwrap_or(u64::MAX);
            let group = d.u32("group").unwrap_or(u32::MAX);
            let seq = field(d.u64("seq"));
            let code = d.u8("op").unwrap_or(u8::MAX);
            let total = field(d.u64("total"));
            if (group, seq, code, total) != (tag.group, tag.seq, tag.op as u8, tag.total) {
                return Err(ParallelError::OutOfStep {
                    op,
                    peer,
                    expected: Tag::describe(tag.group, tag.seq, tag.op as u8, tag.total),
                    received: Tag::describe(group, seq, code, total),
                });
            }
            let piece = header.len - TAG_LEN;
            if piece > dst.len() - filled {
                return Err(ParallelError::frame(
                    ctx.peer,
                    format!("{op}: frame of {piece} bytes overruns the message"),
                ));
            }
            stream
                .read_exact(&mut dst[filled..filled + piece])
                .map_err(|e| ctx.io(e))?;
            filled += piece;
            if filled == dst.len() && (piece > 0 || dst.is_empty()) {
                return Ok(());
            }
            if piece == 0 {
                return Err(ParallelError::frame(
                    ctx.peer,
                    format!("{op}: empty frame inside a non-empty message"),
                ));
            }
        }
    }
}

/// Accepts one connection from every rank above `options.rank`, refusing foreign or duplicate
/// ones, until `options.timeout`.
fn accept_higher_ranks(
    listener: &TcpListener,
    links: &mut [Option<TcpStream>],
    options: &MeshOptions,
) -> Result<()> {
    let expected = options.world_size - options.rank - 1;
    if expected == 0 {
        return Ok(());
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| ParallelError::io("host communicator listener", e))?;
    let deadline = Instant::now() + options.timeout;
    let mut accepted = 0;
    while accepted < expected {
        match listener.accept() {
            Ok((mut stream, from)) => {
                stream
                    .set_nonblocking(false)
                    .map_err(|e| ParallelError::io("host communicator socket", e))?;
                let label = format!("connection from {from}");
                let Ok(hello) = accept_handshake(
                    &mut stream,
                    &options.token,
                    Role::Peer,
                    options.world_size,
                    false,
                    &label,
                ) else {
                    continue; // refused with an error frame; keep waiting for the real ranks
                };
                let peer = hello.rank as usize;
                if peer <= options.rank || links[peer].is_some() {
                    continue; // a lower or duplicate rank: not ours to accept
                }
                links[peer] = Some(stream);
                accepted += 1;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (options.rank + 1..options.world_size)
                        .filter(|&r| links[r].is_none())
                        .collect();
                    return Err(ParallelError::Timeout {
                        op: "host communicator setup",
                        peer: format!("ranks {missing:?} to connect"),
                        timeout: options.timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(ParallelError::io("host communicator accept", e)),
        }
    }
    Ok(())
}
