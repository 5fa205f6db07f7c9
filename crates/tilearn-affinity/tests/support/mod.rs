//! Fake sysfs trees in temporary directories, laid out like the kernel's, so topology discovery
//! and planning can be tested for machines we do not have.

#![allow(dead_code)] // each test binary uses a different part of the helper

use std::fs;
use std::path::Path;

use tempfile::TempDir;
use tilearn_affinity::SysfsRoot;

/// A fake `/` holding `sys/` and `proc/` files.
pub struct FakeMachine {
    dir: TempDir,
}

impl FakeMachine {
    pub fn empty() -> FakeMachine {
        FakeMachine {
            dir: tempfile::tempdir().expect("create a temporary directory"),
        }
    }

    pub fn root(&self) -> SysfsRoot {
        SysfsRoot::new(self.dir.path())
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes `content` plus the newline sysfs ends its files with.
    pub fn write(&self, relative: &str, content: &str) -> &Self {
        let path = self.dir.path().join(relative);
        fs::create_dir_all(path.parent().expect("a file path has a parent"))
            .expect("create the fake file's directory");
        fs::write(&path, format!("{content}\n")).expect("write a fake sysfs file");
        self
    }

    pub fn remove(&self, relative: &str) -> &Self {
        fs::remove_file(self.dir.path().join(relative)).expect("remove a fake sysfs file");
        self
    }

    pub fn node(&self, id: usize, cpulist: &str) -> &Self {
        self.write(
            &format!("sys/devices/system/node/node{id}/cpulist"),
            cpulist,
        )
    }

    pub fn online(&self, cpulist: &str) -> &Self {
        self.write("sys/devices/system/cpu/online", cpulist)
    }

    pub fn siblings(&self, cpu: usize, cpulist: &str) -> &Self {
        self.write(
            &format!("sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"),
            cpulist,
        )
    }

    /// A PCI function with the given vendor and class, e.g. an NVIDIA GPU
    /// (`0x10de`, `0x030200`).
    pub fn pci(&self, bus_id: &str, vendor: &str, class: &str, numa_node: &str) -> &Self {
        let dir = format!("sys/bus/pci/devices/{bus_id}");
        self.write(&format!("{dir}/vendor"), vendor)
            .write(&format!("{dir}/class"), class)
            .write(&format!("{dir}/numa_node"), numa_node)
            .write(&format!("{dir}/device"), "0x2335")
    }

    /// An NVIDIA H100/H200-class GPU on `numa_node` whose local CPUs are `local_cpulist`.
    pub fn gpu(&self, bus_id: &str, numa_node: &str, local_cpulist: &str) -> &Self {
        self.pci(bus_id, "0x10de", "0x030200", numa_node).write(
            &format!("sys/bus/pci/devices/{bus_id}/local_cpulist"),
            local_cpulist,
        )
    }

    /// The NVIDIA driver's information file, which holds the GPU's UUID.
    pub fn gpu_uuid(&self, bus_id: &str, uuid: &str) -> &Self {
        self.write(
            &format!("proc/driver/nvidia/gpus/{bus_id}/information"),
            &format!(
                "Model: \t\t NVIDIA H200\nIRQ:   \t\t 17\nGPU UUID: \t {uuid}\nBus Location: \t {bus_id}"
            ),
        )
    }

    /// Puts the process in cgroup v2 `path` whose effective cpuset is `cpulist`.
    pub fn cgroup(&self, path: &str, cpulist: &str) -> &Self {
        self.write("proc/self/cgroup", &format!("0::/{path}"))
            .write(
                &format!("sys/fs/cgroup/{path}/cpuset.cpus.effective"),
                cpulist,
            )
    }
}

/// `nodes` NUMA nodes of `cores` physical cores each, numbered as Linux does on two-socket x86:
/// node `n` holds cores `n*cores .. (n+1)*cores`, and with `smt` the sibling of CPU `i` is
/// `i + nodes*cores`. Every CPU online. No GPUs.
pub fn cpu_box(nodes: usize, cores: usize, smt: bool) -> FakeMachine {
    let machine = FakeMachine::empty();
    let total = nodes * cores;
    for n in 0..nodes {
        let (lo, hi) = (n * cores, (n + 1) * cores - 1);
        let list = if smt {
            format!("{lo}-{hi},{}-{}", lo + total, hi + total)
        } else {
            format!("{lo}-{hi}")
        };
        machine.node(n, &list);
    }
    let threads = if smt { 2 * total } else { total };
    machine.online(&format!("0-{}", threads - 1));
    for cpu in 0..threads {
        let core = cpu % total;
        let list = if smt {
            format!("{core},{}", core + total)
        } else {
            core.to_string()
        };
        machine.siblings(cpu, &list);
    }
    machine
}

/// Bus ids of the DGX-like box's GPUs, in PCI order; the first four are on node 0.
pub const DGX_GPUS: [&str; 8] = [
    "0000:07:00.0",
    "0000:0f:00.0",
    "0000:47:00.0",
    "0000:4e:00.0",
    "0000:87:00.0",
    "0000:90:00.0",
    "0000:b7:00.0",
    "0000:bd:00.0",
];

/// A DGX-like box scaled down: two nodes of 8 cores with SMT (node 0: 0-7,16-23; node 1:
/// 8-15,24-31), eight GPUs (0–3 on node 0, 4–7 on node 1), four NVSwitches, the GPUs' audio
/// functions and a NIC, which are not GPUs.
pub fn dgx_box() -> FakeMachine {
    let machine = cpu_box(2, 8, true);
    for (i, bus) in DGX_GPUS.iter().enumerate() {
        let (node, local) = if i < 4 {
            ("0", "0-7,16-23")
        } else {
            ("1", "8-15,24-31")
        };
        machine.gpu(bus, node, local);
        machine.gpu_uuid(
            bus,
            &format!("GPU-{i}a1b2c3d-0000-1111-2222-33334444555{i}"),
        );
        // The audio function next to each GPU: NVIDIA, but class 0x0403.
        machine.pci(&bus.replace(".0", ".1"), "0x10de", "0x040300", node);
    }
    for bus in [
        "0000:c4:00.0",
        "0000:c5:00.0",
        "0000:c6:00.0",
        "0000:c7:00.0",
    ] {
        machine.pci(bus, "0x10de", "0x068000", "1"); // NVSwitch (bridge class)
    }
    machine.pci("0000:18:00.0", "0x15b3", "0x020700", "0"); // a Mellanox NIC
    machine
}
