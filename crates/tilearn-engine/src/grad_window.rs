//! ZeRO-2's gradient window: where a backward writes the gradients of the parts it is still
//! computing when the rank keeps only its owned shard of the gradients.
//!
//! The backward's kernels add (`+=`, cuBLASLt with beta = 1) every parameter's gradient at
//! its place in one buffer, and the gradients become final part by part
//! ([`ModelLayout::backward_handoffs`]: the final norm and an untied lm_head, then each layer
//! from the last, then the embedding). A [`WindowPlan`] gives every part a place in a window
//! much smaller than the model: a part is written there, handed to the reduction (each piece
//! to the rank that owns it), and its space is reused by a later part once that reduction is
//! done. A tied lm_head writes the embedding's gradient at the very start of the backward and
//! the embedding backward adds to it at the end, so that part has space of its own for the
//! whole backward (the *persistent* part). The others share a ring of
//! `largest part + largest layer`, so a part's reduction overlaps at least the next layer's
//! backward before its space is needed again.
//!
//! The plan is pure arithmetic (tested below, without a GPU); `gpu/sink.rs` runs it on the
//! device.

use std::ops::Range;

use crate::model::ModelLayout;

/// Where each part of a backward lives in the window, and when its space is reused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WindowPlan {
    /// The parts, in the order the backward finishes them (global ranges of the flat buffer;
    /// together they cover it exactly once).
    pub parts: Vec<Range<usize>>,
    /// Each part's first element in the window.
    pub at: Vec<usize>,
    /// For each part, the earlier parts whose space it takes: their reductions must be done
    /// (and their owned pieces kept) before the part is prepared.
    pub reuses: Vec<Vec<usize>>,
    /// The part live for the whole backward (a tied lm_head's embedding), if any; it is
    /// prepared before the loss head's backward.
    pub persistent: Option<usize>,
    /// Elements of the window.
    pub len: usize,
}

impl WindowPlan {
    /// The plan for `layout`, `None` when its backward cannot hand parts on (a parameter
    /// order other than Hugging Face's; then the whole buffer is kept).
    pub(crate) fn for_layout(layout: &ModelLayout) -> Option<WindowPlan> {
        let offsets = layout.backward_handoffs()?;
        let mut parts = Vec::with_capacity(offsets.len() + 1);
        let mut end = layout.numel;
        for &start in &offsets {
            parts.push(start..end);
            end = start;
        }
        if end > 0 {
            parts.push(0..end);
        }
        // A tied lm_head's gradient lands in the front part (the embedding) before any part
        // is finished.
        let head = &layout.lm_head;
        let persistent = parts
            .iter()
            .position(|p| p.start <= head.start && head.end <= p.end && !head.is_empty())
            .filter(|&i| i + 1 == parts.len() && i > 0);
        Some(Self::place(parts, persistent))
    }

    /// Places `parts` (backward order) with `persistent` at the window's start and the others
    /// in a ring after it.
    fn place(parts: Vec<Range<usize>>, persistent: Option<usize>) -> WindowPlan {
        let ring_parts = || {
            parts
                .iter()
                .enumerate()
                .filter(move |(i, _)| Some(*i) != persistent)
        };
        let largest = ring_parts().map(|(_, p)| p.len()).max().unwrap_or(0);
        // The layers: every part but the first (final norm, lm_head) and the last (embedding).
        let layer = ring_parts()
            .filter(|(i, _)| *i > 0 && *i + 1 < parts.len())
            .map(|(_, p)| p.len())
            .max()
            .unwrap_or(0);
        let base = persistent.map_or(0, |i| parts[i].len());
        let ring = largest + layer;
        let mut at = vec![0; parts.len()];
        let mut reuses = vec![Vec::new(); parts.len()];
        // (part, its space) not yet reused.
        let mut live: Vec<(usize, Range<usize>)> = Vec::new();
        let mut cursor = 0;
        for (i, part) in parts.iter().enumerate() {
            if Some(i) == persistent {
                continue;
            }
            if cursor + part.len() > ring {
                cursor = 0;
            }
            let space = base + cursor..base + cursor + part.len();
            let (taken, kept): (Vec<_>, Vec<_>) = live
                .into_iter()
                .partition(|(_, s)| s.start < space.end && space.start < s.end);
            live = kept;
            reuses[i] = taken.into_iter().map(|(j, _)| j).collect();
            at[i] = space.start;
            live.push((i, space));
            cursor += part.len();
        }
        WindowPlan {
            parts,
            at,
            reuses,
            persistent,
            len: (base + ring).max(1),
        }
    }

    /// Part `i`'s space in the window.
    pub(crate) fn space(&self, i: usize) -> Range<usize> {
        self.at[i]..self.at[i] + self.parts[i].len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LlamaConfig;

    fn layout(tied: bool, layers: usize) -> ModelLayout {
        let json = format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":8,"intermediate_size":16,
               "num_hidden_layers":{layers},"num_attention_heads":2,"num_key_value_heads":1,
               "vocab_size":101,"tie_word_embeddings":{tied},"attention_bias":true}}"#
        );
        ModelLayout::from_config(&LlamaConfig::from_json_str(&json, "config.json").unwrap())
    }

    /// Replays the plan: a part's space never overlaps a part still live (written or not yet
    /// reduced), the persistent one included, and every part is within the window.
    fn check(plan: &WindowPlan, numel: usize) {
        let covered: usize = plan.parts.iter().map(|p| p.len()).sum();
        assert_eq!(covered, numel);
        let mut live: Vec<usize> = plan.persistent.into_iter().collect();
        for i in 0..plan.parts.len() {
            if Some(i) == plan.persistent {
                continue;
            }
            live.retain(|j| !plan.reuses[i].contains(j));
            let space = plan.space(i);
            assert!(space.end <= plan.len, "{plan:?}");
            for &j in &live {
                let other = plan.space(j);
                assert!(
                    space.end <= other.start || other.end <= space.start,
                    "part {i} overlaps live part {j}: {plan:?}"
                );
            }
            for &j in &plan.reuses[i] {
                assert!(j < i, "part {i} waits for a later part {j}");
            }
            live.push(i);
        }
    }

    #[test]
    fn parts_never_overlap_a_live_part_and_the_window_is_smaller_than_the_model() {
        for tied in [false, true] {
            for layers in [1, 2, 3, 8] {
                let l = layout(tied, layers);
                let plan = WindowPlan::for_layout(&l).expect("Hugging Face order");
                check(&plan, l.numel);
                assert_eq!(plan.persistent.is_some(), tied, "{plan:?}");
                if layers >= 3 {
                    assert!(plan.len < l.numel, "{} vs {}", plan.len, l.numel);
                }
            }
        }
    }

    #[test]
    fn the_next_layer_fits_beside_the_part_before_it() {
        // Untied, 8 layers: the ring holds the largest part and one layer, so consecutive
        // layers never wait for each other's reduction.
        let plan = WindowPlan::for_layout(&layout(false, 8)).unwrap();
        for i in 2..plan.parts.len() - 1 {
            assert!(!plan.reuses[i].contains(&(i - 1)), "{plan:?}");
        }
    }

    #[test]
    fn a_tied_embedding_keeps_its_space_for_the_whole_backward() {
        let l = layout(true, 3);
        let plan = WindowPlan::for_layout(&l).unwrap();
        let p = plan.persistent.unwrap();
        assert_eq!(p, plan.parts.len() - 1);
        assert_eq!(plan.parts[p], 0..l.embed.end);
        assert_eq!(plan.at[p], 0);
        assert!(plan.reuses.iter().all(|r| !r.contains(&p)));
    }
}
