//! Where each parameter of the model lies in the flat buffer, resolved once (when the
//! [`Activations`](super::Activations) are built) so the forward and backward never look
//! names up.

use std::ops::Range;

use crate::config::LlamaConfig;
use crate::params::{ParamSpec, ParamStore, layer_prefix};

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
    pub gate: LinearLayout,
    pub up: LinearLayout,
    pub down: LinearLayout,
    pub input_norm: Range<usize>,
    pub post_attention_norm: Range<usize>,
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
        let p = layer_prefix(i);
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
            // W_pack = [Q; K; V] along the rows: three consecutive row blocks.
            let pack = find(specs, &format!("{p}.self_attn.W_pack.weight"))?;
            let c = config.hidden_size;
            let (qn, kvn) = (config.q_dim() * c, config.kv_dim() * c);
            let at = |start: usize, len: usize| LinearLayout {
                weight: pack.start + start..pack.start + start + len,
                bias: None,
            };
            (at(0, qn), at(qn, kvn), at(qn + kvn, kvn))
        } else {
            let ab = config.qkv_bias();
            (
                linear("self_attn.q_proj", ab)?,
                linear("self_attn.k_proj", ab)?,
                linear("self_attn.v_proj", ab)?,
            )
        };
        Some(LayerLayout {
            q,
            k,
            v,
            o: linear("self_attn.o_proj", config.o_bias())?,
            gate: linear("mlp.gate_proj", mb)?,
            up: linear("mlp.up_proj", mb)?,
            down: linear("mlp.down_proj", mb)?,
            input_norm: find(specs, &format!("{p}.input_layernorm.weight"))?,
            post_attention_norm: find(specs, &format!("{p}.post_attention_layernorm.weight"))?,
            sliding_window: config.layer_window(i),
        })
    }

    /// The smallest range of the flat buffer holding all of this layer's parameters.
    pub fn span(&self) -> Range<usize> {
        let linears = [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ];
        let norms = [&self.input_norm, &self.post_attention_norm];
        let ranges = linears.iter().flat_map(|l| l.ranges()).chain(norms);
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
        let embed = r("model.embed_tokens.weight");
        let lm_head = if config.tie_word_embeddings {
            embed.clone()
        } else {
            r("lm_head.weight")
        };
        ModelLayout {
            embed,
            layers,
            norm: r("model.norm.weight"),
            lm_head,
            norm_head: config.norm_head(),
            numel: specs.last().map_or(0, |s| s.range().end),
        }
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
