//! The vocabulary-parallel embedding and loss head of a tensor-parallel rank on the device
//! (Megatron's): the rank holds rows `slice.start .. slice.start + slice.rows` of the embedding
//! and of `lm_head` (cut as the CPU engine cuts them, `chunk_range`), so the full
//! `[tokens × vocab]` logits never exist on one rank.
//!
//! * **Embedding.** Ids in the slice copy their row, other ids give zero rows
//!   (`embedding_forward_slice`), then one all-reduce (sum) of the `[tokens, hidden]` output
//!   completes the lookup: exact in every type (each element is one row plus zeros). The
//!   backward adds the (replicated) hidden gradient into the rank's own rows only.
//! * **Cross entropy**, per chunk of the fused linear + cross entropy (`lce.rs`), on the chunk's
//!   local logits `[rows × slice.rows]`: `vocab_ce_partials` (row max, sum of `exp(x − max)`,
//!   the target's logit where the slice holds it), all-reduce MAX of the maxima,
//!   `vocab_ce_rescale` (the partial sums brought to the global max), one all-reduce SUM of the
//!   sums and target logits together, then `vocab_ce_fused_finish` (row losses — the same on
//!   every rank — and the local logits overwritten with `(softmax − onehot) · factor`). The
//!   hidden state's gradient `dlogits · lm_head` is then a partial sum over the ranks, completed
//!   by one all-reduce of `dxn` after the last chunk; `lm_head`'s gradient is local.
//!
//! The statistics and their two steps live in `vocab_shard.rs`.

use cudarc::driver::{CudaView, CudaViewMut};
use tilearn_ops::cpu::VocabSlice;
use tilearn_ops::cuda::{self as k, DeviceFloat, VocabCeStats};

use super::compute::Cx;
use super::tensor_parallel::complete;
use super::vocab_shard::VocabShard;
use super::{GpuLlama, invalid};
use crate::error::Result;

/// The vocabulary-parallel loss of one chunk (training): `row_loss` written, the local
/// `logits` overwritten with their gradient times `grad_scale` (see the module docs).
pub(crate) fn loss_and_grad_chunk<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    logits: &mut CudaViewMut<'_, T>,
    targets: &CudaView<'_, i32>,
    grad_scale: f64,
    row_loss: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let (stream, tp) = (cx.stream, cx.tp);
    let shard = shard_of(cx)?;
    let slice = shard.slice;
    let rows = targets.len();
    let mut st = shard.carve(rows)?;
    st.complete(stream, tp, &logits.as_view(), targets, slice)?;
    let (global_max, sumexp, target_logit) = st.completed();
    let stats = VocabCeStats {
        global_max: &global_max,
        sumexp: &sumexp,
        target_logit: &target_logit,
    };
    k::vocab_ce_fused_finish(stream, logits, targets, slice, stats, grad_scale, row_loss)?;
    Ok(())
}

/// The vocabulary-parallel loss of one chunk (evaluation): `row_loss` written, the logits
/// left as they are.
pub(crate) fn loss_chunk<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    logits: &CudaView<'_, T>,
    targets: &CudaView<'_, i32>,
    row_loss: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let (stream, tp) = (cx.stream, cx.tp);
    let shard = shard_of(cx)?;
    let slice = shard.slice;
    let rows = targets.len();
    let mut st = shard.carve(rows)?;
    st.complete(stream, tp, logits, targets, slice)?;
    let (global_max, sumexp, target_logit) = st.completed();
    let stats = VocabCeStats {
        global_max: &global_max,
        sumexp: &sumexp,
        target_logit: &target_logit,
    };
    k::vocab_ce_loss_finish(stream, targets, slice.full, stats, row_loss)?;
    Ok(())
}

fn shard_of<'c>(cx: &'c mut Cx<'_>) -> Result<&'c mut VocabShard> {
    cx.vocab.as_deref_mut().ok_or_else(|| {
        invalid(
            "vocabulary-parallel loss head",
            "internal: called on a model without a vocabulary slice".into(),
        )
    })
}

/// The vocabulary the targets and ids index: the whole one, also on a rank holding a slice.
pub(crate) fn full_vocab(cx: &Cx<'_>, local_vocab: usize) -> usize {
    cx.vocab.as_ref().map_or(local_vocab, |v| v.slice.full)
}

/// `out = table[ids]` (`[tokens, dim]`, written): the plain lookup, or on a rank holding a
/// slice its rows (zeros for other ids) completed over the tensor-parallel group.
pub(crate) fn embedding_lookup<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    ids: &CudaView<'_, u32>,
    table: &CudaView<'_, T>,
    dim: usize,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    match cx.vocab.as_ref().map(|v| v.slice) {
        None => k::embedding_forward(cx.stream, ids, table, dim, out, cx.check)?,
        Some(slice) => {
            k::embedding_forward_slice(cx.stream, ids, table, slice, dim, out, cx.check)?;
            complete(cx.tp, out)?;
        }
    }
    Ok(())
}

/// `dtable[ids[r]] += dout[r]` (`+=`, f32) for the rows this rank holds (all of them without
/// a slice); `dout` is complete on every rank.
pub(crate) fn embedding_grad<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    ids: &CudaView<'_, u32>,
    dout: &CudaViewMut<'_, T>,
    dim: usize,
    dtable: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    match cx.vocab.as_ref().map(|v| v.slice) {
        None => k::embedding_backward(
            cx.stream,
            ids,
            dout,
            dim,
            dtable,
            cx.check,
            cx.embed_scratch,
        )?,
        Some(slice) => k::embedding_backward_slice(
            cx.stream,
            ids,
            dout,
            slice,
            dim,
            dtable,
            cx.check,
            cx.embed_scratch,
        )?,
    }
    Ok(())
}

impl GpuLlama {
    /// Makes this model hold rows `slice.start .. slice.start + slice.rows` of a vocabulary of
    /// `slice.full` words (a tensor-parallel rank's embedding and `lm_head`,
    /// [`ShardPlan::vocab`](crate::model::tensor_parallel::ShardPlan::vocab)): it must have
    /// been built for a config of `slice.rows` words and hold those rows. Ids and labels are
    /// then checked against the whole vocabulary, the embedding and the cross entropy complete
    /// their partial results through the group of
    /// [`set_tensor_parallel`](Self::set_tensor_parallel), and
    /// [`forward_logits`](Self::forward_logits) returns this rank's columns `[tokens ×
    /// slice.rows]`. Baichuan2's z-loss needs every logit of a row and is refused.
    pub fn set_vocab_slice(&mut self, slice: VocabSlice) -> Result<()> {
        let slice = VocabSlice::new(slice.start, slice.rows, slice.full)?;
        if slice.rows != self.config.vocab_size {
            return Err(invalid(
                "vocabulary slice",
                format!(
                    "holds {} rows but the device model was built for a vocabulary of {}; \
                     build it for the rank's local config (ShardPlan::local_config)",
                    slice.rows, self.config.vocab_size
                ),
            ));
        }
        if self.config.z_loss_weight != 0.0 {
            return Err(invalid(
                "z_loss_weight",
                "Baichuan2's z-loss is not supported with a vocabulary-parallel head (tensor \
                 parallelism); train with --tp-size 1 or set \"z_loss_weight\": 0 in \
                 config.json"
                    .into(),
            ));
        }
        let stream = self.device.stream().clone();
        let shard = VocabShard::new(&stream, slice, self.lce_rows.max(1))?;
        self.check = k::TokenIdCheck::new(&stream, slice.full)?;
        let previous = self.vocab.as_ref().map_or(0, VocabShard::bytes);
        self.memory.workspace_bytes = self.memory.workspace_bytes - previous + shard.bytes();
        self.memory.own_bytes = self.memory.own_bytes - previous + shard.bytes();
        self.graphs.invalidate();
        self.vocab = Some(shard);
        Ok(())
    }

    /// The rows of the vocabulary this model holds, when it is a vocabulary-parallel rank.
    pub fn vocab_slice(&self) -> Option<VocabSlice> {
        self.vocab.as_ref().map(|v| v.slice)
    }

    /// The vocabulary ids and labels index (the whole one on a vocabulary-parallel rank).
    pub(super) fn full_vocab(&self) -> usize {
        self.vocab
            .as_ref()
            .map_or(self.config.vocab_size, |v| v.slice.full)
    }
}
