//! A call's inputs on their way to the device: shape and token-id checks, the label shift, and
//! the uploads through the page-locked staging buffers.

use tilearn_ops::OpsError;
use tilearn_ops::cpu::{IGNORE_INDEX, check_token_ids};

use super::arena::Dims;
use super::{GpuLlama, cuda_err, invalid};
use crate::error::Result;
use crate::model::{check_call_shape, count_valid_targets};

impl GpuLlama {
    /// Checks a call's shape against the arena and the token ids against the vocabulary,
    /// uploads the ids (one host-to-device copy) and returns the call's dims.
    pub(super) fn prepare(&mut self, ids: &[u32], batch: usize, seq: usize) -> Result<Dims> {
        // The call carves the arena: whole weights a ZeRO-2 save or load left there are gone.
        if self.whole_in_arena {
            self.whole_in_arena = false;
            self.grads_hold_params = false;
        }
        check_call_shape(ids, batch, seq)?;
        let prefix_ok = seq == self.seq || (seq < self.seq && self.rope_prefix_ok);
        if batch > self.batch || !prefix_ok {
            return Err(invalid(
                "batch/seq",
                format!(
                    "the device model was built for batch {} x seq {}, called with batch \
                     {batch} x seq {seq}; build GpuLlama::new(.., {batch}, {seq}, ..)",
                    self.batch, self.seq
                ),
            ));
        }
        check_token_ids(ids, self.full_vocab())?;
        if let Some((_, pb, ps)) = &self.position_ids
            && (*pb, *ps) != (batch, seq)
        {
            return Err(invalid(
                "position_ids",
                format!(
                    "were set for batch {pb} x seq {ps}, but the call is batch {batch} x seq \
                     {seq}; call set_position_ids for every packed batch (None for unpacked)"
                ),
            ));
        }
        let n = batch * seq;
        self.host_ids
            .as_mut_slice()
            .map_err(|e| cuda_err("staging the token ids", e))?[..n]
            .copy_from_slice(ids);
        // The whole (capacity-sized) staging buffer goes up in one copy; only the first `n`
        // ids are read by this call.
        let stream = self.device.stream().clone();
        stream
            .memcpy_htod(&self.host_ids, &mut self.ids)
            .map_err(|e| cuda_err("uploading the token ids", e))?;
        Ok(Dims::new(&self.config, batch, seq))
    }

    /// Sets the position ids (`[batch, seq]`) of the packed rows of the following calls of
    /// shape `batch x seq` (`None`: one sequence a row, positions `0..seq`). Positions restart
    /// at 0 where an example starts ([`tilearn_ops::check_positions`]); RoPE rotates by them and
    /// attention keeps every query inside its example, as if each example ran alone. A call of
    /// another shape is refused until they are set again. Checked here and uploaded once.
    pub fn set_position_ids(
        &mut self,
        positions: Option<&[i32]>,
        batch: usize,
        seq: usize,
    ) -> Result<()> {
        let Some(pos) = positions else {
            self.position_ids = None;
            return Ok(());
        };
        if batch > self.batch || seq > self.seq {
            return Err(invalid(
                "position_ids",
                format!(
                    "batch {batch} x seq {seq} exceeds the device model's batch {} x seq {}",
                    self.batch, self.seq
                ),
            ));
        }
        tilearn_ops::check_positions(pos, batch, seq)?;
        let stream = self.device.stream().clone();
        let buf = stream
            .clone_htod(pos)
            .map_err(|e| cuda_err("uploading the position ids", e))?;
        self.position_ids = Some((buf, batch, seq));
        Ok(())
    }

    /// Shifts Hugging Face *unshifted* `labels` into targets (position `t` predicts
    /// `labels[t + 1]`, the last position of a sequence nothing), checks them and uploads them
    /// (one host-to-device copy). Returns the number of valid targets.
    pub(super) fn upload_targets(&mut self, labels: &[i32], d: &Dims) -> Result<usize> {
        let (n, seq, vocab) = (d.n, d.seq, self.full_vocab());
        if labels.len() != n {
            return Err(invalid(
                "labels",
                format!("has {} entries but batch * seq = {n}", labels.len()),
            ));
        }
        // Validate from `labels` (the staging buffer is write-combined: slow to read back).
        // Target `t` of a row is the row's label `t + 1`; the first label is never a target.
        for (r, row) in labels.chunks(seq).enumerate() {
            if let Some((t, &label)) = row
                .iter()
                .enumerate()
                .skip(1)
                .find(|&(_, &l)| l != IGNORE_INDEX && (l < 0 || l as usize >= vocab))
            {
                return Err(OpsError::LabelOutOfRange {
                    label,
                    position: r * seq + t - 1,
                    vocab,
                }
                .into());
            }
        }
        let host = &mut self
            .host_targets
            .as_mut_slice()
            .map_err(|e| cuda_err("staging the targets", e))?[..n];
        for (trow, lrow) in host.chunks_mut(seq).zip(labels.chunks(seq)) {
            trow[..seq - 1].copy_from_slice(&lrow[1..]);
            trow[seq - 1] = IGNORE_INDEX;
        }
        let stream = self.device.stream().clone();
        stream
            .memcpy_htod(&self.host_targets, &mut self.targets)
            .map_err(|e| cuda_err("uploading the targets", e))?;
        Ok(count_valid_targets(labels, d.batch, seq))
    }
}
