//! Checkpoint offload (`--offload-checkpoints`: gradient checkpointing's layer inputs in
//! page-locked host memory, a three-slab ring on the device, copies on a second stream)
//! against checkpointing with every layer input on the device, from the same seed.
//!
//! Expected agreement and why: the copies move bytes unchanged and every kernel runs in the
//! same order on the same values (the ring changes where a layer input lives, not what it
//! holds), and the steps are deterministic (`set_deterministic(true)`), so losses, gradient
//! norms, weights and AdamW moments are the same bits, also with the per-layer weight copy
//! and with an evaluation forward between steps (a forward-only pass writes the ring too).
//! Six layers, so the backward brings boundaries 0..=3 and the attention outputs of layers
//! 0..=3 back from the host (the last three boundaries and two attention outputs stay in their
//! rings), and its recomputation skips the attention forward for every layer. A control with another learning rate must differ. The arena shrinks by the
//! boundaries the ring does not hold.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

mod support;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use support::{differing_bits, gpu_or_skip, random_batch, report};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::cuda_graphs::{CudaGraphs, StepConditions};
use tilearn_engine::gpu::GpuLlama;
use tilearn_engine::lce_chunk::LceChunk;
use tilearn_engine::memory_mode::MemoryMode;
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_ops::DType;
use tilearn_ops::cuda::GpuDevice;
use tilearn_optim::AdamWConfig;

const LAYERS: usize = 6;
const HIDDEN: usize = 128;

/// head_dim 64 (the flash kernels), untied head, chunks of 64 tokens in the loss head.
fn config() -> LlamaConfig {
    let json = format!(
        r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":{HIDDEN},
        "intermediate_size":352,"num_hidden_layers":{LAYERS},"num_attention_heads":2,
        "num_key_value_heads":1,"vocab_size":997,"max_position_embeddings":1024,
        "rms_norm_eps":1e-5,"tie_word_embeddings":false,"initializer_range":0.2}}"#
    );
    LlamaConfig::from_json_str(&json, "config.json").unwrap()
}

const BATCH: usize = 2;
const SEQ: usize = 128;
const STEPS: usize = 5;

#[derive(Clone, Copy, Debug)]
struct Setup {
    offload: bool,
    per_layer: bool,
    lr_scale: f32,
}

struct Run {
    losses: Vec<f64>,
    eval_losses: Vec<f64>,
    norms: Vec<f64>,
    params: Vec<f32>,
    moments: (Vec<f32>, Vec<f32>),
    activation_bytes: usize,
}

fn build(dev: &GpuDevice, checkpointing: bool) -> GpuLlama {
    let model = LlamaForCausalLM::from_config(config(), 21);
    GpuLlama::with_memory(
        dev,
        &model,
        BATCH,
        SEQ,
        &[DType::BF16],
        checkpointing,
        LceChunk::from_tokens(64),
        MemoryMode::Default,
    )
    .unwrap()
}

fn train(dev: &GpuDevice, s: Setup) -> Run {
    let mut gpu = build(dev, true);
    gpu.set_deterministic(true).unwrap();
    gpu.set_per_layer_weights(s.per_layer).unwrap();
    gpu.set_offload_checkpoints(s.offload).unwrap();
    assert_eq!(gpu.offload_checkpoints(), s.offload);
    let groups = gpu.default_groups(0.1);
    gpu.configure_optimizer(AdamWConfig::default(), groups, 1.0)
        .unwrap();
    // Asked for graphs; an offloading model stays eager.
    gpu.set_cuda_graphs(CudaGraphs::Auto);
    if s.offload {
        assert_eq!(gpu.cuda_graphs(), CudaGraphs::Off);
    } else {
        gpu.set_cuda_graphs(CudaGraphs::Off);
    }
    let vocab = config().vocab_size;
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let (mut losses, mut eval_losses, mut norms) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..STEPS {
        let (ids, labels) = random_batch(&mut rng, vocab, BATCH, SEQ);
        let lr = s.lr_scale * 2e-3 / (1.0 + step as f32);
        let out = gpu
            .train_step(
                &ids,
                &labels,
                BATCH,
                SEQ,
                None,
                lr,
                StepConditions::single(),
            )
            .unwrap();
        losses.push(out.loss.mean());
        norms.push(out.grad_norm);
        let (eval_ids, eval_labels) = random_batch(&mut rng, vocab, BATCH, SEQ);
        let eval = gpu
            .forward_loss(&eval_ids, &eval_labels, BATCH, SEQ)
            .unwrap();
        eval_losses.push(eval.mean());
    }
    Run {
        losses,
        eval_losses,
        norms,
        params: gpu.download_params().unwrap().data,
        moments: gpu.download_optimizer_moments().unwrap(),
        activation_bytes: gpu.memory().activation_bytes,
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn offloaded_checkpoints_give_the_same_bits() {
    let Some(dev) = gpu_or_skip("offloaded_checkpoints_give_the_same_bits") else {
        return;
    };
    let on_device = train(
        &dev,
        Setup {
            offload: false,
            per_layer: false,
            lr_scale: 1.0,
        },
    );
    report(&format!("on device: losses {:?}", on_device.losses));
    for per_layer in [false, true] {
        let what = format!("offload, per-layer copy {per_layer}");
        let run = train(
            &dev,
            Setup {
                offload: true,
                per_layer,
                lr_scale: 1.0,
            },
        );
        let counts = (
            differing_bits(&run.losses, &on_device.losses),
            differing_bits(&run.eval_losses, &on_device.eval_losses),
            differing_bits(&run.norms, &on_device.norms),
            differing_bits(&run.params, &on_device.params),
            differing_bits(&run.moments.0, &on_device.moments.0),
            differing_bits(&run.moments.1, &on_device.moments.1),
        );
        report(&format!(
            "{what}: losses {:?}; differing (losses, eval losses, norms, weights, exp_avg, \
             exp_avg_sq): {counts:?}; arena {} bytes vs {}",
            run.losses, run.activation_bytes, on_device.activation_bytes
        ));
        assert_eq!(counts, (0, 0, 0, 0, 0, 0), "{what}: not bit-identical");
        // The ring holds 3 of the LAYERS + 1 boundaries ([N, C] bf16 each, 128-byte aligned);
        // the attention ring adds one [N, Hq·D] bf16 output and one [B, Hq, T] f32 lse.
        let n = BATCH * SEQ;
        let saved = (LAYERS + 1 - 3) * n * HIDDEN * 2 - n * HIDDEN * 2 - n * 2 * 4;
        assert_eq!(
            on_device.activation_bytes - run.activation_bytes,
            saved,
            "{what}: arena shrinks by the boundaries kept on the host"
        );
    }
    let control = train(
        &dev,
        Setup {
            offload: true,
            per_layer: false,
            lr_scale: 1.5,
        },
    );
    let d = differing_bits(&control.params, &on_device.params);
    report(&format!("control (lr x1.5): {d} weights differ"));
    assert!(d > control.params.len() / 2, "the control must differ");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn offload_needs_checkpointing_and_can_be_turned_off() {
    let Some(dev) = gpu_or_skip("offload_needs_checkpointing_and_can_be_turned_off") else {
        return;
    };
    let mut plain = build(&dev, false);
    let err = plain.set_offload_checkpoints(true).unwrap_err().to_string();
    assert!(err.contains("--gradient-checkpointing"), "{err}");
    assert!(!plain.offload_checkpoints());
    let mut gpu = build(&dev, true);
    let before = gpu.memory().activation_bytes;
    // Boundaries, attention outputs (Hq·D = HIDDEN here) and their f32 lse (2 heads): what
    // `--offload-checkpoints auto` weighs before asking, and what it then holds.
    let n = BATCH * SEQ;
    let host = (LAYERS + 1) * n * HIDDEN * 2 + LAYERS * n * (HIDDEN * 2 + 2 * 4);
    assert_eq!(gpu.checkpoint_offload_host_bytes(), host);
    gpu.set_offload_checkpoints(true).unwrap();
    assert_eq!(gpu.offloaded_checkpoint_bytes(), host);
    gpu.set_offload_checkpoints(false).unwrap();
    assert_eq!(gpu.memory().activation_bytes, before);
    assert_eq!(gpu.offloaded_checkpoint_bytes(), 0);
}
