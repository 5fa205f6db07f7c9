//! The Linux system calls behind pinning, all acting on the *calling thread*: pin it
//! (`sched_setaffinity`), read its mask back (`sched_getaffinity`), prefer a NUMA node for its
//! new memory (`set_mempolicy`), and ask where pages really are (`move_pages`). Affinity and
//! memory policy are per thread and inherited by threads it spawns afterwards.
//!
//! A leaf: discovery ([`crate::topology`]) reads the mask through it and applying a plan
//! ([`crate::apply`]) pins through it; it knows nothing of either.

use std::io;

use crate::cpuset::{CpuSet, MAX_CPUS};
use crate::error::{AffinityError, Result};

/// Bits in the masks passed to the kernel: one word per 64 CPUs, at least 1024 CPUs (glibc's
/// `cpu_set_t`), more when the set names higher ids.
fn mask_words(max_cpu: usize) -> usize {
    (max_cpu + 1).max(1024).div_ceil(64)
}

/// CPUs the calling thread may run on.
#[cfg(target_os = "linux")]
pub fn current_thread_affinity() -> Result<CpuSet> {
    let mut words = mask_words(0);
    loop {
        let mut mask = vec![0u64; words];
        let bytes = words * 8;
        // SAFETY: `mask` is a writable buffer of exactly `bytes` bytes; with pid 0 the kernel
        // reads the calling thread's mask and writes at most `bytes` bytes into it.
        let ret = unsafe {
            libc::sched_getaffinity(0, bytes, mask.as_mut_ptr().cast::<libc::cpu_set_t>())
        };
        if ret == 0 {
            let mut set = CpuSet::new();
            for (w, word) in mask.iter().enumerate() {
                for bit in 0..64 {
                    if word & (1u64 << bit) != 0 {
                        set.insert(w * 64 + bit)?;
                    }
                }
            }
            return Ok(set);
        }
        let err = io::Error::last_os_error();
        // EINVAL: the kernel's mask is wider than ours (more than `bytes * 8` possible CPUs).
        if err.raw_os_error() == Some(libc::EINVAL) && words * 64 < MAX_CPUS {
            words *= 2;
            continue;
        }
        return Err(AffinityError::Syscall {
            call: "sched_getaffinity",
            detail: "calling thread".into(),
            source: err,
        });
    }
}

/// Pins the calling thread (and the threads it spawns from now on) to `cpus`.
#[cfg(target_os = "linux")]
pub fn pin_current_thread(cpus: &CpuSet) -> Result<()> {
    let max = cpus.last().ok_or(AffinityError::EmptyCpuSet)?;
    let words = mask_words(max);
    let mut mask = vec![0u64; words];
    for cpu in cpus.iter() {
        mask[cpu / 64] |= 1u64 << (cpu % 64);
    }
    // SAFETY: `mask` holds `words * 8` initialised bytes, the size passed; pid 0 = this thread.
    let ret =
        unsafe { libc::sched_setaffinity(0, words * 8, mask.as_ptr().cast::<libc::cpu_set_t>()) };
    if ret != 0 {
        return Err(AffinityError::Syscall {
            call: "sched_setaffinity",
            detail: format!("cpus {cpus}"),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Linux `MPOL_DEFAULT` / `MPOL_PREFERRED` (include/uapi/linux/mempolicy.h).
#[cfg(target_os = "linux")]
const MPOL_DEFAULT: libc::c_long = 0;
#[cfg(target_os = "linux")]
const MPOL_PREFERRED: libc::c_long = 1;

/// Makes new memory of the calling thread come from NUMA node `node` while it has free pages
/// (`MPOL_PREFERRED`: falls back to other nodes rather than failing). Call it before allocating
/// pinned host buffers so the pages the GPU reads sit on its node.
#[cfg(target_os = "linux")]
pub fn prefer_memory_node(node: usize) -> Result<()> {
    let words = node / 64 + 1;
    let mut mask = vec![0 as libc::c_ulong; words];
    mask[node / 64] |= 1 << (node % 64);
    // The kernel reads `maxnode - 1` bits (a historical off-by-one that libnuma also
    // compensates for), so pass one more than the mask's width.
    let maxnode = (words * 64 + 1) as libc::c_ulong;
    // SAFETY: set_mempolicy reads `maxnode - 1` bits from `mask`, which holds `words * 64`
    // initialised bits; it changes only this thread's policy.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_set_mempolicy,
            MPOL_PREFERRED,
            mask.as_ptr(),
            maxnode,
        )
    };
    if ret != 0 {
        return Err(AffinityError::Syscall {
            call: "set_mempolicy",
            detail: format!("MPOL_PREFERRED, node {node}"),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Restores the default memory policy (allocate on the node of the CPU that touches the page).
#[cfg(target_os = "linux")]
pub fn reset_memory_policy() -> Result<()> {
    // SAFETY: MPOL_DEFAULT takes no mask (NULL, 0); it changes only this thread's policy.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_set_mempolicy,
            MPOL_DEFAULT,
            std::ptr::null::<libc::c_ulong>(),
            0 as libc::c_ulong,
        )
    };
    if ret != 0 {
        return Err(AffinityError::Syscall {
            call: "set_mempolicy",
            detail: "MPOL_DEFAULT".into(),
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// The NUMA node holding the page of each address (`move_pages` in query mode, which moves
/// nothing): `Some(node)`, or `None` for a page that is not mapped or not yet touched. Lets a
/// benchmark say where a buffer really landed instead of assuming the policy worked.
#[cfg(target_os = "linux")]
pub fn page_nodes(addresses: &[*const u8]) -> Result<Vec<Option<usize>>> {
    let pages: Vec<*const libc::c_void> = addresses.iter().map(|&a| a.cast()).collect();
    let mut status = vec![0 as libc::c_int; pages.len()];
    // SAFETY: with `nodes` NULL, move_pages only reports, for each of `pages.len()` addresses
    // read from `pages`, the node of its page into `status` (same length); it dereferences no
    // address in user space and reports unmapped ones as negative errno values.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0 as libc::c_int,
            pages.len() as libc::c_ulong,
            pages.as_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0 as libc::c_int,
        )
    };
    if ret != 0 {
        return Err(AffinityError::Syscall {
            call: "move_pages",
            detail: format!("query {} pages", pages.len()),
            source: io::Error::last_os_error(),
        });
    }
    Ok(status
        .into_iter()
        .map(|s| usize::try_from(s).ok())
        .collect())
}

#[cfg(not(target_os = "linux"))]
pub fn page_nodes(_addresses: &[*const u8]) -> Result<Vec<Option<usize>>> {
    Err(AffinityError::Unsupported("move_pages"))
}

#[cfg(not(target_os = "linux"))]
pub fn current_thread_affinity() -> Result<CpuSet> {
    Err(AffinityError::Unsupported("sched_getaffinity"))
}

#[cfg(not(target_os = "linux"))]
pub fn pin_current_thread(_cpus: &CpuSet) -> Result<()> {
    Err(AffinityError::Unsupported("sched_setaffinity"))
}

#[cfg(not(target_os = "linux"))]
pub fn prefer_memory_node(_node: usize) -> Result<()> {
    Err(AffinityError::Unsupported("set_mempolicy"))
}

#[cfg(not(target_os = "linux"))]
pub fn reset_memory_policy() -> Result<()> {
    Err(AffinityError::Unsupported("set_mempolicy"))
}
