//! The lean memory mode (`--memory lean`: fp32 master weights and AdamW moments in host memory,
//! stepped on the CPU; the MLP activation recomputed in the backward) against the default mode
//! from the same seed, bf16, with and without gradient checkpointing.
//!
//! Expected agreement and why: the first step's forward and backward read the same bf16
//! weights (the host cast and the device cast both round to nearest even) and the recomputed
//! `silu(gate) * up` comes from the same deterministic kernel, so the first loss is the same
//! bits. The host AdamW is the CPU reference that the fused kernel reproduces operation for
//! operation; the one difference is the f64 gradient norm's summation order (device blocks vs
//! the host's fixed chunks), which reaches the update only through the f32 clip coefficient.
//! Bound: losses, norms, weights and moments within 1e-6 relative over the run (measured
//! differences are printed). A control with another learning rate must differ by more.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

mod support;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use support::{gpu_or_skip, random_batch, rel_err, report};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::cuda_graphs::{CudaGraphs, StepConditions};
use tilearn_engine::gpu::GpuLlama;
use tilearn_engine::lce_chunk::LceChunk;
use tilearn_engine::memory_mode::MemoryMode;
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_ops::DType;
use tilearn_ops::cuda::GpuDevice;
use tilearn_optim::AdamWConfig;

/// head_dim 64 (the flash kernels), an untied head, chunks of 64 tokens in the loss head.
fn config() -> LlamaConfig {
    let json = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":128,
        "intermediate_size":352,"num_hidden_layers":3,"num_attention_heads":2,
        "num_key_value_heads":1,"vocab_size":997,"max_position_embeddings":1024,
        "rms_norm_eps":1e-5,"tie_word_embeddings":false,"initializer_range":0.2}"#;
    LlamaConfig::from_json_str(json, "config.json").unwrap()
}

const BATCH: usize = 3;
const SEQ: usize = 64;
const STEPS: usize = 8;
/// Below the measured norms (printed), so clipping is active at every step.
const MAX_GRAD_NORM: f64 = 0.05;
/// See the module docs.
const BOUND: f64 = 1e-6;

fn lr_at(step: usize, scale: f32) -> f32 {
    scale * 2e-3 / (1.0 + step as f32)
}

struct Run {
    losses: Vec<f64>,
    norms: Vec<f64>,
    params: Vec<f32>,
    moments: (Vec<f32>, Vec<f32>),
    own_bytes: usize,
}

/// Deterministic (`GpuLlama::set_deterministic`): the one-pass flash backward's atomic dQ sums
/// would differ between the two runs by more than the bound.
fn build(dev: &GpuDevice, checkpointing: bool, memory: MemoryMode) -> GpuLlama {
    let model = LlamaForCausalLM::from_config(config(), 5);
    let mut gpu = GpuLlama::with_memory(
        dev,
        &model,
        BATCH,
        SEQ,
        &[DType::BF16],
        checkpointing,
        LceChunk::from_tokens(64),
        memory,
    )
    .unwrap();
    gpu.set_deterministic(true).unwrap();
    gpu
}

fn train(dev: &GpuDevice, checkpointing: bool, memory: MemoryMode, lr_scale: f32) -> Run {
    let mut gpu = build(dev, checkpointing, memory);
    let groups = gpu.default_groups(0.1);
    gpu.configure_optimizer(AdamWConfig::default(), groups, MAX_GRAD_NORM)
        .unwrap();
    gpu.set_cuda_graphs(CudaGraphs::Off);
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (ids, labels) = random_batch(&mut rng, config().vocab_size, BATCH, SEQ);
        let out = gpu
            .train_step(
                &ids,
                &labels,
                BATCH,
                SEQ,
                None,
                lr_at(step, lr_scale),
                StepConditions::single(),
            )
            .unwrap();
        losses.push(out.loss.mean());
        norms.push(out.grad_norm);
    }
    let own_bytes = gpu.memory().own_bytes;
    gpu.stage_offloaded_master().unwrap();
    let params = gpu.download_params().unwrap().data;
    let moments = match gpu.host_optimizer() {
        Some(host) => {
            // The staged weights are the host master's.
            assert_eq!(host.master(), &params[..], "staged master");
            (
                host.adamw().exp_avg().to_vec(),
                host.adamw().exp_avg_sq().to_vec(),
            )
        }
        None => gpu.download_optimizer_moments().unwrap(),
    };
    Run {
        losses,
        norms,
        params,
        moments,
        own_bytes,
    }
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
}

fn check(dev: &GpuDevice, checkpointing: bool) {
    let what = format!("bf16 checkpointing={checkpointing}");
    let default = train(dev, checkpointing, MemoryMode::Default, 1.0);
    let lean = train(dev, checkpointing, MemoryMode::Lean, 1.0);
    let control = train(dev, checkpointing, MemoryMode::Lean, 1.5);
    report(&format!("{what}: default losses {:?}", default.losses));
    report(&format!("{what}: lean losses    {:?}", lean.losses));
    report(&format!(
        "{what}: norms {:?} (clip at {MAX_GRAD_NORM})",
        lean.norms
    ));
    assert!(
        lean.norms.iter().all(|&n| n > MAX_GRAD_NORM),
        "{what}: clipping must be active"
    );
    assert_eq!(
        default.losses[0].to_bits(),
        lean.losses[0].to_bits(),
        "{what}: the first loss reads the same bf16 weights"
    );
    let loss_err = (0..STEPS)
        .map(|i| rel(lean.losses[i], default.losses[i]))
        .fold(0.0, f64::max);
    let norm_err = (0..STEPS)
        .map(|i| rel(lean.norms[i], default.norms[i]))
        .fold(0.0, f64::max);
    let p = rel_err(&lean.params, &default.params);
    let m = rel_err(&lean.moments.0, &default.moments.0);
    let v = rel_err(&lean.moments.1, &default.moments.1);
    let differing = lean
        .params
        .iter()
        .zip(&default.params)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    let control_err = rel_err(&control.params, &default.params);
    report(&format!(
        "{what}: rel err loss {loss_err:.2e} norm {norm_err:.2e} weights {p:.2e} \
         ({differing} of {} differ in bits) exp_avg {m:.2e} exp_avg_sq {v:.2e}; control \
         (lr x1.5) weights {control_err:.2e}",
        lean.params.len()
    ));
    for (name, e) in [
        ("loss", loss_err),
        ("norm", norm_err),
        ("weights", p),
        ("exp_avg", m),
        ("exp_avg_sq", v),
    ] {
        assert!(e <= BOUND, "{what}: {name} rel err {e:.3e} > {BOUND:e}");
    }
    assert!(
        control_err > 100.0 * BOUND,
        "{what}: the control must differ"
    );
    // The device holds no master weights (one element), no moments and (without
    // checkpointing, which recomputes it in both modes) no per-layer MLP activation: at least
    // 12 bytes a parameter and layers x tokens x intermediate bf16 less.
    let c = config();
    let numel = lean.params.len();
    let act = if checkpointing {
        0
    } else {
        c.num_hidden_layers * BATCH * SEQ * c.intermediate_size * 2
    };
    let saved = 4 * (numel - 1) + 8 * numel + act;
    report(&format!(
        "{what}: device bytes default {} lean {} (at least {saved} less expected)",
        default.own_bytes, lean.own_bytes
    ));
    assert!(
        default.own_bytes >= lean.own_bytes + saved,
        "{what}: lean holds {} bytes, default {}",
        lean.own_bytes,
        default.own_bytes
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn lean_steps_track_default_steps() {
    let Some(dev) = gpu_or_skip("lean_steps_track_default_steps") else {
        return;
    };
    check(&dev, false);
    check(&dev, true);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn lean_refuses_what_it_does_not_support() {
    let Some(dev) = gpu_or_skip("lean_refuses_what_it_does_not_support") else {
        return;
    };
    let model = LlamaForCausalLM::from_config(config(), 5);
    for precisions in [
        vec![DType::F32],
        vec![DType::F16],
        vec![DType::BF16, DType::F32],
    ] {
        let err = GpuLlama::with_memory(
            &dev,
            &model,
            BATCH,
            SEQ,
            &precisions,
            false,
            LceChunk::Auto,
            MemoryMode::Lean,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("bf16 only"), "{precisions:?}: {err}");
    }
    let mut gpu = build(&dev, false, MemoryMode::Lean);
    let numel = gpu.download_grads().unwrap().len();
    let groups = gpu.default_groups(0.0);
    let err = gpu
        .configure_optimizer_for(AdamWConfig::default(), groups, 1.0, 0..numel / 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("ZeRO"), "{err}");
    gpu.set_cuda_graphs(CudaGraphs::On);
    assert_eq!(gpu.cuda_graphs(), CudaGraphs::Off, "lean steps stay eager");
    let err = gpu.step(1e-3).unwrap_err().to_string();
    assert!(err.contains("configure_optimizer"), "{err}");
}
