//! `tilearn train --model DIR` fine-tunes checkpoints of the families beyond Llama and saves
//! them in the family's own tensor names and `config.json` (Qwen2's q/k/v biases, Mistral's
//! sliding window, Baichuan's `W_pack` and class name), which `eval` reads back; a 13B
//! Baichuan (ALiBi, chosen by `TILEARN_LLM_BAICHUAN_13B`) and Bloom too; Bloom's post-layernorm
//! residual ends in one clear error.

mod support;

use std::path::Path;
use std::process::{Command, Output};

use tilearn_engine::config::LlamaConfig;
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_ops::DType;

fn tilearn(args: &[&str]) -> Output {
    tilearn_with_baichuan_13b(args, None)
}

/// `tilearn` with `TILEARN_LLM_BAICHUAN_13B` set to `generation` (unset for `None`).
fn tilearn_with_baichuan_13b(args: &[&str], generation: Option<&str>) -> Output {
    let mut cmd = Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")));
    match generation {
        Some(g) => cmd.env(tilearn_engine::config::BAICHUAN_13B_ENV, g),
        None => cmd.env_remove(tilearn_engine::config::BAICHUAN_13B_ENV),
    };
    cmd.args(args).output().expect("the tilearn binary runs")
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

/// A small random checkpoint of `architecture` over the default byte-level vocabulary (257).
fn checkpoint(dir: &Path, architecture: &str, extra: &str) {
    let json = format!(
        r#"{{"architectures": ["{architecture}"], "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 257,
            "max_position_embeddings": 128{extra}}}"#
    );
    let config = LlamaConfig::from_json_str(&json, "config.json").unwrap();
    let model = LlamaForCausalLM::from_config(config, 3);
    model.save_pretrained(dir, DType::F32, None).unwrap();
}

fn tensor_names(dir: &Path) -> Vec<String> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    names
}

#[test]
fn families_fine_tune_and_save_in_their_own_form() {
    let cases = [
        (
            "Qwen2ForCausalLM",
            r#", "tie_word_embeddings": true"#,
            "q_proj.bias",
        ),
        (
            "MistralForCausalLM",
            r#", "sliding_window": 16"#,
            "q_proj.weight",
        ),
        ("BaiChuanForCausalLM", "", "W_pack.weight"),
        ("BaichuanForCausalLM", "", "W_pack.weight"),
        // Bloom reads num_hidden_layers / num_attention_heads as aliases of n_layer / n_head.
        ("BloomForCausalLM", "", "query_key_value.weight"),
    ];
    for (architecture, extra, tensor) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        let out_dir = tmp.path().join("out");
        checkpoint(&src, architecture, extra);
        let out = tilearn(&[
            "train",
            "--model",
            path_str(&src),
            "--output-dir",
            path_str(&out_dir),
            "--max-steps",
            "3",
            "--per-device-train-batch-size",
            "2",
            "--seq-len",
            "32",
            "--device",
            "cpu",
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{architecture}: train failed: {err}");
        let saved: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out_dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(saved["architectures"][0], architecture);
        if architecture.starts_with("Bloom") {
            assert_eq!(saved["n_layer"], 2, "Bloom's own config keys");
        }
        let names = tensor_names(&out_dir);
        assert!(
            names.iter().any(|n| n.ends_with(tensor)),
            "{architecture}: no {tensor} in {names:?}"
        );
        assert!(
            !names.iter().any(|n| n.ends_with("o_proj.bias")),
            "{architecture}: {names:?}"
        );
        if architecture.starts_with("Bai") {
            assert!(!names.iter().any(|n| n.contains("q_proj")), "{names:?}");
        }
        // The fine-tuned weights differ from the source, and eval reads the saved model.
        assert_ne!(support::weights(&src), support::weights(&out_dir));
        let tokens = tmp.path().join("tokens.json");
        std::fs::write(&tokens, "[[84, 104, 101, 32, 99, 97, 116]]").unwrap();
        let out = tilearn(&[
            "eval",
            "--model",
            path_str(&out_dir),
            "--tokens",
            path_str(&tokens),
        ]);
        let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{architecture}: eval: {e}: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        assert!(line["loss"].as_f64().unwrap().is_finite());
    }
}

/// A reduced-width Baichuan2-13B checkpoint (`TILEARN_LLM_BAICHUAN_13B=2`: ALiBi, NormHead,
/// z-loss 0.01) fine-tunes and saves `W_pack` and `z_loss_weight`; `eval` of the saved model
/// with the variable differs from `eval` without it (RoPE), so the variable picks the model.
#[test]
fn a_13b_baichuan_fine_tunes_with_the_variable() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let out_dir = tmp.path().join("out");
    checkpoint(&src, "BaichuanForCausalLM", r#", "z_loss_weight": 0.01"#);
    let out = tilearn_with_baichuan_13b(
        &[
            "train",
            "--model",
            path_str(&src),
            "--output-dir",
            path_str(&out_dir),
            "--max-steps",
            "3",
            "--per-device-train-batch-size",
            "2",
            "--seq-len",
            "32",
            "--device",
            "cpu",
        ],
        Some("2"),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {err}");
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(saved["architectures"][0], "BaichuanForCausalLM");
    assert_eq!(saved["z_loss_weight"], 0.01);
    assert!(
        tensor_names(&out_dir)
            .iter()
            .any(|n| n.ends_with("W_pack.weight"))
    );
    assert_ne!(support::weights(&src), support::weights(&out_dir));
    let tokens = tmp.path().join("tokens.json");
    std::fs::write(
        &tokens,
        "[[84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116]]",
    )
    .unwrap();
    let eval = |generation| {
        let out = tilearn_with_baichuan_13b(
            &[
                "eval",
                "--model",
                path_str(&out_dir),
                "--tokens",
                path_str(&tokens),
            ],
            generation,
        );
        let line: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("eval: {e}: {}", String::from_utf8_lossy(&out.stderr)));
        line["loss"].as_f64().unwrap()
    };
    let (alibi, rope) = (eval(Some("2")), eval(None));
    assert!(alibi.is_finite() && rope.is_finite());
    assert!((alibi - rope).abs() > 1e-6, "ALiBi {alibi} vs RoPE {rope}");
}

/// Bloom's `apply_residual_connection_post_layernorm: true` (taking the residual after the
/// norms) is refused with one clear error.
#[test]
fn bloom_post_layernorm_residual_ends_in_one_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(
        tmp.path().join("config.json"),
        r#"{"architectures": ["BloomForCausalLM"], "hidden_size": 64, "n_layer": 2,
            "n_head": 2, "vocab_size": 257, "apply_residual_connection_post_layernorm": true}"#,
    )
    .unwrap();
    let out = tilearn(&[
        "train",
        "--model",
        path_str(tmp.path()),
        "--output-dir",
        path_str(&tmp.path().join("out")),
        "--device",
        "cpu",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("apply_residual_connection_post_layernorm") && err.contains("not supported"),
        "{err}"
    );
}
