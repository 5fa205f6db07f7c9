//! The fixture shared by the GPU model-parallel tests, `gpu_model_parallel.rs` (tensor
//! parallelism) and `gpu_pipeline_parallel.rs` (pipeline parallelism): ranks on threads share
//! GPU 0 over the host communicator and are compared with the single-rank GPU engine trained
//! from the same random initialisation on the same micro-batches.
//!
//! It holds the tiny Llama config (the files differ in depth and seed only), the training
//! arguments, every step's seeded micro-batches, one optimizer step as the Trainer takes it,
//! the single-rank reference run, a host communicator staged on the GPU, the saved weights,
//! the sliced optimizer checkpoint of a two-rank save, and the comparison of two runs' losses,
//! gradient norms and weights with the bounds both files' docs explain.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tilearn_engine::checkpoint::load_params;
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::Batch;
use tilearn_engine::params::ParamStore;
use tilearn_engine::trainer::gpu_backend::GpuBackend;
use tilearn_engine::trainer::optimizer_shards::{
    OptimizerCheckpoint, SlicedManifest, shard_file_name,
};
use tilearn_engine::trainer::{ModelInit, StepBackend, TrainingArguments};
use tilearn_ops::DType;
use tilearn_ops::cuda::GpuDevice;
use tilearn_parallel::Communicator;
use tilearn_parallel::host::HostCommunicator;

use super::{random_batch, rel_err, report};

/// Words of the tiny model's vocabulary (odd, so two ranks cut it unevenly).
pub const VOCAB: usize = 257;
pub const BATCH: usize = 2;
pub const SEQ: usize = 16;
pub const LR: f32 = 1e-3;

/// The tiny untied Llama with `layers` decoder layers.
pub fn tiny_config(layers: usize) -> LlamaConfig {
    let json = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
 "intermediate_size": 128, "num_hidden_layers": {layers}, "num_attention_heads": 4,
 "num_key_value_heads": 2, "vocab_size": {VOCAB}, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false}}"#
    );
    LlamaConfig::from_json_str(&json, "test/config.json").unwrap()
}

/// Batches of `BATCH × SEQ`, learning rate `LR`, clipping at 1; deterministic, since the
/// resumes are compared bit for bit (the one-pass flash attention backward is not
/// bit-reproducible; head_dim 16 runs the cuBLASLt path anyway, this keeps it so).
pub fn tiny_args() -> TrainingArguments {
    TrainingArguments {
        per_device_train_batch_size: BATCH,
        seq_len: SEQ,
        learning_rate: LR,
        max_grad_norm: 1.0,
        deterministic: true,
        ..TrainingArguments::default()
    }
}

/// The `micro` micro-batches of step `step` (micro-batch `m` seeded `step * 100 + m`).
pub fn step_batches(step: usize, micro: usize) -> Vec<Batch> {
    (0..micro)
        .map(|m| {
            let mut rng = ChaCha8Rng::seed_from_u64((step * 100 + m) as u64);
            let (input_ids, labels) = random_batch(&mut rng, VOCAB, BATCH, SEQ);
            Batch {
                input_ids,
                labels,
                positions: None,
                batch: BATCH,
                seq_len: SEQ,
            }
        })
        .collect()
}

/// The valid targets of a step's micro-batches: the loss's denominator.
pub fn denominator(batches: &[Batch]) -> f64 {
    batches
        .iter()
        .map(|b| tilearn_engine::model::count_valid_targets(&b.labels, BATCH, SEQ))
        .sum::<usize>() as f64
}

/// The forward and backward of a step's micro-batches with the loss scaled by `loss_scale`, as
/// the Trainer runs them: the whole step at once where the backend runs it (a pipeline stage),
/// else micro-batch by micro-batch. Returns the summed loss.
pub fn forward_backward_all(
    backend: &mut dyn StepBackend,
    batches: &[Batch],
    denominator: f64,
    precision: DType,
    loss_scale: f32,
) -> f64 {
    match backend.forward_backward_step(batches, denominator, precision, loss_scale) {
        Some(loss) => loss.unwrap(),
        None => batches
            .iter()
            .map(|b| {
                backend
                    .forward_backward(b, denominator, precision, loss_scale)
                    .unwrap()
            })
            .sum(),
    }
}

/// One optimizer step of `backend` on step `step`'s `micro` micro-batches, as the Trainer
/// takes it: (loss, gradient norm).
pub fn train_step(
    backend: &mut dyn StepBackend,
    step: usize,
    micro: usize,
    precision: DType,
) -> (f64, f64) {
    let batches = step_batches(step, micro);
    let denominator = denominator(&batches);
    backend.zero_grads();
    let loss = forward_backward_all(backend, &batches, denominator, precision, 1.0);
    backend.clip_grad_norm(1.0).unwrap();
    let norm = backend
        .optimizer_step(LR)
        .unwrap()
        .expect("the GPU reports the norm");
    (loss / denominator, norm)
}

/// The single-rank engine of `c` from the random initialisation `seed`, trained `steps` steps
/// of `micro` micro-batches: the reference the parallel runs are compared with.
pub fn one_rank(
    c: &LlamaConfig,
    a: &TrainingArguments,
    seed: u64,
    micro: usize,
    precision: DType,
    steps: Range<usize>,
) -> (GpuBackend, Vec<(f64, f64)>) {
    let init = ModelInit::Random { seed };
    let mut backend = GpuBackend::from_init(c, &init, a, 0, &[precision]).unwrap();
    let log = steps
        .map(|s| train_step(&mut backend, s, micro, precision))
        .collect();
    (backend, log)
}

/// `comm` with its device buffers staged through page-locked memory on a stream of GPU 0 (the
/// GPU every rank of these tests shares).
pub fn staged_on_gpu(comm: HostCommunicator) -> Arc<dyn Communicator> {
    comm.set_staging_stream(GpuDevice::new(0).unwrap().stream().clone());
    Arc::new(comm)
}

/// The weights of `c` saved (as Hugging Face files) in `dir`.
pub fn weights_of(dir: &Path, c: &LlamaConfig) -> Vec<f32> {
    load_params(dir, c).unwrap().data
}

/// The optimizer state of a two-rank save of `c` in `dir` with `(tp, pp, dp)` sizes `layout`
/// (one file per rank, as the Trainer's checkpoint writes it).
pub fn sliced_checkpoint(
    dir: &Path,
    c: &LlamaConfig,
    layout: (usize, usize, usize),
) -> OptimizerCheckpoint {
    let specs = ParamStore::specs_for(c);
    let numel = specs.iter().map(|s| s.numel()).sum();
    let files = (0..2).map(|r| shard_file_name(r, 2)).collect();
    OptimizerCheckpoint::Sliced {
        dir: dir.to_path_buf(),
        manifest: SlicedManifest::new(numel, layout, 0, files),
        specs,
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max)
}

pub fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
}

/// Compares two runs' (loss, norm) logs and final weights with the bounds of `precision`.
pub fn compare(
    what: &str,
    ours: &[(f64, f64)],
    reference: &[(f64, f64)],
    w: (&[f32], &[f32]),
    precision: DType,
) {
    let (loss_tol, norm_tol, w_rel_tol, w_max_tol) = match precision {
        DType::F32 => (1e-5, 1e-5, 1e-5, 1e-4),
        _ => (5e-3, 5e-2, 5e-3, 2.0 * f64::from(LR) * ours.len() as f64),
    };
    assert_eq!(ours.len(), reference.len());
    for (step, (o, r)) in ours.iter().zip(reference).enumerate() {
        report(&format!(
            "{what} step {step}: loss {:.7} vs {:.7} (rel {:.2e}), norm {:.6} vs {:.6} (rel {:.2e})",
            o.0,
            r.0,
            rel(o.0, r.0),
            o.1,
            r.1,
            rel(o.1, r.1)
        ));
        assert!(rel(o.0, r.0) <= loss_tol, "{what}: loss of step {step}");
        assert!(
            rel(o.1, r.1) <= norm_tol,
            "{what}: gradient norm of step {step}"
        );
    }
    assert_eq!(w.0.len(), w.1.len(), "{what}: the saved model's size");
    let (wr, wm) = (rel_err(w.0, w.1), max_abs_diff(w.0, w.1));
    report(&format!("{what}: weights rel {wr:.2e}, max |Δw| {wm:.2e}"));
    assert!(wr <= w_rel_tol, "{what}: weights rel {wr}");
    assert!(wm <= w_max_tol, "{what}: max |Δw| {wm}");
}
