//! The launcher's loop: start the node's ranks, watch exits, heartbeats and the other nodes, stop
//! everything on the first failure, name one rank as the cause, restart the group if allowed.

use std::time::{Duration, Instant};

use crate::error::{ParallelError, Result};
use crate::failure::{FailureReport, read_reports};
use crate::launch::child::{RankProcess, spawn};
use crate::launch::config::{LaunchConfig, Program};
use crate::launch::signals;
use crate::process_group::{COMM_TIMEOUT_ENV, HEARTBEAT_TIMEOUT_ENV};
use crate::rank_env::{LAUNCHER_ENV, RESTART_ENV, RUN_ID_ENV, STORE_ADDR_ENV, bracket_ipv6};
use crate::store::{LAUNCHER_RANK, StoreClient, StoreServer};
use crate::token::{JobToken, TOKEN_ENV};

/// The job's store as this launcher sees it.
struct JobStore {
    client: StoreClient,
    addr: String,
    port: u16,
    token: JobToken,
    /// Node 0's launcher runs the store; it lives as long as the launcher (across restarts).
    _server: Option<StoreServer>,
}

/// Runs the job: `config.nproc_per_node` ranks of `program` on this node.
pub fn launch(config: LaunchConfig, program: &Program) -> Result<()> {
    let config = config.validated()?;
    signals::install();
    let store = open_store(&config)?;
    let mut restart = 0;
    loop {
        match run_attempt(&config, program, &store, restart) {
            Ok(()) => return Ok(()),
            Err(e @ ParallelError::Interrupted { .. }) => return Err(e),
            Err(e) if restart < config.max_restarts => {
                restart += 1;
                eprintln!(
                    "tilearn launch: {e}; restarting the group (restart {restart} of {})",
                    config.max_restarts
                );
            }
            Err(e) => return Err(e),
        }
    }
}

fn open_store(config: &LaunchConfig) -> Result<JobStore> {
    let token = match std::env::var(TOKEN_ENV)
        .ok()
        .and_then(|t| JobToken::from_value(&t))
    {
        Some(token) => token,
        // One node: nobody else needs to know the token. Several: every launcher must agree.
        None if config.nnodes == 1 => JobToken::random(),
        None => JobToken::derive(&[
            &config.master_addr,
            &config.master_port.to_string(),
            &config.run_id,
            &config.world_size().to_string(),
        ]),
    };
    let host = bracket_ipv6(&config.master_addr);
    let (server, port) = if config.node_rank == 0 {
        let server = StoreServer::bind(
            &format!("{host}:{}", config.master_port),
            token.clone(),
            config.world_size(),
        )?;
        let port = server.local_addr().port();
        (Some(server), port)
    } else {
        (None, config.master_port)
    };
    let addr = format!("{host}:{port}");
    let client = StoreClient::connect(&addr, &token, LAUNCHER_RANK, config.comm_timeout)?;
    Ok(JobStore {
        client,
        addr,
        port,
        token,
        _server: server,
    })
}

/// The environment of one rank: torchrun's contract plus tilearn's variables.
fn rank_env(
    config: &LaunchConfig,
    store: &JobStore,
    restart: u32,
    local_rank: usize,
) -> Vec<(String, String)> {
    let rank = config.node_rank * config.nproc_per_node + local_rank;
    let mut env: Vec<(String, String)> = [
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("WORLD_SIZE", config.world_size().to_string()),
        ("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string()),
        ("GROUP_RANK", config.node_rank.to_string()),
        ("ROLE_RANK", rank.to_string()),
        ("MASTER_ADDR", config.master_addr.clone()),
        ("MASTER_PORT", store.port.to_string()),
        (LAUNCHER_ENV, "1".into()),
        (STORE_ADDR_ENV, store.addr.clone()),
        (TOKEN_ENV, store.token.as_str().into()),
        (RUN_ID_ENV, config.run_id.clone()),
        (RESTART_ENV, restart.to_string()),
        (
            COMM_TIMEOUT_ENV,
            config.comm_timeout.as_secs_f64().to_string(),
        ),
        (
            HEARTBEAT_TIMEOUT_ENV,
            config.heartbeat_timeout.as_secs_f64().to_string(),
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if std::env::var_os("OMP_NUM_THREADS").is_none() {
        env.push(("OMP_NUM_THREADS".into(), "1".into()));
    }
    env
}

/// What made the launcher stop the group.
#[derive(Debug)]
enum Trigger {
    /// A local rank exited unsuccessfully (details come from its exit status and reports).
    Exit,
    /// A rank stopped sending heartbeats.
    Silent(usize),
    /// Another node's launcher stopped the job.
    Remote(String),
}

fn run_attempt(
    config: &LaunchConfig,
    program: &Program,
    store: &JobStore,
    restart: u32,
) -> Result<()> {
    let prefix = format!("{}/attempt{restart}", config.run_id);
    let abort_key = format!("{prefix}/abort");
    let mut ranks = Vec::with_capacity(config.nproc_per_node);
    for local_rank in 0..config.nproc_per_node {
        let env = rank_env(config, store, restart, local_rank);
        match spawn(
            program,
            config.node_rank * config.nproc_per_node + local_rank,
            &env,
        ) {
            Ok(process) => ranks.push(process),
            Err(e) => {
                stop(&mut ranks, config);
                return Err(e);
            }
        }
    }

    let mut trigger: Option<(Trigger, Instant)> = None;
    loop {
        std::thread::sleep(config.monitor_interval);
        if let Some(signal) = signals::received() {
            stop(&mut ranks, config);
            return Err(ParallelError::Interrupted {
                signal: signals::name(signal),
            });
        }
        for rank in ranks.iter_mut() {
            rank.poll()?;
        }
        if ranks.iter().all(|r| !r.running()) {
            break;
        }
        if trigger.is_none() {
            trigger = detect(&ranks, store, config, &abort_key).map(|t| (t, Instant::now()));
            if let Some((t, _)) = &trigger {
                // Tell the other nodes (first writer wins; they stop their ranks).
                let why = match t {
                    Trigger::Silent(r) => format!("rank {r} stopped answering"),
                    Trigger::Remote(why) => why.clone(),
                    Trigger::Exit => format!("a rank on node {} failed", config.node_rank),
                };
                let _ = store.client.compare_set(&abort_key, None, why.as_bytes());
            }
        }
        if let Some((t, since)) = &trigger {
            // Ranks that lost a peer exit by themselves; give them a moment to report why, then
            // stop the rest (a silent rank gets no grace).
            let grace = if matches!(t, Trigger::Silent(_)) {
                Duration::ZERO
            } else {
                config.exit_grace
            };
            if since.elapsed() >= grace {
                stop(&mut ranks, config);
                break;
            }
        }
    }
    for rank in ranks.iter_mut() {
        rank.finish();
    }
    let trigger = trigger.map(|(t, _)| t);
    if trigger.is_none() && ranks.iter().all(|r| r.failure().is_none()) {
        return Ok(());
    }
    let reports = read_reports(&store.client, &prefix).unwrap_or_default();
    Err(root_cause(&ranks, &reports, trigger, config))
}

/// A reason to stop the group, if there is one now.
fn detect(
    ranks: &[RankProcess],
    store: &JobStore,
    config: &LaunchConfig,
    abort_key: &str,
) -> Option<Trigger> {
    if ranks.iter().any(|r| r.failure().is_some()) {
        return Some(Trigger::Exit);
    }
    if let Ok(silent) = store.client.silent_ranks(config.heartbeat_timeout)
        && let Some(&rank) = silent.first()
    {
        return Some(Trigger::Silent(rank));
    }
    if let Ok(Some(why)) = store.client.get(abort_key) {
        return Some(Trigger::Remote(String::from_utf8_lossy(&why).into_owned()));
    }
    None
}

/// SIGTERM to every running rank's group, SIGKILL after the grace, until all have exited.
fn stop(ranks: &mut [RankProcess], config: &LaunchConfig) {
    for rank in ranks.iter_mut().filter(|r| r.running()) {
        rank.signal_group(libc::SIGTERM);
    }
    let deadline = Instant::now() + config.kill_grace;
    let mut killed = false;
    loop {
        for rank in ranks.iter_mut() {
            // An error here means the child was already reaped: nothing left to wait for.
            let _ = rank.poll();
        }
        if ranks.iter().all(|r| !r.running()) {
            return;
        }
        if !killed && Instant::now() >= deadline {
            for rank in ranks.iter_mut().filter(|r| r.running()) {
                rank.signal_group(libc::SIGKILL);
            }
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The one failure to report: a rank's own error first, then a death by a signal nobody sent it,
/// then a silent rank, an unexplained exit, and last a rank that only saw another one fail.
fn root_cause(
    ranks: &[RankProcess],
    reports: &[FailureReport],
    trigger: Option<Trigger>,
    config: &LaunchConfig,
) -> ParallelError {
    let failed = |rank: usize, cause: String| ParallelError::RankFailed { rank, cause };
    if let Some(r) = reports.iter().find(|r| !r.secondary) {
        return failed(r.rank, format!("failed: {}", r.message));
    }
    let own_failure = |r: &&RankProcess| !r.stopped_by_launcher && r.failure().is_some();
    if let Some(r) = ranks
        .iter()
        .filter(own_failure)
        .find(|r| r.exit.is_some_and(|s| s.code().is_none()))
    {
        return failed(r.rank, r.failure().unwrap_or_default());
    }
    match trigger {
        Some(Trigger::Silent(rank)) => {
            return failed(
                rank,
                format!(
                    "stopped answering (no heartbeat for {} s)",
                    config.heartbeat_timeout.as_secs_f64()
                ),
            );
        }
        Some(Trigger::Remote(why)) if ranks.iter().all(|r| !own_failure(&r)) => {
            return ParallelError::JobStopped {
                node: config.node_rank,
                reason: why,
            };
        }
        _ => {}
    }
    if let Some(r) = ranks.iter().find(own_failure) {
        let detail = reports
            .iter()
            .find(|rep| rep.rank == r.rank)
            .map(|rep| format!(": {}", rep.message))
            .unwrap_or_default();
        return failed(
            r.rank,
            format!("{}{detail}", r.failure().unwrap_or_default()),
        );
    }
    if let Some(r) = reports.first() {
        return failed(r.rank, format!("failed: {}", r.message));
    }
    let rank = ranks.first().map_or(0, |r| r.rank);
    failed(rank, "was stopped by the launcher".into())
}
