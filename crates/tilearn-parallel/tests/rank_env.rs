//! `RankEnv::from_vars` under each launcher.

use std::collections::HashMap;

use tilearn_parallel::rank_env::{Launcher, RankEnv, StoreHost};
use tilearn_parallel::{JobToken, ParallelError};

fn env(pairs: &[(&str, &str)]) -> Result<RankEnv, ParallelError> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    RankEnv::from_vars(&|k| map.get(k).cloned())
}

const TORCHRUN: &[(&str, &str)] = &[
    ("RANK", "5"),
    ("LOCAL_RANK", "1"),
    ("WORLD_SIZE", "8"),
    ("LOCAL_WORLD_SIZE", "4"),
    ("GROUP_RANK", "1"),
    ("MASTER_ADDR", "10.0.0.1"),
    ("MASTER_PORT", "29500"),
    ("TORCHELASTIC_RUN_ID", "job7"),
    ("TORCHELASTIC_RESTART_COUNT", "2"),
];

#[test]
fn torchrun_ranks_use_the_port_after_the_agents() {
    let e = env(TORCHRUN).unwrap();
    assert_eq!(e.launcher, Launcher::Torchrun);
    assert_eq!(
        (
            e.rank,
            e.local_rank,
            e.world_size,
            e.local_world_size,
            e.node_rank
        ),
        (5, 1, 8, 4, 1)
    );
    assert_eq!(e.store_addr, "10.0.0.1:29501");
    assert_eq!(e.store_host, StoreHost::Rank0);
    assert_eq!((e.run_id.as_str(), e.restart), ("job7", 2));
    // every rank derives the same token; another job (other port) a different one
    let other = env(&[TORCHRUN, &[("RANK", "0"), ("LOCAL_RANK", "0")]].concat()).unwrap();
    assert_eq!(e.token, other.token);
    let mut moved = TORCHRUN.to_vec();
    moved[6] = ("MASTER_PORT", "29600");
    assert_ne!(env(&moved).unwrap().token, e.token);
    // the port override and an explicit token
    let e = env(&[
        TORCHRUN,
        &[
            ("TILEARN_STORE_PORT", "4000"),
            ("TILEARN_JOB_TOKEN", "s3cret"),
        ],
    ]
    .concat())
    .unwrap();
    assert_eq!(e.store_addr, "10.0.0.1:4000");
    assert_eq!(Some(e.token), JobToken::from_value("s3cret"));
}

#[test]
fn tilearn_launch_names_its_store() {
    let e = env(&[
        TORCHRUN,
        &[
            ("TILEARN_LAUNCHER", "1"),
            ("TILEARN_STORE_ADDR", "127.0.0.1:41000"),
            ("TILEARN_RUN_ID", "r1"),
            ("TILEARN_RESTART_COUNT", "1"),
        ],
    ]
    .concat())
    .unwrap();
    assert_eq!(e.launcher, Launcher::Tilearn);
    assert_eq!(e.store_addr, "127.0.0.1:41000");
    assert_eq!(e.store_host, StoreHost::Launcher);
    assert_eq!(e.key_prefix(), "r1/attempt1");
}

#[test]
fn srun_ranks_find_the_master_in_the_node_list() {
    let slurm = [
        ("SLURM_PROCID", "6"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_NODEID", "1"),
        ("SLURM_TASKS_PER_NODE", "4(x2)"),
        ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ("SLURM_JOB_ID", "123456"),
        ("SLURM_STEP_ID", "0"),
    ];
    let e = env(&slurm).unwrap();
    assert_eq!(e.launcher, Launcher::Slurm);
    assert_eq!(
        (
            e.rank,
            e.local_rank,
            e.world_size,
            e.local_world_size,
            e.node_rank
        ),
        (6, 2, 8, 4, 1)
    );
    assert_eq!(e.master_addr, "gpu07");
    assert_eq!(e.master_port, 23456);
    assert_eq!(e.store_addr, "gpu07:23456");
    assert_eq!(e.run_id, "slurm-123456.0");
    // the batch script itself (no step id) is a single process
    let batch: Vec<_> = slurm
        .iter()
        .copied()
        .filter(|(k, _)| *k != "SLURM_STEP_ID")
        .collect();
    assert_eq!(env(&batch).unwrap().launcher, Launcher::Single);
    // MASTER_ADDR/PORT win over the derived ones
    let e = env(&[
        &slurm[..],
        &[("MASTER_ADDR", "head"), ("MASTER_PORT", "3000")],
    ]
    .concat())
    .unwrap();
    assert_eq!(e.store_addr, "head:3000");
}

#[test]
fn no_launcher_is_a_single_process() {
    let e = env(&[]).unwrap();
    assert_eq!((e.launcher, e.rank, e.world_size), (Launcher::Single, 0, 1));
    assert!(!e.is_distributed());
}

#[test]
fn bad_values_name_the_variable() {
    let mut bad = TORCHRUN.to_vec();
    bad[0] = ("RANK", "8");
    let err = env(&bad).unwrap_err().to_string();
    assert!(
        err.contains("RANK=\"8\"") && err.contains("WORLD_SIZE=8"),
        "{err}"
    );
    let mut bad = TORCHRUN.to_vec();
    bad[5] = ("MASTER_ADDR", "");
    let err = env(&bad).unwrap_err().to_string();
    assert!(err.starts_with("MASTER_ADDR"), "{err}");
    let mut bad = TORCHRUN.to_vec();
    bad[6] = ("MASTER_PORT", "http");
    assert!(env(&bad).unwrap_err().to_string().contains("MASTER_PORT"));
}
