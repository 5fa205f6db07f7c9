//! `tilearn plan`: the parallel-plan advisor (`tilearn_engine::plan`). Reads a model's
//! `config.json`, evaluates every tensor/pipeline/data-parallel layout with its ZeRO stage,
//! micro-batch and activation checkpointing on the given GPUs, and prints the fastest that fit
//! (a Markdown table with each one's memory per GPU and predicted throughput) and the
//! recommendation, or the whole plan as JSON with `--json`.

use std::path::{Path, PathBuf};

use clap::Args;
use tilearn_engine::config::LlamaConfig;
use tilearn_engine::plan::{self, Candidate, Hardware, Plan, PlanRequest};

use super::train::PipelineSchedule;
use crate::{LlmError, Result};

const GIB: f64 = (1u64 << 30) as f64;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The model: a directory holding `config.json`, or the config file itself.
    #[arg(long, required_unless_present = "schedule")]
    pub model: Option<PathBuf>,
    /// GPUs of the whole job.
    #[arg(long, required_unless_present = "schedule")]
    pub gpus: Option<usize>,
    /// Nodes the GPUs are spread over (tensor parallelism stays inside a node).
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// Memory of one GPU, with a unit: 141GiB (H200), 80GiB (H100), 81559MiB, 144GB. The
    /// compute and bandwidth rates are the H200's whatever the memory (an H100 computes alike).
    #[arg(long, default_value = "141GiB", value_parser = parse_memory)]
    pub gpu_memory: f64,
    /// Tokens per sequence (default: 4096, or the model's max_position_embeddings if smaller).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Sequences per optimizer step over all data-parallel ranks (default: about 1 M tokens,
    /// rounded up to a multiple of --gpus).
    #[arg(long)]
    pub global_batch_size: Option<usize>,
    /// Fix the micro-batch (sequences per rank per forward); by default powers of two are tried.
    #[arg(long)]
    pub micro_batch_size: Option<usize>,
    /// Layouts listed in the table (the fastest that fit).
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print the plan as one JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Instead of a plan: print this pipeline schedule's timeline per stage and its bubble.
    #[arg(long, value_enum, conflicts_with_all = ["model", "gpus"])]
    pub schedule: Option<PipelineSchedule>,
    /// Stages of the printed schedule.
    #[arg(long, default_value_t = 4, requires = "schedule")]
    pub pp_size: usize,
    /// Micro-batches of the printed schedule.
    #[arg(long, default_value_t = 8, requires = "schedule")]
    pub micro_batches: usize,
    /// Model chunks per stage of an interleaved schedule.
    #[arg(long, default_value_t = 2, requires = "schedule")]
    pub virtual_stages: usize,
}

/// Parses `141GiB`, `80 GiB`, `81559MiB`, `144GB`, `1.5TiB` into bytes.
pub fn parse_memory(text: &str) -> std::result::Result<f64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().map_err(|_| {
        format!("`{text}` is not a memory size; write a number and a unit, e.g. 141GiB or 80GiB")
    })?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "gib" | "g" => GIB,
        "mib" | "m" => (1u64 << 20) as f64,
        "tib" | "t" => (1u64 << 40) as f64,
        "gb" => 1e9,
        "mb" => 1e6,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{text}`; use GiB, MiB, TiB, GB, MB or TB"
            ));
        }
    };
    if !(value.is_finite() && value > 0.0) {
        return Err(format!("`{text}` must be a positive size"));
    }
    Ok(value * scale)
}

/// `DIR/config.json` for a directory, the path itself for a file; a clear error otherwise.
fn load_config(model: &Path) -> Result<LlamaConfig> {
    let path = if model.is_dir() {
        model.join("config.json")
    } else {
        model.to_path_buf()
    };
    if !path.is_file() {
        return Err(LlmError::Usage {
            flag: "--model".into(),
            message: format!(
                "{} does not exist; give a model directory holding config.json or the path of \
                 a config.json",
                path.display()
            ),
        });
    }
    Ok(LlamaConfig::from_file(&path)?)
}

pub fn run(args: PlanArgs) -> Result<()> {
    if let Some(schedule) = args.schedule {
        let kind = schedule.kind(args.virtual_stages);
        return super::plan_schedule::print(kind, args.pp_size, args.micro_batches);
    }
    let (Some(model), Some(gpus)) = (args.model.as_deref(), args.gpus) else {
        return Err(LlmError::Usage {
            flag: "--model/--gpus".into(),
            message: "a plan needs the model and the GPU count (or use --schedule)".into(),
        });
    };
    let config = load_config(model)?;
    if args.nnodes == 0 || !gpus.is_multiple_of(args.nnodes) {
        return Err(LlmError::Usage {
            flag: "--nnodes".into(),
            message: format!(
                "{} GPUs cannot be spread evenly over {} nodes; use a node count that divides \
                 --gpus",
                gpus, args.nnodes
            ),
        });
    }
    let seq_len = args
        .seq_len
        .unwrap_or_else(|| 4096.min(config.max_position_embeddings.max(1)));
    let global_batch = args.global_batch_size.unwrap_or_else(|| {
        let gpus = gpus.max(1);
        ((1usize << 20) / seq_len.max(1)).max(1).div_ceil(gpus) * gpus
    });
    let hw = Hardware::h200(gpus, args.nnodes, args.gpu_memory);
    let request = PlanRequest {
        seq_len,
        global_batch,
        micro_batch: args.micro_batch_size,
    };
    let plan = plan::plan(&config, &hw, &request)?;
    if args.json {
        let mut value = serde_json::to_value(&plan).map_err(|e| LlmError::Usage {
            flag: "--json".into(),
            message: format!("cannot serialise the plan: {e}"),
        })?;
        if let Some(ranked) = value.get_mut("ranked").and_then(|r| r.as_array_mut()) {
            ranked.truncate(args.top.max(1));
        }
        println!("{value}");
    } else {
        print_table(&plan, model, args.top.max(1));
    }
    Ok(())
}

fn gib(bytes: f64) -> String {
    format!("{:.1}", bytes / GIB)
}

fn tokens_per_s(t: f64) -> String {
    if t >= 1e6 {
        format!("{:.2} M", t / 1e6)
    } else {
        format!("{:.1} K", t / 1e3)
    }
}

fn row(rank: usize, c: &Candidate, recommended: bool) -> String {
    let l = &c.layout;
    let m = &c.memory;
    let mark = if recommended { " ◀" } else { "" };
    format!(
        "| {rank}{mark} | {} | {} | {} | {} | {} | {} × {} | {} | {} | {} | {} | {} | {} | **{}** | {:.3} | {} | {:.1} % | {} |",
        l.tp,
        l.pp,
        l.virtual_stages,
        l.dp,
        l.zero.number(),
        l.micro_batch,
        l.micro_batches,
        match (l.checkpointing, l.offload_checkpoints) {
            (true, true) => "on, host",
            (true, false) => "on",
            (false, _) => "off",
        },
        gib(m.weights),
        gib(m.grads),
        gib(m.optimizer),
        gib(m.activations),
        gib(m.workspace),
        gib(c.memory_total),
        c.cost.step_s,
        tokens_per_s(c.cost.tokens_per_s),
        c.cost.mfu * 100.0,
        c.gpu_engine_refuses.unwrap_or("runs")
    )
}

fn print_table(plan: &Plan, model: &Path, top: usize) {
    let m = &plan.model;
    let hw = &plan.hardware;
    let req = &plan.request;
    println!(
        "model: {} ({:.2} B parameters, {} layers, hidden {}, {}/{} heads, vocab {})",
        model.display(),
        m.parameters as f64 / 1e9,
        m.layers,
        m.hidden_size,
        m.attention_heads,
        m.kv_heads,
        m.vocab_size
    );
    println!(
        "job: {} GPUs ({} node{} × {}) of {} GiB; sequences of {} tokens, global batch {} \
         ({:.2} M tokens per step)",
        hw.gpus,
        hw.gpus / hw.gpus_per_node.max(1),
        if hw.gpus / hw.gpus_per_node.max(1) == 1 {
            ""
        } else {
            "s"
        },
        hw.gpus_per_node,
        gib(hw.gpu_memory_bytes),
        req.seq_len,
        req.global_batch,
        (req.seq_len * req.global_batch) as f64 / 1e6
    );
    println!(
        "{} layouts considered, {} fit; the fastest {} (◀ the recommendation: the simplest the \
         GPU engine runs within {:.0} % of the fastest step it runs):",
        plan.considered,
        plan.ranked.len(),
        top.min(plan.ranked.len()),
        plan::search::NEAR_FASTEST * 100.0
    );
    println!();
    println!(
        "| # | TP | PP | v | DP | ZeRO | micro-batch × steps | ckpt | weights | grads | optimizer | activations | workspace | GiB/GPU | step s | tokens/s | MFU | GPU engine |"
    );
    println!("|{}", "---|".repeat(18));
    let r = &plan.recommended;
    for (i, c) in plan.ranked.iter().take(top).enumerate() {
        println!("{}", row(i + 1, c, c == r));
    }
    if let Some(i) = plan.ranked.iter().skip(top).position(|c| c == r) {
        println!("| … |{}", " |".repeat(17));
        println!("{}", row(top + i + 1, r, true));
    }
    let cost = &r.cost;
    println!();
    match r.gpu_engine_refuses {
        None => println!("recommended: {}", r.layout.describe()),
        Some(why) => println!(
            "recommended: {} (the GPU engine runs no layout that fits: {why}; the CPU engine \
             runs it where it is not ZeRO-3)",
            r.layout.describe()
        ),
    }
    println!(
        "  memory per GPU: {} GiB of {} (weights {}, gradients {}, optimizer {}, activations {}, \
         workspace {}; {} kept free for the CUDA context)",
        gib(r.memory_total),
        gib(hw.gpu_memory_bytes),
        gib(r.memory.weights),
        gib(r.memory.grads),
        gib(r.memory.optimizer),
        gib(r.memory.activations),
        gib(r.memory.workspace),
        gib(hw.reserved_bytes)
    );
    println!(
        "  predicted step: {:.3} s (compute {:.3}, TP {:.3}, PP {:.3}, bubble {:.3}, DP {:.3}, \
         optimizer {:.3}): {} tokens/s, MFU {:.1} %",
        cost.step_s,
        cost.compute_s,
        cost.tp_comm_s,
        cost.pp_comm_s,
        cost.bubble_s,
        cost.dp_comm_s,
        cost.optimizer_s,
        tokens_per_s(cost.tokens_per_s),
        cost.mfu * 100.0
    );
    println!(
        "  TILEARN_HYBRID_TP_SIZE={} TILEARN_HYBRID_PP_SIZE={} TILEARN_HYBRID_ZERO_STAGE={}{}",
        r.layout.tp,
        r.layout.pp,
        r.layout.zero.number(),
        if r.layout.virtual_stages > 1 {
            format!(" (interleaved, {} virtual stages)", r.layout.virtual_stages)
        } else {
            String::new()
        }
    );
    let nodes = hw.gpus / hw.gpus_per_node.max(1);
    let launcher = if nodes > 1 {
        format!(
            "--nnodes {nodes} --node-rank <this node> --master-addr <node 0> --nproc-per-node {}",
            hw.gpus_per_node
        )
    } else {
        format!("--standalone --nproc-per-node {}", hw.gpus_per_node)
    };
    println!(
        "  tilearn launch {launcher} train --device cuda --bf16 {} --model … --data …",
        plan.recommended_train_flags.join(" ")
    );
    println!(
        "note: predictions. Compute rates are the H200's measured ones, NVLink {:.0} GB/s and \
         InfiniBand {:.0} GB/s bus bandwidths are assumptions. The GPU engine runs data \
         parallelism with ZeRO-0/1/2, alone or around TP, PP or both (the column says why it \
         refuses the rest: the CPU engine runs them, ZeRO-3 is not built).",
        hw.intra_node_bus_bytes_per_s / 1e9,
        hw.inter_node_bus_bytes_per_s / 1e9
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_sizes_parse_with_units_and_refuse_nonsense() {
        assert_eq!(parse_memory("141GiB").unwrap(), 141.0 * GIB);
        assert_eq!(parse_memory("80 GiB").unwrap(), 80.0 * GIB);
        assert_eq!(parse_memory("144GB").unwrap(), 144e9);
        assert_eq!(
            parse_memory("81559MiB").unwrap(),
            81559.0 * (1u64 << 20) as f64
        );
        assert!(parse_memory("lots").unwrap_err().contains("141GiB"));
        assert!(
            parse_memory("80 parsecs")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(parse_memory("0GiB").is_err());
    }
}
