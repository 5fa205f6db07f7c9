//! The advisor's search: every layout the GPUs, the model's shape and the global batch allow,
//! each with its worst rank's memory and its predicted step, ranked fastest first among those
//! that fit. The recommendation is the simplest of those within [`NEAR_FASTEST`] of the fastest:
//! differences that small are below what the cost model can tell apart (its calibration errors
//! are several per cent), while each extra degree of model parallelism, ZeRO-3's per-layer
//! gathers and recomputation are real costs in complexity the model does not price. Simplest
//! means: the smallest TP·PP·v, then not ZeRO-3, then no checkpointing, then the least memory.
//! Every layout is priced, but only those the GPU engine runs today are recommended
//! ([`engine_support`](super::engine_support)), so the recommendation can be launched as
//! printed; when it runs none that fit, the recommendation is the simplest of all, marked.

use serde::Serialize;

use super::cost::{StepCost, step_cost};
use super::hardware::Hardware;
use super::layout::{Layout, ShardStage, split_heads};
use super::memory::{MemoryBreakdown, rank_memory};
use super::shard::{RankWidths, StagePosition, rank_params};
use crate::config::LlamaConfig;
use crate::error::{EngineError, Result};

/// What to plan for besides the model and the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PlanRequest {
    pub seq_len: usize,
    /// Sequences per optimizer step over all data-parallel ranks.
    pub global_batch: usize,
    /// A fixed micro-batch (sequences per rank per micro-batch); `None` tries powers of two.
    pub micro_batch: Option<usize>,
}

/// One evaluated layout.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Candidate {
    pub layout: Layout,
    /// The rank that needs the most memory (the first pipeline rank, or the last when its
    /// logits outweigh the first's activations).
    pub memory: MemoryBreakdown,
    pub memory_total: f64,
    pub fits: bool,
    pub cost: StepCost,
    /// Why `tilearn train --device cuda` would refuse the layout today; `None` when it runs it.
    pub gpu_engine_refuses: Option<&'static str>,
}

/// The model as the advisor saw it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelSummary {
    pub parameters: usize,
    pub layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub attention_heads: usize,
    pub kv_heads: usize,
    pub vocab_size: usize,
}

/// Everything the advisor found.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub model: ModelSummary,
    pub hardware: Hardware,
    pub request: PlanRequest,
    /// Layouts evaluated.
    pub considered: usize,
    /// Those that fit, fastest first.
    pub ranked: Vec<Candidate>,
    /// The simplest layout within [`NEAR_FASTEST`] of the fastest that fits.
    pub recommended: Candidate,
    /// The `tilearn train` flags of the recommendation ([`Layout::train_flags`]).
    pub recommended_train_flags: Vec<String>,
}

/// Layouts predicted within this fraction of the fastest step count as equally fast.
pub const NEAR_FASTEST: f64 = 0.02;

/// The simplest of the `ranked` (fastest first) layouts the GPU engine runs within
/// [`NEAR_FASTEST`] of the fastest of those; of all of them when it runs none.
pub fn recommend(ranked: &[Candidate]) -> Option<Candidate> {
    let runs: Vec<Candidate> = ranked
        .iter()
        .filter(|c| c.gpu_engine_refuses.is_none())
        .copied()
        .collect();
    simplest_near_fastest(if runs.is_empty() { ranked } else { &runs })
}

/// The simplest of the `ranked` (fastest first) layouts within [`NEAR_FASTEST`] of the first.
fn simplest_near_fastest(ranked: &[Candidate]) -> Option<Candidate> {
    let fastest = ranked.first()?.cost.step_s;
    let simplicity = |c: &Candidate| {
        let l = &c.layout;
        (
            l.tp * l.pp * l.virtual_stages,
            l.zero == ShardStage::Zero3,
            l.checkpointing,
        )
    };
    ranked
        .iter()
        .take_while(|c| c.cost.step_s <= fastest * (1.0 + NEAR_FASTEST))
        .min_by(|a, b| {
            simplicity(a)
                .cmp(&simplicity(b))
                .then(a.memory_total.total_cmp(&b.memory_total))
        })
        .copied()
}

fn invalid(argument: &str, message: String) -> EngineError {
    EngineError::InvalidArgument {
        argument: argument.into(),
        message,
    }
}

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}

/// Evaluates `layout`: its worst rank's memory and its step.
pub fn evaluate(
    hw: &Hardware,
    config: &LlamaConfig,
    layout: &Layout,
    seq: usize,
    global_tokens: f64,
) -> std::result::Result<Candidate, String> {
    let split = split_heads(config, layout.tp)?;
    let widths = RankWidths::new(config, split, layout.tp);
    let ranks: Vec<_> = StagePosition::pipeline_ranks(config, layout, seq)?
        .into_iter()
        .map(|(pos, layers)| (pos, layers, rank_params(config, widths, pos, layers)))
        .collect();
    let memory = ranks
        .iter()
        .map(|(pos, layers, params)| rank_memory(hw, widths, layout, params, *layers, seq, *pos))
        .max_by(|a, b| a.total().total_cmp(&b.total()))
        .unwrap_or_default();
    let num_params = crate::model::ModelLayout::from_config(config).numel;
    let cost = step_cost(
        hw,
        config,
        widths,
        layout,
        &ranks,
        seq,
        global_tokens,
        num_params,
    );
    Ok(Candidate {
        layout: *layout,
        memory,
        memory_total: memory.total(),
        fits: memory.total() <= hw.usable_bytes(),
        cost,
        gpu_engine_refuses: super::engine_support::gpu_engine_refusal(config, layout),
    })
}

/// The layouts of `hw.gpus` GPUs for `config` and `request`: TP dividing the GPUs of a node
/// and splitting the heads, PP dividing the layers, v ∈ {1, 2} virtual stages (interleaving
/// needs m divisible by p), every ZeRO stage when DP > 1, powers-of-two micro-batches dividing
/// the per-rank batch (or the requested one), checkpointing off and on.
pub fn layouts(hw: &Hardware, config: &LlamaConfig, request: &PlanRequest) -> Vec<Layout> {
    let mut out = Vec::new();
    let world = hw.gpus;
    for tp in divisors(hw.gpus_per_node) {
        if split_heads(config, tp).is_err() {
            continue;
        }
        for pp in divisors(world / tp) {
            if !config.num_hidden_layers.is_multiple_of(pp) {
                continue;
            }
            let dp = world / (tp * pp);
            if !request.global_batch.is_multiple_of(dp) {
                continue;
            }
            let per_rank = request.global_batch / dp;
            let micro_batches: Vec<usize> = match request.micro_batch {
                Some(b) => vec![b],
                None => (0..usize::BITS)
                    .map(|k| 1usize << k)
                    .take_while(|&b| b <= per_rank)
                    .collect(),
            };
            let stages: &[ShardStage] = if dp > 1 {
                &ShardStage::ALL
            } else {
                &[ShardStage::Zero0]
            };
            for v in [1, 2] {
                if v > 1 && (pp == 1 || !(config.num_hidden_layers / pp).is_multiple_of(v)) {
                    continue;
                }
                for &b in &micro_batches {
                    if !per_rank.is_multiple_of(b) {
                        continue;
                    }
                    let m = per_rank / b;
                    if v > 1 && !m.is_multiple_of(pp) {
                        continue;
                    }
                    for &zero in stages {
                        for checkpointing in [false, true] {
                            let mut layout = Layout {
                                tp,
                                pp,
                                virtual_stages: v,
                                dp,
                                zero,
                                micro_batch: b,
                                micro_batches: m,
                                checkpointing,
                                offload_checkpoints: false,
                            };
                            layout.offload_checkpoints = layout.auto_offload(request.seq_len);
                            out.push(layout);
                        }
                    }
                }
            }
        }
    }
    out
}

/// Checks the request against the machine before any search.
fn check_request(hw: &Hardware, request: &PlanRequest) -> Result<()> {
    if hw.gpus == 0 {
        return Err(invalid("--gpus", "must be at least 1".into()));
    }
    if hw.gpus_per_node == 0 || !hw.gpus.is_multiple_of(hw.gpus_per_node) {
        return Err(invalid(
            "--nnodes",
            format!(
                "{} GPUs cannot be spread evenly over the nodes; use a node count that divides \
                 --gpus",
                hw.gpus
            ),
        ));
    }
    if request.seq_len == 0 {
        return Err(invalid("--seq-len", "must be at least 1".into()));
    }
    if request.global_batch == 0 {
        return Err(invalid("--global-batch-size", "must be at least 1".into()));
    }
    if request.micro_batch == Some(0) {
        return Err(invalid("--micro-batch-size", "must be at least 1".into()));
    }
    if hw.gpu_memory_bytes <= hw.reserved_bytes {
        return Err(invalid(
            "--gpu-memory",
            format!(
                "{:.1} GiB leaves nothing after the {:.1} GiB the plan reserves for the CUDA \
                 context; give the GPU's memory, e.g. 80GiB or 141GiB",
                hw.gpu_memory_bytes / GIB,
                hw.reserved_bytes / GIB
            ),
        ));
    }
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;

/// Every layout of `request` on `hw` evaluated: (how many, those that fit fastest first, the
/// leanest of all).
fn rank(
    config: &LlamaConfig,
    hw: &Hardware,
    request: &PlanRequest,
) -> (usize, Vec<Candidate>, Option<Candidate>) {
    let global_tokens = (request.global_batch * request.seq_len) as f64;
    let mut all: Vec<Candidate> = layouts(hw, config, request)
        .iter()
        .filter_map(|l| evaluate(hw, config, l, request.seq_len, global_tokens).ok())
        .collect();
    let considered = all.len();
    let leanest = all
        .iter()
        .min_by(|a, b| a.memory_total.total_cmp(&b.memory_total))
        .copied();
    all.retain(|c| c.fits);
    all.sort_by(|a, b| {
        a.cost
            .step_s
            .total_cmp(&b.cost.step_s)
            .then(a.memory_total.total_cmp(&b.memory_total))
    });
    (considered, all, leanest)
}

/// The fewest GPUs (`hw`'s count times a power of two up to 64, same GPUs per node) on which
/// some layout fits, with the global batch rounded up to a multiple of them, and the layout
/// recommended there.
fn fewest_gpus_that_fit(
    config: &LlamaConfig,
    hw: &Hardware,
    request: &PlanRequest,
) -> Option<(usize, Candidate)> {
    (1..=6).find_map(|k| {
        let gpus = hw.gpus << k;
        let nnodes = gpus.div_ceil(hw.gpus_per_node);
        let bigger = Hardware {
            gpus,
            gpus_per_node: gpus / nnodes,
            ..hw.clone()
        };
        let request = PlanRequest {
            global_batch: request.global_batch.div_ceil(gpus) * gpus,
            ..*request
        };
        let (_, fits, _) = rank(config, &bigger, &request);
        recommend(&fits).map(|c| (gpus, c))
    })
}

/// Plans `config` on `hw`: every layout evaluated, those that fit ranked, the fastest that fits
/// recommended. Errors name what to change when nothing can be laid out or nothing fits.
pub fn plan(config: &LlamaConfig, hw: &Hardware, request: &PlanRequest) -> Result<Plan> {
    check_request(hw, request)?;
    let (considered, ranked, leanest) = rank(config, hw, request);
    let parameters = crate::model::ModelLayout::from_config(config).numel;
    if considered == 0 {
        return Err(invalid(
            "--global-batch-size",
            format!(
                "{} sequences cannot be divided among the data-parallel ranks of any layout of \
                 {} GPUs{}; use a global batch that is a multiple of {}",
                request.global_batch,
                hw.gpus,
                request
                    .micro_batch
                    .map(|b| format!(" in micro-batches of {b}"))
                    .unwrap_or_default(),
                hw.gpus * request.micro_batch.unwrap_or(1)
            ),
        ));
    }
    let Some(recommended) = recommend(&ranked) else {
        let leanest = leanest.map_or_else(String::new, |c| {
            format!(
                "; the leanest layout ({}) needs {:.1} GiB per GPU plus {:.1} GiB kept free \
                 for the CUDA context",
                c.layout.describe(),
                c.memory_total / GIB,
                hw.reserved_bytes / GIB
            )
        });
        let more = fewest_gpus_that_fit(config, hw, request).map_or_else(String::new, |(n, c)| {
            format!(
                "; {n} GPUs would fit it ({}, {:.1} GiB per GPU)",
                c.layout.describe(),
                c.memory_total / GIB
            )
        });
        return Err(invalid(
            "--gpu-memory",
            format!(
                "no layout of this {:.2} B-parameter model fits {} GPUs of {:.1} GiB at \
                 --seq-len {}{leanest}{more}; use more GPUs (--gpus, --nnodes), GPUs with more \
                 memory (--gpu-memory), a shorter --seq-len or a smaller --micro-batch-size",
                parameters as f64 / 1e9,
                hw.gpus,
                hw.gpu_memory_bytes / GIB,
                request.seq_len
            ),
        ));
    };
    Ok(Plan {
        model: ModelSummary {
            parameters,
            layers: config.num_hidden_layers,
            hidden_size: config.hidden_size,
            intermediate_size: config.intermediate_size,
            attention_heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            vocab_size: config.vocab_size,
        },
        hardware: hw.clone(),
        request: *request,
        considered,
        ranked,
        recommended_train_flags: recommended.layout.train_flags(request.seq_len),
        recommended,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: f64 = (1u64 << 30) as f64;

    fn config(layers: usize, hidden: usize, heads: usize, kv: usize, inter: usize) -> LlamaConfig {
        let json = format!(
            r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": {hidden}, "num_hidden_layers": {layers},
            "num_attention_heads": {heads}, "num_key_value_heads": {kv},
            "intermediate_size": {inter}, "vocab_size": 32000, "max_position_embeddings": 4096}}"#
        );
        LlamaConfig::from_json_str(&json, "test.json").unwrap()
    }

    fn request(global_batch: usize) -> PlanRequest {
        PlanRequest {
            seq_len: 4096,
            global_batch,
            micro_batch: None,
        }
    }

    #[test]
    fn layouts_respect_the_machine_the_heads_and_the_batch() {
        // TinyLlama's shape: 22 layers, 32 query and 4 kv heads.
        let c = config(22, 2048, 32, 4, 5632);
        let hw = Hardware::h200(16, 2, 141.0 * GIB);
        let all = layouts(&hw, &c, &request(64));
        assert!(!all.is_empty());
        for l in &all {
            assert_eq!(l.world(), 16, "{l:?}");
            assert!(l.tp <= 8, "TP crosses nodes: {l:?}");
            assert_eq!(22 % (l.pp * l.virtual_stages), 0, "{l:?}");
            assert_eq!(l.dp * l.micro_batch * l.micro_batches, 64, "{l:?}");
            if l.dp == 1 {
                assert_eq!(l.zero, ShardStage::Zero0);
            }
        }
        // TP=8 > 4 kv heads is allowed (replicated); 22 layers admit PP 1, 2 and 11 only.
        assert!(all.iter().any(|l| l.tp == 8));
        let pps: std::collections::BTreeSet<_> = all.iter().map(|l| l.pp).collect();
        assert_eq!(pps.into_iter().collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn the_recommendation_fits_and_is_the_simplest_of_the_fastest() {
        let c = config(32, 4096, 32, 32, 11008);
        for memory in [80.0, 141.0] {
            let hw = Hardware::h200(8, 1, memory * GIB);
            let p = plan(&c, &hw, &request(256)).unwrap();
            let r = p.recommended;
            assert!(r.fits && r.memory_total + hw.reserved_bytes <= memory * GIB);
            assert!(p.ranked.iter().all(|x| x.fits));
            assert!(
                p.ranked
                    .windows(2)
                    .all(|w| w[0].cost.step_s <= w[1].cost.step_s)
            );
            let fastest = p.ranked[0].cost.step_s;
            assert!(p.ranked.contains(&r));
            // The recommendation runs on the GPU engine, within 2 % of the fastest that does.
            assert_eq!(r.gpu_engine_refuses, None);
            let runs: Vec<&Candidate> = p
                .ranked
                .iter()
                .filter(|x| x.gpu_engine_refuses.is_none())
                .collect();
            let fastest_run = runs[0].cost.step_s;
            assert!(r.cost.step_s <= fastest_run * (1.0 + NEAR_FASTEST));
            // Nothing as fast that runs is simpler: no smaller TP·PP·v, no checkpointing
            // needlessly, no less memory at the same simplicity.
            let degree = |l: &Layout| l.tp * l.pp * l.virtual_stages;
            for x in runs
                .into_iter()
                .filter(|x| x.cost.step_s <= fastest_run * (1.0 + NEAR_FASTEST))
            {
                assert!(degree(&x.layout) >= degree(&r.layout), "{x:?}");
                if degree(&x.layout) == degree(&r.layout)
                    && (x.layout.zero == ShardStage::Zero3) == (r.layout.zero == ShardStage::Zero3)
                    && x.layout.checkpointing == r.layout.checkpointing
                {
                    assert!(x.memory_total >= r.memory_total, "{x:?}");
                }
            }
            // Anything faster than the fastest that fits does not fit.
            let global_tokens = (256 * 4096) as f64;
            for l in layouts(&hw, &c, &request(256)) {
                if let Ok(x) = evaluate(&hw, &c, &l, 4096, global_tokens)
                    && x.cost.step_s < fastest
                {
                    assert!(!x.fits, "{l:?} is faster and fits");
                }
            }
        }
    }

    #[test]
    fn a_model_too_large_says_how_many_gpus_would_do() {
        // Llama-2-70B's shape: 16 bytes per parameter (18 less the per-layer working copy
        // under checkpointing) alone exceed 8 × 120 GiB.
        let c = config(80, 8192, 64, 8, 28672);
        let hw = Hardware::h200(8, 1, 120.0 * GIB);
        let err = plan(&c, &hw, &request(256)).unwrap_err().to_string();
        assert!(
            err.contains("--gpu-memory") && err.contains("16 GPUs would fit"),
            "{err}"
        );
    }
}
