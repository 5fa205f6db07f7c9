//! The MLP in chunks of tokens under gradient checkpointing (`crate::mlp_chunk`, `gpu/mlp.rs`):
//! the forward runs `gate`/`up`/`down` chunk by chunk, the backward recomputes each chunk's
//! `gate` and `up` from the kept `post_attention_layernorm` output and adds each chunk's weight
//! gradients in turn.
//!
//! Expected agreement and why: in f32 every value is the whole MLP's up to the order in which
//! the products sum over tokens (the weight gradients add five chunk products instead of one),
//! so against the CPU reference the chunked run stays within the engine's CPU parity bound
//! (1e-4 relative), and against the unchunked device run within 1e-5. In bf16 the products of
//! a shorter M may round differently (another cuBLASLt algorithm), a bf16 ulp here and there:
//! 1e-3 on the loss and 2e-2 (‖Δ‖ / ‖g‖) on the gradients. A dropped or doubled chunk moves the
//! gradients by about a fifth, far outside every bound. The arena shrinks by exactly its
//! scratch's difference (five `[N, I]` buffers against the largest of the logits chunk, five
//! `[M, I]` and the attention gradients).
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

mod support;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use support::{gpu_or_skip, random_batch, rel_err, report};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::gpu::GpuLlama;
use tilearn_engine::model::{Activations, LlamaForCausalLM};
use tilearn_ops::DType;

const BATCH: usize = 3;
const SEQ: usize = 64;
const INTER: usize = 352;
/// 192 tokens in chunks of 40: four full chunks and a last one of 32.
const CHUNK: usize = 40;

/// head_dim 64 (the flash kernels in bf16), three layers, SwiGLU.
fn config() -> LlamaConfig {
    let json = format!(
        r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":128,
        "intermediate_size":{INTER},"num_hidden_layers":3,"num_attention_heads":2,
        "num_key_value_heads":1,"vocab_size":997,"max_position_embeddings":1024,
        "rms_norm_eps":1e-5,"initializer_range":0.2}}"#
    );
    LlamaConfig::from_json_str(&json, "config.json").unwrap()
}

struct Run {
    loss_sums: [f64; 2],
    grads: Vec<f32>,
    activation_bytes: usize,
}

fn run(
    dev: &tilearn_ops::cuda::GpuDevice,
    model: &LlamaForCausalLM,
    precision: DType,
    chunk: Option<usize>,
    batches: &[(Vec<u32>, Vec<i32>, usize)],
) -> Run {
    let mut gpu =
        GpuLlama::with_options(dev, model, BATCH, SEQ, &[DType::BF16, DType::F32], true).unwrap();
    gpu.set_deterministic(true).unwrap();
    gpu.set_precision(precision).unwrap();
    if let Some(rows) = chunk {
        gpu.set_mlp_chunk_tokens(rows).unwrap();
    }
    let expected = chunk.unwrap_or(BATCH * SEQ);
    assert_eq!(gpu.mlp_chunk_tokens(), expected);
    let mut loss_sums = [0.0; 2];
    for (k, (ids, labels, batch)) in batches.iter().enumerate() {
        loss_sums[k] = gpu
            .forward_backward(ids, labels, *batch, SEQ, Some(500.0))
            .unwrap()
            .loss_sum;
    }
    Run {
        loss_sums,
        grads: gpu.download_grads().unwrap(),
        activation_bytes: gpu.memory().activation_bytes,
    }
}

/// Two accumulated micro-batches, the second shorter (a prefix of the arena: 128 tokens in
/// chunks of 40, the last of 8).
fn batches(vocab: usize) -> Vec<(Vec<u32>, Vec<i32>, usize)> {
    let mut rng = ChaCha8Rng::seed_from_u64(71);
    [BATCH, 2]
        .into_iter()
        .map(|b| {
            let (ids, labels) = random_batch(&mut rng, vocab, b, SEQ);
            (ids, labels, b)
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn chunked_mlp_matches_the_cpu_and_the_whole_mlp() {
    let Some(dev) = gpu_or_skip("chunked_mlp_matches_the_cpu_and_the_whole_mlp") else {
        return;
    };
    let config = config();
    let model = LlamaForCausalLM::from_config(config.clone(), 5);
    let data = batches(config.vocab_size);

    // The CPU reference (f32): the same two micro-batches accumulated.
    let mut acts = Activations::new(&config, BATCH, SEQ, false);
    let mut cpu_grads = vec![0.0f32; model.params.numel()];
    let mut cpu_losses = [0.0; 2];
    for (k, (ids, labels, b)) in data.iter().enumerate() {
        cpu_losses[k] = model
            .forward_backward(ids, labels, *b, SEQ, Some(500.0), &mut acts, &mut cpu_grads)
            .unwrap()
            .loss_sum;
    }

    for precision in [DType::F32, DType::BF16] {
        let whole = run(&dev, &model, precision, None, &data);
        let chunked = run(&dev, &model, precision, Some(CHUNK), &data);
        let loss_err = (0..2)
            .map(|k| (chunked.loss_sums[k] - whole.loss_sums[k]).abs() / whole.loss_sums[k])
            .fold(0.0, f64::max);
        let grad_err = rel_err(&chunked.grads, &whole.grads);
        let cpu_loss_err = (0..2)
            .map(|k| (chunked.loss_sums[k] - cpu_losses[k]).abs() / cpu_losses[k])
            .fold(0.0, f64::max);
        let cpu_grad_err = rel_err(&chunked.grads, &cpu_grads);
        let saved = whole.activation_bytes - chunked.activation_bytes;
        report(&format!(
            "mlp chunks of {CHUNK} ({precision}): vs whole MLP loss {loss_err:.3e}, grads \
             {grad_err:.3e}; vs CPU loss {cpu_loss_err:.3e}, grads {cpu_grad_err:.3e}; arena \
             {} -> {} bytes",
            whole.activation_bytes, chunked.activation_bytes
        ));
        let (loss_tol, grad_tol) = match precision {
            DType::F32 => (1e-6, 1e-5),
            _ => (1e-3, 2e-2),
        };
        assert!(loss_err <= loss_tol, "{precision}: loss {loss_err:e}");
        assert!(grad_err <= grad_tol, "{precision}: gradients {grad_err:e}");
        if precision == DType::F32 {
            assert!(cpu_loss_err <= 1e-4, "loss vs CPU {cpu_loss_err:e}");
            assert!(cpu_grad_err <= 1e-4, "gradients vs CPU {cpu_grad_err:e}");
        }
        // The scratch holds the largest of: the logits (one chunk of every token here), an
        // MLP chunk's gate, up, dgate, dup, dact, and the attention gradients (dq and datt of
        // 2 × 64 columns, dk and dv of 64); sized for the widest precision built (f32).
        let n = BATCH * SEQ;
        let scratch = |m: usize| (5 * m * INTER).max(n * 997).max(2 * n * (128 + 64));
        assert_eq!(saved, (scratch(n) - scratch(CHUNK)) * 4);
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn mlp_chunks_need_checkpointing() {
    let Some(dev) = gpu_or_skip("mlp_chunks_need_checkpointing") else {
        return;
    };
    let model = LlamaForCausalLM::from_config(config(), 6);
    let mut gpu = GpuLlama::with_options(&dev, &model, 2, 32, &[DType::BF16], false).unwrap();
    let err = gpu.set_mlp_chunk_tokens(16).unwrap_err().to_string();
    assert!(err.contains("gradient checkpointing"), "{err}");
    assert_eq!(gpu.mlp_chunk_tokens(), 64);
    // With checkpointing, a chunk larger than the capacity is the whole MLP.
    let mut gpu = GpuLlama::with_options(&dev, &model, 2, 32, &[DType::BF16], true).unwrap();
    gpu.set_mlp_chunk_tokens(1 << 20).unwrap();
    assert_eq!(gpu.mlp_chunk_tokens(), 64);
}
