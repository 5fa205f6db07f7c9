//! Which of the advisor's layouts the GPU engine runs today. The advisor prices every layout
//! (the cost and memory models do not depend on what is built), but it recommends only what
//! `tilearn train --device cuda` accepts, so a recommendation can be launched as printed.
//! These rules mirror the refusals of `tilearn train` (`gpu_split_supported`) and of the GPU
//! model-parallel backends; each names the part that is missing.

use super::layout::{Layout, ShardStage, split_heads};
use crate::config::{LlamaConfig, PositionEncoding};

/// Why the GPU engine cannot run `layout` for `config`, or `None` when it can.
pub fn gpu_engine_refusal(config: &LlamaConfig, layout: &Layout) -> Option<&'static str> {
    let splits_model = layout.tp > 1 || layout.pp > 1;
    if layout.zero == ShardStage::Zero3 {
        return Some("ZeRO-3 is not built");
    }
    if layout.virtual_stages > 1 {
        return Some("interleaving: CPU engine only");
    }
    if layout.pp > 1 && config.tie_word_embeddings {
        return Some("PP needs untied embeddings");
    }
    if layout.tp > 1 && split_heads(config, layout.tp).is_ok_and(|s| s.kv_replicated) {
        return Some("TP above the kv heads: CPU engine only");
    }
    if splits_model && config.family.position_encoding() == PositionEncoding::Alibi {
        return Some("ALiBi with TP or PP: not built");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tied: bool) -> LlamaConfig {
        LlamaConfig::from_json_str(
            &format!(
                r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 256,
                "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
                "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": {tied}}}"#
            ),
            "support.json",
        )
        .unwrap()
    }

    fn layout(tp: usize, pp: usize, v: usize, zero: ShardStage) -> Layout {
        Layout {
            tp,
            pp,
            virtual_stages: v,
            dp: 8 / (tp * pp),
            zero,
            micro_batch: 1,
            micro_batches: 8,
            checkpointing: false,
            offload_checkpoints: false,
        }
    }

    #[test]
    fn what_tilearn_train_accepts_on_the_gpu_runs_and_the_rest_is_named() {
        let untied = config(false);
        let runs = |l: Layout| gpu_engine_refusal(&untied, &l);
        // Data parallelism with ZeRO 0-2, alone or around TP, PP and both.
        for zero in [ShardStage::Zero0, ShardStage::Zero1, ShardStage::Zero2] {
            assert_eq!(runs(layout(1, 1, 1, zero)), None);
            assert_eq!(runs(layout(2, 1, 1, zero)), None);
            assert_eq!(runs(layout(1, 4, 1, zero)), None);
            assert_eq!(runs(layout(2, 2, 1, zero)), None);
        }

        let refused = |l: Layout, part: &str| {
            let why = runs(l).unwrap_or_else(|| panic!("{l:?} should be refused"));
            assert!(why.contains(part), "{l:?}: {why}");
        };
        refused(layout(1, 1, 1, ShardStage::Zero3), "ZeRO-3");
        refused(layout(1, 2, 2, ShardStage::Zero0), "interleaving");
        // 2 kv heads: TP 4 replicates them.
        refused(layout(4, 1, 1, ShardStage::Zero0), "kv heads");
        let tied = config(true);
        let why = gpu_engine_refusal(&tied, &layout(1, 2, 1, ShardStage::Zero0));
        assert_eq!(why, Some("PP needs untied embeddings"));
        assert_eq!(
            gpu_engine_refusal(&tied, &layout(2, 1, 1, ShardStage::Zero0)),
            None
        );
    }
}
