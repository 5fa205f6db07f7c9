//! The CUDA engine's streamed saves, loads and initialisation (through its ring of page-locked
//! staging buffers, no host copy of the model): the random initialisation equals the CPU's, a
//! saved model and optimizer state read back bit for bit, and a checkpoint restored into a fresh
//! device model saves byte-identical files, also for tensors of several staging pieces.
//!
//! GPU tests: ignored by default (run with `--include-ignored`); without a GPU or driver each
//! prints `skipped: <reason>` to stderr and passes.
#![cfg(feature = "cuda")]

mod support;

use std::path::Path;

use adaptfp16::AmpPlan;

use tilearn_engine::checkpoint::stream::PIECE_ELEMS;
use tilearn_engine::checkpoint::{load_params, save_pretrained};
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::data::{TokenDataset, prepare_embedded_default};
use tilearn_engine::model::LlamaForCausalLM;
use tilearn_engine::trainer::gpu_backend::GpuBackend;
use tilearn_engine::trainer::optimizer_file::{self, HostMoments};
use tilearn_engine::trainer::optimizer_shards::OptimizerCheckpoint;
use tilearn_engine::trainer::{
    ModelInit, PrintLogs, StepBackend, TrainLength, Trainer, TrainingArguments, adamw_setup,
};
use tilearn_ops::DType;

use support::gpu_or_skip;

const TINY: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
 "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "vocab_size": 257, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false}"#;

/// One embedding (and lm_head) of 32768 × 640 = 21 M elements: more than one staging piece.
const WIDE: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 640,
 "intermediate_size": 1280, "num_hidden_layers": 1, "num_attention_heads": 10,
 "num_key_value_heads": 10, "vocab_size": 32768, "max_position_embeddings": 64,
 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false}"#;

fn args(out: &Path) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.to_path_buf(),
        length: TrainLength::MaxSteps(3),
        per_device_train_batch_size: 2,
        seq_len: 32,
        learning_rate: 1e-3,
        logging_steps: 1,
        save_steps: 3,
        ..TrainingArguments::default()
    }
}

fn backend(config: &LlamaConfig, init: &ModelInit, out: &Path) -> GpuBackend {
    GpuBackend::from_init(config, init, &args(out), 0, &[DType::BF16]).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn streamed_init_save_and_load_match_the_cpu() {
    if gpu_or_skip("streamed_init_save_and_load_match_the_cpu").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = LlamaConfig::from_json_str(TINY, "<test config>").unwrap();
    let cpu = LlamaForCausalLM::from_config(config.clone(), 11);
    let mut gpu = backend(&config, &ModelInit::Random { seed: 11 }, dir.path());
    assert_eq!(gpu.model().unwrap().params.data, cpu.params.data);

    let saved = dir.path().join("saved");
    gpu.save_model(&saved, &config, DType::F32, None).unwrap();
    assert_eq!(load_params(&saved, &config).unwrap().data, cpu.params.data);

    let mut loaded = backend(&config, &ModelInit::Pretrained(saved), dir.path());
    assert_eq!(loaded.model().unwrap().params.data, cpu.params.data);
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn a_restored_checkpoint_saves_identical_files() {
    if gpu_or_skip("a_restored_checkpoint_saves_identical_files").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    prepare_embedded_default(&data, 3, 200).unwrap();
    let config = LlamaConfig::from_json_str(TINY, "<test config>").unwrap();
    let out = dir.path().join("run");
    let init = ModelInit::Random { seed: 2 };
    let mut trainer = Trainer::with_backend(
        args(&out),
        config.clone(),
        Box::new(backend(&config, &init, &out)),
        TokenDataset::open(&data).unwrap(),
    )
    .unwrap();
    // The backend holds only a bf16 working copy; the Trainer's default plan is fp32.
    trainer.set_amp_plan(AmpPlan::Fixed(DType::BF16));
    trainer.train(None, &mut PrintLogs).unwrap();
    let ckpt = out.join("checkpoint-3");

    let mut fresh = backend(&config, &init, &out);
    restore_and_save_again(&mut fresh, &config, &ckpt, &dir.path().join("again"));
}

/// Restores `gpu` from the model and `optimizer.safetensors` in `ckpt`, saves both to `again`
/// and asserts that the files are byte-identical to the originals.
fn restore_and_save_again(gpu: &mut GpuBackend, config: &LlamaConfig, ckpt: &Path, again: &Path) {
    let specs = gpu.saved_specs().to_vec();
    let optimizer = OptimizerCheckpoint::open(ckpt, &specs)
        .unwrap()
        .expect("the checkpoint has optimizer state");
    gpu.restore(ckpt, &optimizer).unwrap();
    std::fs::create_dir_all(again).unwrap();
    gpu.save_model(again, config, DType::F32, None).unwrap();
    gpu.save_optimizer(&again.join("optimizer.safetensors"))
        .unwrap();
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(ckpt.join(file)).unwrap();
        let b = std::fs::read(again.join(file)).unwrap();
        assert!(a == b, "{file} differs after a restore");
    }
}

#[test]
#[ignore = "needs a CUDA GPU (run with --include-ignored)"]
fn tensors_of_several_pieces_round_trip_through_the_staging_ring() {
    if gpu_or_skip("tensors_of_several_pieces_round_trip_through_the_staging_ring").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = LlamaConfig::from_json_str(WIDE, "<test config>").unwrap();
    let cpu = LlamaForCausalLM::from_config(config.clone(), 5);
    let embed = cpu
        .params
        .specs
        .iter()
        .find(|s| s.name == "model.embed_tokens.weight")
        .unwrap();
    assert!(
        embed.numel() > PIECE_ELEMS,
        "the test needs a multi-piece tensor"
    );
    let numel = cpu.params.data.len();

    // A model and an optimizer state written on the host, with moments unlike any init.
    let src = dir.path().join("src");
    save_pretrained(&src, &config, &cpu.params, DType::F32, None).unwrap();
    let (opt_config, groups) = adamw_setup(&args(dir.path()), &cpu.params.specs);
    let m: Vec<f32> = (0..numel).map(|i| (i % 9973) as f32 * 1e-3 - 4.0).collect();
    let v: Vec<f32> = (0..numel).map(|i| (i % 7919) as f32 * 1e-6).collect();
    let mut moments = HostMoments {
        exp_avg: &m,
        exp_avg_sq: &v,
    };
    let opt_file = src.join("optimizer.safetensors");
    optimizer_file::write(&opt_file, &opt_config, &groups, 9, numel, &mut moments).unwrap();

    // Restored into a device model initialised otherwise, then saved: the same bytes.
    let mut gpu = backend(&config, &ModelInit::Random { seed: 1 }, dir.path());
    restore_and_save_again(&mut gpu, &config, &src, &dir.path().join("again"));
    assert_eq!(gpu.model().unwrap().params.data, cpu.params.data);

    // The random initialisation streamed through the ring equals the CPU's.
    let mut init = backend(&config, &ModelInit::Random { seed: 5 }, dir.path());
    assert_eq!(init.model().unwrap().params.data, cpu.params.data);
}
