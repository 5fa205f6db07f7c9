//! Golden parity with Hugging Face transformers: each case in `tests/golden/<case>/` (made by
//! `tests/golden/make_golden.py`, see its README) holds a checkpoint as `save_pretrained` wrote
//! it and the logits, loss and parameter gradients transformers computed (float64 model, so the
//! reference is ~1e-7 accurate). We load the checkpoint with our loader, run our f32 CPU
//! forward and backward on the same inputs and compare relative errors ‖ours − ref‖ / ‖ref‖.

mod support;

use support::golden::{CASES, cpu_run, golden_dir, read_golden};
use support::rel_err;
use tilearn_engine::model::{Activations, LlamaForCausalLM};
use tilearn_ops::cpu::rope_inv_freq;

/// Logits and loss go through one f32 forward: ~1e-7 per op, amplified over two layers to
/// ~1e-6..1e-5; 1e-4 leaves margin yet catches any real mistake (a wrong RoPE convention,
/// scaling or norm eps moves them by 1e-2 or more).
const LOGITS_LOSS_TOL: f64 = 1e-4;
/// Gradients accumulate more f32 rounding (backward through softmax, attention and two
/// norms, sums over all tokens) and small-norm tensors (biases, norm weights) amplify it
/// relatively; 1e-3 is still far below the error of any wrong term (>= 1e-2).
const GRAD_TOL: f64 = 1e-3;

fn run_case(case: &str) {
    let dir = golden_dir().join(case);
    assert!(
        dir.is_dir(),
        "golden fixture {} is missing: the fixtures are committed; restore them with git or \
         regenerate with tests/golden/make_golden.py",
        dir.display()
    );
    let model = LlamaForCausalLM::from_pretrained(&dir)
        .unwrap_or_else(|e| panic!("{case}: loading the checkpoint failed: {e}"));
    let g = read_golden(&dir.join("golden.safetensors"));
    let cfg = &model.config;
    assert_eq!(g.logits.len(), g.batch * g.seq * cfg.vocab_size);

    // RoPE inverse frequencies (diagnostic: a mismatch here explains a logits mismatch).
    let inv_err = g.inv_freq.as_ref().map(|want| {
        let ours: Vec<f32> = rope_inv_freq(
            cfg.head_dim,
            cfg.rope_theta,
            &cfg.rope_scaling.to_ops(),
            g.seq,
            cfg.max_position_embeddings,
        )
        .into_iter()
        .map(|x| x as f32)
        .collect();
        rel_err(&ours, want)
    });

    let (logits, stats, grads) = cpu_run(&model, &g);
    let loss = stats.mean();
    let logits_err = rel_err(&logits, &g.logits);
    let loss_err = (loss - g.loss as f64).abs() / (g.loss as f64).abs();

    // Every parameter has a reference gradient and vice versa (tied: no lm_head entry).
    let mut ours_names: Vec<&str> = model.params.specs.iter().map(|s| s.name.as_str()).collect();
    ours_names.sort_unstable();
    let ref_names: Vec<&str> = g.grads.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(ours_names, ref_names, "{case}: parameter sets differ");

    let mut worst = (0.0f64, String::new());
    let mut failures = Vec::new();
    for (name, shape, want) in &g.grads {
        let spec = model.params.spec(name).unwrap();
        assert_eq!(&spec.shape, shape, "{case}: {name} shape");
        let err = rel_err(&grads[spec.range()], want);
        if err > worst.0 {
            worst = (err, name.clone());
        }
        if err > GRAD_TOL {
            failures.push(format!("{name}: {err:.3e}"));
        }
    }
    eprintln!(
        "golden {case}: logits rel err {logits_err:.3e}, loss rel err {loss_err:.3e} \
         (ours {loss:.7}, ref {:.7}, {} targets), worst grad rel err {:.3e} ({}), \
         rope inv_freq rel err {}",
        g.loss,
        stats.valid_tokens,
        worst.0,
        worst.1,
        inv_err.map_or("n/a".into(), |e| format!("{e:.3e}"))
    );
    assert!(
        logits_err <= LOGITS_LOSS_TOL,
        "{case}: logits rel err {logits_err:.3e}"
    );
    assert!(
        loss_err <= LOGITS_LOSS_TOL,
        "{case}: loss rel err {loss_err:.3e}"
    );
    assert!(failures.is_empty(), "{case}: gradients off: {failures:?}");

    // Gradient checkpointing gives the same bits on real checkpoints too.
    let mut acts_ckpt = Activations::new(cfg, g.batch, g.seq, true);
    let mut grads_ckpt = vec![0.0f32; model.params.numel()];
    let stats_ckpt = model
        .forward_backward(
            &g.input_ids,
            &g.labels,
            g.batch,
            g.seq,
            None,
            &mut acts_ckpt,
            &mut grads_ckpt,
        )
        .unwrap();
    assert_eq!(stats, stats_ckpt, "{case}: checkpointed loss");
    assert!(grads == grads_ckpt, "{case}: checkpointed gradients differ");
}

#[test]
fn mha_untied() {
    run_case("mha_untied");
}

#[test]
fn gqa_tied_llama3() {
    run_case("gqa_tied_llama3");
}

#[test]
fn gqa_linear_bias_v4config() {
    run_case("gqa_linear_bias_v4config");
}

#[test]
fn dynamic_rope() {
    run_case("dynamic_rope");
}

#[test]
fn every_fixture_directory_has_a_test() {
    let mut found: Vec<String> = std::fs::read_dir(golden_dir())
        .unwrap_or_else(|e| panic!("{}: {e}; fixtures are committed", golden_dir().display()))
        .filter_map(|e| {
            let e = e.unwrap();
            e.path()
                .join("golden.safetensors")
                .is_file()
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect();
    found.sort();
    let mut known: Vec<String> = CASES.iter().map(|s| s.to_string()).collect();
    known.sort();
    assert_eq!(found, known, "add a #[test] for each golden case");
}
