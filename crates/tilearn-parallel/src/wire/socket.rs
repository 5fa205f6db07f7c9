//! Sockets: connecting with retries, and turning I/O and frame errors into errors that name the
//! operation and the peer.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::ParallelError;
use crate::wire::frame::FrameError;

/// Who is on the other end of a socket and what we were doing, for error messages.
#[derive(Debug, Clone)]
pub struct Context {
    pub op: &'static str,
    /// A human label: `rank 3` or `store 10.0.0.1:29500`.
    pub peer: String,
    /// The peer's rank when it is a rank (a closed connection then means that rank died).
    pub rank: Option<usize>,
    pub timeout: Duration,
}

impl Context {
    pub fn io(&self, e: io::Error) -> ParallelError {
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => match self.rank {
                Some(peer) => ParallelError::PeerLost { op: self.op, peer },
                None => ParallelError::io(
                    format!("{}: {} closed the connection", self.op, self.peer),
                    e,
                ),
            },
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ParallelError::Timeout {
                op: self.op,
                peer: self.peer.clone(),
                timeout: self.timeout,
            },
            _ => ParallelError::io(format!("{} with {}", self.op, self.peer), e),
        }
    }

    pub fn frame(&self, e: FrameError) -> ParallelError {
        match e {
            FrameError::Io(e) => self.io(e),
            FrameError::Malformed(reason) => {
                ParallelError::frame(self.peer.clone(), format!("{}: {reason}", self.op))
            }
            FrameError::TooLarge { len, max } => ParallelError::FrameTooLarge {
                from: self.peer.clone(),
                len,
                max,
            },
        }
    }
}

/// Resolves `host:port` to its first address.
pub fn resolve(addr: &str) -> Result<SocketAddr, ParallelError> {
    addr.to_socket_addrs()
        .map_err(|e| ParallelError::io(format!("cannot resolve {addr}"), e))?
        .next()
        .ok_or_else(|| {
            ParallelError::io(
                format!("cannot resolve {addr}"),
                io::Error::new(io::ErrorKind::NotFound, "no address"),
            )
        })
}

/// Connects to `addr`, retrying until `timeout` (the listener may not be up yet).
pub fn connect_with_retry(addr: &str, timeout: Duration) -> Result<TcpStream, ParallelError> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(10);
    loop {
        let last_error = match resolve(addr) {
            Ok(sockaddr) => {
                let left = deadline.saturating_duration_since(Instant::now());
                match TcpStream::connect_timeout(&sockaddr, left.max(Duration::from_millis(1))) {
                    Ok(stream) => {
                        stream
                            .set_nodelay(true)
                            .map_err(|e| ParallelError::io(format!("set_nodelay {addr}"), e))?;
                        return Ok(stream);
                    }
                    Err(e) => ParallelError::io(format!("cannot connect to {addr}"), e),
                }
            }
            Err(e) => e,
        };
        if Instant::now() + pause >= deadline {
            return Err(match last_error {
                ParallelError::Io { context, source } => ParallelError::Io {
                    context: format!("{context} within {} s", timeout.as_secs_f64()),
                    source,
                },
                other => other,
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// Sets both socket timeouts (`None` blocks forever).
pub fn set_timeouts(stream: &TcpStream, timeout: Option<Duration>) -> io::Result<()> {
    stream.set_read_timeout(timeout)?;
    stream.set_write_timeout(timeout)
}
