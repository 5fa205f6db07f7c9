//! `tilearn ctr`: click-through-rate models of tilearn-recsys (DeepFM, Wide & Deep) on
//! Criteo-format data or the embedded synthetic generator.
//!
//! * `ctr prepare`: Criteo TSV files (or `--synthetic N` samples) into checksummed binary shards;
//!   prints a JSON report with the malformed-line count and the first reasons.
//! * `ctr train`: trains on shards (`--data`) or, by default, on synthetic data whose
//!   ground-truth AUC is logged beside the model's; one JSON line per evaluation in
//!   `OUTPUT/train_log.jsonl` (step, loss, eval_loss, eval_auc, samples_per_sec), the model in
//!   `OUTPUT/model.safetensors`; `--save-steps N` writes `OUTPUT/checkpoint-STEP/` every N
//!   steps and `--resume-from-checkpoint DIR` continues one exactly (tilearn-recsys'
//!   `checkpoint` module).
//! * `ctr eval`: loss and exact AUC of a saved model on shards or synthetic samples.
//! * `ctr bench`: end-to-end samples/s and held-out AUC of one epoch of synthetic samples (one
//!   JSON line); `--export DIR` writes the same batches for `benches/pytorch_recsys_baseline.py
//!   --deepfm-data DIR`, which trains the PyTorch DeepFM on them beside it.
//!
//! `--device cuda` trains on the GPU (tilearn-recsys' `cuda::GpuCtrTrainer`: the embedding-bag
//! kernels, cuBLASLt for the MLP, the fused AdamW); `auto` (the default) picks it when this
//! build has the CUDA kernels and a device is present. Checkpoints are the same on both.
//! `--gpu-embedding-budget` / `--host-rows` keep tables over the budget in pinned host memory
//! behind a GPU cache of hot rows, `--precision bf16` runs the MLP's GEMMs in bf16 (`ctr_gpu`).
//! Under `tilearn launch --nproc-per-node N` (N > 1), `ctr train` shards the tables over the
//! ranks (`--shard table|row|auto`) and trains the dense part data parallel (`ctr_sharded`: on
//! the CPU over the host communicator; with `--device cuda` on each rank's GPU, over NCCL or
//! `--ddp-backend host`).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use tilearn_optim::AdamWConfig;
use tilearn_recsys::bench::{CtrBenchData, CtrBenchOptions, run_bench as run_ctr_bench};
use tilearn_recsys::cache::ResidencyPlan;
use tilearn_recsys::checkpoint::load_checkpoint;
use tilearn_recsys::data::export::export_splits;
use tilearn_recsys::data::{
    CRITEO_DENSE, CRITEO_FIELDS, CtrBatch, SyntheticCriteo, read_shards, read_tsv_file,
    write_shards,
};
use tilearn_recsys::model::io::{load_model, save_model};
use tilearn_recsys::train::{LogRecord, SavePolicy, TrainOptions, evaluate, train};
use tilearn_recsys::{
    CtrConfig, CtrModel, CtrStepper, ModelKind, RecsysError, SparseOptimizer, auc,
};

use super::ctr_gpu::{GpuArgs, PrecisionArg};
use super::ctr_sharded::{ShardArgs, sharded_trainer};
use super::device::{DeviceChoice, choose_device};
use super::train_ranks::Ranks;
use crate::{LlmError, Result};

#[derive(Debug, Args)]
pub struct CtrArgs {
    #[command(subcommand)]
    command: CtrCommand,
}

#[derive(Debug, Subcommand)]
enum CtrCommand {
    /// Train DeepFM or Wide & Deep (default: on synthetic Criteo-shaped data).
    Train(TrainArgs),
    /// Criteo TSV files (or synthetic samples) into binary shards.
    Prepare(PrepareArgs),
    /// Loss and exact AUC of a saved model.
    Eval(EvalArgs),
    /// End-to-end training samples/s and held-out AUC on synthetic Criteo-shaped data (one
    /// JSON line); `--export DIR` also writes the same batches for the PyTorch baseline.
    Bench(BenchArgs),
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModelArg {
    Deepfm,
    WideDeep,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum SparseArg {
    /// Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD).
    Adagrad,
    /// torch.optim.SparseAdam.
    Adam,
    Sgd,
}

/// Where samples come from: shards, or the synthetic generator.
#[derive(Debug, Args)]
struct DataArgs {
    /// A directory of shards written by `tilearn ctr prepare`; without it, synthetic data.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Synthetic samples (training; the held-out split is another tenth after them).
    #[arg(long, default_value_t = 200_000)]
    synthetic_samples: usize,
    /// Largest vocabulary of a synthetic categorical field.
    #[arg(long, default_value_t = 1000)]
    synthetic_vocab: usize,
    /// Fraction of the shards' samples held out for evaluation (the last ones).
    #[arg(long, default_value_t = 0.1)]
    eval_fraction: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Debug, Args)]
struct TrainArgs {
    #[arg(long, value_enum, default_value = "deepfm")]
    model: ModelArg,
    /// Where to train: `auto` takes the GPU when the CUDA kernels are built in and a device
    /// is present.
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceChoice,
    #[command(flatten)]
    data: DataArgs,
    #[arg(long, default_value = "runs/ctr")]
    output_dir: PathBuf,
    #[arg(long, default_value_t = 1000)]
    steps: usize,
    #[arg(long, default_value_t = 512)]
    batch_size: usize,
    /// AdamW learning rate of the dense part.
    #[arg(long, default_value_t = 3e-3)]
    learning_rate: f32,
    #[arg(long, value_enum, default_value = "adagrad")]
    sparse_optimizer: SparseArg,
    /// Learning rate of the embedding rows (updated inside the embedding backward).
    #[arg(long, default_value_t = 0.02)]
    sparse_learning_rate: f32,
    #[arg(long, default_value_t = 16)]
    embed_dim: usize,
    /// MLP hidden widths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "256,128")]
    hidden: Vec<usize>,
    /// Rows of each field's table (raw values are hashed into it).
    #[arg(long, default_value_t = 100_000)]
    hash_rows: usize,
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    /// Write OUTPUT/checkpoint-STEP/ (model, dense and sparse optimizer state, trainer state)
    /// every N steps; 0: none.
    #[arg(long, default_value_t = 0)]
    save_steps: usize,
    /// Keep only the newest K checkpoints.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    save_total_limit: Option<u64>,
    /// Continue the run saved in this checkpoint directory (same model flags, --seed,
    /// --batch-size and data) up to --steps; the log is appended to.
    #[arg(long)]
    resume_from_checkpoint: Option<PathBuf>,
    #[command(flatten)]
    gpu: GpuArgs,
    #[command(flatten)]
    shard: ShardArgs,
}

#[derive(Debug, Args)]
struct PrepareArgs {
    /// Criteo TSV files (label, 13 integers, 26 hex categorical values per line).
    #[arg(long, num_args = 1.., required_unless_present = "synthetic")]
    input: Vec<PathBuf>,
    /// Write this many synthetic samples instead of reading files.
    #[arg(long, conflicts_with = "input")]
    synthetic: Option<usize>,
    #[arg(long, default_value_t = 1000)]
    synthetic_vocab: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long)]
    output: PathBuf,
    #[arg(long, default_value_t = 1_000_000)]
    samples_per_shard: usize,
}

#[derive(Debug, Args)]
struct BenchArgs {
    #[arg(long, value_enum, default_value = "deepfm")]
    model: ModelArg,
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceChoice,
    #[arg(long, default_value_t = 16_384)]
    batch_size: usize,
    /// Timed steps, one epoch of fresh samples (steps x batch size).
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Steps left out of the steady-state rate.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    #[arg(long, default_value_t = 131_072)]
    eval_samples: usize,
    #[arg(long, default_value_t = 1000)]
    synthetic_vocab: usize,
    #[arg(long, default_value_t = 100_000)]
    hash_rows: usize,
    #[arg(long, default_value_t = 16)]
    embed_dim: usize,
    #[arg(long, value_delimiter = ',', default_value = "256,128")]
    hidden: Vec<usize>,
    #[arg(long, default_value_t = 3e-3)]
    learning_rate: f32,
    /// Row-wise Adagrad's learning rate for the embedding rows.
    #[arg(long, default_value_t = 0.02)]
    sparse_learning_rate: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Write the training batches (in step order) and the held-out split here for
    /// `benches/pytorch_recsys_baseline.py --deepfm-data DIR`.
    #[arg(long)]
    export: Option<PathBuf>,
    #[command(flatten)]
    gpu: GpuArgs,
}

#[derive(Debug, Args)]
struct EvalArgs {
    /// A directory holding `model.safetensors` from `tilearn ctr train`.
    #[arg(long)]
    model_dir: PathBuf,
    #[command(flatten)]
    data: DataArgs,
}

pub fn run(args: CtrArgs) -> Result<()> {
    match args.command {
        CtrCommand::Train(a) => run_train(a),
        CtrCommand::Prepare(a) => run_prepare(a),
        CtrCommand::Eval(a) => run_eval(a),
        CtrCommand::Bench(a) => run_bench(a),
    }
}

/// Train and held-out samples, and the ground-truth AUC of the held-out ones when synthetic.
struct Splits {
    train: CtrBatch,
    eval: CtrBatch,
    truth_auc: Option<f64>,
}

fn load_splits(args: &DataArgs) -> Result<Splits> {
    match &args.data {
        Some(dir) => {
            let (_, all) = read_shards(dir)?;
            if !(0.0..1.0).contains(&args.eval_fraction) {
                return Err(usage("--eval-fraction", "must lie in [0, 1)"));
            }
            let held_out = (all.len() as f64 * args.eval_fraction).round() as usize;
            let cut = all.len() - held_out;
            Ok(Splits {
                train: all.slice(0..cut),
                eval: all.slice(cut..all.len()),
                truth_auc: None,
            })
        }
        None => {
            let generator = SyntheticCriteo::criteo_shaped(args.seed, args.synthetic_vocab);
            let n = args.synthetic_samples;
            let (train, _) = generator.generate(0, n);
            let (eval, logits) = generator.generate(n as u64, (n / 10).max(1));
            let scores: Vec<f32> = logits.iter().map(|&z| z as f32).collect();
            Ok(Splits {
                truth_auc: auc(&scores, &eval.labels),
                train,
                eval,
            })
        }
    }
}

fn usage(flag: &str, message: &str) -> LlmError {
    LlmError::Usage {
        flag: flag.into(),
        message: message.into(),
    }
}

fn run_train(args: TrainArgs) -> Result<()> {
    // Under `tilearn launch` with several ranks: the tables sharded over them (`ctr_sharded`).
    match Ranks::join()?.filter(|r| r.group.world_size() > 1) {
        None => train_ranks(args, None),
        Some(ranks) => train_ranks(args, Some(&ranks)).map_err(|e| ranks.report(e)),
    }
}

/// `ctr train` alone (`ranks` `None`) or as one rank of a sharded job.
fn train_ranks(args: TrainArgs, ranks: Option<&Ranks>) -> Result<()> {
    if ranks.is_some() {
        check_sharded_flags(&args)?;
    }
    let primary = ranks.is_none_or(|r| r.is_primary());
    let splits = load_splits(&args.data)?;
    if splits.train.is_empty() {
        return Err(usage("--data", "no training samples"));
    }
    let config = CtrConfig::for_fields(
        model_kind(args.model),
        splits.train.num_dense,
        splits.train.num_fields,
        args.hash_rows,
        args.embed_dim,
        args.hidden.clone(),
    );
    let lr = args.sparse_learning_rate;
    let sparse = match args.sparse_optimizer {
        SparseArg::Adagrad => SparseOptimizer::row_wise_adagrad(lr),
        SparseArg::Adam => SparseOptimizer::adam(lr),
        SparseArg::Sgd => SparseOptimizer::Sgd { lr },
    };
    let dense = AdamWConfig {
        lr: args.learning_rate,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let mut ctr = CtrModel::new(config, sparse, dense, args.data.seed)?;
    let resume = match &args.resume_from_checkpoint {
        Some(dir) => Some(load_checkpoint(dir, &mut ctr)?),
        None => None,
    };
    std::fs::create_dir_all(&args.output_dir).map_err(|e| RecsysError::io(&args.output_dir, e))?;
    let log_path = args.output_dir.join("train_log.jsonl");
    // A resumed run continues the log of the run it resumes; rank 0 alone writes it.
    let log = if primary {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(resume.is_some())
            .truncate(resume.is_none())
            .open(&log_path)
            .map_err(|e| RecsysError::io(&log_path, e))?;
        Some(file)
    } else {
        None
    };
    let save = (args.save_steps > 0).then(|| SavePolicy {
        output_dir: args.output_dir.clone(),
        every: args.save_steps,
        keep: args.save_total_limit.map(|k| k as usize),
    });
    let options = TrainOptions {
        steps: args.steps,
        batch_size: args.batch_size,
        dense_lr: args.learning_rate,
        eval_every: args.eval_every,
        seed: args.data.seed,
        save,
        resume,
    };
    let bar = (primary && std::io::stderr().is_terminal()).then(|| {
        let bar = ProgressBar::new(args.steps as u64);
        bar.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} steps  {msg}")
                .expect("template is valid")
                .progress_chars("=> "),
        );
        bar.set_position(options.resume.as_ref().map_or(0, |r| r.step as u64));
        bar
    });
    let mut run = TrainLoop {
        splits,
        options,
        model_name: args
            .model
            .to_possible_value()
            .map(|v| v.get_name().to_string()),
        log,
        log_path,
        bar,
    };
    let ctr = if let Some(ranks) = ranks {
        if choose_device(args.device)? {
            train_sharded_on_gpu(ctr, &mut run, ranks, &args.shard, args.gpu.precision)?
        } else {
            args.gpu.check_cpu()?;
            ranks.cpu_gradient_communicator(args.shard.ddp_backend)?;
            let mut trainer = sharded_trainer(ctr, ranks, &args.shard)?;
            run.drive(&mut trainer)?;
            trainer.into_host()?
        }
    } else if choose_device(args.device)? {
        let plan = args.gpu.plan(&ctr, args.batch_size)?;
        train_on_gpu(ctr, &mut run, plan.as_ref(), args.gpu.precision)?
    } else {
        args.gpu.check_cpu()?;
        run.drive(&mut ctr)?;
        ctr
    };
    if let Some(bar) = &run.bar {
        bar.finish_and_clear();
    }
    if primary {
        save_model(&args.output_dir, &ctr.config, &ctr.tables, &ctr.dense)?;
    }
    Ok(())
}

/// Fails, naming the flag, for what a sharded run does not do yet (the row cache).
fn check_sharded_flags(args: &TrainArgs) -> Result<()> {
    if args.gpu.gpu_embedding_budget.is_some() {
        return Err(usage(
            "--gpu-embedding-budget",
            "a sharded run keeps each rank's shard whole on its GPU (no row cache yet); add ranks so the shards fit, or drop the flag",
        ));
    }
    Ok(())
}

/// Everything of `ctr train` but the model: data, options, the log and the progress bar.
struct TrainLoop {
    splits: Splits,
    options: TrainOptions,
    model_name: Option<String>,
    /// The log file, on rank 0 only (other ranks of a sharded run print nothing).
    log: Option<std::fs::File>,
    log_path: PathBuf,
    bar: Option<ProgressBar>,
}

impl TrainLoop {
    /// Trains `model` (on whichever device it lives), logging every evaluation.
    fn drive(&mut self, model: &mut impl CtrStepper) -> Result<()> {
        let truth_auc = self.splits.truth_auc;
        let (log, log_path, bar) = (&mut self.log, &self.log_path, &self.bar);
        let model_name = &self.model_name;
        let on_log = |r: &LogRecord| -> tilearn_recsys::Result<()> {
            let mut line = serde_json::to_value(r).expect("a log record serialises");
            line["model"] = serde_json::json!(model_name);
            if let Some(truth) = truth_auc {
                line["ground_truth_auc"] = serde_json::json!(truth);
            }
            let Some(log) = log.as_mut() else {
                return Ok(());
            };
            writeln!(log, "{line}").map_err(|e| RecsysError::io(log_path, e))?;
            match bar {
                Some(bar) => bar.println(line.to_string()),
                None => println!("{line}"),
            }
            Ok(())
        };
        let on_step = |step: usize, loss: f64| {
            if let Some(bar) = bar {
                bar.set_position(step as u64);
                bar.set_message(format!("loss {loss:.4}"));
            }
        };
        let train_data = std::mem::take(&mut self.splits.train);
        train(
            model,
            Arc::new(train_data),
            &self.splits.eval,
            &self.options,
            on_step,
            on_log,
        )?;
        Ok(())
    }
}

/// Trains `ctr` on GPU 0 (rows placed by `plan`) and returns it with the trained weights and
/// optimizer state.
#[cfg(feature = "cuda")]
fn train_on_gpu(
    ctr: CtrModel,
    run: &mut TrainLoop,
    plan: Option<&ResidencyPlan>,
    precision: PrecisionArg,
) -> Result<CtrModel> {
    let device = tilearn_ops::cuda::GpuDevice::new(0)?;
    let mut trainer = super::ctr_gpu::gpu_trainer(device.stream(), ctr, plan, precision)?;
    run.drive(&mut trainer)?;
    Ok(trainer.into_host()?)
}

/// Trains `ctr` as one GPU rank of a sharded job (the rank's GPU: LOCAL_RANK among the
/// visible devices) and returns it whole (gathered from the shards on every rank).
#[cfg(feature = "cuda")]
fn train_sharded_on_gpu(
    ctr: CtrModel,
    run: &mut TrainLoop,
    ranks: &Ranks,
    shard: &super::ctr_sharded::ShardArgs,
    precision: PrecisionArg,
) -> Result<CtrModel> {
    let device = tilearn_ops::cuda::GpuDevice::new(super::device::local_gpu())?;
    let mut trainer =
        super::ctr_sharded::gpu_sharded_trainer(ctr, ranks, shard, device.stream(), precision)?;
    run.drive(&mut trainer)?;
    Ok(trainer.into_host()?)
}

#[cfg(not(feature = "cuda"))]
fn train_sharded_on_gpu(
    _ctr: CtrModel,
    _run: &mut TrainLoop,
    _ranks: &Ranks,
    _shard: &super::ctr_sharded::ShardArgs,
    _precision: PrecisionArg,
) -> Result<CtrModel> {
    Err(usage(
        "--device cuda",
        "this build has no CUDA kernels; rebuild with --features cuda",
    ))
}

#[cfg(not(feature = "cuda"))]
fn train_on_gpu(
    _ctr: CtrModel,
    _run: &mut TrainLoop,
    _plan: Option<&ResidencyPlan>,
    _precision: PrecisionArg,
) -> Result<CtrModel> {
    // choose_device only picks the GPU when the CUDA kernels are compiled in.
    Err(usage(
        "--device cuda",
        "this build has no CUDA kernels; rebuild with --features cuda",
    ))
}

fn model_kind(model: ModelArg) -> ModelKind {
    match model {
        ModelArg::Deepfm => ModelKind::DeepFm,
        ModelArg::WideDeep => ModelKind::WideDeep,
    }
}

fn run_bench(args: BenchArgs) -> Result<()> {
    if args.steps == 0 || args.batch_size == 0 {
        return Err(usage("--steps", "--steps and --batch-size must be >= 1"));
    }
    let generator = SyntheticCriteo::criteo_shaped(args.seed, args.synthetic_vocab);
    let options = CtrBenchOptions {
        batch_size: args.batch_size,
        steps: args.steps,
        warmup: args.warmup,
        eval_samples: args.eval_samples,
        seed: args.seed,
        dense_lr: args.learning_rate,
    };
    let data = CtrBenchData::generate(&generator, &options);
    let config = CtrConfig::for_fields(
        model_kind(args.model),
        generator.num_dense,
        generator.num_fields(),
        args.hash_rows,
        args.embed_dim,
        args.hidden.clone(),
    );
    if let Some(dir) = &args.export {
        let meta = serde_json::json!({
            "model": config.model,
            "num_dense": config.num_dense,
            "field_rows": config.field_rows,
            "embed_dim": config.embed_dim,
            "hidden": config.hidden,
            "batch_size": args.batch_size,
            "steps": args.steps,
            "warmup": args.warmup,
            "learning_rate": args.learning_rate,
            "sparse_learning_rate": args.sparse_learning_rate,
            "ground_truth_auc": data.truth_auc,
        });
        let train = data.train_in_step_order(args.seed);
        export_splits(
            dir,
            &[("train", &train), ("eval", &data.eval)],
            &config.field_rows,
            meta,
        )?;
    }
    let dense = AdamWConfig {
        lr: args.learning_rate,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let sparse = SparseOptimizer::row_wise_adagrad(args.sparse_learning_rate);
    let ctr = CtrModel::new(config, sparse, dense, args.seed)?;
    let record = if choose_device(args.device)? {
        let plan = args.gpu.plan(&ctr, args.batch_size)?;
        let precision = args.gpu.precision;
        let mut record = bench_on_gpu(ctr, &data, &options, plan.as_ref(), precision)?;
        record.mlp_precision = Some(format!("{precision:?}").to_lowercase());
        record.placement = plan.map(|p| {
            serde_json::json!({
                "gpu_embedding_budget": args.gpu.gpu_embedding_budget,
                "host_tables": p.host_tables,
                "device_embedding_bytes": p.device_bytes,
                "host_embedding_bytes": p.host_bytes,
            })
        });
        record
    } else {
        args.gpu.check_cpu()?;
        let mut ctr = ctr;
        run_ctr_bench(&mut ctr, &data, &options, "cpu")?
    };
    println!(
        "{}",
        serde_json::to_string(&record).expect("a bench record serialises")
    );
    Ok(())
}

#[cfg(feature = "cuda")]
fn bench_on_gpu(
    ctr: CtrModel,
    data: &CtrBenchData,
    options: &CtrBenchOptions,
    plan: Option<&ResidencyPlan>,
    precision: PrecisionArg,
) -> Result<tilearn_recsys::bench::CtrBenchRecord> {
    let device = tilearn_ops::cuda::GpuDevice::new(0)?;
    let name = device.name()?;
    let mut trainer = super::ctr_gpu::gpu_trainer(device.stream(), ctr, plan, precision)?;
    Ok(run_ctr_bench(&mut trainer, data, options, &name)?)
}

#[cfg(not(feature = "cuda"))]
fn bench_on_gpu(
    _ctr: CtrModel,
    _data: &CtrBenchData,
    _options: &CtrBenchOptions,
    _plan: Option<&ResidencyPlan>,
    _precision: PrecisionArg,
) -> Result<tilearn_recsys::bench::CtrBenchRecord> {
    Err(usage(
        "--device cuda",
        "this build has no CUDA kernels; rebuild with --features cuda",
    ))
}

fn run_prepare(args: PrepareArgs) -> Result<()> {
    let (batch, report, source) = match args.synthetic {
        Some(n) => {
            let generator = SyntheticCriteo::criteo_shaped(args.seed, args.synthetic_vocab);
            let (batch, _) = generator.generate(0, n);
            let source = serde_json::to_value(&generator).expect("generator serialises");
            (batch, None, source)
        }
        None => {
            let mut all = CtrBatch::new(CRITEO_DENSE, CRITEO_FIELDS);
            let mut reports = Vec::new();
            for path in &args.input {
                let (batch, report) = read_tsv_file(path)?;
                all.extend(&batch);
                reports.push(serde_json::json!({"file": path, "report": report}));
            }
            let files: Vec<String> = args.input.iter().map(|p| p.display().to_string()).collect();
            (
                all,
                Some(reports),
                serde_json::json!({ "criteo_tsv": files }),
            )
        }
    };
    let meta = write_shards(&args.output, &batch, args.samples_per_shard, source)?;
    let summary = serde_json::json!({
        "output": args.output,
        "samples": meta.samples,
        "shards": meta.shards.len(),
        "files": report,
    });
    println!("{summary}");
    Ok(())
}

fn run_eval(args: EvalArgs) -> Result<()> {
    let saved = load_model(&args.model_dir)?;
    let splits = load_splits(&args.data)?;
    // Evaluate on everything given: shards whole (no split), synthetic held-out samples.
    let data = match &args.data.data {
        Some(_) => {
            let mut all = splits.train;
            all.extend(&splits.eval);
            all
        }
        None => splits.eval,
    };
    let mut ctr = CtrModel::new(
        saved.config,
        SparseOptimizer::Sgd { lr: 0.0 },
        AdamWConfig::default(),
        0,
    )?;
    ctr.tables = saved.tables;
    ctr.dense = saved.dense;
    let (loss, model_auc) = evaluate(&mut ctr, &data)?;
    println!(
        "{}",
        serde_json::json!({"model_dir": Path::new(&args.model_dir), "samples": data.len(), "loss": loss, "auc": model_auc})
    );
    Ok(())
}
