//! The model's norm on the device, whichever kind the family uses: RMSNorm (with the residual
//! add fused into the same launch) or LayerNorm with bias (Bloom: the residual add, then the
//! norm, saving its means too). Same contract as the CPU engine's `model/norm.rs`.

use std::ops::Range;

use cudarc::driver::{CudaView, CudaViewMut};
use tilearn_ops::cuda::{self as k, DeviceFloat};

use super::cx::Cx;
use super::sink::GradParts;
use super::weights::Weights;
use crate::error::Result;

/// Where one norm's parameters lie: its weight and, for a LayerNorm, its bias.
#[derive(Clone)]
pub(crate) struct NormAt {
    pub weight: Range<usize>,
    pub bias: Option<Range<usize>>,
}

/// `out = norm(x)`, saving `rstd` (and `mean` for a LayerNorm).
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_fwd<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    eps: f64,
    c: usize,
    w: &Weights<'_, T>,
    at: &NormAt,
    x: &CudaView<'_, T>,
    out: &mut CudaViewMut<'_, T>,
    mean: &mut CudaViewMut<'_, f32>,
    rstd: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let weight = w.slice(at.weight.clone())?;
    match &at.bias {
        None => k::rmsnorm_forward(cx.stream, x, &weight, c, eps, out, rstd)?,
        Some(b) => {
            let bias = w.slice(b.clone())?;
            k::layernorm_forward(cx.stream, x, &weight, &bias, c, eps, out, mean, rstd)?
        }
    }
    Ok(())
}

/// `acc += other`, then `out = norm(acc)` (one launch for RMSNorm).
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_norm_fwd<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    eps: f64,
    c: usize,
    w: &Weights<'_, T>,
    at: &NormAt,
    acc: &mut CudaViewMut<'_, T>,
    other: &CudaView<'_, T>,
    out: &mut CudaViewMut<'_, T>,
    mean: &mut CudaViewMut<'_, f32>,
    rstd: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let weight = w.slice(at.weight.clone())?;
    match &at.bias {
        None => k::add_rmsnorm_forward(cx.stream, acc, other, &weight, c, eps, out, rstd)?,
        Some(_) => {
            k::residual_add_inplace(cx.stream, acc, other)?;
            norm_fwd(cx, eps, c, w, at, &acc.as_view(), out, mean, rstd)?;
        }
    }
    Ok(())
}

/// `dres += d(norm)/d(x)ᵀ dxn`, the weight's (and bias's) gradient added into `g`; `dtmp` is
/// scratch for the LayerNorm's written input gradient.
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_bwd_add<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    c: usize,
    w: &Weights<'_, T>,
    g: &mut GradParts<'_>,
    at: &NormAt,
    dxn: &CudaViewMut<'_, T>,
    x: &CudaView<'_, T>,
    mean: &CudaViewMut<'_, f32>,
    rstd: &CudaViewMut<'_, f32>,
    dres: &mut CudaViewMut<'_, T>,
    dtmp: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let weight = w.slice(at.weight.clone())?;
    match &at.bias {
        None => {
            let mut dw = g.range(at.weight.clone())?;
            k::rmsnorm_backward_add(
                cx.stream,
                dxn,
                x,
                &weight,
                rstd,
                c,
                dres,
                &mut dw,
                cx.norm_scratch,
            )?;
        }
        Some(b) => {
            let (mut dw, mut db) = ordered_pair(g, at.weight.clone(), b.clone())?;
            let scratch = cx.ln_scratch.as_deref_mut().ok_or_else(|| {
                super::views::arena_error("a LayerNorm model was built without its scratch".into())
            })?;
            k::layernorm_backward(
                cx.stream, dxn, x, &weight, mean, rstd, c, dtmp, &mut dw, &mut db, scratch,
            )?;
            k::residual_add_inplace(cx.stream, dres, dtmp)?;
        }
    }
    Ok(())
}

/// `dx = d(norm)/d(x)ᵀ dxn` (written), the weight's (and bias's) gradient added into `g`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn norm_bwd<T: DeviceFloat>(
    cx: &mut Cx<'_>,
    c: usize,
    w: &Weights<'_, T>,
    g: &mut GradParts<'_>,
    at: &NormAt,
    dxn: &CudaViewMut<'_, T>,
    x: &CudaView<'_, T>,
    mean: &CudaViewMut<'_, f32>,
    rstd: &CudaViewMut<'_, f32>,
    dx: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let weight = w.slice(at.weight.clone())?;
    match &at.bias {
        None => {
            let mut dw = g.range(at.weight.clone())?;
            k::rmsnorm_backward(
                cx.stream,
                dxn,
                x,
                &weight,
                rstd,
                c,
                dx,
                &mut dw,
                cx.norm_scratch,
            )?;
        }
        Some(b) => {
            let (mut dw, mut db) = ordered_pair(g, at.weight.clone(), b.clone())?;
            let scratch = cx.ln_scratch.as_deref_mut().ok_or_else(|| {
                super::views::arena_error("a LayerNorm model was built without its scratch".into())
            })?;
            k::layernorm_backward(
                cx.stream, dxn, x, &weight, mean, rstd, c, dx, &mut dw, &mut db, scratch,
            )?;
        }
    }
    Ok(())
}

/// The weight's and the bias's gradient ranges as two views, whichever comes first.
fn ordered_pair<'b>(
    g: &'b mut GradParts<'_>,
    weight: Range<usize>,
    bias: Range<usize>,
) -> Result<(CudaViewMut<'b, f32>, CudaViewMut<'b, f32>)> {
    if weight.end <= bias.start {
        g.two(weight, bias)
    } else {
        let (db, dw) = g.two(bias, weight)?;
        Ok((dw, db))
    }
}
