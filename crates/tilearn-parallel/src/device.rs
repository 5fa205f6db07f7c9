//! Device buffers (feature `cuda`): views of cudarc slices. A bucket of a flat gradient buffer is
//! `grads.slice_mut(range)`, so it is communicated without a copy. cudarc's event tracking orders
//! the communication stream after the kernels that wrote the view and before the ones that read
//! it next. The conversions into [`crate::Buffer`]/[`crate::BufferMut`] live in `buffer.rs`, so
//! this file depends on nothing else in the crate.

use std::sync::Arc;

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DeviceSlice as _};
use half::{bf16, f16};
use tilearn_ops::DType;

/// A read-only device view of one of the communicated dtypes.
#[derive(Debug)]
pub enum DeviceSlice<'a> {
    F32(CudaView<'a, f32>),
    BF16(CudaView<'a, bf16>),
    F16(CudaView<'a, f16>),
}

/// A mutable device view of one of the communicated dtypes.
#[derive(Debug)]
pub enum DeviceSliceMut<'a> {
    F32(CudaViewMut<'a, f32>),
    BF16(CudaViewMut<'a, bf16>),
    F16(CudaViewMut<'a, f16>),
}

impl DeviceSlice<'_> {
    /// A handle to the same elements (to use the view again afterwards).
    pub fn reborrow(&self) -> DeviceSlice<'_> {
        match self {
            DeviceSlice::F32(v) => DeviceSlice::F32(v.slice(..)),
            DeviceSlice::BF16(v) => DeviceSlice::BF16(v.slice(..)),
            DeviceSlice::F16(v) => DeviceSlice::F16(v.slice(..)),
        }
    }

    /// The stream the viewed allocation belongs to (where its writers run).
    pub fn stream(&self) -> &Arc<CudaStream> {
        match self {
            DeviceSlice::F32(v) => v.stream(),
            DeviceSlice::BF16(v) => v.stream(),
            DeviceSlice::F16(v) => v.stream(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            DeviceSlice::F32(_) => DType::F32,
            DeviceSlice::BF16(_) => DType::BF16,
            DeviceSlice::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            DeviceSlice::F32(v) => v.len(),
            DeviceSlice::BF16(v) => v.len(),
            DeviceSlice::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DeviceSliceMut<'_> {
    /// A shorter-lived handle to the same elements (to use the view again afterwards).
    pub fn reborrow(&mut self) -> DeviceSliceMut<'_> {
        match self {
            DeviceSliceMut::F32(v) => DeviceSliceMut::F32(v.slice_mut(..)),
            DeviceSliceMut::BF16(v) => DeviceSliceMut::BF16(v.slice_mut(..)),
            DeviceSliceMut::F16(v) => DeviceSliceMut::F16(v.slice_mut(..)),
        }
    }

    /// The stream the viewed allocation belongs to (where its writers run).
    pub fn stream(&self) -> &Arc<CudaStream> {
        match self {
            DeviceSliceMut::F32(v) => v.stream(),
            DeviceSliceMut::BF16(v) => v.stream(),
            DeviceSliceMut::F16(v) => v.stream(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            DeviceSliceMut::F32(_) => DType::F32,
            DeviceSliceMut::BF16(_) => DType::BF16,
            DeviceSliceMut::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            DeviceSliceMut::F32(v) => v.len(),
            DeviceSliceMut::BF16(v) => v.len(),
            DeviceSliceMut::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
