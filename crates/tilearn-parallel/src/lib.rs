//! tilearn-parallel: training across processes and machines.
//!
//! * [`Communicator`]: collectives over flat typed buffers with work handles and a timeout;
//!   backends [`host::HostCommunicator`] (TCP between processes, gloo's role) and, with the `cuda`
//!   feature, `nccl::NcclCommunicator`; [`RoutedCommunicator`] pairs them for one group (device
//!   buffers over NCCL, host buffers over the host), as model-parallel ranks need.
//! * [`store`]: the rendezvous key-value store.
//! * [`RankEnv`]: who this process is, read from `tilearn launch`, torchrun or Slurm variables.
//! * [`launch`]: the launcher behind `tilearn launch`.
//! * [`pipeline`]: pipeline-parallel schedules as data (GPipe, 1F1B, interleaved 1F1B), their
//!   checks, simulation and timeline.

pub mod buffer;
pub mod communicator;
#[cfg(feature = "cuda")]
pub mod device;
pub mod error;
pub mod failure;
pub mod heartbeat;
pub mod host;
pub mod launch;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod pipeline;
pub mod process_group;
pub mod rank_env;
pub mod reduce;
pub mod routed;
pub mod scalars;
pub mod slurm;
pub mod store;
pub mod token;
pub mod wire;
pub mod work;

pub use buffer::{Buffer, BufferMut, CommElement, HostSlice, HostSliceMut};
pub use communicator::{Communicator, P2pOp};
pub use error::{ParallelError, Result};
pub use process_group::{GroupOptions, ProcessGroup};
pub use rank_env::RankEnv;
pub use reduce::ReduceOp;
pub use routed::RoutedCommunicator;
pub use token::JobToken;
pub use work::Work;
