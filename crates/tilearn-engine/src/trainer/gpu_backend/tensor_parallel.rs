//! Tensor parallelism on the CUDA engine: one rank of a Megatron-style split as a
//! [`StepBackend`] (see "Tensor parallelism on the GPU engine" in `docs/ARCHITECTURE.md`).
//!
//! The rank's [`GpuBackend`] is built for the tp-local config (its query and kv heads, its
//! intermediate columns, its rows of the vocabulary) and holds the rank's slices of q/k/v, o,
//! gate/up and down, of the embedding and of `lm_head`, cut exactly as the CPU engine cuts them
//! ([`ShardPlan`]); the four partial sums per layer are completed on device buffers through the
//! tensor-parallel communicator (`gpu/tensor_parallel.rs`). The embedding and the fused linear +
//! cross entropy are **vocabulary-parallel** (`gpu/vocab_parallel.rs`): each rank looks up and
//! scores its own rows of the vocabulary and the group completes the lookup, the row maxima, the
//! sums of exponentials and the target logits, so the full logits never exist on one rank and
//! each rank holds `vocab/tp` rows of the embedding and `lm_head` (weights, gradients, moments).
//! The final norm is replicated.
//!
//! What needs the whole model's view is collective over the group, as on the CPU backend: the
//! gradient norm (replicated tensors counted by tp rank 0), the overflow check, the saved model
//! (every rank's part all-gathered and put together by name; tp rank 0 writes plain Hugging
//! Face files). The optimizer file of a rank is the CPU model-parallel backend's format with its
//! `layout` of tensor slices, so checkpoints interchange with the CPU engine's layouts.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use tilearn_ops::DType;
use tilearn_ops::cpu::VocabSlice;
use tilearn_parallel::{Communicator, scalars};

use super::GpuBackend;
use super::split_rank::split_rank_methods;
use crate::checkpoint::save_pretrained;
use crate::config::{LlamaConfig, ModelFamily};
use crate::cuda_graphs::CudaGraphs;
use crate::data::Batch;
use crate::gpu::{GpuLlama, GroupDeviceSums};
use crate::model::model_parallel::{PipelineShard, assemble_planned};
use crate::model::tensor_parallel::{ShardPlan, TensorShard, slice_params};
use crate::model::{LlamaForCausalLM, LossStats};
use crate::params::{ParamSpec, ParamStore};
use crate::trainer::TrainingArguments;
use crate::trainer::backend::{ModelInit, StepBackend};
use crate::trainer::model_parallel::gather_padded;
use crate::trainer::optimizer_shards::OptimizerCheckpoint;
use crate::{EngineError, Result};

fn usage(flag: &str, message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: flag.into(),
        message,
    }
}

/// One tensor-parallel rank of a model on the GPU engine.
pub struct GpuTensorParallelBackend {
    inner: GpuBackend,
    plan: ShardPlan,
    full_config: LlamaConfig,
    full_specs: Vec<ParamSpec>,
    tp: Arc<dyn Communicator>,
    /// The local gradient ranges this rank counts in the global norm (merged where adjacent).
    norm_ranges: Vec<Range<usize>>,
    name: String,
}

/// The arguments a split rank's engine is built with: eager (every step communicates between
/// its kernels, which a CUDA graph cannot capture; so the description does not announce graphs
/// either) and, over several tensor ranks, a loss-head chunk every rank cuts the same (each
/// chunk all-reduces), whatever the width of its vocabulary slice.
pub(crate) fn split_rank_args(
    args: &TrainingArguments,
    config: &LlamaConfig,
    shard: TensorShard,
    precisions: &[DType],
) -> TrainingArguments {
    let widest = precisions
        .iter()
        .map(|p| p.size_in_bytes())
        .max()
        .unwrap_or(4);
    TrainingArguments {
        cuda_graphs: CudaGraphs::Off,
        lce_chunk: if shard.size > 1 {
            args.lce_chunk.for_vocab_slices(
                args.per_device_train_batch_size * args.seq_len,
                config.vocab_size,
                shard.size,
                widest,
            )
        } else {
            args.lce_chunk
        },
        ..args.clone()
    }
}

/// Joins `gpu` (built for `plan`'s local config) to its tensor group: partial sums completed
/// over `tp` and, over several ranks, the rank's vocabulary rows of `config`'s vocabulary.
pub(crate) fn join_tensor_group(
    gpu: &mut GpuLlama,
    tp: Arc<dyn Communicator>,
    plan: &ShardPlan,
    config: &LlamaConfig,
) -> Result<()> {
    let size = tp.world_size();
    gpu.set_tensor_parallel(Box::new(GroupDeviceSums::new(tp)));
    if size > 1 {
        let vocab = &plan.vocab;
        gpu.set_vocab_slice(VocabSlice::new(
            vocab.start,
            vocab.len(),
            config.vocab_size,
        )?)?;
    }
    Ok(())
}

/// The ranges of a rank's buffer (`specs`) it counts in the global gradient norm under `plan`
/// (replicated tensors on tensor rank 0 only), merged where adjacent.
pub(crate) fn norm_ranges(specs: &[ParamSpec], plan: &ShardPlan) -> Vec<Range<usize>> {
    merged(
        specs
            .iter()
            .filter(|s| plan.counts_in_norm(&s.name))
            .map(ParamSpec::range),
    )
}

/// This rank's share of the squared gradient norm over `range`: the parts of `counted` in it.
/// Synchronises.
pub(crate) fn counted_sum_of_squares(
    gpu: &mut GpuLlama,
    counted: &[Range<usize>],
    range: &Range<usize>,
) -> Result<f64> {
    let mut local = 0.0;
    for r in counted {
        let part = r.start.max(range.start)..r.end.min(range.end);
        if !part.is_empty() {
            local += gpu.grad_sum_of_squares(part)?;
        }
    }
    Ok(local)
}

/// Consecutive ranges merged.
fn merged(ranges: impl IntoIterator<Item = Range<usize>>) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in ranges {
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

/// The plan of rank `shard` of the GPU engine's tensor parallelism, refusing what it does not
/// run yet with the way out.
pub fn gpu_shard_plan(config: &LlamaConfig, shard: TensorShard) -> Result<ShardPlan> {
    // The tp-local engine is the whole model's with fewer heads and columns: right for the
    // RoPE/RMSNorm/SwiGLU families, not for ALiBi (the slopes follow the global head index) or
    // LayerNorm/GeLU families, whose slicing is not checked on the GPU yet.
    if shard.size > 1
        && !matches!(
            config.family,
            ModelFamily::Llama | ModelFamily::Qwen2 | ModelFamily::Mistral
        )
    {
        return Err(usage(
            "--tp-size",
            format!(
                "{} is not split by tensor parallelism on the GPU engine yet (Llama, Qwen2 and \
                 Mistral are); use --tp-size 1, or --device cpu",
                config.family.architecture()
            ),
        ));
    }
    if shard.size > 1 && config.z_loss_weight != 0.0 {
        return Err(usage(
            "--tp-size",
            "Baichuan2's z-loss needs every logit of a row, which the vocabulary-parallel loss \
             head never gathers (nor does the CPU engine's); use --tp-size 1, or set \
             \"z_loss_weight\": 0 in config.json"
                .into(),
        ));
    }
    let plan = ShardPlan::new(config, shard)?;
    if plan.kv_replicas > 1 {
        return Err(usage(
            "--tp-size",
            format!(
                "{} exceeds num_key_value_heads = {}: replicated kv heads are supported on the \
                 CPU engine only so far; use a --tp-size dividing the kv heads, or --device cpu",
                shard.size, config.num_key_value_heads
            ),
        ));
    }
    Ok(plan)
}

impl GpuTensorParallelBackend {
    /// Rank `shard` of the model `config` describes on GPU `ordinal`, its slices taken from
    /// `init` (a Hugging Face directory is read slice by slice; a random initialisation is made
    /// whole on the host and cut), completing its partial sums over `tp` (the tensor-parallel
    /// group, whose rank is `shard.rank`).
    pub fn from_init(
        config: &LlamaConfig,
        init: &ModelInit,
        args: &TrainingArguments,
        (ordinal, precisions): (usize, &[DType]),
        shard: TensorShard,
        tp: Arc<dyn Communicator>,
    ) -> Result<GpuTensorParallelBackend> {
        if tp.world_size() != shard.size || tp.rank() != shard.rank {
            return Err(usage(
                "--tp-size",
                format!(
                    "internal: the tensor-parallel communicator is rank {} of {}, the layout \
                     says rank {} of {}",
                    tp.rank(),
                    tp.world_size(),
                    shard.rank,
                    shard.size
                ),
            ));
        }
        if args.cuda_graphs == CudaGraphs::On {
            return Err(usage(
                "--cuda-graphs",
                "on: a tensor-parallel step all-reduces through the communicator between its \
                 kernels, which a CUDA graph cannot capture; use --cuda-graphs off (or auto)"
                    .into(),
            ));
        }
        let plan = gpu_shard_plan(config, shard)?;
        let local = plan.local_config(config);
        let eager = split_rank_args(args, config, shard, precisions);
        let mut inner = GpuBackend::build(&local, &eager, ordinal, precisions)?;
        join_tensor_group(&mut inner.gpu, tp.clone(), &plan, config)?;
        let full_specs = ParamStore::specs_for(config);
        let norm_ranges = norm_ranges(&inner.specs, &plan);
        let name = format!(
            "{}, tensor-parallel rank {} of {} (vocabulary-parallel embedding, lm_head and loss: \
             rows {}..{} of {})",
            inner.name, shard.rank, shard.size, plan.vocab.start, plan.vocab.end, config.vocab_size
        );
        let mut backend = GpuTensorParallelBackend {
            inner,
            plan,
            full_config: config.clone(),
            full_specs,
            tp,
            norm_ranges,
            name,
        };
        match init {
            ModelInit::Random { seed } => {
                let full = LlamaForCausalLM::from_config(config.clone(), *seed);
                let mine = slice_params(&full.params, config, &backend.plan);
                backend.inner.gpu.upload_params(&mine)?;
            }
            ModelInit::Pretrained(dir) => backend.load_weights(dir)?,
        }
        Ok(backend)
    }

    /// Bytes of this rank's logits buffer (one chunk of the loss head, `[chunk × vocab/tp]`).
    pub fn logits_buffer_bytes(&self) -> usize {
        self.inner.logits_buffer_bytes()
    }

    /// This rank's share of the squared gradient norm over `range` of the local buffer,
    /// summed over the group. Synchronises.
    fn group_sum_of_squares(&mut self, range: &Range<usize>) -> Result<f64> {
        self.inner.optimizer_ready()?;
        let local = counted_sum_of_squares(&mut self.inner.gpu, &self.norm_ranges, range)?;
        Ok(scalars::sum_f64(self.tp.as_ref(), local)?)
    }

    /// Every rank's weights all-gathered and put together as the whole model.
    fn gather_full_params(&self) -> Result<ParamStore> {
        let local = self.inner.gpu.download_params()?.data;
        let (all, longest) = gather_padded(self.tp.as_ref(), &local)?;
        let size = self.tp.world_size();
        let parts = (0..size)
            .map(|rank| {
                let plan = gpu_shard_plan(&self.full_config, TensorShard { rank, size })?;
                let pipe = PipelineShard::single(&self.full_config);
                Ok((plan, pipe, &all[rank * longest..(rank + 1) * longest]))
            })
            .collect::<Result<Vec<_>>>()?;
        assemble_planned(&self.full_config, &parts)
    }
}

impl StepBackend for GpuTensorParallelBackend {
    split_rank_methods!();

    fn forward_backward(
        &mut self,
        batch: &Batch,
        denominator: f64,
        precision: DType,
        loss_scale: f32,
    ) -> Result<f64> {
        // Every rank computes the same row losses (the cross entropy completes its row
        // statistics over the group): the loss is the whole loss, no sum over the group.
        self.inner
            .forward_backward(batch, denominator, precision, loss_scale)
    }

    fn eval_loss(&mut self, batch: &Batch, precision: DType) -> Result<LossStats> {
        self.inner.eval_loss(batch, precision)
    }

    fn unscale_and_check(&mut self, inv_scale: f32) -> Result<bool> {
        let local = self.inner.unscale_and_check(inv_scale)?;
        Ok(scalars::any(self.tp.as_ref(), local)?)
    }

    fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        // The fused AdamW clips inside its kernel with the group's norm (`optimizer_step`).
        self.inner.clip_grad_norm(max_norm)
    }

    fn model(&mut self) -> Result<&LlamaForCausalLM> {
        Err(usage(
            "--tp-size",
            "a tensor-parallel rank holds only its part of the model; the whole model exists \
             in the saved files (the final model is gathered)"
                .into(),
        ))
    }

    fn save_model(
        &mut self,
        dir: &Path,
        config: &LlamaConfig,
        dtype: DType,
        max_shard_bytes: Option<usize>,
    ) -> Result<()> {
        let full = self.gather_full_params()?;
        if self.tp.rank() != 0 {
            return Ok(());
        }
        save_pretrained(dir, config, &full, dtype, max_shard_bytes)
    }

    fn save_optimizer(&mut self, path: &Path) -> Result<()> {
        self.inner
            .save_optimizer_slices(path, &self.plan, &self.full_specs)
    }

    /// Reads this rank's slices of the weights and of the optimizer state, whatever layout
    /// (or engine) wrote the checkpoint.
    fn restore(&mut self, dir: &Path, optimizer: &OptimizerCheckpoint) -> Result<()> {
        self.inner
            .restore_optimizer_slices(optimizer, &self.plan, &self.full_specs)?;
        self.load_weights(dir)
    }

    fn load_weights(&mut self, dir: &Path) -> Result<()> {
        self.inner
            .load_weight_slices(dir, &self.full_config, &self.full_specs, &self.plan)
    }
}

#[cfg(test)]
mod tests {
    use super::{gpu_shard_plan, merged};
    use crate::config::LlamaConfig;
    use crate::model::tensor_parallel::{Cut, TensorShard};

    fn config() -> LlamaConfig {
        LlamaConfig::from_json_str(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 257, "max_position_embeddings": 32,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
            "test/config.json",
        )
        .unwrap()
    }

    /// The GPU plans cut the vocabulary as the CPU engine does (257 = 129 + 128, no padding):
    /// vocabulary-parallel is the default, and the only mode.
    #[test]
    fn gpu_plans_cut_the_vocabulary_like_the_cpu_engine() {
        let config = config();
        for (rank, rows) in [(0, 0..129), (1, 129..257)] {
            let plan = gpu_shard_plan(&config, TensorShard { rank, size: 2 }).unwrap();
            assert_eq!(plan.vocab, rows);
            assert_eq!(plan.local_config(&config).vocab_size, rows.len());
            assert_eq!(plan.cut("lm_head.weight"), Cut::Rows(rows.clone()));
            assert_eq!(plan.cut("model.embed_tokens.weight"), Cut::Rows(rows));
        }
    }

    /// Baichuan2's z-loss needs every logit of a row: refused under tp with the way out, before
    /// any device is touched; one rank keeps it.
    #[test]
    fn z_loss_is_refused_under_tensor_parallelism() {
        let config = LlamaConfig {
            z_loss_weight: 2e-4,
            ..config()
        };
        let err = gpu_shard_plan(&config, TensorShard { rank: 0, size: 2 })
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("z-loss") && err.contains("--tp-size 1"),
            "{err}"
        );
        assert!(gpu_shard_plan(&config, TensorShard::WHOLE).is_ok());
    }

    #[test]
    fn adjacent_ranges_merge_and_gaps_stay() {
        assert_eq!(merged([0..3, 3..5, 7..9, 9..10]), vec![0..5, 7..10]);
        assert_eq!(merged(Vec::new()), Vec::<std::ops::Range<usize>>::new());
    }
}
