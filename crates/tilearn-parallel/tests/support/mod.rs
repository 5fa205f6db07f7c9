//! Helpers for the in-process tests: a store on loopback and one thread per rank, each with its
//! own host communicator over loopback sockets.

#![allow(dead_code)]

use std::time::Duration;

use tilearn_parallel::JobToken;
use tilearn_parallel::host::{HostCommunicator, MeshOptions};
use tilearn_parallel::store::{StoreClient, StoreServer};

/// Runs `body(rank, communicator)` on `world_size` threads joined into one host communicator
/// (timeout `timeout`) and returns their results in rank order.
pub fn with_group<R: Send>(
    world_size: usize,
    timeout: Duration,
    body: impl Fn(usize, HostCommunicator) -> R + Sync,
) -> Vec<R> {
    let token = JobToken::random();
    let server = StoreServer::bind("127.0.0.1:0", token.clone(), world_size).expect("store");
    let addr = server.local_addr().to_string();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let (addr, token, body) = (&addr, &token, &body);
                scope.spawn(move || {
                    let store =
                        StoreClient::connect(addr, token, rank as u32, Duration::from_secs(10))
                            .expect("store client");
                    let options = MeshOptions {
                        rank,
                        world_size,
                        listen_host: "127.0.0.1".into(),
                        token: token.clone(),
                        timeout,
                        key_prefix: "test".into(),
                    };
                    let comm = HostCommunicator::connect(&store, &options).expect("mesh");
                    body(rank, comm)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// The binary to run: `$TILEARN_BIN_DIR/<name>` when set (the GPU machine runs bundled test
/// executables, where Cargo's build path does not exist), else the one Cargo built for the test.
#[allow(dead_code)] // not every test binary that includes this module launches a program
pub fn bin(name: &str, cargo_built: &str) -> std::ffi::OsString {
    match std::env::var_os("TILEARN_BIN_DIR") {
        Some(dir) => std::path::Path::new(&dir).join(name).into_os_string(),
        None => cargo_built.into(),
    }
}
