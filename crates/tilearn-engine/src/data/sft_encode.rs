//! Tokenizing one supervised fine-tuning record into ids and a per-token loss mask.
//!
//! * Prompt/response: `tokens(prompt) + tokens(response) + [eos]`, each part encoded on its
//!   own without special tokens (no BOS, no template); the response and the EOS are trained.
//! * Chat messages: the chat template renders the whole conversation (`add_generation_prompt`
//!   false), which is tokenized once, without added special tokens (the template writes them,
//!   as in transformers' `apply_chat_template`). The assistant turns' byte ranges come from
//!   incremental rendering ([`ChatTemplate::assistant_spans`]); a token is trained when the
//!   byte where it starts lies inside one of them. Whatever the template puts in an assistant
//!   turn after the generation prompt is trained — for ChatML that is the content,
//!   `<|im_end|>` and the newline; for Llama-2 the space, the content and `</s>`.

use tokenizers::Tokenizer;

use super::chat_template::ChatTemplate;
use super::sft_record::SftRecord;

/// Token ids and, per token, whether it is a training target.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MaskedTokens {
    pub ids: Vec<u32>,
    pub trained: Vec<bool>,
}

impl MaskedTokens {
    /// Number of trained tokens.
    pub fn num_trained(&self) -> usize {
        self.trained.iter().filter(|&&t| t).count()
    }

    /// Cut to the first `len` tokens; true if anything was cut.
    pub fn truncate(&mut self, len: usize) -> bool {
        let cut = self.ids.len() > len;
        self.ids.truncate(len);
        self.trained.truncate(len);
        cut
    }

    fn push(&mut self, ids: &[u32], trained: bool) {
        self.ids.extend_from_slice(ids);
        self.trained.extend(std::iter::repeat_n(trained, ids.len()));
    }
}

/// What encodes records: the tokenizer, the chat template (if the model has one) and the EOS.
#[derive(Debug)]
pub struct SftEncoder<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: Option<&'a ChatTemplate>,
    pub eos_id: u32,
    /// Said in the error for chat lines when there is no template.
    pub missing_template_hint: &'a str,
}

impl SftEncoder<'_> {
    /// Ids and loss mask of `record`; the error is a sentence for the caller to prefix with the
    /// file and line.
    pub fn encode(&self, record: &SftRecord) -> Result<MaskedTokens, String> {
        let mut out = MaskedTokens::default();
        match record {
            SftRecord::PromptResponse { prompt, response } => {
                out.push(&self.ids(prompt)?, false);
                out.push(&self.ids(response)?, true);
                out.push(&[self.eos_id], true);
            }
            SftRecord::Chat(messages) => {
                let Some(template) = self.template else {
                    return Err(self.missing_template_hint.to_string());
                };
                let (text, spans) = template.assistant_spans(messages).map_err(|e| {
                    format!(
                        "the chat template of {} failed: {e}",
                        template.source().display()
                    )
                })?;
                let encoding = self
                    .tokenizer
                    .encode(text.as_str(), false)
                    .map_err(|e| format!("tokenizing the rendered conversation failed: {e}"))?;
                out.ids = encoding.get_ids().to_vec();
                out.trained = encoding
                    .get_offsets()
                    .iter()
                    .map(|&(start, _)| spans.iter().any(|s| s.contains(&start)))
                    .collect();
                if out.num_trained() == 0 {
                    return Err(
                        "the assistant turns render to no tokens of their own; check the \
                         template and the messages' content"
                            .into(),
                    );
                }
            }
        }
        Ok(out)
    }

    fn ids(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("tokenizing failed: {e}"))
    }
}
