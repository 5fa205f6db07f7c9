//! Tensor parallelism on the CPU engine: ranks on threads joined by the host communicator (the
//! transport between processes, over loopback) compute the loss and gradients of the whole
//! model from their slices.
//!
//! Tolerances: the loss to 1e-5 relative and the gradients to 2e-5 relative (‖Δ‖/‖ref‖) of one
//! process. The split changes only the order of f32 additions (a row-parallel product is summed
//! over ranks instead of inside one dot product; the cross entropy's sum of exponentials is
//! summed per slice), so the differences are rounding, about 1e-7 relative; a wrong slice or a
//! missing reduction gives errors of order one.

mod support;

use std::time::Duration;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use support::{random_batch, rel_err, report};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::Batch;
use tilearn_engine::model::tensor_parallel::{
    ShardPlan, TensorParallelLlama, TensorShard, assemble_params, slice_params,
};
use tilearn_engine::model::{Activations, LlamaForCausalLM};
use tilearn_engine::trainer::StepBackend;
use tilearn_engine::trainer::tensor_parallel::TensorParallelCpuBackend;
use tilearn_ops::DType;
use tilearn_optim::{AdamW, AdamWConfig, ParamGroup};
use tilearn_parallel::host::run_on_threads;
use tilearn_parallel::{Communicator, host::HostCommunicator};

/// 4 query heads, 2 kv heads (so tp 4 replicates them), an odd vocabulary (uneven slices).
fn config(tied: bool) -> LlamaConfig {
    let json = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 67,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": {tied}}}"#
    );
    LlamaConfig::from_json_str(&json, "test/config.json").unwrap()
}

const BATCH: usize = 2;
const SEQ: usize = 12;

fn batch(seed: u64, vocab: usize) -> Batch {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (input_ids, labels) = random_batch(&mut rng, vocab, BATCH, SEQ);
    Batch {
        input_ids,
        labels,
        batch: BATCH,
        seq_len: SEQ,
    }
}

/// Loss and full-layout gradients of one process.
fn reference(model: &LlamaForCausalLM, b: &Batch) -> (f64, Vec<f32>) {
    let mut acts = Activations::new(&model.config, BATCH, SEQ, false);
    let mut grads = vec![0.0; model.params.numel()];
    let stats = model
        .forward_backward(
            &b.input_ids,
            &b.labels,
            BATCH,
            SEQ,
            None,
            &mut acts,
            &mut grads,
        )
        .unwrap();
    (stats.loss_sum, grads)
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

/// Every rank's loss and its local gradients (replicated kv heads already summed).
fn split_run(
    model: &LlamaForCausalLM,
    b: &Batch,
    tp: usize,
    checkpointing: bool,
) -> Vec<(f64, Vec<f32>)> {
    run_on_threads(tp, Duration::from_secs(60), |_, comm: HostCommunicator| {
        let comm: std::sync::Arc<dyn Communicator> = std::sync::Arc::new(comm);
        let mut backend =
            TensorParallelCpuBackend::new(model, comm, optimizer, BATCH, SEQ, checkpointing)
                .unwrap();
        backend.zero_grads();
        let denominator = tilearn_engine::model::count_valid_targets(&b.labels, BATCH, SEQ);
        let loss = backend
            .forward_backward(b, denominator as f64, DType::F32, 1.0)
            .unwrap();
        let grads = backend.flat_gradients().unwrap().host().unwrap().to_vec();
        (loss, grads)
    })
    .unwrap()
}

fn check_split(tp: usize, tied: bool, checkpointing: bool) {
    let model = LlamaForCausalLM::from_config(config(tied), 7);
    let b = batch(11 + tp as u64, model.config.vocab_size);
    let (loss, grads) = reference(&model, &b);
    let ranks = split_run(&model, &b, tp, checkpointing);
    let parts: Vec<&[f32]> = ranks.iter().map(|(_, g)| g.as_slice()).collect();
    let assembled = assemble_params(&model.config, &parts).unwrap();
    let grad_err = rel_err(&assembled.data, &grads);
    for (rank, (l, _)) in ranks.iter().enumerate() {
        let loss_err = (l - loss).abs() / loss.abs();
        assert!(
            loss_err < 1e-5,
            "tp {tp} rank {rank}: loss {l} vs {loss} ({loss_err:e})"
        );
    }
    report(&format!(
        "tensor parallel tp={tp} tied={tied} checkpointing={checkpointing}: loss {:.7} vs {loss:.7}, gradient rel err {grad_err:.2e}",
        ranks[0].0
    ));
    assert!(grad_err < 2e-5, "tp {tp}: gradient rel err {grad_err:e}");
    // Each tensor, so a wrong slice cannot hide in the norm of the whole buffer.
    for spec in &model.params.specs {
        let r = spec.range();
        let e = rel_err(&assembled.data[r.clone()], &grads[r]);
        assert!(e < 1e-4, "tp {tp}: {} rel err {e:e}", spec.name);
    }
}

#[test]
fn two_ranks_compute_the_whole_models_loss_and_gradients() {
    check_split(2, false, false);
}

#[test]
fn four_ranks_replicate_two_kv_heads_and_sum_their_gradients() {
    check_split(4, false, false);
}

#[test]
fn tied_embeddings_and_recomputation_split_too() {
    check_split(2, true, true);
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
    let err = TensorParallelLlama::from_full(&model, TensorShard { rank: 0, size: 3 })
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
    let losses = run_on_threads(2, Duration::from_secs(60), |_, comm: HostCommunicator| {
        let comm: std::sync::Arc<dyn Communicator> = std::sync::Arc::new(comm);
        let mut backend =
            TensorParallelCpuBackend::new(&model, comm, optimizer, BATCH, SEQ, false).unwrap();
        backend.eval_loss(&b, DType::F32).unwrap()
    })
    .unwrap();
    for l in losses {
        assert_eq!(l.valid_tokens, whole.valid_tokens);
        let err = (l.loss_sum - whole.loss_sum).abs() / whole.loss_sum;
        assert!(err < 1e-5, "{} vs {} ({err:e})", l.loss_sum, whole.loss_sum);
    }
}
