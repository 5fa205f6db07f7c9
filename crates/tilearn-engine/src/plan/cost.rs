//! The predicted time of one training step of a layout: each rank's micro-batches (GEMMs at the
//! measured bf16 GEMM rate times a shape efficiency, flash attention at its measured rates,
//! the memory-bound rest at the copy bandwidth), tensor-parallel all-reduces and pipeline
//! sends at the assumed interconnect bandwidths, the pipeline bubble (p − 1)/(m·v), the
//! data-parallel collectives less what the backward hides, and the optimizer at the fused
//! AdamW's measured bandwidth.
//!
//! The GEMM shape efficiency is the one fitted constant: a step runs its GEMMs at
//! `GEMM_EFFICIENCY_MAX · w / (w + GEMM_EFFICIENCY_HALF_WIDTH)` of the 8192³ rate, w the
//! narrowest dimension of the rank's GEMMs (hidden size, its q or MLP slice, or the
//! micro-batch's tokens). Fitted to the three measured single-GPU steps (llama-134m,
//! TinyLlama, the Llama-2-7B shape; `tests::calibration`), it says that narrow GEMMs run
//! slower, which is what makes high TP cost more than its communication.

use serde::Serialize;

use super::hardware::Hardware;
use super::layout::{Layout, ShardStage};
use super::memory::GPU_MIXED_PRECISION_ADAMW;
use super::shard::{RankParams, RankWidths, StagePosition};
use crate::config::LlamaConfig;

/// Fitted: the fraction of the 8192³ GEMM rate very wide GEMMs reach inside a step.
pub const GEMM_EFFICIENCY_MAX: f64 = 0.82;
/// Fitted: the GEMM width at which a step reaches half of [`GEMM_EFFICIENCY_MAX`].
pub const GEMM_EFFICIENCY_HALF_WIDTH: f64 = 360.0;

/// Bytes the fused AdamW moves per owned parameter in the engine's layout: fp32 master,
/// two moments (read and write, 24), the fp32 gradient (4) and the 16-bit working copy (2).
const OPTIMIZER_BYTES_PER_PARAM: f64 = 30.0;

/// Memory traffic of the non-GEMM ops per activation element a layer saves, forward and
/// backward: the norms, rotary embedding, SwiGLU, residual adds read and write each saved
/// element about once forward and twice backward (an estimate).
const ELEMENTWISE_PASSES: f64 = 3.0;

/// Training FLOPs per token: 6·N for the matmuls of forward and backward, plus causal attention
/// (scores and values: 12·L·T·(Hq·D), halved by the causal mask); the MFU numerator of
/// `tilearn bench` and the PyTorch baseline.
pub fn flops_per_token(config: &LlamaConfig, num_params: usize, seq: usize) -> f64 {
    let attn = 6 * config.num_hidden_layers * seq * config.num_attention_heads * config.head_dim;
    6.0 * num_params as f64 + attn as f64
}

/// The fraction of the GEMM ceiling a step's GEMMs of narrowest dimension `width` reach.
pub fn gemm_efficiency(width: f64) -> f64 {
    GEMM_EFFICIENCY_MAX * width / (width + GEMM_EFFICIENCY_HALF_WIDTH)
}

/// Time of an all-reduce of `bytes` over `ranks` at bus bandwidth `bus` (ring: 2(k−1)/k).
fn all_reduce_s(hw: &Hardware, bytes: f64, ranks: usize, bus: f64) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let k = ranks as f64;
    hw.collective_latency_s + 2.0 * (k - 1.0) / k * bytes / bus
}

/// Time of a reduce-scatter or all-gather of a `bytes` buffer over `ranks` ((k−1)/k).
fn half_collective_s(hw: &Hardware, bytes: f64, ranks: usize, bus: f64) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let k = ranks as f64;
    hw.collective_latency_s + (k - 1.0) / k * bytes / bus
}

/// One micro-batch's forward and backward on one rank, split by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MicroBatchCost {
    pub gemm_s: f64,
    pub attention_s: f64,
    pub elementwise_s: f64,
    pub tp_comm_s: f64,
    pub pp_comm_s: f64,
}

impl MicroBatchCost {
    pub fn compute_s(&self) -> f64 {
        self.gemm_s + self.attention_s + self.elementwise_s
    }

    pub fn total_s(&self) -> f64 {
        self.compute_s() + self.tp_comm_s + self.pp_comm_s
    }

    /// The backward's part of the compute (2 of the 3 matmul passes, 2.5 of the attention's
    /// 3.5 and 2 of the 3 elementwise passes): the time a gradient collective can hide under.
    pub fn backward_s(&self) -> f64 {
        2.0 / 3.0 * (self.gemm_s + self.elementwise_s) + 2.5 / 3.5 * self.attention_s
    }
}

/// The cost of one micro-batch on the rank at `position`.
pub fn micro_batch_cost(
    hw: &Hardware,
    w: RankWidths,
    layout: &Layout,
    params: &RankParams,
    layers: usize,
    seq: usize,
    position: StagePosition,
) -> MicroBatchCost {
    let tokens = layout.micro_batch * seq;
    let n = tokens as f64;
    let ckpt = if layout.checkpointing { 1.0 } else { 0.0 };
    let layers_f = layers as f64;

    let width = [w.hidden, w.q, w.inter, tokens]
        .into_iter()
        .min()
        .unwrap_or(1) as f64;
    let gemm_flops = 6.0 * n * params.matmul as f64 + ckpt * 2.0 * n * params.layer_matmul as f64;
    let gemm_s = gemm_flops / (hw.gemm_flops * gemm_efficiency(width));

    // Causal attention forward: 4·B·T²·H·D halved by the mask; the backward 2.5× that.
    let b = layout.micro_batch as f64;
    let t = seq as f64;
    let forward = 2.0 * b * t * t * (w.q_heads * w.head_dim) as f64;
    let (fwd_rate, bwd_rate) = hw.attention_flops(w.head_dim, seq);
    // Checkpoint offload keeps each layer's attention output: no recomputed attention forward.
    let recomputed = if layout.offload_checkpoints {
        0.0
    } else {
        ckpt
    };
    let attention_s =
        layers_f * ((1.0 + recomputed) * forward / fwd_rate + 2.5 * forward / bwd_rate);

    let (c, q, kv, i) = (w.hidden as f64, w.q as f64, w.kv as f64, w.inter as f64);
    let saved_per_token = 4.0 * c + 2.0 * (q + kv) + 3.0 * i;
    let passes = ELEMENTWISE_PASSES + ckpt;
    let mut elementwise_bytes = 2.0 * passes * saved_per_token * n * layers_f;
    if position.last {
        // The logits written by the lm_head GEMM, read by the fused cross entropy, which
        // writes their gradient in place, read again by the lm_head backward.
        elementwise_bytes += 4.0 * 2.0 * w.vocab as f64 * n;
    }
    let elementwise_s = elementwise_bytes / hw.copy_bytes_per_s;

    // Tensor parallel: two all-reduces of [N, C] per layer forward and two backward (two more
    // for the recomputed forward), one after the vocabulary-parallel embedding, and the
    // vocabulary-parallel cross entropy's three of [N] f32 (row max, sum of exponentials,
    // target logit).
    let tp_bus = hw.bus_bytes_per_s(layout.tp);
    let activation = n * c * 2.0;
    let mut tp_comm_s =
        layers_f * (4.0 + 2.0 * ckpt) * all_reduce_s(hw, activation, layout.tp, tp_bus);
    if position.first {
        tp_comm_s += all_reduce_s(hw, activation, layout.tp, tp_bus);
    }
    if position.last {
        tp_comm_s += 3.0 * all_reduce_s(hw, n * 4.0, layout.tp, tp_bus);
    }

    // Pipeline: per virtual stage, the activations sent forward and their gradient back.
    let pp_comm_s = if layout.pp > 1 {
        let neighbour_span = 2 * layout.tp * layout.dp;
        let bus = hw.bus_bytes_per_s(neighbour_span);
        2.0 * layout.virtual_stages as f64 * (hw.collective_latency_s + activation / bus)
    } else {
        0.0
    };

    MicroBatchCost {
        gemm_s,
        attention_s,
        elementwise_s,
        tp_comm_s,
        pp_comm_s,
    }
}

/// The predicted step of a layout, on its slowest rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct StepCost {
    /// The micro-batches' GEMMs, attention and elementwise work.
    pub compute_s: f64,
    pub tp_comm_s: f64,
    pub pp_comm_s: f64,
    /// Idle pipeline time: (p − 1)/(m·v) of the pipeline's busy time.
    pub bubble_s: f64,
    /// Data-parallel collectives not hidden under the backward.
    pub dp_comm_s: f64,
    pub optimizer_s: f64,
    pub step_s: f64,
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation against the dense bf16 peak.
    pub mfu: f64,
}

/// Data-parallel communication left exposed for a rank holding `psi` parameters whose
/// micro-batch takes `mb` (see the module docs of [`super`] for the schedule of each stage).
fn exposed_dp_comm_s(hw: &Hardware, layout: &Layout, psi: f64, mb: &MicroBatchCost) -> f64 {
    let d = layout.dp;
    if d <= 1 {
        return 0.0;
    }
    let bus = hw.bus_bytes_per_s(layout.tp * d);
    let bytes = GPU_MIXED_PRECISION_ADAMW;
    let grads = psi * bytes.grads as f64;
    let weights = psi * bytes.weights as f64;
    let m = layout.micro_batches as f64;
    let hidden_under = |comm: f64, compute: f64| (comm - compute).max(0.0);
    match layout.zero {
        // One all-reduce of the gradients, overlapped with the last micro-batch's backward.
        ShardStage::Zero0 => hidden_under(all_reduce_s(hw, grads, d, bus), mb.backward_s()),
        // One reduce-scatter overlapped likewise, then the updated weights gathered.
        ShardStage::Zero1 => {
            hidden_under(half_collective_s(hw, grads, d, bus), mb.backward_s())
                + half_collective_s(hw, weights, d, bus)
        }
        // A reduce-scatter after every micro-batch's backward, then the gather.
        ShardStage::Zero2 => {
            m * hidden_under(half_collective_s(hw, grads, d, bus), mb.backward_s())
                + half_collective_s(hw, weights, d, bus)
        }
        // Weights gathered for the forward and again for the backward, gradients
        // reduce-scattered, every micro-batch, prefetched under its compute.
        ShardStage::Zero3 => {
            let per_mb =
                2.0 * half_collective_s(hw, weights, d, bus) + half_collective_s(hw, grads, d, bus);
            m * hidden_under(per_mb, mb.compute_s())
        }
    }
}

/// The step of `layout` whose ranks hold `ranks` (position, decoder layers, parameters) for `global_tokens`
/// tokens per step of a model of `num_params` parameters.
#[allow(clippy::too_many_arguments)]
pub fn step_cost(
    hw: &Hardware,
    config: &LlamaConfig,
    w: RankWidths,
    layout: &Layout,
    ranks: &[(StagePosition, usize, RankParams)],
    seq: usize,
    global_tokens: f64,
    num_params: usize,
) -> StepCost {
    let mut slowest = MicroBatchCost::default();
    let mut psi_max = 0.0f64;
    for (position, layers, params) in ranks {
        let mb = micro_batch_cost(hw, w, layout, params, *layers, seq, *position);
        if mb.total_s() > slowest.total_s() {
            slowest = mb;
        }
        psi_max = psi_max.max(params.total as f64);
    }
    let m = layout.micro_batches as f64;
    let busy = m * slowest.total_s();
    let bubble_s = layout.bubble_fraction() * busy;
    let dp_comm_s = exposed_dp_comm_s(hw, layout, psi_max, &slowest);
    let sharded = layout.zero != ShardStage::Zero0 && layout.dp > 1;
    let owned = if sharded {
        psi_max / layout.dp as f64
    } else {
        psi_max
    };
    let grads_held = if layout.zero >= ShardStage::Zero2 {
        owned
    } else {
        psi_max
    };
    // The fused AdamW on the owned parameters; the clip norm's read and zero_grad's write of
    // the held fp32 gradients.
    let optimizer_s = OPTIMIZER_BYTES_PER_PARAM * owned / hw.optimizer_bytes_per_s
        + 8.0 * grads_held / hw.copy_bytes_per_s;
    let step_s = busy + bubble_s + dp_comm_s + optimizer_s;
    let tokens_per_s = global_tokens / step_s;
    let mfu = flops_per_token(config, num_params, seq) * tokens_per_s
        / (layout.world() as f64 * hw.peak_flops);
    StepCost {
        compute_s: m * slowest.compute_s(),
        tp_comm_s: m * slowest.tp_comm_s,
        pp_comm_s: m * slowest.pp_comm_s,
        bubble_s,
        dp_comm_s,
        optimizer_s,
        step_s,
        tokens_per_s,
        mfu,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::layout::split_heads;
    use crate::plan::shard::rank_params;

    const GIB: f64 = (1u64 << 30) as f64;

    fn config() -> LlamaConfig {
        let json = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
            "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
            "num_key_value_heads": 4, "vocab_size": 32000}"#;
        LlamaConfig::from_json_str(json, "test.json").unwrap()
    }

    fn layout(tp: usize, pp: usize, v: usize, dp: usize, m: usize) -> Layout {
        Layout {
            tp,
            pp,
            virtual_stages: v,
            dp,
            zero: ShardStage::Zero1,
            micro_batch: 2,
            micro_batches: m,
            checkpointing: false,
            offload_checkpoints: false,
        }
    }

    fn step(hw: &Hardware, c: &LlamaConfig, l: &Layout) -> (StepCost, MicroBatchCost) {
        let w = RankWidths::new(c, split_heads(c, l.tp).unwrap(), l.tp);
        let ranks: Vec<_> = StagePosition::pipeline_ranks(c, l, 512)
            .unwrap()
            .into_iter()
            .map(|(p, layers)| (p, layers, rank_params(c, w, p, layers)))
            .collect();
        let slowest = ranks
            .iter()
            .map(|(p, layers, r)| micro_batch_cost(hw, w, l, r, *layers, 512, *p))
            .max_by(|a, b| a.total_s().total_cmp(&b.total_s()))
            .unwrap();
        let tokens = (l.dp * l.micro_batch * l.micro_batches * 512) as f64;
        (step_cost(hw, c, w, l, &ranks, 512, tokens, 1), slowest)
    }

    #[test]
    fn collectives_and_efficiency_by_hand() {
        let hw = Hardware::h200(8, 1, 141.0 * GIB);
        let bus = hw.intra_node_bus_bytes_per_s;
        assert_eq!(all_reduce_s(&hw, 1e9, 1, bus), 0.0);
        let expected = 20e-6 + 2.0 * 7.0 / 8.0 * 1e9 / 360e9;
        assert!((all_reduce_s(&hw, 1e9, 8, bus) - expected).abs() < 1e-15);
        let expected = 20e-6 + 3.0 / 4.0 * 1e9 / 360e9;
        assert!((half_collective_s(&hw, 1e9, 4, bus) - expected).abs() < 1e-15);
        assert!((gemm_efficiency(GEMM_EFFICIENCY_HALF_WIDTH) - 0.41).abs() < 1e-12);
        assert_eq!(hw.bus_bytes_per_s(8), bus);
        assert_eq!(hw.bus_bytes_per_s(16), hw.inter_node_bus_bytes_per_s);
    }

    #[test]
    fn the_bubble_is_p_minus_one_over_m_v_of_the_busy_pipeline() {
        let hw = Hardware::h200(8, 1, 141.0 * GIB);
        let c = config();
        for (pp, v, m) in [(4, 1, 8), (4, 2, 8), (2, 1, 16), (8, 1, 8)] {
            let l = layout(1, pp, v, 8 / pp, m);
            let (cost, mb) = step(&hw, &c, &l);
            let busy = m as f64 * mb.total_s();
            let expected = (pp - 1) as f64 / (m * v) as f64 * busy;
            assert!((cost.bubble_s - expected).abs() <= 1e-12 * busy, "{l:?}");
            assert!(mb.pp_comm_s > 0.0);
        }
        let (cost, mb) = step(&hw, &c, &layout(1, 1, 1, 8, 8));
        assert_eq!((cost.bubble_s, mb.pp_comm_s, mb.tp_comm_s), (0.0, 0.0, 0.0));
    }

    #[test]
    fn tensor_parallel_traffic_is_four_all_reduces_per_layer() {
        let hw = Hardware::h200(8, 1, 141.0 * GIB);
        let c = config();
        let (_, mb) = step(&hw, &c, &layout(4, 1, 1, 2, 4));
        // 8 layers × 4 all-reduces of [1024 tokens, 1024] bf16, the embedding's one, and the
        // cross entropy's three of 1024 f32, over 4 ranks.
        let bus = hw.intra_node_bus_bytes_per_s;
        let activation = 1024.0 * 1024.0 * 2.0;
        let expected = 33.0 * all_reduce_s(&hw, activation, 4, bus)
            + 3.0 * all_reduce_s(&hw, 1024.0 * 4.0, 4, bus);
        assert!((mb.tp_comm_s - expected).abs() < 1e-12, "{mb:?}");
    }
}
