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
}

/// The parameters of the whole model. With tied embeddings `lm_head == embed`.
#[derive(Clone, Debug)]
pub struct ModelLayout {
    pub embed: Range<usize>,
    pub layers: Vec<LayerLayout>,
    pub norm: Range<usize>,
    pub lm_head: Range<usize>,
    /// Length of the flat buffer.
    pub numel: usize,
}

impl ModelLayout {
    /// The layout of the parameters of a model described by `config` (the order of
    /// [`ParamStore::specs_for`]).
    pub fn from_config(config: &LlamaConfig) -> ModelLayout {
        let specs = ParamStore::specs_for(config);
        let r = |name: &str| -> Range<usize> {
            specs
                .iter()
                .find(|s| s.name == name)
                .map(ParamSpec::range)
                .expect("specs_for lists every tensor the layout names")
        };
        let linear = |name: String, bias: bool| LinearLayout {
            weight: r(&format!("{name}.weight")),
            bias: bias.then(|| r(&format!("{name}.bias"))),
        };
        let (ab, mb) = (config.attention_bias, config.mlp_bias);
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let p = layer_prefix(i);
                LayerLayout {
                    q: linear(format!("{p}.self_attn.q_proj"), ab),
                    k: linear(format!("{p}.self_attn.k_proj"), ab),
                    v: linear(format!("{p}.self_attn.v_proj"), ab),
                    o: linear(format!("{p}.self_attn.o_proj"), ab),
                    gate: linear(format!("{p}.mlp.gate_proj"), mb),
                    up: linear(format!("{p}.mlp.up_proj"), mb),
                    down: linear(format!("{p}.mlp.down_proj"), mb),
                    input_norm: r(&format!("{p}.input_layernorm.weight")),
                    post_attention_norm: r(&format!("{p}.post_attention_layernorm.weight")),
                }
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
            numel: specs.last().map_or(0, |s| s.range().end),
        }
    }
}
