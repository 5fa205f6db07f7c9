//! CPU/NUMA affinity in the CLI: `tilearn info --topology` prints the machine and the plans, and
//! `tilearn train --bind-cores` pins this rank's main thread and its data loader (see the
//! `tilearn-affinity` crate for how the plan is made).

use std::fmt::Write as _;
use std::sync::Arc;

use clap::ValueEnum;
use tilearn_affinity::{BindMode, LocalRank, Plan, ThreadRole, Topology};

/// `--bind-cores`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BindCores {
    /// `numa` when the training step runs on a GPU; `none` on the CPU reference engine, whose
    /// compute threads should keep every core of every node.
    Auto,
    /// No pinning.
    None,
    /// Main thread on the GPU's NUMA node (shared by the node's ranks); loader and
    /// communication threads on CPUs of that node reserved per rank.
    Numa,
    /// Disjoint cores of the GPU's node per rank.
    Exclusive,
}

impl BindCores {
    /// The mode to plan with, given whether the training step runs on a GPU.
    pub fn resolve(self, trains_on_gpu: bool) -> BindMode {
        match self {
            BindCores::Auto if trains_on_gpu => BindMode::Numa,
            BindCores::Auto | BindCores::None => BindMode::None,
            BindCores::Numa => BindMode::Numa,
            BindCores::Exclusive => BindMode::Exclusive,
        }
    }
}

/// Pins the calling (main) thread as this rank's plan says and returns the hook that pins the
/// data loader's worker thread. Never fails: anything that prevents pinning is printed as a
/// warning and training goes on unpinned.
pub fn bind_this_rank(mode: BindMode) -> Option<Arc<dyn Fn() + Send + Sync>> {
    if mode == BindMode::None {
        return None;
    }
    if let Some(reason) = tilearn_affinity::opt_out_reason() {
        println!("affinity: off ({reason})");
        return None;
    }
    let local = match LocalRank::from_env() {
        Ok(local) => local,
        Err(e) => {
            eprintln!("warning: affinity: {e}; threads are not pinned");
            return None;
        }
    };
    let topology = Topology::detect();
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let plan = Plan::for_local_ranks(&topology, mode, local.world_size, visible.as_deref());
    for warning in &plan.warnings {
        eprintln!("warning: affinity: {warning}");
    }
    let rank = plan.rank(local.rank)?;
    if rank.binding.is_none() {
        let why = rank.unpinned_reason.as_deref().unwrap_or("no plan");
        println!("affinity: local rank {} not pinned: {why}", local.rank);
        return None;
    }
    match rank.apply(ThreadRole::Main, true) {
        Ok(Some(main)) => {
            let b = rank.binding.as_ref()?;
            println!(
                "affinity: local rank {} of {} (GPU {}, node {}), mode {mode}: main {main}, loader {}, comm {}",
                local.rank,
                local.world_size,
                rank.gpu.as_deref().unwrap_or("-"),
                rank.numa_node.map_or("-".to_string(), |n| n.to_string()),
                b.loader,
                b.comm
            );
        }
        Ok(None) => return None,
        // The CPU mask may have been applied even if the memory policy was refused; the loader
        // is still worth pinning, so go on.
        Err(e) => eprintln!("warning: affinity: pinning the main thread: {e}"),
    }
    Some(rank.loader_hook())
}

/// `tilearn info --topology`.
pub fn print_topology() {
    let topology = Topology::detect();
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let local = LocalRank::from_env();
    print!("{}", report(&topology, visible.as_deref(), local));
    if let Some(reason) = tilearn_affinity::opt_out_reason() {
        println!("pinning is switched off in this environment ({reason})");
    }
}

/// The text of `info --topology` for a topology and environment (separate for testing).
fn report(
    topology: &Topology,
    visible: Option<&str>,
    local: tilearn_affinity::Result<LocalRank>,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "topology:");
    for line in topology.to_string().lines() {
        let _ = writeln!(out, "  {line}");
    }
    let (gpus, _) = topology.visible_gpus(visible);
    let _ = writeln!(
        out,
        "CUDA_VISIBLE_DEVICES: {} -> {} GPU(s): {}",
        visible.map_or("unset".to_string(), |v| format!("{v:?}")),
        gpus.len(),
        gpus.iter()
            .map(|g| g.bus_id.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    // Without a launcher, show the plan of one rank per visible GPU.
    let ranks = match &local {
        Ok(l) if std::env::var_os("LOCAL_WORLD_SIZE").is_some() => l.world_size,
        Ok(_) => gpus.len().max(1),
        Err(e) => {
            let _ = writeln!(out, "warning: {e}");
            gpus.len().max(1)
        }
    };
    for mode in [BindMode::Numa, BindMode::Exclusive] {
        let plan = Plan::for_local_ranks(topology, mode, ranks, visible);
        // Topology warnings were printed above; show only what the planner adds.
        let mut plan_text = plan.to_string();
        for warning in &topology.warnings {
            plan_text = plan_text.replace(&format!("  warning: {warning}\n"), "");
        }
        out.push_str(&plan_text);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::fs;

    use tilearn_affinity::SysfsRoot;

    use super::*;

    #[test]
    fn auto_binds_only_when_training_on_a_gpu() {
        assert_eq!(BindCores::Auto.resolve(true), BindMode::Numa);
        assert_eq!(BindCores::Auto.resolve(false), BindMode::None);
        assert_eq!(BindCores::Exclusive.resolve(false), BindMode::Exclusive);
        assert_eq!(BindCores::None.resolve(true), BindMode::None);
    }

    #[test]
    fn report_shows_gpus_nodes_and_both_plans() {
        let dir = tempfile::tempdir().unwrap();
        let write = |rel: &str, text: &str| {
            let path = dir.path().join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, format!("{text}\n")).unwrap();
        };
        write("sys/devices/system/node/node0/cpulist", "0-3");
        write("sys/devices/system/cpu/online", "0-3");
        for cpu in 0..4 {
            write(
                &format!("sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"),
                &cpu.to_string(),
            );
        }
        for (bus, node) in [("0000:01:00.0", "0"), ("0000:02:00.0", "0")] {
            write(&format!("sys/bus/pci/devices/{bus}/vendor"), "0x10de");
            write(&format!("sys/bus/pci/devices/{bus}/class"), "0x030200");
            write(&format!("sys/bus/pci/devices/{bus}/numa_node"), node);
        }
        let topology = Topology::discover(&SysfsRoot::new(dir.path()), None);
        let text = report(
            &topology,
            Some("1"),
            Ok(LocalRank {
                rank: 0,
                world_size: 1,
            }),
        );
        assert!(text.contains("NUMA node 0: cpus 0-3"), "{text}");
        assert!(
            text.contains("CUDA_VISIBLE_DEVICES: \"1\" -> 1 GPU(s): 0000:02:00.0"),
            "{text}"
        );
        assert!(
            text.contains("affinity plan: mode numa, 1 local ranks"),
            "{text}"
        );
        // One rank owns all four cores: main 0-1, loader 2, comm 3 in both modes.
        assert!(
            text.contains("rank 0  gpu 0000:02:00.0  node 0  main 0-1  loader 2  comm 3"),
            "{text}"
        );
        assert!(
            text.contains("affinity plan: mode exclusive, 1 local ranks"),
            "{text}"
        );
    }
}
