//! Chat templates: the Jinja `chat_template` of a model's `tokenizer_config.json`, rendered
//! with `minijinja` the way Hugging Face's `apply_chat_template` renders it.
//!
//! transformers compiles the template in a sandboxed Jinja environment with `trim_blocks` and
//! `lstrip_blocks` on and passes `messages`, `bos_token`, `eos_token`, `add_generation_prompt`
//! and a `raise_exception(message)` function. We do the same; `minijinja-contrib`'s Python
//! compatibility layer supplies the string and dict methods templates call (`.strip()`,
//! `.startswith()`, `.items()`, …).
//!
//! [`ChatTemplate::assistant_spans`] finds the text of every assistant turn by rendering
//! incrementally: for assistant message `i`, the conversation before it rendered with
//! `add_generation_prompt = true` ends where the turn's own text starts, and the conversation
//! through it rendered with `add_generation_prompt = false` ends where the turn's text ends.
//! Both renders must be prefixes of the whole conversation's render (true of every template
//! that only appends per message); when one is not, the template is reported rather than
//! guessed around.

use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value, context};

use crate::error::{EngineError, Result};

/// File name of the tokenizer configuration that holds the chat template.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// One chat message as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or any role the template knows).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// The message as the template sees it: a map with `role` and `content`.
    fn to_value(&self) -> Value {
        Value::from_pairs([
            ("role", Value::from(self.role.as_str())),
            ("content", Value::from(self.content.as_str())),
        ])
    }

    /// True for the turns that are trained on.
    pub fn is_assistant(&self) -> bool {
        self.role == "assistant"
    }
}

/// A compiled chat template and the special tokens passed to it.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The `tokenizer_config.json` it came from (named in errors).
    source: PathBuf,
    bos_token: String,
    eos_token: String,
}

/// Name under which the template is stored in the environment.
const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// The template of the `tokenizer_config.json` beside `tokenizer_json`; `None` when that
    /// file does not exist or names no `chat_template`.
    pub fn beside(tokenizer_json: &Path) -> Result<Option<ChatTemplate>> {
        let Some(dir) = tokenizer_json.parent() else {
            return Ok(None);
        };
        let path = dir.join(TOKENIZER_CONFIG_FILE);
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path)
            .map_err(|e| EngineError::io(&path, "read tokenizer_config.json", e))?;
        let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            template_err(
                &path,
                format!("invalid JSON ({e}); fix the file or remove it"),
            )
        })?;
        let source = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(named)) => default_of_named(&path, named)?,
            Some(_) => {
                return Err(template_err(
                    &path,
                    "`chat_template` must be a string (or a list of {name, template}); fix \
                     the file",
                ));
            }
        };
        let token = |field: &str| special_token_text(config.get(field));
        ChatTemplate::new(&source, &path, token("bos_token"), token("eos_token")).map(Some)
    }

    /// Compile `source` (the Jinja text); `config` names the file in errors.
    pub fn new(
        source: &str,
        config: &Path,
        bos_token: String,
        eos_token: String,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_err(config, describe(&e)))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| {
                template_err(
                    config,
                    format!(
                        "the chat_template does not compile: {}; fix the template",
                        describe(&e)
                    ),
                )
            })?;
        Ok(ChatTemplate {
            env,
            source: config.to_path_buf(),
            bos_token,
            eos_token,
        })
    }

    /// The `tokenizer_config.json` the template came from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Render `messages`; the error message says what the template reported.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| describe(&e))?;
        template
            .render(context! {
                messages => messages.iter().map(ChatMessage::to_value).collect::<Vec<_>>(),
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                add_generation_prompt => add_generation_prompt,
            })
            .map_err(|e| describe(&e))
    }

    /// The whole conversation's text and the byte ranges in it of each assistant turn (in
    /// message order); see the module documentation for the method.
    pub fn assistant_spans(
        &self,
        messages: &[ChatMessage],
    ) -> std::result::Result<(String, Vec<Range<usize>>), String> {
        let full = self.render(messages, false)?;
        let mut spans = Vec::new();
        for (i, message) in messages.iter().enumerate() {
            if !message.is_assistant() {
                continue;
            }
            let before = self.render(&messages[..i], true)?;
            let through = self.render(&messages[..=i], false)?;
            for (what, prefix) in [("before", &before), ("through", &through)] {
                if !full.starts_with(prefix.as_str()) {
                    return Err(format!(
                        "the template's rendering of the conversation {what} assistant message \
                         {} is not a prefix of the whole conversation's, so the assistant's \
                         tokens cannot be located (a template that rewrites earlier turns, such \
                         as one that drops past reasoning, is not supported); use \
                         prompt/response lines instead",
                        i + 1
                    ));
                }
            }
            if through.len() < before.len() {
                return Err(format!(
                    "assistant message {} renders to nothing after the generation prompt; the \
                     template does not emit assistant turns",
                    i + 1
                ));
            }
            spans.push(before.len()..through.len());
        }
        Ok((full, spans))
    }
}

/// `raise_exception(message)`: how Hugging Face templates reject a conversation.
fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// The error text of a minijinja error, with its cause and the template line when known.
fn describe(e: &JinjaError) -> String {
    let mut text = match e.detail() {
        Some(detail) if e.kind() == ErrorKind::InvalidOperation => detail.to_string(),
        _ => e.to_string(),
    };
    if let Some(line) = e.line() {
        text.push_str(&format!(" (template line {line})"));
    }
    text
}

/// The template named `default` of a list of `{name, template}` (the form transformers writes
/// for tokenizers with several templates).
fn default_of_named(path: &Path, named: &[serde_json::Value]) -> Result<String> {
    named
        .iter()
        .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
        .and_then(|t| t.get("template"))
        .and_then(|t| t.as_str())
        .map(str::to_string)
        .ok_or_else(|| {
            template_err(
                path,
                "`chat_template` is a list without a template named `default`; fix the file",
            )
        })
}

/// A special token of `tokenizer_config.json`: a string, or an object with `content`
/// (`AddedToken` form). Missing tokens render as the empty string, as in transformers.
pub fn special_token_text(value: Option<&serde_json::Value>) -> String {
    match value {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

fn template_err(path: &Path, message: impl Into<String>) -> EngineError {
    EngineError::Data {
        file: path.to_path_buf(),
        message: message.into(),
    }
}
