//! A group of ranks inside one process: one thread per rank, each with its own host
//! communicator over loopback sockets and a store on an ephemeral port. The same transport as
//! between processes, so tests of anything built on a [`Communicator`](crate::Communicator)
//! (tensor and pipeline parallelism) run without launching processes.

use std::time::Duration;

use super::{HostCommunicator, MeshOptions};
use crate::error::Result;
use crate::store::{StoreClient, StoreServer};
use crate::token::JobToken;

/// Runs `body(rank, communicator)` on `world_size` threads joined into one group (collectives
/// time out after `timeout`) and returns their results in rank order. A thread that panics
/// makes this panic (after the others finish or time out).
pub fn run_on_threads<T: Send>(
    world_size: usize,
    timeout: Duration,
    body: impl Fn(usize, HostCommunicator) -> T + Sync,
) -> Result<Vec<T>> {
    let token = JobToken::random();
    let server = StoreServer::bind("127.0.0.1:0", token.clone(), world_size)?;
    let addr = server.local_addr().to_string();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (addr, token, body) = (&addr, &token, &body);
                scope.spawn(move || -> Result<T> {
                    let store = StoreClient::connect(addr, token, rank as u32, timeout)?;
                    let options = MeshOptions {
                        rank,
                        world_size,
                        listen_host: "127.0.0.1".into(),
                        token: token.clone(),
                        timeout,
                        key_prefix: "threads".into(),
                    };
                    let comm = HostCommunicator::connect(&store, &options)?;
                    Ok(body(rank, comm))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}
