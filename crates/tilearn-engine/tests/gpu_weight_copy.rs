//! The per-layer 16-bit weight copy (`--weight-copy per-layer`: each decoder layer cast from
//! the fp32 master weights just before its forward and its backward) against the whole copy
//! (rewritten by the fused optimizer), from the same seed.
//!
//! Expected agreement and why: both copies come from the same round-to-nearest cast of the
//! same master weights (the optimizer's fused copy and `cast_f32_to_bf16` / `_f16` round
//! alike), and every kernel of the step is deterministic under `set_deterministic(true)`, so
//! the runs are the same bits: losses, gradient norms, weights and AdamW moments, with and
//! without gradient checkpointing, tied and untied heads, across an fp32 period (which reads
//! the master weights) and under CUDA graph replay. A control with another learning rate must
//! differ. The device holds the whole copy's bytes less all but one layer's span (the norms stay).
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

/// head_dim 64 (the flash kernels), four layers, chunks of 64 tokens in the loss head.
fn config(tied: bool) -> LlamaConfig {
    let json = format!(
        r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":{HIDDEN},
        "intermediate_size":352,"num_hidden_layers":{LAYERS},"num_attention_heads":2,
        "num_key_value_heads":1,"vocab_size":{VOCAB},"max_position_embeddings":1024,
        "rms_norm_eps":1e-5,"tie_word_embeddings":{tied},"initializer_range":0.2}}"#
    );
    LlamaConfig::from_json_str(&json, "config.json").unwrap()
}

const LAYERS: usize = 4;
const HIDDEN: usize = 128;
const VOCAB: usize = 997;
/// One layer's parameters: q and o 128 × 128, k and v 64 × 128, gate/up/down 352 × 128, two
/// norms of 128.
const PER_LAYER: usize = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 352 * 128 + 2 * HIDDEN;
const BATCH: usize = 3;
const SEQ: usize = 64;
const STEPS: usize = 6;
/// Step 3 runs in fp32 (the master weights themselves), the others in bf16.
const FP32_STEP: usize = 3;

#[derive(Clone, Copy, Debug)]
struct Setup {
    tied: bool,
    checkpointing: bool,
    per_layer: bool,
    graphs: CudaGraphs,
    lr_scale: f32,
}

struct Run {
    losses: Vec<f64>,
    norms: Vec<f64>,
    params: Vec<f32>,
    moments: (Vec<f32>, Vec<f32>),
    working_copy_bytes: usize,
}

fn train(dev: &GpuDevice, s: Setup) -> Run {
    let c = config(s.tied);
    let model = LlamaForCausalLM::from_config(c.clone(), 9);
    let mut gpu = GpuLlama::with_memory(
        dev,
        &model,
        BATCH,
        SEQ,
        &[DType::BF16, DType::F32],
        s.checkpointing,
        LceChunk::from_tokens(64),
        MemoryMode::Default,
    )
    .unwrap();
    gpu.set_deterministic(true).unwrap();
    gpu.set_per_layer_weights(s.per_layer).unwrap();
    assert_eq!(gpu.per_layer_weights(), s.per_layer);
    let groups = gpu.default_groups(0.1);
    gpu.configure_optimizer(AdamWConfig::default(), groups, 1.0)
        .unwrap();
    gpu.set_cuda_graphs(s.graphs);
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for step in 0..STEPS {
        let precision = if step == FP32_STEP {
            DType::F32
        } else {
            DType::BF16
        };
        gpu.set_precision(precision).unwrap();
        let (ids, labels) = random_batch(&mut rng, c.vocab_size, BATCH, SEQ);
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
    }
    if s.graphs != CudaGraphs::Off {
        let stats = gpu.cuda_graph_stats();
        report(&format!("{s:?}: graph stats {stats:?}"));
        assert!(
            gpu.cuda_graph_fallback().is_none(),
            "{s:?}: capture fell back: {:?}",
            gpu.cuda_graph_fallback()
        );
    }
    Run {
        losses,
        norms,
        params: gpu.download_params().unwrap().data,
        moments: gpu.download_optimizer_moments().unwrap(),
        working_copy_bytes: gpu.memory().working_copy_bytes,
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn per_layer_copy_steps_are_the_whole_copys_bits() {
    let Some(dev) = gpu_or_skip("per_layer_copy_steps_are_the_whole_copys_bits") else {
        return;
    };
    for tied in [false, true] {
        for checkpointing in [true, false] {
            let base = Setup {
                tied,
                checkpointing,
                per_layer: false,
                graphs: CudaGraphs::Off,
                lr_scale: 1.0,
            };
            let whole = train(&dev, base);
            let runs = [
                (
                    "per-layer eager",
                    Setup {
                        per_layer: true,
                        ..base
                    },
                ),
                (
                    "per-layer CUDA graphs",
                    Setup {
                        per_layer: true,
                        graphs: CudaGraphs::Auto,
                        ..base
                    },
                ),
            ];
            for (name, setup) in runs {
                let what = format!("tied={tied} checkpointing={checkpointing} {name}");
                let run = train(&dev, setup);
                report(&format!("{what}: losses {:?}", run.losses));
                let loss_bits = differing_bits(&run.losses, &whole.losses);
                let norm_bits = differing_bits(&run.norms, &whole.norms);
                let (p, m, v) = (
                    differing_bits(&run.params, &whole.params),
                    differing_bits(&run.moments.0, &whole.moments.0),
                    differing_bits(&run.moments.1, &whole.moments.1),
                );
                report(&format!(
                    "{what}: differing bits: losses {loss_bits}, norms {norm_bits}, weights \
                     {p}, exp_avg {m}, exp_avg_sq {v} (of {} parameters); copy bytes {} vs \
                     whole {}",
                    run.params.len(),
                    run.working_copy_bytes,
                    whole.working_copy_bytes
                ));
                assert_eq!(
                    (loss_bits, norm_bits, p, m, v),
                    (0, 0, 0, 0, 0),
                    "{what}: not bit-identical"
                );
                // Per layer: every weight once, less three layers' spans, plus the norms
                // (resident) of the layers not in the window, in bf16. Untied, the embedding
                // table is cast into the window too (which grows only if the table is
                // larger than a layer).
                let table = if tied { 0 } else { VOCAB * HIDDEN };
                let window_growth = table.saturating_sub(PER_LAYER);
                assert_eq!(
                    whole.working_copy_bytes - run.working_copy_bytes,
                    2 * ((LAYERS - 1) * PER_LAYER - LAYERS * 2 * HIDDEN + table - window_growth),
                    "{what}: {} bytes per layer against {} whole",
                    run.working_copy_bytes,
                    whole.working_copy_bytes
                );
            }
        }
    }
    // The control: another learning rate must change the weights.
    let control = train(
        &dev,
        Setup {
            tied: false,
            checkpointing: true,
            per_layer: true,
            graphs: CudaGraphs::Off,
            lr_scale: 1.5,
        },
    );
    let whole = train(
        &dev,
        Setup {
            tied: false,
            checkpointing: true,
            per_layer: false,
            graphs: CudaGraphs::Off,
            lr_scale: 1.0,
        },
    );
    let differ = differing_bits(&control.params, &whole.params);
    report(&format!("control (lr x1.5): {differ} weights differ"));
    assert!(differ > control.params.len() / 2, "the control must differ");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn per_layer_copy_is_refused_where_no_whole_master_is_on_the_gpu() {
    let Some(dev) = gpu_or_skip("per_layer_copy_is_refused_where_no_whole_master_is_on_the_gpu")
    else {
        return;
    };
    let model = LlamaForCausalLM::from_config(config(false), 9);
    let build = |precisions: &[DType], memory| {
        GpuLlama::with_memory(
            &dev,
            &model,
            BATCH,
            SEQ,
            precisions,
            true,
            LceChunk::Auto,
            memory,
        )
        .unwrap()
    };
    let mut lean = build(&[DType::BF16], MemoryMode::Lean);
    let err = lean.set_per_layer_weights(true).unwrap_err().to_string();
    assert!(err.contains("--weight-copy whole"), "{err}");
    assert!(!lean.per_layer_weights());
    let mut f32_only = build(&[DType::F32], MemoryMode::Default);
    let err = f32_only
        .set_per_layer_weights(true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("f32 only"), "{err}");
    f32_only.set_per_layer_weights(false).unwrap();
    // Sharding the optimizer (ZeRO) takes a per-layer model back to the whole copy.
    let mut gpu = build(&[DType::BF16], MemoryMode::Default);
    gpu.set_per_layer_weights(true).unwrap();
    let numel = gpu.download_grads().unwrap().len();
    let groups = gpu.default_groups(0.0);
    gpu.configure_optimizer(AdamWConfig::default(), groups, 1.0)
        .unwrap();
    gpu.shard_optimizer(0..numel / 2).unwrap();
    assert!(
        !gpu.per_layer_weights(),
        "ZeRO's sharded master needs the whole copy"
    );
}
