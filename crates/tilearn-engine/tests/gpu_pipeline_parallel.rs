//! Pipeline parallelism on the CUDA engine: two (or three) ranks on threads share one GPU over
//! the host communicator (activations and their gradients staged through page-locked memory)
//! and train as one rank.
//!
//! * pp 2 with 1F1B against the single-rank GPU engine, 3 steps of 4 micro-batches with
//!   clipping, from the same random initialisation: every step's loss and gradient norm, and
//!   the final weights (gathered and saved as Hugging Face files by stage 0).
//!   - fp32: losses and norms to 1e-5 relative, weights ‖Δw‖/‖w‖ ≤ 1e-5 and max |Δw| ≤ 1e-4.
//!     A stage runs the single rank's kernels on the same inputs (the boundary activations
//!     cross in f32, a stage's first norm is computed unfused, which the gradient-checkpointing
//!     tests show to be bit-identical, the recomputed forward is deterministic) and no sum is
//!     split, so the gradients would be the same bits but for two things: cuBLASLt picks its
//!     algorithm by the operands' pointer alignment, which differs where a tensor sits at
//!     another offset of the stage's buffer than of the whole model's (another algorithm
//!     rounds in another order, ~1e-7 relative), and the clip norm is summed from the stages'
//!     f64 partial sums. Those are tensor parallelism's kinds of differences, so its bounds:
//!     AdamW's m/(√v+ε) can magnify them for a weight whose gradient is near ε, hence the
//!     looser bound on single weights. A lost transfer, a stale arena or a wrong layer cut
//!     gives errors of order one.
//!   - bf16: an algorithm chosen by another alignment rounds a product's output to bf16 from
//!     another f32 value now and then (2⁻⁸ relative on that element), so tensor parallelism's
//!     bf16 bounds: losses 5e-3 relative, norms 5e-2, weights ‖Δw‖/‖w‖ ≤ 5e-3 and max |Δw| ≤
//!     2·lr·steps (AdamW moves a weight by up to ~lr per step whatever its gradient's size, so a
//!     rounding that flips a tiny gradient's sign moves it the other way). The 3 steps move the
//!     weights by ~0.15 of ‖w‖: an error is 30 times the bound.
//! * GPipe with gradient checkpointing in fp32 (every backward recomputes its stage's forward,
//!   and inside it the blocks recompute again), and three stages with 1F1B over 5 micro-batches (a middle stage
//!   receives and sends in both directions), fp32 bounds.
//! * fp16 with loss scaling (scale 1024) against one rank within the 16-bit bounds, and an
//!   infinite gradient planted on the last stage alone makes both stages skip the step.
//! * The evaluation loss of pp 2 equals the single rank's (fp32, 1e-5 relative).
//! * tp 2 × pp 2 (four ranks: tensor parallelism inside each stage) against one rank in fp32
//!   and bf16, with the bounds above (which are tensor parallelism's). Written in a session
//!   without device time: not yet run.
//! * A pp 2 checkpoint (whole Hugging Face files, one optimizer file per stage in the sliced
//!   layout) resumes on pp 2 bit for bit against the uninterrupted pp 2 run, and on one rank
//!   within the fp32 bounds.
//!
//! Measured on the H200: every comparison above was exact (zero difference in losses, norms and
//! weights; one norm 1.3e-16 relative), in every precision.
//!
//! GPU tests: ignored by default (run with `--include-ignored`); without a GPU or driver each
//! prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use support::gpu_parallel::{
    LR, SEQ, compare, denominator, forward_backward_all, max_abs_diff, rel, sliced_checkpoint,
    staged_on_gpu, step_batches, tiny_args, tiny_config, train_step, weights_of,
};
use support::{gpu_or_skip, report};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::model::model_parallel::PipelineShard;
use tilearn_engine::model::tensor_parallel::TensorShard;
use tilearn_engine::trainer::gpu_backend::GpuBackend;
use tilearn_engine::trainer::gpu_backend::pipeline_parallel::{
    GpuPipelineParallelBackend, TensorSplit,
};
use tilearn_engine::trainer::optimizer_shards::{OptimizerCheckpoint, shard_file_name};
use tilearn_engine::trainer::{ModelInit, StepBackend, TrainingArguments};
use tilearn_ops::DType;
use tilearn_parallel::Communicator;
use tilearn_parallel::host::{HostCommunicator, run_on_threads};
use tilearn_parallel::pipeline::ScheduleKind;

const SEED: u64 = 11;
const MICRO: usize = 4;
const STEPS: usize = 3;

fn config() -> LlamaConfig {
    tiny_config(4)
}

fn args_with(micro: usize) -> TrainingArguments {
    TrainingArguments {
        gradient_accumulation_steps: micro,
        ..tiny_args()
    }
}

fn args() -> TrainingArguments {
    args_with(MICRO)
}

fn one_rank(
    a: &TrainingArguments,
    precision: DType,
    steps: std::ops::Range<usize>,
) -> (GpuBackend, Vec<(f64, f64)>) {
    let micro = a.gradient_accumulation_steps;
    support::gpu_parallel::one_rank(&config(), a, SEED, micro, precision, steps)
}

fn stage_backend(
    a: &TrainingArguments,
    init: &ModelInit,
    precision: DType,
    (stage, stages, schedule): (usize, usize, ScheduleKind),
    comm: HostCommunicator,
) -> GpuPipelineParallelBackend {
    let comm = staged_on_gpu(comm);
    let pipe = PipelineShard::balanced(&config(), stage, stages, 1, SEQ).unwrap();
    GpuPipelineParallelBackend::from_init(
        &config(),
        init,
        a,
        (0, &[precision]),
        (pipe, schedule),
        comm,
    )
    .unwrap()
}

fn weights(dir: &Path) -> Vec<f32> {
    weights_of(dir, &config())
}

/// `ranks` ranks on threads, each built by `build` from its rank and communicator, train
/// `STEPS` steps of `a`'s micro-batches as one rank: every rank logs the same loss and norm,
/// and the logs and the saved (gathered) model match the single rank's within `compare`'s
/// bounds.
fn ranks_match_one_rank(
    test: &str,
    a: &TrainingArguments,
    precision: DType,
    ranks: usize,
    build: impl Fn(usize, HostCommunicator) -> GpuPipelineParallelBackend + Sync,
) {
    if gpu_or_skip(test).is_none() {
        return;
    }
    let micro = a.gradient_accumulation_steps;
    let (mut single, reference) = one_rank(a, precision, 0..STEPS);
    let reference_weights = single.model().unwrap().params.data.clone();
    drop(single);
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_path_buf();
    let logs = run_on_threads(ranks, Duration::from_secs(180), |rank, comm| {
        let mut b = build(rank, comm);
        let log: Vec<(f64, f64)> = (0..STEPS)
            .map(|s| train_step(&mut b, s, micro, precision))
            .collect();
        b.save_model(&dir, &config(), DType::F32, None).unwrap();
        log
    })
    .unwrap();
    for log in &logs[1..] {
        assert_eq!(log, &logs[0], "every rank logs the same loss and norm");
    }
    compare(
        test,
        &logs[0],
        &reference,
        (&weights(&dir), &reference_weights),
        precision,
    );
}

/// `stages` stages with `schedule` train `STEPS` steps of `micro` micro-batches as one rank.
fn pipeline_matches_one_rank(
    a: TrainingArguments,
    precision: DType,
    stages: usize,
    schedule: ScheduleKind,
) {
    let micro = a.gradient_accumulation_steps;
    let test = format!(
        "gpu pp {stages} {schedule} {precision} × {micro} micro-batches{}",
        if a.gradient_checkpointing {
            " with gradient checkpointing"
        } else {
            ""
        }
    );
    ranks_match_one_rank(&test, &a, precision, stages, |stage, comm| {
        let init = ModelInit::Random { seed: SEED };
        stage_backend(&a, &init, precision, (stage, stages, schedule), comm)
    });
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn pipeline_2_one_f_one_b_matches_one_rank_fp32() {
    pipeline_matches_one_rank(args(), DType::F32, 2, ScheduleKind::OneFOneB);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn pipeline_2_one_f_one_b_matches_one_rank_bf16() {
    pipeline_matches_one_rank(args(), DType::BF16, 2, ScheduleKind::OneFOneB);
}

/// Every backward of GPipe recomputes its stage's forward (they follow all forwards), and
/// inside the backward the blocks recompute again.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn pipeline_2_gpipe_with_gradient_checkpointing_matches_one_rank_fp32() {
    let a = TrainingArguments {
        gradient_checkpointing: true,
        ..args()
    };
    pipeline_matches_one_rank(a, DType::F32, 2, ScheduleKind::GPipe);
}

/// A middle stage receives activations and gradients and sends both.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn pipeline_3_one_f_one_b_matches_one_rank_fp32() {
    pipeline_matches_one_rank(args_with(5), DType::F32, 3, ScheduleKind::OneFOneB);
}

/// tp 2 × pp 2 (four ranks on threads; rank = stage · 2 + tensor rank, as the launcher lays
/// them out): each stage's two tensor ranks complete their partial sums, the first stage's
/// embedding and the last stage's loss head are vocabulary-parallel, activations cross between
/// the same tensor rank of each stage; against one rank with tensor parallelism's bounds
/// (`compare`), every rank logging the same loss and norm, the saved model gathered from the
/// four ranks' slices.
fn tensor_by_pipeline_matches_one_rank(precision: DType) {
    let test = format!("gpu tp 2 x pp 2 1f1b {precision}");
    let a = args();
    ranks_match_one_rank(&test, &a, precision, 4, |rank, comm| {
        let world = staged_on_gpu(comm);
        // Every rank creates every group, in the same order (as HybridGroups does).
        let mine = |groups: &[&[usize]]| -> Arc<dyn Communicator> {
            let mut found = None;
            for g in groups {
                if let Some(c) = world.new_group(g).unwrap() {
                    found = Some(Arc::from(c));
                }
            }
            found.unwrap()
        };
        let tp = mine(&[&[0, 1], &[2, 3]]);
        let pp = mine(&[&[0, 2], &[1, 3]]);
        let replica = mine(&[&[0, 1, 2, 3]]);
        let (stage, tp_rank) = (rank / 2, rank % 2);
        let pipe = PipelineShard::balanced(&config(), stage, 2, 1, SEQ).unwrap();
        let split = TensorSplit {
            shard: TensorShard {
                rank: tp_rank,
                size: 2,
            },
            tp,
            replica,
        };
        GpuPipelineParallelBackend::with_tensor_split(
            &config(),
            &ModelInit::Random { seed: SEED },
            &a,
            (0, &[precision]),
            (pipe, ScheduleKind::OneFOneB),
            pp,
            Some(split),
        )
        .unwrap()
    });
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensor_2_by_pipeline_2_matches_one_rank_fp32() {
    tensor_by_pipeline_matches_one_rank(DType::F32);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensor_2_by_pipeline_2_matches_one_rank_bf16() {
    tensor_by_pipeline_matches_one_rank(DType::BF16);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn pipeline_2_evaluation_loss_matches_one_rank() {
    let test = "gpu pp 2 evaluation loss";
    if gpu_or_skip(test).is_none() {
        return;
    }
    let batch = step_batches(7, 1).remove(0);
    let (mut single, _) = one_rank(&args(), DType::F32, 0..1);
    let want = single.eval_loss(&batch, DType::F32).unwrap();
    drop(single);
    let got = run_on_threads(2, Duration::from_secs(120), |stage, comm| {
        let init = ModelInit::Random { seed: SEED };
        let place = (stage, 2, ScheduleKind::OneFOneB);
        let mut b = stage_backend(&args(), &init, DType::F32, place, comm);
        train_step(&mut b, 0, MICRO, DType::F32);
        b.eval_loss(&batch, DType::F32).unwrap()
    })
    .unwrap();
    report(&format!(
        "{test}: {} vs {} over {} targets",
        got[0].loss_sum, want.loss_sum, want.valid_tokens
    ));
    for g in &got {
        assert_eq!(g.valid_tokens, want.valid_tokens);
        assert!(rel(g.loss_sum, want.loss_sum) <= 1e-5, "{test}");
    }
}

/// The optimizer state of a pp 2 save in `dir` (as the Trainer's checkpoint writes it).
fn pipeline_checkpoint(dir: &Path) -> OptimizerCheckpoint {
    sliced_checkpoint(dir, &config(), (1, 2, 1))
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn pipeline_checkpoints_resume_bit_for_bit_and_on_one_rank() {
    let test = "gpu pp 2 checkpoint";
    if gpu_or_skip(test).is_none() {
        return;
    }
    let f32 = DType::F32;
    let schedule = ScheduleKind::OneFOneB;
    // pp 2 uninterrupted for STEPS steps, saving after step 1.
    let saved = tempfile::tempdir().unwrap();
    let dir = saved.path().to_path_buf();
    let uninterrupted_out = tempfile::tempdir().unwrap();
    let final_dir = uninterrupted_out.path().to_path_buf();
    let uninterrupted = run_on_threads(2, Duration::from_secs(120), |stage, comm| {
        let init = ModelInit::Random { seed: SEED };
        let mut b = stage_backend(&args(), &init, f32, (stage, 2, schedule), comm);
        let mut log = Vec::new();
        for s in 0..STEPS {
            log.push(train_step(&mut b, s, MICRO, f32));
            if s == 1 {
                b.save_model(&dir, &config(), DType::F32, None).unwrap();
                b.save_optimizer(&dir.join(shard_file_name(stage, 2)))
                    .unwrap();
            }
        }
        b.save_model(&final_dir, &config(), DType::F32, None)
            .unwrap();
        log
    })
    .unwrap();
    let want_weights = weights(&final_dir);

    // pp 2 resumes from the checkpoint of step 1 and takes the last step.
    let resumed_out = tempfile::tempdir().unwrap();
    let resumed_dir = resumed_out.path().to_path_buf();
    let resumed = run_on_threads(2, Duration::from_secs(120), |stage, comm| {
        let init = ModelInit::Pretrained(dir.clone());
        let mut b = stage_backend(&args(), &init, f32, (stage, 2, schedule), comm);
        b.restore(&dir, &pipeline_checkpoint(&dir)).unwrap();
        let log = train_step(&mut b, STEPS - 1, MICRO, f32);
        b.save_model(&resumed_dir, &config(), DType::F32, None)
            .unwrap();
        log
    })
    .unwrap();
    let got_weights = weights(&resumed_dir);
    report(&format!(
        "{test}: pp 2 -> pp 2 step {}: loss {} vs {}, max |Δw| {:.2e}",
        STEPS - 1,
        resumed[0].0,
        uninterrupted[0][STEPS - 1].0,
        max_abs_diff(&got_weights, &want_weights)
    ));
    assert_eq!(
        resumed[0],
        uninterrupted[0][STEPS - 1],
        "{test}: same layout"
    );
    assert_eq!(
        got_weights, want_weights,
        "{test}: same layout, bit for bit"
    );

    // One rank resumes from the same checkpoint.
    let init = ModelInit::Pretrained(dir.clone());
    let mut one = GpuBackend::from_init(&config(), &init, &args(), 0, &[f32]).unwrap();
    one.restore(&dir, &pipeline_checkpoint(&dir)).unwrap();
    let log = vec![train_step(&mut one, STEPS - 1, MICRO, f32)];
    let w = one.model().unwrap().params.data.clone();
    compare(
        "pp 2 -> one rank",
        &log,
        &uninterrupted[0][STEPS - 1..],
        (&w, &want_weights),
        f32,
    );
}

/// What a GPU stage does not run is refused before any device is touched, naming the flag
/// (runs without a GPU).
#[test]
fn unsupported_settings_are_refused_with_the_flag_before_touching_the_gpu() {
    use tilearn_engine::cuda_graphs::CudaGraphs;
    use tilearn_engine::memory_mode::MemoryMode;
    let cases: Vec<(&str, TrainingArguments, LlamaConfig, ScheduleKind)> = vec![
        (
            "--cuda-graphs",
            TrainingArguments {
                cuda_graphs: CudaGraphs::On,
                ..args()
            },
            config(),
            ScheduleKind::OneFOneB,
        ),
        (
            "--memory",
            TrainingArguments {
                memory: MemoryMode::Lean,
                ..args()
            },
            config(),
            ScheduleKind::OneFOneB,
        ),
        (
            "--pp-schedule",
            args(),
            config(),
            ScheduleKind::Interleaved { virtual_stages: 1 },
        ),
    ];
    for (flag, a, cfg, schedule) in cases {
        let errors = run_on_threads(2, Duration::from_secs(30), |stage, comm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm);
            let pipe = PipelineShard::balanced(&cfg, stage, 2, 1, SEQ).unwrap();
            let init = ModelInit::Random { seed: SEED };
            match GpuPipelineParallelBackend::from_init(
                &cfg,
                &init,
                &a,
                (0, &[DType::F32]),
                (pipe, schedule),
                comm,
            ) {
                Ok(_) => panic!("{flag}: accepted"),
                Err(e) => e.to_string(),
            }
        })
        .unwrap();
        for e in errors {
            assert!(e.contains(flag), "expected a refusal naming {flag}: {e}");
        }
    }
}

/// An fp16 step as the Trainer takes it with the GradScaler's `scale`: the scaled backward, the
/// collective unscale/overflow check, then (when finite) the step. `poison` plants an infinite
/// gradient first (fault injection). Returns (loss, gradient norm, found inf).
fn fp16_step(
    backend: &mut dyn StepBackend,
    step: usize,
    scale: f32,
    poison: bool,
) -> (f64, f64, bool) {
    let batches = step_batches(step, MICRO);
    let denominator = denominator(&batches);
    backend.zero_grads();
    let loss = forward_backward_all(backend, &batches, denominator, DType::F16, scale);
    if poison {
        backend.poison_gradients().unwrap();
    }
    let found_inf = backend.unscale_and_check(1.0 / scale).unwrap();
    if found_inf {
        return (loss / denominator, f64::NAN, true);
    }
    backend.clip_grad_norm(1.0).unwrap();
    let norm = backend
        .optimizer_step(LR)
        .unwrap()
        .expect("the GPU reports the norm");
    (loss / denominator, norm, false)
}

/// fp16 with loss scaling: the scaled gradients cross the stages, the unscale and the
/// overflow check are collective (an inf planted on the last stage alone makes both stages
/// skip), and the steps match one rank's within the 16-bit bounds above.
#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn pipeline_2_fp16_with_loss_scaling_matches_one_rank_and_skips_together() {
    let test = "gpu pp 2 fp16 loss scaling";
    if gpu_or_skip(test).is_none() {
        return;
    }
    let f16 = DType::F16;
    let scale = 1024.0;
    let init = ModelInit::Random { seed: SEED };
    let mut single = GpuBackend::from_init(&config(), &init, &args(), 0, &[f16]).unwrap();
    let reference: Vec<(f64, f64)> = (0..STEPS)
        .map(|s| {
            let (loss, norm, inf) = fp16_step(&mut single, s, scale, false);
            assert!(!inf, "{test}: one rank overflowed at scale {scale}");
            (loss, norm)
        })
        .collect();
    let reference_weights = single.model().unwrap().params.data.clone();
    drop(single);
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_path_buf();
    let results = run_on_threads(2, Duration::from_secs(120), |stage, comm| {
        let init = ModelInit::Random { seed: SEED };
        let place = (stage, 2, ScheduleKind::OneFOneB);
        let mut b = stage_backend(&args(), &init, f16, place, comm);
        let mut log = Vec::new();
        for s in 0..STEPS {
            let (loss, norm, inf) = fp16_step(&mut b, s, scale, false);
            assert!(!inf, "{test}: stage {stage} overflowed at scale {scale}");
            log.push((loss, norm));
        }
        b.save_model(&dir, &config(), DType::F32, None).unwrap();
        // Only the last stage's gradients are poisoned; both must skip.
        let (_, _, skipped) = fp16_step(&mut b, STEPS, scale, stage == 1);
        (log, skipped)
    })
    .unwrap();
    assert_eq!(
        results[0].0, results[1].0,
        "{test}: the stages log the same"
    );
    assert!(
        results.iter().all(|r| r.1),
        "{test}: an overflow on one stage is every stage's"
    );
    compare(
        test,
        &results[0].0,
        &reference,
        (&weights(&dir), &reference_weights),
        f16,
    );
}
