//! Evaluation during training: the eval_loss the Trainer logs is the mean token loss of the
//! eval windows under the trained weights, as the CPU model computes it directly, and a bad
//! eval set is refused before training, naming `--eval-data` and the directory.

use std::ops::Range;
use std::path::Path;

use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::{DataLoader, LoaderOptions, TokenDataset, prepare_embedded_default};
use tilearn_engine::model::{Activations, LlamaForCausalLM};
use tilearn_engine::trainer::{
    EvalSet, EvalStrategy, PrintLogs, TrainLength, Trainer, TrainingArguments, log,
};

const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
 "num_key_value_heads": 1, "vocab_size": 257, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;

const SEQ: usize = 32;

fn config() -> LlamaConfig {
    LlamaConfig::from_json_str(CONFIG, "<test config>").unwrap()
}

/// The mean next-token cross entropy (f64 log-softmax of the model's logits) over the
/// `SEQ`-token windows `windows` of `data`, one window at a time.
fn direct_mean_loss(model: &LlamaForCausalLM, data: &TokenDataset, windows: Range<usize>) -> f64 {
    let vocab = model.config.vocab_size;
    let mut acts = Activations::<f32>::new(&model.config, 1, SEQ, false);
    let (mut sum, mut count) = (0.0f64, 0usize);
    for w in windows {
        let ids = data.tokens(w * SEQ..(w + 1) * SEQ).unwrap();
        let logits = model.forward_logits(&ids, 1, SEQ, &mut acts).unwrap();
        for t in 0..SEQ - 1 {
            let row = &logits[t * vocab..(t + 1) * vocab];
            let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
            let log_z = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            sum += log_z - row[ids[t + 1] as usize] as f64;
            count += 1;
        }
    }
    sum / count as f64
}

fn args(out: &Path) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        length: TrainLength::MaxSteps(4),
        per_device_train_batch_size: 4,
        // A partial last eval batch: the windows are not a multiple of 3.
        per_device_eval_batch_size: Some(3),
        seq_len: SEQ,
        learning_rate: 3e-3,
        logging_steps: 1,
        save_steps: 0,
        eval_strategy: EvalStrategy::Steps,
        eval_steps: Some(2),
        ..TrainingArguments::default()
    }
}

/// A CPU Trainer of the tiny model (seed 7) on the prepared data `train`.
fn cpu_trainer(args: TrainingArguments, train: &Path) -> Trainer {
    let model = LlamaForCausalLM::from_config(config(), 7);
    Trainer::new(args, model, TokenDataset::open(train).unwrap()).unwrap()
}

#[test]
fn eval_loss_is_the_models_mean_token_loss_on_the_eval_windows() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = (dir.path().join("train"), dir.path().join("eval"));
    prepare_embedded_default(&train, 7, 300).unwrap();
    prepare_embedded_default(&eval, 11, 21).unwrap();
    let mut trainer = cpu_trainer(args(&dir.path().join("run")), &train);
    trainer
        .set_eval_dataset(TokenDataset::open(&eval).unwrap())
        .unwrap();
    trainer.train(None, &mut PrintLogs).unwrap();

    let log_path = dir.path().join("run").join(log::LOG_FILE);
    let evals = log::read_eval_log(&log_path).unwrap();
    assert_eq!(
        evals.iter().map(|r| r.step).collect::<Vec<_>>(),
        [2, 4],
        "{evals:?}"
    );
    // The training records still read back on their own.
    assert_eq!(log::read_log(&log_path).unwrap().len(), 4);

    let eval_data = TokenDataset::open(&eval).unwrap();
    let windows = eval_data.num_tokens() / SEQ;
    assert!(
        !windows.is_multiple_of(3),
        "the test wants a partial last batch"
    );
    let last = &evals[1];
    assert_eq!(last.eval_tokens, (windows * (SEQ - 1)) as u64);
    let direct = direct_mean_loss(trainer.model().unwrap(), &eval_data, 0..windows);
    let rel = (last.eval_loss - direct).abs() / direct;
    assert!(
        rel < 1e-6,
        "eval_loss {} vs direct {direct} (rel {rel:e})",
        last.eval_loss
    );
    assert_eq!(last.eval_perplexity, last.eval_loss.exp());
    assert!(evals[0].eval_loss.is_finite() && evals[0].eval_loss != last.eval_loss);
}

#[test]
fn validation_split_evaluates_the_held_out_last_windows_and_never_trains_on_them() {
    let dir = tempfile::tempdir().unwrap();
    let train = dir.path().join("train");
    prepare_embedded_default(&train, 7, 60).unwrap();
    let data = TokenDataset::open(&train).unwrap();
    let total = data.num_tokens() / SEQ;
    let held = total * 10 / 100;
    let kept = total - held;

    // The loader of a split run visits only the first windows.
    let options = LoaderOptions {
        windows: Some(kept),
        ..LoaderOptions::new(4, SEQ, 3)
    };
    let mut loader =
        DataLoader::with_options(TokenDataset::open(&train).unwrap(), options, None).unwrap();
    assert_eq!(loader.num_windows(), kept);
    let first_held = data.tokens(kept * SEQ..(kept + 1) * SEQ).unwrap();
    for _ in 0..loader.batches_per_epoch() {
        let batch = loader.next_batch().unwrap();
        assert!(
            batch
                .input_ids
                .chunks(SEQ)
                .all(|row| row != first_held.as_slice())
        );
    }

    let split = TrainingArguments {
        validation_split_percentage: Some(10.0),
        per_device_eval_batch_size: None,
        ..args(&dir.path().join("run"))
    };
    let mut trainer = cpu_trainer(split, &train);
    trainer.train(None, &mut PrintLogs).unwrap();
    let evals = log::read_eval_log(&dir.path().join("run").join(log::LOG_FILE)).unwrap();
    assert_eq!(evals.iter().map(|r| r.step).collect::<Vec<_>>(), [2, 4]);
    let last = &evals[1];
    assert_eq!(last.eval_tokens, (held * (SEQ - 1)) as u64);
    let direct = direct_mean_loss(trainer.model().unwrap(), &data, kept..total);
    let rel = (last.eval_loss - direct).abs() / direct;
    assert!(
        rel < 1e-6,
        "eval_loss {} vs direct {direct}",
        last.eval_loss
    );

    let bad = TrainingArguments {
        validation_split_percentage: Some(100.0),
        ..args(&dir.path().join("bad"))
    };
    let mut trainer = cpu_trainer(bad, &train);
    let err = trainer.train(None, &mut PrintLogs).unwrap_err().to_string();
    assert!(err.contains("--validation-split-percentage"), "{err}");
}

#[test]
fn an_eval_set_with_a_larger_vocabulary_or_no_whole_window_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let eval = dir.path().join("eval");
    prepare_embedded_default(&eval, 11, 1).unwrap();
    let data = || TokenDataset::open(&eval).unwrap();
    let message = |e: tilearn_engine::EngineError| e.to_string();

    let err = message(
        EvalSet::new(data(), 100, SEQ)
            .err()
            .expect("vocab 257 > 100"),
    );
    assert!(err.contains("--eval-data") && err.contains("eval"), "{err}");
    assert!(err.contains("257") && err.contains("100"), "{err}");

    let too_long = data().num_tokens() + 1;
    let err = message(
        EvalSet::new(data(), 257, too_long)
            .err()
            .expect("no window"),
    );
    assert!(
        err.contains("--eval-data") && err.contains("less than one window"),
        "{err}"
    );
}

#[test]
fn an_eval_strategy_without_an_eval_set_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let train = dir.path().join("train");
    prepare_embedded_default(&train, 7, 50).unwrap();
    let mut trainer = cpu_trainer(args(&dir.path().join("run")), &train);
    let err = trainer.train(None, &mut PrintLogs).unwrap_err().to_string();
    assert!(
        err.contains("--eval-strategy") && err.contains("--eval-data"),
        "{err}"
    );
}
