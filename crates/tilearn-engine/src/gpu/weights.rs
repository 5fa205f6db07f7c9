//! The weights one pass computes with: the fp32 master weights in an f32 period, the whole
//! 16-bit working copy, or the per-layer copy (`layer_copy.rs`), behind one lookup by the
//! global ranges of the model layout, so the forward and backward read them alike.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView};
use tilearn_ops::cuda::{CudaStream, DeviceFloat};

use super::layer_copy::PerLayerWeights;
use super::precision::WorkingCopy;
use super::views::arena_error;
use crate::error::Result;

pub(crate) enum Weights<'a, T> {
    /// Every weight in one flat view (the master weights, or the whole working copy).
    Whole(CudaView<'a, T>),
    /// Resident weights plus the decoder layer loaded last.
    PerLayer(PerLayerWeights<'a, T>),
}

impl<T: DeviceFloat> Weights<'_, T> {
    /// The weights `range` of the flat layout. Under the per-layer copy, a decoder layer's
    /// linear weights are readable only after [`Weights::load_layer`] of that layer.
    pub(crate) fn slice(&self, range: Range<usize>) -> Result<CudaView<'_, T>> {
        match self {
            Weights::Whole(w) => w.try_slice(range.clone()).ok_or_else(|| {
                arena_error(format!(
                    "weights {range:?} lie outside the {} of the model",
                    w.len()
                ))
            }),
            Weights::PerLayer(p) => p.slice(range),
        }
    }

    /// Makes the embedding table readable (queues its cast into the window when the
    /// per-layer copy does not keep it resident; free otherwise). Call it before each lookup.
    pub(crate) fn load_embedding(&mut self) -> Result<()> {
        match self {
            Weights::Whole(_) => Ok(()),
            Weights::PerLayer(p) => p.load_embedding(),
        }
    }

    /// Makes decoder layer `layer` readable (queues its cast under the per-layer copy; free
    /// otherwise). Call it before each block's forward and before its backward.
    pub(crate) fn load_layer(&mut self, layer: usize) -> Result<()> {
        match self {
            Weights::Whole(_) => Ok(()),
            Weights::PerLayer(p) => p.load_layer(layer),
        }
    }
}

/// The weights a `T` period computes with: the master weights themselves in f32, the working
/// copy otherwise (under the per-layer copy, this queues the resident casts).
pub(crate) fn weights<'a, T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    master: &'a CudaSlice<f32>,
    work: Option<&'a mut WorkingCopy>,
    numel: usize,
) -> Result<Weights<'a, T>> {
    if size_of::<T>() == size_of::<f32>() {
        // SAFETY: the only 4-byte DeviceFloat is f32 itself, so this is the identity view.
        return unsafe { master.transmute::<T>(numel) }
            .map(Weights::Whole)
            .ok_or_else(|| arena_error("cannot view the master weights".into()));
    }
    match work {
        Some(w) if w.is_per_layer() => {
            let copy = w
                .layer_copy_mut()
                .ok_or_else(|| arena_error("internal: per-layer copy without buffers".into()))?;
            Ok(Weights::PerLayer(PerLayerWeights::new(
                stream, master, copy,
            )?))
        }
        Some(w) => {
            let w: &'a WorkingCopy = w;
            Ok(Weights::Whole(w.view::<T>()?))
        }
        None => Err(arena_error(format!(
            "this model was built without a 16-bit working copy; it cannot run {}",
            T::NAME
        ))),
    }
}
