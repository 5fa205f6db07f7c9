//! `ParamStore`: every parameter of a model in one contiguous f32 buffer (the fp32 master copy).
//!
//! Tensors carry their Hugging Face names and lie in Hugging Face order: `model.embed_tokens`,
//! then per layer `self_attn.{q,k,v,o}_proj` (weight, then bias when `attention_bias`),
//! `mlp.{gate,up,down}_proj` (weight, then bias when `mlp_bias`), `input_layernorm`,
//! `post_attention_layernorm`; then `model.norm` and `lm_head` (absent when embeddings are
//! tied). Gradients use a second buffer with the same layout, so the optimizer and ZeRO work on
//! flat index ranges.

use std::ops::Range;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::config::LlamaConfig;
use crate::error::{EngineError, Result};

/// One tensor of a [`ParamStore`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    /// Hugging Face name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    pub shape: Vec<usize>,
    /// First element in [`ParamStore::data`].
    pub offset: usize,
    /// Whether weight decay applies (false for norms and biases, as Hugging Face's Trainer).
    pub decay: bool,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Index range in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }

    /// What [`ParamStore::init_random`] does with this tensor.
    fn init_kind(&self) -> InitKind {
        if self.name.ends_with("norm.weight") {
            InitKind::One
        } else if self.name.ends_with(".bias") {
            InitKind::Zero
        } else {
            InitKind::Normal
        }
    }
}

enum InitKind {
    Normal,
    Zero,
    One,
}

/// All parameters of a model in one flat f32 buffer.
#[derive(Clone, Debug)]
pub struct ParamStore {
    pub specs: Vec<ParamSpec>,
    pub data: Vec<f32>,
}

/// Names of the tensors of layer `i`'s linear projections and norms, in Hugging Face order.
pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}")
}

impl ParamStore {
    /// The layout for `config`, zero-filled.
    pub fn from_config(config: &LlamaConfig) -> ParamStore {
        let specs = Self::specs_for(config);
        let numel = specs.last().map_or(0, |s| s.offset + s.numel());
        ParamStore {
            specs,
            data: vec![0.0; numel],
        }
    }

    /// The tensor specs (names, shapes, offsets, decay) of a model described by `config`.
    pub fn specs_for(config: &LlamaConfig) -> Vec<ParamSpec> {
        let c = config.hidden_size;
        let mut specs: Vec<ParamSpec> = Vec::new();
        let mut offset = 0;
        let mut push = |name: String, shape: Vec<usize>, decay: bool| {
            let n: usize = shape.iter().product();
            specs.push(ParamSpec {
                name,
                shape,
                offset,
                decay,
            });
            offset += n;
        };
        push(
            "model.embed_tokens.weight".into(),
            vec![config.vocab_size, c],
            true,
        );
        for i in 0..config.num_hidden_layers {
            let p = layer_prefix(i);
            let mut linear = |name: &str, out_f: usize, in_f: usize, bias: bool| {
                push(format!("{p}.{name}.weight"), vec![out_f, in_f], true);
                if bias {
                    push(format!("{p}.{name}.bias"), vec![out_f], false);
                }
            };
            let (q, kv, inter) = (config.q_dim(), config.kv_dim(), config.intermediate_size);
            linear("self_attn.q_proj", q, c, config.attention_bias);
            linear("self_attn.k_proj", kv, c, config.attention_bias);
            linear("self_attn.v_proj", kv, c, config.attention_bias);
            linear("self_attn.o_proj", c, q, config.attention_bias);
            linear("mlp.gate_proj", inter, c, config.mlp_bias);
            linear("mlp.up_proj", inter, c, config.mlp_bias);
            linear("mlp.down_proj", c, inter, config.mlp_bias);
            push(format!("{p}.input_layernorm.weight"), vec![c], false);
            push(
                format!("{p}.post_attention_layernorm.weight"),
                vec![c],
                false,
            );
        }
        push("model.norm.weight".into(), vec![c], false);
        if !config.tie_word_embeddings {
            push("lm_head.weight".into(), vec![config.vocab_size, c], true);
        }
        specs
    }

    /// Total number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// The spec of tensor `name`, if the model has it.
    pub fn spec(&self, name: &str) -> Option<&ParamSpec> {
        self.specs.iter().find(|s| s.name == name)
    }

    /// Index range of tensor `name` in the flat buffer (for the gradient buffer too).
    pub fn range(&self, name: &str) -> Result<Range<usize>> {
        self.spec(name)
            .map(ParamSpec::range)
            .ok_or_else(|| EngineError::InvalidArgument {
                argument: name.to_string(),
                message: "no parameter of this name in the model; use a Hugging Face Llama \
                          tensor name such as model.layers.0.self_attn.q_proj.weight"
                    .to_string(),
            })
    }

    /// The elements of tensor `name`.
    pub fn view(&self, name: &str) -> Result<&[f32]> {
        let r = self.range(name)?;
        Ok(&self.data[r])
    }

    /// The elements of tensor `name`, mutably.
    pub fn view_mut(&mut self, name: &str) -> Result<&mut [f32]> {
        let r = self.range(name)?;
        Ok(&mut self.data[r])
    }

    /// Initialises like Hugging Face's `LlamaPreTrainedModel._init_weights`: linear and
    /// embedding weights from normal(0, `std`), biases zero, norm weights one, and the
    /// embedding row of `pad_token_id` (when given) zero. Deterministic for a given `seed`.
    pub fn init_random(&mut self, seed: u64, std: f64) {
        self.init_random_with_pad(seed, std, None);
    }

    /// [`ParamStore::init_random`], zeroing embedding row `pad_token_id` as `nn.Embedding`'s
    /// `padding_idx` does.
    pub fn init_random_with_pad(&mut self, seed: u64, std: f64, pad_token_id: Option<u32>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for spec in &self.specs {
            let dst = &mut self.data[spec.range()];
            match spec.init_kind() {
                InitKind::One => dst.fill(1.0),
                InitKind::Zero => dst.fill(0.0),
                InitKind::Normal => fill_normal(&mut rng, dst, std),
            }
            if spec.name == "model.embed_tokens.weight"
                && let Some(pad) = pad_token_id
            {
                let dim = spec.shape[1];
                let row = pad as usize;
                if row < spec.shape[0] {
                    dst[row * dim..(row + 1) * dim].fill(0.0);
                }
            }
        }
    }

    /// Index ranges of the tensors that take weight decay (merged where adjacent).
    pub fn decay_ranges(&self) -> Vec<Range<usize>> {
        self.ranges_where(true)
    }

    /// Index ranges of the tensors that take no weight decay (norms, biases), merged where
    /// adjacent.
    pub fn no_decay_ranges(&self) -> Vec<Range<usize>> {
        self.ranges_where(false)
    }

    fn ranges_where(&self, decay: bool) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = Vec::new();
        for r in self
            .specs
            .iter()
            .filter(|s| s.decay == decay)
            .map(ParamSpec::range)
        {
            match out.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => out.push(r),
            }
        }
        out
    }
}

/// Fills `dst` with normal(0, std) samples (Box–Muller on two uniforms in (0, 1]).
fn fill_normal(rng: &mut ChaCha8Rng, dst: &mut [f32], std: f64) {
    let mut chunks = dst.chunks_exact_mut(2);
    for pair in &mut chunks {
        let (a, b) = box_muller(rng);
        pair[0] = (a * std) as f32;
        pair[1] = (b * std) as f32;
    }
    if let [last] = chunks.into_remainder() {
        *last = (box_muller(rng).0 * std) as f32;
    }
}

fn box_muller(rng: &mut ChaCha8Rng) -> (f64, f64) {
    // 1 - U with U in [0, 1) lies in (0, 1], so ln never sees 0.
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    let r = (-2.0 * u1.ln()).sqrt();
    let theta = std::f64::consts::TAU * u2;
    (r * theta.cos(), r * theta.sin())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(tied: bool, bias: bool) -> LlamaConfig {
        let json = format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":8,"intermediate_size":16,
               "num_hidden_layers":2,"num_attention_heads":2,"num_key_value_heads":1,
               "vocab_size":11,"tie_word_embeddings":{tied},"attention_bias":{bias},
               "mlp_bias":{bias}}}"#
        );
        LlamaConfig::from_json_str(&json, "config.json").unwrap()
    }

    #[test]
    fn layout_is_contiguous_and_in_hf_order() {
        let p = ParamStore::from_config(&tiny(false, true));
        let mut off = 0;
        for s in &p.specs {
            assert_eq!(s.offset, off, "{}", s.name);
            off += s.numel();
        }
        assert_eq!(off, p.numel());
        assert_eq!(p.specs[0].name, "model.embed_tokens.weight");
        assert_eq!(p.specs[1].name, "model.layers.0.self_attn.q_proj.weight");
        assert_eq!(p.specs[2].name, "model.layers.0.self_attn.q_proj.bias");
        assert_eq!(p.specs.last().unwrap().name, "lm_head.weight");
        assert_eq!(
            p.spec("model.layers.1.self_attn.k_proj.weight")
                .unwrap()
                .shape,
            vec![4, 8]
        );
        assert!(!p.spec("model.layers.1.mlp.up_proj.bias").unwrap().decay);
        assert!(!p.spec("model.norm.weight").unwrap().decay);
    }

    #[test]
    fn tied_has_no_lm_head() {
        let p = ParamStore::from_config(&tiny(true, false));
        assert!(p.spec("lm_head.weight").is_none());
        assert_eq!(p.specs.last().unwrap().name, "model.norm.weight");
    }

    #[test]
    fn decay_groups_partition_the_buffer() {
        let p = ParamStore::from_config(&tiny(false, true));
        let total: usize = p
            .decay_ranges()
            .iter()
            .chain(p.no_decay_ranges().iter())
            .map(|r| r.len())
            .sum();
        assert_eq!(total, p.numel());
    }

    #[test]
    fn init_matches_hf_scheme() {
        let mut p = ParamStore::from_config(&tiny(false, true));
        p.init_random(7, 0.02);
        assert!(
            p.view("model.norm.weight")
                .unwrap()
                .iter()
                .all(|&x| x == 1.0)
        );
        assert!(
            p.view("model.layers.0.mlp.down_proj.bias")
                .unwrap()
                .iter()
                .all(|&x| x == 0.0)
        );
        let w = p.view("lm_head.weight").unwrap();
        let mean = w.iter().map(|&x| x as f64).sum::<f64>() / w.len() as f64;
        let var = w.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / w.len() as f64;
        assert!(
            mean.abs() < 0.01 && (var.sqrt() - 0.02).abs() < 0.008,
            "{mean} {var}"
        );
        let mut q = ParamStore::from_config(&tiny(false, true));
        q.init_random(7, 0.02);
        assert_eq!(p.data, q.data);
    }
}
