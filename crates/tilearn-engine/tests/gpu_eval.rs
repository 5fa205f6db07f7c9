//! Evaluation on the GPU: the CUDA engine's forward-only eval loss of an eval set equals the
//! CPU engine's in fp32, and a Trainer on the GPU logs eval records.
//!
//! Without a GPU or driver each test prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

mod support;

use support::{gpu_or_skip, report};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::{TokenDataset, prepare_embedded_default};
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_engine::trainer::gpu_backend::GpuBackend;
use tilearn_engine::trainer::{
    CpuBackend, DataParallel, EvalSet, EvalStrategy, PrintLogs, TrainLength, Trainer,
    TrainingArguments, adamw_for, log,
};
use tilearn_ops::DType;

const TINY: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
 "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "vocab_size": 257, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;

fn args(out: &std::path::Path) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        length: TrainLength::MaxSteps(4),
        per_device_train_batch_size: 4,
        per_device_eval_batch_size: Some(3),
        seq_len: 64,
        learning_rate: 3e-3,
        logging_steps: 1,
        save_steps: 0,
        eval_strategy: EvalStrategy::Steps,
        eval_steps: Some(2),
        ..TrainingArguments::default()
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn gpu_eval_loss_matches_the_cpu_in_fp32() {
    if gpu_or_skip("gpu_eval_loss_matches_the_cpu_in_fp32").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let eval = dir.path().join("eval");
    prepare_embedded_default(&eval, 11, 40).unwrap();
    let config = LlamaConfig::from_json_str(TINY, "<test config>").unwrap();
    let model = LlamaForCausalLM::from_config(config.clone(), 7);
    let a = args(&dir.path().join("run"));
    let set = EvalSet::new(TokenDataset::open(&eval).unwrap(), 257, a.seq_len).unwrap();
    let dp = DataParallel::single(model.params.numel());
    let optimizer = adamw_for(&a, &model.params).unwrap();
    let mut cpu = CpuBackend::new(model.clone(), optimizer, 4, a.seq_len, false);
    let mut gpu = GpuBackend::new(model, &a, 0, &[DType::F32]).unwrap();
    let on_cpu = set.evaluate(&mut cpu, &dp, 3, None, DType::F32).unwrap();
    let on_gpu = set.evaluate(&mut gpu, &dp, 3, None, DType::F32).unwrap();
    let rel = (on_gpu.mean - on_cpu.mean).abs() / on_cpu.mean;
    report(&format!(
        "eval_loss cpu {} gpu {} (rel {rel:e}) over {} tokens",
        on_cpu.mean, on_gpu.mean, on_cpu.tokens
    ));
    assert_eq!(on_gpu.tokens, on_cpu.tokens);
    assert!(rel < 1e-4, "gpu {on_gpu:?} vs cpu {on_cpu:?}");
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn trainer_on_the_gpu_logs_eval_records() {
    if gpu_or_skip("trainer_on_the_gpu_logs_eval_records").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = (dir.path().join("train"), dir.path().join("eval"));
    prepare_embedded_default(&train, 7, 300).unwrap();
    prepare_embedded_default(&eval, 11, 40).unwrap();
    let config = LlamaConfig::from_json_str(TINY, "<test config>").unwrap();
    let model = LlamaForCausalLM::from_config(config.clone(), 7);
    let a = args(&dir.path().join("run"));
    let backend = GpuBackend::new(model, &a, 0, &[DType::BF16]).unwrap();
    let mut trainer = Trainer::with_backend(
        a,
        config,
        Box::new(backend),
        TokenDataset::open(&train).unwrap(),
    )
    .unwrap();
    trainer.set_amp_plan(adaptfp16::AmpPlan::Fixed(DType::BF16));
    trainer
        .set_eval_dataset(TokenDataset::open(&eval).unwrap())
        .unwrap();
    trainer.train(None, &mut PrintLogs).unwrap();
    let evals = log::read_eval_log(&dir.path().join("run").join(log::LOG_FILE)).unwrap();
    assert_eq!(evals.iter().map(|r| r.step).collect::<Vec<_>>(), [2, 4]);
    for r in &evals {
        assert!(r.eval_loss.is_finite() && r.precision == "bf16", "{r:?}");
    }
}
