//! Fine-tuning fixtures shared by the CPU and GPU tests: model directories with the chat
//! template fixtures, JSON-lines files, and a batch of two masked examples from the real
//! pipeline.

use std::path::{Path, PathBuf};

use tilearn_engine::data::{
    BYTE_EOS_ID, ChatMessage, SftOptions, TokenDataset, byte_level_tokenizer, prepare_sft,
};
use tokenizers::{AddedToken, Tokenizer};

pub const IGNORE: i32 = -100;

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sft")
        .join(name)
}

/// A model directory in `dir`: the fixture's tokenizer_config.json and the byte-level
/// tokenizer with the family's special tokens added (ids 257, 258, …). Returns the
/// tokenizer.json path.
pub fn model_dir(dir: &Path, family: &str, specials: &[&str]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(
        fixture(family).join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    let mut tok = byte_level_tokenizer();
    let added: Vec<AddedToken> = specials
        .iter()
        .map(|s| AddedToken::from(*s, true))
        .collect();
    tok.add_special_tokens(&added);
    let path = dir.join("tokenizer.json");
    tok.save(&path, false).unwrap();
    path
}

pub fn llama2(dir: &Path) -> PathBuf {
    model_dir(dir, "llama2-chat", &["<s>", "</s>"])
}

pub fn qwen2(dir: &Path) -> PathBuf {
    model_dir(dir, "qwen2-chatml", &["<|im_start|>", "<|im_end|>"])
}

pub fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

pub fn write_lines(path: &Path, lines: &[&str]) -> PathBuf {
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
    path.to_path_buf()
}

pub fn prepare(tokenizer: &Path, input: PathBuf, out: &Path) -> SftOptions {
    SftOptions::new(tokenizer.to_path_buf(), vec![input], out.to_path_buf())
}

/// Every row of `ds` (at `seq` tokens) with its labels.
pub fn rows(ds: &TokenDataset, seq: usize) -> Vec<(Vec<u32>, Vec<i32>)> {
    (0..ds.num_rows(seq))
        .map(|r| {
            let (mut ids, mut labels) = (vec![0u32; seq], vec![0i32; seq]);
            ds.read_row(r, &mut ids, &mut labels).unwrap();
            (ids, labels)
        })
        .collect()
}

/// The text of the trained tokens of a row (labels that are not -100), decoded.
pub fn trained_text(tok: &Tokenizer, labels: &[i32]) -> String {
    let ids: Vec<u32> = labels
        .iter()
        .filter(|&&l| l != IGNORE)
        .map(|&l| l as u32)
        .collect();
    tok.decode(&ids, false).unwrap()
}

pub const TINY: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":16,
    "intermediate_size":24,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"vocab_size":259,"max_position_embeddings":32,
    "rms_norm_eps":1e-5,"rope_theta":10000.0,"tie_word_embeddings":false,
    "initializer_range":0.3}"#;

/// A batch of two fine-tuning rows from the real pipeline (prepare-data → dataset rows) for a
/// model of [`TINY`], and the number of real (unpadded) tokens of each row.
pub fn sft_batch(dir: &Path, seq: usize) -> (Vec<u32>, Vec<i32>, Vec<usize>) {
    let tokenizer = qwen2(&dir.join("model"));
    let input = write_lines(
        &dir.join("pairs.jsonl"),
        &[
            r#"{"prompt": "Q: hi", "response": " ok"}"#,
            r#"{"prompt": "Question", "response": " fine"}"#,
        ],
    );
    let out = dir.join("data");
    prepare_sft(&prepare(&tokenizer, input, &out), false).unwrap();
    let ds = TokenDataset::open(&out).unwrap();
    let lens = (0..2)
        .map(|r| {
            let (mut ids, mut labels) = (vec![0; 64], vec![0; 64]);
            ds.read_row(r, &mut ids, &mut labels).unwrap();
            ids.iter().rposition(|&id| id != BYTE_EOS_ID).unwrap() + 1
        })
        .collect();
    let (mut ids, mut labels) = (vec![0; 2 * seq], vec![0; 2 * seq]);
    for r in 0..2 {
        ds.read_row(
            r,
            &mut ids[r * seq..(r + 1) * seq],
            &mut labels[r * seq..(r + 1) * seq],
        )
        .unwrap();
    }
    (ids, labels, lens)
}

/// `ids` and `labels` with the padding after each row's `lens` tokens replaced by other ids
/// (their labels stay -100: padding is masked).
pub fn perturb_padding(
    ids: &[u32],
    labels: &[i32],
    lens: &[usize],
    seq: usize,
) -> (Vec<u32>, Vec<i32>) {
    let (mut ids2, mut labels2) = (ids.to_vec(), labels.to_vec());
    for (r, &len) in lens.iter().enumerate() {
        for t in len..seq {
            ids2[r * seq + t] = (37 * t as u32 + 11 * r as u32) % 259;
            labels2[r * seq + t] = IGNORE;
        }
    }
    assert_ne!(ids2, ids, "the padding must change");
    (ids2, labels2)
}
