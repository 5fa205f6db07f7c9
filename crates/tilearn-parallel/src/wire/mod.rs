//! The byte level shared by the store and the host communicator: frames, payload fields, the
//! admission handshake, and turning socket errors into [`crate::ParallelError`]s.

pub mod codec;
pub mod frame;
pub mod handshake;
pub mod socket;
