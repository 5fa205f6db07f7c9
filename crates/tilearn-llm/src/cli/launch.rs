//! `tilearn launch`: runs a tilearn subcommand (`tilearn launch … train …`) or any program
//! (`tilearn launch … -- PROGRAM ARGS…`) as N ranks per node, with torchrun's flags (both
//! spellings) and environment contract. The launcher itself is `tilearn_parallel::launch`.

use std::ffi::OsString;
use std::time::Duration;

use clap::Args;
use tilearn_parallel::launch::{DEFAULT_MASTER_PORT, LaunchConfig, Program};

use crate::{LlmError, Result};

/// The subcommands `tilearn launch` runs from this executable; any other word is a program.
const SUBCOMMANDS: [&str; 6] = ["train", "eval", "bench", "prepare-data", "info", "ctr"];

#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Ranks on this node: a number, or `gpu`/`auto` for one per visible CUDA device.
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", default_value = "1")]
    pub nproc_per_node: String,
    /// Number of nodes (a fixed number; elastic `MIN:MAX` ranges are not supported).
    #[arg(long, default_value = "1")]
    pub nnodes: String,
    /// This node's index, 0..nnodes.
    #[arg(long = "node-rank", alias = "node_rank", default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0, where the rendezvous store runs.
    #[arg(
        long = "master-addr",
        alias = "master_addr",
        default_value = "127.0.0.1"
    )]
    pub master_addr: String,
    /// Port of the rendezvous store on node 0.
    #[arg(long = "master-port", alias = "master_port", default_value_t = DEFAULT_MASTER_PORT)]
    pub master_port: u16,
    /// One node on loopback with a free port.
    #[arg(long)]
    pub standalone: bool,
    /// Restart the whole group this many times after a failure.
    #[arg(long = "max-restarts", alias = "max_restarts", default_value_t = 0)]
    pub max_restarts: u32,
    /// Job id shared by every node (keeps jobs on the same store apart).
    #[arg(long = "rdzv-id", alias = "rdzv_id", default_value = "none")]
    pub rdzv_id: String,
    /// Seconds a collective may make no progress before the rank fails.
    #[arg(long = "comm-timeout", default_value_t = 600.0)]
    pub comm_timeout: f64,
    /// Seconds a rank may go without a heartbeat before the job is stopped.
    #[arg(long = "heartbeat-timeout", default_value_t = 60.0)]
    pub heartbeat_timeout: f64,
    /// `train [TRAIN FLAGS]` (a tilearn subcommand) or `-- PROGRAM ARGS…`.
    #[arg(required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<OsString>,
}

fn usage(flag: &str, message: impl Into<String>) -> LlmError {
    LlmError::Usage {
        flag: flag.into(),
        message: message.into(),
    }
}

fn seconds(flag: &str, value: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| usage(flag, format!("{value} is not a positive number of seconds")))
}

fn nproc_per_node(value: &str) -> Result<usize> {
    match value {
        "gpu" | "auto" => {
            let devices = tilearn_ops::backend::probe().devices.len();
            if devices == 0 {
                Err(usage(
                    "--nproc-per-node",
                    format!("{value}: no CUDA device is visible"),
                ))
            } else {
                Ok(devices)
            }
        }
        n => n.parse().map_err(|_| {
            usage(
                "--nproc-per-node",
                format!("{n:?} is not a number, `gpu` or `auto`"),
            )
        }),
    }
}

impl LaunchArgs {
    fn config(&self) -> Result<LaunchConfig> {
        let nnodes = self.nnodes.parse().map_err(|_| {
            usage(
                "--nnodes",
                format!(
                    "{:?}: only a fixed number of nodes is supported",
                    self.nnodes
                ),
            )
        })?;
        Ok(LaunchConfig {
            nproc_per_node: nproc_per_node(&self.nproc_per_node)?,
            nnodes,
            node_rank: self.node_rank,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
            standalone: self.standalone,
            max_restarts: self.max_restarts,
            run_id: self.rdzv_id.clone(),
            comm_timeout: seconds("--comm-timeout", self.comm_timeout)?,
            heartbeat_timeout: seconds("--heartbeat-timeout", self.heartbeat_timeout)?,
            ..LaunchConfig::default()
        })
    }

    fn program(&self) -> Result<Program> {
        let Some((first, rest)) = self.command.split_first() else {
            return Err(usage(
                "launch",
                "name a subcommand (`train …`) or `-- PROGRAM ARGS…`",
            ));
        };
        Ok(if SUBCOMMANDS.iter().any(|s| first == s) {
            Program::CurrentExe(self.command.clone())
        } else {
            Program::External {
                program: first.clone(),
                args: rest.to_vec(),
            }
        })
    }
}

pub fn run(args: LaunchArgs) -> Result<()> {
    tilearn_parallel::launch::launch(args.config()?, &args.program()?)?;
    Ok(())
}
