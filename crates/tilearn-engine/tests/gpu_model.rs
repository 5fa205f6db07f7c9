//! The device model (`tilearn_engine::gpu::GpuLlama`) against transformers (the golden
//! fixtures), against the CPU engine (random models, every gradient, the optimizer step) and over
//! a 200-step bf16 training run whose loss curve must follow the CPU run's.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes. Every test
//! prints its measured errors, on success too, so the GPU machine's log records the margins.
#![cfg(feature = "cuda")]

mod support;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use support::golden::{CASES, golden_dir, read_golden};
use support::{gpu_or_skip, random_batch, rel_err, report};
use tilearn_engine::EngineError;
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::{DataLoader, LoaderState, TokenDataset, prepare_embedded_default};
use tilearn_engine::gpu::GpuLlama;
use tilearn_engine::model::{Activations, LlamaForCausalLM, count_valid_targets};
use tilearn_ops::DType;
use tilearn_ops::OpsError;
use tilearn_ops::cuda::GpuDevice;
use tilearn_optim::{AdamW, AdamWConfig, LrSchedule, SchedulerType};

/// Relative error of every tensor of `ours` against `reference` (flat buffers in the model's
/// layout): the worst one, and the list of those above `tol`.
fn tensor_errors(
    model: &LlamaForCausalLM,
    ours: &[f32],
    reference: &[f32],
    tol: f64,
) -> ((f64, String), Vec<String>) {
    let mut worst = (0.0f64, String::new());
    let mut failures = Vec::new();
    for spec in &model.params.specs {
        let err = rel_err(&ours[spec.range()], &reference[spec.range()]);
        if err.is_nan() || err > worst.0 {
            worst = (err, spec.name.clone());
        }
        if err.is_nan() || err > tol {
            failures.push(format!("{}: {err:.3e}", spec.name));
        }
    }
    (worst, failures)
}

// ---------------------------------------------------------------------------------------------
// (a) golden transformers fixtures on the GPU

/// f32 on the GPU: the CPU engine's tolerances (see tests/golden.rs): one f32 forward is ~1e-6
/// off a float64 reference, a wrong op 1e-2 or more.
const GOLDEN_LOGITS_LOSS_TOL: f64 = 1e-4;
const GOLDEN_GRAD_TOL: f64 = 1e-3;
/// bf16 activations and weights round every value to 8 bits of mantissa (~4e-3 relative); the
/// loss, a mean over all tokens, stays within 1e-2 of the float64 reference.
const GOLDEN_BF16_LOSS_TOL: f64 = 1e-2;

fn golden_case(dev: &GpuDevice, case: &str) {
    let dir = golden_dir().join(case);
    let model = LlamaForCausalLM::from_pretrained(&dir)
        .unwrap_or_else(|e| panic!("{case}: loading the checkpoint failed: {e}"));
    let g = read_golden(&dir.join("golden.safetensors"));

    // f32: logits, loss and every gradient.
    let mut gpu = GpuLlama::new(dev, &model, g.batch, g.seq, DType::F32).unwrap();
    let logits = gpu.forward_logits(&g.input_ids, g.batch, g.seq).unwrap();
    let logits_err = rel_err(&logits, &g.logits);
    let stats = gpu
        .forward_backward(&g.input_ids, &g.labels, g.batch, g.seq, None)
        .unwrap();
    let loss = stats.mean();
    let loss_err = (loss - g.loss as f64).abs() / (g.loss as f64).abs();
    let grads = gpu.download_grads().unwrap();
    let mut worst = (0.0f64, String::new());
    let mut failures = Vec::new();
    assert_eq!(
        g.grads.len(),
        model.params.specs.len(),
        "{case}: parameter count"
    );
    for (name, _, want) in &g.grads {
        let spec = model
            .params
            .spec(name)
            .unwrap_or_else(|| panic!("{case}: no parameter {name}"));
        let err = rel_err(&grads[spec.range()], want);
        if err.is_nan() || err > worst.0 {
            worst = (err, name.clone());
        }
        if err.is_nan() || err > GOLDEN_GRAD_TOL {
            failures.push(format!("{name}: {err:.3e}"));
        }
    }

    // bf16: the loss.
    let mut gpu16 = GpuLlama::new(dev, &model, g.batch, g.seq, DType::BF16).unwrap();
    let stats16 = gpu16
        .forward_backward(&g.input_ids, &g.labels, g.batch, g.seq, None)
        .unwrap();
    let loss16_err = (stats16.mean() - g.loss as f64).abs() / (g.loss as f64).abs();
    let logits16 = gpu16.forward_logits(&g.input_ids, g.batch, g.seq).unwrap();
    let logits16_err = rel_err(&logits16, &g.logits);

    report(&format!(
        "golden {case} on {}: f32 logits rel err {logits_err:.3e}, loss rel err {loss_err:.3e} \
         (ours {loss:.7}, ref {:.7}, {} targets), worst grad rel err {:.3e} ({}); bf16 loss \
         rel err {loss16_err:.3e} (ours {:.7}), bf16 logits rel err {logits16_err:.3e}",
        dev.name().unwrap_or_default(),
        g.loss,
        stats.valid_tokens,
        worst.0,
        worst.1,
        stats16.mean()
    ));
    assert!(
        logits_err <= GOLDEN_LOGITS_LOSS_TOL,
        "{case}: f32 logits rel err {logits_err:.3e}"
    );
    assert!(
        loss_err <= GOLDEN_LOGITS_LOSS_TOL,
        "{case}: f32 loss rel err {loss_err:.3e}"
    );
    assert!(
        failures.is_empty(),
        "{case}: f32 gradients off: {failures:?}"
    );
    assert!(
        loss16_err <= GOLDEN_BF16_LOSS_TOL,
        "{case}: bf16 loss rel err {loss16_err:.3e}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn golden_fixtures_on_the_gpu() {
    let Some(dev) = gpu_or_skip("golden_fixtures_on_the_gpu") else {
        return;
    };
    for case in CASES {
        golden_case(&dev, case);
    }
}

// ---------------------------------------------------------------------------------------------
// (b) GPU f32 against the CPU engine on random models

/// f32 against f32: only the summation orders differ (cuBLASLt vs matrixmultiply, kernel
/// reductions vs sequential loops), ~1e-6 relative; 1e-4 catches any wrong term.
const CPU_PARITY_TOL: f64 = 1e-4;

fn random_config(tied: bool, bias: bool) -> LlamaConfig {
    // Awkward sizes: nothing a multiple of a block, GQA 5:1 or 4:2, head_dim 16.
    let (heads, kv_heads, hidden) = if tied { (4, 2, 64) } else { (5, 1, 80) };
    let json = format!(
        r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":{hidden},
           "intermediate_size":150,"num_hidden_layers":2,"num_attention_heads":{heads},
           "num_key_value_heads":{kv_heads},"vocab_size":301,"max_position_embeddings":128,
           "rms_norm_eps":1e-5,"tie_word_embeddings":{tied},"attention_bias":{bias},
           "mlp_bias":{bias},"initializer_range":0.2,
           "rope_parameters":{{"rope_type":"default","rope_theta":10000.0}}}}"#
    );
    LlamaConfig::from_json_str(&json, "config.json").unwrap()
}

/// Randomises the norm weights (init makes them all 1, which would hide a transposed or
/// misindexed norm weight) and biases.
fn perturb_norms_and_biases(model: &mut LlamaForCausalLM, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for spec in model.params.specs.clone() {
        if spec.name.ends_with("norm.weight") || spec.name.ends_with(".bias") {
            let base = if spec.name.ends_with(".bias") {
                0.0
            } else {
                1.0
            };
            for x in &mut model.params.data[spec.range()] {
                *x = base + 0.25 * (rng.random::<f32>() * 2.0 - 1.0);
            }
        }
    }
}

fn cpu_parity_case(dev: &GpuDevice, tied: bool, bias: bool) {
    let label = format!("tied={tied} bias={bias}");
    let config = random_config(tied, bias);
    let mut model = LlamaForCausalLM::from_config(config.clone(), 11);
    perturb_norms_and_biases(&mut model, 12);
    let (batch, seq) = (3, 45);
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let (ids1, labels1) = random_batch(&mut rng, config.vocab_size, batch, seq);
    // The second micro-batch is shorter in batch than the capacity (a prefix of the arena).
    let (ids2, labels2) = random_batch(&mut rng, config.vocab_size, 2, seq);
    let denominator =
        (count_valid_targets(&labels1, batch, seq) + count_valid_targets(&labels2, 2, seq)) as f64;

    // CPU: logits of batch 1, then two accumulated micro-batches.
    let mut acts = Activations::new(&config, batch, seq, false);
    let cpu_logits = model
        .forward_logits(&ids1, batch, seq, &mut acts)
        .unwrap()
        .to_vec();
    let mut cpu_grads = vec![0.0f32; model.params.numel()];
    let c1 = model
        .forward_backward(
            &ids1,
            &labels1,
            batch,
            seq,
            Some(denominator),
            &mut acts,
            &mut cpu_grads,
        )
        .unwrap();
    let c2 = model
        .forward_backward(
            &ids2,
            &labels2,
            2,
            seq,
            Some(denominator),
            &mut acts,
            &mut cpu_grads,
        )
        .unwrap();

    let mut gpu = GpuLlama::new(dev, &model, batch, seq, DType::F32).unwrap();
    let gpu_logits = gpu.forward_logits(&ids1, batch, seq).unwrap();
    let g1 = gpu
        .forward_backward(&ids1, &labels1, batch, seq, Some(denominator))
        .unwrap();
    let g2 = gpu
        .forward_backward(&ids2, &labels2, 2, seq, Some(denominator))
        .unwrap();
    let gpu_grads = gpu.download_grads().unwrap();

    let logits_err = rel_err(&gpu_logits, &cpu_logits);
    let loss_err = |g: f64, c: f64| (g - c).abs() / c.abs();
    let (l1, l2) = (
        loss_err(g1.loss_sum, c1.loss_sum),
        loss_err(g2.loss_sum, c2.loss_sum),
    );
    let (worst, failures) = tensor_errors(&model, &gpu_grads, &cpu_grads, CPU_PARITY_TOL);
    report(&format!(
        "cpu parity {label}: logits rel err {logits_err:.3e}, loss_sum rel err {l1:.3e} / \
         {l2:.3e} (gpu {:.6} / {:.6}, cpu {:.6} / {:.6}), valid {} / {}, worst grad rel err \
         {:.3e} ({})",
        g1.loss_sum,
        g2.loss_sum,
        c1.loss_sum,
        c2.loss_sum,
        g1.valid_tokens,
        g2.valid_tokens,
        worst.0,
        worst.1
    ));
    assert_eq!(
        (g1.valid_tokens, g2.valid_tokens),
        (c1.valid_tokens, c2.valid_tokens)
    );
    assert!(
        logits_err <= CPU_PARITY_TOL,
        "{label}: logits rel err {logits_err:.3e}"
    );
    assert!(
        l1 <= CPU_PARITY_TOL && l2 <= CPU_PARITY_TOL,
        "{label}: loss {l1:.3e} {l2:.3e}"
    );
    assert!(failures.is_empty(), "{label}: gradients off: {failures:?}");

    // The fused AdamW step with clipping against the CPU optimizer, both on the CPU's
    // gradients (so any difference is the optimizer's), over two steps.
    let opt_config = AdamWConfig {
        lr: 1e-3,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let groups = gpu.default_groups(0.1);
    gpu.configure_optimizer(opt_config, groups.clone(), 1.0)
        .unwrap();
    let mut cpu_opt = AdamW::new(opt_config, groups, model.params.numel()).unwrap();
    let mut cpu_params = model.params.data.clone();
    for (step, scale) in [(1, 1.0f32), (2, 0.05)] {
        // Step 1 clips (norm > 1 with this init), step 2 (gradients scaled down) does not.
        let grads: Vec<f32> = cpu_grads.iter().map(|g| g * scale).collect();
        let mut clipped = grads.clone();
        let cpu_norm = tilearn_optim::clip_grad_norm(&mut clipped, 1.0);
        cpu_opt.step(&mut cpu_params, &clipped, 1e-3).unwrap();
        gpu.upload_grads(&grads).unwrap();
        gpu.step(1e-3).unwrap();
        let gpu_norm = gpu.last_grad_norm().unwrap();
        let gpu_params = gpu.download_params().unwrap();
        let max_diff = gpu_params
            .data
            .iter()
            .zip(&cpu_params)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, |m, d| if d.is_nan() || d > m { d } else { m });
        let norm_err = (gpu_norm - cpu_norm).abs() / cpu_norm;
        report(&format!(
            "adamw step {step} {label}: grad norm gpu {gpu_norm:.9} cpu {cpu_norm:.9} (rel err \
             {norm_err:.3e}), max |param diff| {max_diff:.3e} (lr 1e-3)"
        ));
        assert!(
            norm_err <= 1e-9,
            "{label}: grad norm rel err {norm_err:.3e}"
        );
        // The fused kernel performs the CPU's f32 operations in the same order: within an ulp
        // or two of parameters of magnitude < 1 (ulp <= 6e-8).
        assert!(
            max_diff <= 2e-7,
            "{label}: params after step {step} differ by {max_diff:.3e}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn f32_matches_the_cpu_engine_untied_with_bias() {
    let Some(dev) = gpu_or_skip("f32_matches_the_cpu_engine_untied_with_bias") else {
        return;
    };
    cpu_parity_case(&dev, false, true);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn f32_matches_the_cpu_engine_tied_without_bias() {
    let Some(dev) = gpu_or_skip("f32_matches_the_cpu_engine_tied_without_bias") else {
        return;
    };
    cpu_parity_case(&dev, true, false);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn bad_inputs_are_typed_errors() {
    let Some(dev) = gpu_or_skip("bad_inputs_are_typed_errors") else {
        return;
    };
    let config = random_config(true, false);
    let model = LlamaForCausalLM::from_config(config.clone(), 3);
    let mut gpu = GpuLlama::new(&dev, &model, 2, 8, DType::BF16).unwrap();
    let mut ids = vec![1u32; 16];
    let labels = vec![1i32; 16];
    ids[9] = 301;
    let err = gpu.forward_backward(&ids, &labels, 2, 8, None).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::Ops(OpsError::TokenOutOfRange {
                id: 301,
                position: 9,
                ..
            })
        ),
        "{err}"
    );
    ids[9] = 1;
    let mut bad_labels = labels.clone();
    bad_labels[5] = 400;
    let err = gpu
        .forward_backward(&ids, &bad_labels, 2, 8, None)
        .unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::Ops(OpsError::LabelOutOfRange {
                label: 400,
                position: 4,
                ..
            })
        ),
        "{err}"
    );
    let err = gpu
        .forward_backward(&[1; 24], &[1; 24], 3, 8, None)
        .unwrap_err();
    assert!(matches!(err, EngineError::InvalidArgument { .. }), "{err}");
    let err = gpu.step(1e-3).unwrap_err();
    assert!(matches!(err, EngineError::InvalidArgument { .. }), "{err}");
    // Nothing above broke the model: a valid call still works and gives a finite loss.
    let stats = gpu.forward_backward(&ids, &labels, 2, 8, None).unwrap();
    report(&format!(
        "bad inputs: typed errors; a valid call afterwards gives loss {:.4} over {} targets; {:?}",
        stats.mean(),
        stats.valid_tokens,
        gpu.memory()
    ));
    assert!(stats.mean().is_finite() && stats.valid_tokens == 14);
}

// ---------------------------------------------------------------------------------------------
// (c) 200 training steps, GPU bf16 against CPU f32

const TRAIN_STEPS: u64 = 200;
/// Mean |loss_gpu − loss_cpu| over the last 50 steps. bf16 rounding moves each step's loss by a
/// few 1e-3 and, at this learning rate (3e-3) on a 0.8M-parameter model, the trajectories drift
/// apart mid-run and come back together as the cosine schedule decays: on the H200 (2026-11-29)
/// the gap peaked at 0.33 nats near step 100 and averaged 0.055 over the last 50 steps (final
/// loss 0.71 f32 vs 0.78 bf16). 0.1 nats stays far below the learning signal (> 4.5 nats here)
/// and catches a broken bf16 path, which does not converge at all. The f32 GPU path is held to
/// the CPU engine exactly by the parity tests above.
const CURVE_TOL: f64 = 0.1;

/// The embedded default model of `tilearn train` (crates/tilearn-llm/src/default_config.json):
/// `heads` 4 (head_dim 32: the cuBLASLt attention path), or 2 (head_dim 64: the flash kernels).
fn default_config(heads: usize) -> LlamaConfig {
    let json = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":128,
        "intermediate_size":352,"num_hidden_layers":4,"num_attention_heads":HEADS,
        "num_key_value_heads":2,"vocab_size":257,"max_position_embeddings":512,
        "rms_norm_eps":1e-5,"rope_parameters":{"rope_type":"default","rope_theta":10000.0},
        "tie_word_embeddings":true,"attention_bias":false,"mlp_bias":false,
        "initializer_range":0.02,"eos_token_id":256,"dtype":"float32"}"#;
    LlamaConfig::from_json_str(&json.replace("HEADS", &heads.to_string()), "config.json").unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn bf16_training_follows_the_cpu_loss_curve() {
    let Some(dev) = gpu_or_skip("bf16_training_follows_the_cpu_loss_curve") else {
        return;
    };
    // Both attention paths: head_dim 32 (cuBLASLt GEMMs) and head_dim 64 (flash kernels).
    for heads in [4, 2] {
        training_curve_case(&dev, heads);
    }
}

fn training_curve_case(dev: &GpuDevice, heads: usize) {
    let tmp = tempfile::tempdir().unwrap();
    prepare_embedded_default(tmp.path(), 0, 4000).unwrap();
    let dataset = TokenDataset::open(tmp.path()).unwrap();
    let (batch, seq) = (8, 128);
    let mut loader = DataLoader::new(dataset, batch, seq, 42, LoaderState::default()).unwrap();

    let config = default_config(heads);
    let mut cpu_model = LlamaForCausalLM::from_config(config.clone(), 42);
    let opt_config = AdamWConfig {
        lr: 3e-3,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let schedule = LrSchedule {
        kind: SchedulerType::Cosine,
        base_lr: 3e-3,
        warmup_steps: 20,
        total_steps: TRAIN_STEPS,
    };
    let mut gpu = GpuLlama::new(dev, &cpu_model, batch, seq, DType::BF16).unwrap();
    assert_eq!(
        gpu.flash_attention(),
        heads == 2,
        "attention path of the {heads}-head model"
    );
    let groups = gpu.default_groups(0.0);
    gpu.configure_optimizer(opt_config, groups.clone(), 1.0)
        .unwrap();
    let mut cpu_opt = AdamW::new(opt_config, groups, cpu_model.params.numel()).unwrap();
    let mut acts = Activations::new(&config, batch, seq, false);
    let mut cpu_grads = vec![0.0f32; cpu_model.params.numel()];

    let (mut cpu_curve, mut gpu_curve) = (Vec::new(), Vec::new());
    let mut gpu_secs = 0.0;
    for step in 0..TRAIN_STEPS {
        let b = loader.next_batch().unwrap();
        let lr = schedule.lr_at(step);

        cpu_grads.iter_mut().for_each(|g| *g = 0.0);
        let c = cpu_model
            .forward_backward(
                &b.input_ids,
                &b.labels,
                batch,
                seq,
                None,
                &mut acts,
                &mut cpu_grads,
            )
            .unwrap();
        tilearn_optim::clip_grad_norm(&mut cpu_grads, 1.0);
        cpu_opt
            .step(&mut cpu_model.params.data, &cpu_grads, lr)
            .unwrap();

        let t = std::time::Instant::now();
        gpu.zero_grad().unwrap();
        let g = gpu
            .forward_backward(&b.input_ids, &b.labels, batch, seq, None)
            .unwrap();
        gpu.step(lr).unwrap();
        gpu_secs += t.elapsed().as_secs_f64();

        cpu_curve.push(c.mean());
        gpu_curve.push(g.mean());
        if step % 20 == 0 || step + 1 == TRAIN_STEPS {
            report(&format!(
                "heads {heads}: train step {step:3}: lr {lr:.2e} loss cpu {:.4} gpu-bf16 {:.4}",
                c.mean(),
                g.mean()
            ));
        }
    }
    let n = TRAIN_STEPS as usize;
    let tail = n - 50;
    let mean_abs_diff = (tail..n)
        .map(|i| (cpu_curve[i] - gpu_curve[i]).abs())
        .sum::<f64>()
        / 50.0;
    let last10 = |c: &[f64]| c[n - 10..].iter().sum::<f64>() / 10.0;
    let (start_cpu, start_gpu) = (cpu_curve[0], gpu_curve[0]);
    let (end_cpu, end_gpu) = (last10(&cpu_curve), last10(&gpu_curve));
    let mem = gpu.memory();
    report(&format!(
        "heads {heads} (flash {}): training: start loss cpu {start_cpu:.4} gpu {start_gpu:.4}; mean of last 10 cpu \
         {end_cpu:.4} gpu {end_gpu:.4}; mean |diff| over the last 50 steps {mean_abs_diff:.4} \
         (tol {CURVE_TOL}); gpu {:.1} ms/step (incl. host sync); own device memory {:.1} MiB, \
         peak over the start {:.1} MiB",
        gpu.flash_attention(),
        gpu_secs * 1e3 / TRAIN_STEPS as f64,
        mem.own_bytes as f64 / 1048576.0,
        mem.peak_bytes() as f64 / 1048576.0
    ));
    assert!(
        gpu_curve.iter().all(|l| l.is_finite()),
        "non-finite GPU loss: {gpu_curve:?}"
    );
    assert!(
        mean_abs_diff <= CURVE_TOL,
        "loss curves diverge: mean |diff| {mean_abs_diff:.4} over the last 50 steps"
    );
    assert!(
        start_cpu - end_cpu > 2.0 && start_gpu - end_gpu > 2.0,
        "did not learn: cpu {start_cpu:.3} -> {end_cpu:.3}, gpu {start_gpu:.3} -> {end_gpu:.3}"
    );
    // The downloaded master weights are what the optimizer produced (finite, moved).
    let params = gpu.download_params().unwrap();
    assert!(params.data.iter().all(|x| x.is_finite()));
}

/// Gradient checkpointing recomputes each block's forward in the backward with the same
/// deterministic kernels, so a checkpointed model must give the plain model's logits, loss and
/// gradients bit for bit (f32 and bf16, two accumulated micro-batches, the second shorter), in
/// less activation memory.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gradient_checkpointing_is_bit_identical_and_smaller() {
    let Some(dev) = gpu_or_skip("gradient_checkpointing_is_bit_identical_and_smaller") else {
        return;
    };
    let config = random_config(false, true);
    let mut model = LlamaForCausalLM::from_config(config.clone(), 51);
    perturb_norms_and_biases(&mut model, 52);
    let (batch, seq) = (3, 45);
    let mut rng = ChaCha8Rng::seed_from_u64(53);
    let (ids1, labels1) = random_batch(&mut rng, config.vocab_size, batch, seq);
    let (ids2, labels2) = random_batch(&mut rng, config.vocab_size, 2, seq);
    for precision in [DType::F32, DType::BF16] {
        let run = |checkpointing: bool| {
            let mut gpu =
                GpuLlama::with_options(&dev, &model, batch, seq, &[precision], checkpointing)
                    .unwrap();
            // A bit-for-bit comparison needs the deterministic attention backward (head_dim 16
            // runs the cuBLASLt path, deterministic anyway; this keeps it so at head_dim 64).
            gpu.set_deterministic(true).unwrap();
            assert_eq!(gpu.gradient_checkpointing(), checkpointing);
            let logits = gpu.forward_logits(&ids1, batch, seq).unwrap();
            let a = gpu
                .forward_backward(&ids1, &labels1, batch, seq, Some(300.0))
                .unwrap();
            let b = gpu
                .forward_backward(&ids2, &labels2, 2, seq, Some(300.0))
                .unwrap();
            let grads = gpu.download_grads().unwrap();
            (logits, a.loss_sum, b.loss_sum, grads, gpu.memory())
        };
        let (logits, l1, l2, grads, plain_mem) = run(false);
        let (logits_c, l1_c, l2_c, grads_c, ckpt_mem) = run(true);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let differing = grads
            .iter()
            .zip(&grads_c)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        report(&format!(
            "checkpointing {precision}: loss sums {l1:.9}/{l2:.9} vs {l1_c:.9}/{l2_c:.9}, {differing} \
             of {} gradients differ; activation memory {} -> {} bytes",
            grads.len(),
            plain_mem.activation_bytes,
            ckpt_mem.activation_bytes
        ));
        assert_eq!(bits(&logits), bits(&logits_c), "{precision}: logits differ");
        assert_eq!(
            (l1.to_bits(), l2.to_bits()),
            (l1_c.to_bits(), l2_c.to_bits())
        );
        assert_eq!(differing, 0, "{precision}: gradients differ");
        assert!(ckpt_mem.activation_bytes < plain_mem.activation_bytes);
    }
}
