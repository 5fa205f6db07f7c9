//! What `tilearn generate` does, from three sources in order: the command-line flags, the model
//! directory's `generation_config.json`, then `config.json`'s token ids and transformers'
//! defaults (temperature 1, top-k 50, top-p 1, greedy) — except the length, whose last fallback
//! is [`DEFAULT_MAX_NEW_TOKENS`] rather than transformers' `max_length` 20 (which counts the
//! prompt and would leave a long prompt nothing to generate).

use tilearn_engine::config::{GenerationConfig, LlamaConfig};
use tilearn_engine::model::generate::{Decoding, SamplingParams};

use crate::{LlmError, Result};

/// New tokens when neither a flag nor `generation_config.json` sets a length.
pub(crate) const DEFAULT_MAX_NEW_TOKENS: usize = 64;

/// The generation flags as given (`None` = not on the command line).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct GenerationFlags {
    pub max_new_tokens: Option<usize>,
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
}

/// The resolved settings of one run.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Settings {
    pub decoding: Decoding,
    pub max_new_tokens: usize,
    pub stop_ids: Vec<u32>,
    /// Sampling values that were given but do not apply because decoding is greedy.
    pub ignored_sampling_flags: bool,
}

fn usage(flag: &str, message: String) -> LlmError {
    LlmError::Usage {
        flag: flag.into(),
        message,
    }
}

impl GenerationFlags {
    /// Checks the values of the flags alone (before a model is loaded, so a typo fails fast).
    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(t) = self.temperature
            && !(t.is_finite() && t >= 0.0)
        {
            return Err(usage(
                "--temperature",
                format!("{t} is negative or not a number; use 0 (greedy) or a positive value"),
            ));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(usage(
                "--top-p",
                format!("{p} is outside (0, 1]; 1 disables the filter"),
            ));
        }
        Ok(())
    }

    /// Resolves the settings for a prompt of `prompt_len` tokens of the model `config`
    /// (whose `generation` holds its `generation_config.json`, if any).
    pub(crate) fn resolve(&self, config: &LlamaConfig, prompt_len: usize) -> Result<Settings> {
        self.validate()?;
        let file = config.generation.clone().unwrap_or_default();
        let max_new_tokens = match (self.max_new_tokens, file.max_new_tokens, file.max_length) {
            (Some(n), _, _) | (None, Some(n), _) => n,
            (None, None, Some(total)) => {
                if total <= prompt_len {
                    return Err(usage(
                        "--max-new-tokens",
                        format!(
                            "generation_config.json's max_length {total} leaves nothing to \
                             generate after the {prompt_len}-token prompt; pass --max-new-tokens"
                        ),
                    ));
                }
                total - prompt_len
            }
            (None, None, None) => DEFAULT_MAX_NEW_TOKENS,
        };
        let stop_ids = file
            .eos_token_ids
            .clone()
            .unwrap_or_else(|| config.eos_token_ids.clone());
        let defaults = SamplingParams::default();
        let sampling_given =
            self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some();
        let do_sample = self.do_sample.or(file.do_sample).unwrap_or(false);
        if !do_sample {
            return Ok(Settings {
                decoding: Decoding::Greedy,
                max_new_tokens,
                stop_ids,
                ignored_sampling_flags: sampling_given,
            });
        }
        let temperature = self
            .temperature
            .or(file.temperature.map(|t| t as f32))
            .unwrap_or(defaults.temperature);
        let top_k = self.top_k.or(file.top_k).or(defaults.top_k).unwrap_or(0);
        let top_p = self
            .top_p
            .or(file.top_p.map(|p| p as f32))
            .unwrap_or(defaults.top_p);
        let decoding = if temperature == 0.0 {
            Decoding::Greedy
        } else {
            Decoding::Sample(SamplingParams {
                temperature,
                top_k: (top_k > 0).then_some(top_k),
                top_p,
            })
        };
        Ok(Settings {
            decoding,
            max_new_tokens,
            stop_ids,
            ignored_sampling_flags: false,
        })
    }
}

/// The token a prompt that encodes to nothing starts from: `generation_config.json`'s
/// `bos_token_id`, else `config.json`'s (transformers' `generate` without input ids).
pub(crate) fn bos_for_empty_prompt(config: &LlamaConfig) -> Option<u32> {
    config
        .generation
        .as_ref()
        .and_then(|g: &GenerationConfig| g.bos_token_id)
        .or(config.bos_token_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config(generation: Option<serde_json::Value>) -> LlamaConfig {
        let mut c = LlamaConfig::from_json_str(
            &json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "vocab_size": 32, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2})
            .to_string(),
            "<test>",
        )
        .unwrap();
        c.generation =
            generation.map(|g| GenerationConfig::from_json_str(&g.to_string(), "<gen>").unwrap());
        c
    }

    #[test]
    fn without_a_file_or_flags_decoding_is_greedy_and_stops_at_the_config_eos() {
        let s = GenerationFlags::default()
            .resolve(&config(None), 5)
            .unwrap();
        assert_eq!(s.decoding, Decoding::Greedy);
        assert_eq!(s.max_new_tokens, DEFAULT_MAX_NEW_TOKENS);
        assert_eq!(s.stop_ids, vec![2]);
    }

    #[test]
    fn the_file_sets_defaults_and_flags_override_them() {
        let file = json!({"do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 0,
            "max_length": 30, "eos_token_id": [2, 7], "bos_token_id": 1,
            "repetition_penalty": 1.1});
        let c = config(Some(file));
        let s = GenerationFlags::default().resolve(&c, 10).unwrap();
        assert_eq!(
            s.decoding,
            Decoding::Sample(SamplingParams {
                temperature: 0.6,
                top_k: None,
                top_p: 0.9
            })
        );
        assert_eq!(s.max_new_tokens, 20, "max_length counts the prompt");
        assert_eq!(
            s.stop_ids,
            vec![2, 7],
            "the file's list wins over config.json"
        );
        let flags = GenerationFlags {
            max_new_tokens: Some(3),
            temperature: Some(1.5),
            top_k: Some(4),
            ..Default::default()
        };
        let s = flags.resolve(&c, 10).unwrap();
        assert_eq!(s.max_new_tokens, 3);
        assert_eq!(
            s.decoding,
            Decoding::Sample(SamplingParams {
                temperature: 1.5,
                top_k: Some(4),
                top_p: 0.9
            })
        );
        let greedy = GenerationFlags {
            do_sample: Some(false),
            top_p: Some(0.5),
            ..Default::default()
        };
        let s = greedy.resolve(&c, 10).unwrap();
        assert_eq!(s.decoding, Decoding::Greedy);
        assert!(s.ignored_sampling_flags);
        // max_length no longer than the prompt leaves nothing: an error naming the fix.
        let err = GenerationFlags::default()
            .resolve(&c, 30)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--max-new-tokens"), "{err}");
    }

    #[test]
    fn max_new_tokens_in_the_file_wins_over_max_length_and_temperature_zero_is_greedy() {
        let c = config(Some(
            json!({"max_new_tokens": 7, "max_length": 100, "do_sample": true, "temperature": 0.0}),
        ));
        let s = GenerationFlags::default().resolve(&c, 4).unwrap();
        assert_eq!(s.max_new_tokens, 7);
        assert_eq!(s.decoding, Decoding::Greedy);
    }

    #[test]
    fn bad_flag_values_are_refused_and_bos_falls_back_to_the_config() {
        for flags in [
            GenerationFlags {
                temperature: Some(-1.0),
                ..Default::default()
            },
            GenerationFlags {
                top_p: Some(0.0),
                ..Default::default()
            },
        ] {
            assert!(flags.validate().is_err(), "{flags:?}");
        }
        assert_eq!(bos_for_empty_prompt(&config(None)), Some(1));
        let c = config(Some(json!({"bos_token_id": 5})));
        assert_eq!(bos_for_empty_prompt(&c), Some(5));
    }
}
