//! Model presets shared by `tilearn bench` and `benches/pytorch_baseline.py` (keep in sync).

use tilearn_engine::config::LlamaConfig;

/// A benchmark configuration: the model and its default batch and sequence length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preset {
    pub name: &'static str,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub intermediate_size: usize,
    pub batch: usize,
    pub seq: usize,
}

pub const PRESETS: [Preset; 6] = [
    Preset {
        name: "llama-134m",
        vocab_size: 32000,
        hidden_size: 768,
        num_hidden_layers: 12,
        num_attention_heads: 12,
        num_key_value_heads: 12,
        intermediate_size: 2048,
        batch: 16,
        seq: 1024,
    },
    Preset {
        name: "tinyllama-1.1b",
        vocab_size: 32000,
        hidden_size: 2048,
        num_hidden_layers: 22,
        num_attention_heads: 32,
        num_key_value_heads: 4,
        intermediate_size: 5632,
        batch: 8,
        seq: 2048,
    },
    // Qwen2-0.5B (Qwen2ForCausalLM: q/k/v biases, tied embeddings, rope_theta 1e6).
    Preset {
        name: "qwen2-0.5b",
        vocab_size: 151936,
        hidden_size: 896,
        num_hidden_layers: 24,
        num_attention_heads: 14,
        num_key_value_heads: 2,
        intermediate_size: 4864,
        batch: 8,
        seq: 2048,
    },
    // Baichuan2-7B's widths (W_pack, NormHead, vocabulary 125 696) at 8 of its 32 layers.
    Preset {
        name: "baichuan2-7b-8l",
        vocab_size: 125696,
        hidden_size: 4096,
        num_hidden_layers: 8,
        num_attention_heads: 32,
        num_key_value_heads: 32,
        intermediate_size: 11008,
        batch: 4,
        seq: 2048,
    },
    // Baichuan2-13B's widths (W_pack, ALiBi with 40 heads, NormHead, vocabulary 125 696: the
    // hidden size 5120 makes it the 13B architecture) at 4 of its 40 layers.
    Preset {
        name: "baichuan2-13b-4l",
        vocab_size: 125696,
        hidden_size: 5120,
        num_hidden_layers: 4,
        num_attention_heads: 40,
        num_key_value_heads: 40,
        intermediate_size: 13696,
        batch: 4,
        seq: 2048,
    },
    // bigscience/bloom-560m (BloomForCausalLM: ALiBi, LayerNorm, GeLU MLP of 4 · hidden,
    // biases everywhere, tied embeddings over a 250 880-token vocabulary).
    Preset {
        name: "bloom-560m",
        vocab_size: 250880,
        hidden_size: 1024,
        num_hidden_layers: 24,
        num_attention_heads: 16,
        num_key_value_heads: 16,
        intermediate_size: 4096,
        batch: 8,
        seq: 2048,
    },
];

impl Preset {
    pub fn by_name(name: &str) -> Option<Preset> {
        PRESETS.iter().copied().find(|p| p.name == name)
    }

    /// The preset as a Hugging Face config: Llama with untied embeddings (as in the PyTorch
    /// baseline), or the family the name says (`qwen2-*`: tied, rope_theta 1e6; `baichuan2-*`).
    pub fn config(&self, seq: usize) -> LlamaConfig {
        if self.name.starts_with("bloom") {
            let json = serde_json::json!({
                "architectures": ["BloomForCausalLM"],
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "n_layer": self.num_hidden_layers,
                "n_head": self.num_attention_heads,
                "layer_norm_epsilon": 1e-5,
            });
            return LlamaConfig::from_json_str(
                &json.to_string(),
                format!("<preset {}>", self.name),
            )
            .expect("presets are valid configs");
        }
        let (architecture, tied, rope_theta) = match self.name.split('-').next() {
            Some("qwen2") => ("Qwen2ForCausalLM", true, 1e6),
            Some("baichuan2") => ("BaichuanForCausalLM", false, 10000.0),
            _ => ("LlamaForCausalLM", false, 10000.0),
        };
        let json = serde_json::json!({
            "architectures": [architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": seq.max(2048),
            "rms_norm_eps": 1e-6,
            "rope_theta": rope_theta,
            "tie_word_embeddings": tied,
        });
        LlamaConfig::from_json_str(&json.to_string(), format!("<preset {}>", self.name))
            .expect("presets are valid configs")
    }
}

/// Dense bf16 peak of an H100/H200 SXM (datasheet), the MFU denominator for bf16 runs.
pub const PEAK_BF16_FLOPS: f64 = 989e12;

/// Training FLOPs per token: 6·N for the matmuls of forward and backward, plus causal attention
/// (scores and values: 12·L·T·(Hq·D), halved by the causal mask). The same formula as the
/// PyTorch baseline, so the two MFU figures compare; the plan advisor's MFU uses it too.
pub fn flops_per_token(config: &LlamaConfig, num_params: usize, seq: usize) -> f64 {
    tilearn_engine::plan::flops_per_token(config, num_params, seq)
}

#[cfg(test)]
mod tests {
    use tilearn_engine::config::{BaichuanVariant, ModelFamily};

    use super::*;

    #[test]
    fn every_preset_builds_its_family() {
        for p in PRESETS {
            let c = p.config(p.seq);
            assert_eq!(c.hidden_size, p.hidden_size, "{}", p.name);
            let want = match p.name {
                "qwen2-0.5b" => ModelFamily::Qwen2,
                "baichuan2-7b-8l" => ModelFamily::Baichuan(BaichuanVariant::Baichuan2_7B),
                "baichuan2-13b-4l" => ModelFamily::Baichuan(BaichuanVariant::Baichuan2_13B),
                "bloom-560m" => ModelFamily::Bloom,
                _ => ModelFamily::Llama,
            };
            assert_eq!(c.family, want, "{}", p.name);
        }
        let qwen = Preset::by_name("qwen2-0.5b").unwrap().config(2048);
        assert!(qwen.tie_word_embeddings && qwen.qkv_bias() && !qwen.o_bias());
        assert_eq!(qwen.rope_theta, 1e6);
        assert!(
            Preset::by_name("baichuan2-7b-8l")
                .unwrap()
                .config(2048)
                .norm_head()
        );
    }
}
