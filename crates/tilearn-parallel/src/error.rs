//! The crate's one error type. Every variant names what failed (the operation, the peer rank, the
//! address, the variable) so that a multi-process failure ends in one readable line.

use std::io;
use std::time::Duration;

use tilearn_ops::DType;

/// Everything that can fail in `tilearn-parallel`.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    /// A socket or pipe failed for a reason other than a timeout or a closed peer.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    /// No progress within the communication timeout.
    #[error(
        "{op} made no progress for {} s waiting on {peer} (is it alive and in the same step? \
         raise --comm-timeout if a step is legitimately slower)",
        timeout.as_secs_f64()
    )]
    Timeout {
        op: &'static str,
        peer: String,
        timeout: Duration,
    },
    /// A peer closed its connection, almost always because that rank exited or crashed.
    #[error("rank {peer} closed its connection during {op} (that rank exited or crashed)")]
    PeerLost { op: &'static str, peer: usize },
    /// A frame that does not parse (wrong magic, unknown kind, truncated payload, bad field).
    #[error("malformed frame from {from}: {reason}")]
    Frame { from: String, reason: String },
    /// A frame whose declared length is over the limit for its connection.
    #[error("frame of {len} bytes from {from} is over the limit of {max} bytes")]
    FrameTooLarge { from: String, len: u64, max: u64 },
    /// A connection whose handshake carried another job's token.
    #[error(
        "{from} is not a rank of this job (job token mismatch): check that every node uses the \
         same TILEARN_JOB_TOKEN, MASTER_ADDR, MASTER_PORT and run id"
    )]
    ForeignJob { from: String },
    /// The peer answered with an error frame.
    #[error("{from} refused: {message}")]
    Refused { from: String, message: String },
    /// Ranks disagree about which collective comes next (a program-order bug in the caller).
    #[error("{op}: rank {peer} is out of step: expected {expected}, received {received}")]
    OutOfStep {
        op: &'static str,
        peer: usize,
        expected: String,
        received: String,
    },
    /// A buffer that cannot take part in the collective as given.
    #[error("{op}: buffer of {len} {dtype} elements: {reason}")]
    Buffer {
        op: &'static str,
        dtype: DType,
        len: usize,
        reason: String,
    },
    /// A rank number outside the group.
    #[error("{op}: rank {rank} is not in a group of {world_size}")]
    InvalidRank {
        op: &'static str,
        rank: usize,
        world_size: usize,
    },
    /// An environment variable (or launcher flag) with a value that cannot work.
    #[error("{var}={value:?}: {reason}")]
    Env {
        var: String,
        value: String,
        reason: String,
    },
    /// `wait` on the store ran out of time.
    #[error(
        "rendezvous store: waited {} s for {keys:?} (did every rank start? are MASTER_ADDR and \
         the ports reachable?)",
        timeout.as_secs_f64()
    )]
    StoreTimeout {
        keys: Vec<String>,
        timeout: Duration,
    },
    /// The operation is not available with this backend or buffer.
    #[error("{op} is not supported by the {backend} communicator: {reason}")]
    Unsupported {
        op: &'static str,
        backend: &'static str,
        reason: String,
    },
    /// NCCL could not be loaded.
    #[error(
        "NCCL not found (tried {tried}): install it (`pip install nvidia-nccl-cu13` and add its \
         `nvidia/nccl/lib` directory to LD_LIBRARY_PATH, or the distribution's libnccl2 package), \
         or use the host communicator"
    )]
    NcclNotFound { tried: String },
    /// An NCCL call returned an error.
    #[error("{call} failed: {message} (ncclResult {code})")]
    Nccl {
        call: &'static str,
        code: i32,
        message: String,
    },
    /// A CUDA driver call failed (stream, event, copy).
    #[error("CUDA {context}: {message}")]
    Cuda { context: String, message: String },
    /// A launched rank failed; the launcher's one summary of a failed job.
    #[error("rank {rank} {cause}")]
    RankFailed { rank: usize, cause: String },
    /// Another node's launcher stopped the job; this node's ranks were stopped with it.
    #[error("node {node} stopped its ranks because the job failed elsewhere: {reason}")]
    JobStopped { node: usize, reason: String },
    /// The launcher was told to stop; it stopped every rank.
    #[error("interrupted by {signal}; stopped every rank")]
    Interrupted { signal: &'static str },
    /// The launcher could not start a rank.
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: io::Error,
    },
    /// Launcher flags that contradict each other or cannot work.
    #[error("{flag}: {reason}")]
    Usage { flag: String, reason: String },
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, ParallelError>;

impl ParallelError {
    /// An [`ParallelError::Io`] with its context.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        ParallelError::Io {
            context: context.into(),
            source,
        }
    }

    /// A [`ParallelError::Frame`].
    pub fn frame(from: impl Into<String>, reason: impl Into<String>) -> Self {
        ParallelError::Frame {
            from: from.into(),
            reason: reason.into(),
        }
    }

    /// Whether this error is the consequence of another rank's failure (a lost or silent peer)
    /// rather than a failure of its own; the launcher prefers a rank's own failure as the cause.
    pub fn is_secondary(&self) -> bool {
        matches!(
            self,
            ParallelError::PeerLost { .. } | ParallelError::Timeout { .. }
        )
    }
}
