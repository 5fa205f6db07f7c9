//! Device memory of one rank, term by term as the GPU engine allocates it (`gpu/mod.rs`,
//! `gpu/arena.rs`, `gpu/linalg.rs`):
//!
//! * model state: the engine's bf16 mixed precision holds a 2-byte working copy, fp32 gradients
//!   and K = 12 bytes of fp32 master weights and two AdamW moments per parameter, partitioned
//!   over the data-parallel ranks by the ZeRO stage ([`zero::per_rank`]; stage 3 partitions the
//!   working copy too and adds a buffer for two gathered layers);
//!   Under gradient checkpointing without ZeRO the working copy is per layer
//!   (`--weight-copy auto`, `crate::weight_copy`): everything outside the decoder layers plus
//!   one layer's room instead of every weight;
//! * activations: the arena's `resid[i]` (each layer's input), one set of saved per-layer
//!   buffers per layer (one shared set with checkpointing, which recomputes the MLP's
//!   `silu(gate) * up` instead of keeping it and holds `gate`/`up` for one MLP chunk of
//!   tokens, `crate::mlp_chunk`), the final norm's output, the backward's gradient scratch,
//!   one block backward's gradients sharing their bytes with the loss head's logits chunk
//!   (`[rows, V]` with rows from `--lce-chunk-tokens auto`), and the f32 row statistics; under
//!   pipeline parallelism the first rank keeps several micro-batches' saved buffers
//!   ([`Layout::in_flight_layer_sets`]);
//! * workspace: the cuBLASLt workspace (32 MiB), the attention workspace (the flash kernels'
//!   `delta` rows and, at head_dim 64, the one-pass backward's f32 `dq_accum`, which the H200
//!   engine holds unless `--deterministic`; or the GEMM path's scores), the RMSNorm backward's
//!   partials, the embedding backward's sort buffers, and one NCCL communicator per parallel
//!   group of several ranks.

use serde::Serialize;

use super::hardware::Hardware;
use super::layout::{Layout, ShardStage};
use super::shard::{RankParams, RankWidths, StagePosition};
use crate::lce_chunk::LceChunk;
use crate::mlp_chunk::mlp_chunk_rows;
use crate::offload_checkpoints::DEVICE_RING_SLOTS;
use crate::trainer::zero::{self, StateBytes};

/// The GPU engine's bytes per parameter in bf16/fp16 mixed precision: the 16-bit working copy
/// (2), fp32 gradients (4), fp32 master weights and AdamW's two fp32 moments (K = 12); what
/// `GpuBackend::state_layout` reports (`GpuMemory`: master 4Ψ, working copy 2Ψ, gradients 4Ψ,
/// moments 8Ψ).
pub const GPU_MIXED_PRECISION_ADAMW: StateBytes = StateBytes {
    weights: 2,
    grads: 4,
    optimizer: 12,
};

/// Bytes of one activation element (bf16).
pub const ACTIVATION_ELEM_BYTES: f64 = 2.0;

/// The engine's cuBLASLt workspace (`tilearn_ops::cuda::GEMM_WORKSPACE_BYTES`).
pub const GEMM_WORKSPACE_BYTES: f64 = (32u64 << 20) as f64;

/// The GEMM attention path's workspace budget (`gpu/linalg.rs`).
const ATTENTION_WORKSPACE_BUDGET: f64 = (2u64 << 30) as f64;

/// Rows of dweight partials the RMSNorm backward keeps at most (`kMaxChunks`, `norm.cu`).
const NORM_SCRATCH_MAX_ROWS: usize = 512;

/// Sort buffers of the embedding backward per token: keys, sorted keys, positions, sorted
/// positions (u32 each) and CUB's temporary storage (about 8 bytes per item; estimated).
const EMBEDDING_SORT_BYTES_PER_TOKEN: f64 = 24.0;

/// Bytes one rank holds, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct MemoryBreakdown {
    pub weights: f64,
    pub grads: f64,
    pub optimizer: f64,
    pub activations: f64,
    pub workspace: f64,
}

impl MemoryBreakdown {
    pub fn total(&self) -> f64 {
        self.weights + self.grads + self.optimizer + self.activations + self.workspace
    }
}

/// Model-state bytes (weights, gradients, optimizer) of `psi` parameters over `dp` ranks.
/// Stages 0–2 are the engine's formulas ([`zero::per_rank`]); stage 3 divides all three.
pub fn model_state(bytes: StateBytes, psi: u64, dp: usize, stage: ShardStage) -> [f64; 3] {
    match stage.engine_stage() {
        Some(engine) => {
            let s = zero::per_rank(bytes, psi, dp as u64, engine);
            [s.weights, s.grads, s.optimizer]
        }
        None => {
            let shard = psi as f64 / dp.max(1) as f64;
            [
                bytes.weights as f64 * shard,
                bytes.grads as f64 * shard,
                bytes.optimizer as f64 * shard,
            ]
        }
    }
}

/// Activation-arena sizes for micro-batches of `tokens` rows, per the engine's carving.
#[derive(Clone, Copy, Debug)]
pub struct ArenaTerms {
    /// One layer's saved buffers (xn1, q, k, v, att, h, xn2, the MLP's gate and up, the
    /// activation unless recomputed, and the f32 rstd1, lse, rstd2). Under checkpointing the
    /// shared set keeps neither the activation nor gate and up (one MLP chunk's are in the
    /// scratch, [`crate::mlp_chunk`]).
    pub layer_set: f64,
    /// One `resid[i]` slab, `[N, C]`.
    pub resid: f64,
    /// The gradient scratch that lives through the backward (dres, dxn, dtmp).
    pub grad_scratch: f64,
    /// One MLP chunk's buffers in the scratch: dgate, dup, dact, and under checkpointing gate
    /// and up.
    pub mlp_chunk: f64,
    /// The attention backward's gradients in the scratch: dq, dk, dv, datt.
    pub attention_grads: f64,
    /// `final_xn`, the f32 final rstd and row losses, and the u32 ids and i32 targets.
    pub per_call: f64,
    /// Checkpoint offload's spare attention output and f32 log-sum-exp (the second slot of
    /// its two-slot ring; the first is the layer set's).
    pub attention_spare: f64,
    /// The loss head's logits chunk: `[rows, V]` (vocabulary-parallel: V/TP columns), rows
    /// as the engine's default `--lce-chunk-tokens auto` gives them (at most 128 MiB).
    pub logits: f64,
}

impl ArenaTerms {
    pub fn new(w: RankWidths, tokens: usize, checkpointing: bool) -> ArenaTerms {
        let n = tokens as f64;
        let e = ACTIVATION_ELEM_BYTES;
        let (c, q, kv, i) = (w.hidden as f64, w.q as f64, w.kv as f64, w.inter as f64);
        let elem = ACTIVATION_ELEM_BYTES as usize;
        let m = mlp_chunk_rows(tokens, w.inter, elem, checkpointing) as f64;
        // Without checkpointing each layer keeps gate, up and the activation; with it the
        // chunk's gate and up join its gradients in the scratch.
        let (own_mlp, chunk_mlp) = if checkpointing {
            (0.0, 5.0 * m * i)
        } else {
            (3.0 * n * i, 3.0 * m * i)
        };
        ArenaTerms {
            layer_set: e * (n * (3.0 * c + 2.0 * q + 2.0 * kv) + own_mlp)
                + 4.0 * n * (2.0 + w.q_heads as f64),
            resid: e * n * c,
            grad_scratch: e * 3.0 * n * c,
            mlp_chunk: e * chunk_mlp,
            attention_grads: e * n * (2.0 * q + 2.0 * kv),
            attention_spare: e * n * q + 4.0 * n * w.q_heads as f64,
            per_call: e * n * c + 4.0 * n * 2.0 + 8.0 * n,
            logits: e * LceChunk::Auto.rows(tokens, w.vocab, elem) as f64 * w.vocab as f64,
        }
    }
}

/// Activation bytes of the rank at `position`.
pub fn activation_bytes(
    w: RankWidths,
    layout: &Layout,
    layers: usize,
    seq: usize,
    position: StagePosition,
) -> f64 {
    let a = ArenaTerms::new(w, layout.micro_batch * seq, layout.checkpointing);
    // Micro-batches in flight on this rank: the first holds the most, the last one.
    let in_flight = if position.first {
        layout.in_flight_layer_sets()
    } else {
        1.0
    };
    let layers = layers as f64;
    let saved = if layout.offload_checkpoints {
        // A ring of layer inputs (`resid[L]` among them) and a spare attention output; the
        // rest is in host memory.
        let slabs = (layers + 1.0).min(DEVICE_RING_SLOTS as f64);
        slabs * a.resid + a.attention_spare + a.layer_set
    } else if layout.checkpointing {
        in_flight * layers * a.resid + a.layer_set
    } else {
        in_flight * layers * (a.resid + a.layer_set)
    };
    // `resid[L]`, the final norm's input, and the logits live on the last stage.
    let final_input = if position.last && !layout.offload_checkpoints {
        a.resid
    } else {
        0.0
    };
    let logits = if position.last { a.logits } else { 0.0 };
    let scratch = a.mlp_chunk.max(a.attention_grads).max(logits);
    saved + final_input + a.grad_scratch + scratch + a.per_call
}

/// Workspace bytes of one rank (see the module docs).
pub fn workspace_bytes(
    hw: &Hardware,
    w: RankWidths,
    layout: &Layout,
    seq: usize,
    position: StagePosition,
) -> f64 {
    let b = layout.micro_batch as f64;
    let t = seq as f64;
    let heads = w.q_heads as f64;
    let attention = if matches!(w.head_dim, 64 | 128) {
        // The delta rows; at head_dim 64 (the Hopper kernels') also the one-pass backward's
        // dq_accum, `B·Hq·D·round_up(T, 64)` f32 (`tilearn_flash_attention_dq_accum_len`): the
        // engine's default on an H200 (`--deterministic` drops it), unless each layer's
        // post-attention buffers (`h` and `xn2`, `2·N·C` 16-bit elements, dead during the
        // attention backward) hold it and are lent instead (`gpu::arena::PostAttention`).
        let dq_accum_bytes = b * heads * 64.0 * seq.next_multiple_of(64) as f64 * 4.0;
        let lendable = 2.0 * b * t * w.hidden as f64 * ACTIVATION_ELEM_BYTES;
        let dq_accum = if w.head_dim == 64 && dq_accum_bytes > lendable {
            dq_accum_bytes
        } else {
            0.0
        };
        b * heads * t * 4.0 + dq_accum
    } else {
        // f32 scores and 16-bit probabilities of whole sequences, at least one per pass.
        let per_seq = heads * t * t * (4.0 + ACTIVATION_ELEM_BYTES);
        (ATTENTION_WORKSPACE_BUDGET.max(per_seq)).min(per_seq * b)
    };
    let tokens = layout.micro_batch * seq;
    let norm = (tokens.min(NORM_SCRATCH_MAX_ROWS) * w.hidden) as f64 * 4.0;
    let embedding = if position.first {
        EMBEDDING_SORT_BYTES_PER_TOKEN * tokens as f64
    } else {
        0.0
    };
    let groups = [layout.tp, layout.dp, layout.pp]
        .iter()
        .filter(|&&size| size > 1)
        .count() as f64;
    GEMM_WORKSPACE_BYTES + attention + norm + embedding + groups * hw.nccl_communicator_bytes
}

/// Memory of the rank at `position` of `layout`, holding `params`.
pub fn rank_memory(
    hw: &Hardware,
    w: RankWidths,
    layout: &Layout,
    params: &RankParams,
    layers: usize,
    seq: usize,
    position: StagePosition,
) -> MemoryBreakdown {
    let [mut weights, grads, optimizer] = model_state(
        GPU_MIXED_PRECISION_ADAMW,
        params.total,
        layout.dp,
        layout.zero,
    );
    if layout.checkpointing && layout.zero == ShardStage::Zero0 {
        // The per-layer working copy: all but one decoder layer's 16-bit weights are cast
        // just before use instead of kept, and so is an embedding table only the lookup
        // reads (into the same window, which grows to the table when the table is larger).
        let table = params.lookup_only_table;
        let streamed = layers.saturating_sub(1) as f64 * params.per_layer as f64
            + table.min(params.per_layer) as f64;
        weights -= streamed * GPU_MIXED_PRECISION_ADAMW.weights as f64;
    }
    if layout.zero == ShardStage::Zero3 && layout.dp > 1 {
        // The layer being computed and the one prefetched, gathered whole (this rank's TP
        // slice) in the working precision.
        weights += 2.0 * params.per_layer as f64 * GPU_MIXED_PRECISION_ADAMW.weights as f64;
    }
    MemoryBreakdown {
        weights,
        grads,
        optimizer,
        activations: activation_bytes(w, layout, layers, seq, position),
        workspace: workspace_bytes(hw, w, layout, seq, position),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LlamaConfig;
    use crate::plan::layout::split_heads;

    fn config() -> LlamaConfig {
        // 2 layers, hidden 64, 4 query heads and 2 kv heads of 16, inter 128, vocab 100.
        let json = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}"#;
        LlamaConfig::from_json_str(json, "test.json").unwrap()
    }

    fn layout(checkpointing: bool) -> Layout {
        Layout {
            tp: 1,
            pp: 1,
            virtual_stages: 1,
            dp: 1,
            zero: ShardStage::Zero0,
            micro_batch: 2,
            micro_batches: 1,
            checkpointing,
            offload_checkpoints: false,
        }
    }

    #[test]
    fn arena_terms_by_hand() {
        let c = config();
        let w = RankWidths::new(&c, split_heads(&c, 1).unwrap(), 1);
        // n = 2 × 8 = 16 rows. Per row, bf16: xn1 64, q 64, k 32, v 32, att 64, h 64, xn2 64,
        // gate/up/act 3 × 128 = 768 elements; f32: rstd1, rstd2 and 4 lse = 6 floats.
        let a = ArenaTerms::new(w, 16, false);
        assert_eq!(a.layer_set, 16.0 * (768.0 * 2.0 + 6.0 * 4.0));
        assert_eq!(a.resid, 16.0 * 64.0 * 2.0);
        assert_eq!(a.grad_scratch, 16.0 * 3.0 * 64.0 * 2.0);
        // dgate/dup/dact 3 × 128; dq 64, dk 32, dv 32, datt 64.
        assert_eq!(a.mlp_chunk, 16.0 * 384.0 * 2.0);
        assert_eq!(a.attention_grads, 16.0 * 192.0 * 2.0);
        assert_eq!(a.logits, 16.0 * 100.0 * 2.0);
        assert_eq!(a.per_call, 16.0 * (64.0 * 2.0 + 8.0 + 8.0));
        // Without checkpointing: 2 layers of (resid + set), resid[L], the gradient scratch, the
        // shared scratch (the MLP gradients, larger than the logits and the attention
        // gradients), call.
        let plain = activation_bytes(w, &layout(false), 2, 8, StagePosition::ONLY);
        let expected =
            2.0 * (a.resid + a.layer_set) + a.resid + a.grad_scratch + a.mlp_chunk + a.per_call;
        assert_eq!(plain, expected);
        // With checkpointing: every layer's input, but one shared set without its MLP (16 rows
        // × 3 × 128 bf16), whose gate and up (16 rows are one chunk) join the scratch.
        let ckpt = activation_bytes(w, &layout(true), 2, 8, StagePosition::ONLY);
        let mlp = 16.0 * 128.0 * 2.0;
        assert_eq!(ckpt, expected - a.layer_set - 3.0 * mlp + 2.0 * mlp);
    }

    #[test]
    fn checkpointing_counts_one_mlp_chunk() {
        // TinyLlama at 1 × 64 K: gate, up, dgate, dup and dact hold 2 048 tokens, not 65 536,
        // in the scratch.
        let json = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
            "hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
            "num_key_value_heads": 4, "intermediate_size": 5632}"#;
        let c = LlamaConfig::from_json_str(json, "<test>").unwrap();
        let w = RankWidths::new(&c, split_heads(&c, 1).unwrap(), 1);
        let (n, m, i) = (65_536.0, 2048.0, 5632.0);
        let plain = ArenaTerms::new(w, 65_536, false);
        let ckpt = ArenaTerms::new(w, 65_536, true);
        assert_eq!(plain.layer_set - ckpt.layer_set, 2.0 * 3.0 * n * i);
        assert_eq!(plain.mlp_chunk, 2.0 * 3.0 * n * i);
        assert_eq!(ckpt.mlp_chunk, 2.0 * 5.0 * m * i);
        assert_eq!(ckpt.attention_grads, plain.attention_grads);
    }

    #[test]
    fn offload_keeps_a_ring_of_three_inputs_and_a_spare_attention_output() {
        let c = config();
        let w = RankWidths::new(&c, split_heads(&c, 1).unwrap(), 1);
        let ckpt = layout(true);
        let offloaded = Layout {
            offload_checkpoints: true,
            ..ckpt
        };
        let on_device = activation_bytes(w, &ckpt, 4, 8, StagePosition::ONLY);
        let host = activation_bytes(w, &offloaded, 4, 8, StagePosition::ONLY);
        let a = ArenaTerms::new(w, 16, true);
        // Four layers' inputs and resid[4] on the device against the ring's three, plus the
        // spare attention output (16 rows × 64 bf16) and log-sum-exp (16 × 4 f32).
        assert_eq!(a.attention_spare, 16.0 * (64.0 * 2.0 + 4.0 * 4.0));
        assert_eq!(on_device - host, 2.0 * a.resid - a.attention_spare);
        // The engine's `auto`: from 16 K tokens, under checkpointing, without a pipeline.
        assert!(ckpt.auto_offload(16 * 1024) && !ckpt.auto_offload(8 * 1024));
        assert!(!layout(false).auto_offload(1 << 20));
        assert!(!Layout { pp: 2, ..ckpt }.auto_offload(1 << 20));
    }

    #[test]
    fn model_state_by_hand_and_stage_three() {
        let psi = 1_000_000u64;
        let b = GPU_MIXED_PRECISION_ADAMW;
        assert_eq!(model_state(b, psi, 4, ShardStage::Zero0), [2e6, 4e6, 12e6]);
        assert_eq!(model_state(b, psi, 4, ShardStage::Zero1), [2e6, 4e6, 3e6]);
        assert_eq!(model_state(b, psi, 4, ShardStage::Zero2), [2e6, 1e6, 3e6]);
        assert_eq!(model_state(b, psi, 4, ShardStage::Zero3), [0.5e6, 1e6, 3e6]);
    }

    #[test]
    fn zero_terms_are_the_engine_formulas_and_shrink_with_the_stage() {
        use crate::trainer::zero::{CPU_FP32_ADAMW, MIXED_PRECISION_ADAM, ZeroStage, per_rank};
        let psi = 123_456_789u64;
        for bytes in [
            GPU_MIXED_PRECISION_ADAMW,
            CPU_FP32_ADAMW,
            MIXED_PRECISION_ADAM,
        ] {
            for n in [1usize, 2, 3, 8] {
                let total = |stage| model_state(bytes, psi, n, stage).iter().sum::<f64>();
                for (plan, engine) in [
                    (ShardStage::Zero0, ZeroStage::Off),
                    (ShardStage::Zero1, ZeroStage::One),
                    (ShardStage::Zero2, ZeroStage::Two),
                ] {
                    assert_eq!(total(plan), per_rank(bytes, psi, n as u64, engine).total());
                }
                let stages = ShardStage::ALL.map(total);
                assert!(stages.windows(2).all(|w| w[1] <= w[0]), "{stages:?}");
                let everything = (bytes.weights + bytes.grads + bytes.optimizer) as f64;
                assert_eq!(stages[3], everything * psi as f64 / n as f64);
                if n == 1 {
                    assert_eq!(stages[3], stages[0]);
                }
            }
        }
    }

    #[test]
    fn workspace_by_hand() {
        let c = config();
        let w = RankWidths::new(&c, split_heads(&c, 1).unwrap(), 1);
        let hw = Hardware::h200(1, 1, 141.0 * (1u64 << 30) as f64);
        // head_dim 16 is not a flash size: the GEMM path's scores, f32 + bf16, 4 heads × 8²
        // per sequence, both sequences in one pass (far under the 2 GiB budget); the RMSNorm
        // partials of 16 rows × 64; the embedding sort of 16 tokens.
        let expected = GEMM_WORKSPACE_BYTES
            + 2.0 * 4.0 * 64.0 * 6.0
            + 16.0 * 64.0 * 4.0
            + 16.0 * EMBEDDING_SORT_BYTES_PER_TOKEN;
        let got = workspace_bytes(&hw, w, &layout(false), 8, StagePosition::ONLY);
        assert_eq!(got, expected);
        // Two parallel groups of several ranks add two NCCL communicators; a pipeline rank
        // that is not the first sorts no embedding ids.
        let mut l = layout(false);
        (l.dp, l.pp) = (2, 2);
        let middle = StagePosition {
            first: false,
            last: true,
        };
        let got = workspace_bytes(&hw, w, &l, 8, middle);
        let nccl = 2.0 * hw.nccl_communicator_bytes;
        assert_eq!(got, expected - 16.0 * EMBEDDING_SORT_BYTES_PER_TOKEN + nccl);
    }

    #[test]
    fn flash_workspace_holds_delta_and_the_one_pass_dq_accum_at_head_dim_64() {
        let hw = Hardware::h200(1, 1, 141.0 * (1u64 << 30) as f64);
        let attention = |hidden: usize, seq: usize| {
            let json = format!(
                r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": {hidden}, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 100}}"#
            );
            let c = LlamaConfig::from_json_str(&json, "test.json").unwrap();
            let w = RankWidths::new(&c, split_heads(&c, 1).unwrap(), 1);
            let tokens = 2 * seq;
            let rest = GEMM_WORKSPACE_BYTES
                + (tokens * hidden) as f64 * 4.0
                + tokens as f64 * EMBEDDING_SORT_BYTES_PER_TOKEN;
            workspace_bytes(&hw, w, &layout(false), seq, StagePosition::ONLY) - rest
        };
        // head_dim 64, T = 100: delta 2·4·100 f32, dq_accum 2·4·64·128 f32 (T rounded to 64).
        assert_eq!(
            attention(256, 100),
            2.0 * 4.0 * 100.0 * 4.0 + 2.0 * 4.0 * 64.0 * 128.0 * 4.0
        );
        // head_dim 128 stays on the deterministic kernels: delta only.
        assert_eq!(attention(512, 100), 2.0 * 4.0 * 100.0 * 4.0);
    }
}
