//! The parameters one rank holds under tensor and pipeline parallelism: the decoder layers of
//! its pipeline stage with their linear weights split by TP (Megatron: q/k/v and gate/up by
//! output columns, o and down by input rows; replicated kv heads held whole; norms and the
//! row-parallel biases replicated), the vocabulary-parallel embedding on the first stage and
//! the vocabulary-parallel lm_head and final norm on the last. A tied lm_head is the embedding
//! itself with one stage and a second copy on the last stage with several (as Megatron).

use super::layout::{HeadSplit, Layout};
use crate::config::LlamaConfig;
use crate::model::model_parallel::partition_layers;

/// Which pipeline rank: the first holds the embedding and the most in-flight activations, the
/// last the lm_head, the final norm and the logits. With one stage it is both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagePosition {
    pub first: bool,
    pub last: bool,
}

impl StagePosition {
    pub const ONLY: StagePosition = StagePosition {
        first: true,
        last: true,
    };

    /// Every rank of `layout`'s pipeline with the decoder layers it holds, cut as training
    /// cuts them ([`partition_layers`]: chunks balanced by cost with the head and loss on the
    /// last, chunk `c` on rank `c mod pp` when interleaved), so the advisor judges the layers
    /// each stage really gets.
    pub fn pipeline_ranks(
        config: &LlamaConfig,
        layout: &Layout,
        seq: usize,
    ) -> Result<Vec<(StagePosition, usize)>, String> {
        let pp = layout.pp;
        let chunks =
            partition_layers(config, pp * layout.virtual_stages, seq).map_err(|e| e.to_string())?;
        let mut layers = vec![0usize; pp];
        for (c, chunk) in chunks.iter().enumerate() {
            layers[c % pp] += chunk.len();
        }
        Ok(layers
            .into_iter()
            .enumerate()
            .map(|(rank, held)| {
                let position = StagePosition {
                    first: rank == 0,
                    last: rank + 1 == pp,
                };
                (position, held)
            })
            .collect())
    }
}

/// The widths of one tensor-parallel rank's slice of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankWidths {
    pub hidden: usize,
    pub q: usize,
    pub kv: usize,
    pub inter: usize,
    /// Vocabulary rows of the embedding and lm_head (padded up so TP divides them).
    pub vocab: usize,
    pub q_heads: usize,
    pub head_dim: usize,
}

impl RankWidths {
    pub fn new(config: &LlamaConfig, split: HeadSplit, tp: usize) -> RankWidths {
        RankWidths {
            hidden: config.hidden_size,
            q: split.q_heads * config.head_dim,
            kv: split.kv_heads * config.head_dim,
            inter: config.intermediate_size / tp,
            vocab: config.vocab_size.div_ceil(tp),
            q_heads: split.q_heads,
            head_dim: config.head_dim,
        }
    }
}

/// Parameters of one rank, split by what they cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankParams {
    /// Every parameter the rank holds (what its weights, gradients and optimizer state count).
    pub total: u64,
    /// Weights that enter a GEMM per token (the decoder linears and the lm_head; not the
    /// embedding lookup, the norms or biases): 6 FLOPs each per token for forward + backward.
    pub matmul: u64,
    /// The matmul weights of the decoder layers alone (what checkpointing recomputes).
    pub layer_matmul: u64,
    /// Parameters of one decoder layer on this rank.
    pub per_layer: u64,
    /// The embedding table when nothing else on this rank reads it (the first stage, untied
    /// or lm_head elsewhere): the per-layer working copy casts it into the layer window just
    /// before the lookup instead of keeping it (0 otherwise).
    pub lookup_only_table: u64,
}

/// The parameters of the rank at `position` holding `layers` decoder layers.
pub fn rank_params(
    config: &LlamaConfig,
    widths: RankWidths,
    position: StagePosition,
    layers: usize,
) -> RankParams {
    let w = widths;
    let c = w.hidden as u64;
    let (q, kv, i) = (w.q as u64, w.kv as u64, w.inter as u64);
    let linear = c * q + 2 * c * kv + q * c + 3 * c * i;
    let mut other = 2 * c; // the two norms
    if config.qkv_bias() {
        // q/k/v biases follow their columns; o_proj's bias is added once, after the reduce.
        other += q + 2 * kv;
    }
    if config.o_bias() {
        other += c;
    }
    if config.mlp_bias {
        other += 2 * i + c;
    }
    let layers = layers as u64;
    let table = w.vocab as u64 * c;
    let mut total = layers * (linear + other);
    let mut matmul = layers * linear;
    if position.first {
        total += table;
    }
    if position.last {
        total += c; // final norm
        matmul += table;
        if !config.tie_word_embeddings || !position.first {
            total += table;
        }
    }
    let shares_lm_head = position.last && config.tie_word_embeddings;
    RankParams {
        total,
        matmul,
        layer_matmul: layers * linear,
        per_layer: linear + other,
        lookup_only_table: if position.first && !shares_lm_head {
            table
        } else {
            0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelLayout;
    use crate::plan::layout::{ShardStage, split_heads};

    fn layout(tp: usize, pp: usize) -> Layout {
        Layout {
            tp,
            pp,
            virtual_stages: 1,
            dp: 1,
            zero: ShardStage::Zero0,
            micro_batch: 1,
            micro_batches: 1,
            checkpointing: false,
            offload_checkpoints: false,
        }
    }

    #[test]
    fn pipeline_ranks_get_the_layers_training_gives_them() {
        // A vocabulary large enough that the head costs several layers: the last stage gets
        // fewer decoder layers, as the executor's cut gives it.
        let c = LlamaConfig::from_json_str(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 176, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 2, "vocab_size": 4000}"#,
            "<test>",
        )
        .unwrap();
        let ranks = StagePosition::pipeline_ranks(&c, &layout(1, 2), 64).unwrap();
        let layers: Vec<usize> = ranks.iter().map(|(_, l)| *l).collect();
        let cut = partition_layers(&c, 2, 64).unwrap();
        assert_eq!(layers, [cut[0].len(), cut[1].len()]);
        assert_eq!(layers.iter().sum::<usize>(), 8);
        assert!(layers[1] < layers[0], "{layers:?}");
        assert!(ranks[0].0.first && !ranks[0].0.last && ranks[1].0.last);
        // Interleaved: rank r holds chunks r, r + pp, ….
        let interleaved = Layout {
            virtual_stages: 2,
            ..layout(1, 2)
        };
        let chunks = partition_layers(&c, 4, 64).unwrap();
        let layers: Vec<usize> = StagePosition::pipeline_ranks(&c, &interleaved, 64)
            .unwrap()
            .iter()
            .map(|(_, l)| *l)
            .collect();
        assert_eq!(
            layers,
            [
                chunks[0].len() + chunks[2].len(),
                chunks[1].len() + chunks[3].len()
            ]
        );
        // More chunks than layers is refused with the model's count.
        let too_many = Layout {
            virtual_stages: 8,
            ..layout(1, 2)
        };
        let err = StagePosition::pipeline_ranks(&c, &too_many, 64).unwrap_err();
        assert!(err.contains("num_hidden_layers = 8"), "{err}");
    }

    fn config(extra: &str) -> LlamaConfig {
        let json = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 101{extra}}}"#
        );
        LlamaConfig::from_json_str(&json, "test.json").unwrap()
    }

    #[test]
    fn one_rank_holds_exactly_the_engine_layout() {
        for extra in [
            "",
            r#", "tie_word_embeddings": true"#,
            r#", "attention_bias": true, "mlp_bias": true"#,
        ] {
            let c = config(extra);
            let split = split_heads(&c, 1).unwrap();
            let p = rank_params(
                &c,
                RankWidths::new(&c, split, 1),
                StagePosition::ONLY,
                c.num_hidden_layers,
            );
            assert_eq!(
                p.total as usize,
                ModelLayout::from_config(&c).numel,
                "{extra}"
            );
        }
    }

    #[test]
    fn tensor_and_pipeline_shards_by_hand() {
        let c = config("");
        // TP=2: q 4 heads × 8 = 32, kv 1 head × 8 = 8, inter 88, vocab 51 rows.
        let split = split_heads(&c, 2).unwrap();
        let w = RankWidths::new(&c, split, 2);
        assert_eq!((w.q, w.kv, w.inter, w.vocab), (32, 8, 88, 51));
        let linear = 64 * 32 + 2 * 64 * 8 + 32 * 64 + 3 * 64 * 88;
        let first = rank_params(
            &c,
            w,
            StagePosition {
                first: true,
                last: false,
            },
            2,
        );
        assert_eq!(first.total, 2 * (linear + 128) + 51 * 64);
        assert_eq!(first.matmul, 2 * linear);
        let last = rank_params(
            &c,
            w,
            StagePosition {
                first: false,
                last: true,
            },
            2,
        );
        assert_eq!(last.total, 2 * (linear + 128) + 64 + 51 * 64);
        assert_eq!(last.matmul, 2 * linear + 51 * 64);
        // TP=4 > 2 kv heads: each rank holds one kv head whole (replicated).
        let split = split_heads(&c, 4).unwrap();
        assert!(split.kv_replicated);
        assert_eq!(RankWidths::new(&c, split, 4).kv, 8);
    }
}
