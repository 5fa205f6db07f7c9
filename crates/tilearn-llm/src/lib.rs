//! tilearn-llm: the umbrella crate. Re-exports the workspace crates and hosts the `tilearn` CLI.

pub use tilearn_engine as engine;
pub use tilearn_ops as ops;
pub use tilearn_optim as optim;
