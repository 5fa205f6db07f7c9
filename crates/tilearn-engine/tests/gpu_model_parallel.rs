//! Tensor parallelism on the CUDA engine: two ranks on threads share one GPU over the host
//! communicator (device buffers staged through page-locked memory) and train as one rank. The
//! embedding, lm_head and the fused cross entropy are vocabulary-parallel: the test model's 257
//! words are cut 129 + 128 (uneven, as the CPU engine cuts them: no padding), so every test
//! below also covers a vocabulary that tp does not divide.
//!
//! * tp 2 against the single-rank GPU engine, 3 steps of 2 micro-batches with clipping, from the
//!   same random initialisation: every step's loss and gradient norm, and the final weights
//!   (gathered and saved as Hugging Face files by the tp ranks).
//!   - fp32: losses and norms to 1e-5 relative, weights ‖Δw‖/‖w‖ ≤ 1e-5 and max |Δw| ≤ 1e-4.
//!     The split only reorders f32 additions (a row-parallel product summed over two ranks
//!     instead of inside one GEMM; the cross entropy's sum of exponentials over two slices;
//!     the hidden-state gradient of the loss head summed over the two vocabulary slices),
//!     ~1e-7 relative; AdamW's m/(√v+ε) can magnify that for a
//!     weight whose gradient is near ε, hence the looser bound on single weights (as in
//!     `tilearn-llm/tests/gpu_data_parallel.rs`). A missing all-reduce or a wrong slice gives
//!     errors of order one.
//!   - bf16: each rank's partial o_proj/down_proj output is rounded to bf16 before the sum
//!     (one rounding more than one GEMM's), and the backward's partial input gradients (and the
//!     loss head's partial hidden-state gradient) too, so
//!     the activations differ by ~2⁻⁸ relative: losses to 5e-3 relative, norms to 5e-2, weights
//!     ‖Δw‖/‖w‖ ≤ 5e-3 and max |Δw| ≤ 2·lr·steps (AdamW moves a weight by up to ~lr per step
//!     whatever its gradient's size, so a rounding that flips a tiny gradient's sign moves it
//!     the other way). Measured on the H200 with the vocabulary-parallel head: losses
//!     7.8e-6–1.3e-5, norms ≤ 2.2e-4, weights 1.72e-3 relative and max |Δw| 4.4e-3, evaluation
//!     loss 3.0e-5 (with the replicated head before it: 8e-6–2.2e-5, 2e-4, 1.59e-3, 4.4e-3).
//!     The 3 steps move the weights (initialiser std 0.02) by ~3·lr = 3e-3 each, ~0.15 of ‖w‖:
//!     a lost all-reduce or a wrong slice is off by that order, 30 times the bound; fp32
//!     measured weights 3.7e-7 and 4.6e-6, losses ≤ 1.6e-9, norms ≤ 2e-8, evaluation 3.1e-9.
//! * The same in fp32 with gradient checkpointing (the recomputed forwards all-reduce again),
//!   and in fp32 with tied embeddings (one slice serves the lookup and lm_head; both gradients
//!   land in it). The fp32 test prints each rank's logits-chunk bytes against the single rank's
//!   (the memory the vocabulary split saves: 129/257 of it on rank 0), and every test compares
//!   the trained models' evaluation loss on a held-out batch (the loss-only vocabulary-parallel
//!   path) with the losses' bounds.
//! * A tp 2 checkpoint (whole Hugging Face files, one optimizer file per rank with its slice
//!   layout) resumes on one rank: the next step's loss and the weights after it equal the
//!   uninterrupted single-rank run's (fp32 bounds above); and a single rank's checkpoint
//!   resumes on tp 2 the same way. A tp 2 checkpoint resumed on tp 2 continues bit for bit
//!   (losses, norms and weights equal to the uninterrupted tp 2 run's; measured: 0 of 106 944
//!   weights differ).
//!
//! GPU tests: ignored by default (run with `--include-ignored`); without a GPU or driver each
//! prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

mod support;

use std::path::Path;
use std::time::Duration;

use support::gpu_parallel::{
    compare, rel, staged_on_gpu, step_batches, tiny_args, tiny_config, train_step, weights_of,
};
use support::{gpu_or_skip, report};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::model::tensor_parallel::TensorShard;
use tilearn_engine::trainer::gpu_backend::GpuBackend;
use tilearn_engine::trainer::gpu_backend::tensor_parallel::GpuTensorParallelBackend;
use tilearn_engine::trainer::optimizer_shards::{OptimizerCheckpoint, shard_file_name};
use tilearn_engine::trainer::{ModelInit, StepBackend, TrainingArguments};
use tilearn_ops::DType;
use tilearn_parallel::host::{HostCommunicator, run_on_threads};

/// The rows of the 257-word vocabulary each of the two ranks holds (`chunk_range`).
const VOCAB_ROWS: [usize; 2] = [129, 128];

const SEED: u64 = 7;
const MICRO: usize = 2;

fn config() -> LlamaConfig {
    tiny_config(2)
}

/// The same model with tied embeddings (no `lm_head.weight`).
fn tied_config() -> LlamaConfig {
    LlamaConfig {
        tie_word_embeddings: true,
        ..config()
    }
}

fn args() -> TrainingArguments {
    tiny_args()
}

/// The single-rank engine from the random initialisation, trained `steps` steps.
fn one_rank(precision: DType, steps: std::ops::Range<usize>) -> (GpuBackend, Vec<(f64, f64)>) {
    one_rank_with(&config(), &args(), precision, steps)
}

fn one_rank_with(
    c: &LlamaConfig,
    a: &TrainingArguments,
    precision: DType,
    steps: std::ops::Range<usize>,
) -> (GpuBackend, Vec<(f64, f64)>) {
    support::gpu_parallel::one_rank(c, a, SEED, MICRO, precision, steps)
}

fn tp_backend(
    init: &ModelInit,
    precision: DType,
    rank: usize,
    comm: HostCommunicator,
) -> GpuTensorParallelBackend {
    tp_backend_with(&config(), &args(), init, precision, rank, comm)
}

fn tp_backend_with(
    c: &LlamaConfig,
    a: &TrainingArguments,
    init: &ModelInit,
    precision: DType,
    rank: usize,
    comm: HostCommunicator,
) -> GpuTensorParallelBackend {
    GpuTensorParallelBackend::from_init(
        c,
        init,
        a,
        (0, &[precision]),
        TensorShard { rank, size: 2 },
        staged_on_gpu(comm),
    )
    .unwrap()
}

fn weights(dir: &Path) -> Vec<f32> {
    weights_of(dir, &config())
}

fn tp2_matches_one_rank(precision: DType) {
    tp2_matches_one_rank_with(&config(), args(), precision);
}

fn tp2_matches_one_rank_with(c: &LlamaConfig, a: TrainingArguments, precision: DType) {
    let test = format!(
        "gpu tp 2 {precision}{}{}",
        if a.gradient_checkpointing {
            " with gradient checkpointing"
        } else {
            ""
        },
        if c.tie_word_embeddings {
            " with tied embeddings"
        } else {
            ""
        }
    );
    if gpu_or_skip(&test).is_none() {
        return;
    }
    let (mut single, reference) = one_rank_with(c, &a, precision, 0..3);
    // The evaluation loss (the loss-only vocabulary-parallel path) of a batch no step saw.
    let held_out = &step_batches(9, MICRO)[0];
    let reference_eval = single.eval_loss(held_out, precision).unwrap();
    let reference_weights = single.model().unwrap().params.data.clone();
    let single_logits_bytes = single.logits_buffer_bytes();
    drop(single);
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_path_buf();
    let logs = run_on_threads(
        2,
        Duration::from_secs(120),
        |rank, comm: HostCommunicator| {
            let init = ModelInit::Random { seed: SEED };
            let mut b = tp_backend_with(c, &a, &init, precision, rank, comm);
            let bytes = b.logits_buffer_bytes();
            let log: Vec<(f64, f64)> = (0..3)
                .map(|s| train_step(&mut b, s, MICRO, precision))
                .collect();
            let eval = b.eval_loss(held_out, precision).unwrap();
            b.save_model(&dir, c, DType::F32, None).unwrap();
            (log, bytes, eval)
        },
    )
    .unwrap();
    // The vocabulary split: each rank's logits chunk holds its rows' columns only (the
    // replicated head held all 257 on every rank, the single rank's buffer).
    for (rank, (_, bytes, _)) in logs.iter().enumerate() {
        report(&format!(
            "{test}: rank {rank} logits chunk {bytes} bytes (vocab rows {}), replicated head \
             {single_logits_bytes} bytes: {:.1} % of it",
            VOCAB_ROWS[rank],
            100.0 * *bytes as f64 / single_logits_bytes as f64
        ));
        assert!(
            *bytes < single_logits_bytes,
            "{test}: rank {rank}'s logits chunk is not smaller than the whole vocabulary's"
        );
    }
    assert_eq!(
        logs[0].0, logs[1].0,
        "the tp ranks log the same loss and norm"
    );
    let eval = logs[0].2;
    assert_eq!(eval, logs[1].2, "the tp ranks evaluate the same loss");
    assert_eq!(eval.valid_tokens, reference_eval.valid_tokens);
    let eval_rel = rel(eval.loss_sum, reference_eval.loss_sum);
    report(&format!(
        "{test}: evaluation loss sum {:.7} vs {:.7} (rel {eval_rel:.2e})",
        eval.loss_sum, reference_eval.loss_sum
    ));
    let eval_tol = if precision == DType::F32 { 1e-5 } else { 5e-3 };
    assert!(eval_rel <= eval_tol, "{test}: evaluation loss");
    compare(
        &test,
        &logs[0].0,
        &reference,
        (&weights_of(&dir, c), &reference_weights),
        precision,
    );
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensor_parallel_2_matches_one_rank_fp32() {
    tp2_matches_one_rank(DType::F32);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensor_parallel_2_matches_one_rank_bf16() {
    tp2_matches_one_rank(DType::BF16);
}

/// The recomputed forward of each block all-reduces again (six partial sums per layer).
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensor_parallel_2_with_gradient_checkpointing_matches_one_rank_fp32() {
    let a = TrainingArguments {
        gradient_checkpointing: true,
        ..args()
    };
    tp2_matches_one_rank_with(&config(), a, DType::F32);
}

/// Tied embeddings: one vocabulary slice is both the lookup table and lm_head; the lookup's
/// and the head's gradients both land in the rank's rows.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensor_parallel_2_with_tied_embeddings_matches_one_rank_fp32() {
    tp2_matches_one_rank_with(&tied_config(), args(), DType::F32);
}

/// The optimizer state of a tp 2 save in `dir` (as the Trainer's checkpoint writes it).
fn sliced_checkpoint(dir: &Path) -> OptimizerCheckpoint {
    support::gpu_parallel::sliced_checkpoint(dir, &config(), (2, 1, 1))
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensor_parallel_checkpoints_resume_on_one_rank_and_back() {
    let test = "gpu tp 2 checkpoint";
    if gpu_or_skip(test).is_none() {
        return;
    }
    let f32 = DType::F32;
    let (mut single, reference) = one_rank(f32, 0..3);
    let reference_weights = single.model().unwrap().params.data.clone();
    drop(single);

    // tp 2 trains steps 0-1 and saves; one rank resumes and runs step 2.
    let saved = tempfile::tempdir().unwrap();
    let dir = saved.path().to_path_buf();
    run_on_threads(
        2,
        Duration::from_secs(120),
        |rank, comm: HostCommunicator| {
            let mut b = tp_backend(&ModelInit::Random { seed: SEED }, f32, rank, comm);
            for s in 0..2 {
                train_step(&mut b, s, MICRO, f32);
            }
            b.save_model(&dir, &config(), DType::F32, None).unwrap();
            b.save_optimizer(&dir.join(shard_file_name(rank, 2)))
                .unwrap();
        },
    )
    .unwrap();
    let init = ModelInit::Pretrained(dir.clone());
    let mut resumed = GpuBackend::from_init(&config(), &init, &args(), 0, &[f32]).unwrap();
    resumed.restore(&dir, &sliced_checkpoint(&dir)).unwrap();
    let log = vec![train_step(&mut resumed, 2, MICRO, f32)];
    let w = resumed.model().unwrap().params.data.clone();
    drop(resumed);
    compare(
        "tp 2 -> one rank",
        &log,
        &reference[2..],
        (&w, &reference_weights),
        f32,
    );

    // One rank trains steps 0-1 and saves; tp 2 resumes and runs step 2.
    let saved = tempfile::tempdir().unwrap();
    let dir = saved.path().to_path_buf();
    let (mut single, _) = one_rank(f32, 0..2);
    single
        .save_model(&dir, &config(), DType::F32, None)
        .unwrap();
    let whole = dir.join("optimizer.safetensors");
    single.save_optimizer(&whole).unwrap();
    drop(single);
    let out = tempfile::tempdir().unwrap();
    let final_dir = out.path().to_path_buf();
    let logs = run_on_threads(
        2,
        Duration::from_secs(120),
        |rank, comm: HostCommunicator| {
            let mut b = tp_backend(&ModelInit::Pretrained(dir.clone()), f32, rank, comm);
            b.restore(&dir, &OptimizerCheckpoint::Whole(whole.clone()))
                .unwrap();
            let log = vec![train_step(&mut b, 2, MICRO, f32)];
            b.save_model(&final_dir, &config(), DType::F32, None)
                .unwrap();
            log
        },
    )
    .unwrap();
    compare(
        "one rank -> tp 2",
        &logs[0],
        &reference[2..],
        (&weights(&final_dir), &reference_weights),
        f32,
    );
}

/// A tp 2 checkpoint resumed on tp 2 (each rank reads its vocabulary rows and slices of the
/// weights and its own optimizer file) continues exactly as the uninterrupted tp 2 run: every
/// kernel and the host communicator's reductions are deterministic, so the step after the
/// resume and the final weights are equal bit for bit.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensor_parallel_checkpoints_resume_on_tp_2_bit_for_bit() {
    let test = "gpu tp 2 checkpoint resumed on tp 2";
    if gpu_or_skip(test).is_none() {
        return;
    }
    let f32 = DType::F32;
    let uninterrupted = tempfile::tempdir().unwrap();
    let (saved, resumed_out) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (full_dir, dir, final_dir) = (
        uninterrupted.path().to_path_buf(),
        saved.path().to_path_buf(),
        resumed_out.path().to_path_buf(),
    );
    let reference = run_on_threads(
        2,
        Duration::from_secs(120),
        |rank, comm: HostCommunicator| {
            let mut b = tp_backend(&ModelInit::Random { seed: SEED }, f32, rank, comm);
            let log: Vec<(f64, f64)> = (0..3).map(|s| train_step(&mut b, s, MICRO, f32)).collect();
            b.save_model(&full_dir, &config(), DType::F32, None)
                .unwrap();
            log
        },
    )
    .unwrap();
    run_on_threads(
        2,
        Duration::from_secs(120),
        |rank, comm: HostCommunicator| {
            let mut b = tp_backend(&ModelInit::Random { seed: SEED }, f32, rank, comm);
            for s in 0..2 {
                train_step(&mut b, s, MICRO, f32);
            }
            b.save_model(&dir, &config(), DType::F32, None).unwrap();
            b.save_optimizer(&dir.join(shard_file_name(rank, 2)))
                .unwrap();
        },
    )
    .unwrap();
    let logs = run_on_threads(
        2,
        Duration::from_secs(120),
        |rank, comm: HostCommunicator| {
            let mut b = tp_backend(&ModelInit::Pretrained(dir.clone()), f32, rank, comm);
            b.restore(&dir, &sliced_checkpoint(&dir)).unwrap();
            let log = vec![train_step(&mut b, 2, MICRO, f32)];
            b.save_model(&final_dir, &config(), DType::F32, None)
                .unwrap();
            log
        },
    )
    .unwrap();
    report(&format!(
        "{test}: step 2 loss {:.9} vs {:.9}, norm {:.9} vs {:.9}",
        logs[0][0].0, reference[0][2].0, logs[0][0].1, reference[0][2].1
    ));
    assert_eq!(
        logs[0][0], reference[0][2],
        "{test}: the step after the resume"
    );
    let (w, w_ref) = (weights(&final_dir), weights(&full_dir));
    let differing = w
        .iter()
        .zip(&w_ref)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    report(&format!(
        "{test}: {differing} of {} weights differ",
        w.len()
    ));
    assert_eq!(differing, 0, "{test}: final weights bit for bit");
}
