//! CTR data: the batch type, Criteo's TSV format, the synthetic Criteo-shaped generator, binary
//! shards and their loader.

pub mod batch;

pub use batch::{CtrBatch, MISSING, transform_dense};
