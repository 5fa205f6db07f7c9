//! Tensor and pipeline parallelism on the CPU engine: ranks on threads joined by the host
//! communicator (the transport between processes, over loopback) compute the loss and gradients
//! of the whole model from their parts, over several micro-batches (the pipeline's).
//!
//! Tolerances: the loss to 1e-5 relative and the gradients to 2e-5 relative (‖Δ‖/‖ref‖) of one
//! process, each tensor to 1e-4. The split changes only the order of f32 additions (a
//! row-parallel product is summed over ranks instead of inside one dot product; the cross
//! entropy's sum of exponentials is summed per slice; a pipeline adds the micro-batches in
//! schedule order), so the differences are rounding, about 1e-7 relative; a wrong slice, a
//! missing reduction or a lost micro-batch gives errors of order one.

mod support;

use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use support::{random_batch, rel_err, report};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::Batch;
use tilearn_engine::model::model_parallel::{PipelineShard, assemble_ranks, partition_layers};
use tilearn_engine::model::tensor_parallel::{
    ShardPlan, TensorShard, assemble_params, slice_params,
};
use tilearn_engine::model::{Activations, LlamaForCausalLM};
use tilearn_engine::trainer::StepBackend;
use tilearn_engine::trainer::model_parallel::{
    ModelParallelComms, ModelParallelCpuBackend, ModelParallelLayout,
};
use tilearn_ops::DType;
use tilearn_optim::{AdamW, AdamWConfig, ParamGroup};
use tilearn_parallel::host::run_on_threads;
use tilearn_parallel::pipeline::ScheduleKind;
use tilearn_parallel::{Communicator, host::HostCommunicator};

/// 4 query heads, 2 kv heads (so tp 4 replicates them), an odd vocabulary (uneven slices), 4
/// layers (so 2 stages × 2 virtual stages have a layer each).
fn config(tied: bool) -> LlamaConfig {
    let json = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 67,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": {tied}}}"#
    );
    LlamaConfig::from_json_str(&json, "test/config.json").unwrap()
}

const BATCH: usize = 2;
const SEQ: usize = 12;
/// Micro-batches of one step.
const MICRO: usize = 4;

fn batch(seed: u64, vocab: usize) -> Batch {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (input_ids, labels) = random_batch(&mut rng, vocab, BATCH, SEQ);
    Batch {
        input_ids,
        labels,
        positions: None,
        batch: BATCH,
        seq_len: SEQ,
    }
}

fn batches(seed: u64, vocab: usize) -> Vec<Batch> {
    (0..MICRO as u64)
        .map(|i| batch(seed * 100 + i, vocab))
        .collect()
}

fn denominator(batches: &[Batch]) -> f64 {
    batches
        .iter()
        .map(|b| tilearn_engine::model::count_valid_targets(&b.labels, BATCH, SEQ))
        .sum::<usize>() as f64
}

/// Loss and full-layout gradients of one process over the micro-batches.
fn reference(model: &LlamaForCausalLM, batches: &[Batch]) -> (f64, Vec<f32>) {
    let mut acts = Activations::new(&model.config, BATCH, SEQ, false);
    let mut grads = vec![0.0; model.params.numel()];
    let denom = denominator(batches);
    let mut loss = 0.0;
    for b in batches {
        let stats = model
            .forward_backward(
                &b.input_ids,
                &b.labels,
                BATCH,
                SEQ,
                Some(denom),
                &mut acts,
                &mut grads,
            )
            .unwrap();
        loss += stats.loss_sum;
    }
    (loss, grads)
}

fn optimizer(params: &tilearn_engine::params::ParamStore) -> tilearn_engine::Result<AdamW> {
    let groups = vec![ParamGroup {
        name: "all".into(),
        ranges: std::iter::once(0..params.numel()).collect(),
        weight_decay: 0.0,
        lr_scale: 1.0,
    }];
    Ok(AdamW::new(AdamWConfig::default(), groups, params.numel())?)
}

/// How a test splits the model.
#[derive(Clone, Copy)]
struct Split {
    tp: usize,
    pp: usize,
    schedule: ScheduleKind,
    recompute: bool,
    sequence: bool,
}

fn chunks(schedule: ScheduleKind) -> usize {
    match schedule {
        ScheduleKind::Interleaved { virtual_stages } => virtual_stages,
        _ => 1,
    }
}

/// This thread's groups, as the launcher's layout makes them (tp innermost, one replica).
fn groups(world: &HostCommunicator, tp: usize, pp: usize) -> ModelParallelComms {
    let mut comms = ModelParallelComms::default();
    for stage in 0..pp {
        let ranks: Vec<usize> = (stage * tp..(stage + 1) * tp).collect();
        if let Some(g) = world.new_group(&ranks).unwrap() {
            comms.tp = Some(Arc::from(g)).filter(|_| tp > 1);
        }
    }
    for t in 0..tp {
        let ranks: Vec<usize> = (0..pp).map(|stage| stage * tp + t).collect();
        if let Some(g) = world.new_group(&ranks).unwrap() {
            comms.pp = Some(Arc::from(g)).filter(|_| pp > 1);
        }
    }
    let all: Vec<usize> = (0..tp * pp).collect();
    comms.replica = world
        .new_group(&all)
        .unwrap()
        .map(Arc::from)
        .filter(|_: &Arc<dyn Communicator>| tp * pp > 1);
    comms
}

/// Every rank's step loss, its place and its local gradients (replicated kv heads summed).
fn split_run(
    model: &LlamaForCausalLM,
    batches: &[Batch],
    split: Split,
) -> Vec<(f64, TensorShard, PipelineShard, Vec<f32>)> {
    let world = split.tp * split.pp;
    run_on_threads(
        world,
        Duration::from_secs(60),
        |rank, comm: HostCommunicator| {
            let comms = groups(&comm, split.tp, split.pp);
            let tp = TensorShard {
                rank: rank % split.tp,
                size: split.tp,
            };
            let pipe = PipelineShard::balanced(
                &model.config,
                rank / split.tp,
                split.pp,
                chunks(split.schedule),
                SEQ,
            )
            .unwrap();
            let layout = ModelParallelLayout {
                tp,
                pipe: pipe.clone(),
                schedule: split.schedule,
                sequence_parallel: split.sequence,
            };
            let mut backend = ModelParallelCpuBackend::new(
                model,
                layout,
                comms,
                optimizer,
                (BATCH, SEQ),
                split.recompute,
            )
            .unwrap();
            backend.zero_grads();
            let loss = backend
                .forward_backward_step(batches, denominator(batches), DType::F32, 1.0)
                .expect("the backend runs whole steps")
                .unwrap();
            let grads = backend.flat_gradients().unwrap().host().unwrap().to_vec();
            (loss, tp, pipe, grads)
        },
    )
    .unwrap()
}

fn check_split(split: Split, tied: bool) {
    check_split_model(split, config(tied), tied);
}

fn check_split_model(split: Split, config: LlamaConfig, tied: bool) {
    let mut model = LlamaForCausalLM::from_config(config, 7);
    // Biases start at zero; give them values so a bias lost in the split shows.
    for spec in model.params.specs.clone() {
        if spec.name.ends_with(".bias") {
            for (i, x) in model.params.data[spec.range()].iter_mut().enumerate() {
                *x = 0.1 * ((i % 7) as f32 - 3.0);
            }
        }
    }
    let micro = batches(
        11 + split.tp as u64 + 10 * split.pp as u64,
        model.config.vocab_size,
    );
    let (loss, grads) = reference(&model, &micro);
    let ranks = split_run(&model, &micro, split);
    let parts: Vec<(TensorShard, PipelineShard, &[f32])> = ranks
        .iter()
        .map(|(_, tp, pipe, g)| (*tp, pipe.clone(), g.as_slice()))
        .collect();
    let assembled = assemble_ranks(&model.config, &parts).unwrap();
    let grad_err = rel_err(&assembled.data, &grads);
    for (rank, (l, ..)) in ranks.iter().enumerate() {
        let loss_err = (l - loss).abs() / loss.abs();
        assert!(
            loss_err < 1e-5,
            "rank {rank}: loss {l} vs {loss} ({loss_err:e})"
        );
    }
    report(&format!(
        "model parallel tp={} pp={} {} recompute={} sequence={} tied={tied}: loss {:.7} vs {loss:.7}, gradient rel err {grad_err:.2e}",
        split.tp, split.pp, split.schedule, split.recompute, split.sequence, ranks[0].0
    ));
    assert!(grad_err < 2e-5, "gradient rel err {grad_err:e}");
    // Each tensor, so a wrong slice cannot hide in the norm of the whole buffer.
    for spec in &model.params.specs {
        let r = spec.range();
        let e = rel_err(&assembled.data[r.clone()], &grads[r]);
        assert!(e < 1e-4, "{} rel err {e:e}", spec.name);
    }
}

const TP: Split = Split {
    tp: 2,
    pp: 1,
    schedule: ScheduleKind::OneFOneB,
    recompute: false,
    sequence: false,
};

#[test]
fn two_ranks_compute_the_whole_models_loss_and_gradients() {
    check_split(TP, false);
}

#[test]
fn four_ranks_replicate_two_kv_heads_and_sum_their_gradients() {
    check_split(Split { tp: 4, ..TP }, false);
}

#[test]
fn tied_embeddings_and_recomputation_split_too() {
    check_split(
        Split {
            recompute: true,
            ..TP
        },
        true,
    );
}

#[test]
fn two_stages_with_1f1b_and_gpipe_equal_one_process() {
    for schedule in [ScheduleKind::OneFOneB, ScheduleKind::GPipe] {
        check_split(
            Split {
                tp: 1,
                pp: 2,
                schedule,
                recompute: false,
                sequence: false,
            },
            false,
        );
    }
}

#[test]
fn interleaved_stages_on_two_ranks_and_on_one_equal_one_process() {
    for pp in [2, 1] {
        check_split(
            Split {
                tp: 1,
                pp,
                schedule: ScheduleKind::Interleaved { virtual_stages: 2 },
                recompute: true,
                sequence: false,
            },
            false,
        );
    }
}

#[test]
fn tensor_and_pipeline_parallel_together_equal_one_process() {
    check_split(
        Split {
            tp: 2,
            pp: 2,
            schedule: ScheduleKind::OneFOneB,
            recompute: false,
            sequence: false,
        },
        false,
    );
}

/// The [`config`] shape as another family: `architecture` plus its own keys.
fn family_config(architecture: &str, extra: &str) -> LlamaConfig {
    let json = format!(
        r#"{{"architectures": ["{architecture}"], "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 67,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5{extra}}}"#
    );
    LlamaConfig::from_json_str(&json, "test/config.json").unwrap()
}

/// Qwen2's q/k/v biases split with their heads and its sliding layers (from layer 2, window 5
/// of 12 tokens) keep their mask on every rank; Mistral's window likewise; Baichuan2's W_pack
/// and NormHead across pipeline stages.
#[test]
fn families_split_like_one_process() {
    let qwen2 = family_config(
        "Qwen2ForCausalLM",
        r#", "num_key_value_heads": 2, "use_sliding_window": true, "sliding_window": 5,
           "max_window_layers": 2"#,
    );
    let mistral = family_config(
        "MistralForCausalLM",
        r#", "num_key_value_heads": 2, "sliding_window": 5"#,
    );
    let baichuan2 = family_config("BaichuanForCausalLM", "");
    let tp_pp = Split {
        tp: 2,
        pp: 2,
        schedule: ScheduleKind::OneFOneB,
        recompute: false,
        sequence: false,
    };
    check_split_model(TP, qwen2.clone(), false);
    check_split_model(tp_pp, qwen2, false);
    check_split_model(TP, mistral, false);
    check_split_model(Split { tp: 1, ..tp_pp }, baichuan2.clone(), false);
    let err = ShardPlan::new(&baichuan2, TensorShard { rank: 0, size: 2 })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("W_pack") && err.contains("--tp-size 1"),
        "{err}"
    );
}

/// Sequence parallelism (each rank holds its chunk of the 24 token rows between the products,
/// gathered and reduce-scattered instead of all-reduced, and the norms' gradients summed over
/// the ranks) gives the whole model's loss and gradients within the same bounds: tp 2, tp 4
/// with replicated kv heads and recomputation, and tp 2 × pp 2 (the stages exchange each
/// rank's rows only).
#[test]
fn sequence_parallelism_equals_one_process() {
    for (tp, pp, recompute) in [(2, 1, false), (4, 1, true), (2, 2, false)] {
        check_split(
            Split {
                tp,
                pp,
                schedule: ScheduleKind::OneFOneB,
                recompute,
                sequence: true,
            },
            false,
        );
    }
}

/// Sequence parallelism splits a batch's token rows over the tensor-parallel ranks: 2 × 11
/// rows over 4 ranks are refused by name (which also shows the split is in effect).
#[test]
fn sequence_parallelism_refuses_rows_that_do_not_divide() {
    let model = LlamaForCausalLM::from_config(config(false), 3);
    let mut odd = batch(5, model.config.vocab_size);
    odd.seq_len = 11;
    odd.input_ids.truncate(BATCH * 11);
    odd.labels.truncate(BATCH * 11);
    let errors = run_on_threads(
        4,
        Duration::from_secs(60),
        |rank, comm: HostCommunicator| {
            let layout = ModelParallelLayout {
                tp: TensorShard { rank, size: 4 },
                pipe: PipelineShard::single(&model.config),
                schedule: ScheduleKind::OneFOneB,
                sequence_parallel: true,
            };
            let comms = groups(&comm, 4, 1);
            let mut backend =
                ModelParallelCpuBackend::new(&model, layout, comms, optimizer, (BATCH, SEQ), false)
                    .unwrap();
            let odd = std::slice::from_ref(&odd);
            match backend.forward_backward_step(odd, 10.0, DType::F32, 1.0) {
                Some(Err(e)) => e.to_string(),
                _ => String::new(),
            }
        },
    )
    .unwrap();
    for e in errors {
        assert!(e.contains("--sequence-parallel") && e.contains("22"), "{e}");
    }
}

#[test]
fn layers_are_balanced_with_the_head_on_the_last_stage_or_as_given() {
    let mut cfg = config(false);
    cfg.num_hidden_layers = 8;
    cfg.vocab_size = 20_000;
    let parts = partition_layers(&cfg, 4, SEQ).unwrap();
    assert_eq!(parts.len(), 4);
    assert_eq!(parts.first().unwrap().start, 0);
    assert_eq!(parts.last().unwrap().end, 8);
    assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
    // The large vocabulary's head costs more than a layer: the last stage gets fewer layers.
    assert!(parts[3].len() < parts[0].len(), "{parts:?}");
    let err = partition_layers(&cfg, 9, SEQ).unwrap_err().to_string();
    assert!(err.contains("num_hidden_layers = 8"), "{err}");
    let err = PipelineShard::balanced(&config(true), 0, 2, 1, SEQ)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tie_word_embeddings"), "{err}");
    // --pp-layers overrides the cut, checked against the model.
    let given = PipelineShard::with_layer_counts(&cfg, 1, 2, 2, &[1, 3, 2, 2]).unwrap();
    assert_eq!(given.partition, vec![0..1, 1..4, 4..6, 6..8]);
    for bad in [&[4, 4][..], &[2, 2, 2, 1], &[0, 4, 2, 2]] {
        let err = PipelineShard::with_layer_counts(&cfg, 0, 2, 2, bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--pp-layers") && err.contains("= 8"), "{err}");
    }
}

#[test]
fn slicing_then_assembling_gives_back_every_weight() {
    let model = LlamaForCausalLM::from_config(config(false), 3);
    for tp in [1, 2, 4] {
        let parts: Vec<Vec<f32>> = (0..tp)
            .map(|rank| {
                let plan = ShardPlan::new(&model.config, TensorShard { rank, size: tp }).unwrap();
                slice_params(&model.params, &model.config, &plan).data
            })
            .collect();
        let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
        let back = assemble_params(&model.config, &refs).unwrap();
        assert_eq!(back.data, model.params.data, "tp {tp}");
        // The vocabulary of 67 is cut unevenly: 34 + 33 rows for tp 2.
        if tp == 2 {
            let plan = ShardPlan::new(&model.config, TensorShard { rank: 1, size: 2 }).unwrap();
            assert_eq!(plan.vocab, 34..67);
        }
    }
}

#[test]
fn sizes_that_cannot_be_split_are_named() {
    let model = LlamaForCausalLM::from_config(config(false), 3);
    let err = ShardPlan::new(&model.config, TensorShard { rank: 0, size: 3 })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--tp-size") && err.contains("num_attention_heads = 4"),
        "{err}"
    );
    let mut odd = config(false);
    odd.intermediate_size = 50;
    odd.num_attention_heads = 8;
    odd.head_dim = 4;
    let err = ShardPlan::new(&odd, TensorShard { rank: 0, size: 4 })
        .unwrap_err()
        .to_string();
    assert!(err.contains("intermediate_size = 50"), "{err}");
}

#[test]
fn the_eval_loss_of_the_split_model_is_the_whole_models() {
    let model = LlamaForCausalLM::from_config(config(false), 5);
    let b = batch(99, model.config.vocab_size);
    let mut acts = Activations::new(&model.config, BATCH, SEQ, false);
    let whole = model
        .forward_loss_with(
            &model.params.data,
            &b.input_ids,
            &b.labels,
            BATCH,
            SEQ,
            &mut acts,
        )
        .unwrap();
    // tp 2 × pp 2: the vocabulary-parallel loss on the last stage, carried to every rank.
    let losses = run_on_threads(
        4,
        Duration::from_secs(60),
        |rank, comm: HostCommunicator| {
            let comms = groups(&comm, 2, 2);
            let layout = ModelParallelLayout {
                tp: TensorShard {
                    rank: rank % 2,
                    size: 2,
                },
                pipe: PipelineShard::balanced(&model.config, rank / 2, 2, 1, SEQ).unwrap(),
                schedule: ScheduleKind::OneFOneB,
                sequence_parallel: false,
            };
            let mut backend =
                ModelParallelCpuBackend::new(&model, layout, comms, optimizer, (BATCH, SEQ), false)
                    .unwrap();
            backend.eval_loss(&b, DType::F32).unwrap()
        },
    )
    .unwrap();
    for l in losses {
        assert_eq!(l.valid_tokens, whole.valid_tokens);
        let err = (l.loss_sum - whole.loss_sum).abs() / whole.loss_sum;
        assert!(err < 1e-5, "{} vs {} ({err:e})", l.loss_sum, whole.loss_sum);
    }
}
