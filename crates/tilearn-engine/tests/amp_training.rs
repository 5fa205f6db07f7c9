//! The auto mixed-precision policy inside the Trainer: a loss scale forced to collapse below the
//! floor sends training to the fallback precision for the hold period, then back to fp16 with
//! the scale restarted, and training goes on learning with finite weights.

use adaptfp16::{AmpPlan, PolicyBuilder, PolicyId};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::{TokenDataset, prepare_embedded_default};
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_engine::trainer::{PrintLogs, TrainLength, Trainer, TrainingArguments, log};
use tilearn_ops::DType;

const CONFIG: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
 "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
 "num_key_value_heads": 1, "vocab_size": 257, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": true}"#;

#[test]
fn auto_recovers_from_a_forced_scale_collapse() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    prepare_embedded_default(&data, 7, 300).unwrap();
    let config = LlamaConfig::from_json_str(CONFIG, "<test config>").unwrap();
    let model = LlamaForCausalLM::from_config(config, 7);
    // 17 consecutive overflows halve torch's 65536 down to 0.5, below the floor of 1.
    let args = TrainingArguments {
        output_dir: dir.path().join("run"),
        length: TrainLength::MaxSteps(40),
        per_device_train_batch_size: 4,
        seq_len: 32,
        learning_rate: 3e-3,
        logging_steps: 1,
        save_steps: 0,
        debug_inject_overflow: (1..=17).collect(),
        ..TrainingArguments::default()
    };
    let policy = PolicyBuilder::new(PolicyId::Auto)
        .hold(6)
        .fallback(DType::BF16)
        // Only the collapse rule should fire in this test.
        .overflow_window(1000)
        .max_overflows(1000)
        .build()
        .unwrap();
    let mut trainer = Trainer::new(args, model, TokenDataset::open(&data).unwrap()).unwrap();
    trainer.set_amp_plan(AmpPlan::Adaptive(policy));
    let summary = trainer.train(None, &mut PrintLogs).unwrap();
    assert_eq!(summary.skipped_steps, 17);

    let records = log::read_log(&dir.path().join("run").join(log::LOG_FILE)).unwrap();
    let p: Vec<&str> = records.iter().map(|r| r.precision.as_str()).collect();
    // Steps 1..=17 run fp16 and overflow; the collapse is seen when deciding step 18.
    assert!(p[..17].iter().all(|&x| x == "fp16"), "{p:?}");
    assert_eq!(records[16].loss_scale, 0.5);
    assert_eq!(
        &p[17..23],
        &["bf16"; 6],
        "held the fallback for 6 steps: {p:?}"
    );
    assert!(p[23..].iter().all(|&x| x == "fp16"), "{p:?}");
    // Back in fp16, the scale restarted at torch's initial 65536 and no step overflows.
    assert_eq!(records[23].loss_scale, 65536.0);
    assert!(records[17..].iter().all(|r| r.skipped_steps == 0));
    assert!(summary.final_loss < summary.first_loss - 0.5, "{summary:?}");
    let model = trainer.model().unwrap();
    assert!(model.params.data.iter().all(|w| w.is_finite()));
}
