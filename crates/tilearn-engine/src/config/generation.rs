//! `GenerationConfig`: a model directory's Hugging Face `generation_config.json`, the defaults of
//! its generation (transformers' `GenerationConfig`): the special token ids, the length
//! (`max_new_tokens`, or `max_length` counting the prompt) and the decoding (`do_sample`,
//! `temperature`, `top_k`, `top_p`).
//!
//! Every field is optional, as in the file: an absent one falls back to the next source (for
//! `tilearn generate`: command-line flags first, then this file, then `config.json`'s token ids,
//! then transformers' defaults). Keys we do not interpret (`repetition_penalty`, …) are kept in
//! [`GenerationConfig::extra`] and written back unchanged, so a fine-tuned model keeps its source
//! model's file whole.

use std::path::Path;

use serde_json::{Map, Value};

use super::{Fields, LlamaConfig, TRANSFORMERS_VERSION};
use crate::error::{EngineError, Result};

/// The file name in a model directory.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// Keys [`GenerationConfig`] interprets; everything else goes to `extra`.
const KNOWN_KEYS: &[&str] = &[
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "max_new_tokens",
    "max_length",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "transformers_version",
];

/// The generation defaults of a model (Hugging Face `generation_config.json`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    pub bos_token_id: Option<u32>,
    /// `None` when the file names none (then `config.json`'s ids apply); one id or several.
    pub eos_token_ids: Option<Vec<u32>>,
    pub pad_token_id: Option<u32>,
    /// New tokens to generate; wins over `max_length`, as in transformers.
    pub max_new_tokens: Option<usize>,
    /// Prompt plus new tokens.
    pub max_length: Option<usize>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    /// 0 means no limit, as in transformers.
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    /// Keys of the source file that we do not interpret, written back unchanged.
    pub extra: Map<String, Value>,
}

impl GenerationConfig {
    /// What transformers writes for a model without a generation config of its own: the special
    /// token ids of `config.json`.
    pub fn from_model_config(config: &LlamaConfig) -> GenerationConfig {
        GenerationConfig {
            bos_token_id: config.bos_token_id,
            eos_token_ids: (!config.eos_token_ids.is_empty()).then(|| config.eos_token_ids.clone()),
            pad_token_id: config.pad_token_id,
            ..GenerationConfig::default()
        }
    }

    /// Reads `dir/generation_config.json`; `Ok(None)` when the directory has none.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Option<GenerationConfig>> {
        let path = dir.as_ref().join(GENERATION_CONFIG_FILE);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|e| EngineError::io(&path, "read generation config", e))?;
        Self::from_json_str(&text, &path).map(Some)
    }

    /// Parses the text of a `generation_config.json`; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: impl AsRef<Path>) -> Result<GenerationConfig> {
        let file = path.as_ref();
        let document_error = |message: String| EngineError::Config {
            file: file.to_path_buf(),
            field: "<document>".to_string(),
            message,
        };
        let value: Value = serde_json::from_str(text)
            .map_err(|e| document_error(format!("not valid JSON ({e}); fix the syntax there")))?;
        let Value::Object(obj) = value else {
            return Err(document_error(
                "expected a JSON object at the top level".into(),
            ));
        };
        let f = Fields { obj: &obj, file };
        let eos = f.token_ids("eos_token_id")?;
        let config = GenerationConfig {
            bos_token_id: f.opt_token_id("bos_token_id")?,
            eos_token_ids: f.get("eos_token_id").map(|_| eos),
            pad_token_id: f.opt_token_id("pad_token_id")?,
            max_new_tokens: f.opt_usize("max_new_tokens")?,
            max_length: f.opt_usize("max_length")?,
            do_sample: f.opt_bool("do_sample")?,
            temperature: f.opt_f64("temperature")?,
            top_k: f.opt_usize("top_k")?,
            top_p: f.opt_f64("top_p")?,
            extra: obj
                .iter()
                .filter(|(k, _)| !KNOWN_KEYS.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        };
        if let Some(t) = config.temperature
            && !(t.is_finite() && t >= 0.0)
        {
            return Err(f.err(
                "temperature",
                format!("{t} is negative or not a number; use 0 (greedy) or a positive value"),
            ));
        }
        if let Some(p) = config.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(f.err(
                "top_p",
                format!("{p} is outside (0, 1]; 1 disables the filter"),
            ));
        }
        Ok(config)
    }

    /// The document, with the keys we interpret written only when set (as transformers writes
    /// only non-default values).
    pub fn to_json_value(&self) -> Value {
        let mut m = self.extra.clone();
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                m.insert(k.to_string(), v);
            }
        };
        put("bos_token_id", self.bos_token_id.map(Value::from));
        put(
            "eos_token_id",
            self.eos_token_ids.as_ref().map(|ids| match ids.as_slice() {
                [one] => Value::from(*one),
                many => Value::from(many.to_vec()),
            }),
        );
        put("pad_token_id", self.pad_token_id.map(Value::from));
        put("max_new_tokens", self.max_new_tokens.map(Value::from));
        put("max_length", self.max_length.map(Value::from));
        put("do_sample", self.do_sample.map(Value::from));
        put("temperature", self.temperature.map(Value::from));
        put("top_k", self.top_k.map(Value::from));
        put("top_p", self.top_p.map(Value::from));
        put(
            "transformers_version",
            Some(Value::from(TRANSFORMERS_VERSION)),
        );
        Value::Object(m)
    }

    /// The `generation_config.json` text (pretty-printed, keys sorted).
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(&self.to_json_value())
            .expect("a JSON value always serialises");
        s.push('\n');
        s
    }
}
