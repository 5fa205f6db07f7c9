//! A fine-tuned model's directory gets the tokenizer files of the model it started from, as
//! Hugging Face's Trainer saves its tokenizer beside the weights, so `tilearn generate --model
//! OUT` and transformers' `AutoTokenizer.from_pretrained(OUT)` work on the result directly.

use std::path::Path;

use crate::error::{LlmError, Result};

/// The tokenizer files transformers reads (fast and slow tokenizers, the chat template).
const TOKENIZER_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
];

/// Copies the tokenizer files present in `model_dir` into `output_dir` (each written
/// atomically; a file already there is replaced). Returns the names copied.
pub fn copy_tokenizer_files(model_dir: &Path, output_dir: &Path) -> Result<Vec<&'static str>> {
    let mut copied = Vec::new();
    for name in TOKENIZER_FILES {
        let from = model_dir.join(name);
        if !from.is_file() {
            continue;
        }
        let io = |action: &str, path: &Path, e: std::io::Error| LlmError::Input {
            file: path.to_path_buf(),
            message: format!(
                "could not {action} it ({e}); the fine-tuned model is saved, copy the \
                 tokenizer files from {} by hand",
                model_dir.display()
            ),
        };
        let bytes = std::fs::read(&from).map_err(|e| io("read", &from, e))?;
        let to = output_dir.join(name);
        tilearn_ops::fs::write_bytes_atomic(&to, &bytes).map_err(|e| io("write", &to, e))?;
        copied.push(name);
    }
    Ok(copied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_only_the_tokenizer_files_present() {
        let dir = tempfile::tempdir().unwrap();
        let (model, out) = (dir.path().join("model"), dir.path().join("out"));
        std::fs::create_dir_all(&model).unwrap();
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(model.join("tokenizer.json"), b"{\"t\": 1}").unwrap();
        std::fs::write(model.join("tokenizer_config.json"), b"{}").unwrap();
        std::fs::write(model.join("model.safetensors"), b"weights").unwrap();
        std::fs::write(out.join("tokenizer_config.json"), b"stale").unwrap();
        let copied = copy_tokenizer_files(&model, &out).unwrap();
        assert_eq!(copied, ["tokenizer.json", "tokenizer_config.json"]);
        assert_eq!(
            std::fs::read(out.join("tokenizer.json")).unwrap(),
            b"{\"t\": 1}"
        );
        assert_eq!(
            std::fs::read(out.join("tokenizer_config.json")).unwrap(),
            b"{}"
        );
        assert!(!out.join("model.safetensors").exists());
    }
}
