//! Flat typed buffers, the unit every collective works on: a host slice or (with `cuda`) a device
//! view of f32, bf16 or f16 elements. Buckets of a flat gradient buffer are sub-slices or
//! sub-views of it, so a collective on a bucket copies nothing.

use half::{bf16, f16};
use tilearn_ops::DType;

/// An element type the communicators move and reduce. Half types are reduced in f32.
pub trait CommElement: bytemuck::Pod + Send + Sync + 'static {
    /// The workspace's name for this type.
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
    /// This slice as the typed host slice of its dtype.
    fn host(slice: &[Self]) -> HostSlice<'_>;
    /// This slice as the typed mutable host slice of its dtype.
    fn host_mut(slice: &mut [Self]) -> HostSliceMut<'_>;
    /// This device view as the typed device buffer of its dtype.
    #[cfg(feature = "cuda")]
    fn device_mut(view: cudarc::driver::CudaViewMut<'_, Self>)
    -> crate::device::DeviceSliceMut<'_>;
}

macro_rules! comm_element {
    ($t:ty, $dtype:ident, $to:expr, $from:expr) => {
        impl CommElement for $t {
            const DTYPE: DType = DType::$dtype;
            fn to_f32(self) -> f32 {
                $to(self)
            }
            fn from_f32(value: f32) -> Self {
                $from(value)
            }
            fn host(slice: &[Self]) -> HostSlice<'_> {
                HostSlice::$dtype(slice)
            }
            fn host_mut(slice: &mut [Self]) -> HostSliceMut<'_> {
                HostSliceMut::$dtype(slice)
            }
            #[cfg(feature = "cuda")]
            fn device_mut(
                view: cudarc::driver::CudaViewMut<'_, Self>,
            ) -> crate::device::DeviceSliceMut<'_> {
                crate::device::DeviceSliceMut::$dtype(view)
            }
        }
    };
}

comm_element!(f32, F32, |x: f32| x, |x: f32| x);
comm_element!(bf16, BF16, bf16::to_f32, bf16::from_f32);
comm_element!(f16, F16, f16::to_f32, f16::from_f32);

/// A read-only host slice of one of the communicated dtypes.
#[derive(Debug, Clone, Copy)]
pub enum HostSlice<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
}

/// A mutable host slice of one of the communicated dtypes.
#[derive(Debug)]
pub enum HostSliceMut<'a> {
    F32(&'a mut [f32]),
    BF16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

impl HostSlice<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            HostSlice::F32(_) => DType::F32,
            HostSlice::BF16(_) => DType::BF16,
            HostSlice::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        self.as_bytes().len() / self.dtype().size_in_bytes()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements' bytes (little-endian on every platform tilearn runs on).
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostSlice::F32(s) => bytemuck::cast_slice(s),
            HostSlice::BF16(s) => bytemuck::cast_slice(s),
            HostSlice::F16(s) => bytemuck::cast_slice(s),
        }
    }
}

impl<'a> HostSliceMut<'a> {
    pub fn dtype(&self) -> DType {
        match self {
            HostSliceMut::F32(_) => DType::F32,
            HostSliceMut::BF16(_) => DType::BF16,
            HostSliceMut::F16(_) => DType::F16,
        }
    }

    pub fn len(&self) -> usize {
        self.as_bytes().len() / self.dtype().size_in_bytes()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_bytes(&self) -> &[u8] {
        match self {
            HostSliceMut::F32(s) => bytemuck::cast_slice(s),
            HostSliceMut::BF16(s) => bytemuck::cast_slice(s),
            HostSliceMut::F16(s) => bytemuck::cast_slice(s),
        }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            HostSliceMut::F32(s) => bytemuck::cast_slice_mut(s),
            HostSliceMut::BF16(s) => bytemuck::cast_slice_mut(s),
            HostSliceMut::F16(s) => bytemuck::cast_slice_mut(s),
        }
    }

    /// A shorter-lived handle to the same elements (to use the buffer again afterwards).
    pub fn reborrow(&mut self) -> HostSliceMut<'_> {
        match self {
            HostSliceMut::F32(s) => HostSliceMut::F32(s),
            HostSliceMut::BF16(s) => HostSliceMut::BF16(s),
            HostSliceMut::F16(s) => HostSliceMut::F16(s),
        }
    }

    /// The elements `range` as a host slice of the same dtype.
    pub fn sub(&mut self, range: std::ops::Range<usize>) -> HostSliceMut<'_> {
        match self {
            HostSliceMut::F32(s) => HostSliceMut::F32(&mut s[range]),
            HostSliceMut::BF16(s) => HostSliceMut::BF16(&mut s[range]),
            HostSliceMut::F16(s) => HostSliceMut::F16(&mut s[range]),
        }
    }

    /// Widens every element to f32 (the accumulation type of reductions).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            HostSliceMut::F32(s) => s.to_vec(),
            HostSliceMut::BF16(s) => s.iter().map(|x| x.to_f32()).collect(),
            HostSliceMut::F16(s) => s.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// Writes `values` (f32) into the elements starting at `offset`, rounding once to the dtype.
    pub fn store_f32(&mut self, offset: usize, values: &[f32]) {
        fn store<T: CommElement>(dst: &mut [T], values: &[f32]) {
            for (d, &v) in dst.iter_mut().zip(values) {
                *d = T::from_f32(v);
            }
        }
        let range = offset..offset + values.len();
        match self {
            HostSliceMut::F32(s) => s[range].copy_from_slice(values),
            HostSliceMut::BF16(s) => store(&mut s[range], values),
            HostSliceMut::F16(s) => store(&mut s[range], values),
        }
    }
}

/// The read-only input of a point-to-point send.
#[derive(Debug)]
pub enum Buffer<'a> {
    Host(HostSlice<'a>),
    #[cfg(feature = "cuda")]
    Device(crate::device::DeviceSlice<'a>),
}

/// The buffer a collective reads and writes in place.
#[derive(Debug)]
pub enum BufferMut<'a> {
    Host(HostSliceMut<'a>),
    #[cfg(feature = "cuda")]
    Device(crate::device::DeviceSliceMut<'a>),
}

impl Buffer<'_> {
    /// Whether the elements live in host memory (else on a GPU).
    pub fn is_host(&self) -> bool {
        matches!(self, Buffer::Host(_))
    }

    pub fn dtype(&self) -> DType {
        match self {
            Buffer::Host(h) => h.dtype(),
            #[cfg(feature = "cuda")]
            Buffer::Device(d) => d.dtype(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Buffer::Host(h) => h.len(),
            #[cfg(feature = "cuda")]
            Buffer::Device(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl BufferMut<'_> {
    /// Whether the elements live in host memory (else on a GPU).
    pub fn is_host(&self) -> bool {
        matches!(self, BufferMut::Host(_))
    }

    pub fn dtype(&self) -> DType {
        match self {
            BufferMut::Host(h) => h.dtype(),
            #[cfg(feature = "cuda")]
            BufferMut::Device(d) => d.dtype(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            BufferMut::Host(h) => h.len(),
            #[cfg(feature = "cuda")]
            BufferMut::Device(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a, T: CommElement> From<&'a [T]> for Buffer<'a> {
    fn from(slice: &'a [T]) -> Self {
        Buffer::Host(T::host(slice))
    }
}

impl<'a, T: CommElement> From<&'a mut [T]> for BufferMut<'a> {
    fn from(slice: &'a mut [T]) -> Self {
        BufferMut::Host(T::host_mut(slice))
    }
}

impl<'a, T: CommElement> From<&'a mut Vec<T>> for BufferMut<'a> {
    fn from(vec: &'a mut Vec<T>) -> Self {
        BufferMut::Host(T::host_mut(vec))
    }
}

impl<'a> From<HostSliceMut<'a>> for BufferMut<'a> {
    fn from(slice: HostSliceMut<'a>) -> Self {
        BufferMut::Host(slice)
    }
}

#[cfg(feature = "cuda")]
mod device_conversions {
    use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
    use half::{bf16, f16};

    use super::{Buffer, BufferMut, CommElement};

    impl<'a, T: CommElement> From<CudaViewMut<'a, T>> for BufferMut<'a> {
        fn from(view: CudaViewMut<'a, T>) -> Self {
            BufferMut::Device(T::device_mut(view))
        }
    }

    impl<'a, T: CommElement> From<&'a mut CudaSlice<T>> for BufferMut<'a> {
        fn from(slice: &'a mut CudaSlice<T>) -> Self {
            BufferMut::Device(T::device_mut(slice.as_view_mut()))
        }
    }

    impl<'a> From<CudaView<'a, f32>> for Buffer<'a> {
        fn from(view: CudaView<'a, f32>) -> Self {
            Buffer::Device(crate::device::DeviceSlice::F32(view))
        }
    }

    impl<'a> From<CudaView<'a, bf16>> for Buffer<'a> {
        fn from(view: CudaView<'a, bf16>) -> Self {
            Buffer::Device(crate::device::DeviceSlice::BF16(view))
        }
    }

    impl<'a> From<CudaView<'a, f16>> for Buffer<'a> {
        fn from(view: CudaView<'a, f16>) -> Self {
            Buffer::Device(crate::device::DeviceSlice::F16(view))
        }
    }
}
