//! Which model family a `config.json` describes, and the per-family parts it switches on.
//!
//! tilearn has one model definition (RMSNorm, RoPE, SwiGLU decoder blocks); a family only picks
//! the parts that differ:
//!
//! | family | `architectures` / `model_type` | parts |
//! | --- | --- | --- |
//! | Llama | `LlamaForCausalLM` / `llama` | `attention_bias` on q/k/v/o, `mlp_bias` |
//! | Qwen2 | `Qwen2ForCausalLM` / `qwen2` | bias on q/k/v only; sliding window on the layers `layer_types` names (from `use_sliding_window` and `max_window_layers`) |
//! | Mistral | `MistralForCausalLM` / `mistral` | `sliding_window` on every layer |
//! | Baichuan-7B | `BaiChuanForCausalLM` / `baichuan` | q/k/v fused in `W_pack` |
//! | Baichuan2-7B | `BaichuanForCausalLM` / `baichuan` | `W_pack`, NormHead (lm_head rows L2-normalised) |
//! | Baichuan-13B | `BaichuanForCausalLM`, hidden 5120, vocab not 125696 | `W_pack`, ALiBi instead of RoPE |
//! | Baichuan2-13B | `BaichuanForCausalLM`, hidden 5120, vocab 125696 | `W_pack`, ALiBi, NormHead, `z_loss_weight` |
//!
//! | Bloom | `BloomForCausalLM` / `bloom` | ALiBi, LayerNorm with bias (and one after the embedding), tanh-GeLU MLP, biases on every linear, q/k/v fused in `query_key_value` (interleaved per head in the file), tied lm_head |
//!
//! `BaichuanForCausalLM` names three architectures: Baichuan2-7B (RoPE + NormHead) and the
//! ALiBi models Baichuan-13B and Baichuan2-13B. The hidden size picks 13B (5120) or 7B, and for
//! 13B the vocabulary (125696: Baichuan2) the generation. `TILEARN_LLM_BAICHUAN_13B` = `1`
//! (Baichuan-13B) or `2` (Baichuan2-13B) says the checkpoint is a 13B one of that generation, as
//! Tilearn-Angel's variable does; it overrides the rule for any `BaichuanForCausalLM` (so a
//! reduced-width 13B-architecture model is one too; leave it unset for Baichuan2-7B). Any other
//! value is an error.

use serde_json::Value;

use super::Fields;
use crate::error::{EngineError, Result};

/// The environment variable that picks the Baichuan generation of a 13B-sized
/// `BaichuanForCausalLM` (`1`: Baichuan-13B, `2`: Baichuan2-13B), as in Tilearn-Angel.
pub const BAICHUAN_13B_ENV: &str = "TILEARN_LLM_BAICHUAN_13B";

/// Hidden size of the Baichuan 13B models (ALiBi attention).
const BAICHUAN_13B_HIDDEN: usize = 5120;
/// Vocabulary of Baichuan 2 (Baichuan 1 has 64000).
const BAICHUAN2_VOCAB: usize = 125_696;

/// The Baichuan architectures (one `model_type`, the same tensor names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BaichuanVariant {
    /// Baichuan-7B (`BaiChuanForCausalLM`): RoPE.
    Baichuan7B,
    /// Baichuan2-7B (`BaichuanForCausalLM`): RoPE, NormHead.
    Baichuan2_7B,
    /// Baichuan-13B (`BaichuanForCausalLM`): ALiBi.
    Baichuan13B,
    /// Baichuan2-13B (`BaichuanForCausalLM`): ALiBi, NormHead.
    Baichuan2_13B,
}

/// How attention knows where tokens are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionEncoding {
    /// Rotary embeddings on q and k.
    Rope,
    /// Linear biases on the scores (`tilearn_ops::alibi_slopes`), no rotation.
    Alibi,
}

/// The model family a config describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFamily {
    Llama,
    Qwen2,
    Mistral,
    Baichuan(BaichuanVariant),
    Bloom,
}

/// The normalisation of every norm of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// RMSNorm (weight only).
    Rms,
    /// LayerNorm with weight and bias (Bloom).
    Layer,
}

/// The MLP of a decoder block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    /// `down(silu(gate(x)) * up(x))`.
    SwiGlu,
    /// `down(gelu_tanh(up(x)))` (Bloom's `dense_4h_to_h(gelu(dense_h_to_4h(x)))`).
    GeluTanh,
}

/// What a layer's attention sees (transformers' `layer_types`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Every earlier key (`full_attention`).
    Full,
    /// The last `sliding_window` keys (`sliding_attention`).
    Sliding,
}

impl AttentionKind {
    pub(crate) fn hf_name(self) -> &'static str {
        match self {
            AttentionKind::Full => "full_attention",
            AttentionKind::Sliding => "sliding_attention",
        }
    }
}

impl ModelFamily {
    /// The `architectures` entry transformers (or the checkpoint's own code) uses.
    pub fn architecture(self) -> &'static str {
        match self {
            ModelFamily::Llama => "LlamaForCausalLM",
            ModelFamily::Qwen2 => "Qwen2ForCausalLM",
            ModelFamily::Mistral => "MistralForCausalLM",
            ModelFamily::Baichuan(BaichuanVariant::Baichuan7B) => "BaiChuanForCausalLM",
            ModelFamily::Baichuan(_) => "BaichuanForCausalLM",
            ModelFamily::Bloom => "BloomForCausalLM",
        }
    }

    /// The `model_type` of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            ModelFamily::Llama => "llama",
            ModelFamily::Qwen2 => "qwen2",
            ModelFamily::Mistral => "mistral",
            ModelFamily::Baichuan(_) => "baichuan",
            ModelFamily::Bloom => "bloom",
        }
    }

    /// Whether q, k and v are one tensor held as [Q; K; V] stacked along the rows (Baichuan's
    /// `W_pack`; Bloom's `query_key_value`, whose per-head interleaving the checkpoint code
    /// undoes at load and redoes at save).
    pub fn packed_qkv(self) -> bool {
        matches!(self, ModelFamily::Baichuan(_) | ModelFamily::Bloom)
    }

    /// RMSNorm, or LayerNorm with bias for Bloom.
    pub fn norm_kind(self) -> NormKind {
        match self {
            ModelFamily::Bloom => NormKind::Layer,
            _ => NormKind::Rms,
        }
    }

    /// SwiGLU, or tanh-GeLU for Bloom.
    pub fn mlp_kind(self) -> MlpKind {
        match self {
            ModelFamily::Bloom => MlpKind::GeluTanh,
            _ => MlpKind::SwiGlu,
        }
    }

    /// Whether a norm follows the embedding (Bloom's `word_embeddings_layernorm`).
    pub fn embedding_norm(self) -> bool {
        self == ModelFamily::Bloom
    }

    /// Whether the lm_head rows are L2-normalised before the product (Baichuan2's NormHead).
    pub fn norm_head(self) -> bool {
        matches!(
            self,
            ModelFamily::Baichuan(BaichuanVariant::Baichuan2_7B | BaichuanVariant::Baichuan2_13B)
        )
    }

    /// RoPE, or ALiBi for Baichuan's 13B models.
    pub fn position_encoding(self) -> PositionEncoding {
        match self {
            ModelFamily::Baichuan(
                BaichuanVariant::Baichuan13B | BaichuanVariant::Baichuan2_13B,
            )
            | ModelFamily::Bloom => PositionEncoding::Alibi,
            _ => PositionEncoding::Rope,
        }
    }
}

/// The family of the config in `f`, from `architectures` (or `model_type` when it is absent);
/// `baichuan_13b` is the value of [`BAICHUAN_13B_ENV`].
pub(crate) fn detect(f: &Fields<'_>, baichuan_13b: Option<&str>) -> Result<ModelFamily> {
    let model_type = f.opt_str("model_type")?;
    let names: Vec<&str> = match f.get("architectures") {
        Some(Value::Array(archs)) => archs.iter().filter_map(Value::as_str).collect(),
        Some(v) => return Err(f.wrong_type("architectures", "list of strings", v)),
        None => Vec::new(),
    };
    let field = if names.is_empty() {
        "model_type"
    } else {
        "architectures"
    };
    let name = match (names.first(), model_type) {
        (Some(n), _) => *n,
        (None, Some("llama")) => "LlamaForCausalLM",
        (None, Some("qwen2")) => "Qwen2ForCausalLM",
        (None, Some("mistral")) => "MistralForCausalLM",
        (None, Some("bloom")) => "BloomForCausalLM",
        (None, Some("baichuan")) => "BaichuanForCausalLM",
        (None, Some(other)) => {
            return Err(f.err(
                "model_type",
                format!(
                    "unsupported architecture \"{other}\"; tilearn supports model_type llama, \
                     qwen2, mistral, baichuan and bloom"
                ),
            ));
        }
        (None, None) => {
            return Err(f.err(
                "architectures",
                "missing; add \"architectures\": [\"LlamaForCausalLM\"] (or Qwen2ForCausalLM, \
                 MistralForCausalLM, BaichuanForCausalLM) to config.json",
            ));
        }
    };
    match name {
        "LlamaForCausalLM" => Ok(ModelFamily::Llama),
        "Qwen2ForCausalLM" => Ok(ModelFamily::Qwen2),
        "MistralForCausalLM" => Ok(ModelFamily::Mistral),
        "BloomForCausalLM" => Ok(ModelFamily::Bloom),
        "BaiChuanForCausalLM" => Ok(ModelFamily::Baichuan(BaichuanVariant::Baichuan7B)),
        "BaichuanForCausalLM" => baichuan(f, baichuan_13b),
        other => Err(f.err(
            field,
            format!(
                "unsupported architecture {names:?} ({other}); tilearn supports \
                 LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, BaiChuanForCausalLM \
                 (Baichuan-7B), BaichuanForCausalLM (Baichuan2-7B, Baichuan-13B, \
                 Baichuan2-13B) and BloomForCausalLM"
            ),
        )),
    }
}

/// `BaichuanForCausalLM`: Baichuan2-7B unless the hidden size is 13B's or the environment
/// names a 13B generation.
fn baichuan(f: &Fields<'_>, env: Option<&str>) -> Result<ModelFamily> {
    let thirteen_b = |generation: u8| {
        ModelFamily::Baichuan(if generation == 2 {
            BaichuanVariant::Baichuan2_13B
        } else {
            BaichuanVariant::Baichuan13B
        })
    };
    match env {
        None => {}
        Some("1") => return Ok(thirteen_b(1)),
        Some("2") => return Ok(thirteen_b(2)),
        Some(other) => {
            return Err(EngineError::InvalidArgument {
                argument: BAICHUAN_13B_ENV.to_string(),
                message: format!(
                    "{other:?} is not a Baichuan generation; set it to 1 (Baichuan-13B) or 2 \
                     (Baichuan2-13B), or unset it"
                ),
            });
        }
    }
    if f.opt_usize("hidden_size")? != Some(BAICHUAN_13B_HIDDEN) {
        return Ok(ModelFamily::Baichuan(BaichuanVariant::Baichuan2_7B));
    }
    let vocab = f.opt_usize("vocab_size")?;
    Ok(thirteen_b(if vocab == Some(BAICHUAN2_VOCAB) {
        2
    } else {
        1
    }))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::{Map, Value};

    use super::*;

    fn detect_json(json: &str, env: Option<&str>) -> Result<ModelFamily> {
        let Value::Object(obj): Value = serde_json::from_str(json).unwrap() else {
            panic!("not an object")
        };
        let obj: Map<String, Value> = obj;
        detect(
            &Fields {
                obj: &obj,
                file: Path::new("config.json"),
            },
            env,
        )
    }

    #[test]
    fn architectures_and_model_types_pick_the_family() {
        let cases = [
            (
                r#"{"architectures": ["Qwen2ForCausalLM"]}"#,
                ModelFamily::Qwen2,
            ),
            (r#"{"model_type": "mistral"}"#, ModelFamily::Mistral),
            (
                r#"{"architectures": ["BaiChuanForCausalLM"], "hidden_size": 4096}"#,
                ModelFamily::Baichuan(BaichuanVariant::Baichuan7B),
            ),
            (
                r#"{"architectures": ["BaichuanForCausalLM"], "hidden_size": 4096,
                    "vocab_size": 125696}"#,
                ModelFamily::Baichuan(BaichuanVariant::Baichuan2_7B),
            ),
            (r#"{"model_type": "llama"}"#, ModelFamily::Llama),
        ];
        for (json, want) in cases {
            assert_eq!(detect_json(json, None).unwrap(), want, "{json}");
        }
    }

    #[test]
    fn thirteen_b_baichuans_use_alibi_and_the_variable_picks_the_generation() {
        let v1 = r#"{"architectures": ["BaichuanForCausalLM"], "hidden_size": 5120,
                     "vocab_size": 64000}"#;
        let v2 = r#"{"architectures": ["BaichuanForCausalLM"], "hidden_size": 5120,
                     "vocab_size": 125696}"#;
        let small = r#"{"architectures": ["BaichuanForCausalLM"], "hidden_size": 64,
                     "vocab_size": 128}"#;
        let b = ModelFamily::Baichuan;
        let cases = [
            (v1, None, b(BaichuanVariant::Baichuan13B)),
            (v2, None, b(BaichuanVariant::Baichuan2_13B)),
            (v2, Some("1"), b(BaichuanVariant::Baichuan13B)),
            (v1, Some("2"), b(BaichuanVariant::Baichuan2_13B)),
            (small, None, b(BaichuanVariant::Baichuan2_7B)),
            (small, Some("1"), b(BaichuanVariant::Baichuan13B)),
        ];
        for (json, env, want) in cases {
            assert_eq!(detect_json(json, env).unwrap(), want, "{json} {env:?}");
        }
        assert_eq!(
            b(BaichuanVariant::Baichuan13B).position_encoding(),
            PositionEncoding::Alibi
        );
        assert!(b(BaichuanVariant::Baichuan2_13B).norm_head());
        assert!(!b(BaichuanVariant::Baichuan13B).norm_head());
        let bad = detect_json(v1, Some("13b")).unwrap_err().to_string();
        assert!(
            bad.contains(BAICHUAN_13B_ENV) && bad.contains("set it to 1"),
            "{bad}"
        );
        let bloom = detect_json(r#"{"model_type": "bloom"}"#, None).unwrap();
        assert_eq!(bloom, ModelFamily::Bloom);
        assert_eq!(bloom.position_encoding(), PositionEncoding::Alibi);
        assert_eq!(bloom.norm_kind(), NormKind::Layer);
    }
}
