//! SentencePiece `tokenizer.model` files load as tokenizers that give the ids the
//! `sentencepiece` package gives (fixtures and their script in tests/fixtures/sentencepiece/).

use std::path::{Path, PathBuf};

use serde_json::Value;
use tilearn_engine::data::prepare::load_tokenizer;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sentencepiece")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Every fixture text encodes to sentencepiece's ids and decodes to sentencepiece's text.
fn check_model(name: &str) {
    let tokenizer = load_tokenizer(&fixtures().join(format!("{name}.model"))).unwrap();
    let model = &expected()["models"][name];
    assert_eq!(
        tokenizer.get_vocab_size(true),
        model["vocab_size"].as_u64().unwrap() as usize
    );
    let cases = model["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "{name}: ids of {text:?}");
        let decoded = tokenizer.decode(&got, true).unwrap();
        assert_eq!(
            decoded,
            case["decoded"].as_str().unwrap(),
            "{name}: decoding of {text:?}"
        );
    }
}

#[test]
fn baichuan_style_model_matches_sentencepiece() {
    check_model("baichuan_like");
}

#[test]
fn llama_style_model_with_dummy_prefix_matches_sentencepiece() {
    check_model("llama_like");
}

#[test]
fn a_file_that_is_not_a_sentencepiece_model_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.model");
    std::fs::write(&path, b"\xff\xff\xff not protobuf").unwrap();
    let err = load_tokenizer(&path).unwrap_err().to_string();
    assert!(err.contains("tokenizer.model"), "{err}");
    assert!(err.contains("SentencePiece"), "{err}");
}

/// `prepare-data` with a `tokenizer.model` tokenizes with the conversion, finds `</s>` as the
/// end of sequence and leaves a `tokenizer.json` beside the data that loads to the same ids.
#[test]
fn prepare_data_accepts_a_sentencepiece_model_and_writes_a_tokenizer_json() {
    use tilearn_engine::data::prepare::{PrepareOptions, prepare_data};
    let dir = tempfile::tempdir().unwrap();
    let model = fixtures().join("baichuan_like.model");
    let text = dir.path().join("a.txt");
    std::fs::write(
        &text,
        "大型语言模型的训练 needs 1234 kernels.\n\nSecond document ǅ.\n",
    )
    .unwrap();
    let out = dir.path().join("data");
    let opts = PrepareOptions::new(model.clone(), vec![text], out.clone());
    let summary = prepare_data(&opts, false).unwrap();
    assert_eq!(summary.num_documents, 2, "{summary:?}");
    assert_eq!(summary.eos_id, 2, "{summary:?}");
    assert_eq!(summary.vocab_size, 600, "{summary:?}");
    let saved = load_tokenizer(&out.join("tokenizer.json")).unwrap();
    let original = load_tokenizer(&model).unwrap();
    for case in expected()["models"]["baichuan_like"]["cases"]
        .as_array()
        .unwrap()
    {
        let t = case["text"].as_str().unwrap();
        assert_eq!(
            saved.encode(t, false).unwrap().get_ids(),
            original.encode(t, false).unwrap().get_ids(),
            "{t:?}"
        );
    }
    assert_eq!(saved.token_to_id("</s>"), Some(2));
}
