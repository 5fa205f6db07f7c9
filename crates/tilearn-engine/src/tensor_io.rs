//! The two traits through which values stream between their home (host memory, or device
//! memory through a pinned staging buffer) and files: a leaf module, so the parameter store
//! (which fills a [`TensorDest`] at initialisation) and the checkpoint code (which reads a
//! [`TensorSource`] and fills a [`TensorDest`]) both depend on it rather than on each other.

use std::ops::Range;

use crate::error::Result;

/// Where saved values come from, addressed by flat f32 index ranges (a
/// [`ParamStore`](crate::params::ParamStore)'s layout, or an optimizer's buffers).
pub trait TensorSource {
    /// Calls `sink` with the values of `range`, in order, in one or more pieces.
    fn read(
        &mut self,
        range: Range<usize>,
        sink: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()>;
}

/// Where loaded values go, addressed by flat f32 index ranges.
pub trait TensorDest {
    /// Calls `fill(offset, buf)` with host buffers that together cover `range` in order
    /// (`offset` is the index of `buf[0]` relative to `range.start`); whatever `fill` writes
    /// lands in those elements. Every value of `buf` must be written.
    fn write(
        &mut self,
        range: Range<usize>,
        fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()>;
}

impl TensorSource for &[f32] {
    fn read(
        &mut self,
        range: Range<usize>,
        sink: &mut dyn FnMut(&[f32]) -> Result<()>,
    ) -> Result<()> {
        sink(&self[range])
    }
}

impl TensorDest for &mut [f32] {
    fn write(
        &mut self,
        range: Range<usize>,
        fill: &mut dyn FnMut(usize, &mut [f32]) -> Result<()>,
    ) -> Result<()> {
        fill(0, &mut self[range])
    }
}
