//! NVIDIA GPUs as PCI devices: enumeration from sysfs, PCI bus id normalisation, and the
//! `CUDA_VISIBLE_DEVICES` mapping from CUDA ordinals to bus ids.
//!
//! Ordering: GPUs are listed in ascending PCI bus id order, which is CUDA's order under
//! `CUDA_DEVICE_ORDER=PCI_BUS_ID` and `nvidia-smi`'s order. CUDA's default
//! (`FASTEST_FIRST`) puts the fastest model first; on a machine whose GPUs are all one model
//! (every training box we target) that is the same order, and [`crate::Topology`] warns when the
//! models differ. A caller that knows the bus id of its device (from
//! `cuDeviceGetPCIBusId`) can bypass the mapping and hand the id to [`crate::Plan::build`].

use std::fmt;

use serde::Serialize;

use crate::cpuset::CpuSet;
use crate::sysfs::SysfsRoot;

/// PCI vendor id of NVIDIA.
const NVIDIA_VENDOR: &str = "0x10de";

/// One NVIDIA GPU found in sysfs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuDevice {
    /// Normalised PCI bus id, `dddd:bb:dd.f` in lower-case hex (sysfs' own spelling).
    pub bus_id: String,
    /// NUMA node from `numa_node`; `None` when the file says -1 or is missing/unreadable.
    pub numa_node: Option<usize>,
    /// CPUs the kernel lists as local to the device (`local_cpulist`), when readable.
    pub local_cpus: Option<CpuSet>,
    /// PCI device id (`device`, e.g. `0x2335`): tells GPU models apart.
    pub pci_device: Option<String>,
    /// `GPU-…` UUID from `/proc/driver/nvidia/gpus/<bus id>/information`, when present.
    pub uuid: Option<String>,
}

impl fmt::Display for GpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bus_id)?;
        match self.numa_node {
            Some(node) => write!(f, "  node {node}")?,
            None => write!(f, "  node unknown")?,
        }
        if let Some(cpus) = &self.local_cpus {
            write!(f, "  local cpus {cpus}")?;
        }
        if let Some(uuid) = &self.uuid {
            write!(f, "  {uuid}")?;
        }
        Ok(())
    }
}

/// Normalises a PCI bus id to sysfs' spelling: `0000:3B:00.0`, `00000000:3b:00.0` (nvidia-smi,
/// 8-digit domain) and `3b:00.0` (no domain) all become `0000:3b:00.0`. `None` if it is not a
/// bus id.
pub fn normalize_bus_id(text: &str) -> Option<String> {
    let text = text.trim();
    let (rest, function) = text.rsplit_once('.')?;
    let mut parts: Vec<&str> = rest.split(':').collect();
    if parts.len() == 2 {
        parts.insert(0, "0");
    }
    let [domain, bus, device] = parts[..] else {
        return None;
    };
    let hex = |s: &str, max: u32| {
        if s.is_empty() || s.len() > 8 {
            return None;
        }
        u32::from_str_radix(s, 16).ok().filter(|&v| v <= max)
    };
    let domain = hex(domain, 0xffff)?;
    let bus = hex(bus, 0xff)?;
    let device = hex(device, 0x1f)?;
    let function = hex(function, 0x7)?;
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// Every NVIDIA display/3D controller (class 0x03xxxx) under `sys/bus/pci/devices`, in bus id
/// order. NVSwitches (class 0x0680) and the GPUs' audio functions (0x0403) are not GPUs.
pub(crate) fn enumerate(root: &SysfsRoot, warnings: &mut Vec<String>) -> Vec<GpuDevice> {
    let names = match root.list("sys/bus/pci/devices") {
        Ok(names) => names,
        Err(why) => {
            warnings.push(format!(
                "no PCI devices visible ({why}); GPUs cannot be located"
            ));
            return Vec::new();
        }
    };
    let mut gpus = Vec::new();
    for name in names {
        let Some(bus_id) = normalize_bus_id(&name) else {
            continue;
        };
        let dir = format!("sys/bus/pci/devices/{name}");
        let vendor = root.read(&format!("{dir}/vendor")).unwrap_or_default();
        let class = root.read(&format!("{dir}/class")).unwrap_or_default();
        if !vendor.eq_ignore_ascii_case(NVIDIA_VENDOR) || !class.starts_with("0x03") {
            continue;
        }
        let numa_node = match root.read(&format!("{dir}/numa_node")) {
            Ok(text) => match text.parse::<i64>() {
                Ok(n) if n >= 0 => Some(n as usize),
                Ok(_) => None,
                Err(_) => {
                    warnings.push(format!(
                        "GPU {bus_id}: numa_node holds {text:?}, not a number"
                    ));
                    None
                }
            },
            Err(why) => {
                warnings.push(format!("GPU {bus_id}: {why}"));
                None
            }
        };
        let local_cpus = root.read_cpulist(&format!("{dir}/local_cpulist")).ok();
        let pci_device = root.read(&format!("{dir}/device")).ok();
        let uuid = read_uuid(root, &bus_id);
        gpus.push(GpuDevice {
            bus_id,
            numa_node,
            local_cpus,
            pci_device,
            uuid,
        });
    }
    gpus.sort_by(|a, b| a.bus_id.cmp(&b.bus_id));
    let models: std::collections::BTreeSet<_> =
        gpus.iter().filter_map(|g| g.pci_device.clone()).collect();
    if models.len() > 1 {
        warnings.push(format!(
            "GPUs of different models ({}): CUDA ordinals follow PCI bus order only with \
             CUDA_DEVICE_ORDER=PCI_BUS_ID; set it so the plan's GPU mapping is right",
            models.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    gpus
}

/// The `GPU UUID:` line of the NVIDIA driver's per-GPU information file.
fn read_uuid(root: &SysfsRoot, bus_id: &str) -> Option<String> {
    let text = root
        .read(&format!("proc/driver/nvidia/gpus/{bus_id}/information"))
        .ok()?;
    text.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "GPU UUID").then(|| value.trim().to_string())
    })
}

/// Maps `CUDA_VISIBLE_DEVICES` to indices into `gpus` (PCI order): CUDA ordinal `i` of the
/// process is `gpus[result[i]]`. Unset means every GPU. As in CUDA, the list is read up to the
/// first entry that names no device; entries may be ordinals or `GPU-…` UUIDs (unique
/// prefixes allowed). MIG instances (`MIG-…`) name no PCI device we can see, so they stop the
/// list with a warning.
pub(crate) fn visible(
    gpus: &[GpuDevice],
    cuda_visible_devices: Option<&str>,
    warnings: &mut Vec<String>,
) -> Vec<usize> {
    let Some(list) = cuda_visible_devices else {
        return (0..gpus.len()).collect();
    };
    let mut chosen = Vec::new();
    for entry in list.split(',').map(str::trim) {
        let index = if let Ok(ordinal) = entry.parse::<usize>() {
            (ordinal < gpus.len()).then_some(ordinal)
        } else if entry.starts_with("GPU-") {
            let matches: Vec<usize> = (0..gpus.len())
                .filter(|&i| {
                    gpus[i]
                        .uuid
                        .as_deref()
                        .is_some_and(|u| u.starts_with(entry))
                })
                .collect();
            (matches.len() == 1).then(|| matches[0])
        } else {
            None
        };
        match index {
            Some(i) if !chosen.contains(&i) => chosen.push(i),
            _ => {
                if !entry.is_empty() {
                    warnings.push(format!(
                        "CUDA_VISIBLE_DEVICES={list:?}: {entry:?} names no GPU this process can \
                         locate in sysfs (or repeats one); CUDA ignores it and everything after it"
                    ));
                }
                break;
            }
        }
    }
    chosen
}
