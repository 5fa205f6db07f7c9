//! Wrappers of tilearn-kernels' `z_loss.cu`: Baichuan2's z-loss around the fused cross entropy.
//! Same contract as [`crate::cpu::z_loss_rows`] and [`crate::cpu::z_loss_apply`], except that
//! the loss terms are added into the per-row losses (`row_loss`, f32) that the cross entropy's
//! totals then reduce.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use tilearn_kernels::ffi;

use super::dtype::DeviceFloat;
use super::launch::Launch;
use crate::shape::expect_product;
use crate::{OpsError, Result};

/// Per-row maxima and their positions between [`z_loss_rows`] and [`z_loss_apply`], allocated
/// once for up to `rows` rows.
#[derive(Debug)]
pub struct ZLossScratch {
    max: CudaSlice<f32>,
    arg: CudaSlice<i32>,
}

impl ZLossScratch {
    /// Buffers for calls of up to `rows` rows.
    pub fn new(stream: &Arc<CudaStream>, rows: usize) -> Result<Self> {
        let alloc_err = |e: cudarc::driver::DriverError| OpsError::Cuda {
            context: "ZLossScratch::new",
            message: e.to_string(),
        };
        Ok(ZLossScratch {
            max: stream.alloc_zeros(rows.max(1)).map_err(alloc_err)?,
            arg: stream.alloc_zeros(rows.max(1)).map_err(alloc_err)?,
        })
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.max.len() * 4 + self.arg.len() * 4
    }

    fn check_rows(&self, op: &'static str, rows: usize) -> Result<()> {
        if rows > self.max.len() {
            return Err(OpsError::Cuda {
                context: op,
                message: format!(
                    "{rows} rows exceed the scratch built for {}; build ZLossScratch for the \
                     largest call",
                    self.max.len()
                ),
            });
        }
        Ok(())
    }
}

/// Where [`z_loss_apply`] takes the gradient factor from.
pub enum ZLossScale<'a, D: ?Sized> {
    /// A kernel argument.
    Host(f32),
    /// One f32 in device memory, read by the kernel (CUDA graph replays).
    Device(&'a D),
}

/// Reads, for the rows of `logits` (`[targets.len(), vocab]`) whose target is not `-100`, the
/// max and its first position into `scratch` (before the fused cross entropy overwrites them).
pub fn z_loss_rows<T: DeviceFloat>(
    stream: &Arc<CudaStream>,
    logits: &impl DevicePtr<T>,
    targets: &impl DevicePtr<i32>,
    vocab: usize,
    scratch: &mut ZLossScratch,
) -> Result<()> {
    const OP: &str = "tilearn_z_loss_rows";
    let rows = targets.len();
    expect_product(OP, &[rows, vocab], logits.len())?;
    scratch.check_rows(OP, rows)?;
    let ZLossScratch { max, arg } = scratch;
    let (mut max, mut arg) = (max.slice_mut(..rows), arg.slice_mut(..rows));
    Launch::new(OP, stream)
        .input("logits", logits, rows * vocab)
        .input("targets", targets, rows)
        .output("max", &mut max, rows)
        .output("arg", &mut arg, rows)
        .skip_launch_if(rows == 0)
        .run(|[logits, targets], [max, arg], stream| {
            // SAFETY: the launcher reads rows * vocab elements of T (`T::DTYPE`) of logits and
            // rows i32 targets, and writes rows f32 of max and rows i32 of arg.
            unsafe {
                ffi::tilearn_z_loss_rows(
                    T::DTYPE,
                    logits,
                    targets.cast(),
                    rows,
                    vocab,
                    max.cast(),
                    arg.cast(),
                    stream,
                )
            }
        })
}

/// After the cross entropy: `row_loss[r] += weight · max²` and, with `dlogits` (the fused cross
/// entropy's gradient `[rows, vocab]`), `dlogits[r, arg] += scale · weight · 2 · max` for the
/// rows [`z_loss_rows`] found (`rows = row_loss.len()`).
pub fn z_loss_apply<T: DeviceFloat, D: DevicePtr<f32>, G: DevicePtrMut<T>>(
    stream: &Arc<CudaStream>,
    scratch: &ZLossScratch,
    vocab: usize,
    weight: f32,
    scale: ZLossScale<'_, D>,
    row_loss: &mut impl DevicePtrMut<f32>,
    dlogits: Option<&mut G>,
) -> Result<()> {
    const OP: &str = "tilearn_z_loss_apply";
    let rows = row_loss.len();
    scratch.check_rows(OP, rows)?;
    if let Some(d) = dlogits.as_deref() {
        expect_product(OP, &[rows, vocab], d.len())?;
    }
    let (host_scale, dev_scale) = match scale {
        ZLossScale::Host(s) => (s, None),
        ZLossScale::Device(d) => (0.0, Some(d)),
    };
    let max = scratch.max.slice(..rows);
    let arg = scratch.arg.slice(..rows);
    let launch = Launch::new(OP, stream)
        .input("max", &max, rows)
        .input("arg", &arg, rows)
        .optional_input("grad_scale", dev_scale, 1)
        .output("row_loss", row_loss, rows)
        .skip_launch_if(rows == 0);
    match dlogits {
        Some(d) => launch.output("dlogits", d, rows * vocab).run(
            |[max, arg, dev_scale], [row_loss, dlogits], stream| {
                // SAFETY: the launcher reads rows f32 of max and rows i32 of arg (each arg in
                // -1..vocab, written by z_loss_rows for the same logits), one f32 of
                // dev_scale when it is not null, and adds into rows f32 of row_loss and at most
                // one element of T (`T::DTYPE`) per row of the rows * vocab of dlogits.
                unsafe {
                    ffi::tilearn_z_loss_apply(
                        T::DTYPE,
                        max.cast(),
                        arg.cast(),
                        rows,
                        vocab,
                        weight,
                        host_scale,
                        dev_scale.cast(),
                        row_loss.cast(),
                        dlogits,
                        stream,
                    )
                }
            },
        ),
        None => launch.run(|[max, arg, dev_scale], [row_loss], stream| {
            // SAFETY: as above, without dlogits (null: the launcher only adds the loss terms).
            unsafe {
                ffi::tilearn_z_loss_apply(
                    T::DTYPE,
                    max.cast(),
                    arg.cast(),
                    rows,
                    vocab,
                    weight,
                    host_scale,
                    dev_scale.cast(),
                    row_loss.cast(),
                    std::ptr::null_mut(),
                    stream,
                )
            }
        }),
    }
}
