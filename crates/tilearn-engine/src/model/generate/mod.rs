//! Text generation on the CPU with a key/value cache: the prompt goes through the model in one
//! forward that fills the cache (prefill), then each new token in a forward of one position
//! that attends to the cache (decode), until an end-of-sequence id of the config or
//! `max_new_tokens`. Greedy decoding reproduces transformers' `generate(do_sample=False)`.
//!
//! One sequence at a time (no batching, no padding). The loop ([`generate_with`]) runs any
//! [`Decoder`]: the CPU's [`CachedDecoder`] here, or the CUDA engine's `gpu::GpuDecoder`
//! (feature `cuda`), which keeps the cache in device memory; sampling runs on the host from the
//! last position's logits either way.

mod decode;
pub(crate) mod family_parts;
mod kv_cache;
pub(crate) mod rotary;
mod sampling;

use std::time::{Duration, Instant};

pub use decode::CachedDecoder;
pub use kv_cache::KvCache;
pub use sampling::{Decoding, Sampler, SamplingParams};

use crate::error::{EngineError, Result};
use crate::model::LlamaForCausalLM;

/// What to generate.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Upper bound on the number of generated tokens.
    pub max_new_tokens: usize,
    pub decoding: Decoding,
    /// Seed of the sampling generator (unused by greedy decoding).
    pub seed: u64,
    /// Generation stops after emitting any of these (the emitted id is kept, as transformers
    /// does); usually the config's `eos_token_ids`.
    pub stop_ids: Vec<u32>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The last generated token is one of the stop ids.
    EndOfSequence,
    /// `max_new_tokens` were generated.
    MaxNewTokens,
}

/// The generated tokens and how long the two phases took.
#[derive(Clone, Debug)]
pub struct Generation {
    /// New tokens only (the prompt is not repeated).
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    /// The prompt's forward, which also yields the first new token's logits.
    pub prefill: Duration,
    /// The one-token forwards after it (`tokens.len() - 1` of them).
    pub decode: Duration,
}

impl Generation {
    /// Decoded tokens per second (forwards of one token after the prefill); `None` without any.
    pub fn decode_tokens_per_second(&self) -> Option<f64> {
        let steps = self.tokens.len().saturating_sub(1);
        let secs = self.decode.as_secs_f64();
        (steps > 0 && secs > 0.0).then(|| steps as f64 / secs)
    }
}

/// A forward over new tokens of one sequence that keeps the keys and values of the tokens
/// before them: what [`generate_with`] drives.
pub trait Decoder {
    /// Appends `ids` to the sequence and returns the logits `[vocab]` of the last of them.
    fn forward(&mut self, ids: &[u32]) -> Result<&[f32]>;
    /// Tokens of the sequence so far.
    fn position(&self) -> usize;
    /// Positions the decoder has room for.
    fn capacity(&self) -> usize;
    /// Starts a new sequence.
    fn reset(&mut self);
}

impl Decoder for CachedDecoder<'_> {
    fn forward(&mut self, ids: &[u32]) -> Result<&[f32]> {
        CachedDecoder::forward(self, ids)
    }
    fn position(&self) -> usize {
        CachedDecoder::position(self)
    }
    fn capacity(&self) -> usize {
        self.cache().capacity()
    }
    fn reset(&mut self) {
        CachedDecoder::reset(self)
    }
}

/// Continues `prompt` with up to `options.max_new_tokens` tokens on the CPU.
pub fn generate(
    model: &LlamaForCausalLM,
    prompt: &[u32],
    options: &GenerateOptions,
) -> Result<Generation> {
    let mut decoder = CachedDecoder::new(model, prompt.len() + options.max_new_tokens);
    generate_with(&mut decoder, prompt, options)
}

/// Continues `prompt` with `decoder`, starting a new sequence in it; its capacity must hold
/// the prompt and `options.max_new_tokens`.
pub fn generate_with(
    decoder: &mut dyn Decoder,
    prompt: &[u32],
    options: &GenerateOptions,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidArgument {
            argument: "prompt".into(),
            message: "has no tokens; generation continues a prompt of at least one token".into(),
        });
    }
    let mut sampler = Sampler::new(options.decoding, options.seed)?;
    let max_new = options.max_new_tokens;
    if prompt.len() + max_new > decoder.capacity() {
        return Err(EngineError::InvalidArgument {
            argument: "max_new_tokens".into(),
            message: format!(
                "{} prompt tokens + {max_new} new ones exceed the decoder's capacity of {} \
                 positions; build it with a larger capacity",
                prompt.len(),
                decoder.capacity()
            ),
        });
    }
    decoder.reset();
    let mut tokens = Vec::with_capacity(max_new);
    let started = Instant::now();
    let mut logits = decoder.forward(prompt)?;
    let prefill = started.elapsed();
    let decode_start = Instant::now();
    let mut stop = StopReason::MaxNewTokens;
    while tokens.len() < max_new {
        let next = sampler.pick(logits)?;
        tokens.push(next);
        if options.stop_ids.contains(&next) {
            stop = StopReason::EndOfSequence;
            break;
        }
        if tokens.len() == max_new {
            break;
        }
        logits = decoder.forward(&[next])?;
    }
    Ok(Generation {
        tokens,
        stop,
        prefill,
        decode: decode_start.elapsed(),
    })
}
