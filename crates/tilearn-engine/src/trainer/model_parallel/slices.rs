//! Where a rank's tensors lie in the whole model's, for its checkpoints: the slices of its
//! optimizer state ([`TensorPlace`]s for the state file's `layout`) and a [`TensorDest`] that
//! loads a whole Hugging Face model into the rank's buffer, decoding only the elements the rank
//! holds.

use std::collections::HashMap;
use std::ops::Range;

use crate::checkpoint::TensorDest;
use crate::model::tensor_parallel::{Cut, ShardPlan, pieces};
use crate::params::ParamSpec;
use crate::trainer::optimizer_layout::TensorPlace;
use crate::{EngineError, Result};

/// Where the rank's tensor `spec` lies in the whole tensor (`full`: the whole model's specs).
/// Replicated tensors are marked as copies on all but the rank that counts them in the norm.
pub fn place(plan: &ShardPlan, full: &[ParamSpec], spec: &ParamSpec) -> TensorPlace {
    let shape = full
        .iter()
        .find(|f| f.name == spec.name)
        .map_or_else(|| spec.shape.clone(), |f| f.shape.clone());
    let whole = TensorPlace::whole(&shape);
    let copy = !plan.counts_in_norm(&spec.name);
    match plan.cut(&spec.name) {
        Cut::Rows(rows) => TensorPlace {
            rows,
            copy,
            ..whole
        },
        Cut::Cols(cols) => TensorPlace {
            cols,
            copy,
            ..whole
        },
        Cut::Whole => TensorPlace { copy, ..whole },
    }
}

/// The whole model's flat addressing (tensor by tensor, as [`crate::checkpoint::load_into`]
/// writes for the whole model's specs) mapped onto a rank's buffer of slices.
pub struct RankSlices<'a> {
    /// The whole model's tensors by their first element.
    full: HashMap<usize, &'a ParamSpec>,
    local: HashMap<&'a str, &'a ParamSpec>,
    plan: &'a ShardPlan,
    data: &'a mut [f32],
}

impl<'a> RankSlices<'a> {
    pub fn new(
        full: &'a [ParamSpec],
        local: &'a [ParamSpec],
        plan: &'a ShardPlan,
        data: &'a mut [f32],
    ) -> RankSlices<'a> {
        RankSlices {
            full: full.iter().map(|s| (s.offset, s)).collect(),
            local: local.iter().map(|s| (s.name.as_str(), s)).collect(),
            plan,
            data,
        }
    }
}

impl TensorDest for RankSlices<'_> {
    fn write(
        &mut self,
        range: Range<usize>,
        fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        let Some(full) = self
            .full
            .get(&range.start)
            .filter(|s| s.numel() == range.len())
        else {
            return Err(EngineError::InvalidArgument {
                argument: "--resume-from-checkpoint".into(),
                message: format!(
                    "internal: elements {range:?} are not one tensor of the model; a rank \
                     loads whole tensors"
                ),
            });
        };
        let Some(local) = self.local.get(full.name.as_str()) else {
            // Another stage's tensor: not read at all.
            return Ok(());
        };
        for (f, l) in pieces(&full.shape, &self.plan.cut(&full.name)) {
            let at = local.offset;
            fill(f.start, &mut self.data[at + l.start..at + l.end])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LlamaConfig;
    use crate::model::tensor_parallel::TensorShard;
    use crate::params::ParamStore;

    /// Both engines' embedding slices (vocabulary-parallel): rows of the whole tensor, unmarked
    /// on every rank (each holds different rows, so together they cover it once); the norms are
    /// whole and a `copy` beyond tp rank 0; the column cuts are columns.
    #[test]
    fn vocabulary_rows_are_row_slices_counted_on_every_rank() {
        let config = LlamaConfig::from_json_str(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 11, "max_position_embeddings": 32,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
            "test/config.json",
        )
        .unwrap();
        let full = ParamStore::specs_for(&config);
        for rank in 0..2 {
            let plan = ShardPlan::new(&config, TensorShard { rank, size: 2 }).unwrap();
            let local = ParamStore::specs_for(&plan.local_config(&config));
            let at =
                |name: &str| place(&plan, &full, local.iter().find(|s| s.name == name).unwrap());
            for name in ["model.embed_tokens.weight", "lm_head.weight"] {
                let p = at(name);
                assert_eq!(
                    (p.rows.clone(), p.cols.clone()),
                    ([0..6, 6..11][rank].clone(), 0..16)
                );
                assert!(!p.copy, "{name} on rank {rank}");
            }
            let norm = at("model.norm.weight");
            assert_eq!(norm.copy, rank != 0);
            let o = at("model.layers.0.self_attn.o_proj.weight");
            assert_eq!((o.cols.clone(), o.copy), (rank * 8..(rank + 1) * 8, false));
        }
    }
}
