//! Generation with the key/value cache (`model::generate`): the cached forward gives the logits
//! of the uncached model at every position, and greedy generation reproduces transformers'
//! `generate(do_sample=False)` token for token on every golden checkpoint
//! (`tests/golden/<case>/generate_greedy.json`, written by `tests/golden/make_generate_golden.py`).

mod support;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use support::golden::{CASES, golden_dir};
use support::{rel_err, report};
use tilearn_engine::config::RopeScalingConfig;
use tilearn_engine::model::generate::{
    CachedDecoder, Decoding, GenerateOptions, Sampler, SamplingParams, StopReason, generate,
};
use tilearn_engine::model::{Activations, LlamaForCausalLM};

/// Cached and uncached forwards are both f32 with the same ops except attention (the cache's
/// per-row dot products against the blocked GEMM of the full forward), so they differ only by
/// summation order: ~1e-7 relative, amplified over two layers. 1e-5 is far below the effect of
/// any real mistake (a position off by one or a missed key moves the logits by > 1e-2).
const CACHE_TOL: f64 = 1e-5;

fn load(case: &str) -> LlamaForCausalLM {
    let dir = golden_dir().join(case);
    LlamaForCausalLM::from_pretrained(&dir)
        .unwrap_or_else(|e| panic!("{case}: loading {} failed: {e}", dir.display()))
}

/// The longest sequence whose uncached forward uses the same RoPE frequencies at every length
/// (dynamic NTK changes them past `original_max_position_embeddings`, see `rotary.rs`).
fn comparable_len(model: &LlamaForCausalLM) -> usize {
    match model.config.rope_scaling {
        RopeScalingConfig::Dynamic {
            original_max_position_embeddings,
            ..
        } if original_max_position_embeddings > 0 => original_max_position_embeddings,
        RopeScalingConfig::Dynamic { .. } => model.config.max_position_embeddings,
        _ => 24,
    }
}

#[test]
fn cached_logits_equal_the_full_forward_at_every_position() {
    for case in CASES {
        let model = load(case);
        let cfg = &model.config;
        let len = comparable_len(&model).min(24);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let ids: Vec<u32> = (0..len)
            .map(|_| rng.random_range(0..cfg.vocab_size as u32))
            .collect();
        let mut acts = Activations::new(cfg, 1, len, false);
        let full = model
            .forward_logits(&ids, 1, len, &mut acts)
            .unwrap()
            .to_vec();
        let row = |t: usize| &full[t * cfg.vocab_size..(t + 1) * cfg.vocab_size];

        // Prefill 5 tokens, then a chunk of 3 (prefill continued), then one token at a time.
        let mut decoder = CachedDecoder::new(&model, len);
        let mut worst = 0.0f64;
        let mut check = |end: usize, logits: &[f32]| {
            let err = rel_err(logits, row(end - 1));
            assert!(
                err <= CACHE_TOL,
                "{case}: position {}: rel err {err:e}",
                end - 1
            );
            worst = worst.max(err);
        };
        check(5, decoder.forward(&ids[..5]).unwrap());
        check(8, decoder.forward(&ids[5..8]).unwrap());
        for t in 8..len {
            check(t + 1, decoder.forward(&ids[t..t + 1]).unwrap());
        }
        assert_eq!(decoder.position(), len);
        report(&format!(
            "{case}: cached vs full forward over {len} positions: worst rel err {worst:.2e} (tol {CACHE_TOL:e})"
        ));
    }
}

#[test]
fn the_decoder_refuses_empty_input_out_of_vocab_ids_and_a_full_cache() {
    let model = load("mha_untied");
    let mut decoder = CachedDecoder::new(&model, 3);
    assert!(
        decoder
            .forward(&[])
            .unwrap_err()
            .to_string()
            .contains("empty")
    );
    let vocab = model.config.vocab_size as u32;
    assert!(decoder.forward(&[vocab]).is_err());
    assert_eq!(
        decoder.position(),
        0,
        "a refused call must not advance the cache"
    );
    decoder.forward(&[1, 2, 3]).unwrap();
    let err = decoder.forward(&[4]).unwrap_err().to_string();
    assert!(err.contains("capacity"), "{err}");
    // The capacity is a limit, not an allocation: memory follows the tokens actually held.
    let mut roomy = CachedDecoder::new(&model, 1 << 40);
    roomy.forward(&[1, 2, 3]).unwrap();
    let per_position = 2 * model.config.num_hidden_layers * model.config.kv_dim() * 4;
    assert_eq!(roomy.cache().bytes(), 3 * per_position);
    roomy.forward(&[4]).unwrap();
    assert_eq!(roomy.cache().bytes(), 6 * per_position, "grows by doubling");
    let err = generate(&model, &[], &greedy(4, vec![]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("prompt"), "{err}");
}

fn greedy(max_new_tokens: usize, stop_ids: Vec<u32>) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        decoding: Decoding::Greedy,
        seed: 0,
        stop_ids,
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("a list of token ids")
        .iter()
        .map(|x| x.as_u64().expect("a token id") as u32)
        .collect()
}

#[test]
fn greedy_generation_equals_transformers_on_every_golden_checkpoint() {
    for case in CASES {
        let path = golden_dir().join(case).join("generate_greedy.json");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; the fixture is committed, or regenerate it with \
                 tests/golden/make_generate_golden.py",
                path.display()
            )
        });
        let fixture: Value = serde_json::from_str(&text).unwrap();
        let model = load(case);
        let max_new = fixture["max_new_tokens"].as_u64().unwrap() as usize;
        let stop_ids = ids(&fixture["eos_token_ids"]);
        assert_eq!(stop_ids, model.config.eos_token_ids, "{case}: eos ids");
        let prompts = fixture["prompts"].as_array().unwrap();
        assert!(!prompts.is_empty());
        for (i, p) in prompts.iter().enumerate() {
            let prompt = ids(&p["input_ids"]);
            let want = ids(&p["generated"]);
            let got = generate(&model, &prompt, &greedy(max_new, stop_ids.clone())).unwrap();
            assert_eq!(got.tokens, want, "{case}: prompt {i} {prompt:?}");
            let ended_on_eos = want.last().is_some_and(|t| stop_ids.contains(t));
            let reason = if ended_on_eos {
                StopReason::EndOfSequence
            } else {
                StopReason::MaxNewTokens
            };
            assert_eq!(got.stop, reason, "{case}: prompt {i}");
        }
        report(&format!(
            "{case}: greedy generation equals transformers on {} prompts",
            prompts.len()
        ));
    }
}

#[test]
fn sampling_is_reproducible_with_a_seed_and_stops_at_eos() {
    let model = load("gqa_tied_llama3");
    let sample = |seed| GenerateOptions {
        max_new_tokens: 12,
        decoding: Decoding::Sample(SamplingParams {
            temperature: 1.5,
            top_k: None,
            top_p: 0.95,
        }),
        seed,
        stop_ids: vec![],
    };
    let a = generate(&model, &[1, 7, 9], &sample(11)).unwrap().tokens;
    assert_eq!(a.len(), 12);
    assert_eq!(a, generate(&model, &[1, 7, 9], &sample(11)).unwrap().tokens);
    assert_ne!(a, generate(&model, &[1, 7, 9], &sample(12)).unwrap().tokens);
    // Stopping at a token the run emits keeps it and ends there.
    let mut stop_at = sample(11);
    stop_at.stop_ids = vec![a[3]];
    let first = a.iter().position(|&t| t == a[3]).unwrap();
    let stopped = generate(&model, &[1, 7, 9], &stop_at).unwrap();
    assert_eq!(stopped.tokens, a[..=first]);
    assert_eq!(stopped.stop, StopReason::EndOfSequence);
}

// Sampling filters on hand-made logits.

fn sample(params: SamplingParams, logits: &[f32], draws: usize) -> Vec<u32> {
    let mut s = Sampler::new(Decoding::Sample(params), 7).unwrap();
    (0..draws).map(|_| s.pick(logits).unwrap()).collect()
}

#[test]
fn greedy_takes_the_first_maximum() {
    let mut s = Sampler::new(Decoding::Greedy, 0).unwrap();
    assert_eq!(s.pick(&[0.1, 3.0, -1.0, 3.0]).unwrap(), 1);
}

#[test]
fn top_k_and_top_p_keep_only_the_likeliest_tokens() {
    let logits = [0.0, 2.0, 1.0, 1.9, -5.0];
    let top2 = SamplingParams {
        top_k: Some(2),
        ..Default::default()
    };
    let drawn = sample(top2, &logits, 200);
    assert!(drawn.iter().all(|&t| t == 1 || t == 3), "{drawn:?}");
    assert!(drawn.contains(&1) && drawn.contains(&3));
    // p(1) ≈ 0.39, p(3) ≈ 0.35: top-p 0.5 keeps exactly tokens 1 and 3.
    let nucleus = SamplingParams {
        top_k: None,
        top_p: 0.5,
        ..Default::default()
    };
    let drawn = sample(nucleus, &logits, 200);
    assert!(drawn.iter().all(|&t| t == 1 || t == 3), "{drawn:?}");
    // A tiny top-p keeps the likeliest token only.
    let tiny = SamplingParams {
        top_p: 1e-6,
        ..nucleus
    };
    assert!(sample(tiny, &logits, 50).iter().all(|&t| t == 1));
}

#[test]
fn a_low_temperature_concentrates_and_a_seed_reproduces() {
    let logits = [0.0, 1.0, 0.5];
    let cold = SamplingParams {
        temperature: 0.01,
        top_k: None,
        top_p: 1.0,
    };
    assert!(sample(cold, &logits, 100).iter().all(|&t| t == 1));
    let warm = SamplingParams {
        top_k: None,
        ..Default::default()
    };
    let a = sample(warm, &logits, 100);
    assert_eq!(a, sample(warm, &logits, 100));
    assert!(a.contains(&0) && a.contains(&1) && a.contains(&2), "{a:?}");
}

#[test]
fn out_of_range_values_and_nan_logits_are_refused() {
    for bad in [
        SamplingParams {
            temperature: -1.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        SamplingParams {
            top_p: 0.0,
            ..Default::default()
        },
        SamplingParams {
            top_p: 1.5,
            ..Default::default()
        },
        SamplingParams {
            top_k: Some(0),
            ..Default::default()
        },
    ] {
        assert!(Sampler::new(Decoding::Sample(bad), 0).is_err(), "{bad:?}");
    }
    let mut s = Sampler::new(Decoding::Greedy, 0).unwrap();
    let err = s.pick(&[0.0, f32::NAN]).unwrap_err().to_string();
    assert!(err.contains("NaN"), "{err}");
}
