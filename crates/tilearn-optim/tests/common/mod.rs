//! Code shared by several test binaries of this crate (each includes it with `mod common;`).

pub mod golden;
