//! How many tokens' logits the GPU engine's fused linear + cross entropy holds at once: the
//! setting (`--lce-chunk-tokens`) and the rule that turns it into the rows of the one logits
//! buffer the activation arena keeps.
//!
//! The loss head computes `logits = norm_out · lm_headᵀ`, the fused cross entropy (which
//! overwrites the logits with their gradient) and the two products of the head's backward
//! chunk by chunk of tokens, so the `[tokens × vocab]` logits never exist in full: at 16 × 1024
//! tokens and a 32 000-word vocabulary they are 1 GiB in bf16, 2 GiB when the arena is sized for
//! f32. This module has no device code, so the setting parses and its rule is tested on any
//! machine.

use std::fmt;
use std::num::NonZeroUsize;

use serde::{Deserialize, Serialize};

/// Budget of the logits chunk under [`LceChunk::Auto`]: 128 MiB, an eighth of the full
/// logits at the bench presets, and large enough that each chunk's products stay efficient
/// GEMMs (at vocab 32 000 in bf16 a chunk is 2 048 tokens: M = 2 048, N = 32 000). The chunk
/// shares the arena's scratch with an MLP chunk and the attention gradients (`gpu::arena`),
/// so a budget above theirs would set the scratch's size alone: at TinyLlama and 16 K tokens
/// those are 110 and 144 MiB.
pub const LCE_CHUNK_BUDGET_BYTES: usize = 128 << 20;

/// How many tokens the loss head processes per chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum LceChunk {
    /// Every token of a call at once: the arena holds the whole `[tokens × vocab]` logits.
    Unchunked,
    /// The largest power of two of tokens whose logits fit in [`LCE_CHUNK_BUDGET_BYTES`] (at
    /// least 1), capped at the tokens of a call.
    #[default]
    Auto,
    /// At most this many tokens per chunk (capped at the tokens of a call).
    Tokens(NonZeroUsize),
}

impl LceChunk {
    /// The `--lce-chunk-tokens` value: `0` is [`LceChunk::Unchunked`], `N` is
    /// [`LceChunk::Tokens`]`(N)`.
    pub fn from_tokens(tokens: usize) -> LceChunk {
        match NonZeroUsize::new(tokens) {
            Some(n) => LceChunk::Tokens(n),
            None => LceChunk::Unchunked,
        }
    }

    /// Parses the flag's text: `auto`, `0` (unchunked) or a token count. The error says what
    /// the flag accepts.
    pub fn parse(text: &str) -> Result<LceChunk, String> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("auto") {
            return Ok(LceChunk::Auto);
        }
        t.parse::<usize>().map(LceChunk::from_tokens).map_err(|_| {
            format!(
                "`{text}` is not a token count; use `auto` (chunks of at most {} MiB of \
                 logits), 0 (no chunking) or a number of tokens per chunk",
                LCE_CHUNK_BUDGET_BYTES >> 20
            )
        })
    }

    /// Rows (tokens) of the logits buffer for calls of up to `tokens` tokens over a
    /// vocabulary of `vocab` words stored in `elem_bytes`-byte elements; always in
    /// `1..=tokens` (0 only when `tokens` is 0).
    pub fn rows(self, tokens: usize, vocab: usize, elem_bytes: usize) -> usize {
        let rows = match self {
            LceChunk::Unchunked => tokens,
            LceChunk::Tokens(n) => n.get(),
            LceChunk::Auto => {
                let row_bytes = vocab.saturating_mul(elem_bytes).max(1);
                let fit = (LCE_CHUNK_BUDGET_BYTES / row_bytes).max(1);
                // The largest power of two ≤ fit: chunks then divide the usual power-of-two
                // token counts evenly, and the GEMMs see tile-friendly row counts.
                1usize << fit.ilog2()
            }
        };
        rows.min(tokens)
    }

    /// The setting every rank of a vocabulary-parallel group builds with (tensor parallelism
    /// on the GPU engine): the rows this setting gives the widest of `parts` slices of a
    /// `vocab`-word vocabulary (the engines' `chunk_range` gives the first `vocab mod parts`
    /// slices one word more), fixed as a token count. Every rank then cuts a call into the
    /// same chunks, as it must: each chunk's cross entropy all-reduces over the group, and
    /// under `auto` two slices one word apart can straddle a power of two.
    pub fn for_vocab_slices(
        self,
        tokens: usize,
        vocab: usize,
        parts: usize,
        elem_bytes: usize,
    ) -> LceChunk {
        let widest = vocab.div_ceil(parts.max(1));
        LceChunk::from_tokens(self.rows(tokens, widest, elem_bytes))
    }
}

impl fmt::Display for LceChunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LceChunk::Unchunked => f.write_str("0"),
            LceChunk::Auto => f.write_str("auto"),
            LceChunk::Tokens(n) => write!(f, "{n}"),
        }
    }
}

/// The token ranges of a call of `tokens` tokens in chunks of `rows` (the last one shorter when
/// `rows` does not divide `tokens`). `rows` of 0 is taken as 1, so the ranges always cover
/// `0..tokens` and every range is non-empty.
pub fn chunk_ranges(tokens: usize, rows: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let rows = rows.max(1);
    (0..tokens)
        .step_by(rows)
        .map(move |start| start..(start + rows).min(tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_largest_power_of_two_within_the_budget() {
        // 32 000 × 2 bytes = 64 000 bytes a token: 2 097 fit, 2 048 taken (125 MiB).
        assert_eq!(LceChunk::Auto.rows(16 * 1024, 32_000, 2), 2048);
        // The arena sized for f32: half as many.
        assert_eq!(LceChunk::Auto.rows(16 * 1024, 32_000, 4), 1024);
        // Llama 3's vocabulary: 523 fit, 512 taken.
        assert_eq!(LceChunk::Auto.rows(8 * 2048, 128_256, 2), 512);
        for (vocab, bytes) in [(32_000, 2), (32_000, 4), (128_256, 2), (151_936, 4), (7, 2)] {
            let rows = LceChunk::Auto.rows(usize::MAX, vocab, bytes);
            assert!(rows.is_power_of_two(), "{vocab} x {bytes}: {rows}");
            assert!(
                rows * vocab * bytes <= LCE_CHUNK_BUDGET_BYTES,
                "{vocab} x {bytes}"
            );
            assert!(
                2 * rows * vocab * bytes > LCE_CHUNK_BUDGET_BYTES,
                "{vocab} x {bytes}"
            );
        }
    }

    /// 65 537 words over two ranks: slices of 32 769 and 32 768 words, whose own `auto` rows
    /// differ (1 024 against 2 048 tokens in bf16); the group's setting gives both 1 024.
    #[test]
    fn vocabulary_slices_share_one_chunk_size() {
        let (tokens, vocab, elem) = (8192, 65_537, 2);
        let own: Vec<usize> = [32_769, 32_768]
            .iter()
            .map(|&v| LceChunk::Auto.rows(tokens, v, elem))
            .collect();
        assert_eq!(own, vec![1024, 2048]);
        let group = LceChunk::Auto.for_vocab_slices(tokens, vocab, 2, elem);
        assert_eq!(group, LceChunk::from_tokens(1024));
        for v in [32_769, 32_768] {
            assert_eq!(group.rows(tokens, v, elem), 1024);
        }
        // Unchunked and explicit settings keep their meaning.
        assert_eq!(
            LceChunk::Unchunked
                .for_vocab_slices(100, 257, 2, 4)
                .rows(100, 128, 4),
            100
        );
        assert_eq!(
            LceChunk::from_tokens(33)
                .for_vocab_slices(100, 257, 2, 4)
                .rows(100, 129, 4),
            33
        );
    }

    #[test]
    fn auto_keeps_one_row_when_a_row_exceeds_the_budget() {
        let huge_vocab = LCE_CHUNK_BUDGET_BYTES; // one row of 2-byte elements is 256 MiB
        assert_eq!(LceChunk::Auto.rows(100, huge_vocab, 2), 1);
    }

    #[test]
    fn rows_never_exceed_the_tokens_of_a_call() {
        assert_eq!(LceChunk::Auto.rows(1000, 32_000, 2), 1000);
        assert_eq!(LceChunk::from_tokens(5000).rows(1000, 32_000, 2), 1000);
        assert_eq!(LceChunk::from_tokens(300).rows(1000, 32_000, 2), 300);
        assert_eq!(LceChunk::Unchunked.rows(1000, 32_000, 2), 1000);
        assert_eq!(LceChunk::Unchunked.rows(0, 32_000, 2), 0);
        assert_eq!(LceChunk::Auto.rows(0, 32_000, 2), 0);
    }

    #[test]
    fn the_flag_parses_auto_zero_and_counts() {
        assert_eq!(LceChunk::parse("auto"), Ok(LceChunk::Auto));
        assert_eq!(LceChunk::parse("AUTO"), Ok(LceChunk::Auto));
        assert_eq!(LceChunk::parse("0"), Ok(LceChunk::Unchunked));
        assert_eq!(
            LceChunk::parse("4096"),
            Ok(LceChunk::Tokens(NonZeroUsize::new(4096).unwrap()))
        );
        let err = LceChunk::parse("-3").unwrap_err();
        assert!(err.contains("`-3`") && err.contains("auto"), "{err}");
        for c in [
            LceChunk::Auto,
            LceChunk::Unchunked,
            LceChunk::from_tokens(77),
        ] {
            assert_eq!(LceChunk::parse(&c.to_string()), Ok(c));
        }
    }

    #[test]
    fn chunk_ranges_cover_the_tokens_in_order() {
        let r: Vec<_> = chunk_ranges(10, 4).collect();
        assert_eq!(r, vec![0..4, 4..8, 8..10]);
        assert_eq!(chunk_ranges(8, 4).collect::<Vec<_>>(), vec![0..4, 4..8]);
        assert_eq!(chunk_ranges(3, 100).collect::<Vec<_>>(), vec![0..3]);
        assert_eq!(
            chunk_ranges(3, 0).collect::<Vec<_>>(),
            vec![0..1, 1..2, 2..3]
        );
        assert_eq!(chunk_ranges(0, 4).count(), 0);
    }
}
