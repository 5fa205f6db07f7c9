//! The numeric modes of the device model and the 16-bit working copy of the weights that the
//! bf16 and f16 modes compute with.
//!
//! A mode is a [`DType`] (the workspace's one precision type): `F32` runs weights, activations
//! and gradients in f32 (TF32 off), the reference mode; `BF16` and `F16` keep activations and
//! the working weights in 16 bits with f32 accumulation, f32 master weights and f32 gradients
//! (`F16` needs the GradScaler's loss scaling: its gradients overflow to inf instead of
//! vanishing).
//!
//! A [`GpuLlama`](super::GpuLlama) is built for a set of precisions and runs one of them at a
//! time ([`GpuLlama::set_precision`](super::GpuLlama::set_precision)): the activation arena and
//! the attention workspace are sized for the widest, and one 2-byte working copy serves bf16
//! and f16 alike, re-cast from the fp32 master weights whenever the period's type changes.
//! Switching therefore allocates nothing and costs one cast of the weights.

use std::ffi::c_int;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView};
use half::{bf16, f16};
use tilearn_ops::DType;
use tilearn_ops::cuda::{CudaStream, DeviceFloat, cast_f32_to_bf16, cast_f32_to_f16, ffi};
use tilearn_optim::cuda::{ParamCopy, Rounding};

use super::layer_copy::{LayerCopy, LayerPlan};
use super::views::{arena_error, sub_mut};
use super::{GpuLlama, cuda_err, invalid};
use crate::error::Result;

/// The precision whose activations are `T`.
fn dtype_of<T: DeviceFloat>() -> DType {
    if T::DTYPE == ffi::TILEARN_DTYPE_BF16 as c_int {
        DType::BF16
    } else if T::DTYPE == ffi::TILEARN_DTYPE_F16 as c_int {
        DType::F16
    } else {
        DType::F32
    }
}

/// Runs `$body` with `$t` the element type of precision `$p` (a local type alias), so one
/// generic pass serves every mode.
macro_rules! with_elem {
    ($p:expr, $t:ident => $body:expr) => {
        match $p {
            ::tilearn_ops::DType::F32 => {
                type $t = f32;
                $body
            }
            ::tilearn_ops::DType::BF16 => {
                type $t = ::half::bf16;
                $body
            }
            ::tilearn_ops::DType::F16 => {
                type $t = ::half::f16;
                $body
            }
        }
    };
}
pub(crate) use with_elem;

/// A mutable view of 16-bit device data in its type.
pub enum HalfViewMut<'a> {
    Bf16(cudarc::driver::CudaViewMut<'a, bf16>),
    F16(cudarc::driver::CudaViewMut<'a, f16>),
}

/// The 16-bit copy of the fp32 master weights that bf16 and f16 periods compute with: whole
/// (the fused optimizer rewrites it in the period's type after every step) or per layer (each
/// pass casts the layers it runs, see `layer_copy.rs`).
#[derive(Debug)]
pub(crate) struct WorkingCopy {
    storage: Storage,
    numel: usize,
    /// The type it currently mirrors the master weights in; `None` when stale (the master
    /// weights changed without it, e.g. in an fp32 period).
    holds: Option<DType>,
}

#[derive(Debug)]
enum Storage {
    Whole(CudaSlice<u16>),
    PerLayer(LayerCopy),
}

impl WorkingCopy {
    /// The whole copy, `numel` elements.
    pub(crate) fn new(stream: &Arc<CudaStream>, numel: usize) -> Result<Self> {
        let buf = stream.alloc_zeros::<u16>(numel.max(1)).map_err(|e| {
            super::model_alloc_err("allocating the 16-bit working copy", 2 * numel, stream, e)
        })?;
        Ok(WorkingCopy {
            storage: Storage::Whole(buf),
            numel,
            holds: None,
        })
    }

    /// The per-layer copy of a model of `numel` parameters laid out as `plan` says.
    pub(crate) fn per_layer(
        stream: &Arc<CudaStream>,
        numel: usize,
        plan: LayerPlan,
    ) -> Result<Self> {
        Ok(WorkingCopy {
            storage: Storage::PerLayer(LayerCopy::new(stream, plan)?),
            numel,
            holds: None,
        })
    }

    pub(crate) fn is_per_layer(&self) -> bool {
        matches!(self.storage, Storage::PerLayer(_))
    }

    pub(crate) fn bytes(&self) -> usize {
        match &self.storage {
            Storage::Whole(buf) => buf.num_bytes(),
            Storage::PerLayer(copy) => copy.bytes(),
        }
    }

    /// The per-layer buffers, when that is the layout.
    pub(crate) fn layer_copy_mut(&mut self) -> Option<&mut LayerCopy> {
        match &mut self.storage {
            Storage::PerLayer(copy) => Some(copy),
            Storage::Whole(_) => None,
        }
    }

    /// The whole buffer, or an error naming `what` needs it.
    fn whole(&self, what: &str) -> Result<&CudaSlice<u16>> {
        match &self.storage {
            Storage::Whole(buf) => Ok(buf),
            Storage::PerLayer(_) => Err(per_layer_error(what)),
        }
    }

    fn whole_mut(&mut self, what: &str) -> Result<&mut CudaSlice<u16>> {
        match &mut self.storage {
            Storage::Whole(buf) => Ok(buf),
            Storage::PerLayer(_) => Err(per_layer_error(what)),
        }
    }

    /// The type it mirrors the master weights in (`None`: stale).
    pub(crate) fn holds(&self) -> Option<DType> {
        self.holds
    }

    /// Marks it stale: the master weights changed and it was not rewritten.
    pub(crate) fn invalidate(&mut self) {
        self.holds = None;
    }

    /// Makes it mirror `master` in `precision` (one cast unless it already does).
    pub(crate) fn refresh(
        &mut self,
        stream: &Arc<CudaStream>,
        master: &CudaSlice<f32>,
        precision: DType,
    ) -> Result<()> {
        if self.holds == Some(precision) {
            return Ok(());
        }
        if self.is_per_layer() {
            // Each pass casts what it runs from the master weights.
            self.holds = precision.is_half().then_some(precision);
            return Ok(());
        }
        let src = master.slice(..self.numel);
        match precision {
            DType::F32 => return Ok(()),
            DType::BF16 => cast_f32_to_bf16(stream, &src, &mut self.typed_mut::<bf16>()?)?,
            DType::F16 => cast_f32_to_f16(stream, &src, &mut self.typed_mut::<f16>()?)?,
        }
        self.holds = Some(precision);
        Ok(())
    }

    /// The copy as `T` (which it must currently hold).
    pub(crate) fn view<T: DeviceFloat>(&self) -> Result<CudaView<'_, T>> {
        if self.holds != Some(dtype_of::<T>()) || size_of::<T>() != 2 {
            return Err(arena_error(format!(
                "the working copy holds {:?}, not {}: set_precision refreshes it",
                self.holds,
                T::NAME
            )));
        }
        let buf = self.whole("a whole view of the working copy")?;
        // SAFETY: T is a 2-byte float type (checked above) for which any bit pattern is a
        // valid value; the buffer holds `numel` 2-byte elements and is borrowed for the
        // view's lifetime.
        unsafe { buf.transmute::<T>(self.numel) }
            .ok_or_else(|| arena_error("cannot view the working copy".into()))
    }

    fn typed_mut<T: DeviceFloat>(&mut self) -> Result<cudarc::driver::CudaViewMut<'_, T>> {
        let numel = self.numel;
        let buf = self.whole_mut("writing the whole working copy")?;
        // SAFETY: only called with bf16 / f16 (2 bytes, any bit pattern valid); the buffer
        // holds `numel` of them and is borrowed mutably for the view's lifetime.
        unsafe { buf.transmute_mut::<T>(numel) }
            .ok_or_else(|| arena_error("cannot view the working copy".into()))
    }

    /// The optimizer's output for elements `range` of it in `precision` (round to nearest;
    /// none in f32); call [`WorkingCopy::written_as`] once the step is queued.
    pub(crate) fn param_copy(
        &mut self,
        precision: DType,
        range: Range<usize>,
    ) -> Result<ParamCopy<'_>> {
        if self.is_per_layer() {
            // Nothing to rewrite: the next pass casts from the updated master weights.
            return Ok(ParamCopy::None);
        }
        let copy = match precision {
            DType::F32 => ParamCopy::None,
            DType::BF16 => ParamCopy::Bf16(
                sub_mut(self.typed_mut::<bf16>()?, range)?,
                Rounding::Nearest,
            ),
            DType::F16 => ParamCopy::F16(sub_mut(self.typed_mut::<f16>()?, range)?),
        };
        Ok(copy)
    }

    /// The whole copy in the type it holds (ZeRO all-gathers it after each rank's optimizer
    /// wrote its shard). Fails when it is stale.
    pub(crate) fn half_view_mut(&mut self) -> Result<HalfViewMut<'_>> {
        match self.holds {
            Some(DType::BF16) => Ok(HalfViewMut::Bf16(self.typed_mut::<bf16>()?)),
            Some(DType::F16) => Ok(HalfViewMut::F16(self.typed_mut::<f16>()?)),
            other => Err(arena_error(format!(
                "the working copy holds {other:?}; only a bf16 or f16 copy can be gathered"
            ))),
        }
    }

    /// Casts the f32 `source` (the whole model's weights) into it as `precision`.
    pub(crate) fn cast_from(
        &mut self,
        stream: &Arc<CudaStream>,
        source: &CudaView<'_, f32>,
        precision: DType,
    ) -> Result<()> {
        if self.is_per_layer() {
            // The whole weights are cast layer by layer from the master weights each pass.
            self.holds = precision.is_half().then_some(precision);
            return Ok(());
        }
        match precision {
            DType::F32 => return Ok(()),
            DType::BF16 => cast_f32_to_bf16(stream, source, &mut self.typed_mut::<bf16>()?)?,
            DType::F16 => cast_f32_to_f16(stream, source, &mut self.typed_mut::<f16>()?)?,
        }
        self.holds = Some(precision);
        Ok(())
    }

    /// Replaces it with the bf16 values whose bits `bits` holds (one per element; the lean
    /// mode's weights from the host step). Queued on `stream`; `bits`' own event keeps the
    /// host from rewriting it before the copy ran.
    pub(crate) fn upload_bf16_bits(
        &mut self,
        stream: &Arc<CudaStream>,
        bits: &cudarc::driver::PinnedHostSlice<u16>,
    ) -> Result<()> {
        let buf = self.whole_mut("the lean mode's weight upload")?;
        stream
            .memcpy_htod(bits, buf)
            .map_err(|e| cuda_err("uploading the bf16 weights", e))?;
        self.holds = Some(DType::BF16);
        Ok(())
    }

    /// Records that the optimizer rewrote it in `precision`.
    pub(crate) fn written_as(&mut self, precision: DType) {
        self.holds = precision.is_half().then_some(precision);
    }
}

fn per_layer_error(what: &str) -> crate::error::EngineError {
    arena_error(format!(
        "{what} needs the whole 16-bit working copy and this model keeps it per layer \
         (--weight-copy per-layer); use --weight-copy whole"
    ))
}

impl GpuLlama {
    /// Keeps the 16-bit working copy per layer (`true`: each pass casts the layers it runs
    /// from the master weights, see the module docs) or whole (`false`, as built). Set-up
    /// work: frees one layout before allocating the other, re-casts a whole copy, drops a
    /// recorded CUDA graph, and restarts the observed peak (the build's whole copy is gone).
    /// Refused for the lean mode (no master weights on the device) and under ZeRO's sharded
    /// master weights; a model without a 16-bit precision has no copy to lay out.
    pub fn set_per_layer_weights(&mut self, per_layer: bool) -> Result<()> {
        let Some(current) = self.work.as_ref() else {
            return match per_layer {
                true => Err(invalid(
                    "--weight-copy per-layer",
                    "this model runs f32 only and has no 16-bit weight copy".into(),
                )),
                false => Ok(()),
            };
        };
        if current.is_per_layer() == per_layer {
            return Ok(());
        }
        let plan = if per_layer {
            if self.is_lean() || self.master_shard.is_some() {
                return Err(invalid(
                    "--weight-copy per-layer",
                    "the fp32 master weights are not whole on this GPU (lean mode or ZeRO), \
                     so no layer can be cast from them; use --weight-copy whole"
                        .into(),
                ));
            }
            Some(LayerPlan::new(&self.layout).map_err(|why| {
                invalid(
                    "--weight-copy per-layer",
                    format!("{why}; use --weight-copy whole"),
                )
            })?)
        } else {
            None
        };
        let before = current.bytes();
        let stream = self.device.stream().clone();
        let numel = self.layout.numel;
        // The old layout's readers are queued on this stream; its memory returns to the pool
        // in stream order when dropped here, before the new one is taken.
        self.work = None;
        let mut work = match plan {
            Some(plan) => WorkingCopy::per_layer(&stream, numel, plan)?,
            None => WorkingCopy::new(&stream, numel)?,
        };
        work.refresh(&stream, &self.master, self.precision)?;
        let after = work.bytes();
        self.work = Some(work);
        self.graphs.invalidate();
        self.rebooked(|m| &mut m.working_copy_bytes, before, after)
    }

    /// Whether the 16-bit working copy is kept per layer (see
    /// [`GpuLlama::set_per_layer_weights`]).
    pub fn per_layer_weights(&self) -> bool {
        self.work.as_ref().is_some_and(WorkingCopy::is_per_layer)
    }
}
