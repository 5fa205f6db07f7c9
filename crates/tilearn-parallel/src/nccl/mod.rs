//! NCCL (feature `cuda`): one process per GPU, bootstrapped through the rendezvous store.

pub mod communicator;
pub mod library;
pub mod work;

pub use communicator::NcclCommunicator;
pub use library::{NCCL_LIBRARY_ENV, NCCL_NAMES, nccl};
