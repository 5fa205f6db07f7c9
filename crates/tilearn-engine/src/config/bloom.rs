//! Bloom's `config.json` (`BloomForCausalLM`, transformers' `BloomConfig`): its own key names
//! (`n_layer`, `n_head`, `layer_norm_epsilon`; `num_hidden_layers` / `num_attention_heads` /
//! `n_embed` as the aliases transformers accepts), read into the one [`LlamaConfig`] with the
//! Bloom parts (ALiBi, LayerNorm, GeLU MLP of width `4 · hidden`, biases everywhere, tied
//! embeddings by default) and written back in the same names.

use serde_json::{Map, Value};
use tilearn_ops::DType;

use super::{
    AttentionKind, Fields, LlamaConfig, ModelFamily, RopeScalingConfig, TRANSFORMERS_VERSION,
    parse_dtype,
};
use crate::error::Result;

/// Keys this module interprets; the others are kept in `extra`.
const KNOWN_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "n_embed",
    "n_layer",
    "num_hidden_layers",
    "n_head",
    "num_attention_heads",
    "layer_norm_epsilon",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "apply_residual_connection_post_layernorm",
    "torch_dtype",
    "dtype",
    "transformers_version",
];

fn first_of(f: &Fields<'_>, keys: &[&str]) -> Result<Option<usize>> {
    for k in keys {
        if let Some(v) = f.opt_usize(k)? {
            return Ok(Some(v));
        }
    }
    Ok(None)
}

fn positive(f: &Fields<'_>, keys: &[&str]) -> Result<usize> {
    match first_of(f, keys)? {
        Some(0) => Err(f.err(keys[0], "must be positive, found 0")),
        Some(n) => Ok(n),
        None => Err(f.missing(keys[0], "int")),
    }
}

/// A Bloom config.
pub(super) fn parse(f: &Fields<'_>) -> Result<LlamaConfig> {
    if f.opt_bool("apply_residual_connection_post_layernorm")? == Some(true) {
        return Err(f.err(
            "apply_residual_connection_post_layernorm",
            "true is not supported (the residual would be taken after the layer norms); \
             tilearn trains Bloom checkpoints with false, as every published Bloom model has it",
        ));
    }
    let hidden_size = positive(f, &["hidden_size", "n_embed"])?;
    let num_hidden_layers = positive(f, &["n_layer", "num_hidden_layers"])?;
    let heads = positive(f, &["n_head", "num_attention_heads"])?;
    let vocab_size = positive(f, &["vocab_size"])?;
    if hidden_size % heads != 0 {
        return Err(f.err(
            "n_head",
            format!("{heads} does not divide hidden_size = {hidden_size}; use a divisor"),
        ));
    }
    let eps = f.opt_f64("layer_norm_epsilon")?.unwrap_or(1e-5);
    if !(eps >= 0.0 && eps.is_finite()) {
        return Err(f.err(
            "layer_norm_epsilon",
            format!("{eps} must be a finite non-negative number"),
        ));
    }
    let dtype: Option<DType> = match (f.opt_str("dtype")?, f.opt_str("torch_dtype")?) {
        (Some(s), _) => Some(parse_dtype(f, "dtype", s)?),
        (None, Some(s)) => Some(parse_dtype(f, "torch_dtype", s)?),
        (None, None) => None,
    };
    let extra: Map<String, Value> = f
        .obj
        .iter()
        .filter(|(k, _)| !KNOWN_KEYS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(LlamaConfig {
        family: ModelFamily::Bloom,
        hidden_size,
        intermediate_size: 4 * hidden_size,
        num_hidden_layers,
        num_attention_heads: heads,
        num_key_value_heads: heads,
        head_dim: hidden_size / heads,
        vocab_size,
        rms_norm_eps: eps,
        rope_theta: 10000.0,
        rope_scaling: RopeScalingConfig::Default,
        tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(true),
        // ALiBi has no position limit; this only sizes tables nothing reads.
        max_position_embeddings: 2048,
        attention_bias: true,
        mlp_bias: true,
        initializer_range: f.opt_f64("initializer_range")?.unwrap_or(0.02),
        bos_token_id: f.opt_token_id("bos_token_id")?,
        eos_token_ids: f.token_ids("eos_token_id")?,
        pad_token_id: f.opt_token_id("pad_token_id")?,
        dtype,
        sliding_window: None,
        layer_types: vec![AttentionKind::Full; num_hidden_layers],
        z_loss_weight: 0.0,
        extra,
        generation: None,
    })
}

/// The `config.json` document of a Bloom model (transformers 5's form: `dtype`).
pub(super) fn to_json_value(c: &LlamaConfig) -> Value {
    let mut m = c.extra.clone();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put("architectures", Value::from(vec![c.family.architecture()]));
    put("model_type", Value::from(c.family.model_type()));
    put("vocab_size", Value::from(c.vocab_size));
    put("hidden_size", Value::from(c.hidden_size));
    put("n_layer", Value::from(c.num_hidden_layers));
    put("n_head", Value::from(c.num_attention_heads));
    put("layer_norm_epsilon", Value::from(c.rms_norm_eps));
    put("initializer_range", Value::from(c.initializer_range));
    put(
        "apply_residual_connection_post_layernorm",
        Value::from(false),
    );
    put("tie_word_embeddings", Value::from(c.tie_word_embeddings));
    put(
        "bos_token_id",
        c.bos_token_id.map_or(Value::Null, Value::from),
    );
    put(
        "eos_token_id",
        match c.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => Value::from(*one),
            many => Value::from(many.to_vec()),
        },
    );
    put(
        "pad_token_id",
        c.pad_token_id.map_or(Value::Null, Value::from),
    );
    put(
        "dtype",
        Value::from(c.dtype.unwrap_or(DType::F32).hf_name()),
    );
    put("transformers_version", Value::from(TRANSFORMERS_VERSION));
    Value::Object(m)
}
