//! What every op of one forward or backward call on the device needs besides its buffers
//! (shared by `compute.rs`, `norms.rs` and `lce.rs`).

use cudarc::driver::CudaView;
use std::sync::Arc;
use tilearn_ops::cuda::{
    self as k, CudaStream, EmbeddingBackwardScratch, GpuRopeTable, LayerNormScratch,
    RmsNormScratch, TokenIdCheck,
};

use super::linalg::Matmul;
use super::resid_offload::ResidOffload;
use super::tensor_parallel::DeviceSums;
use super::vocab_shard::VocabShard;
use crate::model::ModelLayout;

/// What every op of a call needs besides its buffers.
pub(crate) struct Cx<'a> {
    pub stream: &'a Arc<CudaStream>,
    pub layout: &'a ModelLayout,
    pub rope: &'a GpuRopeTable,
    pub mm: &'a mut Matmul,
    pub check: &'a mut TokenIdCheck,
    /// dweight partials of the RMSNorm backwards (allocated once at build).
    pub norm_scratch: &'a mut RmsNormScratch,
    /// dweight/dbias partials of the LayerNorm backwards (Bloom; allocated once at build).
    pub ln_scratch: Option<&'a mut LayerNormScratch>,
    /// Sort buffers of the embedding backward (allocated once at build).
    pub embed_scratch: &'a mut EmbeddingBackwardScratch,
    /// Position ids `[batch, seq]` of packed rows (restarting at 0 per example): RoPE rotates
    /// by them and attention keeps each query inside its example. `None`: one sequence a row.
    pub positions: Option<CudaView<'a, i32>>,
    /// The tensor-parallel group completing the row-parallel outputs and the column-parallel
    /// input gradients (`None`: the whole model on one rank).
    pub tp: Option<&'a dyn DeviceSums>,
    /// The rank's rows of the vocabulary (`None`: the whole vocabulary): the embedding and the
    /// cross entropy complete their partial results over `tp` (see `vocab_parallel.rs`).
    pub vocab: Option<&'a mut VocabShard>,
    /// ALiBi slopes `[q_heads]` (Baichuan-13B): attention biases instead of rotations.
    pub alibi: Option<CudaView<'a, f32>>,
    /// Row maxima of Baichuan2's z-loss (present when `z_loss_weight` is non-zero).
    pub z_loss: Option<&'a mut k::ZLossScratch>,
    /// Checkpoint offload (`None`: every layer boundary stays on the device); present only
    /// with gradient checkpointing, whose arena then holds the ring (see
    /// `resid_offload.rs`).
    pub resid_offload: Option<&'a mut ResidOffload>,
}
