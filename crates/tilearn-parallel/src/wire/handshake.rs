//! The first exchange on every connection: the connecting side says who it is and presents the job
//! token; the listening side answers `Welcome` or an `Error` frame and closes.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use crate::error::ParallelError;
use crate::token::{JobToken, MAX_TOKEN_LEN};
use crate::wire::codec::{Decoder, Encoder};
use crate::wire::frame::{FrameKind, read_frame, write_frame};
use crate::wire::socket::{Context, set_timeouts};

/// The largest handshake frame (token plus a few integers, or an error message).
pub const MAX_HANDSHAKE_LEN: usize = 4096;

/// How long a listener waits for a connection's handshake before dropping it.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a connection is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A rank or a launcher talking to the rendezvous store.
    StoreClient = 1,
    /// A rank connecting to another rank of the host communicator.
    Peer = 2,
}

/// The connecting side's introduction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub role: Role,
    /// The connecting rank (`u32::MAX` for a launcher).
    pub rank: u32,
    pub token: Vec<u8>,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        Encoder::new()
            .u8(self.role as u8)
            .u32(self.rank)
            .bytes(&self.token)
            .finish()
    }

    pub fn decode(payload: &[u8]) -> Result<Hello, String> {
        let mut d = Decoder::new(payload);
        let role = match d.u8("role")? {
            1 => Role::StoreClient,
            2 => Role::Peer,
            other => return Err(format!("unknown role {other}")),
        };
        let rank = d.u32("rank")?;
        let token = d.bytes("token")?;
        if token.len() > MAX_TOKEN_LEN {
            return Err(format!("token of {} bytes is too long", token.len()));
        }
        let token = token.to_vec();
        d.finish()?;
        Ok(Hello { role, rank, token })
    }
}

/// Introduces this side and waits for the verdict.
pub fn connect_handshake(
    stream: &mut TcpStream,
    hello: &Hello,
    ctx: &Context,
) -> Result<(), ParallelError> {
    set_timeouts(stream, Some(ctx.timeout)).map_err(|e| ctx.io(e))?;
    write_frame(stream, FrameKind::Hello, &[&hello.encode()]).map_err(|e| ctx.io(e))?;
    let reply = read_frame(stream, MAX_HANDSHAKE_LEN).map_err(|e| ctx.frame(e))?;
    match reply.kind {
        FrameKind::Welcome if reply.payload.is_empty() => Ok(()),
        FrameKind::Error => Err(ParallelError::Refused {
            from: ctx.peer.clone(),
            message: String::from_utf8_lossy(&reply.payload).into_owned(),
        }),
        other => Err(ParallelError::frame(
            ctx.peer.clone(),
            format!("expected Welcome, got {other:?}"),
        )),
    }
}

/// Reads a connection's introduction and admits it if it carries `token` and `role` and its rank is
/// below `rank_limit` (or is `u32::MAX`, a launcher, when `launcher_allowed`). A refused connection
/// gets an `Error` frame saying why.
pub fn accept_handshake(
    stream: &mut TcpStream,
    token: &JobToken,
    role: Role,
    rank_limit: usize,
    launcher_allowed: bool,
    label: &str,
) -> Result<Hello, ParallelError> {
    let ctx = Context {
        op: "handshake",
        peer: label.to_string(),
        rank: None,
        timeout: HANDSHAKE_TIMEOUT,
    };
    set_timeouts(stream, Some(HANDSHAKE_TIMEOUT)).map_err(|e| ctx.io(e))?;
    let refuse = |stream: &mut TcpStream, err: ParallelError| {
        // Best effort: the peer may already be gone; the error we return is what matters.
        let _ = write_frame(stream, FrameKind::Error, &[err.to_string().as_bytes()]);
        let _ = stream.flush();
        Err(err)
    };
    let frame = match read_frame(stream, MAX_HANDSHAKE_LEN) {
        Ok(frame) => frame,
        Err(e) => return refuse(stream, ctx.frame(e)),
    };
    if frame.kind != FrameKind::Hello {
        let err = ParallelError::frame(label, format!("expected Hello, got {:?}", frame.kind));
        return refuse(stream, err);
    }
    let hello = match Hello::decode(&frame.payload) {
        Ok(hello) => hello,
        Err(reason) => return refuse(stream, ParallelError::frame(label, reason)),
    };
    if !token.matches(&hello.token) {
        return refuse(
            stream,
            ParallelError::ForeignJob {
                from: label.to_string(),
            },
        );
    }
    if hello.role != role {
        let err = ParallelError::frame(
            label,
            format!("a {:?} connected to a {role:?} port", hello.role),
        );
        return refuse(stream, err);
    }
    let is_launcher = hello.rank == u32::MAX && launcher_allowed;
    if !is_launcher && hello.rank as usize >= rank_limit {
        let err = ParallelError::InvalidRank {
            op: "handshake",
            rank: hello.rank as usize,
            world_size: rank_limit,
        };
        return refuse(stream, err);
    }
    write_frame(stream, FrameKind::Welcome, &[]).map_err(|e| ctx.io(e))?;
    Ok(hello)
}
