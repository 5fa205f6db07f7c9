//! The `tilearn` command line: `train`, `eval`, `plot`, `prepare-data`, `info`, `launch`, `plan`.

mod bench;
mod bench_gpu;
mod bench_loop;
mod ctr;
mod ctr_gpu;
mod ctr_sharded;
mod decode;
mod device;
mod eval;
mod generate;
mod generate_settings;
mod hybrid;
mod info;
mod launch;
mod plan;
mod plan_schedule;
mod plot;
mod prepare;
mod progress;
mod tokenizer_files;
mod topology;
mod train;
mod train_ranks;
mod train_samples;

use clap::{Parser, Subcommand};

pub use bench::BenchArgs;
pub use eval::EvalArgs;
pub use generate::GenerateArgs;
pub use info::InfoArgs;
pub use launch::LaunchArgs;
pub use plan::PlanArgs;
pub use plot::PlotArgs;
pub use prepare::PrepareArgs;
pub use train::TrainArgs;

use crate::Result;

#[derive(Debug, Parser)]
#[command(
    name = "tilearn",
    version,
    about = "Fast Llama training in Rust, compatible with Hugging Face checkpoints"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model (from a checkpoint, a config, or the embedded default).
    Train(Box<TrainArgs>),
    /// Mean next-token loss (and optionally logits) of a model on given token sequences.
    Eval(EvalArgs),
    /// Continue a prompt with a model (CPU, KV cache): greedy or sampled, stops at EOS.
    Generate(GenerateArgs),
    /// Draw a run's loss.png: training and evaluation loss and the learning rate against steps.
    Plot(PlotArgs),
    /// Training-step throughput on a preset model (one JSON line).
    Bench(BenchArgs),
    /// Tokenize text or JSON-lines files into memory-mapped token shards.
    PrepareData(PrepareArgs),
    /// Version, devices, and which CUDA/NCCL libraries were found (or why not).
    Info(InfoArgs),
    /// Run a subcommand (`launch … train …`) or a program (`launch … -- PROGRAM`) as N ranks per
    /// node, with torchrun's flags and environment.
    Launch(LaunchArgs),
    /// Click-through-rate models (DeepFM, Wide & Deep): train, prepare, eval.
    Ctr(ctr::CtrArgs),
    /// Recommend a parallel layout (TP, PP, DP, ZeRO stage, micro-batch, checkpointing) for a
    /// model on N GPUs: memory per GPU and predicted throughput of the fastest that fit.
    Plan(PlanArgs),
}

/// Runs one parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(args) => train::run(*args),
        Command::Eval(args) => eval::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Plot(args) => plot::run(args),
        Command::Bench(args) => bench::run(args),
        Command::PrepareData(args) => prepare::run(args),
        Command::Info(args) => info::run(args),
        Command::Launch(args) => launch::run(args),
        Command::Ctr(args) => ctr::run(args),
        Command::Plan(args) => plan::run(args),
    }
}
