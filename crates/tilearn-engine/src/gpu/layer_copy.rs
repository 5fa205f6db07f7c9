//! The per-layer 16-bit working copy (`--weight-copy per-layer`, see `crate::weight_copy`):
//! where each weight of a pass is read from, and the casts that fill it.
//!
//! The flat parameter buffer is cut in two kinds of part. Each decoder layer's *span* (the
//! smallest range holding all of its tensors) is cast into one shared *window* just before
//! the layer runs; so is an untied embedding table, just before the lookup (nothing else
//! reads it: its gradient is added from the activations' gradient, and lm_head is another
//! tensor), which at TinyLlama's widths makes the window 43 MB larger and the resident part
//! 131 MB smaller. Everything else, and every layer's norms (block `i` computes layer
//! `i + 1`'s input norm in the forward, while the window holds layer `i`), is *resident*:
//! cast once at the start of each pass into a compact buffer of segments.
//!
//! A range is looked up in the window first (the layer being run), then in the resident
//! segments; a range found in neither is a bug in the caller and is reported, never read
//! from stale memory. Every cast is the kernel `WorkingCopy::refresh` uses, so the values
//! are the whole copy's bit for bit.

use std::ops::Range;
use std::sync::Arc;

use std::ffi::c_int;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use half::{bf16, f16};
use tilearn_ops::cuda::{CudaStream, DeviceFloat, cast_f32_to_bf16, cast_f32_to_f16, ffi};

use super::cuda_err;
use super::views::{arena_error, sub_mut};
use crate::error::Result;
use crate::model::{LayerLayout, ModelLayout};

/// A resident part: global elements `global` of the flat buffer at `at` in the compact one.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Segment {
    global: Range<usize>,
    at: usize,
}

/// Where each part of a model's weights lives under the per-layer copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LayerPlan {
    /// Decoder layer `i`'s span in the flat buffer.
    spans: Vec<Range<usize>>,
    /// The embedding table when it is cast into the window before the lookup (untied, and
    /// present: a later pipeline stage has none), else `None` (resident).
    embedding: Option<Range<usize>>,
    /// The resident segments, in increasing global order.
    segments: Vec<Segment>,
    resident_len: usize,
    window_len: usize,
}

/// Every range of layer `lay`'s tensors.
fn layer_ranges(lay: &LayerLayout) -> Vec<Range<usize>> {
    let linears = [&lay.q, &lay.k, &lay.v, &lay.o, &lay.up, &lay.down]
        .into_iter()
        .chain(lay.gate.as_ref());
    let mut out: Vec<Range<usize>> = linears
        .flat_map(|l| std::iter::once(l.weight.clone()).chain(l.bias.clone()))
        .collect();
    out.extend(layer_norm_ranges(lay));
    out
}

/// Layer `lay`'s norm weights and biases (resident: small, and read by the previous block).
fn layer_norm_ranges(lay: &LayerLayout) -> Vec<Range<usize>> {
    [
        Some(&lay.input_norm),
        Some(&lay.post_attention_norm),
        lay.input_norm_bias.as_ref(),
        lay.post_attention_norm_bias.as_ref(),
    ]
    .into_iter()
    .flatten()
    .filter(|r| !r.is_empty())
    .cloned()
    .collect()
}

impl LayerPlan {
    /// The plan for `layout`, or why the per-layer copy cannot serve it (layers whose spans
    /// interleave: the casts could not be one contiguous range a layer).
    pub(crate) fn new(layout: &ModelLayout) -> std::result::Result<LayerPlan, String> {
        let mut spans = Vec::with_capacity(layout.layers.len());
        for (i, lay) in layout.layers.iter().enumerate() {
            let ranges = layer_ranges(lay);
            let start = ranges.iter().map(|r| r.start).min().unwrap_or(0);
            let end = ranges.iter().map(|r| r.end).max().unwrap_or(0);
            if end > layout.numel {
                return Err(format!(
                    "layer {i} ends at element {end}, past the buffer's {}",
                    layout.numel
                ));
            }
            spans.push(start..end);
        }
        let embedding = (!layout.embed.is_empty() && layout.lm_head != layout.embed)
            .then(|| layout.embed.clone());
        let mut sorted: Vec<&Range<usize>> = spans.iter().chain(embedding.as_ref()).collect();
        sorted.sort_by_key(|r| r.start);
        if let Some(w) = sorted.windows(2).find(|w| w[0].end > w[1].start) {
            return Err(format!(
                "the tensors of two decoder layers (or a layer and the embedding) interleave \
                 ({:?} and {:?})",
                w[0], w[1]
            ));
        }
        // Resident: the gaps between the spans (and the window-cast embedding), then every
        // layer's norms.
        let mut resident: Vec<Range<usize>> = Vec::new();
        let mut at = 0;
        for span in &sorted {
            if span.start > at {
                resident.push(at..span.start);
            }
            at = at.max(span.end);
        }
        if layout.numel > at {
            resident.push(at..layout.numel);
        }
        for lay in &layout.layers {
            resident.extend(layer_norm_ranges(lay));
        }
        resident.sort_by_key(|r| r.start);
        let mut segments = Vec::with_capacity(resident.len());
        let mut len = 0;
        for global in resident {
            let n = global.len();
            segments.push(Segment { global, at: len });
            len += n;
        }
        let window_len = sorted.iter().map(|s| s.len()).max().unwrap_or(0);
        Ok(LayerPlan {
            spans,
            embedding,
            segments,
            resident_len: len,
            window_len,
        })
    }

    /// Where `range` lies in the window while it holds `span`, if it does.
    fn in_window(span: &Range<usize>, range: &Range<usize>) -> Option<Range<usize>> {
        (span.start <= range.start && range.end <= span.end)
            .then(|| range.start - span.start..range.end - span.start)
    }

    /// Where `range` lies in the compact resident buffer, if it does.
    fn in_resident(&self, range: &Range<usize>) -> Option<Range<usize>> {
        // The last segment starting at or before `range.start`.
        let i = self
            .segments
            .partition_point(|s| s.global.start <= range.start)
            .checked_sub(1)?;
        let s = &self.segments[i];
        (range.end <= s.global.end).then(|| {
            let off = s.at + range.start - s.global.start;
            off..off + range.len()
        })
    }
}

/// The device buffers of the per-layer copy (2-byte elements, bf16 or f16 bits).
#[derive(Debug)]
pub(crate) struct LayerCopy {
    plan: Arc<LayerPlan>,
    resident: CudaSlice<u16>,
    window: CudaSlice<u16>,
}

impl LayerCopy {
    pub(crate) fn new(stream: &Arc<CudaStream>, plan: LayerPlan) -> Result<LayerCopy> {
        let alloc = |len: usize, what: &str| {
            stream
                .alloc_zeros::<u16>(len.max(1))
                .map_err(|e| cuda_err(what, e))
        };
        Ok(LayerCopy {
            resident: alloc(plan.resident_len, "allocating the resident 16-bit weights")?,
            window: alloc(plan.window_len, "allocating the 16-bit layer window")?,
            plan: Arc::new(plan),
        })
    }

    pub(crate) fn bytes(&self) -> usize {
        self.resident.num_bytes() + self.window.num_bytes()
    }
}

/// Casts `src` into `dst` as `T` (round to nearest even; bf16 or f16).
pub(crate) fn cast_f32_into<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    src: &CudaView<'_, f32>,
    dst: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let len = dst.len();
    // SAFETY (both arms): `T` is the type its DTYPE names (same size, any bit pattern valid);
    // the view is borrowed mutably for the reinterpreted view's lifetime.
    match T::DTYPE {
        d if d == ffi::TILEARN_DTYPE_BF16 as c_int => {
            let mut d = unsafe { dst.transmute_mut::<bf16>(len) }
                .ok_or_else(|| arena_error("cannot view a weight buffer as bf16".into()))?;
            cast_f32_to_bf16(stream, src, &mut d)?;
        }
        d if d == ffi::TILEARN_DTYPE_F16 as c_int => {
            let mut d = unsafe { dst.transmute_mut::<f16>(len) }
                .ok_or_else(|| arena_error("cannot view a weight buffer as f16".into()))?;
            cast_f32_to_f16(stream, src, &mut d)?;
        }
        _ => {
            return Err(arena_error(
                "an f32 pass computes with the master weights, it casts nothing".into(),
            ));
        }
    }
    Ok(())
}

/// Casts `master[global]` into `buf[at..]` as `T` (bf16 or f16).
fn cast_part<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    master: &CudaSlice<f32>,
    global: Range<usize>,
    buf: &mut CudaSlice<u16>,
    at: usize,
) -> Result<()> {
    let len = buf.len();
    // SAFETY: `T` is a 2-byte float type (the per-layer copy exists for bf16/f16 only, checked
    // by `PerLayerWeights::new`) for which any bit pattern is valid; the buffer holds `len`
    // 2-byte elements and is borrowed mutably for the view's lifetime.
    let typed = unsafe { buf.transmute_mut::<T>(len) }
        .ok_or_else(|| arena_error("cannot view the per-layer weight buffer".into()))?;
    let src = master
        .try_slice(global.clone())
        .ok_or_else(|| arena_error(format!("master weights {global:?} out of range")))?;
    let mut dst = sub_mut(typed, at..at + global.len())?;
    cast_f32_into::<T>(stream, &src, &mut dst)
}

/// A view of `len` elements of `buf` as `T`, sub-range `range`.
fn typed_view<'b, T: DeviceFloat>(
    buf: &'b CudaSlice<u16>,
    range: Range<usize>,
) -> Result<CudaView<'b, T>> {
    // SAFETY: as in `cast_part`; shared borrow for the view's lifetime.
    let all = unsafe { buf.transmute::<T>(buf.len()) }
        .ok_or_else(|| arena_error("cannot view the per-layer weight buffer".into()))?;
    all.try_slice(range.clone())
        .ok_or_else(|| arena_error(format!("{range:?} lies outside a weight buffer")))
}

/// The weights of one pass under the per-layer copy: the fp32 master weights to cast from and
/// the copy's buffers, with the layer the window holds.
pub(crate) struct PerLayerWeights<'a, T> {
    stream: Arc<CudaStream>,
    master: &'a CudaSlice<f32>,
    copy: &'a mut LayerCopy,
    /// The span the window holds (a decoder layer's, or the embedding's).
    loaded: Option<Range<usize>>,
    _elem: std::marker::PhantomData<T>,
}

impl<'a, T: DeviceFloat> PerLayerWeights<'a, T> {
    /// Queues the resident casts (the master weights may have changed since the last pass).
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        master: &'a CudaSlice<f32>,
        copy: &'a mut LayerCopy,
    ) -> Result<Self> {
        if size_of::<T>() != 2 {
            return Err(arena_error(format!(
                "the per-layer weight copy holds 16-bit weights, not {}",
                T::NAME
            )));
        }
        let plan = copy.plan.clone();
        for s in &plan.segments {
            cast_part::<T>(stream, master, s.global.clone(), &mut copy.resident, s.at)?;
        }
        Ok(PerLayerWeights {
            stream: stream.clone(),
            master,
            copy,
            loaded: None,
            _elem: std::marker::PhantomData,
        })
    }

    /// Queues the cast of decoder layer `layer` into the window (after every kernel queued
    /// before it on the stream, so the previous layer's readers are done with it).
    pub(crate) fn load_layer(&mut self, layer: usize) -> Result<()> {
        let span = self.copy.plan.spans.get(layer).cloned().ok_or_else(|| {
            arena_error(format!("layer {layer} is not in the per-layer weight plan"))
        })?;
        self.load(span)
    }

    /// Queues the cast of the embedding table into the window when the plan casts it there
    /// (nothing to do when it is resident).
    pub(crate) fn load_embedding(&mut self) -> Result<()> {
        match self.copy.plan.embedding.clone() {
            Some(span) => self.load(span),
            None => Ok(()),
        }
    }

    fn load(&mut self, span: Range<usize>) -> Result<()> {
        if self.loaded.as_ref() == Some(&span) {
            return Ok(());
        }
        cast_part::<T>(
            &self.stream,
            self.master,
            span.clone(),
            &mut self.copy.window,
            0,
        )?;
        self.loaded = Some(span);
        Ok(())
    }

    /// The weights `range` (global elements): from the loaded layer, else resident.
    pub(crate) fn slice(&self, range: Range<usize>) -> Result<CudaView<'_, T>> {
        let plan = &self.copy.plan;
        if let Some(r) = self
            .loaded
            .as_ref()
            .and_then(|span| LayerPlan::in_window(span, &range))
        {
            return typed_view(&self.copy.window, r);
        }
        match plan.in_resident(&range) {
            Some(r) => typed_view(&self.copy.resident, r),
            None => Err(arena_error(format!(
                "weights {range:?} are neither resident nor in the loaded layer {:?}: a pass \
                 read a layer it did not load",
                self.loaded
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LlamaConfig;

    fn tiny(tied: bool) -> ModelLayout {
        let json = format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":16,
            "intermediate_size":24,"num_hidden_layers":3,"num_attention_heads":4,
            "num_key_value_heads":2,"vocab_size":64,"tie_word_embeddings":{tied},
            "attention_bias":true}}"#
        );
        ModelLayout::from_config(&LlamaConfig::from_json_str(&json, "config.json").unwrap())
    }

    #[test]
    fn every_tensor_is_found_in_its_layer_or_resident_and_the_copy_is_small() {
        let layout = tiny(false);
        let plan = LayerPlan::new(&layout).expect("llama layers are contiguous");
        for (i, lay) in layout.layers.iter().enumerate() {
            let span = &plan.spans[i];
            let next = &plan.spans[(i + 1) % layout.layers.len()];
            for r in layer_ranges(lay) {
                let w = LayerPlan::in_window(span, &r).expect("a layer's tensor is in its window");
                assert_eq!(w.len(), r.len());
                assert!(w.end <= plan.window_len);
                // Another layer's window never claims it.
                assert!(LayerPlan::in_window(next, &r).is_none());
            }
            for r in layer_norm_ranges(lay) {
                let at = plan.in_resident(&r).expect("norms are resident");
                assert_eq!(at.len(), r.len());
            }
        }
        for r in [layout.norm.clone(), layout.lm_head.clone()] {
            let at = plan.in_resident(&r).expect("final norm, lm_head resident");
            assert!(at.end <= plan.resident_len);
        }
        // The untied embedding is cast into the window before the lookup, not resident.
        assert_eq!(plan.embedding, Some(layout.embed.clone()));
        assert!(plan.in_resident(&layout.embed).is_none());
        assert!(layout.embed.len() <= plan.window_len);
        // A linear weight is not resident, and a range across two parts is refused.
        assert!(plan.in_resident(&layout.layers[1].q.weight).is_none());
        let across = layout.layers[2].down.weight.start..layout.norm.end;
        assert!(plan.in_resident(&across).is_none());
        let layers_total: usize = layout.layers.iter().map(|l| l.down.weight.len()).sum();
        assert!(plan.resident_len + plan.window_len < layout.numel - layers_total / 2);
    }

    #[test]
    fn a_tied_embedding_stays_resident_for_lm_head() {
        let layout = tiny(true);
        let plan = LayerPlan::new(&layout).unwrap();
        assert_eq!(plan.embedding, None);
        let at = plan
            .in_resident(&layout.embed)
            .expect("tied embedding resident");
        assert_eq!(at.len(), layout.embed.len());
        // Resident: everything outside the layers' spans, plus the layers' norms; untied, less
        // the table.
        let resident = |layout: &ModelLayout| {
            let spans: usize = layout
                .layers
                .iter()
                .map(|lay| {
                    let r = layer_ranges(lay);
                    r.iter().map(|r| r.end).max().unwrap()
                        - r.iter().map(|r| r.start).min().unwrap()
                })
                .sum();
            let norms: usize = layout
                .layers
                .iter()
                .flat_map(layer_norm_ranges)
                .map(|r| r.len())
                .sum();
            layout.numel - spans + norms
        };
        assert_eq!(plan.resident_len, resident(&layout));
        let untied = tiny(false);
        assert_eq!(
            LayerPlan::new(&untied).unwrap().resident_len,
            resident(&untied) - untied.embed.len()
        );
    }

    #[test]
    fn resident_segments_are_disjoint_compact_and_in_order() {
        let plan = LayerPlan::new(&tiny(false)).unwrap();
        let mut at = 0;
        for w in plan.segments.windows(2) {
            assert!(w[0].global.end <= w[1].global.start, "{w:?}");
        }
        for s in &plan.segments {
            assert_eq!(s.at, at);
            at += s.global.len();
        }
        assert_eq!(at, plan.resident_len);
    }
}
