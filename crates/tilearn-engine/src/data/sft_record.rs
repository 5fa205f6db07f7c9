//! One line of a supervised fine-tuning JSON-lines file: a prompt/response pair or a chat.
//!
//! Accepted forms (one JSON object per line):
//! * `{"prompt": "...", "response": "..."}` — both strings;
//! * `{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}` — at
//!   least one `assistant` message (only those are trained on).
//!
//! Other fields are ignored. Errors are sentences without the file and line, which the caller
//! adds, and say how to fix the line.

use super::chat_template::ChatMessage;

/// A parsed line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SftRecord {
    /// Train on `response` given `prompt` (tokenized as they are, no template).
    PromptResponse { prompt: String, response: String },
    /// Train on the assistant turns of a conversation rendered by the chat template.
    Chat(Vec<ChatMessage>),
}

const FORMS: &str = "each line must be one JSON object with `prompt` and `response` strings, or \
                     a `messages` list of {\"role\", \"content\"} objects";

/// Parse one non-blank line.
pub fn parse_record(line: &str) -> Result<SftRecord, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("invalid JSON ({e}); {FORMS}"))?;
    let Some(object) = value.as_object() else {
        return Err(format!("found {}, not an object; {FORMS}", kind(&value)));
    };
    let has_pair = object.contains_key("prompt") || object.contains_key("response");
    match (object.get("messages"), has_pair) {
        (Some(_), true) => {
            Err("has both `messages` and `prompt`/`response`; keep one form per line".to_string())
        }
        (Some(messages), false) => parse_messages(messages).map(SftRecord::Chat),
        (None, true) => Ok(SftRecord::PromptResponse {
            prompt: string_field(object, "prompt")?,
            response: string_field(object, "response")?,
        }),
        (None, false) => Err(format!(
            "has neither `prompt`/`response` nor `messages`; {FORMS}"
        )),
    }
}

fn string_field(
    object: &serde_json::Map<String, serde_json::Value>,
    field: &str,
) -> Result<String, String> {
    match object.get(field) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!(
            "field `{field}` must be a string, found {}",
            kind(other)
        )),
        None => Err(format!(
            "field `{field}` is missing; a prompt/response line needs both `prompt` and \
             `response` strings"
        )),
    }
}

fn parse_messages(value: &serde_json::Value) -> Result<Vec<ChatMessage>, String> {
    let Some(list) = value.as_array() else {
        return Err(format!(
            "`messages` must be a list of {{\"role\", \"content\"}} objects, found {}",
            kind(value)
        ));
    };
    let mut messages = Vec::with_capacity(list.len());
    for (i, item) in list.iter().enumerate() {
        let Some(object) = item.as_object() else {
            return Err(format!(
                "messages[{i}] must be an object with `role` and `content` strings, found {}",
                kind(item)
            ));
        };
        let field = |name: &str| match object.get(name) {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(format!(
                "messages[{i}].{name} must be a string, found {}",
                kind(other)
            )),
            None => Err(format!(
                "messages[{i}] has no `{name}`; every message needs `role` and `content` \
                 strings"
            )),
        };
        messages.push(ChatMessage {
            role: field("role")?,
            content: field("content")?,
        });
    }
    if !messages.iter().any(ChatMessage::is_assistant) {
        return Err(
            "no message has role `assistant`, so nothing would be trained on; add the \
             assistant's answer or drop the line"
                .to_string(),
        );
    }
    Ok(messages)
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_forms_parse() {
        assert_eq!(
            parse_record(r#"{"prompt": "a", "response": "b", "id": 3}"#).unwrap(),
            SftRecord::PromptResponse {
                prompt: "a".into(),
                response: "b".into()
            }
        );
        let chat = parse_record(
            r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}"#,
        )
        .unwrap();
        let SftRecord::Chat(m) = chat else {
            panic!("expected a chat")
        };
        assert_eq!(m.len(), 2);
        assert!(m[1].is_assistant());
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        let cases = [
            ("{not json", "invalid JSON"),
            ("[1, 2]", "found a list, not an object"),
            (r#"{"prompt": "a"}"#, "field `response` is missing"),
            (
                r#"{"prompt": "a", "response": 7}"#,
                "`response` must be a string",
            ),
            (
                r#"{"text": "a"}"#,
                "neither `prompt`/`response` nor `messages`",
            ),
            (r#"{"messages": "hi"}"#, "`messages` must be a list"),
            (
                r#"{"messages": [{"role": "user"}]}"#,
                "messages[0] has no `content`",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "q"}]}"#,
                "no message has role `assistant`",
            ),
            (
                r#"{"messages": [], "prompt": "a", "response": "b"}"#,
                "keep one form per line",
            ),
        ];
        for (line, expected) in cases {
            let err = parse_record(line).unwrap_err();
            assert!(err.contains(expected), "{line}: {err}");
        }
    }
}
