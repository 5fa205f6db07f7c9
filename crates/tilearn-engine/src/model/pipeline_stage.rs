//! One pipeline stage's part of a model, described as a model of its own for an engine that runs
//! whole models (the CUDA engine's `GpuLlama`): the stage's tensors in one flat buffer with
//! their Hugging Face names and order ([`rank_specs`], as the CPU engine's ranks hold them), the
//! [`ModelLayout`] of that buffer, and the config its activation buffers are sized by (the
//! model's, with the stage's layer count).
//!
//! The first stage holds the embedding, the last the final norm and `lm_head`; a tensor a stage
//! does not hold has an empty range in the layout ([`ModelLayout::has_embedding`],
//! [`ModelLayout::has_head`]), which is how the engine's forward and backward know where the
//! stage starts and ends. The layers are cut exactly as the CPU engine cuts them
//! ([`PipelineShard`]), so checkpoints, optimizer files and `--pp-layers` mean the same on both.

use std::ops::Range;

use super::layout::{LayerLayout, ModelLayout, find};
use super::model_parallel::{PipelineShard, rank_specs};
use super::tensor_parallel::{ShardPlan, TensorShard};
use crate::config::{LlamaConfig, ModelFamily, NormKind, PositionEncoding};
use crate::error::{EngineError, Result};
use crate::params::{ParamSpec, TensorNames};

fn usage(message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: "--pp-size".into(),
        message,
    }
}

/// One pipeline stage (one model chunk) of a model, or of one tensor-parallel rank's part of it.
#[derive(Clone, Debug)]
pub struct PipelineStage {
    /// The whole model's config.
    pub full_config: LlamaConfig,
    /// Where this stage lies in the pipeline and the layers of every stage.
    pub pipe: PipelineShard,
    /// The rank's config (the whole model's, or its tensor-parallel rank's local one: its
    /// heads, columns and vocabulary rows) with this stage's layer count (and their attention
    /// kinds): what the stage's weights and activation buffers are sized by.
    pub config: LlamaConfig,
    /// The tensors this stage holds, with their offsets in its flat buffer.
    pub specs: Vec<ParamSpec>,
    /// Where they lie in that buffer (empty ranges for what the stage does not hold).
    pub layout: ModelLayout,
    /// The tensor-parallel plan (whole tensors without tensor parallelism) the CPU engine's
    /// slicing and assembling helpers take.
    pub plan: ShardPlan,
}

impl PipelineStage {
    /// Stage `pipe.stage` of `full`, refusing what a one-chunk stage of a whole-model engine
    /// cannot run, with the way out.
    pub fn new(full: &LlamaConfig, pipe: PipelineShard) -> Result<PipelineStage> {
        Self::with_plan(full, pipe, ShardPlan::new(full, TensorShard::WHOLE)?)
    }

    /// Stage `pipe.stage` of the tensor-parallel rank of `plan` (tensor and pipeline
    /// parallelism together): the stage's tensors cut as `plan` cuts them, sized by the rank's
    /// local config. The activations between stages stay whole (`[tokens, hidden]`).
    pub fn with_plan(
        full: &LlamaConfig,
        pipe: PipelineShard,
        plan: ShardPlan,
    ) -> Result<PipelineStage> {
        if pipe.chunks != 1 {
            return Err(usage(format!(
                "{} virtual stages (the interleaved schedule) run on the CPU engine only so \
                 far; use --pp-schedule 1f1b or gpipe on the GPU, or --device cpu",
                pipe.chunks
            )));
        }
        if pipe.stages > 1 && full.tie_word_embeddings {
            return Err(usage(
                "tie_word_embeddings (config.json) puts the embedding on the first stage and \
                 lm_head, the same tensor, on the last, whose gradients would have to be summed \
                 between them, which is not supported; use --pp-size 1, or a checkpoint with \
                 untied embeddings"
                    .into(),
            ));
        }
        let alibi = full.family.position_encoding() == PositionEncoding::Alibi;
        if pipe.stages > 1 && (alibi || full.family.norm_kind() == NormKind::Layer) {
            return Err(usage(format!(
                "{} (ALiBi attention{}) is not split into pipeline stages on the GPU engine; \
                 use --pp-size 1 (data parallelism and ZeRO work), or --device cpu",
                full.family.architecture(),
                if full.family == ModelFamily::Bloom {
                    ", LayerNorm"
                } else {
                    ""
                }
            )));
        }
        let (stages, stage) = (pipe.stages, pipe.stage);
        if pipe.partition.len() != stages || stage >= stages {
            return Err(usage(format!(
                "internal: stage {stage} of {stages} with {} layer ranges",
                pipe.partition.len()
            )));
        }
        let specs = rank_specs(full, &plan, &pipe);
        let layers: Range<usize> = pipe.partition[stage].clone();
        let first = stage == 0;
        let last = stage + 1 == stages;
        let local = plan.local_config(full);
        let mut config = local.clone();
        config.num_hidden_layers = layers.len();
        if full.layer_types.len() == full.num_hidden_layers {
            config.layer_types = full.layer_types[layers.clone()].to_vec();
        }
        let names = TensorNames::of(full.family);
        let tensor = |name: &str| {
            find(&specs, name).ok_or_else(|| {
                usage(format!(
                    "internal: stage {stage} does not hold {name}, which it needs"
                ))
            })
        };
        let empty = 0..0;
        let embed = if first {
            tensor(names.embed)?
        } else {
            empty.clone()
        };
        let (norm, lm_head) = if last {
            (
                tensor(&format!("{}.weight", names.final_norm))?,
                tensor("lm_head.weight")?,
            )
        } else {
            (empty.clone(), empty)
        };
        let layer_layouts = layers
            .clone()
            .map(|i| {
                LayerLayout::find(&specs, i, &local).ok_or_else(|| {
                    usage(format!(
                        "internal: stage {stage} lacks a tensor of layer {i}"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let layout = ModelLayout {
            embed,
            layers: layer_layouts,
            norm,
            lm_head,
            // LayerNorm families are refused above.
            norm_bias: None,
            embed_norm: None,
            norm_head: full.norm_head(),
            numel: specs.last().map_or(0, |s| s.range().end),
        };
        Ok(PipelineStage {
            full_config: full.clone(),
            pipe,
            config,
            specs,
            layout,
            plan,
        })
    }

    /// Whether this stage embeds the tokens (the first stage).
    pub fn is_first(&self) -> bool {
        self.pipe.stage == 0
    }

    /// Whether this stage computes the loss (the last stage).
    pub fn is_last(&self) -> bool {
        self.pipe.stage + 1 == self.pipe.stages
    }

    /// Elements of the stage's flat buffer.
    pub fn numel(&self) -> usize {
        self.layout.numel
    }

    /// Elements of the activations (or their gradients) between two stages for a call of
    /// `rows` = batch · seq tokens: `[rows, hidden]`.
    pub fn boundary_len(&self, rows: usize) -> usize {
        rows * self.full_config.hidden_size
    }

    /// Stage `stage`'s (of the same pipeline) place.
    pub fn pipe_of(&self, stage: usize) -> PipelineShard {
        PipelineShard {
            stage,
            ..self.pipe.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelLayout;
    use crate::model::model_parallel::assemble_planned;
    use crate::params::ParamStore;

    fn config(extra: &str) -> LlamaConfig {
        let json = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 5, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 11, "max_position_embeddings": 32,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0 {extra}}}"#
        );
        LlamaConfig::from_json_str(&json, "config.json").unwrap()
    }

    fn untied() -> LlamaConfig {
        config(r#", "tie_word_embeddings": false"#)
    }

    fn stages(full: &LlamaConfig, p: usize) -> Vec<PipelineStage> {
        (0..p)
            .map(|s| {
                let pipe = PipelineShard::balanced(full, s, p, 1, 8).unwrap();
                PipelineStage::new(full, pipe).unwrap()
            })
            .collect()
    }

    #[test]
    fn the_stages_cut_the_layers_as_the_cpu_engine_and_hold_every_tensor_once() {
        let full = untied();
        let whole = ParamStore::specs_for(&full);
        for p in 1..=5 {
            let parts = stages(&full, p);
            let mut names: Vec<&str> = parts
                .iter()
                .flat_map(|s| s.specs.iter().map(|t| t.name.as_str()))
                .collect();
            names.sort_unstable();
            let mut want: Vec<&str> = whole.iter().map(|s| s.name.as_str()).collect();
            want.sort_unstable();
            assert_eq!(names, want, "p = {p}");
            let cpu = PipelineShard::balanced(&full, 0, p, 1, 8)
                .unwrap()
                .partition;
            for (s, part) in parts.iter().enumerate() {
                assert_eq!(part.pipe.partition, cpu);
                assert_eq!(part.config.num_hidden_layers, cpu[s].len());
                assert_eq!(part.is_first(), s == 0);
                assert_eq!(part.is_last(), s + 1 == p);
                assert_eq!(part.layout.has_embedding(), s == 0);
                assert_eq!(part.layout.has_head(), s + 1 == p);
            }
        }
    }

    #[test]
    fn the_layout_addresses_the_stage_buffer_by_name() {
        let full = untied();
        let whole = ModelLayout::from_config(&full);
        let whole_specs = ParamStore::specs_for(&full);
        let by_name = |specs: &[ParamSpec], r: &Range<usize>| {
            specs
                .iter()
                .find(|s| s.range() == *r)
                .map(|s| s.name.clone())
        };
        for part in stages(&full, 2) {
            let l = &part.layout;
            assert_eq!(
                l.numel,
                part.specs.iter().map(ParamSpec::numel).sum::<usize>()
            );
            let first_layer = part.pipe.partition[part.pipe.stage].start;
            for (k, layer) in l.layers.iter().enumerate() {
                let global = &whole.layers[first_layer + k];
                for (mine, theirs) in [
                    (&layer.q.weight, &global.q.weight),
                    (&layer.down.weight, &global.down.weight),
                    (&layer.input_norm, &global.input_norm),
                ] {
                    assert_eq!(
                        by_name(&part.specs, mine),
                        by_name(&whole_specs, theirs),
                        "layer {k} of stage {}",
                        part.pipe.stage
                    );
                    assert!(mine.end <= l.numel);
                }
            }
            if part.is_first() {
                assert_eq!(
                    by_name(&part.specs, &l.embed).as_deref(),
                    Some("model.embed_tokens.weight")
                );
            } else {
                assert!(l.embed.is_empty());
            }
            if part.is_last() {
                assert_eq!(
                    by_name(&part.specs, &l.norm).as_deref(),
                    Some("model.norm.weight")
                );
                assert_eq!(
                    by_name(&part.specs, &l.lm_head).as_deref(),
                    Some("lm_head.weight")
                );
            } else {
                assert!(l.norm.is_empty() && l.lm_head.is_empty());
            }
        }
    }

    #[test]
    fn stage_buffers_assemble_into_the_whole_model() {
        let full = untied();
        let model = crate::model::LlamaForCausalLM::from_config(full.clone(), 3);
        let parts = stages(&full, 3);
        let datas: Vec<Vec<f32>> = parts
            .iter()
            .map(|part| {
                part.specs
                    .iter()
                    .flat_map(|s| {
                        let w = model.params.spec(&s.name).unwrap().range();
                        model.params.data[w].to_vec()
                    })
                    .collect()
            })
            .collect();
        let planned: Vec<_> = parts
            .iter()
            .zip(&datas)
            .map(|(p, d)| (p.plan.clone(), p.pipe.clone(), &d[..]))
            .collect();
        let assembled = assemble_planned(&full, &planned).unwrap();
        assert_eq!(assembled.data, model.params.data);
    }

    /// tp 2 × pp 2: each of the four ranks' stages holds its tensor rank's slices of its
    /// layers (sized by the local config: half the heads, columns and vocabulary rows; the
    /// hidden size whole), its buffer is what the backend uploads (the stage's tensors of the
    /// tensor rank's sliced model), and the four buffers put together are the whole model.
    #[test]
    fn tensor_split_stages_hold_their_slices_and_assemble_into_the_whole_model() {
        use crate::model::tensor_parallel::slice_params;
        let full = untied();
        let model = crate::model::LlamaForCausalLM::from_config(full.clone(), 5);
        let mut planned_parts = Vec::new();
        for stage in 0..2 {
            for rank in 0..2 {
                let plan = ShardPlan::new(&full, TensorShard { rank, size: 2 }).unwrap();
                let pipe = PipelineShard::balanced(&full, stage, 2, 1, 16).unwrap();
                let part = PipelineStage::with_plan(&full, pipe, plan.clone()).unwrap();
                assert_eq!(part.config.num_attention_heads, 2);
                assert_eq!(part.config.num_key_value_heads, 1);
                assert_eq!(part.config.intermediate_size, 12);
                assert_eq!(part.config.hidden_size, full.hidden_size);
                assert_eq!(part.boundary_len(10), 10 * full.hidden_size);
                assert_eq!(part.is_first(), stage == 0);
                assert_eq!(part.layout.has_embedding(), stage == 0);
                assert_eq!(part.layout.has_head(), stage == 1);
                let local = slice_params(&model.params, &full, &plan);
                let data: Vec<f32> = part
                    .specs
                    .iter()
                    .flat_map(|s| {
                        let w = local.spec(&s.name).unwrap();
                        assert_eq!(w.shape, s.shape, "{}", s.name);
                        local.data[w.range()].to_vec()
                    })
                    .collect();
                assert_eq!(data.len(), part.numel());
                planned_parts.push((plan, part.pipe.clone(), data));
            }
        }
        let planned: Vec<_> = planned_parts
            .iter()
            .map(|(plan, pipe, d)| (plan.clone(), pipe.clone(), &d[..]))
            .collect();
        let assembled = assemble_planned(&full, &planned).unwrap();
        assert_eq!(assembled.data, model.params.data);
    }

    #[test]
    fn sliding_window_kinds_follow_the_stage_layers() {
        let full = LlamaConfig::from_json_str(
            r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 11, "max_position_embeddings": 32,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
            "use_sliding_window": true, "sliding_window": 4, "max_window_layers": 1}"#,
            "config.json",
        )
        .unwrap();
        let whole = ModelLayout::from_config(&full);
        for part in stages(&full, 2) {
            let start = part.pipe.partition[part.pipe.stage].start;
            for (k, layer) in part.layout.layers.iter().enumerate() {
                assert_eq!(layer.sliding_window, whole.layers[start + k].sliding_window);
                assert_eq!(
                    part.config.layer_window(k),
                    full.layer_window(start + k),
                    "stage {} layer {k}",
                    part.pipe.stage
                );
            }
        }
    }

    fn refusal(full: &LlamaConfig, pipe: PipelineShard) -> String {
        match PipelineStage::new(full, pipe) {
            Err(EngineError::InvalidArgument { argument, message }) => {
                format!("{argument}: {message}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn what_a_gpu_stage_cannot_run_is_refused_with_the_way_out() {
        let full = untied();
        let interleaved = PipelineShard::balanced(&full, 0, 2, 2, 8).unwrap();
        let msg = refusal(&full, interleaved);
        assert!(
            msg.contains("--pp-size") && msg.contains("interleaved"),
            "{msg}"
        );

        let tied = config(r#", "tie_word_embeddings": true"#);
        let pipe = PipelineShard {
            stage: 0,
            stages: 2,
            chunks: 1,
            partition: vec![0..2, 2..5],
        };
        let msg = refusal(&tied, pipe.clone());
        assert!(msg.contains("tie_word_embeddings"), "{msg}");

        // The ALiBi families (Baichuan-13B here; Bloom is also LayerNorm).
        let mut alibi = untied();
        alibi.family = ModelFamily::Baichuan(crate::config::BaichuanVariant::Baichuan13B);
        let msg = refusal(&alibi, pipe.clone());
        assert!(
            msg.contains("ALiBi") && msg.contains("--pp-size 1"),
            "{msg}"
        );
        // One stage is the whole model: nothing to refuse.
        let whole = PipelineShard::balanced(&alibi, 0, 1, 1, 8).unwrap();
        assert!(PipelineStage::new(&alibi, whole).is_ok());
    }
}
