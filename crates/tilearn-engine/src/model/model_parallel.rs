//! One rank's part of a model split by tensor and pipeline parallelism: the tensor-parallel
//! slices ([`ShardPlan`]) of the layers of its pipeline chunks.
//!
//! The layers are cut into `stages × chunks` consecutive global chunks balanced by compute
//! ([`partition_layers`]: each layer's matmul and attention FLOPs, the embedding counted on the
//! first chunk and `lm_head` with the loss on the last), and global chunk `g` lives on stage
//! `g mod stages` as its local chunk `g / stages` (Megatron's interleaving; one chunk per stage
//! without it). A rank's tensors keep their Hugging Face names and order in one flat buffer, so
//! data parallelism, ZeRO and the optimizer see one buffer as everywhere else, and the saved
//! model is put together by name ([`assemble_ranks`]).

use std::ops::Range;

use tilearn_ops::cpu::Real;

use super::block::Dims;
use super::layout::{LayerLayout, find};
use super::stage::{StageParts, stage_backward, stage_forward};
use super::tensor_parallel::{ShardPlan, TensorShard, pieces};
use super::{
    Activations, LlamaForCausalLM, LossStats, PartialSums, Split, shift_targets, vocab_parallel,
};
use crate::config::LlamaConfig;
use crate::error::{EngineError, Result};
use crate::params::{ParamSpec, ParamStore, layer_prefix};

/// A rank's place in the pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelineShard {
    pub stage: usize,
    pub stages: usize,
    /// Model chunks per stage (virtual stages when interleaved, else 1).
    pub chunks: usize,
    /// The layers of every global chunk, in order.
    pub partition: Vec<Range<usize>>,
}

fn usage(message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: "--pp-size".into(),
        message,
    }
}

impl PipelineShard {
    /// The whole model on one stage.
    pub fn single(config: &LlamaConfig) -> PipelineShard {
        PipelineShard {
            stage: 0,
            stages: 1,
            chunks: 1,
            partition: std::iter::once(0..config.num_hidden_layers).collect(),
        }
    }

    /// Stage `stage` of `stages` with `chunks` chunks each, layers balanced by cost for
    /// sequences of `seq` tokens.
    pub fn balanced(
        config: &LlamaConfig,
        stage: usize,
        stages: usize,
        chunks: usize,
        seq: usize,
    ) -> Result<PipelineShard> {
        if stages > 1 && config.tie_word_embeddings {
            return Err(usage(
                "tie_word_embeddings with pipeline parallelism would need the embedding's \
                 gradient shared between the first and the last stage, which is not supported \
                 yet; use --pp-size 1"
                    .into(),
            ));
        }
        Ok(PipelineShard {
            stage,
            stages,
            chunks,
            partition: partition_layers(config, stages * chunks, seq)?,
        })
    }

    /// Stage `stage` of `stages` with `chunks` chunks each and the layers of the global chunks
    /// given by `sizes` (in model order: `--pp-layers`), instead of the balanced cut.
    pub fn with_layer_counts(
        config: &LlamaConfig,
        stage: usize,
        stages: usize,
        chunks: usize,
        sizes: &[usize],
    ) -> Result<PipelineShard> {
        let balanced_shape = Self::balanced(config, stage, stages, chunks, 1)?;
        let (parts, layers) = (stages * chunks, config.num_hidden_layers);
        if sizes.len() != parts || sizes.contains(&0) || sizes.iter().sum::<usize>() != layers {
            return Err(EngineError::InvalidArgument {
                argument: "--pp-layers".into(),
                message: format!(
                    "{sizes:?} must give {parts} positive layer counts (stages × virtual \
                     stages) adding up to num_hidden_layers = {layers}"
                ),
            });
        }
        let mut start = 0;
        let partition = sizes
            .iter()
            .map(|&n| {
                start += n;
                start - n..start
            })
            .collect();
        Ok(PipelineShard {
            partition,
            ..balanced_shape
        })
    }

    /// The global chunk of local chunk `chunk`.
    pub fn global(&self, chunk: usize) -> usize {
        chunk * self.stages + self.stage
    }

    fn is_first(&self, chunk: usize) -> bool {
        self.global(chunk) == 0
    }

    fn is_last(&self, chunk: usize) -> bool {
        self.global(chunk) + 1 == self.partition.len()
    }
}

/// Forward FLOPs per token of decoder layer work, of the embedding (none) and of the head.
fn layer_cost(config: &LlamaConfig, seq: usize) -> f64 {
    let (c, q, kv, inter) = (
        config.hidden_size as f64,
        config.q_dim() as f64,
        config.kv_dim() as f64,
        config.intermediate_size as f64,
    );
    2.0 * (c * q + 2.0 * c * kv + q * c) + 6.0 * c * inter + 2.0 * seq as f64 * q
}

fn head_cost(config: &LlamaConfig) -> f64 {
    2.0 * config.hidden_size as f64 * config.vocab_size as f64
}

/// Consecutive layer ranges for `parts` chunks minimising the costliest chunk (the head counted
/// on the last one); every chunk gets at least one layer.
pub fn partition_layers(
    config: &LlamaConfig,
    parts: usize,
    seq: usize,
) -> Result<Vec<Range<usize>>> {
    let layers = config.num_hidden_layers;
    if parts == 0 || layers < parts {
        return Err(usage(format!(
            "{parts} pipeline chunks (stages × virtual stages) need at least as many layers; \
             the model has num_hidden_layers = {layers}"
        )));
    }
    let per_layer = layer_cost(config, seq);
    let head = head_cost(config);
    let cost = |range: &Range<usize>, last: bool| {
        range.len() as f64 * per_layer + if last { head } else { 0.0 }
    };
    // best[k][i]: the least possible maximum cost of cutting layers 0..i into k chunks.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; layers + 1]; parts + 1];
    let mut cut = vec![vec![0usize; layers + 1]; parts + 1];
    best[0][0] = 0.0;
    for k in 1..=parts {
        for i in k..=layers {
            for j in (k - 1)..i {
                let c = best[k - 1][j].max(cost(&(j..i), k == parts && i == layers));
                if c < best[k][i] {
                    best[k][i] = c;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(parts);
    let mut end = layers;
    for k in (1..=parts).rev() {
        let start = cut[k][end];
        ranges.push(start..end);
        end = start;
    }
    ranges.reverse();
    Ok(ranges)
}

/// One local chunk: where its tensors lie in the rank's buffer and the config its buffers are
/// sized by.
#[derive(Clone, Debug)]
struct Chunk {
    embed: Option<Range<usize>>,
    layers: Vec<LayerLayout>,
    head: Option<(Range<usize>, Range<usize>)>,
    /// The tensor-parallel local config with this chunk's layer count (and no vocabulary
    /// unless it ends the model: only the last chunk holds logits).
    config: LlamaConfig,
}

impl Chunk {
    fn parts(&self) -> StageParts<'_> {
        StageParts {
            embed: self.embed.as_ref(),
            layers: &self.layers,
            head: self.head.as_ref().map(|(n, h)| (n, h)),
            // Bloom is refused by `from_full`: the other families have neither.
            norm_bias: None,
            embed_norm: None,
        }
    }
}

/// One rank's part of a tensor- and pipeline-parallel Llama.
#[derive(Clone, Debug)]
pub struct RankModel {
    pub full_config: LlamaConfig,
    pub plan: ShardPlan,
    pub pipe: PipelineShard,
    /// The rank's tensors (tensor-parallel slices of its chunks' tensors), Hugging Face names.
    pub params: ParamStore,
    chunks: Vec<Chunk>,
    /// Megatron's sequence parallelism: between the tensor-parallel products (and between
    /// pipeline stages) the rank holds its chunk of the rows.
    pub sequence_parallel: bool,
}

/// The tensors rank (`tp`, `pipe`) holds, with offsets in its flat buffer.
pub fn rank_specs(full: &LlamaConfig, plan: &ShardPlan, pipe: &PipelineShard) -> Vec<ParamSpec> {
    let local = plan.local_config(full);
    let mut layers = Vec::new();
    let (mut first, mut last) = (false, false);
    for chunk in 0..pipe.chunks {
        layers.extend(pipe.partition[pipe.global(chunk)].clone());
        first |= pipe.is_first(chunk);
        last |= pipe.is_last(chunk);
    }
    let owns = |name: &str| -> bool {
        if name == "model.embed_tokens.weight" {
            return first || (last && full.tie_word_embeddings);
        }
        if name == "model.norm.weight" || name == "lm_head.weight" {
            return last;
        }
        layers
            .iter()
            .any(|&i| name.starts_with(&format!("{}.", layer_prefix(i))))
    };
    let mut offset = 0;
    ParamStore::specs_for(&local)
        .into_iter()
        .filter(|s| owns(&s.name))
        .map(|mut s| {
            s.offset = offset;
            offset += s.numel();
            s
        })
        .collect()
}

impl RankModel {
    /// Rank (`tp`, `pipe`)'s part of `full`.
    pub fn from_full(
        full: &LlamaForCausalLM,
        tp: TensorShard,
        pipe: PipelineShard,
    ) -> Result<RankModel> {
        if full.config.family == crate::config::ModelFamily::Bloom {
            return Err(EngineError::InvalidArgument {
                argument: "--tp-size / --pp-size".into(),
                message: "Bloom is not supported with tensor or pipeline parallelism yet; train \
                          it with --tp-size 1 --pp-size 1 (data parallelism and ZeRO work)"
                    .into(),
            });
        }
        let plan = ShardPlan::new(&full.config, tp)?;
        let specs = rank_specs(&full.config, &plan, &pipe);
        let numel = specs.last().map_or(0, |s| s.range().end);
        let mut params = ParamStore {
            specs,
            data: vec![0.0; numel],
        };
        for spec in &params.specs {
            let full_spec = full
                .params
                .spec(&spec.name)
                .expect("a rank's tensors are the full model's");
            let (src, dst) = (
                &full.params.data[full_spec.range()],
                &mut params.data[spec.range()],
            );
            for (f, l) in pieces(&full_spec.shape, &plan.cut(&spec.name)) {
                dst[l].copy_from_slice(&src[f]);
            }
        }
        let local = plan.local_config(&full.config);
        let chunks = (0..pipe.chunks)
            .map(|chunk| {
                let layers = pipe.partition[pipe.global(chunk)].clone();
                let mut config = local.clone();
                config.num_hidden_layers = layers.len();
                let last = pipe.is_last(chunk);
                if !last {
                    config.vocab_size = 0;
                }
                let specs = &params.specs;
                let embed_range = || find(specs, "model.embed_tokens.weight");
                Chunk {
                    embed: if pipe.is_first(chunk) {
                        embed_range()
                    } else {
                        None
                    },
                    layers: layers
                        .map(|i| {
                            LayerLayout::find(specs, i, &local)
                                .expect("a rank holds every tensor of its layers")
                        })
                        .collect(),
                    head: last.then(|| {
                        let norm = find(specs, "model.norm.weight").expect("the last stage's norm");
                        let lm_head = if full.config.tie_word_embeddings {
                            embed_range()
                        } else {
                            find(specs, "lm_head.weight")
                        }
                        .expect("the last stage's lm_head");
                        (norm, lm_head)
                    }),
                    config,
                }
            })
            .collect();
        Ok(RankModel {
            full_config: full.config.clone(),
            plan,
            pipe,
            params,
            chunks,
            sequence_parallel: false,
        })
    }

    /// The elements of a chunk's input or output activations (`rows` = batch · seq) on this
    /// rank: all rows, or with sequence parallelism its chunk of them.
    pub fn boundary_len(&self, rows: usize) -> usize {
        let parts = if self.sequence_parallel {
            self.plan.shard.size
        } else {
            1
        };
        rows / parts * self.full_config.hidden_size
    }

    /// The activation buffers of one micro-batch through local chunk `chunk`.
    pub fn activations(
        &self,
        chunk: usize,
        batch: usize,
        seq: usize,
        recompute: bool,
    ) -> Activations<f32> {
        Activations::new(&self.chunks[chunk].config, batch, seq, recompute)
    }

    fn split<'a, R>(&self, sums: &'a dyn PartialSums<R>) -> Split<'a, R> {
        Split {
            sums,
            vocab: self.plan.vocab.clone(),
            full_vocab: self.full_config.vocab_size,
            sequence_parallel: self.sequence_parallel,
        }
    }

    /// Forward of local chunk `chunk`: from the token ids when it starts the model, else from
    /// `input` (the previous chunk's output, `[batch·seq, hidden]`). When it ends the model the
    /// shifted `labels` are kept for [`Self::backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward<R: Real>(
        &self,
        chunk: usize,
        params: &[R],
        ids: &[u32],
        labels: &[i32],
        (batch, seq): (usize, usize),
        input: Option<&[R]>,
        acts: &mut Activations<R>,
        sums: &dyn PartialSums<R>,
    ) -> Result<()> {
        let c = &self.chunks[chunk];
        let d = Dims::new(&c.config, batch, seq);
        if c.head.is_some() {
            shift_targets(&mut acts.targets[..d.n], labels, seq);
        }
        stage_forward(&d, &c.parts(), params, ids, input, acts, &self.split(sums))
    }

    /// The output of local chunk `chunk` after its forward (the next chunk's input; this
    /// rank's rows of it with sequence parallelism). `rows` = batch · seq of the call.
    pub fn output<'a, R: Real>(
        &self,
        chunk: usize,
        acts: &'a Activations<R>,
        rows: usize,
    ) -> &'a [R] {
        let c = &self.chunks[chunk];
        let slab = rows * c.config.hidden_size;
        let nl = c.layers.len();
        &acts.resid[nl * slab..nl * slab + self.boundary_len(rows)]
    }

    /// Backward of local chunk `chunk` after its forward: from the loss (scaled by `grad_scale`)
    /// when it ends the model, else from `dout`. Parameter gradients are added into `grads`;
    /// the gradient of the chunk's input is then [`Self::input_grad`]. Returns the loss when the
    /// chunk computed it.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<R: Real>(
        &self,
        chunk: usize,
        params: &[R],
        grads: &mut [R],
        ids: &[u32],
        (batch, seq): (usize, usize),
        dout: Option<&[R]>,
        grad_scale: f64,
        acts: &mut Activations<R>,
        sums: &dyn PartialSums<R>,
    ) -> Result<Option<LossStats>> {
        let c = &self.chunks[chunk];
        let d = Dims::new(&c.config, batch, seq);
        let loss = stage_backward(
            &d,
            &c.parts(),
            params,
            grads,
            ids,
            dout,
            grad_scale,
            acts,
            &self.split(sums),
        )?;
        Ok(loss.map(|l| LossStats {
            loss_sum: l.loss_sum,
            valid_tokens: l.valid,
        }))
    }

    /// The loss of local chunk `chunk` (which ends the model) after its forward, without the
    /// backward (evaluation).
    pub fn loss<R: Real>(
        &self,
        chunk: usize,
        acts: &Activations<R>,
        rows: usize,
        sums: &dyn PartialSums<R>,
    ) -> Result<LossStats> {
        let c = &self.chunks[chunk];
        let n = rows;
        let (logits, targets) = (&acts.logits[..n * c.config.vocab_size], &acts.targets[..n]);
        let ce = vocab_parallel::loss(
            logits,
            targets,
            c.config.vocab_size,
            c.config.z_loss_weight,
            &self.split(sums),
        )?;
        Ok(LossStats {
            loss_sum: ce.loss_sum,
            valid_tokens: ce.valid,
        })
    }

    /// Local chunks per stage.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The gradient of a chunk's input after its backward (for the previous chunk).
    pub fn input_grad<'a, R: Real>(&self, acts: &'a Activations<R>, rows: usize) -> &'a [R] {
        &acts.grad.dres[..self.boundary_len(rows)]
    }

    /// Whether local chunk `chunk` ends the model (computes the loss).
    pub fn ends_model(&self, chunk: usize) -> bool {
        self.chunks[chunk].head.is_some()
    }

    /// Whether local chunk `chunk` starts the model (embeds the tokens).
    pub fn starts_model(&self, chunk: usize) -> bool {
        self.chunks[chunk].embed.is_some()
    }

    /// The local ranges whose gradients this rank counts in the global norm (tensors
    /// replicated over tensor parallelism counted once).
    pub fn norm_ranges(&self) -> Vec<Range<usize>> {
        self.params
            .specs
            .iter()
            .filter(|s| self.plan.counts_in_norm(&s.name))
            .map(ParamSpec::range)
            .collect()
    }

    /// The k/v weights' ranges when their heads are replicated over tensor parallelism (their
    /// gradients are summed over the replicas), else empty.
    pub fn kv_gradient_ranges(&self) -> Vec<Range<usize>> {
        if self.plan.kv_replicas == 1 {
            return Vec::new();
        }
        self.params
            .specs
            .iter()
            .filter(|s| s.name.contains("k_proj") || s.name.contains("v_proj"))
            .map(ParamSpec::range)
            .collect()
    }
}

/// The whole model's parameters put together from ranks' buffers: `parts[i]` is the tensor and
/// pipeline place of a rank and its flat buffer (possibly padded at the end). Every tensor must
/// be covered by some rank.
pub fn assemble_ranks(
    full_config: &LlamaConfig,
    parts: &[(TensorShard, PipelineShard, &[f32])],
) -> Result<ParamStore> {
    let planned = parts
        .iter()
        .map(|(tp, pipe, data)| Ok((ShardPlan::new(full_config, *tp)?, pipe.clone(), *data)))
        .collect::<Result<Vec<_>>>()?;
    assemble_planned(full_config, &planned)
}

/// [`assemble_ranks`] for ranks whose cuts are given as plans (e.g. the GPU engine's, see
/// `trainer::gpu_backend::tensor_parallel`); a tensor several ranks hold whole is written by
/// each (they hold the same values).
pub fn assemble_planned(
    full_config: &LlamaConfig,
    parts: &[(ShardPlan, PipelineShard, &[f32])],
) -> Result<ParamStore> {
    let mut full = ParamStore::from_config(full_config);
    for (plan, pipe, data) in parts {
        for spec in rank_specs(full_config, plan, pipe) {
            let full_spec = full
                .spec(&spec.name)
                .expect("a rank's tensors are the full model's")
                .clone();
            let (src, dst) = (&data[spec.range()], &mut full.data[full_spec.range()]);
            for (f, l) in pieces(&full_spec.shape, &plan.cut(&spec.name)) {
                dst[f].copy_from_slice(&src[l]);
            }
        }
    }
    Ok(full)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tensor_parallel::{Cut, slice_params};

    fn config() -> LlamaConfig {
        LlamaConfig::from_json_str(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 11, "max_position_embeddings": 32,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
            "test/config.json",
        )
        .unwrap()
    }

    /// The vocabulary cut both engines use (the GPU engine's tensor parallelism included): an
    /// uneven vocabulary (11 words over 2 ranks) gives the first rank one row more (6 + 5, no
    /// padding), the embedding and lm_head are rows of it on every rank and counted in the norm
    /// by each (they hold different rows), tied or not, and slicing then assembling the ranks'
    /// buffers gives the model back.
    #[test]
    fn vocabulary_rows_split_unevenly_and_assemble_to_the_whole_model() {
        for tied in [false, true] {
            let mut config = config();
            config.tie_word_embeddings = tied;
            let model = LlamaForCausalLM::from_config(config.clone(), 3);
            let plans: Vec<ShardPlan> = (0..2)
                .map(|rank| ShardPlan::new(&config, TensorShard { rank, size: 2 }).unwrap())
                .collect();
            for (rank, plan) in plans.iter().enumerate() {
                let rows = [0..6, 6..11][rank].clone();
                assert_eq!(plan.vocab, rows);
                let local = plan.local_config(&config);
                assert_eq!(local.vocab_size, rows.len());
                for name in ["model.embed_tokens.weight", "lm_head.weight"] {
                    assert_eq!(plan.cut(name), Cut::Rows(rows.clone()), "{name}");
                    assert!(plan.counts_in_norm(name), "{name} on rank {rank}");
                }
                assert_eq!(plan.cut("model.norm.weight"), Cut::Whole);
                assert_eq!(plan.counts_in_norm("model.norm.weight"), rank == 0);
                let specs = ParamStore::specs_for(&local);
                let embed = specs
                    .iter()
                    .find(|s| s.name == "model.embed_tokens.weight")
                    .unwrap();
                assert_eq!(embed.shape, vec![rows.len(), 16]);
                assert_eq!(
                    specs.iter().any(|s| s.name == "lm_head.weight"),
                    !tied,
                    "a tied head is the embedding's slice"
                );
            }
            let sliced: Vec<ParamStore> = plans
                .iter()
                .map(|p| slice_params(&model.params, &config, p))
                .collect();
            let parts: Vec<(ShardPlan, PipelineShard, &[f32])> = plans
                .iter()
                .zip(&sliced)
                .map(|(p, s)| (p.clone(), PipelineShard::single(&config), s.data.as_slice()))
                .collect();
            let whole = assemble_planned(&config, &parts).unwrap();
            assert_eq!(whole.data, model.params.data, "tied = {tied}");
        }
    }
}
