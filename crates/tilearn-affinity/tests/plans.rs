//! Topology discovery and plans on fake sysfs trees. Every plan is asserted in full: the exact
//! CPU list of every thread role of every rank.

mod support;

use support::{DGX_GPUS, FakeMachine, cpu_box, dgx_box};
use tilearn_affinity::{BindMode, CpuSet, Plan, Topology};

/// `(main, loader, comm)` of each rank as cpu list strings; `None` for an unpinned rank.
fn bindings(plan: &Plan) -> Vec<Option<(String, String, String)>> {
    plan.ranks
        .iter()
        .map(|r| {
            r.binding
                .as_ref()
                .map(|b| (b.main.to_string(), b.loader.to_string(), b.comm.to_string()))
        })
        .collect()
}

fn pinned(main: &str, loader: &str, comm: &str) -> Option<(String, String, String)> {
    Some((main.into(), loader.into(), comm.into()))
}

fn set(text: &str) -> CpuSet {
    CpuSet::parse(text).unwrap()
}

/// One node, 8 cores with SMT (siblings +8), two GPUs.
fn two_gpu_box() -> FakeMachine {
    let m = cpu_box(1, 8, true);
    m.gpu("0000:01:00.0", "0", "0-15")
        .gpu("0000:02:00.0", "0", "0-15");
    m
}

#[test]
fn one_node_two_gpus() {
    let m = two_gpu_box();
    let topo = Topology::discover(&m.root(), None);
    assert!(topo.warnings.is_empty(), "{:?}", topo.warnings);
    assert_eq!(topo.nodes.len(), 1);
    assert_eq!(topo.nodes[0].cpus, set("0-15"));
    assert_eq!(topo.allowed, set("0-15"));
    let buses: Vec<_> = topo.gpus.iter().map(|g| g.bus_id.as_str()).collect();
    assert_eq!(buses, ["0000:01:00.0", "0000:02:00.0"]);
    assert_eq!(topo.gpus[0].numa_node, Some(0));
    assert_eq!(topo.gpus[0].local_cpus, Some(set("0-15")));

    // Each rank's share is 4 cores: two for main, one for the loader plus the comm core's
    // sibling, the comm thread on the last core's primary.
    let exclusive = Plan::for_local_ranks(&topo, BindMode::Exclusive, 2, None);
    assert_eq!(
        bindings(&exclusive),
        vec![
            pinned("0-1,8-9", "2,10-11", "3"),
            pinned("4-5,12-13", "6,14-15", "7"),
        ]
    );
    assert_eq!(exclusive.ranks[1].gpu.as_deref(), Some("0000:02:00.0"));
    assert_eq!(exclusive.ranks[1].numa_node, Some(0));

    // numa: the main threads share every CPU not reserved for loaders and comm threads.
    let numa = Plan::for_local_ranks(&topo, BindMode::Numa, 2, None);
    assert_eq!(
        bindings(&numa),
        vec![
            pinned("0-1,4-5,8-9,12-13", "2,10-11", "3"),
            pinned("0-1,4-5,8-9,12-13", "6,14-15", "7"),
        ]
    );

    let none = Plan::for_local_ranks(&topo, BindMode::None, 2, None);
    assert_eq!(bindings(&none), vec![None, None]);
    assert_eq!(
        none.ranks[0].unpinned_reason.as_deref(),
        Some("bind mode none")
    );
    assert_eq!(
        none.ranks[0].numa_node,
        Some(0),
        "the GPU's node is still reported"
    );

    let printed = exclusive.to_string();
    assert!(
        printed
            .contains("rank 1  gpu 0000:02:00.0  node 0  main 4-5,12-13  loader 6,14-15  comm 7"),
        "{printed}"
    );
}

#[test]
fn two_node_eight_gpu_box() {
    let m = dgx_box();
    let topo = Topology::discover(&m.root(), None);
    assert!(topo.warnings.is_empty(), "{:?}", topo.warnings);
    // NVSwitches, audio functions and the NIC are not GPUs; order is PCI bus order.
    let buses: Vec<_> = topo.gpus.iter().map(|g| g.bus_id.as_str()).collect();
    assert_eq!(buses, DGX_GPUS);
    let nodes: Vec<_> = topo.gpus.iter().map(|g| g.numa_node).collect();
    assert_eq!(
        nodes,
        [
            Some(0),
            Some(0),
            Some(0),
            Some(0),
            Some(1),
            Some(1),
            Some(1),
            Some(1)
        ]
    );
    assert_eq!(topo.nodes[1].cpus, set("8-15,24-31"));

    // Four ranks per node, two cores each: main on the first core (both threads), comm on the
    // second core's primary, the loader on its sibling.
    let exclusive = Plan::for_local_ranks(&topo, BindMode::Exclusive, 8, None);
    assert_eq!(
        bindings(&exclusive),
        vec![
            pinned("0,16", "17", "1"),
            pinned("2,18", "19", "3"),
            pinned("4,20", "21", "5"),
            pinned("6,22", "23", "7"),
            pinned("8,24", "25", "9"),
            pinned("10,26", "27", "11"),
            pinned("12,28", "29", "13"),
            pinned("14,30", "31", "15"),
        ]
    );
    let numa = Plan::for_local_ranks(&topo, BindMode::Numa, 8, None);
    let node0 = "0,2,4,6,16,18,20,22";
    let node1 = "8,10,12,14,24,26,28,30";
    assert_eq!(
        bindings(&numa),
        vec![
            pinned(node0, "17", "1"),
            pinned(node0, "19", "3"),
            pinned(node0, "21", "5"),
            pinned(node0, "23", "7"),
            pinned(node1, "25", "9"),
            pinned(node1, "27", "11"),
            pinned(node1, "29", "13"),
            pinned(node1, "31", "15"),
        ]
    );
    let ranks_nodes: Vec<_> = numa.ranks.iter().map(|r| r.numa_node).collect();
    assert_eq!(ranks_nodes, nodes);
}

#[test]
fn cuda_visible_devices_picks_the_gpus_and_their_nodes() {
    let m = dgx_box();
    let topo = Topology::discover(&m.root(), None);
    // Two ranks on GPUs 5 and 6, both on node 1: node 1's 8 cores split 4 + 4.
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 2, Some("5,6"));
    assert!(plan.warnings.is_empty(), "{:?}", plan.warnings);
    let gpus: Vec<_> = plan.ranks.iter().map(|r| r.gpu.clone().unwrap()).collect();
    assert_eq!(gpus, [DGX_GPUS[5], DGX_GPUS[6]]);
    assert_eq!(
        bindings(&plan),
        vec![
            pinned("8-9,24-25", "10,26-27", "11"),
            pinned("12-13,28-29", "14,30-31", "15")
        ]
    );

    // A UUID prefix names GPU 2 (node 0); the ordinal 1 names GPU 1 (node 0).
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 2, Some("GPU-2a1b2c3d,1"));
    let gpus: Vec<_> = plan.ranks.iter().map(|r| r.gpu.clone().unwrap()).collect();
    assert_eq!(gpus, [DGX_GPUS[2], DGX_GPUS[1]]);
    assert_eq!(
        bindings(&plan),
        vec![
            pinned("0-1,16-17", "2,18-19", "3"),
            pinned("4-5,20-21", "6,22-23", "7")
        ]
    );

    // As in CUDA, an entry naming no GPU ends the list: only GPU 3 is visible, both ranks use it.
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 2, Some("3,42,4"));
    let gpus: Vec<_> = plan.ranks.iter().map(|r| r.gpu.clone().unwrap()).collect();
    assert_eq!(gpus, [DGX_GPUS[3], DGX_GPUS[3]]);
    assert!(
        plan.warnings.iter().any(|w| w.contains("\"42\"")),
        "{:?}",
        plan.warnings
    );
    assert!(
        plan.warnings.iter().any(|w| w.contains("ranks share GPUs")),
        "{:?}",
        plan.warnings
    );

    // No visible GPU: nothing to place.
    let plan = Plan::for_local_ranks(&topo, BindMode::Numa, 1, Some(""));
    assert_eq!(bindings(&plan), vec![None]);
    assert_eq!(
        plan.ranks[0].unpinned_reason.as_deref(),
        Some("no GPU for this rank")
    );
}

#[test]
fn explicit_bus_ids_in_any_spelling() {
    let m = dgx_box();
    let topo = Topology::discover(&m.root(), None);
    // cuDeviceGetPCIBusId spells it upper-case; nvidia-smi with an 8-digit domain.
    let plan = Plan::build(
        &topo,
        BindMode::Exclusive,
        &[Some("0000:B7:00.0".into()), Some("00000000:bd:00.0".into())],
    );
    assert_eq!(plan.ranks[0].gpu.as_deref(), Some("0000:b7:00.0"));
    assert_eq!(plan.ranks[1].gpu.as_deref(), Some("0000:bd:00.0"));
    assert_eq!(
        bindings(&plan),
        vec![
            pinned("8-9,24-25", "10,26-27", "11"),
            pinned("12-13,28-29", "14,30-31", "15")
        ]
    );
    let plan = Plan::build(&topo, BindMode::Numa, &[Some("0000:99:00.0".into()), None]);
    assert_eq!(bindings(&plan), vec![None, None]);
    assert_eq!(
        plan.ranks[0].unpinned_reason.as_deref(),
        Some("GPU 0000:99:00.0 not found under sys/bus/pci/devices")
    );
}

#[test]
fn cgroup_restricted_cpu_set() {
    let m = dgx_box();
    m.cgroup("kubepods/pod1/job", "4-7,20-23");
    let topo = Topology::discover(&m.root(), None);
    assert_eq!(topo.allowed, set("4-7,20-23"));
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 8, None);
    let reason = "node 1 has no CPU this process may use (allowed: 4-7,20-23)";
    assert_eq!(
        bindings(&plan),
        vec![
            pinned("4,20", "20", "4"),
            pinned("5,21", "21", "5"),
            pinned("6,22", "22", "6"),
            pinned("7,23", "23", "7"),
            None,
            None,
            None,
            None,
        ]
    );
    for rank in &plan.ranks[4..] {
        assert_eq!(rank.unpinned_reason.as_deref(), Some(reason));
    }
    // The affinity mask narrows it further (a launcher's taskset): 4-5,20-21 remain.
    let topo = Topology::discover(&m.root(), Some(&set("0-5,16-21")));
    assert_eq!(topo.allowed, set("4-5,20-21"));
    let plan = Plan::for_local_ranks(&topo, BindMode::Numa, 2, None);
    // Each rank's share is one core; one-core shares reserve nothing, so main gets the node.
    assert_eq!(
        bindings(&plan),
        vec![
            pinned("4-5,20-21", "20", "4"),
            pinned("4-5,20-21", "21", "5")
        ]
    );
}

#[test]
fn cgroup_at_the_root_of_a_cgroup_namespace() {
    // Inside a container with its own cgroup namespace /proc/self/cgroup says "0::/" and the
    // container's cpuset is the root file.
    let m = two_gpu_box();
    m.write("proc/self/cgroup", "0::/");
    m.write("sys/fs/cgroup/cpuset.cpus.effective", "0-3,8-11");
    let topo = Topology::discover(&m.root(), None);
    assert_eq!(topo.allowed, set("0-3,8-11"));
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 2, None);
    assert_eq!(
        bindings(&plan),
        vec![pinned("0,8", "9", "1"), pinned("2,10", "11", "3")]
    );
}

#[test]
fn smt_off() {
    let m = cpu_box(1, 8, false);
    m.gpu("0000:01:00.0", "0", "0-7")
        .gpu("0000:02:00.0", "0", "0-7");
    let topo = Topology::discover(&m.root(), None);
    assert!(topo.warnings.is_empty(), "{:?}", topo.warnings);
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 2, None);
    assert_eq!(
        bindings(&plan),
        vec![pinned("0-1", "2", "3"), pinned("4-5", "6", "7")]
    );
    let plan = Plan::for_local_ranks(&topo, BindMode::Numa, 2, None);
    assert_eq!(
        bindings(&plan),
        vec![pinned("0-1,4-5", "2", "3"), pinned("0-1,4-5", "6", "7")]
    );
    // Shares of two or three cores without SMT: the loader shares the comm CPU.
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 3, None);
    assert_eq!(
        bindings(&plan),
        vec![
            pinned("0-1", "2", "2"),
            pinned("3-4", "5", "5"),
            pinned("6", "7", "7")
        ]
    );
}

#[test]
fn smt_on_versus_off_with_one_core_per_rank() {
    // Eight ranks on eight cores: with SMT each rank's main thread has both threads of its
    // core, the comm thread the primary and the loader the sibling; without SMT all three
    // share the one CPU.
    let on = cpu_box(1, 8, true);
    let off = cpu_box(1, 8, false);
    for m in [&on, &off] {
        for g in 0..8 {
            m.gpu(&format!("0000:{:02x}:00.0", g + 1), "0", "0-15");
        }
    }
    let plan = Plan::for_local_ranks(
        &Topology::discover(&on.root(), None),
        BindMode::Exclusive,
        8,
        None,
    );
    let want: Vec<_> = (0..8)
        .map(|i| {
            pinned(
                &format!("{i},{}", i + 8),
                &(i + 8).to_string(),
                &i.to_string(),
            )
        })
        .collect();
    assert_eq!(bindings(&plan), want);
    let plan = Plan::for_local_ranks(
        &Topology::discover(&off.root(), None),
        BindMode::Exclusive,
        8,
        None,
    );
    let want: Vec<_> = (0..8)
        .map(|i| pinned(&i.to_string(), &i.to_string(), &i.to_string()))
        .collect();
    assert_eq!(bindings(&plan), want);
}

#[test]
fn more_ranks_than_cores_share_cores_with_a_warning() {
    let m = cpu_box(1, 2, false);
    m.gpu("0000:01:00.0", "0", "0-1");
    let topo = Topology::discover(&m.root(), None);
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 3, None);
    assert_eq!(
        bindings(&plan),
        vec![
            pinned("0", "0", "0"),
            pinned("1", "1", "1"),
            pinned("0", "0", "0")
        ]
    );
    assert!(
        plan.warnings
            .iter()
            .any(|w| w.contains("3 ranks but 2 physical cores")),
        "{:?}",
        plan.warnings
    );
}

#[test]
fn offline_cpus_are_not_used() {
    // Booted with nosmt: the node still lists the siblings 8-15 but only 0-7 are online.
    let m = two_gpu_box();
    m.online("0-7");
    let topo = Topology::discover(&m.root(), None);
    assert_eq!(topo.nodes[0].cpus, set("0-7"));
    assert!(
        topo.warnings
            .iter()
            .any(|w| w.contains("cpus 8-15 are offline")),
        "{:?}",
        topo.warnings
    );
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 2, None);
    assert_eq!(
        bindings(&plan),
        vec![pinned("0-1", "2", "3"), pinned("4-5", "6", "7")]
    );
}

#[test]
fn hidden_sysfs_means_no_pinning() {
    let m = FakeMachine::empty();
    let topo = Topology::discover(&m.root(), None);
    assert!(topo.nodes.is_empty() && topo.gpus.is_empty());
    assert!(
        topo.warnings
            .iter()
            .any(|w| w.contains("no NUMA information")),
        "{:?}",
        topo.warnings
    );
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 2, None);
    assert_eq!(bindings(&plan), vec![None, None]);
    // A rank given a bus id still is not pinned: there is no node to pin it to.
    let plan = Plan::build(&topo, BindMode::Numa, &[Some("0000:01:00.0".into())]);
    assert_eq!(
        plan.ranks[0].unpinned_reason.as_deref(),
        Some("no NUMA topology")
    );
    assert!(plan.to_string().contains("not pinned: no NUMA topology"));
}

#[test]
fn numa_node_minus_one_on_a_two_node_box() {
    let m = dgx_box();
    m.write(
        &format!("sys/bus/pci/devices/{}/numa_node", DGX_GPUS[4]),
        "-1",
    );
    let topo = Topology::discover(&m.root(), None);
    assert_eq!(topo.gpus[4].numa_node, None);
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 8, None);
    let b = bindings(&plan);
    assert_eq!(b[4], None);
    assert_eq!(
        plan.ranks[4].unpinned_reason.as_deref(),
        Some(
            "GPU 0000:87:00.0 has no NUMA node (numa_node -1 or unreadable) on a machine with 2 nodes"
        )
    );
    // The other node-1 ranks split node 1 three ways (3 + 3 + 2 cores).
    assert_eq!(
        b[5..],
        [
            pinned("8-9,24-25", "26", "10"),
            pinned("11-12,27-28", "29", "13"),
            pinned("14,30", "31", "15"),
        ]
    );
    assert_eq!(b[0], pinned("0,16", "17", "1"));
}

#[test]
fn numa_node_minus_one_on_a_one_node_box_uses_that_node() {
    let m = two_gpu_box();
    m.write("sys/bus/pci/devices/0000:01:00.0/numa_node", "-1");
    let topo = Topology::discover(&m.root(), None);
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 2, None);
    assert_eq!(
        bindings(&plan),
        vec![
            pinned("0-1,8-9", "2,10-11", "3"),
            pinned("4-5,12-13", "6,14-15", "7")
        ]
    );
    assert!(
        plan.warnings
            .iter()
            .any(|w| w.contains("rank 0: GPU 0000:01:00.0 has no numa_node (-1)")),
        "{:?}",
        plan.warnings
    );
}

#[test]
fn broken_files_degrade_with_warnings() {
    let m = dgx_box();
    m.write("sys/devices/system/node/node1/cpulist", "8-15,garbage");
    m.remove("sys/devices/system/cpu/cpu0/topology/thread_siblings_list");
    m.remove("sys/devices/system/cpu/cpu16/topology/thread_siblings_list");
    m.remove("sys/devices/system/cpu/online");
    m.write(
        &format!("sys/bus/pci/devices/{}/numa_node", DGX_GPUS[1]),
        "zero",
    );
    let topo = Topology::discover(&m.root(), None);
    let joined = topo.warnings.join("\n");
    for expected in [
        "node 1 left out",
        "assuming every CPU of the NUMA nodes is online",
        "SMT siblings of cpus 0,16 unknown",
        "numa_node holds \"zero\"",
    ] {
        assert!(
            joined.contains(expected),
            "missing {expected:?} in:\n{joined}"
        );
    }
    assert_eq!(topo.nodes.len(), 1);
    assert_eq!(topo.online, set("0-7,16-23"));
    let plan = Plan::for_local_ranks(&topo, BindMode::Exclusive, 8, None);
    let b = bindings(&plan);
    // GPU 1's node is unknown; GPUs 4-7 report node 1, which is gone.
    assert_eq!(b[1], None);
    for rank in &plan.ranks[4..] {
        assert!(
            rank.unpinned_reason
                .as_deref()
                .unwrap()
                .contains("reports node 1, which sysfs does not list"),
            "{rank:?}"
        );
    }
    assert_eq!(
        plan.ranks[1].unpinned_reason.as_deref(),
        Some(
            "GPU 0000:0f:00.0 has no NUMA node (numa_node -1 or unreadable) on a machine with 2 nodes"
        )
    );
    // Ranks 0, 2, 3 split node 0, where cpus 0 and 16 now count as separate cores (ordered by
    // their lowest thread: 0, 1/17, …, 7/23, 16): 9 cores, 3 each.
    assert_eq!(
        [b[0].clone(), b[2].clone(), b[3].clone()],
        [
            pinned("0-1,17", "18", "2"),
            pinned("3-4,19-20", "21", "5"),
            pinned("6-7,22-23", "16", "16"),
        ]
    );
}

#[test]
fn plan_serializes_to_json() {
    let m = two_gpu_box();
    let plan = Plan::for_local_ranks(
        &Topology::discover(&m.root(), None),
        BindMode::Exclusive,
        1,
        None,
    );
    let json = serde_json::to_value(&plan).unwrap();
    assert_eq!(json["mode"], "exclusive");
    assert_eq!(json["ranks"][0]["binding"]["main"], "0-5,8-13");
    assert_eq!(json["ranks"][0]["binding"]["loader"], "6,14-15");
    assert_eq!(json["ranks"][0]["binding"]["comm"], "7");
}
