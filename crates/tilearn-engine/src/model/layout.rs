//! Where each parameter of the model lies in the flat buffer, resolved once (when the
//! [`Activations`](super::Activations) are built) so the forward and backward never look
//! names up.

use std::ops::Range;

use crate::config::{LlamaConfig, NormKind};
use crate::params::{ParamSpec, ParamStore, TensorNames};

/// A linear layer: weight `[out, in]` and optional bias `[out]`.
#[derive(Clone, Debug)]
pub struct LinearLayout {
    pub weight: Range<usize>,
    pub bias: Option<Range<usize>>,
}

/// The parameters of one decoder layer.
#[derive(Clone, Debug)]
pub struct LayerLayout {
    pub q: LinearLayout,
    pub k: LinearLayout,
    pub v: LinearLayout,
    pub o: LinearLayout,
    /// SwiGLU's gate; `None` for the tanh-GeLU MLP (Bloom), which is `down(gelu(up(x)))`.
    pub gate: Option<LinearLayout>,
    pub up: LinearLayout,
    pub down: LinearLayout,
    pub input_norm: Range<usize>,
    pub post_attention_norm: Range<usize>,
    /// LayerNorm biases (Bloom); `None` for RMSNorm.
    pub input_norm_bias: Option<Range<usize>>,
    pub post_attention_norm_bias: Option<Range<usize>>,
    /// The layer's sliding window (keys `i - W < j <= i`), `None` for full causal attention.
    pub sliding_window: Option<usize>,
}

impl LinearLayout {
    fn ranges(&self) -> impl Iterator<Item = &Range<usize>> {
        std::iter::once(&self.weight).chain(self.bias.as_ref())
    }
}

/// The range of tensor `name` in `specs`.
pub(crate) fn find(specs: &[ParamSpec], name: &str) -> Option<Range<usize>> {
    specs.iter().find(|s| s.name == name).map(ParamSpec::range)
}

impl LayerLayout {
    /// Where decoder layer `i` (Hugging Face index) lies in the buffer of `specs`, or `None` if
    /// a tensor of it is missing.
    pub(crate) fn find(specs: &[ParamSpec], i: usize, config: &LlamaConfig) -> Option<LayerLayout> {
        let names = TensorNames::of(config.family);
        let p = names.layer(i);
        let linear = |name: &str, bias: bool| -> Option<LinearLayout> {
            Some(LinearLayout {
                weight: find(specs, &format!("{p}.{name}.weight"))?,
                bias: if bias {
                    Some(find(specs, &format!("{p}.{name}.bias"))?)
                } else {
                    None
                },
            })
        };
        let mb = config.mlp_bias;
        let (q, k, v) = if config.family.packed_qkv() {
            // W_pack / query_key_value = [Q; K; V] along the rows: three consecutive row
            // blocks (and bias blocks).
            let pack = find(specs, &format!("{p}.{}.weight", names.qkv))?;
            let bias = if config.qkv_bias() {
                Some(find(specs, &format!("{p}.{}.bias", names.qkv))?)
            } else {
                None
            };
            let c = config.hidden_size;
            let (qd, kvd) = (config.q_dim(), config.kv_dim());
            let at = |start: usize, rows: usize| LinearLayout {
                weight: pack.start + start * c..pack.start + (start + rows) * c,
                bias: bias
                    .as_ref()
                    .map(|b| b.start + start..b.start + start + rows),
            };
            (at(0, qd), at(qd, kvd), at(qd + kvd, kvd))
        } else {
            let ab = config.qkv_bias();
            (
                linear("self_attn.q_proj", ab)?,
                linear("self_attn.k_proj", ab)?,
                linear("self_attn.v_proj", ab)?,
            )
        };
        let norm_bias = |name: &str| -> Option<Option<Range<usize>>> {
            match config.family.norm_kind() {
                NormKind::Rms => Some(None),
                NormKind::Layer => Some(Some(find(specs, &format!("{p}.{name}.bias"))?)),
            }
        };
        Some(LayerLayout {
            q,
            k,
            v,
            o: linear(names.o, config.o_bias())?,
            gate: match names.gate {
                Some(gate) => Some(linear(gate, mb)?),
                None => None,
            },
            up: linear(names.up, mb)?,
            down: linear(names.down, mb)?,
            input_norm: find(specs, &format!("{p}.input_layernorm.weight"))?,
            post_attention_norm: find(specs, &format!("{p}.post_attention_layernorm.weight"))?,
            input_norm_bias: norm_bias("input_layernorm")?,
            post_attention_norm_bias: norm_bias("post_attention_layernorm")?,
            sliding_window: config.layer_window(i),
        })
    }

    /// The smallest range of the flat buffer holding all of this layer's parameters.
    pub fn span(&self) -> Range<usize> {
        let linears = [&self.q, &self.k, &self.v, &self.o, &self.up, &self.down];
        let norms = [&self.input_norm, &self.post_attention_norm];
        let norm_biases = [&self.input_norm_bias, &self.post_attention_norm_bias];
        let ranges = linears
            .into_iter()
            .chain(self.gate.as_ref())
            .flat_map(|l| l.ranges())
            .chain(norms)
            .chain(norm_biases.into_iter().flatten());
        let (mut start, mut end) = (usize::MAX, 0);
        for r in ranges {
            start = start.min(r.start);
            end = end.max(r.end);
        }
        start.min(end)..end
    }
}

/// The parameters of the whole model. With tied embeddings `lm_head == embed`.
#[derive(Clone, Debug)]
pub struct ModelLayout {
    pub embed: Range<usize>,
    pub layers: Vec<LayerLayout>,
    pub norm: Range<usize>,
    pub lm_head: Range<usize>,
    /// The final norm's bias (LayerNorm, Bloom).
    pub norm_bias: Option<Range<usize>>,
    /// The LayerNorm after the embedding (Bloom's `word_embeddings_layernorm`): weight, bias.
    pub embed_norm: Option<(Range<usize>, Range<usize>)>,
    /// Whether the lm_head rows are L2-normalised before the product (Baichuan2's NormHead).
    pub norm_head: bool,
    /// Length of the flat buffer.
    pub numel: usize,
}

impl ModelLayout {
    /// The layout of the parameters of a model described by `config` (the order of
    /// [`ParamStore::specs_for`]).
    pub fn from_config(config: &LlamaConfig) -> ModelLayout {
        let specs = ParamStore::specs_for(config);
        let r = |name: &str| -> Range<usize> {
            find(&specs, name).expect("specs_for lists every tensor the layout names")
        };
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                LayerLayout::find(&specs, i, config)
                    .expect("specs_for lists every tensor the layout names")
            })
            .collect();
        let names = TensorNames::of(config.family);
        let embed = r(names.embed);
        let lm_head = if config.tie_word_embeddings {
            embed.clone()
        } else {
            r("lm_head.weight")
        };
        ModelLayout {
            embed,
            layers,
            norm: r(&format!("{}.weight", names.final_norm)),
            norm_bias: (config.family.norm_kind() == NormKind::Layer)
                .then(|| r(&format!("{}.bias", names.final_norm))),
            embed_norm: names
                .embed_norm
                .map(|n| (r(&format!("{n}.weight")), r(&format!("{n}.bias")))),
            lm_head,
            norm_head: config.norm_head(),
            numel: specs.last().map_or(0, |s| s.range().end),
        }
    }

    /// Whether the buffer holds the embedding (a whole model, or a pipeline's first stage:
    /// see [`crate::model::pipeline_stage`], where a tensor a stage lacks has an empty range).
    pub fn has_embedding(&self) -> bool {
        !self.embed.is_empty()
    }

    /// Whether the buffer holds the final norm and `lm_head` (a whole model, or a pipeline's
    /// last stage).
    pub fn has_head(&self) -> bool {
        !self.norm.is_empty()
    }

    /// Where the backward can hand finished gradients on: offsets `o₀ > o₁ > …` such that once
    /// the final norm (and an untied `lm_head`) is done `o₀..numel` is final, and once layer
    /// `L−1−k` is done `o_{k+1}..o_k` is final too. The backward runs from the loss towards the
    /// embedding, so this holds when the parameters lie in that order: embedding, layer 0, …,
    /// layer L−1, then the final norm and `lm_head` (Hugging Face's order, which
    /// [`ParamStore::specs_for`] keeps). `None` for any other layout: then gradients are
    /// handed on only after the whole backward.
    pub fn backward_handoffs(&self) -> Option<Vec<usize>> {
        let spans: Vec<Range<usize>> = self.layers.iter().map(LayerLayout::span).collect();
        let tail_start = self.norm.start;
        let head_end = spans.first().map_or(tail_start, |s| s.start);
        // Tied: lm_head is the embedding, written last of all, at the front.
        let lm_head_in_tail = self.lm_head == self.embed || self.lm_head.start >= tail_start;
        let ordered = self.embed.end <= head_end
            && lm_head_in_tail
            && spans.windows(2).all(|w| w[0].end <= w[1].start)
            && spans.last().is_none_or(|s| s.end <= tail_start);
        if !ordered {
            return None;
        }
        let mut offsets = vec![tail_start];
        offsets.extend(spans.iter().rev().map(|s| s.start));
        Some(offsets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(tied: bool, layers: usize) -> LlamaConfig {
        let json = format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":8,"intermediate_size":16,
               "num_hidden_layers":{layers},"num_attention_heads":2,"num_key_value_heads":1,
               "vocab_size":11,"tie_word_embeddings":{tied},"attention_bias":true}}"#
        );
        LlamaConfig::from_json_str(&json, "config.json").unwrap()
    }

    #[test]
    fn handoffs_cover_the_model_from_the_end_in_backward_order() {
        for tied in [false, true] {
            let layout = ModelLayout::from_config(&config(tied, 3));
            let offsets = layout.backward_handoffs().expect("Hugging Face order");
            assert_eq!(offsets.len(), 1 + 3);
            assert!(offsets.windows(2).all(|w| w[0] > w[1]), "{offsets:?}");
            // The first hand-off holds the final norm (and lm_head when untied), the last
            // one starts at layer 0, after the embedding, which is handed on at the very end.
            assert_eq!(offsets[0], layout.norm.start);
            assert_eq!(*offsets.last().unwrap(), layout.embed.end);
            for (k, layer) in layout.layers.iter().rev().enumerate() {
                assert_eq!(layer.span().start, offsets[k + 1]);
                assert_eq!(layer.span().end, offsets[k]);
            }
        }
    }

    #[test]
    fn a_layout_out_of_backward_order_has_no_handoffs() {
        let mut layout = ModelLayout::from_config(&config(false, 2));
        layout.layers.swap(0, 1);
        assert_eq!(layout.backward_handoffs(), None);
    }
}
