//! The rendezvous store's server: a key-value map behind a TCP listener, one thread per admitted
//! connection. It binds only the address it is given, admits only connections with the job token,
//! bounds every frame, and answers a malformed request with an error frame.

use std::collections::{HashMap, HashSet};
use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{ParallelError, Result};
use crate::store::protocol::{MAX_STORE_FRAME, Request, Response};
use crate::token::JobToken;
use crate::wire::frame::{FrameError, FrameKind, read_frame, write_frame};
use crate::wire::handshake::{Role, accept_handshake};
use crate::wire::socket::set_timeouts;

/// The most entries the store holds (a bound on what a buggy client can make it allocate).
const MAX_ENTRIES: usize = 1 << 16;
/// How often the accept loop looks at the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    heartbeats: HashMap<u32, Instant>,
    finished: HashSet<u32>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
    token: JobToken,
    world_size: usize,
    max_connections: usize,
    live_connections: AtomicUsize,
    /// Clones of the admitted sockets by connection number, shut down on drop to end their
    /// threads; each thread removes its own when it ends.
    sockets: Mutex<HashMap<u64, TcpStream>>,
    next_connection: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic in another connection thread cannot leave the map half-updated (each request
        // is one insert or remove), so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A running store; dropping it stops the listener and closes every connection.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl StoreServer {
    /// Listens on `addr` (`host:port`; port 0 picks a free one) for the ranks `0..world_size`
    /// of the job with `token`, and for launchers.
    pub fn bind(addr: &str, token: JobToken, world_size: usize) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            ParallelError::io(
                format!("rendezvous store cannot listen on {addr} (is the port in use, or is this not the MASTER_ADDR node?)"),
                e,
            )
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| ParallelError::io("rendezvous store address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| ParallelError::io("rendezvous store listener", e))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            token,
            world_size,
            // Every rank opens two connections (requests and heartbeats) and each launcher one;
            // the rest is headroom for restarts whose old sockets are still closing.
            max_connections: 4 * world_size + 64,
            live_connections: AtomicUsize::new(0),
            sockets: Mutex::new(HashMap::new()),
            next_connection: AtomicU64::new(0),
        });
        let accept_shared = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("tilearn-store".into())
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|e| ParallelError::io("starting the rendezvous store thread", e))?;
        Ok(StoreServer {
            addr: local,
            shared,
            accept: Some(accept),
        })
    }

    /// The address it listens on (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        for socket in self
            .shared
            .sockets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            // Ends the connection thread's blocking read; an error means it is already closed.
            let _ = socket.shutdown(Shutdown::Both);
        }
        if let Some(accept) = self.accept.take() {
            // The accept loop only returns; a panic in it has already been reported.
            let _ = accept.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                if shared.live_connections.load(Ordering::SeqCst) >= shared.max_connections {
                    continue; // dropped: closes the connection
                }
                if stream.set_nonblocking(false).is_err() {
                    continue;
                }
                shared.live_connections.fetch_add(1, Ordering::SeqCst);
                let conn_shared = Arc::clone(&shared);
                let spawned = std::thread::Builder::new()
                    .name("tilearn-store-conn".into())
                    .spawn(move || {
                        serve_connection(stream, peer, &conn_shared);
                        conn_shared.live_connections.fetch_sub(1, Ordering::SeqCst);
                    });
                if spawned.is_err() {
                    shared.live_connections.fetch_sub(1, Ordering::SeqCst);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(ACCEPT_POLL),
            Err(_) => std::thread::sleep(ACCEPT_POLL),
        }
    }
}

fn serve_connection(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    let label = format!("store client {peer}");
    if accept_handshake(
        &mut stream,
        &shared.token,
        Role::StoreClient,
        shared.world_size,
        true,
        &label,
    )
    .is_err()
    {
        return; // refused with an error frame; nothing else to do
    }
    // An admitted client may stay idle for a whole training run: no read timeout.
    if set_timeouts(&stream, None).is_err() {
        return;
    }
    let id = shared.next_connection.fetch_add(1, Ordering::SeqCst);
    if let Ok(clone) = stream.try_clone() {
        shared
            .sockets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, clone);
    }
    serve_requests(&mut stream, shared);
    shared
        .sockets
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&id);
    // Closes the connection for the peer even while the clone was alive.
    let _ = stream.shutdown(Shutdown::Both);
}

/// Answers requests until the client leaves, the stream's framing is lost, or the store stops.
fn serve_requests(stream: &mut TcpStream, shared: &Shared) {
    while !shared.stop.load(Ordering::SeqCst) {
        let frame = match read_frame(stream, MAX_STORE_FRAME) {
            Ok(frame) => frame,
            Err(FrameError::Io(_)) => return, // closed or shut down
            Err(e) => {
                // The stream's framing is lost: say why and close.
                let message = match e {
                    FrameError::Malformed(m) => m,
                    FrameError::TooLarge { len, max } => {
                        format!("frame of {len} bytes is over the store's limit of {max}")
                    }
                    FrameError::Io(_) => unreachable!("handled above"),
                };
                let _ = write_frame(stream, FrameKind::Error, &[message.as_bytes()]);
                return;
            }
        };
        let reply = if frame.kind != FrameKind::Request {
            Err(format!("expected a Request frame, got {:?}", frame.kind))
        } else {
            Request::decode(&frame.payload).and_then(|request| handle(shared, request))
        };
        let written = match reply {
            Ok(response) => write_frame(stream, FrameKind::Response, &[&response.encode()]),
            Err(message) => write_frame(stream, FrameKind::Error, &[message.as_bytes()]),
        };
        if written.is_err() {
            return;
        }
    }
}

fn handle(shared: &Shared, request: Request) -> std::result::Result<Response, String> {
    let mut state = shared.lock();
    let full =
        |state: &State, key: &str| state.map.len() >= MAX_ENTRIES && !state.map.contains_key(key);
    let response = match request {
        Request::Set { key, value } => {
            if full(&state, &key) {
                return Err(format!("the store is full ({MAX_ENTRIES} keys)"));
            }
            state.map.insert(key, value);
            shared.changed.notify_all();
            Response::Ok
        }
        Request::Get { key } => Response::Value(state.map.get(&key).cloned()),
        Request::Wait { keys, timeout } => {
            let deadline = Instant::now() + timeout;
            loop {
                if keys.iter().all(|k| state.map.contains_key(k)) {
                    break Response::Ok;
                }
                let now = Instant::now();
                if now >= deadline || shared.stop.load(Ordering::SeqCst) {
                    break Response::TimedOut;
                }
                state = shared
                    .changed
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        Request::Add { key, delta } => {
            if full(&state, &key) {
                return Err(format!("the store is full ({MAX_ENTRIES} keys)"));
            }
            let current = match state.map.get(&key) {
                None => 0,
                Some(bytes) => std::str::from_utf8(bytes)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| format!("add on {key:?}, whose value is not an integer"))?,
            };
            let new = current
                .checked_add(delta)
                .ok_or_else(|| format!("add on {key:?} overflows i64"))?;
            state.map.insert(key, new.to_string().into_bytes());
            shared.changed.notify_all();
            Response::Int(new)
        }
        Request::CompareSet {
            key,
            expected,
            desired,
        } => {
            if full(&state, &key) {
                return Err(format!("the store is full ({MAX_ENTRIES} keys)"));
            }
            if state.map.get(&key) == expected.as_ref() {
                state.map.insert(key.clone(), desired);
                shared.changed.notify_all();
            }
            Response::Value(state.map.get(&key).cloned())
        }
        Request::Delete { key } => Response::Bool(state.map.remove(&key).is_some()),
        Request::Heartbeat { rank } => {
            state.heartbeats.insert(rank, Instant::now());
            state.finished.remove(&rank);
            Response::Ok
        }
        Request::Goodbye { rank } => {
            state.finished.insert(rank);
            Response::Ok
        }
        Request::Silent { max_age } => {
            let now = Instant::now();
            let mut silent: Vec<u32> = state
                .heartbeats
                .iter()
                .filter(|(rank, last)| {
                    !state.finished.contains(rank) && now.duration_since(**last) > max_age
                })
                .map(|(&rank, _)| rank)
                .collect();
            silent.sort_unstable();
            Response::Ranks(silent)
        }
    };
    Ok(response)
}
