//! The README's "Fine-tune a Hugging Face model" walkthrough, command for command, on a tiny
//! stand-in for a published chat model (Llama architecture, the Llama-2 chat template, a
//! byte-level tokenizer with `<s>`/`</s>`): chat JSON lines → `prepare-data --format sft` →
//! `train --model` with a held-out split, evaluation and the best checkpoint → `loss.png`,
//! `tilearn plot` → `generate` from the fine-tuned directory (which carries the tokenizer).

mod support;

use std::path::Path;
use std::process::{Command, Output};

use support::ok;
use tilearn_engine::checkpoint::save_pretrained;
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::byte_level_tokenizer;
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_ops::DType;
use tokenizers::AddedToken;

fn tilearn(args: &[&str]) -> Output {
    Command::new(support::bin("tilearn", env!("CARGO_BIN_EXE_tilearn")))
        .args(args)
        .output()
        .expect("the tilearn binary runs")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
 "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
 "num_key_value_heads": 1, "vocab_size": 260, "max_position_embeddings": 256,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 257, "eos_token_id": 258,
 "torch_dtype": "float32"}"#;

/// The "published" model: random weights, the Llama-2 chat template and its special tokens.
fn published_model(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let config = LlamaConfig::from_json_str(CONFIG, "<test config>").unwrap();
    let model = LlamaForCausalLM::from_config(config.clone(), 3);
    save_pretrained(dir, &config, &model.params, DType::F32, None).unwrap();
    let template = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tilearn-engine/tests/fixtures/sft/llama2-chat/tokenizer_config.json");
    std::fs::copy(template, dir.join("tokenizer_config.json")).unwrap();
    let mut tokenizer = byte_level_tokenizer();
    tokenizer.add_special_tokens(&[
        AddedToken::from("<s>", true),
        AddedToken::from("</s>", true),
    ]);
    tokenizer.save(dir.join("tokenizer.json"), false).unwrap();
}

#[test]
fn fine_tune_a_chat_model_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("llama-chat");
    published_model(&base);
    let chats = dir.path().join("chats.jsonl");
    let lines: Vec<String> = (0..40)
        .map(|i| {
            format!(
                r#"{{"messages": [{{"role": "user", "content": "What is {i} plus {i}?"}}, {{"role": "assistant", "content": "{} it is."}}]}}"#,
                2 * i
            )
        })
        .collect();
    std::fs::write(&chats, lines.join("\n")).unwrap();

    // 1. Tokenize with the model's chat template; only the answers are trained.
    let data = dir.path().join("sft-data");
    let out = ok(tilearn(&[
        "prepare-data",
        "--format",
        "sft",
        "--tokenizer",
        s(&base.join("tokenizer.json")),
        "--input",
        s(&chats),
        "--output",
        s(&data),
        "--max-seq-length",
        "96",
    ]));
    assert!(out.contains("40 examples"), "{out}");

    // 2. Fine-tune with a held-out split, evaluation and the best checkpoint.
    let ft = dir.path().join("llama-chat-ft");
    let out = ok(tilearn(&[
        "train",
        "--model",
        s(&base),
        "--data",
        s(&data),
        "--output-dir",
        s(&ft),
        "--seq-len",
        "96",
        "--max-steps",
        "8",
        "--per-device-train-batch-size",
        "4",
        "--learning-rate",
        "3e-3",
        "--lr-scheduler-type",
        "cosine",
        "--warmup-steps",
        "2",
        "--validation-split-percentage",
        "20",
        "--eval-strategy",
        "steps",
        "--eval-steps",
        "2",
        "--save-steps",
        "4",
        "--save-total-limit",
        "1",
        "--load-best-model-at-end",
        "--logging-steps",
        "1",
        "--device",
        "cpu",
    ]));
    assert!(out.contains("copied the tokenizer files"), "{out}");
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "loss.png",
    ] {
        assert!(
            ft.join(file).is_file(),
            "{file} missing in the fine-tuned directory"
        );
    }
    let log = std::fs::read_to_string(ft.join("train_log.jsonl")).unwrap();
    assert!(log.contains("\"eval_loss\""), "{log}");

    // 3. The loss plot again, on demand.
    std::fs::remove_file(ft.join("loss.png")).unwrap();
    ok(tilearn(&["plot", s(&ft)]));
    assert!(ft.join("loss.png").is_file());

    // 4. Ask the fine-tuned model in its chat format (its own directory has the tokenizer and
    // the template): the same greedy answer as the template's text typed by hand.
    let ask = |input: &[&str]| {
        let mut args = vec!["generate", "--model", s(&ft), "--max-new-tokens", "8"];
        args.extend_from_slice(input);
        ok(tilearn(&args))
    };
    let out = ask(&["--chat", "What is 3 plus 3?"]);
    assert_eq!(
        out,
        ask(&["--prompt", "<s>[INST] What is 3 plus 3? [/INST]"])
    );
    assert!(!out.trim().is_empty(), "no generated text");
}
