//! The rendezvous store: a small TCP key-value store run by the launcher (or rank 0 when another
//! launcher started the ranks), through which ranks exchange addresses and NCCL unique ids, report
//! failures and send heartbeats.

pub mod client;
pub mod protocol;
pub mod server;

pub use client::{LAUNCHER_RANK, StoreClient};
pub use server::StoreServer;
