//! A connection to the rendezvous store. Every call has a timeout; `wait` has its own.

use std::net::TcpStream;
use std::sync::Mutex;
use std::time::Duration;

use crate::error::{ParallelError, Result};
use crate::store::protocol::{MAX_STORE_FRAME, Request, Response};
use crate::token::JobToken;
use crate::wire::frame::{FrameKind, read_frame, write_frame};
use crate::wire::handshake::{Hello, Role, connect_handshake};
use crate::wire::socket::{Context, connect_with_retry, set_timeouts};

/// The rank number a launcher uses in its handshake.
pub const LAUNCHER_RANK: u32 = u32::MAX;

/// A client of the store; calls from several threads are serialised.
pub struct StoreClient {
    stream: Mutex<TcpStream>,
    addr: String,
    timeout: Duration,
}

impl std::fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl StoreClient {
    /// Connects to the store at `addr` as `rank` (a launcher passes [`LAUNCHER_RANK`]), retrying
    /// until `timeout`, which also bounds every later request.
    pub fn connect(
        addr: &str,
        token: &JobToken,
        rank: u32,
        timeout: Duration,
    ) -> Result<StoreClient> {
        let mut stream = connect_with_retry(addr, timeout)?;
        let ctx = Context {
            op: "store handshake",
            peer: format!("store {addr}"),
            rank: None,
            timeout,
        };
        connect_handshake(
            &mut stream,
            &Hello {
                role: Role::StoreClient,
                rank,
                token: token.as_str().as_bytes().to_vec(),
            },
            &ctx,
        )?;
        Ok(StoreClient {
            stream: Mutex::new(stream),
            addr: addr.to_string(),
            timeout,
        })
    }

    /// The store's address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn call(&self, op: &'static str, request: &Request, timeout: Duration) -> Result<Response> {
        let ctx = Context {
            op,
            peer: format!("store {}", self.addr),
            rank: None,
            timeout,
        };
        let mut stream = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        set_timeouts(&stream, Some(timeout)).map_err(|e| ctx.io(e))?;
        write_frame(&mut *stream, FrameKind::Request, &[&request.encode()])
            .map_err(|e| ctx.io(e))?;
        let frame = read_frame(&mut *stream, MAX_STORE_FRAME).map_err(|e| ctx.frame(e))?;
        match frame.kind {
            FrameKind::Response => Response::decode(&frame.payload)
                .map_err(|reason| ParallelError::frame(ctx.peer.clone(), reason)),
            FrameKind::Error => Err(ParallelError::Refused {
                from: ctx.peer,
                message: String::from_utf8_lossy(&frame.payload).into_owned(),
            }),
            other => Err(ParallelError::frame(
                ctx.peer,
                format!("{op}: expected a Response, got {other:?}"),
            )),
        }
    }

    fn unexpected(&self, op: &str, response: Response) -> ParallelError {
        ParallelError::frame(
            format!("store {}", self.addr),
            format!("{op}: unexpected response {response:?}"),
        )
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let request = Request::Set {
            key: key.into(),
            value: value.to_vec(),
        };
        match self.call("store set", &request, self.timeout)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected("set", other)),
        }
    }

    /// The value of `key`, or `None` if it is not set (does not wait).
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match self.call("store get", &Request::Get { key: key.into() }, self.timeout)? {
            Response::Value(v) => Ok(v),
            other => Err(self.unexpected("get", other)),
        }
    }

    /// Blocks until every key in `keys` is set, at most `timeout`.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let request = Request::Wait {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            timeout,
        };
        match self.call("store wait", &request, timeout + self.timeout)? {
            Response::Ok => Ok(()),
            Response::TimedOut => Err(ParallelError::StoreTimeout {
                keys: keys.iter().map(|k| k.to_string()).collect(),
                timeout,
            }),
            other => Err(self.unexpected("wait", other)),
        }
    }

    /// Waits for `key` and returns its value.
    pub fn wait_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        self.get(key)?.ok_or_else(|| ParallelError::StoreTimeout {
            keys: vec![key.to_string()],
            timeout,
        })
    }

    /// Adds `delta` to the counter `key` (missing = 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let request = Request::Add {
            key: key.into(),
            delta,
        };
        match self.call("store add", &request, self.timeout)? {
            Response::Int(v) => Ok(v),
            other => Err(self.unexpected("add", other)),
        }
    }

    /// Sets `desired` if the value is `expected` (`None`: absent); returns the value afterwards.
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        let request = Request::CompareSet {
            key: key.into(),
            expected: expected.map(<[u8]>::to_vec),
            desired: desired.to_vec(),
        };
        match self.call("store compare_set", &request, self.timeout)? {
            Response::Value(v) => Ok(v),
            other => Err(self.unexpected("compare_set", other)),
        }
    }

    /// Removes `key`; whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool> {
        match self.call(
            "store delete",
            &Request::Delete { key: key.into() },
            self.timeout,
        )? {
            Response::Bool(b) => Ok(b),
            other => Err(self.unexpected("delete", other)),
        }
    }

    /// Tells the store that `rank` is alive.
    pub fn heartbeat(&self, rank: usize) -> Result<()> {
        let request = Request::Heartbeat { rank: rank as u32 };
        match self.call("store heartbeat", &request, self.timeout)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected("heartbeat", other)),
        }
    }

    /// Tells the store that `rank` stopped on purpose (it is no longer expected to beat).
    pub fn goodbye(&self, rank: usize) -> Result<()> {
        let request = Request::Goodbye { rank: rank as u32 };
        match self.call("store goodbye", &request, self.timeout)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected("goodbye", other)),
        }
    }

    /// Ranks that have beaten before but not within `max_age`.
    pub fn silent_ranks(&self, max_age: Duration) -> Result<Vec<usize>> {
        match self.call("store silent", &Request::Silent { max_age }, self.timeout)? {
            Response::Ranks(r) => Ok(r.into_iter().map(|r| r as usize).collect()),
            other => Err(self.unexpected("silent", other)),
        }
    }
}
