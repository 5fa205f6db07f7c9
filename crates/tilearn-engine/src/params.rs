//! `ParamStore`: every parameter of a model in one contiguous f32 buffer (the fp32 master copy).
//!
//! Tensors carry their Hugging Face names and lie in Hugging Face order: `model.embed_tokens`,
//! then per layer `self_attn.{q,k,v,o}_proj` (weight, then bias when `attention_bias`; Qwen2
//! biases q/k/v only; Baichuan holds q, k and v in one `self_attn.W_pack.weight`, [Q; K; V]
//! stacked along the rows, which is exactly q_proj, k_proj, v_proj one after the other),
//! `mlp.{gate,up,down}_proj` (weight, then bias when `mlp_bias`), `input_layernorm`,
//! `post_attention_layernorm`; then `model.norm` and `lm_head` (absent when embeddings are
//! tied). Gradients use a second buffer with the same layout, so the optimizer and ZeRO work on
//! flat index ranges.

use std::ops::Range;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::config::{LlamaConfig, ModelFamily, NormKind};
use crate::error::{EngineError, Result};
use crate::tensor_io::TensorDest;

/// Elements one rayon task of the random initialisation fills (even, so tasks start on a
/// Box–Muller pair).
const INIT_TASK: usize = 1 << 16;

/// ChaCha words one Box–Muller pair consumes: two f64 uniforms of one `u64` (two words) each.
const WORDS_PER_PAIR: u128 = 4;

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
        // Norm weights are the only one-dimensional weights (Bloom's `ln_f.weight` does not
        // end in "norm.weight").
        if self.name.ends_with(".bias") {
            InitKind::Zero
        } else if self.name.ends_with("norm.weight") || self.shape.len() == 1 {
            InitKind::One
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

/// The Hugging Face names of a family's tensors (Bloom's differ throughout; the others use
/// Llama's, with Baichuan's `W_pack` for q/k/v).
#[derive(Clone, Copy, Debug)]
pub struct TensorNames {
    pub embed: &'static str,
    /// The norm after the embedding (Bloom's `word_embeddings_layernorm`).
    pub embed_norm: Option<&'static str>,
    /// Layer `i`'s prefix is `{layers}.{i}`.
    pub layers: &'static str,
    /// The packed q/k/v projection (families with [`ModelFamily::packed_qkv`]).
    pub qkv: &'static str,
    pub o: &'static str,
    pub gate: Option<&'static str>,
    pub up: &'static str,
    pub down: &'static str,
    pub final_norm: &'static str,
}

impl TensorNames {
    pub fn of(family: ModelFamily) -> TensorNames {
        match family {
            ModelFamily::Bloom => TensorNames {
                embed: "transformer.word_embeddings.weight",
                embed_norm: Some("transformer.word_embeddings_layernorm"),
                layers: "transformer.h",
                qkv: "self_attention.query_key_value",
                o: "self_attention.dense",
                gate: None,
                up: "mlp.dense_h_to_4h",
                down: "mlp.dense_4h_to_h",
                final_norm: "transformer.ln_f",
            },
            _ => TensorNames {
                embed: "model.embed_tokens.weight",
                embed_norm: None,
                layers: "model.layers",
                qkv: "self_attn.W_pack",
                o: "self_attn.o_proj",
                gate: Some("mlp.gate_proj"),
                up: "mlp.up_proj",
                down: "mlp.down_proj",
                final_norm: "model.norm",
            },
        }
    }

    /// The prefix of decoder layer `i`'s tensors.
    pub fn layer(&self, i: usize) -> String {
        format!("{}.{i}", self.layers)
    }
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
        let names = TensorNames::of(config.family);
        push(names.embed.into(), vec![config.vocab_size, c], true);
        let norm_bias = config.family.norm_kind() == NormKind::Layer;
        if let Some(norm) = names.embed_norm {
            push(format!("{norm}.weight"), vec![c], false);
            push(format!("{norm}.bias"), vec![c], false);
        }
        for i in 0..config.num_hidden_layers {
            let p = names.layer(i);
            let mut push_norm = |name: &str| {
                push(format!("{p}.{name}.weight"), vec![c], false);
                if norm_bias {
                    push(format!("{p}.{name}.bias"), vec![c], false);
                }
            };
            // Bloom's order puts each norm before the block it feeds; the Llama kinds list
            // both norms after the projections.
            if norm_bias {
                push_norm("input_layernorm");
            }
            let mut linear = |name: &str, out_f: usize, in_f: usize, bias: bool| {
                push(format!("{p}.{name}.weight"), vec![out_f, in_f], true);
                if bias {
                    push(format!("{p}.{name}.bias"), vec![out_f], false);
                }
            };
            let (q, kv, inter) = (config.q_dim(), config.kv_dim(), config.intermediate_size);
            if config.family.packed_qkv() {
                linear(names.qkv, q + 2 * kv, c, config.qkv_bias());
            } else {
                linear("self_attn.q_proj", q, c, config.qkv_bias());
                linear("self_attn.k_proj", kv, c, config.qkv_bias());
                linear("self_attn.v_proj", kv, c, config.qkv_bias());
            }
            linear(names.o, c, q, config.o_bias());
            if norm_bias {
                let mut push_norm = |name: &str| {
                    push(format!("{p}.{name}.weight"), vec![c], false);
                    push(format!("{p}.{name}.bias"), vec![c], false);
                };
                push_norm("post_attention_layernorm");
            }
            let mut linear = |name: &str, out_f: usize, in_f: usize, bias: bool| {
                push(format!("{p}.{name}.weight"), vec![out_f, in_f], true);
                if bias {
                    push(format!("{p}.{name}.bias"), vec![out_f], false);
                }
            };
            if let Some(gate) = names.gate {
                linear(gate, inter, c, config.mlp_bias);
            }
            linear(names.up, inter, c, config.mlp_bias);
            linear(names.down, c, inter, config.mlp_bias);
            if !norm_bias {
                push(format!("{p}.input_layernorm.weight"), vec![c], false);
                push(
                    format!("{p}.post_attention_layernorm.weight"),
                    vec![c],
                    false,
                );
            }
        }
        push(format!("{}.weight", names.final_norm), vec![c], false);
        if norm_bias {
            push(format!("{}.bias", names.final_norm), vec![c], false);
        }
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
        let mut dest: &mut [f32] = &mut self.data;
        init_random_into(&self.specs, seed, std, pad_token_id, &mut dest)
            .expect("filling host memory cannot fail");
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

/// Writes the initialisation of [`ParamStore::init_random_with_pad`] for the tensors `specs`
/// into `dest`, piece by piece and in parallel, without a host copy of the model (the GPU
/// engine initialises through its staging buffer).
///
/// The normal samples are one ChaCha8 stream of `seed` consumed in parameter order, one
/// Box–Muller pair (four stream words) per two elements of each normal tensor (an odd tensor's
/// last element takes the first of a pair). Because ChaCha8 can seek, every piece starts at its
/// own word position: the values are the same whatever the piece sizes or the thread count.
pub fn init_random_into(
    specs: &[ParamSpec],
    seed: u64,
    std: f64,
    pad_token_id: Option<u32>,
    dest: &mut dyn TensorDest,
) -> Result<()> {
    let mut next_word: u128 = 0;
    for spec in specs {
        let kind = spec.init_kind();
        let tensor_word = next_word;
        if let InitKind::Normal = kind {
            next_word += WORDS_PER_PAIR * spec.numel().div_ceil(2) as u128;
        }
        // The padding row's elements, relative to the tensor.
        let pad_row = match (spec.name.as_str(), pad_token_id) {
            ("model.embed_tokens.weight", Some(pad)) if (pad as usize) < spec.shape[0] => {
                let dim = spec.shape[1];
                Some(pad as usize * dim..(pad as usize + 1) * dim)
            }
            _ => None,
        };
        dest.write(spec.range(), &mut |offset, buf| {
            match kind {
                InitKind::One => buf.fill(1.0),
                InitKind::Zero => buf.fill(0.0),
                InitKind::Normal => {
                    buf.par_chunks_mut(INIT_TASK)
                        .enumerate()
                        .for_each(|(k, part)| {
                            fill_normal_at(seed, tensor_word, offset + k * INIT_TASK, part, std)
                        })
                }
            }
            if let Some(row) = &pad_row {
                let (lo, hi) = (row.start.max(offset), row.end.min(offset + buf.len()));
                if lo < hi {
                    buf[lo - offset..hi - offset].fill(0.0);
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// Fills `dst` with the normal(0, std) samples of elements `first..` of a tensor whose pairs
/// start at word `tensor_word` of `seed`'s stream: element `e` is component `e % 2` of pair
/// `e / 2`.
fn fill_normal_at(seed: u64, tensor_word: u128, first: usize, dst: &mut [f32], std: f64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_word_pos(tensor_word + WORDS_PER_PAIR * (first / 2) as u128);
    let rest = match dst.split_first_mut() {
        Some((x, tail)) if first % 2 == 1 => {
            *x = (box_muller(&mut rng).1 * std) as f32;
            tail
        }
        _ => dst,
    };
    let mut pairs = rest.chunks_exact_mut(2);
    for pair in &mut pairs {
        let (a, b) = box_muller(&mut rng);
        pair[0] = (a * std) as f32;
        pair[1] = (b * std) as f32;
    }
    if let [last] = pairs.into_remainder() {
        *last = (box_muller(&mut rng).0 * std) as f32;
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

    /// The stream every earlier version produced: one ChaCha8 generator consumed in order.
    fn sequential_reference(p: &ParamStore, seed: u64, std: f64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut out = vec![0.0f32; p.numel()];
        for spec in &p.specs {
            let dst = &mut out[spec.range()];
            match spec.init_kind() {
                InitKind::One => dst.fill(1.0),
                InitKind::Zero => dst.fill(0.0),
                InitKind::Normal => {
                    for pair in dst.chunks_mut(2) {
                        let (a, b) = box_muller(&mut rng);
                        pair[0] = (a * std) as f32;
                        if let Some(x) = pair.get_mut(1) {
                            *x = (b * std) as f32;
                        }
                    }
                }
            }
        }
        out
    }

    /// A destination that lends buffers of an odd size, so pieces start mid-pair.
    struct OddPieces<'a>(&'a mut [f32]);

    impl TensorDest for OddPieces<'_> {
        fn write(
            &mut self,
            range: Range<usize>,
            fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
        ) -> Result<()> {
            for (k, piece) in self.0[range].chunks_mut(7).enumerate() {
                fill(k * 7, piece)?;
            }
            Ok(())
        }
    }

    #[test]
    fn parallel_init_is_the_sequential_stream_whatever_the_pieces() {
        // Pieces of 7 elements start mid-pair and cross tensor ends.
        let json = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":10,
            "intermediate_size":6,"num_hidden_layers":2,"num_attention_heads":1,
            "num_key_value_heads":1,"vocab_size":13,"tie_word_embeddings":false,
            "attention_bias":true,"mlp_bias":false}"#;
        let config = LlamaConfig::from_json_str(json, "config.json").unwrap();
        let mut p = ParamStore::from_config(&config);
        p.init_random(3, 0.5);
        assert_eq!(p.data, sequential_reference(&p, 3, 0.5));
        let mut q = vec![0.0f32; p.numel()];
        init_random_into(&p.specs, 3, 0.5, None, &mut OddPieces(&mut q)).unwrap();
        assert_eq!(p.data, q);
    }
}
