//! One candidate setting of the advisor: tensor, pipeline and data parallel sizes, the ZeRO
//! stage, the micro-batch and activation checkpointing; and how tensor parallelism splits a
//! model's heads (Megatron's rules, which the tensor-parallel engine of issue 12 follows).

use serde::Serialize;

use crate::config::LlamaConfig;
use crate::trainer::zero::ZeroStage;

/// How much of the model state the data-parallel ranks partition. Stages 0–2 are the engine's
/// [`ZeroStage`]; stage 3 (parameters partitioned too, gathered layer by layer) is planned for,
/// not yet run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(into = "u8")]
pub enum ShardStage {
    Zero0,
    Zero1,
    Zero2,
    Zero3,
}

impl ShardStage {
    pub const ALL: [ShardStage; 4] = [
        ShardStage::Zero0,
        ShardStage::Zero1,
        ShardStage::Zero2,
        ShardStage::Zero3,
    ];

    pub fn number(self) -> u8 {
        match self {
            ShardStage::Zero0 => 0,
            ShardStage::Zero1 => 1,
            ShardStage::Zero2 => 2,
            ShardStage::Zero3 => 3,
        }
    }

    /// The engine's stage, where the engine has it.
    pub fn engine_stage(self) -> Option<ZeroStage> {
        match self {
            ShardStage::Zero0 => Some(ZeroStage::Off),
            ShardStage::Zero1 => Some(ZeroStage::One),
            ShardStage::Zero2 => Some(ZeroStage::Two),
            ShardStage::Zero3 => None,
        }
    }
}

impl From<ShardStage> for u8 {
    fn from(stage: ShardStage) -> u8 {
        stage.number()
    }
}

/// A complete parallel layout for a job of `tp · pp · dp` GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    pub tp: usize,
    pub pp: usize,
    /// Virtual stages per pipeline rank (interleaved 1F1B); 1 is plain 1F1B.
    pub virtual_stages: usize,
    pub dp: usize,
    pub zero: ShardStage,
    /// Sequences per micro-batch on one rank.
    pub micro_batch: usize,
    /// Micro-batches per step on one rank (gradient accumulation steps).
    pub micro_batches: usize,
    pub checkpointing: bool,
    /// The checkpointed layer inputs and attention outputs in host memory
    /// (`--offload-checkpoints`): the device keeps a ring of three layer inputs and a spare
    /// attention output, and the recomputation skips the attention forward. The advisor
    /// follows the engine's `auto` ([`Layout::auto_offload`]); host memory is assumed to hold
    /// them.
    pub offload_checkpoints: bool,
}

impl Layout {
    /// What `--offload-checkpoints auto` gives this layout at sequences of `seq` tokens:
    /// under checkpointing, without a pipeline, from
    /// [`AUTO_MIN_SEQ`](crate::offload_checkpoints::AUTO_MIN_SEQ) tokens.
    pub fn auto_offload(&self, seq: usize) -> bool {
        self.checkpointing && self.pp == 1 && seq >= crate::offload_checkpoints::AUTO_MIN_SEQ
    }

    pub fn world(&self) -> usize {
        self.tp * self.pp * self.dp
    }

    /// The pipeline bubble as a fraction of the ideal pipeline time: (p − 1) / (m · v).
    pub fn bubble_fraction(&self) -> f64 {
        (self.pp - 1) as f64 / (self.micro_batches * self.virtual_stages) as f64
    }

    /// Micro-batches whose saved activations (for all of its L/p layers) the first pipeline
    /// rank holds at once under 1F1B: p, capped at m; interleaving with v virtual stages
    /// multiplies that by 1 + (p − 1)/(p·v) (Korthikanti et al., 2022, §4.2). Without a
    /// pipeline, one (the arena is reused by every micro-batch).
    pub fn in_flight_layer_sets(&self) -> f64 {
        if self.pp == 1 {
            return 1.0;
        }
        let (p, v, m) = (
            self.pp as f64,
            self.virtual_stages as f64,
            self.micro_batches as f64,
        );
        let interleaving = if self.virtual_stages > 1 {
            1.0 + (p - 1.0) / (p * v)
        } else {
            1.0
        };
        (p * interleaving).min(m)
    }

    /// The `tilearn train` flags that run this layout on sequences of `seq` tokens (the data
    /// parallel size follows from the launched ranks; `--offload-checkpoints` is left to its
    /// `auto`, which [`Layout::auto_offload`] follows).
    pub fn train_flags(&self, seq: usize) -> Vec<String> {
        let mut flags = vec![
            "--seq-len".to_string(),
            seq.to_string(),
            "--per-device-train-batch-size".into(),
            self.micro_batch.to_string(),
            "--gradient-accumulation-steps".into(),
            self.micro_batches.to_string(),
        ];
        let mut add = |flag: &str, value: usize| {
            flags.push(flag.to_string());
            flags.push(value.to_string());
        };
        if self.tp > 1 {
            add("--tp-size", self.tp);
        }
        if self.pp > 1 {
            add("--pp-size", self.pp);
        }
        if self.virtual_stages > 1 {
            add("--virtual-stages", self.virtual_stages);
        }
        if self.zero != ShardStage::Zero0 {
            add("--zero-stage", self.zero.number().into());
        }
        if self.virtual_stages > 1 {
            flags.extend(["--pp-schedule".to_string(), "interleaved".to_string()]);
        }
        if self.checkpointing {
            flags.push("--gradient-checkpointing".into());
        }
        flags
    }

    /// `TP=2 PP=4 (v=2) DP=1 ZeRO-1 mb=1×32 ckpt` style.
    pub fn describe(&self) -> String {
        let v = if self.virtual_stages > 1 {
            format!(" (v={})", self.virtual_stages)
        } else {
            String::new()
        };
        format!(
            "TP={} PP={}{v} DP={} ZeRO-{}, micro-batch {} × {} accumulation steps, {}",
            self.tp,
            self.pp,
            self.dp,
            self.zero.number(),
            self.micro_batch,
            self.micro_batches,
            if self.checkpointing {
                "activation checkpointing"
            } else {
                "no checkpointing"
            }
        )
    }
}

/// How one tensor-parallel rank holds the attention heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct HeadSplit {
    pub q_heads: usize,
    pub kv_heads: usize,
    /// Whether the kv heads are replicated (TP > kv heads: each rank holds one of them,
    /// `tp / kv_heads` ranks the same one).
    pub kv_replicated: bool,
}

/// Megatron's split of `config`'s heads over `tp` ranks: query heads must divide; kv heads are
/// split when `tp` divides them and replicated when `kv_heads` divides `tp`. The error names
/// the sizes and the sizes that would work.
pub fn split_heads(config: &LlamaConfig, tp: usize) -> Result<HeadSplit, String> {
    let (hq, hkv) = (config.num_attention_heads, config.num_key_value_heads);
    if tp == 0 || hq % tp != 0 {
        return Err(format!(
            "{hq} attention heads cannot be split over TP={tp}; use a TP that divides {hq}"
        ));
    }
    if !config.intermediate_size.is_multiple_of(tp) {
        return Err(format!(
            "intermediate_size {} cannot be split over TP={tp}; use a TP that divides it",
            config.intermediate_size
        ));
    }
    if hkv % tp == 0 {
        Ok(HeadSplit {
            q_heads: hq / tp,
            kv_heads: hkv / tp,
            kv_replicated: false,
        })
    } else if tp.is_multiple_of(hkv) {
        Ok(HeadSplit {
            q_heads: hq / tp,
            kv_heads: 1,
            kv_replicated: true,
        })
    } else {
        Err(format!(
            "{hkv} key/value heads can be neither split over TP={tp} (TP must divide them) nor \
             replicated (they must divide TP)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(hq: usize, hkv: usize) -> LlamaConfig {
        let hidden = 64 * hq;
        let json = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": {hidden}, "intermediate_size": 1024, "num_hidden_layers": 4,
            "num_attention_heads": {hq}, "num_key_value_heads": {hkv}, "vocab_size": 1000}}"#
        );
        LlamaConfig::from_json_str(&json, "test.json").unwrap()
    }

    #[test]
    fn train_flags_name_each_dimension_that_is_not_the_default() {
        let plain = Layout {
            tp: 1,
            pp: 1,
            virtual_stages: 1,
            dp: 8,
            zero: ShardStage::Zero2,
            micro_batch: 1,
            micro_batches: 32,
            checkpointing: false,
            offload_checkpoints: false,
        };
        assert_eq!(
            plain.train_flags(4096).join(" "),
            "--seq-len 4096 --per-device-train-batch-size 1 --gradient-accumulation-steps 32 \
             --zero-stage 2"
        );
        let split = Layout {
            tp: 2,
            pp: 4,
            virtual_stages: 2,
            dp: 1,
            zero: ShardStage::Zero0,
            micro_batch: 2,
            micro_batches: 8,
            checkpointing: true,
            ..plain
        };
        assert_eq!(
            split.train_flags(2048).join(" "),
            "--seq-len 2048 --per-device-train-batch-size 2 --gradient-accumulation-steps 8 \
             --tp-size 2 --pp-size 4 --virtual-stages 2 --pp-schedule interleaved \
             --gradient-checkpointing"
        );
    }
    #[test]
    fn kv_heads_split_when_divisible_and_replicated_beyond() {
        let c = config(32, 4);
        let s = split_heads(&c, 2).unwrap();
        assert_eq!((s.q_heads, s.kv_heads, s.kv_replicated), (16, 2, false));
        let s = split_heads(&c, 8).unwrap();
        assert_eq!((s.q_heads, s.kv_heads, s.kv_replicated), (4, 1, true));
        let c = config(12, 12);
        let err = split_heads(&c, 8).unwrap_err();
        assert!(
            err.contains("12 attention heads") && err.contains("TP=8"),
            "{err}"
        );
        let c = config(24, 6);
        let err = split_heads(&c, 4).unwrap_err();
        assert!(err.contains("6 key/value heads"), "{err}");
    }

    #[test]
    fn bubble_and_in_flight_follow_the_formulas() {
        let mut l = Layout {
            tp: 1,
            pp: 4,
            virtual_stages: 1,
            dp: 2,
            zero: ShardStage::Zero1,
            micro_batch: 1,
            micro_batches: 8,
            checkpointing: false,
            offload_checkpoints: false,
        };
        assert_eq!(l.bubble_fraction(), 3.0 / 8.0);
        assert_eq!(l.in_flight_layer_sets(), 4.0);
        l.virtual_stages = 2;
        assert_eq!(l.bubble_fraction(), 3.0 / 16.0);
        assert_eq!(l.in_flight_layer_sets(), 4.0 * (1.0 + 3.0 / 8.0));
        l.micro_batches = 2;
        assert_eq!(l.in_flight_layer_sets(), 2.0);
        assert_eq!(l.world(), 8);
    }
}
