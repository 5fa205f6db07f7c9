//! The crate's error type. Discovery never fails (problems become warnings); errors come from
//! parsing (cpu lists, environment variables, modes) and from the pinning system calls.

use std::io;

/// Everything that can go wrong in this crate.
#[derive(Debug, thiserror::Error)]
pub enum AffinityError {
    /// A cpu list (`0-3,8-11`, the kernel's format) could not be parsed.
    #[error("bad cpu list {input:?}: {reason}")]
    CpuList { input: String, reason: String },
    /// An environment variable (LOCAL_RANK, LOCAL_WORLD_SIZE, …) holds a value we cannot use.
    #[error("{variable}={value:?} is not valid: {reason}")]
    Env {
        variable: &'static str,
        value: String,
        reason: String,
    },
    /// `--bind-cores` or a similar setting named no known mode.
    #[error("unknown bind mode {0:?}: use none, numa or exclusive")]
    BindMode(String),
    /// Pinning to no CPU at all is refused (the kernel would return EINVAL anyway).
    #[error("cannot pin a thread to an empty cpu set")]
    EmptyCpuSet,
    /// A system call failed (`sched_setaffinity`, `set_mempolicy`, …).
    #[error("{call}({detail}) failed: {source}")]
    Syscall {
        call: &'static str,
        detail: String,
        source: io::Error,
    },
    /// Thread pinning exists only on Linux.
    #[error("{0} is only supported on Linux")]
    Unsupported(&'static str),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, AffinityError>;
