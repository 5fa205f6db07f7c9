//! CTR data: the batch type, Criteo's TSV format, the synthetic Criteo-shaped generator, binary
//! shards, the prefetching loader, and raw arrays for a PyTorch baseline ([`export`]).

pub mod batch;
pub mod criteo;
pub mod export;
pub mod loader;
pub mod shards;
pub mod synthetic;

pub use batch::{CtrBatch, MISSING, transform_dense};
pub use criteo::{CRITEO_DENSE, CRITEO_FIELDS, ParseReport, parse_line, read_tsv, read_tsv_file};
pub use loader::{Prefetcher, epoch_order, gather};
pub use shards::{ShardMeta, read_shards, write_shards};
pub use synthetic::{SyntheticCriteo, write_tsv_lines};
