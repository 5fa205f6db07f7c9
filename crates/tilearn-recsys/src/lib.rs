//! tilearn-recsys: recommendation (CTR) models on top of tilearn-ops and tilearn-optim.
//!
//! * [`tables`], [`jagged`], [`hash`]: the fused multi-table embedding bag's inputs: table
//!   shapes and weights in one flat buffer, jagged ids per (table, sample), raw categorical
//!   values hashed into each table.
//! * [`embedding_bag`]: its CPU reference, forward (sum / mean pooling) and backward fused with
//!   the sparse optimizers of [`sparse_optim`] (SGD, row-wise Adagrad, SparseAdam), which update
//!   touched rows in place from de-duplicated gradients.
//! * [`cache`]: tables larger than the device, rows in a backing store behind an LRU cache of
//!   hot rows with write-back.
//! * [`shard`]: the embedding bag sharded table-wise or row-wise over a communicator's ranks.
//! * [`model`]: DeepFM and Wide & Deep (CPU), the dense part stepped by tilearn-optim's AdamW;
//!   [`metrics`]: exact AUC.
//! * [`data`]: Criteo's TSV format, a synthetic Criteo-shaped generator with a known
//!   ground-truth model, binary shards and their loader.
//! * [`train`]: the training loop (held-out exact AUC, samples/s) of `tilearn ctr train`, over
//!   any [`CtrStepper`] (the CPU [`CtrModel`], or `cuda::GpuCtrTrainer`);
//!   [`checkpoint`]: its checkpoints with exact resume ([`tensor_file`]: the safetensors files);
//!   [`bench`]: end-to-end samples/s and AUC of `tilearn ctr bench`.

pub mod bench;
pub mod cache;
pub mod checkpoint;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod embedding_bag;
pub mod error;
pub mod hash;
pub mod jagged;
pub mod metrics;
pub mod model;
pub mod shard;
pub mod sparse_optim;
pub mod stepper;
pub mod tables;
pub mod tensor_file;
pub mod train;
pub mod zipf;

pub use data::CtrBatch;
pub use embedding_bag::{embedding_bag_backward_update, embedding_bag_forward};
pub use error::{RecsysError, Result};
pub use jagged::JaggedBatch;
pub use metrics::auc;
pub use model::{CtrConfig, CtrModel, ModelKind};
pub use sparse_optim::{RowRule, RowStateMut, SparseOptimizer, SparseState};
pub use stepper::CtrStepper;
pub use tables::{EmbeddingTables, Pooling, TableLayout, TableSpec};
pub use zipf::Zipf;
