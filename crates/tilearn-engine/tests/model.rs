//! `LlamaForCausalLM` on the CPU: gradient checkpointing is bit-identical, gradient
//! accumulation is exact, the backward matches finite differences (in f64), and save → load
//! keeps the logits.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tilearn_engine::EngineError;
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::model::{Activations, LlamaForCausalLM, count_valid_targets};
use tilearn_ops::DType;

/// A tiny config: GQA (4 query heads, 2 kv heads), optional biases and tying, RoPE as given.
fn config(tied: bool, bias: bool, rope: &str) -> LlamaConfig {
    let json = format!(
        r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":16,"intermediate_size":24,
           "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
           "vocab_size":23,"max_position_embeddings":8,"rms_norm_eps":1e-5,
           "tie_word_embeddings":{tied},"attention_bias":{bias},"mlp_bias":{bias},
           "initializer_range":0.3,"rope_parameters":{rope}}}"#
    );
    LlamaConfig::from_json_str(&json, "test/config.json").unwrap()
}

const ROPE_DEFAULT: &str = r#"{"rope_type":"default","rope_theta":10000.0}"#;
const ROPE_DYNAMIC: &str = r#"{"rope_type":"dynamic","factor":2.0,"rope_theta":10000.0}"#;
const ROPE_LLAMA3: &str = r#"{"rope_type":"llama3","factor":4.0,"low_freq_factor":1.0,
    "high_freq_factor":4.0,"original_max_position_embeddings":8,"rope_theta":500.0}"#;

/// A model with norm weights and biases perturbed away from 1 / 0, so their gradients matter.
fn model(config: LlamaConfig, seed: u64) -> LlamaForCausalLM {
    let mut m = LlamaForCausalLM::from_config(config, seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 1000);
    for spec in m.params.specs.clone() {
        if spec.name.ends_with("norm.weight") || spec.name.ends_with(".bias") {
            for x in &mut m.params.data[spec.range()] {
                *x += rng.random_range(-0.3..0.3);
            }
        }
    }
    m
}

/// Random ids and labels = ids with a few positions ignored.
fn batch(vocab: usize, batch: usize, seq: usize, seed: u64) -> (Vec<u32>, Vec<i32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let ids: Vec<u32> = (0..batch * seq)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    let labels = ids
        .iter()
        .enumerate()
        .map(|(i, &t)| if i % 5 == 3 { -100 } else { t as i32 })
        .collect();
    (ids, labels)
}

fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        d += (x as f64 - y as f64).powi(2);
        n += (y as f64).powi(2);
    }
    d.sqrt() / n.sqrt()
}

#[test]
fn gradient_checkpointing_is_bit_identical() {
    for (tied, bias, rope) in [
        (false, true, ROPE_DEFAULT),
        (true, false, ROPE_LLAMA3),
        (false, false, ROPE_DYNAMIC),
    ] {
        let m = model(config(tied, bias, rope), 1);
        let (b, t) = (3, 12);
        let (ids, labels) = batch(23, b, t, 2);
        let mut plain = Activations::new(&m.config, b, t, false);
        let mut ckpt = Activations::new(&m.config, b, t, true);
        assert!(ckpt.bytes() < plain.bytes());
        let l1 = m.forward_logits(&ids, b, t, &mut plain).unwrap().to_vec();
        let l2 = m.forward_logits(&ids, b, t, &mut ckpt).unwrap().to_vec();
        assert!(l1 == l2, "logits differ with checkpointing");
        let mut g1 = vec![0.0; m.params.numel()];
        let mut g2 = vec![0.0; m.params.numel()];
        let s1 = m
            .forward_backward(&ids, &labels, b, t, None, &mut plain, &mut g1)
            .unwrap();
        let s2 = m
            .forward_backward(&ids, &labels, b, t, None, &mut ckpt, &mut g2)
            .unwrap();
        assert_eq!(s1, s2);
        assert!(
            g1 == g2,
            "gradients differ with checkpointing (tied={tied})"
        );
        assert!(g1.iter().all(|x| x.is_finite()) && g1.iter().any(|&x| x != 0.0));
    }
}

#[test]
fn gradient_accumulation_matches_full_batch() {
    let m = model(config(false, true, ROPE_DEFAULT), 3);
    let (b, t) = (4, 10);
    let (ids, labels) = batch(23, b, t, 4);
    let total = count_valid_targets(&labels, b, t);
    assert!(total > 0);

    let mut acts = Activations::new(&m.config, b, t, false);
    let mut full = vec![0.0; m.params.numel()];
    let s_full = m
        .forward_backward(&ids, &labels, b, t, None, &mut acts, &mut full)
        .unwrap();
    assert_eq!(s_full.valid_tokens, total);

    // Two micro-batches of 2 into one buffer, each scaled by the whole batch's count. The
    // arena is reused: built for batch 4, called with batch 2.
    let mut acc = vec![0.0; m.params.numel()];
    let half = 2 * t;
    let mut loss_sum = 0.0;
    let mut valid = 0;
    for k in 0..2 {
        let r = k * half..(k + 1) * half;
        let s = m
            .forward_backward(
                &ids[r.clone()],
                &labels[r],
                2,
                t,
                Some(total as f64),
                &mut acts,
                &mut acc,
            )
            .unwrap();
        loss_sum += s.loss_sum;
        valid += s.valid_tokens;
    }
    assert_eq!(valid, total);
    assert!((loss_sum - s_full.loss_sum).abs() <= 1e-9 * s_full.loss_sum.abs() + 1e-9);
    let err = rel_diff(&acc, &full);
    assert!(err <= 1e-6, "accumulated gradient rel err {err:.3e}");
}

#[test]
fn loss_denominator_scales_gradients_and_grads_accumulate() {
    let m = model(config(true, false, ROPE_DEFAULT), 5);
    let (b, t) = (2, 8);
    let (ids, labels) = batch(23, b, t, 6);
    let mut acts = Activations::new(&m.config, b, t, false);
    let n = count_valid_targets(&labels, b, t) as f64;
    let mut g1 = vec![0.0; m.params.numel()];
    m.forward_backward(&ids, &labels, b, t, Some(n), &mut acts, &mut g1)
        .unwrap();
    let mut g2 = vec![0.0; m.params.numel()];
    m.forward_backward(&ids, &labels, b, t, Some(2.0 * n), &mut acts, &mut g2)
        .unwrap();
    // Adding the same half-weighted gradient twice gives the full one.
    m.forward_backward(&ids, &labels, b, t, Some(2.0 * n), &mut acts, &mut g2)
        .unwrap();
    assert!(rel_diff(&g2, &g1) <= 1e-6);
}

#[test]
fn count_valid_targets_shifts_labels() {
    // Row 0: the first label is never a target; row 1: -100 ignored.
    let labels = [5, 6, 7, 1, -100, 2];
    assert_eq!(count_valid_targets(&labels, 2, 3), 2 + 1);
}

/// Central differences of the f64 loss against the f64 backward, for a few entries of every
/// parameter tensor. In f64 with h = 1e-5 the truncation error (~h²·f''') and rounding error
/// (~1e-16/h) are both ~1e-10, so a 1e-6 bound is tight yet robust.
fn finite_difference_check(config: LlamaConfig, seq: usize) {
    let m = model(config, 7);
    let (b, t) = (2, seq);
    let (ids, labels) = batch(m.config.vocab_size, b, t, 8);
    let p64: Vec<f64> = m.params.data.iter().map(|&x| x as f64).collect();
    let mut acts = Activations::<f64>::new(&m.config, b, t, false);
    let mut grads = vec![0.0f64; p64.len()];
    let stats = m
        .forward_backward_with(&p64, &ids, &labels, b, t, None, &mut acts, &mut grads)
        .unwrap();
    let denom = stats.valid_tokens as f64;
    let mut scratch = vec![0.0f64; p64.len()];
    let mut loss_at = |p: &[f64]| {
        let s = m
            .forward_backward_with(p, &ids, &labels, b, t, None, &mut acts, &mut scratch)
            .unwrap();
        s.loss_sum / denom
    };

    let h = 1e-5;
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut worst = 0.0f64;
    for spec in &m.params.specs {
        for _ in 0..3 {
            let i = spec.offset + rng.random_range(0..spec.numel());
            let mut p = p64.clone();
            p[i] = p64[i] + h;
            let up = loss_at(&p);
            p[i] = p64[i] - h;
            let down = loss_at(&p);
            let fd = (up - down) / (2.0 * h);
            let err = (fd - grads[i]).abs() / (1e-4 + grads[i].abs());
            worst = worst.max(err);
            assert!(
                (fd - grads[i]).abs() <= 1e-7 + 1e-5 * grads[i].abs(),
                "{} [{}]: backward {:.10e}, finite difference {:.10e}",
                spec.name,
                i - spec.offset,
                grads[i],
                fd
            );
        }
    }
    eprintln!("finite differences: worst relative error {worst:.3e}");
}

#[test]
fn backward_matches_finite_differences_untied_bias() {
    finite_difference_check(config(false, true, ROPE_DEFAULT), 6);
}

#[test]
fn backward_matches_finite_differences_tied_llama3() {
    finite_difference_check(config(true, false, ROPE_LLAMA3), 6);
}

#[test]
fn backward_matches_finite_differences_dynamic_rope_past_max_positions() {
    // seq 12 > max_position_embeddings 8: dynamic NTK rescaling is active.
    finite_difference_check(config(false, false, ROPE_DYNAMIC), 12);
}

/// Bloom's parts (ALiBi over 3 heads, LayerNorms with bias including the embedding's, the
/// tanh-GeLU MLP, biases on every linear, tied embeddings) through the same check.
#[test]
fn backward_matches_finite_differences_bloom() {
    let json = r#"{"architectures": ["BloomForCausalLM"], "hidden_size": 12, "n_layer": 2,
        "n_head": 3, "vocab_size": 23, "initializer_range": 0.3}"#;
    finite_difference_check(LlamaConfig::from_json_str(json, "config.json").unwrap(), 6);
}

/// Baichuan2-13B's parts (ALiBi, NormHead, z-loss 0.05) through the same check.
#[test]
fn backward_matches_finite_differences_baichuan2_13b() {
    let json = r#"{"architectures": ["BaichuanForCausalLM"], "hidden_size": 12,
        "intermediate_size": 20, "num_hidden_layers": 2, "num_attention_heads": 3,
        "vocab_size": 23, "initializer_range": 0.3, "z_loss_weight": 0.05}"#;
    let mut config = LlamaConfig::from_json_str(json, "config.json").unwrap();
    config.family = tilearn_engine::config::ModelFamily::Baichuan(
        tilearn_engine::config::BaichuanVariant::Baichuan2_13B,
    );
    finite_difference_check(config, 6);
}

#[test]
fn save_load_gives_same_logits() {
    let m = model(config(false, true, ROPE_LLAMA3), 11);
    let (b, t) = (2, 7);
    let (ids, _) = batch(23, b, t, 12);
    let mut acts = Activations::new(&m.config, b, t, true);
    let before = m.forward_logits(&ids, b, t, &mut acts).unwrap().to_vec();
    for shard in [None, Some(4096)] {
        let dir = tempfile::tempdir().unwrap();
        m.save_pretrained(dir.path(), DType::F32, shard).unwrap();
        let loaded = LlamaForCausalLM::from_pretrained(dir.path()).unwrap();
        assert_eq!(loaded.config.rope_scaling, m.config.rope_scaling);
        assert_eq!(loaded.params.data, m.params.data);
        let after = loaded.forward_logits(&ids, b, t, &mut acts).unwrap();
        assert!(
            before == after,
            "logits changed through save/load ({shard:?})"
        );
    }
}

#[test]
fn smaller_batch_than_arena_gives_same_result() {
    let m = model(config(false, false, ROPE_DEFAULT), 13);
    let t = 9;
    let (ids, _) = batch(23, 1, t, 14);
    let mut big = Activations::new(&m.config, 4, t, false);
    let mut exact = Activations::new(&m.config, 1, t, false);
    let a = m.forward_logits(&ids, 1, t, &mut big).unwrap().to_vec();
    let b = m.forward_logits(&ids, 1, t, &mut exact).unwrap();
    assert!(a == b);
}

#[test]
fn bad_inputs_are_errors_that_say_what_to_do() {
    let m = model(config(false, false, ROPE_DEFAULT), 15);
    let mut acts = Activations::new(&m.config, 2, 4, false);
    // Token id outside the vocabulary.
    let e = m
        .forward_logits(&[0, 1, 23, 2, 0, 0, 0, 0], 2, 4, &mut acts)
        .unwrap_err();
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    // Batch larger than the arena.
    let e = m.forward_logits(&[0; 12], 3, 4, &mut acts).unwrap_err();
    assert!(matches!(e, EngineError::InvalidArgument { .. }), "{e:?}");
    assert!(e.to_string().contains("Activations::new"), "{e}");
    // Label outside the vocabulary.
    let mut g = vec![0.0; m.params.numel()];
    let e = m
        .forward_backward(
            &[0; 8],
            &[0, 99, 0, 0, 0, 0, 0, 0],
            2,
            4,
            None,
            &mut acts,
            &mut g,
        )
        .unwrap_err();
    assert!(e.to_string().contains("-100"), "{e}");
    // Wrong gradient buffer.
    let e = m
        .forward_backward(&[0; 8], &[0; 8], 2, 4, None, &mut acts, &mut [0.0; 3])
        .unwrap_err();
    assert!(e.to_string().contains("params.data"), "{e}");
}

#[test]
fn a_few_sgd_steps_reduce_the_loss() {
    let mut m = model(config(true, false, ROPE_DEFAULT), 17);
    let (b, t) = (2, 8);
    let (ids, labels) = batch(23, b, t, 18);
    let mut acts = Activations::new(&m.config, b, t, false);
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..20 {
        let mut g = vec![0.0; m.params.numel()];
        let s = m
            .forward_backward(&ids, &labels, b, t, None, &mut acts, &mut g)
            .unwrap();
        last = s.mean();
        first.get_or_insert(last);
        for (p, g) in m.params.data.iter_mut().zip(&g) {
            *p -= 0.5 * g;
        }
    }
    assert!(last < 0.5 * first.unwrap(), "{first:?} -> {last}");
}

/// Step time of the default `tilearn train` model (hidden 128, 4 layers, vocab 257) at batch
/// 16 x seq 128. Not an assertion (the machine is shared); run with
/// `cargo test -p tilearn-engine --test model -- --ignored --nocapture step_time`.
#[test]
#[ignore]
fn step_time_of_the_default_model() {
    let cfg = LlamaConfig::from_file(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tilearn-llm/src/default_config.json"
    ))
    .unwrap();
    let m = LlamaForCausalLM::from_config(cfg, 1);
    let (b, t) = (16, 128);
    let (ids, labels) = batch(m.config.vocab_size, b, t, 1);
    for ckpt in [false, true] {
        let mut acts = Activations::new(&m.config, b, t, ckpt);
        let mut g = vec![0.0; m.params.numel()];
        m.forward_backward(&ids, &labels, b, t, None, &mut acts, &mut g)
            .unwrap();
        let reps = 5;
        let start = std::time::Instant::now();
        for _ in 0..reps {
            m.forward_backward(&ids, &labels, b, t, None, &mut acts, &mut g)
                .unwrap();
        }
        let step = start.elapsed().as_secs_f64() / reps as f64;
        eprintln!(
            "gradient_checkpointing={ckpt}: {} params, arena {} MiB, forward+backward {:.1} ms",
            m.params.numel(),
            acts.bytes() >> 20,
            step * 1e3
        );
    }
}
