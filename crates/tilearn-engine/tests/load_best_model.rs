//! `--load-best-model-at-end`: the final model is the weights of the checkpoint with the lowest
//! logged eval loss, that checkpoint survives `--save-total-limit`, and the trainer state names
//! it with Hugging Face's fields.

use std::path::Path;

use tilearn_engine::checkpoint::load_params;
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::{TokenDataset, prepare_embedded_default};
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_engine::trainer::checkpoint::{checkpoint_dir, checkpoints};
use tilearn_engine::trainer::state::{TRAINER_STATE_FILE, TrainerState, read_json};
use tilearn_engine::trainer::{
    EvalStrategy, PrintLogs, TrainLength, Trainer, TrainingArguments, log,
};

const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
 "num_key_value_heads": 1, "vocab_size": 257, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;

const SEQ: usize = 32;

fn run(out: &Path, train: &Path, eval: &Path) {
    let args = TrainingArguments {
        output_dir: out.to_path_buf(),
        length: TrainLength::MaxSteps(10),
        per_device_train_batch_size: 4,
        seq_len: SEQ,
        // A learning rate far too high, constant: the eval loss first falls, then the run
        // becomes unstable, so the best checkpoint is not the last one.
        learning_rate: 6e-2,
        lr_scheduler_type: "constant".into(),
        max_grad_norm: 0.0,
        logging_steps: 1,
        save_steps: 2,
        save_total_limit: Some(1),
        eval_strategy: EvalStrategy::Steps,
        eval_steps: Some(2),
        load_best_model_at_end: true,
        ..TrainingArguments::default()
    };
    let config = LlamaConfig::from_json_str(CONFIG, "<test config>").unwrap();
    let model = LlamaForCausalLM::from_config(config, 7);
    let mut trainer = Trainer::new(args, model, TokenDataset::open(train).unwrap()).unwrap();
    trainer
        .set_eval_dataset(TokenDataset::open(eval).unwrap())
        .unwrap();
    trainer.train(None, &mut PrintLogs).unwrap();
}

#[test]
fn final_model_is_the_best_checkpoint_which_rotation_keeps() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval, out) = (
        dir.path().join("train"),
        dir.path().join("eval"),
        dir.path().join("run"),
    );
    prepare_embedded_default(&train, 7, 300).unwrap();
    prepare_embedded_default(&eval, 11, 21).unwrap();
    run(&out, &train, &eval);

    let evals = log::read_eval_log(&out.join(log::LOG_FILE)).unwrap();
    let best = evals
        .iter()
        .min_by(|a, b| a.eval_loss.total_cmp(&b.eval_loss))
        .unwrap();
    let last = evals.last().unwrap();
    assert_eq!(last.step, 10, "{evals:?}");
    assert!(
        best.step < last.step,
        "the test needs a best checkpoint before the last: eval losses {:?}",
        evals.iter().map(|r| r.eval_loss).collect::<Vec<_>>()
    );

    // Rotation (limit 1) keeps the best and the newest.
    let left: Vec<u64> = checkpoints(&out).into_iter().map(|(s, _)| s).collect();
    assert_eq!(left, [best.step, 10]);

    // The state names the best with its metric, as Hugging Face's trainer_state.json does.
    let state: TrainerState =
        read_json(&checkpoint_dir(&out, 10).join(TRAINER_STATE_FILE)).unwrap();
    assert_eq!(state.best.best_metric, Some(best.eval_loss));
    assert_eq!(
        state.best.best_model_checkpoint.as_deref(),
        Some(checkpoint_dir(&out, best.step).as_path())
    );

    // The final model holds the best checkpoint's weights, not the last step's.
    let config = LlamaConfig::from_json_str(CONFIG, "<test config>").unwrap();
    let final_model = load_params(&out, &config).unwrap();
    let best_model = load_params(&checkpoint_dir(&out, best.step), &config).unwrap();
    let last_model = load_params(&checkpoint_dir(&out, 10), &config).unwrap();
    assert!(final_model.data == best_model.data);
    assert!(final_model.data != last_model.data);
}
