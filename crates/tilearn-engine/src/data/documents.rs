//! Reading documents from input files.
//!
//! * Plain text (any extension other than `.jsonl`/`.json`): the file is split into paragraphs
//!   at blank lines (lines that are empty or only whitespace); every non-empty paragraph is one
//!   document, its lines joined with `\n` (a trailing `\r` of each line is removed). One
//!   document per paragraph, rather than per file, keeps documents short and lets a corpus of
//!   many small texts live in one file.
//! * JSON lines (`.jsonl` or `.json`): one JSON object per line with a string field (normally
//!   `text`); blank lines are skipped. A line that is not an object, lacks the field, or whose
//!   field is not a string is an error naming the file, the line number (1-based) and the field.
//!
//! Documents whose text is empty are skipped: they would contribute only an EOS token.

use std::path::Path;

use crate::error::{EngineError, Result};

/// How an input file is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputKind {
    /// Paragraphs separated by blank lines.
    PlainText,
    /// One JSON object per line.
    JsonLines,
}

impl InputKind {
    /// The kind for a file name: `.jsonl` and `.json` are JSON lines, everything else is text.
    pub fn of(path: &Path) -> InputKind {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(|e| e.to_ascii_lowercase())
            .as_deref()
        {
            Some("jsonl") | Some("json") => InputKind::JsonLines,
            _ => InputKind::PlainText,
        }
    }
}

/// Read the whole file as UTF-8.
pub(crate) fn read_utf8(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| EngineError::io(path, "read input file", e))?;
    String::from_utf8(bytes).map_err(|e| EngineError::Data {
        file: path.to_path_buf(),
        message: format!(
            "not valid UTF-8 (first bad byte at offset {}); convert the file to UTF-8",
            e.utf8_error().valid_up_to()
        ),
    })
}

/// The documents of `content`, read from `path` as `kind`.
pub fn split_documents(
    path: &Path,
    content: &str,
    kind: InputKind,
    text_field: &str,
) -> Result<Vec<String>> {
    match kind {
        InputKind::PlainText => Ok(paragraphs(content)),
        InputKind::JsonLines => json_lines(path, content, text_field),
    }
}

fn paragraphs(content: &str) -> Vec<String> {
    let mut docs = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for line in content.lines() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.trim().is_empty() {
            if !current.is_empty() {
                docs.push(current.join("\n"));
                current.clear();
            }
        } else {
            current.push(line);
        }
    }
    if !current.is_empty() {
        docs.push(current.join("\n"));
    }
    docs
}

fn json_lines(path: &Path, content: &str, field: &str) -> Result<Vec<String>> {
    let mut docs = Vec::new();
    for (index, line) in content.lines().enumerate() {
        let line_no = index + 1;
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let err = |message: String| EngineError::Data {
            file: path.to_path_buf(),
            message: format!("line {line_no}: {message}"),
        };
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| err(format!("invalid JSON ({e}); expected one object per line")))?;
        let object = value.as_object().ok_or_else(|| {
            err(format!(
                "expected a JSON object with a string field `{field}`, found {}",
                json_kind(&value)
            ))
        })?;
        match object.get(field) {
            Some(serde_json::Value::String(text)) => {
                if !text.is_empty() {
                    docs.push(text.clone());
                }
            }
            Some(other) => {
                return Err(err(format!(
                    "field `{field}` must be a string, found {}",
                    json_kind(other)
                )));
            }
            None => {
                return Err(err(format!(
                    "field `{field}` is missing; choose the field with --text-field"
                )));
            }
        }
    }
    Ok(docs)
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paragraphs_split_at_blank_lines() {
        let docs = paragraphs("a b\r\nc\n\n \n\nd\n\n\ne f\n");
        assert_eq!(docs, vec!["a b\nc", "d", "e f"]);
        assert!(paragraphs("\n\n  \n").is_empty());
    }

    #[test]
    fn kinds_by_extension() {
        assert_eq!(InputKind::of(Path::new("x.jsonl")), InputKind::JsonLines);
        assert_eq!(InputKind::of(Path::new("x.JSON")), InputKind::JsonLines);
        assert_eq!(InputKind::of(Path::new("x.txt")), InputKind::PlainText);
        assert_eq!(InputKind::of(Path::new("x")), InputKind::PlainText);
    }
}
