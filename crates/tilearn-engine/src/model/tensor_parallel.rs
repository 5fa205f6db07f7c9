//! Megatron-style tensor parallelism of the CPU model: how a Llama is cut over the ranks of a
//! tensor-parallel group, and one rank's part of it.
//!
//! | tensor | cut | why |
//! | --- | --- | --- |
//! | `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj` | rows (output features) by heads / intermediate | column-parallel: each rank computes its heads and its MLP columns alone |
//! | `o_proj`, `down_proj` | columns (input features) | row-parallel: each rank's product is a partial sum, completed by one all-reduce |
//! | `embed_tokens`, `lm_head` | rows by vocabulary ([`chunk_range`]: the first `V mod tp` ranks one row more) | vocabulary-parallel: the full logits never exist on one rank |
//! | norms | replicated | their inputs are complete on every rank |
//!
//! With grouped-query attention the key/value heads are split when `tp` divides their count and
//! replicated when their count divides `tp` (rank `r` holds kv head `r·Hkv/tp`, as Megatron
//! does); the replicas' gradients are summed over the ranks that hold the same head.
//!
//! The forward and backward are those of [`super::LlamaForCausalLM`] run on the rank's local
//! config (its head, intermediate and vocabulary counts) with a [`super::Split`] that completes
//! the partial results: two all-reduces per layer each way, and the vocabulary-parallel
//! embedding and cross entropy (see [`super::model_parallel::RankModel`]).

use std::ops::Range;

use tilearn_parallel::communicator::chunk_range;

use crate::config::LlamaConfig;
use crate::error::{EngineError, Result};
use crate::params::ParamStore;

/// A rank's place in a tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorShard {
    pub rank: usize,
    pub size: usize,
}

impl TensorShard {
    pub const WHOLE: TensorShard = TensorShard { rank: 0, size: 1 };
}

/// How one tensor of the full model is cut for a rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Rows `range` of a `[rows, cols]` (or `[rows]`) tensor.
    Rows(Range<usize>),
    /// Columns `range` of a `[rows, cols]` tensor.
    Cols(Range<usize>),
    /// The whole tensor (replicated on every rank).
    Whole,
}

fn usage(message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: "--tp-size".into(),
        message,
    }
}

/// Which rows of the q (and o) dimension, the kv dimension and the intermediate dimension a
/// rank holds, and its vocabulary rows; checked against the config once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub shard: TensorShard,
    pub q_rows: Range<usize>,
    pub kv_rows: Range<usize>,
    pub inter_rows: Range<usize>,
    pub vocab: Range<usize>,
    /// The kv heads are replicated: this many ranks hold each one.
    pub kv_replicas: usize,
}

impl ShardPlan {
    /// The plan of `shard` for `config`, or an error naming the sizes that cannot be split.
    pub fn new(config: &LlamaConfig, shard: TensorShard) -> Result<ShardPlan> {
        let tp = shard.size;
        let (hq, hkv, d) = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        );
        if tp == 0 || shard.rank >= tp {
            return Err(usage(format!(
                "rank {} of a tensor-parallel group of {tp} does not exist",
                shard.rank
            )));
        }
        if !hq.is_multiple_of(tp) {
            return Err(usage(format!(
                "{tp} does not divide num_attention_heads = {hq}; use a tensor-parallel size \
                 that divides it"
            )));
        }
        if !hkv.is_multiple_of(tp) && !tp.is_multiple_of(hkv) {
            return Err(usage(format!(
                "{tp} neither divides num_key_value_heads = {hkv} nor is a multiple of it; the \
                 kv heads can be split (tp divides them) or replicated (they divide tp)"
            )));
        }
        if !config.intermediate_size.is_multiple_of(tp) {
            return Err(usage(format!(
                "{tp} does not divide intermediate_size = {}; use a tensor-parallel size that \
                 divides it",
                config.intermediate_size
            )));
        }
        if config.vocab_size < tp {
            return Err(usage(format!(
                "vocab_size = {} is smaller than the tensor-parallel size {tp}",
                config.vocab_size
            )));
        }
        // q/k/v biases (Qwen2) are column-parallel: each rank keeps its heads' rows.
        if tp > 1 && (config.o_bias() || config.mlp_bias) {
            return Err(usage(
                "biases on the row-parallel o_proj/down_proj (attention_bias or mlp_bias) are \
                 not supported with tensor parallelism yet; use --tp-size 1"
                    .into(),
            ));
        }
        if tp > 1 && config.family.packed_qkv() {
            return Err(usage(format!(
                "{} keeps q, k and v in one packed tensor (W_pack / query_key_value), which \
                 tensor parallelism does not split yet; use --tp-size 1",
                config.family.architecture()
            )));
        }
        let r = shard.rank;
        let q_per = hq / tp * d;
        let (kv_rows, kv_replicas) = if hkv >= tp {
            let per = hkv / tp * d;
            (r * per..(r + 1) * per, 1)
        } else {
            let head = r * hkv / tp;
            (head * d..(head + 1) * d, tp / hkv)
        };
        let inter_per = config.intermediate_size / tp;
        Ok(ShardPlan {
            shard,
            q_rows: r * q_per..(r + 1) * q_per,
            kv_rows,
            inter_rows: r * inter_per..(r + 1) * inter_per,
            vocab: chunk_range(config.vocab_size, tp, r),
            kv_replicas,
        })
    }

    /// The config of this rank's part: its heads, intermediate size and vocabulary rows.
    pub fn local_config(&self, full: &LlamaConfig) -> LlamaConfig {
        let mut local = full.clone();
        local.num_attention_heads = self.q_rows.len() / full.head_dim;
        local.num_key_value_heads = self.kv_rows.len() / full.head_dim;
        local.intermediate_size = self.inter_rows.len();
        local.vocab_size = self.vocab.len();
        local
    }

    /// How tensor `name` (a Hugging Face Llama name) is cut for this rank.
    pub fn cut(&self, name: &str) -> Cut {
        let base = name
            .strip_suffix(".weight")
            .or_else(|| name.strip_suffix(".bias"))
            .unwrap_or(name);
        let last = base.rsplit('.').next().unwrap_or(base);
        match last {
            "q_proj" => Cut::Rows(self.q_rows.clone()),
            "k_proj" | "v_proj" => Cut::Rows(self.kv_rows.clone()),
            "o_proj" => Cut::Cols(self.q_rows.clone()),
            "gate_proj" | "up_proj" => Cut::Rows(self.inter_rows.clone()),
            "down_proj" => Cut::Cols(self.inter_rows.clone()),
            "embed_tokens" | "lm_head" => Cut::Rows(self.vocab.clone()),
            _ => Cut::Whole,
        }
    }

    /// Whether this rank's gradient of tensor `name` is the one to count in a norm over the
    /// whole model (replicated tensors are counted once: by tp rank 0, and for replicated kv
    /// heads by the first rank holding each head).
    pub fn counts_in_norm(&self, name: &str) -> bool {
        match self.cut(name) {
            Cut::Whole => self.shard.rank == 0,
            Cut::Rows(_) if name.contains("k_proj") || name.contains("v_proj") => {
                self.shard.rank.is_multiple_of(self.kv_replicas)
            }
            _ => true,
        }
    }
}

/// The pieces of a tensor of shape `shape` that `cut` selects: pairs of element ranges in the
/// full tensor and in the rank's local tensor.
pub(crate) fn pieces(shape: &[usize], cut: &Cut) -> Vec<(Range<usize>, Range<usize>)> {
    let cols = if shape.len() == 2 { shape[1] } else { 1 };
    match cut {
        Cut::Whole => {
            let n = shape.iter().product();
            vec![(0..n, 0..n)]
        }
        Cut::Rows(rows) => vec![(rows.start * cols..rows.end * cols, 0..rows.len() * cols)],
        Cut::Cols(range) => {
            let width = range.len();
            (0..shape[0])
                .map(|row| {
                    let f = row * cols + range.start;
                    (f..f + width, row * width..(row + 1) * width)
                })
                .collect()
        }
    }
}

/// This rank's parameters cut out of the full model's.
pub fn slice_params(full: &ParamStore, full_config: &LlamaConfig, plan: &ShardPlan) -> ParamStore {
    let mut local = ParamStore::from_config(&plan.local_config(full_config));
    for spec in &local.specs {
        let full_spec = full
            .spec(&spec.name)
            .expect("the local model has the full model's tensor names");
        let (src, dst) = (&full.data[full_spec.range()], &mut local.data[spec.range()]);
        for (f, l) in pieces(&full_spec.shape, &plan.cut(&spec.name)) {
            dst[l].copy_from_slice(&src[f]);
        }
    }
    local
}

/// The full model's parameters put together from every rank's (`parts[r]` is rank `r`'s flat
/// buffer, possibly padded at the end).
pub fn assemble_params(full_config: &LlamaConfig, parts: &[&[f32]]) -> Result<ParamStore> {
    let mut full = ParamStore::from_config(full_config);
    let size = parts.len();
    for (rank, part) in parts.iter().enumerate() {
        let plan = ShardPlan::new(full_config, TensorShard { rank, size })?;
        for spec in ParamStore::specs_for(&plan.local_config(full_config)) {
            let full_spec = full
                .spec(&spec.name)
                .expect("the local model has the full model's tensor names")
                .clone();
            let (src, dst) = (&part[spec.range()], &mut full.data[full_spec.range()]);
            for (f, l) in pieces(&full_spec.shape, &plan.cut(&spec.name)) {
                dst[f].copy_from_slice(&src[l]);
            }
        }
    }
    Ok(full)
}
