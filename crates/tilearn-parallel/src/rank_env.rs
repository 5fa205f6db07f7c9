//! Who this process is in a multi-process job, read from the environment that `tilearn launch`,
//! torchrun or Slurm's `srun` set up.
//!
//! * `tilearn launch`: torchrun's contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
//!   GROUP_RANK, MASTER_ADDR, MASTER_PORT) plus `TILEARN_LAUNCHER`, `TILEARN_STORE_ADDR` (the
//!   launcher's store), `TILEARN_JOB_TOKEN`, `TILEARN_RUN_ID`, `TILEARN_RESTART_COUNT`.
//! * torchrun (`torchrun --no-python tilearn train …`): the same contract. torchrun's agent already
//!   listens on MASTER_PORT, so rank 0 runs tilearn's store on MASTER_PORT + 1
//!   (`TILEARN_STORE_PORT` overrides).
//! * `srun`: SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NODEID, SLURM_JOB_NODELIST (first
//!   host = MASTER_ADDR unless set), SLURM_JOB_ID; recognised when a step id is set (inside `srun`,
//!   not in the batch script itself). MASTER_PORT defaults to 20000 + SLURM_JOB_ID mod 10000, and
//!   rank 0 runs the store there (`TILEARN_STORE_PORT` overrides).
//! * none of these: a single process.

use crate::error::{ParallelError, Result};
use crate::slurm::{expand_nodelist, expand_tasks_per_node};
use crate::token::{JobToken, TOKEN_ENV};

/// Set by `tilearn launch` in every rank it starts.
pub const LAUNCHER_ENV: &str = "TILEARN_LAUNCHER";
/// The store's `host:port`, set by `tilearn launch`.
pub const STORE_ADDR_ENV: &str = "TILEARN_STORE_ADDR";
/// Overrides the store port under torchrun and Slurm.
pub const STORE_PORT_ENV: &str = "TILEARN_STORE_PORT";
/// The run id `tilearn launch` gives its ranks.
pub const RUN_ID_ENV: &str = "TILEARN_RUN_ID";
/// How many times `tilearn launch` restarted the group.
pub const RESTART_ENV: &str = "TILEARN_RESTART_COUNT";

/// What started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    Tilearn,
    Torchrun,
    Slurm,
    /// Nobody: one process, world size 1.
    Single,
}

/// Who runs the rendezvous store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreHost {
    /// `tilearn launch` on node 0 (it outlives restarts and watches heartbeats).
    Launcher,
    /// Rank 0, in a thread (under torchrun and Slurm, and for a single process).
    Rank0,
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    pub launcher: Launcher,
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub local_world_size: usize,
    /// The node's index (torchrun's GROUP_RANK, Slurm's SLURM_NODEID).
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// `host:port` of the rendezvous store.
    pub store_addr: String,
    pub store_host: StoreHost,
    pub run_id: String,
    /// How many times the group was restarted before this attempt.
    pub restart: u32,
    pub token: JobToken,
}

struct Vars<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Vars<'_> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.is_empty())
    }

    fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    fn required(&self, name: &str, why: &str) -> Result<String> {
        self.get(name).ok_or_else(|| ParallelError::Env {
            var: name.into(),
            value: String::new(),
            reason: format!("not set ({why})"),
        })
    }

    fn number<T: std::str::FromStr>(&self, name: &str, why: &str) -> Result<T> {
        let value = self.required(name, why)?;
        value.trim().parse().map_err(|_| ParallelError::Env {
            var: name.into(),
            value: value.clone(),
            reason: "not a non-negative integer".into(),
        })
    }

    fn number_or<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T> {
        if self.has(name) {
            self.number(name, "")
        } else {
            Ok(default)
        }
    }
}

fn env_error(var: &str, value: impl ToString, reason: impl Into<String>) -> ParallelError {
    ParallelError::Env {
        var: var.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl RankEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<RankEnv> {
        Self::from_vars(&|name| std::env::var(name).ok())
    }

    /// Reads the variables `get` returns (tests pass a map).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<RankEnv> {
        let vars = Vars(get);
        let env = if vars.has(LAUNCHER_ENV) {
            Self::torchrun_contract(&vars, Launcher::Tilearn)?
        } else if vars.has("RANK") || vars.has("WORLD_SIZE") {
            Self::torchrun_contract(&vars, Launcher::Torchrun)?
        } else if vars.has("SLURM_PROCID")
            && (vars.has("SLURM_STEP_ID") || vars.has("SLURM_STEPID"))
        {
            Self::slurm(&vars)?
        } else {
            Self::single()
        };
        env.check()?;
        Ok(env)
    }

    /// A lone process: rank 0 of 1, with a store of its own on loopback.
    pub fn single() -> RankEnv {
        RankEnv {
            launcher: Launcher::Single,
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            store_addr: "127.0.0.1:0".into(),
            store_host: StoreHost::Rank0,
            run_id: "single".into(),
            restart: 0,
            token: JobToken::random(),
        }
    }

    fn torchrun_contract(vars: &Vars<'_>, launcher: Launcher) -> Result<RankEnv> {
        let contract = "part of torchrun's environment contract";
        let rank: usize = vars.number("RANK", contract)?;
        let world_size: usize = vars.number("WORLD_SIZE", contract)?;
        let local_rank = vars.number("LOCAL_RANK", contract)?;
        let local_world_size: usize = vars.number("LOCAL_WORLD_SIZE", contract)?;
        let node_rank = vars.number_or("GROUP_RANK", rank / local_world_size.max(1))?;
        let master_addr = vars.required("MASTER_ADDR", contract)?;
        let master_port: u16 = vars.number("MASTER_PORT", contract)?;
        let (store_addr, store_host, run_id, restart) = if launcher == Launcher::Tilearn {
            (
                vars.required(STORE_ADDR_ENV, "set by tilearn launch")?,
                StoreHost::Launcher,
                vars.get(RUN_ID_ENV).unwrap_or_else(|| "none".into()),
                vars.number_or(RESTART_ENV, 0)?,
            )
        } else {
            let default_port = master_port.checked_add(1).ok_or_else(|| {
                env_error(
                    "MASTER_PORT",
                    master_port,
                    "leaves no room for tilearn's store at +1",
                )
            })?;
            let store_port: u16 = vars.number_or(STORE_PORT_ENV, default_port)?;
            (
                format!("{}:{store_port}", bracket_ipv6(&master_addr)),
                StoreHost::Rank0,
                vars.get("TORCHELASTIC_RUN_ID")
                    .unwrap_or_else(|| "none".into()),
                vars.number_or("TORCHELASTIC_RESTART_COUNT", 0)?,
            )
        };
        let token = token(
            vars,
            &[&master_addr, &store_addr, &run_id, &world_size.to_string()],
        );
        Ok(RankEnv {
            launcher,
            rank,
            local_rank,
            world_size,
            local_world_size,
            node_rank,
            master_addr,
            master_port,
            store_addr,
            store_host,
            run_id,
            restart,
            token,
        })
    }

    fn slurm(vars: &Vars<'_>) -> Result<RankEnv> {
        let why = "set by srun";
        let rank = vars.number("SLURM_PROCID", why)?;
        let world_size: usize = vars.number("SLURM_NTASKS", why)?;
        let local_rank = vars.number("SLURM_LOCALID", why)?;
        let node_rank: usize = vars.number_or("SLURM_NODEID", 0)?;
        let local_world_size = if vars.has("SLURM_NTASKS_PER_NODE") {
            vars.number("SLURM_NTASKS_PER_NODE", why)?
        } else {
            let list = vars.required("SLURM_TASKS_PER_NODE", why)?;
            let counts = expand_tasks_per_node(&list)
                .map_err(|e| env_error("SLURM_TASKS_PER_NODE", &list, e))?;
            *counts.get(node_rank).ok_or_else(|| {
                env_error(
                    "SLURM_TASKS_PER_NODE",
                    &list,
                    format!("has no entry for node {node_rank}"),
                )
            })?
        };
        let job_id = vars.required("SLURM_JOB_ID", why)?;
        let step = vars
            .get("SLURM_STEP_ID")
            .or_else(|| vars.get("SLURM_STEPID"))
            .unwrap_or_default();
        let master_addr = match vars.get("MASTER_ADDR") {
            Some(addr) => addr,
            None => {
                let name = if vars.has("SLURM_STEP_NODELIST") {
                    "SLURM_STEP_NODELIST"
                } else {
                    "SLURM_JOB_NODELIST"
                };
                let list = vars.required(name, why)?;
                expand_nodelist(&list)
                    .map_err(|e| env_error(name, &list, e))?
                    .swap_remove(0)
            }
        };
        let master_port: u16 = match vars.get("MASTER_PORT") {
            Some(_) => vars.number("MASTER_PORT", "")?,
            None => {
                let id: u64 = job_id
                    .parse()
                    .map_err(|_| env_error("SLURM_JOB_ID", &job_id, "not a number"))?;
                20_000 + (id % 10_000) as u16
            }
        };
        let store_port: u16 = vars.number_or(STORE_PORT_ENV, master_port)?;
        let store_addr = format!("{}:{store_port}", bracket_ipv6(&master_addr));
        let run_id = format!("slurm-{job_id}.{step}");
        let token = token(
            vars,
            &[&master_addr, &store_addr, &run_id, &world_size.to_string()],
        );
        Ok(RankEnv {
            launcher: Launcher::Slurm,
            rank,
            local_rank,
            world_size,
            local_world_size,
            node_rank,
            master_addr,
            master_port,
            store_addr,
            store_host: StoreHost::Rank0,
            run_id,
            restart: vars.number_or("SLURM_RESTART_COUNT", 0)?,
            token,
        })
    }

    fn check(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(env_error("WORLD_SIZE", 0, "must be at least 1"));
        }
        if self.rank >= self.world_size {
            return Err(env_error(
                "RANK",
                self.rank,
                format!("must be below WORLD_SIZE={}", self.world_size),
            ));
        }
        if self.local_rank >= self.local_world_size.max(1) {
            return Err(env_error(
                "LOCAL_RANK",
                self.local_rank,
                format!("must be below LOCAL_WORLD_SIZE={}", self.local_world_size),
            ));
        }
        Ok(())
    }

    /// Whether more than one process takes part.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// The prefix of this attempt's keys in the store (a restart must not see old addresses).
    pub fn key_prefix(&self) -> String {
        format!("{}/attempt{}", self.run_id, self.restart)
    }
}

fn token(vars: &Vars<'_>, parts: &[&str]) -> JobToken {
    vars.get(TOKEN_ENV)
        .and_then(|t| JobToken::from_value(&t))
        .unwrap_or_else(|| JobToken::derive(parts))
}

/// `::1` → `[::1]`, so that `host:port` parses; names and IPv4 addresses are unchanged.
pub fn bracket_ipv6(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}
