//! `--weight-copy auto|whole|per-layer`: how the GPU engine keeps the 16-bit copy of the fp32
//! master weights that bf16/fp16 steps compute with. No device code here (the setting parses
//! and resolves on any machine); the device side is `gpu::layer_copy`.
//!
//! **Whole** keeps the copy of every weight on the device (2 bytes a parameter), rewritten by
//! the fused optimizer in the same launch as the update: no extra work in the step.
//!
//! **Per layer** keeps only what is small or used outside the decoder layers (the embedding,
//! the norms, the final norm and lm_head) plus one layer's worth of room: each pass casts the
//! master weights of the layer it is about to run into that room, in the forward and again
//! in the backward (where gradient checkpointing recomputes the layer). The cast is the same
//! round-to-nearest one the optimizer's copy uses, so the step computes with the same bits;
//! it costs two passes over the fp32 weights a step (about 6 GB of traffic each at 1.1 B
//! parameters, a few milliseconds on an H200 against a 16 K-token step's half second) and
//! saves nearly the whole copy (1.69 GiB measured at 1.1 B).
//!
//! **Auto** (the default) is per layer when gradient checkpointing is on in the default memory
//! mode (the memory-bound setting the flag is for, where a step is long and the cast is lost
//! in it), whole otherwise. ZeRO, whose ranks hold shards of the master weights, always runs
//! the whole copy (an `auto` model switches when its optimizer is sharded).

use std::fmt;

use serde::{Deserialize, Serialize};

/// `--weight-copy`: the requested layout of the 16-bit working copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightCopy {
    /// Per layer under gradient checkpointing in the default memory mode, whole otherwise.
    #[default]
    Auto,
    /// Every weight's 16-bit copy on the device, written by the optimizer.
    Whole,
    /// Cast layer by layer from the master weights just before use.
    PerLayer,
}

impl fmt::Display for WeightCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WeightCopy::Auto => "auto",
            WeightCopy::Whole => "whole",
            WeightCopy::PerLayer => "per-layer",
        })
    }
}

impl WeightCopy {
    /// Parses the flag's text (`auto`, `whole`, `per-layer`; case-insensitive).
    pub fn parse(text: &str) -> std::result::Result<WeightCopy, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(WeightCopy::Auto),
            "whole" => Ok(WeightCopy::Whole),
            "per-layer" | "per_layer" => Ok(WeightCopy::PerLayer),
            _ => Err(format!(
                "`{text}` is not a weight-copy layout; use `auto`, `whole` (the 16-bit copy \
                 of every weight on the GPU) or `per-layer` (each layer cast from the fp32 \
                 master weights just before use: less memory, two extra reads of the weights \
                 a step)"
            )),
        }
    }

    /// Whether a model with these settings keeps its copy per layer. `auto` picks per layer
    /// only under gradient checkpointing in the default memory mode; an explicit `per-layer`
    /// is taken as asked (see [`WeightCopy::check`] for what refuses it).
    pub fn per_layer(self, gradient_checkpointing: bool, lean: bool) -> bool {
        match self {
            WeightCopy::Whole => false,
            WeightCopy::PerLayer => true,
            WeightCopy::Auto => gradient_checkpointing && !lean,
        }
    }

    /// Refuses an explicit `per-layer` where it cannot work: the lean mode (its master
    /// weights are in host memory, nothing on the device to cast from) and ZeRO (each rank
    /// holds a shard of the master weights, not the layer it runs).
    pub fn check(self, lean: bool, zero_stage: u8) -> crate::error::Result<()> {
        if self != WeightCopy::PerLayer {
            return Ok(());
        }
        let why = if lean {
            "the lean memory mode keeps the fp32 master weights in host memory, so there is \
             nothing on the GPU to cast a layer from; use --memory default or --weight-copy \
             whole"
        } else if zero_stage > 0 {
            "ZeRO shards the fp32 master weights across ranks, so no rank holds the whole \
             layer it runs; use --zero-stage 0 or --weight-copy whole"
        } else {
            return Ok(());
        };
        Err(crate::error::EngineError::InvalidArgument {
            argument: "--weight-copy per-layer".into(),
            message: why.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_name_and_refuses_others_with_the_choices() {
        assert_eq!(WeightCopy::parse("auto"), Ok(WeightCopy::Auto));
        assert_eq!(WeightCopy::parse(" Whole "), Ok(WeightCopy::Whole));
        assert_eq!(WeightCopy::parse("per-layer"), Ok(WeightCopy::PerLayer));
        assert_eq!(WeightCopy::parse("PER_LAYER"), Ok(WeightCopy::PerLayer));
        let err = WeightCopy::parse("layer").unwrap_err();
        assert!(
            err.contains("`layer`") && err.contains("per-layer"),
            "{err}"
        );
        for w in [WeightCopy::Auto, WeightCopy::Whole, WeightCopy::PerLayer] {
            assert_eq!(WeightCopy::parse(&w.to_string()), Ok(w));
        }
    }

    #[test]
    fn auto_is_per_layer_only_under_checkpointing_in_the_default_mode() {
        assert!(WeightCopy::Auto.per_layer(true, false));
        assert!(!WeightCopy::Auto.per_layer(false, false));
        assert!(!WeightCopy::Auto.per_layer(true, true));
        assert!(WeightCopy::PerLayer.per_layer(false, false));
        assert!(!WeightCopy::Whole.per_layer(true, false));
    }

    #[test]
    fn explicit_per_layer_is_refused_with_lean_and_zero_naming_the_fix() {
        assert!(WeightCopy::PerLayer.check(false, 0).is_ok());
        assert!(WeightCopy::Auto.check(true, 2).is_ok());
        let lean = WeightCopy::PerLayer.check(true, 0).unwrap_err().to_string();
        assert!(
            lean.contains("--weight-copy") && lean.contains("host memory"),
            "{lean}"
        );
        let zero = WeightCopy::PerLayer
            .check(false, 1)
            .unwrap_err()
            .to_string();
        assert!(zero.contains("--zero-stage 0"), "{zero}");
    }
}
