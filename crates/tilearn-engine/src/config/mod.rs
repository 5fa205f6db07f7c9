//! `LlamaConfig`: the Hugging Face `config.json` of a decoder of the Llama kind: Llama itself and
//! the families that differ from it in a few parts (Qwen2, Mistral, Baichuan-7B, Baichuan2-7B;
//! see [`family`] and [`ModelFamily`]).
//!
//! Both forms found in the wild are read:
//! * transformers v4: `rope_theta` and `rope_scaling` (`type` or `rope_type`, `factor`, …) at the
//!   top level, `torch_dtype`;
//! * transformers v5: `rope_parameters` holding `rope_type`, `rope_theta` and the scaling fields,
//!   `dtype`.
//!
//! [`LlamaConfig::to_json`] writes the v5 form, as transformers 5 does. Keys we do not interpret
//! (`attention_dropout`, `use_cache`, …) are kept in [`LlamaConfig::extra`] and written back, so
//! a load → save round trip loses nothing.

mod bloom;
mod family;
mod generation;

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use tilearn_ops::DType;

use crate::error::{EngineError, Result};

pub use family::{
    AttentionKind, BAICHUAN_13B_ENV, BaichuanVariant, MlpKind, ModelFamily, NormKind,
    PositionEncoding,
};
pub use generation::{GENERATION_CONFIG_FILE, GenerationConfig};

/// The transformers version we write into `config.json`.
pub const TRANSFORMERS_VERSION: &str = "5.17.0";

/// How rotary position embeddings are scaled (Hugging Face `rope_type`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScalingConfig {
    /// `rope_type: "default"` (or no scaling at all).
    Default,
    /// `rope_type: "linear"`: positions divided by `factor`.
    Linear { factor: f64 },
    /// `rope_type: "dynamic"`: NTK-aware base rescaling once the sequence exceeds
    /// `original_max_position_embeddings`.
    Dynamic {
        factor: f64,
        original_max_position_embeddings: usize,
    },
    /// `rope_type: "llama3"`: per-frequency interpolation of Llama 3.1.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

impl RopeScalingConfig {
    /// The Hugging Face `rope_type` string.
    pub fn rope_type(&self) -> &'static str {
        match self {
            RopeScalingConfig::Default => "default",
            RopeScalingConfig::Linear { .. } => "linear",
            RopeScalingConfig::Dynamic { .. } => "dynamic",
            RopeScalingConfig::Llama3 { .. } => "llama3",
        }
    }

    /// The scaling as the CPU ops take it.
    pub fn to_ops(&self) -> tilearn_ops::cpu::RopeScaling {
        use tilearn_ops::cpu::RopeScaling;
        match *self {
            RopeScalingConfig::Default => RopeScaling::None,
            RopeScalingConfig::Linear { factor } => RopeScaling::Linear { factor },
            RopeScalingConfig::Dynamic {
                factor,
                original_max_position_embeddings,
            } => RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings,
            },
            RopeScalingConfig::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            },
        }
    }
}

/// The configuration of a Llama-family causal language model, as in Hugging Face `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Which family's parts and tensor names the model uses (from `architectures`).
    pub family: ModelFamily,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Defaults to `num_attention_heads` (multi-head attention).
    pub num_key_value_heads: usize,
    /// Defaults to `hidden_size / num_attention_heads`.
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f64,
    /// Defaults to 10000.
    pub rope_theta: f64,
    pub rope_scaling: RopeScalingConfig,
    /// Defaults to false.
    pub tie_word_embeddings: bool,
    /// Defaults to 2048, as in transformers.
    pub max_position_embeddings: usize,
    /// Bias on q/k/v/o projections (Llama's `attention_bias`; defaults to false). Qwen2 has
    /// it set and biases on q/k/v only ([`LlamaConfig::o_bias`]).
    pub attention_bias: bool,
    /// Bias on gate/up/down projections; defaults to false.
    pub mlp_bias: bool,
    /// Standard deviation of the normal initialisation; defaults to 0.02.
    pub initializer_range: f64,
    pub bos_token_id: Option<u32>,
    /// One id, several (Llama 3 lists several), or none.
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    /// `dtype` (v5) or `torch_dtype` (v4): the dtype the weights were saved in.
    pub dtype: Option<DType>,
    /// Keys visible to a query on the layers of kind [`AttentionKind::Sliding`] (key `j` from
    /// query `i` when `i - W < j <= i`, as transformers masks it); `None`: every layer full.
    /// Mistral's `sliding_window`; Qwen2's when `use_sliding_window` is true.
    pub sliding_window: Option<usize>,
    /// Per layer, full or sliding attention (`num_hidden_layers` entries): Qwen2's
    /// `layer_types` (or its `max_window_layers` rule), every layer sliding for Mistral.
    pub layer_types: Vec<AttentionKind>,
    /// Baichuan2's `z_loss_weight` (0 for every other family): the training loss adds
    /// `z_loss_weight · max(logits)²` per target (see `tilearn_ops::cpu::z_loss`).
    pub z_loss_weight: f64,
    /// Keys of the source `config.json` that we do not interpret, written back unchanged.
    pub extra: Map<String, Value>,
    /// The model directory's `generation_config.json`, when the model was loaded from one that
    /// has it (`LlamaForCausalLM::from_pretrained`, `tilearn train --model`; not
    /// [`LlamaConfig::from_file`], which reads `config.json` alone). Saving writes it back, or,
    /// when `None`, one holding this config's special token ids, as transformers does.
    pub generation: Option<GenerationConfig>,
}

/// Keys [`LlamaConfig`] interprets (or rewrites) itself; everything else goes to `extra`.
const KNOWN_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
    "hidden_act",
    "transformers_version",
];

/// Keys of the sliding-window families, interpreted only for them (a Llama keeps them in
/// `extra`).
const SLIDING_KEYS: &[&str] = &["sliding_window", "use_sliding_window", "layer_types"];

/// Reads typed fields out of a JSON object, with errors that name the file and the field.
pub(crate) struct Fields<'a> {
    pub(crate) obj: &'a Map<String, Value>,
    pub(crate) file: &'a Path,
}

impl<'a> Fields<'a> {
    pub(crate) fn err(&self, field: &str, message: impl Into<String>) -> EngineError {
        EngineError::Config {
            file: self.file.to_path_buf(),
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// The value of `key`, treating JSON `null` as absent.
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    pub(crate) fn missing(&self, key: &str, kind: &str) -> EngineError {
        self.err(
            key,
            format!(
                "missing; add \"{key}\": <{kind}> to {}",
                file_name(self.file)
            ),
        )
    }

    pub(crate) fn wrong_type(&self, key: &str, kind: &str, v: &Value) -> EngineError {
        self.err(
            key,
            format!("expected {kind}, found {v}; write it as \"{key}\": <{kind}>"),
        )
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "non-negative int", v)),
        }
    }

    pub(crate) fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key, "int"))
    }

    pub(crate) fn positive(&self, key: &str) -> Result<usize> {
        let n = self.usize(key)?;
        if n == 0 {
            return Err(self.err(key, "must be positive, found 0"));
        }
        Ok(n)
    }

    pub(crate) fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "number", v)),
        }
    }

    pub(crate) fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "true|false", v)),
        }
    }

    pub(crate) fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "string", v)),
        }
    }

    pub(crate) fn opt_token_id(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "token id (non-negative int)", v)),
        }
    }

    pub(crate) fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let bad = |v: &Value| self.wrong_type(key, "token id or list of token ids", v);
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or_else(|| bad(v))
                })
                .collect(),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(|n| vec![n])
                .ok_or_else(|| bad(v)),
        }
    }
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "config.json".to_string())
}

impl LlamaConfig {
    /// Reads a Hugging Face `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<LlamaConfig> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|e| EngineError::io(path, "read config", e))?;
        Self::from_json_str(&text, path)
    }

    /// [`LlamaConfig::from_file`] with the value of [`BAICHUAN_13B_ENV`] given instead of read
    /// from the environment (`None`: unset), for callers that load several models in one
    /// process (tests).
    pub fn from_file_with_baichuan_13b(
        path: impl AsRef<Path>,
        baichuan_13b: Option<&str>,
    ) -> Result<LlamaConfig> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|e| EngineError::io(path, "read config", e))?;
        let obj = Self::json_object(&text, path)?;
        Self::from_json_object(&obj, path, baichuan_13b)
    }

    /// Parses the text of a `config.json`; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: impl AsRef<Path>) -> Result<LlamaConfig> {
        let obj = Self::json_object(text, path.as_ref())?;
        let env = std::env::var(BAICHUAN_13B_ENV).ok();
        Self::from_json_object(&obj, path.as_ref(), env.as_deref())
    }

    fn json_object(text: &str, path: &Path) -> Result<Map<String, Value>> {
        let file: PathBuf = path.to_path_buf();
        let value: Value = serde_json::from_str(text).map_err(|e| EngineError::Config {
            file: file.clone(),
            field: "<document>".to_string(),
            message: format!("not valid JSON ({e}); fix the syntax at that position"),
        })?;
        let Value::Object(obj) = value else {
            return Err(EngineError::Config {
                file,
                field: "<document>".to_string(),
                message: "expected a JSON object at the top level".to_string(),
            });
        };
        Ok(obj)
    }

    fn from_json_object(
        obj: &Map<String, Value>,
        file: &Path,
        baichuan_13b: Option<&str>,
    ) -> Result<LlamaConfig> {
        let f = Fields { obj, file };
        let family = family::detect(&f, baichuan_13b)?;
        if family == ModelFamily::Bloom {
            return bloom::parse(&f);
        }

        if let Some(act) = f.opt_str("hidden_act")?
            && act != "silu"
        {
            return Err(f.err(
                "hidden_act",
                format!(
                    "\"{act}\" is not supported; {} uses \"silu\"",
                    family.architecture()
                ),
            ));
        }

        let hidden_size = f.positive("hidden_size")?;
        let intermediate_size = f.positive("intermediate_size")?;
        let num_hidden_layers = f.positive("num_hidden_layers")?;
        let num_attention_heads = f.positive("num_attention_heads")?;
        let vocab_size = f.positive("vocab_size")?;
        let num_key_value_heads = match f.opt_usize("num_key_value_heads")? {
            Some(0) => return Err(f.err("num_key_value_heads", "must be positive, found 0")),
            Some(n) => n,
            None => num_attention_heads,
        };
        if family.packed_qkv() && num_key_value_heads != num_attention_heads {
            return Err(f.err(
                "num_key_value_heads",
                format!(
                    "{num_key_value_heads} differs from num_attention_heads = \
                     {num_attention_heads}; Baichuan's W_pack holds full-width q, k and v"
                ),
            ));
        }
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!(
                    "{num_key_value_heads} does not divide num_attention_heads = \
                     {num_attention_heads}; use a divisor of {num_attention_heads}"
                ),
            ));
        }
        let head_dim = match f.opt_usize("head_dim")? {
            Some(0) => return Err(f.err("head_dim", "must be positive, found 0")),
            Some(d) => d,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(f.err(
                        "num_attention_heads",
                        format!(
                            "{num_attention_heads} does not divide hidden_size = {hidden_size}; \
                             use a divisor or set \"head_dim\" explicitly"
                        ),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if family.position_encoding() == PositionEncoding::Rope && head_dim % 2 != 0 {
            return Err(f.err(
                "head_dim",
                format!("{head_dim} is odd; rotary embeddings need an even head_dim"),
            ));
        }
        let rms_norm_eps = f.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
        if !(rms_norm_eps >= 0.0 && rms_norm_eps.is_finite()) {
            return Err(f.err(
                "rms_norm_eps",
                format!("{rms_norm_eps} must be a finite non-negative number"),
            ));
        }
        let max_position_embeddings = match f.opt_usize("max_position_embeddings")? {
            Some(0) => {
                return Err(f.err("max_position_embeddings", "must be positive, found 0"));
            }
            Some(n) => n,
            None => match family {
                ModelFamily::Llama | ModelFamily::Bloom => 2048,
                ModelFamily::Qwen2 => 32768,
                ModelFamily::Mistral => 131072,
                ModelFamily::Baichuan(_) => 4096,
            },
        };
        let (rope_theta, rope_scaling) = parse_rope(&f, max_position_embeddings)?;
        if family.packed_qkv()
            && (rope_theta != 10000.0 || rope_scaling != RopeScalingConfig::Default)
        {
            return Err(f.err(
                "rope_theta",
                "Baichuan's modeling code rotates with base 10000 and no scaling; remove \
                 rope_theta / rope_scaling from config.json",
            ));
        }
        // Baichuan2's modeling code adds `z_loss_weight · mean(max(logits)²)` to the loss.
        let z_loss_weight = if family.norm_head() {
            let z = f.opt_f64("z_loss_weight")?.unwrap_or(0.0);
            if !(z >= 0.0 && z.is_finite()) {
                return Err(f.err(
                    "z_loss_weight",
                    format!("{z} must be a finite non-negative number (0 turns the z-loss off)"),
                ));
            }
            z
        } else {
            0.0
        };
        let (sliding_window, layer_types) = parse_sliding_window(&f, family, num_hidden_layers)?;

        let dtype = match (f.opt_str("dtype")?, f.opt_str("torch_dtype")?) {
            (Some(s), _) => Some(parse_dtype(&f, "dtype", s)?),
            (None, Some(s)) => Some(parse_dtype(&f, "torch_dtype", s)?),
            (None, None) => None,
        };

        let sliding = matches!(family, ModelFamily::Qwen2 | ModelFamily::Mistral);
        let extra: Map<String, Value> = obj
            .iter()
            .filter(|(k, _)| {
                let interpreted = KNOWN_KEYS.contains(&k.as_str())
                    || (sliding && SLIDING_KEYS.contains(&k.as_str()))
                    || (family.norm_head() && k.as_str() == "z_loss_weight");
                !interpreted
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();

        let (attention_bias, mlp_bias) = match family {
            ModelFamily::Llama => (
                f.opt_bool("attention_bias")?.unwrap_or(false),
                f.opt_bool("mlp_bias")?.unwrap_or(false),
            ),
            // Qwen2: q/k/v always have a bias; no other family has any.
            ModelFamily::Qwen2 => (true, false),
            ModelFamily::Mistral | ModelFamily::Baichuan(_) | ModelFamily::Bloom => (false, false),
        };

        Ok(LlamaConfig {
            family,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            max_position_embeddings,
            attention_bias,
            mlp_bias,
            initializer_range: f.opt_f64("initializer_range")?.unwrap_or(0.02),
            bos_token_id: f.opt_token_id("bos_token_id")?,
            eos_token_ids: f.token_ids("eos_token_id")?,
            pad_token_id: f.opt_token_id("pad_token_id")?,
            dtype,
            sliding_window,
            layer_types,
            z_loss_weight,
            extra,
            generation: None,
        })
    }

    /// Whether q, k and v have a bias (Llama's `attention_bias`, always for Qwen2).
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias
    }

    /// Whether o_proj has a bias (Llama's `attention_bias`, always for Bloom; never for Qwen2).
    pub fn o_bias(&self) -> bool {
        self.attention_bias && matches!(self.family, ModelFamily::Llama | ModelFamily::Bloom)
    }

    /// Whether the lm_head rows are L2-normalised before the product (Baichuan2's NormHead).
    pub fn norm_head(&self) -> bool {
        self.family.norm_head()
    }

    /// The sliding window of decoder layer `i`, `None` for full attention.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        match self.layer_types.get(i) {
            Some(AttentionKind::Sliding) => self.sliding_window,
            _ => None,
        }
    }

    /// The first end-of-sequence id, if any.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_ids.first().copied()
    }

    /// Width of the query projection output (`num_attention_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of the key/value projection outputs (`num_key_value_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// The `config.json` document in the transformers v5 form.
    pub fn to_json_value(&self) -> Value {
        if self.family == ModelFamily::Bloom {
            return bloom::to_json_value(self);
        }
        let mut m = self.extra.clone();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        let family = self.family;
        put("architectures", Value::from(vec![family.architecture()]));
        put("model_type", Value::from(family.model_type()));
        put("hidden_act", Value::from("silu"));
        put("hidden_size", Value::from(self.hidden_size));
        put("intermediate_size", Value::from(self.intermediate_size));
        put("num_hidden_layers", Value::from(self.num_hidden_layers));
        put("num_attention_heads", Value::from(self.num_attention_heads));
        put("num_key_value_heads", Value::from(self.num_key_value_heads));
        put("head_dim", Value::from(self.head_dim));
        put("vocab_size", Value::from(self.vocab_size));
        put("rms_norm_eps", Value::from(self.rms_norm_eps));
        put("tie_word_embeddings", Value::from(self.tie_word_embeddings));
        put(
            "max_position_embeddings",
            Value::from(self.max_position_embeddings),
        );
        if family == ModelFamily::Llama {
            put("attention_bias", Value::from(self.attention_bias));
            put("mlp_bias", Value::from(self.mlp_bias));
        }
        put("initializer_range", Value::from(self.initializer_range));
        put(
            "bos_token_id",
            self.bos_token_id.map_or(Value::Null, Value::from),
        );
        put(
            "eos_token_id",
            match self.eos_token_ids.as_slice() {
                [] => Value::Null,
                [one] => Value::from(*one),
                many => Value::from(many.to_vec()),
            },
        );
        put(
            "pad_token_id",
            self.pad_token_id.map_or(Value::Null, Value::from),
        );
        let dtype = Value::from(self.dtype.unwrap_or(DType::F32).hf_name());
        match family {
            // Bloom returned above (its keys differ throughout).
            ModelFamily::Llama | ModelFamily::Bloom => {}
            ModelFamily::Qwen2 => {
                put(
                    "use_sliding_window",
                    Value::from(self.sliding_window.is_some()),
                );
                put(
                    "sliding_window",
                    self.sliding_window.map_or(Value::Null, Value::from),
                );
                let kinds: Vec<&str> = self.layer_types.iter().map(|k| k.hf_name()).collect();
                put("layer_types", Value::from(kinds));
            }
            ModelFamily::Mistral => put(
                "sliding_window",
                self.sliding_window.map_or(Value::Null, Value::from),
            ),
            // Baichuan's own modeling code is a transformers 4 one: the v4 form, no RoPE keys
            // (it rotates with base 10000) and no head_dim.
            ModelFamily::Baichuan(_) => {
                m.remove("head_dim");
                if family.norm_head() {
                    m.insert("z_loss_weight".into(), Value::from(self.z_loss_weight));
                }
                m.insert("torch_dtype".into(), dtype);
                m.insert("transformers_version".into(), Value::from("4.29.2"));
                return Value::Object(m);
            }
        }
        put("dtype", dtype);
        let mut rope = Map::new();
        rope.insert(
            "rope_type".into(),
            Value::from(self.rope_scaling.rope_type()),
        );
        rope.insert("rope_theta".into(), Value::from(self.rope_theta));
        match self.rope_scaling {
            RopeScalingConfig::Default => {}
            RopeScalingConfig::Linear { factor } => {
                rope.insert("factor".into(), Value::from(factor));
            }
            RopeScalingConfig::Dynamic {
                factor,
                original_max_position_embeddings,
            } => {
                rope.insert("factor".into(), Value::from(factor));
                // transformers defaults it to max_position_embeddings; write it only if it differs.
                if original_max_position_embeddings != self.max_position_embeddings {
                    rope.insert(
                        "original_max_position_embeddings".into(),
                        Value::from(original_max_position_embeddings),
                    );
                }
            }
            RopeScalingConfig::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                rope.insert("factor".into(), Value::from(factor));
                rope.insert("low_freq_factor".into(), Value::from(low_freq_factor));
                rope.insert("high_freq_factor".into(), Value::from(high_freq_factor));
                rope.insert(
                    "original_max_position_embeddings".into(),
                    Value::from(original_max_position_embeddings),
                );
            }
        }
        put("rope_parameters", Value::Object(rope));
        put("transformers_version", Value::from(TRANSFORMERS_VERSION));
        Value::Object(m)
    }

    /// The `config.json` text in the transformers v5 form (pretty-printed, keys sorted).
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(&self.to_json_value())
            .expect("a JSON value always serialises");
        s.push('\n');
        s
    }
}

/// Reads the sliding window of the families that have one: Mistral's `sliding_window` on every
/// layer; Qwen2's only when `use_sliding_window` is true, on the layers `layer_types` names
/// (or, without it, from `max_window_layers` on, as transformers derives them). An absent
/// `sliding_window` is transformers' default 4096; `null` means none.
fn parse_sliding_window(
    f: &Fields<'_>,
    family: ModelFamily,
    layers: usize,
) -> Result<(Option<usize>, Vec<AttentionKind>)> {
    let full = vec![AttentionKind::Full; layers];
    let window = || -> Result<Option<usize>> {
        let w = match f.obj.get("sliding_window") {
            None => Some(4096),
            Some(Value::Null) => None,
            Some(_) => f.opt_usize("sliding_window")?,
        };
        if w == Some(0) {
            return Err(f.err("sliding_window", "must be positive (or null), found 0"));
        }
        Ok(w)
    };
    match family {
        ModelFamily::Mistral => {
            let w = window()?;
            let kinds = if w.is_some() {
                vec![AttentionKind::Sliding; layers]
            } else {
                full
            };
            Ok((w, kinds))
        }
        ModelFamily::Qwen2 => {
            if !f.opt_bool("use_sliding_window")?.unwrap_or(false) {
                return Ok((None, full));
            }
            let w = window()?;
            let kinds = match f.get("layer_types") {
                Some(Value::Array(items)) => {
                    let kinds = items
                        .iter()
                        .map(|v| match v.as_str() {
                            Some("full_attention") => Ok(AttentionKind::Full),
                            Some("sliding_attention") => Ok(AttentionKind::Sliding),
                            _ => Err(f.wrong_type(
                                "layer_types",
                                "list of \"full_attention\" | \"sliding_attention\"",
                                v,
                            )),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    if kinds.len() != layers {
                        return Err(f.err(
                            "layer_types",
                            format!(
                                "has {} entries but num_hidden_layers = {layers}; list one per \
                                 layer",
                                kinds.len()
                            ),
                        ));
                    }
                    kinds
                }
                Some(v) => return Err(f.wrong_type("layer_types", "list of strings", v)),
                None => {
                    let from = f.opt_usize("max_window_layers")?.unwrap_or(28);
                    (0..layers)
                        .map(|i| {
                            if i >= from {
                                AttentionKind::Sliding
                            } else {
                                AttentionKind::Full
                            }
                        })
                        .collect()
                }
            };
            if w.is_none() {
                return Ok((None, full));
            }
            Ok((w, kinds))
        }
        ModelFamily::Llama | ModelFamily::Baichuan(_) | ModelFamily::Bloom => Ok((None, full)),
    }
}

fn parse_dtype(f: &Fields<'_>, key: &str, s: &str) -> Result<DType> {
    DType::parse(s).ok_or_else(|| {
        f.err(
            key,
            format!("unsupported dtype \"{s}\"; use \"float32\", \"bfloat16\" or \"float16\""),
        )
    })
}

/// Reads `rope_parameters` (v5) or `rope_theta` + `rope_scaling` (v4).
fn parse_rope(f: &Fields<'_>, max_position_embeddings: usize) -> Result<(f64, RopeScalingConfig)> {
    // v5: everything under `rope_parameters`. The v4 keys may also be present (configs written
    // by conversion tools); `rope_parameters` wins.
    let (params, field_prefix, theta) = match f.get("rope_parameters") {
        Some(Value::Object(p)) => {
            let pf = Fields {
                obj: p,
                file: f.file,
            };
            let theta = match pf.opt_f64("rope_theta") {
                Ok(t) => t,
                Err(_) => {
                    return Err(f.wrong_type(
                        "rope_parameters.rope_theta",
                        "number",
                        pf.get("rope_theta").unwrap_or(&Value::Null),
                    ));
                }
            };
            let theta = match theta {
                Some(t) => Some(t),
                None => f.opt_f64("rope_theta")?,
            };
            (Some(p), "rope_parameters", theta)
        }
        Some(v) => return Err(f.wrong_type("rope_parameters", "object", v)),
        None => match f.get("rope_scaling") {
            Some(Value::Object(p)) => (Some(p), "rope_scaling", f.opt_f64("rope_theta")?),
            Some(v) => return Err(f.wrong_type("rope_scaling", "object or null", v)),
            None => (None, "rope_scaling", f.opt_f64("rope_theta")?),
        },
    };
    let theta = theta.unwrap_or(10000.0);
    if !(theta > 0.0 && theta.is_finite()) {
        return Err(f.err("rope_theta", format!("{theta} must be a positive number")));
    }
    let Some(p) = params else {
        return Ok((theta, RopeScalingConfig::Default));
    };

    let name = |k: &str| format!("{field_prefix}.{k}");
    let num = |k: &str| -> Result<Option<f64>> {
        match p.get(k).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| f.wrong_type(&name(k), "number", v)),
        }
    };
    let req = |k: &str, rope_type: &str| -> Result<f64> {
        num(k)?.ok_or_else(|| {
            f.err(
                &name(k),
                format!("missing; rope_type \"{rope_type}\" needs \"{k}\": <number> in \"{field_prefix}\""),
            )
        })
    };
    let factor_of = |rope_type: &str| -> Result<f64> {
        let factor = req("factor", rope_type)?;
        if !(factor >= 1.0 && factor.is_finite()) {
            return Err(f.err(&name("factor"), format!("{factor} must be a number >= 1.0")));
        }
        Ok(factor)
    };
    let original_max = |default: Option<usize>, rope_type: &str| -> Result<usize> {
        match p
            .get("original_max_position_embeddings")
            .filter(|v| !v.is_null())
        {
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| {
                    f.wrong_type(&name("original_max_position_embeddings"), "positive int", v)
                }),
            None => default.ok_or_else(|| {
                f.err(
                    &name("original_max_position_embeddings"),
                    format!(
                        "missing; rope_type \"{rope_type}\" needs \
                         \"original_max_position_embeddings\": <int> in \"{field_prefix}\""
                    ),
                )
            }),
        }
    };

    let rope_type = match (p.get("rope_type"), p.get("type")) {
        (Some(Value::String(s)), _) | (None, Some(Value::String(s))) => s.as_str(),
        (Some(v), _) => return Err(f.wrong_type(&name("rope_type"), "string", v)),
        (None, Some(v)) => return Err(f.wrong_type(&name("type"), "string", v)),
        (None, None) if field_prefix == "rope_parameters" => "default",
        (None, None) => {
            return Err(f.err(
                &name("rope_type"),
                format!(
                    "missing; add \"rope_type\": \"default\" (or linear, dynamic, llama3) to \
                     \"{field_prefix}\""
                ),
            ));
        }
    };
    let scaling = match rope_type {
        "default" => RopeScalingConfig::Default,
        "linear" => RopeScalingConfig::Linear {
            factor: factor_of("linear")?,
        },
        "dynamic" => RopeScalingConfig::Dynamic {
            factor: factor_of("dynamic")?,
            original_max_position_embeddings: original_max(
                Some(max_position_embeddings),
                "dynamic",
            )?,
        },
        "llama3" => RopeScalingConfig::Llama3 {
            factor: factor_of("llama3")?,
            low_freq_factor: req("low_freq_factor", "llama3")?,
            high_freq_factor: req("high_freq_factor", "llama3")?,
            original_max_position_embeddings: original_max(None, "llama3")?,
        },
        other => {
            return Err(f.err(
                &name("rope_type"),
                format!(
                    "rope type \"{other}\" is unsupported; tilearn supports default, linear, \
                     dynamic and llama3"
                ),
            ));
        }
    };
    Ok((theta, scaling))
}
