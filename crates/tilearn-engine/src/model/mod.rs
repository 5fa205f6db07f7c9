//! `LlamaForCausalLM` on the CPU: forward (logits), and forward + backward with the Hugging
//! Face causal-LM loss, over one flat parameter buffer.
//!
//! The compute is generic over [`Real`]: the model trains in f32 (its
//! [`ParamStore`]), and [`LlamaForCausalLM::forward_backward_with`] runs the same code on an f64
//! copy of the parameters for the finite-difference tests.

mod activations;
mod block;
pub mod generate;
mod layout;
pub mod model_parallel;
pub(crate) mod norm;
mod partial_sums;
pub mod pipeline_stage;
mod stage;
pub mod tensor_parallel;
mod vocab_parallel;

use std::ops::Range;
use std::path::Path;

use tilearn_ops::DType;
use tilearn_ops::cpu::{IGNORE_INDEX, Real};

pub use activations::{Activations, GradScratch, LayerActs};
pub use layout::{LayerLayout, LinearLayout, ModelLayout};
pub use partial_sums::{PartialSums, Whole};

use block::Dims;
use stage::{StageParts, stage_backward, stage_forward};

use crate::checkpoint;
use crate::config::{GenerationConfig, LlamaConfig};
use crate::error::{EngineError, Result};
use crate::params::ParamStore;

/// Loss of one `forward_backward` call.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossStats {
    /// Sum of the per-token cross entropies (natural log) over the non-ignored targets.
    pub loss_sum: f64,
    /// Number of non-ignored targets.
    pub valid_tokens: usize,
}

impl LossStats {
    /// Mean loss over this call's targets (0 when there are none).
    pub fn mean(&self) -> f64 {
        if self.valid_tokens == 0 {
            0.0
        } else {
            self.loss_sum / self.valid_tokens as f64
        }
    }
}

/// How the tensors a call computes with relate to the full model's: the whole model, or one
/// tensor-parallel rank's slices (see [`tensor_parallel`]).
pub(crate) struct Split<'a, R> {
    /// Completes the partial results of a rank (no-ops for the whole model).
    pub sums: &'a dyn PartialSums<R>,
    /// This rank's rows of the embedding and `lm_head` (the whole vocabulary when unsplit).
    pub vocab: Range<usize>,
    pub full_vocab: usize,
    /// Megatron's sequence parallelism: each rank holds its chunk of the rows between the
    /// tensor-parallel products (see [`partial_sums::RowSplit`]).
    pub sequence_parallel: bool,
}

impl<'a, R> Split<'a, R> {
    fn whole(vocab: usize) -> Split<'static, R> {
        Split {
            sums: &Whole,
            vocab: 0..vocab,
            full_vocab: vocab,
            sequence_parallel: false,
        }
    }

    fn is_whole(&self) -> bool {
        self.sums.parts() == 1
    }

    /// How the rows between the products are held over the ranks.
    fn rows(&self) -> partial_sums::RowSplit<'a, R> {
        partial_sums::RowSplit {
            sums: self.sums,
            sequence: self.sequence_parallel && !self.is_whole(),
        }
    }
}

/// Number of non-ignored targets in Hugging Face *unshifted* `labels` (`[batch, seq]`): position
/// `t` predicts `labels[t + 1]`, so the first label of each sequence is never a target.
pub fn count_valid_targets(labels: &[i32], batch: usize, seq: usize) -> usize {
    if seq == 0 {
        return 0;
    }
    labels
        .chunks(seq)
        .take(batch)
        .map(|row| row[1..].iter().filter(|&&l| l != IGNORE_INDEX).count())
        .sum()
}

fn check_labels(labels: &[i32], n: usize) -> Result<()> {
    if labels.len() != n {
        return Err(invalid(
            "labels",
            format!("has {} entries but batch * seq = {n}", labels.len()),
        ));
    }
    Ok(())
}

/// Hugging Face's shift: position `t` predicts `labels[t + 1]`; the last position of a
/// sequence has no target.
pub(crate) fn shift_targets(targets: &mut [i32], labels: &[i32], seq: usize) {
    for (trow, lrow) in targets.chunks_mut(seq).zip(labels.chunks(seq)) {
        trow[..seq - 1].copy_from_slice(&lrow[1..]);
        trow[seq - 1] = IGNORE_INDEX;
    }
}

/// A Llama causal language model: configuration plus the flat f32 parameters.
#[derive(Clone, Debug)]
pub struct LlamaForCausalLM {
    pub config: LlamaConfig,
    pub params: ParamStore,
}

impl LlamaForCausalLM {
    /// A freshly initialised model (Hugging Face `_init_weights` scheme, `initializer_range`).
    pub fn from_config(config: LlamaConfig, seed: u64) -> LlamaForCausalLM {
        let mut params = ParamStore::from_config(&config);
        params.init_random_with_pad(seed, config.initializer_range, config.pad_token_id);
        LlamaForCausalLM { config, params }
    }

    /// Loads `config.json` and the safetensors weights of a Hugging Face checkpoint directory.
    pub fn from_pretrained(dir: impl AsRef<Path>) -> Result<LlamaForCausalLM> {
        let dir = dir.as_ref();
        let mut config = LlamaConfig::from_file(dir.join(checkpoint::CONFIG_FILE))?;
        config.generation = GenerationConfig::from_dir(dir)?;
        let params = checkpoint::load_params(dir, &config)?;
        Ok(LlamaForCausalLM { config, params })
    }

    /// [`Self::from_pretrained`] with the value of `TILEARN_LLM_BAICHUAN_13B` given instead of
    /// read from the environment (see [`LlamaConfig::from_file_with_baichuan_13b`]).
    pub fn from_pretrained_with_baichuan_13b(
        dir: impl AsRef<Path>,
        baichuan_13b: Option<&str>,
    ) -> Result<LlamaForCausalLM> {
        let dir = dir.as_ref();
        let mut config = LlamaConfig::from_file_with_baichuan_13b(
            dir.join(checkpoint::CONFIG_FILE),
            baichuan_13b,
        )?;
        config.generation = GenerationConfig::from_dir(dir)?;
        let params = checkpoint::load_params(dir, &config)?;
        Ok(LlamaForCausalLM { config, params })
    }

    /// Writes `config.json` and the weights (in `dtype`, sharded above `max_shard_bytes`) so
    /// that transformers' `from_pretrained` loads them.
    pub fn save_pretrained(
        &self,
        dir: impl AsRef<Path>,
        dtype: DType,
        max_shard_bytes: Option<usize>,
    ) -> Result<()> {
        checkpoint::save_pretrained(
            dir.as_ref(),
            &self.config,
            &self.params,
            dtype,
            max_shard_bytes,
        )
    }

    /// The resolved parameter layout (ranges into `params.data` and gradient buffers).
    pub fn layout(&self) -> ModelLayout {
        ModelLayout::from_config(&self.config)
    }

    /// Logits `[batch * seq * vocab]` of `ids` (`[batch, seq]`), borrowed from `acts`.
    pub fn forward_logits<'a>(
        &self,
        ids: &[u32],
        batch: usize,
        seq: usize,
        acts: &'a mut Activations<f32>,
    ) -> Result<&'a [f32]> {
        self.forward_logits_with(&self.params.data, ids, batch, seq, acts)
    }

    /// Forward and backward with Hugging Face *unshifted* `labels` (`-100` = ignore; target of
    /// position `t` is `labels[t + 1]`). The loss is `loss_sum / loss_denominator`, the
    /// denominator defaulting to this call's number of valid targets (pass the whole
    /// accumulated batch's [`count_valid_targets`] when accumulating). Parameter gradients are
    /// added into `grads` (same layout as `params.data`).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward(
        &self,
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        loss_denominator: Option<f64>,
        acts: &mut Activations<f32>,
        grads: &mut [f32],
    ) -> Result<LossStats> {
        self.forward_backward_with(
            &self.params.data,
            ids,
            labels,
            batch,
            seq,
            loss_denominator,
            acts,
            grads,
        )
    }

    /// [`Self::forward_logits`] on another copy of the parameters (same layout, any [`Real`]).
    pub fn forward_logits_with<'a, R: Real>(
        &self,
        params: &[R],
        ids: &[u32],
        batch: usize,
        seq: usize,
        acts: &'a mut Activations<R>,
    ) -> Result<&'a [R]> {
        let d = self.check_call(params, ids, batch, seq, acts)?;
        forward(&d, params, ids, acts, &Split::whole(d.vocab))?;
        Ok(&acts.logits[..d.n * d.vocab])
    }

    /// The loss of `ids` against Hugging Face *unshifted* `labels` with the forward only
    /// (evaluation): the same token losses [`Self::forward_backward_with`] sums, on the
    /// parameters `params` (the master weights or a copy rounded to the run's precision).
    pub fn forward_loss_with<R: Real>(
        &self,
        params: &[R],
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        acts: &mut Activations<R>,
    ) -> Result<LossStats> {
        let split = Split::whole(self.config.vocab_size);
        self.forward_loss_split(params, ids, labels, batch, seq, acts, &split)
    }

    /// [`Self::forward_loss_with`] on this model's part of a split model.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_loss_split<R: Real>(
        &self,
        params: &[R],
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        acts: &mut Activations<R>,
        split: &Split<'_, R>,
    ) -> Result<LossStats> {
        let d = self.check_call(params, ids, batch, seq, acts)?;
        check_labels(labels, d.n)?;
        shift_targets(&mut acts.targets[..d.n], labels, seq);
        forward(&d, params, ids, acts, split)?;
        let (logits, targets) = (&acts.logits[..d.n * d.vocab], &acts.targets[..d.n]);
        let ce = vocab_parallel::loss(logits, targets, d.vocab, d.z_loss_weight, split)?;
        Ok(LossStats {
            loss_sum: ce.loss_sum,
            valid_tokens: ce.valid,
        })
    }

    /// [`Self::forward_backward`] on another copy of the parameters (same layout, any
    /// [`Real`]); `grads` has the same layout.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward_with<R: Real>(
        &self,
        params: &[R],
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        loss_denominator: Option<f64>,
        acts: &mut Activations<R>,
        grads: &mut [R],
    ) -> Result<LossStats> {
        let split = Split::whole(self.config.vocab_size);
        self.forward_backward_split(
            params,
            ids,
            labels,
            batch,
            seq,
            loss_denominator,
            acts,
            grads,
            &split,
        )
    }

    /// [`Self::forward_backward_with`] on this model's part of a split model.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_backward_split<R: Real>(
        &self,
        params: &[R],
        ids: &[u32],
        labels: &[i32],
        batch: usize,
        seq: usize,
        loss_denominator: Option<f64>,
        acts: &mut Activations<R>,
        grads: &mut [R],
        split: &Split<'_, R>,
    ) -> Result<LossStats> {
        let d = self.check_call(params, ids, batch, seq, acts)?;
        check_labels(labels, d.n)?;
        if grads.len() != acts.layout.numel {
            return Err(invalid(
                "grads",
                format!(
                    "has {} entries but the model has {} parameters; allocate it like params.data",
                    grads.len(),
                    acts.layout.numel
                ),
            ));
        }
        let valid = count_valid_targets(labels, batch, seq);
        let denominator = match loss_denominator {
            None => valid as f64,
            Some(x) if x >= 0.0 && x.is_finite() => x,
            Some(x) => {
                return Err(invalid(
                    "loss_denominator",
                    format!("{x} is not a non-negative finite number; pass the token count"),
                ));
            }
        };
        shift_targets(&mut acts.targets[..d.n], labels, seq);

        let layout = acts.layout.clone();
        let parts = StageParts::whole(&layout);
        stage_forward(&d, &parts, params, ids, None, acts, split)?;
        // The gradients of loss_sum / denominator.
        let grad_scale = if denominator > 0.0 {
            1.0 / denominator
        } else {
            0.0
        };
        let loss = stage_backward(
            &d, &parts, params, grads, ids, None, grad_scale, acts, split,
        )?
        .expect("the whole model ends with the loss");
        debug_assert_eq!(loss.valid, valid);
        Ok(LossStats {
            loss_sum: loss.loss_sum,
            valid_tokens: loss.valid,
        })
    }

    fn check_call<R: Real>(
        &self,
        params: &[R],
        ids: &[u32],
        batch: usize,
        seq: usize,
        acts: &Activations<R>,
    ) -> Result<Dims> {
        let layout = &acts.layout;
        if params.len() != layout.numel {
            return Err(invalid(
                "params",
                format!(
                    "has {} entries but the model has {} parameters",
                    params.len(),
                    layout.numel
                ),
            ));
        }
        check_call_shape(ids, batch, seq)?;
        let prefix_ok = seq == acts.seq || (seq < acts.seq && acts.rope_prefix_ok);
        if batch > acts.batch || !prefix_ok {
            return Err(invalid(
                "activations",
                format!(
                    "built for batch {} x seq {}, called with batch {batch} x seq {seq}; build \
                     Activations::new(config, {batch}, {seq}, ..)",
                    acts.batch, acts.seq
                ),
            ));
        }
        if acts.resid.len()
            != (self.config.num_hidden_layers + 1) * acts.batch * acts.seq * self.config.hidden_size
            || acts.logits.len() != acts.batch * acts.seq * self.config.vocab_size
        {
            return Err(invalid(
                "activations",
                "were built for another config; build them with this model's config".to_string(),
            ));
        }
        Ok(Dims::new(&self.config, batch, seq))
    }
}

/// The checks every forward makes before anything else, on the CPU and the GPU alike: a
/// positive `batch` and `seq`, and `batch * seq` token ids.
pub(crate) fn check_call_shape(ids: &[u32], batch: usize, seq: usize) -> Result<()> {
    if batch == 0 || seq == 0 {
        return Err(invalid("batch/seq", "must both be positive".to_string()));
    }
    if ids.len() != batch * seq {
        return Err(invalid(
            "ids",
            format!(
                "has {} entries but batch * seq = {}",
                ids.len(),
                batch * seq
            ),
        ));
    }
    Ok(())
}

fn invalid(argument: &str, message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: argument.to_string(),
        message,
    }
}

/// Forward through the final norm and `lm_head` into `acts.logits` (this rank's vocabulary
/// columns when split).
fn forward<R: Real>(
    d: &Dims,
    params: &[R],
    ids: &[u32],
    acts: &mut Activations<R>,
    split: &Split<'_, R>,
) -> Result<()> {
    let layout = acts.layout.clone();
    stage_forward(
        d,
        &StageParts::whole(&layout),
        params,
        ids,
        None,
        acts,
        split,
    )
}
