//! The Trainer's save rules on the CPU with a small model: the final model survives failing
//! checkpoint writes (injected I/O errors, a disk that fills up during the run) and the
//! previous checkpoint stays resumable; the disk check refuses at start a run that cannot save;
//! `--save-steps 0` / `--save-strategy no` write no checkpoint; `--save-total-limit` rotates;
//! `--save-only-model` checkpoints hold the model alone.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tilearn_engine::EngineError;
use tilearn_engine::checkpoint::load_params;
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::{TokenDataset, prepare_embedded_default};
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_engine::trainer::checkpoint::checkpoints;
use tilearn_engine::trainer::{
    FreeSpace, LogRecord, ProgressSink, SaveStrategy, TrainLength, Trainer, TrainingArguments,
};

const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
 "num_key_value_heads": 1, "vocab_size": 257, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;

struct Run {
    _tmp: tempfile::TempDir,
    data: PathBuf,
    out: PathBuf,
}

fn run_dirs() -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    prepare_embedded_default(&data, 3, 200).unwrap();
    let out = tmp.path().join("run");
    Run {
        _tmp: tmp,
        data,
        out,
    }
}

fn args(out: &Path, steps: u64, save_steps: u64) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        length: TrainLength::MaxSteps(steps),
        per_device_train_batch_size: 2,
        seq_len: 16,
        learning_rate: 1e-3,
        logging_steps: 1,
        save_steps,
        ..TrainingArguments::default()
    }
}

fn trainer(run: &Run, args: TrainingArguments) -> Trainer {
    let config = LlamaConfig::from_json_str(CONFIG, "<test config>").unwrap();
    let model = LlamaForCausalLM::from_config(config, 5);
    Trainer::new(args, model, TokenDataset::open(&run.data).unwrap()).unwrap()
}

/// Collects warnings; optionally fills the simulated disk after a given step.
#[derive(Default)]
struct Sink {
    warnings: Vec<String>,
    fill_after: Option<(u64, Arc<AtomicU64>, u64)>,
}

impl ProgressSink for Sink {
    fn start(&mut self, _: u64, _: u64) {}
    fn step(&mut self, step: u64, _: f64, _: f64) {
        if let Some((at, used, bytes)) = &self.fill_after
            && step == *at
        {
            used.store(*bytes, Ordering::SeqCst);
        }
    }
    fn log(&mut self, _: &LogRecord) {}
    fn finish(&mut self) {}
    fn note(&mut self, _: &str) {}
    fn warn(&mut self, line: &str) {
        self.warnings.push(line.to_string());
    }
}

/// A disk of `budget` bytes holding the output directory and `other` bytes of someone else's
/// files.
struct Quota {
    dir: PathBuf,
    budget: u64,
    other: Arc<AtomicU64>,
}

impl FreeSpace for Quota {
    fn available_bytes(&self, _: &Path) -> std::io::Result<u64> {
        let used = du(&self.dir) + self.other.load(Ordering::SeqCst);
        Ok(self.budget.saturating_sub(used))
    }
}

fn du(path: &Path) -> u64 {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => std::fs::read_dir(path)
            .unwrap()
            .map(|e| du(&e.unwrap().path()))
            .sum(),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

fn steps_on_disk(out: &Path) -> Vec<u64> {
    checkpoints(out).into_iter().map(|(s, _)| s).collect()
}

fn no_staging_left(out: &Path) {
    let tmp: Vec<String> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(tmp.is_empty(), "staging left behind: {tmp:?}");
}

fn final_weights(out: &Path) -> Vec<f32> {
    let config = LlamaConfig::from_file(out.join("config.json")).unwrap();
    load_params(out, &config).unwrap().data
}

#[test]
fn final_model_survives_a_failing_last_checkpoint_and_the_previous_one_resumes() {
    let run = run_dirs();
    let mut a = args(&run.out, 4, 2);
    a.debug_fail_checkpoint_write = vec![4];
    let mut t = trainer(&run, a.clone());
    let mut sink = Sink::default();
    let err = t.train(None, &mut sink).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, EngineError::CheckpointsNotSaved { .. }),
        "{err:?}"
    );
    assert!(msg.contains("checkpoint-4 was not written"), "{msg}");
    assert!(msg.contains("no space left on device"), "{msg}");
    assert!(msg.contains("final model is saved"), "{msg}");
    assert_eq!(sink.warnings.len(), 1, "{:?}", sink.warnings);

    // The final model is on disk and is the trained model.
    let trained = t.model().unwrap().params.data.clone();
    assert_eq!(final_weights(&run.out), trained);
    // checkpoint-2 is intact, checkpoint-4 and its staging directory are gone.
    assert_eq!(steps_on_disk(&run.out), [2]);
    no_staging_left(&run.out);

    // Resuming from the surviving checkpoint reproduces the same final model bit for bit.
    let resumed_out = run.out.with_file_name("resumed");
    let mut b = args(&resumed_out, 4, 0);
    b.save_strategy = SaveStrategy::No;
    let mut t2 = trainer(&run, b);
    t2.train(Some(&run.out.join("checkpoint-2")), &mut Sink::default())
        .unwrap();
    assert_eq!(final_weights(&resumed_out), trained);
}

#[test]
fn a_mid_run_checkpoint_failure_keeps_training_and_saving() {
    let run = run_dirs();
    let mut a = args(&run.out, 4, 2);
    a.debug_fail_checkpoint_write = vec![2];
    let mut sink = Sink::default();
    let err = trainer(&run, a).train(None, &mut sink).unwrap_err();
    assert!(
        err.to_string().contains("checkpoint-2 was not written"),
        "{err}"
    );
    assert_eq!(steps_on_disk(&run.out), [4]);
    assert!(run.out.join("model.safetensors").is_file());
    no_staging_left(&run.out);
}

#[test]
fn disk_check_refuses_at_start_naming_both_numbers_and_the_options() {
    let run = run_dirs();
    let mut t = trainer(&run, args(&run.out, 4, 2));
    std::fs::create_dir_all(&run.out).unwrap();
    t.set_free_space(Arc::new(Quota {
        dir: run.out.clone(),
        budget: 100_000,
        other: Arc::new(AtomicU64::new(0)),
    }));
    let msg = t.train(None, &mut Sink::default()).unwrap_err().to_string();
    assert!(msg.contains("this run's saves need"), "{msg}");
    assert!(msg.contains("2 checkpoint(s)"), "{msg}");
    assert!(msg.contains("bytes) free"), "{msg}");
    for option in [
        "--save-only-model",
        "--save-total-limit",
        "--save-steps 0",
        "--output-dir",
    ] {
        assert!(msg.contains(option), "{msg}");
    }
    assert!(!run.out.join("model.safetensors").exists());
    assert!(steps_on_disk(&run.out).is_empty());
}

#[test]
fn a_disk_that_fills_up_mid_run_skips_checkpoints_but_keeps_the_model() {
    let run = run_dirs();
    let mut t = trainer(&run, args(&run.out, 4, 2));
    std::fs::create_dir_all(&run.out).unwrap();
    // Room for everything at the start; after step 1 another process takes all but 0.6 MB:
    // a checkpoint is estimated at 1.4 MB (0.4 MB of tensors and a 1 MiB allowance for small
    // files) and refused, while the final model's files (0.1 MB) are written.
    let budget = 1u64 << 32;
    let other = Arc::new(AtomicU64::new(0));
    t.set_free_space(Arc::new(Quota {
        dir: run.out.clone(),
        budget,
        other: other.clone(),
    }));
    let mut sink = Sink {
        fill_after: Some((1, other, budget - 600_000)),
        ..Sink::default()
    };
    let err = t.train(None, &mut sink).unwrap_err().to_string();
    assert!(err.contains("checkpoint-2 was not written"), "{err}");
    assert!(err.contains("checkpoint-4 was not written"), "{err}");
    assert!(err.contains("needs"), "{err}");
    assert_eq!(sink.warnings.len(), 2);
    assert!(steps_on_disk(&run.out).is_empty());
    assert!(run.out.join("model.safetensors").is_file());
}

#[test]
fn save_steps_zero_and_strategy_no_write_no_checkpoint() {
    for strategy in [SaveStrategy::Steps, SaveStrategy::No] {
        let run = run_dirs();
        let mut a = args(
            &run.out,
            3,
            if strategy == SaveStrategy::No { 1 } else { 0 },
        );
        a.save_strategy = strategy;
        trainer(&run, a).train(None, &mut Sink::default()).unwrap();
        assert!(steps_on_disk(&run.out).is_empty(), "{strategy:?}");
        assert!(run.out.join("model.safetensors").is_file());
    }
}

#[test]
fn save_total_limit_keeps_the_newest_and_the_last_step_is_saved() {
    let run = run_dirs();
    let mut a = args(&run.out, 5, 2);
    a.save_total_limit = Some(2);
    trainer(&run, a).train(None, &mut Sink::default()).unwrap();
    // HF: multiples of save_steps (2, 4) and the last step (5); the oldest rotated away.
    assert_eq!(steps_on_disk(&run.out), [4, 5]);
    no_staging_left(&run.out);
}

#[test]
fn save_only_model_checkpoints_hold_the_model_in_the_save_dtype_and_cannot_resume() {
    let run = run_dirs();
    let mut a = args(&run.out, 2, 2);
    a.save_only_model = true;
    a.save_dtype = Some(tilearn_ops::DType::BF16);
    trainer(&run, a.clone())
        .train(None, &mut Sink::default())
        .unwrap();
    let ckpt = run.out.join("checkpoint-2");
    assert!(ckpt.join("model.safetensors").is_file());
    assert!(ckpt.join("trainer_state.json").is_file());
    assert!(!ckpt.join("optimizer.safetensors").exists());
    let config = LlamaConfig::from_file(ckpt.join("config.json")).unwrap();
    assert_eq!(config.dtype, Some(tilearn_ops::DType::BF16));
    // The final model in bf16 is the checkpoint's weights.
    assert_eq!(final_weights(&run.out), final_weights(&ckpt));

    let other = run.out.with_file_name("other");
    let msg = trainer(&run, args(&other, 4, 0))
        .train(Some(&ckpt), &mut Sink::default())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("--save-only-model"), "{msg}");
    assert!(msg.contains("--model"), "{msg}");
}
