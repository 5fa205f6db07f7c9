//! What `tilearn launch` runs and how: torchrun's flags as a plain struct.

use std::ffi::OsString;
use std::time::Duration;

use crate::communicator::DEFAULT_TIMEOUT;
use crate::error::{ParallelError, Result};
use crate::process_group::DEFAULT_HEARTBEAT_TIMEOUT;

/// torchrun's default MASTER_PORT.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The launcher's settings (torchrun's names and defaults, plus tilearn's timeouts).
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchConfig {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// One node on loopback with a free port (torchrun's `--standalone`).
    pub standalone: bool,
    /// How many times the whole group is restarted after a failure.
    pub max_restarts: u32,
    /// Identifies the job; every node must use the same.
    pub run_id: String,
    /// Passed to the ranks as their communication timeout.
    pub comm_timeout: Duration,
    /// A rank silent for this long ends the job.
    pub heartbeat_timeout: Duration,
    /// How often the launcher looks at its ranks.
    pub monitor_interval: Duration,
    /// After the first failure, how long the other ranks get to exit by themselves.
    pub exit_grace: Duration,
    /// After SIGTERM, how long before SIGKILL.
    pub kill_grace: Duration,
}

impl Default for LaunchConfig {
    fn default() -> Self {
        LaunchConfig {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            standalone: false,
            max_restarts: 0,
            run_id: "none".into(),
            comm_timeout: DEFAULT_TIMEOUT,
            heartbeat_timeout: DEFAULT_HEARTBEAT_TIMEOUT,
            monitor_interval: Duration::from_millis(50),
            exit_grace: Duration::from_secs(2),
            kill_grace: Duration::from_secs(5),
        }
    }
}

impl LaunchConfig {
    /// Checks the flags against each other and applies `--standalone`.
    pub fn validated(mut self) -> Result<LaunchConfig> {
        let usage = |flag: &str, reason: String| ParallelError::Usage {
            flag: flag.into(),
            reason,
        };
        if self.nproc_per_node == 0 {
            return Err(usage("--nproc-per-node", "must be at least 1".into()));
        }
        if self.nnodes == 0 {
            return Err(usage("--nnodes", "must be at least 1".into()));
        }
        if self.standalone {
            if self.nnodes != 1 {
                return Err(usage(
                    "--standalone",
                    format!("runs one node, but --nnodes is {}", self.nnodes),
                ));
            }
            self.master_addr = "127.0.0.1".into();
            self.master_port = 0;
        }
        if self.node_rank >= self.nnodes {
            return Err(usage(
                "--node-rank",
                format!("{} is not below --nnodes {}", self.node_rank, self.nnodes),
            ));
        }
        if self.master_port == 0 && self.nnodes > 1 {
            return Err(usage(
                "--master-port",
                "0 (pick a free port) only works on one node".into(),
            ));
        }
        Ok(self)
    }

    pub fn world_size(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }
}

/// What every rank runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Program {
    /// This executable with these arguments (`tilearn launch … train …`).
    CurrentExe(Vec<OsString>),
    /// Any program (`tilearn launch … -- PROGRAM ARGS…`).
    External {
        program: OsString,
        args: Vec<OsString>,
    },
}
