//! How many tokens the GPU engine's MLP processes at once under gradient checkpointing: the
//! rule that sizes the arena's `[rows × intermediate]` buffers (`gate`, `up`, and the
//! backward's `dgate`, `dup`, `dact`).
//!
//! The MLP is token-wise, so under checkpointing nothing forces its activations to exist for
//! the whole call: the forward runs `gate`/`up`/`down` chunk by chunk of tokens into the
//! block output, and the backward recomputes `gate` and `up` of one chunk at a time from the
//! kept `post_attention_layernorm` output, adding each chunk's weight gradients (`+=`) as the
//! products always do. At TinyLlama's widths and 64 K tokens the five `[N × I]` buffers are
//! 3.4 GiB in bf16; in chunks of 2 048 tokens they are 110 MiB. Without checkpointing each
//! layer keeps its own `gate`/`up` for the backward anyway, so the MLP runs whole. This module
//! has no device code, so the rule is tested on any machine.

/// Budget of one `[rows × intermediate]` buffer: 32 MiB. At TinyLlama's intermediate size
/// (5 632) in bf16 a chunk is 2 048 tokens, whose products (M = 2 048, N = 5 632, K = 2 048)
/// cuBLASLt still runs near its peak; the weight gradients then take eight `+=` products
/// instead of one at 16 K tokens, at the same FLOPs. The five buffers (110 MiB there) stay
/// below the attention gradients they share the scratch with (144 MiB at 16 K).
pub const MLP_CHUNK_BUDGET_BYTES: usize = 32 << 20;

/// Rows (tokens) per MLP chunk for calls of up to `tokens` tokens with `inter` intermediate
/// features in `elem_bytes`-byte elements: `tokens` (no chunking) without checkpointing, else
/// the largest power of two of rows whose buffer fits [`MLP_CHUNK_BUDGET_BYTES`] (at least 1),
/// capped at `tokens`. Always in `1..=tokens` (0 only when `tokens` is 0).
pub fn mlp_chunk_rows(
    tokens: usize,
    inter: usize,
    elem_bytes: usize,
    checkpointing: bool,
) -> usize {
    if !checkpointing {
        return tokens;
    }
    let row_bytes = inter.saturating_mul(elem_bytes).max(1);
    let fit = (MLP_CHUNK_BUDGET_BYTES / row_bytes).max(1);
    // A power of two: chunks then divide the usual power-of-two token counts evenly.
    (1usize << fit.ilog2()).min(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpointing_chunks_within_the_budget() {
        // TinyLlama: 5 632 × 2 bytes a token, 2 978 fit, 2 048 taken (22 MiB).
        assert_eq!(mlp_chunk_rows(16 * 1024, 5632, 2, true), 2048);
        // The arena sized for f32: half as many.
        assert_eq!(mlp_chunk_rows(16 * 1024, 5632, 4, true), 1024);
        // Llama-2-7B's 11 008: 1 524 fit, 1 024 taken.
        assert_eq!(mlp_chunk_rows(4096, 11_008, 2, true), 1024);
        for (inter, bytes) in [(5632, 2), (11_008, 4), (28_672, 2), (3, 2)] {
            let rows = mlp_chunk_rows(usize::MAX, inter, bytes, true);
            assert!(rows.is_power_of_two(), "{inter} x {bytes}: {rows}");
            assert!(rows * inter * bytes <= MLP_CHUNK_BUDGET_BYTES);
            assert!(2 * rows * inter * bytes > MLP_CHUNK_BUDGET_BYTES);
        }
    }

    #[test]
    fn short_calls_and_plain_runs_are_one_chunk() {
        // A call shorter than a chunk runs whole (llama-134m's 2 048 at 8 K tokens); at 16 K
        // it takes two.
        assert_eq!(mlp_chunk_rows(8 * 1024, 2048, 2, true), 8 * 1024);
        assert_eq!(mlp_chunk_rows(16 * 1024, 2048, 2, true), 8 * 1024);
        assert_eq!(mlp_chunk_rows(100, 5632, 2, true), 100);
        // Without checkpointing every layer keeps its activations: never chunked.
        assert_eq!(mlp_chunk_rows(1 << 20, 5632, 2, false), 1 << 20);
        // A width wider than the budget still gets one token a chunk.
        assert_eq!(mlp_chunk_rows(10, usize::MAX / 4, 4, true), 1);
        assert_eq!(mlp_chunk_rows(0, 5632, 2, true), 0);
    }
}
