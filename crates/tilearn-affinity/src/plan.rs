//! [`Plan`]: which CPUs each local rank's threads run on. Plain data, built from a
//! [`Topology`] without touching the machine, so it can be printed and tested exactly.
//!
//! The rules, per NUMA node:
//! 1. A rank belongs to the node of its GPU. The node's *usable* CPUs are its online CPUs that
//!    this process may use; they are grouped into physical cores (SMT siblings together), in
//!    order of their lowest CPU id.
//! 2. The cores are split into contiguous, disjoint *shares*, one per rank on the node, as
//!    evenly as possible (the first `cores % ranks` ranks get one more). Splitting by physical
//!    core keeps both threads of a core with one rank. With more ranks than cores, rank `j`
//!    shares core `j % cores` (and a warning says so).
//! 3. Within a share of `m` cores `c0 … c(m-1)`: the communication thread gets the primary
//!    (lowest) thread of the last core; the loader workers get the other threads of the last
//!    core and, when `m ≥ 4`, all threads of the core before it (or share the comm CPU when
//!    that leaves them none); the main thread gets the rest.
//!    With `m = 1` everything shares the one core (main: all its threads; comm: the primary;
//!    loader: the siblings, or the primary without SMT).
//! 4. Mode `exclusive`: main = the rest of the share, so ranks never share a CPU. Mode `numa`:
//!    main = every usable CPU of the node except the loader and comm CPUs reserved by the
//!    node's ranks (the node's compute pool, shared by its ranks). Mode `none`: nothing pinned.
//!
//! Physical cores come before SMT siblings everywhere: shares are whole cores, and a thread's
//! set is printed (and filled by the scheduler) from primaries up.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::cpuset::CpuSet;
use crate::error::AffinityError;
use crate::gpu::normalize_bus_id;
use crate::topology::Topology;

/// How ranks are bound to CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BindMode {
    /// No pinning: threads run wherever the scheduler puts them.
    None,
    /// Each rank's main thread may use its GPU's whole node (shared by the node's ranks);
    /// loader and communication threads get per-rank CPUs of that node.
    Numa,
    /// Each rank gets a disjoint share of its GPU's node for all its threads.
    Exclusive,
}

impl FromStr for BindMode {
    type Err = AffinityError;
    fn from_str(s: &str) -> Result<Self, AffinityError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "off" => Ok(BindMode::None),
            "numa" | "node" => Ok(BindMode::Numa),
            "exclusive" => Ok(BindMode::Exclusive),
            _ => Err(AffinityError::BindMode(s.to_string())),
        }
    }
}

impl fmt::Display for BindMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BindMode::None => "none",
            BindMode::Numa => "numa",
            BindMode::Exclusive => "exclusive",
        })
    }
}

/// CPUs for the threads of one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Binding {
    /// The main (training / GPU-driving) thread and the compute threads it spawns.
    pub main: CpuSet,
    /// Data loader worker threads.
    pub loader: CpuSet,
    /// The communication thread (collectives, rendezvous).
    pub comm: CpuSet,
}

/// The plan of one local rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankPlan {
    pub local_rank: usize,
    /// PCI bus id of the rank's GPU, if known.
    pub gpu: Option<String>,
    /// NUMA node of that GPU, if known.
    pub numa_node: Option<usize>,
    /// Where to pin; `None` means leave the rank's threads where they are.
    pub binding: Option<Binding>,
    /// Why the rank is not pinned (when `binding` is `None`).
    pub unpinned_reason: Option<String>,
}

/// The plan of every local rank on this machine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub mode: BindMode,
    pub ranks: Vec<RankPlan>,
    /// Topology warnings plus what the planner had to give up on.
    pub warnings: Vec<String>,
}

impl Plan {
    /// The plan for `local_world_size` ranks where rank `r` drives CUDA ordinal
    /// `r % visible` (torchrun's `cuda:LOCAL_RANK` with every rank seeing the same
    /// `CUDA_VISIBLE_DEVICES`, given here; `None` = unset).
    pub fn for_local_ranks(
        topology: &Topology,
        mode: BindMode,
        local_world_size: usize,
        cuda_visible_devices: Option<&str>,
    ) -> Plan {
        let (visible, visible_warnings) = topology.visible_gpus(cuda_visible_devices);
        let gpus: Vec<Option<String>> = (0..local_world_size)
            .map(|r| (!visible.is_empty()).then(|| visible[r % visible.len()].bus_id.clone()))
            .collect();
        let mut plan = Plan::build(topology, mode, &gpus);
        if local_world_size > visible.len() && !visible.is_empty() {
            plan.warnings.push(format!(
                "{local_world_size} local ranks but {} visible GPUs: ranks share GPUs",
                visible.len()
            ));
        }
        plan.warnings.splice(0..0, visible_warnings);
        plan
    }

    /// The plan for ranks `0..rank_gpus.len()`, rank `r` driving the GPU with PCI bus id
    /// `rank_gpus[r]` (`None`: no GPU, not pinned).
    pub fn build(topology: &Topology, mode: BindMode, rank_gpus: &[Option<String>]) -> Plan {
        let mut warnings = topology.warnings.clone();
        let mut ranks: Vec<RankPlan> = rank_gpus
            .iter()
            .enumerate()
            .map(|(local_rank, gpu)| RankPlan {
                local_rank,
                gpu: gpu
                    .as_deref()
                    .map(|g| normalize_bus_id(g).unwrap_or_else(|| g.to_string())),
                numa_node: None,
                binding: None,
                unpinned_reason: None,
            })
            .collect();
        for rank in &mut ranks {
            match locate(topology, rank.gpu.as_deref()) {
                Ok((node, note)) => {
                    rank.numa_node = Some(node);
                    if let Some(note) = note {
                        warnings.push(format!("rank {}: {note}", rank.local_rank));
                    }
                }
                Err(reason) => rank.unpinned_reason = Some(reason),
            }
        }
        if mode == BindMode::None {
            for rank in &mut ranks {
                rank.unpinned_reason
                    .get_or_insert_with(|| "bind mode none".into());
            }
            return Plan {
                mode,
                ranks,
                warnings,
            };
        }
        for node in &topology.nodes {
            let members: Vec<usize> = (0..ranks.len())
                .filter(|&r| {
                    ranks[r].unpinned_reason.is_none() && ranks[r].numa_node == Some(node.id)
                })
                .collect();
            if members.is_empty() {
                continue;
            }
            let usable = node.cpus.intersection(&topology.allowed);
            let cores = topology.physical_cores(&usable);
            if cores.is_empty() {
                for &r in &members {
                    ranks[r].unpinned_reason = Some(format!(
                        "node {} has no CPU this process may use (allowed: {})",
                        node.id, topology.allowed
                    ));
                }
                continue;
            }
            if members.len() > cores.len() {
                warnings.push(format!(
                    "node {}: {} ranks but {} physical cores usable: ranks share cores",
                    node.id,
                    members.len(),
                    cores.len()
                ));
            }
            let shares = split_cores(&cores, members.len());
            let roles: Vec<Binding> = shares.iter().map(|share| share_roles(share)).collect();
            // In numa mode the main threads share the node minus what is reserved for loaders
            // and comm threads; a one-core share reserves nothing (its main thread needs it).
            let reserved = shares
                .iter()
                .zip(&roles)
                .filter(|(share, _)| share.len() >= 2)
                .fold(CpuSet::new(), |acc, (_, b)| {
                    acc.union(&b.loader).union(&b.comm)
                });
            let pool = match usable.difference(&reserved) {
                pool if pool.is_empty() => usable.clone(),
                pool => pool,
            };
            for (&r, mut binding) in members.iter().zip(roles) {
                if mode == BindMode::Numa {
                    binding.main = pool.clone();
                }
                ranks[r].binding = Some(binding);
            }
        }
        for rank in &mut ranks {
            if rank.binding.is_none() && rank.unpinned_reason.is_none() {
                rank.unpinned_reason = Some("its NUMA node is not in the topology".into());
            }
        }
        Plan {
            mode,
            ranks,
            warnings,
        }
    }

    /// The plan of local rank `local_rank`.
    pub fn rank(&self, local_rank: usize) -> Option<&RankPlan> {
        self.ranks.iter().find(|r| r.local_rank == local_rank)
    }
}

/// The NUMA node of a rank's GPU, with a note when it had to be inferred; or why the rank
/// cannot be placed.
fn locate(topology: &Topology, gpu: Option<&str>) -> Result<(usize, Option<String>), String> {
    if topology.nodes.is_empty() {
        return Err("no NUMA topology".into());
    }
    let bus_id = gpu.ok_or("no GPU for this rank")?;
    let device = topology
        .gpu(bus_id)
        .ok_or_else(|| format!("GPU {bus_id} not found under sys/bus/pci/devices"))?;
    match device.numa_node {
        Some(node) if topology.node(node).is_some() => Ok((node, None)),
        Some(node) => Err(format!(
            "GPU {bus_id} reports node {node}, which sysfs does not list"
        )),
        // One node: -1 only means the firmware did not say; there is nothing to choose. (Not
        // when other nodes exist but were unreadable.)
        None if topology.nodes.len() == 1 && topology.nodes_left_out.is_empty() => Ok((
            topology.nodes[0].id,
            Some(format!(
                "GPU {bus_id} has no numa_node (-1); using the only node, {}",
                topology.nodes[0].id
            )),
        )),
        None => Err(format!(
            "GPU {bus_id} has no NUMA node (numa_node -1 or unreadable) on a machine with {} nodes",
            topology.nodes.len() + topology.nodes_left_out.len()
        )),
    }
}

/// `cores` split into `ranks` contiguous shares of whole cores, sizes differing by at most one
/// (larger first); with more ranks than cores, rank `j` gets core `j % cores`.
fn split_cores(cores: &[Vec<usize>], ranks: usize) -> Vec<Vec<Vec<usize>>> {
    if ranks > cores.len() {
        return (0..ranks)
            .map(|j| vec![cores[j % cores.len()].clone()])
            .collect();
    }
    let (base, extra) = (cores.len() / ranks, cores.len() % ranks);
    let mut start = 0;
    (0..ranks)
        .map(|j| {
            let size = base + usize::from(j < extra);
            let share = cores[start..start + size].to_vec();
            start += size;
            share
        })
        .collect()
}

/// Main / loader / comm CPUs within one share (rule 3 of the module docs). `share` is non-empty.
fn share_roles(share: &[Vec<usize>]) -> Binding {
    let m = share.len();
    let last = &share[m - 1];
    let comm: CpuSet = std::iter::once(last[0]).collect();
    let last_siblings: CpuSet = last[1..].iter().copied().collect();
    let threads = |cores: &[Vec<usize>]| -> CpuSet { cores.iter().flatten().copied().collect() };
    if m == 1 {
        let loader = if last_siblings.is_empty() {
            comm.clone()
        } else {
            last_siblings
        };
        return Binding {
            main: threads(share),
            loader,
            comm,
        };
    }
    let (main_cores, loader_core) = if m >= 4 {
        (&share[..m - 2], Some(&share[m - 2]))
    } else {
        (&share[..m - 1], None)
    };
    let mut loader = last_siblings;
    if let Some(core) = loader_core {
        loader = loader.union(&core.iter().copied().collect());
    }
    if loader.is_empty() {
        loader = comm.clone();
    }
    Binding {
        main: threads(main_cores),
        loader,
        comm,
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "affinity plan: mode {}, {} local ranks",
            self.mode,
            self.ranks.len()
        )?;
        for rank in &self.ranks {
            write!(f, "  rank {}", rank.local_rank)?;
            write!(f, "  gpu {}", rank.gpu.as_deref().unwrap_or("-"))?;
            match rank.numa_node {
                Some(node) => write!(f, "  node {node}")?,
                None => write!(f, "  node -")?,
            }
            match (&rank.binding, &rank.unpinned_reason) {
                (Some(b), _) => {
                    writeln!(f, "  main {}  loader {}  comm {}", b.main, b.loader, b.comm)?
                }
                (None, Some(why)) => writeln!(f, "  not pinned: {why}")?,
                (None, None) => writeln!(f, "  not pinned")?,
            }
        }
        for warning in &self.warnings {
            writeln!(f, "  warning: {warning}")?;
        }
        Ok(())
    }
}
