//! [`Topology`]: what the machine looks like from this process — NUMA nodes and their CPUs, SMT
//! siblings, the CPUs it may run on, and the NVIDIA GPUs with their NUMA nodes.
//!
//! Discovery never fails: each missing or malformed file becomes a warning and the part of the
//! topology it would have described is left out, so the plan built from it pins less (or
//! nothing) instead of stopping training.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

use crate::cpuset::CpuSet;
use crate::gpu::{self, GpuDevice};
use crate::sysfs::SysfsRoot;

/// One NUMA node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NumaNode {
    pub id: usize,
    /// Online CPUs of the node (its `cpulist` ∩ `cpu/online`).
    pub cpus: CpuSet,
}

/// The machine as this process sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// NUMA nodes in id order; empty when sysfs does not describe them (then nothing is pinned).
    pub nodes: Vec<NumaNode>,
    /// Ids of nodes present in sysfs whose CPU list could not be read (left out of `nodes`).
    pub nodes_left_out: Vec<usize>,
    /// Online CPUs.
    pub online: CpuSet,
    /// CPUs this process may use: online ∩ its affinity mask ∩ its cgroup's cpuset.
    pub allowed: CpuSet,
    /// For each online CPU, its SMT siblings including itself (`thread_siblings_list`).
    pub siblings: BTreeMap<usize, CpuSet>,
    /// NVIDIA GPUs in PCI bus id order.
    pub gpus: Vec<GpuDevice>,
    /// What could not be read and what that costs.
    pub warnings: Vec<String>,
}

impl Topology {
    /// The topology of this machine for the calling thread: sysfs under `/` and the thread's
    /// current affinity mask (so a launcher's `taskset`/`numactl` restriction is respected).
    pub fn detect() -> Topology {
        let affinity = crate::thread::current_thread_affinity();
        let mut topology = Topology::discover(&SysfsRoot::host(), affinity.as_ref().ok());
        if let Err(e) = affinity {
            topology
                .warnings
                .push(format!("cannot read this thread's affinity mask: {e}"));
        }
        topology
    }

    /// Reads the topology under `root`. `affinity` is the calling thread's affinity mask when
    /// known (tests pass the mask a fake machine's process would have).
    pub fn discover(root: &SysfsRoot, affinity: Option<&CpuSet>) -> Topology {
        let mut warnings = Vec::new();
        let (mut nodes, nodes_left_out) = read_nodes(root, &mut warnings);
        let listed: CpuSet = nodes
            .iter()
            .fold(CpuSet::new(), |acc, n| acc.union(&n.cpus));
        let online = match root.read_cpulist("sys/devices/system/cpu/online") {
            Ok(online) => online,
            Err(why) => {
                if !listed.is_empty() {
                    warnings.push(format!(
                        "{why}; assuming every CPU of the NUMA nodes is online"
                    ));
                }
                listed.clone()
            }
        };
        for node in &mut nodes {
            let offline = node.cpus.difference(&online);
            if !offline.is_empty() {
                warnings.push(format!(
                    "node {}: cpus {offline} are offline and will not be used",
                    node.id
                ));
                node.cpus = node.cpus.intersection(&online);
            }
        }

        let mut allowed = online.clone();
        if let Some(mask) = affinity {
            allowed = allowed.intersection(mask);
        }
        if let Some(cpuset) = cgroup_cpuset(root) {
            allowed = allowed.intersection(&cpuset);
        }
        if allowed.is_empty() && !online.is_empty() {
            warnings.push(format!(
                "no online CPU ({online}) is in this process's affinity mask and cgroup cpuset; \
                 nothing will be pinned"
            ));
        }

        let siblings = read_siblings(root, &online, &mut warnings);
        let gpus = gpu::enumerate(root, &mut warnings);
        Topology {
            nodes,
            nodes_left_out,
            online,
            allowed,
            siblings,
            gpus,
            warnings,
        }
    }

    /// The node with id `id`.
    pub fn node(&self, id: usize) -> Option<&NumaNode> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// The GPU with this PCI bus id (any spelling [`gpu::normalize_bus_id`] accepts).
    pub fn gpu(&self, bus_id: &str) -> Option<&GpuDevice> {
        let bus_id = gpu::normalize_bus_id(bus_id)?;
        self.gpus.iter().find(|g| g.bus_id == bus_id)
    }

    /// The GPUs this process sees as CUDA ordinals 0, 1, …, given `CUDA_VISIBLE_DEVICES`
    /// (`None` = unset), plus warnings about entries that name no GPU.
    pub fn visible_gpus(
        &self,
        cuda_visible_devices: Option<&str>,
    ) -> (Vec<&GpuDevice>, Vec<String>) {
        let mut warnings = Vec::new();
        let indices = gpu::visible(&self.gpus, cuda_visible_devices, &mut warnings);
        (
            indices.into_iter().map(|i| &self.gpus[i]).collect(),
            warnings,
        )
    }

    /// `cpus` grouped into physical cores: each core lists its CPUs from `cpus` in ascending
    /// order (the first is its "primary" thread, the rest its SMT siblings); cores are ordered by
    /// their primary thread. A CPU whose siblings are unknown is a core of its own.
    pub fn physical_cores(&self, cpus: &CpuSet) -> Vec<Vec<usize>> {
        let mut cores: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for cpu in cpus.iter() {
            // Two CPUs share a core exactly when their full sibling lists share the lowest id.
            let key = self
                .siblings
                .get(&cpu)
                .and_then(CpuSet::first)
                .unwrap_or(cpu);
            cores.entry(key).or_default().push(cpu);
        }
        let mut cores: Vec<Vec<usize>> = cores.into_values().collect();
        cores.sort_by_key(|threads| threads[0]);
        cores
    }
}

/// The readable nodes, and the ids of those whose CPU list could not be read.
fn read_nodes(root: &SysfsRoot, warnings: &mut Vec<String>) -> (Vec<NumaNode>, Vec<usize>) {
    let names = match root.list("sys/devices/system/node") {
        Ok(names) => names,
        Err(why) => {
            warnings.push(format!(
                "no NUMA information ({why}; a container may hide sysfs): nothing will be pinned"
            ));
            return (Vec::new(), Vec::new());
        }
    };
    let (mut nodes, mut left_out) = (Vec::new(), Vec::new());
    for name in names {
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|s| s.parse::<usize>().ok())
        else {
            continue;
        };
        match root.read_cpulist(&format!("sys/devices/system/node/{name}/cpulist")) {
            Ok(cpus) => nodes.push(NumaNode { id, cpus }),
            Err(why) => {
                warnings.push(format!("node {id} left out: {why}"));
                left_out.push(id);
            }
        }
    }
    if nodes.is_empty() {
        warnings.push("no readable NUMA node: nothing will be pinned".into());
    }
    nodes.sort_by_key(|n| n.id);
    (nodes, left_out)
}

fn read_siblings(
    root: &SysfsRoot,
    online: &CpuSet,
    warnings: &mut Vec<String>,
) -> BTreeMap<usize, CpuSet> {
    let mut siblings = BTreeMap::new();
    let mut unknown = CpuSet::new();
    for cpu in online.iter() {
        let file = format!("sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list");
        match root.read_cpulist(&file) {
            Ok(set) if set.contains(cpu) => {
                siblings.insert(cpu, set);
            }
            _ => {
                unknown.insert(cpu).ok();
            }
        }
    }
    if !unknown.is_empty() {
        warnings.push(format!(
            "SMT siblings of cpus {unknown} unknown (thread_siblings_list missing or bad): each \
             counts as a physical core"
        ));
    }
    siblings
}

/// The process's cgroup v2 `cpuset.cpus.effective` (or cgroup v1 `cpuset.effective_cpus`),
/// when there is one. The affinity mask normally reflects it already; reading it too guards
/// against a mask inherited from before the cgroup was narrowed.
fn cgroup_cpuset(root: &SysfsRoot) -> Option<CpuSet> {
    let own_path = root.read("proc/self/cgroup").ok().and_then(|text| {
        text.lines()
            .find_map(|line| line.strip_prefix("0::").map(|p| p.trim().to_string()))
    });
    let mut candidates = Vec::new();
    if let Some(path) = own_path {
        let path = path.trim_matches('/');
        if !path.is_empty() {
            candidates.push(format!("sys/fs/cgroup/{path}/cpuset.cpus.effective"));
        }
    }
    candidates.push("sys/fs/cgroup/cpuset.cpus.effective".into());
    candidates.push("sys/fs/cgroup/cpuset/cpuset.effective_cpus".into());
    candidates
        .iter()
        .find_map(|file| root.read_cpulist(file).ok())
        .filter(|set| !set.is_empty())
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "online cpus: {}", self.online)?;
        writeln!(
            f,
            "allowed cpus: {} (affinity mask ∩ cgroup cpuset)",
            self.allowed
        )?;
        if self.nodes.is_empty() {
            writeln!(f, "NUMA nodes: unknown")?;
        }
        for node in &self.nodes {
            let usable = node.cpus.intersection(&self.allowed);
            let cores = self.physical_cores(&usable);
            writeln!(
                f,
                "NUMA node {}: cpus {} (usable {}: {} physical cores, {} threads)",
                node.id,
                node.cpus,
                usable,
                cores.len(),
                usable.len()
            )?;
        }
        if self.gpus.is_empty() {
            writeln!(f, "NVIDIA GPUs in sysfs: none")?;
        }
        for (i, gpu) in self.gpus.iter().enumerate() {
            writeln!(f, "GPU {i} (PCI order): {gpu}")?;
        }
        for warning in &self.warnings {
            writeln!(f, "warning: {warning}")?;
        }
        Ok(())
    }
}
