//! The host communicator: collectives between processes over TCP (for CPU training, tests, and
//! several ranks sharing one GPU through staged device buffers).

pub mod collectives;
pub mod communicator;
pub mod mesh;
pub mod ring;
#[cfg(feature = "cuda")]
pub mod staging;
pub mod threads;

pub use communicator::HostCommunicator;
pub use mesh::MeshOptions;
pub use threads::run_on_threads;
