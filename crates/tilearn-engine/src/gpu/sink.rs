//! Handing parameter gradients on while the backward still runs: the hook data parallelism
//! uses to all-reduce the gradients of the last layers while the first ones are computed
//! (PyTorch DDP's bucketed overlap).
//!
//! The backward runs from the loss to the embedding, so the gradients become final from the
//! end of the flat buffer towards its start ([`ModelLayout::backward_handoffs`]). After the
//! final norm and after each layer, [`Handoff`] splits the finished part off the view it
//! still writes to and hands it to a [`GradientSink`]; at the end it hands over the rest
//! (the embedding and the first layer's front) and lets the sink order the compute stream
//! after what it launched.
//!
//! The gradient buffer is not tracked by cudarc's events ([`GpuLlama`](super::GpuLlama) makes
//! it so): one allocation has one pair of events, so a collective in flight on a finished part
//! would otherwise make every later kernel that writes *another* part wait for it. The order
//! is kept by hand instead: a sink's collectives wait for the compute stream as it stands
//! when the part is handed on, and [`GradientSink::finish`] makes the compute stream wait
//! for all of them before the optimizer reads the gradients.

use std::sync::Arc;

use cudarc::driver::CudaViewMut;
use tilearn_ops::cuda::CudaStream;

use super::views::split_owned;
use crate::error::{EngineError, Result};
use crate::model::ModelLayout;

/// Receives the finished parts of the gradient buffer during a backward.
pub trait GradientSink {
    /// `part` is elements `offset..offset + part.len()` of the flat gradient buffer; no kernel
    /// of this backward writes them any more. `stream` is the compute stream, whose enqueued
    /// work produced them. Launch without blocking; the part must not be touched after
    /// [`finish`](Self::finish) returns.
    fn ready(
        &mut self,
        offset: usize,
        part: CudaViewMut<'_, f32>,
        stream: &Arc<CudaStream>,
    ) -> Result<()>;

    /// After the whole buffer was handed on: order `stream` after everything launched.
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()>;
}

/// The gradient view a backward writes to, shrinking as parts are handed on.
pub(crate) struct Handoff<'g, 's> {
    rest: Option<CudaViewMut<'g, f32>>,
    sink: Option<&'s mut dyn GradientSink>,
    offsets: Vec<usize>,
    next: usize,
}

fn internal(what: &str) -> EngineError {
    EngineError::InvalidArgument {
        argument: "gradient hand-off".into(),
        message: format!("internal: {what}"),
    }
}

impl<'g, 's> Handoff<'g, 's> {
    /// Without a sink nothing is split and everything stays one view.
    pub(crate) fn new(
        grads: CudaViewMut<'g, f32>,
        sink: Option<&'s mut dyn GradientSink>,
        layout: &ModelLayout,
    ) -> Self {
        let offsets = match sink {
            Some(_) => layout.backward_handoffs().unwrap_or_default(),
            None => Vec::new(),
        };
        Handoff {
            rest: Some(grads),
            sink,
            offsets,
            next: 0,
        }
    }

    /// The part the backward still writes (elements `0..len` of the buffer: offsets into it
    /// are the layout's).
    pub(crate) fn grads(&mut self) -> Result<&mut CudaViewMut<'g, f32>> {
        self.rest
            .as_mut()
            .ok_or_else(|| internal("the gradient view was handed on twice"))
    }

    /// The next part of [`ModelLayout::backward_handoffs`] is final: hand it on.
    pub(crate) fn pass_on(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        let Some(sink) = self.sink.as_deref_mut() else {
            return Ok(());
        };
        let Some(&at) = self.offsets.get(self.next) else {
            return Ok(());
        };
        self.next += 1;
        let rest = self
            .rest
            .take()
            .ok_or_else(|| internal("the gradient view was handed on twice"))?;
        let (front, done) = split_owned(rest, at)?;
        self.rest = Some(front);
        sink.ready(at, done, stream)
    }

    /// The backward is over: hand on what is left and order `stream` after the sink's work.
    pub(crate) fn finish(mut self, stream: &Arc<CudaStream>) -> Result<()> {
        let Some(sink) = self.sink.as_deref_mut() else {
            return Ok(());
        };
        if let Some(rest) = self.rest.take()
            && !rest.is_empty()
        {
            sink.ready(0, rest, stream)?;
        }
        sink.finish(stream)
    }
}
