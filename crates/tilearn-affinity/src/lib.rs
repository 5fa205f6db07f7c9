//! tilearn-affinity: GPU/NUMA/CPU topology and thread pinning for training ranks and their data
//! loaders. No CUDA dependency of its own: GPUs are found as PCI devices in sysfs.
//!
//! A rank whose threads run on the NUMA node far from its GPU copies host buffers across the
//! socket interconnect and jitters; torchrun's `--numa-binding` and DeepSpeed's
//! `--bind_cores_to_rank` exist for that. This crate does the same in three plain steps:
//!
//! 1. **Discover** a [`Topology`] from sysfs (root configurable, see [`SysfsRoot`], so tests
//!    use fake trees): NUMA nodes and their CPU lists (`sys/devices/system/node/node*/cpulist`,
//!    minus offline CPUs), SMT siblings (`cpu*/topology/thread_siblings_list`), the CPUs this
//!    process may use (the thread's `sched_getaffinity` mask ∩ the cgroup v2
//!    `cpuset.cpus.effective`), and every NVIDIA GPU (`sys/bus/pci/devices/*` with vendor
//!    `0x10de`, class `0x03xxxx`) with its `numa_node` and `local_cpulist`. Discovery never
//!    fails: missing files, `numa_node = -1` on a multi-node machine, offline CPUs or a
//!    container hiding sysfs become warnings and that part of the machine is not pinned.
//! 2. **Plan** ([`Plan`], plain data with `Display` and `Serialize`): for each local rank the
//!    CPUs of its main thread, its loader workers and its communication thread, from its GPU's
//!    node, split evenly among the ranks on that node, whole physical cores first
//!    (rules in [`plan`]). Modes: [`BindMode::None`], [`BindMode::Numa`] (the node's compute
//!    CPUs shared by its ranks) and [`BindMode::Exclusive`] (disjoint CPUs per rank).
//! 3. **Apply** on the thread concerned ([`RankPlan::apply`], [`RankPlan::loader_hook`]):
//!    `sched_setaffinity` and, optionally, `set_mempolicy(MPOL_PREFERRED)` so pinned host
//!    buffers land on the GPU's node. `TILEARN_AFFINITY=off` turns pinning off
//!    ([`opt_out_reason`]).
//!
//! GPU mapping: rank `r` drives CUDA ordinal `LOCAL_RANK % visible`, where the visible GPUs are
//! `CUDA_VISIBLE_DEVICES` (ordinals or `GPU-…` UUIDs) applied to the GPUs in PCI bus id order.
//! That is CUDA's order with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, and its default order when all GPUs
//! are one model (a warning says when they are not). A caller that has the bus id from the CUDA
//! driver passes it to [`Plan::build`] directly.
//!
//! ```
//! use tilearn_affinity::{BindMode, Plan, SysfsRoot, Topology};
//! // A root with no sysfs at all: no topology, every rank left unpinned, never an error.
//! let topology = Topology::discover(&SysfsRoot::new("/nonexistent-root"), None);
//! let plan = Plan::for_local_ranks(&topology, BindMode::Numa, 2, None);
//! assert!(plan.ranks.iter().all(|r| r.binding.is_none()));
//! println!("{plan}");
//! ```

pub mod apply;
pub mod cpuset;
pub mod env;
pub mod error;
pub mod gpu;
pub mod plan;
pub mod sysfs;
pub mod thread;
pub mod topology;

pub use apply::{OPT_OUT_ENV, ThreadRole, opt_out_from, opt_out_reason};
pub use cpuset::CpuSet;
pub use env::LocalRank;
pub use error::{AffinityError, Result};
pub use gpu::{GpuDevice, normalize_bus_id};
pub use plan::{BindMode, Binding, Plan, RankPlan};
pub use sysfs::SysfsRoot;
pub use thread::{
    current_thread_affinity, page_nodes, pin_current_thread, prefer_memory_node,
    reset_memory_policy,
};
pub use topology::{NumaNode, Topology};
