//! Applying a plan: pin a rank's threads to the CPUs the plan gives each role (through the
//! system calls in [`crate::thread`]), and the `TILEARN_AFFINITY=off` opt-out.
//!
//! Pinning acts on the *calling thread* (Linux affinity and memory policy are per thread and
//! inherited by threads it spawns afterwards), so a rank pins its main thread before it starts
//! its compute pool, and the loader pins its worker from inside (see [`RankPlan::loader_hook`]).

use std::sync::Arc;

use crate::cpuset::CpuSet;
use crate::error::Result;
use crate::plan::RankPlan;
use crate::thread::{pin_current_thread, prefer_memory_node};

/// Environment variable that turns all pinning off (`off`, `0`, `false`, `none`).
pub const OPT_OUT_ENV: &str = "TILEARN_AFFINITY";

/// Why pinning is switched off by the environment, if it is.
pub fn opt_out_reason() -> Option<String> {
    let value = std::env::var(OPT_OUT_ENV).ok()?;
    opt_out_from(&value).then(|| format!("{OPT_OUT_ENV}={value}"))
}

/// Whether a `TILEARN_AFFINITY` value means "off".
pub fn opt_out_from(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "off" | "0" | "false" | "none" | "no"
    )
}

/// Which thread of a rank is being pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadRole {
    Main,
    Loader,
    Comm,
}

impl RankPlan {
    /// The CPUs for `role`, or `None` when the rank is not pinned.
    pub fn cpus_for(&self, role: ThreadRole) -> Option<&CpuSet> {
        let b = self.binding.as_ref()?;
        Some(match role {
            ThreadRole::Main => &b.main,
            ThreadRole::Loader => &b.loader,
            ThreadRole::Comm => &b.comm,
        })
    }

    /// Pins the calling thread as `role` and, with `prefer_local_memory`, prefers the GPU's
    /// node for its new memory. Returns the CPUs pinned to (`None`: the plan leaves this rank
    /// alone). A failed memory policy is reported as an error after the pinning succeeded.
    pub fn apply(&self, role: ThreadRole, prefer_local_memory: bool) -> Result<Option<CpuSet>> {
        let Some(cpus) = self.cpus_for(role) else {
            return Ok(None);
        };
        pin_current_thread(cpus)?;
        if prefer_local_memory && let Some(node) = self.numa_node {
            prefer_memory_node(node)?;
        }
        Ok(Some(cpus.clone()))
    }

    /// A closure for a loader's worker thread (e.g. `tilearn_engine`'s `WorkerHook`): pins
    /// the thread to the loader CPUs and prefers the GPU's node for the batches it allocates.
    /// A failure is printed as a warning — a loader must not die because pinning was refused.
    pub fn loader_hook(&self) -> Arc<dyn Fn() + Send + Sync> {
        let plan = self.clone();
        Arc::new(move || {
            if let Err(e) = plan.apply(ThreadRole::Loader, true) {
                eprintln!(
                    "warning: could not pin the data loader thread of local rank {}: {e}",
                    plan.local_rank
                );
            }
        })
    }
}
