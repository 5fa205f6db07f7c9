//! Picking the next token from logits: greedy (argmax) or sampling with temperature, top-k and
//! top-p (nucleus), applied in transformers' order (temperature, then top-k, then top-p) and
//! drawn from a seeded ChaCha generator so a seed reproduces a run on any machine.

use rand::SeedableRng;
use rand::distr::Distribution;
use rand::distr::weighted::WeightedIndex;
use rand_chacha::ChaCha20Rng;

use crate::error::{EngineError, Result};

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decoding {
    /// The most likely token (the first one on ties, like `torch.argmax`): transformers'
    /// `do_sample=False`.
    Greedy,
    /// A draw from the filtered distribution: transformers' `do_sample=True`.
    Sample(SamplingParams),
}

/// The filters of [`Decoding::Sample`] (transformers' defaults: temperature 1, top-k 50,
/// top-p 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Logits are divided by it; must be positive (0 means greedy: use [`Decoding::Greedy`]).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (ties with the k-th kept too); `None` = no limit.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`, in
    /// `(0, 1]`; 1 keeps every token.
    pub top_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: Some(50),
            top_p: 1.0,
        }
    }
}

impl SamplingParams {
    /// Fails with a message naming the flag when a value is out of range.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(invalid(
                "temperature",
                format!(
                    "{} is not a positive number; use a temperature > 0, or greedy decoding",
                    self.temperature
                ),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid(
                "top_p",
                format!("{} is outside (0, 1]; 1 disables the filter", self.top_p),
            ));
        }
        if self.top_k == Some(0) {
            return Err(invalid(
                "top_k",
                "0 keeps no token; use at least 1 (or no limit)".into(),
            ));
        }
        Ok(())
    }
}

/// Picks tokens from logits according to a [`Decoding`], with its own random generator.
#[derive(Clone, Debug)]
pub struct Sampler {
    decoding: Decoding,
    rng: ChaCha20Rng,
    /// Reused `(token, logit)` buffer for the sampling filters.
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler whose draws are fixed by `seed`; fails on out-of-range sampling values.
    pub fn new(decoding: Decoding, seed: u64) -> Result<Sampler> {
        if let Decoding::Sample(params) = decoding {
            params.validate()?;
        }
        Ok(Sampler {
            decoding,
            rng: ChaCha20Rng::seed_from_u64(seed),
            candidates: Vec::new(),
        })
    }

    /// The next token for `logits` (`[vocab]`). Fails on a NaN logit (a broken model), which
    /// would otherwise pick an arbitrary token.
    pub fn pick(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(invalid("logits", "are empty (vocabulary of 0)".into()));
        }
        if let Some(i) = logits.iter().position(|x| x.is_nan()) {
            return Err(invalid(
                "logits",
                format!("entry {i} is NaN; the model's weights or activations are not finite"),
            ));
        }
        match self.decoding {
            Decoding::Greedy => Ok(argmax(logits)),
            Decoding::Sample(params) => self.sample(logits, params),
        }
    }

    fn sample(&mut self, logits: &[f32], params: SamplingParams) -> Result<u32> {
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &x)| (i as u32, x / params.temperature)),
        );
        // Most likely first; the sort is stable, so equal logits keep the lower id first.
        c.sort_by(|a, b| b.1.total_cmp(&a.1));
        if let Some(k) = params.top_k {
            let kth = c[k.min(c.len()) - 1].1;
            let kept = c.iter().take_while(|t| t.1 >= kth).count();
            c.truncate(kept);
        }
        let max = c[0].1;
        let weights: Vec<f64> = c.iter().map(|t| f64::from(t.1 - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut kept = weights.len();
        if params.top_p < 1.0 {
            let mut cumulative = 0.0;
            for (i, w) in weights.iter().enumerate() {
                cumulative += w / total;
                if cumulative >= f64::from(params.top_p) {
                    kept = i + 1;
                    break;
                }
            }
        }
        let dist = WeightedIndex::new(&weights[..kept]).map_err(|e| {
            invalid(
                "logits",
                format!("no token has a positive probability after filtering ({e})"),
            )
        })?;
        Ok(c[dist.sample(&mut self.rng)].0)
    }
}

/// Index of the largest logit, the first one on ties.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

fn invalid(argument: &str, message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: argument.to_string(),
        message,
    }
}
