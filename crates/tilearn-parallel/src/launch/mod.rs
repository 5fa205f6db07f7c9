//! The launcher behind `tilearn launch`: N ranks per node with torchrun's environment contract,
//! one summary line when the job fails, no orphans, and whole-group restarts.

pub mod child;
pub mod config;
pub mod signals;
pub mod supervisor;

pub use config::{DEFAULT_MASTER_PORT, LaunchConfig, Program};
pub use supervisor::launch;
