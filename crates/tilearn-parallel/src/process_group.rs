//! `ProcessGroup`: a rank's entry into the job. It starts or joins the rendezvous store, starts the
//! heartbeat, and creates communicators. This is what a trainer calls first:
//!
//! ```no_run
//! use tilearn_parallel::{Communicator, ProcessGroup, ReduceOp};
//! let group = ProcessGroup::from_env()?;
//! let comm = group.host_communicator()?;
//! let mut grads = vec![1.0f32; 1000];
//! comm.all_reduce((&mut grads).into(), ReduceOp::Avg)?.wait()?;
//! # Ok::<(), tilearn_parallel::ParallelError>(())
//! ```

use std::net::{IpAddr, UdpSocket};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::communicator::DEFAULT_TIMEOUT;
use crate::error::{ParallelError, Result};
use crate::failure::{FailureReport, write_report};
use crate::heartbeat::Heartbeat;
use crate::host::{HostCommunicator, MeshOptions};
use crate::rank_env::{Launcher, RankEnv, StoreHost};
use crate::store::{StoreClient, StoreServer};
use crate::wire::socket::resolve;

/// The communication timeout in seconds, set by `tilearn launch --comm-timeout`.
pub const COMM_TIMEOUT_ENV: &str = "TILEARN_COMM_TIMEOUT";
/// The heartbeat timeout in seconds, set by `tilearn launch --heartbeat-timeout`.
pub const HEARTBEAT_TIMEOUT_ENV: &str = "TILEARN_HEARTBEAT_TIMEOUT";
/// The local address the host communicator listens on (default: the interface that reaches
/// MASTER_ADDR).
pub const COMM_HOST_ENV: &str = "TILEARN_COMM_HOST";
/// The default heartbeat timeout.
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(60);

/// Timeouts of a process group.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupOptions {
    /// How long a collective or a store wait may make no progress.
    pub timeout: Duration,
    /// How long a rank may go without a heartbeat before the job is ended.
    pub heartbeat_timeout: Duration,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            timeout: DEFAULT_TIMEOUT,
            heartbeat_timeout: DEFAULT_HEARTBEAT_TIMEOUT,
        }
    }
}

fn seconds(var: &str, default: Duration) -> Result<Duration> {
    match std::env::var(var) {
        Err(_) => Ok(default),
        Ok(value) => value
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| ParallelError::Env {
                var: var.into(),
                value,
                reason: "not a positive number of seconds".into(),
            }),
    }
}

impl GroupOptions {
    /// The defaults, overridden by [`COMM_TIMEOUT_ENV`] and [`HEARTBEAT_TIMEOUT_ENV`].
    pub fn from_env() -> Result<GroupOptions> {
        Ok(GroupOptions {
            timeout: seconds(COMM_TIMEOUT_ENV, DEFAULT_TIMEOUT)?,
            heartbeat_timeout: seconds(HEARTBEAT_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT)?,
        })
    }
}

/// A rank's membership in the job: the store connection, the heartbeat, and (when rank 0 hosts
/// it) the store itself.
pub struct ProcessGroup {
    env: RankEnv,
    options: GroupOptions,
    store: StoreClient,
    store_addr: String,
    _heartbeat: Heartbeat,
    // Declared last: dropped after the heartbeat has said goodbye.
    _server: Option<StoreServer>,
    communicators: AtomicU32,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("env", &self.env)
            .finish_non_exhaustive()
    }
}

impl ProcessGroup {
    /// Joins the job described by the environment, with timeouts from the environment.
    pub fn from_env() -> Result<ProcessGroup> {
        ProcessGroup::init(RankEnv::from_env()?, GroupOptions::from_env()?)
    }

    /// Joins the job described by `env`.
    pub fn init(env: RankEnv, options: GroupOptions) -> Result<ProcessGroup> {
        let hosts_store = env.store_host == StoreHost::Rank0 && env.rank == 0;
        let server = if hosts_store {
            Some(StoreServer::bind(
                &env.store_addr,
                env.token.clone(),
                env.world_size,
            )?)
        } else {
            None
        };
        // Port 0 (a single process) means the port the server picked.
        let store_addr = match &server {
            Some(s) => s.local_addr().to_string(),
            None => env.store_addr.clone(),
        };
        let rank = env.rank as u32;
        let store = StoreClient::connect(&store_addr, &env.token, rank, options.timeout)?;
        let beat_store = StoreClient::connect(&store_addr, &env.token, rank, options.timeout)?;
        // Under tilearn launch the launcher watches heartbeats; otherwise the store's host does.
        let watch = hosts_store && env.launcher != Launcher::Tilearn;
        let heartbeat = Heartbeat::start(beat_store, env.rank, options.heartbeat_timeout, watch);
        Ok(ProcessGroup {
            env,
            options,
            store,
            store_addr,
            _heartbeat: heartbeat,
            _server: server,
            communicators: AtomicU32::new(0),
        })
    }

    pub fn env(&self) -> &RankEnv {
        &self.env
    }

    pub fn rank(&self) -> usize {
        self.env.rank
    }

    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    pub fn options(&self) -> GroupOptions {
        self.options
    }

    /// The connection to the rendezvous store (for exchanging ids and small values).
    pub fn store(&self) -> &StoreClient {
        &self.store
    }

    /// A store key private to this attempt of the job and to `name`.
    pub fn key(&self, name: &str) -> String {
        format!("{}/{name}", self.env.key_prefix())
    }

    /// A fresh key namespace for the next communicator (every rank creates them in the same order).
    pub(crate) fn next_communicator_key(&self, backend: &str) -> String {
        let n = self.communicators.fetch_add(1, Ordering::SeqCst);
        self.key(&format!("{backend}{n}"))
    }

    /// Joins a host (TCP) communicator of all ranks. Collective: every rank calls it.
    pub fn host_communicator(&self) -> Result<HostCommunicator> {
        let options = MeshOptions {
            rank: self.env.rank,
            world_size: self.env.world_size,
            listen_host: listen_host(&self.store_addr)?,
            token: self.env.token.clone(),
            timeout: self.options.timeout,
            key_prefix: self.next_communicator_key("host"),
        };
        HostCommunicator::connect(&self.store, &options)
    }

    /// Records why this rank fails for the launcher's summary; whether the report reached the
    /// store. `secondary`: the failure is a consequence of another rank's (a lost or silent peer).
    pub fn report_failure(&self, message: &str, secondary: bool) -> bool {
        let report = FailureReport {
            rank: self.env.rank,
            secondary,
            message: message.to_string(),
        };
        write_report(&self.store, &self.env.key_prefix(), &report).is_ok()
    }

    /// How a rank ends with an error: under `tilearn launch` it reports to the launcher, which
    /// prints one line for the whole job; otherwise (or if the report fails) it prints
    /// `error: MESSAGE` itself.
    pub fn report_or_print(&self, message: &str, secondary: bool) {
        let reported =
            self.env.launcher == Launcher::Tilearn && self.report_failure(message, secondary);
        if !reported {
            eprintln!("error: {message}");
        }
    }
}

/// The local address other ranks reach this one on: [`COMM_HOST_ENV`] if set, loopback when the
/// store is on loopback, else the address of the interface that routes to the store.
fn listen_host(store_addr: &str) -> Result<String> {
    if let Ok(host) = std::env::var(COMM_HOST_ENV) {
        return Ok(host);
    }
    let store = resolve(store_addr)?;
    if store.ip().is_loopback() {
        return Ok(store.ip().to_string());
    }
    // Connecting a UDP socket sends nothing; it only asks the kernel for the route.
    let unspecified = if store.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let local: IpAddr = UdpSocket::bind(unspecified)
        .and_then(|s| s.connect(store).and_then(|()| s.local_addr()))
        .map(|a| a.ip())
        .map_err(|e| {
            ParallelError::io(
                format!("finding the interface that reaches {store_addr}"),
                e,
            )
        })?;
    Ok(local.to_string())
}
