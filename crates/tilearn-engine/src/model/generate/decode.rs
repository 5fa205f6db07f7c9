//! The forward of a [`LlamaForCausalLM`] over new tokens of one sequence, attending to a
//! [`KvCache`] of the tokens before them: the prompt in one call (prefill), then one token per
//! call (decode). The layer math is the model's (`block.rs`), with attention reading the cache.

use tilearn_ops::cpu::{
    CachedAttnShape, add_inplace, cached_attention_alibi, check_token_ids, embedding_forward,
    gelu_tanh_forward, linear_forward, rope_forward, swiglu_forward,
};

use super::family_parts::{alibi_slopes, apply_head_scale, check_sliding_window, norm_head_scale};
use super::kv_cache::KvCache;
use super::rotary::rope_rows;
use crate::error::{EngineError, Result};
use crate::model::norm::{NormAt, norm_forward};
use crate::model::{LayerLayout, LinearLayout, LlamaForCausalLM, ModelLayout};

/// Buffers of one chunk of `n` new rows, grown to the largest chunk seen.
#[derive(Clone, Debug, Default)]
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    rstd: Vec<f32>,
    mean: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    h: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
}

impl Scratch {
    fn resize(&mut self, model: &LlamaForCausalLM, n: usize) {
        let c = &model.config;
        let (hid, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        for (buf, width) in [
            (&mut self.x, hid),
            (&mut self.xn, hid),
            (&mut self.rstd, 1),
            (&mut self.mean, 1),
            (&mut self.q, q),
            (&mut self.k, kv),
            (&mut self.v, kv),
            (&mut self.att, q),
            (&mut self.h, hid),
            (&mut self.gate, inter),
            (&mut self.up, inter),
            (&mut self.act, inter),
        ] {
            buf.resize(n * width, 0.0);
        }
    }
}

/// Runs a model forward over a sequence piece by piece, keeping the keys and values.
#[derive(Clone, Debug)]
pub struct CachedDecoder<'m> {
    model: &'m LlamaForCausalLM,
    layout: ModelLayout,
    cache: KvCache,
    scratch: Scratch,
    logits: Vec<f32>,
    /// NormHead's per-row logit scale (Baichuan2), `None` for the other families.
    head_scale: Option<Vec<f32>>,
    /// ALiBi slopes (Baichuan-13B), `None` for RoPE models.
    alibi: Option<Vec<f32>>,
}

impl<'m> CachedDecoder<'m> {
    /// A decoder with an empty cache for sequences of up to `capacity` tokens (memory is
    /// taken as the sequence grows, not up front).
    pub fn new(model: &'m LlamaForCausalLM, capacity: usize) -> CachedDecoder<'m> {
        CachedDecoder {
            model,
            layout: model.layout(),
            cache: KvCache::new(&model.config, capacity),
            scratch: Scratch::default(),
            logits: vec![0.0; model.config.vocab_size],
            head_scale: norm_head_scale(model),
            alibi: alibi_slopes(&model.config),
        }
    }

    /// Tokens of the sequence processed so far (the position of the next one).
    pub fn position(&self) -> usize {
        self.cache.len()
    }

    /// The cache (its length, capacity and size).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Starts a new sequence, keeping the buffers.
    pub fn reset(&mut self) {
        self.cache.clear();
    }

    /// Appends `ids` to the sequence (positions `position()..position() + ids.len()`) and returns
    /// the logits `[vocab]` of the last of them: the distribution of the token after it.
    pub fn forward(&mut self, ids: &[u32]) -> Result<&[f32]> {
        let model = self.model;
        let config = &model.config;
        let (n, start) = (ids.len(), self.cache.len());
        if n == 0 {
            return Err(invalid(
                "ids",
                "is empty; pass at least one token id".into(),
            ));
        }
        if start + n > self.cache.capacity() {
            return Err(invalid(
                "ids",
                format!(
                    "{n} more tokens after {start} exceed the cache capacity of {} positions; \
                     build the decoder with a larger capacity",
                    self.cache.capacity()
                ),
            ));
        }
        check_token_ids(ids, config.vocab_size)?;
        check_sliding_window(config, start + n)?;
        let p = &model.params.data;
        let c = config.hidden_size;
        self.scratch.resize(model, n);
        self.cache.reserve(start + n);
        let rope = rope_rows(config, start, n);
        let s = &mut self.scratch;
        embedding_forward(ids, &p[self.layout.embed.clone()], c, &mut s.x)?;
        if let Some((w, b)) = &self.layout.embed_norm {
            let at = NormAt {
                weight: w,
                bias: Some(b),
            };
            let eps = config.rms_norm_eps;
            norm_forward(at, p, &s.x, c, eps, &mut s.xn, &mut s.mean, &mut s.rstd)?;
            s.x.copy_from_slice(&s.xn);
        }
        for (lay, kv) in self.layout.layers.iter().zip(&mut self.cache.layers) {
            let row = self.cache.row;
            let cached = start * row..(start + n) * row;
            let rope = if self.alibi.is_some() {
                None
            } else {
                Some(&rope)
            };
            layer_forward(model, lay, p, rope, n, s)?;
            kv.k[cached.clone()].copy_from_slice(&s.k);
            kv.v[cached].copy_from_slice(&s.v);
            let shape = CachedAttnShape {
                n,
                start,
                q_heads: config.num_attention_heads,
                kv_heads: config.num_key_value_heads,
                head_dim: config.head_dim,
            };
            let seen = (start + n) * row;
            let (k, v, alibi) = (&kv.k[..seen], &kv.v[..seen], self.alibi.as_deref());
            cached_attention_alibi(shape, alibi, &s.q, k, v, &mut s.att)?;
            layer_finish(model, lay, p, n, s)?;
        }
        self.cache.advance(n);
        // Only the last position's logits are needed to pick the next token.
        let last = &s.x[(n - 1) * c..n * c];
        let at = NormAt {
            weight: &self.layout.norm,
            bias: self.layout.norm_bias.as_ref(),
        };
        norm_forward(
            at,
            p,
            last,
            c,
            config.rms_norm_eps,
            &mut s.xn[..c],
            &mut s.mean[..1],
            &mut s.rstd[..1],
        )?;
        linear_forward(
            &s.xn[..c],
            &p[self.layout.lm_head.clone()],
            None,
            1,
            c,
            config.vocab_size,
            &mut self.logits,
        )?;
        apply_head_scale(self.head_scale.as_deref(), &mut self.logits);
        Ok(&self.logits)
    }
}

fn linear(
    p: &[f32],
    l: &LinearLayout,
    x: &[f32],
    rows: usize,
    in_f: usize,
    out_f: usize,
    out: &mut [f32],
) -> Result<()> {
    let bias = l.bias.as_ref().map(|b| &p[b.clone()]);
    Ok(linear_forward(
        x,
        &p[l.weight.clone()],
        bias,
        rows,
        in_f,
        out_f,
        out,
    )?)
}

/// The layer up to attention: `s.q`, `s.k` (rotated by `rope`, whose rows are the chunk's
/// absolute positions; not rotated for ALiBi models) and `s.v` from the block input `s.x`.
fn layer_forward(
    model: &LlamaForCausalLM,
    lay: &LayerLayout,
    p: &[f32],
    rope: Option<&tilearn_ops::cpu::RopeTable>,
    n: usize,
    s: &mut Scratch,
) -> Result<()> {
    let cfg = &model.config;
    let (c, q, kv, d) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
    let at = NormAt {
        weight: &lay.input_norm,
        bias: lay.input_norm_bias.as_ref(),
    };
    let eps = cfg.rms_norm_eps;
    norm_forward(at, p, &s.x, c, eps, &mut s.xn, &mut s.mean, &mut s.rstd)?;
    linear(p, &lay.q, &s.xn, n, c, q, &mut s.q)?;
    linear(p, &lay.k, &s.xn, n, c, kv, &mut s.k)?;
    linear(p, &lay.v, &s.xn, n, c, kv, &mut s.v)?;
    if let Some(rope) = rope {
        rope_forward(&mut s.q, 1, n, cfg.num_attention_heads, d, rope)?;
        rope_forward(&mut s.k, 1, n, cfg.num_key_value_heads, d, rope)?;
    }
    Ok(())
}

/// The layer after attention: `o_proj` and the MLP with their residual adds, leaving the block
/// output in `s.x`.
fn layer_finish(
    model: &LlamaForCausalLM,
    lay: &LayerLayout,
    p: &[f32],
    n: usize,
    s: &mut Scratch,
) -> Result<()> {
    let cfg = &model.config;
    let (c, q, inter) = (cfg.hidden_size, cfg.q_dim(), cfg.intermediate_size);
    linear(p, &lay.o, &s.att, n, q, c, &mut s.h)?;
    add_inplace(&mut s.h, &s.x)?;
    let at = NormAt {
        weight: &lay.post_attention_norm,
        bias: lay.post_attention_norm_bias.as_ref(),
    };
    let eps = cfg.rms_norm_eps;
    norm_forward(at, p, &s.h, c, eps, &mut s.xn, &mut s.mean, &mut s.rstd)?;
    linear(p, &lay.up, &s.xn, n, c, inter, &mut s.up)?;
    match &lay.gate {
        Some(gate) => {
            linear(p, gate, &s.xn, n, c, inter, &mut s.gate)?;
            swiglu_forward(&s.gate, &s.up, &mut s.act)?;
        }
        None => gelu_tanh_forward(&s.up, &mut s.act)?,
    }
    linear(p, &lay.down, &s.act, n, inter, c, &mut s.x)?;
    add_inplace(&mut s.x, &s.h)?;
    Ok(())
}

fn invalid(argument: &str, message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: argument.to_string(),
        message,
    }
}
