//! The parameters one rank holds under tensor and pipeline parallelism: the decoder layers of
//! its pipeline stage with their linear weights split by TP (Megatron: q/k/v and gate/up by
//! output columns, o and down by input rows; replicated kv heads held whole; norms and the
//! row-parallel biases replicated), the vocabulary-parallel embedding on the first stage and
//! the vocabulary-parallel lm_head and final norm on the last. A tied lm_head is the embedding
//! itself with one stage and a second copy on the last stage with several (as Megatron).

use super::layout::{HeadSplit, Layout};
use crate::config::LlamaConfig;

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

    /// The first and the last rank of a pipeline of `pp` stages (one position when `pp` is 1).
    pub fn ends(pp: usize) -> Vec<StagePosition> {
        if pp == 1 {
            vec![StagePosition::ONLY]
        } else {
            vec![
                StagePosition {
                    first: true,
                    last: false,
                },
                StagePosition {
                    first: false,
                    last: true,
                },
            ]
        }
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
}

/// The parameters of the rank at `position` of `layout`.
pub fn rank_params(
    config: &LlamaConfig,
    widths: RankWidths,
    layout: &Layout,
    position: StagePosition,
) -> RankParams {
    let w = widths;
    let c = w.hidden as u64;
    let (q, kv, i) = (w.q as u64, w.kv as u64, w.inter as u64);
    let linear = c * q + 2 * c * kv + q * c + 3 * c * i;
    let mut other = 2 * c; // the two norms
    if config.attention_bias {
        // q/k/v biases follow their columns; o_proj's bias is added once, after the reduce.
        other += q + 2 * kv + c;
    }
    if config.mlp_bias {
        other += 2 * i + c;
    }
    let layers = layout.layers_per_rank(config) as u64;
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
    RankParams {
        total,
        matmul,
        layer_matmul: layers * linear,
        per_layer: linear + other,
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
        }
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
                &layout(1, 1),
                StagePosition::ONLY,
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
            &layout(2, 2),
            StagePosition {
                first: true,
                last: false,
            },
        );
        assert_eq!(first.total, 2 * (linear + 128) + 51 * 64);
        assert_eq!(first.matmul, 2 * linear);
        let last = rank_params(
            &c,
            w,
            &layout(2, 2),
            StagePosition {
                first: false,
                last: true,
            },
        );
        assert_eq!(last.total, 2 * (linear + 128) + 64 + 51 * 64);
        assert_eq!(last.matmul, 2 * linear + 51 * 64);
        // TP=4 > 2 kv heads: each rank holds one kv head whole (replicated).
        let split = split_heads(&c, 4).unwrap();
        assert!(split.kv_replicated);
        assert_eq!(RankWidths::new(&c, split, 4).kv, 8);
    }
}
