//! Hugging Face checkpoint I/O: round trips in every dtype, sharding, and the errors and
//! failure modes (missing tensor, wrong shape, unexpected tensor, interrupted save).

use std::path::Path;

use tilearn_engine::EngineError;
use tilearn_engine::checkpoint::{
    INDEX_FILE, NamedTensor, SINGLE_FILE, load_params, read_tensors_file, save_pretrained,
    write_tensors_file,
};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::params::ParamStore;
use tilearn_ops::DType;

fn config(tied: bool) -> LlamaConfig {
    let json = format!(
        r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":16,"intermediate_size":24,
           "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
           "vocab_size":37,"tie_word_embeddings":{tied},"attention_bias":true}}"#
    );
    LlamaConfig::from_json_str(&json, "config.json").unwrap()
}

fn params(config: &LlamaConfig, seed: u64) -> ParamStore {
    let mut p = ParamStore::from_config(config);
    p.init_random(seed, 0.5);
    p
}

/// Every tensor of the weight files in `dir`, sorted by name.
fn tensors_in(dir: &Path) -> Vec<NamedTensor> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            out.extend(read_tensors_file(&path).unwrap());
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn checkpoint_err(dir: &Path, config: &LlamaConfig) -> (String, String, String) {
    match load_params(dir, config).unwrap_err() {
        e @ EngineError::Checkpoint { .. } => {
            let EngineError::Checkpoint { file, tensor, .. } = &e else {
                unreachable!()
            };
            (file.display().to_string(), tensor.clone(), e.to_string())
        }
        e => panic!("expected a checkpoint error, got {e:?}"),
    }
}

#[test]
fn round_trip_f32_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(false);
    let p = params(&cfg, 1);
    save_pretrained(dir.path(), &cfg, &p, DType::F32, None).unwrap();
    assert!(dir.path().join(SINGLE_FILE).is_file());
    assert!(!dir.path().join(INDEX_FILE).exists());
    let loaded_cfg = LlamaConfig::from_file(dir.path().join("config.json")).unwrap();
    assert_eq!(loaded_cfg.dtype, Some(DType::F32));
    let q = load_params(dir.path(), &loaded_cfg).unwrap();
    assert_eq!(p.data, q.data);
    // The header carries {"format": "pt"} as transformers expects.
    let bytes = std::fs::read(dir.path().join(SINGLE_FILE)).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert_eq!(header["__metadata__"]["format"], "pt");
    assert_eq!(header["model.embed_tokens.weight"]["dtype"], "F32");
}

#[test]
fn round_trip_half_precision_rounds_to_nearest() {
    for (dtype, rel) in [(DType::BF16, 1.0 / 256.0), (DType::F16, 1.0 / 2048.0)] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(true);
        let p = params(&cfg, 2);
        save_pretrained(dir.path(), &cfg, &p, dtype, None).unwrap();
        let q = load_params(dir.path(), &cfg).unwrap();
        for (a, b) in p.data.iter().zip(&q.data) {
            assert!((a - b).abs() <= a.abs() * rel + 1e-7, "{dtype}: {a} vs {b}");
        }
        // Saving what was loaded again is lossless.
        let dir2 = tempfile::tempdir().unwrap();
        save_pretrained(dir2.path(), &cfg, &q, dtype, None).unwrap();
        assert_eq!(q.data, load_params(dir2.path(), &cfg).unwrap().data);
        let cfg_text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
        assert!(
            cfg_text.contains(&format!("\"dtype\": \"{}\"", dtype.hf_name())),
            "{cfg_text}"
        );
    }
}

#[test]
fn sharded_round_trip_and_index() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(false);
    let p = params(&cfg, 3);
    let total_bytes = p.numel() * 4;
    save_pretrained(dir.path(), &cfg, &p, DType::F32, Some(total_bytes / 3)).unwrap();
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(INDEX_FILE)).unwrap())
            .unwrap();
    assert_eq!(index["metadata"]["total_size"], total_bytes);
    let weight_map = index["weight_map"].as_object().unwrap();
    assert_eq!(weight_map.len(), p.specs.len());
    let mut files: Vec<&str> = weight_map.values().map(|v| v.as_str().unwrap()).collect();
    files.sort();
    files.dedup();
    assert!(files.len() >= 3, "{files:?}");
    let n = files.len();
    for (i, f) in files.iter().enumerate() {
        assert_eq!(*f, format!("model-{:05}-of-{:05}.safetensors", i + 1, n));
        assert!(dir.path().join(f).is_file());
    }
    assert!(!dir.path().join(SINGLE_FILE).exists());
    assert_eq!(load_params(dir.path(), &cfg).unwrap().data, p.data);
    // Each tensor is in exactly one shard.
    let mut names: Vec<String> = tensors_in(dir.path()).into_iter().map(|t| t.name).collect();
    names.dedup();
    assert_eq!(names.len(), p.specs.len());

    // Re-saving unsharded into the same directory removes the shards and the index.
    let p2 = params(&cfg, 4);
    save_pretrained(dir.path(), &cfg, &p2, DType::F32, None).unwrap();
    assert!(!dir.path().join(INDEX_FILE).exists());
    assert!(!dir.path().join(files[0]).exists());
    assert_eq!(load_params(dir.path(), &cfg).unwrap().data, p2.data);
}

#[test]
fn tied_checkpoint_with_lm_head_and_inv_freq_loads() {
    // transformers ignores lm_head.weight when embeddings are tied; old saves hold inv_freq.
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(true);
    let p = params(&cfg, 5);
    let mut tensors: Vec<(&str, &[usize], &[f32])> = p
        .specs
        .iter()
        .map(|s| (s.name.as_str(), s.shape.as_slice(), &p.data[s.range()]))
        .collect();
    let embed = p.view("model.embed_tokens.weight").unwrap();
    let shape = [37usize, 16];
    let inv = [1.0f32, 0.5];
    tensors.push(("lm_head.weight", &shape, embed));
    tensors.push(("model.layers.0.self_attn.rotary_emb.inv_freq", &[2], &inv));
    write_tensors_file(&dir.path().join(SINGLE_FILE), &tensors, DType::F32, &[]).unwrap();
    assert_eq!(load_params(dir.path(), &cfg).unwrap().data, p.data);
}

#[test]
fn missing_tensor_names_file_tensor_and_shape() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(false);
    let p = params(&cfg, 6);
    let tensors: Vec<(&str, &[usize], &[f32])> = p
        .specs
        .iter()
        .filter(|s| s.name != "model.layers.1.mlp.down_proj.weight")
        .map(|s| (s.name.as_str(), s.shape.as_slice(), &p.data[s.range()]))
        .collect();
    write_tensors_file(&dir.path().join(SINGLE_FILE), &tensors, DType::F32, &[]).unwrap();
    let (file, tensor, msg) = checkpoint_err(dir.path(), &cfg);
    assert!(file.ends_with("model.safetensors"), "{msg}");
    assert_eq!(tensor, "model.layers.1.mlp.down_proj.weight");
    assert!(msg.contains("missing (expected shape [16, 24])"), "{msg}");
}

#[test]
fn missing_lm_head_of_untied_model_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let tied = config(true);
    save_pretrained(dir.path(), &tied, &params(&tied, 7), DType::F32, None).unwrap();
    let (_, tensor, msg) = checkpoint_err(dir.path(), &config(false));
    assert_eq!(tensor, "lm_head.weight", "{msg}");
}

#[test]
fn wrong_shape_names_both_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(false);
    save_pretrained(dir.path(), &cfg, &params(&cfg, 8), DType::F32, None).unwrap();
    let mut other = cfg.clone();
    other.intermediate_size = 32;
    let (file, tensor, msg) = checkpoint_err(dir.path(), &other);
    assert!(file.ends_with("model.safetensors"), "{msg}");
    // Tensors are checked in name order: down_proj is the first MLP tensor.
    assert_eq!(tensor, "model.layers.0.mlp.down_proj.weight", "{msg}");
    assert!(
        msg.contains("has shape [16, 24] but config.json expects [16, 32]"),
        "{msg}"
    );
}

#[test]
fn unexpected_tensor_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(false);
    save_pretrained(dir.path(), &cfg, &params(&cfg, 9), DType::F32, None).unwrap();
    let mut fewer = cfg.clone();
    fewer.num_hidden_layers = 1;
    let (_, tensor, msg) = checkpoint_err(dir.path(), &fewer);
    assert!(tensor.starts_with("model.layers.1."), "{msg}");
    assert!(msg.contains("unexpected tensor"), "{msg}");
}

#[test]
fn unsupported_dtype_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(true);
    save_pretrained(dir.path(), &cfg, &params(&cfg, 10), DType::F32, None).unwrap();
    // Rewrite the dtype of one tensor in the header as I32 (same element size).
    let path = dir.path().join(SINGLE_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap().to_string();
    let patched = header.replacen("\"F32\"", "\"I32\"", 1);
    bytes[8..8 + n].copy_from_slice(patched.as_bytes());
    std::fs::write(&path, bytes).unwrap();
    let (_, _, msg) = checkpoint_err(dir.path(), &cfg);
    assert!(msg.contains("I32 is not supported"), "{msg}");
}

#[test]
fn no_weights_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _, msg) = checkpoint_err(dir.path(), &config(false));
    assert!(file.ends_with("model.safetensors"), "{msg}");
    assert!(msg.contains("no model.safetensors"), "{msg}");
}

#[test]
fn interrupted_save_leaves_previous_files_intact() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(false);
    let old = params(&cfg, 11);
    save_pretrained(dir.path(), &cfg, &old, DType::F32, None).unwrap();

    // A crash mid-write leaves a truncated `.tmp` behind: loading ignores it.
    std::fs::write(dir.path().join("model.safetensors.tmp"), b"truncated").unwrap();
    assert_eq!(load_params(dir.path(), &cfg).unwrap().data, old.data);

    // A save that fails part-way (here: the weights' .tmp path cannot be created) returns an
    // error and leaves the previous weights loadable and unchanged.
    std::fs::remove_file(dir.path().join("model.safetensors.tmp")).unwrap();
    std::fs::create_dir(dir.path().join("model.safetensors.tmp")).unwrap();
    std::fs::write(dir.path().join("model.safetensors.tmp/blocker"), b"x").unwrap();
    let new = params(&cfg, 12);
    let e = save_pretrained(dir.path(), &cfg, &new, DType::F32, None).unwrap_err();
    assert!(e.to_string().contains("model.safetensors.tmp"), "{e}");
    assert_eq!(load_params(dir.path(), &cfg).unwrap().data, old.data);

    // Once the obstacle is gone, saving again replaces the weights.
    std::fs::remove_dir_all(dir.path().join("model.safetensors.tmp")).unwrap();
    save_pretrained(dir.path(), &cfg, &new, DType::F32, None).unwrap();
    assert_eq!(load_params(dir.path(), &cfg).unwrap().data, new.data);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}
