//! One linear layer of a block on the device: `out = x · Wᵀ (+ b)` and its backward, the
//! weights read from the step's [`Weights`] and the gradients added into their ranges of the
//! flat f32 gradient buffer.

use cudarc::driver::{CudaView, CudaViewMut};
use tilearn_ops::cuda::DeviceFloat;

use super::cx::Cx;
use super::sink::GradParts;
use super::weights::Weights;
use crate::error::Result;
use crate::model::LinearLayout;

#[allow(clippy::too_many_arguments)]
pub(super) fn linear_fwd<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    w: &Weights<'_, T>,
    l: &LinearLayout,
    x: &CudaView<'_, T>,
    rows: usize,
    in_f: usize,
    out_f: usize,
    out: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let bias = l.bias.as_ref().map(|b| w.slice(b.clone())).transpose()?;
    cx.mm.linear_forward(
        cx.stream,
        x,
        &w.slice(l.weight.clone())?,
        bias.as_ref(),
        rows,
        in_f,
        out_f,
        out,
    )?;
    Ok(())
}

/// Backward of one linear layer: `dx =` (when asked), weight and bias gradients `+=` into
/// their ranges of the flat f32 gradient buffer (the weight's `=` where it is the first
/// product into an unzeroed buffer).
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_bwd<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    w: &Weights<'_, T>,
    g: &mut GradParts<'_>,
    l: &LinearLayout,
    dout: &CudaView<'_, T>,
    x: &CudaView<'_, T>,
    rows: usize,
    in_f: usize,
    out_f: usize,
    dx: Option<&mut CudaViewMut<'_, T>>,
) -> Result<()> {
    let weight = w.slice(l.weight.clone())?;
    // The product covers the whole weight gradient, so it may write it (see `GradParts::claim`).
    let dw_grad = g.claim(l.weight.clone())?;
    let (mut dw, mut db) = match &l.bias {
        Some(b) => {
            let (dw, db) = g.two(l.weight.clone(), b.clone())?;
            (dw, Some(db))
        }
        None => (g.range(l.weight.clone())?, None),
    };
    cx.mm.linear_backward(
        cx.stream,
        dout,
        x,
        &weight,
        rows,
        in_f,
        out_f,
        dx,
        (&mut dw, dw_grad),
        db.as_mut(),
    )?;
    Ok(())
}

/// Backward of a linear layer whose input gradient is added onto `dx` (`dx += dout·W`, one
/// rounding: see [`super::linalg::Matmul::linear_input_grad_add`]) rather than written: the
/// k and v projections onto q's, up onto gate's. Weight and bias gradients as [`linear_bwd`].
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_bwd_add_dx<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    w: &Weights<'_, T>,
    g: &mut GradParts<'_>,
    l: &LinearLayout,
    dout: &CudaView<'_, T>,
    x: &CudaView<'_, T>,
    rows: usize,
    in_f: usize,
    out_f: usize,
    dx: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    linear_bwd(cx, w, g, l, dout, x, rows, in_f, out_f, None)?;
    let weight = w.slice(l.weight.clone())?;
    cx.mm
        .linear_input_grad_add(cx.stream, dout, &weight, rows, in_f, out_f, dx)?;
    Ok(())
}
