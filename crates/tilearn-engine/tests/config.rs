//! `LlamaConfig` parsing: both Hugging Face forms, the round trip, and one-line errors that name
//! the file and the field; `GenerationConfig` (`generation_config.json`) likewise.

use tilearn_engine::EngineError;
use tilearn_engine::config::{GenerationConfig, LlamaConfig, RopeScalingConfig};
use tilearn_ops::DType;

const V4: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 64,
  "initializer_range": 0.02,
  "intermediate_size": 176,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 8,
  "num_hidden_layers": 2,
  "num_key_value_heads": 2,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0",
  "use_cache": true,
  "vocab_size": 1000
}"#;

const V5: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "dtype": "bfloat16",
  "eos_token_id": [128001, 128008, 128009],
  "head_dim": 8,
  "hidden_act": "silu",
  "hidden_size": 64,
  "initializer_range": 0.02,
  "intermediate_size": 176,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 8,
  "num_hidden_layers": 2,
  "num_key_value_heads": 2,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.0.0",
  "use_cache": true,
  "vocab_size": 1000
}"#;

/// A minimal v4 config with one key replaced (or removed with `None`).
fn with(key: &str, value: Option<&str>) -> String {
    let mut v: serde_json::Value = serde_json::from_str(
        r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":32,
            "intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":4,
            "num_key_value_heads":2,"vocab_size":50,"rms_norm_eps":1e-6}"#,
    )
    .unwrap();
    let obj = v.as_object_mut().unwrap();
    match value {
        Some(s) => {
            obj.insert(key.to_string(), serde_json::from_str(s).unwrap());
        }
        None => {
            obj.remove(key);
        }
    }
    v.to_string()
}

fn err_of(text: &str) -> String {
    let e = LlamaConfig::from_json_str(text, "/ckpt/config.json").unwrap_err();
    assert!(matches!(e, EngineError::Config { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(!msg.contains('\n'), "one line: {msg}");
    assert!(
        msg.starts_with("/ckpt/config.json: "),
        "names the file: {msg}"
    );
    msg
}

#[test]
fn v4_and_v5_forms_agree() {
    let a = LlamaConfig::from_json_str(V4, "v4/config.json").unwrap();
    let b = LlamaConfig::from_json_str(V5, "v5/config.json").unwrap();
    assert_eq!(a, b);
    assert_eq!(a.head_dim, 8);
    assert_eq!(a.num_key_value_heads, 2);
    assert_eq!(a.rope_theta, 500000.0);
    assert_eq!(
        a.rope_scaling,
        RopeScalingConfig::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
    assert!(a.tie_word_embeddings);
    assert_eq!(a.dtype, Some(DType::BF16));
    assert_eq!(a.eos_token_ids, vec![128001, 128008, 128009]);
    assert_eq!(a.bos_token_id, Some(128000));
    assert_eq!(a.pad_token_id, None);
    // Unknown keys are carried.
    assert_eq!(
        a.extra.get("use_cache"),
        Some(&serde_json::Value::Bool(true))
    );
    assert_eq!(
        a.extra.get("pretraining_tp"),
        Some(&serde_json::Value::from(1))
    );
}

#[test]
fn to_json_writes_v5_form_and_round_trips() {
    let a = LlamaConfig::from_json_str(V4, "config.json").unwrap();
    let text = a.to_json();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["architectures"][0], "LlamaForCausalLM");
    assert_eq!(v["model_type"], "llama");
    assert_eq!(v["dtype"], "bfloat16");
    assert_eq!(v["transformers_version"], "5.17.0");
    assert_eq!(v["rope_parameters"]["rope_type"], "llama3");
    assert_eq!(v["rope_parameters"]["rope_theta"], 500000.0);
    assert_eq!(v["use_cache"], true);
    assert_eq!(v["attention_dropout"], 0.0);
    assert!(v.get("rope_scaling").is_none() && v.get("torch_dtype").is_none());
    let b = LlamaConfig::from_json_str(&text, "config.json").unwrap();
    assert_eq!(a, b);
}

#[test]
fn defaults_follow_transformers() {
    let c = LlamaConfig::from_json_str(&with("num_key_value_heads", None), "c.json").unwrap();
    assert_eq!(c.num_key_value_heads, 4);
    assert_eq!(c.head_dim, 8);
    assert_eq!(c.rope_theta, 10000.0);
    assert_eq!(c.rope_scaling, RopeScalingConfig::Default);
    assert!(!c.tie_word_embeddings && !c.attention_bias && !c.mlp_bias);
    assert_eq!(c.initializer_range, 0.02);
    assert_eq!(c.dtype, None);
}

#[test]
fn rope_variants_in_both_forms() {
    let linear4 = with("rope_scaling", Some(r#"{"type":"linear","factor":2.0}"#));
    let c = LlamaConfig::from_json_str(&linear4, "c.json").unwrap();
    assert_eq!(c.rope_scaling, RopeScalingConfig::Linear { factor: 2.0 });
    let dyn5 = with(
        "rope_parameters",
        Some(r#"{"rope_type":"dynamic","factor":4.0,"rope_theta":1000.0}"#),
    );
    let c = LlamaConfig::from_json_str(&dyn5, "c.json").unwrap();
    assert_eq!(c.rope_theta, 1000.0);
    assert_eq!(
        c.rope_scaling,
        RopeScalingConfig::Dynamic {
            factor: 4.0,
            original_max_position_embeddings: 2048
        }
    );
    let default5 = with(
        "rope_parameters",
        Some(r#"{"rope_type":"default","rope_theta":5.0}"#),
    );
    let c = LlamaConfig::from_json_str(&default5, "c.json").unwrap();
    assert_eq!(
        (c.rope_theta, c.rope_scaling),
        (5.0, RopeScalingConfig::Default)
    );
}

#[test]
fn missing_field_names_file_and_field() {
    let msg = err_of(&with("hidden_size", None));
    assert!(msg.contains("`hidden_size`"), "{msg}");
    assert!(msg.contains("add \"hidden_size\": <int>"), "{msg}");
}

#[test]
fn wrong_type_names_field_and_type() {
    let msg = err_of(&with("num_hidden_layers", Some("\"two\"")));
    assert!(msg.contains("`num_hidden_layers`"), "{msg}");
    assert!(msg.contains("expected non-negative int"), "{msg}");
    let msg = err_of(&with("tie_word_embeddings", Some("1")));
    assert!(
        msg.contains("`tie_word_embeddings`") && msg.contains("true|false"),
        "{msg}"
    );
}

#[test]
fn unknown_architecture_is_rejected() {
    let msg = err_of(&with("architectures", Some(r#"["GPTNeoXForCausalLM"]"#)));
    assert!(msg.contains("`architectures`"), "{msg}");
    assert!(msg.contains("unsupported architecture"), "{msg}");
    assert!(msg.contains("GPTNeoXForCausalLM"), "{msg}");
    assert!(msg.contains("tilearn supports LlamaForCausalLM"), "{msg}");
    assert!(msg.contains("BloomForCausalLM"), "lists Bloom: {msg}");
}

#[test]
fn unsupported_rope_type_is_rejected() {
    let msg = err_of(&with(
        "rope_scaling",
        Some(r#"{"rope_type":"yarn","factor":4.0}"#),
    ));
    assert!(msg.contains("`rope_scaling.rope_type`"), "{msg}");
    assert!(msg.contains("\"yarn\" is unsupported"), "{msg}");
    let msg = err_of(&with(
        "rope_parameters",
        Some(r#"{"rope_type":"longrope","rope_theta":1.0}"#),
    ));
    assert!(
        msg.contains("`rope_parameters.rope_type`") && msg.contains("longrope"),
        "{msg}"
    );
}

#[test]
fn kv_heads_must_divide_heads() {
    let msg = err_of(&with("num_key_value_heads", Some("3")));
    assert!(msg.contains("`num_key_value_heads`"), "{msg}");
    assert!(
        msg.contains("3 does not divide num_attention_heads = 4"),
        "{msg}"
    );
}

#[test]
fn heads_must_divide_hidden_unless_head_dim_given() {
    let text = with("num_attention_heads", Some("6"));
    let text = text.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3");
    let msg = err_of(&text);
    assert!(
        msg.contains("`num_attention_heads`") && msg.contains("head_dim"),
        "{msg}"
    );
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["head_dim"] = 16.into();
    let c = LlamaConfig::from_json_str(&v.to_string(), "c.json").unwrap();
    assert_eq!((c.head_dim, c.q_dim(), c.kv_dim()), (16, 96, 48));
}

#[test]
fn zero_sizes_are_rejected() {
    let msg = err_of(&with("vocab_size", Some("0")));
    assert!(
        msg.contains("`vocab_size`") && msg.contains("positive"),
        "{msg}"
    );
}

#[test]
fn invalid_json_and_missing_file() {
    let msg = err_of("{ not json");
    assert!(msg.contains("not valid JSON"), "{msg}");
    let e = LlamaConfig::from_file("/nonexistent/dir/config.json").unwrap_err();
    assert!(
        e.to_string().contains("/nonexistent/dir/config.json"),
        "{e}"
    );
}

#[test]
fn golden_configs_round_trip_without_losing_keys() {
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden");
    let mut seen = 0;
    for entry in std::fs::read_dir(&golden).expect("tests/golden is committed") {
        let path = entry.unwrap().path().join("config.json");
        if !path.is_file() {
            continue;
        }
        seen += 1;
        let a = LlamaConfig::from_file(&path).unwrap();
        let text = a.to_json();
        let b = LlamaConfig::from_json_str(&text, &path).unwrap();
        assert_eq!(a, b, "{}", path.display());
        let src: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let out: serde_json::Value = serde_json::from_str(&text).unwrap();
        // Every key survives, except the v4 spellings that the v5 form renames.
        for key in src.as_object().unwrap().keys() {
            let renamed = ["rope_theta", "rope_scaling", "torch_dtype"].contains(&key.as_str());
            assert!(
                renamed || out.get(key).is_some(),
                "{}: key {key} lost",
                path.display()
            );
        }
    }
    assert!(
        seen >= 4,
        "expected the golden fixtures in {}",
        golden.display()
    );
}

#[test]
fn generation_config_reads_its_fields_keeps_the_rest_and_round_trips() {
    // A Llama-2-chat-like file, with a key we do not interpret.
    let text = r#"{"bos_token_id": 1, "eos_token_id": [2, 32000], "pad_token_id": 0,
        "do_sample": true, "temperature": 0.6, "top_p": 0.9, "top_k": 0, "max_length": 4096,
        "repetition_penalty": 1.05, "transformers_version": "4.31.0"}"#;
    let g = GenerationConfig::from_json_str(text, "generation_config.json").unwrap();
    assert_eq!(g.bos_token_id, Some(1));
    assert_eq!(g.eos_token_ids, Some(vec![2, 32000]));
    assert_eq!(g.pad_token_id, Some(0));
    assert_eq!(
        (g.do_sample, g.temperature, g.top_p),
        (Some(true), Some(0.6), Some(0.9))
    );
    assert_eq!(
        (g.top_k, g.max_length, g.max_new_tokens),
        (Some(0), Some(4096), None)
    );
    assert_eq!(g.extra["repetition_penalty"], 1.05);
    let back = GenerationConfig::from_json_str(&g.to_json(), "<written>").unwrap();
    assert_eq!(back, g);
    // One id is an id; an absent one stays absent (config.json's ids then apply).
    let one = GenerationConfig::from_json_str(r#"{"eos_token_id": 7}"#, "g.json").unwrap();
    assert_eq!(one.eos_token_ids, Some(vec![7]));
    let none = GenerationConfig::from_json_str("{}", "g.json").unwrap();
    assert_eq!(none, GenerationConfig::default());
}

#[test]
fn generation_config_errors_name_the_file_and_field() {
    for (text, field) in [
        (r#"{"eos_token_id": "two"}"#, "eos_token_id"),
        (r#"{"max_new_tokens": -3}"#, "max_new_tokens"),
        (r#"{"do_sample": "yes"}"#, "do_sample"),
        (r#"{"temperature": -1}"#, "temperature"),
        (r#"{"top_p": 1.5}"#, "top_p"),
    ] {
        let err = GenerationConfig::from_json_str(text, "/m/generation_config.json")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("generation_config.json") && err.contains(field),
            "{text}: {err}"
        );
    }
    assert!(GenerationConfig::from_json_str("[1]", "g.json").is_err());
}

#[test]
fn generation_config_from_the_model_config_holds_its_token_ids() {
    let config = LlamaConfig::from_json_str(V4, "config.json").unwrap();
    let g = GenerationConfig::from_model_config(&config);
    assert_eq!(g.bos_token_id, Some(128000));
    assert_eq!(g.eos_token_ids, Some(vec![128001, 128008, 128009]));
    assert_eq!((g.do_sample, g.max_new_tokens), (None, None));
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(GenerationConfig::from_dir(dir.path()).unwrap(), None);
    std::fs::write(dir.path().join("generation_config.json"), g.to_json()).unwrap();
    assert_eq!(GenerationConfig::from_dir(dir.path()).unwrap(), Some(g));
}
